"""logit_dp.make_private: σ, C, q, T, noise placement, sampler and ledger agree."""

import itertools
import logging
import math
import warnings

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import logit_dp
from conftest import make_model
from logit_dp import models

N, BATCH, EPS, DELTA = 400, 20, 3.0, 1e-5


def _embed():
  model = models.MLPEmbedding(embedding_dim=4, hidden=(8,))
  params = model.init(jax.random.key(0), jnp.zeros((1, 6)))
  return model.apply, params


def _setup(**kwargs):
  embed_fn, _ = _embed()
  args = dict(target_epsilon=EPS, target_delta=DELTA, num_records=N, expected_batch_size=BATCH,
              optimizer=optax.sgd(0.1), steps=50)
  args.update(kwargs)
  return logit_dp.make_private(embed_fn, logit_dp.losses.contrastive(temperature=1.0), 1.0, **args)


def _recorder(lr=0.25):
  """An 'optimizer' that returns −lr·u and keeps the u it was given in its state."""
  def init(params):
    return jax.tree_util.tree_map(jnp.zeros_like, params)

  def update(updates, state, params=None):
    del state, params
    return jax.tree_util.tree_map(lambda u: -lr * u, updates), updates

  return optax.GradientTransformation(init, update)


def _dp_accounting_epsilon(sigma, q, steps, delta):
  """ε from a fresh dp_accounting PLD accountant, built here independently of the library."""
  acc = dp_accounting.pld.PLDAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
      value_discretization_interval=1e-3)
  acc.compose(
      dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
  return acc.get_epsilon(delta)


@pytest.mark.parametrize("kwargs,steps",
                         [(dict(steps=50), 50),
                          pytest.param(dict(steps=None, epochs=3), 60, marks=pytest.mark.slow)])
def test_sigma_q_steps_and_ledger_match_the_accountant(kwargs, steps):
  pt = _setup(**kwargs)
  q = BATCH / N
  assert pt.sampling_rate == q and pt.steps == steps
  # σ is calibrated at δ minus the padded batches' overflow term (1 + e^ε)·(1 − (1 − p)^T),
  # p = P[Binomial(N + 1, q) > max_batch_size] (≈ T·p here: p ≤ 1e-12).
  p_over = stats.binom.sf(pt.sampler.max_batch_size, N + 1, q)
  delta_acc = DELTA - (1 + math.exp(EPS)) * steps * p_over
  led = pt.ledger
  assert led.target_delta == pytest.approx(delta_acc, rel=1e-9, abs=0)
  assert pt.noise_multiplier == logit_dp.accounting.noise_multiplier(EPS, led.target_delta, q,
                                                                     steps)
  # Independently: the calibrated σ meets the target, 1 % less noise would not.
  assert _dp_accounting_epsilon(pt.noise_multiplier, q, steps, led.target_delta) <= EPS
  assert _dp_accounting_epsilon(0.99 * pt.noise_multiplier, q, steps, led.target_delta) > EPS
  # Sampler and ledger: same q, same N, same σ, budgets (ε, δ), no steps yet.
  assert pt.sampler.sampling_rate == q and pt.sampler.num_records == N
  assert pt.sampler.expected_batch_size == pytest.approx(BATCH)
  assert (led.noise_multiplier, led.sampling_rate) == (pt.noise_multiplier, q)
  assert led.steps == 0 and led.epsilon_budget == EPS and led.num_examples == N
  assert led.delta_budget == DELTA
  assert led.overflow_probability == pt.sampler.step_overflow_probability
  assert led.remaining_steps() >= steps
  eps_t = led.record_steps(steps)
  assert led.steps == steps
  assert eps_t == pytest.approx(
      _dp_accounting_epsilon(pt.noise_multiplier, q, steps, led.target_delta), rel=1e-12)
  assert eps_t <= EPS and led.delta() <= DELTA


def test_rdp_accountant_is_used_for_sigma_and_ledger():
  pt = _setup(accountant="rdp")
  q = BATCH / N
  assert pt.noise_multiplier == logit_dp.accounting.noise_multiplier(EPS, pt.ledger.target_delta, q,
                                                                     50, accountant="rdp")
  assert pt.ledger.accountant == "rdp" and pt.ledger.target_delta <= DELTA


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sensitivity_is_the_supremum_over_batch_sizes(temperature):
  embed_fn, _ = _embed()
  loss = logit_dp.losses.contrastive(temperature=temperature)
  pt = logit_dp.make_private(embed_fn, loss, 0.7, target_epsilon=EPS, target_delta=DELTA,
                             num_records=N, expected_batch_size=BATCH, optimizer=optax.sgd(0.1),
                             steps=10)
  assert pt.sensitivity == logit_dp.sensitivity(loss, 0.7, batch_size=None)
  # The closed form: 2(1 + e^{2/τ})/τ · B.
  assert pt.sensitivity == pytest.approx(2 * (1 + math.exp(2 / temperature)) / temperature * 0.7,
                                         rel=1e-12)
  assert pt.clip_norm == 0.7


def test_naive_method_uses_naive_gradient_and_sensitivity():
  embed_fn, params = _embed()
  loss = logit_dp.losses.contrastive(temperature=1.0)
  pt = _setup(method="naive")
  assert pt.sensitivity == logit_dp.baselines.naive_sensitivity(1.0) == 2.0
  x = jax.random.normal(jax.random.key(1), (6, 6))
  xp = x + 0.1 * jax.random.normal(jax.random.key(2), (6, 6))
  mask = jnp.array([True] * 5 + [False])
  want = logit_dp.baselines.naive_clipped_grad(embed_fn, loss, 1.0)(params, x, xp, mask)
  got = pt.grad_fn(params, x, xp, mask)
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


# The default run keeps one case that passes both a non-default method and a microbatch size
# (each case compiles a conv net's gradient twice); the others are slow.
@pytest.mark.parametrize("method,microbatch_size", [
    pytest.param("ghost", None, marks=pytest.mark.slow),
    pytest.param("ghost", 2, marks=pytest.mark.slow),
    ("triangle", 2),
    pytest.param("materialize", 3, marks=pytest.mark.slow),
])
def test_grad_fn_is_clipped_grad_with_method_and_microbatch(method, microbatch_size):
  # A conv net: clipped_grad(microbatch_size=m) currently fails on nets of Dense layers only
  # (a zero-size leaf reshaped with -1 in chunking.unchunk_rows), not make_private's concern.
  embed_fn, params, x, xp = make_model("conv", n=6)
  loss = logit_dp.losses.contrastive(temperature=1.0)
  pt = logit_dp.make_private(embed_fn, loss, 1.0, target_epsilon=EPS, target_delta=DELTA,
                             num_records=N, expected_batch_size=BATCH, optimizer=optax.sgd(0.1),
                             steps=10, method=method, microbatch_size=microbatch_size)
  want = logit_dp.clipped_grad(embed_fn, loss, 1.0, method=method,
                               microbatch_size=microbatch_size)(params, x, xp)
  jax.tree_util.tree_map(np.testing.assert_array_equal, pt.grad_fn(params, x, xp), want)


def _chi2_statistic(pt, mean, grads):
  """Σ z² over the k coordinates, z = (optimizer input · scale − ḡ)/(σC): χ²(k) if correct."""
  state = pt.optimizer.init(grads)
  out, state = pt.optimizer.update(grads, state, grads)
  seen = state[-1]  # what the optimizer was given
  scale = BATCH if mean else 1.0
  # The optimizer comes last: its output is −lr × its input, nothing added after it.
  jax.tree_util.tree_map(lambda o, s: np.testing.assert_array_equal(o, -0.25 * s), out, seen)
  z = np.concatenate([
      ((np.asarray(s, np.float64) * scale - np.asarray(g, np.float64)) /
       (pt.noise_multiplier * pt.sensitivity)).ravel()
      for s, g in zip(jax.tree_util.tree_leaves(seen), jax.tree_util.tree_leaves(grads))
  ])
  return float(np.sum(z * z)), z.size


@pytest.mark.parametrize("mean", [False, True])
def test_noise_of_std_sigma_c_is_added_before_the_optimizer(mean):
  grads = {"w": jnp.full((500, 300), 3.0), "b": jnp.arange(100, dtype=jnp.float32)}
  pt = _setup(optimizer=_recorder(), mean=mean, noise_key=jax.random.key(7))
  stat, k = _chi2_statistic(pt, mean, grads)
  # Two-sided χ²(k) test at level 2e-9; with k = 150,100 a noise std off by 2 % (11 sd of
  # the statistic) is rejected.
  lo, hi = stats.chi2.ppf(1e-9, k), stats.chi2.isf(1e-9, k)
  assert lo < stat < hi, (stat, k)
  assert not lo < stat * 1.02 ** 2 < hi and not lo < stat / 1.02 ** 2 < hi


def test_mean_scales_after_the_noise():
  grads = {"w": jnp.zeros((20_000,))}
  plain = _setup(optimizer=_recorder(), noise_key=jax.random.key(3))
  mean = _setup(optimizer=_recorder(), mean=True, noise_key=jax.random.key(3))
  seen = [p.optimizer.update(grads, p.optimizer.init(grads))[1][-1]["w"] for p in (plain, mean)]
  # Same key, same noise: the mean chain hands the optimizer exactly noisy_sum / E[n].
  np.testing.assert_allclose(np.asarray(seen[1]), np.asarray(seen[0]) / BATCH, rtol=1e-6)
  assert np.std(np.asarray(seen[1])) == pytest.approx(
      mean.noise_multiplier * mean.sensitivity / BATCH, rel=0.03)


def test_noise_key_and_sampler_seed_are_secret_by_default():
  grads = {"w": jnp.zeros((64,))}
  a, b = _setup(), _setup()
  assert a.sampler.seed != b.sampler.seed  # drawn with `secrets`: equal w.p. 2⁻⁶³
  assert a.sampler.seed != 0  # not PoissonSampler's default
  noise = [p.optimizer.update(grads, p.optimizer.init(grads))[0]["w"] for p in (a, b)]
  assert not np.array_equal(noise[0], noise[1])
  # Fixed on purpose: reproducible.
  c, d = (_setup(noise_key=jax.random.key(5), sampler_seed=11) for _ in range(2))
  assert c.sampler.seed == d.sampler.seed == 11
  np.testing.assert_array_equal(
      *[p.optimizer.update(grads, p.optimizer.init(grads))[0]["w"] for p in (c, d)])
  np.testing.assert_array_equal(c.sampler(3).indices, d.sampler(3).indices)


@pytest.mark.parametrize("kwargs,match", [
    (dict(epochs=2), "exactly one of epochs and steps"),
    (dict(steps=None), "exactly one of epochs and steps"),
    (dict(method="exact"), "method must be one of"),
    (dict(optimizer=0.1), "optax.GradientTransformation"),
    (dict(mean=1), "mean must be True or False"),
    (dict(target_epsilon=0.0), "target_epsilon"),
    (dict(target_delta=1.0), "target_delta"),
    (dict(num_records=0), "num_records"),
    (dict(expected_batch_size=N + 1), "expected_batch_size"),
    (dict(sampler_seed=-1), "sampler_seed"),
    (dict(noise_key=3), "key must be a JAX PRNG key"),
    (dict(steps=0), "steps must be an integer"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _setup(**kwargs)


def test_infinite_clip_norm_is_refused():
  embed_fn, _ = _embed()
  with pytest.raises(ValueError, match="clip_norm=inf"):
    logit_dp.make_private(embed_fn, logit_dp.losses.spreadout(), math.inf, target_epsilon=EPS,
                          target_delta=DELTA, num_records=N, expected_batch_size=BATCH,
                          optimizer=optax.sgd(0.1), steps=5)


def test_large_delta_warns_once():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _setup(target_delta=1 / N)
  assert sum("target_delta=" in str(w.message) for w in caught) == 1


@pytest.mark.slow  # a second tiny training loop (test_experiments keeps one by default)
def test_end_to_end_training_run():
  """A few private steps on two clusters: the loop of the README's make_private section."""
  embed_fn, params = _embed()
  rng = np.random.default_rng(0)
  centres = rng.normal(size=(2, 6)).astype(np.float32) * 3
  labels = rng.integers(0, 2, size=N)
  x = jnp.asarray(centres[labels] + rng.normal(size=(N, 6)).astype(np.float32))
  x_prime = jnp.asarray(centres[labels] + rng.normal(size=(N, 6)).astype(np.float32))
  pt = _setup(optimizer=optax.adam(1e-2), mean=True, steps=8)
  opt_state = pt.optimizer.init(params)

  @jax.jit
  def step(params, opt_state, idx, mask):
    loss_value, grads = pt.grad_fn(params, x[idx], x_prime[idx], mask)
    updates, opt_state = pt.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss_value

  start = params
  for t in range(pt.steps):
    batch = pt.sampler(t)
    pt.ledger.record_steps(1)
    params, opt_state, loss_value = step(params, opt_state, batch.indices, batch.mask)
    assert np.isfinite(float(loss_value))
  assert pt.ledger.steps == pt.steps == 8
  eps, delta = pt.ledger.guarantee()
  assert eps <= EPS and pt.ledger.target_delta < delta <= DELTA  # overflow term included
  assert int(opt_state[0].count) == 8  # the noise transform ran at every step
  moved = jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), params, start)
  assert all(np.isfinite(v) and v > 0 for v in jax.tree_util.tree_leaves(moved))


# -- Accounting by construction: batches(), the budgeted sampler, make_train_step. ----------


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, 6)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(x + 0.1 * rng.normal(size=(N, 6)).astype(np.float32))


def _allowed_steps(pt):
  """The most steps within the budget, from dp_accounting itself (not the ledger)."""
  k = 0
  while _dp_accounting_epsilon(pt.noise_multiplier, pt.sampling_rate, k + 1,
                               pt.ledger.target_delta) <= EPS:
    k += 1
  return k


def test_batches_record_each_step_first_and_stop_at_the_budget():
  pt = _setup(steps=4)
  allowed = _allowed_steps(pt)
  assert 4 <= allowed < 12
  seen = []
  with pytest.raises(logit_dp.ledger.PrivacyBudgetExceededError, match="would spend"):
    for batch in pt.batches(12):  # asks for 12 steps of a run calibrated for 4
      seen.append(np.asarray(batch.indices))
      # Recorded before the batch is handed out.
      assert pt.ledger.steps == len(seen)
  assert len(seen) == pt.ledger.steps == allowed
  eps, delta = pt.ledger.guarantee()
  assert eps == pytest.approx(
      _dp_accounting_epsilon(pt.noise_multiplier, pt.sampling_rate, allowed,
                             pt.ledger.target_delta), rel=1e-12)
  assert eps <= EPS and delta <= DELTA
  # The batches are the plain Poisson sampler's of steps 0, 1, …
  for t, idx in enumerate(seen):
    np.testing.assert_array_equal(idx, pt.sampler.unbudgeted()(t).indices)


def test_batches_default_to_the_planned_steps_and_continue_where_the_ledger_stands():
  pt = _setup(steps=4)
  first = [b.indices for b in itertools.islice(pt.batches(), 2)]
  assert pt.ledger.steps == 2
  rest = [b.indices for b in pt.batches()]
  assert len(first) + len(rest) == 4 and pt.ledger.steps == pt.steps == 4
  np.testing.assert_array_equal(rest[0], pt.sampler(2).indices)
  eps = _dp_accounting_epsilon(pt.noise_multiplier, pt.sampling_rate, 4, pt.ledger.target_delta)
  assert pt.ledger.epsilon() == pytest.approx(eps, rel=1e-12)


def test_a_loop_over_a_spent_budget_raises_instead_of_training_nothing():
  pt = _setup(steps=4)
  allowed = _allowed_steps(pt)  # ≥ 4
  assert [b.batch_size.shape for b in pt.batches(steps=2)] == [(), ()]  # steps 0 and 1
  with pytest.raises(ValueError, match=r"batches\(steps=2\) stops once the ledger holds 2"):
    pt.batches(steps=2)  # already there: a loop that would train nothing
  assert len(list(pt.batches(steps=3))) == 1 and pt.ledger.steps == 3  # steps that exist
  assert len(list(pt.batches())) == 1 and pt.ledger.steps == 4
  eps = _dp_accounting_epsilon(pt.noise_multiplier, pt.sampling_rate, 4, pt.ledger.target_delta)
  for steps in (None, 2, 4):  # the planned T = 4 steps are spent
    with pytest.raises(logit_dp.ledger.PrivacyBudgetExceededError,
                       match=rf"budget of T = 4 steps is spent.*ε, δ\) = \({eps:.4g}"):
      pt.batches(steps)
  assert pt.ledger.steps == 4
  # Past T while the ε budget lasts (test_batches_record_each_step_first_and_stop_at_the_budget),
  # then refused at the budget.
  with pytest.raises(logit_dp.ledger.PrivacyBudgetExceededError, match="would spend"):
    list(pt.batches(steps=allowed + 1))
  assert pt.ledger.steps == allowed


def test_sampler_refuses_steps_past_the_budget_even_unrecorded():
  pt = _setup(steps=4)
  allowed = _allowed_steps(pt)
  drawn = 0
  with pytest.raises(logit_dp.ledger.PrivacyBudgetExceededError):
    for t in range(12):  # the by-hand loop that forgets ledger.record_steps
      pt.sampler(t)
      drawn += 1
  assert drawn == allowed and pt.ledger.steps == 0
  assert isinstance(pt.sampler, logit_dp.sampling.PoissonSampler)
  unbudgeted = pt.sampler.unbudgeted()  # the low-level sampler: no budget
  assert type(unbudgeted) is logit_dp.sampling.PoissonSampler and unbudgeted.seed == pt.sampler.seed
  np.testing.assert_array_equal(unbudgeted(11).indices, unbudgeted(11).indices)


def test_recording_inside_the_batches_loop_is_refused():
  pt = _setup(steps=4)
  with pytest.raises(RuntimeError, match="records every step itself"):
    for _ in pt.batches():
      pt.ledger.record_steps(1)


@pytest.mark.extended
def test_the_first_training_in_a_process_runs_no_accountant_within_its_planned_steps(monkeypatch):
  """The loop of batches() and the train step, within the T steps σ was calibrated for, run
  no privacy accountant: the first training built in a process does the work per step of
  any later identical one (whose ε values are all cached)."""
  from logit_dp._src import accounting as accounting_src
  from logit_dp._src import ledger as ledger_src
  accounting_src._epsilon_cached.cache_clear()  # as in a fresh process: no ε computed yet
  accounting_src._calibrate_cached.cache_clear()  # nor any σ calibrated
  monkeypatch.setattr(ledger_src, "_WITHIN_BUDGET", {})
  runs = []
  make_accountant = accounting_src.make_accountant

  def counting(*args, **kwargs):
    runs.append(args)
    return make_accountant(*args, **kwargs)

  monkeypatch.setattr(accounting_src, "make_accountant", counting)
  embed_fn, params = _embed()
  x_all, x_prime_all = _data()
  for _ in range(2):  # the first training built in the process, then an identical one
    pt = logit_dp.make_private(embed_fn, logit_dp.losses.contrastive(temperature=1.0), 1.0,
                               target_epsilon=EPS, target_delta=DELTA, num_records=N,
                               expected_batch_size=BATCH, optimizer=optax.sgd(0.1), steps=6)
    train_step, opt_state, p = pt.make_train_step(), pt.optimizer.init(params), params
    runs.clear()
    for batch in pt.batches():
      p, opt_state, _ = train_step(p, opt_state, batch, (x_all, x_prime_all))
    assert pt.ledger.steps == 6 and int(opt_state[0].count) == 6
    assert runs == []
  eps = _dp_accounting_epsilon(pt.noise_multiplier, pt.sampling_rate, 6, pt.ledger.target_delta)
  assert pt.ledger.epsilon() == pytest.approx(eps, rel=1e-12) and eps <= EPS


def test_train_step_releases_only_recorded_steps():
  embed_fn, params = _embed()
  x, xp = _data()
  mask8 = np.ones(8, bool)
  pt = _setup(steps=4, noise_key=jax.random.key(0))
  train_step = pt.make_train_step()
  opt_state = pt.optimizer.init(params)
  with pytest.raises(logit_dp.UnrecordedStepError, match="0 step"):
    train_step(params, opt_state, x[:8], xp[:8], mask8)  # no step recorded for it
  for batch in pt.batches():
    old_state = opt_state
    params, opt_state, loss_value = train_step(params, opt_state, batch, (x, xp))
    assert np.isfinite(float(loss_value))
    assert pt.ledger.released_updates == pt.ledger.steps
    if pt.ledger.steps == 2:  # the same noise again, on another batch: refused
      with pytest.raises(logit_dp.UnrecordedStepError, match="same noise"):
        train_step(params, old_state, x[:8], xp[:8], mask8)
  assert int(opt_state[0].count) == pt.ledger.steps == 4
  with pytest.raises(logit_dp.UnrecordedStepError, match="update 5"):
    train_step(params, opt_state, x[:8], xp[:8], mask8)
  # The low-level path: a step recorded by hand may be released (rows as many as a batch's:
  # the update compiled for the batches).
  pt.ledger.record_steps(1, allow_exceeding_budget=True)
  rows = pt.sampler.max_batch_size
  train_step(params, opt_state, x[:rows], xp[:rows], np.arange(rows) < 8)
  assert pt.ledger.released_updates == 5


def test_train_step_gathers_and_masks_the_batch_itself():
  """The padding of a Poisson batch never reaches the update: the step takes the batch and
  the records, and the array form without its mask is refused."""
  embed_fn, params = _embed()
  x, xp = _data()
  pt = _setup(steps=4, noise_key=jax.random.key(3), optimizer=_recorder())
  train_step = pt.make_train_step()
  opt_state = pt.optimizer.init(params)
  batch = next(iter(pt.batches()))
  n = int(batch.batch_size)
  assert 0 < n < batch.mask.shape[0]  # padded: the padding slots hold record 0
  # The mistake of leaving the mask out (padding = copies of record 0) does not run.
  with pytest.raises(TypeError, match="needs the padding mask"):
    train_step(params, opt_state, x[batch.indices], xp[batch.indices])
  with pytest.raises(ValueError, match=r"bool array of shape \(\d+,\)"):
    train_step(params, opt_state, x[batch.indices], xp[batch.indices], batch.mask[:n])
  with pytest.raises(ValueError, match="bool array"):
    train_step(params, opt_state, x[batch.indices], xp[batch.indices], batch.mask.astype(int))
  with pytest.raises(TypeError, match="pass no mask"):
    train_step(params, opt_state, batch, (x, xp), batch.mask)
  with pytest.raises(ValueError, match="N = 400 pair records"):
    train_step(params, opt_state, batch, (x[:300], xp[:300]))
  with pytest.raises(ValueError, match="drawn by"):  # drawn by hand
    train_step(params, opt_state, pt.sampler(0), (x, xp))
  # Host (numpy) records: only the batch is gathered and sent.
  new_params, new_state, loss_value = train_step(params, opt_state, batch,
                                                 (np.asarray(x), np.asarray(xp)))
  # Reference: the padding deleted, not masked; the recorder's state is the noisy sum.
  valid = np.asarray(batch.indices)[:n]
  want_loss, want_grads = pt.grad_fn(params, x[valid], xp[valid])
  np.testing.assert_allclose(loss_value, want_loss, rtol=1e-5)
  noise = jax.tree_util.tree_map(lambda a, b: a - b, new_state[1], want_grads)
  _, reference_state = pt.optimizer.update(jax.tree_util.tree_map(jnp.zeros_like, want_grads),
                                           opt_state, params)
  # The same noise key, count 0: the same noise, up to float32 rounding. ḡ recomputed without
  # the padding is another program: its pair norms come from Gram forms, which carry about
  # √(16u)·S_ij of float32 rounding (docs/privacy_floating_point.md), so ḡ is compared to √eps
  # of its largest entry; the noisy sum is rounded at its own magnitude. Another noise would
  # differ by about σC ≈ 10 here.
  eps32 = float(np.finfo(np.float32).eps)
  jax.tree_util.tree_map(
      lambda a, b, g, total: np.testing.assert_allclose(
          a, b, rtol=0, atol=np.sqrt(eps32) * float(np.max(np.abs(g))) + 4 * eps32 * float(
              np.max(np.abs(total)))), noise, reference_state[1], want_grads, new_state[1])
  del new_params
  next_batch = next(iter(pt.batches()))
  with pytest.raises(ValueError, match="used already"):  # one batch, one update
    train_step(params, new_state, batch, (x, xp))
  train_step(params, new_state, next_batch, (x, xp))  # device records gathered on the device


def test_no_train_step_releases_a_noise_count_twice(tmp_path, monkeypatch):
  """The released noise counts live in the ledger: refused by every step object, after a
  restore in the same process, and in a fresh process from the checkpoint (old ones too)."""
  _, params = _embed()
  x, xp = _data()

  def rows(batch):  # the array form, with the batch's mask
    return x[batch.indices], xp[batch.indices], batch.mask

  pt = _setup(steps=6, noise_key=jax.random.key(4))
  first_step, second_step = pt.make_train_step(), pt.make_train_step()
  init_state = pt.optimizer.init(params)
  states = [init_state]
  batches = pt.batches()
  for t, batch in zip(range(4), batches):
    _, state, _ = first_step(params, states[-1], *rows(batch))
    states.append(state)
    if t == 1:
      pt.save_checkpoint(tmp_path / "new", (params, state))  # released 2
  next_batch = next(batches)  # step 4 recorded
  # Another step object (a notebook cell run again) on an old state: the same noise, refused.
  for old in states[:4]:
    with pytest.raises(logit_dp.UnrecordedStepError, match="same noise"):
      second_step(params, old, *rows(next_batch))
  assert pt.ledger.released_updates == 4
  # A restore in the same process keeps what this process released (4): redoing step 2 from
  # the checkpoint is refused, by the restored run's steps and by this one's.
  (_, restored_state), restored = pt.restore_checkpoint(tmp_path / "new", (params, init_state))
  assert int(restored_state[0].count) == 2 and restored.ledger.steps == 2
  assert restored.ledger.released_updates == pt.ledger.released_updates == 4
  redo = next(iter(restored.batches()))
  with pytest.raises(logit_dp.UnrecordedStepError, match="same noise"):
    restored.make_train_step()(params, restored_state, *rows(redo))
  # A fresh process (a new make_private) restores the count released with the checkpoint.
  fresh = _setup(steps=6, noise_key=jax.random.key(4))
  (_, fresh_state), resumed = fresh.restore_checkpoint(tmp_path / "new", (params, init_state))
  assert resumed.ledger.released_updates == 2
  step = resumed.make_train_step()
  batch = next(iter(resumed.batches()))
  with pytest.raises(logit_dp.UnrecordedStepError, match="same noise"):
    step(params, init_state, *rows(batch))  # count 0, released with the checkpoint's run
  step(params, fresh_state, *rows(batch))  # count 2: continues
  # A checkpoint written before the ledger recorded released updates (format version 1).
  old_to_dict = logit_dp.ledger.PrivacyLedger.to_dict

  def version_1(ledger):
    out = old_to_dict(ledger)
    del out["released_updates"]
    return {**out, "format_version": 1}

  monkeypatch.setattr(logit_dp.ledger.PrivacyLedger, "to_dict", version_1)
  pt.save_checkpoint(tmp_path / "old", (params, states[3]))
  monkeypatch.undo()
  (_, old_state), from_old = _setup(steps=6).restore_checkpoint(tmp_path / "old",
                                                                (params, init_state))
  assert int(old_state[0].count) == 3 and from_old.ledger.steps == 5
  assert from_old.ledger.released_updates == 3  # what the restored state has released


def test_train_step_returns_while_the_device_works():
  """The call only dispatches: it reads no value of the update it dispatched, nor of the one
  before (its noise count is known on the host, its reports are read once it has run)."""
  _, params = _embed()
  x, xp = _data()
  pt = _setup(steps=4, noise_key=jax.random.key(5))
  train_step = pt.make_train_step()
  state = pt.optimizer.init(params)
  batches = pt.batches()
  first = next(batches)
  params, state, _ = train_step(params, state, x[first.indices], xp[first.indices],
                                first.mask)  # compiles
  jax.block_until_ready((params, state))

  @jax.jit
  def after_a_while(params):  # params, once a second or so of device work is done
    big = jax.lax.fori_loop(0, 600, lambda i, a: jnp.tanh(a @ a), jnp.eye(400) * 0.5)
    return jax.tree_util.tree_map(lambda p: jnp.where(jnp.sum(big) > -1e9, p, p + 1), params)

  after_a_while.lower(params).compile()
  b1, b2 = next(batches), next(batches)  # drawn (and recorded) before the device is busy
  rows_1 = x[b1.indices], xp[b1.indices], b1.mask
  jax.block_until_ready(rows_1)
  late_params = after_a_while(params)
  params_1, state_1, loss_1 = train_step(late_params, state, *rows_1)  # the array form
  assert not loss_1.is_ready()  # the call returned while the device was busy before it
  params_2, state_2, loss_2 = train_step(params_1, state_1, b2, (x, xp))  # the batch form
  assert not loss_1.is_ready() and not loss_2.is_ready()  # it did not wait for step 1
  assert pt.ledger.released_updates == 3
  jax.block_until_ready((params_2, state_2, loss_2))
  assert int(state_2[0].count) == 3 and np.isfinite(float(loss_2))


@pytest.mark.slow  # a third compilation; the loop tests above run the same update by default
def test_train_step_is_the_update_of_grad_fn_and_optimizer():
  embed_fn, params = _embed()
  x, xp = _data()
  pt = _setup(steps=4, noise_key=jax.random.key(1))
  opt_state = pt.optimizer.init(params)
  pt.ledger.record_steps(1)
  mask = jnp.arange(10) < 7
  got = pt.make_train_step(jit=False)(params, opt_state, x[:10], xp[:10], mask)
  loss_value, grads = pt.grad_fn(params, x[:10], xp[:10], mask)
  updates, state = pt.optimizer.update(grads, opt_state, params)
  want = (optax.apply_updates(params, updates), state, loss_value)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got,
                         want)


def test_train_step_reports_non_finite_rows_and_empty_batches():
  embed_fn, params = _embed()
  x, xp = _data()
  x = x.at[3].set(jnp.nan)
  mask8, empty = np.ones(8, bool), np.zeros(8, bool)
  pt = _setup(steps=4, noise_key=jax.random.key(2))
  opt_state = pt.optimizer.init(params)
  pt.ledger.record_steps(3)
  warn_step = pt.make_train_step()
  # "warn" reports once the step has run: at a later call, at flush() or the loop's end.
  with pytest.warns(logit_dp.NonFiniteRowsWarning, match="step 1: 1 of 8 valid pair"):
    params_1, opt_state_1, _ = warn_step(params, opt_state, x[:8], xp[:8], mask8)
    warn_step.flush()
  assert int(opt_state_1[0].count) == 1
  assert all(np.all(np.isfinite(a)) for a in jax.tree_util.tree_leaves(params_1))
  with pytest.warns(logit_dp.EmptyBatchWarning, match="step 2: the batch has no valid pair"):
    warn_step(params_1, opt_state_1, x[:8], xp[:8], empty)
    warn_step.flush()
  assert warn_step.num_dropped() == 1  # the pairs dropped by the released updates
  # "error" waits for the step and raises before anything is released: the state may retry.
  pt = _setup(steps=4, noise_key=jax.random.key(2))
  pt.ledger.record_steps(3)
  error_step = pt.make_train_step(on_nonfinite="error", on_empty="error", jit=False)
  with pytest.raises(FloatingPointError, match="1 of 8 valid pair"):
    error_step(params, opt_state, x[:8], xp[:8], mask8)
  with pytest.raises(ValueError, match="no valid pair"):
    error_step(params, opt_state, x[:8], xp[:8], empty)
  assert pt.ledger.released_updates == 0
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ignore_step = pt.make_train_step(on_nonfinite="ignore", jit=False)
    ignore_step(params, opt_state, x[:8], xp[:8], mask8)
    ignore_step.flush()
  assert ignore_step.num_dropped() == 0  # nothing read
  with pytest.raises(ValueError, match="on_empty must be one of"):
    pt.make_train_step(on_empty="raise")


def test_warnings_of_the_last_steps_come_at_the_end_of_the_loop():
  embed_fn, params = _embed()
  x, xp = _data()
  x = x.at[:, 0].set(jnp.nan)  # every row
  pt = _setup(steps=2, noise_key=jax.random.key(6))
  train_step, opt_state = pt.make_train_step(), pt.optimizer.init(params)
  with pytest.warns(logit_dp.NonFiniteRowsWarning) as caught:
    for batch in pt.batches():
      params, opt_state, _ = train_step(params, opt_state, batch, (x, xp))
  steps = sorted(
      int(str(w.message).split(":")[0].split()[-1]) for w in caught
      if issubclass(w.category, logit_dp.NonFiniteRowsWarning))
  assert steps == [1, 2]


def test_non_finite_parameters_stop_the_loop_with_no_step_recorded_past_the_report():
  """NaN parameters (a diverged run): every valid pair with finite inputs has a non-finite
  embedding. Under the default "warn" the loop stops with NonFiniteParametersError at the
  first report (at most two steps late), and the ledger holds no step that was not released:
  the rest of the budget is not spent on pure noise."""
  _, params = _embed()
  x, xp = _data()
  nan_params = jax.tree_util.tree_map(lambda p: jnp.full_like(p, jnp.nan), params)
  pt = _setup(steps=10, noise_key=jax.random.key(7))
  train_step, opt_state = pt.make_train_step(), pt.optimizer.init(params)
  batches = pt.batches()
  with pytest.raises(
      logit_dp.NonFiniteParametersError,
      match=r"step 1: all \d+ valid pair\(s\) with finite inputs have non-finite "
      r"embeddings \(NaN/inf\): the parameters hold NaN/inf"):
    for batch in batches:
      _, opt_state, _ = train_step(nan_params, opt_state, batch, (x, xp))
  steps = pt.ledger.steps
  assert 1 <= steps <= 3  # reported at most two steps late
  assert pt.ledger.released_updates == steps  # no step recorded past the last release
  # Raised by the step or by the loop before its next step: that loop hands out no more.
  with pytest.raises((logit_dp.NonFiniteParametersError, StopIteration)):
    next(batches)
  assert pt.ledger.steps == pt.ledger.released_updates == steps
  # Under "error" the step waits for its report and releases nothing.
  pt = _setup(steps=10, noise_key=jax.random.key(9))
  error_step = pt.make_train_step(on_nonfinite="error")
  with pytest.raises(logit_dp.NonFiniteParametersError, match="lower the learning rate"):
    for batch in pt.batches():
      error_step(nan_params, pt.optimizer.init(params), batch, (x, xp))
  assert pt.ledger.steps == 1 and pt.ledger.released_updates == 0


def test_non_finite_data_is_reported_with_its_record_indices():
  """Finite parameters and records with NaN values: the report names the records (the array
  form: the batch's rows) and is not the parameters' error; the other pairs train."""
  _, params = _embed()
  x, xp = _data()
  pt = _setup(steps=4, noise_key=jax.random.key(10))
  train_step, opt_state = pt.make_train_step(), pt.optimizer.init(params)
  batch = next(pt.batches())
  valid_rows = np.flatnonzero(np.asarray(batch.mask))[[1, 3]]
  bad = np.asarray(batch.indices)[valid_rows]
  x_bad = np.asarray(x).copy()
  x_bad[bad[0], 2] = np.nan
  xp_bad = np.asarray(xp).copy()
  xp_bad[bad[1], 0] = np.inf
  with pytest.warns(
      logit_dp.NonFiniteRowsWarning,
      match=r"step 1: 2 of \d+ valid pair\(s\) were dropped \(masked out, still "
      r"private\)\. 2 valid pair\(s\) have non-finite inputs \(NaN/inf\): "
      f"records {bad[0]}, {bad[1]} of x_all or x_prime_all. Fix or remove"):
    _, opt_state, _ = train_step(params, opt_state, batch, (x_bad, xp_bad))
    train_step.flush()
  pt.ledger.record_steps(1)  # the low-level path: the array form
  with pytest.warns(logit_dp.NonFiniteRowsWarning,
                    match=f"rows {valid_rows[0]}, {valid_rows[1]} of the batch"):
    train_step(params, opt_state, x_bad[batch.indices], xp_bad[batch.indices], batch.mask)
    train_step.flush()
  assert train_step.num_dropped() == 4 and pt.ledger.released_updates == 2


def test_an_optimizer_state_of_another_training_is_named_as_such():
  """A state this training did not produce (another make_private's noise key, or a noise count
  it never released) is refused with a message that says so, not as an unrecorded step."""
  _, params = _embed()
  x, xp = _data()
  other = _setup(steps=4, noise_key=jax.random.key(11))
  other_state = other.optimizer.init(params)
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  for _ in range(2):  # two updates of the other training
    _, other_state = other.optimizer.update(zeros, other_state, params)
  pt = _setup(steps=4, noise_key=jax.random.key(12))
  train_step = pt.make_train_step()
  batch = next(pt.batches())
  with pytest.raises(ValueError, match="opt_state was not produced by this training: its noise "
                     "key"):
    train_step(params, other_state, batch, (x, xp))
  # The same noise key, and a count this training never released.
  same_key = pt._replace(optimizer=other.optimizer)
  with pytest.raises(ValueError, match="its noise count is 2, and this training has released 0"):
    same_key.make_train_step()(params, other_state, batch, (x, xp))
  assert pt.ledger.released_updates == 0
  # Its own state trains.
  train_step(params, pt.optimizer.init(params), batch, (x, xp))
  assert pt.ledger.released_updates == 1


@pytest.mark.slow
def test_checkpoint_restores_ledger_and_sampler_position(tmp_path):
  """A run stopped after 3 of 5 steps and restored into a fresh make_private (other secret
  seeds) draws the batches and noise of the uninterrupted run and ends with its parameters."""
  embed_fn, params0 = _embed()
  x, xp = _data()

  def run(pt, train_step, params, opt_state, stop=None):
    indices = []
    for batch in pt.batches():
      indices.append(np.asarray(batch.indices))
      params, opt_state, _ = train_step(params, opt_state, batch, (x, xp))
      if pt.ledger.steps == stop:
        pt.save_checkpoint(tmp_path, (params, opt_state))
        break
    return params, opt_state, indices

  first = _setup(steps=5)
  first_step = first.make_train_step()
  params, opt_state, idx_first = run(first, first_step, params0, first.optimizer.init(params0),
                                     stop=3)
  assert logit_dp.ledger.latest_step(tmp_path) == 3 and len(idx_first) == 3

  fresh = _setup(steps=5)
  assert fresh.sampler.seed != first.sampler.seed
  template = (params0, fresh.optimizer.init(params0))
  (params_r, opt_state_r), resumed = fresh.restore_checkpoint(tmp_path, template)
  assert resumed.ledger.steps == 3 and resumed.sampler.seed == first.sampler.seed
  assert resumed.ledger.epsilon_budget == EPS and resumed.sampler.ledger is resumed.ledger
  assert int(opt_state_r[0].count) == 3
  p_resumed, _, idx_resumed = run(resumed, resumed.make_train_step(), params_r, opt_state_r)
  assert resumed.ledger.steps == 5 and len(idx_resumed) == 2
  # The first run, continued without interruption: same batches, same noise, same parameters.
  p_first, _, idx_continued = run(first, first_step, params, opt_state)
  jax.tree_util.tree_map(np.testing.assert_array_equal, p_resumed, p_first)
  plain = first.sampler.unbudgeted()
  for t, idx in enumerate(idx_first + idx_resumed):
    np.testing.assert_array_equal(idx, plain(t).indices)
  for got, want in zip(idx_resumed, idx_continued):
    np.testing.assert_array_equal(got, want)
  eps = _dp_accounting_epsilon(first.noise_multiplier, first.sampling_rate, 5,
                               first.ledger.target_delta)
  assert resumed.ledger.guarantee() == first.ledger.guarantee()
  assert resumed.ledger.epsilon() == pytest.approx(eps, rel=1e-12)


def test_restore_refuses_another_mechanism_or_a_missing_sampler(tmp_path):
  _, params = _embed()
  pt = _setup(steps=5)
  state = (params, pt.optimizer.init(params))
  assert pt.restore_checkpoint(tmp_path / "none", state, missing_ok=True) == (state, pt)
  pt.ledger.record_steps(1)
  pt.save_checkpoint(tmp_path / "a", state)
  other = _setup(steps=50)  # another σ
  with pytest.raises(ValueError, match="noise_multiplier"):
    other.restore_checkpoint(tmp_path / "a", state)
  logit_dp.ledger.save_checkpoint(tmp_path / "b", 1, state, pt.ledger)  # no sampler
  with pytest.raises(ValueError, match="holds no sampler"):
    _setup(steps=5).restore_checkpoint(tmp_path / "b", state)


def test_restore_from_no_checkpoint_is_refused_unless_missing_ok(tmp_path):
  """A directory that does not exist, or holds no checkpoint, restarts a run with a fresh
  ledger only when asked (missing_ok=True); otherwise the error says which it is."""
  _, params = _embed()
  pt = _setup(steps=5)
  state = (params, pt.optimizer.init(params))
  with pytest.raises(FileNotFoundError, match=r"does not exist\. Pass missing_ok=True"):
    pt.restore_checkpoint(tmp_path / "typo", state)
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=r"exists but holds no checkpoint \(it is empty"):
    pt.restore_checkpoint(tmp_path / "empty", state)
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("")
  with pytest.raises(FileNotFoundError, match=r"holds no checkpoint \(it holds \['notes.txt'\]"):
    pt.restore_checkpoint(tmp_path / "other", state)
  for directory in ("typo", "empty", "other"):
    assert pt.restore_checkpoint(tmp_path / directory, state, missing_ok=True) == (state, pt)
  assert not (tmp_path / "typo").exists()
  pt.ledger.record_steps(1)
  pt.save_checkpoint(tmp_path / "run", state)
  with pytest.raises(FileNotFoundError, match=r"No checkpoint 4 .* holds steps \[1\]"):
    pt.restore_checkpoint(tmp_path / "run", state, step=4, missing_ok=True)
  with pytest.raises(ValueError, match="missing_ok must be True or False"):
    pt.restore_checkpoint(tmp_path / "run", state, missing_ok="yes")


def test_restore_with_another_optimizer_names_what_differs(tmp_path):
  """A template of another optimizer chain (or other params) is refused with the differing
  leaves named, never with orbax's advice to restore part of the state."""
  _, params = _embed()
  adam = _setup(steps=5, optimizer=optax.adam(1e-3))
  adam.ledger.record_steps(1)
  adam.save_checkpoint(tmp_path, (params, adam.optimizer.init(params)))
  momentum = _setup(steps=5, optimizer=optax.sgd(0.1, momentum=0.9))
  with pytest.raises(ValueError, match="differs from the template") as refused:
    momentum.restore_checkpoint(tmp_path, (params, momentum.optimizer.init(params)))
  message = str(refused.value)
  assert "partial_restore" not in message
  kernel = "params.Dense_0.kernel"
  assert f"1.1.0.mu.{kernel}: in the checkpoint, not in the template" in message
  assert f"1.1.0.trace.{kernel}: in the template, not in the checkpoint" in message
  differing = [line.split(":")[0].strip() for line in message.splitlines() if ": in the" in line]
  assert differing and all(name.startswith("1.1.0.") for name in differing)  # params, noise match
  wider = models.MLPEmbedding(embedding_dim=4, hidden=(9,)).init(jax.random.key(0), jnp.zeros(
      (1, 6)))
  with pytest.raises(ValueError, match=rf"0\.{kernel}: shape \(6, 9\) in the template, \(6, 8\)"):
    adam.restore_checkpoint(tmp_path, (wider, adam.optimizer.init(wider)))


# -- DP-GCL through make_private. ------------------------------------------------------------


def test_dp_gcl_sensitivity_groups_and_train_step_are_those_of_grouped_clipped_grad():
  """method="dp_gcl": C = 2B, G = round(E[n]/s), and train_step's update is grouped_clipped_grad
  on the batch's record ids grouped with fold_in(group_key, t), noised by the optimizer."""
  embed_fn, params = _embed()
  loss = logit_dp.losses.contrastive(temperature=1.0)
  pt = _setup(method="dp_gcl", group_size=4, steps=4, noise_key=jax.random.key(1), sampler_seed=3,
              optimizer=_recorder())
  assert pt.sensitivity == logit_dp.baselines.grouped_sensitivity(1.0) == 2.0
  assert pt.grad_fn.mechanism is logit_dp.Mechanism.DP_GCL and pt.grad_fn.num_groups == 5
  assert pt.method == "dp_gcl" and pt.group_key is not None
  x, xp = _data()
  opt_state = pt.optimizer.init(params)
  train_step = pt.make_train_step()
  for t, batch in enumerate(pt.batches(2)):
    xs, xps = x[batch.indices], xp[batch.indices]
    if t == 0:  # the batch form groups the records by batch.indices itself
      new_params, new_state, loss_value = train_step(params, opt_state, batch, (x, xp))
    else:
      new_params, new_state, loss_value = train_step(params, opt_state, xs, xps, batch.mask,
                                                     record_ids=batch.indices)
    want_loss, want = logit_dp.baselines.grouped_clipped_grad(
        embed_fn, loss, 1.0, 5)(params, xs, xps, batch.mask, record_ids=batch.indices,
                                group_key=jax.random.fold_in(pt.group_key, t))
    zeros = jax.tree_util.tree_map(jnp.zeros_like, want)
    noise = pt.optimizer.update(zeros, opt_state, params)[1][-1]  # the noise of step t alone
    jax.tree_util.tree_map(
        lambda got, n, w: np.testing.assert_allclose(got - n, w, rtol=1e-4, atol=1e-5),
        new_state[-1], noise, want)
    np.testing.assert_allclose(float(loss_value), float(want_loss), rtol=1e-6)
    params, opt_state = new_params, new_state
  with pytest.raises(ValueError, match="record_ids"):
    train_step(params, opt_state, x[:8], xp[:8], jnp.ones(8, bool))


def test_dp_gcl_two_towers_train_end_to_end():
  """Two towers (an MLP on x, a linear tower on x' of another width), DP-GCL via make_private:
  C = 2B, the parameters of both towers move, the ledger stays within (ε, δ)."""
  embed_fn, image_params = _embed()
  text = lambda p, b: b @ p["text"]
  params = {"image": image_params, "text": 0.3 * jax.random.normal(jax.random.key(5), (3, 4))}
  towers = (lambda p, a: embed_fn(p["image"], a), text)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(N, 6)).astype(np.float32))
  texts = jnp.asarray(rng.normal(size=(N, 3)).astype(np.float32))
  pt = logit_dp.make_private(towers[0], logit_dp.losses.contrastive(1.0), 1.0, target_epsilon=EPS,
                             target_delta=DELTA, num_records=N, expected_batch_size=BATCH, steps=3,
                             optimizer=optax.adam(1e-2), mean=True, method="dp_gcl", group_size=5,
                             positive_embed_fn=towers[1])
  assert pt.grad_fn.num_groups == 4
  assert pt.sensitivity == 2.0
  opt_state = pt.optimizer.init(params)
  train_step = pt.make_train_step(on_empty="error")
  start = params
  for batch in pt.batches():
    params, opt_state, loss_value = train_step(params, opt_state, x[batch.indices],
                                               texts[batch.indices], batch.mask,
                                               record_ids=batch.indices)
    assert np.isfinite(float(loss_value))
  assert pt.ledger.steps == 3 and pt.ledger.guarantee()[0] <= EPS
  moved = jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), params, start)
  assert all(v > 0 for v in jax.tree_util.tree_leaves(moved))


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="dp_gcl"), "group_size"),
    (dict(method="dp_gcl", group_size=0), "group_size"),
    (dict(method="dp_gcl", group_size=float("inf")), "group_size"),
    (dict(method="dp_gcl", group_size=True), "group_size"),
    (dict(method="dp_gcl", group_size="8"), "group_size"),
    (dict(method="dp_gcl", num_groups=3), "group_size"),
    (dict(method="ghost", group_size=4), "dp_gcl"),
    (dict(method="dp_gcl", group_size=4, axis_name="batch"), "mesh="),
])
def test_dp_gcl_bad_arguments_raise_value_error(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _setup(**kwargs)


def test_record_ids_only_with_dp_gcl():
  embed_fn, params = _embed()
  x, xp = _data()
  pt = _setup(steps=2)
  pt.ledger.record_steps(1)
  with pytest.raises(ValueError, match="record_ids"):
    pt.make_train_step()(params, pt.optimizer.init(params), x[:8], xp[:8], jnp.ones(8, bool),
                         record_ids=jnp.arange(8))


@pytest.mark.extended
def test_dp_gcl_with_dropout_gets_the_model_key_of_the_step():
  """stochastic=True: step t's DP-GCL gradient uses fold_in(model_key, t) and
  fold_in(group_key, t), the noise key split apart from both."""
  w = jax.random.normal(jax.random.key(2), (6, 4))

  def embed(p, x, key):
    h = jnp.tanh(x @ p["w"])
    return jnp.where(jax.random.bernoulli(key, 0.7, h.shape), h / 0.7, 0.0)

  params = {"w": w}
  loss = logit_dp.losses.contrastive(temperature=1.0)
  pt = logit_dp.make_private(embed, loss, 1.0, target_epsilon=EPS, target_delta=DELTA,
                             num_records=N, expected_batch_size=BATCH, steps=2,
                             optimizer=_recorder(), method="dp_gcl", group_size=5, stochastic=True,
                             noise_key=jax.random.key(4), sampler_seed=1)
  assert pt.model_key is not None and pt.group_key is not None
  x, xp = _data()
  opt_state = pt.optimizer.init(params)
  (batch,) = list(pt.batches(1))
  xs, xps = x[batch.indices], xp[batch.indices]
  _, new_state, _ = pt.make_train_step()(params, opt_state, xs, xps, batch.mask,
                                         record_ids=batch.indices)
  _, want = logit_dp.baselines.grouped_clipped_grad(embed, loss, 1.0, 4, stochastic=True)(
      params, xs, xps, batch.mask, record_ids=batch.indices,
      group_key=jax.random.fold_in(pt.group_key, 0), key=jax.random.fold_in(pt.model_key, 0))
  noise = pt.optimizer.update(jax.tree_util.tree_map(jnp.zeros_like, want), opt_state,
                              params)[1][-1]
  np.testing.assert_allclose(new_state[-1]["w"] - noise["w"], want["w"], rtol=1e-4, atol=1e-5)


def _steps(pt, params, data, num_steps, **step_kwargs):
  """num_steps steps of pt's batches through its train step; (params, opt_state, outputs)."""
  train_step = pt.make_train_step(**step_kwargs)
  opt_state = pt.optimizer.init(params)
  outputs = []
  for batch in pt.batches(num_steps):
    params, opt_state, *out = train_step(params, opt_state, batch, data)
    outputs.append((batch, out))
  return params, opt_state, outputs


@pytest.mark.parametrize(
    "method", ["ghost", pytest.param("naive", marks=pytest.mark.extended), "dp_gcl"])
def test_make_private_on_a_mesh_trains_as_on_one_device(method, caplog):
  """make_private(mesh=): the step pads the batch to the devices and computes the global ḡ;
  the same σ, C, ledger and, step after step, the same parameters as one device; its update
  compiles once (the first step's params are placed on the mesh as the step returns them).
  DP-GCL groups the global batch's records, with one extra view per record from augment."""
  embed_fn, params = _embed()
  x, xp = _data()
  kwargs = dict(steps=3, noise_key=jax.random.key(2), sampler_seed=5, method=method,
                max_batch_size=50)  # 50 rows: 2 of mesh padding on 4 devices
  step_kwargs = {}
  if method == "dp_gcl":
    kwargs["group_size"] = 4
    step_kwargs["augment"] = lambda a, b, t: (a, b, (0.5 * (a + b))[:, None])
  one = _setup(**kwargs)
  mesh = logit_dp.distributed.data_mesh(4)
  sharded = _setup(mesh=mesh, **kwargs)
  assert sharded.grad_fn.mesh is mesh
  assert (sharded.noise_multiplier, sharded.sensitivity) == (one.noise_multiplier, one.sensitivity)
  want, _, _ = _steps(one, params, (x, xp), 3, **step_kwargs)
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    got, _, _ = _steps(sharded, params, (np.asarray(x), np.asarray(xp)), 3, **step_kwargs)
  compiles = [r for r in caplog.records if "Compiling jit(update)" in r.getMessage()]
  assert len(compiles) == 1, [r.getMessage()[:200] for r in compiles]
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), got,
                         want)
  assert sharded.ledger.steps == one.ledger.steps == 3
  assert sharded.ledger.epsilon() == one.ledger.epsilon()


def test_make_private_refuses_a_bad_mesh():
  with pytest.raises(TypeError, match="jax.sharding.Mesh"):
    _setup(mesh="data")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("batch",))
  with pytest.raises(ValueError, match="not 'data'"):
    _setup(mesh=mesh)


@pytest.mark.extended
def test_augment_runs_per_step_on_the_gathered_batch_before_the_gradient():
  """augment(x, x', t) is applied inside the step to the gathered rows, with the update's
  number t: (ℒ, ḡ) are grad_fn's on the augmented valid rows, under the step's own noise."""
  embed_fn, params = _embed()
  x, xp = _data()
  traced = []

  def augment(a, b, t):
    traced.append(a.shape[0])
    return a * (1.0 + t), jnp.flip(b, axis=-1)

  pt = _setup(steps=2, noise_key=jax.random.key(3), optimizer=_recorder())
  train_step = pt.make_train_step(augment=augment)
  opt_state = pt.optimizer.init(params)
  for t, batch in enumerate(pt.batches()):
    new_params, new_state, loss_value = train_step(params, opt_state, batch, (x, xp))
    valid = np.asarray(batch.indices)[np.asarray(batch.mask)]
    want_loss, want = pt.grad_fn(params, x[valid] * (1.0 + t), jnp.flip(xp[valid], axis=-1))
    np.testing.assert_allclose(loss_value, want_loss, rtol=1e-5)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, want)
    noise = pt.optimizer.update(zeros, opt_state, params)[1][1]  # step t's noise alone
    jax.tree_util.tree_map(lambda g, n, w: np.testing.assert_allclose(g - n, w, atol=2e-5),
                           new_state[1], noise, want)
    params, opt_state = new_params, new_state
  assert traced == [int(pt.sampler.max_batch_size)]  # traced once, on the padded batch
  with pytest.raises(TypeError, match=r"augment must return a tuple \(x, x_prime\)"):
    _steps(_setup(steps=1), params, (x, xp), 1, augment=lambda a, b, t: (a, b, a))
  with pytest.raises(TypeError, match="callable"):
    _setup(steps=1).make_train_step(augment=3)


@pytest.mark.extended
def test_dp_gcl_augment_gives_the_extra_views_of_each_record():
  """method="dp_gcl": augment may return (x, x', extra_views); the update is
  grouped_clipped_grad's with those extra views."""
  embed_fn, params = _embed()
  x, xp = _data()
  loss = logit_dp.losses.contrastive(temperature=1.0)

  def augment(a, b, t):
    return a, b, jnp.stack([a + 0.01 * (t + 1), b - 0.01], axis=1)

  pt = _setup(method="dp_gcl", group_size=4, steps=1, noise_key=jax.random.key(1), sampler_seed=3,
              optimizer=_recorder())
  train_step = pt.make_train_step(augment=augment)
  opt_state = pt.optimizer.init(params)
  batch = next(iter(pt.batches()))
  _, new_state, loss_value = train_step(params, opt_state, batch, (x, xp))
  xs, xps = x[batch.indices], xp[batch.indices]
  want_loss, want = logit_dp.baselines.grouped_clipped_grad(embed_fn, loss, 1.0, 5)(
      params, xs, xps, batch.mask, record_ids=batch.indices,
      group_key=jax.random.fold_in(pt.group_key, 0), extra_views=augment(xs, xps, 0)[2])
  np.testing.assert_allclose(float(loss_value), float(want_loss), rtol=1e-6)
  noise = pt.optimizer.update(jax.tree_util.tree_map(jnp.zeros_like, want), opt_state,
                              params)[1][-1]
  jax.tree_util.tree_map(lambda g, n, w: np.testing.assert_allclose(g - n, w, atol=1e-5),
                         new_state[-1], noise, want)


@pytest.mark.extended
def test_clip_stats_are_those_of_grad_fn_on_the_batch():
  """make_train_step(clip_stats=True) returns grad_fn.with_stats's ClipStats of the batch."""
  embed_fn, params = _embed()
  x, xp = _data()
  pt = _setup(steps=1, noise_key=jax.random.key(4))
  _, _, [(batch, (loss_value, stats))] = _steps(pt, params, (x, xp), 1, clip_stats=True)
  want_loss, _, want = pt.grad_fn.with_stats(params, x[batch.indices], xp[batch.indices],
                                             jnp.asarray(batch.mask))
  np.testing.assert_allclose(loss_value, want_loss, rtol=1e-6)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), stats, want)
  with pytest.raises(TypeError, match="clip_stats must be True or False"):
    pt.make_train_step(clip_stats=1)


def test_a_fixed_noise_multiplier_keeps_the_budget():
  """noise_multiplier=σ: σ is not calibrated; ε is reported at the δ_acc of the calibrated
  run, and batches() stops before the step past the (ε, δ) budget."""
  calibrated = _setup(steps=50)
  same = _setup(steps=50, noise_multiplier=calibrated.noise_multiplier)
  assert same.ledger == calibrated.ledger
  low = _setup(steps=50, noise_multiplier=0.8 * calibrated.noise_multiplier)
  assert low.noise_multiplier == 0.8 * calibrated.noise_multiplier
  assert low.ledger.target_delta == calibrated.ledger.target_delta
  allowed = _allowed_steps(low)
  assert 0 < allowed < 50
  with pytest.raises(logit_dp.ledger.PrivacyBudgetExceededError):
    for _ in low.batches():
      pass
  assert low.ledger.steps == allowed

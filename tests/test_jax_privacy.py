"""logit_dp's clipped gradient inside jax_privacy (the `jax-privacy` extra; skipped without it).

docs/guides/jax_privacy.md runs a training step with jax_privacy's sampling, privatizer and
accountant (tests/test_docs.py, slow); these tests check the pieces it relies on.
"""

import inspect

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logit_dp
from helpers import flat
from helpers import import_jax_privacy

jax_privacy = import_jax_privacy()
from jax_privacy import accounting as jp_accounting  # noqa: E402
from jax_privacy import batch_selection  # noqa: E402
from jax_privacy import noise_addition  # noqa: E402

Relation = dp_accounting.NeighboringRelation
LOSS = logit_dp.losses.contrastive(1.0)


def embed_fn(params, xs):
  return jnp.tanh(xs @ params["w1"]) @ params["w2"]


def _problem(n=40, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  params = {"w1": jax.random.normal(k[0], (6, 12)) / 3, "w2": jax.random.normal(k[1], (12, 4)) / 4}
  x = jax.random.normal(k[2], (n, 6))
  return params, x, x + 0.1 * jax.random.normal(k[3], (n, 6))


def test_sensitivity_takes_the_relation_as_bounded_sensitivity_callable_does():
  """Called as jax_privacy calls it (positionally, or by its keyword), per relation: C for
  add-or-remove and zero-out, C_rep for replace-one; jax_privacy's own per-example callable
  gives B and 2B there."""
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, 0.5)
  theirs = jax_privacy.clipped_grad(lambda p, x: jnp.sum(p * x), l2_clip_norm=0.5)
  assert "neighboring_relation" in inspect.signature(grad_fn.sensitivity).parameters
  c = logit_dp.sensitivity(LOSS, 0.5)
  c_rep = logit_dp.sensitivity(LOSS, 0.5, neighboring_relation=Relation.REPLACE_ONE)
  expected = {
      Relation.ADD_OR_REMOVE_ONE: c, Relation.REPLACE_SPECIAL: c, Relation.REPLACE_ONE: c_rep
  }
  for relation, value in expected.items():
    assert grad_fn.sensitivity(relation) == grad_fn.sensitivity(neighboring_relation=relation)
    assert grad_fn.sensitivity(relation) == value
    # The ratio to the per-example callable's: Logit-DP's replace-one costs less than double.
    assert value / theirs.sensitivity(relation) == pytest.approx(
        c / 0.5 if relation is not Relation.REPLACE_ONE else (c + 2 * 0.5) / 1.0)
  accountant = jp_accounting.PldAccountantConfig().create_accountant()
  assert grad_fn.sensitivity(accountant.neighboring_relation) == c


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_jax_privacy_accountant_gives_logit_dp_epsilon(accountant):
  """DpsgdTrainingAccountant's ε (T compositions of the Poisson-subsampled Gaussian) is
  logit_dp.accounting.epsilon's (one self-composed event), accountant settings alike."""
  orders = jp_accounting.RdpAccountantConfig().orders
  for sigma, batch_size, steps in ((0.8, 32, 50), (1.5, 100, 400), (4.0, 10, 7)):
    num_samples, delta = 2_000, 1e-6
    config = (jp_accounting.PldAccountantConfig(value_discretization_interval=1e-3)
              if accountant == "pld" else jp_accounting.RdpAccountantConfig(orders=orders))
    theirs = jp_accounting.DpsgdTrainingAccountant(config).compute_epsilon(
        steps,
        jp_accounting.DpParams(noise_multipliers=sigma, num_samples=num_samples, delta=delta,
                               batch_size=batch_size))
    ours = logit_dp.accounting.epsilon(sigma, delta, batch_size / num_samples, steps, accountant,
                                       rdp_orders=orders)
    assert theirs == pytest.approx(ours, rel=1e-9)


def test_padding_rows_of_jax_privacy_batches_contribute_nothing():
  """A batch padded by jax_privacy (−1 indices), with the padding masked, gives the ḡ of the
  unpadded batch (float64: to rounding)."""
  sampler = batch_selection.CyclicPoissonSampling(sampling_prob=0.3, iterations=1)
  (indices,) = sampler.batch_iterator(40, rng=0)
  padded = batch_selection.pad_to_multiple_of(indices, 32)
  mask = padded >= 0
  assert 0 < indices.size < padded.size
  rows = np.where(mask, padded, 0)
  with jax.enable_x64(True):
    params, x, x_prime = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), _problem())
    grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, 0.1)
    loss_padded, padded_grad = grad_fn(params, x[rows], x_prime[rows], jnp.asarray(mask))
    loss_exact, exact_grad = grad_fn(params, x[indices], x_prime[indices])
  np.testing.assert_allclose(loss_padded, loss_exact, rtol=1e-12)
  np.testing.assert_allclose(flat(padded_grad), flat(exact_grad), rtol=1e-9, atol=1e-14)


def test_gaussian_privatizer_adds_noise_of_std_sigma_times_the_sensitivity():
  """jax_privacy's Gaussian privatizer at stddev σ·grad_fn.sensitivity(relation) on ḡ: the
  added noise has that standard deviation (chi-square interval over 8 steps' coordinates)."""
  from scipy import stats
  params, x, x_prime = _problem(n=16)
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, 0.1)
  _, clipped = jax.jit(grad_fn)(params, x, x_prime)
  sigma = 0.7
  for relation in (Relation.ADD_OR_REMOVE_ONE, Relation.REPLACE_ONE):
    stddev = sigma * grad_fn.sensitivity(relation)
    privatizer = noise_addition.gaussian_privatizer(stddev=stddev, prng_key=0)
    update = jax.jit(privatizer.update)
    state, samples = privatizer.init(params), []
    for _ in range(8):
      noisy, state = update(clipped, state)
      samples.append(flat(noisy) - flat(clipped))
    samples = np.concatenate(samples)
    lo, hi = stats.chi2.ppf([1e-6, 1 - 1e-6], samples.size) / samples.size
    assert lo < np.mean(samples ** 2) / stddev ** 2 < hi


def test_user_selection_strategy_drives_per_person_training_with_the_ledgers_epsilon():
  """jax_privacy's UserSelectionStrategy (people Poisson-sampled at the rate of
  make_private(user_ids=, max_pairs_per_user=K), K records each, repeats of a person with fewer
  dropped) picks the batches of the per-person train step, at most K records per person; its
  DpsgdTrainingAccountant over the people gives the per-person ledger's ε."""
  rng = np.random.default_rng(0)
  n, k, steps = 60, 2, 6
  user_ids = np.sort(rng.integers(0, 25, size=n)) * 7  # up to 25 people, 1 or more pairs each
  params, x, x_prime = _problem(n)
  private = logit_dp.make_private(embed_fn, LOSS, 1.0, target_epsilon=2.0, target_delta=1e-4,
                                  num_records=n, expected_batch_size=4, steps=steps,
                                  optimizer=optax.sgd(0.1), user_ids=user_ids, max_pairs_per_user=k)
  people = private.sampler.num_people
  assert private.sampling_rate == 4 / people and private.ledger.unit == "person"
  strategy = batch_selection.UserSelectionStrategy(
      batch_selection.CyclicPoissonSampling(
          sampling_prob=private.sampling_rate, iterations=steps,
          partition_type=batch_selection.PartitionType.INDEPENDENT), examples_per_user_per_batch=k,
      shuffle_per_user=True)
  train_step = private.make_train_step()
  opt_state = private.optimizer.init(params)
  width = private.sampler.max_batch_size
  for user_batch in strategy.batch_iterator(user_ids, rng=1):
    rows = np.unique(np.asarray(user_batch, np.int64))  # a person's repeats once
    owners, counts = np.unique(user_ids[rows], return_counts=True)
    assert counts.max(initial=0) <= k and len(owners) == len(user_batch)
    mask = np.arange(width) < rows.size
    rows = np.pad(rows, (0, width - rows.size))
    private.ledger.record_steps(1)
    params, opt_state, _ = train_step(params, opt_state, x[rows], x_prime[rows], mask)
  assert private.ledger.steps == private.ledger.released_updates == steps
  theirs = jp_accounting.DpsgdTrainingAccountant(
      jp_accounting.PldAccountantConfig(value_discretization_interval=1e-3)).compute_epsilon(
          steps,
          jp_accounting.DpParams(noise_multipliers=private.noise_multiplier, num_samples=people,
                                 delta=private.ledger.target_delta, batch_size=4))
  assert theirs == pytest.approx(private.ledger.epsilon(), rel=1e-9)
  assert private.ledger.epsilon() <= 2.0


def test_fine_tuning_noises_only_the_trainable_leaves_through_a_masked_privatizer():
  """Fine-tuning on the jax_privacy path: ḡ of clipped_grad(..., trainable=) and jax_privacy's
  Gaussian privatizer restricted to the trainable leaves (`logit_dp.finetune.masked_optimizer`):
  the frozen leaf gets exactly zero noise and never moves, the trained one gets noise of std
  σ·C (χ² test), and C is the sensitivity without trainable=."""
  from helpers import assert_noise_std  # pylint: disable=g-import-not-at-top
  params, x, x_prime = _problem(n=16)
  params["w2"] = jnp.ones((12, 256)) / 16  # 3,072 trained coordinates for the χ² test's power
  trainable = {"w1": False, "w2": True}
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, 0.1, trainable=trainable)
  assert grad_fn.sensitivity() == logit_dp.clipped_grad(embed_fn, LOSS, 0.1).sensitivity()
  stddev = 0.7 * grad_fn.sensitivity(Relation.ADD_OR_REMOVE_ONE)
  privatizer = logit_dp.finetune.masked_optimizer(
      noise_addition.gaussian_privatizer(stddev=stddev, prng_key=0), trainable)
  optimizer = logit_dp.finetune.masked_optimizer(optax.adam(1e-2), trainable)

  @jax.jit
  def train_step(params, noise_state, opt_state):
    _, clipped_sum = grad_fn(params, x, x_prime)
    noisy_sum, noise_state = privatizer.update(clipped_sum, noise_state, params)
    updates, opt_state = optimizer.update(noisy_sum, opt_state, params)
    return optax.apply_updates(params, updates), noise_state, opt_state, clipped_sum, noisy_sum

  noise_state, opt_state, p, noise = privatizer.init(params), optimizer.init(params), params, []
  for _ in range(2):
    p, noise_state, opt_state, clipped_sum, noisy_sum = train_step(p, noise_state, opt_state)
    assert not np.any(np.asarray(noisy_sum["w1"]))
    noise.append(np.asarray(noisy_sum["w2"]) - np.asarray(clipped_sum["w2"]))
  np.testing.assert_array_equal(p["w1"], params["w1"])
  assert_noise_std(noise, stddev)

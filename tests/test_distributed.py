"""Data-parallel Logit-DP over 1, 2, 4, 8 simulated CPU devices against the single-device call.

conftest.py sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is
imported. Multi-host (jax.distributed.initialize) cannot be exercised here; the
process-local feeding path (make_array_from_process_local_data) is run in one process.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import logit_dp
from conftest import MLP
from conftest import make_model
from conftest import require_devices
from helpers import assert_noise_std
from helpers import clip_norm_in_a_gap
from helpers import independence_threshold
from helpers import max_abs_correlation_z
from helpers import noise_std_is_rejected
from helpers import reference_grad
from helpers import rel_err
from helpers import tree_norm
from logit_dp import distributed

LOSSES = {
    "contrastive": logit_dp.losses.contrastive(temperature=0.5),
    "spreadout": logit_dp.losses.spreadout(),
}
DEVICE_COUNTS = (1, 2, 4, 8)
N = 16
MASK = np.array([1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1], bool)  # padding rows


@pytest.fixture(scope="module", autouse=True)
def _enough_devices():
  require_devices(max(DEVICE_COUNTS))


def _cache(fn):
  """functools.cache keyed on the arguments with the defaults filled in: _batch() and
  _batch("mlp", N, 0) are one entry, built (and compiled for) once."""
  cached = functools.cache(fn)
  signature = inspect.signature(fn)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return cached(*bound.args)

  return wrapper


@_cache
def _batch(kind="mlp", n=N, seed=0):
  embed_fn, params, x, x_prime = make_model(kind, n, seed)
  # A clip norm below most pair norms, so that clipping changes the result.
  norms = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, method="ghost")
  return embed_fn, params, x, x_prime, float(np.quantile(np.asarray(norms), 0.4))


@_cache
def _single(loss_name, method="ghost", kind="mlp", n=N, seed=0):
  """The single-device reference grad_fn (cached: one compile per configuration)."""
  embed_fn, _, _, _, clip_norm = _batch(kind, n, seed)
  return logit_dp.clipped_grad(embed_fn, LOSSES[loss_name], clip_norm, method=method)


@_cache
def _sharded(k, loss_name, method="ghost", kind="mlp", n=N, seed=0):
  """The data-parallel grad_fn on k devices (cached, shared between tests)."""
  embed_fn, _, _, _, clip_norm = _batch(kind, n, seed)
  return distributed.make_sharded_grad_fn(embed_fn, LOSSES[loss_name], clip_norm,
                                          distributed.data_mesh(k), method=method)


def _assert_same_on_every_device(tree):
  """Each device's own copy of a replicated output is bitwise the same."""
  for leaf in jax.tree_util.tree_leaves(tree):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(shards) == len(leaf.sharding.device_set)
    for s in shards[1:]:
      np.testing.assert_array_equal(s, shards[0])


def _assert_matches(sharded, reference, tol=1e-5):
  (value, grads), (ref_value, ref_grads) = sharded, reference
  np.testing.assert_allclose(value, ref_value, rtol=tol, atol=1e-6)
  assert rel_err(grads, ref_grads) < tol


# The default run keeps one device count per method, with the contrastive loss (spreadout is
# compared with the single device in test_nonfinite_pairs_raise_eagerly_like_single_device);
# the rest of the grid is slow.
_DEFAULT_GRID = {(4, "contrastive", "ghost")}
_EXTENDED_GRID = {(2, "contrastive", "triangle")}
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("k,loss_name,method", [
    pytest.param(
        k, loss_name, method, marks=() if
        (k, loss_name, method) in _DEFAULT_GRID else pytest.mark.extended if
        (k, loss_name, method) in _EXTENDED_GRID else _SLOW) for k in DEVICE_COUNTS
    for loss_name in sorted(LOSSES) for method in ("ghost", "triangle")
])
def test_sharded_equals_single_device(k, loss_name, method):
  _, params, x, x_prime, _ = _batch()
  single, sharded = _single(loss_name, method), _sharded(k, loss_name, method)
  out = sharded(params, x, x_prime)
  _assert_matches(out, single(params, x, x_prime))
  _assert_same_on_every_device(out)
  # Padding masks: masked rows contribute nothing, wherever they sit.
  masked = sharded(params, x, x_prime, MASK)
  _assert_matches(masked, single(params, x, x_prime, MASK))
  _assert_same_on_every_device(masked)


# Slow: padding masks are compared with one device by test_sharded_equals_single_device and
# pad_to_multiple by test_data_mesh_and_padding_helpers by default.
@pytest.mark.slow
@pytest.mark.parametrize("k", [4, 8])
def test_uneven_global_batch_is_padded(k):
  embed_fn, params, x, x_prime, clip_norm = _batch()
  x, x_prime = x[:13], x_prime[:13]
  sharded = _sharded(k, "contrastive")
  with pytest.raises(ValueError, match="pad_to_multiple"):
    sharded(params, x, x_prime)
  px, pxp, pmask = distributed.pad_to_multiple(x, x_prime, None, k)
  assert px.shape[0] == 16 and int(pmask.sum()) == 13
  reference = logit_dp.clipped_grad(embed_fn, LOSSES["contrastive"], clip_norm)(params, x, x_prime)
  _assert_matches(sharded(params, px, pxp, pmask), reference)
  # The host-feeding path (make_array_from_process_local_data; one process here).
  mesh = sharded.mesh
  gx, gxp, gmask = distributed.shard_batch(mesh, np.asarray(x), np.asarray(x_prime))
  assert gx.shape[0] == 16 and gx.sharding.spec == P("data")
  _assert_matches(sharded(distributed.replicate(params, mesh), gx, gxp, gmask), reference)


@pytest.mark.slow  # k = 8 with n = 8; test_sharded_equals_single_device covers the path
def test_one_pair_per_device():
  embed_fn, params, x, x_prime, clip_norm = _batch()
  x, x_prime = x[:8], x_prime[:8]
  loss = LOSSES["contrastive"]
  sharded = distributed.make_sharded_grad_fn(embed_fn, loss, clip_norm, distributed.data_mesh(8))
  reference = logit_dp.clipped_grad(embed_fn, loss, clip_norm)(params, x, x_prime)
  _assert_matches(sharded(params, x, x_prime), reference)


@pytest.mark.slow  # Algorithm 1 sharded; ghost and triangle are compared with one device by default
def test_materialize_sharded():
  embed_fn, params, x, x_prime, clip_norm = _batch("mlp", 6, 2)
  loss = LOSSES["spreadout"]
  mask = np.array([1, 1, 1, 0, 1, 1], bool)
  sharded = distributed.make_sharded_grad_fn(embed_fn, loss, clip_norm, distributed.data_mesh(2),
                                             method="materialize")
  reference = logit_dp.clipped_grad(embed_fn, loss, clip_norm, method="materialize")(params, x,
                                                                                     x_prime, mask)
  _assert_matches(sharded(params, x, x_prime, mask), reference)


@pytest.mark.extended
def test_naive_sharded():
  embed_fn, params, x, x_prime, _ = _batch()
  loss = LOSSES["contrastive"]
  single = logit_dp.baselines.naive_clipped_grad(embed_fn, loss, 0.1)
  sharded = distributed.make_sharded_grad_fn(embed_fn, loss, 0.1, distributed.data_mesh(8),
                                             naive=True)
  out = sharded(params, x, x_prime, MASK)
  _assert_matches(out, single(params, x, x_prime, MASK))
  np.testing.assert_allclose(tree_norm(out[1]), 0.1, rtol=1e-5)  # clipping was active


def _direct(k, method, check_vma):
  """The raw API: jax.shard_map(clipped_grad(..., axis_name="data"))."""
  embed_fn, params, x, x_prime, clip_norm = _batch()
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSSES["contrastive"], clip_norm, method=method,
                                  axis_name="data")
  mesh = Mesh(np.array(jax.devices()[:k]), ("data",))
  fn = jax.jit(
      jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                    out_specs=(P(), P()), check_vma=check_vma))
  mask = jnp.asarray(MASK)
  out = fn(params, x, x_prime, mask)
  _assert_matches(out, _single("contrastive", method)(params, x, x_prime, mask))


@pytest.mark.slow  # check_vma=False; make_sharded_grad_fn runs check_vma=True by default
def test_direct_shard_map_api():
  _direct(4, "ghost", check_vma=False)


@pytest.mark.slow  # make_sharded_grad_fn is this shard_map (check_vma=True), tested by default
@pytest.mark.parametrize("method", ["ghost", "triangle", "materialize"])
def test_direct_shard_map_default_check_vma(method):
  """JAX's default check_vma=True: derivatives must stay per device (no implicit psum)."""
  _direct(2, method, check_vma=True)


@pytest.mark.slow  # make_sharded_grad_fn(naive=True) runs the same under check_vma=True
def test_direct_shard_map_default_check_vma_naive():
  embed_fn, params, x, x_prime, clip_norm = _batch()
  grad_fn = logit_dp.baselines.naive_clipped_grad(embed_fn, LOSSES["contrastive"], clip_norm,
                                                  axis_name="data")
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  fn = jax.jit(
      jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                    out_specs=(P(), P())))
  mask = jnp.asarray(MASK)
  expected = logit_dp.baselines.naive_clipped_grad(embed_fn, LOSSES["contrastive"],
                                                   clip_norm)(params, x, x_prime, mask)
  _assert_matches(fn(params, x, x_prime, mask), expected)


SIGMA, NOISE_KEY = 2.0, jax.random.PRNGKey(3)


def _private_optimizer():
  _, _, _, _, clip_norm = _batch()
  # C of the global ḡ: (loss, B) and optionally the global batch size; no device count.
  c = logit_dp.sensitivity(LOSSES["contrastive"], clip_norm)
  return distributed.make_private_optimizer(SIGMA, c, NOISE_KEY, optax.sgd(1.0)), c


def _flat(tree):
  return np.concatenate(
      [np.ravel(np.asarray(leaf, np.float64)) for leaf in jax.tree_util.tree_leaves(tree)])


@pytest.mark.slow  # the sharded ḡ equals one device's (default: test_sharded_equals_single_device)
def test_removing_a_pair_moves_the_sharded_gradient_the_same_for_every_device_count():
  """Add-or-remove one pair (row 3 masked out): the change of the global ḡ is the same for
  every k and within the sensitivity of the single-device mechanism."""
  _, params, x, x_prime, _ = _batch()
  _, c = _private_optimizer()
  diffs = []
  for k in DEVICE_COUNTS:
    sharded = _sharded(k, "contrastive")
    g = _flat(sharded(params, x, x_prime, MASK)[1])
    diffs.append(g - _flat(sharded(params, x, x_prime, MASK & (np.arange(N) != 3))[1]))
  for diff in diffs[1:]:
    np.testing.assert_allclose(diff, diffs[0], rtol=0, atol=1e-5 * np.linalg.norm(diffs[0]))
  assert max(np.linalg.norm(d) for d in diffs) <= c


# A private run as make_private sets it up, stepped by make_private_train_step on k devices.
RUN_RECORDS, RUN_BATCH, RUN_STEPS, RUN_MAX_BATCH = 48, 8, 3, 24
RUN_EPSILON, RUN_DELTA = 4.0, 1e-5


@functools.cache
def _run_data():
  """A wider MLP than _batch's (520 parameters: 1,560 noise coordinates over the run, for the
  χ² test's power) and RUN_RECORDS pair records."""
  model = MLP(features=(32, 8))
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(5), 3)
  x = jax.random.normal(k1, (RUN_RECORDS, 7))
  x_prime = x + 0.5 * jax.random.normal(k2, x.shape)
  return model.apply, model.init(k3, x[:1]), np.asarray(x), np.asarray(x_prime)


def _make_run():
  embed_fn, _, _, _ = _run_data()
  return logit_dp.make_private(embed_fn, LOSSES["contrastive"], 0.05, target_epsilon=RUN_EPSILON,
                               target_delta=RUN_DELTA, num_records=RUN_RECORDS,
                               expected_batch_size=RUN_BATCH, optimizer=optax.sgd(1.0),
                               steps=RUN_STEPS, noise_key=NOISE_KEY, sampler_seed=11,
                               max_batch_size=RUN_MAX_BATCH)


@functools.cache
def _sharded_run(k):
  """RUN_STEPS private steps on k devices, the ledger recording each: the PrivateTraining it
  used, the final optimizer state, and per step (params before, params after, batch)."""
  embed_fn, params, data, data_prime = _run_data()
  run = _make_run()
  mesh = distributed.data_mesh(k)
  step = distributed.make_private_train_step(embed_fn, LOSSES["contrastive"], run.clip_norm, mesh,
                                             run.optimizer)
  params = distributed.replicate(params, mesh)
  state = distributed.replicate(run.optimizer.init(params), mesh)
  steps = []
  for t in range(RUN_STEPS):
    batch = run.sampler(t)
    idx, mask = np.asarray(batch.indices), np.asarray(batch.mask)
    new_params, state, _ = step(params, state, data[idx], data_prime[idx], mask)
    run.ledger.record_steps(1)
    _assert_same_on_every_device((new_params, state))
    steps.append(
        (jax.device_get(params), jax.device_get(new_params), (data[idx], data_prime[idx], mask)))
    params = new_params
  return run, state, steps


@functools.cache
def _dp_accounting_epsilon(sigma, q, steps, delta):
  """ε of T Poisson-subsampled Gaussian steps from dp_accounting's PLD accountant directly."""
  import dp_accounting  # pylint: disable=g-import-not-at-top
  accountant = dp_accounting.pld.PLDAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
      value_discretization_interval=1e-4)
  accountant.compose(
      dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
  return accountant.get_epsilon(delta)


@functools.cache
def _run_grad_fn(clip_norm):
  """The single-device ḡ of the run's model (jitted once)."""
  embed_fn, _, _, _ = _run_data()
  return jax.jit(logit_dp.clipped_grad(embed_fn, LOSSES["contrastive"], clip_norm))


def _released_noise(run, steps):
  """Per step, the noise of the released update: with sgd(1), params − new_params − ḡ, ḡ the
  single-device clipped sum on that step's batch and parameters."""
  grad_fn = _run_grad_fn(run.clip_norm)
  return [
      _flat(before) - _flat(after) - _flat(grad_fn(before, *batch)[1])
      for before, after, batch in steps
  ]


def test_accounting_does_not_depend_on_device_count():
  """For k = 1 and 8 devices (the sharded ḡ of every k is test_sharded_equals_single_device's):
  each run's σ, q, T (steps the noise transform took) and ledger give the same ε, within the
  budget; the noise is the same on every device and for every k, is N(0, (σC)²) on every
  coordinate (χ² test) and independent across steps."""
  epsilons, noises = {}, {}
  for k in (1, max(DEVICE_COUNTS)):
    run, state, steps = _sharded_run(k)
    sigma, q = run.noise_multiplier, run.sampler.sampling_rate
    num_steps = int(state[0].count)  # the noise transform's own step count
    assert num_steps == run.ledger.steps == RUN_STEPS
    assert (run.ledger.noise_multiplier, run.ledger.sampling_rate) == (sigma, q)
    epsilons[k] = _dp_accounting_epsilon(sigma, q, num_steps, run.ledger.target_delta)
    assert epsilons[k] <= RUN_EPSILON
    np.testing.assert_allclose(run.ledger.epsilon(), epsilons[k], rtol=1e-2)
    noises[k] = _released_noise(run, steps)
  assert len(set(epsilons.values())) == 1, epsilons
  reference = noises[DEVICE_COUNTS[0]]
  run = _sharded_run(DEVICE_COUNTS[0])[0]
  std = run.noise_multiplier * run.sensitivity
  for k in noises:  # the same noise vectors, up to ḡ's float rounding
    np.testing.assert_allclose(np.concatenate(noises[k]), np.concatenate(reference), rtol=0,
                               atol=1e-4 * std)
  # Two-sided χ² test at level 1e-6 over 3 × 520 coordinates; a std 15 % off either way is
  # rejected with probability ≥ 0.99 (asserted inside), a std half as large with certainty.
  assert_noise_std(reference, std)
  assert noise_std_is_rejected([0.5 * n for n in reference], std)  # σ halved, same key
  # Fresh noise at every step: Fisher z of every pair of steps, Bonferroni at level 1e-6.
  threshold = independence_threshold(num_pairs=3)
  assert max_abs_correlation_z(reference) < threshold
  assert max_abs_correlation_z([reference[0], reference[0]]) > threshold  # a reused step key


@pytest.mark.slow  # the same run, against the single-device optimizer update
def test_noise_is_identical_on_every_device_and_matches_single_device():
  embed_fn, _, _, _ = _run_data()
  run, _, steps = _sharded_run(8)
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSSES["contrastive"], run.clip_norm)
  state = run.optimizer.init(steps[0][0])
  for before, after, batch in steps:
    updates, state = run.optimizer.update(grad_fn(before, *batch)[1], state, before)
    assert rel_err(after, optax.apply_updates(before, updates)) < 1e-5


def test_data_mesh_and_padding_helpers():
  assert distributed.data_mesh().shape == {"data": jax.device_count()}
  assert distributed.data_mesh(-1).shape == {"data": jax.device_count()}
  assert distributed.data_mesh(2, axis_name="batch").shape == {"batch": 2}
  assert distributed.data_mesh(jax.devices()[2:5]).devices.tolist() == jax.devices()[2:5]
  for bad in (0, jax.device_count() + 1, -2):
    with pytest.raises(ValueError, match=r"devices must be -1 \(all\) or between 1"):
      distributed.data_mesh(bad)
  x, xp = np.ones((5, 3), np.float32), np.ones((5, 3), np.float32)
  px, pxp, pm = distributed.pad_to_multiple(x, xp, None, 4)
  assert isinstance(px, np.ndarray) and px.shape == (8, 3)
  assert pm.tolist() == [True] * 5 + [False] * 3
  assert not px[5:].any()
  jx, _, jm = distributed.pad_to_multiple(jnp.asarray(x), jnp.asarray(xp), np.arange(5) < 4, 5)
  assert isinstance(jx, jax.Array) and jx.shape == (5, 3) and jm.tolist() == [True] * 4 + [False]
  with pytest.raises(ValueError, match="multiple"):
    distributed.pad_to_multiple(x, xp, None, 0)
  with pytest.raises(ValueError, match="same number"):
    distributed.pad_to_multiple(x, xp[:4], None, 2)
  with pytest.raises(ValueError, match="axes"):
    distributed.make_sharded_grad_fn(lambda p, a: a, LOSSES["spreadout"], 1.0,
                                     distributed.data_mesh(2, axis_name="batch"))


@pytest.mark.extended
@pytest.mark.parametrize(
    "method,naive", [("ghost", False), pytest.param("ghost", True, marks=_SLOW)])
def test_sharded_stats_and_num_dropped_are_those_of_the_global_batch(method, naive):
  embed_fn, params, x, x_prime, _ = _batch()
  loss = LOSSES["contrastive"]
  used = np.asarray(logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, method),
                    np.float64)
  clip_norm = clip_norm_in_a_gap(used)
  sharded = distributed.make_sharded_grad_fn(embed_fn, loss, clip_norm, distributed.data_mesh(4),
                                             method=method, naive=naive)
  bad = x.at[5].set(jnp.nan)
  value, grads, stats = sharded.with_stats(params, bad, x_prime, MASK)
  _assert_same_on_every_device(stats)
  valid = MASK & (np.arange(N) != 5)
  assert int(stats.num_dropped) == 1 and int(stats.num_valid) == int(valid.sum())
  if naive:  # one norm, ‖∇ℒ‖ of the batch without its dropped row
    _, ref = reference_grad(embed_fn, loss, params, x, x_prime, valid)
    counted = np.array([tree_norm(ref)])
  else:
    counted = used[np.ix_(valid, valid)].ravel()
  assert int(stats.num_norms) == counted.size
  assert int(stats.num_clipped) == int(np.sum(counted > clip_norm))
  np.testing.assert_allclose(np.asarray(stats.quantiles),
                             np.quantile(counted, logit_dp.clip_methods.QUANTILE_LEVELS), rtol=1e-5)
  # with_num_dropped on the global batch: the same (ℒ, ḡ) and the dropped row.
  plain_value, plain_grads, dropped = sharded.with_num_dropped(params, bad, x_prime, MASK)
  assert int(dropped) == 1
  _assert_matches((value, grads), (plain_value, plain_grads), tol=1e-6)


@pytest.mark.extended
def test_nonfinite_pairs_raise_eagerly_like_single_device():
  _, params, x, x_prime, _ = _batch()
  sharded = _sharded(4, "spreadout")
  bad = x.at[5].set(jnp.nan)
  with pytest.raises(ValueError, match="non-finite"):
    sharded(params, bad, x_prime)
  # Masked garbage rows are padding and are fine.
  out = sharded(params, bad, x_prime, np.arange(N) != 5)
  _assert_matches(out, _single("spreadout")(params, x, x_prime, np.arange(N) != 5))

"""grad_fn.with_stats against brute force: pair norms from jax.grad, counts and numpy quantiles."""

import jax
import jax.extend  # noqa: F401  (jax.extend.core.jaxprs_in_params)
import jax.numpy as jnp
import numpy as np
import pytest

import logit_dp
from conftest import make_model
from helpers import clip_method
from helpers import clip_norm_in_a_gap
from helpers import reference_grad

LOSS = logit_dp.losses.contrastive(temperature=0.5)
MASK = jnp.array([True, True, False, True, True, True])


def _pair_norms(embed_fn, params, x, x_prime, positive_embed_fn=None):
  """‖∇_w Z_ij‖ of every pair (i, j), one jax.grad per pair, in float64 on the host."""
  positive_embed_fn = positive_embed_fn or embed_fn

  def z(p, xi, xj):
    u = logit_dp.losses.normalize(embed_fn(p, xi[None]))[0]
    v = logit_dp.losses.normalize(positive_embed_fn(p, xj[None]))[0]
    return jnp.dot(u, v)

  n = x.shape[0]
  rows, cols = np.divmod(np.arange(n * n), n)
  grads = jax.jit(jax.vmap(jax.grad(z), in_axes=(None, 0, 0)))(params, x[rows], x_prime[cols])
  sq = sum(
      np.sum(np.asarray(g, np.float64).reshape(n * n, -1) ** 2, axis=1)
      for g in jax.tree_util.tree_leaves(grads))
  return np.sqrt(sq).reshape(n, n)


def _expected(norms: np.ndarray, valid: np.ndarray, clip_norm: float):
  counted = norms[np.ix_(valid, valid)].ravel()
  return (counted.size, int(np.sum(counted > clip_norm)),
          np.quantile(counted, logit_dp.clip_methods.QUANTILE_LEVELS))


def _check(stats, norms, valid, clip_norm, rtol):
  num, clipped, quantiles = _expected(norms, valid, clip_norm)
  assert int(stats.num_valid) == int(np.sum(valid))
  assert int(stats.num_dropped) == 0
  assert int(stats.num_norms) == num
  assert int(stats.num_clipped) == clipped
  np.testing.assert_allclose(float(stats.fraction_clipped), clipped / num, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(stats.quantiles), quantiles, rtol=rtol)
  np.testing.assert_allclose(float(stats.median_norm), quantiles[2], rtol=rtol)


def _grad_fns(method, embed_fn, x, **kwargs):
  return logit_dp.clipped_grad(embed_fn, LOSS, kwargs.pop("clip_norm"), clip_method(method, x),
                               **kwargs)


_SLOW = pytest.mark.slow
# The default run keeps ghost (one block and blocked), materialize, shared two towers with
# ghost and Naive-DP; the rest of the grid is slow.


@pytest.mark.extended
@pytest.mark.parametrize(
    "method",
    [m if m == "ghost" else pytest.param(m, marks=_SLOW) for m in logit_dp.clip_methods.METHODS])
def test_stats_are_those_of_the_norms_clipping_used(method):
  # The norms clipping uses (allowances and bounds included) are `pair_grad_norms`.
  embed_fn, params, x, x_prime = make_model("mlp", n=6)
  used = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, clip_method(method, x)),
      np.float64)
  clip_norm = clip_norm_in_a_gap(used)
  fn = _grad_fns(method, embed_fn, x, clip_norm=clip_norm)
  loss, grads, stats = fn.with_stats(params, x, x_prime, MASK)
  _check(stats, used, np.asarray(MASK), clip_norm, rtol=1e-5)
  plain_loss, plain_grads = fn(params, x, x_prime, MASK)  # the default call: the same (ℒ, ḡ)
  np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads,
                         plain_grads)


@pytest.mark.parametrize("method,budget", [
    pytest.param("ghost", None, marks=_SLOW), ("ghost", 1),
    pytest.param("materialize", None, marks=pytest.mark.extended)
])
def test_exact_methods_match_brute_force_pair_norms(method, budget, no_float_allowance):
  # budget=1 byte: "ghost" in blocks of one row and one column.
  embed_fn, params, x, x_prime = make_model("mlp", n=6, seed=2)
  norms = _pair_norms(embed_fn, params, x, x_prime)
  clip_norm = clip_norm_in_a_gap(norms)
  kwargs = {} if budget is None else {"memory_budget": budget}
  fn = _grad_fns(method, embed_fn, x, clip_norm=clip_norm, **kwargs)
  _, _, stats = jax.jit(fn.with_stats)(params, x, x_prime, MASK)
  _check(stats, norms, np.asarray(MASK), clip_norm, rtol=1e-5)


@_SLOW
@pytest.mark.parametrize("method", ["triangle", "projected"])
def test_bound_methods_clip_at_least_the_brute_force_count(method):
  embed_fn, params, x, x_prime = make_model("mlp", n=6, seed=2)
  norms = _pair_norms(embed_fn, params, x, x_prime)
  clip_norm = clip_norm_in_a_gap(norms)
  _, _, stats = _grad_fns(method, embed_fn, x, clip_norm=clip_norm).with_stats(params, x, x_prime)
  num, clipped, quantiles = _expected(norms, np.ones(6, bool), clip_norm)
  assert int(stats.num_norms) == num and int(stats.num_clipped) >= clipped
  assert np.all(np.asarray(stats.quantiles) >= quantiles * (1 - 1e-6))


def _two_towers(shared: bool):
  k = jax.random.split(jax.random.PRNGKey(3), 5)
  params = {
      "a": jax.random.normal(k[0], (4, 6)) / 2, "b": jax.random.normal(k[1], (3, 6)) / 2,
      "h": jax.random.normal(k[2], (6, 5)) / 2, "h2": jax.random.normal(k[3], (6, 5)) / 2
  }
  f = lambda p, xs: jnp.tanh(xs @ p["a"]) @ p["h"]
  g = lambda p, xs: jnp.tanh(xs @ p["b"]) @ p["h" if shared else "h2"]
  x = jax.random.normal(k[4], (6, 4))
  x_prime = jax.random.normal(jax.random.PRNGKey(4), (6, 3))
  return f, g, params, x, x_prime


@pytest.mark.parametrize("method,shared", [
    pytest.param(method, shared, marks=_SLOW) for method in ("ghost", "triangle", "materialize")
    for shared in (False, True)
])
def test_two_towers(method, shared, no_float_allowance):
  f, g, params, x, x_prime = _two_towers(shared)
  norms = _pair_norms(f, params, x, x_prime, positive_embed_fn=g)
  clip_norm = clip_norm_in_a_gap(norms)
  fn = logit_dp.clipped_grad(f, LOSS, clip_norm, method, positive_embed_fn=g)
  _, _, stats = fn.with_stats(params, x, x_prime, MASK)
  if method == "triangle" and shared:  # the bound √a + √b: clips at least as much
    num, clipped, quantiles = _expected(norms, np.asarray(MASK), clip_norm)
    assert int(stats.num_norms) == num and int(stats.num_clipped) >= clipped
    assert np.all(np.asarray(stats.quantiles) >= quantiles * (1 - 1e-6))
  else:
    _check(stats, norms, np.asarray(MASK), clip_norm, rtol=1e-5)


@_SLOW
def test_infinite_clip_norm_clips_nothing():
  embed_fn, params, x, x_prime = make_model("mlp", n=6)
  _, _, stats = logit_dp.clipped_grad(embed_fn, LOSS, jnp.inf).with_stats(params, x, x_prime)
  assert int(stats.num_clipped) == 0 and float(stats.fraction_clipped) == 0.0


def test_empty_batch_reports_no_valid_pair():
  embed_fn, params, x, x_prime = make_model("mlp", n=6)
  fn = logit_dp.clipped_grad(embed_fn, LOSS, 1.0)
  loss, _, stats = fn.with_stats(params, x, x_prime, jnp.zeros(6, bool))
  assert float(loss) == 0.0
  assert int(stats.num_valid) == 0 and int(stats.num_norms) == 0
  assert int(stats.num_clipped) == 0
  assert np.isnan(float(stats.fraction_clipped)) and np.all(np.isnan(stats.quantiles))


@_SLOW
def test_dropped_rows_are_counted_and_not_in_the_norms():
  embed_fn, params, x, x_prime = make_model("mlp", n=6)
  bad = x.at[1].set(jnp.nan)
  used = np.asarray(logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime), np.float64)
  clip_norm = clip_norm_in_a_gap(used)
  fn = logit_dp.clipped_grad(embed_fn, LOSS, clip_norm)
  _, _, stats = fn.with_stats(params, bad, x_prime, MASK)
  valid = np.asarray(MASK).copy()
  valid[1] = False
  assert int(stats.num_dropped) == 1
  num, clipped, quantiles = _expected(used, valid, clip_norm)
  assert int(stats.num_valid) == int(np.sum(valid)) and int(stats.num_norms) == num
  assert int(stats.num_clipped) == clipped
  np.testing.assert_allclose(np.asarray(stats.quantiles), quantiles, rtol=1e-5)


@pytest.mark.parametrize("clip_norm", [pytest.param(c, marks=_SLOW) for c in (1e-3, 1e3)])
def test_naive_dp_reports_its_one_norm(clip_norm):
  embed_fn, params, x, x_prime = make_model("mlp", n=6)
  _, ref = reference_grad(embed_fn, LOSS, params, x, x_prime, MASK)
  norm = np.sqrt(sum(
      np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree_util.tree_leaves(ref)))
  fn = logit_dp.baselines.naive_clipped_grad(embed_fn, LOSS, clip_norm)
  _, _, stats = fn.with_stats(params, x, x_prime, MASK)
  assert int(stats.num_norms) == 1 and int(stats.num_valid) == 5
  assert int(stats.num_clipped) == int(norm > clip_norm)
  np.testing.assert_allclose(np.asarray(stats.quantiles), np.full(5, norm), rtol=1e-5)


def test_stats_are_a_pytree_and_log_as_numbers():
  embed_fn, params, x, x_prime = make_model("mlp", n=6)
  _, _, stats = logit_dp.clipped_grad(embed_fn, LOSS, 1.0).with_stats(params, x, x_prime)
  assert isinstance(stats, logit_dp.clip_methods.ClipStats)
  logged = stats.as_dict()
  assert logged["num_norms"] == 36
  assert logged["norm_median"] == float(stats.median_norm)
  assert logged["fraction_clipped"] == float(stats.fraction_clipped)
  assert len(jax.tree_util.tree_leaves(stats)) == 5


def _primitives(jaxpr) -> set:
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitives(sub)
  return names


def test_the_plain_call_does_not_compute_the_statistics():
  # The quantiles sort the norms: only the statistics' computation holds a sort.
  embed_fn, params, x, x_prime = make_model("mlp", n=6)
  fn = logit_dp.clipped_grad(embed_fn, LOSS, 1.0)
  mask = jnp.ones((6,), bool)
  plain = _primitives(jax.make_jaxpr(fn.core)(params, x, x_prime, mask).jaxpr)
  stats = _primitives(jax.make_jaxpr(fn.stats_core)(params, x, x_prime, mask).jaxpr)
  assert "sort" in stats and "sort" not in plain

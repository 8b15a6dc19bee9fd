"""logit_dp.transform: Gaussian noise of the right scale, independent across leaves and steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import logit_dp
from helpers import assert_noise_std
from helpers import flat
from helpers import independence_threshold
from helpers import max_abs_correlation_z
from helpers import noise_std_is_rejected


def _noise(tx, updates, steps):
  state = tx.init(updates)
  draws = []
  for _ in range(steps):
    out, state = tx.update(updates, state)
    draws.append(jax.tree_util.tree_map(lambda o, u: np.asarray(o - u, np.float64), out, updates))
  return draws, state


def test_noise_is_gaussian_with_std_sigma_times_c_on_every_leaf():
  sigma, c = 1.3, 2.5
  tx = logit_dp.transform(noise_multiplier=sigma, sensitivity=c, key=jax.random.key(0))
  updates = {
      "w": jnp.full((40, 50), 3.0), "b": jnp.zeros((2000,)), "h": {"k": jnp.ones((10, 20, 10))}
  }
  draws, _ = _noise(tx, updates, steps=2)
  # Every leaf, and all of them together: a two-sided χ² test at level 1e-6 whose power against
  # a std 15 % too large or too small is ≥ 0.99 (asserted by assert_noise_std).
  for path in ("w", "b", "h"):
    assert_noise_std([d[path] for d in draws], sigma * c)
  assert_noise_std(draws, sigma * c)
  samples = np.concatenate([flat(d) for d in draws])
  assert stats.kstest(samples / (sigma * c), "norm").pvalue > 1e-3  # Gaussian in shape too
  # Negative controls: the same test rejects σ 2× or 15 % too small, and a leaf left un-noised.
  for wrong in (0.5, 0.85, 1.15):
    bad = logit_dp.transform(wrong * sigma, c, key=jax.random.key(0))
    assert noise_std_is_rejected(_noise(bad, updates, steps=2)[0], sigma * c)
  skipped = _noise(_defective_transform(sigma, c, jax.random.key(0), noised_leaves=2), updates,
                   steps=2)[0]
  assert not noise_std_is_rejected([d["b"] for d in skipped], sigma * c)
  assert noise_std_is_rejected([d["w"] for d in skipped], sigma * c)


def _defective_transform(sigma, c, key, *, same_key_for_leaves=False, same_key_for_steps=False,
                         noised_leaves=None):
  """`logit_dp.transform` with one defect, for negative controls: one key for every leaf, one
  key for every step (no fold_in of the count), or noise on the first `noised_leaves` only."""
  def init_fn(params):
    del params
    return jnp.zeros([], jnp.int32)

  def update_fn(updates, count, params=None):
    del params
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    step_key = key if same_key_for_steps else jax.random.fold_in(key, count)
    keys = [step_key] * len(leaves) if same_key_for_leaves else jax.random.split(
        step_key, len(leaves))
    limit = len(leaves) if noised_leaves is None else noised_leaves
    noisy = [
        leaf + (sigma * c * jax.random.normal(k, leaf.shape) if i < limit else 0.0)
        for i, (leaf, k) in enumerate(zip(leaves, keys))
    ]
    return jax.tree_util.tree_unflatten(treedef, noisy), count + 1

  return optax.GradientTransformation(init_fn, update_fn)


def _independence_statistic(tx, steps=3):
  """max Fisher z of the correlation over every pair of (leaf, step) noise series, and the
  Bonferroni threshold at level 1e-6 for that many pairs."""
  updates = {
      "a": jnp.zeros((4000,)), "b": jnp.zeros((4000,)), "c": {"d": jnp.zeros((4000,))},
      "e": jnp.zeros((50, 40))
  }
  draws, _ = _noise(tx, updates, steps)
  series = [leaf.ravel() for d in draws for leaf in jax.tree_util.tree_leaves(d)]
  num_pairs = len(series) * (len(series) - 1) // 2
  return max_abs_correlation_z(series), independence_threshold(num_pairs)


def test_every_leaf_and_step_gets_independent_noise():
  key = jax.random.PRNGKey(3)
  tx = logit_dp.transform(noise_multiplier=1.0, sensitivity=1.0, key=key)
  z, threshold = _independence_statistic(tx)
  assert z < threshold, (z, threshold)
  draws, state = _noise(tx, {"a": jnp.zeros((4000,)), "b": jnp.zeros((4000,))}, steps=2)
  # The difference of two leaves is noised too (the released-code bug would make it exact).
  assert_noise_std(draws[0]["a"] - draws[0]["b"], np.sqrt(2))
  assert int(state.count) == 2
  # Negative controls: a key shared between leaves, or between steps, is caught (r = 1).
  for defect in ("same_key_for_leaves", "same_key_for_steps"):
    z, threshold = _independence_statistic(_defective_transform(1.0, 1.0, key, **{defect: True}))
    assert z > threshold, defect


def test_noise_depends_only_on_key_and_step_count():
  updates = {"w": jnp.zeros((10,))}
  tx = logit_dp.transform(noise_multiplier=1.0, sensitivity=1.0, key=jax.random.PRNGKey(7))
  a, _ = _noise(tx, updates, steps=3)
  state = tx.init(updates)._replace(count=jnp.asarray(2, jnp.int32))  # a resumed run
  resumed, _ = tx.update(updates, state)
  np.testing.assert_array_equal(np.asarray(resumed["w"]), a[2]["w"])
  other = logit_dp.transform(noise_multiplier=1.0, sensitivity=1.0, key=jax.random.PRNGKey(8))
  b, _ = _noise(other, updates, steps=1)
  assert not np.allclose(a[0]["w"], b[0]["w"])


def test_transform_composes_and_jits_in_an_optax_chain():
  tx = optax.chain(logit_dp.transform(0.5, 2.0, key=jax.random.key(1)), optax.adam(1e-2))
  params = {"w": jnp.ones((3,))}
  state = tx.init(params)
  step = jax.jit(lambda g, s: tx.update(g, s, params))
  updates, state = step({"w": jnp.ones((3,))}, state)
  updates, state = step({"w": jnp.ones((3,))}, state)
  assert int(state[0].count) == 2 and np.all(np.isfinite(updates["w"]))


def test_zero_noise_requires_explicit_opt_in():
  with pytest.raises(ValueError, match="not private"):
    logit_dp.transform(noise_multiplier=0.0, sensitivity=1.0, key=jax.random.key(0))
  tx = logit_dp.transform(0.0, 1.0, key=jax.random.key(0), allow_zero_noise=True)
  out, _ = tx.update({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)}))
  np.testing.assert_array_equal(out["w"], np.ones(3))


@pytest.mark.parametrize("sigma, c", [(-0.1, 1.0), (float("nan"), 1.0), (float("inf"), 1.0),
                                      (1.0, 0.0), (1.0, -2.0), (1.0, float("inf")),
                                      (1.0, float("nan"))])
def test_bad_noise_arguments(sigma, c):
  with pytest.raises(ValueError):
    logit_dp.transform(noise_multiplier=sigma, sensitivity=c, key=jax.random.key(0))


def test_bad_key():
  with pytest.raises(ValueError, match="key"):
    logit_dp.transform(1.0, 1.0, key=jnp.array([1.0, 2.0]))

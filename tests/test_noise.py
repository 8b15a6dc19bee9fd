"""logit_dp.transform: Gaussian noise of the right scale, independent across leaves and steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import logit_dp


def _noise(tx, updates, steps):
  state = tx.init(updates)
  draws = []
  for _ in range(steps):
    out, state = tx.update(updates, state)
    draws.append(jax.tree_util.tree_map(lambda o, u: np.asarray(o - u, np.float64), out, updates))
  return draws, state


def test_noise_is_gaussian_with_std_sigma_times_c():
  sigma, c = 1.3, 2.5
  tx = logit_dp.transform(noise_multiplier=sigma, sensitivity=c, key=jax.random.key(0))
  updates = {"w": jnp.full((200, 50), 3.0), "b": jnp.zeros((7,))}
  draws, _ = _noise(tx, updates, steps=2)
  samples = np.concatenate([d["w"].ravel() for d in draws])
  result = stats.kstest(samples / (sigma * c), "norm")
  assert result.pvalue > 1e-3
  np.testing.assert_allclose(samples.std(), sigma * c, rtol=0.02)
  # Wrong scales are rejected by the same test: it has power.
  assert stats.kstest(samples / (1.1 * sigma * c), "norm").pvalue < 1e-6


def test_equal_shaped_leaves_and_steps_get_independent_noise():
  tx = logit_dp.transform(noise_multiplier=1.0, sensitivity=1.0, key=jax.random.PRNGKey(3))
  updates = {"a": jnp.zeros((4000,)), "b": jnp.zeros((4000,)), "c": {"d": jnp.zeros((4000,))}}
  draws, state = _noise(tx, updates, steps=2)
  series = [draws[0]["a"], draws[0]["b"], draws[0]["c"]["d"], draws[1]["a"]]
  for i in range(len(series)):
    for j in range(i + 1, len(series)):
      assert not np.allclose(series[i], series[j])
      r, p = stats.pearsonr(series[i], series[j])
      assert abs(r) < 0.07, (i, j, r)
  # The difference of two leaves is noised too (the released-code bug would make it exact).
  np.testing.assert_allclose(np.std(series[0] - series[1]), np.sqrt(2), rtol=0.05)
  assert int(state.count) == 2


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

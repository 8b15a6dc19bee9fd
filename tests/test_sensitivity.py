"""Sensitivity constants: formulas, the τ-level worst case, and ḡ on neighbouring batches."""

import functools
import math
import warnings

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logit_dp
from conftest import make_model
from helpers import flat


def weight_change(loss, z, k):
  """Σ_j|τ_kj| + Σ_{i≠k}|τ_ik| + Σ_{i,j≠k}|τ_ij − τ'_ij| from jax.grad of the loss.

  This is ‖ḡ(X) − ḡ(X∖k)‖/B when every clipped pair gradient has norm B and the
  directions align with the signs: the quantity the sensitivity must bound.
  """
  n = z.shape[0]
  grad = _jitted_grad(loss)
  tau = np.asarray(grad(z), np.float64)
  keep = np.arange(n) != k
  tau_without = np.asarray(grad(z[keep][:, keep]), np.float64)
  others = tau[keep][:, keep]
  return (np.abs(tau[k]).sum() + np.abs(tau[keep, k]).sum() + np.abs(others - tau_without).sum())


@functools.cache
def _jitted_grad(loss):
  return jax.jit(jax.grad(loss))


def adversarial_contrastive_z(n, k=0):
  """Row k's diagonal least similar, every other row's column k most similar.

  Realised by 1-D unit embeddings û_k = 1, v̂_k = −1, û_i = −1, v̂_j = 1 (i, j ≠ k).
  """
  u = -np.ones(n)
  u[k] = 1.0
  v = np.ones(n)
  v[k] = -1.0
  return jnp.asarray(np.outer(u, v), jnp.float32)


# The default run keeps one temperature per batch size n ≥ 3 (where Lemma 3.4 is compared);
# the rest of the grid is slow.
@pytest.mark.parametrize("n,temperature", [
    pytest.param(n, t, marks=() if (n, t) in ((3, 0.5), (8, 1.0), (40, 2.0)) else pytest.mark.slow)
    for n in (2, 3, 8, 40) for t in (0.5, 1.0, 2.0)
])
def test_contrastive_constant_is_attained_and_exceeds_the_papers_lemma(temperature, n):
  loss = logit_dp.losses.contrastive(temperature)
  factor = loss.sensitivity_factor(n)
  a = math.exp(2 / temperature)
  p = a / (a + n - 1)
  np.testing.assert_allclose(factor, (2 + 2 * (n - 1) * p) / temperature, rtol=1e-12)
  worst = weight_change(loss, adversarial_contrastive_z(n), k=0)
  assert worst <= factor * (1 + 1e-5)
  # Attained exactly, up to the diagonal softmax s_kk = 1/(1 + (n−1)a) of row k.
  s_kk = 1 / (1 + (n - 1) * a)
  np.testing.assert_allclose(worst, (2 * (1 - s_kk) + 2 * (n - 1) * p) / temperature, rtol=1e-5)
  paper = 2 * (1 + (n - 2) * p) / temperature
  if n >= 3:
    assert worst > paper  # Lemma 3.4's constant is too small


@pytest.mark.parametrize("loss", [logit_dp.losses.contrastive(0.7),
                                  logit_dp.losses.spreadout()], ids=["contrastive", "spreadout"])
def test_random_similarity_matrices_stay_below_the_constant(loss):
  rng = np.random.default_rng(0)
  for n in (2, 3, 5, 12):
    for _ in range(20):
      u = rng.normal(size=(n, 3))
      v = rng.normal(size=(n, 3))
      z = logit_dp.losses.cosine_similarity(jnp.asarray(u), jnp.asarray(v))
      worst = max(weight_change(loss, z, k) for k in range(n))
      assert worst <= loss.sensitivity_factor(n) * (1 + 1e-5)


def test_spreadout_extreme_configuration():
  loss = logit_dp.losses.spreadout()
  for n in (3, 6, 20):
    z = jnp.ones((n, n))  # every pair maximally similar
    worst = weight_change(loss, z, k=0)
    # G1 = G2 = 2 and L = 2/(n−1)·(n−1)... = 2 attained exactly: the constant 6 is tight.
    np.testing.assert_allclose(worst, 6.0, rtol=1e-6)


def test_sensitivity_values_supremum_and_monotonicity():
  loss = logit_dp.losses.contrastive(1.0)
  sup = logit_dp.sensitivity(loss, clip_norm=1.0)
  np.testing.assert_allclose(sup, 2 * (1 + math.exp(2)), rtol=1e-12)
  values = [logit_dp.sensitivity(loss, 1.0, batch_size=n) for n in (2, 10, 100, 10 ** 4, 10 ** 8)]
  assert all(a < b for a, b in zip(values, values[1:])) and values[-1] < sup
  np.testing.assert_allclose(values[-1], sup, rtol=1e-5)
  assert logit_dp.sensitivity(loss, clip_norm=3.0) == pytest.approx(3 * sup)
  assert logit_dp.sensitivity(logit_dp.losses.spreadout(), 0.5, batch_size=7) == 3.0
  assert logit_dp.baselines.naive_sensitivity(0.25) == 0.5


def test_low_temperature_price_is_visible():
  with pytest.warns(logit_dp.losses.LargeSensitivityWarning, match="temperature 0.2"):
    c = logit_dp.sensitivity(logit_dp.losses.contrastive(0.2), clip_norm=1.0)
  assert 2.0e5 < c < 2.3e5
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    logit_dp.sensitivity(logit_dp.losses.contrastive(1.0), clip_norm=1.0)  # no warning


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_sensitivity_arguments(bad):
  with pytest.raises(ValueError):
    logit_dp.sensitivity(logit_dp.losses.spreadout(), clip_norm=bad)
  with pytest.raises(ValueError):
    logit_dp.baselines.naive_sensitivity(bad)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), 1e-4])
def test_bad_temperature(bad):
  with pytest.raises(ValueError, match="temperature"):
    logit_dp.losses.contrastive(bad)


def test_bad_batch_size_and_unknown_loss():
  with pytest.raises(ValueError, match="batch_size"):
    logit_dp.sensitivity(logit_dp.losses.contrastive(1.0), 1.0, batch_size=1)
  with pytest.raises(ValueError, match="No sensitivity"):
    logit_dp.sensitivity(lambda z, mask=None: jnp.sum(z), 1.0)


# ---------------------------------------------------------------------------------------------
# Replace-one.
# ---------------------------------------------------------------------------------------------

REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
ADD_OR_REMOVE_ONE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE_SPECIAL = dp_accounting.NeighboringRelation.REPLACE_SPECIAL


def replace_weight_change(loss, z, z_replaced, k):
  """Σ_j(|τ_kj| + |τ̃_kj|) + Σ_{i≠k}(|τ_ik| + |τ̃_ik|) + Σ_{i,j≠k}|τ_ij − τ̃_ij| in float64 from
  jax.grad of the loss, τ̃ on the batch whose pair k is replaced (z_replaced differs from z in
  row k and column k only).

  This is ‖ḡ(X) − ḡ(X̃)‖/B when every clipped pair gradient has norm B, pair k's old and new
  gradients point opposite ways and the rest align with the signs: what C_rep must bound.
  """
  with jax.enable_x64(True):
    grad = _jitted_grad(loss)
    tau = np.asarray(grad(jnp.asarray(z, jnp.float64)))
    tau_r = np.asarray(grad(jnp.asarray(z_replaced, jnp.float64)))
  keep = np.arange(z.shape[0]) != k
  return (np.abs(tau[k]).sum() + np.abs(tau_r[k]).sum() + np.abs(tau[keep, k]).sum()
          + np.abs(tau_r[keep, k]).sum() + np.abs(tau[keep][:, keep] - tau_r[keep][:, keep]).sum())


@pytest.mark.parametrize("n,temperature", [(2, 1.0), (3, 0.5), (8, 1.0), (40, 2.0)])
def test_contrastive_replace_one_constant_is_attained_and_needs_more_than_c(temperature, n):
  loss = logit_dp.losses.contrastive(temperature)
  factor = loss.replace_sensitivity_factor(n)
  a = math.exp(2 / temperature)
  p = a / (a + n - 1)
  np.testing.assert_allclose(factor, (4 + 2 * (n - 1) * p) / temperature, rtol=1e-12)
  # The removal worst case on both sides: row k's diagonal least similar, every other row's
  # column k most similar, before and after the replacement.
  z = np.asarray(adversarial_contrastive_z(n), np.float64)
  worst = replace_weight_change(loss, z, z, k=0)
  s_kk = 1 / (1 + (n - 1) * a)
  np.testing.assert_allclose(worst, (4 * (1 - s_kk) + 2 * (n - 1) * p) / temperature, rtol=1e-12)
  assert worst <= factor
  # Replace-one needs more than the removal constant C, and less than 2C.
  assert loss.sensitivity_factor(n) < worst and factor < 2 * loss.sensitivity_factor(n)


@pytest.mark.parametrize("loss", [logit_dp.losses.contrastive(0.7),
                                  logit_dp.losses.spreadout()], ids=["contrastive", "spreadout"])
def test_random_replacements_stay_below_the_replace_one_constant(loss):
  rng = np.random.default_rng(0)
  for n in (2, 3, 5, 12):
    for _ in range(20):
      u, v = rng.normal(size=(n, 3)), rng.normal(size=(n, 3))
      k = int(rng.integers(n))
      u_r, v_r = u.copy(), v.copy()
      u_r[k], v_r[k] = rng.normal(size=3), rng.normal(size=3)
      cos = lambda a, b: (a / np.linalg.norm(a, axis=1, keepdims=True)) @ (b / np.linalg.norm(
          b, axis=1, keepdims=True)).T
      worst = replace_weight_change(loss, cos(u, v), cos(u_r, v_r), k)
      assert worst <= loss.replace_sensitivity_factor(n) * (1 + 1e-12)


def test_spreadout_replace_one_constant_is_attained():
  loss = logit_dp.losses.spreadout()
  for n in (2, 3, 6, 20):
    z = np.ones((n, n))  # every pair maximally similar, before and after
    np.testing.assert_allclose(replace_weight_change(loss, z, z, k=0), 8.0, rtol=1e-12)
    assert loss.replace_sensitivity_factor(n) == 8.0 and loss.sensitivity_factor(n) == 6.0


def test_sensitivity_under_each_neighboring_relation():
  loss, clip_norm, n = logit_dp.losses.contrastive(1.0), 0.5, 8
  embed_fn = lambda w, xs: xs @ w
  logit = logit_dp.clipped_grad(embed_fn, loss, clip_norm)
  c, c_n = logit_dp.sensitivity(loss, clip_norm), logit_dp.sensitivity(loss, clip_norm, n)
  assert logit.sensitivity() == logit.sensitivity(ADD_OR_REMOVE_ONE) == c
  assert logit.sensitivity(REPLACE_SPECIAL) == c  # zero-out: the pair masked out, as removal
  assert logit.sensitivity(batch_size=n) == logit.sensitivity(ADD_OR_REMOVE_ONE, batch_size=n)
  assert logit.sensitivity(batch_size=n) == c_n
  np.testing.assert_allclose(logit.sensitivity(REPLACE_ONE), c + 2 * clip_norm, rtol=1e-12)
  np.testing.assert_allclose(logit.sensitivity(REPLACE_ONE, batch_size=n), c_n + 2 * clip_norm,
                             rtol=1e-12)
  assert logit.sensitivity(REPLACE_ONE) == logit_dp.sensitivity(loss, clip_norm,
                                                                neighboring_relation=REPLACE_ONE)
  spread = logit_dp.clipped_grad(embed_fn, logit_dp.losses.spreadout(), clip_norm)
  assert (spread.sensitivity(), spread.sensitivity(REPLACE_ONE)) == (3.0, 4.0)
  naive = logit_dp.baselines.naive_clipped_grad(embed_fn, loss, clip_norm)
  grouped = logit_dp.baselines.grouped_clipped_grad(embed_fn, loss, clip_norm, 4)
  for fn in (naive, grouped):
    assert [fn.sensitivity(r) for r in dp_accounting.NeighboringRelation] == [1.0, 1.0, 1.0]
  # A loss with only the removal constant gets 2C, valid for every loss.
  removal_only = type("RemovalOnly", (), dict(sensitivity_factor=lambda self, n=None: 5.0))()
  assert logit_dp.sensitivity(removal_only, clip_norm, neighboring_relation=REPLACE_ONE) == 5.0
  with pytest.warns(DeprecationWarning, match="batch_size=n"):
    assert logit.sensitivity(n) == c_n
  for bad in ("replace_one", 2.0, REPLACE_ONE.value + 0.5):
    with pytest.raises(TypeError, match="NeighboringRelation"):
      logit.sensitivity(bad)
  with pytest.raises(TypeError, match="NeighboringRelation"):
    logit_dp.baselines.naive_sensitivity(1.0, neighboring_relation="add_or_remove_one")


def _neighbour_differences(fn, params, x, x_prime):
  n = x.shape[0]
  _, full = fn(params, x, x_prime, jnp.ones((n,), bool))
  diffs = []
  for k in range(n):
    mask = jnp.arange(n) != k
    _, without = fn(params, x, x_prime, mask)  # mask == removing pair k
    diffs.append(np.linalg.norm(flat(full) - flat(without)))
  return np.array(diffs)


@pytest.mark.parametrize("loss", [logit_dp.losses.contrastive(0.5),
                                  logit_dp.losses.spreadout()], ids=["contrastive", "spreadout"])
@pytest.mark.parametrize("kind", ["mlp", pytest.param("conv", marks=pytest.mark.slow)])
def test_removing_any_pair_moves_clipped_gradient_by_at_most_c(kind, loss):
  clip_norm = 0.05  # every pair is clipped
  c = logit_dp.sensitivity(loss, clip_norm, batch_size=6)
  fn = None
  for seed in range(2):
    embed_fn, params, x, x_prime = make_model(kind, n=6, seed=seed)
    fn = fn or jax.jit(logit_dp.clipped_grad(embed_fn, loss, clip_norm))
    assert np.all(_neighbour_differences(fn, params, x, x_prime) <= c)


def _adversarial_problem(n=6, d=3):
  """Linear embeddings near the τ-level worst case for pair 0 (`adversarial_contrastive_z`)."""
  rng = np.random.default_rng(1)
  u = -np.ones(n)
  u[0] = 1.0
  v = np.ones(n)
  v[0] = -1.0
  x = np.zeros((n, d))
  x[:, 0] = u
  x_prime = np.zeros((n, d))
  x_prime[:, 0] = v
  x += 0.05 * rng.normal(size=x.shape)
  x_prime += 0.05 * rng.normal(size=x.shape)
  embed_fn = lambda w, xs: xs @ w
  return embed_fn, jnp.eye(d), jnp.asarray(x, jnp.float32), jnp.asarray(x_prime, jnp.float32)


def test_adversarial_embeddings_respect_the_bound():
  """Linear embeddings placed at the τ-level worst case, all pairs clipped."""
  loss, clip_norm = logit_dp.losses.contrastive(0.5), 1e-3
  embed_fn, params, x, x_prime = _adversarial_problem()
  fn = jax.jit(logit_dp.clipped_grad(embed_fn, loss, clip_norm))
  diffs = _neighbour_differences(fn, params, x, x_prime)
  assert np.all(diffs <= logit_dp.sensitivity(loss, clip_norm, batch_size=x.shape[0]))
  assert np.argmax(diffs) == 0  # the pair placed at the worst case moves ḡ the most


def test_adversarial_removal_gaps_are_the_brute_force_ones(no_float_allowance):
  """Without the float32 allowances (which only clip more), each ‖ḡ(X) − ḡ(X∖k)‖ is the
  brute-force one: materialised pair gradients in float64, clipped, weighted by jax.grad of the
  loss on each batch."""
  loss, clip_norm = logit_dp.losses.contrastive(0.5), 1e-3
  embed_fn, params, x, x_prime = _adversarial_problem()
  fn = jax.jit(logit_dp.clipped_grad(embed_fn, loss, clip_norm))
  diffs = _neighbour_differences(fn, params, x, x_prime)
  reference = _brute_force_removal_gaps(embed_fn, params, x, x_prime, loss, clip_norm)
  np.testing.assert_allclose(diffs, reference, rtol=1e-4)


def _brute_force_removal_gaps(embed_fn, params, x, x_prime, loss, clip_norm):
  """‖ḡ(X) − ḡ(X∖k)‖ for every k in float64, ḡ = Σ_ij τ_ij·clip_B(∇_w Z_ij) from each pair's
  own gradient (jax.grad of Z_ij) and τ = jax.grad of the loss on each batch."""
  n = x.shape[0]
  with jax.enable_x64(True):
    p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
    x64, xp64 = jnp.asarray(x, jnp.float64), jnp.asarray(x_prime, jnp.float64)

    def unit(p, xe):
      e = embed_fn(p, xe[None])[0]
      return e / jnp.sqrt(jnp.sum(e * e) + logit_dp.losses.DEFAULT_COSINE_EPS ** 2)

    def pair_grad(i, j):
      g = jax.grad(lambda p: jnp.dot(unit(p, x64[i]), unit(p, xp64[j])))(p64)
      return jnp.concatenate([jnp.ravel(leaf) for leaf in jax.tree_util.tree_leaves(g)])

    @jax.jit  # one compilation of the pair gradients and unit embeddings
    def pair_grads_and_units():
      rows, cols = jnp.meshgrid(jnp.arange(n), jnp.arange(n), indexing="ij")
      return (jax.vmap(jax.vmap(pair_grad))(rows, cols), jax.vmap(lambda xe: unit(p64, xe))(x64),
              jax.vmap(lambda xe: unit(p64, xe))(xp64))

    g, u, v = (np.asarray(a) for a in pair_grads_and_units())  # g: (n, n, p)
    norms = np.linalg.norm(g, axis=-1, keepdims=True)
    clipped = g * np.minimum(1.0, clip_norm / norms)

    def gbar(keep):
      tau = np.asarray(_jitted_grad(loss)(jnp.asarray(u[keep] @ v[keep].T)))
      return np.einsum("ij,ijp->p", tau, clipped[np.ix_(keep, keep)])

    full = gbar(np.arange(n))
    return np.array([np.linalg.norm(full - gbar(np.delete(np.arange(n), k))) for k in range(n)])


@pytest.mark.parametrize("kind", ["mlp", pytest.param("conv", marks=pytest.mark.slow)])
def test_naive_dp_neighbours_within_2b(kind):
  loss = logit_dp.losses.contrastive(0.5)
  embed_fn, params, x, x_prime = make_model(kind, n=6)
  fn = jax.jit(logit_dp.baselines.naive_clipped_grad(embed_fn, loss, 0.1))
  assert np.all(
      _neighbour_differences(fn, params, x, x_prime) <= logit_dp.baselines.naive_sensitivity(0.1))

"""Float allowances scaled to the dtype of the computation, and the diagonal pair norms.

Float64 runs clip by norms within 1e-12 of the exact float64 norms (the allowance is that of
float64's unit roundoff), and the positives of near-identical views (x' = x + 0.01·noise),
whose pair gradients nearly cancel, get float32 clip norms at or above their float64 truth and
within 10% of it.
"""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import logit_dp
from conftest import MLP
from conftest import SmallConv
from helpers import clip_method
from helpers import flat
from helpers import float64_clipped_reference
from helpers import rel_err
from logit_dp._src import numerics

N = 8
LOSS = logit_dp.losses.contrastive(temperature=1.0)


def _problem(family: str, seed: int = 0, model=None):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  model = SmallConv() if model is None else model
  x = jax.random.uniform(k1, (N, 8, 8, 3))
  noise = jax.random.normal(k2, x.shape)
  x_prime = {"near_identical": x + 1e-2 * noise, "unrelated": jax.random.uniform(k2, x.shape)}
  return model.apply, model.init(k3, x[:1]), x, x_prime[family]


def _as64(tree):
  return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), tree)


def test_allowances_scale_with_the_unit_roundoff():
  assert numerics.unit_roundoff(jnp.float32) == 2.0 ** -24
  assert numerics.unit_roundoff(jnp.float64) == 2.0 ** -53
  assert numerics.unit_roundoff(jnp.bfloat16) == 2.0 ** -8
  assert numerics.vector_error(jnp.float32) == numerics.VECTOR_FLOAT_ERROR
  assert numerics.gram_error(jnp.float32) == numerics.GRAM_FLOAT_ERROR
  assert numerics.vector_error(jnp.float64) == numerics.VECTOR_FLOAT_ERROR * 2.0 ** -29
  assert numerics.gram_error(jnp.float64) == numerics.GRAM_FLOAT_ERROR * 2.0 ** -29


def test_the_computation_dtype_is_the_lowest_precision_the_model_computes_in():
  """A model that casts down internally gets the allowances of that dtype."""
  def casting(p, x):
    inner = jax.jit(lambda a: jnp.tanh(a.astype(jnp.bfloat16)).astype(jnp.float32))
    return inner(x @ p)

  ones = jnp.ones((3, 3))
  assert numerics.computation_dtype(casting, ones, ones) == jnp.bfloat16
  assert numerics.computation_dtype(lambda p, x: jnp.tanh(x @ p), ones, ones) == jnp.float32


@pytest.mark.parametrize("offset", [1e-6, 1.0])
def test_pair_cosine_cotangents_are_the_gradient_of_the_cosine(offset):
  """The closed-form ∂⟨n(e_0), n(e_1)⟩/∂e equals jax.grad of the cosine (float64), for rows
  nearly identical (the positive pairs) and unrelated, and tiny rows where ε matters."""
  with jax.enable_x64(True):
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (5,), jnp.float64)
    for scale in (1.0, 1e-4):
      e = scale * jnp.stack([a, a + offset * jax.random.normal(key_b, (5,), jnp.float64)])
      truth = jax.grad(lambda f: jnp.dot(numerics.normalize(f[0]), numerics.normalize(f[1])))(e)
      got = numerics.pair_cosine_cotangents(e)
      np.testing.assert_allclose(got, truth, rtol=1e-9, atol=1e-12 * float(jnp.max(jnp.abs(truth))))


def _mlp_problem(seed: int = 0):
  model = MLP(features=(16, 6))
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  x, x_prime = jax.random.normal(k1, (N, 7)), jax.random.normal(k2, (N, 7))
  return model.apply, model.init(k3, x[:1]), x, x_prime


def _float64_jacobian_norms(embed_fn, params, xs, eps=logit_dp.losses.DEFAULT_COSINE_EPS):
  """‖J_e‖_F of the normalised embedding per example, by jax.jacrev in float64 (under x64)."""
  flat, unravel = jax.flatten_util.ravel_pytree(_as64(params))

  def unit(w, xe):
    e = embed_fn(unravel(w), xe[None])[0]
    return e / jnp.sqrt(jnp.sum(e * e) + eps * eps)

  jac = jax.vmap(lambda xe: jax.jacrev(unit)(flat, xe))(_as64(xs))
  return np.sqrt(np.sum(np.asarray(jac) ** 2, axis=(1, 2)))


@pytest.mark.slow  # float64 end to end; float32's allowances: test_float32_norms, by default
@pytest.mark.parametrize("method", ["ghost", "materialize"])
def test_float64_runs_clip_by_norms_within_the_float64_allowance(method):
  """x64 with float64 params and inputs, every pair clipped: each norm lies between the exact
  float64 norm and it plus the float64 allowance (with float32's allowances the norms and ḡ
  moved by 4e-6 to 2.3e-5), and ḡ is within what those allowances move the clip factors by."""
  embed_fn, params, x, x_prime = _mlp_problem()
  with jax.enable_x64(True):
    fresh = lambda p, xs: embed_fn(p, xs)
    p64, x64, xp64 = _as64((params, x, x_prime))
    truth, _ = float64_clipped_reference(fresh, LOSS, params, x, x_prime, 1.0)
    clip_norm = 0.5 * float(np.min(truth))  # every pair is clipped
    _, reference = float64_clipped_reference(fresh, LOSS, params, x, x_prime, clip_norm)
    got = np.asarray(logit_dp.clip_methods.pair_grad_norms(fresh, p64, x64, xp64, method))
    _, grads = logit_dp.clipped_grad(fresh, LOSS, clip_norm, method)(p64, x64, xp64)
    scale = (_float64_jacobian_norms(fresh, params, x)[:, None]
             + _float64_jacobian_norms(fresh, params, x_prime)[None, :])
    z = logit_dp.losses.cosine_similarity(fresh(p64, x64), fresh(p64, xp64))
    tau = np.abs(np.asarray(jax.grad(LOSS)(z, jnp.ones((N,), bool))))
  per_unit = numerics.vector_error(jnp.float64)
  if method == "ghost":  # Gram forms: √(ε_G)·S_ij on top
    per_unit += numerics.gram_error(jnp.float64) ** 0.5
  allowance = 1.01 * per_unit * scale + 4 * 2.0 ** -53 * truth  # + rounding of the reference
  assert got.dtype == np.float64
  assert np.all(got >= truth)
  assert np.all(got <= truth + allowance)
  # |min(1, B/n) − min(1, B/n*)|·‖g‖ ≤ B·(n − n*)/n*: the bound on ‖ḡ − reference‖.
  moved = np.sum(tau * clip_norm * allowance / truth)
  assert all(g.dtype == jnp.float64 for g in jax.tree_util.tree_leaves(grads))
  assert rel_err(grads, reference) <= moved / np.linalg.norm(flat(reference)) + 1e-13
  assert rel_err(grads, reference) < 1e-12  # measured: 2e-14 (ghost and materialize)


@pytest.fixture(scope="module")
def near_identical_truth():
  """‖∇_w Z_ii‖ of the positives in float64, by jax.grad of each Z_ii."""
  embed_fn, params, x, x_prime = _problem("near_identical")
  with jax.enable_x64(True):
    p64, x64, xp64 = _as64((params, x, x_prime))
    unit = lambda p, xe: (lambda u: u / jnp.sqrt(jnp.sum(u * u) + 1e-12))(embed_fn(p, xe[None])[0])
    pair_grad = lambda ab: jax.grad(lambda p: jnp.dot(unit(p, ab[0]), unit(p, ab[1])))(p64)
    g = jax.lax.map(pair_grad, (x64, xp64))  # a vmap would batch the convolutions: slower
    return np.sqrt(
        sum(
            np.sum(np.asarray(leaf).reshape(N, -1) ** 2, -1)
            for leaf in jax.tree_util.tree_leaves(g)))


@pytest.mark.parametrize("method", [
    m if m == "ghost" else pytest.param(m, marks=pytest.mark.slow)
    for m in logit_dp.clip_methods.METHODS
])
def test_float32_diagonal_norms_of_near_identical_pairs_are_within_10_percent(
    method, near_identical_truth):
  """The positives' clip norms of a float32 convolutional model, as shipped (formed in
  float64) and formed in float32 first (float64_positive_pairs=False: those the float32
  allowance flags formed again in float64): ≥ the float64 truth and ≤ 1.10× it."""
  embed_fn, params, x, x_prime = _problem("near_identical")
  truth = near_identical_truth
  norms = lambda **kw: np.diag(
      np.asarray(
          logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, clip_method(
              method, x), microbatch_size=3, **kw), np.float64))
  got, in_float32 = norms(), norms(float64_positive_pairs=False)
  for values in (got, in_float32):
    assert np.all(values >= truth), np.min(values / truth)
    assert np.all(values <= 1.10 * truth), np.max(values / truth)


@pytest.mark.slow  # the one-tower positives are tested by default above
def test_two_tower_diagonal_norms_of_near_identical_pairs_are_within_10_percent():
  """Two towers sharing their first layer: the same bounds on the positives (x'_i embedded by
  the second tower), against float64 jax.grad."""
  model = MLP(features=(16, 6))
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
  x = jax.random.normal(k1, (N, 7))
  x_prime = x + 1e-2 * jax.random.normal(k2, x.shape)
  params = model.init(k3, x[:1])
  scale = lambda p: jax.tree_util.tree_map(lambda a: a * 1.01, p)
  tower = lambda p, xs: model.apply(scale(p), xs)
  got = np.diag(
      np.asarray(
          logit_dp.clip_methods.pair_grad_norms(model.apply, params, x, x_prime, "ghost",
                                                positive_embed_fn=tower), np.float64))
  with jax.enable_x64(True):
    p64, x64, xp64 = _as64((params, x, x_prime))
    unit = lambda f, p, xe: (lambda u: u / jnp.sqrt(jnp.sum(u * u) + 1e-12))(f(p, xe[None])[0])
    g = jax.vmap(
        lambda a, b: jax.grad(lambda p: jnp.dot(unit(model.apply, p, a), unit(tower, p, b)))(p64))(
            x64, xp64)
    truth = np.sqrt(
        sum(
            np.sum(np.asarray(leaf).reshape(N, -1) ** 2, -1)
            for leaf in jax.tree_util.tree_leaves(g)))
  assert np.all(got >= truth), np.min(got / truth)
  assert np.all(got <= 1.10 * truth), np.max(got / truth)

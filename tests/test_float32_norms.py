"""Clip norms in float32 never fall below the true pair-gradient norm (float64 truth).

The inputs that stress them: near-identical views, where the two halves J_iᵀv̂_j and
J'_jᵀû_i of a pair gradient nearly cancel, on and off the diagonal, and a tiny clip norm B
under which every pair is clipped, so that an under-estimated norm breaks the sensitivity.
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logit_dp
from conftest import SmallConv
from helpers import clip_method
from helpers import float32_jacobian_norms
from helpers import make_batch
from helpers import method_kwargs
from logit_dp import audit
from logit_dp._src import layerwise
from logit_dp._src import numerics
from logit_dp._src import pair_terms
from logit_dp._src.methods import ghost

N = 8
_TESTS = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_TESTS)


def _problem(family: str, seed: int = 0, dim: int = 5):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  model = SmallConv(dim=dim)
  x = jax.random.uniform(k1, (N, 8, 8, 3))
  noise = jax.random.normal(k2, x.shape)
  x_prime = {
      "near_identical": x + 1e-2 * noise,
      "near_identical_off_diagonal": jnp.roll(x, 1, axis=0) + 1e-2 * noise,
      "unrelated": jax.random.uniform(k2, x.shape)
  }[family]
  return model.apply, model.init(k3, x[:1]), x, x_prime


def _float64_truth(embed_fn, params, x, x_prime, eps=logit_dp.losses.DEFAULT_COSINE_EPS):
  """‖∇_w Z_ij‖ in float64: jax.grad of each Z_ij separately (independent of the library)."""
  with jax.enable_x64(True):
    p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
    x64, xp64 = jnp.asarray(x, jnp.float64), jnp.asarray(x_prime, jnp.float64)

    def unit(p, xe):
      u = embed_fn(p, xe[None])[0]
      return u / jnp.sqrt(jnp.sum(u * u) + eps * eps)

    def norm(i, j):
      g = jax.grad(lambda p: jnp.dot(unit(p, x64[i]), unit(p, xp64[j])))(p64)
      return jnp.sqrt(sum(jnp.sum(leaf * leaf) for leaf in jax.tree_util.tree_leaves(g)))

    rows, cols = jnp.meshgrid(jnp.arange(N), jnp.arange(N), indexing="ij")
    return np.asarray(jax.jit(jax.vmap(jax.vmap(norm)))(rows, cols))


def _batch_and_factors(embed_fn, params, x, x_prime):
  batch = make_batch(embed_fn, params, x, x_prime)
  return batch, (batch.factors(batch.x), batch.factors(batch.x_prime))


@functools.cache
def _family_jacobian_norms(family: str) -> tuple[np.ndarray, np.ndarray]:
  return float32_jacobian_norms(*_problem(family))


FAMILIES = ("near_identical", "near_identical_off_diagonal", "unrelated")
_SLOW = pytest.mark.slow


class _Truths(dict):
  """The float64 truth of each family, computed when a test first asks for it."""
  def __missing__(self, family):
    self[family] = _float64_truth(*_problem(family))
    return self[family]


@pytest.fixture(scope="module")
def truths():
  return _Truths()


# The default run keeps the diagonal stress (near-identical views) for every method and the
# off-diagonal one for ghost; the rest is slow.
_DEFAULT_FAMILIES = {
    "near_identical": logit_dp.clip_methods.METHODS, "near_identical_off_diagonal": ("ghost",)
}


@pytest.mark.parametrize("family,method", [
    pytest.param(family, method, marks=() if method in _DEFAULT_FAMILIES.get(family, ()) else _SLOW)
    for family in FAMILIES for method in logit_dp.clip_methods.METHODS
])
def test_clip_norms_are_never_below_the_float64_truth(truths, method, family):
  embed_fn, params, x, x_prime = _problem(family)
  truth = truths[family]
  got = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, clip_method(method, x),
                                            microbatch_size=3), np.float64)
  assert np.all(got >= truth * (1 - 2.0 ** -23)), np.min(got / truth)
  if method not in ("triangle",
                    "projected"):  # an exact method over-estimates by no more than its allowance
    s_u, s_v = _family_jacobian_norms(family)
    scale = s_u[:, None] + s_v[None, :]
    allowance = (numerics.GRAM_FLOAT_ERROR ** 0.5 + numerics.VECTOR_FLOAT_ERROR) * scale
    assert np.all(got <= truth + 1.01 * allowance)
  if method == "ghost":  # the pairs its allowance would put far above their truth: formed again
    assert np.all(got <= pair_terms.FLAG_RATIO * truth), np.max(got / truth)


@pytest.mark.slow  # shows the stress input is one; the bound itself is tested by default above
def test_the_stress_is_real_gram_forms_lose_the_diagonal_norms(truths):
  """Without the vector form, ‖g_ii‖² = a + b + 2c of near-identical views is mostly rounding."""
  embed_fn, params, x, x_prime = _problem("near_identical")
  batch, (f_u, f_v) = _batch_and_factors(embed_fn, params, x, x_prime)
  a, b, c = (np.asarray(t, np.float64) for t in ghost.ghost_terms(f_u, batch.u_loc, f_v, batch.v))
  gram_form = np.sqrt(np.maximum(np.diag(a + b + 2 * c), 0.0))
  truth = np.diag(truths["near_identical"])
  assert np.max(np.abs(gram_form - truth) / truth) > 0.1
  assert np.min(np.diag(np.sqrt(np.maximum(a, 0)) + np.sqrt(np.maximum(b, 0))) / truth) > 3


@pytest.mark.slow  # a utility bound; the lower bound is test_clip_norms_are_never_below_...
def test_triangle_takes_the_diagonal_pairs_from_their_vectors(truths):
  """The positives are not over-clipped by the triangle bound (it over-estimated them 22-64×)."""
  embed_fn, params, x, x_prime = _problem("near_identical")
  tri = np.asarray(logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "triangle"),
                   np.float64)
  truth = truths["near_identical"]
  s_u, s_v = _family_jacobian_norms("near_identical")
  allowance = numerics.VECTOR_FLOAT_ERROR * (s_u + s_v)
  assert np.all(np.diag(truth) <= np.diag(tri))
  assert np.all(np.diag(tri) <= np.diag(truth) + 1.01 * allowance)
  off = ~np.eye(N, dtype=bool)
  assert np.median(tri[off] / truth[off]) > 1.5  # off the diagonal it is still the bound


@pytest.mark.parametrize(
    "method",
    [m if m == "ghost" else pytest.param(m, marks=_SLOW) for m in logit_dp.clip_methods.METHODS])
def test_tiny_clip_norm_on_near_identical_positives_respects_the_sensitivity(method):
  embed_fn, params, x, x_prime = _problem("near_identical")
  loss = logit_dp.losses.contrastive(temperature=1.0)
  result = audit.max_removal_ratio(embed_fn, params, loss, 1e-5, x, x_prime, method=method,
                                   **method_kwargs(method, x))
  assert result.ratio <= 1.0, result.ratio


@pytest.mark.slow  # two worst-case searches; the allowances are checked against the truth above
def test_the_audit_search_catches_gram_norms_without_the_allowances(monkeypatch):
  """search_worst_case's near-identical restarts find the breach of the uncorrected ghost norms
  (> 1× C·B at B = 1e-5), and none in the library as it is."""
  embed_fn, params, x, _ = _problem("unrelated")
  loss = logit_dp.losses.contrastive(temperature=1.0)

  def search():
    fresh = lambda p, xs: embed_fn(p, xs)  # nothing compiled is reused across the two runs
    return audit.search_worst_case(fresh, params, loss, 1e-5, x, x, key=jax.random.PRNGKey(3),
                                   num_restarts=4, num_steps=0, init_scale=0.3, method="ghost")

  assert search().ratio <= 1.0
  with monkeypatch.context() as patch:
    patch.setattr(numerics, "GRAM_FLOAT_ERROR", 0.0)
    patch.setattr(pair_terms, "refine_flagged", lambda norms, *args, **kwargs: norms)
    assert search().ratio > 1.0


@pytest.mark.slow  # a float64 compilation of the conv net's materialised pair gradients
def test_materialize_runs_with_x64_enabled_and_float32_params():
  embed_fn, params, x, x_prime = _problem("unrelated")
  expected = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "materialize"))
  loss = logit_dp.losses.contrastive(temperature=1.0)
  _, ref = logit_dp.clipped_grad(embed_fn, loss, 0.1, "materialize")(params, x, x_prime)
  with jax.enable_x64(True):
    fresh = lambda p, xs: embed_fn(p, xs)
    got = np.asarray(logit_dp.clip_methods.pair_grad_norms(fresh, params, x, x_prime,
                                                           "materialize"))
    _, grads = logit_dp.clipped_grad(fresh, loss, 0.1, "materialize")(params, x, x_prime)
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
    assert g.dtype == r.dtype
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-7)


_X64_SCOPES = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
import logit_dp
from conftest import MLP
from helpers import float64_clipped_reference

assert jax.config.jax_enable_x64  # process-wide, as JAX_ENABLE_X64=1
model = MLP(features=(6, 3))
k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
x = jax.random.normal(k1, (8, 5))  # float64: made while x64 is enabled
x_prime = x + 0.3 * jax.random.normal(k2, x.shape)
params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), model.init(k3, x[:1]))
loss = logit_dp.losses.contrastive(temperature=1.0)
clip_norm = 0.05  # every pair clipped


def norms_and_grads(*args):
  embed_fn = lambda p, xs: model.apply(p, xs)  # fresh: nothing cached from the other scope
  return (np.asarray(logit_dp.clip_methods.pair_grad_norms(embed_fn, *args)),
          logit_dp.clipped_grad(embed_fn, loss, clip_norm)(*args)[1])


x32, x_prime32 = np.float32(x), np.float32(x_prime)
with jax.enable_x64(False):
  norms, grads = norms_and_grads(params, x, x_prime)
  want_norms, want = norms_and_grads(params, x32, x_prime32)
truth, _ = float64_clipped_reference(model.apply, loss, params, x32, x_prime32, clip_norm)
assert norms.dtype == np.float32 and np.all(norms >= truth)
np.testing.assert_array_equal(norms, want_norms)
for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want)):
  assert g.dtype == np.float32
  np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-12)

plain = lambda p, xs: jnp.tanh(xs @ p["w"]) @ p["w2"]  # traced without flax's own casts
plain_params = {"w": np.float32(np.eye(5, 6)), "w2": np.float32(np.eye(6, 3))}
with jax.enable_x64(False):
  norms = np.asarray(logit_dp.clip_methods.pair_grad_norms(plain, plain_params, x, x_prime))
  want_norms = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(plain, plain_params, x32, x_prime32))
np.testing.assert_array_equal(norms, want_norms)

if sys.argv[1] == "disabled":
  print("ok")
  sys.exit(0)
wide = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), params)
norms, grads = norms_and_grads(wide, x, x_prime)
truth, reference = float64_clipped_reference(model.apply, loss, wide, x, x_prime, clip_norm,
                                             clip_by=norms)
assert norms.dtype == np.float64 and np.all(norms >= truth)
np.testing.assert_allclose(norms, truth, rtol=1e-9)
for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference)):
  assert g.dtype == np.float64
  np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
print("ok")
"""


def _run_with_x64_enabled(part: str) -> None:
  env = dict(os.environ, JAX_ENABLE_X64="1",
             PYTHONPATH=os.pathsep.join([_TESTS, _REPO,
                                         os.environ.get("PYTHONPATH", "")]))
  run = subprocess.run([sys.executable, "-c", _X64_SCOPES, part], cwd=_TESTS, env=env,
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_float64_inputs_inside_enable_x64_false_are_computed_in_float32():
  """A process with x64 enabled (a subprocess: x64 is process-wide): float64 inputs with
  float32 params inside jax.enable_x64(False) are computed in float32, as every jnp operation
  there: the norms and ḡ of their float32 roundings, at or above the float64 truth (a flax
  MLP and a plain function)."""
  _run_with_x64_enabled("disabled")


@pytest.mark.slow  # a fresh process with x64 enabled, and float64 compilations
def test_float64_arrays_are_computed_in_the_dtype_of_the_x64_scope():
  """The same, then outside jax.enable_x64(False): float64 params and inputs give the float64
  truth and its clipped sum."""
  _run_with_x64_enabled("enabled")


@pytest.mark.parametrize("family", FAMILIES)
def test_cross_terms_from_the_pairs_vectors_stay_within_the_gram_allowance(family):
  """At d = 16 ghost's flattened layer (the first convolution) takes its cross terms from the
  pairs' vectors (`layerwise.flat_cross`), not the cross-Gram: a + b + 2c in float32 is within
  a fifth of the Gram allowance 16u·S_ij² of the float64 truth on every stress input, and the
  clip norms are never below it."""
  embed_fn, params, x, x_prime = _problem(family, seed=1, dim=16)
  truth = _float64_truth(embed_fn, params, x, x_prime)
  batch, (f_u, f_v) = _batch_and_factors(embed_fn, params, x, x_prime)
  assert not layerwise.flat_cross_by_gram(16) and not all(batch.plan.ghost)
  assert f_u.flat.shape[-1] > 0
  a, b, c = (np.asarray(t, np.float64) for t in ghost.ghost_terms(f_u, batch.u_loc, f_v, batch.v))
  s_u, s_v = float32_jacobian_norms(embed_fn, params, x, x_prime)
  scale_sq = (s_u[:, None] + s_v[None, :]) ** 2
  error = np.abs(a + b + 2 * c - truth ** 2) / (numerics.FLOAT32_UNIT_ROUNDOFF * scale_sq)
  assert np.max(error) <= 16 / 5, np.max(error)
  got = np.asarray(logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "ghost"))
  assert np.all(got >= truth * (1 - 2.0 ** -23)), np.min(got / truth)

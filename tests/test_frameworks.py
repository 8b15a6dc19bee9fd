"""The same network in flax.linen, flax.nnx, Equinox (per example, vmapped) and plain JAX
(benchmarks.frameworks.build, identical weights) gets the same layer plan, with every
parameter factored, and the same pair norms and clipped gradients: checked against
"materialize" (a backward pass per pair through embed_fn), against float64 jax.grad / jacrev
truth, with masks, microbatches, two towers and under shard_map.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import logit_dp
from benchmarks import frameworks
from helpers import clip_method
from helpers import flat
from helpers import rel_err
from logit_dp._src import layerwise

FRAMEWORKS = frameworks.FRAMEWORKS
# Small versions of the architectures the benchmark times at full size.
SIZES = {
    "mlp": dict(features=12, hidden=(8, 8), dim=4),
    "conv": dict(channels=(4, 8), dim=5, side=8),
    "resnet18": dict(width=2, dim=4, side=8),
}
ARCH = {"mlp": "mlp", "conv": "embedding_net", "resnet18": "resnet18"}
LOSS = logit_dp.losses.contrastive(temperature=0.5)


def _problem(framework, model, n=6, seed=0):
  embed_fn, params, x, x_prime = _built(framework, model, n, seed)
  # A new function object per call, as a fresh build: the library's jit caches, keyed on
  # embed_fn, never reuse a trace made under another test's patched constants
  # (no_float_allowance).
  return functools.partial(embed_fn), params, x, x_prime


@functools.cache  # built once per configuration, shared by the tests (its arrays are immutable)
def _built(framework, model, n, seed):
  embed_fn, params, shape = frameworks.build(framework, ARCH[model], **SIZES[model])
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(k1, (n,) + shape)
  x_prime = x + 0.3 * jax.random.normal(k2, x.shape)
  return embed_fn, params, x, x_prime


def _plan(embed_fn, params, x):
  return layerwise.make_plan(embed_fn, params, x, embed_fn(params, x[:1]).shape[-1])


def _float64_pair_norms(embed_fn, params, x, x_prime, positive_embed_fn=None):
  """‖∇_w cos(Φ(x_i), Φ'(x'_j))‖ in float64 from per-example jacrev Jacobians."""
  positive_embed_fn = positive_embed_fn or embed_fn
  with jax.enable_x64(True):
    w, unravel = ravel_pytree(jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params))
    x64, xp64 = jnp.asarray(x, jnp.float64), jnp.asarray(x_prime, jnp.float64)

    def unit(fn, w, xe):
      e = fn(unravel(w), xe[None])[0]
      return e / jnp.sqrt(jnp.sum(e * e) + logit_dp.losses.DEFAULT_COSINE_EPS ** 2)

    @jax.jit  # one compilation instead of one per operation
    def norms(w, x64, xp64):
      u = jax.vmap(lambda xe: unit(embed_fn, w, xe))(x64)
      v = jax.vmap(lambda xe: unit(positive_embed_fn, w, xe))(xp64)
      jac_u = jax.vmap(lambda xe: jax.jacrev(lambda w: unit(embed_fn, w, xe))(w))(x64)
      jac_v = jax.vmap(lambda xe: jax.jacrev(lambda w: unit(positive_embed_fn, w, xe))(w))(xp64)
      g = (jnp.einsum("ikq,jk->ijq", jac_u, v) + jnp.einsum("jkq,ik->ijq", jac_v, u))
      return jnp.sqrt(jnp.sum(g * g, axis=-1))

    return np.asarray(norms(w, x64, xp64))


def _float64_grad(embed_fn, params, x, x_prime, mask):
  """jax.grad of ℒ(Z(w)) in float64: the unclipped gradient."""
  with jax.enable_x64(True):
    p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
    x64, xp64 = jnp.asarray(x, jnp.float64), jnp.asarray(x_prime, jnp.float64)
    total = lambda p: LOSS(logit_dp.losses.cosine_similarity(embed_fn(p, x64), embed_fn(p, xp64)),
                           mask)
    return flat(jax.jit(jax.grad(total))(p64))  # one compilation instead of one per operation


@functools.cache
def _expected_layers(model):
  """(kind, positions, fan_in, features) of the linen plan: what every framework must find."""
  embed_fn, params, x, _ = _problem("linen", model)
  return [(layer.kind, layer.positions, layer.fan_in, layer.features)
          for layer in _plan(embed_fn, params, x).layers]


_PLAN_MARKS = {"conv": (), "mlp": pytest.mark.extended, "resnet18": pytest.mark.slow}


@pytest.mark.parametrize(
    "framework,model",
    [pytest.param(f, m, marks=_PLAN_MARKS[m]) for m in sorted(SIZES) for f in FRAMEWORKS])
def test_every_framework_gets_the_linen_plan(framework, model):
  """Every dense / conv layer found, with its bias, and no parameter left generic."""
  embed_fn, params, x, _ = _problem(framework, model)
  linen_fn, linen_params, _, _ = _problem("linen", model)
  np.testing.assert_allclose(embed_fn(params, x), linen_fn(linen_params, x), rtol=1e-5, atol=1e-6)
  plan = _plan(embed_fn, params, x)
  assert plan.generic == ()
  assert plan.factored_leaves == frozenset(range(len(jax.tree_util.tree_leaves(params))))
  assert all(len(layer.leaves) == 2 for layer in plan.layers)  # kernel and bias
  assert [(layer.kind, layer.positions, layer.fan_in, layer.features) for layer in plan.layers
         ] == _expected_layers(model)
  assert plan.ghost == _plan(linen_fn, linen_params, x).ghost


# By default: the MLP in the frameworks other than linen (whose layers test_layerwise and
# test_clipping check), the conv net in Equinox (kernels stored (O, I, H, W)); the rest is slow.
def _cases(default):
  return [(f, m) if (f, m) in default else pytest.param(f, m, marks=pytest.mark.slow)
          for m in ("mlp", "conv", "resnet18") for f in FRAMEWORKS]


# nnx's ghost gradient is checked by default below (test_clipped_grad_with_mask_and_microbatches).
NORM_CASES = _cases({("equinox", "mlp"), ("plain", "mlp")})


@pytest.mark.extended
@pytest.mark.parametrize("framework,model", NORM_CASES)
def test_ghost_norms_are_materialize_and_float64_truth(framework, model):
  embed_fn, params, x, x_prime = _problem(framework, model)
  truth = _float64_pair_norms(embed_fn, params, x, x_prime)
  exact = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "materialize",
                                            float_allowance=False))
  ghost = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "ghost",
                                            float_allowance=False))
  triangle = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "triangle"))
  # float32 Gram forms lose ~1e-7·max² to cancellation (as in test_layerwise._check_norms).
  atol = 1e-5 * float(np.max(truth))
  np.testing.assert_allclose(exact, truth, rtol=1e-4, atol=atol)
  np.testing.assert_allclose(ghost, truth, rtol=1e-4, atol=atol)
  assert np.all(triangle >= truth * (1 - 1e-5))


GRAD_CASES = _cases({("nnx", "mlp")})


@pytest.mark.extended
@pytest.mark.parametrize("framework,model", GRAD_CASES)
def test_clipped_grad_with_mask_and_microbatches(framework, model, no_float_allowance):
  """ghost (microbatched) = materialize with a mask and an active clip; with a clip above
  every pair norm, ḡ = float64 jax.grad of the loss."""
  embed_fn, params, x, x_prime = _problem(framework, model)
  mask = jnp.asarray([True, True, False, True, True, True])
  norms = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "materialize"))
  clip = float(np.median(norms))
  _, exact = logit_dp.clipped_grad(embed_fn, LOSS, clip, "materialize")(params, x, x_prime, mask)
  _, ghost = logit_dp.clipped_grad(embed_fn, LOSS, clip, "ghost", microbatch_size=4)(params, x,
                                                                                     x_prime, mask)
  np.testing.assert_allclose(flat(ghost), flat(exact), rtol=1e-4, atol=1e-6)
  big = 10.0 * float(np.max(norms))
  _, unclipped = logit_dp.clipped_grad(embed_fn, LOSS, big, "ghost",
                                       microbatch_size=4)(params, x, x_prime, mask)
  truth = _float64_grad(embed_fn, params, x, x_prime, mask)
  np.testing.assert_allclose(flat(unclipped), truth, rtol=1e-4, atol=1e-6 * np.max(np.abs(truth)))


@pytest.mark.parametrize("framework", [pytest.param(f, marks=pytest.mark.slow) for f in FRAMEWORKS])
def test_triangle_and_projected(framework, no_float_allowance):
  """triangle: the norms and ḡ of the same weights in linen. projected: an upper bound of the
  float64 truth, exact on the diagonal (formed in float64: the allowances are off; its
  subspace comes from an eigendecomposition of near-singular Grams, so float rounding of another
  parameter layout moves the bound)."""
  embed_fn, params, x, x_prime = _problem(framework, "mlp")
  linen_fn, linen_params, _, _ = _problem("linen", "mlp")
  got = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "triangle")
  want = logit_dp.clip_methods.pair_grad_norms(linen_fn, linen_params, x, x_prime, "triangle")
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  _, grad = logit_dp.clipped_grad(embed_fn, LOSS, 0.5, "triangle")(params, x, x_prime)
  _, linen_grad = logit_dp.clipped_grad(linen_fn, LOSS, 0.5, "triangle")(linen_params, x, x_prime)
  # The leaves differ in order and layout (Equinox: weight = kernelᵀ): compare the multisets.
  np.testing.assert_allclose(np.sort(flat(grad)), np.sort(flat(linen_grad)), rtol=1e-4, atol=1e-7)
  truth = _float64_pair_norms(embed_fn, params, x, x_prime)
  projected = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime,
                                            clip_method("projected", x)))
  assert np.all(projected >= truth * (1 - 1e-5))
  np.testing.assert_allclose(np.diag(projected), np.diag(truth), rtol=1e-4)


@pytest.mark.slow  # Equinox's layers are checked against materialize by default (NORM_CASES)
@pytest.mark.parametrize("mode", ["ghost", "flat"])
@pytest.mark.parametrize("framework,model", [("equinox", "mlp"), ("equinox", "conv")])
def test_permuted_kernels_contract_like_jax(framework, model, mode, monkeypatch):
  """Kernels stored transposed (Equinox: (out, in), (O, I, H, W)): factors_transpose = jax.vjp
  and factors_times = jax.jvp of the normalised embeddings, leaf by leaf, in both layer modes."""
  from helpers import make_batch  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(layerwise, "use_ghost", lambda layer, d: mode == "ghost")
  embed_fn, params, x, _ = _problem(framework, model)
  batch = make_batch(embed_fn, params, x, x)
  assert all(layer.kernel_axes is not None for layer in batch.plan.layers)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  factors = batch.factors(x)
  embed = lambda p: jax.vmap(lambda xe: logit_dp.losses.normalize(
      embed_fn(p, xe[None])[0], batch.eps))(x)
  cotangents = jax.random.normal(jax.random.PRNGKey(7), (x.shape[0], batch.u.shape[-1]))
  grads = layerwise.factors_transpose(batch.plan, factors, cotangents, leaves)
  want = jax.tree_util.tree_leaves(jax.vjp(embed, params)[1](cotangents)[0])
  for got, expected in zip(grads, want):
    np.testing.assert_allclose(got, expected, rtol=1e-5,
                               atol=1e-6 * float(np.max(np.abs(expected))))
  keys = jax.random.split(jax.random.PRNGKey(11), len(leaves))
  tangents = [jax.random.normal(k, (2,) + leaf.shape) for k, leaf in zip(keys, leaves)]
  applied = layerwise.factors_times(batch.plan, factors, tangents)
  for index in range(2):
    tangent = jax.tree_util.tree_unflatten(treedef, [t[index] for t in tangents])
    expected = jax.jvp(embed, (params,), (tangent,))[1]
    np.testing.assert_allclose(applied[:, :, index], expected, rtol=1e-4,
                               atol=1e-5 * float(np.max(np.abs(expected))))


@pytest.mark.extended
@pytest.mark.parametrize(
    "framework",
    [f if f == "equinox" else pytest.param(f, marks=pytest.mark.slow) for f in FRAMEWORKS])
def test_two_towers(framework):
  """positive_embed_fn: a second network of the same framework in the same params pytree."""
  anchor_fn, anchor_params, x, x_prime = _problem(framework, "mlp", seed=0)
  positive_fn, positive_params, _, _ = _problem(framework, "mlp", seed=1)
  params = {
      "anchor": anchor_params, "positive": jax.tree_util.tree_map(lambda a: 0.9 * a,
                                                                  positive_params)
  }
  embed_fn = lambda p, x: anchor_fn(p["anchor"], x)
  positive_embed_fn = lambda p, x: positive_fn(p["positive"], x)
  kwargs = dict(positive_embed_fn=positive_embed_fn, float_allowance=False)
  truth = _float64_pair_norms(embed_fn, params, x, x_prime, positive_embed_fn)
  exact = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "materialize", **kwargs))
  ghost = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "ghost", **kwargs))
  atol = 1e-5 * float(np.max(truth))
  np.testing.assert_allclose(exact, truth, rtol=1e-4, atol=atol)
  np.testing.assert_allclose(ghost, truth, rtol=1e-4, atol=atol)


@pytest.mark.extended
@pytest.mark.parametrize(
    "framework", [f if f == "nnx" else pytest.param(f, marks=pytest.mark.slow) for f in FRAMEWORKS])
def test_under_shard_map(framework):
  """shard_map(clipped_grad(..., axis_name)) over 4 devices = the single-device ḡ."""
  embed_fn, params, x, x_prime = _problem(framework, "mlp", n=8)
  mask = jnp.ones((8,), bool).at[5].set(False)
  single = logit_dp.clipped_grad(embed_fn, LOSS, 0.3, "ghost")(params, x, x_prime, mask)
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, 0.3, "ghost", axis_name="data")
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  sharded = jax.jit(
      jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                    out_specs=(P(), P())))(params, x, x_prime, mask)
  # As tests/test_distributed.py: the sum over devices runs in another order.
  np.testing.assert_allclose(sharded[0], single[0], rtol=1e-5, atol=1e-6)
  assert rel_err(sharded[1], single[1]) < 1e-5


@jax.jit
def _jitted_dense(params, h):
  return jnp.dot(h, params["kernel"].T.T) + params["bias"]  # reindexed twice, inside a jit


def _nested_embed(params, x):
  """Dense layers inside jit sub-jaxprs, an activation with a custom JVP between them, and a
  leaf that is also scaled outside any layer (so only it is generic)."""
  h = jax.nn.relu(_jitted_dense(params["first"], x))
  h = jax.jit(lambda p, h: h @ p["kernel"])(params["second"], h)
  return h * params["scale"]


@pytest.mark.extended
def test_layers_inside_sub_jaxprs_are_found():
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {
      "first": {"kernel": jax.random.normal(k1, (5, 4)), "bias": 0.1 * jnp.ones(4)},
      "second": {"kernel": jax.random.normal(k2, (4, 3))},
      "scale": 1.0 + 0.1 * jax.random.normal(k3, (3,)),
  }
  x = jax.random.normal(k4, (6, 5))
  x_prime = x + 0.3 * jax.random.normal(k1, x.shape)
  plan = _plan(_nested_embed, params, x)
  leaves = jax.tree_util.tree_leaves(params)
  scale = next(i for i, leaf in enumerate(leaves) if leaf is params["scale"])
  assert plan.generic == (scale,)
  assert [(layer.kind, len(layer.leaves)) for layer in plan.layers] == [("dense", 2), ("dense", 1)]
  truth = _float64_pair_norms(_nested_embed, params, x, x_prime)
  # In float64: pairs (0, 0) and (4, 4) embed collinearly (true norms ~1e-12), where the ghost
  # norm's sum of Gram terms cancels to an absolute error of ~sqrt(eps)·max: ~1e-4 in float32,
  # ~1e-8 in float64. This test is about finding the layers; the float32 bounds have their own.
  with jax.enable_x64(True):
    to64 = lambda a: jnp.asarray(a, jnp.float64)
    ghost = np.asarray(
        logit_dp.clip_methods.pair_grad_norms(_nested_embed, jax.tree_util.tree_map(to64, params),
                                              to64(x), to64(x_prime), "ghost",
                                              float_allowance=False))
  assert ghost.dtype == np.float64
  np.testing.assert_allclose(ghost, truth, rtol=1e-9, atol=1e-7 * float(np.max(truth)))

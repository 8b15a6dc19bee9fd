"""Per-layer Jacobian factors: exact against materialised pair gradients, safe fallbacks.

Every pair-norm check compares "ghost" with "materialize" (Algorithm 1: each pair
gradient by its own backward pass through the user's embed_fn), so a layer whose
factors were wrong, or a parameter wrongly treated as owned by one layer, shows up as
a norm mismatch.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logit_dp
from helpers import flat
from helpers import make_batch
from logit_dp._src import layerwise
from logit_dp._src.layers import conv as conv_layers
from logit_dp.models import EmbeddingNet

CONV_CONFIGS = {
    "same_stride2": dict(kernel_size=(3, 3), strides=2, padding="SAME"),
    "valid": dict(kernel_size=(3, 2), strides=1, padding="VALID"),
    "explicit_pad": dict(kernel_size=(3, 3), strides=(1, 2), padding=((2, 0), (1, 1))),
    "kernel_dilation": dict(kernel_size=(3, 3), kernel_dilation=2, padding="SAME"),
    "input_dilation": dict(kernel_size=(2, 2), input_dilation=2, padding=((1, 1), (0, 1))),
    "no_bias": dict(kernel_size=(3, 3), padding="SAME", use_bias=False),
}


# The default run keeps the configurations of the default conv gradient tests below; the
# others are slow.
@pytest.mark.parametrize("name", [
    name if name in ("explicit_pad",
                     "same_stride2") else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(CONV_CONFIGS)
])
def test_conv_patches_times_kernel_is_the_convolution(name):
  conv = nn.Conv(5, **CONV_CONFIGS[name])
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 7, 6, 4))
  params = conv.init(jax.random.PRNGKey(1), x)["params"]
  config = conv_layers.flax_conv_config(conv, x)
  assert config is not None
  patches = conv_layers.conv_patches(x, *config)
  kernel = params["kernel"]
  y = conv.apply({"params": {"kernel": kernel, "bias": jnp.zeros(5)}}
                 if conv.use_bias else {"params": {"kernel": kernel}}, x)
  via_patches = patches @ kernel.reshape(-1, kernel.shape[-1])
  np.testing.assert_allclose(via_patches, y.reshape(3, -1, 5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_conv_patches_other_ranks(rank):
  conv = nn.Conv(3, (2,) * rank, strides=2, padding="SAME")
  x = jax.random.normal(jax.random.PRNGKey(0), (2,) + (5,) * rank + (2,))
  params = conv.init(jax.random.PRNGKey(1), x)["params"]
  patches = conv_layers.conv_patches(x, *conv_layers.flax_conv_config(conv, x))
  y = conv.apply({"params": {"kernel": params["kernel"], "bias": jnp.zeros(3)}}, x)
  np.testing.assert_allclose(patches @ params["kernel"].reshape(-1, 3), y.reshape(2, -1, 3),
                             rtol=1e-5, atol=1e-5)


CONV_VJP_CASES = dict(CONV_CONFIGS, stride3_valid=dict(kernel_size=(2, 3), strides=(3, 2),
                                                       padding="VALID"))


# The default run keeps explicit_pad (strides, asymmetric padding; each case compiles flax's
# and the library's conv gradients); test_conv_patches_* keeps the other configurations'
# patches by default.
@pytest.mark.parametrize("name", [
    name if name == "explicit_pad" else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(CONV_VJP_CASES) + ["rank1", "rank3"]
])
@pytest.mark.slow
def test_channels_last_conv_has_the_values_and_gradients_of_jax(name):
  """Its hand-written backward pass = jax.vjp of flax's convolution, w.r.t. input and kernel."""
  if name.startswith("rank"):
    rank = int(name[-1])
    conv, shape = nn.Conv(3, (2,) * rank, strides=2, padding="SAME"), (2,) + (5,) * rank + (2,)
  else:
    conv, shape = nn.Conv(5, **CONV_VJP_CASES[name]), (3, 9, 8, 4)
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(k1, shape)
  config = conv_layers.flax_conv_config(conv, x)
  kernel = jax.random.normal(k2, tuple(config[0]) + (shape[-1], conv.features))

  def flax_conv(x, kernel):
    params = {"kernel": kernel, "bias": jnp.zeros(conv.features)
             } if conv.use_bias else {"kernel": kernel}
    return conv.apply({"params": params}, x)

  y, reference_vjp = jax.vjp(flax_conv, x, kernel)
  y_got, got_vjp = jax.vjp(lambda x, k: conv_layers.channels_last_conv(x, k, config, None), x,
                           kernel)
  np.testing.assert_allclose(y_got, y, rtol=1e-5, atol=1e-5)  # float32 sums, other order
  cotangent = jax.random.normal(k3, y.shape)
  for got, want in zip(got_vjp(cotangent), reference_vjp(cotangent)):
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


class ConvNet(nn.Module):
  conv: dict
  dim: int = 4

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Conv(6, **self.conv)(x))
    x = nn.tanh(nn.Conv(5, (2, 2), strides=2, padding="VALID")(x))
    return nn.Dense(self.dim)(x.mean(axis=(1, 2)))


class SequenceNet(nn.Module):
  """Dense layers on (n, L, F) inputs: T = L positions per example."""
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(6)(x))
    x = nn.tanh(nn.Dense(5, use_bias=False)(x))
    return nn.Dense(4)(x.mean(axis=1))


class TiedNet(nn.Module):
  """One Dense applied twice: its kernel belongs to two calls."""
  @nn.compact
  def __call__(self, x):
    shared = nn.Dense(5)
    h = nn.tanh(shared(x))
    return nn.Dense(4)(nn.tanh(shared(h[..., :5] * 0.5 + x)))


class KernelAlsoUsedElsewhere(nn.Module):
  """A Dense whose kernel also enters the output outside the layer call."""
  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(5)
    h = nn.tanh(dense(x))
    return nn.Dense(4)(h) + 0.3 * jnp.sum(jnp.sin(dense.variables["params"]["kernel"]))


class ExamplesNotLeading(nn.Module):
  """Moves the example axis away from axis 0 before a Dense."""
  @nn.compact
  def __call__(self, x):  # x: (n, L, F)
    h = jnp.swapaxes(x, 0, 1)  # (L, n, F): the Dense sees L as its leading axis
    h = nn.tanh(nn.Dense(5)(h))
    return nn.Dense(4)(jnp.swapaxes(h, 0, 1).mean(axis=1))


class MixedNet(nn.Module):
  """Recognised layers next to GroupNorm, a circular conv and a raw parameter."""
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3), padding="CIRCULAR")(x)
    x = nn.relu(nn.GroupNorm(num_groups=2)(x))
    x = nn.relu(nn.Conv(6, (3, 3), strides=2)(x))
    scale = self.param("scale", nn.initializers.ones, (6,))
    return nn.Dense(4)(x.mean(axis=(1, 2)) * scale)


def pure_jax_embed(params, x):
  h = jnp.tanh(x.reshape(x.shape[0], -1) @ params["w1"] + params["b1"])
  return h @ params["w2"]


def pure_jax_scaled_embed(params, x):
  """pure_jax_embed times exp(log_scale): a leaf used outside any linear operation."""
  return pure_jax_embed(params, x) * jnp.exp(params["log_scale"])


def _problem(model, shape, n=6, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(k1, (n,) + shape)
  x_prime = x + 0.5 * jax.random.normal(k2, x.shape)
  if model is None or model == "pure_jax_scaled":
    f = int(np.prod(shape))
    params = {
        "w1": jax.random.normal(k3, (f, 5)) / np.sqrt(f), "b1": jnp.zeros(5),
        "w2": jax.random.normal(k1, (5, 4))
    }
    if model is None:
      return pure_jax_embed, params, x, x_prime
    params["log_scale"] = 0.1 * jax.random.normal(k2, (4,))
    return pure_jax_scaled_embed, params, x, x_prime
  return model.apply, model.init(k3, x[:1]), x, x_prime


# Only kernel_used_elsewhere runs by default: the other nets' rewritten layers are compared with
# materialize (which calls embed_fn itself) by test_ghost_norms_exact_for_conv_configs and
# test_unrecognised_uses_fall_back_to_generic_jacobians by default (pure_jax has no conv).
@pytest.mark.parametrize("model,shape", [
    pytest.param(ConvNet(CONV_CONFIGS["same_stride2"]), (7, 6, 3), marks=pytest.mark.slow),
    pytest.param(MixedNet(), (6, 6, 2), marks=pytest.mark.slow),
    pytest.param(TiedNet(), (5,), marks=pytest.mark.slow),
    (KernelAlsoUsedElsewhere(), (5,)),
    pytest.param(None, (3, 2), marks=pytest.mark.slow),
], ids=["conv", "mixed", "tied", "kernel_used_elsewhere", "pure_jax"])
@pytest.mark.slow
def test_recognised_layers_keep_values_and_gradients_in_a_microbatch_loop(model, shape):
  """with_recognised_layers(embed_fn) = embed_fn, values and parameter vjps, under lax.map + jit."""
  embed_fn, params, x, _ = _problem(model, shape)
  cotangents = jax.random.normal(jax.random.PRNGKey(3), (x.shape[0], 4))

  def microbatched(fn):
    def chunk(xs):
      x_chunk, cot_chunk = xs
      y, vjp = jax.vjp(lambda p: fn(p, x_chunk), params)
      return y, vjp(cot_chunk)[0]

    ys, grads = jax.lax.map(chunk, (x.reshape((2, 3) + shape), cotangents.reshape(2, 3, 4)))
    return ys.reshape(x.shape[0], -1), jax.tree_util.tree_map(lambda g: g.sum(0), grads)

  got = jax.jit(lambda: microbatched(layerwise.with_recognised_layers(embed_fn)))()
  y, vjp = jax.vjp(lambda p: embed_fn(p, x), params)
  np.testing.assert_allclose(got[0], y, rtol=1e-6, atol=1e-6)
  for g, want in zip(jax.tree_util.tree_leaves(got[1]),
                     jax.tree_util.tree_leaves(vjp(cotangents)[0])):
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(want))))


# "auto" mixes the two per layer; tests/test_clipping.py covers it on the default plans.
MODES = {"all_ghost": True, "all_flat": False}


def _check_norms(embed_fn, params, x, x_prime, monkeypatch, modes=MODES):
  """Ghost pair norms equal materialised ones, and triangle bounds them, in every layer mode."""
  exact = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "materialize",
                                            float_allowance=False))
  for mode, ghost_everywhere in modes.items():
    with monkeypatch.context() as patch:
      if ghost_everywhere is not None:
        patch.setattr(layerwise, "use_ghost", lambda layer, d, g=ghost_everywhere: g)
        assert all(g == ghost_everywhere for g in _plan(embed_fn, params, x).ghost)
      fresh = lambda p, xs: embed_fn(p, xs)  # a new function: no compiled plan is reused
      ghost = logit_dp.clip_methods.pair_grad_norms(fresh, params, x, x_prime, "ghost",
                                                    float_allowance=False)
      bound = logit_dp.clip_methods.pair_grad_norms(fresh, params, x, x_prime, "triangle")
    # ‖g‖² = a + b + 2c in float32 loses ~1e-7·(a + b) to cancellation, so the relative error
    # of a norm far below the batch's largest grows as 1e-7·(max/‖g‖)²; atol covers that.
    np.testing.assert_allclose(ghost, exact, rtol=1e-4, atol=1e-5 * float(np.max(exact)),
                               err_msg=mode)
    assert np.all(np.asarray(bound) >= exact * (1 - 1e-5)), mode


def _plan(embed_fn, params, x):
  d = embed_fn(params, x[:1]).shape[-1]
  return layerwise.make_plan(embed_fn, params, x, d)


FAST_CONV_CONFIGS = ()  # all slow: the conv nets of the other modules run by default


@pytest.mark.parametrize("name", [
    name if name in FAST_CONV_CONFIGS else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(CONV_CONFIGS)
])
def test_ghost_norms_exact_for_conv_configs(name, monkeypatch):
  embed_fn, params, x, x_prime = _problem(ConvNet(CONV_CONFIGS[name]), (7, 6, 3))
  plan = _plan(embed_fn, params, x)
  assert [layer.kind for layer in plan.layers] == ["conv", "conv", "dense"]
  assert plan.generic == ()
  _check_norms(embed_fn, params, x, x_prime, monkeypatch)


@pytest.mark.slow  # dense layers on (n, t, f) inputs; the conv nets run by default elsewhere
def test_ghost_norms_exact_for_dense_on_sequences(monkeypatch):
  embed_fn, params, x, x_prime = _problem(SequenceNet(), (5, 3))
  plan = _plan(embed_fn, params, x)
  assert [layer.positions for layer in plan.layers] == [5, 5, 1]
  _check_norms(embed_fn, params, x, x_prime, monkeypatch)


@pytest.mark.slow  # traces the paper's net at 32×32; a structural check, not a computation
def test_embedding_net_plan():
  """The paper's net: conv1/conv2 flattened, conv3 and the head from factors."""
  model = EmbeddingNet()
  x = jnp.zeros((4, 32, 32, 3))
  params = model.init(jax.random.PRNGKey(0), x[:1])
  plan = _plan(model.apply, params, x)
  assert [(layer.kind, layer.positions, layer.fan_in, layer.features) for layer in plan.layers] == [
      ("conv", 256, 28, 8), ("conv", 64, 73, 16), ("conv", 16, 145, 32), ("dense", 1, 33, 8)
  ]
  assert plan.ghost == (False, False, True, True)
  assert plan.generic == ()


def _leaf_names(params, indices):
  """Leaf paths without the leading 'params' key, e.g. ("Dense_0", "kernel")."""
  paths = [
      tuple(k.key for k in path if k.key != "params")
      for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  return {paths[i] for i in indices}


@pytest.mark.parametrize(
    "model,shape,generic",
    [
        (TiedNet(), (5,), {("Dense_0", "bias"), ("Dense_0", "kernel")}),
        (KernelAlsoUsedElsewhere(), (5,), {("Dense_0", "bias"), ("Dense_0", "kernel")}),
        (ExamplesNotLeading(), (3, 5), {("Dense_0", "bias"), ("Dense_0", "kernel")}),
        # Slow: a conv + GroupNorm mix of the cases before and after it (44 s on 2 CPU cores). The
        # circular conv is a convolution of the padded input: recognised like any other.
        pytest.param(MixedNet(), (6, 6, 2), {("GroupNorm_0", "bias"), ("GroupNorm_0", "scale"),
                                             ("scale",)}, marks=pytest.mark.slow),
        # Slow: a plain function's dots and bias add are layers; only log_scale is generic.
        pytest.param("pure_jax_scaled", (3, 2), {("log_scale",)}, marks=pytest.mark.slow),
    ],
    ids=["tied", "kernel_used_elsewhere", "examples_not_leading", "mixed", "pure_jax_scaled"])
@pytest.mark.slow
def test_unrecognised_uses_fall_back_to_generic_jacobians(model, shape, generic, monkeypatch):
  """Leaves not owned by exactly one recognised call get ordinary per-example Jacobians."""
  embed_fn, params, x, x_prime = _problem(model, shape)
  plan = _plan(embed_fn, params, x)
  assert _leaf_names(params, plan.generic) == generic
  assert not plan.factored_leaves & set(plan.generic)
  _check_norms(embed_fn, params, x, x_prime, monkeypatch, {"auto": None})


# Slow: MixedNet's norms (fallback and factored leaves) are compared with materialize by
# test_unrecognised_uses_fall_back_to_generic_jacobians and its ḡ with jax.vjp by
# test_factor_contraction_is_the_backward_pass (pure_jax_scaled: a generic leaf) by default.
@pytest.mark.slow
def test_clipped_grad_matches_materialize_on_fallback_and_factored_mix(no_float_allowance):
  embed_fn, params, x, x_prime = _problem(MixedNet(), (6, 6, 2))
  loss = logit_dp.losses.contrastive(temperature=0.5)
  norms = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "materialize")
  clip = float(np.median(np.asarray(norms)))
  _, ghost = logit_dp.clipped_grad(embed_fn, loss, clip, "ghost")(params, x, x_prime)
  _, exact = logit_dp.clipped_grad(embed_fn, loss, clip, "materialize")(params, x, x_prime)
  np.testing.assert_allclose(flat(ghost), flat(exact), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_looped_and_vmapped_backward_passes_give_the_same_factors(monkeypatch):
  embed_fn, params, x, _ = _problem(ConvNet(CONV_CONFIGS["same_stride2"]), (7, 6, 3))
  plan = _plan(embed_fn, params, x)
  normalize = logit_dp.losses.normalize
  factors = {}
  for min_batch in (1, 10 ** 9):
    monkeypatch.setattr(layerwise, "_LOOPED_MIN_BATCH", min_batch)
    factors[min_batch] = layerwise.layer_factors(embed_fn, params, plan, x, normalize, None)
  for a, b in zip(jax.tree_util.tree_leaves(factors[1]),
                  jax.tree_util.tree_leaves(factors[10 ** 9])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class SqrtNet(nn.Module):
  """Finite embedding whose Jacobian is not finite for an all-zero input (√|h| at h = 0)."""
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(3, use_bias=False)(x)
    return nn.Dense(4)(jnp.sqrt(jnp.abs(h)) + 1.0)


def _batch(embed_fn, params, x):
  return make_batch(embed_fn, params, x, x)


def _normalised_embedding(batch, x):
  """params ↦ (m, d) normalised embeddings of x by embed_fn itself, example by example (JAX's
  own layers, not the library's factors): the reference the factor contractions are checked
  against."""
  from logit_dp._src import numerics  # pylint: disable=g-import-not-at-top
  return lambda p: jax.vmap(lambda xe: numerics.normalize(
      batch.embed_fn(p, xe[None])[0], batch.eps))(x)


def _backward_pass(batch, params, x, cotangents):
  """Σ_e J_eᵀ c_e by jax.vjp of the normalised embeddings: the reference."""
  return jax.vjp(_normalised_embedding(batch, x), params)[1](cotangents)[0]


# The default run keeps conv and pure_jax_scaled (a plain function's layers, a generic leaf, an
# unused leaf) with factored leaves; flattened leaves and the other models are slow.
FACTOR_MODELS = dict(
    argnames="model,shape", argvalues=[
        (ConvNet(CONV_CONFIGS["same_stride2"]), (7, 6, 3)),
        pytest.param(ConvNet(CONV_CONFIGS["no_bias"]), (5, 4, 2), marks=pytest.mark.slow),
        pytest.param(SequenceNet(), (5, 3), marks=pytest.mark.slow),
        pytest.param(MixedNet(), (6, 6, 2), marks=pytest.mark.slow),
        ("pure_jax_scaled", (3, 2)),
    ], ids=["conv", "conv_no_bias", "sequence", "mixed", "pure_jax_scaled"])


@pytest.mark.parametrize("mode", ["all_ghost", pytest.param("all_flat", marks=pytest.mark.slow)])
@pytest.mark.parametrize(**FACTOR_MODELS)
def test_factor_contraction_is_the_backward_pass(model, shape, mode, monkeypatch):
  """ḡ contracted from the factors = jax.vjp, per leaf, for factored, flat and generic leaves."""
  embed_fn, params, x, _ = _problem(model, shape)
  if isinstance(model, str):
    params = dict(params, unused=jnp.ones((3,)))  # a leaf the embedding never reads: ḡ = 0
  monkeypatch.setattr(layerwise, "use_ghost", lambda layer, d, g=MODES[mode]: g)
  cotangents = jax.random.normal(jax.random.PRNGKey(7), (x.shape[0], 4)).at[2].set(0.0)
  leaves, treedef = jax.tree_util.tree_flatten(params)

  @jax.jit  # one compilation instead of an eager dispatch of every operation
  def contract_and_reference(params, x, cotangents):
    batch = _batch(embed_fn, params, x)
    grads = layerwise.factors_transpose(batch.plan, batch.factors(x), cotangents,
                                        jax.tree_util.tree_leaves(params))
    return grads, jax.tree_util.tree_leaves(_backward_pass(batch, params, x, cotangents))

  grads, expected = contract_and_reference(params, x, cotangents)
  assert len(grads) == len(expected)
  for got, want in zip(grads, expected):
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(want))))
  if isinstance(model, str):
    np.testing.assert_array_equal(jax.tree_util.tree_unflatten(treedef, grads)["unused"], 0.0)


@pytest.mark.parametrize("mode", ["all_ghost", pytest.param("all_flat", marks=pytest.mark.slow)])
@pytest.mark.parametrize(**FACTOR_MODELS)
def test_factors_times_tangents_is_the_forward_derivative(model, shape, mode, monkeypatch):
  """J_e t_l contracted from the factors = jax.jvp of the normalised embedding of example e in
  direction t_l (JAX's own forward mode through embed_fn), for every example and tangent."""
  embed_fn, params, x, _ = _problem(model, shape)
  monkeypatch.setattr(layerwise, "use_ghost", lambda layer, d, g=MODES[mode]: g)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  num_tangents = 3
  keys = jax.random.split(jax.random.PRNGKey(11), len(leaves))
  tangent_leaves = [
      jax.random.normal(key, (num_tangents,) + leaf.shape) for key, leaf in zip(keys, leaves)
  ]

  @jax.jit  # one compilation instead of an eager dispatch of every operation
  def contract_and_reference(params, x, tangent_leaves):
    batch = _batch(embed_fn, params, x)
    embed = _normalised_embedding(batch, x)
    wants = [
        jax.jvp(embed, (params,),
                (jax.tree_util.tree_unflatten(treedef, [t[index] for t in tangent_leaves]),))[1]
        for index in range(num_tangents)
    ]  # each (m, d)
    return layerwise.factors_times(batch.plan, batch.factors(x), tangent_leaves), wants

  got, wants = contract_and_reference(params, x, tangent_leaves)
  for index, want in enumerate(wants):
    np.testing.assert_allclose(got[:, :, index], want, rtol=1e-4,
                               atol=1e-5 * float(np.max(np.abs(want))))


@pytest.mark.parametrize(
    "mode",
    [m if m == "all_ghost" else pytest.param(m, marks=pytest.mark.slow) for m in sorted(MODES)])
def test_nonfinite_factors_with_zero_cotangent_contribute_exactly_zero(mode, monkeypatch):
  """A finite embedding with a non-finite Jacobian (dropped pairs, λ = 0) must not leak NaN."""
  monkeypatch.setattr(layerwise, "use_ghost", lambda layer, d, g=MODES[mode]: g)
  embed_fn, params, x, x_prime = _problem(SqrtNet(), (5,))
  x = x.at[1].set(0.0)
  cotangents = jax.random.normal(jax.random.PRNGKey(8), (x.shape[0], 4)).at[1].set(0.0)
  keep = np.arange(x.shape[0]) != 1

  @jax.jit  # one compilation instead of an eager dispatch of every operation
  def contract_and_reference(params, x, cotangents):
    batch = _batch(embed_fn, params, x)
    factors = batch.factors(x)
    grads = jax.tree_util.tree_leaves(batch.factor_backward(factors, cotangents))
    return factors, grads, jax.tree_util.tree_leaves(
        _backward_pass(batch, params, x[keep], cotangents[keep]))

  factors, grads, expected = contract_and_reference(params, x, cotangents)
  assert not all(np.all(np.isfinite(f)) for f in jax.tree_util.tree_leaves(factors))
  assert len(grads) == len(expected)
  for got, want in zip(grads, expected):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  # End to end: the pairs (1, j), whose gradients are not finite, are dropped, exactly as
  # Algorithm 1 drops them; the example stays a negative of the others.
  loss = logit_dp.losses.contrastive(temperature=0.5)
  grads = {
      method: jax.jit(logit_dp.clipped_grad(embed_fn, loss, 0.5, method))(params, x, x_prime)[1]
      for method in ("ghost", "materialize")
  }
  assert np.all(np.isfinite(flat(grads["ghost"])))
  np.testing.assert_allclose(flat(grads["ghost"]), flat(grads["materialize"]), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("d", [2, 8, 9, 16])
@pytest.mark.parametrize("block_floats", [1, 5 * 7 * 3, 1 << 20])
def test_flat_cross_is_the_pairs_vectors_inner_product_in_every_form(d, block_floats):
  """v̂_jᵀ J_i J'_jᵀ û_i against ⟨J_iᵀv̂_j, J'_jᵀû_i⟩ formed pair by pair in float64: the
  cross-Gram at small d, the pairs' vectors in parameter blocks above it (blocks of one
  parameter, of 3 with 29 = 9·3 + 2 padded, and one block)."""
  rows, n, q = 5, 7, 29
  keys = jax.random.split(jax.random.key(d), 4)
  flat_rows, flat_all = (jax.random.normal(k, (m, d, q)) for k, m in zip(keys[:2], (rows, n)))
  u_rows, v_all = jax.random.normal(keys[2], (rows, d)), jax.random.normal(keys[3], (n, d))
  got = layerwise.flat_cross(flat_rows, u_rows, flat_all, v_all, block_floats)
  f_r, f_a, u, v = (np.asarray(a, np.float64) for a in (flat_rows, flat_all, u_rows, v_all))
  want = np.array([[(v[j] @ f_r[i]) @ (u[i] @ f_a[j]) for j in range(n)] for i in range(rows)])
  assert layerwise.flat_cross_by_gram(d) == (d <= 8)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_flat_pair_cost_takes_the_cheaper_of_the_cross_gram_and_the_pairs_vectors():
  """d² per parameter up to d = 8 (at GEMM speed), 4·2d above (the vectors' multiply-adds at a
  quarter of it): a dense layer of P·C parameters is weighed the same."""
  assert layerwise.flat_pair_cost(10, 4) == 16 * 10 and layerwise.flat_pair_cost(10, 8) == 640
  assert layerwise.flat_pair_cost(10, 32) == 8 * 32 * 10
  dense = layerwise.LayerCall("dense", (0,), (3,), 1, 6, 3)
  assert dense.pair_cost(32, ghost=False) == layerwise.flat_pair_cost(18, 32)

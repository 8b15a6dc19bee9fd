"""Per-layer factors of per-example Jacobians for flax Dense and Conv layers.

A flax ``nn.Dense`` or ``nn.Conv`` call y_t = W·a_t + b (t over the T output
positions, a_t the input patch of position t, P = its size, C = the output
features) has per-example weight gradient

    ∂û_k/∂(W, b) = Σ_t [a_t; 1] ⊗ δ_t^k,      δ_t^k = ∂û_k/∂y_t  (k = 1..d),

so one batched backward pass with d cotangents w.r.t. a zero perturbation ξ added
to every layer output gives all per-example Jacobians of these layers (δ), without
per-example weight-gradient backward passes; the patches a_t are recorded on the
way forward. With this factorisation the cross term of two pair gradients of a layer
is

    ⟨J_iᵀv̂_j, J'_jᵀû_i⟩ = Σ_{t,s} ⟨a_it, a'_js⟩ ⟨α_ij,t, β_ij,s⟩,
    α_ij,t = Σ_k v̂_jk δ_it^k,   β_ij,s = Σ_l û_il δ'_js^l,

which costs T²(P + C) + 2TCd per pair instead of d²·P·C ("ghost" layers); layers
where that is not cheaper are flattened into ordinary per-example Jacobians ("flat").
The same factors give ḡ = Σ_e J_eᵀc_e without a backward pass (`factors_transpose`).

Soundness. `make_plan` traces ``embed_fn`` with every parameter leaf replaced by
a placeholder and the recognised layers computed from the real leaves instead.
A leaf is factored only if the traced embedding does not depend on its placeholder
(a conservative data-flow check of the jaxpr: the layer is then the leaf's only
use), it belongs to exactly one recognised call, and that call's leading axis is
the example axis (checked at two batch sizes). Every other leaf the embedding
depends on gets ordinary per-example Jacobians. Only layers whose semantics are
reproduced exactly are recognised: ``nn.Dense`` (2-D kernel, last axis) and
``nn.Conv`` (one batch axis, feature_group_count 1, no mask, zero padding), float32,
default promotion and dot/conv functions; anything else falls back.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import dtypes as flax_dtypes
from flax.linen import linear as flax_linear

_HIGHEST = jax.lax.Precision.HIGHEST
# A pair cost unit of a ghost layer's α/β/⟨α,β⟩ work is ~this many GEMM multiply-adds
# (batched small contractions run well below matmul speed on CPU).
_GHOST_OVERHEAD = 8
# Embedding sizes up to this get one backward pass per coordinate (unrolled), not a vmap,
# for batches of at least _UNROLLED_MIN_BATCH examples.
_UNROLLED_COTANGENTS = 32
_UNROLLED_MIN_BATCH = 128


class LayerCall(NamedTuple):
  """One recognised layer call: kind, parameter leaves and factor sizes."""
  kind: str  # "dense" or "conv"
  leaves: tuple[int, ...]  # flat indices of (kernel,) or (kernel, bias)
  out_shape: tuple[int, ...]  # per-example shape of y
  positions: int  # T
  fan_in: int  # P (with the bias column)
  features: int  # C

  def pair_cost(self, d: int, ghost: bool) -> float:
    """Cost model per pair: T²P + k·(2TCd + T²C) (k = _GHOST_OVERHEAD) if ghost, else d²PC."""
    if ghost:
      t, c = self.positions, self.features
      return t * t * self.fan_in + _GHOST_OVERHEAD * (2 * t * c * d + t * t * c)
    return d * d * self.fan_in * self.features


class Plan(NamedTuple):
  """Which leaves are factored through which layer calls, and which are generic."""
  layers: tuple[LayerCall, ...]
  ghost: tuple[bool, ...]  # per layer: cross term from factors (True) or flattened
  generic: tuple[int, ...]  # leaves the embedding uses outside recognised layers

  @property
  def factored_leaves(self) -> frozenset:
    """Indices of the leaves some recognised layer call owns."""
    return frozenset(i for layer in self.layers for i in layer.leaves)


def _num_rows(x) -> int:
  """Examples in x, an array or a pytree of arrays with the examples along axis 0."""
  return jax.tree_util.tree_leaves(x)[0].shape[0]


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _conv_config(module, x):
  """(kernel_size, strides, padding, lhs_dil, rhs_dil) if this nn.Conv call is reproduced exactly.

  None otherwise.
  """
  kernel_size = ((module.kernel_size,)
                 if isinstance(module.kernel_size, int) else tuple(module.kernel_size))
  if (len(kernel_size) > 3 or x.ndim != len(kernel_size) + 2 or module.feature_group_count != 1
      or module.mask is not None or getattr(module, "conv_general_dilated", None) is not None
      or getattr(module, "conv_general_dilated_cls", None) is not None):
    return None

  def broadcast(v):
    v = 1 if v is None else v
    return (v,) * len(kernel_size) if isinstance(v, int) else tuple(v)

  padding = flax_linear.canonicalize_padding(module.padding, len(kernel_size))
  if isinstance(padding, str) and padding not in ("SAME", "VALID"):
    return None  # CIRCULAR / REFLECT / CAUSAL pad the input themselves
  return (kernel_size, broadcast(module.strides), padding, broadcast(module.input_dilation),
          broadcast(module.kernel_dilation))


def _layer_inputs(context, args, kwargs, placeholder_index):
  """(kind, leaves, config) when this call is a recognised layer on placeholders."""
  module = context.module
  if (context.method_name != "__call__" or kwargs or len(args) != 1
      or type(module) not in (nn.Dense, nn.Conv)):
    return None
  x = args[0]
  if (not hasattr(x, "dtype") or x.dtype != jnp.float32 or x.ndim < 2
      or module.dtype not in (None, jnp.float32) or module.param_dtype != jnp.float32 or getattr(
          module, "promote_dtype", flax_dtypes.promote_dtype) is not flax_dtypes.promote_dtype):
    return None
  if not module.has_variable("params", "kernel"):
    return None
  leaves = [placeholder_index.get(id(module.get_variable("params", "kernel")))]
  if module.use_bias:
    if not module.has_variable("params", "bias"):
      return None
    leaves.append(placeholder_index.get(id(module.get_variable("params", "bias"))))
  if any(i is None for i in leaves):
    return None
  if type(module) is nn.Dense:
    if (not isinstance(module.features, int) or getattr(module, "dot_general", None) is not None
        or getattr(module, "dot_general_cls", None) is not None):
      return None
    return "dense", tuple(leaves), None
  config = _conv_config(module, x)
  if config is None:
    return None
  return "conv", tuple(leaves), config


def _apply_layer(kind, config, x, kernel, bias, precision, with_patches=True):
  """(y, patches (N, T, P) or None) of a recognised layer, computed from the real leaves."""
  if kind == "dense":
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
    patches = x.reshape(x.shape[0], -1, x.shape[-1]) if with_patches else None
  else:
    # cast: a custom_vjp under functools.partial loses its return type in JAX's annotations.
    y = cast(jax.Array, channels_last_conv(x, kernel, config, precision))
    patches = conv_patches(x, *config) if with_patches else None
  if bias is not None:
    y = y + bias.reshape((1,) * (y.ndim - 1) + bias.shape)
    if patches is not None:
      patches = jnp.concatenate([patches, jnp.ones(patches.shape[:-1] + (1,), patches.dtype)], -1)
  return y, None if patches is None else jax.lax.stop_gradient(patches)


def _dilated(sizes, dilation):
  return [0 if s == 0 else 1 + d * (s - 1) for s, d in zip(sizes, dilation)]


def _explicit_padding(x, kernel_size, strides, padding, lhs_dilation, rhs_dilation):
  if not isinstance(padding, str):
    return tuple(tuple(p) for p in padding)
  return tuple(
      jax.lax.padtype_to_pads(_dilated(x.shape[1:-1], lhs_dilation),
                              _dilated(kernel_size, rhs_dilation), strides, padding))


def _conv(x, kernel, strides, padding, lhs_dilation, rhs_dilation, precision):
  """Channels-last convolution (N, *spatial, C) * (*window, I, O), explicit padding."""
  return jax.lax.conv_general_dilated(
      x,
      kernel,
      strides,
      padding,
      lhs_dilation=lhs_dilation,
      rhs_dilation=rhs_dilation,
      dimension_numbers=flax_linear._conv_dimension_numbers(x.shape),  # pylint: disable=protected-access
      precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def channels_last_conv(x, kernel, config, precision) -> jax.Array:
  """nn.Conv's convolution for a `_conv_config` config, with a backward pass made of
  channels-last convolutions only.

  Same values and gradients as jax.lax.conv_general_dilated. JAX differentiates a convolution
  into convolutions with transposed dimension labels, which XLA:CPU runs 4-50x slower inside a
  loop body (lax.map / scan, as in microbatching) than outside one
  (https://github.com/jax-ml/jax/issues/12868); here the operands are transposed explicitly
  instead, so every convolution has the labels of the forward one.
  """
  _, strides, _, lhs_dil, rhs_dil = config
  return _conv(x, kernel, strides, _explicit_padding(x, *config), lhs_dil, rhs_dil, precision)


def _channels_last_conv_fwd(x, kernel, config, precision):
  return channels_last_conv(x, kernel, config, precision), (x, kernel)


def _channels_last_conv_bwd(config, precision, residuals, g):
  """x̄ = g ⋆ flip(W)ᵀ (strides ↔ input dilation); W̄ = x ⋆ g over the batch (as in JAX)."""
  x, kernel = residuals
  kernel_size, strides, _, lhs_dil, rhs_dil = config
  padding = _explicit_padding(x, *config)
  in_sizes, out_sizes = x.shape[1:-1], g.shape[1:-1]
  in_d = _dilated(in_sizes, lhs_dil)
  window_d = _dilated(kernel_size, rhs_dil)
  out_d = _dilated(out_sizes, strides)
  lhs_before = [w - lo - 1 for w, (lo, _) in zip(window_d, padding)]
  lhs_padding = [(b, i + w - 1 - o - b) for b, i, w, o in zip(lhs_before, in_d, window_d, out_d)]
  spatial = tuple(range(len(kernel_size)))
  flipped = jnp.swapaxes(jnp.flip(kernel, spatial), -1, -2)  # (*window, O, I)
  x_bar = _conv(g, flipped, lhs_dil, lhs_padding, strides, rhs_dil, precision)
  rhs_padding = [
      (lo, o - i + w - lo - 1) for (lo, _), i, w, o in zip(padding, in_d, window_d, out_d)
  ]
  # Batch as the contracted feature axis: x as (C_in, *spatial, N), g as (*out, N, C_out).
  kernel_bar = _conv(jnp.swapaxes(x, 0, -1), jnp.moveaxis(g, 0, -2), rhs_dil, rhs_padding, lhs_dil,
                     strides, precision)  # (C_in, *window, C_out)
  return x_bar, jnp.moveaxis(kernel_bar, 0, -2).astype(kernel.dtype)


channels_last_conv.defvjp(_channels_last_conv_fwd, _channels_last_conv_bwd)


def conv_patches(x, kernel_size, strides, padding, lhs_dilation, rhs_dilation) -> jax.Array:
  """Input patches of a channels-last convolution: (N, T, K·C_in), kernel-offset major.

  Row t, column (o, c) is the input value that kernel offset o, input channel c multiply
  at output position t (zero where padded), so y_t = patches_t · kernel.reshape(K·C_in, C_out)
  for a kernel of shape (*kernel_size, C_in, C_out), exactly as lax.conv_general_dilated.
  """
  spatial = x.shape[1:-1]
  dilated_in = [(s - 1) * d + 1 for s, d in zip(spatial, lhs_dilation)]
  dilated_k = [(k - 1) * d + 1 for k, d in zip(kernel_size, rhs_dilation)]
  if isinstance(padding, str):
    padding = jax.lax.padtype_to_pads(dilated_in, dilated_k, strides, padding)
  config = [(0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation)
                         ] + [(0, 0, 0)]
  padded = jax.lax.pad(x, jnp.zeros((), x.dtype), config)
  out = [(p - k) // s + 1 for p, k, s in zip(padded.shape[1:-1], dilated_k, strides)]
  columns = []
  for offset in np.ndindex(*kernel_size):
    start = [0] + [o * d for o, d in zip(offset, rhs_dilation)] + [0]
    limit = ([x.shape[0]] + [st + (m - 1) * s + 1 for st, m, s in zip(start[1:-1], out, strides)]
             + [x.shape[-1]])
    columns.append(jax.lax.slice(padded, start, limit, [1] + list(strides) + [1]))
  patches = jnp.stack(columns, axis=-2)  # (N, *out, K, C_in)
  return patches.reshape(x.shape[0], int(np.prod(out)), -1)


@dataclasses.dataclass
class _Interceptor:
  """Computes recognised layers from the real leaves (plus ξ), recording patches."""
  placeholder_index: dict  # id(placeholder) -> leaf index
  real_leaves: list
  perturbations: Any = None  # list of ξ in call order (None while planning)
  with_patches: bool = True  # False: only compute the layers (with_recognised_layers)
  calls: list = dataclasses.field(default_factory=list)  # (kind, leaves) per call
  records: list = dataclasses.field(default_factory=list)  # (x, y, patches) shapes per call
  patches: list = dataclasses.field(default_factory=list)

  def __call__(self, next_fun, args, kwargs, context):
    found = _layer_inputs(context, args, kwargs, self.placeholder_index)
    if found is None:
      return next_fun(*args, **kwargs)
    kind, leaves, config = found
    position = len(self.calls)
    x = args[0]
    kernel = self.real_leaves[leaves[0]]
    bias = self.real_leaves[leaves[1]] if len(leaves) > 1 else None
    y, patches = _apply_layer(kind, config, x, kernel, bias, context.module.precision,
                              self.with_patches)
    if self.perturbations is not None and position < len(self.perturbations):
      y = y + self.perturbations[position]  # a call beyond the plan fails layer_factors' check
    self.calls.append((kind, leaves))
    if patches is not None:  # self.with_patches
      self.records.append((x.shape, y.shape, patches.shape))
      self.patches.append(patches)
    return y


def with_recognised_layers(embed_fn) -> Callable[[Any, jax.Array], jax.Array]:
  """embed_fn with every recognised nn.Dense / nn.Conv call computed by `_apply_layer`.

  Same values and gradients; the difference is that convolutions then differentiate into
  channels-last convolutions only (`channels_last_conv`), which XLA:CPU runs at full speed
  inside the loop bodies of microbatching.
  """
  def embed(params, x):
    leaves = jax.tree_util.tree_leaves(params)
    interceptor = _Interceptor({id(leaf): i for i, leaf in enumerate(leaves)}, leaves,
                               with_patches=False)
    with nn.intercept_methods(interceptor):
      return embed_fn(params, x)

  return embed


def replace_leaves(leaves, treedef, indices, values) -> Any:
  """The pytree of `leaves` with leaves[i] replaced by values[k] for i = indices[k]."""
  out = list(leaves)
  for i, value in zip(indices, values):
    out[i] = value
  return jax.tree_util.tree_unflatten(treedef, out)


def _dependent_inputs(closed_jaxpr) -> set:
  """Indices of the jaxpr's inputs that any output depends on (conservative data flow)."""
  jaxpr = closed_jaxpr.jaxpr
  labels = {}
  for k, var in enumerate(jaxpr.invars):
    labels[var] = frozenset([k])
  empty = frozenset()

  def of(atom):
    return labels.get(atom, empty) if not hasattr(atom, "val") else empty

  for eqn in jaxpr.eqns:
    deps = frozenset().union(*[of(a) for a in eqn.invars]) if eqn.invars else empty
    for out in eqn.outvars:
      labels[out] = deps
  result = set()
  for out in jaxpr.outvars:
    result |= of(out)
  return result


def _trace(embed_fn, leaves, treedef, candidates, x_struct):
  """Traces embed_fn once with placeholders for `candidates`.

  Returns (recognised calls, their shape records, candidates whose placeholder the output
  depends on, leaves whose real value it depends on).
  """
  candidates = sorted(candidates)
  interceptor_box = []

  def fn(placeholders, reals, x):
    index = {id(p): i for p, i in zip(placeholders, candidates)}
    interceptor = _Interceptor(index, reals)
    interceptor_box.append(interceptor)
    params = replace_leaves(reals, treedef, candidates, placeholders)
    with nn.intercept_methods(interceptor):
      return embed_fn(params, x)

  placeholders = [
      jax.ShapeDtypeStruct(np.shape(leaves[i]), jnp.result_type(leaves[i])) for i in candidates
  ]
  reals = [jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf)) for leaf in leaves]
  closed = jax.make_jaxpr(fn)(placeholders, reals, x_struct)
  interceptor = interceptor_box[-1]
  depends = _dependent_inputs(closed)
  # Flat inputs: placeholders first, then every real leaf, then x.
  num_placeholders = len(candidates)
  placeholder_deps = {candidates[k] for k in depends if k < num_placeholders}
  real_deps = {
      k - num_placeholders for k in depends
      if num_placeholders <= k < num_placeholders + len(leaves)
  }
  return interceptor.calls, interceptor.records, placeholder_deps, real_deps


def make_plan(embed_fn, params, x, d: int) -> Plan:
  """Finds the recognised layers of embed_fn and the leaves they fully own (see module doc)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  n = _num_rows(x)
  structs = [
      jax.tree_util.tree_map(
          lambda a, m=m: jax.ShapeDtypeStruct((m,) + tuple(a.shape[1:]), a.dtype), x)
      for m in (n, n + 1)
  ]
  candidates = {i for i, leaf in enumerate(leaves) if _is_float(leaf)}
  while True:
    calls, records, placeholder_deps, real_deps = _trace(embed_fn, leaves, treedef, candidates,
                                                         structs[0])
    owners = collections.Counter(i for _, ls in calls for i in ls)
    _, records_plus, _, _ = _trace(embed_fn, leaves, treedef, candidates, structs[1])
    bad = set(placeholder_deps) | {i for i, c in owners.items() if c > 1}
    if len(records_plus) != len(records):
      bad |= set(owners)
    else:
      for (_, ls), (xs, ys, _), (xs1, ys1, _) in zip(calls, records, records_plus):
        if not (xs[0] == n and ys[0] == n and xs1[0] == n + 1 and ys1[0] == n + 1
                and xs[1:] == xs1[1:] and ys[1:] == ys1[1:]):
          bad |= set(ls)  # the leading axis is not the example axis
    if not bad & candidates:
      break
    candidates -= bad
  layers = []
  for (kind, ls), (_, y_shape, p_shape) in zip(calls, records):
    layers.append(
        LayerCall(kind, ls, tuple(y_shape[1:]), int(p_shape[1]), int(p_shape[2]), int(y_shape[-1])))
  factored = {i for layer in layers for i in layer.leaves}
  generic = tuple(
      sorted(i for i in real_deps | placeholder_deps if i not in factored and _is_float(leaves[i])))
  return Plan(tuple(layers), tuple(use_ghost(layer, d) for layer in layers), generic)


def use_ghost(layer: LayerCall, d: int) -> bool:
  """Cross terms from the layer's factors when that is cheaper per pair than flattening."""
  return layer.pair_cost(d, ghost=True) < layer.pair_cost(d, ghost=False)


class Factors(NamedTuple):
  """Per-example Jacobian factors of one view (leading axis = examples).

  flat: (m, d, q) per-example Jacobians of the flattened layers and generic leaves
    (q may be 0); ghost_patches[l]: (m, T, P); ghost_deltas[l]: (m, T, d, C);
  gram: (m, d, d) per-example Grams J_e J_eᵀ over all parameters.
  """
  flat: jax.Array
  ghost_patches: tuple
  ghost_deltas: tuple
  gram: jax.Array


def ghost_layer_gram(patches, deltas) -> jax.Array:
  """Σ_{t,s} ⟨a_t, a_s⟩⟨δ_t^k, δ_s^l⟩ per example: (m, d, d)."""
  a = jnp.einsum("mtp,msp->mts", patches, patches, precision=_HIGHEST)
  a_delta = jnp.einsum("mts,mslc->mtlc", a, deltas, precision=_HIGHEST)
  return jnp.einsum("mtkc,mtlc->mkl", deltas, a_delta, precision=_HIGHEST)


def _deltas(embed_fn, params, plan: Plan, x, normalize_fn, varying, with_patches: bool,
            stacked: bool = True):
  """(u, deltas, patches) of a batch: u = normalize_fn(embed_fn(params, x)) (m, d);
  deltas[l] = ∂u_k/∂y_l for every coordinate k, (d, m, *out_shape) per planned layer
  call l (one backward pass per k; not stacked: a list over k where the passes are
  unrolled); patches[l] as recorded by _Interceptor ([] if not with_patches)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  factored = sorted(plan.factored_leaves)
  planned = [(layer.kind, layer.leaves) for layer in plan.layers]
  m = _num_rows(x)
  xis = [varying(jnp.zeros((m,) + layer.out_shape, jnp.float32)) for layer in plan.layers]

  def embed(perturbations):
    placeholders = [jnp.zeros_like(leaves[i]) for i in factored]
    index = {id(p): i for p, i in zip(placeholders, factored)}
    interceptor = _Interceptor(index, leaves, perturbations, with_patches=with_patches)
    with nn.intercept_methods(interceptor):
      e = embed_fn(replace_leaves(leaves, treedef, factored, placeholders), x)
    if interceptor.calls != planned:  # never silently mis-factor (a missing ξ means δ = 0)
      raise RuntimeError("logit_dp: embed_fn's layer calls differ from its plan; "
                         "embed_fn must trace the same way on every call.")
    return normalize_fn(e), interceptor.patches

  u, vjp_fn, patches = jax.vjp(embed, xis, has_aux=True)
  d = u.shape[-1]
  eye = jnp.eye(d, dtype=u.dtype)
  if d <= _UNROLLED_COTANGENTS and m >= _UNROLLED_MIN_BATCH:
    # d separate backward passes: ~2x faster than one vmapped pass on CPU for large batches
    # (n = 1000, embedding net); for small ones the vmap compiles faster.
    per_k = [vjp_fn(jnp.zeros_like(u) + eye[k])[0] for k in range(d)]
    deltas = [jnp.stack(layer_deltas) for layer_deltas in zip(*per_k)] if stacked else per_k
  else:
    deltas = jax.vmap(lambda c: vjp_fn(jnp.zeros_like(u) + c)[0])(eye)
  return u, deltas, patches


def embedding_deltas(embed_fn, params, plan: Plan, x, normalize_fn) -> list:
  """∂u_k/∂y_l of every planned layer call l and coordinate k, not stacked: the forward
  pass and the d backward passes that `layer_factors` starts from, and nothing else
  (benchmarks.profile_ghost times it as part of the step's cost floor)."""
  return _deltas(embed_fn, params, plan, x, normalize_fn, lambda a: a, with_patches=False,
                 stacked=False)[1]


def layer_factors(embed_fn, params, plan: Plan, x, normalize_fn, generic_jacobian,
                  varying=lambda a: a) -> Factors:
  """Factors of a batch x under plan.

  generic_jacobian(leaf_indices) -> (m, d, q) per-example Jacobians of those leaves;
  varying(a) types a as per-device inside shard_map (so that derivatives w.r.t. the
  perturbations stay local instead of being summed over devices).
  """
  m = _num_rows(x)
  u, deltas, patches = _deltas(embed_fn, params, plan, x, normalize_fn, varying, with_patches=True)
  d = u.shape[-1]
  flat, ghost_patches, ghost_deltas = [], [], []
  gram = jnp.zeros((m, d, d), u.dtype)
  for layer, is_ghost, a, delta in zip(plan.layers, plan.ghost, patches, deltas):
    delta = jnp.moveaxis(delta.reshape(d, m, layer.positions, layer.features), 0, 2)  # (m,T,d,C)
    if is_ghost:
      ghost_patches.append(a)
      ghost_deltas.append(delta)
      gram = gram + ghost_layer_gram(a, delta)
    else:
      grads = jnp.einsum("mtp,mtn->mpn", a, delta.reshape(m, layer.positions, d * layer.features),
                         precision=_HIGHEST)
      grads = grads.reshape(m, layer.fan_in, d, layer.features)
      flat.append(jnp.moveaxis(grads, 2, 1).reshape(m, d, -1))
  if plan.generic:
    flat.append(generic_jacobian(plan.generic))
  flat = jnp.concatenate(flat, axis=-1) if flat else jnp.zeros((m, d, 0), u.dtype)
  # Example by example: the batched (m, d, q)·(m, q, d) contraction runs 3-6x slower on CPU.
  gram = gram + jax.lax.map(lambda f: jnp.matmul(f, f.T, precision=_HIGHEST), flat)
  return Factors(flat, tuple(ghost_patches), tuple(ghost_deltas), gram)


def factors_transpose(plan: Plan, factors: Factors, cotangents, leaves, keep=None) -> list:
  """Σ_e J_eᵀ c_e per parameter leaf, contracted from the factors (no backward pass).

  Flattened layers and generic leaves: Σ_e flat_eᵀ c_e; ghost layer:
  Σ_{e,t} a_et ⊗ (Σ_k c_ek δ_et^k) (kernel rows of the patch axis, then the bias column). Leaves
  the embedding does not use get zeros. keep: optional (m,) bool; examples not kept have their
  factors *selected* to 0, so they add exactly 0 even where their factors are not finite (0·NaN is
  NaN).
  """
  m, d, q = factors.flat.shape

  def select(a):
    if keep is None:
      return a
    return jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a, jnp.zeros_like(a))

  grads = [jnp.zeros_like(leaf) for leaf in leaves]
  flat = jnp.matmul(cotangents.reshape(m * d),
                    select(factors.flat).reshape(m * d, q),
                    precision=_HIGHEST)  # one GEMV; an einsum here is ~15x slower on CPU
  offset = 0
  ghost = iter(zip(factors.ghost_patches, factors.ghost_deltas))
  for layer, is_ghost in zip(plan.layers, plan.ghost):
    if is_ghost:
      patches, deltas = next(ghost)
      weighted = jnp.sum(select(deltas) * cotangents[:, None, :, None], axis=2)  # (m, T, C)
      grad = jnp.matmul(
          select(patches).reshape(-1, layer.fan_in).T, weighted.reshape(-1, layer.features),
          precision=_HIGHEST)
    else:
      size = layer.fan_in * layer.features
      grad = flat[offset:offset + size].reshape(layer.fan_in, layer.features)
      offset += size
    kernel = leaves[layer.leaves[0]]
    grads[layer.leaves[0]] = grad[:kernel.size // layer.features].reshape(kernel.shape)
    if len(layer.leaves) > 1:
      grads[layer.leaves[1]] = grad[-1].reshape(leaves[layer.leaves[1]].shape)
  for i in plan.generic:
    grads[i] = flat[offset:offset + leaves[i].size].reshape(leaves[i].shape)
    offset += leaves[i].size
  return grads


def factors_times(plan: Plan, factors: Factors, tangent_leaves) -> jax.Array:
  """(m, d, k): J_e t_l for every example e and tangent t_l, contracted from the factors (the
  transpose of `factors_transpose`: ⟨J_eᵀc_e, t⟩ = ⟨c_e, J_e t⟩).

  tangent_leaves: the k tangents as parameter leaves, each (k, *leaf.shape), in
  `jax.tree_util.tree_leaves` order. Flattened layers and generic leaves: flat_e t_l, one GEMM
  over (m·d, q)(q, k); ghost layer: Σ_{t,c} δ_et^a[c] (a_et W_l)[c] with W_l the layer's
  (kernel rows, then bias) tangent matrix: one GEMM (m·T, P)(P, k·C), then per example a
  (d, T·C)(T·C, k) product. Never the (k, m, T, d, C) broadcast a transposed ghost layer
  would form (the reason this exists: ~10x faster at d = 32, k = 32 on CPU).
  """
  m, d, q = factors.flat.shape
  k = tangent_leaves[0].shape[0] if tangent_leaves else 0

  def layer_matrix(layer):  # (k, P, C) in factors_transpose's (kernel rows, bias) layout
    kernel = tangent_leaves[layer.leaves[0]].reshape(k, -1, layer.features)
    if len(layer.leaves) == 1:
      return kernel
    return jnp.concatenate([kernel, tangent_leaves[layer.leaves[1]].reshape(k, 1, -1)], axis=1)

  flat_tangents, out = [], jnp.zeros((m, d, k), factors.flat.dtype)
  ghost = iter(zip(factors.ghost_patches, factors.ghost_deltas))
  for layer, is_ghost in zip(plan.layers, plan.ghost):
    w = layer_matrix(layer)
    if not is_ghost:
      flat_tangents.append(w.reshape(k, -1))
      continue
    patches, deltas = next(ghost)  # (m, T, P), (m, T, d, C)
    t, c = layer.positions, layer.features
    applied = jnp.matmul(patches.reshape(m * t, layer.fan_in),
                         jnp.moveaxis(w, 0, 1).reshape(layer.fan_in, k * c),
                         precision=_HIGHEST).reshape(m, t, k, c)
    out = out + jnp.einsum("mtdc,mtkc->mdk", deltas, applied, precision=_HIGHEST)
  flat_tangents += [tangent_leaves[i].reshape(k, -1) for i in plan.generic]
  if q:
    flat_t = jnp.concatenate(flat_tangents, axis=1)  # (k, q), factors.flat's column order
    out = out + jnp.matmul(factors.flat.reshape(m * d, q), flat_t.T, precision=_HIGHEST).reshape(
        m, d, k)
  return out


def diagonal_sq_norms(plan: Plan, f_u: Factors, f_v: Factors, u, v, chunk: int = 1) -> jax.Array:
  """‖J_iᵀv̂_i + J'_iᵀû_i‖² of the pairs (x_i, x'_i), from both views' factors: (m,).

  The pair gradient is formed as a vector (per layer Σ_t a_it ⊗ α_it + Σ_s a'_is ⊗ β_is, with
  α_it = Σ_k v̂_ik δ_it^k and β_is = Σ_l û_il δ'_is^l; flattened parameters flat_iᵀv̂_i +
  flat'_iᵀû_i) before its norm is taken, so no Gram form a + b + 2c loses the small norms of
  near-identical views to cancellation. Rows are processed `chunk` at a time (memory: chunk
  times the number of parameters).
  """
  del plan  # the factors' layout is all that is needed

  def one(fu, fv, ui, vi):
    flat = (jnp.matmul(vi, fu.flat, precision=_HIGHEST)
            + jnp.matmul(ui, fv.flat, precision=_HIGHEST))
    sq = jnp.sum(flat * flat)
    for a_u, d_u, a_v, d_v in zip(fu.ghost_patches, fu.ghost_deltas, fv.ghost_patches,
                                  fv.ghost_deltas):
      alpha = jnp.einsum("tkc,k->tc", d_u, vi, precision=_HIGHEST)
      beta = jnp.einsum("tkc,k->tc", d_v, ui, precision=_HIGHEST)
      grad = (jnp.matmul(a_u.T, alpha, precision=_HIGHEST)
              + jnp.matmul(a_v.T, beta, precision=_HIGHEST))
      sq = sq + jnp.sum(grad * grad)
    return sq

  rows = (f_u._replace(gram=None), f_v._replace(gram=None), u, v)
  return jax.lax.map(lambda r: one(*r), rows, batch_size=max(1, int(chunk)))


def flat_cross(flat_rows, u_rows, flat_all, v_all) -> jax.Array:
  """v̂_jᵀ J_i J'_jᵀ û_i over the flattened parameters, rows i × all columns j: (I, n).

  One (I·d × q)·(q × n·d) matmul per chunk of rows: n²d²q multiply-adds in all.
  """
  rows, d, q = flat_rows.shape
  n = flat_all.shape[0]
  gram = jnp.matmul(flat_rows.reshape(rows * d, q),
                    flat_all.reshape(n * d, q).T, precision=_HIGHEST).reshape(rows, d, n, d)
  return jnp.einsum("jk,ikjl,il->ij", v_all, gram, u_rows, precision=_HIGHEST)


def ghost_layer_cross(a_rows, delta_rows, u_rows, a_all, delta_all, v_all) -> jax.Array:
  """Σ_{t,s} ⟨a_it, a'_js⟩⟨α_ij,t, β_ij,s⟩ of one ghost layer, rows i × all columns j: (I, n).

  Layouts (see `ghost_cross_layouts`): a_rows (I, T, P), delta_rows (I, T, C, d),
  a_all (n, T, P), delta_all (d, n, T, C). Contracted as

      Π_ij = a_i a'_jᵀ (T×T),   β_ij = Σ_l û_il Δ'_j^l (T×C),   γ_ij = Π_ij β_ij,
      cross_ij = Σ_k v̂_jk ⟨Δ_i^k, γ_ij⟩,

  i.e. T²P (one GEMM) + 2TCd + T²C multiply-adds per pair; α is never formed.
  """
  rows, t, p = a_rows.shape
  d, n, _, c = delta_all.shape
  patch_inner = jnp.einsum("itp,jsp->ijts", a_rows, a_all, precision=_HIGHEST)
  beta = jnp.matmul(u_rows, delta_all.reshape(d, n * t * c),
                    precision=_HIGHEST).reshape(rows, n, t, c)
  gamma = jnp.matmul(patch_inner, beta, precision=_HIGHEST)  # (I, n, T, C)
  rho = jnp.matmul(gamma.reshape(rows, n, t * c), delta_rows.reshape(rows, t * c, d),
                   precision=_HIGHEST)  # (I, n, d): ⟨Δ_i^k, γ_ij⟩
  return jnp.einsum("ijk,jk->ij", rho, v_all, precision=_HIGHEST)


def ghost_cross_layouts(row_deltas, column_deltas) -> tuple[jax.Array, jax.Array]:
  """Factors.ghost_deltas (m, T, d, C) of the row and column views, in the layouts of
  `ghost_layer_cross`: (m, T, C, d) and (d, m, T, C)."""
  return jnp.swapaxes(row_deltas, 2, 3), jnp.moveaxis(column_deltas, 2, 0)

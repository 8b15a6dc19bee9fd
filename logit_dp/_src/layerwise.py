"""Per-layer factors of per-example Jacobians, for the parameter-linear operations of any
JAX embedding function.

Contract: ``embed_fn(params, x)`` is a pure function of a params pytree and a batch x
(an array or pytree of arrays, examples along axis 0) that embeds every example on its own
(row e of the output depends on x[e] only). Any framework that gives such a function
works; its parameter-linear operations are found in the traced jaxpr
(`logit_dp._src.linear_ops`), so flax.linen, flax.nnx, Equinox, Haiku-style and
plain-function models get the same factors:

* flax.linen:  ``embed_fn = model.apply``; ``params = model.init(key, x[:1])``.
* flax.nnx:    ``graphdef, params = nnx.split(model)``;
               ``embed_fn = lambda p, x: nnx.merge(graphdef, p)(x)``.
* Equinox (a per-example model, vmapped):
               ``params, static = eqx.partition(model, eqx.is_inexact_array)``;
               ``embed_fn = lambda p, x: jax.vmap(eqx.combine(p, static))(x)``.
* Haiku-style: ``net = hk.without_apply_rng(hk.transform(f))``; ``embed_fn = net.apply``.
* A function:  ``embed_fn = lambda p, x: jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]``.

An operation y_t = W·a_t + b that is linear in a parameter leaf W (dense: t over the
positions of the non-contracted input axes; convolution: t over the T output positions,
a_t the input patch of position t; P = its size, C = the output features) has per-example
weight gradient

    ∂û_k/∂(W, b) = Σ_t [a_t; 1] ⊗ δ_t^k,      δ_t^k = ∂û_k/∂y_t  (k = 1..d),

so one batched backward pass with d cotangents w.r.t. a zero perturbation ξ added to every
such output gives all per-example Jacobians of these layers (δ), without per-example
weight-gradient backward passes; the inputs a_t are recorded on the way forward. With this
factorisation the cross term of two pair gradients of a layer is

    ⟨J_iᵀv̂_j, J'_jᵀû_i⟩ = Σ_{t,s} ⟨a_it, a'_js⟩ ⟨α_ij,t, β_ij,s⟩,
    α_ij,t = Σ_k v̂_jk δ_it^k,   β_ij,s = Σ_l û_il δ'_js^l,

which costs T²(P + C) + 2TCd per pair instead of the 2d·P·C of the pair's vectors over the
flattened layer ("ghost" layers; `LayerCall.pair_cost` weighs both forms); layers where that
is not cheaper are flattened into ordinary per-example Jacobians ("flat").
The same factors give ḡ = Σ_e J_eᵀc_e without a backward pass (`factors_transpose`).

Soundness. `make_plan` traces ``embed_fn`` at two batch sizes. A leaf is factored only if
every use of it in the jaxpr is one recognised operation (of a registered layer kind,
`layers`: float32 operands, reached through pure reindexings of the leaf) or that
operation's bias add, that operation's input has the example axis as its leading
axis at both batch sizes, and the leaf belongs to no other operation. Every other leaf the
embedding depends on (a conservative data-flow walk of the jaxpr) gets ordinary per-example
Jacobians ("generic").
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from logit_dp._src import layers
from logit_dp._src import linear_ops

_HIGHEST = jax.lax.Precision.HIGHEST
# A pair cost unit of a ghost layer's α/β/⟨α,β⟩ work is ~this many GEMM multiply-adds
# (batched small contractions run well below matmul speed on CPU).
_GHOST_OVERHEAD = 8
# A multiply-add of the pairs' vectors over flattened parameters (`flat_cross`) costs ~this many
# of one large GEMM: their n²·q floats pass through memory (CPU: 13-22 against 70 GMAC/s). So
# the vectors (2d multiply-adds per parameter and pair) beat the cross-Gram (d², at GEMM speed)
# above d = 2·_FLAT_VECTOR_SLOWDOWN.
_FLAT_VECTOR_SLOWDOWN = 4
# Flattening a layer (`_assembled`) writes its m·P·d·C per-example Jacobian and moves it into the
# flat columns' order: ~this many times the time of the T·P·C·d multiply-adds that form it (CPU:
# a ViT's 65-token layers).
_FLATTEN_COST = 2
# DP-GCL keeps a layer as its factors when they hold at most this many times the floats of its
# flattened per-example Jacobian (`keeps_group_factors`). A ViT's 65-token layers (2.0×) are
# then factors, which makes its DP-GCL step faster (docs/BENCHMARKS.md); the first convolution
# of the paper's embedding net (41×) stays flattened: its per-group forms cost more than its
# per-example GEMMs.
_GROUP_FACTOR_RATIO = 4
# Embedding sizes up to this get one backward pass per coordinate (a loop), not a vmap,
# for batches of at least _LOOPED_MIN_BATCH examples.
_LOOPED_COTANGENTS = 32
_LOOPED_MIN_BATCH = 128


class LayerCall(NamedTuple):
  """One recognised layer call: kind, parameter leaves and factor sizes."""
  kind: str  # "dense", "conv" or "embed"
  leaves: tuple[int, ...]  # flat indices of (kernel,) or (kernel, bias)
  out_shape: tuple[int, ...]  # per-example shape of y, (*positions, C)
  positions: int  # T
  fan_in: int  # P (with the bias column)
  features: int  # C
  # The kernel matrix (P without bias, C) is the kernel leaf with its axes in this order,
  # reshaped; None: the leaf itself in row-major order.
  kernel_axes: tuple[int, ...] | None = None

  def pair_cost(self, d: int, ghost: bool) -> float:
    """Cost model per pair: T²P + k·(2TCd + T²C) (k = _GHOST_OVERHEAD) if ghost, else
    `flat_pair_cost` of its P·C parameters."""
    if ghost:
      t, c = self.positions, self.features
      return t * t * self.fan_in + _GHOST_OVERHEAD * (2 * t * c * d + t * t * c)
    return flat_pair_cost(self.fan_in * self.features, d)

  def gram_cost(self, d: int, ghost: bool) -> float:
    """Cost model per example of its Gram J_e J_eᵀ: T²P + T²Cd + TCd² from its factors
    (`ghost_layer_gram`), else k·TPCd + d²PC (k = _FLATTEN_COST: the flattened per-example
    Jacobian formed, then its Gram)."""
    t, p, c = self.positions, self.fan_in, self.features
    if ghost:
      return float(t * t * p + t * t * c * d + t * c * d * d)
    return float(_FLATTEN_COST * t * p * c * d + d * d * p * c)


def flat_cross_by_gram(d: int) -> bool:
  """Whether `flat_cross` forms the cross-Gram (d² multiply-adds per parameter and pair, at
  GEMM speed) rather than the pairs' vectors (2d, `_FLAT_VECTOR_SLOWDOWN` times slower each)."""
  return d <= 2 * _FLAT_VECTOR_SLOWDOWN


def flat_pair_cost(size: int, d: int) -> float:
  """The cost model per pair of `size` flattened parameters, in GEMM multiply-adds: the cheaper
  of d²·size (cross-Gram) and k·2d·size (the pairs' vectors, k = _FLAT_VECTOR_SLOWDOWN)."""
  return float(min(d * d, _FLAT_VECTOR_SLOWDOWN * 2 * d) * size)


class Plan(NamedTuple):
  """Which leaves are factored through which layer calls, and which have flat per-example
  Jacobian columns (`generic`): from their elementwise sites where all their uses are such
  sites (`sites`), otherwise from `jax.jacrev` per example."""
  layers: tuple[LayerCall, ...]
  ghost: tuple[bool, ...]  # per layer: cross term from factors (True) or flattened
  generic: tuple[int, ...]  # leaves the embedding uses outside recognised layers
  sites: tuple[linear_ops.ElementwiseSite, ...] = ()  # of the generic leaves in `elementwise`

  @property
  def factored_leaves(self) -> frozenset:
    """Indices of the leaves some recognised layer call owns."""
    return frozenset(i for layer in self.layers for i in layer.leaves)

  @property
  def elementwise(self) -> frozenset:
    """Generic leaves whose columns come from their elementwise sites, not from jax.jacrev."""
    return frozenset(site.leaf for site in self.sites)

  @property
  def jacobian_leaves(self) -> tuple[int, ...]:
    """Generic leaves whose columns come from `jax.jacrev` per example (the slow path)."""
    elementwise = self.elementwise
    return tuple(i for i in self.generic if i not in elementwise)


def _num_rows(x) -> int:
  """Examples in x, an array or a pytree of arrays with the examples along axis 0."""
  return jax.tree_util.tree_leaves(x)[0].shape[0]


def is_float(x) -> bool:
  """Whether x (an array or an abstract value) has a floating dtype."""
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _op_patches(op: linear_ops.LinearOp, act) -> jax.Array:
  """(m, T, P) inputs of a recognised operation's canonical form (no bias column)."""
  return layers.get(op.kind).patches(op, act)


def with_recognised_layers(embed_fn,
                           plan: Plan | None = None) -> Callable[[Any, jax.Array], jax.Array]:
  """embed_fn with every recognised convolution computed by `channels_last_conv`; embed_fn
  itself when `plan` (embed_fn's) holds no convolution (no trace of its own on every call).

  Same values and gradients; the difference is that convolutions then differentiate into
  channels-last convolutions only, which XLA:CPU runs at full speed inside the loop bodies
  of microbatching.
  """
  if plan is not None and not any(layer.kind == "conv" for layer in plan.layers):
    return embed_fn

  def embed(params, x):
    leaves = jax.tree_util.tree_leaves(params)
    closed, out_tree = linear_ops.trace(embed_fn, params, x)
    found = linear_ops.scan(closed, len(leaves), [np.shape(leaf) for leaf in leaves],
                            with_bias=False)
    convs = [op for op in found.ops if op.kind == "conv"]
    if not convs:
      return embed_fn(params, x)
    conv = layers.get("conv")
    out = linear_ops.evaluate(closed, leaves + jax.tree_util.tree_leaves(x),
                              lambda op, values, compute: conv.forward(op, values, compute), convs)
    return jax.tree_util.tree_unflatten(out_tree, out)

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


def _found_ops(embed_fn, leaves, treedef, x, with_bias: bool):
  """(jaxpr, output treedef, linear_ops.Scan) of embed_fn at x's shapes."""
  closed, out_tree = linear_ops.trace(embed_fn, jax.tree_util.tree_unflatten(treedef, leaves), x)
  found = linear_ops.scan(closed, len(leaves), [np.shape(leaf) for leaf in leaves], with_bias)
  return closed, out_tree, found


def make_plan(embed_fn, params, x, d: int,
              keep_factors: Callable[[LayerCall, int], bool] | None = None) -> Plan:
  """Finds the recognised layers of embed_fn and the leaves they fully own (see module doc).

  keep_factors(layer, d): whether a layer stays as its factors ("ghost") or is flattened;
  default `use_ghost` (the pair norms' cost per pair); DP-GCL's group norms use
  `keeps_group_factors`.
  """
  keep_factors = use_ghost if keep_factors is None else keep_factors
  leaves, treedef = jax.tree_util.tree_flatten(params)
  structs = [jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf)) for leaf in leaves]
  n = _num_rows(x)
  scans = []
  depends: set = set()
  for m in (n, n + 1):
    x_struct = jax.tree_util.tree_map(
        lambda a, m=m: jax.ShapeDtypeStruct((m,) + tuple(a.shape[1:]), a.dtype), x)
    closed, _, found = _found_ops(embed_fn, structs, treedef, x_struct, with_bias=True)
    if m == n:
      depends = _dependent_inputs(closed)
    scans.append(found)
  ops, ops_plus = scans[0].ops, scans[1].ops
  bad = {i for i, leaf in enumerate(leaves) if not is_float(leaf)}
  bad |= scans[0].other_uses | scans[1].other_uses
  owners = collections.Counter(i for op in ops for i in op.leaves)
  bad |= {i for i, count in owners.items() if count > 1}
  if [(op.path, op.kind, op.leaves) for op in ops
     ] != [(op.path, op.kind, op.leaves) for op in ops_plus]:
    bad |= set(owners)
  else:
    for op, op_plus in zip(ops, ops_plus):
      if not (op.act_shape[0] == n and op_plus.act_shape[0] == n + 1
              and op.act_shape[1:] == op_plus.act_shape[1:] and op.out_shape == op_plus.out_shape):
        bad |= set(op.leaves)  # the leading axis is not the example axis
  layers = tuple(
      LayerCall(op.kind, op.leaves, op.out_shape, op.positions, op.fan_in
                + (op.bias_leaf is not None), op.features, op.kernel_axes) for op in ops
      if not set(op.leaves) & bad)
  factored = {i for layer in layers for i in layer.leaves}
  generic = tuple(
      sorted(i for i in depends if i < len(leaves) and i not in factored and is_float(leaves[i])))
  sites, sites_plus = scans[0].sites, scans[1].sites
  site_bad = set(bad) | set(owners)
  if [(s.path, s.leaf, s.kind) for s in sites] != [(s.path, s.leaf, s.kind) for s in sites_plus]:
    site_bad |= {s.leaf for s in sites}
  else:
    for site, site_plus in zip(sites, sites_plus):
      if not (site.out_shape[0] == n and site_plus.out_shape[0] == n + 1 and site.out_shape[1:]
              == site_plus.out_shape[1:] and np.array_equal(site.index, site_plus.index)):
        site_bad.add(site.leaf)  # the leading axis is not the example axis
  planned_sites = tuple(s for s in sites if s.leaf in generic and s.leaf not in site_bad)
  return Plan(layers, tuple(keep_factors(layer, d) for layer in layers), generic, planned_sites)


def jacobian_plan(params) -> Plan:
  """The plan without layers: every float leaf gets per-example Jacobians from `jax.jacrev`
  (the reference path, which depends on nothing but JAX's own differentiation)."""
  leaves = jax.tree_util.tree_leaves(params)
  return Plan((), (), tuple(i for i, leaf in enumerate(leaves) if is_float(leaf)))


def use_ghost(layer: LayerCall, d: int) -> bool:
  """Cross terms from the layer's factors when that is cheaper per pair than flattening."""
  return layer.pair_cost(d, ghost=True) < layer.pair_cost(d, ghost=False)


def use_ghost_alone(layer: LayerCall, d: int) -> bool:
  """For a layer no cross-pair term involves (a parameter of one tower only): its factors when
  its per-example Gram costs no more from them than flattened."""
  return layer.gram_cost(d, ghost=True) <= layer.gram_cost(d, ghost=False)


def keeps_group_factors(layer: LayerCall, d: int) -> bool:
  """DP-GCL's rule (`group_norms`): the layer stays as its factors when they hold at most
  `_GROUP_FACTOR_RATIO` times the floats per example of its flattened Jacobian,
  T·(P + C·d) ≤ k·P·C·d. Its group norms then take one GEMM or Gram per group instead of a
  small GEMM per example (the flattened columns), and no P·C·d vector is held per example."""
  t, p, c = layer.positions, layer.fan_in, layer.features
  return t * (p + c * d) <= _GROUP_FACTOR_RATIO * p * c * d


def _kernel_matrix(layer: LayerCall, kernel, lead: int = 0) -> jax.Array:
  """(*lead, *kernel.shape) -> (*lead, P without bias, C): the layer's kernel matrix."""
  if layer.kernel_axes is not None:
    kernel = jnp.transpose(kernel, tuple(range(lead)) + tuple(lead + a for a in layer.kernel_axes))
  return kernel.reshape(kernel.shape[:lead] + (-1, layer.features))


def _matrix_kernel(layer: LayerCall, matrix, kernel_shape, lead: int = 0) -> jax.Array:
  """The inverse of `_kernel_matrix`: (*lead, P without bias, C) -> (*lead, *kernel_shape)."""
  batch = matrix.shape[:lead]
  if layer.kernel_axes is None:
    return matrix.reshape(batch + tuple(kernel_shape))
  permuted = matrix.reshape(batch + tuple(kernel_shape[a] for a in layer.kernel_axes))
  inverse = np.argsort(layer.kernel_axes)
  return jnp.transpose(permuted, tuple(range(lead)) + tuple(lead + int(a) for a in inverse))


def _flat_layer_columns(layer: LayerCall, grads, kernel_shape) -> jax.Array:
  """(m, d, P, C) per-example Jacobians of a flattened layer -> (m, d, q) flat columns: the
  kernel in its leaf's own element order, then the bias."""
  m, d = grads.shape[:2]
  if layer.kernel_axes is None:
    return grads.reshape(m, d, -1)
  rows = int(np.prod(kernel_shape, dtype=np.int64)) // layer.features
  kernel = _matrix_kernel(layer, grads[:, :, :rows], kernel_shape, lead=2).reshape(m, d, -1)
  return jnp.concatenate([kernel, grads[:, :, rows:].reshape(m, d, -1)], axis=-1)


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


def dense_layers_gram(patches, deltas) -> jax.Array:
  """Σ_l `ghost_layer_gram` of ghost layers of one position each (T = 1: dense layers), as one
  contraction over their features: Σ_l ‖a_l‖² δ_l δ_lᵀ per example, (m, d, d)."""
  joined = jnp.concatenate([delta[:, 0] for delta in deltas], axis=-1)  # (m, d, ΣC)
  scaled = jnp.concatenate([
      jnp.sum(a[:, 0] * a[:, 0], axis=-1)[:, None, None] * delta[:, 0]
      for a, delta in zip(patches, deltas)
  ], axis=-1)
  return jnp.einsum("mkc,mlc->mkl", joined, scaled, precision=_HIGHEST)


def _site_columns(plan: Plan, leaves, site_deltas, site_acts) -> jax.Array:
  """(m, q_e): the per-example Jacobian columns of the elementwise leaves (`Plan.sites`) for
  one cotangent, in `Plan.generic` order, from δ at each site (`linear_ops.ElementwiseSite`)."""
  columns = {}
  for site, delta, act in zip(plan.sites, site_deltas, site_acts):
    m = delta.shape[0]
    coef = delta if site.kind == "shift" else delta * jnp.broadcast_to(act, delta.shape)
    flat_index = site.index.reshape(-1)
    used = np.nonzero(flat_index >= 0)[0]
    values = coef.reshape(m, -1)
    if used.size != flat_index.size:
      values = values[:, used]
    size = int(np.size(leaves[site.leaf]))
    col = jax.ops.segment_sum(values.T, flat_index[used], num_segments=size,
                              indices_are_sorted=False).T
    col = site.sign * col if site.kind == "shift" and site.sign != 1.0 else col
    columns[site.leaf] = col if site.leaf not in columns else columns[site.leaf] + col
  return jnp.concatenate([columns[i] for i in plan.generic if i in columns], axis=-1)


def _forward(embed_fn, params, plan: Plan, x, normalize_fn, varying, with_patches: bool):
  """(u, backward, patches) of a batch: u = normalize_fn(embed_fn(params, x)) (m, d), its
  forward pass run once with a perturbation ξ_l added to the output of every planned layer
  call l; backward(c), c (m, d) a cotangent of u: [∂⟨c, u⟩/∂y_l per layer l, (m, *out_shape)]
  followed, when the plan has elementwise sites, by their per-example columns (m, q_e);
  patches[l]: (m, T, P) inputs of layer l, with a ones column for a bias ([] if not
  with_patches). backward is None when the plan perturbs nothing."""
  if not plan.layers and not plan.sites:  # nothing to perturb: the model as it is
    return normalize_fn(embed_fn(params, x)), None, []
  leaves, treedef = jax.tree_util.tree_flatten(params)
  m = _num_rows(x)
  closed, out_tree, found = _found_ops(embed_fn, leaves, treedef, x, with_bias=False)
  factored = plan.factored_leaves
  selected = [op for op in found.ops if op.kernel_leaf in factored]
  elementwise = plan.elementwise
  sites = [site for site in found.sites if site.leaf in elementwise]
  found_calls = [(op.kind, op.kernel_leaf, op.out_shape, op.act_shape[0]) for op in selected]
  planned_calls = [(layer.kind, layer.leaves[0], layer.out_shape, m) for layer in plan.layers]
  # Sites by what they are, not by their equations' indices: a trace inside shard_map has
  # equations of its own (the params made per-device) before them.
  found_sites = [(site.kind, site.leaf, site.out_shape[1:], site.out_shape[0]) for site in sites]
  planned_sites = [(site.kind, site.leaf, site.out_shape[1:], m) for site in plan.sites]
  traced, planned = found_calls + found_sites, planned_calls + planned_sites
  if traced != planned:  # never silently mis-factor (a missing ξ means δ = 0): name the layer
    names = [
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]

    def described(entries, k):
      if k >= len(entries):
        return "nothing"
      return f"the {entries[k][0]} of params{names[entries[k][1]]} with output {entries[k][2]}"

    k = next((i for i, (f, p) in enumerate(zip(traced, planned)) if f != p),
             min(len(traced), len(planned)))
    raise RuntimeError(f"logit_dp: embed_fn's layer calls differ from its plan: call {k} was "
                       f"planned as {described(planned, k)} and traced as "
                       f"{described(traced, k)}. embed_fn must trace the same way on every call "
                       "(no Python state that changes its layers between calls).")
  position = {op.path: index for index, op in enumerate(selected)}
  site_position = {site.path: index for index, site in enumerate(sites)}
  num_layers = len(plan.layers)
  xis = [varying(jnp.zeros((m,) + layer.out_shape, jnp.float32)) for layer in plan.layers]
  xis += [varying(jnp.zeros(site.out_shape, jnp.float32)) for site in sites]
  args = leaves + jax.tree_util.tree_leaves(x)

  def embed(perturbations):
    patches: list = []
    acts: list[Any] = [None] * len(sites)

    def on_op(op, values, compute):
      if isinstance(op, linear_ops.ElementwiseSite):
        k = site_position[op.path]
        if op.kind == "scale":
          acts[k] = jax.lax.stop_gradient(jnp.asarray(values[op.act_position], jnp.float32))
        return compute() + perturbations[num_layers + k]
      y = layers.get(op.kind).forward(op, values, compute)
      index = position.get(op.path)
      if index is None:
        return y
      if with_patches:
        a = _op_patches(op, values[op.act_position])
        if len(plan.layers[index].leaves) > 1:
          a = jnp.concatenate([a, jnp.ones(a.shape[:-1] + (1,), a.dtype)], -1)
        patches.append(jax.lax.stop_gradient(a))
      return y + op.to_raw(perturbations[index])

    out = linear_ops.evaluate(closed, args, on_op, found.ops + sites)
    return normalize_fn(jax.tree_util.tree_unflatten(out_tree, out)), (patches, acts)

  u, vjp_fn, (patches, acts) = jax.vjp(embed, xis, has_aux=True)

  def backward(c):
    grads = vjp_fn(jnp.zeros_like(u) + c)[0]
    if not sites:
      return grads
    return grads[:num_layers] + [_site_columns(plan, leaves, grads[num_layers:], acts)]

  return u, backward, patches


def _deltas(embed_fn, params, plan: Plan, x, normalize_fn, varying, with_patches: bool,
            stacked: bool = True):
  """(u, deltas, patches, site_flat) of a batch: u = normalize_fn(embed_fn(params, x)) (m, d);
  deltas[l] = ∂u_k/∂y_l for every coordinate k, (m, T, d, C) per planned layer call l (one
  backward pass per k; not stacked: a list over k of the lists over l, each (m, *out_shape));
  patches[l]: (m, T, P) inputs of layer l, with a ones column for a bias
  ([] if not with_patches); site_flat: (m, d, q_e) per-example Jacobian columns of the
  elementwise leaves (`Plan.sites`) from the same backward passes (None without sites)."""
  u, backward, patches = _forward(embed_fn, params, plan, x, normalize_fn, varying, with_patches)
  if backward is None:
    return u, [], [], None
  leaves = jax.tree_util.tree_leaves(params)
  m, d = _num_rows(x), u.shape[-1]
  num_layers, sites = len(plan.layers), bool(plan.sites)
  elementwise = plan.elementwise
  eye = jnp.asarray(np.eye(d, dtype=u.dtype))  # a constant of the program: no kernel builds it

  # (d, m, *out_shape) of one layer's coordinates to the factors' (m, T, d, C).
  factor_layout = lambda delta, layer: jnp.moveaxis(
      jnp.reshape(delta, (d, m, layer.positions, layer.features)), 0, 2)
  split = lambda deltas: (deltas[:num_layers], deltas[num_layers] if sites else None)
  if d <= _LOOPED_COTANGENTS and m >= _LOOPED_MIN_BATCH:
    # d separate backward passes, one after another: ~2x faster than one vmapped pass on CPU
    # for large batches (n = 1000, embedding net). A loop, not d unrolled copies: the same
    # passes, compiled once.
    if stacked:
      # A layer of one position (dense) has its δ written straight into (m, 1, d, C): no
      # transpose after the loop. The others stack (d, m, T, C) and are transposed after it
      # (writing their T·m rows of C floats with a stride in the loop is slower). The
      # elementwise columns go straight into (m, d, q_e).
      direct = [layer.positions == 1 for layer in plan.layers] + [True] * bool(sites)

      def one_coordinate(k, held):
        def put(held_l, g, straight):
          if straight:
            return jax.lax.dynamic_update_index_in_dim(
                held_l, g.reshape(held_l.shape[:1] + (1,) * (held_l.ndim - 3) + (1, -1)), k,
                axis=held_l.ndim - 2)
          return jax.lax.dynamic_update_index_in_dim(held_l, g, k, axis=0)

        return [put(*args) for args in zip(held, backward(eye[k]), direct)]

      held = [
          varying(
              jnp.zeros((m, 1, d, layer.features) if straight else (d, m) + layer.out_shape,
                        jnp.float32)) for layer, straight in zip(plan.layers, direct)
      ]
      if sites:
        q_e = sum(int(np.size(leaves[i])) for i in plan.generic if i in elementwise)
        held.append(varying(jnp.zeros((m, d, q_e), jnp.float32)))
      held = jax.lax.fori_loop(0, d, one_coordinate, held)
      layer_held, site_flat = split(held)
      deltas = [
          delta if straight else factor_layout(delta, layer)
          for delta, layer, straight in zip(layer_held, plan.layers, direct)
      ]
      return u, deltas, patches, site_flat
    deltas = jax.lax.map(backward, eye)
  else:
    deltas = jax.vmap(backward)(eye)
  deltas, site_flat = split(list(deltas))
  site_flat = None if site_flat is None else jnp.moveaxis(site_flat, 0, 1)
  if stacked:
    deltas = [factor_layout(delta, layer) for delta, layer in zip(deltas, plan.layers)]
  else:
    deltas = [[layer_deltas[k] for layer_deltas in deltas] for k in range(d)]
  return u, deltas, patches, site_flat


def embedding_deltas(embed_fn, params, plan: Plan, x, normalize_fn) -> list:
  """∂u_k/∂y_l of every planned layer call l and coordinate k, not stacked: the forward
  pass and the d backward passes that `layer_factors` starts from, and nothing else
  (benchmarks.profile_ghost times it as part of the step's cost floor)."""
  return _deltas(embed_fn, params, plan, x, normalize_fn, lambda a: a, with_patches=False,
                 stacked=False)[1]


def layer_factors(embed_fn, params, plan: Plan, x, normalize_fn, generic_jacobian,
                  varying=lambda a: a, with_embeddings: bool = False) -> Any:
  """Factors of a batch x under plan (with_embeddings: (normalize_fn(embed_fn(params, x)),
  factors), the embeddings of the same forward pass).

  generic_jacobian(leaf_indices) -> (m, d, q) per-example Jacobians of those leaves;
  varying(a) types a as per-device inside shard_map (so that derivatives w.r.t. the
  perturbations stay local instead of being summed over devices).
  """
  u, deltas, patches, site_flat = _deltas(embed_fn, params, plan, x, normalize_fn, varying,
                                          with_patches=True)
  factors = _assembled(plan, params, _num_rows(x), u.shape[-1], u.dtype, deltas, patches, site_flat,
                       generic_jacobian)
  return (u, factors) if with_embeddings else factors


def cotangent_factors(embed_fn, params, plan: Plan, x, normalize_fn,
                      varying=lambda a: a) -> tuple[jax.Array, Callable[..., Factors]]:
  """(u, finish): u = normalize_fn(embed_fn(params, x)) (m, d) from a forward pass that
  `layer_factors` needs anyway, and finish(c, generic_jacobian) -> the `Factors` of the scalar
  ⟨c_e, u_e⟩ of every example (d = 1; c (m, d), computed from u) from one backward pass,
  without running the forward pass again. generic_jacobian(leaf_indices) -> (m, 1, q) as in
  `layer_factors`."""
  u, backward, patches = _forward(embed_fn, params, plan, x, normalize_fn, varying,
                                  with_patches=True)
  m = _num_rows(x)

  def finish(c, generic_jacobian) -> Factors:
    deltas, site_flat = [], None
    if backward is not None:
      grads = backward(c)
      deltas = [
          jnp.reshape(g, (m, layer.positions, 1, layer.features))
          for g, layer in zip(grads, plan.layers)
      ]
      if plan.sites:
        site_flat = grads[len(plan.layers)][:, None, :]
    return _assembled(plan, params, m, 1, u.dtype, deltas, patches, site_flat, generic_jacobian)

  return u, finish


def _assembled(plan: Plan, params, m: int, d: int, dtype, deltas, patches, site_flat,
               generic_jacobian) -> Factors:
  """The `Factors` of the δs (m, T, d, C) and patches of every planned layer and the
  elementwise columns (m, d, q_e): ghost layers kept as factors, the others flattened into
  per-example Jacobian columns, and the per-example Grams."""
  leaves = jax.tree_util.tree_leaves(params)
  flat, ghost_patches, ghost_deltas = [], [], []
  gram = jnp.zeros((m, d, d), dtype)
  dense = []  # ghost layers of one position: their Grams in one contraction
  for layer, is_ghost, a, delta in zip(plan.layers, plan.ghost, patches, deltas):
    delta = cast(jax.Array, delta)  # (m, T, d, C)
    if is_ghost:
      ghost_patches.append(a)
      ghost_deltas.append(delta)
      if layer.positions == 1:
        dense.append((a, delta))
      else:
        gram = gram + ghost_layer_gram(a, delta)
    else:
      grads = jnp.einsum("mtp,mtn->mpn", a, delta.reshape(m, layer.positions, d * layer.features),
                         precision=_HIGHEST)
      grads = jnp.moveaxis(grads.reshape(m, layer.fan_in, d, layer.features), 2, 1)
      flat.append(_flat_layer_columns(layer, grads, np.shape(leaves[layer.leaves[0]])))
  if dense:
    gram = gram + dense_layers_gram(*zip(*dense))
  if plan.generic:
    flat.append(_generic_columns(plan, generic_jacobian, site_flat, leaves))
  flat = jnp.concatenate(flat, axis=-1) if flat else jnp.zeros((m, d, 0), dtype)
  # Example by example: the batched (m, d, q)·(m, q, d) contraction runs 3-6x slower on CPU.
  if flat.shape[-1]:
    gram = gram + jax.lax.map(lambda f: jnp.matmul(f, f.T, precision=_HIGHEST), flat)
  return Factors(flat, tuple(ghost_patches), tuple(ghost_deltas), gram)


def _generic_columns(plan: Plan, generic_jacobian, site_flat, leaves) -> jax.Array:
  """(m, d, q) columns of `Plan.generic` in its order: the elementwise leaves' from their
  sites (site_flat), the others' from generic_jacobian (jax.jacrev per example)."""
  jacobian = plan.jacobian_leaves
  if not plan.sites:
    return generic_jacobian(jacobian)
  if not jacobian:
    return site_flat
  by_jacobian = generic_jacobian(jacobian)
  parts, offsets = [], {"site": 0, "jacobian": 0}
  elementwise = plan.elementwise
  for i in plan.generic:
    source = "site" if i in elementwise else "jacobian"
    size = int(np.size(leaves[i]))
    block = site_flat if source == "site" else by_jacobian
    parts.append(block[..., offsets[source]:offsets[source] + size])
    offsets[source] += size
  return jnp.concatenate(parts, axis=-1)


def factors_transpose(plan: Plan, factors: Factors, cotangents, leaves, keep=None) -> list:
  """Σ_e J_eᵀ c_e per parameter leaf, contracted from the factors (no backward pass).

  Flattened layers and generic leaves: Σ_e flat_eᵀ c_e; ghost layer: the kernel
  Σ_{e,t} a_et ⊗ w_et with w_et = Σ_k c_ek δ_et^k (a_et the patch without its bias column) and
  the bias Σ_{e,t} w_et. Leaves the embedding does not use get zeros. keep: optional (m,) bool;
  examples not kept have their factors *selected* to 0, so they add exactly 0 even where their
  factors are not finite (0·NaN is NaN).
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
    kernel = leaves[layer.leaves[0]]
    if is_ghost:
      patches, deltas = next(ghost)
      weighted = jnp.sum(select(deltas) * cotangents[:, None, :, None], axis=2)  # (m, T, C)
      rows = kernel.size // layer.features  # the kernel's rows: the patches without a bias column
      grad = jnp.matmul(
          select(patches[..., :rows]).reshape(-1, rows).T, weighted.reshape(-1, layer.features),
          precision=_HIGHEST)
      grads[layer.leaves[0]] = _matrix_kernel(layer, grad, kernel.shape)
      bias = jnp.sum(weighted, axis=(0, 1))  # the bias column holds ones
    else:  # flat columns: the kernel in its own order, then the bias
      size = layer.fan_in * layer.features
      grad = flat[offset:offset + size]
      offset += size
      grads[layer.leaves[0]] = grad[:kernel.size].reshape(kernel.shape)
      bias = grad[kernel.size:]
    if len(layer.leaves) > 1:
      grads[layer.leaves[1]] = bias.reshape(leaves[layer.leaves[1]].shape)
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
    kernel = _kernel_matrix(layer, tangent_leaves[layer.leaves[0]], lead=1)
    if len(layer.leaves) == 1:
      return kernel
    return jnp.concatenate([kernel, tangent_leaves[layer.leaves[1]].reshape(k, 1, -1)], axis=1)

  flat_tangents, out = [], jnp.zeros((m, d, k), factors.flat.dtype)
  ghost = iter(zip(factors.ghost_patches, factors.ghost_deltas))
  for layer, is_ghost in zip(plan.layers, plan.ghost):
    if not is_ghost:  # flat columns: the kernel in its own order, then the bias
      flat_tangents += [tangent_leaves[i].reshape(k, -1) for i in layer.leaves]
      continue
    w = layer_matrix(layer)
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


def flat_cross(flat_rows, u_rows, flat_all, v_all, block_floats: int) -> jax.Array:
  """v̂_jᵀ J_i J'_jᵀ û_i over the flattened parameters, rows i × all columns j: (I, n).

  Small d (`flat_cross_by_gram`): `flat_cross_gram`. Otherwise = Σ_q (J_iᵀv̂_j)_q (J'_jᵀû_i)_q,
  formed one block of the q parameters at a time:
  the block of every pair's J'_jᵀû_i (I·n·d multiply-adds per parameter), contracted with
  J_i's block and summed over the blocks ((I, n, d)), then with v̂_j: 2·I·n·d·q multiply-adds
  in all. A block holds about block_floats floats of the pairs' vectors (I·n per parameter).
  """
  rows, d, q = flat_rows.shape
  n = flat_all.shape[0]
  if flat_cross_by_gram(d):
    return flat_cross_gram(flat_rows, u_rows, flat_all, v_all)
  num_blocks = -(-q // max(1, min(q, block_floats // max(rows * n, 1))))
  block = -(-q // num_blocks)
  if num_blocks * block != q:  # zero columns add exactly 0
    pad = ((0, 0), (0, 0), (0, num_blocks * block - q))
    flat_rows, flat_all = jnp.pad(flat_rows, pad), jnp.pad(flat_all, pad)

  def add_block(k, w):
    a, b = (
        jax.lax.dynamic_slice_in_dim(f, k * block, block, axis=2) for f in (flat_rows, flat_all))
    positive = jnp.einsum("id,jdq->ijq", u_rows, b, precision=_HIGHEST)  # J'_jᵀû_i
    return w + jnp.einsum("ijq,iaq->ija", positive, a, precision=_HIGHEST)

  w = jnp.zeros((rows, n, d), jnp.result_type(flat_rows, u_rows))
  w = add_block(0, w) if num_blocks == 1 else jax.lax.fori_loop(0, num_blocks, add_block, w)
  return jnp.einsum("ija,ja->ij", w, v_all, precision=_HIGHEST)


def flat_cross_gram(flat_rows, u_rows, flat_all, v_all) -> jax.Array:
  """`flat_cross` from one (I·d × q)·(q × n·d) cross-Gram: I·n·d²·q multiply-adds."""
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

"""Logit-DP clipped gradients (and the Naive-DP baseline).

Notation. A batch is n pairs (x_i, x'_i). Embeddings are normalised,
û_i = n(Φ_w(x_i)), v̂_j = n(Φ_w(x'_j)) with n(u) = u/√(‖u‖² + ε²), and
Z_ij = ⟨û_i, v̂_j⟩ is their cosine similarity (ε = 1e-6 keeps zero embeddings
finite: |Z_ij| < 1 still holds and the gradient at u = 0 is I/ε, large but finite
and clipped like any other). With τ_ij = ∂ℒ/∂Z_ij and pair gradients g_ij = ∇_w Z_ij,

    ḡ = Σ_ij λ_ij g_ij,   λ_ij = τ_ij · min(1, B/‖g_ij‖)

is the SUM of clipped, loss-weighted pair gradients (not a mean). Its
sensitivity is `logit_dp.sensitivity(loss, B)`. Once λ is known,
ḡ = ∇_w Σ_ij λ_ij Z_ij(w) with λ held fixed: one backward pass with cotangents
∂/∂û_i = Σ_j λ_ij v̂_j and ∂/∂v̂_j = Σ_i λ_ij û_i ("ghost" contracts its per-example
Jacobian factors with them instead).

Pair norms without materialising pair gradients ("ghost"). With J_i = ∂û_i/∂w
and J'_j = ∂v̂_j/∂w (d×p per-example Jacobians), g_ij = J_iᵀv̂_j + J'_jᵀû_i, so

    ‖g_ij‖² = v̂_jᵀ K_i v̂_j + û_iᵀ K'_j û_i + 2 v̂_jᵀ (J_i J'_jᵀ) û_i,

K_i = J_i J_iᵀ. The Jacobians come as per-layer factors (layerwise.py: flax
Dense/Conv layers from d batched backward passes; any other parameter from
per-example jacrev). The cross term is an (nd)×(nd) cross-Gram over the
"flattened" parameters plus per-layer pair terms for "ghost" layers, in row
chunks; never n²·p floats. "triangle" clips with the upper bound ‖J_iᵀv̂_j‖ + ‖J'_jᵀû_i‖, which only
needs the per-example Grams K_i: clipping by a larger norm is still private
(each term has norm ≤ B), just less accurate. "materialize" is Algorithm 1 of
the paper: it forms every g_ij by its own backward pass, in blocks of pairs.

Two towers (dual encoders, `positive_embed_fn=`): x_prime is embedded by its own
function of the same params, v̂_j = n(Φ'_w(x'_j)), and J'_j = ∂v̂_j/∂w comes from it;
everything above holds as written. The cross term only involves parameters both towers
depend on: none for disjoint towers, whose norms are exact at triangle's cost
(two_tower.py).

Requirement: embed_fn must treat examples independently (no batch norm); the
per-example Jacobians and pair gradients assume it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Protocol, cast

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from logit_dp._src import layerwise
from logit_dp._src import projection
from logit_dp._src import sensitivity as sensitivity_lib
from logit_dp._src import two_tower

DEFAULT_COSINE_EPS = 1e-6
METHODS = ("ghost", "materialize", "triangle", "projected")
DEFAULT_PROJECTION_RANK = 32
# Floats held by one chunk of the ghost cross-Gram (rows × n × d²).
_CROSS_GRAM_CHUNK_FLOATS = 1 << 23
# Floats held by one chunk of a ghost layer's pair terms (rows × n × (T² + 2TC + d)).
_GHOST_LAYER_CHUNK_FLOATS = 1 << 24
_GHOST_LAYER_CHUNK_ROWS = 8  # its batched small contractions run fastest in small chunks (CPU)
# On an accelerator the pair-term chunks are this many times larger and not capped in rows:
# a chunk there is a few kernel launches, and at the CPU sizes (1-13 rows at n = 10,000)
# the launches, not the arithmetic, would set the time.
_ACCELERATOR_CHUNK_SCALE = 16
# Bytes of Jacobian factors "ghost" holds at once by default on the CPU (rows + column blocks;
# `default_memory_budget`). ResNet-18 without batch norm: 29 MB per example, so 4 GiB hold
# 146 examples' factors; the paper's embedding net: 0.2 MB, all of n = 10,000 in one block.
DEFAULT_GHOST_MEMORY_BUDGET = 4 << 30
# Smallest column block "ghost" uses when the budget lets it choose (factors of fewer examples
# at a time run below batch speed).
_MIN_COLUMN_BLOCK = 8
# Floats held by one block of materialised pair gradients (pairs × p).
_PAIR_BLOCK_FLOATS = 1 << 22
# Float32 allowances added to every pair norm before clipping, so that a clip factor never
# uses a norm below the true one (docs/PRIVACY.md, "Clip norms in float32"). With
# s_i = ‖J_i‖_F (per-example Jacobian of the normalised embedding) and S_ij = s_i + s'_j:
#   a norm formed from its vector (materialize, the diagonal pairs) is raised by
#   _VECTOR_FLOAT_ERROR·S_ij; a squared norm from Gram forms (a + b + 2c, or a and b of
#   "triangle") by _GRAM_FLOAT_ERROR·S_ij². Largest float32 errors measured against float64
#   (tests/test_float32_norms.py inputs, three seeds, and the paper's embedding net):
#   3.2·2⁻²⁴·S_ij and 0.36·2⁻²⁴·S_ij², so the margins are 20× and 44×.
_VECTOR_FLOAT_ERROR = 2.0 ** -18
_GRAM_FLOAT_ERROR = 2.0 ** -20

_HIGHEST = jax.lax.Precision.HIGHEST
# embed_fn(params, x) -> (n, d); x is an array or a pytree of arrays, examples along axis 0.
EmbedFn = Callable[[Any, Any], jax.Array]


class GradFn(Protocol):
  """grad_fn(params, x, x_prime, mask=None) -> (ℒ, ḡ), as built by `clipped_grad`.

  ``core(params, x, x_prime, mask) -> (ℒ, ḡ, n_nonfinite)`` is its jitted body without the
  input checks (n_nonfinite: valid pairs with non-finite inputs or embeddings, masked out);
  ``with_num_dropped`` is grad_fn returning n_nonfinite too, never raising.
  """

  core: Callable[..., tuple[jax.Array, Any, jax.Array]]
  with_num_dropped: Callable[..., tuple[jax.Array, Any, jax.Array]]

  def __call__(self, params: Any, x: jax.Array, x_prime: jax.Array,
               mask: jax.Array | None = None) -> tuple[jax.Array, Any]:
    """(ℒ, ḡ) on the batch of pairs (x_i, x'_i) with mask_i true."""
    ...


def normalize(u: jax.Array, eps: float = DEFAULT_COSINE_EPS) -> jax.Array:
  """n(u) = u/√(‖u‖² + ε²) along the last axis."""
  return u / jnp.sqrt(jnp.sum(u * u, axis=-1, keepdims=True) + eps * eps)


def cosine_similarity(u: jax.Array, v: jax.Array, eps: float = DEFAULT_COSINE_EPS) -> jax.Array:
  """Z_ij = ⟨n(u_i), n(v_j)⟩ for u (n, d) and v (m, d)."""
  return jnp.matmul(normalize(u, eps), normalize(v, eps).T, precision=_HIGHEST)


def _is_traced(tree) -> bool:
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


def _num_rows(x) -> int:
  """The number of examples of an input (array or pytree of arrays, examples along axis 0)."""
  return jax.tree_util.tree_leaves(x)[0].shape[0]


def _take_row(x, i):
  """Example i of an input (array or pytree)."""
  return jax.tree_util.tree_map(lambda a: a[i], x)


def raise_if_dropped(what: str, tree, num_dropped, unit: str = "pair(s)") -> None:
  """Eager calls only: a ValueError when rows with non-finite inputs or embeddings were dropped.

  Under jit (``tree`` traced) such rows are masked out and counted instead (docs/PRIVACY.md).
  """
  if not _is_traced(tree) and int(num_dropped) > 0:
    raise ValueError(f"{what}: {int(num_dropped)} {unit} have non-finite inputs or embeddings "
                     "(NaN/inf). Nothing was released. Under jit such rows are masked out "
                     "instead (see docs/PRIVACY.md).")


def _finite_rows(x) -> jax.Array:
  """(n,): whether every floating entry of each example (in every leaf) is finite."""
  ok = jnp.ones((_num_rows(x),), bool)
  for a in jax.tree_util.tree_leaves(x):
    if jnp.issubdtype(a.dtype, jnp.inexact):
      ok = ok & jnp.all(jnp.isfinite(a).reshape(a.shape[0], -1), axis=1)
  return ok


def _where_rows(ok: jax.Array, x):
  return jax.tree_util.tree_map(
      lambda a: jnp.where(ok.reshape((-1,) + (1,) * (a.ndim - 1)), a, jnp.zeros_like(a)), x)


def _varying_axes(x) -> frozenset:
  """Mesh axes x is typed as varying over (empty outside shard_map or with check_vma=False)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))  # jax 0.6 - 0.9


class _Collective:
  """Gathers over a shard_map axis, or the identity on a single device."""
  def __init__(self, axis_name):
    self.axis_name = axis_name

  def checks_vma(self) -> bool:
    """True inside shard_map(check_vma=True), where values carry varying-axis types."""
    if self.axis_name is None:
      return False
    return self.axis_name in _varying_axes(jax.lax.axis_index(self.axis_name))

  def local_params(self, params):
    """Params (or any value to differentiate against, e.g. layer perturbations) as per-device.

    Under check_vma=True, differentiating w.r.t. a replicated (invariant) value
    inside shard_map implicitly psums the derivative over the axis, which would
    add up the per-example Jacobians / pair gradients of different devices.
    Casting params to varying keeps every derivative local; `psum` below then
    sums the backward pass explicitly, as with check_vma=False.
    """
    if not self.checks_vma():
      return params
    return jax.lax.pcast(params, self.axis_name, to="varying")

  def gather(self, tree):
    if self.axis_name is None:
      return tree
    return jax.tree_util.tree_map(
        lambda x: jax.lax.all_gather(x, self.axis_name, axis=0, tiled=True), tree)

  def psum(self, tree):
    if self.axis_name is None:
      return tree
    return jax.lax.psum(tree, self.axis_name)

  def replicated(self, x):
    """A value computed identically on every device, typed as replicated.

    all_gather's output is typed varying under check_vma=True, so a loss
    computed from gathered embeddings cannot be returned with out_specs=P().
    pmean of identical values restores the type (exact for power-of-two axes,
    one rounding otherwise; identical on every device either way).
    """
    if not self.checks_vma():
      return x
    if jnp.issubdtype(x.dtype, jnp.integer):
      return jax.lax.psum(x, self.axis_name) // jax.lax.psum(1, self.axis_name)
    return jax.lax.pmean(x, self.axis_name)

  def local_rows(self, n_local: int) -> jax.Array:
    start = 0 if self.axis_name is None else jax.lax.axis_index(self.axis_name) * n_local
    return start + jnp.arange(n_local)

  def size(self) -> int:
    """k, the number of devices along the axis (1 outside shard_map)."""
    return 1 if self.axis_name is None else jax.lax.axis_size(self.axis_name)

  def index(self):
    """This device's position along the axis (0 outside shard_map)."""
    return 0 if self.axis_name is None else jax.lax.axis_index(self.axis_name)

  def ring_shift(self, tree):
    """Every device's value passed to the next device along the axis (ppermute i -> i + 1)."""
    if self.axis_name is None:
      return tree
    k = self.size()
    perm = [(i, (i + 1) % k) for i in range(k)]
    return jax.tree_util.tree_map(lambda a: jax.lax.ppermute(a, self.axis_name, perm), tree)

  def varying(self, tree):
    """tree typed as per-device under check_vma=True (for loop carries that become varying)."""
    if not self.checks_vma():
      return tree

    def cast_one(a):
      if self.axis_name in _varying_axes(a):
        return a
      return jax.lax.pcast(a, self.axis_name, to="varying")

    return jax.tree_util.tree_map(cast_one, tree)


def _map(fn, xs, batch_size):
  """fn over the leading axis in chunks of batch_size (vmap if None)."""
  if batch_size is None or batch_size >= jax.tree_util.tree_leaves(xs)[0].shape[0]:
    return jax.vmap(fn)(xs)
  return jax.lax.map(fn, xs, batch_size=batch_size)


def _map_chunks(fn, xs, chunk: int):
  """fn(*chunk of rows) over the leading axis of xs (a tuple of arrays) in chunks of `chunk`
  rows, the last one zero-padded; the results stacked per chunk, (num_chunks, ...).
  An element of xs may be a pytree (inputs), chunked leaf by leaf."""
  n = _num_rows(xs)
  num_chunks = -(-n // chunk)
  pad = num_chunks * chunk - n

  def split(a):
    a = jnp.concatenate([a, jnp.zeros((pad,) + a.shape[1:], a.dtype)]) if pad else a
    return a.reshape((num_chunks, chunk) + a.shape[1:])

  return jax.lax.map(lambda rows: fn(*rows), jax.tree_util.tree_map(split, tuple(xs)))


def _unchunk_rows(tree, n: int):
  """(num_chunks, chunk, ...) per-row results of _map_chunks back to their n rows."""
  # The explicit size, not -1: a zero-size leaf (no flattened parameters) cannot infer it.
  return jax.tree_util.tree_map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])[:n],
                                tree)


class _Batch:
  """The shared forward state of one gradient computation.

  Methods taking `positive=True` act on the tower of x_prime (`positive_embed_fn`); with one
  tower that is embed_fn itself.
  """
  def __init__(self, embed_fn, params, x, x_prime, mask, *, eps, microbatch_size, collective,
               positive_embed_fn=None):
    self.embed_fn, self.params, self.eps = embed_fn, params, eps
    self.two_tower = positive_embed_fn is not None and positive_embed_fn is not embed_fn
    self.positive_embed_fn = positive_embed_fn if self.two_tower else embed_fn
    # The same function, with recognised convolutions differentiated into channels-last
    # convolutions: JAX's own rule runs 4-50x slower inside the loops of microbatching and of
    # materialize on XLA:CPU (layerwise.channels_last_conv). Factors intercept embed_fn themselves.
    self._embed_fn = layerwise.with_recognised_layers(embed_fn)
    self._positive_fn = (layerwise.with_recognised_layers(self.positive_embed_fn)
                         if self.two_tower else self._embed_fn)
    self.microbatch_size, self.c = microbatch_size, collective
    n_local = _num_rows(x)
    inputs_ok = _finite_rows(x) & _finite_rows(x_prime)
    # Zero non-finite inputs so that their NaNs cannot reach the backward pass.
    self.x, self.x_prime = _where_rows(inputs_ok, x), _where_rows(inputs_ok, x_prime)
    u_loc = self._embed(self.x)
    v_loc = self._embed(self.x_prime, positive=True)
    if u_loc.shape[-1] != v_loc.shape[-1]:
      raise ValueError(f"the two towers must embed into the same dimension: embed_fn gives "
                       f"{u_loc.shape[-1]}, positive_embed_fn {v_loc.shape[-1]}.")
    ok = inputs_ok & _finite_rows(u_loc) & _finite_rows(v_loc)
    self.u_loc, self.v_loc = _where_rows(ok, u_loc), _where_rows(ok, v_loc)
    self.rows = collective.local_rows(n_local)
    self.u, self.v = collective.gather(self.u_loc), collective.gather(self.v_loc)
    self.valid = collective.gather(mask & ok)
    self.num_nonfinite = jnp.sum(collective.gather(mask & ~ok))
    self.z = jnp.matmul(self.u, self.v.T, precision=_HIGHEST)

  def normalized_embedding(self, params, x_one, positive: bool = False):
    fn = self._positive_fn if positive else self._embed_fn
    return normalize(fn(params, jax.tree_util.tree_map(lambda a: a[None], x_one))[0], self.eps)

  def _embed(self, xs, positive: bool = False):
    return _map(lambda xe: self.normalized_embedding(self.params, xe, positive), xs,
                self.microbatch_size)

  @functools.cached_property
  def plan(self) -> layerwise.Plan:
    """Which parameters get per-layer factors and which generic per-example Jacobians."""
    if self.two_tower:
      return self.tower_plans.anchor
    return layerwise.make_plan(self.embed_fn, self.params, self.x, self.u_loc.shape[-1])

  @functools.cached_property
  def tower_plans(self) -> two_tower.TowerPlans:
    """The plans of both towers (the same plan twice with one tower)."""
    if not self.two_tower:
      return two_tower.TowerPlans(self.plan, self.plan,
                                  tuple(sorted(two_tower.dependencies(self.plan))))
    return two_tower.tower_plans(self.embed_fn, self.positive_embed_fn, self.params, self.x,
                                 self.x_prime, self.u_loc.shape[-1])

  def _plan_of(self, positive: bool) -> layerwise.Plan:
    return self.tower_plans.positive if positive and self.two_tower else self.plan

  def _generic_jacobian(self, indices, xs, positive: bool = False):
    """Per-example Jacobians w.r.t. the leaves `indices` (jacrev per example): (m, d, q)."""
    leaves, treedef = jax.tree_util.tree_flatten(self.params)

    def one(x_one):
      def embed(selected):
        params = layerwise.replace_leaves(leaves, treedef, indices, selected)
        return self.normalized_embedding(params, x_one, positive)

      jac = jax.jacrev(embed)([leaves[i] for i in indices])
      return jnp.concatenate([j.reshape(j.shape[0], -1) for j in jac], axis=1)

    return jax.vmap(one)(xs)

  def factors(self, xs, chunked: bool = True, positive: bool = False,
              chunk: int | None = None) -> layerwise.Factors:
    """Per-example Jacobian factors of one view (see layerwise), microbatch by microbatch
    (chunk examples at a time if given; chunked=False: xs in one piece, for callers that
    chunk themselves)."""
    plan = self._plan_of(positive)
    embed_fn = self.positive_embed_fn if positive else self.embed_fn

    def chunk_factors(x_chunk):
      return layerwise.layer_factors(
          embed_fn, self.params, plan, x_chunk, lambda e: normalize(e, self.eps),
          lambda indices: self._generic_jacobian(indices, x_chunk, positive), self.c.local_params)

    m, n = chunk or self.microbatch_size, _num_rows(xs)
    if not chunked or m is None or m >= n:
      return chunk_factors(xs)
    return _unchunk_rows(_map_chunks(chunk_factors, (xs,), m), n)

  def _selected_backward(self, xs, cot, positive: bool = False):
    """Σ_e J_eᵀ cot_e with examples whose cotangent is 0 contributing exactly 0."""
    def one(xe, ce):
      _, vjp = jax.vjp(lambda p: self.normalized_embedding(p, xe, positive), self.params)
      keep = jnp.any(ce != 0)
      return jax.tree_util.tree_map(lambda g: jnp.where(keep, g, jnp.zeros_like(g)), vjp(ce)[0])

    return jax.tree_util.tree_map(lambda g: jnp.sum(g, axis=0), jax.vmap(one)(xs, cot))

  def _backward_pass(self, xs, cot, positive: bool = False):
    """Σ_e J_eᵀ cot_e by backward passes, microbatch by microbatch.

    Each microbatch is embedded in one call (examples are independent): a vmap over examples
    would batch the convolutions' custom backward pass into grouped convolutions (~4x slower).
    """
    fn = self._positive_fn if positive else self._embed_fn

    def chunk_grad(x_chunk, cot_chunk):
      embed = lambda p: normalize(fn(p, x_chunk), self.eps)
      _, vjp = jax.vjp(embed, self.params)
      return _finite_or(
          vjp(cot_chunk)[0], lambda: self._selected_backward(x_chunk, cot_chunk, positive))

    m = self.microbatch_size
    if m is None or m >= _num_rows(xs):
      return chunk_grad(xs, cot)
    # Padded examples have zero cotangents and add exactly 0.
    return jax.tree_util.tree_map(lambda g: jnp.sum(g, axis=0),
                                  _map_chunks(chunk_grad, (xs, cot), m))

  def _factor_backward(self, factors: layerwise.Factors, cot, positive: bool = False):
    """Σ_e J_eᵀ cot_e contracted from the examples' Jacobian factors.

    The selecting recomputation goes example by example: selecting all of them at once would
    hold a second copy of the factors (the largest buffer of "ghost").
    """
    leaves, treedef = jax.tree_util.tree_flatten(self.params)
    plan = self._plan_of(positive)

    def transpose(f, c, keep=None):
      return jax.tree_util.tree_unflatten(treedef,
                                          layerwise.factors_transpose(plan, f, c, leaves, keep))

    def selected():
      def add_example(total, example):
        f, c = jax.tree_util.tree_map(lambda a: a[None], example)
        return jax.tree_util.tree_map(jnp.add, total, transpose(f, c, jnp.any(c != 0, -1))), None

      zeros = self.c.varying(jax.tree_util.tree_map(jnp.zeros_like, self.params))
      return jax.lax.scan(add_example, zeros, (factors, cot))[0]

    return _finite_or(transpose(factors, cot), selected)

  def weighted_backward(self, lam_local_rows: jax.Array, lam_full: jax.Array, factors=None):
    """∇_w Σ_ij λ_ij Z_ij(w) for fixed λ, summed over devices.

    = Σ_i J_iᵀ(Σ_j λ_ij v̂_j) + Σ_j J'_jᵀ(Σ_i λ_ij û_i): one backward pass per view, or, given
    the Jacobian factors (f_u, f_v) of the local examples of both views (two towers), their
    contraction. Either way an example whose cotangent is 0 contributes exactly 0. (One-tower
    "ghost" contracts its factors block by block instead: `_ghost`.)
    """
    cot_u = jnp.matmul(lam_local_rows, self.v, precision=_HIGHEST)
    cot_v = jnp.matmul(lam_full[:, self.rows].T, self.u, precision=_HIGHEST)
    if factors is None:
      anchor = self._backward_pass(self.x, cot_u)
      positive = self._backward_pass(self.x_prime, cot_v, positive=True)
    else:
      anchor = self._factor_backward(factors[0], cot_u)
      positive = self._factor_backward(factors[1], cot_v, positive=True)
    grads = (anchor, positive)
    return self.c.psum(jax.tree_util.tree_map(jnp.add, *grads))


def _finite_or(grads, redo):
  """grads if all of it is finite, else redo(): the recomputation in which every example with
  a zero cotangent is *selected* out.

  A non-finite Jacobian times a zero cotangent is NaN, not 0: that would release whether a
  dropped or masked example is present. Selecting inside the fast computation costs ~10x on
  CPU, so it is redone only when something is not finite (the sums are otherwise the same).
  """
  leaves = jax.tree_util.tree_leaves(grads)
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves]))
  return jax.lax.cond(finite, lambda: grads, redo)


def _clip_factor(norms: jax.Array, clip_norm: float) -> jax.Array:
  """min(1, B/‖g‖); a non-finite norm gives 0 (the pair is dropped, which is private)."""
  scaled = clip_norm / jnp.where(norms > 0, norms, 1.0)
  return jnp.where(norms <= clip_norm, 1.0, jnp.where(jnp.isfinite(norms), scaled, 0.0))


def _quadratic_terms(k_local, k_prime, u_local, v):
  """v̂_jᵀK_i v̂_j and û_iᵀK'_j û_i for local rows i and all columns j."""
  anchor = jnp.einsum("ikl,jk,jl->ij", k_local, v, v, precision=_HIGHEST)
  positive = jnp.einsum("jkl,ik,il->ij", k_prime, u_local, u_local, precision=_HIGHEST)
  return anchor, positive


def _on_accelerator() -> bool:
  return jax.default_backend() != "cpu"


def _full_float32(fn):
  """fn with every matmul and convolution it traces at full float32 precision.

  The clip factors min(1, B/‖g_ij‖) and ḡ come from different passes (Jacobian factors
  vs one weighted backward pass), so the clipped pair gradients stay within B only as
  far as both are computed accurately. On GPUs and TPUs JAX's default precision for
  float32 contractions is TF32 or bfloat16 passes (about 3 significant digits); this
  pins "highest" while fn is traced (precision is resolved when each op is traced), so
  the mechanism is the same on every backend. Layers given an explicit `precision=`
  keep it.
  """
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.default_matmul_precision("highest"):
      return fn(*args, **kwargs)

  return wrapped


def _backend_chunk_limits(budget: int, max_rows: int | None) -> tuple[int, int | None]:
  """(floats, rows) a pair-term chunk may hold on this backend: the CPU's as given;
  `_ACCELERATOR_CHUNK_SCALE` × the floats and no row cap on an accelerator."""
  if _on_accelerator():
    return budget * _ACCELERATOR_CHUNK_SCALE, None
  return budget, max_rows


def _row_chunks(fn, rows, row_floats: int, budget: int, max_rows: int | None = None):
  """fn(chunk of rows) -> (chunk, n), over all rows in chunks holding about `budget` floats
  and at most `max_rows` rows (as `_backend_chunk_limits` sets them for this backend)."""
  budget, max_rows = _backend_chunk_limits(budget, max_rows)
  n_rows = rows[0].shape[0]
  chunk = int(max(1, min(n_rows, max_rows or n_rows, budget // max(row_floats, 1))))
  return _unchunk_rows(_map_chunks(fn, rows, chunk), n_rows)


def _flat_cross_terms(flat_rows, u_rows, flat_columns, v):
  """layerwise.flat_cross for all local rows, in row chunks of about _CROSS_GRAM_CHUNK_FLOATS."""
  n, d, _ = flat_columns.shape
  return _row_chunks(lambda f, u: layerwise.flat_cross(f, u, flat_columns, v), (flat_rows, u_rows),
                     n * d * d, _CROSS_GRAM_CHUNK_FLOATS)


def _ghost_layer_cross_terms(a_rows, deltas_rows, u_rows, a_columns, deltas_columns, v):
  """layerwise.ghost_layer_cross of one layer for all local rows, in small row chunks."""
  deltas_rows, deltas_columns = layerwise.ghost_cross_layouts(deltas_rows, deltas_columns)
  d, n, t, c = deltas_columns.shape
  return _row_chunks(
      lambda a, delta, u: layerwise.ghost_layer_cross(a, delta, u, a_columns, deltas_columns, v),
      (a_rows, deltas_rows, u_rows), n * (t * t + 2 * t * c + d), _GHOST_LAYER_CHUNK_FLOATS,
      _GHOST_LAYER_CHUNK_ROWS)


def _ghost_terms(f_u: layerwise.Factors, u_rows, f_v: layerwise.Factors, v_columns):
  """(a, b, c) with ‖g_ij‖² = a + b + 2c for the rows i of f_u and the columns j of f_v,
  each (rows, columns): a = v̂_jᵀK_i v̂_j, b = û_iᵀK'_j û_i, c = v̂_jᵀ J_i J'_jᵀ û_i."""
  anchor, positive = _quadratic_terms(f_u.gram, f_v.gram, u_rows, v_columns)
  cross = jnp.zeros_like(anchor)
  if f_v.flat.shape[-1]:
    cross += _flat_cross_terms(f_u.flat, u_rows, f_v.flat, v_columns)
  for a_u, delta_u, a_v, delta_v in zip(f_u.ghost_patches, f_u.ghost_deltas, f_v.ghost_patches,
                                        f_v.ghost_deltas):
    cross += _ghost_layer_cross_terms(a_u, delta_u, u_rows, a_v, delta_v, v_columns)
  return anchor, positive, cross


def _jacobian_norms(gram: jax.Array) -> jax.Array:
  """‖J_e‖_F = √tr(J_e J_eᵀ) per example, from the (m, d, d) per-example Grams."""
  return jnp.sqrt(jnp.maximum(jnp.trace(gram, axis1=1, axis2=2), 0.0))


def _triangle_bound(anchor, positive, s_local, s_all, allowance: float):
  """√(a + ε_G s_i²) + √(b + ε_G s'_j²) ≥ ‖J_iᵀv̂_j‖ + ‖J'_jᵀû_i‖ ≥ ‖g_ij‖ in float32
  (ε_G = allowance·_GRAM_FLOAT_ERROR)."""
  eps = allowance * _GRAM_FLOAT_ERROR
  return (jnp.sqrt(jnp.maximum(anchor, 0.0) + eps * s_local[:, None] ** 2)
          + jnp.sqrt(jnp.maximum(positive, 0.0) + eps * s_all[None, :] ** 2))


def _vectors_per_block(batch: _Batch, count: int) -> int:
  """How many parameter-sized vectors (pair gradients) to hold at once: at most `count`, about
  _PAIR_BLOCK_FLOATS floats, at least one."""
  num_params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(batch.params))
  return max(1, min(count, _PAIR_BLOCK_FLOATS // max(num_params, 1)))


def _diagonal_norms(batch: _Batch, f_u: layerwise.Factors, f_v: layerwise.Factors, u, v,
                    allowance: float) -> jax.Array:
  """‖g_ii‖ of the pairs (x_i, x'_i) whose two views' factors are f_u, f_v, from their vectors
  (`layerwise.diagonal_sq_norms`), plus the vector allowance allowance·_VECTOR_FLOAT_ERROR·
  (s_i + s'_i)."""
  chunk = _vectors_per_block(batch, u.shape[0])
  sq = layerwise.diagonal_sq_norms(batch.plan, f_u, f_v, u, v, chunk)
  scale = _jacobian_norms(f_u.gram) + _jacobian_norms(f_v.gram)
  return jnp.sqrt(jnp.maximum(sq, 0.0)) + allowance * _VECTOR_FLOAT_ERROR * scale


def _with_diagonal(batch: _Batch, norms, f_u: layerwise.Factors, f_v: layerwise.Factors, u_rows,
                   v_columns, offset, at_home, allowance: float):
  """A block's norms (r, c) with each diagonal pair (x_i, x'_i) replaced by its vector-form norm.

  The block's columns are the examples offset..offset+c-1 of its rows when `at_home` (a bool
  or a traced bool); otherwise it holds no diagonal pair and is returned as it is.
  Positive pairs of near-identical views have small pair gradients whose two halves
  J_iᵀv̂_i and J'_iᵀû_i nearly cancel: Gram forms lose them in float32 (ghost returned 0
  for true norms of ~3e-3; triangle over-estimates them up to 60×). They are only n
  vectors, so they are formed and normed directly (`_diagonal_norms`).
  """
  if at_home is False:
    return norms
  r, c = norms.shape

  def diagonal():
    rows = lambda a: jax.lax.dynamic_slice_in_dim(a, offset, c, axis=0)
    return _diagonal_norms(batch, jax.tree_util.tree_map(rows, f_u), f_v, rows(u_rows), v_columns,
                           allowance)

  if at_home is True:
    values = diagonal()
  else:
    values = jax.lax.cond(at_home, diagonal, lambda: batch.c.varying(jnp.zeros((c,), norms.dtype)))
  on_diagonal = jnp.arange(r)[:, None] == offset + jnp.arange(c)[None, :]
  return jnp.where(on_diagonal & at_home, values[None, :], norms)


def _block_norms(f_u: layerwise.Factors, u_rows, f_v: layerwise.Factors, v_columns,
                 allowance: float):
  """min(√(a + b + 2c + ε_G S_ij²), triangle bound) for the rows of f_u and columns of f_v."""
  anchor, positive, cross = _ghost_terms(f_u, u_rows, f_v, v_columns)
  s_rows, s_columns = _jacobian_norms(f_u.gram), _jacobian_norms(f_v.gram)
  scale = s_rows[:, None] + s_columns[None, :]
  gram_norms = jnp.sqrt(
      jnp.maximum(anchor + positive + 2.0 * cross, 0.0)
      + allowance * _GRAM_FLOAT_ERROR * scale ** 2)
  return jnp.minimum(gram_norms, _triangle_bound(anchor, positive, s_rows, s_columns, allowance))


def _projection_tangents(batch: _Batch, reference_inputs, rank: int):
  """(tangents, η): the columns of the reference basis Q̃ (`projection.basis`) as a list of
  parameter leaves with a leading axis of k, from the reference inputs' Jacobians at
  batch.params."""
  leaves = jax.tree_util.tree_leaves(batch.params)
  factors = batch.factors(reference_inputs)
  d = factors.flat.shape[1]

  def jacobian_rows(one_example):  # (d, p): J_e, row a = J_eᵀe_a contracted from the factors
    def row(a):
      grads = layerwise.factors_transpose(batch.plan, one_example,
                                          jax.nn.one_hot(a, d)[None], leaves)
      return jnp.concatenate([jnp.ravel(g) for g in grads])

    return jax.vmap(row)(jnp.arange(d))

  rows = jax.vmap(lambda f: jacobian_rows(jax.tree_util.tree_map(lambda a: a[None], f)))(factors)
  q, eta = projection.basis(rows.reshape(-1, rows.shape[-1]), rank)
  return projection.as_tangent_leaves(q, leaves), eta


def _projected_jacobians(batch: _Batch, factors: layerwise.Factors, tangent_leaves) -> jax.Array:
  """(m, d, k): J_e q̃_l for the examples of `factors`, contracted from the factors
  (`layerwise.factors_times`; no forward or backward pass through the model). One tower:
  "projected" refuses two, so both views share batch.plan."""
  return layerwise.factors_times(batch.plan, factors, tangent_leaves)


def _triangle_norms(batch: _Batch, allowance: float = 1.0, projection_spec=None):
  """Upper bound ‖J_iᵀv̂_j‖ + ‖J'_jᵀû_i‖ ≥ ‖g_ij‖ from per-example Grams (with float32
  allowances), and the diagonal pairs from their vectors (`_diagonal_norms`).

  projection_spec = (reference_inputs, rank): "projected", the tighter bound exact on the
  reference inputs' Jacobian subspace (`projection.bound`); it needs the per-example
  projections J_iQ̃ (n·d·k floats) on top, and the pair terms go in row chunks.

  Memory stays at the Grams plus one microbatch of factors: the diagonal pairs are
  formed microbatch by microbatch from both views' factors of the same rows.
  """
  tangents = eta = None
  if projection_spec is not None:
    tangents, eta = _projection_tangents(batch, *projection_spec)

  def chunk_terms(x_chunk, x_prime_chunk, u_chunk, v_chunk) -> tuple[jax.Array, ...]:
    f_u, f_v = batch.factors(x_chunk, chunked=False), batch.factors(x_prime_chunk, chunked=False)
    terms = (f_u.gram, f_v.gram, _diagonal_norms(batch, f_u, f_v, u_chunk, v_chunk, allowance))
    if tangents is None:
      return terms
    return terms + (_projected_jacobians(batch, f_u,
                                         tangents), _projected_jacobians(batch, f_v, tangents))

  xs = (batch.x, batch.x_prime, batch.u_loc, batch.v_loc)
  m, n_local = batch.microbatch_size, _num_rows(batch.x)
  terms: tuple[jax.Array, ...]
  if m is None or m >= n_local:
    terms = chunk_terms(*xs)
  else:
    terms = _unchunk_rows(_map_chunks(chunk_terms, xs, m), n_local)
  k_local, k_prime_local, diagonal = terms[:3]
  k_prime = batch.c.gather(k_prime_local)
  s_local, s_prime_local = _jacobian_norms(k_local), _jacobian_norms(k_prime_local)
  s_all = batch.c.gather(s_prime_local)
  anchor, positive = _quadratic_terms(k_local, k_prime, batch.u_loc, batch.v)
  norms = _triangle_bound(anchor, positive, s_local, s_all, allowance)
  if tangents is not None:
    proj_local, proj_prime = terms[3], batch.c.gather(terms[4])
    n, d, k = proj_prime.shape
    vector_error = allowance * _VECTOR_FLOAT_ERROR * math.sqrt(k)
    gram_error = allowance * _GRAM_FLOAT_ERROR
    if projection.uses_gram_form(d):
      columns = projection.gram_columns(proj_prime, batch.v)
      subspace_norms = lambda proj_rows, u_rows, s_rows: projection.gram_norms(
          proj_rows, u_rows, columns, s_rows, s_all, gram_error)
      row_floats = 8 * n + d * d * k
    else:
      subspace_norms = lambda proj_rows, u_rows, s_rows: projection.vector_norms(
          proj_rows, u_rows, proj_prime, batch.v)
      row_floats = 3 * n * k

    def rows_bound(proj_rows, u_rows, anchor_rows, positive_rows, s_rows, triangle_rows):
      return projection.bound(subspace_norms(proj_rows, u_rows, s_rows), anchor_rows, positive_rows,
                              s_rows, s_all, eta, vector_error, gram_error, triangle_rows)

    norms = _row_chunks(rows_bound, (proj_local, batch.u_loc, anchor, positive, s_local, norms),
                        row_floats, _CROSS_GRAM_CHUNK_FLOATS)
  return norms.at[jnp.arange(n_local), batch.rows].set(diagonal)


def default_memory_budget() -> int:
  """Bytes of Jacobian factors "ghost" holds at once when not told: DEFAULT_GHOST_MEMORY_BUDGET
  on the CPU; a quarter of the device's memory on an accelerator that reports it."""
  if _on_accelerator():
    try:
      stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # pylint: disable=broad-except  (a backend without memory stats)
      stats = {}
    if stats.get("bytes_limit"):
      return max(DEFAULT_GHOST_MEMORY_BUDGET, int(stats["bytes_limit"]) // 4)
  return DEFAULT_GHOST_MEMORY_BUDGET


def factor_bytes_per_example(plan: layerwise.Plan, d: int, leaves) -> int:
  """Bytes one example's Jacobian factors take in "ghost" (float32): d·q for the q flattened
  parameters, T·(P + d·C) per ghost layer, the d×d Gram, and the largest ghost layer's T·d·C
  once more (its deltas are re-laid out for the pair terms)."""
  q = sum(int(np.prod(np.shape(leaves[i]))) for i in plan.generic)
  held, relaid = d * d, 0
  for layer, ghost in zip(plan.layers, plan.ghost):
    if ghost:
      held += layer.positions * (layer.fan_in + d * layer.features)
      relaid = max(relaid, layer.positions * d * layer.features)
    else:
      q += layer.fan_in * layer.features
  return 4 * (held + d * q + relaid)


def ghost_block_sizes(n_local: int, num_devices: int, example_bytes: int, memory_budget: int,
                      multiple: int = 1) -> tuple[int, int]:
  """(r, c): rows and columns of the pair blocks of "ghost", c dividing r.

  With b = 1 column buffer on one device and 2 on a ring (the block in use and the one
  arriving), the factors held at once are (r + b·c)·example_bytes ≤ memory_budget. The
  column factors are recomputed once per row block, so r is as large as fits (all n_local
  rows when (n_local + b·⌈n_local/b⌉)·example_bytes fit: no recomputation, and on one device
  the single block of the path before the blocks); c is then the largest that fits, at least
  _MIN_COLUMN_BLOCK where the budget allows, and a multiple of `multiple` (the microbatch of
  the factor computations) when larger than it, except for that single block. Below
  (1 + b)·example_bytes: r = c = 1.
  """
  buffers = 1 if num_devices == 1 else 2
  slots = memory_budget // max(example_bytes, 1)
  for num_row_blocks in range(1, n_local + 1):
    r0 = -(-n_local // num_row_blocks)
    c = min(-(-r0 // buffers), (slots - r0) // buffers)
    if c < min(_MIN_COLUMN_BLOCK, -(-r0 // buffers)):
      continue
    while True:
      per_row_block = -(-r0 // c)
      c_balanced = -(-r0 // per_row_block)
      if buffers == 1 and c_balanced == n_local:
        return n_local, n_local
      if c_balanced > multiple:  # whole microbatches: no padded chunk to slice off
        c_balanced = -(-c_balanced // multiple) * multiple
      r = per_row_block * c_balanced
      if r + buffers * c_balanced <= slots or c == 1:
        return r, c_balanced
      c -= 1
  return 1, 1


def _loop(num: int, body, carry):
  """body(i, carry) for i < num: a fori_loop, or one direct call when num == 1."""
  if num == 1:
    return body(0, carry)
  return jax.lax.fori_loop(0, num, body, carry)


def _ghost(batch: _Batch, tau_local, clip_norm, allowance: float, memory_budget: int | None,
           with_grads: bool = True):
  """Exact pair norms and ḡ of "ghost" in blocks of r rows × c columns (`ghost_block_sizes`).

  For each row block the rows' factors f_u are computed once; for each column block of this
  device's x_prime its factors f_v are computed (again for every row block) and passed around
  the ring of devices (`_Collective.ring_shift`, k steps: it comes home last), so that every
  device pairs its rows with every column. Per block: the norms (`_block_norms`, the diagonal
  pairs from their vectors when the block holds them), λ_ij = τ_ij·min(1, B/‖g_ij‖), and the
  cotangents c_i += Σ_j λ_ij v̂_j (of the rows) and c'_j += Σ_i λ_ij û_i (travelling with the
  column block). ḡ = Σ_i J_iᵀc_i + Σ_j J'_jᵀc'_j is contracted from f_u after its row block
  and from f_v when it comes home (per row block: ḡ is linear in the cotangents).

  Returns (norms (n_local, n), ḡ psum-ed over devices, or None without with_grads).
  """
  col = batch.c
  n_local, d = batch.u_loc.shape
  k = col.size()
  leaves = jax.tree_util.tree_leaves(batch.params)
  budget = default_memory_budget() if memory_budget is None else memory_budget
  r, c = ghost_block_sizes(n_local, k, factor_bytes_per_example(batch.plan, d, leaves), budget,
                           batch.microbatch_size or 1)
  per_row_block = r // c
  num_row_blocks, num_column_blocks = -(-n_local // r), -(-n_local // c)
  single = num_row_blocks == 1 and num_column_blocks == 1 and k == 1
  # One block: the user's microbatches; blocks: at most a column block at a time.
  chunk = batch.microbatch_size if single else min(batch.microbatch_size or c, c)

  def pad(a, size):
    extra = size - a.shape[0]
    return jnp.concatenate([a, jnp.zeros((extra,) + a.shape[1:], a.dtype)]) if extra else a

  n_rows, n_columns = num_row_blocks * r, num_column_blocks * c
  x, u = pad(batch.x, n_rows), pad(batch.u_loc, n_rows)
  x_prime, v_local = pad(batch.x_prime, n_columns), pad(batch.v_loc, n_columns)
  tau = tau_local.reshape(n_local, k, n_local)  # columns: (device, local example)
  tau = jnp.pad(tau, ((0, n_rows - n_local), (0, 0), (0, n_columns - n_local)))
  me = col.index()
  zero_grads = col.varying(jax.tree_util.tree_map(jnp.zeros_like, batch.params))

  def row_block(a, carry):
    norms, grads = carry
    f_u = batch.factors(jax.lax.dynamic_slice_in_dim(x, a * r, r), chunk=chunk)
    u_rows = jax.lax.dynamic_slice_in_dim(u, a * r, r)
    tau_rows = jax.lax.dynamic_slice_in_dim(tau, a * r, r)

    def column_block(b, carry):
      norms_rows, cot_u, grads = carry
      start = b * c
      f_v = batch.factors(jax.lax.dynamic_slice_in_dim(x_prime, start, c), chunk=chunk)
      v_columns = jax.lax.dynamic_slice_in_dim(v_local, start, c)
      home = b // per_row_block == a  # its examples are rows start - a·r ... of this row block

      def ring_step(s, carry):
        norms_rows, cot_u, (f_v, v_columns, cot_v) = carry
        owner = (me - s) % k  # the device whose columns are passing
        block = _block_norms(f_u, u_rows, f_v, v_columns, allowance)
        block = _with_diagonal(batch, block, f_u, f_v, u_rows, v_columns, start - a * r,
                               home & (s == 0), allowance)
        norms_rows = jax.lax.dynamic_update_slice(norms_rows, block[:, None, :], (0, owner, start))
        if with_grads:
          tau_block = jax.lax.dynamic_slice(tau_rows, (0, owner, start), (r, 1, c))[:, 0, :]
          lam = tau_block * _clip_factor(block, clip_norm)
          cot_u = cot_u + jnp.matmul(lam, v_columns, precision=_HIGHEST)
          cot_v = cot_v + jnp.matmul(lam.T, u_rows, precision=_HIGHEST)
        return norms_rows, cot_u, col.ring_shift((f_v, v_columns, cot_v))

      travelling = col.varying((f_v, v_columns, jnp.zeros((c, d), u.dtype)))
      norms_rows, cot_u, (f_v, _, cot_v) = _loop(k, ring_step, (norms_rows, cot_u, travelling))
      if with_grads:  # home again, with Σ_i λ_ij û_i over every device's rows of this row block
        grads = jax.tree_util.tree_map(jnp.add, grads, batch._factor_backward(f_v, cot_v))
      return norms_rows, cot_u, grads

    norms_rows = col.varying(jnp.zeros((r, k, n_columns), u.dtype))
    cot_u = col.varying(jnp.zeros((r, d), u.dtype))
    norms_rows, cot_u, grads = _loop(num_column_blocks, column_block, (norms_rows, cot_u, grads))
    if with_grads:
      grads = jax.tree_util.tree_map(jnp.add, grads, batch._factor_backward(f_u, cot_u))
    return jax.lax.dynamic_update_slice_in_dim(norms, norms_rows, a * r, axis=0), grads

  norms = col.varying(jnp.zeros((n_rows, k, n_columns), u.dtype))
  norms, grads = _loop(num_row_blocks, row_block, (norms, zero_grads))
  norms = norms[:n_local, :, :n_local].reshape(n_local, k * n_local)
  return norms, (col.psum(grads) if with_grads else None)


def _materialize(batch: _Batch, tau_local_rows, clip_norm, pair_block_size, allowance: float = 1.0):
  """Algorithm 1: every pair gradient by its own backward pass, in blocks of pairs.

  Each norm is raised by the vector allowance _VECTOR_FLOAT_ERROR·(‖J_i‖_F + ‖J'_j‖_F).
  Returns (ḡ summed over local rows and psum-ed over devices, norms (n_local, n)).
  """
  x_prime_all = batch.c.gather(batch.x_prime)
  s_local = _jacobian_norms(batch.factors(batch.x).gram)
  s_all = batch.c.gather(_jacobian_norms(batch.factors(batch.x_prime, positive=True).gram))
  slack = allowance * _VECTOR_FLOAT_ERROR * (s_local[:, None] + s_all[None, :])
  n_local, n = tau_local_rows.shape
  block = pair_block_size or _vectors_per_block(batch, n_local * n)
  num_pairs = n_local * n
  num_blocks = -(-num_pairs // block)
  flat = jnp.arange(num_blocks * block)
  real = flat < num_pairs
  flat = jnp.where(real, flat, 0)
  rows, cols = flat // n, flat % n
  weights = jnp.where(real, tau_local_rows.reshape(-1)[flat], 0.0)

  def pair_grad(i, j):
    z = lambda p: jnp.dot(batch.normalized_embedding(p, _take_row(batch.x, i)),
                          batch.normalized_embedding(p, _take_row(x_prime_all, j), positive=True),
                          precision=_HIGHEST)
    return jax.grad(z)(batch.params)

  def step(acc, blk):
    i, j, w, slack = blk
    grads = jax.vmap(pair_grad)(i, j)
    sq = sum(
        jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree_util.tree_leaves(grads))
    norms = jnp.sqrt(sq) + slack
    coef = w * _clip_factor(norms, clip_norm)
    finite = jnp.isfinite(norms)  # dropped pairs must add exactly 0, not 0·inf = NaN

    def add(a, g):
      g = jnp.where(finite.reshape((-1,) + (1,) * (g.ndim - 1)), g, jnp.zeros_like(g))
      return a + jnp.tensordot(coef.astype(g.dtype), g, axes=1, precision=_HIGHEST).astype(a.dtype)

    acc = jax.tree_util.tree_map(add, acc, grads)
    return acc, norms

  zeros = jax.tree_util.tree_map(jnp.zeros_like, batch.params)
  blocks = tuple(
      a.reshape(num_blocks, block) for a in (rows, cols, weights, slack.reshape(-1)[flat]))
  grads, norms = jax.lax.scan(step, zeros, blocks)
  norms = norms.reshape(-1)[:num_pairs].reshape(n_local, n)
  return batch.c.psum(grads), norms


def _as_inputs(a, name: str, xp):
  """An array, or a pytree of arrays (e.g. token ids and their mask), with the examples along
  axis 0 of every leaf, as `xp` arrays; ValueError otherwise."""
  leaves, treedef = jax.tree_util.tree_flatten(a)
  if not leaves:
    raise ValueError(f"{name} must be an array or a pytree of arrays, got {a!r} (no arrays).")
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0]:
    where = name + jax.tree_util.keystr(path)
    if not hasattr(leaf, "shape") and not isinstance(leaf, (int, float, bool, np.generic)):
      raise ValueError(f"{where} must be an array with the examples along axis 0, got "
                       f"{type(leaf).__name__}.")
    dtype = np.dtype(getattr(leaf, "dtype", type(leaf)))
    if dtype.kind not in "biuf":
      raise ValueError(f"{where} must hold numbers (bool, int or float), got dtype {dtype}.")
    leaf = xp.asarray(leaf)
    if leaf.ndim < 1:
      raise ValueError(f"{where} must have the examples along axis 0, got a scalar.")
    out.append(leaf)
  sizes = sorted({leaf.shape[0] for leaf in out})
  if len(sizes) > 1:
    raise ValueError(
        f"every leaf of {name} must hold the same number of examples along axis 0, "
        f"got {sizes}: "
        + ", ".join(f"{name}{jax.tree_util.keystr(path)}: {leaf.shape}"
                    for (path, _), leaf in zip(jax.tree_util.tree_flatten_with_path(a)[0], out))
        + ".")
  return jax.tree_util.tree_unflatten(treedef, out)


def _check_mask(mask, n: int, xp):
  mask = xp.asarray(mask)
  if mask.shape != (n,):
    raise ValueError(f"mask must have shape ({n},), got {mask.shape}.")
  if mask.dtype == bool:
    return mask
  if not jnp.issubdtype(mask.dtype, jnp.integer):
    raise ValueError(
        f"mask must be boolean (or integer 0/1), got dtype {mask.dtype}: a float mask such as "
        "0.5 would silently count as True.")
  if not _is_traced(mask) and not bool(xp.all((mask == 0) | (mask == 1))):
    raise ValueError("an integer mask must hold only 0 and 1.")
  return mask.astype(bool)


def check_pairs(x, x_prime, mask=None, xp=jnp) -> tuple[Any, Any, Any]:
  """(x, x_prime, mask) as `xp` arrays (or pytrees of them), mask all-True if None.

  ValueError on leaves that are not numeric arrays with the examples along axis 0, leaves
  of one input with different numbers of examples, x and x_prime with different numbers
  of examples, or a mask that is not boolean (integer 0/1 is accepted).
  """
  x, x_prime = _as_inputs(x, "x", xp), _as_inputs(x_prime, "x_prime", xp)
  if _num_rows(x) != _num_rows(x_prime):
    raise ValueError(f"x and x_prime must hold the same number of examples, got "
                     f"{_num_rows(x)} and {_num_rows(x_prime)} (shapes "
                     f"{jax.tree_util.tree_map(jnp.shape, x)} and "
                     f"{jax.tree_util.tree_map(jnp.shape, x_prime)}).")
  n = _num_rows(x)
  mask = xp.ones((n,), dtype=bool) if mask is None else _check_mask(mask, n, xp)
  return x, x_prime, mask


_NON_TRAINABLE_COLLECTIONS = ("batch_stats", "cache", "intermediates", "state")
_PROBE_ROWS = 4


def _probe_inputs(params, x):
  """Concrete stand-ins of (params, x) with their shapes and dtypes (random, fixed seed)."""
  rng = np.random.default_rng(0)

  def stand_in(a, scale):
    if jnp.issubdtype(a.dtype, jnp.floating):
      return np.asarray(scale * rng.standard_normal(a.shape), a.dtype)
    if jnp.issubdtype(a.dtype, jnp.integer):
      return np.asarray(rng.integers(0, 2, a.shape), a.dtype)
    if a.dtype == bool:
      return np.ones(a.shape, a.dtype)  # e.g. an attention mask: keep every position
    return np.zeros(a.shape, a.dtype)

  rows = min(_num_rows(x), _PROBE_ROWS)
  return (jax.tree_util.tree_map(lambda a: stand_in(a, 0.3), params),
          jax.tree_util.tree_map(
              lambda a: stand_in(jax.ShapeDtypeStruct((rows,) + a.shape[1:], a.dtype), 1.0), x))


def check_embed_fn(embed_fn: EmbedFn, params, x, name: str = "embed_fn") -> None:
  """ValueError unless embed_fn(params, x) is (n, d) and treats the examples independently.

  Per-pair clipping needs each embedding to depend on its own example only: a model that
  mixes the batch (flax BatchNorm in training mode, subtracting the batch mean) would be
  evaluated example by example and learn nothing. Compares embed_fn on a few rows at once
  with the same rows one by one: on (params, x) themselves when they are concrete, under
  jit on random stand-ins of their shapes. Also refuses params holding non-trainable flax
  collections (they must be closed over by embed_fn, never differentiated or noised).
  """
  if isinstance(params, dict) or hasattr(params, "keys"):
    keys = set(params.keys())
    extra = keys & set(_NON_TRAINABLE_COLLECTIONS) or (keys
                                                       - {"params"} if "params" in keys else set())
    if extra:
      raise ValueError(
          f"params holds the flax collection(s) {sorted(extra)}: pass only the trainable "
          "parameters (e.g. variables['params']) and let embed_fn close over the rest, so "
          "that non-trainable state is never differentiated or noised. Batch statistics "
          "mix the examples of a batch and break per-pair clipping: use GroupNorm/LayerNorm "
          "or no normalisation.")
  if _num_rows(x) < 1:
    return
  if _is_traced((params, x)):
    params, x = _probe_inputs(params, x)
  with jax.ensure_compile_time_eval():  # everything below runs now, also inside a jit trace
    rows = jax.tree_util.tree_map(lambda a: jnp.asarray(a[:_PROBE_ROWS]), x)
    num = _num_rows(rows)
    batched = np.asarray(embed_fn(params, rows), np.float64)
    if batched.ndim != 2 or batched.shape[0] != num:
      raise ValueError(f"{name} must return (n, d) embeddings, one row per example; got shape "
                       f"{batched.shape} for {num} examples.")
    if num < 2:
      return
    one_by_one = [jax.tree_util.tree_map(lambda a, i=i: a[i:i + 1], rows) for i in range(num)]
    single = np.concatenate([np.asarray(embed_fn(params, r), np.float64) for r in one_by_one])
  if not np.all(np.isfinite(batched)) or not np.all(np.isfinite(single)):
    return  # non-finite embeddings are handled (dropped) by the gradient itself
  tol = 1e-3 * max(float(np.max(np.abs(batched))), 1e-6)
  if np.max(np.abs(batched - single)) > tol:
    raise ValueError(
        f"{name} mixes the examples of a batch: embedding rows together differs from "
        f"embedding them one by one (max difference {np.max(np.abs(batched - single)):.3g}). "
        "Logit-DP clips per-pair gradients and needs examples to be independent: no batch "
        "norm in training mode, no batch statistics.")


def _check_pair_inputs(x, x_prime, mask, min_batch_size, num_shards=1):
  x, x_prime, mask = check_pairs(x, x_prime, mask)
  n = _num_rows(x)
  if n * num_shards < min_batch_size:  # the pair matrix spans the global batch
    raise ValueError(
        f"the loss needs at least {min_batch_size} pairs per batch, got {n * num_shards}.")
  return x, x_prime, mask


def _forward(embed_fn, loss, params, x, x_prime, mask, eps, microbatch_size, collective,
             positive_embed_fn=None):
  """(batch, ℒ, τ): embeddings, the loss on the global Z and τ_ij = ∂ℒ/∂Z_ij (0 off valid pairs)."""
  params = collective.local_params(params)
  batch = _Batch(embed_fn, params, x, x_prime, mask, eps=eps, microbatch_size=microbatch_size,
                 collective=collective, positive_embed_fn=positive_embed_fn)
  loss_value, tau = jax.value_and_grad(loss)(batch.z, batch.valid)
  tau = jnp.where(batch.valid[:, None] & batch.valid[None, :], tau, 0.0)
  # Every valid pair dropped as non-finite (e.g. NaN parameters): the loss is NaN, not the
  # loss of an empty batch, so that a diverged run cannot log 0.0 forever.
  all_dropped = (batch.num_nonfinite > 0) & ~jnp.any(batch.valid)
  loss_value = jnp.where(all_dropped, jnp.nan, loss_value)
  return batch, loss_value, tau


def check_towers(embed_fn: EmbedFn, positive_embed_fn: EmbedFn | None, params, x, x_prime) -> None:
  """`check_embed_fn` on embed_fn with x and, for two towers, on positive_embed_fn with x_prime."""
  check_embed_fn(embed_fn, params, x)
  if positive_embed_fn is not None and positive_embed_fn is not embed_fn:
    check_embed_fn(positive_embed_fn, params, x_prime, "positive_embed_fn")


def _check_positive_embed_fn(positive_embed_fn):
  if positive_embed_fn is not None and not callable(positive_embed_fn):
    raise ValueError(f"positive_embed_fn must be callable or None, got {positive_embed_fn!r}.")


def _make_grad_fn(core, embed_fn, loss, what, axis_name=None, positive_embed_fn=None):
  """Wraps a jitted core: input checks, and a ValueError on non-finite values when eager."""
  core = jax.jit(core)
  min_batch_size = getattr(loss, "min_batch_size", 1)

  checked = []

  def with_num_dropped(params, x, x_prime, mask=None):
    num_shards = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    x, x_prime, mask = _check_pair_inputs(x, x_prime, mask, min_batch_size, num_shards)
    if not checked:  # on first use
      check_towers(embed_fn, positive_embed_fn, params, x, x_prime)
      checked.append(True)
    return core(params, x, x_prime, mask)

  def grad_fn(params, x, x_prime, mask=None):
    loss_value, grads, num_nonfinite = with_num_dropped(params, x, x_prime, mask)
    raise_if_dropped(what, (params, x, x_prime, mask), num_nonfinite)
    return loss_value, grads

  typed = cast(GradFn, grad_fn)
  typed.core = core
  with_num_dropped.__doc__ = (
      "(ℒ, ḡ, num_dropped): as grad_fn, never raising; num_dropped counts the valid pairs "
      "dropped for non-finite inputs or embeddings (ℒ is NaN when that is all of them).")
  typed.with_num_dropped = with_num_dropped
  return typed


def clipped_grad(embed_fn: EmbedFn, loss, clip_norm: float, method: str = "ghost", *,
                 microbatch_size: int | None = None, pair_block_size: int | None = None,
                 memory_budget: int | None = None, axis_name: str | None = None,
                 cosine_eps: float = DEFAULT_COSINE_EPS, positive_embed_fn: EmbedFn | None = None,
                 reference_inputs: Any = None,
                 projection_rank: int = DEFAULT_PROJECTION_RANK) -> GradFn:
  """Builds grad_fn(params, x, x_prime, mask=None) -> (ℒ, ḡ) for Logit-DP.

  ḡ = Σ_ij τ_ij·min(1, B/‖∇_w Z_ij‖)·∇_w Z_ij, a pytree like params; it is a SUM
  over the n² pairs, with L2 sensitivity `logit_dp.sensitivity(loss, B)` under
  add-or-remove-one pair. Noise it with `logit_dp.transform`.

  Args:
    embed_fn: embed_fn(params, x) -> (n, d), acting on examples independently.
    loss: a loss from `logit_dp.losses` (any loss(Z, mask) works for the
      gradient, but only those have a known sensitivity).
    clip_norm: B > 0; jnp.inf disables clipping (ḡ = ∇ℒ, not private).
    method: "ghost" (exact pair norms from per-example Jacobians, default),
      "materialize" (Algorithm 1, n² backward passes: the reference) or
      "triangle" (clips by an upper bound of the pair norm: cheaper, private,
      clips more than needed; the negative pairs more than the exact diagonal, which
      for the contrastive loss biases ḡ towards collapsed embeddings when most pairs
      are clipped: docs/METHOD.md) or
      "projected" (a tighter upper bound at about triangle's cost: exact on the
      subspace spanned by the Jacobians of public `reference_inputs`, triangle on
      the rest; bound/norm ≈ 1.1 where triangle's is ≈ 5.7: docs/METHOD.md).
    microbatch_size: process examples in chunks of this size (forward,
      Jacobians, backward) to bound memory. The pair matrix still spans the
      whole batch, so every negative is kept and the noise, added once to ḡ,
      is unchanged: this is gradient accumulation without changing the mechanism.
    pair_block_size: pairs per block for "materialize" (default: ~4M floats).
    memory_budget: "ghost" only: bytes of per-example Jacobian factors held at
      once (default `default_memory_budget()`: 4 GiB on the CPU, a quarter of an
      accelerator's memory). The pair norms are computed in blocks of r rows × c
      columns holding (r + c)·F bytes of factors (F per example,
      `factor_bytes_per_example`; r + 2c under axis_name, where column blocks pass
      around a ring of devices), the column factors recomputed once per row
      block; when both views' factors of the whole (local) batch fit, that is
      one block and nothing is recomputed. Memory then grows with n only as the
      n·d embeddings and the n² pair scalars (τ, norms, λ); one microbatch's
      forward and backward passes (microbatch_size, or at most c examples when
      blocked) and the pair-term chunks come on top (docs/METHOD.md).
    axis_name: call inside `jax.shard_map` over this mesh axis with the batch
      split across devices; the pair matrix spans the global batch and every
      device returns the same global (ℒ, ḡ).
    cosine_eps: ε of the cosine similarity n(u) = u/√(‖u‖² + ε²).
    positive_embed_fn: two towers (dual encoder, CLIP-style): x_prime is
      embedded by positive_embed_fn(params, x_prime) -> (n, d), x by embed_fn;
      params is one pytree holding both towers. Towers that share no parameter
      (found by tracing which leaves each output depends on) get exact pair
      norms at the cost of "triangle" (the cross term is 0); shared parameters
      use the general computation. Same sensitivity as one tower.
    reference_inputs: "projected" only (and required there): PUBLIC inputs
      (examples along axis 0, like x), e.g. 64 images of a public data set. Their
      Jacobians at the current params span the subspace Q̃; it never depends on the
      private batch, so each pair's clip factor depends on that pair only. Costs
      m·d·p floats for their Jacobians (m examples, p parameters).
    projection_rank: "projected": k, the dimension of the subspace (at most m·d);
      the per-example projections hold n·d·k floats.

  grad_fn's mask is an optional (n,) boolean: False rows are padding and
  contribute exactly nothing. x and x_prime are arrays or pytrees of arrays
  (e.g. token ids and a padding mask) with the examples along axis 0 of every
  leaf, and the same number of examples.
  Called eagerly, grad_fn raises ValueError when any valid pair has non-finite
  inputs or embeddings; under jit it masks those pairs out (still private: it is
  the same as removing them). `grad_fn.with_num_dropped(...)` returns
  (ℒ, ḡ, num_dropped) with their number, and ℒ is NaN when every valid pair was
  dropped (e.g. NaN parameters), so a diverged run cannot look like loss 0.

  Precision: grad_fn traces embed_fn and every contraction of the pair norms at
  `jax.default_matmul_precision("highest")`, whatever the ambient default, because
  the clip factors and ḡ come from different passes and TF32 (the GPU default for
  float32) would put each clipped pair gradient's norm off B by ~1e-3 relative.
  Layers constructed with an explicit `precision=` keep theirs.
  """
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  clip_norm = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=True)
  _check_microbatch(microbatch_size)
  _check_memory_budget(memory_budget)
  _check_positive_embed_fn(positive_embed_fn)
  projection_spec = _check_projection(method, reference_inputs, projection_rank, positive_embed_fn,
                                      embed_fn)
  collective = _Collective(axis_name)

  @_full_float32
  def core(params, x, x_prime, mask):
    batch, loss_value, tau = _forward(embed_fn, loss, params, x, x_prime, mask, cosine_eps,
                                      microbatch_size, collective, positive_embed_fn)
    tau_local = tau[batch.rows]
    if method == "materialize":
      grads, _ = _materialize(batch, tau_local, clip_norm, pair_block_size)
      return collective.replicated(loss_value), grads, collective.replicated(batch.num_nonfinite)
    if batch.two_tower:
      norms, factors = two_tower.pair_norms(batch, method)
      lam_local = tau_local * _clip_factor(norms, clip_norm)
      grads = batch.weighted_backward(lam_local, collective.gather(lam_local), factors)
    elif method == "ghost":
      _, grads = _ghost(batch, tau_local, clip_norm, 1.0, memory_budget)
    else:
      norms = _triangle_norms(batch, projection_spec=projection_spec)
      lam_local = tau_local * _clip_factor(norms, clip_norm)
      grads = batch.weighted_backward(lam_local, collective.gather(lam_local))
    return collective.replicated(loss_value), grads, collective.replicated(batch.num_nonfinite)

  return _make_grad_fn(core, embed_fn, loss, f"clipped_grad({method})", axis_name,
                       positive_embed_fn)


def pair_grad_norms(embed_fn: EmbedFn, params, x, x_prime, method: str = "ghost", *,
                    microbatch_size: int | None = None, cosine_eps: float = DEFAULT_COSINE_EPS,
                    float_allowance: bool = True, memory_budget: int | None = None,
                    positive_embed_fn: EmbedFn | None = None, reference_inputs: Any = None,
                    projection_rank: int = DEFAULT_PROJECTION_RANK) -> jax.Array:
  """The (n, n) matrix of the norms `clipped_grad` clips by: ‖∇_w Z_ij‖ ("ghost",
  "materialize"; "triangle", "projected": upper bounds off the diagonal, exact on it).

  microbatch_size and memory_budget ("ghost": bytes of Jacobian factors held at once) as in
  `clipped_grad`.

  With float_allowance (the default, what clipping uses) every norm includes the float32
  allowance that keeps it at or above the true norm (docs/PRIVACY.md): relative ~1e-4 on
  ordinary pairs, more on pairs whose gradient nearly cancels. float_allowance=False
  returns the computed values without it (for comparing methods; never clip by them).
  positive_embed_fn: the tower of x_prime, and reference_inputs, projection_rank
  ("projected"), as in `clipped_grad`.
  """
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  _check_microbatch(microbatch_size)
  _check_positive_embed_fn(positive_embed_fn)
  spec = _check_projection(method, reference_inputs, projection_rank, positive_embed_fn, embed_fn)
  x, x_prime, _ = _check_pair_inputs(x, x_prime, None, 1)
  reference, rank = spec if spec is not None else (None, None)
  return _pair_grad_norms(embed_fn, params, x, x_prime, method, microbatch_size,
                          cosine_eps, 1.0 if float_allowance else 0.0,
                          _check_memory_budget(memory_budget), positive_embed_fn, reference, rank)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7, 8, 9, 11))
@_full_float32
def _pair_grad_norms(embed_fn, params, x, x_prime, method, microbatch_size, cosine_eps, allowance,
                     memory_budget, positive_embed_fn, reference_inputs, projection_rank):
  n = _num_rows(x)
  mask = jnp.ones((n,), dtype=bool)
  batch = _Batch(embed_fn, params, x, x_prime, mask, eps=cosine_eps,
                 microbatch_size=microbatch_size, collective=_Collective(None),
                 positive_embed_fn=positive_embed_fn)
  if batch.two_tower and method != "materialize":
    return two_tower.pair_norms(batch, method, allowance)[0]
  if method == "ghost":
    return _ghost(batch, jnp.zeros((n, n), batch.u_loc.dtype), math.inf, allowance, memory_budget,
                  with_grads=False)[0]
  if method in ("triangle", "projected"):
    spec = None if method == "triangle" else (reference_inputs, projection_rank)
    return _triangle_norms(batch, allowance, spec)
  _, norms = _materialize(batch, jnp.zeros((n, n), batch.u_loc.dtype), math.inf, None, allowance)
  return norms


def naive_clipped_grad(embed_fn: EmbedFn, loss, clip_norm: float, *,
                       microbatch_size: int | None = None, axis_name: str | None = None,
                       cosine_eps: float = DEFAULT_COSINE_EPS,
                       positive_embed_fn: EmbedFn | None = None) -> GradFn:
  """Naive-DP: ḡ = ∇ℒ·min(1, B/‖∇ℒ‖), the whole-batch gradient clipped to B.

  Sensitivity 2B under add-or-remove-one (`logit_dp.naive_sensitivity`). Same
  signature and mask/axis/two-tower semantics as `clipped_grad`.
  """
  clip_norm = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=True)
  _check_microbatch(microbatch_size)
  _check_positive_embed_fn(positive_embed_fn)
  collective = _Collective(axis_name)

  def core(params, x, x_prime, mask):
    batch, loss_value, tau = _forward(embed_fn, loss, params, x, x_prime, mask, cosine_eps,
                                      microbatch_size, collective, positive_embed_fn)
    grads = batch.weighted_backward(tau[batch.rows], tau)
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
    factor = _clip_factor(norm, clip_norm)
    clipped = jax.tree_util.tree_map(lambda g: jnp.where(factor > 0, g * factor, 0.0), grads)
    return (collective.replicated(loss_value), clipped, collective.replicated(batch.num_nonfinite))

  return _make_grad_fn(core, embed_fn, loss, "naive_clipped_grad", axis_name, positive_embed_fn)


def _check_projection(method: str, reference_inputs, projection_rank, positive_embed_fn, embed_fn):
  """(reference_inputs as float arrays, k) for "projected", None otherwise; ValueError when
  "projected" has no (finite, non-empty) reference inputs, another method is given them, or
  there are two towers (disjoint towers are exact at triangle's cost already)."""
  if method != "projected":
    if reference_inputs is not None:
      raise ValueError(f"reference_inputs are used by method='projected' only, not {method!r}.")
    return None
  if reference_inputs is None:
    raise ValueError("method='projected' needs reference_inputs: a few PUBLIC inputs (examples "
                     "along axis 0) whose Jacobians span the subspace of its bound.")
  if positive_embed_fn is not None and positive_embed_fn is not embed_fn:
    raise ValueError("method='projected' supports one tower; with two towers use 'triangle' "
                     "(exact for towers sharing no parameter) or 'ghost'.")
  rank = projection.check_rank(projection_rank)
  reference = _as_inputs(reference_inputs, "reference_inputs", np)
  if _num_rows(reference) < 1:
    raise ValueError("reference_inputs must hold at least one example.")
  for leaf in jax.tree_util.tree_leaves(reference):
    if not np.all(np.isfinite(leaf)):
      raise ValueError("reference_inputs must be finite (they are public inputs, not masked).")
  return jax.tree_util.tree_map(jnp.asarray, reference), rank


def _check_memory_budget(memory_budget):
  if memory_budget is not None and (isinstance(memory_budget, bool)
                                    or not isinstance(memory_budget, int) or memory_budget < 1):
    raise ValueError(
        f"memory_budget must be a positive integer (bytes) or None, got {memory_budget!r}.")
  return memory_budget


def _check_microbatch(microbatch_size):
  if microbatch_size is not None and (isinstance(microbatch_size, bool) or
                                      not isinstance(microbatch_size, int) or microbatch_size < 1):
    raise ValueError(
        f"microbatch_size must be a positive integer or None, got {microbatch_size!r}.")

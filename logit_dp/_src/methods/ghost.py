""""ghost": exact pair norms from per-example Jacobian factors, in blocks of pairs.

‖g_ij‖² = a + b + 2c (`pair_terms`), never n²·p floats: the cross term c is ⟨J_iᵀv̂_j, J'_jᵀû_i⟩
over the flattened parameters, formed a block of them at a time (`layerwise.flat_cross`), plus
per-layer pair terms of ghost layers (`ghost_terms`), in row chunks (`chunking.row_chunks`).
The rows' and columns' factors are held r and c examples at a time within a memory budget
(`chunking.ghost_block_sizes`); under a shard_map axis the column blocks pass around the ring
of devices. Two towers:
`towers.pair_norms` (exact at triangle's cost for towers that share no parameter).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from logit_dp._src import checks
from logit_dp._src import chunking
from logit_dp._src import layerwise
from logit_dp._src import numerics
from logit_dp._src import pair_batch
from logit_dp._src import pair_terms
from logit_dp._src import rows as rows_lib
from logit_dp._src.methods import base
from logit_dp._src.methods import towers


@dataclasses.dataclass(frozen=True)
class Ghost(base.ClipMethod):
  """Exact pair norms (min with the triangle bound; the positive pairs and the pairs whose
  float allowance bites formed as vectors, `pair_terms.refine_gram_pairs`).

  For ḡ alone (`clipped_grad`) a norm at or below B is not tightened: its clip factor is 1
  whatever its exact value, so ḡ is that of the tightened norms. `pair_norms` and
  `norms_and_clipped_grad` (whose norms `ClipStats` reports) tighten them all.

  Attributes:
    memory_budget: bytes of Jacobian factors held at once, a positive integer (None:
      `chunking.default_memory_budget`).
  """
  name: ClassVar[str] = "ghost"
  memory_budget: int | None = None

  def __post_init__(self):
    checks.check_positive_int_or_none("memory_budget", self.memory_budget, " (bytes)")

  def pair_norms_with_factors(self, batch, allowance) -> base.NormsAndFactors:
    """See `base.ClipMethod.pair_norms_with_factors`."""
    if batch.two_tower:
      return towers.pair_norms(batch, flat_cross_terms, allowance=allowance)
    tau = jnp.zeros((batch.u_loc.shape[0], batch.u.shape[0]), batch.u_loc.dtype)
    return ghost_blocks(batch, tau, math.inf, allowance, self.memory_budget,
                        with_grads=False)[0], None

  def embeds_with_factors(self, batch) -> bool:
    """See `base.ClipMethod.embeds_with_factors`: with one block of pairs on one device,
    `_one_block` contracts the factors of both views, computed in one pass; two towers in one
    microbatch (`towers.one_microbatch`)."""
    if batch.two_tower:
      return towers.one_microbatch(batch)
    return _block_sizes(batch, self.memory_budget)[2]

  def norms_and_clipped_grad(self, batch, tau_local, clip_norm) -> tuple[jax.Array, Any]:
    """See `base.ClipMethod.norms_and_clipped_grad`."""
    if batch.two_tower:
      return base.clipped_by(batch, *towers.pair_norms(batch, flat_cross_terms), tau_local,
                             clip_norm)
    return ghost_blocks(batch, tau_local, clip_norm, 1.0, self.memory_budget)

  def clipped_grad(self, batch, tau_local, clip_norm) -> Any:
    """See `base.ClipMethod.clipped_grad`; the norms at or below B are left as they are."""
    if batch.two_tower:
      return self.norms_and_clipped_grad(batch, tau_local, clip_norm)[1]
    return ghost_blocks(batch, tau_local, clip_norm, 1.0, self.memory_budget, above=clip_norm)[1]


jax.tree_util.register_dataclass(Ghost, data_fields=[], meta_fields=["memory_budget"])


def _loop(num: int, body, carry):
  """body(i, carry) for i < num: a fori_loop, or one direct call when num == 1."""
  if num == 1:
    return body(0, carry)
  return jax.lax.fori_loop(0, num, body, carry)


def _block_sizes(batch: pair_batch.PairBatch, memory_budget: int | None) -> tuple[int, int, bool]:
  """(r, c, single): the rows and columns of the pair blocks (`chunking.ghost_block_sizes`), and
  whether one block on one device holds every pair."""
  n_local, k = rows_lib.num_rows(batch.x), batch.c.size()
  budget = chunking.default_memory_budget() if memory_budget is None else memory_budget
  leaves = jax.tree_util.tree_leaves(batch.params)
  r, c = chunking.ghost_block_sizes(
      n_local, k, chunking.factor_bytes_per_example(batch.plan, batch.embedding_dim, leaves),
      budget, batch.microbatch_size or 1)
  return r, c, r >= n_local and c >= n_local and k == 1


def ghost_blocks(batch: pair_batch.PairBatch, tau_local, clip_norm, allowance: float,
                 memory_budget: int | None, with_grads: bool = True,
                 above=0.0) -> tuple[jax.Array, Any]:
  """Exact pair norms and ḡ of "ghost" in blocks of r rows × c columns
  (`chunking.ghost_block_sizes`).

  For each row block the rows' factors f_u are computed once; for each column block of this
  device's x_prime its factors f_v are computed (again for every row block) and passed around
  the ring of devices (`collective.Collective.ring_shift`, k steps: it comes home last), so
  that every device pairs its rows with every column. Per block: the norms
  (`block_norms`; the positive pairs, when the block holds them, and the pairs the float
  allowance flags formed as vectors, `pair_terms.refine_gram_pairs`, those at or below
  `above` left as they are), λ_ij = τ_ij·min(1, B/‖g_ij‖), and the
  cotangents c_i += Σ_j λ_ij v̂_j (of the rows) and c'_j += Σ_i λ_ij û_i (travelling with the
  column block). ḡ = Σ_i J_iᵀc_i + Σ_j J'_jᵀc'_j is contracted from f_u after its row block
  and from f_v when it comes home (per row block: ḡ is linear in the cotangents). One block on
  one device (the whole batch's factors fit the budget) takes the shorter route of `_one_block`.

  Returns (norms (n_local, n), ḡ psum-ed over devices, or None without with_grads).
  """
  col = batch.c
  n_local, d = batch.u_loc.shape
  k = col.size()
  r, c, single = _block_sizes(batch, memory_budget)
  per_row_block = r // c
  num_row_blocks, num_column_blocks = -(-n_local // r), -(-n_local // c)
  # One block: the user's microbatches; blocks: at most a column block at a time.
  chunk = batch.microbatch_size if single else min(batch.microbatch_size or c, c)
  if single and batch.views_stack:
    return _one_block(batch, tau_local, clip_norm, allowance, chunk, with_grads, above)

  def pad(tree, size):  # inputs may be pytrees (e.g. with per-example keys)
    def pad_leaf(a):
      extra = size - a.shape[0]
      return jnp.concatenate([a, jnp.zeros((extra,) + a.shape[1:], a.dtype)]) if extra else a

    return jax.tree_util.tree_map(pad_leaf, tree)

  def rows_of(tree, start, size):
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size), tree)

  n_rows, n_columns = num_row_blocks * r, num_column_blocks * c
  x, u = pad(batch.x, n_rows), pad(batch.u_loc, n_rows)
  x_prime, v_local = pad(batch.x_prime, n_columns), pad(batch.v_loc, n_columns)
  gram_error = allowance * numerics.gram_error(batch.norm_dtype)
  vector_error = numerics.vector_error(batch.norm_dtype)
  tau = tau_local.reshape(n_local, k, n_local)  # columns: (device, local example)
  tau = jnp.pad(tau, ((0, n_rows - n_local), (0, 0), (0, n_columns - n_local)))
  me = col.index()
  zero_grads = col.varying(jax.tree_util.tree_map(jnp.zeros_like, batch.params))

  def row_block(a, carry):
    norms, grads = carry
    x_rows = rows_of(x, a * r, r)
    f_u = batch.factors(x_rows, chunk=chunk)
    u_rows = jax.lax.dynamic_slice_in_dim(u, a * r, r)
    tau_rows = jax.lax.dynamic_slice_in_dim(tau, a * r, r)

    def column_block(b, carry):
      norms_rows, cot_u, grads = carry
      start = b * c
      x_columns = rows_of(x_prime, start, c)
      f_v = batch.factors(x_columns, chunk=chunk)
      v_columns = jax.lax.dynamic_slice_in_dim(v_local, start, c)
      home = b // per_row_block == a  # its examples are rows start - a·r ... of this row block

      def ring_step(s, carry):
        norms_rows, cot_u, (f_v, v_columns, x_columns, cot_v) = carry
        owner = (me - s) % k  # the device whose columns are passing
        block, computed = block_norms(f_u, u_rows, f_v, v_columns, gram_error)
        at_home = home & (s == 0)
        positives = at_home & (jnp.arange(r)[:, None] == start - a * r + jnp.arange(c)[None, :])
        real = ((a * r + jnp.arange(r) < n_local)[:, None] &
                (start + jnp.arange(c) < n_local)[None, :])
        block = pair_terms.refine_gram_pairs(batch, block, computed, f_u, u_rows, f_v, v_columns,
                                             x_rows, x_columns, allowance, vector_error, real=real,
                                             positives=positives, above=above)
        norms_rows = jax.lax.dynamic_update_slice(norms_rows, block[:, None, :], (0, owner, start))
        if with_grads:
          tau_block = jax.lax.dynamic_slice(tau_rows, (0, owner, start), (r, 1, c))[:, 0, :]
          lam = tau_block * numerics.clip_factor(block, clip_norm)
          cot_u = cot_u + jnp.matmul(lam, v_columns, precision=numerics.HIGHEST)
          cot_v = cot_v + jnp.matmul(lam.T, u_rows, precision=numerics.HIGHEST)
        return norms_rows, cot_u, col.ring_shift((f_v, v_columns, x_columns, cot_v))

      travelling = col.varying((f_v, v_columns, x_columns, jnp.zeros((c, d), u.dtype)))
      norms_rows, cot_u, (f_v, _, _, cot_v) = _loop(k, ring_step, (norms_rows, cot_u, travelling))
      if with_grads:  # home again, with Σ_i λ_ij û_i over every device's rows of this row block
        grads = jax.tree_util.tree_map(jnp.add, grads, batch.factor_backward(f_v, cot_v))
      return norms_rows, cot_u, grads

    norms_rows = col.varying(jnp.zeros((r, k, n_columns), u.dtype))
    cot_u = col.varying(jnp.zeros((r, d), u.dtype))
    norms_rows, cot_u, grads = _loop(num_column_blocks, column_block, (norms_rows, cot_u, grads))
    if with_grads:
      grads = jax.tree_util.tree_map(jnp.add, grads, batch.factor_backward(f_u, cot_u))
    return jax.lax.dynamic_update_slice_in_dim(norms, norms_rows, a * r, axis=0), grads

  norms = col.varying(jnp.zeros((n_rows, k, n_columns), u.dtype))
  norms, grads = _loop(num_row_blocks, row_block, (norms, zero_grads))
  norms = norms[:n_local, :, :n_local].reshape(n_local, k * n_local)
  return norms, (col.psum(grads) if with_grads else None)


def _one_block(batch: pair_batch.PairBatch, tau, clip_norm, allowance: float, chunk: int | None,
               with_grads: bool, above) -> tuple[jax.Array, Any]:
  """`ghost_blocks` when one block holds every pair of one device's batch and both views stack
  (`pair_batch.PairBatch.views_stack`): the factors of both views come from one pass over their 2n
  examples (`pair_batch.PairBatch.stacked_factors`), and ḡ = Σ_i J_iᵀc_i + Σ_j J'_jᵀc'_j with
  c_i = Σ_j λ_ij v̂_j and c'_j = Σ_i λ_ij û_i from one contraction of them (each compiled
  once). They are the batch's `joint_factors`, whose pass gave its embeddings
  (`Ghost.embeds_with_factors`), when the batch was built so."""
  factors = batch.joint_factors
  if factors is None:
    factors = batch.stacked_factors((batch.x, batch.x_prime), chunk)
  f_u, f_v = (jax.tree_util.tree_map(lambda a, view=view: a[view], factors) for view in (0, 1))
  u, v = batch.u_loc, batch.v_loc
  n = u.shape[0]
  norms, computed = block_norms(f_u, u, f_v, v, allowance * numerics.gram_error(batch.norm_dtype))
  norms = pair_terms.refine_gram_pairs(batch, norms, computed, f_u, u, f_v, v, batch.x,
                                       batch.x_prime, allowance,
                                       numerics.vector_error(batch.norm_dtype),
                                       positives=jnp.eye(n, dtype=bool), above=above)
  if not with_grads:
    return norms, None
  lam = tau * numerics.clip_factor(norms, clip_norm)
  cot = jnp.stack([
      jnp.matmul(lam, v, precision=numerics.HIGHEST),
      jnp.matmul(lam.T, u, precision=numerics.HIGHEST)
  ])
  return norms, batch.c.psum(batch.factor_backward(factors, cot, stacked=True))


def block_norms(f_u: layerwise.Factors, u_rows, f_v: layerwise.Factors, v_columns,
                gram_error: float) -> tuple[jax.Array, jax.Array]:
  """(min(√(a + b + 2c + ε_G S_ij²), triangle bound), √max(a + b + 2c, 0)) for the rows of f_u
  and columns of f_v: each pair's clip norm and its computed value without the allowance."""
  anchor, positive, cross = ghost_terms(f_u, u_rows, f_v, v_columns)
  s_rows, s_columns = pair_terms.jacobian_norms(f_u.gram), pair_terms.jacobian_norms(f_v.gram)
  scale = s_rows[:, None] + s_columns[None, :]
  squared, error = anchor + positive + 2.0 * cross, gram_error * scale ** 2
  gram_norms = jnp.sqrt(jnp.maximum(squared, 0.0) + error)
  return (jnp.minimum(gram_norms,
                      pair_terms.triangle_bound(anchor, positive, s_rows, s_columns,
                                                gram_error)), jnp.sqrt(jnp.maximum(squared, 0.0)))


def ghost_terms(f_u: layerwise.Factors, u_rows, f_v: layerwise.Factors,
                v_columns) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(a, b, c) with ‖g_ij‖² = a + b + 2c for the rows i of f_u and the columns j of f_v,
  each (rows, columns): a = v̂_jᵀK_i v̂_j, b = û_iᵀK'_j û_i, c = v̂_jᵀ J_i J'_jᵀ û_i."""
  anchor, positive = pair_terms.quadratic_terms(f_u.gram, f_v.gram, u_rows, v_columns)
  specs = []
  if f_v.flat.shape[-1]:
    specs.append(flat_cross_spec(f_u.flat, u_rows, f_v.flat, v_columns))
  for a_u, delta_u, a_v, delta_v in zip(f_u.ghost_patches, f_u.ghost_deltas, f_v.ghost_patches,
                                        f_v.ghost_deltas):
    specs.append(ghost_layer_cross_spec(a_u, delta_u, u_rows, a_v, delta_v, v_columns))
  cross = chunking.row_chunks_sum(specs) if specs else jnp.zeros_like(anchor)
  return anchor, positive, cross


def flat_cross_spec(flat_rows, u_rows, flat_columns, v) -> tuple:
  """The `row_chunks` arguments of `flat_cross_terms`: rows of n·d² floats for the cross-Gram
  (`layerwise.flat_cross_by_gram`), else of n·(d + `chunking.FLAT_CROSS_MIN_BLOCK`), so that a
  chunk's parameter blocks are at least that wide."""
  n, d, _ = flat_columns.shape
  budget, _ = chunking.backend_chunk_limits(chunking.FLAT_CROSS_CHUNK_FLOATS, None)
  fn = lambda f, u: layerwise.flat_cross(f, u, flat_columns, v, budget)
  if layerwise.flat_cross_by_gram(d):
    return fn, (flat_rows, u_rows), n * d * d, chunking.CROSS_GRAM_CHUNK_FLOATS, None
  return (fn, (flat_rows, u_rows), n *
          (d + chunking.FLAT_CROSS_MIN_BLOCK), chunking.FLAT_CROSS_CHUNK_FLOATS, None)


def flat_cross_terms(flat_rows, u_rows, flat_columns, v) -> jax.Array:
  """`layerwise.flat_cross` for all local rows, in row chunks (`flat_cross_spec`)."""
  return chunking.row_chunks(*flat_cross_spec(flat_rows, u_rows, flat_columns, v))


def ghost_layer_cross_spec(a_rows, deltas_rows, u_rows, a_columns, deltas_columns, v) -> tuple:
  """The `row_chunks` arguments of `ghost_layer_cross_terms`."""
  deltas_rows, deltas_columns = layerwise.ghost_cross_layouts(deltas_rows, deltas_columns)
  d, n, t, c = deltas_columns.shape
  # The loop's inputs flattened to two axes and reshaped inside it: XLA gives a factor with a
  # size-1 axis (the one position of a dense layer) a layout of its own and would copy every
  # such loop input on entry.
  row_shapes = a_rows.shape[1:], deltas_rows.shape[1:]
  a_columns_flat, deltas_columns_flat = a_columns.reshape(n, -1), deltas_columns.reshape(d, -1)

  def fn(a, delta, u):
    a, delta = (b.reshape((b.shape[0],) + shape) for b, shape in zip((a, delta), row_shapes))
    return layerwise.ghost_layer_cross(a, delta, u, a_columns_flat.reshape(a_columns.shape),
                                       deltas_columns_flat.reshape(deltas_columns.shape), v)

  rows = tuple(b.reshape(b.shape[0], -1) for b in (a_rows, deltas_rows)) + (u_rows,)
  row_floats = n * (t * t + 2 * t * c + d)
  return (fn, rows, row_floats, chunking.GHOST_LAYER_CHUNK_FLOATS,
          chunking.ghost_layer_chunk_rows(n))


def ghost_layer_cross_terms(a_rows, deltas_rows, u_rows, a_columns, deltas_columns, v) -> jax.Array:
  """`layerwise.ghost_layer_cross` of one layer for all local rows, in small row chunks."""
  return chunking.row_chunks(
      *ghost_layer_cross_spec(a_rows, deltas_rows, u_rows, a_columns, deltas_columns, v))

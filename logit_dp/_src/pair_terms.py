"""The pair terms the clip methods build their norms from, and their float allowances.

With J_i = ∂û_i/∂w and J'_j = ∂v̂_j/∂w (d×p per-example Jacobians) and g_ij = J_iᵀv̂_j + J'_jᵀû_i,

    ‖g_ij‖² = a + b + 2c,  a = v̂_jᵀK_i v̂_j,  b = û_iᵀK'_j û_i,  c = v̂_jᵀ (J_i J'_jᵀ) û_i,

K_i = J_i J_iᵀ. The per-example Jacobians come as per-layer factors (`layerwise.Factors`);
the cross term c, which only "ghost" forms, is a cross-Gram over the flattened parameters plus
per-layer pair terms of ghost layers (`methods.ghost.ghost_terms`). The triangle
bound √a + √b ≥ ‖g_ij‖ needs only the Grams K_i. Diagonal pairs (x_i, x'_i) are formed as
vectors in float64 and normed directly (`diagonal_norms`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from logit_dp._src import chunking
from logit_dp._src import numerics
from logit_dp._src import rows as rows_lib
from logit_dp._src import widened

if TYPE_CHECKING:
  from logit_dp._src import pair_batch


def quadratic_terms(k_local, k_prime, u_local, v) -> tuple[jax.Array, jax.Array]:
  """v̂_jᵀK_i v̂_j and û_iᵀK'_j û_i for local rows i and all columns j."""
  anchor = jnp.einsum("ikl,jk,jl->ij", k_local, v, v, precision=numerics.HIGHEST)
  positive = jnp.einsum("jkl,ik,il->ij", k_prime, u_local, u_local, precision=numerics.HIGHEST)
  return anchor, positive


def jacobian_norms(gram: jax.Array) -> jax.Array:
  """‖J_e‖_F = √tr(J_e J_eᵀ) per example, from the (m, d, d) per-example Grams."""
  m, d, _ = gram.shape
  diagonal = gram.reshape(m, d * d)[:, ::d + 1]  # a strided slice: no mask over the d² entries
  return jnp.sqrt(jnp.maximum(jnp.sum(diagonal, axis=-1), 0.0))


def triangle_bound(anchor, positive, s_local, s_all, gram_error: float) -> jax.Array:
  """√(a + ε_G s_i²) + √(b + ε_G s'_j²) ≥ ‖J_iᵀv̂_j‖ + ‖J'_jᵀû_i‖ ≥ ‖g_ij‖ in float arithmetic
  (ε_G = gram_error: `numerics.gram_error` of the computation's dtype, or 0 for none)."""
  eps = gram_error
  return (jnp.sqrt(jnp.maximum(anchor, 0.0) + eps * s_local[:, None] ** 2)
          + jnp.sqrt(jnp.maximum(positive, 0.0) + eps * s_all[None, :] ** 2))


def vector_norms(batch: pair_batch.PairBatch, pairs, in_float64: bool) -> tuple[jax.Array, float]:
  """(‖g_e‖, e) of the pairs e of `pairs` (`pair_batch.PairBatch.pairs`), each formed as a
  vector by its own backward pass and normed, and e, the vector allowance per unit of
  s_i + s'_j of the dtype they were computed in (`with_allowance` adds it).

  in_float64: the params and float inputs widened to float64 (`widened.pair_norms`), the norms
  rounded up to the embeddings' dtype, and e that of the lowest precision the computation
  actually ran in (float64 unless the model casts down internally); otherwise the inputs'
  own dtype.
  """
  m = rows_lib.num_rows(pairs)
  chunk = max(1, chunking.vectors_per_block(batch.params, m) // 2)
  # Equal chunks: a remainder would be a second copy of the computation, compiled again.
  chunk = -(-m // -(-m // chunk))
  norms, dtype = widened.pair_norms(batch.pair_grad, batch.params, pairs, batch.u_loc.dtype,
                                    chunk, in_float64=in_float64, native_dtype=batch.norm_dtype)
  return norms, numerics.vector_error(dtype)


def diagonal_norms(batch: pair_batch.PairBatch) -> tuple[jax.Array, float]:
  """(‖g_ii‖ (n_local,), e): the norms of this device's pairs (x_i, x'_i) as `vector_norms`
  forms them, and e, their vector allowance per unit of s_i + s'_i.

  Near-identical views (the usual positive pair) have pair gradients whose halves J_iᵀv̂_i and
  J'_iᵀû_i cancel to a few 1e-6 of ‖J_i‖_F: Gram forms lose them entirely (ghost returned 0
  for true norms of ~3e-3), so they are formed as vectors; in float32 the rounding of the
  forward pass alone moves them by ~1%, and the allowance e·(s_i + s'_i) exceeds them up to
  ~100-fold. So (`batch.float64_positive_pairs`, the default) they are formed in float64;
  otherwise in float32, and those the allowance flags are formed again in float64
  (`diagonal_values`). A stochastic model's pairs stay in its own dtype
  (`pair_batch.PairBatch.pairs_in_float64`), with the allowance e·(s_i + s'_i) on top.
  """
  in_float64 = batch.float64_positive_pairs and batch.pairs_in_float64
  return vector_norms(batch, batch.positive_pairs, in_float64)


def diagonal_values(batch: pair_batch.PairBatch, norms, error: float, scale, allowance: float,
                    pairs, active=True) -> jax.Array:
  """The clip norms of the diagonal pairs `pairs` (c of `pair_batch.PairBatch.pairs`) from
  their `diagonal_norms` (c,): with their allowance (`with_allowance`, scale = s_i + s'_i),
  and, when formed below float64 and the model can be evaluated in float64, those whose
  allowance could put them above `FLAG_RATIO` × their truth formed again in float64
  (`refine_flagged`; `active`, a bool or traced bool: whether the values are used at all)."""
  raised = with_allowance(norms, error, scale, allowance)
  refine = (allowance and batch.pairs_in_float64 and not batch.float64_positive_pairs)
  if not refine:
    return raised
  lower = norms - allowance * error * scale

  def recompute(index):
    chosen = jax.tree_util.tree_map(lambda a: a[index], pairs)
    exact, exact_error = vector_norms(batch, chosen, in_float64=True)
    return with_allowance(exact, exact_error, scale[index], allowance)

  return refine_flagged(raised, lower, recompute, raised.size, active)


# A clip norm more than this many times the lower end of its float error interval is
# "flagged" and formed again as a vector in float64 (`refine_flagged`).
FLAG_RATIO = 1.10
# Flagged pairs formed again per block of pairs, at most (the worst first); the rest keep
# their allowance-raised norms, which are sound (at most this many float64 backward passes of
# one pair each per block, and none where nothing is flagged).
FLAGGED_PAIR_CAPACITY = 32


def refine_flagged(norms: jax.Array, lower: jax.Array, recompute, capacity: int,
                   active=True) -> jax.Array:
  """norms, each an upper bound of its pair's true norm, with the flagged ones tightened:
  those above FLAG_RATIO × lower (a lower bound of the same truth) and finite (a non-finite
  norm drops its pair, and stays so).

  recompute(index) gives sound upper bounds of the pairs at the flat indices `index` (k,) of
  norms; it runs for the k = min(capacity, size) flagged pairs of largest norms/lower ratio,
  and only when some pair is flagged (a `lax.cond`, and `active` true), each keeping the
  smaller of its two bounds. Unflagged norms lie within FLAG_RATIO × their truth.
  """
  flagged = jnp.isfinite(norms) & (norms > FLAG_RATIO * lower)
  shape, size = norms.shape, norms.size
  k = min(capacity, size)

  def tighten(norms):
    flat, flags = norms.reshape(-1), flagged.reshape(-1)
    if k == size:
      index = jnp.arange(size)
    else:
      low = lower.reshape(-1)
      ratio = jnp.where(low > 0, flat / jnp.where(low > 0, low, 1.0), jnp.inf)
      _, index = jax.lax.top_k(jnp.where(flags, ratio, -1.0), k)
    current = flat[index]
    tighter = jnp.where(flags[index], jnp.minimum(current, recompute(index)), current)
    return flat.at[index].set(tighter).reshape(shape)

  return jax.lax.cond(jnp.any(flagged) & active, tighten, lambda norms: norms, norms)


def refine_pairs(batch: pair_batch.PairBatch, norms, lower, x_rows, x_prime_columns, s_rows,
                 s_columns, allowance: float, real=None) -> jax.Array:
  """`refine_flagged` for a block of pairs, rows x_rows × columns x_prime_columns (r, c): the
  flagged pairs (at most FLAGGED_PAIR_CAPACITY) formed as vectors (`vector_norms`) in float64
  (a stochastic model's in its own dtype), with their vector allowance (s: ‖J‖_F of the rows
  and columns). real (r, c), where given: the pairs of real examples (padding is never
  flagged)."""
  if not allowance:
    return norms
  c = norms.shape[1]
  if real is not None:
    lower = jnp.where(real, lower, norms)

  def recompute(index):
    i, j = index // c, index % c
    pairs = batch.pairs(rows_lib.take_row(x_rows, i), rows_lib.take_row(x_prime_columns, j))
    exact, error = vector_norms(batch, pairs, in_float64=batch.pairs_in_float64)
    return with_allowance(exact, error, s_rows[i] + s_columns[j], allowance)

  return refine_flagged(norms, lower, recompute, FLAGGED_PAIR_CAPACITY)


def with_allowance(norms: jax.Array, error: float, scale: jax.Array, allowance: float) -> jax.Array:
  """norms + allowance·error·scale, never below it after rounding (of `diagonal_norms`)."""
  if not allowance:
    return norms
  raised = norms + allowance * error * scale
  fixed = jax.lax.stop_gradient(raised)
  return raised + (jnp.nextafter(fixed, jnp.inf) - fixed)  # one ulp up


def with_diagonal(batch: pair_batch.PairBatch, norms, values, offset, at_home) -> jax.Array:
  """A block's norms (r, c) with each diagonal pair (x_i, x'_i) replaced by its value in
  `values` (c,), the float64 norms of `diagonal_norms` for the block's columns.

  The block's columns are the examples offset..offset+c-1 of its rows when `at_home` (a bool
  or a traced bool); otherwise it holds no diagonal pair and is returned as it is.
  """
  del batch
  if at_home is False:
    return norms
  r, c = norms.shape
  on_diagonal = jnp.arange(r)[:, None] == offset + jnp.arange(c)[None, :]
  return jnp.where(on_diagonal & at_home, values[None, :], norms)

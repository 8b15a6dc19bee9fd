"""The pair terms the clip methods build their norms from, and their float allowances.

With J_i = ∂û_i/∂w and J'_j = ∂v̂_j/∂w (d×p per-example Jacobians) and g_ij = J_iᵀv̂_j + J'_jᵀû_i,

    ‖g_ij‖² = a + b + 2c,  a = v̂_jᵀK_i v̂_j,  b = û_iᵀK'_j û_i,  c = v̂_jᵀ (J_i J'_jᵀ) û_i,

K_i = J_i J_iᵀ. The per-example Jacobians come as per-layer factors (`layerwise.Factors`);
the cross term c, which only "ghost" forms, is a sum over the flattened parameters plus
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


def vector_norms(batch: pair_batch.PairBatch, pairs, in_float64: bool,
                 params=None) -> tuple[jax.Array, float]:
  """(‖g_e‖, e) of the pairs e of `pairs` (`pair_batch.PairBatch.pairs`), each formed as a
  vector by its own backward pass and normed, and e, the vector allowance per unit of
  s_i + s'_j of the dtype they were computed in (`with_allowance` adds it).

  in_float64: the params and float inputs widened to float64 (`widened.pair_norms`), the norms
  rounded up to the embeddings' dtype, and e that of the lowest precision the computation
  actually ran in (float64 unless the model casts down internally); otherwise the inputs'
  own dtype. params: those of the pair gradients (None: batch.params).
  """
  params = batch.params if params is None else params
  m = rows_lib.num_rows(pairs)
  chunk = max(1, chunking.vectors_per_block(batch.params, m) // 2)
  # Equal chunks: a remainder would be a second copy of the computation, compiled again.
  chunk = -(-m // -(-m // chunk))
  norms, dtype = widened.pair_norms(batch.pair_grad, params, pairs, batch.u_loc.dtype, chunk,
                                    in_float64=in_float64, native_dtype=batch.norm_dtype)
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


def factor_positive_norms(f_u, u, f_v, v) -> jax.Array:
  """‖J_iᵀv̂_i + J'_iᵀû_i‖ (m,) of the pairs of matching examples of f_u and f_v (m each),
  formed as vectors from the Jacobian factors (`layerwise.Factors`): flattened layers
  flat_iᵀv̂_i + flat'_iᵀû_i; a ghost layer's weights (its patches' columns × features)
  Σ_t a_t ⊗ (Σ_k v̂_ik δ_t^k) over the positions of both examples. No pass through the model;
  the vector allowance (`numerics.vector_error`) of the factors' dtype covers its rounding."""
  flat = (jnp.einsum("mdq,md->mq", f_u.flat, v, precision=numerics.HIGHEST)
          + jnp.einsum("mdq,md->mq", f_v.flat, u, precision=numerics.HIGHEST))
  squared = jnp.sum(flat * flat, axis=-1)
  for a_u, delta_u, a_v, delta_v in zip(f_u.ghost_patches, f_u.ghost_deltas, f_v.ghost_patches,
                                        f_v.ghost_deltas):
    patches = jnp.concatenate([a_u, a_v], axis=1)  # (m, 2T, P)
    weighted = jnp.concatenate([
        jnp.einsum("mtkc,mk->mtc", delta_u, v, precision=numerics.HIGHEST),
        jnp.einsum("mtkc,mk->mtc", delta_v, u, precision=numerics.HIGHEST)
    ], axis=1)  # (m, 2T, C)
    weights = jnp.einsum("mtp,mtc->mpc", patches, weighted, precision=numerics.HIGHEST)
    squared = squared + jnp.sum(weights * weights, axis=(1, 2))
  return jnp.sqrt(squared)


def diagonal_values(batch: pair_batch.PairBatch, norms, error: float, scale, allowance: float,
                    pairs) -> jax.Array:
  """The clip norms of the diagonal pairs `pairs` (c of `pair_batch.PairBatch.pairs`) from
  their norms (c,) formed as vectors (`diagonal_norms`): with their allowance
  (`with_allowance`, error per unit of scale = s_i + s'_i), and, where they were formed below
  float64 (`float64_positive_pairs=False`) and the model can be evaluated in float64, those
  whose allowance could put them above `FLAG_RATIO` × their truth formed again in float64
  (`refine_flagged`)."""
  raised = with_allowance(norms, error, scale, allowance)
  if not (allowance and not batch.float64_positive_pairs and batch.pairs_in_float64):
    return raised
  lower = norms - allowance * error * scale

  def recompute(operands, index):
    params, pairs, scale = operands
    chosen = jax.tree_util.tree_map(lambda a: a[index], pairs)
    exact, exact_error = vector_norms(batch, chosen, in_float64=True, params=params)
    return with_allowance(exact, exact_error, scale[index], allowance)

  return refine_flagged(raised, lower, recompute, (batch.params, pairs, scale), raised.size)


# A clip norm more than this many times the lower end of its float error interval is
# "flagged" and formed again as a vector in float64 (`refine_flagged`).
FLAG_RATIO = 1.10
# Flagged pairs formed again per pass of the loop of `refine_flagged` (one float64 backward
# pass of one pair each).
FLAGGED_PAIRS_PER_PASS = 32


def refine_flagged(norms: jax.Array, lower: jax.Array, recompute, operands,
                   per_pass: int | None = None, ratio: float = FLAG_RATIO, forced=None,
                   above=0.0) -> jax.Array:
  """norms, each an upper bound of its pair's true norm, with every flagged one tightened:
  those above ratio × lower (by default FLAG_RATIO × the lower end of the same computation's
  float error interval) or `forced` (a bool mask of norms's shape, or None), finite (a
  non-finite norm drops its pair, and stays so) and, where `above` > 0, above it (a clip norm
  B: a norm at or below B gives its pair the clip factor 1 whatever its exact value, so it is
  final; at 0 a computed norm of 0 is tightened too).

  recompute(operands, index) gives sound upper bounds of the pairs at the flat indices
  `index` (k,) of norms from `operands` (a pytree: everything it reads that is traced); it
  runs on the flagged pairs, `per_pass` at a time (default FLAGGED_PAIRS_PER_PASS, at most
  the number of pairs), in a loop that runs only while flagged pairs remain (nothing
  at all where none is flagged), and each flagged pair keeps the smaller of its two bounds,
  each forced one its recomputed value (without a float allowance its norm is a computed value,
  not a bound). Every pair's norm is a function of that pair alone (the
  sensitivity needs it: no capacity decides which pairs are tightened), and each unflagged
  norm lies within FLAG_RATIO × lower. The recomputed values are constants to
  differentiation (the operands enter the loop, whose length depends on the values, through
  `lax.stop_gradient`).
  """
  flagged = norms > ratio * lower
  if forced is not None:
    flagged = flagged | forced
  flagged = flagged & jnp.isfinite(norms) & ((norms > above) | (above <= 0))
  replaced = (jnp.zeros(norms.shape, bool) if forced is None else forced & flagged).reshape(-1)
  shape, size = norms.shape, norms.size
  k = min(per_pass or FLAGGED_PAIRS_PER_PASS, size)
  num_passes = -(-size // k)

  constants = jax.tree_util.tree_map(
      lambda a: jax.lax.stop_gradient(a) if jnp.issubdtype(a.dtype, jnp.inexact) else a, operands)

  def tighten(norms):
    flat, flags = norms.reshape(-1), flagged.reshape(-1)
    count = jnp.sum(flags)
    index = jnp.nonzero(flags, size=num_passes * k, fill_value=0)[0]  # the flagged first

    def one_pass(carry):
      i, tight = carry
      chunk = jax.lax.dynamic_slice_in_dim(index, i * k, k)
      real = i * k + jnp.arange(k) < count
      values = jnp.where(real, recompute(constants, chunk), jnp.inf)
      return i + 1, tight.at[chunk].min(values)

    start = (0, jnp.where(replaced, jnp.inf, jax.lax.stop_gradient(flat)))
    if num_passes == 1:
      _, tight = one_pass(start)
    else:
      _, tight = jax.lax.while_loop(lambda carry: carry[0] * k < count, one_pass, start)
    # Each flagged norm becomes the smaller of its two bounds, a forced one its recomputed value.
    return jnp.where(flags & (tight < flat) | replaced, tight, flat).reshape(shape)

  return jax.lax.cond(jnp.any(flagged), tighten, lambda norms: norms, norms)


# A Gram-form norm √(a + b + 2c + ε_G S_ij²) more than this many times its computed value
# √max(a + b + 2c, 0) (the allowance's share of it) is flagged (`refine_gram_pairs`). With the
# float32 error below a fifth of the allowance (measured: 1/44), an unflagged norm is within
# 1.10× its truth.
GRAM_FLAG_RATIO = 1.09


def pairs_per_pass(factors) -> int:
  """Pairs whose gathered factors (`layerwise.Factors` of one example per side) hold about
  `chunking.PAIR_BLOCK_FLOATS` floats, between 1 and 1,024."""
  per_example = sum(leaf[0].size for leaf in jax.tree_util.tree_leaves(factors))
  return int(max(1, min(1024, chunking.PAIR_BLOCK_FLOATS // max(2 * per_example, 1))))


def refine_gram_pairs(batch: pair_batch.PairBatch, norms, computed, f_rows, u_rows, f_columns,
                      v_columns, x_rows, x_prime_columns, allowance: float, vector_error: float,
                      real=None, positives=None, above=0.0) -> jax.Array:
  """`refine_flagged` for a block of Gram-form norms (rows of f_rows × columns of f_columns,
  their Jacobian factors, r and c examples): the pairs above GRAM_FLAG_RATIO × their computed
  value, and the positive pairs (x_i, x'_i) whatever their value (their halves cancel, so
  Gram forms lose them), formed as vectors from their factors (`factor_positive_norms`, the
  vector allowance e = vector_error); of those, the ones still flagged (above FLAG_RATIO × the
  lower end v − e·S_ij) formed again in float64 from their inputs (x_rows, x_prime_columns;
  `vector_norms`). Near-identical views and near-duplicate records go all the way; ordinary
  pairs whose Gram allowance bites stop at the vectors, a few multiply-adds per parameter.

  real (r, c), where given: the pairs of real examples (padding is never flagged); positives
  (r, c): where the block holds the positive pairs (None: nowhere), formed as vectors without
  an allowance too (allowance 0: the computed values, the positives' in float64); above: as
  in `refine_flagged` (0: every flagged pair is tightened; B: only those whose clip factor it
  can change).
  """
  if not allowance and positives is None:
    return norms
  c = norms.shape[1]
  if real is not None:
    computed = jnp.where(real, computed, norms)
    positives = None if positives is None else positives & real
  take = lambda tree, index: jax.tree_util.tree_map(lambda a: a[index], tree)

  def recompute(operands, index):
    params, f_rows, u_rows, f_columns, v_columns, x_rows, x_prime_columns = operands
    i, j = index // c, index % c
    f_i, f_j = take(f_rows, i), take(f_columns, j)
    scale = jacobian_norms(f_i.gram) + jacobian_norms(f_j.gram)
    vectors = factor_positive_norms(f_i, u_rows[i], f_j, v_columns[j])

    def exact(inputs, sub):
      params, x_rows, x_prime_columns, scale = inputs
      pairs = batch.pairs(rows_lib.take_row(x_rows, i[sub]),
                          rows_lib.take_row(x_prime_columns, j[sub]))
      values, error = vector_norms(batch, pairs, in_float64=batch.pairs_in_float64, params=params)
      return with_allowance(values, error, scale[sub], allowance)

    # Without an allowance nothing is flagged by its size: the positives, which float32 loses
    # to cancellation, are formed in float64 (the computed values are then the truth's).
    return refine_flagged(with_allowance(vectors, vector_error, scale,
                                         allowance), vectors - allowance * vector_error * scale,
                          exact, (params, x_rows, x_prime_columns, scale),
                          min(FLAGGED_PAIRS_PER_PASS, index.size), above=above,
                          forced=None if allowance else jnp.ones(index.shape, bool))

  return refine_flagged(
      norms, computed, recompute,
      (batch.params, f_rows, u_rows, f_columns, v_columns, x_rows, x_prime_columns),
      pairs_per_pass(f_rows), ratio=GRAM_FLAG_RATIO, forced=positives, above=above)


def refine_pairs(batch: pair_batch.PairBatch, norms, lower, x_rows, x_prime_columns, s_rows,
                 s_columns, allowance: float, real=None, ratio: float = FLAG_RATIO,
                 forced=None) -> jax.Array:
  """`refine_flagged` for a block of pairs, rows x_rows × columns x_prime_columns (r, c): the
  flagged pairs formed as vectors (`vector_norms`) in float64
  (a stochastic model's in its own dtype), with their vector allowance (s: ‖J‖_F of the rows
  and columns). real (r, c), where given: the pairs of real examples (padding is never
  flagged); ratio, forced: as in `refine_flagged` (forced: e.g. the positive pairs, formed
  as vectors whatever their value by the same compiled computation)."""
  if not allowance and forced is None:
    return norms
  c = norms.shape[1]
  if real is not None:
    lower = jnp.where(real, lower, norms)

  def recompute(operands, index):
    params, x_rows, x_prime_columns, s_rows, s_columns = operands
    i, j = index // c, index % c
    pairs = batch.pairs(rows_lib.take_row(x_rows, i), rows_lib.take_row(x_prime_columns, j))
    exact, error = vector_norms(batch, pairs, in_float64=batch.pairs_in_float64, params=params)
    return with_allowance(exact, error, s_rows[i] + s_columns[j], allowance)

  return refine_flagged(norms, lower, recompute,
                        (batch.params, x_rows, x_prime_columns, s_rows, s_columns), ratio=ratio,
                        forced=forced)


def with_allowance(norms: jax.Array, error: float, scale: jax.Array, allowance: float) -> jax.Array:
  """norms + allowance·error·scale, never below it after rounding (of `diagonal_norms`)."""
  if not allowance:
    return norms
  raised = norms + allowance * error * scale
  fixed = jax.lax.stop_gradient(raised)
  return raised + (jnp.nextafter(fixed, jnp.inf) - fixed)  # one ulp up

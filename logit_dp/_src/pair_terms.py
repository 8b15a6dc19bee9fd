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
from logit_dp._src import stochastic
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


def diagonal_norms(batch: pair_batch.PairBatch) -> tuple[jax.Array, float]:
  """(‖g_ii‖ (n_local,), e): the norms of this device's pairs (x_i, x'_i), each formed as a
  vector by its own backward pass of the model and normed, and e, the vector allowance per
  unit of s_i + s'_i of the dtype they were computed in (`with_allowance` adds it).

  Near-identical views (the usual positive pair) have pair gradients whose halves J_iᵀv̂_i and
  J'_iᵀû_i cancel to a few 1e-6 of ‖J_i‖_F: Gram forms lose them entirely (ghost returned 0
  for true norms of ~3e-3), so they are formed as vectors. In float32 the rounding of the
  forward pass alone moves them by ~1% and the allowance in terms of ‖J_i‖_F can double them.
  So (`batch.float64_positive_pairs`, the default) the params and float inputs are widened to
  float64 (`widened.pair_norms`), the norms rounded up to the embeddings' dtype, and e is that
  of the lowest precision the computation actually ran in (float64 unless the model casts down
  internally). A stochastic model's pairs stay in its own dtype: evaluated in float64, its
  random draws (dropout masks) would not be those of the rest of the computation.
  """
  m = rows_lib.num_rows(batch.x)
  chunk = max(1, chunking.vectors_per_block(batch.params, m) // 2)
  # Equal chunks: a remainder would be a second copy of the computation, compiled again.
  chunk = -(-m // -(-m // chunk))
  norms, dtype = widened.pair_norms(
      batch.pair_grad, batch.params, batch.positive_pairs, batch.u_loc.dtype, chunk,
      in_float64=batch.float64_positive_pairs
      and not stochastic.is_stochastic(batch.embed_fn, batch.positive_embed_fn),
      native_dtype=batch.norm_dtype)
  return norms, numerics.vector_error(dtype)


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

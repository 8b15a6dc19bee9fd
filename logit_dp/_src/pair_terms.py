"""The pair terms the clip methods build their norms from, and their float32 allowances.

With J_i = ∂û_i/∂w and J'_j = ∂v̂_j/∂w (d×p per-example Jacobians) and g_ij = J_iᵀv̂_j + J'_jᵀû_i,

    ‖g_ij‖² = a + b + 2c,  a = v̂_jᵀK_i v̂_j,  b = û_iᵀK'_j û_i,  c = v̂_jᵀ (J_i J'_jᵀ) û_i,

K_i = J_i J_iᵀ. The per-example Jacobians come as per-layer factors (`layerwise.Factors`);
the cross term c is a cross-Gram over the flattened parameters plus per-layer pair terms of
ghost layers (`chunking.flat_cross_terms`, `chunking.ghost_layer_cross_terms`). The triangle
bound √a + √b ≥ ‖g_ij‖ needs only the Grams K_i. Diagonal pairs (x_i, x'_i) are formed as
vectors and normed directly (`diagonal_norms`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from logit_dp._src import chunking
from logit_dp._src import layerwise
from logit_dp._src import numerics

if TYPE_CHECKING:
  from logit_dp._src import pair_batch


def quadratic_terms(k_local, k_prime, u_local, v) -> tuple[jax.Array, jax.Array]:
  """v̂_jᵀK_i v̂_j and û_iᵀK'_j û_i for local rows i and all columns j."""
  anchor = jnp.einsum("ikl,jk,jl->ij", k_local, v, v, precision=numerics.HIGHEST)
  positive = jnp.einsum("jkl,ik,il->ij", k_prime, u_local, u_local, precision=numerics.HIGHEST)
  return anchor, positive


def ghost_terms(f_u: layerwise.Factors, u_rows, f_v: layerwise.Factors,
                v_columns) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(a, b, c) with ‖g_ij‖² = a + b + 2c for the rows i of f_u and the columns j of f_v,
  each (rows, columns): a = v̂_jᵀK_i v̂_j, b = û_iᵀK'_j û_i, c = v̂_jᵀ J_i J'_jᵀ û_i."""
  anchor, positive = quadratic_terms(f_u.gram, f_v.gram, u_rows, v_columns)
  specs = []
  if f_v.flat.shape[-1]:
    specs.append(chunking.flat_cross_spec(f_u.flat, u_rows, f_v.flat, v_columns))
  for a_u, delta_u, a_v, delta_v in zip(f_u.ghost_patches, f_u.ghost_deltas, f_v.ghost_patches,
                                        f_v.ghost_deltas):
    specs.append(chunking.ghost_layer_cross_spec(a_u, delta_u, u_rows, a_v, delta_v, v_columns))
  cross = jnp.zeros_like(anchor)
  for term in chunking.row_chunks_together(specs) if specs else ():
    cross += term
  return anchor, positive, cross


def jacobian_norms(gram: jax.Array) -> jax.Array:
  """‖J_e‖_F = √tr(J_e J_eᵀ) per example, from the (m, d, d) per-example Grams."""
  return jnp.sqrt(jnp.maximum(jnp.trace(gram, axis1=1, axis2=2), 0.0))


def triangle_bound(anchor, positive, s_local, s_all, allowance: float) -> jax.Array:
  """√(a + ε_G s_i²) + √(b + ε_G s'_j²) ≥ ‖J_iᵀv̂_j‖ + ‖J'_jᵀû_i‖ ≥ ‖g_ij‖ in float32
  (ε_G = allowance·numerics.GRAM_FLOAT_ERROR)."""
  eps = allowance * numerics.GRAM_FLOAT_ERROR
  return (jnp.sqrt(jnp.maximum(anchor, 0.0) + eps * s_local[:, None] ** 2)
          + jnp.sqrt(jnp.maximum(positive, 0.0) + eps * s_all[None, :] ** 2))


def diagonal_norms(batch: pair_batch.PairBatch, f_u: layerwise.Factors, f_v: layerwise.Factors, u,
                   v, allowance: float) -> jax.Array:
  """‖g_ii‖ of the pairs (x_i, x'_i) whose two views' factors are f_u, f_v, from their vectors
  (`layerwise.diagonal_sq_norms`), plus the vector allowance allowance·numerics.VECTOR_FLOAT_ERROR·
  (s_i + s'_i)."""
  m = u.shape[0]
  chunk = chunking.vectors_per_block(batch.params, m)
  # Equal chunks: a remainder would be a second copy of the computation, compiled again.
  chunk = -(-m // -(-m // chunk))
  sq = layerwise.diagonal_sq_norms(batch.plan, f_u, f_v, u, v, chunk)
  scale = jacobian_norms(f_u.gram) + jacobian_norms(f_v.gram)
  return jnp.sqrt(jnp.maximum(sq, 0.0)) + allowance * numerics.VECTOR_FLOAT_ERROR * scale


def with_diagonal(batch: pair_batch.PairBatch, norms, f_u: layerwise.Factors,
                  f_v: layerwise.Factors, u_rows, v_columns, offset, at_home,
                  allowance: float) -> jax.Array:
  """A block's norms (r, c) with each diagonal pair (x_i, x'_i) replaced by its vector-form norm.

  The block's columns are the examples offset..offset+c-1 of its rows when `at_home` (a bool
  or a traced bool); otherwise it holds no diagonal pair and is returned as it is.
  Positive pairs of near-identical views have small pair gradients whose two halves
  J_iᵀv̂_i and J'_iᵀû_i nearly cancel: Gram forms lose them in float32 (ghost returned 0
  for true norms of ~3e-3; triangle over-estimates them up to 60×). They are only n
  vectors, so they are formed and normed directly (`diagonal_norms`).
  """
  if at_home is False:
    return norms
  r, c = norms.shape

  def diagonal():
    rows = lambda a: jax.lax.dynamic_slice_in_dim(a, offset, c, axis=0)
    return diagonal_norms(batch, jax.tree_util.tree_map(rows, f_u), f_v, rows(u_rows), v_columns,
                          allowance)

  if at_home is True:
    values = diagonal()
  else:
    values = jax.lax.cond(at_home, diagonal, lambda: batch.c.varying(jnp.zeros((c,), norms.dtype)))
  on_diagonal = jnp.arange(r)[:, None] == offset + jnp.arange(c)[None, :]
  return jnp.where(on_diagonal & at_home, values[None, :], norms)


def block_norms(f_u: layerwise.Factors, u_rows, f_v: layerwise.Factors, v_columns,
                allowance: float) -> jax.Array:
  """min(√(a + b + 2c + ε_G S_ij²), triangle bound) for the rows of f_u and columns of f_v."""
  anchor, positive, cross = ghost_terms(f_u, u_rows, f_v, v_columns)
  s_rows, s_columns = jacobian_norms(f_u.gram), jacobian_norms(f_v.gram)
  scale = s_rows[:, None] + s_columns[None, :]
  gram_norms = jnp.sqrt(
      jnp.maximum(anchor + positive + 2.0 * cross, 0.0)
      + allowance * numerics.GRAM_FLOAT_ERROR * scale ** 2)
  return jnp.minimum(gram_norms, triangle_bound(anchor, positive, s_rows, s_columns, allowance))

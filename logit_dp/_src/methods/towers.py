"""Pair norms of two-tower (dual-encoder) models, for "ghost" and "triangle".

With S the parameters both towers share (`two_tower.tower_plans`):

* S = ∅ (disjoint towers): ‖g_ij‖² = a + b exactly, from the per-example Grams alone,
  i.e. at the cost of "triangle"; "ghost" and "triangle" both use it.
* S ≠ ∅: "ghost" adds the cross-Gram over the columns of S only
  (`chunking.flat_cross_terms`), "triangle" keeps its bound √a + √b.

Diagonal pairs are formed as vectors, as with one tower: the towers' own parts
J_iᵀv̂_i|_{not S} and J'_iᵀû_i|_{not S} separately, and the S part as one sum, then normed,
so no Gram form loses a small positive-pair norm to cancellation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from logit_dp._src import chunking
from logit_dp._src import layerwise
from logit_dp._src import numerics
from logit_dp._src import pair_terms
from logit_dp._src import rows as rows_lib
from logit_dp._src import two_tower


def _transpose_vector(factors: layerwise.Factors, cotangent):
  """(Jᵀc over the flat columns (q,), ‖Jᵀc‖² over the ghost layers) of one example."""
  flat = jnp.matmul(cotangent, factors.flat, precision=numerics.HIGHEST)
  ghost_sq = jnp.zeros((), flat.dtype)
  for patches, deltas in zip(factors.ghost_patches, factors.ghost_deltas):
    weighted = jnp.einsum("tkc,k->tc", deltas, cotangent, precision=numerics.HIGHEST)
    grad = jnp.matmul(patches.T, weighted, precision=numerics.HIGHEST)
    ghost_sq = ghost_sq + jnp.sum(grad * grad)
  return flat, ghost_sq


def diagonal_sq_norms(f_u: layerwise.Factors, f_v: layerwise.Factors, u, v, cols_u, cols_v,
                      chunk: int) -> jax.Array:
  """‖J_iᵀv̂_i + J'_iᵀû_i‖² of the pairs (x_i, x'_i) from vectors: (m,).

  = ‖J_iᵀv̂_i off S‖² + ‖J'_iᵀû_i off S‖² + ‖(J_iᵀv̂_i + J'_iᵀû_i) on S‖², S the shared
  columns (cols_u of the anchor's flat Jacobian, cols_v of the positive's).
  """
  own_u = np.setdiff1d(np.arange(f_u.flat.shape[-1]), cols_u)
  own_v = np.setdiff1d(np.arange(f_v.flat.shape[-1]), cols_v)

  def one(fu, fv, ui, vi):
    wu, ghost_u = _transpose_vector(fu, vi)
    wv, ghost_v = _transpose_vector(fv, ui)
    sq = ghost_u + ghost_v + jnp.sum(wu[own_u] ** 2) + jnp.sum(wv[own_v] ** 2)
    if cols_u.size:
      sq = sq + jnp.sum((wu[cols_u] + wv[cols_v]) ** 2)
    return sq

  rows = (f_u._replace(gram=None), f_v._replace(gram=None), u, v)
  return jax.lax.map(lambda r: one(*r), rows, batch_size=max(1, int(chunk)))


def pair_norms(batch, cross_terms: bool,
               allowance: float = 1.0) -> tuple[jax.Array, tuple[layerwise.Factors, ...] | None]:
  """(norms (n_local, n), factors or None) for clipping the pair gradients of two towers.

  Off the diagonal, disjoint towers: √(a + b + ε_G S_ij²) (exact up to the float32
  allowance, ε_G = allowance·GRAM_FLOAT_ERROR, S_ij = ‖J_i‖_F + ‖J'_j‖_F); shared
  leaves: with cross_terms ("ghost") min(√(a + b + 2c + ε_G S_ij²), triangle bound), without
  ("triangle") the bound. Diagonal: √‖g_ii‖² from vectors + allowance·VECTOR_FLOAT_ERROR·S_ii.
  factors (of the local rows of both towers) are returned when the cross terms computed them
  (shared leaves), for ḡ from the factors; None means ḡ by backward passes.
  batch: a `pair_batch.PairBatch` (which builds its plans with this module).
  """
  plans, c = batch.tower_plans, batch.c
  cols_u, cols_v = two_tower.shared_columns(plans, batch.params)
  eps_gram = allowance * numerics.GRAM_FLOAT_ERROR
  n_local = rows_lib.num_rows(batch.x)
  diagonal_chunk = chunking.vectors_per_block(batch.params, n_local)
  factors = None
  if cross_terms and plans.shared:
    f_u = batch.factors(batch.x)
    f_v_local = batch.factors(batch.x_prime, positive=True)
    factors = (f_u, f_v_local)
    k_local, k_prime_local = f_u.gram, f_v_local.gram
    diag_sq = diagonal_sq_norms(f_u, f_v_local, batch.u_loc, batch.v_loc, cols_u, cols_v,
                                diagonal_chunk)
    cross = chunking.flat_cross_terms(f_u.flat[..., cols_u], batch.u_loc,
                                      c.gather(f_v_local.flat[..., cols_v]), batch.v)
  else:
    # Grams and diagonal vectors microbatch by microbatch; no factors are kept.
    def chunk_terms(x_chunk, x_prime_chunk, u_chunk, v_chunk):
      f_u = batch.factors(x_chunk, chunked=False)
      f_v = batch.factors(x_prime_chunk, chunked=False, positive=True)
      rows = chunking.vectors_per_block(batch.params, rows_lib.num_rows(x_chunk))
      sq = diagonal_sq_norms(f_u, f_v, u_chunk, v_chunk, cols_u, cols_v, rows)
      return f_u.gram, f_v.gram, sq

    xs = (batch.x, batch.x_prime, batch.u_loc, batch.v_loc)
    k_local, k_prime_local, diag_sq = chunking.map_row_chunks(chunk_terms, xs,
                                                              batch.microbatch_size)
    cross = None
  s_local = pair_terms.jacobian_norms(k_local)
  s_prime_local = pair_terms.jacobian_norms(k_prime_local)
  s_all = c.gather(s_prime_local)
  anchor, positive = pair_terms.quadratic_terms(k_local, c.gather(k_prime_local), batch.u_loc,
                                                batch.v)
  scale_sq = (s_local[:, None] + s_all[None, :]) ** 2
  bound = pair_terms.triangle_bound(anchor, positive, s_local, s_all, allowance)
  if not plans.shared:  # no cross term: exact
    norms = jnp.sqrt(jnp.maximum(anchor, 0.0) + jnp.maximum(positive, 0.0) + eps_gram * scale_sq)
  elif cross is not None:
    norms = jnp.minimum(
        jnp.sqrt(jnp.maximum(anchor + positive + 2.0 * cross, 0.0) + eps_gram * scale_sq), bound)
  else:
    norms = bound
  diagonal = (jnp.sqrt(jnp.maximum(diag_sq, 0.0)) + allowance * numerics.VECTOR_FLOAT_ERROR *
              (s_local + s_prime_local))
  return norms.at[jnp.arange(n_local), batch.rows].set(diagonal), factors

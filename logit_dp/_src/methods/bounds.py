"""Upper bounds of the pair norms from per-example Grams: "triangle", refined by "projected".

"triangle" clips with ‖J_iᵀv̂_j‖ + ‖J'_jᵀû_i‖ ≥ ‖g_ij‖, which only needs the per-example
Grams K_i: clipping by a larger norm is still private (each term has norm ≤ B), just less
accurate. "projected" tightens it on the subspace spanned by the Jacobians of public reference
inputs (`projection.bound`). Both form the diagonal pairs from their vectors.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from logit_dp._src import chunking
from logit_dp._src import layerwise
from logit_dp._src import numerics
from logit_dp._src import pair_batch
from logit_dp._src import pair_terms
from logit_dp._src import projection
from logit_dp._src import rows as rows_lib


def projection_tangents(batch: pair_batch.PairBatch, reference_inputs,
                        rank: int) -> tuple[list[jax.Array], jax.Array]:
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


def projected_jacobians(batch: pair_batch.PairBatch, factors: layerwise.Factors,
                        tangent_leaves) -> jax.Array:
  """(m, d, k): J_e q̃_l for the examples of `factors`, contracted from the factors
  (`layerwise.factors_times`; no forward or backward pass through the model). One tower:
  "projected" refuses two, so both views share batch.plan."""
  return layerwise.factors_times(batch.plan, factors, tangent_leaves)


def bound_norms(batch: pair_batch.PairBatch, allowance: float = 1.0,
                projection_spec=None) -> jax.Array:
  """Upper bound ‖J_iᵀv̂_j‖ + ‖J'_jᵀû_i‖ ≥ ‖g_ij‖ from per-example Grams (with the float
  allowances of `numerics`), and the diagonal pairs from their vectors
  (`pair_terms.diagonal_norms`).

  projection_spec = (reference_inputs, rank): "projected", the tighter bound exact on the
  reference inputs' Jacobian subspace (`projection.bound`); it needs the per-example
  projections J_iQ̃ (n·d·k floats) on top, and the pair terms go in row chunks.

  Memory stays at the Grams plus one microbatch of factors (the diagonal pairs'
  gradients go in chunks of `chunking.vectors_per_block`).
  """
  tangents = eta = None
  if projection_spec is not None:
    tangents, eta = projection_tangents(batch, *projection_spec)

  def chunk_terms(x_chunk, x_prime_chunk, u_chunk, v_chunk) -> tuple[jax.Array, ...]:
    f_u, f_v = batch.factors(x_chunk, chunked=False), batch.factors(x_prime_chunk, chunked=False)
    terms = (f_u.gram, f_v.gram)
    if tangents is None:
      return terms
    return terms + (projected_jacobians(batch, f_u,
                                        tangents), projected_jacobians(batch, f_v, tangents))

  xs = (batch.x, batch.x_prime, batch.u_loc, batch.v_loc)
  n_local = rows_lib.num_rows(batch.x)
  terms: tuple[jax.Array, ...] = chunking.map_row_chunks(chunk_terms, xs, batch.microbatch_size)
  k_local, k_prime_local = terms[:2]
  k_prime = batch.c.gather(k_prime_local)
  s_local, s_prime_local = pair_terms.jacobian_norms(k_local), pair_terms.jacobian_norms(
      k_prime_local)
  s_all = batch.c.gather(s_prime_local)
  anchor, positive = pair_terms.quadratic_terms(k_local, k_prime, batch.u_loc, batch.v)
  gram_error = allowance * numerics.gram_error(batch.norm_dtype)
  norms = pair_terms.triangle_bound(anchor, positive, s_local, s_all, gram_error)
  lower = None  # "projected": the lower ends of its bounds' float intervals
  if tangents is not None:
    proj_local, proj_prime = terms[2], batch.c.gather(terms[3])
    n, d, k = proj_prime.shape
    vector_error = allowance * numerics.vector_error(batch.norm_dtype) * math.sqrt(k)
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
      subspace = subspace_norms(proj_rows, u_rows, s_rows)
      values = projection.bound(subspace, anchor_rows, positive_rows, s_rows, s_all, eta,
                                vector_error, gram_error, triangle_rows)
      return values, projection.lower_end(subspace, anchor_rows, positive_rows, s_rows, s_all, eta,
                                          vector_error, gram_error, values)

    norms, lower = chunking.row_chunks(rows_bound,
                                       (proj_local, batch.u_loc, anchor, positive, s_local, norms),
                                       row_floats, chunking.CROSS_GRAM_CHUNK_FLOATS)
  diagonal, diagonal_error = pair_terms.diagonal_norms(batch)
  diagonal = pair_terms.diagonal_values(batch, diagonal, diagonal_error, s_local + s_prime_local,
                                        allowance, batch.positive_pairs)
  on_diagonal = (jnp.arange(n_local), batch.rows)
  norms = norms.at[on_diagonal].set(diagonal)
  if lower is not None:  # the pairs whose allowances may loosen the bound by > FLAG_RATIO
    norms = pair_terms.refine_pairs(batch, norms, lower.at[on_diagonal].set(diagonal), batch.x,
                                    batch.c.gather(batch.x_prime), s_local, s_all, allowance)
  return norms

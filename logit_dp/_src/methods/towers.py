"""Pair norms of two-tower (dual-encoder) models, for "ghost" and "triangle".

With S the parameters both towers share (`two_tower.tower_plans`):

* S = ∅ (disjoint towers): ‖g_ij‖² = a + b exactly, from the per-example Grams alone,
  i.e. at the cost of "triangle"; "ghost" and "triangle" both use it.
* S ≠ ∅: "ghost" adds the cross terms over the columns of S only (its
  `ghost.flat_cross_terms`, passed in as cross_terms), "triangle" keeps its bound √a + √b.

Diagonal pairs are formed as vectors (in float64, as with one tower), so no Gram form loses a
small positive-pair norm to rounding; they go through the same compiled loop as the pairs their
float allowance flags (`pair_terms.refine_pairs` with the diagonal forced).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from logit_dp._src import chunking
from logit_dp._src import layerwise
from logit_dp._src import numerics
from logit_dp._src import pair_terms
from logit_dp._src import rows as rows_lib
from logit_dp._src import two_tower


def one_microbatch(batch) -> bool:
  """Whether one microbatch holds the batch's local rows: their factors are formed whole
  anyway, so they give the embeddings (`pair_batch.PairBatch.joint_factors`) and ḡ is
  contracted from them instead of compiling and running a backward pass of each tower."""
  m = batch.microbatch_size
  return m is None or m >= rows_lib.num_rows(batch.x)


def pair_norms(batch, cross_terms: Callable | None,
               allowance: float = 1.0) -> tuple[jax.Array, tuple[layerwise.Factors, ...] | None]:
  """(norms (n_local, n), factors or None) for clipping the pair gradients of two towers.

  Off the diagonal, disjoint towers: √(a + b + ε_G S_ij²) (exact up to the float
  allowance, ε_G = allowance·`numerics.gram_error`, S_ij = ‖J_i‖_F + ‖J'_j‖_F); shared
  leaves: with cross_terms ("ghost": cross_terms(flat_rows, u_rows, flat_columns, v) -> the
  (n_local, n) cross terms c) min(√(a + b + 2c + ε_G S_ij²), triangle bound), without (None,
  "triangle") the bound. Diagonal: ‖g_ii‖ formed as a vector in float64 with its vector
  allowance; the exact forms' pairs whose allowance raises them by more than
  `pair_terms.GRAM_FLAG_RATIO`: the smaller of that and their vector's (`pair_terms.refine_pairs`).
  factors (of the local rows of both towers) are returned when the cross terms computed them
  (shared leaves) or one microbatch holds the batch, for ḡ from the factors; None (microbatches,
  their Grams formed one at a time) means ḡ by backward passes.
  batch: a `pair_batch.PairBatch` (which builds its plans with this module).
  """
  plans, c = batch.tower_plans, batch.c
  cols_u, cols_v = two_tower.shared_columns(plans, batch.params)
  eps_gram = allowance * numerics.gram_error(batch.norm_dtype)
  n_local = rows_lib.num_rows(batch.x)
  factors = None
  with_cross = cross_terms is not None and bool(plans.shared)
  if with_cross or one_microbatch(batch):
    factors = batch.joint_factors
    if factors is None:
      factors = (batch.factors(batch.x), batch.factors(batch.x_prime, positive=True))
    f_u, f_v_local = factors
    k_local, k_prime_local = f_u.gram, f_v_local.gram
    cross = None
    if with_cross:
      assert cross_terms is not None
      cross = cross_terms(f_u.flat[..., cols_u], batch.u_loc, c.gather(f_v_local.flat[..., cols_v]),
                          batch.v)
  else:
    # Grams microbatch by microbatch; no factors are kept.
    def chunk_terms(x_chunk, x_prime_chunk):
      f_u = batch.factors(x_chunk, chunked=False)
      f_v = batch.factors(x_prime_chunk, chunked=False, positive=True)
      return f_u.gram, f_v.gram

    k_local, k_prime_local = chunking.map_row_chunks(chunk_terms, (batch.x, batch.x_prime),
                                                     batch.microbatch_size)
    cross = None
  s_local = pair_terms.jacobian_norms(k_local)
  s_prime_local = pair_terms.jacobian_norms(k_prime_local)
  s_all = c.gather(s_prime_local)
  anchor, positive = pair_terms.quadratic_terms(k_local, c.gather(k_prime_local), batch.u_loc,
                                                batch.v)
  scale_sq = (s_local[:, None] + s_all[None, :]) ** 2
  bound = pair_terms.triangle_bound(anchor, positive, s_local, s_all, eps_gram)
  squared = None
  if not plans.shared:  # no cross term: exact
    squared = jnp.maximum(anchor, 0.0) + jnp.maximum(positive, 0.0)
    norms = jnp.sqrt(squared + eps_gram * scale_sq)
  elif cross is not None:
    squared = anchor + positive + 2.0 * cross
    norms = jnp.minimum(jnp.sqrt(jnp.maximum(squared, 0.0) + eps_gram * scale_sq), bound)
  else:
    norms = bound
  # The exact forms' pairs their allowance flags, and the diagonal whatever its value, formed
  # again as vectors by one compiled computation.
  computed = norms if squared is None else jnp.sqrt(jnp.maximum(squared, 0.0))
  diagonal = jnp.zeros(norms.shape, bool).at[jnp.arange(n_local), batch.rows].set(True)
  norms = pair_terms.refine_pairs(batch, norms, computed, batch.x, c.gather(batch.x_prime), s_local,
                                  s_all, allowance, ratio=pair_terms.GRAM_FLAG_RATIO,
                                  forced=diagonal)
  return norms, factors

r"""Pair-norm upper bound exact on a public subspace ("projected" clipping).

With J_i = ∂û_i/∂w and J'_j = ∂v̂_j/∂w, a pair gradient is g_ij = J_iᵀv̂_j + J'_jᵀû_i. Let Π
be the orthogonal projector onto a k-dimensional subspace of parameter space. Then
‖g_ij‖² = ‖Πg_ij‖² + ‖(I−Π)g_ij‖², and the triangle inequality on the second part only gives

    ‖g_ij‖² ≤ ‖Πg_ij‖² + (‖(I−Π)J_iᵀv̂_j‖ + ‖(I−Π)J'_jᵀû_i‖)²,
    ‖(I−Π)J_iᵀv̂_j‖² = v̂_jᵀK_i v̂_j − ‖ΠJ_iᵀv̂_j‖²   (K_i = J_iJ_iᵀ),

never looser than the triangle bound ‖J_iᵀv̂_j‖ + ‖J'_jᵀû_i‖ (Cauchy–Schwarz), and exact when
the subspace holds both halves. The triangle bound is loose because the halves nearly cancel:
at initialisation the embedding net maps all images to similar directions, so J_iᵀv̂_j and
J'_jᵀû_i point almost opposite for negative pairs too (bound/norm ≈ 5.7). That cancellation
lives in a few directions shared by all inputs' Jacobians, so a subspace spanned by the
Jacobians of a few *public* inputs captures it: bound/norm 1.12 (k = 32) and 1.04 (k = 128)
on CIFAR-10 pairs with CIFAR-100 references (docs/METHOD.md).

The subspace is the span of the top-k right singular vectors of the stacked Jacobian rows of
the reference inputs at the current parameters. It depends on the parameters and on public
data only, never on the private batch, so the clip factor of pair (i, j) is a function of
(x_i, x'_j) alone, as the sensitivity requires (docs/PRIVACY.md).

Float32: the basis Q̃ is only nearly orthonormal; with η ≥ ‖Q̃ᵀQ̃ − I‖₂ its singular values lie
in [√(1−η), √(1+η)], so ‖Πg‖² ≤ ‖Q̃ᵀg‖²/(1−η) and ‖Πx‖² ≥ ‖Q̃ᵀx‖²/(1+η) for the projector Π
onto span(Q̃): the bound holds for Q̃ itself, not for an ideal Q. The projections Q̃ᵀJ_iᵀv̂_j
come from the products J_iq̃_l (contracted from the layer factors, clipping.py) and carry the
vector allowance; the quadratic forms carry the Gram allowance. The pair terms take one of two
forms with the same bound (`vector_norms`, or `gram_norms` for d ≤ GRAM_FORM_MAX_DIM, whose
squared norms carry the Gram allowance on top).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from logit_dp._src import numerics

_HIGHEST = jax.lax.Precision.HIGHEST
# The numerical rank of the reference rows M (r, p): eigenvalues of G = MMᵀ at or below
# RANK_TOLERANCE·max(r, √p)·u·λ_max (u the unit roundoff of M's dtype) are rounding, not
# directions of M, and their columns are dropped. E.g. each normalised embedding's Jacobian
# has rank ≤ d − 1, so 8 reference inputs of d = 4 give 24 directions: the 8 other
# eigenvalues of G are ~0.3u·λ_max in float32 (~5e-17 in float64), and keeping them made
# the same model written two ways give norms 2.4% apart (2e-7 after dropping them).
RANK_TOLERANCE = 16.0
# Added to the measured ‖Q̃ᵀQ̃ − I‖_F per column for the error of forming Q̃ᵀQ̃ itself, in units
# of the unit roundoff (2⁻²⁰ in float32).
_GRAM_IDENTITY_UNITS = 16.0
# Above this η the basis is not trusted and the bound falls back to the triangle bound.
MAX_ORTHONORMALITY_ERROR = 0.25


def check_rank(rank) -> int:
  """rank as an int; ValueError unless it is a positive integer."""
  if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
    raise ValueError(f"rank (of the projected bound) must be a positive integer, got {rank!r}.")
  return int(rank)


def basis(reference_rows: jax.Array, rank: int) -> tuple[jax.Array, jax.Array]:
  """(Q̃, η): Q̃ (p, k) an orthonormal basis (up to float error η) of the top-``rank`` right
  singular subspace of ``reference_rows`` M (r, p), the stacked Jacobian rows of the reference
  inputs, truncated at M's numerical rank; k = min(rank, r, p) columns.

  Top singular vectors from the eigenvectors of the small (r, r) Gram G = MMᵀ:
  q_l = Mᵀu_l/√λ_l, re-orthonormalised by QR, for λ_l > RANK_TOLERANCE·max(r, √p)·u·λ_max;
  the columns of the other λ_l are 0 (the subspace is that of the kept columns; QR's first
  columns do not depend on later ones). With D = diag(kept),
  η = ‖Q̃ᵀQ̃ − D‖_F + 16k·u ≥ ‖Q̃_keptᵀQ̃_kept − I‖₂.
  """
  rows, num_params = reference_rows.shape
  k = min(rank, rows, num_params)
  u = numerics.unit_roundoff(reference_rows.dtype)
  gram = jnp.matmul(reference_rows, reference_rows.T, precision=_HIGHEST)
  eigenvalues, eigenvectors = jnp.linalg.eigh(gram)
  top_values, top_vectors = eigenvalues[::-1][:k], eigenvectors[:, ::-1][:, :k]
  floor = RANK_TOLERANCE * max(rows, math.sqrt(num_params)) * u
  keep = top_values > floor * jnp.maximum(top_values[0], 0.0)
  scale = jnp.where(keep, jax.lax.rsqrt(jnp.where(keep, top_values, 1.0)), 0.0)
  q, _ = jnp.linalg.qr(jnp.matmul(reference_rows.T, top_vectors, precision=_HIGHEST) * scale)
  q = jnp.where(keep[None, :], q, 0.0)
  deviation = jnp.matmul(q.T, q, precision=_HIGHEST) - jnp.diag(keep.astype(q.dtype))
  eta = jnp.sqrt(jnp.sum(deviation * deviation)) + k * _GRAM_IDENTITY_UNITS * u
  return q, eta


def as_tangent_leaves(q: jax.Array, leaves) -> list:
  """The k columns of Q̃ (p, k) as parameter leaves with a leading axis of k, for ``leaves`` in
  `jax.tree_util.tree_leaves` order, each raveled (the layout of the reference rows)."""
  out, offset = [], 0
  for leaf in leaves:
    out.append(q[offset:offset + leaf.size].T.reshape((q.shape[1],) + leaf.shape).astype(
        leaf.dtype))
    offset += leaf.size
  return out


# Embedding dimensions up to this use the Gram form of the pair terms (`gram_norms`), larger
# ones the vector form (`vector_norms`): per pair d²k multiply-adds in matrix products against
# 2dk in memory-bound ones. On 2 CPU cores at n = 4,000 (full Logit-DP step,
# benchmarks/projected_forms.py, docs/BENCHMARKS.md) the Gram form takes 0.86× the vector form's
# time at d = 8 and 1.08× at d = 16.
GRAM_FORM_MAX_DIM = 8


def uses_gram_form(embedding_dim: int) -> bool:
  """Whether the pair terms of embedding dimension d take the Gram form (d ≤ GRAM_FORM_MAX_DIM)."""
  return embedding_dim <= GRAM_FORM_MAX_DIM


def vector_norms(proj_rows, u_rows, proj_columns,
                 v_columns) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(‖X + Y‖, ‖X‖, ‖Y‖, ‖X + Y‖), each (rows, columns), for X = Q̃ᵀJ_iᵀv̂_j and
  Y = Q̃ᵀJ'_jᵀû_i formed as vectors from proj_rows (r, d, k) = J_iQ̃ and proj_columns
  (c, d, k) = J'_jQ̃ (the last: the lower end of the first, the same here; `gram_norms`)."""
  x = jnp.einsum("idk,jd->ijk", proj_rows, v_columns, precision=_HIGHEST)
  y = jnp.einsum("jdk,id->ijk", proj_columns, u_rows, precision=_HIGHEST)
  norm = lambda a: jnp.sqrt(jnp.sum(a * a, axis=-1))
  sum_norm = norm(x + y)
  return sum_norm, norm(x), norm(y), sum_norm


def gram_columns(proj_columns, v_columns) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The column side of `gram_norms`, formed once for all row chunks: v̂_j ⊗ v̂_j (c, d²),
  J'_jQ̃Q̃ᵀJ'_jᵀ (c, d²) and H_j[a, b, l] = v̂_ja (J'_jQ̃)_bl (c, d²k)."""
  c, d, _ = proj_columns.shape
  vv = (v_columns[:, :, None] * v_columns[:, None, :]).reshape(c, d * d)
  gram = jnp.einsum("jak,jbk->jab", proj_columns, proj_columns, precision=_HIGHEST).reshape(c, -1)
  h = (v_columns[:, :, None, None] * proj_columns[:, None, :, :]).reshape(c, -1)
  return vv, gram, h


def gram_norms(proj_rows, u_rows, columns, s_rows, s_columns,
               gram_error: float) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """`vector_norms` from Gram forms, each a matrix product: ‖X‖² = v̂_jᵀ(J_iQ̃Q̃ᵀJ_iᵀ)v̂_j,
  ‖Y‖² = û_iᵀ(J'_jQ̃Q̃ᵀJ'_jᵀ)û_i and X·Y = Σ_abl (J_iQ̃)_al û_ib · v̂_ja (J'_jQ̃)_bl (columns:
  `gram_columns`). The computed squares are within ε_G·s² of those of the computed vectors
  (ε_G = gram_error, the Gram allowance; s_i² for ‖X‖², s'_j² for ‖Y‖², (s_i + s'_j)² for
  ‖X + Y‖²; measured against float64 from the same projections: below 2⁻²⁴·s², a margin of
  16 asserted in tests/test_projected.py): the first norm is raised by it and the other two
  lowered, so each bounds the vector form's value; the fourth is ‖X + Y‖ lowered by it."""
  vv, gram_columns_, h = columns
  r, d, _ = proj_rows.shape
  gram_rows = jnp.einsum("iak,ibk->iab", proj_rows, proj_rows, precision=_HIGHEST).reshape(r, -1)
  uu = (u_rows[:, :, None] * u_rows[:, None, :]).reshape(r, d * d)
  f = (proj_rows[:, :, None, :] * u_rows[:, None, :, None]).reshape(r, -1)
  xx = jnp.matmul(gram_rows, vv.T, precision=_HIGHEST)
  yy = jnp.matmul(uu, gram_columns_.T, precision=_HIGHEST)
  xy = jnp.matmul(f, h.T, precision=_HIGHEST)
  s_i, s_j = s_rows[:, None], s_columns[None, :]
  squared = xx + yy + 2.0 * xy
  upper = jnp.sqrt(jnp.maximum(squared, 0.0) + gram_error * (s_i + s_j) ** 2)
  lower = lambda sq, s: jnp.sqrt(jnp.maximum(sq - gram_error * s ** 2, 0.0))
  return upper, lower(xx, s_i), lower(yy, s_j), lower(squared, s_i + s_j)


def bound(subspace_norms, anchor, positive, s_rows, s_columns, eta, vector_error: float,
          gram_error: float, triangle) -> jax.Array:
  """min(projected bound, triangle) for rows i and columns j, shape (rows, columns).

  subspace_norms = (‖X + Y‖, ‖X‖, ‖Y‖, ‖X + Y‖) of the computed X = Q̃ᵀJ_iᵀv̂_j and
  Y = Q̃ᵀJ'_jᵀû_i (`vector_norms` or `gram_norms`: an upper bound of the first, lower bounds
  of the others),
  each vector within vector_error·s of the truth; anchor = v̂_jᵀK_i v̂_j and
  positive = û_iᵀK'_j û_i (r, c); s = ‖J‖_F per example. With e_v = vector_error and
  ε_G = gram_error:

      bound² = (‖X + Y‖ + e_v(s_i + s'_j))²/(1 − η) + (r_i + r'_j)²,
      r_i = √(max(a − X_low²/(1+η), 0) + ε_G s_i²),  r'_j = √(max(b − Y_low²/(1+η), 0) + ε_G s'_j²),

  X_low = max(‖X‖ − e_v s_i, 0), Y_low likewise.
  """
  sum_norm, x_norm, y_norm = subspace_norms[:3]
  s_i, s_j = s_rows[:, None], s_columns[None, :]
  in_subspace = sum_norm + vector_error * (s_i + s_j)
  x_low = jnp.maximum(x_norm - vector_error * s_i, 0.0)
  y_low = jnp.maximum(y_norm - vector_error * s_j, 0.0)
  trusted = eta < MAX_ORTHONORMALITY_ERROR
  eta = jnp.where(trusted, eta, 0.0)
  rest_u = jnp.sqrt(jnp.maximum(anchor - x_low ** 2 / (1.0 + eta), 0.0) + gram_error * s_i ** 2)
  rest_v = jnp.sqrt(jnp.maximum(positive - y_low ** 2 / (1.0 + eta), 0.0) + gram_error * s_j ** 2)
  projected = jnp.sqrt(in_subspace ** 2 / (1.0 - eta) + (rest_u + rest_v) ** 2)
  return jnp.where(trusted, jnp.minimum(projected, triangle), triangle)


def lower_end(subspace_norms, anchor, positive, s_rows, s_columns, eta, vector_error: float,
              gram_error: float, bound_values) -> jax.Array:
  """The lower end of `bound`'s float error interval, each allowance taken the other way:

      L² = max(‖X + Y‖_low − e_v(s_i + s'_j), 0)²/(1 + η) + (ρ_i + ρ'_j)²,
      ρ_i = √max(a − ε_G s_i² − X_high²/(1 − η), 0),  X_high = √(‖X‖² + 2ε_G s_i²) + e_v s_i,

  ρ'_j likewise with b, ‖Y‖, s'_j (‖X + Y‖_low: the last of `subspace_norms`). L is at most
  the bound in exact arithmetic, and at most ‖g_ij‖ where the subspace holds the pair gradient
  (then ρ = 0). Where the basis is not trusted (`bound` gives the triangle bound):
  bound_values, so that no pair is flagged by it."""
  sum_low, x_norm, y_norm = subspace_norms[3], subspace_norms[1], subspace_norms[2]
  s_i, s_j = s_rows[:, None], s_columns[None, :]
  trusted = eta < MAX_ORTHONORMALITY_ERROR
  eta = jnp.where(trusted, eta, 0.0)
  in_subspace = jnp.maximum(sum_low - vector_error * (s_i + s_j), 0.0)
  high = lambda norm, s: jnp.sqrt(norm ** 2 + 2.0 * gram_error * s ** 2) + vector_error * s
  rest = lambda quad, norm, s: jnp.sqrt(
      jnp.maximum(quad - gram_error * s ** 2 - high(norm, s) ** 2 / (1.0 - eta), 0.0))
  low = jnp.sqrt(in_subspace ** 2 / (1.0 + eta)
                 + (rest(anchor, x_norm, s_i) + rest(positive, y_norm, s_j)) ** 2)
  return jnp.where(trusted, low, bound_values)

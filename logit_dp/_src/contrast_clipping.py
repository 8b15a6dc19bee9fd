r"""Contrast clipping: a Logit-DP variant for the contrastive loss, on dense Jacobians.

For the contrastive loss every row's weights sum to zero, Σ_j τ_ij = 0 (τ_ij = (s_ij − δ_ij)/τ,
s_i = softmax(Z_i/τ)), so row i's gradient is Σ_{j≠i} (s_ij/τ)·D_ij with the contrasts
D_ij = g_ij − g_ii (g_ij = ∇_w Z_ij). Clipping D_ij instead of g_ij keeps the cancellation
between a positive pair and its negatives inside each clipped term:

    ḡ = Σ_i Σ_{j≠i} (s_ij/τ)·min(1, B/‖D_ij‖)·D_ij,

with C/B = (1 + 2(n−1)p)/τ under adding or removing one pair record, p = a/(a + n − 1),
a = e^{2/τ}; supremum over n (1 + 2a)/τ, against Logit-DP's (2 + 2a)/τ (proof: docs/METHOD.md,
"Contrast clipping"). With B = ∞, ḡ = ∇ℒ.

Grouped contrast clipping (``group_ids`` and ``group_clip_norm`` K): negatives only from the own
group (hash-assigned as in DP-GCL, `logit_dp.baselines.assign_groups`), the softmax over the group's
columns, contrasts clipped to B, and each group's sum G_h projected onto the ball of radius K:

    ḡ = Σ_h min(1, K/‖G_h‖)·G_h,    G_h = Σ_{i∈h} Σ_{j∈h, j≠i} (s^h_ij/τ)·min(1, B/‖D_ij‖)·D_ij,

with C = min(2K, (1 + 2a)B/τ).

The per-example Jacobians of the normalised embeddings are formed densely (n·d·p floats per view),
so this is for measuring and auditing at small p, not for training. The clipped terms' norms come
in three ways (``norms``): "materialize" forms the n² terms as p-vectors in blocks of rows
(``row_block``·n·p floats); "gram" computes the exact norms from Grams of the d×p Jacobians,

    ‖D_ij‖² = y_ijᵀ S_i y_ij + û_iᵀ K'_j û_i + 2 y_ijᵀ (W_i J'_jᵀ) û_i,

W_i = [J_i; J'_i] (record i's two Jacobians stacked, 2d×p), S_i = W_i W_iᵀ, K'_j = J'_j J'_jᵀ,
y_ij = (v̂_j − v̂_i, −û_i), so D_ij = W_iᵀ y_ij + J'_jᵀ û_i (row_block·n·2d² floats); "bound"
clips with ‖W_iᵀ y_ij‖ + ‖J'_jᵀ û_i‖ ≥ ‖D_ij‖, from the per-record Grams S_i and K'_j only. The
last two never form a term: ḡ comes from cotangents, Σ_i W_iᵀ c_i + Σ_j J'_jᵀ c'_j.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from logit_dp._src import losses as losses_lib
from logit_dp._src import numerics
from logit_dp._src import sensitivity as sensitivity_lib

EmbedFn = Callable[[Any, jax.Array], jax.Array]

#: What each clipped term is: "contrast" (D_ij = g_ij − g_ii, this module's variant) or "pair"
#: (g_ij, Logit-DP with exact norms; the same computation, for side-by-side measurements).
CLIP_TERMS = ("contrast", "pair")

#: How the clipped terms' norms are computed (module docstring): "materialize" (each term formed as
#: a p-vector), "gram" (exact, from Grams of the Jacobians) or "bound" (an upper bound from
#: per-record Grams).
NORMS = ("materialize", "gram", "bound")


def contrast_sensitivity_factor(temperature: float, batch_size: int | None = None) -> float:
  """C/B of contrast clipping: (1 + 2(n−1)p)/τ, p = a/(a + n − 1), a = e^{2/τ}.

  Args:
    temperature: τ of the contrastive loss.
    batch_size: n, or None for the supremum over n, (1 + 2a)/τ (Poisson sampling).

  Returns:
    C/B as a float.
  """
  loss = losses_lib.Contrastive(temperature)  # validates τ
  a = math.exp(2.0 / loss.temperature)
  if batch_size is None:
    return (1.0 + 2.0 * a) / loss.temperature
  n = losses_lib.check_batch_size(batch_size, loss.min_batch_size)
  return (1.0 + 2.0 * (n - 1) / (1.0 + (n - 1) / a)) / loss.temperature


def contrast_sensitivity(loss, clip_norm: float, batch_size: int | None = None,
                         group_clip_norm: float | None = None) -> float:
  """L2 sensitivity C of the contrast-clipped ḡ under adding or removing one pair record.

  C = (1 + 2(n−1)p)/τ·B (batch_size None: (1 + 2a)/τ·B); with groups whose sums are clipped to
  K = ``group_clip_norm``, C = min(2K, (1 + 2a)/τ·B) (group sizes are random).

  Args:
    loss: a `losses.Contrastive` (the decomposition needs Σ_j τ_ij = 0).
    clip_norm: B, the contrast clip norm.
    batch_size: n for batches of exactly n pairs; None for any n. Ignored with groups.
    group_clip_norm: K, or None without groups.

  Returns:
    C as a float.
  """
  if not isinstance(loss, losses_lib.Contrastive):
    raise TypeError(f"contrast clipping needs a logit_dp.losses.contrastive loss (rows whose "
                    f"weights sum to 0), got {loss!r}.")
  b = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=False)
  if group_clip_norm is None:
    return contrast_sensitivity_factor(loss.temperature, batch_size) * b
  k = sensitivity_lib.check_clip_norm(group_clip_norm, allow_inf=True)
  return min(2.0 * k, contrast_sensitivity_factor(loss.temperature, None) * b)


def normalized_jacobians(embed_fn: EmbedFn, params, x: jax.Array,
                         block: int = 32) -> tuple[jax.Array, jax.Array, Callable]:
  """(n(Φ_w(x)) (n, d), ∂n(Φ_w(x_i))/∂w as dense (n, d, p) Jacobians, unravel) per example."""
  flat, unravel = ravel_pytree(params)

  def embed_one(flat_params, x_one):
    return numerics.normalize(embed_fn(unravel(flat_params), x_one[None])[0])

  def one(x_one):
    return embed_one(flat, x_one), jax.jacrev(embed_one)(flat, x_one)

  u, jac = jax.lax.map(one, x, batch_size=min(block, x.shape[0]))
  return u, jac, unravel


def _weights(z: jax.Array, temperature: float, valid: jax.Array,
             group_ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """(s, same): softmax weights of each row over its valid (same-group) columns, and that set."""
  n = z.shape[0]
  same = valid[:, None] & valid[None, :]
  if group_ids is not None:
    same &= group_ids[:, None] == group_ids[None, :]
  logits = jnp.where(same, z / temperature, -jnp.inf)
  row_max = jnp.max(jnp.where(same, logits, -1e30), axis=1, keepdims=True)
  e = jnp.where(same, jnp.exp(logits - row_max), 0.0)
  total = jnp.sum(e, axis=1, keepdims=True)
  s = jnp.where(total > 0, e / jnp.where(total > 0, total, 1.0), 0.0)
  del n
  return s, same


class DenseBatch(NamedTuple):
  """A batch's normalised embeddings and their dense per-example Jacobians (flat parameters)."""
  u: jax.Array  # (n, d) n(Φ_w(x_i))
  jac_u: jax.Array  # (n, d, p) ∂û_i/∂w
  v: jax.Array  # (n, d) n(Φ_w(x'_j))
  jac_v: jax.Array  # (n, d, p) ∂v̂_j/∂w
  unravel: Callable  # flat (p,) -> params pytree


def dense_batch(embed_fn: EmbedFn, params, x: jax.Array, x_prime: jax.Array,
                jacobian_block: int = 32) -> DenseBatch:
  """`DenseBatch` of n pairs: 2n per-example Jacobians by `jax.jacrev`, ``jacobian_block`` at a
  time."""
  u, jac_u, unravel = normalized_jacobians(embed_fn, params, x, jacobian_block)
  v, jac_v, _ = normalized_jacobians(embed_fn, params, x_prime, jacobian_block)
  return DenseBatch(u, jac_u, v, jac_v, unravel)


def _row_blocks(n: int, row_block: int) -> tuple[jax.Array, jax.Array]:
  """(indices, real): the rows 0..n−1 in blocks of ``row_block``, padded with row 0 (not real)."""
  num_blocks = -(-n // row_block)
  pad = num_blocks * row_block - n
  idx = jnp.concatenate([jnp.arange(n), jnp.zeros((pad,), int)]).reshape(num_blocks, row_block)
  real = (jnp.arange(num_blocks * row_block) < n).reshape(num_blocks, row_block)
  return idx, real


def _record_jacobians(batch: DenseBatch, clip_terms: str) -> jax.Array:
  """W_i, the Jacobians a term's record-i part is made of: [J_i; J'_i] (n, 2d, p) for contrasts,
  J_i (n, d, p) for pairs."""
  if clip_terms == "contrast":
    return jnp.concatenate([batch.jac_u, batch.jac_v], axis=1)
  return batch.jac_u


def _record_coefficients(batch: DenseBatch, clip_terms: str, rows: jax.Array) -> jax.Array:
  """y_ij for i in ``rows``, every j ((r, n, 2d) or (r, n, d)): term_ij = W_iᵀy_ij + J'_jᵀû_i.

  Contrasts: y_ij = (v̂_j − v̂_i, −û_i); pairs: y_ij = v̂_j.
  """
  u, v = batch.u, batch.v
  r, n = rows.shape[0], v.shape[0]
  if clip_terms == "contrast":
    a = v[None, :, :] - v[rows][:, None, :]
    return jnp.concatenate([a, jnp.broadcast_to(-u[rows][:, None, :], a.shape)], axis=-1)
  return jnp.broadcast_to(v[None], (r, n, v.shape[1]))


def _gram_norms(batch: DenseBatch, clip_terms: str, norms: str, row_block: int) -> jax.Array:
  """(n, n) norms of term_ij = W_iᵀy_ij + J'_jᵀû_i from Grams, ``row_block`` rows at a time.

  "gram": √(y_ijᵀS_iy_ij + û_iᵀK'_jû_i + 2y_ijᵀ(W_iJ'_jᵀ)û_i), exact (negative rounding
  clamped to 0), S_i = W_iW_iᵀ, K'_j = J'_jJ'_jᵀ; "bound": √(y_ijᵀS_iy_ij) + √(û_iᵀK'_jû_i),
  ≥ the norm by the triangle inequality, from per-record Grams only. The diagonal is exact in
  both: D_ii = 0, and ‖g_ii‖ from the n vectors g_ii.
  """
  hp = numerics.HIGHEST
  u, jac_v = batch.u, batch.jac_v
  n = u.shape[0]
  w = _record_jacobians(batch, clip_terms)
  gram_w = jnp.einsum("ikp,ilp->ikl", w, w, precision=hp)
  gram_v = jnp.einsum("jdp,jep->jde", jac_v, jac_v, precision=hp)

  def block_norms(rows):
    y = _record_coefficients(batch, clip_terms, rows)
    u_rows = u[rows]
    record = jnp.einsum("rjk,rkl,rjl->rj", y, gram_w[rows], y, precision=hp)
    column = jnp.einsum("rd,jde,re->rj", u_rows, gram_v, u_rows, precision=hp)
    if norms == "bound":
      return jnp.sqrt(jnp.maximum(record, 0.0)) + jnp.sqrt(jnp.maximum(column, 0.0))
    cross_gram = jnp.einsum("rkp,jep->rjke", w[rows], jac_v, precision=hp)
    cross = jnp.einsum("rjk,rjke,re->rj", y, cross_gram, u_rows, precision=hp)
    return jnp.sqrt(jnp.maximum(record + column + 2.0 * cross, 0.0))

  idx, _ = _row_blocks(n, row_block)
  out = jax.lax.map(block_norms, idx).reshape(-1, n)[:n]
  if clip_terms == "contrast":
    diagonal = jnp.zeros((n,), out.dtype)  # D_ii = 0
  else:
    # g_ii as vectors: the Gram form cancels catastrophically for near-identical views.
    g_ii = (jnp.einsum("idp,id->ip", batch.jac_u, batch.v, precision=hp)
            + jnp.einsum("idp,id->ip", jac_v, u, precision=hp))
    diagonal = jnp.sqrt(jnp.sum(g_ii * g_ii, axis=1))
  return jnp.where(jnp.eye(n, dtype=bool), diagonal[:, None], out)


def _contracted_rows(batch: DenseBatch, clip_terms: str, coefficients: jax.Array) -> jax.Array:
  """R_i = Σ_j λ_ij term_ij = W_iᵀ(Σ_j λ_ij y_ij) + Σ_j λ_ij J'_jᵀû_i, (n, p), no term formed."""
  hp = numerics.HIGHEST
  u, v, jac_v = batch.u, batch.v, batch.jac_v
  n, d = u.shape
  lam = coefficients
  c = jnp.matmul(lam, v, precision=hp)
  if clip_terms == "contrast":
    total = jnp.sum(lam, axis=1, keepdims=True)
    c = jnp.concatenate([c - total * v, -total * u], axis=1)
  record = jnp.einsum("ik,ikp->ip", c, _record_jacobians(batch, clip_terms), precision=hp)
  column = jnp.matmul((lam[:, :, None] * u[:, None, :]).reshape(n, n * d), jac_v.reshape(n * d, -1),
                      precision=hp)
  return record + column


def clipped_sums(batch: DenseBatch, loss, clip_norm: float, *, clip_terms: str = "contrast",
                 norms: str = "materialize", mask: jax.Array | None = None,
                 group_ids: jax.Array | None = None, row_block: int = 8) -> dict[str, jax.Array]:
  """The rows' clipped sums R_i (flat, (n, p)) and the norms the terms are clipped with.

  clip_terms="contrast": R_i = Σ_{j≠i} (s_ij/τ)·min(1, B/N_ij)·D_ij, N_ij = ‖D_ij‖ or its bound;
  clip_terms="pair": R_i = Σ_j τ_ij·min(1, B/N_ij)·g_ij (Logit-DP), N_ij = ‖g_ij‖ or its bound.
  s is the softmax of row i over its valid columns (of its own group with ``group_ids``).
  Both are term_ij = W_iᵀy_ij + J'_jᵀû_i (module docstring; pairs: W_i = J_i, y_ij = v̂_j, the
  bound is Logit-DP's "triangle"). No float allowance is added to any norm.

  Args:
    batch: `dense_batch` of the n pairs.
    loss: a `losses.Contrastive`.
    clip_norm: B (math.inf: no clipping).
    clip_terms: "contrast" or "pair".
    norms: "materialize" (every term a p-vector, normed and summed), "gram" (exact norms from
      Grams) or "bound" (the triangle bound from per-record Grams); the last two sum by
      contracting the Jacobians with cotangents.
    mask: (n,) booleans, the valid pairs (default all).
    group_ids: (n,) integers, each pair's group (default one group).
    row_block: rows whose n terms (materialize: row_block·n·p floats) or cross-Grams (gram:
      row_block·n·2d² floats) are formed at once.

  Returns:
    {"rows": (n, p) R_i, "norms": (n, n) N_ij (0 outside the pairs of valid same-group rows),
     "weights": (n, n) the coefficients of the clipped terms before clipping, "z": (n, n)
     similarities}.
  """
  if not isinstance(loss, losses_lib.Contrastive):
    raise TypeError(f"contrast clipping needs a logit_dp.losses.contrastive loss, got {loss!r}.")
  if clip_terms not in CLIP_TERMS:
    raise ValueError(f"clip_terms must be one of {CLIP_TERMS}, got {clip_terms!r}.")
  if norms not in NORMS:
    raise ValueError(f"norms must be one of {NORMS}, got {norms!r}.")
  b = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=True)
  u, jac_u, v, jac_v = batch.u, batch.jac_u, batch.v, batch.jac_v
  n = u.shape[0]
  valid = jnp.ones((n,), bool) if mask is None else jnp.asarray(mask, bool)
  z = jnp.matmul(u, v.T, precision=numerics.HIGHEST)
  s, same = _weights(z, loss.temperature, valid, group_ids)
  eye = jnp.eye(n, dtype=bool)
  if clip_terms == "contrast":
    weights = jnp.where(same & ~eye, s, 0.0) / loss.temperature
  else:
    weights = jnp.where(same, s - eye, 0.0) / loss.temperature
  if norms != "materialize":
    term_norms = _gram_norms(batch, clip_terms, norms, row_block)
    rows_sum = _contracted_rows(batch, clip_terms, weights * numerics.clip_factor(term_norms, b))
    return dict(rows=rows_sum, norms=jnp.where(same, term_norms, 0.0), weights=weights, z=z)
  idx, real = _row_blocks(n, row_block)
  hp = numerics.HIGHEST

  def block_terms(args):
    rows, real_rows = args
    # g_ij = J_iᵀv̂_j + J'_jᵀû_i for i in the block, every j: (r, n, p).
    g = (jnp.einsum("rdp,jd->rjp", jac_u[rows], v, precision=hp)
         + jnp.einsum("jdp,rd->rjp", jac_v, u[rows], precision=hp))
    if clip_terms == "contrast":
      g = g - g[jnp.arange(rows.shape[0]), rows][:, None, :]
    term_norms = jnp.sqrt(jnp.sum(g * g, axis=-1))
    w = weights[rows] * numerics.clip_factor(term_norms, b)
    w = jnp.where(real_rows[:, None], w, 0.0)
    return jnp.einsum("rj,rjp->rp", w, g, precision=hp), term_norms

  rows_sum, term_norms = jax.lax.map(block_terms, (idx, real))
  rows_sum = rows_sum.reshape(-1, rows_sum.shape[-1])[:n]
  term_norms = term_norms.reshape(-1, n)[:n]
  return dict(rows=rows_sum, norms=jnp.where(same, term_norms, 0.0), weights=weights, z=z)


def group_sums(rows: jax.Array, group_ids: jax.Array,
               group_clip_norm: float | None = None) -> tuple[jax.Array, jax.Array]:
  """(Σ_h min(1, K/‖G_h‖)·G_h, the (n,) norms ‖G_h‖ (0 for absent groups)), G_h = Σ_{i∈h} R_i."""
  n = rows.shape[0]
  _, dense_ids = jnp.unique(jnp.asarray(group_ids), return_inverse=True, size=n)
  sums = jax.ops.segment_sum(rows, dense_ids.reshape(-1), num_segments=n)
  norms = jnp.sqrt(jnp.sum(sums * sums, axis=1))
  if group_clip_norm is not None:
    k = sensitivity_lib.check_clip_norm(group_clip_norm, allow_inf=True)
    sums = sums * numerics.clip_factor(norms, k)[:, None]
  return jnp.sum(sums, axis=0), norms


def contrast_clipped_grad(embed_fn: EmbedFn, loss, clip_norm: float, params, x: jax.Array,
                          x_prime: jax.Array, *, clip_terms: str = "contrast",
                          norms: str = "materialize", mask: jax.Array | None = None,
                          group_ids: jax.Array | None = None, group_clip_norm: float | None = None,
                          row_block: int = 8, jacobian_block: int = 32) -> Any:
  """ḡ of contrast clipping (module docstring), as a params pytree.

  Without ``group_ids``: ḡ = Σ_i R_i. With them: ḡ = Σ_h min(1, K/‖G_h‖)·G_h, G_h = Σ_{i∈h} R_i,
  K = ``group_clip_norm`` (None: no group clipping). R_i: `clipped_sums` (``norms``: how the
  clipped terms are normed). The noise that makes it private is N(0, (σC)²I),
  C = `contrast_sensitivity`, whichever ``norms``.
  """
  if group_clip_norm is not None and group_ids is None:
    raise ValueError("group_clip_norm needs group_ids (each pair's group).")
  batch = dense_batch(embed_fn, params, x, x_prime, jacobian_block)
  rows = clipped_sums(batch, loss, clip_norm, clip_terms=clip_terms, norms=norms, mask=mask,
                      group_ids=group_ids, row_block=row_block)["rows"]
  if group_ids is None:
    return batch.unravel(jnp.sum(rows, axis=0))
  return batch.unravel(group_sums(rows, group_ids, group_clip_norm)[0])


def removal_gaps(embed_fn: EmbedFn, loss, clip_norm: float, params, x: jax.Array,
                 x_prime: jax.Array, *, clip_terms: str = "contrast", norms: str = "materialize",
                 group_ids: jax.Array | None = None,
                 group_clip_norm: float | None = None) -> jax.Array:
  """gap_k = ‖ḡ(X) − ḡ(X∖k)‖₂ for every pair k, pair k deleted (not masked), as an (n,) array."""
  n = x.shape[0]

  def grad(p, xs, xps, ids):
    g = contrast_clipped_grad(embed_fn, loss, clip_norm, p, xs, xps, clip_terms=clip_terms,
                              norms=norms, group_ids=ids, group_clip_norm=group_clip_norm,
                              row_block=n)
    return ravel_pytree(g)[0]

  full = grad(params, x, x_prime, group_ids)
  kept = jnp.stack([jnp.concatenate([jnp.arange(k), jnp.arange(k + 1, n)]) for k in range(n)])
  ids = None if group_ids is None else jnp.asarray(group_ids)[kept]
  smaller = jax.vmap(grad, in_axes=(None, 0, 0, None if ids is None else 0))(params, x[kept],
                                                                             x_prime[kept], ids)
  return jnp.sqrt(jnp.sum((full[None] - smaller) ** 2, axis=1))


def search_worst_case(embed_fn: EmbedFn, loss, clip_norm: float, params, x: jax.Array,
                      x_prime: jax.Array, *, num_restarts: int = 4, num_steps: int = 40,
                      learning_rate: float = 0.05, move_params: bool = False, seed: int = 0,
                      clip_terms: str = "contrast", group_ids: jax.Array | None = None,
                      group_clip_norm: float | None = None) -> dict[str, Any]:
  """The largest max_k gap_k / C found by Adam ascent on (x, x′[, w]) from random restarts.

  Maximises logsumexp_k log(gap_k² + 10⁻³⁰) (≈ log max_k gap_k²), keeping the best ratio seen
  at any step; restart 0 starts from the given batch, the others from N(0, 1) inputs of the same
  shape (and, with move_params, parameters perturbed by N(0, 1)). C = `contrast_sensitivity` at
  n = x.shape[0] (groups: min(2K, C(∞))). A lower bound on the worst case, never a proof.

  Returns:
    {"ratio": best max_k gap_k / C, "ratio_sup": the same against C(∞), "bound": C,
     "x", "x_prime", "params": where it was reached}.
  """
  import optax  # pylint: disable=g-import-not-at-top
  n = x.shape[0]
  if clip_terms == "pair":
    bound = sensitivity_lib.sensitivity(loss, clip_norm, n)
    bound_sup = sensitivity_lib.sensitivity(loss, clip_norm, None)
  else:
    bound = contrast_sensitivity(loss, clip_norm, n, group_clip_norm)
    bound_sup = contrast_sensitivity(loss, clip_norm, None, group_clip_norm)

  def gaps_of(state):
    xs, xps, ps = state
    return removal_gaps(embed_fn, loss, clip_norm, ps, xs, xps, clip_terms=clip_terms,
                        group_ids=group_ids, group_clip_norm=group_clip_norm)

  def objective(state):
    return -jax.nn.logsumexp(jnp.log(gaps_of(state) ** 2 + 1e-30))

  grad_fn = jax.jit(jax.value_and_grad(objective))
  gaps_fn = jax.jit(gaps_of)
  optimizer = optax.adam(learning_rate)
  key = jax.random.PRNGKey(seed)
  best: dict[str, Any] = dict(ratio=-1.0)
  best_ratio = -1.0
  for restart in range(num_restarts):
    key, kx, kxp, kp = jax.random.split(key, 4)
    if restart == 0:
      state = (x, x_prime, params)
    else:
      noise = lambda k, a: jax.random.normal(k, a.shape, a.dtype)
      leaves, treedef = jax.tree_util.tree_flatten(params)
      keys = jax.random.split(kp, len(leaves))
      moved = (jax.tree_util.tree_unflatten(
          treedef, [leaf + noise(kk, leaf) for kk, leaf in zip(keys, leaves)])
               if move_params else params)
      scale = (1.0, 0.1, 10.0)[restart % 3]
      xs = scale * noise(kx, x)
      xps = xs + scale * (0.3 if restart % 2 else 1.0) * noise(kxp, x_prime)
      state = (xs, xps, moved)
    opt_state = optimizer.init(state)
    for step in range(num_steps + 1):
      gap = float(jnp.max(gaps_fn(state)))
      if gap / bound > best_ratio:
        best_ratio = gap / bound
        xs_now, xps_now, params_now = state
        best = dict(ratio=best_ratio, ratio_sup=gap / bound_sup, bound=bound, x=xs_now,
                    x_prime=xps_now, params=params_now)
      if step == num_steps:
        break
      _, grads = grad_fn(state)
      grads = jax.tree_util.tree_map(lambda g: jnp.where(jnp.isfinite(g), g, 0.0), grads)
      if not move_params:
        grads = (grads[0], grads[1], jax.tree_util.tree_map(jnp.zeros_like, grads[2]))
      updates, opt_state = optimizer.update(grads, opt_state)
      state = cast(tuple, optax.apply_updates(state, updates))
  return best

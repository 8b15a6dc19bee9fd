"""Non-decomposable similarity losses and their Logit-DP sensitivity constants.

A loss is a function of the n×n similarity matrix Z (Z_ij = cos(Φ(x_i), Φ(x'_j)),
anchors in rows, positives in columns):

    ℒ(Z) = Σ_{i valid} ℓ^{(i,n)}(Z_i)

where the sum runs over the valid rows of an optional (n,) boolean ``mask``
(padded rows and columns of a Poisson batch contribute exactly nothing) and n is
the number of valid pairs.

Sensitivity (Kong, Muñoz Medina & Ribero 2025, Theorem 3.3). Let τ_ij = ∂ℒ/∂Z_ij
and let every pair gradient be clipped to norm B. Removing pair k from a batch of
n pairs changes ḡ = Σ_ij τ_ij ĝ_ij by at most (G1 + G2 + (n−1)·L)·B where

    G1 ≥ Σ_j |τ_kj|                         (row k disappears)
    G2 ≥ Σ_{i≠k} |τ_ik|                     (column k disappears)
    L  ≥ Σ_{j≠k} |τ_ij − τ'_ij|  for i ≠ k  (the other rows' weights move)

(τ' are the weights on the batch without pair k). Each loss below derives its
constants; ``sensitivity_factor(n)`` returns (G1 + G2 + (n−1)L), i.e. C/B.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp

# C/B above which `sensitivity_factor` warns: the noise then swamps any realistic signal.
LARGE_SENSITIVITY_FACTOR = 1e3


class LargeSensitivityWarning(UserWarning):
  """The sensitivity is so large that the added noise will dominate the gradient."""


def _valid_mask(z: jax.Array, mask: jax.Array | None) -> jax.Array:
  if z.ndim != 2 or z.shape[0] != z.shape[1]:
    raise ValueError(f"Z must be a square (n, n) matrix, got shape {z.shape}.")
  if mask is None:
    return jnp.ones((z.shape[0],), dtype=bool)
  mask = jnp.asarray(mask)
  if mask.shape != (z.shape[0],):
    raise ValueError(f"mask must have shape ({z.shape[0]},), got {mask.shape}.")
  return mask.astype(bool)


@dataclasses.dataclass(frozen=True)
class Contrastive:
  r"""Row-wise InfoNCE loss with temperature τ.

      ℓ^{(i,n)}(Z_i) = −log softmax(Z_i / τ)_i = −Z_ii/τ + log Σ_j exp(Z_ij/τ)

  (the sum over j runs over valid columns only).

  Sensitivity derivation (|Z_ij| ≤ 1, logits z = Z/τ so |z_ij| ≤ 1/τ).
  With s_ij = softmax(z_i)_j, τ_ij = ∂ℓ/∂Z_ij = (s_ij − δ_ij)/τ. Let
  a = e^{2/τ} and p = a/(a + n − 1); p bounds every entry of a softmax over
  n columns, since s_ij ≤ e^{1/τ}/(e^{1/τ} + (n−1)e^{−1/τ}) = p.

  * G1: Σ_j |τ_kj| = (1 − s_kk + Σ_{j≠k} s_kj)/τ = 2(1 − s_kk)/τ ≤ 2/τ.
  * G2: Σ_{i≠k} |τ_ik| = Σ_{i≠k} s_ik/τ ≤ (n−1)p/τ.
  * L: for i ≠ k, dropping column k renormalises s'_ij = s_ij/(1 − s_ik), so
    Σ_{j≠k} |s'_ij − s_ij| = s_ik ≤ p, i.e. L ≤ p/τ.

  Hence C/B ≤ (2 + 2(n−1)p)/τ, increasing in n with supremum
  2(1 + a)/τ = 2(1 + e^{2/τ})/τ as n → ∞. The paper's Lemma 3.4 states
  2(1 + (n−2)p); it uses one p for three different quantities, and a batch in
  which row k's diagonal is its least similar entry while every other row's
  column k is its most similar entry attains the larger value above.

  The price of temperature: τ = 1 gives sup C/B ≈ 16.8, τ = 0.5 ≈ 222,
  τ = 0.2 ≈ 2.2·10⁵ (a warning is emitted above 10³).

  Replace-one (pair k replaced, n unchanged; τ̃, s̃ the weights after): row k changes
  whole, Σ_j |τ_kj| + |τ̃_kj| ≤ 4/τ. A row i ≠ k keeps its other columns' logits, so
  s̃_ij/s_ij is one factor for every j ≠ k and Σ_{j≠k} |s_ij − s̃_ij| = |s_ik − s̃_ik|; with
  its column-k terms (s_ik + s̃_ik)/τ the row costs 2·max(s_ik, s̃_ik)/τ ≤ 2p/τ. Hence
  C_rep/B ≤ (4 + 2(n−1)p)/τ = C/B + 2/τ, below 2C/B for every n ≥ 2.

  Removing a set P of k pairs at once (one person's; rows and columns P disappear): each row
  of P costs ≤ 2/τ as above; a row i ∉ P loses the columns P, of softmax mass S_i = Σ_{j∈P} s_ij
  ≤ p_k = k·a/(k·a + n − k), and renormalises, s'_ij = s_ij/(1 − S_i), so its columns P and its
  moved weights cost S_i/τ + S_i/τ. Hence C_k/B ≤ (2k + 2(n−k)p_k)/τ ≤ k·C/B (k = 1: C/B), with
  supremum over n k·2(1 + a)/τ; the configuration û_k = 1, v̂_k = −1 (k ∈ P), û_i = −1, v̂_j = 1
  otherwise attains the weights (docs/METHOD.md, "Privacy per person").
  """

  temperature: float = 1.0
  min_batch_size = 2

  def __post_init__(self):
    t = self.temperature
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
      raise ValueError(f"temperature must be a finite number > 0, got {t!r}.")
    if 2.0 / t > 700.0:
      raise ValueError(f"temperature={t} makes the sensitivity overflow (it grows like "
                       f"2·exp(2/τ)/τ); use τ ≥ {2.0 / 700.0:.4f}.")

  def row_losses(self, z: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Per-row losses ℓ^{(i,n)}(Z_i), zero on invalid rows."""
    valid = _valid_mask(z, mask)
    logits = z / self.temperature
    # Mask columns without producing inf (whose gradient would be NaN).
    safe = jnp.where(valid[None, :], logits, 0.0)
    row_max = jax.lax.stop_gradient(
        jnp.max(jnp.where(valid[None, :], logits, -jnp.inf), axis=1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    exps = jnp.where(valid[None, :], jnp.exp(safe - row_max), 0.0)
    total = jnp.sum(exps, axis=1)
    log_norm = jnp.log(jnp.where(total > 0, total, 1.0)) + row_max[:, 0]
    return jnp.where(valid, log_norm - jnp.diagonal(safe), 0.0)

  def __call__(self, z: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """ℒ(Z) = Σ_i ℓ^{(i,n)}(Z_i) over valid rows."""
    return jnp.sum(self.row_losses(z, mask))

  def sensitivity_factor(self, batch_size: int | None = None) -> float:
    """C/B = (2 + 2(n−1)p)/τ, or its supremum 2(1 + e^{2/τ})/τ when batch_size is None."""
    a = math.exp(2.0 / self.temperature)
    if batch_size is None:
      factor = 2.0 * (1.0 + a) / self.temperature
    else:
      n = check_batch_size(batch_size, self.min_batch_size)
      # (n−1)p = (n−1)a/(a+n−1), written to avoid overflow.
      factor = (2.0 + 2.0 * (n - 1) / (1.0 + (n - 1) / a)) / self.temperature
    return _warn_if_large(factor, f"contrastive loss at temperature {self.temperature}")

  def person_sensitivity_factor(self, max_pairs: int, batch_size: int | None = None) -> float:
    """C_K/B for removing up to K = max_pairs pairs (their rows and columns) at once:
    max_{k ≤ min(K, n)} (2k + 2(n−k)·p_k)/τ with p_k = k·a/(k·a + n − k), or its supremum
    K·2(1 + e^{2/τ})/τ = K·C(∞)/B when batch_size is None (`person_sensitivity`)."""
    k_max = check_batch_size(max_pairs, 1)
    a = math.exp(2.0 / self.temperature)
    if batch_size is None:
      factor = k_max * 2.0 * (1.0 + a) / self.temperature
    else:
      n = check_batch_size(batch_size, self.min_batch_size)
      # (n−k)·p_k = (n−k)·k/(k + (n−k)/a), written to avoid overflow.
      factor = max((2.0 * k + 2.0 * (n - k) * k / (k + (n - k) / a)) / self.temperature
                   for k in range(1,
                                  min(k_max, n) + 1))
    return _warn_if_large(factor, f"contrastive loss at temperature {self.temperature}")

  def replace_sensitivity_factor(self, batch_size: int | None = None) -> float:
    """C_rep/B = (4 + 2(n−1)p)/τ under replace-one, or its supremum (4 + 2e^{2/τ})/τ."""
    a = math.exp(2.0 / self.temperature)
    if batch_size is None:
      factor = (4.0 + 2.0 * a) / self.temperature
    else:
      n = check_batch_size(batch_size, self.min_batch_size)
      factor = (4.0 + 2.0 * (n - 1) / (1.0 + (n - 1) / a)) / self.temperature
    return _warn_if_large(factor, f"contrastive loss at temperature {self.temperature}")


@dataclasses.dataclass(frozen=True)
class Spreadout:
  r"""Spreadout regulariser: pushes non-matching pairs towards orthogonality.

      ℓ^{(i,n)}(Z_i) = Σ_{j≠i} Z_ij² / (n − 1)

  (no temperature; j runs over valid columns, n counts valid pairs; n = 1 gives 0).

  Sensitivity derivation (|Z_ij| ≤ 1): τ_ij = 2Z_ij/(n−1) for j ≠ i, τ_ii = 0.

  * G1: Σ_{j≠k} 2|Z_kj|/(n−1) ≤ 2.
  * G2: Σ_{i≠k} 2|Z_ik|/(n−1) ≤ 2.
  * L: for i ≠ k the remaining n−2 off-diagonal weights change from
    2Z_ij/(n−1) to 2Z_ij/(n−2): Σ ≤ 2(n−2)(1/(n−2) − 1/(n−1)) = 2/(n−1).

  Hence C/B ≤ 2 + 2 + (n−1)·2/(n−1) = 6 for every n.

  Removing a set P of k pairs at once: the k rows of P cost ≤ 2 each, their columns in the
  other rows ≤ 2k(n−k)/(n−1), and the other rows' weights move from 2Z_ij/(n−1) to
  2Z_ij/(n−k−1): ≤ 2k(n−k)/(n−1) in all. Hence C_k/B ≤ 2k + 4k(n−k)/(n−1) ≤ 6k.

  Replace-one (pair k replaced, n unchanged): the weights of every other pair (i, j ≠ k) stay
  2Z_ij/(n−1), so only row k and column k move, each by ≤ 2 + 2: C_rep/B ≤ 8 (attained at
  Z = 1 everywhere with opposite clipped gradients).
  """

  min_batch_size = 2

  def row_losses(self, z: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Per-row losses ℓ^{(i,n)}(Z_i) = Σ_{j≠i} Z_ij² / (n − 1), zero on invalid rows."""
    valid = _valid_mask(z, mask)
    n = z.shape[0]
    off_diagonal = valid[:, None] & valid[None, :] & ~jnp.eye(n, dtype=bool)
    n_valid = jnp.sum(valid)
    denom = jnp.maximum(n_valid - 1, 1).astype(z.dtype)
    squares = jnp.where(off_diagonal, z, 0.0) ** 2
    return jnp.sum(squares, axis=1) / denom

  def __call__(self, z: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """ℒ(Z) = Σ_i ℓ^{(i,n)}(Z_i) over valid rows."""
    return jnp.sum(self.row_losses(z, mask))

  def sensitivity_factor(self, batch_size: int | None = None) -> float:
    """C/B = 6 for every batch size."""
    if batch_size is not None:
      check_batch_size(batch_size, self.min_batch_size)
    return 6.0

  def person_sensitivity_factor(self, max_pairs: int, batch_size: int | None = None) -> float:
    """C_K/B for removing up to K = max_pairs pairs at once: max_{k ≤ min(K, n)}
    (2k + 4k(n−k)/(n−1)), or its supremum 6K when batch_size is None (`person_sensitivity`)."""
    k_max = check_batch_size(max_pairs, 1)
    if batch_size is None:
      return 6.0 * k_max
    n = check_batch_size(batch_size, self.min_batch_size)
    return max(2.0 * k + 4.0 * k * (n - k) / (n - 1) for k in range(1, min(k_max, n) + 1))

  def replace_sensitivity_factor(self, batch_size: int | None = None) -> float:
    """C_rep/B = 8 under replace-one, for every batch size."""
    if batch_size is not None:
      check_batch_size(batch_size, self.min_batch_size)
    return 8.0


def check_batch_size(batch_size, minimum: int) -> int:
  """batch_size as an int ≥ minimum; ValueError otherwise."""
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < minimum:
    raise ValueError(f"batch_size must be an integer ≥ {minimum} or None, got {batch_size!r}.")
  return batch_size


def _warn_if_large(factor: float, what: str) -> float:
  if factor > LARGE_SENSITIVITY_FACTOR:
    warnings.warn(
        f"Logit-DP sensitivity for the {what} is C = {factor:.3g}·B: the Gaussian "
        "noise std σ·C will dwarf the clipped gradient. Consider a larger temperature.",
        LargeSensitivityWarning, stacklevel=3)
  return factor


def contrastive(temperature: float = 1.0) -> Contrastive:
  """InfoNCE loss ℓ^{(i,n)}(Z_i) = −log softmax(Z_i/τ)_i. See `Contrastive`."""
  return Contrastive(float(temperature) if isinstance(temperature, int) else temperature)


def spreadout() -> Spreadout:
  """Spreadout loss ℓ^{(i,n)}(Z_i) = Σ_{j≠i} Z_ij²/(n−1). See `Spreadout`."""
  return Spreadout()

"""L2 sensitivity of the released (summed) gradient, per method.

Formal guarantees. Under the add-or-remove-one-pair neighbouring relation (a
batch X and X with one pair (x_k, x'_k) removed, every other pair unchanged) and
fixed parameters w:

* Logit-DP: ‖ḡ(X) − ḡ(X∖k)‖₂ ≤ C = (G1 + G2 + (n−1)L)·B, with the constants of
  the loss (`losses.Contrastive`, `losses.Spreadout`). The bound holds for the
  summed gradient ḡ = Σ_ij τ_ij·min(1, B/‖g_ij‖)·g_ij whatever the pair
  gradients are, because each clipped term has norm ≤ |τ_ij|·B and the pair
  (i, j) gradient g_ij depends on x_i, x'_j and w only.
* Naive-DP: the whole-batch gradient is clipped to B on both batches, so
  ‖ḡ(X) − ḡ(X∖k)‖₂ ≤ 2B.

Adding N(0, (σC)²I) to ḡ then gives the Gaussian mechanism with noise multiplier σ.
"""

from __future__ import annotations

import math


def check_clip_norm(clip_norm, *, allow_inf: bool) -> float:
  """Returns clip_norm as a float or raises ValueError (≤ 0, NaN, wrong type)."""
  try:
    value = float(clip_norm)
  except (TypeError, ValueError):
    raise ValueError(f"clip_norm must be a positive number, got {clip_norm!r}.") from None
  if math.isnan(value) or value <= 0:
    raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}.")
  if math.isinf(value) and not allow_inf:
    raise ValueError("clip_norm=inf means no clipping: the sensitivity is unbounded and no "
                     "amount of noise makes the release private.")
  return value


def sensitivity(loss, clip_norm: float, batch_size: int | None = None) -> float:
  """L2 sensitivity C of the Logit-DP gradient ḡ (a sum over pairs).

  C = (G1 + G2 + (n−1)L)·B: contrastive (2 + 2(n−1)p)/τ·B with p = a/(a+n−1),
  a = e^{2/τ}; spreadout 6B.

  Args:
    loss: a loss from `logit_dp.losses`.
    clip_norm: B, the per-pair gradient clip norm (finite, > 0).
    batch_size: n, when every batch has exactly n pairs. None returns the
      supremum over n, which is what Poisson sampling (random n) needs.

  Returns:
    C as a Python float.
  """
  b = check_clip_norm(clip_norm, allow_inf=False)
  if not hasattr(loss, "sensitivity_factor"):
    raise ValueError(f"No sensitivity is known for loss {loss!r}; use a loss from logit_dp.losses.")
  return loss.sensitivity_factor(batch_size) * b


def naive_sensitivity(clip_norm: float) -> float:
  """Sensitivity 2B of Naive-DP (the batch gradient clipped to B), add/remove-one."""
  return 2.0 * check_clip_norm(clip_norm, allow_inf=False)


def grouped_sensitivity(clip_norm: float) -> float:
  """Sensitivity 2B of the DP-GCL gradient ḡ = Σ_g clip_B(∇L_g), add/remove one record.

  Adding a record changes one group's clipped gradient from a vector of norm ≤ B to
  another one (both non-zero in general): 2B, as Naive-DP (G = 1 is Naive-DP).
  """
  return 2.0 * check_clip_norm(clip_norm, allow_inf=False)

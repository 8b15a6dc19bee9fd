"""L2 sensitivity of the released (summed) gradient, per method and neighbouring relation.

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

Under zero-out (`REPLACE_SPECIAL`: pair k replaced by a null pair, i.e. masked out) the
batches are those of removal: the same C. Under replace-one (`REPLACE_ONE`: pair k replaced by
another pair, the batch size unchanged; docs/PRIVACY.md, "Replace-one"):

* Logit-DP: C_rep = (2·G1 + 2·G2 + (n−1)·L_rep)·B with the loss's constants
  (`replace_sensitivity_factor`: contrastive (4 + 2(n−1)p)/τ·B, spreadout 8B); a loss without
  them gets 2C, valid for every loss (X → X∖k → X̃ by the triangle inequality).
* Naive-DP and DP-GCL: 2B (both released vectors have norm ≤ B; a replaced record keeps its
  id, hence its group).

Per person (`person_sensitivity`; docs/METHOD.md, "Privacy per person"): a person owns up to K
pairs of a batch, and neighbouring datasets differ by one person with all their pairs. Removing
them removes up to K rows and K columns of Z:

* Logit-DP: C_K(n) = B·max_{k ≤ min(K, n)} (G1_k + G2_k + L_k), the loss's
  ``person_sensitivity_factor`` (contrastive (2k + 2(n−k)p_k)/τ, p_k = k·a/(k·a + n − k);
  spreadout 2k + 4k(n−k)/(n−1)); C_K(n) ≤ K·C(n) and sup_n C_K(n) = K·C(∞). A loss without the
  constant gets K·C(n), valid for every loss (one pair at a time, C increasing in n).
* Naive-DP: 2B (both released vectors have norm ≤ B).
* DP-GCL grouped by person (`grouped_clipped_grad(...)(..., user_ids=)`): 2B, every pair of the
  person is in one group; grouped by pair it is 2B·K (K groups can change), which the audit
  shows (`tests/test_person.py`).

Adding N(0, (σC)²I) to ḡ then gives the Gaussian mechanism with noise multiplier σ under the
relation C is taken for.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np

ADD_OR_REMOVE_ONE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
REPLACE_SPECIAL = dp_accounting.NeighboringRelation.REPLACE_SPECIAL


def check_relation(neighboring_relation) -> dp_accounting.NeighboringRelation:
  """neighboring_relation if it is a `dp_accounting.NeighboringRelation`; TypeError otherwise."""
  if not isinstance(neighboring_relation, dp_accounting.NeighboringRelation):
    raise TypeError("neighboring_relation must be a dp_accounting.NeighboringRelation "
                    "(ADD_OR_REMOVE_ONE, REPLACE_ONE or REPLACE_SPECIAL), got "
                    f"{neighboring_relation!r}.")
  return neighboring_relation


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


def sensitivity(
    loss, clip_norm: float, batch_size: int | None = None, *,
    neighboring_relation: dp_accounting.NeighboringRelation = ADD_OR_REMOVE_ONE) -> float:
  """L2 sensitivity C of the Logit-DP gradient ḡ (a sum over pairs).

  Add-or-remove-one and zero-out: C = (G1 + G2 + (n−1)L)·B, contrastive (2 + 2(n−1)p)/τ·B
  with p = a/(a+n−1), a = e^{2/τ}; spreadout 6B. Replace-one: C_rep = (2G1 + 2G2 +
  (n−1)L_rep)·B, contrastive (4 + 2(n−1)p)/τ·B, spreadout 8B (2C for a loss without
  ``replace_sensitivity_factor``).

  Args:
    loss: a loss from `logit_dp.losses`.
    clip_norm: B, the per-pair gradient clip norm (finite, > 0).
    batch_size: n, when every batch has exactly n pairs. None returns the
      supremum over n, which is what Poisson sampling (random n) needs.
    neighboring_relation: the `dp_accounting.NeighboringRelation` the sensitivity is for.

  Returns:
    C as a Python float.
  """
  b = check_clip_norm(clip_norm, allow_inf=False)
  relation = check_relation(neighboring_relation)
  if not hasattr(loss, "sensitivity_factor"):
    raise ValueError(f"No sensitivity is known for loss {loss!r}; use a loss from logit_dp.losses.")
  if relation is not REPLACE_ONE:
    return loss.sensitivity_factor(batch_size) * b
  if hasattr(loss, "replace_sensitivity_factor"):
    return loss.replace_sensitivity_factor(batch_size) * b
  return 2.0 * loss.sensitivity_factor(batch_size) * b


def naive_sensitivity(
    clip_norm: float, *,
    neighboring_relation: dp_accounting.NeighboringRelation = ADD_OR_REMOVE_ONE) -> float:
  """Sensitivity 2B of Naive-DP (the batch gradient clipped to B) under every relation.

  ḡ(X) and ḡ(X') both have norm ≤ B whatever X and X' are.
  """
  check_relation(neighboring_relation)
  return 2.0 * check_clip_norm(clip_norm, allow_inf=False)


def grouped_sensitivity(
    clip_norm: float, *,
    neighboring_relation: dp_accounting.NeighboringRelation = ADD_OR_REMOVE_ONE) -> float:
  """Sensitivity 2B of the DP-GCL gradient ḡ = Σ_g clip_B(∇L_g) under every relation.

  Adding, removing or replacing a record changes one group's clipped gradient from a vector
  of norm ≤ B to another one (both non-zero in general): 2B, as Naive-DP (G = 1 is Naive-DP).
  A replaced record keeps its group because groups hash the record id (the sampler's index
  of the record), which replacement keeps.
  """
  check_relation(neighboring_relation)
  return 2.0 * check_clip_norm(clip_norm, allow_inf=False)


def check_max_pairs_per_user(max_pairs_per_user) -> int:
  """max_pairs_per_user as an int K ≥ 1; ValueError otherwise."""
  if (isinstance(max_pairs_per_user, bool) or not isinstance(max_pairs_per_user, (int, np.integer))
      or max_pairs_per_user < 1):
    raise ValueError("max_pairs_per_user must be an integer ≥ 1 (K, the most pairs of one person "
                     f"in a batch), got {max_pairs_per_user!r}.")
  return int(max_pairs_per_user)


def person_sensitivity(
    loss, clip_norm: float, max_pairs_per_user: int, batch_size: int | None = None, *,
    neighboring_relation: dp_accounting.NeighboringRelation = ADD_OR_REMOVE_ONE) -> float:
  """L2 sensitivity C_K of the Logit-DP gradient ḡ when one person, with up to K pairs in the
  batch, is added or removed.

  Removing the person's k ≤ K pairs removes k rows and k columns of the similarity matrix:

      C_K(n) = B·max_{k ≤ min(K, n)} (G1_k + G2_k + L_k),

  contrastive (2k + 2(n−k)·p_k)/τ with p_k = k·a/(k·a + n − k), a = e^{2/τ}; spreadout
  2k + 4k(n−k)/(n−1) (proof: `losses.Contrastive`, `losses.Spreadout`, docs/METHOD.md). It is at
  most K·C(n) (equal for K = 1), and its supremum over n, what Poisson sampling needs
  (batch_size=None), is K·C(∞): for an unbounded batch the person costs K single pairs.
  A loss without ``person_sensitivity_factor`` gets K·C(n): removing the pairs one at a time
  moves ḡ by ≤ C(n) each. Replace-one (a person replaced by another with up to K pairs): 2·C_K,
  by the triangle inequality through the batch without the person.

  Args:
    loss: a loss from `logit_dp.losses`.
    clip_norm: B, the per-pair gradient clip norm (finite, > 0).
    max_pairs_per_user: K ≥ 1, the most pairs one person brings to a batch.
    batch_size: n, when every batch has exactly n pairs; None: the supremum over n.
    neighboring_relation: the `dp_accounting.NeighboringRelation`, with a person as the unit.

  Returns:
    C_K as a Python float.
  """
  b = check_clip_norm(clip_norm, allow_inf=False)
  k = check_max_pairs_per_user(max_pairs_per_user)
  relation = check_relation(neighboring_relation)
  if not hasattr(loss, "sensitivity_factor"):
    raise ValueError(f"No sensitivity is known for loss {loss!r}; use a loss from logit_dp.losses.")
  if hasattr(loss, "person_sensitivity_factor"):
    factor = loss.person_sensitivity_factor(k, batch_size)
  else:
    factor = k * loss.sensitivity_factor(batch_size)
  return (2.0 if relation is REPLACE_ONE else 1.0) * factor * b

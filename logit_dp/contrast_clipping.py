"""Contrast clipping: clip D_ij = g_ij − g_ii instead of g_ij (a Logit-DP variant).

A reference for measurements on dense per-example Jacobians, not a mechanism: `logit_dp` does
not import it (``import logit_dp.contrast_clipping``). The contrasts' norms are materialised,
exact from Grams, or bounded from per-record Grams (`NORMS`). docs/METHOD.md, "Contrast
clipping", gives the sensitivity proof, the Gram form, the bound and the audits;
docs/results_in_detail.md the signal-to-noise measurements that rule it out as a mechanism.
"""

from logit_dp._src.contrast_clipping import CLIP_TERMS
from logit_dp._src.contrast_clipping import NORMS
from logit_dp._src.contrast_clipping import DenseBatch
from logit_dp._src.contrast_clipping import clipped_sums
from logit_dp._src.contrast_clipping import contrast_clipped_grad
from logit_dp._src.contrast_clipping import contrast_sensitivity
from logit_dp._src.contrast_clipping import contrast_sensitivity_factor
from logit_dp._src.contrast_clipping import dense_batch
from logit_dp._src.contrast_clipping import group_sums
from logit_dp._src.contrast_clipping import removal_gaps
from logit_dp._src.contrast_clipping import search_worst_case

__all__ = [
    "CLIP_TERMS",
    "DenseBatch",
    "NORMS",
    "clipped_sums",
    "contrast_clipped_grad",
    "contrast_sensitivity",
    "contrast_sensitivity_factor",
    "dense_batch",
    "group_sums",
    "removal_gaps",
    "search_worst_case",
]

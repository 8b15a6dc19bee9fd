"""The baselines Logit-DP is compared with: Naive-DP and DP-GCL.

* Naive-DP (`naive_clipped_grad`): the whole-batch gradient clipped to B; sensitivity
  `naive_sensitivity` = 2B.
* DP-GCL (`grouped_clipped_grad`): the records split into groups (`assign_groups`), each
  group's loss gradient clipped to B; sensitivity `grouped_sensitivity` = 2B.

Both return a `logit_dp.ClippedGradFn`, noised like Logit-DP's with `logit_dp.transform`.
"""

from logit_dp._src.clipping import naive_clipped_grad
from logit_dp._src.grouped import assign_groups
from logit_dp._src.grouped import grouped_clipped_grad
from logit_dp._src.grouped import grouped_sensitivity
from logit_dp._src.sensitivity import naive_sensitivity

__all__ = [
    "assign_groups",
    "grouped_clipped_grad",
    "grouped_sensitivity",
    "naive_clipped_grad",
    "naive_sensitivity",
]

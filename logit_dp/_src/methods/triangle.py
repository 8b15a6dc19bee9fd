""""triangle": clips by the upper bound ‖J_iᵀv̂_j‖ + ‖J'_jᵀû_i‖ ≥ ‖g_ij‖ (`bounds`).

Cheaper than "ghost" (per-example Grams only), private, and clips more than needed: the
negative pairs more than the exact diagonal, which for the contrastive loss biases ḡ towards
collapsed embeddings when most pairs are clipped (docs/METHOD.md). Two towers that share no
parameter get exact norms at this cost (`towers.pair_norms`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from logit_dp._src.methods import base
from logit_dp._src.methods import bounds
from logit_dp._src.methods import towers


@dataclasses.dataclass(frozen=True)
class Triangle(base.ClipMethod):
  """The triangle bound from per-example Grams; diagonal pairs from their vectors."""
  name: ClassVar[str] = "triangle"

  def pair_norms_with_factors(self, batch, allowance) -> base.NormsAndFactors:
    """See `base.ClipMethod.pair_norms_with_factors`."""
    if batch.two_tower:
      return towers.pair_norms(batch, None, allowance=allowance)
    return bounds.bound_norms(batch, allowance), None

  def embeds_with_factors(self, batch) -> bool:
    """See `base.ClipMethod.embeds_with_factors`: two towers in one microbatch
    (`towers.one_microbatch`)."""
    return batch.two_tower and towers.one_microbatch(batch)


jax.tree_util.register_dataclass(Triangle, data_fields=[], meta_fields=[])

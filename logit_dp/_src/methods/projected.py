""""projected": the triangle bound made exact on the Jacobian subspace of public inputs.

The Jacobians of PUBLIC reference inputs at the current params span a subspace Q̃ (of
dimension k, `projection.basis`); on it the pair norm is computed exactly, off it the
triangle bound is used (`projection.bound`). Q̃ never depends on the private batch, so each
pair's clip factor depends on that pair only. bound/norm ≈ 1.1 where triangle's is ≈ 5.7
(docs/METHOD.md). One tower only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax

from logit_dp._src.methods import base
from logit_dp._src.methods import bounds


@dataclasses.dataclass(frozen=True)
class Projected(base.ClipMethod):
  """The projected bound.

  Attributes:
    reference_inputs: public inputs (examples along axis 0, like x), checked by
      `checks.check_projection`.
    rank: k, the dimension of the subspace.
  """
  name: ClassVar[str] = "projected"
  reference_inputs: Any
  rank: int

  def pair_norms_with_factors(self, batch, allowance) -> base.NormsAndFactors:
    """See `base.ClipMethod.pair_norms_with_factors`."""
    if batch.two_tower:  # refused by `checks.check_projection` before any batch exists
      raise ValueError("method='projected' supports one tower.")
    return bounds.bound_norms(batch, allowance, (self.reference_inputs, self.rank)), None


jax.tree_util.register_dataclass(Projected, data_fields=["reference_inputs"], meta_fields=["rank"])

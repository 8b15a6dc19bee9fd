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
import jax.numpy as jnp
import numpy as np

from logit_dp._src import checks
from logit_dp._src import precision
from logit_dp._src import projection
from logit_dp._src import rows as rows_lib
from logit_dp._src import stochastic
from logit_dp._src.methods import base
from logit_dp._src.methods import bounds

DEFAULT_RANK = 32


@dataclasses.dataclass(frozen=True)
class Projected(base.ClipMethod):
  """The projected bound.

  Attributes:
    reference_inputs: PUBLIC inputs (examples along axis 0, like x; required), e.g. 64
      images of a public data set. Their Jacobians at the current params span the subspace
      Q̃, which never depends on the private batch; they cost m·d·p floats (m examples,
      p parameters). Checked (finite, at least one example) when the method meets its model.
    rank: k, the dimension of the subspace (a positive integer; at most m·d are used); the
      per-example projections hold n·d·k floats.
  """
  name: ClassVar[str] = "projected"
  reference_inputs: Any = None
  rank: int = DEFAULT_RANK

  def __post_init__(self):
    if self.reference_inputs is None:
      raise ValueError("method='projected' needs reference_inputs: a few PUBLIC inputs (examples "
                       "along axis 0) whose Jacobians span the subspace of its bound, e.g. "
                       "clip_methods.Projected(reference_inputs=public_x[:64]).")
    object.__setattr__(self, "rank", projection.check_rank(self.rank))

  def for_model(self, embed_fn, positive_embed_fn) -> Projected:
    """See `base.ClipMethod.for_model`: one tower only; the reference inputs as float arrays."""
    if positive_embed_fn is not None and positive_embed_fn is not embed_fn:
      raise ValueError("method='projected' supports one tower; with two towers use 'triangle' "
                       "(exact for towers sharing no parameter) or 'ghost'.")
    reference = checks.as_inputs(self.reference_inputs, "reference_inputs", np)
    if rows_lib.num_rows(reference) < 1:
      raise ValueError("reference_inputs must hold at least one example.")
    for leaf in jax.tree_util.tree_leaves(reference):
      if not np.all(np.isfinite(leaf)):
        raise ValueError("reference_inputs must be finite (they are public inputs, not masked).")
    return dataclasses.replace(
        self, reference_inputs=precision.widen(jax.tree_util.tree_map(jnp.asarray, reference)))

  def with_key(self, key) -> Projected:
    """See `base.ClipMethod.with_key`: the public reference inputs keyed as view 2
    (`stochastic.reference_inputs`; any subspace keeps the bound valid)."""
    if key is None:
      return self
    return _unchecked(stochastic.reference_inputs(self.reference_inputs, key), self.rank)

  def pair_norms_with_factors(self, batch, allowance) -> base.NormsAndFactors:
    """See `base.ClipMethod.pair_norms_with_factors`."""
    if batch.two_tower:  # refused by `for_model` before any batch exists
      raise ValueError("method='projected' supports one tower.")
    return bounds.bound_norms(batch, allowance, (self.reference_inputs, self.rank)), None


def _unchecked(reference_inputs, rank: int) -> Projected:
  """A `Projected` of already checked (or traced) options, made without checking them."""
  method = object.__new__(Projected)
  object.__setattr__(method, "reference_inputs", reference_inputs)
  object.__setattr__(method, "rank", rank)
  return method


# The reference inputs are a leaf (traced under jit), the rank static; unflattening (with
# tracers or placeholders for the inputs) does not check them again.
jax.tree_util.register_pytree_node(Projected, lambda m: ((m.reference_inputs,), m.rank),
                                   lambda rank, leaves: _unchecked(leaves[0], rank))

"""The interface every clip method implements: `ClipMethod`."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import jax

from logit_dp._src import layerwise
from logit_dp._src import numerics
from logit_dp._src import pair_batch

#: (norms (n_local, n), Jacobian factors of the local rows of both views, or None).
NormsAndFactors = tuple[jax.Array, tuple[layerwise.Factors, ...] | None]


class ClipMethod(abc.ABC):
  """How Logit-DP finds the norms it clips the pair gradients g_ij = ∇_w Z_ij by.

  A method is a frozen dataclass holding its options and registered as a pytree (array
  options, such as public reference inputs, are leaves; the rest is static), so that it can be
  passed to jitted functions. It computes, for a `pair_batch.PairBatch` (one tower or two: the
  batch's plans say which):

  * `pair_norms`: the (n_local, n) norms ‖g_ij‖, or upper bounds of them, that clipping uses;
  * `clipped_grad`: ḡ = Σ_ij τ_ij·min(1, B/‖g_ij‖)·g_ij, summed over devices;
  * `clipped_grad_and_norms`: ḡ and the norms it was clipped by (for `ClipStats`).

  Every norm is at or above the true ‖g_ij‖ (with the float allowances of `numerics`), so
  each clipped pair gradient has norm ≤ B and ḡ has the sensitivity `logit_dp.sensitivity`.
  """

  name: ClassVar[str]

  @abc.abstractmethod
  def pair_norms_with_factors(self, batch: pair_batch.PairBatch,
                              allowance: float) -> NormsAndFactors:
    """(norms (n_local, n), factors of the local rows of both views, or None).

    allowance scales the float allowances (1: what clipping uses; 0: none). The factors
    are returned when computing the norms produced them, so that ḡ is contracted from them
    instead of backward passes.
    """

  def embeds_with_factors(self, batch: pair_batch.PairBatch) -> bool:
    """Whether `batch` (one tower, views of one layout; its embeddings not yet computed) should
    take its embeddings from one pass that also computes both views' Jacobian factors, which
    this method then contracts (`pair_batch.PairBatch.joint_factors`): no forward pass of
    their own is compiled or run. False unless a method overrides it."""
    del batch
    return False

  def pair_norms(self, batch: pair_batch.PairBatch, allowance: float = 1.0) -> jax.Array:
    """The (n_local, n) norms clipping uses: ‖g_ij‖ or an upper bound, plus the allowances."""
    return self.pair_norms_with_factors(batch, allowance)[0]

  def clipped_grad(self, batch: pair_batch.PairBatch, tau_local: jax.Array,
                   clip_norm: float) -> Any:
    """ḡ = Σ_ij λ_ij g_ij with λ_ij = τ_ij·min(1, B/‖g_ij‖), summed over devices.

    tau_local: (n_local, n), τ_ij = ∂ℒ/∂Z_ij for this device's rows i and all columns j.
    """
    norms, factors = self.pair_norms_with_factors(batch, 1.0)
    lam_local = tau_local * numerics.clip_factor(norms, clip_norm)
    return batch.weighted_backward(lam_local, batch.c.gather(lam_local), factors)

  def clipped_grad_and_norms(self, batch: pair_batch.PairBatch, tau_local: jax.Array,
                             clip_norm: float) -> tuple[Any, jax.Array]:
    """(ḡ of `clipped_grad`, the (n_local, n) norms it clipped by), from one computation."""
    norms, factors = self.pair_norms_with_factors(batch, 1.0)
    lam_local = tau_local * numerics.clip_factor(norms, clip_norm)
    return batch.weighted_backward(lam_local, batch.c.gather(lam_local), factors), norms

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

  A method is a frozen dataclass holding its options, checked when it is made, and registered
  as a pytree (array options, such as public reference inputs, are leaves; the rest is static),
  so that it can be passed to jitted functions. Its class is registered under its `name`
  (`methods.register`), which `clipped_grad` and `make_private` resolve to the default object.
  It computes, for a `pair_batch.PairBatch` (one tower or two: the batch's plans say which):

  * `pair_norms_with_factors` (the one method to implement): the (n_local, n) norms ‖g_ij‖,
    or upper bounds of them, that clipping uses;
  * `norms_and_clipped_grad`: those norms and ḡ = Σ_ij τ_ij·min(1, B/‖g_ij‖)·g_ij, summed
    over devices (by default one backward pass weighted by λ_ij);
  * `for_model` and `with_key`: the method checked against the model, and for a stochastic
    model's key (by default the method itself).

  Every norm is at or above the true ‖g_ij‖ (with the float allowances of `numerics`), so
  each clipped pair gradient has norm ≤ B and ḡ has the sensitivity `logit_dp.sensitivity`.
  """

  name: ClassVar[str]
  #: Whether the method builds on the engine's per-layer factors (`layerwise.make_plan`);
  #: False: every per-example Jacobian comes from `jax.jacrev` of the model as it is.
  layer_factors: ClassVar[bool] = True

  def for_model(self, embed_fn, positive_embed_fn) -> ClipMethod:
    """This method as it clips the model embed_fn (and positive_embed_fn, the tower of x_prime,
    or None): its options checked against the model, ValueError when it cannot clip it."""
    del embed_fn, positive_embed_fn
    return self

  def with_key(self, key) -> ClipMethod:
    """This method for a stochastic model embedded with `key` (`stochastic`); None: itself."""
    del key
    return self

  @abc.abstractmethod
  def pair_norms_with_factors(self, batch: pair_batch.PairBatch,
                              allowance: float) -> NormsAndFactors:
    """(norms (n_local, n), factors of the local rows of both views, or None).

    allowance scales the float allowances (1: what clipping uses; 0: none). The factors
    are returned when computing the norms produced them, so that ḡ is contracted from them
    instead of backward passes.
    """

  def embeds_with_factors(self, batch: pair_batch.PairBatch) -> bool:
    """Whether `batch` (one tower with views of one layout, or two towers; its plans made,
    its embeddings not yet computed) should take its embeddings from the passes that also
    compute both views' Jacobian factors, which this method then contracts
    (`pair_batch.PairBatch.joint_factors`):
    no forward pass of their own is compiled or run. False unless a method overrides it."""
    del batch
    return False

  def pair_norms(self, batch: pair_batch.PairBatch, allowance: float = 1.0) -> jax.Array:
    """The (n_local, n) norms clipping uses: ‖g_ij‖ or an upper bound, plus the allowances."""
    return self.pair_norms_with_factors(batch, allowance)[0]

  def norms_and_clipped_grad(self, batch: pair_batch.PairBatch, tau_local: jax.Array,
                             clip_norm: float) -> tuple[jax.Array, Any]:
    """(norms (n_local, n) of `pair_norms`, ḡ), from one computation.

    ḡ = Σ_ij λ_ij g_ij with λ_ij = τ_ij·min(1, B/‖g_ij‖), summed over devices.
    tau_local: (n_local, n), τ_ij = ∂ℒ/∂Z_ij for this device's rows i and all columns j.
    """
    return clipped_by(batch, *self.pair_norms_with_factors(batch, 1.0), tau_local, clip_norm)

  def clipped_grad(self, batch: pair_batch.PairBatch, tau_local: jax.Array,
                   clip_norm: float) -> Any:
    """ḡ of `norms_and_clipped_grad`."""
    return self.norms_and_clipped_grad(batch, tau_local, clip_norm)[1]


def clipped_by(batch: pair_batch.PairBatch, norms: jax.Array, factors, tau_local: jax.Array,
               clip_norm: float) -> tuple[jax.Array, Any]:
  """(norms, ḡ = Σ_ij λ_ij g_ij) with λ_ij = τ_ij·min(1, B/‖g_ij‖) for the norms of
  `pair_norms_with_factors` (and its factors, or None: backward passes), summed over devices."""
  lam_local = tau_local * numerics.clip_factor(norms, clip_norm)
  return norms, batch.weighted_backward(lam_local, batch.c.gather(lam_local), factors)

"""One call that sets up private training: `make_private`.

The by-hand path (`clipped_grad`, `sensitivity`, `accounting.noise_multiplier`,
`transform`, `PoissonSampler`, `PrivacyLedger`) stays available; this module
only wires those pieces together so that σ, C, q, T, the sampler and the ledger
cannot disagree, and so that the noise key and the sampling seed are secret
unless fixed on purpose.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from logit_dp._src import accounting
from logit_dp._src import clipping
from logit_dp._src import distributed
from logit_dp._src import mechanisms
from logit_dp._src import sensitivity as sensitivity_lib
from logit_dp._src.ledger import PrivacyLedger
from logit_dp._src.sampling import PoissonSampler

#: Methods accepted by `make_private`: the Logit-DP ones and the Naive-DP baseline.
PRIVATE_METHODS = mechanisms.PRIVATE_METHODS


class PrivateTraining(NamedTuple):
  """Everything a private training loop needs, consistent by construction.

  Attributes:
    grad_fn: a `ClippedGradFn`, grad_fn(params, x, x_prime, mask) -> (ℒ, ḡ), ḡ the SUM
      of clipped pair gradients (`clipped_grad`) or the clipped batch gradient
      (`naive_clipped_grad` for method="naive"); ``grad_fn.mechanism`` says which.
    optimizer: optax chain ḡ → + N(0, (σC)²) → [× 1/E[n] if mean] → optimizer.
      Its state holds the noise key: checkpoint it, keep it secret.
    sampler: the Poisson sampler (rate q, secret seed); batch t = sampler(t).
    ledger: the privacy ledger (σ, q, δ, budget ε); call
      ``ledger.record_steps(1)`` before releasing each update.
    noise_multiplier: σ, the smallest σ with ε(σ, δ, q, T) ≤ target ε.
    sensitivity: C of ḡ under add/remove one pair, for any batch size.
    clip_norm: B.
    sampling_rate: q = expected_batch_size / num_records.
    steps: T, the number of steps σ is calibrated for.
    method: the gradient method ("ghost", "triangle", "projected", "materialize", "naive").
  """
  grad_fn: Callable
  optimizer: optax.GradientTransformation
  sampler: PoissonSampler
  ledger: PrivacyLedger
  noise_multiplier: float
  sensitivity: float
  clip_norm: float
  sampling_rate: float
  steps: int
  method: str


def _check_count(name: str, value) -> int:
  if isinstance(value, bool):
    raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  try:
    out = int(value)
  except (TypeError, ValueError, OverflowError):
    raise ValueError(f"{name} must be a positive integer, got {value!r}.") from None
  if out != value or out < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  return out


def _secret_seed() -> int:
  # `secrets` on process 0, shared with every process (one noise key, one sampler for all).
  return distributed.broadcast_seed()


def make_private(embed_fn: Callable, loss, clip_norm: float, *, target_epsilon: float,
                 target_delta: float, num_records: int, expected_batch_size: float,
                 optimizer: optax.GradientTransformation, epochs: float | None = None,
                 steps: int | None = None, method: str = "ghost", mean: bool = False,
                 microbatch_size: int | None = None, accountant: str = "pld", noise_key: Any = None,
                 sampler_seed: int | None = None, max_batch_size: int | None = None,
                 overflow: str = "error", **grad_kwargs) -> PrivateTraining:
  """Sets up (ε, δ)-DP training in one call, as Opacus' `make_private_with_epsilon`.

  q = expected_batch_size / num_records; T = steps, or ⌈epochs / q⌉;
  σ = `accounting.noise_multiplier(ε, δ_acc, q, T, accountant)` with δ_acc = δ minus
  the padded batches' overflow term (`PrivacyLedger.calibrated`);
  C = `sensitivity(loss, B, batch_size=None)` (`naive_sensitivity(B)` = 2B for
  method="naive"); optimizer = chain(`transform(σ, C, noise_key)`,
  [`optax.scale(1 / expected_batch_size)` if mean], optimizer). The noise is
  added to the summed ḡ first; the mean and the optimizer are post-processing.

  Formal guarantees. Neighbouring datasets differ by adding or removing one
  pair record (x_i, x'_i) (`dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE`).
  If every step draws its batch with ``sampler`` (Poisson sampling at rate q,
  secret seed), computes ḡ with ``grad_fn`` (L2 sensitivity ≤ C for every batch
  size, C = `logit_dp.sensitivity(loss, B, batch_size=None)`), updates through
  ``optimizer`` (fresh N(0, (σC)²I) per step from a secret key), and takes at
  most T steps, the released updates (and all models computed from them) are
  (ε, δ′)-DP with ε ≤ target_epsilon and δ′ = δ_acc + the sampler's overflow
  term ≤ target_delta, which ``ledger.guarantee()`` reports (see docs/PRIVACY.md
  for the conditions on embed_fn and what is not covered).

  Args:
    embed_fn: embed_fn(params, x) -> (n, d), acting on examples independently.
    loss: a loss from `logit_dp.losses`.
    clip_norm: B > 0, finite.
    target_epsilon, target_delta: the (ε, δ) to reach after T steps.
    num_records: N, the number of pair records.
    expected_batch_size: E[n] = q·N of the Poisson batches.
    optimizer: any optax optimizer; it receives the noisy ḡ (or ḡ / E[n]).
    epochs, steps: exactly one; epochs gives T = ⌈epochs / q⌉.
    method: "ghost" (default), "triangle", "projected" (needs reference_inputs= in
      grad_kwargs), "materialize" or "naive" (Naive-DP).
    mean: scale the noisy sum by 1 / expected_batch_size before the optimizer.
    microbatch_size: passed to `clipped_grad` / `naive_clipped_grad`.
    accountant: "pld" (default) or "rdp", used for σ and by the ledger.
    noise_key: JAX PRNG key of the noise; None draws one with `secrets`
      (multi-host: on process 0, shared with every process; `broadcast_seed`).
      Fixing it makes runs reproducible and voids the guarantee against
      whoever knows it.
    sampler_seed: integer seed of the Poisson sampler; None draws one with
      `secrets`, as noise_key (read it from ``sampler.seed`` to resume; keep
      it secret).
    max_batch_size, overflow: passed to `PoissonSampler`.
    **grad_kwargs: other `clipped_grad` arguments (pair_block_size, cosine_eps,
      reference_inputs and projection_rank for "projected";
      positive_embed_fn for a two-tower model, with the same C).

  Returns:
    A `PrivateTraining`.
  """
  if not callable(embed_fn):
    raise ValueError(f"embed_fn must be callable, got {embed_fn!r}.")
  mechanisms.check_method(method, PRIVATE_METHODS)
  if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
    raise ValueError(f"optimizer must be an optax.GradientTransformation, got {optimizer!r}.")
  if not isinstance(mean, bool):
    raise ValueError(f"mean must be True or False, got {mean!r}.")
  if (epochs is None) == (steps is None):
    raise ValueError("Pass exactly one of epochs and steps, got "
                     f"epochs={epochs!r}, steps={steps!r}.")
  eps = accounting.check_epsilon(target_epsilon)
  delta = accounting.check_delta(target_delta)
  n = _check_count("num_records", num_records)
  accounting.check_accountant(accountant)
  q = accounting.sampling_rate_for(expected_batch_size, n)
  t = accounting.check_steps(steps) if epochs is None else accounting.steps_for_epochs(epochs, q)
  if sampler_seed is not None and (isinstance(sampler_seed, bool)
                                   or not isinstance(sampler_seed, int) or sampler_seed < 0):
    raise ValueError(f"sampler_seed must be an integer ≥ 0 or None, got {sampler_seed!r}.")
  b = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=False)

  grad_fn = clipping.private_grad(embed_fn, loss, b, method, microbatch_size=microbatch_size,
                                  **grad_kwargs)
  c = grad_fn.sensitivity(batch_size=None)

  accounting.warn_if_large_delta(delta, n, stacklevel=3)
  sampler = PoissonSampler(num_records=n, sampling_rate=q, max_batch_size=max_batch_size,
                           seed=_secret_seed() if sampler_seed is None else sampler_seed,
                           overflow=overflow)
  with warnings.catch_warnings():  # δ ≥ 1/N was already reported above, once
    warnings.filterwarnings("ignore", message="target_delta=", category=UserWarning)
    ledger = PrivacyLedger.calibrated(sampler, eps, delta, t, accountant)
  sigma = ledger.noise_multiplier
  key = jax.random.key(_secret_seed()) if noise_key is None else noise_key
  scale_by = float(expected_batch_size) if mean else None
  tx = distributed.make_private_optimizer(sigma, c, key, optimizer, expected_batch_size=scale_by)
  return PrivateTraining(grad_fn=grad_fn, optimizer=tx, sampler=sampler, ledger=ledger,
                         noise_multiplier=sigma, sensitivity=c, clip_norm=b, sampling_rate=q,
                         steps=t, method=method)

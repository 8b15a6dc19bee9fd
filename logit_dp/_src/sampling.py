"""Batch samplers: Poisson sampling that matches the accounting, and shuffling.

Logit-DP's accounting (`logit_dp.accounting`) assumes *Poisson sampling*: at
every step each of the N records joins the batch independently with
probability q, so the batch size is random, n ~ Binomial(N, q). Under `jit`
shapes must be static, so a batch is returned padded to a fixed
``max_batch_size`` together with a validity mask; padded rows must be passed to
`logit_dp.clipped_grad(..., mask=mask)`, which makes them contribute nothing to
the loss, to τ_ij and to ḡ. Because n is random, the noise must be calibrated
to ``logit_dp.sensitivity(loss, clip_norm, batch_size=None)``, the supremum of
the sensitivity over all batch sizes.

Overflow. A Poisson batch larger than ``max_batch_size`` cannot be represented.
The samplers never change the guarantee silently:

* ``overflow="error"`` (default): the host-side sampler raises
  `BatchOverflowError`; the jittable `poisson_batch` returns an ``overflow``
  flag that the caller must check (`check_overflow`).
* ``overflow="truncate"``: the batch keeps the ``max_batch_size`` sampled records
  with the smallest indices.

Formal guarantees of overflow handling. Let M* be the ideal mechanism (exact
Poisson batches, never truncated) and M the implemented one. Run both with the
same random bits: their T-step transcripts coincide unless some step's sample
exceeds ``max_batch_size``, an event whose probability depends only on the
sampling bits and is at most η = T·p_over with p_over = P[Binomial(N+1, q) >
max_batch_size] (N+1 covers the larger of two neighbouring datasets). So
TV(M(D), M*(D)) ≤ η for every dataset D of at most N+1 records, and if M* is
(ε, δ)-DP then for every event S,

    P[M(D) ∈ S] ≤ P[M*(D) ∈ S] + η ≤ e^ε P[M*(D') ∈ S] + δ + η
               ≤ e^ε P[M(D') ∈ S] + δ + (1 + e^ε)·η,

i.e. M is (ε, δ + (1 + e^ε)·T·p_over)-DP. This holds for both policies ("error"
also reveals the overflow event, by aborting) and is what
`overflow_delta` returns and `PrivacyLedger` adds to δ. The default
``max_batch_size`` makes p_over ≤ 1e-12, so the extra δ is small (≈ 1.3e-7
for N = 50,000, q = 0.02, T = 1000, ε = 5); choose a smaller p_over for very
long runs or very small δ. After a `BatchOverflowError`, do not simply rerun
with another seed: the aborted run is a release too; raise ``max_batch_size``
and resume from the last checkpoint (same seed, same steps) instead.
We do not use the truncation-specific amplification analysis of
`dp_accounting.TruncatedSubsampledGaussianDpEvent`: it assumes random-subset
truncation and a decomposable sum, whose sensitivity is not the Logit-DP one.

For non-private baselines, `ShuffledBatcher` visits every record exactly once
per epoch. Its batches are *not* Poisson samples and are not covered by the
accounting.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

OVERFLOW_POLICIES = ("error", "truncate")

#: Default per-step probability (for a dataset of N+1 records) that a Poisson
#: batch exceeds the padded size chosen by `max_batch_size_for`.
DEFAULT_OVERFLOW_PROBABILITY = 1e-12


class BatchOverflowError(RuntimeError):
  """A Poisson batch had more records than max_batch_size (overflow="error")."""


class PoissonBatch(NamedTuple):
  """A padded Poisson batch.

  Attributes:
    indices: int32[max_batch_size], the sampled record indices in increasing
      order, followed by 0 in padded slots.
    mask: bool[max_batch_size], True for the first ``batch_size`` slots.
    batch_size: int32 scalar, the number of valid slots (≤ max_batch_size).
    sampled_size: int32 scalar, the Poisson sample size before any truncation.
    overflow: bool scalar, sampled_size > max_batch_size.
  """
  indices: jax.Array
  mask: jax.Array
  batch_size: jax.Array
  sampled_size: jax.Array
  overflow: jax.Array


def _check_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool):
    raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}.")
  try:
    out = int(value)
  except (TypeError, ValueError, OverflowError):
    raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}.") from None
  if out != value or out < minimum:
    raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}.")
  return out


def _check_rate(sampling_rate) -> float:
  try:
    q = float(sampling_rate)
  except (TypeError, ValueError):
    raise ValueError(f"sampling_rate must be a number in (0, 1], got {sampling_rate!r}.") from None
  if not 0 < q <= 1:
    raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}.")
  return q


def overflow_probability(num_records: int, sampling_rate: float, max_batch_size: int) -> float:
  """p_over = P[Binomial(N + 1, q) > max_batch_size].

  The per-step probability that a Poisson batch from a dataset of N records or
  any neighbour of it (≤ N + 1 records) does not fit in ``max_batch_size``.
  """
  from scipy import stats  # pylint: disable=g-import-not-at-top
  n = _check_int("num_records", num_records, 1)
  q = _check_rate(sampling_rate)
  b = _check_int("max_batch_size", max_batch_size, 1)
  return float(stats.binom.sf(b, n + 1, q))


def max_batch_size_for(num_records: int, sampling_rate: float, *,
                       overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY,
                       multiple_of: int = 1) -> int:
  """Smallest padded batch size b with P[Binomial(N+1, q) > b] ≤ overflow_probability.

  The quantile is computed with scipy (``binom.isf``) and checked exactly with
  ``binom.sf``; the result is rounded up to a multiple of ``multiple_of`` (e.g. 8
  for accelerator-friendly shapes) and capped at N + 1, where overflow is
  impossible. Example: N = 50,000, q = 0.02 (mean 1000, sd ≈ 31) gives b = 1228
  at the default p_over = 1e-12.
  """
  from scipy import stats  # pylint: disable=g-import-not-at-top
  n = _check_int("num_records", num_records, 1)
  q = _check_rate(sampling_rate)
  m = _check_int("multiple_of", multiple_of, 1)
  p = float(overflow_probability)
  if not 0 < p < 1:
    raise ValueError(f"overflow_probability must be in (0, 1), got {overflow_probability!r}.")
  if q == 1.0:
    b = n + 1
  else:
    b = int(stats.binom.isf(p, n + 1, q))
    b = max(b, 0)
    while b > 0 and stats.binom.sf(b - 1, n + 1, q) <= p:
      b -= 1
    while stats.binom.sf(b, n + 1, q) > p:
      b += 1
  b = max(b, 1)
  b = -(-b // m) * m
  return min(b, -(-(n + 1) // m) * m)


def overflow_term(epsilon: float, steps: int, overflow_probability: float) -> float:
  """(1 + e^ε)·(1 − (1 − p_over)^T), the δ added by T padded steps that each overflow with
  probability p_over (module docstring); 0 when p_over = 0 or T = 0."""
  p = float(overflow_probability)
  if not 0 <= p < 1:
    raise ValueError(f"overflow_probability must be in [0, 1), got {overflow_probability!r}.")
  t = _check_int("steps", steps, 0)
  if p == 0.0 or t == 0:
    return 0.0
  eta = -math.expm1(t * math.log1p(-p))
  return min(1.0, (1.0 + math.exp(min(float(epsilon), 700.0))) * eta)


def overflow_delta(num_records: int, sampling_rate: float, max_batch_size: int, steps: int,
                   epsilon: float) -> float:
  """Extra δ from overflows: (1 + e^ε)·(1 − (1 − p_over)^T) ≤ (1 + e^ε)·T·p_over.

  See the module docstring for the proof. Add it to the accountant's δ, or calibrate σ at
  δ minus it (`logit_dp.ledger.accountant_delta`, `PrivacyLedger.calibrated`).
  """
  p = overflow_probability(num_records, sampling_rate, max_batch_size)
  if p >= 1:  # q = 1 and a padded size below N + 1: every step overflows
    return 0.0 if _check_int("steps", steps, 0) == 0 else 1.0
  return overflow_term(epsilon, steps, p)


def inclusion_threshold(sampling_rate: float) -> int | None:
  """⌊q·2³²⌋: record i is included iff its uniform 32-bit draw is below it.

  The realised inclusion probability is ⌊q·2³²⌋/2³² ∈ (q − 2⁻³², q], never
  above the q given to the accountant (comparing a float32 uniform with q
  instead could exceed q by up to 2⁻²³). Returns None for q = 1 (always included).
  """
  q = _check_rate(sampling_rate)
  if q == 1.0:
    return None
  return min(math.floor(q * 2.0 ** 32), 2 ** 32 - 1)


@functools.partial(jax.jit, static_argnames=("num_records", "sampling_rate", "max_batch_size"))
def poisson_batch(key: jax.Array, num_records: int, sampling_rate: float,
                  max_batch_size: int) -> PoissonBatch:
  """Draws one Poisson batch, padded to ``max_batch_size`` (jittable).

  Every record i ∈ {0, …, N−1} is included independently with probability q
  (one uniform 32-bit draw per record from ``key``, compared with
  `inclusion_threshold`, so the probability is within 2⁻³² below q and never
  above it). The included indices are
  returned in increasing order in the first ``batch_size`` slots; the rest is
  padding (index 0, mask False). If more than ``max_batch_size`` records were
  drawn, the batch is truncated to the smallest indices and ``overflow`` is
  True: the caller decides (see `check_overflow` and the module docstring).

  Args:
    key: a JAX PRNG key; use a different key at every step, e.g.
      ``jax.random.fold_in(base_key, step)``, so a resumed run re-draws exactly
      the batches of an uninterrupted one.
    num_records: N (static).
    sampling_rate: q ∈ (0, 1] (static Python float).
    max_batch_size: padded size (static).

  Returns:
    A `PoissonBatch`.
  """
  if num_records < 1 or max_batch_size < 1:
    raise ValueError("num_records and max_batch_size must be ≥ 1.")
  threshold = inclusion_threshold(sampling_rate)
  if threshold is None:
    include = jnp.ones((num_records,), bool)
  else:
    bits = jax.random.bits(key, (num_records,), jnp.uint32)
    include = bits < jnp.uint32(threshold)
  sampled_size = jnp.sum(include, dtype=jnp.int32)
  (indices,) = jnp.nonzero(include, size=max_batch_size, fill_value=0)
  indices = indices.astype(jnp.int32)
  batch_size = jnp.minimum(sampled_size, max_batch_size).astype(jnp.int32)
  mask = jnp.arange(max_batch_size) < batch_size
  indices = jnp.where(mask, indices, 0)
  return PoissonBatch(indices=indices, mask=mask, batch_size=batch_size, sampled_size=sampled_size,
                      overflow=sampled_size > max_batch_size)


def check_overflow(batch: PoissonBatch, overflow: str = "error") -> PoissonBatch:
  """Host-side check: raises `BatchOverflowError` on overflow when overflow="error"."""
  if overflow not in OVERFLOW_POLICIES:
    raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}.")
  if overflow == "error" and bool(batch.overflow):
    raise BatchOverflowError(
        f"Poisson batch of {int(batch.sampled_size)} records exceeds max_batch_size="
        f"{batch.mask.shape[0]}. Raise max_batch_size (see max_batch_size_for) or use "
        "overflow='truncate' and account for it (overflow_delta).")
  return batch


@dataclasses.dataclass(frozen=True)
class PoissonSampler:
  """Poisson batch sampler whose batches match `logit_dp.accounting`.

  The batch of step t depends only on (seed, t): it is drawn with key
  ``fold_in(PRNGKey(seed), t)``. A run restored at step k therefore draws the
  same batches for steps k, k+1, … as an uninterrupted run.

  Attributes:
    num_records: N, the dataset size.
    sampling_rate: q ∈ (0, 1].
    max_batch_size: padded size; None chooses `max_batch_size_for(N, q,
      overflow_probability=overflow_probability)`.
    seed: integer seed of the sampling randomness (keep it independent of the
      noise key).
    overflow: "error" (raise `BatchOverflowError`) or "truncate".
    overflow_probability: target p_over used when max_batch_size is None.

  Example:
    >>> sampler = PoissonSampler(num_records=50_000, sampling_rate=0.02, seed=0)
    >>> batch = sampler(step)              # PoissonBatch, padded, with mask
    >>> x, xp = data[batch.indices], data_prime[batch.indices]
    >>> loss, grads = grad_fn(params, x, xp, mask=batch.mask)
  """
  num_records: int
  sampling_rate: float
  max_batch_size: int | None = None
  seed: int = 0
  overflow: str = "error"
  overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY

  def __post_init__(self):
    n = _check_int("num_records", self.num_records, 1)
    q = _check_rate(self.sampling_rate)
    object.__setattr__(self, "num_records", n)
    object.__setattr__(self, "sampling_rate", q)
    if self.overflow not in OVERFLOW_POLICIES:
      raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {self.overflow!r}.")
    if self.max_batch_size is None:
      b = max_batch_size_for(n, q, overflow_probability=self.overflow_probability)
    else:
      b = _check_int("max_batch_size", self.max_batch_size, 1)
    object.__setattr__(self, "max_batch_size", b)
    _check_int("seed", self.seed, 0)

  @property
  def expected_batch_size(self) -> float:
    """E[n] = N·q, the expected number of sampled records per step."""
    return self.num_records * self.sampling_rate

  @property
  def step_overflow_probability(self) -> float:
    """p_over = P[Binomial(N+1, q) > max_batch_size] for this sampler."""
    assert self.max_batch_size is not None  # an int after __post_init__
    return overflow_probability(self.num_records, self.sampling_rate, self.max_batch_size)

  def overflow_delta(self, steps: int, epsilon: float) -> float:
    """Extra δ (see module docstring) for ``steps`` steps at privacy level ε."""
    assert self.max_batch_size is not None  # an int after __post_init__
    return overflow_delta(self.num_records, self.sampling_rate, self.max_batch_size, steps, epsilon)

  def key(self, step: int) -> jax.Array:
    """The PRNG key of step ``step``: fold_in(PRNGKey(seed), step)."""
    return jax.random.fold_in(jax.random.PRNGKey(self.seed), step)

  def __call__(self, step: int) -> PoissonBatch:
    """The padded batch of step ``step``; raises on overflow if overflow="error"."""
    batch = poisson_batch(self.key(step), self.num_records, self.sampling_rate, self.max_batch_size)
    return check_overflow(batch, self.overflow)

  sample = __call__


@dataclasses.dataclass(frozen=True)
class ShuffledBatcher:
  """Epoch-wise shuffling for NON-private baselines (not Poisson, not accounted).

  Epoch e uses the permutation ``np.random.default_rng([seed, e]).permutation(N)``
  cut into consecutive batches of ``batch_size``: every record appears exactly
  once per epoch. With ``drop_remainder=False`` the last batch is padded with
  index 0 and mask False; with True it is dropped (those records are skipped in
  that epoch).
  """
  num_records: int
  batch_size: int
  seed: int = 0
  drop_remainder: bool = False

  def __post_init__(self):
    _check_int("num_records", self.num_records, 1)
    _check_int("batch_size", self.batch_size, 1)
    _check_int("seed", self.seed, 0)

  def num_batches(self) -> int:
    """Batches per epoch: ⌊N/B⌋ with drop_remainder, else ⌈N/B⌉."""
    if self.drop_remainder:
      return self.num_records // self.batch_size
    return -(-self.num_records // self.batch_size)

  def epoch(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yields (indices int32[batch_size], mask bool[batch_size]) for one epoch."""
    e = _check_int("epoch", epoch, 0)
    perm = np.random.default_rng([self.seed, e]).permutation(self.num_records)
    for b in range(self.num_batches()):
      chunk = perm[b * self.batch_size:(b + 1) * self.batch_size]
      mask = np.zeros(self.batch_size, bool)
      mask[:len(chunk)] = True
      idx = np.zeros(self.batch_size, np.int32)
      idx[:len(chunk)] = chunk
      yield idx, mask

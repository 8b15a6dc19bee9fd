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

Privacy per person: `PersonPoissonSampler` samples people instead of records (each person
joins with probability q and brings at most K of their pairs, chosen secretly), for the
guarantee of `make_private(user_ids=, max_pairs_per_user=)`.

For non-private baselines, `ShuffledBatcher` visits every record exactly once
per epoch. Its batches are *not* Poisson samples and are not covered by the
accounting.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

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
  def unit(self) -> str:
    """The unit of privacy: "pair" (one record; `PersonPoissonSampler`: "person")."""
    return "pair"

  @property
  def num_units(self) -> int:
    """How many units the sampling rate q is over: N records (`PersonPoissonSampler`: people)."""
    return self.num_records

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


# ----------------------------------------------------------------------------
# Privacy per person.
# ----------------------------------------------------------------------------


def check_user_ids(user_ids, num_records: int) -> np.ndarray:
  """user_ids as an int64 array of shape (N,): the person of every record; ValueError/TypeError
  naming ``user_ids`` otherwise."""
  if isinstance(
      user_ids,
      (str, bytes)) or not hasattr(user_ids, "__len__") and not hasattr(user_ids, "shape"):
    raise TypeError("user_ids must be an integer array with one entry per record (its "
                    f"person), got {type(user_ids).__name__}.")
  ids = np.asarray(user_ids)
  if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
    raise TypeError("user_ids must be an integer array with one entry per record (its person), "
                    f"got dtype {ids.dtype}.")
  if ids.shape != (num_records,):
    raise ValueError(f"user_ids must have shape ({num_records},), one person id per record "
                     f"(num_records = {num_records}), got shape {ids.shape}.")
  return ids.astype(np.int64)


def _people(user_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(person index of every record in 0..M−1, the records of every person): dense persons in
  the order of their ids."""
  _, person, counts = np.unique(user_ids, return_inverse=True, return_counts=True)
  return person.astype(np.int32).reshape(-1), counts


def _log_mgf(t: float, capped: np.ndarray, sampling_rate: float, extra: int) -> float:
  """log E[e^{t·S}] of S = Σ_m capped[m]·Bernoulli(q)·m summed over people, plus one more person
  of ``extra`` pairs (the neighbour); capped[m] = people who bring m pairs."""
  q = sampling_rate
  m = np.arange(capped.shape[0])
  if q == 1.0:
    terms = t * m
    last = t * extra
  else:
    terms = np.logaddexp(math.log1p(-q), math.log(q) + t * m)
    last = float(np.logaddexp(math.log1p(-q), math.log(q) + t * extra))
  return float(np.sum(capped * terms) + last)


def person_overflow_probability(pairs_per_person, sampling_rate: float, max_batch_size: int,
                                max_pairs_per_user: int) -> float:
  """A bound on p_over = P[S > max_batch_size] for the pairs S of a person-level Poisson batch,
  on the dataset or a neighbour with one more person (bringing K pairs).

  S = Σ_u ξ_u·m_u + ξ·K, ξ ~ Bernoulli(q) i.i.d., m_u = min(K, pairs of person u). The Chernoff
  bound P[S ≥ b + 1] ≤ min_{t>0} e^{−t(b+1)}·E[e^{tS}] is returned (minimised numerically: any
  t gives a valid bound); 0 when b ≥ Σ_u m_u + K, where overflow is impossible.
  """
  from scipy import optimize  # pylint: disable=g-import-not-at-top
  q = _check_rate(sampling_rate)
  b = _check_int("max_batch_size", max_batch_size, 1)
  k = _check_int("max_pairs_per_user", max_pairs_per_user, 1)
  m = np.minimum(np.asarray(pairs_per_person, np.int64), k)
  if b >= int(np.sum(m)) + k:
    return 0.0
  capped = np.bincount(m, minlength=k + 1).astype(np.float64)
  bound = lambda t: _log_mgf(t, capped, q, k) - t * (b + 1)
  result = optimize.minimize_scalar(bound, bounds=(0.0, 50.0), method="bounded",
                                    options={"xatol": 1e-10})
  value = min(bound(float(result.x)), bound(0.0))
  return float(min(1.0, math.exp(min(value, 0.0))))


def person_max_batch_size_for(pairs_per_person, sampling_rate: float, max_pairs_per_user: int, *,
                              overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY) -> int:
  """Smallest padded batch size b (in pairs) with `person_overflow_probability` ≤
  overflow_probability (bisection; at most Σ_u min(K, pairs of u) + K, where overflow is
  impossible)."""
  p = float(overflow_probability)
  if not 0 < p < 1:
    raise ValueError(f"overflow_probability must be in (0, 1), got {overflow_probability!r}.")
  k = _check_int("max_pairs_per_user", max_pairs_per_user, 1)
  high = int(np.sum(np.minimum(np.asarray(pairs_per_person, np.int64), k))) + k
  low = 1
  while low < high:
    mid = (low + high) // 2
    if person_overflow_probability(pairs_per_person, sampling_rate, mid, k) <= p:
      high = mid
    else:
      low = mid + 1
  return low


@functools.partial(
    jax.jit,
    static_argnames=("num_people", "sampling_rate", "max_batch_size", "max_pairs_per_user"))
def person_poisson_batch(key: jax.Array, person_of_record: jax.Array, num_people: int,
                         sampling_rate: float, max_batch_size: int,
                         max_pairs_per_user: int) -> PoissonBatch:
  """Draws one person-level Poisson batch of records, padded to ``max_batch_size`` (jittable).

  Every person u ∈ {0, …, M−1} joins independently with probability q (one uniform 32-bit
  draw per person from the first half of ``key``, compared with `inclusion_threshold`). Every
  record draws a uniform 32-bit key from the second half; a person who joins brings the
  min(K, c_u) of their c_u records with the smallest keys (ties: the smaller index), i.e. a
  uniformly random K-subset, independent of the other people and of who joins. The records
  are returned as `poisson_batch`'s: increasing indices, padding, mask, overflow flag.

  Args:
    key: the step's key (fold_in(PRNGKey(seed), t)).
    person_of_record: (N,) int32, the person index (0..M−1) of every record.
    num_people: M (static).
    sampling_rate: q over people (static).
    max_batch_size: padded size in records (static).
    max_pairs_per_user: K (static).
  """
  people_key, pairs_key = jax.random.split(key)
  threshold = inclusion_threshold(sampling_rate)
  if threshold is None:
    joins = jnp.ones((num_people,), bool)
  else:
    joins = jax.random.bits(people_key, (num_people,), jnp.uint32) < jnp.uint32(threshold)
  n = person_of_record.shape[0]
  draws = jax.random.bits(pairs_key, (n,), jnp.uint32)
  positions = jnp.arange(n, dtype=jnp.int32)
  order = jnp.lexsort((positions, draws, person_of_record))  # by person, then key, then index
  sorted_people = person_of_record[order]
  first = jnp.searchsorted(sorted_people, sorted_people, side="left").astype(jnp.int32)
  rank = jnp.zeros((n,), jnp.int32).at[order].set(positions - first)
  include = joins[person_of_record] & (rank < max_pairs_per_user)
  sampled_size = jnp.sum(include, dtype=jnp.int32)
  (indices,) = jnp.nonzero(include, size=max_batch_size, fill_value=0)
  batch_size = jnp.minimum(sampled_size, max_batch_size).astype(jnp.int32)
  mask = jnp.arange(max_batch_size) < batch_size
  indices = jnp.where(mask, indices.astype(jnp.int32), 0)
  return PoissonBatch(indices=indices, mask=mask, batch_size=batch_size, sampled_size=sampled_size,
                      overflow=sampled_size > max_batch_size)


@dataclasses.dataclass(frozen=True)
class PersonPoissonSampler(PoissonSampler):
  """Poisson sampling of people: the batches of privacy per person.

  At every step each of the M people (the distinct values of ``user_ids``) joins the batch
  independently with probability q = ``sampling_rate``, and a person who joins brings
  min(K, c_u) of their c_u records, a uniformly random subset drawn from the step's secret
  key independently of the other people (`person_poisson_batch`). The batch is a
  `PoissonBatch` of record indices, like `PoissonSampler`'s, so every train step takes it
  unchanged. The batch of step t depends only on (seed, t): fold_in(PRNGKey(seed), t).

  Formal guarantees. Unit of privacy: a person, with all of their records; neighbouring
  datasets add or remove one person. Whatever the other people hold, the batch of a dataset
  with person u is that of the dataset without u plus, with probability q and independently
  of the rest, at most K records of u chosen from u's records and randomness alone. A released
  sum whose change is ≤ C_K when at most K pairs of one person join or leave (`make_private`
  calibrates to it: `person_sensitivity`, 2B for Naive-DP and DP-GCL grouped by person) is then
  the Poisson-subsampled Gaussian mechanism over people with rate q, which
  `logit_dp.accounting` accounts for; the random choice of the K records is a mixture over
  randomness independent of the data, which keeps the guarantee (joint convexity, as for a
  stochastic model; docs/PRIVACY.md, "Privacy per person"). Overflow is handled as for
  `PoissonSampler` with p_over the Chernoff bound of `person_overflow_probability` (an upper
  bound on the probability, which is all the δ term needs). The seed must be secret: it
  reveals who is in each batch and which of their records.

  Attributes:
    num_records: N, the number of records (pairs); the batches index them.
    sampling_rate: q ∈ (0, 1] over people.
    max_batch_size: padded size in records; None: `person_max_batch_size_for` at
      ``overflow_probability``.
    seed, overflow, overflow_probability: as for `PoissonSampler`.
    user_ids: (N,) integer person id of every record (not compared; ``users_digest`` is).
    max_pairs_per_user: K ≥ 1.
    users_digest: a SHA-256 digest of the person of every record (computed; it identifies
      the grouping in checkpoints without storing it).
  """
  user_ids: Any = dataclasses.field(default=None, compare=False, repr=False)
  max_pairs_per_user: int = 1
  users_digest: str = ""

  def __post_init__(self):
    n = _check_int("num_records", self.num_records, 1)
    ids = check_user_ids(self.user_ids, n)
    k = _check_int("max_pairs_per_user", self.max_pairs_per_user, 1)
    q = _check_rate(self.sampling_rate)
    person, counts = _people(ids)
    digest = users_digest(ids)
    if self.users_digest and self.users_digest != digest:
      raise ValueError("users_digest does not match user_ids: these are not the people the "
                       "sampler was made for.")
    object.__setattr__(self, "user_ids", ids)
    object.__setattr__(self, "max_pairs_per_user", k)
    object.__setattr__(self, "users_digest", digest)
    object.__setattr__(self, "_person", person)
    object.__setattr__(self, "_counts", counts)
    if self.max_batch_size is None:
      b = person_max_batch_size_for(counts, q, k, overflow_probability=self.overflow_probability)
      object.__setattr__(self, "max_batch_size", b)
    super().__post_init__()

  @property
  def unit(self) -> str:
    """"person"."""
    return "person"

  @property
  def num_people(self) -> int:
    """M, the number of distinct people."""
    return int(self._counts.shape[0])  # pyright: ignore[reportAttributeAccessIssue]

  @property
  def num_units(self) -> int:
    """M: q is the rate over people."""
    return self.num_people

  @property
  def person_of_record(self) -> np.ndarray:
    """(N,) int32: the person index (0..M−1, in the order of the ids) of every record."""
    return self._person  # pyright: ignore[reportAttributeAccessIssue]

  @property
  def pairs_per_person(self) -> np.ndarray:
    """(M,) the number of records of every person."""
    return self._counts  # pyright: ignore[reportAttributeAccessIssue]

  @property
  def expected_batch_size(self) -> float:
    """E[people] = M·q, the expected number of sampled people per step."""
    return self.num_people * self.sampling_rate

  @property
  def step_overflow_probability(self) -> float:
    """The Chernoff bound on p_over of `person_overflow_probability` for this sampler."""
    assert self.max_batch_size is not None  # an int after __post_init__
    return person_overflow_probability(self.pairs_per_person, self.sampling_rate,
                                       self.max_batch_size, self.max_pairs_per_user)

  def overflow_delta(self, steps: int, epsilon: float) -> float:
    """Extra δ of the padded batches: (1 + e^ε)·(1 − (1 − p_over)^T)."""
    p = self.step_overflow_probability
    if p >= 1:
      return 0.0 if _check_int("steps", steps, 0) == 0 else 1.0
    return overflow_term(epsilon, steps, p)

  def __call__(self, step: int) -> PoissonBatch:
    """The padded batch of step ``step``; raises on overflow if overflow="error"."""
    assert self.max_batch_size is not None  # an int after __post_init__
    batch = person_poisson_batch(self.key(step), jnp.asarray(self.person_of_record),
                                 self.num_people, self.sampling_rate, self.max_batch_size,
                                 self.max_pairs_per_user)
    return check_overflow(batch, self.overflow)

  sample = __call__


def users_digest(user_ids) -> str:
  """SHA-256 of the dense person index of every record (the grouping, not the raw ids)."""
  person, _ = _people(np.asarray(user_ids, np.int64))
  return hashlib.sha256(np.ascontiguousarray(person, dtype="<i4").tobytes()).hexdigest()

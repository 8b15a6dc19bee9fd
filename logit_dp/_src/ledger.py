"""A privacy ledger that travels with the checkpoints of a training run.

The ledger records everything the accountant needs — σ, q, δ, the accountant
and the number of steps taken — and reports the ε spent so far. It is saved in
the same orbax checkpoint as the model and optimizer state (`save_checkpoint`)
and restored with it (`restore_checkpoint`), so:

* a run killed after k steps and resumed reports exactly the ε of an
  uninterrupted run of the same length (ε is a deterministic function of the
  ledger, and the ledger is checkpointed atomically with the state);
* noise keys are never re-used: `logit_dp.transform` derives the noise of step
  t from fold_in(key, t) with t = the optimizer state's ``count``, which is
  restored from the same checkpoint as the ledger;
* a run refuses to take a step that would exceed its ε budget
  (`PrivacyBudgetExceededError`) unless explicitly allowed.

Formal guarantees. After ``steps`` steps, each a Poisson-sampled Gaussian
mechanism with noise multiplier σ and sampling rate q on a released sum of
sensitivity C (under add-or-remove-one-``unit`` adjacency: unit="pair", one record;
unit="person", one person with all of their records, q then the rate at which people are
sampled and C the per-person sensitivity, `logit_dp.sampling.PersonPoissonSampler`), the whole run —
every intermediate model included — is (ε, δ)-DP with ε = `epsilon()` and
δ = `delta()` = target_delta + overflow term, where the overflow term
(1 + e^ε)·(1 − (1 − p_over)^steps) accounts for batches that could not be
represented at the padded size (see `logit_dp.sampling`; it is 0 when
``overflow_probability`` = 0, i.e. when no truncation/abort can occur).
`PrivacyLedger.calibrated` chooses σ so that this whole δ, overflow term
included, is at most the δ asked for: it calibrates at
δ_acc = `accountant_delta`(ε, δ, T, p_over) = δ − (1 + e^ε)·(1 − (1 − p_over)^T)
and sets both budgets, so `record_steps` refuses any step after which
(ε, δ) would no longer hold.
The guarantee assumes the ledger's σ and q are those actually used and that
every step that touched the data was recorded: call `record_steps` *before*
releasing (applying) each noisy update, and checkpoint ledger and state
together. This is the low-level path; `logit_dp.make_private`'s
`PrivateTraining.batches` records every step itself, its `BudgetedSampler`
refuses steps past the budget, and its checkpoints hold the sampler too.
A step is one noisy update: gradient accumulation over micro-batches
(`clipped_grad(..., microbatch_size=m)`) computes the same ḡ of the whole
Poisson batch and adds noise once, so it is still one step.

Resuming redoes the steps taken after the last checkpoint with the same
batches (the sampler is a function of (seed, step)) and the same noise keys
(fold_in(key, count)): if such an update had already been released, the redone
one is identical to it, so no additional privacy is spent; fresh noise for a
redone step would instead count as a second release. The ledger also counts the
noisy updates released (``released_updates``): `logit_dp.PrivateTraining`'s steps
refuse an optimizer state whose noise count is below it, so no noise goes to a
second gradient, and a restore in the same process keeps the count (an older
checkpoint's steps are then refused rather than redone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
from typing import Any

from logit_dp._src import accounting
from logit_dp._src.sampling import PersonPoissonSampler
from logit_dp._src.sampling import PoissonBatch
from logit_dp._src.sampling import PoissonSampler
from logit_dp._src.sampling import overflow_term

LEDGER_FORMAT_VERSION = 3
#: Format versions `PrivacyLedger.from_dict` reads (version 1 has no ``released_updates``,
#: versions 1 and 2 no ``unit``: a pair).
_READABLE_FORMAT_VERSIONS = (1, 2, 3)
#: The units of privacy a ledger accounts for: one pair record, or one person with all of their
#: pairs (`logit_dp.make_private(user_ids=, max_pairs_per_user=)`).
UNITS = ("pair", "person")


class PrivacyBudgetExceededError(ValueError):
  """Taking the requested steps would spend more than the ledger's ε or δ budget."""


def accountant_delta(target_epsilon: float, target_delta: float, steps: int,
                     overflow_probability: float) -> float:
  """δ_acc = δ − (1 + e^ε)·(1 − (1 − p_over)^T), the δ at which to calibrate σ.

  If σ is calibrated so that the accountant's ε at δ_acc is ≤ ε after T steps,
  the certified guarantee of the padded-batch mechanism is (ε, δ_acc + overflow
  term) with the overflow term ≤ (1 + e^ε)·(1 − (1 − p_over)^T) (it grows with
  ε), i.e. (ε, δ) exactly as asked.

  Raises:
    ValueError: the overflow term alone is ≥ δ (raise the padded batch size, i.e.
      lower p_over, or take fewer steps).
  """
  eps = accounting.check_epsilon(target_epsilon)
  dlt = accounting.check_delta(target_delta)
  t = accounting.check_steps(steps)
  extra = overflow_term(eps, t, overflow_probability)
  if extra >= dlt:
    raise ValueError(
        f"The overflow term (1 + e^ε)·(1 − (1 − p_over)^T) = {extra:.4g} of T = {t} padded "
        f"batches at ε = {eps:g} (p_over = {float(overflow_probability):.3g} per step) is ≥ "
        f"δ = {dlt:g}: no σ can certify (ε, δ). Use a larger max_batch_size (a smaller "
        "overflow probability) or fewer steps.")
  # One ulp down: (δ − x) + x can round to above δ, and the δ budget check is exact.
  return math.nextafter(dlt - extra, 0.0) if extra else dlt


#: Per mechanism and budgets: the most steps `PrivacyLedger.check_budgets` found within them.
_WITHIN_BUDGET: dict[tuple, int] = {}


@dataclasses.dataclass
class PrivacyLedger:
  """Privacy state of a training run: parameters of the mechanism and steps taken.

  Attributes:
    noise_multiplier: σ > 0 of `logit_dp.transform`.
    sampling_rate: q ∈ (0, 1] of the Poisson sampler (1.0: full batch).
    target_delta: δ ∈ (0, 1) at which the accountant reports ε; the run's
      certified δ, `delta()`, adds the overflow term to it.
    accountant: "pld" or "rdp".
    steps: noisy steps taken so far (≥ 0).
    epsilon_budget: optional ε budget; `record_steps` refuses to exceed it.
    delta_budget: optional δ budget for `delta()` (target_delta plus the
      overflow term); `record_steps` refuses to exceed it.
    num_examples: optional dataset size N (warns if δ ≥ 1/N).
    overflow_probability: per-step probability p_over that a Poisson batch
      overflows the padded size (`PoissonSampler.step_overflow_probability`);
      0.0 if overflow cannot happen.
    pld_discretization: grid width of the PLD accountant.
    released_updates: noisy updates released so far, i.e. noise counts 0, …,
      released_updates − 1 have been used (`logit_dp.PrivateTraining.make_train_step`
      refuses an optimizer state whose noise count is below it: the same noise on
      another gradient would reveal their difference). Saved in checkpoints; 0 for
      those written before it existed.
    unit: the unit of privacy the guarantee is for, "pair" (default) or "person" (q is then
      the rate over people, num_examples the number of people); every printout of the
      guarantee states it. Saved in checkpoints; "pair" for those written before it existed.

  Example:
    >>> ledger = PrivacyLedger(noise_multiplier=sigma, sampling_rate=q,
    ...                        target_delta=1e-5, epsilon_budget=5.0)
    >>> for step in range(ledger.steps, total_steps):
    ...   ledger.record_steps(1)        # raises before the budget is exceeded
    ...   state = train_step(state, sampler(step))
    ...   if step % 100 == 0: save_checkpoint(ckpt_dir, step + 1, state, ledger)
    >>> print(ledger.epsilon())
  """
  noise_multiplier: float
  sampling_rate: float
  target_delta: float
  accountant: str = "pld"
  steps: int = 0
  epsilon_budget: float | None = None
  num_examples: int | None = None
  overflow_probability: float = 0.0
  pld_discretization: float = accounting.DEFAULT_PLD_DISCRETIZATION
  delta_budget: float | None = None
  released_updates: int = 0
  unit: str = "pair"

  def __post_init__(self):
    if self.unit not in UNITS:
      raise ValueError(f"unit must be one of {UNITS}, got {self.unit!r}.")
    self.noise_multiplier = accounting.check_noise_multiplier(self.noise_multiplier)
    if self.noise_multiplier == 0:
      raise ValueError("noise_multiplier must be > 0 for a private run (σ = 0 gives ε = ∞).")
    self.sampling_rate = accounting.check_sampling_rate(self.sampling_rate)
    self.target_delta = accounting.check_delta(self.target_delta)
    accounting.check_accountant(self.accountant)
    if isinstance(self.steps, bool) or int(self.steps) != self.steps or self.steps < 0:
      raise ValueError(f"steps must be an integer ≥ 0, got {self.steps!r}.")
    self.steps = int(self.steps)
    if (isinstance(self.released_updates, bool)
        or int(self.released_updates) != self.released_updates or self.released_updates < 0):
      raise ValueError(f"released_updates must be an integer ≥ 0, got {self.released_updates!r}.")
    self.released_updates = int(self.released_updates)
    if self.epsilon_budget is not None:
      self.epsilon_budget = accounting.check_epsilon(self.epsilon_budget)
    if self.delta_budget is not None:
      self.delta_budget = accounting.check_delta(self.delta_budget)
      if self.delta_budget < self.target_delta:
        raise ValueError(f"delta_budget = {self.delta_budget:g} is below target_delta = "
                         f"{self.target_delta:g}: no step could be taken.")
    if self.num_examples is not None:
      if (isinstance(self.num_examples, bool) or int(self.num_examples) != self.num_examples
          or self.num_examples < 1):
        raise ValueError(f"num_examples must be a positive integer, got {self.num_examples!r}.")
      self.num_examples = int(self.num_examples)
      # Frames: warn_if_large_delta, __post_init__, __init__, the caller.
      accounting.warn_if_large_delta(self.target_delta, self.num_examples, stacklevel=4)
    p = float(self.overflow_probability)
    if not 0 <= p < 1:
      raise ValueError(
          f"overflow_probability must be in [0, 1), got {self.overflow_probability!r}.")
    self.overflow_probability = p
    d = float(self.pld_discretization)
    if not 0 < d <= 1:
      raise ValueError(f"pld_discretization must be in (0, 1], got {self.pld_discretization!r}.")
    self.pld_discretization = d

  @classmethod
  def for_sampler(cls, sampler, noise_multiplier: float, target_delta: float,
                  **kwargs) -> PrivacyLedger:
    """A ledger matching a `logit_dp.sampling.PoissonSampler`.

    Takes q, N (people for a `PersonPoissonSampler`), the unit and the per-step overflow
    probability from the sampler, so the reported δ includes the overflow term of its padded
    batch size.
    """
    return cls(noise_multiplier=noise_multiplier, sampling_rate=sampler.sampling_rate,
               target_delta=target_delta, num_examples=sampler.num_units,
               overflow_probability=sampler.step_overflow_probability, unit=sampler.unit, **kwargs)

  @classmethod
  def calibrated(cls, sampler, target_epsilon: float, target_delta: float, steps: int,
                 accountant: str = "pld", **kwargs) -> PrivacyLedger:
    """A ledger whose ``steps`` steps with ``sampler`` are (ε, δ)-DP, overflow term included.

    σ = `accounting.noise_multiplier`(ε, δ_acc, q, T) with δ_acc =
    `accountant_delta`(ε, δ, T, p_over) (ValueError if it is ≤ 0), so
    ``delta(T)`` = δ_acc + (1 + e^ε(T))·(1 − (1 − p_over)^T) ≤ δ. The ledger's
    target_delta is δ_acc, its epsilon_budget ε and its delta_budget δ. The budgets are
    checked at T here (`check_budgets`), so the checks of steps 1, …, T run no accountant.

    Args:
      sampler: the run's `logit_dp.sampling.PoissonSampler` (q, N and p_over).
      target_epsilon: ε > 0.
      target_delta: δ ∈ (0, 1) of the certified guarantee.
      steps: T, the planned number of steps.
      accountant: "pld" or "rdp".
      **kwargs: other `PrivacyLedger` fields (pld_discretization is used by the
        calibration too).
    """
    eps = accounting.check_epsilon(target_epsilon)
    dlt = accounting.check_delta(target_delta)
    p_over = sampler.step_overflow_probability
    delta_acc = accountant_delta(eps, dlt, steps, p_over)
    discretization = kwargs.get("pld_discretization", accounting.DEFAULT_PLD_DISCRETIZATION)
    accounting.warn_if_large_delta(dlt, sampler.num_units, stacklevel=3)
    sigma = accounting.noise_multiplier(eps, delta_acc, sampler.sampling_rate, steps, accountant,
                                        pld_discretization=discretization)
    ledger = cls(noise_multiplier=sigma, sampling_rate=sampler.sampling_rate,
                 target_delta=delta_acc, accountant=accountant, num_examples=sampler.num_units,
                 overflow_probability=p_over, epsilon_budget=eps, delta_budget=dlt,
                 unit=sampler.unit, **kwargs)
    # ε(T) is the calibration's own (cached) value: steps 1, …, T pass the budget checks
    # without accounting again.
    ledger.check_budgets(steps)
    return ledger

  @classmethod
  def with_budget(cls, sampler, noise_multiplier: float, epsilon_budget: float, delta_budget: float,
                  steps: int, accountant: str = "pld", **kwargs) -> PrivacyLedger:
    """A ledger of a fixed σ with the budget (ε, δ) of `calibrated`: ε is reported at the
    same δ_acc = `accountant_delta`(ε, δ, T, p_over), and `record_steps` refuses a step past
    the budget.

    Args:
      sampler: the run's `logit_dp.sampling.PoissonSampler` (q, N and p_over).
      noise_multiplier: σ > 0.
      epsilon_budget: ε > 0.
      delta_budget: δ ∈ (0, 1) of the certified guarantee.
      steps: T, the planned number of steps (it sets δ_acc).
      accountant: "pld" or "rdp".
      **kwargs: other `PrivacyLedger` fields.
    """
    eps = accounting.check_epsilon(epsilon_budget)
    dlt = accounting.check_delta(delta_budget)
    accounting.warn_if_large_delta(dlt, sampler.num_units, stacklevel=3)
    delta_acc = accountant_delta(eps, dlt, steps, sampler.step_overflow_probability)
    ledger = cls.for_sampler(sampler, noise_multiplier, delta_acc, accountant=accountant,
                             epsilon_budget=eps, delta_budget=dlt, **kwargs)
    try:  # within the budget at T: steps 1, …, T pass the checks without accounting again
      ledger.check_budgets(steps)
    except PrivacyBudgetExceededError:
      pass  # σ too small for T steps: each step is checked, the one past the budget refused
    return ledger

  # -- Reporting. -------------------------------------------------------------

  def epsilon(self, steps: int | None = None) -> float:
    """ε after ``steps`` steps (default: the steps taken so far); 0.0 for 0 steps.

    Computed by `logit_dp.accounting.epsilon` (results are cached).
    """
    t = self.steps if steps is None else steps
    if isinstance(t, bool) or int(t) != t or t < 0:
      raise ValueError(f"steps must be an integer ≥ 0, got {steps!r}.")
    if t == 0:
      return 0.0
    return accounting.epsilon(self.noise_multiplier, self.target_delta, self.sampling_rate, int(t),
                              self.accountant, pld_discretization=self.pld_discretization)

  def delta(self, steps: int | None = None) -> float:
    """δ of the guarantee: target_delta + (1 + e^ε)·(1 − (1 − p_over)^steps)."""
    t = self.steps if steps is None else int(steps)
    if self.overflow_probability == 0.0 or t == 0:
      return self.target_delta
    return min(1.0,
               self.target_delta + overflow_term(self.epsilon(t), t, self.overflow_probability))

  def guarantee(self) -> tuple[float, float]:
    """(ε, δ) of the run so far."""
    return self.epsilon(), self.delta()

  def remaining_steps(self) -> int | None:
    """How many more steps fit in the budget (None if there is no budget)."""
    if self.epsilon_budget is None:
      return None
    total = accounting.max_steps(self.noise_multiplier, self.epsilon_budget, self.target_delta,
                                 self.sampling_rate, self.accountant,
                                 pld_discretization=self.pld_discretization)
    return max(0, total - self.steps)

  def __str__(self) -> str:
    eps, dlt = self.guarantee()
    budget = "" if self.epsilon_budget is None else f" of budget {self.epsilon_budget:g}"
    if self.delta_budget is not None:
      budget += f" (δ budget {self.delta_budget:g})"
    return (f"({eps:.4g}, {dlt:.3g})-DP per {self.unit} after {self.steps} steps{budget} "
            f"[σ={self.noise_multiplier:.6g}, q={self.sampling_rate:.6g}, {self.accountant}]")

  # -- Recording. -------------------------------------------------------------

  def check_budgets(self, steps: int) -> None:
    """Raises `PrivacyBudgetExceededError` if running to ``steps`` steps (in all) would spend
    ε(steps) > epsilon_budget or certify δ(steps) > delta_budget.

    Releasing fewer steps is post-processing of releasing more, so a count at or below one
    already found within the same budgets (same mechanism) passes without accounting again:
    a loop that checks every step accounts once per new maximum, not once per step.
    """
    if isinstance(steps, bool) or int(steps) != steps or steps < 0:
      raise ValueError(f"steps must be an integer ≥ 0, got {steps!r}.")
    if self.epsilon_budget is None and self.delta_budget is None:
      return
    key = (self.noise_multiplier, self.sampling_rate, self.target_delta, self.accountant,
           self.overflow_probability, self.pld_discretization, self.epsilon_budget,
           self.delta_budget)
    if int(steps) <= _WITHIN_BUDGET.get(key, 0):
      return
    new_eps = self.epsilon(steps)
    if self.epsilon_budget is not None and new_eps > self.epsilon_budget:
      raise PrivacyBudgetExceededError(
          f"Running to step {steps} would spend ε = {new_eps:.4g} (per {self.unit}) > budget "
          f"{self.epsilon_budget:g} at δ = {self.target_delta:g} (currently ε = "
          f"{self.epsilon():.4g} after {self.steps} steps). Stop training, or call "
          "ledger.record_steps(k, allow_exceeding_budget=True) to continue knowingly.")
    if self.delta_budget is not None:
      new_delta = self.delta(steps)
      if new_delta > self.delta_budget:
        raise PrivacyBudgetExceededError(
            f"Running to step {steps} would certify δ = {new_delta:.6g} (per {self.unit}) > δ "
            f"budget {self.delta_budget:g} (accountant δ {self.target_delta:g} plus the overflow "
            "term of the padded batches). Stop training, or call ledger.record_steps(k, "
            "allow_exceeding_budget=True) to continue knowingly.")
    _WITHIN_BUDGET[key] = max(_WITHIN_BUDGET.get(key, 0), int(steps))

  def record_steps(self, k: int = 1, *, allow_exceeding_budget: bool = False) -> float:
    """Records k more noisy steps and returns the new ε.

    Call it before the k updates are released. If a budget would be exceeded
    (`check_budgets`(steps + k)), nothing is recorded and
    `PrivacyBudgetExceededError` is raised, unless allow_exceeding_budget=True.
    The new ε is an accountant run the first time a process meets this step count
    (then cached); `logit_dp.PrivateTraining.batches` records without computing it.
    """
    self._add_steps(k, allow_exceeding_budget=allow_exceeding_budget)
    return self.epsilon()

  def _add_steps(self, k: int, *, allow_exceeding_budget: bool = False) -> None:
    """`record_steps` without computing the new ε (no accountant within checked budgets)."""
    if isinstance(k, bool) or int(k) != k or k < 0:
      raise ValueError(f"k must be an integer ≥ 0, got {k!r}.")
    k = int(k)
    if not allow_exceeding_budget:
      self.check_budgets(self.steps + k)
    self.steps += k

  # -- Serialisation. ---------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    """JSON-serialisable dict (plain floats/ints/str/None) with a format version."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["format_version"] = LEDGER_FORMAT_VERSION
    return out

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> PrivacyLedger:
    """Inverse of `to_dict`; rejects unknown keys and unknown format versions.

    Version 1 (no ``released_updates``) reads with released_updates = 0; versions 1 and 2
    (no ``unit``) with unit = "pair".
    """
    data = dict(data)
    version = data.pop("format_version", LEDGER_FORMAT_VERSION)
    if version not in _READABLE_FORMAT_VERSIONS:
      raise ValueError(f"Unsupported ledger format_version {version!r}.")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
      raise ValueError(f"Unknown ledger fields: {sorted(unknown)}.")
    return cls(**data)


@dataclasses.dataclass(frozen=True)
class BudgetedSampler(PoissonSampler):
  """A `PoissonSampler` that refuses the steps its ledger's budget does not allow.

  ``sampler(t)`` raises `PrivacyBudgetExceededError` when t + 1 steps in all would spend
  more than the ledger's ε or δ budget (`PrivacyLedger.check_budgets`), before drawing
  anything; otherwise it returns the batch of step t exactly as `PoissonSampler` does
  (fold_in(PRNGKey(seed), t)). It records nothing: `logit_dp.PrivateTraining.batches`
  records each step before handing its batch out, and by-hand loops call
  ``ledger.record_steps(1)`` themselves. A ledger without budget allows every step.

  Attributes:
    ledger: the `PrivacyLedger` whose budgets bound the steps (not compared, not hashed).
  """
  ledger: PrivacyLedger | None = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.ledger, PrivacyLedger):
      raise TypeError(f"ledger must be a PrivacyLedger, got {type(self.ledger).__name__}.")

  @classmethod
  def bind(cls, sampler: PoissonSampler, ledger: PrivacyLedger) -> BudgetedSampler:
    """The sampler ``sampler`` (same N, q, padded size, seed, overflow policy) bound to ledger;
    a `PersonPoissonSampler` gives a `BudgetedPersonSampler` (same people and K too)."""
    if ledger.unit != sampler.unit:
      raise ValueError(f"The ledger accounts per {ledger.unit} and the sampler samples per "
                       f"{sampler.unit}: the guarantee would be for the wrong unit.")
    plain = PersonPoissonSampler if isinstance(sampler, PersonPoissonSampler) else PoissonSampler
    fields = {f.name: getattr(sampler, f.name) for f in dataclasses.fields(plain)}
    if plain is PersonPoissonSampler and not issubclass(cls, PersonPoissonSampler):
      cls = BudgetedPersonSampler
    return cls(**fields, ledger=ledger)

  def unbudgeted(self) -> PoissonSampler:
    """The plain `PoissonSampler` (`PersonPoissonSampler`) with the same fields (low-level:
    checks no budget)."""
    plain = PersonPoissonSampler if isinstance(self, PersonPoissonSampler) else PoissonSampler
    return plain(**{f.name: getattr(self, f.name) for f in dataclasses.fields(plain)})

  def __call__(self, step: int) -> PoissonBatch:
    """The padded batch of step ``step``; raises past the ledger's budget or on overflow."""
    if isinstance(step, bool) or int(step) != step or step < 0:
      raise ValueError(f"step must be an integer ≥ 0, got {step!r}.")
    assert self.ledger is not None  # checked in __post_init__
    self.ledger.check_budgets(int(step) + 1)
    return super().__call__(int(step))

  sample = __call__


@dataclasses.dataclass(frozen=True)
class BudgetedPersonSampler(BudgetedSampler, PersonPoissonSampler):
  """A `PersonPoissonSampler` that refuses the steps its ledger's budget does not allow, as
  `BudgetedSampler` does (its ledger's unit is "person")."""


# ----------------------------------------------------------------------------
# Orbax integration.
# ----------------------------------------------------------------------------

_STATE_ITEM = "state"
_LEDGER_ITEM = "privacy_ledger"
_SAMPLER_ITEM = "poisson_sampler"


def _manager(directory, max_to_keep: int | None = None, create: bool = True):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create)
  return ocp.CheckpointManager(os.fspath(os.path.abspath(directory)), options=options)


def _sampler_dict(sampler: PoissonSampler) -> dict[str, Any]:
  out = {f.name: getattr(sampler, f.name) for f in dataclasses.fields(PoissonSampler)}
  if isinstance(sampler, PersonPoissonSampler):  # the people by digest, not their ids
    out.update(max_pairs_per_user=sampler.max_pairs_per_user, users_digest=sampler.users_digest)
  return out


def save_checkpoint(directory, step: int, state: Any, ledger: PrivacyLedger, *,
                    sampler: PoissonSampler | None = None, max_to_keep: int | None = None) -> None:
  """Saves ``state`` (any pytree of arrays), the ledger and the sampler as one orbax checkpoint.

  All go into the same checkpoint step (items "state", "privacy_ledger" and, with a
  sampler, "poisson_sampler"), written atomically by `orbax.checkpoint.CheckpointManager`;
  the call blocks until the checkpoint is on disk. The sampler's fields include its seed,
  a secret like the noise key in the optimizer state: keep the checkpoints private.

  Args:
    directory: checkpoint root directory (created if needed).
    step: checkpoint step number; use the number of steps taken.
    state: pytree with the params and the optimizer state (including the
      `logit_dp.AddNoiseState`, whose count keys the noise).
    ledger: the run's `PrivacyLedger`.
    sampler: the run's `PoissonSampler` (or `BudgetedSampler`); `restore_sampler` reads it
      back, so a resumed run draws the batches of an uninterrupted one.
    max_to_keep: keep only the newest checkpoints (None: keep all).
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  if not isinstance(ledger, PrivacyLedger):
    raise TypeError(f"ledger must be a PrivacyLedger, got {type(ledger).__name__}.")
  if sampler is not None and not isinstance(sampler, PoissonSampler):
    raise TypeError(f"sampler must be a PoissonSampler, got {type(sampler).__name__}.")
  items = {
      _STATE_ITEM: ocp.args.StandardSave(state),
      _LEDGER_ITEM: ocp.args.JsonSave(ledger.to_dict()),
  }
  if sampler is not None:
    items[_SAMPLER_ITEM] = ocp.args.JsonSave(_sampler_dict(sampler))
  mngr = _manager(directory, max_to_keep=max_to_keep)
  try:
    mngr.save(int(step), args=ocp.args.Composite(**items), force=True)
    mngr.wait_until_finished()
  finally:
    mngr.close()


def latest_step(directory) -> int | None:
  """Newest checkpoint step in ``directory`` (None if there is none)."""
  if not os.path.isdir(directory):
    return None
  mngr = _manager(directory, create=False)
  try:
    return mngr.latest_step()
  finally:
    mngr.close()


@contextlib.contextmanager
def _opened(directory, step: int | None):
  """(checkpoint manager, step) of ``directory``; step None: the newest. Closes the manager.

  FileNotFoundError, saying which: the directory does not exist, it holds no checkpoint, or
  not checkpoint ``step``.
  """
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"The checkpoint directory {os.fspath(directory)!r} does not exist.")
  mngr = _manager(directory, create=False)
  try:
    steps = sorted(mngr.all_steps())
    if not steps:
      held = sorted(os.listdir(directory))
      raise FileNotFoundError(
          f"The directory {os.fspath(directory)!r} exists but holds no checkpoint ("
          + (f"it holds {held[:10]}" if held else "it is empty")
          + "): pass the directory save_checkpoint wrote to.")
    if step is None:
      step = steps[-1]
    elif int(step) not in steps:
      raise FileNotFoundError(
          f"No checkpoint {step} in {os.fspath(directory)!r}; it holds steps {steps}.")
    yield mngr, int(step)
  finally:
    mngr.close()


def _leaf_shapes(tree, is_leaf=None) -> dict[str, tuple[int, ...]]:
  """{path: shape} of the array leaves of tree, paths as orbax names them ("1.0.count")."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  def name(key) -> str:
    for attribute in ("key", "name", "idx"):
      if hasattr(key, attribute):
        return str(getattr(key, attribute))
    return str(key)

  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  return {".".join(name(k) for k in path): tuple(np.shape(leaf)) for path, leaf in flat}


def state_differences(directory, step: int, template: Any) -> list[str]:
  """How the state saved in checkpoint ``step`` differs from ``template``: one line per leaf
  held by only one of them, or with another shape (read from the checkpoint's metadata)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(os.path.abspath(os.fspath(directory))) / str(step) / _STATE_ITEM
  stored = ocp.StandardCheckpointHandler().metadata(
      path).tree  # pyright: ignore[reportArgumentType]
  saved = _leaf_shapes(stored, is_leaf=lambda a: hasattr(a, "shape"))
  wanted = _leaf_shapes(template)
  lines = []
  for name in sorted(set(saved) | set(wanted)):
    if name not in wanted:
      lines.append(f"{name}: in the checkpoint, not in the template")
    elif name not in saved:
      lines.append(f"{name}: in the template, not in the checkpoint")
    elif saved[name] != wanted[name]:
      lines.append(f"{name}: shape {wanted[name]} in the template, {saved[name]} in the "
                   "checkpoint")
  return lines


def restore_checkpoint(directory, template: Any,
                       step: int | None = None) -> tuple[Any, PrivacyLedger, int]:
  """Restores (state, ledger, step) saved by `save_checkpoint`.

  Args:
    directory: checkpoint root directory.
    template: a pytree with the structure, shapes and dtypes of the saved state
      (e.g. a freshly initialised state); its values are not used.
    step: which checkpoint (default: the newest).

  Raises:
    FileNotFoundError: ``directory`` does not exist, holds no checkpoint, or not ``step``
      (the message says which).
    ValueError: the template's structure or shapes differ from the saved state's (another
      optimizer chain, other params): the message names the differing leaves. Restoring only
      the matching part would start the rest afresh, e.g. a noise state whose count and key
      draw noise already released; rebuild the template as the state was saved.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with _opened(directory, step) as (mngr, step):
    # Other shapes are refused from the metadata, before any read: a restore that fails
    # while reading leaves orbax's reads behind, to report their errors whenever collected.
    differences = state_differences(directory, step, template)
    restored = None
    if not any(": shape " in line for line in differences):
      try:
        restored = mngr.restore(
            step, args=ocp.args.Composite(**{
                _STATE_ITEM: ocp.args.StandardRestore(template),
                _LEDGER_ITEM: ocp.args.JsonRestore(),
            }))
      except ValueError:
        if not differences:
          raise
    if restored is None:
      shown = "\n  ".join(differences[:20])
      more = f"\n  ... and {len(differences) - 20} more" if len(differences) > 20 else ""
      raise ValueError(
          f"The state in checkpoint {step} of {os.fspath(directory)!r} differs from the "
          f"template:\n  {shown}{more}\nBuild the template as the state was saved: the same "
          "params and the same optimizer chain (optimizer=, mean=). Do not restore part of "
          "it: the rest would start afresh, and a fresh noise state draws noise already "
          "released.")
  ledger = PrivacyLedger.from_dict(restored[_LEDGER_ITEM])
  return restored[_STATE_ITEM], ledger, int(step)


def restore_sampler(directory, step: int | None = None, *,
                    user_ids: Any = None) -> PoissonSampler | None:
  """The `PoissonSampler` saved with checkpoint ``step`` (default: the newest) by
  `save_checkpoint(..., sampler=)`; None if that checkpoint holds no sampler.

  A `PersonPoissonSampler` is saved with a digest of its people, not their ids: pass the
  run's ``user_ids`` to restore it (ValueError when they are missing or are not the people
  the checkpoint was made with).

  Raises:
    FileNotFoundError: no checkpoint in ``directory``.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with _opened(directory, step) as (mngr, step):
    if not os.path.isdir(os.path.join(os.fspath(directory), str(step), _SAMPLER_ITEM)):
      return None
    restored = mngr.restore(step,
                            args=ocp.args.Composite(**{_SAMPLER_ITEM: ocp.args.JsonRestore()}))
  fields = dict(restored[_SAMPLER_ITEM])
  if "users_digest" not in fields:
    return PoissonSampler(**fields)
  if user_ids is None:
    raise ValueError(f"Checkpoint {step} in {os.fspath(directory)!r} holds a person-level "
                     "sampler: pass user_ids=, the person of every record.")
  try:
    return PersonPoissonSampler(**fields, user_ids=user_ids)
  except ValueError as error:
    raise ValueError(f"Checkpoint {step} in {os.fspath(directory)!r}: user_ids are not the "
                     f"people its run sampled ({error})") from None

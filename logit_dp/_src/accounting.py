"""Privacy accounting for Logit-DP training, built on Google's `dp_accounting`.

One training step of Logit-DP releases ḡ + N(0, (σC)²I), where ḡ is the summed,
per-pair-clipped gradient of a batch drawn by Poisson sampling (every record
joins independently with probability q) and C is `logit_dp.sensitivity(loss,
clip_norm, batch_size=None)`, an upper bound on ‖ḡ(X) − ḡ(X')‖₂ for batches X,
X' that differ by adding or removing one pair (x_i, x'_i), valid whatever the
batch size. Each step is therefore a Poisson-subsampled Gaussian mechanism with
noise multiplier σ, and T steps are its T-fold adaptive composition:

    SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), T)

This module turns that event into (ε, δ) with a `dp_accounting` accountant and
inverts it (σ for a target ε) with `dp_accounting.calibrate_dp_mechanism`. No
accountant is implemented here.

Formal guarantees. Let D and D' be datasets of pairs that differ by adding or
removing one pair (the add-or-remove-one relation,
`dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE`, for which the Logit-DP
sensitivity is proved). If every step (i) draws its batch by Poisson sampling
with rate q from the whole dataset, independently of everything else,
(ii) computes a released quantity whose L2 sensitivity under that relation is at
most C for every batch size, and (iii) adds fresh N(0, (σC)²I) noise, then the
sequence of all T released updates (and anything computed from them) is
(ε, δ)-DP with ε = `epsilon(σ, δ, q, T)`. The bound is

* ``accountant="pld"``: the privacy-loss-distribution accountant
  (`dp_accounting.pld.PLDAccountant`) with pessimistic discretization of the
  privacy loss on a grid of width ``pld_discretization`` (default 1e-3). It is a
  valid upper bound on the true ε and is almost tight. The discretization
  error grows with T: at T = 1000 steps the default grid cannot certify ε
  much below a few hundredths (e.g. ε = 0.033 where RDP gives 0.017, at
  σ = 100, q = 0.02), so use a finer grid or RDP for very small ε.
* ``accountant="rdp"``: Rényi-DP accounting of the subsampled Gaussian
  (Mironov et al. 2019) at the default orders of
  `dp_accounting.rdp.RdpAccountant`, converted to (ε, δ) with the improved
  conversion of Canonne, Kamath and Steinke (2020). Also a valid upper bound,
  looser: at the same σ its ε is typically 7–35 % larger than PLD's (largest
  for few steps and small ε), and calibrating to the same target gives a σ
  4–15 % larger.

What the guarantee does not cover: batches that are not Poisson sampled (a
shuffled pass over the data with fixed batch size is *not* accounted for by
these functions), hyper-parameter tuning on the private data, and the
floating-point / PRNG caveats common to all DP-SGD implementations.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence

import dp_accounting

ACCOUNTANTS = ("pld", "rdp")

#: Width of the privacy-loss grid of the PLD accountant. dp_accounting's own
#: default is 1e-4; 1e-3 is ≈ 4–10× faster and changed ε by < 0.5 % (always
#: upwards, i.e. conservatively) in the settings we checked (ε ≈ 1–15,
#: T = 300–30,000 steps).
DEFAULT_PLD_DISCRETIZATION = 1e-3

#: Default search range for `noise_multiplier`. Below 0.1 the accountants are
#: slow (a wide privacy-loss support) and the guarantees meaningless; above 1e4
#: the noise swamps any gradient.
DEFAULT_MIN_NOISE_MULTIPLIER = 0.1
DEFAULT_MAX_NOISE_MULTIPLIER = 1e4

# ----------------------------------------------------------------------------
# Validation.
# ----------------------------------------------------------------------------


def _check_real(name: str, value) -> float:
  if isinstance(value, bool):
    raise ValueError(f"{name} must be a number, got {value!r}.")
  try:
    out = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number, got {value!r}.") from None
  if math.isnan(out):
    raise ValueError(f"{name} must not be NaN.")
  return out


def check_epsilon(target_epsilon) -> float:
  """Returns ε as a float; raises ValueError unless 0 < ε < ∞."""
  eps = _check_real("target_epsilon", target_epsilon)
  if not 0 < eps < math.inf:
    raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}.")
  return eps


def check_delta(target_delta) -> float:
  """Returns δ as a float; raises ValueError unless 0 < δ < 1."""
  delta = _check_real("target_delta", target_delta)
  if not 0 < delta < 1:
    raise ValueError(f"target_delta must be in the open interval (0, 1), got {target_delta!r}.")
  return delta


def check_sampling_rate(sampling_rate) -> float:
  """Returns q as a float; raises ValueError unless 0 < q ≤ 1."""
  q = _check_real("sampling_rate", sampling_rate)
  if not 0 < q <= 1:
    raise ValueError(f"sampling_rate must be in (0, 1] (q = expected batch size / dataset size; "
                     f"1.0 = full batch), got {sampling_rate!r}.")
  return q


def check_steps(steps) -> int:
  """Returns T as an int; raises ValueError unless T is an integer ≥ 1."""
  if isinstance(steps, bool):
    raise ValueError(f"steps must be an integer ≥ 1, got {steps!r}.")
  try:
    t = int(steps)
  except (TypeError, ValueError, OverflowError):
    raise ValueError(f"steps must be an integer ≥ 1, got {steps!r}.") from None
  if t != steps or t < 1:
    raise ValueError(f"steps must be an integer ≥ 1, got {steps!r}.")
  return t


def check_noise_multiplier(noise_multiplier) -> float:
  """Returns σ as a float; raises ValueError unless 0 ≤ σ < ∞ (σ = 0: ε = ∞)."""
  sigma = _check_real("noise_multiplier", noise_multiplier)
  if not 0 <= sigma < math.inf:
    raise ValueError(f"noise_multiplier must be finite and ≥ 0, got {noise_multiplier!r}.")
  return sigma


def check_accountant(accountant) -> str:
  """Returns accountant; raises ValueError unless it is one of ACCOUNTANTS."""
  if accountant not in ACCOUNTANTS:
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}.")
  return accountant


def warn_if_large_delta(target_delta: float, num_examples: int | None, *,
                        stacklevel: int = 3) -> None:
  """Warns when δ ≥ 1/N: such a δ allows releasing one record in the clear."""
  if num_examples is None:
    return
  if isinstance(num_examples, bool) or int(num_examples) != num_examples or num_examples < 1:
    raise ValueError(f"num_examples must be a positive integer, got {num_examples!r}.")
  if target_delta >= 1.0 / num_examples:
    warnings.warn(
        f"target_delta={target_delta:g} ≥ 1/N = {1.0 / num_examples:g} (N = {num_examples}). "
        "A mechanism that publishes a random record in the clear satisfies "
        "(0, 1/N)-DP, so such a δ gives a weak guarantee; prefer δ ≪ 1/N.", UserWarning,
        stacklevel=stacklevel)


# ----------------------------------------------------------------------------
# Events and accountants.
# ----------------------------------------------------------------------------


def make_event(noise_multiplier: float, sampling_rate: float, steps: int) -> dp_accounting.DpEvent:
  """The `dp_accounting` event of T Logit-DP steps.

  Returns ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), T)``.
  With q = 1 (full batch, no amplification) the Poisson wrapper is a no-op and
  is dropped: ``SelfComposedDpEvent(GaussianDpEvent(σ), T)``.

  Args:
    noise_multiplier: σ ≥ 0, the ratio of the noise standard deviation to the
      sensitivity C of the released sum ḡ.
    sampling_rate: q ∈ (0, 1], the Poisson sampling probability per record.
    steps: T ≥ 1.
  """
  sigma = check_noise_multiplier(noise_multiplier)
  q = check_sampling_rate(sampling_rate)
  t = check_steps(steps)
  event = dp_accounting.GaussianDpEvent(sigma)
  if q < 1.0:
    event = dp_accounting.PoissonSampledDpEvent(q, event)
  return dp_accounting.SelfComposedDpEvent(event, t)


def make_accountant(accountant: str = "pld", *,
                    pld_discretization: float = DEFAULT_PLD_DISCRETIZATION,
                    rdp_orders: Sequence[float] | None = None) -> dp_accounting.PrivacyAccountant:
  """A fresh, empty accountant under the add-or-remove-one relation.

  Args:
    accountant: "pld" (`dp_accounting.pld.PLDAccountant`) or "rdp"
      (`dp_accounting.rdp.RdpAccountant`).
    pld_discretization: value_discretization_interval of the PLD accountant.
    rdp_orders: RDP orders (None: dp_accounting's defaults).
  """
  check_accountant(accountant)
  relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
  if accountant == "pld":
    interval = _check_real("pld_discretization", pld_discretization)
    if not 0 < interval <= 1:
      raise ValueError(f"pld_discretization must be in (0, 1], got {pld_discretization!r}.")
    return dp_accounting.pld.PLDAccountant(neighboring_relation=relation,
                                           value_discretization_interval=interval)
  return dp_accounting.rdp.RdpAccountant(orders=None if rdp_orders is None else list(rdp_orders),
                                         neighboring_relation=relation)


@functools.lru_cache(maxsize=4096)
def _epsilon_cached(sigma: float, delta: float, q: float, steps: int, accountant: str,
                    pld_discretization: float, rdp_orders: tuple | None) -> float:
  if sigma == 0:
    return math.inf
  acc = make_accountant(accountant, pld_discretization=pld_discretization, rdp_orders=rdp_orders)
  acc.compose(make_event(sigma, q, steps))
  return float(acc.get_epsilon(delta))


def epsilon(noise_multiplier: float, target_delta: float, sampling_rate: float, steps: int,
            accountant: str = "pld", *, num_examples: int | None = None,
            pld_discretization: float = DEFAULT_PLD_DISCRETIZATION,
            rdp_orders: Sequence[float] | None = None) -> float:
  """ε of T Poisson-sampled Gaussian steps at the given δ.

  ε is the smallest value (up to the accountant's pessimistic approximation)
  such that T steps with noise N(0, (σC)²I) on a released sum of sensitivity C,
  each on a Poisson sample of rate q, are (ε, δ)-DP under add-or-remove-one-pair
  adjacency (see the module docstring for the formal statement). Results are
  cached, so calling this after every step is cheap after the first call.

  Args:
    noise_multiplier: σ ≥ 0 (σ = 0 returns ∞).
    target_delta: δ ∈ (0, 1).
    sampling_rate: q ∈ (0, 1]; 1.0 means full-batch steps (no amplification).
    steps: T ≥ 1.
    accountant: "pld" (default, tighter) or "rdp".
    num_examples: N, optional; when given, warns if δ ≥ 1/N.
    pld_discretization: grid width of the PLD accountant.
    rdp_orders: orders of the RDP accountant (None: dp_accounting's defaults).

  Returns:
    ε as a float (math.inf if the mechanism is not private at this δ).
  """
  sigma = check_noise_multiplier(noise_multiplier)
  delta = check_delta(target_delta)
  q = check_sampling_rate(sampling_rate)
  t = check_steps(steps)
  check_accountant(accountant)
  warn_if_large_delta(delta, num_examples)
  orders = None if rdp_orders is None else tuple(float(o) for o in rdp_orders)
  return _epsilon_cached(sigma, delta, q, t, accountant, float(pld_discretization), orders)


def delta(noise_multiplier: float, target_epsilon: float, sampling_rate: float, steps: int,
          accountant: str = "pld", *, pld_discretization: float = DEFAULT_PLD_DISCRETIZATION,
          rdp_orders: Sequence[float] | None = None) -> float:
  """δ of T Poisson-sampled Gaussian steps at the given ε (inverse view of `epsilon`)."""
  sigma = check_noise_multiplier(noise_multiplier)
  eps = _check_real("target_epsilon", target_epsilon)
  if eps < 0:
    raise ValueError(f"target_epsilon must be ≥ 0, got {target_epsilon!r}.")
  q = check_sampling_rate(sampling_rate)
  t = check_steps(steps)
  if sigma == 0:
    return 1.0
  acc = make_accountant(accountant, pld_discretization=pld_discretization, rdp_orders=rdp_orders)
  acc.compose(make_event(sigma, q, t))
  return float(acc.get_delta(eps))


@functools.lru_cache(maxsize=1024)
def _calibrate_cached(eps: float, delta: float, q: float, steps: int, accountant: str,
                      pld_discretization: float, rdp_orders: tuple | None, lo: float, hi: float,
                      rtol: float) -> float:
  """dp_accounting's calibration of σ in the bracket [lo, hi], to tol = rtol·lo: a pure function
  of its arguments (each is a key of the cache), computed once per process."""
  def fresh_accountant():
    return make_accountant(accountant, pld_discretization=pld_discretization, rdp_orders=rdp_orders)

  sigma = dp_accounting.calibrate_dp_mechanism(
      fresh_accountant, lambda s: make_event(s, q, steps), eps, delta,
      bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi), tol=rtol * lo)
  return float(sigma)


def noise_multiplier(target_epsilon: float, target_delta: float, sampling_rate: float, steps: int,
                     accountant: str = "pld", *, num_examples: int | None = None,
                     pld_discretization: float = DEFAULT_PLD_DISCRETIZATION,
                     rdp_orders: Sequence[float] | None = None,
                     min_noise_multiplier: float = DEFAULT_MIN_NOISE_MULTIPLIER,
                     max_noise_multiplier: float = DEFAULT_MAX_NOISE_MULTIPLIER,
                     rtol: float = 1e-3) -> float:
  """Smallest σ (within a relative tolerance) with ε(σ) ≤ target_epsilon.

  Calibrates with `dp_accounting.calibrate_dp_mechanism` on an explicit bracket
  [σ_lo, σ_hi] found by doubling / halving from σ = 1, then re-checks the
  returned σ with a fresh accountant and, should the check fail (it never
  should: the library already guarantees a non-positive gap), increases σ by
  factors of (1 + rtol) until ε(σ) ≤ target.

  The calibration is cached per process (its arguments are the key), so calibrating the same
  budget again is cheap; the returned σ is checked against `epsilon` on every call.

  Guarantee: the returned σ satisfies ``epsilon(σ, δ, q, T, accountant) ≤
  target_epsilon`` for the same accountant settings, and σ·(1 − rtol) no longer
  does (unless σ = min_noise_multiplier, see below).

  Args:
    target_epsilon: ε > 0.
    target_delta: δ ∈ (0, 1).
    sampling_rate: q ∈ (0, 1].
    steps: T ≥ 1.
    accountant: "pld" or "rdp".
    num_examples: N, optional; warns if δ ≥ 1/N.
    pld_discretization, rdp_orders: accountant settings (see `epsilon`).
    min_noise_multiplier, max_noise_multiplier: the search range. If even
      σ = max_noise_multiplier gives ε > target, ValueError; if already
      σ = min_noise_multiplier meets the target, that σ is returned with a
      warning (any larger σ is also private; the target is very loose).
    rtol: relative tolerance on σ.

  Raises:
    ValueError: invalid arguments, or no σ in the range meets the target.
  """
  eps = check_epsilon(target_epsilon)
  dlt = check_delta(target_delta)
  q = check_sampling_rate(sampling_rate)
  t = check_steps(steps)
  check_accountant(accountant)
  warn_if_large_delta(dlt, num_examples)
  lo_limit = _check_real("min_noise_multiplier", min_noise_multiplier)
  hi_limit = _check_real("max_noise_multiplier", max_noise_multiplier)
  if not 0 < lo_limit < hi_limit < math.inf:
    raise ValueError("Need 0 < min_noise_multiplier < max_noise_multiplier < inf, got "
                     f"{min_noise_multiplier!r}, {max_noise_multiplier!r}.")
  if not 0 < rtol < 0.5:
    raise ValueError(f"rtol must be in (0, 0.5), got {rtol!r}.")
  orders = None if rdp_orders is None else tuple(float(o) for o in rdp_orders)

  def eps_of(sigma: float) -> float:
    return _epsilon_cached(float(sigma), dlt, q, t, accountant, float(pld_discretization), orders)

  # Bracket: eps_of is non-increasing in σ.
  hi = min(max(1.0, lo_limit), hi_limit)
  while eps_of(hi) > eps:
    if hi >= hi_limit:
      raise ValueError(f"No noise multiplier σ ≤ {hi_limit:g} reaches ε ≤ {eps:g} at δ = {dlt:g} "
                       f"with q = {q:g} and T = {t} steps ({accountant} accountant gives "
                       f"ε = {eps_of(hi_limit):.4g} at σ = {hi_limit:g}). Raise the budget, take "
                       "fewer steps or a smaller sampling rate"
                       + (", or use a finer pld_discretization (the PLD grid bounds ε from "
                          "below)" if accountant == "pld" else "") + ".")
    hi = min(hi * 2.0, hi_limit)
  lo = hi
  while eps_of(lo) <= eps:
    if lo <= lo_limit:
      warnings.warn(
          f"σ = min_noise_multiplier = {lo_limit:g} already gives ε = {eps_of(lo):.4g} "
          f"≤ target {eps:g}; returning it. The target is so loose that almost no "
          "noise is needed; check the arguments.", UserWarning, stacklevel=2)
      return float(lo_limit)
    lo = max(lo / 2.0, lo_limit)
  # Now eps_of(lo) > eps ≥ eps_of(hi).

  sigma = _calibrate_cached(eps, dlt, q, t, accountant, float(pld_discretization), orders,
                            float(lo), float(hi), float(rtol))
  # Verify with the same (cached) computation users will call, nudge up if needed.
  while eps_of(sigma) > eps:
    sigma *= 1.0 + rtol
    if sigma > hi:
      sigma = hi
      break
  assert eps_of(sigma) <= eps
  return sigma


def max_steps(noise_multiplier: float, target_epsilon: float, target_delta: float,
              sampling_rate: float, accountant: str = "pld", *, max_steps_limit: int = 10 ** 7,
              pld_discretization: float = DEFAULT_PLD_DISCRETIZATION,
              rdp_orders: Sequence[float] | None = None) -> int:
  """Largest T with epsilon(σ, δ, q, T) ≤ target_epsilon (0 if even T = 1 exceeds it).

  Binary search on T (ε is non-decreasing in T); returns ``max_steps_limit`` if
  that many steps still fit in the budget.
  """
  sigma = check_noise_multiplier(noise_multiplier)
  eps = check_epsilon(target_epsilon)
  dlt = check_delta(target_delta)
  q = check_sampling_rate(sampling_rate)
  check_accountant(accountant)
  limit = check_steps(max_steps_limit)

  def fits(t: int) -> bool:
    return epsilon(sigma, dlt, q, t, accountant, pld_discretization=pld_discretization,
                   rdp_orders=rdp_orders) <= eps

  if not fits(1):
    return 0
  lo, hi = 1, 2
  while hi < limit and fits(hi):
    lo, hi = hi, min(2 * hi, limit)
  if hi >= limit and fits(limit):
    return limit
  while hi - lo > 1:  # fits(lo) and not fits(hi)
    mid = (lo + hi) // 2
    if fits(mid):
      lo = mid
    else:
      hi = mid
  return lo


def sampling_rate_for(expected_batch_size: float, num_examples: int) -> float:
  """q = expected batch size / N, validated to lie in (0, 1]."""
  if isinstance(num_examples, bool) or int(num_examples) != num_examples or num_examples < 1:
    raise ValueError(f"num_examples must be a positive integer, got {num_examples!r}.")
  b = _check_real("expected_batch_size", expected_batch_size)
  if not 0 < b <= num_examples:
    raise ValueError(f"expected_batch_size must be in (0, num_examples={num_examples}], "
                     f"got {expected_batch_size!r}.")
  return b / num_examples


def steps_for_epochs(epochs: float, sampling_rate: float) -> int:
  """T = ceil(epochs / q): the number of Poisson steps in which every record is
  expected to be seen ``epochs`` times (e.g. 20 epochs at q = 0.02 → 1000 steps)."""
  q = check_sampling_rate(sampling_rate)
  e = _check_real("epochs", epochs)
  if not e > 0:
    raise ValueError(f"epochs must be > 0, got {epochs!r}.")
  return max(1, math.ceil(e / q - 1e-9))

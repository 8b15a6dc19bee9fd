"""Thin adapters over ``logit_dp.accounting`` and ``logit_dp.ledger``.

The experiments call these functions only; each prefers the library's own module
and falls back to an equivalent implementation on ``dp_accounting`` (PLD) /
a JSON ledger when that module is not available (older installs).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional


def _lib_accounting():
  try:
    from logit_dp import accounting  # pylint: disable=g-import-not-at-top
    return accounting
  except ImportError:
    return None


def _event(sigma: float, q: float, steps: int):
  import dp_accounting  # pylint: disable=g-import-not-at-top
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), int(steps))


def _accountant(name: str):
  import dp_accounting  # pylint: disable=g-import-not-at-top
  if name == "rdp":
    return dp_accounting.rdp.RdpAccountant()
  return dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)


def noise_multiplier(target_epsilon: float, target_delta: float, sampling_rate: float,
                     steps: int, accountant: str = "pld") -> float:
  """σ such that ``steps`` Poisson(q)-subsampled Gaussian steps are (ε, δ)-DP."""
  acc = _lib_accounting()
  if acc is not None and hasattr(acc, "noise_multiplier"):
    return float(acc.noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                      sampling_rate=sampling_rate, steps=steps,
                                      accountant=accountant))
  import dp_accounting  # pylint: disable=g-import-not-at-top
  return float(dp_accounting.calibrate_dp_mechanism(
      lambda: _accountant(accountant), lambda s: _event(s, sampling_rate, steps),
      target_epsilon, target_delta,
      bracket_interval=dp_accounting.LowerEndpointAndGuess(0.1, 1.0)))


def epsilon(noise_multiplier_: float, target_delta: float, sampling_rate: float, steps: int,
            accountant: str = "pld") -> float:
  """ε spent after ``steps`` steps (0 for 0 steps)."""
  if steps <= 0:
    return 0.0
  acc = _lib_accounting()
  if acc is not None and hasattr(acc, "epsilon"):
    return float(acc.epsilon(noise_multiplier_, target_delta, sampling_rate, steps,
                             accountant=accountant))
  a = _accountant(accountant)
  a.compose(_event(noise_multiplier_, sampling_rate, steps))
  return float(a.get_epsilon(target_delta))


@dataclasses.dataclass
class Ledger:
  """What was spent: enough to recompute ε after a resume (saved with every checkpoint)."""

  noise_multiplier: float
  sampling_rate: float
  target_delta: float
  target_epsilon: float
  accountant: str = "pld"
  steps: int = 0
  method: str = ""

  def record(self, steps: int = 1):
    self.steps += int(steps)

  def epsilon(self) -> float:
    if not math.isfinite(self.noise_multiplier) or self.noise_multiplier <= 0:
      return math.inf if self.steps else 0.0
    return epsilon(self.noise_multiplier, self.target_delta, self.sampling_rate, self.steps,
                   self.accountant)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "Ledger":
    return cls(**{k: d[k] for k in d if k in {f.name for f in dataclasses.fields(cls)}})

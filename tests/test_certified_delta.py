"""The certified δ (accountant δ + padded batches' overflow term) stays within the δ asked for.

`PrivacyLedger.calibrated` and `experiments.train.privacy_plan` calibrate σ at
δ_acc = δ − (1 + e^ε)·(1 − (1 − p_over)^T). Checked against an independent computation:
p_over from scipy's binomial tail, the overflow term written out, ε from a dp_accounting PLD
accountant built here, on inputs where the overflow term is a large part of δ.
"""

import decimal
import json
import math

import dp_accounting
import numpy as np
import pytest
from scipy import stats

from experiments import train
from experiments.configs import tiny
from helpers import save_config_started_before
from logit_dp import accounting
from logit_dp import sampling
from logit_dp.ledger import PrivacyBudgetExceededError
from logit_dp.ledger import PrivacyLedger
from logit_dp.ledger import accountant_delta

N, Q = 50_000, 0.02


def independent_overflow(num_records, q, max_batch, steps, epsilon):
  """(1 + e^ε)·(1 − (1 − p)^T) with p = P[Binomial(N + 1, q) > max_batch], in 50-digit decimals
  (1 − p rounds p ≈ 1e-12 to 1e-4 relative in floats)."""
  return (1 + math.exp(epsilon)) * survival(stats.binom.sf(max_batch, num_records + 1, q), steps)


def survival(p, steps):
  """1 − (1 − p)^T, computed exactly enough."""
  with decimal.localcontext() as ctx:
    ctx.prec = 50
    return float(1 - (1 - decimal.Decimal(float(p))) ** steps)


def independent_epsilon(sigma, delta, q, steps, discretization):
  acc = dp_accounting.pld.PLDAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
      value_discretization_interval=discretization)
  acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
  return acc.get_epsilon(delta)


def tight_sampler():
  """A padded batch small enough that 1,000 steps at ε = 8 overflow by ~25% of δ = 1e-5."""
  b = sampling.max_batch_size_for(N, Q, overflow_probability=1e-12)
  return sampling.PoissonSampler(N, Q, max_batch_size=b)


def test_overflow_term_matches_the_formula():
  s = tight_sampler()
  for eps, steps in ((1.0, 10), (8.0, 1000), (20.0, 1)):
    assert s.overflow_delta(steps, eps) == pytest.approx(
        independent_overflow(N, Q, s.max_batch_size, steps, eps), rel=1e-9)
  assert sampling.overflow_term(5.0, 0, 1e-3) == 0.0
  assert sampling.overflow_term(5.0, 10, 0.0) == 0.0
  with pytest.raises(ValueError, match="overflow_probability"):
    sampling.overflow_term(5.0, 10, 1.0)


def test_calibrated_ledger_certifies_the_delta_asked_for():
  s = tight_sampler()
  eps, delta, steps = 8.0, 1e-5, 1000
  extra = independent_overflow(N, Q, s.max_batch_size, steps, eps)
  assert 0.1 * delta < extra < 0.5 * delta  # the stress: the term is a large part of δ
  led = PrivacyLedger.calibrated(s, eps, delta, steps)
  assert led.target_delta == pytest.approx(delta - extra, rel=1e-9)
  assert (led.epsilon_budget, led.delta_budget) == (eps, delta)
  led.record_steps(steps)
  eps_true = independent_epsilon(led.noise_multiplier, led.target_delta, Q, steps,
                                 led.pld_discretization)
  assert eps_true <= eps
  certified = led.target_delta + independent_overflow(N, Q, s.max_batch_size, steps, eps_true)
  assert led.delta() == pytest.approx(certified, rel=1e-9)
  assert certified <= delta
  # Calibrating at δ itself (the ledger's older use) certifies more than δ here.
  sigma_at_delta = accounting.noise_multiplier(eps, delta, Q, steps)
  old = PrivacyLedger.for_sampler(s, sigma_at_delta, delta, steps=steps)
  assert old.delta() > 1.2 * delta
  assert led.noise_multiplier > sigma_at_delta


def test_accountant_delta_refuses_when_overflow_eats_delta():
  p = 1e-9  # 1,000 steps at ε = 8: overflow term ≈ 3e-3 > δ
  with pytest.raises(ValueError, match="no σ can certify"):
    accountant_delta(8.0, 1e-5, 1000, p)
  sampler = sampling.PoissonSampler(
      N, Q, max_batch_size=sampling.max_batch_size_for(N, Q, overflow_probability=1e-9))
  with pytest.raises(ValueError, match="max_batch_size"):
    PrivacyLedger.calibrated(sampler, 8.0, 1e-5, 1000)
  assert accountant_delta(8.0, 1e-5, 1000, 0.0) == 1e-5


def test_accountant_delta_plus_the_overflow_term_never_rounds_above_delta():
  """(δ − x) + x rounds to above δ for ~0.4% of float inputs; the budget check is exact."""
  rng = np.random.default_rng(0)
  checked = 0
  for _ in range(20_000):
    delta, p = 10 ** rng.uniform(-9, -3), 10 ** rng.uniform(-15, -8)
    steps, eps = int(rng.integers(1, 5000)), float(rng.uniform(0.1, 10))
    extra = sampling.overflow_term(eps, steps, p)
    if extra >= delta:
      continue
    assert accountant_delta(eps, delta, steps, p) + extra <= delta
    checked += 1
  assert checked > 10_000


def test_record_steps_refuses_past_the_delta_budget():
  s = tight_sampler()
  led = PrivacyLedger.for_sampler(s, 1.0, 1e-5, delta_budget=1.1e-5)
  k = next(t for t in range(1, 10_000, 50) if led.delta(t) > 1.1e-5)
  led.record_steps(k - 50)
  with pytest.raises(PrivacyBudgetExceededError, match="δ budget"):
    led.record_steps(50)
  assert led.steps == k - 50  # nothing recorded
  led.record_steps(50, allow_exceeding_budget=True)
  assert led.delta() > 1.1e-5
  with pytest.raises(ValueError, match="below target_delta"):
    PrivacyLedger(1.0, 0.01, 1e-5, delta_budget=1e-6)
  round_trip = PrivacyLedger.from_dict(json.loads(json.dumps(led.to_dict())))
  assert round_trip == led


def test_privacy_plan_calibrates_at_the_accountant_delta():
  cfg = tiny.get_config()
  cfg.batch_size, cfg.num_epochs, cfg.target_epsilon = 1000, 20, 8.0
  plan = train.privacy_plan(cfg, N)
  p_over = stats.binom.sf(plan["max_batch"], N + 1, plan["sampling_rate"])
  extra = (1 + math.exp(8.0)) * survival(p_over, plan["steps"])
  assert plan["accountant_delta"] == pytest.approx(cfg.target_delta - extra, rel=1e-9)
  assert independent_epsilon(plan["noise_multiplier"], plan["accountant_delta"], Q, plan["steps"],
                             accounting.DEFAULT_PLD_DISCRETIZATION) <= 8.0
  cfg.delta_includes_overflow = False  # σ at target_delta
  legacy = train.privacy_plan(cfg, N)
  assert legacy["accountant_delta"] == cfg.target_delta
  assert legacy["noise_multiplier"] < plan["noise_multiplier"]


def test_a_run_started_before_the_field_resumes_only_with_the_old_calibration(tmp_path):
  cfg = tiny.get_config()
  save_config_started_before(cfg, tmp_path, "delta_includes_overflow")
  with pytest.raises(ValueError, match="different training config"):
    train.check_resumable(cfg, str(tmp_path))  # σ would change mid-run
  cfg.delta_includes_overflow = False
  train.check_resumable(cfg, str(tmp_path))

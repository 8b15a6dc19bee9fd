"""logit_dp.accounting: calibration round trips, monotonicity, PLD vs RDP,
input validation, and published reference values."""

import math
import warnings

import dp_accounting
import numpy as np
import pytest
from scipy import stats

from logit_dp import accounting

# The CIFAR-10 setting of the worked example in docs/guides/privacy_budget.md.
N = 50_000
Q = 1000 / N
T = 1000

# ----------------------------------------------------------------------------
# Round trip and accountant agreement.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("target_eps,q,steps", [(1.0, 0.01, 300), (5.0, Q, T)])
def test_round_trip(accountant, target_eps, q, steps):
  sigma = accountant_sigma = accounting.noise_multiplier(target_eps, 1e-5, q, steps, accountant)
  eps = accounting.epsilon(sigma, 1e-5, q, steps, accountant)
  assert eps <= target_eps  # the returned σ meets the target...
  assert eps >= 0.98 * target_eps  # ...and is not needlessly large:
  # 0.5 % less noise already violates the target.
  assert accounting.epsilon(0.995 * accountant_sigma, 1e-5, q, steps, accountant) > target_eps


@pytest.mark.parametrize("target_eps,q,steps,max_ratio", [
    pytest.param(5.0, Q, T, 1.06, marks=pytest.mark.extended),
    pytest.param(8.0, 0.005, 2000, 1.06, marks=pytest.mark.extended), (1.0, 0.01, 300, 1.16)
])
def test_pld_and_rdp_agree(target_eps, q, steps, max_ratio):
  """Both are upper bounds; PLD is near-exact, RDP looser. For training-length
  runs (T ≥ 1000) the calibrated σ agree within 6 %; for few steps and small ε
  RDP's conversion loss grows (≈ 14 % at ε = 1, T = 300)."""
  s_pld = accounting.noise_multiplier(target_eps, 1e-5, q, steps, "pld")
  s_rdp = accounting.noise_multiplier(target_eps, 1e-5, q, steps, "rdp")
  assert 0.995 * s_pld <= s_rdp <= max_ratio * s_pld, (s_pld, s_rdp)
  # At the same σ, PLD's ε is the smaller one (up to its grid).
  assert accounting.epsilon(s_pld, 1e-5, q, steps,
                            "pld") <= 1.01 * accounting.epsilon(s_pld, 1e-5, q, steps, "rdp")


def test_full_batch_matches_analytic_gaussian():
  """q = 1: T steps of σ are one Gaussian mechanism with σ/√T, whose exact
  δ(ε) = Φ(−εs + 1/(2s)) − e^ε Φ(−εs − 1/(2s)) (Balle & Wang 2018, Thm. 8)."""
  sigma, steps, delta = 4.0, 16, 1e-5
  eps = accounting.epsilon(sigma, delta, 1.0, steps, "pld", pld_discretization=1e-4)
  s = sigma / math.sqrt(steps)
  exact_delta = (stats.norm.cdf(-eps * s + 1 / (2 * s))
                 - math.exp(eps) * stats.norm.cdf(-eps * s - 1 / (2 * s)))
  assert exact_delta <= delta * 1.001  # PLD is an upper bound on ε...
  assert eps == pytest.approx(accounting.epsilon(s, delta, 1.0, 1, "pld", pld_discretization=1e-4),
                              rel=2e-3)
  # ...and a tight one: the exact ε at this δ is within 1 %.
  exact_eps = dp_accounting.get_epsilon_gaussian(s, delta)
  assert exact_eps <= eps <= 1.01 * exact_eps
  # RDP is valid too (larger), and q = 1 calibrates.
  assert accounting.epsilon(sigma, delta, 1.0, steps, "rdp") >= exact_eps
  s_cal = accounting.noise_multiplier(eps, delta, 1.0, steps, "rdp")
  assert sigma < s_cal < 1.1 * sigma


# ----------------------------------------------------------------------------
# Monotonicity.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_epsilon_monotone(accountant):
  def eps(sigma=1.0, delta=1e-5, q=0.01, steps=500):
    return accounting.epsilon(sigma, delta, q, steps, accountant)

  by_sigma = [eps(sigma=s) for s in (0.8, 1.0, 2.0)]
  by_steps = [eps(steps=t) for t in (1, 500, 2000)]
  by_q = [eps(q=q) for q in (0.001, 0.01, 1.0)]
  by_delta = [eps(delta=d) for d in (1e-9, 1e-5, 1e-3)]
  assert all(a > b for a, b in zip(by_sigma, by_sigma[1:]))
  assert all(a < b for a, b in zip(by_steps, by_steps[1:]))
  assert all(a < b for a, b in zip(by_q, by_q[1:]))
  assert all(a > b for a, b in zip(by_delta, by_delta[1:]))


def test_noise_multiplier_monotone():
  sig = lambda e, t: accounting.noise_multiplier(e, 1e-5, 0.01, t, "rdp")
  assert sig(1.0, 500) > sig(4.0, 500)  # more budget, less noise
  assert sig(4.0, 500) < sig(4.0, 2000)  # more steps, more noise


def test_noise_multiplier_calibrates_each_budget_once_and_checks_every_answer(monkeypatch):
  """The calibration is cached per process: the same arguments give the same σ without a second
  calibration; any other argument (ε, δ, q, T, accountant, PLD grid) is a calibration of its own,
  and every returned σ meets its own target."""
  from logit_dp._src import accounting as accounting_src
  accounting_src._calibrate_cached.cache_clear()
  calls = []
  calibrate = dp_accounting.calibrate_dp_mechanism

  def counting(*args, **kwargs):
    calls.append(args[2:4])  # (ε, δ)
    return calibrate(*args, **kwargs)

  monkeypatch.setattr(dp_accounting, "calibrate_dp_mechanism", counting)
  base = dict(target_epsilon=2.0, target_delta=1e-5, sampling_rate=0.01, steps=200,
              accountant="rdp")
  first = accounting.noise_multiplier(**base)
  assert accounting.noise_multiplier(**base) == first and len(calls) == 1
  others = [
      dict(base, target_epsilon=3.0),
      dict(base, target_delta=1e-6),
      dict(base, sampling_rate=0.02),
      dict(base, steps=400),
      dict(base, accountant="pld", sampling_rate=1.0, steps=2),
      dict(base, accountant="pld", sampling_rate=1.0, steps=2, pld_discretization=2e-3)
  ]
  for i, kwargs in enumerate(others, start=2):
    sigma = accounting.noise_multiplier(**kwargs)
    assert len(calls) == i, kwargs
    grid = kwargs.get("pld_discretization", accounting.DEFAULT_PLD_DISCRETIZATION)
    eps = accounting.epsilon(sigma, kwargs["target_delta"], kwargs["sampling_rate"],
                             kwargs["steps"], kwargs["accountant"], pld_discretization=grid)
    assert eps <= kwargs["target_epsilon"]
  assert len({accounting.noise_multiplier(**kwargs) for kwargs in [base] + others}) == 7
  assert len(calls) == 7  # all cached


def test_max_steps_and_helpers():
  t_max = accounting.max_steps(1.0, 3.0, 1e-5, 0.01, "rdp")
  assert accounting.epsilon(1.0, 1e-5, 0.01, t_max, "rdp") <= 3.0
  assert accounting.epsilon(1.0, 1e-5, 0.01, t_max + 1, "rdp") > 3.0
  assert accounting.max_steps(0.3, 0.01, 1e-5, 1.0, "rdp") == 0
  assert accounting.max_steps(100.0, 10.0, 1e-5, 0.001, "rdp", max_steps_limit=1000) == 1000
  assert accounting.sampling_rate_for(1000, N) == Q
  assert accounting.steps_for_epochs(20, Q) == 1000
  assert accounting.steps_for_epochs(1.5, 0.3) == 5
  with pytest.raises(ValueError):
    accounting.sampling_rate_for(0, 10)
  with pytest.raises(ValueError):
    accounting.sampling_rate_for(11, 10)


def test_make_event_and_accountant():
  event = accounting.make_event(1.3, 0.01, 7)
  assert event == dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.3)), 7)
  assert accounting.make_event(1.3, 1.0, 7) == dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(1.3), 7)
  for name, cls in [("pld", dp_accounting.pld.PLDAccountant),
                    ("rdp", dp_accounting.rdp.RdpAccountant)]:
    acc = accounting.make_accountant(name)
    assert isinstance(acc, cls)
    assert acc.neighboring_relation == dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
  assert accounting.epsilon(0.0, 1e-5, 0.01, 10) == math.inf


# ----------------------------------------------------------------------------
# Validation and warnings.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(target_epsilon=0.0), "target_epsilon"),
    (dict(target_epsilon=-1.0), "target_epsilon"),
    (dict(target_epsilon=math.inf), "target_epsilon"),
    (dict(target_delta=0.0), "target_delta"),
    (dict(target_delta=1.0), "target_delta"),
    (dict(target_delta=-1e-5), "target_delta"),
    (dict(sampling_rate=0.0), "sampling_rate"),
    (dict(sampling_rate=1.5), "sampling_rate"),
    (dict(steps=0), "steps"),
    (dict(steps=2.5), "steps"),
    (dict(accountant="moments"), "accountant"),
])
def test_noise_multiplier_rejects_bad_input(kwargs, match):
  args = dict(target_epsilon=2.0, target_delta=1e-5, sampling_rate=0.01, steps=100)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    accounting.noise_multiplier(**args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(target_delta=1.0), "target_delta"),
    (dict(sampling_rate=0.0), "sampling_rate"),
    (dict(steps=0), "steps"),
    (dict(accountant="gdp"), "accountant"),
])
def test_epsilon_rejects_bad_input(kwargs, match):
  args = dict(noise_multiplier=1.0, target_delta=1e-5, sampling_rate=0.01, steps=100)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    accounting.epsilon(**args)


def test_unreachable_target_raises():
  with pytest.raises(ValueError, match="No noise multiplier"):
    accounting.noise_multiplier(1.0, 1e-5, 0.5, 10_000, "rdp", max_noise_multiplier=5.0)
  # The PLD grid cannot certify ε far below its resolution for many steps.
  with pytest.raises(ValueError, match="No noise multiplier"):
    accounting.noise_multiplier(1e-4, 1e-5, Q, T, "pld")


def test_loose_target_returns_min_noise_with_warning():
  with pytest.warns(UserWarning, match="min_noise_multiplier"):
    sigma = accounting.noise_multiplier(1e4, 1e-5, 0.01, 10, "rdp")
  assert sigma == accounting.DEFAULT_MIN_NOISE_MULTIPLIER


def test_warns_when_delta_at_least_one_over_n():
  with pytest.warns(UserWarning, match="1/N"):
    accounting.epsilon(1.0, 1e-3, 0.01, 10, num_examples=1000)
  with pytest.warns(UserWarning, match="1/N"):
    accounting.noise_multiplier(2.0, 1 / N, Q, 10, "rdp", num_examples=N)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    accounting.epsilon(1.0, 1e-5, 0.01, 10, num_examples=1000)


# ----------------------------------------------------------------------------
# Published reference values.
# ----------------------------------------------------------------------------


def test_reference_dp_accounting_pld_subsampled_gaussian():
  """dp-accounting 0.6.0, dp_accounting/pld/pld_privacy_accountant_test.py,
  test_self_composed_subsampled_gaussian: 3 × PoissonSampled(q=0.2,
  Gaussian(σ=0.5)) gives ε = 1 at δ = 0.15594 (their tolerance 1e-3, at their
  default grid 1e-4)."""
  eps = accounting.epsilon(0.5, 0.15594, 0.2, 3, "pld", pld_discretization=1e-4)
  assert eps == pytest.approx(1.0, abs=1e-3)
  # Our default grid (1e-3) is pessimistic by less than 1 %.
  assert 1.0 - 1e-3 <= accounting.epsilon(0.5, 0.15594, 0.2, 3, "pld") <= 1.01


def test_reference_dp_accounting_pld_gaussian_full_batch():
  """Same test file, test_gaussian_basic: three Gaussian(σ=√3) releases
  (q = 1, no sampling) give ε = 1 at δ = 0.126936."""
  eps = accounting.epsilon(math.sqrt(3), 0.126936, 1.0, 3, "pld", pld_discretization=1e-4)
  assert eps == pytest.approx(1.0, abs=1e-3)


def test_reference_opacus_compute_dp_sgd_privacy():
  """Opacus documentation of opacus.scripts.compute_dp_sgd_privacy
  (https://opacus.ai/api/compute_dp_sgd_privacy.html): sampling rate 1 %,
  noise multiplier 1.0, 300 steps, RDP orders {2, 5, 10, 20, 100} satisfies
  (ε = 2.39, δ = 1e-5)-DP with optimal order 5."""
  eps = accounting.epsilon(1.0, 1e-5, 0.01, 300, "rdp", rdp_orders=[2, 5, 10, 20, 100])
  assert round(eps, 2) == 2.39
  # With the full default set of orders and the PLD accountant ε only improves.
  assert accounting.epsilon(1.0, 1e-5, 0.01, 300, "rdp") <= eps
  assert accounting.epsilon(1.0, 1e-5, 0.01, 300, "pld") <= eps


@pytest.mark.parametrize("sigma,epochs,published_eps", [(1.12, 60, 2.92), (0.6, 30, 9.74),
                                                        (1.2, 10, 1.20)])
def test_reference_tf_privacy_mnist_tutorial(sigma, epochs, published_eps):
  """TensorFlow Privacy, tutorials/README.md ("Select Parameters" table):
  MNIST N = 60,000, batch 256, δ = 1e-5 — σ = 1.12 for 60 epochs: ε = 2.92;
  σ = 0.6 for 30 epochs: ε = 9.74; σ = 1.2 for 10 epochs: ε = 1.20. Those
  values were computed by TF Privacy's RDP accountant with its orders
  {1.1, …, 10.9} ∪ {12, …, 63} and the classic conversion
  ε = min_α RDP(α) + log(1/δ)/(α − 1) (Mironov 2017, Prop. 3). We rebuild
  them from our event and dp-accounting's RDP curve (tolerance 0.5 %), then
  check that the improved conversion and the PLD accountant only lower ε."""
  q, steps = 256 / 60_000, epochs * 60_000 // 256
  orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
  acc = accounting.make_accountant("rdp", rdp_orders=orders)
  acc.compose(accounting.make_event(sigma, q, steps))
  rdp = np.asarray(acc._rdp)  # pylint: disable=protected-access
  classic_eps = float(np.min(rdp + math.log(1 / 1e-5) / (np.asarray(orders) - 1)))
  assert classic_eps == pytest.approx(published_eps, rel=5e-3)
  assert accounting.epsilon(sigma, 1e-5, q, steps, "rdp", rdp_orders=orders) <= classic_eps
  assert accounting.epsilon(sigma, 1e-5, q, steps, "pld") <= classic_eps


def test_privacy_budget_guide_example():
  """The σ of the privacy-budget guide's worked example: CIFAR-10, N = 50,000, expected batch
  1,000 (q = 0.02), 20 epochs (T = 1,000), ε = 5, δ = 1/N."""
  with pytest.warns(UserWarning, match="1/N"):
    sigma = accounting.noise_multiplier(5.0, 1 / N, Q, T, "pld", num_examples=N)
  assert sigma == pytest.approx(0.872, abs=2e-3)
  assert accounting.epsilon(sigma, 1 / N, Q, T, "pld") <= 5.0

"""Every python block of README.md runs as written and prints what the README quotes.

The blocks run in order in one namespace (the multi-device block continues the
ones before it). A block line ``# -> TEXT`` quotes the next line its prints
write; the prose numbers of the worked example are recomputed here.
"""

import contextlib
import io
import math
import os
import re

import dp_accounting
import pytest
from scipy import stats

import logit_dp
from logit_dp import accounting

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _text():
  with open(README, encoding="utf-8") as f:
    return f.read()


def _blocks():
  return re.findall(r"```python\n(.*?)```", _text(), re.S)


def _sci(x, digits):
  """1.3e-7 style: the README's way of writing small numbers."""
  mantissa, exponent = f"{x:.{digits}e}".split("e")
  return f"{mantissa}e{int(exponent)}"


# The tests that execute the README are slow (the module fixture runs every block: a training
# loop and a multi-device step, each library piece also tested by default in its own module;
# test_accounting.test_readme_worked_example checks the worked example's σ by default).
_SLOW = pytest.mark.slow


@pytest.fixture(scope="module")
def executed():
  namespace, runs = {}, []
  for i, block in enumerate(_blocks()):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(block, f"README.md python block {i}", "exec"), namespace)  # noqa: S102
    runs.append((block, out.getvalue().splitlines()))
  return namespace, runs


def test_readme_has_the_blocks_this_test_knows():
  blocks = _blocks()
  assert len(blocks) == 6
  assert sum("# -> " in b for b in blocks) == 4


@_SLOW
def test_every_block_runs_and_prints_what_it_quotes(executed):
  _, runs = executed
  for block, printed in runs:
    quoted = re.findall(r"^# -> (.*)$", block, re.M)
    assert printed == quoted, block[:200]


@_SLOW
def test_worked_example_numbers(executed):
  namespace, _ = executed
  text = " ".join(_text().split())  # one space everywhere, so line breaks do not matter
  n = 50_000
  q = 1_000 / n
  steps = math.ceil(20 / q)
  delta = 1 / n
  assert (namespace["q"], namespace["T"], namespace["N"]) == (q, steps, n)
  assert "# 0.02 " in text and "# 1000 " in text
  # σ at δ minus the overflow term of the padded batches (1 + e^ε)·(1 − (1 − p)^T) ≈
  # (1 + e^ε)·T·p, p = P[Binomial(N + 1, q) > padded size] (p ≈ 1e-12: T·p is exact to 1e-9).
  sampler, ledger = namespace["sampler"], namespace["ledger"]
  p_over = stats.binom.sf(sampler.max_batch_size, n + 1, q)
  extra = (1 + math.exp(5.0)) * steps * p_over
  delta_acc = delta - extra
  assert ledger.target_delta == pytest.approx(delta_acc, rel=1e-9)
  sigma = accounting.noise_multiplier(5.0, ledger.target_delta, q, steps, accountant="pld")
  sigma_rdp = accounting.noise_multiplier(5.0, ledger.target_delta, q, steps, accountant="rdp")
  # ε at that σ from a fresh dp_accounting PLD accountant, not the library's.
  acc = dp_accounting.pld.PLDAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
      value_discretization_interval=1e-3)
  acc.compose(
      dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
  eps = acc.get_epsilon(ledger.target_delta)
  assert (f"**σ = {sigma:.3f}** (ε = {eps:.2f}; the RDP accountant needs "
          f"σ = {sigma_rdp:.3f})") in text

  def row(label, loss, c_fmt, std_fmt, mean_fmt):
    c = logit_dp.sensitivity(loss, 1.0, batch_size=None)
    return (f"| {label} | {c:{c_fmt}} | {sigma * c:{std_fmt}} · B | "
            f"{sigma * c / 1000:{mean_fmt}} · B |")

  contrastive = logit_dp.losses.contrastive
  assert row("contrastive, τ = 1", contrastive(temperature=1.0), ".2f", ".1f", ".4f") in text
  with pytest.warns(logit_dp.losses.LargeSensitivityWarning):
    assert row("contrastive, τ = 0.2", contrastive(temperature=0.2), ",.0f", ",.0f", ".0f") in text
  assert row("spreadout", logit_dp.losses.spreadout(), "g", ".2f", ".4f") in text

  c_1000 = logit_dp.sensitivity(contrastive(temperature=1.0), 1.0, batch_size=1000)
  assert f"hardly more than the {c_1000:.2f} at n = 1,000" in text
  with pytest.warns(logit_dp.losses.LargeSensitivityWarning):
    sup = logit_dp.sensitivity(contrastive(temperature=0.2), 1.0)
    at_1000 = logit_dp.sensitivity(contrastive(temperature=0.2), 1.0, batch_size=1000)
  assert (f"(a = e¹⁰ ≈ {math.exp(10):,.0f}) the supremum is {sup:,.0f}, "
          f"{sup / at_1000:.0f}×") in text
  assert f"C/B ≈ {sup / 1e5:.1f}·10⁵" in text

  assert ledger.steps == steps and ledger.noise_multiplier == sigma
  certified = ledger.target_delta + (1 + math.exp(ledger.epsilon())) * steps * p_over
  assert ledger.delta() == pytest.approx(certified, rel=1e-9) and ledger.delta() <= delta
  old_sigma = accounting.noise_multiplier(5.0, delta, q, steps, accountant="pld")
  old_eps = accounting.epsilon(old_sigma, delta, q, steps)
  old_delta = delta + (1 + math.exp(old_eps)) * steps * p_over
  assert (f"Padded batches hold {sampler.max_batch_size:,} rows, so a batch overflows with "
          f"probability {_sci(p_over, 1)} per step. Over T = {steps:,} steps that costs δ up to "
          f"(1 + e^ε)·T·p_over = {_sci(extra, 1)}") in text
  assert f"calibrates σ at δ − {_sci(extra, 1)} = {_sci(delta_acc, 3)}, not at δ" in text
  assert f"is ({ledger.epsilon():.2f}, ≤ {_sci(delta, 0)})" in text
  assert f"would certify ({old_eps:.2f}, {_sci(old_delta, 3)})" in text


@_SLOW
def test_make_private_section_matches_its_parts(executed):
  namespace, _ = executed
  private = namespace["private"]
  q = 32 / 512
  assert private.steps == math.ceil(1 / q)
  assert private.noise_multiplier == accounting.noise_multiplier(5.0, private.ledger.target_delta,
                                                                 q, private.steps)
  assert private.ledger.target_delta <= 1e-6 and private.ledger.delta_budget == 1e-6
  assert private.ledger.steps == private.steps


@_SLOW
def test_two_tower_section_trains_both_towers(executed):
  namespace, _ = executed
  clip = namespace["clip"]
  assert clip.sensitivity == namespace["private"].sensitivity  # C of one tower
  # The loop recorded every step itself and released exactly that many noisy updates.
  assert clip.ledger.steps == clip.steps == int(namespace["clip_state"][0].count)
  assert clip.ledger.guarantee() == namespace["private"].ledger.guarantee()

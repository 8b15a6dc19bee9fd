"""Every python block of the documentation pages runs as written.

The blocks of one page run in order, each in a fresh namespace unless its first line says it
continues the block above ("# Continues the block above (...)."; `helpers.run_blocks`): then
in that block's namespace. A block line ``# -> TEXT`` quotes the line its prints write there.
Every page with python blocks is listed below, so a new page's code cannot go unexecuted. The
slow pages (a training loop, several model libraries, multi-device compilation: half a minute or
more each) are slow-marked and run in CI with the README's blocks, after
`pip install -e '.[docs]'` (Equinox).
"""

import math
import os
import re

import dp_accounting
import pytest
from scipy import stats

import logit_dp
from helpers import continues
from helpers import free_names
from helpers import import_jax_privacy
from helpers import python_blocks
from helpers import run_blocks
from logit_dp import accounting

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
# Not pages of the site: build output, run results, the generated API pages.
NOT_PAGES = ("_build", "results", "benchmarks", os.path.join("api", "_autosummary"))

FAST_PAGES = ("guides/privacy_budget.md",)
SLOW_PAGES = (
    "guides/choosing_a_clip_method.md",
    "getting_started/index.md",
    "guides/bring_your_own_model.md",
    "guides/distributed.md",
    "guides/privacy_per_person.md",
    "guides/finetuning.md",
)
# Pages that need jax_privacy (the `jax-privacy` extra); slow, run in CI with it installed.
JAX_PRIVACY_PAGES = ("guides/jax_privacy.md",)


def _read(page):
  with open(os.path.join(DOCS, page), encoding="utf-8") as f:
    return f.read()


def _pages():
  for root, dirs, files in os.walk(DOCS):
    dirs[:] = [d for d in dirs if os.path.relpath(os.path.join(root, d), DOCS) not in NOT_PAGES]
    for name in files:
      if name.endswith(".md"):
        yield os.path.relpath(os.path.join(root, name), DOCS).replace(os.sep, "/")


def _run_page(page):
  """Runs the page's blocks (`helpers.run_blocks`); the namespace of the last one."""
  last = {}
  for i, (block, namespace, printed) in enumerate(run_blocks(python_blocks(_read(page)), page)):
    quoted = re.findall(r"^# -> (.*)$", block, re.M)
    if quoted:
      assert printed == quoted, f"{page} block {i}"
    last = namespace
  return last


def test_every_page_with_code_is_executed():
  with_code = {page for page in _pages() if python_blocks(_read(page))}
  assert with_code == set(FAST_PAGES) | set(SLOW_PAGES) | set(JAX_PRIVACY_PAGES)


def test_every_block_stands_alone_or_says_it_continues():
  """A block that reads names it does not define is marked as continuing the one above, and a
  page's first block continues nothing."""
  for page in _pages():
    for i, block in enumerate(python_blocks(_read(page))):
      if continues(block):
        assert i > 0, f"{page} block 0 continues no block"
      else:
        assert not free_names(block), (page, i, sorted(free_names(block)))


# Warnings that a page's blocks raise on purpose (the worked example's δ = 1/N).
EXPECTED_WARNINGS = {"guides/privacy_budget.md": "1/N"}


@pytest.mark.parametrize("page", FAST_PAGES)
def test_page_blocks_run(page):
  if page in EXPECTED_WARNINGS:
    with pytest.warns(UserWarning, match=EXPECTED_WARNINGS[page]):
      _run_page(page)
  else:
    _run_page(page)


@pytest.mark.slow
@pytest.mark.parametrize("page", SLOW_PAGES)
def test_slow_page_blocks_run(page):
  _run_page(page)


@pytest.mark.slow
def test_jax_privacy_page_gives_the_ledgers_epsilon():
  """The training steps with jax_privacy's sampling, privatizer and accountant run, its ε is
  logit_dp's ledger's (the same PLD computation), and its fixed-size-batch ε is logit_dp's
  Poisson ε at noise multiplier (noise std)/C_rep."""
  import_jax_privacy()
  (page,) = JAX_PRIVACY_PAGES
  ns = _run_page(page)
  assert ns["ledger"].steps == ns["T"]
  assert math.isclose(ns["eps_jax_privacy"], ns["eps_ledger"], rel_tol=1e-12)
  assert ns["C_rep"] == logit_dp.sensitivity(
      ns["loss"], 1.0, ns["b"], neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  assert math.isclose(
      ns["eps_replace"],
      accounting.epsilon(ns["noise_std"] / ns["C_rep"], ns["delta"], ns["b"] / ns["N"], ns["T"]),
      rel_tol=1e-12)
  assert ns["eps_replace"] < ns["eps_replace_2c"]
  # Per person: UserSelectionStrategy's batches, the per-person ledger's ε.
  assert ns["private"].ledger.unit == "person" and ns["private"].ledger.steps == ns["T"]
  assert math.isclose(ns["eps_person_jax_privacy"], ns["eps_person_ledger"], rel_tol=1e-9)


def _sci(x, digits):
  """1.3e-7 style: the pages' way of writing small numbers."""
  mantissa, exponent = f"{x:.{digits}e}".split("e")
  return f"{mantissa}e{int(exponent)}"


def test_privacy_budget_guide_numbers():
  """The prose numbers of the worked example, recomputed: σ with an independent PLD accountant,
  the noise table from the sensitivities, the overflow term from the binomial tail."""
  page = "guides/privacy_budget.md"
  with pytest.warns(UserWarning, match="1/N"):
    namespace = _run_page(page)
  text = " ".join(_read(page).split())  # one space everywhere, so line breaks do not matter
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

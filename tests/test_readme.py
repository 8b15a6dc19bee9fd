"""Every python block of README.md runs as written and prints what the README quotes.

The blocks run in order, each in a fresh namespace unless its first line says it continues the
block above (`helpers.run_blocks`: the two-tower block continues the make_private one). A
block line ``# -> TEXT`` quotes the next line its prints write.
"""

import math
import os
import re

import pytest

import logit_dp
from helpers import continues
from helpers import free_names
from helpers import python_blocks
from helpers import run_blocks
from logit_dp import accounting

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _text():
  with open(README, encoding="utf-8") as f:
    return f.read()


def _blocks():
  return python_blocks(_text())


# The tests that execute the README are slow (the module fixture runs every block: two training
# loops, each library piece also tested by default in its own module).
_SLOW = pytest.mark.slow


@pytest.fixture(scope="module")
def executed():
  namespace, runs = {}, []
  for block, block_namespace, printed in run_blocks(_blocks(), "README.md"):
    namespace.update(block_namespace)
    runs.append((block, printed))
  return namespace, runs


def test_readme_has_the_blocks_this_test_knows():
  blocks = _blocks()
  assert len(blocks) == 2
  assert sum("# -> " in b for b in blocks) == 2
  assert [continues(b) for b in blocks] == [False, True]


def test_every_block_stands_alone_or_says_it_continues():
  """A block that reads names it does not define is marked as continuing the one above."""
  for i, block in enumerate(_blocks()):
    assert continues(block) or not free_names(block), (i, free_names(block))


def test_privacy_paragraph_constant():
  """The README's C/B at τ = 0.2: the supremum over batch sizes of the contrastive loss's."""
  with pytest.warns(logit_dp.losses.LargeSensitivityWarning):
    sup = logit_dp.sensitivity(logit_dp.losses.contrastive(temperature=0.2), 1.0)
  assert f"C/B ≈ {sup / 1e5:.1f}·10⁵" in " ".join(_text().split())


@_SLOW
def test_every_block_runs_and_prints_what_it_quotes(executed):
  _, runs = executed
  for block, printed in runs:
    quoted = re.findall(r"^# -> (.*)$", block, re.M)
    assert printed == quoted, block[:200]


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

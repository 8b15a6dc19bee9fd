"""Every python block of the documentation pages runs as written.

The blocks of one page run in order in one namespace (a block may continue the one before it).
A block line ``# -> TEXT`` quotes the line its prints write there. Every page with python
blocks is listed below, so a new page's code cannot go unexecuted. The slow pages (a training
loop, several model libraries, multi-device compilation: half a minute or more each) are
slow-marked and run in CI with the README's blocks, after `pip install -e '.[docs]'` (Equinox).
"""

import contextlib
import io
import os
import re

import pytest

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
# Not pages of the site: build output, run results, the generated API pages.
NOT_PAGES = ("_build", "results", "benchmarks", os.path.join("api", "_autosummary"))

FAST_PAGES = ("guides/choosing_a_clip_method.md",)
SLOW_PAGES = (
    "getting_started/index.md",
    "guides/bring_your_own_model.md",
    "guides/distributed.md",
)


def python_blocks(text):
  """The ```python fenced blocks of a markdown text, as in tests/test_readme.py."""
  return re.findall(r"```python\n(.*?)```", text, re.S)


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
  namespace = {}
  for i, block in enumerate(python_blocks(_read(page))):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(block, f"{page} python block {i}", "exec"), namespace)  # noqa: S102
    quoted = re.findall(r"^# -> (.*)$", block, re.M)
    if quoted:
      assert out.getvalue().splitlines() == quoted, f"{page} block {i}"


def test_every_page_with_code_is_executed():
  with_code = {page for page in _pages() if python_blocks(_read(page))}
  assert with_code == set(FAST_PAGES) | set(SLOW_PAGES)


@pytest.mark.parametrize("page", FAST_PAGES)
def test_page_blocks_run(page):
  _run_page(page)


@pytest.mark.slow
@pytest.mark.parametrize("page", SLOW_PAGES)
def test_slow_page_blocks_run(page):
  _run_page(page)

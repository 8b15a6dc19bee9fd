"""docs/guarantees.md names tests that exist and run by default (not marked slow)."""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `test_x.py::test_name` or, after one, `::test_name` (the same file).
_REFERENCE = re.compile(r"`((?:\w+/)?test_\w+\.py)?::(test_\w+)")


def _references():
  with open(os.path.join(ROOT, "docs", "guarantees.md"), encoding="utf-8") as f:
    text = f.read()
  current, out = None, []
  for match in _REFERENCE.finditer(text):
    current = match.group(1) or current
    out.append((current, match.group(2)))
  return out


def _is_slow(decorator) -> bool:
  """`@pytest.mark.slow` or an alias of it (`_SLOW`, `SLOW`), or `@pytest.mark.extended`: not in
  the default run; a parametrization with some such cases is (its default cases run)."""
  return isinstance(
      decorator,
      (ast.Attribute, ast.Name)) and ast.unparse(decorator) in ("pytest.mark.slow", "_SLOW", "SLOW",
                                                                "pytest.mark.extended")


def _default_tests(filename):
  with open(os.path.join(ROOT, "tests", filename), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  return {
      node.name for node in tree.body
      if isinstance(node, ast.FunctionDef) and not any(_is_slow(d) for d in node.decorator_list)
  }


def test_the_map_lists_tests():
  assert len(_references()) > 40


@pytest.mark.parametrize("filename,name", sorted(set(_references())))
def test_every_test_in_the_map_exists_and_is_not_slow(filename, name):
  assert filename is not None, name
  assert name in _default_tests(filename), f"{filename}::{name} is missing or marked slow"

"""The package's module structure: no import cycle, no module using another's private names."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "logit_dp"


def _modules() -> dict[str, ast.Module]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = ast.parse(path.read_text())
  return out


def _imports(tree: ast.Module) -> dict[str, str]:
  """local name -> the logit_dp module it is bound to, for `from logit_dp... import module`."""
  bound = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("logit_dp"):
      for alias in node.names:
        bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("logit_dp"):
          bound[alias.asname or alias.name] = alias.name
  return bound


def _top_level_imports(tree: ast.Module, modules) -> set[str]:
  """The logit_dp modules a module imports when it is imported (not inside functions)."""
  out = set()
  nodes = [n for n in tree.body]
  while nodes:
    node = nodes.pop()
    if isinstance(node, ast.If):  # `if TYPE_CHECKING:` blocks are not run
      if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
        nodes.extend(node.body + node.orelse)
    elif isinstance(node, ast.Try):
      nodes.extend(node.body)
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("logit_dp"):
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        out.add(full if full in modules else node.module)
    elif isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.startswith("logit_dp"))
  return out


def test_no_import_cycle():
  modules = _modules()
  graph = {name: _top_level_imports(tree, modules) & set(modules) for name, tree in modules.items()}
  for name in graph:  # a package's __init__ importing its own submodules is not a cycle
    graph[name] = {m for m in graph[name] if not (m.startswith(name + ".") or m == name)}
  state = {}

  def visit(name, path):
    if state.get(name) == "done":
      return
    if state.get(name) == "open":
      cycle = path[path.index(name):] + [name]
      pytest.fail("import cycle: " + " -> ".join(cycle))
    state[name] = "open"
    for dep in sorted(graph[name]):
      visit(dep, path + [name])
    state[name] = "done"

  for name in sorted(graph):
    visit(name, [])


def test_no_module_uses_another_modules_private_names():
  modules = _modules()
  found = []
  for name, tree in modules.items():
    bound = _imports(tree)
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("logit_dp"):
        found += [
            f"{name}: from {node.module} import {a.name}" for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")
        ]
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in bound and node.attr.startswith("_")
          and not node.attr.startswith("__")):
        found.append(f"{name}: {node.value.id}.{node.attr}")
  assert not found, found


def _public_modules():
  import types  # pylint: disable=g-import-not-at-top

  import logit_dp  # pylint: disable=g-import-not-at-top
  return [logit_dp] + [
      getattr(logit_dp, name)
      for name in logit_dp.__all__ if isinstance(getattr(logit_dp, name), types.ModuleType)
  ]


def test_the_top_level_is_small_and_every_public_name_is_exported_once():
  import types  # pylint: disable=g-import-not-at-top

  import logit_dp  # pylint: disable=g-import-not-at-top
  assert len(logit_dp.__all__) <= 22
  where = {}
  for module in _public_modules():
    assert len(set(module.__all__)) == len(module.__all__), module.__name__
    for name in module.__all__:
      value = getattr(module, name)
      if callable(value) and not isinstance(value, types.ModuleType):
        where.setdefault(id(value), []).append(f"{module.__name__}.{name}")
  twice = [places for places in where.values() if len(places) > 1]
  assert not twice, twice


def test_public_docstrings_do_not_send_the_reader_into_src():
  found = []
  for module in _public_modules():
    if "_src" in (module.__doc__ or ""):
      found.append(module.__name__)
    for name in module.__all__:
      value = getattr(module, name)
      if callable(value) and "logit_dp._src" in (getattr(value, "__doc__", None) or ""):
        found.append(f"{module.__name__}.{name}")
  assert not found, found


@pytest.mark.parametrize("name", ["clipped_grad", "make_private", "sensitivity", "transform"])
def test_top_level_functions_document_each_parameter_on_its_own(name):
  import inspect  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top

  import logit_dp  # pylint: disable=g-import-not-at-top
  fn = getattr(logit_dp, name)
  args = inspect.getdoc(fn).split("Args:")[1]
  for parameter in inspect.signature(fn).parameters.values():
    stars = "**" if parameter.kind is parameter.VAR_KEYWORD else ""
    assert re.search(rf"^  {re.escape(stars + parameter.name)}:", args, re.M), parameter.name


def test_moved_top_level_names_still_work_with_a_deprecation_warning():
  import importlib  # pylint: disable=g-import-not-at-top

  import logit_dp  # pylint: disable=g-import-not-at-top
  moved = logit_dp._MOVED  # pylint: disable=protected-access
  assert len(moved) == 18
  for name, module in moved.items():
    assert name not in logit_dp.__all__
    with pytest.warns(DeprecationWarning, match=f"use logit_dp.{module}.{name}"):
      value = getattr(logit_dp, name)
    assert value is getattr(importlib.import_module(f"logit_dp.{module}"), name)
  with pytest.warns(DeprecationWarning, match="PRIVATE_METHODS is deprecated"):
    assert logit_dp.PRIVATE_METHODS == ("ghost", "materialize", "triangle", "projected", "naive",
                                        "dp_gcl")
  with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
    _ = logit_dp.not_a_name


def test_the_public_names_do_not_warn():
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = (
      "import warnings; warnings.simplefilter('error')\n"
      "from logit_dp import *\n"
      "import logit_dp\n"
      "for m in logit_dp.__all__:\n"
      "  for n in getattr(getattr(logit_dp, m), '__all__', ()): getattr(getattr(logit_dp, m), n)\n")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)

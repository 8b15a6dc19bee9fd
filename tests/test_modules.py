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

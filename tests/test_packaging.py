"""The distribution's metadata: one version everywhere, dependencies that match the imports,
dependency floors that CI pins, and the files a published package carries."""

import ast
import importlib.metadata
import os
import re
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import logit_dp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]


def _requirements(specs):
  """{canonical name: Requirement} of ``specs``, self-references (logit_dp[...]) left out."""
  reqs = (Requirement(s) for s in specs)
  return {canonicalize_name(r.name): r for r in reqs if canonicalize_name(r.name) != "logit-dp"}


def _imported_distributions(*folders):
  """The distributions that the Python files under ``folders`` import at the top level of a
  module name (standard library and first-party modules left out), by import name."""
  first_party = {"logit_dp", "experiments", "benchmarks", "tests"}
  local = set()
  names = set()
  for folder in folders:
    for root, _, files in os.walk(os.path.join(REPO, folder)):
      local |= {f[:-3] for f in files if f.endswith(".py")}
      for f in files:
        if not f.endswith(".py"):
          continue
        with open(os.path.join(root, f)) as source:
          tree = ast.parse(source.read())
        for node in ast.walk(tree):
          if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
          elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
  names -= set(sys.stdlib_module_names) | first_party | local
  installed = importlib.metadata.packages_distributions()
  return {n: {canonicalize_name(d) for d in installed.get(n, ())} for n in names}


def test_one_version_everywhere():
  version = _pyproject()["version"]
  assert logit_dp.__version__ == version
  with open(os.path.join(REPO, "CITATION.cff")) as f:
    assert re.search(r"^version: (\S+)$", f.read(), re.M).group(1) == version
  with open(os.path.join(REPO, "CHANGELOG.md")) as f:
    assert f"## [{version}]" in f.read()


def test_core_dependencies_are_what_the_library_imports():
  """Every distribution logit_dp/ imports is a core dependency, and every core dependency is
  imported by logit_dp/ (none is carried for the experiments' sake)."""
  core = _requirements(_pyproject()["dependencies"])
  imported = _imported_distributions("logit_dp")
  for name, dists in imported.items():
    assert dists & set(core), f"logit_dp imports {name} ({dists or 'not installed'}): not core"
  used = set().union(*imported.values())
  assert set(core) <= used, f"core dependencies logit_dp never imports: {set(core) - used}"


def test_experiments_extra_covers_the_experiment_imports():
  project = _pyproject()
  core = _requirements(project["dependencies"])
  extras = {k: _requirements(v) for k, v in project["optional-dependencies"].items()}
  covered = set(core) | set(extras["experiments"])
  # Imported lazily: by the tfds data source, by the jax_privacy tests (which skip without it).
  optional = {"tensorflow_datasets": "tfds", "jax_privacy": "jax-privacy"}
  for name, dists in _imported_distributions("experiments", "benchmarks").items():
    if name in optional:
      assert canonicalize_name(name) in extras[optional[name]]
      continue
    assert dists & covered, f"experiments import {name} ({dists or 'not installed'})"
  # The test extra installs what the tests import, directly or through its own requirements
  # (jupyter_client comes with nbclient, packaging with pytest).
  test = set(extras["test"])
  test |= {
      canonicalize_name(Requirement(r).name) for d in extras["test"]
      for r in importlib.metadata.requires(d) or ()
  }
  for name, dists in _imported_distributions("tests").items():
    assert dists & (covered | test) or name in optional, name


def test_floor_constraints_pin_every_floor():
  """.ci/floor-constraints.txt installs each dependency at its lower bound in pyproject.toml."""
  project = _pyproject()
  with open(os.path.join(REPO, ".ci", "floor-constraints.txt")) as f:
    pins = _requirements(
        line for line in f.read().splitlines() if line.strip() and not line.startswith("#"))
  specs = list(project["dependencies"])
  for extra in ("experiments", "test"):
    specs += project["optional-dependencies"][extra]
  for name, req in _requirements(specs).items():
    floors = [s.version for s in req.specifier if s.operator == ">="]
    if not floors:
      continue
    assert name in pins, f"{name} has no floor pin"
    (pin,) = pins[name].specifier
    assert pin.operator == "==" and Version(pin.version) == Version(floors[0]), (name, str(pin))


@pytest.mark.parametrize("name", ["LICENSE", "CHANGELOG.md", "CITATION.cff", "logit_dp/py.typed"])
def test_published_files_exist(name):
  assert os.path.isfile(os.path.join(REPO, name))


def test_license_is_apache_2():
  with open(os.path.join(REPO, "LICENSE")) as f:
    text = f.read()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text
  assert _pyproject()["license"] == "Apache-2.0"


def test_type_marker_is_package_data():
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
  assert "py.typed" in package_data["logit_dp"]

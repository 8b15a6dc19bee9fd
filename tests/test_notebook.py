"""Executes notebooks/quickstart.ipynb (the test suite runs the notebook end to end)."""

import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks",
                        "quickstart.ipynb")

# Run after the notebook's own cells, in its kernel; not saved.
CHECKS = """
assert (y_te[test_pairs[:, 0]] == y_te[test_pairs[:, 1]]).all()   # test pairs are positives
assert curves["Non-private"][-1] < curves["Non-private"][0]        # so the plain loss falls
assert all(p.ledger.steps == p.steps == len(curves[n]) - 1 for n, p in private.items())
seeds = [p.sampler.seed for p in private.values()]
assert len(set(seeds)) == len(seeds) and 0 not in seeds           # drawn with `secrets`
import matplotlib
assert "inline" in matplotlib.get_backend()                       # the kernel's, not forced
print("checks passed")
"""


def _ensure_kernel():
  from jupyter_client.kernelspec import KernelSpecManager
  from jupyter_client.kernelspec import NoSuchKernel
  try:
    KernelSpecManager().get_kernel_spec("python3")
  except NoSuchKernel:
    ipykernel = pytest.importorskip("ipykernel.kernelspec")
    ipykernel.install(user=True)


def _text(nb):
  return "".join(
      o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_committed_notebook_has_its_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.outputs for c in code), "execute it with jupyter nbconvert --execute --inplace"
  assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)
  sources = "".join(c.source for c in code)
  assert "matplotlib.use(" not in sources
  assert "noise_key=" not in sources and "sampler_seed=" not in sources
  assert not any("execution" in c.metadata for c in code), "no execution timestamps"


@pytest.mark.slow  # a training run in a kernel; test_private_training runs make_private's loop
def test_quickstart_notebook_runs():
  _ensure_kernel()
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nb.cells.append(nbformat.v4.new_code_cell(CHECKS))
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
  client.execute()
  outputs = _text(nb)
  for name in ("Logit-DP", "Naive-DP", "Non-private"):
    assert f"{name}" in outputs and "k-NN accuracy" in outputs
  assert "checks passed" in outputs

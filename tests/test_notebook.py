"""Executes notebooks/quickstart.ipynb (the test suite runs the notebook end to end)."""

import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "notebooks", "quickstart.ipynb")


def _ensure_kernel():
  from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
  try:
    KernelSpecManager().get_kernel_spec("python3")
  except NoSuchKernel:
    ipykernel = pytest.importorskip("ipykernel.kernelspec")
    ipykernel.install(user=True)


def test_quickstart_notebook_runs():
  _ensure_kernel()
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(
      nb, timeout=600, kernel_name="python3",
      resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
  client.execute()
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
  for name in ("Logit-DP", "Naive-DP", "Non-private"):
    assert f"{name}" in outputs and "k-NN accuracy" in outputs

r"""How spread out a run's test embeddings are: a diagnostic for collapsed encoders.

For the first ``n`` test images of a finished pretrain.py run, every method's final encoder
(and the seed's untrained one) gives embeddings e_1..e_n, u_i = e_i / ‖e_i‖. Reported:

    median ‖e_i‖,
    mean and min of cos(e_i, e_j) = u_iᵀu_j over i ≠ j,
    ‖ū‖, ū = mean of the u_i            (1 when every embedding points the same way),
    centred energy ‖E − 1ēᵀ‖²_F / ‖E‖²_F (the part of the embeddings that varies between images),
    and the test loss the run logged last.

When every cosine is near 1, the logits Z_ij/τ of a test batch are nearly equal and the
contrastive loss sits at ln(batch): the encoder barely separates images, whatever its k-NN score.

    python -m experiments.embedding_geometry --workdir=runs/cifar10_resnet18_cpu_s0 \
        --npz_dir=DIR --out=docs/results/cifar10_resnet18_cpu_s0/geometry.json
"""

import json
import os

import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

from experiments import data as data_lib
from experiments import finetuning
from experiments import train as train_lib

FLAGS = flags.FLAGS


def _define_flags():
  flags.DEFINE_string("workdir", None, "A finished pretrain.py run.", required=True)
  flags.DEFINE_string("npz_dir", None, "Overrides the run's config.data.npz_dir.")
  flags.DEFINE_integer("n", 1000, "Test images.")
  flags.DEFINE_string("out", None, "Write the measurements here (JSON).")


def geometry(embeddings: np.ndarray) -> dict[str, float]:
  """The statistics of the module docstring for an (n, d) array of embeddings (n ≥ 2)."""
  e = np.asarray(embeddings, np.float64)
  if e.ndim != 2 or e.shape[0] < 2:
    raise ValueError(f"need an (n, d) array with n >= 2, got shape {e.shape}")
  norms = np.linalg.norm(e, axis=1)
  if not np.all(norms > 0):
    raise ValueError("an embedding has norm 0: its cosine is undefined")
  u = e / norms[:, None]
  cos = u @ u.T
  off_diagonal = cos[~np.eye(len(e), dtype=bool)]
  return dict(median_norm=float(np.median(norms)), mean_cosine=float(off_diagonal.mean()),
              min_cosine=float(off_diagonal.min()),
              mean_direction_norm=float(np.linalg.norm(u.mean(0))),
              centred_energy=float(np.sum((e - e.mean(0)) ** 2) / np.sum(e ** 2)))


def measure(workdir: str, n: int, npz_dir: str | None = None) -> dict[str, dict[str, float]]:
  """{method: geometry(...) | last logged test loss} for the run's methods and its untrained
  encoder."""
  pre_config, results = finetuning.read_pretrain(workdir)
  if npz_dir is not None:
    pre_config.data.npz_dir = npz_dir
  ds = data_lib.load_dataset(pre_config.data, seed=pre_config.seed)
  x = data_lib.to_float(jnp.asarray(ds["x_test"][:n]))
  apply_fn = train_lib.get_model(pre_config.model)[1]
  report = {}
  for method in [train_lib.UNTRAINED] + [m for m in results if m != train_lib.UNTRAINED]:
    params = finetuning.load_pretrained(workdir, method, pre_config)
    row = geometry(np.asarray(apply_fn(params, x)))
    history = results.get(method, {}).get("history") or []
    if history and "test_loss" in history[-1]:
      row["last_test_loss"] = float(history[-1]["test_loss"])
    report[method] = row
  return report


def main(argv):
  del argv
  report = dict(workdir=os.path.basename(os.path.normpath(FLAGS.workdir)), n=FLAGS.n,
                methods=measure(FLAGS.workdir, FLAGS.n, FLAGS.npz_dir))
  text = json.dumps(report, indent=1)
  print(text)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  _define_flags()
  app.run(main)

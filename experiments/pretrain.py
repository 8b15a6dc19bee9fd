r"""Private contrastive pre-training: Logit-DP vs Naive-DP vs non-private.

    python experiments/pretrain.py                                  # digits demo (offline)
    python experiments/pretrain.py --config=experiments/configs/cifar10_embedding_net.py \
        --config.data.npz_dir=/path/to/cifar --workdir=runs/cifar10_embnet
    python -m experiments.pretrain ...                              # equivalent

Trains every method in ``config.methods`` with the same seed and data, prints the
comparison table and writes the results folder (see ``experiments.train``).
Re-running with the same ``--workdir`` resumes from the last checkpoint.
"""

import os
import sys

if __package__ in (None, ""):  # `python experiments/pretrain.py`: make the repo importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments import train

_HERE = os.path.dirname(os.path.abspath(__file__))
config_flags.DEFINE_config_file("config", os.path.join(_HERE, "configs", "default.py"),
                                "Training configuration (a file under experiments/configs/).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Results folder (default: runs/pretrain_<config name>).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
  workdir = flags.FLAGS.workdir or train.default_workdir(flags.FLAGS["config"].config_filename,
                                                         "pretrain")
  print(f"workdir: {workdir}")
  train.train_and_evaluate(flags.FLAGS.config, workdir)
  print(f"results: {os.path.join(workdir, 'results.md')}")


if __name__ == "__main__":
  app.run(main)

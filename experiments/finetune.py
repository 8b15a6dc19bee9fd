r"""Fine-tuning on CIFAR-100 (20 coarse labels) on top of frozen pre-trained encoders.

    python experiments/finetune.py --config=experiments/configs/cifar100_finetune.py \
        --config.pretrain_workdir=runs/cifar10_embnet --config.data.npz_dir=/path/to/cifar \
        --workdir=runs/cifar100_finetune

For every method pre-trained in ``pretrain_workdir`` (Logit-DP, Naive-DP, non-private),
freezes its encoder, trains the 64-32-20 head and reports test accuracy and the
per-class metrics, absolute and relative to the non-private encoder. Each invocation is timed
in ``workdir/wallclock.json`` (``experiments.workdirs.timed_attempt``).
"""

import os
import shlex
import sys

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments import compilation_cache
from experiments import finetuning
from experiments import train
from experiments import workdirs

_HERE = os.path.dirname(os.path.abspath(__file__))
config_flags.DEFINE_config_file("config", os.path.join(_HERE, "configs", "cifar100_finetune.py"),
                                "Fine-tuning configuration.", lock_config=True)
flags.DEFINE_string("workdir", None, "Results folder (default: runs/finetune_<config name>).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
  workdir = flags.FLAGS.workdir or train.default_workdir(flags.FLAGS["config"].config_filename,
                                                         "finetune")
  print(f"workdir: {workdir}")
  compilation_cache.enable_from_flags(workdir)
  with workdirs.timed_attempt(workdir, shlex.join(sys.argv)) as attempt:
    finetuning.finetune_and_evaluate(flags.FLAGS.config, workdir)
    attempt["returncode"] = 0
  print(f"results: {os.path.join(workdir, 'results.md')}")


if __name__ == "__main__":
  app.run(main)

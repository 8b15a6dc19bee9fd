r"""Private contrastive pre-training: Logit-DP vs Naive-DP vs non-private.

    python experiments/pretrain.py                                  # digits demo (offline)
    python experiments/pretrain.py --config=experiments/configs/cifar10_embedding_net.py \
        --config.data.npz_dir=/path/to/cifar --workdir=runs/cifar10_embnet
    python -m experiments.pretrain ...                              # equivalent

Multi-host: start the same command on every process with --coordinator_address (process
0's host:port), --num_processes and --process_id (or --distributed_auto on Cloud TPU /
SLURM), and --config.num_devices=-1; a --workdir every process sees. Two processes with
two simulated CPU devices each, on one machine::

    for i in 0 1; do
      python experiments/pretrain.py --config=experiments/configs/tiny.py \
          --config.num_devices=-1 --workdir=runs/tiny_2proc --coordinator_address=127.0.0.1:12355 \
          --num_processes=2 --process_id=$i --local_device_count=2 &
    done; wait

Trains every method in ``config.methods`` with the same seed and data, prints the
comparison table and writes the results folder (see ``experiments.train``).
Re-running with the same ``--workdir`` resumes from the last checkpoint, or says "finished,
nothing to do" when every method has been trained and evaluated. Each invocation is timed in
``workdir/wallclock.json`` (its command line, seconds, return code and commit:
``experiments.workdirs.timed_attempt``). Progress: a bar on a
terminal, plain lines when the output goes to a file; the first step says it is compiling.
"""

import contextlib
import os
import shlex
import sys

if __package__ in (None, ""):  # `python experiments/pretrain.py`: make the repo importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments import compilation_cache
from experiments import train
from experiments import workdirs

_HERE = os.path.dirname(os.path.abspath(__file__))
config_flags.DEFINE_config_file("config", os.path.join(_HERE, "configs", "default.py"),
                                "Training configuration (a file under experiments/configs/).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Results folder (default: runs/pretrain_<config name>).")
flags.DEFINE_string("coordinator_address", None,
                    "Multi-process run: host:port where process 0 serves jax.distributed.")
flags.DEFINE_integer("num_processes", None, "Multi-process run: the number of processes.")
flags.DEFINE_integer(
    "process_id", None, "Multi-process run: this process's index, 0 .. num_processes-1 (0 writes "
    "the results).")
flags.DEFINE_bool(
    "distributed_auto", False,
    "Multi-process run whose processes are detected by jax.distributed.initialize() "
    "(Cloud TPU, SLURM, ...).")
flags.DEFINE_integer("local_device_count", None,
                     "CPU: the number of devices this process simulates (jax_num_cpu_devices).")
flags.DEFINE_enum("cpu_collectives", "gloo", ["gloo", "mpi"],
                  "CPU: collectives between the processes of a multi-process run.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
  flag = flags.FLAGS
  train.initialize_distributed(flag.coordinator_address, flag.num_processes, flag.process_id,
                               local_device_count=flag.local_device_count,
                               cpu_collectives=flag.cpu_collectives, auto=flag.distributed_auto)
  workdir = flag.workdir or train.default_workdir(flag["config"].config_filename, "pretrain")
  primary = train.is_primary()
  if primary:
    print(f"workdir: {workdir}")
  compilation_cache.enable_from_flags(workdir)
  timed = workdirs.timed_attempt(workdir, shlex.join(sys.argv)) if primary else None
  with timed or contextlib.nullcontext({}) as attempt:
    train.train_and_evaluate(flag.config, workdir)
    attempt["returncode"] = 0
  if primary:
    print(f"results: {os.path.join(workdir, 'results.md')}")


if __name__ == "__main__":
  app.run(main)

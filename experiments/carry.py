r"""Carries an unfinished run to the next machine: only what is committed outlives a session.

    python -m experiments.carry save RUN       # runs/RUN -> carry/RUN; then commit carry/RUN
    python -m experiments.carry restore RUN    # carry/RUN -> runs/RUN (run_queue does this itself)

A run that takes longer than a session (e.g. exact ghost norms at n = 10,000 on a CPU) resumes
from its checkpoints; when the next session gets a new machine, its workdir is gone. `save`
copies the workdir without its TensorBoard logs and with only the newest checkpoint of each
method, which is what a resume reads (`experiments.train.restore_checkpoint`), into
``carry/RUN``. `experiments.run_queue` restores a carried run whose workdir is missing before it
resumes it, and deletes the carried copy once the run has finished and is published.

Formal guarantee it keeps: a checkpoint holds the optimizer state, and a DP run's optimizer state
holds the noise key (`logit_dp.AddNoiseState`); its Poisson batches follow from the sampling seed.
Whoever reads them can subtract the noise, so `save` refuses any run whose privacy seeds are
secret (``config.privacy_seed`` unset, the default) and any workdir holding a secret seed file.
Only a run that chose a public ``privacy_seed`` (reproducible, NOT private against the reader of
its config) can be carried: its noise is N(0, σ²) as in any run, so it measures accuracy under
DP noise, but it is not a private release.
"""

import json
import os
import shutil
import sys

from absl import app
from absl import flags

SECRET_SEEDS_FILE = "SECRET_privacy_seeds.json"  # as experiments.train.SECRET_SEEDS_FILE
_SKIPPED_DIRS = ("tensorboard",)
FLAGS = flags.FLAGS
CARRY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "carry")


def _newest_step(checkpoints_dir: str) -> int | None:
  """The newest complete orbax checkpoint step in ``checkpoints_dir`` (as orbax names them: a
  step's folder gets its integer name only once it is written)."""
  steps = [int(n) for n in os.listdir(checkpoints_dir) if n.isdigit()]
  return max(steps) if steps else None


def _refuse_secrets(workdir: str) -> None:
  """ValueError unless the run's privacy seeds are public (see the module docstring)."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise ValueError(f"{workdir} has no config.json: not a run's workdir.")
  with open(path) as f:
    config = json.load(f)
  if config.get("privacy_seed") is None:
    raise ValueError(
        f"{workdir}: config.privacy_seed is unset, so its noise and sampling seeds are secret, "
        "and its checkpoints hold the secret noise key: it cannot be committed. Only a run "
        "started with a public --config.privacy_seed can be carried.")
  for root, _, files in os.walk(workdir):
    if SECRET_SEEDS_FILE in files:
      raise ValueError(f"{os.path.join(root, SECRET_SEEDS_FILE)} is a secret seed file.")


def save(workdir: str, dest: str) -> list[str]:
  """Copies ``workdir`` to ``dest`` (replacing it) without TensorBoard logs and with only the
  newest checkpoint of each method; returns the checkpoints kept (paths relative to dest)."""
  from experiments import run_queue  # pylint: disable=g-import-not-at-top (run_queue imports carry)
  _refuse_secrets(workdir)
  if run_queue.is_finished(workdir):
    raise ValueError(f"{workdir} has finished: publish it (run_queue does); nothing to carry.")
  kept, skip = [], set()
  for root, dirs, _ in os.walk(workdir):
    dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]
    if os.path.basename(root) == "checkpoints":
      newest = _newest_step(root)
      skip.update(os.path.join(root, d) for d in dirs if d != str(newest))
      if newest is not None:
        kept.append(os.path.relpath(os.path.join(root, str(newest)), workdir))
      dirs[:] = []

  def ignore(directory, names):
    return [
        n for n in names
        if n in _SKIPPED_DIRS or os.path.join(directory, n) in skip or n.endswith(".tmp")
    ]

  tmp = dest.rstrip(os.sep) + ".saving"
  shutil.rmtree(tmp, ignore_errors=True)
  shutil.copytree(workdir, tmp, ignore=ignore)
  shutil.rmtree(dest, ignore_errors=True)
  os.replace(tmp, dest)
  return sorted(kept)


def restore(src: str, workdir: str) -> bool:
  """Copies a carried run ``src`` to ``workdir`` if there is one and ``workdir`` does not
  exist (a workdir on this machine is at least as new); returns whether it copied."""
  if not os.path.isdir(src) or os.path.exists(workdir):
    return False
  _refuse_secrets(src)  # a carried copy is committed: it must not hold secrets either
  os.makedirs(os.path.dirname(os.path.abspath(workdir)), exist_ok=True)
  shutil.copytree(src, workdir)
  return True


def _define_flags():
  flags.DEFINE_string("runs_dir", "runs", "Where the workdirs are.")
  flags.DEFINE_string("carry_dir", CARRY_DIR, "Where carried runs are committed.")


def main(argv):
  if len(argv) != 3 or argv[1] not in ("save", "restore"):
    raise app.UsageError("usage: python -m experiments.carry save|restore RUN")
  command, name = argv[1], argv[2]
  workdir, dest = os.path.join(FLAGS.runs_dir, name), os.path.join(FLAGS.carry_dir, name)
  try:
    if command == "save":
      kept = save(workdir, dest)
      print(f"saved {workdir} -> {dest} (checkpoints: {', '.join(kept) or 'none'})")
    elif restore(dest, workdir):
      print(f"restored {dest} -> {workdir}")
    else:
      print(f"nothing restored ({dest} missing or {workdir} exists)")
  except ValueError as e:
    print(f"refused: {e}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)

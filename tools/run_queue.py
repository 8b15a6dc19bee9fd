r"""Runs a list of pre-training and fine-tuning runs one after another, resumably.

    nohup python -m tools.run_queue --npz_dir=DIR > runs/queue.log 2>&1 &

The list (default tools/published_runs.txt, the commands of every published run) has one run
per line, ``<run-name> <config file> [--config.key=value ...]`` (pretrain.py), or ``<run-name>
finetune <pretrain run-name> [--config.key=value ...]`` (finetune.py with
configs/cifar100_finetune.py on the encoders of ``runs/<pretrain run-name>``, run once that run
has finished); '#' starts a comment. A pre-training entry whose config file defines
``ready(arg=None)`` (e.g. configs/cifar10_embedding_net_tuned.py, which needs the finished
public-data search) waits, and the driver goes on with later entries, until it returns True.
The driver re-executes itself after every run, so edits of the list take effect while it works.
Each run trains in ``runs/<run-name>`` (re-running a workdir resumes from its checkpoints) with
``--config.data.npz_dir=DIR``; its log is ``runs/<run-name>/log.txt``. A finished run
(`experiments.workdirs.is_finished`) has its config.json, results.json and wallclock.json
copied to ``docs/results/<run-name>/``, and a run whose published copy is finished counts as
finished even without its workdir; a fine-tuning entry whose encoders are gone cannot run and
is listed as such. One driver per list: nothing locks a workdir.
"""

import importlib.util
import os
import subprocess
import sys
import time

from absl import app
from absl import flags

from experiments import workdirs

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS


def _define_flags():
  """The driver's flags (defined only when it runs, so that other scripts can import it)."""
  flags.DEFINE_string("queue", os.path.join(_REPO, "tools", "published_runs.txt"),
                      "The list of runs.")
  flags.DEFINE_string("npz_dir", None,
                      "Folder with cifar10.npz / cifar100.npz (default: the download cache).")
  flags.DEFINE_string("runs_dir", os.path.join(_REPO, "runs"), "Where the workdirs go.")
  flags.DEFINE_string("results_dir", os.path.join(_REPO, "docs", "results"),
                      "Where finished runs' small files are copied.")
  flags.DEFINE_integer("max_attempts", 3, "Attempts per run (a crash is retried, then skipped).")
  flags.DEFINE_integer("wait_pid", None, "Wait for this process to exit before starting.")


def read_queue(path):
  """[(name, config, overrides)] from the queue file."""
  out = []
  with open(path) as f:
    for line in f:
      line = line.split("#", 1)[0].strip()
      if line:
        name, config, *overrides = line.split()
        out.append((name, config, overrides))
  return out


def is_done(name):
  """True when run ``name`` finished: in its workdir, or in its published copy in results_dir
  (a new machine has no runs/, and the committed copies say what finished)."""
  return (workdirs.is_finished(os.path.join(FLAGS.runs_dir, name))
          or workdirs.is_finished(os.path.join(FLAGS.results_dir, name)))


def command(config, overrides, workdir):
  """The pretrain.py / finetune.py command line of a queue entry."""
  if config == "finetune":
    pre, *overrides = overrides
    script, config = "finetune.py", "experiments/configs/cifar100_finetune.py"
    overrides = [f"--config.pretrain_workdir={os.path.join(FLAGS.runs_dir, pre)}", *overrides]
  else:
    script = "pretrain.py"
  cmd = [
      sys.executable,
      os.path.join(_REPO, "experiments", script), f"--config={os.path.join(_REPO, config)}",
      f"--workdir={workdir}", *overrides
  ]
  if FLAGS.npz_dir:
    cmd.append(f"--config.data.npz_dir={FLAGS.npz_dir}")
  return cmd


def ready(config, overrides):
  """A fine-tuning entry waits for its pre-training run; a pre-training entry for its config
  file's ``ready(arg)``, if the file defines one (``file.py:arg`` passes arg)."""
  if config == "finetune":
    return workdirs.is_finished(os.path.join(FLAGS.runs_dir, overrides[0]))
  path, _, arg = config.partition(":")
  spec = importlib.util.spec_from_file_location("_queued_config", os.path.join(_REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  check = getattr(module, "ready", None)
  return check is None or bool(check(arg or None))


def publish_run(name):
  """`experiments.workdirs.publish` of a finished entry to ``results_dir/name``."""
  workdirs.publish(os.path.join(FLAGS.runs_dir, name), os.path.join(FLAGS.results_dir, name))


def run_one(name, config, overrides, workdir):
  """One attempt: pretrain.py in ``workdir``, timed in wallclock.json
  (`experiments.workdirs.timed_attempt`)."""
  del name
  cmd = command(config, overrides, workdir)
  with workdirs.timed_attempt(workdir, " ".join(cmd[1:])) as attempt:
    with open(os.path.join(workdir, "log.txt"), "a") as log:
      log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC: "
                f"{' '.join(cmd)}\n")
      log.flush()
      attempt["returncode"] = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=_REPO)
  return attempt["returncode"]


def main(argv):
  del argv
  if FLAGS.wait_pid:
    while os.path.exists(f"/proc/{FLAGS.wait_pid}"):
      time.sleep(10)
  for n, _, _ in read_queue(FLAGS.queue):  # finished but not yet copied (e.g. a restart)
    workdir, dest = os.path.join(FLAGS.runs_dir, n), os.path.join(FLAGS.results_dir, n)
    if workdirs.is_finished(workdir) and not os.path.exists(os.path.join(dest, "results.json")):
      publish_run(n)
  todo, waiting, orphaned = [], [], []
  for n, c, o in read_queue(FLAGS.queue):
    workdir = os.path.join(FLAGS.runs_dir, n)
    if is_done(n) or workdirs.failed_attempts(workdir) >= FLAGS.max_attempts:
      continue
    if ready(c, o):
      todo.append((n, c, o))
    elif c == "finetune" and is_done(o[0]):
      orphaned.append(f"{n} (runs/{o[0]} is gone: its published results have no encoders)")
    elif c != "finetune":  # a fine-tuning entry waits for its pre-training run: not news
      waiting.append(n)
  if waiting:
    print(f"waiting: {', '.join(waiting)} (not ready)", flush=True)
  if orphaned:
    print(f"cannot run: {'; '.join(orphaned)}", flush=True)
  if not todo:
    print("queue done", flush=True)
    return
  name, config, overrides = todo[0]
  workdir = os.path.join(FLAGS.runs_dir, name)
  print(f"{time.strftime('%H:%M:%S', time.gmtime())} start {name}", flush=True)
  rc = run_one(name, config, overrides, workdir)
  print(f"{time.strftime('%H:%M:%S', time.gmtime())} end {name} rc={rc}", flush=True)
  if workdirs.is_finished(workdir):
    publish_run(name)
  elif rc != 0:  # a crash is most often broken code: stop rather than burn through the queue
    print(f"stopped: {name} failed (rc={rc}); see {workdir}/log.txt, fix, then restart the driver",
          flush=True)
    sys.exit(1)
  # Re-execute: picks up edits of the queue and of this file.
  argv = [a for a in sys.argv[1:] if not a.startswith("--wait_pid")]
  os.execv(sys.executable, [sys.executable, "-m", "tools.run_queue", *argv])


if __name__ == "__main__":
  _define_flags()
  app.run(main)

r"""Runs a queue of pre-training runs one after another; skips finished runs, resumes the rest.

    nohup python -m experiments.run_queue --npz_dir=DIR > runs/queue.log 2>&1 &

The queue (default experiments/queue.txt) has one run per line, ``<run-name> <config file>
[--config.key=value ...]`` (pretrain.py), or ``<run-name> finetune <pretrain run-name>
[--config.key=value ...]`` (finetune.py with configs/cifar100_finetune.py on the encoders of
``runs/<pretrain run-name>``, run once that run has finished); '#' starts a comment. A
pre-training entry whose config file defines ``ready(arg=None)`` (e.g.
configs/cifar10_embedding_net_tuned.py, which needs the finished public-data search) waits, and
the queue goes on with later entries, until it returns True. The driver re-executes itself after
every run, so edits of the queue (and of this file) take effect while it works. Each run trains
in ``runs/<run-name>`` (re-running a workdir resumes from its checkpoints) with
``--config.data.npz_dir=DIR``; its log is ``runs/<run-name>/log.txt``. A run is finished when
its results.json has every method finished; then its config.json, results.json and
wallclock.json (wall-clock seconds, commit and dirty flag of every attempt) are copied to
``docs/results/<run-name>/`` (small files only: no checkpoints, no secret seeds). A run whose
published copy is finished counts as finished even when its workdir is gone (a new machine);
a fine-tuning entry whose encoders went with it cannot run and is listed as such. An attempt is
written to wallclock.json when it starts and its seconds every minute while it runs, so one
killed with the driver (e.g. at the end of a session) keeps its time, with returncode null.
A run longer than a session can be committed with ``python -m experiments.carry save RUN``
(public privacy seeds only); the driver restores it from ``--carry_dir`` when its workdir is
missing and deletes the carried copy once the run is published.
"""

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags

from experiments import carry

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
HEARTBEAT_SECONDS = 60.0


def _define_flags():
  """The driver's flags (defined only when it runs, so that other scripts can import it)."""
  flags.DEFINE_string("queue", os.path.join(_REPO, "experiments", "queue.txt"), "Queue file.")
  flags.DEFINE_string("npz_dir", None, "Folder with cifar10.npz / cifar100.npz.")
  flags.DEFINE_string("runs_dir", os.path.join(_REPO, "runs"), "Where the workdirs go.")
  flags.DEFINE_string("results_dir", os.path.join(_REPO, "docs", "results"),
                      "Where finished runs' small files are copied.")
  flags.DEFINE_string(
      "carry_dir", carry.CARRY_DIR,
      "Carried unfinished runs (experiments/carry.py): restored when their "
      "workdir is missing, deleted once published.")
  flags.DEFINE_integer("max_attempts", 3, "Attempts per run (a crash is retried, then skipped).")
  flags.DEFINE_integer("wait_pid", None, "Wait for this process to exit before starting.")


SHARED_FILES = ("config.json", "results.json", "wallclock.json")


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


def is_finished(workdir):
  """True when results.json exists and every method in it finished."""
  path = os.path.join(workdir, "results.json")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    res = json.load(f)
  return bool(res) and all(r.get("finished", True) for r in res.values())  # finetune: no key


def is_done(name):
  """True when run ``name`` finished: in its workdir, or in its published copy in results_dir
  (a new machine has no runs/, and the committed copies say what finished)."""
  return (is_finished(os.path.join(FLAGS.runs_dir, name))
          or is_finished(os.path.join(FLAGS.results_dir, name)))


def failed_attempts(workdir):
  path = os.path.join(workdir, "wallclock.json")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(a["returncode"] not in (0, None) for a in json.load(f)["attempts"])


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
    return is_finished(os.path.join(FLAGS.runs_dir, overrides[0]))
  path, _, arg = config.partition(":")
  spec = importlib.util.spec_from_file_location("_queued_config", os.path.join(_REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  check = getattr(module, "ready", None)
  return check is None or bool(check(arg or None))


def publish(workdir, dest, extra_files=()):
  """Copies the small, shareable files of a finished run (and ``extra_files``) to ``dest``."""
  os.makedirs(dest, exist_ok=True)
  for name in (*SHARED_FILES, *extra_files):
    src = os.path.join(workdir, name)
    if os.path.exists(src):
      shutil.copy(src, os.path.join(dest, name))


def publish_run(name):
  """`publish` of a finished queue entry; its carried copy (experiments/carry.py), if any, is
  deleted: the published files replace it."""
  publish(os.path.join(FLAGS.runs_dir, name), os.path.join(FLAGS.results_dir, name))
  carried = os.path.join(FLAGS.carry_dir, name)
  if os.path.isdir(carried):
    shutil.rmtree(carried)
    print(f"deleted {carried} (published)", flush=True)


def code_version():
  """The commit the run starts from, and whether logit_dp/ or experiments/ differ from it."""
  def git(*args):
    r = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, check=False)
    return r.stdout.strip() if r.returncode == 0 else None

  return dict(commit=git("rev-parse", "HEAD"),
              dirty=bool(git("status", "--porcelain", "--", "logit_dp", "experiments")))


def write_json(path: str, obj) -> None:
  """Writes ``obj`` to ``path`` through a temporary file, so a reader never sees half of it."""
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(path + ".tmp", path)


@contextlib.contextmanager
def timed_attempt(workdir: str, command_line: str, heartbeat_seconds: float = HEARTBEAT_SECONDS):
  """Records one attempt in ``workdir/wallclock.json``; yields it to set its ``returncode``.

  The attempt is written when it starts (returncode None) and its seconds are rewritten every
  ``heartbeat_seconds`` while it runs, so an attempt killed with its process keeps its time
  up to the last heartbeat; ``total_seconds`` sums every attempt.
  """
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "wallclock.json")
  wc = json.load(open(path)) if os.path.exists(path) else dict(attempts=[])
  wc["command"] = command_line
  t0 = time.time()
  attempt = dict(start_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), seconds=0.0,
                 returncode=None, **code_version())
  wc["attempts"].append(attempt)
  lock, done = threading.Lock(), threading.Event()

  def write():
    with lock:
      attempt["seconds"] = round(time.time() - t0, 1)
      wc["total_seconds"] = round(sum(a["seconds"] for a in wc["attempts"]), 1)
      write_json(path, wc)

  def beat():
    while not done.wait(heartbeat_seconds):
      write()

  write()
  heart = threading.Thread(target=beat, daemon=True)
  heart.start()
  try:
    yield attempt
  finally:
    done.set()
    heart.join()
    write()


def run_one(name, config, overrides, workdir):
  """One attempt: pretrain.py in ``workdir``, timed in wallclock.json (`timed_attempt`)."""
  del name
  cmd = command(config, overrides, workdir)
  with timed_attempt(workdir, " ".join(cmd[1:])) as attempt:
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
    if is_finished(workdir) and not os.path.exists(os.path.join(dest, "results.json")):
      publish_run(n)
  todo, waiting, orphaned = [], [], []
  for n, c, o in read_queue(FLAGS.queue):
    workdir = os.path.join(FLAGS.runs_dir, n)
    if is_done(n) or failed_attempts(workdir) >= FLAGS.max_attempts:
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
  if carry.restore(os.path.join(FLAGS.carry_dir, name), workdir):
    print(f"restored {name} from {FLAGS.carry_dir}", flush=True)
  print(f"{time.strftime('%H:%M:%S', time.gmtime())} start {name}", flush=True)
  rc = run_one(name, config, overrides, workdir)
  print(f"{time.strftime('%H:%M:%S', time.gmtime())} end {name} rc={rc}", flush=True)
  if is_finished(workdir):
    publish_run(name)
  elif rc != 0:  # a crash is most often broken code: stop rather than burn through the queue
    print(f"stopped: {name} failed (rc={rc}); see {workdir}/log.txt, fix, then restart the driver",
          flush=True)
    sys.exit(1)
  # Re-execute: picks up edits of the queue and of this file.
  argv = [a for a in sys.argv[1:] if not a.startswith("--wait_pid")]
  os.execv(sys.executable, [sys.executable, "-m", "experiments.run_queue", *argv])


if __name__ == "__main__":
  _define_flags()
  app.run(main)

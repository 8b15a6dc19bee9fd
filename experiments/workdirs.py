"""Finished runs, their shareable files and their wall-clock time.

A run trains in a workdir (``pretrain.py --workdir=...``). It has finished when its
``results.json`` has every method finished; its small, shareable files (``config.json``,
``results.json``, ``wallclock.json``: no checkpoints, no secret seeds) are then copied elsewhere
with :func:`publish`. :func:`timed_attempt` records each attempt at a run in
``wallclock.json`` (start, seconds, return code, commit and whether the code differed from it).
"""

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEARTBEAT_SECONDS = 60.0
SHARED_FILES = ("config.json", "results.json", "wallclock.json")


def is_finished(workdir: str) -> bool:
  """True when results.json exists and every method in it finished."""
  path = os.path.join(workdir, "results.json")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    res = json.load(f)
  return bool(res) and all(r.get("finished", True) for r in res.values())  # finetune: no key


def failed_attempts(workdir: str) -> int:
  """The attempts of ``workdir/wallclock.json`` that exited with an error (a killed attempt,
  returncode None, is not one)."""
  path = os.path.join(workdir, "wallclock.json")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(a["returncode"] not in (0, None) for a in json.load(f)["attempts"])


_REPO_DIRS = ("experiments", "docs", "runs", "logit_dp", "tools", "benchmarks", "tests")
_ABS_PATH_RE = re.compile(r"(?<![\w.~-])/[^\s=,;'\"]+")


def shareable_path(path: str) -> str:
  """An absolute path as a repository path (from its first repository folder on: runs/x,
  experiments/configs/y.py) or, outside the repository, its last component."""
  parts = os.path.normpath(path).split(os.sep)
  for i, part in enumerate(parts):
    if part in _REPO_DIRS:
      return os.path.join(*parts[i:])
  return parts[-1] or path


def shareable_command(command: str) -> str:
  """A command line without machine paths: data folders as DIR, other absolute paths as
  `shareable_path` gives them."""
  command = re.sub(r"(npz_dir|data_dir|archive_dir)=\S+", r"\1=DIR", command)
  return _ABS_PATH_RE.sub(lambda m: shareable_path(m.group(0)), command)


def shareable_config(config: dict) -> dict:
  """A config.json dict without machine paths: ``npz_dir`` None (the data are named by
  ``data.name`` and found by flag), every other absolute path as `shareable_path` gives it."""
  def clean(value):
    if isinstance(value, dict):
      return {k: (None if k == "npz_dir" else clean(v)) for k, v in value.items()}
    if isinstance(value, list):
      return [clean(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
      return shareable_path(value)
    return value

  return clean(config)


def write_config(config, path: str) -> None:
  """Writes an ml_collections config (or a dict) as the shareable config.json at ``path``."""
  d = config if isinstance(config, dict) else json.loads(config.to_json_best_effort())
  with open(path, "w") as f:
    json.dump(shareable_config(d), f, indent=2, ensure_ascii=False)


def shareable_wallclock(wallclock: dict) -> dict:
  """wallclock.json with its command line shareable (`shareable_command`)."""
  if "command" not in wallclock:
    return wallclock
  return dict(wallclock, command=shareable_command(wallclock["command"]))


def publish(workdir: str, dest: str, extra_files=()) -> None:
  """Copies the small, shareable files of a finished run (and ``extra_files``) to ``dest``;
  config.json and wallclock.json without machine paths (`shareable_config`,
  `shareable_command`)."""
  os.makedirs(dest, exist_ok=True)
  for name in (*SHARED_FILES, *extra_files):
    src = os.path.join(workdir, name)
    if not os.path.exists(src):
      continue
    if name == "config.json":
      with open(src) as f:
        write_config(json.load(f), os.path.join(dest, name))
    elif name == "wallclock.json":
      with open(src) as f:
        write_json(os.path.join(dest, name), shareable_wallclock(json.load(f)))
    else:
      shutil.copy(src, os.path.join(dest, name))


def code_version() -> dict:
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
  wc["command"] = shareable_command(command_line)
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

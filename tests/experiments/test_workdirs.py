"""The run records of experiments/workdirs.py: the timed attempts, what a finished run shares."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json
import math
import subprocess
import time

from experiments import workdirs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_timed_attempt_keeps_the_time_of_a_killed_attempt(tmp_path):
  """A process killed mid-run (SIGKILL) leaves its attempt in wallclock.json with its seconds up
  to the last heartbeat and returncode null, which does not count as a failure."""
  script = ("import sys, time; from experiments import workdirs\n"
            "with workdirs.timed_attempt(sys.argv[1], 'cmd', heartbeat_seconds=0.1):\n"
            "  print('started', flush=True); time.sleep(600)\n")
  proc = subprocess.Popen(
      [sys.executable, "-c", script, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "started"
  time.sleep(1.5)
  proc.kill()
  proc.wait()
  wc = json.loads((tmp_path / "wallclock.json").read_text())
  (killed,) = wc["attempts"]
  assert killed["returncode"] is None and 1.0 <= killed["seconds"] <= 10.0
  assert workdirs.failed_attempts(str(tmp_path)) == 0
  with workdirs.timed_attempt(str(tmp_path), "cmd") as attempt:
    attempt["returncode"] = 3
  wc = json.loads((tmp_path / "wallclock.json").read_text())
  assert [a["returncode"] for a in wc["attempts"]] == [None, 3]
  assert math.isclose(wc["total_seconds"], sum(a["seconds"] for a in wc["attempts"]), abs_tol=0.11)
  assert workdirs.failed_attempts(str(tmp_path)) == 1


def test_publish_copies_only_the_shareable_files(tmp_path):
  workdir, dest = tmp_path / "run", tmp_path / "published"
  (workdir / "logit_dp" / "checkpoints").mkdir(parents=True)
  for name in ("extra.json", "log.txt"):
    (workdir / name).write_text(name)
  (workdir / "config.json").write_text(json.dumps(dict(data=dict(npz_dir="/srv/cifar"), seed=1)))
  (workdir / "logit_dp" / "checkpoints" / "3").write_text("noise key")
  assert not workdirs.is_finished(str(workdir))  # no results.json
  (workdir / "results.json").write_text(json.dumps({"logit_dp": {"finished": False}}))
  assert not workdirs.is_finished(str(workdir))
  (workdir / "results.json").write_text(json.dumps({"logit_dp": {"finished": True}}))
  assert workdirs.is_finished(str(workdir))
  workdirs.publish(str(workdir), str(dest), extra_files=("extra.json",))
  assert sorted(os.listdir(dest)) == ["config.json", "extra.json", "results.json"]
  # The published config names no machine path.
  assert json.loads((dest / "config.json").read_text()) == dict(data=dict(npz_dir=None), seed=1)

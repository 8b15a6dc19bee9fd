"""The contributor tools: the run driver, the run records it writes, the accelerator scripts."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json
import math
import shutil
import subprocess
import time

import numpy as np
import pytest

from experiments import train
from experiments import workdirs
from tools import run_queue

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_TOOLS = os.path.join(REPO, "tools", "gpu")

# ---------------------------------------------------------------------------
# The run driver.


def _queue_driver(tmp_path, queue_text: str):
  """Writes the list of runs; returns a function that runs the driver on it once."""
  queue = tmp_path / "queue.txt"
  queue.write_text(queue_text)
  args = [
      sys.executable, "-m", "tools.run_queue", f"--queue={queue}",
      f"--runs_dir={tmp_path / 'runs'}", f"--results_dir={tmp_path / 'results'}"
  ]
  return lambda: subprocess.run(args, cwd=REPO, capture_output=True, text=True)


@pytest.mark.slow  # runs tiny pre-training jobs in subprocesses
def test_run_queue_runs_skips_and_publishes(tmp_path):
  drive = _queue_driver(
      tmp_path, "# a comment\n"
      "tiny_s0 experiments/configs/tiny.py --config.methods=('non_private',)  # np\n")
  r = drive()
  assert r.returncode == 0, r.stdout + r.stderr
  assert "start tiny_s0" in r.stdout and r.stdout.rstrip().endswith("queue done")
  published = sorted(os.listdir(tmp_path / "results" / "tiny_s0"))
  assert published == ["config.json", "results.json", "wallclock.json"]
  wc = json.loads((tmp_path / "results" / "tiny_s0" / "wallclock.json").read_text())
  assert len(wc["attempts"]) == 1 and wc["attempts"][0]["returncode"] == 0
  assert math.isclose(wc["total_seconds"], wc["attempts"][0]["seconds"])
  r = drive()  # finished: skipped
  assert "start" not in r.stdout and "queue done" in r.stdout


@pytest.mark.slow  # runs tiny pre-training jobs in subprocesses
def test_run_queue_without_workdirs_trusts_the_published_runs(tmp_path):
  """runs/ gone, results/ kept: a published run is not retrained; a fine-tuning entry whose
  encoders were in runs/ is reported, not run and not waited for in silence."""
  drive = _queue_driver(tmp_path,
                        "tiny_s0 experiments/configs/tiny.py --config.methods=('non_private',)\n")
  assert drive().returncode == 0
  shutil.rmtree(tmp_path / "runs")
  drive = _queue_driver(
      tmp_path, "tiny_s0 experiments/configs/tiny.py --config.methods=('non_private',)\n"
      "ft_s0 finetune tiny_s0\n")
  r = drive()
  assert r.returncode == 0, r.stdout + r.stderr
  assert "start" not in r.stdout and r.stdout.rstrip().endswith("queue done"), r.stdout
  assert "cannot run: ft_s0 (runs/tiny_s0 is gone" in r.stdout
  assert not (tmp_path / "runs" / "tiny_s0").exists()


@pytest.mark.slow
def test_run_queue_waits_for_a_config_that_is_not_ready(tmp_path):
  """A config file's ready(arg) holds its entry back; later entries run meanwhile."""
  flag = tmp_path / "go"
  config = tmp_path / "gated.py"
  config.write_text("import os\nfrom experiments.configs.tiny import get_config\n"
                    "def ready(arg=None):\n  return os.path.exists(arg)\n")
  drive = _queue_driver(
      tmp_path, f"gated_s0 {config}:{flag} --config.methods=('non_private',)\n"
      "tiny_s0 experiments/configs/tiny.py --config.methods=('non_private',)\n")
  r = drive()
  assert r.returncode == 0, r.stdout + r.stderr
  assert "start tiny_s0" in r.stdout and "start gated_s0" not in r.stdout
  assert "waiting: gated_s0 (not ready)" in r.stdout and r.stdout.rstrip().endswith("queue done")
  flag.write_text("")
  r = drive()
  assert "start gated_s0" in r.stdout and "start tiny_s0" not in r.stdout, r.stdout + r.stderr


def test_published_runs_list_names_each_published_run_once():
  """Every entry of tools/published_runs.txt names a config that exists (or a fine-tuning of an
  earlier entry), and no run twice."""
  entries = run_queue.read_queue(os.path.join(REPO, "tools", "published_runs.txt"))
  names = [n for n, _, _ in entries]
  assert len(names) == len(set(names)) and len(names) > 50
  for i, (name, config, overrides) in enumerate(entries):
    if config == "finetune":
      assert overrides[0] in names[:i], name
    else:
      assert os.path.exists(os.path.join(REPO, config.partition(":")[0])), (name, config)


# ---------------------------------------------------------------------------
# Run records (experiments.workdirs).


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


# ---------------------------------------------------------------------------
# Accelerator scripts.


def test_gpu_scripts_parse():
  scripts = sorted(f for f in os.listdir(GPU_TOOLS) if f.endswith(".sh"))
  assert len(scripts) >= 4
  for script in scripts:
    subprocess.run(["bash", "-n", os.path.join(GPU_TOOLS, script)], check=True)


def _stage(tmp_path, source, datasets="cifar10"):
  """Runs `gpu_stage.sh prepare` on ``source`` in parts of 2,000 bytes; returns the part names,
  a function that receives one part into a staging folder, and the npz folder it fills."""
  script = os.path.join(GPU_TOOLS, "gpu_stage.sh")
  env = dict(os.environ, GPU_STAGE_OUT=str(tmp_path / "parts"), GPU_STAGE_CHUNK="2000",
             GPU_STAGE_WHEELS="0")
  subprocess.run(["bash", script, "prepare", str(source), datasets], env=env, check=True,
                 cwd=tmp_path, capture_output=True)
  npz = tmp_path / "npz"

  def receive(stage, part):
    command = ["bash", script, "receive", str(tmp_path / "parts" / part), str(stage), str(npz)]
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)

  return sorted(os.listdir(tmp_path / "parts")), receive, npz


def test_gpu_stage_carries_the_data_in_parts_and_refuses_a_corrupt_one(tmp_path):
  """prepare cuts the data into parts; receive, part by part, rebuilds it byte for byte only once
  every part is in, after the SHA-256 check."""
  source = tmp_path / "data"
  source.mkdir()
  rng = np.random.default_rng(0)
  (source / "cifar10.npz").write_bytes(rng.bytes(5000))
  (source / "cifar10_label_names.json").write_text('{"label_names": []}')
  parts, receive, npz = _stage(tmp_path, source)
  chunks = [tmp_path / "parts" / p / f"chunk.{p[4:]}" for p in parts]
  assert len(parts) > 2 and all(c.stat().st_size <= 2000 for c in chunks)
  for part in parts[:-1]:
    assert "staged" not in receive(tmp_path / "stage", part).stdout
  assert not npz.exists()
  last = receive(tmp_path / "stage", parts[-1])
  assert "staged:" in last.stdout, last.stdout + last.stderr
  assert (npz / "cifar10.npz").read_bytes() == (source / "cifar10.npz").read_bytes()
  assert (npz / "cifar10_label_names.json").exists()
  data = bytearray(chunks[1].read_bytes())
  data[0] ^= 1
  chunks[1].write_bytes(bytes(data))
  results = [receive(tmp_path / "stage2", part) for part in parts]
  assert results[-1].returncode != 0 and "FAILED" in results[-1].stdout + results[-1].stderr


def test_gpu_stage_checks_an_archive_against_the_published_checksums(tmp_path):
  """An archive under the official name is unpacked there by experiments.cifar, which refuses
  one that is not the official archive."""
  source = tmp_path / "data"
  source.mkdir()
  (source / "cifar-10-python.tar.gz").write_bytes(np.random.default_rng(1).bytes(3000))
  parts, receive, npz = _stage(tmp_path, source)
  results = [receive(tmp_path / "stage", part) for part in parts]
  assert results[-1].returncode != 0
  assert "is not the official cifar-10-python.tar.gz" in results[-1].stderr
  assert not (npz / "cifar10.npz").exists()


def test_gpu_stage_refuses_a_folder_without_the_data(tmp_path):
  script = os.path.join(GPU_TOOLS, "gpu_stage.sh")
  env = dict(os.environ, GPU_STAGE_OUT=str(tmp_path / "parts"), GPU_STAGE_WHEELS="0")
  r = subprocess.run(
      ["bash", script, "prepare", str(tmp_path), "cifar100"], env=env, capture_output=True,
      text=True)
  assert r.returncode != 0 and "neither cifar-100-python.tar.gz nor cifar100.npz" in r.stderr


def test_resnet18_gpu_collect_copies_the_small_results_of_a_workdir(tmp_path):
  """--collect brings back what the tables need (config, results, each method's metrics) and no
  checkpoint, also from a run that has not finished (a method's folder may be missing)."""
  workdir = tmp_path / "run"
  for m in ("logit_dp", "naive_dp"):
    (workdir / m / "checkpoints").mkdir(parents=True)
    (workdir / m / "metrics.csv").write_text(f"step,{m}\n")
    (workdir / m / "checkpoints" / "5").write_text("noise key")
  (workdir / "config.json").write_text("{}")
  out = tmp_path / "out"
  out.mkdir()
  env = dict(os.environ, WORKDIR=str(workdir), OUT=str(out))
  script = os.path.join(GPU_TOOLS, "resnet18_gpu.sh")
  subprocess.run(["bash", script, "--collect"], env=env, check=True, cwd=tmp_path,
                 capture_output=True)
  assert sorted(os.listdir(out)) == ["config.json", "logit_dp.metrics.csv", "naive_dp.metrics.csv"]
  assert (out / "naive_dp.metrics.csv").read_text() == "step,naive_dp\n"


def _default_chunk() -> int:
  with open(os.path.join(GPU_TOOLS, "gpu_stage.sh")) as f:
    (line,) = [line for line in f if line.startswith("CHUNK=")]
  return int(line.split(":-")[1].rstrip("}\n"))


def test_gpu_stage_parts_fit_one_call_each():
  """A call carries at most 64 MiB, working tree included: the tracked tree, one part of the
  default size and 1 MiB for a carried run state fit, and CIFAR-10's archive with the wheels
  (~0.3 MB) travels in three parts."""
  chunk = _default_chunk()
  tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True,
                           text=True).stdout.split("\0")
  tree = sum(
      os.path.getsize(os.path.join(REPO, f)) for f in tracked
      if f and os.path.isfile(os.path.join(REPO, f)))
  assert tree + chunk + 2 ** 20 <= 64 * 2 ** 20, (tree, chunk)
  cifar10_archive, wheels = 170_498_071, 400_000
  assert math.ceil((cifar10_archive + wheels) / chunk) == 3


# ---------------------------------------------------------------------------
# Logit-DP with exact pair norms at the tuned setting (tools/gpu/tuned_ghost_gpu.sh).

TUNED_QUEUE = os.path.join(GPU_TOOLS, "tuned_ghost_runs.txt")
TUNED_SCRIPT = os.path.join(GPU_TOOLS, "tuned_ghost_gpu.sh")


def _parsed_config(config_file: str, overrides) -> dict:
  """The config pretrain.py builds from ``config_file`` and ``overrides``, as a plain dict."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  argv = ["pretrain", f"--config={os.path.join(REPO, config_file)}", *overrides]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True,
                                  sys_argv=argv)
  values(argv)
  return json.loads(values.config.to_json_best_effort())


def test_tuned_ghost_runs_pair_with_the_committed_tuned_runs():
  """Each entry is the committed tuned run of its seed (every setting, hence σ, q and T) but for
  the clip method (ghost), the methods (Logit-DP) and its public privacy seed; the noise and
  sampling seeds (p, p + 1) of the three seeds are all different."""
  entries = run_queue.read_queue(TUNED_QUEUE)
  assert [n for n, _, _ in entries] == [f"cifar10_embnet_tuned_ghost_s{s}" for s in range(3)]
  privacy_seeds = []
  for seed, (_, config_file, overrides) in enumerate(entries):
    ghost = _parsed_config(config_file, overrides)
    with open(os.path.join(REPO, "docs", "results", f"cifar10_embnet_tuned_s{seed}",
                           "config.json")) as f:
      committed = json.load(f)
    for key, value in train._ADDED_CONFIG_DEFAULTS.items():  # as check_resumable reads it
      committed.setdefault(key, value)
    assert ghost["seed"] == committed["seed"] == seed
    assert ghost["clip_method"] == "ghost" and committed["clip_method"] == "projected"
    assert ghost["methods"] == ["logit_dp"] and ghost["target_epsilon"] == 5.0
    assert not ghost["delta_includes_overflow"]
    differ = {k for k in ghost.keys() | committed.keys() if ghost.get(k) != committed.get(k)}
    differ -= {"clip_method", "methods", "privacy_seed", "checkpoint_every", "data"}
    assert differ == set(), differ
    assert {k: v for k, v in ghost["data"].items() if k != "npz_dir"
           } == {k: v for k, v in committed["data"].items() if k != "npz_dir"}
    privacy_seeds.append(ghost["privacy_seed"])
  derived = [p + i for p in privacy_seeds for i in (0, 1)]
  assert len(set(derived)) == 6


def _tuned_ghost(tmp_path, allotment: str, *args, seeds="0", **env):
  """Runs tuned_ghost_gpu.sh in tiny mode, with runs/ and $OUT of its own per allotment."""
  out = tmp_path / allotment / "out"
  out.mkdir(parents=True, exist_ok=True)
  env = dict(os.environ, TUNED_GHOST_TINY="1", TUNED_GHOST_SEEDS=seeds,
             TUNED_GHOST_RUNS=str(tmp_path / allotment / "runs"),
             TUNED_GHOST_RESULTS=str(tmp_path / "results"),
             TUNED_GHOST_STATE=str(tmp_path / "state.tar.gz"), OUT=str(out), **env)
  r = subprocess.run(["bash", TUNED_SCRIPT, *args], env=env, cwd=REPO, capture_output=True,
                     text=True, timeout=900)
  assert r.returncode == 0, r.stdout + r.stderr
  return r, out


@pytest.mark.slow
def test_tuned_ghost_gpu_trains_collects_and_files_across_allotments(tmp_path):
  """Allotment 1 trains seed 0 and packs it; filed here, it is published and its state kept.
  Allotment 2, on a bare runs/, carries that state, skips seed 0 and trains seed 1; filed, both
  render in the paired tables against the committed tuned runs."""
  r, out1 = _tuned_ghost(tmp_path, "device1", "none", "600")
  assert sorted(os.listdir(out1)) == ["tuned_ghost_progress.txt", "tuned_ghost_state.tar.gz"]
  progress = (out1 / "tuned_ghost_progress.txt").read_text()
  _tuned_ghost(tmp_path, "here", "--file", str(out1))
  published = tmp_path / "results" / "cifar10_embnet_tuned_ghost_s0"
  assert sorted(os.listdir(published)) == ["config.json", "results.json", "wallclock.json"]
  config = json.loads((published / "config.json").read_text())
  assert config["clip_method"] == "ghost" and config["privacy_seed"] == 20261200
  steps = json.loads((published / "results.json").read_text())["logit_dp"]["total_steps"]
  assert progress.startswith(f"cifar10_embnet_tuned_ghost_s0: step {steps}, ")
  assert progress.endswith(" finished\n")
  assert (tmp_path / "state.tar.gz").exists()

  r, out2 = _tuned_ghost(tmp_path, "device2", "none", "600", seeds="0 1")
  assert "start cifar10_embnet_tuned_ghost_s1" in r.stdout
  assert "start cifar10_embnet_tuned_ghost_s0" not in r.stdout
  _tuned_ghost(tmp_path, "here", "--file", str(out2), seeds="0 1")
  assert (tmp_path / "results" / "cifar10_embnet_tuned_ghost_s1" / "results.json").exists()

  from experiments import render_results  # pylint: disable=g-import-not-at-top
  for seed in (0, 1):
    name = f"cifar10_embnet_tuned_s{seed}"
    shutil.copytree(os.path.join(REPO, "docs", "results", name), tmp_path / "results" / name)
  runs = render_results.load_runs(str(tmp_path / "results"))
  groups = render_results.groups_of(runs)
  assert [r["seed"] for r in groups["cifar10_embnet_tuned_ghost"]] == [0, 1]
  bound = render_results.render_block("bound:cifar10_embnet_tuned_ghost:cifar10_embnet_tuned", runs,
                                      groups, None)
  assert "ghost (exact norms) | projected (upper bound)" in bound
  assert {line.split("|")[1].strip() for line in bound.splitlines()[2:]} == {"0", "1"}
  versus = render_results.render_block("versus:cifar10_embnet_tuned_ghost:cifar10_embnet_tuned",
                                       runs, groups, None)
  assert "| Logit-DP | DP-GCL | 3-NN acc |" in versus


def test_tuned_ghost_collect_keeps_a_run_with_secret_seeds_here(tmp_path):
  """A workdir with secret seeds beside it (no public privacy_seed) is not packed: its
  checkpoints hold the noise key."""
  runs = tmp_path / "device" / "runs"
  (runs / "cifar10_embnet_tuned_ghost_s0" / "logit_dp").mkdir(parents=True)
  (runs / "cifar10_embnet_tuned_ghost_s0.secrets").mkdir()
  out = tmp_path / "out"
  out.mkdir()
  env = dict(os.environ, TUNED_GHOST_RUNS=str(runs), OUT=str(out))
  r = subprocess.run(["bash", TUNED_SCRIPT, "--collect"], env=env, cwd=REPO, capture_output=True,
                     text=True)
  assert r.returncode != 0 and "secret seeds" in r.stderr
  assert os.listdir(out) == []


# ---------------------------------------------------------------------------
# Step times on one GPU (tools/gpu/step_times_gpu.sh).


@pytest.mark.slow
def test_step_benchmark_embedding_dim_sets_the_nets_output():
  """--embedding-dim d: the embedding net ends in a dense layer 32 → d, so p = 6,296 at the
  paper's d = 8 and 6,296 + 24·33 at d = 32."""
  from benchmarks import step_benchmark  # pylint: disable=g-import-not-at-top
  assert step_benchmark.parse_args([]).embedding_dim == 8
  assert step_benchmark.parse_args(["--embedding-dim", "32"]).embedding_dim == 32
  for d, p in ((8, 6_296), (32, 6_296 + 24 * 33)):
    embed_fn, params, x, _, num_params = step_benchmark.build_problem("embedding", 2, 8,
                                                                      embedding_dim=d)
    assert embed_fn(params, x).shape == (2, d) and num_params == p


@pytest.mark.slow
def test_step_times_gpu_runs_every_stage_and_merges_them(tmp_path):
  """Tiny mode on the CPU: every stage ends (rc=0), the merged report holds each model's sizes
  and the fresh-process memory of the memory stage, in at most 7 files."""
  env = dict(os.environ, STEP_TIMES_TINY="1", EMBEDDING_METHODS="nonprivate,triangle",
             BIG_METHODS="nonprivate", RESNET_METHODS="nonprivate", MEMORY_METHODS="triangle",
             STEP_TIMES_CACHE=str(tmp_path / "cache"))
  res = tmp_path / "res"
  r = subprocess.run(["bash", os.path.join(GPU_TOOLS, "step_times_gpu.sh"),
                      str(res)], env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
  assert r.returncode == 0, r.stdout + r.stderr
  for stage in ("env", "embedding", "n25000", "resnet", "memory", "render"):
    assert f" {stage} rc=0" in r.stdout, r.stdout
  assert len(os.listdir(res)) <= 7
  report = json.loads((res / "step_times.json").read_text())
  got = {(e["model"], e["n"], e["spec"]): e for e in report["results"]}
  for n in (8, 16):
    for spec in ("nonprivate", "triangle"):
      entry = got[("embedding", n, spec)]
      assert entry["status"] == "ok" and entry["times_s"]
  assert got[("resnet18", 4, "nonprivate")]["status"] == "ok"
  assert got[("embedding", 16, "triangle")]["peak_rss_bytes"] > 0
  md = (res / "step_times.md").read_text()
  assert "**embedding**" in md and "**resnet18**" in md


# ---------------------------------------------------------------------------
# The paper's ResNet-18 run (tools/gpu/resnet18_gpu.sh).


@pytest.mark.slow
def test_resnet18_gpu_runs_end_to_end_on_tiny_data(tmp_path):
  """The real config (experiments/configs/cifar10_resnet18.py: Logit-DP with triangle clipping)
  on a random CIFAR-shaped npz, a narrow ResNet-18, batch 20 and two of its methods: both train to
  the end in one piece, a second start finds the run finished, and --wait collects at once."""
  rng = np.random.default_rng(0)
  npz = tmp_path / "npz"
  npz.mkdir()
  np.savez(npz / "cifar10.npz", x_train=rng.integers(0, 256, (120, 32, 32, 3), dtype=np.uint8),
           y_train=rng.integers(0, 10, 120), x_test=rng.integers(0, 256, (20, 32, 32, 3),
                                                                 dtype=np.uint8),
           y_test=rng.integers(0, 10, 20))
  workdir, out = tmp_path / "run", tmp_path / "out"
  out.mkdir()
  env = dict(os.environ, WORKDIR=str(workdir), OUT=str(out), R18_LOG=str(tmp_path / "none"))
  script = os.path.join(GPU_TOOLS, "resnet18_gpu.sh")
  flags_ = [
      "--config.batch_size=20", "--config.num_epochs=1", "--config.model.width=4",
      "--config.microbatch_size=10", "--config.eval_batch_size=20", "--config.eval_num_batches=1",
      "--config.linear_probe=False", "--config.methods=('logit_dp','non_private')"
  ]
  run = lambda *args: subprocess.run(["bash", script, *args], env=env, cwd=tmp_path, capture_output=
                                     True, text=True, timeout=1800)
  r = run(str(npz), "0", "50", *flags_)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  assert r.stdout.count("piece:") == 1 and "finished:" in r.stdout
  results = json.loads((workdir / "results.json").read_text())
  assert sorted(results) == ["logit_dp", "non_private"]
  assert all(m["finished"] for m in results.values())
  assert json.loads((workdir / "config.json").read_text())["clip_method"] == "triangle"
  r = run(str(npz), "0", "50", *flags_)
  assert r.returncode == 0 and "piece:" not in r.stdout
  r = run("--wait", "600")
  assert r.returncode == 0, r.stderr
  assert sorted(os.listdir(out)) == [
      "config.json", "logit_dp.metrics.csv", "non_private.metrics.csv", "results.json"
  ]

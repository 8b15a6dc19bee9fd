"""The GPU scripts of tools/gpu/, run on the CPU in their tiny modes."""

import json
import os
import subprocess

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_TOOLS = os.path.join(REPO, "tools", "gpu")


def test_gpu_scripts_parse():
  scripts = sorted(f for f in os.listdir(GPU_TOOLS) if f.endswith(".sh"))
  assert len(scripts) >= 4
  for script in scripts:
    subprocess.run(["bash", "-n", os.path.join(GPU_TOOLS, script)], check=True)


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
  and the fresh-process memory of the memory stage."""
  env = dict(os.environ, STEP_TIMES_TINY="1", EMBEDDING_METHODS="nonprivate,triangle",
             BIG_METHODS="nonprivate", RESNET_METHODS="nonprivate", MEMORY_METHODS="triangle",
             STEP_TIMES_CACHE=str(tmp_path / "cache"))
  res = tmp_path / "res"
  r = subprocess.run(["bash", os.path.join(GPU_TOOLS, "step_times_gpu.sh"),
                      str(res)], env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
  assert r.returncode == 0, r.stdout + r.stderr
  for stage in ("env", "embedding", "n25000", "resnet", "memory", "render"):
    assert f" {stage} rc=0" in r.stdout, r.stdout
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
  the end, timed in wallclock.json, and a second start finds the run finished."""
  rng = np.random.default_rng(0)
  npz = tmp_path / "npz"
  npz.mkdir()
  np.savez(npz / "cifar10.npz", x_train=rng.integers(0, 256, (120, 32, 32, 3), dtype=np.uint8),
           y_train=rng.integers(0, 10, 120), x_test=rng.integers(0, 256, (20, 32, 32, 3),
                                                                 dtype=np.uint8),
           y_test=rng.integers(0, 10, 20))
  out = tmp_path / "run"
  script = os.path.join(GPU_TOOLS, "resnet18_gpu.sh")
  flags_ = [
      "--config.batch_size=20", "--config.num_epochs=1", "--config.model.width=4",
      "--config.microbatch_size=10", "--config.eval_batch_size=20", "--config.eval_num_batches=1",
      "--config.linear_probe=False", "--config.methods=('logit_dp','non_private')"
  ]
  command = ["bash", script, str(npz), str(out), "0", *flags_]
  run = lambda: subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
  r = run()
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  results = json.loads((out / "results.json").read_text())
  assert sorted(results) == ["logit_dp", "non_private"]
  assert all(m["finished"] for m in results.values())
  assert json.loads((out / "config.json").read_text())["clip_method"] == "triangle"
  (attempt,) = json.loads((out / "wallclock.json").read_text())["attempts"]
  assert attempt["returncode"] == 0
  r = run()
  assert r.returncode == 0 and "finished, nothing to do" in r.stdout + r.stderr, r.stdout

"""experiments/people_benchmark.py: privacy per person measured, (a) per-pair DP-GCL converted by
group privacy against native person-level (b) DP-GCL and (c) Logit-DP, K chosen on public data."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
import pytest

from experiments import clip
from experiments import people_benchmark
from experiments.configs import people_benchmark as full
from experiments.configs import people_benchmark_tiny


def _no_machine_path(root: str, path: str) -> None:
  for dirpath, _, files in os.walk(root):
    for name in files:
      with open(os.path.join(dirpath, name)) as f:
        assert path not in f.read(), os.path.join(dirpath, name)


@pytest.mark.slow  # twelve tiny two-tower trainings (three searches of three, three runs)
def test_people_benchmark_runs_end_to_end_at_a_tiny_size(tmp_path):
  """The one command on synthetic data: every arm's public search over K and the learning rate,
  then its run on the benchmark data with the choice; the guarantees are per person (natively,
  or by group privacy from the per-pair ε/K); a second call trains nothing."""
  config = people_benchmark_tiny.get_config()
  runs, results = str(tmp_path / "runs"), str(tmp_path / "docs")
  out = people_benchmark.run_all(config, runs, results)
  assert out["complete"] and not out["waiting"]
  for arm in ("group_privacy", "dp_gcl", "logit_dp"):
    name = people_benchmark.search_name(arm, 8.0)
    with open(os.path.join(results, "people_benchmark_search", name, "search.json")) as f:
      search = json.load(f)
    assert search["complete"] and search["base"]["data"]["name"] == "cifar100"
    assert [c["name"] for c in search["candidates"]] == ["K1", "K2", "lr0.006"]
    run = os.path.join(results, "people_benchmark", people_benchmark.run_name(arm, 8.0, 0))
    with open(os.path.join(run, "config.json")) as f:
      cfg = json.load(f)
    with open(os.path.join(run, "results.json")) as f:
      (r,) = json.load(f)["methods"].values()
    with open(os.path.join(run, "choice.json")) as f:
      choice = json.load(f)
    assert cfg["data"]["name"] == "cifar10" and choice["search"] == name
    k = choice["overrides"].get("people.max_pairs_per_user", 1)
    assert cfg["people"]["max_pairs_per_user"] == r["max_pairs_per_user"] == k
    assert 0 < r["epsilon"] <= 8.0 and r["delta"] <= 1e-5 * (1 + 1e-9)
    owners = clip.simulate_owners(64, 4, 1.5, 0)
    if arm == "group_privacy":
      assert r["unit"] == "person (group privacy)" and r["epsilon_per_pair"] <= 8.0 / k
      capped = int(np.minimum(np.bincount(owners), k).sum())
      assert r["num_records_capped"] == capped
      assert r["sampling_rate"] == pytest.approx(0.25, rel=0.05)  # q over the capped pairs
    else:
      assert r["unit"] == "person" and r["num_units"] == len(np.unique(owners))
      assert r["sampling_rate"] == pytest.approx(0.25)  # q over the people
  for label in people_benchmark.LABELS.values():
    assert label in out["table"]
  assert out["table"].startswith("Verdict")
  _no_machine_path(results, str(tmp_path))
  again = people_benchmark.run_all(config, runs, results,
                                   train_fn=lambda *a, **k: pytest.fail("trained again"))
  assert again["table"] == out["table"]

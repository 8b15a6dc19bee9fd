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
from helpers import scripted_trainer


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


# Scripted outcome of a run: top-1 peaks at K = PEAK_K[arm] and at the learning rate × 3 of the
# start; (b) leads (a) by 0.05 and (c) by 0.03 at every seed.
PEAK_K = dict(group_privacy=1, dp_gcl=4, logit_dp=2)
OFFSET = dict(group_privacy=0.0, dp_gcl=0.05, logit_dp=0.02)


def _scripted_trainer(calls, fail_at=None):
  """`helpers.scripted_trainer` with the outcome above."""
  def method_results(cfg, method):
    arm = next(a for a, (m, mode) in people_benchmark.ARMS.items()
               if m == method and mode == cfg.people.mode)
    k, lr = cfg.people.max_pairs_per_user, cfg.learning_rates[method]
    top1 = (0.3 - 0.02 * abs(np.log2(k / PEAK_K[arm])) - 0.01 * abs(np.log10(lr / 6e-3))
            + OFFSET[arm] + 0.01 * cfg.seed)
    r = dict(steps=4, learning_rate=lr, temperature=cfg.temperature, clip_norm=cfg.clip_norm,
             zero_shot_top1=top1, zero_shot_top5=top1 + 0.3, epsilon=cfg.target_epsilon * 0.99,
             delta=1e-5, noise_multiplier=1.0, sampling_rate=0.25, max_pairs_per_user=k,
             unit="person", sensitivity=k * 0.5 if method == "logit_dp" else 0.2)
    if cfg.people.mode == "group_privacy":
      r.update(unit="person (group privacy)", epsilon_per_pair=cfg.target_epsilon / k)
    return r

  return scripted_trainer(calls, method_results, fail_at)


def _per_pair_files(results: str) -> None:
  """The per-pair benchmark's published searches (each choosing τ = 0.5) and two of its runs."""
  for mechanism in ("dp_gcl", "logit_dp"):
    for eps in (1, 8):
      folder = os.path.join(results, "clip_benchmark_search", f"{mechanism}_eps{eps}")
      os.makedirs(folder)
      with open(os.path.join(folder, "search.json"), "w") as f:
        json.dump(
            dict(complete=True, chosen=dict(name="tau0.5", overrides={"temperature": 0.5}),
                 base=dict(data=dict(name="cifar100"))), f)
  for name, method, eps in (("dp_gcl_eps8_s0", "dp_gcl", 8.0), ("non_private_s0", "non_private",
                                                                None)):
    folder = os.path.join(results, "clip_benchmark", name)
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
      json.dump(dict(target_epsilon=eps or 8.0, seed=0), f)
    r = dict(steps=100, learning_rate=1e-2, temperature=0.5, zero_shot_top1=0.5, zero_shot_top5=0.9)
    if eps:
      r.update(epsilon=7.98, clip_norm=1e-3, group_size=8, noise_multiplier=0.5)
    with open(os.path.join(folder, "results.json"), "w") as f:
      json.dump(dict(num_classes=10, methods={method: r}), f)


def test_people_benchmark_chooses_k_on_public_data_resumes_and_tabulates(tmp_path):
  """Each arm at each ε starts from the per-pair public choice, searches K then the learning
  rate on the public data only, runs every seed on the benchmark data with its choice; an
  interrupted call resumes without retraining what finished; the table's verdict names the arm
  of best mean top-1 and takes Δ against (b) paired by seed."""
  config = people_benchmark_tiny.get_config()
  config.epsilons = (1.0, 8.0)
  config.seeds = (0, 1, 2)
  config.per_pair_search = "clip_benchmark_search"
  config.per_pair_benchmark = "clip_benchmark"
  runs, results = str(tmp_path / "runs"), str(tmp_path / "docs")
  _per_pair_files(results)
  calls = []
  with pytest.raises(KeyboardInterrupt):
    people_benchmark.run_all(config, runs, results, train_fn=_scripted_trainer(calls, fail_at=11))
  interrupted = list(calls)
  calls.clear()
  out = people_benchmark.run_all(config, runs, results, train_fn=_scripted_trainer(calls))
  assert out["complete"] and not out["waiting"]
  # 3 arms × 2 ε: a search of 3 candidates, then 3 seeds; nothing finished is trained again.
  assert not set(interrupted[:-1]) & set(calls)
  assert len(interrupted) - 1 + len(calls) == 6 * (3 + 3)
  for name, choice in out["chosen"].items():
    arm = name.rsplit("_eps", 1)[0]
    k = min((1, 2), key=lambda v: abs(np.log2(v / PEAK_K[arm])))  # the grid's best K
    method = people_benchmark.ARMS[arm][0]
    assert choice["overrides"] == {
        "people.max_pairs_per_user": k, f"learning_rates.{method}": 6e-3
    }, name
  for workdir in interrupted[:-1] + calls:
    with open(os.path.join(workdir, "config.json")) as f:
      cfg = json.load(f)
    is_search = os.sep + "search" + os.sep in workdir
    assert cfg["data"]["name"] == ("cifar100" if is_search else "cifar10")
    assert cfg["temperature"] == 0.5  # the per-pair public choice is the starting point
  table = out["table"]
  assert table.startswith("Verdict")
  for eps in ("1", "8"):
    assert f"* ε = {eps} per person: **(b) DP-GCL per person**" in table
  # (b) − (c): 0.05 − 0.02 + 0.02 at every seed (K = 2 is one octave off (b)'s peak).
  assert "against (c) Logit-DP per person Δ top-1 +0.010 ± 0.000, Δ top-5 +0.010 ± 0.000" in table
  row = next(
      line for line in table.splitlines() if line.startswith("| (c) Logit-DP per person | 7.92"))
  assert "| 2 |" in row and "-0.010 ± 0.000 (3)" in row  # K = 2 on the grid, at its peak
  assert "| 1 | 1 | 4 | 3 |" in row  # σ, C = K·0.5, steps, seeds
  row = next(line for line in table.splitlines() if line.startswith("| (a) per-pair DP-GCL"))
  assert "| 0.99 | 1 |" in row and "| 1 |" in row  # K = 1, per-pair ε = ε/K
  assert "reference: DP-GCL per pair (per-pair benchmark) | 7.98 per pair" in table
  assert table.count("reference: non-private") == 2
  _no_machine_path(os.path.join(results, "people_benchmark"), str(tmp_path))
  _no_machine_path(os.path.join(results, "people_benchmark_search"), str(tmp_path))
  from experiments import render_results
  name = "people_benchmark:people_benchmark"
  block = f"<!-- generated:{name} -->\n<!-- /generated:{name} -->\n"
  assert table in render_results.render(block, {}, None, results)


def test_people_benchmark_refuses_bad_configs():
  config = full.get_config()
  config.search_base.data.name = "cifar10"
  with pytest.raises(ValueError, match="public data"):
    people_benchmark.check_config(config)
  config = full.get_config()
  config.search_base.people.sampling_rate = 0.05
  with pytest.raises(ValueError, match="people"):
    people_benchmark.check_config(config)
  config = full.get_config()
  config.arms = ("group_privacy", "logit_dp")
  with pytest.raises(ValueError, match="dp_gcl"):
    people_benchmark.check_config(config)
  config = full.get_config()
  config.arms = ("dp_gcl", "dp_sgd")
  with pytest.raises(ValueError, match="unknown"):
    people_benchmark.check_config(config)
  config = full.get_config()
  config.k_grid = (0, 2)
  with pytest.raises(ValueError, match="k_grid"):
    people_benchmark.check_config(config)


def test_people_sampling_rate_sets_q_over_the_people_and_is_checked():
  """people.sampling_rate = q: q·M expected people natively (M the simulated owners); a rate
  outside (0, 1] is refused, naming the setting."""
  from experiments.configs import clip_people_tiny

  config = clip_people_tiny.get_config()
  config.people.sampling_rate = 0.25
  owners = clip.simulate_owners(200, 4, 1.5, 0)
  kwargs = clip.person_kwargs(config, 200)
  np.testing.assert_array_equal(kwargs["user_ids"], owners)
  assert kwargs["expected_batch_size"] == pytest.approx(0.25 * len(np.unique(owners)))
  for bad in (0.0, 1.5, -0.1):
    config.people.sampling_rate = bad
    with pytest.raises(ValueError, match="people.sampling_rate"):
      clip.person_kwargs(config, 200)

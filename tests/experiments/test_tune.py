"""The public-data search (experiments/tune.py) and the tuned CIFAR-10 config."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import glob
import json
import math
import shlex

import numpy as np
import pytest

from experiments import tune
from experiments import workdirs
from experiments.configs import cifar10_embedding_net_triangle
from experiments.configs import cifar10_embedding_net_tuned
from experiments.configs import tiny
from experiments.configs import tune_cifar100

# ---------------------------------------------------------------------------
# The search logic on the real 17-candidate config, with a scripted trainer (no training).


def _scripted_accuracy(cfg) -> float:
  """A fixed 3-NN accuracy per setting: τ = 2 and d = 16 help, the schedules tie, and the
  epoch counts tie with the incumbent (so the rule's tie-break decides)."""
  acc = 0.20
  acc += {0.5: -0.05, 1.0: 0.0, 2.0: 0.02}[cfg.temperature]
  acc += {8: 0.0, 16: 0.01, 32: 0.005}[cfg.model.embedding_dim]
  acc += 0.0 if cfg.pair_mode == "same_class" else -0.03
  acc += {1e-2: 0.0, 3e-3: -0.01, 1e-1: -0.02}[cfg.learning_rates.logit_dp]
  acc += 0.004 if cfg.lr_schedule != "constant" else 0.0
  return acc


def _steps(cfg) -> int:
  records = 25_000 if cfg.pair_mode == "same_class" else 50_000
  return math.ceil(cfg.num_epochs * records / cfg.batch_size)


class ScriptedTrainer:
  """Writes the results.json that train.train_and_evaluate would, from _scripted_accuracy;
  ``interrupt`` candidates stop unfinished on their first call; lr 3e-2 diverges."""
  def __init__(self, interrupt=(), results_dir=None):
    self.calls, self.configs, self.interrupt = [], {}, set(interrupt)
    self.results_dir, self.progress = results_dir, {}

  def __call__(self, cfg, workdir, quiet=True):
    name = os.path.basename(workdir)
    self.calls.append(name)
    path = os.path.join(self.results_dir or "", "search.json")
    if self.results_dir and os.path.exists(path) and name not in self.progress:
      with open(path) as f:
        self.progress[name] = json.load(f)  # what the search had published before this one
    self.configs[name] = cfg
    if cfg.learning_rates.logit_dp == 3e-2:
      raise FloatingPointError("logit_dp: the training loss is not finite at step 3")
    finished = name not in self.interrupt or self.calls.count(name) > 1
    steps = _steps(cfg)
    acc = _scripted_accuracy(cfg)
    res = dict(logit_dp=dict(method="logit_dp", finished=finished, steps=steps if finished else 10,
                             total_steps=steps, noise_multiplier=2.5, sampling_rate=cfg.batch_size
                             / 25_000, epsilon=4.99, delta=1e-5, clip_norm=cfg.clip_norm,
                             train_seconds=0.0))
    if finished:
      res["logit_dp"].update(accuracy=acc, linear_probe=acc + 0.05)
    with open(os.path.join(workdir, "results.json"), "w") as f:
      json.dump(res, f)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(cfg.to_json_best_effort())
    return res


@pytest.fixture(scope="module")
def scripted_search(tmp_path_factory):
  root = tmp_path_factory.mktemp("search")
  runs, results = str(root / "runs"), str(root / "results")
  trainer = ScriptedTrainer(interrupt={"dim16"}, results_dir=results)
  config = tune_cifar100.get_config()
  first = tune.run_search(config, runs, results, train_fn=trainer)
  first_calls = list(trainer.calls)
  second = tune.run_search(config, runs, results, train_fn=trainer)
  return dict(root=root, runs=runs, results=results, trainer=trainer, first=first,
              first_calls=first_calls, second=second, config=config)


def test_search_stops_at_an_unfinished_stage_and_resumes_it(scripted_search):
  first, second = scripted_search["first"], scripted_search["second"]
  trainer = scripted_search["trainer"]
  assert not first["complete"] and first["chosen"] is None
  # Stages base, temperature, clip norm and embedding dimension ran; dim16 stopped early.
  assert scripted_search["first_calls"] == [
      "base", "projected", "tau0.5", "tau2", "clip0.3", "clip3", "clip10", "dim16", "dim32"
  ]
  assert [r["name"] for r in first["candidates"]][-2:] == ["dim16", "dim32"]
  assert not first["candidates"][-2]["finished"]
  # Resumed: only dim16 again, then the stages not yet run; finished ones are not retrained.
  names = [c["name"] for s in scripted_search["config"].stages for c in s["candidates"]]
  assert trainer.calls.count("dim16") == 2
  assert sorted(trainer.calls) == sorted(names + ["dim16"])
  assert second["complete"]
  again = tune.run_search(scripted_search["config"], scripted_search["runs"],
                          scripted_search["results"], train_fn=trainer)
  assert len(trainer.calls) == len(names) + 1  # a third call trains nothing
  assert again == second


def test_a_new_machine_resumes_from_the_published_candidates(scripted_search, tmp_path):
  """runs/ is gone (a new machine), the committed results_dir is not: nothing is retrained,
  not even the diverged candidate, and the summary is the same."""
  import shutil  # pylint: disable=g-import-not-at-top
  results = str(tmp_path / "results")
  shutil.copytree(scripted_search["results"], results)
  trainer = ScriptedTrainer()
  again = tune.run_search(scripted_search["config"], str(tmp_path / "empty_runs"), results,
                          train_fn=trainer)
  assert trainer.calls == []
  assert again == scripted_search["second"]
  assert any("diverged" in c for c in again["candidates"])
  # A published copy made with other settings is refused, as a stale workdir is.
  with open(os.path.join(results, "tau2", "config.json")) as f:
    stale = json.load(f)
  stale["temperature"] = 0.25
  with open(os.path.join(results, "tau2", "config.json"), "w") as f:
    json.dump(stale, f)
  with pytest.raises(ValueError, match="different training config"):
    tune.run_search(scripted_search["config"], str(tmp_path / "empty_runs"), results,
                    train_fn=trainer)


def test_each_stage_builds_on_the_incumbent_and_the_rule_picks(scripted_search):
  second, trainer = scripted_search["second"], scripted_search["trainer"]
  records = {r["name"]: r for r in second["candidates"]}
  # Stage k's candidates carry the winner of stages < k.
  assert trainer.configs["clip3"].temperature == 2.0 and trainer.configs["clip3"].clip_norm == 3.0
  assert trainer.configs["lr3e-3"].model.embedding_dim == 16
  assert trainer.configs["epochs40"].lr_schedule == "cosine"
  assert records["epochs40"]["overrides"] == {
      "temperature": 2.0, "model.embedding_dim": 16, "lr_schedule": "cosine",
      "lr_final_fraction": 0.1, "num_epochs": 40
  }
  # The diverged candidate is recorded, ranks last and is not retried.
  assert records["lr3e-2"]["diverged"].startswith("logit_dp: the training loss is not finite")
  assert trainer.calls.count("lr3e-2") == 1
  assert [s["winner"] for s in second["stages"]
         ] == ["base", "base", "tau2", "tau2", "dim16", "dim16", "dim16", "cosine", "epochs10"]
  # The rule, computed here over every candidate: best accuracy, then fewer steps, then earlier.
  scored = [(-_scripted_accuracy(trainer.configs[n]), _steps(trainer.configs[n]), i, n)
            for i, n in enumerate(records) if n != "lr3e-2"]
  want = min(scored)[3]
  assert want == "epochs10"  # ties base+τ+d+schedule (epochs40 too) with 25 steps, the fewest
  assert second["chosen"] == dict(name=want, overrides=records[want]["overrides"])
  for n, r in records.items():
    if n != "lr3e-2":
      assert r["accuracy"] == _scripted_accuracy(trainer.configs[n])
      assert r["steps"] == _steps(trainer.configs[n])


def test_search_publishes_its_progress_after_every_candidate(scripted_search):
  progress = scripted_search["trainer"].progress
  assert "base" not in progress  # nothing was written before the first candidate
  before_tau = progress["tau0.5"]
  assert [r["name"] for r in before_tau["candidates"]] == ["base", "projected"]
  assert not before_tau["complete"] and before_tau["chosen"] is None
  assert [st["winner"] for st in before_tau["stages"]] == ["base", "base"]
  assert not tune.search_finished(os.path.join(scripted_search["root"], "missing.json"))
  with pytest.raises(ValueError, match="has not finished"):
    cifar10_embedding_net_tuned.get_config(_write(scripted_search["root"], before_tau))


def test_search_table_marks_a_wallclock_below_the_training_time():
  from experiments import render_results  # pylint: disable=g-import-not-at-top
  row = dict(order=0, name="tau2", stage="temperature", own_overrides={}, overrides={},
             finished=True, steps=50, noise_multiplier=2.71, epsilon=5.0, accuracy=0.05,
             linear_probe=0.09, train_seconds=2066.0, wallclock_seconds=990.0)
  text = render_results.search_table(dict(rule="r", candidates=[row]))
  assert "| 0.0541 |" not in text and "| 0.0500 | 0.0900 | 2,066 | 990 † |" in text
  assert "† Less than the training alone" in text
  row.update(wallclock_seconds=2100.0)
  assert "†" not in render_results.search_table(dict(rule="r", candidates=[row]))


def _write(root, summary) -> str:
  path = os.path.join(root, "partial_search.json")
  with open(path, "w") as f:
    json.dump(summary, f)
  return path


def test_search_writes_its_summary_and_publishes_the_candidates(scripted_search):
  results = scripted_search["results"]
  with open(os.path.join(results, "search.json")) as f:
    assert json.load(f) == json.loads(json.dumps(scripted_search["second"]))
  md = open(os.path.join(results, "search.md")).read()
  assert "| train s | wall-clock s |" in md and "†" not in md
  assert "**epochs10**" in md and "Chosen by the rule" in md and "| diverged |" in md
  rows = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
  assert len(rows) == 17  # one row per candidate
  base = json.loads(open(os.path.join(results, "base", "results.json")).read())
  assert base["logit_dp"]["accuracy"] == pytest.approx(0.2)
  for name in ("config.json", "results.json", "wallclock.json"):
    assert os.path.exists(os.path.join(results, "dim16", name))
  wc = json.loads(open(os.path.join(scripted_search["runs"], "dim16", "wallclock.json")).read())
  assert len(wc["attempts"]) == 2 and all(a["returncode"] == 0 for a in wc["attempts"])
  assert scripted_search["second"]["base"]["data"]["name"] == "cifar100"


def test_tuned_config_applies_the_chosen_overrides_once(scripted_search):
  path = os.path.join(scripted_search["results"], "search.json")
  cfg = cifar10_embedding_net_tuned.get_config(path)
  ref = cifar10_embedding_net_triangle.get_config()
  assert cfg.data.name == "cifar10"
  assert tuple(cfg.methods) == ("logit_dp", "naive_dp", "dp_gcl", "non_private")
  assert (cfg.dp_gcl.group_size, cfg.dp_gcl.extra_views, cfg.learning_rates.dp_gcl) == (8.0, 2,
                                                                                        1e-2)
  assert (cfg.temperature, cfg.model.embedding_dim, cfg.lr_schedule, cfg.lr_final_fraction,
          cfg.num_epochs) == (2.0, 16, "cosine", 0.1, 10)
  assert cfg.tuned_from.candidate == "epochs10"
  changed = {
      "temperature", "model", "lr_schedule", "lr_final_fraction", "num_epochs", "tuned_from",
      "projection", "methods", "dp_gcl", "learning_rates"
  }
  assert cfg.projection.reference == "cifar100" and cfg.projection.split == "train"
  got, want = cfg.to_dict(), ref.to_dict()
  assert {k for k in got if got[k] != want.get(k)} == changed
  assert {k: v for k, v in got["model"].items() if k != "embedding_dim"
         } == {k: v for k, v in want["model"].items() if k != "embedding_dim"}
  assert {k: v for k, v in got["learning_rates"].items() if k != "dp_gcl"} == want["learning_rates"]


def _parse_config_flags(config_arg: str, *overrides: str):
  """The config as pretrain.py's ``config_flags.DEFINE_config_file`` parses it."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  argv = ["prog", f"--config={config_arg}", *overrides]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
  values(argv)
  return values.config


def test_every_npz_config_takes_the_data_folder_from_the_command_line(scripted_search):
  """As pretrain.py and finetune.py take it: ``--config.data.npz_dir=DIR``.
  The tuned config once lost the placeholder's type in a copy and refused the flag."""
  configs = os.path.join(os.path.dirname(tune.__file__), "configs")
  search = os.path.join(scripted_search["results"], "search.json")
  checked = []
  for name in sorted(os.listdir(configs)):
    if not name.endswith(".py") or name in ("__init__.py", "tune_cifar100.py"):
      continue
    arg = os.path.join(configs, name)
    arg += f":{search}" if name == "cifar10_embedding_net_tuned.py" else ""
    if _parse_config_flags(arg).get("data", {}).get("source") != "npz":
      continue
    assert _parse_config_flags(arg, "--config.data.npz_dir=/d").data.npz_dir == "/d", name
    checked.append(name)
  assert "cifar10_embedding_net_tuned.py" in checked and len(checked) >= 10, checked


def test_every_published_pretraining_command_parses_with_the_committed_search():
  """Each published run's command (its wallclock.json) with today's configs, the tuned config
  reading the committed search.json (a config default added later must not make a published run
  fail to reproduce)."""
  repo = os.path.dirname(os.path.dirname(tune.__file__))
  parsed = 0
  for path in sorted(glob.glob(os.path.join(repo, "docs", "results", "*", "wallclock.json"))):
    with open(path) as f:
      script, *args = shlex.split(json.load(f)["command"])
    if not script.endswith("pretrain.py"):
      continue
    (config,) = (a.split("=", 1)[1] for a in args if a.startswith("--config="))
    overrides = [a for a in args if a.startswith("--config.")]
    cfg = _parse_config_flags(
        os.path.join(repo, "experiments", "configs", os.path.basename(config)), *overrides)
    name = os.path.basename(os.path.dirname(path))
    assert cfg.seed == int(name.rsplit("_s", 1)[1]), name
    if "--config.delta_includes_overflow=False" in overrides:
      assert cfg.delta_includes_overflow is False
    parsed += 1
  assert parsed >= 20


def test_tuned_config_refuses_a_missing_unfinished_or_mismatched_search(scripted_search, tmp_path):
  with pytest.raises(FileNotFoundError, match="run the public-data search first"):
    cifar10_embedding_net_tuned.get_config(str(tmp_path / "none.json"))
  summary = json.loads(json.dumps(scripted_search["first"]))
  (tmp_path / "unfinished.json").write_text(json.dumps(summary))
  with pytest.raises(ValueError, match="has not finished"):
    cifar10_embedding_net_tuned.get_config(str(tmp_path / "unfinished.json"))
  done = json.loads(json.dumps(scripted_search["second"]))
  for edit, match in ((lambda s: s["base"]["data"].update(name="cifar10"),
                       "private"), (lambda s: s["base"].update(batch_size=1_000), "base differs"),
                      (lambda s: s["chosen"]["overrides"].update(target_epsilon=8.0),
                       "target_epsilon")):
    bad = json.loads(json.dumps(done))
    edit(bad)
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=match):
      cifar10_embedding_net_tuned.get_config(str(tmp_path / "bad.json"))


def test_search_config_is_checked(tmp_path):
  cfg = tune_cifar100.get_config()
  tune.check_search_config(cfg)
  n = sum(len(s["candidates"]) for s in cfg.stages)
  assert n == 17 and f"{n} candidates:" in tune_cifar100.__doc__  # the docstring's count
  b = cfg.base
  assert (b.data.name, b.data.label, tuple(b.methods), b.batch_size, b.target_epsilon,
          b.target_delta, b.clip_method) == ("cifar100", "fine", ("logit_dp",), 10_000, 5.0, 1e-5,
                                             "triangle")
  for edit, match in (
      (lambda c: c.base.data.update(name="cifar10"),
       "public data"), (lambda c: setattr(c.base, "methods", ("logit_dp", "naive_dp")), "Logit-DP"),
      (lambda c: c.stages[1]["candidates"][0]["overrides"].update(target_epsilon=8.0),
       "may not change"), (lambda c: c.stages[1]["candidates"][0].update(name="base"), "unique"),
      (lambda c: c.stages[1]["candidates"][0]["overrides"].update({"model.width": 3}),
       "no 'width'")):
    bad = tune_cifar100.get_config()
    edit(bad)
    with pytest.raises(ValueError, match=match):
      tune.check_search_config(bad)
  trainer = ScriptedTrainer()
  bad = tune_cifar100.get_config()
  bad.base.data.name = "cifar10"
  with pytest.raises(ValueError, match="public data"):
    tune.run_search(bad, str(tmp_path / "r"), str(tmp_path / "s"), train_fn=trainer)
  assert trainer.calls == []
  bad = tune_cifar100.get_config()
  bad.base.projection.reference = "cifar10"
  with pytest.raises(ValueError, match="private data set"):
    tune.check_search_config(bad)


def test_a_workdir_made_with_other_settings_is_not_taken_for_the_candidate(tmp_path):
  """E.g. after a stage is inserted: the old "tau2" (triangle) is not the new "tau2"."""
  config = tune_cifar100.get_config()
  config.stages = [config.stages[0], config.stages[1], config.stages[2]]  # base, clip, τ
  runs, results = str(tmp_path / "runs"), str(tmp_path / "results")
  trainer = _PreferProjected(ScriptedTrainer())
  stale = tune.apply_overrides(config.base, {"temperature": 2.0})  # made before the clip stage
  os.makedirs(os.path.join(runs, "tau2"))
  trainer(stale, os.path.join(runs, "tau2"))
  trainer.trainer.calls.clear()
  with pytest.raises(ValueError, match="different training config"):
    tune.run_search(config, runs, results, train_fn=trainer)
  assert trainer.trainer.calls == ["base", "projected", "tau0.5"]


class _PreferProjected:
  """ScriptedTrainer with the projected bound scoring higher, so that it wins its stage."""
  def __init__(self, trainer):
    self.trainer = trainer

  def __call__(self, cfg, workdir, quiet=True):
    res = self.trainer(cfg, workdir, quiet)
    res["logit_dp"]["accuracy"] += 0.1 if cfg.clip_method == "projected" else 0.0
    with open(os.path.join(workdir, "results.json"), "w") as f:
      json.dump(res, f)
    return res


def test_subset_keeps_the_sampling_rate():
  cfg = tune.scaled_to_subset(tune_cifar100.get_config(), 5_000)
  assert cfg.base.data.train_subset == 5_000 and cfg.base.batch_size == 1_000
  assert cfg.base.microbatch_size == 1_000 and cfg.base.eval_batch_size == 1_000
  assert 1_000 / (5_000 // 2) == 10_000 / 25_000


# ---------------------------------------------------------------------------
# A real search at a tiny size (digits as the public data): runs, resumes, picks.


def _tiny_search():
  cfg = tune_cifar100.get_config()
  base = tiny.get_config()
  base.methods = ("logit_dp",)
  base.linear_probe = False
  base.log_every = 100
  cfg.base = base
  cfg.stages = [
      dict(name="base", candidates=[dict(name="base", overrides={})]),
      dict(name="temperature", candidates=[dict(name="tau2", overrides={"temperature": 2.0})]),
      dict(name="schedule", candidates=[dict(name="cosine", overrides={"lr_schedule": "cosine"})]),
  ]
  return cfg


@pytest.mark.slow
def test_tiny_search_trains_resumes_and_picks(tmp_path):
  cfg = _tiny_search()
  ref = tune.run_search(cfg, str(tmp_path / "ref_runs"), str(tmp_path / "ref"))
  assert ref["complete"]
  cfg.base.stop_after_steps = 2
  part = tune.run_search(cfg, str(tmp_path / "runs"), str(tmp_path / "res"))
  assert not part["complete"] and len(part["candidates"]) == 1
  assert not workdirs.is_finished(str(tmp_path / "runs" / "base"))
  cfg.base.stop_after_steps = None
  done = tune.run_search(cfg, str(tmp_path / "runs"), str(tmp_path / "res"))
  assert done["complete"]
  for a, b in zip(done["candidates"], ref["candidates"]):
    assert a["name"] == b["name"] and a["accuracy"] == b["accuracy"] and a["steps"] == b["steps"]
  acc = {r["name"]: r["accuracy"] for r in done["candidates"]}
  assert all(0.0 <= v <= 1.0 for v in acc.values())
  best = max(acc.values())
  assert done["chosen"]["name"] == next(n for n in acc if acc[n] == best)  # equal steps: earlier
  assert done["chosen"] == ref["chosen"]
  with open(tmp_path / "res" / "search.json") as f:
    assert json.load(f)["chosen"] == done["chosen"]
  # The σ of each candidate is the accountant's for its own q and T at the base's ε.
  for r in done["candidates"]:
    assert 0.9 * cfg.base.target_epsilon < r["epsilon"] <= cfg.base.target_epsilon
  assert np.isfinite([r["noise_multiplier"] for r in done["candidates"]]).all()


@pytest.mark.slow
def test_tuned_config_trains_at_tiny_size(scripted_search, tmp_path):
  from experiments import train  # pylint: disable=g-import-not-at-top
  cfg = cifar10_embedding_net_tuned.get_config(
      os.path.join(scripted_search["results"], "search.json"))
  small = tiny.get_config()
  cfg.data, cfg.methods = small.data, ("logit_dp",)
  cfg.model.name = "mlp"
  cfg.model.hidden = (16,)
  cfg.batch_size, cfg.microbatch_size, cfg.eval_batch_size, cfg.eval_num_batches = 32, None, None, 1
  cfg.privacy_seed, cfg.progress, cfg.stop_after_steps, cfg.linear_probe = 0, False, 2, False
  r = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)["logit_dp"]
  assert r["steps"] == 2 and r["sensitivity"] == pytest.approx(2 * (1 + np.exp(1.0)) / 2.0)

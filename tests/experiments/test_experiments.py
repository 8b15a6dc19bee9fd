"""End-to-end tests of the experiment scripts (tiny digits config, seconds)."""

import os
import sys

# `experiments/` is not an installed package: make the repository root importable
# (also when pytest is started as `pytest` rather than `python -m pytest`).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import csv
import io
import json
import subprocess

import jax
import numpy as np
import pytest

import logit_dp
from experiments import finetuning
from experiments import train
from experiments.configs import default as default_config
from experiments.configs import tiny
from experiments.configs import tiny_finetune
from helpers import save_config_started_before
from helpers import scripted_trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """One uninterrupted tiny run of the three methods (shared by the tests below)."""
  workdir = str(tmp_path_factory.mktemp("pretrain"))
  results = train.train_and_evaluate(tiny.get_config(), workdir, quiet=True)
  return workdir, results


def _params_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return len(la) == len(lb) and all(
      np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.mark.slow  # the tiny pipeline run (pretrained); the library's steps are tested in tests/
def test_pretrain_results_folder(pretrained):
  workdir, results = pretrained
  assert set(results) == {"logit_dp", "naive_dp", "non_private"}
  for name in ("config.json", "results.json", "results.md", "relative_loss.png", "loss.png",
               "confusion_matrices.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0, name
  for m in results:
    assert os.listdir(os.path.join(workdir, "tensorboard", m))
    assert os.path.isdir(os.path.join(workdir, m, "checkpoints"))
    with open(os.path.join(workdir, m, "metrics.csv")) as f:
      rows = list(csv.DictReader(f))
    assert int(rows[-1]["step"]) == results[m]["total_steps"]
    # The private training loss is not logged by default.
    assert not any("train_loss" in k for k in rows[0])
    assert 0.0 <= results[m]["accuracy"] <= 1.0 and 0.0 <= results[m]["linear_probe"] <= 1.0
    cm = np.asarray(results[m]["confusion_matrix"])
    assert cm.sum() == 100 and cm.shape == (10, 10)
  table = open(os.path.join(workdir, "results.md")).read()
  assert "Logit-DP" in table and "Naive-DP" in table and "rel. acc" in table


@pytest.mark.slow  # the tiny pipeline run (pretrained); the library's steps are tested in tests/
def test_privacy_of_dp_runs(pretrained):
  _, results = pretrained
  cfg = tiny.get_config()
  for m in ("logit_dp", "naive_dp"):
    r = results[m]
    assert 0.9 * cfg.target_epsilon < r["epsilon"] <= cfg.target_epsilon
    # The certified δ, overflow term of the padded batches included (here ~1e-8), is within
    # the target (σ calibrated at δ minus it: tests/test_certified_delta.py).
    assert 0.99 * cfg.target_delta < r["delta"] <= cfg.target_delta
    assert r["noise_multiplier"] > 0
  assert results["logit_dp"]["sensitivity"] == pytest.approx(
      2 * (1 + np.exp(2.0)) * cfg.clip_norm)  # contrastive, tau = 1, sup over batch sizes
  assert results["naive_dp"]["sensitivity"] == 2 * cfg.clip_norm
  assert results["non_private"]["epsilon"] == 0.0


# logit_dp is slow: test_ledger.test_kill_and_resume_reports_the_same_epsilon_and_noise resumes
# the noise and the ledger by default.
@pytest.mark.slow  # the tiny pipeline run (pretrained) and a resumed one
@pytest.mark.parametrize("method", ["logit_dp", "non_private"])
def test_resume_matches_uninterrupted_run(pretrained, tmp_path, method):
  ref_dir, ref = pretrained
  cfg = tiny.get_config()
  cfg.methods = (method,)
  cfg.stop_after_steps = 2
  first = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)[method]
  assert not first["finished"] and first["steps"] == 2
  cfg.stop_after_steps = None
  second = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)[method]
  assert second["finished"]
  assert _params_equal(second["params"], ref[method]["params"])
  assert second["epsilon"] == ref[method]["epsilon"]
  assert second["accuracy"] == ref[method]["accuracy"]
  with open(os.path.join(tmp_path, method, "metrics.csv")) as f:
    steps = [int(r["step"]) for r in csv.DictReader(f)]
  with open(os.path.join(ref_dir, method, "metrics.csv")) as f:
    ref_steps = [int(r["step"]) for r in csv.DictReader(f)]
  assert steps == ref_steps  # no duplicated or missing rows after the resume
  # The resumed record's training time counts the interrupted attempt's steps too.
  assert 0 < first["train_seconds"] < second["train_seconds"]
  with open(os.path.join(tmp_path, method, "metrics.csv")) as f:
    rows = list(csv.DictReader(f))
  assert second["train_seconds"] == pytest.approx(train.logged_train_seconds(rows))
  assert first["train_seconds"] == pytest.approx(
      train.logged_train_seconds([r for r in rows if int(r["step"]) <= 2]))


def test_logged_train_seconds_sums_steps_over_rate():
  rows = [
      dict(step=0, steps_per_sec="nan"),
      dict(step=10, steps_per_sec="2.0"),
      dict(step=15, steps_per_sec="5.0"),
      dict(step=15, steps_per_sec="5.0")
  ]
  assert train.logged_train_seconds(rows) == 10 / 2.0 + 5 / 5.0


@pytest.mark.slow
def test_a_row_is_logged_at_every_checkpoint(tmp_path):
  """Rows at checkpoints keep a resumed run's training time whole when the logging and the
  checkpoint intervals differ."""
  cfg = tiny.get_config()
  cfg.methods = ("non_private",)
  cfg.log_every, cfg.checkpoint_every, cfg.stop_after_steps = 3, 2, 4
  train.train_and_evaluate(cfg, str(tmp_path), quiet=True)
  with open(os.path.join(tmp_path, "non_private", "metrics.csv")) as f:
    assert [int(r["step"]) for r in csv.DictReader(f)] == [0, 2, 3, 4]


@pytest.mark.slow  # the tiny pipeline run (pretrained); the library's steps are tested in tests/
def test_signal_to_noise_measures_at_a_runs_trained_parameters(pretrained):
  from experiments import signal_to_noise  # pylint: disable=g-import-not-at-top
  workdir, results = pretrained
  cfg = tiny.get_config()
  x = np.zeros((1, 8, 8, 1), np.float32)
  params, described = signal_to_noise.load_params(f"{workdir}:non_private", cfg, x)
  assert _params_equal(params, results["non_private"]["params"])
  assert described == f"non_private trained ({os.path.basename(workdir)})"
  with pytest.raises(ValueError, match="WORKDIR:METHOD"):
    signal_to_noise.load_params(workdir, cfg, x)
  other = cfg.copy_and_resolve_references()
  other.model.embedding_dim = cfg.model.embedding_dim + 1
  with pytest.raises(ValueError, match="not the measured"):
    signal_to_noise.load_params(f"{workdir}:non_private", other, x)


@pytest.mark.slow  # a tiny training run
def test_signal_to_noise_initial_parameters_are_those_a_run_of_the_seed_starts_from(tmp_path):
  """"initial (seed S)" is where seed S's runs start: a run of seed 3 whose updates are zero
  (learning rate 0) ends at exactly the measured parameters."""
  from experiments import signal_to_noise  # pylint: disable=g-import-not-at-top
  cfg = tiny.get_config()
  cfg.seed, cfg.methods, cfg.linear_probe = 3, ("non_private",), False
  cfg.learning_rates.non_private = 0.0
  unmoved = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)["non_private"]["params"]
  params, described = signal_to_noise.load_params(None, cfg, np.zeros((1, 8, 8, 1), np.float32))
  assert _params_equal(params, unmoved) and described == "initial (seed 3)"
  cfg.seed = 4
  assert not _params_equal(
      signal_to_noise.load_params(None, cfg, np.zeros((1, 8, 8, 1)))[0], unmoved)


@pytest.mark.slow  # two tiny training runs
def test_untrained_baseline_added_to_a_finished_run(tmp_path):
  """Adding "untrained" to a finished run evaluates the seed's initial parameters and keeps the
  finished method's results (train time included) as they were."""
  cfg = tiny.get_config()
  cfg.methods = ("non_private",)
  first = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)["non_private"]
  cfg.methods = ("non_private", "untrained")
  again = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)
  kept = again["non_private"]
  assert kept["train_seconds"] == first["train_seconds"] > 0
  assert kept["accuracy"] == first["accuracy"]
  untrained = again["untrained"]
  assert untrained["steps"] == 0 and untrained["epsilon"] == 0.0 and untrained["finished"]
  ds = train.data_lib.load_dataset(cfg.data, seed=cfg.seed)
  init = train.get_model(cfg.model)[3](train._keys(cfg.seed)["init"],
                                       train.data_lib.to_float(ds["x_train"][:1]))
  assert _params_equal(untrained["params"], init)
  want = train.evaluate_embeddings(cfg, init, ds)
  assert untrained["accuracy"] == want["accuracy"]
  assert untrained["linear_probe"] == want["linear_probe"]
  with open(os.path.join(tmp_path, "results.json")) as f:
    assert set(json.load(f)) == {"non_private", "untrained"}
  assert _params_equal(finetuning.load_pretrained(str(tmp_path), "untrained", cfg), init)
  cfg.knn_k = 5  # another evaluation: nothing is reused
  fresh = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)["non_private"]
  assert "params" in fresh


@pytest.mark.slow  # the tiny pipeline run (pretrained); the library's steps are tested in tests/
def test_resume_refuses_a_different_config(pretrained):
  workdir, _ = pretrained
  cfg = tiny.get_config()
  cfg.learning_rates.logit_dp = 0.5
  with pytest.raises(ValueError, match="different training config"):
    train.train_and_evaluate(cfg, workdir, quiet=True)


def test_resume_takes_the_data_from_another_folder_but_not_other_data(tmp_path):
  """A new machine unpacks CIFAR elsewhere: the folder is a location, the data set is not."""
  from experiments.configs import cifar10_embedding_net_triangle  # pylint: disable=g-import-not-at-top
  cfg = cifar10_embedding_net_triangle.get_config()
  cfg.data.npz_dir = "/old/machine/cifar"
  (tmp_path / "config.json").write_text(cfg.to_json_best_effort())
  cfg.data.npz_dir = "/new/machine/cifar"
  train.check_resumable(cfg, str(tmp_path))  # no error
  cfg.data.name = "cifar100"
  with pytest.raises(ValueError, match="different training config"):
    train.check_resumable(cfg, str(tmp_path))
  assert cfg.data.npz_dir == "/new/machine/cifar"  # the caller's config is left as it was


@pytest.mark.slow  # two tiny runs; test_ledger refuses and resumes past the budget by default
def test_run_past_the_privacy_budget_is_refused_unless_allowed(tmp_path):
  cfg = tiny.get_config()
  cfg.methods = ("logit_dp",)
  cfg.noise_multiplier = 0.3  # far less noise than target_epsilon allows
  with pytest.raises(logit_dp.ledger.PrivacyBudgetExceededError, match="allow_exceeding_budget"):
    train.train_and_evaluate(cfg, str(tmp_path / "refused"), quiet=True)
  cfg.allow_exceeding_budget = True
  result = train.train_and_evaluate(cfg, str(tmp_path / "allowed"), quiet=True)["logit_dp"]
  assert result["epsilon"] > cfg.target_epsilon


# Slow: three more tiny runs; the sharded private step is compared with one device in
# test_distributed and the sharded batches of pretrain.py in test_multihost.
@pytest.mark.slow
@pytest.mark.parametrize("method", ["logit_dp", "naive_dp", "non_private"])
def test_num_devices_flag_reproduces_the_single_device_run(pretrained, tmp_path, method):
  """config.num_devices=4 (simulated CPU devices): same training, same ε."""
  _, ref = pretrained
  cfg = tiny.get_config()
  cfg.methods = (method,)
  cfg.num_devices = 4
  result = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)[method]
  assert result["epsilon"] == ref[method]["epsilon"]
  for got, want in zip(jax.tree_util.tree_leaves(result["params"]),
                       jax.tree_util.tree_leaves(ref[method]["params"])):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # two tiny training runs; the library's secret seeds: test_private_training
def test_privacy_seeds_are_secret_by_default_and_survive_a_resume(tmp_path):
  cfg = tiny.get_config()
  cfg.methods = ("logit_dp",)
  cfg.privacy_seed = None  # the default of every real config
  cfg.stop_after_steps = 1
  seeds = []
  for run in ("a", "b"):
    workdir = tmp_path / run
    train.train_and_evaluate(cfg, str(workdir), quiet=True)
    # Outside the results folder, readable by the owner only.
    path = tmp_path / f"{run}.secrets" / "logit_dp" / train.SECRET_SEEDS_FILE
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert not list(workdir.rglob(train.SECRET_SEEDS_FILE))
    seeds.append(json.loads(path.read_text()))
    for public in workdir.rglob("*"):
      if public.is_file() and public.suffix in (".json", ".csv", ".md"):
        text = public.read_text()
        assert str(seeds[-1]["noise_seed"]) not in text and str(
            seeds[-1]["sampling_seed"]) not in text
  assert seeds[0] != seeds[1]  # drawn afresh, not derived from config.seed
  cfg.stop_after_steps = None
  train.train_and_evaluate(cfg, str(tmp_path / "a"), quiet=True)  # resume
  path = tmp_path / "a.secrets" / "logit_dp" / train.SECRET_SEEDS_FILE
  assert json.loads(path.read_text()) == seeds[0]


def test_privacy_seeds_of_a_run_started_with_the_old_layout_are_reused(tmp_path):
  """A run whose seed file sits in workdir/<method>/ (before secrets_dir) resumes with it."""
  cfg = tiny.get_config()
  cfg.privacy_seed = None
  legacy = tmp_path / "w" / "logit_dp"
  legacy.mkdir(parents=True)
  (legacy / train.SECRET_SEEDS_FILE).write_text(json.dumps(dict(noise_seed=5, sampling_seed=7)))
  assert train.privacy_seeds(cfg, str(tmp_path / "w"), "logit_dp") == (5, 7)
  cfg.secrets_dir = str(tmp_path / "elsewhere")
  first = train.privacy_seeds(cfg, str(tmp_path / "v"), "naive_dp")
  assert (tmp_path / "elsewhere" / "naive_dp" / train.SECRET_SEEDS_FILE).exists()
  assert train.privacy_seeds(cfg, str(tmp_path / "v"), "naive_dp") == first


@pytest.mark.extended
def test_private_train_loss_only_as_labelled_diagnostic(tmp_path):
  cfg = tiny.get_config()
  cfg.methods = ("non_private",)
  cfg.log_private_train_loss = True
  train.train_and_evaluate(cfg, str(tmp_path), quiet=True)
  with open(os.path.join(tmp_path, "non_private", "metrics.csv")) as f:
    header = next(csv.reader(f))
  assert "train_loss_NONPRIVATE_diagnostic" in header


# Slow: tiny training runs; the statistics themselves are tested by test_clip_stats and, sharded,
# by test_distributed.
@pytest.mark.slow
@pytest.mark.parametrize("method,num_devices", [("logit_dp", 1), ("naive_dp", 2)])
def test_clip_stats_only_as_labelled_diagnostics(tmp_path, method, num_devices):
  cfg = tiny.get_config()
  cfg.methods = (method,)
  cfg.num_devices = num_devices
  cfg.log_clip_stats = True
  cfg.log_every, cfg.stop_after_steps = 1, 2
  record = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)[method]
  assert record["steps"] == 2
  with open(os.path.join(tmp_path, method, "metrics.csv")) as f:
    rows = list(csv.DictReader(f))
  assert [int(r["step"]) for r in rows] == [0, 1, 2]
  for row in rows[1:]:
    assert 0.0 <= float(row["fraction_clipped_NONPRIVATE_diagnostic"]) <= 1.0
    assert float(row["median_norm_NONPRIVATE_diagnostic"]) > 0.0


@pytest.mark.slow  # a second pipeline run; train_head and standardize are tested below
def test_finetune_on_frozen_encoders(pretrained, tmp_path):
  workdir, _ = pretrained
  cfg = tiny_finetune.get_config()
  cfg.pretrain_workdir = workdir
  results = finetuning.finetune_and_evaluate(cfg, str(tmp_path), quiet=True)
  assert set(results) == {"logit_dp", "naive_dp", "non_private"}
  for r in results.values():
    assert 0.0 <= r["accuracy"] <= 1.0
  assert os.path.exists(os.path.join(tmp_path, "confusion_matrices.png"))
  with open(os.path.join(tmp_path, "results.json")) as f:
    saved = json.load(f)
  assert saved["logit_dp"]["epsilon"] == pytest.approx(results["logit_dp"]["epsilon"])


@pytest.mark.slow  # a tiny training run and a head
def test_head_on_standardised_embeddings(tmp_path):
  """Standardising uses the train split's statistics; it rescues embeddings with a large offset.

  Four well-separated 8-d clusters, then a common offset of 30 and a scale of 20, the shape of
  a private encoder's output. The head must learn them once standardised.
  """
  rng = np.random.default_rng(0)
  centres = rng.normal(size=(4, 8))
  y_tr, y_te = rng.integers(0, 4, 800), rng.integers(0, 4, 200)
  offset = 30.0 * np.ones(8)
  e_tr = 20.0 * (centres[y_tr] + 0.1 * rng.normal(size=(800, 8))) + offset
  e_te = 20.0 * (centres[y_te] + 0.1 * rng.normal(size=(200, 8))) + offset
  s_tr, s_te = finetuning.standardize(e_tr, e_te)
  np.testing.assert_allclose(s_tr.mean(0), 0.0, atol=1e-9)
  np.testing.assert_allclose(s_tr.std(0), 1.0, rtol=1e-9)
  np.testing.assert_allclose(s_te, (e_te - e_tr.mean(0)) / e_tr.std(0), rtol=1e-12)
  cfg = tiny_finetune.get_config()
  assert cfg.standardize_embeddings
  cfg.num_epochs = 5
  _, pred = finetuning.train_head(cfg, e_tr, y_tr, e_te, 4, str(tmp_path / "m.csv"), y_te=y_te)
  assert np.mean(pred == y_te) > 0.95


@pytest.mark.slow  # subprocesses; tests/benchmarks/test_gpu_scripts.py runs pretrain.py too
def test_scripts_from_the_command_line(pretrained, tmp_path):
  """Both absl entry points, as a user runs them (cheap settings)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([
      sys.executable, "experiments/pretrain.py", "--config=experiments/configs/tiny.py",
      f"--workdir={tmp_path / 'pre'}", "--config.methods=('non_private',)"
  ], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "Non-private" in out.stdout and "| method |" in out.stdout
  workdir, _ = pretrained
  out = subprocess.run([
      sys.executable, "experiments/finetune.py", "--config=experiments/configs/tiny_finetune.py",
      f"--config.pretrain_workdir={workdir}", f"--workdir={tmp_path / 'ft'}",
      "--config.methods=('logit_dp','non_private')"
  ], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "head acc" in out.stdout and "Logit-DP" in out.stdout


def test_default_config_is_the_offline_digits_demo():
  cfg = default_config.get_config()
  assert cfg.data.source == "digits"
  assert tuple(cfg.methods) == ("logit_dp", "naive_dp", "non_private")
  assert cfg.model.name == "embedding_net" and cfg.target_epsilon == 5.0


@pytest.mark.parametrize(
    "name",
    ["cifar10_embedding_net", "cifar10_resnet18", "cifar10_embedding_net_cpu", "cifar100_finetune"])
def test_paper_configs(name):
  import importlib
  cfg = importlib.import_module(f"experiments.configs.{name}").get_config()
  if name == "cifar100_finetune":
    assert (cfg.batch_size, cfg.num_epochs, cfg.learning_rate) == (400, 10, 1e-2)
    assert tuple(cfg.head_hidden) == (64, 32) and cfg.data.label == "coarse"
    return
  assert cfg.data.source == "npz" and cfg.data.name == "cifar10" and cfg.target_epsilon == 5.0
  lrs = dict(cfg.learning_rates)
  # The paper's learning rates (its appendix, "Experiment Details").
  if name == "cifar10_resnet18":
    assert lrs == dict(logit_dp=1e-4, naive_dp=1e-3, non_private=1e-2)
  else:
    assert lrs == dict(logit_dp=1e-2, naive_dp=1e-2, non_private=1e-3)
  if name == "cifar10_embedding_net":
    assert (cfg.batch_size, cfg.num_epochs) == (10_000, 20)
  if name == "cifar10_resnet18":
    assert (cfg.batch_size, cfg.num_epochs, cfg.model.name) == (1_000, 2, "resnet18")


@pytest.mark.slow
def test_cifar_embedding_net_smoke(tmp_path):
  d = os.environ.get("LOGIT_DP_CIFAR_DIR")
  if not d or not os.path.exists(os.path.join(d, "cifar10.npz")):
    pytest.skip(
        "set LOGIT_DP_CIFAR_DIR to a folder made by `python -m experiments.cifar --out DIR`")
  from experiments.configs import cifar10_embedding_net
  cfg = cifar10_embedding_net.get_config()
  cfg.data.npz_dir = d
  cfg.data.train_subset, cfg.data.test_subset = 2000, 500
  cfg.batch_size, cfg.num_epochs, cfg.clip_method = 200, 1, "triangle"
  cfg.eval_batch_size, cfg.eval_num_batches = 200, 1
  results = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)
  assert all(r["finished"] for r in results.values())


@pytest.mark.slow  # another tiny training run; the augmentations are tested in test_data
def test_augment_pair_mode_trains(tmp_path):
  """The unsupervised mode: two on-device augmentations of each image, one record per image."""
  cfg = tiny.get_config()
  cfg.methods = ("non_private",)
  cfg.pair_mode = "augment"
  cfg.data.train_subset = 128
  cfg.batch_size = 32
  cfg.linear_probe = False
  r = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)["non_private"]
  assert r["finished"] and r["total_steps"] == 128 // 32  # one record per image


@pytest.mark.slow  # two more tiny runs; DP-GCL's gradient and 2B are tested in test_grouped
def test_dp_gcl_trains_privately_beside_the_other_methods(pretrained, tmp_path):
  """The grouped baseline: Poisson batches, σ of the same accountant (same ε), noise σ·2B,
  groups hashed from the record ids, extra augmented views; a resume reproduces it."""
  _, ref = pretrained
  cfg = tiny.get_config()
  cfg.methods = ("dp_gcl",)
  cfg.dp_gcl.group_size = 4
  cfg.dp_gcl.extra_views = 2
  result = train.train_and_evaluate(cfg, str(tmp_path / "a"), quiet=True)["dp_gcl"]
  assert result["finished"] and result["total_steps"] == ref["logit_dp"]["total_steps"]
  assert result["noise_multiplier"] == ref["logit_dp"]["noise_multiplier"] > 0
  assert 0.9 * cfg.target_epsilon < result["epsilon"] <= cfg.target_epsilon
  assert result["sensitivity"] == logit_dp.baselines.grouped_sensitivity(
      cfg.clip_norm) == 2 * cfg.clip_norm
  assert train.dp_gcl_num_groups(cfg) == 8  # round(32 / 4)
  assert 0.0 <= result["accuracy"] <= 1.0 and 0.0 <= result["linear_probe"] <= 1.0
  initial = train.get_model(cfg.model)[3](train._keys(cfg.seed)["init"],
                                          np.zeros((1, 8, 8, 1), np.float32))
  assert not _params_equal(result["params"], initial)  # it trained
  cfg.stop_after_steps = 3
  first = train.train_and_evaluate(cfg, str(tmp_path / "b"), quiet=True)["dp_gcl"]
  assert not first["finished"]
  cfg.stop_after_steps = None
  second = train.train_and_evaluate(cfg, str(tmp_path / "b"), quiet=True)["dp_gcl"]
  assert _params_equal(second["params"], result["params"])
  for bad in (dict(group_size=0.0), dict(extra_views=-1)):
    cfg = tiny.get_config()
    cfg.methods = ("dp_gcl",)
    cfg.dp_gcl.update(bad)
    with pytest.raises(ValueError, match="dp_gcl"):
      train.train_and_evaluate(cfg, str(tmp_path / "bad"), quiet=True)


def test_a_run_started_before_the_dp_gcl_config_resumes(tmp_path):
  """config.json files written before config.dp_gcl existed still match today's config."""
  cfg = tiny.get_config()
  save_config_started_before(cfg, tmp_path, "dp_gcl")
  train.check_resumable(cfg, str(tmp_path))
  cfg.learning_rates.logit_dp = 0.5
  with pytest.raises(ValueError, match="different training config"):
    train.check_resumable(cfg, str(tmp_path))


@pytest.mark.slow  # the tiny pipeline run (pretrained); the library's steps are tested in tests/
def test_embedding_geometry_of_a_finished_run(pretrained):
  """The diagnostic's statistics against a direct computation on the run's own encoders."""
  from experiments import data as data_lib  # pylint: disable=g-import-not-at-top
  from experiments import embedding_geometry  # pylint: disable=g-import-not-at-top
  workdir, results = pretrained
  report = embedding_geometry.measure(workdir, n=30)
  assert set(report) == {"untrained", "logit_dp", "naive_dp", "non_private"}
  cfg = tiny.get_config()
  x = data_lib.to_float(data_lib.load_dataset(cfg.data, seed=cfg.seed)["x_test"][:30])
  e = np.asarray(train.get_model(cfg.model)[1](results["non_private"]["params"], x), np.float64)
  cos = [
      np.dot(e[i], e[j]) / np.linalg.norm(e[i]) / np.linalg.norm(e[j]) for i in range(30)
      for j in range(30) if i != j
  ]
  row = report["non_private"]
  np.testing.assert_allclose(row["mean_cosine"], np.mean(cos), rtol=1e-6)
  np.testing.assert_allclose(row["min_cosine"], np.min(cos), rtol=1e-6)
  np.testing.assert_allclose(row["median_norm"], np.median(np.linalg.norm(e, axis=1)), rtol=1e-6)
  assert row["last_test_loss"] == results["non_private"]["history"][-1]["test_loss"]


def test_embedding_geometry_limits():
  from experiments import embedding_geometry  # pylint: disable=g-import-not-at-top
  same = embedding_geometry.geometry(np.tile([[3.0, 4.0]], (5, 1)))
  assert same["mean_cosine"] == pytest.approx(1) and same["mean_direction_norm"] == pytest.approx(1)
  assert same["centred_energy"] == pytest.approx(0) and same["median_norm"] == pytest.approx(5)
  spread = embedding_geometry.geometry(np.eye(4))
  assert spread["mean_cosine"] == pytest.approx(0) and spread["mean_direction_norm"] == 0.5
  assert spread["centred_energy"] == pytest.approx(0.75)  # ‖I − J/4‖²_F / ‖I‖²_F = 3/4
  with pytest.raises(ValueError, match="norm 0"):
    embedding_geometry.geometry(np.array([[1.0, 0.0], [0.0, 0.0]]))
  with pytest.raises(ValueError, match="n >= 2"):
    embedding_geometry.geometry(np.ones((1, 3)))


def test_geometry_block_renders_every_method_of_every_report(tmp_path):
  from experiments import embedding_geometry  # pylint: disable=g-import-not-at-top
  from experiments import render_results  # pylint: disable=g-import-not-at-top
  row = embedding_geometry.geometry(np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 2.0]]))
  for run, loss in (("a_s0", 4.6), ("b_s0", None)):
    os.makedirs(tmp_path / run)
    methods = {
        "untrained": row, "logit_dp": dict(row, **({"last_test_loss": loss} if loss else {}))
    }
    with open(tmp_path / run / "geometry.json", "w") as f:
      json.dump(dict(workdir=run, n=3, methods=methods), f)
  text = ("<!-- generated:geometry:a_s0/geometry.json,b_s0/geometry.json -->\n"
          "<!-- /generated:geometry:a_s0/geometry.json,b_s0/geometry.json -->")
  body = render_results.render(text, {}, None, str(tmp_path))
  lines = [line for line in body.splitlines() if line.startswith(("| a_s0", "| b_s0"))]
  assert len(lines) == 4
  # cosines 0.6, 0, 0.8: mean 0.4667, min 0; ‖ū‖ = ‖(1.6, 1.8)/3‖ = 0.8028
  assert "| a_s0 | Logit-DP | 1 | 0.4667 | +0.000 | 0.8028 |" in body and "| 4.6000 |" in body
  assert lines[3].endswith("| – |")
  missing = ("<!-- generated:geometry:c_s0/geometry.json -->\n"
             "<!-- /generated:geometry:c_s0/geometry.json -->")
  assert "not computed yet" in render_results.render(missing, {}, None, str(tmp_path))
  with open(tmp_path / "b_s0" / "geometry.json", "w") as f:
    json.dump(dict(workdir="b_s0", n=4, methods={"untrained": row}), f)
  with pytest.raises(ValueError, match="different numbers of test images"):
    render_results.render(text, {}, None, str(tmp_path))


# -- Loud where it matters: finished workdirs, progress, non-finite rows. --------------------


@pytest.mark.slow  # the tiny pipeline run (pretrained); the library's steps are tested in tests/
def test_rerunning_a_finished_workdir_says_nothing_to_do(pretrained, capsys):
  workdir, results = pretrained
  table = os.path.join(workdir, "results.md")
  before = os.stat(table).st_mtime_ns
  capsys.readouterr()
  again = train.train_and_evaluate(tiny.get_config(), workdir)
  out = capsys.readouterr().out
  assert f"{workdir}: finished, nothing to do" in out
  assert "resumed from step" not in out and os.stat(table).st_mtime_ns == before
  assert set(again) == set(results)
  for m in results:
    assert again[m]["accuracy"] == results[m]["accuracy"]
    assert again[m]["epsilon"] == results[m]["epsilon"]


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_progress_says_compiling_and_prints_plain_lines_without_a_terminal():
  piped = io.StringIO()
  progress = train.Progress("Logit-DP", total=6, start=2, stream=piped)
  for step in range(3, 7):
    progress.update(step)
    if step % 2 == 0:
      progress.log(step, {"ε": "1.5"})
  progress.close()
  lines = piped.getvalue().splitlines()
  assert "\r" not in piped.getvalue()
  assert lines == [
      "[Logit-DP] step 3/6: compiling the training step (the first step also runs it)",
      "[Logit-DP] step 3/6: compiled and ran the first step",
      "[Logit-DP] step 4/6  ε 1.5",
      "[Logit-DP] step 6/6  ε 1.5",
  ]
  # On a terminal: the same first line, then a tqdm bar that starts after the compiled step
  # (so its rate and ETA do not include the compilation).
  terminal = _Terminal()
  progress = train.Progress("Logit-DP", total=6, start=2, stream=terminal)
  assert progress.bar is None and "compiling" in terminal.getvalue()
  progress.update(3)
  assert progress.bar is not None and progress.bar.n == 3
  progress.update(4)
  assert progress.bar.n == 4
  progress.close()
  assert "\r" in terminal.getvalue()
  # Quiet, or nothing left to train: silent.
  silent = io.StringIO()
  train.Progress("Logit-DP", total=6, start=6, stream=silent).update(7)
  train.Progress("Logit-DP", total=6, start=0, enabled=False, stream=silent).update(1)
  assert silent.getvalue() == ""


@pytest.mark.parametrize("policy", ["warn", "error"])
@pytest.mark.slow
def test_non_finite_rows_are_reported(tmp_path, policy):
  cfg = tiny.get_config()
  cfg.methods = ("naive_dp",)
  cfg.stop_after_steps = 2
  cfg.on_nonfinite_rows = policy
  ds = train.data_lib.load_dataset(cfg.data, seed=cfg.seed)
  pairs = train.data_lib.make_pairs(ds["y_train"], cfg.pair_mode, cfg.seed)
  ds["x_train"] = ds["x_train"].astype(np.float32)
  ds["x_train"][pairs[1::2, 0]] = np.nan  # the anchors of every other record
  if policy == "warn":
    with pytest.warns(logit_dp.NonFiniteRowsWarning, match="non-finite"):
      record = train.train_method(cfg, "naive_dp", ds, pairs, str(tmp_path), quiet=True)
    assert record["dropped_pairs"] > 0 and record["steps"] == 2
  else:
    with pytest.raises(FloatingPointError, match="on_nonfinite_rows='error'"):
      train.train_method(cfg, "naive_dp", ds, pairs, str(tmp_path), quiet=True)


def test_compilation_cache_flag_sets_the_persistent_cache(tmp_path):
  """--compilation_cache_dir: by default <workdir>/.jax_cache, a directory of its own when
  given, off when empty; pretrain.py, finetune.py and clip.py set it before training."""
  import ast  # pylint: disable=g-import-not-at-top

  from experiments import compilation_cache  # pylint: disable=g-import-not-at-top
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  before = {name: getattr(jax.config, name) for name in names}
  try:
    workdir = str(tmp_path / "run")
    assert compilation_cache.enable(workdir) == os.path.join(workdir, ".jax_cache")
    assert jax.config.jax_compilation_cache_dir == os.path.join(workdir, ".jax_cache")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
    shared = str(tmp_path / "shared")
    assert compilation_cache.enable(workdir, shared) == shared
    assert jax.config.jax_compilation_cache_dir == shared
    jax.config.update("jax_compilation_cache_dir", None)
    assert compilation_cache.enable(workdir, "") is None
    assert jax.config.jax_compilation_cache_dir is None
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  for script, trains in (("pretrain", "train_and_evaluate"), ("finetune", "finetune_and_evaluate"),
                         ("clip", "run")):
    with open(os.path.join(root, "experiments", f"{script}.py"), encoding="utf-8") as f:
      main = next(node for node in ast.parse(f.read()).body
                  if isinstance(node, ast.FunctionDef) and node.name == "main")
    calls = [ast.unparse(node.func) for node in ast.walk(main) if isinstance(node, ast.Call)]
    enabled = calls.index("compilation_cache.enable_from_flags")
    assert any(call.endswith(trains) for call in calls[enabled + 1:]), script


# -- The private two-tower benchmark (experiments/clip_benchmark.py). -----------------------


def _scripted_clip_trainer(calls, fail_at=None):
  """`helpers.scripted_trainer` whose zero-shot top-1 peaks at learning rate 3e-2 (private) /
  1e-2 (non-private), with an offset per mechanism and seed."""
  offsets = dict(logit_dp=0.02, dp_gcl=0.05, naive_dp=0.0, non_private=0.2)

  def method_results(cfg, method):
    lr = cfg.learning_rates[method]
    best = 1e-2 if method == "non_private" else 3e-2
    top1 = 0.3 - 0.05 * abs(np.log10(lr / best)) + offsets[method] + 0.01 * cfg.seed
    r = dict(steps=4, train_seconds=1.0, learning_rate=lr, temperature=cfg.temperature,
             zero_shot_top1=top1, zero_shot_top5=top1 + 0.3)
    if method != "non_private":
      r.update(epsilon=cfg.target_epsilon * 0.99, delta=1e-5,
               noise_multiplier=1.0 / cfg.target_epsilon, sampling_rate=0.25,
               clip_norm=cfg.clip_norm)
      if method == "dp_gcl":
        r.update(group_size=cfg.dp_gcl.group_size)
    return r

  return scripted_trainer(calls, method_results, fail_at)


def test_clip_benchmark_searches_then_runs_resumably_and_tabulates(tmp_path):
  """The one command: each mechanism's search on the public data (at each ε), then every
  mechanism × ε × seed with its own choice; an interrupted call resumes without retraining
  what finished; Δ against DP-GCL paired by seed; no machine path in the published files."""
  from experiments import clip_benchmark
  from experiments.configs import clip_benchmark_tiny

  config = clip_benchmark_tiny.get_config()
  config.epsilons = (1.0, 8.0)
  config.seeds = (0, 1, 2)
  config.grids.learning_rate = (0.3, 3.0)  # base 1e-2 (non-private 3e-3): 3e-3, 3e-2
  for base in (config.search_base, config.benchmark_base):
    base.learning_rates.update(dict(logit_dp=1e-2, dp_gcl=1e-2, naive_dp=1e-2, non_private=3e-3))
  runs, results = str(tmp_path / "runs"), str(tmp_path / "docs")
  data_dir = str(tmp_path / "machine" / "cifar")
  calls = []
  with pytest.raises(KeyboardInterrupt):
    clip_benchmark.run_all(config, runs, results, data_dir,
                           train_fn=_scripted_clip_trainer(calls, fail_at=9))
  interrupted = list(calls)
  calls.clear()
  out = clip_benchmark.run_all(config, runs, results, data_dir,
                               train_fn=_scripted_clip_trainer(calls))
  assert out["complete"] and not out["waiting"]
  # 7 searches of 3 candidates (the non-private one once), then 3 × 2 × 3 + 3 runs.
  assert len(set(interrupted[:-1]) & set(calls)) == 0  # finished candidates are not retrained
  assert len(interrupted) - 1 + len(calls) == 7 * 3 + 21
  for name, choice in out["chosen"].items():
    method = name.split("_eps")[0]
    want = 3e-2 if method != "non_private" else 9e-3  # the scripted optimum on the grid
    assert choice["overrides"] == {f"learning_rates.{method}": want}, name
  search_dirs = [c for c in interrupted[:-1] + calls if os.sep + "search" + os.sep in c]
  assert len(search_dirs) == 21
  for c in search_dirs:
    with open(os.path.join(c, "config.json")) as f:
      assert json.load(f)["data"]["name"] != "cifar10"  # the search never sees CIFAR-10
  bench = sorted(os.listdir(os.path.join(results, "clip_benchmark")))
  assert len([b for b in bench if os.path.isdir(os.path.join(results, "clip_benchmark", b))]) == 21
  # A second call trains nothing and writes the same table.
  calls.clear()
  again = clip_benchmark.run_all(config, runs, results, data_dir,
                                 train_fn=_scripted_clip_trainer(calls))
  assert calls == [] and again["table"] == out["table"]
  # Δ top-1 of Logit-DP against DP-GCL: offsets 0.02 − 0.05 at every seed, std 0.
  row = next(line for line in out["table"].splitlines() if line.startswith("| Logit-DP | 7.92"))
  assert "-0.030 ± 0.000 (3)" in row and "lr 0.03" in row
  assert "| DP-GCL | 0.99 |" in out["table"]
  non_private = [line for line in out["table"].splitlines() if line.startswith("| Non-private")]
  delta = 0.2 - 0.05 * abs(np.log10(9e-3 / 1e-2)) - 0.05  # its lr 9e-3 is off the peak
  assert len(non_private) == 2 and f"{delta:+.3f} ± 0.000 (3)" in non_private[0]
  for dirpath, _, files in os.walk(results):
    for name in files:
      with open(os.path.join(dirpath, name)) as f:
        text = f.read()
      assert str(tmp_path) not in text, os.path.join(dirpath, name)
  from experiments import render_results
  name = "clip_benchmark:clip_benchmark"
  block = f"<!-- generated:{name} -->\n<!-- /generated:{name} -->\n"
  assert out["table"] in render_results.render(block, {}, None, results)


def test_clip_benchmark_refuses_bad_configs():
  from experiments import clip_benchmark
  from experiments.configs import clip_benchmark as full

  config = full.get_config()
  config.search_base.data.name = "cifar10"
  with pytest.raises(ValueError, match="public data"):
    clip_benchmark.check_config(config)
  config = full.get_config()
  config.search_base.clip_norm = 1.0
  with pytest.raises(ValueError, match="clip_norm"):
    clip_benchmark.check_config(config)
  config = full.get_config()
  config.mechanisms = ("logit_dp", "naive_dp")
  with pytest.raises(ValueError, match="dp_gcl"):
    clip_benchmark.check_config(config)
  config = full.get_config()
  config.mechanisms = ("logit_dp", "dp_gcl", "dpsgd")
  with pytest.raises(ValueError, match="unknown"):
    clip_benchmark.check_config(config)
  # Every private mechanism gets the same number of candidates.
  counts = {
      m: sum(len(s["candidates"]) for s in clip_benchmark.search_stages(full.get_config(), m))
      for m in ("logit_dp", "dp_gcl", "naive_dp")
  }
  assert set(counts.values()) == {9}


@pytest.mark.slow  # four tiny two-tower trainings (~2 min on 2 CPU cores)
def test_clip_trains_every_mechanism_with_two_towers_and_resumes(tmp_path):
  """Logit-DP, DP-GCL, Naive-DP (make_private, each its own C) and non-private on the tiny
  synthetic two towers; a re-run keeps the finished methods, and a private run with its
  results removed resumes from its last checkpoint (the final step) without training."""
  from experiments import clip
  from experiments.configs import clip_benchmark_tiny

  config = clip_benchmark_tiny.get_config().benchmark_base
  config.methods = ("logit_dp", "dp_gcl", "naive_dp", "non_private")
  config.checkpoint_every = 2
  config.data.label_names = os.path.join(REPO, "experiments", "label_names", "cifar10.json")
  workdir = str(tmp_path / "run")
  results = clip.run(config, workdir, quiet=True)["methods"]
  tau_c = 2 * (1 + np.exp(2.0)) * config.clip_norm
  assert results["logit_dp"]["sensitivity"] == pytest.approx(tau_c, rel=1e-3)
  assert results["dp_gcl"]["sensitivity"] == results["naive_dp"][
      "sensitivity"] == 2 * config.clip_norm
  assert results["dp_gcl"]["num_groups"] == 4  # round(16 / 4)
  for m in ("logit_dp", "dp_gcl", "naive_dp"):
    assert 0 < results[m]["epsilon"] <= config.target_epsilon and results[m]["steps"] == 4
  with open(os.path.join(workdir, "config.json")) as f:
    text = f.read()
  assert REPO not in text and str(tmp_path) not in text
  again = clip.run(config, workdir, quiet=True)["methods"]
  assert again == results
  kept = {m: r for m, r in results.items() if m != "dp_gcl"}
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(dict(num_records=64, num_test=50, num_classes=10, methods=kept), f)
  resumed = clip.run(config, workdir, quiet=True)["methods"]["dp_gcl"]
  assert resumed["resumed_at_step"] == 4
  assert resumed["zero_shot_top1"] == results["dp_gcl"]["zero_shot_top1"]


def test_results_files_record_no_machine_path():
  """docs/results holds no absolute path (data folders, workdirs, commands)."""
  import re
  absolute = re.compile(r"(?<![\w.~-])/(work|home|Users|tmp|mnt|data|root|var)/")
  offenders = []
  for dirpath, _, files in os.walk(os.path.join(REPO, "docs", "results")):
    for name in files:
      if name.endswith((".json", ".md")):
        with open(os.path.join(dirpath, name)) as f:
          if absolute.search(f.read()):
            offenders.append(os.path.relpath(os.path.join(dirpath, name), REPO))
  assert offenders == []


def test_shareable_config_and_command():
  from experiments import workdirs
  config = dict(data=dict(npz_dir="/srv/cifar", name="cifar10", label_names="/a/b/names.json"),
                pretrain_workdir="/x/y/runs/cifar10_embnet_s0", text_template="a photo of a {}")
  assert workdirs.shareable_config(config) == dict(
      data=dict(npz_dir=None, name="cifar10", label_names="names.json"),
      pretrain_workdir="runs/cifar10_embnet_s0", text_template="a photo of a {}")
  assert workdirs.shareable_command(
      "/opt/r/experiments/pretrain.py --config=/opt/r/experiments/configs/x.py "
      "--config.data.npz_dir=/srv/cifar --workdir=/opt/r/runs/x_s0") == (
          "experiments/pretrain.py --config=experiments/configs/x.py "
          "--config.data.npz_dir=DIR --workdir=runs/x_s0")

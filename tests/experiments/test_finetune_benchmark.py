"""The private fine-tuning benchmark (experiments/finetune_benchmark.py): end to end at a tiny size,
and its table from scripted results."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest  # noqa: E402


@pytest.mark.slow  # 13 tiny two-tower runs (pretraining, 6 searches, 6 benchmark runs): minutes
def test_finetune_benchmark_pretrains_searches_fine_tunes_and_tabulates(tmp_path):
  """The one command at a tiny size (synthetic CIFAR-shaped images, real training): public
  pretraining with its params saved, every variant's search on public data, the fine-tuning runs
  starting from the pretrained params (every parameter or the heads only), the table; a second
  call trains nothing; no machine path in the published files."""
  from experiments import clip
  from experiments import finetune_benchmark
  from experiments.configs import finetune_benchmark_tiny

  config = finetune_benchmark_tiny.get_config()
  runs, results = str(tmp_path / "runs"), str(tmp_path / "docs")
  calls = []

  def train_fn(cfg, workdir, quiet=True):
    calls.append((workdir, json.loads(cfg.to_json_best_effort())))
    return clip.train_and_evaluate(cfg, workdir, quiet=quiet)

  out = finetune_benchmark.run_all(config, runs, results, train_fn=train_fn)
  assert out["complete"]
  assert os.path.isdir(finetune_benchmark.pretrained_params(runs))
  # Pretraining, then 3 variants × (2 searches of one candidate + 2 benchmark runs).
  assert len(calls) == 1 + 3 * 4
  pretraining, *others = calls
  assert pretraining[1]["data"]["name"] == "cifar100" and pretraining[1]["save_params"]
  for workdir, cfg in others:
    variant = os.path.relpath(workdir, runs).split(os.sep)[0]
    if os.sep + "search" + os.sep in workdir:
      assert cfg["data"]["name"] != "cifar10"  # no choice sees CIFAR-10
    assert (cfg["init_from"] is None) == (variant == "scratch")
    assert cfg["trainable"] == ("heads" if variant == "heads" else "all")
  table = out["table"]
  assert "| DP-GCL | 8 | " in table and "| Non-private | ∞ | " in table
  for question in ("How much of the gap", "Does training fewer parameters help",
                   "Does it change which mechanism"):
    assert question in table
  with open(os.path.join(results, "finetune_benchmark", "benchmark.md")) as f:
    assert f.read().strip() == table.strip()

  calls.clear()
  again = finetune_benchmark.run_all(config, runs, results, train_fn=train_fn)
  assert calls == [] and again["table"] == table
  for dirpath, _, files in os.walk(results):
    for name in files:
      with open(os.path.join(dirpath, name)) as f:
        assert str(tmp_path) not in f.read(), os.path.join(dirpath, name)
  from experiments import render_results
  name = "finetune_benchmark:finetune_benchmark"
  block = f"<!-- generated:{name} -->\n<!-- /generated:{name} -->\n"
  assert table in render_results.render(block, {}, None, results)


def _record(variant, method, epsilon, seed, top1):
  return dict(variant=variant, method=method, epsilon=epsilon, seed=seed, num_classes=10,
              result=dict(zero_shot_top1=top1), choice={})


@pytest.mark.extended
def test_finetune_benchmark_table_answers_the_three_questions():
  """The shares, paired differences and rankings of the table, recomputed by hand."""
  from experiments import finetune_benchmark

  top1 = {
      ("scratch", "dp_gcl"): 0.20,
      ("all", "dp_gcl"): 0.30,
      ("heads", "dp_gcl"): 0.35,
      ("scratch", "logit_dp"): 0.10,
      ("all", "logit_dp"): 0.25,
      ("heads", "logit_dp"): 0.40,
  }
  records = []
  for seed in (0, 1, 2):
    for (variant, method), value in top1.items():
      records.append(_record(variant, method, 8.0, seed, value + 0.01 * seed))
    for variant, value in (("scratch", 0.30), ("all", 0.40), ("heads", 0.36)):
      records.append(_record(variant, "non_private", None, seed, value + 0.01 * seed))
  table = finetune_benchmark.benchmark_table(records)
  # Share closed against non-private fine-tuning of every parameter (0.41 on average):
  # DP-GCL (0.31 − 0.21) / (0.41 − 0.21) = 0.50 and (0.36 − 0.21) / 0.20 = 0.75.
  assert "| DP-GCL | 8 | +0.200 | 0.50 | 0.75 |" in table
  assert "| Logit-DP | 8 | +0.300 | 0.50 | 1.00 |" in table
  assert "| DP-GCL | 8 | +0.050 ± 0.000 (3) |" in table  # heads − all
  assert "| Non-private | ∞ | -0.040 ± 0.000 (3) |" in table
  assert "| from scratch | 8 | DP-GCL > Logit-DP | Logit-DP -0.100 ± 0.000 (3) |" in table
  assert "| pretrained, heads only | 8 | Logit-DP > DP-GCL | Logit-DP +0.050 ± 0.000 (3) |" in table
  assert finetune_benchmark.benchmark_table([]).startswith("(no finished")


@pytest.mark.extended
def test_finetune_benchmark_refuses_bad_configs():
  from experiments import finetune_benchmark
  from experiments.configs import finetune_benchmark_tiny

  config = finetune_benchmark_tiny.get_config()
  config.variants = ("scratch", "lora")
  with pytest.raises(ValueError, match="variant"):
    finetune_benchmark.check_config(config)
  config = finetune_benchmark_tiny.get_config()
  config.pretrain.data.name = "cifar10"
  with pytest.raises(ValueError, match="public"):
    finetune_benchmark.check_config(config)
  config = finetune_benchmark_tiny.get_config()
  config.search_base.vocabulary_from = ("cifar10",)
  with pytest.raises(ValueError, match="vocabulary_from"):
    finetune_benchmark.check_config(config)
  from experiments.configs import finetune_benchmark as full_size
  finetune_benchmark.check_config(finetune_benchmark_tiny.get_config())
  finetune_benchmark.check_config(full_size.get_config())

"""Tests of the paper-scale experiment tooling: configs at tiny size, the results renderer."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json
import re
import subprocess

import jax
import numpy as np
import pytest
from scipy import stats

import logit_dp
from experiments import data as data_lib
from experiments import render_results
from experiments import train
from experiments.configs import cifar10_embedding_net_paper_hparams
from experiments.configs import cifar10_embedding_net_projected
from experiments.configs import cifar10_embedding_net_triangle
from experiments.configs import cifar10_resnet18
from experiments.configs import cifar10_resnet18_cpu
from experiments.configs import tiny

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny_like(config):
  """``config`` on 300 digits with a small batch: keeps its methods' settings (B, lr, clipping)."""
  small = tiny.get_config()
  config.data = small.data
  config.batch_size = 32
  config.num_epochs = 1
  config.microbatch_size = None
  config.eval_batch_size = None
  config.eval_num_batches = 1
  config.privacy_seed = 0
  config.progress = False
  config.stop_after_steps = 2
  config.target_epsilon = 8.0
  return config


# ---------------------------------------------------------------------------
# Configs.


@pytest.mark.slow  # calibrates σ of three paper-size configs
def test_paper_size_configs_have_the_papers_sampling_rate_and_steps():
  # CIFAR-10: 50,000 train images -> 25,000 disjoint same-class pair records.
  pairs = data_lib.same_class_pairs(np.repeat(np.arange(10), 5000), seed=0)
  for cfg in (cifar10_embedding_net_triangle.get_config(),
              cifar10_embedding_net_paper_hparams.get_config()):
    plan = train.privacy_plan(cfg, len(pairs))
    assert len(pairs) == 25_000 and plan["sampling_rate"] == 0.4 and plan["steps"] == 50
    assert cfg.clip_method == "triangle"
  # ResNet-18 CPU subset: q and T of the paper's batch 1,000 of 25,000, 2 epochs.
  cfg = cifar10_resnet18_cpu.get_config()
  paper = train.privacy_plan(cifar10_resnet18.get_config(), 25_000)
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 10, cfg.data.train_subset)
  plan = train.privacy_plan(cfg, len(data_lib.same_class_pairs(labels, 0)))
  assert paper["steps"] == plan["steps"] == 50
  assert abs(plan["sampling_rate"] - paper["sampling_rate"]) < 1e-3
  assert cfg.model.name == "resnet18" and cfg.model.norm == "none"


@pytest.mark.slow  # five gradient compilations; test_experiments checks the default config's C
def test_paper_hparams_config_clips_each_method_with_its_own_bound():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  cfg = cifar10_embedding_net_paper_hparams.get_config()
  cfg.model = tiny.get_config().model
  cfg.microbatch_size = None
  cfg.noise_multiplier = 1.0  # skips the accountant's calibration (not what is tested here)
  model, apply_fn, _, _ = train.get_model(cfg.model)
  x, xp = jax.random.uniform(jax.random.PRNGKey(1), (2, 6, 8, 8, 1))
  params = model.init(jax.random.PRNGKey(0), x)
  mask = jnp.ones(6, bool)
  loss = train.make_loss(cfg)
  key = jax.random.PRNGKey(2)
  want = dict(logit_dp=logit_dp.clipped_grad(apply_fn, loss, clip_norm=1e-5, method="triangle"),
              naive_dp=logit_dp.baselines.naive_clipped_grad(apply_fn, loss, clip_norm=1e-4))
  sens = dict(logit_dp=logit_dp.sensitivity(loss, 1e-5, batch_size=None), naive_dp=2e-4)
  for m in ("logit_dp", "naive_dp"):
    grad_fn, _, info = train.make_method(cfg, m, apply_fn, 25_000, key)
    assert info["clip_norm"] == cfg.clip_norms[m]
    np.testing.assert_allclose(info["sensitivity"], sens[m], rtol=1e-12)
    got, ref = grad_fn(params, x, xp, mask)[1], want[m](params, x, xp, mask)[1]
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
  # The bound binds: with B = 1 the same batch gives another (larger) clipped gradient.
  big = logit_dp.clipped_grad(apply_fn, loss, clip_norm=1.0, method="triangle")(params, x, xp,
                                                                                mask)[1]
  norm = lambda t: float(jnp.sqrt(sum(jnp.sum(leaf ** 2) for leaf in jax.tree_util.tree_leaves(t))))
  assert norm(big) > 10 * norm(want["logit_dp"](params, x, xp, mask)[1])


@pytest.mark.slow
def test_resnet18_cpu_config_trains_at_tiny_size(tmp_path):
  cfg = _tiny_like(cifar10_resnet18_cpu.get_config())
  cfg.model.width = 4
  cfg.data.train_subset = 64
  cfg.batch_size = 8
  cfg.microbatch_size = 4
  cfg.stop_after_steps = 1
  res = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)
  for m in cfg.methods:
    assert res[m]["steps"] == (0 if m == train.UNTRAINED else 1)
  assert res["logit_dp"]["learning_rate"] == 1e-4


@pytest.mark.slow  # a tiny training run with projected clipping (test_projected: the library's)
def test_projected_config_trains_at_tiny_size_with_public_reference_inputs(tmp_path):
  cfg = _tiny_like(cifar10_embedding_net_projected.get_config())
  cfg.methods = ("logit_dp",)
  cfg.model = tiny.get_config().model
  cfg.projection.split = "test"  # digits has one data set: its held-out split is the public one
  cfg.projection.num_reference = 4
  cfg.projection.rank = 8
  res = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)
  assert res["logit_dp"]["steps"] == 2 and cfg.clip_method == "projected"
  reference = train.reference_inputs(cfg)
  assert reference.shape[0] == 4 and float(reference.max()) <= 1.0
  cfg.projection.split = "train"
  with pytest.raises(ValueError, match="must be public"):
    train.reference_inputs(cfg)
  full = cifar10_embedding_net_projected.get_config()
  assert full.projection.reference == "cifar100" and full.data.name == "cifar10"


# ---------------------------------------------------------------------------
# Item 12: δ in the tables, labelled confusion matrices.


def test_format_table_prints_delta():
  row = dict(epsilon=4.99, delta=1.0007e-5, noise_multiplier=2.7, accuracy=0.2)
  table = train.format_table(dict(logit_dp=row, non_private=dict(row, delta=0.0, epsilon=0.0)))
  head, _, dp, nonpriv = table.splitlines()
  assert head.split(" | ")[2] == "δ"
  assert dp.split(" | ")[2] == "1e-05" and nonpriv.split(" | ")[2] == "–"


def test_confusion_matrix_plot_labels_every_class_and_has_a_colour_bar(tmp_path, monkeypatch):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  seen = {}
  monkeypatch.setattr(plt.Figure, "savefig",
                      lambda fig, path, **kw: seen.setdefault(os.path.basename(path), fig))
  cm = np.random.default_rng(0).integers(0, 9, (10, 10))
  names = data_lib.class_names(dict(name="cifar10", label="fine"), 10)
  train.plot_results(dict(logit_dp=dict(confusion_matrix=cm, accuracy=0.3)), str(tmp_path), names)
  fig = seen["confusion_matrices.png"]
  ax, cbar = fig.axes  # the matrix and its colour bar
  assert [t.get_text() for t in ax.get_xticklabels()] == names
  assert [t.get_text() for t in ax.get_yticklabels()] == names
  assert cbar.get_ylabel() == "fraction of the true class"
  assert data_lib.class_names(dict(name="cifar100", label="coarse"), 20)[0] == "aquatic mammals"
  assert data_lib.class_names(dict(name="digits"), 10) == [str(c) for c in range(10)]


# ---------------------------------------------------------------------------
# Renderer.


def _fake_runs(root, group, seeds, rng):
  """Results folders of ``group_s<seed>`` with random metrics (the renderer's input format)."""
  for s in seeds:
    d = root / f"{group}_s{s}"
    d.mkdir(parents=True)
    res = {}
    for m in render_results.METHODS:
      r = {k: float(rng.uniform(0.1, 0.5)) for k in render_results.METRICS}
      r.update(method=m, finished=True, train_seconds=float(rng.uniform(10, 100)),
               learning_rate=1e-2, noise_multiplier=0.0 if m == "non_private" else 2.7,
               epsilon=0.0 if m == "non_private" else 4.99, delta=1e-5, steps=50, sampling_rate=0.4,
               clip_norm=None if m == "non_private" else 1.0)
      res[m] = r
    (d / "results.json").write_text(json.dumps(res))
    (d / "config.json").write_text(json.dumps(dict(seed=s, batch_size=10_000, clip_norm=1.0)))
    (d / "wallclock.json").write_text(
        json.dumps(dict(attempts=[dict(seconds=600.0, returncode=0)], total_seconds=600.0)))


def _cells(text, first):
  """The cells of the table row of ``text`` that starts with ``first``."""
  for line in text.splitlines():
    if line.startswith(first):
      return [c.strip() for c in line.strip("|").split("|")]
  raise AssertionError(f"no row {first!r} in\n{text}")


def _assert_tables_well_formed(text):
  """Every row of every markdown table in ``text`` has as many cells as its header (an escaped
  ``\\|`` is not a cell border)."""
  width = None
  for line in text.splitlines():
    if not line.startswith("|"):
      width = None
      continue
    cells = len(re.split(r"(?<!\\)\|", line.strip()[1:-1]))
    if width is None:
      width = cells
    assert cells == width, f"{cells} cells, header {width}: {line}"


@pytest.mark.parametrize("doc", [
    "README.md", "BUILD.md",
    *(f"docs/{f}" for f in sorted(os.listdir(os.path.join(REPO, "docs"))) if f.endswith(".md"))
])
def test_committed_docs_tables_are_well_formed(doc):
  with open(os.path.join(REPO, doc), encoding="utf-8") as f:
    _assert_tables_well_formed(f.read())


def test_renderer_means_stds_relative_and_paired_differences(tmp_path):
  rng = np.random.default_rng(0)
  _fake_runs(tmp_path / "results", "cifar10_embnet_x", (0, 1, 2), rng)
  runs = render_results.load_runs(str(tmp_path / "results"))
  paper = render_results.load_paper(os.path.join(REPO, "experiments", "paper_results.json"))
  doc = ("# t\n<!-- generated:group:cifar10_embnet_x -->\nstale\n"
         "<!-- /generated:group:cifar10_embnet_x -->\n"
         "<!-- generated:verdict -->\n<!-- /generated:verdict -->\n"
         "<!-- generated:runs -->\n<!-- /generated:runs -->\n")
  out = render_results.render(doc, runs, paper)
  assert "stale" not in out and out.startswith("# t\n")
  assert render_results.render(out, runs, paper) == out  # idempotent
  _assert_tables_well_formed(out)
  res = [runs[f"cifar10_embnet_x_s{s}"]["results"] for s in (0, 1, 2)]

  def ms(v):
    return f"{np.mean(v):.3f} ± {np.std(v, ddof=1):.3f}"

  row = _cells(out, "| Logit-DP | ours")
  assert row[2] == "4.99" and row[3] == "1e-05"
  acc = [r["logit_dp"]["accuracy"] for r in res]
  rel = [r["logit_dp"]["linear_probe"] / r["non_private"]["linear_probe"] for r in res]
  assert row[4] == ms(acc) and row[13] == ms(rel)
  # The paper's numbers come from the data file, beside ours.
  prow = _cells(out, "| Logit-DP | paper")
  absolute = paper["cifar10_absolute_mean_std"]["embedding_net"]["logit_dp"][0]
  assert prow[4] == f"{absolute[0]:.3f} ± {absolute[1]:.3f}"
  assert prow[9] == f"{paper['cifar10_relative']['embedding_net']['logit_dp'][0]:.3f}"
  # Paired difference = scipy's paired t-test.
  a, b = acc, [r["naive_dp"]["accuracy"] for r in res]
  t, p = stats.ttest_rel(a, b)
  vrow = _cells(out, "| cifar10_embnet_x | Logit-DP − Naive-DP")
  d = np.subtract(a, b)
  assert vrow[2] == f"{d.mean():+.4f} ± {d.std(ddof=1):.4f}"
  assert vrow[4] == f"{t:.2f}" and vrow[5] == f"{p:.2g}"
  run_row = _cells(out, "| cifar10_embnet_x_s2")
  assert run_row[2] == "600" and run_row[7] == f"{res[2]['non_private']['train_seconds']:,.0f}"
  # The untrained encoder: ε = 0, and each DP method's gain over it, paired by seed.
  assert _cells(out, "| Untrained (init) | ours")[2:4] == ["0", "0"]
  d = np.subtract(a, [r["untrained"]["accuracy"] for r in res])
  urow = _cells(out, "| cifar10_embnet_x | Logit-DP − Untrained (init)")
  assert urow[2] == f"{d.mean():+.4f} ± {d.std(ddof=1):.4f}" and urow[7] == "–"


def test_renderer_refuses_to_pool_seeds_of_different_mechanisms(tmp_path):
  rng = np.random.default_rng(0)
  _fake_runs(tmp_path / "results", "cifar10_embnet_x", (0, 1), rng)
  assert set(render_results.groups_of(render_results.load_runs(str(tmp_path / "results"))))
  path = tmp_path / "results" / "cifar10_embnet_x_s1" / "results.json"
  res = json.loads(path.read_text())
  res["logit_dp"]["noise_multiplier"] = 2.70816  # σ calibrated at δ − the overflow term
  path.write_text(json.dumps(res))
  with pytest.raises(ValueError, match="differ in noise_multiplier.*delta_includes_overflow"):
    render_results.groups_of(render_results.load_runs(str(tmp_path / "results")))


def test_privacy_cell_rounds_the_bounds_up():
  """ε and δ are upper bounds: .3g would print 1.0140008e-5 as 1.01e-05 and 2.0004 as 2."""
  def run(eps, delta):
    return dict(results=dict(logit_dp=dict(epsilon=eps, delta=delta)))

  runs = [run(4.9988, 1.0000012e-5), run(4.9990, 1.0140008e-5)]
  assert render_results.privacy_cell(runs, "logit_dp") == ("5", "1.02e-05")
  assert render_results.privacy_cell([run(2.0004, 1e-5)], "logit_dp") == ("2.01", "1e-05")
  assert render_results.privacy_cell([run(4.99, 9.99999e-6)], "logit_dp") == ("4.99", "1e-05")


def test_paper_rows_match_the_papers_model():
  """Each group is set beside the paper's table of its own model, and none where it has none."""
  paper = render_results.load_paper(os.path.join(REPO, "experiments", "paper_results.json"))
  cases = {
      "cifar10_embnet_triangle": paper["cifar10_absolute_mean_std"]["embedding_net"],
      "cifar10_resnet18_cpu": paper["cifar10_absolute_mean_std"]["resnet18"],
      "cifar100_ft_triangle": paper["cifar100_finetune_absolute"],
  }
  for group, table in cases.items():
    rows = render_results.paper_rows(paper, group)
    assert rows is not None and rows["logit_dp"]["abs"][0][0] == np.ravel(
        table["logit_dp"][0])[0], group
  # The paper fine-tunes only the embedding net: no paper row beside a ResNet-18 fine-tuning.
  assert render_results.paper_rows(paper, "cifar100_ft_resnet18_cpu") is None
  assert render_results.paper_rows(paper, "digits_default") is None


def test_runs_table_marks_a_wallclock_below_the_training_time():
  def run(wall, trained):
    results = {m: dict(train_seconds=s) for m, s in zip(render_results.TRAINED, trained)}
    return dict(seed=0, results=results, wallclock=dict(attempts=[dict(seconds=wall)],
                                                        total_seconds=wall))

  out = render_results.runs_table(
      {"whole": run(500.0, [100.0, 200.0, 150.0, 40.0]), "killed": run(537.0, [1847.0])})
  assert _cells(out, "| whole")[2] == "500" and _cells(out, "| killed")[2] == "537 †"
  assert "† Less than the training alone" in out
  assert "†" not in render_results.runs_table({"whole": run(500.0, [100.0])})


def test_render_check_mode(tmp_path):
  out = tmp_path / "doc.md"
  out.write_text("<!-- generated:runs -->\n<!-- /generated:runs -->\n")
  args = [
      sys.executable, "-m", "experiments.render_results", "--check", f"--out={out}",
      f"--results_dir={tmp_path}"
  ]
  assert subprocess.run(args, cwd=REPO, capture_output=True).returncode == 1  # out of date
  assert subprocess.run(args[:3] + args[4:], cwd=REPO, capture_output=True).returncode == 0
  assert subprocess.run(args, cwd=REPO, capture_output=True).returncode == 0  # rendered


def test_tuned_config_is_ready_only_when_the_search_has_finished(tmp_path):
  from experiments import tune  # pylint: disable=g-import-not-at-top
  from experiments.configs import cifar10_embedding_net_tuned  # pylint: disable=g-import-not-at-top
  path = tmp_path / "search.json"
  assert not cifar10_embedding_net_tuned.ready(str(path))
  path.write_text(json.dumps(dict(complete=False)))
  assert not cifar10_embedding_net_tuned.ready(str(path))
  path.write_text(json.dumps(dict(complete=True, chosen=None)))
  assert cifar10_embedding_net_tuned.ready(str(path)) and tune.search_finished(str(path))
  with pytest.raises(ValueError, match="has not finished"):  # ready, but nothing to run: loud
    cifar10_embedding_net_tuned.get_config(str(path))


def _render_two_groups(tmp_path, block: str, seed: int):
  """Fake seeds 0-2 of group a and 1-3 of group b (seeds 1, 2 in common), the block
  ``<block>:a:b`` rendered, and the runs."""
  rng = np.random.default_rng(seed)
  _fake_runs(tmp_path, "cifar10_embnet_a", (0, 1, 2), rng)
  _fake_runs(tmp_path, "cifar10_embnet_b", (1, 2, 3), rng)
  runs = render_results.load_runs(str(tmp_path))
  name = f"{block}:cifar10_embnet_a:cifar10_embnet_b"
  return render_results.render(f"<!-- generated:{name} -->\n<!-- /generated:{name} -->\n", runs,
                               None), runs


def _assert_paired_cells(cells, runs, method_a, method_b, metric):
  """cells = [Δ, n, t, p] of a table row: the paired difference of ``metric`` between
  method_a of group a and method_b of group b over the common seeds 1, 2."""
  a = [runs[f"cifar10_embnet_a_s{s}"]["results"][method_a][metric] for s in (1, 2)]
  b = [runs[f"cifar10_embnet_b_s{s}"]["results"][method_b][metric] for s in (1, 2)]
  d = np.subtract(a, b)
  t, p = stats.ttest_rel(a, b)
  assert cells[0] == f"{d.mean():.4f} ± {d.std(ddof=1):.4f}" and cells[1] == "2"
  assert cells[2] == f"{t:.2f}" and cells[3] == f"{p:.2g}"


def test_renderer_compare_block_pairs_seeds_of_two_configurations(tmp_path):
  out, runs = _render_two_groups(tmp_path, "compare", seed=1)
  row = _cells(out, "| Naive-DP | best F_β")
  _assert_paired_cells(row[4:8], runs, "naive_dp", "naive_dp", "best_fbeta")


def test_renderer_versus_block_pairs_every_method_of_a_with_every_method_of_b(tmp_path):
  out, runs = _render_two_groups(tmp_path, "versus", seed=2)
  row = _cells(out, "| Logit-DP | Naive-DP | 3-NN acc")
  _assert_paired_cells(row[5:9], runs, "logit_dp", "naive_dp", "accuracy")


def _set_clip_method(results, group, seeds, method):
  for s in seeds:
    path = results / f"{group}_s{s}" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "clip_method": method}))


def _render_bound_block(results, a, b):
  block = f"bound:{a}:{b}"
  return render_results.render(f"<!-- generated:{block} -->\n<!-- /generated:{block} -->\n",
                               render_results.load_runs(str(results)), None)


def test_renderer_bound_block_compares_ghost_and_triangle_logit_dp_seed_by_seed(tmp_path):
  """One exact-norm seed beside three triangle seeds: only the shared seed is shown, every
  metric with ghost − triangle, and the training seconds with their ratio."""
  rng = np.random.default_rng(3)
  _fake_runs(tmp_path / "results", "cifar10_embnet_ghost", (1,), rng)
  _fake_runs(tmp_path / "results", "cifar10_embnet_triangle", (0, 1, 2), rng)
  _set_clip_method(tmp_path / "results", "cifar10_embnet_ghost", (1,), "ghost")
  _set_clip_method(tmp_path / "results", "cifar10_embnet_triangle", (0, 1, 2), "triangle")
  runs = render_results.load_runs(str(tmp_path / "results"))
  out = _render_bound_block(tmp_path / "results", "cifar10_embnet_ghost", "cifar10_embnet_triangle")
  _assert_tables_well_formed(out)
  assert ("| seed | metric | ghost (exact norms) | triangle (upper bound) | ghost − triangle |"
          in out)
  ghost = runs["cifar10_embnet_ghost_s1"]["results"]["logit_dp"]
  tri = runs["cifar10_embnet_triangle_s1"]["results"]["logit_dp"]
  row = _cells(out, "| 1 | linear probe")
  assert row[2:] == [
      f"{ghost['linear_probe']:.4f}", f"{tri['linear_probe']:.4f}",
      f"{ghost['linear_probe'] - tri['linear_probe']:+.4f}"
  ]
  row = _cells(out, "| 1 | Logit-DP train s")
  assert row[4] == f"×{ghost['train_seconds'] / tri['train_seconds']:,.1f}"
  assert "| 0 |" not in out and "| 2 |" not in out
  assert len([r for r in out.splitlines() if r.startswith("| 1 |")
             ]) == len(render_results.METRICS) + 1


def test_renderer_bound_block_names_columns_by_clip_method_and_refuses_mixed_groups(tmp_path):
  """The same block against the projected bound is headed by that method; a group whose seeds
  ran different clip methods is refused rather than compared as one."""
  rng = np.random.default_rng(4)
  results = tmp_path / "results"
  _fake_runs(results, "cifar10_embnet_ghost", (0,), rng)
  _fake_runs(results, "cifar10_embnet_projected", (0, 1), rng)
  _set_clip_method(results, "cifar10_embnet_ghost", (0,), "ghost")
  _set_clip_method(results, "cifar10_embnet_projected", (0, 1), "projected")
  out = _render_bound_block(results, "cifar10_embnet_ghost", "cifar10_embnet_projected")
  assert ("| ghost (exact norms) | projected (upper bound) | ghost − projected |" in out)
  _set_clip_method(results, "cifar10_embnet_projected", (1,), "triangle")
  with pytest.raises(ValueError, match="several clip methods"):
    _render_bound_block(results, "cifar10_embnet_ghost", "cifar10_embnet_projected")


def test_paired_by_seed_keeps_only_seeds_where_both_sides_have_the_metric():
  def run(seed, **methods):
    return dict(seed=seed, results={m: dict(accuracy=v) for m, v in methods.items()})

  a_runs = [run(3, logit_dp=0.3), run(1, logit_dp=0.1), run(2, logit_dp=0.2), run(5)]
  b_runs = [
      run(2, naive_dp=0.25),
      run(1, naive_dp=0.15),
      run(4, naive_dp=0.4),
      run(5, naive_dp=0.5)
  ]
  b_runs[1]["results"]["naive_dp"]["linear_probe"] = 0.9
  assert render_results.paired_by_seed(a_runs, "logit_dp", b_runs, "naive_dp",
                                       "accuracy") == ([0.1, 0.2], [0.15, 0.25])
  assert render_results.paired_by_seed(a_runs, "logit_dp", b_runs, "naive_dp",
                                       "linear_probe") == ([], [])


def test_pair_norm_summary():
  from experiments import pair_norms
  v = np.random.default_rng(0).lognormal(size=(50, 50))
  s = pair_norms.norm_summary(v)
  assert s["q50"] == pytest.approx(np.median(v))
  assert s["clipped_at_1"] == pytest.approx(np.count_nonzero(v > 1) / v.size)
  assert s["clipped_at_1e-05"] == 1.0


def test_renderer_figures(tmp_path):
  rng = np.random.default_rng(2)
  _fake_runs(tmp_path, "cifar10_embnet_f", (0, 1), rng)
  for s in (0, 1):
    path = tmp_path / f"cifar10_embnet_f_s{s}" / "results.json"
    res = json.loads(path.read_text())
    for r in res.values():
      r["history"] = [dict(epoch=e, test_loss=float(rng.uniform(6, 7))) for e in range(5)]
      r["confusion_matrix"] = rng.integers(0, 5, (10, 10)).tolist()
    res.update(num_classes=10, example_text="a photo of a cat")  # run-level, as the CLIP run's
    path.write_text(json.dumps(res))
  groups = render_results.groups_of(render_results.load_runs(str(tmp_path)))
  written = render_results.plot_group("cifar10_embnet_f", groups["cifar10_embnet_f"],
                                      str(tmp_path / "figures"))
  assert sorted(os.path.basename(p) for p in written) == [
      "cifar10_embnet_f_confusion_s0.png", "cifar10_embnet_f_relative_loss.png"
  ]
  assert all(os.path.getsize(p) > 0 for p in written)
  assert sorted(os.listdir(tmp_path / "figures")) == sorted(os.path.basename(p) for p in written)


def test_renderer_zero_shot_block_averages_the_two_tower_seeds(tmp_path):
  """The zero_shot block of experiments/clip.py runs: mean ± std (ddof 1) over seeds of each
  method, the largest ε and δ of the seeds, chance from the class count."""
  rng = np.random.default_rng(0)
  top1 = {}
  for seed in (0, 1, 2):
    top1[seed] = (float(rng.uniform(0.1, 0.3)), float(rng.uniform(0.2, 0.4)))
    private = dict(epsilon=7.98 + 0.001 * seed, delta=1e-5, steps=100, noise_multiplier=0.61,
                   clip_norm=1e-3, train_seconds=600.0 + seed, zero_shot_top1=top1[seed][0],
                   zero_shot_top5=0.6)
    results = dict(
        num_classes=10, num_records=50_000, num_test=2_000, methods=dict(
            logit_dp=private, non_private=dict(steps=100, train_seconds=30.0,
                                               zero_shot_top1=top1[seed][1], zero_shot_top5=0.8)))
    run_dir = tmp_path / f"clip_cifar10_s{seed}"
    run_dir.mkdir()
    (run_dir / "results.json").write_text(json.dumps(results))
  runs = render_results.load_runs(str(tmp_path))
  out = render_results.render(
      "<!-- generated:zero_shot:clip_cifar10 -->\n"
      "<!-- /generated:zero_shot:clip_cifar10 -->\n", runs, None)
  assert "chance 0.1 (top-1), 0.5 (top-5)" in out
  for column, label in ((0, "| Logit-DP, two towers"), (1, "| Non-private")):
    values = [top1[s][column] for s in (0, 1, 2)]
    cells = _cells(out, label)
    assert cells[6] == f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"
  assert _cells(out, "| Logit-DP, two towers")[1:6] == ["7.98", "1e-05", "100", "0.61", "0.001"]
  with pytest.raises(ValueError, match="differ in noise_multiplier"):
    bad = json.loads((tmp_path / "clip_cifar10_s2" / "results.json").read_text())
    bad["methods"]["logit_dp"]["noise_multiplier"] = 0.7
    (tmp_path / "clip_cifar10_s2" / "results.json").write_text(json.dumps(bad))
    render_results.zero_shot_table(
        render_results.groups_of(render_results.load_runs(str(tmp_path)))["clip_cifar10"])

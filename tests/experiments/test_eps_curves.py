"""Accuracy-vs-ε curves: the renderer's curve block and figure, and the curve run configs."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json
import re
import subprocess

import matplotlib.image
import numpy as np
import pytest

from experiments import render_results
from experiments import train
from experiments.configs import cifar10_embedding_net_dpgcl
from experiments.configs import cifar10_embedding_net_triangle
from experiments.configs import tiny

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = "cifar10_embnet:5=cifar10_embnet_triangle"
DOC = f"# t\n<!-- generated:curve:{SPEC} -->\n<!-- /generated:curve:{SPEC} -->\n"
ALL = ("logit_dp", "naive_dp", "dp_gcl", "non_private")


def _certified_delta(target_epsilon, seed, method):
  """The target δ plus an overflow term (1 + e^ε)·T·p_over (T = 50, p_over = 1e-12), varied by
  seed and method so that the largest one is the one to report."""
  if method == "non_private":
    return 0.0
  return 1e-5 + (1 + np.exp(target_epsilon)) * 50 * 1e-12 * (1 + seed + (method == "dp_gcl"))


def _write_runs(root, group, seeds, methods, target_epsilon, rng):
  """Results folders of ``group_s<seed>`` (the renderer's input format), random metrics."""
  for s in seeds:
    d = root / f"{group}_s{s}"
    d.mkdir(parents=True)
    res = {
        m:
            dict(method=m, finished=True, accuracy=float(rng.uniform(0.1, 0.3)),
                 linear_probe=float(rng.uniform(0.2, 0.4)),
                 epsilon=0.0 if m == "non_private" else target_epsilon * 0.999,
                 delta=_certified_delta(target_epsilon, s, m)) for m in methods
    }
    (d / "results.json").write_text(json.dumps(res))
    (d / "config.json").write_text(json.dumps(dict(seed=s, target_epsilon=target_epsilon)))


@pytest.fixture()
def curve_runs(tmp_path):
  rng = np.random.default_rng(0)
  root = tmp_path / "results"
  _write_runs(root, "cifar10_embnet_eps1", (0, 1, 2), ALL, 1.0, rng)
  _write_runs(root, "cifar10_embnet_eps2", (0, 1), ALL, 2.0, rng)
  _write_runs(root, "cifar10_embnet_eps2", (2,), ("logit_dp",), 2.0, rng)  # one method only
  _write_runs(root, "cifar10_embnet_eps5", (0, 1, 2), ("dp_gcl",), 5.0, rng)
  _write_runs(root, "cifar10_embnet_triangle", (0, 1, 2, 3),
              ("logit_dp", "naive_dp", "non_private"), 5.0, rng)
  # No ε = 8 group: its column is empty.
  return root, render_results.load_runs(str(root))


def _values(runs, group, method, key):
  return [
      r["results"][method][key] for r in runs.values()
      if r["group"] == group and method in r["results"]
  ]


def _cell(values):
  if len(values) == 1:
    return f"{values[0]:.3f} (1)"
  return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f} ({len(values)})"


def _row(text, method, metric):
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if cells[:2] == [method, metric]:
      return cells[2:]
  raise AssertionError(f"no row {method} / {metric} in\n{text}")


def test_curve_table_means_stds_sources_and_gaps(curve_runs):
  root, runs = curve_runs
  paper = render_results.load_paper(os.path.join(REPO, "experiments", "paper_results.json"))
  out = render_results.render(DOC, runs, paper, str(root))
  assert render_results.render(out, runs, paper, str(root)) == out  # idempotent
  header = next(line for line in out.splitlines() if line.startswith("| method"))
  assert "ε = 1 | ε = 2 | ε = 5 | ε = 8 | paper" in header
  where = {1: "cifar10_embnet_eps1", 2: "cifar10_embnet_eps2", 5: "cifar10_embnet_triangle"}
  for m in ALL:
    for key, label in (("accuracy", "3-NN acc"), ("linear_probe", "linear probe")):
      row = _row(out, render_results.LABELS[m], label)
      for i, e in enumerate((1, 2, 5)):
        group = "cifar10_embnet_eps5" if (m == "dp_gcl" and e == 5) else where[e]
        assert row[i] == _cell(_values(runs, group, m, key)), (m, key, e)
      assert row[3] == "–"  # ε = 8: no run
  # Seeds 0, 1 (all methods) and seed 2 (Logit-DP only) at ε = 2.
  assert _row(out, "Logit-DP", "3-NN acc")[1].endswith("(3)")
  assert _row(out, "Naive-DP", "3-NN acc")[1].endswith("(2)")
  # The paper's ε = 5 points, 3-NN only; none for DP-GCL.
  absolute = paper["cifar10_absolute_mean_std"]["embedding_net"]
  assert _row(out, "Logit-DP", "3-NN acc")[4] == "{:.3f} ± {:.3f}".format(*absolute["logit_dp"][0])
  assert _row(out, "Non-private",
              "3-NN acc")[4] == "{:.3f} ± {:.3f}".format(*absolute["non_private"][0])
  assert _row(out, "DP-GCL", "3-NN acc")[4] == "–"
  assert _row(out, "Logit-DP", "linear probe")[4] == "–"
  assert ("ε = 5: `cifar10_embnet_triangle` (Logit-DP, Naive-DP, Non-private; seeds 0, 1, 2, 3); "
          "ε = 5: `cifar10_embnet_eps5` (DP-GCL; seeds 0, 1, 2)") in out
  assert "no finished run" not in out
  # The certified δ of each point: the largest over the runs it uses, never the target alone.
  largest = {
      1: _certified_delta(1.0, 2, "dp_gcl"), 2: _certified_delta(2.0, 2, "logit_dp"),
      5: _certified_delta(5.0, 3, "logit_dp")
  }
  footer = re.search(
      r"Certified δ \(the largest over a point's runs: the target δ plus the padded "
      r"Poisson batch's overflow term \(1 \+ e\^ε\)·\(1 − \(1 − p_over\)\^T\)\): "
      r"ε = 1: ≤ (\S+), ε = 2: ≤ (\S+), ε = 5: ≤ (\S+)\.", out)
  assert footer, out
  for e, printed in zip((1, 2, 5), footer.groups()):
    # Printed rounded up (a bound), to 4 significant digits.
    assert largest[e] <= float(printed) <= largest[e] * (1 + 1e-3), (e, printed, largest[e])
  assert render_results._round_up(1e-5) == "1e-05"
  assert render_results._round_up(1.01400807e-5) == "1.015e-05"
  assert render_results._round_up(1.01400807e-5, 3) == "1.02e-05"


def test_curve_differences_are_paired_by_seed_within_each_point(curve_runs):
  """Logit-DP − rival at each ε over the seeds both points have = scipy's paired t-test."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  root, runs = curve_runs
  out = render_results.render(DOC, runs, None, str(root))
  header = next(line for line in out.splitlines() if line.startswith("| 3-NN acc, paired"))
  assert header.endswith("| ε = 1 | ε = 2 | ε = 5 | ε = 8 |")

  def by_seed(group, method):
    return {
        r["seed"]: r["results"][method]["accuracy"] for r in runs.values()
        if r["group"] == group and method in r["results"]
    }

  sources = {  # (ε, method): group of the point
      (1, "logit_dp"): "cifar10_embnet_eps1", (1, "dp_gcl"): "cifar10_embnet_eps1",
      (1, "naive_dp"): "cifar10_embnet_eps1", (2, "logit_dp"): "cifar10_embnet_eps2",
      (2, "dp_gcl"): "cifar10_embnet_eps2", (2, "naive_dp"): "cifar10_embnet_eps2",
      (5, "logit_dp"): "cifar10_embnet_triangle", (5, "dp_gcl"): "cifar10_embnet_eps5",
      (5, "naive_dp"): "cifar10_embnet_triangle"
  }
  for rival, label in (("dp_gcl", "Logit-DP − DP-GCL"), ("naive_dp", "Logit-DP − Naive-DP")):
    row = next([c.strip() for c in line.strip("|").split("|")][1:] for line in out.splitlines()
               if line.startswith(f"| {label} |"))
    for i, e in enumerate((1, 2, 5)):
      a, b = by_seed(sources[(e, "logit_dp")], "logit_dp"), by_seed(sources[(e, rival)], rival)
      seeds = sorted(set(a) & set(b))  # ε = 2: seed 2 has Logit-DP only; ε = 5: DP-GCL 0-2
      assert len(seeds) == {1: 3, 2: 2, 5: 3 if rival == "dp_gcl" else 4}[e]
      d = np.subtract([a[s] for s in seeds], [b[s] for s in seeds])
      p = stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds]).pvalue
      assert row[i] == f"{d.mean():+.3f} ± {d.std(ddof=1):.3f} ({len(seeds)}), p = {p:.2g}"
    assert row[3] == "–"  # ε = 8: no run


def test_curve_with_no_run_says_so_and_rejects_a_mislabelled_run(curve_runs, tmp_path):
  root, runs = curve_runs
  out = render_results.render(DOC.replace("cifar10_embnet:", "cifar10_other:"), runs, None)
  assert "(no finished run of `cifar10_other_eps<ε>` yet)" in out
  assert _row(out, "DP-GCL", "3-NN acc") == ["–"] * 4 + ["–"]
  _write_runs(root, "cifar10_embnet_eps8", (0,), ALL, 5.0, np.random.default_rng(1))
  with pytest.raises(ValueError, match="target_epsilon = 5.0, not the ε = 8"):
    render_results.render(DOC, render_results.load_runs(str(root)), None)
  with pytest.raises(ValueError, match="is not <ε>=<group>"):
    render_results.parse_curve_spec("cifar10_embnet:cifar10_embnet_triangle")


def test_curve_band_and_no_figure_link_without_figures(curve_runs):
  root, runs = curve_runs
  paper = render_results.load_paper(os.path.join(REPO, "experiments", "paper_results.json"))
  data = render_results.curve_data(SPEC, render_results.groups_of(runs))
  # The band: one non-private value per seed, from the smallest ε that has the seed.
  band = render_results.epsilon_free_band(data, "accuracy")
  want = _values(runs, "cifar10_embnet_eps1", "non_private", "accuracy") + _values(
      runs, "cifar10_embnet_triangle", "non_private", "accuracy")[3:]
  assert band == want
  assert "![accuracy vs ε]" not in render_results.render(DOC, runs, paper, str(root))


@pytest.mark.extended  # a subprocess of the renderer; plot_curve is checked by the test below
def test_curve_figure_and_its_link(curve_runs):
  root, _ = curve_runs
  args = [
      sys.executable, "-m", "experiments.render_results", "--figures", f"--results_dir={root}",
      f"--out={root / 'doc.md'}"
  ]
  (root / "doc.md").write_text(DOC)
  r = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  path = root / "figures" / "cifar10_embnet_eps_curve.png"
  assert path.stat().st_size > 0 and f"wrote {path}" in r.stdout
  assert "![accuracy vs ε](results/figures/cifar10_embnet_eps_curve.png)" in (
      root / "doc.md").read_text()


def test_curve_figure_with_one_panel_at_a_given_path(curve_runs, tmp_path):
  """The README's figure: the 3-NN panel alone, where it is asked for, with the given title."""
  root, runs = curve_runs
  data = render_results.curve_data(SPEC, render_results.groups_of(runs))
  path = str(tmp_path / "front" / "figure.png")
  out = render_results.plot_curve(data, None, str(root), render_results.CURVE_METRICS[:1], path,
                                  "a title")
  assert out == path and os.path.getsize(path) > 0
  height, width = matplotlib.image.imread(path).shape[:2]
  assert width < 1.5 * height  # one panel (two are 9 × 3.6 inches)
  assert render_results.plot_curve(render_results.curve_data("cifar10_none:5=cifar10_none", {}),
                                   None, str(root), render_results.CURVE_METRICS[:1], path) is None


# ---------------------------------------------------------------------------
# The curve runs' config and the published runs.


def test_dpgcl_config_is_the_triangle_run_with_dp_gcl():
  cfg, ref = cifar10_embedding_net_dpgcl.get_config(), cifar10_embedding_net_triangle.get_config()
  assert tuple(cfg.methods) == ALL
  assert (cfg.dp_gcl.group_size, cfg.dp_gcl.extra_views, cfg.learning_rates.dp_gcl) == (8.0, 2,
                                                                                        1e-2)
  got, want = cfg.to_dict(), ref.to_dict()
  assert {k for k in got if got[k] != want[k]} == {"methods", "dp_gcl", "learning_rates"}
  assert {k: v for k, v in got["learning_rates"].items() if k != "dp_gcl"} == want["learning_rates"]
  cfg.batch_size = 10_000
  assert train.dp_gcl_num_groups(cfg) == 1_250


@pytest.mark.slow
def test_dpgcl_config_trains_every_method_at_tiny_size(tmp_path):
  cfg = cifar10_embedding_net_dpgcl.get_config()
  small = tiny.get_config()
  cfg.data, cfg.model = small.data, small.model
  cfg.batch_size, cfg.num_epochs, cfg.microbatch_size = 32, 1, None
  cfg.eval_batch_size, cfg.eval_num_batches, cfg.linear_probe = None, 1, False
  cfg.privacy_seed, cfg.progress, cfg.stop_after_steps = 0, False, 1
  cfg.noise_multiplier = 1.0  # σ fixed (ε = 1 would need hundreds of steps' worth of noise)
  cfg.target_epsilon, cfg.allow_exceeding_budget = 1.0, True
  res = train.train_and_evaluate(cfg, str(tmp_path), quiet=True)
  assert set(res) == set(ALL) and all(r["steps"] == 1 for r in res.values())
  assert res["dp_gcl"]["sensitivity"] == 2.0 and res["dp_gcl"]["learning_rate"] == 1e-2

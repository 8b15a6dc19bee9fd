r"""Renders every table of the results pages (docs/RESULTS.md, docs/results_in_detail.md) from
committed run results and the paper's numbers.

    python -m experiments.render_results            # rewrites the generated blocks in place
    python -m experiments.render_results --check    # exit 1 if a page is out of date

Inputs: ``docs/results/<run-name>/{config,results,wallclock}.json`` (copied there from a
finished run's folder) and ``experiments/paper_results.json`` (the paper's tables, with
the citation). Runs named ``<group>_s<seed>`` form a group; a metric of a group is
reported as mean ± std over its seeds (std with ddof = 1, as for n runs of the paper), and
each relative metric is m_seed / m_seed(non-private) averaged over seeds. Differences
between methods are paired by seed: Δ_s = m_s(A) − m_s(B), reported as mean ± std with the
paired t statistic t = mean(Δ) / (std(Δ) / √n) and its two-sided p-value.

In those pages a block ``<!-- generated:NAME -->`` … ``<!-- /generated:NAME -->`` is
replaced by the table NAME: ``runs`` (every run with its wall-clock), ``verdict``,
``group:<group>`` (ours beside the paper's), ``compare:<group a>:<group b>`` (same method and
seeds, two configurations), ``versus:<group a>:<group b>`` (every method of a against every
method of b, same seeds), ``bound:<ghost group>:<triangle group>``
(what the triangle bound costs, same seeds), ``pair_norms:<file in results_dir>`` (how much
B clips, from experiments/pair_norms.py), ``clip_bias:<file in results_dir>`` (what clipping
every pair does to ḡ, from experiments/clip_bias.py), ``signal_to_noise:<file in results_dir>``
(one step's clipped sum against its noise, from experiments/signal_to_noise.py),
``signal_to_noise_summary:<file>,<file>…`` (its SNR per method over several reports),
``contrast_snr:<file>,<file>…`` (contrast clipping's SNR against Logit-DP's, same reports),
``geometry:<file>,<file>…`` (how spread out the runs' test embeddings are, from
experiments/embedding_geometry.py),
``zero_shot:<group>`` (the two-tower runs of experiments/clip.py),
``clip_benchmark:<folder in results_dir>`` (the private two-tower benchmark of
experiments/clip_benchmark.py: every mechanism tuned on public data, Δ against DP-GCL),
``finetune_benchmark:<folder in results_dir>`` (private fine-tuning of pretrained towers, from
experiments/finetune_benchmark.py: every variant and mechanism, and its three answers),
``people_benchmark:<folder in results_dir>`` (privacy per person, experiments/people_benchmark.py:
group privacy against native person-level DP-GCL and Logit-DP, its default config),
``search:<folder in results_dir>`` (the
public-data search of experiments/tune.py, from its search.json) and
``curve:<prefix>[:<E>=<group>…]`` (3-NN accuracy and linear probe vs ε of the groups
``<prefix>_eps<E>``, an extra group per ε for the methods those lack; `parse_curve_spec`).
``--figures`` also draws each curve block's figure, ``results_dir/figures/<prefix>_eps_curve.png``,
and the README's, ``results_dir/figures/accuracy_vs_epsilon.png`` (`FRONT_CURVE`).
"""

from __future__ import annotations

import decimal
import json
import math
import os
import re
import sys
from typing import Any

import numpy as np
from absl import app
from absl import flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAINED = ("logit_dp", "naive_dp", "dp_gcl", "non_private")
METHODS = (*TRAINED, "untrained")
LABELS = {
    "logit_dp": "Logit-DP", "naive_dp": "Naive-DP", "dp_gcl": "DP-GCL",
    "non_private": "Non-private", "untrained": "Untrained (init)"
}
PRIVATE = ("logit_dp", "naive_dp", "dp_gcl")
# Our metric keys, in the paper's metric_order, then the linear probe (ours only).
METRICS = ("accuracy", "best_recall", "best_precision", "best_fbeta", "linear_probe")
METRIC_LABELS = ("acc", "best recall", "best precision", "best F_β", "linear probe")

# Which of the paper's tables a group is compared with: (absolute, relative) keys; the longest
# matching prefix decides, and None means the paper has no such table (its CIFAR-100
# fine-tuning is of the embedding net only).
PAPER_TABLES = {
    "cifar10_embnet": ("cifar10_absolute_mean_std.embedding_net", "cifar10_relative.embedding_net"),
    "cifar10_resnet18": ("cifar10_absolute_mean_std.resnet18", "cifar10_relative.resnet18"),
    "cifar100_ft_resnet18": None,
    "cifar100_ft": ("cifar100_finetune_absolute", "cifar100_finetune_relative"),
}
PAPER_METHOD_KEYS = {"non_private": ("non_private", "non_private_no_bn")}

_RUN_RE = re.compile(r"^(?P<group>.+)_s(?P<seed>\d+)$")

# ---------------------------------------------------------------------------
# Loading.


def load_runs(results_dir: str) -> dict[str, dict]:
  """{run name: dict(config, results, wallclock, group, seed)} of every finished run."""
  runs = {}
  for name in sorted(os.listdir(results_dir)):
    d = os.path.join(results_dir, name)
    rpath = os.path.join(d, "results.json")
    if not os.path.isfile(rpath):
      continue
    with open(rpath) as f:
      results = json.load(f)
    config = {}
    if os.path.exists(os.path.join(d, "config.json")):
      with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    wallclock = None
    if os.path.exists(os.path.join(d, "wallclock.json")):
      with open(os.path.join(d, "wallclock.json")) as f:
        wallclock = json.load(f)
    m = _RUN_RE.match(name)
    group, seed = (m["group"], int(m["seed"])) if m else (name, config.get("seed", 0))
    runs[name] = dict(name=name, config=config, results=results, wallclock=wallclock, group=group,
                      seed=seed)
  return runs


def groups_of(runs) -> dict[str, list[dict]]:
  """{group: runs sorted by seed}, pre-training groups first, then fine-tuning."""
  out: dict[str, list[dict]] = {}
  for r in runs.values():
    out.setdefault(r["group"], []).append(r)
  for g in out.values():
    g.sort(key=lambda r: r["seed"])
    check_one_mechanism(g)
    check_one_clip_method(g)
  return dict(sorted(out.items(), key=lambda kv: (kv[0].startswith("cifar100_ft"), kv[0])))


# What a method's privacy mechanism is (its δ follows from them and ε): seeds pooled in one
# group must share all of it.
MECHANISM_KEYS = ("noise_multiplier", "sampling_rate", "steps", "clip_norm")


def check_one_mechanism(group_runs) -> None:
  """ValueError if a method's seeds in one group ran different mechanisms (σ, q, T or B):
  a mean over them would pool two experiments (e.g. σ calibrated with and without
  delta_includes_overflow)."""
  for key in MECHANISM_KEYS:
    values: dict[str, dict[Any, list[str]]] = {}
    for r in group_runs:
      for method, res in r["results"].items():
        if isinstance(res, dict) and key in res:
          values.setdefault(method, {}).setdefault(res[key], []).append(r["name"])
    for method, seen in values.items():
      if len(seen) > 1:
        raise ValueError(
            f"group {group_runs[0]['group']!r}, {method}: its runs differ in {key} "
            f"({', '.join(f'{v!r}: {names}' for v, names in seen.items())}); seeds of one group "
            "must run one mechanism (a seed added to a group whose runs calibrated σ at the "
            "target δ needs --config.delta_includes_overflow=False).")


def check_one_clip_method(group_runs) -> None:
  """ValueError if one group's seeds ran different clip methods (config.clip_method): their
  mean would pool two estimators of the pair norms."""
  found = {r["config"].get("clip_method") for r in group_runs}
  if len(found) > 1:
    raise ValueError(f"group {group_runs[0]['group']!r} ran several clip methods: "
                     f"{sorted(map(str, found))}")


def load_paper(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def _dig(d, dotted):
  for k in dotted.split("."):
    d = d[k]
  return d


def paper_rows(paper, group: str):
  """{method: dict(abs=[(mean, std or None)] * 4, rel=[value] * 4)} of the paper's table,
  or None."""
  prefix = max((p for p in PAPER_TABLES if group.startswith(p)), key=len, default=None)
  keys = PAPER_TABLES[prefix] if prefix else None
  if keys is None:
    return None
  absolute, relative = _dig(paper, keys[0]), _dig(paper, keys[1])
  out = {}
  for m in METHODS:
    key = next((k for k in PAPER_METHOD_KEYS.get(m, (m,)) if k in absolute), None)
    if key is None:  # a row the paper does not have (DP-GCL, the untrained encoder)
      continue
    a = absolute[key]
    a = [tuple(v) if isinstance(v, list) else (v, None) for v in a]
    out[m] = dict(abs=a, rel=list(relative[m]), key=key)
  return out


# ---------------------------------------------------------------------------
# Statistics.


def mean_std(values) -> tuple:
  """(mean, sample std with ddof = 1; nan for one value)."""
  v = np.asarray(values, np.float64)
  return float(v.mean()), (float(v.std(ddof=1)) if v.size > 1 else float("nan"))


def relative(run_results: dict, method: str, metric: str) -> float | None:
  """m(method) / m(non-private) of one run (None if either is missing or m(non-private) = 0)."""
  r, ref = run_results.get(method, {}), run_results.get("non_private", {})
  if metric in r and ref.get(metric):
    return float(r[metric]) / float(ref[metric])
  return None


def paired_difference(a, b) -> dict[str, float]:
  """Δ_s = a_s − b_s over seeds: mean, std, n, t = mean / (std/√n), two-sided p (Student t, n−1)."""
  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  n = d.size
  mean, std = mean_std(d)
  t = p = float("nan")
  if n > 1 and std > 0:
    from scipy import stats  # pylint: disable=g-import-not-at-top
    t = mean / (std / math.sqrt(n))
    p = float(2 * stats.t.sf(abs(t), n - 1))
  return dict(mean=mean, std=std, n=n, t=t, p=p)


def values_by_seed(runs, method, metric) -> dict:
  """{seed: metric of ``method``} over the runs that have it."""
  return {
      r["seed"]: float(r["results"][method][metric]) for r in runs
      if r["results"].get(method, {}).get(metric) is not None
  }


def paired_by_seed(a_runs, a_method, b_runs, b_method, metric) -> tuple[list, list]:
  """The metric of a_method in a_runs and of b_method in b_runs over the seeds both have, in
  seed order: the two samples of `paired_difference`. Every paired table is built on this."""
  va = values_by_seed(a_runs, a_method, metric)
  vb = values_by_seed(b_runs, b_method, metric)
  seeds = sorted(va.keys() & vb.keys())
  return [va[s] for s in seeds], [vb[s] for s in seeds]


def method_values(group_runs, method, metric, rel=False):
  """The metric of ``method`` in every run of the group that has it (relative if ``rel``)."""
  out = []
  for run in group_runs:
    res = run["results"]
    if rel:
      v = relative(res, method, metric)
    else:
      v = res.get(method, {}).get(metric)
    if v is not None:
      out.append(float(v))
  return out


# ---------------------------------------------------------------------------
# Formatting.


def fmt_ms(mean, std, digits=3) -> str:
  if mean is None or mean != mean:
    return "–"
  if std is None or std != std:
    return f"{mean:.{digits}f}"
  return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _fmt_t_p(d: dict) -> tuple[str, str]:
  """The t statistic and p-value of `paired_difference`, "–" where undefined (n < 2, std 0)."""
  t = "–" if d["t"] != d["t"] else f"{d['t']:.2f}"
  p = "–" if d["p"] != d["p"] else f"{d['p']:.2g}"
  return t, p


def _fmt_num(x) -> str:
  return "–" if x is None or x != x else f"{x:.3g}"  # x != x: NaN (e.g. the std of one seed)


def _lr_b(run, method):
  cfg = run["config"]
  res = run["results"].get(method, {})
  b = res.get("clip_norm")
  if b is None and method != "non_private":
    b = (cfg.get("clip_norms") or {}).get(method, cfg.get("clip_norm"))
  return res.get("learning_rate"), b


def settings_line(group_runs) -> str:
  """Seeds, data size, batch, steps, ε / δ / σ, B and learning rates of a group."""
  r0 = group_runs[0]
  cfg, res = r0["config"], r0["results"]
  seeds = ", ".join(str(r["seed"]) for r in group_runs)
  parts = [f"{len(group_runs)} seed{'s' if len(group_runs) > 1 else ''} ({seeds})"]
  if cfg.get("pretrain_workdir"):  # fine-tuning: the head's settings, the encoders' source
    pre = sorted(
        {os.path.basename(os.path.normpath(r["config"]["pretrain_workdir"])) for r in group_runs})
    k = len(next(iter(res.values())).get("confusion_matrix", ())) or "k"
    parts += [
        f"head {'-'.join(str(h) for h in (*cfg.get('head_hidden', ()), k))}, "
        f"batch {cfg.get('batch_size')}, {cfg.get('num_epochs')} epochs, "
        f"Adam {_fmt_num(cfg.get('learning_rate'))}",
        "encoders of " + ", ".join(f"`{p}`" for p in pre)
    ]
    return "; ".join(parts) + "."
  if "batch_size" in cfg:
    parts.append(f"expected batch {cfg['batch_size']:,}")
  for m in METHODS:
    if m not in res or m == "untrained":  # nothing trained, nothing to set
      continue
    r = res[m]
    lr, b = _lr_b(r0, m)
    bits = [f"lr {_fmt_num(lr)}"] if lr is not None else []
    if m != "non_private" and r.get("noise_multiplier"):
      bits += [f"B = {_fmt_num(b)}", f"σ = {r['noise_multiplier']:.3g}"]
      if r.get("steps"):
        bits.append(f"T = {r['steps']}")
      if r.get("sampling_rate"):
        bits.append(f"q = {r['sampling_rate']:.3g}")
    if bits:
      parts.append(f"{LABELS[m]}: " + ", ".join(bits))
  return "; ".join(parts) + "."


def method_deltas(runs, method) -> list[float]:
  """The certified δ of a method in each run that reports one."""
  return [
      float(r["results"][method]["delta"]) for r in runs if "delta" in r["results"].get(method, {})
  ]


def privacy_cell(group_runs, method) -> str:
  """ε and δ of a method over the group's runs (max over seeds), rounded up to 3 digits: bounds
  printed as bounds."""
  if method == "non_private":
    return "∞", "–"
  if method == "untrained":
    return "0", "0"
  eps = [r["results"][method]["epsilon"] for r in group_runs if method in r["results"]]
  dl = method_deltas(group_runs, method)
  if not eps:
    return "–", "–"
  return _round_up(max(eps), 3), (_round_up(max(dl), 3) if dl else "–")


def group_table(group_runs, paper=None, acc_label="3-NN acc") -> str:
  """Ours (mean ± std over seeds) beside the paper's: absolute, then relative to non-private."""
  labels = (acc_label,) + METRIC_LABELS[1:]
  head = ("| method | source | ε | δ | " + " | ".join(labels) + " | "
          + " | ".join(f"rel. {label}" for label in labels) + " |")
  lines = [head, "|" + "---|" * (4 + 2 * len(METRICS))]
  for m in METHODS:
    n = sum(m in r["results"] for r in group_runs)
    if n:
      eps, delta = privacy_cell(group_runs, m)
      absolute = [
          fmt_ms(*mean_std(v)) if (v := method_values(group_runs, m, k)) else "–" for k in METRICS
      ]
      rel = [
          fmt_ms(*mean_std(v)) if (v := method_values(group_runs, m, k, rel=True)) else "–"
          for k in METRICS
      ]
      lines.append(f"| {LABELS[m]} | ours, {n} seed{'s' if n > 1 else ''} | {eps} | {delta} | "
                   + " | ".join(absolute) + " | " + " | ".join(rel) + " |")
    if paper and m in paper:
      p = paper[m]
      pa = [fmt_ms(mu, sd) for mu, sd in p["abs"]] + ["–"]
      pr = [f"{v:.3f}" for v in p["rel"]] + ["–"]
      src = "paper" + (" (no batch norm)" if p["key"] == "non_private_no_bn" else "")
      peps = "∞" if m == "non_private" else "5"
      lines.append(f"| {LABELS[m]} | {src} | {peps} | not stated | " + " | ".join(pa) + " | "
                   + " | ".join(pr) + " |")
  return "\n".join(lines)


def verdict_table(groups, paper) -> str:
  """Paired differences of accuracy between methods, per group, beside the paper's."""
  pairs = (("logit_dp", "naive_dp"), ("logit_dp", "dp_gcl"), ("logit_dp", "non_private"),
           ("naive_dp", "non_private"), ("dp_gcl", "non_private"), ("logit_dp", "untrained"),
           ("naive_dp", "untrained"), ("dp_gcl", "untrained"))
  lines = [
      "| experiment | difference (accuracy) | ours: mean ± std of Δ over seeds | n | t | p "
      "| larger than the seed-to-seed noise? | paper: Δ of means ± √(sd₁² + sd₂²) |",
      "|---|---|---|---|---|---|---|---|"
  ]
  for g, group_runs in groups.items():
    if not any("non_private" in r["results"] for r in group_runs):
      continue
    prow = paper_rows(paper, g) if paper else None
    for a, b in pairs:
      va, vb = paired_by_seed(group_runs, a, group_runs, b, "accuracy")
      if not va:
        continue
      d = paired_difference(va, vb)
      if d["n"] < 2:
        answer = "one seed: cannot tell"
      elif d["p"] == d["p"] and d["p"] < 0.05:
        answer = "yes (p < 0.05)"
      else:
        answer = "no"
      ptxt = "–"
      if prow and a in prow and b in prow:
        (ma, sa), (mb, sb) = prow[a]["abs"][0], prow[b]["abs"][0]
        ptxt = (f"{ma - mb:+.3f}"
                if sa is None or sb is None else f"{ma - mb:+.3f} ± {math.hypot(sa, sb):.3f}")
      t, p = _fmt_t_p(d)
      mean = f"{d['mean']:+.4f}" + ("" if d["std"] != d["std"] else f" ± {d['std']:.4f}")
      lines.append(f"| {g} | {LABELS[a]} − {LABELS[b]} | {mean} | {d['n']} | {t} | {p} | "
                   f"{answer} | {ptxt} |")
  return "\n".join(lines)


def compare_table(a_runs, b_runs, a_name: str, b_name: str) -> str:
  """Same method, same seeds, two configurations: paired Δ = m(a) − m(b) per metric."""
  lines = [
      f"| method | metric | {a_name} | {b_name} | Δ paired by seed | n | t | p |",
      "|---|---|---|---|---|---|---|---|"
  ]
  shared = []
  for m in METHODS:
    for k, lab in zip(METRICS, METRIC_LABELS):
      va, vb = paired_by_seed(a_runs, m, b_runs, m, k)
      if not va:
        continue
      if va == vb:  # the same runs in both groups: nothing to compare
        if LABELS[m] not in shared:
          shared.append(LABELS[m])
        continue
      d = paired_difference(va, vb)
      t, p = _fmt_t_p(d)
      lines.append(f"| {LABELS[m]} | {lab} | {fmt_ms(*mean_std(va))} | {fmt_ms(*mean_std(vb))} | "
                   f"{fmt_ms(d['mean'], d['std'], 4)} | {d['n']} | {t} | {p} |")
  if shared:
    lines += ["", f"{', '.join(shared)}: the same runs in both groups, left out."]
  return "\n".join(lines)


def versus_table(a_runs, b_runs, a_name: str, b_name: str, acc: str = "3-NN acc") -> str:
  """Every method of configuration a against every method of configuration b, paired by seed:
  Δ = m_a − m'_b of 3-NN accuracy and the linear probe (e.g. Logit-DP with one clip method
  against the Naive-DP, non-private and untrained encoders of the same seeds). acc labels
  the "accuracy" metric (3-NN accuracy; the head's accuracy for fine-tuning groups)."""
  lines = [
      f"| {a_name} | {b_name} | metric | a | b | Δ = a − b paired by seed | n | t | p |",
      "|---|---|---|---|---|---|---|---|---|"
  ]
  for ma in METHODS:
    for mb in METHODS:
      for k, lab in (("accuracy", acc), ("linear_probe", "linear probe")):
        va, vb = paired_by_seed(a_runs, ma, b_runs, mb, k)
        if not va:
          continue
        d = paired_difference(va, vb)
        t, p = _fmt_t_p(d)
        lines.append(f"| {LABELS[ma]} | {LABELS[mb]} | {lab} | {fmt_ms(*mean_std(va))} | "
                     f"{fmt_ms(*mean_std(vb))} | {fmt_ms(d['mean'], d['std'], 4)} | {d['n']} | "
                     f"{t} | {p} |")
  return "\n".join(lines)


BOUND_LABELS = dict(ghost="ghost (exact norms)", triangle="triangle (upper bound)",
                    projected="projected (upper bound)")


def _clip_method_label(group_runs) -> str:
  """The clip method of a group's runs (one per group: check_one_clip_method), as a header."""
  method = group_runs[0]["config"].get("clip_method", "?")
  return BOUND_LABELS.get(method, method)


def bound_table(a_runs, b_runs) -> str:
  """Logit-DP with one pair-norm clip method (a, e.g. exact ghost norms) against another (b, e.g.
  the triangle bound), seed by seed (the seeds both groups have): each metric, a − b, and the
  training seconds with their ratio a / b. Columns are named by each group's config.clip_method."""
  a_label, b_label = _clip_method_label(a_runs), _clip_method_label(b_runs)
  lines = [
      f"| seed | metric | {a_label} | {b_label} | "
      f"{a_label.split()[0]} − {b_label.split()[0]} |", "|---|---|---|---|---|"
  ]
  by_key = {
      k: (values_by_seed(a_runs, "logit_dp", k), values_by_seed(b_runs, "logit_dp", k))
      for k in (*METRICS, "train_seconds")
  }
  seeds = sorted(set().union(*(a.keys() & b.keys() for a, b in by_key.values())))
  for seed in seeds:
    for k, label in (*zip(METRICS, METRIC_LABELS), ("train_seconds", "Logit-DP train s")):
      a_values, b_values = by_key[k]
      if seed not in a_values or seed not in b_values:
        continue
      a, b = a_values[seed], b_values[seed]
      if k == "train_seconds":
        cells = f"{a:,.0f} | {b:,.0f} | " + (f"×{a / b:,.1f}" if b > 0 else "–")
      else:
        cells = f"{a:.4f} | {b:.4f} | {a - b:+.4f}"
      lines.append(f"| {seed} | {label} | {cells} |")
  return "\n".join(lines)


WALLCLOCK_FOOTNOTE = (
    "† Less than the training alone: an attempt interrupted before its wall-clock was written "
    "is missing from it, while the training seconds count every attempt's steps.")


def _wallclock_cell(wallclock_seconds, train_seconds) -> tuple[str, bool]:
  """(cell, marked): the wall-clock, marked † when it is below the training seconds."""
  if wallclock_seconds is None:
    return "–", False
  marked = train_seconds is not None and wallclock_seconds < train_seconds
  return f"{wallclock_seconds:,.0f}" + (" †" if marked else ""), marked


def runs_table(runs) -> str:
  """Every committed run: wall-clock (all attempts) and training seconds per method."""
  lines = [
      "| run | seed | wall-clock (s, all attempts) | attempts | Logit-DP train s | "
      "Naive-DP train s | DP-GCL train s | non-private train s |",
      "|---|---|---|---|---|---|---|---|"
  ]
  incomplete = False
  for name, r in runs.items():
    wc = r["wallclock"]
    trained = [r["results"].get(m, {}).get("train_seconds") for m in TRAINED]
    total, marked = _wallclock_cell(wc["total_seconds"] if wc else None,
                                    sum(s for s in trained if s is not None))
    incomplete |= marked
    attempts = "–" if not wc else str(len(wc["attempts"]))
    secs = ["–" if s is None else f"{s:,.0f}" for s in trained]
    lines.append(f"| {name} | {r['seed']} | {total} | {attempts} | " + " | ".join(secs) + " |")
  if incomplete:
    lines += ["", WALLCLOCK_FOOTNOTE]
  return "\n".join(lines)


def pair_norms_table(report: dict) -> str:
  """Quantiles of ‖∇_θ Z_ij‖ and the fraction of pairs each B clips (experiments/pair_norms.py)."""
  names = {"init": "initial", **LABELS}
  ref = report.get("reference")
  ref = (f" Projected bound: the rank-{ref['rank']} subspace of {ref['num_reference']} "
         f"{ref['data']} {ref['split']} images' Jacobians." if ref else "")
  lines = [
      f"Run `{report['run']}`, n = {report['n']:,} {report['split']} pairs "
      f"({report['n'] ** 2:,} pair norms per row).{ref}", "",
      "| parameters | norms | 1% quantile | median | 99% quantile | clipped by B = 1 | "
      "clipped by B = 1e-5 | bound / exact, negatives: median (90%) |",
      "|---|---|---|---|---|---|---|---|"
  ]
  for who, by_method in report["params"].items():
    for m, q in by_method.items():
      if m == "batch_grad_norm":
        continue
      over = q.get("over_exact")
      over = f"{over['median']:.2f} ({over['q90']:.2f})" if over else "–"
      lines.append(f"| {names.get(who, who)} | {m} | {q['q01']:.3g} | {q['q50']:.3g} | "
                   f"{q['q99']:.3g} | {100 * q['clipped_at_1']:.2f}% | "
                   f"{100 * q['clipped_at_1e-05']:.2f}% | {over} |")
  norms = {
      who: q["batch_grad_norm"] for who, q in report["params"].items() if "batch_grad_norm" in q
  }
  if norms:
    lines += [
        "", "‖∇_θ ℒ‖ of the whole batch of these pairs (what Naive-DP clips to B): "
        + ", ".join(f"{names.get(w, w)} {v:.3g}" for w, v in norms.items()) + "."
    ]
  return "\n".join(lines)


def clip_bias_table(report: dict) -> str:
  """What clipping every pair does to ḡ, noise-free (experiments/clip_bias.py)."""
  steps = report["steps"]
  marks = [0, min(10, steps), steps]
  n_test = None
  lines = [
      f"Noise-free Adam (lr {report['lr']:g}), {report['clip_method']} pair norms, batch "
      f"{report['batch']:,} pairs from a {report['subset']:,}-image CIFAR-10 subset, {steps} "
      "steps. "
      "At initialisation: ‖ḡ‖, its cosine with the true gradient ∇ℒ, and the norms of its "
      "positive-pair (Z_ii) and negative-pair parts. Then, on 1,000 test pairs, the loss per pair "
      f"(collapse: ln n = {report['ln_n_test']:.4f}) and the mean cosine of non-matching "
      "embeddings (collapse: 1) after " + " / ".join(map(str, marks)) + " steps.", "",
      "| B | ‖ḡ‖ | cos(ḡ, ∇ℒ) | positive part | negative part | cos(pos., neg.) | "
      "test loss per pair | mean cosine of non-matching pairs |",
      "|---|---|---|---|---|---|---|---|"
  ]
  for b, r in report["runs"].items():
    i = r["at_init"]
    n_test = n_test or round(math.exp(report["ln_n_test"]))
    loss = " / ".join(f"{r['test_loss'][k] / n_test:.4f}" for k in marks)
    cos = " / ".join(f"{r['mean_negative_cosine'][k]:.3f}" for k in marks)
    name = "∞ (∇ℒ)" if b == "inf" else b
    lines.append(f"| {name} | {i['norm']:.3g} | {i['cos_with_true_grad']:+.2f} | "
                 f"{i['positive_norm']:.3g} | {i['negative_norm']:.3g} | "
                 f"{i['cos_positive_negative']:+.3f} | {loss} | {cos} |")
  return "\n".join(lines)


def _snr_label(name: str) -> str:
  """A signal_to_noise.py method key as a label: "logit_dp_projected" → "Logit-DP, projected"."""
  return LABELS.get(name, f"{LABELS['logit_dp']}, {name.removeprefix('logit_dp_')}")


def _config_changes(report: dict) -> str:
  """The sentence naming a signal_to_noise.py report's ``--set`` changes, or ""."""
  changes = report.get("overrides")
  return f" Config changes: {_fmt_overrides(changes)}." if changes else ""


def signal_to_noise_table(report: dict) -> str:
  """One private step's clipped sum against its noise, per method (signal_to_noise.py)."""
  lines = [
      f"One batch of {report['n']:,} CIFAR-10 same-class pairs, {report['parameters']} "
      f"parameters, B = {report['clip_norm']:g}, τ = {report['temperature']:g}, "
      f"σ = {report['noise_multiplier']:.3g}: ‖ḡ‖, the sensitivity Δ, the noise's norm σΔ√p, "
      "SNR = ‖ḡ‖ / (σΔ√p), and the cosine of ḡ with the unclipped full-batch gradient ∇ℒ."
      + _config_changes(report), "", "| method | ‖ḡ‖ | Δ | σΔ√p | SNR | cos(ḡ, ∇ℒ) |",
      "|---|---|---|---|---|---|"
  ]
  for name, m in report["methods"].items():
    label = _snr_label(name)
    if name == "dp_gcl":
      label += (f" ({m['num_groups']:,} groups; cos with its unclipped group sum "
                f"{m['cos_with_unclipped_group_sum']:+.3f})")
    lines.append(f"| {label} | {m['grad_norm']:.3g} | {m['sensitivity']:.3g} | "
                 f"{m['noise_norm']:.3g} | {m['snr']:.3g} | {m['cos_with_true_grad']:+.3f} |")
  return "\n".join(lines)


def signal_to_noise_summary_table(reports) -> str:
  """SNR and cos(ḡ, ∇ℒ) of every method at several parameter points (signal_to_noise.py)."""
  names = list(reports[0]["methods"])

  def setting(r):
    return r["clip_norm"], r["temperature"], r.get("overrides") or {}

  for r in reports[1:]:
    if list(r["methods"]) != names or setting(r) != setting(reports[0]):
      raise ValueError("signal_to_noise_summary: reports of different methods or settings")
  lines = [
      f"B = {reports[0]['clip_norm']:g}, τ = {reports[0]['temperature']:g}: SNR = "
      "‖ḡ‖ / (σΔ√p) of one batch, and in brackets cos(ḡ, ∇ℒ)." + _config_changes(reports[0]), "",
      "| parameters | n | " + " | ".join(_snr_label(n) for n in names)
      + " | DP-GCL SNR ÷ projected SNR |", "|---|---|" + "---|" * (len(names) + 1)
  ]
  for r in reports:
    m = r["methods"]
    cells = [f"{m[n]['snr']:.3g} ({m[n]['cos_with_true_grad']:+.2f})" for n in names]
    ratio = (f"{m['dp_gcl']['snr'] / m['logit_dp_projected']['snr']:.1f}"
             if "dp_gcl" in m and "logit_dp_projected" in m else "–")
    lines.append(f"| {r['parameters']} | {r['n']:,} | " + " | ".join(cells) + f" | {ratio} |")
  return "\n".join(lines)


_CONTRAST_LABELS = {
    "logit_dp_exact": "Logit-DP, exact norms", "logit_dp_projected": "Logit-DP, projected",
    "contrast": "contrast clipping", "contrast_bound": "contrast clipping, bound norms",
    "dp_gcl": "DP-GCL", "naive_dp": "Naive-DP"
}


def contrast_snr_table(reports) -> str:
  """SNR of contrast clipping beside Logit-DP and DP-GCL, as a multiple of Logit-DP with exact
  norms (signal_to_noise.py --contrast)."""
  names = [n for n in reports[0]["methods"] if n != "naive_dp"]
  lines = [
      "SNR = ‖ḡ‖ / (σΔ√p) of one batch ÷ that of Logit-DP with exact norms; in brackets "
      "SNR·cos(ḡ, ∇ℒ) ÷ the same for Logit-DP with exact norms (the part of the signal along "
      "∇ℒ). B: the config's for every method, or each method's own norms' quantile. Grouped "
      "contrast clipping with expected group size s: K the median of its group sums' norms."
      + _config_changes(reports[0]), "", "| parameters | n | B | " + " | ".join(
          _CONTRAST_LABELS.get(n, n.replace("grouped_contrast_s", "grouped contrast, s = "))
          for n in names) + " |", "|---|---|---|" + "---|" * len(names)
  ]
  for r in reports:
    m = r["methods"]
    base = m["logit_dp_exact"]
    along = base["snr"] * base["cos_with_true_grad"]
    cells = [
        f"{m[n]['snr'] / base['snr']:.2f} ({m[n]['snr'] * m[n]['cos_with_true_grad'] / along:+.2f})"
        if n in m else "–" for n in names
    ]
    q = r.get("clip_quantile")
    bound = f"{r['clip_norm']:g}" if q is None else f"{q:g}-quantile"
    lines.append(f"| {r['parameters']} | {r['n']:,} | {bound} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def geometry_table(reports) -> str:
  """How spread out each run's test embeddings are, per method (embedding_geometry.py)."""
  if len({r["n"] for r in reports}) > 1:
    raise ValueError("geometry: reports over different numbers of test images")
  lines = [
      f"First {reports[0]['n']:,} test images of each run; cosines over i ≠ j; ū = mean of "
      "eᵢ/‖eᵢ‖; centred energy = ‖E − 1ēᵀ‖²_F / ‖E‖²_F; test loss: the run's last logged one.", "",
      "| run | method | median ‖e‖ | mean cos | min cos | ‖ū‖ | centred energy | test loss |",
      "|---|---|---:|---:|---:|---:|---:|---:|"
  ]
  for r in reports:
    for method, g in r["methods"].items():
      loss = f"{g['last_test_loss']:.4f}" if "last_test_loss" in g else "–"
      lines.append(f"| {r['workdir']} | {LABELS.get(method, method)} | {g['median_norm']:.3g} | "
                   f"{g['mean_cosine']:.4f} | {g['min_cosine']:+.3f} | "
                   f"{g['mean_direction_norm']:.4f} | {g['centred_energy']:.3f} | {loss} |")
  return "\n".join(lines)


_REPORT_TABLES = {
    "pair_norms": pair_norms_table, "clip_bias": clip_bias_table,
    "signal_to_noise": signal_to_noise_table
}
# Blocks over several JSON reports (comma-separated files).
_MULTI_REPORT_TABLES = {
    "signal_to_noise_summary": signal_to_noise_summary_table, "geometry": geometry_table,
    "contrast_snr": contrast_snr_table
}


def _fmt_overrides(overrides: dict) -> str:
  return ", ".join(f"{k} = {v}" for k, v in overrides.items()) or "–"


def search_table(summary: dict) -> str:
  """The public-data search of experiments/tune.py: one row per candidate, then the choice."""
  zero_shot = any("zero_shot_top5" in r for r in summary["candidates"])  # experiments/clip.py
  metrics = "zero-shot top-1 | zero-shot top-5" if zero_shot else "3-NN acc | linear probe"
  lines = [
      f"| # | candidate | stage | its change | overrides of the base | T | σ | ε | {metrics} | "
      "train s | wall-clock s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"
  ]
  incomplete = False
  number = lambda v, spec: "–" if v is None else format(v, spec)
  chosen = (summary.get("chosen") or {}).get("name")
  for r in summary["candidates"]:
    name = f"**{r['name']}**" if r["name"] == chosen else r["name"]
    if r.get("diverged"):
      cells = ["–", "–", "–", "diverged", "–"]
    elif not r["finished"]:
      cells = ["–", "–", "–", "not finished", "–"]
    else:
      second = r.get("zero_shot_top5" if zero_shot else "linear_probe")
      cells = [
          str(r["steps"]),
          number(r.get("noise_multiplier"), ".3g"),
          number(r.get("epsilon"), ".3g"), f"{r['accuracy']:.4f}",
          number(second, ".4f")
      ]
    trained = r.get("train_seconds")
    wall, marked = _wallclock_cell(r.get("wallclock_seconds"), trained)
    incomplete |= marked
    lines.append(f"| {r['order']} | {name} | {r['stage']} | {_fmt_overrides(r['own_overrides'])} | "
                 f"{_fmt_overrides(r['overrides'])} | " + " | ".join(cells)
                 + f" | {'–' if trained is None else f'{trained:,.0f}'} | {wall} |")
  lines.append("")
  if incomplete:
    lines += [WALLCLOCK_FOOTNOTE, ""]
  if chosen:
    lines.append(f"Chosen by the rule fixed in advance ({summary['rule']}): **{chosen}**, "
                 f"overrides {_fmt_overrides(summary['chosen']['overrides'])}.")
  else:
    lines.append(f"Nothing chosen yet: the search has not finished (rule: {summary['rule']}).")
  winners = ", ".join(f"{st['name']}: {st['winner']}" for st in summary.get("stages", ()))
  if winners:
    lines.append(f"Incumbent after each stage: {winners}.")
  return "\n".join(lines)


# ---------------------------------------------------------------------------
# Accuracy vs ε.

CURVE_EPSILONS = (1.0, 2.0, 5.0, 8.0)
CURVE_METRICS = (("accuracy", "3-NN acc"), ("linear_probe", "linear probe"))
# The README's figure: 3-NN accuracy vs ε of the recommended setting, one panel.
FRONT_CURVE = "cifar10_embnet_tuned:5=cifar10_embnet_tuned"
FRONT_FIGURE = "accuracy_vs_epsilon.png"
FRONT_TITLE = ("CIFAR-10, embedding net: 3-NN accuracy vs ε\n"
               "(mean ± std over 3 seeds; stars: the paper's ε = 5 points)")


def _eps_label(e: float) -> str:
  return f"{e:g}"


def parse_curve_spec(spec: str) -> tuple[str, dict[float, list[str]]]:
  """``<prefix>[:<E>=<group>[,<group>…]]…`` -> (prefix, {E: [extra groups]}).

  The curve's point at ε = E comes from the runs of group ``<prefix>_eps<E>`` and, for the
  methods that group lacks, from the extra groups named for E (in order): one method's
  numbers at one ε come from one group.
  """
  prefix, *extras = spec.split(":")
  out: dict[float, list[str]] = {}
  for item in extras:
    e, eq, names = item.partition("=")
    if not eq or not names:
      raise ValueError(f"curve block {spec!r}: {item!r} is not <ε>=<group>[,<group>…]")
    out.setdefault(float(e), []).extend(names.split(","))
  return prefix, out


def curve_data(spec: str, groups) -> dict:
  """Per ε and method, the runs (one source group each) that give the curve's points.

  Returns dict(prefix, epsilons, cells={(method, E): dict(group, runs)}, found): ``found`` is
  whether any ``<prefix>_eps<E>`` group exists. Every run used at ε = E must have been
  configured with target_epsilon = E (ValueError otherwise).
  """
  prefix, extras = parse_curve_spec(spec)
  pattern = re.compile(re.escape(prefix) + r"_eps(\d+(?:\.\d+)?)$")
  own = {float(m[1]): g for g in groups if (m := pattern.match(g))}
  epsilons = sorted(set(CURVE_EPSILONS) | set(own) | set(extras))
  cells = {}
  for e in epsilons:
    sources = ([own[e]] if e in own else []) + [g for g in extras.get(e, ()) if g in groups]
    for m in METHODS:
      for g in sources:
        runs = [r for r in groups[g] if m in r["results"]]
        if runs:
          for r in runs:
            target = r["config"].get("target_epsilon")
            if target is not None and float(target) != e:
              raise ValueError(f"curve {prefix!r}: run {r['name']} has target_epsilon = {target}, "
                               f"not the ε = {e:g} of its point")
          cells[(m, e)] = dict(group=g, runs=runs)
          break
  return dict(prefix=prefix, epsilons=epsilons, cells=cells, found=bool(own))


def curve_deltas(data: dict) -> dict[float, float]:
  """Per ε, the largest certified δ of the curve's private runs (their results' ``delta``: the
  target δ plus the padded Poisson batch's overflow term (1 + e^ε)·(1 − (1 − p_over)^T), see
  `logit_dp.ledger.PrivacyLedger.delta`)."""
  out = {}
  for (m, e), cell in data["cells"].items():
    deltas = method_deltas(cell["runs"], m) if m in PRIVATE else []
    if deltas:
      out[e] = max(out.get(e, 0.0), *deltas)
  return out


def _round_up(x: float, digits: int = 4) -> str:
  """x rounded up to ``digits`` significant digits: a bound stays a bound when printed."""
  if x <= 0:
    return f"{x:g}"
  d = decimal.Decimal(repr(float(x)))  # the shortest decimal that reads back as x
  step = decimal.Decimal(1).scaleb(d.adjusted() - digits + 1)
  return f"{float(d.quantize(step, rounding=decimal.ROUND_CEILING)):.{digits}g}"


def curve_figure_name(prefix: str) -> str:
  return f"{prefix}_eps_curve.png"


def curve_table(data: dict, paper=None, results_dir: str = "") -> str:
  """3-NN accuracy and linear probe, mean ± std over seeds (n), per method and ε."""
  eps = data["epsilons"]
  prow = paper_rows(paper, data["prefix"]) if paper else None
  lines = []
  if not data["found"]:
    lines += [f"(no finished run of `{data['prefix']}_eps<ε>` yet)", ""]
  lines += [
      "| method | metric | " + " | ".join(f"ε = {_eps_label(e)}" for e in eps)
      + " | paper, ε = 5 (non-private: ∞) |", "|---|---|" + "---|" * (len(eps) + 1)
  ]
  for m in METHODS:
    for key, label in CURVE_METRICS:
      cells = []
      for e in eps:
        cell = data["cells"].get((m, e))
        v = method_values(cell["runs"], m, key) if cell else []
        cells.append(f"{fmt_ms(*mean_std(v))} ({len(v)})" if v else "–")
      ptxt = "–"
      if key == "accuracy" and prow and m in prow:
        ptxt = fmt_ms(*prow[m]["abs"][0])
      lines.append(f"| {LABELS[m]} | {label} | " + " | ".join(cells) + f" | {ptxt} |")
  used = []
  for e in eps:
    by_group: dict[str, list[str]] = {}
    for m in METHODS:
      if (m, e) in data["cells"]:
        by_group.setdefault(data["cells"][(m, e)]["group"], []).append(m)
    for g, ms in by_group.items():
      seeds = sorted({r["seed"] for m in ms for r in data["cells"][(m, e)]["runs"]})
      used.append(f"ε = {_eps_label(e)}: `{g}` ({', '.join(LABELS[m] for m in ms)}; seeds "
                  f"{', '.join(map(str, seeds))})")
  lines += [
      "", "Mean ± std over seeds (n seeds). Runs: " + ("; ".join(used) if used else "none") + "."
  ]
  deltas = curve_deltas(data)
  if deltas:
    lines[-1] += (
        " Certified δ (the largest over a point's runs: the target δ plus the padded "
        "Poisson batch's overflow term (1 + e^ε)·(1 − (1 − p_over)^T)): "
        + ", ".join(f"ε = {_eps_label(e)}: ≤ {_round_up(d)}" for e, d in sorted(deltas.items()))
        + ".")
  lines += [
      "", *curve_differences(data), "",
      "Δ = Logit-DP − rival per seed, mean ± std over the seeds both points have (n), and the "
      "two-sided p of the paired t-test."
  ]
  fig = os.path.join(results_dir, "figures", curve_figure_name(data["prefix"]))
  if results_dir and os.path.exists(fig):
    lines += ["", f"![accuracy vs ε](results/figures/{curve_figure_name(data['prefix'])})"]
  return "\n".join(lines)


# Differences the curve's reader asks about: Logit-DP against each rival, at every ε.
CURVE_DIFFERENCES = (("logit_dp", "dp_gcl"), ("logit_dp", "naive_dp"))


def curve_differences(data: dict, key: str = "accuracy") -> list[str]:
  """Per ε, Logit-DP − rival paired by seed (`paired_difference`: mean ± std (n), two-sided p
  of the paired t-test) over the seeds both methods' points have."""
  eps = data["epsilons"]
  label = dict(CURVE_METRICS)[key]
  lines = [
      f"| {label}, paired by seed | " + " | ".join(f"ε = {_eps_label(e)}" for e in eps) + " |",
      "|---|" + "---|" * len(eps)
  ]
  for a, b in CURVE_DIFFERENCES:
    cells = []
    for e in eps:
      ca, cb = data["cells"].get((a, e)), data["cells"].get((b, e))
      va, vb = paired_by_seed(ca["runs"] if ca else [], a, cb["runs"] if cb else [], b, key)
      if not va:
        cells.append("–")
        continue
      d = paired_difference(va, vb)
      std = "" if d["std"] != d["std"] else f" ± {d['std']:.3f}"
      cells.append(f"{d['mean']:+.3f}{std} ({d['n']}), p = {_fmt_t_p(d)[1]}")
    lines.append(f"| {LABELS[a]} − {LABELS[b]} | " + " | ".join(cells) + " |")
  return lines


def epsilon_free_band(data: dict, key: str, method: str = "non_private") -> list[float]:
  """The metric of a method that does not depend on ε (non-private, untrained) once per seed,
  from the smallest ε whose group has that seed."""
  by_seed = {}
  for e in data["epsilons"]:
    cell = data["cells"].get((method, e))
    for r in cell["runs"] if cell else ():
      if r["seed"] not in by_seed and key in r["results"][method]:
        by_seed[r["seed"]] = float(r["results"][method][key])
  return [by_seed[s] for s in sorted(by_seed)]


def plot_curve(data: dict, paper, out_dir: str, metrics=CURVE_METRICS, path: str | None = None,
               title: str | None = None) -> str | None:
  """Accuracy vs ε, one panel per metric (default 3-NN and linear probe): mean ± std over seeds
  per DP method, the non-private mean ± std as a band, the paper's ε = 5 points as stars. Written
  to ``path`` (default ``out_dir/<prefix>_eps_curve.png``); None if no point."""
  if not data["cells"]:
    return None
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  prow = paper_rows(paper, data["prefix"]) if paper else None
  colours = dict(logit_dp="C0", naive_dp="C1", dp_gcl="C2", non_private="0.4", untrained="C3")
  deltas = curve_deltas(data)
  fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.6), squeeze=False)
  axes = axes[0]
  for ax, (key, label) in zip(axes, metrics):
    for m in PRIVATE:
      pts = []
      for e in data["epsilons"]:
        cell = data["cells"].get((m, e))
        v = method_values(cell["runs"], m, key) if cell else []
        if v:
          mu, sd = mean_std(v)
          pts.append((e, mu, 0.0 if sd != sd else sd))
      if pts:
        x, y, err = zip(*pts)
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, color=colours[m], label=LABELS[m])
    for m in ("non_private", "untrained"):
      band = epsilon_free_band(data, key, m)
      if band:
        mu, sd = mean_std(band)
        sd = 0.0 if sd != sd else sd
        ax.axhspan(mu - sd, mu + sd, color=colours[m], alpha=0.2, lw=0)
        ax.axhline(mu, color=colours[m], lw=1, ls="-" if m == "non_private" else "--",
                   label=f"{LABELS[m]} ({len(band)} seed{'s' if len(band) != 1 else ''})")
    if key == "accuracy" and prow:
      for m in PRIVATE:
        if m in prow:
          mu, sd = prow[m]["abs"][0]
          # Drawn a little right of ε = 5 so that ours stays visible under it.
          ax.errorbar([5.15], [mu], yerr=[sd or 0.0], marker="*", ms=13, ls="none",
                      color=colours[m], mec="k", label=f"paper, {LABELS[m]}")
      if "non_private" in prow:
        ax.axhline(prow["non_private"]["abs"][0][0], color="k", lw=1, ls=":",
                   label="paper, non-private")
    ax.set_xticks(data["epsilons"])
    ax.set_xticklabels([_eps_label(e) for e in data["epsilons"]])
    ax.set_xlabel(f"ε (δ ≤ {_round_up(max(deltas.values()), 3)})" if deltas else "ε")
    ax.set_ylabel(label)
    ax.set_title(title or f"{data['prefix']}: {label} (mean ± std over seeds)", fontsize=9)
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  path = path or os.path.join(out_dir, curve_figure_name(data["prefix"]))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


# ---------------------------------------------------------------------------
# Blocks.

_BLOCK_RE = re.compile(
    r"(<!-- generated:(?P<name>[^ ]+) -->\n)(?P<body>.*?)(<!-- /generated:(?P=name) -->)", re.S)

ZERO_SHOT_LABELS = {"logit_dp": "Logit-DP, two towers", "non_private": "Non-private"}


def zero_shot_table(group_runs) -> str:
  """The two-tower runs of experiments/clip.py: zero-shot accuracy per method, mean ± std over
  seeds, beside chance (1/classes for top-1, 5/classes for top-5)."""
  classes = {r["results"]["num_classes"] for r in group_runs}
  if len(classes) != 1:
    raise ValueError(f"runs of one group with different class counts: {sorted(classes)}")
  (k,) = classes
  seeds = ", ".join(str(r["seed"]) for r in group_runs)
  lines = [
      f"{len(group_runs)} seed{'s' if len(group_runs) > 1 else ''} ({seeds}); "
      f"{group_runs[0]['results']['num_records']:,} records, {k} classes, zero-shot accuracy on "
      f"{group_runs[0]['results']['num_test']:,} test images; chance {1 / k:.3g} (top-1), "
      f"{min(5, k) / k:.3g} (top-5).", "",
      "| method | ε | δ | steps | σ | B | zero-shot top-1 | zero-shot top-5 | train s |",
      "|---|---|---|---|---|---|---|---|---|"
  ]
  for method, label in ZERO_SHOT_LABELS.items():
    res = [r["results"]["methods"][method] for r in group_runs if method in r["results"]["methods"]]
    if not res:
      continue
    private = "epsilon" in res[0]
    for key in ("noise_multiplier", "clip_norm", "steps") if private else ():
      if len({x[key] for x in res}) != 1:
        raise ValueError(f"{label}: seeds of one group differ in {key}")
    eps = f"{max(x['epsilon'] for x in res):.2f}" if private else "∞"
    delta = f"{max(x['delta'] for x in res):.3g}" if private else "–"
    sigma = f"{res[0]['noise_multiplier']:.3g}" if private else "–"
    clip = f"{res[0]['clip_norm']:g}" if private else "–"
    steps = "/".join(sorted({str(x["steps"]) for x in res}))
    top1 = fmt_ms(*mean_std([x["zero_shot_top1"] for x in res]))
    top5 = fmt_ms(*mean_std([x["zero_shot_top5"] for x in res]))
    secs = max(x["train_seconds"] for x in res)
    lines.append(f"| {label} | {eps} | {delta} | {steps} | {sigma} | {clip} | {top1} | {top5} | "
                 f"≤ {secs:,.0f} |")
  return "\n".join(lines)


def render_block(name: str, runs, groups, paper, results_dir: str = "") -> str:
  if name == "runs":
    return runs_table(runs)
  if name == "verdict":
    return verdict_table(groups, paper)
  kind, _, arg = name.partition(":")
  if kind == "group":
    acc = "head acc" if arg.startswith("cifar100_ft") else "3-NN acc"
    prow = paper_rows(paper, arg) if paper else None
    if arg not in groups:
      none = f"(no finished run of `{arg}` yet)"
      return none + ("\n\n" + group_table([], prow, acc) if prow else "")
    return settings_line(groups[arg]) + "\n\n" + group_table(groups[arg], prow, acc)
  if kind == "compare":
    a, b = arg.split(":")
    if a not in groups or b not in groups:
      return f"(no seed of `{a}` with a `{b}` run of the same seed yet)"
    return compare_table(groups[a], groups[b], a, b)
  if kind in _REPORT_TABLES or kind in _MULTI_REPORT_TABLES:  # JSON reports -> a table
    files = arg.split(",") if kind in _MULTI_REPORT_TABLES else [arg]
    missing = [a for a in files if not os.path.exists(os.path.join(results_dir, a))]
    if missing:
      return f"(`{'`, `'.join(missing)}` not computed yet)"
    reports = []
    for a in files:
      with open(os.path.join(results_dir, a)) as f:
        reports.append(json.load(f))
    if kind in _MULTI_REPORT_TABLES:
      return _MULTI_REPORT_TABLES[kind](reports)
    return _REPORT_TABLES[kind](reports[0])
  if kind == "curve":
    return curve_table(curve_data(arg, groups), paper, results_dir)
  if kind == "search":
    path = os.path.join(results_dir, arg, "search.json")
    if not os.path.exists(path):
      return f"(the search `{arg}` has not been run yet: no `{arg}/search.json`)"
    with open(path) as f:
      return search_table(json.load(f))
  if kind == "versus":
    a, b = arg.split(":")
    if a not in groups or b not in groups:
      return f"(no seed of `{a}` with a `{b}` run of the same seed yet)"
    acc = "head acc" if a.startswith("cifar100_ft") else "3-NN acc"
    return versus_table(groups[a], groups[b], a, b, acc)
  if kind == "zero_shot":
    if arg not in groups:
      return f"(no finished run of `{arg}` yet)"
    return zero_shot_table(groups[arg])
  if kind == "clip_benchmark":
    from experiments import clip_benchmark  # pylint: disable=g-import-not-at-top
    return clip_benchmark.benchmark_table(
        clip_benchmark.load_results(os.path.join(results_dir, arg)))
  if kind == "finetune_benchmark":
    from experiments import finetune_benchmark  # pylint: disable=g-import-not-at-top
    return finetune_benchmark.benchmark_table(
        finetune_benchmark.load_results(os.path.join(results_dir, arg)))
  if kind == "people_benchmark":
    from experiments import people_benchmark  # pylint: disable=g-import-not-at-top
    return people_benchmark.table_of(results_dir, arg)
  if kind == "bound":
    a, b = arg.split(":")
    if a not in groups or b not in groups:
      return f"(no finished run of `{a}` with a `{b}` run of the same seed yet)"
    return bound_table(groups[a], groups[b])
  raise ValueError(f"unknown generated block {name!r}")


def render(text: str, runs, paper, results_dir: str = "") -> str:
  """``text`` with every generated block replaced."""
  groups = groups_of(runs)

  def sub(m):
    body = render_block(m["name"], runs, groups, paper, results_dir)
    return m.group(1) + body.rstrip() + "\n" + m.group(4)

  return _BLOCK_RE.sub(sub, text)


def plot_group(group: str, group_runs, out_dir: str) -> list[str]:
  """Figures of a group: relative test loss (mean ± std over seeds) and the first seed's
  confusion matrices."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  from experiments import data as data_lib  # pylint: disable=g-import-not-at-top
  from experiments import train as train_lib  # pylint: disable=g-import-not-at-top
  os.makedirs(out_dir, exist_ok=True)
  written = []
  with_curves = [r for r in group_runs if r["results"].get("non_private", {}).get("history")]
  if with_curves:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for m in PRIVATE:
      curves = []
      for r in with_curves:
        h, ref = r["results"].get(m, {}).get("history"), r["results"]["non_private"]["history"]
        if not h:
          continue
        e = np.array([row["epoch"] for row in h])
        ref_l = np.interp(e, [row["epoch"] for row in ref], [row["test_loss"] for row in ref])
        curves.append((e, np.array([row["test_loss"] for row in h]) / ref_l))
      if not curves:
        continue
      e = curves[0][0]
      rel = np.stack([np.interp(e, c[0], c[1]) for c in curves])
      mu = rel.mean(0)
      ax.plot(e, mu, marker=".", label=f"{LABELS[m]} ({len(curves)} seeds)")
      if len(curves) > 1:
        sd = rel.std(0, ddof=1)
        ax.fill_between(e, mu - sd, mu + sd, alpha=0.25)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--", label="Non-private")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test loss / non-private test loss")
    ax.set_title(f"{group}: relative test loss (mean ± std)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, f"{group}_relative_loss.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  first = group_runs[0]
  # A run's results may also hold run-level scalars (the two-tower run's num_classes, ...).
  res = {
      m: r for m, r in first["results"].items() if isinstance(r, dict) and "confusion_matrix" in r
  }
  if res:
    k = len(next(iter(res.values()))["confusion_matrix"])
    names = data_lib.class_names(first["config"].get("data", {}), k)
    tmp = os.path.join(out_dir, f".{group}")
    os.makedirs(tmp, exist_ok=True)
    train_lib.plot_results({m: dict(r, history=[]) for m, r in res.items()}, tmp, names)
    path = os.path.join(out_dir, f"{group}_confusion_s{first['seed']}.png")
    os.replace(os.path.join(tmp, "confusion_matrices.png"), path)
    os.rmdir(tmp)
    written.append(path)
  return written


#: The pages whose generated blocks are rendered, under docs/.
PAGES = ("RESULTS.md", "results_in_detail.md")


def main(argv):
  del argv
  runs = load_runs(flags.FLAGS.results_dir)
  paper = load_paper(flags.FLAGS.paper)
  pages = {}
  for out in flags.FLAGS.out:
    with open(out) as f:
      pages[out] = f.read()
  if flags.FLAGS.figures:
    figures = os.path.join(flags.FLAGS.results_dir, "figures")
    groups = groups_of(runs)
    for g, group_runs in groups.items():
      for path in plot_group(g, group_runs, figures):
        print("wrote", path)
    for old in pages.values():
      for m in _BLOCK_RE.finditer(old):
        if m["name"].startswith("curve:"):
          path = plot_curve(curve_data(m["name"].partition(":")[2], groups), paper, figures)
          if path:
            print("wrote", path)
    path = plot_curve(curve_data(FRONT_CURVE, groups), paper, figures, CURVE_METRICS[:1],
                      os.path.join(figures, FRONT_FIGURE), FRONT_TITLE)
    if path:
      print("wrote", path)
  stale = []
  for out, old in pages.items():
    new = render(old, runs, paper, flags.FLAGS.results_dir)
    if flags.FLAGS.check:
      if new != old:
        print(f"{out} is out of date: run python -m experiments.render_results")
        stale.append(out)
      continue
    with open(out, "w") as f:
      f.write(new)
    print(f"rendered {len(_BLOCK_RE.findall(old))} blocks from {len(runs)} runs into {out}")
  if stale:
    sys.exit(1)


def _define_flags():
  flags.DEFINE_string("results_dir", os.path.join(_REPO, "docs", "results"), "Run results.")
  flags.DEFINE_string("paper", os.path.join(_REPO, "experiments", "paper_results.json"),
                      "The paper's numbers.")
  flags.DEFINE_list("out", [os.path.join(_REPO, "docs", page) for page in PAGES],
                    "The pages with the blocks (comma-separated).")
  flags.DEFINE_bool("check", False, "Do not write; exit 1 if the file would change.")
  flags.DEFINE_bool("figures", False, "Also draw each group's figures into results_dir/figures/.")


if __name__ == "__main__":
  _define_flags()
  app.run(main)

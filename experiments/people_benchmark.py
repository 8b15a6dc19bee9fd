r"""Privacy per person, measured: group privacy against native person-level DP on CIFAR-10.

    python -m experiments.people_benchmark --data_dir=DIR --search_subset=10000

Two-tower CIFAR-10 (`experiments.clip`) with simulated owners (a heavy-tailed number of pairs per
person, 1 to 16), three ways to a person-level (ε, δ) (``config.arms``,
experiments/configs/people_benchmark.py):

* (a) ``group_privacy``: per-pair DP-GCL on the K-capped records (at most K pairs a person) at
  the per-pair (ε/K, δ/(K·e^{(K−1)ε/K})), converted by group privacy to the person's (ε, δ);
* (b) ``dp_gcl``: native person-level DP-GCL, ``make_private(user_ids=, max_pairs_per_user=K)``
  (every pair of a person in one group, C = 2B);
* (c) ``logit_dp``: native person-level Logit-DP (C = K·C(∞)).

One command runs everything, resumably (re-running it continues where it stopped), one arm at a
time (its searches, then its runs), in the order of ``config.arms``:

1. **Search on public data** (`experiments.tune`, the rule of the per-pair benchmark: best
   zero-shot top-1 on CIFAR-100's public test split). For every arm and ε, from the per-pair
   benchmark's public choice for the arm's mechanism at the same ε (``config.per_pair_search``:
   learning rate, τ, B, DP-GCL's group size; None starts from the base settings), a stage over
   K ∈ ``config.k_grid``, then a stage over the learning rate × ``config.learning_rate_grid``.
   The search runs on CIFAR-100 with its coarse labels and owners simulated the same way (a
   subset with ``--search_subset``, at the same q and T); no CIFAR-10 image or label is used.
2. **Benchmark.** Every arm × ε × seed of ``config.seeds`` trains ``benchmark_base`` (CIFAR-10)
   with its search's choice (``runs_dir/benchmark/<arm>_eps<ε>_s<seed>``, checkpointed every
   ``checkpoint_every`` steps); a finished run (or its published copy) is skipped.
3. **Table.** ``results_dir/people_benchmark/benchmark.md`` (and .json), the block
   ``people_benchmark:people_benchmark`` of docs/RESULTS.md: the verdict at each ε (the arm of
   best mean top-1), then zero-shot top-1 and top-5 (mean ± std over seeds) and each arm's Δ
   against (b) paired by seed; beside them, for reference, the per-pair benchmark's DP-GCL (a
   per-pair guarantee, not a person's) and non-private runs (``config.per_pair_benchmark``).

Published (small, shareable, no machine paths): ``results_dir/people_benchmark_search/<search>/``
and ``results_dir/people_benchmark/<run>/`` (config.json, results.json, wallclock.json,
choice.json). Checkpoints and the secret seeds stay under ``runs_dir``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import ml_collections

from experiments import clip_benchmark
from experiments import render_results
from experiments import tune
from experiments import workdirs

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The mechanism and the mode (`experiments.clip`'s ``people.mode``) of every arm.
ARMS = {
    "group_privacy": ("dp_gcl", "group_privacy"),
    "dp_gcl": ("dp_gcl", "native"),
    "logit_dp": ("logit_dp", "native"),
}
LABELS = {
    "group_privacy": "(a) per-pair DP-GCL, group privacy",
    "dp_gcl": "(b) DP-GCL per person",
    "logit_dp": "(c) Logit-DP per person",
}
REFERENCE = "dp_gcl"  # the arm every Δ is taken against
SEARCH_FOLDER = "people_benchmark_search"
RUNS_FOLDER = "people_benchmark"


def search_name(arm: str, epsilon: float) -> str:
  return f"{arm}_eps{float(epsilon):g}"


def run_name(arm: str, epsilon: float, seed: int) -> str:
  return f"{search_name(arm, epsilon)}_s{int(seed)}"


def per_pair_overrides(config, arm: str, epsilon: float, results_dir: str) -> dict:
  """The per-pair benchmark's public choice for the arm's mechanism at ε ({} when
  ``config.per_pair_search`` is None): the arm's starting point."""
  if not config.get("per_pair_search"):
    return {}
  mechanism, _ = ARMS[arm]
  path = os.path.join(results_dir, config.per_pair_search,
                      clip_benchmark.search_name(mechanism, float(epsilon)), "search.json")
  return tune.load_choice(path)["overrides"]


def arm_config(base, arm: str, epsilon: float, overrides: dict,
               checkpoint_every: int) -> ml_collections.ConfigDict:
  """``base`` training the arm's mechanism in its mode at person-level ε, with ``overrides``."""
  mechanism, mode = ARMS[arm]
  out = copy.deepcopy(base)
  out.methods = (mechanism,)
  out.target_epsilon = float(epsilon)
  out.people.mode = mode
  out.checkpoint_every = int(checkpoint_every)
  return tune.apply_overrides(out, overrides)


def search_stages(config, arm: str, base) -> list[dict]:
  """K ∈ k_grid, then the learning rate × learning_rate_grid (of ``base``'s rate)."""
  mechanism, _ = ARMS[arm]
  key = f"learning_rates.{mechanism}"
  rate = float(base.learning_rates[mechanism])
  stages = [
      dict(
          name="max pairs per person", candidates=[
              dict(name=f"K{int(k)}", overrides={"people.max_pairs_per_user": int(k)})
              for k in config.k_grid
          ]),
      dict(
          name="learning rate", candidates=[
              dict(name=f"lr{float(f'{rate * m:.3g}'):g}",
                   overrides={key: float(f"{rate * m:.3g}")}) for m in config.learning_rate_grid
          ]),
  ]
  return [s for s in stages if s["candidates"]]


def search_config(config, arm: str, epsilon: float, results_dir: str, data_dir: str | None,
                  subset: int | None) -> ml_collections.ConfigDict:
  """The `experiments.tune` config of one arm's search at ε (trainer "clip", public data)."""
  base = arm_config(config.search_base, arm, epsilon,
                    per_pair_overrides(config, arm, epsilon, results_dir), config.checkpoint_every)
  if data_dir:
    base.data.npz_dir = data_dir
  search = ml_collections.ConfigDict()
  search.trainer = "clip"
  search.base = base
  search.full_train_size = config.full_train_size
  search.stages = search_stages(config, arm, base)
  if subset:
    search = tune.scaled_to_subset(search, subset)
  return search


def benchmark_config(config, arm: str, epsilon: float, seed: int, chosen: dict, results_dir: str,
                     data_dir: str | None) -> ml_collections.ConfigDict:
  """``benchmark_base`` (CIFAR-10) training the arm at ε with ``seed``: the per-pair choice, then
  the arm's search's choice (``chosen``, its overrides)."""
  cfg = arm_config(config.benchmark_base, arm, epsilon,
                   per_pair_overrides(config, arm, epsilon, results_dir), config.checkpoint_every)
  cfg = tune.apply_overrides(cfg, chosen)
  cfg.seed = int(seed)
  if data_dir:
    cfg.data.npz_dir = data_dir
  return cfg


def run_arm(config, arm: str, epsilon: float, runs_dir: str, results_dir: str, data_dir: str | None,
            subset: int | None, train_fn: Callable | None = None, quiet: bool = True) -> dict:
  """One arm at ε: its search, then its runs once the search has chosen; dict(chosen, waiting)."""
  name = search_name(arm, epsilon)
  summary = tune.run_search(search_config(config, arm, epsilon, results_dir, data_dir, subset),
                            os.path.join(runs_dir, "search", name),
                            os.path.join(results_dir, SEARCH_FOLDER, name), train_fn=train_fn,
                            quiet=quiet)
  chosen = summary["chosen"] if summary["complete"] else None
  if not quiet:
    print(f"[people_benchmark] search {name}: {chosen or 'not finished: re-run to continue'}",
          flush=True)
  runs = [run_name(arm, epsilon, s) for s in config.seeds]
  if chosen is None:
    return dict(chosen=None, waiting=runs)
  for seed, run in zip(config.seeds, runs):
    cfg = benchmark_config(config, arm, epsilon, seed, chosen["overrides"], results_dir, data_dir)
    clip_benchmark.train_and_publish(cfg, os.path.join(runs_dir, "benchmark", run),
                                     os.path.join(results_dir, RUNS_FOLDER, run),
                                     dict(search=name, **chosen), train_fn, quiet,
                                     command="experiments.people_benchmark")
  return dict(chosen=chosen, waiting=[])


def check_config(config) -> None:
  """ValueError for an unknown arm, a search on the private data, or a search base whose
  training settings are not the benchmark's."""
  unknown = [a for a in config.arms if a not in ARMS]
  if unknown:
    raise ValueError(f"unknown arm(s) {unknown}: use {tuple(ARMS)}.")
  if REFERENCE not in config.arms:
    raise ValueError(f"the table takes every Δ against {REFERENCE}: keep it in arms.")
  bad_k = [k for k in config.k_grid if int(k) < 1 or int(k) != k]
  if not config.k_grid or bad_k:
    raise ValueError(f"k_grid must hold integers ≥ 1, got {tuple(config.k_grid)}.")
  clip_benchmark.check_bases(config)


def run_all(config, runs_dir: str, results_dir: str, data_dir: str | None = None,
            search_subset: int | None = None, train_fn: Callable | None = None,
            quiet: bool = True) -> dict:
  """Every arm's searches and runs (arm by arm), then the table."""
  check_config(config)
  chosen, waiting = {}, []
  for arm in config.arms:
    for epsilon in config.epsilons:
      out = run_arm(config, arm, float(epsilon), runs_dir, results_dir, data_dir, search_subset,
                    train_fn, quiet)
      chosen[search_name(arm, epsilon)] = out["chosen"]
      waiting += out["waiting"]
  table = write_table(config, results_dir)
  return dict(chosen=chosen, waiting=waiting, table=table, complete=not waiting)


# -- The table. ----------------------------------------------------------------------------


def load_records(config, results_dir: str, folder: str = RUNS_FOLDER) -> list[dict]:
  """The finished runs of the benchmark in ``results_dir/folder`` (``arm`` set) and, as
  references, the per-pair benchmark's DP-GCL and non-private runs (``arm`` "per_pair_dp_gcl",
  "non_private")."""
  records = []
  for r in clip_benchmark.load_results(os.path.join(results_dir, folder)):
    arm = r["name"].rsplit("_eps", 1)[0]
    if arm in ARMS:
      records.append(dict(r, arm=arm))
  if config.get("per_pair_benchmark"):
    for r in clip_benchmark.load_results(os.path.join(results_dir, config.per_pair_benchmark)):
      if r["method"] in ("dp_gcl", "non_private"):
        records.append(dict(r, arm="per_pair_dp_gcl" if r["method"] == "dp_gcl" else "non_private"))
  return records


def _settings(r: dict, arm: str) -> str:
  parts = [f"lr {r['learning_rate']:g}", f"τ {r.get('temperature', 1.0):g}"]
  if arm == "non_private":
    return ", ".join(parts)
  parts.append(f"B {r['clip_norm']:g}")
  if r.get("group_size") is not None:
    parts.append(f"s {r['group_size']:g}")
  return ", ".join(parts)


def _mean_std(values) -> tuple[float, float]:
  return render_results.mean_std(values)


def _delta(runs: dict, other: dict, metric: str) -> str:
  """runs − other paired by seed: "+0.019 ± 0.017, p 0.25" (p of the paired t-test)."""
  common = sorted(set(runs) & set(other))
  if not common:
    return "–"
  d = render_results.paired_difference([runs[s][metric] for s in common],
                                       [other[s][metric] for s in common])
  text = f"{d['mean']:+.3f}"
  if d["std"] == d["std"]:
    text += f" ± {d['std']:.3f}"
  if d["p"] == d["p"]:
    text += f", p {d['p']:.2g}"
  return text


def verdict(by_key: dict, epsilon: float) -> str:
  """The arm of best mean top-1 at ε, its mean ± std, and its paired Δ top-1 / top-5 against
  every other arm (only arms with results)."""
  present = [arm for arm in ARMS if (arm, epsilon) in by_key]
  if not present:
    return f"* ε = {epsilon:g} per person: no finished run yet."
  top1 = {
      arm: _mean_std([r["zero_shot_top1"] for r in by_key[(arm, epsilon)].values()])
      for arm in present
  }
  best = max(present, key=lambda a: top1[a][0])
  runs = by_key[(best, epsilon)]
  text = (f"* ε = {epsilon:g} per person: **{LABELS[best]}**, zero-shot top-1 "
          f"{render_results.fmt_ms(*top1[best])} (n = {len(runs)})")
  against = [
      f"against {LABELS[a]} Δ top-1 {_delta(runs, by_key[(a, epsilon)], 'zero_shot_top1')}, "
      f"Δ top-5 {_delta(runs, by_key[(a, epsilon)], 'zero_shot_top5')}" for a in present
      if a != best
  ]
  if against:
    text += "; " + "; ".join(against)
  missing = [LABELS[a] for a in ARMS if a not in present]
  if missing:
    text += f"; not run yet: {', '.join(missing)}"
  return text + "."


def benchmark_table(records: list[dict], epsilons) -> str:
  """The verdict at each ε, then per arm and ε: the chosen K and settings, per-pair ε (group
  privacy), σ, the sensitivity C (per person; per pair in group privacy), steps, zero-shot
  top-1 / top-5 (mean ± std over seeds) and Δ against (b), paired by seed; the per-pair
  references below each ε."""
  if not any(r["arm"] in ARMS for r in records):
    return "(no finished run of the privacy-per-person benchmark yet)"
  (k,) = {r["num_classes"] for r in records}
  by_key: dict[tuple, dict[int, dict]] = {}
  for r in records:
    epsilon = None if r["arm"] == "non_private" else r["epsilon"]
    by_key.setdefault((r["arm"], epsilon), {})[r["seed"]] = r["result"]
  lines = [
      "Verdict: the arm of best mean zero-shot top-1 on CIFAR-10 at each person-level ε, and "
      "its Δ against the others paired by seed (mean ± std, paired t-test p):", ""
  ]
  lines += [verdict(by_key, float(e)) for e in epsilons]
  lines += [
      "", f"Zero-shot accuracy on the CIFAR-10 test images (chance {1 / k:.3g} top-1, "
      f"{min(5, k) / k:.3g} top-5), mean ± std over seeds (n); Δ = arm − (b) at the same ε, "
      "paired by seed, mean ± std of the per-seed differences. ε is per person (δ = 1e-5) but "
      "in the reference rows (ε per pair, no person-level guarantee); the noise std is σ·C.", "",
      "| arm | ε | K | settings (chosen on CIFAR-100) | per-pair ε | σ | C | steps | n | "
      "zero-shot top-1 | zero-shot top-5 | Δ top-1 vs (b) | Δ top-5 vs (b) |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  ]
  for epsilon in (float(e) for e in epsilons):
    reference = by_key.get((REFERENCE, epsilon), {})
    for arm in (*ARMS, "per_pair_dp_gcl", "non_private"):
      runs = by_key.get((arm, None if arm == "non_private" else epsilon))
      if not runs:
        continue
      seeds = sorted(runs)
      first = runs[seeds[0]]
      cells = [
          render_results.fmt_ms(*_mean_std([runs[s][m] for s in seeds]))
          for m in ("zero_shot_top1", "zero_shot_top5")
      ]
      for metric in ("zero_shot_top1", "zero_shot_top5"):
        common = [s for s in seeds if s in reference]
        if arm == REFERENCE or not common:
          cells.append("–")
          continue
        d = render_results.paired_difference([runs[s][metric] for s in common],
                                             [reference[s][metric] for s in common])
        std = "" if d["std"] != d["std"] else f" ± {d['std']:.3f}"
        cells.append(f"{d['mean']:+.3f}{std} ({d['n']})")
      if arm in ARMS:
        label, k_cell = LABELS[arm], str(first.get("max_pairs_per_user", "–"))
        eps = f"{max(runs[s]['epsilon'] for s in seeds):.2f}"
      elif arm == "per_pair_dp_gcl":
        label, k_cell = "reference: DP-GCL per pair (per-pair benchmark)", "–"
        eps = f"{max(runs[s]['epsilon'] for s in seeds):.2f} per pair"
      else:
        label, k_cell, eps = "reference: non-private (per-pair benchmark)", "–", "∞"
      per_pair = (f"{max(runs[s]['epsilon_per_pair'] for s in seeds):.3g}"
                  if "epsilon_per_pair" in first else "–")
      sigma = f"{first['noise_multiplier']:.3g}" if "noise_multiplier" in first else "–"
      sensitivity = f"{first['sensitivity']:.3g}" if "sensitivity" in first else "–"
      lines.append(f"| {label} | {eps} | {k_cell} | {_settings(first, arm)} | {per_pair} | "
                   f"{sigma} | {sensitivity} | {first['steps']} | {len(seeds)} | "
                   + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_table(config, results_dir: str) -> str:
  """benchmark.md and benchmark.json in results_dir/people_benchmark; returns the table."""
  folder = os.path.join(results_dir, RUNS_FOLDER)
  records = load_records(config, results_dir)
  table = benchmark_table(records, config.epsilons)
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "benchmark.md"), "w") as f:
    f.write(table + "\n")
  workdirs.write_json(os.path.join(folder, "benchmark.json"),
                      [r for r in records if r["arm"] in ARMS])
  return table


def table_of(results_dir: str, folder: str = RUNS_FOLDER) -> str:
  """The table of the runs in ``results_dir/folder``, with the default config's ε and per-pair
  references (the ``people_benchmark:<folder>`` block of the results pages)."""
  from experiments.configs import people_benchmark as default  # pylint: disable=g-import-not-at-top
  config = default.get_config()
  return benchmark_table(load_records(config, results_dir, folder), config.epsilons)


def main(argv):
  clip_benchmark.prepare_main(argv)
  clip_benchmark.run_from_flags(run_all)


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  clip_benchmark.define_flags(
      "people_benchmark",
      "Benchmark configuration (search_base, benchmark_base, arms, epsilons, seeds, grids).",
      "Workdirs and checkpoints of every run (private: holds the noise keys).",
      "Where people_benchmark_search/ and people_benchmark/ are published (and where the "
      "per-pair benchmark's searches and runs are read).",
      "Search on this many CIFAR-100 training images (owners simulated on them, the same q and T "
      "as on the full data).")
  flags.adopt_module_key_flags(clip_benchmark)  # listed by --help as this module's


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  _define_flags()
  app.run(main)

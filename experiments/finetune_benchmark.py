r"""Private fine-tuning of pretrained two towers on CIFAR-10: the public-pretraining recipe.

    nice -n 19 python -m experiments.finetune_benchmark --data_dir=DIR        # all of it, resumable
    nice -n 19 python -m experiments.finetune_benchmark --data_dir=DIR --search_subset=10000

(``DIR`` holds cifar10.npz and cifar100.npz: ``python -m experiments.cifar --out DIR``.) One
command runs the whole benchmark, resumably (re-running it continues where it stopped), on the
two-tower model of `experiments.clip_benchmark` (image tower: the paper's embedding net; text
tower: a bag of words over the class names; zero-shot accuracy on the test images):

1. **Pretraining on public data.** Both towers are trained non-privately on CIFAR-100's training
   images and their fine class names (``config.pretrain``), and their params saved
   (``runs_dir/pretrain/params/non_private``). Every stage shares one vocabulary, the class
   names of CIFAR-100 (fine and coarse) and of CIFAR-10, so the text tower's token embeddings
   carry over.
2. **Search on public data, per variant.** For every variant of ``config.variants``,

   * ``scratch``: the towers from their random initialisation, every parameter trained (the
     mechanism benchmark's setting);
   * ``all``: the pretrained towers, every parameter fine-tuned;
   * ``heads``: the pretrained towers, the projection heads only (the last dense layer of each
     tower, `experiments.clip.is_head`, through ``make_private(trainable=)``; the rest frozen),

   and every mechanism (Logit-DP, DP-GCL, Naive-DP, the non-private reference: non-private
   fine-tuning for ``all`` and ``heads``) at every ε, the same sequential search as
   `experiments.clip_benchmark` (its `search_stages`, `run_searches`) on CIFAR-100's coarse
   labels, from the same base. No CIFAR-10 image or label enters any choice. The search's
   images are those the towers were pretrained on (with other texts): the search task is
   easier than CIFAR-10 for the pretrained variants, which can bias their choice toward
   smaller steps; the choice still uses public data only.
3. **Benchmark.** Each variant × mechanism × ε × seed fine-tunes (or trains) on CIFAR-10 with
   its own search's choice (`clip_benchmark.run_benchmark`).
4. **Table.** ``results_dir/finetune_benchmark/benchmark.md`` (and .json): zero-shot top-1 per
   mechanism, ε and variant (mean ± std over seeds), and the three answers: the share of the
   gap to non-private training that pretraining closes, Δ heads-only − every parameter at each
   ε (paired by seed), and the mechanism ranking of every variant. ``python -m
   experiments.render_results`` puts it in docs/RESULTS.md (block
   ``finetune_benchmark:finetune_benchmark``).

Published (small, shareable, no machine paths): ``results_dir/finetune_benchmark/pretrain/``,
``results_dir/finetune_benchmark/<variant>/clip_benchmark_search/<search>/`` and
``results_dir/finetune_benchmark/<variant>/clip_benchmark/<run>/``. Checkpoints, the pretrained
params and the secret seeds stay under ``runs_dir`` (default ``runs/finetune_benchmark``).

The privacy of a fine-tuned run: the frozen and initial values come from public CIFAR-100 only,
so the (ε, δ) of each private run is the whole guarantee for CIFAR-10 (docs/PRIVACY.md,
"Fine-tuning: frozen parameters").
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

from experiments import clip_benchmark
from experiments import render_results
from experiments import tune
from experiments import workdirs

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = "finetune_benchmark"
VARIANTS = ("scratch", "all", "heads")
VARIANT_LABELS = {
    "scratch": "from scratch", "all": "pretrained, every parameter",
    "heads": "pretrained, heads only"
}
LABELS = clip_benchmark.LABELS
METRIC = "zero_shot_top1"


def pretrained_params(runs_dir: str) -> str:
  """Where the pretrained towers' params are saved."""
  return os.path.abspath(os.path.join(runs_dir, "pretrain", "params", "non_private"))


def pretrain_config(config, data_dir: str | None):
  cfg = copy.deepcopy(config.pretrain)
  cfg.methods = ("non_private",)
  cfg.save_params = True
  if data_dir:
    cfg.data.npz_dir = data_dir
  return cfg


def pretrain(config, runs_dir: str, results_dir: str, data_dir: str | None,
             train_fn: Callable | None = None, quiet: bool = True) -> str:
  """Trains (or finds) the pretrained towers; the folder of their params."""
  from experiments import clip  # pylint: disable=g-import-not-at-top
  train_fn = train_fn or clip.train_and_evaluate
  cfg = pretrain_config(config, data_dir)
  workdir = os.path.join(runs_dir, "pretrain")
  clip.check_resumable(cfg, workdir)
  params = pretrained_params(runs_dir)
  if not (clip.is_finished(workdir, cfg.methods) and os.path.isdir(params)):
    if not quiet:
      print("[finetune_benchmark] pretraining on the public data", flush=True)
    with workdirs.timed_attempt(workdir, "experiments.finetune_benchmark") as attempt:
      attempt["returncode"] = 1
      train_fn(cfg, workdir, quiet=quiet)
      attempt["returncode"] = 0
  workdirs.publish(workdir, os.path.join(results_dir, FOLDER, "pretrain"))
  return params


def variant_config(config, variant: str, params_dir: str | None):
  """The clip_benchmark config of one variant: its bases start from the pretrained params
  (``all``, ``heads``) or from scratch, and train every parameter or the heads only."""
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}: use {VARIANTS}.")
  out = copy.deepcopy(config)
  for base in (out.search_base, out.benchmark_base):
    base.init_from = None if variant == "scratch" else params_dir
    base.trainable = "heads" if variant == "heads" else "all"
  return out


def _variant_dirs(runs_dir: str, results_dir: str, variant: str) -> tuple[str, str]:
  return os.path.join(runs_dir, variant), os.path.join(results_dir, FOLDER, variant)


def run_all(config, runs_dir: str, results_dir: str, data_dir: str | None = None,
            search_subset: int | None = None, train_fn: Callable | None = None,
            quiet: bool = True) -> dict:
  """Pretraining, then every variant's searches and benchmark runs, then the table."""
  check_config(config)
  params_dir = pretrain(config, runs_dir, results_dir, data_dir, train_fn, quiet)
  variants, complete = {}, True
  for variant in config.variants:
    cfg = variant_config(config, variant, params_dir)
    runs, results = _variant_dirs(runs_dir, results_dir, variant)
    chosen = clip_benchmark.run_searches(cfg, runs, results, data_dir, search_subset, train_fn,
                                         quiet)
    waiting = clip_benchmark.run_benchmark(cfg, chosen, runs, results, data_dir, train_fn, quiet)
    variants[variant] = dict(chosen=chosen, waiting=waiting)
    complete = complete and not waiting and all(c is not None for c in chosen.values())
  table = write_table(results_dir)
  return dict(variants=variants, table=table, complete=complete)


def load_results(folder: str) -> list[dict]:
  """Every finished benchmark run of every variant in ``folder`` (results_dir/finetune_benchmark):
  `clip_benchmark.load_results`' records with their ``variant``."""
  records = []
  for variant in VARIANTS:
    runs = os.path.join(folder, variant, "clip_benchmark")
    records += [dict(r, variant=variant) for r in clip_benchmark.load_results(runs)]
  return records


def _by_key(records: list[dict]) -> dict[tuple, dict[int, float]]:
  """{(variant, mechanism, ε or None): {seed: zero-shot top-1}}."""
  out: dict[tuple, dict[int, float]] = {}
  for r in records:
    out.setdefault((r["variant"], r["method"], r["epsilon"]), {})[r["seed"]] = r["result"][METRIC]
  return out


def _cell(runs: dict[int, float] | None) -> str:
  if not runs:
    return "–"
  mean, std = render_results.mean_std(list(runs.values()))
  return f"{render_results.fmt_ms(mean, std)} ({len(runs)})"


def _mean(runs: dict[int, float] | None) -> float | None:
  return None if not runs else render_results.mean_std(list(runs.values()))[0]


def _paired(a: dict[int, float] | None, b: dict[int, float] | None) -> str:
  common = sorted(set(a or {}) & set(b or {}))
  if not common:
    return "–"
  assert a is not None and b is not None
  d = render_results.paired_difference([a[s] for s in common], [b[s] for s in common])
  std = "" if d["std"] != d["std"] else f" ± {d['std']:.3f}"
  return f"{d['mean']:+.3f}{std} ({d['n']})"


def benchmark_table(records: list[dict]) -> str:
  """The zero-shot top-1 of every mechanism × variant × ε and the answers to the three
  questions (module docstring), from the finished runs."""
  if not records:
    return "(no finished fine-tuning benchmark run yet)"
  (k,) = {r["num_classes"] for r in records}
  runs = _by_key(records)
  epsilons = sorted({e for (_, _, e) in runs if e is not None})
  variants = [v for v in VARIANTS if any(key[0] == v for key in runs)]
  mechanisms = [m for m in LABELS if m != "non_private" and any(key[1] == m for key in runs)]
  header = "| mechanism | ε | " + " | ".join(VARIANT_LABELS[v] for v in variants) + " |"
  rule = "|---|---|" + "---|" * len(variants)
  lines = [
      f"Zero-shot top-1 on the CIFAR-10 test images (chance {1 / k:.3g}), mean ± std over seeds "
      "(n). Pretraining: both towers, non-private, on public CIFAR-100; every setting chosen by "
      "the same search on CIFAR-100's coarse labels.", "", header, rule
  ]
  for epsilon in epsilons:
    for method in mechanisms:
      lines.append(f"| {LABELS[method]} | {epsilon:g} | "
                   + " | ".join(_cell(runs.get((v, method, epsilon))) for v in variants) + " |")
  lines.append("| Non-private | ∞ | "
               + " | ".join(_cell(runs.get((v, "non_private", None))) for v in variants) + " |")

  # 1. The share of the gap to non-private training that pretraining closes.
  reference = runs.get(("all", "non_private", None))
  lines += [
      "", "**How much of the gap to non-private does public pretraining close?** Share closed "
      "= (fine-tuned − from scratch) / (non-private fine-tuning of every parameter − from "
      "scratch), from the means; 1 closes the whole gap, 0 none.", "",
      "| mechanism | ε | gap from scratch | share closed, every parameter | "
      "share closed, heads only |", "|---|---|---|---|---|"
  ]
  ref = _mean(reference)
  for epsilon in epsilons:
    for method in mechanisms:
      scratch = _mean(runs.get(("scratch", method, epsilon)))
      cells = []
      gap = None if ref is None or scratch is None else ref - scratch
      for variant in ("all", "heads"):
        tuned = _mean(runs.get((variant, method, epsilon)))
        cells.append(
            "–" if gap is None or tuned is None or gap <= 0 else f"{(tuned - scratch) / gap:.2f}")
      lines.append(f"| {LABELS[method]} | {epsilon:g} | "
                   f"{'–' if gap is None else f'{gap:+.3f}'} | " + " | ".join(cells) + " |")

  # 2. Heads only against every parameter, per ε.
  lines += [
      "", "**Does training fewer parameters help at each ε?** Δ = heads only − every "
      "parameter, paired by seed (mean ± std of the per-seed differences).", "",
      "| mechanism | ε | Δ top-1 |", "|---|---|---|"
  ]
  for epsilon in epsilons:
    for method in mechanisms:
      lines.append(
          f"| {LABELS[method]} | {epsilon:g} | "
          f"{_paired(runs.get(('heads', method, epsilon)), runs.get(('all', method, epsilon)))} |")
  lines.append(f"| Non-private | ∞ | "
               f"{_paired(runs.get(('heads', 'non_private', None)), reference)} |")

  # 3. The mechanism ranking of every variant.
  lines += [
      "", "**Does it change which mechanism to use?** Mechanisms by mean top-1, best first, and "
      f"each one's Δ against {LABELS[clip_benchmark.REFERENCE]} paired by seed.", "",
      "| variant | ε | ranking | Δ vs DP-GCL |", "|---|---|---|---|"
  ]
  for epsilon in epsilons:
    for variant in variants:
      means = {m: _mean(runs.get((variant, m, epsilon))) for m in mechanisms}
      ranked = sorted((m for m in mechanisms if means[m] is not None), key=lambda m: -means[m])
      if not ranked:
        continue
      dgcl = runs.get((variant, clip_benchmark.REFERENCE, epsilon))
      deltas = ", ".join(f"{LABELS[m]} {_paired(runs.get((variant, m, epsilon)), dgcl)}"
                         for m in ranked if m != clip_benchmark.REFERENCE)
      lines.append(f"| {VARIANT_LABELS[variant]} | {epsilon:g} | "
                   f"{' > '.join(LABELS[m] for m in ranked)} | {deltas or '–'} |")
  return "\n".join(lines)


def write_table(results_dir: str) -> str:
  """benchmark.md and benchmark.json in results_dir/finetune_benchmark; returns the table."""
  folder = os.path.join(results_dir, FOLDER)
  records = load_results(folder)
  table = benchmark_table(records)
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "benchmark.md"), "w") as f:
    f.write(table + "\n")
  workdirs.write_json(os.path.join(folder, "benchmark.json"), records)
  return table


def check_config(config) -> None:
  """ValueError unless the variants are known, the pretraining and the search run on public
  data, and the search and the benchmark share every training setting but the data
  (`clip_benchmark.check_config`)."""
  unknown = [v for v in config.variants if v not in VARIANTS]
  if unknown:
    raise ValueError(f"unknown variant(s) {unknown}: use {VARIANTS}.")
  if config.pretrain.data.name in tune.PRIVATE_DATA:
    raise ValueError(f"the pretraining runs on public data; pretrain.data.name = "
                     f"{config.pretrain.data.name!r} is the private data set.")
  vocabularies = {
      tuple(c.get("vocabulary_from") or ())
      for c in (config.pretrain, config.search_base, config.benchmark_base)
  }
  if len(vocabularies) != 1:
    raise ValueError("pretrain, search_base and benchmark_base must share vocabulary_from: the "
                     "text tower's token embeddings are indexed by it.")
  clip_benchmark.check_config(config)


def main(argv):
  clip_benchmark.prepare_main(argv)
  clip_benchmark.run_from_flags(run_all)


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  clip_benchmark.define_flags(
      FOLDER, "Benchmark configuration (pretrain, search_base, benchmark_base, variants, "
      "mechanisms, epsilons, seeds, grids).",
      "Workdirs, checkpoints and pretrained params (private: holds the noise keys).",
      f"Where {FOLDER}/ is published.")
  flags.adopt_module_key_flags(clip_benchmark)  # listed by --help as this module's


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  _define_flags()
  app.run(main)

r"""Private two-tower CIFAR-10: every mechanism tuned on public data, then compared.

    python -m experiments.clip_benchmark --data_dir=DIR            # the search, then the runs
    python -m experiments.clip_benchmark --data_dir=DIR --search_subset=10000   # smaller search

One command runs the whole benchmark, resumably (re-running it continues where it stopped):

1. **Search on public data.** For every mechanism of ``config.mechanisms`` (Logit-DP, DP-GCL,
   Naive-DP, non-private) and, for the private ones, every ε of ``config.epsilons``, the same
   sequential coordinate search (`experiments.tune`, zero-shot top-1 on CIFAR-100's public
   test split) over the mechanism's free settings, from the same base (``search_base``: the
   CIFAR-10 run with CIFAR-100's coarse labels as data: same records count, q, T and σ):

   * learning rate × ``grids.learning_rate`` (of the mechanism's base rate);
   * temperature τ ∈ ``grids.temperature``;
   * clip norm B ∈ ``grids.clip_norm`` (private mechanisms);
   * a last stage of two candidates: DP-GCL's expected group size ∈ ``grids.group_size``;
     the others a wider learning rate × ``grids.wide_learning_rate``.

   Every private mechanism gets the same number of candidates (1 + 2 + 2 + 2 + 2 = 9 with the
   default grids), the non-private reference 7 (it has no B). Each stage keeps its incumbent
   unless a candidate beats it. No CIFAR-10 image or label is used (`experiments.tune` refuses
   cifar10 data).
2. **Benchmark.** Each mechanism × ε × seed of ``config.seeds`` trains `benchmark_base`
   (`clip_cifar10`, two towers, CIFAR-10) with its own search's choice, one workdir per run
   (``runs_dir/benchmark/<mechanism>_eps<ε>_s<seed>``, private runs checkpointed every
   ``checkpoint_every`` steps); a finished run (or its published copy) is skipped.
3. **Table.** ``results_dir/clip_benchmark/benchmark.md`` (and .json): zero-shot top-1 and
   top-5, mean ± std over seeds, and each mechanism's Δ against DP-GCL paired by seed
   (mean ± std of the per-seed differences, `render_results.paired_difference`).

Published (small, shareable, no machine paths): ``results_dir/clip_benchmark_search/<search>/``
(search.json, search.md, every candidate's config.json, results.json, wallclock.json) and
``results_dir/clip_benchmark/<run>/``. Checkpoints and the secret seeds stay under ``runs_dir``.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from typing import Any

import ml_collections

from experiments import render_results
from experiments import tune
from experiments import workdirs

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRIVATE = ("logit_dp", "dp_gcl", "naive_dp")
LABELS = {
    "logit_dp": "Logit-DP", "dp_gcl": "DP-GCL", "naive_dp": "Naive-DP", "non_private": "Non-private"
}
# The settings a candidate may change, and where they are in the clip config.
_LEARNING_RATE = "learning_rates.{}"
REFERENCE = "dp_gcl"  # the mechanism every Δ is taken against


def search_name(method: str, epsilon: float | None) -> str:
  """The search of a mechanism at ε ("non_private": one search)."""
  return method if epsilon is None else f"{method}_eps{epsilon:g}"


def run_name(method: str, epsilon: float | None, seed: int) -> str:
  return f"{search_name(method, epsilon)}_s{seed}"


def _epsilons(config, method: str) -> tuple:
  return (None,) if method == "non_private" else tuple(float(e) for e in config.epsilons)


def _with(config, method: str, epsilon: float | None, **fields) -> ml_collections.ConfigDict:
  """A clip config training ``method`` alone (at ε), with ``fields`` set."""
  out = copy.deepcopy(config)
  out.methods = (method,)
  if epsilon is not None:
    out.target_epsilon = float(epsilon)
  for k, v in fields.items():
    out[k] = v
  return out


def search_stages(config, method: str) -> list[dict]:
  """The stages of ``method``'s search (see the module docstring)."""
  grids = config.grids
  lr_key = _LEARNING_RATE.format(method)
  base_lr = float(config.search_base.learning_rates[method])

  def stage(name, key, values, tag):
    return dict(name=name,
                candidates=[dict(name=f"{tag}{v:g}", overrides={key: v}) for v in values])

  stages = [dict(name="base", candidates=[dict(name="base", overrides={})])]
  scaled = lambda multipliers: [float(f"{base_lr * m:.3g}") for m in multipliers]
  stages.append(stage("learning rate", lr_key, scaled(grids.learning_rate), "lr"))
  stages.append(stage("temperature", "temperature", list(grids.temperature), "tau"))
  if method in PRIVATE:
    stages.append(stage("clip norm", "clip_norm", list(grids.clip_norm), "clip"))
  if method == "dp_gcl":
    stages.append(stage("group size", "dp_gcl.group_size", list(grids.group_size), "group"))
  else:
    stages.append(stage("wide learning rate", lr_key, scaled(grids.wide_learning_rate), "lr"))
  return [s for s in stages if s["candidates"]]


def search_config(config, method: str, epsilon: float | None, data_dir: str | None,
                  subset: int | None) -> ml_collections.ConfigDict:
  """The `experiments.tune` config of one search (trainer "clip")."""
  base = _with(config.search_base, method, epsilon, checkpoint_every=config.checkpoint_every)
  if data_dir:
    base.data.npz_dir = data_dir
  search = ml_collections.ConfigDict()
  search.trainer = "clip"
  search.base = base
  search.full_train_size = config.full_train_size
  search.stages = search_stages(config, method)
  if subset:
    search = tune.scaled_to_subset(search, subset)
  return search


def run_searches(config, runs_dir: str, results_dir: str, data_dir: str | None, subset: int | None,
                 train_fn: Callable | None = None, quiet: bool = True) -> dict[str, dict | None]:
  """Runs (or resumes) every search; {search name: chosen dict(name, overrides) or None}."""
  chosen = {}
  for method in config.mechanisms:
    for epsilon in _epsilons(config, method):
      name = search_name(method, epsilon)
      summary = tune.run_search(search_config(config, method, epsilon, data_dir, subset),
                                os.path.join(runs_dir, "search", name),
                                os.path.join(results_dir, "clip_benchmark_search", name),
                                train_fn=train_fn, quiet=quiet)
      chosen[name] = summary["chosen"] if summary["complete"] else None
      if not quiet:
        print(
            f"[clip_benchmark] search {name}: "
            f"{chosen[name] or 'not finished: re-run to continue'}", flush=True)
  return chosen


def benchmark_config(config, method: str, epsilon: float | None, seed: int,
                     overrides: dict[str, Any], data_dir: str | None) -> ml_collections.ConfigDict:
  """`benchmark_base` training ``method`` at ε with seed ``seed`` and its search's choice."""
  cfg = tune.apply_overrides(
      _with(config.benchmark_base, method, epsilon, seed=int(seed),
            checkpoint_every=config.checkpoint_every), overrides)
  if data_dir:
    cfg.data.npz_dir = data_dir
  return cfg


def run_benchmark(config, chosen: dict, runs_dir: str, results_dir: str, data_dir: str | None,
                  train_fn: Callable | None = None, quiet: bool = True) -> list[str]:
  """Trains every run whose search has chosen (skipping finished ones); the runs not done."""
  waiting = []
  for method in config.mechanisms:
    for epsilon in _epsilons(config, method):
      for seed in config.seeds:
        name = run_name(method, epsilon, seed)
        choice = chosen.get(search_name(method, epsilon))
        if choice is None:
          waiting.append(name)
          continue
        cfg = benchmark_config(config, method, epsilon, seed, choice["overrides"], data_dir)
        train_and_publish(cfg, os.path.join(runs_dir, "benchmark", name),
                          os.path.join(results_dir, "clip_benchmark", name),
                          dict(search=search_name(method, epsilon), **choice), train_fn, quiet)
  return waiting


def train_and_publish(cfg, workdir: str, published: str, choice: dict,
                      train_fn: Callable | None = None, quiet: bool = True,
                      command: str = "experiments.clip_benchmark") -> None:
  """Trains the clip run ``cfg`` in ``workdir`` (resuming it; skipped when it or its published
  copy has finished) and publishes its small files and ``choice`` (choice.json) to
  ``published``."""
  from experiments import clip  # pylint: disable=g-import-not-at-top
  train_fn = train_fn or clip.train_and_evaluate
  clip.check_resumable(cfg, workdir)
  clip.check_resumable(cfg, published)
  if clip.is_finished(published, cfg.methods):
    return
  if not clip.is_finished(workdir, cfg.methods):
    if not quiet:
      print(
          f"[{command.split('.')[-1]}] {os.path.basename(published)}: training with "
          f"{choice['overrides']}", flush=True)
    with workdirs.timed_attempt(workdir, command) as attempt:
      attempt["returncode"] = 1
      train_fn(cfg, workdir, quiet=quiet)
      attempt["returncode"] = 0
  workdirs.publish(workdir, published)
  with open(os.path.join(published, "choice.json"), "w") as f:
    json.dump(choice, f, indent=1)


def load_results(folder: str) -> list[dict]:
  """Every finished benchmark run in ``folder``: dict(name (the run's folder), method, epsilon,
  seed, result, choice, num_classes)."""
  records = []
  if not os.path.isdir(folder):
    return records
  for name in sorted(os.listdir(folder)):
    path = os.path.join(folder, name, "results.json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      results = json.load(f)
    with open(os.path.join(folder, name, "config.json")) as f:
      cfg = json.load(f)
    choice = {}
    if os.path.exists(os.path.join(folder, name, "choice.json")):
      with open(os.path.join(folder, name, "choice.json")) as f:
        choice = json.load(f)
    for method, r in results["methods"].items():
      private = method != "non_private"
      records.append(
          dict(name=name, method=method, epsilon=float(cfg["target_epsilon"]) if private else None,
               seed=int(cfg["seed"]), result=r, choice=choice.get("overrides", {}),
               num_classes=results["num_classes"]))
  return records


def _settings(r: dict, method: str) -> str:
  parts = [f"lr {r.get('learning_rate', float('nan')):g}", f"τ {r.get('temperature', 1.0):g}"]
  if method != "non_private":
    parts.append(f"B {r['clip_norm']:g}")
  if method == "dp_gcl":
    parts.append(f"s {r['group_size']:g}")
  return ", ".join(parts)


def benchmark_table(records: list[dict]) -> str:
  """Zero-shot top-1 / top-5 per mechanism and ε (mean ± std over seeds) and Δ against DP-GCL
  at the same ε, paired by seed (mean ± std of the differences; the non-private reference
  against DP-GCL at every ε)."""
  if not records:
    return "(no finished benchmark run yet)"
  classes = {r["num_classes"] for r in records}
  (k,) = classes
  by_key: dict[tuple, dict[int, dict]] = {}
  for r in records:
    by_key.setdefault((r["method"], r["epsilon"]), {})[r["seed"]] = r["result"]
  epsilons = sorted({e for (_, e) in by_key if e is not None})
  lines = [
      f"Zero-shot accuracy on the CIFAR-10 test images (chance {1 / k:.3g} top-1, "
      f"{min(5, k) / k:.3g} top-5), mean ± std over seeds (n); Δ = mechanism − DP-GCL at the same "
      "ε, paired by seed, mean ± std of the per-seed differences.", "",
      "| mechanism | ε | settings (chosen on CIFAR-100) | σ | steps | n | zero-shot top-1 | "
      "zero-shot top-5 | Δ top-1 vs DP-GCL | Δ top-5 vs DP-GCL |",
      "|---|---|---|---|---|---|---|---|---|---|"
  ]
  order = [m for m in LABELS if any(key[0] == m for key in by_key)]
  for epsilon in epsilons:
    reference = by_key.get((REFERENCE, epsilon), {})
    for method in order:
      runs = by_key.get((method, None if method == "non_private" else epsilon))
      if not runs:
        continue
      seeds = sorted(runs)
      first = runs[seeds[0]]
      cells = []
      for metric in ("zero_shot_top1", "zero_shot_top5"):
        cells.append(
            render_results.fmt_ms(*render_results.mean_std([runs[s][metric] for s in seeds])))
      for metric in ("zero_shot_top1", "zero_shot_top5"):
        common = [s for s in seeds if s in reference]
        if method == REFERENCE or not common:
          cells.append("–")
          continue
        d = render_results.paired_difference([runs[s][metric] for s in common],
                                             [reference[s][metric] for s in common])
        std = "" if d["std"] != d["std"] else f" ± {d['std']:.3f}"
        cells.append(f"{d['mean']:+.3f}{std} ({d['n']})")
      private = method != "non_private"
      eps = f"{max(runs[s]['epsilon'] for s in seeds):.2f}" if private else "∞"
      sigma = f"{first['noise_multiplier']:.3g}" if private else "–"
      lines.append(f"| {LABELS[method]} | {eps} | {_settings(first, method)} | {sigma} | "
                   f"{first['steps']} | {len(seeds)} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_table(results_dir: str) -> str:
  """benchmark.md and benchmark.json in results_dir/clip_benchmark; returns the table."""
  folder = os.path.join(results_dir, "clip_benchmark")
  records = load_results(folder)
  table = benchmark_table(records)
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "benchmark.md"), "w") as f:
    f.write(table + "\n")
  workdirs.write_json(os.path.join(folder, "benchmark.json"), records)
  return table


def run_all(config, runs_dir: str, results_dir: str, data_dir: str | None = None,
            search_subset: int | None = None, train_fn: Callable | None = None,
            quiet: bool = True) -> dict:
  """The searches, the benchmark runs whose search has finished, and the table."""
  check_config(config)
  chosen = run_searches(config, runs_dir, results_dir, data_dir, search_subset, train_fn, quiet)
  waiting = run_benchmark(config, chosen, runs_dir, results_dir, data_dir, train_fn, quiet)
  table = write_table(results_dir)
  complete = not waiting and all(v is not None for v in chosen.values())
  return dict(chosen=chosen, waiting=waiting, table=table, complete=complete)


def time_steps(config, data_dir: str | None, num_steps: int = 3, quiet: bool = True) -> dict:
  """Seconds of the first step (compilation included) and of the next ``num_steps`` steps of
  every mechanism at the benchmark's size, side by side in one process: for planning the
  full run. {mechanism: dict(first_step_s, step_s (median), batch_size)}."""
  import time  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import logit_dp  # pylint: disable=g-import-not-at-top
  from experiments import clip  # pylint: disable=g-import-not-at-top

  base = benchmark_config(config, "logit_dp", max(config.epsilons), 0, {}, data_dir)
  ds = clip.load_images(base)
  texts = clip.class_texts(ds["names"], base.text_template)
  vocab = clip.Vocabulary(texts)
  tokens = vocab.tokenize(texts)
  embed_images, embed_texts, params = clip.make_towers(
      base, len(vocab), ds["x_train"].shape[1:], jax.tree_util.tree_map(lambda a: a[:1], tokens))
  loss = logit_dp.losses.contrastive(base.temperature)
  out = {}
  for method in config.mechanisms:
    cfg = benchmark_config(config, method, max(config.epsilons), 0, {}, data_dir)
    if method == "non_private":
      batcher = logit_dp.sampling.ShuffledBatcher(len(ds["y_train"]), cfg.batch_size, seed=0)
      optimizer = optax.adam(cfg.learning_rates.non_private)

      @jax.jit
      def plain_step(p, state, x, t, mask, optimizer=optimizer):
        objective = lambda q: loss(
            logit_dp.losses.cosine_similarity(embed_images(q, x), embed_texts(q, t)), mask)
        grads = jax.grad(objective)(p)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state

      state, p = optimizer.init(params), params
      inputs = [(*clip._pairs(ds, tokens, idx), mask, {})
                for _, (idx, mask) in zip(range(num_steps + 1), batcher.epoch(0))]
      step = lambda p, state, x, t, mask, ids, fn=plain_step: fn(p, state, x, t, mask)
    else:
      private = logit_dp.make_private(embed_images, loss, cfg.clip_norm,
                                      target_epsilon=cfg.target_epsilon,
                                      target_delta=cfg.target_delta, num_records=len(ds["y_train"]),
                                      expected_batch_size=cfg.batch_size, epochs=cfg.num_epochs,
                                      optimizer=optax.adam(cfg.learning_rates[method]), mean=True,
                                      noise_key=jax.random.key(0), sampler_seed=0,
                                      positive_embed_fn=embed_texts,
                                      **clip.make_private_method(cfg, method))
      state, p = private.optimizer.init(params), params
      grouped = method == "dp_gcl"
      inputs = [(*clip._pairs(ds, tokens, b.indices), b.mask,
                 dict(record_ids=b.indices) if grouped else {})
                for b in private.batches(num_steps + 1)]  # each step recorded first
      train_step = private.make_train_step()
      step = lambda p, state, x, t, mask, ids, fn=train_step: fn(p, state, x, t, mask, **ids)[:2]
    times = []
    for x, t, mask, ids in inputs:
      t0 = time.time()
      p, state = step(p, state, x, t, mask, ids)
      jax.block_until_ready(p)
      times.append(time.time() - t0)
    out[method] = dict(first_step_s=round(times[0], 2), step_s=round(float(np.median(times[1:])),
                                                                     3), batch_size=cfg.batch_size)
    if not quiet:
      print(f"[clip_benchmark] {method}: {out[method]}", flush=True)
  return out


def check_config(config) -> None:
  """ValueError unless the search and the benchmark share every training setting but the data,
  the search runs on public data, and the mechanisms are known."""
  unknown = [m for m in config.mechanisms if m not in LABELS]
  if unknown:
    raise ValueError(f"unknown mechanism(s) {unknown}: use {tuple(LABELS)}.")
  if REFERENCE not in config.mechanisms:
    raise ValueError(f"the table takes every Δ against {REFERENCE}: keep it in mechanisms.")
  check_bases(config)


def check_bases(config) -> None:
  """ValueError unless ``config.search_base`` runs on public data and shares every training
  setting of ``config.benchmark_base`` but the data."""
  if config.search_base.data.name in tune.PRIVATE_DATA:
    raise ValueError(f"the search runs on public data; search_base.data.name = "
                     f"{config.search_base.data.name!r} is the private data set.")
  ignore = {"data", "methods", "seed", "target_epsilon", "checkpoint_every", "log_every"}
  search = json.loads(config.search_base.to_json_best_effort())
  bench = json.loads(config.benchmark_base.to_json_best_effort())
  differ = sorted(
      k for k in set(search) | set(bench) if k not in ignore and search.get(k) != bench.get(k))
  if differ:
    raise ValueError(f"search_base and benchmark_base differ in {differ}: the chosen settings "
                     "would not mean the same on CIFAR-10.")


def prepare_main(argv):
  """A benchmark driver's absl entry: refuses extra arguments, logs warnings only; the flags."""
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  return flags.FLAGS


def run_from_flags(run_all_fn: Callable) -> None:
  """Runs a driver's ``run_all`` with the flags of `define_flags` and prints its table, then
  whether it is complete (re-running the same command continues where it stopped)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  out = run_all_fn(f.config, f.runs_dir, f.results_dir, f.data_dir, f.search_subset, quiet=False)
  print(out["table"])
  if out["complete"]:
    print("benchmark complete")
  elif isinstance(out.get("waiting"), list):
    print(f"not finished ({len(out['waiting'])} run(s) wait for their search): re-run the same "
          "command to continue")
  else:
    print("not finished: re-run the same command to continue")


_SEARCH_SUBSET_HELP = ("Search on this many CIFAR-100 training images, the expected batch scaled "
                       "by search_subset / 50,000 (the same q, T and σ as the full search).")


def define_flags(config_name: str, config_help: str, runs_help: str, results_help: str,
                 search_subset_help: str = _SEARCH_SUBSET_HELP) -> None:
  """The flags every benchmark driver takes: --config (default experiments/configs/
  <config_name>.py), --data_dir, --runs_dir (default runs/<config_name>), --results_dir
  (default docs/results) and --search_subset."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flags.DEFINE_config_file(
      "config", os.path.join(_REPO, "experiments", "configs", f"{config_name}.py"), config_help,
      lock_config=False)
  flags.DEFINE_string("data_dir", None, "Folder with cifar10.npz and cifar100.npz.")
  flags.DEFINE_string("runs_dir", os.path.join("runs", config_name), runs_help)
  flags.DEFINE_string("results_dir", os.path.join("docs", "results"), results_help)
  flags.DEFINE_integer("search_subset", None, search_subset_help)


def main(argv):
  f = prepare_main(argv)
  if f.time_steps:
    print(json.dumps(time_steps(f.config, f.data_dir, f.time_steps, quiet=False), indent=1))
    return
  run_from_flags(run_all)


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  define_flags(
      "clip_benchmark",
      "Benchmark configuration (search_base, benchmark_base, mechanisms, epsilons, seeds, "
      "grids).", "Workdirs and checkpoints of every run (private: holds the noise keys).",
      "Where clip_benchmark_search/ and clip_benchmark/ are published.")
  flags.DEFINE_integer(
      "time_steps", 0, "Instead of running: time the first and this many more steps of every "
      "mechanism at the benchmark's size (CIFAR-10, the base settings), side by side.")


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  _define_flags()
  app.run(main)

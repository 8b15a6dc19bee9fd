r"""Sequential search of Logit-DP settings on public data.

    python -m experiments.tune --config=experiments/configs/tune_cifar100.py \
        --config.base.data.npz_dir=DIR --runs_dir=runs/tune_cifar100 \
        --results_dir=docs/results/tune_cifar100 [--subset=5000]

The config holds ``base`` (a training config of `experiments.train`, Logit-DP only, on
public data; or, with ``trainer = "clip"``, a config of `experiments.clip` training one method,
ranked by zero-shot top-1: `experiments.clip_benchmark` builds those) and ``stages``: a list
of ``dict(name, candidates=[dict(name, overrides)])``.
``overrides`` maps dotted config keys (``"temperature"``, ``"model.embedding_dim"``,
``"learning_rates.logit_dp"``, …) to values. Stage k's candidates are the incumbent's
overrides updated with their own; the incumbent after stage k is the best of the incumbent
and stage k's candidates by `rank_key`: best 3-NN accuracy, ties to fewer steps T, then to
the earlier candidate. Each candidate trains in ``runs_dir/<name>`` with
`train.train_and_evaluate`; a finished one (`workdirs.is_finished`, in its workdir or, on a
new machine without runs_dir, in its published copy ``results_dir/<name>``) is skipped, an
unfinished one resumes from its checkpoints, and the search stops after a stage with an
unfinished candidate (re-running continues it). A candidate whose training diverges
(`FloatingPointError`) is recorded as diverged, ranks last and is not retried. σ is never set
by a candidate: the accountant recalibrates it for the candidate's q and T at the base's (ε, δ).

Writes ``results_dir/search.json`` (every candidate's overrides, T, σ, ε, 3-NN accuracy,
linear probe, wall-clock; the stages' winners; the choice) and ``results_dir/search.md``
after every candidate (``complete`` false and nothing chosen until the last),
copies every finished candidate's config.json, results.json and wallclock.json to
``results_dir/<name>/``, and prints the chosen candidate.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import ml_collections
from absl import app
from absl import flags

from experiments import render_results
from experiments import workdirs

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULE = ("best 3-NN accuracy on the public test split; ties to fewer steps T, then to the "
        "earlier candidate")
CLIP_RULE = ("best zero-shot top-1 accuracy on the public test split; ties to fewer steps T, "
             "then to the earlier candidate")
#: What a search trains: ``config.trainer`` "train" (`experiments.train`, Logit-DP, 3-NN
#: accuracy) or "clip" (`experiments.clip`, one method of two towers, zero-shot top-1).
TRAINERS = ("train", "clip")
# A candidate may not change what is private, the privacy target, or how σ is calibrated.
FORBIDDEN_OVERRIDES = ("data", "projection", "methods", "target_epsilon", "target_delta",
                       "noise_multiplier", "accountant", "privacy_seed", "allow_exceeding_budget")
PRIVATE_DATA = ("cifar10",)
# Written into a candidate's workdir when its training diverged (train's FloatingPointError):
# the candidate is done, ranks last, and is not retried.
DIVERGED_FILE = "diverged.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: dict[str, Any]) -> ml_collections.ConfigDict:
  """A copy of ``config`` with every dotted key of ``overrides`` set (the key must exist).

  A deep copy, so that typed placeholders (``data.npz_dir``) stay overridable from the command
  line; ``copy_and_resolve_references`` would turn them into untyped ``None``.
  """
  out = copy.deepcopy(config)
  for dotted, value in overrides.items():
    *path, leaf = dotted.split(".")
    node = out
    for k in path:
      if k not in node:
        raise ValueError(f"override {dotted!r}: the config has no {k!r}.")
      node = node[k]
    if leaf not in node:
      raise ValueError(f"override {dotted!r}: the config has no {leaf!r}.")
    node[leaf] = tuple(value) if isinstance(value, list) else value
  return out


class Trainer(NamedTuple):
  """How a search trains a candidate and reads its result."""
  train_fn: Callable  # train_fn(cfg, workdir, quiet=...)
  check_resumable: Callable  # (cfg, workdir) -> None, ValueError for another config
  is_finished: Callable  # workdir -> bool
  result: Callable  # finished workdir -> dict(steps, ..., accuracy)
  rule: str


def trainer_of(config) -> Trainer:
  """The `Trainer` of ``config.trainer`` (default "train")."""
  name = config.get("trainer", "train")
  if name == "clip":
    from experiments import clip  # pylint: disable=g-import-not-at-top
    return Trainer(clip.train_and_evaluate, clip.check_resumable, clip.is_finished,
                   clip.search_result, CLIP_RULE)
  if name != "train":
    raise ValueError(f"config.trainer must be one of {TRAINERS}, got {name!r}.")
  from experiments import train  # pylint: disable=g-import-not-at-top
  return Trainer(train.train_and_evaluate, train.check_resumable, workdirs.is_finished,
                 _train_result, RULE)


def _train_result(workdir: str) -> dict:
  r = _read_json(os.path.join(workdir, "results.json"))["logit_dp"]
  return dict(steps=int(r["steps"]), noise_multiplier=r["noise_multiplier"],
              sampling_rate=r["sampling_rate"], epsilon=r["epsilon"], delta=r["delta"],
              clip_norm=r.get("clip_norm"), accuracy=float(r["accuracy"]),
              linear_probe=r.get("linear_probe"), train_seconds=r.get("train_seconds"))


def check_search_config(config) -> None:
  """ValueError unless the search trains one method (Logit-DP for "train"), on public data,
  with σ from the accountant and unique candidate names that are folder names."""
  base = config.base
  trainer = config.get("trainer", "train")
  if trainer not in TRAINERS:
    raise ValueError(f"config.trainer must be one of {TRAINERS}, got {trainer!r}.")
  if base.data.get("name") in PRIVATE_DATA:
    raise ValueError(f"the search runs on public data only; base.data.name = "
                     f"{base.data.name!r} is the private data set.")
  projection = base.get("projection")
  if projection is not None and projection.get("reference") in PRIVATE_DATA:
    raise ValueError(f"the projected bound's reference inputs come from "
                     f"{projection.reference!r}, the private data set: the search uses none.")
  if trainer == "train" and tuple(base.methods) != ("logit_dp",):
    raise ValueError(f"the search pre-trains Logit-DP only; base.methods = {tuple(base.methods)}.")
  if trainer == "clip" and len(tuple(base.methods)) != 1:
    raise ValueError(f"a clip search trains one method; base.methods = {tuple(base.methods)}.")
  if base.get("noise_multiplier") is not None:
    raise ValueError("base.noise_multiplier must be None: σ is recalibrated for every candidate.")
  names = [c["name"] for s in config.stages for c in s["candidates"]]
  if not names:
    raise ValueError("the search has no candidate.")
  if len(set(names)) != len(names):
    raise ValueError(f"candidate names must be unique: {names}.")
  for s in config.stages:
    for c in s["candidates"]:
      if not _NAME_RE.match(c["name"]) or c["name"] == "search":
        raise ValueError(f"candidate name {c['name']!r} is not a folder name.")
      for k in c["overrides"]:
        if k.split(".")[0] in FORBIDDEN_OVERRIDES:
          raise ValueError(f"candidate {c['name']!r} overrides {k!r}: a candidate may not change "
                           f"{FORBIDDEN_OVERRIDES}.")
      apply_overrides(base, c["overrides"])  # every key exists


def scaled_to_subset(config, subset: int):
  """config with base.data.train_subset = subset and the expected batch (and the microbatch,
  test-loss batch) scaled by subset / full_train_size: about the q, T and σ of the full search
  (a random subset pairs a little less than half its images: a class with an odd count leaves
  one out)."""
  config = config.copy_and_resolve_references()
  base = config.base
  scale = subset / float(config.full_train_size)
  base.data.train_subset = int(subset)
  base.batch_size = max(1, round(base.batch_size * scale))
  for k in ("microbatch_size", "eval_batch_size"):
    if base.get(k):
      base[k] = min(base[k], base.batch_size)
  return config


def rank_key(record: dict) -> tuple:
  """Sort key of the rule: higher 3-NN accuracy first, then fewer steps, then earlier; a
  diverged candidate (no accuracy) last."""
  acc = record.get("accuracy")
  return (math.inf if acc is None else -acc, record.get("steps") or math.inf, record["order"])


def _read_json(path):
  with open(path) as f:
    return json.load(f)


def finished_dir(workdir: str, published: str,
                 is_finished: Callable = workdirs.is_finished) -> str | None:
  """The folder holding a finished (or diverged) candidate's files, or None if it has not finished.

  The workdir first; else its published copy in ``results_dir`` (a new machine has no runs/,
  but the committed copies say what finished).
  """
  for d in (workdir, published):
    if os.path.exists(os.path.join(d, DIVERGED_FILE)) or is_finished(d):
      return d
  return None


def _record(stage, cand, order, overrides, workdir, trainer: Trainer) -> dict:
  rec = dict(name=cand["name"], stage=stage["name"], order=order,
             own_overrides=dict(cand["overrides"]), overrides=dict(overrides), finished=False)
  if os.path.exists(os.path.join(workdir, DIVERGED_FILE)):
    rec.update(finished=True, diverged=_read_json(os.path.join(workdir, DIVERGED_FILE))["error"])
  elif trainer.is_finished(workdir):
    rec.update(finished=True, **trainer.result(workdir))
  wc = os.path.join(workdir, "wallclock.json")
  rec["wallclock_seconds"] = _read_json(wc)["total_seconds"] if os.path.exists(wc) else None
  return rec


def _train_timed(train_fn, cfg, workdir, quiet):
  """train_fn(cfg, workdir), timed in workdir/wallclock.json (`workdirs.timed_attempt`)."""
  with workdirs.timed_attempt(workdir, "experiments.tune") as attempt:
    attempt["returncode"] = 1
    try:
      train_fn(cfg, workdir, quiet=quiet)
      attempt["returncode"] = 0
    except FloatingPointError as e:  # diverged: a result of the search, not a crash to retry
      with open(os.path.join(workdir, DIVERGED_FILE), "w") as f:
        json.dump(dict(error=str(e)), f)


def check_resumable(cfg, workdir: str) -> None:
  """ValueError when ``workdir`` holds a run made with another training config than ``cfg``."""
  from experiments import train  # pylint: disable=g-import-not-at-top
  train.check_resumable(cfg, workdir)


def run_search(config, runs_dir: str, results_dir: str, train_fn: Callable | None = None,
               quiet: bool = True) -> dict:
  """Runs (or resumes) the search; writes and returns the summary (see module docstring)."""
  check_search_config(config)
  trainer = trainer_of(config)
  if train_fn is None:
    train_fn = trainer.train_fn
  records, stages = [], []
  incumbent = None
  complete = True
  order = 0

  def write_summary(complete, chosen, candidates):
    """search.json and search.md: after every candidate (complete False) and at the end."""
    summary = dict(rule=trainer.rule, complete=complete, chosen=chosen, stages=list(stages),
                   candidates=list(candidates),
                   base=workdirs.shareable_config(json.loads(config.base.to_json_best_effort())))
    os.makedirs(results_dir, exist_ok=True)
    workdirs.write_json(os.path.join(results_dir, "search.json"), summary)
    with open(os.path.join(results_dir, "search.md"), "w") as f:
      f.write(render_results.search_table(summary) + "\n")
    return summary

  for stage in config.stages:
    inc_overrides = incumbent["overrides"] if incumbent else {}
    stage_records = []
    for cand in stage["candidates"]:
      overrides = {**inc_overrides, **cand["overrides"]}
      workdir = os.path.join(runs_dir, cand["name"])
      published = os.path.join(results_dir, cand["name"])
      # A workdir (or published copy) of this name made with other settings (e.g. an earlier
      # order of the stages) is neither resumed nor counted: check_resumable refuses it.
      cfg = apply_overrides(config.base, overrides)
      trainer.check_resumable(cfg, workdir)
      trainer.check_resumable(cfg, published)
      done_dir = finished_dir(workdir, published, trainer.is_finished)
      if done_dir is None:
        if not quiet:
          print(f"[tune] {cand['name']}: training with {overrides}", flush=True)
        _train_timed(train_fn, cfg, workdir, quiet)
        done_dir = finished_dir(workdir, published, trainer.is_finished) or workdir
      rec = _record(stage, cand, order, overrides, done_dir, trainer)
      order += 1
      if rec["finished"] and done_dir == workdir:
        workdirs.publish(workdir, published, extra_files=(DIVERGED_FILE,))
      stage_records.append(rec)
      write_summary(False, None, records + stage_records)  # progress: nothing chosen yet
    records += stage_records
    if not all(r["finished"] for r in stage_records):
      complete = False
      break
    before = incumbent
    incumbent = min(([incumbent] if incumbent else []) + stage_records, key=rank_key)
    stages.append(
        dict(name=stage["name"], incumbent_before=before["name"] if before else None,
             winner=incumbent["name"]))
    write_summary(False, None, records)
  finished = [r for r in records if r["finished"]]
  chosen = None
  if complete:
    best = min(finished, key=rank_key)
    assert best is incumbent, (best["name"], incumbent and incumbent["name"])
    if best.get("accuracy") is not None:  # else every candidate diverged: nothing to choose
      chosen = dict(name=best["name"], overrides=best["overrides"])
  return write_summary(complete, chosen, records)


def search_finished(path: str) -> bool:
  """Whether ``path`` holds the search.json of a finished search (chosen or not)."""
  return os.path.exists(path) and bool(_read_json(path).get("complete"))


def load_choice(path: str) -> dict:
  """The finished search's choice, dict(name, overrides, base), from its search.json.

  FileNotFoundError if the search has not been run; ValueError if it has not finished, chose
  nothing, or did not run on public data.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"{path} does not exist: run the public-data search first (python -m experiments.tune "
        "--config=experiments/configs/tune_cifar100.py --config.base.data.npz_dir=DIR) and "
        "commit its search.json.")
  summary = _read_json(path)
  if not summary.get("complete") or not summary.get("chosen"):
    raise ValueError(f"{path}: the search has not finished (or every candidate diverged); "
                     "re-run experiments.tune to complete it.")
  data = summary["base"]["data"]
  if data.get("name") in PRIVATE_DATA:
    raise ValueError(f"{path}: the search ran on {data.get('name')!r}, the private data.")
  chosen = summary["chosen"]
  for k in chosen["overrides"]:
    if k.split(".")[0] in FORBIDDEN_OVERRIDES:
      raise ValueError(f"{path}: the chosen overrides change {k!r}.")
  return dict(name=chosen["name"], overrides=dict(chosen["overrides"]), base=summary["base"])


def base_differences(search_base: dict, config) -> list[str]:
  """Training settings (data, methods and run-only fields aside) in which the search's base
  differs from ``config``: the chosen overrides mean the same only where there are none."""
  from experiments import train  # pylint: disable=g-import-not-at-top
  # The projected bound's public references differ by design (CIFAR-100 test in the search,
  # CIFAR-100 train for CIFAR-10): the data around the search, not a setting it chose.
  # How σ is calibrated to the same (ε, δ) (delta_includes_overflow: σ +0.003% at ε = 5, T = 50;
  # added after the search ran) is not a setting the search chose either.
  run_only = set(train._RUN_ONLY_FIELDS)  # pylint: disable=protected-access
  ignore = run_only | {"data", "methods", "projection", "delta_includes_overflow"}
  target = json.loads(config.to_json_best_effort())
  keys = (set(search_base) | set(target)) - ignore
  return sorted(k for k in keys if search_base.get(k) != target.get(k))


def _define_flags():
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flags.DEFINE_config_file("config",
                                  os.path.join(_REPO, "experiments", "configs", "tune_cifar100.py"),
                                  "Search configuration (base + stages).", lock_config=False)
  flags.DEFINE_string("runs_dir", os.path.join(_REPO, "runs", "tune_cifar100"),
                      "Workdirs of the candidates.")
  flags.DEFINE_string("results_dir", os.path.join(_REPO, "docs", "results", "tune_cifar100"),
                      "search.json, search.md and the candidates' small files.")
  flags.DEFINE_integer(
      "subset", None, "Reduced size: this many train images, the expected batch scaled by "
      "subset / full_train_size (about the q, T and σ of the full-size search).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
  f = flags.FLAGS
  config = f.config
  if f.subset:
    config = scaled_to_subset(config, f.subset)
  summary = run_search(config, f.runs_dir, f.results_dir, quiet=False)
  print(render_results.search_table(summary))
  if summary["chosen"]:
    c = summary["chosen"]
    print(f"chosen: {c['name']} {json.dumps(c['overrides'])}")
  else:
    print("search not finished: re-run the same command to continue it")


if __name__ == "__main__":
  _define_flags()
  app.run(main)

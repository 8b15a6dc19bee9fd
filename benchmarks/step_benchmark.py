r"""Side-by-side benchmark of one full training step: non-private vs Naive-DP vs Logit-DP.

    python -m benchmarks.step_benchmark --out results/bench.json

For every model and batch size n it builds, in ONE process, the jitted full step

    (ℒ, g) = gradient(params, x, x')           # method-specific
    updates = chain(logit_dp.transform(σ, C), adam).update(g)   # non-private: adam only
    params  = apply_updates(params, updates)

for non-private training, Naive-DP, and every Logit-DP method in `logit_dp.clip_methods.METHODS`
("ghost", "triangle", "materialize", ...), compiles each ahead of time, runs each once
(warm-up), and then times `--repeats` runs of all of them INTERLEAVED (round r runs
method 1, method 2, ... once each), with `jax.block_until_ready`. It reports the median
and min of each, and the headline ratio  Logit-DP step / non-private step  measured in
the same process on the same batch: the machines are shared and noisy, so ratios, not
absolute times, are what to compare.

Peak memory (`--memory`):
  subprocess (default)  one fresh child process per (model, n, method) loads the same
                        compiled step (persistent compilation cache) and runs it once;
                        it reports its peak RSS (VmHWM, which includes Python + JAX,
                        ~0.3-0.6 GB, also reported as `base_rss_bytes`) on CPU, or
                        `peak_bytes_in_use` of jax.devices()[0].memory_stats() on an
                        accelerator. `--memory-methods` limits which methods get a child.
  sampler               no child processes: a background thread samples this process's
                        RSS every 5 ms while each step runs; reported per method as the
                        peak RSS of the process (`inproc_rss_peak_bytes`, marked * in the
                        table) and the largest increase over the RSS just before a run
                        (`inproc_rss_delta_bytes`, a lower bound of the step's working set
                        because the allocator may reuse memory freed by earlier runs).
  none                  no child processes.
The sampler always samples the warm-up run (for methods without a child); it samples the
timed runs only with `--memory sampler` (a sampling thread costs the timed step CPU).

Timing: `--repeats` interleaved runs per method after one warm-up run, each timed run of a
step faster than `--settle-below-s` (2 s) right after an untimed run of the same step, fewer where a
step is slow (the runs of one method fit in `--time-budget-s`, at least one); a step
slower than the whole budget is timed once, by its warm-up run (the first run after the
ahead-of-time compilation; noted in the table). Materialize gets
`--materialize-repeats` (1).

Configurations that cannot run are not launched (`pre_gate`): "materialize" where its
estimated time (≈ n × the non-private step: n² pair backward passes instead of 2n
example ones) exceeds `--max-step-s`, "ghost"/"triangle" where even d × the
non-private step (d backward passes per example for the Jacobians) exceeds it, and
"ghost" where the Jacobian factors of both views (2·n·(d·q + ghost-layer factors)
floats, q = flattened parameters) exceed `--memory-limit-gb`. Every other step is compiled and
XLA's own buffer assignment (`compiled.memory_analysis()`: arguments + outputs + temporaries) is
compared with
`--memory-limit-gb` before it runs.

Method specs: a name, optionally with a microbatch size, e.g. `triangle@8` runs
`clipped_grad(..., method="triangle", microbatch_size=8)`. `nonprivate` and `naive` are
the baselines.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time

# On a GPU, JAX reserves 75% of the device's memory when it starts unless told not to; the
# fresh-process memory children run beside this process, so neither may reserve it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import optax

import logit_dp

SCHEMA = "logit_dp.step_benchmark/1"
BASELINE = "nonprivate"
NAIVE = "naive"
RESULT_MARKER = "@@STEP_BENCHMARK_CHILD@@ "

DEFAULT_SIZES = {"embedding": (64, 256, 1000, 4096), "resnet18": (64, 256)}
QUICK_SIZES = {"embedding": (8,), "resnet18": (8,)}
# ResNet-18 without batch norm has p ≈ 11.2M parameters and activations of 32×32×64 per
# example, so the Logit-DP methods run in microbatches of this size.
RESNET_MICROBATCH = 8

GB = 1e9

# ----------------------------------------------------------------------------- models


def _embedding_net(embedding_dim: int = 8):
  try:
    from logit_dp import models  # pylint: disable=g-import-not-at-top
    return models.EmbeddingNet(embedding_dim=embedding_dim)
  except (ImportError, AttributeError):  # fallback: the paper's net, defined here
    import flax.linen as nn  # pylint: disable=g-import-not-at-top

    class EmbeddingNet(nn.Module):
      @nn.compact
      def __call__(self, x):
        for c in (8, 16, 32):
          x = nn.relu(
              nn.Conv(c, (3, 3), strides=(2, 2), padding="SAME",
                      kernel_init=nn.initializers.kaiming_normal())(x))
        return nn.Dense(embedding_dim,
                        kernel_init=nn.initializers.xavier_normal())(x.mean(axis=(1, 2)))

    return EmbeddingNet()


def _resnet18(embedding_dim: int = 8):
  from logit_dp import models  # pylint: disable=g-import-not-at-top
  return models.ResNet18(embedding_dim=embedding_dim, norm=None)


MODELS = {"embedding": _embedding_net, "resnet18": _resnet18}


def build_problem(model_name: str, n: int, image_size: int, seed: int = 0, embedding_dim: int = 8):
  """(embed_fn, params, x, x_prime, num_params) for a batch of n CIFAR-shaped pairs."""
  model = MODELS[model_name](embedding_dim)
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  shape = (n, image_size, image_size, 3)
  x = jax.random.uniform(k1, shape)
  x_prime = x + 0.1 * jax.random.normal(k2, shape)
  params = jax.jit(model.init)(k3, x[:1])
  num_params = int(sum(leaf.size for leaf in jax.tree_util.tree_leaves(params)))
  return model.apply, params, x, x_prime, num_params


# ----------------------------------------------------------------------------- steps


def parse_method(spec: str) -> tuple[str, int | None]:
  name, _, mb = spec.partition("@")
  name = name.strip()
  if name not in (BASELINE, NAIVE) + tuple(logit_dp.clip_methods.METHODS):
    raise ValueError(f"unknown method {name!r}: use {BASELINE}, {NAIVE} or one of "
                     f"{logit_dp.clip_methods.METHODS} (optionally with @microbatch_size)")
  return name, (int(mb) if mb else None)


def default_methods(model_name: str) -> list[str]:
  dp = [m for m in logit_dp.clip_methods.METHODS if m != "materialize"]
  dp = ["ghost"] + [m for m in dp if m != "ghost"] if "ghost" in dp else dp
  dp.append("materialize")
  if model_name == "resnet18":
    dp = [m if m == "materialize" else f"{m}@{RESNET_MICROBATCH}" for m in dp]
  return [BASELINE, NAIVE] + dp


def reference_inputs(example_shape, args):
  """"projected"'s reference inputs: ``--num-reference`` uniform [0, 1) inputs of the model's
  example shape from a fixed key of their own (timing only: any public inputs cost the same)."""
  return jax.random.uniform(jax.random.key(2), (args.num_reference,) + tuple(example_shape))


def make_step(spec: str, embed_fn, n: int, args, example_shape=None):
  """Returns (step, tx): step(params, opt_state, x, x') -> (loss, params, opt_state).
  example_shape: the shape of one input, for "projected"'s reference inputs."""
  method, mb = parse_method(spec)
  loss = logit_dp.losses.contrastive(temperature=args.temperature)
  adam = optax.adam(args.learning_rate)
  key = jax.random.key(1)
  if method == BASELINE:

    def grads(params, x, x_prime):
      def total(p):
        return loss(logit_dp.losses.cosine_similarity(embed_fn(p, x), embed_fn(p, x_prime)))

      return jax.value_and_grad(total)(params)

    tx = adam
  elif method == NAIVE:
    grads = logit_dp.baselines.naive_clipped_grad(embed_fn, loss, args.clip_norm,
                                                  microbatch_size=mb)
    tx = optax.chain(
        logit_dp.transform(args.noise_multiplier,
                           logit_dp.baselines.naive_sensitivity(args.clip_norm), key), adam)
  else:
    clip_method = method
    if method == "projected":
      clip_method = logit_dp.clip_methods.Projected(
          reference_inputs=reference_inputs(example_shape, args), rank=args.projection_rank)
    grads = logit_dp.clipped_grad(embed_fn, loss, args.clip_norm, method=clip_method,
                                  microbatch_size=mb)
    c = logit_dp.sensitivity(loss, args.clip_norm, batch_size=n)
    tx = optax.chain(logit_dp.transform(args.noise_multiplier, c, key), adam)

  def step(params, opt_state, x, x_prime):
    loss_value, g = grads(params, x, x_prime)
    updates, opt_state = tx.update(g, opt_state, params)
    return loss_value, optax.apply_updates(params, updates), opt_state

  return step, tx


def compile_step(spec, embed_fn, params, x, x_prime, args):
  """AOT-compiles the step. Returns (compiled, opt_state, info dict)."""
  step, tx = make_step(spec, embed_fn, x.shape[0], args, x.shape[1:])
  opt_state = tx.init(params)
  t0 = time.perf_counter()
  compiled = jax.jit(step).lower(params, opt_state, x, x_prime).compile()
  info = {"compile_s": time.perf_counter() - t0}
  try:
    ma = compiled.memory_analysis()
    info["xla_bytes"] = int(ma.argument_size_in_bytes + ma.output_size_in_bytes
                            + ma.temp_size_in_bytes - ma.alias_size_in_bytes)
    info["xla_temp_bytes"] = int(ma.temp_size_in_bytes)
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    if ca and "flops" in ca:
      info["flops"] = float(ca["flops"])
  except Exception:  # pylint: disable=broad-except
    pass
  return compiled, opt_state, info


def median_and_min_s(fn, *args, repeats: int) -> tuple[float, float]:
  """(median, min) seconds of fn(*args) over `repeats` runs after one untimed warm-up run."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), min(times)


class Runner:
  """Holds a compiled step and its (chained) state; run() times one step."""
  def __init__(self, compiled, params, opt_state, x, x_prime):
    self.compiled, self.x, self.x_prime = compiled, x, x_prime
    self.params, self.opt_state = params, opt_state

  def run(self) -> float:
    t0 = time.perf_counter()
    out = self.compiled(self.params, self.opt_state, self.x, self.x_prime)
    jax.block_until_ready(out)
    dt = time.perf_counter() - t0
    loss_value, self.params, self.opt_state = out
    if not np.isfinite(float(loss_value)):
      raise FloatingPointError(f"non-finite loss {float(loss_value)}")
    return dt


# ----------------------------------------------------------------------------- memory


def _rss() -> int:
  try:
    import psutil  # pylint: disable=g-import-not-at-top
    return int(psutil.Process().memory_info().rss)
  except ImportError:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss() -> int:
  """Peak RSS of this process image: VmHWM (reset by exec, unlike ru_maxrss, which on
  Linux carries the forking parent's RSS into a child across fork + exec)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return int(r if sys.platform == "darwin" else r * 1024)


def _on_accelerator() -> bool:
  return jax.devices()[0].platform != "cpu"


def _device_peak() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return int(peak) if peak is not None else None


class RssSampler:
  """Background thread: per label, the largest RSS increase over the RSS before a run."""
  def __init__(self, interval_s: float = 0.005):
    self.interval_s = interval_s
    self.deltas: dict[str, int] = {}
    self.peaks: dict[str, int] = {}
    self._label, self._start, self._peak = None, 0, 0
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._active = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)
    self._thread.start()

  def _loop(self):
    # Idle (blocked, not polling) between runs: a polling thread steals CPU from XLA on a
    # small machine and slowed the short non-private step by ~35% here.
    while not self._stop.is_set():
      self._active.wait()
      rss = _rss()
      with self._lock:
        if self._label is not None:
          self._peak = max(self._peak, rss)
      time.sleep(self.interval_s)

  def begin(self, label: str):
    with self._lock:
      self._label, self._start = label, _rss()
      self._peak = self._start
    self._active.set()

  def end(self):
    self._active.clear()
    with self._lock:
      self._peak = max(self._peak, _rss())
      if self._label is not None:
        delta = self._peak - self._start
        self.deltas[self._label] = max(self.deltas.get(self._label, 0), delta)
        self.peaks[self._label] = max(self.peaks.get(self._label, 0), self._peak)
      self._label = None

  @contextlib.contextmanager
  def watching(self, label: str, enabled: bool = True):
    """Samples while the block runs (when enabled)."""
    if not enabled:
      yield
      return
    self.begin(label)
    try:
      yield
    finally:
      self.end()

  def close(self):
    self._stop.set()
    self._active.set()
    self._thread.join(timeout=1)


def enable_compile_cache(path: str | None):
  """Persistent XLA cache: the memory children load the parent's executables."""
  if not path:
    return
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def child_main(config: dict) -> dict:
  """One step in a fresh process: its peak memory (and one step's time, for reference)."""
  args = argparse.Namespace(**config["args"])
  enable_compile_cache(config.get("compile_cache"))
  embed_fn, params, x, x_prime, _ = build_problem(config["model"], config["n"], args.image_size,
                                                  embedding_dim=args.embedding_dim)
  jax.block_until_ready((params, x, x_prime))
  base = _rss()
  compiled, opt_state, info = compile_step(config["spec"], embed_fn, params, x, x_prime, args)
  after_compile = _max_rss()
  runner = Runner(compiled, params, opt_state, x, x_prime)
  info["child_step_s"] = runner.run()
  out = {
      "base_rss_bytes": base, "max_rss_after_compile_bytes": after_compile,
      "peak_rss_bytes": _max_rss(), **info
  }
  if _on_accelerator():
    out["peak_device_bytes"] = _device_peak()
  return out


def measure_in_child(model, n, spec, args) -> dict:
  settings = ("image_size", "temperature", "clip_norm", "noise_multiplier", "learning_rate",
              "embedding_dim")
  config = {
      "model": model, "n": n, "spec": spec, "compile_cache": args.compile_cache,
      "args": {k: getattr(args, k) for k in settings}
  }
  cmd = [sys.executable, "-m", "benchmarks.step_benchmark", "--child", json.dumps(config)]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ)
  env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  try:
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                          timeout=args.child_timeout_s, check=False)
  except subprocess.TimeoutExpired:
    return {"error": f"memory child timed out after {args.child_timeout_s} s"}
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith(RESULT_MARKER):
      return json.loads(line[len(RESULT_MARKER):])
  return {"error": f"memory child failed (rc={proc.returncode}): {proc.stderr[-600:]}"}


# ----------------------------------------------------------------------------- benchmark


def _entry(model, n, spec, num_params):
  method, mb = parse_method(spec)
  return {
      "model": model, "n": n, "method": method, "spec": spec, "microbatch_size": mb,
      "num_params": num_params, "status": "ok", "reason": None, "times_s": []
  }


def _log(msg: str):
  print(f"[{datetime.datetime.now(datetime.UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def factor_floats_per_example(embed_fn, params, x, d: int) -> int:
  """Floats "ghost" holds per example and view: d·q flat Jacobian + each ghost layer's factors."""
  from logit_dp._src import layerwise  # pylint: disable=g-import-not-at-top
  plan = layerwise.make_plan(embed_fn, params, x, d)
  leaves = jax.tree_util.tree_leaves(params)
  q = sum(int(np.prod(np.shape(leaves[i]))) for i in plan.generic)
  held = 0
  for layer, ghost in zip(plan.layers, plan.ghost):
    if ghost:
      held += layer.positions * (layer.fan_in + d * layer.features)
    else:
      q += layer.fan_in * layer.features
  return held + d * q


def pre_gate(e: dict, n: int, p: int, d: int, t_np: float | None, args,
             held_per_example: int | None = None) -> str | None:
  """Reason to skip a configuration before compiling it, or None.

  Time: "materialize" costs ≈ n × the non-private step (n² pair backward passes of 2
  examples instead of 2n examples once); the per-example-Jacobian methods ("ghost",
  "triangle") cost at least ≈ d × the non-private step (d backward passes).
  Memory: "ghost" holds the Jacobian factors of both views whatever the microbatch size,
  2·n·held_per_example floats (`factor_floats_per_example`; d·p, the full per-example
  Jacobians, when not given).
  """
  method = e["method"]
  if t_np is not None and method not in (BASELINE, NAIVE):
    factor, why = ((n, "≈ n × non-private: n² pair backward passes") if method == "materialize" else
                   (d, f"≥ d × non-private: d = {d} backward passes per example"))
    est = factor * t_np
    e["est_step_s"] = est
    if est > args.max_step_s:
      return f"estimated {est:.0f} s per step ({why}) > --max-step-s {args.max_step_s:g}"
  if method == "ghost" and args.analytic_gate:
    held = d * p if held_per_example is None else held_per_example
    need = 2 * n * held * 4
    e["est_bytes"] = need
    if need > args.memory_limit_gb * GB:
      return (f"does not fit: the Jacobian factors of both views need 2·n·{held:,}·4 B = "
              f"{need / GB:.1f} GB > --memory-limit-gb {args.memory_limit_gb:g}")
  return None


def bench_config(model: str, n: int, specs: list[str], args, sampler: RssSampler) -> list[dict]:
  """All methods for one (model, n), timed interleaved in this process."""
  embed_fn, params, x, x_prime, num_params = build_problem(model, n, args.image_size,
                                                           embedding_dim=args.embedding_dim)
  jax.block_until_ready((params, x, x_prime))
  d = int(jax.eval_shape(embed_fn, params, x[:1]).shape[-1])
  limit = args.memory_limit_gb * GB
  entries, runners = [], {}
  # Baseline first: its warm-up time prices "materialize" before compiling it.
  specs = sorted(specs, key=lambda s: parse_method(s)[0] != BASELINE)
  t_np = None
  for spec in specs:
    e = _entry(model, n, spec, num_params)
    entries.append(e)
    method = e["method"]
    held = (factor_floats_per_example(embed_fn, params, x, d) if e["method"] == "ghost" else None)
    reason = pre_gate(e, n, num_params, d, t_np, args, held)
    if reason:
      e["status"], e["reason"] = "skipped", reason
      _log(f"{model} n={n} {spec}: {e['reason']}")
      continue
    try:
      compiled, opt_state, info = compile_step(spec, embed_fn, params, x, x_prime, args)
    except Exception as err:  # pylint: disable=broad-except
      e["status"], e["reason"] = "error", f"compile failed: {type(err).__name__}: {err}"[:500]
      _log(f"{model} n={n} {spec}: {e['reason']}")
      continue
    e.update(info)
    if info.get("xla_bytes", 0) > limit:
      e["status"], e["reason"] = "skipped", (
          f"does not fit: XLA buffer assignment needs {info['xla_bytes'] / GB:.1f} GB "
          f"> --memory-limit-gb {args.memory_limit_gb:g}")
      _log(f"{model} n={n} {spec}: {e['reason']}")
      del compiled
      continue
    runner = Runner(compiled, params, opt_state, x, x_prime)
    try:
      with sampler.watching(spec):
        e["warmup_s"] = runner.run()
    except Exception as err:  # pylint: disable=broad-except
      e["status"], e["reason"] = "error", f"run failed: {type(err).__name__}: {err}"[:500]
      _log(f"{model} n={n} {spec}: {e['reason']}")
      continue
    if method == BASELINE:
      t_np = e["warmup_s"]
    runners[spec] = runner
    _log(f"{model} n={n} {spec}: compiled in {e['compile_s']:.1f} s, "
         f"warm-up step {e['warmup_s']:.3f} s")

  # Repeats: `--repeats`, fewer where a step is slow (total per method ≤ --time-budget-s),
  # and `--materialize-repeats` for the reference.
  todo = {}
  for e in entries:
    if e["spec"] in runners:
      if e["warmup_s"] >= args.time_budget_s:
        # One step takes longer than the whole budget: the first run after the AOT
        # compilation is the only sample (its one-off overhead is negligible here).
        e["times_s"].append(e["warmup_s"])
        e["timing_note"] = "single run (the warm-up itself): step > --time-budget-s"
        continue
      r = args.repeats if e["method"] != "materialize" else min(args.repeats,
                                                                args.materialize_repeats)
      r = max(1, min(r, int(args.time_budget_s // max(e["warmup_s"], 1e-9))))
      todo[e["spec"]] = r
  for rnd in range(max(todo.values(), default=0)):
    for e in entries:
      spec = e["spec"]
      if todo.get(spec, 0) > rnd:
        if e["warmup_s"] < args.settle_below_s:
          # An untimed run first: right after a heavy step a light one runs up to ~50%
          # slower (caches, allocator), which would flatter every ratio to it.
          runners[spec].run()
        # Timed runs are sampled only when the sampler is the memory measurement.
        with sampler.watching(spec, enabled=args.memory == "sampler"):
          e["times_s"].append(runners[spec].run())
  runners.clear()

  for e in entries:
    if e["times_s"]:
      e["median_s"] = statistics.median(e["times_s"])
      e["min_s"] = min(e["times_s"])
      e["repeats"] = len(e["times_s"])
      if _on_accelerator():
        # The host RSS says nothing of device memory; XLA's buffer assignment does.
        e["xla_device_bytes"] = e.get("xla_bytes")
      else:
        e["inproc_rss_delta_bytes"] = sampler.deltas.get(e["spec"])
        e["inproc_rss_peak_bytes"] = sampler.peaks.get(e["spec"])
      _log(f"{model} n={n} {e['spec']}: median {e['median_s']:.4f} s over {e['repeats']}")
  base = next((e for e in entries if e["method"] == BASELINE and e.get("median_s")), None)
  for e in entries:
    if base is not None and e.get("median_s"):
      e["ratio_median"] = e["median_s"] / base["median_s"]
      e["ratio_min"] = e["min_s"] / base["min_s"]

  if args.memory == "subprocess":
    wanted = None if args.memory_methods is None else {
        m.strip() for m in args.memory_methods.split(",")
    }
    for e in entries:
      if e["status"] != "ok" or (wanted is not None and e["method"] not in wanted
                                 and e["spec"] not in wanted):
        continue
      _log(f"{model} n={n} {e['spec']}: measuring peak memory in a fresh process")
      m = measure_in_child(model, n, e["spec"], args)
      if "error" in m:
        e["memory_error"] = m["error"]
        _log(f"  {m['error']}")
      else:
        e["peak_rss_bytes"] = m["peak_rss_bytes"]
        e["base_rss_bytes"] = m["base_rss_bytes"]
        if m.get("peak_device_bytes") is not None:
          e["peak_device_bytes"] = m["peak_device_bytes"]
        e["child_step_s"] = m.get("child_step_s")
  return entries


# ----------------------------------------------------------------------------- analysis


def scaling_exponents(results: list[dict]) -> dict:
  """Least-squares slope of log(median step time) vs log(n), per model and method."""
  out: dict[str, dict] = {}
  for model in sorted({r["model"] for r in results}):
    for spec in _ordered_specs([r for r in results if r["model"] == model]):
      pts = sorted((r["n"], r["median_s"]) for r in results
                   if r["model"] == model and r["spec"] == spec and r.get("median_s"))
      if len(pts) < 2:
        continue
      ns, ts = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
      local = [float((ts[i + 1] - ts[i]) / (ns[i + 1] - ns[i])) for i in range(len(pts) - 1)]
      out.setdefault(model, {})[spec] = {
          "sizes": [p[0] for p in pts],
          "exponent": float(np.polyfit(ns, ts, 1)[0]),
          "local_exponents": local,
      }
      # The ratio to the non-private step is measured side by side, so its slope is far
      # less sensitive to the machine's load than the absolute times are.
      rat = sorted((r["n"], r["ratio_median"]) for r in results
                   if r["model"] == model and r["spec"] == spec and r.get("ratio_median"))
      if len(rat) >= 2 and spec != BASELINE:
        out[model][spec]["ratio_exponent"] = float(
            np.polyfit(np.log([q[0] for q in rat]), np.log([q[1] for q in rat]), 1)[0])
  return out


def _get(results, model, n, method):
  for r in results:
    if r["model"] == model and r["n"] == n and r["spec"] == method:
      return r
  return None


def peak_memory(r: dict, fallback: bool = True) -> int | None:
  """Peak memory of the step: fresh-process measurement, else the in-process sampler's
  (CPU) or XLA's buffer assignment (accelerator)."""
  if r is None:
    return None
  if r.get("peak_device_bytes") is not None:
    return r["peak_device_bytes"]
  if r.get("peak_rss_bytes") is not None or not fallback:
    return r.get("peak_rss_bytes")
  if r.get("xla_device_bytes") is not None:
    return r["xla_device_bytes"]
  return r.get("inproc_rss_peak_bytes")


def _fmt_mem(r):
  b = peak_memory(r)
  if b is None:
    return "—"
  return _fmt_gb(b) + ("" if peak_memory(r, fallback=False) is not None else " *")


def code_version() -> dict:
  """Git commit of the checkout and a hash of the library code that was measured (every module
  of logit_dp/_src: the clip methods and what they build on)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = {}
  try:
    out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, text=True,
                                       capture_output=True, check=True).stdout.strip()
    out["git_dirty_files"] = [
        line[3:] for line in
        subprocess.run(["git", "--no-optional-locks", "status", "--porcelain"], cwd=root, text=True,
                       capture_output=True, check=True).stdout.splitlines()
    ]
  except (OSError, subprocess.CalledProcessError):
    pass
  try:
    from logit_dp._src import clipping  # pylint: disable=g-import-not-at-top
    src = os.path.dirname(clipping.__file__)
    files = sorted(
        os.path.join(folder, name) for folder, _, names in os.walk(src) for name in names
        if name.endswith(".py"))
    digest = hashlib.sha256()
    for path in files:
      digest.update(os.path.relpath(path, src).encode())
      with open(path, "rb") as f:
        digest.update(f.read())
    out["engine_sha256"] = digest.hexdigest()[:16]
    out["engine_mtime_utc"] = datetime.datetime.fromtimestamp(
        max(os.path.getmtime(path) for path in files), datetime.UTC).isoformat(timespec="seconds")
  except (ImportError, OSError):
    pass
  return out


def machine_info() -> dict:
  cpu = platform.processor() or platform.machine()
  cpuinfo = {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if ":" in line:
          k, v = (t.strip() for t in line.split(":", 1))
          cpuinfo.setdefault(k, v)
    cpu = cpuinfo.get("model name", cpu)
  except OSError:
    pass
  flags = set(cpuinfo.get("flags", "").split())
  isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
  virt = "hypervisor" in flags
  try:
    import psutil  # pylint: disable=g-import-not-at-top
    ram = psutil.virtual_memory().total
  except ImportError:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  dev = jax.devices()[0]
  import flax  # pylint: disable=g-import-not-at-top
  return {
      "cpu": cpu, "cpu_family": cpuinfo.get("cpu family"), "cpu_model": cpuinfo.get("model"),
      "isa": isa, "virtualized": virt, "cpu_count": os.cpu_count(),
      "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
      "ram_bytes": int(ram), "platform": dev.platform, "device_kind": dev.device_kind,
      "device_count": jax.device_count(), "python": platform.python_version(),
      "jax": jax.__version__,
      "jaxlib": getattr(jax.lib, "__version__", None) or __import__("jaxlib").__version__,
      "flax": flax.__version__, "optax": optax.__version__, "numpy": np.__version__,
      "logit_dp": getattr(logit_dp, "__version__", None)
  }


# ----------------------------------------------------------------------------- markdown


def _fmt_s(t):
  if t is None:
    return "—"
  return f"{t:.3g}" if t < 100 else f"{t:.0f}"


def _fmt_ratio(x):
  if x is None:
    return "—"
  return f"{x:.2f}×" if x < 10 else f"{x:.1f}×" if x < 100 else f"{x:.0f}×"


def _fmt_gb(b):
  return "—" if b is None else f"{b / GB:.2f} GB"


def _ordered_specs(results):
  seen = []
  for r in results:
    if r["spec"] not in seen:
      seen.append(r["spec"])
  key = lambda s: (0 if s == BASELINE else 1 if s == NAIVE else 2 if s.startswith("ghost") else 4
                   if s.startswith("materialize") else 3)
  return sorted(seen, key=key)


def _label(spec):
  method, mb = parse_method(spec)
  name = {BASELINE: "non-private", NAIVE: "Naive-DP"}.get(method, f"Logit-DP {method}")
  return name + (f" (microbatch {mb})" if mb else "")


def _short(r):
  if r is None:
    return "—"
  if r["status"] != "ok":
    return {"skipped": "skip", "not timed": "—"}.get(r["status"], "error")
  return _fmt_ratio(r.get("ratio_median"))


def markdown(report: dict) -> str:
  results = report["results"]
  lines = []
  m = report.get("machine", {})
  if m:
    lines.append(f"Machine: {m.get('cpu')} (family {m.get('cpu_family')}, model "
                 f"{m.get('cpu_model')}; {', '.join(m.get('isa') or [])}"
                 f"{', virtualised' if m.get('virtualized') else ''}), "
                 f"{m.get('affinity') or m.get('cpu_count')} cores, "
                 f"{m.get('ram_bytes', 0) / 2**30:.0f} GiB RAM, {m.get('platform')} "
                 f"({m.get('device_kind')}), jax {m.get('jax')}. Run {report.get('created_utc')}"
                 + (f" to {report['finished_utc']}" if report.get("finished_utc") else "")
                 + (f"; load average {report['load_average_start'][0]:.1f} at the start" if report.
                    get("load_average_start") else "") + ".")
    lines.append("")
  mem_kind = "peak device memory" if m.get("platform") not in (None, "cpu") else "peak RSS"
  # Headline: ratio to non-private per method.
  for model in sorted({r["model"] for r in results}, key=lambda s: s != "embedding"):
    rows = [r for r in results if r["model"] == model]
    specs = [s for s in _ordered_specs(rows) if s != BASELINE]
    sizes = sorted({r["n"] for r in rows})
    head = ["n", "non-private step (s)"] + [f"{_label(s)} / non-private" for s in specs]
    head.append(f"ghost {mem_kind}")
    lines.append(f"**{model}** (p = {rows[0]['num_params']:,} parameters): step time ratio "
                 "to the non-private step (median of interleaved runs)")
    lines.append("")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---:" for _ in head) + "|")
    for n in sizes:
      b = _get(results, model, n, BASELINE)
      gh = next((_get(results, model, n, s) for s in specs if s.startswith("ghost")), None)
      cells = [str(n), _fmt_s(b.get("median_s") if b else None)]
      cells += [_short(_get(results, model, n, s)) for s in specs]
      cells.append(_fmt_mem(gh))
      lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
  # Details.
  lines.append(f"Details (times in seconds; ratio = method / non-private, same process; "
               f"{mem_kind} of a fresh process running one step"
               + (", as the device allocator's peak_bytes_in_use):" if m.get("platform") not in
                  (None, "cpu") else ", Python+JAX included):"))
  lines.append("")
  head = [
      "model", "n", "method", "ratio (median)", "ratio (min)", "median s", "min s", "runs",
      mem_kind, "compile s", "note"
  ]
  lines.append("| " + " | ".join(head) + " |")
  lines.append("|" + "|".join(["---", "---:", "---"] + ["---:"] * 7 + ["---"]) + "|")
  for model in sorted({r["model"] for r in results}, key=lambda s: s != "embedding"):
    for n in sorted({r["n"] for r in results if r["model"] == model}):
      for s in _ordered_specs([r for r in results if r["model"] == model]):
        r = _get(results, model, n, s)
        if r is None:
          continue
        note = r.get("reason") or r.get("memory_error") or r.get("timing_note") or ""
        lines.append("| " + " | ".join([
            model,
            str(n),
            _label(s),
            _fmt_ratio(r.get("ratio_median")),
            _fmt_ratio(r.get("ratio_min")),
            _fmt_s(r.get("median_s")),
            _fmt_s(r.get("min_s")),
            str(r.get("repeats", "—")),
            _fmt_mem(r),
            _fmt_s(r.get("compile_s")),
            note.replace("|", "/")
        ]) + " |")
  lines.append("")
  lines.append("(* = no fresh-process measurement: " + (
      "XLA's buffer assignment for the step: arguments + outputs + temporaries.)" if m.
      get("platform") not in (None, "cpu") else
      "peak RSS of the benchmark process itself while the step ran, sampled every 5 ms.)"))
  lines.append("")
  sc = report.get("scaling", {})
  if sc:
    lines.append("Scaling exponent k of step time ∝ n^k (least-squares fit of log time vs "
                 "log n; local = between consecutive sizes; k of ratio = slope of the "
                 "side-by-side ratio to non-private, so k ≈ k(non-private) + k of ratio):")
    lines.append("")
    lines.append("| model | method | sizes | k (fit) | local k | k of ratio |")
    lines.append("|---|---|---|---:|---|---:|")
    for model, per in sc.items():
      for s, v in per.items():
        kr = v.get("ratio_exponent")
        lines.append(f"| {model} | {_label(s)} | {', '.join(map(str, v['sizes']))} | "
                     f"{v['exponent']:.2f} | "
                     f"{', '.join(f'{k:.2f}' for k in v['local_exponents'])} | "
                     f"{'—' if kr is None else f'{kr:.2f}'} |")
    lines.append("")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def finalize(report: dict) -> dict:
  report["scaling"] = scaling_exponents(report["results"])
  return report


def write(report: dict, path: str | None):
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(report, f, indent=1, default=float)
  os.replace(tmp, path)


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m benchmarks.step_benchmark",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="results/bench.json", help="JSON output path")
  p.add_argument("--markdown", default=None, help="also write the markdown table here")
  p.add_argument(
      "--sizes", default=None,
      help="comma-separated batch sizes for every model (default: 64,256,1000,4096 "
      "for embedding, 64,256 for resnet18)")
  p.add_argument("--models", default="embedding,resnet18")
  p.add_argument(
      "--methods", default=None,
      help="comma-separated method specs (default: nonprivate, naive, and every "
      "logit_dp.clip_methods.METHODS; on resnet18 with microbatch 8)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--materialize-repeats", type=int, default=1)
  p.add_argument("--time-budget-s", type=float, default=300.0,
                 help="timed runs per method and config are cut to fit this budget (≥ 1 run)")
  p.add_argument(
      "--max-step-s", type=float, default=300.0,
      help="skip a DP method where its estimated step time (materialize: n × "
      "non-private; ghost/triangle: ≥ d × non-private) exceeds this")
  p.add_argument("--memory", choices=("subprocess", "sampler", "none"), default="subprocess")
  p.add_argument("--memory-limit-gb", type=float, default=12.0,
                 help="skip configurations whose compiled working set exceeds this")
  p.add_argument(
      "--no-analytic-gate", dest="analytic_gate", action="store_false",
      help="do not skip 'ghost' on the 2·n·d·p-float Jacobian estimate; rely "
      "on XLA's buffer assignment only")
  p.add_argument("--child-timeout-s", type=float, default=1800.0)
  p.add_argument(
      "--memory-only", action="store_true",
      help="only the fresh-process memory measurements (no timing); merge "
      "into a timing run with --render")
  p.add_argument(
      "--memory-methods", default=None,
      help="with --memory subprocess: only these methods get a memory child "
      "(default: all); the others report the in-process sampler's peak")
  p.add_argument(
      "--compile-cache", default=None,
      help="persistent XLA compilation cache directory, shared with the memory "
      "child processes (default: .jax_cache next to --out; '' disables)")
  p.add_argument(
      "--settle-below-s", type=float, default=2.0,
      help="steps faster than this get one untimed run right before each timed "
      "run, so that every timed run follows a run of the same step")
  p.add_argument("--image-size", type=int, default=32)
  p.add_argument("--embedding-dim", type=int, default=8,
                 help="d, the models' embedding dimension (the paper's: 8)")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--clip-norm", type=float, default=1.0)
  p.add_argument("--num-reference", type=int, default=64,
                 help='"projected": reference inputs spanning its subspace.')
  p.add_argument("--projection-rank", type=int, default=32, help='"projected": subspace rank.')
  p.add_argument("--noise-multiplier", type=float, default=1.0)
  p.add_argument("--learning-rate", type=float, default=1e-3)
  p.add_argument("--quick", action="store_true",
                 help="smoke test: n=8, 16×16 images, 2 repeats, embedding net, sampler memory")
  p.add_argument("--render", nargs="+", default=None, metavar="JSON",
                 help="merge these result files (later ones win) and print the tables")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.compile_cache is None:
    args.compile_cache = os.path.join(os.path.dirname(os.path.abspath(args.out)), ".jax_cache")
  if args.quick:
    args.models = "embedding" if args.models == "embedding,resnet18" else args.models
    args.sizes = args.sizes or "8"
    args.repeats = min(args.repeats, 2)
    args.image_size = 16
    if "--memory" not in " ".join(argv or []):
      args.memory = "sampler"
  return args


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.child is not None:
    out = child_main(json.loads(args.child))
    print(RESULT_MARKER + json.dumps(out), flush=True)
    return out
  if args.render:
    merged: dict = {}
    base = None
    for path in args.render:
      with open(path) as f:
        rep = json.load(f)
      for r in rep["results"]:
        key = (r["model"], r["n"], r["spec"])
        if r.get("memory_only") and key in merged:
          merged[key].update({k: v for k, v in r.items() if k != "memory_only"})
        else:
          merged[key] = dict(r)
      base = base or rep  # machine, command and times of the first file
    num_params = {r["model"]: r["num_params"] for r in merged.values() if "num_params" in r}
    for r in merged.values():
      if r.get("memory_only"):  # measured for memory, not timed in any of the files
        r.setdefault("status", "not timed")
        r.setdefault("reason", "memory measured only; not timed in this run")
        r.setdefault("num_params", num_params.get(r["model"]))
    base["results"] = list(merged.values())
    report = finalize(base)
    write(report, args.out if args.out != "results/bench.json" else None)
    print(markdown(report))
    return report

  enable_compile_cache(args.compile_cache)
  models = [m.strip() for m in args.models.split(",") if m.strip()]
  report = {
      "schema": SCHEMA, "created_utc": datetime.datetime.now(datetime.UTC
                                                            ).isoformat(timespec="seconds"),
      "command": "python -m benchmarks.step_benchmark " + " ".join(argv), "machine": machine_info(),
      "code": code_version(),
      "settings": {k: v for k, v in vars(args).items() if k not in ("child", "render")},
      "memory_method": args.memory, "load_average_start": list(os.getloadavg()), "results": []
  }
  sampler = RssSampler()
  try:
    for model in models:
      if model not in MODELS:
        raise ValueError(f"unknown model {model!r}: use {sorted(MODELS)}")
      sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes else list(
          (QUICK_SIZES if args.quick else DEFAULT_SIZES)[model]))
      specs = ([s.strip() for s in args.methods.split(",") if s.strip()]
               if args.methods else default_methods(model))
      for spec in specs:
        parse_method(spec)
      if BASELINE not in specs:
        specs = [BASELINE] + specs
      for n in sizes:
        if args.memory_only:
          # Only the fresh-process memory measurement; `--render` merges it into a
          # timing run's entries.
          for spec in specs:
            if spec == BASELINE and BASELINE not in (args.methods or ""):
              continue
            _log(f"{model} n={n} {spec}: measuring peak memory in a fresh process")
            m = measure_in_child(model, n, spec, args)
            method, mb = parse_method(spec)
            e = {
                "model": model, "n": n, "method": method, "spec": spec, "microbatch_size": mb,
                "memory_only": True
            }
            if "error" in m:
              e["memory_error"] = m["error"]
            else:
              e.update({
                  k: m[k] for k in ("peak_rss_bytes", "base_rss_bytes", "peak_device_bytes")
                  if m.get(k) is not None
              })
            report["results"].append(e)
            write(report, args.out)
          continue
        _log(f"=== {model}, n = {n}: {', '.join(specs)}")
        report["results"].extend(bench_config(model, n, specs, args, sampler))
        write(finalize(report), args.out)
  finally:
    sampler.close()
  report["finished_utc"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  report["load_average_end"] = list(os.getloadavg())
  if args.memory_only:
    write(report, args.out)
    return report
  finalize(report)
  write(report, args.out)
  md = markdown(report)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(md + "\n")
  print(md)
  return report


if __name__ == "__main__":
  main()

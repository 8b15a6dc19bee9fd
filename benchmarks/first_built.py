r"""First-built vs second-built private training in one process, side by side.

    python -m benchmarks.first_built --out docs/benchmarks/first_built_cpu.json

Each configuration (model:n:method) runs in a fresh process, as a new user's script would:
`logit_dp.make_private` builds training A (same data, same initial parameters), its loop

    for batch in private.batches():
      params, opt_state, loss = train_step(params, opt_state, batch, (x_all, x_prime_all))

runs a few untimed iterations (the first compiles) and ``--timed-steps`` timed ones; then an
identical training B (other noise key and sampler seed) is built and measured the same way;
then ``--rounds`` rounds run one iteration of each, alternating which goes first. An
iteration is timed in two parts: the draw (``next`` on the `batches` generator: the budget
check, the Poisson batch, the ledger) and the step (``train_step`` and
``jax.block_until_ready``). Per phase it counts the XLA compilations
(``/jax/core/compile/backend_compile_duration`` events) and the accountant runs (misses of
the ε cache of `logit_dp.accounting`) during the timed iterations.

The ratio A / B of the median iteration is the first-built penalty (1.0: none).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SCHEMA = "logit_dp.first_built_benchmark/1"
DEFAULT_CONFIGS = "mlp:64:ghost,embedding:32:ghost,mlp:64:naive,mlp:64:dp_gcl"
NUM_RECORDS = 4096
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
#: Timed phases: each training alone (A after it was built, B after it), each alone again, then
#: alternating iterations.
MODES = ("alone", "again", "alternating")


def _build(model_name: str, n: int, method: str, seed: int, args):
  """One private training as `make_private` builds it; returns iterate() -> (draw_s, step_s)."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import logit_dp  # pylint: disable=g-import-not-at-top
  from logit_dp import models  # pylint: disable=g-import-not-at-top

  if model_name == "mlp":
    model, shape = models.MLPEmbedding(embedding_dim=16, hidden=(256, 128)), (NUM_RECORDS, 256)
  elif model_name == "embedding":
    model, shape = models.EmbeddingNet(embedding_dim=8), (NUM_RECORDS, 32, 32, 3)
  else:
    raise ValueError(f"model must be 'mlp' or 'embedding', got {model_name!r}.")
  x_all = jax.random.normal(jax.random.key(0), shape)
  x_prime_all = x_all + 0.1 * jax.random.normal(jax.random.key(1), shape)
  params = model.init(jax.random.key(2), x_all[:1])
  extra = {"group_size": 8} if method == "dp_gcl" else {}
  private = logit_dp.make_private(model.apply, logit_dp.losses.contrastive(temperature=1.0),
                                  clip_norm=1.0, target_epsilon=args.epsilon, target_delta=1e-5,
                                  num_records=NUM_RECORDS, expected_batch_size=n,
                                  steps=args.budget_steps, optimizer=optax.adam(1e-3), mean=True,
                                  method=method, noise_key=jax.random.key(seed), sampler_seed=seed,
                                  **extra)
  train_step = private.make_train_step()
  state = [params, private.optimizer.init(params)]
  batches = private.batches()
  data = (x_all, x_prime_all)

  def iterate() -> tuple[float, float]:
    t0 = time.perf_counter()
    batch = next(batches)
    t1 = time.perf_counter()
    state[0], state[1], loss = train_step(state[0], state[1], batch, data)
    jax.block_until_ready((state[0], loss))
    return t1 - t0, time.perf_counter() - t1

  return iterate


def child_main(config: str, args) -> dict:
  """Trainings A and B of one configuration in this process: their timed iterations."""
  import jax  # pylint: disable=g-import-not-at-top

  from logit_dp._src import accounting  # pylint: disable=g-import-not-at-top

  compiles = [0]
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, _duration, **_: compiles.__setitem__(0, compiles[0] +
                                                         (event == _COMPILE_EVENT)))

  def counters() -> tuple[int, int, float, int]:
    return (
        compiles[0],
        accounting._epsilon_cached.cache_info().misses,  # pylint: disable=protected-access
        time.process_time(),
        resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

  phases: dict[str, dict] = {}

  def timed(runs: list[tuple[str, object]]):
    for label, iterate in runs:
      before = counters()
      draw_s, step_s = iterate()  # pyright: ignore[reportCallIssue]
      after = counters()
      phase = phases.setdefault(
          label, dict(draw_s=[], step_s=[], cpu_s=[], page_faults=[], compiles=0,
                      accountant_runs=0))
      phase["draw_s"].append(draw_s)
      phase["step_s"].append(step_s)
      phase["cpu_s"].append(after[2] - before[2])
      phase["page_faults"].append(after[3] - before[3])
      phase["compiles"] += after[0] - before[0]
      phase["accountant_runs"] += after[1] - before[1]

  model_name, n, method = config.split(":")
  built, build_s = {}, {}
  for label, seed in (("A", 1), ("B", 2)):
    t0 = time.perf_counter()
    built[label] = _build(model_name, int(n), method, seed, args)
    for _ in range(args.warmup_steps):
      built[label]()
    build_s[label] = time.perf_counter() - t0
    timed([(f"{label} alone", built[label])] * args.timed_steps)
  for label in ("A", "B"):
    timed([(f"{label} again", built[label])] * args.timed_steps)
  for r in range(args.rounds):
    order = ("A", "B") if r % 2 == 0 else ("B", "A")
    timed([(f"{label} alternating", built[label]) for label in order])

  def median(label: str, part: str) -> float:
    phase = phases[label]
    if part == "iteration":
      return statistics.median(d + s for d, s in zip(phase["draw_s"], phase["step_s"]))
    return statistics.median(phase[f"{part}_s"])

  out = dict(model=model_name, n=int(n), method=method, build_and_warm_s=build_s, phases=phases,
             median_ms={}, ratio={})
  for mode in MODES:
    for label in ("A", "B"):
      out["median_ms"][f"{label} {mode}"] = {
          part: 1e3 * median(f"{label} {mode}", part)
          for part in ("iteration", "draw", "step", "cpu")
      }
    out["ratio"][mode] = {
        clock: median(f"A {mode}", part) / median(f"B {mode}", part)
        for clock, part in (("wall", "iteration"), ("cpu", "cpu"))
    }
  return out


def markdown(report: dict) -> str:
  """One row per configuration: A / B of the median iteration's CPU time (wall time) in each
  phase, A's and B's median draw and CPU time, and the accountant runs and compilations."""
  lines = [
      "| model | n | method | A / B alone | A / B again | A / B alternating | draw A, B (ms) | "
      "CPU per iteration A, B (ms) | accountant runs A, B | compiles A, B |",
      "|---|---|---|---|---|---|---|---|---|---|"
  ]
  for r in report["results"]:
    ratios = [f"{r['ratio'][m]['cpu']:.2f} ({r['ratio'][m]['wall']:.2f})" for m in MODES]
    ms = r["median_ms"]
    counts = {
        key: [sum(r["phases"][f"{label} {m}"][key] for m in MODES) for label in ("A", "B")]
        for key in ("accountant_runs", "compiles")
    }
    lines.append(f"| {r['model']} | {r['n']} | {r['method']} | {' | '.join(ratios)} | "
                 f"{ms['A alone']['draw']:.1f}, {ms['B alone']['draw']:.1f} | "
                 f"{ms['A alone']['cpu']:.1f}, {ms['B alone']['cpu']:.1f} | "
                 f"{counts['accountant_runs'][0]}, {counts['accountant_runs'][1]} | "
                 f"{counts['compiles'][0]}, {counts['compiles'][1]} |")
  return "\n".join(lines)


def main(argv=None) -> dict | None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.first_built")
  p.add_argument("--configs", default=DEFAULT_CONFIGS,
                 help="comma-separated model:n:method (model: mlp or embedding)")
  p.add_argument("--timed-steps", type=int, default=20)
  p.add_argument("--warmup-steps", type=int, default=3)
  p.add_argument("--rounds", type=int, default=10, help="alternating rounds after both are built")
  p.add_argument("--epsilon", type=float, default=8.0)
  p.add_argument("--budget-steps", type=int, default=200, help="T of make_private")
  p.add_argument("--out", default=None, help="JSON output path")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    print(json.dumps(child_main(args.child, args)))
    return None
  from benchmarks import step_benchmark  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  results = []
  own = list(argv if argv is not None else sys.argv[1:])
  for config in args.configs.split(","):
    cmd = [sys.executable, "-m", "benchmarks.first_built", "--child", config, *own]
    done = subprocess.run(cmd, cwd=root, check=True, capture_output=True, text=True)
    results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(markdown(dict(results=results[-1:])).splitlines()[-1], file=sys.stderr, flush=True)
  report = dict(schema=SCHEMA, argv=own, code=step_benchmark.code_version(), results=results,
                load_average_end=list(os.getloadavg()))
  print(markdown(report))
  step_benchmark.write(report, args.out)
  return report


if __name__ == "__main__":
  main()

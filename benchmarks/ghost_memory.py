r"""Memory and time of the blocked "ghost" gradient (docs/BENCHMARKS.md, "Bounded-memory ghost").

Memory (compile only, nothing is run):

    python -m benchmarks.ghost_memory memory --sizes 256,1000 --out results/ghost_memory.json

reads XLA's buffer assignment (`compiled.memory_analysis()`: arguments + outputs +
temporaries) of the jitted `clipped_grad(..., "ghost")` core for ResNet-18 without batch norm
(microbatch 8), with the default memory budget and, for contrast, with an unbounded one (one
block: the factors of both views of the whole batch, as before the blocks).

Time (one process, the steps interleaved, median of --repeats after a warm-up):

    python -m benchmarks.ghost_memory time --model resnet18 --sizes 64 --repeats 2 \
        --out results/ghost_time_resnet64.json

times one training step (gradient, noise, Adam) of "ghost", "triangle" and the non-private
step (--methods: a subset; --no-warmup: each step's first run is its first timed one, for steps
of many minutes). Ratios, not absolute times: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types

import jax
import jax.numpy as jnp

import logit_dp
from benchmarks import step_benchmark
from logit_dp._src import chunking
from logit_dp._src import layerwise

UNBOUNDED = 1 << 50  # bytes: every batch in one block (the path before the blocks)


def _ghost_memory(embed_fn, params, x, x_prime, microbatch_size, memory_budget) -> dict:
  loss = logit_dp.losses.contrastive(temperature=1.0)
  grad_fn = logit_dp.clipped_grad(embed_fn, loss, 1.0,
                                  logit_dp.clip_methods.Ghost(memory_budget=memory_budget),
                                  microbatch_size=microbatch_size or None)
  mask = jnp.ones((x.shape[0],), bool)
  t0 = time.perf_counter()
  compiled = grad_fn.core.lower(params, x, x_prime, mask).compile()
  analysis = compiled.memory_analysis()
  return dict(
      compile_s=time.perf_counter() - t0, argument_bytes=int(analysis.argument_size_in_bytes),
      output_bytes=int(analysis.output_size_in_bytes), temp_bytes=int(analysis.temp_size_in_bytes),
      alias_bytes=int(analysis.alias_size_in_bytes),
      total_bytes=int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                      + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes))


def memory(args) -> list:
  rows = []
  for n in (int(s) for s in args.sizes.split(",")):
    embed_fn, params, x, x_prime, num_params = step_benchmark.build_problem(
        args.model, n, args.image_size)
    d = jax.eval_shape(embed_fn, params, x[:1]).shape[-1]
    plan = layerwise.make_plan(embed_fn, params, x, d)
    example_bytes = chunking.factor_bytes_per_example(plan, d, jax.tree_util.tree_leaves(params))
    budgets = {"blocked": args.budget or chunking.default_memory_budget()}
    if not args.skip_unbounded:
      budgets["one block"] = UNBOUNDED
    for name, budget in budgets.items():
      r, c = chunking.ghost_block_sizes(n, 1, example_bytes, budget, args.microbatch or 1)
      row = dict(model=args.model, n=n, num_params=num_params, microbatch=args.microbatch,
                 variant=name, memory_budget=budget, factor_bytes_per_example=example_bytes,
                 row_block=r, column_block=c)
      row.update(_ghost_memory(embed_fn, params, x, x_prime, args.microbatch, budget))
      print(json.dumps(row), flush=True)
      rows.append(row)
  return rows


def timing(args) -> list:
  settings = types.SimpleNamespace(temperature=1.0, learning_rate=1e-3, clip_norm=1.0,
                                   noise_multiplier=1.0)
  mb = f"@{args.microbatch}" if args.microbatch else ""
  rows = []
  for n in (int(s) for s in args.sizes.split(",")):
    embed_fn, params, x, x_prime, _ = step_benchmark.build_problem(args.model, n, args.image_size)
    steps = {}
    specs = {
        "nonprivate": step_benchmark.BASELINE, "triangle": f"triangle{mb}", "ghost": f"ghost{mb}"
    }
    for spec in (specs[m] for m in args.methods.split(",")):
      compiled, opt_state, info = step_benchmark.compile_step(spec, embed_fn, params, x, x_prime,
                                                              settings)
      if args.warmup:
        jax.block_until_ready(compiled(params, opt_state, x, x_prime))
      steps[spec] = (compiled, opt_state, info)
      print(f"compiled {spec} at n = {n}: {info}", flush=True)
    times = {spec: [] for spec in steps}
    for _ in range(args.repeats):
      for spec, (compiled, opt_state, _) in steps.items():
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, opt_state, x, x_prime))
        times[spec].append(time.perf_counter() - t0)
    base = statistics.median(times[step_benchmark.BASELINE])
    for spec, (_, _, info) in steps.items():
      row = dict(model=args.model, n=n, method=spec, repeats=args.repeats, times_s=times[spec],
                 median_s=statistics.median(times[spec]),
                 per_non_private=statistics.median(times[spec]) / base, **info)
      print(json.dumps(row), flush=True)
      rows.append(row)
  return rows


def main(argv=None) -> list:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("what", choices=("memory", "time"))
  parser.add_argument("--model", default="resnet18", choices=sorted(step_benchmark.MODELS))
  parser.add_argument("--sizes", default="256,1000")
  parser.add_argument("--microbatch", type=int, default=8)
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--budget", type=int, default=None,
                      help="memory_budget in bytes (default: the library's)")
  parser.add_argument("--skip-unbounded", action="store_true",
                      help="memory: only the blocked path, not the one-block contrast")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--methods", default="nonprivate,triangle,ghost",
                      help="time: a subset of nonprivate,triangle,ghost (nonprivate first)")
  parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                      help="time: an untimed run of each step before the timed ones")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  rows = memory(args) if args.what == "memory" else timing(args)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(device=str(jax.devices()[0]), argv=argv or sys.argv[1:], rows=rows), f,
                indent=1)
  return rows


if __name__ == "__main__":
  main()

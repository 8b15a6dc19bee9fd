r"""DP-GCL's memory and step time (docs/METHOD.md, "DP-GCL").

Memory (compile only, nothing is run; XLA's buffer assignment is deterministic):

    python -m benchmarks.grouped_cost memory --out benchmarks/results/grouped_memory.json

reads `compiled.memory_analysis()` of the jitted `grouped_clipped_grad` core for an MLP
512-1024-512-64 (1.08M parameters) at n = 512 records, G = 64 groups, and reports its
temporaries against the G·p float32 floats of a (G, p) group-gradient accumulator (the target:
≤ 25 %).

Time (one process, the steps interleaved, median of --repeats after a warm-up):

    python -m benchmarks.grouped_cost time --out benchmarks/results/grouped_time.json

times the jitted DP-GCL gradient and the non-private gradient (jax.value_and_grad of the
contrastive loss on the whole batch) for an MLP 256-256-256-64 at n = 1,000, G = 125 (the
target: ≤ 3×). Ratios, not absolute times: the machines are shared and noisy.

--tiny runs both at toy sizes (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import logit_dp


def mlp(widths):
  """(embed_fn, params) of a tanh MLP with the given layer widths (input first)."""
  keys = jax.random.split(jax.random.PRNGKey(0), len(widths))
  params = [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros((b,))}
            for k, a, b in zip(keys, widths[:-1], widths[1:])]

  def embed_fn(p, x):
    for i, layer in enumerate(p):
      x = x @ layer["w"] + layer["b"]
      if i < len(p) - 1:
        x = jnp.tanh(x)
    return x

  return embed_fn, params


def _problem(widths, n, num_groups, clip_norm=1.0):
  embed_fn, params = mlp(widths)
  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  x = jax.random.normal(k1, (n, widths[0]))
  x_prime = x + 0.3 * jax.random.normal(k2, x.shape)
  loss = logit_dp.losses.contrastive(0.5)
  grad_fn = logit_dp.baselines.grouped_clipped_grad(embed_fn, loss, clip_norm, num_groups)
  groups = logit_dp.baselines.assign_groups(jnp.arange(n), jax.random.PRNGKey(2), num_groups)
  args = (params, x, x_prime, jnp.ones((n,), bool), groups, None)
  return embed_fn, params, x, x_prime, loss, grad_fn, args


def memory(widths, n, num_groups) -> dict:
  _, params, _, _, _, grad_fn, args = _problem(widths, n, num_groups)
  p = sum(int(np.size(a)) for a in jax.tree_util.tree_leaves(params))
  start = time.perf_counter()
  analysis = grad_fn.core.lower(*args).compile().memory_analysis()
  accumulator = 4 * num_groups * p
  return dict(widths=list(widths), n=n, num_groups=num_groups, parameters=p,
              compile_s=time.perf_counter() - start, temp_bytes=int(analysis.temp_size_in_bytes),
              argument_bytes=int(analysis.argument_size_in_bytes),
              output_bytes=int(analysis.output_size_in_bytes), accumulator_bytes=accumulator,
              temp_over_accumulator=int(analysis.temp_size_in_bytes) / accumulator)


def _median_seconds(fn, args, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def step_time(widths, n, num_groups, repeats) -> dict:
  embed_fn, params, x, x_prime, loss, grad_fn, args = _problem(widths, n, num_groups)
  eps = logit_dp.losses.DEFAULT_COSINE_EPS

  @jax.jit
  def nonprivate(params, x, x_prime, mask):
    def total(p):
      z = logit_dp.losses.cosine_similarity(embed_fn(p, x), embed_fn(p, x_prime), eps)
      return loss(z, mask)

    return jax.value_and_grad(total)(params)

  private = grad_fn.core
  plain_args = args[:4]
  jax.block_until_ready(nonprivate(*plain_args))  # warm-up (compiles)
  jax.block_until_ready(private(*args))
  plain_s, private_s = [], []
  for _ in range(repeats):  # interleaved
    plain_s.append(_median_seconds(nonprivate, plain_args, 1))
    private_s.append(_median_seconds(private, args, 1))
  plain, gcl = statistics.median(plain_s), statistics.median(private_s)
  return dict(widths=list(widths), n=n, num_groups=num_groups, nonprivate_s=plain, dp_gcl_s=gcl,
              ratio=gcl / plain, repeats=repeats)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("what", choices=["memory", "time"])
  parser.add_argument("--tiny", action="store_true", help="toy sizes (a smoke test)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if args.what == "memory":
    widths, n, g = ((16, 32, 8), 32, 4) if args.tiny else ((512, 1024, 512, 64), 512, 64)
    result = memory(widths, n, g)
  else:
    widths, n, g = ((16, 32, 8), 40, 5) if args.tiny else ((256, 256, 256, 64), 1000, 125)
    result = step_time(widths, n, g, 2 if args.tiny else args.repeats)
  result.update(jax=jax.__version__, backend=jax.default_backend())
  text = json.dumps(result, indent=2)
  print(text)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main(sys.argv[1:])

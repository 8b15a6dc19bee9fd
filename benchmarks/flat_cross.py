r"""Ghost's cross terms over flattened parameters: the pairs' vectors against the cross-Gram.

For n rows and columns, d-dimensional embeddings and q flattened parameters (random per-example
Jacobians J_i, J'_j of shape (d, q) and unit vectors û_i, v̂_j), times in one process

  vectors      `layerwise.flat_cross` as "ghost" calls it (`methods.ghost.flat_cross_terms`:
               row chunks, a block of parameters at a time): ⟨J_iᵀv̂_j, J'_jᵀû_i⟩,
               2n²·d·q multiply-adds
  cross-Gram   `layerwise.flat_cross_gram` (what "ghost" forms at d ≤ 8): one (n·d × q)·(q × n·d)
               matmul per chunk of rows and its contraction with û_i and v̂_j: n²·d²·q
               multiply-adds at matmul speed

(median of --repeats after a first call) and their largest difference relative to the largest
term. The ViT of `benchmarks.transformers` flattens about 75,000-107,000 parameters:

  python -m benchmarks.flat_cross --n 128 --d 32 --q 74560 --out docs/benchmarks/flat_cross_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from logit_dp._src import chunking
from logit_dp._src import layerwise
from logit_dp._src.methods import ghost


def cross_gram(flat_rows, u_rows, flat_all, v_all) -> jax.Array:
  """`layerwise.flat_cross_gram` in row chunks of about `chunking.CROSS_GRAM_CHUNK_FLOATS`
  floats, as "ghost" forms it at small d."""
  n, d, _ = flat_all.shape
  return chunking.row_chunks(lambda f, u: layerwise.flat_cross_gram(f, u, flat_all, v_all),
                             (flat_rows, u_rows), n * d * d, chunking.CROSS_GRAM_CHUNK_FLOATS)


def measure(n: int, d: int, q: int, repeats: int) -> dict:
  keys = jax.random.split(jax.random.key(0), 4)
  flat_rows, flat_all = (jax.random.normal(k, (n, d, q)) for k in keys[:2])
  u, v = (a / jnp.linalg.norm(a, axis=1, keepdims=True)
          for a in (jax.random.normal(k, (n, d)) for k in keys[2:]))
  forms = {"vectors": jax.jit(ghost.flat_cross_terms), "cross-Gram": jax.jit(cross_gram)}
  out, seconds = {}, {}
  for name, fn in forms.items():
    out[name] = jax.block_until_ready(fn(flat_rows, u, flat_all, v))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(flat_rows, u, flat_all, v))
      times.append(time.perf_counter() - start)
    seconds[name] = float(np.median(times))
  scale = float(jnp.max(jnp.abs(out["cross-Gram"])))
  return {
      "n": n, "d": d, "q": q, "seconds": seconds,
      "ratio": seconds["cross-Gram"] / seconds["vectors"],
      "max_relative_difference": float(jnp.max(jnp.abs(out["vectors"] - out["cross-Gram"]))) / scale
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--n", type=int, default=128)
  parser.add_argument("--d", type=int, default=32)
  parser.add_argument("--q", type=int, default=74560)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  result = measure(args.n, args.d, args.q, args.repeats)
  result.update(machine=platform.processor() or platform.machine(), jax=jax.__version__)
  print(json.dumps(result))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()

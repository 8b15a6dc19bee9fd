r"""Convolution gradients inside a microbatch loop: JAX's rule vs layers.conv.channels_last_conv.

    python -m benchmarks.loop_conv --out results/loop_conv.json

XLA:CPU runs the convolutions JAX differentiates a convolution into (transposed dimension
labels) far slower inside a loop body than outside one (https://github.com/jax-ml/jax/issues/12868).
Microbatching (`microbatch_size=`) puts every backward pass of Logit-DP inside a lax.map, so this
measures, side by side in one process, ∂/∂(x, W) of one 3x3 convolution (the `--shape` batch,
NHWC, split into `--chunks` microbatches) for

  jax / unrolled         jax.vjp of lax.conv_general_dilated, microbatches in a Python loop
  jax / lax.map          the same inside lax.map (what microbatching compiles to)
  channels_last / ...    layers.conv.channels_last_conv (explicitly transposed operands), both ways

and checks that both give the same gradients. Median of --repeats runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import step_benchmark as sb
from logit_dp._src import layers


def measure(shape, features: int, stride: int, chunks: int, repeats: int) -> dict:
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, shape)
  kernel = jax.random.normal(kw, (3, 3, shape[-1], features)) / np.sqrt(9 * shape[-1])
  config = ((3, 3), (stride, stride), "SAME", (1, 1), (1, 1))
  convs = {
      "jax":
          lambda x, w: jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                                    dimension_numbers=("NHWC", "HWIO", "NHWC")),
      "channels_last":
          lambda x, w: layers.conv.channels_last_conv(x, w, config, None),
  }
  out_shape = jax.eval_shape(convs["jax"], x, kernel).shape
  g = jax.random.normal(kg, out_shape)
  split = lambda a: a.reshape((chunks, -1) + a.shape[1:])

  def chunk_grads(conv, xc, gc, w):
    return jax.vjp(conv, xc, w)[1](gc)

  def unrolled(conv):
    def run(x, g, w):
      parts = [chunk_grads(conv, xc, gc, w) for xc, gc in zip(split(x), split(g))]
      return jnp.concatenate([p[0] for p in parts]), sum(p[1] for p in parts)

    return run

  def looped(conv):
    def run(x, g, w):
      xs, ws = jax.lax.map(lambda a: chunk_grads(conv, *a, w), (split(x), split(g)))
      return xs.reshape(x.shape), ws.sum(0)

    return run

  out = {
      "shape": list(shape), "features": features, "stride": stride, "chunks": chunks,
      "median_s": {}
  }
  grads = {}
  for name, conv in convs.items():
    for how, make in (("unrolled", unrolled), ("lax.map", looped)):
      fn = jax.jit(make(conv))
      grads[name, how] = fn(x, g, kernel)
      out["median_s"][f"{name} / {how}"] = sb.median_and_min_s(fn, x, g, kernel, repeats=repeats)[0]
  reference = grads["jax", "unrolled"]
  out["max_rel_diff"] = max(
      float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for got in grads.values()
      for a, b in zip(got, reference))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.loop_conv",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--shape", default="16,32,32,64", help="input batch N,H,W,C")
  p.add_argument("--features", type=int, default=64)
  p.add_argument("--strides", default="1,2")
  p.add_argument("--chunks", type=int, default=2)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out", default=None, help="JSON output path")
  args = p.parse_args(argv)
  shape = tuple(int(s) for s in args.shape.split(","))
  results = [
      measure(shape, args.features, int(s), args.chunks, args.repeats)
      for s in args.strides.split(",")
  ]
  lines = [
      "| stride | " + " | ".join(results[0]["median_s"]) + " | lax.map slowdown, jax | "
      "lax.map slowdown, channels_last | max rel. diff |", "|---:|" + "---:|" *
      (len(results[0]["median_s"]) + 3)
  ]
  for r in results:
    t = r["median_s"]
    lines.append(f"| {r['stride']} | " + " | ".join(f"{v * 1e3:.1f} ms" for v in t.values())
                 + f" | {t['jax / lax.map'] / t['jax / unrolled']:.1f}× | "
                 f"{t['channels_last / lax.map'] / t['channels_last / unrolled']:.1f}× | "
                 f"{r['max_rel_diff']:.1e} |")
  print("\n".join(lines))
  report = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "results": results}
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  return report


if __name__ == "__main__":
  sys.exit(main() and 0)

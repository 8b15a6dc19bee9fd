r"""Where the compile time of a "ghost" gradient goes (CPU or accelerator).

    python -m benchmarks.compile_profile --out benchmarks/results/compile_profile.json

For each model (benchmarks.frameworks' linen MLP 256→128→128→16 and the paper's embedding
net, n = 128) it records, in CPU seconds of this process (the minimum over --repeats compiles of
freshly built functions): tracing, lowering and XLA compilation of the non-private gradient
(jitted jax.value_and_grad of the loss) and of `clipped_grad(..., "ghost")`, the lines of their
optimised HLO, and the compile time of ghost with one part of the computation left out at a
time (the gradients of these variants are not valid; they measure what the part costs to
compile):

  no vectors    the positive pairs and the flagged pairs formed as vectors
                (pair_terms.refine_flagged)
  no cross      the cross terms of the pair norms (ghost.ghost_terms keeps a and b only)

The variants patch the library's internal modules (logit_dp/_src).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time

import jax
import jax.numpy as jnp

import logit_dp
from benchmarks import frameworks
from logit_dp._src import pair_terms
from logit_dp._src.methods import ghost

VARIANTS = ("ghost", "no vectors", "no cross")


@contextlib.contextmanager
def _left_out(variant: str):
  """The library with one part of the ghost computation left out (nothing for "ghost")."""
  saved = (pair_terms.refine_flagged, ghost.ghost_terms)
  if variant == "no vectors":
    pair_terms.refine_flagged = lambda norms, *args, **kwargs: norms
  elif variant == "no cross":

    def without_cross(f_u, u_rows, f_v, v_columns):
      anchor, positive = pair_terms.quadratic_terms(f_u.gram, f_v.gram, u_rows, v_columns)
      return anchor, positive, jnp.zeros_like(anchor)

    ghost.ghost_terms = without_cross
  try:
    yield
  finally:
    pair_terms.refine_flagged, ghost.ghost_terms = saved


def _stages(fn, args) -> dict:
  """CPU seconds to trace, lower and compile fn, and the lines of its optimised HLO."""
  times = [time.process_time()]
  traced = jax.jit(fn).trace(*args)
  times.append(time.process_time())
  lowered = traced.lower()
  times.append(time.process_time())
  compiled = lowered.compile()
  times.append(time.process_time())
  return {
      "trace_s": times[1] - times[0], "lower_s": times[2] - times[1],
      "compile_s": times[3] - times[2], "total_s": times[3] - times[0],
      "hlo_lines": compiled.as_text().count("\n")
  }


def profile(arch: str, n: int, repeats: int) -> dict:
  """The stages of the non-private and ghost gradients and of the left-out variants."""
  loss = logit_dp.losses.contrastive(temperature=1.0)
  embed_fn, params, shape = frameworks.build("linen", arch)
  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  x = jax.random.normal(k1, (n,) + shape)
  args = (params, x, x + 0.1 * jax.random.normal(k2, x.shape), jnp.ones((n,), bool))

  def make_nonprivate():
    def nonprivate(p, anchors, positives, mask):
      z = lambda w: loss(
          logit_dp.losses.cosine_similarity(embed_fn(w, anchors), embed_fn(w, positives)), mask)
      return jax.value_and_grad(z)(p)

    return nonprivate

  # Untimed: the eager input checks of the first trace of a grad_fn in a process.
  jax.jit(logit_dp.clipped_grad(embed_fn, loss, 1.0, "ghost")).lower(*args)
  rows = {}
  for _ in range(repeats):
    for name in ("nonprivate",) + VARIANTS:
      with _left_out(name):
        if name == "nonprivate":
          fn = make_nonprivate()
        else:
          fn = logit_dp.clipped_grad(embed_fn, loss, 1.0, "ghost")
        stages = _stages(fn, args)
      best = rows.setdefault(name, stages)
      for key, value in stages.items():
        best[key] = min(best[key], value)
  for name, row in rows.items():
    values = " ".join(
        f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
    print(f"{arch:14s} {name:12s} {values}", flush=True)
  return {"arch": arch, "n": n, "stages": rows}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default="mlp,embedding_net")
  p.add_argument("--n", type=int, default=128)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  report = {
      "command":
          "python -m benchmarks.compile_profile " + " ".join(
              f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
      "machine": {
          "platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
          "backend": jax.default_backend()
      },
      "results": [profile(arch, args.n, args.repeats) for arch in args.models.split(",")],
  }
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()

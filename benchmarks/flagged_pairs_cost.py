r"""What forming pairs as vectors costs "ghost": full training steps in one process.

    python -m benchmarks.flagged_pairs_cost --sizes 256,1000 --repeats 5 \
        --out docs/benchmarks/flagged_pairs_cost_cpu.json

Per batch size n (the embedding net, `step_benchmark.build_problem`: views x' = x + 0.1·noise,
B = 1), the jitted training steps, timed interleaved (median of --repeats): the non-private
step; "ghost" as shipped (the positive pairs and the pairs whose Gram allowance bites formed as
vectors, those at or below B left as they are); "ghost" forming every such pair whatever its
norm (what `pair_norms` does); "ghost" forming none (not a valid gradient: its positives keep
their Gram-form norms; the cost of everything else). Ratios to the non-private step of the same
run.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from benchmarks import step_benchmark as sb
from logit_dp._src import pair_terms

_REFINE_GRAM_PAIRS = pair_terms.refine_gram_pairs


def _every_flagged_pair(*args, **kwargs):
  """`pair_terms.refine_gram_pairs` tightening the flagged pairs below B too."""
  return _REFINE_GRAM_PAIRS(*args, **{**kwargs, "above": 0.0})


VARIANTS = {
    "non-private": (sb.BASELINE, ()),
    "ghost": ("ghost", ()),
    "ghost, every flagged pair formed":
        ("ghost", ((pair_terms, "refine_gram_pairs", _every_flagged_pair),)),
    "ghost, no pair formed (not valid)":
        ("ghost", ((pair_terms, "refine_flagged", lambda norms, *args, **kwargs: norms),)),
}


def run(n: int, repeats: int, variants: dict | None = None) -> dict:
  """Times the training steps of `variants` (name: (method spec, patches); default VARIANTS),
  each patch (module, attribute, value) set while its step is built."""
  variants = VARIANTS if variants is None else variants
  embed_fn, params, x, x_prime, _ = sb.build_problem("embedding", n, 32)
  args = argparse.Namespace(temperature=1.0, clip_norm=1.0, noise_multiplier=1.0,
                            learning_rate=1e-3)

  def compiled(spec, patches):
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
      setattr(module, name, value)
    try:
      fresh = lambda p, xs: embed_fn(p, xs)  # nothing compiled is shared between variants
      step, tx = sb.make_step(spec, fresh, n, args)
      state = tx.init(params)
      return jax.jit(step).lower(params, state, x, x_prime).compile(), (params, state, x, x_prime)
    finally:
      for module, name, value in saved:
        setattr(module, name, value)

  steps = {name: compiled(*variant) for name, variant in variants.items()}
  for step, step_args in steps.values():
    jax.block_until_ready(step(*step_args))
  times = {name: [] for name in steps}
  for _ in range(repeats):
    for name, (step, step_args) in steps.items():
      jax.block_until_ready(step(*step_args))  # each timed run after an untimed one
      start = time.perf_counter()
      jax.block_until_ready(step(*step_args))
      times[name].append(time.perf_counter() - start)
  base = float(np.median(times["non-private"]))
  return {
      "n": n, "load_average": open("/proc/loadavg").read().split()[:3], "variants": {
          name: {"median_s": float(np.median(t)), "ratio": float(np.median(t)) / base}
          for name, t in times.items()
      }
  }


def main(argv=None) -> list:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="256,1000")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  results = []
  for n in (int(s) for s in args.sizes.split(",")):
    results.append(run(n, args.repeats))
    print(json.dumps(results[-1]))
  sb.write({"machine": sb.machine_info(), "code": sb.code_version(), "results": results}, args.out)
  return results


if __name__ == "__main__":
  main()

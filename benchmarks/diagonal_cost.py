r"""What the float32-safe clip norms cost: ghost / triangle gradients with and without them.

    python -m benchmarks.diagonal_cost --sizes 256,1000 --repeats 5 --out results/diag.json

In one process, for the paper's embedding net on random CIFAR-sized inputs, it times the
jitted `clipped_grad` of "ghost" and "triangle" in three variants, the runs interleaved:
as shipped (the positive pairs formed as vectors: "ghost" from its factors, the flagged ones
again in float64; "triangle" in float64; float allowances, the flagged pairs formed again),
with `float64_positive_pairs=False`, and with the positive pairs, the allowances and the
recomputation of flagged pairs switched off (the norms of a release without them). Views
x' = x + σ·noise (--view-noise σ; 0.01: near-identical, every positive flagged). It reports
the medians and their ratios. Ratios, not absolute times: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import logit_dp
from logit_dp import models
from logit_dp._src import numerics
from logit_dp._src import pair_terms

# (module, name) of what the previous release did not have: the diagonal pairs from their
# vectors and the float32 allowances.
_SWITCHES = ((pair_terms, "diagonal_norms"), (pair_terms, "refine_flagged"),
             (pair_terms, "factor_positive_norms"), (numerics, "GRAM_FLOAT_ERROR"),
             (numerics, "VECTOR_FLOAT_ERROR"))

VARIANTS = ("shipped", "float32_pairs", "without")


def _compiled(method: str, variant: str, microbatch_size: int, params, x, x_prime, mask):
  """The compiled `clipped_grad` core of `method` in `variant` (one of VARIANTS)."""
  model = models.EmbeddingNet()
  loss = logit_dp.losses.contrastive(temperature=1.0)
  fresh = lambda p, xs: model.apply(p, xs)  # a new function: nothing compiled is shared
  grad_fn = logit_dp.clipped_grad(fresh, loss, 1.0, method, microbatch_size=microbatch_size,
                                  float64_positive_pairs=variant == "shipped")
  safe = variant != "without"
  saved = [getattr(module, name) for module, name in _SWITCHES]
  if not safe:
    numerics.GRAM_FLOAT_ERROR = numerics.VECTOR_FLOAT_ERROR = 0.0
    # the diagonal not computed (its values then differ: only the time is compared)
    pair_terms.diagonal_norms = lambda batch: (jnp.full(
        (batch.u_loc.shape[0],), jnp.inf, batch.u_loc.dtype), 0.0)
    pair_terms.factor_positive_norms = lambda f_u, u, *args: jnp.full(
        (u.shape[0],), jnp.inf, u.dtype)
    pair_terms.refine_flagged = lambda norms, *args, **kwargs: norms
  try:
    return jax.jit(grad_fn.core).lower(params, x, x_prime, mask).compile()
  finally:
    for (module, name), value in zip(_SWITCHES, saved):
      setattr(module, name, value)


def main(argv=None) -> list:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="256,1000")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--microbatch", type=int, default=250)
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--view-noise", type=float, default=0.01)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  results = []
  for n in (int(s) for s in args.sizes.split(",")):
    x = jax.random.uniform(jax.random.PRNGKey(0), (n, args.image_size, args.image_size, 3))
    x_prime = x + args.view_noise * jax.random.normal(jax.random.PRNGKey(1), x.shape)
    params = models.EmbeddingNet().init(jax.random.PRNGKey(2), x[:1])
    mask = jnp.ones((n,), bool)
    for method in ("ghost", "triangle"):
      steps = {
          variant: _compiled(method, variant, args.microbatch, params, x, x_prime, mask)
          for variant in VARIANTS
      }
      times = {variant: [] for variant in VARIANTS}
      for step in steps.values():
        jax.block_until_ready(step(params, x, x_prime, mask))  # warm-up
      for _ in range(args.repeats):
        for variant, step in steps.items():
          t0 = time.perf_counter()
          jax.block_until_ready(step(params, x, x_prime, mask))
          times[variant].append(time.perf_counter() - t0)
      row = dict(n=n, method=method, view_noise=args.view_noise)
      row.update({f"{variant}_s": statistics.median(times[variant]) for variant in VARIANTS})
      row["ratio"] = row["shipped_s"] / row["without_s"]
      row["float64_ratio"] = row["shipped_s"] / row["float32_pairs_s"]
      print(json.dumps(row))
      results.append(row)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(device=str(jax.devices()[0]), repeats=args.repeats, rows=results), f, indent=1)
  return results


if __name__ == "__main__":
  main()

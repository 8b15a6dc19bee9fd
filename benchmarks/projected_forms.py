r"""The "projected" bound's pair terms in their two forms, side by side in one process.

    python -m benchmarks.projected_forms --sizes 1000,4000 --dims 8,16,32 [--repeats 5]

For each (n, d): the paper's embedding net with embedding dimension d, a batch of n CIFAR-shaped
pairs, 64 reference inputs, rank 32. Times one jitted `clipped_grad` of each of: the non-private
gradient, "triangle", and "projected" with the pair terms in the Gram form and in the vector
form (`projection.GRAM_FORM_MAX_DIM` set to force each; the two compile separately), called in
turn ``repeats`` times after a warm-up, and reports medians and ratios. Also checks that both
forms give the same ḡ. JSON on stdout (docs/BENCHMARKS.md quotes it).
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import logit_dp
from logit_dp import models
from logit_dp._src import projection


def problem(n: int, d: int, image_size: int, seed: int = 0):
  """(embed_fn, params, x, x', reference): the embedding net with embedding dimension d, n
  random image pairs (x' = x + noise) of image_size², and 64 random reference inputs."""
  model = models.EmbeddingNet(embedding_dim=d)
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.uniform(k1, (n, image_size, image_size, 3))
  x_prime = x + 0.1 * jax.random.normal(k2, x.shape)
  reference = jax.random.uniform(k4, (64,) + x.shape[1:])
  return model.apply, jax.jit(model.init)(k3, x[:1]), x, x_prime, reference


def compile_variants(embed_fn, reference, rank: int, args: tuple, variants: dict,
                     microbatch_size: int | None = None) -> dict:
  """The non-private gradient, "triangle", and one "projected" step per variant, each compiled
  for ``args`` = (params, x, x'). variants: {name: (module, attribute, value)}, the library
  switch set to value while that step is traced (and restored after)."""
  loss = logit_dp.losses.contrastive(temperature=1.0)

  def non_private(params, x, x_prime):
    return jax.value_and_grad(lambda p: loss(
        logit_dp.losses.cosine_similarity(embed_fn(p, x), embed_fn(p, x_prime))))(params)

  fns = {
      "non_private":
          jax.jit(non_private).lower(*args).compile(), "triangle":
              jax.jit(
                  logit_dp.clipped_grad(embed_fn, loss, 1.0, "triangle",
                                        microbatch_size=microbatch_size)).lower(*args).compile()
  }
  for name, (module, attribute, value) in variants.items():
    saved = getattr(module, attribute)
    setattr(module, attribute, value)
    try:
      fn = jax.jit(
          logit_dp.clipped_grad(
              embed_fn, loss, 1.0,
              logit_dp.clip_methods.Projected(reference_inputs=reference, rank=rank),
              microbatch_size=microbatch_size))
      fns[name] = fn.lower(*args).compile()  # traced now, under this variant
    finally:
      setattr(module, attribute, saved)
  return fns


def _time(fn, args) -> float:
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t


def time_side_by_side(fns: dict, call_args: tuple, repeats: int, first: str,
                      second: str) -> tuple[dict, float]:
  """({name: median seconds}, ‖ḡ_first − ḡ_second‖ / ‖ḡ_second‖): every (ℒ, ḡ) function called
  once to warm up, then in turn ``repeats`` times (interleaved, so load changes hit all alike)."""
  outs = {name: fn(*call_args) for name, fn in fns.items()}
  a, b = (jax.tree_util.tree_leaves(outs[k][1]) for k in (first, second))
  num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(a, b))
  den = sum(float(jnp.sum(y ** 2)) for y in b)
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      times[name].append(_time(fn, call_args))
  return {name: float(np.median(t)) for name, t in times.items()}, (num / den) ** 0.5


def compare_rows(args, build, first: str, second: str, ratio_key: str, **fields) -> list[dict]:
  """One JSON row per (n, d) of args.sizes × args.dims: build(n, d) -> (fns, call_args), timed
  by `time_side_by_side`; median seconds, first/second as ``ratio_key``, every function over the
  non-private step, and the relative ḡ difference of first and second. Printed as they come,
  then all of them with the device."""
  rows = []
  for n in (int(s) for s in args.sizes.split(",")):
    for d in (int(s) for s in args.dims.split(",")):
      fns, call_args = build(n, d)
      median, difference = time_side_by_side(fns, call_args, args.repeats, first, second)
      row = dict(n=n, d=d, rank=args.rank, **fields, median_s=median,
                 **{ratio_key: median[first] / median[second]},
                 over_non_private={k: v / median["non_private"] for k, v in median.items()},
                 grad_relative_difference=difference)
      rows.append(row)
      print(json.dumps(row), flush=True)
  print(json.dumps(dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=rows), indent=1))
  return rows


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="1000")
  parser.add_argument("--dims", default="8,16,32")
  parser.add_argument("--rank", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--image-size", type=int, default=32)
  args = parser.parse_args(argv)

  def build(n, d):
    embed_fn, params, x, x_prime, reference = problem(n, d, args.image_size)
    call_args = (params, x, x_prime)
    forms = {
        "projected_gram": (projection, "GRAM_FORM_MAX_DIM", 1 << 30),
        "projected_vector": (projection, "GRAM_FORM_MAX_DIM", 0)
    }
    return compile_variants(embed_fn, reference, args.rank, call_args, forms), call_args

  return compare_rows(args, build, "projected_gram", "projected_vector", "gram_over_vector")


if __name__ == "__main__":
  main()

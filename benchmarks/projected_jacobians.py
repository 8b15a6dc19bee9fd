r"""The "projected" step with its per-example projections J_eQ̃ formed two ways, in one process.

    python -m benchmarks.projected_jacobians --sizes 2000,4000 --dims 8,16,32 [--repeats 3]

For each (n, d): the paper's embedding net with embedding dimension d, n CIFAR-shaped pairs,
64 reference inputs, rank 32, microbatches of 1,000 (the full-size runs' setting). Times one
jitted `clipped_grad` step of: the non-private gradient, "triangle", and "projected" with J_eQ̃
from `layerwise.factors_times` (GEMMs, the library's way since 2026-11-24) and from
`jax.linear_transpose` of `layerwise.factors_transpose` vmapped over the k tangents (the way
before: its ghost layers broadcast a (k, m, T, d, C) product). Called in turn ``repeats`` times
after a warm-up; medians and ratios. Also checks that both give the same ḡ. JSON on stdout
(docs/BENCHMARKS.md quotes it).
"""

import argparse
import json

import jax
import jax.numpy as jnp

import logit_dp
from benchmarks import projected_forms
from logit_dp import models
from logit_dp._src import clipping
from logit_dp._src import layerwise


def transposed_projections(batch, factors, tangent_leaves):
  """J_eQ̃ (m, d, k) as the library formed it before `layerwise.factors_times`."""
  leaves = jax.tree_util.tree_leaves(batch.params)
  m, d, _ = factors.flat.shape
  contract = lambda c: layerwise.factors_transpose(batch.plan, factors, c, leaves)
  transposed = jax.linear_transpose(contract, batch.c.varying(jnp.zeros((m, d),
                                                                        factors.flat.dtype)))
  return jax.vmap(lambda q: transposed(q)[0], out_axes=-1)(batch.c.varying(tangent_leaves))


def _functions(d: int, n: int, rank: int, microbatch: int, image_size: int,
               seed: int = 0) -> tuple[dict, tuple]:
  model = models.EmbeddingNet(embedding_dim=d)
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.uniform(k1, (n, image_size, image_size, 3))
  x_prime = x + 0.1 * jax.random.normal(k2, x.shape)
  reference = jax.random.uniform(k4, (64,) + x.shape[1:])
  args = (jax.jit(model.init)(k3, x[:1]), x, x_prime)
  loss = logit_dp.losses.contrastive(temperature=1.0)

  def non_private(params, x, x_prime):
    return jax.value_and_grad(lambda p: loss(
        logit_dp.cosine_similarity(model.apply(p, x), model.apply(p, x_prime))))(params)

  fns = {
      "non_private":
          jax.jit(non_private).lower(*args).compile(), "triangle":
              jax.jit(
                  logit_dp.clipped_grad(model.apply, loss, 1.0, "triangle",
                                        microbatch_size=microbatch)).lower(*args).compile()
  }
  for name, projections in (("projected_gemm", clipping._projected_jacobians),
                            ("projected_transpose", transposed_projections)):
    saved = clipping._projected_jacobians
    clipping._projected_jacobians = projections
    try:
      fns[name] = jax.jit(
          logit_dp.clipped_grad(model.apply, loss, 1.0, "projected", reference_inputs=reference,
                                projection_rank=rank,
                                microbatch_size=microbatch)).lower(*args).compile()
    finally:
      clipping._projected_jacobians = saved
  return fns, args


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="2000")
  parser.add_argument("--dims", default="8,16,32")
  parser.add_argument("--rank", type=int, default=32)
  parser.add_argument("--microbatch", type=int, default=1000)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--image-size", type=int, default=32)
  args = parser.parse_args(argv)
  rows = []
  for n in (int(s) for s in args.sizes.split(",")):
    for d in (int(s) for s in args.dims.split(",")):
      fns, call_args = _functions(d, n, args.rank, args.microbatch, args.image_size)
      median, difference = projected_forms.time_side_by_side(fns, call_args, args.repeats,
                                                             "projected_gemm",
                                                             "projected_transpose")
      row = dict(n=n, d=d, rank=args.rank, microbatch=args.microbatch, median_s=median,
                 gemm_over_transpose=median["projected_gemm"] / median["projected_transpose"],
                 over_non_private={k: v / median["non_private"] for k, v in median.items()},
                 grad_relative_difference=difference)
      rows.append(row)
      print(json.dumps(row), flush=True)
  print(json.dumps(dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=rows), indent=1))
  return rows


if __name__ == "__main__":
  main()

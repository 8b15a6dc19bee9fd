r"""The "projected" step with its per-example projections J_eQ̃ formed two ways, in one process.

    python -m benchmarks.projected_jacobians --sizes 2000,4000 --dims 8,16,32 [--repeats 3]

For each (n, d): the paper's embedding net with embedding dimension d, n CIFAR-shaped pairs,
64 reference inputs, rank 32, microbatches of 1,000 (the full-size runs' setting). Times one
jitted `clipped_grad` step of: the non-private gradient, "triangle", and "projected" with J_eQ̃
from `layerwise.factors_times` (GEMMs, the library's way) and from
`jax.linear_transpose` of `layerwise.factors_transpose` vmapped over the k tangents (the way
before: its ghost layers broadcast a (k, m, T, d, C) product). Called in turn ``repeats`` times
after a warm-up; medians and ratios. Also checks that both give the same ḡ. JSON on stdout
(docs/BENCHMARKS.md quotes it).
"""

import argparse

import jax
import jax.numpy as jnp

from benchmarks import projected_forms
from logit_dp._src import layerwise
from logit_dp._src.methods import bounds


def transposed_projections(batch, factors, tangent_leaves):
  """J_eQ̃ (m, d, k) as the library formed it before `layerwise.factors_times`."""
  leaves = jax.tree_util.tree_leaves(batch.params)
  m, d, _ = factors.flat.shape
  contract = lambda c: layerwise.factors_transpose(batch.plan, factors, c, leaves)
  transposed = jax.linear_transpose(contract, batch.c.varying(jnp.zeros((m, d),
                                                                        factors.flat.dtype)))
  return jax.vmap(lambda q: transposed(q)[0], out_axes=-1)(batch.c.varying(tangent_leaves))


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="2000")
  parser.add_argument("--dims", default="8,16,32")
  parser.add_argument("--rank", type=int, default=32)
  parser.add_argument("--microbatch", type=int, default=1000)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--image-size", type=int, default=32)
  args = parser.parse_args(argv)
  ways = {
      "projected_gemm": (bounds, "projected_jacobians", bounds.projected_jacobians),
      "projected_transpose": (bounds, "projected_jacobians", transposed_projections)
  }

  def build(n, d):
    embed_fn, params, x, x_prime, reference = projected_forms.problem(n, d, args.image_size)
    call_args = (params, x, x_prime)
    return projected_forms.compile_variants(embed_fn, reference, args.rank, call_args, ways,
                                            args.microbatch), call_args

  return projected_forms.compare_rows(args, build, "projected_gemm", "projected_transpose",
                                      "gemm_over_transpose", microbatch=args.microbatch)


if __name__ == "__main__":
  main()

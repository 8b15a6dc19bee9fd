r"""How far the backend's default float32 contraction precision moves pair-gradient norms.

    python -m benchmarks.precision_check --out results/precision.json

For the embedding net and ResNet-18 (no batch norm) it computes, with plain JAX (no
logit_dp code), the gradients g_ij = ∇_w Z_ij of a few pair similarities twice: at the
backend's default precision for float32 matmuls and convolutions (TF32 on NVIDIA GPUs
since Ampere; full float32 on CPU) and at "highest". It reports, over the pairs,

    max |‖g_ij‖_default − ‖g_ij‖_highest| / ‖g_ij‖_highest     (norm error)
    max ‖g_ij,default − g_ij,highest‖ / ‖g_ij,highest‖          (vector error)

A clip factor computed in one pass and a gradient computed in another, each carrying
errors of this size, give a clipped pair gradient whose norm can be off B by about the
norm error: the reason `logit_dp.clipped_grad` pins "highest" (see its docstring).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import step_benchmark as sb


def _pair_gradients(embed_fn, params, x, x_prime, pairs):
  def z(p, i, j):
    u = embed_fn(p, x[i][None])[0]
    v = embed_fn(p, x_prime[j][None])[0]
    return jnp.dot(u, v) / (jnp.linalg.norm(u) * jnp.linalg.norm(v))

  def flat_grad(i, j):
    g = jax.grad(z)(params, i, j)
    return jnp.concatenate([leaf.ravel() for leaf in jax.tree_util.tree_leaves(g)])

  i, j = jnp.asarray(pairs).T
  return jax.jit(lambda i, j: jax.lax.map(lambda ij: flat_grad(*ij), (i, j)))(i, j)


def check(model: str, n: int = 8, image_size: int = 32) -> dict:
  embed_fn, params, x, x_prime, p = sb.build_problem(model, n, image_size)
  pairs = [(i, j) for i in range(n) for j in range(n) if (i + j) % 3 == 0][:16]
  with jax.default_matmul_precision("highest"):
    exact = np.asarray(_pair_gradients(embed_fn, params, x, x_prime, pairs), np.float64)
  default = np.asarray(_pair_gradients(embed_fn, params, x, x_prime, pairs), np.float64)
  norms = np.linalg.norm(exact, axis=1)
  return {
      "model": model, "num_params": p, "pairs": len(pairs), "backend": jax.default_backend(),
      "device_kind": jax.devices()[0].device_kind,
      "norm_error_max": float(np.max(np.abs(np.linalg.norm(default, axis=1) - norms) / norms)),
      "vector_error_max": float(np.max(np.linalg.norm(default - exact, axis=1) / norms))
  }


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.precision_check")
  ap.add_argument("--models", default="embedding,resnet18")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  rows = [check(m.strip()) for m in args.models.split(",") if m.strip()]
  for r in rows:
    print(f"{r['model']:10s} {r['backend']} ({r['device_kind']}): ‖g‖ relative error "
          f"{r['norm_error_max']:.2e}, g relative error {r['vector_error_max']:.2e} "
          f"over {r['pairs']} pairs")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)
  return rows


if __name__ == "__main__":
  main(sys.argv[1:])

r"""Step time of data-parallel Logit-DP against the number of devices.

    python -m benchmarks.device_scaling                       # 1, 2, 4, 8 simulated CPU devices
    python -m benchmarks.device_scaling --devices 1,2,4,8 --batch 256 --repeats 5 \
        --out benchmarks/results/device_scaling.json

One full private step at a FIXED global batch of n pairs (the paper's
EmbeddingNet on 32×32×3 inputs, contrastive loss τ = 0.5), built with
`logit_dp.distributed.make_private_train_step` on a k-device mesh:

    ḡ = sharded clipped_grad (all-gathered embeddings, global n×n pair matrix, psum)
    params, opt_state = chain(logit_dp.transform(σ, C), adam).update(ḡ)   (replicated)

for `ghost` and `triangle`, and `nonprivate`: the same data-parallel step with
`naive_clipped_grad(clip_norm=inf)` (the exact gradient: one forward pass, the
global loss, one backward pass) and plain adam. Each configuration is compiled
and run once (warm-up, compile time recorded), then `--repeats` rounds run every
configuration once each, interleaved, timed with `jax.block_until_ready`.

On a CPU, `--xla_force_host_platform_device_count` SIMULATES k devices that share
the same physical cores (2 on the development machine), so no speed-up is
possible: at a fixed global batch the total work is constant and the table
measures the cost of the data-parallel code path itself (collectives, the n×n
similarity matrix and loss computed on every device, per-device program
overhead). Run it on a machine with several accelerators for real scaling; the
script uses whatever `jax.devices()` lists (it sets the CPU flag only when no
XLA_FLAGS are given, and the flag has no effect on GPUs/TPUs).
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import logit_dp  # noqa: E402
from logit_dp import distributed  # noqa: E402

METHODS = ("nonprivate", "ghost", "triangle")


def _model():
  try:
    from logit_dp.models import EmbeddingNet
    return EmbeddingNet(embedding_dim=8), "logit_dp.models.EmbeddingNet(embedding_dim=8)"
  except ImportError:  # pragma: no cover - the models module is optional here
    import flax.linen as nn

    class EmbeddingNet(nn.Module):
      @nn.compact
      def __call__(self, x):
        for c in (8, 16, 32):
          x = nn.relu(nn.Conv(c, (3, 3), strides=(2, 2))(x))
        return nn.Dense(8)(x.mean(axis=(1, 2)))

    return EmbeddingNet(), "local EmbeddingNet (8/16/32 convs, d=8)"


def build_step(method: str, model, params, mesh, loss, clip_norm: float, sigma: float, key):
  """The jitted data-parallel step and its replicated (params, opt_state)."""
  if method == "nonprivate":
    opt = optax.adam(1e-3)
    step = distributed.make_private_train_step(model.apply, loss, jnp.inf, mesh, opt,
                                               method="naive", non_private=True)
  else:
    c = logit_dp.sensitivity(loss, clip_norm)
    opt = distributed.make_private_optimizer(sigma, c, key, optax.adam(1e-3))
    step = distributed.make_private_train_step(model.apply, loss, clip_norm, mesh, opt,
                                               method=method)
  return step, distributed.replicate(params, mesh), distributed.replicate(opt.init(params), mesh)


def run(device_counts, methods, batch: int, image_size: int, repeats: int) -> dict:
  model, model_name = _model()
  loss = logit_dp.losses.contrastive(temperature=0.5)
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(k1, (batch, image_size, image_size, 3))
  x_prime = x + 0.3 * jax.random.normal(k2, x.shape)
  params = model.init(k3, x[:1])
  num_params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))
  configs = {}
  for k in device_counts:
    if batch % k:
      raise ValueError(f"--batch {batch} must divide by every device count, not {k}.")
    mesh = distributed.data_mesh(k)
    xs, xps, mask = distributed.shard_batch(mesh, np.asarray(x), np.asarray(x_prime))
    for method in methods:
      step, p, s = build_step(method, model, params, mesh, loss, 1.0, 1.0, jax.random.PRNGKey(1))
      t0 = time.perf_counter()
      jax.block_until_ready(step(p, s, xs, xps, mask))
      first = time.perf_counter() - t0
      configs[(k, method)] = dict(step=step, args=(p, s, xs, xps, mask), first_s=first, times=[])
      print(f"k={k} {method}: first call (compile + run) {first:.2f}s", flush=True)
  for _ in range(repeats):
    for cfg in configs.values():
      t0 = time.perf_counter()
      jax.block_until_ready(cfg["step"](*cfg["args"]))
      cfg["times"].append(time.perf_counter() - t0)
  rows = []
  for (k, method), cfg in configs.items():
    base = configs.get((device_counts[0], method))
    med = statistics.median(cfg["times"])
    rows.append(
        dict(
            devices=k, method=method, per_device_batch=batch // k, median_s=med,
            min_s=min(cfg["times"]), first_call_s=cfg["first_s"], times_s=cfg["times"],
            vs_fewest_devices=med / statistics.median(base["times"]),
            vs_nonprivate_same_k=(med / statistics.median(configs[(k, "nonprivate")]["times"]) if
                                  (k, "nonprivate") in configs else None)))
  return dict(benchmark="device_scaling", date=datetime.datetime.now(datetime.UTC).isoformat(),
              jax=jax.__version__, backend=jax.default_backend(),
              device_kind=jax.devices()[0].device_kind, visible_devices=jax.device_count(),
              host_cpus=os.cpu_count(), platform=platform.platform(),
              xla_flags=os.environ.get("XLA_FLAGS",
                                       ""), model=model_name, num_params=int(num_params),
              loss="contrastive(tau=0.5)", global_batch=batch, image_size=image_size,
              repeats=repeats, simulated_devices=jax.default_backend() == "cpu", rows=rows)


def markdown(result: dict) -> str:
  simulated = (f", simulated devices sharing {result['host_cpus']} CPU cores"
               if result["simulated_devices"] else "")
  lines = [
      f"Global batch n = {result['global_batch']} pairs, {result['model']} ({result['num_params']} "
      f"params), {result['loss']}, backend {result['backend']} ({result['device_kind']}"
      f"{simulated}), "
      f"jax {result['jax']}, median of {result['repeats']} interleaved runs.",
      "",
      "| devices | pairs / device | method | median step (s) | min (s) | vs. fewest devices "
      "| vs. non-private (same k) | first call (s) |",
      "|---:|---:|---|---:|---:|---:|---:|---:|",
  ]
  for r in sorted(result["rows"], key=lambda r: (METHODS.index(r["method"]), r["devices"])):
    vs_np = "" if r["vs_nonprivate_same_k"] is None else f"{r['vs_nonprivate_same_k']:.2f}×"
    lines.append(
        f"| {r['devices']} | {r['per_device_batch']} | {r['method']} | {r['median_s']:.3f} | "
        f"{r['min_s']:.3f} | {r['vs_fewest_devices']:.2f}× | {vs_np} | {r['first_call_s']:.1f} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", default="1,2,4,8", help="comma-separated device counts")
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--batch", type=int, default=256, help="global batch (pairs)")
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="benchmarks/results/device_scaling.json",
                      help="JSON output; the markdown table goes next to it (.md)")
  args = parser.parse_args(argv)
  counts = [int(c) for c in args.devices.split(",")]
  if max(counts) > jax.device_count():
    raise SystemExit(f"asked for {max(counts)} devices, {jax.device_count()} visible.")
  methods = [m for m in args.methods.split(",") if m]
  unknown = set(methods) - set(METHODS)
  if unknown:
    raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {METHODS}.")
  result = run(counts, methods, args.batch, args.image_size, args.repeats)
  table = markdown(result)
  print(table)
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
      f.write(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()

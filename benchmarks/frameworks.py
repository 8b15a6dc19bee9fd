r"""One architecture, four frameworks: step and compile time of `clipped_grad` side by side.

The same network with the same weights as a flax.linen module (logit_dp.models), a flax.nnx
module (``nnx.split`` / ``nnx.merge``), an Equinox module written per example and vmapped
(``eqx.partition`` / ``eqx.combine``) and a plain function of a params dict
(``jnp.dot`` / ``lax.conv_general_dilated``). `build` returns (embed_fn, params) for any of
them; tests/test_frameworks.py uses it to check that all four get the same layer plan and
the same norms and gradients.

For each model and framework the benchmark times, in one process, the compile time (trace,
lower and compile) and the step time after compilation of the non-private gradient
(jax.grad of the loss) and of `clipped_grad` with "ghost", "triangle" and "projected", and
records the ratios (framework / linen step time; ghost / non-private compile time, wall-clock
and CPU seconds of the process, the latter less sensitive to other jobs on shared cores):

  python -m benchmarks.frameworks --out benchmarks/results/frameworks.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import logit_dp
from logit_dp import models

FRAMEWORKS = ("linen", "nnx", "equinox", "plain")
PRIVATE_METHODS = ("ghost", "triangle", "projected")


# The architectures, written once against a small layer interface (`ops`) so that every
# framework computes exactly what logit_dp.models' linen modules compute. Layer names are
# the linen parameter paths.
def mlp_forward(ops, x, hidden):
  x = ops.flatten(x)
  for i in range(len(hidden)):
    x = jax.nn.relu(ops.dense((f"Dense_{i}",), x))
  return ops.dense((f"Dense_{len(hidden)}",), x)


def embedding_net_forward(ops, x, channels):
  for i in range(len(channels)):
    x = jax.nn.relu(ops.conv((f"Conv_{i}",), x, 2))
  return ops.dense(("Dense_0",), ops.pool(x))


def resnet18_forward(ops, x, stage_sizes):
  x = jax.nn.relu(ops.conv(("stem",), x, 1))
  block = 0
  for i, n_blocks in enumerate(stage_sizes):
    for j in range(n_blocks):
      strides = 2 if i > 0 and j == 0 else 1
      name = f"ResNetBlock_{block}"
      y = jax.nn.relu(ops.conv((name, "Conv_0"), x, strides))
      y = ops.conv((name, "Conv_1"), y, 1)
      residual = ops.conv((name, "proj"), x, strides) if ops.has((name, "proj")) else x
      x = jax.nn.relu(residual + y)
      block += 1
  return ops.dense(("Dense_0",), ops.pool(x))


def architecture(arch: str, **sizes) -> tuple[nn.Module, Callable, tuple[int, ...]]:
  """(linen module, forward(ops, x), example shape) of an architecture.

  arch: "mlp" (logit_dp.models.MLPEmbedding), "embedding_net" (EmbeddingNet, the paper's) or
  "resnet18" (ResNet18 without norm layers); sizes override their widths.
  """
  if arch == "mlp":
    hidden, dim = tuple(sizes.get("hidden", (128, 128))), sizes.get("dim", 16)
    return (models.MLPEmbedding(embedding_dim=dim, hidden=hidden),
            functools.partial(mlp_forward, hidden=hidden), (sizes.get("features", 256),))
  if arch == "embedding_net":
    channels, dim = tuple(sizes.get("channels", (8, 16, 32))), sizes.get("dim", 8)
    side = sizes.get("side", 32)
    return (models.EmbeddingNet(embedding_dim=dim, channels=channels),
            functools.partial(embedding_net_forward, channels=channels), (side, side, 3))
  if arch == "resnet18":
    stages, dim = tuple(sizes.get("stage_sizes", (2, 2, 2, 2))), sizes.get("dim", 8)
    side = sizes.get("side", 32)
    return (models.ResNet18(embedding_dim=dim, width=sizes.get("width", 64), stage_sizes=stages,
                            norm=None), functools.partial(resnet18_forward,
                                                          stage_sizes=stages), (side, side, 3))
  raise ValueError(f"unknown architecture {arch!r}")


def _layer(tree, path):
  for key in path:
    tree = tree[key]
  return tree


class _PlainOps:
  """Batched NHWC layers on a params dict: jnp.dot and lax.conv_general_dilated."""
  def __init__(self, params):
    self.params = params

  def has(self, path):
    try:
      _layer(self.params, path)
      return True
    except KeyError:
      return False

  def dense(self, path, x):
    p = _layer(self.params, path)
    return jnp.dot(x, p["kernel"]) + p["bias"]

  def conv(self, path, x, strides):
    p = _layer(self.params, path)
    y = jax.lax.conv_general_dilated(x, p["kernel"], (strides, strides), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + p["bias"]

  def pool(self, x):
    return jnp.mean(x, axis=(1, 2))

  def flatten(self, x):
    return x.reshape(x.shape[0], -1)


def _key(path) -> str:
  return "/".join(path)


class _NnxModel(nnx.Module):
  """The architecture with nnx.Linear / nnx.Conv layers holding the linen weights."""
  def __init__(self, forward, linen_params, strides: dict):
    self.forward = forward
    self.layers = nnx.Dict()
    for path, stride in strides.items():
      p = _layer(linen_params, path)
      kernel = p["kernel"]
      if kernel.ndim == 2:
        layer = nnx.Linear(kernel.shape[0], kernel.shape[1], rngs=nnx.Rngs(0))
      else:
        layer = nnx.Conv(kernel.shape[-2], kernel.shape[-1], kernel.shape[:2], strides=stride,
                         padding="SAME", rngs=nnx.Rngs(0))
      layer.kernel.value = jnp.asarray(kernel)
      layer.bias.value = jnp.asarray(p["bias"])
      self.layers[_key(path)] = layer

  def has(self, path):
    return _key(path) in self.layers

  def dense(self, path, x):
    return self.layers[_key(path)](x)

  def conv(self, path, x, strides):
    del strides  # the layer's own
    return self.layers[_key(path)](x)

  def pool(self, x):
    return jnp.mean(x, axis=(1, 2))

  def flatten(self, x):
    return x.reshape(x.shape[0], -1)

  def __call__(self, x):
    return self.forward(self, x)


class _EqxModel(eqx.Module):
  """The architecture per example (CHW), with eqx.nn.Linear / eqx.nn.Conv2d layers."""
  layers: dict
  forward: Callable = eqx.field(static=True)

  def has(self, path):
    return _key(path) in self.layers

  def dense(self, path, x):
    return self.layers[_key(path)](x)

  def conv(self, path, x, strides):
    del strides  # the layer's own
    return self.layers[_key(path)](x)

  def pool(self, x):
    return jnp.mean(x, axis=(1, 2))

  def flatten(self, x):
    return x.reshape(-1)

  def __call__(self, x):
    if x.ndim == 3:
      x = jnp.transpose(x, (2, 0, 1))  # HWC -> CHW
    return self.forward(self, x)


def _eqx_model(forward, linen_params, strides: dict) -> _EqxModel:
  layers = {}
  key = jax.random.PRNGKey(0)
  for path, stride in strides.items():
    p = _layer(linen_params, path)
    kernel = np.asarray(p["kernel"])
    if kernel.ndim == 2:
      layer = eqx.nn.Linear(kernel.shape[0], kernel.shape[1], key=key)
      weight, bias = kernel.T, np.asarray(p["bias"])
    else:
      layer = eqx.nn.Conv2d(kernel.shape[-2], kernel.shape[-1], kernel.shape[:2], stride=stride,
                            padding="SAME", key=key)
      weight, bias = kernel.transpose(3, 2, 0, 1), np.asarray(p["bias"]).reshape(-1, 1, 1)
    layer = eqx.tree_at(lambda m: (m.weight, m.bias), layer,
                        (jnp.asarray(weight), jnp.asarray(bias)))
    layers[_key(path)] = layer
  return _EqxModel(layers, forward)


class _StrideRecorder(_PlainOps):
  """Runs the architecture on abstract values, recording each layer's stride."""
  def __init__(self, params):
    super().__init__(params)
    self.strides = {}

  def dense(self, path, x):
    self.strides[path] = None
    return super().dense(path, x)

  def conv(self, path, x, strides):
    self.strides[path] = strides
    return super().conv(path, x, strides)


def build(framework: str, arch: str, key=None, **sizes) -> tuple[Callable, Any, tuple[int, ...]]:
  """(embed_fn, params, example shape) of an architecture in one framework, with the weights
  of the linen module initialised from key (the same in every framework)."""
  module, forward, shape = architecture(arch, **sizes)
  key = jax.random.PRNGKey(0) if key is None else key
  variables = module.init(key, jnp.zeros((1,) + shape))
  if framework == "linen":
    return module.apply, variables, shape
  linen_params = variables["params"]
  if framework == "plain":
    return (lambda p, x: forward(_PlainOps(p), x)), linen_params, shape
  recorder = _StrideRecorder(linen_params)
  jax.eval_shape(lambda x: forward(recorder, x), jax.ShapeDtypeStruct((1,) + shape, jnp.float32))
  if framework == "nnx":
    graphdef, state = nnx.split(_NnxModel(forward, linen_params, recorder.strides))
    return (lambda p, x: nnx.merge(graphdef, p)(x)), state, shape
  if framework == "equinox":
    params, static = eqx.partition(_eqx_model(forward, linen_params, recorder.strides),
                                   eqx.is_inexact_array)
    return (lambda p, x: jax.vmap(eqx.combine(p, static))(x)), params, shape
  raise ValueError(f"unknown framework {framework!r}")


def _compiled(fn, args):
  """(executable, seconds to trace, lower and compile it, CPU seconds of this process doing so)."""
  start, start_cpu = time.perf_counter(), time.process_time()
  compiled = jax.jit(fn).lower(*args).compile()
  seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
  jax.block_until_ready(compiled(*args))
  return compiled, seconds, cpu_seconds


def measure(arch: str, n: int, frameworks, methods, repeats: int, compile_repeats: int = 1,
            **sizes) -> dict:
  """Compile and step times of every framework and method on one architecture.

  Everything is compiled first, `compile_repeats` rounds of freshly built functions (compile
  time: the minimum over the rounds, wall-clock and CPU seconds of this process); then the
  steps are timed round-robin (every executable once per round, `repeats` rounds), so that a
  change in the machine's load falls on all of them alike. Step time: the minimum over the
  rounds (the median is recorded too).
  """
  loss = logit_dp.losses.contrastive(temperature=1.0)
  executables, compile_s, compile_cpu_s = {}, {}, {}
  for framework in frameworks:
    embed_fn, params, shape = build(framework, arch, **sizes)
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(k1, (n,) + shape)
    x_prime = x + 0.1 * jax.random.normal(k2, x.shape)
    args = (params, x, x_prime, jnp.ones((n,), bool))

    def make_nonprivate(embed_fn=embed_fn):
      """A new function (traced and compiled afresh): jax.value_and_grad of the loss."""
      def nonprivate(p, anchors, positives, mask):
        z = lambda w: loss(
            logit_dp.losses.cosine_similarity(embed_fn(w, anchors), embed_fn(w, positives)), mask)
        return jax.value_and_grad(z)(p)

      return nonprivate

    # Untimed: the first trace of a grad_fn in a process also runs its eager input checks
    # (and compiles what they call), a one-time cost that would fall on the first framework.
    jax.jit(logit_dp.clipped_grad(embed_fn, loss, 1.0, "ghost")).lower(*args)
    for _ in range(compile_repeats):
      for method in ("nonprivate",) + tuple(methods):
        if method == "nonprivate":
          fn = make_nonprivate()
        else:
          clip_method = method
          if method == "projected":
            clip_method = logit_dp.clip_methods.Projected(
                reference_inputs=jax.random.uniform(jax.random.PRNGKey(7), (4,) + shape), rank=16)
          fn = logit_dp.clipped_grad(embed_fn, loss, 1.0, clip_method)
        compiled, seconds, cpu_seconds = _compiled(fn, args)
        executables[framework, method] = (compiled, args)
        key = framework, method
        compile_s[key] = min(seconds, compile_s.get(key, seconds))
        compile_cpu_s[key] = min(cpu_seconds, compile_cpu_s.get(key, cpu_seconds))
        print(
            f"{arch:14s} {framework:8s} {method:10s} compile {seconds:7.2f} s "
            f"(CPU {cpu_seconds:7.2f} s)", flush=True)
  steps = {key: [] for key in executables}
  for _ in range(repeats):
    for key, (compiled, args) in executables.items():
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      steps[key].append(time.perf_counter() - start)
  rows = {}
  for (framework, method), seconds in compile_s.items():
    rows.setdefault(framework, {})[method] = {
        "compile_s": seconds, "compile_cpu_s": compile_cpu_s[framework, method],
        "step_s": float(np.min(steps[framework, method])),
        "step_median_s": float(np.median(steps[framework, method]))
    }
    print(f"{arch:14s} {framework:8s} {method:10s} step {rows[framework][method]['step_s']:8.4f} s",
          flush=True)
  ratios = {}
  for framework, row in rows.items():
    ratios[framework] = {}
    for method in methods:
      ratios[framework][f"{method}_compile_over_nonprivate"] = (row[method]["compile_s"]
                                                                / row["nonprivate"]["compile_s"])
      ratios[framework][f"{method}_compile_cpu_over_nonprivate"] = (
          row[method]["compile_cpu_s"] / row["nonprivate"]["compile_cpu_s"])
    if "linen" in rows:
      for method in ("nonprivate",) + tuple(methods):
        ratios[framework][f"{method}_step_over_linen"] = (row[method]["step_s"]
                                                          / rows["linen"][method]["step_s"])
  return {"arch": arch, "n": n, "sizes": sizes, "times": rows, "ratios": ratios}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default="mlp,embedding_net", help="comma-separated architectures")
  p.add_argument("--n", type=int, default=128)
  p.add_argument("--resnet-n", type=int, default=16)
  p.add_argument("--resnet-width", type=int, default=16)
  p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
  p.add_argument("--methods", default=",".join(PRIVATE_METHODS))
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--compile-repeats", type=int, default=1,
                 help="rounds of compiles (freshly built functions); the minimum is recorded")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  frameworks, methods = args.frameworks.split(","), args.methods.split(",")
  results = []
  for arch in args.models.split(","):
    if arch == "resnet18":
      results.append(
          measure(arch, args.resnet_n, frameworks, methods, args.repeats, args.compile_repeats,
                  width=args.resnet_width))
    else:
      results.append(measure(arch, args.n, frameworks, methods, args.repeats, args.compile_repeats))
  report = {
      "command":
          "python -m benchmarks.frameworks " + " ".join(
              f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
      "machine": {
          "platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
          "backend": jax.default_backend()
      },
      "results":
          results,
  }
  for result in results:
    print(result["arch"], json.dumps(result["ratios"], indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()

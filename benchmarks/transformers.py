r"""Transformer encoders in every framework, and their private gradient's cost side by side.

`build(framework, arch, n, **sizes)` returns (embed_fn, params, x, x_prime, positive_embed_fn)
for a text transformer ("text"), a ViT ("vit") or their CLIP pair ("clip": the ViT embeds x,
the text transformer x', one params pytree, no shared parameter), written with each
framework's own layers:

* linen: `logit_dp.models.TextTransformer` / `ViT` (``nn.Embed``, ``nn.LayerNorm``,
  ``nn.MultiHeadDotProductAttention``, ``nn.Dense``, ``nn.Conv``);
* nnx: ``nnx.Embed``, ``nnx.LayerNorm``, ``nnx.MultiHeadAttention``, ``nnx.Linear``,
  ``nnx.Conv`` (``nnx.split`` / ``nnx.merge``);
* equinox: ``eqx.nn.Embedding``, ``eqx.nn.LayerNorm``, ``eqx.nn.MultiheadAttention``,
  ``eqx.nn.Linear``, ``eqx.nn.Conv2d``, written per example and vmapped;
* plain: a params dict and ``jnp.einsum`` (multi-axis contractions, per-head projections).

The default sizes are the benchmark's: width 64, 4 heads, MLP 256, 2 pre-LN blocks; text:
length 16, vocabulary 1,000, mean pooling; ViT: 32×32 images, 4×4 patches, a class token;
32-dimensional embeddings. The benchmark times, in one process, the non-private
``value_and_grad`` of the contrastive loss and each private gradient (after compilation, each
method's steps in one block, at least --repeats and --min-seconds of them, median), and their
compile times, twice: the first call less
one step (what a user waits for: tracing, checks and compiling, with a step's noise) and the
seconds XLA's backend compile takes within that call (``jax.monitoring``'s
``backend_compile_duration`` events):

  python -m benchmarks.transformers --archs text,vit,clip --sizes 128,512 \
      --out docs/benchmarks/transformers_cpu.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import logit_dp
from logit_dp import models
from logit_dp._src import layerwise

FRAMEWORKS = ("linen", "nnx", "equinox", "plain")
ARCHS = ("text", "vit", "clip")
DEFAULT_SIZES = dict(width=64, depth=2, num_heads=4, mlp_dim=256, length=16, vocab_size=1000,
                     image_side=32, patch_size=4, embedding_dim=32)


# flax.nnx ----------------------------------------------------------------------------------
class _NnxBlock(nnx.Module):
  def __init__(self, width, num_heads, mlp_dim, rngs):
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(num_heads, width, decode=False, rngs=rngs)
    self.norm2 = nnx.RMSNorm(width, rngs=rngs)
    self.up = nnx.LinearGeneral(width, mlp_dim, rngs=rngs)
    self.down = nnx.Linear(mlp_dim, width, rngs=rngs)

  def __call__(self, x):
    h = self.norm1(x)
    x = x + self.attention(h, h)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class _NnxText(nnx.Module):
  def __init__(self, s, rngs):
    self.embed = nnx.Embed(s["vocab_size"], s["width"], rngs=rngs)
    self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (s["length"], s["width"])))
    self.blocks = nnx.List(
        [_NnxBlock(s["width"], s["num_heads"], s["mlp_dim"], rngs) for _ in range(s["depth"])])
    self.norm = nnx.LayerNorm(s["width"], rngs=rngs)
    self.head = nnx.Linear(s["width"], s["embedding_dim"], rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.positions[...]
    for block in self.blocks:
      x = block(x)
    return self.head(jnp.mean(self.norm(x), axis=1))


class _NnxVit(nnx.Module):
  def __init__(self, s, rngs):
    p, w = s["patch_size"], s["width"]
    self.patches = nnx.Conv(3, w, (p, p), strides=(p, p), padding="VALID", rngs=rngs)
    tokens = (s["image_side"] // p) ** 2 + 1
    self.cls = nnx.Param(jnp.zeros((1, 1, w)))
    self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (tokens, w)))
    self.blocks = nnx.List(
        [_NnxBlock(w, s["num_heads"], s["mlp_dim"], rngs) for _ in range(s["depth"])])
    self.norm = nnx.LayerNorm(w, rngs=rngs)
    self.head = nnx.Linear(w, s["embedding_dim"], rngs=rngs)

  def __call__(self, images):
    x = self.patches(images)
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    cls = jnp.broadcast_to(self.cls[...], (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([cls, x], axis=1) + self.positions[...]
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x[:, 0]))


def _nnx(module) -> tuple[Callable, Any]:
  graphdef, params = nnx.split(module)
  return (lambda p, x: nnx.merge(graphdef, p)(x)), params


# Equinox (per example, vmapped) -------------------------------------------------------------
class _EqxBlock(eqx.Module):
  norm1: eqx.nn.LayerNorm
  attention: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  up: eqx.nn.Linear
  down: eqx.nn.Linear

  def __init__(self, width, num_heads, mlp_dim, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.norm1 = eqx.nn.LayerNorm(width)
    self.attention = eqx.nn.MultiheadAttention(num_heads, width, use_query_bias=True,
                                               use_key_bias=True, use_value_bias=True,
                                               use_output_bias=True, key=k1)
    self.norm2 = eqx.nn.LayerNorm(width)
    self.up = eqx.nn.Linear(width, mlp_dim, key=k2)
    self.down = eqx.nn.Linear(mlp_dim, width, key=k3)

  def __call__(self, x):  # (T, width)
    h = jax.vmap(self.norm1)(x)
    x = x + self.attention(h, h, h)
    h = jax.vmap(self.up)(jax.vmap(self.norm2)(x))
    return x + jax.vmap(self.down)(jax.nn.gelu(h))


class _EqxText(eqx.Module):
  embed: eqx.nn.Embedding
  positions: jax.Array
  blocks: list
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, s, key):
    keys = jax.random.split(key, s["depth"] + 3)
    self.embed = eqx.nn.Embedding(s["vocab_size"], s["width"], key=keys[0])
    self.positions = 0.02 * jax.random.normal(keys[1], (s["length"], s["width"]))
    self.blocks = [_EqxBlock(s["width"], s["num_heads"], s["mlp_dim"], k) for k in keys[3:]]
    self.norm = eqx.nn.LayerNorm(s["width"])
    self.head = eqx.nn.Linear(s["width"], s["embedding_dim"], key=keys[2])

  def __call__(self, tokens):  # (length,)
    x = jax.vmap(self.embed)(tokens) + self.positions
    for block in self.blocks:
      x = block(x)
    return self.head(jnp.mean(jax.vmap(self.norm)(x), axis=0))


class _EqxVit(eqx.Module):
  patches: eqx.nn.Conv2d
  cls: jax.Array
  positions: jax.Array
  blocks: list
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, s, key):
    keys = jax.random.split(key, s["depth"] + 3)
    p, w = s["patch_size"], s["width"]
    self.patches = eqx.nn.Conv2d(3, w, p, stride=p, key=keys[0])
    self.cls = jnp.zeros((1, w))
    self.positions = 0.02 * jax.random.normal(keys[1], ((s["image_side"] // p) ** 2 + 1, w))
    self.blocks = [_EqxBlock(w, s["num_heads"], s["mlp_dim"], k) for k in keys[3:]]
    self.norm = eqx.nn.LayerNorm(w)
    self.head = eqx.nn.Linear(w, s["embedding_dim"], key=keys[2])

  def __call__(self, image):  # (H, W, C)
    x = self.patches(jnp.moveaxis(image, -1, 0))  # (width, h, w)
    x = x.reshape(x.shape[0], -1).T
    x = jnp.concatenate([self.cls, x], axis=0) + self.positions
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x[0]))


def _eqx(module) -> tuple[Callable, Any]:
  params, static = eqx.partition(module, eqx.is_inexact_array)
  return (lambda p, x: jax.vmap(eqx.combine(p, static))(x)), params


# Plain JAX: einsum with multi-axis contractions and per-head projections --------------------
def _plain_init(s, key, tokens_in: int, vocab: bool):
  w, h, f = s["width"], s["num_heads"], s["mlp_dim"]
  keys = iter(jax.random.split(key, 8 + 8 * s["depth"]))
  normal = lambda shape, scale: scale * jax.random.normal(next(keys), shape)
  params = {
      "positions": normal((tokens_in, w), 0.02),
      "norm": {"scale": jnp.ones((w,)), "bias": jnp.zeros((w,))}, "head": normal(
          (w, s["embedding_dim"]), w ** -0.5), "blocks": []
  }
  if vocab:
    params["embed"] = normal((s["vocab_size"], w), 1.0)
  else:
    params["patches"] = normal((s["patch_size"] ** 2 * 3, w), (s["patch_size"] ** 2 * 3) ** -0.5)
    params["cls"] = jnp.zeros((w,))
  for _ in range(s["depth"]):
    params["blocks"].append({
        "qkv": normal((3, w, h, w // h), w ** -0.5),  # one einsum, a stacked projection
        "out": normal((h, w // h, w), w ** -0.5),  # contracts (heads, head_dim)
        "norm": {"scale": jnp.ones((w,))},  # RMSNorm
        "up": normal((w, f), w ** -0.5),
        "down": normal((f, w), f ** -0.5)
    })
  return params


def _rms(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _plain_blocks(params, x):
  for block in params["blocks"]:
    h = _rms(x, block["norm"]["scale"])
    q, k, v = jnp.einsum("ntc,icHd->intHd", h, block["qkv"])
    logits = jnp.einsum("ntHd,nsHd->nHts", q, k) / np.sqrt(q.shape[-1])
    attended = jnp.einsum("nHts,nsHd->ntHd", jax.nn.softmax(logits, axis=-1), v)
    x = x + jnp.einsum("ntHd,Hdc->ntc", attended, block["out"])
    x = x + jax.nn.gelu(_rms(x, block["norm"]["scale"]) @ block["up"]) @ block["down"]
  return x


def _plain_text(params, tokens):
  x = jnp.take(params["embed"], tokens, axis=0) + params["positions"]
  x = _plain_blocks(params, x)
  x = _rms(x, params["norm"]["scale"]) + params["norm"]["bias"]
  return jnp.mean(x, axis=1) @ params["head"]


def _plain_vit(patch_size):
  def embed(params, images):
    n, side = images.shape[0], images.shape[1]
    g = side // patch_size
    patches = images.reshape(n, g, patch_size, g, patch_size, -1).transpose(0, 1, 3, 2, 4, 5)
    x = jnp.einsum("ntp,pc->ntc", patches.reshape(n, g * g, -1), params["patches"])
    cls = jnp.broadcast_to(params["cls"], (n, 1, x.shape[-1]))
    x = jnp.concatenate([cls, x], axis=1) + params["positions"]
    x = _plain_blocks(params, x)
    return (_rms(x[:, 0], params["norm"]["scale"]) + params["norm"]["bias"]) @ params["head"]

  return embed


def _tower(framework: str, arch: str, s: dict, key) -> tuple[Callable, Any]:
  if framework == "linen":
    keys = ("vocab_size", "length") if arch == "text" else ("patch_size",)
    common = {k: s[k] for k in ("width", "depth", "num_heads", "mlp_dim", "embedding_dim")}
    module = (models.TextTransformer if arch == "text" else models.ViT)(**common,
                                                                        **{k: s[k] for k in keys})
    example = (jnp.zeros((1, s["length"]), jnp.int32) if arch == "text" else jnp.zeros(
        (1, s["image_side"], s["image_side"], 3)))
    return module.apply, jax.jit(module.init)(key, example)  # one compilation, not one per op
  if framework == "nnx":
    rngs = nnx.Rngs(key)
    return _nnx(_NnxText(s, rngs) if arch == "text" else _NnxVit(s, rngs))
  if framework == "equinox":
    return _eqx(_EqxText(s, key) if arch == "text" else _EqxVit(s, key))
  if framework == "plain":
    tokens = s["length"] if arch == "text" else (s["image_side"] // s["patch_size"]) ** 2 + 1
    params = _plain_init(s, key, tokens, arch == "text")
    return (_plain_text if arch == "text" else _plain_vit(s["patch_size"])), params
  raise ValueError(f"unknown framework {framework!r}; one of {FRAMEWORKS}")


def _inputs(arch: str, s: dict, n: int, key):
  if arch == "text":
    return jax.random.randint(key, (n, s["length"]), 0, s["vocab_size"])
  return jax.random.normal(key, (n, s["image_side"], s["image_side"], 3))


def build(framework: str, arch: str, n: int, seed: int = 0, **sizes):
  """(embed_fn, params, x, x_prime, positive_embed_fn) of an architecture in a framework.

  arch: "text", "vit" or "clip" (x images embedded by the ViT tower, x' token ids by the text
  tower, params {"image": ..., "text": ...}); positive_embed_fn is None for one tower. x' of
  one tower is x with a few tokens redrawn (text) or a little noise added (ViT): positives.
  """
  s = dict(DEFAULT_SIZES, **sizes)
  keys = jax.random.split(jax.random.key(seed), 6)
  if arch == "clip":
    image_fn, image_params = _tower(framework, "vit", s, keys[0])
    text_fn, text_params = _tower(framework, "text", s, keys[1])
    params = {"image": image_params, "text": text_params}
    return ((lambda p, x: image_fn(p["image"], x)), params, _inputs("vit", s, n, keys[2]),
            _inputs("text", s, n, keys[3]), (lambda p, t: text_fn(p["text"], t)))
  if arch not in ARCHS:
    raise ValueError(f"unknown architecture {arch!r}; one of {ARCHS}")
  embed_fn, params = _tower(framework, arch, s, keys[0])
  x = _inputs(arch, s, n, keys[2])
  if arch == "text":
    redraw = jax.random.bernoulli(keys[4], 0.25, x.shape)
    x_prime = jnp.where(redraw, _inputs(arch, s, n, keys[3]), x)
  else:
    x_prime = x + 0.1 * jax.random.normal(keys[3], x.shape)
  return embed_fn, params, x, x_prime, None


# The benchmark ------------------------------------------------------------------------------
def _grouped_step(grad_fn, record_ids, group_key, params, x, x_prime):
  return grad_fn.with_num_dropped(params, x, x_prime, record_ids=record_ids, group_key=group_key)


def _grad_fns(embed_fn, positive_embed_fn, methods, n: int) -> dict:
  loss = logit_dp.losses.contrastive(temperature=0.1)
  fns = {}
  for method in methods:
    if method == "nonprivate":

      def total(p, x, xp):
        u = logit_dp.losses.normalize(embed_fn(p, x))
        v = logit_dp.losses.normalize((positive_embed_fn or embed_fn)(p, xp))
        return loss(u @ v.T, jnp.ones((x.shape[0],), bool))

      fns[method] = jax.jit(jax.value_and_grad(total))
    elif method == "dp_gcl":
      grad_fn = logit_dp.baselines.grouped_clipped_grad(embed_fn, loss, 1.0, max(1, n // 8),
                                                        positive_embed_fn=positive_embed_fn)
      fns[method] = functools.partial(_grouped_step, grad_fn, jnp.arange(n), jax.random.key(1))
    else:
      grad_fn = logit_dp.clipped_grad(embed_fn, loss, 1.0, method,
                                      positive_embed_fn=positive_embed_fn)
      fns[method] = grad_fn.with_num_dropped
  return fns


def _forward_macs(fn, params, x) -> float:
  """Multiply-adds of one example's forward pass (XLA's cost analysis: flops / 2)."""
  compiled = jax.jit(fn).lower(params, jax.tree_util.tree_map(lambda a: a[:1], x)).compile()
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return float(analysis["flops"]) / 2


def _flat_cross_macs(d: int) -> int:
  """Multiply-adds per flattened parameter and pair of the cheaper cross term form: the
  cross-Gram's d² or the pairs' vectors' 2d (`layerwise.flat_cross`)."""
  return min(d * d, 2 * d)


def _gram_and_cross_macs(plan, leaves, d: int) -> tuple[float, float]:
  """Lower bounds of the (per-example Gram, per-pair cross term) multiply-adds of a plan's
  layers, each the cheaper of its forms, without the runtime weights of
  `layerwise.LayerCall.pair_cost`: from factors T²P + T²Cd + Td²C (Gram) and T²P + 2TCd + T²C
  (cross); flattened T·P·C·d to form and d²PC (Gram), min(d², 2d)·PC (cross: the cross-Gram
  or the pairs' vectors, `layerwise.flat_cross`); flat columns d²q (Gram) and min(d², 2d)·q
  (cross) each."""
  flat = sum(int(np.size(leaves[i])) for i in plan.generic)
  per_column = _flat_cross_macs(d)
  gram, cross = float(d * d * flat), float(per_column * flat)
  for layer in plan.layers:
    t, p, c = layer.positions, layer.fan_in, layer.features
    gram += min(t * t * p + t * t * c * d + t * d * d * c, t * p * c * d + d * d * p * c)
    cross += min(t * t * p + 2 * t * c * d + t * t * c, per_column * p * c)
  return gram, cross


def floor_ratio(embed_fn, params, x, x_prime, positive_embed_fn, n: int) -> dict:
  """The arithmetic floor of ghost against the non-private gradient, in multiply-adds.

  Non-private: forward and backward of both views, 3·n·(F + F') (F, F' one example's forward
  multiply-adds of each tower). Ghost at least: the forward and d cotangent passes of both views
  (each pass ≈ a forward's work: only activation cotangents), n·(1 + d)·(F + F'); the
  per-example Grams, n·(G + G'); and the cross terms, n²·X for the parameters both towers
  share (all of them with one tower; none for a disjoint CLIP pair). G and X from the plan
  (`_gram_and_cross_macs`).
  """
  from logit_dp._src import layerwise  # pylint: disable=import-outside-toplevel
  from logit_dp._src import two_tower  # pylint: disable=import-outside-toplevel
  leaves = jax.tree_util.tree_leaves(params)
  d = int(jax.eval_shape(embed_fn, params, x).shape[-1])
  positive = positive_embed_fn or embed_fn
  macs = _forward_macs(embed_fn, params, x) + _forward_macs(positive, params, x_prime)
  if positive_embed_fn is None:
    plan = layerwise.make_plan(embed_fn, params, x[:4], d)
    gram, cross = _gram_and_cross_macs(plan, leaves, d)
    gram *= 2
  else:
    towers = two_tower.tower_plans(embed_fn, positive_embed_fn, params, x[:4], x_prime[:4], d)
    g_u, _ = _gram_and_cross_macs(towers.anchor, leaves, d)
    g_v, _ = _gram_and_cross_macs(towers.positive, leaves, d)
    gram = g_u + g_v
    cross = _flat_cross_macs(d) * sum(int(np.size(leaves[i])) for i in towers.shared)
  nonprivate = 3 * n * macs
  ghost = n * (1 + d) * macs + n * gram + n * n * cross
  return {
      "forward_macs": macs, "nonprivate_macs": nonprivate, "ghost_floor_macs": ghost,
      "ghost_floor_ratio": ghost / nonprivate
  }


def _first_call(fn, params, x, x_prime) -> tuple[float, float]:
  """(seconds of fn's first call: trace, compile and run, seconds of XLA backend compile within
  it), the latter from `jax.monitoring`'s events, listened to for this call only."""
  seconds = [0.0]

  def listen(event: str, duration: float, **kwargs) -> None:
    del kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      seconds[0] += duration

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    start = time.perf_counter()
    jax.block_until_ready(fn(params, x, x_prime))
    return time.perf_counter() - start, seconds[0]
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def cpu_steal() -> tuple[int, int] | None:
  """(steal, total) jiffies of all CPUs so far (Linux's /proc/stat), or None elsewhere: the time
  a virtual machine's hypervisor gave to others, which slows every timing taken meanwhile."""
  try:
    with open("/proc/stat") as f:
      fields = [int(v) for v in f.readline().split()[1:]]
  except (OSError, ValueError):
    return None
  return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def _steal_fraction(start, end) -> float | None:
  if start is None or end is None or end[1] <= start[1]:
    return None
  return (end[0] - start[0]) / (end[1] - start[1])


def _timed(fn, args, repeats: int, min_seconds: float) -> list[float]:
  """Seconds of consecutive calls of fn(*args), after one untimed call: at least `repeats` of
  them and, up to 100·repeats, until they add up to min_seconds (a step of 0.05 s timed 3 times
  is mostly noise)."""
  jax.block_until_ready(fn(*args))  # warm after the other methods
  times: list[float] = []
  while len(times) < repeats or (sum(times) < min_seconds and len(times) < 100 * repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return times


def measure(framework: str, arch: str, n: int, methods, repeats: int, blocked: bool = True,
            min_seconds: float = 2.0, **sizes) -> dict:
  """Compile and step seconds of each method (the median of its timed steps), and their ratios
  to the non-private step; `cpu_steal`: the fraction of CPU time the hypervisor took meanwhile
  (`cpu_steal`; None off Linux).

  blocked: each method is first called (compiled) and then timed, at least `repeats` and at
  least min_seconds of its steps one after another (`_timed`), before the next method is
  first called: the non-private gradient first, in a process that has run nothing larger (on
  the CPU a non-private step after a private gradient's first call or step can run 2-4×
  slower, its memory evicted); False: all first calls, then `repeats` rounds of one step of
  each method in turn.
  """
  embed_fn, params, x, x_prime, positive = build(framework, arch, n, **sizes)
  fns = _grad_fns(embed_fn, positive, ("nonprivate",) + tuple(methods), n)
  steal_start = cpu_steal()
  compile_s, xla_compile, times = {}, {}, {}
  for name, fn in fns.items():  # blocked: each one compiled and timed before the next
    compile_s[name], xla_compile[name] = _first_call(fn, params, x, x_prime)
    if blocked:
      times[name] = _timed(fn, (params, x, x_prime), repeats, min_seconds)
  if not blocked:
    times = {name: [] for name in fns}
    for _ in range(repeats):
      for name, fn in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(params, x, x_prime))
        times[name].append(time.perf_counter() - start)
  steal = _steal_fraction(steal_start, cpu_steal())
  step = {name: float(np.median(t)) for name, t in times.items()}
  first_compile = {name: compile_s[name] - step[name] for name in fns}
  result = dict(framework=framework, arch=arch, n=n, order="blocked" if blocked else "interleaved",
                step_s=step, steps_timed={name: len(t) for name, t in times.items()},
                cpu_steal=steal, compile_s=first_compile)
  result["ratio"] = {name: step[name] / step["nonprivate"] for name in fns}
  result["compile_ratio"] = {
      name: first_compile[name] / max(first_compile["nonprivate"], 1e-9) for name in fns
  }
  result["xla_compile_s"] = xla_compile
  result["xla_compile_ratio"] = {
      name: xla_compile[name] / max(xla_compile["nonprivate"], 1e-9) for name in fns
  }
  result["floor"] = floor_ratio(embed_fn, params, x, x_prime, positive, n)
  report = logit_dp.clip_methods.describe_plan(embed_fn, params, x[:4], x_prime=x_prime[:4],
                                               positive_embed_fn=positive)
  result["routes"] = [(leaf.path, leaf.route) for leaf in report.leaves]
  return result


def table(rows, methods=None) -> str:
  """The markdown table of a benchmark's rows (BENCHMARKS.md's): per model and n, each private
  gradient's step and compile time (and, where measured, XLA's backend compile within its first
  call) as ratios to the non-private gradient's, ghost's arithmetic floor, and where recorded
  the CPU time the hypervisor took during the row's timings (methods: those to show, default
  all). A first call less a step below zero (the timed step slower than the first call's) has no
  compile time to show: "—"."""
  methods = [m for m in rows[0]["ratio"] if m != "nonprivate" and (not methods or m in methods)]
  floor = "ghost" in methods
  xla = all("xla_compile_ratio" in row for row in rows)
  steal = all(row.get("cpu_steal") is not None for row in rows)
  head = ("| framework | model | n | non-private step | " + " | ".join(
      f"{m} step | {m} compile" + (f" | {m} XLA compile" if xla else "") for m in methods) +
          (" | ghost's arithmetic floor" if floor else "") +
          (" | CPU steal" if steal else "") + " |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for row in rows:
    cells = [row["framework"], row["arch"], str(row["n"]), f"{row['step_s']['nonprivate']:.3g} s"]
    for m in methods:
      compile_ratio = row["compile_ratio"][m]
      cells += [f"{row['ratio'][m]:.1f}×", f"{compile_ratio:.1f}×" if compile_ratio >= 0 else "—"]
      if xla:
        cells.append(f"{row['xla_compile_ratio'][m]:.1f}×")
    if floor:
      cells.append(f"{row['floor']['ghost_floor_ratio']:.1f}×")
    if steal:
      cells.append(f"{100 * row['cpu_steal']:.0f}%")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--archs", default="text,vit,clip")
  parser.add_argument("--frameworks", default="linen")
  parser.add_argument("--sizes", default="128,512")
  parser.add_argument("--methods", default="ghost,dp_gcl")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--min-seconds", type=float, default=2.0,
                      help="time each method's steps until they add up to this (blocked order)")
  parser.add_argument("--interleaved", action="store_true",
                      help="time the methods round-robin instead of one block each")
  parser.add_argument(
      "--group-factor-ratio", type=float, default=None,
      help="DP-GCL keeps a layer as factors up to this many times the floats of "
      "its flattened gradient (default: the library's)")
  parser.add_argument("--out", default=None)
  parser.add_argument("--table", default=None,
                      help="print the markdown table of this JSON output (of --methods) and exit")
  args = parser.parse_args()
  if args.table:
    with open(args.table) as f:
      print(table(json.load(f)["rows"], args.methods.split(",")))
    return
  if args.group_factor_ratio is not None:
    layerwise._GROUP_FACTOR_RATIO = args.group_factor_ratio  # pylint: disable=protected-access
  rows = []
  for n in [int(v) for v in args.sizes.split(",")]:
    for arch in args.archs.split(","):
      for framework in args.frameworks.split(","):
        row = measure(framework, arch, n, args.methods.split(","), args.repeats,
                      blocked=not args.interleaved, min_seconds=args.min_seconds)
        rows.append(row)
        print(
            f"{framework:8s} {arch:5s} n={n:4d} floor {row['floor']['ghost_floor_ratio']:.1f}x "
            f"steal {row['cpu_steal'] if row['cpu_steal'] is None else round(row['cpu_steal'], 2)} "
            + "  ".join(
                f"{name} {row['ratio'][name]:.1f}x (compile {row['compile_ratio'][name]:.1f}x, "
                f"XLA {row['xla_compile_ratio'][name]:.1f}x)" for name in row["ratio"]), flush=True)
        if args.out:
          with open(args.out, "w") as f:
            json.dump(
                {
                    "machine": platform.processor() or platform.machine(),
                    "jax": jax.__version__,
                    "group_factor_ratio": layerwise._GROUP_FACTOR_RATIO,  # pylint: disable=protected-access
                    "rows": rows
                },
                f,
                indent=1)


if __name__ == "__main__":
  main()

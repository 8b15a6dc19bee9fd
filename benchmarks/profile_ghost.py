r"""Where the time of a Logit-DP "ghost" step goes (one tower, CPU or accelerator).

    python -m benchmarks.profile_ghost --sizes 256,1000 --out results/profile_ghost.json
    python -m benchmarks.profile_ghost --model text --sizes 128 --out results/profile_text.json

--model: "embedding" (the paper's embedding net, default) or a transformer encoder of
`benchmarks.transformers` ("text", "vit"; flax linen, its default sizes).

Each piece is jitted on its own and timed (median of --repeats runs after a warm-up):

  forward        both views' normalised embeddings, Z and τ = ∂ℒ/∂Z       (_Batch)
  factors        per-example Jacobian factors of both views: patches + one
                 backward pass per embedding coordinate, per-example weight
                 gradients of the flattened layers, per-example Grams    (_Batch.factors)
  flat cross     the cross terms of the flattened layers, 2n²·d·q         (layerwise.flat_cross)
  ghost layer L  the cross terms of ghost layer L          (layerwise.ghost_layer_cross)
  positives from factors
                 the n positive pairs' norms as vectors from the factors, what the step
                 computes for them                         (pair_terms.factor_positive_norms)
  positives in float64
                 the n positive pairs' norms by one float64 backward pass each: what the
                 step adds when every positive is flagged (near-identical views)
                                                           (pair_terms.vector_norms)
  pair norms     all ‖g_ij‖ clipped by: pair terms + diagonal  (_ghost, one block)
  backward ḡ     ḡ contracted from the factors with λ-weighted cotangents, plus
                 the forward pass that gives λ                           (_Batch.weighted_backward)
  noise + adam   logit_dp.transform + optax.adam on a p-vector
  ghost grad     the whole logit_dp.clipped_grad(method="ghost") call
  non-private    jax.value_and_grad of ℒ + adam (the denominator of the ratio)
  GEMM floor     one (n·d × p)·(p × n·d) float32 matmul: the same n²·d²·p multiply-adds
                 a cross-Gram of all p parameters would need, at this machine's matmul speed

and the cost floor of this ghost step on this machine, the sum of two parts that any
implementation of the same contractions pays:

  backward passes        the forward pass and the d backward passes per view that give the
                         per-layer deltas, and nothing else (no patches, per-example
                         gradients, Grams or layout changes)
  pair terms at GEMM speed
                         the pair terms' multiply-adds (`pair_multiply_adds`: n² times
                         2d·q for the flattened layers, T²P + 2TCd + T²C + d per ghost
                         layer) at the GEMM floor's multiply-adds per second

The pieces use the library's internal modules (logit_dp/_src: pair_batch, chunking, the
"ghost" method); when those change,
the pieces that no longer apply are reported as unavailable (the whole-step timings
and the GEMM floor still run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import optax

import logit_dp
from benchmarks import step_benchmark as sb
from logit_dp._src import layerwise


def pair_multiply_adds(plan, d: int) -> int:
  """Multiply-adds of the exact cross terms per pair (i, j), as clipping contracts them.

  Flattened layers: the pair's vector J'_jᵀû_i over their q = Σ P·C parameters, its
  contraction with J_i, then with v̂_j (2d·q + d), or at small d the d×d cross-Gram and its
  contraction with û_i, then v̂_j (d²·q + d² + d); ghost layer: Π (T²P), β and ρ (T·C·d each),
  γ (T²C) and the contraction with v̂_j (d) (layerwise.flat_cross / ghost_layer_cross).
  """
  per_pair = 0
  flat = [layer for layer, ghost in zip(plan.layers, plan.ghost) if not ghost]
  if flat:
    q = sum(layer.fan_in * layer.features for layer in flat)
    per_pair += d * d * q + d * d + d if layerwise.flat_cross_by_gram(d) else 2 * d * q + d
  for layer, ghost in zip(plan.layers, plan.ghost):
    if ghost:
      t, p, c = layer.positions, layer.fan_in, layer.features
      per_pair += t * t * p + 2 * t * c * d + t * t * c + d
  return per_pair


MODELS = ("embedding", "text", "vit")


def build_problem(model: str, n: int, image_size: int):
  """(embed_fn, params, x, x_prime, number of parameters) of a one-tower model."""
  if model == "embedding":
    return sb.build_problem("embedding", n, image_size)
  if model not in MODELS:
    raise ValueError(f"unknown model {model!r}: one of {MODELS}")
  from benchmarks import transformers  # pylint: disable=g-import-not-at-top
  embed_fn, params, x, x_prime, _ = transformers.build("linen", model, n)
  return embed_fn, params, x, x_prime, sum(a.size for a in jax.tree_util.tree_leaves(params))


def profile(n: int, repeats: int, image_size: int = 32, clip_norm: float = 1.0,
            temperature: float = 1.0, model: str = "embedding") -> dict:
  from logit_dp._src import collective  # pylint: disable=g-import-not-at-top
  from logit_dp._src import layerwise as L  # pylint: disable=g-import-not-at-top
  from logit_dp._src import methods  # pylint: disable=g-import-not-at-top
  from logit_dp._src import numerics  # pylint: disable=g-import-not-at-top
  from logit_dp._src import pair_batch  # pylint: disable=g-import-not-at-top
  from logit_dp._src import pair_terms  # pylint: disable=g-import-not-at-top
  from logit_dp._src.methods import ghost  # pylint: disable=g-import-not-at-top

  embed_fn, params, x, xp, p = build_problem(model, n, image_size)
  loss = logit_dp.losses.contrastive(temperature=temperature)
  d = embed_fn(params, x[:1]).shape[-1]
  out = {"model": model, "n": n, "d": int(d), "p": int(p), "pieces": {}, "unavailable": {}}
  rows = out["pieces"]

  def record(name, fn, *args):
    try:
      med, mn = sb.median_and_min_s(jax.jit(fn), *args, repeats=repeats)
      rows[name] = {"median_s": med, "min_s": mn}
      sb._log(f"profile n={n} {name}: {med:.4f} s")
    except Exception as err:  # pylint: disable=broad-except
      out["unavailable"][name] = f"{type(err).__name__}: {err}"[:300]
      sb._log(f"profile n={n} {name}: unavailable ({out['unavailable'][name][:120]})")

  mask = jnp.ones((n,), bool)

  def batch(pp, xx, xxp):
    return pair_batch.PairBatch(embed_fn, pp, xx, xxp, mask, eps=numerics.DEFAULT_COSINE_EPS,
                                microbatch_size=None, collective=collective.Collective(None))

  def forward(pp, xx, xxp):
    b = batch(pp, xx, xxp)
    return jax.value_and_grad(loss)(b.z, b.valid)

  def factors(pp, xx, xxp):
    b = batch(pp, xx, xxp)
    return b.factors(b.x), b.factors(b.x_prime), b.u, b.v

  def pair_norms(pp, xx, xxp):
    b = batch(pp, xx, xxp)
    return methods.Ghost().pair_norms(b)

  def backward_from_factors(fu, fv, pp, xx, xxp):
    b = batch(pp, xx, xxp)
    tau = jax.grad(loss)(b.z, b.valid)
    cot_u, cot_v = tau @ b.v, tau.T @ b.u
    return jax.tree_util.tree_map(jnp.add, b.factor_backward(fu, cot_u),
                                  b.factor_backward(fv, cot_v))

  def backward_passes(pp, xx, xxp):
    b = batch(pp, xx, xxp)
    return [
        L.embedding_deltas(embed_fn, pp, b.plan, v, lambda e: numerics.normalize(e, b.eps))
        for v in (b.x, b.x_prime)
    ]

  record("forward", forward, params, x, xp)
  record("backward passes", backward_passes, params, x, xp)
  record("factors", factors, params, x, xp)
  f_u, f_v, u, v = jax.jit(factors)(params, x, xp)
  out["flat_params"] = int(f_v.flat.shape[-1])
  record("flat cross", lambda fu, fv, uu, vv: ghost.flat_cross_terms(fu.flat, uu, fv.flat, vv), f_u,
         f_v, u, v)
  for i in range(len(f_u.ghost_patches)):

    def layer_cross(fu, fv, uu, vv, i=i):
      return ghost.ghost_layer_cross_terms(fu.ghost_patches[i], fu.ghost_deltas[i], uu,
                                           fv.ghost_patches[i], fv.ghost_deltas[i], vv)

    t, p_i = f_u.ghost_patches[i].shape[1:]
    record(f"ghost layer {i} (T={t}, P={p_i}, C={f_u.ghost_deltas[i].shape[-1]})", layer_cross, f_u,
           f_v, u, v)
  record("positives from factors", pair_terms.factor_positive_norms, f_u, u, f_v, v)

  def positives_float64(pp, xx, xxp):
    b = batch(pp, xx, xxp)
    return pair_terms.vector_norms(b, b.positive_pairs, in_float64=True)[0]

  record("positives in float64", positives_float64, params, x, xp)
  record("backward ḡ", backward_from_factors, f_u, f_v, params, x, xp)
  del f_u, f_v
  record("pair norms", pair_norms, params, x, xp)

  key = jax.random.key(1)
  tx = optax.chain(logit_dp.transform(1.0, logit_dp.sensitivity(loss, clip_norm, n), key),
                   optax.adam(1e-3))
  state = tx.init(params)

  def noise_adam(pp, g, st):
    upd, st = tx.update(g, st, pp)
    return optax.apply_updates(pp, upd), st

  record("noise + adam", noise_adam, params, params, state)
  grad_fn = logit_dp.clipped_grad(embed_fn, loss, clip_norm, method="ghost")
  record("ghost grad", grad_fn, params, x, xp)

  args = argparse.Namespace(temperature=temperature, clip_norm=clip_norm, noise_multiplier=1.0,
                            learning_rate=1e-3)
  for name, spec in (("non-private step", sb.BASELINE),):
    step, stx = sb.make_step(spec, embed_fn, n, args)
    record(name, step, params, stx.init(params), x, xp)

  a = jax.random.normal(jax.random.key(2), (n * d, p))
  b = jax.random.normal(jax.random.key(3), (n * d, p))
  record("GEMM floor", lambda u, v: jnp.matmul(u, v.T), a, b)
  del a, b

  flops = 2.0 * (n * d) ** 2 * p
  out["cross_gram_flops"] = flops
  plan = L.make_plan(embed_fn, params, x, int(d))
  out["pair_multiply_adds"] = n * n * pair_multiply_adds(plan, int(d))
  if "GEMM floor" in rows:
    out["gemm_gflops_per_s"] = flops / rows["GEMM floor"]["median_s"] / 1e9
    at_gemm_speed = 2.0 * out["pair_multiply_adds"] / (out["gemm_gflops_per_s"] * 1e9)
    rows["pair terms at GEMM speed"] = {"median_s": at_gemm_speed, "derived": True}
    if "backward passes" in rows:
      rows["floor"] = {
          "median_s": rows["backward passes"]["median_s"] + at_gemm_speed, "derived": True
      }
  return out


def markdown(results: list[dict]) -> str:
  layer_names = sorted({k for r in results for k in r["pieces"] if k.startswith("ghost layer")},
                       key=lambda k: int(k.split()[2]))
  names = (["forward", "factors", "flat cross"] + layer_names + [
      "positives from factors", "positives in float64", "pair norms", "backward ḡ", "noise + adam",
      "ghost grad", "non-private step", "GEMM floor", "backward passes", "pair terms at GEMM speed",
      "floor"
  ])
  ns = [r["n"] for r in results]
  lines = [
      "| piece | " + " | ".join(f"n={n} (s)" for n in ns) + " | "
      + " | ".join(f"n={n} share of ghost grad" for n in ns) + " |", "|---|" + "---:|" *
      (2 * len(ns))
  ]
  for name in names:
    cells = []
    for r in results:
      v = r["pieces"].get(name)
      cells.append("—" if v is None else f"{v['median_s']:.3g}")
    for r in results:
      v, g = r["pieces"].get(name), r["pieces"].get("ghost grad")
      cells.append("—" if v is None or g is None or name in (
          "non-private step", "GEMM floor") else f"{100 * v['median_s'] / g['median_s']:.0f}%")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  lines.append("")
  for r in results:
    extra = ""
    if "gemm_gflops_per_s" in r:
      extra = f"; matmul speed {r['gemm_gflops_per_s']:.0f} GFLOP/s"
    pieces = r["pieces"]
    if "ghost grad" in pieces and "floor" in pieces and "non-private step" in pieces:
      ghost, floor = pieces["ghost grad"]["median_s"], pieces["floor"]["median_s"]
      lines.append(f"- n={r['n']}: ghost grad / floor = {ghost / floor:.2f}; ghost grad / "
                   f"non-private step = {ghost / pieces['non-private step']['median_s']:.1f}")
    lines.append(f"- n={r['n']}: d={r['d']}, p={r['p']:,} ({r.get('flat_params', '?'):,} in "
                 f"flattened layers); a full cross-Gram would need 2·(nd)²·p = "
                 f"{r['cross_gram_flops']:.3g} flops (GEMM floor row){extra}; the exact "
                 f"pair terms are {r['pair_multiply_adds']:.3g} multiply-adds.")
    for k, v in r["unavailable"].items():
      lines.append(f"  - {k}: unavailable ({v})")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.profile_ghost",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default="256,1000")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--model", default="embedding", choices=MODELS)
  p.add_argument("--image-size", type=int, default=32)
  p.add_argument("--out", default=None, help="JSON output path")
  p.add_argument("--compile-cache", default="results/.jax_cache",
                 help="persistent XLA compilation cache ('' disables)")
  args = p.parse_args(argv)
  sb.enable_compile_cache(args.compile_cache)
  results = [
      profile(int(n), args.repeats, args.image_size, model=args.model)
      for n in args.sizes.split(",")
  ]
  report = {
      "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      "machine": sb.machine_info(), "code": sb.code_version(), "results": results
  }
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  md = markdown(results)
  print(md)
  return report


if __name__ == "__main__":
  sys.exit(main() and 0)

"""Empirical privacy audit of Logit-DP training on scikit-learn's digits.

Two parts, both written to ``--out`` (JSON) and printed as Markdown tables:

1. ``--part canary``: the one-run audit of Steinke, Nasr & Jagielski (2023)
   with white-box gradient canaries (`logit_dp._src.canary`). A real Logit-DP
   run (tiny MLP, contrastive loss, Poisson sampling, per-pair clipping, noise
   calibrated by `logit_dp.accounting` to ε) carries m canaries, each included
   with probability 1/2; each included canary is a record Poisson-sampled at the
   same rate q as the real pairs and, when sampled, adds C·d_k to the clipped
   sum before the noise. The auditor sees every noisy gradient, scores each
   canary by its log-likelihood ratio and turns the guesses into a 95 %
   lower bound on ε. Controls: noise off (σ = 0) and noise cut in half (σ/2
   while the claim stays ε). ``--canary-type input`` instead runs a black-box
   audit with canary *pairs* of random images, scored from the final model only.
2. ``--part sensitivity``: `logit_dp.audit.search_worst_case` for Logit-DP
   (contrastive at several temperatures, spreadout; ghost and triangle clipping)
   and Naive-DP, reporting the largest ratio ‖ḡ(X) − ḡ(X∖k)‖/C found.

Usage (from the repository root)::

    python benchmarks/audit_canaries.py --part canary --epsilons 1 5 20 --controls \
        --control-epsilons 1 5 20 --out benchmarks/results/audit_canaries.json
    python benchmarks/audit_canaries.py --part canary --runs 1:0.25 \
        --out benchmarks/results/audit_canaries_quarter_noise.json
    python benchmarks/audit_canaries.py --part canary --canary-type input --num-canaries 1000 \
        --steps 300 --runs 20:0 20:1 --out benchmarks/results/audit_input_canaries.json
    python benchmarks/audit_canaries.py --part sensitivity --restarts 3 --search-steps 60 \
        --out benchmarks/results/audit_sensitivity.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import logit_dp  # noqa: E402
from logit_dp._src import accounting  # noqa: E402
from logit_dp._src import audit  # noqa: E402
from logit_dp._src import canary  # noqa: E402
from logit_dp._src import sampling  # noqa: E402


class MLP(nn.Module):
  features: tuple = (32, 16)

  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    for f in self.features[:-1]:
      x = nn.tanh(nn.Dense(f)(x))
    return nn.Dense(self.features[-1])(x)


def digits_pairs(seed: int = 0):
  """Same-class pairs of two different digits images: every image in at most one record."""
  from sklearn.datasets import load_digits
  data = load_digits()
  images = (data.images / 16.0).astype(np.float32).reshape(-1, 64)
  rng = np.random.default_rng(seed)
  first, second = [], []
  for c in range(10):
    idx = rng.permutation(np.flatnonzero(data.target == c))
    half = len(idx) // 2
    first.append(idx[:half])
    second.append(idx[half:2 * half])
  first, second = np.concatenate(first), np.concatenate(second)
  return images[first], images[second]


def run_canary_audit(*, epsilon: float, noise_scale: float, num_canaries: int, sampling_rate: float,
                     steps: int, delta: float, clip_norm: float, temperature: float,
                     learning_rate: float, seed: int) -> dict:
  """One training run with gradient canaries; returns the audit record."""
  x_all, xp_all = digits_pairs(seed)
  num_records = x_all.shape[0]
  loss = logit_dp.losses.contrastive(temperature=temperature)
  c = logit_dp.sensitivity(loss, clip_norm, batch_size=None)
  sigma_claim = accounting.noise_multiplier(epsilon, delta, sampling_rate, steps)
  sigma = noise_scale * sigma_claim

  model = MLP()
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  params = model.init(keys[0], jnp.zeros((1, 64)))
  canaries = canary.GradientCanaries(params, num_canaries, keys[1])
  included = np.asarray(jax.random.bernoulli(keys[2], 0.5, (num_canaries,)))

  grad_fn = logit_dp.clipped_grad(model.apply, loss, clip_norm, method="ghost")
  noise = logit_dp.transform(sigma, c, keys[3], allow_zero_noise=(sigma == 0))
  opt = optax.adam(learning_rate)
  sampler = sampling.PoissonSampler(num_records=num_records, sampling_rate=sampling_rate,
                                    seed=seed + 1)
  threshold = sampling.inclusion_threshold(sampling_rate)
  x_all, xp_all = jnp.asarray(x_all), jnp.asarray(xp_all)
  included_j = jnp.asarray(included)

  @jax.jit
  def step(params, noise_state, opt_state, scores, indices, mask, t):
    x, xp = x_all[indices], xp_all[indices]
    loss_value, g = grad_fn(params, x, xp, mask)
    # Canary records: included ones join the batch independently with rate q, like any record.
    bits = jax.random.bits(jax.random.fold_in(keys[4], t), (num_canaries,), jnp.uint32)
    sampled = included_j & (bits < jnp.uint32(threshold))
    g = canaries.inject(g, sampled, c)
    noisy, noise_state = noise.update(g, noise_state)  # the released quantity
    proj = canaries.project(noisy)
    scores = scores + canary.log_likelihood_ratio(proj, sigma, c, sampling_rate)
    mean = jax.tree_util.tree_map(lambda u: u / (sampling_rate * num_records), noisy)
    updates, opt_state = opt.update(mean, opt_state, params)
    return (optax.apply_updates(params, updates), noise_state, opt_state, scores,
            loss_value / jnp.maximum(jnp.sum(mask), 1))

  noise_state, opt_state = noise.init(params), opt.init(params)
  scores = jnp.zeros((num_canaries,))
  start = time.time()
  losses = []
  for t in range(steps):
    batch = sampler(t)
    params, noise_state, opt_state, scores, lv = step(params, noise_state, opt_state, scores,
                                                      batch.indices, batch.mask, t)
    losses.append(float(lv))
  train_seconds = time.time() - start
  result = canary.audit_scores(np.asarray(scores), included, delta=delta, confidence=0.95)
  return _audit_record(result, included, losses, epsilon=epsilon, noise_scale=noise_scale,
                       sigma_calibrated=sigma_claim, sigma_used=sigma, delta=delta, sensitivity=c,
                       clip_norm=clip_norm, temperature=temperature, sampling_rate=sampling_rate,
                       steps=steps, num_records=num_records, seconds=train_seconds, seed=seed)


def _audit_record(result, included, losses, *, epsilon, sigma_used, delta, sampling_rate, steps,
                  **settings):
  """The JSON record of one canary run: its settings, ε of the noise used, and the bound."""
  return dict(
      epsilon_claimed=epsilon, sigma_used=sigma_used,
      epsilon_of_sigma_used=(math.inf if sigma_used == 0 else accounting.epsilon(
          sigma_used, delta, sampling_rate, steps)), delta=delta, sampling_rate=sampling_rate,
      steps=steps, **settings, num_canaries=len(included), num_included=int(included.sum()),
      epsilon_lower_bound=result.epsilon_lower_bound, num_guesses=result.num_guesses,
      num_correct=result.num_correct, grid=[list(g) for g in result.grid],
      train_loss_first=float(np.mean(losses[:5])), train_loss_last=float(np.mean(losses[-5:])))


def run_input_canary_audit(*, epsilon: float, noise_scale: float, num_canaries: int,
                           sampling_rate: float, steps: int, delta: float, clip_norm: float,
                           temperature: float, learning_rate: float, seed: int) -> dict:
  """Black-box audit: canary PAIRS of two unrelated uniform-noise images.

  Each canary pair is a record included with probability 1/2, then Poisson-sampled
  like every real pair; nothing else differs from ordinary Logit-DP training. The
  auditor sees only the initial and final parameters and scores canary k by how
  much the final model prefers its positive among all canary positives:
  score_k = log softmax(Z_k/τ)_k(final) − log softmax(Z_k/τ)_k(initial), Z the
  m×m cosine matrix of canary anchors and positives.
  """
  x_real, xp_real = digits_pairs(seed)
  rng = np.random.default_rng(seed + 100)
  canary_x = rng.random((num_canaries, 64)).astype(np.float32)
  # The positive is an unrelated random image: only training on the pair aligns the two
  # (a near-copy would be aligned by members and non-members alike).
  canary_xp = rng.random((num_canaries, 64)).astype(np.float32)
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  included = np.asarray(jax.random.bernoulli(keys[2], 0.5, (num_canaries,)))
  x_all = jnp.asarray(np.concatenate([x_real, canary_x[included]]))
  xp_all = jnp.asarray(np.concatenate([xp_real, canary_xp[included]]))
  num_records = int(x_all.shape[0])
  loss = logit_dp.losses.contrastive(temperature=temperature)
  c = logit_dp.sensitivity(loss, clip_norm, batch_size=None)
  sigma_claim = accounting.noise_multiplier(epsilon, delta, sampling_rate, steps)
  sigma = noise_scale * sigma_claim
  model = MLP()
  params0 = model.init(keys[0], jnp.zeros((1, 64)))
  grad_fn = logit_dp.clipped_grad(model.apply, loss, clip_norm, method="ghost")
  noise = logit_dp.transform(sigma, c, keys[3], allow_zero_noise=(sigma == 0))
  opt = optax.adam(learning_rate)
  sampler = sampling.PoissonSampler(num_records=num_records, sampling_rate=sampling_rate,
                                    seed=seed + 1)

  @jax.jit
  def step(params, noise_state, opt_state, indices, mask):
    loss_value, g = grad_fn(params, x_all[indices], xp_all[indices], mask)
    noisy, noise_state = noise.update(g, noise_state)
    mean = jax.tree_util.tree_map(lambda u: u / (sampling_rate * num_records), noisy)
    updates, opt_state = opt.update(mean, opt_state, params)
    return (optax.apply_updates(params, updates), noise_state, opt_state,
            loss_value / jnp.maximum(jnp.sum(mask), 1))

  def canary_log_prob(params):
    z = logit_dp.losses.cosine_similarity(model.apply(params, jnp.asarray(canary_x)),
                                          model.apply(params, jnp.asarray(canary_xp)))
    return np.asarray(jnp.diagonal(jax.nn.log_softmax(z / temperature, axis=1)))

  params, noise_state, opt_state = params0, noise.init(params0), opt.init(params0)
  start, losses = time.time(), []
  for t in range(steps):
    batch = sampler(t)
    params, noise_state, opt_state, lv = step(params, noise_state, opt_state, batch.indices,
                                              batch.mask)
    losses.append(float(lv))
  train_seconds = time.time() - start
  scores = canary_log_prob(params) - canary_log_prob(params0)
  result = canary.audit_scores(scores, included, delta=delta, confidence=0.95)
  return dict(
      canary_type="input",
      **_audit_record(result, included, losses, epsilon=epsilon, noise_scale=noise_scale,
                      sigma_calibrated=sigma_claim, sigma_used=sigma, delta=delta, sensitivity=c,
                      clip_norm=clip_norm, temperature=temperature, sampling_rate=sampling_rate,
                      steps=steps, num_records=num_records, seconds=train_seconds, seed=seed),
      mean_score_in=float(scores[included].mean()), mean_score_out=float(scores[~included].mean()))


def run_sensitivity_search(seed: int, restarts: int, steps: int) -> list:
  records = []
  model = MLP(features=(8, 4))
  n = 5
  key = jax.random.PRNGKey(seed)
  x = jax.random.normal(key, (n, 6))
  xp = x + 0.3 * jax.random.normal(jax.random.fold_in(key, 1), (n, 6))
  params = model.init(jax.random.fold_in(key, 2), x[:1])
  settings = []
  for clip in (1e-3, 1.0):
    for t in (0.5, 1.0, 3.0):
      settings.append((f"contrastive(τ={t})", logit_dp.losses.contrastive(t), clip, "ghost"))
    settings.append(("spreadout", logit_dp.losses.spreadout(), clip, "ghost"))
    settings.append(("contrastive(τ=1)", logit_dp.losses.contrastive(1.0), clip, "triangle"))
    for name, loss in (("contrastive(τ=1)", logit_dp.losses.contrastive(1.0)),
                       ("spreadout", logit_dp.losses.spreadout())):
      settings.append((name, loss, clip, "naive"))
  for name, loss, clip, method in settings:
    for optimize_params in (False, True):
      start = time.time()
      res = audit.search_worst_case(model.apply, params, loss, clip, x, xp,
                                    key=jax.random.PRNGKey(seed + 7), num_restarts=restarts,
                                    num_steps=steps, learning_rate=0.05,
                                    optimize_params=optimize_params, method=method)
      rec = dict(loss=name, clip_norm=clip, method=method, optimize_params=optimize_params, n=n,
                 ratio=res.ratio, ratio_sup=res.ratio_sup, max_gap=res.max_gap, bound=res.bound,
                 seconds=time.time() - start)
      print(json.dumps(rec), flush=True)
      records.append(rec)
  return records


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--part", choices=("canary", "sensitivity"), default="canary")
  parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 5.0, 20.0])
  parser.add_argument("--controls", action="store_true",
                      help="also run σ = 0 and σ/2 (at --control-epsilons)")
  parser.add_argument("--control-epsilons", type=float, nargs="+", default=[1.0, 5.0])
  parser.add_argument(
      "--runs", nargs="+", default=None, metavar="EPS:SCALE",
      help="explicit runs, e.g. 1:0.25 (claimed ε 1, noise ×0.25); "
      "overrides --epsilons/--controls")
  parser.add_argument("--canary-type", choices=("gradient", "input"), default="gradient",
                      help="white-box gradient canaries, or black-box input canary pairs")
  parser.add_argument("--num-canaries", type=int, default=2000)
  parser.add_argument("--sampling-rate", type=float, default=0.1)
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--delta", type=float, default=1e-5)
  parser.add_argument("--clip-norm", type=float, default=1.0)
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--learning-rate", type=float, default=1e-2)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--restarts", type=int, default=4)
  parser.add_argument("--search-steps", type=int, default=60)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)

  if args.part == "sensitivity":
    records = run_sensitivity_search(args.seed, args.restarts, args.search_steps)
    print("\n| loss | B | method | moves w | max ratio vs C(n) | vs C(∞) |")
    print("|---|---|---|---|---|---|")
    for r in records:
      print(f"| {r['loss']} | {r['clip_norm']:g} | {r['method']} | {r['optimize_params']} | "
            f"{r['ratio']:.4f} | {r['ratio_sup']:.4f} |")
  else:
    runs = [(e, 1.0) for e in args.epsilons]
    if args.controls:
      runs += [(e, 0.5) for e in args.control_epsilons] + [(args.epsilons[0], 0.0)]
    if args.runs:
      runs = [(float(r.split(":")[0]), float(r.split(":")[1])) for r in args.runs]
    records = []
    for eps, scale in runs:
      audit_fn = run_canary_audit if args.canary_type == "gradient" else run_input_canary_audit
      rec = audit_fn(epsilon=eps, noise_scale=scale, num_canaries=args.num_canaries,
                     sampling_rate=args.sampling_rate, steps=args.steps, delta=args.delta,
                     clip_norm=args.clip_norm, temperature=args.temperature,
                     learning_rate=args.learning_rate, seed=args.seed)
      print(json.dumps({k: v for k, v in rec.items() if k != "grid"}), flush=True)
      records.append(rec)
    print("\n| claimed ε | noise | σ used | ε of σ used | ε lower bound (95 %) | guesses r | "
          "correct v | train loss first→last | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
      noise = {1.0: "calibrated", 0.5: "σ/2", 0.0: "off"}.get(r["noise_scale"],
                                                              f"σ×{r['noise_scale']:g}")
      print(f"| {r['epsilon_claimed']:g} | {noise} | {r['sigma_used']:.3f} | "
            f"{r['epsilon_of_sigma_used']:.3g} | {r['epsilon_lower_bound']:.3f} | "
            f"{r['num_guesses']} | {r['num_correct']} | "
            f"{r['train_loss_first']:.3f}→{r['train_loss_last']:.3f} | {r['seconds']:.0f} |")
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(dict(args=vars(args), records=records), f, indent=1, default=float)


if __name__ == "__main__":
  main()

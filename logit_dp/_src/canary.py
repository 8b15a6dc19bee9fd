"""Empirical lower bounds on ε from canaries in ONE training run.

Implements the audit of Steinke, Nasr & Jagielski, "Privacy Auditing with One
(1) Training Run", NeurIPS 2023 (arXiv:2305.08846): their audit procedure and
their (ε, δ) analysis, with the exact p-value computation of their published
Python code, re-implemented here with scipy:

1. m canaries are drawn; each is included in the training data independently
   with probability 1/2 (S ∈ {−1, +1}^m, ``included``).
2. The (ε, δ)-DP training run is executed once.
3. Every canary gets a score from the run's output; the auditor guesses
   "included" for the k₊ highest scores, "excluded" for the k₋ lowest and
   abstains on the rest (r = k₊ + k₋ guesses).
4. If the run is (ε, δ)-DP, the number of correct guesses V satisfies
   P[V ≥ v] ≤ β(ε, r, v) + α(ε, r, v)·2mδ (see `p_value`), so the largest ε
   that this p-value rejects at level 1 − confidence is a valid lower bound:
   with probability ≥ confidence over the canary coin flips and the run, the
   run is *not* (ε', δ)-DP for any ε' below the reported value.

We try a small fixed grid of r and apply a Bonferroni correction (each r is
tested at level (1 − confidence)/len(grid)), so the reported maximum over the
grid is still a valid bound at the stated confidence.

`GradientCanaries` provides white-box "gradient canaries" for Logit-DP: a
canary is a unit direction d_k in parameter space (orthonormal across
canaries) and, whenever canary k is included and sampled in a step, C·d_k is
added to the clipped sum ḡ before the noise — a record whose contribution has
norm exactly the sensitivity C, the worst case the noise is calibrated for.
Each step's noisy gradient is released to the auditor (DP-SGD's threat model
covers all intermediate updates) and the canary is scored by the
log-likelihood ratio of the projections ⟨ĝ_t, d_k⟩/(σC) under "sampled with
rate q" against "absent". This audits the noise transform, its calibration,
Poisson sampling and the accountant of a real training run; it does not audit
the clipping (that is `logit_dp.audit.search_worst_case`'s job).

Formal guarantees: `epsilon_lower_bound` is a lower bound, at the given confidence,
on the ε of any (ε, δ)-DP mechanism whose canaries were included by fair,
independent coin flips that the guesses did not see (Steinke et al. 2023,
main theorem for (ε, δ)-DP and its p-value computation).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def _check_counts(m: int, r: int, v: int):
  for name, value in (("m", m), ("r", r), ("v", v)):
    if isinstance(value, bool) or int(value) != value:
      raise ValueError(f"{name} must be an integer, got {value!r}.")
  if not 0 <= v <= r <= m:
    raise ValueError(f"need 0 ≤ v ≤ r ≤ m, got m={m}, r={r}, v={v}.")
  return int(m), int(r), int(v)


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
  """P[≥ v correct out of r guesses] for an (ε, δ)-DP run with m canaries (upper bound).

  β = P[Binomial(r, e^ε/(1+e^ε)) ≥ v] plus the δ term α·2mδ with
  α = max_{1≤i≤v} P[v > Binomial(r, q) ≥ v − i]/i (Steinke et al. 2023, the
  (ε, δ) case of their main theorem; the same computation as their code).
  """
  import scipy.stats  # pylint: disable=g-import-not-at-top (keeps `import logit_dp` light)
  m, r, v = _check_counts(m, r, v)
  if not epsilon >= 0 or not 0 <= delta <= 1:
    raise ValueError(f"need ε ≥ 0 and 0 ≤ δ ≤ 1, got {epsilon!r}, {delta!r}.")
  q = 1.0 / (1.0 + math.exp(-epsilon)) if epsilon < 700 else 1.0
  beta = float(scipy.stats.binom.sf(v - 1, r, q))
  if v == 0 or delta == 0:
    return min(beta, 1.0)
  pmf = scipy.stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # v−1, v−2, …, 0
  alpha = float(np.max(np.cumsum(pmf) / np.arange(1, v + 1)))
  return min(beta + alpha * delta * 2 * m, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95, *,
                        tolerance: float = 1e-6) -> float:
  """Largest ε rejected at level 1 − confidence after v of r guesses were correct.

  Doubling then bisection on ε, keeping the largest ε found with
  p_value < 1 − confidence (the authors' search). Returns 0 when even ε = 0
  is not rejected and inf when ε = 700 still is.
  """
  m, r, v = _check_counts(m, r, v)
  if not 0 < confidence < 1:
    raise ValueError(f"confidence must be in (0, 1), got {confidence!r}.")
  p = 1.0 - confidence
  if p_value(m, r, v, 0.0, delta) >= p:
    return 0.0
  lo, hi = 0.0, 1.0
  while p_value(m, r, v, hi, delta) < p:
    lo, hi = hi, hi + 1.0
    if hi > 700:
      return math.inf
  while hi - lo > tolerance:
    mid = 0.5 * (lo + hi)
    if p_value(m, r, v, mid, delta) < p:
      lo = mid
    else:
      hi = mid
  return lo


@dataclasses.dataclass(frozen=True)
class OneRunAudit:
  """Result of `audit_scores`.

  Attributes:
    epsilon_lower_bound: the bound (max over the guess grid, Bonferroni-corrected).
    num_canaries: m.
    num_guesses: r of the grid point attaining the bound.
    num_correct: v there.
    confidence: overall confidence level.
    delta: δ of the null hypothesis.
    grid: tuple of (r, v, bound) for every grid point (each at level
      (1 − confidence)/len(grid)).
  """
  epsilon_lower_bound: float
  num_canaries: int
  num_guesses: int
  num_correct: int
  confidence: float
  delta: float
  grid: tuple


def audit_scores(scores, included, *, delta: float, confidence: float = 0.95,
                 guess_fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS) -> OneRunAudit:
  """One-run ε lower bound from canary scores (higher score = "more likely included").

  For each fraction f of the fixed grid, r = max(2, round(f·m)) (even) guesses
  are made: "included" for the r/2 highest scores, "excluded" for the r/2
  lowest. Ties are broken by a fixed random permutation (seed 0), which the
  inclusion bits do not influence.

  Args:
    scores: (m,) float array.
    included: (m,) bool array, the true inclusion bits.
    delta: δ of the (ε, δ) claim being tested.
    confidence: overall confidence (Bonferroni over the grid).
    guess_fractions: the grid, fixed before looking at the scores.
  """
  scores = np.asarray(scores, np.float64)
  included = np.asarray(included, bool)
  if scores.ndim != 1 or scores.shape != included.shape or scores.size < 2:
    raise ValueError("scores and included must be 1-D arrays of the same length ≥ 2.")
  if not np.all(np.isfinite(scores)):
    raise ValueError("scores must be finite.")
  m = scores.size
  perm = np.random.default_rng(0).permutation(m)
  order = perm[np.argsort(scores[perm], kind="stable")]  # ascending
  level = 1.0 - (1.0 - confidence) / len(guess_fractions)
  grid = []
  for f in guess_fractions:
    half = max(1, min(m // 2, int(round(f * m / 2))))
    guessed_in, guessed_out = order[-half:], order[:half]
    v = int(np.sum(included[guessed_in]) + np.sum(~included[guessed_out]))
    grid.append((2 * half, v, epsilon_lower_bound(m, 2 * half, v, delta, level)))
  best = max(grid, key=lambda t: t[2])
  return OneRunAudit(epsilon_lower_bound=best[2], num_canaries=m, num_guesses=best[0],
                     num_correct=best[1], confidence=confidence, delta=delta, grid=tuple(grid))


def _flatten(tree) -> jax.Array:
  return jnp.concatenate(
      [jnp.ravel(leaf).astype(jnp.float32) for leaf in jax.tree_util.tree_leaves(tree)])


class GradientCanaries:
  """m white-box gradient canaries: orthonormal directions in parameter space.

  Args:
    params: a parameter pytree (only shapes are used).
    num_canaries: m ≤ number of parameters p.
    key: JAX PRNG key for the directions (and nothing else).

  ``inject(grads, sampled, c)`` returns ḡ + c·Σ_{k: sampled_k} d_k (a pytree like
  grads); ``project(noisy)`` returns ⟨noisy, d_k⟩ for every k. Both are
  jittable. The directions are the Q factor of a p×m Gaussian matrix.
  """
  def __init__(self, params, num_canaries: int, key):
    leaves, self.treedef = jax.tree_util.tree_flatten(params)
    self.shapes = [leaf.shape for leaf in leaves]
    self.sizes = [int(np.prod(s)) for s in self.shapes]
    p = sum(self.sizes)
    integer = not isinstance(num_canaries, bool) and int(num_canaries) == num_canaries
    if not integer or not (1 <= num_canaries <= p):
      raise ValueError(f"num_canaries must be an integer in [1, {p}], got {num_canaries!r}.")
    self.num_canaries = int(num_canaries)
    gauss = jax.random.normal(key, (p, self.num_canaries), jnp.float32)
    q, _ = jnp.linalg.qr(gauss)
    self.directions = q.T  # (m, p), orthonormal rows

  def _unflatten(self, flat):
    out, start = [], 0
    for shape, size in zip(self.shapes, self.sizes):
      out.append(flat[start:start + size].reshape(shape))
      start += size
    return jax.tree_util.tree_unflatten(self.treedef, out)

  def inject(self, grads, sampled, scale) -> Any:
    """ḡ + scale·Σ_k sampled_k·d_k: grads (a pytree) plus the sampled canaries."""
    sampled = jnp.asarray(sampled, jnp.float32)
    extra = self._unflatten(scale * (sampled @ self.directions))
    return jax.tree_util.tree_map(lambda g, e: g + e.astype(g.dtype), grads, extra)

  def project(self, noisy) -> jax.Array:
    """(m,) projections ⟨noisy, d_k⟩ of a pytree like the parameters on each direction."""
    return self.directions @ _flatten(noisy)


def log_likelihood_ratio(projections: jax.Array, noise_multiplier: float, sensitivity: float,
                         sampling_rate: float) -> jax.Array:
  """Per-step score log[(1 − q) + q·exp(y/σ − 1/(2σ²))], y = ⟨ĝ, d_k⟩/(σC).

  The optimal per-step test of "canary present with Poisson rate q" against
  "absent" when ⟨ĝ, d_k⟩ ~ N(C·b, (σC)²), b ~ Bernoulli(q). With σ = 0 the
  raw projection is returned (the no-noise control).
  """
  if noise_multiplier == 0:
    return projections
  y = projections / (noise_multiplier * sensitivity)
  log_present = math.log(sampling_rate) + y / noise_multiplier - 0.5 / noise_multiplier ** 2
  if sampling_rate >= 1.0:
    return log_present
  return jnp.logaddexp(math.log1p(-sampling_rate), log_present)

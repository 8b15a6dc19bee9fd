"""Sensitivity audits: measure ‖ḡ(X) − ḡ(X∖k)‖ and search for batches that maximise it.

`logit_dp.sensitivity` is a proof (Theorem 3.3 of Kong, Muñoz Medina & Ribero
2025, with the corrected contrastive constant, see `losses.Contrastive`). This
module tests it numerically on the code that is actually run: it calls the
same jitted core as `logit_dp.clipped_grad` / `logit_dp.baselines.naive_clipped_grad`,
removes each pair k in turn (by masking it out, which the clipping tests show is
identical to deleting it) and compares the largest change with the bound.

    gap_k  = ‖ḡ(X) − ḡ(X∖k)‖₂            (k over the valid pairs of X)
    ratio  = max_k gap_k / C(n)           (C(n) = sensitivity(loss, B, batch_size=n))
    ratio∞ = max_k gap_k / C(∞)           (C(∞) = sensitivity(loss, B), the Poisson bound)

For Naive-DP the bound is 2B for every n. A ratio above 1 is a privacy bug.
DP-GCL (method="dp_gcl", `logit_dp.baselines.grouped_clipped_grad`) is audited against its 2B with
record ids 0..n−1 grouped by `logit_dp.baselines.assign_groups` (key PRNGKey(group_seed)): removing
record k by masking it keeps every other record's group, which is what removing it from a
Poisson batch does under that assignment. Its extra views, if any, come from
``extra_views_fn(x, x_prime) -> (n, k, ...)`` (row r a function of record r only), so the
search moves them with the inputs.

`search_worst_case` makes the ratio as large as it can: gradient ascent (Adam)
on the inputs (x, x′) — and optionally on the parameters w, since the bound
must hold for every w — of the smooth surrogate

    f(x, x′) = logsumexp_k log(gap_k² + 1e-30)

(≈ log max_k gap_k²), from the given batch and from ``num_restarts − 1``
random restarts, keeping the best ratio seen at any step. The clip factor
min(1, B/‖g_ij‖) makes f piecewise smooth; plain `jax.grad` through it is used
(non-finite gradient entries are zeroed). A search is a lower bound on the worst
case, never a proof; the proof is the derivation in `logit_dp.losses`.

Replace-one (`replacement_gaps`, `search_worst_replacement`) audits
`sensitivity(loss, B, neighboring_relation=REPLACE_ONE)` the same way: pair k of X is replaced
by pair k of a second batch (y, y′), every other pair kept,

    gap_k = ‖ḡ(X) − ḡ(X with (x_k, x′_k) replaced by (y_k, y′_k))‖₂,

and the search moves (x, x′, y, y′) together. The replaced record keeps its position, hence
(DP-GCL) its record id and group. With ``dtype=jnp.float64`` (under `jax.enable_x64`) the
audited ḡ is computed in float64, so the ratio carries no float32 rounding.

Formal guarantees: none (this is a test instrument). A ratio > 1 returned by
these functions is a counterexample to the claimed sensitivity for the
returned inputs and parameters, up to float32 rounding (≈ 1e-6 relative).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logit_dp._src import checks
from logit_dp._src import clipping
from logit_dp._src import grouped
from logit_dp._src import mechanisms
from logit_dp._src import methods
from logit_dp._src import numerics
from logit_dp._src import rows as rows_lib
from logit_dp._src import sensitivity as sensitivity_lib
from logit_dp._src import stochastic as stochastic_lib

EmbedFn = Callable[[Any, jax.Array], jax.Array]
_TINY = 1e-30


@dataclasses.dataclass(frozen=True)
class RemovalAudit:
  """The result of one removal audit.

  Attributes:
    ratio: max_k gap_k / C(n), n the number of valid pairs in the batch (for
      Naive-DP: / 2B). Must be ≤ 1.
    ratio_sup: max_k gap_k / C(∞), the bound used with Poisson sampling (equal
      to ``ratio`` for spreadout and Naive-DP).
    max_gap: max_k gap_k.
    worst_pair: the k attaining it.
    bound: C(n) (Naive-DP: 2B).
    bound_sup: C(∞) (Naive-DP: 2B).
    gaps: np.ndarray (n,), gap_k for every k (0 for pairs already masked out).
      A NaN gap means the clipped gradient itself was NaN on X or X∖k (a
      failure of the audited code; ratio is then NaN and never passes ≤ 1).
    method: the clipping method ("ghost", "materialize", "triangle", "projected", "naive" or
      "dp_gcl").
    x, x_prime, params: the batch and parameters the audit ran on (for
      `search_worst_case`, the worst ones found).
    replacement: (y, y′), the pairs that replace X's in a replace-one audit (None for
      removal); bound and bound_sup are then the replace-one sensitivities.
  """
  ratio: float
  ratio_sup: float
  max_gap: float
  worst_pair: int
  bound: float
  bound_sup: float
  gaps: np.ndarray
  method: str
  x: Any = None
  x_prime: Any = None
  params: Any = None
  replacement: Any = None


def _bounds(loss, clip_norm: float, n_valid: int, method: str,
            relation=sensitivity_lib.ADD_OR_REMOVE_ONE) -> tuple[float, float]:
  mechanism = mechanisms.Mechanism.of_method(method)
  return (mechanism.sensitivity(loss, clip_norm, batch_size=max(n_valid, 2),
                                neighboring_relation=relation),
          mechanism.sensitivity(loss, clip_norm, batch_size=None, neighboring_relation=relation))


@dataclasses.dataclass(frozen=True)
class _Grouping:
  """The DP-GCL configuration of an audit (hashable: a static argument of the cores)."""
  num_groups: int
  group_seed: int = 0
  extra_views_fn: Callable | None = None


def _grouping(method, num_groups, group_seed, extra_views_fn) -> _Grouping | None:
  if method != "dp_gcl":
    if num_groups is not None or extra_views_fn is not None:
      raise ValueError("num_groups and extra_views_fn are for method='dp_gcl' only.")
    return None
  if num_groups is None:
    raise ValueError("method='dp_gcl' needs num_groups.")
  return _Grouping(grouped.check_num_groups(num_groups), int(group_seed), extra_views_fn)


@dataclasses.dataclass(frozen=True, eq=False)
class _Reference:
  """The public reference inputs of method="projected" (hashed by identity: a cache key)."""
  inputs: Any
  rank: int


def _reference(method, reference_inputs, projection_rank, embed_fn,
               positive_embed_fn=None) -> _Reference | None:
  """The reference of method="projected" checked by `methods.Projected` (reference_inputs for
  another method, also "naive" and "dp_gcl", which never reach clipped_grad: ValueError), as a
  cache key."""
  if method != methods.Projected.name:
    if reference_inputs is not None:
      raise ValueError(f"reference_inputs are used by method='projected' only, not {method!r}.")
    return None
  projected = methods.Projected(reference_inputs=reference_inputs,
                                rank=projection_rank).for_model(embed_fn, positive_embed_fn)
  return _Reference(projected.reference_inputs, projected.rank)


@functools.lru_cache(maxsize=64)
def _make_core(embed_fn, loss, clip_norm, method, cosine_eps, grouping=None, positive_embed_fn=None,
               reference: _Reference | None = None, stochastic: bool = False):
  """The jitted core of the audited grad_fn (cached: one compilation per configuration);
  stochastic: it takes the model's key after the mask."""
  if mechanisms.Mechanism.of_method(method) is mechanisms.Mechanism.DP_GCL:
    if grouping is None:
      raise ValueError("method='dp_gcl' needs num_groups.")
    fn = grouped.grouped_clipped_grad(embed_fn, loss, clip_norm, grouping.num_groups,
                                      cosine_eps=cosine_eps, positive_embed_fn=positive_embed_fn,
                                      stochastic=stochastic)

    def grouped_core(params, x, x_prime, mask, *keys):
      ids = jnp.arange(rows_lib.num_rows(x))
      groups = grouped.assign_groups(ids, jax.random.PRNGKey(grouping.group_seed),
                                     grouping.num_groups)
      views = None if grouping.extra_views_fn is None else grouping.extra_views_fn(x, x_prime)
      return fn.core(params, x, x_prime, mask, groups, views, *keys)

    return grouped_core
  if reference is not None:
    method = methods.Projected(reference_inputs=reference.inputs, rank=reference.rank)
  fn = clipping.private_grad(embed_fn, loss, clip_norm, method, cosine_eps=cosine_eps,
                             positive_embed_fn=positive_embed_fn, stochastic=stochastic)
  return fn.core


def _flat(tree) -> jax.Array:
  return jnp.concatenate([jnp.ravel(leaf) for leaf in jax.tree_util.tree_leaves(tree)])


def _squared_gaps(full, changed, n: int, mask, chunk):
  """‖changed(k) − full‖² for k = 0..n−1 (0 where mask is False), vmapped or in chunks."""
  full = _flat(full)

  def one(k):
    d = _flat(changed(k)) - full
    return jnp.sum(d * d)

  if chunk is None or chunk >= n:
    sq = jax.vmap(one)(jnp.arange(n))
  else:
    sq = jax.lax.map(one, jnp.arange(n), batch_size=chunk)
  return jnp.where(mask, sq, 0.0)


def _gaps_fn(core, params, x, x_prime, mask, chunk, keys=()):
  """gap_k² for every k: ḡ(X) against ḡ(X with pair k masked out); keys: (the model's key,) of a
  stochastic core, the same for both (every other example keeps its randomness)."""
  n = rows_lib.num_rows(x)
  full = core(params, x, x_prime, mask, *keys)[1]
  masked = lambda k: core(params, x, x_prime, mask & (jnp.arange(n) != k), *keys)[1]
  return _squared_gaps(full, masked, n, mask, chunk)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _gaps_jit(core, params, x, x_prime, mask, chunk, keys=()):
  return jnp.sqrt(_gaps_fn(core, params, x, x_prime, mask, chunk, keys))


def _replacement_gaps_fn(core, params, x, x_prime, y, y_prime, mask, chunk):
  """gap_k² for every k: ḡ(X) against ḡ(X with pair k replaced by (y_k, y′_k))."""
  n = rows_lib.num_rows(x)
  full = core(params, x, x_prime, mask)[1]
  replaced = lambda k: core(params, x.at[k].set(y[k]), x_prime.at[k].set(y_prime[k]), mask)[1]
  return _squared_gaps(full, replaced, n, mask, chunk)


@functools.partial(jax.jit, static_argnums=(0, 7))
def _replacement_gaps_jit(core, params, x, x_prime, y, y_prime, mask, chunk):
  return jnp.sqrt(_replacement_gaps_fn(core, params, x, x_prime, y, y_prime, mask, chunk))


def _check_method(method: str) -> str:
  """method if it names a clip method (registered), "naive" or "dp_gcl"; ValueError otherwise."""
  if isinstance(method, str):
    mechanisms.Mechanism.of_method(method)
    return method
  raise ValueError(f"method must be the name of a clip method, 'naive' or 'dp_gcl', got "
                   f"{method!r}.")


def _prepare(loss, x, x_prime, mask, dtype=jnp.float32):
  x, x_prime, mask = checks.check_pair_inputs(x, x_prime, mask, getattr(loss, "min_batch_size", 1))
  as_dtype = lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a
  x, x_prime = jax.tree_util.tree_map(as_dtype, (x, x_prime))
  if not (bool(jnp.all(rows_lib.finite_rows(x))) and bool(jnp.all(rows_lib.finite_rows(x_prime)))):
    raise ValueError("x and x_prime must be finite (an audit has no pair to drop).")
  return x, x_prime, mask


def removal_gaps(embed_fn: EmbedFn, params, loss, clip_norm: float, x, x_prime, *, mask=None,
                 method: str = "ghost", chunk: int | None = None,
                 cosine_eps: float = numerics.DEFAULT_COSINE_EPS, num_groups: int | None = None,
                 group_seed: int = 0, extra_views_fn: Callable | None = None,
                 positive_embed_fn: EmbedFn | None = None, reference_inputs: Any = None,
                 projection_rank: int = methods.DEFAULT_PROJECTION_RANK,
                 model_key: Any = None) -> np.ndarray:
  """gap_k = ‖ḡ(X) − ḡ(X∖k)‖₂ for every pair k, as an (n,) array.

  Args:
    embed_fn, params, loss, clip_norm: as for `logit_dp.clipped_grad`.
    x, x_prime: the batch, (n, ...) each.
    mask: optional (n,) bool of valid pairs (invalid ones get gap 0).
    method: the name of a clip method (`logit_dp.clip_methods.names`), "naive" for
      `naive_clipped_grad` or "dp_gcl" for `grouped_clipped_grad` (with num_groups,
      group_seed, extra_views_fn: see the module doc).
    chunk: removals computed at once (None: all n, vmapped).
    cosine_eps, positive_embed_fn: as for `logit_dp.clipped_grad` (two towers: x, x_prime
      may be pytrees).
    reference_inputs, projection_rank: the public reference of method="projected", as for
      `logit_dp.clipped_grad`.
    model_key: a stochastic embed_fn(params, x, key) (`clipped_grad(..., stochastic=True)`)
      with this key in both ḡ(X) and ḡ(X∖k): the gaps conditioned on the model's randomness,
      which the sensitivity bounds for every value of it. None: embed_fn(params, x).
  """
  method = _check_method(method)
  grouping = _grouping(method, num_groups, group_seed, extra_views_fn)
  x, x_prime, mask = _prepare(loss, x, x_prime, mask)
  keys = _model_keys(model_key)
  core = _make_core(
      embed_fn, loss, clip_norm, method, cosine_eps, grouping, positive_embed_fn,
      _reference(method, reference_inputs, projection_rank, embed_fn, positive_embed_fn),
      bool(keys))
  return np.asarray(_gaps_jit(core, params, x, x_prime, mask, chunk, keys), np.float64)


def _model_keys(model_key) -> tuple:
  """(model_key,) checked as a PRNG key, or () for a deterministic model."""
  if model_key is None:
    return ()
  return (stochastic_lib.check_key(model_key, True, "the audit"),)


def max_removal_ratio(embed_fn: EmbedFn, params, loss, clip_norm: float, x, x_prime, *, mask=None,
                      method: str = "ghost", chunk: int | None = None,
                      cosine_eps: float = numerics.DEFAULT_COSINE_EPS,
                      num_groups: int | None = None, group_seed: int = 0,
                      extra_views_fn: Callable | None = None,
                      positive_embed_fn: EmbedFn | None = None, reference_inputs: Any = None,
                      projection_rank: int = methods.DEFAULT_PROJECTION_RANK,
                      model_key: Any = None) -> RemovalAudit:
  """max_k ‖ḡ(X) − ḡ(X∖k)‖₂ and its ratio to the sensitivity.

  Args: as for `removal_gaps`; method="naive" audits Naive-DP and "dp_gcl" DP-GCL against 2B.

  Returns:
    A `RemovalAudit`. ``ratio`` compares with C(n) for the n valid pairs of X
    (the exact claim for a batch of that size), ``ratio_sup`` with the supremum
    C(∞) that Poisson training calibrates its noise to.
  """
  _check_method(method)
  clip_norm = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=False)
  gaps = removal_gaps(embed_fn, params, loss, clip_norm, x, x_prime, mask=mask, method=method,
                      chunk=chunk, cosine_eps=cosine_eps, num_groups=num_groups,
                      group_seed=group_seed, extra_views_fn=extra_views_fn,
                      positive_embed_fn=positive_embed_fn, reference_inputs=reference_inputs,
                      projection_rank=projection_rank, model_key=model_key)
  x, x_prime, mask_arr = _prepare(loss, x, x_prime, mask)
  return _result(gaps, loss, clip_norm, mask_arr, method, params, x, x_prime)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _ascent(core, num_steps, learning_rate, optimize_params, chunk, params, x, x_prime, mask,
            keys=(), replacement=None):
  """Adam ascent on (x, x′[, w]) (with a replacement (y, y′): on (x, x′, y, y′) of the
  replace-one gaps); returns the best max_k gap_k² seen and its arguments, or +inf and the
  first point where a gap was not finite."""
  opt = optax.adam(learning_rate)

  def objective(variables):
    p = variables["params"] if optimize_params else params
    if replacement is None:
      sq = _gaps_fn(core, p, variables["x"], variables["x_prime"], mask, chunk, keys)
    else:
      sq = _replacement_gaps_fn(core, p, variables["x"], variables["x_prime"], variables["y"],
                                variables["y_prime"], mask, chunk)
    surrogate = jax.nn.logsumexp(jnp.where(mask, jnp.log(sq + _TINY), -jnp.inf))
    return surrogate, jnp.max(sq)

  variables = {"x": x, "x_prime": x_prime}
  if optimize_params:
    variables["params"] = params
  if replacement is not None:
    variables["y"], variables["y_prime"] = replacement

  def keep(best, best_v, max_sq, v):
    # A non-finite gap is a failure of the audited code: the first one seen is kept (as +inf,
    # never replaced) so that the re-audit of its point reports it.
    failed = ~jnp.isfinite(max_sq) & jnp.isfinite(best)
    better = failed | (jnp.isfinite(max_sq) & (max_sq > best))
    best_v = jax.tree_util.tree_map(lambda a, b: jnp.where(better, a, b), v, best_v)
    return jnp.where(failed, jnp.inf, jnp.where(better, max_sq, best)), best_v

  def step(carry, _):
    v, state, best, best_v = carry
    (_, max_sq), g = jax.value_and_grad(objective, has_aux=True)(v)
    best, best_v = keep(best, best_v, max_sq, v)
    g = jax.tree_util.tree_map(lambda t: jnp.where(jnp.isfinite(t), -t, 0.0), g)  # ascent
    updates, state = opt.update(g, state, v)
    return (optax.apply_updates(v, updates), state, best, best_v), max_sq

  init = (variables, opt.init(variables), jnp.asarray(-1.0), variables)
  (v, _, best, best_v), _ = jax.lax.scan(step, init, None, length=num_steps)
  _, last = objective(v)  # the final iterate, never evaluated inside the scan
  return keep(best, best_v, last, v)


_RESTART_SCALES = (1.0, 0.1, 10.0)


def _restart_points(params, x, x_prime, key, num_restarts, init_scale, optimize_params):
  """Starting points: the given one, then random inputs at scales init_scale·(1, 0.1, 10, …)
  (see `search_worst_case` for the families of positives)."""
  points = [(params, x, x_prime)]
  for r in range(1, num_restarts):
    scale = init_scale * _RESTART_SCALES[(r - 1) % len(_RESTART_SCALES)]
    kx, kxp, kp = jax.random.split(jax.random.fold_in(key, r), 3)
    x0 = scale * jax.random.normal(kx, x.shape, jnp.float32)
    xp0 = scale * jax.random.normal(kxp, x_prime.shape, jnp.float32)
    if x.shape == x_prime.shape and r % 2 == 1:
      # Positives near their anchors (the training regime); every other such restart makes
      # them near-identical (x' = x + 1e-2·noise), where the two halves of g_ii nearly cancel
      # and float32 Gram forms lose the small norm, and rolls them by one row so that the
      # near-identical pairs are off the diagonal.
      family = (r // 2) % 3
      spread = 0.3 if family == 0 else 1e-2
      anchors = x0 if family < 2 else jnp.roll(x0, 1, axis=0)
      xp0 = anchors + spread * scale * jax.random.normal(kxp, x.shape, jnp.float32)
    p0 = params
    if optimize_params:
      leaves, treedef = jax.tree_util.tree_flatten(params)
      keys = jax.random.split(kp, len(leaves))
      p0 = jax.tree_util.tree_unflatten(treedef, [
          leaf + init_scale * jnp.sqrt(jnp.mean(leaf * leaf) + 1e-12)
          * jax.random.normal(k, leaf.shape, leaf.dtype) for leaf, k in zip(leaves, keys)
      ])
    points.append((p0, x0, xp0))
  return points


@functools.partial(jax.jit, static_argnums=(0, 5))
def _evaluate_many(core, params, xs, xps, mask, chunk, keys=()):
  """gap_k for a stack of batches (the same params): (restarts, n)."""
  return jnp.sqrt(jax.vmap(lambda a, b: _gaps_fn(core, params, a, b, mask, chunk, keys))(xs, xps))


def _result(gaps, loss, clip_norm, mask, method, params, x, x_prime,
            replacement=None) -> RemovalAudit:
  gaps = np.asarray(gaps, np.float64)
  relation = (sensitivity_lib.ADD_OR_REMOVE_ONE
              if replacement is None else sensitivity_lib.REPLACE_ONE)
  bound, bound_sup = _bounds(loss, clip_norm, int(jnp.sum(mask)), method, relation)
  k = int(np.argmax(gaps))
  return RemovalAudit(ratio=float(gaps[k] / bound), ratio_sup=float(gaps[k] / bound_sup),
                      max_gap=float(gaps[k]), worst_pair=k, bound=bound, bound_sup=bound_sup,
                      gaps=gaps, method=method, x=x, x_prime=x_prime, params=params,
                      replacement=replacement)


def search_worst_case(embed_fn: EmbedFn, params, loss, clip_norm: float, x, x_prime, *, key,
                      num_restarts: int = 4, num_steps: int = 50, learning_rate: float = 0.05,
                      init_scale: float = 1.0, optimize_params: bool = False, method: str = "ghost",
                      chunk: int | None = None, cosine_eps: float = numerics.DEFAULT_COSINE_EPS,
                      num_groups: int | None = None, group_seed: int = 0,
                      extra_views_fn: Callable | None = None, reference_inputs: Any = None,
                      projection_rank: int = methods.DEFAULT_PROJECTION_RANK, model_key: Any = None,
                      positive_embed_fn: EmbedFn | None = None) -> RemovalAudit:
  """Searches for the batch (and optionally parameters) maximising max_k gap_k / C.

  Restart 0 starts from (x, x′, params); restart r ≥ 1 from inputs drawn
  i.i.d. N(0, s²) with the shapes of x, x′ and s cycling through
  init_scale·(1, 0.1, 10) (odd restarts draw x′ near x: x + 0.3·noise, x + 0.01·noise
  (near-identical positives) or the latter rolled by one row (near-identical off-diagonal
  pairs), in turn; even ones independently;
  with optimize_params, params + N(0, (init_scale·rms(leaf))²) per leaf). Each
  restart runs ``num_steps`` Adam steps of ascent on
  logsumexp_k log(gap_k² + 1e-30) (one jit-compiled scan, compiled once for all
  restarts). With ``num_steps=0`` the restarts are only evaluated, all at once
  (a random search: one cheap compilation, used by the property tests). The
  best point over all restarts and steps is re-audited with
  `max_removal_ratio` and returned; a point where some gap_k is not finite (the
  audited ḡ is NaN or infinite there) takes precedence over every finite one, so
  the returned ratio is then NaN or infinite and fails ``ratio <= 1``.

  Args:
    embed_fn, params, loss, clip_norm: as for `logit_dp.clipped_grad`.
    x, x_prime: the starting batch; its shapes are kept.
    key: a JAX PRNG key for the restarts.
    num_restarts: ≥ 1.
    num_steps: Adam steps per restart (≥ 0).
    learning_rate: Adam step size.
    init_scale: scale of the random restarts.
    optimize_params: also move the parameters w (the bound holds for every w).
    method: the name of a clip method (`logit_dp.clip_methods.names`), "naive" or "dp_gcl"
      (both audited against 2B).
    chunk: removals computed at once (None: all n).
    cosine_eps: as for `logit_dp.clipped_grad`.
    num_groups, group_seed, extra_views_fn: the DP-GCL configuration (method="dp_gcl").
    reference_inputs, projection_rank: method="projected"'s public reference (kept fixed).
    model_key: a stochastic model's key, held fixed during the search (`removal_gaps`).
    positive_embed_fn: two towers, as for `logit_dp.clipped_grad` (x, x_prime float arrays,
      moved by the search like one tower's).

  Returns:
    The `RemovalAudit` of the worst (x, x′, params) found.
  """
  method = _check_method(method)
  clip_norm = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=False)
  if isinstance(num_restarts, bool) or int(num_restarts) != num_restarts or num_restarts < 1:
    raise ValueError(f"num_restarts must be an integer ≥ 1, got {num_restarts!r}.")
  if isinstance(num_steps, bool) or int(num_steps) != num_steps or num_steps < 0:
    raise ValueError(f"num_steps must be an integer ≥ 0, got {num_steps!r}.")
  grouping = _grouping(method, num_groups, group_seed, extra_views_fn)
  x, x_prime, mask = _prepare(loss, x, x_prime, None)
  reference = _reference(method, reference_inputs, projection_rank, embed_fn, positive_embed_fn)
  keys = _model_keys(model_key)
  core = _make_core(embed_fn, loss, clip_norm, method, cosine_eps, grouping, positive_embed_fn,
                    reference, bool(keys))
  points = _restart_points(params, x, x_prime, key, int(num_restarts), float(init_scale),
                           bool(optimize_params))
  if num_steps == 0 and not optimize_params:
    gaps = np.asarray(
        _evaluate_many(core, params, jnp.stack([p[1] for p in points]),
                       jnp.stack([p[2] for p in points]), mask, chunk, keys))
    # A restart with a non-finite gap is the result (+inf): its ratio is NaN and fails.
    values = np.where(np.all(np.isfinite(gaps), axis=1), np.max(gaps, axis=1), np.inf)
    r = int(np.argmax(values))
    return _result(gaps[r], loss, clip_norm, mask, method, params, points[r][1], points[r][2])
  else:
    best, best_args = -1.0, points[0]
    for p0, x0, xp0 in points:
      if num_steps == 0:
        value, v = float(jnp.max(_gaps_jit(core, p0, x0, xp0, mask, chunk,
                                           keys))) ** 2, dict(params=p0, x=x0, x_prime=xp0)
      else:
        value, v = _ascent(core, int(num_steps), float(learning_rate), bool(optimize_params), chunk,
                           p0, x0, xp0, mask, keys)
      value = float(value)
      if not math.isfinite(value) or value > best:
        best = value
        best_args = (v["params"] if optimize_params else p0, v["x"], v["x_prime"])
      if not math.isfinite(best):  # a non-finite gap fails the audit: re-audit that point
        break
  p, bx, bxp = best_args
  return max_removal_ratio(embed_fn, p, loss, clip_norm, bx, bxp, method=method, chunk=chunk,
                           cosine_eps=cosine_eps, num_groups=num_groups, group_seed=group_seed,
                           extra_views_fn=extra_views_fn, reference_inputs=reference_inputs,
                           projection_rank=projection_rank, model_key=model_key,
                           positive_embed_fn=positive_embed_fn)


def _replacement_core(embed_fn, loss, clip_norm, method, cosine_eps, num_groups, group_seed):
  method = _check_method(method)
  grouping = _grouping(method, num_groups, group_seed, None)
  _reference(method, None, methods.DEFAULT_PROJECTION_RANK, embed_fn)  # "projected": refused
  return method, _make_core(embed_fn, loss, clip_norm, method, cosine_eps, grouping)


def _prepare_replacement(loss, x, x_prime, y, y_prime, mask, dtype):
  if jnp.dtype(dtype) == jnp.float64 and not jax.config.read("jax_enable_x64"):
    raise ValueError("dtype=float64 needs 64-bit JAX: run the audit under jax.enable_x64(True).")
  x, x_prime, mask = _prepare(loss, x, x_prime, mask, dtype)
  y, y_prime, _ = _prepare(loss, y, y_prime, None, dtype)
  if not isinstance(x, jax.Array) or y.shape != x.shape or y_prime.shape != x_prime.shape:
    raise ValueError("the replacement (y, y_prime) must be arrays of the shapes of (x, x_prime), "
                     f"got {jnp.shape(y)}, {jnp.shape(y_prime)} for {jnp.shape(x)}, "
                     f"{jnp.shape(x_prime)}.")
  return x, x_prime, y, y_prime, mask


def replacement_gaps(embed_fn: EmbedFn, params, loss, clip_norm: float, x, x_prime, y, y_prime, *,
                     mask=None, method: str = "ghost", chunk: int | None = None,
                     cosine_eps: float = numerics.DEFAULT_COSINE_EPS, num_groups: int | None = None,
                     group_seed: int = 0, dtype=jnp.float32) -> np.ndarray:
  """gap_k = ‖ḡ(X) − ḡ(X with pair k replaced by (y_k, y′_k))‖₂ for every pair k, as (n,).

  Args:
    embed_fn, params, loss, clip_norm: as for `logit_dp.clipped_grad`.
    x, x_prime: the batch, (n, ...) arrays.
    y, y_prime: the replacements, arrays of the shapes of x and x_prime.
    mask: optional (n,) bool of valid pairs (invalid ones get gap 0).
    method: a `logit_dp.clip_methods.METHODS` entry other than "projected", "naive" or
      "dp_gcl" (with num_groups, group_seed; record ids 0..n−1, so a replaced record keeps its
      group).
    chunk: replacements computed at once (None: all n, vmapped).
    cosine_eps: as for `logit_dp.clipped_grad`.
    dtype: the float dtype of inputs and params the gaps are computed in (jnp.float64 needs
      `jax.enable_x64`).
  """
  method, core = _replacement_core(embed_fn, loss, clip_norm, method, cosine_eps, num_groups,
                                   group_seed)
  x, x_prime, y, y_prime, mask = _prepare_replacement(loss, x, x_prime, y, y_prime, mask, dtype)
  params = _as_dtype(params, dtype)
  return np.asarray(_replacement_gaps_jit(core, params, x, x_prime, y, y_prime, mask, chunk),
                    np.float64)


def _as_dtype(params, dtype):
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(a, dtype)
      if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else a, params)


def search_worst_replacement(embed_fn: EmbedFn, params, loss, clip_norm: float, x, x_prime, *, key,
                             num_restarts: int = 4, num_steps: int = 50,
                             learning_rate: float = 0.05, init_scale: float = 1.0,
                             method: str = "ghost", chunk: int | None = None,
                             cosine_eps: float = numerics.DEFAULT_COSINE_EPS,
                             num_groups: int | None = None, group_seed: int = 0,
                             dtype=jnp.float32) -> RemovalAudit:
  """Searches for the batch and replacements maximising max_k gap_k / C_rep (replace-one).

  As `search_worst_case`, with the replacements (y, y′) moved too: restart 0 starts from
  (x, x′) and y, y′ = x, x′ rolled by one row (each pair replaced by its neighbour's); restart
  r ≥ 1 draws (x, x′) and (y, y′) as `search_worst_case`'s restarts (independent keys). Each
  restart runs ``num_steps`` Adam steps of ascent on logsumexp_k log(gap_k² + 1e-30) in
  ``dtype``; the best point is re-audited.

  The arguments are those of `search_worst_case` (without optimize_params: the parameters stay
  fixed; "projected" is not audited here), and ``dtype`` as for `replacement_gaps`.

  Returns:
    The `RemovalAudit` of the worst (x, x′) and ``replacement`` (y, y′) found; its bounds are
    the replace-one sensitivities C_rep(n) and C_rep(∞).
  """
  method, core = _replacement_core(embed_fn, loss, clip_norm, method, cosine_eps, num_groups,
                                   group_seed)
  clip_norm = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=False)
  if isinstance(num_restarts, bool) or int(num_restarts) != num_restarts or num_restarts < 1:
    raise ValueError(f"num_restarts must be an integer ≥ 1, got {num_restarts!r}.")
  if isinstance(num_steps, bool) or int(num_steps) != num_steps or num_steps < 1:
    raise ValueError(f"num_steps must be an integer ≥ 1, got {num_steps!r}.")
  x, x_prime, y, y_prime, mask = _prepare_replacement(loss, x, x_prime, jnp.roll(x, 1, axis=0),
                                                      jnp.roll(x_prime, 1, axis=0), None, dtype)
  params = _as_dtype(params, dtype)
  starts = _restart_points(params, x, x_prime, key, int(num_restarts), float(init_scale), False)
  replacements = _restart_points(params, y, y_prime, jax.random.fold_in(key, 2 ** 20),
                                 int(num_restarts), float(init_scale), False)
  cast = lambda a: a.astype(dtype)
  best, best_args = -1.0, (x, x_prime, y, y_prime)
  for (_, x0, xp0), (_, y0, yp0) in zip(starts, replacements):
    value, v = _ascent(core, int(num_steps), float(learning_rate), False, chunk, params, cast(x0),
                       cast(xp0), mask, (), (cast(y0), cast(yp0)))
    value = float(value)
    if not math.isfinite(value) or value > best:
      best, best_args = value, (v["x"], v["x_prime"], v["y"], v["y_prime"])
    if not math.isfinite(best):
      break
  bx, bxp, by, byp = best_args
  gaps = replacement_gaps(embed_fn, params, loss, clip_norm, bx, bxp, by, byp, method=method,
                          chunk=chunk, cosine_eps=cosine_eps, num_groups=num_groups,
                          group_seed=group_seed, dtype=dtype)
  return _result(gaps, loss, clip_norm, mask, method, params, bx, bxp, (by, byp))


# ----------------------------------------------------------------------------
# Privacy per person: removing a whole person.
# ----------------------------------------------------------------------------

#: How an audited DP-GCL run groups its rows: by the person of each row (what privacy per person
#: needs and `make_private(user_ids=)` does) or by each row's own record id (per pair: the
#: negative control, a person's pairs land in several groups).
GROUP_BY = ("person", "pair")


@dataclasses.dataclass(frozen=True)
class PersonRemovalAudit:
  """The result of one person-removal audit.

  Attributes:
    ratio: max_u gap_u / C_K(n), gap_u = ‖ḡ(X) − ḡ(X without every pair of person u)‖₂, n the
      valid pairs of X and K the most valid pairs of one person in X (`person_sensitivity`;
      Naive-DP and DP-GCL: 2B). Must be ≤ 1.
    ratio_sup: max_u gap_u / C_K(∞), the bound Poisson training calibrates to.
    max_gap: max_u gap_u.
    worst_person: the u attaining it (dense index: 0..M−1 in the order of the ids).
    bound, bound_sup: C_K(n) and C_K(∞).
    max_pairs: K, the most valid pairs of one person in X.
    gaps: (M,) gap_u of every person (0 for a person without a valid pair).
    method: the audited method; group_by: DP-GCL's grouping ("person" or "pair"; None otherwise).
    x, x_prime, params, user_ids: the batch the audit ran on.
  """
  ratio: float
  ratio_sup: float
  max_gap: float
  worst_person: int
  bound: float
  bound_sup: float
  max_pairs: int
  gaps: np.ndarray
  method: str
  group_by: str | None = None
  x: Any = None
  x_prime: Any = None
  params: Any = None
  user_ids: Any = None


def _people(user_ids, n: int) -> tuple[np.ndarray, int]:
  ids = np.asarray(user_ids)
  if ids.shape != (n,) or ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"user_ids must be an integer array of shape ({n},), the person of every "
                     f"row, got shape {ids.shape}, dtype {ids.dtype}.")
  _, person = np.unique(ids, return_inverse=True)
  person = person.reshape(-1).astype(np.int32)
  return person, int(person.max()) + 1


@functools.lru_cache(maxsize=64)
def _make_person_core(embed_fn, loss, clip_norm, method, cosine_eps, grouping=None, group_by=None,
                      positive_embed_fn=None):
  """core(params, x, x_prime, mask, person) of the audited grad_fn: DP-GCL groups by
  ``person`` (group_by="person") or by the row (group_by="pair"); the others ignore it."""
  if mechanisms.Mechanism.of_method(method) is mechanisms.Mechanism.DP_GCL:
    if grouping is None:
      raise ValueError("method='dp_gcl' needs num_groups.")
    fn = grouped.grouped_clipped_grad(embed_fn, loss, clip_norm, grouping.num_groups,
                                      cosine_eps=cosine_eps, positive_embed_fn=positive_embed_fn)

    def grouped_core(params, x, x_prime, mask, person):
      ids = person if group_by == "person" else jnp.arange(rows_lib.num_rows(x))
      groups = grouped.assign_groups(ids, jax.random.PRNGKey(grouping.group_seed),
                                     grouping.num_groups)
      views = None if grouping.extra_views_fn is None else grouping.extra_views_fn(x, x_prime)
      return fn.core(params, x, x_prime, mask, groups, views)

    return grouped_core
  fn = clipping.private_grad(embed_fn, loss, clip_norm, method, cosine_eps=cosine_eps,
                             positive_embed_fn=positive_embed_fn)
  return lambda params, x, x_prime, mask, person: fn.core(params, x, x_prime, mask)


def _person_gaps_fn(core, params, x, x_prime, mask, person, num_people):
  """gap_u² for every person u: ḡ(X) against ḡ(X with every row of u masked out)."""
  full = _flat(core(params, x, x_prime, mask, person)[1])

  def one(u):
    d = _flat(core(params, x, x_prime, mask & (person != u), person)[1]) - full
    return jnp.sum(d * d)

  present = jax.ops.segment_sum(mask.astype(jnp.int32), person, num_segments=num_people) > 0
  return jnp.where(present, jax.vmap(one)(jnp.arange(num_people)), 0.0)


@functools.partial(jax.jit, static_argnums=(0, 6))
def _person_gaps_jit(core, params, x, x_prime, mask, person, num_people):
  return jnp.sqrt(_person_gaps_fn(core, params, x, x_prime, mask, person, num_people))


def _person_setup(embed_fn, loss, clip_norm, x, x_prime, user_ids, mask, method, cosine_eps,
                  num_groups, group_seed, extra_views_fn, group_by, positive_embed_fn):
  method = _check_method(method)
  clip_norm = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=False)
  grouping = _grouping(method, num_groups, group_seed, extra_views_fn)
  if grouping is None:
    if group_by is not None:
      raise ValueError("group_by is for method='dp_gcl' only.")
  elif group_by not in GROUP_BY:
    raise ValueError(f"group_by must be one of {GROUP_BY}, got {group_by!r}.")
  x, x_prime, mask = _prepare(loss, x, x_prime, mask)
  person, num_people = _people(user_ids, rows_lib.num_rows(x))
  core = _make_person_core(embed_fn, loss, clip_norm, method, cosine_eps, grouping,
                           group_by if grouping is not None else None, positive_embed_fn)
  return method, clip_norm, core, x, x_prime, mask, jnp.asarray(person), num_people


def person_removal_gaps(embed_fn: EmbedFn, params, loss, clip_norm: float, x, x_prime, user_ids, *,
                        mask=None, method: str = "ghost",
                        cosine_eps: float = numerics.DEFAULT_COSINE_EPS,
                        num_groups: int | None = None, group_seed: int = 0,
                        extra_views_fn: Callable | None = None, group_by: str | None = None,
                        positive_embed_fn: EmbedFn | None = None) -> np.ndarray:
  """gap_u = ‖ḡ(X) − ḡ(X without every pair of person u)‖₂ for every person u, as an (M,) array.

  A person is removed by masking out all of their rows, which removes their rows and columns
  of the similarity matrix (as deleting them does). user_ids: (n,) integer person of every row;
  people are numbered 0..M−1 in the order of their ids. method="dp_gcl" takes num_groups,
  group_seed, extra_views_fn and group_by: "person" (groups hash the person, as
  `make_private(user_ids=)` does) or "pair" (groups hash the row: a person's pairs can fall in
  several groups, the negative control). The other arguments are `removal_gaps`'s.
  """
  method, _, core, x, x_prime, mask, person, num_people = _person_setup(
      embed_fn, loss, clip_norm, x, x_prime, user_ids, mask, method, cosine_eps, num_groups,
      group_seed, extra_views_fn, group_by, positive_embed_fn)
  return np.asarray(_person_gaps_jit(core, params, x, x_prime, mask, person, num_people),
                    np.float64)


def _person_bounds(loss, clip_norm, method, n_valid, max_pairs):
  mechanism = mechanisms.Mechanism.of_method(method)
  k = max(max_pairs, 1)
  return (mechanism.sensitivity(loss, clip_norm, batch_size=max(n_valid, 2), max_pairs_per_user=k),
          mechanism.sensitivity(loss, clip_norm, batch_size=None, max_pairs_per_user=k))


def _person_result(gaps, loss, clip_norm, method, group_by, mask, person, params, x, x_prime,
                   user_ids) -> PersonRemovalAudit:
  gaps = np.asarray(gaps, np.float64)
  mask = np.asarray(mask)
  counts = np.bincount(np.asarray(person)[mask], minlength=gaps.shape[0])
  max_pairs = int(counts.max()) if counts.size else 0
  bound, bound_sup = _person_bounds(loss, clip_norm, method, int(mask.sum()), max_pairs)
  u = int(np.argmax(gaps))
  return PersonRemovalAudit(ratio=float(gaps[u] / bound), ratio_sup=float(gaps[u] / bound_sup),
                            max_gap=float(gaps[u]), worst_person=u, bound=bound,
                            bound_sup=bound_sup, max_pairs=max_pairs, gaps=gaps, method=method,
                            group_by=group_by, x=x, x_prime=x_prime, params=params,
                            user_ids=np.asarray(user_ids))


def max_person_removal_ratio(embed_fn: EmbedFn, params, loss, clip_norm: float, x, x_prime,
                             user_ids, *, mask=None, method: str = "ghost",
                             cosine_eps: float = numerics.DEFAULT_COSINE_EPS,
                             num_groups: int | None = None, group_seed: int = 0,
                             extra_views_fn: Callable | None = None, group_by: str | None = None,
                             positive_embed_fn: EmbedFn | None = None) -> PersonRemovalAudit:
  """max_u gap_u (`person_removal_gaps`) and its ratio to the per-person sensitivity.

  The bound is the one `make_private(user_ids=, max_pairs_per_user=K)` calibrates to, with K
  the most valid pairs of one person in X: Logit-DP `person_sensitivity(loss, B, K, n)`
  (``ratio``) and its supremum over n (``ratio_sup``); Naive-DP and DP-GCL 2B. For DP-GCL
  grouped by pair (group_by="pair") the 2B claim is false, and the audit shows it.
  """
  method, clip_norm, core, x, x_prime, mask, person, num_people = _person_setup(
      embed_fn, loss, clip_norm, x, x_prime, user_ids, mask, method, cosine_eps, num_groups,
      group_seed, extra_views_fn, group_by, positive_embed_fn)
  gaps = _person_gaps_jit(core, params, x, x_prime, mask, person, num_people)
  return _person_result(gaps, loss, clip_norm, method, group_by, mask, person, params, x, x_prime,
                        user_ids)


def adversarial_person_batch(key, user_ids, dim: int, *, spread: float = 1e-2,
                             scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """(x, x′) with every person's pairs near-identical: person u's anchors and positives are
  c_u + spread·noise around one centre c_u ~ N(0, scale²) (dimension ``dim``), so each of a
  person's positives is a hardest negative of the person's other anchors."""
  person, num_people = _people(user_ids, np.asarray(user_ids).shape[0])
  kc, kx, kxp = jax.random.split(key, 3)
  centres = scale * jax.random.normal(kc, (num_people, dim), jnp.float32)[person]
  x = centres + spread * scale * jax.random.normal(kx, centres.shape, jnp.float32)
  return x, x + spread * scale * jax.random.normal(kxp, centres.shape, jnp.float32)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _person_ascent(core, num_people, num_steps, learning_rate, params, x, x_prime, mask, person):
  """Adam ascent on (x, x′) of logsumexp_u log gap_u²; returns the best max_u gap_u² seen and
  its point (the first non-finite one, as +inf, if any)."""
  opt = optax.adam(learning_rate)

  def objective(v):
    sq = _person_gaps_fn(core, params, v["x"], v["x_prime"], mask, person, num_people)
    return jax.nn.logsumexp(jnp.where(sq > 0, jnp.log(sq + _TINY), -jnp.inf)), jnp.max(sq)

  def step(carry, _):
    v, state, best, best_v = carry
    (_, max_sq), g = jax.value_and_grad(objective, has_aux=True)(v)
    failed = ~jnp.isfinite(max_sq) & jnp.isfinite(best)
    better = failed | (jnp.isfinite(max_sq) & (max_sq > best))
    best_v = jax.tree_util.tree_map(lambda a, b: jnp.where(better, a, b), v, best_v)
    best = jnp.where(failed, jnp.inf, jnp.where(better, max_sq, best))
    g = jax.tree_util.tree_map(lambda t: jnp.where(jnp.isfinite(t), -t, 0.0), g)  # ascent
    updates, state = opt.update(g, state, v)
    return (optax.apply_updates(v, updates), state, best, best_v), None

  v0 = {"x": x, "x_prime": x_prime}
  (_, _, best, best_v), _ = jax.lax.scan(step, (v0, opt.init(v0), jnp.asarray(-1.0), v0), None,
                                         length=num_steps)
  return best, best_v


def search_worst_person_removal(embed_fn: EmbedFn, params, loss, clip_norm: float, user_ids, *,
                                dim: int, key, num_restarts: int = 4, num_steps: int = 30,
                                learning_rate: float = 0.05, method: str = "ghost",
                                cosine_eps: float = numerics.DEFAULT_COSINE_EPS,
                                num_groups: int | None = None, group_seed: int = 0,
                                group_by: str | None = None,
                                positive_embed_fn: EmbedFn | None = None) -> PersonRemovalAudit:
  """Searches for the batch maximising max_u gap_u / C_K: adversarial starts, then Adam.

  Restart r starts from `adversarial_person_batch` (every person's pairs near-identical, each
  other's hardest negatives; spread 10⁻² at scale 1, 0.1, 10 in turn, and on odd restarts the
  positives rolled by one row, so that a person's near-identical pairs sit off the diagonal)
  and runs ``num_steps`` Adam steps of ascent on logsumexp_u log(gap_u² + 10⁻³⁰) over the
  inputs (x, x′) of shape (n, dim). The best point is re-audited (`max_person_removal_ratio`).
  A search is a lower bound on the worst case, never a proof (docs/METHOD.md, "Privacy per
  person", holds the proofs).
  """
  if isinstance(num_restarts, bool) or int(num_restarts) != num_restarts or num_restarts < 1:
    raise ValueError(f"num_restarts must be an integer ≥ 1, got {num_restarts!r}.")
  if isinstance(num_steps, bool) or int(num_steps) != num_steps or num_steps < 1:
    raise ValueError(f"num_steps must be an integer ≥ 1, got {num_steps!r}.")
  x, x_prime = adversarial_person_batch(key, user_ids, dim)
  method, _, core, x, x_prime, mask, person, num_people = _person_setup(
      embed_fn, loss, clip_norm, x, x_prime, user_ids, None, method, cosine_eps, num_groups,
      group_seed, None, group_by, positive_embed_fn)
  best, best_point = -1.0, (x, x_prime)
  for r in range(int(num_restarts)):
    scale = _RESTART_SCALES[r % len(_RESTART_SCALES)]
    x0, xp0 = adversarial_person_batch(jax.random.fold_in(key, r), user_ids, dim, scale=scale)
    if r % 2 == 1:
      xp0 = jnp.roll(xp0, 1, axis=0)
    value, v = _person_ascent(core, num_people, int(num_steps), float(learning_rate), params, x0,
                              xp0, mask, person)
    value = float(value)
    if not math.isfinite(value) or value > best:
      best, best_point = value, (v["x"], v["x_prime"])
    if not math.isfinite(best):
      break
  return max_person_removal_ratio(embed_fn, params, loss, clip_norm, best_point[0], best_point[1],
                                  user_ids, method=method, cosine_eps=cosine_eps,
                                  num_groups=num_groups, group_seed=group_seed, group_by=group_by,
                                  positive_embed_fn=positive_embed_fn)

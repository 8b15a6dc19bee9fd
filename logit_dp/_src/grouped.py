"""DP-GCL: private contrastive learning by bounding group-level contribution.

The grouped baseline of Li, Gong, Lin, Wang & Xiao, "Differentially Private Contrastive
Learning via Bounding Group-level Contribution" (arXiv:2604.26467, 2026), implemented
from its description. Every record r of a batch (a pair (x_r, x'_r), optionally with k
extra augmented views w_r1..w_rk of its own data) belongs to one group g(r) ∈ {0..G−1}.
The contrastive loss of an anchor only sees the records of its own group:

    ℓ_i = −Z_ii/τ + log( Σ_{j∈g(i)} e^{Z_ij/τ} + Σ_{j∈g(i), j≠i} Σ_m e^{⟨û_i, ŵ_jm⟩/τ} ),

Z_ij = ⟨û_i, v̂_j⟩ (normalised embeddings as in `logit_dp.clipped_grad`), so the extra views
of the other members are extra negatives (a record's own views are not its negatives).
With L_g = Σ_{i∈g} ℓ_i the released gradient is

    ḡ = Σ_g min(1, B/‖∇_w L_g‖)·∇_w L_g,

each GROUP's gradient clipped to B. Its L2 sensitivity under adding or removing one record
is 2B (`grouped_sensitivity`), provided the groups are assigned by `assign_groups`: a keyed
hash of the record id, so that a record's group does not depend on which other records
were sampled. Chunking the sampled batch by position is NOT valid: removing one record
shifts every later record into another group (docs/METHOD.md, "DP-GCL").

Formal guarantees. Neighbouring relation: add or remove one record (with its extra
views, which are functions of the record and of public randomness only) under Poisson
sampling, the relation of `logit_dp.accounting`. For fixed parameters w, group key and G,
let S be a sampled batch and S' = S ∪ {r}. With groups from `assign_groups`, S and S'
have the same groups except g(r), which gains r. Every other L_g is a function of its own
members only, so ḡ(S') − ḡ(S) = clip(∇L_{g(r)}(S')) − clip(∇L_{g(r)}(S)), and both terms
have norm ≤ B: ‖ḡ(S') − ḡ(S)‖₂ ≤ 2B. Adding N(0, (σ·2B)²I) is then the Poisson-subsampled
Gaussian mechanism with noise multiplier σ that `logit_dp.accounting` accounts for.
Two towers (positive_embed_fn: v̂_r = n(Φ'(x'_r))) change nothing in this argument: L_g still
reads w and its own members' records only, so the sensitivity is the same 2B
(docs/METHOD.md, "DP-GCL").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from logit_dp._src import checks
from logit_dp._src import chunking
from logit_dp._src import clip_stats
from logit_dp._src import collective as collective_lib
from logit_dp._src import finetune
from logit_dp._src import grad_fn as grad_fn_lib
from logit_dp._src import group_norms
from logit_dp._src import layerwise
from logit_dp._src import losses as losses_lib
from logit_dp._src import mechanisms
from logit_dp._src import numerics
from logit_dp._src import pair_batch
from logit_dp._src import plan_report
from logit_dp._src import precision
from logit_dp._src import rows as rows_lib
from logit_dp._src import sensitivity as sensitivity_lib
from logit_dp._src import stochastic as stochastic_lib
from logit_dp._src import two_tower

EmbedFn = Callable[[Any, jax.Array], jax.Array]
_HIGHEST = jax.lax.Precision.HIGHEST

#: grad_fn(params, x, x_prime, mask=None, *, record_ids, group_key, extra_views=None) -> (ℒ, ḡ),
#: as built by `grouped_clipped_grad`: a `ClippedGradFn` of `Mechanism.DP_GCL`. Its ``core(params,
#: x, x_prime, mask, group_ids, extra_views) -> (ℒ, ḡ, n_nonfinite)`` is the jitted body without
#: input checks, taking the group ids directly (the guarantee needs them from `assign_groups`).
GroupedGradFn = grad_fn_lib.ClippedGradFn


def check_num_groups(num_groups) -> int:
  """num_groups as an int if a positive integer (G ≥ 1); ValueError otherwise."""
  if isinstance(num_groups, bool) or not isinstance(num_groups,
                                                    (int, np.integer)) or num_groups < 1:
    raise ValueError(f"num_groups must be an integer ≥ 1, got {num_groups!r}.")
  return int(num_groups)


def num_groups_for(expected_batch_size: float, group_size) -> int:
  """G = max(1, round(E[n] / s)) for the expected group size s > 0; ValueError otherwise."""
  if group_size is None:
    raise ValueError("method='dp_gcl' needs group_size= (the expected records per group).")
  if isinstance(group_size, bool) or not isinstance(group_size,
                                                    (int, float, np.integer, np.floating)):
    raise ValueError("group_size must be a number > 0 (the expected records per DP-GCL group), "
                     f"got {group_size!r}.")
  if not 0 < float(group_size) < float("inf"):
    raise ValueError(f"group_size must be a finite number > 0, got {group_size!r}.")
  return max(1, int(round(float(expected_batch_size) / float(group_size))))


def assign_groups(record_ids: jax.Array, key: jax.Array, num_groups: int) -> jax.Array:
  """g(r) = a uniform integer in [0, G) drawn from fold_in(key, r), for every record id r.

  A keyed hash of the record id alone (threefry, as every JAX key derivation): the group of
  a record is the same whichever other records are in the batch, so adding or removing a
  record changes only its own group. The key must not depend on the data (e.g.
  fold_in(public_key, step) to regroup every step); it need not be secret.

  Args:
    record_ids: (n,) non-negative integer ids of the records (the sampler's indices).
    key: a JAX PRNG key.
    num_groups: G ≥ 1.

  Returns:
    (n,) int32 group ids.
  """
  g = check_num_groups(num_groups)
  ids = jnp.asarray(record_ids)
  if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"record_ids must be a 1-D integer array, got shape {ids.shape}, dtype "
                     f"{ids.dtype}.")
  ids = ids.astype(jnp.uint32)
  draw = lambda r: jax.random.randint(jax.random.fold_in(key, r), (), 0, g, dtype=jnp.int32)
  return jax.vmap(draw)(ids)


grouped_sensitivity = sensitivity_lib.grouped_sensitivity


def grouped_contrastive_row_losses(u: jax.Array, v: jax.Array, w: jax.Array | None,
                                   valid: jax.Array, group_ids: jax.Array,
                                   temperature: float) -> jax.Array:
  """ℓ_i of every valid row (0 elsewhere): InfoNCE over the own group's positives v̂_j and the
  other members' extra views ŵ_jm; u, v: (n, d), w: (n, k, d) or None, all normalised."""
  n = u.shape[0]
  same = (group_ids[:, None] == group_ids[None, :]) & valid[:, None] & valid[None, :]
  logits = jnp.matmul(u, v.T, precision=_HIGHEST) / temperature
  columns = [(logits, same)]
  if w is not None and w.shape[1]:
    view_logits = jnp.einsum("id,jmd->ijm", u, w, precision=_HIGHEST).reshape(n, -1) / temperature
    others = same & ~jnp.eye(n, dtype=bool)
    columns.append((view_logits, jnp.repeat(others, w.shape[1], axis=1)))
  all_logits = jnp.concatenate([c[0] for c in columns], axis=1)
  ok = jnp.concatenate([c[1] for c in columns], axis=1)
  safe = jnp.where(ok, all_logits, 0.0)
  row_max = jax.lax.stop_gradient(jnp.max(jnp.where(ok, all_logits, -jnp.inf), axis=1))
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  total = jnp.sum(jnp.where(ok, jnp.exp(safe - row_max[:, None]), 0.0), axis=1)
  log_norm = jnp.log(jnp.where(total > 0, total, 1.0)) + row_max
  return jnp.where(valid, log_norm - jnp.diagonal(jnp.where(same, logits, 0.0)), 0.0)


def _finite_rows(*arrays) -> jax.Array:
  ok = [jnp.all(jnp.isfinite(a).reshape(a.shape[0], -1), axis=1) for a in arrays]
  return functools.reduce(jnp.logical_and, ok)


def _zero_rows(ok, a):
  return jnp.where(ok.reshape((-1,) + (1,) * (a.ndim - 1)), a, jnp.zeros_like(a))


def _flat_size(plan, params) -> int:
  """q: the flat columns (flattened layers and generic leaves) of a plan's factors."""
  columns = two_tower.flat_columns(plan, jax.tree_util.tree_leaves(params))
  return max([stop for _, stop in columns.values()], default=0)


def _embed_rows(embed_fn, params, xs, eps, chunk):
  """n(Φ(x)) for the rows of xs, microbatch by microbatch: (n, d)."""
  n = rows_lib.num_rows(xs)
  if chunk is None or chunk >= n:
    return numerics.normalize(embed_fn(params, xs), eps)
  return chunking.unchunk_rows(
      chunking.map_chunks(lambda rows: numerics.normalize(embed_fn(params, rows), eps), (xs,),
                          chunk), n)


def grouped_clipped_grad(embed_fn: EmbedFn, loss, clip_norm: float, num_groups: int, *,
                         microbatch_size: int | None = None,
                         cosine_eps: float = numerics.DEFAULT_COSINE_EPS,
                         positive_embed_fn: EmbedFn | None = None, stochastic: bool = False,
                         axis_name: str | None = None, trainable: Any = None) -> GroupedGradFn:
  """Builds grad_fn(params, x, x_prime, mask=None, *, record_ids, group_key, extra_views=None).

  grad_fn returns (ℒ, ḡ) with ℒ = Σ_g L_g and ḡ = Σ_g min(1, B/‖∇_w L_g‖)·∇_w L_g, a SUM
  over the G groups of `assign_groups(record_ids, group_key, G)` (see the module docstring
  for L_g). Its L2 sensitivity under adding or removing one record is
  `grouped_sensitivity(B)` = 2B, with one tower or two; noise it with `logit_dp.transform`.

  Computation (docs/METHOD.md, "DP-GCL"): one forward pass for the loss and the cotangents
  c_e = ∂ℒ/∂ê_e of every example e (anchor û_r, positive v̂_r, extra view ŵ_rm; each embedding
  enters only its own group's loss, so these are the group losses' cotangents). Then ONE
  backward pass of the scalar Σ_e ⟨c_e, ê_e⟩ (through that forward pass's residuals; with
  microbatching, a forward and a backward pass per microbatch) gives the per-example factors of
  J_eᵀc_e
  (`group_norms.weighted_factors`: a ghost layer's input patches a_et and w_et = Σ_k c_ek δ_et^k,
  other parameters' columns flat_e = J_eᵀc_e), and with ∇L_g = Σ_{e∈g} J_eᵀc_e

      ‖∇L_g‖² = Σ_{ghost layers} Σ_{e,e'∈g} Σ_{t,s} ⟨a_et, a_e's⟩⟨w_et, w_e's⟩ + ‖Σ_{e∈g} flat_e‖²,

  each ghost layer's term by the cheaper of the within-group Gram and the group's materialised
  layer gradient (`group_norms.group_sq_norms`: groups gathered into slots, a few groups at a
  time). Finally ḡ = Σ_e J_eᵀ(min(1, B/‖∇L_g(e)‖)·c_e), contracted from the same factors
  (`layerwise.factors_transpose`). No (G, p) array is formed: memory is that of the factors
  (O(n(2 + k)·Σ_layers T(P + C)) plus flat columns) and one step of the group loop. The norm
  used for clipping is raised by float allowances scaled to the computation's dtype
  (`numerics.gram_error`, `numerics.vector_error`) times S_g = Σ_{e∈g} ‖J_eᵀc_e‖, so the released
  group gradients stay ≤ B in float32 (tested against float64 on near-identical records) and in
  float64 ḡ is the per-group `jax.grad` truth to < 10⁻¹⁰ relative (tested).

  Formal guarantees. ḡ is the clipped sum of the module docstring, whose 2B argument is
  unchanged: each group's term is its own gradient scaled by min(1, B/N_g) with N_g ≥ ‖∇L_g‖
  (the computed norm raised by the float allowances), so it has norm ≤ B, and it reads only the
  group's own members. With axis_name the norms and ḡ are those of the global batch on every
  device (the same mechanism for any device count); the noise is added once, afterwards, by
  `logit_dp.transform` on the replicated ḡ.

  Args:
    embed_fn: embed_fn(params, x) -> (n, d), acting on examples independently.
    loss: `logit_dp.losses.contrastive(τ)` (the group loss is its InfoNCE restricted to the
      group; other losses raise ValueError).
    clip_norm: B > 0 (finite: this is a DP method).
    num_groups: G ≥ 1, the number of hash buckets; the expected group size is E[n]/G and
      group sizes are random (Binomial). G = 1 without extra views is Naive-DP.
    microbatch_size: examples per chunk of the embeddings and of the Jacobian factors.
    cosine_eps: ε of the cosine similarity n(u) = u/√(‖u‖² + ε²).
    positive_embed_fn: two towers (dual encoder), as in `logit_dp.clipped_grad`: x_prime is
      embedded by positive_embed_fn(params, x_prime) -> (n, d), x by embed_fn, params one
      pytree holding both towers; x and x_prime may be pytrees (e.g. token ids and a mask).
      v̂_r = n(Φ'(x'_r)) and p_r takes J'_r from that tower; the sensitivity is the same 2B
      (docs/METHOD.md, "DP-GCL"). Extra views are one tower's (ValueError with two).
    stochastic: embed_fn (and positive_embed_fn) is embed_fn(params, x, key) (dropout) and
      grad_fn takes key=, as in `logit_dp.clipped_grad`: x_r, x'_r and extra view m of record
      r (row r of the batch) are embedded alone with fold_in(fold_in(key, v), r) for
      v = 0, 1 and 3 + m, in every pass.
    axis_name: call inside `jax.shard_map` over this mesh axis with the batch (and the group
      ids, extra views) split along it (`distributed.make_sharded_grad_fn(method="dp_gcl")`):
      the loss spans the global batch (embeddings all-gathered), every device computes the
      norms of its share of the groups from the gathered factors, and ḡ is the psum of each
      device's contraction of its own examples, the single-device ḡ.
    trainable: fine-tuning, as in `logit_dp.clipped_grad`: the group norms ‖∇_{w_T} L_g‖ and ḡ
      are those of the model with the frozen leaves closed over, ḡ exactly zero at them; the
      same 2B.

  grad_fn's mask is an optional (n,) boolean: False rows are padding and contribute exactly
  nothing. record_ids: (n,) integer ids of the records (unique among valid rows; the
  sampler's indices). group_key: the JAX key of the assignment (public, data-independent).
  user_ids: optional (n,) integer person of every row: the groups are then
  `assign_groups(user_ids, group_key, G)`, every record of a person in one group, so adding or
  removing a person (all of their records) changes one group: sensitivity 2B per person
  (docs/METHOD.md, "Privacy per person").
  extra_views: optional (n, k, ...) extra augmented views of each record (same example
  shape as x; one tower only). Called eagerly, grad_fn raises ValueError when a valid record
  has non-finite inputs or embeddings; under jit such records are dropped (the same as
  removing them). ``grad_fn.with_stats`` returns (ℒ, ḡ, `ClipStats`) over the norms
  ‖∇_w L_g‖ of the groups with a valid record (NON-PRIVATE diagnostics).
  """
  if trainable is not None:

    def build(e, pe):
      return grouped_clipped_grad(e, loss, clip_norm, num_groups, microbatch_size=microbatch_size,
                                  cosine_eps=cosine_eps, positive_embed_fn=pe,
                                  stochastic=stochastic, axis_name=axis_name)

    return finetune.restrict(build, embed_fn, positive_embed_fn, stochastic, trainable)
  if not isinstance(loss, losses_lib.Contrastive):
    raise ValueError(f"grouped_clipped_grad needs logit_dp.losses.contrastive(τ), got {loss!r}: "
                     "its group loss is InfoNCE over the group's members and extra views.")
  bound = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=False)
  num_groups = check_num_groups(num_groups)
  checks.check_microbatch(microbatch_size)
  checks.check_positive_embed_fn(positive_embed_fn)
  stochastic = stochastic_lib.check_stochastic(stochastic)
  stochastic_lib.check_signature(embed_fn, stochastic)
  group_norms.check_factor_fields()
  temperature = float(loss.temperature)
  two_towers = positive_embed_fn is not None and positive_embed_fn is not embed_fn

  def body(params, x, x_prime, mask, group_ids, extra_views, with_stats, key):
    # Low-precision models are evaluated in float32, as in clipped_grad (`precision`).
    params, x, x_prime, extra_views = precision.widen((params, x, x_prime, extra_views))
    if two_towers and extra_views is not None:
      raise ValueError("extra_views are augmented views embedded by the one tower; with two "
                       "towers (positive_embed_fn=) pass extra_views=None.")
    c = collective_lib.Collective(axis_name)
    params = c.local_params(params)
    n = rows_lib.num_rows(x)  # this device's records
    # view after view, each like x
    views = [] if extra_views is None else [extra_views[:, m] for m in range(extra_views.shape[1])]
    k = len(views)
    inputs_ok = rows_lib.finite_rows(x) & rows_lib.finite_rows(x_prime)
    for view in views:
      inputs_ok = inputs_ok & rows_lib.finite_rows(view)
    x, x_prime = rows_lib.where_rows(inputs_ok, x), rows_lib.where_rows(inputs_ok, x_prime)
    views = [rows_lib.where_rows(inputs_ok, view) for view in views]
    fn = positive_fn = embed_fn
    if two_towers:
      positive_fn = cast(EmbedFn, positive_embed_fn)
    if key is not None:  # every example with its own key (`stochastic`), in every pass
      impl = stochastic_lib.key_impl(key)
      fn = stochastic_lib.PerExample(cast(stochastic_lib.StochasticEmbedFn, embed_fn), impl)
      positive_fn = fn if not two_towers else stochastic_lib.PerExample(
          cast(stochastic_lib.StochasticEmbedFn, positive_embed_fn), impl)
      rows = c.local_rows(n)  # the rows of the global batch: the keys of one device
      x = stochastic_lib.attach(x, key, stochastic_lib.VIEW_X, rows)
      x_prime = stochastic_lib.attach(x_prime, key, stochastic_lib.VIEW_X_PRIME, rows)
      views = [stochastic_lib.attach(view, key, 3 + m, rows) for m, view in enumerate(views)]
    # The examples by embedding function: one part (all views of one tower stacked) or two.
    if not two_towers and all(rows_lib.same_layout(x, a) for a in [x_prime] + views):
      plan = layerwise.make_plan(fn, params, x, 1, layerwise.keeps_group_factors)
      towers = [(fn, plan, [x, x_prime] + views)]
      columns = [np.arange(_flat_size(plan, params))]
    else:
      plans = two_tower.tower_plans(fn, positive_fn, params, x, x_prime, 1,
                                    layerwise.keeps_group_factors)
      towers = [(fn, plans.anchor, [x] + views), (positive_fn, plans.positive, [x_prime])]
      columns = list(group_norms.flat_columns_map(plans, params))
    # A one-time warning for a large leaf on the jax.jacrev route (`describe_plan`).
    plan_report.warn_slow_leaves(plan_report.report(tuple(plan for _, plan, _ in towers), params,
                                                    1))
    # finishers[i](cotangents of part i) -> the part's weighted factors.
    if microbatch_size is None:  # the factors' forward pass gives the embeddings: one pass
      staged = [
          group_norms.weighted_forward(f, params, plan, pair_batch.join_views(xs), cosine_eps,
                                       c.local_params) for f, plan, xs in towers
      ]
      embedded = [
          list(pair_batch.split_views(u_part, len(xs)))
          for (u_part, _), (_, _, xs) in zip(staged, towers)
      ]
      split = len(towers) == 2  # x' in a part of its own
      u, w = embedded[0][0], embedded[0][1 if split else 2:]
      v = embedded[1][0] if split else embedded[0][1]
      finishers = [finish for _, finish in staged]
    else:  # microbatch by microbatch: a forward pass for the embeddings, one with the factors
      embed = lambda f, xs: _embed_rows(f, params, xs, cosine_eps, microbatch_size)
      u, v = embed(fn, x), embed(positive_fn, x_prime)
      w = [embed(fn, view) for view in views]
      finishers = [
          functools.partial(group_norms.weighted_factors, f, params, plan,
                            pair_batch.join_views(xs), eps=cosine_eps,
                            microbatch_size=microbatch_size, varying=c.local_params)
          for f, plan, xs in towers
      ]
    ok = inputs_ok & _finite_rows(u, v, *w)
    valid_local = mask & ok
    num_nonfinite = jnp.sum(c.gather(mask & ~ok))
    u, v = _zero_rows(ok, u), _zero_rows(ok, v)
    w = [_zero_rows(ok, view) for view in w]
    # The loss spans the global batch (gathered over the devices of a mesh).
    valid = c.gather(valid_local)
    groups = jnp.where(valid, c.gather(group_ids), num_groups).astype(jnp.int32)
    w_all = jnp.stack(c.gather(w), axis=1) if k else None

    def total_loss(u, v, w):
      loss_groups = jnp.where(valid, groups, 0)
      return jnp.sum(grouped_contrastive_row_losses(u, v, w, valid, loss_groups, temperature))

    loss_value, cots = jax.value_and_grad(total_loss, argnums=(0, 1, 2) if k else
                                          (0, 1))(c.gather(u), c.gather(v), w_all)
    here = c.local_rows(n)
    cot_u, cot_v = cots[0][here], cots[1][here]
    cot_w = [cots[2][here, m] for m in range(k)]

    cotangents = [[cot_u] + cot_w, [cot_v]] if len(towers) == 2 else [[cot_u, cot_v] + cot_w]
    parts = [
        group_norms.Part(plan, finish(jnp.concatenate(cot)), len(xs), part_columns)
        for finish, (_, plan, xs), cot, part_columns in zip(finishers, towers, cotangents, columns)
    ]

    # ‖∇L_g‖² of every group: each device those of its share of the groups, from the factors
    # of the global batch.
    share = -(-num_groups // c.size())
    gathered = [part._replace(factors=c.gather(part.factors)) for part in parts]
    dtype = parts[0].factors.gram.dtype
    sq = group_norms.group_sq_norms(gathered, groups, share, n, first_group=c.index() * share,
                                    dtype=dtype, total_groups=num_groups)
    sq = c.gather(sq)[:num_groups]
    # Float allowance (docs/METHOD.md, "DP-GCL"): S_g = Σ_{e∈g} ‖J_eᵀc_e‖ bounds the terms
    # whose rounding the norm and ḡ carry; the allowances scale to the computation's dtype.
    local_groups = jnp.where(valid_local, group_ids, num_groups).astype(jnp.int32)
    sizes = sum(
        group_norms.group_sums(jnp.sqrt(jnp.maximum(part.factors.gram[:, 0, 0], 0.0)),
                               group_norms.example_groups(local_groups, part.views), num_groups)
        for part in parts)
    sizes = c.psum(sizes)
    norm_dtype = numerics.lowest_precision(
        [u.dtype, dtype]
        + [numerics.computation_dtype(f, params, rows_lib.first_row(xs[0])) for f, _, xs in towers])
    norms = (jnp.sqrt(jnp.maximum(sq, 0.0) + numerics.gram_error(norm_dtype) * sizes ** 2)
             + numerics.vector_error(norm_dtype) * sizes)
    factor = numerics.clip_factor(norms, bound)

    # ḡ = Σ_g factor_g ∇L_g = Σ_e J_eᵀ(factor_{g(e)} c_e): the weighted factors contracted.
    leaves, treedef = jax.tree_util.tree_flatten(params)
    weights, keeps = [], []
    for part in parts:
      example_group = group_norms.example_groups(local_groups, part.views)
      weight = jnp.where(example_group < num_groups,
                         factor[jnp.minimum(example_group, num_groups - 1)], 0.0)
      weights.append(weight[:, None].astype(dtype))
      keeps.append(weight != 0)
    grads = c.psum(
        jax.tree_util.tree_unflatten(treedef,
                                     group_norms.transpose_parts(parts, weights, keeps, leaves)))
    all_dropped = (num_nonfinite > 0) & ~jnp.any(valid)
    loss_value = c.replicated(jnp.where(all_dropped, jnp.nan, loss_value))
    if with_stats:  # the norms of the groups with a valid record
      members = group_norms.group_sums(valid.astype(jnp.int32), groups, num_groups)
      stats = clip_stats.summarize(norms, members > 0, bound, jnp.sum(valid, dtype=jnp.int32),
                                   num_nonfinite)
      return loss_value, grads, jax.tree_util.tree_map(c.replicated, stats)
    return loss_value, grads, c.replicated(num_nonfinite)

  def core(params, x, x_prime, mask, group_ids, extra_views, key=None):
    return body(params, x, x_prime, mask, group_ids, extra_views, False, key)

  def stats_core(params, x, x_prime, mask, group_ids, extra_views, key=None):
    return body(params, x, x_prime, mask, group_ids, extra_views, True, key)

  def check_inputs(params, x, x_prime, mask=None, *, record_ids, group_key, extra_views=None,
                   key=None, user_ids=None):
    key = stochastic_lib.check_key(key, stochastic, "grouped_clipped_grad")
    x, x_prime, mask = checks.check_pair_inputs(x, x_prime, mask, loss.min_batch_size)
    ids = _check_record_ids(record_ids, mask, rows_lib.num_rows(x))
    if extra_views is not None and not two_towers:  # two towers: the core refuses them
      extra_views = _check_extra_views(extra_views, x)
    # Per person: the groups hash the person, so all of a person's records share one group.
    by = ids if user_ids is None else _check_user_ids(user_ids, mask, rows_lib.num_rows(x))
    groups = assign_groups(by, group_key, num_groups)
    return (params, x, x_prime, mask, groups, extra_views) + ((key,) if stochastic else ())

  def check_model(params, x, x_prime, mask, groups, extra_views, key=None):
    del mask, groups, extra_views
    checks.check_towers(embed_fn, positive_embed_fn, params, x, x_prime, key)

  return grad_fn_lib.ClippedGradFn(
      core=jax.jit(numerics.full_float32(core)), check_inputs=check_inputs, check_model=check_model,
      mechanism=mechanisms.Mechanism.DP_GCL, clip_norm=bound, loss=loss, num_groups=num_groups,
      description="grouped_clipped_grad", unit="record(s)",
      stats_core=jax.jit(numerics.full_float32(stats_core)), stochastic=stochastic)


def _check_ids(name: str, ids, mask, n: int, unique: bool, what: str) -> jax.Array:
  """ids as a (n,) integer array, ≥ 0 on the valid rows (and unique there if `unique`)."""
  ids = jnp.asarray(ids)
  if ids.shape != (n,) or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array of shape ({n},){what}, got shape "
                     f"{ids.shape}, dtype {ids.dtype}.")
  if not rows_lib.is_traced((ids, mask)):
    valid_ids = np.asarray(ids)[np.asarray(mask)]
    if valid_ids.size and valid_ids.min() < 0:
      raise ValueError(f"{name} must be ≥ 0.")
    if unique and len(np.unique(valid_ids)) != valid_ids.size:
      raise ValueError(f"{name} of the valid rows must be unique: a record is sampled at most "
                       "once per batch.")
  return ids


def _check_record_ids(record_ids, mask, n: int) -> jax.Array:
  if record_ids is None:
    raise ValueError("record_ids is required: groups are a hash of the record id (a group by "
                     "position in the batch is not private, see docs/METHOD.md).")
  return _check_ids("record_ids", record_ids, mask, n, unique=True, what="")


def _check_user_ids(user_ids, mask, n: int) -> jax.Array:
  return _check_ids("user_ids", user_ids, mask, n, unique=False, what=", the person of every row")


def _check_extra_views(extra_views, x) -> jax.Array:
  if isinstance(extra_views, (dict, list, tuple)) or not hasattr(extra_views, "shape"):
    raise ValueError("extra_views must be one array of shape (n, k, ...), got "
                     f"{type(extra_views).__name__}.")
  views = jnp.asarray(extra_views)
  if views.ndim != x.ndim + 1 or views.shape[0] != x.shape[0] or views.shape[2:] != x.shape[1:]:
    raise ValueError(f"extra_views must have shape ({x.shape[0]}, k) + {tuple(x.shape[1:])}, "
                     f"got {views.shape}.")
  return views

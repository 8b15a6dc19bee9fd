"""Logit-DP clipped gradients (and the Naive-DP baseline): the public builders.

Notation. A batch is n pairs (x_i, x'_i). Embeddings are normalised,
û_i = n(Φ_w(x_i)), v̂_j = n(Φ_w(x'_j)) with n(u) = u/√(‖u‖² + ε²) (`numerics`), and
Z_ij = ⟨û_i, v̂_j⟩ is their cosine similarity. With τ_ij = ∂ℒ/∂Z_ij and pair gradients
g_ij = ∇_w Z_ij,

    ḡ = Σ_ij λ_ij g_ij,   λ_ij = τ_ij · min(1, B/‖g_ij‖)

is the SUM of clipped, loss-weighted pair gradients (not a mean). Its
sensitivity is `logit_dp.sensitivity(loss, B)`. Once λ is known,
ḡ = ∇_w Σ_ij λ_ij Z_ij(w) with λ held fixed: one backward pass with cotangents
∂/∂û_i = Σ_j λ_ij v̂_j and ∂/∂v̂_j = Σ_i λ_ij û_i (`pair_batch.PairBatch.weighted_backward`;
"ghost" contracts its per-example Jacobian factors with them instead).

How ‖g_ij‖ is found is the clip method (`methods`: "ghost", "triangle", "projected",
"materialize"), resolved once from its name into a `methods.ClipMethod`. Two towers (dual
encoders, `positive_embed_fn=`): x_prime is embedded by its own function of the same params;
the batch's plans (`two_tower`) say which parameters both towers share, and each method
handles them.

Requirement: embed_fn must treat examples independently (no batch norm); the
per-example Jacobians and pair gradients assume it. A stochastic embed_fn(params, x, key)
(dropout) is declared with stochastic=True: every example is embedded with its own key
(`stochastic`), the same in every pass.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from logit_dp._src import checks
from logit_dp._src import clip_stats
from logit_dp._src import collective as collective_lib
from logit_dp._src import finetune
from logit_dp._src import grad_fn as grad_fn_lib
from logit_dp._src import grouped
from logit_dp._src import mechanisms
from logit_dp._src import methods
from logit_dp._src import numerics
from logit_dp._src import pair_batch
from logit_dp._src import precision
from logit_dp._src import rows as rows_lib
from logit_dp._src import sensitivity as sensitivity_lib
from logit_dp._src import stochastic as stochastic_lib

DEFAULT_COSINE_EPS = numerics.DEFAULT_COSINE_EPS


def build_grad_fn(core, embed_fn: checks.EmbedFn, loss, clip_norm: float,
                  mechanism: mechanisms.Mechanism, clip_method: methods.ClipMethod | None,
                  description: str, axis_name: str | None = None,
                  positive_embed_fn: checks.EmbedFn | None = None, stats_core=None,
                  stochastic: bool = False) -> grad_fn_lib.ClippedGradFn:
  """The `ClippedGradFn` of a (params, x, x_prime, mask[, key]) -> (ℒ, ḡ, n_nonfinite) core:
  jitted, with the pair inputs checked (`checks.check_pair_inputs`; the batch size over every
  shard of axis_name; key= required exactly when stochastic, `stochastic.check_key`) and the
  towers checked on first use (`checks.check_towers`). stats_core: the same arguments ->
  (ℒ, ḡ, `ClipStats`), jitted separately (None: no statistics)."""
  min_batch_size = getattr(loss, "min_batch_size", 1)
  stochastic = stochastic_lib.check_stochastic(stochastic)
  stochastic_lib.check_signature(embed_fn, stochastic)
  if positive_embed_fn is not None:
    stochastic_lib.check_signature(positive_embed_fn, stochastic, "positive_embed_fn")

  def check_inputs(params, x, x_prime, mask=None, *, key=None):
    key = stochastic_lib.check_key(key, stochastic, description)
    num_shards = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    x, x_prime, mask = checks.check_pair_inputs(x, x_prime, mask, min_batch_size, num_shards)
    return (params, x, x_prime, mask) + ((key,) if stochastic else ())

  def check_model(params, x, x_prime, mask, key=None):
    del mask
    checks.check_towers(embed_fn, positive_embed_fn, params, x, x_prime, key)

  return grad_fn_lib.ClippedGradFn(core=jax.jit(core), check_inputs=check_inputs,
                                   check_model=check_model, mechanism=mechanism,
                                   clip_norm=clip_norm, loss=loss, clip_method=clip_method,
                                   description=description,
                                   stats_core=None if stats_core is None else jax.jit(stats_core),
                                   stochastic=stochastic)


def clipped_grad(embed_fn: checks.EmbedFn, loss, clip_norm: float,
                 method: str | methods.ClipMethod = "ghost", *, microbatch_size: int | None = None,
                 axis_name: str | None = None, cosine_eps: float = numerics.DEFAULT_COSINE_EPS,
                 positive_embed_fn: checks.EmbedFn | None = None, stochastic: bool = False,
                 float64_positive_pairs: bool = True, trainable: Any = None,
                 **deprecated_options) -> grad_fn_lib.ClippedGradFn:
  """Builds grad_fn(params, x, x_prime, mask=None) -> (ℒ, ḡ) for Logit-DP.

  ḡ = Σ_ij τ_ij·min(1, B/‖∇_w Z_ij‖)·∇_w Z_ij, a pytree like params; it is a SUM
  over the n² pairs, with L2 sensitivity `logit_dp.sensitivity(loss, B)` under
  add-or-remove-one pair. Noise it with `logit_dp.transform`.

  Args:
    embed_fn: embed_fn(params, x) -> (n, d), acting on examples independently.
    loss: a loss from `logit_dp.losses` (any loss(Z, mask) works for the
      gradient, but only those have a known sensitivity).
    clip_norm: B > 0; jnp.inf disables clipping (ḡ = ∇ℒ, not private).
    method: a clip method (`logit_dp.clip_methods`): an object holding its options, e.g.
      ``clip_methods.Ghost(memory_budget=1 << 30)`` or
      ``clip_methods.Projected(reference_inputs=public_x)``, or the name of a registered
      method for its default object: "ghost" (exact pair norms from per-example Jacobians,
      the default), "materialize" (Algorithm 1, n² backward passes: the reference),
      "triangle" (clips by an upper bound of the pair norm: cheaper, private, clips more
      than needed) or "projected" (needs its reference inputs: pass the object).
    microbatch_size: process examples in chunks of this size (forward,
      Jacobians, backward) to bound memory. The pair matrix still spans the
      whole batch, so every negative is kept and the noise, added once to ḡ,
      is unchanged: this is gradient accumulation without changing the mechanism.
    axis_name: call inside `jax.shard_map` over this mesh axis with the batch
      split across devices; the pair matrix spans the global batch and every
      device returns the same global (ℒ, ḡ).
    cosine_eps: ε of the cosine similarity n(u) = u/√(‖u‖² + ε²).
    positive_embed_fn: two towers (dual encoder, CLIP-style): x_prime is
      embedded by positive_embed_fn(params, x_prime) -> (n, d), x by embed_fn;
      params is one pytree holding both towers. Towers that share no parameter
      (found by tracing which leaves each output depends on) get exact pair
      norms at the cost of "triangle" (the cross term is 0); shared parameters
      use the general computation. Same sensitivity as one tower.
    stochastic: embed_fn (and positive_embed_fn) is embed_fn(params, x, key) -> (n, d),
      drawing its randomness (dropout, stochastic depth) from key; grad_fn then takes
      key= (required): a fresh key at every step, independent of the noise key, never
      released. Example i of view v (0: x, 1: x_prime) is embedded alone with
      fold_in(fold_in(key, v), i), i its row in the global batch, in every pass; the
      sensitivity and the accounting are unchanged (docs/PRIVACY.md).
    float64_positive_pairs: form the norms of the n positive pairs (x_i, x'_i) by one
      backward pass each with params and inputs widened to float64, rounded up to
      float32 (`pair_terms.diagonal_norms`; convolutions run as matrix products, which
      XLA:CPU runs fast in float64). Near-identical views, whose pair gradients nearly
      cancel, are clipped by norms within 1e-6 of the truth. False forms them in float32
      first and those whose float32 allowance could put them above 1.10× their truth again
      in float64 (`pair_terms.diagonal_values`). "ghost" does the latter either way, its
      float32 vectors contracted from its Jacobian factors; two towers ("ghost" and
      "triangle") form them in float64 either way, in the loop that forms their flagged
      pairs again. A model that fixes
      its own computation dtype (e.g. flax's dtype=jnp.float32) keeps it, with the
      allowance of that dtype; stochastic models keep theirs (their random draws would
      differ), and the allowance e·(s_i + s'_i) can then be ~100× such a pair's norm.
    trainable: fine-tuning (`logit_dp.finetune`): a pytree of bools with the structure of
      params (or a prefix of it, as optax.multi_transform's labels) or a predicate
      ``(path, leaf) -> bool``; the frozen leaves (False) are closed over, so the pair norms
      and ḡ are those of the model of the trainable leaves alone, ḡ exactly zero at the frozen
      ones. Same sensitivity. None: every leaf is trained.
    **deprecated_options: memory_budget, pair_block_size, reference_inputs and
      projection_rank, the options of a method name from before the methods held them:
      deprecated (a DeprecationWarning), set them in the method object instead.

  grad_fn's mask is an optional (n,) boolean: False rows are padding and
  contribute exactly nothing. x and x_prime are arrays or pytrees of arrays
  (e.g. token ids and a padding mask) with the examples along axis 0 of every
  leaf, and the same number of examples.
  Called eagerly, grad_fn raises ValueError when any valid pair has non-finite
  inputs or embeddings; under jit it masks those pairs out (still private: it is
  the same as removing them). `grad_fn.with_num_dropped(...)` returns
  (ℒ, ḡ, num_dropped) with their number, and ℒ is NaN when every valid pair was
  dropped (e.g. NaN parameters), so a diverged run cannot look like loss 0. An eager call
  with a mask that is all False warns `EmptyBatchWarning` (ℒ = 0, ḡ = 0).
  `grad_fn.with_stats(...)` returns (ℒ, ḡ, `ClipStats`): the number and fraction of valid
  pairs (i, j) whose norm exceeded B, quantiles of the norms clipping used (allowances
  included), the valid and dropped rows. They are NON-PRIVATE diagnostics (computed from
  the batch without noise), compiled separately from the plain call, which does not keep them.
  grad_fn is a `ClippedGradFn`: ``grad_fn.sensitivity()`` is the C to noise ḡ with,
  ``grad_fn.mechanism`` is `Mechanism.LOGIT_DP` and ``grad_fn.clip_method`` the resolved
  method.

  Precision: grad_fn traces embed_fn and every contraction of the pair norms at
  `jax.default_matmul_precision("highest")`, whatever the ambient default, because
  the clip factors and ḡ come from different passes and TF32 (the GPU default for
  float32) would put each clipped pair gradient's norm off B by ~1e-3 relative.
  Layers constructed with an explicit `precision=` keep theirs.

  Mixed precision: bfloat16 or float16 params and inputs are widened to float32
  first (`precision.widen`); the pair gradients clipped, their norms and ḡ all come
  from that float32 evaluation of embed_fn, so every clipped term has norm ≤ B and
  ḡ has the sensitivity above. ḡ is returned in float32: add the noise to it
  there and cast the noisy update to the params' dtype afterwards (post-processing;
  `optax.apply_updates` does). Clip norms carry float allowances scaled to the
  unit roundoff of the lowest precision embed_fn computes in (float64 runs get
  float64's; docs/privacy_floating_point.md). Float64 arrays made while x64 was enabled and passed
  inside ``jax.enable_x64(False)`` are computed in float32, as jnp computes them there.

  Returns:
    A `ClippedGradFn`: grad_fn(params, x, x_prime, mask=None[, key=]) -> (ℒ, ḡ).
  """
  if trainable is not None:

    def build(e, pe):
      return clipped_grad(e, loss, clip_norm, method, microbatch_size=microbatch_size,
                          axis_name=axis_name, cosine_eps=cosine_eps, positive_embed_fn=pe,
                          stochastic=stochastic, float64_positive_pairs=float64_positive_pairs,
                          **deprecated_options)

    return finetune.restrict(build, embed_fn, positive_embed_fn, stochastic, trainable)
  if not isinstance(method, methods.ClipMethod):
    methods.check_name(method)
  clip_norm = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=True)
  checks.check_microbatch(microbatch_size)
  checks.check_positive_embed_fn(positive_embed_fn)
  stochastic_lib.check_stochastic(stochastic)
  clip = methods.resolve(method, embed_fn=embed_fn, positive_embed_fn=positive_embed_fn,
                         stacklevel=3, **deprecated_options)
  collective = collective_lib.Collective(axis_name)

  def body(params, x, x_prime, mask, with_stats, key):
    params, x, x_prime = precision.widen((params, x, x_prime))
    batch, loss_value, tau = pair_batch.forward(embed_fn, loss, params, x, x_prime, mask,
                                                cosine_eps, microbatch_size, collective,
                                                positive_embed_fn, key, float64_positive_pairs,
                                                clip.embeds_with_factors, clip.layer_factors)
    keyed_clip = clip.with_key(key)
    if with_stats:
      norms, grads = keyed_clip.norms_and_clipped_grad(batch, tau[batch.rows], clip_norm)
      return (collective.replicated(loss_value), grads,
              clip_stats.pair_stats(batch, norms, clip_norm))
    grads = keyed_clip.clipped_grad(batch, tau[batch.rows], clip_norm)
    return collective.replicated(loss_value), grads, collective.replicated(batch.num_nonfinite)

  core, stats_core = _cores(body)
  return build_grad_fn(core, embed_fn, loss, clip_norm, mechanisms.Mechanism.LOGIT_DP, clip,
                       f"clipped_grad({clip.name})", axis_name, positive_embed_fn, stats_core,
                       stochastic)


def _cores(body) -> tuple[Any, Any]:
  """(core, stats_core): body(params, x, x_prime, mask, with_stats, key) without and with the
  statistics, each traced at full float32 precision (`numerics.full_float32_precision`); key: the
  model's key of a stochastic embed_fn (None: deterministic)."""
  def core(params, x, x_prime, mask, key=None):
    with numerics.full_float32_precision():
      return body(params, x, x_prime, mask, False, key)

  def stats_core(params, x, x_prime, mask, key=None):
    with numerics.full_float32_precision():
      return body(params, x, x_prime, mask, True, key)

  return core, stats_core


def pair_grad_norms(embed_fn: checks.EmbedFn, params, x, x_prime,
                    method: str | methods.ClipMethod = "ghost", *,
                    microbatch_size: int | None = None,
                    cosine_eps: float = numerics.DEFAULT_COSINE_EPS, float_allowance: bool = True,
                    positive_embed_fn: checks.EmbedFn | None = None, key: Any = None,
                    float64_positive_pairs: bool = True, trainable: Any = None,
                    **deprecated_options) -> jax.Array:
  """The (n, n) matrix of the norms `clipped_grad` clips by: ‖∇_w Z_ij‖ ("ghost",
  "materialize"; "triangle", "projected": upper bounds off the diagonal, exact on it).

  Args:
    embed_fn: embed_fn(params, x) -> (n, d), as in `clipped_grad`.
    params: the parameters the norms are taken at.
    x: the first views, n examples along axis 0.
    x_prime: the second views, n examples along axis 0.
    method: a clip method (object or registered name), as in `clipped_grad`.
    microbatch_size: examples per chunk, as in `clipped_grad`.
    cosine_eps: ε of the cosine similarity, as in `clipped_grad`.
    float_allowance: include the float allowance that keeps every norm at or above the true
      norm (the default, what clipping uses; docs/privacy_floating_point.md); False returns
      the computed values without it (for comparing methods; never clip by them).
    positive_embed_fn: the tower of x_prime, as in `clipped_grad`.
    key: the key of a stochastic embed_fn(params, x, key) (as
      ``clipped_grad(..., stochastic=True)`` with this key); None: embed_fn(params, x).
    float64_positive_pairs: form the positive pairs' norms in float64, as in `clipped_grad`.
    trainable: fine-tuning, as in `clipped_grad`: the norms ‖∇_{w_T} Z_ij‖ of the model with
      the frozen leaves closed over (the norms `clipped_grad(..., trainable=)` clips by).
    **deprecated_options: the deprecated method keywords of `clipped_grad`.

  Returns:
    The (n, n) norms, row i for x_i and column j for x'_j.
  """
  if trainable is not None:
    trainable_part, frozen = finetune.partition(params, trainable)
    stochastic = key is not None
    closed_embed = finetune.closed(embed_fn, frozen, stochastic)
    assert closed_embed is not None  # embed_fn is not None
    return pair_grad_norms(closed_embed, trainable_part, x, x_prime, method,
                           microbatch_size=microbatch_size, cosine_eps=cosine_eps,
                           float_allowance=float_allowance,
                           positive_embed_fn=finetune.closed(positive_embed_fn, frozen,
                                                             stochastic), key=key,
                           float64_positive_pairs=float64_positive_pairs, **deprecated_options)
  if not isinstance(method, methods.ClipMethod):
    methods.check_name(method)
  checks.check_microbatch(microbatch_size)
  checks.check_positive_embed_fn(positive_embed_fn)
  clip = methods.resolve(method, embed_fn=embed_fn, positive_embed_fn=positive_embed_fn,
                         stacklevel=3, **deprecated_options)
  x, x_prime, _ = checks.check_pair_inputs(x, x_prime, None, 1)
  if key is not None:
    key = stochastic_lib.check_key(key, True, "pair_grad_norms")
  stochastic_lib.check_signature(embed_fn, key is not None)
  if positive_embed_fn is not None:
    stochastic_lib.check_signature(positive_embed_fn, key is not None, "positive_embed_fn")
  return _pair_grad_norms(embed_fn, params, x, x_prime, clip, microbatch_size, cosine_eps,
                          1.0 if float_allowance else 0.0, positive_embed_fn, key,
                          bool(float64_positive_pairs))


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8, 10))
@numerics.full_float32
def _pair_grad_norms(embed_fn, params, x, x_prime, clip, microbatch_size, cosine_eps, allowance,
                     positive_embed_fn, key, float64_positive_pairs):
  rows = jnp.arange(rows_lib.num_rows(x))
  embed_fn, positive_embed_fn, x, x_prime = stochastic_lib.bind(embed_fn, positive_embed_fn, key, x,
                                                                x_prime, rows)
  mask = jnp.ones((rows_lib.num_rows(x),), dtype=bool)
  params, x, x_prime = precision.widen((params, x, x_prime))
  batch = pair_batch.PairBatch(embed_fn, params, x, x_prime, mask, eps=cosine_eps,
                               microbatch_size=microbatch_size,
                               collective=collective_lib.Collective(None),
                               positive_embed_fn=positive_embed_fn,
                               float64_positive_pairs=float64_positive_pairs,
                               layer_factors=clip.layer_factors)
  return clip.with_key(key).pair_norms(batch, allowance)


def naive_clipped_grad(embed_fn: checks.EmbedFn, loss, clip_norm: float, *,
                       microbatch_size: int | None = None, axis_name: str | None = None,
                       cosine_eps: float = numerics.DEFAULT_COSINE_EPS,
                       positive_embed_fn: checks.EmbedFn | None = None, stochastic: bool = False,
                       trainable: Any = None) -> grad_fn_lib.ClippedGradFn:
  """Naive-DP: ḡ = ∇ℒ·min(1, B/‖∇ℒ‖), the whole-batch gradient clipped to B.

  Sensitivity 2B under add-or-remove-one (`logit_dp.baselines.naive_sensitivity`). Same
  signature and mask/axis/two-tower/stochastic/trainable semantics as `clipped_grad` (with
  trainable=, ‖∇ℒ‖ is ‖∇_{w_T} ℒ‖, the frozen leaves closed over), and the same
  precision: embed_fn and the backward pass are traced at
  `jax.default_matmul_precision("highest")`, so that ‖∇ℒ‖ and the clipped gradient agree on
  every backend. ``grad_fn.with_stats`` returns the `ClipStats` of its one norm ‖∇ℒ‖
  (NON-PRIVATE).
  """
  if trainable is not None:

    def build(e, pe):
      return naive_clipped_grad(e, loss, clip_norm, microbatch_size=microbatch_size,
                                axis_name=axis_name, cosine_eps=cosine_eps, positive_embed_fn=pe,
                                stochastic=stochastic)

    return finetune.restrict(build, embed_fn, positive_embed_fn, stochastic, trainable)
  clip_norm = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=True)
  checks.check_microbatch(microbatch_size)
  checks.check_positive_embed_fn(positive_embed_fn)
  stochastic_lib.check_stochastic(stochastic)
  collective = collective_lib.Collective(axis_name)

  def body(params, x, x_prime, mask, with_stats, key):
    params, x, x_prime = precision.widen((params, x, x_prime))
    batch, loss_value, tau = pair_batch.forward(embed_fn, loss, params, x, x_prime, mask,
                                                cosine_eps, microbatch_size, collective,
                                                positive_embed_fn, key)
    grads = batch.weighted_backward(tau[batch.rows], tau)
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
    factor = numerics.clip_factor(norm, clip_norm)
    clipped = jax.tree_util.tree_map(lambda g: jnp.where(factor > 0, g * factor, 0.0), grads)
    loss_value = collective.replicated(loss_value)
    if with_stats:  # one norm, ‖∇ℒ‖, counted when the batch has a valid pair
      num_valid = jnp.sum(batch.valid, dtype=jnp.int32)
      stats = clip_stats.summarize(norm, num_valid > 0, clip_norm, num_valid, batch.num_nonfinite)
      return loss_value, clipped, jax.tree_util.tree_map(collective.replicated, stats)
    return loss_value, clipped, collective.replicated(batch.num_nonfinite)

  core, stats_core = _cores(body)
  return build_grad_fn(core, embed_fn, loss, clip_norm, mechanisms.Mechanism.NAIVE_DP, None,
                       "naive_clipped_grad", axis_name, positive_embed_fn, stats_core, stochastic)


def private_grad(embed_fn: checks.EmbedFn, loss, clip_norm: float,
                 method: str | methods.ClipMethod = "ghost", *, trainable: Any = None,
                 **kwargs) -> grad_fn_lib.ClippedGradFn:
  """`clipped_grad` with a clip method, `naive_clipped_grad` for method="naive" or
  `grouped_clipped_grad` for method="dp_gcl" (num_groups= in kwargs).

  method: a clip method (object or registered name) or "naive"
  (`mechanisms.check_private_method`); trainable: fine-tuning, as in `clipped_grad` (every
  mechanism: the frozen leaves are closed over); kwargs: the chosen builder's keywords.
  """
  if trainable is not None:

    def build(e, pe):
      return private_grad(e, loss, clip_norm, method, **dict(kwargs, positive_embed_fn=pe))

    return finetune.restrict(build, embed_fn, kwargs.get("positive_embed_fn"),
                             bool(kwargs.get("stochastic", False)), trainable)
  mechanism = mechanisms.Mechanism.of_method(mechanisms.check_private_method(method))
  if mechanism is mechanisms.Mechanism.NAIVE_DP:
    return naive_clipped_grad(embed_fn, loss, clip_norm, **kwargs)
  if mechanism is mechanisms.Mechanism.DP_GCL:
    if "num_groups" not in kwargs:
      raise ValueError("method='dp_gcl' needs num_groups= (G ≥ 1).")
    return grouped.grouped_clipped_grad(embed_fn, loss, clip_norm, kwargs.pop("num_groups"),
                                        **kwargs)
  return clipped_grad(embed_fn, loss, clip_norm, method, **kwargs)

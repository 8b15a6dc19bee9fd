"""The forward state of one gradient computation: `PairBatch`.

Embeddings are normalised, û_i = n(Φ_w(x_i)), v̂_j = n(Φ'_w(x'_j)) (Φ' = Φ with one tower),
Z_ij = ⟨û_i, v̂_j⟩ spans the global batch (gathered over the devices of a shard_map axis), and
the batch provides what every clip method builds on: the per-example Jacobian factors
(`layerwise`), backward passes Σ_e J_eᵀc_e, and ḡ = ∇_w Σ_ij λ_ij Z_ij(w) for fixed λ.

Requirement: embed_fn must treat examples independently (no batch norm); the
per-example Jacobians and pair gradients assume it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logit_dp._src import chunking
from logit_dp._src import layerwise
from logit_dp._src import numerics
from logit_dp._src import plan_report
from logit_dp._src import rows as rows_lib
from logit_dp._src import stochastic
from logit_dp._src import two_tower


class PairBatch:
  """The shared forward state of one gradient computation.

  Methods taking `positive=True` act on the tower of x_prime (`positive_embed_fn`); with one
  tower that is embed_fn itself.
  """
  def __init__(self, embed_fn, params, x, x_prime, mask, *, eps, microbatch_size, collective,
               positive_embed_fn=None, float64_positive_pairs: bool = True,
               embeds_with_factors: Callable[[PairBatch], bool] | None = None,
               layer_factors: bool = True):
    """embeds_with_factors(batch): whether the embeddings come from the passes that also
    compute the Jacobian factors of both views (`joint_factors`, for the clip method that
    contracts them; asked when one tower embeds views of one layout, and for two towers).
    Otherwise (and when None) the embeddings come from a forward pass of their own and
    `joint_factors` is None.
    layer_factors: False: the model is used as it is, with no layer recognised
    (`layerwise.jacobian_plan`; the reference method's batch)."""
    self.embed_fn, self.params, self.eps = embed_fn, params, eps
    self.layer_factors = layer_factors
    self.float64_positive_pairs = float64_positive_pairs
    self.two_tower = positive_embed_fn is not None and positive_embed_fn is not embed_fn
    self.positive_embed_fn: Callable = (positive_embed_fn if self.two_tower
                                        and positive_embed_fn is not None else embed_fn)
    self.microbatch_size, self.c = microbatch_size, collective
    n_local = rows_lib.num_rows(x)
    inputs_ok = rows_lib.finite_rows(x) & rows_lib.finite_rows(x_prime)
    # Zero non-finite inputs so that their NaNs cannot reach the backward pass.
    self.x, self.x_prime = rows_lib.where_rows(inputs_ok,
                                               x), rows_lib.where_rows(inputs_ok, x_prime)
    # The factors of both views from the passes that gave the embeddings, or None: one tower,
    # stacked along a leading axis of 2; two towers, (x's, x_prime's).
    self.joint_factors: Any = None
    # One tower and both views of one layout: the views stack into one batch.
    self.views_stack = not self.two_tower and rows_lib.same_layout(self.x, self.x_prime)
    if not self.views_stack:  # two embedding functions or input layouts: checked before any pass
      self._check_same_dimension()
    # 1. The plan: which parameters get per-layer factors, from the model traced at the batch's
    # shapes (both towers' plans; the same plan twice with one tower).
    self.tower_plans = self._make_plans()
    # The same functions, with the convolutions of their plans differentiated into channels-last
    # convolutions: JAX's own rule runs 4-50x slower inside the loops of microbatching and of
    # materialize on XLA:CPU (layers.conv.channels_last_conv). Factors intercept embed_fn
    # themselves.
    self._embed_fn = layerwise.with_recognised_layers(embed_fn, self.tower_plans.anchor)
    self._positive_fn = (layerwise.with_recognised_layers(
        self.positive_embed_fn, self.tower_plans.positive) if self.two_tower else self._embed_fn)
    # 2. The embeddings, from the passes that also give both views' factors when the clip method
    # contracts them, else from a forward pass of their own.
    if (self.two_tower or self.views_stack) and embeds_with_factors is not None and \
        embeds_with_factors(self):
      if self.two_tower:
        u_loc, f_u = self.factors(self.x, with_embeddings=True)
        v_loc, f_v = self.factors(self.x_prime, positive=True, with_embeddings=True)
        self.joint_factors = (f_u, f_v)
      else:
        (u_loc, v_loc), self.joint_factors = self.stacked_factors(
            (self.x, self.x_prime), self.microbatch_size, with_embeddings=True)
    elif not self.views_stack:
      u_loc, v_loc = self._embed(self.x), self._embed(self.x_prime, positive=True)
    else:  # both views as one batch: the forward pass is compiled once
      u_loc, v_loc = split_views(self._embed(join_views((self.x, self.x_prime))), 2)
    ok = inputs_ok & rows_lib.finite_rows(u_loc) & rows_lib.finite_rows(v_loc)
    self.u_loc, self.v_loc = rows_lib.where_rows(ok, u_loc), rows_lib.where_rows(ok, v_loc)
    self.rows = collective.local_rows(n_local)
    self.u, self.v = collective.gather(self.u_loc), collective.gather(self.v_loc)
    self.valid = collective.gather(mask & ok)
    self.num_nonfinite = jnp.sum(collective.gather(mask & ~ok))
    self.z = jnp.matmul(self.u, self.v.T, precision=numerics.HIGHEST)
    # 3. The dtype the float allowances are scaled to (`numerics.vector_error`): the lowest
    # precision among the embeddings and the values the forward passes of both views compute
    # (a backward pass computes in the dtypes of its forward pass), as DP-GCL's group norms.
    views = [(self.embed_fn, self.x)
            ] + ([] if self.views_stack else [(self.positive_embed_fn, self.x_prime)])
    self.norm_dtype: np.dtype = numerics.lowest_precision(
        [self.u_loc.dtype]
        + [numerics.computation_dtype(fn, self.params, rows_lib.first_row(x)) for fn, x in views])

  def _check_same_dimension(self) -> None:
    """ValueError unless x and x_prime embed into one dimension (from their shapes; nothing
    computed)."""
    positive = jax.eval_shape(self.positive_embed_fn, self.params, self.x_prime).shape[-1]
    if positive != self.embedding_dim:
      raise ValueError(f"embed_fn and positive_embed_fn must embed into the same dimension: "
                       f"embed_fn gives {self.embedding_dim}, positive_embed_fn {positive}.")

  def normalized_embedding(self, params, x_one, positive: bool = False) -> jax.Array:
    """n(Φ_w(x)) of one example x_one (no batch axis) at params, (d,)."""
    fn = self._positive_fn if positive else self._embed_fn
    return numerics.normalize(
        fn(params, jax.tree_util.tree_map(lambda a: a[None], x_one))[0], self.eps)

  @functools.cached_property
  def positive_pairs(self) -> Any:
    """The n pairs (x_i, x'_i) as one input with the examples along axis 0, one element of
    which `pair_grad` takes: with one tower and views of one layout, both views stacked
    (n, 2, ...) per leaf; otherwise the tuple (x, x')."""
    return self.pairs(self.x, self.x_prime)

  def pairs(self, x_rows, x_prime_columns) -> Any:
    """The pairs (x_e, x'_e) of equally many examples of each view, in the layout of
    `positive_pairs` (an element of it is what `pair_grad` takes)."""
    if self.views_stack:
      return jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b], axis=1), x_rows, x_prime_columns)
    return x_rows, x_prime_columns

  @functools.cached_property
  def pairs_in_float64(self) -> bool:
    """Whether pair gradients formed as vectors may be evaluated in float64: not for a model
    that draws random numbers (under float64 its draws, e.g. dropout masks, would not be those
    of the rest of the computation)."""
    return not stochastic.is_stochastic(self.embed_fn, self.positive_embed_fn)

  def pair_grad(self, params, pair) -> Any:
    """g = ∇_w Z(w) = ∇_w⟨n(Φ_w(x)), n(Φ'_w(x'))⟩ of one pair (an element of
    `positive_pairs`, no example axis), like params.

    With one tower and views of one layout, x and x' are embedded as one batch of two: one
    forward and one backward pass of the model to compile instead of two, with the cotangents
    of the cosine in closed form (`numerics.pair_cosine_cotangents`).
    """
    if self.views_stack:
      e, vjp_fn = jax.vjp(lambda p: self._embed_fn(p, pair), params)
      return vjp_fn(numerics.pair_cosine_cotangents(e, self.eps))[0]
    x_one, x_prime_one = pair
    z = lambda p: jnp.dot(self.normalized_embedding(p, x_one),
                          self.normalized_embedding(p, x_prime_one, positive=True), precision=
                          numerics.HIGHEST)
    return jax.grad(z)(params)

  @functools.cached_property
  def embedding_dim(self) -> int:
    """d, the dimension embed_fn embeds into (from its shapes; nothing is computed)."""
    return jax.eval_shape(self.embed_fn, self.params, self.x).shape[-1]

  def _embed(self, xs, positive: bool = False):
    return rows_lib.map_rows(lambda xe: self.normalized_embedding(self.params, xe, positive), xs,
                             self.microbatch_size)

  def _make_plans(self) -> two_tower.TowerPlans:
    """The plans of both towers (`two_tower.tower_plans`; one tower: its plan twice), with the
    one-time warning of `plan_report.warn_slow_leaves` for a large leaf on the slow path."""
    if self.two_tower and self.layer_factors:
      plans = two_tower.tower_plans(self.embed_fn, self.positive_embed_fn, self.params, self.x,
                                    self.x_prime, self.embedding_dim)
      plan_report.warn_slow_leaves(
          plan_report.report((plans.anchor, plans.positive), self.params, self.embedding_dim,
                             frozenset(plans.shared)))
      return plans
    if self.layer_factors:
      plan = layerwise.make_plan(self.embed_fn, self.params, self.x, self.embedding_dim)
      plan_report.warn_slow_leaves(plan_report.report((plan,), self.params, self.embedding_dim))
    else:
      plan = layerwise.jacobian_plan(self.params)
    return two_tower.TowerPlans(plan, plan, tuple(sorted(two_tower.dependencies(plan))))

  @property
  def plan(self) -> layerwise.Plan:
    """The plan of embed_fn's tower (`tower_plans.anchor`)."""
    return self.tower_plans.anchor

  def _plan_of(self, positive: bool) -> layerwise.Plan:
    return self.tower_plans.positive if positive and self.two_tower else self.plan

  def _generic_jacobian(self, indices, xs, positive: bool = False):
    """Per-example Jacobians w.r.t. the leaves `indices` (jacrev per example): (m, d, q)."""
    leaves, treedef = jax.tree_util.tree_flatten(self.params)

    def one(x_one):
      def embed(selected):
        params = layerwise.replace_leaves(leaves, treedef, indices, selected)
        return self.normalized_embedding(params, x_one, positive)

      jac = jax.jacrev(embed)([leaves[i] for i in indices])
      return jnp.concatenate([j.reshape(j.shape[0], -1) for j in jac], axis=1)

    return jax.vmap(one)(xs)

  def factors(self, xs, chunked: bool = True, positive: bool = False, chunk: int | None = None,
              with_embeddings: bool = False) -> Any:
    """Per-example Jacobian factors of one view (see layerwise), microbatch by microbatch
    (chunk examples at a time if given; chunked=False: xs in one piece, for callers that
    chunk themselves); with_embeddings: (normalised embeddings (m, d), factors), the
    embeddings those of the factors' own forward pass."""
    plan = self._plan_of(positive)
    embed_fn = self.positive_embed_fn if positive else self.embed_fn

    def chunk_factors(x_chunk):
      return layerwise.layer_factors(
          embed_fn, self.params, plan, x_chunk, lambda e: numerics.normalize(e, self.eps),
          lambda indices: self._generic_jacobian(indices, x_chunk, positive), self.c.local_params,
          with_embeddings=with_embeddings)

    m, n = chunk or self.microbatch_size, rows_lib.num_rows(xs)
    if not chunked or m is None or m >= n:
      return chunk_factors(xs)
    return chunking.unchunk_rows(chunking.map_chunks(chunk_factors, (xs,), m), n)

  def stacked_factors(self, views, chunk: int | None = None, with_embeddings: bool = False) -> Any:
    """`factors` of equally many examples of several views of this tower (e.g. (x, x')),
    stacked along a leading axis: (views, m, ...) (with_embeddings: (the views' embeddings,
    each (m, d), the stacked factors)). The views are joined into one batch
    (examples are independent): one pass, compiled once, and no loop over the views, whose
    stacking of the outputs XLA would compile as kernels of its own."""
    xs, k = join_views(views), len(views)
    if not with_embeddings:
      return split_views(self.factors(xs, chunk=chunk), k)
    embeddings, factors = self.factors(xs, chunk=chunk, with_embeddings=True)
    return tuple(split_views(embeddings, k)), split_views(factors, k)

  def _selected_backward(self, xs, cot, positive: bool = False):
    """Σ_e J_eᵀ cot_e with examples whose cotangent is 0 contributing exactly 0."""
    def one(xe, ce):
      _, vjp = jax.vjp(lambda p: self.normalized_embedding(p, xe, positive), self.params)
      keep = jnp.any(ce != 0)
      return jax.tree_util.tree_map(lambda g: jnp.where(keep, g, jnp.zeros_like(g)), vjp(ce)[0])

    return jax.tree_util.tree_map(lambda g: jnp.sum(g, axis=0), jax.vmap(one)(xs, cot))

  def _backward_pass(self, xs, cot, positive: bool = False):
    """Σ_e J_eᵀ cot_e by backward passes, microbatch by microbatch.

    Each microbatch is embedded in one call (examples are independent): a vmap over examples
    would batch the convolutions' custom backward pass into grouped convolutions (~4x slower).
    """
    fn = self._positive_fn if positive else self._embed_fn

    def chunk_grad(x_chunk, cot_chunk):
      embed = lambda p: numerics.normalize(fn(p, x_chunk), self.eps)
      _, vjp = jax.vjp(embed, self.params)
      return finite_or(
          vjp(cot_chunk)[0], lambda: self._selected_backward(x_chunk, cot_chunk, positive))

    m = self.microbatch_size
    if m is None or m >= rows_lib.num_rows(xs):
      return chunk_grad(xs, cot)
    # Padded examples have zero cotangents and add exactly 0.
    return jax.tree_util.tree_map(lambda g: jnp.sum(g, axis=0),
                                  chunking.map_chunks(chunk_grad, (xs, cot), m))

  def factor_backward(self, factors: layerwise.Factors, cot, positive: bool = False,
                      stacked: bool = False) -> Any:
    """Σ_e J_eᵀ cot_e contracted from the examples' Jacobian factors.

    stacked: factors and cot hold several views of this tower along a leading axis,
    (views, m, ...); the result is the sum over the views, contracted as one batch of
    views·m examples (compiled once).
    Examples whose cotangent is 0 have their factors *selected* to 0 inside the contraction
    (`layerwise.factors_transpose`'s keep), so that a non-finite Jacobian of a masked or
    dropped example adds exactly 0 (0·NaN is NaN). The selection is elementwise on the
    contraction's operands: no backward pass is redone and no fallback is compiled.
    """
    leaves, treedef = jax.tree_util.tree_flatten(self.params)
    plan = self._plan_of(positive)

    def transpose(f, c, keep=None):
      return jax.tree_util.tree_unflatten(treedef,
                                          layerwise.factors_transpose(plan, f, c, leaves, keep))

    if stacked:
      factors, cot = jax.tree_util.tree_map(
          lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), (factors, cot))
    return transpose(factors, cot, jnp.any(cot != 0, -1))

  def weighted_backward(self, lam_local_rows: jax.Array, lam_full: jax.Array, factors=None) -> Any:
    """∇_w Σ_ij λ_ij Z_ij(w) for fixed λ, summed over devices.

    = Σ_i J_iᵀ(Σ_j λ_ij v̂_j) + Σ_j J'_jᵀ(Σ_i λ_ij û_i): one backward pass per view, or, given
    the Jacobian factors (f_u, f_v) of the local examples of both views (two towers), their
    contraction. Either way an example whose cotangent is 0 contributes exactly 0. (One-tower
    "ghost" contracts its factors block by block instead: `methods.ghost.ghost_blocks`.)
    """
    cot_u = jnp.matmul(lam_local_rows, self.v, precision=numerics.HIGHEST)
    cot_v = jnp.matmul(lam_full[:, self.rows].T, self.u, precision=numerics.HIGHEST)
    if factors is None:
      anchor = self._backward_pass(self.x, cot_u)
      positive = self._backward_pass(self.x_prime, cot_v, positive=True)
    else:
      anchor = self.factor_backward(factors[0], cot_u)
      positive = self.factor_backward(factors[1], cot_v, positive=True)
    grads = (anchor, positive)
    return self.c.psum(jax.tree_util.tree_map(jnp.add, *grads))


def join_views(views) -> Any:
  """Equally many examples of several views (arrays or pytrees) as one batch, view after view."""
  return jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *views)


def split_views(tree, k: int) -> Any:
  """Results of a `join_views` batch of k views back per view: leaves (k·m, ...) -> (k, m, ...)."""
  # The explicit size, not -1: a zero-size leaf (no flattened parameters) cannot infer it.
  return jax.tree_util.tree_map(lambda a: a.reshape((k, a.shape[0] // k) + a.shape[1:]), tree)


def finite_or(grads, redo) -> Any:
  """grads if all of it is finite, else redo(): the recomputation in which every example with
  a zero cotangent is *selected* out.

  A non-finite Jacobian times a zero cotangent is NaN, not 0: that would release whether a
  dropped or masked example is present. Selecting inside a backward pass of the model means
  one pass per example (~10x on CPU), so it is redone only when something is not finite (the
  sums are otherwise the same). (The contraction of Jacobian factors selects directly:
  `PairBatch.factor_backward`.)
  """
  leaves = jax.tree_util.tree_leaves(grads)
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves]))
  return jax.lax.cond(finite, lambda: grads, redo)


def forward(embed_fn, loss, params, x, x_prime, mask, eps, microbatch_size, collective,
            positive_embed_fn=None, key=None, float64_positive_pairs: bool = True,
            embeds_with_factors=None,
            layer_factors: bool = True) -> tuple[PairBatch, jax.Array, jax.Array]:
  """(batch, ℒ, τ): embeddings, the loss on the global Z and τ_ij = ∂ℒ/∂Z_ij (0 off valid pairs).

  key: a stochastic embed_fn(params, x, key): the batch embeds every example with its own key
  (`stochastic.bind`, rows numbered over the global batch); None: embed_fn(params, x).
  float64_positive_pairs: form the positive pairs' norms in float64 (`pair_terms.diagonal_norms`).
  embeds_with_factors, layer_factors: as in `PairBatch` (the clip method's
  `embeds_with_factors` and `layer_factors`).
  """
  params = collective.local_params(params)
  embed_fn, positive_embed_fn, x, x_prime = stochastic.bind(
      embed_fn, positive_embed_fn, key, x, x_prime, collective.local_rows(rows_lib.num_rows(x)))
  batch = PairBatch(embed_fn, params, x, x_prime, mask, eps=eps, microbatch_size=microbatch_size,
                    collective=collective, positive_embed_fn=positive_embed_fn,
                    float64_positive_pairs=float64_positive_pairs,
                    embeds_with_factors=embeds_with_factors, layer_factors=layer_factors)
  loss_value, tau = jax.value_and_grad(loss)(batch.z, batch.valid)
  tau = jnp.where(batch.valid[:, None] & batch.valid[None, :], tau, 0.0)
  # Every valid pair dropped as non-finite (e.g. NaN parameters): the loss is NaN, not the
  # loss of an empty batch, so that a diverged run cannot log 0.0 forever.
  all_dropped = (batch.num_nonfinite > 0) & ~jnp.any(batch.valid)
  loss_value = jnp.where(all_dropped, jnp.nan, loss_value)
  return batch, loss_value, tau

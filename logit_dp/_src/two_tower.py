"""Two-tower (dual-encoder) models: û_i = n(Φ_w(x_i)), v̂_j = n(Φ'_w(x'_j)), and which
parameters the towers share.

One params pytree w holds both towers. With J_i = ∂û_i/∂w and J'_j = ∂v̂_j/∂w,

    g_ij = J_iᵀv̂_j + J'_jᵀû_i,
    ‖g_ij‖² = v̂_jᵀK_i v̂_j + û_iᵀK'_j û_i + 2 v̂_jᵀ J_i J'_jᵀ û_i,

and the cross term only involves the parameters S that both towers depend on: a leaf
outside S has a zero column in J_i or in J'_j. Which leaves each tower depends on comes
from the plans (`layerwise.make_plan`: a conservative data-flow walk over the traced
jaxpr, so a leaf is left out only if the output provably does not depend on it). Every
layer owning a leaf of S is flattened in both plans (`tower_plans`), so the columns of S sit
in both towers' flat Jacobians, leaf by leaf in the same order (`shared_columns`); a layer of
one tower only enters no cross term, so it keeps its factors where its per-example Gram is
cheaper from them (`layerwise.use_ghost_alone`). One tower
is the case S = every leaf, anchor plan = positive plan. The pair norms of two towers are
`methods.towers.pair_norms`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from logit_dp._src import checks
from logit_dp._src import layerwise


class TowerPlans(NamedTuple):
  """Plans of the anchor tower (x) and the positive tower (x'), and the leaves they share."""
  anchor: layerwise.Plan
  positive: layerwise.Plan
  shared: tuple[int, ...]  # float leaves both towers' outputs depend on


def dependencies(plan: layerwise.Plan) -> frozenset:
  """Float leaves the planned embedding depends on (factored by a layer, or generic)."""
  return plan.factored_leaves | frozenset(plan.generic)


def _tower_plan(plan: layerwise.Plan, shared: frozenset, d: int, keep_factors) -> layerwise.Plan:
  """plan with every layer that owns one of the `shared` leaves flattened (its cross terms are
  over flat columns); keep_factors None: every other layer by `layerwise.use_ghost_alone` (no
  cross term involves it, only its Gram), else as planned."""
  ghost = tuple(not frozenset(layer.leaves) & shared and (
      layerwise.use_ghost_alone(layer, d) if keep_factors is None else is_ghost)
                for layer, is_ghost in zip(plan.layers, plan.ghost))
  return plan._replace(ghost=ghost)


def tower_plans(embed_fn, positive_embed_fn, params, x, x_prime, d: int,
                keep_factors=None) -> TowerPlans:
  """Plans of both towers (keep_factors: as in `layerwise.make_plan`, None: see `_tower_plan`);
  the layers owning shared leaves are flattened in both."""
  anchor = layerwise.make_plan(embed_fn, params, x, d, keep_factors)
  positive = layerwise.make_plan(positive_embed_fn, params, x_prime, d, keep_factors)
  shared = dependencies(anchor) & dependencies(positive)
  return TowerPlans(_tower_plan(anchor, shared, d, keep_factors),
                    _tower_plan(positive, shared, d, keep_factors), tuple(sorted(shared)))


def flat_columns(plan: layerwise.Plan, leaves) -> dict[int, tuple[int, int]]:
  """leaf index -> (start, stop) of its columns in Factors.flat, in the leaf's own order.

  Mirrors `layerwise.layer_factors` / `factors_transpose`: flattened layers first (kernel,
  then the bias row), then the generic leaves.
  """
  columns, offset = {}, 0
  for layer, is_ghost in zip(plan.layers, plan.ghost):
    if is_ghost:
      continue
    kernel_size = int(np.size(leaves[layer.leaves[0]]))
    columns[layer.leaves[0]] = (offset, offset + kernel_size)
    if len(layer.leaves) > 1:
      columns[layer.leaves[1]] = (offset + kernel_size, offset + kernel_size + layer.features)
    offset += layer.fan_in * layer.features
  for i in plan.generic:
    columns[i] = (offset, offset + int(np.size(leaves[i])))
    offset += int(np.size(leaves[i]))
  return columns


def shared_columns(plans: TowerPlans, params) -> tuple[np.ndarray, np.ndarray]:
  """Column indices of the shared leaves in the anchor's and the positive tower's flat
  Jacobians, aligned entry by entry (same leaf, same element)."""
  leaves = jax.tree_util.tree_leaves(params)
  anchor, positive = flat_columns(plans.anchor, leaves), flat_columns(plans.positive, leaves)
  cols_u, cols_v = [], []
  for i in plans.shared:
    if i not in anchor or i not in positive:  # cannot happen: shared leaves are flattened
      raise RuntimeError(f"logit_dp: shared leaf {i} has no flat columns in both towers.")
    cols_u.append(np.arange(*anchor[i]))
    cols_v.append(np.arange(*positive[i]))
  if not cols_u:
    return np.zeros((0,), np.int32), np.zeros((0,), np.int32)
  return np.concatenate(cols_u), np.concatenate(cols_v)


def shared_parameters(embed_fn, positive_embed_fn, params, x, x_prime) -> list[str]:
  """Key paths of the parameter leaves both towers' outputs depend on (traced, conservative).

  Empty: the towers are disjoint and `clipped_grad(..., positive_embed_fn=)` clips exact
  pair norms at the cost of "triangle". x, x_prime: example inputs (a few rows suffice).
  """
  x, x_prime, _ = checks.check_pairs(x, x_prime)
  d = int(embed_fn(params, x).shape[-1])
  anchor = layerwise.make_plan(embed_fn, params, x, d)
  positive = layerwise.make_plan(positive_embed_fn, params, x_prime, d)
  paths = [
      jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  return [paths[i] for i in sorted(dependencies(anchor) & dependencies(positive))]

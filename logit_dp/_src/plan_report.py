"""How the engine computes each parameter's per-pair gradient norms: `describe_plan`, and the
one-time warning when a large parameter takes the slow path.

Every float parameter leaf the embedding depends on takes one of these routes
(`layerwise.make_plan`):

* ``ghost``: a recognised layer (dense / DenseGeneral / einsum, convolution, embedding
  lookup) whose pair terms are contracted from its factors (inputs a_t and output
  cotangents δ_t over T positions): T²P + k(2TCd + T²C) multiply-adds per pair;
* ``flattened``: a recognised layer whose per-example Jacobian is formed from the same factors
  (Σ_t a_t ⊗ δ_t) and enters the flat cross terms: 2d·P·C per pair (`layerwise.flat_cross`);
* ``elementwise``: a scale or shift of the activations (LayerNorm/RMSNorm scale and bias,
  learned positions, a class token), its per-example Jacobian a segment sum of δ at its use
  (no extra backward pass); 2d·size per pair in the flat cross terms;
* ``jacrev``: any other use, per-example Jacobians by `jax.jacrev` (exact for every JAX
  operation, but d extra backward passes of the model per example: the slow path);
* ``unused``: the embedding does not depend on it (no cost, zero gradient).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np

from logit_dp._src import checks
from logit_dp._src import layerwise
from logit_dp._src import two_tower

#: A parameter leaf of at least this many floats on the jacrev route warns once.
SLOW_LEAF_WARN_SIZE = 4096

_warned: set = set()


@dataclasses.dataclass(frozen=True)
class LeafRoute:
  """One parameter leaf: its key path, size, route and estimated cost per pair."""
  path: str
  size: int
  route: str  # "ghost", "flattened", "elementwise", "jacrev", "unused" or "not float"
  detail: str  # e.g. "dense, T=16, P=65, C=64"
  # The cost model per pair of the norms' cross terms, in matmul multiply-adds (the layer's, for a
  # layer: `layerwise.LayerCall.pair_cost`, which weighs the slower forms' multiply-adds).
  pair_cost: float


@dataclasses.dataclass(frozen=True)
class PlanReport:
  """The routes of every parameter leaf (`describe_plan`); ``str(report)`` is a table."""
  leaves: tuple[LeafRoute, ...]
  embedding_dim: int
  method: str = "ghost"  # whose routes: a pair clip method's, or "dp_gcl"'s group norms

  @property
  def slow(self) -> tuple[LeafRoute, ...]:
    """The leaves on the jacrev route."""
    return tuple(leaf for leaf in self.leaves if leaf.route == "jacrev")

  def __str__(self) -> str:
    width = max([len(leaf.path) for leaf in self.leaves] + [9])
    lines = [f"{'parameter':<{width}}  {'size':>9}  {'route':<11}  {'per pair':>10}  detail"]
    for leaf in self.leaves:
      cost = f"{leaf.pair_cost:10.3g}" if leaf.pair_cost else f"{'':>10}"
      lines.append(
          f"{leaf.path:<{width}}  {leaf.size:>9,}  {leaf.route:<11}  {cost}  {leaf.detail}")
    total = sum(leaf.pair_cost for leaf in self.leaves)
    cost = (f"estimated cost per pair (d = {self.embedding_dim}, matmul multiply-adds): {total:.3g}"
            if self.method != "dp_gcl" else "DP-GCL's group norms: no pair terms")
    lines.append(f"{cost}; on the slow jacrev route: {len(self.slow)} leaf(s), "
                 f"{sum(leaf.size for leaf in self.slow):,} floats")
    return "\n".join(lines)


def _routes(plan: layerwise.Plan, leaves, d: int) -> dict[int, tuple[str, str, float]]:
  routes = {}
  for layer, ghost in zip(plan.layers, plan.ghost):
    detail = (f"{layer.kind}, T={layer.positions}, P={layer.fan_in}, C={layer.features}" +
              ("" if len(layer.leaves) == 1 else ", with its bias"))
    cost = layer.pair_cost(d, ghost)
    for k, i in enumerate(layer.leaves):
      routes[i] = ("ghost" if ghost else "flattened", detail if k == 0 else "bias of the layer",
                   cost if k == 0 else 0.0)
  kinds = {}
  for site in plan.sites:
    kinds.setdefault(site.leaf, set()).add(site.kind)
  for i in plan.generic:
    size = int(np.size(leaves[i]))
    if i in kinds:
      routes[i] = ("elementwise", " and ".join(sorted(kinds[i])), layerwise.flat_pair_cost(size, d))
    else:
      routes[i] = ("jacrev", "per-example jax.jacrev: d backward passes per example",
                   layerwise.flat_pair_cost(size, d))
  return routes


def _merge(first, second):
  """The route of a leaf in two towers' plans: the slower one (jacrev > flattened > ...)."""
  order = ["unused", "elementwise", "ghost", "flattened", "jacrev"]
  if first is None:
    return second
  if second is None:
    return first
  return max(first, second, key=lambda r: order.index(r[0]))


def report(plans: tuple[layerwise.Plan, ...], params, d: int,
           shared: frozenset | None = None) -> PlanReport:
  """The `PlanReport` of the plans of one model: one tower's plan, or both towers' with the
  leaves they share (only those have cross-pair terms; the others cost per-example Grams)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  leaves = [leaf for _, leaf in flat]
  routes: dict = {}
  for plan in plans:
    for i, route in _routes(plan, leaves, d).items():
      routes[i] = _merge(routes.get(i), route)
  if shared is not None:
    for i, (route, detail, _) in list(routes.items()):
      if i not in shared:
        routes[i] = (route, detail + "; one tower's only: no cross-pair term", 0.0)
  rows = []
  for i, (path, leaf) in enumerate(flat):
    size = int(np.size(leaf))
    if not layerwise.is_float(leaf):
      rows.append(
          LeafRoute(jax.tree_util.keystr(path), size, "not float", "not differentiated", 0.0))
      continue
    route, detail, cost = routes.get(i, ("unused", "the embedding does not depend on it", 0.0))
    rows.append(LeafRoute(jax.tree_util.keystr(path), size, route, detail, cost))
  return PlanReport(tuple(rows), d)


def warn_slow_leaves(plan_report: PlanReport) -> None:
  """Warns once per parameter path and size when a leaf of ≥ `SLOW_LEAF_WARN_SIZE` floats
  takes the jacrev route."""
  for leaf in plan_report.slow:
    key = (leaf.path, leaf.size)
    if leaf.size < SLOW_LEAF_WARN_SIZE or key in _warned:
      continue
    _warned.add(key)
    warnings.warn(
        f"logit_dp: parameter {leaf.path} ({leaf.size:,} floats) takes the slow path: its "
        "per-example Jacobians come from jax.jacrev (d backward passes per example), because "
        "it is used by an operation the engine does not factor. The norms stay exact. "
        "logit_dp.clip_methods.describe_plan(embed_fn, params, x) lists every parameter's "
        "route.", stacklevel=2)


def describe_plan(embed_fn, params, x, *, x_prime=None, positive_embed_fn=None,
                  method: str = "ghost") -> PlanReport:
  """How every parameter leaf's per-pair gradient norms are computed, and their estimated cost.

  Traces ``embed_fn(params, x)`` (and ``positive_embed_fn(params, x_prime)`` for two towers;
  x_prime defaults to x) without computing anything, and returns a `PlanReport`: per leaf
  its key path, size, route ("ghost", "flattened", "elementwise", "jacrev", "unused") and
  the estimated multiply-adds per pair of its norms' cross terms; ``print(report)`` shows a
  table. "jacrev" is the slow path. A few example rows of x suffice.

  method: "ghost", "triangle" or "projected" (one plan: the routes of these clip methods;
  "materialize" uses none of them, every pair gradient by its own backward pass), or
  "dp_gcl": the routes of DP-GCL's group norms (`baselines.grouped_clipped_grad`), where a
  layer stays as its factors ("ghost") when they hold at most 4 times the floats per example
  of its flattened gradient (`layerwise.keeps_group_factors`); they have no pair terms, so the
  costs are 0.
  """
  if method not in ("ghost", "triangle", "projected", "dp_gcl"):
    raise ValueError(f"describe_plan: method must be 'ghost', 'triangle', 'projected' or "
                     f"'dp_gcl', got {method!r}.")
  groups = method == "dp_gcl"
  x_prime = x if x_prime is None else x_prime
  x, x_prime, _ = checks.check_pairs(x, x_prime)
  embedding_dim = int(jax.eval_shape(embed_fn, params, x).shape[-1])
  d = 1 if groups else embedding_dim  # DP-GCL's factors: one backward pass of ⟨c_e, ê_e⟩
  keep_factors = layerwise.keeps_group_factors if groups else None
  if positive_embed_fn is None or positive_embed_fn is embed_fn:
    plans = (layerwise.make_plan(embed_fn, params, x, d, keep_factors),)
    shared = None
  else:
    towers = two_tower.tower_plans(embed_fn, positive_embed_fn, params, x, x_prime, d, keep_factors)
    plans, shared = (towers.anchor, towers.positive), frozenset(towers.shared)
  result = report(plans, params, d, shared)
  if groups:  # group norms: no pair term
    leaves = tuple(dataclasses.replace(leaf, pair_cost=0.0) for leaf in result.leaves)
    result = PlanReport(leaves, embedding_dim, method)
  return result

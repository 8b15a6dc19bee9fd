"""DP-GCL's group-gradient norms from per-example Jacobian factors, without any (G, p) array.

Every example e of a batch (an anchor x_r, a positive x'_r or an extra view w_rm of record r)
has the cotangent c_e = ∂ℒ/∂ê_e of its normalised embedding, and the gradient of group g's loss
is ∇L_g = Σ_{e∈g} J_eᵀc_e. `layerwise.layer_factors` with the scalar output ⟨c_e, ê_e⟩ instead
of the embedding (d = 1: ONE backward pass, `weighted_factors`) gives, per example, the factors
of J_eᵀc_e itself: for a ghost layer the input patches a_et (T, P) and w_et = Σ_k c_ek δ_et^k
(T, C), so that its gradient of the layer is Σ_t a_et ⊗ w_et; for the other parameters (flattened
layers, generic leaves) the vector flat_e = J_eᵀc_e over their columns. Then

    ‖∇L_g‖² = Σ_{ghost layers} ‖Σ_{e∈g} A_eᵀW_e‖²_F + ‖Σ_{e∈g} flat_e‖²,

and for a ghost layer ‖Σ_{e∈g} A_eᵀW_e‖²_F = Σ_{e,e'∈g} Σ_{t,s} ⟨a_et, a_e't'⟩⟨w_et, w_e's⟩.

Groups as slots. The records of each group are gathered into S slots (`capacity`: S is the
smallest size that a Binomial(n, 1/G) group exceeds with probability ≤ `OVERFLOW_PROBABILITY`/G),
so that group g's examples are a (S·r, ...) block of factors (r examples per record). Per ghost
layer and group the cheaper of two exact forms is taken (`ghost_sq_norm`):

* within-group Gram: (S r)²T²(P + C) multiply-adds, (S r)²T² floats;
* the group's layer gradient materialised, Σ_e A_eᵀW_e: (S r)·T·P·C multiply-adds, P·C floats.

Flat columns: the group's vector Σ_e flat_e (q floats). Groups are processed a few at a time
(`jax.lax.map` with a batch size that keeps each step within `STEP_FLOATS` floats), so the
memory is that of the factors (their gathered copy included) plus one step, never G·p. A batch
in which some group has more than S records (probability ≤ `OVERFLOW_PROBABILITY`) takes the
same computation with every record of the batch as a slot, one group at a time (exact, slower).

Two towers: a ghost layer belongs to one tower (layers owning a leaf both towers use are
flattened in both plans, `two_tower.tower_plans`), and the towers' flat columns are aligned on
their shared leaves (`two_tower.shared_columns`), so their group vectors add up column by column.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from logit_dp._src import chunking
from logit_dp._src import layerwise
from logit_dp._src import numerics
from logit_dp._src import rows as rows_lib
from logit_dp._src import two_tower

_HIGHEST = jax.lax.Precision.HIGHEST
# A group exceeds its slots with at most this probability over all groups of a batch; such a
# batch takes the exact per-group path over all records (`group_sq_norms`).
OVERFLOW_PROBABILITY = 1e-6
# Floats one step of the per-group loop holds at most (several groups per step when they fit).
STEP_FLOATS = 1 << 20

# The factor fields this module contracts. A new kind of factor in `layerwise.Factors` must be
# added here (and to `_group_sq_norm_fn`) before DP-GCL can use it: otherwise its parameters would
# be missing from the group norms, and the clipped gradients would exceed B.
_KNOWN_FACTOR_FIELDS = ("flat", "ghost_patches", "ghost_deltas", "gram")


def check_factor_fields() -> None:
  """RuntimeError unless `layerwise.Factors` holds exactly the factors this module contracts."""
  if tuple(layerwise.Factors._fields) != _KNOWN_FACTOR_FIELDS:
    raise RuntimeError(
        f"logit_dp: layerwise.Factors has the fields {layerwise.Factors._fields}, DP-GCL's group "
        f"norms contract {_KNOWN_FACTOR_FIELDS}: extend logit_dp._src.group_norms first.")


class Part(NamedTuple):
  """The examples of one embedding function (a tower) in one batch of factors.

  plan: its layer plan; factors: `layerwise.Factors` of its m = r·n examples, view after view
  (example v·n + i is view v of record i, n the records on this device; gathered over k devices:
  device after device); views: r, its examples per record; columns: (q,) int, the position of
  each of its flat columns in the vector space shared by all parts.
  """
  plan: layerwise.Plan
  factors: layerwise.Factors
  views: int
  columns: np.ndarray


def weighted_factors(embed_fn, params, plan: layerwise.Plan, xs, cotangents, eps: float,
                     microbatch_size: int | None, varying=lambda a: a) -> layerwise.Factors:
  """Factors of J_eᵀc_e for every example e of xs (d = 1): `layerwise.layer_factors` of the
  scalar ⟨c_e, n(Φ(x_e))⟩, one forward and one backward pass per microbatch.

  cotangents: (m, d). The result's ghost_deltas are (m, T, 1, C) (w_et), flat (m, 1, q)
  (J_eᵀc_e over the flat columns), gram (m, 1, 1) (‖J_eᵀc_e‖²).
  """
  def chunk_factors(x_chunk, c_chunk):
    def scalar(e):
      return jnp.sum(numerics.normalize(e, eps) * c_chunk, axis=-1, keepdims=True)

    return layerwise.layer_factors(embed_fn, params, plan, x_chunk, scalar,
                                   _generic_jacobian(embed_fn, params, x_chunk, c_chunk, eps),
                                   varying)

  n = rows_lib.num_rows(xs)
  if microbatch_size is None or microbatch_size >= n:
    return chunk_factors(xs, cotangents)
  return chunking.unchunk_rows(
      chunking.map_chunks(chunk_factors, (xs, cotangents), microbatch_size), n)


def weighted_forward(embed_fn, params, plan: layerwise.Plan, xs, eps: float,
                     varying=lambda a: a) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
  """(u, finish): u = n(Φ(x_e)) (m, d) of every example of xs, and finish(c) -> the factors of
  `weighted_factors`(..., c) from that same forward pass and one backward pass (the forward
  pass is not run again; no microbatching)."""
  u, finish = layerwise.cotangent_factors(embed_fn, params, plan, xs,
                                          lambda e: numerics.normalize(e, eps), varying)
  return u, lambda c: finish(c, _generic_jacobian(embed_fn, params, xs, c, eps))


def _generic_jacobian(embed_fn, params, xs, cotangents, eps: float):
  """generic_jacobian(leaf_indices) -> (m, 1, q): ∇ of ⟨c_e, n(Φ(x_e))⟩ with respect to those
  leaves, example by example (jax.grad: the slow path of `layerwise.layer_factors`)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)

  def generic_jacobian(indices):
    def one(x_one, c_one):
      def value(selected):
        p = layerwise.replace_leaves(leaves, treedef, indices, selected)
        e = embed_fn(p, jax.tree_util.tree_map(lambda a: a[None], x_one))[0]
        return jnp.dot(numerics.normalize(e, eps), c_one, precision=_HIGHEST)

      grads = jax.grad(value)([leaves[i] for i in indices])
      return jnp.concatenate([g.reshape(-1) for g in grads])[None]

    return jax.vmap(one)(xs, cotangents)

  return generic_jacobian


def _binomial_log_pmf(k: int, m: int, q: float) -> float:
  """log P(Binomial(m, q) = k)."""
  return (math.lgamma(m + 1) - math.lgamma(k + 1) - math.lgamma(m - k + 1) + k * math.log(q) +
          (m - k) * math.log1p(-q))


def capacity(num_records: int, num_groups: int) -> int:
  """S: the smallest s with G·P(Binomial(n, 1/G) > s) ≤ `OVERFLOW_PROBABILITY` (at most n)."""
  n, g = int(num_records), int(num_groups)
  if g <= 1:
    return max(n, 1)
  p = 1.0 / g
  tail = 1.0  # P(X > s - 1) = P(X ≥ s)
  for s in range(n + 1):
    tail -= math.exp(_binomial_log_pmf(s, n, p))  # now P(X > s)
    if g * tail <= OVERFLOW_PROBABILITY:
      return max(s, 1)
  return max(n, 1)


def two_pass_slots(num_records: int, total_groups: int, num_groups: int,
                   slots: int) -> tuple[int, int]:
  """(S₁, K): the slots of a first pass over every group and the most groups a second pass
  takes again with all `slots`, or (slots, 0) for one pass when two are not cheaper.

  S₁ = the smallest s with P(Binomial(n, 1/G) > s) ≤ 1/16; K = the smallest k with
  P(Binomial(num_groups, P(X > S₁)) > k) ≤ `OVERFLOW_PROBABILITY`. A batch with more than K
  such groups (or a group above `slots`) takes the exact per-group path, so K only sets the
  cost: the Grams cost num_groups·S₁² + K·S² against num_groups·S².
  """
  n, g = int(num_records), int(total_groups)
  if g <= 1 or slots <= 2:
    return slots, 0
  p = 1.0 / g
  tail, first = 1.0, slots
  for s in range(slots):
    tail -= math.exp(_binomial_log_pmf(s, n, p))  # P(X > s)
    if tail <= 1 / 16:
      first = max(s, 1)
      break
  if first >= slots or tail <= 0:
    return slots, 0
  spill_tail, spill = 1.0, num_groups
  for k in range(num_groups + 1):
    spill_tail -= math.exp(_binomial_log_pmf(k, num_groups, tail))
    if spill_tail <= OVERFLOW_PROBABILITY:
      spill = k
      break
  if num_groups * first ** 2 + spill * slots ** 2 >= num_groups * slots ** 2:
    return slots, 0
  return first, max(spill, 1)


def flat_columns_map(plans: two_tower.TowerPlans, params) -> tuple[np.ndarray, np.ndarray]:
  """(columns of the anchor tower, columns of the positive tower) in one vector space: the
  anchor's flat columns first, then the positive tower's columns that are not shared; a shared
  leaf's columns of the positive tower map to the anchor's columns of that leaf."""
  leaves = jax.tree_util.tree_leaves(params)
  anchor = two_tower.flat_columns(plans.anchor, leaves)
  positive = two_tower.flat_columns(plans.positive, leaves)
  q_u = max([stop for _, stop in anchor.values()], default=0)
  q_v = max([stop for _, stop in positive.values()], default=0)
  cols_u, cols_v = two_tower.shared_columns(plans, params)
  columns_v = np.full((q_v,), -1, np.int64)
  columns_v[cols_v] = cols_u
  own = columns_v < 0
  columns_v[own] = q_u + np.arange(int(own.sum()))
  return np.arange(q_u), columns_v


def _slot_examples(table, views: int, n_local: int) -> jax.Array:
  """(g, S) global record indices (≥ the number of records: empty) -> (g, S·views) indices of
  the examples of a part's (gathered) factors; empty slots point past the end."""
  m_local = views * n_local
  device, row = table // n_local, table % n_local
  index = jnp.stack([device * m_local + v * n_local + row for v in range(views)], axis=-1)
  return index.reshape(table.shape[0], -1)


def ghost_sq_norm(a, w) -> jax.Array:
  """‖Σ_e A_eᵀW_e‖²_F of one group: a (s, T, P), w (s, T, C); the cheaper exact form."""
  s, t, p = a.shape
  c = w.shape[-1]
  if s * s * t * t * (p + c) <= s * t * p * c:  # within-group Gram
    ka = jnp.einsum("stp,urp->sutr", a, a, precision=_HIGHEST)
    kw = jnp.einsum("stc,urc->sutr", w, w, precision=_HIGHEST)
    return jnp.sum(ka * kw)
  grad = jnp.matmul(a.reshape(s * t, p).T, w.reshape(s * t, c), precision=_HIGHEST)
  return jnp.sum(grad * grad)


def _step_floats(parts, slots: int) -> int:
  """Floats one group holds in `_group_sq_norm_fn` (the gathered factors and the largest form)."""
  total = 0
  q = 0
  for part in parts:
    s = slots * part.views
    q = max(q, int(np.max(part.columns, initial=-1)) + 1)
    total += s * part.factors.flat.shape[-1]
    for a, w in zip(part.factors.ghost_patches, part.factors.ghost_deltas):
      t, p, c = a.shape[1], a.shape[2], w.shape[-1]
      total += s * t * (p + c) + min(s * s * t * t, p * c)
  return total + q


def _group_sq_norm_fn(parts, dtype):
  """indices -> ‖∇L_g‖² of one group, indices one (S·r,) array of example indices per part
  (past the end: an empty slot)."""
  q = max([int(np.max(part.columns, initial=-1)) + 1 for part in parts], default=0)

  def one_group(indices):
    total = jnp.zeros((), dtype)
    vector = None
    for part, index in zip(parts, indices):
      take = lambda a, index=index: jnp.take(a, index, axis=0, mode="fill", fill_value=0)
      f = part.factors
      for a, w in zip(f.ghost_patches, f.ghost_deltas):
        a_g, w_g = take(a), take(w)[:, :, 0, :]  # (s, T, P), (s, T, C)
        total = total + ghost_sq_norm(a_g, w_g).astype(total.dtype)
      if f.flat.shape[-1]:
        summed = jnp.sum(take(f.flat)[:, 0, :], axis=0)  # (q_part,)
        contribution = jnp.zeros((q,), summed.dtype).at[part.columns].add(summed)
        vector = contribution if vector is None else vector + contribution
    if vector is not None:
      total = total + jnp.sum(vector * vector).astype(total.dtype)
    return total

  return one_group


def group_sq_norms(parts, group_ids, num_groups: int, n_local: int, first_group: Any = 0,
                   dtype=jnp.float32, total_groups: int | None = None) -> jax.Array:
  """(G_share,) ‖∇L_g‖² of the groups first_group .. first_group + num_groups − 1.

  group_ids: (n,) the group of every record of the (gathered) batch, ≥ first_group +
  num_groups or < first_group for records that are not in these groups (invalid ones);
  n_local: the records per device (the factors' layout, `Part`); total_groups: G, of which
  these are a share (the slots' `capacity` is that of a group among G; default num_groups).
  """
  n = group_ids.shape[0]
  local = group_ids - first_group
  member = (local >= 0) & (local < num_groups)
  local = jnp.where(member, local, num_groups)
  counts = jax.ops.segment_sum(member.astype(jnp.int32), local, num_segments=num_groups + 1)
  total_groups = num_groups if total_groups is None else total_groups
  slots = capacity(n, total_groups)
  first_slots, spill = two_pass_slots(n, total_groups, num_groups, slots)
  order = jnp.argsort(local, stable=True)
  sorted_group = local[order]
  starts = jnp.cumsum(counts) - counts
  rank = jnp.arange(n) - starts[sorted_group]

  def table_of(slots):  # (num_groups, slots): the first `slots` records of every group
    fits = (sorted_group < num_groups) & (rank < slots)
    where = jnp.where(fits, sorted_group * slots + rank, num_groups * slots)
    table = jnp.full((num_groups * slots + 1,), n, jnp.int32).at[where].set(order.astype(jnp.int32))
    return table[:-1].reshape(num_groups, slots)

  def norms_of(table, slots):
    one_group = _group_sq_norm_fn(parts, dtype)
    indices = tuple(_slot_examples(table, part.views, n_local) for part in parts)
    batch = max(1, min(table.shape[0], STEP_FLOATS // max(_step_floats(parts, slots), 1)))
    return jax.lax.map(one_group, indices, batch_size=batch)

  def main():
    if not spill:
      return norms_of(table_of(slots), slots)
    # Every group with first_slots slots, then the (at most spill) groups with more records
    # again with all of them: the within-group Grams cost G·S₁² + K·S², not G·S².
    norms = norms_of(table_of(first_slots), first_slots)
    (large,) = jnp.nonzero(counts[:num_groups] > first_slots, size=spill, fill_value=num_groups)
    rank_in_group = jnp.arange(slots)
    position = starts[large][:, None] + rank_in_group
    member_slot = (large[:, None] < num_groups) & (rank_in_group < counts[large][:, None])
    table = jnp.where(member_slot, order[jnp.minimum(position, n - 1)], n).astype(jnp.int32)
    return norms.at[large].set(norms_of(table, slots), mode="drop")

  def overflow():  # every record of the batch as a slot, one group at a time
    def one(g):
      members = jnp.where(local == g, jnp.arange(n), n)
      full = jnp.sort(members)[None]  # (1, n)
      return norms_of(full, n)[0]

    return jax.lax.map(one, jnp.arange(num_groups))

  too_many = jnp.sum(counts[:num_groups] > first_slots) > spill if spill else False
  if slots >= n and not spill:
    return main()
  return jax.lax.cond(jnp.any(counts[:num_groups] > slots) | too_many, overflow, main)


def group_sums(values, group_ids, num_groups: int) -> jax.Array:
  """(G,) Σ_{e: group_ids[e] = g} values[e] (ids outside [0, G) are left out)."""
  inside = (group_ids >= 0) & (group_ids < num_groups)
  return jax.ops.segment_sum(jnp.where(inside, values, 0), jnp.where(inside, group_ids, 0),
                             num_segments=num_groups)


def example_groups(group_ids, views: int) -> jax.Array:
  """(r·n,) the group of every example of a part, view after view, from the records' (n,)."""
  return jnp.tile(group_ids, views)


def transpose_parts(parts_local, cotangents, keeps, leaves) -> list:
  """Σ over parts of `layerwise.factors_transpose`: Σ_e J_eᵀ(weight_e c_e) per leaf, from the
  weighted factors (cotangents (m, 1) the weights; keeps (m,) bool: examples not kept add 0)."""
  total = [jnp.zeros_like(leaf) for leaf in leaves]
  for part, cot, keep in zip(parts_local, cotangents, keeps):
    grads = layerwise.factors_transpose(part.plan, part.factors, cot, leaves, keep)
    total = [a + b for a, b in zip(total, grads)]
  return total

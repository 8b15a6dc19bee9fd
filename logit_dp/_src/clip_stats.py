"""Clip statistics of one private gradient: `ClipStats`.

They summarise the norms a clipped gradient compared with B, the norms used for clipping
(float32 allowances and upper bounds included): of the N norms considered, how many exceed
B, and the quantiles q_α of the norms (numpy.quantile's linear interpolation).

They are NON-PRIVATE diagnostics: they depend on the batch without noise, so releasing them
costs privacy that the accounting of ḡ does not include. Use them for tuning B on data
that may be spent on it, or noise them before they leave.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

#: The levels α of `ClipStats.quantiles`: min, 10 %, median, 90 %, max.
QUANTILE_LEVELS = (0.0, 0.1, 0.5, 0.9, 1.0)


@dataclasses.dataclass(frozen=True)
class ClipStats:
  """What clipping did on one batch (a pytree of arrays; NON-PRIVATE, see below).

  The norms N counts are those clipping compared with B:

  * Logit-DP (`clipped_grad`): ‖g_ij‖ (or the method's upper bound), allowances
    included, of every valid pair (i, j), i.e. both rows valid with finite inputs and
    embeddings, whatever τ_ij (N = num_valid²);
  * Naive-DP (`naive_clipped_grad`): the one norm ‖∇ℒ‖ of the batch gradient (N = 1; 0 on
    an empty batch);
  * DP-GCL (`grouped_clipped_grad`): ‖∇_w L_g‖ of every group with a valid record.

  A norm counts as clipped when its clip factor min(1, B/‖g‖) is below 1: norm > B, or
  non-finite (such a term is dropped). The statistics depend on the batch without noise:
  releasing them costs privacy that the accounting of ḡ does not cover.

  Attributes:
    num_valid: the valid rows (mask true) with finite inputs and embeddings.
    num_dropped: the valid rows dropped for non-finite inputs or embeddings.
    num_norms: N, the number of norms the statistics are over (0: nothing was clipped
      because nothing was used, e.g. an empty batch).
    num_clipped: how many of the N norms exceed B.
    quantiles: (5,) the norms at `QUANTILE_LEVELS` (min, 10 %, median, 90 %, max), NaN when
      N = 0; non-finite norms count as +inf.
  """
  num_valid: jax.Array
  num_dropped: jax.Array
  num_norms: jax.Array
  num_clipped: jax.Array
  quantiles: jax.Array

  @property
  def fraction_clipped(self) -> jax.Array:
    """num_clipped / num_norms (NaN when num_norms is 0)."""
    return jnp.where(self.num_norms > 0, self.num_clipped / jnp.maximum(self.num_norms, 1), jnp.nan)

  @property
  def median_norm(self) -> jax.Array:
    """The median of the norms (NaN when num_norms is 0)."""
    return self.quantiles[QUANTILE_LEVELS.index(0.5)]

  def as_dict(self) -> dict[str, float]:
    """Host numbers for logging: the counts, fraction_clipped and one entry per quantile
    (``norm_min``, ``norm_q10``, ``norm_median``, ``norm_q90``, ``norm_max``)."""
    names = ("norm_min", "norm_q10", "norm_median", "norm_q90", "norm_max")
    out = {
        "num_valid": int(self.num_valid), "num_dropped": int(self.num_dropped),
        "num_norms": int(self.num_norms), "num_clipped": int(self.num_clipped),
        "fraction_clipped": float(self.fraction_clipped)
    }
    out.update((name, float(q)) for name, q in zip(names, self.quantiles))
    return out


jax.tree_util.register_dataclass(
    ClipStats, data_fields=["num_valid", "num_dropped", "num_norms", "num_clipped", "quantiles"],
    meta_fields=[])


def summarize(norms: jax.Array, counted: jax.Array, clip_norm, num_valid, num_dropped) -> ClipStats:
  """`ClipStats` of the entries of ``norms`` where ``counted`` (same shape) is true.

  clipped: ¬(norm ≤ B), as `numerics.clip_factor` (non-finite norms are clipped to 0);
  quantiles over the counted norms with NaN read as +inf.
  """
  norms, counted = jnp.ravel(norms), jnp.ravel(counted)
  num_norms = jnp.sum(counted, dtype=jnp.int32)
  num_clipped = jnp.sum(counted & ~(norms <= clip_norm), dtype=jnp.int32)
  values = jnp.where(counted, jnp.where(jnp.isnan(norms), jnp.inf, norms), jnp.nan)
  levels = jnp.asarray(QUANTILE_LEVELS, norms.dtype)
  quantiles = jnp.where(num_norms > 0, jnp.nanquantile(values, levels), jnp.nan)
  return ClipStats(num_valid=jnp.asarray(num_valid, jnp.int32),
                   num_dropped=jnp.asarray(num_dropped, jnp.int32), num_norms=num_norms,
                   num_clipped=num_clipped, quantiles=quantiles)


def pair_stats(batch, norms_local: jax.Array, clip_norm) -> ClipStats:
  """`ClipStats` of Logit-DP from the (n_local, n) pair norms clipping used.

  Under a shard_map axis the norms are gathered over the devices (n² floats, only when
  statistics are asked for), so every device returns the statistics of the global batch.
  batch: the `pair_batch.PairBatch` the norms belong to.
  """
  c = batch.c
  norms = c.gather(norms_local)  # (n, n)
  valid = batch.valid  # (n,), gathered: valid and finite
  stats = summarize(norms, valid[:, None] & valid[None, :], clip_norm,
                    jnp.sum(valid, dtype=jnp.int32), batch.num_nonfinite)
  return jax.tree_util.tree_map(c.replicated, stats)

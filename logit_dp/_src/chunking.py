"""How much of a pair computation is held at once: row chunks, blocks of pairs, memory budgets.

The pair terms of "ghost" (cross terms over flattened parameters, per-layer pair terms of
ghost layers: `methods.ghost`) and of "projected" are formed for chunks of rows against all
columns, each chunk holding about a fixed number of floats (`row_chunks`); on an accelerator
the chunks are `ACCELERATOR_CHUNK_SCALE` times larger and not capped in rows
(`backend_chunk_limits`).
"ghost" holds the Jacobian factors of r rows and c columns at once (`ghost_block_sizes`) within
a memory budget (`default_memory_budget`, `factor_bytes_per_example`).
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from logit_dp._src import layerwise
from logit_dp._src import rows as rows_lib

# Floats held by one chunk of a cross-Gram over flattened parameters (rows × n × d²; the
# projected bound's, and ghost's at small d).
CROSS_GRAM_CHUNK_FLOATS = 1 << 23
# Floats of the pairs' vectors J'_jᵀû_i one block of the ghost flat cross terms holds
# (rows × n × parameters of the block; `layerwise.flat_cross`), and the fewest parameters a
# block spans (its contraction with J_i runs at matmul speed from about this width).
FLAT_CROSS_CHUNK_FLOATS = 1 << 24
FLAT_CROSS_MIN_BLOCK = 256
# Floats held by one chunk of a ghost layer's pair terms (rows × n × (T² + 2TC + d)).
GHOST_LAYER_CHUNK_FLOATS = 1 << 24
# On the CPU a ghost layer's chunk holds at most GHOST_LAYER_CHUNK_ROWS rows and at most
# GHOST_LAYER_CHUNK_PAIRS pairs, but at least one row (`ghost_layer_chunk_rows`): its batched
# small contractions (T×T by T×C per pair) run fastest in small chunks, the smaller the larger
# n (the embedding net's step: 4 rows 3–10% faster than 8 at n = 1,000, 2 rows 6% faster at
# n = 2,000; docs/BENCHMARKS.md).
GHOST_LAYER_CHUNK_ROWS = 8
GHOST_LAYER_CHUNK_PAIRS = 4096
# On an accelerator the pair-term chunks are this many times larger and not capped in rows:
# a chunk there is a few kernel launches, and at the CPU sizes (1-13 rows at n = 10,000)
# the launches, not the arithmetic, would set the time.
ACCELERATOR_CHUNK_SCALE = 16
# Bytes of Jacobian factors "ghost" holds at once by default on the CPU (rows + column blocks;
# `default_memory_budget`). ResNet-18 without batch norm: 29 MB per example, so 4 GiB hold
# 146 examples' factors; the paper's embedding net: 0.2 MB, all of n = 10,000 in one block.
DEFAULT_GHOST_MEMORY_BUDGET = 4 << 30
# Smallest column block "ghost" uses when the budget lets it choose (factors of fewer examples
# at a time run below batch speed).
MIN_COLUMN_BLOCK = 8
# Floats held by one block of materialised pair gradients (pairs × p).
PAIR_BLOCK_FLOATS = 1 << 22


def on_accelerator() -> bool:
  """Whether JAX runs on an accelerator (GPU, TPU) rather than the CPU."""
  return jax.default_backend() != "cpu"


def backend_chunk_limits(budget: int, max_rows: int | None) -> tuple[int, int | None]:
  """(floats, rows) a pair-term chunk may hold on this backend: the CPU's as given;
  `ACCELERATOR_CHUNK_SCALE` × the floats and no row cap on an accelerator."""
  if on_accelerator():
    return budget * ACCELERATOR_CHUNK_SCALE, None
  return budget, max_rows


def map_chunks(fn, xs, chunk: int) -> Any:
  """fn(*chunk of rows) over the leading axis of xs (a tuple of arrays) in chunks of `chunk`
  rows, the last one zero-padded; the results stacked per chunk, (num_chunks, ...).
  An element of xs may be a pytree (inputs), chunked leaf by leaf."""
  n = rows_lib.num_rows(xs)
  num_chunks = -(-n // chunk)
  pad = num_chunks * chunk - n

  def split(a):
    a = jnp.concatenate([a, jnp.zeros((pad,) + a.shape[1:], a.dtype)]) if pad else a
    return a.reshape((num_chunks, chunk) + a.shape[1:])

  return jax.lax.map(lambda rows: fn(*rows), jax.tree_util.tree_map(split, tuple(xs)))


def unchunk_rows(tree, n: int) -> Any:
  """(num_chunks, chunk, ...) per-row results of `map_chunks` back to their n rows."""
  # The explicit size, not -1: a zero-size leaf (no flattened parameters) cannot infer it.
  return jax.tree_util.tree_map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])[:n],
                                tree)


def map_row_chunks(fn, xs, chunk: int | None) -> Any:
  """fn(*xs) per row, in chunks of `chunk` rows (one call when chunk is None or ≥ the rows)."""
  n = rows_lib.num_rows(xs)
  if chunk is None or chunk >= n:
    return fn(*xs)
  return unchunk_rows(map_chunks(fn, xs, chunk), n)


def ghost_layer_chunk_rows(n_columns: int) -> int:
  """The row cap of a ghost layer's pair-term chunks against n_columns columns on the CPU:
  GHOST_LAYER_CHUNK_PAIRS // n_columns, between 1 and GHOST_LAYER_CHUNK_ROWS."""
  return max(1, min(GHOST_LAYER_CHUNK_ROWS, GHOST_LAYER_CHUNK_PAIRS // max(n_columns, 1)))


def _chunk_rows(n_rows: int, row_floats: int, budget: int, max_rows: int | None) -> int:
  """Rows per chunk of `row_chunks`."""
  budget, max_rows = backend_chunk_limits(budget, max_rows)
  return int(max(1, min(n_rows, max_rows or n_rows, budget // max(row_floats, 1))))


def row_chunks(fn, rows, row_floats: int, budget: int, max_rows: int | None = None) -> jax.Array:
  """fn(chunk of rows) -> (chunk, n), over all rows in chunks holding about `budget` floats
  and at most `max_rows` rows (as `backend_chunk_limits` sets them for this backend)."""
  n_rows = rows[0].shape[0]
  chunk = _chunk_rows(n_rows, row_floats, budget, max_rows)
  return unchunk_rows(map_chunks(fn, rows, chunk), n_rows)


def row_chunks_sum(specs) -> jax.Array:
  """Σ of `row_chunks` of several (fn, rows, row_floats, budget, max_rows) over the same rows,
  added in order; those with the same chunk size share one loop (its body compiled once),
  which slices each distinct row array once and adds their results in the body."""
  n_rows = specs[0][1][0].shape[0]
  chunks = [_chunk_rows(n_rows, *spec[2:]) for spec in specs]
  total = None
  for chunk in dict.fromkeys(chunks):
    group = [i for i, c in enumerate(chunks) if c == chunk]
    rows, positions = [], []  # the distinct row arrays (by identity), and each spec's
    for i in group:
      here = []
      for a in specs[i][1]:
        found = next((k for k, b in enumerate(rows) if b is a), None)
        if found is None:
          rows.append(a)
          found = len(rows) - 1
        here.append(found)
      positions.append(here)

    def fn(*chunk_rows, group=group, positions=positions):
      result = None
      for i, here in zip(group, positions):
        term = specs[i][0](*[chunk_rows[k] for k in here])
        result = term if result is None else result + term
      return result

    part = unchunk_rows(map_chunks(fn, tuple(rows), chunk), n_rows)
    total = part if total is None else total + part
  return cast(jax.Array, total)


def vectors_per_block(params, count: int) -> int:
  """How many parameter-sized vectors (pair gradients) to hold at once: at most `count`, about
  PAIR_BLOCK_FLOATS floats, at least one."""
  num_params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))
  return max(1, min(count, PAIR_BLOCK_FLOATS // max(num_params, 1)))


def default_memory_budget() -> int:
  """Bytes of Jacobian factors "ghost" holds at once when not told: DEFAULT_GHOST_MEMORY_BUDGET
  on the CPU; a quarter of the device's memory on an accelerator that reports it."""
  if on_accelerator():
    try:
      stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # pylint: disable=broad-except  (a backend without memory stats)
      stats = {}
    if stats.get("bytes_limit"):
      return max(DEFAULT_GHOST_MEMORY_BUDGET, int(stats["bytes_limit"]) // 4)
  return DEFAULT_GHOST_MEMORY_BUDGET


def factor_bytes_per_example(plan: layerwise.Plan, d: int, leaves) -> int:
  """Bytes one example's Jacobian factors take in "ghost" (float32): d·q for the q flattened
  parameters, T·(P + d·C) per ghost layer, the d×d Gram, and the largest ghost layer's T·d·C
  once more (its deltas are re-laid out for the pair terms)."""
  q = sum(int(np.prod(np.shape(leaves[i]))) for i in plan.generic)
  held, relaid = d * d, 0
  for layer, ghost in zip(plan.layers, plan.ghost):
    if ghost:
      held += layer.positions * (layer.fan_in + d * layer.features)
      relaid = max(relaid, layer.positions * d * layer.features)
    else:
      q += layer.fan_in * layer.features
  return 4 * (held + d * q + relaid)


def ghost_block_sizes(n_local: int, num_devices: int, example_bytes: int, memory_budget: int,
                      multiple: int = 1) -> tuple[int, int]:
  """(r, c): rows and columns of the pair blocks of "ghost", c dividing r.

  With b = 1 column buffer on one device and 2 on a ring (the block in use and the one
  arriving), the factors held at once are (r + b·c)·example_bytes ≤ memory_budget. The
  column factors are recomputed once per row block, so r is as large as fits (all n_local
  rows when (n_local + b·⌈n_local/b⌉)·example_bytes fit: no recomputation, and on one device
  the single block of the path before the blocks); c is then the largest that fits, at least
  MIN_COLUMN_BLOCK where the budget allows, and a multiple of `multiple` (the microbatch of
  the factor computations) when larger than it, except for that single block. Below
  (1 + b)·example_bytes: r = c = 1.
  """
  buffers = 1 if num_devices == 1 else 2
  slots = memory_budget // max(example_bytes, 1)
  for num_row_blocks in range(1, n_local + 1):
    r0 = -(-n_local // num_row_blocks)
    c = min(-(-r0 // buffers), (slots - r0) // buffers)
    if c < min(MIN_COLUMN_BLOCK, -(-r0 // buffers)):
      continue
    while True:
      per_row_block = -(-r0 // c)
      c_balanced = -(-r0 // per_row_block)
      if buffers == 1 and c_balanced == n_local:
        return n_local, n_local
      if c_balanced > multiple:  # whole microbatches: no padded chunk to slice off
        c_balanced = -(-c_balanced // multiple) * multiple
      r = per_row_block * c_balanced
      if r + buffers * c_balanced <= slots or c == 1:
        return r, c_balanced
      c -= 1
  return 1, 1

"""Input validation of the gradient builders: bad input is a ValueError, never NaN or a silently
non-private result."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logit_dp._src import rows as rows_lib
from logit_dp._src import stochastic as stochastic_lib

# embed_fn(params, x) -> (n, d); x is an array or a pytree of arrays, examples along axis 0.
EmbedFn = Callable[[Any, Any], jax.Array]


class EmptyBatchWarning(UserWarning):
  """A batch had no valid pair (mask all False): ℒ = 0 and ḡ = 0, and a private step
  releases pure noise."""


def warn_if_empty(what: str, mask) -> None:
  """Eager calls only: `EmptyBatchWarning` when ``mask`` is given and all False."""
  if mask is None or rows_lib.is_traced(mask):
    return
  if isinstance(mask, jax.Array) and not mask.is_fully_addressable:
    mask = jnp.any(mask)  # a global array over several processes: a value every one can read
  if bool(np.any(np.asarray(mask))):
    return
  warnings.warn(
      f"{what}: the batch has no valid pair (mask all False), so ℒ = 0 and ḡ = 0; "
      "a Poisson batch is empty by chance, anything else is a masking error.", EmptyBatchWarning,
      stacklevel=3)


def raise_if_dropped(what: str, tree, num_dropped, unit: str = "pair(s)") -> None:
  """Eager calls only: a ValueError when rows with non-finite inputs or embeddings were dropped.

  Under jit (``tree`` or the count traced: a jitted function may close over the batch) such
  rows are masked out and counted instead (docs/PRIVACY.md).
  """
  if not rows_lib.is_traced((tree, num_dropped)) and int(num_dropped) > 0:
    raise ValueError(f"{what}: {int(num_dropped)} {unit} have non-finite inputs or embeddings "
                     "(NaN/inf). Nothing was released. Under jit such rows are masked out "
                     "instead (see docs/PRIVACY.md).")


def as_inputs(a, name: str, xp) -> Any:
  """An array, or a pytree of arrays (e.g. token ids and their mask), with the examples along
  axis 0 of every leaf, as `xp` arrays; ValueError otherwise."""
  leaves, treedef = jax.tree_util.tree_flatten(a)
  if not leaves:
    raise ValueError(f"{name} must be an array or a pytree of arrays, got {a!r} (no arrays).")
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0]:
    where = name + jax.tree_util.keystr(path)
    if not hasattr(leaf, "shape") and not isinstance(leaf, (int, float, bool, np.generic)):
      raise ValueError(f"{where} must be an array with the examples along axis 0, got "
                       f"{type(leaf).__name__}.")
    dtype = np.dtype(getattr(leaf, "dtype", type(leaf)))
    if dtype.kind not in "biuf" and not jnp.issubdtype(dtype, jnp.floating):  # bfloat16 is "V"
      raise ValueError(f"{where} must hold numbers (bool, int or float), got dtype {dtype}.")
    leaf = xp.asarray(leaf)
    if leaf.ndim < 1:
      raise ValueError(f"{where} must have the examples along axis 0, got a scalar.")
    out.append(leaf)
  sizes = sorted({leaf.shape[0] for leaf in out})
  if len(sizes) > 1:
    raise ValueError(
        f"every leaf of {name} must hold the same number of examples along axis 0, "
        f"got {sizes}: "
        + ", ".join(f"{name}{jax.tree_util.keystr(path)}: {leaf.shape}"
                    for (path, _), leaf in zip(jax.tree_util.tree_flatten_with_path(a)[0], out))
        + ".")
  return jax.tree_util.tree_unflatten(treedef, out)


def check_mask(mask, n: int, xp) -> Any:
  """mask as a boolean `xp` array of shape (n,); ValueError unless boolean or integer 0/1."""
  mask = xp.asarray(mask)
  if mask.shape != (n,):
    raise ValueError(f"mask must have shape ({n},), got {mask.shape}.")
  if mask.dtype == bool:
    return mask
  if not jnp.issubdtype(mask.dtype, jnp.integer):
    raise ValueError(
        f"mask must be boolean (or integer 0/1), got dtype {mask.dtype}: a float mask such as "
        "0.5 would silently count as True.")
  if not rows_lib.is_traced(mask) and not bool(xp.all((mask == 0) | (mask == 1))):
    raise ValueError("an integer mask must hold only 0 and 1.")
  return mask.astype(bool)


def check_pairs(x, x_prime, mask=None, xp=jnp) -> tuple[Any, Any, Any]:
  """(x, x_prime, mask) as `xp` arrays (or pytrees of them), mask all-True if None.

  ValueError on leaves that are not numeric arrays with the examples along axis 0, leaves
  of one input with different numbers of examples, x and x_prime with different numbers
  of examples, or a mask that is not boolean (integer 0/1 is accepted).
  """
  x, x_prime = as_inputs(x, "x", xp), as_inputs(x_prime, "x_prime", xp)
  if rows_lib.num_rows(x) != rows_lib.num_rows(x_prime):
    raise ValueError(f"x and x_prime must hold the same number of examples, got "
                     f"{rows_lib.num_rows(x)} and {rows_lib.num_rows(x_prime)} (shapes "
                     f"{jax.tree_util.tree_map(jnp.shape, x)} and "
                     f"{jax.tree_util.tree_map(jnp.shape, x_prime)}).")
  n = rows_lib.num_rows(x)
  mask = xp.ones((n,), dtype=bool) if mask is None else check_mask(mask, n, xp)
  return x, x_prime, mask


NON_TRAINABLE_COLLECTIONS = ("batch_stats", "cache", "intermediates", "state")
PROBE_ROWS = 4


def probe_inputs(params, x) -> tuple[Any, Any]:
  """Concrete stand-ins of (params, x) with their shapes and dtypes (random, fixed seed)."""
  rng = np.random.default_rng(0)

  def stand_in(a, scale):
    if jnp.issubdtype(a.dtype, jnp.floating):
      return np.asarray(scale * rng.standard_normal(a.shape), a.dtype)
    if jnp.issubdtype(a.dtype, jnp.integer):
      return np.asarray(rng.integers(0, 2, a.shape), a.dtype)
    if a.dtype == bool:
      return np.ones(a.shape, a.dtype)  # e.g. an attention mask: keep every position
    return np.zeros(a.shape, a.dtype)

  rows = min(rows_lib.num_rows(x), PROBE_ROWS)
  return (jax.tree_util.tree_map(lambda a: stand_in(a, 0.3), params),
          jax.tree_util.tree_map(
              lambda a: stand_in(jax.ShapeDtypeStruct((rows,) + a.shape[1:], a.dtype), 1.0), x))


def check_embed_fn(embed_fn: EmbedFn, params, x, name: str = "embed_fn", key=None) -> None:
  """ValueError unless embed_fn(params, x) is (n, d) and treats the examples independently.

  Per-pair clipping needs each embedding to depend on its own example only: a model that
  mixes the batch (flax BatchNorm in training mode, subtracting the batch mean) would be
  evaluated example by example and learn nothing. Compares embed_fn on a few rows at once
  with the same rows one by one: on (params, x) themselves when they are concrete, under
  jit on random stand-ins of their shapes. Also refuses params holding non-trainable flax
  collections (they must be closed over by embed_fn, never differentiated or noised).

  With a key, embed_fn is stochastic, embed_fn(params, x, key): see
  `_check_stochastic_embed_fn`.
  """
  if isinstance(params, dict) or hasattr(params, "keys"):
    keys = set(params.keys())
    extra = keys & set(NON_TRAINABLE_COLLECTIONS) or (keys
                                                      - {"params"} if "params" in keys else set())
    if extra:
      raise ValueError(
          f"params holds the flax collection(s) {sorted(extra)}: pass only the trainable "
          "parameters (e.g. variables['params']) and let embed_fn close over the rest, so "
          "that non-trainable state is never differentiated or noised. Batch statistics "
          "mix the examples of a batch and break per-pair clipping: use GroupNorm/LayerNorm "
          "or no normalisation.")
  if rows_lib.num_rows(x) < 1:
    return
  if rows_lib.is_traced((params, x)):
    params, x = probe_inputs(params, x)
  if key is not None:
    _check_stochastic_embed_fn(embed_fn, params, x, key, name)
    return
  rows = _probe_rows(x)
  num = rows_lib.num_rows(rows)
  batched = np.asarray(_first_call(embed_fn, params, rows, None, name)(params, rows), np.float64)
  if batched.ndim != 2 or batched.shape[0] != num:
    raise ValueError(f"{name} must return (n, d) embeddings, one row per example; got shape "
                     f"{batched.shape} for {num} examples.")
  if num < 2:
    return
  # Each row as a batch of one, in one vmapped call (one evaluation instead of num).
  alone = jax.vmap(lambda p, row: embed_fn(p, jax.tree_util.tree_map(lambda a: a[None], row))[0],
                   in_axes=(None, 0))
  single = np.asarray(_run_now(alone, params, rows), np.float64)
  if not np.all(np.isfinite(batched)) or not np.all(np.isfinite(single)):
    return  # non-finite embeddings are handled (dropped) by the gradient itself
  tol = 1e-3 * max(float(np.max(np.abs(batched))), 1e-6)
  if np.max(np.abs(batched - single)) > tol:
    raise ValueError(
        f"{name} mixes the examples of a batch: embedding rows together differs from "
        f"embedding them one by one (max difference {np.max(np.abs(batched - single)):.3g}). "
        "Logit-DP clips per-pair gradients and needs examples to be independent: no batch "
        "norm in training mode, no batch statistics. A stochastic model (dropout) takes a "
        "key: embed_fn(params, x, key), declared with stochastic=True.")


def _probe_rows(x):
  """The first PROBE_ROWS rows of x, concrete also inside a jit trace."""
  with jax.ensure_compile_time_eval():
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a[:PROBE_ROWS]), x)


def _compiled(fn, *args):
  """fn compiled for args (concrete), to run now also inside a jit trace: once as a whole, not
  one compilation per operation as eagerly. Not under `jax.ensure_compile_time_eval`, which
  would evaluate the model's constant subexpressions eagerly while tracing it (flax checks
  every parameter's shape by tracing its initializer)."""
  return jax.jit(lambda *a: fn(*a)).lower(*args).compile()  # a new function: traced anew


def _run_now(fn, *args):
  """fn(*args) of concrete args, computed now (`_compiled`)."""
  return _compiled(fn, *args)(*args)


def _first_call(embed_fn, params, x, key, name: str):
  """embed_fn compiled for (params, x[, key]) (`_compiled`); a TypeError that the other arity
  would not raise becomes `stochastic.arity_error` (stochastic= does not match embed_fn's
  arguments)."""
  try:
    return _compiled(embed_fn, params, x) if key is None else _compiled(embed_fn, params, x, key)
  except TypeError as error:
    if stochastic_lib.called_with_other_arity(embed_fn, params, x, key):
      raise stochastic_lib.arity_error(name, key is not None) from error
    raise


def _probe_key(key) -> Any:
  """A concrete key of the kind of key (fixed seed), for checks under jit."""
  if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
    return jax.random.key(0, impl=jax.random.key_impl(key))
  return jax.random.PRNGKey(0)


def _check_stochastic_embed_fn(embed_fn, params, x, key, name: str) -> None:
  """ValueError unless embed_fn(params, x, key) is (n, d), reproducible given the key, and row
  0's embedding does not depend on the other rows of its batch.

  The randomness is held fixed: the same key and the same batch shape, so a dropout mask is
  the same in both calls, while a batch statistic changes when rows 1.. are replaced by copies
  of row 0.
  """
  if rows_lib.is_traced(key):
    with jax.ensure_compile_time_eval():  # a concrete key now, also inside a jit trace
      key = _probe_key(key)
  rows = _probe_rows(x)
  num = rows_lib.num_rows(rows)
  compiled = _first_call(embed_fn, params, rows, key, name)
  batched = np.asarray(compiled(params, rows, key), np.float64)
  if batched.ndim != 2 or batched.shape[0] != num:
    raise ValueError(f"{name} must return (n, d) embeddings, one row per example; got shape "
                     f"{batched.shape} for {num} examples.")
  # Traced again: randomness from Python state changes between traces.
  again = np.asarray(_run_now(embed_fn, params, rows, key), np.float64)
  with jax.ensure_compile_time_eval():
    copies = jax.tree_util.tree_map(lambda a: jnp.repeat(a[:1], num, axis=0), rows)
  alone = np.asarray(compiled(params, copies, key), np.float64)
  if not all(np.all(np.isfinite(a)) for a in (batched, again, alone)):
    return  # non-finite embeddings are handled (dropped) by the gradient itself
  tol = 1e-3 * max(float(np.max(np.abs(batched))), 1e-6)
  if np.max(np.abs(batched - again)) > tol:
    raise ValueError(
        f"{name} is not a function of (params, x, key): two calls with the same key differ "
        f"(max difference {np.max(np.abs(batched - again)):.3g}). Draw all randomness from the "
        "key argument (e.g. rngs={'dropout': key}), not from state kept between calls.")
  if num >= 2 and np.max(np.abs(batched[0] - alone[0])) > tol:
    raise ValueError(
        f"{name} mixes the examples of a batch: with the same key, example 0's embedding "
        "changes when the other examples of its batch change (max difference "
        f"{np.max(np.abs(batched[0] - alone[0])):.3g}). Logit-DP clips per-pair gradients and "
        "needs examples to be independent: no batch norm in training mode, no batch "
        "statistics.")


def check_pair_inputs(x, x_prime, mask, min_batch_size, num_shards=1) -> tuple[Any, Any, Any]:
  """`check_pairs`, and a ValueError when the global batch (num_shards shards of x) holds fewer
  than min_batch_size pairs."""
  x, x_prime, mask = check_pairs(x, x_prime, mask)
  n = rows_lib.num_rows(x)
  if n * num_shards < min_batch_size:  # the pair matrix spans the global batch
    raise ValueError(
        f"the loss needs at least {min_batch_size} pairs per batch, got {n * num_shards}.")
  return x, x_prime, mask


def check_towers(embed_fn: EmbedFn, positive_embed_fn: EmbedFn | None, params, x, x_prime,
                 key=None) -> None:
  """`check_embed_fn` on embed_fn with x and, for two towers, on positive_embed_fn with x_prime
  (stochastic ones with key)."""
  check_embed_fn(embed_fn, params, x, key=key)
  if positive_embed_fn is not None and positive_embed_fn is not embed_fn:
    check_embed_fn(positive_embed_fn, params, x_prime, "positive_embed_fn", key=key)


def check_positive_embed_fn(positive_embed_fn) -> None:
  """ValueError unless positive_embed_fn is callable or None."""
  if positive_embed_fn is not None and not callable(positive_embed_fn):
    raise ValueError(f"positive_embed_fn must be callable or None, got {positive_embed_fn!r}.")


def check_positive_int_or_none(name: str, value, unit: str = "") -> int | None:
  """value if a positive integer or None; ValueError naming ``name`` (and ``unit``) otherwise."""
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
    raise ValueError(f"{name} must be a positive integer{unit} or None, got {value!r}.")
  return value


def check_microbatch(microbatch_size) -> int | None:
  """microbatch_size if a positive integer or None; ValueError otherwise."""
  return check_positive_int_or_none("microbatch_size", microbatch_size)

"""Private fine-tuning: the trainable part of a params pytree (``trainable=``).

A training run that fine-tunes a pretrained encoder trains only some of its parameters; the
others (the pretrained, frozen ones) are constants of the model. ``trainable`` says which:

* a pytree of bools with the structure of params, or a prefix of it (as the labels of
  ``optax.multi_transform``): True at a trainable leaf (or subtree), False at a frozen one;
* or a predicate ``trainable(path, leaf) -> bool`` on every leaf of params, ``path`` its JAX key
  path (``jax.tree_util.keystr(path)`` reads e.g. ``"['params']['Dense_0']['kernel']"``). It is
  also called on trees shaped like params (ḡ, the updates), so it should decide from the path
  and the shape, not the values.

With w = (w_T, w_F) split into the trainable and frozen leaves, every private gradient with
``trainable=`` differentiates Φ(w_T) = embed_fn((w_T, w_F), ·) with w_F closed over: the pair
norms ‖∇_{w_T} Z_ij‖ (every clip method), DP-GCL's group norms, Naive-DP's batch norm and ḡ
are those of that model, and the engine never sees a frozen leaf. ḡ keeps the structure of
params, with exact zeros at the frozen leaves. `masked_optimizer` (and `make_private`'s
optimizer) noise and update only the trainable leaves: a frozen leaf gets no noise, no update
and no optimizer state.

Formal guarantees. Frozen leaves are constants of the function whose gradient is clipped, so
the sensitivity of ḡ_T (and of the released updates of the trainable leaves) is that of the
closed-over model: the one `logit_dp.sensitivity` gives, unchanged. The released output is w_T's
updates; w_F is released as it was given. This is private provided w_F does not depend on the
private data (pretrained on public data, or random): docs/PRIVACY.md, "Fine-tuning: frozen
parameters".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logit_dp._src import precision

__all__ = [
    "check_trainable", "closed", "combine", "keep_frozen", "masked_optimizer", "partition",
    "restrict", "trainable_mask"
]

_STRUCTURE_HINT = ("trainable must be a pytree of bools with the structure of params, or a "
                   "prefix of it (as optax.multi_transform's labels), or a predicate "
                   "trainable(path, leaf) -> bool")


def _is_predicate(trainable) -> bool:
  leaves = jax.tree_util.tree_leaves(trainable)
  return callable(trainable) and len(leaves) == 1 and leaves[0] is trainable


def _as_bool(value, where: str) -> bool:
  """value as a Python bool if it is a bool (Python, NumPy, or a 0-d bool array); TypeError
  naming ``trainable`` otherwise (0/1, strings, tracers)."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, (np.ndarray, jax.Array)) and value.shape == () and value.dtype == bool:
    try:
      return bool(value)
    except jax.errors.ConcretizationTypeError:
      pass
  raise TypeError(f"{_STRUCTURE_HINT}: {where} is {value!r} ({type(value).__name__}), not a "
                  "bool (True: trained, False: frozen).")


def check_trainable(trainable) -> Any:
  """trainable as given if it is a predicate or a pytree of bools with one True at least.

  TypeError for a leaf that is not a bool, ValueError for a mask with no leaf or no True leaf
  (nothing to train). The structure is checked against params where params are first seen
  (`trainable_mask`).
  """
  if trainable is None or _is_predicate(trainable):
    return trainable
  leaves = jax.tree_util.tree_leaves(trainable)
  if not leaves:
    raise ValueError(f"{_STRUCTURE_HINT}; got {trainable!r}, which has no leaf.")
  flags = [_as_bool(leaf, "a leaf") for leaf in leaves]
  if not any(flags):
    raise ValueError("trainable marks every parameter frozen (no True leaf): there is nothing to "
                     "train. Mark the parameters to fine-tune True.")
  return trainable


def _flags(trainable, params) -> list[bool]:
  """One bool per leaf of params (in tree_leaves order)."""
  check_trainable(trainable)
  with_path, _ = jax.tree_util.tree_flatten_with_path(params)
  if not with_path:
    raise ValueError("params has no leaf: there is nothing to train.")
  if _is_predicate(trainable):
    flags = [
        _as_bool(trainable(path, leaf), f"trainable{jax.tree_util.keystr(path)}")
        for path, leaf in with_path
    ]
  else:
    try:
      expanded = jax.tree_util.tree_map(
          lambda flag, sub: jax.tree_util.tree_map(lambda _: flag, sub), trainable, params)
    except (ValueError, TypeError) as e:
      raise ValueError(f"{_STRUCTURE_HINT}; its structure does not match params: {e}") from None
    flags = [bool(flag) for flag in jax.tree_util.tree_leaves(expanded)]
    if len(flags) != len(with_path):
      raise ValueError(f"{_STRUCTURE_HINT}; it marks {len(flags)} leaves and params has "
                       f"{len(with_path)}.")
  if not any(flags):
    raise ValueError("trainable marks every leaf of params frozen: there is nothing to train. "
                     "Mark the parameters to fine-tune True.")
  return flags


def trainable_mask(trainable, params) -> Any:
  """The pytree of bools with params' structure: True at the trainable leaves.

  Args:
    trainable: a pytree of bools (params' structure or a prefix of it) or a predicate
      ``(path, leaf) -> bool`` (module docstring).
    params: the parameters (or a tree with their structure, such as ḡ).

  Raises:
    ValueError: the structure does not match params, or nothing is trainable.
    TypeError: a mask leaf or a predicate's result is not a bool.
  """
  treedef = jax.tree_util.tree_structure(params)
  return treedef.unflatten(_flags(trainable, params))


def partition(params, trainable) -> tuple[Any, Any]:
  """(trainable part, frozen part): two trees with params' structure, each holding None where
  the other holds a leaf (as ``equinox.partition``); `combine` joins them."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  flags = _flags(trainable, params)
  return (treedef.unflatten([leaf if f else None for leaf, f in zip(leaves, flags)]),
          treedef.unflatten([None if f else leaf for leaf, f in zip(leaves, flags)]))


def combine(*parts) -> Any:
  """The tree of `partition`'s parts joined: at every leaf, the first part's value that is not
  None."""
  def first(*values):
    for value in values:
      if value is not None:
        return value
    return None

  return jax.tree_util.tree_map(first, *parts, is_leaf=lambda v: v is None)


def _zeros_like_grad(leaf) -> jax.Array:
  """Exact zeros in the dtype ḡ has at this leaf (float32 for a bfloat16 leaf)."""
  dtype = precision.compute_dtype(getattr(leaf, "dtype", None) or jnp.asarray(leaf).dtype)
  return jnp.zeros(jnp.shape(leaf), dtype)


def closed(fn, frozen, stochastic: bool = False) -> Callable | None:
  """fn(params, x[, key]) with the frozen part (`partition`) closed over: a function
  (trainable part, x[, key]) -> fn(combine(trainable part, frozen), x[, key]); None for None."""
  if fn is None:
    return None
  if stochastic:

    def closed_stochastic(trainable_part, x, key):
      return fn(combine(trainable_part, frozen), x, key)

    return closed_stochastic

  def closed_fn(trainable_part, x):
    return fn(combine(trainable_part, frozen), x)

  return closed_fn


def restrict(build: Callable[..., Any], embed_fn, positive_embed_fn, stochastic: bool,
             trainable) -> Any:
  """The gradient function of ``build`` with only the ``trainable`` leaves differentiated.

  build(embed_fn, positive_embed_fn) -> a `ClippedGradFn`. The returned function takes the full
  params; at every trace its core partitions them, builds ``build`` on embed_fn (and
  positive_embed_fn) with the frozen leaves closed over, calls that core on the trainable part
  and returns ḡ with params' structure, exact zeros at the frozen leaves. Its input checks,
  model check, mechanism and sensitivity are those of ``build(embed_fn, positive_embed_fn)``.
  """
  trainable = check_trainable(trainable)
  template = build(embed_fn, positive_embed_fn)

  def restricted(which: str):
    def core(params, *args):
      frozen_free, frozen = partition(params, trainable)
      inner = build(closed(embed_fn, frozen, stochastic),
                    closed(positive_embed_fn, frozen, stochastic))
      loss_value, grads, extra = getattr(inner, which)(frozen_free, *args)
      zeros = jax.tree_util.tree_map(_zeros_like_grad, frozen)
      return loss_value, combine(grads, zeros), extra

    return core

  return dataclasses.replace(
      template, core=jax.jit(restricted("core")),
      stats_core=None if template.stats_core is None else jax.jit(restricted("stats_core")),
      trainable=trainable, _checked=[])


def masked_optimizer(optimizer: optax.GradientTransformation,
                     trainable) -> optax.GradientTransformation:
  """``optimizer`` on the trainable leaves only (``optax.masked``): the frozen leaves' updates
  pass through as they come (exact zeros from a ḡ with ``trainable=``) and they hold no state
  (adam keeps no moments for them)."""
  trainable = check_trainable(trainable)
  return optax.masked(optimizer, lambda tree: trainable_mask(trainable, tree))


def keep_frozen(new_params, params, trainable) -> Any:
  """new_params with the frozen leaves of params exactly as they were (bit for bit)."""
  if trainable is None:
    return new_params
  trained, _ = partition(new_params, trainable)
  _, frozen = partition(params, trainable)
  return combine(trained, frozen)

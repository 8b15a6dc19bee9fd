"""Inputs as examples along axis 0: an array, or a pytree of arrays with as many rows each."""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import jax.numpy as jnp


def num_rows(x) -> int:
  """The number of examples of an input (array or pytree of arrays, examples along axis 0)."""
  return jax.tree_util.tree_leaves(x)[0].shape[0]


def take_row(x, i) -> Any:
  """Example i of an input (array or pytree)."""
  return jax.tree_util.tree_map(lambda a: a[i], x)


def first_row(x) -> Any:
  """The first example of an input with its batch axis (array or pytree)."""
  return jax.tree_util.tree_map(lambda a: a[:1], x)


def is_traced(tree) -> bool:
  """Whether any leaf of tree is a tracer (the call is inside jit, vmap, grad, ...)."""
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


def same_layout(x, x_prime) -> bool:
  """Whether two inputs have the same pytree structure, leaf shapes and dtypes (so that they
  stack into one array per leaf)."""
  leaves, treedef = jax.tree_util.tree_flatten(x)
  leaves_prime, treedef_prime = jax.tree_util.tree_flatten(x_prime)
  return treedef == treedef_prime and all(
      a.shape == b.shape and a.dtype == b.dtype for a, b in zip(leaves, leaves_prime))


def finite_rows(x) -> jax.Array:
  """(n,): whether every floating entry of each example (in every leaf) is finite."""
  ok = jnp.ones((num_rows(x),), bool)
  for a in jax.tree_util.tree_leaves(x):
    if jnp.issubdtype(a.dtype, jnp.inexact):
      ok = ok & jnp.all(jnp.isfinite(a).reshape(a.shape[0], -1), axis=1)
  return ok


def where_rows(ok: jax.Array, x) -> Any:
  """x with the examples where ok is False set to zeros."""
  return jax.tree_util.tree_map(
      lambda a: jnp.where(ok.reshape((-1,) + (1,) * (a.ndim - 1)), a, jnp.zeros_like(a)), x)


def map_rows(fn, xs, batch_size) -> Any:
  """fn over the leading axis in chunks of batch_size (vmap if None)."""
  if batch_size is None or batch_size >= jax.tree_util.tree_leaves(xs)[0].shape[0]:
    return jax.vmap(fn)(xs)
  return jax.lax.map(fn, xs, batch_size=batch_size)

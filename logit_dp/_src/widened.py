"""Pair-gradient norms computed in float64 inside a float32 computation: `pair_norms`.

The float64 values are traced under `jax.enable_x64`; a jaxpr holding float64 operations can
not be transformed again once that context has ended (batching or differentiating it
re-derives float64 types without x64 and fails). So the float64 computation is one opaque
function: `jax.custom_batching.custom_vmap` batches it by mapping it over the batch axis
(traced under x64 again), and `jax.custom_jvp` gives its derivative as that of the same norms
computed in the inputs' own dtype (the same function, so the same derivative up to rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from logit_dp._src import dot_convolution
from logit_dp._src import numerics


def widen(tree) -> Any:
  """tree with its float leaves as float64 (ints and bools kept); call under x64."""
  return jax.tree_util.tree_map(
      lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def round_up(values: jax.Array, dtype) -> jax.Array:
  """values (≥ 0) in `dtype`, never below them: one step up from the nearest rounding."""
  rounded = values.astype(dtype)
  return rounded if rounded.dtype == values.dtype else jnp.nextafter(rounded, jnp.inf)


def _norms(pair_grad: Callable, params, pairs, chunk: int, finish: Callable) -> jax.Array:
  """finish(‖pair_grad(params, pair_e)‖) for every pair e of pairs, chunk pairs at a time
  (finish, elementwise, runs in the loop's body: no kernels of its own after the loop)."""
  def one(pair):
    grads = pair_grad(params, pair)
    return finish(jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(grads))))

  return jax.lax.map(one, pairs, batch_size=max(1, int(chunk)))


def pair_norms(pair_grad: Callable, params, pairs, out_dtype, chunk: int, in_float64: bool = True,
               native_dtype=None) -> tuple[jax.Array, np.dtype]:
  """(‖g_e‖ (n,), dtype): the norms of g_e = pair_grad(params, pair_e) for the pairs e of
  pairs (a pytree, the pairs along axis 0 of every leaf), computed with params and float
  inputs widened to float64 and rounded up to out_dtype; dtype is the lowest precision that
  computation ran in (`numerics.computation_dtype`: float64 unless pair_grad casts down
  internally).

  in_float64=False computes them in the inputs' own dtype instead (a model that draws random
  numbers: under float64 its draws would differ from those of the rest of the computation);
  native_dtype is then that computation's dtype when the caller knows it.
  """
  first = lambda t: jax.tree_util.tree_map(lambda a: a[0], t)
  if not in_float64:
    dtype = native_dtype or numerics.computation_dtype(pair_grad, params, first(pairs))
    return _norms(pair_grad, params, pairs, chunk, lambda v: v.astype(out_dtype)), dtype

  def norms_in_float64(p, a):
    with jax.enable_x64(True):
      p, a = widen((p, a))
      grad64 = dot_convolution.convolutions_as_dots(pair_grad)
      return _norms(grad64, p, a, chunk, lambda v: round_up(v, out_dtype))

  # Traced once under x64; its constants (the convolutions' patch indices, values pair_grad
  # closes over) become arguments of the custom_vmap function, which cannot close over values
  # an enclosing transformation batches (a cond with a batched predicate batches every
  # operand of its branches).
  with jax.enable_x64(True):
    closed = jax.make_jaxpr(norms_in_float64)(params, pairs)

  @jax.custom_batching.custom_vmap
  def norms(p, a, consts):
    with jax.enable_x64(True):
      return jex.jaxpr_as_fun(jex.ClosedJaxpr(closed.jaxpr,
                                              consts))(*jax.tree_util.tree_leaves((p, a)))[0]

  @norms.def_vmap
  def _batched(axis_size, in_batched, p, a, consts):
    del axis_size  # lax.map over the batched arguments; the others are the same for each
    leaves, treedef = jax.tree_util.tree_flatten((p, a, consts))
    batched = jax.tree_util.tree_leaves(tuple(in_batched))

    def one(batched_leaves):
      rest = iter(batched_leaves)
      return norms(*jax.tree_util.tree_unflatten(
          treedef, [next(rest) if b else leaf for leaf, b in zip(leaves, batched)]))

    return jax.lax.map(one, [leaf for leaf, b in zip(leaves, batched) if b]), True

  @jax.custom_jvp
  def differentiable(p, a):
    return norms(p, a, list(closed.consts))

  @differentiable.defjvp
  def _jvp(primals, tangents):
    native = lambda p, a: _norms(pair_grad, p, a, chunk, lambda v: v.astype(out_dtype))
    _, tangent = jax.jvp(native, primals, tangents)
    return differentiable(*primals), tangent

  with jax.enable_x64(True):
    dtype = numerics.computation_dtype(pair_grad, *widen((params, first(pairs))))
  return differentiable(params, pairs), dtype

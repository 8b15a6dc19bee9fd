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


def _sq_norms(pair_grad: Callable, params, x, x_prime, chunk: int) -> jax.Array:
  """‖pair_grad(params, x_e, x'_e)‖² for every example e, chunk examples at a time."""
  def one(pair):
    grads = pair_grad(params, *pair)
    return sum(jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(grads))

  return jax.lax.map(one, (x, x_prime), batch_size=max(1, int(chunk)))


def pair_norms(pair_grad: Callable, params, x, x_prime, out_dtype, chunk: int,
               in_float64: bool = True, native_dtype=None) -> tuple[jax.Array, np.dtype]:
  """(‖g_e‖ (n,), dtype): the norms of g_e = pair_grad(params, x_e, x'_e) for the examples e
  of x and x_prime (axis 0), computed with params and float inputs widened to float64 and
  rounded up to out_dtype; dtype is the lowest precision that computation ran in
  (`numerics.computation_dtype`: float64 unless pair_grad casts down internally).

  in_float64=False computes them in the inputs' own dtype instead (a model that draws random
  numbers: under float64 its draws would differ from those of the rest of the computation);
  native_dtype is then that computation's dtype when the caller knows it.
  """
  if not in_float64:
    one = lambda t: jax.tree_util.tree_map(lambda a: a[0], t)
    dtype = native_dtype or numerics.computation_dtype(pair_grad, params, one(x), one(x_prime))
    return jnp.sqrt(_sq_norms(pair_grad, params, x, x_prime, chunk)).astype(out_dtype), dtype

  def norms_in_float64(p, a, b):
    with jax.enable_x64(True):
      p, a, b = widen((p, a, b))
      grad64 = dot_convolution.convolutions_as_dots(pair_grad)
      return round_up(jnp.sqrt(_sq_norms(grad64, p, a, b, chunk)), out_dtype)

  @jax.custom_batching.custom_vmap
  def norms(p, a, b):
    return norms_in_float64(p, a, b)

  @norms.def_vmap
  def _batched(axis_size, in_batched, p, a, b):
    args = jax.tree_util.tree_map(
        lambda t, batched: t
        if batched else jnp.broadcast_to(t, (axis_size,) + jnp.shape(t)), (p, a, b),
        tuple(in_batched))
    return jax.lax.map(lambda one: norms(*one), args), True

  @jax.custom_jvp
  def differentiable(p, a, b):
    return norms(p, a, b)

  @differentiable.defjvp
  def _jvp(primals, tangents):
    native = lambda p, a, b: jnp.sqrt(_sq_norms(pair_grad, p, a, b, chunk)).astype(out_dtype)
    _, tangent = jax.jvp(native, primals, tangents)
    return norms(*primals), tangent

  with jax.enable_x64(True):
    one = lambda t: t[0]
    dtype = numerics.computation_dtype(
        pair_grad,
        *widen((params, jax.tree_util.tree_map(one, x), jax.tree_util.tree_map(one, x_prime))))
  return differentiable(params, x, x_prime), dtype

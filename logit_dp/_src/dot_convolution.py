"""Convolutions evaluated as matrix products: `convolutions_as_dots(fn)`.

XLA:CPU has a fast convolution kernel for float32 and float16 only; a float64 convolution runs
through a generic loop about 100× slower than the same work as a float64 matrix product. The
float64 positive-pair norms (`widened.pair_norms`) differentiate the model, so every forward
convolution and the two convolutions of its backward pass (with respect to the input: a
dilated convolution with the flipped kernel; with respect to the kernel: a convolution of the
input by the output cotangent, with batch groups for grouped convolutions) are rewritten.

A convolution of x (N, C, *S) by w (O, C/G, *K) with G feature groups gathers the patches
of the padded (and input-dilated) x, (N, C, taps, positions), and contracts them with w over
the channels and the kernel offsets k:

    y[n, o, s] = Σ_k Σ_c x_pad[n, g(o)·C/G + c, s·stride + k·rhs_dilation] · w[o, c, k].

The rewrite is exact in real arithmetic (the same products, summed in another order).
Convolutions inside control flow (scan, while, cond) are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

# Higher-order primitives whose body is evaluated inline, with the name of their jaxpr.
_INLINED = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
}


def convolution_as_dot(lhs: jax.Array, rhs: jax.Array, *, window_strides, padding, lhs_dilation,
                       rhs_dilation, dimension_numbers, feature_group_count: int,
                       batch_group_count: int, precision=None, preferred_element_type=None,
                       **unused) -> jax.Array:
  """`lax.conv_general_dilated`'s result (the parameters of its jaxpr equation) from one gather
  of patches and one `lax.dot_general`."""
  del unused
  lhs_spec, rhs_spec, out_spec = dimension_numbers
  # Channels last: each gathered patch entry is a contiguous row of channels.
  x = jnp.transpose(lhs, (lhs_spec[0],) + tuple(lhs_spec[2:]) + (lhs_spec[1],))  # (N, *S, C)
  w = jnp.transpose(rhs, rhs_spec)  # (O, I, *K)
  zero = jnp.zeros((), x.dtype)
  x = lax.pad(x, zero, [(0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation)]
              + [(0, 0, 0)])
  n, c = x.shape[0], x.shape[-1]
  o, i = w.shape[:2]
  kernel = w.shape[2:]
  out = tuple((x.shape[1 + a] - (kernel[a] - 1) * rhs_dilation[a] - 1) // window_strides[a] + 1
              for a in range(len(kernel)))
  taps, positions = int(np.prod(kernel)), int(np.prod(out))
  # Flat index into x_pad's spatial positions of s·stride + k·rhs_dilation, (taps, positions).
  rank = len(kernel)
  coords = []
  for a, (k, d, m, t) in enumerate(zip(kernel, rhs_dilation, out, window_strides)):
    shape = [1] * (2 * rank)
    shape[a], shape[rank + a] = k, m
    coords.append((np.arange(k)[:, None] * d + np.arange(m)[None, :] * t).reshape(shape))
  flat = np.ravel_multi_index(tuple(np.broadcast_arrays(*coords)), x.shape[1:-1])
  patches = x.reshape(n, -1, c).at[:, flat.reshape(taps, positions)].get(
      mode="promise_in_bounds")  # (N, taps, positions, C)
  w = w.reshape(o, i, taps)
  dot = lambda a, b, dims: lax.dot_general(a, b, dims, precision=precision, preferred_element_type=
                                           preferred_element_type)
  if feature_group_count > 1:
    g = feature_group_count
    patches = patches.reshape(n, taps, positions, g, c // g)
    w = w.reshape(g, o // g, i, taps)
    y = dot(patches, w, (((1, 4), (3, 2)), ((3,), (0,))))  # (G, N, positions, O/G)
    y = jnp.moveaxis(y, 0, 2).reshape(n, positions, o)
  elif batch_group_count > 1:
    g = batch_group_count
    patches = patches.reshape(g, n // g, taps, positions, c)
    w = w.reshape(g, o // g, i, taps)
    y = dot(patches, w, (((2, 4), (3, 2)), ((0,), (0,))))  # (G, N/G, positions, O/G)
    y = jnp.moveaxis(y, 0, 2).reshape(n // g, positions, o)
  else:
    y = dot(patches, w, (((1, 3), (2, 1)), ((), ())))  # (N, positions, O)
  y = y.reshape((y.shape[0],) + out + (o,))
  y = jnp.moveaxis(y, -1, 1)  # (N, O, *out)
  return jnp.transpose(y, tuple(int(a) for a in np.argsort(out_spec)))


def _evaluate(jaxpr: core.Jaxpr, consts, *args) -> list:
  """jaxpr's outputs on args with every convolution outside control flow as `convolution_as_dot`."""
  env: dict = {}
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  for var, value in zip(jaxpr.constvars, consts):
    env[var] = value
  for var, value in zip(jaxpr.invars, args):
    env[var] = value
  for eqn in jaxpr.eqns:
    inputs = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name == "conv_general_dilated":
      outputs = [convolution_as_dot(*inputs, **eqn.params)]
    elif name in _INLINED and _INLINED[name] in eqn.params:
      body = eqn.params[_INLINED[name]]
      if isinstance(body, core.ClosedJaxpr):
        outputs = _evaluate(body.jaxpr, body.consts, *inputs)
      else:
        outputs = _evaluate(body, (), *inputs)
    else:
      bound = eqn.primitive.get_bind_params(eqn.params)
      subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
      with eqn.ctx.manager:
        result = eqn.primitive.bind(*subfuns, *inputs, **params)
      outputs = result if eqn.primitive.multiple_results else [result]
    env.update(zip(eqn.outvars, outputs))
  return [read(v) for v in jaxpr.outvars]


def convolutions_as_dots(fn: Callable) -> Callable:
  """fn with the convolutions it traces (outside control flow) evaluated by `convolution_as_dot`:
  the same values up to rounding, and a float64 computation XLA:CPU runs at matrix-product speed."""
  def rewritten(*args):
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    outputs = _evaluate(closed.jaxpr, closed.consts, *jax.tree_util.tree_leaves(args))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outputs)

  return rewritten

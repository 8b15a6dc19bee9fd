"""Convolutions evaluated as matrix products: `convolutions_as_dots(fn)`.

XLA:CPU has a fast convolution kernel for float32 and float16 only; a float64 convolution runs
through a generic loop about 100× slower than the same work as a float64 matrix product. The
float64 positive-pair norms (`widened.pair_norms`) differentiate the model, so every forward
convolution and the two convolutions of its backward pass (with respect to the input: a
dilated convolution with the flipped kernel; with respect to the kernel: a convolution of the
input by the output cotangent, with batch groups for grouped convolutions) are rewritten.

A convolution of x (N, C, *S) by w (O, C/G, *K) with G feature groups gathers the patches
of the padded (and input-dilated) x (`layers.conv.conv_patches`) and contracts them with w over
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

from logit_dp._src import linear_ops
from logit_dp._src.layers import conv


def convolution_as_dot(lhs: jax.Array, rhs: jax.Array, out_shape, *, window_strides, padding,
                       lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count: int,
                       batch_group_count: int, precision=None, preferred_element_type=None,
                       **unused) -> jax.Array:
  """`lax.conv_general_dilated`'s result of shape out_shape (the parameters of its jaxpr
  equation) from one gather of patches and one `lax.dot_general`."""
  del unused
  lhs_spec, rhs_spec, out_spec = dimension_numbers
  x = jnp.transpose(lhs, (lhs_spec[0],) + tuple(lhs_spec[2:]) + (lhs_spec[1],))  # (N, *S, C)
  w = jnp.transpose(rhs, tuple(rhs_spec[2:]) + (rhs_spec[1], rhs_spec[0]))  # (*K, I, O)
  kernel, (i, o) = w.shape[:-2], w.shape[-2:]
  patches = conv.conv_patches(x, kernel, window_strides, padding, lhs_dilation,
                              rhs_dilation)  # (N, positions, taps·C), offset-major
  n, positions, c = x.shape[0], patches.shape[1], x.shape[-1]
  taps = int(np.prod(kernel))
  patches = patches.reshape(n, positions, taps, c)
  dot = lambda a, b, dims: lax.dot_general(a, b, dims, precision=precision, preferred_element_type=
                                           preferred_element_type)
  if feature_group_count > 1:
    g = feature_group_count
    patches = patches.reshape(n, positions, taps, g, c // g)
    w = w.reshape(taps, i, g, o // g)
    y = dot(patches, w, (((2, 4), (0, 1)), ((3,), (2,))))  # (G, N, positions, O/G)
    y = jnp.moveaxis(y, 0, 2).reshape(n, positions, o)
  elif batch_group_count > 1:
    g = batch_group_count
    patches = patches.reshape(g, n // g, positions, taps, c)
    w = w.reshape(taps, i, g, o // g)
    y = dot(patches, w, (((3, 4), (0, 1)), ((0,), (2,))))  # (G, N/G, positions, O/G)
    y = jnp.moveaxis(y, 0, 2).reshape(n // g, positions, o)
  else:
    y = dot(patches, w.reshape(taps, i, o), (((2, 3), (0, 1)), ((), ())))  # (N, positions, O)
  out = tuple(out_shape[a] for a in out_spec[2:])
  y = jnp.moveaxis(y.reshape((y.shape[0],) + out + (o,)), -1, 1)  # (N, O, *out)
  return jnp.transpose(y, tuple(int(a) for a in np.argsort(out_spec)))


def _as_dot(eqn, values) -> list | None:
  if eqn.primitive.name == "conv_general_dilated":
    return [convolution_as_dot(values[0], values[1], eqn.outvars[0].aval.shape, **eqn.params)]
  return None


def convolutions_as_dots(fn: Callable) -> Callable:
  """fn with the convolutions it traces (outside control flow) evaluated by `convolution_as_dot`:
  the same values up to rounding, and a float64 computation XLA:CPU runs at matrix-product speed."""
  def rewritten(*args):
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    outputs = linear_ops.evaluate_substituting(closed, jax.tree_util.tree_leaves(args), _as_dot)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outputs)

  return rewritten

"""Convolutions: ``conv_general_dilated(A, W')`` with one feature group and one batch group,
the example axis leading, any strides, padding and dilations (flax/nnx ``Conv``, Equinox
``Conv``, ``lax.conv``): t the output positions, A[e, t] the input patch of position t
(`conv_patches`). Computed, when perturbed, as a channels-last convolution
(`channels_last_conv`), which XLA:CPU runs at full speed inside loop bodies."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import linear as flax_linear

from logit_dp._src import linear_ops
from logit_dp._src.layers import base


class Conv(base.LayerKind):
  """y[e, t, c] = Σ_p A[e, t, p] K[p, c], p over (window, input channel)."""
  name = "conv"
  primitive = "conv_general_dilated"
  kernel_operands = (1,)

  def recognise(self, eqn, path, kernel_position, kernel) -> linear_ops.LinearOp | None:
    """The canonical form of a one-group convolution with the leaf as kernel."""
    del kernel_position  # the kernel, operand 1
    params = eqn.params
    if (params["feature_group_count"] != 1 or params["batch_group_count"] != 1
        or params.get("preferred_element_type") not in (None, jnp.float32)):
      return None
    act_aval, w_aval, out_aval = (eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval)
    if not self.all_float32(act_aval, w_aval, out_aval):
      return None
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    if lhs_spec[0] != 0:
      return None
    input_axes = (lhs_spec[0],) + tuple(lhs_spec[2:]) + (lhs_spec[1],)
    kernel_axes = tuple(rhs_spec[2:]) + (rhs_spec[1], rhs_spec[0])
    raw_to_canonical = (out_spec[0],) + tuple(out_spec[2:]) + (out_spec[1],)
    window = tuple(int(w_aval.shape[a]) for a in rhs_spec[2:])
    features = int(w_aval.shape[rhs_spec[0]])
    fan_in = int(np.prod(window, dtype=np.int64)) * int(w_aval.shape[rhs_spec[1]])
    leaf, index, leaf_shape = kernel
    axes, ok = self.kernel_axes(
        np.transpose(index, kernel_axes).reshape(fan_in, features), leaf_shape)
    if not ok:
      return None
    config = (window, tuple(params["window_strides"]), tuple(tuple(p) for p in params["padding"]),
              tuple(params["lhs_dilation"]), tuple(params["rhs_dilation"]))
    out_shape = tuple(int(out_aval.shape[a]) for a in raw_to_canonical[1:])
    return linear_ops.LinearOp(path, self.name, leaf, axes, 0, tuple(act_aval.shape), out_shape,
                               fan_in, features, (), raw_to_canonical, input_axes, kernel_axes,
                               config, params.get("precision"))

  def patches(self, op, act) -> jax.Array:
    """A: the input patches (m, T, window·C_in), kernel-offset major (`conv_patches`)."""
    return conv_patches(jnp.transpose(act, op.conv_input_axes), *op.conv_config)

  def forward(self, op, values, compute) -> jax.Array:
    """The convolution by `channels_last_conv`, in the equation's output layout."""
    del compute
    act, kernel = values
    y = channels_last_conv(jnp.transpose(act, op.conv_input_axes),
                           jnp.transpose(kernel, op.conv_kernel_axes), op.conv_config, op.precision)
    return op.to_raw(y)


def flax_conv_config(module, x) -> tuple | None:
  """(kernel_size, strides, padding, lhs_dil, rhs_dil) if this nn.Conv call is reproduced exactly.

  None otherwise.
  """
  kernel_size = ((module.kernel_size,)
                 if isinstance(module.kernel_size, int) else tuple(module.kernel_size))
  if (len(kernel_size) > 3 or x.ndim != len(kernel_size) + 2 or module.feature_group_count != 1
      or module.mask is not None or getattr(module, "conv_general_dilated", None) is not None
      or getattr(module, "conv_general_dilated_cls", None) is not None):
    return None

  def broadcast(v):
    v = 1 if v is None else v
    return (v,) * len(kernel_size) if isinstance(v, int) else tuple(v)

  padding = flax_linear.canonicalize_padding(module.padding, len(kernel_size))
  if isinstance(padding, str) and padding not in ("SAME", "VALID"):
    return None  # CIRCULAR / REFLECT / CAUSAL pad the input themselves
  return (kernel_size, broadcast(module.strides), padding, broadcast(module.input_dilation),
          broadcast(module.kernel_dilation))


def _dilated(sizes, dilation):
  return [0 if s == 0 else 1 + d * (s - 1) for s, d in zip(sizes, dilation)]


def _explicit_padding(x, kernel_size, strides, padding, lhs_dilation, rhs_dilation):
  if not isinstance(padding, str):
    return tuple(tuple(p) for p in padding)
  return tuple(
      jax.lax.padtype_to_pads(_dilated(x.shape[1:-1], lhs_dilation),
                              _dilated(kernel_size, rhs_dilation), strides, padding))


def _conv(x, kernel, strides, padding, lhs_dilation, rhs_dilation, precision):
  """Channels-last convolution (N, *spatial, C) * (*window, I, O), explicit padding."""
  return jax.lax.conv_general_dilated(
      x,
      kernel,
      strides,
      padding,
      lhs_dilation=lhs_dilation,
      rhs_dilation=rhs_dilation,
      dimension_numbers=flax_linear._conv_dimension_numbers(x.shape),  # pylint: disable=protected-access
      precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def channels_last_conv(x, kernel, config, precision) -> jax.Array:
  """nn.Conv's convolution for a `flax_conv_config` config, with a backward pass made of
  channels-last convolutions only.

  Same values and gradients as jax.lax.conv_general_dilated. JAX differentiates a convolution
  into convolutions with transposed dimension labels, which XLA:CPU runs 4-50x slower inside a
  loop body (lax.map / scan, as in microbatching) than outside one
  (https://github.com/jax-ml/jax/issues/12868); here the operands are transposed explicitly
  instead, so every convolution has the labels of the forward one.
  """
  _, strides, _, lhs_dil, rhs_dil = config
  return _conv(x, kernel, strides, _explicit_padding(x, *config), lhs_dil, rhs_dil, precision)


def _channels_last_conv_fwd(x, kernel, config, precision):
  return channels_last_conv(x, kernel, config, precision), (x, kernel)


def _channels_last_conv_bwd(config, precision, residuals, g):
  """x̄ = g ⋆ flip(W)ᵀ (strides ↔ input dilation); W̄ = x ⋆ g over the batch (as in JAX)."""
  x, kernel = residuals
  kernel_size, strides, _, lhs_dil, rhs_dil = config
  padding = _explicit_padding(x, *config)
  in_sizes, out_sizes = x.shape[1:-1], g.shape[1:-1]
  in_d = _dilated(in_sizes, lhs_dil)
  window_d = _dilated(kernel_size, rhs_dil)
  out_d = _dilated(out_sizes, strides)
  lhs_before = [w - lo - 1 for w, (lo, _) in zip(window_d, padding)]
  lhs_padding = [(b, i + w - 1 - o - b) for b, i, w, o in zip(lhs_before, in_d, window_d, out_d)]
  spatial = tuple(range(len(kernel_size)))
  flipped = jnp.swapaxes(jnp.flip(kernel, spatial), -1, -2)  # (*window, O, I)
  x_bar = _conv(g, flipped, lhs_dil, lhs_padding, strides, rhs_dil, precision)
  rhs_padding = [
      (lo, o - i + w - lo - 1) for (lo, _), i, w, o in zip(padding, in_d, window_d, out_d)
  ]
  # Batch as the contracted feature axis: x as (C_in, *spatial, N), g as (*out, N, C_out).
  kernel_bar = _conv(jnp.swapaxes(x, 0, -1), jnp.moveaxis(g, 0, -2), rhs_dil, rhs_padding, lhs_dil,
                     strides, precision)  # (C_in, *window, C_out)
  return x_bar, jnp.moveaxis(kernel_bar, 0, -2).astype(kernel.dtype)


channels_last_conv.defvjp(_channels_last_conv_fwd, _channels_last_conv_bwd)


def conv_patches(x, kernel_size, strides, padding, lhs_dilation, rhs_dilation) -> jax.Array:
  """Input patches of a channels-last convolution: (N, T, K·C_in), kernel-offset major.

  Row t, column (o, c) is the input value that kernel offset o, input channel c multiply
  at output position t (zero where padded), so y_t = patches_t · kernel.reshape(K·C_in, C_out)
  for a kernel of shape (*kernel_size, C_in, C_out), exactly as lax.conv_general_dilated.
  One gather from the padded input (one kernel, not one slice per kernel offset).
  """
  spatial = x.shape[1:-1]
  dilated_in = [(s - 1) * d + 1 for s, d in zip(spatial, lhs_dilation)]
  dilated_k = [(k - 1) * d + 1 for k, d in zip(kernel_size, rhs_dilation)]
  if isinstance(padding, str):
    padding = jax.lax.padtype_to_pads(dilated_in, dilated_k, strides, padding)
  config = [(0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation)
                         ] + [(0, 0, 0)]
  padded = jax.lax.pad(x, jnp.zeros((), x.dtype), config)
  out = [(p - k) // s + 1 for p, k, s in zip(padded.shape[1:-1], dilated_k, strides)]
  rank = len(kernel_size)
  # Index of padded position along spatial axis i for output position o_i and kernel offset
  # k_i, shaped to broadcast to (*out, *kernel_size).
  index = []
  for i, (m, k, s, d) in enumerate(zip(out, kernel_size, strides, rhs_dilation)):
    shape = [1] * (2 * rank)
    shape[i], shape[rank + i] = m, k
    index.append((np.arange(m)[:, None] * s + np.arange(k)[None, :] * d).reshape(shape))
  where = (slice(None),) + tuple(index) + (slice(None),)
  patches = padded.at[where].get(mode="promise_in_bounds")  # (N, *out, *kernel_size, C_in)
  return patches.reshape(x.shape[0], int(np.prod(out)), -1)

"""Embedding lookups: a ``gather`` of whole rows of a (V, C) table, y[e, t, c] = W[i_et, c]
(``jnp.take(W, ids, axis=0)``, flax/nnx ``Embed``, Equinox's vmapped ``Embedding``): the dense
form with one-hot patches, A[e, t] = onehot(i_et) of the table's V rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logit_dp._src import linear_ops
from logit_dp._src.layers import base


class Embed(base.LayerKind):
  """The gather reads whole rows: slice sizes (1, C), the row index first in each index
  vector; a second index (the column start, as vmap writes a row read) is ignored only where
  the mode clamps it, so that it is 0 whatever its value (CLIP, PROMISE_IN_BOUNDS); a clamped
  row index is clamped the same way in the patches."""
  name = "embed"
  primitive = "gather"
  kernel_operands = (0,)

  def recognise(self, eqn, path, kernel_position, kernel) -> linear_ops.LinearOp | None:
    """The canonical form of a whole-row gather from the (V, C) table leaf."""
    del kernel_position  # the table, operand 0
    dims, params = eqn.params["dimension_numbers"], eqn.params
    w_aval, ids_aval, out_aval = eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval
    mode = str(params.get("mode"))
    clamps = "CLIP" in mode or "PROMISE_IN_BOUNDS" in mode
    if (w_aval.ndim != 2 or ids_aval.ndim < 2 or not self.all_float32(w_aval, out_aval)
        or not jnp.issubdtype(ids_aval.dtype, jnp.integer)
        or tuple(getattr(dims, "operand_batching_dims",
                         ())) != () or tuple(params["slice_sizes"]) != (1, w_aval.shape[1])):
      return None
    rank = out_aval.ndim
    by_row = (ids_aval.shape[-1] == 1 and tuple(dims.start_index_map) == (0,)
              and tuple(dims.collapsed_slice_dims) == (0,)
              and tuple(dims.offset_dims) == (rank - 1,))
    by_slice = (clamps and ids_aval.shape[-1] == 2 and tuple(dims.start_index_map) == (0, 1)
                and tuple(dims.collapsed_slice_dims) == ()
                and tuple(dims.offset_dims) == (rank - 2, rank - 1))
    if not (by_row or by_slice):
      return None
    leaf, index, leaf_shape = kernel
    axes, ok = self.kernel_axes(index, leaf_shape)
    if not ok:
      return None
    vocab, features = (int(a) for a in w_aval.shape)
    out_shape = tuple(int(a) for a in out_aval.shape[1:-1]) + (features,)
    return linear_ops.LinearOp(path, self.name, leaf, axes, 1, tuple(ids_aval.shape), out_shape,
                               vocab, features, (), tuple(range(rank)), embed_clamps=clamps)

  def patches(self, op, act) -> jax.Array:
    """A: one-hot rows (m, T, V) of the looked-up ids (clamped as the gather clamps them)."""
    ids = act[..., 0].reshape(act.shape[0], op.positions)  # index vectors (m, *positions, 1|2)
    if op.embed_clamps:
      ids = jnp.clip(ids, 0, op.fan_in - 1)
    return jax.nn.one_hot(ids, op.fan_in, dtype=jnp.float32)

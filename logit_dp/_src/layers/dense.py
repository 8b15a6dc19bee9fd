"""Dense layers: ``dot_general(A, W')`` with no batch dimensions (either operand order), A's
leading axis the example axis and not contracted: flax ``Dense``/``DenseGeneral`` (any axes),
nnx ``Linear``/``LinearGeneral``, the projections of attention, Equinox ``Linear``, and plain
``x @ W`` or ``einsum``. Free axes of A besides the example axis are the positions t, its
contracted axes the fan-in p, W's free axes (flattened row-major) the features c."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from logit_dp._src import linear_ops
from logit_dp._src.layers import base


class Dense(base.LayerKind):
  """y[e, t, c] = Σ_p A[e, t, p] K[p, c] read off a dot_general; A is the operand itself."""
  name = "dense"
  primitive = "dot_general"
  kernel_operands = (0, 1)

  def recognise(self, eqn, path, kernel_position, kernel) -> linear_ops.LinearOp | None:
    """The canonical form of a dot_general with the leaf as one operand (None if it has batch
    dimensions, contracts the example axis, or is not float32)."""
    (contract_lhs, contract_rhs), (batch_lhs, batch_rhs) = eqn.params["dimension_numbers"]
    if batch_lhs or batch_rhs:
      return None
    if eqn.params.get("preferred_element_type") not in (None, jnp.float32):
      return None
    act_position = 1 - kernel_position
    act_aval, w_aval = eqn.invars[act_position].aval, eqn.invars[kernel_position].aval
    if not self.all_float32(act_aval, w_aval, eqn.outvars[0].aval) or act_aval.ndim < 2:
      return None
    act_contract = tuple(contract_lhs if act_position == 0 else contract_rhs)
    w_contract = tuple(contract_rhs if act_position == 0 else contract_lhs)
    if 0 in act_contract:
      return None
    act_free = [a for a in range(act_aval.ndim) if a not in act_contract]
    w_free = [a for a in range(w_aval.ndim) if a not in w_contract]
    fan_in = int(np.prod([act_aval.shape[a] for a in act_contract], dtype=np.int64))
    features = int(np.prod([w_aval.shape[a] for a in w_free], dtype=np.int64))
    leaf, index, leaf_shape = kernel
    axes, ok = self.kernel_axes(
        np.transpose(index, w_contract + tuple(w_free)).reshape(fan_in, features), leaf_shape)
    if not ok:
      return None
    n_act, n_w = len(act_free), len(w_free)
    raw_to_canonical = (tuple(range(n_act
                                    + n_w)) if act_position == 0 else tuple(range(n_w, n_w + n_act))
                        + tuple(range(n_w)))
    out_shape = tuple(act_aval.shape[a] for a in act_free[1:]) + (features,)
    feature_shape = tuple(int(w_aval.shape[a]) for a in w_free)
    return linear_ops.LinearOp(path, self.name, leaf, axes, act_position, tuple(act_aval.shape),
                               out_shape, fan_in, features,
                               tuple(act_free) + act_contract, raw_to_canonical,
                               precision=eqn.params.get("precision"), feature_shape=feature_shape)

  def patches(self, op, act) -> jax.Array:
    """A: the operand with its axes as (example, positions, contracted), flattened."""
    rows = jnp.transpose(act, op.act_to_rows)
    return rows.reshape(rows.shape[0], op.positions, op.fan_in)

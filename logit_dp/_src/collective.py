"""The collective of a gradient computation: gathers over a `jax.shard_map` axis, or the
identity on a single device."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def varying_axes(x) -> frozenset:
  """Mesh axes x is typed as varying over (empty outside shard_map or with check_vma=False)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))  # jax 0.6 - 0.9


class Collective:
  """Gathers over a shard_map axis, or the identity on a single device."""
  def __init__(self, axis_name):
    self.axis_name = axis_name

  def checks_vma(self) -> bool:
    """True inside shard_map(check_vma=True), where values carry varying-axis types."""
    if self.axis_name is None:
      return False
    return self.axis_name in varying_axes(jax.lax.axis_index(self.axis_name))

  def local_params(self, params) -> Any:
    """Params (or any value to differentiate against, e.g. layer perturbations) as per-device.

    Under check_vma=True, differentiating w.r.t. a replicated (invariant) value
    inside shard_map implicitly psums the derivative over the axis, which would
    add up the per-example Jacobians / pair gradients of different devices.
    Casting params to varying keeps every derivative local; `psum` below then
    sums the backward pass explicitly, as with check_vma=False.
    """
    if not self.checks_vma():
      return params
    return jax.lax.pcast(params, self.axis_name, to="varying")

  def gather(self, tree) -> Any:
    """Every leaf concatenated over the devices along axis 0 (all_gather, tiled)."""
    if self.axis_name is None:
      return tree
    return jax.tree_util.tree_map(
        lambda x: jax.lax.all_gather(x, self.axis_name, axis=0, tiled=True), tree)

  def psum(self, tree) -> Any:
    """Every leaf summed over the devices."""
    if self.axis_name is None:
      return tree
    return jax.lax.psum(tree, self.axis_name)

  def replicated(self, x) -> jax.Array:
    """A value computed identically on every device, typed as replicated.

    all_gather's output is typed varying under check_vma=True, so a loss
    computed from gathered embeddings cannot be returned with out_specs=P().
    pmean of identical values restores the type (exact for power-of-two axes,
    one rounding otherwise; identical on every device either way).
    """
    if not self.checks_vma():
      return x
    if jnp.issubdtype(x.dtype, jnp.integer):
      return jax.lax.psum(x, self.axis_name) // jax.lax.psum(1, self.axis_name)
    return jax.lax.pmean(x, self.axis_name)

  def local_rows(self, n_local: int) -> jax.Array:
    """(n_local,): the global indices of this device's rows."""
    start = 0 if self.axis_name is None else jax.lax.axis_index(self.axis_name) * n_local
    return start + jnp.arange(n_local)

  def size(self) -> int:
    """k, the number of devices along the axis (1 outside shard_map)."""
    return 1 if self.axis_name is None else jax.lax.axis_size(self.axis_name)

  def index(self) -> jax.Array | int:
    """This device's position along the axis (0 outside shard_map)."""
    return 0 if self.axis_name is None else jax.lax.axis_index(self.axis_name)

  def ring_shift(self, tree) -> Any:
    """Every device's value passed to the next device along the axis (ppermute i -> i + 1)."""
    if self.axis_name is None:
      return tree
    k = self.size()
    perm = [(i, (i + 1) % k) for i in range(k)]
    return jax.tree_util.tree_map(lambda a: jax.lax.ppermute(a, self.axis_name, perm), tree)

  def varying(self, tree) -> Any:
    """tree typed as per-device under check_vma=True (for loop carries that become varying)."""
    if not self.checks_vma():
      return tree

    def cast_one(a):
      if self.axis_name in varying_axes(a):
        return a
      return jax.lax.pcast(a, self.axis_name, to="varying")

    return jax.tree_util.tree_map(cast_one, tree)

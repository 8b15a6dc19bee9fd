"""The kinds of parameter-linear layer the engine factors, and their registry.

A layer kind is one JAX primitive that, for a parameter leaf W, computes per example e

    y[e, t, c] = Σ_p A[e, t, p] K[p, c],

K (fan_in P × features C) the elements of W with its axes permuted, and A[e, t] (the patch of
output position t) a function of example e's input alone. Given A, the engine has everything
else: the output cotangents δ come from its backward passes, the per-example Jacobian of W is
Σ_t a_tᵀ δ_t, the pair norms' Gram terms are Σ_{t,s} ⟨a_t, a'_s⟩⟨δ_t, δ'_s⟩, and ḡ's weighted
backward pass is the equation's own transpose. So a kind supplies three things:

* `LayerKind.recognise`: the `linear_ops.LinearOp` of an equation (or None: not this kind);
* `LayerKind.patches`: A (m, T, P) from the equation's input operand;
* optionally `LayerKind.forward`: what computes the equation when the engine perturbs its
  output (by default the equation itself).

A new kind is a `LayerKind` subclass in a module of its own and one `register` line.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
  from logit_dp._src.linear_ops import LinearOp

#: (leaf, index array of the leaf element numbers, leaf shape): what the scan knows of an
#: operand that is a reindexing of a parameter leaf.
DerivedLeaf = tuple[int, np.ndarray, tuple[int, ...]]


class LayerKind(abc.ABC):
  """One kind of parameter-linear layer: a JAX primitive whose output, for a parameter leaf W,
  is per example e

      y[e, t, c] = Σ_p A[e, t, p] K[p, c],

  K (fan_in P × features C) the elements of W with its axes permuted and A[e, t] (the patch
  of output position t) a function of example e's input alone. A subclass gives `recognise`
  (the equation's `LinearOp`, or None) and `patches` (A); the engine derives the rest: the
  cotangents δ from its backward passes, the per-example Jacobian Σ_t a_tᵀ δ_t, the pair
  norms' Gram terms Σ_{t,s} ⟨a_t, a'_s⟩⟨δ_t, δ'_s⟩ and ḡ. Register an instance with
  `register_layer_kind`.

  Class attributes:
    name: the kind's name (`LinearOp.kind`, the plan and `describe_plan`'s report).
    primitive: the name of the JAX primitive it reads (``eqn.primitive.name``).
    kernel_operands: the operand positions the parameter leaf may take.
  """
  name: ClassVar[str]
  primitive: ClassVar[str]
  kernel_operands: ClassVar[tuple[int, ...]]

  @abc.abstractmethod
  def recognise(self, eqn, path: tuple[int, ...], kernel_position: int,
                kernel: DerivedLeaf) -> LinearOp | None:
    """The `LinearOp` of ``eqn`` with the leaf at operand ``kernel_position``, or None.

    Return None for any form the kind does not cover; an exception of the usual kinds
    (ValueError, TypeError, KeyError, IndexError) counts as None. The leaf then takes the
    exact per-example Jacobians.
    """

  @abc.abstractmethod
  def patches(self, op: LinearOp, act: jax.Array) -> jax.Array:
    """A: (m, T, P) float32 inputs of the canonical form from the equation's operand
    ``values[op.act_position]`` (no bias column)."""

  def forward(self, op: LinearOp, values: list, compute: Callable[[], Any]) -> jax.Array:
    """The equation's output, in its own layout, from its operand values; ``compute()``
    evaluates the equation as traced."""
    del op, values
    return compute()

  @staticmethod
  def kernel_axes(matrix_index: np.ndarray, leaf_shape) -> tuple[tuple[int, ...] | None, bool]:
    """(axes, found): the leaf axis permutation whose row-major order is matrix_index, the
    (P, C) matrix of leaf element numbers (axes None: the identity; found False: K is not a
    permutation of the leaf, so the equation is not of the kind)."""
    size = int(np.prod(leaf_shape, dtype=np.int64))
    if matrix_index.size != size:
      return None, False
    flat = matrix_index.reshape(-1)
    iota = np.arange(size).reshape(leaf_shape)
    if np.array_equal(flat, iota.reshape(-1)):
      return None, True
    for axes in itertools.permutations(range(len(leaf_shape))):
      if np.array_equal(flat, np.transpose(iota, axes).reshape(-1)):
        return tuple(axes), True
    return None, False

  @staticmethod
  def all_float32(*avals) -> bool:
    """Whether every aval is float32 (the forms the engine factors in float32 arithmetic)."""
    return all(getattr(a, "dtype", None) == jnp.float32 for a in avals)


#: The registered layer kinds by name: `register` adds to it.
REGISTRY: dict[str, LayerKind] = {}


def register(kind: LayerKind) -> LayerKind:
  """Registers a `LayerKind` instance under its ``name``; the engine then recognises it.

  Registering an instance of the same class again replaces it. ValueError for a name taken
  by another class, or a kind without a name, primitive or kernel_operands.
  """
  if not isinstance(kind, LayerKind):
    raise TypeError(f"register takes a LayerKind instance, got {kind!r}.")
  for attribute, kinds in (("name", str), ("primitive", str), ("kernel_operands", tuple)):
    if not isinstance(getattr(kind, attribute, None), kinds) or not getattr(kind, attribute):
      raise ValueError(f"{type(kind).__name__} must set the class attribute {attribute} "
                       f"(a non-empty {kinds.__name__}).")
  other = REGISTRY.get(kind.name)
  if other is not None and type(other) is not type(kind):
    raise ValueError(f"A layer kind is already registered as {kind.name!r}: "
                     f"{type(other).__name__}.")
  REGISTRY[kind.name] = kind
  return kind


def for_primitive(name: str) -> tuple[LayerKind, ...]:
  """The registered kinds that read the primitive ``name``, in registration order."""
  return tuple(kind for kind in REGISTRY.values() if kind.primitive == name)


def get(name: str) -> LayerKind:
  """The registered kind called ``name`` (KeyError if none)."""
  return REGISTRY[name]

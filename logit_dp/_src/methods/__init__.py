"""The clip methods of Logit-DP, one registry: `resolve` turns a method name into its object.

Every method is a `ClipMethod` (pair norms; the clipped gradient), defined in a module of its
own and registered by one line below (`register`, which also takes methods defined outside
the package):

* "ghost" (`Ghost`): exact pair norms from per-example Jacobian factors (the default);
* "materialize" (`Materialize`): Algorithm 1, every pair gradient formed (the reference);
* "triangle" (`Triangle`): an upper bound from per-example Grams (cheaper, clips more);
* "projected" (`Projected`): the triangle bound made exact on the subspace of public inputs.

Two towers are a case of the batch's plans (`two_tower.tower_plans`): "ghost" and "triangle"
find their norms with `towers.pair_norms`, "materialize" forms the pair gradients of both
towers as of one, and "projected" takes one tower only.
"""

from __future__ import annotations

import warnings

from logit_dp._src.methods.base import ClipMethod
from logit_dp._src.methods.ghost import Ghost
from logit_dp._src.methods.materialize import Materialize
from logit_dp._src.methods.projected import DEFAULT_RANK
from logit_dp._src.methods.projected import Projected
from logit_dp._src.methods.triangle import Triangle

#: The names of the other mechanisms (`mechanisms`), which no clip method may take.
RESERVED_NAMES = ("naive", "dp_gcl")
#: The registered clip methods by name: `register` adds to it.
REGISTRY: dict[str, type[ClipMethod]] = {}


def register(method_class: type[ClipMethod]) -> type[ClipMethod]:
  """Registers a `ClipMethod` subclass under its ``name`` (usable as a class decorator).

  The name then works wherever a method name does (`clipped_grad`, `make_private`, the
  audits), resolved to ``method_class()``. Registering the same class again does nothing.

  Args:
    method_class: the `ClipMethod` subclass; its class attribute ``name`` is neither taken by
      another class nor "naive" or "dp_gcl" (ValueError otherwise).

  Returns:
    method_class.
  """
  if not (isinstance(method_class, type) and issubclass(method_class, ClipMethod)):
    raise TypeError(f"register takes a ClipMethod subclass, got {method_class!r}.")
  name = getattr(method_class, "name", None)
  if not isinstance(name, str) or not name:
    raise ValueError(f"{method_class.__name__} must set the class attribute name (a string).")
  if name in RESERVED_NAMES:
    raise ValueError(f"{name!r} names another mechanism; choose another name.")
  if REGISTRY.get(name, method_class) is not method_class:
    raise ValueError(f"A clip method is already registered as {name!r}: "
                     f"{REGISTRY[name].__name__}.")
  REGISTRY[name] = method_class
  return method_class


register(Ghost)
register(Materialize)
register(Triangle)
register(Projected)

#: The names of the built-in clip methods (`names` also lists those registered since).
METHODS = tuple(REGISTRY)
DEFAULT_PROJECTION_RANK = DEFAULT_RANK

# Keywords of `clipped_grad` and `pair_grad_norms` from before the methods held their options,
# deprecated: keyword -> (the method class that takes it, its field there).
_DEPRECATED_OPTIONS = {
    "memory_budget": (Ghost, "memory_budget"),
    "pair_block_size": (Materialize, "pair_block_size"),
    "reference_inputs": (Projected, "reference_inputs"),
    "projection_rank": (Projected, "rank"),
}


def names() -> tuple[str, ...]:
  """The names of every registered clip method, built-in ones first."""
  return tuple(REGISTRY)


def check_name(method: str) -> str:
  """method if it names a registered clip method; ValueError otherwise."""
  if not isinstance(method, str) or method not in REGISTRY:
    raise ValueError(f"method must be one of {names()} or a ClipMethod object, got {method!r}.")
  return method


def is_method(method) -> bool:
  """Whether `method` is a clip method: a `ClipMethod` object or a registered name."""
  return isinstance(method, ClipMethod) or (isinstance(method, str) and method in REGISTRY)


def resolve(method: str | ClipMethod, *, embed_fn=None, positive_embed_fn=None, stacklevel: int = 2,
            **deprecated_options) -> ClipMethod:
  """The `ClipMethod` of a registered name (its default object) or the object itself.

  Args:
    method: a registered name or a `ClipMethod` object.
    embed_fn: the model; when given, the method is checked against it
      (`ClipMethod.for_model`).
    positive_embed_fn: the tower of x_prime (None: one tower), checked with embed_fn.
    stacklevel: where the DeprecationWarning of deprecated_options points.
    **deprecated_options: the keywords `clipped_grad` took before the methods held their
      options (memory_budget, pair_block_size, reference_inputs, projection_rank), applied to a
      method name with a DeprecationWarning; options another method takes are ignored, except
      reference_inputs (ValueError). With a method object they are a ValueError.

  Returns:
    The `ClipMethod`.
  """
  options = {k: v for k, v in deprecated_options.items() if v is not None}
  unknown = sorted(set(options) - set(_DEPRECATED_OPTIONS))
  if unknown:
    raise TypeError(f"Unexpected keyword argument(s) {unknown}.")
  if isinstance(method, ClipMethod):
    if options:
      raise ValueError(f"method is a {type(method).__name__} object: set {sorted(options)} in "
                       "it, not as keywords.")
  else:
    method_class = REGISTRY[check_name(method)]
    if options:
      warnings.warn(
          f"The keywords {sorted(options)} are deprecated: pass the method as an object holding "
          f"its options, e.g. method=logit_dp.clip_methods.{method_class.__name__}(...).",
          DeprecationWarning, stacklevel=stacklevel)
    if "reference_inputs" in options and method_class is not Projected:
      raise ValueError(f"reference_inputs are used by method='projected' only, not {method!r}.")
    method = method_class(
        **{
            field: options[keyword] for keyword, (owner, field) in _DEPRECATED_OPTIONS.items()
            if owner is method_class and keyword in options
        })
  return method if embed_fn is None else method.for_model(embed_fn, positive_embed_fn)


__all__ = [
    "ClipMethod",
    "DEFAULT_PROJECTION_RANK",
    "Ghost",
    "METHODS",
    "Materialize",
    "Projected",
    "REGISTRY",
    "RESERVED_NAMES",
    "Triangle",
    "check_name",
    "is_method",
    "names",
    "register",
    "resolve",
]

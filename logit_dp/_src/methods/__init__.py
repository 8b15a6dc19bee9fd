"""The clip methods of Logit-DP, one registry: `resolve` turns a method name into its object.

Every method is a `ClipMethod` (pair norms; the clipped gradient):

* "ghost" (`Ghost`): exact pair norms from per-example Jacobian factors (the default);
* "materialize" (`Materialize`): Algorithm 1, every pair gradient formed (the reference);
* "triangle" (`Triangle`): an upper bound from per-example Grams (cheaper, clips more);
* "projected" (`Projected`): the triangle bound made exact on the subspace of public inputs.

Two towers are a case of the batch's plans (`two_tower.tower_plans`): "ghost" and "triangle"
find their norms with `towers.pair_norms`, "materialize" forms the pair gradients of both
towers as of one, and "projected" takes one tower only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from logit_dp._src import checks
from logit_dp._src import stochastic
from logit_dp._src.methods.base import ClipMethod
from logit_dp._src.methods.ghost import Ghost
from logit_dp._src.methods.materialize import Materialize
from logit_dp._src.methods.projected import Projected
from logit_dp._src.methods.triangle import Triangle

DEFAULT_PROJECTION_RANK = 32
REGISTRY: dict[str, type[ClipMethod]] = {
    cls.name: cls for cls in (Ghost, Materialize, Triangle, Projected)
}
METHODS = tuple(REGISTRY)


def check_name(method: str) -> str:
  """method if it names a clip method; ValueError otherwise."""
  if not isinstance(method, str) or method not in REGISTRY:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  return method


def resolve(method: str | ClipMethod, *, memory_budget: int | None = None,
            pair_block_size: int | None = None, reference_inputs: Any = None,
            projection_rank: int = DEFAULT_PROJECTION_RANK, embed_fn=None,
            positive_embed_fn=None) -> ClipMethod:
  """The `ClipMethod` object of a method name (or the object itself), with its options checked.

  Options a method does not use are ignored, except reference_inputs: only "projected" takes
  them (ValueError otherwise, as for "projected" without them or with two towers). A method
  object holds its own options: passing them as keywords too is a ValueError.
  """
  if isinstance(method, ClipMethod):  # checked like its name and options
    given = {
        "memory_budget": memory_budget, "pair_block_size": pair_block_size,
        "reference_inputs": reference_inputs
    }
    extra = sorted(k for k, v in given.items() if v is not None)
    if projection_rank != DEFAULT_PROJECTION_RANK:
      extra.append("projection_rank")
    if extra:
      raise ValueError(f"method is a {type(method).__name__} object: set {extra} in it, not as "
                       "keywords.")
    options = {
        field.name: getattr(method, field.name) for field in dataclasses.fields(cast(Any, method))
    }
    if "rank" in options:
      options["projection_rank"] = options.pop("rank")
    return resolve(method.name, **options, embed_fn=embed_fn, positive_embed_fn=positive_embed_fn)
  check_name(method)
  checks.check_memory_budget(memory_budget)
  spec = checks.check_projection(method, reference_inputs, projection_rank, positive_embed_fn,
                                 embed_fn)
  if method == Ghost.name:
    return Ghost(memory_budget=memory_budget)
  if method == Materialize.name:
    return Materialize(pair_block_size=pair_block_size)
  if method == Triangle.name:
    return Triangle()
  assert spec is not None
  return Projected(reference_inputs=spec[0], rank=spec[1])


def with_key(method: ClipMethod, key) -> ClipMethod:
  """method for a stochastic model embedded with key (None: method itself): "projected" with its
  public reference inputs keyed as view 2 (`stochastic.reference_inputs`; any subspace keeps
  its bound valid)."""
  if key is None or not isinstance(method, Projected):
    return method
  return dataclasses.replace(
      method, reference_inputs=stochastic.reference_inputs(method.reference_inputs, key))


__all__ = [
    "ClipMethod",
    "DEFAULT_PROJECTION_RANK",
    "Ghost",
    "METHODS",
    "Materialize",
    "Projected",
    "REGISTRY",
    "Triangle",
    "check_name",
    "resolve",
    "with_key",
]

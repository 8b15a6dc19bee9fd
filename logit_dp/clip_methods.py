"""The clip methods of Logit-DP as objects, and their registry.

`logit_dp.clipped_grad` and `logit_dp.make_private` take a method object holding its options,
e.g. ``method=clip_methods.Ghost(memory_budget=1 << 30)``, or a registered name for its
default object. A new method subclasses `ClipMethod` and is registered by `register`.
"""

from logit_dp._src.methods import DEFAULT_PROJECTION_RANK
from logit_dp._src.methods import METHODS
from logit_dp._src.methods import ClipMethod
from logit_dp._src.methods import Ghost
from logit_dp._src.methods import Materialize
from logit_dp._src.methods import Projected
from logit_dp._src.methods import Triangle
from logit_dp._src.methods import names
from logit_dp._src.methods import register
from logit_dp._src.methods import resolve

__all__ = [
    "DEFAULT_PROJECTION_RANK",
    "METHODS",
    "ClipMethod",
    "Ghost",
    "Materialize",
    "Projected",
    "Triangle",
    "names",
    "register",
    "resolve",
]

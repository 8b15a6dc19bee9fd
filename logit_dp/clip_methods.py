"""The clip methods of Logit-DP as objects; see `logit_dp._src.methods`.

`logit_dp.clipped_grad(..., method=)` takes a name of `METHODS` or one of these objects, e.g.
``method=clip_methods.Ghost(memory_budget=1 << 30)``.
"""

from logit_dp._src.methods import DEFAULT_PROJECTION_RANK
from logit_dp._src.methods import METHODS
from logit_dp._src.methods import ClipMethod
from logit_dp._src.methods import Ghost
from logit_dp._src.methods import Materialize
from logit_dp._src.methods import Projected
from logit_dp._src.methods import Triangle
from logit_dp._src.methods import resolve

__all__ = [
    "DEFAULT_PROJECTION_RANK",
    "METHODS",
    "ClipMethod",
    "Ghost",
    "Materialize",
    "Projected",
    "Triangle",
    "resolve",
]

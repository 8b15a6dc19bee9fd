"""How Logit-DP finds the pair norms it clips by: the clip methods, their registry, and what
clipping did.

`logit_dp.clipped_grad` and `logit_dp.make_private` take a method object holding its options,
e.g. ``method=clip_methods.Ghost(memory_budget=1 << 30)``, or a registered name for its
default object ("ghost", "materialize", "triangle"; "projected" needs its reference inputs). A
new method subclasses `ClipMethod` and is added by `register`. `pair_grad_norms` returns the
norms a method clips by, `ClipStats` what clipping did on a batch (``grad_fn.with_stats``), and
`shared_parameters` which parameters two towers share, and `describe_plan` how the norms of
every parameter are computed (and which take the slow path).

The layers the exact methods factor are kinds of their own: a new one subclasses `LayerKind`
(it recognises a primitive's equation as a `LinearOp` y = A·K and gives its patches A) and is
added by `register_layer_kind`; its pair norms and clipped gradient then follow.
"""

from logit_dp._src.clip_stats import QUANTILE_LEVELS
from logit_dp._src.clip_stats import ClipStats
from logit_dp._src.clipping import pair_grad_norms
from logit_dp._src.layers import LayerKind
from logit_dp._src.layers import register as register_layer_kind
from logit_dp._src.linear_ops import LinearOp
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
from logit_dp._src.plan_report import LeafRoute
from logit_dp._src.plan_report import PlanReport
from logit_dp._src.plan_report import describe_plan
from logit_dp._src.two_tower import shared_parameters

__all__ = [
    "ClipMethod",
    "ClipStats",
    "DEFAULT_PROJECTION_RANK",
    "Ghost",
    "LayerKind",
    "LeafRoute",
    "LinearOp",
    "METHODS",
    "Materialize",
    "PlanReport",
    "Projected",
    "QUANTILE_LEVELS",
    "Triangle",
    "describe_plan",
    "names",
    "pair_grad_norms",
    "register",
    "register_layer_kind",
    "resolve",
    "shared_parameters",
]

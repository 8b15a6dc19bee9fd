"""The layer kinds the engine factors, one registry (see `base` for what a kind supplies).

Every kind is a `LayerKind` defined in a module of its own and registered by one line below
(`register`, which also takes kinds defined outside the package):

* "dense" (`Dense`): ``dot_general`` with a parameter operand (Dense, DenseGeneral, attention
  projections, einsum);
* "conv" (`Conv`): ``conv_general_dilated`` with one feature group;
* "embed" (`Embed`): a ``gather`` of whole table rows (embedding lookups).

Parameters that enter elementwise (normalisation scales and biases, learned positions, class
tokens) are not layers: `linear_ops.ElementwiseSite` covers them.
"""

from logit_dp._src.layers.base import REGISTRY
from logit_dp._src.layers.base import LayerKind
from logit_dp._src.layers.base import for_primitive
from logit_dp._src.layers.base import get
from logit_dp._src.layers.base import register
from logit_dp._src.layers.conv import Conv
from logit_dp._src.layers.dense import Dense
from logit_dp._src.layers.embed import Embed

register(Dense())
register(Conv())
register(Embed())

__all__ = ["REGISTRY", "Conv", "Dense", "Embed", "LayerKind", "for_primitive", "get", "register"]

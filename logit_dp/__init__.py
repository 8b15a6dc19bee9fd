"""logit_dp: differentially private training with non-decomposable similarity losses.

Implements Logit-DP (Kong, Muñoz Medina & Ribero, "Differentially private
optimization for non-decomposable objective functions", ICLR 2025) in JAX:
per-pair clipped gradients (`clipped_grad`, a `ClippedGradFn` carrying its `Mechanism` and
sensitivity; the clip methods `METHODS`, each a `ClipMethod`), their sensitivity
(`sensitivity`), and the Gaussian noise as an optax transformation (`transform`);
`make_private` sets all of it up (with sampler and ledger) in one call.
``grad_fn.with_stats`` adds the clip statistics (`ClipStats`: the fraction of pairs clipped,
quantiles of their norms; non-private diagnostics for tuning B).
The grouped baseline DP-GCL (`grouped_clipped_grad`, `grouped_sensitivity`,
`assign_groups`) clips each group's gradient instead of each pair's.

Models. ``embed_fn(params, x) -> (n, d)`` is any pure JAX function of a params pytree and
a batch (examples along axis 0) that embeds every example on its own. Its dense and
convolution layers (``dot_general`` / ``conv_general_dilated`` with a parameter as one
operand, and their bias adds) are found in the traced computation and get per-layer
Jacobian factors whatever framework wrote them; other parameters get per-example
Jacobians. For example::

  # flax.linen
  embed_fn = model.apply;  params = model.init(key, x[:1])
  # flax.nnx
  graphdef, params = nnx.split(model)
  embed_fn = lambda p, x: nnx.merge(graphdef, p)(x)
  # Equinox (a per-example model)
  params, static = eqx.partition(model, eqx.is_inexact_array)
  embed_fn = lambda p, x: jax.vmap(eqx.combine(p, static))(x)
  # Haiku
  net = hk.without_apply_rng(hk.transform(f));  embed_fn = net.apply
  # plain JAX
  embed_fn = lambda p, x: jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
"""

from logit_dp import accounting
from logit_dp import audit
from logit_dp import clip_methods
from logit_dp import contrast_clipping
from logit_dp import distributed
from logit_dp import ledger
from logit_dp import losses
from logit_dp import sampling
from logit_dp._src.clip_stats import QUANTILE_LEVELS
from logit_dp._src.clip_stats import ClipStats
from logit_dp._src.clipping import clipped_grad
from logit_dp._src.clipping import naive_clipped_grad
from logit_dp._src.clipping import pair_grad_norms
from logit_dp._src.grad_fn import ClippedGradFn
from logit_dp._src.grouped import assign_groups
from logit_dp._src.grouped import grouped_clipped_grad
from logit_dp._src.grouped import grouped_sensitivity
from logit_dp._src.ledger import BudgetedSampler
from logit_dp._src.ledger import PrivacyBudgetExceededError
from logit_dp._src.ledger import PrivacyLedger
from logit_dp._src.mechanisms import PRIVATE_METHODS
from logit_dp._src.mechanisms import Mechanism
from logit_dp._src.methods import METHODS
from logit_dp._src.methods import ClipMethod
from logit_dp._src.noise import AddNoiseState
from logit_dp._src.noise import transform
from logit_dp._src.numerics import DEFAULT_COSINE_EPS
from logit_dp._src.numerics import cosine_similarity
from logit_dp._src.numerics import normalize
from logit_dp._src.private_training import EmptyBatchWarning
from logit_dp._src.private_training import NonFiniteRowsWarning
from logit_dp._src.private_training import PrivateTraining
from logit_dp._src.private_training import UnrecordedStepError
from logit_dp._src.private_training import make_private
from logit_dp._src.sampling import PoissonSampler
from logit_dp._src.sensitivity import naive_sensitivity
from logit_dp._src.sensitivity import sensitivity
from logit_dp._src.two_tower import shared_parameters

__version__ = "0.2.0"

__all__ = [
    "BudgetedSampler",
    "ClipMethod",
    "ClipStats",
    "ClippedGradFn",
    "EmptyBatchWarning",
    "Mechanism",
    "NonFiniteRowsWarning",
    "PRIVATE_METHODS",
    "PoissonSampler",
    "PrivacyBudgetExceededError",
    "PrivacyLedger",
    "PrivateTraining",
    "UnrecordedStepError",
    "accounting",
    "assign_groups",
    "audit",
    "clip_methods",
    "contrast_clipping",
    "distributed",
    "ledger",
    "sampling",
    "AddNoiseState",
    "DEFAULT_COSINE_EPS",
    "METHODS",
    "QUANTILE_LEVELS",
    "clipped_grad",
    "cosine_similarity",
    "grouped_clipped_grad",
    "grouped_sensitivity",
    "losses",
    "make_private",
    "naive_clipped_grad",
    "naive_sensitivity",
    "normalize",
    "pair_grad_norms",
    "sensitivity",
    "shared_parameters",
    "transform",
]

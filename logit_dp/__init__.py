"""logit_dp: differentially private training with non-decomposable similarity losses.

Logit-DP (Kong, Muñoz Medina & Ribero, "Differentially private optimization for
non-decomposable objective functions", ICLR 2025) in JAX. The top level holds what a training
loop calls:

* `clipped_grad`: the per-pair clipped gradient ḡ of a similarity loss (a `ClippedGradFn`
  carrying its `Mechanism` and sensitivity);
* `sensitivity`: its L2 sensitivity C under adding or removing one pair
  (`losses.person_sensitivity`: one person with up to K pairs);
* `transform`: the Gaussian noise N(0, (σC)²) as an optax transformation;
* `make_private`: all of it, with a Poisson sampler and a privacy ledger, for a target (ε, δ)
  (a `PrivateTraining`).

The submodules hold the rest: `losses` (the losses and their cosine similarity),
`clip_methods` (how the pair norms are found, and your own methods), `baselines` (Naive-DP,
DP-GCL), `finetune` (training some parameters, the others frozen), `accounting`, `sampling`,
`ledger` (and checkpoints), `audit`, `distributed` and `models`. The maths is in
docs/METHOD.md, the guarantees in docs/PRIVACY.md.

``embed_fn(params, x) -> (n, d)`` is any pure JAX function of a params pytree and a batch
(examples along axis 0) that embeds every example on its own: flax (``model.apply``), flax.nnx,
Equinox, Haiku or plain JAX (docs/guides/bring_your_own_model.md).
"""

import importlib
import warnings

from logit_dp import accounting
from logit_dp import audit
from logit_dp import baselines
from logit_dp import clip_methods
from logit_dp import distributed
from logit_dp import finetune
from logit_dp import ledger
from logit_dp import losses
from logit_dp import models
from logit_dp import sampling
from logit_dp._src.clipping import clipped_grad
from logit_dp._src.grad_fn import ClippedGradFn
from logit_dp._src.mechanisms import Mechanism
from logit_dp._src.noise import AddNoiseState
from logit_dp._src.noise import transform
from logit_dp._src.private_training import EmptyBatchWarning
from logit_dp._src.private_training import NonFiniteParametersError
from logit_dp._src.private_training import NonFiniteRowsWarning
from logit_dp._src.private_training import PrivateTraining
from logit_dp._src.private_training import UnrecordedStepError
from logit_dp._src.private_training import make_private
from logit_dp._src.sensitivity import sensitivity

__version__ = "0.2.0"

__all__ = [
    "accounting",
    "audit",
    "baselines",
    "clip_methods",
    "distributed",
    "finetune",
    "ledger",
    "losses",
    "models",
    "sampling",
    "AddNoiseState",
    "ClippedGradFn",
    "EmptyBatchWarning",
    "Mechanism",
    "NonFiniteParametersError",
    "NonFiniteRowsWarning",
    "PrivateTraining",
    "UnrecordedStepError",
    "clipped_grad",
    "make_private",
    "sensitivity",
    "transform",
]

# Top-level names of release 0.2 that moved to a submodule: name -> the module holding it now.
# They still work, with a DeprecationWarning, until the next release.
_MOVED = {
    "BudgetedSampler": "ledger",
    "PrivacyBudgetExceededError": "ledger",
    "PrivacyLedger": "ledger",
    "PoissonSampler": "sampling",
    "ClipMethod": "clip_methods",
    "ClipStats": "clip_methods",
    "METHODS": "clip_methods",
    "QUANTILE_LEVELS": "clip_methods",
    "pair_grad_norms": "clip_methods",
    "shared_parameters": "clip_methods",
    "assign_groups": "baselines",
    "grouped_clipped_grad": "baselines",
    "grouped_sensitivity": "baselines",
    "naive_clipped_grad": "baselines",
    "naive_sensitivity": "baselines",
    "DEFAULT_COSINE_EPS": "losses",
    "cosine_similarity": "losses",
    "normalize": "losses",
}


def __getattr__(name: str):
  """The moved names of `_MOVED` (with a DeprecationWarning), and PRIVATE_METHODS."""
  if name in _MOVED:
    module = _MOVED[name]
    warnings.warn(f"logit_dp.{name} is deprecated: use logit_dp.{module}.{name}.",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(f"logit_dp.{module}"), name)
  if name == "PRIVATE_METHODS":
    warnings.warn(
        "logit_dp.PRIVATE_METHODS is deprecated: make_private takes a clip method "
        "(logit_dp.clip_methods.names(), or a ClipMethod object), 'naive' or 'dp_gcl'.",
        DeprecationWarning, stacklevel=2)
    return importlib.import_module("logit_dp._src.mechanisms").PRIVATE_METHODS
  raise AttributeError(f"module 'logit_dp' has no attribute {name!r}")

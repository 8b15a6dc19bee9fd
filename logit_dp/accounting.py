"""Privacy accounting for Poisson-sampled Gaussian steps: the noise multiplier σ of a target
(ε, δ) (`noise_multiplier`), the ε or δ of σ (`epsilon`, `delta`), and the steps a budget allows
(`max_steps`), by dp_accounting's PLD or RDP accountant."""

from logit_dp._src.accounting import ACCOUNTANTS
from logit_dp._src.accounting import DEFAULT_MAX_NOISE_MULTIPLIER
from logit_dp._src.accounting import DEFAULT_MIN_NOISE_MULTIPLIER
from logit_dp._src.accounting import DEFAULT_PLD_DISCRETIZATION
from logit_dp._src.accounting import delta
from logit_dp._src.accounting import epsilon
from logit_dp._src.accounting import make_accountant
from logit_dp._src.accounting import make_event
from logit_dp._src.accounting import max_steps
from logit_dp._src.accounting import noise_multiplier
from logit_dp._src.accounting import sampling_rate_for
from logit_dp._src.accounting import steps_for_epochs

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_MAX_NOISE_MULTIPLIER",
    "DEFAULT_MIN_NOISE_MULTIPLIER",
    "DEFAULT_PLD_DISCRETIZATION",
    "delta",
    "epsilon",
    "make_accountant",
    "make_event",
    "max_steps",
    "noise_multiplier",
    "sampling_rate_for",
    "steps_for_epochs",
]

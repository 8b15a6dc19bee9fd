"""Privacy verification: sensitivity audits and one-run canary ε lower bounds.

See `logit_dp._src.audit` (‖ḡ(X) − ḡ(X∖k)‖ against `logit_dp.sensitivity`, and a
gradient-ascent search for the worst batch; the same for replacing one pair against the
replace-one sensitivity) and `logit_dp._src.canary` (the
one-run audit of Steinke, Nasr & Jagielski 2023 with white-box gradient
canaries). docs/PRIVACY.md records the results.
"""

from logit_dp._src.audit import RemovalAudit
from logit_dp._src.audit import max_removal_ratio
from logit_dp._src.audit import removal_gaps
from logit_dp._src.audit import replacement_gaps
from logit_dp._src.audit import search_worst_case
from logit_dp._src.audit import search_worst_replacement
from logit_dp._src.canary import DEFAULT_GUESS_FRACTIONS
from logit_dp._src.canary import GradientCanaries
from logit_dp._src.canary import OneRunAudit
from logit_dp._src.canary import audit_scores
from logit_dp._src.canary import epsilon_lower_bound
from logit_dp._src.canary import log_likelihood_ratio
from logit_dp._src.canary import p_value

__all__ = [
    "DEFAULT_GUESS_FRACTIONS",
    "GradientCanaries",
    "OneRunAudit",
    "RemovalAudit",
    "audit_scores",
    "epsilon_lower_bound",
    "log_likelihood_ratio",
    "max_removal_ratio",
    "p_value",
    "removal_gaps",
    "replacement_gaps",
    "search_worst_case",
    "search_worst_replacement",
]

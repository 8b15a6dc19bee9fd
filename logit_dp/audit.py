"""Privacy verification: sensitivity audits and one-run canary ε lower bounds.

* Removal audits: ‖ḡ(X) − ḡ(X∖k)‖ for every pair k against the sensitivity
  (`removal_gaps`, `max_removal_ratio`), and a gradient-ascent search for the worst batch
  (`search_worst_case`).
* Person-removal audits (privacy per person): ‖ḡ(X) − ḡ(X without person u)‖ for every
  person u against the per-person sensitivity (`person_removal_gaps`,
  `max_person_removal_ratio`, `search_worst_person_removal`).
* Replace-one audits: ‖ḡ(X) − ḡ(X with pair k replaced)‖ against the replace-one
  sensitivity (`replacement_gaps`, `search_worst_replacement`).
* The one-run audit of Steinke, Nasr & Jagielski (2023) with white-box gradient canaries
  (`GradientCanaries`, `epsilon_lower_bound`).

docs/privacy_audits.md records the results.
"""

from logit_dp._src.audit import GROUP_BY
from logit_dp._src.audit import PersonRemovalAudit
from logit_dp._src.audit import RemovalAudit
from logit_dp._src.audit import adversarial_person_batch
from logit_dp._src.audit import max_person_removal_ratio
from logit_dp._src.audit import max_removal_ratio
from logit_dp._src.audit import person_removal_gaps
from logit_dp._src.audit import removal_gaps
from logit_dp._src.audit import replacement_gaps
from logit_dp._src.audit import search_worst_case
from logit_dp._src.audit import search_worst_person_removal
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
    "GROUP_BY",
    "GradientCanaries",
    "OneRunAudit",
    "PersonRemovalAudit",
    "RemovalAudit",
    "adversarial_person_batch",
    "audit_scores",
    "epsilon_lower_bound",
    "log_likelihood_ratio",
    "max_person_removal_ratio",
    "max_removal_ratio",
    "p_value",
    "person_removal_gaps",
    "removal_gaps",
    "replacement_gaps",
    "search_worst_case",
    "search_worst_person_removal",
    "search_worst_replacement",
]

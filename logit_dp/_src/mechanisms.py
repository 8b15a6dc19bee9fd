"""Which private mechanism a gradient function implements: `Mechanism`, and the method names.

Three mechanisms release a clipped gradient ḡ, each with its own L2 sensitivity C under
adding or removing one pair record (noise N(0, (σC)²) makes a step private):

* Logit-DP (`clipped_grad`): every pair gradient ∇_w Z_ij clipped to B, weighted by
  τ_ij = ∂ℒ/∂Z_ij; C = `sensitivity(loss, B)`. It takes a clip method (`methods`: how the
  pair norms are found; a `methods.ClipMethod` object or a registered name).
* Naive-DP (`naive_clipped_grad`): the whole batch gradient clipped to B; C = 2B.
* DP-GCL (`grouped_clipped_grad`): each group's gradient clipped to B; C = 2B.

The methods accepted by `make_private` and the audits (`check_private_method`: a clip method
for Logit-DP, "naive" or "dp_gcl"; `AUDITED_METHODS` lists the names) and the experiments' names
(`Mechanism` values: "logit_dp", "naive_dp", "dp_gcl") all map to a `Mechanism` here.
"""

from __future__ import annotations

import enum

import dp_accounting

from logit_dp._src import methods
from logit_dp._src import sensitivity as sensitivity_lib

NAIVE_METHOD = "naive"
GROUPED_METHOD = "dp_gcl"


class Mechanism(enum.Enum):
  """A private mechanism: what is clipped, hence the sensitivity of ḡ."""
  LOGIT_DP = "logit_dp"
  NAIVE_DP = "naive_dp"
  DP_GCL = "dp_gcl"

  @property
  def label(self) -> str:
    """The name papers and tables use: "Logit-DP", "Naive-DP" or "DP-GCL"."""
    return {"logit_dp": "Logit-DP", "naive_dp": "Naive-DP", "dp_gcl": "DP-GCL"}[self.value]

  def sensitivity(
      self, loss, clip_norm: float, batch_size: int | None = None, *,
      neighboring_relation: dp_accounting.NeighboringRelation = sensitivity_lib.ADD_OR_REMOVE_ONE,
      max_pairs_per_user: int | None = None) -> float:
    """C of ḡ under neighboring_relation: `sensitivity(loss, B, batch_size)` for Logit-DP, 2B
    for Naive-DP and DP-GCL (batch_size None: any batch size, as under Poisson sampling).

    With max_pairs_per_user = K the unit is a person with up to K pairs in a batch:
    `person_sensitivity(loss, B, K, batch_size)` for Logit-DP; 2B for Naive-DP; 2B for DP-GCL
    grouped by person (`grouped_clipped_grad`'s ``user_ids=``, which `make_private(user_ids=)`
    always passes; grouped by pair a person can change K groups)."""
    relation = dict(neighboring_relation=neighboring_relation)
    if max_pairs_per_user is not None:
      k = sensitivity_lib.check_max_pairs_per_user(max_pairs_per_user)
      if self is Mechanism.LOGIT_DP:
        return sensitivity_lib.person_sensitivity(loss, clip_norm, k, batch_size, **relation)
    if self is Mechanism.LOGIT_DP:
      return sensitivity_lib.sensitivity(loss, clip_norm, batch_size, **relation)
    if self is Mechanism.NAIVE_DP:
      return sensitivity_lib.naive_sensitivity(clip_norm, **relation)
    return sensitivity_lib.grouped_sensitivity(clip_norm, **relation)

  @classmethod
  def of_method(cls, method) -> Mechanism:
    """The mechanism of a method: a clip method (object or registered name: Logit-DP),
    "naive" or "dp_gcl"."""
    if methods.is_method(method):
      return cls.LOGIT_DP
    if method == NAIVE_METHOD:
      return cls.NAIVE_DP
    if method == GROUPED_METHOD:
      return cls.DP_GCL
    raise ValueError(f"method must be one of {methods.names() + (NAIVE_METHOD, GROUPED_METHOD)}, "
                     f"got {method!r}.")


#: Method names accepted by `make_private`: the built-in clip methods, Naive-DP and DP-GCL (and
#: any clip method registered since, `check_private_method`).
PRIVATE_METHODS = methods.METHODS + (NAIVE_METHOD, GROUPED_METHOD)
#: Methods the removal audits accept: those of `make_private`.
AUDITED_METHODS = PRIVATE_METHODS


def check_private_method(method: str | methods.ClipMethod) -> str | methods.ClipMethod:
  """method if `make_private` takes it: a clip method (a `methods.ClipMethod` object or a
  registered name), "naive" or "dp_gcl"; ValueError otherwise."""
  if methods.is_method(method) or method in (NAIVE_METHOD, GROUPED_METHOD):
    return method
  raise ValueError(f"method must be one of {methods.names() + (NAIVE_METHOD, GROUPED_METHOD)} "
                   "or a ClipMethod "
                   f"object, got {method!r}.")


def check_method(method: str, allowed: tuple[str, ...]) -> str:
  """method if it is one of `allowed`; ValueError otherwise."""
  if not isinstance(method, str) or method not in allowed:
    raise ValueError(f"method must be one of {allowed}, got {method!r}.")
  return method

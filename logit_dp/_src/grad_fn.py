"""The private gradient functions handed to users: `ClippedGradFn`, and the checked call of a
jitted core that every builder shares (`CheckedCall`).

A builder (`clipped_grad`, `naive_clipped_grad`, `grouped_clipped_grad`,
`distributed.make_sharded_grad_fn`, `distributed.make_private_train_step`) supplies a jitted
core and the checks of its inputs; the object runs the checks, checks the model once on first
use, calls the core, and (for a gradient) refuses to release a result with dropped non-finite
rows when called eagerly. A `ClippedGradFn` also says which mechanism it implements and its
sensitivity, so that the noise can be calibrated from the object itself.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import dp_accounting
import jax

from logit_dp._src import checks
from logit_dp._src import clip_stats
from logit_dp._src import mechanisms
from logit_dp._src import methods
from logit_dp._src import sensitivity as sensitivity_lib


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class CheckedCall:
  """core(*check_inputs(...)) with check_model(*the core's arguments) run once, on first use.

  Attributes:
    core: the jitted body, called with what check_inputs returns.
    check_inputs: (params, x, x_prime, mask=None, **kwargs) -> the core's arguments, after
      validating them (ValueError on bad input).
    check_model: called with the core's arguments of the first call, returns None (ValueError
      if the model cannot be used, e.g. it mixes the examples of a batch).
  """
  core: Callable[..., Any]
  check_inputs: Callable[..., tuple] = dataclasses.field(repr=False)
  check_model: Callable[..., None] = dataclasses.field(repr=False)
  _checked: list = dataclasses.field(default_factory=list, repr=False)

  def _checked_args(self, *args, **kwargs) -> tuple:
    core_args = self.check_inputs(*args, **kwargs)
    if not self._checked:  # on first use
      self.check_model(*core_args)
      self._checked.append(True)
    return core_args

  def _checked_core(self, *args, **kwargs):
    return self.core(*self._checked_args(*args, **kwargs))

  def check(self, *args, **kwargs) -> None:
    """Everything the first call would check, now, without computing anything: the inputs,
    the model (`check_model`) and the trace of the core (`jax.eval_shape`: the layer plan,
    ``trainable=`` against params, the one-time warning for a large leaf on the slow path).
    Takes the arguments of a call; a few rows suffice. Nothing is compiled."""
    jax.eval_shape(self.core, *self._checked_args(*args, **kwargs))


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class ClippedGradFn(CheckedCall):
  """grad_fn(params, x, x_prime, mask=None[, key=]) -> (ℒ, ḡ): a private (clipped) gradient.

  ḡ is a pytree like params with L2 sensitivity `sensitivity()` under adding or removing one
  pair record (`sensitivity(relation)` under a `dp_accounting.NeighboringRelation`, as
  jax_privacy's `BoundedSensitivityCallable`); noise it with
  `logit_dp.transform(σ, grad_fn.sensitivity(), key)`. Called
  eagerly, it raises ValueError when any valid pair has non-finite inputs or embeddings;
  under jit such pairs are masked out (the same as removing them). grouped_clipped_grad's
  functions also take record_ids=, group_key= and extra_views= keywords; a stochastic one
  (built with stochastic=True) takes key=, the model's randomness.

  Attributes:
    mechanism: the `Mechanism` (Logit-DP, Naive-DP or DP-GCL).
    clip_norm: B (jnp.inf: unclipped, not private).
    loss: the loss ℒ(Z, mask).
    clip_method: the `methods.ClipMethod` of Logit-DP (None for the others).
    num_groups: G of DP-GCL (None for the others).
    description: the name its errors use, e.g. "clipped_grad(ghost)".
    unit: what a dropped row is ("pair(s)" or "record(s)").
    core: the jitted body without the input checks: core(params, x, x_prime, mask, ...)
      -> (ℒ, ḡ, n_nonfinite), n_nonfinite the valid rows with non-finite inputs or
      embeddings (masked out).
    stochastic: embed_fn is embed_fn(params, x, key) and every call takes key= (a fresh key
      per step, independent of the noise key); the core then takes the key after the mask.
    stats_core: the same computation returning (ℒ, ḡ, `ClipStats`) (None: no statistics).
    trainable: the ``trainable=`` it was built with (`logit_dp.finetune`): ḡ is that of the
      model with the frozen leaves closed over, exact zeros at them; None: every leaf trained.
  """
  mechanism: mechanisms.Mechanism
  clip_norm: float
  loss: Any
  clip_method: methods.ClipMethod | None = None
  num_groups: int | None = None
  description: str = ""
  unit: str = "pair(s)"
  stochastic: bool = False
  stats_core: Callable[..., Any] | None = dataclasses.field(default=None, repr=False)
  trainable: Any = dataclasses.field(default=None, repr=False)

  @property
  def method(self) -> str:
    """The method name: the clip method's for Logit-DP, "naive" or "dp_gcl"."""
    if self.clip_method is not None:
      return self.clip_method.name
    if self.mechanism is mechanisms.Mechanism.NAIVE_DP:
      return mechanisms.NAIVE_METHOD
    return mechanisms.GROUPED_METHOD

  def sensitivity(
      self,
      neighboring_relation: dp_accounting.NeighboringRelation = sensitivity_lib.ADD_OR_REMOVE_ONE,
      *, batch_size: int | None = None, max_pairs_per_user: int | None = None) -> float:
    """The L2 sensitivity of ḡ under a neighbouring relation, as jax_privacy's
    `BoundedSensitivityCallable.sensitivity`.

    Args:
      neighboring_relation: ADD_OR_REMOVE_ONE or REPLACE_SPECIAL (zero-out: the pair masked
        out): C; REPLACE_ONE: the replace-one sensitivity (`Mechanism.sensitivity`).
      batch_size: n when every batch has exactly n pairs; None: any batch size, as under
        Poisson sampling.
      max_pairs_per_user: K: the unit is a person with up to K pairs in a batch
        (`person_sensitivity` for Logit-DP, 2B for Naive-DP, 2B for DP-GCL called with
        ``user_ids=``, the person of every row); None: a pair.

    Returns:
      The sensitivity as a Python float. ValueError for an unclipped function, TypeError for a
      relation that is not a `dp_accounting.NeighboringRelation`.
    """
    if isinstance(neighboring_relation, int) and not isinstance(neighboring_relation, bool):
      warnings.warn(
          "grad_fn.sensitivity(n) is deprecated: pass the batch size as "
          "grad_fn.sensitivity(batch_size=n).", DeprecationWarning, stacklevel=2)
      neighboring_relation, batch_size = sensitivity_lib.ADD_OR_REMOVE_ONE, neighboring_relation
    elif neighboring_relation is None:
      neighboring_relation = sensitivity_lib.ADD_OR_REMOVE_ONE
    return self.mechanism.sensitivity(self.loss, self.clip_norm, batch_size,
                                      neighboring_relation=neighboring_relation,
                                      max_pairs_per_user=max_pairs_per_user)

  def with_num_dropped(self, params, x, x_prime, mask=None,
                       **kwargs) -> tuple[jax.Array, Any, jax.Array]:
    """(ℒ, ḡ, num_dropped): as grad_fn, never raising; num_dropped counts the valid rows
    dropped for non-finite inputs or embeddings (ℒ is NaN when that is all of them)."""
    return self._checked_core(params, x, x_prime, mask, **kwargs)

  def with_stats(self, params, x, x_prime, mask=None,
                 **kwargs) -> tuple[jax.Array, Any, clip_stats.ClipStats]:
    """(ℒ, ḡ, stats): (ℒ, ḡ) as `with_num_dropped`, never raising, and the `ClipStats` of the
    norms ḡ was clipped by (stats.num_dropped is with_num_dropped's count), all from one
    jitted computation.

    The statistics are NON-PRIVATE: they depend on the batch without noise (`ClipStats`).
    That computation is compiled separately and keeps every norm; the plain call does not
    compute them. TypeError for a function without statistics.
    """
    if self.stats_core is None:
      raise TypeError(f"{self.description} does not compute clip statistics.")
    return self.stats_core(*self._checked_args(params, x, x_prime, mask, **kwargs))

  def __call__(self, params, x, x_prime, mask=None, **kwargs) -> tuple[jax.Array, Any]:
    """(ℒ, ḡ) on the batch of pairs (x_i, x'_i) with mask_i true.

    Called eagerly it raises ValueError when valid rows were dropped for non-finite inputs
    or embeddings, and warns `EmptyBatchWarning` when the mask is all False (ℒ = 0, ḡ = 0).
    """
    loss_value, grads, num_dropped = self.with_num_dropped(params, x, x_prime, mask, **kwargs)
    checks.raise_if_dropped(self.description, (params, x, x_prime, mask, kwargs), num_dropped,
                            self.unit)
    checks.warn_if_empty(self.description, mask)
    return loss_value, grads

"""One call that sets up private training: `make_private`.

`make_private` wires the pieces together so that σ, C, q, T, the sampler and the
ledger cannot disagree, and so that the noise key and the sampling seed are secret
unless fixed on purpose. Its `PrivateTraining` accounts by construction:

* `PrivateTraining.batches` hands out the Poisson batches and records each step in
  the ledger before yielding it, so no batch leaves it unrecorded, and it stops (or
  raises `PrivacyBudgetExceededError`) where the budget ends;
* ``sampler`` is a `BudgetedSampler`: it refuses any step past the ledger's budget;
* `PrivateTraining.make_train_step` refuses to release more noisy updates than the
  ledger has recorded, and reports non-finite rows and empty batches;
* `PrivateTraining.save_checkpoint` / `restore_checkpoint` keep the state, the
  ledger and the sampler (seed, hence position) together.

The low-level path (`clipped_grad`, `sensitivity`, `accounting.noise_multiplier`,
`transform`, `PoissonSampler`, `PrivacyLedger.record_steps`) stays available: it
accounts only if the loop calls ``ledger.record_steps`` before every release.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from logit_dp._src import accounting
from logit_dp._src import clipping
from logit_dp._src import distributed
from logit_dp._src import ledger as ledger_lib
from logit_dp._src import mechanisms
from logit_dp._src import methods
from logit_dp._src import sensitivity as sensitivity_lib
from logit_dp._src.checks import EmptyBatchWarning
from logit_dp._src.ledger import BudgetedSampler
from logit_dp._src.ledger import PrivacyLedger
from logit_dp._src.noise import AddNoiseState
from logit_dp._src.sampling import PoissonBatch
from logit_dp._src.sampling import PoissonSampler

#: What `PrivateTraining.make_train_step` does on non-finite rows or an empty batch.
REPORT_POLICIES = ("warn", "error", "ignore")


class NonFiniteRowsWarning(UserWarning):
  """Valid pairs with non-finite inputs or embeddings were dropped from a private step."""


class UnrecordedStepError(RuntimeError):
  """A noisy update would be released without a step recorded in the ledger for it."""


def _noise_count(opt_state) -> int:
  """The count of the `AddNoiseState` in an optimizer state: noisy updates released so far."""
  states = [
      s
      for s in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda s: isinstance(s, AddNoiseState))
      if isinstance(s, AddNoiseState)
  ]
  if len(states) != 1:
    raise ValueError("opt_state must hold exactly one logit_dp noise state (AddNoiseState): "
                     "pass the state of PrivateTraining.optimizer, got "
                     f"{len(states)} noise states.")
  return int(states[0].count)


def _report(policy: str, message: str, category, exception) -> None:
  if policy == "error":
    raise exception(message)
  if policy == "warn":
    warnings.warn(message, category, stacklevel=3)


class PrivateTraining(NamedTuple):
  """Everything a private training loop needs, consistent by construction.

  Attributes:
    grad_fn: a `ClippedGradFn`, grad_fn(params, x, x_prime, mask) -> (ℒ, ḡ), ḡ the SUM
      of clipped pair gradients (`clipped_grad`) or the clipped batch gradient
      (`naive_clipped_grad` for method="naive"); ``grad_fn.mechanism`` says which.
    optimizer: optax chain ḡ → + N(0, (σC)²) → [× 1/E[n] if mean] → optimizer.
      Its state holds the noise key: checkpoint it, keep it secret.
    sampler: the Poisson sampler (rate q, secret seed) bound to the ledger
      (`BudgetedSampler`): sampler(t) is the batch of step t and raises
      `PrivacyBudgetExceededError` for a step past the budget.
    ledger: the privacy ledger (σ, q, δ, budget ε); `batches` records in it.
    noise_multiplier: σ, the smallest σ with ε(σ, δ, q, T) ≤ target ε.
    sensitivity: C of ḡ under add/remove one pair, for any batch size.
    clip_norm: B.
    sampling_rate: q = expected_batch_size / num_records.
    steps: T, the number of steps σ is calibrated for.
    method: the gradient method's name (a clip method's, e.g. "ghost", or "naive").
    model_key: a stochastic model (stochastic=True): the secret key its randomness is drawn
      from, split from the training key apart from the noise key; step t's key is
      fold_in(model_key, t), handed to grad_fn by `make_train_step`. None otherwise.

  The training loop (every released step recorded before it happens)::

    train_step = private.make_train_step()
    opt_state = private.optimizer.init(params)
    for batch in private.batches():          # steps ledger.steps, ..., T − 1
      params, opt_state, loss = train_step(params, opt_state, x[batch.indices],
                                           x_prime[batch.indices], batch.mask)
  """
  grad_fn: Callable
  optimizer: optax.GradientTransformation
  sampler: BudgetedSampler
  ledger: PrivacyLedger
  noise_multiplier: float
  sensitivity: float
  clip_norm: float
  sampling_rate: float
  steps: int
  method: str
  model_key: Any = None

  def batches(self, steps: int | None = None) -> Iterator[PoissonBatch]:
    """Yields the Poisson batches of steps ledger.steps, …, T − 1, recording each first.

    Before yielding the batch of step t it draws it (`sampler`(t): raises
    `PrivacyBudgetExceededError` past the budget, `BatchOverflowError` on an
    overflow) and records the step (`PrivacyLedger.record_steps`(1)), so every
    batch handed out is accounted for, whether or not its update is released.
    The position is the ledger's step count: after `restore_checkpoint`, or a
    second call, it continues where the ledger stands.

    Args:
      steps: stop once the ledger holds this many steps (default T =
        ``self.steps``). More than T is allowed while the budget lasts; the
        step past it raises `PrivacyBudgetExceededError` before its batch exists.

    Raises:
      RuntimeError: the ledger recorded steps inside the loop (``record_steps``
        is the low-level path; here it would count each step twice).
    """
    end = self.steps if steps is None else accounting.check_steps(steps)
    while self.ledger.steps < end:
      step = self.ledger.steps
      batch = self.sampler(step)
      self.ledger.record_steps(1)
      yield batch
      if self.ledger.steps != step + 1:
        raise RuntimeError(
            f"The ledger went from {step + 1} to {self.ledger.steps} steps inside the loop over "
            "PrivateTraining.batches(), which records every step itself: remove the "
            "ledger.record_steps call (it counts the step twice).")

  def make_train_step(self, *, on_nonfinite: str = "warn", on_empty: str = "warn",
                      jit: bool = True) -> Callable:
    """train_step(params, opt_state, x, x_prime, mask=None) -> (params, opt_state, ℒ).

    One private update: (ℒ, ḡ) from ``grad_fn``, then ``optimizer`` (the noise
    first) and `optax.apply_updates`, jitted. Around it, on the host:

    * before the update: `UnrecordedStepError` unless the ledger has recorded more
      steps than the optimizer state has released noisy updates (its noise count),
      so no update leaves without its step in the ledger (draw the batches with
      `batches`, or call ``ledger.record_steps(1)`` first on the low-level path),
      and when this train_step already released the update of that noise count
      (an old optimizer state used again: the same noise twice);
    * after it: the number of valid pairs dropped for non-finite inputs or
      embeddings (``grad_fn.with_num_dropped``) and an empty batch (no valid
      pair: the update is pure noise) are reported per ``on_nonfinite`` and
      ``on_empty``: "warn" (`NonFiniteRowsWarning`, `EmptyBatchWarning`),
      "error" (FloatingPointError, ValueError; the update is discarded, nothing
      is released) or "ignore".

    An empty Poisson batch is part of the mechanism (probability (1 − q)^N): its
    noisy update is released as any other, which is what the accounting assumes.

    Args:
      on_nonfinite, on_empty: "warn" (default), "error" or "ignore".
      jit: jit the update (default); False runs it eagerly (debugging).
    """
    for name, value in (("on_nonfinite", on_nonfinite), ("on_empty", on_empty)):
      if value not in REPORT_POLICIES:
        raise ValueError(f"{name} must be one of {REPORT_POLICIES}, got {value!r}.")
    grad_fn, optimizer, ledger = self.grad_fn, self.optimizer, self.ledger
    with_num_dropped = getattr(grad_fn, "with_num_dropped", None)
    model_key = self.model_key

    def update(params, opt_state, x, x_prime, mask, step):
      # A stochastic model: the randomness of step t, fold_in(model_key, t), never released.
      key = {} if model_key is None else {"key": jax.random.fold_in(model_key, step)}
      if with_num_dropped is None:
        loss_value, grads = grad_fn(params, x, x_prime, mask, **key)
        num_dropped = jnp.zeros((), jnp.int32)
      else:
        loss_value, grads, num_dropped = with_num_dropped(params, x, x_prime, mask, **key)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      num_valid = jnp.sum(mask, dtype=jnp.int32)
      return optax.apply_updates(params, updates), opt_state, loss_value, num_dropped, num_valid

    update = jax.jit(update) if jit else update

    released_counts = set()

    def train_step(params, opt_state, x, x_prime, mask=None):
      released = _noise_count(opt_state)
      if released in released_counts:
        raise UnrecordedStepError(
            f"This train_step already released the update of noise count {released}: a second "
            "update from the same optimizer state draws the same noise, and the difference of "
            "the two updates would reveal the gradients without noise. Continue from the "
            "optimizer state the last step returned.")
      if released >= ledger.steps:
        raise UnrecordedStepError(
            f"The optimizer state has released {released} noisy update(s) and the ledger has "
            f"recorded {ledger.steps} step(s): update {released + 1} would leave unaccounted. "
            "Draw the batches with PrivateTraining.batches(), which records each step, or call "
            "ledger.record_steps(1) before the update on the low-level path.")
      if mask is None:
        mask = jnp.ones((jax.tree_util.tree_leaves(x)[0].shape[0],), bool)
      params_out, state_out, loss_value, num_dropped, num_valid = update(
          params, opt_state, x, x_prime, mask, released)
      if int(num_valid) == 0:
        _report(
            on_empty, f"Private step {released + 1}: the batch has no valid pair (mask all "
            "False), so the released update is pure noise. A Poisson batch is empty with "
            f"probability (1 − q)^N = (1 − {self.sampling_rate:g})^{self.sampler.num_records}; "
            "anything else is a masking error.", EmptyBatchWarning, ValueError)
      if int(num_dropped) > 0:
        _report(
            on_nonfinite, f"Private step {released + 1}: {int(num_dropped)} of {int(num_valid)} "
            "valid pair(s) have non-finite inputs or embeddings (NaN/inf) and were dropped "
            "(masked out, still private). Check the data, or lower the learning rate if the "
            "model diverges.", NonFiniteRowsWarning, FloatingPointError)
      released_counts.add(released)
      return params_out, state_out, loss_value

    return train_step

  def save_checkpoint(self, directory, state: Any, *, max_to_keep: int | None = None) -> None:
    """Saves ``state`` (params, optimizer state), the ledger and the sampler as one checkpoint.

    The checkpoint step is the ledger's step count (`logit_dp.ledger.save_checkpoint`).
    It holds the noise key and the sampler seed: keep it private.
    """
    ledger_lib.save_checkpoint(directory, self.ledger.steps, state, self.ledger,
                               sampler=self.sampler.unbudgeted(), max_to_keep=max_to_keep)

  def restore_checkpoint(self, directory, template: Any,
                         step: int | None = None) -> tuple[Any, PrivateTraining]:
    """(state, private) from the newest checkpoint (or ``step``) of `save_checkpoint`.

    The returned `PrivateTraining` has the checkpoint's ledger (steps taken, with
    this object's budgets) and its sampler seed, so `batches` resumes at the
    checkpointed step with the batches of an uninterrupted run; the state holds
    the optimizer's noise count and key, so the noise continues too. Without a
    checkpoint in ``directory``, returns (template, self).

    Raises:
      ValueError: the checkpoint's σ, q, δ, accountant or sampler (N, q, padded
        size, overflow policy) differ from this run's, or it holds no sampler.
    """
    if ledger_lib.latest_step(directory) is None:
      return template, self
    state, ledger, step = ledger_lib.restore_checkpoint(directory, template, step)
    sampler = ledger_lib.restore_sampler(directory, step)
    if sampler is None:
      raise ValueError(
          f"Checkpoint {step} in {directory!r} holds no sampler (saved without sampler=): "
          "resuming with another seed would redo its steps with other batches. Use "
          "logit_dp.ledger.restore_checkpoint and make_private(..., sampler_seed=<the seed "
          "of that run>) instead.")
    mine = self.ledger
    for name in ("noise_multiplier", "sampling_rate", "target_delta", "accountant",
                 "overflow_probability", "pld_discretization"):
      if getattr(ledger, name) != getattr(mine, name):
        raise ValueError(f"Checkpoint {step} in {directory!r} was made with ledger {name} = "
                         f"{getattr(ledger, name)!r}, this run has {getattr(mine, name)!r}: "
                         "its steps cannot continue this run's accounting.")
    for name in ("num_records", "sampling_rate", "max_batch_size", "overflow"):
      if getattr(sampler, name) != getattr(self.sampler, name):
        raise ValueError(f"Checkpoint {step} in {directory!r} was made with sampler {name} = "
                         f"{getattr(sampler, name)!r}, this run has "
                         f"{getattr(self.sampler, name)!r}.")
    ledger = dataclasses.replace(mine, steps=ledger.steps)
    return state, self._replace(ledger=ledger, sampler=BudgetedSampler.bind(sampler, ledger))


def _check_count(name: str, value) -> int:
  if isinstance(value, bool):
    raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  try:
    out = int(value)
  except (TypeError, ValueError, OverflowError):
    raise ValueError(f"{name} must be a positive integer, got {value!r}.") from None
  if out != value or out < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  return out


def _secret_seed() -> int:
  # `secrets` on process 0, shared with every process (one noise key, one sampler for all).
  return distributed.broadcast_seed()


def make_private(embed_fn: Callable, loss, clip_norm: float, *, target_epsilon: float,
                 target_delta: float, num_records: int, expected_batch_size: float,
                 optimizer: optax.GradientTransformation, epochs: float | None = None,
                 steps: int | None = None, method: str | methods.ClipMethod = "ghost",
                 mean: bool = False, microbatch_size: int | None = None, accountant: str = "pld",
                 noise_key: Any = None, sampler_seed: int | None = None,
                 max_batch_size: int | None = None, overflow: str = "error",
                 **grad_kwargs) -> PrivateTraining:
  """Sets up (ε, δ)-DP training in one call, as Opacus' `make_private_with_epsilon`.

  q = expected_batch_size / num_records; T = steps, or ⌈epochs / q⌉;
  σ = `accounting.noise_multiplier(ε, δ_acc, q, T, accountant)` with δ_acc = δ minus
  the padded batches' overflow term (`PrivacyLedger.calibrated`);
  C = `sensitivity(loss, B, batch_size=None)` (`naive_sensitivity(B)` = 2B for
  method="naive"); optimizer = chain(`transform(σ, C, noise_key)`,
  [`optax.scale(1 / expected_batch_size)` if mean], optimizer). The noise is
  added to the summed ḡ first; the mean and the optimizer are post-processing.

  Formal guarantees. Neighbouring datasets differ by adding or removing one
  pair record (x_i, x'_i) (`dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE`).
  If every step draws its batch with ``sampler`` (Poisson sampling at rate q,
  secret seed), computes ḡ with ``grad_fn`` (L2 sensitivity ≤ C for every batch
  size, C = `logit_dp.sensitivity(loss, B, batch_size=None)`), updates through
  ``optimizer`` (fresh N(0, (σC)²I) per step from a secret key), and takes at
  most T steps, the released updates (and all models computed from them) are
  (ε, δ′)-DP with ε ≤ target_epsilon and δ′ = δ_acc + the sampler's overflow
  term ≤ target_delta, which ``ledger.guarantee()`` reports (see docs/PRIVACY.md
  for the conditions on embed_fn and what is not covered). A loop over
  `PrivateTraining.batches` with the step of `PrivateTraining.make_train_step`
  meets the sampling, recording and step-count conditions by construction.

  Args:
    embed_fn: embed_fn(params, x) -> (n, d), acting on examples independently.
    loss: a loss from `logit_dp.losses`.
    clip_norm: B > 0, finite.
    target_epsilon: ε > 0, the ε to reach after T steps.
    target_delta: δ ∈ (0, 1), the δ to reach after T steps (a UserWarning when δ ≥ 1/N).
    num_records: N, the number of pair records.
    expected_batch_size: E[n] = q·N of the Poisson batches.
    optimizer: any optax optimizer; it receives the noisy ḡ (or ḡ / E[n]).
    epochs: passes over the data, T = ⌈epochs / q⌉ steps (pass epochs or steps, not both).
    steps: T, the number of steps (pass epochs or steps, not both).
    method: a clip method of `clipped_grad` (an object such as
      ``clip_methods.Projected(reference_inputs=public_x)``, or a registered name: "ghost",
      the default, "triangle", "materialize") or "naive" (Naive-DP).
    mean: scale the noisy sum by 1 / expected_batch_size before the optimizer.
    microbatch_size: passed to `clipped_grad` / `naive_clipped_grad`.
    accountant: "pld" (default) or "rdp", used for σ and by the ledger.
    noise_key: JAX PRNG key of the noise; None draws one with `secrets`
      (multi-host: on process 0, shared with every process; `broadcast_seed`).
      Fixing it makes runs reproducible and voids the guarantee against
      whoever knows it.
    sampler_seed: integer seed of the Poisson sampler; None draws one with
      `secrets`, as noise_key (read it from ``sampler.seed`` to resume; keep
      it secret).
    max_batch_size: the padded batch size of `sampling.PoissonSampler` (None: large enough
      that a batch overflows it with a small probability, which δ accounts for).
    overflow: what a larger Poisson batch does, "error" (default) or "truncate"
      (`sampling.PoissonSampler`).
    **grad_kwargs: other `clipped_grad` arguments (cosine_eps;
      positive_embed_fn for a two-tower model, with the same C; stochastic=True for a
      model embed_fn(params, x, key) with dropout: the training key is then split into the
      noise key and ``model_key``, and each step's model randomness is
      fold_in(model_key, t), independent of the noise and never released; same C and σ).

  Returns:
    A `PrivateTraining`.
  """
  if not callable(embed_fn):
    raise ValueError(f"embed_fn must be callable, got {embed_fn!r}.")
  mechanisms.check_private_method(method)
  if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
    raise ValueError(f"optimizer must be an optax.GradientTransformation, got {optimizer!r}.")
  if not isinstance(mean, bool):
    raise ValueError(f"mean must be True or False, got {mean!r}.")
  if (epochs is None) == (steps is None):
    raise ValueError("Pass exactly one of epochs and steps, got "
                     f"epochs={epochs!r}, steps={steps!r}.")
  eps = accounting.check_epsilon(target_epsilon)
  delta = accounting.check_delta(target_delta)
  n = _check_count("num_records", num_records)
  accounting.check_accountant(accountant)
  q = accounting.sampling_rate_for(expected_batch_size, n)
  t = accounting.check_steps(steps) if epochs is None else accounting.steps_for_epochs(epochs, q)
  if sampler_seed is not None and (isinstance(sampler_seed, bool)
                                   or not isinstance(sampler_seed, int) or sampler_seed < 0):
    raise ValueError(f"sampler_seed must be an integer ≥ 0 or None, got {sampler_seed!r}.")
  b = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=False)

  grad_fn = clipping.private_grad(embed_fn, loss, b, method, microbatch_size=microbatch_size,
                                  **grad_kwargs)
  c = grad_fn.sensitivity(batch_size=None)

  accounting.warn_if_large_delta(delta, n, stacklevel=3)
  poisson = PoissonSampler(num_records=n, sampling_rate=q, max_batch_size=max_batch_size,
                           seed=_secret_seed() if sampler_seed is None else sampler_seed,
                           overflow=overflow)
  with warnings.catch_warnings():  # δ ≥ 1/N was already reported above, once
    warnings.filterwarnings("ignore", message="target_delta=", category=UserWarning)
    ledger = PrivacyLedger.calibrated(poisson, eps, delta, t, accountant)
  sampler = BudgetedSampler.bind(poisson, ledger)
  sigma = ledger.noise_multiplier
  key = jax.random.key(_secret_seed()) if noise_key is None else noise_key
  model_key = None
  if grad_fn.stochastic:  # two independent keys: the noise's and the model's randomness
    key, model_key = jax.random.split(key)
  scale_by = float(expected_batch_size) if mean else None
  tx = distributed.make_private_optimizer(sigma, c, key, optimizer, expected_batch_size=scale_by)
  return PrivateTraining(grad_fn=grad_fn, optimizer=tx, sampler=sampler, ledger=ledger,
                         noise_multiplier=sigma, sensitivity=c, clip_norm=b, sampling_rate=q,
                         steps=t, method=grad_fn.method, model_key=model_key)

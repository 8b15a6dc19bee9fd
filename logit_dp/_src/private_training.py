"""One call that sets up private training: `make_private`.

`make_private` wires the pieces together so that σ, C, q, T, the sampler and the
ledger cannot disagree, and so that the noise key and the sampling seed are secret
unless fixed on purpose. Its `PrivateTraining` accounts by construction:

* `PrivateTraining.batches` hands out the Poisson batches and records each step in
  the ledger before yielding it, so no batch leaves it unrecorded; it stops at T and
  raises `PrivacyBudgetExceededError` past the budget, or when called with the T
  steps already spent;
* ``sampler`` is a `BudgetedSampler`: it refuses any step past the ledger's budget;
* `PrivateTraining.make_train_step`'s step takes a batch of `batches` and the records,
  gathers the batch and masks its padding itself; it refuses to release more noisy
  updates than the ledger has recorded, or a noise count the ledger has released
  already (by any step), and reports non-finite rows and empty batches without
  waiting for the device;
* `PrivateTraining.save_checkpoint` / `restore_checkpoint` keep the state, the
  ledger and the sampler (seed, hence position) together.

The low-level path (`clipped_grad`, `sensitivity`, `accounting.noise_multiplier`,
`transform`, `PoissonSampler`, `PrivacyLedger.record_steps`) stays available: it
accounts only if the loop calls ``ledger.record_steps`` before every release.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logit_dp._src import accounting
from logit_dp._src import clipping
from logit_dp._src import distributed
from logit_dp._src import finetune
from logit_dp._src import grouped as grouped_lib
from logit_dp._src import ledger as ledger_lib
from logit_dp._src import mechanisms
from logit_dp._src import methods
from logit_dp._src import rows as rows_lib
from logit_dp._src import sensitivity as sensitivity_lib
from logit_dp._src import update as update_lib
from logit_dp._src.checks import EmptyBatchWarning
from logit_dp._src.ledger import BudgetedSampler
from logit_dp._src.ledger import PrivacyBudgetExceededError
from logit_dp._src.ledger import PrivacyLedger
from logit_dp._src.noise import AddNoiseState
from logit_dp._src.sampling import PersonPoissonSampler
from logit_dp._src.sampling import PoissonBatch
from logit_dp._src.sampling import PoissonSampler
from logit_dp._src.sampling import check_user_ids

#: What `PrivateTraining.make_train_step` does on non-finite rows or an empty batch.
REPORT_POLICIES = ("warn", "error", "ignore")


class NonFiniteRowsWarning(UserWarning):
  """Valid pairs with non-finite inputs or embeddings were dropped from a private step."""


class UnrecordedStepError(RuntimeError):
  """A noisy update would be released without a step recorded in the ledger for it, or with
  noise already released."""


class NonFiniteParametersError(FloatingPointError):
  """A private step dropped every valid pair whose inputs are finite because its embeddings
  are not: the parameters are non-finite (a diverged run), and every further update would be
  pure noise. Raised by `PrivateTraining.make_train_step`'s step at its first report of such
  a step (under "warn" too), and by `PrivateTraining.batches` before it records another step."""


#: How many record indices (or rows) with non-finite values a report names.
NAMED_ROWS = 8


def _noise_states(tree) -> list[AddNoiseState]:
  """Every `AddNoiseState` in a pytree (an optimizer state, or a state that holds one)."""
  is_noise = lambda s: isinstance(s, AddNoiseState)
  return [s for s in jax.tree_util.tree_leaves(tree, is_leaf=is_noise) if is_noise(s)]


def _noise_state(opt_state) -> AddNoiseState:
  """The `AddNoiseState` of an optimizer state; its count is the noisy updates released."""
  states = _noise_states(opt_state)
  if len(states) != 1:
    raise ValueError("opt_state must hold exactly one logit_dp noise state (AddNoiseState): "
                     "pass the state of PrivateTraining.optimizer, got "
                     f"{len(states)} noise states.")
  return states[0]


def _host_int(value) -> int:
  """int(value), from this process's copy of a replicated array (multi-host: every process
  holds the same count, so every process reads the same)."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    value = value.addressable_data(0)
  return int(value)


def _key_bytes(state: AddNoiseState) -> bytes:
  """The noise key of a noise state, as bytes (multi-host: this process's copy)."""
  key = state.rng_key
  if isinstance(key, jax.Array) and not key.is_fully_addressable:
    key = key.addressable_data(0)
  return np.asarray(key).tobytes()


def _is_ready(value) -> bool:
  if not isinstance(value, jax.Array):
    return True
  return value.is_ready()  # pyright: ignore[reportAttributeAccessIssue]


def _report(policy: str, message: str, category, exception) -> None:
  if policy == "error":
    raise exception(message)
  if policy == "warn":
    warnings.warn(message, category, stacklevel=4)


def _host_device():
  """The CPU device, where `PrivateTraining.batches` draws its batches: drawing batch t + 1
  then does not wait for the accelerator's step t. None without a CPU backend."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return None


class _Loop:
  """What the batches() loops and train steps over one ledger share in a process: the batches
  handed out and not used yet (by id), the steps' report flushes and polls (the reports of
  the steps that have run, without waiting), the `NonFiniteParametersError` that stopped the
  loop (None while none has), and the noise keys of the optimizer states restored into this
  ledger (`PrivateTraining.restore_checkpoint`)."""
  def __init__(self):
    self.unused: dict[int, PoissonBatch] = {}
    self.flushes = weakref.WeakSet()
    self.polls = weakref.WeakSet()
    self.failure: NonFiniteParametersError | None = None
    self.noise_keys: set[bytes] = set()

  def poll(self) -> None:
    """Makes the reports of the train steps that have run; raises the loop's
    `NonFiniteParametersError` (again) once there is one."""
    for poll in list(self.polls):
      poll()
    if self.failure is not None:
      raise NonFiniteParametersError(str(self.failure))

  def flush(self, stop: bool) -> None:
    """Makes every report not made yet; with stop=False (the loop is closing on an error or
    a break) a `NonFiniteParametersError` is a `NonFiniteRowsWarning` instead."""
    for flush in list(self.flushes):
      flush(stop=stop)


_LOOPS: dict[int, tuple[weakref.ref, _Loop]] = {}


def _loop(ledger: PrivacyLedger) -> _Loop:
  """The `_Loop` of ``ledger`` (one per ledger object, dropped with it)."""
  key = id(ledger)
  entry = _LOOPS.get(key)
  if entry is None or entry[0]() is not ledger:
    entry = (weakref.ref(ledger, lambda _: _LOOPS.pop(key, None)), _Loop())
    _LOOPS[key] = entry
  return entry[1]


def _check_mask(mask, x) -> Any:
  """The mask of the array form: bool (n,), n the leading size of x."""
  leaves = jax.tree_util.tree_leaves(x)
  if not leaves or not hasattr(leaves[0], "shape") or len(leaves[0].shape) < 1:
    raise TypeError("x must be an array (or pytree of arrays) of n examples along axis 0, got "
                    f"{type(x).__name__}.")
  n = leaves[0].shape[0]
  if not hasattr(mask, "shape"):
    mask = np.asarray(mask)
  if tuple(mask.shape) != (n,) or mask.dtype != bool:
    raise ValueError(f"mask must be a bool array of shape ({n},), one entry per row of x: pass "
                     f"batch.mask, got {getattr(mask, 'dtype', type(mask).__name__)} of shape "
                     f"{tuple(mask.shape)}.")
  return mask


def _replicated(tree, mesh):
  """tree as it is if every array leaf is replicated on `mesh` already (what the step
  returns), else `distributed.replicate`-d (the first step's params and optimizer state)."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  leaves = jax.tree_util.tree_leaves(tree)
  if all(
      isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(replicated, leaf.ndim)
      for leaf in leaves):
    return tree
  return distributed.replicate(tree, mesh)


def _gather(data, indices: np.ndarray, num_records: int, mask: np.ndarray, mesh=None):
  """(x, x_prime, mask): the records of ``indices`` in data = (x_all, x_prime_all), each a
  pytree of arrays with the N records along axis 0.

  A jax.Array is gathered on its device (no copy of the dataset), any other array on the
  host (only the batch is sent to the device). On a mesh, host records are gathered row by
  device: each process takes only the rows its devices hold
  (`distributed.local_batch_indices`) and the global batch, padded with masked rows to a
  multiple of the devices, is assembled from them (`distributed.shard_batch`).
  """
  if not (isinstance(data, (tuple, list)) and len(data) == 2):
    raise TypeError("data must be the records (x_all, x_prime_all), arrays (or pytrees) of the "
                    f"N = {num_records} pair records along axis 0, got {type(data).__name__}.")
  on_device = any(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(data))
  if mesh is not None and on_device and jax.process_count() > 1:
    raise TypeError("On a mesh spanning several processes the records (x_all, x_prime_all) must "
                    "be host (NumPy) arrays: each process gathers its own rows of the batch.")

  def checked(leaf):
    if not isinstance(leaf, jax.Array):
      leaf = np.asarray(leaf)
    if leaf.ndim < 1 or leaf.shape[0] != num_records:
      raise ValueError(f"data must hold the N = {num_records} pair records along axis 0 (the "
                       "sampler's num_records), got an array of shape "
                       f"{tuple(leaf.shape)}.")
    return leaf

  data = jax.tree_util.tree_map(checked, tuple(data))
  if mesh is None or on_device:
    x, x_prime = jax.tree_util.tree_map(lambda leaf: leaf[indices], data)
    return x, x_prime, mask
  rows, local_mask = distributed.local_batch_indices(mesh, indices, mask)
  x, x_prime = jax.tree_util.tree_map(lambda leaf: leaf[rows], data)
  return distributed.shard_batch(mesh, x, x_prime, local_mask)


def _rows(tree, start: int, stop: int | None = None):
  return jax.tree_util.tree_map(lambda a: a[start:stop], tree)


def _joined(head, tail):
  return jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), head, tail)


class PrivateTraining(NamedTuple):
  """Everything a private training loop needs, consistent by construction.

  Attributes:
    grad_fn: a `ClippedGradFn`, grad_fn(params, x, x_prime, mask) -> (ℒ, ḡ), ḡ the SUM
      of clipped pair gradients (`clipped_grad`), the clipped batch gradient
      (`naive_clipped_grad` for method="naive") or the sum of clipped group gradients
      (`grouped_clipped_grad` for method="dp_gcl", which also takes record_ids= and
      group_key=); ``grad_fn.mechanism`` says which.
    optimizer: optax chain ḡ → + N(0, (σC)²) → [× 1/E[n] if mean] → optimizer.
      Its state holds the noise key: checkpoint it, keep it secret.
    sampler: the Poisson sampler (rate q, secret seed) bound to the ledger
      (`BudgetedSampler`): sampler(t) is the batch of step t and raises
      `PrivacyBudgetExceededError` for a step past the budget.
    ledger: the privacy ledger (σ, q, δ, budget ε); `batches` records in it, and it
      records the noisy updates released (``released_updates``) for every train step
      built from this object.
    noise_multiplier: σ, the smallest σ with ε(σ, δ, q, T) ≤ target ε.
    sensitivity: C of ḡ under add/remove one pair, for any batch size.
    clip_norm: B.
    sampling_rate: q = expected_batch_size / num_records.
    steps: T, the number of steps σ is calibrated for.
    method: the gradient method's name (a clip method's, e.g. "ghost", "naive" or "dp_gcl").
    model_key: a stochastic model (stochastic=True): the secret key its randomness is drawn
      from, split from the training key apart from the noise key; step t's key is
      fold_in(model_key, t), handed to grad_fn by `make_train_step`. None otherwise.
    group_key: DP-GCL (method="dp_gcl"): the key of the group assignment, independent of the
      data; step t groups its records by `assign_groups(record_ids, fold_in(group_key, t), G)`
      (`make_train_step`; per person: by the records' people). None otherwise.
    max_pairs_per_user: K of privacy per person (`make_private(user_ids=, max_pairs_per_user=)`:
      the unit is a person, ``sensitivity`` the per-person C_K, ``sampler`` a
      `PersonPoissonSampler`, ``ledger.unit`` "person"); None: the unit is a pair.
    trainable: fine-tuning (`make_private(trainable=)`): which leaves of params are trained
      (`logit_dp.finetune`); None: every leaf.

  The training loop (every released step recorded before it happens; the step gathers
  the batch's records and masks its padding itself)::

    train_step = private.make_train_step()
    opt_state = private.optimizer.init(params)
    for batch in private.batches():          # steps ledger.steps, ..., T − 1
      params, opt_state, loss = train_step(params, opt_state, batch, (x_all, x_prime_all))

  (method="dp_gcl": the step groups the batch's records by their indices.)
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
  group_key: Any = None
  max_pairs_per_user: int | None = None
  trainable: Any = None

  def batches(self, steps: int | None = None) -> Iterator[PoissonBatch]:
    """Yields the Poisson batches of steps ledger.steps, …, T − 1, recording each first.

    Before yielding the batch of step t it draws it (`sampler`(t): raises
    `PrivacyBudgetExceededError` past the budget, `BatchOverflowError` on an
    overflow; drawn on the CPU, so it does not wait for the accelerator) and
    records the step (`PrivacyLedger.record_steps`(1)), so every batch handed out
    is accounted for, whether or not its update is released. The position is the
    ledger's step count: after `restore_checkpoint`, or a second call, it continues
    where the ledger stands. Before recording a step it makes the reports of the
    train steps that have run (non-finite rows, empty batches), and when the loop
    ends, those not made yet.

    Args:
      steps: stop once the ledger holds this many steps, counted from the start of
        the run (default T = ``self.steps``). More than T is allowed while the budget
        lasts; the step past it raises `PrivacyBudgetExceededError` before its batch
        exists.

    Raises:
      PrivacyBudgetExceededError: when called, the ledger already holds T (and
        ``steps``) steps: the budget is spent, the loop would train nothing.
      ValueError: when called, the ledger already holds ``steps`` < T steps (the
        loop would train nothing; ``steps`` counts from the start of the run).
      RuntimeError: the ledger recorded steps inside the loop (``record_steps``
        is the low-level path; here it would count each step twice).
      NonFiniteParametersError: a train step reported non-finite parameters
        (`make_train_step`); no step is recorded after it, and this loop hands out
        no further batch (a new call to ``batches`` starts a new loop).
    """
    end = self.steps if steps is None else accounting.check_steps(steps)
    start = self.ledger.steps
    if start >= end:
      if start >= self.steps:
        eps, delta = self.ledger.guarantee()
        budget = ("" if self.ledger.epsilon_budget is None else
                  f" of the budget ε = {self.ledger.epsilon_budget:g}")
        raise PrivacyBudgetExceededError(
            f"The budget of T = {self.steps} steps is spent: the ledger holds {start} steps, "
            f"(ε, δ) = ({eps:.4g}, {delta:.3g}) per {self.ledger.unit}{budget}, so batches() "
            "has no step to hand out and the loop would train nothing. To train further, set up "
            "a run with a larger budget (make_private with a larger target_epsilon, or more "
            "epochs or steps); a second run on the same records spends its ε on top of this "
            "one's.")
      raise ValueError(
          f"batches(steps={end}) stops once the ledger holds {end} steps, and it holds "
          f"{start}: the loop would train nothing. steps counts from the start of the run "
          f"(T = {self.steps}): pass a larger one, or none for the rest of the run.")
    return self._batches(end)

  def _batches(self, end: int) -> Iterator[PoissonBatch]:
    loop = _loop(self.ledger)
    loop.failure = None  # a new loop: the parameters may have been fixed
    device = _host_device()
    completed = False
    try:
      while self.ledger.steps < end:
        # The reports of the steps that have run, before the next step is recorded: a
        # NonFiniteParametersError stops the loop with no step recorded past it.
        loop.poll()
        step = self.ledger.steps
        if device is None:
          batch = self.sampler(step)
        else:
          with jax.default_device(device):
            batch = self.sampler(step)
        self.ledger._add_steps(1)  # record_steps(1), without computing ε at every step
        loop.unused[id(batch)] = batch
        yield batch
        if self.ledger.steps != step + 1:
          raise RuntimeError(
              f"The ledger went from {step + 1} to {self.ledger.steps} steps inside the loop "
              "over PrivateTraining.batches(), which records every step itself: remove the "
              "ledger.record_steps call (it counts the step twice).")
      completed = True
    finally:
      loop.flush(stop=completed)

  def make_train_step(self, *, on_nonfinite: str = "warn", on_empty: str = "warn",
                      augment: Callable | None = None, clip_stats: bool = False,
                      jit: bool = True) -> Callable:
    """train_step(params, opt_state, batch, (x_all, x_prime_all)) -> (params, opt_state, ℒ).

    With method="dp_gcl" the records are grouped by their indices (``batch.indices``),
    hashed into groups with fold_in(group_key, t) at step t; the array form below then
    takes them as ``record_ids=``.

    One private update of a batch that `batches` handed out: the step gathers
    its records, x = x_all[batch.indices] and x′ = x_prime_all[batch.indices] (a
    jax.Array on its device, any other array on the host, so only the batch is sent),
    masks the padding with batch.mask, computes (ℒ, ḡ) with ``grad_fn`` and applies
    ``optimizer`` (the noise first) and `optax.apply_updates`, jitted. x_all and
    x_prime_all are arrays (or pytrees of arrays) of the N records along axis 0.

    A custom pipeline that gathers its own rows calls
    train_step(params, opt_state, x, x_prime, mask) with the mask required (bool, one
    entry per row: padded rows False).

    On the host, before the update, it refuses (`UnrecordedStepError`) an update
    without a step recorded for it (the ledger must hold more steps than the
    optimizer state's noise count) and an optimizer state whose noise count the
    ledger has already released (``ledger.released_updates``, shared by every
    step built from this `PrivateTraining`, saved in its checkpoints and kept by
    `restore_checkpoint`): the same noise on another gradient would reveal their
    difference. An optimizer state this training did not produce is refused with
    ValueError: its noise key is neither ``optimizer``'s nor that of a state
    restored by `restore_checkpoint`, or its noise count exceeds the updates this
    training released. A batch that `batches` has not handed out (another run's, one
    drawn by hand), or one already used, is refused with ValueError: every update
    has a fresh Poisson batch of its own.

    The call does not wait for the device: the noise count of an optimizer state
    this step returned is known on the host (a state it has not seen, e.g. one
    just restored, is read once), and the reports are read from the device once
    the step has run. The number of valid pairs dropped for non-finite inputs or
    embeddings (``grad_fn.with_num_dropped``) and an empty batch (no valid pair:
    the update is pure noise) are reported per ``on_nonfinite`` and ``on_empty``:

    * "warn" (default): `NonFiniteRowsWarning`, `EmptyBatchWarning`, late: at the
      first later call that finds the step done (at most two steps late), when
      `batches` is about to record its next step, at ``train_step.flush()`` and at
      the end of the `batches` loop;
    * "error": FloatingPointError, ValueError before the call returns (it waits
      for the step); the update is discarded, nothing is released;
    * "ignore": nothing is read.

    A report tells the data's fault from the model's. Valid pairs with non-finite
    inputs (after ``augment``) are named by their record indices (``batch.indices``;
    the array form names the batch's rows, or its ``record_ids``): fix or remove those
    records. When every valid pair whose inputs are finite has non-finite embeddings,
    the parameters are non-finite (a diverged run) and every further update would be
    pure noise: the report raises `NonFiniteParametersError` (a FloatingPointError)
    under "warn" too, and the `batches` loop records no step after it (it checks
    before recording each step), so the budget left is not spent on noise. Under
    "warn" the steps of the two reports' delay are released and recorded; the ledger
    holds no step that was not released. The stop depends on the parameters, which
    are released, and on the batch holding a valid pair with finite inputs. The
    reports (record indices, counts) describe the private data and are not private:
    they are for whoever holds the data, not for release.

    ``train_step.num_dropped()`` is the total of the dropped pairs reported ("warn" or
    "error"; 0 with "ignore").

    An empty Poisson batch is part of the mechanism (probability (1 − q)^N): its
    noisy update is released as any other, which is what the accounting assumes.

    On a mesh (``make_private(mesh=...)``) the step pads the batch with masked rows to a
    multiple of the devices and computes the global ḡ data-parallel; the update is the
    single-device one (the same noise, drawn once from the replicated state). On a mesh
    spanning several processes, pass the records as NumPy arrays: each process gathers
    only the rows its devices hold.

    Args:
      on_nonfinite, on_empty: "warn" (default), "error" or "ignore".
      augment: augment(x, x_prime, t) -> (x, x_prime), run on the gathered batch inside the
        jitted step before the gradient (t: the update's number, a traced int32), e.g. data
        augmentation or decoding. It must treat each row on its own: row i a function of
        record i's values and of randomness independent of the data (fold t into a key
        of your own), as embed_fn acts on examples independently. With method="dp_gcl" it
        may return (x, x_prime, extra_views), extra_views (n, k, ...) the k extra views of
        each record (`grouped_clipped_grad`). Rows past the batch (mesh padding) are
        left as they are.
      clip_stats: the step returns (params, opt_state, ℒ, stats), stats the
        `clip_methods.ClipStats` of the batch (``grad_fn.with_stats``): NON-PRIVATE
        diagnostics, computed on the batch without noise.
      jit: jit the update (default); False runs it eagerly (debugging).
    """
    for name, value in (("on_nonfinite", on_nonfinite), ("on_empty", on_empty)):
      if value not in REPORT_POLICIES:
        raise ValueError(f"{name} must be one of {REPORT_POLICIES}, got {value!r}.")
    if augment is not None and not callable(augment):
      raise TypeError(f"augment must be callable or None, got {augment!r}.")
    if not isinstance(clip_stats, bool):
      raise TypeError(f"clip_stats must be True or False, got {clip_stats!r}.")
    grad_fn, optimizer, ledger = self.grad_fn, self.optimizer, self.ledger
    if clip_stats and getattr(grad_fn, "stats_core", None) is None:
      raise TypeError(f"clip_stats=True: {grad_fn!r} computes no clip statistics.")
    keys = (self.model_key, self.group_key)
    grouped = self.group_key is not None
    # Per person, DP-GCL groups the records by their people (every pair of a person in one
    # group), which its per-person sensitivity 2B needs.
    person_of_record = (self.sampler.person_of_record
                        if grouped and isinstance(self.sampler, PersonPoissonSampler) else None)
    mesh = getattr(grad_fn, "mesh", None)
    multiple = 1 if mesh is None else int(mesh.shape[distributed.DATA_AXIS])
    loop = _loop(ledger)
    num_records = self.sampler.num_records
    synchronous = "error" in (on_nonfinite, on_empty)
    deferred = not synchronous and "warn" in (on_nonfinite, on_empty)

    def augmented(x, x_prime, step, num_rows):
      assert augment is not None
      views = augment(_rows(x, 0, num_rows), _rows(x_prime, 0, num_rows), step)
      if not isinstance(views, tuple) or len(views) not in ((2, 3) if grouped else (2,)):
        returns = "(x, x_prime) or (x, x_prime, extra_views)" if grouped else "(x, x_prime)"
        raise TypeError(f"augment must return a tuple {returns}, got {type(views).__name__}"
                        f"{'' if not isinstance(views, tuple) else f' of {len(views)}'}.")
      x_new, x_prime_new = views[:2]
      extra_views = None if len(views) == 2 else views[2]
      padding = rows_lib.num_rows(x) - num_rows
      if padding > 0:  # mesh padding, left as it is (masked rows; their extra views are zeros)
        x_new = _joined(x_new, _rows(x, num_rows))
        x_prime_new = _joined(x_prime_new, _rows(x_prime, num_rows))
        if extra_views is not None:
          extra_views = jnp.asarray(extra_views)
          extra_views = jnp.concatenate(
              [extra_views,
               jnp.zeros((padding,) + extra_views.shape[1:], extra_views.dtype)])
      return x_new, x_prime_new, ({} if extra_views is None else {"extra_views": extra_views})

    def update(params, opt_state, x, x_prime, mask, step, record_ids, user_ids, keys, num_rows):
      model_key, group_key = keys
      extra = {}
      if augment is not None:
        x, x_prime, extra = augmented(x, x_prime, step, num_rows)
      # A stochastic model: the randomness of step t, fold_in(model_key, t), never released.
      if model_key is not None:
        extra["key"] = jax.random.fold_in(model_key, step)
      if group_key is not None:  # DP-GCL: the records regrouped at every step
        extra.update(record_ids=record_ids, group_key=jax.random.fold_in(group_key, step))
        if user_ids is not None:
          extra["user_ids"] = user_ids
      # Valid rows whose inputs (as grad_fn gets them) are not finite: the data's fault. The
      # other dropped rows have finite inputs and non-finite embeddings: the model's.
      inputs_ok = rows_lib.finite_rows(x) & rows_lib.finite_rows(x_prime)
      if "extra_views" in extra:
        inputs_ok = inputs_ok & rows_lib.finite_rows(extra["extra_views"])
      bad_inputs = mask & ~inputs_ok
      (bad_rows,) = jnp.nonzero(bad_inputs, size=NAMED_ROWS, fill_value=-1)
      params_finite = jnp.all(
          jnp.stack([
              jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(params)
              if jnp.issubdtype(leaf.dtype, jnp.inexact)
          ] or [jnp.bool_(True)]))
      params, opt_state, loss_value, num_dropped, stats = update_lib.private_update(
          grad_fn, optimizer, params, opt_state, x, x_prime, mask, clip_stats=clip_stats, **extra)
      flags = jnp.concatenate([
          jnp.stack([
              jnp.sum(mask, dtype=jnp.int32),
              num_dropped.astype(jnp.int32),
              jnp.sum(bad_inputs, dtype=jnp.int32),
              params_finite.astype(jnp.int32)
          ]),
          bad_rows.astype(jnp.int32)
      ])
      return params, opt_state, loss_value, flags, stats

    update = jax.jit(update, static_argnames="num_rows") if jit else update

    # The noise count array the last call returned and its value: read without the device.
    returned_count: list = [None, None]
    # (update number, flags, record indices of the rows or None) of released updates not
    # reported yet, oldest first.
    pending: list[tuple[int, jax.Array, np.ndarray | None]] = []
    own_key: list = []  # the noise key of ``optimizer``, once read

    dropped = [0]  # the valid pairs dropped in the reported steps

    def named(rows, records) -> str:
      """The records (or the batch's rows, without record indices) of the rows ``rows``."""
      if records is None:
        return "rows " + ", ".join(str(r) for r in rows) + " of the batch"
      return "records " + ", ".join(str(int(records[r])) for r in rows)

    def report(number: int, flags, records, stop: bool = True) -> None:
      num_valid, num_dropped, num_bad_inputs, params_finite, *rows = (
          int(v) for v in np.asarray(flags))
      rows = [r for r in rows if r >= 0]
      if on_nonfinite != "ignore":
        dropped[0] += num_dropped
      if num_valid == 0:
        _report(
            on_empty, f"Private step {number}: the batch has no valid pair (mask all "
            "False), so the released update is pure noise. A Poisson batch is empty with "
            f"probability (1 − q)^N = (1 − {self.sampling_rate:g})^{num_records}; "
            "anything else is a masking error.", EmptyBatchWarning, ValueError)
      if num_dropped == 0 or on_nonfinite == "ignore":
        return
      num_model = num_dropped - num_bad_inputs  # finite inputs, non-finite embeddings
      finite_inputs = num_valid - num_bad_inputs
      if num_model > 0 and num_model == finite_inputs:
        cause = ("the parameters hold NaN/inf (the model diverged)" if not params_finite else
                 "the parameters are finite but the model overflows on every pair")
        message = (
            f"Private step {number}: all {finite_inputs} valid pair(s) with finite inputs have "
            f"non-finite embeddings (NaN/inf): {cause}, so every update from them is pure "
            "noise. Training stops here so that the rest of the privacy budget is not spent on "
            "noise: lower the learning rate (or clip_norm) and train from the parameters of an "
            "earlier step, e.g. private.restore_checkpoint of a checkpoint saved before the "
            "divergence.")
        if synchronous or (stop and loop.failure is None):
          loop.failure = NonFiniteParametersError(message)
          raise loop.failure
        if loop.failure is None:  # the loop closes before the error: said as a warning
          _report("warn", message, NonFiniteRowsWarning, NonFiniteParametersError)
        return
      parts = []
      if num_bad_inputs > 0:
        more = f" (the first {len(rows)} of {num_bad_inputs})" if num_bad_inputs > len(rows) else ""
        parts.append(f"{num_bad_inputs} valid pair(s) have non-finite inputs (NaN/inf): "
                     f"{named(rows, records)}{more} of x_all or x_prime_all"
                     f"{' (after augment)' if augment is not None else ''}. Fix or remove those "
                     "records.")
      if num_model > 0:
        parts.append(
            f"{num_model} valid pair(s) with finite inputs have non-finite embeddings "
            "(NaN/inf): the model overflows on them; lower the learning rate if it diverges.")
      _report(
          on_nonfinite, f"Private step {number}: {num_dropped} of {num_valid} valid pair(s) "
          "were dropped (masked out, still private). " + " ".join(parts), NonFiniteRowsWarning,
          FloatingPointError)

    def flush(stop: bool = True) -> None:
      """Makes the reports of every released update not reported yet (waits for them).

      Raises `NonFiniteParametersError` at the first report of a step whose valid pairs
      with finite inputs all have non-finite embeddings (stop=False: warns instead)."""
      while pending:
        report(*pending.pop(0), stop=stop)

    def report_finished() -> None:
      # Steps that have run, without waiting; more than two steps behind: wait for the oldest.
      while pending and (len(pending) > 2 or _is_ready(pending[0][1])):
        report(*pending.pop(0))

    def check_own(opt_state, params, count: int) -> None:
      """ValueError unless opt_state (not returned by this step) holds this training's noise
      key (``optimizer``'s, or a restored checkpoint's) and at most the noise count it
      released."""
      if not own_key:
        own_key.append(_key_bytes(_noise_state(optimizer.init(params))))
      if _key_bytes(_noise_state(opt_state)) not in loop.noise_keys | {own_key[0]}:
        raise ValueError(
            "opt_state was not produced by this training: its noise key is neither the key of "
            "this PrivateTraining's optimizer nor that of a state restored by its "
            "restore_checkpoint (it comes from another make_private, or another run). "
            "Start from private.optimizer.init(params), continue from the opt_state the last "
            "step returned, or resume with private.restore_checkpoint.")
      if count > ledger.released_updates:
        raise ValueError(
            f"opt_state was not produced by this training: its noise count is {count}, and "
            f"this training has released {ledger.released_updates} noisy update(s) (another "
            "run with the same noise key made it). Start from private.optimizer.init(params), "
            "continue from the opt_state the last step returned, or resume with "
            "private.restore_checkpoint.")

    def released_count(opt_state, params) -> int:
      count = _noise_state(opt_state).count
      if count is returned_count[0]:
        return returned_count[1]
      released = _host_int(count)
      check_own(opt_state, params, released)
      return released

    def train_step(params, opt_state, batch, data, mask=None, *, record_ids=None, user_ids=None):
      if isinstance(batch, PoissonBatch):
        if mask is not None:
          raise TypeError("train_step(params, opt_state, batch, (x_all, x_prime_all)) masks "
                          "the batch with batch.mask itself: pass no mask.")
        if loop.unused.get(id(batch)) is not batch:
          raise ValueError(
              "train_step takes a batch that PrivateTraining.batches() handed out (its step "
              "recorded), once; this one was used already, is another run's, or was drawn by "
              "hand. A pipeline with its own batches calls train_step(params, opt_state, x, "
              "x_prime, mask) after ledger.record_steps(1).")
        if record_ids is not None or user_ids is not None:
          raise TypeError("train_step(params, opt_state, batch, (x_all, x_prime_all)) groups "
                          "the records by batch.indices itself: pass no record_ids or "
                          "user_ids.")
        indices = records = np.asarray(batch.indices)
        num_rows = indices.shape[0]
        x, x_prime, mask = _gather(data, indices, num_records, np.asarray(batch.mask), mesh)
        if grouped:
          record_ids = indices
        if person_of_record is not None:
          user_ids = person_of_record[indices]
      else:
        if mask is None:
          raise TypeError(
              "train_step needs the padding mask: call train_step(params, opt_state, batch, "
              "(x_all, x_prime_all)) with the batch of PrivateTraining.batches(), or "
              "train_step(params, opt_state, x, x_prime, mask) with the batch's mask "
              "(batch.mask; padded rows False). Without it the padding, copies of record 0, "
              "would be trained on.")
        x, x_prime = batch, data
        mask = _check_mask(mask, x)
        num_rows = rows_lib.num_rows(x)
        if (record_ids is None) == grouped:
          raise ValueError("record_ids= is required by method='dp_gcl' (pass batch.indices) "
                           f"and taken by it only; this run's method is {self.method!r}.")
        records = None if record_ids is None else np.asarray(record_ids)
        if (user_ids is None) == (person_of_record is not None):
          raise ValueError(
              "user_ids= (the person of every row: sampler.person_of_record[batch.indices]) is "
              "required by method='dp_gcl' with privacy per person, which groups the rows by "
              "person, and taken by it only.")
        if user_ids is not None:
          user_ids = np.asarray(user_ids)
      released = released_count(opt_state, params)
      if released < ledger.released_updates:
        raise UnrecordedStepError(
            f"The optimizer state's noise count is {released}, and the ledger has released "
            f"{ledger.released_updates} noisy update(s): the update of noise count {released} "
            "was released already, and a second update from that state draws the same noise; "
            "the difference of the two updates would reveal the gradients without noise. "
            "Continue from the optimizer state the last step returned (after a restore: from "
            "the newest checkpoint).")
      if released >= ledger.steps:
        raise UnrecordedStepError(
            f"The optimizer state has released {released} noisy update(s) and the ledger has "
            f"recorded {ledger.steps} step(s): update {released + 1} would leave unaccounted. "
            "Draw the batches with PrivateTraining.batches(), which records each step, or call "
            "ledger.record_steps(1) before the update on the low-level path.")
      if multiple > 1:
        x, x_prime, mask = distributed.pad_to_multiple(x, x_prime, mask, multiple)
      if grouped and record_ids is not None:
        record_ids = _padded_ids(record_ids, rows_lib.num_rows(x))  # the mesh's masked rows
      if mesh is not None:  # as the step returns them: one compilation for every step
        params, opt_state = _replicated((params, opt_state), mesh)
      params_out, state_out, loss_value, flags, stats = update(params, opt_state, x, x_prime, mask,
                                                               released, record_ids, user_ids, keys,
                                                               num_rows=num_rows)
      if synchronous:
        report(released + 1, flags, records)  # raises before anything is released
      ledger.released_updates = released + 1
      if isinstance(batch, PoissonBatch):
        del loop.unused[id(batch)]
      returned_count[:] = [_noise_state(state_out).count, released + 1]
      if deferred:
        # After the update: a NonFiniteParametersError leaves no recorded step unreleased.
        pending.append((released + 1, flags, records))
        report_finished()
      if clip_stats:
        return params_out, state_out, loss_value, stats
      return params_out, state_out, loss_value

    def num_dropped() -> int:
      """The valid pairs dropped for non-finite inputs or embeddings by the released updates
      (all of them: it makes the reports not made yet first)."""
      flush()
      return dropped[0]

    train_step.flush = flush  # pyright: ignore[reportFunctionMemberAccess]
    train_step.num_dropped = num_dropped  # pyright: ignore[reportFunctionMemberAccess]
    train_step._poll = report_finished  # pyright: ignore[reportFunctionMemberAccess]
    loop.flushes.add(flush)
    loop.polls.add(report_finished)
    return train_step

  def save_checkpoint(self, directory, state: Any, *, max_to_keep: int | None = None) -> None:
    """Saves ``state`` (params, optimizer state), the ledger and the sampler as one checkpoint.

    The checkpoint step is the ledger's step count (`logit_dp.ledger.save_checkpoint`).
    It holds the noise key and the sampler seed: keep it private.
    """
    ledger_lib.save_checkpoint(directory, self.ledger.steps, state, self.ledger,
                               sampler=self.sampler.unbudgeted(), max_to_keep=max_to_keep)

  def restore_checkpoint(self, directory, template: Any, step: int | None = None, *,
                         missing_ok: bool = False) -> tuple[Any, PrivateTraining]:
    """(state, private) from the newest checkpoint (or ``step``) of `save_checkpoint`.

    The returned `PrivateTraining` has the checkpoint's ledger (steps taken, with
    this object's budgets) and its sampler seed, so `batches` resumes at the
    checkpointed step with the batches of an uninterrupted run; the state holds
    the optimizer's noise count and key, so the noise continues too. The noisy
    updates released (``ledger.released_updates``) are the most of the
    checkpoint's, this object's ledger's (raised to it too: a restore in the same
    process forgets nothing it released) and the restored state's noise count, so
    no train step releases a noise count twice.

    Args:
      directory: the directory of `save_checkpoint`.
      template: the state as `save_checkpoint` got it, freshly initialised (the same
        params and ``optimizer``); its values are not used.
      step: which checkpoint (default: the newest).
      missing_ok: what to do when ``directory`` does not exist or holds no checkpoint:
        False (default) raises FileNotFoundError, so a mistyped path cannot restart a run
        with a fresh ledger; True returns (template, self), to start afresh (the first run
        of a script that resumes). A missing ``step`` always raises.

    Raises:
      FileNotFoundError: no checkpoint (see missing_ok); the message says whether the
        directory does not exist or holds no checkpoint.
      ValueError: the checkpoint's σ, q, δ, accountant or sampler (N, q, padded
        size, overflow policy) differ from this run's, it holds no sampler, or its state
        differs from ``template`` (the differing leaves are named).
    """
    if missing_ok is not True and missing_ok is not False:
      raise ValueError(f"missing_ok must be True or False, got {missing_ok!r}.")
    if step is None and missing_ok and ledger_lib.latest_step(directory) is None:
      return template, self
    try:
      state, ledger, step = ledger_lib.restore_checkpoint(directory, template, step)
    except FileNotFoundError as error:
      if step is not None:
        raise
      raise FileNotFoundError(f"{error} Pass missing_ok=True to start afresh when there is no "
                              "checkpoint yet.") from None
    sampler = ledger_lib.restore_sampler(directory, step,
                                         user_ids=getattr(self.sampler, "user_ids", None))
    if sampler is None:
      raise ValueError(
          f"Checkpoint {step} in {directory!r} holds no sampler (saved without sampler=): "
          "resuming with another seed would redo its steps with other batches. Use "
          "logit_dp.ledger.restore_checkpoint and make_private(..., sampler_seed=<the seed "
          "of that run>) instead.")
    mine = self.ledger
    for name in ("noise_multiplier", "sampling_rate", "target_delta", "accountant",
                 "overflow_probability", "pld_discretization", "unit"):
      if getattr(ledger, name) != getattr(mine, name):
        raise ValueError(f"Checkpoint {step} in {directory!r} was made with ledger {name} = "
                         f"{getattr(ledger, name)!r}, this run has {getattr(mine, name)!r}: "
                         "its steps cannot continue this run's accounting.")
    for name in ("num_records", "sampling_rate", "max_batch_size", "overflow", "unit",
                 "max_pairs_per_user", "users_digest"):
      if getattr(sampler, name, None) != getattr(self.sampler, name, None):
        raise ValueError(f"Checkpoint {step} in {directory!r} was made with sampler {name} = "
                         f"{getattr(sampler, name)!r}, this run has "
                         f"{getattr(self.sampler, name)!r}.")
    # Released: what the checkpoint's run and this process released, and what the state did.
    released = max([ledger.released_updates, mine.released_updates]
                   + [_host_int(s.count) for s in _noise_states(state)])
    mine.released_updates = released
    ledger = dataclasses.replace(mine, steps=ledger.steps, released_updates=released)
    # The restored state's noise key continues this training (the train steps accept it).
    _loop(ledger).noise_keys.update(_key_bytes(s) for s in _noise_states(state))
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


def _check_example(grad_fn, example, model_key, group_key, multiple: int) -> None:
  """`ClippedGradFn.check` on make_private's ``example=(params, x[, x_prime])``: the call a
  first step makes, on the example's rows (padded with masked rows to a multiple of the mesh's
  devices, `distributed.pad_to_multiple`)."""
  if not isinstance(example, (tuple, list)) or len(example) not in (2, 3):
    raise TypeError("example must be (params, x) or (params, x, x_prime) with a few rows of "
                    f"the data, got {type(example).__name__}.")
  params, x = example[0], example[1]
  x_prime = x if len(example) == 2 else example[2]
  x, x_prime, mask = distributed.pad_to_multiple(x, x_prime, None, multiple)
  extra = {}
  if model_key is not None:
    extra["key"] = model_key
  if group_key is not None:
    extra.update(record_ids=np.arange(rows_lib.num_rows(x)), group_key=group_key)
  grad_fn.check(params, x, x_prime, mask, **extra)


def _is_prng_key(key) -> bool:
  """Whether key is what `transform` takes: a typed JAX PRNG key, or raw uint32 key data."""
  try:
    dtype, ndim = jnp.result_type(key), jnp.ndim(key)
  except TypeError:
    return False
  return bool(jnp.issubdtype(dtype, jax.dtypes.prng_key) or (dtype == jnp.uint32 and ndim == 1))


def _secret_seed() -> int:
  # `secrets` on process 0, shared with every process (one noise key, one sampler for all).
  return distributed.broadcast_seed()


def _padded_ids(record_ids, num_rows: int) -> Any:
  """record_ids with zeros appended up to num_rows (the ids of masked padding rows)."""
  ids = np.asarray(record_ids)
  if ids.ndim != 1 or ids.shape[0] >= num_rows:
    return record_ids  # as given (the grad_fn checks its shape)
  return np.concatenate([ids, np.zeros((num_rows - ids.shape[0],), ids.dtype)])


def make_private(embed_fn: Callable, loss, clip_norm: float, *, target_epsilon: float,
                 target_delta: float, num_records: int, expected_batch_size: float,
                 optimizer: optax.GradientTransformation, epochs: float | None = None,
                 steps: int | None = None, method: str | methods.ClipMethod = "ghost",
                 mean: bool = False, microbatch_size: int | None = None, accountant: str = "pld",
                 noise_key: Any = None, sampler_seed: int | None = None,
                 max_batch_size: int | None = None, overflow: str = "error",
                 group_size: float | None = None, noise_multiplier: float | None = None,
                 mesh: Any = None, user_ids: Any = None, max_pairs_per_user: int | None = None,
                 trainable: Any = None, example: Any = None, **grad_kwargs) -> PrivateTraining:
  """Sets up (ε, δ)-DP training in one call, as Opacus' `make_private_with_epsilon`.

  q = expected_batch_size / num_records; T = steps, or ⌈epochs / q⌉;
  σ = `accounting.noise_multiplier(ε, δ_acc, q, T, accountant)` with δ_acc = δ minus
  the padded batches' overflow term (`PrivacyLedger.calibrated`);
  C = `sensitivity(loss, B, batch_size=None)` (`naive_sensitivity(B)` = 2B for
  method="naive", `grouped_sensitivity(B)` = 2B for method="dp_gcl");
  optimizer = chain(`transform(σ, C, noise_key)`, [`optax.scale(1 / expected_batch_size)`
  if mean], optimizer). The noise is added to the summed ḡ first; the mean and the
  optimizer are post-processing.

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

  Privacy per person (``user_ids=u, max_pairs_per_user=K``). The unit is a person: neighbouring
  datasets add or remove one person with all of their pairs. The sampler is a
  `sampling.PersonPoissonSampler`: each of the M = len(unique(u)) people joins a batch with
  probability q = expected_batch_size / M (expected_batch_size counts people, epochs passes
  over the people) and brings min(K, own pairs) of their pairs, a uniformly random subset drawn
  with the secret sampling randomness, independently of the other people. C is the per-person
  sensitivity, ``grad_fn.sensitivity(batch_size=None, max_pairs_per_user=K)``: Logit-DP
  `person_sensitivity(loss, B, K)` = K·C(∞) (at most K·C for any batch; docs/METHOD.md,
  "Privacy per person"), Naive-DP 2B, DP-GCL 2B with the train step grouping the rows by
  person (every pair of a person in one group). The theorem above then holds with "one pair"
  read "one person" (docs/PRIVACY.md); the ledger says so (``ledger.unit`` = "person", in its
  printout and checkpoints). With user_ids=None the unit is a pair and nothing above changes.

  Fine-tuning (``trainable=``). Only the trainable leaves w_T are trained; the frozen ones w_F
  are closed over in embed_fn (`logit_dp.finetune`): every pair norm, group norm and ḡ is that
  of the model of w_T alone (no cost is spent on w_F), ḡ is exactly zero at w_F, and the
  optimizer noises and updates w_T only (``optax.masked``: a frozen leaf gets no noise, no
  update, no optimizer state, and the train step returns it bit for bit). C, σ and the ledger
  are unchanged: the theorem above holds for the released updates of w_T provided w_F does not
  depend on the private data (e.g. pretrained on public data; docs/PRIVACY.md, "Fine-tuning:
  frozen parameters").
  The frozen leaves stay in params, so `save_checkpoint` saves them with the rest.

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
      the default, "triangle", "materialize"), "naive" (Naive-DP) or "dp_gcl" (DP-GCL,
      `grouped_clipped_grad`: needs group_size; train_step groups the records by
      batch.indices; one device or a mesh).
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
    group_size: method="dp_gcl" only (and required there): the expected group size s > 0;
      G = max(1, round(expected_batch_size / s)) hash groups. The
      group key is split from the training key, as model_key (`PrivateTraining.group_key`).
    noise_multiplier: σ > 0 fixed instead of calibrated. (target_epsilon, target_delta) are
      then the budget: the ledger reports ε at δ_acc, as with a calibrated σ, and `batches`
      raises `PrivacyBudgetExceededError` before a step that would exceed it.
    user_ids: privacy per person: an (N,) integer array, the person of every record (None:
      privacy per pair). Needs max_pairs_per_user.
    max_pairs_per_user: K ≥ 1, the most pairs of one person in a batch (with user_ids only).
    trainable: fine-tuning: a pytree of bools with the structure of params (or a prefix of it,
      as optax.multi_transform's labels), True where a leaf is trained, or a predicate
      ``trainable(path, leaf) -> bool`` on params' key paths (it is also called on trees
      shaped like params: decide from the path and the shape). None (default): every leaf is
      trained. ValueError on the first use when its structure does not match params or
      nothing is trainable; TypeError when a leaf is not a bool.
    mesh: a `jax.sharding.Mesh` with a "data" axis (`distributed.data_mesh`) for
      data-parallel training (one or several processes): ``grad_fn`` is then
      `distributed.make_sharded_grad_fn`'s, the same ḡ and C as on one device, and the
      train step places the batch on the mesh (method="dp_gcl" included: the groups are
      those of the global batch).
    **grad_kwargs: other `clipped_grad` arguments (cosine_eps;
      positive_embed_fn for a two-tower model, with the same C; stochastic=True for a
      model embed_fn(params, x, key) with dropout: the training key is then split into the
      noise key and ``model_key``, and each step's model randomness is
      fold_in(model_key, t), independent of the noise and never released; same C and σ).
    example: (params, x) or (params, x, x_prime), the initial params and a few rows of the
      data: the model is checked now, as the first step would check it, so that a model the
      training cannot use fails here, not at its first step (`ClippedGradFn.check`: the
      towers, ``trainable=`` against params, the layer plan, the one-time warning for a large
      leaf on the slow path). It traces the gradient and computes nothing. None: checked on
      the first step.

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
  people = None
  if user_ids is None:
    if max_pairs_per_user is not None:
      raise ValueError("max_pairs_per_user is for privacy per person: pass it with user_ids= "
                       "(the person of every record).")
    units = n
  else:
    if max_pairs_per_user is None:
      raise ValueError("user_ids= (privacy per person) needs max_pairs_per_user=K, the most "
                       "pairs of one person in a batch.")
    max_pairs_per_user = sensitivity_lib.check_max_pairs_per_user(max_pairs_per_user)
    user_ids = check_user_ids(user_ids, n)
    people = len(np.unique(user_ids))
    units = people
  try:
    q = accounting.sampling_rate_for(expected_batch_size, units)
  except ValueError:
    bound = f"num_records={n}" if people is None else f"the number of people in user_ids, {units}"
    raise ValueError(f"expected_batch_size must be a number in (0, {bound}], got "
                     f"{expected_batch_size!r}.") from None
  t = accounting.check_steps(steps) if epochs is None else accounting.steps_for_epochs(epochs, q)
  if sampler_seed is not None and (isinstance(sampler_seed, bool)
                                   or not isinstance(sampler_seed, int) or sampler_seed < 0):
    raise ValueError(f"sampler_seed must be an integer ≥ 0 or None, got {sampler_seed!r}.")
  b = sensitivity_lib.check_clip_norm(clip_norm, allow_inf=False)
  if noise_key is not None and not _is_prng_key(noise_key):
    raise ValueError("noise_key must be a JAX PRNG key (jax.random.key(seed) or "
                     f"jax.random.PRNGKey(seed)), or None to draw a secret one, got {noise_key!r}.")

  trainable = finetune.check_trainable(trainable)
  if trainable is not None:
    grad_kwargs["trainable"] = trainable
  grouped = mechanisms.Mechanism.of_method(method) is mechanisms.Mechanism.DP_GCL
  if "axis_name" in grad_kwargs:
    raise ValueError("make_private trains data-parallel with mesh= (distributed.data_mesh()), "
                     "not axis_name=: its step runs the shard_map itself.")
  if "num_groups" in grad_kwargs:
    raise ValueError("make_private takes group_size= (the expected group size), not num_groups.")
  if grouped:
    grad_kwargs["num_groups"] = grouped_lib.num_groups_for(expected_batch_size, group_size)
  elif group_size is not None:
    raise ValueError(f"group_size is for method='dp_gcl' only, not {method!r}.")
  if mesh is None:
    grad_fn = clipping.private_grad(embed_fn, loss, b, method, microbatch_size=microbatch_size,
                                    **grad_kwargs)
  else:
    grad_fn = distributed.make_sharded_grad_fn(embed_fn, loss, b, distributed.check_mesh(mesh),
                                               method=method, microbatch_size=microbatch_size,
                                               **grad_kwargs)
  if people is None:
    c = grad_fn.sensitivity(batch_size=None)
  else:  # the per-person C_K: the noise is calibrated to it below
    c = grad_fn.sensitivity(batch_size=None, max_pairs_per_user=max_pairs_per_user)

  accounting.warn_if_large_delta(delta, units, stacklevel=3)
  seed = _secret_seed() if sampler_seed is None else sampler_seed
  if people is None:
    poisson = PoissonSampler(num_records=n, sampling_rate=q, max_batch_size=max_batch_size,
                             seed=seed, overflow=overflow)
  else:
    poisson = PersonPoissonSampler(num_records=n, sampling_rate=q, max_batch_size=max_batch_size,
                                   seed=seed, overflow=overflow, user_ids=user_ids,
                                   max_pairs_per_user=int(max_pairs_per_user or 0))
  with warnings.catch_warnings():  # δ ≥ 1/N was already reported above, once
    warnings.filterwarnings("ignore", message="target_delta=", category=UserWarning)
    if noise_multiplier is None:
      ledger = PrivacyLedger.calibrated(poisson, eps, delta, t, accountant)
    else:
      ledger = PrivacyLedger.with_budget(poisson, noise_multiplier, eps, delta, t, accountant)
  sampler = BudgetedSampler.bind(poisson, ledger)
  sigma = ledger.noise_multiplier
  key = jax.random.key(_secret_seed()) if noise_key is None else noise_key
  model_key = group_key = None
  if grad_fn.stochastic:  # two independent keys: the noise's and the model's randomness
    key, model_key = jax.random.split(key)
  if grouped:  # the group assignment's key: independent of the data and of the noise
    key, group_key = jax.random.split(key)
  if example is not None:
    multiple = 1 if mesh is None else int(mesh.shape[distributed.DATA_AXIS])
    _check_example(grad_fn, example, model_key, group_key, multiple)
  scale_by = float(expected_batch_size) if mean else None
  tx = distributed.make_private_optimizer(sigma, c, key, optimizer, expected_batch_size=scale_by,
                                          trainable=trainable)
  return PrivateTraining(grad_fn=grad_fn, optimizer=tx, sampler=sampler, ledger=ledger,
                         noise_multiplier=sigma, sensitivity=c, clip_norm=b, sampling_rate=q,
                         steps=t, method=grad_fn.method, model_key=model_key, group_key=group_key,
                         max_pairs_per_user=max_pairs_per_user, trainable=trainable)

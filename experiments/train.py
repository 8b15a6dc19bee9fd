"""Contrastive pre-training with Logit-DP, Naive-DP, DP-GCL and non-private training.

``train_and_evaluate(config, workdir)`` trains every method in ``config.methods``
with the same seed, data, pairs and initial parameters, evaluates the frozen
embeddings (k-NN, linear probe) and writes a results folder::

    workdir/
      config.json                 the exact config
      results.json, results.md    the comparison table (absolute and relative to non-private)
      relative_loss.png           test-set contrastive loss relative to non-private (paper Fig. 1)
      loss.png                    the same curves, absolute
      confusion_matrices.png      k-NN confusion matrices
      tensorboard/<method>/       TensorBoard events
      <method>/metrics.csv        step, epoch, ε, steps/s, test loss, ...
      <method>/checkpoints/       orbax checkpoints (params, optimizer state with the noise
                                  key and count, privacy ledger); training resumes from here
    workdir.secrets/<method>/SECRET_privacy_seeds.json
                                  the secret noise / sampling seeds of a DP run, outside the
                                  results folder (see `privacy_seeds`)

Multi-host (several processes, `initialize_distributed` first): every process runs this
same code on the same config and data; the mesh spans every process's devices, every
process draws the same Poisson batch and loads only its own rows of it
(`logit_dp.distributed.local_batch_indices`), all of them write the orbax checkpoints
together (each array once), and only process 0 evaluates and writes the results folder,
metrics, TensorBoard logs and the secret seeds (which it draws and shares:
`logit_dp.distributed.broadcast_seed`). Checkpoints need a folder every process sees.

Privacy: DP methods use Poisson sampling of records with rate q = batch_size / R (R
records) and σ from the accountant for (ε, δ) after ``steps = epochs·R/batch_size``
steps; Logit-DP noise has scale σ·sensitivity(loss, B) (supremum over batch sizes,
as Poisson batches have random size), Naive-DP σ·2B, DP-GCL σ·2B (the grouped baseline,
`logit_dp.baselines.grouped_clipped_grad`: records hashed into G = round(batch_size /
config.dp_gcl.group_size) groups by record id, regrouped every step, with
config.dp_gcl.extra_views augmented views of each record as extra negatives).
The training loss of a DP run is computed on private data and is not differentially
private: it is only logged when ``config.log_private_train_loss`` is True, in a column named
``train_loss_NONPRIVATE_diagnostic``. Likewise the clip statistics
(`logit_dp.clip_methods.ClipStats`: the fraction of the norms compared with B that exceeded it
and their median, for tuning B; pair norms for Logit-DP, the batch gradient's for Naive-DP, the
groups' for DP-GCL) are logged only when ``config.log_clip_stats`` is True, in the columns
``fraction_clipped_NONPRIVATE_diagnostic`` and ``median_norm_NONPRIVATE_diagnostic``.
The curves and tables use the test set.
"""

from __future__ import annotations

import csv
import functools
import json
import os
import secrets
import sys
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import logit_dp
import logit_dp.accounting  # noqa: F401
import logit_dp.ledger  # noqa: F401
import logit_dp.sampling  # noqa: F401
from experiments import augment as augment_lib
from experiments import data as data_lib
from experiments import evaluation
from experiments import workdirs
from logit_dp import models

# The encoder at its initial parameters, evaluated like the trained ones: the floor every
# method must beat (a random conv net already gives a useful k-NN). No step, no data, ε = 0.
UNTRAINED = "untrained"
# The private methods are the mechanisms ("logit_dp" with config.clip_method, "naive_dp",
# "dp_gcl"); "non_private" and UNTRAINED are the baselines.
PRIVATE_METHODS = tuple(mechanism.value for mechanism in logit_dp.Mechanism)
METHOD_LABELS = ({mechanism.value: mechanism.label for mechanism in logit_dp.Mechanism} |
                 {"non_private": "Non-private", UNTRAINED: "Untrained (init)"})


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


# ---------------------------------------------------------------------------
# Building blocks.


def make_loss(config):
  if config.loss == "contrastive":
    return logit_dp.losses.contrastive(temperature=config.temperature)
  if config.loss == "spreadout":
    return logit_dp.losses.spreadout()
  raise ValueError(f"unknown loss {config.loss!r}")


def make_model(model_config):
  kwargs = dict(model_config)
  name = kwargs.pop("name")
  return models.make_model(name, **kwargs)


def learning_rate(config, method: str) -> float:
  lrs = config.learning_rates
  return float(lrs[method] if method in lrs else config.learning_rate)


LR_SCHEDULES = ("constant", "cosine", "warmup_cosine")


def learning_rate_schedule(config, method: str, total_steps: int) -> float | optax.Schedule:
  """Adam's learning rate η_t at update t = 0 … T−1 of a run of T = ``total_steps`` updates.

  With η = `learning_rate(config, method)`, f = config.lr_final_fraction, W =
  config.lr_warmup_steps:

  * "constant": η (a float, so the optimizer is exactly the one without a schedule);
  * "cosine": η_t = η·(f + (1 − f)·½(1 + cos(π·t/T))), `optax.cosine_decay_schedule`;
  * "warmup_cosine": η_t = η·(t + 1)/W for t < W (linear, no update with η = 0), then the
    cosine above over the remaining T − W updates (`optax.join_schedules`).

  optax counts the updates in the optimizer state, which the checkpoints hold: a resumed run
  continues the schedule at its global step.
  """
  lr = learning_rate(config, method)
  kind = config.get("lr_schedule", "constant")
  if kind not in LR_SCHEDULES:
    raise ValueError(f"config.lr_schedule must be one of {LR_SCHEDULES}, got {kind!r}.")
  if kind == "constant":
    return lr
  final = config.get("lr_final_fraction", 0.0)
  if isinstance(final, bool) or not isinstance(final, (int, float)) or not 0.0 <= final <= 1.0:
    raise ValueError(f"config.lr_final_fraction must be a number in [0, 1], got {final!r}.")
  warmup = config.get("lr_warmup_steps", 0)
  if kind == "cosine":
    if warmup:
      raise ValueError(f"config.lr_warmup_steps = {warmup!r} needs lr_schedule='warmup_cosine'.")
    return optax.cosine_decay_schedule(lr, int(total_steps), alpha=float(final))
  if isinstance(warmup, bool) or not isinstance(warmup, int) or not 1 <= warmup < total_steps:
    raise ValueError(f"config.lr_warmup_steps must be an integer in [1, T = {total_steps}) for "
                     f"lr_schedule='warmup_cosine', got {warmup!r}.")
  if warmup == 1:
    ramp = optax.constant_schedule(lr)
  else:
    ramp = optax.linear_schedule(lr / warmup, lr, transition_steps=warmup - 1)
  decay = optax.cosine_decay_schedule(lr, int(total_steps) - warmup, alpha=float(final))
  return optax.join_schedules([ramp, decay], boundaries=[warmup])


def clip_norm(config, method: str) -> float:
  """B of ``method``: ``config.clip_norms[method]`` if set (e.g. the paper's), else
  config.clip_norm."""
  norms = config.get("clip_norms") or {}
  return float(norms[method] if method in norms else config.clip_norm)


def _freeze(x):
  """A hashable, order-independent version of a (nested) ConfigDict / dict / sequence."""
  if isinstance(x, (ml_collections.ConfigDict, dict)):
    return tuple(sorted((k, _freeze(v)) for k, v in dict(x).items()))
  if isinstance(x, (list, tuple)):
    return tuple(_freeze(v) for v in x)
  return x


# Fields that do not change what a training step computes (excluded from cache keys).
_RUN_ONLY_FIELDS = ("log_every", "checkpoint_every", "stop_after_steps", "progress", "knn_k",
                    "knn_train_size", "f_beta", "linear_probe", "methods", "log_private_train_loss",
                    "eval_batch_size", "eval_num_batches", "max_checkpoints_to_keep", "secrets_dir",
                    "on_nonfinite_rows", "log_clip_stats")


def _step_key(config, method, num_records):
  d = {k: v for k, v in config.items() if k not in _RUN_ONLY_FIELDS and k != "data"}
  # The clip statistics change the compiled step (not the update it computes).
  return (method, num_records, _freeze(d), _logs_clip_stats(config, method))


def _logs_clip_stats(config, method: str) -> bool:
  """Whether the steps of ``method`` compute the NON-PRIVATE clip statistics to log."""
  return bool(config.get("log_clip_stats", False)) and method in PRIVATE_METHODS


_MODEL_CACHE: dict[Any, Any] = {}


def get_model(model_config):
  """(model, apply_fn, jitted apply) for a model config; cached so compilations are reused."""
  key = _freeze(model_config)
  if key not in _MODEL_CACHE:
    model = make_model(model_config)
    _MODEL_CACHE[key] = (model, model.apply, jax.jit(model.apply), jax.jit(model.init))
  return _MODEL_CACHE[key]


def privacy_plan(config, num_records: int) -> dict[str, Any]:
  """Sampling rate, number of steps, padded batch and noise multiplier of the DP methods.

  q = batch_size / R, T = ceil(num_epochs / q), max_batch = sampling.max_batch_size_for(R, q)
  (overflow probability p_over per step) and σ = accounting.noise_multiplier(ε, δ_acc, q, T),
  where δ_acc, the δ at which the ledger reports ε, is
  ledger.accountant_delta(ε, δ, T, p_over) = δ − (1 + e^ε)·(1 − (1 − p_over)^T) if
  config.delta_includes_overflow (the certified δ is then ≤ target_delta), else δ.
  """
  q = logit_dp.accounting.sampling_rate_for(int(config.batch_size), num_records)
  steps = logit_dp.accounting.steps_for_epochs(config.num_epochs, q)
  max_batch = logit_dp.sampling.max_batch_size_for(num_records, q)
  delta = config.get("target_delta")  # a config with an explicit σ may have none
  if delta is not None and config.get("delta_includes_overflow", False):
    p_over = logit_dp.sampling.overflow_probability(num_records, q, max_batch)
    delta = logit_dp.ledger.accountant_delta(float(config.target_epsilon), delta, steps, p_over)
  if config.get("noise_multiplier") is not None:
    sigma = float(config.noise_multiplier)
  else:
    sigma = _noise_multiplier_cached(float(config.target_epsilon), float(delta), q, steps,
                                     config.accountant)
  return dict(sampling_rate=q, steps=steps, noise_multiplier=sigma, max_batch=max_batch,
              accountant_delta=delta)


@functools.lru_cache(maxsize=64)
def _noise_multiplier_cached(eps, delta, q, steps, accountant):
  return float(logit_dp.accounting.noise_multiplier(eps, delta, q, steps, accountant))


def dp_gcl_num_groups(config) -> int:
  """G = max(1, round(batch_size / config.dp_gcl.group_size)): the expected group size."""
  size = config.dp_gcl.group_size
  if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < float("inf"):
    raise ValueError(f"config.dp_gcl.group_size must be a number > 0, got {size!r}.")
  return max(1, int(round(int(config.batch_size) / float(size))))


def dp_gcl_extra_views(config) -> int:
  k = config.dp_gcl.extra_views
  if isinstance(k, bool) or not isinstance(k, int) or k < 0:
    raise ValueError(f"config.dp_gcl.extra_views must be an integer ≥ 0, got {k!r}.")
  return k


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, local_device_count: int | None = None,
                           cpu_collectives: str = "gloo", auto: bool = False) -> None:
  """Joins a multi-process run (`jax.distributed.initialize`); call it before any JAX computation.

  With coordinator_address / num_processes / process_id, or auto=True (Cloud TPU, SLURM, ...
  detect them), every process of the run calls it with its own process_id. On the CPU,
  local_device_count sets the devices this process simulates (``jax_num_cpu_devices``) and
  the processes' collectives use ``cpu_collectives`` (gloo over TCP, or mpi). Without any
  of them it only sets local_device_count (if given): one process.
  """
  if local_device_count is not None:
    jax.config.update("jax_num_cpu_devices", int(local_device_count))
  given = (coordinator_address, num_processes, process_id)
  if not auto and all(v is None for v in given):
    return
  if not auto and any(v is None for v in given):
    raise ValueError("a multi-process run needs coordinator_address, num_processes and "
                     f"process_id together (or auto=True), got {given}.")
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id)


def is_primary() -> bool:
  """Process 0 of a multi-process run (or the only process): the one that writes results."""
  return jax.process_index() == 0


def _multiprocess() -> bool:
  return jax.process_count() > 1


def _sync(name: str):
  """Waits for every process (multi-process runs only)."""
  if _multiprocess():
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


def _local(tree):
  """This process's copy of replicated arrays (they span every process's devices otherwise)."""
  return jax.tree.map(
      lambda a: a.addressable_data(0)
      if isinstance(a, jax.Array) and not a.is_fully_addressable else a, tree)


def make_mesh(config):
  """A data-parallel mesh over config.num_devices devices (-1: all visible), or None for 1.

  With several processes the mesh must span every device of every process: num_devices
  must be -1 (or their number).
  """
  num_devices = config.get("num_devices", 1)
  if _multiprocess() and num_devices not in (-1, jax.device_count()):
    raise ValueError(
        f"{jax.process_count()} processes: the mesh must span all {jax.device_count()} devices "
        f"of all processes; set --config.num_devices=-1 (got {num_devices}).")
  if num_devices == 1:
    return None
  return logit_dp.distributed.data_mesh(None if num_devices == -1 else num_devices)


def reference_inputs(config):
  """The public inputs of clip_method="projected" (``config.projection``: reference data set,
  split, num_reference, seed), preprocessed as the training inputs.

  ValueError when they could be private: the training data's own train split (or, for the
  "digits" source, which has one data set, its train split)."""
  spec, data = config.projection, config.data
  if spec.split not in ("train", "test"):
    raise ValueError(f"config.projection.split must be 'train' or 'test', got {spec.split!r}.")
  same_data = data.source == "digits" or spec.reference == data.get("name")
  if same_data and spec.split == "train":
    raise ValueError(
        f"config.projection takes its reference inputs from {spec.reference!r} train, the "
        "private training data: they must be public (another data set, or a held-out split).")
  images = data_lib.reference_images(spec.reference, spec.split, int(spec.num_reference),
                                     int(spec.seed), data.source, data.get("npz_dir"),
                                     data.get("label", "fine"))
  return jnp.asarray(data_lib.to_float(images))


def clip_method(config) -> str | logit_dp.clip_methods.ClipMethod:
  """config.clip_method, with its reference inputs and rank for "projected"."""
  if config.clip_method != "projected":
    return config.clip_method
  return logit_dp.clip_methods.Projected(reference_inputs=reference_inputs(config),
                                         rank=int(config.projection.rank))


def make_method(config, method: str, apply_fn, num_records: int, noise_key):
  """(grad_fn, optimizer, info) for one method; info has the privacy plan and step count.

  The private methods' are those of `make_private_training` (sampler seed 0).
  """
  loss = make_loss(config)
  batch = int(config.batch_size)
  if method == "non_private" and make_mesh(config) is not None:
    # The exact gradient, data parallel: Naive-DP's path without clipping.
    grad_fn = logit_dp.distributed.make_sharded_grad_fn(apply_fn, loss, jnp.inf, make_mesh(config),
                                                        method="naive")
  if method == "non_private":

    def local_grad_fn(params, x, x_prime, mask):
      def total(p):
        z = logit_dp.losses.cosine_similarity(apply_fn(p, x), apply_fn(p, x_prime))
        return loss(z, mask)

      return jax.value_and_grad(total)(params)

    if make_mesh(config) is None:
      grad_fn = local_grad_fn
    steps_per_epoch = -(-num_records // batch)
    steps = int(steps_per_epoch * config.num_epochs)
    tx = optax.chain(optax.scale(1.0 / batch),
                     optax.adam(learning_rate_schedule(config, method, steps)))
    info = dict(noise_multiplier=0.0, sensitivity=0.0, sampling_rate=None, steps=steps,
                max_batch=batch)
    return grad_fn, tx, info
  private = make_private_training(config, method, apply_fn, num_records, noise_key, sampling_seed=0)
  info = dict(privacy_plan(config, num_records), sensitivity=private.sensitivity,
              clip_norm=private.clip_norm)
  return private.grad_fn, private.optimizer, info


def _clip_method_of(config, method: str):
  """make_private's method of an experiment method: the config's clip method for Logit-DP."""
  mechanism = logit_dp.Mechanism(method)
  if mechanism is logit_dp.Mechanism.LOGIT_DP:
    return clip_method(config)
  return "naive" if mechanism is logit_dp.Mechanism.NAIVE_DP else "dp_gcl"


def make_private_training(config, method: str, apply_fn, num_records: int, noise_key,
                          sampling_seed: int) -> logit_dp.PrivateTraining:
  """The private run of ``method`` as a user sets one up: `logit_dp.make_private`.

  The mechanism ("logit_dp" with config.clip_method, "naive_dp", "dp_gcl" with
  config.dp_gcl.group_size), its clip norm, the plan of `privacy_plan` (q, T, the padded
  batch, σ: make_private is given the σ it calibrates, and reports ε at the same δ),
  ``noise_key`` and the Poisson sampler's seed, Adam with the config's schedule after the
  noisy sum scaled to a mean, and the config's data-parallel mesh. A config that calibrates σ
  at target_delta (delta_includes_overflow=False) keeps its ledger's δ there, without a δ
  budget, as its runs were started.
  """
  if method not in PRIVATE_METHODS:
    raise ValueError(f"unknown method {method!r} (logit_dp, naive_dp, dp_gcl or non_private)")
  plan = privacy_plan(config, num_records)
  kwargs = {}
  if method == "dp_gcl":
    dp_gcl_num_groups(config)  # checks group_size
    dp_gcl_extra_views(config)
    kwargs["group_size"] = float(config.dp_gcl.group_size)
  mesh = make_mesh(config)
  private = logit_dp.make_private(
      apply_fn, make_loss(config), clip_norm(config,
                                             method), target_epsilon=float(config.target_epsilon),
      target_delta=float(config.target_delta), num_records=num_records,
      expected_batch_size=int(config.batch_size), steps=plan["steps"], optimizer=optax.adam(
          learning_rate_schedule(config, method,
                                 plan["steps"])), mean=True, method=_clip_method_of(config, method),
      microbatch_size=config.get("microbatch_size"), accountant=config.accountant,
      noise_key=noise_key, sampler_seed=int(sampling_seed), max_batch_size=plan["max_batch"],
      noise_multiplier=plan["noise_multiplier"], mesh=mesh, **kwargs)
  if not config.get("delta_includes_overflow", False):
    private.ledger.target_delta = plan["accountant_delta"]
    private.ledger.delta_budget = None
  return private


def private_augment(config, method: str):
  """augment(x, x', t) of the private train step: the records' images (uint8 or float) to
  floats in [0, 1], augmented with keys from fold_in(augment key, t) (`augment_views`);
  dp_gcl with config.dp_gcl.extra_views = k: also the (n, k, ...) extra views, view m a
  fresh augmentation of the record's first image (m even) or second (m odd). Functions of
  each record's own images and of public randomness only: no privacy cost."""
  aug_key = _keys(config.seed)["augment"]
  k = dp_gcl_extra_views(config) if method == "dp_gcl" else 0

  def augment(xa, xb, step):
    images = (data_lib.to_float(xa), data_lib.to_float(xb))
    x, x_prime = augment_views(config, *images, aug_key, step) if _augments(config) else images
    if k == 0:
      return x, x_prime
    step_key = jax.random.fold_in(aug_key, step)
    views = [
        augment_lib.augment_batch(jax.random.fold_in(step_key, 2 + m), images[m % 2],
                                  **dict(config.augment)) for m in range(k)
    ]
    return x, x_prime, jnp.stack(views, axis=1)

  return augment


def _augments(config) -> bool:
  return config.pair_mode == "augment" or config.get("augment_same_class", False)


def augment_views(config, xa, xb, aug_key, step):
  """The two views augmented independently, with keys from fold_in(aug_key, step)."""
  k1, k2 = jax.random.split(jax.random.fold_in(aug_key, step))
  return (augment_lib.augment_batch(k1, xa, **dict(config.augment)),
          augment_lib.augment_batch(k2, xb, **dict(config.augment)))


def gather_pairs(config, x_train, pairs, idx, aug_key, step):
  """Images of the records ``idx`` as two views (x, x_prime) in [0, 1], augmented on device."""
  rec = pairs[idx]
  xa = data_lib.to_float(x_train[rec[:, 0]])
  xb = data_lib.to_float(x_train[rec[:, 1]])
  if _augments(config):
    xa, xb = augment_views(config, xa, xb, aug_key, step)
  return xa, xb


def augment_rows(config, x, xp, aug_key, step, num_rows: int):
  """Multi-process: the first ``num_rows`` rows of the global batch augmented as `gather_pairs`
  augments the batcher's ``num_rows`` rows; the rows past them (mesh padding) are left as
  they are."""
  if not _augments(config):
    return x, xp
  xa, xb = augment_views(config, x[:num_rows], xp[:num_rows], aug_key, step)
  return jnp.concatenate([xa, x[num_rows:]]), jnp.concatenate([xb, xp[num_rows:]])


def local_batch(config, x_train: np.ndarray, pairs: np.ndarray, idx, mask, mesh):
  """Multi-process: the global batch (x, x_prime, mask) of the records ``idx``, this process
  loading only its own rows (`distributed.local_batch_indices`) on the host."""
  rows, local_mask = logit_dp.distributed.local_batch_indices(mesh, np.asarray(idx),
                                                              np.asarray(mask))
  rec = pairs[rows]
  xa = np.asarray(data_lib.to_float(x_train[rec[:, 0]]))
  xb = np.asarray(data_lib.to_float(x_train[rec[:, 1]]))
  return logit_dp.distributed.shard_batch(mesh, xa, xb, local_mask)


def train_step(state: TrainState, x, x_prime, mask, *, grad_fn, tx):
  """One pure non-private update: the summed gradient -> optimizer -> params."""
  loss_value, grads = grad_fn(state.params, x, x_prime, mask)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), loss_value


_STEP_CACHE: dict[Any, Any] = {}

#: The metrics.csv columns of the clip statistics (config.log_clip_stats): NON-PRIVATE.
CLIP_STATS_COLUMNS = {
    "fraction_clipped": "fraction_clipped_NONPRIVATE_diagnostic",
    "median_norm": "median_norm_NONPRIVATE_diagnostic",
}


def get_step_fn(config, num_records: int):
  """(step_fn, tx, info) of the non-private run, cached per training config so resumes reuse
  compilations (the private runs' steps are `logit_dp.PrivateTraining.make_train_step`'s).

  ``step_fn(state, x_train, pairs, idx, mask)`` gathers and augments the batch on the
  device and applies `train_step`; it is jitted. Multi-process it is
  ``step_fn(state, x, x_prime, mask)`` on the global batch of `local_batch`.
  """
  method = "non_private"
  key = _step_key(config, method, num_records)
  if key not in _STEP_CACHE:
    keys = _keys(config.seed)
    _, apply_fn, _, _ = get_model(config.model)
    grad_fn, tx, info = make_method(config, method, apply_fn, num_records, keys["noise"])
    mesh = make_mesh(config)
    if _multiprocess():
      num_rows = int(info["max_batch"])  # the batcher's rows; then padding to the mesh

      @jax.jit
      def step_fn(state, x, xp, mask):  # the global batch of `local_batch`
        x, xp = augment_rows(config, x, xp, keys["augment"], state.step, num_rows)
        return train_step(state, x, xp, mask, grad_fn=grad_fn, tx=tx)
    else:

      @jax.jit
      def step_fn(state, x_train, pairs, idx, mask):
        x, xp = gather_pairs(config, x_train, pairs, idx, keys["augment"], state.step)
        if mesh is not None:  # masked rows so the global batch divides by the device count
          x, xp, mask = logit_dp.distributed.pad_to_multiple(x, xp, mask, mesh.size)
        return train_step(state, x, xp, mask, grad_fn=grad_fn, tx=tx)

    _STEP_CACHE[key] = (step_fn, tx, info)
  return _STEP_CACHE[key]


_EVAL_CACHE: dict[Any, Any] = {}


def eval_pairs(config, x_test, y_test, seed: int):
  """Fixed test-set pairs ``(nb, bs, ...)`` x2 for the test contrastive loss."""
  pairs = data_lib.make_pairs(y_test, config.pair_mode, seed + 7)
  bs = int(min(config.get("eval_batch_size") or config.batch_size, len(pairs)))
  nb = max(1, min(len(pairs) // bs, int(config.get("eval_num_batches") or 4)))
  pairs = jnp.asarray(pairs[:nb * bs].reshape(nb, bs, 2))
  xt = jnp.asarray(x_test)
  key = jax.random.PRNGKey(seed + 11)
  views = [gather_pairs(config, xt, pairs[b], jnp.arange(bs), key, b) for b in range(nb)]
  return jnp.stack([v[0] for v in views]), jnp.stack([v[1] for v in views])


def get_eval_loss(config):
  """jitted eval_loss(params, xa, xb): mean per-pair loss on fixed test batches (public)."""
  key = (_freeze(config.model), config.loss, config.temperature)
  if key not in _EVAL_CACHE:
    loss = make_loss(config)
    _, apply_fn, _, _ = get_model(config.model)

    @jax.jit
    def eval_loss(params, xa_all, xb_all):
      def one(ab):
        xa, xb = ab
        z = logit_dp.losses.cosine_similarity(apply_fn(params, xa), apply_fn(params, xb))
        return loss(z) / xa.shape[0]

      return jnp.mean(jax.lax.map(one, (xa_all, xb_all)))

    _EVAL_CACHE[key] = eval_loss
  return _EVAL_CACHE[key]


# ---------------------------------------------------------------------------
# Checkpoints (orbax) of the non-private run. The private runs' are PrivateTraining's (state,
# privacy ledger and sampler in one atomic checkpoint).


def _plain_manager(directory: str, max_to_keep: int | None):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))


def save_checkpoint(directory: str, state: TrainState, max_to_keep: int | None = 2):
  """The non-private run's state as one orbax checkpoint (a private run's checkpoints are
  ``PrivateTraining.save_checkpoint``'s: state, ledger and sampler together)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  mngr = _plain_manager(directory, max_to_keep)
  try:
    mngr.save(int(state.step), args=ocp.args.Composite(state=ocp.args.StandardSave(state)),
              force=True)
    mngr.wait_until_finished()
  finally:
    mngr.close()


def save_params(path: str, params):
  """Final encoder params (read by finetune.py)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.abspath(path), params, force=True)


def restore_checkpoint(directory: str, template: TrainState) -> TrainState:
  """The non-private run's state from its newest checkpoint (`save_checkpoint`)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  mngr = _plain_manager(directory, None)
  try:
    out = mngr.restore(mngr.latest_step(),
                       args=ocp.args.Composite(state=ocp.args.StandardRestore(template)))
  finally:
    mngr.close()
  return out["state"]


# ---------------------------------------------------------------------------
# One method.

SECRET_SEEDS_FILE = "SECRET_privacy_seeds.json"


def secrets_dir(config, workdir: str) -> str:
  """Folder of the secret seed files: ``config.secrets_dir`` or ``<workdir>.secrets`` beside it.

  Kept outside the results folder so that sharing ``workdir`` (its config, results, plots,
  metrics) never shares the seeds. The checkpoints hold the noise key too: do not share them.
  """
  d = config.get("secrets_dir") or os.path.abspath(workdir).rstrip(os.sep) + ".secrets"
  os.makedirs(d, mode=0o700, exist_ok=True)
  return d


def privacy_seeds(config, workdir: str, method: str):
  """(noise_seed, sampling_seed) of a DP run.

  The noise key and the Poisson sampling seed are part of the mechanism: whoever
  knows them can subtract the noise or see which records each batch holds. With
  config.privacy_seed = None (the default) they are drawn with `secrets` and kept only
  in ``secrets_dir(config, workdir)/<method>/SECRET_privacy_seeds.json`` (mode 0600),
  outside the results folder (a run started before this layout keeps its file in
  ``workdir/<method>/`` and resumes from there). A set privacy_seed makes the run
  reproducible and NOT private against anyone who reads the config (tests, debugging).
  Multi-process: process 0 keeps the file and shares the seeds with the others.
  """
  if config.get("privacy_seed") is not None:
    return int(config.privacy_seed), int(config.privacy_seed) + 1
  seeds = _stored_seeds(config, workdir, method) if is_primary() else (None, None)
  if _multiprocess():  # process 0's seeds, on every process
    seeds = tuple(logit_dp.distributed.broadcast_seed(s) for s in seeds)
  return seeds


def _stored_seeds(config, workdir: str, method: str) -> tuple[int, int]:
  """The secret seeds of `privacy_seeds`, read from their file or drawn and written there."""
  legacy = os.path.join(workdir, method, SECRET_SEEDS_FILE)
  path = legacy
  if not os.path.exists(legacy):
    mdir = os.path.join(secrets_dir(config, workdir), method)
    os.makedirs(mdir, mode=0o700, exist_ok=True)
    path = os.path.join(mdir, SECRET_SEEDS_FILE)
  if os.path.exists(path):
    with open(path) as f:
      seeds = json.load(f)
  else:
    seeds = dict(noise_seed=secrets.randbits(63), sampling_seed=secrets.randbits(63))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
      json.dump(seeds, f)
  return int(seeds["noise_seed"]), int(seeds["sampling_seed"])


def _keys(seed: int):
  root = jax.random.PRNGKey(seed)
  names = ("init", "data", "augment", "noise")
  return dict(zip(names, jax.random.split(root, len(names))))


class _Batcher:
  """The non-private run's host-side batches: shuffled epochs, a pure function of (seed,
  step), so a resumed run sees the same batches (the private runs draw theirs from
  `logit_dp.PrivateTraining.batches`)."""
  def __init__(self, num_records: int, batch_size: int, seed: int):
    self.batcher = logit_dp.sampling.ShuffledBatcher(num_records, batch_size, seed=seed)
    self._epoch, self._batches = None, None

  def __call__(self, step: int):
    nb = self.batcher.num_batches()
    e, j = divmod(step, nb)
    if e != self._epoch:
      self._epoch, self._batches = e, list(self.batcher.epoch(e))
    return self._batches[j]


def _read_history(csv_path: str, upto: int):
  if not os.path.exists(csv_path):
    return []
  with open(csv_path) as f:
    rows = [{k: (float(v) if v not in ("", None) else float("nan")) for k, v in r.items()}
            for r in csv.DictReader(f)]
  out = [r for r in rows if r["step"] <= upto]
  for r in out:
    r["step"] = int(r["step"])
  return out


def logged_train_seconds(history) -> float:
  """Σ Δstep / steps_per_sec over the logged rows of metrics.csv: the training wall-clock of
  every attempt up to the last row (checkpoint saves included, evaluations excluded).

  A resumed run keeps the rows up to its checkpoint, and a row is logged at every checkpoint,
  so this counts the steps of earlier, interrupted attempts too (the work an interruption
  lost after the last checkpoint is not counted: those steps are trained again).
  """
  seconds, previous = 0.0, 0
  for row in history:
    step, rate = int(row["step"]), float(row["steps_per_sec"])
    if step > previous and rate == rate and rate > 0:
      seconds += (step - previous) / rate
    previous = step
  return seconds


class Progress:
  """Training progress: a tqdm bar on a terminal, plain lines when stderr is not one.

  The first step compiles, often for longer than many steps take: the progress says so
  ("compiling") and the bar (with its rate and ETA) starts only once that step is done.
  Without a terminal (output piped to a file) it prints one line per `log` call instead
  of a bar redrawn with carriage returns.
  """
  def __init__(self, label: str, total: int, start: int, enabled: bool = True, stream: Any = None):
    self.label, self.total, self.start = label, int(total), int(start)
    self.stream = sys.stderr if stream is None else stream
    self.enabled = enabled and self.start < self.total
    self.bar_mode = self.enabled and bool(getattr(self.stream, "isatty", lambda: False)())
    self.bar = None
    if self.enabled:
      self.write(f"[{label}] step {self.start + 1}/{self.total}: compiling the training step "
                 "(the first step also runs it)")

  def write(self, line: str) -> None:
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.write(line, file=self.stream)
    else:
      print(line, file=self.stream, flush=True)

  def update(self, step: int) -> None:
    """Called after each step with the number of steps done."""
    if not self.enabled:
      return
    if step == self.start + 1:
      self.write(f"[{self.label}] step {step}/{self.total}: compiled and ran the first step")
      if self.bar_mode:
        from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
        self.bar = tqdm(total=self.total, initial=step, desc=self.label, file=self.stream,
                        dynamic_ncols=True)
      return
    if self.bar is not None:
      self.bar.update(1)

  def log(self, step: int, values: dict[str, str]) -> None:
    """The values of a logged step: the bar's postfix, or one plain line."""
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.set_postfix(values)
    else:
      fields = "  ".join(f"{k} {v}" for k, v in values.items())
      self.write(f"[{self.label}] step {step}/{self.total}  {fields}")

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def train_method(config, method: str, ds: dict[str, np.ndarray], pairs: np.ndarray, workdir: str,
                 quiet: bool = False, eval_data=None) -> dict[str, Any]:
  """Trains one method (resuming from its checkpoints if any) and returns its record.

  A private method trains the way users train: `make_private_training` (`logit_dp.make_private`),
  a loop over ``PrivateTraining.batches()`` (each step recorded in the ledger before its batch
  is handed out, none past the budget) with the step of ``PrivateTraining.make_train_step``
  (it gathers, augments and masks the batch itself), and the run's checkpoints
  (``PrivateTraining.save_checkpoint`` / ``restore_checkpoint``: state, ledger and sampler).
  """
  from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top

  mdir = os.path.join(workdir, method)
  primary = is_primary()  # multi-process: only process 0 evaluates and writes files
  quiet = quiet or not primary
  if primary:
    os.makedirs(mdir, exist_ok=True)
  apply_fn = get_model(config.model)[1]
  num_records = int(pairs.shape[0])
  private = method in PRIVATE_METHODS
  batch = int(config.batch_size)
  params = initial_params(config, ds["x_train"][:1])
  training = None
  if private:
    noise_seed, sampling_seed = privacy_seeds(config, workdir, method)
    training = make_private_training(config, method, apply_fn, num_records,
                                     jax.random.PRNGKey(noise_seed), sampling_seed)
    total_steps = training.steps
    opt_state = training.optimizer.init(params)
    info = dict(noise_multiplier=training.noise_multiplier, sensitivity=training.sensitivity,
                clip_norm=training.clip_norm, sampling_rate=training.sampling_rate)
    epoch_per_step = training.sampling_rate  # epochs seen: q per Poisson step
  else:
    step_fn, tx, info = get_step_fn(config, num_records)
    total_steps = info["steps"]
    opt_state = tx.init(params)
    epoch_per_step = 1.0 / -(-num_records // batch)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
  mesh = make_mesh(config) if _multiprocess() else None
  if mesh is not None:  # the same values on every process (checked), on every device
    state = logit_dp.distributed.replicate(state, mesh)

  ckpt_dir = os.path.join(mdir, "checkpoints")
  resumed = os.path.isdir(ckpt_dir) and logit_dp.ledger.latest_step(ckpt_dir) is not None
  if resumed and private:
    state, training = training.restore_checkpoint(ckpt_dir, state)
  elif resumed:
    state = restore_checkpoint(ckpt_dir, state)
  if resumed and not quiet:
    done = " (finished)" if int(state.step) >= total_steps else ""
    print(f"[{method}] resumed from step {int(state.step)}{done}")
  csv_path = os.path.join(mdir, "metrics.csv")
  start = int(state.step)
  history = _read_history(csv_path, start) if start and primary else []

  eval_loss = get_eval_loss(config)
  if eval_data is None and primary:
    eval_data = eval_pairs(config, ds["x_test"], ds["y_test"], config.seed)
  writer = SummaryWriter(os.path.join(workdir, "tensorboard", method)) if primary else None
  fields = ["step", "epoch", "epsilon", "delta", "steps_per_sec", "test_loss"]
  if config.log_private_train_loss:
    fields.append("train_loss_NONPRIVATE_diagnostic")
  if _logs_clip_stats(config, method):
    fields += list(CLIP_STATS_COLUMNS.values())

  def test_loss(params):
    return float(eval_loss(_local(params), *eval_data))

  def write_row(row):
    if not primary:
      return
    history.append(row)
    with open(csv_path, "a", newline="") as f:
      csv.DictWriter(f, fieldnames=fields, extrasaction="ignore").writerow(row)
    for k, v in row.items():
      if k != "step" and v == v and v is not None and writer is not None:
        writer.add_scalar(k, v, row["step"])

  if primary:
    with open(csv_path, "w", newline="") as f:  # rewrite: drops rows past the checkpoint
      w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
      w.writeheader()
      for r in history:
        w.writerow(r)
  if start == 0 and primary:
    write_row(
        dict(step=0, epoch=0.0, epsilon=0.0, delta=0.0, steps_per_sec=float("nan"),
             test_loss=test_loss(state.params)))

  stop = total_steps
  if config.get("stop_after_steps"):
    stop = min(total_steps, start + int(config.stop_after_steps))
  log_every = max(1, int(config.log_every))
  ckpt_every = max(1, int(config.checkpoint_every))
  keep = config.get("max_checkpoints_to_keep", 2)
  on_nonfinite = config.get("on_nonfinite_rows", "warn")
  if on_nonfinite not in ("warn", "error"):
    raise ValueError(f"config.on_nonfinite_rows must be 'warn' or 'error', got {on_nonfinite!r}.")
  ledger = None if training is None else training.ledger
  if ledger is not None:
    # A resumed run keeps today's budgets; allow_exceeding_budget runs without them.
    if config.get("allow_exceeding_budget", False):
      ledger.epsilon_budget = ledger.delta_budget = None
    try:
      ledger.check_budgets(stop)
    except logit_dp.ledger.PrivacyBudgetExceededError as e:
      raise logit_dp.ledger.PrivacyBudgetExceededError(
          f"[{method}] {e} Here: --config.allow_exceeding_budget=True.") from None
    if ledger.steps != start:
      raise ValueError(f"[{method}] the checkpoint's ledger holds {ledger.steps} step(s) and its "
                       f"state {start}: they must agree.")
  train_step_fn = None

  def private_steps(state):
    """(state, ℒ, valid pairs, clip stats) of each private step, as users train."""
    nonlocal train_step_fn
    train_step_fn = training.make_train_step(on_nonfinite=on_nonfinite,
                                             augment=private_augment(config, method),
                                             clip_stats=_logs_clip_stats(config, method))
    images = np.asarray(ds["x_train"])
    records = (images[pairs[:, 0]], images[pairs[:, 1]])  # record r: its two images
    if mesh is None:  # multi-process: each process gathers its own rows on the host
      records = jax.device_put(records)
    for poisson_batch in training.batches(stop) if start < stop else ():
      try:
        params, opt_state, loss_value, *stats = train_step_fn(state.params, state.opt_state,
                                                              poisson_batch, records)
      except logit_dp.NonFiniteParametersError:  # diverged, whatever the policy
        raise
      except FloatingPointError as e:  # on_nonfinite="error": raised before the release
        raise FloatingPointError(
            f"[{method}] {e} Stopping (config.on_nonfinite_rows='error').") from None
      state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
      yield state, loss_value, int(poisson_batch.batch_size), (stats[0] if stats else None)

  def non_private_steps(state):
    """(state, ℒ, valid pairs, None) of each step of the shuffled epochs."""
    batcher = _Batcher(num_records, batch, seed=config.seed + 1)
    if mesh is None:
      x_train, pairs_d = jnp.asarray(ds["x_train"]), jnp.asarray(pairs)
    else:  # each process gathers its own rows on the host
      x_train, pairs_d = np.asarray(ds["x_train"]), np.asarray(pairs)
    for step in range(start, stop):
      idx, mask = batcher(step)
      if mesh is None:
        state, loss_value = step_fn(state, x_train, pairs_d, idx, mask)
      else:
        state, loss_value = step_fn(state, *local_batch(config, x_train, pairs_d, idx, mask, mesh))
      yield state, loss_value, int(np.sum(mask)), None

  eps_now = ledger.epsilon() if ledger else 0.0
  t_last, s_last, t_train = time.time(), start, 0.0
  progress = Progress(METHOD_LABELS.get(method, method), total_steps, start, enabled=not quiet
                      and config.get("progress", True))
  step = start
  t0 = time.time()
  updates = (private_steps if private else non_private_steps)(state)
  for state, loss_value, num_valid, stats in updates:
    if not np.isfinite(float(loss_value)):
      raise FloatingPointError(
          f"{method}: the training loss is not finite at step {int(state.step)} (the "
          "parameters have diverged or every pair of the batch was dropped as non-finite); "
          "stopping. Lower the learning rate or resume from an earlier checkpoint.")
    jax.block_until_ready(state.params)
    step += 1
    t_train += time.time() - t0
    progress.update(step)
    checkpoint_now = step % ckpt_every == 0 or step == stop
    if primary and (step % log_every == 0 or checkpoint_now):
      sps = (step - s_last) / max(time.time() - t_last, 1e-9)
      if ledger is not None:
        eps_now = ledger.epsilon()
      row = dict(step=step, epoch=step * epoch_per_step, epsilon=eps_now,
                 delta=ledger.delta() if ledger else 0.0, steps_per_sec=sps,
                 test_loss=test_loss(state.params))
      if config.log_private_train_loss:
        row["train_loss_NONPRIVATE_diagnostic"] = float(loss_value) / max(num_valid, 1)
      if stats is not None:
        for name, column in CLIP_STATS_COLUMNS.items():
          row[column] = float(getattr(stats, name))
      write_row(row)
      progress.log(
          step,
          {"steps/s": f"{sps:.2f}", "ε": f"{eps_now:.3g}", "test_loss": f"{row['test_loss']:.4f}"})
      t_last, s_last = time.time(), step
    if checkpoint_now:
      if training is not None:
        training.save_checkpoint(ckpt_dir, state, max_to_keep=keep)
      else:
        save_checkpoint(ckpt_dir, state, max_to_keep=keep)
    t0 = time.time()
  progress.close()
  if writer is not None:
    writer.close()
  if int(state.step) >= total_steps:
    save_params(os.path.join(mdir, "params"), state.params)
  eps_final = ledger.epsilon() if ledger else 0.0
  num_dropped = 0 if train_step_fn is None else train_step_fn.num_dropped()
  return dict(method=method, steps=int(state.step), total_steps=total_steps,
              finished=int(state.step) >= total_steps, learning_rate=learning_rate(config, method),
              noise_multiplier=info["noise_multiplier"], sensitivity=info["sensitivity"],
              clip_norm=info.get("clip_norm"), sampling_rate=info["sampling_rate"],
              epsilon=eps_final, delta=ledger.delta() if ledger else 0.0,
              train_seconds=logged_train_seconds(history) if primary else t_train, history=history,
              dropped_pairs=num_dropped, params=_local(state.params), apply_fn=apply_fn)


def initial_params(config, example):
  """The parameters every method of ``config.seed`` starts from; ``example`` is one input (its
  shape matters, not its values)."""
  init_fn = get_model(config.model)[3]
  return init_fn(_keys(config.seed)["init"], data_lib.to_float(jnp.asarray(example)))


def untrained_record(config, ds) -> dict[str, Any]:
  """The initial parameters of every method of this seed, untrained."""
  params = initial_params(config, ds["x_train"][:1])
  apply_fn = get_model(config.model)[1]
  return dict(method=UNTRAINED, steps=0, total_steps=0, finished=True, learning_rate=0.0,
              noise_multiplier=0.0, sensitivity=0.0, clip_norm=None, sampling_rate=0.0, epsilon=0.0,
              delta=0.0, train_seconds=0.0, history=[], params=params, apply_fn=apply_fn)


def evaluate_embeddings(config, params, ds) -> dict[str, Any]:
  """k-NN (test vs. train embeddings) summary + linear probe on frozen embeddings."""
  _, _, apply_jit, _ = get_model(config.model)
  n_knn = config.get("knn_train_size")
  x_tr, y_tr = ds["x_train"], ds["y_train"]
  if n_knn and n_knn < len(y_tr):
    idx = np.random.default_rng(config.seed + 3).permutation(len(y_tr))[:n_knn]
    x_tr, y_tr = x_tr[idx], y_tr[idx]
  e_tr = evaluation.embed(apply_jit, params, x_tr, preprocess=data_lib.to_float)
  e_te = evaluation.embed(apply_jit, params, ds["x_test"], preprocess=data_lib.to_float)
  pred = evaluation.knn_predict(e_tr, y_tr, e_te, k=config.knn_k, num_classes=ds["num_classes"])
  summary = evaluation.classification_summary(ds["y_test"], pred, ds["num_classes"],
                                              beta=config.f_beta)
  if config.get("linear_probe", True):
    summary["linear_probe"] = evaluation.linear_probe_accuracy(e_tr, y_tr, e_te, ds["y_test"],
                                                               seed=config.seed)
  return summary


# ---------------------------------------------------------------------------
# Reporting.


def format_table(rows, reference: str | None = "non_private", acc_label: str = "k-NN acc") -> str:
  """Markdown comparison table (absolute metrics, then relative to the reference)."""
  head = (f"| method | ε | δ | σ | {acc_label} | best recall | best precision | best F_β | "
          "linear probe | rel. acc | rel. recall | rel. precision | rel. F_β | rel. probe |")
  lines = [head, "|" + "---|" * 14]
  ref = rows.get(reference)
  for m, r in rows.items():
    rel = evaluation.relative_metrics(r, ref) if ref else {}
    eps = "∞ (non-private)" if m == "non_private" else f"{r['epsilon']:.3g}"
    delta = "–" if m == "non_private" or "delta" not in r else f"{r['delta']:.3g}"

    def f(d, k, fmt="{:.4f}"):
      return fmt.format(d[k]) if k in d else "–"

    lines.append(
        f"| {METHOD_LABELS.get(m, m)} | {eps} | {delta} | {r['noise_multiplier']:.3g} | "
        f"{f(r, 'accuracy')} | {f(r, 'best_recall')} | {f(r, 'best_precision')} | "
        f"{f(r, 'best_fbeta')} | {f(r, 'linear_probe')} | {f(rel, 'accuracy', '{:.3f}')} | "
        f"{f(rel, 'best_recall', '{:.3f}')} | {f(rel, 'best_precision', '{:.3f}')} | "
        f"{f(rel, 'best_fbeta', '{:.3f}')} | {f(rel, 'linear_probe', '{:.3f}')} |")
  return "\n".join(lines)


def plot_results(results: dict[str, dict], workdir: str, class_names=None):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  def curve(m):
    h = results[m]["history"]
    return (np.array([r["epoch"] for r in h]), np.array([r["test_loss"] for r in h]))

  has_curves = all(results[m].get("history") for m in results)
  fig, ax = plt.subplots(figsize=(5, 3.5)) if has_curves else (None, None)
  for m in (results if has_curves else ()):
    epochs, test_loss = curve(m)
    ax.plot(epochs, test_loss, marker=".", label=METHOD_LABELS.get(m, m))
  if has_curves:
    ax.set_xlabel("epoch")
    ax.set_ylabel("test contrastive loss (per pair)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "loss.png"), dpi=120)
    plt.close(fig)

  if has_curves and "non_private" in results:
    e_ref, l_ref = curve("non_private")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for m in results:
      if m == "non_private":
        continue
      epochs, test_loss = curve(m)
      ax.plot(epochs, test_loss / np.interp(epochs, e_ref, l_ref), marker=".",
              label=METHOD_LABELS.get(m, m))
    ax.axhline(1.0, color="gray", lw=0.8, ls="--", label="Non-private")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test loss / non-private test loss")
    ax.set_title("Relative loss (cf. paper Fig. 1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "relative_loss.png"), dpi=120)
    plt.close(fig)

  ms = [m for m in results if "confusion_matrix" in results[m]]
  if ms:
    k = np.asarray(results[ms[0]]["confusion_matrix"]).shape[0]
    names = list(class_names) if class_names is not None else [str(c) for c in range(k)]
    side = max(4.0, 0.35 * k + 2.5)
    fig, axes = plt.subplots(1, len(ms), figsize=(side * len(ms) + 1.0, side), squeeze=False)
    for ax, m in zip(axes[0], ms):
      cm = np.asarray(results[m]["confusion_matrix"], np.float64)
      cmn = cm / np.maximum(cm.sum(1, keepdims=True), 1)
      im = ax.imshow(cmn, vmin=0, vmax=1, cmap="Blues")
      ax.set_title(f"{METHOD_LABELS.get(m, m)}: acc {results[m]['accuracy']:.3f}")
      ax.set_xticks(range(k))
      ax.set_yticks(range(k))
      fs = 8 if k <= 20 else 5
      ax.set_xticklabels(names, rotation=90, fontsize=fs)
      ax.set_yticklabels(names, fontsize=fs)
      ax.set_xlabel("predicted")
      ax.set_ylabel("true")
      fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "confusion_matrices.png"), dpi=120)
    plt.close(fig)


def _jsonable(x):
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items() if k not in ("params", "apply_fn")}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.ndarray, jax.Array)):
    return np.asarray(x).tolist()
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  return x


def default_workdir(config_path: str, prefix: str) -> str:
  """runs/<prefix>_<config file name>."""
  name = os.path.splitext(os.path.basename(config_path.split(":")[0]))[0]
  return os.path.join("runs", f"{prefix}_{name}")


def save_config(config, workdir: str):
  """workdir/config.json: the config without machine paths (`workdirs.shareable_config`)."""
  os.makedirs(workdir, exist_ok=True)
  workdirs.write_config(config, os.path.join(workdir, "config.json"))


_ADDED_CONFIG_GROUPS = ("dp_gcl", "projection")
# Fields added after runs were started, with the value that reproduces those runs: a
# config.json without them is compared as if it had these values.
_ADDED_CONFIG_DEFAULTS = dict(lr_schedule="constant", lr_final_fraction=0.0, lr_warmup_steps=0,
                              delta_includes_overflow=False, log_clip_stats=False)


def check_resumable(config, workdir: str):
  """Refuses to resume a workdir whose checkpoints were made with another training config."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return
  with open(path) as f:
    old = ml_collections.ConfigDict(workdirs.shareable_config(json.load(f)))
  new = ml_collections.ConfigDict(
      workdirs.shareable_config(json.loads(config.to_json_best_effort())))
  # Config groups added after a run was started (absent from its config.json) are compared
  # as absent: they configure methods that run did not train.
  added = [k for k in _ADDED_CONFIG_GROUPS if k not in old]
  for k, v in _ADDED_CONFIG_DEFAULTS.items():
    if k not in old:
      old[k] = v
  # Where the data lies is not what it is (the loader verifies the archives' checksums): a run
  # resumes from another folder holding the same data.
  for c in (old, new):
    if "npz_dir" in c.get("data", {}):
      c.data.npz_dir = None
  key = lambda c: _freeze(
      {k: v for k, v in c.items() if k not in _RUN_ONLY_FIELDS and k not in added})
  if key(old) != key(new):
    raise ValueError(
        f"{workdir} holds a run with a different training config ({path}); resuming it "
        "would mix two experiments. Use another --workdir (or delete this one).")


_EVALUATION_FIELDS = ("knn_k", "knn_train_size", "f_beta", "linear_probe")


def _finished_results(config, workdir: str) -> dict[str, dict[str, Any]]:
  """The finished methods of an earlier call on this workdir, if it evaluated the same way."""
  paths = [os.path.join(workdir, n) for n in ("results.json", "config.json")]
  if not all(os.path.exists(p) for p in paths):
    return {}
  with open(paths[1]) as f:
    old = json.load(f)
  if any(old.get(k) != config.get(k) for k in _EVALUATION_FIELDS):
    return {}
  with open(paths[0]) as f:
    return {m: r for m, r in json.load(f).items() if r.get("finished")}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       quiet: bool = False) -> dict[str, dict[str, Any]]:
  """Trains and evaluates every method of ``config.methods``; returns per-method results.

  Re-running with the same ``workdir`` resumes every method from its last checkpoint; when
  every method has finished and been evaluated, it says "finished, nothing to do" and
  returns the stored results (without parameters) without touching the folder.
  Multi-process, every process calls it; process 0 returns the evaluated results and
  writes the folder, the others return their training records only.
  """
  check_resumable(config, workdir)
  _sync("config checked")  # before process 0 overwrites it
  # A method added to a finished run (e.g. "untrained") leaves the finished ones as they were:
  # their evaluated results, train time included, are kept, not recomputed.
  previous = {} if _multiprocess() else _finished_results(config, workdir)
  primary = is_primary()  # multi-process: process 0 evaluates and writes; all train
  quiet = quiet or not primary
  if previous and all(m in previous for m in config.methods):
    if not quiet:
      print(f"{workdir}: finished, nothing to do (every method of config.methods was trained "
            f"and evaluated earlier; results in {os.path.join(workdir, 'results.md')})")
    return {m: previous[m] for m in config.methods}
  if primary:
    os.makedirs(workdir, exist_ok=True)
    save_config(config, workdir)
  np.random.seed(config.seed)
  ds = data_lib.load_dataset(config.data, seed=config.seed)
  pairs = data_lib.make_pairs(ds["y_train"], config.pair_mode, config.seed)
  if not quiet:
    print(f"data: {config.data.source}/{config.data.get('name', '')} train {len(ds['y_train'])} "
          f"test {len(ds['y_test'])}; {len(pairs)} records ({config.pair_mode} pairs)")
  eval_data = None
  if primary:
    with open(os.path.join(workdir, "input_shape.json"), "w") as f:
      json.dump(list(ds["x_train"].shape[1:]), f)
    eval_data = eval_pairs(config, ds["x_test"], ds["y_test"], config.seed)
  results = {}
  for method in config.methods:
    if method in previous:
      results[method] = previous[method]
      continue
    if method == UNTRAINED:
      r = untrained_record(config, ds)
    else:
      r = train_method(config, method, ds, pairs, workdir, quiet=quiet, eval_data=eval_data)
    if r["finished"] and primary:
      r.update(evaluate_embeddings(config, r["params"], ds))
    results[method] = r
  if not primary:
    return results
  done = {m: r for m, r in results.items() if r["finished"]}
  if done:
    table = format_table(done)
    if not quiet:
      print(table)
    with open(os.path.join(workdir, "results.md"), "w") as f:
      f.write(table + "\n")
    plot_results(done, workdir, data_lib.class_names(config.data, ds["num_classes"]))
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(_jsonable(results), f, indent=1)
  return results

"""Data-parallel Logit-DP over a device mesh with `jax.sharding` and `jax.shard_map`.

The global batch of n pairs is split along one mesh axis ("data"): each of the
k devices holds n/k pairs and a replicated copy of the parameters. Inside
`jax.shard_map`, `logit_dp.clipped_grad(..., axis_name="data")` all-gathers
the normalised embeddings (as distributed CLIP/SimCLR training does), so the
n×n similarity matrix, the loss and the weights τ_ij span the whole global
batch; each device computes the pair norms and λ_ij for its own rows against
all n columns ("ghost": the positives' Jacobian factors pass around a ring of
devices in blocks, `ppermute`, so each device holds 2n/k examples' factors),
each device contracts or back-propagates the cotangents of its own examples,
and a psum leaves the same global ḡ on every device. The
mechanism is exactly the single-device one on the concatenated batch: same ḡ
(to float rounding), same sensitivity, same noise (drawn once from the same key
on every device), so the privacy accounting does not depend on k.

This module adds the plumbing around that core:

* `data_mesh`: a 1-D mesh over all (or some) visible devices.
* `pad_to_multiple`: pads a batch with masked rows so that it splits evenly.
* `shard_batch` / `replicate`: place a batch (each process feeding its own
  rows, via `jax.make_array_from_process_local_data`) and the replicated state.
* `local_batch_indices`: the rows of a global batch of record indices (e.g. a
  Poisson batch) that this process loads and feeds to `shard_batch`.
* `broadcast_seed`: a secret seed drawn once (process 0) and shared by every
  process, for the noise key and the sampler.
* `make_sharded_grad_fn`: the jitted shard_map of `clipped_grad` /
  `naive_clipped_grad` / `grouped_clipped_grad`, returning the global (ℒ, ḡ), replicated.
* `make_private_optimizer` / `make_private_train_step`: ḡ → `logit_dp.transform`
  (noise) → optax, the low-level step (`make_private(mesh=...)` sets up the sampler and
  the ledger around the same update).

Multi-host: call `jax.distributed.initialize()` first on every process; then
`jax.devices()` lists the devices of all hosts and `data_mesh()` spans them.
Every process runs the same program: the same parameters (same seed), the
same noise key and sampler seed (`broadcast_seed`), hence the same Poisson
batch of record indices at every step; `local_batch_indices` gives each
process its rows, which it loads and passes to `shard_batch`. The result is
the single-process computation on the same global batch: tests/test_multihost.py
runs 2 processes × 2 CPU devices over loopback (gloo) and compares ḡ, the
noisy update, the ledger and a run resumed after a killed process with one
process.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from logit_dp._src import checks
from logit_dp._src import clipping
from logit_dp._src import finetune
from logit_dp._src import grad_fn as grad_fn_lib
from logit_dp._src import mechanisms
from logit_dp._src import methods
from logit_dp._src import noise as noise_lib
from logit_dp._src import rows as rows_lib
from logit_dp._src import stochastic as stochastic_lib
from logit_dp._src import update as update_lib

DATA_AXIS = "data"

__all__ = [
    "DATA_AXIS",
    "broadcast_seed",
    "data_mesh",
    "local_batch_indices",
    "make_private_optimizer",
    "make_private_train_step",
    "make_sharded_grad_fn",
    "pad_to_multiple",
    "replicate",
    "resolve_devices",
    "shard_batch",
]

DevicesArg = None | int | Sequence[Any]


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class ShardedGradFn(grad_fn_lib.ClippedGradFn):
  """grad_fn(params, x, x_prime, mask=None) -> (ℒ, ḡ) on the GLOBAL batch (`make_sharded_grad_fn`).

  A `ClippedGradFn` (mechanism, clip_norm, sensitivity()) whose ḡ is replicated on every
  device. ``shard_mapped`` is its un-jitted shard_map, (params, x, x_prime, mask[, key]) ->
  (ℒ, ḡ, n_nonfinite); ``mesh`` the mesh it runs on.
  """
  shard_mapped: Callable[..., tuple[jax.Array, Any, jax.Array]]
  mesh: Mesh


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class TrainStep(grad_fn_lib.CheckedCall):
  """step(params, opt_state, x, x_prime, mask=None, *, key=None) -> (params, opt_state, ℒ).

  key: required for a stochastic model (stochastic=True), refused otherwise.
  ``mesh`` is the mesh it runs on.
  """
  mesh: Mesh

  def __call__(self, params: Any, opt_state: Any, x: jax.Array, x_prime: jax.Array,
               mask: jax.Array | None = None, *, key: Any = None) -> tuple[Any, Any, jax.Array]:
    """One private step on the batch of pairs (x_i, x'_i) with mask_i true."""
    return self._checked_core(params, opt_state, x, x_prime, mask, key=key)


def resolve_devices(devices: DevicesArg = None) -> list:
  """The devices to use: None or -1 means all visible devices (of all hosts).

  An int k ≥ 1 takes the first k of `jax.devices()`; a sequence is used as given.
  With several processes (multi-host) a mesh must span every process's devices
  (each process feeds its own rows), so only "all devices" is accepted there.
  """
  all_devices = jax.devices()
  if devices is None or (isinstance(devices, int) and not isinstance(devices, bool)
                         and devices == -1):
    return list(all_devices)
  if isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
    k = int(devices)
    if not 1 <= k <= len(all_devices):
      raise ValueError(f"devices must be -1 (all) or between 1 and {len(all_devices)} (the visible "
                       f"devices), got {k}.")
    if jax.process_count() > 1 and k != len(all_devices):
      raise ValueError(
          f"with {jax.process_count()} processes the mesh must use all {len(all_devices)} "
          f"devices (devices=-1), got {k}.")
    return list(all_devices[:k])
  if isinstance(devices, bool):
    raise TypeError(f"devices must be None, an int or a sequence of devices, got {devices!r}.")
  devices = list(devices)
  if not devices:
    raise ValueError("devices must not be empty.")
  return devices


def data_mesh(devices: DevicesArg = None, axis_name: str = DATA_AXIS) -> Mesh:
  """A 1-D mesh with one axis `axis_name` over `devices` (default: all visible).

  `devices` is None / -1 (all), a count k (the first k devices), or a sequence
  of devices. The axis type is Auto, so jitted code may receive inputs with any
  sharding and XLA moves them (`make_sharded_grad_fn` also places them itself).
  """
  devs = resolve_devices(devices)
  return Mesh(
      np.asarray(devs, dtype=object).reshape(len(devs)), (axis_name,),
      axis_types=(jax.sharding.AxisType.Auto,))


def check_mesh(mesh, axis_name: str = DATA_AXIS) -> Mesh:
  """mesh if it is a `jax.sharding.Mesh` with the axis ``axis_name``; TypeError/ValueError
  otherwise."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh (distributed.data_mesh()), got "
                    f"{type(mesh).__name__}.")
  _axis_size(mesh, axis_name)
  return mesh


def _axis_size(mesh: Mesh, axis_name: str) -> int:
  if axis_name not in mesh.shape:
    raise ValueError(f"mesh has axes {tuple(mesh.axis_names)}, not {axis_name!r}.")
  return int(mesh.shape[axis_name])


def pad_to_multiple(x, x_prime, mask=None, multiple: int = 1) -> tuple[Any, Any, Any]:
  """Pads the batch with masked rows so that its size divides by `multiple`.

  Padded rows are zeros with mask False: they contribute exactly nothing to the
  loss or to ḡ (see `clipped_grad`), so a batch of 13 pairs padded to 16 on 4
  devices gives the same (ℒ, ḡ) as the 13 pairs on one device. numpy inputs
  give numpy outputs (pad on the host, before `shard_batch`), others jax arrays.

  Returns:
    (x, x_prime, mask) with leading size ⌈n/multiple⌉·multiple; mask is bool.
  """
  if isinstance(multiple, bool) or not isinstance(multiple, (int, np.integer)) or multiple < 1:
    raise ValueError(f"multiple must be a positive integer, got {multiple!r}.")
  host = all(isinstance(a, np.ndarray) for a in jax.tree_util.tree_leaves((x, x_prime, mask)))
  xp = np if host else jnp
  x, x_prime, mask = checks.check_pairs(x, x_prime, mask, xp)
  n = rows_lib.num_rows(x)
  pad = (-n) % int(multiple)
  if pad == 0:
    return x, x_prime, mask

  def padded(a):
    return xp.concatenate([a, xp.zeros((pad,) + a.shape[1:], a.dtype)])

  return jax.tree_util.tree_map(padded, (x, x_prime, mask))


def replicate(tree, mesh: Mesh) -> Any:
  """Places a pytree (params, optimizer state) replicated on every device of the mesh.

  Multi-host: every process must pass the same values (e.g. params initialised
  from the same seed, or restored from the same checkpoint, and the noise key
  from `broadcast_seed`); JAX compares them across processes and this raises
  ValueError if they differ.
  """
  try:
    return jax.device_put(tree, NamedSharding(mesh, P()))
  except AssertionError as e:  # jax's cross-process comparison (multihost_utils.assert_equal)
    raise ValueError(
        f"replicate: the processes passed different values ({e}). Every process needs the "
        "same parameters and optimizer state: initialise from the same seed and draw the noise "
        "key from distributed.broadcast_seed(), not from `secrets` on each process.") from e


_SEED_BOUND = 2 ** 63


def broadcast_seed(seed: int | None = None) -> int:
  """A seed in [0, 2⁶³) that is the same on every process: process 0's.

  The noise key and the Poisson sampler's seed must be equal on every process
  (each process draws the replicated noise itself and samples the global batch
  itself), and secret. ``seed=None`` draws one with `secrets` on process 0; an
  int is process 0's value. Single process: the seed itself, no communication.
  Multi-host it is a collective: every process must call it, in the same order.

  Raises:
    ValueError: seed is not an integer in [0, 2⁶³).
  """
  if seed is None:
    seed = secrets.randbits(63) if jax.process_index() == 0 else 0
  is_int = isinstance(seed, (int, np.integer)) and not isinstance(seed, bool)
  if not is_int or not 0 <= seed < _SEED_BOUND:
    raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {seed!r}.")
  seed = int(seed)
  if jax.process_count() == 1:
    return seed
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  words = np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
  shared = np.asarray(multihost_utils.broadcast_one_to_all(words)).astype(np.uint64)
  return int(shared[0]) << 32 | int(shared[1])


def _process_row_range(mesh: Mesh, axis_name: str, n: int) -> tuple[int, int]:
  """[start, stop): the rows of a P(axis_name) batch of n rows held by this process's devices."""
  sharding = NamedSharding(mesh, P(axis_name))
  ranges = set()
  for index in sharding.addressable_devices_indices_map((n,)).values():
    rows = slice(None) if index is None else index[0]
    ranges.add((0 if rows.start is None else rows.start, n if rows.stop is None else rows.stop))
  ranges = sorted(ranges)
  if not ranges:
    raise ValueError("this process has no device in the mesh.")
  for (_, stop), (start, _) in zip(ranges, ranges[1:]):
    if start != stop:
      raise ValueError(
          f"this process's devices hold the non-contiguous rows {ranges} of the batch; build the "
          "mesh with data_mesh() (devices in process order).")
  return ranges[0][0], ranges[-1][1]


def local_batch_indices(mesh: Mesh, indices, mask=None, *,
                        axis_name: str = DATA_AXIS) -> tuple[np.ndarray, np.ndarray]:
  """This process's share of a global batch of record indices (e.g. a Poisson batch).

  Every process passes the same global batch (a `PoissonSampler` is a function
  of (seed, step), so processes with the same seed draw the same batch). It is
  padded with (index 0, mask False) to n' = ⌈n/k⌉·k rows for the k devices of
  `axis_name`, and this process gets the rows [start, stop) that its devices
  hold under P(axis_name). Load those records and pass them to `shard_batch`:
  the global batch it assembles is the padded batch, row for row, on every
  number of processes (padded rows carry mask False and contribute nothing).

  Returns:
    (indices, mask) of this process's rows: int32[n'/P] and bool[n'/P] when all
    P processes have the same number of devices.
  """
  k = _axis_size(mesh, axis_name)
  indices = np.asarray(indices)
  if indices.ndim != 1:
    raise ValueError(f"indices must be a 1-D array of record indices, got shape {indices.shape}.")
  n = indices.shape[0]
  mask = np.ones((n,), bool) if mask is None else np.asarray(mask)
  if mask.shape != (n,) or mask.dtype != np.bool_:
    raise ValueError(f"mask must be a bool array of shape ({n},), got {mask.dtype}{mask.shape}.")
  pad = (-n) % k
  indices = np.concatenate([indices.astype(np.int32), np.zeros((pad,), np.int32)])
  mask = np.concatenate([mask, np.zeros((pad,), bool)])
  start, stop = _process_row_range(mesh, axis_name, n + pad)
  return indices[start:stop], mask[start:stop]


def shard_batch(mesh: Mesh, x, x_prime, mask=None, *,
                axis_name: str = DATA_AXIS) -> tuple[jax.Array, ...]:
  """Builds the global batch, sharded along `axis_name`, from this process's rows.

  Single process: x, x_prime (and mask) are the whole batch. Multi-host: each
  process passes its own slice (all processes the same number of rows, in
  process order); `jax.make_array_from_process_local_data` assembles the global
  array without any host seeing the whole batch. The local rows are first
  padded with masked rows to a multiple of this process's devices in the mesh.

  Returns:
    (x, x_prime, mask) as global jax.Arrays sharded P(axis_name).
  """
  _axis_size(mesh, axis_name)
  local_devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  x, x_prime, mask = pad_to_multiple(jax.tree_util.tree_map(np.asarray, x),
                                     jax.tree_util.tree_map(np.asarray, x_prime),
                                     None if mask is None else np.asarray(mask),
                                     max(int(local_devices), 1))
  sharding = NamedSharding(mesh, P(axis_name))
  return tuple(
      jax.tree_util.tree_map(lambda a: jax.make_array_from_process_local_data(sharding, a), t)
      for t in (x, x_prime, mask))


def _check_global_batch(x, x_prime, mask, k: int, min_batch_size: int):
  """(x, x_prime) as jax arrays (or pytrees of them); ValueError on a batch that cannot be
  split over k devices or is too small for the loss."""
  x, x_prime, _ = checks.check_pairs(x, x_prime)
  n = rows_lib.num_rows(x)
  if n < min_batch_size:
    raise ValueError(f"the loss needs at least {min_batch_size} pairs per batch, got {n}.")
  if n % k:
    raise ValueError(
        f"the global batch ({n} pairs) must split evenly over the {k} devices of the mesh; "
        f"pad it with masked rows first: logit_dp.distributed.pad_to_multiple(x, x_prime, "
        f"mask, {k}).")
  if mask is not None and tuple(np.shape(mask)) != (n,):
    raise ValueError(f"mask must have shape ({n},), got {tuple(np.shape(mask))}.")
  return x, x_prime


def _grad_fn(embed_fn, loss, clip_norm, method, naive, axis_name, kwargs):
  """The `ClippedGradFn` of one shard (`clipping.private_grad` with axis_name); naive=True is
  method="naive".

  Its public call checks the batch size on the LOCAL shard (so 1 pair per device fails for
  the contrastive loss, which needs 2 in the batch); the sharded functions call its core and
  check the global batch instead.
  """
  if naive:  # Naive-DP has no pair norms, hence no clip method
    method = mechanisms.NAIVE_METHOD
  return clipping.private_grad(embed_fn, loss, clip_norm, method, axis_name=axis_name, **kwargs)


def _checked_global_inputs(k: int, min_batch_size: int, data, replicated):
  """check_inputs of the sharded functions: (params, [opt_state,] x, x_prime, mask) with the
  global batch checked (`_check_global_batch`, `checks.check_mask`) and, called eagerly, placed
  on the mesh (one placement whatever the caller's: no resharding inside, one jit cache entry)."""
  def check_inputs(*state, x, x_prime, mask, key=()):
    x, x_prime = _check_global_batch(x, x_prime, mask, k, min_batch_size)
    n = rows_lib.num_rows(x)
    mask = jnp.ones((n,), bool) if mask is None else checks.check_mask(mask, n, jnp)
    if not rows_lib.is_traced((state, x, x_prime, mask, key)):
      state, key = jax.device_put((state, key), replicated)
      x, x_prime, mask = jax.device_put((x, x_prime, mask), data)
    return (*state, x, x_prime, mask, *key)

  return check_inputs


def _shard_map(fn, mesh, in_specs, out_specs):
  # JAX's default check_vma=True: the core casts params to per-device values so
  # that derivatives stay local (tests/test_distributed.py checks both modes).
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def make_sharded_grad_fn(embed_fn, loss, clip_norm: float, mesh: Mesh,
                         method: str | methods.ClipMethod = "ghost", *, naive: bool = False,
                         axis_name: str = DATA_AXIS, **kwargs) -> ShardedGradFn:
  """Data-parallel `clipped_grad` (or `naive_clipped_grad`, `grouped_clipped_grad`) over `mesh`.

  Returns grad_fn(params, x, x_prime, mask=None) -> (ℒ, ḡ): x, x_prime, mask
  hold the GLOBAL batch (any sharding; it is placed P(axis_name), so its size
  must divide by the number of devices: use `pad_to_multiple`); params are
  replicated. ℒ and ḡ are the values of the single-device call on the whole
  batch, replicated on every device. Called eagerly it raises ValueError on
  non-finite valid pairs, like `clipped_grad`; `grad_fn.shard_mapped` is the
  un-jitted shard_map (returning (ℒ, ḡ, num_nonfinite)) for use inside your
  own jitted step. ``grad_fn.with_num_dropped`` and ``grad_fn.with_stats`` are those of
  `clipped_grad` on the global batch: the `ClipStats` are aggregated over the devices
  (NON-PRIVATE diagnostics).

  Args:
    embed_fn, loss, clip_norm: as in `logit_dp.clipped_grad`.
    mesh: a mesh with axis `axis_name` (e.g. `data_mesh()`).
    method: as in `make_private`: a clip method of `clipped_grad` (Logit-DP; an object or a
      registered name), "naive" (`naive_clipped_grad`, Naive-DP) or "dp_gcl"
      (`grouped_clipped_grad`, DP-GCL, with num_groups= in kwargs: grad_fn then also takes
      record_ids=, group_key= and extra_views= of the global batch, split along the axis with
      it; the groups and ḡ are those of one device).
    naive: True is the same as method="naive".
    axis_name: the mesh axis the batch is split along.
    **kwargs: microbatch_size, pair_block_size, memory_budget, cosine_eps (per device),
      positive_embed_fn for two towers (x, x_prime may then be pytrees, split
      along axis 0 of every leaf), and stochastic=True for a model embed_fn(params, x, key)
      (grad_fn then takes key=, replicated; example i of the global batch gets the key it
      gets on one device, so ḡ is the single-device one).
  """
  k = _axis_size(mesh, axis_name)
  shard_fn = _grad_fn(embed_fn, loss, clip_norm, method, naive, axis_name, kwargs)
  stochastic = shard_fn.stochastic
  batch_spec = P(axis_name)
  if shard_fn.mechanism is mechanisms.Mechanism.DP_GCL:
    return _sharded_grouped_grad_fn(shard_fn, embed_fn, loss, mesh, axis_name, kwargs)
  # The model's key of a stochastic embed_fn, replicated.
  in_specs = (P(), batch_spec, batch_spec, batch_spec) + ((P(),) if stochastic else ())
  shard_mapped = _shard_map(shard_fn.core, mesh, in_specs, (P(), P(), P()))
  # (ℒ, ḡ, ClipStats): the statistics of the global batch, the same on every device.
  stats_mapped = _shard_map(shard_fn.stats_core, mesh, in_specs, (P(), P(), P()))
  data, replicated = NamedSharding(mesh, batch_spec), NamedSharding(mesh, P())
  check_global = _checked_global_inputs(k, getattr(loss, "min_batch_size", 1), data, replicated)

  def check_inputs(params, x, x_prime, mask=None, *, key=None):
    key = stochastic_lib.check_key(key, stochastic, shard_fn.description)
    return check_global(params, x=x, x_prime=x_prime, mask=mask, key=(key,) if stochastic else ())

  def check_model(params, x, x_prime, mask, key=None):
    del mask
    checks.check_towers(embed_fn, kwargs.get("positive_embed_fn"), params, x, x_prime, key)

  return ShardedGradFn(core=jax.jit(shard_mapped), check_inputs=check_inputs,
                       check_model=check_model, mechanism=shard_fn.mechanism,
                       clip_norm=shard_fn.clip_norm, loss=loss, clip_method=shard_fn.clip_method,
                       description=shard_fn.description, shard_mapped=shard_mapped, mesh=mesh,
                       stats_core=jax.jit(stats_mapped), stochastic=stochastic,
                       trainable=shard_fn.trainable)


def _sharded_grouped_grad_fn(shard_fn, embed_fn, loss, mesh: Mesh, axis_name: str,
                             kwargs) -> ShardedGradFn:
  """`make_sharded_grad_fn` of DP-GCL (`grouped_clipped_grad` with axis_name): grad_fn(params, x,
  x_prime, mask=None, *, record_ids, group_key, extra_views=None[, key]) on the GLOBAL batch.

  The records are grouped on the whole batch (`assign_groups` of the global record ids), and
  the group ids and extra views are split along the axis with the records.
  """
  k = _axis_size(mesh, axis_name)
  stochastic = shard_fn.stochastic
  batch_spec = P(axis_name)
  # (params, x, x_prime, mask, group ids, extra views[, key]).
  in_specs = (P(), batch_spec, batch_spec, batch_spec, batch_spec, batch_spec) + (
      (P(),) if stochastic else ())
  shard_mapped = _shard_map(shard_fn.core, mesh, in_specs, (P(), P(), P()))
  stats_mapped = _shard_map(shard_fn.stats_core, mesh, in_specs, (P(), P(), P()))
  data, replicated = NamedSharding(mesh, batch_spec), NamedSharding(mesh, P())
  check_global = _checked_global_inputs(k, getattr(loss, "min_batch_size", 1), data, replicated)

  def check_inputs(params, x, x_prime, mask=None, *, record_ids=None, group_key=None,
                   extra_views=None, key=None):
    # The single-device checks on the global batch (record ids, extra views, the groups),
    # then the placement of the sharded functions.
    params, x, x_prime, mask, groups, views, *key_arg = shard_fn.check_inputs(
        params, x, x_prime, mask, record_ids=record_ids, group_key=group_key,
        extra_views=extra_views, key=key)
    params, x, x_prime, mask, *key_arg = check_global(params, x=x, x_prime=x_prime, mask=mask,
                                                      key=tuple(key_arg))
    if not rows_lib.is_traced((groups, views)):
      groups, views = jax.device_put((groups, views), data)
    return (params, x, x_prime, mask, groups, views, *key_arg)

  def check_model(params, x, x_prime, mask, groups, views, key=None):
    del mask, groups, views
    checks.check_towers(embed_fn, kwargs.get("positive_embed_fn"), params, x, x_prime, key)

  return ShardedGradFn(core=jax.jit(shard_mapped), check_inputs=check_inputs,
                       check_model=check_model, mechanism=shard_fn.mechanism,
                       clip_norm=shard_fn.clip_norm, loss=loss, num_groups=shard_fn.num_groups,
                       description=shard_fn.description, unit=shard_fn.unit,
                       shard_mapped=shard_mapped, mesh=mesh, stats_core=jax.jit(stats_mapped),
                       stochastic=stochastic, trainable=shard_fn.trainable)


def make_private_optimizer(noise_multiplier: float, sensitivity: float, key,
                           optimizer: optax.GradientTransformation, *,
                           expected_batch_size: float | None = None, allow_zero_noise: bool = False,
                           trainable: Any = None) -> optax.GradientTransformation:
  """ḡ → N(0, (σC)²) noise (`logit_dp.transform`) → optional 1/E[n] scaling → optimizer.

  The noise comes first, on the summed ḡ; everything after it is
  post-processing. C is the sensitivity of the GLOBAL ḡ
  (`logit_dp.sensitivity(loss, B, batch_size)` with the global number of real
  pairs, or None under Poisson sampling), never a per-device quantity: the
  mechanism, hence the accounting, does not depend on the number of devices.

  trainable (fine-tuning, `logit_dp.finetune`): the noise and the optimizer act on the
  trainable leaves only (``optax.masked``); a frozen leaf's update is its ḡ, exact zeros from a
  gradient built with the same ``trainable``, and it has no optimizer state.
  """
  noise = noise_lib.transform(noise_multiplier, sensitivity, key, allow_zero_noise=allow_zero_noise)
  if trainable is not None:
    noise = finetune.masked_optimizer(noise, trainable)
    optimizer = finetune.masked_optimizer(optimizer, trainable)
  parts = [noise]
  if expected_batch_size is not None:
    parts.append(optax.scale(1.0 / float(expected_batch_size)))
  parts.append(optimizer)
  return optax.chain(*parts)


def _first_state(state):
  """The state of the first transformation of an optax.chain (nested chains included)."""
  while True:
    if isinstance(state, optax.MaskedState):  # fine-tuning: the noise on the trainable leaves
      state = state.inner_state
    elif isinstance(state, (tuple, list)) and not hasattr(state, "_fields") and state:
      state = state[0]
    else:
      return state


def check_adds_noise(optimizer: optax.GradientTransformation, params) -> None:
  """ValueError unless `optimizer` starts with the Logit-DP noise (`logit_dp.transform`).

  The noise must come first, on the summed clipped gradient ḡ whose sensitivity is C:
  anything before it (a scale, a clip, an optimizer) would change what is noised.
  """
  state = jax.eval_shape(optimizer.init, params)
  if not isinstance(_first_state(state), noise_lib.AddNoiseState):
    raise ValueError(
        "optimizer does not start with the Logit-DP noise, so the step would not be private. "
        "Build it with distributed.make_private_optimizer(σ, C, key, optimizer) or start an "
        "optax.chain with logit_dp.transform(σ, C, key); pass non_private=True to train "
        "without noise on purpose.")


def make_private_train_step(embed_fn, loss, clip_norm: float, mesh: Mesh,
                            optimizer: optax.GradientTransformation, method: str = "ghost", *,
                            naive: bool = False, axis_name: str = DATA_AXIS, donate: bool = False,
                            non_private: bool = False, **kwargs) -> TrainStep:
  """One data-parallel private step: (params, opt_state, x, x', mask) -> (params, opt_state, ℒ).

  The low-level step, without sampler or ledger (`make_private(mesh=...)` sets up both and
  its `make_train_step` runs the same update): the global ḡ of `make_sharded_grad_fn`, then
  ``optimizer``, then `optax.apply_updates` (`update.private_update`), jitted.
  `optimizer` must add the noise (build it with `make_private_optimizer` or
  start it with `logit_dp.transform`): on first use the step raises ValueError
  otherwise, unless non_private=True (an explicitly non-private step). embed_fn
  is checked on first use too (`checks.check_embed_fn`). The noise key lives in the
  replicated optimizer state, so the noise is drawn once, the same on every device, and
  the released update and new params are replicated. params/opt_state should be
  `replicate`d and the batch sharded along `axis_name` (`shard_batch`); with donate=True
  params and opt_state are donated. As with `clipped_grad` under jit, valid pairs with
  non-finite inputs or embeddings are masked out.

  method and naive (the same as method="naive") as in `make_sharded_grad_fn`.
  """
  k = _axis_size(mesh, axis_name)
  grad_fn = make_sharded_grad_fn(embed_fn, loss, clip_norm, mesh, method, naive=naive,
                                 axis_name=axis_name, **kwargs)
  if grad_fn.mechanism is mechanisms.Mechanism.DP_GCL:
    raise ValueError("make_private_train_step takes no record ids: train DP-GCL on a mesh with "
                     "make_private(..., method='dp_gcl', mesh=mesh), whose step groups each "
                     "batch's records, or call make_sharded_grad_fn(..., method='dp_gcl').")
  stochastic = grad_fn.stochastic

  def body(params, opt_state, x, x_prime, mask, *key):
    grad_kwargs = {"key": key[0]} if stochastic else {}
    params, opt_state, loss_value, _, _ = update_lib.private_update(grad_fn, optimizer, params,
                                                                    opt_state, x, x_prime, mask,
                                                                    **grad_kwargs)
    return params, opt_state, loss_value

  jitted = jax.jit(body, donate_argnums=(0, 1) if donate else ())
  data, replicated = NamedSharding(mesh, P(axis_name)), NamedSharding(mesh, P())
  check_global = _checked_global_inputs(k, getattr(loss, "min_batch_size", 1), data, replicated)

  def check_inputs(params, opt_state, x, x_prime, mask=None, *, key=None):
    key = stochastic_lib.check_key(key, stochastic, "make_private_train_step")
    return check_global(params, opt_state, x=x, x_prime=x_prime, mask=mask,
                        key=(key,) if stochastic else ())

  def check_model(params, opt_state, x, x_prime, mask, key=None):
    del opt_state, x, x_prime, mask, key
    if not non_private:
      check_adds_noise(optimizer, params)

  return TrainStep(core=jitted, check_inputs=check_inputs, check_model=check_model, mesh=mesh)

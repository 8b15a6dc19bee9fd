"""One process of the distributed guide's multi-host recipe, run by tests/test_multihost.py.

    python tests/multihost_worker.py --coordinator=127.0.0.1:PORT --num_processes=2 \
        --process_id=I --local_devices=2 --out=DIR [--steps=T] [--checkpoint_dir=CKPT]

Each process joins `jax.distributed` over loopback (gloo collectives on the CPU), builds
the mesh over every process's devices, draws the same Poisson batch as the others
(same sampler seed), loads only its own rows (`distributed.local_batch_indices`) and
feeds them to `distributed.shard_batch`; `make_sharded_grad_fn` gives the global ḡ and
`make_private_train_step` the noisy update, the ledger records each step first. With
--checkpoint_dir every step is checkpointed with the ledger (`logit_dp.ledger`) and a
relaunch resumes from the newest checkpoint. Process p writes DIR/process{p}.npz (ḡ,
loss and params after every step, its rows, the seeds) and DIR/process{p}.json (ledger).

Without --checkpoint_dir it checks ḡ (`make_sharded_grad_fn`) and the noisy update by hand
(`tx.update`); with it, it trains with `make_private_train_step`. Both run unchanged in one
process on any mesh (the test's 4-device reference).
"""

import argparse
import json
import os
import sys
import time

N_RECORDS = 40
SAMPLING_RATE = 0.3
FEATURES = 7
CLIP_NORM = 0.05  # below most pair-gradient norms here: clipping changes ḡ
NOISE_MULTIPLIER = 0.8
TARGET_DELTA = 1e-5
LEARNING_RATE = 0.05
DATA_SEED = 0
SEED_FILE = "SECRET_seeds.json"


def problem(noise_seed: int, sampler_seed: int) -> dict:
  """The run: a tiny dataset of pairs, an MLP, its optimizer (noise first), sampler and ledger."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import logit_dp
  from logit_dp import distributed
  from logit_dp import models
  from logit_dp import sampling
  from logit_dp.ledger import PrivacyLedger

  rng = np.random.default_rng(DATA_SEED)
  x_all = rng.standard_normal((N_RECORDS, FEATURES)).astype(np.float32)
  x_prime_all = (x_all + 0.5 * rng.standard_normal(x_all.shape)).astype(np.float32)
  model = models.MLPEmbedding(embedding_dim=4, hidden=(8,))
  loss = logit_dp.losses.contrastive(temperature=0.5)
  sampler = sampling.PoissonSampler(num_records=N_RECORDS, sampling_rate=SAMPLING_RATE,
                                    seed=sampler_seed)
  sensitivity = logit_dp.sensitivity(loss, clip_norm=CLIP_NORM, batch_size=None)
  tx = distributed.make_private_optimizer(NOISE_MULTIPLIER, sensitivity, jax.random.key(noise_seed),
                                          optax.sgd(LEARNING_RATE),
                                          expected_batch_size=sampler.expected_batch_size)
  return dict(embed_fn=model.apply, loss=loss, x_all=x_all, x_prime_all=x_prime_all,
              params=model.init(jax.random.key(DATA_SEED), jnp.zeros(
                  (1, FEATURES))), tx=tx, sampler=sampler,
              ledger=PrivacyLedger.for_sampler(sampler, NOISE_MULTIPLIER, TARGET_DELTA,
                                               pld_discretization=1e-3))  # 0.08 s a step, not 0.6


def _flat(tree):
  import jax
  import numpy as np
  return np.concatenate([np.ravel(np.asarray(a)) for a in jax.tree.leaves(tree)])


def _global_batch(mesh, run, step):
  """This process's rows of the Poisson batch of `step`, assembled into the global batch."""
  from logit_dp import distributed
  batch = run["sampler"](step)  # the same on every process: a function of (seed, step)
  rows, mask = distributed.local_batch_indices(mesh, batch.indices, batch.mask)
  x, x_prime, mask = distributed.shard_batch(mesh, run["x_all"][rows], run["x_prime_all"][rows],
                                             mask)
  return rows, x, x_prime, mask


def check_steps(mesh, noise_seed: int, sampler_seed: int, steps: int):
  """ḡ (`make_sharded_grad_fn`), then the noisy update by hand (`tx.update`), `steps` times.

  Returns (records, ledger): per step the process's rows, ℒ, ḡ and the params after it.
  """
  import jax
  import optax

  from logit_dp import distributed

  run = problem(noise_seed, sampler_seed)
  tx, ledger = run["tx"], run["ledger"]
  grad_fn = distributed.make_sharded_grad_fn(run["embed_fn"], run["loss"], CLIP_NORM, mesh)

  @jax.jit
  def noisy_update(gbar, opt_state, params):
    updates, opt_state = tx.update(gbar, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = distributed.replicate(run["params"], mesh)
  opt_state = distributed.replicate(tx.init(run["params"]), mesh)
  records = []
  for step in range(steps):
    rows, x, x_prime, mask = _global_batch(mesh, run, step)
    ledger.record_steps(1)  # before the update is released
    loss_value, gbar = grad_fn(params, x, x_prime, mask)
    params, opt_state = noisy_update(gbar, opt_state, params)
    records.append(
        dict(step=step, rows=rows, loss=float(loss_value), gbar=_flat(gbar), params=_flat(params)))
  return records, ledger


def train_steps(mesh, noise_seed: int, sampler_seed: int, steps: int, checkpoint_dir: str,
                step_delay: float = 0.0, log=print):
  """`make_private_train_step` up to step `steps`, resuming from and checkpointing every step.

  State and ledger are saved together (`logit_dp.ledger.save_checkpoint`) after every step
  by every process (orbax writes each array once); a relaunch resumes from the newest one.
  Returns (records, ledger), records holding the steps run here (params after each).
  """
  import logit_dp.ledger
  from logit_dp import distributed

  run = problem(noise_seed, sampler_seed)
  tx, ledger = run["tx"], run["ledger"]
  step_fn = distributed.make_private_train_step(run["embed_fn"], run["loss"], CLIP_NORM, mesh, tx)
  state = distributed.replicate({"params": run["params"], "opt_state": tx.init(run["params"])},
                                mesh)
  start = 0
  if logit_dp.ledger.latest_step(checkpoint_dir) is not None:
    state, ledger, start = logit_dp.ledger.restore_checkpoint(checkpoint_dir, state)
    log(f"resumed from step {start}")
  records = []
  for step in range(start, steps):
    rows, x, x_prime, mask = _global_batch(mesh, run, step)
    ledger.record_steps(1)
    params, opt_state, loss_value = step_fn(state["params"], state["opt_state"], x, x_prime, mask)
    state = {"params": params, "opt_state": opt_state}
    logit_dp.ledger.save_checkpoint(checkpoint_dir, step + 1, state, ledger)
    log(f"checkpointed step {step + 1}")
    records.append(dict(step=step, rows=rows, loss=float(loss_value), params=_flat(params)))
    time.sleep(step_delay)
  return records, ledger


def _shared_seeds(seed_file):
  """(noise_seed, sampler_seed), drawn with `secrets` by process 0 and shared by every process.

  With seed_file, process 0 keeps them there (drawn once) so that a relaunch reuses them.
  """
  import jax

  from logit_dp import distributed

  mine = [None, None]  # None: process 0 draws it with `secrets`
  if jax.process_index() == 0 and seed_file and os.path.exists(seed_file):
    with open(seed_file) as f:
      mine = json.load(f)
  seeds = [distributed.broadcast_seed(s) for s in mine]
  if jax.process_index() == 0 and seed_file and not os.path.exists(seed_file):
    with open(seed_file, "w") as f:
      json.dump(seeds, f)
  return seeds


def _check_replicate_refuses_different_values(mesh, log):
  """A noise key drawn on each process (here: its own seed) must not become 'replicated'."""
  import jax

  from logit_dp import distributed
  own_key = jax.random.key_data(jax.random.key(jax.process_index()))
  try:
    distributed.replicate({"rng_key": own_key}, mesh)
  except ValueError as e:
    log(f"replicate refused different values: {str(e)[:100]}")
  else:
    raise SystemExit("replicate accepted different values on the processes")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--coordinator", required=True)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--local_devices", type=int, default=2)
  parser.add_argument("--out", required=True)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--checkpoint_dir", default=None)
  parser.add_argument("--step_delay", type=float, default=0.0)
  parser.add_argument("--heartbeat_timeout", type=int, default=5)
  args = parser.parse_args(argv)

  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_num_cpu_devices", args.local_devices)
  jax.config.update("jax_default_matmul_precision", "highest")  # as the tests' reference
  jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                             process_id=args.process_id,
                             heartbeat_timeout_seconds=args.heartbeat_timeout)
  import numpy as np

  from logit_dp import distributed

  me = jax.process_index()
  log = lambda msg: print(f"[process {me}] {msg}", flush=True)
  log(f"{jax.process_count()} processes, devices {jax.devices()}")
  mesh = distributed.data_mesh()
  seed_file = os.path.join(args.out, SEED_FILE)
  noise_seed, sampler_seed = _shared_seeds(seed_file)
  if args.checkpoint_dir is None:
    _check_replicate_refuses_different_values(mesh, log)
    records, ledger = check_steps(mesh, noise_seed, sampler_seed, args.steps)
  else:
    records, ledger = train_steps(mesh, noise_seed, sampler_seed, args.steps, args.checkpoint_dir,
                                  args.step_delay, log)
  stacked = {k: np.stack([r[k] for r in records]) for k in (records[0] if records else {})}
  np.savez(os.path.join(args.out, f"process{me}.npz"), seeds=np.array([noise_seed, sampler_seed],
                                                                      np.uint64), **stacked)
  with open(os.path.join(args.out, f"process{me}.json"), "w") as f:
    json.dump(ledger.to_dict(), f)
  log(f"done ({time.process_time():.1f} s of CPU)")
  return 0


if __name__ == "__main__":
  sys.exit(main())

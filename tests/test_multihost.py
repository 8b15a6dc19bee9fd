"""Multi-host for real: 2 processes × 2 CPU devices over loopback against one process.

Each test launches tests/multihost_worker.py twice as subprocesses that join
`jax.distributed` on 127.0.0.1 (gloo collectives, `jax_num_cpu_devices=2` each), so
the mesh spans 4 devices in 2 processes and every collective crosses a process
boundary. The references are computed here, in this single process, on one device:
`clipped_grad` on the unpadded Poisson batch and the optimizer (noise first) by hand.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import logit_dp
from helpers import reference_grad
from helpers import rel_err
from logit_dp import distributed
from logit_dp.ledger import PrivacyLedger

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)  # experiments.*

import multihost_worker as worker  # noqa: E402

NUM_PROCESSES = 2
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
LAUNCH_TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env():
  env = dict(os.environ)
  # conftest's 8 simulated devices dropped (the workers set 2 each), its other flags kept.
  flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  return env


class _Job:
  """The processes of one launch, with their logs in `log_dir`.

  ``command(i, coordinator)`` is the argv of process i; every process gets the same free
  loopback port for the coordinator.
  """
  def __init__(self, command, log_dir, tag):
    coordinator = f"127.0.0.1:{_free_port()}"
    self.logs = [os.path.join(log_dir, f"{tag}_process{i}.log") for i in range(NUM_PROCESSES)]
    self.procs = []
    for i, path in enumerate(self.logs):
      with open(path, "w") as log:
        self.procs.append(
            subprocess.Popen(command(i, coordinator), cwd=REPO, env=_env(), stdout=log,
                             stderr=subprocess.STDOUT))

  def output(self, tail: int = 4000) -> str:
    text = []
    for i, path in enumerate(self.logs):
      with open(path, errors="replace") as f:
        log = "".join(line for line in f if not line.startswith("[Gloo]"))
      text.append(f"--- process {i} (exit {self.procs[i].poll()}) ---\n{log[-tail:]}")
    return "\n".join(text)

  def wait(self, timeout: float = LAUNCH_TIMEOUT_S) -> list:
    deadline = time.monotonic() + timeout
    for p in self.procs:
      try:
        p.wait(timeout=max(deadline - time.monotonic(), 0.1))
      except subprocess.TimeoutExpired:
        self.kill()
        pytest.fail(f"the worker processes did not finish in {timeout} s:\n{self.output()}")
    return [p.returncode for p in self.procs]

  def kill(self):
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.wait()

  def expect_success(self, timeout: float = LAUNCH_TIMEOUT_S):
    codes = self.wait(timeout)
    assert codes == [0] * NUM_PROCESSES, f"worker exit codes {codes}:\n{self.output()}"


def _workers(out, log_dir, tag, **flags) -> _Job:
  """tests/multihost_worker.py on every process."""
  def command(i, coordinator):
    return [
        sys.executable,
        os.path.join(HERE, "multihost_worker.py"), f"--coordinator={coordinator}",
        f"--num_processes={NUM_PROCESSES}", f"--process_id={i}", f"--out={out}"
    ] + [f"--{k}={v}" for k, v in flags.items()]

  return _Job(command, log_dir, tag)


def _read(out):
  data = [dict(np.load(os.path.join(out, f"process{i}.npz"))) for i in range(NUM_PROCESSES)]
  ledgers = []
  for i in range(NUM_PROCESSES):
    with open(os.path.join(out, f"process{i}.json")) as f:
      ledgers.append(json.load(f))
  return data, ledgers


def _reference(noise_seed: int, sampler_seed: int, steps: int):
  """One process, one device: ḡ = clipped_grad on each unpadded Poisson batch, then tx.update."""
  import optax
  run = worker.problem(noise_seed, sampler_seed)
  tx, ledger, sampler = run["tx"], run["ledger"], run["sampler"]
  grad_fn = logit_dp.clipped_grad(run["embed_fn"], run["loss"], worker.CLIP_NORM)
  params, opt_state = run["params"], tx.init(run["params"])
  records = []
  for step in range(steps):
    batch = sampler(step)
    x, x_prime = run["x_all"][batch.indices], run["x_prime_all"][batch.indices]
    ledger.record_steps(1)
    loss_value, gbar = grad_fn(params, x, x_prime, batch.mask)
    updates, opt_state = tx.update(gbar, opt_state, params)
    records.append(
        dict(batch=batch, loss=float(loss_value), gbar=gbar, params_before=params,
             params=optax.apply_updates(params, updates), x=x, x_prime=x_prime))
    params = records[-1]["params"]
  return records, ledger, run


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(a)) for a in jax.tree.leaves(tree)])


def test_local_batch_indices_in_one_process_is_the_padded_batch():
  mesh = distributed.data_mesh(4)
  indices, mask = np.array([3, 8, 9, 0, 0], np.int32), np.array([1, 1, 1, 0, 0], bool)
  rows, local_mask = distributed.local_batch_indices(mesh, indices, mask)
  np.testing.assert_array_equal(rows, [3, 8, 9, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(local_mask, [1, 1, 1, 0, 0, 0, 0, 0])
  rows, local_mask = distributed.local_batch_indices(mesh, np.arange(4))
  np.testing.assert_array_equal(rows, np.arange(4))
  assert local_mask.all() and rows.dtype == np.int32
  with pytest.raises(ValueError, match="1-D"):
    distributed.local_batch_indices(mesh, np.zeros((2, 2), np.int32))
  with pytest.raises(ValueError, match="bool array of shape"):
    distributed.local_batch_indices(mesh, indices, np.ones(5, np.float32))
  with pytest.raises(ValueError, match="bool array of shape"):
    distributed.local_batch_indices(mesh, indices, np.ones(4, bool))


def test_broadcast_seed_in_one_process():
  assert distributed.broadcast_seed(2 ** 63 - 1) == 2 ** 63 - 1
  assert distributed.broadcast_seed(np.int64(5)) == 5
  drawn = {distributed.broadcast_seed() for _ in range(4)}
  assert len(drawn) == 4 and all(0 <= s < 2 ** 63 for s in drawn)
  for bad in (-1, 2 ** 63, 1.0, True, "3"):
    with pytest.raises(ValueError, match="seed must be an integer"):
      distributed.broadcast_seed(bad)


def test_initialize_distributed_needs_all_three_addresses():
  from experiments import train
  train.initialize_distributed()  # nothing given: one process, nothing to do
  for given in (dict(coordinator_address="127.0.0.1:1"), dict(num_processes=2, process_id=0)):
    with pytest.raises(ValueError, match="needs coordinator_address, num_processes and"):
      train.initialize_distributed(**given)
  assert jax.process_count() == 1


def test_pretrain_multiprocess_batch_is_the_single_process_batch():
  """train.local_batch + augment_rows (the multi-process step) give the rows that gather_pairs
  + pad_to_multiple (the single-process step on a mesh) give, augmentation included."""
  from experiments import train
  from experiments.configs import tiny
  config = tiny.get_config()
  config.pair_mode = "augment"
  rng = np.random.default_rng(0)
  x_train = rng.integers(0, 256, (30, 8, 8, 1), dtype=np.uint8)
  pairs = np.stack([np.arange(30), rng.permutation(30)], axis=1)
  idx = np.array([2, 5, 7, 11, 13, 17, 19, 23, 0, 0], np.int32)
  mask = np.arange(10) < 8
  mesh = distributed.data_mesh(4)
  key = jax.random.PRNGKey(3)
  want = train.gather_pairs(config, x_train, pairs, idx, key, 4)
  want_x, want_xp, want_mask = distributed.pad_to_multiple(*want, mask, 4)
  x, xp, got_mask = train.local_batch(config, x_train, pairs, idx, mask, mesh)
  x, xp = train.augment_rows(config, x, xp, key, 4, len(idx))
  assert x.shape == want_x.shape == (12, 8, 8, 1)
  np.testing.assert_array_equal(got_mask, want_mask)
  np.testing.assert_array_equal(np.asarray(x)[:10], np.asarray(want_x)[:10])
  np.testing.assert_array_equal(np.asarray(xp)[:10], np.asarray(want_xp)[:10])
  assert not np.array_equal(np.asarray(x)[:8], x_train[pairs[idx[:8], 0]] / 255.0)  # augmented


def test_two_processes_give_the_single_process_gradient_update_and_ledger(tmp_path):
  steps, seeds = 2, [2 ** 62 + 12345, 2 ** 40 + 7]
  with open(os.path.join(tmp_path, worker.SEED_FILE), "w") as f:
    json.dump(seeds, f)  # read by process 0 only; the others get them from broadcast_seed
  job = _workers(str(tmp_path), str(tmp_path), "check", steps=steps)
  records, ledger, run = _reference(*seeds, steps)  # meanwhile, in this process
  job.expect_success()
  data, ledgers = _read(str(tmp_path))
  for d in data:
    np.testing.assert_array_equal(d["seeds"], seeds)
  for path in job.logs:  # a noise key drawn per process is refused
    with open(path) as f:
      assert "replicate refused different values" in f.read(), job.output()
  for t, ref in enumerate(records):
    # each process loaded its own rows; together, in process order, the padded batch
    rows = np.concatenate([d["rows"][t] for d in data])
    padded = np.zeros(len(rows), np.int32)
    padded[:len(ref["batch"].indices)] = np.where(ref["batch"].mask, ref["batch"].indices, 0)
    np.testing.assert_array_equal(rows, padded)
    assert len(data[0]["rows"][t]) == len(data[1]["rows"][t]) == len(rows) // 2
    for d in data:
      assert d["step"][t] == t
      np.testing.assert_allclose(d["loss"][t], ref["loss"], rtol=1e-5)
      assert rel_err(d["gbar"][t], _flat(ref["gbar"])) < 1e-5
      # the noisy update: the same noise (same key) on the same ḡ
      np.testing.assert_allclose(d["params"][t], _flat(ref["params"]), rtol=1e-5, atol=1e-6)
  # the processes hold identical replicated values
  for k in ("gbar", "params", "loss"):
    np.testing.assert_array_equal(data[0][k], data[1][k])
  # clipping changed ḡ (B is below the pair norms): not the plain gradient
  first = records[0]
  _, plain = reference_grad(run["embed_fn"], run["loss"], first["params_before"], first["x"],
                            first["x_prime"], first["batch"].mask)
  assert rel_err(first["gbar"], plain) > 0.1
  assert ledgers[0] == ledgers[1] == ledger.to_dict()
  assert ledger.steps == steps
  assert PrivacyLedger.from_dict(ledgers[0]).epsilon() == ledger.epsilon()


def _checkpoint_steps(directory) -> list:
  """Finished orbax checkpoint steps (orbax renames a step's folder to its number when done)."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_process_is_survived_by_resuming_from_the_checkpoint(tmp_path, victim):
  steps, kill_after = 8, 3
  out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
  os.makedirs(out)
  job = _workers(out, str(tmp_path), "killed", steps=steps, checkpoint_dir=ckpt, step_delay=1.0)
  deadline = time.monotonic() + LAUNCH_TIMEOUT_S
  while not _checkpoint_steps(ckpt) or _checkpoint_steps(ckpt)[-1] < kill_after:
    if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
      job.kill()
      pytest.fail(f"no checkpoint of step {kill_after} before the kill:\n{job.output()}")
    time.sleep(0.05)
  job.procs[victim].send_signal(signal.SIGKILL)
  # The survivor stops too: jax.distributed sees the missing heartbeats and aborts it.
  codes = job.wait(timeout=120)
  assert codes[victim] == -signal.SIGKILL
  assert codes[1 - victim] != 0, f"the survivor finished alone:\n{job.output()}"
  interrupted_at = _checkpoint_steps(ckpt)[-1]
  assert kill_after <= interrupted_at < steps, job.output()
  assert not os.path.exists(os.path.join(out, "process0.npz"))

  resumed = _workers(out, str(tmp_path), "resumed", steps=steps, checkpoint_dir=ckpt)
  resumed.expect_success()
  assert f"resumed from step {interrupted_at}" in resumed.output(tail=10 ** 6), resumed.output()
  data, ledgers = _read(out)
  seeds = data[0]["seeds"]
  np.testing.assert_array_equal(data[1]["seeds"], seeds)
  records, ledger, _ = _reference(int(seeds[0]), int(seeds[1]), steps)
  for d in data:
    np.testing.assert_array_equal(d["step"], np.arange(interrupted_at, steps))
    for t, params in zip(d["step"], d["params"]):
      np.testing.assert_allclose(params, _flat(records[t]["params"]), rtol=1e-5, atol=1e-6)
  assert ledgers[0] == ledgers[1] == ledger.to_dict()
  assert ledger.steps == steps
  assert _checkpoint_steps(ckpt)[-1] == steps


_PRETRAIN_CONFIG = """
from experiments.configs import tiny


def get_config():
  config = tiny.get_config()
  config.privacy_seed = None  # secret seeds: process 0 draws them and shares them
  config.num_devices = {num_devices}
  return config
"""


def _pretrain_config(path, num_devices):
  with open(path, "w") as f:
    f.write(_PRETRAIN_CONFIG.format(num_devices=num_devices))
  return str(path)


@pytest.mark.slow
def test_pretrain_on_two_processes_matches_one_process_on_four_devices(tmp_path):
  """experiments/pretrain.py, tiny config, 2 processes × 2 devices: interrupted after 2 steps of
  every method, resumed, and compared with one process on 4 devices (same secret seeds)."""
  from experiments import finetuning
  from experiments import train
  from experiments.configs import tiny
  workdir = str(tmp_path / "run")
  config_path = _pretrain_config(tmp_path / "config_2proc.py", -1)

  def pretrain(*extra):
    def command(i, coordinator):
      return [
          sys.executable,
          os.path.join(REPO, "experiments", "pretrain.py"), f"--config={config_path}",
          f"--workdir={workdir}", f"--coordinator_address={coordinator}",
          f"--num_processes={NUM_PROCESSES}", f"--process_id={i}", "--local_device_count=2"
      ] + list(extra)

    return command

  first = _Job(pretrain("--config.stop_after_steps=2"), str(tmp_path), "first")
  first.expect_success()
  second = _Job(pretrain(), str(tmp_path), "second")
  second.expect_success()
  log = second.output(tail=10 ** 6)
  for method in tiny.get_config().methods:
    assert f"[{method}] resumed from step 2" in log, log
  with open(os.path.join(workdir, "results.json")) as f:
    results = json.load(f)
  # only process 0 prints (and writes) the results
  with open(second.logs[1]) as f:
    assert "results:" not in f.read()
  with open(second.logs[0]) as f:
    assert "results:" in f.read()

  # One process, 4 devices, the same seeds (process 0's secret file).
  import shutil
  reference_dir = str(tmp_path / "reference")
  shutil.copytree(workdir + ".secrets", reference_dir + ".secrets")
  import importlib.util
  spec = importlib.util.spec_from_file_location("config_1proc",
                                                _pretrain_config(tmp_path / "config_1proc.py", 4))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  reference = train.train_and_evaluate(module.get_config(), reference_dir, quiet=True)
  for method, ref in reference.items():
    got = results[method]
    assert got["finished"] and ref["finished"]
    assert got["steps"] == ref["steps"] == ref["total_steps"]
    assert got["epsilon"] == ref["epsilon"] and got["delta"] == ref["delta"]
    # as fine-tuning reads them, in one process
    params = finetuning.load_pretrained(workdir, method, finetuning.read_pretrain(workdir)[0])
    np.testing.assert_allclose(_flat(params), _flat(ref["params"]), rtol=1e-4, atol=1e-6)
    losses = [row["test_loss"] for row in got["history"]]
    np.testing.assert_allclose(losses, [row["test_loss"] for row in ref["history"]], rtol=1e-4)

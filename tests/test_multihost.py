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
from logit_dp.ledger import PrivacyLedger

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import multihost_worker as worker  # noqa: E402

NUM_PROCESSES = 2
LAUNCH_TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # conftest's 8 simulated devices: the workers set 2 each
  env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  return env


class _Job:
  """The worker processes of one launch, with their logs in `log_dir`."""

  def __init__(self, out, log_dir, tag, **flags):
    port = _free_port()
    self.logs = [os.path.join(log_dir, f"{tag}_process{i}.log") for i in range(NUM_PROCESSES)]
    self.procs = []
    for i, path in enumerate(self.logs):
      argv = [sys.executable, os.path.join(HERE, "multihost_worker.py"),
              f"--coordinator=127.0.0.1:{port}", f"--num_processes={NUM_PROCESSES}",
              f"--process_id={i}", f"--out={out}"] + [f"--{k}={v}" for k, v in flags.items()]
      with open(path, "w") as log:
        self.procs.append(
            subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT))

  def output(self, tail: int = 3000) -> str:
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


def test_two_processes_give_the_single_process_gradient_update_and_ledger(tmp_path):
  steps, seeds = 2, [2**62 + 12345, 2**40 + 7]
  with open(os.path.join(tmp_path, worker.SEED_FILE), "w") as f:
    json.dump(seeds, f)  # read by process 0 only; the others get them from broadcast_seed
  job = _Job(str(tmp_path), str(tmp_path), "check", steps=steps)
  records, ledger, run = _reference(*seeds, steps)  # meanwhile, in this process
  job.expect_success()
  data, ledgers = _read(str(tmp_path))
  for d in data:
    np.testing.assert_array_equal(d["seeds"], seeds)
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
  job = _Job(out, str(tmp_path), "killed", steps=steps, checkpoint_dir=ckpt, step_delay=1.0)
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

  resumed = _Job(out, str(tmp_path), "resumed", steps=steps, checkpoint_dir=ckpt)
  resumed.expect_success()
  assert f"resumed from step {interrupted_at}" in resumed.output(), resumed.output()
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

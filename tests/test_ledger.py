"""logit_dp.ledger: ε reporting, budget refusal, serialisation, and a
kill-and-resume run through orbax checkpoints with logit_dp.transform."""

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logit_dp
from logit_dp import accounting
from logit_dp import ledger as ledger_lib
from logit_dp import sampling
from logit_dp.ledger import PrivacyBudgetExceededError
from logit_dp.ledger import PrivacyLedger

# ----------------------------------------------------------------------------
# The ledger itself.
# ----------------------------------------------------------------------------


def test_epsilon_matches_accounting():
  led = PrivacyLedger(noise_multiplier=1.1, sampling_rate=0.01, target_delta=1e-5)
  assert led.epsilon() == 0.0 and led.steps == 0
  assert led.record_steps(100) == led.epsilon()
  assert led.steps == 100
  assert led.epsilon() == accounting.epsilon(1.1, 1e-5, 0.01, 100, "pld")
  led.record_steps(50)
  assert led.epsilon() == accounting.epsilon(1.1, 1e-5, 0.01, 150, "pld")
  assert led.epsilon(steps=10) == accounting.epsilon(1.1, 1e-5, 0.01, 10, "pld")
  rdp = PrivacyLedger(1.1, 0.01, 1e-5, accountant="rdp", steps=150)
  assert rdp.epsilon() == accounting.epsilon(1.1, 1e-5, 0.01, 150, "rdp") >= led.epsilon()
  assert led.delta() == 1e-5 and led.guarantee() == (led.epsilon(), 1e-5)
  assert "150 steps" in str(led)


def test_refuses_to_exceed_budget():
  sigma, q, delta, budget = 1.0, 0.02, 1e-5, 1.0
  limit = accounting.max_steps(sigma, budget, delta, q)
  assert limit > 5
  led = PrivacyLedger(sigma, q, delta, epsilon_budget=budget)
  assert led.remaining_steps() == limit
  led.record_steps(limit - 2)
  led.record_steps(2)  # exactly at the limit: allowed
  assert led.epsilon() <= budget and led.remaining_steps() == 0
  with pytest.raises(PrivacyBudgetExceededError, match="budget"):
    led.record_steps(1)
  assert issubclass(PrivacyBudgetExceededError, ValueError)
  assert led.steps == limit  # nothing recorded on refusal
  assert led.record_steps(1, allow_exceeding_budget=True) > budget
  assert led.steps == limit + 1
  # Refusal is decided before the step: a big jump is refused as a whole.
  fresh = PrivacyLedger(sigma, q, delta, epsilon_budget=budget)
  with pytest.raises(PrivacyBudgetExceededError):
    fresh.record_steps(limit + 1)
  assert fresh.steps == 0
  assert PrivacyLedger(sigma, q, delta).remaining_steps() is None


def test_serialisation_round_trip():
  led = PrivacyLedger(0.9, 0.02, 2e-6, accountant="rdp", steps=17, epsilon_budget=4.0,
                      num_examples=50_000, overflow_probability=1e-12, released_updates=16)
  data = json.loads(json.dumps(led.to_dict()))
  assert data["format_version"] == ledger_lib.LEDGER_FORMAT_VERSION
  back = PrivacyLedger.from_dict(data)
  assert back == led and back.epsilon() == led.epsilon() and back.released_updates == 16
  # A ledger saved before it counted released updates (format 1) reads with none.
  version_1 = {k: v for k, v in data.items() if k != "released_updates"}
  old = PrivacyLedger.from_dict({**version_1, "format_version": 1})
  assert old.released_updates == 0 and old.steps == 17
  with pytest.raises(ValueError, match="released_updates must be an integer"):
    PrivacyLedger(0.9, 0.02, 2e-6, released_updates=-1)
  with pytest.raises(ValueError, match="Unknown ledger fields"):
    PrivacyLedger.from_dict({**data, "seed": 3})
  with pytest.raises(ValueError, match="format_version"):
    PrivacyLedger.from_dict({**data, "format_version": 99})


def test_overflow_probability_adds_to_delta():
  n, q = 50_000, 0.02
  sampler = sampling.PoissonSampler(n, q)
  led = PrivacyLedger.for_sampler(sampler, 0.9, 1e-5, steps=1000)
  assert led.sampling_rate == q and led.num_examples == n
  assert led.overflow_probability == sampler.step_overflow_probability > 0
  eps, dlt = led.guarantee()
  assert dlt == pytest.approx(1e-5 + sampler.overflow_delta(1000, eps), rel=1e-9)
  assert 1e-5 < dlt < 1e-5 + 2e-7


@pytest.mark.parametrize("kwargs", [
    dict(noise_multiplier=0.0),
    dict(noise_multiplier=-1.0),
    dict(sampling_rate=0.0),
    dict(sampling_rate=2.0),
    dict(target_delta=1.0),
    dict(accountant="moments"),
    dict(steps=-1),
    dict(epsilon_budget=0.0),
    dict(num_examples=0),
    dict(overflow_probability=1.0),
])
def test_rejects_bad_input(kwargs):
  args = dict(noise_multiplier=1.0, sampling_rate=0.01, target_delta=1e-5)
  args.update(kwargs)
  with pytest.raises(ValueError):
    PrivacyLedger(**args)


def test_warns_when_delta_at_least_one_over_n():
  with pytest.warns(UserWarning, match="1/N"):
    PrivacyLedger(1.0, 0.01, 1e-3, num_examples=1000)


# ----------------------------------------------------------------------------
# Kill and resume: a tiny Logit-DP run checkpointed with orbax.
# ----------------------------------------------------------------------------

N_RECORDS, RATE, SIGMA, DELTA, CLIP, MAX_BATCH = 32, 0.25, 1.5, 1e-5, 1.0, 20


def _embed(params, x):
  return jnp.tanh(x @ params["w1"]) @ params["w2"]


@functools.cache
def _setup():
  """Builds the data, model, optimizer, sampler and jitted step of a run.

  Cached so the step is compiled once per process; a resumed run's state and
  ledger are nevertheless fresh objects restored from disk, and
  `test_sigkilled_process_resumes_exactly` rebuilds everything in a new process.
  """
  kx, kp, kw1, kw2 = jax.random.split(jax.random.PRNGKey(0), 4)
  x = jax.random.normal(kx, (N_RECORDS, 4))
  x_prime = x + 0.3 * jax.random.normal(kp, x.shape)
  params = {"w1": 0.5 * jax.random.normal(kw1, (4, 8)), "w2": 0.5 * jax.random.normal(kw2, (8, 3))}
  loss = logit_dp.losses.contrastive(temperature=0.5)
  grad_fn = logit_dp.clipped_grad(_embed, loss, clip_norm=CLIP)
  noise_tx = logit_dp.transform(SIGMA, logit_dp.sensitivity(loss, CLIP, batch_size=None),
                                key=jax.random.PRNGKey(42))
  tx = optax.chain(noise_tx, optax.adam(1e-2))
  sampler = sampling.PoissonSampler(N_RECORDS, RATE, max_batch_size=MAX_BATCH, seed=5)

  @jax.jit
  def train_step(state, indices, mask):
    _, grads = grad_fn(state["params"], x[indices], x_prime[indices], mask)
    # The noise of this step, drawn exactly as the chain draws it.
    noise, _ = noise_tx.update(jax.tree_util.tree_map(jnp.zeros_like, grads), state["opt_state"][0])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, noise

  init = {"params": params, "opt_state": tx.init(params)}
  return init, train_step, sampler


def _train(ckpt_dir, total_steps, *, epsilon_budget=None, kill_after_step=None, save_every=3):
  """Resumes from the newest checkpoint in ckpt_dir (if any) and trains to total_steps.

  Checkpoints every `save_every` steps and at the end. Returns (state, ledger,
  {step: noise}). With kill_after_step=k the process SIGKILLs itself right
  after computing step k (before any checkpoint of it).
  """
  state, train_step, sampler = _setup()
  if ledger_lib.latest_step(ckpt_dir) is not None:
    state, led, step = ledger_lib.restore_checkpoint(ckpt_dir, state)
    assert step == led.steps == int(state["opt_state"][0].count)
  else:
    led = PrivacyLedger(SIGMA, RATE, DELTA, epsilon_budget=epsilon_budget, num_examples=N_RECORDS,
                        overflow_probability=sampler.step_overflow_probability)
  noises = {}
  while led.steps < total_steps:
    t = led.steps
    batch = sampler(t)
    led.record_steps(1)  # refuses before the update is made
    state, noises[t] = train_step(state, batch.indices, batch.mask)
    if kill_after_step == t + 1:
      os.kill(os.getpid(), signal.SIGKILL)
    if (t + 1) % save_every == 0 or t + 1 == total_steps:
      ledger_lib.save_checkpoint(ckpt_dir, t + 1, state, led, max_to_keep=2)
  return state, led, noises


def _assert_same_tree(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_kill_and_resume_reports_the_same_epsilon_and_noise(tmp_path):
  state_a, led_a, noise_a = _train(str(tmp_path / "a"), 6)
  _, led_b1, noise_b1 = _train(str(tmp_path / "b"), 3)
  assert led_b1.steps == 3 and led_b1.epsilon() == led_a.epsilon(3)
  # Resume: state, optimizer state (noise count and key) and ledger come from disk.
  state_b, led_b, noise_b2 = _train(str(tmp_path / "b"), 6)
  assert sorted(noise_b2) == [3, 4, 5]
  assert led_b.steps == led_a.steps == 6
  assert led_b.epsilon() == led_a.epsilon() == accounting.epsilon(SIGMA, DELTA, RATE, 6)
  assert led_b == led_a
  _assert_same_tree(state_b, state_a)  # bitwise identical run
  for t in range(3):
    _assert_same_tree(noise_b1[t], noise_a[t])
  for t in (3, 4, 5):
    _assert_same_tree(noise_b2[t], noise_a[t])  # steps 4–6 draw A's noise...
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(noise_a[t])])
  for s in range(6):  # ...and no two steps share a draw.
    for t in range(s):
      assert not np.allclose(flat(s), flat(t))
  assert int(state_b["opt_state"][0].count) == 6


def test_run_refuses_to_continue_past_budget(tmp_path):
  budget = accounting.epsilon(SIGMA, DELTA, RATE, 4)
  state, led, _ = _train(str(tmp_path / "c"), 4, epsilon_budget=budget)
  with pytest.raises(PrivacyBudgetExceededError):
    _train(str(tmp_path / "c"), 6)
  # Nothing beyond step 4 was taken or saved; the budget survives the restart.
  assert ledger_lib.latest_step(str(tmp_path / "c")) == 4
  restored_state, restored, _ = ledger_lib.restore_checkpoint(str(tmp_path / "c"), state)
  assert restored.epsilon_budget == budget and restored.steps == 4
  _assert_same_tree(restored_state, state)
  restored.record_steps(1, allow_exceeding_budget=True)
  assert restored.epsilon() > budget


_WORKER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests_dir!r})
    import test_ledger
    test_ledger._train({ckpt!r}, 6, kill_after_step=5)
    """)


@pytest.mark.slow  # a second Python process: imports and compiles again (~10 s)
def test_sigkilled_process_resumes_exactly(tmp_path):
  """A real process is SIGKILLed after computing steps 4 and 5 but before
  checkpointing them; a fresh process resumes from checkpoint 3, redoes steps
  4–5 with the same batches and the same noise keys (re-releasing an identical
  update costs no privacy), and ends exactly where an uninterrupted run ends."""
  ckpt = str(tmp_path / "killed")
  code = _WORKER.format(tests_dir=os.path.dirname(os.path.abspath(__file__)), ckpt=ckpt)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                        env=dict(os.environ))
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  assert ledger_lib.latest_step(ckpt) == 3
  state_b, led_b, noise_b = _train(ckpt, 6)
  state_a, led_a, noise_a = _train(str(tmp_path / "straight"), 6)
  assert led_b.epsilon() == led_a.epsilon() and led_b.steps == 6
  for t in (3, 4, 5):
    _assert_same_tree(noise_b[t], noise_a[t])
  for x, y in zip(jax.tree_util.tree_leaves(state_b), jax.tree_util.tree_leaves(state_a)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_checkpoint_keeps_the_sampler_with_the_ledger(tmp_path):
  sampler = sampling.PoissonSampler(num_records=300, sampling_rate=0.05, seed=12345,
                                    overflow="truncate")
  led = PrivacyLedger.for_sampler(sampler, SIGMA, DELTA, steps=3)
  state = {"w": jnp.arange(3.0)}
  ledger_lib.save_checkpoint(str(tmp_path), 3, state, led)  # without a sampler
  assert ledger_lib.restore_sampler(str(tmp_path)) is None
  budgeted = logit_dp.ledger.BudgetedSampler.bind(sampler, led)
  ledger_lib.save_checkpoint(str(tmp_path), 4, state, led, sampler=budgeted)
  restored = ledger_lib.restore_sampler(str(tmp_path))
  assert restored == sampler and type(restored) is sampling.PoissonSampler
  np.testing.assert_array_equal(restored(7).indices, sampler(7).indices)
  assert ledger_lib.restore_sampler(str(tmp_path), step=3) is None
  _, restored_ledger, step = ledger_lib.restore_checkpoint(str(tmp_path), state)
  assert step == 4 and restored_ledger == led
  with pytest.raises(TypeError, match="PoissonSampler"):
    ledger_lib.save_checkpoint(str(tmp_path), 5, state, led, sampler=object())
  with pytest.raises(FileNotFoundError):
    ledger_lib.restore_sampler(str(tmp_path / "missing"))


def test_budgeted_sampler_refuses_past_the_budget_and_records_nothing():
  sampler = sampling.PoissonSampler(num_records=300, sampling_rate=0.05, seed=3)
  budget = accounting.epsilon(SIGMA, DELTA, 0.05, 4)
  led = PrivacyLedger.for_sampler(sampler, SIGMA, DELTA, epsilon_budget=budget)
  budgeted = logit_dp.ledger.BudgetedSampler.bind(sampler, led)
  for t in range(4):
    np.testing.assert_array_equal(budgeted(t).indices, sampler(t).indices)
  with pytest.raises(PrivacyBudgetExceededError, match="step 5"):
    budgeted(4)
  assert led.steps == 0
  unlimited = logit_dp.ledger.BudgetedSampler.bind(sampler,
                                                   PrivacyLedger.for_sampler(sampler, SIGMA, DELTA))
  np.testing.assert_array_equal(unlimited(100).indices, sampler(100).indices)
  with pytest.raises(TypeError, match="PrivacyLedger"):
    logit_dp.ledger.BudgetedSampler(num_records=300, sampling_rate=0.05)
  with pytest.raises(ValueError, match="step must be"):
    budgeted(-1)


def _count_accountant_runs(monkeypatch) -> list[int]:
  """The step counts of every ε the ledger computes from now on (a list that fills up)."""
  from logit_dp._src import ledger as ledger_src
  calls = []
  epsilon = ledger_src.accounting.epsilon

  def counting(*args, **kwargs):
    calls.append(args[3])  # the number of steps
    return epsilon(*args, **kwargs)

  monkeypatch.setattr(ledger_src.accounting, "epsilon", counting)
  return calls


def test_check_budgets_accounts_once_per_new_maximum(monkeypatch):
  calls = _count_accountant_runs(monkeypatch)
  ledger = PrivacyLedger(noise_multiplier=1.2345, sampling_rate=0.01, target_delta=1e-5,
                         accountant="rdp")
  budget = accounting.epsilon(1.2345, 1e-5, 0.01, 50, "rdp")
  ledger.epsilon_budget = budget
  ledger.check_budgets(50)
  for t in (1, 10, 49, 50):  # fewer steps than a count within the budget: within it too
    ledger.check_budgets(t)
  assert calls == [50]
  with pytest.raises(PrivacyBudgetExceededError):
    ledger.check_budgets(51)
  ledger.epsilon_budget = accounting.epsilon(1.2345, 1e-5, 0.01, 20, "rdp")  # another budget
  with pytest.raises(PrivacyBudgetExceededError):
    ledger.check_budgets(30)
  with pytest.raises(ValueError, match="steps"):
    ledger.check_budgets(-1)


def test_a_calibrated_ledger_checks_its_planned_steps_without_accounting_again(monkeypatch):
  """`calibrated` checks the budgets at T once (with the calibration's own ε(T)), so the
  checks of steps 1, …, T run no accountant; a step past T is accounted for and refused."""
  from logit_dp._src import ledger as ledger_src
  monkeypatch.setattr(ledger_src, "_WITHIN_BUDGET", {})  # as in a fresh process
  calls = _count_accountant_runs(monkeypatch)
  sampler = sampling.PoissonSampler(num_records=300, sampling_rate=0.05, seed=3)
  ledger = PrivacyLedger.calibrated(sampler, 2.0, 1e-5, 40)
  calls.clear()
  for t in range(1, 41):
    ledger.check_budgets(t)
  assert calls == []
  past = next(t for t in range(41, 10_000)
              if accounting.epsilon(ledger.noise_multiplier, ledger.target_delta, 0.05, t) > 2.0)
  calls.clear()
  with pytest.raises(PrivacyBudgetExceededError):
    ledger.check_budgets(past)
  assert calls == [past]


def test_a_refused_restore_leaves_no_failed_reads_behind(tmp_path):
  """A restore refused for other shapes leaves no suspended orbax reads that would print
  "Exception ignored ... Encountered error while reading array index" when collected later."""
  import gc
  import sys
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  adam = optax.adam(1e-3)
  ledger_lib.save_checkpoint(str(tmp_path), 1, (params, adam.init(params)),
                             PrivacyLedger(SIGMA, RATE, DELTA))
  wider = {"w": jnp.ones((3, 5)), "b": jnp.zeros(5)}
  with pytest.raises(ValueError, match="differs from the template"):
    ledger_lib.restore_checkpoint(str(tmp_path), (wider, adam.init(wider)))
  reported, hook = [], sys.unraisablehook
  sys.unraisablehook = reported.append
  try:
    gc.collect()
  finally:
    sys.unraisablehook = hook
  assert not [r for r in reported if "read_array_index" in repr(r.object)], reported


def test_restore_says_which_checkpoint_is_missing_and_what_differs(tmp_path):
  """The low-level restore: a directory that does not exist, one without a checkpoint and a
  missing step are told apart; a template of another optimizer chain or other shapes is
  refused with the differing leaves named (not orbax's advice to restore part of the state)."""
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  led = PrivacyLedger(SIGMA, RATE, DELTA)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    ledger_lib.restore_checkpoint(str(tmp_path / "typo"), params)
  with pytest.raises(FileNotFoundError, match="exists but holds no checkpoint"):
    ledger_lib.restore_checkpoint(str(tmp_path), params)
  adam = optax.adam(1e-3)
  ledger_lib.save_checkpoint(str(tmp_path), 2, (params, adam.init(params)), led)
  with pytest.raises(FileNotFoundError, match=r"No checkpoint 3 .* holds steps \[2\]"):
    ledger_lib.restore_checkpoint(str(tmp_path), params, step=3)
  sgd = optax.sgd(0.1, momentum=0.9)
  with pytest.raises(ValueError, match="differs from the template") as refused:
    ledger_lib.restore_checkpoint(str(tmp_path), (params, sgd.init(params)))
  message = str(refused.value)
  assert "partial_restore" not in message
  for name in ("1.0.count", "1.0.mu.w", "1.0.nu.b"):
    assert f"{name}: in the checkpoint, not in the template" in message
  assert "1.0.trace.w: in the template, not in the checkpoint" in message
  wider = {"w": jnp.ones((3, 5)), "b": jnp.zeros(5)}
  with pytest.raises(ValueError, match=r"0\.w: shape \(3, 5\) in the template, \(3, 2\)"):
    ledger_lib.restore_checkpoint(str(tmp_path), (wider, adam.init(wider)))
  state, restored, step = ledger_lib.restore_checkpoint(str(tmp_path), (params, adam.init(params)))
  assert step == 2 and restored == led

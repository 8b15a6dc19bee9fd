"""Learning-rate schedules of experiments/train.py (config.lr_schedule)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logit_dp
from experiments import train
from experiments.configs import tiny
from helpers import save_config_started_before

METHODS = ("logit_dp", "naive_dp", "dp_gcl", "non_private")


def _config(schedule="constant", **kw):
  cfg = tiny.get_config()
  cfg.noise_multiplier = 1.0  # σ fixed: the accountant is not what is tested here
  cfg.lr_schedule = schedule
  for k, v in kw.items():
    cfg[k] = v
  return cfg


def _numpy_schedule(kind, lr, steps, final, warmup):
  """η_t written out from the definition, independently of optax."""
  t = np.arange(steps, dtype=np.float64)
  if kind == "constant":
    return np.full(steps, lr)
  start = warmup if kind == "warmup_cosine" else 0
  cos = lr * (final + (1 - final) * 0.5 * (1 + np.cos(math.pi * (t - start) / (steps - start))))
  if kind == "cosine":
    return cos
  return np.where(t < warmup, lr * (t + 1) / warmup, cos)


def _updates(tx, grads_seq, params):
  state = tx.init(params)
  out = []
  for g in grads_seq:
    u, state = tx.update(g, state, params)
    out.append(u)
  return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["cosine", "warmup_cosine"])
@pytest.mark.slow
def test_adam_step_sizes_follow_the_schedule(method, kind):
  """Same gradients (and noise key) through the scheduled and the constant-lr optimizer: the
  updates differ by the factor η_t / η, the schedule's value at the global step t."""
  extra = dict(lr_final_fraction=0.1)
  if kind == "warmup_cosine":
    extra["lr_warmup_steps"] = 2
  sched_cfg, const_cfg = _config(kind, **extra), _config("constant")
  _, apply_fn, _, init_fn = train.get_model(sched_cfg.model)
  params = init_fn(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
  key = jax.random.PRNGKey(3)
  _, tx, info = train.make_method(sched_cfg, method, apply_fn, 150, key)
  _, tx_const, info_const = train.make_method(const_cfg, method, apply_fn, 150, key)
  steps = info["steps"]
  assert steps == info_const["steps"] >= 4
  rng = np.random.default_rng(0)
  grads_seq = [
      jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
      for _ in range(steps)
  ]
  lr = train.learning_rate(sched_cfg, method)
  want = _numpy_schedule(kind, lr, steps, 0.1, extra.get("lr_warmup_steps", 0))
  if kind == "cosine":
    np.testing.assert_allclose(
        want, [float(optax.cosine_decay_schedule(lr, steps, alpha=0.1)(t)) for t in range(steps)],
        rtol=1e-6)
  for t, (u, uc) in enumerate(
      zip(_updates(tx, grads_seq, params), _updates(tx_const, grads_seq, params))):
    for a, b in zip(jax.tree_util.tree_leaves(u), jax.tree_util.tree_leaves(uc)):
      np.testing.assert_allclose(np.asarray(a),
                                 np.asarray(b) * want[t] / lr, rtol=2e-5, atol=1e-12,
                                 err_msg=f"{method} step {t}")


@pytest.mark.parametrize("method", ["logit_dp", "non_private"])
def test_constant_schedule_is_the_optimizer_without_a_schedule(method):
  """lr_schedule='constant' builds exactly the optimizer of before (same state, same updates)."""
  cfg = _config("constant")
  _, apply_fn, _, init_fn = train.get_model(cfg.model)
  params = init_fn(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
  key = jax.random.PRNGKey(3)
  _, tx, info = train.make_method(cfg, method, apply_fn, 150, key)
  lr, batch = train.learning_rate(cfg, method), cfg.batch_size
  if method == "non_private":
    before = optax.chain(optax.scale(1.0 / batch), optax.adam(lr))
  else:
    before = optax.chain(
        logit_dp.transform(noise_multiplier=1.0, sensitivity=info["sensitivity"], key=key),
        optax.scale(1.0 / batch), optax.adam(lr))
  assert (jax.tree_util.tree_structure(tx.init(params)) == jax.tree_util.tree_structure(
      before.init(params)))
  rng = np.random.default_rng(1)
  grads_seq = [
      jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
      for _ in range(3)
  ]
  for u, v in zip(_updates(tx, grads_seq, params), _updates(before, grads_seq, params)):
    for a, b in zip(jax.tree_util.tree_leaves(u), jax.tree_util.tree_leaves(v)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # three tiny runs; test_experiments resumes a run (optimizer state) by default
@pytest.mark.parametrize("method", ["logit_dp", "non_private"])
def test_resumed_run_continues_the_schedule(tmp_path, method):
  """Interrupted after 2 updates (inside the warm-up) and resumed = uninterrupted, params bit
  for bit: the schedule's count is restored with the optimizer state."""
  cfg = _config("warmup_cosine", lr_warmup_steps=2, lr_final_fraction=0.0)
  cfg.methods = (method,)
  cfg.linear_probe = False
  ref = train.train_and_evaluate(cfg, str(tmp_path / "ref"), quiet=True)[method]
  cfg.stop_after_steps = 2
  first = train.train_and_evaluate(cfg, str(tmp_path / "resumed"), quiet=True)[method]
  assert not first["finished"] and first["steps"] == 2
  cfg.stop_after_steps = None
  second = train.train_and_evaluate(cfg, str(tmp_path / "resumed"), quiet=True)[method]
  assert second["finished"] and second["steps"] == ref["steps"] > 2
  for a, b in zip(jax.tree_util.tree_leaves(second["params"]),
                  jax.tree_util.tree_leaves(ref["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_schedule_settings_raise():
  _, apply_fn, _, _ = train.get_model(tiny.get_config().model)
  key = jax.random.PRNGKey(0)
  for bad in (dict(lr_schedule="linear"), dict(lr_schedule="cosine", lr_final_fraction=1.5),
              dict(lr_schedule="cosine",
                   lr_warmup_steps=3), dict(lr_schedule="warmup_cosine", lr_warmup_steps=0),
              dict(lr_schedule="warmup_cosine", lr_warmup_steps=10_000)):
    cfg = _config(**bad)
    with pytest.raises(ValueError, match="lr_"):
      train.make_method(cfg, "logit_dp", apply_fn, 150, key)


def test_a_run_started_before_the_schedule_fields_resumes(tmp_path):
  """A config.json without lr_schedule (older runs) is the constant schedule, nothing else."""
  cfg = tiny.get_config()
  save_config_started_before(cfg, tmp_path, "lr_schedule", "lr_final_fraction", "lr_warmup_steps")
  train.check_resumable(cfg, str(tmp_path))
  cfg.lr_schedule = "cosine"
  with pytest.raises(ValueError, match="different training config"):
    train.check_resumable(cfg, str(tmp_path))

"""bfloat16 and float16 params and inputs: clipped in float32, checked against float64.

The model is evaluated with its params and inputs widened to float32 (`precision.widen`); the
float64 reference evaluates the same model from the same (exactly widened) values, forms every
pair gradient by jax.grad and clips it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logit_dp
from conftest import MLP
from helpers import float64_clipped_reference
from helpers import rel_err
from logit_dp._src import checks
from logit_dp._src import precision

N = 8
LOSS = logit_dp.losses.contrastive(temperature=1.0)
CLIP_NORM = 0.05


def _problem(dtype):
  model = MLP(features=(16, 6))
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
  x = jax.random.normal(k1, (N, 7))
  x_prime = x + 0.3 * jax.random.normal(k2, (N, 7))
  reference = jax.random.normal(k4, (4, 7))
  low = lambda t: jax.tree_util.tree_map(lambda a: a.astype(dtype), t)
  return model.apply, low(model.init(k3, x[:1])), low(x), low(x_prime), low(reference)


def test_low_precision_inputs_are_accepted_and_widened():
  for dtype in (jnp.bfloat16, jnp.float16):
    x, _, _ = checks.check_pairs(jnp.ones((3, 2), dtype), jnp.ones((3, 2), dtype))
    assert x.dtype == dtype
    widened = precision.widen(
        {"a": jnp.ones(2, dtype), "b": jnp.ones(2, jnp.int32), "c": jnp.ones(2, jnp.float32)})
    assert widened["a"].dtype == jnp.float32 and widened["b"].dtype == jnp.int32
  with pytest.raises(ValueError, match="must hold numbers"):
    checks.check_pairs(jnp.ones((3, 2), jnp.complex64), jnp.ones((3, 2)))


# The default run keeps ghost in bfloat16; the rest is slow.
@pytest.mark.parametrize("method,dtype", [
    pytest.param(method, dtype, marks=() if
                 (method, dtype) == ("ghost", jnp.bfloat16) else pytest.mark.slow,
                 id=f"{method}-{jnp.dtype(dtype).name}") for method in logit_dp.clip_methods.METHODS
    for dtype in (jnp.bfloat16, jnp.float16)
])
@pytest.mark.slow
def test_low_precision_model_is_clipped_in_float32_against_float64(method, dtype):
  """Every pair's clip norm is ≥ its float64 norm (so each clipped pair gradient has norm ≤ B),
  and ḡ is the float64 sum clipped by those norms to float32 accuracy, returned in float32."""
  embed_fn, params, x, x_prime, reference = _problem(dtype)
  if method == "projected":
    method = logit_dp.clip_methods.Projected(reference_inputs=reference, rank=16)
  norms = np.asarray(logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, method),
                     np.float64)
  loss_value, grads = logit_dp.clipped_grad(embed_fn, LOSS, CLIP_NORM, method)(params, x, x_prime)
  with jax.enable_x64(True):
    truth, reference_grads = float64_clipped_reference(embed_fn, LOSS, params, x, x_prime,
                                                       CLIP_NORM, clip_by=norms)
  assert np.mean(truth > CLIP_NORM) > 0.5  # clipping is active
  assert np.all(norms >= truth * (1 - 2.0 ** -23)), np.min(norms / truth)
  assert np.all(np.minimum(1.0, CLIP_NORM / norms) * truth <= CLIP_NORM * (1 + 2.0 ** -23))
  assert loss_value.dtype == jnp.float32
  assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))
  assert rel_err(grads, reference_grads) < 1e-5


@pytest.mark.slow  # two jitted private steps; clipped_grad's dtypes are tested by default above
def test_make_private_trains_bfloat16_params_and_returns_them_in_bfloat16():
  """The noise is added to the float32 ḡ; the update is cast to bfloat16 by optax.apply_updates
  after it (post-processing)."""
  embed_fn, params, x, x_prime, _ = _problem(jnp.bfloat16)
  pt = logit_dp.make_private(embed_fn, LOSS, 1.0, target_epsilon=4.0, target_delta=1e-5,
                             num_records=1000, expected_batch_size=N, optimizer=optax.adam(1e-2),
                             steps=10, noise_key=jax.random.key(0), sampler_seed=0)
  step = pt.make_train_step()
  opt_state = pt.optimizer.init(params)
  new = params
  for _ in range(2):
    pt.ledger.record_steps(1)
    new, opt_state, loss_value = step(new, opt_state, x, x_prime, np.ones(x.shape[0], bool))
  assert all(a.dtype == jnp.bfloat16 for a in jax.tree_util.tree_leaves(new))
  assert all(np.all(np.isfinite(np.asarray(a, np.float32))) for a in jax.tree_util.tree_leaves(new))
  assert rel_err(new, params) > 0
  assert np.isfinite(float(loss_value))


@pytest.mark.extended
def test_dp_gcl_evaluates_a_bfloat16_model_in_float32():
  """DP-GCL widens like clipped_grad: bfloat16 params and inputs give exactly the result of the
  same values cast to float32 first (the cast is exact), in float32."""
  embed_fn, params, x, x_prime, _ = _problem(jnp.bfloat16)
  grad_fn = logit_dp.baselines.grouped_clipped_grad(embed_fn, logit_dp.losses.contrastive(1.0), 0.1,
                                                    num_groups=2)
  kwargs = dict(record_ids=jnp.arange(N), group_key=jax.random.PRNGKey(1))
  loss_low, grads_low = grad_fn(params, x, x_prime, **kwargs)
  wide = lambda t: jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), t)
  loss_wide, grads_wide = grad_fn(wide(params), wide(x), wide(x_prime), **kwargs)
  assert loss_low.dtype == jnp.float32 and loss_low == loss_wide
  for low, ref in zip(jax.tree_util.tree_leaves(grads_low), jax.tree_util.tree_leaves(grads_wide)):
    assert low.dtype == jnp.float32
    np.testing.assert_array_equal(low, ref)

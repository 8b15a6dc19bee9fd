"""Loud failures instead of silent ones: no-noise "private" steps, batch-mixing models, NaN
parameters under jit, bad masks, keys and input shapes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logit_dp
from conftest import make_model
from helpers import flat
from helpers import rel_err
from logit_dp import distributed
from logit_dp._src import checks

LOSS = logit_dp.losses.contrastive(temperature=1.0)
KEY = jax.random.key(0)


def _mesh():
  return distributed.data_mesh(2)


def test_private_train_step_refuses_an_optimizer_without_the_noise():
  embed_fn, params, x, x_prime = make_model("mlp", n=4)
  step = distributed.make_private_train_step(embed_fn, LOSS, 1.0, _mesh(), optax.adam(1e-3))
  with pytest.raises(ValueError, match="Logit-DP noise"):
    step(params, optax.adam(1e-3).init(params), x, x_prime)
  # Noise after another transformation is not the mechanism either.
  late = optax.chain(optax.scale(0.5), logit_dp.transform(1.0, 1.0, KEY))
  step = distributed.make_private_train_step(embed_fn, LOSS, 1.0, _mesh(), late)
  with pytest.raises(ValueError, match="Logit-DP noise"):
    step(params, late.init(params), x, x_prime)


# Slow: the sharded step's noisy update is compared with one device by test_distributed and
# the noise's std with σC by test_noise by default.
@pytest.mark.slow
def test_private_train_step_accepts_the_noise_first_and_an_explicit_non_private_opt_in():
  embed_fn, params, x, x_prime = make_model("mlp", n=4)
  sigma, c = 1.0, logit_dp.sensitivity(LOSS, clip_norm=1.0)
  tx = distributed.make_private_optimizer(sigma, c, KEY, optax.sgd(1.0))
  step = distributed.make_private_train_step(embed_fn, LOSS, 1.0, _mesh(), tx)
  new_params, _, _ = step(params, tx.init(params), x, x_prime)
  _, clipped = logit_dp.clipped_grad(embed_fn, LOSS, 1.0)(params, x, x_prime)
  # The update is -(ḡ + noise): its distance from -ḡ is noise of std σC per coordinate.
  residual = flat(new_params) - flat(params) + flat(clipped)
  assert abs(np.std(residual) / (sigma * c) - 1) < 0.2
  plain = distributed.make_private_train_step(embed_fn, LOSS, 1.0, _mesh(), optax.sgd(1.0),
                                              non_private=True)
  new_params, _, _ = plain(params, optax.sgd(1.0).init(params), x, x_prime)
  np.testing.assert_allclose(flat(new_params), flat(params) - flat(clipped), rtol=1e-5, atol=1e-6)


class BatchNormNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(6)(x.reshape(x.shape[0], -1))
    return nn.BatchNorm(use_running_average=False)(x)


def _mean_subtracting(params, x):
  del params
  e = x.reshape(x.shape[0], -1)[:, :5]
  return e - jnp.mean(e, axis=0, keepdims=True)


@pytest.mark.parametrize("jit", [False, True])
def test_batch_mixing_embed_fn_is_refused(jit):
  _, params, x, x_prime = make_model("mlp", n=6)
  grad_fn = logit_dp.clipped_grad(_mean_subtracting, LOSS, 1.0)
  call = jax.jit(grad_fn) if jit else grad_fn
  with pytest.raises(ValueError, match="mixes the examples"):
    call(params, x, x_prime)


def test_batch_norm_in_training_mode_is_refused():
  model = BatchNormNet()
  x = jax.random.normal(jax.random.PRNGKey(0), (6, 7))
  variables = model.init(jax.random.PRNGKey(1), x)
  stats = variables["batch_stats"]

  def embed_fn(params, xs):
    out, _ = model.apply({"params": params, "batch_stats": stats}, xs, mutable=["batch_stats"])
    return out

  with pytest.raises(ValueError, match="mixes the examples"):
    logit_dp.clipped_grad(embed_fn, LOSS, 1.0)(variables["params"], x, x + 0.1)
  # The whole variables dict: batch_stats would be differentiated and noised.
  full = lambda v, xs: model.apply(v, xs, mutable=["batch_stats"])[0]
  with pytest.raises(ValueError, match="batch_stats"):
    logit_dp.clipped_grad(full, LOSS, 1.0)(variables, x, x + 0.1)
  with pytest.raises(ValueError, match="batch_stats"):
    distributed.make_sharded_grad_fn(full, LOSS, 1.0, _mesh())(variables, x, x + 0.1)


concrete_initializer_keys = []


def _watched_init(key, shape, dtype=jnp.float32):
  concrete_initializer_keys.append(not isinstance(key, jax.core.Tracer))
  return nn.initializers.lecun_normal()(key, shape, dtype)


class WatchedNet(nn.Module):
  """A dense layer whose initializer records whether it ran on a concrete key."""
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, kernel_init=_watched_init)(jnp.tanh(nn.Dense(8)(x)))


@pytest.mark.parametrize("jit", [False, True])
def test_the_model_check_compiles_the_model_whole_and_runs_no_initializer(jit):
  """The check that examples are independent runs the model on a few rows now (also inside a
  jit trace), compiled as a whole: flax's shape check of every parameter (a trace of its
  initializer) stays abstract, where under `jax.ensure_compile_time_eval` it evaluated every
  initializer with a concrete key, operation by operation."""
  model = WatchedNet()
  x = jax.random.normal(KEY, (6, 7))
  params = model.init(KEY, x[:1])["params"]
  concrete_initializer_keys.clear()
  compiled = []
  listener = lambda event, duration, **kwargs: compiled.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    check = lambda p, xs: checks.check_embed_fn(lambda q, e: model.apply({"params": q}, e), p, xs)
    if jit:
      jax.jit(lambda p, xs: (check(p, xs), jnp.sum(xs))[1])(params, x)
    else:
      check(params, x)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert concrete_initializer_keys and not any(concrete_initializer_keys)
  # The batch and the vmapped rows: two programs (and the rows' slices), not one per operation.
  assert compiled.count("/jax/core/compile/backend_compile_duration") <= 6


@pytest.mark.slow  # a conv net; test_clipping jits clipped_grad of independent mlps by default
def test_independent_embed_fn_is_accepted_under_jit():
  embed_fn, params, x, x_prime = make_model("conv", n=5)
  loss, grads = jax.jit(logit_dp.clipped_grad(embed_fn, LOSS, 1.0))(params, x, x_prime)
  assert np.isfinite(float(loss))


def test_a_jitted_function_may_close_over_the_batch():
  """Under jit with params and batch closed over (no input traced), a non-finite row is masked
  out as under jit, not an error about a traced count."""
  k1, k2, k3 = jax.random.split(KEY, 3)
  embed_fn, params = lambda w, xs: xs @ w, jax.random.normal(k1, (3, 2))
  x = jax.random.normal(k2, (5, 3))
  x_prime = x + 0.3 * jax.random.normal(k3, (5, 3))
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, 1.0)
  x_bad = x.at[2].set(jnp.inf)
  loss, grads = jax.jit(lambda: grad_fn(params, x_bad, x_prime))()
  assert np.isfinite(float(loss)) and np.all(np.isfinite(flat(grads)))
  _, without = grad_fn(params, x, x_prime, jnp.arange(5) != 2)
  assert rel_err(grads, without) < 1e-5  # float32: another compilation of the same sum


@pytest.mark.parametrize("method", ["ghost", pytest.param("naive", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_nan_parameters_under_jit_give_a_nan_loss_and_count_the_dropped_rows(method):
  embed_fn, params, x, x_prime = make_model("mlp", n=5)
  grad_fn = (logit_dp.baselines.naive_clipped_grad(embed_fn, LOSS, 1.0)
             if method == "naive" else logit_dp.clipped_grad(embed_fn, LOSS, 1.0, method=method))
  nan_params = jax.tree_util.tree_map(lambda a: jnp.full_like(a, jnp.nan), params)
  loss, grads, dropped = jax.jit(grad_fn.with_num_dropped)(nan_params, x, x_prime)
  assert np.isnan(float(loss)) and int(dropped) == 5
  loss, _ = jax.jit(grad_fn)(nan_params, x, x_prime)
  assert np.isnan(float(loss))
  # One non-finite input row: that pair is dropped, counted, and the loss stays finite.
  loss, _, dropped = jax.jit(grad_fn.with_num_dropped)(params, x.at[2].set(jnp.inf), x_prime)
  assert int(dropped) == 1 and np.isfinite(float(loss))


def test_non_boolean_masks_are_refused():
  embed_fn, params, x, x_prime = make_model("mlp", n=4)
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, 1.0)
  with pytest.raises(ValueError, match="boolean"):
    grad_fn(params, x, x_prime, jnp.array([1.0, 0.5, 1.0, 1.0]))
  with pytest.raises(ValueError, match="only 0 and 1"):
    grad_fn(params, x, x_prime, jnp.array([1, 2, 1, 1]))
  as_int = grad_fn(params, x, x_prime, jnp.array([1, 0, 1, 1]))[1]
  as_bool = grad_fn(params, x, x_prime, jnp.array([True, False, True, True]))[1]
  np.testing.assert_array_equal(flat(as_int), flat(as_bool))
  with pytest.raises(ValueError, match="boolean"):
    distributed.make_sharded_grad_fn(embed_fn, LOSS, 1.0, _mesh())(params, x, x_prime,
                                                                   jnp.array([1.0, 0.5, 1.0, 1.0]))


def test_transform_without_a_key_is_refused():
  with pytest.raises(ValueError, match="key is required"):
    logit_dp.transform(1.0, 1.0, key=None)


def test_embeddings_that_are_not_two_dimensional_are_refused():
  _, params, x, x_prime = make_model("mlp", n=4)
  flat_embed = lambda p, xs: xs.reshape(xs.shape[0], -1).sum(axis=1)
  with pytest.raises(ValueError, match=r"\(n, d\)"):
    logit_dp.clipped_grad(flat_embed, LOSS, 1.0)(params, x, x_prime)


def test_unsupported_input_pytrees_are_refused_with_a_clear_error():
  """Pytrees of arrays are inputs (two-tower models: tests/test_two_tower.py); leaves that are
  not numeric arrays with the examples along axis 0 are refused, naming the leaf."""
  embed_fn, params, x, x_prime = make_model("mlp", n=4)
  fn = logit_dp.clipped_grad(embed_fn, LOSS, 1.0)
  with pytest.raises(ValueError, match=r"x\['ids'\] must be an array"):
    fn(params, {"ids": "abc"}, x_prime)
  with pytest.raises(ValueError, match="no arrays"):
    fn(params, {}, x_prime)
  with pytest.raises(ValueError, match=r"every leaf of x .* same number of examples"):
    fn(params, {"a": x, "b": x[:3]}, x_prime)


def test_training_loop_stops_with_a_clear_message_on_a_non_finite_loss(tmp_path):
  from experiments import train
  from experiments.configs import tiny
  cfg = tiny.get_config()
  cfg.methods = ("non_private",)
  cfg.learning_rates.non_private = 1e30  # Adam steps of 1e30: the parameters overflow
  cfg.model.hidden = (16, 16, 16)
  with pytest.raises(FloatingPointError, match="not finite"):
    train.train_and_evaluate(cfg, str(tmp_path), quiet=True)


@pytest.mark.slow  # a regression check of an all-ghost net in microbatches
@pytest.mark.parametrize("method", ["ghost", "triangle"])
def test_microbatches_on_a_net_without_flattened_parameters(method):
  """Every layer a ghost layer: the flattened factors are zero-size (once a ZeroDivisionError)."""
  embed_fn, params, x, x_prime = make_model("mlp", n=6)
  from logit_dp._src import layerwise
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(layerwise, "use_ghost", lambda layer, d: True)
    fresh = lambda p, xs: embed_fn(p, xs)
    whole = logit_dp.clipped_grad(fresh, LOSS, 0.1, method)(params, x, x_prime)[1]
    chunked = logit_dp.clipped_grad(fresh, LOSS, 0.1, method, microbatch_size=4)(params, x,
                                                                                 x_prime)[1]
  np.testing.assert_allclose(flat(chunked), flat(whole), rtol=1e-5, atol=1e-7)

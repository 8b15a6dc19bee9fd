"""Stochastic models (dropout): embed_fn(params, x, key), one key per example.

Every check compares with an independent computation of the documented contract: example i
of view v is embedded alone with k_i = fold_in(fold_in(key, v), i), and its pair gradients are
jax.grad of Z_ij = ⟨n(Φ(x_i; k_i)), n(Φ'(x'_j; k'_j))⟩ (float64 for the plain-JAX model, whose
mask is drawn in float32 either way; float32 for flax, whose masks depend on the float width).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree

import logit_dp
from helpers import clip_method
from helpers import flat
from logit_dp import audit
from logit_dp import distributed
from logit_dp._src import checks

LOSS = logit_dp.losses.contrastive(temperature=0.5)
KEEP = 0.7
EPS = logit_dp.losses.DEFAULT_COSINE_EPS


def _keep_mask(key, shape):
  """A dropout mask (P(keep) ≈ 0.7) hashed from the key's bits with integer arithmetic only: the
  same in float64 mode, and quick to compile (the flax models use jax.random)."""
  bits = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  index = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape)
  mixed = ((index * jnp.uint32(2654435761)) ^ bits[0]) * jnp.uint32(2246822519)
  mixed = (mixed ^ (mixed >> 15) ^ bits[1]) * jnp.uint32(3266489917)
  mixed = mixed ^ (mixed >> 16)
  return (mixed >> 8) % 10 < 7


def plain_dropout(params, x, key):
  """A dropout MLP in plain JAX."""
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  h = jnp.where(_keep_mask(key, h.shape), h / KEEP, 0.0)
  return h @ params["w2"] + params["b2"]


def shared_mask_dropout(params, x, key):
  """One dropout mask for the whole batch (shape of one example's features)."""
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  h = jnp.where(_keep_mask(key, h.shape[1:]), h / KEEP, 0.0)
  return h @ params["w2"] + params["b2"]


class LinenDropout(nn.Module):
  batch_norm: bool = False

  @nn.compact
  def __call__(self, x, deterministic=True):
    h = nn.tanh(nn.Dense(8)(x))
    if self.batch_norm:
      h = nn.BatchNorm(use_running_average=False)(h)
    h = nn.Dropout(1 - KEEP, deterministic=deterministic)(h)
    return nn.Dense(4)(h)


class NnxDropout(nnx.Module):
  def __init__(self, rngs):
    self.dense1 = nnx.Linear(5, 8, rngs=rngs)
    self.dropout = nnx.Dropout(1 - KEEP)
    self.dense2 = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x, rngs=None):
    return self.dense2(self.dropout(nnx.tanh(self.dense1(x)), rngs=rngs))


def _data(n=6, seed=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(k1, (n, 5))
  return x, x + 0.3 * jax.random.normal(k2, x.shape)


def _plain_params(seed=0):
  k = jax.random.split(jax.random.PRNGKey(100 + seed), 4)
  return {
      "w1": jax.random.normal(k[0], (5, 8)), "b1": 0.1 * jax.random.normal(k[1], (8,)),
      "w2": jax.random.normal(k[2], (8, 4)), "b2": 0.1 * jax.random.normal(k[3], (4,))
  }


def _model(framework):
  """(embed_fn(params, x, key), params) of the same kind of dropout MLP in each framework."""
  x, _ = _data()
  if framework == "plain":
    return plain_dropout, _plain_params()
  if framework == "linen":
    module = LinenDropout()
    params = module.init(jax.random.PRNGKey(1), x[:1])["params"]
    return (lambda p, x, key: module.apply({"params": p}, x, deterministic=False, rngs=
                                           {"dropout": key})), params
  graphdef, params = nnx.split(NnxDropout(nnx.Rngs(1)))
  return (lambda p, x, key: nnx.merge(graphdef, p)(x, rngs=nnx.Rngs(dropout=key))), params


def _key_of(key, view, i):
  return jax.random.fold_in(jax.random.fold_in(key, view), i)


def _brute_force(embed_fn, params, x, x_prime, key, clip_norm, positive_embed_fn=None,
                 float64=False, mask=None):
  """(‖g_ij‖ (n, n), Σ_ij τ_ij·min(1, B/‖g_ij‖)·g_ij flattened, ℒ) from jax.grad per pair."""
  positive_embed_fn = positive_embed_fn or embed_fn
  n = x.shape[0]
  mask = jnp.ones((n,), bool) if mask is None else mask
  with jax.enable_x64(float64):
    dtype = jnp.float64 if float64 else jnp.float32
    params, x, x_prime = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype),
                                                (params, x, x_prime))
    norms, g_bar, loss_value = _brute_force_jit(embed_fn, positive_embed_fn, params, x, x_prime,
                                                key, jnp.asarray(clip_norm, dtype), mask)
    return np.asarray(norms, np.float64), np.asarray(g_bar, np.float64), float(loss_value)


# One compilation per model, shape and float width (B is an argument): compiled operation by
# operation it would take longer than the computation.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _brute_force_jit(embed_fn, positive_embed_fn, params, x, x_prime, key, clip_norm, mask):
  w, unravel = ravel_pytree(params)
  rows = jnp.arange(x.shape[0])
  keys_u = jax.vmap(lambda i: _key_of(key, 0, i))(rows)
  keys_v = jax.vmap(lambda i: _key_of(key, 1, i))(rows)

  def unit(fn, w, xe, k):
    e = fn(unravel(w), xe[None], k)[0]
    return e / jnp.sqrt(jnp.sum(e * e) + EPS ** 2)

  def z_matrix(w):
    u = jax.vmap(lambda xe, k: unit(embed_fn, w, xe, k))(x, keys_u)
    v = jax.vmap(lambda xe, k: unit(positive_embed_fn, w, xe, k))(x_prime, keys_v)
    return u @ v.T

  # grads (n, n, p): g_ij = ∇_w Z_ij.
  z, grads = z_matrix(w), jax.jacrev(z_matrix)(w)
  loss_value, tau = jax.value_and_grad(LOSS)(z, mask)
  tau = jnp.where(mask[:, None] & mask[None, :], tau, 0.0)
  norms = jnp.sqrt(jnp.sum(grads * grads, axis=-1))
  factor = jnp.minimum(1.0, clip_norm / norms)
  g_bar = jnp.einsum("ij,ijp->p", tau * factor, grads)
  return norms, g_bar, loss_value


# ---------------------------------------------------------------------------
# Norms and ḡ of every method against brute force.
# ---------------------------------------------------------------------------


@pytest.mark.extended
def test_plain_norms_of_every_method_are_float64_truth(no_float_allowance):
  embed_fn, params = _model("plain")
  x, x_prime = _data()
  key = jax.random.key(3)
  truth, _, _ = _brute_force(embed_fn, params, x, x_prime, key, 1.0, float64=True)
  atol = 1e-5 * float(np.max(truth))
  norms = {
      m:
          np.asarray(
              logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, clip_method(m, x),
                                                    key=key, float_allowance=False))
      for m in ("materialize", "ghost", "triangle")
  }
  np.testing.assert_allclose(norms["materialize"], truth, rtol=1e-4, atol=atol)
  np.testing.assert_allclose(norms["ghost"], truth, rtol=1e-4, atol=atol)
  # An upper bound, exact on the diagonal.
  assert np.all(norms["triangle"] >= truth * (1 - 1e-5) - atol)
  np.testing.assert_allclose(np.diag(norms["triangle"]), np.diag(truth), rtol=1e-4, atol=atol)


@pytest.mark.slow
def test_plain_projected_and_blocked_ghost_norms_are_float64_truth(no_float_allowance):
  """"projected" (public reference inputs keyed as view 2) bounds the truth, exact on the
  diagonal; "ghost" in microbatches and memory blocks embeds each example with its own key."""
  embed_fn, params = _model("plain")
  x, x_prime = _data()
  key = jax.random.key(3)
  truth, _, _ = _brute_force(embed_fn, params, x, x_prime, key, 1.0, float64=True)
  atol = 1e-5 * float(np.max(truth))
  projected = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime,
                                            clip_method("projected",
                                                        x), key=key, float_allowance=False))
  assert np.all(projected >= truth * (1 - 1e-5) - atol)
  np.testing.assert_allclose(np.diag(projected), np.diag(truth), rtol=1e-4, atol=atol)
  blocked = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime,
                                                  logit_dp.clip_methods.Ghost(memory_budget=1),
                                                  key=key, float_allowance=False, microbatch_size=4)
  np.testing.assert_allclose(blocked, truth, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("method", ["ghost", pytest.param("materialize", marks=pytest.mark.slow)])
def test_plain_clipped_grad_is_float64_brute_force(method, no_float_allowance):
  embed_fn, params = _model("plain")
  x, x_prime = _data()
  key = jax.random.key(4)
  mask = jnp.asarray([True, True, False, True, True, True])
  truth, _, _ = _brute_force(embed_fn, params, x, x_prime, key, 1.0, float64=True)
  clip = float(np.median(truth))
  _, want, want_loss = _brute_force(embed_fn, params, x, x_prime, key, clip, float64=True,
                                    mask=mask)
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, clip, method, stochastic=True, microbatch_size=4)
  loss_value, got = grad_fn(params, x, x_prime, mask, key=key)
  np.testing.assert_allclose(float(loss_value), want_loss, rtol=1e-5)
  np.testing.assert_allclose(flat(got), want, rtol=1e-4, atol=1e-6 * np.max(np.abs(want)))


@pytest.mark.parametrize("framework",
                         [pytest.param(f, marks=pytest.mark.slow) for f in ("linen", "nnx")])
def test_flax_dropout_norms_and_grad_are_brute_force(framework, no_float_allowance):
  """flax's own Dropout (jax.random.bernoulli), with the key passed at call time."""
  embed_fn, params = _model(framework)
  x, x_prime = _data()
  key = jax.random.key(5)
  truth, _, _ = _brute_force(embed_fn, params, x, x_prime, key, 1.0)
  got = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "ghost", key=key,
                                              float_allowance=False)
  np.testing.assert_allclose(got, truth, rtol=1e-4, atol=1e-5 * float(np.max(truth)))
  clip = float(np.median(truth))
  _, want, _ = _brute_force(embed_fn, params, x, x_prime, key, clip)
  _, got = logit_dp.clipped_grad(embed_fn, LOSS, clip, stochastic=True)(params, x, x_prime, key=key)
  np.testing.assert_allclose(flat(got), want, rtol=1e-4, atol=1e-6 * np.max(np.abs(want)))


@pytest.mark.slow
def test_every_clipped_pair_gradient_stays_within_the_clip_norm():
  """With the float32 allowances (what training uses), the clip factors of every method keep
  each pair's clipped gradient at or below B in float64."""
  embed_fn, params = _model("plain")
  x, x_prime = _data()
  key = jax.random.key(6)
  truth, _, _ = _brute_force(embed_fn, params, x, x_prime, key, 1.0, float64=True)
  clip = float(np.min(truth)) / 2  # every pair clipped
  for method in logit_dp.clip_methods.METHODS:
    norms = np.asarray(
        logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, clip_method(method, x),
                                              key=key))
    assert np.all(truth * np.minimum(1.0, clip / norms) <= clip * (1 + 1e-7))


# ---------------------------------------------------------------------------
# Independent per-example randomness.
# ---------------------------------------------------------------------------


def test_examples_get_independent_keys_and_the_same_key_reproduces(no_float_allowance):
  """A model drawing one mask for "the batch" still gets one mask per example: identical
  examples embed differently, and ḡ is the brute force with per-example keys."""
  params = _plain_params()
  x = jnp.tile(_data()[0][:1], (6, 1))  # six copies of one example
  x_prime = x + 0.1
  key = jax.random.key(7)
  per_example = jnp.stack(
      [shared_mask_dropout(params, x[i:i + 1], _key_of(key, 0, i))[0] for i in range(6)])
  assert len({tuple(np.round(np.asarray(row), 5)) for row in per_example}) > 1
  grad_fn = logit_dp.clipped_grad(shared_mask_dropout, LOSS, 0.3, stochastic=True)
  loss_value, got = grad_fn(params, x, x_prime, key=key)
  _, want, want_loss = _brute_force(shared_mask_dropout, params, x, x_prime, key, 0.3, float64=True)
  np.testing.assert_allclose(float(loss_value), want_loss, rtol=1e-5)
  np.testing.assert_allclose(flat(got), want, rtol=1e-4, atol=1e-6 * np.max(np.abs(want)))
  again = grad_fn(params, x, x_prime, key=key)[1]
  np.testing.assert_array_equal(flat(again), flat(got))
  other = grad_fn(params, x, x_prime, key=jax.random.key(8))[1]
  assert np.linalg.norm(flat(other) - flat(got)) > 1e-3 * np.linalg.norm(flat(got))


@pytest.mark.slow
def test_raw_keys_and_typed_keys_give_the_same_gradient():
  embed_fn, params = _model("plain")
  x, x_prime = _data()
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, 0.3, stochastic=True)
  typed = grad_fn(params, x, x_prime, key=jax.random.key(9))[1]
  raw = grad_fn(params, x, x_prime, key=jax.random.PRNGKey(9))[1]
  np.testing.assert_array_equal(flat(typed), flat(raw))


# ---------------------------------------------------------------------------
# Checks.
# ---------------------------------------------------------------------------


def test_batch_norm_is_refused_and_dropout_accepted():
  x, x_prime = _data()
  key = jax.random.key(10)
  module = LinenDropout(batch_norm=True)
  variables = module.init(jax.random.PRNGKey(1), x)
  stats = variables["batch_stats"]

  def with_batch_norm(p, x, key):
    out, _ = module.apply({"params": p, "batch_stats": stats}, x, deterministic=False,
                          rngs={"dropout": key}, mutable=["batch_stats"])
    return out

  grad_fn = logit_dp.clipped_grad(with_batch_norm, LOSS, 0.3, stochastic=True)
  with pytest.raises(ValueError, match="mixes the examples"):
    grad_fn(variables["params"], x, x_prime, key=key)
  for framework in ("linen", "nnx", "plain"):  # the check grad_fn runs on first use
    embed_fn, params = _model(framework)
    checks.check_towers(embed_fn, None, params, x, x_prime, key)


def test_batch_norm_is_refused_under_jit():
  x, x_prime = _data()
  module = LinenDropout(batch_norm=True)
  variables = module.init(jax.random.PRNGKey(1), x)

  def with_batch_norm(p, x, key):
    return module.apply({"params": p, "batch_stats": variables["batch_stats"]}, x,
                        deterministic=False, rngs={"dropout": key}, mutable=["batch_stats"])[0]

  grad_fn = logit_dp.clipped_grad(with_batch_norm, LOSS, 0.3, stochastic=True)
  with pytest.raises(ValueError, match="mixes the examples"):
    jax.jit(lambda p, k: grad_fn(p, x, x_prime, key=k))(variables["params"], jax.random.key(0))


def test_key_errors():
  embed_fn, params = _model("plain")
  x, x_prime = _data()
  stochastic = logit_dp.clipped_grad(embed_fn, LOSS, 0.3, stochastic=True)
  with pytest.raises(TypeError, match="needs key="):
    stochastic(params, x, x_prime)
  with pytest.raises(ValueError, match="one PRNG key"):
    stochastic(params, x, x_prime, key=jax.random.split(jax.random.key(0), 2))
  with pytest.raises(ValueError, match="PRNG key"):
    stochastic(params, x, x_prime, key=jnp.zeros((2,), jnp.float32))
  deterministic = logit_dp.clipped_grad(lambda p, x: x @ p["w1"], LOSS, 0.3)
  with pytest.raises(TypeError, match="takes no key"):
    deterministic(params, x, x_prime, key=jax.random.key(0))
  with pytest.raises(ValueError, match="stochastic must be"):
    logit_dp.clipped_grad(embed_fn, LOSS, 0.3, stochastic="yes")


def _deterministic(params, x):
  return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


class _ApplyTakesAnything:
  """An embed_fn whose signature accepts any arguments (as flax's Module.apply, *args): the
  mismatch shows only when it is called."""
  def __init__(self, fn):
    self.fn = fn

  def __call__(self, *args):
    return self.fn(*args)


def _private(fn, stochastic):
  return logit_dp.make_private(fn, LOSS, 0.3, target_epsilon=8.0, target_delta=1e-3, num_records=40,
                               expected_batch_size=8, optimizer=optax.sgd(0.1), steps=3,
                               stochastic=stochastic)


@pytest.mark.parametrize(
    "make", [
        functools.partial(logit_dp.clipped_grad, loss=LOSS, clip_norm=0.3),
        functools.partial(logit_dp.baselines.naive_clipped_grad, loss=LOSS, clip_norm=0.3),
        functools.partial(logit_dp.baselines.grouped_clipped_grad, loss=LOSS, clip_norm=0.3,
                          num_groups=2),
        _private,
    ], ids=["clipped_grad", "naive_clipped_grad", "grouped_clipped_grad", "make_private"])
def test_an_embed_fn_whose_arity_does_not_match_stochastic_is_refused_when_built(make):
  """stochastic=True with embed_fn(params, x), and stochastic=False with embed_fn(params, x,
  key): a TypeError that says what to pass, before anything is traced."""
  with pytest.raises(TypeError, match=r"declared stochastic=True.*drop stochastic=True"):
    make(_deterministic, stochastic=True)
  with pytest.raises(TypeError, match=r"requires a third argument.*pass stochastic=True"):
    make(plain_dropout, stochastic=False)
  with pytest.raises(TypeError, match=r"positive_embed_fn requires a third argument"):
    logit_dp.clipped_grad(_deterministic, LOSS, 0.3, positive_embed_fn=plain_dropout)
  x, x_prime = _data()
  with pytest.raises(TypeError, match=r"requires a third argument.*pass stochastic=True"):
    logit_dp.clip_methods.pair_grad_norms(plain_dropout, _plain_params(), x, x_prime)
  with pytest.raises(TypeError, match=r"declared stochastic=True.*drop stochastic=True"):
    logit_dp.clip_methods.pair_grad_norms(_deterministic, _plain_params(), x, x_prime,
                                          key=jax.random.key(0))


def test_an_embed_fn_whose_arity_does_not_match_stochastic_is_refused_on_first_call():
  """A signature that takes any arguments (*args, as Module.apply) is told apart on its first
  call; a TypeError raised inside a model that takes the right arguments is left as it is."""
  params = _plain_params()
  x, x_prime = _data()
  deterministic = logit_dp.clipped_grad(_ApplyTakesAnything(_deterministic), LOSS, 0.3,
                                        stochastic=True)
  with pytest.raises(TypeError, match=r"declared stochastic=True.*drop stochastic=True"):
    deterministic(params, x, x_prime, key=jax.random.key(0))
  stochastic = logit_dp.clipped_grad(_ApplyTakesAnything(plain_dropout), LOSS, 0.3)
  with pytest.raises(TypeError, match=r"requires a third argument.*pass stochastic=True"):
    stochastic(params, x, x_prime)

  def broken(params, x):
    raise TypeError("a bug inside the model")

  with pytest.raises(TypeError, match="a bug inside the model"):
    logit_dp.clipped_grad(broken, LOSS, 0.3)(params, x, x_prime)


def test_randomness_from_hidden_state_is_refused():
  params = _plain_params()
  x, x_prime = _data()
  draws = iter(range(1000))

  def hidden(p, x, key):
    del key
    return plain_dropout(p, x, jax.random.PRNGKey(next(draws)))

  with pytest.raises(ValueError, match="two calls with the same key differ"):
    logit_dp.clipped_grad(hidden, LOSS, 0.3, stochastic=True)(params, x, x_prime,
                                                              key=jax.random.key(0))


# ---------------------------------------------------------------------------
# Two towers, Naive-DP and the sharded path.
# ---------------------------------------------------------------------------


def _two_towers():
  anchor = lambda p, x, key: plain_dropout(p["anchor"], x, key)
  positive = lambda p, x, key: plain_dropout(p["positive"], x, key)
  return anchor, positive, {"anchor": _plain_params(0), "positive": _plain_params(1)}


@pytest.mark.extended
@pytest.mark.parametrize(
    "method",
    ["ghost"] + [pytest.param(m, marks=pytest.mark.slow) for m in ("triangle", "materialize")])
def test_two_towers_with_dropout(method, no_float_allowance):
  anchor, positive, params = _two_towers()
  x, x_prime = _data()
  key = jax.random.key(11)
  truth, _, _ = _brute_force(anchor, params, x, x_prime, key, 1.0, positive_embed_fn=positive,
                             float64=True)
  norms = logit_dp.clip_methods.pair_grad_norms(anchor, params, x, x_prime, method, key=key,
                                                positive_embed_fn=positive, float_allowance=False)
  # Disjoint towers: every method is exact (the cross term is 0).
  np.testing.assert_allclose(norms, truth, rtol=1e-4, atol=1e-5 * float(np.max(truth)))
  clip = float(np.median(truth))
  _, want, _ = _brute_force(anchor, params, x, x_prime, key, clip, positive_embed_fn=positive,
                            float64=True)
  _, got = logit_dp.clipped_grad(anchor, LOSS, clip, method, positive_embed_fn=positive,
                                 stochastic=True)(params, x, x_prime, key=key)
  np.testing.assert_allclose(flat(got), want, rtol=1e-4, atol=1e-6 * np.max(np.abs(want)))


@pytest.mark.slow  # the same per-example keys as clipped_grad, tested by default above
def test_naive_dp_with_dropout_is_the_clipped_brute_force_gradient():
  embed_fn, params = _model("plain")
  x, x_prime = _data()
  key = jax.random.key(12)
  _, unclipped, _ = _brute_force(embed_fn, params, x, x_prime, key, np.inf, float64=True)
  clip = 0.5 * float(np.linalg.norm(unclipped))
  _, got = logit_dp.baselines.naive_clipped_grad(embed_fn, LOSS, clip,
                                                 stochastic=True)(params, x, x_prime, key=key)
  np.testing.assert_allclose(flat(got), unclipped * clip / np.linalg.norm(unclipped), rtol=1e-4,
                             atol=1e-6 * clip)


@pytest.mark.slow
def test_dp_gcl_with_dropout():
  """One group, no extra views: the clipped float64 brute-force gradient (DP-GCL is Naive-DP
  there); with extra views, microbatches embed every view with its own key."""
  embed_fn, params = _model("plain")
  x, x_prime = _data()
  key = jax.random.key(15)
  ids = jnp.arange(6)
  _, unclipped, _ = _brute_force(embed_fn, params, x, x_prime, key, np.inf, float64=True)
  clip = 0.5 * float(np.linalg.norm(unclipped))
  one_group = logit_dp.baselines.grouped_clipped_grad(embed_fn, LOSS, clip, 1, stochastic=True)
  _, got = one_group(params, x, x_prime, record_ids=ids, group_key=jax.random.key(0), key=key)
  # DP-GCL's float allowance raises the norm by ~2⁻¹⁸ relative in float32, within rtol.
  scale = clip / np.linalg.norm(unclipped)
  np.testing.assert_allclose(flat(got), unclipped * scale, rtol=1e-4, atol=1e-6 * clip)
  views = jnp.stack([x + 0.1, x - 0.1], axis=1)
  args = dict(record_ids=ids, group_key=jax.random.key(0), extra_views=views, key=key)
  whole = logit_dp.baselines.grouped_clipped_grad(embed_fn, LOSS, 0.5, 2, stochastic=True)
  chunked = logit_dp.baselines.grouped_clipped_grad(embed_fn, LOSS, 0.5, 2, stochastic=True,
                                                    microbatch_size=4)
  want = flat(whole(params, x, x_prime, **args)[1])
  np.testing.assert_allclose(flat(chunked(params, x, x_prime, **args)[1]), want, rtol=1e-5,
                             atol=1e-7 * np.max(np.abs(want)))


@pytest.mark.extended
@pytest.mark.parametrize(
    "method",
    ["ghost"] + [pytest.param(m, marks=pytest.mark.slow) for m in ("materialize", "naive")])
def test_sharded_dropout_equals_single_device(method):
  """Rows keyed by their global index: 4 devices give the single-device ḡ."""
  embed_fn, params = _model("plain")
  x, x_prime = _data(n=8)
  key = jax.random.key(13)
  mask = jnp.asarray([True] * 5 + [False] + [True] * 2)
  if method == "naive":
    single = logit_dp.baselines.naive_clipped_grad(embed_fn, LOSS, 0.5, stochastic=True)
  else:
    single = logit_dp.clipped_grad(embed_fn, LOSS, 0.5, method, stochastic=True)
  want_loss, want = single(params, x, x_prime, mask, key=key)
  sharded = distributed.make_sharded_grad_fn(embed_fn, LOSS, 0.5, distributed.data_mesh(4), method,
                                             stochastic=True)
  got_loss, got = sharded(params, x, x_prime, mask, key=key)
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  want = flat(want)
  np.testing.assert_allclose(flat(got), want, rtol=1e-4, atol=1e-6 * np.max(np.abs(want)))
  with pytest.raises(TypeError, match="needs key="):
    sharded(params, x, x_prime, mask)


@pytest.mark.slow
def test_sharded_train_step_with_dropout():
  embed_fn, params = _model("plain")
  x, x_prime = _data(n=8)
  mesh = distributed.data_mesh(2)
  optimizer = distributed.make_private_optimizer(1.0, logit_dp.sensitivity(LOSS, 0.5),
                                                 jax.random.key(0), optax.sgd(0.1))
  step = distributed.make_private_train_step(embed_fn, LOSS, 0.5, mesh, optimizer, stochastic=True)
  state = optimizer.init(params)
  new_params, _, loss_value = step(params, state, x, x_prime, key=jax.random.key(1))
  assert np.isfinite(float(loss_value))
  assert np.linalg.norm(flat(new_params) - flat(params)) > 0
  with pytest.raises(TypeError, match="needs key="):
    step(params, state, x, x_prime)


# ---------------------------------------------------------------------------
# make_private and the audit.
# ---------------------------------------------------------------------------


@pytest.mark.extended
def test_make_private_trains_a_dropout_model():
  embed_fn, params = _model("plain")
  data_x, data_xp = _data(n=40, seed=1)
  private = logit_dp.make_private(embed_fn, LOSS, 0.5, target_epsilon=8.0, target_delta=1e-3,
                                  num_records=40, expected_batch_size=8, optimizer=optax.sgd(0.05),
                                  steps=3, noise_key=jax.random.key(0), sampler_seed=0,
                                  max_batch_size=24, stochastic=True)
  assert private.grad_fn.stochastic and private.model_key is not None
  # The model's key is split from the training key apart from the noise key.
  noise_key, model_key = jax.random.split(jax.random.key(0))
  np.testing.assert_array_equal(jax.random.key_data(private.model_key),
                                jax.random.key_data(model_key))
  assert not np.array_equal(jax.random.key_data(private.model_key), jax.random.key_data(noise_key))
  train_step = private.make_train_step(on_empty="ignore")
  state = private.optimizer.init(params)
  losses = []
  for batch in private.batches():
    params, state, loss_value = train_step(params, state, batch, (data_x, data_xp))
    losses.append(float(loss_value))
  assert len(losses) == 3 and all(np.isfinite(losses))


@pytest.mark.slow  # make_private with dropout runs by default
def test_make_private_without_dropout_keeps_the_noise_key():
  private = logit_dp.make_private(lambda p, x: x @ p, LOSS, 0.5, target_epsilon=8.0,
                                  target_delta=1e-3, num_records=40, expected_batch_size=8,
                                  optimizer=optax.sgd(0.05), steps=3, noise_key=jax.random.key(0),
                                  sampler_seed=0)
  assert private.model_key is None and not private.grad_fn.stochastic


@pytest.mark.parametrize(
    "method", ["ghost"]
    + [pytest.param(m, marks=pytest.mark.slow) for m in ("triangle", "materialize", "naive")])
def test_audit_with_dropout_stays_within_the_sensitivity(method):
  """Removing a pair (masking it out) with the model's randomness held fixed moves ḡ by at most
  the sensitivity, at a small and a large input scale."""
  embed_fn, params = _model("plain")
  for scale, clip in ((1.0, 0.05), (30.0, 0.5)):
    x, x_prime = _data(n=5, seed=2)
    result = audit.max_removal_ratio(embed_fn, params, LOSS, clip, scale * x, scale * x_prime,
                                     method=method, model_key=jax.random.key(14))
    assert 0 < result.ratio <= 1 + 1e-4


@pytest.mark.slow
def test_worst_case_search_with_dropout_stays_within_the_sensitivity():
  embed_fn, params = _model("plain")
  x, x_prime = _data(n=4, seed=3)
  result = audit.search_worst_case(embed_fn, params, LOSS, 0.05, x, x_prime,
                                   key=jax.random.PRNGKey(0), num_restarts=2, num_steps=5,
                                   model_key=jax.random.key(16))
  assert 0 < result.ratio <= 1 + 1e-4


@pytest.mark.slow
def test_clip_statistics_of_a_dropout_model_are_those_of_its_norms(no_float_allowance):
  embed_fn, params = _model("plain")
  x, x_prime = _data()
  key = jax.random.key(17)
  truth, _, _ = _brute_force(embed_fn, params, x, x_prime, key, 1.0, float64=True)
  clip = float(np.median(truth))
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, clip, stochastic=True)
  _, grads, stats = grad_fn.with_stats(params, x, x_prime, key=key)
  np.testing.assert_allclose(flat(grads), flat(grad_fn(params, x, x_prime, key=key)[1]), rtol=1e-6)
  assert int(stats.num_norms) == truth.size
  assert int(stats.num_clipped) == int(np.sum(truth > clip))
  np.testing.assert_allclose(float(stats.quantiles[-1]), np.max(truth), rtol=1e-4)

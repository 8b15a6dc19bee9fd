"""DP-GCL's group norms and ḡ from weighted Jacobian factors (`logit_dp._src.group_norms`).

The reference is independent of the factors: for every group, jax.grad of the group's loss
L_g (built by a Python loop over its members' logits, `test_grouped._group_loss`) in float64,
clipped in float64 and summed. At a tiny B every group is clipped, so ḡ = Σ_g B·∇L_g/‖∇L_g‖
depends on every group's norm; at a B between the norms some groups are clipped and some not.
The float allowances are NOT switched off: in float64 they are ~10⁻¹⁶ relative, so ḡ is the
float64 truth to 10⁻¹⁰.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_grouped import _float_towers
from test_grouped import _group_gradients
from test_grouped import _group_loss
from test_grouped import two_towers

import logit_dp
from benchmarks import frameworks
from conftest import make_model
from conftest import require_devices
from helpers import flat
from helpers import rel_err
from helpers import tree_norm
from logit_dp import distributed
from logit_dp._src import group_norms

KEY = jax.random.PRNGKey(3)
TOL_VIT = 2e-5  # the ViT's float32 allowance (test_transformers_match_...)
TEMPERATURE = 0.7
IDS = np.array([5, 90, 3, 41, 17, 8, 66, 12, 30, 2, 77])
MASK = np.arange(11) % 5 != 2  # rows 2 and 7 are padding


def _float64(tree):
  return jax.tree_util.tree_map(
      lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _reference_group_grads(fn, params, x, x_prime, views, groups, positive_fn=None):
  """[∇L_g] of the groups with a valid record, each by its own jax.grad (jitted together)."""
  if positive_fn is None:
    group_loss = _group_loss(fn, x, x_prime, views, TEMPERATURE)
  else:  # two towers: û_i = n(fn(x_i)), v̂_j = n(positive_fn(x'_j))
    unit = lambda e: e / jnp.sqrt(jnp.sum(e * e, -1, keepdims=True) + 1e-12)

    def group_loss(p, members):
      u = unit(fn(p, x[jnp.asarray(members)]))
      v = unit(positive_fn(p, x_prime[jnp.asarray(members)]))
      logits = u @ v.T / TEMPERATURE
      return jnp.sum(jax.nn.logsumexp(logits, axis=1) - jnp.diagonal(logits))

  return jax.jit(lambda p: [g for _, g in _group_gradients(group_loss, p, MASK, groups)])(params)


def _clipped(grads, clip_norm):
  norms = [tree_norm(g) for g in grads]
  total = jax.tree_util.tree_map(jnp.zeros_like, grads[0])
  for g, norm in zip(grads, norms):
    factor = min(1.0, clip_norm / norm)
    total = jax.tree_util.tree_map(lambda t, a, f=factor: t + f * a, total, g)
  return total, np.array(norms)


def _check_against_float64_truth(fn, params, x, x_prime, views=None, num_groups=3,
                                 microbatch_size=None, positive_fn=None, tolerance=1e-10):
  """ḡ at a tiny B (every group clipped) and at a B between the group norms, in float64."""
  with jax.enable_x64(True):
    params, x, x_prime, views = _float64((params, x, x_prime, views))
    groups = np.asarray(logit_dp.baselines.assign_groups(jnp.asarray(IDS), KEY, num_groups))
    assert len(np.unique(groups[MASK])) == num_groups  # every group is used
    truth = _reference_group_grads(fn, params, x, x_prime, views, groups, positive_fn)
    norms = np.sort([tree_norm(g) for g in truth])
    for clip_norm in (1e-3 * norms[0], float(np.sqrt(norms[0] * norms[1]))):
      want, _ = _clipped(truth, clip_norm)
      grad_fn = logit_dp.baselines.grouped_clipped_grad(fn,
                                                        logit_dp.losses.contrastive(TEMPERATURE),
                                                        clip_norm, num_groups,
                                                        microbatch_size=microbatch_size,
                                                        positive_embed_fn=positive_fn)
      _, got = grad_fn(params, x, x_prime, jnp.asarray(MASK), record_ids=jnp.asarray(IDS),
                       group_key=KEY, extra_views=views)
      assert flat(got).dtype == np.float64
      assert rel_err(got, want) < tolerance, (clip_norm, rel_err(got, want))


def _views(x, k, seed=5):
  return x[:, None] + 0.3 * jax.random.normal(jax.random.PRNGKey(seed),
                                              (x.shape[0], k) + x.shape[1:])


@pytest.mark.parametrize("kind,k,microbatch", [
    ("mlp", 2, None),
    pytest.param("conv", 1, 4, marks=pytest.mark.extended),
])
def test_linen_models_match_per_group_jax_grad_in_float64(kind, k, microbatch):
  """An MLP and a conv net (flax.linen), with extra views and microbatches."""
  fn, params, x, x_prime = make_model(kind, 11, seed=1)
  _check_against_float64_truth(fn, params, x, x_prime, _views(x, k), microbatch_size=microbatch)


@pytest.mark.extended
@pytest.mark.parametrize("framework", ["nnx", "equinox"])
def test_nnx_and_equinox_models_match_per_group_jax_grad_in_float64(framework):
  fn, params, shape = frameworks.build(framework, "embedding_net", channels=(3, 4), dim=4, side=6)
  x = jax.random.normal(jax.random.PRNGKey(1), (11,) + shape)
  x_prime = x + 0.3 * jax.random.normal(jax.random.PRNGKey(2), x.shape)
  _check_against_float64_truth(fn, params, x, x_prime, _views(x, 1))


class _TokenEncoder(nn.Module):
  """Token ids -> embedding table, LayerNorm, a dense layer per token, mean pool, projection."""
  @nn.compact
  def __call__(self, ids):
    h = nn.Embed(9, 6)(ids)
    h = nn.tanh(nn.Dense(6)(nn.LayerNorm()(h)))
    return nn.Dense(4)(h.mean(axis=1))


@pytest.mark.extended
def test_embedding_and_layer_norm_match_per_group_jax_grad_in_float64():
  """An embedding table and LayerNorm scales and biases (whatever factors the engine gives
  them) and a dense layer over the tokens."""
  ids = jax.random.randint(jax.random.PRNGKey(1), (11, 5), 0, 9)
  ids_prime = jax.random.randint(jax.random.PRNGKey(2), (11, 5), 0, 9)
  model = _TokenEncoder()
  params = model.init(jax.random.PRNGKey(0), ids[:1])
  _check_against_float64_truth(model.apply, params, ids, ids_prime, num_groups=2)


@pytest.mark.extended
@pytest.mark.parametrize("name", ["text_transformer", "vit"])
def test_transformers_match_per_group_jax_grad_in_float64(name):
  """A pre-LN text transformer (embeddings, learned positions, attention, LayerNorm) and a ViT
  (patch convolution, class token), tiny. The ViT casts its images to float32: a float32 value
  enters its computation, so its float allowance is float32's (2⁻¹⁸ relative) and ḡ differs
  from the float64 truth by the allowance's clip factors, a few 10⁻⁶ (< 10⁻⁹ with the
  allowances set to 0)."""
  sizes = dict(width=8, depth=1, num_heads=2, mlp_dim=8, embedding_dim=4)
  if name == "text_transformer":
    model = logit_dp.models.make_model(name, vocab_size=13, length=4, **sizes)
    x = jax.random.randint(jax.random.PRNGKey(1), (11, 4), 0, 13)
    x_prime = jax.random.randint(jax.random.PRNGKey(2), (11, 4), 0, 13)
  else:
    model = logit_dp.models.make_model(name, patch_size=4, **sizes)
    x = jax.random.normal(jax.random.PRNGKey(1), (11, 8, 8, 3))
    x_prime = x + 0.3 * jax.random.normal(jax.random.PRNGKey(2), x.shape)
  params = model.init(jax.random.PRNGKey(0), x[:1])
  _check_against_float64_truth(model.apply, params, x, x_prime, num_groups=2,
                               tolerance=1e-10 if name == "text_transformer" else TOL_VIT)


@pytest.mark.parametrize("kind", ["shared", pytest.param("disjoint", marks=pytest.mark.extended)])
def test_two_towers_match_per_group_jax_grad_in_float64(kind):
  f, f_prime, params, x, x_prime = _float_towers(kind, 11, seed=3)
  _check_against_float64_truth(f, params, x, x_prime, positive_fn=f_prime)


def test_a_group_larger_than_its_slots_takes_the_exact_path(monkeypatch):
  """Slots for one record per group: every group overflows and the norms come from the
  per-group path over all records (the same ḡ)."""
  monkeypatch.setattr(group_norms, "capacity", lambda n, g: 1)
  fn, params, x, x_prime = make_model("mlp", 11, seed=2)
  _check_against_float64_truth(fn, params, x, x_prime, _views(x, 1))


@pytest.mark.parametrize("first,spill", [(1, 3), pytest.param(2, 1, marks=pytest.mark.extended)])
def test_groups_above_the_first_pass_slots_are_taken_again_with_all_their_records(
    monkeypatch, first, spill):
  """Two passes over the groups: a first one with `first` slots each, then the groups with more
  records again with all of them. (1, 3): every one of the 3 groups is taken again; (2, 1): more
  such groups than the second pass takes, so the exact per-group path. The same ḡ."""
  monkeypatch.setattr(group_norms, "two_pass_slots", lambda n, g, share, slots: (first, spill))
  fn, params, x, x_prime = make_model("mlp", 11, seed=2)
  _check_against_float64_truth(fn, params, x, x_prime, _views(x, 1))


def test_two_passes_are_taken_where_they_are_cheaper():
  slots = group_norms.capacity(1000, 125)
  first, spill = group_norms.two_pass_slots(1000, 125, 125, slots)
  assert (slots, first, spill) == (28, 13, 17)
  from scipy import stats
  assert stats.binom.sf(first, 1000, 1 / 125) <= 1 / 16 < stats.binom.sf(first - 1, 1000, 1 / 125)
  over = stats.binom.sf(first, 1000, 1 / 125)
  assert stats.binom.sf(spill, 125, over) <= group_norms.OVERFLOW_PROBABILITY
  assert 125 * first ** 2 + spill * slots ** 2 < 125 * slots ** 2 / 2
  assert group_norms.two_pass_slots(11, 3, 3, group_norms.capacity(11, 3)) == (11, 0)


@pytest.mark.parametrize("s,t,p,c", [(3, 1, 5, 4), (2, 3, 40, 30), (4, 2, 3, 2)])
def test_ghost_layer_group_norm_is_the_norm_of_the_summed_layer_gradient(s, t, p, c):
  """Both forms (within-group Gram, materialised layer gradient) against the float64 norm."""
  with jax.enable_x64(True):
    a = jax.random.normal(jax.random.PRNGKey(0), (s, t, p), jnp.float64)
    w = jax.random.normal(jax.random.PRNGKey(1), (s, t, c), jnp.float64)
    grad = jnp.einsum("stp,stc->pc", a, w)
    np.testing.assert_allclose(float(group_norms.ghost_sq_norm(a, w)), float(jnp.sum(grad ** 2)),
                               rtol=1e-12)


def test_capacity_is_a_binomial_tail_bound():
  assert group_norms.capacity(10, 1) == 10
  n, g = 512, 64
  s = group_norms.capacity(n, g)
  from scipy import stats
  assert g * stats.binom.sf(s, n, 1 / g) <= group_norms.OVERFLOW_PROBABILITY
  assert g * stats.binom.sf(s - 1, n, 1 / g) > group_norms.OVERFLOW_PROBABILITY


# Negative control: with the allowances set to 0, the tiny case releases 1.00000002·B.
@pytest.mark.parametrize(
    "spread,scale",
    [(1e-3, 1e-3), pytest.param(1e-4, 1.0, marks=pytest.mark.extended)])
def test_released_group_gradients_never_exceed_b_in_float32(spread, scale):
  """Near-identical records and views (the group gradient cancels) and tiny inputs, in
  float32: for B swept across a group's float64 norm, the released clipped group gradient (the
  group alone, the others masked) has float64 norm ≤ B."""
  fn, params, x, _ = make_model("mlp", 8, seed=4)
  x = scale * x
  x_prime = x + spread * scale * jax.random.normal(jax.random.PRNGKey(9), x.shape)
  views = x[:, None] + spread * scale * jax.random.normal(jax.random.PRNGKey(8),
                                                          (8, 2) + x.shape[1:])
  ids = jnp.arange(8)
  groups = np.asarray(logit_dp.baselines.assign_groups(ids, KEY, 2))
  loss = logit_dp.losses.contrastive(0.5)
  members = groups == groups[0]
  with jax.enable_x64(True):
    truth = _group_gradients(_group_loss(fn, *_float64((x, x_prime, views)), 0.5), _float64(params),
                             members, groups)
    norm = tree_norm(truth[0][1])
  for bound in norm * (1.0 + np.array([-1e-7, 0.0, 1e-7])):
    grad_fn = logit_dp.baselines.grouped_clipped_grad(fn, loss, float(bound), 2)
    _, released = grad_fn(params, x, x_prime, jnp.asarray(members), record_ids=ids, group_key=KEY,
                          extra_views=views)
    assert np.linalg.norm(flat(released).astype(np.float64)) <= bound, (bound, norm)


@functools.cache
def _sharded(fn, num_groups, clip_norm, num_devices, positive_fn=None, microbatch=None):
  kwargs = {} if positive_fn is None else {"positive_embed_fn": positive_fn}
  return distributed.make_sharded_grad_fn(fn, logit_dp.losses.contrastive(TEMPERATURE), clip_norm,
                                          distributed.data_mesh(num_devices), method="dp_gcl",
                                          num_groups=num_groups, microbatch_size=microbatch,
                                          **kwargs)


def _pad(a, rows):
  return jnp.concatenate([a, jnp.zeros((rows - a.shape[0],) + a.shape[1:], a.dtype)])


@pytest.mark.parametrize("towers", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_one_device_and_eight_give_the_same_gradient(towers):
  """DP-GCL on a mesh of 8 (simulated) devices: the batch of 11 records padded to 16, the
  groups' norms from the gathered factors; ḡ and ℒ are those of one device (one tower with
  extra views and microbatches; two towers)."""
  require_devices(8)
  if towers:
    fn, positive_fn, params, x, x_prime = _float_towers("shared", 11, seed=3)
    views, microbatch = None, None
  else:
    fn, params, x, x_prime = make_model("mlp", 11, seed=5)
    positive_fn, views, microbatch = None, _views(x, 2), 1
  ids = jnp.asarray(IDS)
  for clip_norm in (1e-3, 1.0):
    one = logit_dp.baselines.grouped_clipped_grad(fn, logit_dp.losses.contrastive(TEMPERATURE),
                                                  clip_norm, 3, positive_embed_fn=positive_fn,
                                                  microbatch_size=microbatch)
    want_loss, want = one(params, x, x_prime, jnp.asarray(MASK), record_ids=ids, group_key=KEY,
                          extra_views=views)
    sharded = _sharded(fn, 3, clip_norm, 8, positive_fn, microbatch)
    got_loss, got = sharded(params, _pad(x, 16), _pad(x_prime, 16), _pad(jnp.asarray(MASK), 16),
                            record_ids=_pad(ids, 16), group_key=KEY,
                            extra_views=None if views is None else _pad(views, 16))
    assert rel_err(got, want) < 1e-5, clip_norm
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    assert sharded.sensitivity() == one.sensitivity() == 2 * clip_norm


@pytest.mark.extended
def test_dropout_on_eight_devices_gives_the_single_device_gradient():
  """A stochastic model: every example keyed by its row of the global batch, on any device."""
  require_devices(8)
  f, f_prime, params, x, texts = two_towers("shared", 8, seed=2, dropout=0.5)
  loss = logit_dp.losses.contrastive(TEMPERATURE)
  key, ids = jax.random.key(11), jnp.arange(8) * 7
  kwargs = dict(positive_embed_fn=f_prime, stochastic=True)
  single = logit_dp.baselines.grouped_clipped_grad(f, loss, 0.05, 2, **kwargs)
  want_loss, want = single(params, x, texts, record_ids=ids, group_key=KEY, key=key)
  sharded = distributed.make_sharded_grad_fn(f, loss, 0.05, distributed.data_mesh(8),
                                             method="dp_gcl", num_groups=2, **kwargs)
  got_loss, got = sharded(params, x, texts, record_ids=ids, group_key=KEY, key=key)
  assert rel_err(got, want) < 1e-5
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)


def test_the_low_level_train_step_refuses_dp_gcl():
  fn, _, _, _ = make_model("mlp", 4)
  with pytest.raises(ValueError, match="make_private"):
    distributed.make_private_train_step(fn, logit_dp.losses.contrastive(), 1.0,
                                        distributed.data_mesh(2), optax.sgd(0.1), method="dp_gcl",
                                        num_groups=2)

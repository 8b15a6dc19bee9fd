"""Blocked "ghost" (memory_budget): pair blocks of r rows × c columns, column factors recomputed
per row block, column blocks passed around a ring of devices.

Every blocked configuration is compared with the one-block path (the factors of the whole batch,
which is "ghost" before the blocks), with Algorithm 1 ("materialize") and, unclipped, with
jax.grad in float64.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logit_dp
from conftest import SmallConv
from conftest import make_model
from conftest import require_devices
from helpers import rel_err
from logit_dp import distributed
from logit_dp import models
from logit_dp._src import chunking
from logit_dp._src import layerwise

LOSS = logit_dp.losses.contrastive(temperature=0.5)
N = 7
MASK = np.array([1, 1, 0, 1, 1, 1, 0], bool)
# (r, c): c divides r; r < n with and without dividing n = 7, single columns, and r > n. The
# default run keeps (4, 2) on the mlp (each case compiles two gradients; the conv net's blocks
# are checked by test_blocked_unclipped_ghost_is_float64_jax_grad and test_ring_matches_one_device);
# the others are slow.
_SLOW = pytest.mark.slow
BLOCKS = [(4, 2), (3, 1), (6, 3), (2, 2), (8, 8)]


def _force_blocks(monkeypatch, r, c):
  monkeypatch.setattr(chunking, "ghost_block_sizes", lambda *args: (r, c))


def _fresh(embed_fn):
  """A new function object: nothing jitted with other block sizes is reused."""
  return lambda p, xs: embed_fn(p, xs)


@functools.cache
def _one_block(kind):
  """(problem, clip norm, norms, ḡ of one block, norms and ḡ of materialize) on n = 7 pairs."""
  embed_fn, params, x, x_prime = make_model(kind, N, seed=1)
  exact = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "materialize",
                                            float_allowance=False))
  clip_norm = float(np.quantile(exact, 0.4))
  one = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "ghost",
                                            float_allowance=False))
  grads = {
      method: logit_dp.clipped_grad(embed_fn, LOSS, clip_norm, method)(params, x, x_prime, MASK)[1]
      for method in ("ghost", "materialize")
  }
  return (embed_fn, params, x, x_prime), clip_norm, one, exact, grads


@pytest.mark.extended
@pytest.mark.parametrize("kind,blocks", [
    pytest.param(kind, blocks, marks=() if (kind, blocks) == ("mlp", (4, 2)) else _SLOW)
    for kind in ("mlp", "conv") for blocks in BLOCKS
], ids=str)
def test_blocked_ghost_matches_one_block_and_materialize(kind, blocks, monkeypatch):
  (embed_fn, params, x, x_prime), clip_norm, one, exact, grads = _one_block(kind)
  _force_blocks(monkeypatch, *blocks)
  fresh = _fresh(embed_fn)
  norms = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(fresh, params, x, x_prime, "ghost", microbatch_size=2,
                                            float_allowance=False))
  atol = 1e-5 * float(np.max(exact))  # small norms carry the cancellation of a + b + 2c
  np.testing.assert_allclose(norms, one, rtol=1e-5, atol=atol)
  np.testing.assert_allclose(norms, exact, rtol=1e-4, atol=atol)
  _, blocked = logit_dp.clipped_grad(fresh, LOSS, clip_norm, "ghost",
                                     microbatch_size=2)(params, x, x_prime, MASK)
  assert rel_err(blocked, grads["ghost"]) < 1e-5
  assert rel_err(blocked, grads["materialize"]) < 1e-4


# Slow: a second reference (float64 jax.grad) for the path that
# test_blocked_ghost_matches_one_block_and_materialize compares with materialize by default.
@pytest.mark.slow
@pytest.mark.parametrize("blocks", [(4, 2), (3, 1)], ids=str)
def test_blocked_unclipped_ghost_is_float64_jax_grad(blocks, monkeypatch):
  embed_fn, params, x, x_prime = make_model("conv", N, seed=2)
  _force_blocks(monkeypatch, *blocks)
  _, grads = logit_dp.clipped_grad(_fresh(embed_fn), LOSS, jnp.inf, "ghost")(params, x, x_prime,
                                                                             MASK)
  with jax.enable_x64(True):
    p64, x64, xp64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64),
                                            (params, x, x_prime))

    def total(p):
      z = logit_dp.losses.cosine_similarity(embed_fn(p, x64), embed_fn(p, xp64))
      return LOSS(z, jnp.asarray(MASK))

    truth = jax.grad(total)(p64)
  assert rel_err(grads, truth) < 1e-5


@pytest.mark.extended
def test_blocked_ghost_drops_non_finite_pairs_like_one_block(monkeypatch):
  embed_fn, params, x, x_prime = make_model("mlp", N, seed=3)
  x = x.at[4, 0].set(jnp.nan)
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, 0.1, "ghost")
  loss_one, grads_one, dropped_one = jax.jit(grad_fn.with_num_dropped)(params, x, x_prime, MASK)
  _force_blocks(monkeypatch, 2, 1)
  blocked_fn = logit_dp.clipped_grad(_fresh(embed_fn), LOSS, 0.1, "ghost")
  loss_b, grads_b, dropped_b = jax.jit(blocked_fn.with_num_dropped)(params, x, x_prime, MASK)
  assert int(dropped_one) == int(dropped_b) == 1
  np.testing.assert_allclose(loss_b, loss_one, rtol=1e-6)
  assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads_b))
  assert rel_err(grads_b, grads_one) < 1e-5


def test_one_block_takes_its_embeddings_from_the_factor_pass(monkeypatch):
  """With one block of pairs, both views' embeddings come from the pass that computes their
  Jacobian factors (no forward pass of their own); they and the factors equal those computed
  apart. Blocked, the embeddings have their own forward pass."""
  from logit_dp._src import collective  # pylint: disable=g-import-not-at-top
  from logit_dp._src import methods  # pylint: disable=g-import-not-at-top
  from logit_dp._src import numerics  # pylint: disable=g-import-not-at-top
  from logit_dp._src import pair_batch  # pylint: disable=g-import-not-at-top

  embed_fn, params, x, x_prime = make_model("conv", N, seed=4)
  ghost = methods.resolve("ghost")

  def batch(params, x, x_prime, **kwargs):
    return pair_batch.PairBatch(embed_fn, params, x, x_prime, jnp.asarray(MASK),
                                eps=numerics.DEFAULT_COSINE_EPS, microbatch_size=None,
                                collective=collective.Collective(None), **kwargs)

  @jax.jit  # under jit, as in clipped_grad
  def joint_and_apart(params, x, x_prime):
    joint = batch(params, x, x_prime, embeds_with_factors=ghost.embeds_with_factors)
    apart = batch(params, x, x_prime)
    assert joint.joint_factors is not None and apart.joint_factors is None
    separate = apart.stacked_factors((apart.x, apart.x_prime))
    return (joint.u_loc, joint.v_loc, joint.joint_factors), (apart.u_loc, apart.v_loc, separate)

  joint, apart = joint_and_apart(params, x, x_prime)
  (joint_u, joint_v, joint_factors), (apart_u, apart_v, separate) = joint, apart
  np.testing.assert_allclose(joint_u, apart_u, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(joint_v, apart_v, rtol=1e-6, atol=1e-7)
  for a, b in zip(jax.tree_util.tree_leaves(joint_factors), jax.tree_util.tree_leaves(separate)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(b))))
  _force_blocks(monkeypatch, 4, 2)
  blocked = []  # traced only: whether the blocked batch holds joint factors
  jax.eval_shape(
      lambda p, a, b: blocked.append(
          batch(p, a, b, embeds_with_factors=ghost.embeds_with_factors).joint_factors is None),
      params, x, x_prime)
  assert blocked == [True]


@pytest.mark.parametrize("multiple", [1, 8])
def test_block_sizes_fit_the_budget(multiple):
  example_bytes = 1000
  for n in (1, 2, 7, 16, 100, 257):
    for k in (1, 8):
      buffers = 1 if k == 1 else 2
      for slots in (1, 2, 3, 5, 9, 17, 40, 100, 3 * n, 10 * n):
        r, c = chunking.ghost_block_sizes(n, k, example_bytes, slots * example_bytes, multiple)
        case = (n, k, slots, r, c)
        assert r >= 1 and c >= 1 and r % c == 0, case
        assert c <= multiple or c % multiple == 0 or (k, r, c) == (1, n, n), case
        if slots >= 1 + buffers:
          assert r + buffers * c <= slots, case
        if multiple == 1 and slots >= 2 * n + buffers:  # all local rows: no recomputation
          assert r >= n and r - n < c, case
    # One device with room for both views: one block, the path before the blocks.
    assert chunking.ghost_block_sizes(n, 1, example_bytes, 2 * n * example_bytes) == (n, n)


def test_memory_budget_is_checked():
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="memory_budget"):
      logit_dp.clip_methods.Ghost(memory_budget=bad)


def _temp_bytes(fn, *args) -> int:
  return int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)


@pytest.mark.slow  # four compilations of a wider conv net's ghost gradient (a memory property)
def test_blocked_temporaries_do_not_grow_with_n_like_one_block():
  """XLA's buffer assignment: one block holds both views' factors of the whole batch (grows as
  2·n·F); under a fixed budget the held factors stay put and only O(n·d + n²) grows."""
  model = SmallConv(channels=(16, 32), dim=5)
  x = jnp.zeros((64, 8, 8, 3))
  params = model.init(jax.random.PRNGKey(1), x[:1])
  plan = layerwise.make_plan(model.apply, params, x, 5)
  example_bytes = chunking.factor_bytes_per_example(plan, 5, jax.tree_util.tree_leaves(params))
  temp = {}
  for name, budget in (("one block", None), ("blocked", 12 * example_bytes)):
    fn = logit_dp.clipped_grad(model.apply, LOSS, 1.0,
                               logit_dp.clip_methods.Ghost(memory_budget=budget), microbatch_size=4)
    temp[name] = [
        _temp_bytes(fn.core, params, x[:n], x[:n], jnp.ones((n,), bool)) for n in (16, 64)
    ]
  growth = {name: t[1] - t[0] for name, t in temp.items()}
  assert growth["one block"] > 2 * 48 * example_bytes * 0.9, (temp, example_bytes)
  # Blocked: (r + c) = 12 examples' factors at both sizes; what grows is the n² pair scalars
  # (τ, norms, λ: a few (n, n) arrays) and the n·d embeddings, far below 48 examples' factors.
  assert growth["blocked"] < 0.25 * growth["one block"], (temp, example_bytes)
  assert temp["blocked"][1] < 0.5 * temp["one block"][1], temp


# ---------------------------------------------------------------- the ring of devices

N_SHARDED = 16
MASK_SHARDED = np.array([1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1], bool)


@pytest.mark.parametrize("k,blocks", [(2, (6, 3)),
                                      pytest.param(8, (2, 1), marks=_SLOW),
                                      pytest.param(2, (2, 1), marks=_SLOW),
                                      pytest.param(8, (2, 2), marks=_SLOW)], ids=str)
def test_ring_matches_one_device(k, blocks, monkeypatch):
  """Column blocks passed around k devices (with r < n/k: recomputed per row block, padded where
  the blocks do not divide n/k), microbatches and padding masks: the single-device ḡ."""
  require_devices(k)
  embed_fn, params, x, x_prime = make_model("conv", N_SHARDED)
  clip_norm = float(
      np.quantile(np.asarray(logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime)),
                  0.4))
  expected = logit_dp.clipped_grad(embed_fn, LOSS, clip_norm)(params, x, x_prime, MASK_SHARDED)
  _force_blocks(monkeypatch, *blocks)
  sharded = distributed.make_sharded_grad_fn(_fresh(embed_fn), LOSS, clip_norm,
                                             distributed.data_mesh(k), microbatch_size=3)
  value, grads = sharded(params, x, x_prime, MASK_SHARDED)
  np.testing.assert_allclose(value, expected[0], rtol=1e-5)
  assert rel_err(grads, expected[1]) < 1e-5


@pytest.mark.slow  # two compilations of a (narrow) ResNet-18 gradient, ~1 min each on 2 cores
def test_ring_per_device_memory_falls_as_one_over_k():
  """Per-device temporaries of the sharded ghost gradient, same global batch: k = 8 holds its
  n/8 rows and two column blocks of n/16 (2n/8 examples' factors), k = 1 both views of all n."""
  require_devices(8)
  model = models.ResNet18(width=4, embedding_dim=8)  # factors dominate: 30k floats per example
  n = 128
  x = jax.random.normal(jax.random.PRNGKey(0), (n, 8, 8, 3))
  params = model.init(jax.random.PRNGKey(1), x[:1])
  mask = jnp.ones((n,), bool)
  temp = {}
  for k in (1, 8):
    fn = distributed.make_sharded_grad_fn(model.apply, LOSS, 1.0, distributed.data_mesh(k))
    temp[k] = _temp_bytes(jax.jit(fn.shard_mapped), params, x, x, mask)
  assert temp[8] <= temp[1] / 6, temp

"""Fine-tuning (`make_private(..., trainable=)`, `logit_dp.finetune`): frozen leaves are constants.

The references are independent of the implementation: the model with the frozen leaves closed
over by hand (``closed_embed``), whose pair norms and gradients come from `jax.grad` of each
Z_ij (or of each group's loss, or of the batch loss) in float64. The negative controls are the
two attempts a user makes without ``trainable=``: ``jax.lax.stop_gradient`` on the frozen layer
(noise and adam still move it) and ``optax.multi_transform`` with ``set_to_zero`` (the layer
stays, but its gradient counts in every pair norm).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logit_dp
from helpers import assert_noise_std
from helpers import flat
from helpers import float64_clipped_reference
from helpers import noise_std_is_rejected
from helpers import rel_err
from logit_dp import finetune
from logit_dp import models

LOSS = logit_dp.losses.contrastive(temperature=0.5)
# The body (first layer) is pretrained and frozen; the head is fine-tuned. A prefix of params.
TRAINABLE = {"body": False, "head": True}
EPS = logit_dp.losses.DEFAULT_COSINE_EPS


def embed_fn(params, x):
  h = jnp.tanh(x @ params["body"]["w"] + params["body"]["b"])
  return h @ params["head"]["w"] + params["head"]["b"]


def stop_gradient_embed(params, x):
  """The first attempt: the body behind jax.lax.stop_gradient."""
  return embed_fn({"body": jax.lax.stop_gradient(params["body"]), "head": params["head"]}, x)


def closed_embed(body):
  """The reference model: the head alone, the body closed over by hand."""
  def fn(head, x):
    return embed_fn({"body": body, "head": head}, x)

  return fn


def make_params(seed=0, d_in=6, hidden=8, dim=4, dtype=jnp.float32):
  k = jax.random.split(jax.random.key(seed), 4)
  return {
      "body": {
          "w": (jax.random.normal(k[0], (d_in, hidden)) / 2).astype(dtype),
          "b": (0.1 * jax.random.normal(k[1], (hidden,))).astype(dtype)
      },
      "head": {
          "w": (jax.random.normal(k[2], (hidden, dim)) / 2).astype(dtype),
          "b": (0.1 * jax.random.normal(k[3], (dim,))).astype(dtype)
      },
  }


def make_pairs(n=8, d_in=6, seed=1, dtype=jnp.float32):
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (n, d_in))
  return x.astype(dtype), (x + 0.5 * jax.random.normal(k2, (n, d_in))).astype(dtype)


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _assert_bit_identical(new, old):
  for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(old), strict=True):
    np.testing.assert_array_equal(_bits(a), _bits(b))


def _max_change(new, old) -> float:
  return float(np.max(np.abs(flat(new) - flat(old))))


@pytest.fixture
def no_norm_allowance(monkeypatch):
  """Clip by the computed norms themselves, to compare with the exact float64 mechanism."""
  from logit_dp._src import numerics  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(numerics, "GRAM_FLOAT_ERROR", 0.0)
  monkeypatch.setattr(numerics, "VECTOR_FLOAT_ERROR", 0.0)


# ---------------------------------------------------------------------------------------------
# Pair norms, group norms and ḡ are those of the closed-over model.


def _method(name, x):
  if name != "projected":
    return name
  reference = jax.random.uniform(jax.random.key(7), (4,) + x.shape[1:], x.dtype)
  return logit_dp.clip_methods.Projected(reference_inputs=reference, rank=16)


@pytest.mark.parametrize("method", [
    "ghost", "projected",
    pytest.param("materialize", marks=pytest.mark.extended),
    pytest.param("triangle", marks=pytest.mark.extended)
])
def test_pair_norms_and_gradient_are_those_of_the_closed_over_model_in_float64(
    method, no_norm_allowance):
  with jax.enable_x64(True):
    params = make_params(dtype=jnp.float64)
    x, x_prime = make_pairs(dtype=jnp.float64)
    closed = closed_embed(params["body"])
    truth, _ = float64_clipped_reference(closed, LOSS, params["head"], x, x_prime, 1.0, eps=EPS)
    norms = np.asarray(
        logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, _method(method, x),
                                              trainable=TRAINABLE, float_allowance=False))
    exact = method in ("ghost", "materialize")
    if exact:  # the exact norms of the closed-over model
      np.testing.assert_allclose(norms, truth, rtol=1e-9)
      clip_by = truth
    else:  # an upper bound of them, exact on the positive pairs, and the method's own bound
      assert np.all(norms >= truth * (1 - 1e-9))
      np.testing.assert_allclose(np.diag(norms), np.diag(truth), rtol=1e-9)
      np.testing.assert_array_equal(
          norms,
          logit_dp.clip_methods.pair_grad_norms(closed, params["head"], x, x_prime,
                                                _method(method, x), float_allowance=False))
      clip_by = norms
    clip_norm = float(np.median(truth))  # about half of the pairs are clipped
    _, want = float64_clipped_reference(closed, LOSS, params["head"], x, x_prime, clip_norm,
                                        clip_by=clip_by, eps=EPS)
    grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, clip_norm, _method(method, x),
                                    trainable=TRAINABLE)
    _, grads = grad_fn(params, x, x_prime)
    assert rel_err(grads["head"], want) < 1e-9
    for leaf in jax.tree_util.tree_leaves(grads["body"]):  # exact zeros on the frozen leaves
      assert not np.any(np.asarray(leaf))

    # Negative control (optax.multi_transform with set_to_zero): the model of every leaf, whose
    # frozen layer's gradient counts in every pair norm, fails the same check.
    full = np.asarray(
        logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, _method(method, x),
                                              float_allowance=False))
    assert not np.allclose(full, truth, rtol=1e-3)
    assert np.median(full) > 1.2 * np.median(truth)
    _, full_grads = logit_dp.clipped_grad(embed_fn, LOSS, clip_norm, _method(method, x))(params, x,
                                                                                         x_prime)
    assert rel_err(full_grads["head"], want) > 1e-3


def _group_reference(closed, head, x, x_prime, groups, clip_norm):
  """(Σ_g ‖∇L_g‖ of every group, Σ_g min(1, B/‖∇L_g‖)·∇L_g) by jax.grad of each group's
  contrastive loss on the closed-over model (float64)."""
  def group_loss(h, members):
    z = logit_dp.losses.cosine_similarity(closed(h, x[members]), closed(h, x_prime[members]))
    return LOSS(z)

  norms, total = [], jax.tree_util.tree_map(jnp.zeros_like, head)
  group_grad = jax.jit(jax.grad(group_loss))  # compiled per group size, not per operation
  for g in np.unique(groups):
    grad = group_grad(head, np.flatnonzero(groups == g))
    norm = float(np.linalg.norm(flat(grad)))
    norms.append(norm)
    factor = min(1.0, clip_norm / norm)
    total = jax.tree_util.tree_map(lambda t, gr, f=factor: t + f * gr, total, grad)
  return np.asarray(norms), total


def test_naive_and_dp_gcl_norms_and_gradients_are_those_of_the_closed_over_model_in_float64(
    no_norm_allowance):
  with jax.enable_x64(True):
    params = make_params(dtype=jnp.float64)
    x, x_prime = make_pairs(n=12, dtype=jnp.float64)
    closed = closed_embed(params["body"])

    # Naive-DP: the batch gradient of the closed-over model, clipped.
    def batch_loss(h):
      return LOSS(logit_dp.losses.cosine_similarity(closed(h, x), closed(h, x_prime)))

    grad = jax.jit(jax.grad(batch_loss))(params["head"])
    norm = float(np.linalg.norm(flat(grad)))
    naive = logit_dp.baselines.naive_clipped_grad(embed_fn, LOSS, norm / 2, trainable=TRAINABLE)
    _, grads, stats = naive.with_stats(params, x, x_prime)
    np.testing.assert_allclose(float(stats.quantiles[-1]), norm, rtol=1e-9)
    assert rel_err(grads["head"], jax.tree_util.tree_map(lambda g: g / 2, grad)) < 1e-9
    assert not np.any(flat(grads["body"]))
    _, _, full_stats = logit_dp.baselines.naive_clipped_grad(embed_fn, LOSS, norm / 2).with_stats(
        params, x, x_prime)
    assert float(full_stats.quantiles[-1]) > 1.2 * norm  # negative control: set_to_zero

    # DP-GCL: every group's loss gradient of the closed-over model, clipped.
    ids, key, num_groups = np.arange(12), jax.random.key(5), 3
    groups = np.asarray(logit_dp.baselines.assign_groups(ids, key, num_groups))
    norms, _ = _group_reference(closed, params["head"], x, x_prime, groups, np.inf)
    clip_norm = float(np.median(norms))
    _, want = _group_reference(closed, params["head"], x, x_prime, groups, clip_norm)
    grouped = logit_dp.baselines.grouped_clipped_grad(embed_fn, LOSS, clip_norm, num_groups,
                                                      trainable=TRAINABLE)
    _, grads, stats = grouped.with_stats(params, x, x_prime, record_ids=ids, group_key=key)
    np.testing.assert_allclose(
        np.asarray(stats.quantiles)[[0, -1]], [norms.min(), norms.max()], rtol=1e-9)
    assert rel_err(grads["head"], want) < 1e-9
    assert not np.any(flat(grads["body"]))
    _, _, full_stats = logit_dp.baselines.grouped_clipped_grad(
        embed_fn, LOSS, clip_norm, num_groups).with_stats(params, x, x_prime, record_ids=ids,
                                                          group_key=key)
    assert float(full_stats.quantiles[-1]) > 1.2 * norms.max()  # negative control: set_to_zero


# ---------------------------------------------------------------------------------------------
# Frozen leaves get no noise and no update.

N = 64


def _records(n=N, d_in=6, seed=3):
  x, x_prime = make_pairs(n=n, d_in=d_in, seed=seed)
  return np.asarray(x), np.asarray(x_prime)


def _private(embed=embed_fn, *, steps=4, optimizer=None, **kwargs):
  args = dict(target_epsilon=4.0, target_delta=1e-5, num_records=N, expected_batch_size=12,
              steps=steps, optimizer=optax.adam(0.05) if optimizer is None else optimizer,
              mean=True, noise_key=jax.random.key(11), sampler_seed=5)
  args.update(kwargs)
  return logit_dp.make_private(embed, LOSS, 1.0, **args)


def _train(private, params, data, **step_kwargs):
  step = private.make_train_step(**step_kwargs)
  state = private.optimizer.init(params)
  for batch in private.batches():
    params, state, *_ = step(params, state, batch, data)
  return params, state


def _frozen_params():
  params = make_params(seed=2)
  # A negative zero in a frozen leaf: p + 0.0 would turn it into +0.0, the step keeps its bits.
  params["body"]["b"] = params["body"]["b"].at[0].set(-0.0)
  return params


@pytest.mark.parametrize("method", [
    "ghost",
    pytest.param("materialize", marks=pytest.mark.extended),
    pytest.param("triangle", marks=pytest.mark.extended),
    pytest.param("naive", marks=pytest.mark.extended),
    pytest.param("dp_gcl", marks=pytest.mark.extended),
])
def test_frozen_leaves_are_bit_identical_after_training_with_adam(method):
  params, data = _frozen_params(), _records()
  grouping = {"group_size": 4} if method == "dp_gcl" else {}
  private = _private(method=method, trainable=TRAINABLE, **grouping)
  trained, state = _train(private, params, data)
  _assert_bit_identical(trained["body"], params["body"])
  assert np.signbit(np.asarray(trained["body"]["b"])[0])
  assert _max_change(trained["head"], params["head"]) > 1e-3  # the head trains
  # Adam keeps no state for the frozen leaves: its moments hold the head's values only.
  head_size = flat(params["head"]).size
  moments = [
      leaf for leaf in jax.tree_util.tree_leaves(state)
      if getattr(leaf, "ndim", 0) >= 1 and leaf.dtype == jnp.float32
  ]
  assert sum(leaf.size for leaf in moments) == 2 * head_size

  # Negative control: the frozen layer behind jax.lax.stop_gradient, with the same adam,
  # moves (the noise is added to every leaf).
  moved, _ = _train(_private(stop_gradient_embed, method=method, **grouping), params, data)
  assert _max_change(moved["body"], params["body"]) > 1e-3


def test_noise_only_on_trainable_leaves_at_the_calibrated_std():
  # A head of 2,048 coordinates: over 3 updates the χ² test has power ≥ 0.99 against a std 15 %
  # off (assert_noise_std checks it). The user optimizer is the identity, so each update is the
  # noisy ḡ itself; the gradient fed in is zero, so the update is the noise.
  params = {
      "body": {"w": jnp.ones((6, 32)), "b": jnp.zeros((32,))},
      "head": {"w": jnp.ones((32, 64)), "b": jnp.zeros((64,))}
  }
  zero = jax.tree_util.tree_map(jnp.zeros_like, params)

  def noise_of(private, steps=3):
    state, draws = private.optimizer.init(params), []
    for _ in range(steps):
      updates, state = private.optimizer.update(zero, state, params)
      draws.append(updates)
    return draws

  private = _private(optimizer=optax.identity(), mean=False, trainable=TRAINABLE)
  std = private.noise_multiplier * private.sensitivity
  draws = noise_of(private)
  assert_noise_std([d["head"] for d in draws], std)
  for d in draws:
    for leaf in jax.tree_util.tree_leaves(d["body"]):
      assert not np.any(np.asarray(leaf))  # exactly zero, not merely small

  # Negative control (today's stop_gradient, and set_to_zero before the optimizer): without
  # trainable= the frozen leaves are noised at the full std too.
  plain = noise_of(_private(optimizer=optax.identity(), mean=False))
  assert np.any(flat([d["body"] for d in plain]))
  assert not noise_std_is_rejected([d["body"]["w"] for d in plain], std)
  assert noise_std_is_rejected([d["body"]["w"] for d in draws], std)


@pytest.mark.extended
def test_make_private_trains_what_the_closed_over_model_trains():
  """The trained head is the one the closed-over model trains with the same noise key and
  sampler seed (the noise is drawn for the head's leaves alone in both)."""
  params, data = make_params(seed=4), _records()
  trained, _ = _train(_private(trainable=TRAINABLE), params, data)
  head, _ = _train(_private(closed_embed(params["body"])), params["head"], data)
  np.testing.assert_allclose(flat(trained["head"]), flat(head), rtol=1e-5, atol=1e-6)


def test_bad_trainable_raises_naming_trainable():
  params = make_params()
  x, x_prime = make_pairs()
  for bad, error in [
      ({"body": False, "neck": True}, ValueError),  # not params' structure
      ({"body": {"w": False}, "head": True}, ValueError),  # body's structure is not params'
      ([False, True], ValueError),  # a list for a dict
      ({"body": 0, "head": 1}, TypeError),  # not bools
      ({"body": "frozen", "head": "trained"}, TypeError),  # optax labels, not bools
      ({"body": False, "head": jnp.ones(3, bool)}, TypeError),  # an array, not a bool
  ]:
    with pytest.raises(error, match="trainable"):
      logit_dp.clipped_grad(embed_fn, LOSS, 1.0, trainable=bad)(params, x, x_prime)
  for nothing in ({"body": False, "head": False}, {}):
    with pytest.raises(ValueError, match="trainable"):
      _private(trainable=nothing)
  with pytest.raises(ValueError, match="trainable"):  # a predicate that freezes every leaf
    logit_dp.clipped_grad(embed_fn, LOSS, 1.0, trainable=lambda path, leaf: False)(params, x,
                                                                                   x_prime)
  with pytest.raises(TypeError, match="trainable"):  # a predicate that returns an array
    logit_dp.clipped_grad(embed_fn, LOSS, 1.0, trainable=lambda path, leaf: leaf > 0)(params, x,
                                                                                      x_prime)
  private = _private(trainable={"body": False, "neck": True})
  with pytest.raises(ValueError, match="trainable"):  # the optimizer checks it too
    private.optimizer.init(params)


# ---------------------------------------------------------------------------------------------
# Everything else works with trainable= (extended).


def _head_predicate(path, leaf):
  del leaf
  return jax.tree_util.keystr(path).startswith("['head']")


@pytest.mark.extended
def test_predicate_prefix_mask_and_full_mask_are_the_same():
  params = make_params()
  full = jax.tree_util.tree_map(lambda _: True, params)
  full["body"] = jax.tree_util.tree_map(lambda _: False, params["body"])
  for trainable in (TRAINABLE, full, _head_predicate):
    assert finetune.trainable_mask(trainable, params) == full
    part, frozen = finetune.partition(params, trainable)
    assert part["body"] == {"w": None, "b": None} and frozen["head"] == {"w": None, "b": None}
    _assert_bit_identical(finetune.combine(part, frozen), params)


@pytest.mark.extended
def test_mesh_training_is_the_single_device_training():
  params, data = _frozen_params(), _records()
  single, _ = _train(_private(trainable=TRAINABLE), params, data)
  mesh = logit_dp.distributed.data_mesh(4)
  sharded, _ = _train(_private(trainable=TRAINABLE, mesh=mesh), params, data)
  _assert_bit_identical(sharded["body"], params["body"])
  np.testing.assert_allclose(flat(sharded["head"]), flat(single["head"]), rtol=1e-5, atol=1e-6)
  grouped, _ = _train(_private(trainable=_head_predicate, mesh=mesh, method="dp_gcl", group_size=4),
                      params, data)
  _assert_bit_identical(grouped["body"], params["body"])


@pytest.mark.extended
def test_checkpoint_round_trip_keeps_the_frozen_leaves_and_resumes(tmp_path):
  params, data = _frozen_params(), _records()
  whole, _ = _train(_private(trainable=TRAINABLE), params, data)

  private = _private(trainable=TRAINABLE)
  step, state = private.make_train_step(), private.optimizer.init(params)
  p = params
  for batch in private.batches(steps=2):
    p, state, _ = step(p, state, batch, data)
  private.save_checkpoint(tmp_path, (p, state))
  template = (params, private.optimizer.init(params))
  (p, state), resumed = _private(trainable=TRAINABLE).restore_checkpoint(tmp_path, template)
  _assert_bit_identical(p["body"], params["body"])  # saved with the params, restored as saved
  assert resumed.ledger.steps == 2
  step = resumed.make_train_step()
  for batch in resumed.batches():
    p, state, _ = step(p, state, batch, data)
  _assert_bit_identical(p, whole)


@pytest.mark.extended
def test_clip_statistics_are_those_of_the_closed_over_model():
  params, data = make_params(seed=6), _records()
  private = _private(trainable=TRAINABLE)
  batch = next(iter(private.batches(steps=1)))
  step = private.make_train_step(clip_stats=True)
  *_, stats = step(params, private.optimizer.init(params), batch, data)
  x, x_prime = data[0][batch.indices], data[1][batch.indices]
  closed = logit_dp.clipped_grad(closed_embed(params["body"]), LOSS, 1.0)
  _, _, want = closed.with_stats(params["head"], x, x_prime, batch.mask)
  np.testing.assert_allclose(np.asarray(stats.quantiles), np.asarray(want.quantiles), rtol=1e-6)
  assert int(stats.num_clipped) == int(want.num_clipped)


@pytest.mark.extended
@pytest.mark.parametrize("method", ["ghost", "dp_gcl"])
def test_person_level_training_keeps_the_frozen_leaves(method):
  params, data = _frozen_params(), _records()
  user_ids = np.arange(N) // 2
  grouping = {"group_size": 2} if method == "dp_gcl" else {}
  private = _private(method=method, trainable=TRAINABLE, user_ids=user_ids, max_pairs_per_user=2,
                     expected_batch_size=8, **grouping)
  plain = _private(method=method, user_ids=user_ids, max_pairs_per_user=2, expected_batch_size=8,
                   **grouping)
  assert private.sensitivity == plain.sensitivity
  assert private.noise_multiplier == plain.noise_multiplier
  trained, _ = _train(private, params, data)
  _assert_bit_identical(trained["body"], params["body"])
  assert _max_change(trained["head"], params["head"]) > 1e-3


@pytest.mark.extended
def test_two_towers_and_dropout_are_those_of_the_closed_over_model():
  params = make_params(seed=8)
  params["text"] = {"w": jax.random.normal(jax.random.key(9), (5, 4)) / 2}
  trainable = {"body": False, "head": True, "text": True}
  x, _ = make_pairs(n=8)
  texts = jax.random.normal(jax.random.key(10), (8, 5))

  def text_tower(p, t, key):
    keep = jax.random.bernoulli(key, 0.8, t.shape)
    return (t * keep / 0.8) @ p["text"]["w"]

  def image_tower(p, xs, key):
    del key
    return embed_fn(p, xs)

  key = jax.random.key(12)
  grad_fn = logit_dp.clipped_grad(image_tower, LOSS, 0.5, positive_embed_fn=text_tower,
                                  stochastic=True, trainable=trainable)
  _, grads = grad_fn(params, x, texts, key=key)
  body = params["body"]
  rest = {"head": params["head"], "text": params["text"]}
  closed = logit_dp.clipped_grad(lambda p, xs, k: image_tower(dict(p, body=body), xs, k), LOSS, 0.5,
                                 positive_embed_fn=lambda p, t, k: text_tower(p, t, k),
                                 stochastic=True)
  _, want = closed(rest, x, texts, key=key)
  assert rel_err({"head": grads["head"], "text": grads["text"]}, want) < 1e-6
  assert not np.any(flat(grads["body"]))


@pytest.mark.extended
def test_lora_adapter_trains_through_trainable_and_its_base_stays():
  """A pretrained MLP's kernels frozen, a rank-2 LoRA adapter beside each trained."""
  x_all, x_prime_all = _records(d_in=12)
  plain = models.MLPEmbedding(embedding_dim=4, hidden=(16,))
  pretrained = plain.init(jax.random.key(1), x_all[:1])
  adapted = models.MLPEmbedding(embedding_dim=4, hidden=(16,), lora_rank=2)
  from flax import traverse_util  # pylint: disable=g-import-not-at-top
  merged = traverse_util.flatten_dict(adapted.init(jax.random.key(2), x_all[:1]))
  merged.update(traverse_util.flatten_dict(pretrained))
  params = traverse_util.unflatten_dict(merged)
  # The adapter starts as the identity change: the adapted model is the pretrained one.
  np.testing.assert_array_equal(adapted.apply(params, x_all), plain.apply(pretrained, x_all))

  private = _private(adapted.apply, trainable=models.is_lora, steps=3)
  trained, _ = _train(private, params, (x_all, x_prime_all))
  base, _ = finetune.partition(params, lambda path, leaf: not models.is_lora(path, leaf))
  trained_base, _ = finetune.partition(trained, lambda path, leaf: not models.is_lora(path, leaf))
  _assert_bit_identical(trained_base, base)
  assert _max_change(trained["params"]["Dense_0"]["lora_b"],
                     params["params"]["Dense_0"]["lora_b"]) > 1e-3

  # Its pair norms are those of the adapter alone (materialize on the closed-over model).
  part, frozen = finetune.partition(trained, models.is_lora)
  norms = logit_dp.clip_methods.pair_grad_norms(adapted.apply, trained, x_all[:8], x_prime_all[:8],
                                                trainable=models.is_lora)
  want = logit_dp.clip_methods.pair_grad_norms(finetune.closed(adapted.apply, frozen), part,
                                               x_all[:8], x_prime_all[:8], "materialize")
  np.testing.assert_allclose(np.asarray(norms), np.asarray(want), rtol=1e-3)


@pytest.mark.extended
@pytest.mark.parametrize("make_embed", [functools.partial(models.EmbeddingNet, channels=(4, 8))])
def test_frozen_convolutions_keep_ghost_norms_exact(make_embed):
  model = make_embed(embedding_dim=4)
  x = jax.random.normal(jax.random.key(0), (6, 8, 8, 3))
  x_prime = x + 0.5 * jax.random.normal(jax.random.key(1), x.shape)
  params = model.init(jax.random.key(2), x[:1])
  trainable = {"params": {"Conv_0": False, "Conv_1": True, "Dense_0": True}}
  part, frozen = finetune.partition(params, trainable)
  norms = logit_dp.clip_methods.pair_grad_norms(model.apply, params, x, x_prime,
                                                trainable=trainable, float_allowance=False)
  want = logit_dp.clip_methods.pair_grad_norms(finetune.closed(model.apply, frozen), part, x,
                                               x_prime, "materialize", float_allowance=False)
  np.testing.assert_allclose(np.asarray(norms), np.asarray(want), rtol=1e-3)


@pytest.mark.extended
def test_low_level_mesh_step_takes_the_masked_noise_and_keeps_the_frozen_leaves():
  """distributed.make_private_train_step with trainable= and make_private_optimizer(trainable=):
  the masked noise counts as the noise that comes first; an optimizer without it is refused."""
  params = _frozen_params()
  x, x_prime = make_pairs(n=8)
  mesh = logit_dp.distributed.data_mesh(4)
  optimizer = logit_dp.distributed.make_private_optimizer(0.5, 1.0, jax.random.key(0),
                                                          optax.adam(0.05), trainable=TRAINABLE)
  step = logit_dp.distributed.make_private_train_step(embed_fn, LOSS, 1.0, mesh, optimizer,
                                                      trainable=TRAINABLE)
  state = logit_dp.distributed.replicate(optimizer.init(params), mesh)
  p = logit_dp.distributed.replicate(params, mesh)
  for _ in range(2):
    p, state, _ = step(p, state, x, x_prime)
  _assert_bit_identical(p["body"], params["body"])
  assert _max_change(p["head"], params["head"]) > 1e-3
  unnoised = logit_dp.distributed.make_private_train_step(
      embed_fn, LOSS, 1.0, mesh, finetune.masked_optimizer(optax.adam(0.05), TRAINABLE),
      trainable=TRAINABLE)
  with pytest.raises(ValueError, match="noise"):
    unnoised(p, finetune.masked_optimizer(optax.adam(0.05), TRAINABLE).init(params), x, x_prime)

"""Tests of logit_dp.models: architecture, initialisation, per-example independence."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logit_dp
from logit_dp import models


def _init(model, shape, seed=0):
  return jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros(shape))


def _shapes(model, shape):
  """Parameter shapes without running anything (jax.eval_shape: no compilation)."""
  return jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros(shape))


def test_embedding_net_architecture():
  model = models.EmbeddingNet()
  params = _shapes(model, (1, 32, 32, 3))
  p = params["params"]
  assert [p[f"Conv_{i}"]["kernel"].shape for i in range(3)] == [(3, 3, 3, 8), (3, 3, 8, 16),
                                                                (3, 3, 16, 32)]
  assert p["Dense_0"]["kernel"].shape == (32, 8)
  x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
  out, inter = jax.eval_shape(lambda p, x: model.apply(p, x, capture_intermediates=True), params, x)
  assert out.shape == (2, 8)
  shapes = [inter["intermediates"][f"Conv_{i}"]["__call__"][0].shape for i in range(3)]
  assert shapes == [(2, 16, 16, 8), (2, 8, 8, 16), (2, 4, 4, 32)]  # stride 2, NHWC
  # 8x8 digits: 4 -> 2 -> 1.
  out8 = jax.eval_shape(model.apply, _shapes(model, (1, 8, 8, 1)),
                        jax.ShapeDtypeStruct((3, 8, 8, 1), jnp.float32))
  assert out8.shape == (3, 8)


@pytest.mark.slow  # initialises the paper's net at 32×32 four times; flax's initialisers' stds
def test_embedding_net_initialisers():
  """Kaiming-normal convolutions, Xavier-normal dense layer (std within sampling error)."""
  model = models.EmbeddingNet()
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  # lazy_init materialises only the parameters (no forward pass to compile).
  spec = jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32)
  all_params = jax.jit(jax.vmap(lambda k: model.lazy_init(k, spec)))(keys)
  stds_conv, stds_dense = [], []
  for seed in range(4):
    p = jax.tree_util.tree_map(lambda leaf, seed=seed: leaf[seed], all_params)["params"]
    k = np.asarray(p["Conv_2"]["kernel"])
    stds_conv.append(k.std() / np.sqrt(2.0 / (3 * 3 * 16)))
    d = np.asarray(p["Dense_0"]["kernel"])
    stds_dense.append(d.std() / np.sqrt(2.0 / (32 + 8)))
    assert abs(k.mean()) < 0.1 * k.std()
  assert np.mean(stds_conv) == pytest.approx(1.0, abs=0.05)
  assert np.mean(stds_dense) == pytest.approx(1.0, abs=0.12)


@pytest.mark.parametrize("model", [
    models.EmbeddingNet(),
    pytest.param(models.ResNet18(width=4, norm=None), marks=pytest.mark.slow),
    pytest.param(models.ResNet18(width=4, norm="group", num_groups=2), marks=pytest.mark.slow),
], ids=["embedding_net", "resnet18", "resnet18_groupnorm"])
def test_examples_are_independent(model):
  """No batch statistics: an example's embedding does not depend on the rest of the batch."""
  rng = np.random.default_rng(0)
  x = rng.uniform(size=(3, 8, 8, 3)).astype(np.float32)
  params = _init(model, (1, 8, 8, 3))
  assert "batch_stats" not in params
  x2 = x.copy()
  x2[1:] = rng.uniform(size=(2, 8, 8, 3))
  both = jax.jit(model.apply)(params, np.concatenate([x, x2]))
  a, b = both[:3], both[3:]
  np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-6)
  assert not np.allclose(a[1], b[1])


def test_resnet18_size_and_norms():
  shapes = jax.eval_shape(models.ResNet18().init, jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))
  n = sum(np.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(shapes))
  assert 11.0e6 < n < 11.3e6  # ResNet-18 (CIFAR variant, 8-d head): ~11.2M parameters
  flat = flax.traverse_util.flatten_dict(shapes["params"])
  assert not any("BatchNorm" in "/".join(k) for k in flat)
  gn = jax.eval_shape(
      models.ResNet18(norm="group").init, jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))
  assert any("GroupNorm" in "/".join(k) for k in flax.traverse_util.flatten_dict(gn["params"]))
  with pytest.raises(ValueError, match="batch norm"):
    models.ResNet18(norm="batch").init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 3)))


def test_finetune_head():
  head = models.FinetuneHead()
  params = _shapes(head, (1, 8))["params"]
  assert [params[f"Dense_{i}"]["kernel"].shape for i in range(3)] == [(8, 64), (64, 32), (32, 20)]


def test_make_model():
  assert isinstance(models.make_model("embedding_net", embedding_dim=4), models.EmbeddingNet)
  assert isinstance(models.make_model("resnet18"), models.ResNet18)
  with pytest.raises(ValueError):
    models.make_model("vgg")


@pytest.mark.slow
def test_embedding_net_with_logit_dp_clipping():
  model = models.EmbeddingNet()
  params = _init(model, (1, 8, 8, 1))
  x = jax.random.uniform(jax.random.PRNGKey(0), (6, 8, 8, 1))
  xp = jax.random.uniform(jax.random.PRNGKey(1), (6, 8, 8, 1))
  loss = logit_dp.losses.contrastive()
  _, g = logit_dp.clipped_grad(model.apply, loss, clip_norm=1e-3)(params, x, xp)
  norm = np.sqrt(sum(float(jnp.sum(leaf ** 2)) for leaf in jax.tree_util.tree_leaves(g)))
  # Each pair gradient is clipped to 1e-3 and weighted by |tau_ij|; sum_ij |tau_ij| <= 2n.
  assert 0 < norm <= 2 * 6 * 1e-3 + 1e-9

"""Data loading, positive pairs, samplers (no record over-represented) and augmentations."""

import os
import sys

# `experiments/` is not an installed package: make the repository root importable
# (also when pytest is started as `pytest` rather than `python -m pytest`).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import logit_dp.sampling
from experiments import augment
from experiments import data as data_lib
from experiments import train


def test_digits_nhwc_stratified_and_seeded():
  ds = data_lib.load_digits(seed=3)
  assert ds["x_train"].shape[1:] == (8, 8, 1) and ds["x_train"].dtype == np.float32
  assert ds["x_train"].min() >= 0 and ds["x_train"].max() <= 1
  assert len(ds["y_train"]) + len(ds["y_test"]) == 1797
  frac_tr = np.bincount(ds["y_train"]) / len(ds["y_train"])
  frac_te = np.bincount(ds["y_test"]) / len(ds["y_test"])
  np.testing.assert_allclose(frac_tr, frac_te, atol=0.01)  # stratified
  again = data_lib.load_digits(seed=3)
  np.testing.assert_array_equal(again["y_test"], ds["y_test"])


def _fake_npz(path, coarse=True, n=40):
  rng = np.random.default_rng(0)
  arrays = dict(x_train=rng.integers(0, 256, (n, 32, 32, 3),
                                     dtype=np.uint8), y_train=rng.integers(0, 100, n),
                x_test=rng.integers(0, 256, (10, 32, 32, 3),
                                    dtype=np.uint8), y_test=rng.integers(0, 100, 10))
  if coarse:
    arrays["y_train_coarse"] = arrays["y_train"] // 5
    arrays["y_test_coarse"] = arrays["y_test"] // 5
  np.savez(path, **arrays)
  return arrays


def test_npz_source_with_coarse_labels_and_subset(tmp_path):
  arrays = _fake_npz(tmp_path / "cifar100.npz")
  cfg = ml_collections.ConfigDict(
      dict(source="npz", name="cifar100", label="coarse", npz_dir=str(tmp_path), train_subset=25,
           test_subset=None))
  ds = data_lib.load_dataset(cfg, seed=0)
  assert ds["x_train"].shape == (25, 32, 32, 3) and ds["x_train"].dtype == np.uint8
  assert ds["y_train"].max() < 20
  np.testing.assert_array_equal(ds["y_test"], arrays["y_test_coarse"])
  x = data_lib.to_float(jnp.asarray(ds["x_train"][:2]))
  assert x.dtype == jnp.float32 and float(x.max()) <= 1.0


def test_missing_npz_explains_unpack(tmp_path, monkeypatch):
  monkeypatch.delenv("LOGIT_DP_CIFAR_DIR", raising=False)
  cfg = ml_collections.ConfigDict(dict(source="npz", name="cifar10", label="fine", npz_dir=None))
  with pytest.raises(FileNotFoundError, match="unpack.py"):
    data_lib.load_dataset(cfg)
  cfg.npz_dir = str(tmp_path)
  with pytest.raises(FileNotFoundError, match="unpack.py"):
    data_lib.load_dataset(cfg)


def test_tfds_source_with_mock_data():
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=12):
    ds = data_lib.load_tfds("cifar100", label="coarse")
  assert ds["x_train"].shape[1:] == (32, 32, 3)
  assert ds["y_train"].max() < 20


@pytest.mark.slow
def test_real_cifar_npz():
  d = os.environ.get("LOGIT_DP_CIFAR_DIR")
  if not d or not os.path.exists(os.path.join(d, "cifar100.npz")):
    pytest.skip(
        "set LOGIT_DP_CIFAR_DIR to a folder made by `python <shared>/data/unpack.py --out DIR`")
  c10 = data_lib.load_npz(d, "cifar10")
  assert c10["x_train"].shape == (50000, 32, 32, 3) and c10["num_classes"] == 10
  c100 = data_lib.load_npz(d, "cifar100", label="coarse")
  assert c100["num_classes"] == 20 and c100["x_test"].shape == (10000, 32, 32, 3)
  pairs = data_lib.make_pairs(c10["y_train"], "same_class", 0)
  assert len(pairs) == 25000 and len(np.unique(pairs)) == 50000


# ---------------------------------------------------------------------------
# Pairs.


def test_same_class_pairs_are_disjoint_and_same_class():
  labels = np.random.default_rng(0).integers(0, 7, 501)
  pairs = data_lib.make_pairs(labels, "same_class", seed=1)
  assert np.all(labels[pairs[:, 0]] == labels[pairs[:, 1]])
  assert np.all(pairs[:, 0] != pairs[:, 1])
  assert len(np.unique(pairs)) == pairs.size  # every image in at most one record
  assert len(pairs) == sum(np.bincount(labels) // 2)
  aug = data_lib.make_pairs(labels, "augment", seed=1)
  np.testing.assert_array_equal(aug[:, 0], np.arange(501))
  np.testing.assert_array_equal(aug[:, 1], np.arange(501))


# ---------------------------------------------------------------------------
# Samplers: no record may be over-represented.


def _z_scores(counts, steps, q):
  """Per-record z-scores of inclusion counts against Binomial(steps, q)."""
  return (counts - steps * q) / np.sqrt(steps * q * (1 - q))


def _pipeline_batcher(method, num_records, batch_size, seed=0):
  cfg = ml_collections.ConfigDict(dict(batch_size=batch_size, num_epochs=1, noise_multiplier=1.0))
  info = train.privacy_plan(cfg, num_records) if method != "non_private" else {}
  return train._Batcher(method, num_records, info, batch_size, seed)  # pylint: disable=protected-access


def released_code_bug_batches(pairs_jax, num_images, batch_size, steps):
  """The bug of the authors' released code: R = N/2 pairs indexed by a permutation of
  N image indices. JAX/TF gathers clamp out-of-range indices, so every index >= R
  selects the last pair, which then fills about half of every batch."""
  rng = np.random.default_rng(0)
  perms = np.stack([rng.permutation(num_images)[:batch_size] for _ in range(steps)])
  return pairs_jax[jnp.asarray(perms)]  # (steps, batch, 2), clamped gather


def test_poisson_pipeline_includes_every_record_with_probability_q():
  num_records, batch, steps = 250, 50, 300
  batcher = _pipeline_batcher("logit_dp", num_records, batch)
  q = batcher.sampler.sampling_rate
  assert q == pytest.approx(batch / num_records)
  counts = data_lib.inclusion_counts(batcher, num_records, steps)
  z = _z_scores(counts, steps, q)
  assert np.abs(z).max() < 5.0, z.max()
  # Mean over all records is q to within sampling error.
  assert counts.mean() / steps == pytest.approx(q, abs=4 * np.sqrt(q / (steps * num_records)))


def test_inclusion_check_catches_the_released_code_bug():
  num_images, batch, steps = 500, 50, 200
  labels = np.repeat(np.arange(10), 50)
  pairs = data_lib.make_pairs(labels, "same_class", 0)
  num_records = len(pairs)  # 250 = num_images / 2
  pj = jnp.asarray(np.concatenate([np.arange(num_records)[:, None]] * 2, 1))
  rec = np.asarray(released_code_bug_batches(pj, num_images, batch, steps))[..., 0]
  counts = np.bincount(rec.ravel(), minlength=num_records)
  q = batch / num_images  # what the bug believes
  z = _z_scores(counts, steps, q)
  assert counts[-1] > 0.4 * batch * steps  # one pair fills ~half of every batch
  assert np.abs(z).max() > 50  # the over-representation check fails loudly


def test_shuffled_epochs_visit_every_record_once():
  num_records, batch = 103, 20
  batcher = _pipeline_batcher("non_private", num_records, batch)
  nb = -(-num_records // batch)
  for epoch in range(3):
    seen = []
    for j in range(nb):
      idx, mask = batcher(epoch * nb + j)
      seen.extend(np.asarray(idx)[np.asarray(mask)].tolist())
    assert sorted(seen) == list(range(num_records))


def test_training_batches_use_each_image_at_most_once_per_epoch():
  labels = np.repeat(np.arange(5), 21)
  pairs = data_lib.make_pairs(labels, "same_class", 0)
  batcher = _pipeline_batcher("non_private", len(pairs), 16)
  images = []
  for t in range(-(-len(pairs) // 16)):
    idx, mask = batcher(t)
    images.extend(pairs[np.asarray(idx)[np.asarray(mask)]].ravel().tolist())
  assert len(images) == len(set(images)) == 2 * len(pairs)


def test_poisson_overflow_is_an_error():
  sampler = logit_dp.sampling.PoissonSampler(num_records=100, sampling_rate=0.5, max_batch_size=10,
                                             seed=0)
  with pytest.raises(logit_dp.sampling.BatchOverflowError):
    sampler(0)


# ---------------------------------------------------------------------------
# Augmentations.


def test_augment_shapes_range_determinism():
  x = jax.random.uniform(jax.random.PRNGKey(0), (3, 8, 8, 3))
  f = jax.jit(lambda k, x: augment.augment_batch(k, x, crop_padding=2))
  a1, a2 = f(jax.random.PRNGKey(1), x), f(jax.random.PRNGKey(1), x)
  b = f(jax.random.PRNGKey(2), x)
  assert a1.shape == x.shape
  assert float(a1.min()) >= 0 and float(a1.max()) <= 1
  np.testing.assert_array_equal(a1, a2)
  assert not np.allclose(a1, b)
  # Two views of the same image differ (the augment pair mode).
  assert not np.allclose(a1[0], f(jax.random.PRNGKey(3), x)[0])


def test_augment_identity_and_flip():
  x = jax.random.uniform(jax.random.PRNGKey(0), (8, 8, 1))
  ident = jax.jit(lambda k, x: augment.augment_image(k, x, crop_padding=0, flip=False, brightness=0,
                                                     contrast=0, saturation=0))(
                                                         jax.random.PRNGKey(0), x)
  np.testing.assert_array_equal(ident, x)
  flip = jax.jit(augment.random_flip)
  for s in range(6):
    y = flip(jax.random.PRNGKey(s), x)
    assert np.array_equal(y, x) or np.array_equal(y, x[:, ::-1])


def test_crop_is_a_shifted_window():
  x = jnp.arange(36.0).reshape(6, 6, 1) / 36
  y = jax.jit(augment.random_crop, static_argnums=2)(jax.random.PRNGKey(5), x, 2)
  padded = np.pad(np.asarray(x), ((2, 2), (2, 2), (0, 0)), mode="reflect")
  windows = [padded[i:i + 6, j:j + 6] for i in range(5) for j in range(5)]
  assert any(np.array_equal(np.asarray(y), w) for w in windows)


def test_color_jitter_grayscale_and_rgb():
  x = np.full((4, 4, 3), 0.5, np.float32)
  x[0, 0] = [1.0, 0.0, 0.0]
  jitter = jax.jit(lambda k, x: augment.color_jitter(k, x, 0.5, 0.5, 0.5))
  y = jitter(jax.random.PRNGKey(0), x)
  assert y.shape == x.shape and float(y.min()) >= 0 and float(y.max()) <= 1
  g = jitter(jax.random.PRNGKey(0), x[..., :1])
  assert g.shape == (4, 4, 1)

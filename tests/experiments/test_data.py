"""Data loading, positive pairs, samplers (no record over-represented) and augmentations."""

import dataclasses
import hashlib
import io
import itertools
import json
import os
import pickle
import shutil
import sys
import tarfile

# `experiments/` is not an installed package: make the repository root importable
# (also when pytest is started as `pytest` rather than `python -m pytest`).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import logit_dp.sampling
from experiments import augment
from experiments import cifar
from experiments import data as data_lib
from experiments import train
from experiments.configs import tiny


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


def test_missing_npz_in_a_given_folder_explains_the_options(tmp_path, monkeypatch):
  monkeypatch.delenv("LOGIT_DP_CIFAR_DIR", raising=False)
  cfg = ml_collections.ConfigDict(
      dict(source="npz", name="cifar10", label="fine", npz_dir=str(tmp_path)))
  with pytest.raises(FileNotFoundError, match="python -m experiments.cifar --out DIR"):
    data_lib.load_dataset(cfg)
  monkeypatch.setenv("LOGIT_DP_CIFAR_DIR", str(tmp_path))
  cfg.npz_dir = None
  with pytest.raises(FileNotFoundError, match="cifar10.npz does not exist"):
    data_lib.load_dataset(cfg)


def test_npz_label_must_be_fine_or_coarse(tmp_path):
  _fake_npz(tmp_path / "cifar10.npz", coarse=False)
  with pytest.raises(ValueError, match="'fine' or 'coarse'"):
    data_lib.load_npz(str(tmp_path), "cifar10", label="superclass")
  with pytest.raises(ValueError, match="no coarse labels"):
    data_lib.load_npz(str(tmp_path), "cifar10", label="coarse")


# ---------------------------------------------------------------------------
# The official archives: a small archive in the official pickle layout, served from a file:// URL.


def _official_layout_archive(path, name, sizes=(3, 2, 4, 1, 2), test_size=5, seed=0):
  """A .tar.gz laid out as the official ``name`` archive (Python-2 pickles with byte-string keys,
  images as rows of 3,072 bytes: 1,024 red, 1,024 green, 1,024 blue, each row-major), with
  ``sizes`` images in its training batches (CIFAR-10: one per batch; CIFAR-100: their sum in
  one), and the images and labels it holds."""
  rng = np.random.default_rng(seed)
  folder = "cifar-10-batches-py" if name == "cifar10" else "cifar-100-python"
  if name == "cifar100":
    sizes = (sum(sizes),)
  members, images, labels = {}, {}, {}
  for split, split_sizes in (("train", sizes), ("test", (test_size,))):
    rows, fine = [], []
    for b, n in enumerate(split_sizes):
      data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
      y = rng.integers(0, 10 if name == "cifar10" else 100, n).tolist()
      if name == "cifar10":
        member = f"data_batch_{b + 1}" if split == "train" else "test_batch"
        members[member] = {b"batch_label": b"batch", b"labels": y, b"data": data}
      else:
        members[split] = {b"fine_labels": y, b"coarse_labels": [v // 5 for v in y], b"data": data}
      rows.append(data)
      fine.extend(y)
    images[split], labels[split] = np.concatenate(rows), np.asarray(fine)
  if name == "cifar10":
    members["batches.meta"] = {b"label_names": [f"class{c}".encode() for c in range(10)]}
  else:
    members["meta"] = {
        b"fine_label_names": [f"fine{c}".encode() for c in range(100)],
        b"coarse_label_names": [f"coarse{c}".encode() for c in range(20)]
    }
  with tarfile.open(path, "w:gz") as tar:
    for member, content in members.items():
      payload = pickle.dumps(content, protocol=2)
      info = tarfile.TarInfo(f"{folder}/{member}")
      info.size = len(payload)
      tar.addfile(info, io.BytesIO(payload))
  return images, labels


def _serve(tmp_path, monkeypatch, name, corrupt=False):
  """Writes the archive of ``name`` into a served folder and registers its checksums as the
  published ones; returns the folder's file:// URL, the images and labels."""
  served = tmp_path / "served"
  served.mkdir(exist_ok=True)
  archive = cifar.ARCHIVES[name]
  path = served / archive.filename
  images, labels = _official_layout_archive(path, name)
  raw = path.read_bytes()
  monkeypatch.setitem(
      cifar.ARCHIVES, name,
      dataclasses.replace(archive, size=len(raw), md5=hashlib.md5(raw).hexdigest(),
                          sha256=hashlib.sha256(raw).hexdigest()))
  if corrupt:  # one byte of the served copy changes after publication
    path.write_bytes(raw[:100] + bytes([raw[100] ^ 1]) + raw[101:])
  return served.as_uri(), images, labels


def _pixel(rows, i, r, c, channel):
  """Pixel (r, c) of image i in the official layout: channel planes of 32 rows of 32."""
  return rows[i, channel * 1024 + r * 32 + c]


def test_published_checksums_are_well_formed():
  for name, archive in cifar.ARCHIVES.items():
    assert archive.filename == f"{name.replace('cifar', 'cifar-')}-python.tar.gz"
    assert len(archive.md5) == 32 and len(archive.sha256) == 64
    int(archive.md5, 16), int(archive.sha256, 16)  # hexadecimal
    assert archive.size > 160_000_000


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_download_verifies_and_unpacks_the_official_layout(tmp_path, monkeypatch, name):
  url, images, labels = _serve(tmp_path, monkeypatch, name)
  cache = tmp_path / "cache"
  path = cifar.prepare(name, str(cache), base_url=url)
  assert path == str(cache / f"{name}.npz")
  assert (cache / cifar.ARCHIVES[name].filename).exists()  # kept: verified, reused
  assert not [p for p in os.listdir(cache) if p.endswith(".part")]
  with np.load(path) as f:
    arrays = dict(f)
  keys = {"x_train", "y_train", "x_test", "y_test"}
  keys |= {"y_train_coarse", "y_test_coarse"} if name == "cifar100" else set()
  assert set(arrays) == keys
  for split in ("train", "test"):
    x = arrays[f"x_{split}"]
    assert x.shape == (len(labels[split]), 32, 32, 3) and x.dtype == np.uint8
    rows = images[split]
    for i, r, c, channel in itertools.product(range(len(rows)), (0, 7, 31), (0, 19, 31), range(3)):
      assert x[i, r, c, channel] == _pixel(rows, i, r, c, channel)
    np.testing.assert_array_equal(arrays[f"y_{split}"], labels[split])
    assert arrays[f"y_{split}"].dtype == np.int64
    if name == "cifar100":
      np.testing.assert_array_equal(arrays[f"y_{split}_coarse"], labels[split] // 5)
  names = json.loads((cache / f"{name}_label_names.json").read_text())
  if name == "cifar10":
    assert names == {"label_names": [f"class{c}" for c in range(10)]}
  else:
    assert names["fine_label_names"][99] == "fine99" and len(names["coarse_label_names"]) == 20


def test_a_corrupted_download_is_refused_and_deleted(tmp_path, monkeypatch):
  url, _, _ = _serve(tmp_path, monkeypatch, "cifar10", corrupt=True)
  cache = tmp_path / "cache"
  with pytest.raises(cifar.ChecksumError, match="is not the official cifar-10-python.tar.gz"):
    cifar.prepare("cifar10", str(cache), base_url=url)
  assert os.listdir(cache) == []  # neither the archive nor a partial file nor an npz


def test_a_corrupted_archive_already_present_is_refused(tmp_path, monkeypatch):
  url, _, _ = _serve(tmp_path, monkeypatch, "cifar100")
  cache = tmp_path / "cache"
  cache.mkdir()
  archive = cache / cifar.ARCHIVES["cifar100"].filename
  good = (tmp_path / "served" / archive.name).read_bytes()
  archive.write_bytes(good[:-1])  # truncated
  with pytest.raises(cifar.ChecksumError, match="size .*; md5 .*; sha256"):
    cifar.prepare("cifar100", str(cache), base_url=url)
  assert not (cache / "cifar100.npz").exists()


def test_a_failed_download_says_how_to_work_offline(tmp_path):
  missing = (tmp_path / "nowhere").as_uri()
  with pytest.raises(cifar.DownloadError, match="--config.data.npz_dir=DIR"):
    cifar.prepare("cifar10", str(tmp_path / "cache"), base_url=missing)


def test_offline_archives_are_unpacked_without_download(tmp_path, monkeypatch, capsys):
  _, images, _ = _serve(tmp_path, monkeypatch, "cifar10")
  out = tmp_path / "npz"
  offline = (tmp_path / "nowhere").as_uri()  # a download would fail
  cifar.main(f"--out={out} --datasets=cifar10 --archive_dir={tmp_path / 'served'} "
             f"--base_url={offline}".split())
  assert capsys.readouterr().out.strip() == str(out / "cifar10.npz")
  ds = data_lib.load_npz(str(out), "cifar10")
  assert ds["x_train"].shape == (len(images["train"]), 32, 32, 3) and ds["num_classes"] <= 10


def test_npz_source_without_a_folder_downloads_into_the_cache_once(tmp_path, monkeypatch):
  url, images, labels = _serve(tmp_path, monkeypatch, "cifar100")
  monkeypatch.delenv("LOGIT_DP_CIFAR_DIR", raising=False)
  monkeypatch.setenv("LOGIT_DP_DATA_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(cifar, "OFFICIAL_BASE_URL", url)
  assert cifar.default_data_dir() == str(tmp_path / "cache")
  cfg = ml_collections.ConfigDict(dict(source="npz", name="cifar100", label="coarse", npz_dir=None))
  ds = data_lib.load_dataset(cfg)
  np.testing.assert_array_equal(ds["y_test"], labels["test"] // 5)
  assert ds["x_train"].shape[0] == len(images["train"])
  shutil.rmtree(tmp_path / "served")  # the second load reads the cache
  again = data_lib.load_dataset(cfg)
  np.testing.assert_array_equal(again["x_train"], ds["x_train"])


def test_default_cache_folder(monkeypatch, tmp_path):
  monkeypatch.delenv("LOGIT_DP_DATA_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert cifar.default_data_dir() == str(tmp_path / "logit_dp")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert cifar.default_data_dir() == str(tmp_path / "home" / ".cache" / "logit_dp")


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
        "set LOGIT_DP_CIFAR_DIR to a folder made by `python -m experiments.cifar --out DIR`")
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
  """The batches of the training pipeline: the private run's Poisson sampler (as
  `train.make_private_training` sets it up, unbudgeted), the non-private run's epochs."""
  if method == "non_private":
    return train._Batcher(num_records, batch_size, seed)  # pylint: disable=protected-access
  cfg = tiny.get_config()
  cfg.batch_size, cfg.num_epochs, cfg.noise_multiplier = batch_size, 1, 1.0
  apply_fn = train.get_model(cfg.model)[1]
  training = train.make_private_training(cfg, method, apply_fn, num_records, jax.random.PRNGKey(0),
                                         sampling_seed=seed)
  return training.sampler.unbudgeted()


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
  q = batcher.sampling_rate
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

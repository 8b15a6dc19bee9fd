"""Datasets, positive pairs and batch samplers for the experiments.

Sources (``config.data.source``):

* ``digits`` -- scikit-learn's 8x8 handwritten digits (ships inside scikit-learn,
  works offline): NHWC ``(n, 8, 8, 1)`` float32 in [0, 1], stratified split.
* ``npz`` -- Keras-style ``cifar10.npz`` / ``cifar100.npz`` (``x_train``,
  ``y_train``, ``x_test``, ``y_test`` and ``y_*_coarse`` for CIFAR-100) in
  ``config.data.npz_dir`` (an offline copy), else in ``$LOGIT_DP_CIFAR_DIR``, else in the cache
  folder (:func:`experiments.cifar.default_data_dir`: ``$LOGIT_DP_DATA_DIR``, else
  ``~/.cache/logit_dp``), where the official archive is downloaded, checked against its
  published checksums and unpacked the first time (:mod:`experiments.cifar`).
* ``tfds`` -- ``tensorflow_datasets`` (optional extra ``logit_dp[tfds]``; needs internet
  or a prepared TFDS data dir), imported lazily.

Records and pairs.  Training samples *records*, each record being a positive
pair of image indices ``pairs[r] = (i, j)``:

* ``augment``: one record per image, ``pairs[r] = (r, r)``; the two views are two
  random augmentations made on the device (the unsupervised setting).
* ``same_class``: the images of every class are shuffled once (seeded) and cut into
  disjoint pairs ``(i, j)`` of two *different* images of that class, so every image
  belongs to at most one record (an odd image out per class is dropped).  A record
  is therefore the unit of privacy.

Batches never over-represent a record: DP runs use ``logit_dp.sampling.PoissonSampler``
(every record joins independently with probability exactly ``q``, padded to a fixed
size with a validity mask), the non-private run ``logit_dp.sampling.ShuffledBatcher``
(every record exactly once per epoch).  :func:`inclusion_counts` checks this.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import cifar

__all__ = [
    "load_dataset",
    "load_digits",
    "load_npz",
    "load_tfds",
    "make_pairs",
    "same_class_pairs",
    "inclusion_counts",
    "to_float",
    "MISSING_NPZ_HELP",
]

CIFAR_DIR_ENV = "LOGIT_DP_CIFAR_DIR"
MISSING_NPZ_HELP = (
    "Pass --config.data.npz_dir=DIR with a folder holding Keras-style cifar10.npz / "
    "cifar100.npz (`python -m experiments.cifar --out DIR` makes them from the official "
    "archives, `--archive_dir` for offline copies of the archives), or leave npz_dir unset to "
    "download them into the cache folder; or use --config.data.source=tfds "
    "(`pip install 'logit_dp[tfds]'`).")


def to_float(x):
  """uint8 images -> float32 in [0, 1]; float images are returned as float32."""
  if x.dtype == jnp.uint8 or x.dtype == np.uint8:
    return x.astype(jnp.float32) / 255.0
  return x.astype(jnp.float32)


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> dict[str, np.ndarray]:
  """scikit-learn's 8x8 digits as NHWC float32 in [0, 1], stratified train/test split."""
  from sklearn.datasets import load_digits as _load
  from sklearn.model_selection import train_test_split
  d = _load()
  x = (d.images / 16.0).astype(np.float32)[..., None]
  y = d.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed,
                                            stratify=y)
  return dict(x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te, num_classes=10)


def _npz_path(npz_dir: str | None, name: str, cache_dir: str | None = None) -> str:
  """The npz of ``name``: in ``npz_dir``, else ``$LOGIT_DP_CIFAR_DIR``, else prepared in the
  cache (downloaded and verified the first time)."""
  npz_dir = npz_dir or os.environ.get(CIFAR_DIR_ENV)
  if not npz_dir:
    return cifar.prepare(name, cache_dir)
  path = cifar.npz_path(npz_dir, name)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist.\n" + MISSING_NPZ_HELP)
  return path


def load_npz(npz_dir: str | None, name: str = "cifar10", label: str = "fine",
             cache_dir: str | None = None):
  """Loads ``{npz_dir}/{name}.npz``; ``label='coarse'`` uses ``y_*_coarse`` (CIFAR-100).

  Without ``npz_dir`` (and ``$LOGIT_DP_CIFAR_DIR``), the npz in ``cache_dir`` (default
  :func:`experiments.cifar.default_data_dir`), made from the official archive if missing.
  """
  if label not in ("fine", "coarse"):
    raise ValueError(f"label must be 'fine' or 'coarse', not {label!r}")
  with np.load(_npz_path(npz_dir, name, cache_dir)) as f:
    suffix = "_coarse" if label == "coarse" else ""
    if "y_train" + suffix not in f:
      raise ValueError(f"{name}.npz has no {label} labels (y_train{suffix})")
    out = dict(x_train=f["x_train"], y_train=f["y_train" + suffix].astype(np.int32),
               x_test=f["x_test"], y_test=f["y_test" + suffix].astype(np.int32))
  out["num_classes"] = int(max(out["y_train"].max(), out["y_test"].max()) + 1)
  return out


def load_tfds(name: str = "cifar10", label: str = "fine", data_dir: str | None = None):
  """Loads CIFAR through ``tensorflow_datasets`` (lazy import; optional extra)."""
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover - depends on the optional extra
    raise ImportError("source='tfds' needs tensorflow-datasets: pip install 'logit_dp[tfds]'. "
                      "Or use source='npz'.\n" + MISSING_NPZ_HELP) from e
  key = "coarse_label" if (label == "coarse" and name == "cifar100") else "label"
  out = {}
  for split in ("train", "test"):
    ds = tfds.load(name, split=split, batch_size=-1, data_dir=data_dir)
    ds = tfds.as_numpy(ds)
    out[f"x_{split}"] = np.asarray(ds["image"], np.uint8)
    out[f"y_{split}"] = np.asarray(ds[key], np.int32)
  out["num_classes"] = int(max(out["y_train"].max(), out["y_test"].max()) + 1)
  return out


def _subset(x, y, n, rng):
  if n is None or n <= 0 or n >= len(y):
    return x, y
  idx = np.sort(rng.permutation(len(y))[:n])  # data may be grouped by class: shuffle first
  return x[idx], y[idx]


CLASS_NAMES = {
    "cifar10":
        ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
    "cifar100_coarse":
        ("aquatic mammals", "fish", "flowers", "food containers", "fruit and vegetables",
         "household electrical devices", "household furniture", "insects", "large carnivores",
         "large man-made outdoor things", "large natural outdoor scenes",
         "large omnivores and herbivores", "medium mammals", "non-insect invertebrates", "people",
         "reptiles", "small mammals", "trees", "vehicles 1", "vehicles 2"),
}


def class_names(data_config, num_classes: int):
  """Names of the classes of ``data_config`` (CIFAR-10, CIFAR-100 coarse), else "0", "1", …."""
  name = data_config.get("name", "")
  if name == "cifar100":
    name += "_" + data_config.get("label", "fine")
  names = CLASS_NAMES.get(name)
  if names is None or len(names) != num_classes:
    names = tuple(str(c) for c in range(num_classes))
  return list(names)


def load_dataset(data_config, seed: int = 0) -> dict[str, np.ndarray]:
  """Dispatches on ``data_config.source``; applies ``train_subset`` / ``test_subset``."""
  source = data_config.source
  if source == "digits":
    ds = load_digits(seed=seed, test_fraction=data_config.get("test_fraction", 0.2))
  elif source == "npz":
    ds = load_npz(data_config.get("npz_dir"), data_config.name, data_config.get("label", "fine"))
  elif source == "tfds":
    ds = load_tfds(data_config.name, data_config.get("label", "fine"),
                   data_config.get("tfds_data_dir"))
  else:
    raise ValueError(f"unknown data source {source!r} (digits, npz or tfds)")
  rng = np.random.default_rng(seed + 1)
  ds["x_train"], ds["y_train"] = _subset(ds["x_train"], ds["y_train"],
                                         data_config.get("train_subset"), rng)
  ds["x_test"], ds["y_test"] = _subset(ds["x_test"], ds["y_test"], data_config.get("test_subset"),
                                       rng)
  return ds


def reference_images(name: str, split: str, num: int, seed: int = 0, source: str = "npz",
                     npz_dir: str | None = None, label: str = "fine") -> np.ndarray:
  """``num`` images of data set ``name``'s ``split`` ("train" or "test"), drawn without
  replacement with ``seed`` and kept in their stored order, as stored (uint8 for npz): the
  public reference inputs of clip_method="projected"."""
  data_config = ml_collections.ConfigDict(
      dict(source=source, name=name, npz_dir=npz_dir, label=label))
  images = np.asarray(load_dataset(data_config, seed=0)["x_" + split])
  return images[np.sort(np.random.default_rng(seed).permutation(len(images))[:num])]


# ---------------------------------------------------------------------------
# Positive pairs.


def same_class_pairs(labels: np.ndarray, seed: int) -> np.ndarray:
  """Disjoint pairs of two different images of the same class, ``(R, 2)`` int32.

  Every image index appears in at most one pair, so every record (pair) is
  distinct and no image is over-represented.
  """
  rng = np.random.default_rng(seed)
  labels = np.asarray(labels)
  out = []
  for c in np.unique(labels):
    idx = rng.permutation(np.flatnonzero(labels == c))
    m = len(idx) // 2 * 2
    out.append(idx[:m].reshape(-1, 2))
  pairs = np.concatenate(out, axis=0)
  return pairs[rng.permutation(len(pairs))].astype(np.int32)


def make_pairs(labels: np.ndarray, mode: str, seed: int) -> np.ndarray:
  """Records as ``(R, 2)`` image-index pairs for ``mode`` in {'augment', 'same_class'}."""
  if mode == "augment":
    r = np.arange(len(labels), dtype=np.int32)
    return np.stack([r, r], axis=1)
  if mode == "same_class":
    return same_class_pairs(labels, seed)
  raise ValueError(f"unknown pair mode {mode!r} (augment or same_class)")


# ---------------------------------------------------------------------------
# Batches come from logit_dp.sampling (PoissonSampler for DP runs, ShuffledBatcher
# for the non-private run); see experiments.train._Batcher.


def inclusion_counts(batch_fn: Callable[[int], tuple], num_records: int, steps: int) -> np.ndarray:
  """How many times each record was (validly) drawn in ``steps`` calls of ``batch_fn(step)``.

  ``batch_fn`` returns ``(indices, mask, ...)``.  Used to check that no record is
  over-represented (e.g. a permutation of 2N indices folded onto N records).
  """
  counts = np.zeros(num_records, np.int64)
  for t in range(steps):
    out = batch_fn(t)
    idx, mask = np.asarray(out[0]), np.asarray(out[1])
    np.add.at(counts, idx[mask], 1)
  return counts

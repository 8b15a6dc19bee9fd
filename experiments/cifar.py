r"""CIFAR-10 and CIFAR-100 from the official archives, verified and unpacked to Keras-style npz.

    python -m experiments.cifar --out DIR                      # both data sets, downloaded
    python -m experiments.cifar --out DIR --archive_dir ADIR   # offline: archives already in ADIR

The archives are the "python version" files of https://www.cs.toronto.edu/~kriz/cifar.html
(``cifar-10-python.tar.gz``, ``cifar-100-python.tar.gz``). Every archive is checked against its
published size, MD5 and SHA-256 before a byte of it is unpickled; a mismatch raises
:class:`ChecksumError` and a download that fails it is deleted. The pickles are read straight from
the archive (nothing is extracted to disk) and written as ``{name}.npz`` with ``x_train`` /
``x_test`` of shape ``(n, 32, 32, 3)`` uint8 (NHWC, RGB), ``y_train`` / ``y_test`` int64 (the
fine labels for CIFAR-100) and, for CIFAR-100, ``y_train_coarse`` / ``y_test_coarse``: the layout
of ``keras.datasets``. The class names go to ``{name}_label_names.json`` (``label_names`` for
CIFAR-10; ``fine_label_names`` and ``coarse_label_names`` for CIFAR-100).

Without a folder, :func:`prepare` uses the cache folder :func:`default_data_dir`:
``$LOGIT_DP_DATA_DIR``, else ``$XDG_CACHE_HOME/logit_dp``, else ``~/.cache/logit_dp``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request

import numpy as np

DATA_DIR_ENV = "LOGIT_DP_DATA_DIR"
OFFICIAL_BASE_URL = "https://www.cs.toronto.edu/~kriz/"


@dataclasses.dataclass(frozen=True)
class Archive:
  """An official CIFAR archive: its file name, published checksums and pickle layout."""
  filename: str
  size: int
  md5: str
  sha256: str
  folder: str  # the folder the pickles lie in inside the archive
  train_members: tuple[str, ...]
  test_member: str
  meta_member: str
  label_keys: dict[str, str]  # npz suffix ("" or "_coarse") -> label key of the pickles
  name_keys: tuple[str, ...]  # label-name keys of the meta pickle


ARCHIVES = {
    "cifar10":
        Archive(filename="cifar-10-python.tar.gz", size=170_498_071,
                md5="c58f30108f718f92721af3b95e74349a",
                sha256="6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
                folder="cifar-10-batches-py", train_members=tuple(
                    f"data_batch_{i}" for i in range(1, 6)), test_member="test_batch",
                meta_member="batches.meta", label_keys={"": "labels"}, name_keys=("label_names",)),
    "cifar100":
        Archive(filename="cifar-100-python.tar.gz", size=169_001_437,
                md5="eb9058c3a382ffc7106e4002c42a8d85",
                sha256="85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",
                folder="cifar-100-python", train_members=("train",), test_member="test",
                meta_member="meta", label_keys={"": "fine_labels", "_coarse": "coarse_labels"},
                name_keys=("fine_label_names", "coarse_label_names")),
}


class ChecksumError(ValueError):
  """An archive whose size, MD5 or SHA-256 differs from the published one."""


class DownloadError(OSError):
  """An archive that could not be fetched."""


def default_data_dir() -> str:
  """``$LOGIT_DP_DATA_DIR``, else ``$XDG_CACHE_HOME/logit_dp``, else ``~/.cache/logit_dp``."""
  if os.environ.get(DATA_DIR_ENV):
    return os.path.expanduser(os.environ[DATA_DIR_ENV])
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache, "logit_dp")


def _archive(name: str) -> Archive:
  if name not in ARCHIVES:
    raise ValueError(f"unknown data set {name!r}: one of {sorted(ARCHIVES)}")
  return ARCHIVES[name]


def verify(path: str, name: str) -> None:
  """Checks the archive at ``path`` against the published size, MD5 and SHA-256 of ``name``.

  Raises:
    ChecksumError: any of the three differs.
  """
  archive = _archive(name)
  md5, sha256, size = hashlib.md5(usedforsecurity=False), hashlib.sha256(), 0
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      md5.update(block)
      sha256.update(block)
      size += len(block)
  found = dict(size=size, md5=md5.hexdigest(), sha256=sha256.hexdigest())
  expected = dict(size=archive.size, md5=archive.md5, sha256=archive.sha256)
  wrong = [f"{k} {found[k]} (expected {expected[k]})" for k in expected if found[k] != expected[k]]
  if wrong:
    raise ChecksumError(f"{path} is not the official {archive.filename}: " + "; ".join(wrong)
                        + ". Delete it and download it again.")


def fetch(name: str, directory: str, base_url: str | None = None, timeout_s: float = 60.0) -> str:
  """The verified archive of ``name`` in ``directory``, downloaded from ``base_url`` if absent.

  An archive already in ``directory`` is verified, never replaced. A download goes to a temporary
  file in ``directory`` and takes the archive's name only once it verifies; one that does not is
  deleted. ``base_url`` defaults to the official site, ``OFFICIAL_BASE_URL``.

  Raises:
    ChecksumError: the archive (found or downloaded) differs from the official one.
    DownloadError: the download failed (e.g. no network).
  """
  archive = _archive(name)
  path = os.path.join(directory, archive.filename)
  if os.path.exists(path):
    verify(path, name)
    return path
  os.makedirs(directory, exist_ok=True)
  url = (base_url or OFFICIAL_BASE_URL).rstrip("/") + "/" + archive.filename
  logging.info("downloading %s to %s", url, path)
  fd, partial = tempfile.mkstemp(dir=directory, prefix=archive.filename + ".", suffix=".part")
  try:
    with os.fdopen(fd, "wb") as out:
      try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
          shutil.copyfileobj(response, out, 1 << 20)
      except (urllib.error.URLError, OSError) as e:
        raise DownloadError(
            f"could not download {url}: {e}. Offline, pass --config.data.npz_dir=DIR with a "
            f"folder holding {name}.npz (`python -m experiments.cifar --out DIR "
            "--archive_dir ARCHIVES` makes it from the official archives), or use "
            "--config.data.source=tfds.") from e
    verify(partial, name)
    os.replace(partial, path)
  finally:
    if os.path.exists(partial):
      os.remove(partial)
  return path


def _unpickle(tar: tarfile.TarFile, member: str) -> dict:
  try:
    f = tar.extractfile(member)
  except KeyError:
    f = None
  if f is None:
    raise ValueError(f"{tar.name} has no file {member}: not an official CIFAR archive")
  with f:
    return pickle.load(f, encoding="bytes")  # verified archive: the official pickles


def read_archive(path: str, name: str) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
  """The Keras-style arrays and the class names of the archive at ``path`` (not verified here).

  Each pickled image is a row of 3,072 bytes, the red, green and blue 32×32 planes one after
  another, each row-major: ``x[i, r, c, ch] = data[i, 1024·ch + 32·r + c]``. Training batches
  are concatenated in their order.

  Returns:
    ``(arrays, label_names)``: ``arrays`` with ``x_train``, ``y_train``, ``x_test``, ``y_test``
    (and the ``_coarse`` labels of CIFAR-100), ``label_names`` keyed as in the meta pickle.
  """
  archive = _archive(name)
  arrays = {}
  with tarfile.open(path, "r:gz") as tar:
    for split, members in (("train", archive.train_members), ("test", (archive.test_member,))):
      batches = [_unpickle(tar, f"{archive.folder}/{m}") for m in members]
      data = np.concatenate([np.asarray(b[b"data"], np.uint8) for b in batches])
      arrays[f"x_{split}"] = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).copy()
      for suffix, key in archive.label_keys.items():
        labels = np.concatenate([np.asarray(b[key.encode()], np.int64) for b in batches])
        if len(labels) != len(data):
          raise ValueError(f"{path}: {len(labels)} {key} for {len(data)} {split} images")
        arrays[f"y_{split}{suffix}"] = labels
    meta = _unpickle(tar, f"{archive.folder}/{archive.meta_member}")
  names = {k: [n.decode() for n in meta[k.encode()]] for k in archive.name_keys}
  return arrays, names


def npz_path(directory: str, name: str) -> str:
  """``{directory}/{name}.npz``."""
  return os.path.join(os.path.expanduser(directory), f"{name}.npz")


def prepare(name: str, out_dir: str | None = None, archive_dir: str | None = None,
            base_url: str | None = None) -> str:
  """``{out_dir}/{name}.npz``, made from the official archive if it is not there yet.

  Args:
    name: "cifar10" or "cifar100".
    out_dir: where the npz (and, unless ``archive_dir`` is given, the archive) go; default
      :func:`default_data_dir`.
    archive_dir: a folder that already holds the official archive (offline copies); default
      ``out_dir``, where a missing archive is downloaded.
    base_url: where a missing archive is downloaded from; default the official site.

  Returns:
    The path of the npz file.
  """
  out_dir = os.path.expanduser(out_dir or default_data_dir())
  path = npz_path(out_dir, name)
  if os.path.exists(path):
    return path
  archive_path = fetch(name, os.path.expanduser(archive_dir or out_dir), base_url)
  arrays, names = read_archive(archive_path, name)
  os.makedirs(out_dir, exist_ok=True)
  fd, partial = tempfile.mkstemp(dir=out_dir, prefix=f"{name}.", suffix=".npz")
  os.close(fd)
  try:
    np.savez(partial, **arrays)
    with open(os.path.join(out_dir, f"{name}_label_names.json"), "w") as f:
      json.dump(names, f, indent=1)
    os.replace(partial, path)
  finally:
    if os.path.exists(partial):
      os.remove(partial)
  return path


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m experiments.cifar", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=None, help="folder of the npz files (default: the cache)")
  parser.add_argument("--datasets", default="cifar10,cifar100", help="comma-separated names")
  parser.add_argument("--archive_dir", default=None,
                      help="folder that already holds the official archives (no download)")
  parser.add_argument("--base_url", default=OFFICIAL_BASE_URL, help="where archives come from")
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  for name in args.datasets.split(","):
    print(prepare(name.strip(), args.out, args.archive_dir, args.base_url), flush=True)


if __name__ == "__main__":
  main()

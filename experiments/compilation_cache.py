"""JAX's persistent compilation cache for the experiments: a second start does not recompile.

Each private method's training step takes tens of seconds to compile on a CPU. With the cache
on, a run that finds its programs compiled by an earlier one (same code, shapes, flags and JAX
version) loads them from disk instead. The training scripts (``pretrain.py``, ``finetune.py``,
``clip.py``) turn it on by default in ``<workdir>/.jax_cache``, so a resumed or repeated run
starts at once; ``--compilation_cache_dir=DIR`` shares one cache between runs and
``--compilation_cache_dir=`` turns it off. A compiled program can hold constants of the
function compiled: keep the cache as private as the checkpoints beside it.
"""

from __future__ import annotations

import os

import jax
from absl import flags

_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", None,
    "JAX's persistent compilation cache (default: <workdir>/.jax_cache; empty: off).")

#: Programs that compile faster than this are not cached (JAX's default).
MIN_COMPILE_SECONDS = 1.0


def cache_dir(workdir: str, flag_value: str | None) -> str | None:
  """The cache directory: flag_value, else ``<workdir>/.jax_cache``; None when flag_value is
  empty (off)."""
  if flag_value is None:
    return os.path.join(workdir, ".jax_cache")
  return os.path.abspath(flag_value) if flag_value else None


def enable(workdir: str, flag_value: str | None = None) -> str | None:
  """Points JAX's persistent compilation cache at `cache_dir` (before the first compilation)
  and returns it; None: left off."""
  directory = cache_dir(workdir, flag_value)
  if directory is not None:
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return directory


def enable_from_flags(workdir: str) -> str | None:
  """`enable` with ``--compilation_cache_dir``."""
  return enable(workdir, _CACHE_DIR.value)

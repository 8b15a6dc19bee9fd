"""Mixed precision: bfloat16 and float16 params and inputs, computed in float32.

A model given in a float type below float32 (bfloat16, float16) is evaluated by the clipped
gradient with its params and float inputs widened to float32 (`widen`): the pair gradients
g_ij whose norms are clipped are those of this float32 evaluation of the model, and ḡ is
summed from the same evaluation, so every clipped term has norm ≤ B for what is released
(the allowances of `numerics` cover float32 rounding; a model that casts down internally gets
those of its lowest precision, `numerics.computation_dtype`). ḡ is returned in float32: the
noise is added to it there, and the update is cast to the params' dtype only afterwards
(`optax.apply_updates` does), which is post-processing. Rounding ḡ to bfloat16 before the
noise would move each coordinate by up to 2⁻⁹ of its value, a change the sensitivity does not
cover.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

COMPUTE_DTYPE = jnp.float32


def is_low_precision(dtype) -> bool:
  """Whether dtype is a float type with fewer bits than float32 (bfloat16, float16, ...)."""
  return bool(jnp.issubdtype(dtype, jnp.floating)) and jnp.finfo(dtype).bits < 32


def compute_dtype(dtype) -> Any:
  """The dtype a float leaf of this dtype is computed in: float32 below float32, float32 for
  float64 while x64 is disabled (JAX's canonical dtype), the dtype itself otherwise."""
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    return dtype
  return jnp.dtype(COMPUTE_DTYPE) if is_low_precision(dtype) else jax.dtypes.canonicalize_dtype(
      dtype)


def widen(tree) -> Any:
  """tree with each float leaf in its `compute_dtype`; every other leaf unchanged.

  Float leaves below float32 are widened to float32. A float64 array made while x64 was
  enabled and passed where it is disabled (inside ``jax.enable_x64(False)``) is narrowed to
  float32, as every jnp operation in that scope would: the model is then traced in one dtype
  in every pass (its layer plan, factors and pair gradients), with the allowances of float32.
  """
  def cast(a):
    dtype = jnp.dtype(a.dtype if hasattr(a, "dtype") else jnp.result_type(a))
    target = compute_dtype(dtype)
    return a if target == dtype else jnp.asarray(a).astype(target)

  return jax.tree_util.tree_map(cast, tree)

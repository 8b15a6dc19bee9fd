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


def widen(tree) -> Any:
  """tree with its float leaves below float32 as float32; every other leaf unchanged."""
  return jax.tree_util.tree_map(
      lambda a: a.astype(COMPUTE_DTYPE) if is_low_precision(jnp.result_type(a)) else a, tree)

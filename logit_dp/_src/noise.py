"""The Gaussian noise transformation: the only randomness in a Logit-DP step."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class AddNoiseState(NamedTuple):
  """State of `transform`: steps taken and the base key (raw uint32 key data)."""
  # Shadows tuple.count, as optax's states do (ScaleByAdamState.count): the name is the API.
  count: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride]
  rng_key: jax.Array


def _key_data(key) -> jax.Array:
  if key is None:
    raise ValueError("key is required: pass a secret JAX PRNG key, e.g. "
                     "jax.random.key(secrets.randbits(63)); whoever knows it can remove the noise.")
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(key)
  if key.dtype != jnp.uint32 or key.ndim != 1:
    raise ValueError(f"key must be a JAX PRNG key (jax.random.key or PRNGKey), got {key!r}.")
  return key


def transform(noise_multiplier: float, sensitivity: float, key, *,
              allow_zero_noise: bool = False) -> optax.GradientTransformation:
  """Adds i.i.d. N(0, (σ·C)²) noise to every coordinate of every leaf.

  The input is the SUMMED clipped gradient ḡ of `logit_dp.clipped_grad` (not a
  mean); C is its sensitivity (`logit_dp.sensitivity`). To work with a mean,
  follow this transform with `optax.scale(1 / expected_batch_size)`: scaling
  after the noise is post-processing and changes nothing about privacy.

  Step t (t = state.count, starting at 0) uses key fold_in(key, t), split into one
  independent key per leaf, so no two leaves and no two steps share noise. The
  count is part of the optimizer state: checkpoint it, and a resumed run draws
  fresh noise exactly where it stopped.

  Formal guarantees: if the input has L2 sensitivity ≤ C under a neighbouring
  relation, each update is the Gaussian mechanism with noise multiplier σ
  (zCDP ρ = 1/(2σ²) per step) under that relation. JAX's threefry PRNG is not a
  cryptographically secure generator; see docs/PRIVACY.md.

  Args:
    noise_multiplier: σ ≥ 0 (σ = 0 only with allow_zero_noise=True).
    sensitivity: C, finite and > 0.
    key: a JAX PRNG key (typed or raw uint32[2]).
    allow_zero_noise: σ = 0 gives a non-private update; it must be asked for.
  """
  sigma = float(noise_multiplier)
  if math.isnan(sigma) or sigma < 0 or math.isinf(sigma):
    raise ValueError(f"noise_multiplier must be a finite number ≥ 0, got {noise_multiplier!r}.")
  if sigma == 0 and not allow_zero_noise:
    raise ValueError("noise_multiplier=0 adds no noise, so training is not private. Pass "
                     "allow_zero_noise=True to run non-privately on purpose.")
  c = float(sensitivity)
  if not math.isfinite(c) or c <= 0:
    raise ValueError(f"sensitivity must be finite and > 0, got {sensitivity!r}.")
  base_key = _key_data(key)
  stddev = sigma * c

  def init_fn(params):
    del params
    return AddNoiseState(count=jnp.zeros([], jnp.int32), rng_key=base_key)

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng_key), state.count)
    leaf_keys = jax.random.split(step_key, max(len(leaves), 1))
    noisy = [(leaf + stddev * jax.random.normal(k, leaf.shape, jnp.float32)).astype(leaf.dtype)
             for leaf, k in zip(leaves, leaf_keys)]
    return (jax.tree_util.tree_unflatten(treedef, noisy),
            AddNoiseState(count=state.count + 1, rng_key=state.rng_key))

  return optax.GradientTransformation(init_fn, update_fn)

"""Cosine similarities, clip factors and the float32 allowances of the pair norms.

Embeddings are normalised as n(u) = u/√(‖u‖² + ε²) (ε = `DEFAULT_COSINE_EPS` keeps zero
embeddings finite: |Z_ij| < 1 still holds and the gradient at u = 0 is I/ε, large but finite
and clipped like any other), and Z_ij = ⟨n(u_i), n(v_j)⟩.

Float32 allowances are added to every pair norm before clipping, so that a clip factor never
uses a norm below the true one (docs/PRIVACY.md, "Clip norms in float32"). With
s_i = ‖J_i‖_F (per-example Jacobian of the normalised embedding) and S_ij = s_i + s'_j:
a norm formed from its vector (materialize, the diagonal pairs) is raised by
`VECTOR_FLOAT_ERROR`·S_ij; a squared norm from Gram forms (a + b + 2c, or a and b of
"triangle") by `GRAM_FLOAT_ERROR`·S_ij². Largest float32 errors measured against float64
(tests/test_float32_norms.py inputs, three seeds, and the paper's embedding net):
3.2·2⁻²⁴·S_ij and 0.36·2⁻²⁴·S_ij², so the margins are 20× and 44×.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

DEFAULT_COSINE_EPS = 1e-6
VECTOR_FLOAT_ERROR = 2.0 ** -18
GRAM_FLOAT_ERROR = 2.0 ** -20
HIGHEST = jax.lax.Precision.HIGHEST


def normalize(u: jax.Array, eps: float = DEFAULT_COSINE_EPS) -> jax.Array:
  """n(u) = u/√(‖u‖² + ε²) along the last axis."""
  return u / jnp.sqrt(jnp.sum(u * u, axis=-1, keepdims=True) + eps * eps)


def cosine_similarity(u: jax.Array, v: jax.Array, eps: float = DEFAULT_COSINE_EPS) -> jax.Array:
  """Z_ij = ⟨n(u_i), n(v_j)⟩ for u (n, d) and v (m, d)."""
  return jnp.matmul(normalize(u, eps), normalize(v, eps).T, precision=HIGHEST)


def clip_factor(norms: jax.Array, clip_norm: float) -> jax.Array:
  """min(1, B/‖g‖); a non-finite norm gives 0 (the pair is dropped, which is private)."""
  scaled = clip_norm / jnp.where(norms > 0, norms, 1.0)
  return jnp.where(norms <= clip_norm, 1.0, jnp.where(jnp.isfinite(norms), scaled, 0.0))


def full_float32(fn) -> Callable:
  """fn with every matmul and convolution it traces at full float32 precision.

  The clip factors min(1, B/‖g_ij‖) and ḡ come from different passes (Jacobian factors
  vs one weighted backward pass), so the clipped pair gradients stay within B only as
  far as both are computed accurately. On GPUs and TPUs JAX's default precision for
  float32 contractions is TF32 or bfloat16 passes (about 3 significant digits); this
  pins "highest" while fn is traced (precision is resolved when each op is traced), so
  the mechanism is the same on every backend. Layers given an explicit `precision=`
  keep it.
  """
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.default_matmul_precision("highest"):
      return fn(*args, **kwargs)

  return wrapped

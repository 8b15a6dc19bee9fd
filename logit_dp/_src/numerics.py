"""Cosine similarities, clip factors and the float allowances of the pair norms.

Embeddings are normalised as n(u) = u/√(‖u‖² + ε²) (ε = `DEFAULT_COSINE_EPS` keeps zero
embeddings finite: |Z_ij| < 1 still holds and the gradient at u = 0 is I/ε, large but finite
and clipped like any other), and Z_ij = ⟨n(u_i), n(v_j)⟩.

Float allowances are added to every pair norm before clipping, so that a clip factor never
uses a norm below the true one (docs/privacy_floating_point.md, "Clip norms in float32"). With
s_i = ‖J_i‖_F (per-example Jacobian of the normalised embedding), S_ij = s_i + s'_j and u the
unit roundoff of the dtype the norms are computed in (`computation_dtype`: 2⁻²⁴ for float32,
2⁻⁵³ for float64): a norm formed from its vector (materialize) is raised by
`vector_error`·S_ij = 64u·S_ij; a squared norm from Gram forms (a + b + 2c, or a and b of
"triangle") by `gram_error`·S_ij² = 16u·S_ij². `VECTOR_FLOAT_ERROR` and `GRAM_FLOAT_ERROR` are
those at float32. Largest float32 errors measured against float64 (tests/test_float32_norms.py
inputs, three seeds, and the paper's embedding net): 3.2u·S_ij and 0.36u·S_ij², so the margins
are 20× and 44×. The n diagonal pairs (x_i, x'_i), whose gradients nearly cancel, are formed as
vectors, in float64 (`pair_terms.diagonal_norms`). An allowance is coarse where a pair's norm is
much below S_ij (pairs that cancel off the diagonal too); the exact methods form the pairs
whose allowance could put them above 1.10× their truth again in float64
(`pair_terms.refine_flagged`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_COSINE_EPS = 1e-6
VECTOR_FLOAT_ERROR = 2.0 ** -18
GRAM_FLOAT_ERROR = 2.0 ** -20
HIGHEST = jax.lax.Precision.HIGHEST
FLOAT32_UNIT_ROUNDOFF = 2.0 ** -24


def unit_roundoff(dtype) -> float:
  """u = 2⁻ᵖ of a float dtype with p significand bits (float32 2⁻²⁴, float64 2⁻⁵³, bfloat16 2⁻⁸)."""
  return float(jnp.finfo(dtype).eps) / 2.0


def vector_error(dtype) -> float:
  """The vector allowance per unit of S_ij at `dtype`: VECTOR_FLOAT_ERROR·u/2⁻²⁴."""
  return VECTOR_FLOAT_ERROR * unit_roundoff(dtype) / FLOAT32_UNIT_ROUNDOFF


def gram_error(dtype) -> float:
  """The Gram allowance per unit of S_ij² at `dtype`: GRAM_FLOAT_ERROR·u/2⁻²⁴."""
  return GRAM_FLOAT_ERROR * unit_roundoff(dtype) / FLOAT32_UNIT_ROUNDOFF


def lowest_precision(dtypes) -> np.dtype:
  """The float dtype of largest unit roundoff among `dtypes` (non-float ones are ignored)."""
  floats = [jnp.dtype(d) for d in dtypes if jnp.issubdtype(d, jnp.floating)]
  if not floats:
    raise ValueError("no float dtype among the computation's values.")
  return max(floats, key=unit_roundoff)


def _jaxpr_float_dtypes(jaxpr, found: set) -> set:
  """The float dtypes of every value a jaxpr (and its sub-jaxprs) computes."""
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      dtype = getattr(getattr(var, "aval", None), "dtype", None)
      if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        found.add(jnp.dtype(dtype))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _jaxpr_float_dtypes(inner, found)
  return found


def computation_dtype(fn, *args) -> np.dtype:
  """The float dtype of lowest precision among the values fn(*args) computes (traced with
  `jax.make_jaxpr` on the args' shapes and dtypes): the dtype whose rounding the allowances of
  fn's results must cover, e.g. bfloat16 for a model that casts to it internally."""
  shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)),
                                  args)
  closed = jax.make_jaxpr(fn)(*shapes)
  dtypes = _jaxpr_float_dtypes(closed.jaxpr, set())
  dtypes |= {jnp.dtype(v.aval.dtype) for v in closed.jaxpr.outvars}
  return lowest_precision(dtypes)


def normalize(u: jax.Array, eps: float = DEFAULT_COSINE_EPS) -> jax.Array:
  """n(u) = u/√(‖u‖² + ε²) along the last axis."""
  return u / jnp.sqrt(jnp.sum(u * u, axis=-1, keepdims=True) + eps * eps)


def pair_cosine_cotangents(e: jax.Array, eps: float = DEFAULT_COSINE_EPS) -> jax.Array:
  """∂Z/∂e for Z = ⟨n(e_0), n(e_1)⟩ of two rows e (2, d): row v is (n(e_w) − Z·n(e_v))/r_v,
  w the other row and r_v = √(‖e_v‖² + ε²) (the derivative of `normalize` is
  (I − n(e_v) n(e_v)ᵀ)/r_v)."""
  r = jnp.sqrt(jnp.sum(e * e, axis=-1, keepdims=True) + eps * eps)
  unit = e / r
  z = jnp.dot(unit[0], unit[1], precision=HIGHEST)
  return (unit[::-1] - z * unit) / r


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
    with full_float32_precision():
      return fn(*args, **kwargs)

  return wrapped


def full_float32_precision() -> contextlib.AbstractContextManager:
  """The context of `full_float32`: every matmul and convolution traced within it is at full
  float32 precision."""
  return jax.default_matmul_precision("highest")

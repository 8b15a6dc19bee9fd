""""materialize": Algorithm 1 of the paper, every pair gradient by its own backward pass.

The reference the other methods are tested against: exact norms, n² backward passes, in
blocks of pairs of about `chunking.PAIR_BLOCK_FLOATS` floats. It depends on nothing but JAX's
own differentiation: the model runs as it is (no layer of it is recognised or rewritten), and
the Jacobian norms of its float allowance come from `jax.jacrev` per example.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from logit_dp._src import checks
from logit_dp._src import chunking
from logit_dp._src import numerics
from logit_dp._src import pair_batch
from logit_dp._src import pair_terms
from logit_dp._src import rows as rows_lib
from logit_dp._src.methods import base


@dataclasses.dataclass(frozen=True)
class Materialize(base.ClipMethod):
  """Exact pair norms from the pair gradients themselves.

  Attributes:
    pair_block_size: pairs per block (None: about `chunking.PAIR_BLOCK_FLOATS` floats).
  """
  name: ClassVar[str] = "materialize"
  layer_factors: ClassVar[bool] = False  # the reference: JAX's own differentiation only
  pair_block_size: int | None = None

  def __post_init__(self):
    checks.check_positive_int_or_none("pair_block_size", self.pair_block_size)

  def pair_norms_with_factors(self, batch, allowance) -> base.NormsAndFactors:
    """See `base.ClipMethod.pair_norms_with_factors`."""
    tau = jnp.zeros((batch.u_loc.shape[0], batch.u.shape[0]), batch.u_loc.dtype)
    return materialize(batch, tau, math.inf, self.pair_block_size, allowance)[0], None

  def norms_and_clipped_grad(self, batch, tau_local, clip_norm) -> tuple[jax.Array, Any]:
    """See `base.ClipMethod.norms_and_clipped_grad`."""
    return materialize(batch, tau_local, clip_norm, self.pair_block_size)


jax.tree_util.register_dataclass(Materialize, data_fields=[], meta_fields=["pair_block_size"])


def materialize(batch: pair_batch.PairBatch, tau_local_rows, clip_norm, pair_block_size,
                allowance: float = 1.0) -> tuple[jax.Array, Any]:
  """Algorithm 1: every pair gradient by its own backward pass, in blocks of pairs.

  Each norm is raised by the vector allowance allowance·`numerics.vector_error`·(‖J_i‖_F +
  ‖J'_j‖_F); the diagonal pairs (x_i, x'_i) take their vector-formed norms instead
  (`pair_terms.diagonal_norms`), the gradients ḡ is summed from stay those of the blocks.
  Returns (norms (n_local, n), ḡ summed over local rows and psum-ed over devices).
  """
  x_prime_all = batch.c.gather(batch.x_prime)
  s_local = pair_terms.jacobian_norms(batch.factors(batch.x).gram)
  s_all = batch.c.gather(pair_terms.jacobian_norms(
      batch.factors(batch.x_prime, positive=True).gram))
  slack = allowance * numerics.vector_error(batch.norm_dtype) * (s_local[:, None] + s_all[None, :])
  n_local, n = tau_local_rows.shape
  diagonal, diagonal_error = pair_terms.diagonal_norms(batch)
  diagonal = pair_terms.diagonal_values(batch, diagonal, diagonal_error,
                                        s_local + s_all[batch.rows], allowance,
                                        batch.positive_pairs)
  on_diagonal = jnp.zeros((n_local, n), bool).at[jnp.arange(n_local), batch.rows].set(True)
  exact = jnp.zeros((n_local, n), diagonal.dtype).at[jnp.arange(n_local), batch.rows].set(diagonal)
  block = pair_block_size or chunking.vectors_per_block(batch.params, n_local * n)
  num_pairs = n_local * n
  num_blocks = -(-num_pairs // block)
  flat = jnp.arange(num_blocks * block)
  real = flat < num_pairs
  flat = jnp.where(real, flat, 0)
  rows, cols = flat // n, flat % n
  weights = jnp.where(real, tau_local_rows.reshape(-1)[flat], 0.0)

  def pair_grad(i, j):
    z = lambda p: jnp.dot(
        batch.normalized_embedding(p, rows_lib.take_row(batch.x, i)),
        batch.normalized_embedding(p, rows_lib.take_row(x_prime_all, j), positive=True), precision=
        numerics.HIGHEST)
    return jax.grad(z)(batch.params)

  def step(acc, blk):
    i, j, w, slack, on_diagonal, exact = blk
    grads = jax.vmap(pair_grad)(i, j)
    sq = sum(
        jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree_util.tree_leaves(grads))
    norms = jnp.where(on_diagonal, exact, jnp.sqrt(sq) + slack)
    coef = w * numerics.clip_factor(norms, clip_norm)
    finite = jnp.isfinite(norms)  # dropped pairs must add exactly 0, not 0·inf = NaN

    def add(a, g):
      g = jnp.where(finite.reshape((-1,) + (1,) * (g.ndim - 1)), g, jnp.zeros_like(g))
      return a + jnp.tensordot(coef.astype(g.dtype), g, axes=1, precision=numerics.HIGHEST).astype(
          a.dtype)

    acc = jax.tree_util.tree_map(add, acc, grads)
    return acc, norms

  zeros = jax.tree_util.tree_map(jnp.zeros_like, batch.params)
  blocks = tuple(
      a.reshape(num_blocks, block)
      for a in (rows, cols, weights, slack.reshape(-1)[flat], on_diagonal.reshape(-1)[flat] & real,
                exact.reshape(-1)[flat]))
  grads, norms = jax.lax.scan(step, zeros, blocks)
  norms = norms.reshape(-1)[:num_pairs].reshape(n_local, n)
  return norms, batch.c.psum(grads)

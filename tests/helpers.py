"""Tree arithmetic used by the tests."""

import jax
import numpy as np


def flat(tree) -> np.ndarray:
  return np.concatenate(
      [np.ravel(np.asarray(leaf, np.float64)) for leaf in jax.tree_util.tree_leaves(tree)])


def rel_err(a, b) -> float:
  a, b = flat(a), flat(b)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tree_norm(tree) -> float:
  return float(np.linalg.norm(flat(tree)))


def reference_grad(embed_fn, loss, params, x, x_prime, mask=None):
  """jax.grad of ℒ(Z(w)) directly: the unclipped gradient."""
  import logit_dp

  def total(p):
    return loss(logit_dp.cosine_similarity(embed_fn(p, x), embed_fn(p, x_prime)), mask)

  return jax.value_and_grad(total)(params)

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


def method_kwargs(method: str, x, num_reference: int = 4, seed: int = 7) -> dict:
  """The extra `clipped_grad` arguments a method needs: "projected" gets reference inputs
  (uniform, of x's example shape, drawn independently of x) and projection rank 16."""
  if method != "projected":
    return {}
  import jax.numpy as jnp
  shape = (num_reference,) + tuple(jnp.shape(x)[1:])
  reference = jax.random.uniform(jax.random.PRNGKey(seed), shape, jnp.float32)
  return dict(reference_inputs=reference, projection_rank=16)


def make_batch(embed_fn, params, x, x_prime, positive_embed_fn=None):
  """The library's internal `pair_batch.PairBatch` for all-valid rows on one device, without
  microbatches (tests that check its factors, norms and projections directly)."""
  import jax.numpy as jnp

  from logit_dp._src import collective
  from logit_dp._src import numerics
  from logit_dp._src import pair_batch

  return pair_batch.PairBatch(embed_fn, params, x, x_prime, jnp.ones(
      (x.shape[0],), bool), eps=numerics.DEFAULT_COSINE_EPS, microbatch_size=None,
                              collective=collective.Collective(None),
                              positive_embed_fn=positive_embed_fn)


def save_config_started_before(config, workdir, *fields) -> None:
  """Writes ``config``'s config.json into ``workdir`` without ``fields``: the config.json of a
  run started before those fields existed (what `train.check_resumable` must still accept)."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  from experiments import train  # pylint: disable=g-import-not-at-top
  train.save_config(config, str(workdir))
  path = os.path.join(str(workdir), "config.json")
  with open(path) as f:
    old = json.load(f)
  for k in fields:
    del old[k]
  with open(path, "w") as f:
    json.dump(old, f)

r"""How tight are the pair-norm upper bounds? A float64 dense check, independent of the library.

    python -m experiments.bound_tightness --npz_dir=DIR --n=128 \
        --out=docs/results/bound_tightness.json

Embedding net at its initial parameters (seed 0), n same-class CIFAR-10 train pairs (from a
4,000-image subset) and 256 CIFAR-100 train images as the public reference. Per-example
Jacobians of the normalised embeddings by jax.jacrev in float64; pair gradients
g_ij = J_iᵀv̂_j + J'_jᵀû_i formed as vectors. For the negative (off-diagonal) pairs it reports
bound/‖g_ij‖ (median, 90% quantile) of the triangle bound ‖J_iᵀv̂_j‖ + ‖J'_jᵀû_i‖ and of the
projected bound (docs/METHOD.md) with the subspace of the top-k right singular vectors of the
references' Jacobian rows, for several k. Memory: n²·p float64 (p = 6,296): n = 128 is 0.8 GB.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

jax.config.update("jax_enable_x64", True)

import logit_dp  # noqa: E402  (after enabling x64)
from experiments import data as data_lib  # noqa: E402
from experiments import train as train_lib  # noqa: E402
from experiments.configs import cifar10_embedding_net_triangle  # noqa: E402

flags.DEFINE_string("npz_dir", None, "Folder with cifar10.npz and cifar100.npz.", required=True)
flags.DEFINE_integer("n", 128, "Pairs.")
flags.DEFINE_integer("num_reference", 256, "CIFAR-100 train images spanning the subspace.")
flags.DEFINE_list("ranks", ["8", "32", "128", "512"], "Subspace ranks k.")
flags.DEFINE_string("out", None, "Write the results here (JSON).")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  config = cifar10_embedding_net_triangle.get_config()
  config.data.npz_dir = FLAGS.npz_dir
  config.data.train_subset = 4000
  ds = data_lib.load_dataset(config.data, seed=0)
  x = np.asarray(data_lib.to_float(ds["x_train"]), np.float64)
  pairs = data_lib.make_pairs(ds["y_train"], "same_class", seed=0)[:FLAGS.n]
  xa, xb = jnp.asarray(x[pairs[:, 0]]), jnp.asarray(x[pairs[:, 1]])
  images = data_lib.reference_images("cifar100", "train", FLAGS.num_reference,
                                     npz_dir=FLAGS.npz_dir)
  reference = jnp.asarray(np.asarray(images, np.float64) / 255.0)
  _, apply_fn, _, init_jit = train_lib.get_model(config.model)
  params = init_jit(jax.random.PRNGKey(0), xa[:1].astype(jnp.float32))
  flat, unravel = jax.flatten_util.ravel_pytree(
      jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params))

  def unit(w, xe):
    return logit_dp.losses.normalize(apply_fn(unravel(w), xe[None]))[0]

  jacobians = jax.jit(jax.vmap(jax.jacrev(unit), in_axes=(None, 0)))
  j_u, j_v, j_ref = jacobians(flat, xa), jacobians(flat, xb), jacobians(flat, reference)
  u = jax.vmap(lambda xe: unit(flat, xe))(xa)
  v = jax.vmap(lambda xe: unit(flat, xe))(xb)
  first = jnp.einsum("iap,ja->ijp", j_u, v)  # J_iᵀv̂_j
  second = jnp.einsum("jbp,ib->ijp", j_v, u)  # J'_jᵀû_i
  exact = jnp.linalg.norm(first + second, axis=-1)
  off = ~np.eye(FLAGS.n, dtype=bool)

  def summary(bound):
    ratio = np.asarray(bound / exact)
    assert np.all(ratio >= 1 - 1e-9), float(ratio.min())  # every bound is an upper bound
    return dict(median=float(np.median(ratio[off])), q90=float(np.quantile(ratio[off], 0.9)))

  report = dict(
      n=FLAGS.n, num_reference=FLAGS.num_reference, num_params=int(flat.size),
      triangle=summary(jnp.linalg.norm(first, axis=-1) + jnp.linalg.norm(second, axis=-1)),
      projected={})
  _, _, vt = jnp.linalg.svd(j_ref.reshape(-1, flat.size), full_matrices=False)
  for k in map(int, FLAGS.ranks):
    q = vt[:k].T
    in_subspace = jnp.linalg.norm((first + second) @ q, axis=-1)
    rest = lambda a, q=q: jnp.linalg.norm(a - (a @ q) @ q.T, axis=-1)
    report["projected"][str(k)] = summary(
        jnp.sqrt(in_subspace ** 2 + (rest(first) + rest(second)) ** 2))
  print(json.dumps(report, indent=1))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  app.run(main)

r"""Does clipping every pair (B far below the pair norms) by itself collapse the embeddings?

Noise-free diagnostic for docs/results_in_detail.md, "Clip methods at the paper's size". It
trains the embedding net on a random CIFAR-10 subset with Adam on the *noise-free* clipped sum
ḡ = Σ_ij τ_ij·min(1, B/‖∇Z_ij‖)·∇Z_ij (no noise, no Poisson sampling, so not private) for
several B, next to the true gradient (B = ∞). It records, on test pairs, the contrastive loss and
the mean cosine similarity of non-matching test embeddings: a collapse shows as that mean → 1
and the loss → ln n. It also splits ḡ at initialisation into its positive-pair (diagonal)
part and its negative-pair part (by masking τ), and reports their norms and the cosine of ḡ
with the true gradient.

    python -m experiments.clip_bias --npz_dir=DIR --out=docs/results/clip_bias.json
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app
from absl import flags

import logit_dp
from experiments import data as data_lib
from experiments import train as train_lib
from experiments.configs import cifar10_embedding_net_paper_hparams

FLAGS = flags.FLAGS


def _define_flags():
  flags.DEFINE_string("npz_dir", None, "Folder with cifar10.npz.")
  flags.DEFINE_string("out", None, "Write the measurements here (JSON).")
  flags.DEFINE_integer("subset", 4000, "Train images (random subset).")
  flags.DEFINE_integer("batch", 1000, "Pairs per step.")
  flags.DEFINE_integer("steps", 40, "Adam steps.")
  flags.DEFINE_list("clip_norms", ["inf", "1", "1e-2", "1e-5"],
                    "B values (inf: the true gradient).")
  flags.DEFINE_string("clip_method", "triangle", "triangle | ghost | projected.")
  flags.DEFINE_integer(
      "num_reference", 64,
      "projected: CIFAR-100 train images (public, fixed seed) spanning the subspace.")
  flags.DEFINE_integer("projection_rank", 32, "projected: rank of the subspace.")


class _DiagonalOnly:
  """The contrastive loss with its weights τ_ij kept only on (diagonal) or off the diagonal."""
  def __init__(self, loss, diagonal: bool):
    self.loss, self.diagonal = loss, diagonal

  def __call__(self, z, mask=None):
    n = z.shape[0]
    eye = jnp.eye(n, dtype=bool)
    keep = eye if self.diagonal else ~eye
    # Same value, gradient only through the kept entries of Z.
    z_kept = jnp.where(keep, z, jax.lax.stop_gradient(z))
    return self.loss(z_kept, mask)


def gradient_parts(apply_fn, loss, clip_norm, method, params, x, x_prime):
  """ḡ and its positive-pair and negative-pair parts (ḡ = positive + negative: the clip factors
  do not depend on the weights τ_ij, so ḡ is linear in them)."""
  def grad_of(part_loss):
    return logit_dp.clipped_grad(apply_fn, part_loss, clip_norm, method,
                                 microbatch_size=500)(params, x, x_prime)[1]

  parts = {
      name: grad_of(_DiagonalOnly(loss, diag))
      for name, diag in (("positive", True), ("negative", False))
  }
  return grad_of(loss), parts


def _tree_norm(t):
  return float(optax.global_norm(t))


def tree_cosine(a, b) -> float:
  """⟨a, b⟩ / (‖a‖‖b‖) over all leaves of two pytrees."""
  num = sum(
      jnp.vdot(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
  return float(num / (optax.global_norm(a) * optax.global_norm(b)))


def main(argv):
  del argv
  config = cifar10_embedding_net_paper_hparams.get_config()
  config.data.npz_dir = FLAGS.npz_dir
  config.data.train_subset = FLAGS.subset
  ds = data_lib.load_dataset(config.data, seed=0)
  x_tr = np.asarray(data_lib.to_float(ds["x_train"]))
  pairs = data_lib.make_pairs(ds["y_train"], "same_class", seed=0)
  te_pairs = data_lib.make_pairs(ds["y_test"], "same_class", seed=0)[:1000]
  x_te = np.asarray(data_lib.to_float(ds["x_test"]))
  xa_te, xb_te = jnp.asarray(x_te[te_pairs[:, 0]]), jnp.asarray(x_te[te_pairs[:, 1]])
  model, apply_fn, _, init_jit = train_lib.get_model(config.model)
  del model
  loss = logit_dp.losses.contrastive(temperature=1.0)
  params0 = init_jit(jax.random.PRNGKey(0), jnp.asarray(x_tr[:1]))

  def test_stats(params):
    za, zb = apply_fn(params, xa_te), apply_fn(params, xb_te)
    z = logit_dp.losses.cosine_similarity(za, zb)
    n = z.shape[0]
    off = (jnp.sum(z) - jnp.trace(z)) / (n * n - n)
    return float(loss(z)), float(off)

  rng = np.random.default_rng(0)
  batches = [pairs[rng.choice(len(pairs), FLAGS.batch, replace=False)] for _ in range(FLAGS.steps)]
  report = dict(subset=FLAGS.subset, batch=FLAGS.batch, steps=FLAGS.steps, lr=1e-2,
                clip_method=FLAGS.clip_method, ln_n_test=float(np.log(len(te_pairs))), runs={})
  projected = None
  if FLAGS.clip_method == "projected":
    images = data_lib.reference_images("cifar100", "train", FLAGS.num_reference,
                                       npz_dir=FLAGS.npz_dir)
    projected = logit_dp.clip_methods.Projected(
        reference_inputs=jnp.asarray(data_lib.to_float(images)), rank=FLAGS.projection_rank)
    report.update(num_reference=FLAGS.num_reference, projection_rank=FLAGS.projection_rank)
  b0 = batches[0]
  xa0, xb0 = jnp.asarray(x_tr[b0[:, 0]]), jnp.asarray(x_tr[b0[:, 1]])
  true_grad = jax.grad(lambda p: loss(
      logit_dp.losses.cosine_similarity(apply_fn(p, xa0), apply_fn(p, xb0))))(params0)
  for b_str in FLAGS.clip_norms:
    clip = float(b_str)
    t0 = time.time()
    method = FLAGS.clip_method if np.isfinite(clip) else "ghost"
    if method == "projected":
      method = projected
    grad_fn = jax.jit(logit_dp.clipped_grad(apply_fn, loss, clip, method, microbatch_size=500))
    g0, parts = gradient_parts(apply_fn, loss, clip, method, params0, xa0, xb0)
    init = dict(norm=_tree_norm(g0), cos_with_true_grad=tree_cosine(g0, true_grad),
                positive_norm=_tree_norm(parts["positive"]),
                negative_norm=_tree_norm(parts["negative"]),
                cos_positive_negative=tree_cosine(parts["positive"], parts["negative"]))
    tx = optax.adam(1e-2)
    params, opt_state = params0, tx.init(params0)
    curve = [test_stats(params)]
    for b in batches:
      _, g = grad_fn(params, jnp.asarray(x_tr[b[:, 0]]), jnp.asarray(x_tr[b[:, 1]]))
      updates, opt_state = tx.update(g, opt_state, params)
      params = optax.apply_updates(params, updates)
      curve.append(test_stats(params))
    report["runs"][b_str] = dict(at_init=init, test_loss=[c[0] for c in curve],
                                 mean_negative_cosine=[c[1] for c in curve],
                                 seconds=time.time() - t0)
    print(b_str, json.dumps(init), f"final loss {curve[-1][0]:.4f} mean neg cos {curve[-1][1]:.4f}",
          flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)

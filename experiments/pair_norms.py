r"""How much the clip norm B clips: pair-gradient norms ‖∇_θ Z_ij‖ of an embedding net.

    python -m experiments.pair_norms --workdir=runs/cifar10_embnet_triangle_s0 \
        --npz_dir=DIR --out=docs/results/pair_norms_s0.json

For the initial parameters (``config.seed``) and each method's final parameters of a finished
pre-training run, it embeds ``n`` same-class pairs of the (public) test split and reports
quantiles of the n × n matrix of pair-gradient norms, exact ("ghost"), the triangle upper
bound and the projected upper bound (its subspace from ``--num_reference`` images of the public
``--reference`` train split, rank ``--projection_rank``), how far each bound is above the
exact norm off the diagonal (median and 90% quantile of bound/exact), and the fraction of
pairs that B clips (norm > B) for B = 1 (ours) and 1e-5 (the paper's
Logit-DP B); and ‖∇_θ ℒ‖ of the whole batch of n pairs, the norm Naive-DP clips to B.
docs/results_in_detail.md renders the JSON (``experiments.render_results``).
"""

import json
import os
import sys

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app
from absl import flags

import logit_dp
from experiments import data as data_lib
from experiments import finetuning
from experiments import train

QUANTILES = (0.01, 0.5, 0.99)
BOUNDS = (1.0, 1e-5)


def norm_summary(norms: np.ndarray) -> dict:
  """Quantiles of the pair norms and the fraction of pairs above each B in BOUNDS."""
  v = np.asarray(norms, np.float64).ravel()
  out = {f"q{int(q * 100):02d}": float(np.quantile(v, q)) for q in QUANTILES}
  out.update({f"clipped_at_{b:g}": float(np.mean(v > b)) for b in BOUNDS})
  return out


def over_estimate(bound: np.ndarray, exact: np.ndarray) -> dict:
  """Median and 90% quantile of bound/exact over the off-diagonal (negative) pairs."""
  off = ~np.eye(exact.shape[0], dtype=bool)
  ratio = np.asarray(bound, np.float64)[off] / np.asarray(exact, np.float64)[off]
  return dict(median=float(np.median(ratio)), q90=float(np.quantile(ratio, 0.9)))


def pair_norm_report(config, params_by_name, x, xp, methods=("ghost", "triangle"), projection=None):
  """{name: {method: norm_summary}} for each parameter set; with "ghost" first, each bound's
  summary also holds ``over_exact`` (`over_estimate`). projection: the method object of
  "projected" (`logit_dp.clip_methods.Projected`, with its reference inputs and rank)."""
  _, apply_fn, _, _ = train.get_model(config.model)
  loss = train.make_loss(config)

  @jax.jit
  def batch_grad_norm(params):
    def total(p):
      return loss(logit_dp.losses.cosine_similarity(apply_fn(p, x), apply_fn(p, xp)))

    g = jax.grad(total)(params)
    return jnp.sqrt(sum(jnp.sum(leaf * leaf) for leaf in jax.tree_util.tree_leaves(g)))

  out = {}
  for name, params in params_by_name.items():
    out[name] = {"batch_grad_norm": float(batch_grad_norm(params))}
    exact = None
    for m in methods:
      norms = np.asarray(
          logit_dp.clip_methods.pair_grad_norms(apply_fn, params, x, xp,
                                                method=projection if m == "projected" else m,
                                                microbatch_size=config.get("microbatch_size")))
      out[name][m] = norm_summary(norms)
      if m == "ghost":
        exact = norms
      elif exact is not None:
        out[name][m]["over_exact"] = over_estimate(norms, exact)
  return out


def main(argv):
  del argv
  f = flags.FLAGS
  with open(os.path.join(f.workdir, "config.json")) as fh:
    config = ml_collections.ConfigDict(json.load(fh))
  if f.npz_dir:
    config.data.npz_dir = f.npz_dir
  ds = data_lib.load_dataset(config.data, seed=config.seed)
  pairs = data_lib.make_pairs(ds["y_test"], "same_class", config.seed)[:f.n]
  x = data_lib.to_float(jnp.asarray(ds["x_test"][pairs[:, 0]]))
  xp = data_lib.to_float(jnp.asarray(ds["x_test"][pairs[:, 1]]))
  params = {"init": train.initial_params(config, x[:1])}
  for m in config.methods:
    if os.path.isdir(os.path.join(f.workdir, m, "params")):
      params[m] = finetuning.load_pretrained(f.workdir, m, config)
  images = data_lib.reference_images(f.reference, "train", f.num_reference,
                                     npz_dir=config.data.npz_dir)
  projection = logit_dp.clip_methods.Projected(
      reference_inputs=data_lib.to_float(jnp.asarray(images)), rank=f.projection_rank)
  report = dict(
      run=os.path.basename(os.path.normpath(f.workdir)), n=int(len(pairs)), split="test",
      reference=dict(data=f.reference, split="train", num_reference=f.num_reference,
                     rank=f.projection_rank),
      params=pair_norm_report(config, params, x, xp, ("ghost", "triangle", "projected"),
                              projection))
  os.makedirs(os.path.dirname(os.path.abspath(f.out)), exist_ok=True)
  with open(f.out, "w") as fh:
    json.dump(report, fh, indent=1)
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A finished pretrain.py run.", required=True)
  flags.DEFINE_string("npz_dir", None, "Folder with cifar10.npz (else the run's).")
  flags.DEFINE_integer("n", 1000, "Number of test pairs.")
  flags.DEFINE_string("out", "pair_norms.json", "Output JSON.")
  flags.DEFINE_string("reference", "cifar100", "Public data set of the projected bound's subspace.")
  flags.DEFINE_integer("num_reference", 64, "Reference images (train split, fixed seed).")
  flags.DEFINE_integer("projection_rank", 32, "Rank of the projected bound's subspace.")
  app.run(main)

r"""Signal against noise of one private step, per method (a noise-free diagnostic, not private).

For one batch of n CIFAR-10 same-class pairs at the initial parameters of the full-size runs'
embedding net (`cifar10_embedding_net_dpgcl`: B = 1, τ = 1, ε = 5 at q = 0.4, T = 50), every
private method's clipped sum ḡ is set against the Gaussian noise the method adds to it:
N(0, (σΔ)²I) on p parameters, Δ the method's sensitivity (`logit_dp.sensitivity`,
`naive_sensitivity`, `grouped_sensitivity`) and σ the runs' noise multiplier. It reports

    ‖ḡ‖,  Δ,  SNR = ‖ḡ‖ / (σΔ√p)   (the noise's norm is ≈ σΔ√p),
    cos(ḡ, ∇ℒ)                      (∇ℒ: the unclipped full-batch InfoNCE gradient),
    SNR·cos(ḡ, ∇ℒ)                  (the part of the signal along ∇ℒ),

and for DP-GCL also cos(ḡ, Σ_g ∇L_g) with its own unclipped group sum (clip norm 10³⁰): whether
clipping the groups turns their sum. Groups: expected size 8 (G = n/8), no extra views.

``--contrast`` adds contrast clipping (`logit_dp.contrast_clipping`: the contrasts
D_ij = g_ij − g_ii clipped instead of the pair gradients, Δ = (1 + 2e^{2/τ})/τ·B), Logit-DP with
exact norms computed the same way ("logit_dp_exact"), and grouped contrast clipping for each
``--contrast_group_sizes`` s (negatives from the own group, G = n/s hash groups as DP-GCL's,
each group's sum clipped to K, Δ = min(2K, (1 + 2e^{2/τ})/τ·B); K the ``--group_quantile`` of
its group sums' norms), and contrast clipping at the same B with every contrast clipped by the
triangle bound ‖W_iᵀy_ij‖ + ‖J'_jᵀû_i‖ ≥ ‖D_ij‖ ("contrast_bound", with the 0.1/0.5/0.9
quantiles of bound/‖D_ij‖ over i ≠ j). These use dense per-example Jacobians and materialise the
n² contrasts: use n of about 10³. ``--clip_quantile=q`` sets every method's B to the q-quantile
of its own norms (pair gradients, contrasts, group gradients; q ∈ {0.1, 0.5, 0.9}) instead of
the config's; the library's Logit-DP methods and "contrast_bound" then take the exact norms'
quantile.

    python -m experiments.signal_to_noise --npz_dir=DIR --n=10000 \
        --out=docs/results/signal_to_noise.json

``--params_from=WORKDIR:METHOD`` measures at the final parameters a finished pretrain.py run
trained with METHOD instead of at initialisation (is the gap only a feature of the first step?);
``--seed`` picks the initial parameters and the batch; ``--set key=value`` (repeatable) changes
the config, e.g. ``--set temperature=2.0 --set clip_norm=3.0 --set model.embedding_dim=16``.
"""

import ast
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app
from absl import flags

import logit_dp
import logit_dp.contrast_clipping  # a research reference, not imported by logit_dp
from experiments import clip_bias
from experiments import data as data_lib
from experiments import finetuning
from experiments import train as train_lib
from experiments import tune
from experiments.configs import cifar10_embedding_net_dpgcl
from experiments.configs import cifar10_embedding_net_projected

FLAGS = flags.FLAGS
_UNCLIPPED = 1e30


def _define_flags():
  flags.DEFINE_string("npz_dir", None, "Folder with cifar10.npz and cifar100.npz.")
  flags.DEFINE_string("out", None, "Write the measurements here (JSON).")
  flags.DEFINE_integer("n", 2000, "Pairs in the batch.")
  flags.DEFINE_list("logit_dp_methods", ["triangle", "projected"], "Logit-DP clip methods.")
  flags.DEFINE_string(
      "params_from", None, "WORKDIR:METHOD of a finished pretrain.py run: measure at its trained "
      "parameters instead of the initial ones.")
  flags.DEFINE_integer("seed", 0, "Seed of the initial parameters and of the batch.")
  flags.DEFINE_multi_string(
      "set", [], "key=value: a change of the config (dotted key, Python "
      "literal value), e.g. temperature=2.0.")
  flags.DEFINE_bool("contrast", False, "Also measure contrast clipping (materialised).")
  flags.DEFINE_list("contrast_group_sizes", ["8", "32"],
                    "Expected group sizes of grouped contrast clipping.")
  flags.DEFINE_float("group_quantile", 0.5, "K of grouped contrast clipping: this quantile of "
                     "its group sums' norms.")
  flags.DEFINE_float(
      "clip_quantile", None, "Each method's B at this quantile of its own norms "
      "(0.1, 0.5 or 0.9); default: the config's B for every method.")


def parse_overrides(items) -> dict:
  """{'a.b': value} from ['a.b=value', ...]; values are Python literals or else strings."""
  out = {}
  for item in items:
    key, sep, text = item.partition("=")
    if not sep or not key:
      raise ValueError(f"--set wants key=value, got {item!r}.")
    try:
      out[key] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      out[key] = text
  return out


def load_params(params_from: str | None, config, x):
  """(params, description): a run's trained parameters or the initial ones of seed
  ``config.seed``'s runs (`train.initial_params`, the parameters every method of that seed
  starts from).

  A run's parameters are refused (ValueError) unless it trained the model ``config.model``
  describes, the one the measurement applies them to.
  """
  model_config = config.model
  if not params_from:
    return train_lib.initial_params(config, x[:1]), f"initial (seed {config.seed})"
  workdir, sep, method = params_from.rpartition(":")
  if not sep or not workdir or not method:
    raise ValueError(f"--params_from must be WORKDIR:METHOD, got {params_from!r}.")
  pre_config = finetuning.read_pretrain(workdir)[0]
  measured = json.loads(json.dumps(model_config.to_dict()))  # as config.json stores it
  if pre_config.model.to_dict() != measured:
    raise ValueError(f"{workdir} trained model {pre_config.model.to_dict()}, not the measured "
                     f"{measured}.")
  params = finetuning.load_pretrained(workdir, method, pre_config)
  return params, f"{method} trained ({os.path.basename(os.path.normpath(workdir))})"


def _entry(g, true_grad, delta: float, sigma: float, num_params: int, clip_norm: float) -> dict:
  norm = float(optax.global_norm(g))
  noise_norm = sigma * delta * num_params ** 0.5
  cos = clip_bias.tree_cosine(g, true_grad)
  return dict(grad_norm=norm, sensitivity=delta, noise_norm=noise_norm, snr=norm / noise_norm,
              cos_with_true_grad=cos, snr_along_true_grad=norm * cos / noise_norm,
              clip_norm=clip_norm)


def _quantile(norms, where, q: float) -> float:
  return float(np.quantile(np.asarray(norms)[np.asarray(where)], q))


def measure_contrast(apply_fn, params, x, x_prime, loss, clip_norm: float, sigma: float, true_grad,
                     clip_quantile: float | None = None, group_sizes=(8, 32),
                     group_quantile: float = 0.5) -> dict:
  """Entries for Logit-DP with exact norms, contrast clipping and grouped contrast clipping."""
  cc = logit_dp.contrast_clipping
  num_params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))
  n = x.shape[0]
  batch = cc.dense_batch(apply_fn, params, x, x_prime)
  off_diagonal = ~np.eye(n, dtype=bool)
  out = {}
  for name, terms, where in (("logit_dp_exact", "pair", np.ones(
      (n, n), bool)), ("contrast", "contrast", off_diagonal)):
    bound = clip_norm
    if clip_quantile is not None:
      norms = cc.clipped_sums(batch, loss, math.inf, clip_terms=terms)["norms"]
      bound = _quantile(norms, where, clip_quantile)
    rows = cc.clipped_sums(batch, loss, bound, clip_terms=terms)["rows"]
    delta = (logit_dp.sensitivity(loss, bound) if terms == "pair" else cc.contrast_sensitivity(
        loss, bound))
    out[name] = _entry(batch.unravel(jnp.sum(rows, 0)), true_grad, delta, sigma, num_params, bound)
  contrast_bound = out["contrast"]["clip_norm"]
  # The same B, each contrast clipped with the bound ‖W_iᵀy_ij‖ + ‖J'_jᵀû_i‖ ≥ ‖D_ij‖.
  bounded = cc.clipped_sums(batch, loss, contrast_bound, norms="bound")
  exact = cc.clipped_sums(batch, loss, math.inf)["norms"]
  ratios = np.asarray(bounded["norms"])[off_diagonal] / np.asarray(exact)[off_diagonal]
  out["contrast_bound"] = dict(
      _entry(batch.unravel(jnp.sum(bounded["rows"], 0)), true_grad,
             cc.contrast_sensitivity(loss, contrast_bound), sigma, num_params, contrast_bound),
      bound_over_norm={f"q{q:g}": float(np.quantile(ratios, q)) for q in (0.1, 0.5, 0.9)})
  for size in group_sizes:
    num_groups = max(1, round(n / size))
    group_ids = logit_dp.baselines.assign_groups(jnp.arange(n), jax.random.PRNGKey(0), num_groups)
    same = np.asarray(group_ids)[:, None] == np.asarray(group_ids)[None, :]
    bound = contrast_bound
    if clip_quantile is not None:
      norms = cc.clipped_sums(batch, loss, math.inf, group_ids=group_ids)["norms"]
      bound = _quantile(norms, same & off_diagonal, clip_quantile)
    rows = cc.clipped_sums(batch, loss, bound, group_ids=group_ids)["rows"]
    group_norms = np.asarray(cc.group_sums(rows, group_ids)[1])
    k = float(np.quantile(group_norms[group_norms > 0], group_quantile))
    total = cc.group_sums(rows, group_ids, k)[0]
    delta = cc.contrast_sensitivity(loss, bound, group_clip_norm=k)
    entry = _entry(batch.unravel(total), true_grad, delta, sigma, num_params, bound)
    out[f"grouped_contrast_s{size}"] = dict(entry, group_clip_norm=k, num_groups=num_groups)
  return out


def measure(apply_fn, params, x, x_prime, loss, clip_norm: float, sigma: float, logit_dp_methods,
            reference_inputs=None, projection_rank: int = 32, group_size: float = 8.0,
            contrast: bool = False, clip_quantile: float | None = None,
            contrast_group_sizes=(8, 32), group_quantile: float = 0.5) -> dict:
  """The report's ``methods`` entries for one batch (see the module docstring)."""
  if clip_quantile is not None:
    if not contrast:
      raise ValueError("--clip_quantile needs --contrast (the exact pair norms).")
    if clip_quantile not in logit_dp.clip_methods.QUANTILE_LEVELS:
      raise ValueError(f"--clip_quantile must be one of {logit_dp.clip_methods.QUANTILE_LEVELS}.")
  num_params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))
  n = x.shape[0]
  true_grad = jax.grad(lambda p: loss(
      logit_dp.losses.cosine_similarity(apply_fn(p, x), apply_fn(p, x_prime))))(params)
  record_ids = jnp.arange(n)
  num_groups = max(1, round(n / group_size))
  group_key = jax.random.PRNGKey(0)

  def grouped(bound):
    fn = logit_dp.baselines.grouped_clipped_grad(apply_fn, loss, bound, num_groups,
                                                 microbatch_size=500)
    return fn(params, x, x_prime, record_ids=record_ids, group_key=group_key)[1]

  extra = {}
  gcl_clip_norm = clip_norm
  if contrast:
    extra = measure_contrast(apply_fn, params, x, x_prime, loss, clip_norm, sigma, true_grad,
                             clip_quantile, contrast_group_sizes, group_quantile)
  if clip_quantile is not None:
    clip_norm = extra["logit_dp_exact"]["clip_norm"]
    fn = logit_dp.baselines.grouped_clipped_grad(apply_fn, loss, _UNCLIPPED, num_groups,
                                                 microbatch_size=500)
    stats = fn.with_stats(params, x, x_prime, record_ids=record_ids, group_key=group_key)[2]
    gcl_clip_norm = float(
        stats.quantiles[logit_dp.clip_methods.QUANTILE_LEVELS.index(clip_quantile)])

  grads, sensitivities = {}, {}
  for method in logit_dp_methods:
    clip_method = (logit_dp.clip_methods.Projected(reference_inputs=reference_inputs,
                                                   rank=projection_rank)
                   if method == "projected" else method)
    grads[f"logit_dp_{method}"] = logit_dp.clipped_grad(apply_fn, loss, clip_norm, clip_method,
                                                        microbatch_size=500)(params, x, x_prime)[1]
    sensitivities[f"logit_dp_{method}"] = logit_dp.sensitivity(loss, clip_norm, batch_size=None)
  grads["naive_dp"] = logit_dp.baselines.naive_clipped_grad(apply_fn, loss, clip_norm,
                                                            microbatch_size=500)(params, x,
                                                                                 x_prime)[1]
  sensitivities["naive_dp"] = logit_dp.baselines.naive_sensitivity(clip_norm)
  grads["dp_gcl"] = grouped(gcl_clip_norm)
  sensitivities["dp_gcl"] = logit_dp.baselines.grouped_sensitivity(gcl_clip_norm)
  out = {}
  for name, g in grads.items():
    bound = gcl_clip_norm if name == "dp_gcl" else clip_norm
    out[name] = _entry(g, true_grad, float(sensitivities[name]), sigma, num_params, bound)
  out.update(extra)
  out["dp_gcl"]["cos_with_unclipped_group_sum"] = clip_bias.tree_cosine(
      grads["dp_gcl"], grouped(_UNCLIPPED))
  out["dp_gcl"]["num_groups"] = num_groups
  return out


def main(argv):
  del argv
  overrides = parse_overrides(FLAGS.set)
  config = tune.apply_overrides(cifar10_embedding_net_dpgcl.get_config(), overrides)
  config.data.npz_dir = FLAGS.npz_dir
  ds = data_lib.load_dataset(config.data, seed=0)
  pairs = data_lib.make_pairs(ds["y_train"], "same_class", seed=0)
  sigma = train_lib.privacy_plan(config, len(pairs))["noise_multiplier"]
  x_train = np.asarray(data_lib.to_float(ds["x_train"]))
  batch = pairs[np.random.default_rng(FLAGS.seed).choice(len(pairs), FLAGS.n, replace=False)]
  x, x_prime = jnp.asarray(x_train[batch[:, 0]]), jnp.asarray(x_train[batch[:, 1]])
  config.seed = FLAGS.seed
  apply_fn = train_lib.get_model(config.model)[1]
  params, described = load_params(FLAGS.params_from, config, x)
  projection = cifar10_embedding_net_projected.projection_config()
  reference = None
  if "projected" in FLAGS.logit_dp_methods:
    reference = jnp.asarray(
        data_lib.to_float(
            data_lib.reference_images(projection.reference, projection.split,
                                      projection.num_reference, seed=projection.seed,
                                      npz_dir=FLAGS.npz_dir)))
  t0 = time.time()
  methods = measure(apply_fn, params, x, x_prime, logit_dp.losses.contrastive(config.temperature),
                    float(config.clip_norm), sigma,
                    FLAGS.logit_dp_methods, reference, projection.rank,
                    float(config.dp_gcl.group_size), FLAGS.contrast, FLAGS.clip_quantile,
                    [int(v) for v in FLAGS.contrast_group_sizes], FLAGS.group_quantile)
  report = dict(n=FLAGS.n, clip_norm=float(config.clip_norm), clip_quantile=FLAGS.clip_quantile,
                temperature=config.temperature, noise_multiplier=sigma, parameters=described,
                overrides=overrides, methods=methods, seconds=time.time() - t0)
  for name, m in methods.items():
    print(name, json.dumps(m), flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)

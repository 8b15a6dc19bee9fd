r"""Signal against noise of one private step, per method (a noise-free diagnostic, not private).

For one batch of n CIFAR-10 same-class pairs at the initial parameters of the full-size runs'
embedding net (`cifar10_embedding_net_dpgcl`: B = 1, τ = 1, ε = 5 at q = 0.4, T = 50), every
private method's clipped sum ḡ is set against the Gaussian noise the method adds to it:
N(0, (σΔ)²I) on p parameters, Δ the method's sensitivity (`logit_dp.sensitivity`,
`naive_sensitivity`, `grouped_sensitivity`) and σ the runs' noise multiplier. It reports

    ‖ḡ‖,  Δ,  SNR = ‖ḡ‖ / (σΔ√p)   (the noise's norm is ≈ σΔ√p),
    cos(ḡ, ∇ℒ)                      (∇ℒ: the unclipped full-batch InfoNCE gradient),

and for DP-GCL also cos(ḡ, Σ_g ∇L_g) with its own unclipped group sum (clip norm 10³⁰): whether
clipping the groups turns their sum. Groups: expected size 8 (G = n/8), no extra views.

    python -m experiments.signal_to_noise --npz_dir=DIR --n=10000 \
        --out=docs/results/signal_to_noise.json

``--params_from=WORKDIR:METHOD`` measures at the final parameters a finished pretrain.py run
trained with METHOD instead of at initialisation (is the gap only a feature of the first step?);
``--seed`` picks the initial parameters and the batch; ``--set key=value`` (repeatable) changes
the config, e.g. ``--set temperature=2.0 --set clip_norm=3.0 --set model.embedding_dim=16``.
"""

import ast
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app
from absl import flags

import logit_dp
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


def measure(apply_fn, params, x, x_prime, loss, clip_norm: float, sigma: float, logit_dp_methods,
            reference_inputs=None, projection_rank: int = 32, group_size: float = 8.0) -> dict:
  """The report's ``methods`` entries for one batch (see the module docstring)."""
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
  grads["dp_gcl"] = grouped(clip_norm)
  sensitivities["dp_gcl"] = logit_dp.baselines.grouped_sensitivity(clip_norm)
  out = {}
  for name, g in grads.items():
    norm = float(optax.global_norm(g))
    delta = float(sensitivities[name])
    noise_norm = sigma * delta * num_params ** 0.5
    out[name] = dict(grad_norm=norm, sensitivity=delta, noise_norm=noise_norm,
                     snr=norm / noise_norm, cos_with_true_grad=clip_bias.tree_cosine(g, true_grad))
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
                    float(config.clip_norm), sigma, FLAGS.logit_dp_methods, reference,
                    projection.rank, float(config.dp_gcl.group_size))
  report = dict(n=FLAGS.n, clip_norm=float(config.clip_norm), temperature=config.temperature,
                noise_multiplier=sigma, parameters=described, overrides=overrides, methods=methods,
                seconds=time.time() - t0)
  for name, m in methods.items():
    print(name, json.dumps(m), flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)

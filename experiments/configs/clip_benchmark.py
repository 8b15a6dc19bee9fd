"""The private two-tower CIFAR-10 benchmark: every mechanism tuned on CIFAR-100, then compared.

    python -m experiments.clip_benchmark --data_dir=DIR [--search_subset=10000]

``benchmark_base`` is `clip_cifar10` (50,000 records, Poisson batches of 1,000, 2 epochs: q = 0.02,
T = 100, δ = 1e-5); ``search_base`` is the same run on CIFAR-100's training images with its 20
coarse labels (50,000 records: the same q, T and σ at each ε), zero-shot on 2,000 CIFAR-100 test
images. Mechanisms: Logit-DP (exact pair norms: the towers share no parameter, so "ghost" costs
what "triangle" costs), DP-GCL, Naive-DP and the non-private reference, at ε = 1 and 8, seeds
0, 1, 2. The search grids are in ``grids`` (see `experiments.clip_benchmark`).
"""

import ml_collections

from experiments.configs import clip_cifar10


def on_public_data(config):
  """config with CIFAR-100's training images and 20 coarse labels as its data: public for
  CIFAR-10 (50,000 records, as CIFAR-10's, so q, T and σ stay those of the run)."""
  config.data.name = "cifar100"
  config.data.label = "coarse"
  return config


def search_base():
  """clip_cifar10 on the public data (`on_public_data`)."""
  return on_public_data(clip_cifar10.get_config())


def get_config():
  config = ml_collections.ConfigDict()
  config.search_base = search_base()
  config.benchmark_base = clip_cifar10.get_config()
  config.mechanisms = ("logit_dp", "dp_gcl", "naive_dp", "non_private")
  config.epsilons = (1.0, 8.0)
  config.seeds = (0, 1, 2)
  config.full_train_size = 50_000  # --search_subset scales the search's batch from it
  config.checkpoint_every = 10  # private runs: a checkpoint every 10 of their 100 steps
  config.grids = ml_collections.ConfigDict(
      dict(
          learning_rate=(0.3, 3.0),  # × the base rate (1e-2 private, 3e-3 non-private)
          temperature=(0.5, 2.0),
          clip_norm=(1e-2, 1e-1),  # the base B is 1e-3
          group_size=(2, 32),  # the base expected group size is 8
          wide_learning_rate=(0.1, 10.0)))
  return config

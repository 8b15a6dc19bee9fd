"""The clip benchmark at a tiny size for the tests: synthetic class-coloured images, a few steps.

The search runs on synthetic images named by CIFAR-100's fine labels, the benchmark on synthetic
images named by CIFAR-10's; one learning-rate candidate beside the base.
"""

from experiments.configs import clip_benchmark
from experiments.configs import clip_tiny


def _tiny(name):
  config = clip_tiny.get_config()
  config.data.name = name
  config.data.train_subset = 64
  config.data.test_subset = 50
  config.clip_method = "ghost"
  config.learning_rates.dp_gcl = config.learning_rates.naive_dp = config.learning_rates.logit_dp
  config.dp_gcl.group_size = 4
  return config


def get_config():
  config = clip_benchmark.get_config()
  config.search_base = _tiny("cifar100")
  config.benchmark_base = _tiny("cifar10")
  config.epsilons = (8.0,)
  config.seeds = (0, 1)
  config.full_train_size = 64
  config.checkpoint_every = 2
  config.grids.learning_rate = (3.0,)
  config.grids.temperature = ()
  config.grids.clip_norm = ()
  config.grids.group_size = ()
  config.grids.wide_learning_rate = ()
  return config

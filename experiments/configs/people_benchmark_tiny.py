"""The privacy-per-person benchmark at a tiny size for the tests: synthetic class-coloured
images with simulated owners (1 to 4 pairs a person), a few steps.

The search runs on synthetic images named by CIFAR-100's fine labels, the benchmark on synthetic
images named by CIFAR-10's; K ∈ {1, 2}, one learning-rate candidate, one ε, one seed, and no
per-pair benchmark to start from (``per_pair_search`` None).
"""

from experiments.configs import clip_people_tiny
from experiments.configs import people_benchmark


def _tiny(name):
  config = clip_people_tiny.get_config()
  config.data.name = name
  config.data.train_subset = 64
  config.data.test_subset = 50
  config.clip_method = "ghost"
  config.learning_rates.dp_gcl = config.learning_rates.logit_dp
  config.dp_gcl.group_size = 2
  config.people.sampling_rate = 0.25
  config.people.mode = "native"
  return config


def get_config():
  config = people_benchmark.get_config()
  config.search_base = _tiny("cifar100")
  config.benchmark_base = _tiny("cifar10")
  config.epsilons = (8.0,)
  config.seeds = (0,)
  config.full_train_size = 64
  config.checkpoint_every = 2
  config.k_grid = (1, 2)
  config.learning_rate_grid = (3.0,)
  config.per_pair_search = None
  config.per_pair_benchmark = None
  return config

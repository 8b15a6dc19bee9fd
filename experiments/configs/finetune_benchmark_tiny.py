"""The fine-tuning benchmark at a tiny size for the tests: synthetic class-coloured images.

Pretraining on synthetic images named by CIFAR-100's fine labels, the search on CIFAR-100's
coarse ones, the benchmark on CIFAR-10's; DP-GCL and the non-private reference, one ε, one seed,
the base candidate of each search only.
"""

from experiments.configs import clip_benchmark_tiny
from experiments.configs import clip_tiny
from experiments.configs import finetune_benchmark


def get_config():
  config = clip_benchmark_tiny.get_config()
  pretrain = finetune_benchmark.with_fine_tuning_fields(clip_tiny.get_config())
  pretrain.methods = ("non_private",)
  pretrain.data.train_subset = 64
  pretrain.data.test_subset = 50
  pretrain.save_params = True
  config.pretrain = pretrain
  config.search_base = finetune_benchmark.with_fine_tuning_fields(config.search_base)
  config.search_base.data.label = "coarse"
  config.benchmark_base = finetune_benchmark.with_fine_tuning_fields(config.benchmark_base)
  config.variants = ("scratch", "all", "heads")
  config.mechanisms = ("dp_gcl", "non_private")
  config.seeds = (0,)
  config.grids.learning_rate = ()
  return config

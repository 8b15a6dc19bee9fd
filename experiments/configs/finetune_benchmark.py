"""Private fine-tuning of pretrained two towers on CIFAR-10, measured.

    nice -n 19 python -m experiments.finetune_benchmark --data_dir=DIR

``pretrain``: both towers trained non-privately on CIFAR-100's 50,000 training images and their
fine class names (public), 3 epochs of 256 (`clip_cifar100`), params saved. ``search_base`` and
``benchmark_base`` are those of `clip_benchmark` (the search on CIFAR-100's coarse labels, the
benchmark on CIFAR-10: q = 0.02, T = 100, δ = 1e-5), with one vocabulary for every stage (the
class names of CIFAR-100, fine and coarse, and of CIFAR-10) and the fine-tuning fields
``init_from`` (set per variant by the driver) and ``trainable``. Variants: from scratch, every
parameter fine-tuned, the projection heads only. Mechanisms, ε, seeds and grids as in
`clip_benchmark` (see `experiments.finetune_benchmark`).
"""

from ml_collections import config_dict

from experiments.configs import clip_benchmark
from experiments.configs import clip_cifar100

#: The class names the text tower's vocabulary holds in every stage.
VOCABULARY = ("cifar100:fine", "cifar100:coarse", "cifar10")


def with_fine_tuning_fields(config):
  """config with the fine-tuning fields of `experiments.clip` (typed, so a driver can set them)."""
  config.vocabulary_from = VOCABULARY
  config.init_from = config_dict.placeholder(str)
  config.trainable = "all"
  return config


def pretrain():
  """Non-private two-tower training on CIFAR-100 (fine labels), its params saved."""
  config = with_fine_tuning_fields(clip_cifar100.get_config())
  config.methods = ("non_private",)
  config.data.test_subset = 2_000
  config.save_params = True
  return config


def get_config():
  config = clip_benchmark.get_config()
  config.pretrain = pretrain()
  config.search_base = with_fine_tuning_fields(config.search_base)
  config.benchmark_base = with_fine_tuning_fields(config.benchmark_base)
  config.variants = ("scratch", "all", "heads")
  return config

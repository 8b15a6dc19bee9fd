"""Tiny CLIP config for the tests: synthetic class-coloured 8x8 images, a few steps.

The class names come from the shipped experiments/label_names/cifar100.json (100 classes).
"""

from experiments.configs import clip_cifar100


def get_config():
  config = clip_cifar100.get_config()
  config.data.source = "synthetic"
  config.data.image_size = 8
  config.data.train_subset = 200
  config.data.test_subset = 100
  config.model.embedding_dim = 4
  config.model.channels = (4,)
  config.model.text_width = 8
  config.batch_size = 16
  config.num_epochs = 1.0
  config.learning_rates.non_private = 3e-2
  config.clip_norm = 0.1
  config.log_every = 5
  config.eval_batch_size = 50
  config.privacy_seed = 0  # reproducible for the tests; NOT private against the config's reader
  return config

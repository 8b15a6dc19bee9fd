"""Tiny fine-tuning config for the tests: digits, 2 epochs."""

from experiments.configs import cifar100_finetune


def get_config():
  config = cifar100_finetune.get_config()
  config.data.source = "digits"
  config.data.name = "digits"
  config.data.label = "fine"
  config.data.train_subset = 300
  config.data.test_subset = 100
  config.batch_size = 64
  config.num_epochs = 2
  return config

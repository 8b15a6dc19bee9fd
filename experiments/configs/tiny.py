"""Tiny config for the tests: a subset of digits, a tiny MLP, a few steps per method.

Use ``--config.model.name=embedding_net`` to exercise the paper's network instead
(slower to compile).
"""

from experiments.configs import default


def get_config():
  config = default.get_config()
  config.data.train_subset = 300
  config.data.test_subset = 100
  config.batch_size = 32
  config.num_epochs = 1
  config.target_epsilon = 8.0
  config.eval_num_batches = 1
  config.log_every = 2
  config.checkpoint_every = 2
  config.linear_probe = True
  config.progress = False
  config.model.name = "mlp"
  config.model.hidden = (16,)
  config.privacy_seed = 0  # reproducible for the tests; NOT private against the config's reader
  return config

"""CLIP-style two-tower training on CIFAR-10 (images + "a photo of a <label>" texts).

    python -m experiments.clip --config=experiments/configs/clip_cifar10.py \
        --config.data.npz_dir=/path/to/cifar --config.seed=S --workdir=runs/clip_cifar10_sS

`clip_cifar100` on CIFAR-10's 10 classes (zero-shot chance 0.1), sized for a CPU: 10,000
training records and large Poisson batches (Logit-DP's signal grows with n against a noise
σ·C that does not). The setting is fixed a priori, not tuned on CIFAR-10.
"""

from experiments.configs import clip_cifar100


def get_config():
  config = clip_cifar100.get_config()
  config.data.name = "cifar10"
  config.data.train_subset = 10_000
  config.data.test_subset = 2_000
  config.batch_size = 1000
  config.num_epochs = 2.0
  config.clip_norm = 1e-3
  config.learning_rates.logit_dp = 3e-3
  config.learning_rates.non_private = 3e-3
  config.eval_batch_size = 1000
  config.log_every = 1
  return config

"""CLIP-style two-tower training on CIFAR-100 (images + "a photo of a <fine label>" texts).

    python -m experiments.clip --config=experiments/configs/clip_cifar100.py \
        --config.data.npz_dir=/path/to/cifar

Image tower: the paper's embedding net (widened to d = 16); text tower: bag of words over a
word vocabulary built from the class names. Zero-shot accuracy on the test images.
"""

import ml_collections
from ml_collections import config_dict


def get_config():
  config = ml_collections.ConfigDict()
  config.seed = 0  # data subset, initialisation, non-private shuffling (public)
  # Noise key and Poisson seed of the private run: None draws them secretly and keeps them in
  # <workdir>.secrets/ (or secrets_dir); an int makes the run reproducible but NOT private.
  config.privacy_seed = config_dict.placeholder(int)
  config.secrets_dir = config_dict.placeholder(str)
  config.methods = ("logit_dp", "non_private")

  config.data = ml_collections.ConfigDict()
  config.data.source = "npz"  # npz | synthetic (tests)
  config.data.name = "cifar100"
  config.data.label = "fine"
  config.data.npz_dir = config_dict.placeholder(str)  # folder with cifar100.npz
  # JSON {"fine_label_names": [...]}; None: experiments/label_names/<data.name>.json (shipped)
  config.data.label_names = config_dict.placeholder(str)
  config.data.train_subset = config_dict.placeholder(int)  # None: all 50,000 training images
  config.data.test_subset = config_dict.placeholder(int)  # None: all 10,000 test images
  config.data.image_size = 32  # synthetic only
  config.text_template = "a photo of a {}"

  config.model = ml_collections.ConfigDict(
      dict(embedding_dim=16, channels=(8, 16, 32), text_width=32))

  config.temperature = 1.0
  config.batch_size = 256  # expected (Poisson) batch size / non-private batch size
  config.num_epochs = 3.0
  # Each method's own learning rate (Adam).
  config.learning_rates = ml_collections.ConfigDict(
      dict(logit_dp=2e-3, dp_gcl=2e-3, naive_dp=2e-3, non_private=3e-3))
  # DP-GCL: records hashed into G = round(batch_size / group_size) groups at every step.
  config.dp_gcl = ml_collections.ConfigDict(dict(group_size=8))

  # Privacy (one record = one image-text pair).
  config.target_epsilon = 8.0
  config.target_delta = 1e-5
  config.clip_norm = 1e-3  # B (results.json reports the share of pairs above it at the start)
  config.clip_method = "ghost"  # disjoint towers: exact norms at triangle's cost either way
  config.microbatch_size = config_dict.placeholder(int)
  # Valid pairs with non-finite inputs or embeddings are dropped (private); "warn" reports
  # them, "error" stops the run.
  config.on_nonfinite_rows = "warn"

  # Private runs: a checkpoint every this many steps (0: none), from which a re-run resumes.
  config.checkpoint_every = 0
  config.eval_batch_size = 1000
  config.log_every = 20
  return config

"""Default config: a quick, fully offline demo on scikit-learn's 8x8 digits.

    python experiments/pretrain.py        # trains Logit-DP, Naive-DP, non-private; prints the table

1,797 images (1,437 train / 360 test), same-class pairs -> ~715 records, the paper's
embedding net, ε = 5.  A few minutes on two CPU cores.
"""

import ml_collections
from ml_collections import config_dict


def get_config():
  config = ml_collections.ConfigDict()
  config.seed = 0  # data split, pairs, init, augmentation (public)
  # Noise key and Poisson sampling seed of DP runs: None draws them secretly (see
  # experiments.train.privacy_seeds); an int makes runs reproducible but not private.
  config.privacy_seed = config_dict.placeholder(int)
  # Where those secret seeds are kept (None: "<workdir>.secrets", outside the results folder).
  config.secrets_dir = config_dict.placeholder(str)
  config.methods = ("logit_dp", "naive_dp", "non_private")

  config.data = ml_collections.ConfigDict()
  config.data.source = "digits"  # digits | npz | tfds
  config.data.name = "digits"  # cifar10 | cifar100 for npz/tfds
  config.data.label = "fine"  # fine | coarse (CIFAR-100 superclasses)
  # Folder with cifar10.npz / cifar100.npz (None: $LOGIT_DP_CIFAR_DIR, else the official archive,
  # downloaded, verified and unpacked once into $LOGIT_DP_DATA_DIR or ~/.cache/logit_dp).
  config.data.npz_dir = config_dict.placeholder(str)
  config.data.tfds_data_dir = config_dict.placeholder(str)
  config.data.test_fraction = 0.2  # digits only
  config.data.train_subset = config_dict.placeholder(
      int)  # use only this many (random) train images
  config.data.test_subset = config_dict.placeholder(int)

  # Positive pairs: "same_class" (two different images of a class, as in the
  # authors' code) or "augment" (two random augmentations of one image).
  config.pair_mode = "same_class"
  config.augment_same_class = False  # also augment the two views of same_class pairs
  config.augment = ml_collections.ConfigDict(
      dict(crop_padding=1, flip=False, brightness=0.3, contrast=0.3, saturation=0.0))

  config.model = ml_collections.ConfigDict(dict(name="embedding_net", embedding_dim=8))

  config.loss = "contrastive"
  config.temperature = 1.0
  config.batch_size = 100  # expected batch size (Poisson) / batch size (epochs)
  config.num_epochs = 20
  config.learning_rate = 1e-2  # fallback for methods missing from learning_rates
  config.learning_rates = ml_collections.ConfigDict(
      dict(logit_dp=1e-2, naive_dp=1e-2, non_private=1e-3))
  # Adam's learning rate over the run's T updates (experiments.train.learning_rate_schedule):
  # "constant", "cosine" (down to lr_final_fraction·lr) or "warmup_cosine" (linear warm-up over
  # lr_warmup_steps updates, then cosine).
  config.lr_schedule = "constant"
  config.lr_final_fraction = 0.0
  config.lr_warmup_steps = 0

  # Privacy.
  config.target_epsilon = 5.0
  config.target_delta = 1e-5
  config.accountant = "pld"
  config.noise_multiplier = config_dict.placeholder(
      float)  # None: calibrated to (target_epsilon, target_delta)
  # True: σ is calibrated at δ minus the padded batches' overflow term, so the certified δ
  # (overflow term included) is at most target_delta, and training refuses steps past it.
  # False: σ at target_delta, the certified δ slightly above it.
  config.delta_includes_overflow = True
  config.clip_norm = 1.0
  # ghost (exact, bounded memory) | projected (a bound exact on the span of public references'
  # Jacobians; needs config.projection, as configs/cifar10_embedding_net_projected.py) |
  # materialize (exact, all pair gradients in memory; small models) | triangle (an upper bound:
  # private, but biased towards collapse for contrastive losses).
  config.clip_method = "ghost"
  config.microbatch_size = config_dict.placeholder(int)
  config.log_private_train_loss = False
  # The fraction of pairs clipped and the median pair norm of each logged step (NON-PRIVATE
  # diagnostics for tuning clip_norm: they are computed on the batch without noise).
  config.log_clip_stats = False
  # DP-GCL (method "dp_gcl", the grouped baseline): records are hashed by id into
  # G = round(batch_size / group_size) groups every step; extra_views augmented views of
  # each record join its group's negatives. Not in `methods` by default.
  config.dp_gcl = ml_collections.ConfigDict(dict(group_size=8.0, extra_views=0))
  # Refuse to train past target_epsilon (e.g. more epochs on resume).
  config.allow_exceeding_budget = False

  # Evaluation.
  config.knn_k = 3
  config.knn_train_size = config_dict.placeholder(int)  # None: all train embeddings
  config.f_beta = 1.0
  config.linear_probe = True
  config.eval_batch_size = config_dict.placeholder(int)  # test-loss batches (None: batch_size)
  config.eval_num_batches = 3

  # Running.
  config.num_devices = 1  # data-parallel devices: 1, k, or -1 for every visible device
  config.log_every = 10
  config.checkpoint_every = 50
  config.stop_after_steps = config_dict.placeholder(
      int)  # stop early (simulate an interruption); rerun resumes
  config.progress = True
  return config

"""CIFAR-100 fine-tuning (20 coarse labels) on frozen pre-trained encoders (paper setting).

Batch 400, 10 epochs, Adam lr 1e-2, head 64-32-20, as the paper; unlike the paper, the frozen
embeddings are standardised per feature with the CIFAR-100 train split's mean and std before
the head (`standardize_embeddings`): without it the head collapsed to one class on a private
encoder whose embeddings have norms around 10 (docs/results_in_detail.md).

    python experiments/finetune.py --config=experiments/configs/cifar100_finetune.py \
        --config.pretrain_workdir=runs/cifar10_embnet --config.data.npz_dir=DIR
"""

import ml_collections
from ml_collections import config_dict


def get_config():
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.pretrain_workdir = ""  # --workdir of a finished pretrain.py run (required)
  config.methods = ()  # () = every method found in pretrain_workdir
  config.data = ml_collections.ConfigDict(
      dict(source="npz", name="cifar100", label="coarse", npz_dir=config_dict.placeholder(str),
           tfds_data_dir=config_dict.placeholder(str), test_fraction=0.2,
           train_subset=config_dict.placeholder(int), test_subset=config_dict.placeholder(int)))
  config.head_hidden = (64, 32)
  config.batch_size = 400
  config.num_epochs = 10
  config.learning_rate = 1e-2
  config.standardize_embeddings = True  # False: the paper's recipe, raw embeddings
  config.f_beta = 1.0
  config.linear_probe = True
  return config

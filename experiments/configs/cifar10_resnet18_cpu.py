"""ResNet-18 without batch norm on a CPU-sized CIFAR-10 subset, at the paper's q and T.

The paper: batch 1,000 of 25,000 pair records (q = 0.04), 2 epochs (T = 50), ε = 5,
Adam 1e-4 / 1e-3 / 1e-2 (Logit-DP / Naive-DP / non-private), ResNet-18 with its batch
norm layers removed (``norm="none"``; GroupNorm: --config.model.norm=group).  Here:
a random 5,000-image subset of the train split (2,500 same-class pair records),
expected batch 100, so q = 0.04 and T = 50 as in the paper and σ is the paper
setting's σ; B = 1 (ours), triangle clipping, microbatches of 10. The 3-NN
classifier and the probe use the 5,000 subset embeddings, against the whole test split.

    python experiments/pretrain.py --config=experiments/configs/cifar10_resnet18_cpu.py \
        --config.data.npz_dir=DIR --config.seed=0 --workdir=runs/cifar10_resnet18_cpu_s0
"""

from experiments.configs import cifar10_resnet18


def get_config():
  config = cifar10_resnet18.get_config()
  config.model.norm = "none"
  config.data.train_subset = 5_000
  config.batch_size = 100
  config.num_epochs = 2
  config.learning_rates = dict(logit_dp=1e-4, naive_dp=1e-3, non_private=1e-2)
  config.microbatch_size = 10
  config.eval_batch_size = 100
  config.eval_num_batches = 2
  config.log_every = 5
  config.checkpoint_every = 5
  config.progress = False
  return config

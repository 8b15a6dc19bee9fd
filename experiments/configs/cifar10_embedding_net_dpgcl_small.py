"""DP-GCL beside Logit-DP and Naive-DP, sized for a 2-core CPU (~15 minutes).

The embedding-net run of `cifar10_embedding_net_cpu` made smaller: a random 4,000-image subset
of the CIFAR-10 train split (2,000 same-class pair records), expected batch 800, so the
sampling rate q = 0.4, T = 50 steps, ε = 5 / δ = 1e-5 and σ are the paper run's. DP-GCL hashes
the records into round(800 / 8) = 100 groups per step (expected group size 8) with 2 extra
augmented views per record; its settings were fixed before any run, not tuned on CIFAR-10.
Evaluation uses the full 10,000-image test split.

    python experiments/pretrain.py \
        --config=experiments/configs/cifar10_embedding_net_dpgcl_small.py \
        --config.data.npz_dir=DIR --workdir=runs/dpgcl_small_cifar10_embnet_s0
"""

from experiments.configs import cifar10_embedding_net_cpu


def get_config():
  config = cifar10_embedding_net_cpu.get_config()
  config.methods = ("dp_gcl", "logit_dp", "naive_dp")
  config.data.train_subset = 4_000
  config.batch_size = 800
  config.microbatch_size = 400
  config.eval_batch_size = 1_000
  config.log_every = 10
  config.dp_gcl.group_size = 8.0
  config.dp_gcl.extra_views = 2
  return config

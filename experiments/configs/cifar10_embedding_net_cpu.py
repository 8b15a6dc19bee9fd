"""The embedding-net run sized for a 2-core CPU, ~20 minutes (docs/results_in_detail.md).

Same sampling rate q = 0.4, same T = 50 steps, same ε = 5 / δ = 1e-5 and therefore the
same noise multiplier σ as the paper's run (batch 10,000 of 25,000 pair records):
only the data is a random 10,000-image subset of the CIFAR-10 train split (5,000
same-class pair records) and the expected batch is 2,000.  Logit-DP clips with
clip_method="triangle" (an upper bound of the pair norms: private, clips more),
because exact ghost norms cost O(n^2 d p) per step.  Evaluation uses the full
10,000-image test split.

    python experiments/pretrain.py --config=experiments/configs/cifar10_embedding_net_cpu.py \
        --config.data.npz_dir=DIR --workdir=runs/cifar10_embnet_cpu
"""

from experiments.configs import cifar10_embedding_net


def get_config():
  config = cifar10_embedding_net.get_config()
  config.data.train_subset = 10_000
  config.batch_size = 2_000
  config.clip_method = "triangle"
  config.microbatch_size = 500
  config.eval_batch_size = 2_000
  config.eval_num_batches = 2
  return config

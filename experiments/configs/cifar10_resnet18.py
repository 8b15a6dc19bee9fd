"""Paper run: ResNet-18 (no batch norm; GroupNorm) on CIFAR-10: batch 1,000, 2 epochs.

    python experiments/pretrain.py --config=experiments/configs/cifar10_resnet18.py \
        --config.data.npz_dir=DIR --workdir=runs/cifar10_resnet18

Per-pair clipping of an 11M-parameter network: Logit-DP uses the cheaper
clip_method="triangle" (clips by an upper bound of every pair-gradient norm:
still private, clips more than needed).  Meant for an accelerator.
"""

from experiments.configs import cifar10_embedding_net


def get_config():
  config = cifar10_embedding_net.get_config()
  config.model = dict(name="resnet18", embedding_dim=8, width=64, norm="group", num_groups=32)
  config.batch_size = 1_000
  config.num_epochs = 2
  config.clip_method = "triangle"
  config.microbatch_size = 50
  config.eval_batch_size = 500
  config.eval_num_batches = 2
  config.log_every = 10
  config.checkpoint_every = 10
  return config

"""Paper run: ResNet-18 without batch norm on CIFAR-10: batch 1,000, 2 epochs (accelerator).

The paper's model is ResNet-18 with its batch norm layers removed (``norm="none"``, the
default here; ``--config.model.norm=group`` adds GroupNorm(32) instead). Its learning rates
1e-4 / 1e-3 / 1e-2 (Logit-DP / Naive-DP / non-private), Adam, ε = 5; all 25,000 same-class
pair records, q = 0.04, T = 50. B = 1 (ours; the paper's clip norms are 1e-5 / 1e-3:
``--config.clip_norms="{'logit_dp': 1e-5, 'naive_dp': 1e-3}"``). Per-pair clipping of an
11M-parameter network: Logit-DP uses clip_method="triangle" (clips by an upper bound of every
pair-gradient norm: still private, clips more than needed). In resumable pieces of
under 10 minutes: ``bash tools/gpu/resnet18_gpu.sh DIR``.

    python experiments/pretrain.py --config=experiments/configs/cifar10_resnet18.py \
        --config.data.npz_dir=DIR --workdir=runs/cifar10_resnet18
"""

from experiments.configs import cifar10_embedding_net


def get_config():
  config = cifar10_embedding_net.get_config()
  config.model = dict(name="resnet18", embedding_dim=8, width=64, norm="none", num_groups=32)
  config.batch_size = 1_000
  config.num_epochs = 2
  config.learning_rates = dict(logit_dp=1e-4, naive_dp=1e-3, non_private=1e-2)
  config.clip_method = "triangle"
  config.microbatch_size = 50
  config.eval_batch_size = 500
  config.eval_num_batches = 2
  config.log_every = 10
  config.checkpoint_every = 5
  config.progress = False
  return config

"""DP-GCL, the grouped baseline, beside the full-size embedding-net run.

`cifar10_embedding_net_triangle` (all 25,000 same-class records of CIFAR-10, expected batch
10,000, q = 0.4, T = 50, B = 1, τ = 1, triangle clipping, Adam 1e-2 / 1e-2 / 1e-3) with DP-GCL
beside Logit-DP, Naive-DP and non-private. DP-GCL's setting is fixed a priori, as in
`cifar10_embedding_net_dpgcl_small`, and not tuned on CIFAR-10 (`add_dp_gcl`): expected group
size 8 (G = 1,250 groups of the batch of 10,000), 2 extra augmented views per record, Adam 1e-2,
the run's B. The published runs (``cifar10_embnet_dpgcl``) train DP-GCL alone on the triangle
runs' seeds, paired by seed with their Logit-DP and Naive-DP:

    python experiments/pretrain.py \
        --config=experiments/configs/cifar10_embedding_net_dpgcl.py \
        --config.data.npz_dir=DIR --config.methods="('dp_gcl',)" --config.seed=S \
        --workdir=runs/cifar10_embnet_dpgcl_sS

`cifar10_embedding_net_tuned` adds DP-GCL with the same `add_dp_gcl`.
"""

from experiments.configs import cifar10_embedding_net_triangle

ALL_METHODS = ("logit_dp", "naive_dp", "dp_gcl", "non_private")


def add_dp_gcl(config):
  """``config`` with DP-GCL among its methods, at the a-priori setting (in place)."""
  config.methods = ALL_METHODS
  config.learning_rates.dp_gcl = 1e-2
  config.dp_gcl.group_size = 8.0
  config.dp_gcl.extra_views = 2
  return config


def get_config():
  return add_dp_gcl(cifar10_embedding_net_triangle.get_config())

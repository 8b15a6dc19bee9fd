"""Accuracy-vs-ε curves (issue #18 item 3): the full-size embedding-net run with four methods.

`cifar10_embedding_net_triangle` (all 25,000 same-class records of CIFAR-10, expected batch
10,000, q = 0.4, T = 50, B = 1, τ = 1, triangle clipping, Adam 1e-2 / 1e-2 / 1e-3) with
DP-GCL beside Logit-DP, Naive-DP and non-private. DP-GCL's setting is fixed a priori, as in
`cifar10_embedding_net_dpgcl_small` and not tuned on CIFAR-10: expected group size 8
(G = 1,250 groups of the batch of 10,000), 2 extra augmented views per record, Adam 1e-2,
B = 1. ε is set per run; σ is recalibrated by the accountant for it:

    python experiments/pretrain.py \
        --config=experiments/configs/cifar10_embedding_net_eps_curve.py \
        --config.data.npz_dir=DIR --config.target_epsilon=E --config.seed=S \
        --workdir=runs/cifar10_embnet_epsE_sS

The runs of ε = E form the group ``cifar10_embnet_eps<E>`` (experiments/queue_eps.txt); the
ε = 5 Logit-DP, Naive-DP and non-private points are the ``cifar10_embnet_triangle`` group,
this config without DP-GCL.
"""

from experiments.configs import cifar10_embedding_net_triangle


def get_config():
  config = cifar10_embedding_net_triangle.get_config()
  config.methods = ("logit_dp", "naive_dp", "dp_gcl", "non_private")
  config.learning_rates.dp_gcl = 1e-2
  config.dp_gcl.group_size = 8.0
  config.dp_gcl.extra_views = 2
  return config

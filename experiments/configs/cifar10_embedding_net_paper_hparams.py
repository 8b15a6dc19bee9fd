"""The paper-size embedding-net run with the paper's own clip norms (triangle clipping).

As `cifar10_embedding_net_triangle` (25,000 records, batch 10,000, T = 50, ε = 5), but with
the "ℓ2 sensitivity" hyper-parameters of the paper's appendix taken as clip norms:
B = 1e-5 for Logit-DP and B = 1e-4 for Naive-DP (ours: B = 1 for both), and the
paper's learning rates 1e-2 / 1e-2 / 1e-3 (the same as ours). The noise standard
deviation scales with B (σ·C(τ)·B and σ·2B), so only the clipping regime and Adam's
ε_adam = 1e-8 against the update's scale differ from B = 1.

    python experiments/pretrain.py \
        --config=experiments/configs/cifar10_embedding_net_paper_hparams.py \
        --config.data.npz_dir=DIR --config.seed=0 --workdir=runs/cifar10_embnet_paper_s0
"""

from experiments.configs import cifar10_embedding_net_triangle


def get_config():
  config = cifar10_embedding_net_triangle.get_config()
  config.clip_norms = dict(logit_dp=1e-5, naive_dp=1e-4)
  config.learning_rates = dict(logit_dp=1e-2, naive_dp=1e-2, non_private=1e-3)
  return config

"""The paper-size embedding-net run on a CPU: clip_method="triangle" (docs/results_in_detail.md).

Everything as in `cifar10_embedding_net` (all 25,000 same-class pair records of the
50,000 CIFAR-10 train images, expected batch 10,000, q = 0.4, T = 50, 20 epochs,
ε = 5, δ = 1e-5, B = 1, τ = 1, Adam 1e-2 / 1e-2 / 1e-3), except that Logit-DP
clips by the triangle upper bound of every pair-gradient norm,
‖∇Z_ij‖ ≤ ‖∇_θ φ(x_i)ᵀ v_j‖ + ‖∇_θ φ(x'_j)ᵀ u_i‖ (private, clips more than the exact ghost
norms), at O(n d p) per step instead of O(n² d p): about 5 s per Logit-DP step on 2 CPU cores.

    python experiments/pretrain.py --config=experiments/configs/cifar10_embedding_net_triangle.py \
        --config.data.npz_dir=DIR --config.seed=0 --workdir=runs/cifar10_embnet_triangle_s0
"""

from experiments.configs import cifar10_embedding_net


def get_config():
  config = cifar10_embedding_net.get_config()
  config.clip_method = "triangle"
  config.progress = False
  return config

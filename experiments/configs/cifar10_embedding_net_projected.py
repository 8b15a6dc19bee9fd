"""The paper-size embedding-net run with clip_method="projected" (docs/METHOD.md).

Everything as in `cifar10_embedding_net_triangle` (25,000 same-class CIFAR-10 pair records,
expected batch 10,000, q = 0.4, T = 50, ε = 5, δ = 1e-5, B = 1, τ = 1), except that Logit-DP
clips by the projected bound: exact on the top-32 singular subspace of the Jacobians of 64
CIFAR-100 train images (public data, drawn with a fixed seed) at the current parameters, the
triangle bound on the rest. The triangle bound over-estimates the negative pairs' norms ~5×
and biases ḡ towards collapse (docs/results_in_detail.md, "Clip methods at the paper's size");
this one over-estimates them ~1.1×.

    python experiments/pretrain.py --config=experiments/configs/cifar10_embedding_net_projected.py \
        --config.data.npz_dir=DIR --config.seed=0 --workdir=runs/cifar10_embnet_projected_s0
"""

from experiments.configs import cifar10_embedding_net_triangle


def projection_config(reference: str = "cifar100", split: str = "train"):
  """The public reference of clip_method="projected": ``num_reference`` images of
  ``reference``'s ``split`` (same npz_dir and preprocessing as the data), drawn with ``seed``;
  subspace rank ``rank``."""
  import ml_collections
  return ml_collections.ConfigDict(
      dict(reference=reference, split=split, num_reference=64, seed=0, rank=32))


def get_config():
  config = cifar10_embedding_net_triangle.get_config()
  config.clip_method = "projected"
  config.projection = projection_config()
  return config

"""Paper run: the embedding net on CIFAR-10 (Kong, Muñoz Medina & Ribero, ICLR 2025).

Batch 10,000, 20 epochs, Adam with lr 1e-2 (Logit-DP), 1e-2 (Naive-DP), 1e-3
(non-private), ε = 5, same-class pairs (as in the authors' released code).

    python experiments/pretrain.py --config=experiments/configs/cifar10_embedding_net.py \
        --config.data.npz_dir=DIR --workdir=runs/cifar10_embnet

DIR holds cifar10.npz (`python -m experiments.cifar --out DIR` makes it from the official
archive); without ``--config.data.npz_dir`` the archive is downloaded into the cache folder once.
The 50,000 train images make 25,000 disjoint same-class pair records, so q = 0.4 and T = 50
steps.  Exact ghost clipping at n = 10,000 costs O(n^2 d p) per step: an accelerator's work
(about 400 s a step on two CPU cores, docs/BENCHMARKS.md).  On a CPU use
`cifar10_embedding_net_projected` (clip_method="projected": a bound exact on the span of public
CIFAR-100 references' Jacobians, close to the exact norms), not clip_method="triangle": the
triangle bound over-estimates the negative pairs' norms several-fold, so clipping biases the
gradient towards collapsed embeddings (docs/results_in_detail.md).
"""

from experiments.configs import default


def get_config():
  config = default.get_config()
  config.data.source = "npz"
  config.data.name = "cifar10"
  config.data.label = "fine"
  config.pair_mode = "same_class"
  # "untrained": the initial parameters evaluated as the floor (no training, ε = 0).
  config.methods = ("logit_dp", "naive_dp", "non_private", "untrained")
  config.augment = dict(crop_padding=4, flip=True, brightness=0.4, contrast=0.4, saturation=0.4)
  config.model.name = "embedding_net"
  config.model.embedding_dim = 8
  config.batch_size = 10_000
  config.num_epochs = 20
  config.learning_rates = dict(logit_dp=1e-2, naive_dp=1e-2, non_private=1e-3)
  config.target_epsilon = 5.0
  config.target_delta = 1e-5
  config.clip_norm = 1.0
  config.clip_method = "ghost"
  config.microbatch_size = 1000  # bounds memory of per-example Jacobians
  config.eval_batch_size = 1000
  config.eval_num_batches = 4
  config.log_every = 1
  config.checkpoint_every = 5
  return config

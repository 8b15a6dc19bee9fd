"""Experiments for Logit-DP: private contrastive pre-training and fine-tuning.

Entry points (absl + ml_collections, the flax examples convention)::

    python experiments/pretrain.py                       # digits demo, default config
    python experiments/pretrain.py --config=experiments/configs/cifar10_embedding_net.py \
        --config.data.npz_dir=/path/to/npz --workdir=runs/cifar10_embnet
    python experiments/finetune.py --config=experiments/configs/cifar100_finetune.py \
        --config.pretrain_workdir=runs/cifar10_embnet --config.data.npz_dir=/path/to/npz
    python -m experiments.clip_benchmark --data_dir=/path/to/npz   # private two towers, tuned
    python -m experiments.people_benchmark --data_dir=/path/to/npz # the same, privacy per person

Without ``--config.data.npz_dir``, CIFAR-10/100 are downloaded from the official archives,
verified and cached the first time (`experiments.cifar`).
"""

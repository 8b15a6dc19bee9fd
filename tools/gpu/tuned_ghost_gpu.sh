#!/usr/bin/env bash
# Logit-DP with exact pair norms (clip_method="ghost") at the tuned CIFAR-10 setting
# (experiments/configs/cifar10_embedding_net_tuned.py: ε = 5, d = 32, τ = 2, B = 3, expected
# batch 10,000, T = 50), the seeds of docs/results/cifar10_embnet_tuned_s*, with their σ
# (delta_includes_overflow=False), so that ghost compares with projected Logit-DP, DP-GCL,
# Naive-DP and non-private seed by seed. Each seed has a public privacy seed (noise seed p,
# sampling seed p + 1): an accuracy measurement, not a private release.
#
#   bash tools/gpu/tuned_ghost_gpu.sh NPZ_DIR OUT_DIR [SEEDS]
#
# NPZ_DIR holds cifar10.npz; SEEDS defaults to "0 1 2". Each seed trains in
# OUT_DIR/cifar10_embnet_tuned_ghost_s<seed> (checkpointed every step: re-running resumes), timed
# in its wallclock.json. Copy a finished seed's config.json, results.json and wallclock.json to
# docs/results/<name>/ and run `python -m experiments.render_results` (docs/RESULTS.md).
#
# Cost: on one H100 a ghost step of the paper's net (d = 8) at n = 10,000 takes 1.5-2.5 s
# (docs/BENCHMARKS.md), and ghost's pair terms grow as d² (8.4× from d = 8 to d = 32 on the CPU at
# n = 1,000), so 13-40 s a step at d = 32: 11-33 minutes of training per seed.
set -euo pipefail
NPZ=${1:?usage: tuned_ghost_gpu.sh NPZ_DIR OUT_DIR [SEEDS]}
OUT=${2:?usage: tuned_ghost_gpu.sh NPZ_DIR OUT_DIR [SEEDS]}
SEEDS=${3:-0 1 2}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
NPZ=$(cd "$NPZ" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
for seed in $SEEDS; do
  python3 experiments/pretrain.py --config=experiments/configs/cifar10_embedding_net_tuned.py \
    --config.data.npz_dir="$NPZ" --config.seed="$seed" --config.methods="('logit_dp',)" \
    --config.clip_method=ghost --config.progress=False --config.checkpoint_every=1 \
    --config.delta_includes_overflow=False --config.privacy_seed=$((20261200 + 2 * seed)) \
    --workdir="$OUT/cifar10_embnet_tuned_ghost_s$seed"
done

#!/usr/bin/env bash
# The paper's ResNet-18 run (experiments/configs/cifar10_resnet18.py: no batch norm, 25,000
# records, batch 1,000, 2 epochs; Logit-DP with triangle clipping, Naive-DP, non-private) on an
# accelerator: test accuracy, the privacy guarantee and the time of each method.
#
#   bash tools/gpu/resnet18_gpu.sh NPZ_DIR OUT_DIR [SEED] [--config.key=value ...]
#
# NPZ_DIR holds cifar10.npz. The run trains in OUT_DIR (default seed 0; re-running resumes from
# its checkpoints, which hold the secret noise key: share only config.json, results.json,
# wallclock.json and the metrics.csv files). An H100 step of Logit-DP (triangle) at n = 256
# takes 0.73 s (docs/BENCHMARKS.md), so about 3 s at n ≈ 1,000: 2.5 minutes for Logit-DP's 50
# steps, 5-7 minutes with the other methods, their compilations and evaluations.
#
# On the CPU subset the non-private run diverges at the paper's Adam 1e-2 and learns at 1e-4
# (docs/RESULTS.md); if it diverges here too (test loss at ln(batch), embeddings all one
# direction: experiments/embedding_geometry.py), add a non-private reference:
#   bash tools/gpu/resnet18_gpu.sh NPZ_DIR OUT_DIR_NP 0 --config.methods="('non_private',)" \
#     --config.learning_rates.non_private=1e-4
set -euo pipefail
NPZ=${1:?usage: resnet18_gpu.sh NPZ_DIR OUT_DIR [SEED] [--config.key=value ...]}
OUT=${2:?usage: resnet18_gpu.sh NPZ_DIR OUT_DIR [SEED] [--config.key=value ...]}
SEED=${3:-0}
shift $(($# < 3 ? $# : 3))
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
NPZ=$(cd "$NPZ" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
python3 experiments/pretrain.py --config=experiments/configs/cifar10_resnet18.py \
  --config.data.npz_dir="$NPZ" --config.seed="$SEED" --workdir="$OUT" "$@"

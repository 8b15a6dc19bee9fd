#!/usr/bin/env bash
# The paper's ResNet-18 run (no batch norm, 25,000 records, batch 1,000, 2 epochs, 3 methods)
# on an accelerator, in resumable pieces: each call of pretrain.py advances every unfinished
# method by STEPS steps (then checkpoints and exits), so no piece runs much longer than
# STEPS steps; re-running this script resumes where the last piece stopped.
#
#   bash tools/gpu/resnet18_gpu.sh DIR [SEED] [STEPS] [EXTRA --config flags...]
#
# DIR holds cifar10.npz. One H100 step of Logit-DP (triangle, n = 1,000) should take well under
# a minute; lower STEPS if a piece nears 10 minutes (steps/s is in <method>/metrics.csv).
#
# On the CPU subset the non-private run diverges at the paper's Adam 1e-2 and learns at 1e-4
# (docs/RESULTS.md); if it diverges here too (test loss at ln(batch), embeddings
# all one direction: experiments/embedding_geometry.py), add a non-private reference:
#   WORKDIR=runs/cifar10_resnet18_np_lr1e-4_s0 bash tools/gpu/resnet18_gpu.sh DIR 0 10 \
#     --config.methods="('non_private',)" --config.learning_rates.non_private=1e-4
#
# On a remote accelerator host reached by calls of at most 10 minutes that carry at most 64 MiB
# each way, the data travels in parts (tools/gpu/gpu_stage.sh) and the run must finish inside the
# calls that follow, on the machine kept warm by calling back to back: its checkpoints (~135 MB
# a method, and they hold the secret noise key) cannot come back, so a run cut off there is
# lost. STEPS = 50 trains each method in one piece (T = 50), so each compiles once. The call
# sequence for one 15-minute budget is in tools/README.md; its last calls are
#   bash tools/gpu/gpu_stage.sh receive .gpu_stage/part02 /tmp/stage /tmp/cifar &&
#   export PYTHONPATH=/tmp/stage/site:$PWD PYTHONUNBUFFERED=1 &&
#   (setsid nohup bash tools/gpu/resnet18_gpu.sh /tmp/cifar 0 50 >/tmp/r18.log 2>&1 &) &&
#   bash tools/gpu/resnet18_gpu.sh --wait 480
# and, at once if it has not finished:  bash tools/gpu/resnet18_gpu.sh --wait SECONDS
# --wait SECONDS waits until every method of WORKDIR has finished or SECONDS have passed, prints
# the log's last lines (R18_LOG, default /tmp/r18.log) and collects. --collect copies config.json,
# results.json and each method's metrics.csv of WORKDIR (default runs/cifar10_resnet18_s0) to
# $OUT: no checkpoint.
set -euo pipefail
finished() {  # finished WORKDIR: every method of its results.json has finished
  python3 - "$1" <<'PY'
import json, os, sys
p = os.path.join(sys.argv[1], "results.json")
ok = os.path.exists(p) and all(r.get("finished") for r in json.load(open(p)).values())
sys.exit(0 if ok else 1)
PY
}
if [[ "${1:-}" == "--wait" ]]; then
  limit=${2:?usage: resnet18_gpu.sh --wait SECONDS}
  cd "$(dirname "$0")/../.."
  end=$(($(date +%s) + limit))
  until finished "${WORKDIR:-runs/cifar10_resnet18_s0}" || (($(date +%s) >= end)); do
    sleep 5
  done
  if [[ -f ${R18_LOG:-/tmp/r18.log} ]]; then tail -5 "${R18_LOG:-/tmp/r18.log}"; fi
  set -- --collect
fi
if [[ "${1:-}" == "--collect" ]]; then
  W=${WORKDIR:-runs/cifar10_resnet18_s0}
  cd "$(dirname "$0")/../.."
  for f in config.json results.json; do [[ -f $W/$f ]] && cp "$W/$f" "$OUT/"; done
  for m in logit_dp naive_dp non_private; do
    [[ -f $W/$m/metrics.csv ]] && cp "$W/$m/metrics.csv" "$OUT/$m.metrics.csv"
  done
  ls "$OUT"
  exit 0
fi
DIR=${1:?usage: resnet18_gpu.sh NPZ_DIR [SEED] [STEPS] [flags...]}
SEED=${2:-0}
STEPS=${3:-5}
shift $(( $# < 3 ? $# : 3 ))
WORKDIR=${WORKDIR:-runs/cifar10_resnet18_s${SEED}}
cd "$(dirname "$0")/../.."
until finished "$WORKDIR"; do
  start=$(date +%s)
  python3 experiments/pretrain.py --config=experiments/configs/cifar10_resnet18.py \
    --config.data.npz_dir="$DIR" --config.seed="$SEED" --config.stop_after_steps="$STEPS" \
    --workdir="$WORKDIR" "$@"
  echo "piece: $(( $(date +%s) - start )) s"
done
echo "finished: $WORKDIR/results.md"

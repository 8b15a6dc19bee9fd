#!/usr/bin/env bash
# The paper's ResNet-18 run (no batch norm, 25,000 records, batch 1,000, 2 epochs, 3 methods)
# on an accelerator, in resumable pieces: each call of pretrain.py advances every unfinished
# method by STEPS steps (then checkpoints and exits), so no piece runs much longer than
# STEPS steps; re-running this script resumes where the last piece stopped.
#
#   bash experiments/resnet18_gpu.sh DIR [SEED] [STEPS] [EXTRA --config flags...]
#
# DIR holds cifar10.npz. One H100 step of Logit-DP (triangle, n = 1,000) should take well under
# a minute; lower STEPS if a piece nears 10 minutes (steps/s is in <method>/metrics.csv).
#
# On the CPU subset the non-private run diverged at the paper's Adam 1e-2 (docs/RESULTS.md,
# section 5) and learned at 1e-4; if it diverges here too (test loss at ln(batch), embeddings
# all one direction: experiments/embedding_geometry.py), add a non-private reference:
#   WORKDIR=runs/cifar10_resnet18_np_lr1e-4_s0 bash experiments/resnet18_gpu.sh DIR 0 10 \
#     --config.methods="('non_private',)" --config.learning_rates.non_private=1e-4
#
# With the device tool (calls of at most 10 minutes and 64 MiB, a machine warm for 30 s after a
# call, and since 2026-11 only 15 minutes of device time a task, the start included), the data
# travels in two parts (experiments/gpu_stage.sh) and the run must finish inside the second call
# and one short third: its checkpoints (~135 MB a method, and they hold the noise key) cannot come
# back, so a run cut off there is lost.
#   here, once:  bash experiments/gpu_stage.sh prepare SHARED_DATA_DIR   # .gpu_stage/part00, 01
#   call 1, carry [".gpu_stage/part00"]:
#     bash experiments/gpu_stage.sh receive .gpu_stage/part00 /tmp/stage /tmp/cifar
#   call 2 at once, carry [".gpu_stage/part01"], timeout_s 600:
#     bash experiments/gpu_stage.sh receive .gpu_stage/part01 /tmp/stage /tmp/cifar &&
#     export PYTHONPATH=/tmp/stage/site:$PWD PYTHONUNBUFFERED=1 &&
#     (setsid nohup bash experiments/resnet18_gpu.sh /tmp/cifar 0 10 >/tmp/r18.log 2>&1 &) &&
#     sleep 520; tail -3 /tmp/r18.log; bash experiments/resnet18_gpu.sh --collect
#   call 3 at once, if it has not finished:  sleep 150; bash experiments/resnet18_gpu.sh --collect
# --collect copies config.json, results.json and each method's metrics.csv of WORKDIR to $OUT.
set -euo pipefail
if [[ "${1:-}" == "--collect" ]]; then
  W=${WORKDIR:-runs/cifar10_resnet18_s0}
  cd "$(dirname "$0")/.."
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
cd "$(dirname "$0")/.."
finished() {
  python - "$WORKDIR" <<'PY'
import json, os, sys
p = os.path.join(sys.argv[1], "results.json")
ok = os.path.exists(p) and all(r.get("finished") for r in json.load(open(p)).values())
sys.exit(0 if ok else 1)
PY
}
until finished; do
  start=$(date +%s)
  python experiments/pretrain.py --config=experiments/configs/cifar10_resnet18.py \
    --config.data.npz_dir="$DIR" --config.seed="$SEED" --config.stop_after_steps="$STEPS" \
    --workdir="$WORKDIR" "$@"
  echo "piece: $(( $(date +%s) - start )) s"
done
echo "finished: $WORKDIR/results.md"

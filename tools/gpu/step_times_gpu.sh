#!/usr/bin/env bash
# Step times on one GPU, in under 10 minutes: every method side by side in one process per model
# (benchmarks/step_benchmark.py: compiled ahead of time, timed interleaved, ratios to the
# non-private step of the same process).
#
#   embedding  the paper's embedding net (d = 8), n = 10,000, 1,000, 4,096 (10,000 first: the
#              headline): non-private, Naive-DP, triangle, projected, ghost (exact norms)
#   n25000     the same net at n = 25,000: non-private, triangle, projected, ghost; a method
#              whose XLA buffers exceed --memory-limit-gb or whose estimated step exceeds
#              --max-step-s is skipped, not run
#   resnet     ResNet-18 without norm, n = 1,000: non-private, ghost under the default
#              memory_budget (a quarter of the device's memory), projected and triangle in
#              microbatches of 8
#   memory     peak device memory (peak_bytes_in_use) of one step of each method at n = 10,000,
#              each in a fresh process that loads the compiled step from the compilation cache
#   render     the tables of all of them merged: step_times.md, step_times.json
#
# Each stage runs under its own time limit (STAGE_S variables below, in seconds; 565 s in all)
# and writes its JSON after every n, so a stage cut off keeps the sizes it finished and the
# stages after it still run. On an H100 compilation takes most of it (docs/BENCHMARKS.md: ~25 s
# for ghost, ~60 s for ResNet-18's ghost), so the embedding stage's last size (4,096) and
# n = 25,000's projected are the first to go if the limits are short; rerun one stage with the
# others' limits at 0 (e.g. EMBEDDING_S=0 N25000_S=0 MEMORY_S=0; the compilation cache,
# STEP_TIMES_CACHE outside RESULTS, keeps the compiled steps). RESULTS gets
# step_times.{md,json,log} and the four stages' JSON.
#
#   bash tools/gpu/step_times_gpu.sh RESULTS_DIR
#
# Expected (H100, docs/BENCHMARKS.md): ghost at n = 10,000 took 1.5-2.5 s a step, so n = 25,000
# (6.25× the pairs) 10-15 s.
#
# STEP_TIMES_TINY=1 runs every stage at n = 8 and 16 on 16×16 images (the CPU test of the script,
# tests/benchmarks/test_gpu_scripts.py, which also narrows EMBEDDING_METHODS, BIG_METHODS,
# RESNET_METHODS and MEMORY_METHODS to keep the compilations short).
set -u
RES=${1:?usage: step_times_gpu.sh RESULTS_DIR}
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
CACHE=${STEP_TIMES_CACHE:-/tmp/step_times_jax_cache}  # outside RESULTS: many small files
LOG=$RES/step_times.log

if [[ ${STEP_TIMES_TINY:-0} == 1 ]]; then
  SIZES=8,16 BIG=16 RESNET_N=4 MEMORY_N=16 IMAGE=16 MEM_GB=8
  : "${ENV_S:=120}" "${EMBEDDING_S:=600}" "${N25000_S:=600}" "${RESNET_S:=600}" "${MEMORY_S:=600}"
  : "${RENDER_S:=120}"
else
  SIZES=10000,1000,4096 BIG=25000 RESNET_N=1000 MEMORY_N=10000 IMAGE=32 MEM_GB=70
  : "${ENV_S:=30}" "${EMBEDDING_S:=240}" "${N25000_S:=75}" "${RESNET_S:=150}" "${MEMORY_S:=50}"
  : "${RENDER_S:=20}"
fi
BENCH=(python3 -m benchmarks.step_benchmark --compile-cache "$CACHE" --image-size "$IMAGE"
       --memory-limit-gb "$MEM_GB")

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  if ((limit <= 0)); then
    echo "=== $name skipped (limit 0)" | tee -a "$LOG"
    return
  fi
  echo "=== $(date -u +%T) $name (limit ${limit}s)" | tee -a "$LOG"
  timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?  # 124: cut off at its limit
  echo "=== $(date -u +%T) $name rc=$rc" | tee -a "$LOG"
}

stage env "$ENV_S" bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
  --format=csv 2>/dev/null; python3 -c "import jax, jaxlib, flax, optax, numpy, dp_accounting;
print({m.__name__: getattr(m, \"__version__\", None)
       for m in (jax, jaxlib, flax, optax, numpy, dp_accounting)}, jax.devices())"'
stage embedding "$EMBEDDING_S" "${BENCH[@]}" --models embedding --sizes "$SIZES" \
  --methods "${EMBEDDING_METHODS:-nonprivate,naive,triangle,projected,ghost}" --repeats 5 \
  --time-budget-s 8 --max-step-s 30 --memory none --out "$RES/step_times_embedding.json"
stage n25000 "$N25000_S" "${BENCH[@]}" --models embedding --sizes "$BIG" \
  --methods "${BIG_METHODS:-nonprivate,ghost,triangle,projected}" --repeats 3 \
  --time-budget-s 15 --max-step-s 40 --memory none --out "$RES/step_times_embedding_n25000.json"
stage resnet "$RESNET_S" "${BENCH[@]}" --models resnet18 --sizes "$RESNET_N" \
  --methods "${RESNET_METHODS:-nonprivate,ghost,projected@8,triangle@8}" --no-analytic-gate \
  --repeats 3 --time-budget-s 6 --max-step-s 120 --memory none \
  --out "$RES/step_times_resnet18.json"
stage memory "$MEMORY_S" "${BENCH[@]}" --models embedding --sizes "$MEMORY_N" \
  --methods "${MEMORY_METHODS:-ghost,projected,triangle,nonprivate}" --memory-only \
  --child-timeout-s 30 --out "$RES/step_times_memory.json"
parts=()
for f in embedding embedding_n25000 resnet18 memory; do
  [[ -s $RES/step_times_$f.json ]] && parts+=("$RES/step_times_$f.json")
done
if ((${#parts[@]})); then
  stage render "$RENDER_S" bash -c '"$@" >"'"$RES"'/step_times.md"' render "${BENCH[@]}" \
    --render "${parts[@]}" --out "$RES/step_times.json"
fi
echo "=== $(date -u +%T) done" | tee -a "$LOG"

#!/usr/bin/env bash
# The GPU benchmark run: environment, the clipping tests on the device, the step
# benchmark on the embedding net (n up to 10,000 in one logical batch) and ResNet-18, and
# fresh-process peak device memory.  Each stage has its own time limit and writes into
# RESULTS as it goes, so a stage that runs out of time loses only itself.
#
#   bash tools/gpu/device_run.sh RESULTS_DIR
set -u
RES=${1:?usage: device_run.sh RESULTS_DIR}
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
BENCH="python3 -m benchmarks.step_benchmark --compile-cache $RES/.jax_cache"

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== $(date -u +%T) $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$RES/$name.log" 2>&1
  local rc=$?
  echo "=== $(date -u +%T) $name rc=$rc"
}

stage env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv;
  python3 -c "import jax, jaxlib, flax, optax, chex, dp_accounting, numpy;
print({m.__name__: getattr(m, \"__version__\", None) for m in (jax, jaxlib, flax, optax, chex, dp_accounting, numpy)}, jax.devices())"'
stage precision "${PRECISION_S:-60}" python3 -m benchmarks.precision_check --out "$RES/precision.json"
stage tests "${TESTS_S:-200}" python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -n 4 \
  tests/test_clipping.py tests/test_layerwise.py tests/test_noise.py
stage embedding "${EMBEDDING_S:-600}" $BENCH --models embedding --sizes ${EMBEDDING_SIZES:-64,256,1000,4096,10000} \
  --methods nonprivate,naive,ghost,triangle,materialize --repeats 7 --materialize-repeats 2 \
  --time-budget-s 20 --max-step-s 30 --memory none --memory-limit-gb 70 \
  --out "$RES/gpu_embedding.json" --markdown "$RES/gpu_embedding.md"
stage memory "${MEMORY_S:-300}" $BENCH --models embedding --sizes 1000,10000 \
  --methods nonprivate,ghost,triangle --memory-only --memory-limit-gb 70 \
  --out "$RES/gpu_embedding_memory.json"
stage resnet "${RESNET_S:-480}" $BENCH --models resnet18 --sizes 64,256 \
  --methods ${RESNET_METHODS:-nonprivate,naive,ghost@8,triangle@8} --repeats 3 --time-budget-s 30 \
  --max-step-s 120 --memory none --memory-limit-gb 70 \
  --out "$RES/gpu_resnet.json" --markdown "$RES/gpu_resnet.md"
echo "=== $(date -u +%T) done"

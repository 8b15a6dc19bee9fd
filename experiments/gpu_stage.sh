#!/usr/bin/env bash
# Takes the offline CIFAR copies and the wheels the GPU image lacks to a lent GPU machine, whose
# calls carry at most 64 MiB each (working tree included): here the data is cut into parts of
# at most CHUNK bytes, one part per call; there each call adds its part to a staging folder, and
# the call with the last part checks the SHA-256, unpacks the data and installs the wheels.
#
#   here:  bash experiments/gpu_stage.sh prepare SHARED_DATA_DIR [DATASETS]
#            DATASETS: cifar10 (default) or cifar10,cifar100. Writes .gpu_stage/part00, part01, …
#            (git-excluded; GPU_STAGE_OUT=DIR writes there instead) and downloads the
#            dp-accounting, ml-collections and tensorboardX wheels for the image's Python 3.12
#            (GPU_STAGE_WHEELS=0 skips them).
#   there: bash experiments/gpu_stage.sh receive .gpu_stage/partKK STAGE_DIR NPZ_DIR
#            one device call per part, carrying .gpu_stage/partKK, back to back (a machine stays
#            warm 30 s after a call). Prints "staged: NPZ_DIR" once every part is in, and puts
#            the wheels in STAGE_DIR/site: export PYTHONPATH=STAGE_DIR/site:$PWD.
#   then, e.g.: experiments/resnet18_gpu.sh's call sequence, or the exact-ghost seed (queue entry
#     cifar10_embnet_ghost_s0; started with setsid so that it runs on between calls):
#     python experiments/pretrain.py --config=experiments/configs/cifar10_embedding_net.py \
#       --config.seed=0 --config.methods="('logit_dp',)" --config.checkpoint_every=1 \
#       --config.data.npz_dir=NPZ_DIR --workdir=runs/cifar10_embnet_ghost_s0
set -euo pipefail
CHUNK=${GPU_STAGE_CHUNK:-55000000}
cd "$(dirname "$0")/.."

prepare() {
  local src=${1:?usage: gpu_stage.sh prepare SHARED_DATA_DIR [DATASETS]} datasets=${2:-cifar10}
  local out=${GPU_STAGE_OUT:-.gpu_stage} work exclude
  if [[ $out == .gpu_stage ]]; then
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF "/$out/" "$exclude" 2>/dev/null || echo "/$out/" >>"$exclude"
  fi
  rm -rf "$out" && mkdir -p "$out"
  work=$(mktemp -d)
  local files=(unpack.py)
  for d in ${datasets//,/ }; do
    files+=("${d}_train.webp.npz" "${d}_test.webp.npz" "${d}_label_names.json")
  done
  for f in "${files[@]}"; do cp "$src/$f" "$work/"; done
  if [[ ${GPU_STAGE_WHEELS:-1} != 0 ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux2014_x86_64 -d "$work/wheels" \
      "dp-accounting==$(pip_version dp-accounting)" "ml-collections==$(pip_version ml-collections)" \
      "tensorboardX==$(pip_version tensorboardX)"
  fi
  tar -C "$work" -cf "$work/stage.tar" --exclude=stage.tar .
  (cd "$work" && split -b "$CHUNK" -d -a 2 stage.tar chunk. && sha256sum stage.tar >SHA256SUM)
  local chunks=("$work"/chunk.*) c part
  for c in "${chunks[@]}"; do
    part="$out/part${c##*.}"
    mkdir -p "$part" && mv "$c" "$part/" && cp "$work/SHA256SUM" "$part/"
    echo "${#chunks[@]}" >"$part/PARTS"
  done
  rm -rf "$work"
  du -sh "$out"/part*
}

pip_version() { python3 -m pip show "$1" | awk '/^Version:/{print $2}'; }

receive() {
  local part=${1:?usage: gpu_stage.sh receive PART_DIR STAGE_DIR NPZ_DIR} stage=${2:?} npz=${3:?}
  mkdir -p "$stage"
  cp "$part"/* "$stage/"
  local want have
  want=$(cat "$stage/PARTS")
  have=$(find "$stage" -maxdepth 1 -name 'chunk.*' | wc -l)
  if ((have < want)); then
    echo "received $(basename "$part"): $have of $want parts"
    return 0
  fi
  (cd "$stage" && cat chunk.* >stage.tar && sha256sum -c SHA256SUM && rm chunk.*)
  mkdir -p "$stage/files" && tar -C "$stage/files" -xf "$stage/stage.tar" && rm "$stage/stage.tar"
  local d
  for d in cifar10 cifar100; do
    if [[ -f "$stage/files/${d}_train.webp.npz" ]]; then
      python3 "$stage/files/unpack.py" --out "$npz" --only "$d"
    fi
  done
  if compgen -G "$stage/files/wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$stage/site" \
      "$stage"/files/wheels/*.whl
  fi
  echo "staged: $npz"
}

case "${1:-}" in
  prepare) shift && prepare "$@" ;;
  receive) shift && receive "$@" ;;
  *) echo "usage: gpu_stage.sh prepare SHARED_DATA_DIR [DATASETS] | receive PART STAGE NPZ" >&2
     exit 2 ;;
esac

#!/usr/bin/env bash
# Takes the CIFAR data, and the wheels the GPU image lacks, to an accelerator host whose calls
# carry at most 64 MiB each (working tree included): here the data is cut into parts of at most
# CHUNK bytes, one part per call; there each call adds its part to a staging folder, and the call
# with the last part checks the SHA-256 of the whole, unpacks the data and installs the wheels.
# CHUNK (GPU_STAGE_CHUNK, default 58,000,000 bytes) leaves the tracked working tree (~5.6 MB) and
# a carried run state room under 64 MiB = 67,108,864 bytes: CIFAR-10's archive (170,498,071
# bytes) and the wheels (~0.3 MB) travel in three parts (tests/test_tools.py checks the sum).
#
#   here:  bash tools/gpu/gpu_stage.sh prepare DATA_DIR [DATASETS]
#            DATASETS: cifar10 (default) or cifar10,cifar100. DATA_DIR holds, for each data set,
#            its official archive (cifar-10-python.tar.gz, cifar-100-python.tar.gz) or its
#            Keras-style npz (cifar10.npz, cifar100.npz: `python -m experiments.cifar --out
#            DATA_DIR`); an archive travels smaller. Writes .gpu_stage/part00, part01, …
#            (git-excluded; GPU_STAGE_OUT=DIR writes there instead) and downloads the
#            dp-accounting, ml-collections and tensorboardX wheels for the image's Python 3.12
#            (GPU_STAGE_WHEELS=0 skips them).
#   there: bash tools/gpu/gpu_stage.sh receive .gpu_stage/partKK STAGE_DIR NPZ_DIR
#            one call per part, carrying .gpu_stage/partKK, back to back. Prints "staged: NPZ_DIR"
#            once every part is in (an archive is verified against its published checksums and
#            unpacked by experiments.cifar), and puts the wheels in STAGE_DIR/site:
#            export PYTHONPATH=STAGE_DIR/site:$PWD.
#   then, e.g., tools/gpu/resnet18_gpu.sh's call sequence.
set -euo pipefail
CHUNK=${GPU_STAGE_CHUNK:-58000000}
cd "$(dirname "$0")/../.."

prepare() {
  local src=${1:?usage: gpu_stage.sh prepare DATA_DIR [DATASETS]} datasets=${2:-cifar10}
  local out=${GPU_STAGE_OUT:-.gpu_stage} work exclude
  if [[ $out == .gpu_stage ]]; then
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF "/$out/" "$exclude" 2>/dev/null || echo "/$out/" >>"$exclude"
  fi
  rm -rf "$out" && mkdir -p "$out"
  work=$(mktemp -d)
  local d archive
  for d in ${datasets//,/ }; do
    archive=$(archive_name "$d")
    if [[ -f $src/$archive ]]; then
      cp "$src/$archive" "$work/"
    elif [[ -f $src/$d.npz ]]; then
      cp "$src/$d.npz" "$work/"
      if [[ -f $src/${d}_label_names.json ]]; then cp "$src/${d}_label_names.json" "$work/"; fi
    else
      echo "$src holds neither $archive nor $d.npz (python -m experiments.cifar --out $src)" >&2
      rm -rf "$work"
      return 1
    fi
  done
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

archive_name() { echo "${1/cifar/cifar-}-python.tar.gz"; }  # cifar10 -> cifar-10-python.tar.gz

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
  mkdir -p "$npz"
  for d in cifar10 cifar100; do
    if [[ -f "$stage/files/$(archive_name "$d")" ]]; then
      python3 -m experiments.cifar --out "$npz" --datasets "$d" --archive_dir "$stage/files"
    elif [[ -f "$stage/files/$d.npz" ]]; then
      cp "$stage/files/$d.npz" "$npz/"
      if [[ -f $stage/files/${d}_label_names.json ]]; then
        cp "$stage/files/${d}_label_names.json" "$npz/"
      fi
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
  *) echo "usage: gpu_stage.sh prepare DATA_DIR [DATASETS] | receive PART STAGE NPZ" >&2
     exit 2 ;;
esac

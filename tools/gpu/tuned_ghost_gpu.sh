#!/usr/bin/env bash
# Logit-DP with exact pair norms (clip_method="ghost") at the tuned CIFAR-10 setting
# (experiments/configs/cifar10_embedding_net_tuned.py: ε = 5, d = 32, τ = 2, B = 3, expected
# batch 10,000, T = 50), seeds 0, 1, 2: the runs of tools/gpu/tuned_ghost_runs.txt, driven by
# tools.run_queue, on an accelerator host reached by calls of at most 10 minutes.
#
#   there: bash tools/gpu/tuned_ghost_gpu.sh NPZ_DIR [SECONDS]
#            trains the unfinished seeds in order for at most SECONDS (default 480), every step
#            checkpointed, then packs every seed's workdir into $OUT (--collect). A state carried
#            in .gpu_state/tuned_ghost.tar.gz is unpacked first (seeds absent from runs/ only),
#            so a seed cut off in one allotment resumes in the next.
#   there: bash tools/gpu/tuned_ghost_gpu.sh --collect
#            writes $OUT/tuned_ghost_state.tar.gz (each seed's runs/<name>: config, results,
#            wallclock, metrics.csv, log, checkpoints; no tensorboard events) and
#            $OUT/tuned_ghost_progress.txt. Refuses a workdir with secret seeds beside it.
#   here:  bash tools/gpu/tuned_ghost_gpu.sh --file FILES_DIR
#            unpacks FILES_DIR/tuned_ghost_state.tar.gz into runs/, copies each finished seed's
#            config.json, results.json and wallclock.json to docs/results/<name>/ and keeps the
#            state in .gpu_state/ (git-excluded) for the next allotment to carry. Then
#            `python -m experiments.render_results` renders, once docs/RESULTS.md holds them,
#              <!-- generated:group:cifar10_embnet_tuned_ghost -->
#              <!-- generated:bound:cifar10_embnet_tuned_ghost:cifar10_embnet_tuned -->
#              <!-- generated:versus:cifar10_embnet_tuned_ghost:cifar10_embnet_tuned -->
#            (each closed by its <!-- /generated:… --> line): ghost against projected Logit-DP
#            seed by seed, and against DP-GCL, Naive-DP and non-private of the same seeds.
#
# Device time (an estimate; the first call's tuned_ghost_progress.txt gives the measured steps/s).
# The committed tuned runs (docs/results/cifar10_embnet_tuned_s*/wallclock.json, 2 CPU cores)
# took 1,905-2,049 s each, Logit-DP (projected) 1,091-1,230 s of it: 22-25 s a step. On one H100
# a ghost step of the paper's net (d = 8) at n = 10,000 took 1.5-2.5 s (docs/BENCHMARKS.md);
# from d = 8 to d = 32 ghost's step grew 8.4× on the CPU at n = 1,000 (12.1 s to 102 s:
# `python -m benchmarks.step_benchmark --models embedding --sizes 1000 --methods
# nonprivate,ghost,projected --embedding-dim D --repeats 3 --memory none`), and its pair terms
# grow as d², up to 16×. So 13-40 s a step on an H100: 11-33 minutes of training per seed, plus
# about a minute per call to load the data, compile and evaluate. The three seeds need 35-100
# device minutes, several 15-minute budgets; one budget trains about 9 minutes (the rest goes to
# starting the machine and carrying the data), and the public privacy seeds let a seed's
# checkpoints travel from one budget to the next.
#
# One 15-minute budget (tools/README.md has the whole sequence): here, once,
#   bash tools/gpu/gpu_stage.sh prepare DATA_DIR       # .gpu_stage/part00 … part02
# then three calls, back to back (the machine stays warm between them):
#   carry [".gpu_stage/part00"], timeout_s 120:
#     bash tools/gpu/gpu_stage.sh receive .gpu_stage/part00 /tmp/stage /tmp/cifar
#   carry [".gpu_stage/part01"], timeout_s 120: the same with part01
#   carry [".gpu_stage/part02", ".gpu_state"], timeout_s 600:
#     bash tools/gpu/gpu_stage.sh receive .gpu_stage/part02 /tmp/stage /tmp/cifar &&
#     PYTHONPATH=/tmp/stage/site:$PWD bash tools/gpu/tuned_ghost_gpu.sh /tmp/cifar 480
#   give_back; here: bash tools/gpu/tuned_ghost_gpu.sh --file FILES_AT
#
# Settings: TUNED_GHOST_QUEUE (the list), TUNED_GHOST_SEEDS ("0 1 2"), TUNED_GHOST_RUNS (runs),
# TUNED_GHOST_RESULTS (docs/results), TUNED_GHOST_STATE (.gpu_state/tuned_ghost.tar.gz).
# TUNED_GHOST_TINY=1 runs the same entries on experiments/configs/tiny.py (digits, an MLP, each
# image paired with its augmentation; NPZ_DIR is then ignored): the CPU test of this script in
# tests/test_tools.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
QUEUE=${TUNED_GHOST_QUEUE:-tools/gpu/tuned_ghost_runs.txt}
SEEDS=${TUNED_GHOST_SEEDS:-0 1 2}
RUNS=${TUNED_GHOST_RUNS:-runs}
RESULTS=${TUNED_GHOST_RESULTS:-docs/results}
STATE=${TUNED_GHOST_STATE:-.gpu_state/tuned_ghost.tar.gz}
export PYTHONUNBUFFERED=1

queue_names() {  # the queue's run names of the chosen seeds
  python3 - "$QUEUE" "$SEEDS" <<'PY'
import sys
from tools import run_queue
seeds = {f"_s{s}" for s in sys.argv[2].split()}
print(" ".join(n for n, _, _ in run_queue.read_queue(sys.argv[1])
               if any(n.endswith(s) for s in seeds)))
PY
}

progress() {  # one line per run: steps done of T, steps/s, finished
  python3 - "$RUNS" "$@" <<'PY'
import csv, json, os, sys
runs = sys.argv[1]
for name in sys.argv[2:]:
  w = os.path.join(runs, name)
  rows = []
  if os.path.exists(os.path.join(w, "logit_dp", "metrics.csv")):
    with open(os.path.join(w, "logit_dp", "metrics.csv")) as f:
      rows = list(csv.DictReader(f))
  done = rows[-1]["step"] if rows else "0"
  rates = [float(r["steps_per_sec"]) for r in rows if r["steps_per_sec"] not in ("", "nan")]
  rate = f"{sum(rates) / len(rates):.4f} steps/s" if rates else "no steps yet"
  res = os.path.join(w, "results.json")
  fin = os.path.exists(res) and all(r.get("finished") for r in json.load(open(res)).values())
  print(f"{name}: step {done}, {rate}, {'finished' if fin else 'not finished'}")
PY
}

collect() {
  local out=${OUT:?--collect writes to \$OUT} names=() n
  for n in $(queue_names); do
    [[ -d $RUNS/$n ]] || continue
    if [[ -e $RUNS/$n.secrets ]]; then
      echo "$RUNS/$n.secrets exists: that run has secret seeds and its checkpoints stay here" >&2
      return 1
    fi
    names+=("$n")
  done
  if ((${#names[@]} == 0)); then
    echo "no workdir of $QUEUE under $RUNS" >&2
    return 1
  fi
  tar -C "$RUNS" --exclude=tensorboard -czf "$out/tuned_ghost_state.tar.gz" "${names[@]}"
  progress "${names[@]}" | tee "$out/tuned_ghost_progress.txt"
}

file_results() {
  local files=${1:?usage: tuned_ghost_gpu.sh --file FILES_DIR} n exclude
  local names=($(tar -tzf "$files/tuned_ghost_state.tar.gz" | cut -d/ -f1 | sort -u))
  mkdir -p "$RUNS"
  for n in "${names[@]}"; do rm -rf "${RUNS:?}/$n"; done
  tar -C "$RUNS" -xzf "$files/tuned_ghost_state.tar.gz"
  for n in "${names[@]}"; do
    python3 -c "import sys; from experiments import workdirs
w, dest = sys.argv[1:]
if workdirs.is_finished(w):
  workdirs.publish(w, dest)
  print('published', dest)" "$RUNS/$n" "$RESULTS/$n"
  done
  if [[ $STATE == .gpu_state/* ]]; then
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF "/.gpu_state/" "$exclude" 2>/dev/null || echo "/.gpu_state/" >>"$exclude"
  fi
  mkdir -p "$(dirname "$STATE")"
  cp "$files/tuned_ghost_state.tar.gz" "$STATE"
  progress "${names[@]}"
}

case "${1:-}" in
  --collect) collect; exit ;;
  --file) shift; file_results "$@"; exit ;;
  "" | -*) echo "usage: tuned_ghost_gpu.sh NPZ_DIR [SECONDS] | --collect | --file FILES_DIR" >&2
           exit 2 ;;
esac
NPZ=$1
SECONDS_LEFT=${2:-480}
mkdir -p "$RUNS"
if [[ ${TUNED_GHOST_TINY:-0} == 1 ]]; then
  tiny=$(mktemp)
  # Every seed pairs each image with its augmentation: the same number of records, hence the
  # same σ, q and T, as every seed of the real runs has (all 25,000 same-class records).
  sed -e 's#experiments/configs/cifar10_embedding_net_tuned.py#experiments/configs/tiny.py#' \
    -e '/^[^#]/s/$/ --config.pair_mode=augment/' "$QUEUE" >"$tiny"
  QUEUE=$tiny
fi
if [[ -f $STATE ]]; then  # a state carried from an earlier allotment: only runs not here
  unpack=$(mktemp -d)
  tar -C "$unpack" -xzf "$STATE"
  for n in "$unpack"/*; do
    [[ -e $RUNS/$(basename "$n") ]] || mv "$n" "$RUNS/"
  done
  rm -rf "$unpack"
fi
only=$(mktemp)
names=$(queue_names)
if [[ -z $names ]]; then
  echo "no run of seeds $SEEDS in $QUEUE" >&2
  exit 2
fi
grep -E "^($(echo "$names" | tr ' ' '|'))[[:space:]]" "$QUEUE" >"$only"
npz_flag=()
[[ ${TUNED_GHOST_TINY:-0} == 1 ]] || npz_flag=("--npz_dir=$NPZ")
rc=0
timeout -k 10 "$SECONDS_LEFT" python3 -m tools.run_queue --queue="$only" --runs_dir="$RUNS" \
  --results_dir="$RESULTS" "${npz_flag[@]}" || rc=$?
echo "run_queue rc=$rc (124: stopped after $SECONDS_LEFT s; the checkpoints resume it)"
if ((rc != 0 && rc != 124)); then
  for n in $names; do [[ -f $RUNS/$n/log.txt ]] && tail -20 "$RUNS/$n/log.txt"; done
fi
if [[ -n ${OUT:-} ]]; then collect; else progress $names; fi

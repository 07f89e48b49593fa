#!/usr/bin/env bash
# The wide-panel benchmark on the device machine (issue 9): every panel model at its bench batches,
# convpass against ONNX Runtime's four configurations and PyTorch's two, every output checked
# against ONNX Runtime CPU. Expects onnxruntime-gpu unpacked in /tmp/ortgpu (shared/device/README.md,
# stage-ort-gpu.sh); uses nvidia-cudnn-frontend when staged in .cudnnfe/ (graph-api-check.sh says how).
#
# In phases, each within one device call; the machine keeps .panel and .bench-panel/ between
# back-to-back calls:
#   bash scripts/bench-panel.sh setup              install, export the panel (or $MODELS), queue its models
#   bash scripts/bench-panel.sh tune               convpass tune of the queued models at 1,32 on every GPU
#                                                  (--cluster local), so that the benches time no conv;
#                                                  stopped after TUNE_SECONDS (default 420)
#   bash scripts/bench-panel.sh run [SECONDS] [bench options]
#       one worker per GPU takes the next queued model and benches it (its batches in one process,
#       the machine's cores split between the workers with taskset, one tuning-cache copy each) until
#       SECONDS (default 540) have passed; a model cut off by that limit goes back to the head of the
#       queue for the next call, and one that fails is kept with its log; GPUS=0,1 names the GPUs
#       the workers use (default: every GPU)
#   bash scripts/bench-panel.sh report             merge every benched model: $OUT/bench.{txt,json,png}
# Per-model reports and JSON stay in .bench-panel/; after every phase all of it goes to $OUT as one
# file, bench-panel.tar (with the tuning cache and the workers' copies, zstd-compressed: carry the
# first back as .tunecache/<tag>/tune.db.zst for the next session).
# Device time: a machine goes back after about 30 s idle, so issue the calls back to back; the
# whole panel at 1,32 took more than 430 s of tuning on 2 H200s from a cache that lacked batch 1's
# newer rows (2026-11-23), so carry a complete cache or budget for it.
#
# One part in one process, as the earlier runs were made (README):
#   bash scripts/bench-panel.sh TAG MODEL[,MODEL...] [more convpass bench options]
# writes $OUT/bench-TAG.json and .txt; merge parts with
#   convpass bench --from-json bench-*.json --json-file bench.json --plot bench.png
#
# The tuning cache is $CONVPASS_TUNE_CACHE (default /tmp/tune.db); it is seeded from .tunecache/tune.db
# when that exists (decisions are kept per device fingerprint, so only the same GPU type reuses them).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}; mkdir -p "$out"
work=.bench-panel
cache=${CONVPASS_TUNE_CACHE:-/tmp/tune.db}
# shellcheck source=device-env.sh
. scripts/device-env.sh
device_env || exit 1
[ -f "$cache" ] || [ ! -f .tunecache/tune.db ] || cp .tunecache/tune.db "$cache"
bench_defaults=(--runs 15 --warmup 3 --tf32 on --profile-ops --no-roofline)
# KERNELS=1: compile each tuned model's kernels ahead of time, which runs the in-place check too
[ "${KERNELS:-0}" = 1 ] || bench_defaults+=(--no-kernels)
# the largest cases first, so that the small ones fill the end of a call
heavy_first="r2plus1d_18 conv_tasnet_base r3d_18 unet espcn efficientnet_v2_s fcn_resnet50 densenet121 inception_v3 mobilevit_s convnext_tiny"

export_panel() {
  [ -f .panel/panel.json ] || python3 models/export_panel.py --out .panel ${MODELS:+--models "$MODELS"} >"$out/export.log" 2>&1 \
    || { tail -5 "$out/export.log"; return 1; }
}

# the next queued model (and remove it), under a lock: the workers share the queue
pop() {
  flock "$work/queue.lock" bash -c 'm=$(head -n 1 "$1"); [ -n "$m" ] || exit 1; sed -i 1d "$1"; echo "$m"' _ "$work/queue"
}
push_front() {
  flock "$work/queue.lock" bash -c '{ echo "$2"; cat "$1"; } >"$1.new" && mv "$1.new" "$1"' _ "$work/queue" "$1"
}

worker() {  # GPU, CPU list, deadline (in $SECONDS), bench options...
  local gpu=$1 cpus=$2 deadline=$3; shift 3
  local wcache="$cache.gpu$gpu" m left rc pin=()
  [ -f "$wcache" ] || cp "$cache" "$wcache" 2>/dev/null || true
  command -v taskset >/dev/null && pin=(taskset -c "$cpus")
  while left=$((deadline - SECONDS)); [ "$left" -gt 60 ] && m=$(pop); do
    echo "[gpu $gpu] $m (${left} s left)"
    local started=$SECONDS
    CUDA_VISIBLE_DEVICES=$gpu timeout --signal=INT --kill-after=20 $((left - 25)) "${pin[@]}" \
      python3 -m convpass.cli.main bench ".panel/$m.onnx" "${bench_defaults[@]}" --cache "$wcache" \
        --json-file "$work/bench-$m.json.part" "$@" >"$work/bench-$m.txt" 2>&1
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] || [ ! -s "$work/bench-$m.json.part" ]; then
      if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "[gpu $gpu] $m cut off after $((SECONDS - started)) s: back to the queue"; push_front "$m"
      else
        echo "[gpu $gpu] $m FAILED (exit $rc, no JSON): $work/bench-$m.txt"; echo "$m" >>"$work/failed"
      fi
      rm -f "$work/bench-$m.json.part"
    else
      mv "$work/bench-$m.json.part" "$work/bench-$m.json"
      echo "[gpu $gpu] $m done in $((SECONDS - started)) s (exit $rc)"
      grep -E "^  convpass |CUDA graph:" "$work/bench-$m.txt" | sed "s/^/[gpu $gpu]   /"
    fi
  done
}

phase() {
  case "$1" in
    setup)
      mkdir -p "$work"
      nvidia-smi -L | tee "$out/gpus.txt"
      python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())" 2>&1 | tee "$out/ort.txt"
      grep -q CUDAExecutionProvider "$out/ort.txt" || echo "onnxruntime-gpu is not staged in /tmp/ortgpu: the bench will have no ONNX Runtime GPU peer" | tee -a "$out/ort.txt"
      python3 -c "from convpass.native.cudnn import graph_api; print('graph API:', graph_api.unavailable() or 'available')"
      export_panel || return 1
      if [ ! -f "$work/queue" ]; then
        local all
        all=$(python3 -c "import json; print(' '.join(dict.fromkeys(e['name'] for e in json.load(open('.panel/panel.json'))['models'])))")
        { for m in $heavy_first; do [[ " $all " == *" $m "* ]] && echo "$m"; done
          for m in $all; do [[ " $heavy_first " == *" $m "* ]] || echo "$m"; done; } >"$work/queue"
      fi
      echo "queued: $(tr '\n' ' ' <"$work/queue")" ;;
    tune)
      local models=() m
      while read -r m; do models+=(".panel/$m.onnx"); done <"$work/queue"
      mkdir -p "$work/tuned"
      # interrupted (SIGINT) after TUNE_SECONDS, tune keeps what it measured in the cache
      timeout --signal=INT --kill-after=30 "${TUNE_SECONDS:-420}" \
        python3 -m convpass.cli.main tune "${models[@]}" --batch 1,32 --tf32 on --cluster local --cache "$cache" \
          -o "$work/tuned" --json >"$work/tune.json" 2>"$work/tune.log"
      local rc=$?
      [ "$rc" -eq 124 ] && echo "tune: stopped after ${TUNE_SECONDS:-420} s; the benches measure what is missing"
      tail -c 600 "$work/tune.log"; return "$rc" ;;
    run)
      shift
      local seconds=540
      [[ "${1:-}" =~ ^[0-9]+$ ]] && { seconds=$1; shift; }
      local gpus cores n i k=0 per
      # $GPUS (a comma list) keeps some GPUs for other work; default: every GPU
      if [ -n "${GPUS:-}" ]; then IFS=, read -r -a gpus <<<"$GPUS"; else mapfile -t gpus < <(seq 0 $(($(nvidia-smi -L | wc -l) - 1))); fi
      cores=$(nproc); per=$((cores / ${#gpus[@]}))
      local deadline=$((SECONDS + seconds))
      for i in "${gpus[@]}"; do
        worker "$i" "$((k * per))-$((k * per + per - 1))" "$deadline" "$@" &
        k=$((k + 1))
      done
      wait
      n=$(wc -l <"$work/queue")
      echo "still queued: $n model(s) $(tr '\n' ' ' <"$work/queue")" ;;
    report)
      local plot=()  # bench --plot without matplotlib is an error: ask for the chart only where it can be drawn
      python3 -c "import matplotlib" 2>/dev/null && plot=(--plot "$out/bench.png")
      python3 -m convpass.cli.main bench --from-json "$work"/bench-*.json --json-file "$out/bench.json" "${plot[@]}" \
        >"$out/bench.txt" 2>&1
      local rc=$?
      sed -n '/^Summary over/,/^$/p' "$out/bench.txt"
      [ -s "$work/failed" ] && echo "failed: $(tr '\n' ' ' <"$work/failed")"
      return "$rc" ;;
    *) sed -n 2,26p "$0"; return 2 ;;
  esac
}

# Everything in .bench-panel/ as one file, $OUT/bench-panel.tar (the device tool brings back only a
# few files per call), with the tuning cache and the workers' copies compressed when a zstd is at hand.
pack() {
  local z
  z=$(command -v zstd || ls .ortgpu/tool/zstd .cudnnfe/tool/zstd 2>/dev/null | head -n 1)
  if [ -n "$z" ]; then
    for f in "$cache" "$cache".gpu*; do [ -f "$f" ] && "$z" -q -f "$f" -o "$work/$(basename "$f").zst"; done
  fi
  tar cf "$out/bench-panel.tar" -C "$work" --exclude=tuned --exclude=queue.lock . 2>/dev/null
}

case "${1:-}" in
  setup|tune|report)
    phase "$1"; rc=$?; pack; exit "$rc" ;;
  run)
    shift; phase run "$@"; rc=$?; pack; exit "$rc" ;;
  ""|-h|--help) phase help ;;
esac

tag=$1; models=${2:?models}; shift 2
export_panel || exit 1
paths=()
for m in ${models//,/ }; do paths+=(".panel/$m.onnx"); done
python3 -m convpass.cli.main bench "${paths[@]}" --runs 20 --warmup 5 --tf32 on --profile-ops \
    --cache "$cache" --json-file "$out/bench-$tag.json" "$@" 2>&1 | tee "$out/bench-$tag.txt"

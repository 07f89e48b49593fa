#!/usr/bin/env bash
# The GPU tests on every GPU of the device machine, resumable across calls: one call may run 10
# minutes, and the GPU suite with the exported panel models (fp32 and fp16) takes longer.
#   bash scripts/gpu-tests.sh [SECONDS] [pytest arguments]     (default: 540 s, tests/)
# One pytest per GPU, each taking every n-th collected test (scripts/gpu_tests_progress.py); every
# finished test is written to .gpu-tests/done as it ends, so the next call (back to back: the
# machine keeps .gpu-tests/ and .panel/ between calls) runs only what is left. The workers are
# interrupted SECONDS after the start; a test cut off runs again next call. Prints the totals, the
# failures (their reports in .gpu-tests/done.failures) and how many are left; $OUT/gpu-tests.tar
# has the logs. PANEL_MODELS=all (or a list) exports the panel first, fp32 and fp16, so that the
# tests check those models too. CONVPASS_TUNE_CACHE (a tuning cache to start from, e.g. a carried
# one): with PANEL_MODELS, the exported models are first tuned into it on every GPU (convpass tune
# --cluster local, batch 1, the tests' PANEL_OPTIONS; over several calls if need be, and the
# cache comes back as $OUT/tune.db.zst), then it is copied once per GPU into .gpu-tests/, so no two
# workers write one SQLite file. Start again from nothing: rm -rf .gpu-tests
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-tests-out}; mkdir -p "$out"
# shellcheck source=device-env.sh
. scripts/device-env.sh
device_env || exit 1
seconds=540
[[ "${1:-}" =~ ^[0-9]+$ ]] && { seconds=$1; shift; }
[ "$#" -gt 0 ] || set -- tests
work=.gpu-tests; mkdir -p "$work"
if [ -n "${PANEL_MODELS:-}" ] && [ ! -f .panel/panel.json ]; then
  [ "$PANEL_MODELS" = all ] && sel=() || sel=(--models "$PANEL_MODELS")
  { python3 models/export_panel.py --out .panel "${sel[@]}" && python3 models/export_panel.py --out .panel "${sel[@]}" --fp16; } \
      >"$out/export.log" 2>&1 || { tail -5 "$out/export.log"; exit 1; }
fi
gpus=$(nvidia-smi -L | wc -l)
if [ -n "${PANEL_MODELS:-}" ] && [ -n "${CONVPASS_TUNE_CACHE:-}" ] && [ ! -f "$work/tuned" ]; then
  # The panel tests optimize every exported model at batch 1 with PANEL_OPTIONS
  # (tests/gpu/test_executor_cuda.py): float32 with TF32 on, float16 with the legacy candidates.
  # Tuned one by one inside the tests that took 20-50 s per model (2026-11-23: 17 tests in 450 s on
  # 2 H200s); tuned here first, on every GPU, the problems are measured once. A cut-off tune keeps
  # what it measured (the driver writes the cache) and resumes next call.
  fp32=() fp16=()
  for f in .panel/*.onnx; do if [[ $f == *_fp16.onnx ]]; then fp16+=("$f"); else fp32+=("$f"); fi; done
  tune_panel() {
    local budget=$((seconds - SECONDS - 60))
    [ "$budget" -gt 60 ] || { echo "no time left to tune the panel ($SECONDS s)" >>"$work/tune.log"; return 1; }
    timeout --signal=INT --kill-after=30 "$budget" python3 -m convpass.cli.main tune "$@" --batch 1 --cluster local \
        --cache "$CONVPASS_TUNE_CACHE" -o "$work/panel-tuned" --json >>"$work/tune.json" 2>>"$work/tune.log"
  }
  mkdir -p "$work/panel-tuned"
  tune_panel "${fp32[@]}" --tf32 on && tune_panel "${fp16[@]}" --engines legacy && touch "$work/tuned"
  z=$(command -v zstd || ls .cudnnfe/tool/zstd .ortgpu/tool/zstd 2>/dev/null | head -n 1)
  [ -n "$z" ] && [ -f "$CONVPASS_TUNE_CACHE" ] && "$z" -q -f -19 "$CONVPASS_TUNE_CACHE" -o "$out/tune.db.zst"  # carry it next time
  [ -f "$work/tuned" ] || { echo "panel tuning not finished in this call ($(tail -n 1 "$work/tune.log")); run again"; exit 0; }
  echo "panel tuned in this call: $(tail -n 1 "$work/tune.log")"
fi
left=$((seconds - SECONDS - 30))  # install, export and tuning included; 30 s for the summary and the tar
[ "$left" -gt 30 ] || { echo "no time left for tests after set-up ($SECONDS s)"; exit 1; }
export PYTHONPATH=scripts${PYTHONPATH:+:$PYTHONPATH} GPU_TESTS_LOG=$work/done
for ((g = 0; g < gpus; g++)); do
  cache=${CONVPASS_TUNE_CACHE:-}
  if [ -n "$cache" ]; then
    [ -f "$work/tune.gpu$g.db" ] || { [ -f "$cache" ] && cp "$cache" "$work/tune.gpu$g.db"; }
    cache=$work/tune.gpu$g.db
  fi
  CONVPASS_TUNE_CACHE=$cache CUDA_VISIBLE_DEVICES=$g GPU_TESTS_SHARD=$g/$gpus timeout --signal=INT --kill-after=20 "$left" \
    python3 -m pytest -m gpu -q -p no:cacheprovider -p gpu_tests_progress "$@" >>"$work/gpu$g.log" 2>&1 &
done
wait
python3 scripts/gpu_tests_progress.py summary "$work/done" | tee "$out/gpu-tests-summary.txt"
tar cf "$out/gpu-tests.tar" -C "$work" --exclude='tune.gpu*.db' .

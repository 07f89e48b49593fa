#!/usr/bin/env bash
# Issue 10's start-up figures of convpass (and ONNX Runtime's, where it is staged) on one GPU.
# Device time on an H200: tuning the three default models about 5 minutes (efficientnet_b0 3-4 of
# them); the fresh processes about 1.4 s each, (2 trees + the ORT configurations) x 2 batches x
# models x $RUNS: with three ORT configurations, 3 models and RUNS=4, about 3.5 minutes. So tune in
# one call and measure in the next (KEEP_TUNED=1), or lower MODELS / RUNS / ORT, to stay within a
# call's 10 minutes (2026-11-27: 3 models, RUNS=4, three ORT configurations took 228 s with the
# models tuned already).
#   bash scripts/fresh-check.sh [OLD_TREE]
# 1. the floor of a fresh process here (benchmarks/fresh_floor.py: Python, numpy, CuPy and a CUDA
#    context, cuDNN and its handle);
# 2. $MODELS (default resnet50,convnext_tiny,efficientnet_b0) exported and tuned for batch 1 and 32
#    with their kernel side-car (a model that fails to export or tune is said and left out);
# 3. with OLD_TREE (a folder holding another tree's convpass package, made here with
#    `mkdir -p devab/REV && git archive REV convpass passes | tar x -C devab/REV` and sent with the
#    device call's carry ["devab/REV"]), convpass's fresh-process start under OLD_TREE and this
#    tree, interleaved, $RUNS (default 5) each per model and batch (benchmarks/fresh_ab.py);
#    without it, this tree alone (twice the runs, under two names); where onnxruntime-gpu is staged
#    (shared/device/README.md), ONNX Runtime's configurations $ORT (comma-separated; default
#    HEURISTIC-nchw, HEURISTIC-nhwc and EXHAUSTIVE-nchw: EXHAUSTIVE-nhwc was the slower EXHAUSTIVE in
#    all 8 cases of 2026-11-27 and takes 4-5 s a process; empty: none) on the original models in the
#    same rotation, and issue 10's two targets judged;
# 4. each model's second batch size in the same executor (32 after 1), three executors each.
# KEEP_TUNED=1 keeps the tuned models an earlier call on the same machine left in .fresh-check/
# (a stale side-car shows as run-time compilations in the fresh processes' table). Logs and JSON in $OUT (or
# ./fresh-check-out). Exit status: non-zero if a step failed.
set -uo pipefail
old=""  # the caller's folder resolves OLD_TREE, before the cd below
if [ $# -ge 1 ]; then old=$(cd "$1" 2>/dev/null && pwd) || { echo "fresh-check: no folder $1"; exit 2; }; fi
cd "$(dirname "$0")/.."
out=${OUT:-fresh-check-out}; mkdir -p "$out"
work=.fresh-check; mkdir -p "$work"
models=${MODELS:-resnet50,convnext_tiny,efficientnet_b0}
failed=0
# shellcheck source=device-env.sh
. scripts/device-env.sh
device_env || exit 1
echo "== floor"
python3 benchmarks/fresh_floor.py --runs 3 --json "$out/floor.json" 2>"$out/floor.log" | tee "$out/floor.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
echo "== export and tune ($models, batch 1 and 32)"
missing=()
for m in ${models//,/ }; do [ -f ".panel/$m.onnx" ] || missing+=("$m"); done
if [ ${#missing[@]} -gt 0 ]; then
  missing_list=$(IFS=,; echo "${missing[*]}")
  python3 models/export_panel.py --out .panel --models "$missing_list" >"$out/export.log" 2>&1 \
    || { echo "export: not every model exported (log: export.log):"; tail -3 "$out/export.log"; failed=1; }
fi
python3 - "$work" <<'PY'
import sys, numpy as np
for b in (1, 32):
    np.savez(f"{sys.argv[1]}/in{b}.npz", input=np.random.default_rng(0).standard_normal((b, 3, 224, 224)).astype(np.float32))
PY
cases=()
tuned=()
for m in ${models//,/ }; do
  [ -f ".panel/$m.onnx" ] || { echo "$m: not exported, left out"; continue; }
  if [ "${KEEP_TUNED:-0}" = 1 ] && [ -f "$work/$m.tuned.onnx" ] && [ -f "$work/$m.tuned.onnx.kernels" ]; then
    echo "tuned $m: kept from an earlier call on this machine (KEEP_TUNED)"
  else
    rm -f "$work/$m.tuned.onnx" "$work/$m.tuned.onnx.kernels"
    t0=$(date +%s)
    python3 -m convpass.cli.main optimize ".panel/$m.onnx" -o "$work/$m.tuned.onnx" --shape input=1x3x224x224 --shape input=32x3x224x224 \
      >"$out/optimize-$m.log" 2>&1 || { echo "optimize $m failed, left out:"; tail -3 "$out/optimize-$m.log"; failed=1; continue; }
    echo "tuned $m in $(( $(date +%s) - t0 )) s"
  fi
  tuned+=("$m")
  cases+=(--case "$m.b1=$work/$m.tuned.onnx,$work/in1.npz,.panel/$m.onnx" --case "$m.b32=$work/$m.tuned.onnx,$work/in32.npz,.panel/$m.onnx")
done
[ ${#tuned[@]} -gt 0 ] || { echo "fresh-check: no model tuned"; exit 1; }
echo "== fresh processes"
if [ -n "$old" ]; then trees=(--tree "old=$old" --tree "new=."); else trees=(--tree "a=." --tree "b=."); fi
ort=${ORT-HEURISTIC-nchw,HEURISTIC-nhwc,EXHAUSTIVE-nchw}
if [ -n "$ort" ]; then
  if python3 -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; then
    for c in ${ort//,/ }; do trees+=(--ort "$c"); done
  else
    echo "ONNX Runtime's CUDA EP is not available here (shared/device/README.md stages it): convpass alone"
  fi
fi
python3 benchmarks/fresh_ab.py "${trees[@]}" "${cases[@]}" --runs "${RUNS:-5}" --json "$out/fresh-ab.json" 2>"$out/fresh-ab.log" | tee "$out/fresh-ab.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "fresh_ab failed (log: fresh-ab.log):"; tail -3 "$out/fresh-ab.log"; failed=1; }
echo "== second batch size in the same executor"
{ for m in "${tuned[@]}"; do
  for i in 1 2 3; do
    python3 - "$work" "$m" <<'PY' || failed=1
import sys, time, numpy as np, cupy as cp
from convpass.runtime.executor import Executor
work, m = sys.argv[1], sys.argv[2]
ex = Executor(f"{work}/{m}.tuned.onnx", device="cuda", output_kind="device")
ex.run(None, {"input": cp.asarray(np.load(f"{work}/in1.npz")["input"])})
x = cp.asarray(np.load(f"{work}/in32.npz")["input"])
cp.cuda.runtime.deviceSynchronize()
t0 = time.perf_counter()
ex.run(None, {"input": x})
cp.cuda.runtime.deviceSynchronize()
print(f"{m}: batch 32 after 1 in the same executor {time.perf_counter() - t0:.3f} s", flush=True)
PY
  done
done; } >"$out/second-batch.txt" 2>&1  # in this shell, so that a failure counts
cat "$out/second-batch.txt"
exit "$failed"

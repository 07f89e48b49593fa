#!/usr/bin/env bash
# Issue 10's start-up figures of convpass on one GPU, in one device call (about 6-8 minutes on an
# H200 for the three default models; ONNX Runtime's are the bench's: `convpass bench --fresh-process`).
#   bash scripts/fresh-check.sh [OLD_TREE]
# 1. the floor of a fresh process here (benchmarks/fresh_floor.py: Python, numpy, CuPy and a CUDA
#    context, cuDNN and its handle);
# 2. $MODELS (default resnet50,convnext_tiny,efficientnet_b0) exported and tuned for batch 1 and 32
#    with their kernel side-car;
# 3. with OLD_TREE (a folder holding another tree's convpass package, made here with
#    `git archive REV convpass passes | tar x -C devab/REV`: an untracked folder travels with the
#    working tree), convpass's fresh-process start under OLD_TREE and this tree, interleaved, $RUNS
#    (default 5) each per model and batch (benchmarks/fresh_ab.py); without it, this tree alone;
# 4. each model's second batch size in the same executor (32 after 1), three executors each.
# Logs and JSON in $OUT (or ./fresh-check-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-fresh-check-out}; mkdir -p "$out"
work=.fresh-check; mkdir -p "$work"
models=${MODELS:-resnet50,convnext_tiny,efficientnet_b0}
# shellcheck source=device-env.sh
. scripts/device-env.sh
device_env || exit 1
echo "== floor"
python3 benchmarks/fresh_floor.py --runs 3 --json "$out/floor.json" 2>"$out/floor.log" | tee "$out/floor.txt"
echo "== export and tune ($models, batch 1 and 32)"
[ -f .panel/panel.json ] || python3 models/export_panel.py --out .panel --models "$models" >"$out/export.log" 2>&1 || { tail -5 "$out/export.log"; exit 1; }
python3 - "$work" <<'PY'
import sys, numpy as np
for b in (1, 32):
    np.savez(f"{sys.argv[1]}/in{b}.npz", input=np.random.default_rng(0).standard_normal((b, 3, 224, 224)).astype(np.float32))
PY
cases=()
for m in ${models//,/ }; do
  t0=$(date +%s)
  convpass optimize ".panel/$m.onnx" -o "$work/$m.tuned.onnx" --shape input=1x3x224x224 --shape input=32x3x224x224 \
    >"$out/optimize-$m.log" 2>&1 || { echo "optimize $m failed:"; tail -3 "$out/optimize-$m.log"; continue; }
  echo "tuned $m in $(( $(date +%s) - t0 )) s"
  cases+=(--case "$m.b1=$work/$m.tuned.onnx,$work/in1.npz" --case "$m.b32=$work/$m.tuned.onnx,$work/in32.npz")
done
[ ${#cases[@]} -gt 0 ] || exit 1
echo "== fresh processes"
trees=(--tree "new=.")
[ $# -ge 1 ] && trees=(--tree "old=$1" --tree "new=.")
if [ $# -ge 1 ]; then
  python3 benchmarks/fresh_ab.py "${trees[@]}" "${cases[@]}" --runs "${RUNS:-5}" --json "$out/fresh-ab.json" 2>"$out/fresh-ab.log" | tee "$out/fresh-ab.txt"
else  # one tree: fresh_ab.py wants two; the same tree twice under two names gives twice the runs
  python3 benchmarks/fresh_ab.py --tree a=. --tree b=. "${cases[@]}" --runs "${RUNS:-5}" --json "$out/fresh-ab.json" 2>"$out/fresh-ab.log" | tee "$out/fresh-ab.txt"
fi
echo "== second batch size in the same executor"
for m in ${models//,/ }; do
  [ -f "$work/$m.tuned.onnx" ] || continue
  for i in 1 2 3; do
    python3 - "$work" "$m" <<'PY'
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
print(f"{m}: batch 32 after 1 in the same executor {time.perf_counter() - t0:.3f} s")
PY
  done
done 2>&1 | tee "$out/second-batch.txt"

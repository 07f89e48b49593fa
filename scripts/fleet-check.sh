#!/usr/bin/env bash
# Fleet tuning on the 2-GPU device machine (nvidia-h200-x2): the issue-11 targets in one call, or
# phase by phase when one call would pass the 10-minute limit (the machine keeps .panel and
# .fleet-check between back-to-back calls).
#   bash scripts/fleet-check.sh all                      setup one two kill retime reclock report
#   bash scripts/fleet-check.sh first, then second       the same in two calls of under 10 minutes
#                                                        (first: setup one two; second: kill retime reclock report)
#   bash scripts/fleet-check.sh PHASE...                 those phases in order (setup one two ray kill retime reclock report)
# setup:  install convpass from this tree (no registry), export the panel to .panel, GPU tests of the fleet,
#         then read the NVIDIA libraries (cuDNN's kernels) once, so that the first 1-GPU run does not
#         meet a cold page cache that the later runs do not (a fresh H200's first tuning process ran
#         12% slower in every problem family than the next; that this is the cause is not checked)
# one:    convpass tune of the whole panel (--batch 1,32, every model) on GPU 0, fresh cache
# two:    the same on GPUs 0,1 (--cluster local)      ray: the same with --cluster ray (Ray importable)
# kill:   the same on GPUs 0,1, one worker SIGKILLed mid-run; checks nothing is missing or written twice
# retime: a third run on GPU 0: the clock the report re-times both runs' decisions on
# reclock: the problems one and two decided differently, measured 3 more times on GPU 0 (the report's median clock)
# report: the table (wall 2 GPUs / the faster 1-GPU run <= 0.55, decisions within 3%, noise, kill) and
#         $OUT/fleet-check.json
# Ray, staged as shared/device/README.md says (stage-wheels.sh .raywhl ray==2.60.0 jsonschema
# jsonschema-specifications referencing rpds-py), is found through PYTHONPATH=/tmp/site.
# BATCH overrides the batch sizes (default 1,32); MODELS (comma-separated) exports only those panel
# models at setup (default: all of models/export_panel.py). Logs and JSON go to $OUT (or ./fleet-check-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-fleet-check-out}; mkdir -p "$out"
work=.fleet-check; mkdir -p "$work"
batch=${BATCH:-1,32}
export PYTHONUNBUFFERED=1
# bytecode written as an installed environment has it (see scripts/device-env.sh); setup's GPU tests
# write most of it before the first measured run
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pyc}
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
bench() { python3 benchmarks/fleet_scaling.py "$@" --work "$work"; }
keep() { cp "$work"/*.json "$work"/*.log "$out"/ 2>/dev/null; true; }

phase() {
  case "$1" in
    setup)
      python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; return 1; }
      nvidia-smi -L | tee "$out/gpus.txt"
      python3 -c "import ray; print('ray', ray.__version__)" 2>/dev/null | tee "$out/ray.txt" | grep -q . \
        || echo "ray: not importable (only the ray phase needs it: stage it as shared/device/README.md says)" | tee "$out/ray.txt"
      [ -f .panel/panel.json ] || python3 models/export_panel.py --out .panel ${MODELS:+--models "$MODELS"} >"$out/export.log" 2>&1 || { tail -5 "$out/export.log"; return 1; }
      python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_fleet_gpu.py 2>&1 | tee "$out/fleet-gpu-tests.log" | tail -5
      local rc="${PIPESTATUS[0]}"
      python3 - <<'PY' | tee "$out/page-cache.txt"
import pathlib, time
from convpass.native.cudnn import library
lib = pathlib.Path(library.path()).resolve().parent
nvidia = lib.parent.parent  # .../site-packages/nvidia/<package>/lib: the wheels' libraries, cuDNN's beside CUDA's
libs = sorted(nvidia.glob("*/lib/*.so*")) if nvidia.name == "nvidia" else sorted(lib.glob("libcudnn*.so*"))
started, n = time.perf_counter(), 0
for f in libs:
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 24):
            n += len(chunk)
print(f"read {n / 1e9:.2f} GB in {len(libs)} NVIDIA libraries in {time.perf_counter() - started:.1f} s")
PY
      return "$rc" ;;
    one)    bench run --name one --gpus 0 --batch "$batch" ;;
    two)    bench run --name two --gpus 0,1 --batch "$batch" ;;
    ray)    bench run --name two-ray --gpus 0,1 --cluster ray --batch "$batch" ;;
    kill)   bench kill --name kill --gpus 0,1 --batch "$batch" ;;
    retime) bench run --name retime --gpus 0 --batch "$batch" ;;
    reclock) python3 benchmarks/fleet_scaling.py reclock --gpus 0 --rounds 3 --work "$work" 2>&1 | tee "$out/reclock.log"; return "${PIPESTATUS[0]}" ;;
    report) python3 benchmarks/fleet_scaling.py report --work "$work" --out "$out" | tee "$out/report.txt" ;;
    *) sed -n 2,23p "$0"; return 2 ;;
  esac
}

rc=0
case "${1:-}" in
  all) phases="setup one two kill retime reclock report" ;;
  first) phases="setup one two" ;;
  second) phases="kill retime reclock report" ;;
  *) phases="$*" ;;
esac
[ -n "$phases" ] || { phase help; exit 2; }
for p in $phases; do  # every name checked before minutes of the earlier phases are spent
  case "$p" in setup|one|two|ray|kill|retime|reclock|report) ;; *) echo "fleet-check: unknown phase $p"; phase help; exit 2 ;; esac
done
for p in $phases; do
  echo "== $p"; phase "$p" || rc=1; keep
done
exit "$rc"

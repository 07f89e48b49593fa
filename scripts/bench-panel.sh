#!/usr/bin/env bash
# The wide-panel benchmark on the device machine, in parts that each fit one device call:
#   bash scripts/bench-panel.sh TAG MODEL[,MODEL...] [more convpass bench options]
# writes $OUT/bench-TAG.json and .txt (the report of that part); merge the parts with
#   convpass bench --from-json bench-*.json --json bench.json --plot bench.png
# Expects onnxruntime-gpu unpacked in /tmp/ortgpu (shared/device/README.md, stage-ort-gpu.sh) and
# shares one tuning cache per machine ($CONVPASS_TUNE_CACHE, default /tmp/tune.db) with the GPU tests.
set -uo pipefail
cd "$(dirname "$0")/.."
tag=${1:?tag}; models=${2:?models}; shift 2
out=${OUT:-bench-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
SP=/opt/torch/.venv/lib/python3.12/site-packages
export PYTHONPATH=/tmp/ortgpu${PYTHONPATH:+:$PYTHONPATH}
export LD_LIBRARY_PATH=$SP/nvidia/cu13/lib:$SP/nvidia/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
python3 -c "import convpass" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1
[ -f .panel/panel.json ] || python3 models/export_panel.py --out .panel >"$out/export.log" 2>&1 || { tail -5 "$out/export.log"; exit 1; }
cache=${CONVPASS_TUNE_CACHE:-/tmp/tune.db}
# a cache carried from an earlier machine of the same GPU type (decisions are per device fingerprint)
[ -f "$cache" ] || [ ! -f .tunecache/tune.db ] || cp .tunecache/tune.db "$cache"
paths=()
for m in ${models//,/ }; do paths+=(".panel/$m.onnx"); done
python3 -m convpass.cli bench "${paths[@]}" --runs 20 --warmup 5 --tf32 on --profile-ops \
    --cache "$cache" --json "$out/bench-$tag.json" "$@" 2>&1 | tee "$out/bench-$tag.txt"

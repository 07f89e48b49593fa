#!/usr/bin/env bash
# cuDNN's graph-API engines on the device machine (issue 12), in one call of at most 10 minutes:
# unpacks nvidia-cudnn-frontend staged in .cudnnfe/ (one part, carried with .cudnnfe/tool), runs
# tests/gpu/test_graph_api_gpu.py, then benchmarks MODELS at BATCHES against ONNX Runtime (when staged
# in /tmp/ortgpu, shared/device/README.md) with --engines all, the default.
#   bash ../shared/device/stage-wheels.sh .cudnnfe nvidia-cudnn-frontend==1.32.0      (here, once)
#   bash scripts/graph-api-check.sh [MODELS] [BATCHES]       (device; carry .cudnnfe/00, .cudnnfe/tool)
# BATCHES: bench's --batch values, space-separated ("32", "1,32", "efficientnet_b0=1 efficientnet_v2_s=32").
# MODELS default to the batch-32 losers of the wide panel whose convs are depthwise; the tuning
# cache is $CONVPASS_TUNE_CACHE (default /tmp/tune.db; a legacy-only cache gets only its engines
# measured). $ENGINES (default "all") lists the --engines spaces to bench, one bench run each
# ("legacy all" compares the legacy space alone with the default on the same machine). Logs and
# JSON go to $OUT (or ./graph-api-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-graph-api-out}; mkdir -p "$out"
models=${1:-efficientnet_b0,mobilenet_v3_large}
batches=${2:-32}
[ -f .cudnnfe/00/part ] || { echo "stage nvidia-cudnn-frontend first: bash ../shared/device/stage-wheels.sh .cudnnfe nvidia-cudnn-frontend==1.32.0" >&2; exit 2; }
# shellcheck source=device-env.sh
. scripts/device-env.sh
device_env || exit 1
python3 -c "from convpass.native.cudnn import graph_api; print('graph API:', graph_api.unavailable() or 'available')"
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: the benchmark only
    python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu/test_graph_api_gpu.py 2>&1 | tee "$out/gpu-tests.log" | tail -12
    rc=${PIPESTATUS[0]}
fi
python3 models/export_panel.py --out .panel --models "$models" >"$out/export.log" 2>&1 || { tail -5 "$out/export.log"; exit 1; }
paths=(); for m in ${models//,/ }; do paths+=(".panel/$m.onnx"); done
batch_args=(); for b in $batches; do batch_args+=(--batch "$b"); done
vs=ort; [ -d /tmp/ortgpu ] || vs=none
for engines in ${ENGINES:-all}; do
    echo "== --engines $engines"
    python3 -m convpass.cli.main bench "${paths[@]}" "${batch_args[@]}" --vs "$vs" --runs 15 --warmup 3 --tf32 on --profile-ops \
        --no-roofline --engines "$engines" --cache "${CONVPASS_TUNE_CACHE:-/tmp/tune.db}" --json-file "$out/bench-$engines.json" 2>&1 \
        | tee "$out/bench-$engines.txt" | grep -E "^\||convpass optimize|CUDA graph" | tail -30
    vs=none  # the peers once
done
exit "$rc"

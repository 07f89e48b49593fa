#!/usr/bin/env bash
# The project's one-command GPU check, for a machine with an NVIDIA GPU, CuPy and cuDNN (e.g. the
# device machine): installs convpass from this tree without touching the registry, runs the GPU
# tests (the exported panel models included, fp32 and fp16) and prints the tuning-quality benchmark.
#   bash scripts/gpu-check.sh [MODELS] [BATCHES]      (defaults: the three tuning models, 1,32)
# MODELS are exported and tuned for the benchmark; PANEL_MODELS=all (or a list) exports more of the
# panel (models/export_panel.py) for the GPU tests, which check every exported panel model.
# Logs and JSON go to $OUT (or ./gpu-check-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check-out}; mkdir -p "$out"
models=${1:-resnet50,mobilenet_v3_large,efficientnet_b0}
batches=${2:-1,32}
panel=${PANEL_MODELS:-$models}
[ "$panel" = all ] && panel_args=() || panel_args=(--models "$panel")
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
# the panel first (fp32 and fp16), so the GPU tests check the exported models too
{ python3 models/export_panel.py --out .panel "${panel_args[@]}" && python3 models/export_panel.py --out .panel "${panel_args[@]}" --fp16; } \
    >"$out/export.log" 2>&1 || { tail -5 "$out/export.log"; exit 1; }
python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$out/gpu-tests.log" | tail -15
rc=${PIPESTATUS[0]}
python3 benchmarks/tune_quality.py --panel .panel --models "$models" --batches "$batches" --json "$out/tune_quality.json" 2>&1 | tee "$out/tune_quality.log" | tail -12
exit "$rc"

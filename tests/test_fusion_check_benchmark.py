"""benchmarks/fusion_check.py on the CPU: optimize, the units found and run, outputs against ONNX Runtime."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import onnx
from fused_models import block


def _script():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fusion_check.py"
    spec = importlib.util.spec_from_file_location("fusion_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_smoke_run_reports_units_fused_by_rule_and_matching_outputs(tmp_path, capsys):
    path = tmp_path / "gn.onnx"
    onnx.save(block("gn17", "silu", (1, 8, 5, 6), 4), path)
    out = tmp_path / "rows.json"
    assert _script().main(["--model", str(path), "--batch", "2", "--device", "cpu", "--json", str(out), "--cache", str(tmp_path / "c.db")]) == 0
    (row,) = json.loads(out.read_text())
    assert row["units"] == {"norm": 2} and row["measured"] == 0 and row["ran_fused"] == {"norm": "2/2"}
    assert row["max_rel_err"] < 1e-5 and "fused_ms" not in row

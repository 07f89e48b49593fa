"""benchmarks/fusion_check.py on the CPU: optimize, the units found and run, outputs against ONNX Runtime."""

from __future__ import annotations

import json

import onnx
from conftest import benchmark_script
from fused_models import block


def test_a_smoke_run_reports_units_fused_by_rule_and_matching_outputs(tmp_path, capsys):
    path = tmp_path / "gn.onnx"
    onnx.save(block("gn17", "silu", (1, 8, 5, 6), 4), path)
    out = tmp_path / "rows.json"
    assert benchmark_script("fusion_check").main(["--model", str(path), "--batch", "2", "--device", "cpu", "--json", str(out), "--cache", str(tmp_path / "c.db")]) == 0
    (row,) = json.loads(out.read_text())
    assert row["units"] == {"norm": 2} and row["measured"] == 0 and row["ran_fused"] == {"norm": "2/2"}
    assert row["max_rel_err"] < 1e-5 and "fused_ms" not in row

"""benchmarks/precision_panel.py's verdicts from case figures (no GPU: the figures are given)."""

from __future__ import annotations

import importlib.util

from conftest import REPO

_spec = importlib.util.spec_from_file_location("precision_panel", REPO / "benchmarks" / "precision_panel.py")
precision_panel = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(precision_panel)


def _case(model, batch, tf32, auto2, auto3, fp32, err2=1e-3, err3=1e-4, peer=None):
    c = {"model": model, "batch": batch, "fp32": {"ms": fp32, "error": 1e-7}, "tf32": {"ms": tf32, "error": 3e-3},
         "auto-1e-2": {"ms": auto2, "error": err2, "convs": {"fp16": 3}}, "auto-1e-3": {"ms": auto3, "error": err3, "convs": {"tf32": 3}}}
    if peer is not None:
        c["ort_fp16"] = {"ms": peer, "error": 2e-3}
        c["torch_compile_fp16"] = {"skipped": "torch is not installed"}
    return c


def test_the_summary_judges_every_target():
    cases = [_case("a", 16, 2.0, 1.0, 1.5, 3.0, peer=1.2), _case("b", 16, 3.0, 2.0, 3.5, 3.0, err3=2e-3, peer=1.0),
             {"model": "c", "batch": 16, "error": "out of memory"}]
    lines = precision_panel.summarize(cases)
    text = "\n".join(lines)
    assert "batch 16, 2 models:" in text
    assert "geomean 1.73x" in text and "target 1.5x at batch 16/32: met" in text  # sqrt(2 * 1.5)
    assert "auto 1e-2: worst 1.00e-03 (a): met" in text
    assert "auto 1e-3: worst 2.00e-03 (b): not met" in text
    assert "worst 1.17 of FP32's time (b): not met" in text
    assert "2 models: geomean 1.29 of the peer's time: not met" in text  # sqrt(1/1.2 * 2/1)
    assert "failed: c b16: out of memory" in text
    assert "1.50x tf32" in precision_panel._row(cases[1])

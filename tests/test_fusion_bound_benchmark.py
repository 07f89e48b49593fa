"""benchmarks/fusion_bound.py: the fastest bare conv of a geometry from recorded rows (no GPU)."""

from __future__ import annotations

from conftest import REPO, benchmark_script

from convpass.core.problem import ProblemKey
from convpass.tuning.cache_rows import Measurement

fusion_bound = benchmark_script("fusion_bound")

NCHW = ProblemKey.parse("fwd|n=32|c=64|k=64|in=56x56|ker=1x1|pad=0x0|str=1x1|dil=1x1|g=1|float32|nchw|default")
NHWC = ProblemKey.parse("fwd|n=32|c=64|k=64|in=56x56|ker=1x1|pad=0x0|str=1x1|dil=1x1|g=1|float32|nhwc|default")


def _row(key, algo, ms, method="measure", note=""):
    return Measurement(key, algo, "ok", ms, 0, True, 1.0, method, note=note)


def test_an_engine_row_counts_without_its_bias_pass_and_fused_or_stopped_rows_not_at_all():
    rows = [
        _row(NCHW, "implicit_gemm", 0.050),
        _row(NCHW, "implicit_gemm+bias+relu", 0.030),  # a fused call: not a bare conv
        _row(NCHW, "gemm", 0.010, note="early stop: estimate over 1.5x the best"),  # an estimate
        _row(NHWC, "engine:eng1", 0.048),  # timed with its bias pass (0.010)
        _row(NHWC, "bias", 0.010, method="epilogue"),
        _row(NHWC, "bias+relu", 0.012, method="epilogue"),
    ]
    assert abs(fusion_bound.bare_best_ms(rows, NCHW) - 0.038) < 1e-12
    # an engine row whose pass was not timed tells nothing about its bare conv
    assert fusion_bound.bare_best_ms([rows[0], rows[3]], NCHW) == 0.050


def test_a_missing_cache_is_an_error_and_is_not_created(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        fusion_bound.main(["--model", str(REPO / "models" / "residual_cnn.onnx"), "--cache", str(tmp_path / "none.db")])
    assert "none.db does not exist" in capsys.readouterr().err and not (tmp_path / "none.db").exists()
    with pytest.raises(SystemExit):  # an untuned model: nothing to bound
        (tmp_path / "c.db").write_bytes(b"")
        fusion_bound.main(["--model", str(REPO / "models" / "residual_cnn.onnx"), "--cache", str(tmp_path / "c.db")])
    assert "records no timed conv decision" in capsys.readouterr().err

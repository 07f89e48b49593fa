"""The per-conv account's logic on the CPU: routes from measured rows, the table, and its refusal
without a GPU."""

from __future__ import annotations

from convpass.bench.account import _route_times, render
from convpass.cli.main import main
from convpass.core.problem import ConvShape
from convpass.tuning.cache_rows import Measurement

SHAPE = ConvShape("fwd", 16, 64, 64, (32, 32), (3, 3), (1, 1), (1, 1), (1, 1))
KEY = SHAPE.key("nhwc", "default")
OTHER = SHAPE.key("nchw", "default")


def _row(algo, ms, key=KEY, method="measure", rank=None, status="ok"):
    return Measurement(key, algo, status, ms, 0, True, 1.0, method, heuristic_rank=rank)


def test_each_route_takes_its_best_bare_conv_of_the_key():
    rows = [_row("implicit_gemm", 0.30, rank=1), _row("implicit_precomp_gemm", 0.20), _row("implicit_precomp_gemm", None, method="heuristic", rank=0),
            _row("implicit_precomp_gemm+bias+relu", 0.05),  # a fused call is not the bare conv
            _row("engine:eng67_k2=1", 0.15), _row("engine:eng5", 0.12), _row("engine:eng9", None, status="wrong_result"),
            _row("bias", 0.02, method="epilogue"), _row("implicit_gemm", 0.01, key=OTHER)]
    routes = {"engines A": {"eng67_k2=1"}, "engines B": {"eng67_k2=1", "eng5"}, "fallback": set()}
    assert _route_times(rows, KEY, routes) == {"legacy": 0.20, "heuristic": 0.20, "engines A": 0.15, "engines B": 0.12}


def test_the_table_sums_every_column():
    rows = [{"node": "a", "memory_format": "NHWC", "tuned_ms": 0.1, "in_place_ms": 0.12, "best_ms": 0.09, "legacy nhwc": 0.1},
            {"node": "b", "memory_format": "NCHW", "tuned_ms": 0.2, "in_place_ms": 0.2, "best_ms": 0.2, "legacy nhwc": None}]
    lines = render(rows)
    assert lines[0].split()[:5] == ["node", "fmt", "tuned", "in_place", "best"]
    assert lines[-1].split() == ["sum", "0.3000", "0.3200", "0.2900", "0.1000"]


def test_without_a_gpu_the_account_says_so(capsys, tmp_path):
    from conftest import MODELS

    assert main(["account", str(MODELS / "residual_cnn.onnx")]) == 1
    assert "needs a usable GPU" in capsys.readouterr().err


def test_the_table_says_the_floor_taken_off_the_in_place_times():
    rows = [{"node": "a", "memory_format": "NHWC", "tuned_ms": 0.1, "in_place_ms": 0.12, "in_place_raw_ms": 0.123, "floor_ms": 0.003,
             "best_ms": 0.09}]
    lines = render(rows)
    assert lines[-2].split()[:2] == ["sum", "0.1000"] and "raw" not in lines[0]
    assert lines[-1] == "in_place: each launch as timed less the timing's own 0.0030 ms per launch (an empty kernel timed the same way)"

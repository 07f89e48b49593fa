"""Close calls timed twice (:func:`convpass.tune.tuner.close_calls`): which configurations are timed
again, how the two timings combine, and that only fresh, re-runnable rows of ``measure`` mode are.
The second timing is a stand-in (no GPU here): the GPU path is ``tests/gpu/test_tuner.py``."""

from __future__ import annotations

import contextlib

import pytest

from convpass.cache import Measurement
from convpass.decide import EPILOGUE_METHOD, select
from convpass.options import TuneOptions
from convpass.passes.collect_conv_problems import ConvProblem
from convpass.problem import ProblemKey
from convpass.tune import tuner

# r3d_18's conv at batch 32 as H200 fleet runs timed it, but for the fused call: timed once 8% high
KEY = ProblemKey.parse("fwd|n=32|c=512|k=512|in=2x7x7|ker=3x3x3|pad=1x1x1|str=1x1x1|dil=1x1x1|g=1|float32|nhwc|default")
NCHW = ProblemKey.parse(str(KEY.shape) + "|nchw|default")
PROBLEM = ConvProblem((KEY.shape,), "bias+relu")
OPTIONS = TuneOptions(engines="legacy")


def row(algo, ms, key=KEY, method="measure", status="ok", note="timed"):
    return Measurement(key, algo, status, ms, 0, True, 1.0, method, note=note)


PASS = row("bias+relu", 0.0088, method=EPILOGUE_METHOD)
ROWS = [
    row("implicit_precomp_gemm", 0.1455),  # + pass: 0.1543
    row("implicit_precomp_gemm+bias+relu", 0.1560),  # the high timing (0.1447-0.1464 in three runs)
    row("implicit_gemm", 0.30),
    row("fft", 0.70, note="early stop: estimate over 4x the best"),
    row("implicit_gemm+bias+add+relu", 0.01),  # another epilogue: not this problem's
    row("implicit_precomp_gemm", 0.1600, key=NCHW),  # + pass: 0.1690, 9.5% over the best
    PASS,
    row("bias+relu", 0.0090, key=NCHW, method=EPILOGUE_METHOD),
]


def test_the_close_calls_are_the_rivals_within_the_band_by_the_decisions_cost():
    close = tuner.close_calls(ROWS, PROBLEM, OPTIONS)
    assert [(m.algo, m.key.layout) for m in close] == [("implicit_precomp_gemm", "nhwc"), ("implicit_precomp_gemm+bias+relu", "nhwc")]
    assert tuner.close_calls([ROWS[0], ROWS[2], PASS], PROBLEM, OPTIONS) == []  # a clear winner has no rival
    many = [row(f"algo{i}", 0.100 + 0.001 * i) for i in range(6)]
    assert [m.algo for m in tuner.close_calls(many, ConvProblem((KEY.shape,)), OPTIONS)] == ["algo0", "algo1", "algo2"][:tuner.CONFIRM_TOP]


def test_a_close_call_keeps_the_lower_of_its_two_times_and_the_decision_follows():
    second = {"implicit_precomp_gemm+bias+relu": 0.1449, "implicit_precomp_gemm": 0.1460}
    assert select(ROWS, PROBLEM, OPTIONS).algo == "implicit_precomp_gemm"  # the high timing lost it
    got = tuner.confirm_close_calls(PROBLEM, OPTIONS, ROWS, retime=lambda m: row(m.algo, second[m.algo], key=m.key))
    by = {(m.key, m.algo, m.method): m for m in got}
    fused = by[(KEY, "implicit_precomp_gemm+bias+relu", "measure")]
    assert fused.time_ms == 0.1449 and "close call, timed twice: 0.1560 and 0.1449 ms, the lower kept" in fused.note
    assert by[(KEY, "implicit_precomp_gemm", "measure")].time_ms == 0.1455  # its first timing was the lower
    assert [m for m in got if m.algo not in second or m.key != KEY] == [m for m in ROWS if m.algo not in second or m.key != KEY]
    assert select(got, PROBLEM, OPTIONS).algo == "implicit_precomp_gemm+bias+relu"


def test_stored_rows_and_engines_are_not_timed_again_and_a_failed_second_timing_is_said():
    asked = []

    def retime(m):
        asked.append(m.algo)
        return row(m.algo, None, key=m.key, status="oom", note="out of memory")

    fresh = [row("engine:eng3", 0.1460), row("implicit_precomp_gemm", 0.1400), PASS]
    have = [row("implicit_precomp_gemm+bias+relu", 0.1447)]
    got = tuner.confirm_close_calls(PROBLEM, TuneOptions(), fresh, have, retime=retime)
    assert asked == ["implicit_precomp_gemm"]  # the stored fused row and the engine are rivals, not timed again
    bare = next(m for m in got if m.algo == "implicit_precomp_gemm")
    assert bare.time_ms == 0.1400 and bare.note.endswith("close call, timed again: oom (out of memory)")


@pytest.mark.parametrize("fprop_algo,timed_again", [(None, True), ("normal", False)])
def test_only_measure_mode_times_close_calls_again(monkeypatch, fprop_algo, timed_again):
    from convpass.tune import harness

    asked = []
    monkeypatch.setattr(harness, "warm_clocks", lambda: None)
    monkeypatch.setattr(tuner, "_measure", lambda *a, **k: list(ROWS))
    monkeypatch.setattr(tuner, "retime_row", lambda m: asked.append(m.algo) or m)
    tuner.measure_problem(PROBLEM, TuneOptions(engines="legacy", fprop_algo=fprop_algo))
    assert bool(asked) == timed_again


def test_a_row_is_timed_again_the_way_it_was_timed_first(monkeypatch):
    import convpass.cudnn as cudnn

    calls = []

    class Bench:
        def __init__(self, shape):
            self.shape = shape

        def measure(self, descs, key, algo, best_ms):
            calls.append(("legacy", algo, descs, best_ms))
            return "legacy"

        def _measure_fused_call(self, descs, key, algo, name, best_ms):
            calls.append(("fused", algo, name, descs, best_ms))
            return "fused"

        def _measure_own(self, key, algo, fusion, best_ms):
            calls.append(("own", algo, fusion, best_ms))
            return "own"

        def release(self):
            calls.append("released")

    monkeypatch.setattr(tuner, "_ShapeBench", Bench)
    monkeypatch.setattr(cudnn, "ConvDescriptors", lambda key: contextlib.nullcontext(f"descs of {key.layout}"))
    assert tuner.retime_row(row("implicit_gemm", 0.1)) == "legacy"
    assert tuner.retime_row(row("implicit_precomp_gemm+bias+relu", 0.1)) == "fused"
    assert tuner.retime_row(row("convpass_depthwise_r8+bias", 0.1)) == "own"
    assert calls == [("legacy", "implicit_gemm", "descs of nhwc", None), "released",
                     ("fused", "implicit_precomp_gemm", "bias+relu", "descs of nhwc", None), "released",
                     ("own", "convpass_depthwise_r8", "bias", None), "released"]

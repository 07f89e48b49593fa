"""Tuned convs timed in place on a real GPU: the plan runs the recorded algorithm, each conv's time
in place is near its tuned time once the timing's own per-launch floor is taken off (small convs
at batch 1 are not flagged for it), and a decision whose recorded time is a tenth of the truth (a
deliberately mismatched plan) is caught. ``optimize --json`` carries the check with its floor."""

from __future__ import annotations

import onnx
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import MODELS  # noqa: E402

from convpass.compiler.pipeline import optimize_model  # noqa: E402
from convpass.core import annotation  # noqa: E402
from convpass.core.model_io import load_model, to_proto  # noqa: E402
from convpass.core.options import TuneOptions  # noqa: E402
from convpass.runtime import Executor  # noqa: E402
from convpass.runtime.in_place import SLOW_RATIO, check_in_place  # noqa: E402

MAX_FLOOR_MS = 0.010  # an empty launch between two events: a few microseconds on a current GPU

SHAPE = "input=1x3x64x64"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    from convpass.native import device

    if device.detect() is None:
        pytest.skip("no usable GPU / cuDNN")
    model = load_model(MODELS / "residual_cnn.onnx")
    optimize_model(model, TuneOptions(tf32="on"), [SHAPE], cache=tmp_path_factory.mktemp("c") / "c.db")
    return to_proto(model)


def _feeds():
    return {"input": cp.random.standard_normal((1, 3, 64, 64), dtype=cp.float32)}


def test_each_tuned_conv_runs_its_recorded_algorithm_and_near_its_tuned_time(tuned):
    ex = Executor(tuned, device="cuda", cuda_graph=False)
    report = check_in_place(ex, _feeds())
    recorded = {r["node"]: r for r in __import__("convpass").inspect(tuned)}
    assert report.reliable and len(report.convs) == len(recorded)
    for c in report.convs:
        r = recorded[c.node]
        assert c.algo in (r["engine"] and f"engine:{r['engine']}" + (f"+{r['fusion']}" if r["fusion"] else ""), r["algo"],
                          f"{r['algo']}+{r['fusion']}" if r["fusion"] else r["algo"]), (c, r)
        assert c.memory_format == r["memory_format"]
    print("\n".join(c.line() for c in report.convs))


def test_a_mismatched_plan_is_caught(tuned):
    damaged = onnx.ModelProto()
    damaged.CopyFrom(tuned)
    for node in damaged.graph.node:
        if annotation.is_annotated_conv(node):
            for attr in node.attribute:
                if attr.name == "time_ms":
                    attr.floats[:] = [t / 10 for t in attr.floats]
    ex = Executor(damaged, device="cuda", cuda_graph=False)
    report = check_in_place(ex, _feeds())
    assert report.reliable and report.slow and all(c.ratio > SLOW_RATIO for c in report.slow)


def test_the_floor_is_an_empty_launch_subtracted_from_every_conv(tuned):
    """The floor's arithmetic, not a speed: whether a batch-1 conv runs within 15% of its tuned time
    in place is what the check measures (a stem conv reading a freshly transposed input was flagged
    at 1.4x), so the test asserts only that the floor never flags more convs than the raw times."""
    ex = Executor(tuned, device="cuda", cuda_graph=False)
    report = check_in_place(ex, _feeds())
    raw_flagged = sum(c.raw_ms / c.tuned_ms > SLOW_RATIO for c in report.convs)
    print(f"\nfloor {report.floor_ms:.4f} ms; {raw_flagged} of {len(report.convs)} flagged without it; {report.how}")
    print("\n".join(c.line() for c in report.convs))
    assert report.reliable and report.convs and 0 < report.floor_ms < MAX_FLOOR_MS
    for c in report.convs:
        assert c.floor_ms == report.floor_ms and c.in_place_ms == max(c.raw_ms - c.floor_ms, 0.0)
    assert len(report.slow) <= raw_flagged
    assert all(c.ratio > SLOW_RATIO for c in report.slow)


def test_optimize_json_carries_the_check_with_its_floor(tmp_path, capsys, caplog):
    import json

    from convpass.cli.main import main
    from convpass.compiler.aot import SHOWN_SLOW

    tuned = tmp_path / "t.onnx"
    with caplog.at_level("WARNING", logger="convpass"):
        assert main(["optimize", str(MODELS / "residual_cnn.onnx"), "-o", str(tuned), "--shape", SHAPE, "--tf32", "on",
                     "--cache", str(tmp_path / "c.db"), "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    (profile,) = doc["in_place"]
    print(captured.err)
    assert profile["reliable"] and 0 < profile["floor_ms"] < MAX_FLOOR_MS and profile["convs"]
    assert all(c["floor_ms"] == profile["floor_ms"] and c["raw_ms"] >= c["in_place_ms"] for c in profile["convs"])
    assert "(each less the timing's own" in captured.err
    slow = [c for c in profile["convs"] if c["ratio"] > SLOW_RATIO]
    named = [r.getMessage() for r in caplog.records if r.getMessage().startswith("conv '")]
    assert len(named) == min(len(slow), SHOWN_SLOW)
    assert any(r.getMessage().startswith("... and ") for r in caplog.records) == (len(slow) > SHOWN_SLOW)

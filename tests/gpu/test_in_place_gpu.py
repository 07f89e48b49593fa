"""Tuned convs timed in place on a real GPU: the plan runs the recorded algorithm, each conv's time
in place is near its tuned time, and a decision whose recorded time is a tenth of the truth (a
deliberately mismatched plan) is caught."""

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

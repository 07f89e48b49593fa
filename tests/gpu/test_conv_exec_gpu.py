"""What is timed is what runs, on a real GPU: for every conv decision of a small model, the
execution object (:mod:`convpass.kernels.conv_exec`) the tuner timed for the recorded algorithm
and the one the executor's plan runs are of the same class, with the same problem key, the same
algorithm (a graph-API engine's id and knobs, a fused epilogue) and the same workspace."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import MODELS, leaky_model, silu_model  # noqa: E402

import convpass  # noqa: E402
from convpass.kernels import conv_exec  # noqa: E402
from convpass.kernels.convolution import ConvLaunch  # noqa: E402
from convpass.runtime import Executor  # noqa: E402

CASES = {
    "residual_cnn": (lambda: onnx.load(MODELS / "residual_cnn.onnx"), {"input": (1, 3, 64, 64)}),  # legacy calls, fused residuals
    "mobile_block": (lambda: onnx.load(MODELS / "mobile_block.onnx"), {"input": (2, 3, 32, 32)}),  # depthwise: own kernels
    "silu": (silu_model, {"x": (2, 16, 12, 12)}),  # graph-API engines, the fused bias+swish graph
    "leaky": (leaky_model, {"x": (2, 8, 12, 12)}),  # the fused bias+leakyrelu0.2 / 0.1 graphs
}



def _runs(record: dict) -> str:
    """The algorithm text of what a recorded decision runs (:class:`convpass.core.algo.Algo`)."""
    fusion = f"+{record['fusion']}" if record["fusion"] else ""
    return f"engine:{record['engine']}{fusion}" if record["engine"] else record["algo"] + fusion


@pytest.mark.parametrize("case", list(CASES))
def test_each_decision_runs_the_object_the_tuner_timed(case, tmp_path):
    make, inputs = CASES[case]
    shapes = [",".join(f"{name}={'x'.join(map(str, dims))}" for name, dims in inputs.items())]
    with conv_exec.record_launches() as timed:
        convpass.optimize(make(), tmp_path / "m.onnx", shapes=shapes, cache=tmp_path / "c.db", quiet=True, tf32="on")
    records = {r["node"]: r for r in convpass.inspect(onnx.load(tmp_path / "m.onnx"))}
    assert records and all(r["source"] == "measure" for r in records.values()), records

    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(dims).astype(np.float32) for name, dims in inputs.items()}
    ex = Executor(str(tmp_path / "m.onnx"), device="cuda", cuda_graph=False)
    ex.run(None, feeds)  # the op-by-op run that records the plan
    with conv_exec.record_launches() as ran:
        ex.run(None, feeds)  # the plan's launches
    launches = [launch for launch in ex.last_plan.backend_state.launch_list() if isinstance(launch, ConvLaunch)]
    assert sorted(launch.call.node_name for launch in launches) == sorted(records)

    runs = []
    for launch in launches:
        node, resolution = launch.call.node_name, launch.exec
        record = records[node]
        assert resolution.source == "recorded", (node, resolution.source, resolution.note)
        [conv] = resolution.steps.values()  # the one object the plan's launch of this conv runs
        runs.append(conv.identity)
        assert (str(conv.key), str(conv.algo)) == (record["problem_key"], _runs(record)), (node, conv, record)
        assert conv.workspace_bytes == record["workspace_bytes"], (node, conv, record)
        tuned = {t.identity for t in timed if (t.identity.key, t.identity.algo) == (conv.key, str(conv.algo))}
        assert tuned, f"{node}: the tuner never launched {conv}"
        assert {(t.kind, t.workspace_bytes) for t in tuned} == {(type(conv).__name__, conv.workspace_bytes)}, (node, conv, tuned)
        print(f"{node}: {conv.describe()}")
    assert collections.Counter(r.identity for r in ran) == collections.Counter(runs)  # and nothing else launched

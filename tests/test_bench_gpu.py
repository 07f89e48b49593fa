"""GPU tests of ``convpass bench``'s strongest peers (marked ``gpu``; run on the device machine with
``pytest -m gpu tests/test_bench_gpu.py``): ONNX Runtime's CUDA EP with CUDA graphs on a model it
captures and on one it refuses (control flow), torch.compile on a panel model, and the command
end to end with every peer. Each output checked against ONNX Runtime CPU by the bench itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import MODELS, REPO  # noqa: E402

from convpass.bench import contenders, measure, ort_contender, ranking, records, torch_contender  # noqa: E402
from convpass.bench.reference import reference_outputs  # noqa: E402
from convpass.core.profiles import input_shapes  # noqa: E402

PANEL = REPO / ".panel"


def _inputs(path: Path, batch: int = 1):
    model = onnx.load(path, load_external_data=False)
    feeds = measure.make_feeds(model, input_shapes(model, batch))
    ref, _, _ = reference_outputs(path, feeds)
    return feeds, {n: cp.asarray(a) for n, a in feeds.items()}, ref


def _ort_or_skip() -> None:
    reason = ort_contender.ort_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def test_ort_captures_a_plain_cnn_in_a_cuda_graph_and_its_outputs_match():
    _ort_or_skip()
    path = MODELS / "residual_cnn.onnx"
    feeds, dev, ref = _inputs(path)
    got = ort_contender.run_ort_graph(path, feeds, dev, ref, True, "float32", runs=10, warmup=3)
    assert [c["family"] for c in got] == ["ort-graph"] * 4
    for c in got:
        assert c["status"] == "ok", (c["name"], c["reason"])
        assert c["rel_err"] <= c["tolerance"] and c["median_ms"] > 0 and c["first_run_s"] > 0


def _control_flow_model(path: Path) -> None:
    """Conv -> If(cond) -> Relu or Identity: ONNX Runtime does not capture control flow in a CUDA graph."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    cond = numpy_helper.from_array(np.array(True), "cond")
    then = helper.make_graph([helper.make_node("Relu", ["c"], ["t"])], "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", ["c"], ["e"])], "else", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
        "cf", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 16, 16])], [w, cond])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def test_ort_refuses_to_capture_control_flow_and_its_reason_reaches_the_case(tmp_path):
    _ort_or_skip()
    path = tmp_path / "control_flow.onnx"
    _control_flow_model(path)
    feeds, dev, ref = _inputs(path, batch=2)
    peers = contenders.run_peers(path, feeds, dev, ref, vs=("ort-graph",), tf32=True, dtype="float32", runs=5, warmup=1,
                                 panel_json=None, module_cache={}, compile_modes=(), log=lambda s: None)
    graphs = [c for c in peers if c["family"] == "ort-graph"]
    assert {c["status"] for c in graphs} == {"refused"}, [(c["name"], c["status"], c["reason"]) for c in graphs]
    assert all("\n" not in c["reason"] and "graph" in c["reason"].lower() for c in graphs), graphs[0]["reason"]
    stand_ins = [c for c in peers if c["family"] == "ort"]
    assert len(stand_ins) == 4 and any(records.rankable(c) for c in stand_ins)
    ours = records.contender("convpass", "convpass", times_ms=[1.0], rel_err=0.0, tolerance=5e-3)
    case = ranking.annotate_case({"model": "control_flow", "batch": 2, "contenders": [ours, *peers]})
    assert case["stand_ins"]["ort-graph"] == graphs[0]["reason"] and case["best"]["ort-graph"] == case["best"]["ort"]


def test_torch_compile_default_and_reduce_overhead_on_a_panel_model():
    reason = torch_contender.torch_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    path = PANEL / "dcgan_generator.onnx"
    if not path.exists():
        pytest.skip(f"{path} not exported (python3 models/export_panel.py --out .panel --models dcgan_generator)")
    feeds, dev, ref = _inputs(path, batch=2)
    cache: dict = {}
    eager = torch_contender.run_torch(path, None, dev, ref, True, "float32", 10, 3, cache)
    got = torch_contender.run_torch_compile(path, None, dev, ref, True, "float32", 10, 3, cache, ("default", "reduce-overhead"), eager)
    assert [c["name"] for c in got] == ["torch.compile default", "torch.compile reduce-overhead"]
    for c in got:
        assert c["status"] == "ok", (c["name"], c["reason"])
        assert c["compile_s"] > 0 and c["cold_start_s"] >= c["compile_s"] and c["median_ms"] > 0


def test_bench_command_with_every_peer_on_a_sample(tmp_path, capsys):
    _ort_or_skip()
    from convpass.cli import bench as bench_cli

    out = tmp_path / "bench.json"
    rc = bench_cli.main([str(MODELS / "residual_cnn.onnx"), "--batch", "1", "--vs", "ort,ort-graph", "--runs", "10",
                         "--warmup", "3", "--no-roofline", "--cache", str(tmp_path / "t.db"), "--json-file", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    (case,) = doc["cases"]
    assert records.find(case, "convpass")["status"] == "ok"
    assert {c["family"] for c in case["contenders"]} == {"convpass", "ort", "ort-graph"}
    assert case["best"]["ort-any"] is not None and case["ratios"]["vs_ort_any"] > 0
    assert "ONNX Runtime CUDA EP with CUDA graphs" in capsys.readouterr().out

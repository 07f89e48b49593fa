"""Convolutions inside If / Loop / Scan bodies: tuned like any other (shapes resolved per branch and
body), or named with the reason when they cannot be; the tuned model still runs in ONNX Runtime with
the original's outputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import random_input, run_ort
from onnx import TensorProto, helper, numpy_helper

import convpass
from convpass.core import annotation

RNG = np.random.default_rng(5)


def _w(name: str, *shape: int) -> onnx.TensorProto:
    fan_in = int(np.prod(shape[1:]))
    return numpy_helper.from_array((RNG.standard_normal(shape) * fan_in ** -0.5).astype(np.float32), name)


def _vi(name: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def if_model(batch="N") -> onnx.ModelProto:
    """x -> If(sum(x) > 0): then Conv 3x3 + Relu, else Conv 5x5 (their own weights, one a branch
    initializer, one the outer graph's) -> Conv 1x1 after the If."""
    then = helper.make_graph(
        [helper.make_node("Conv", ["x", "w_then"], ["t1"], pads=[1, 1, 1, 1], name="then_conv"),
         helper.make_node("Relu", ["t1"], ["t_out"], name="then_relu")],
        "then", [], [_vi("t_out", None)], [_w("w_then", 4, 3, 3, 3)])
    other = helper.make_graph(
        [helper.make_node("Conv", ["x", "w_else", "b_else"], ["e_out"], pads=[2, 2, 2, 2], name="else_conv")],
        "else", [], [_vi("e_out", None)])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
        helper.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
        helper.make_node("If", ["cond"], ["branch"], then_branch=then, else_branch=other, name="if"),
        helper.make_node("Conv", ["branch", "w_after"], ["y"], name="after_conv"),
    ]
    inits = [_w("w_else", 4, 3, 5, 5), numpy_helper.from_array(RNG.standard_normal(4).astype(np.float32), "b_else"),
             _w("w_after", 2, 4, 1, 1), numpy_helper.from_array(np.array(0, np.float32), "zero")]
    graph = helper.make_graph(nodes, "g", [_vi("x", [batch, 3, 8, 8])], [_vi("y", [batch, 2, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def loop_model() -> onnx.ModelProto:
    """v0 = Conv(x); three times v = Relu(Conv(v)) + v in a Loop body (its weight the body's own)."""
    body = helper.make_graph(
        [helper.make_node("Conv", ["v_in", "w_body", "b_body"], ["c"], pads=[1, 1, 1, 1], name="body_conv"),
         helper.make_node("Relu", ["c"], ["r"], name="body_relu"),
         helper.make_node("Add", ["r", "v_in"], ["v_out"], name="body_add"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 _vi("v_in", None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), _vi("v_out", None)],
        [_w("w_body", 4, 4, 3, 3), numpy_helper.from_array(np.zeros(4, np.float32), "b_body")])
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["v0"], pads=[1, 1, 1, 1], name="first_conv"),
        helper.make_node("Loop", ["trips", "true", "v0"], ["y"], body=body, name="loop"),
    ]
    inits = [_w("w0", 4, 3, 3, 3), numpy_helper.from_array(np.array(3, np.int64), "trips"),
             numpy_helper.from_array(np.array(True), "true")]
    graph = helper.make_graph(nodes, "g", [_vi("x", [2, 3, 8, 8])], [_vi("y", [2, 4, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def scan_model() -> onnx.ModelProto:
    """A Scan over the first axis of x [T, N, C, H, W]: each step's slice goes through a Conv."""
    body = helper.make_graph(
        [helper.make_node("Conv", ["frame", "w_scan"], ["out_frame"], pads=[1, 1, 1, 1], name="scan_conv"),
         helper.make_node("Add", ["acc_in", "out_frame"], ["acc_out"], name="scan_add")],
        "body", [_vi("acc_in", [1, 4, 8, 8]), _vi("frame", [1, 3, 8, 8])], [_vi("acc_out", [1, 4, 8, 8]), _vi("out_frame", [1, 4, 8, 8])],
        [_w("w_scan", 4, 3, 3, 3)])
    nodes = [helper.make_node("Scan", ["acc0", "x"], ["acc", "frames"], body=body, num_scan_inputs=1, name="scan")]
    graph = helper.make_graph(nodes, "g", [_vi("x", [5, 1, 3, 8, 8])], [_vi("acc", [1, 4, 8, 8]), _vi("frames", [5, 1, 4, 8, 8])],
                              [numpy_helper.from_array(np.zeros((1, 4, 8, 8), np.float32), "acc0")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _annotated(model: onnx.ModelProto) -> dict[str, str]:
    """Name -> op type of every tuned conv, at any depth."""
    return {n.name: n.op_type for n in annotation.all_nodes(model.graph) if annotation.is_annotated_conv(n)}


def _same_outputs(original: onnx.ModelProto, tuned: onnx.ModelProto, feeds: dict) -> None:
    onnx.checker.check_model(tuned, full_check=True)
    for got, want in zip(run_ort(tuned, feeds), run_ort(original, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sign", [1.0, -1.0])  # which branch runs
def test_convs_in_both_branches_of_an_if_are_tuned(sign):
    model = if_model()
    tuned = convpass.optimize(model, quiet=True, shapes=["x=2x3x8x8"])
    assert _annotated(tuned) == {"then_conv": "ConvNoBias", "else_conv": "Conv", "after_conv": "ConvNoBias"}
    records = {r["node"]: r for r in convpass.inspect(tuned)}
    assert set(records) == {"then_conv", "else_conv", "after_conv"}
    assert records["then_conv"]["problem_key"].startswith("fwd|n=2|c=3|k=4|in=8x8|ker=3x3|pad=1x1")
    assert records["else_conv"]["problem_key"].startswith("fwd|n=2|c=3|k=4|in=8x8|ker=5x5|pad=2x2")
    x = np.abs(random_input((2, 3, 8, 8))) * sign
    _same_outputs(model, tuned, {"x": x})


def test_a_conv_in_a_loop_body_is_tuned():
    model = loop_model()
    tuned = convpass.optimize(model, quiet=True)
    assert _annotated(tuned) == {"first_conv": "ConvNoBias", "body_conv": "Conv"}
    key = next(r["problem_key"] for r in convpass.inspect(tuned) if r["node"] == "body_conv")
    assert key.startswith("fwd|n=2|c=4|k=4|in=8x8|ker=3x3")
    _same_outputs(model, tuned, {"x": random_input((2, 3, 8, 8))})


def test_a_conv_in_a_scan_body_is_tuned():
    model = scan_model()
    tuned = convpass.optimize(model, quiet=True)
    assert _annotated(tuned) == {"scan_conv": "ConvNoBias"}
    _same_outputs(model, tuned, {"x": random_input((5, 1, 3, 8, 8))})


def test_a_body_conv_whose_shape_cannot_be_resolved_is_named(capsys):
    """A Loop whose carried tensor grows each trip (a Concat with itself): its body's conv has no
    one input shape, and optimize says so by name (and tunes what it can)."""
    model = loop_model()
    body = model.graph.node[1].attribute[0].g
    body.node.insert(0, helper.make_node("Concat", ["v_in", "v_in"], ["v_grown"], axis=2, name="grow"))
    body.node[1].input[0] = "v_grown"  # the conv reads the grown tensor: its height doubles each trip
    body.node[3].input[1] = "v_grown"
    body.node[3].input[0] = "r"
    tuned = convpass.optimize(model, quiet=False)
    err = capsys.readouterr().err
    assert "2 convolutions" in err and "untuned" in err
    assert "untuned body_conv" in err and "in the body of Loop 'loop'" in err and "shape" in err
    assert _annotated(tuned) == {"first_conv": "ConvNoBias"}


def test_body_convs_take_cached_decisions_beside_the_main_graph_s_layout_plan(tmp_path):
    """From a tuning cache (no GPU), with --layout auto: the main graph's convs are planned as one
    graph, a body's conv takes its own best layout; every conv gets its cached decision."""
    import time

    from convpass.compiler.pipeline import OptimizeReport, build_options, prepare_model
    from convpass.core.device import DeviceFingerprint
    from convpass.core.model_io import load_model
    from convpass.tuning.cache import TuningCache
    from convpass.tuning.cache_rows import Measurement

    h200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)
    model = if_model()
    prepared = load_model(model)
    uses = prepare_model(prepared, build_options({}), ["x=2x3x8x8"], OptimizeReport())
    with TuningCache(tmp_path / "c.db") as cache:
        rows = [Measurement(s.key(layout, "default"), "implicit_gemm", "ok", 0.01 if layout == "nhwc" else 0.02, 0, True, time.time(), "measure")
                for problem in uses for s in problem.candidates for layout in ("nchw", "nhwc")]
        cache.put(h200, rows)
        for shapes in prepared.meta["convpass.value_shapes"]:
            for dims in {tuple(d) for d in shapes.values() if len(d) == 4 and all(isinstance(v, int) for v in d)}:
                cache.put_transpose(h200, dims, "float32", 0.001)
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", device_name="H200", quiet=True, shapes=["x=2x3x8x8"])
    records = {r["node"]: r for r in convpass.inspect(tuned)}
    assert {n: (r["source"], r["memory_format"]) for n, r in records.items()} == {
        "then_conv": ("cache", "NHWC"), "else_conv": ("cache", "NHWC"), "after_conv": ("cache", "NHWC")}
    assert annotation.read_model_info(tuned).options.get("layout_applied") is None  # the plan ran
    _same_outputs(model, tuned, {"x": random_input((2, 3, 8, 8))})

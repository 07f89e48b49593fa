"""A selective-kernel block (timm's SelectiveKernel as exported): its branch sums become 4-D
element-wise sums (convpass.compiler.passes.sum_branches), and the layout plan may then put every
conv of the block in NHWC, its channel Split included (convpass.compiler.passes.plan_layouts)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import prepared, run_ort
from onnx import TensorProto, helper, numpy_helper

from convpass.compiler import pipeline
from convpass.compiler.passes.plan_layouts import plan_layouts
from convpass.core.model_io import to_proto
from convpass.runtime.executor import Executor

N, C, HW, K = 4, 8, 6, 2  # batch, channels per path, size, paths


def _sk_block(keepdims: int = 0, weights_axis_len: int = K) -> onnx.ModelProto:
    """x -> stem conv -> Relu -> Split(axis 1) -> K path convs -> Relu -> Unsqueeze(1) -> Concat(1)
    = S [N, K, C, H, W]; ReduceSum(S, [1]) -> ReduceMean(2, 3) -> 1x1 conv -> Relu -> 1x1 conv ->
    Reshape [N, K, C, 1, 1] -> Softmax(1) = W; ReduceSum(S * W, [1]) -> conv -> y. ``keepdims=1``:
    each ReduceSum keeps the axis and a Squeeze drops it."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(name, shape):
        return const(name, (rng.standard_normal(shape) * 0.3).astype(np.float32))

    nodes.append(helper.make_node("Conv", ["x", weight("ws", (K * C, 3, 3, 3))], ["s"], name="stem", pads=[1] * 4))
    nodes.append(helper.make_node("Relu", ["s"], ["r"], name="stem_relu"))
    nodes.append(helper.make_node("Split", ["r"], [f"in{i}" for i in range(K)], name="split", axis=1))
    const("ax1", np.array([1], np.int64))
    for i in range(K):
        nodes.append(helper.make_node("Conv", [f"in{i}", weight(f"wp{i}", (C, C, 3, 3))], [f"p{i}"], name=f"path{i}",
                                      pads=[i + 1] * 4, dilations=[i + 1] * 2))
        nodes.append(helper.make_node("Relu", [f"p{i}"], [f"x{i}"], name=f"path{i}_relu"))
        nodes.append(helper.make_node("Unsqueeze", [f"x{i}", "ax1"], [f"u{i}"], name=f"unsqueeze{i}"))
    nodes.append(helper.make_node("Concat", [f"u{i}" for i in range(K)], ["stack"], name="stack", axis=1))
    nodes.append(helper.make_node("ReduceSum", ["stack", "ax1"], ["total_k" if keepdims else "total"], name="attn_sum", keepdims=keepdims))
    nodes += [helper.make_node("Squeeze", ["total_k", "ax1"], ["total"], name="squeeze_total")] if keepdims else []
    nodes.append(helper.make_node("ReduceMean", ["total"], ["pooled"], name="pool", axes=[-2, -1], keepdims=1))
    nodes.append(helper.make_node("Conv", ["pooled", weight("wr", (4, C, 1, 1))], ["red"], name="fc_reduce"))
    nodes.append(helper.make_node("Relu", ["red"], ["red_relu"], name="fc_relu"))
    nodes.append(helper.make_node("Conv", ["red_relu", weight("wsel", (weights_axis_len * C, 4, 1, 1))], ["sel"], name="fc_select"))
    const("target", np.array([N, weights_axis_len, C, 1, 1], np.int64))
    nodes.append(helper.make_node("Reshape", ["sel", "target"], ["logits"], name="reshape"))
    nodes.append(helper.make_node("Softmax", ["logits"], ["w"], name="softmax", axis=1))
    nodes.append(helper.make_node("Mul", ["stack", "w"], ["weighted"], name="mul"))
    nodes.append(helper.make_node("ReduceSum", ["weighted", "ax1"], ["mixed_k" if keepdims else "mixed"], name="mix_sum", keepdims=keepdims))
    if keepdims:
        nodes.append(helper.make_node("Squeeze", ["mixed_k", "ax1"], ["mixed"], name="squeeze_mixed"))
    nodes.append(helper.make_node("Conv", ["mixed", weight("w2", (C, C, 3, 3))], ["y"], name="conv2", pads=[1] * 4))
    graph = helper.make_graph(nodes, "sk_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, 3, HW, HW])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, C, HW, HW])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _prepared(model: onnx.ModelProto) -> ir.Model:
    return prepared(model, [f"x={N}x3x{HW}x{HW}"])


def _ops(m: ir.Model) -> list[str]:
    return [n.op_type for n in m.graph]


def _x() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((N, 3, HW, HW)).astype(np.float32)


def test_the_branch_sums_become_element_wise_sums_of_the_same_values():
    model = _sk_block()
    m = _prepared(model)
    ops = _ops(m)
    assert "ReduceSum" not in ops and "Unsqueeze" not in ops and "Concat" not in ops
    assert ops.count("Add") == 2 and ops.count("Mul") == K and ops.count("Squeeze") == K
    rewritten = to_proto(m)
    onnx.checker.check_model(rewritten, full_check=True)
    (want,) = run_ort(model, {"x": _x()})
    (got,) = run_ort(rewritten, {"x": _x()})
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    (cpu,) = Executor(rewritten, device="cpu").run(None, {"x": _x()})
    np.testing.assert_allclose(cpu, want, rtol=1e-5, atol=1e-5)


def test_the_new_values_have_their_shapes_in_the_profile():
    m = _prepared(_sk_block())
    shapes = m.meta[pipeline.VALUE_SHAPES_KEY][0]
    for node in m.graph:
        if node.op_type in ("Add", "Mul"):
            assert list(shapes[node.outputs[0].name]) == [N, C, HW, HW], node.name
        if node.op_type == "Squeeze":
            assert list(shapes[node.outputs[0].name]) == [N, C, 1, 1], node.name
    assert {"mixed", "total"} <= set(shapes)  # the sums keep their names


@pytest.mark.parametrize(("case", "kwargs"), [("keepdims=1", {"keepdims": 1}), ("weights broadcast over the paths", {"weights_axis_len": 1})])
def test_what_the_rule_does_not_cover_is_left_as_it_is(case, kwargs):
    model = _sk_block(**kwargs)
    m = _prepared(model)
    ops = _ops(m)
    if case == "weights broadcast over the paths":
        assert ops.count("ReduceSum") == 1 and ops.count("Concat") == 1, case  # the plain sum rewritten, the weighted one kept
    else:
        assert ops.count("ReduceSum") == 2, case
    (want,) = run_ort(model, {"x": _x()})
    (got,) = run_ort(to_proto(m), {"x": _x()})
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _plan(m: ir.Model, transpose: float = 1.0):
    convs = [n for n in m.graph if n.op_type == "Conv"]
    shapes = m.meta[pipeline.VALUE_SHAPES_KEY][0]
    plan = plan_layouts(m.graph, {n: {"nchw": 10.0, "nhwc": 5.0} for n in convs},
                        lambda v: transpose if len(shapes.get(v.name) or ()) in (4, 5) and list(shapes[v.name])[2:] != [1] * (len(shapes[v.name]) - 2) else 0.0,
                        shapes=shapes)
    return plan, convs


def test_the_plan_puts_every_conv_of_the_block_in_nhwc():
    """Every conv 5 ms in NHWC and 10 in NCHW, a transpose of a feature map 1 ms (none for one
    spatial position): with the 5-D stack gone and the Split agnostic, all 6 convs in NHWC, paying
    the graph input's and output's transposes only (30 + 2 ms). Held by the Split, the Unsqueezes
    and the ReduceSums, the stem, the paths and conv2 stayed in NCHW."""
    plan, convs = _plan(_prepared(_sk_block()))
    assert {c.name: plan.layouts[c] for c in convs} == {c.name: "nhwc" for c in convs}
    assert plan.transposes == 2 and plan.cost_ms == pytest.approx(32.0)


def test_a_channel_split_passes_the_format_through():
    """The Split alone (the stack left as it is, keepdims=1 after the sums), a transpose 3 ms: the
    stem and the paths take NHWC through it, each path paying only its output's transpose to the
    stack. Held in NCHW, the Split made NHWC cost each path two transposes (6 ms for 5 gained) and
    the stem two (the graph input and the Split), so all three stayed in NCHW."""
    m = _prepared(_sk_block(keepdims=1))
    plan, convs = _plan(m, transpose=3.0)
    layouts = {c.name: plan.layouts[c] for c in convs}
    assert layouts["stem"] == layouts["path0"] == layouts["path1"] == "nhwc"

"""The min-cut layout planner on small graphs whose best plans are known."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from convpass.passes.plan_layouts import plan_layouts


def _chain(*ops):
    """x -> op0 -> op1 -> ... -> y, every value the same size."""
    x = ir.Value(name="x")
    nodes, value = [], x
    for i, op in enumerate(ops):
        node = ir.Node("", op, [value], name=f"{op.lower()}{i}")
        nodes.append(node)
        value = node.outputs[0]
        value.name = f"v{i}"
    graph = ir.Graph([x], [value], nodes=nodes)
    return graph, nodes


def _plan(ops, costs, transpose):
    graph, nodes = _chain(*ops)
    conv_costs = {n: costs[i] for i, n in enumerate(nodes) if n.op_type == "Conv"}
    plan = plan_layouts(graph, conv_costs, lambda v: transpose)
    return [plan.layouts.get(n) for n in nodes if n.op_type == "Conv"], plan


def test_nhwc_chain_pays_two_transposes():
    layouts, plan = _plan(["Conv", "Relu", "Conv"], [{"nchw": 10, "nhwc": 5}, None, {"nchw": 10, "nhwc": 5}], 1)
    assert layouts == ["nhwc", "nhwc"] and plan.transposes == 2 and plan.cost_ms == pytest.approx(12)


def test_expensive_transposes_keep_nchw():
    layouts, plan = _plan(["Conv", "Relu", "Conv"], [{"nchw": 10, "nhwc": 5}, None, {"nchw": 10, "nhwc": 5}], 10)
    assert layouts == ["nchw", "nchw"] and plan.transposes == 0 and plan.cost_ms == 20


def test_whole_graph_beats_per_conv_choice():
    # conv0 alone prefers NHWC by 1, but that would cost two transposes of 3 each
    layouts, plan = _plan(["Conv", "Relu", "Conv"], [{"nchw": 10, "nhwc": 9}, None, {"nchw": 5, "nhwc": 20}], 3)
    assert layouts == ["nchw", "nchw"] and plan.cost_ms == 15 and plan.per_conv_best_ms == 14


def test_layout_sensitive_ops_stay_nchw():
    # a Reshape between the convs is pinned to NCHW: each NHWC conv pays its own two transposes
    layouts, plan = _plan(["Conv", "Reshape", "Conv"], [{"nchw": 10, "nhwc": 5}, None, {"nchw": 10, "nhwc": 9}], 2)
    assert layouts == ["nhwc", "nchw"] and plan.transposes == 2 and plan.cost_ms == pytest.approx(5 + 4 + 10)


def test_unmeasured_layout_is_never_chosen():
    layouts, _ = _plan(["Conv", "Relu", "Conv"], [{"nchw": 10}, None, {"nchw": 10, "nhwc": 1}], 0.1)
    assert layouts[0] == "nchw"


def test_no_convs():
    graph, _ = _chain("Relu")
    assert plan_layouts(graph, {}, lambda v: 1).layouts == {}

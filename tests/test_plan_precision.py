"""The float16 region as a minimum cut (known answers on hand-built graphs, exhaustive check on random
ones) and the rewrite that puts it in the graph (Casts shared, names kept, ONNX Runtime runs it)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from convpass.compiler.passes.plan_precision import evaluate_assignment, movable_nodes, plan_precision
from convpass.compiler.passes.reduce_precision import ReducePrecisionPass

F32 = ir.DataType.FLOAT


def _value(name: str) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(F32))


def _node(op: str, inputs, name: str) -> ir.Node:
    node = ir.Node("", op, inputs, name=name)
    node.outputs[0].name, node.outputs[0].type = f"v_{name}", ir.TensorType(F32)
    return node


def _chain(*ops):
    x = _value("x")
    nodes, value = [], x
    for i, op in enumerate(ops):
        node = _node(op, [value], f"{op.lower()}{i}")
        nodes.append(node)
        value = node.outputs[0]
    return ir.Graph([x], [value], nodes=nodes), nodes


def _plan(graph, nodes, costs, cast):
    conv_costs = {n: c for n, c in zip(nodes, costs) if c is not None}
    return plan_precision(graph, conv_costs, "fp16", lambda v: cast)


def _precisions(plan, nodes):
    return [plan.precisions[n] for n in nodes if n in plan.precisions]


FAST = {"fp32": 10.0, "tf32": 4.0, "fp16": 1.0}


def test_a_chain_of_convs_is_one_region_with_two_casts():
    graph, nodes = _chain("Conv", "Relu", "Conv")
    plan = _plan(graph, nodes, [FAST, None, FAST], 1.0)
    assert _precisions(plan, nodes) == ["fp16", "fp16"]
    assert plan.reduced == frozenset(nodes)  # the Relu between them too: no cast inside the region
    assert plan.casts == 2 and plan.cost_ms == pytest.approx(4.0)


def test_expensive_casts_keep_the_convs_wide_at_their_cheaper_wide_precision():
    graph, nodes = _chain("Conv", "Relu", "Conv")
    plan = _plan(graph, nodes, [FAST, None, FAST], 5.0)
    assert _precisions(plan, nodes) == ["tf32", "tf32"] and not plan.reduced
    assert plan.casts == 0 and plan.cost_ms == pytest.approx(8.0)


def test_equal_wide_times_choose_fp32_and_ties_choose_float32_storage():
    graph, nodes = _chain("Conv")
    plan = _plan(graph, nodes, [{"fp32": 2.0, "tf32": 2.0, "fp16": 1.0}], 0.5)  # fp16 + 2 casts = 2.0: a tie
    assert _precisions(plan, nodes) == ["fp32"] and not plan.reduced


def test_a_fixed_op_between_convs_costs_casts_on_both_sides():
    graph, nodes = _chain("Conv", "Softmax", "Conv")
    plan = _plan(graph, nodes, [FAST, None, FAST], 1.0)
    assert _precisions(plan, nodes) == ["fp16", "fp16"] and nodes[1] not in plan.reduced
    assert plan.casts == 4 and plan.cost_ms == pytest.approx(6.0)
    costly = _plan(graph, nodes, [FAST, None, {"fp32": 10.0, "fp16": 9.0}], 1.0)
    assert _precisions(costly, nodes) == ["fp16", "fp32"]  # 9 + 2 casts > 10


def test_a_value_read_by_several_wide_readers_is_cast_back_once():
    """conv -> y; y read by three Softmax (fixed) nodes: one Cast to float32 serves them all."""
    x = _value("x")
    conv = _node("Conv", [x], "conv")
    readers = [_node("Softmax", [conv.outputs[0]], f"s{i}") for i in range(3)]
    graph = ir.Graph([x], [r.outputs[0] for r in readers], nodes=[conv, *readers])
    plan = plan_precision(graph, {conv: {"fp32": 5.0, "fp16": 1.0}}, "fp16", lambda v: 1.0)
    assert plan.precisions[conv] == "fp16" and plan.casts == 2 and plan.cost_ms == pytest.approx(3.0)
    dearer = plan_precision(graph, {conv: {"fp32": 2.9, "fp16": 1.0}}, "fp16", lambda v: 1.0)
    assert dearer.precisions[conv] == "fp32"  # 1 + 2 shared casts = 3 > 2.9 (one cast per reader would say 5)


def test_a_value_read_by_several_reduced_readers_is_cast_to_half_once():
    x = _value("x")
    convs = [_node("Conv", [x], f"c{i}") for i in range(3)]
    graph = ir.Graph([x], [c.outputs[0] for c in convs], nodes=convs)
    plan = plan_precision(graph, {c: {"fp32": 2.0, "fp16": 1.0} for c in convs}, "fp16", lambda v: 0.4)
    # three reduced convs: one cast of x in, three casts out = 1.6 + 3 = 4.6 < 6
    assert all(p == "fp16" for p in plan.precisions.values()) and plan.casts == 4 and plan.cost_ms == pytest.approx(4.6)


def test_a_conv_without_a_float16_measurement_stays_wide():
    graph, nodes = _chain("Conv", "Relu", "Conv")
    plan = _plan(graph, nodes, [FAST, None, {"fp32": 10.0, "tf32": 4.0}], 0.1)
    assert _precisions(plan, nodes) == ["fp16", "tf32"]


def test_constants_outside_the_half_range_keep_their_node_wide():
    x = _value("x")
    conv = _node("Conv", [x], "conv")
    big = ir.Value(name="big", type=ir.TensorType(F32), const_value=ir.tensor(np.array([1e5], np.float32), name="big"))
    add = _node("Add", [conv.outputs[0], big], "add")
    small = ir.Value(name="small", type=ir.TensorType(F32), const_value=ir.tensor(np.array([3.0], np.float32), name="small"))
    mul = _node("Mul", [conv.outputs[0], small], "mul")
    graph = ir.Graph([x], [add.outputs[0], mul.outputs[0]], nodes=[conv, add, mul], initializers=[big, small])
    movable = movable_nodes(graph, {conv: {"fp16": 1.0}}, "fp16", {})
    assert conv in movable and mul in movable and add not in movable


def test_values_of_unknown_type_take_the_types_shape_inference_gave():
    x = ir.Value(name="x")
    conv = ir.Node("", "Conv", [x], name="conv")
    conv.outputs[0].name = "y"
    graph = ir.Graph([x], [conv.outputs[0]], nodes=[conv])
    costs = {conv: {"fp32": 5.0, "fp16": 1.0}}
    assert plan_precision(graph, costs, "fp16", lambda v: 1.0).precisions[conv] == "fp32"  # types unknown: nothing moves
    typed = plan_precision(graph, costs, "fp16", lambda v: 1.0, {"x": TensorProto.FLOAT, "y": TensorProto.FLOAT})
    assert typed.precisions[conv] == "fp16"


_OPS = ["Conv", "Conv", "Relu", "Add", "Mul", "MaxPool", "Softmax", "Concat", "Shape"]


def _random_case(seed):
    rng = random.Random(seed)
    x = _value("x")
    values, nodes = [x], []
    for i in range(rng.randint(3, 9)):
        op = rng.choice(_OPS)
        ins = [rng.choice(values[-4:])] + ([rng.choice(values[-4:])] if op in ("Add", "Mul", "Concat") else [])
        node = _node(op, ins, f"{op}{i}")
        if op == "Shape":
            node.outputs[0].type = ir.TensorType(ir.DataType.INT64)
        else:
            values.append(node.outputs[0])
        nodes.append(node)
    outputs = [values[-1]] + ([values[rng.randint(1, len(values) - 1)]] if rng.random() < 0.5 and len(values) > 2 else [])
    graph = ir.Graph([x], list(dict.fromkeys(outputs)), nodes=nodes)
    costs = {}
    for n in nodes:
        if n.op_type == "Conv":
            c = {"fp32": rng.uniform(1, 10), "tf32": rng.uniform(0.5, 5), "fp16": rng.uniform(0.2, 3)}
            for p in rng.sample(["fp32", "tf32"], rng.randint(0, 1)):
                del c[p]
            costs[n] = c
    casts = {v.name: rng.uniform(0.05, 2.0) for v in values}
    return graph, costs, lambda v: casts[v.name]


def test_the_plan_is_the_cheapest_region_on_random_graphs():
    """Exhaustive check: every subset of the movable nodes, priced by the same rules."""
    for seed in range(400):
        graph, costs, cast = _random_case(seed)
        if not costs:
            continue
        plan = plan_precision(graph, costs, "fp16", cast)
        movable = sorted(movable_nodes(graph, costs, "fp16", {}), key=lambda n: n.name)
        best = min(evaluate_assignment(graph, {n for n, on in zip(movable, bits) if on}, costs, "fp16", cast).cost_ms
                   for bits in itertools.product((0, 1), repeat=len(movable)))
        assert plan.cost_ms == pytest.approx(best, abs=1e-5), seed


# ------------------------------------------------------------------ the rewrite


def _model():
    """x -> conv1 -> relu -> conv2 (+ bias) -> add(const) -> y (graph output), and conv1's output
    also read by a Softmax (fixed) -> s (graph output); maxpool from relu -> m (output)."""
    rng = np.random.default_rng(0)
    init = lambda name, *shape: numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)  # noqa: E731
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "k"], ["y"], name="add"),
        helper.make_node("Softmax", ["c1"], ["s"], name="softmax", axis=1),
        helper.make_node("MaxPool", ["r"], ["m"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
    ]
    inits = [init("w1", 8, 3, 3, 3), init("w2", 8, 8, 3, 3), init("b2", 8), init("k", 1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in
                               (("y", [1, 8, 8, 8]), ("s", [1, 8, 8, 8]), ("m", [1, 8, 4, 4]))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _run(model, x):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_the_rewrite_casts_once_per_value_and_direction_and_keeps_the_outputs():
    original = _model()
    model = ir.serde.deserialize_model(original)
    rewrite = ReducePrecisionPass({"conv1", "relu", "conv2", "add"})
    rewrite(model)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    casts = {n.name: (list(n.input), n.attribute[0].i) for n in out.graph.node if n.op_type == "Cast"}
    # x in; c1 back for the Softmax; r back for the MaxPool; y back (an output keeps its name)
    assert sorted(casts) == ["c1/to_fp32", "r/to_fp32", "x/to_fp16", "y/to_fp32"] and rewrite.casts == 4
    assert [o.name for o in out.graph.output] == ["y", "s", "m"]
    assert all(o.type.tensor_type.elem_type == TensorProto.FLOAT for o in out.graph.output)
    inits = {t.name: t.data_type for t in out.graph.initializer}
    assert inits == {"w1_fp16": TensorProto.FLOAT16, "w2_fp16": TensorProto.FLOAT16, "b2_fp16": TensorProto.FLOAT16,
                     "k_fp16": TensorProto.FLOAT16}
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    for got, want in zip(_run(out, x), _run(original, x)):
        assert got.dtype == np.float32
        assert np.abs(got - want).max() <= 5e-3 * np.abs(want).max()  # float16 storage: 2^-11 per rounding


def test_a_constant_read_by_a_wide_node_too_keeps_its_float32_copy():
    original = _model()
    model = ir.serde.deserialize_model(original)
    ReducePrecisionPass({"conv2"})(model)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    assert {t.name for t in out.graph.initializer} == {"w1", "w2_fp16", "b2_fp16", "k"}
    x = np.random.default_rng(2).standard_normal((1, 3, 8, 8)).astype(np.float32)
    assert all(np.allclose(a, b, rtol=0, atol=5e-3 * np.abs(b).max()) for a, b in zip(_run(out, x), _run(original, x)))

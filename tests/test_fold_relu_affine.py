"""HGNetV2's learnable affine block (``Conv -> Relu -> Mul(s) -> Add(t)``, the constants shared through
Identity nodes, as timm exports it): the positive scale folds into the conv and a zero shift goes
(convpass.compiler.passes.fold_relu_affine), so the conv's step (``bias+relu``) writes the block's
output and no element-wise pass is left; the outputs stay ONNX Runtime's on the original model."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import prepared, run_ort
from onnx import TensorProto, helper, numpy_helper

from convpass.compiler.passes.collect_conv_problems import conv_fusion
from convpass.core.model_io import to_proto
from convpass.runtime.executor import Executor

N, C, HW = 2, 8, 6


def _lab_block(scales=(1.0, 1.0), shifts=(0.0, 0.0), channel_scale: bool = False) -> onnx.ModelProto:
    """x -> [Conv 3x3 + bias -> Relu -> Mul(s_i) -> Add(t_i)] x 2 -> y, each constant read through an
    Identity (timm's export). ``channel_scale``: the second scale is one value per channel, [C,1,1]."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array, np.float32), name))
        nodes.append(helper.make_node("Identity", [name], [name + "_id"], name=name + "_identity"))
        return name + "_id"

    src = "x"
    for i, (s, t) in enumerate(zip(scales, shifts)):
        cin = 3 if i == 0 else C
        w = const(f"w{i}", rng.standard_normal((C, cin, 3, 3)) * 0.3)
        b = const(f"b{i}", rng.standard_normal(C) * 0.1)
        scale = np.linspace(0.5, 2.0, C).reshape(C, 1, 1) if channel_scale and i == 1 else np.array([s])
        nodes.append(helper.make_node("Conv", [src, w, b], [f"c{i}"], name=f"conv{i}", pads=[1] * 4))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"))
        nodes.append(helper.make_node("Mul", [f"r{i}", const(f"s{i}", scale)], [f"m{i}"], name=f"mul{i}"))
        src = "y" if i == len(scales) - 1 else f"a{i}"
        nodes.append(helper.make_node("Add", [f"m{i}", const(f"t{i}", np.array([t]))], [src], name=f"add{i}"))
    graph = helper.make_graph(nodes, "lab_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, 3, HW, HW])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, C, HW, HW])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _prepared(model: onnx.ModelProto) -> ir.Model:
    return prepared(model, [f"x={N}x3x{HW}x{HW}"])


def _ops(m: ir.Model) -> list[str]:
    return [n.op_type for n in m.graph if n.op_type != "Identity"]


def _x() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((N, 3, HW, HW)).astype(np.float32)


def _same_outputs(model: onnx.ModelProto, m: ir.Model) -> None:
    rewritten = to_proto(m)
    onnx.checker.check_model(rewritten, full_check=True)
    (want,) = run_ort(model, {"x": _x()})
    (got,) = run_ort(rewritten, {"x": _x()})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    (cpu,) = Executor(rewritten, device="cpu").run(None, {"x": _x()})
    np.testing.assert_allclose(cpu, want, rtol=1e-5, atol=1e-5)


def test_an_identity_affine_leaves_each_conv_step_ending_at_its_relu():
    """The panel's export (scale 1, shift 0 in every block): no Mul or Add is left, each conv's step
    absorbs its Relu and writes what the block wrote, and the output keeps its name."""
    model = _lab_block()
    m = _prepared(model)
    assert _ops(m) == ["Conv", "Relu", "Conv", "Relu"]
    assert [conv_fusion(n) for n in m.graph if n.op_type == "Conv"] == ["bias+relu", "bias+relu"]
    assert [v.name for v in m.graph.outputs] == ["y"] and m.graph.outputs[0].producer().op_type == "Relu"
    _same_outputs(model, m)


@pytest.mark.parametrize("channel_scale", [False, True], ids=["scalar scale", "per-channel scale"])
def test_a_positive_scale_folds_into_the_conv_and_a_shift_that_is_not_zero_stays(channel_scale):
    """Trained values (scales 0.7 and 1.3 or per channel, shifts 0.25 and -0.5): the Muls go into the
    convs' weights and biases; the shifts stay as Adds after the Relus."""
    model = _lab_block(scales=(0.7, 1.3), shifts=(0.25, -0.5), channel_scale=channel_scale)
    m = _prepared(model)
    assert _ops(m) == ["Conv", "Relu", "Add", "Conv", "Relu", "Add"]
    _same_outputs(model, m)


@pytest.mark.parametrize("scale", [-0.5, 0.0, float("inf")])
def test_a_scale_that_is_not_positive_and_finite_is_left_as_it_is(scale):
    """``s * relu(u)`` is no ``relu(s * u)`` for s <= 0; an infinite scale has no folded weight.
    The zero shift after an unfolded Mul stays too (it no longer follows the Relu)."""
    model = _lab_block(scales=(scale, 1.0))
    m = _prepared(model)
    assert _ops(m) == ["Conv", "Relu", "Mul", "Add", "Conv", "Relu"]
    (want,) = run_ort(model, {"x": _x()})
    (got,) = run_ort(to_proto(m), {"x": _x()})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_shared_weight_keeps_its_value_for_its_other_reader():
    """The folded weight is a new initializer: a second conv reading the same weight (with no affine
    after it) still computes with the original one."""
    model = _lab_block(scales=(2.0, 1.0))
    g = model.graph
    g.node.append(helper.make_node("Conv", ["x", "w0_id", "b0_id"], ["side"], name="side_conv", pads=[1] * 4))
    g.output.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, [N, C, HW, HW]))
    m = _prepared(model)
    convs = {n.name: n for n in m.graph if n.op_type == "Conv"}
    w_side, w_folded = (np.asarray(convs[k].inputs[1].const_value.numpy()) for k in ("side_conv", "conv0"))
    np.testing.assert_allclose(w_folded, 2.0 * w_side, rtol=1e-6)
    rewritten = to_proto(m)
    want = run_ort(model, {"x": _x()})
    got = run_ort(rewritten, {"x": _x()})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

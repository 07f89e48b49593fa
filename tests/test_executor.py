"""The executor (CPU backend) against ONNX Runtime CPU, its plans, and its errors."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import MODELS, annotated, conv_model, random_input, run_ort
from onnx import TensorProto, helper, numpy_helper

from convpass.core import annotation
from convpass.runtime import Executor, ExecutorError, check_support

FP32 = dict(rtol=1e-4, atol=1e-5)
FP16 = dict(rtol=1e-2, atol=1e-2)


def _run_onnx_reference(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)


def _compare(model: onnx.ModelProto, feeds: dict, tol: dict = FP32, reference=run_ort, **kw) -> Executor:
    ex = Executor(model, **kw)
    got = ex.run(None, feeds)
    ref = reference(model, feeds)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        np.testing.assert_allclose(g.astype(np.float64), r.astype(np.float64), **tol)
    return ex


# ---------------------------------------------------------------------------------------------
# every conv variant

CONV_CASES = {
    "plain": ((2, 4, 9, 9), (6, 4, 3, 3), dict(pads=[1, 1, 1, 1])),
    "no_pad_no_bias": ((1, 3, 8, 8), (5, 3, 3, 3), dict(bias=False)),
    "stride2": ((1, 4, 10, 10), (8, 4, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "stride_rect_kernel": ((1, 3, 11, 9), (4, 3, 5, 3), dict(strides=[3, 2], pads=[2, 1, 2, 1])),
    "dilation": ((1, 4, 12, 12), (4, 4, 3, 3), dict(dilations=[2, 3], pads=[2, 3, 2, 3])),
    "groups": ((1, 8, 7, 7), (12, 4, 3, 3), dict(group=2, pads=[1, 1, 1, 1])),
    "depthwise": ((2, 8, 9, 9), (8, 1, 3, 3), dict(group=8, pads=[1, 1, 1, 1], strides=[2, 2])),
    "depthwise_multiplier": ((1, 4, 6, 6), (8, 1, 3, 3), dict(group=4)),
    "asymmetric_pads": ((1, 3, 8, 8), (4, 3, 4, 4), dict(pads=[1, 0, 2, 3])),
    "same_upper": ((1, 3, 9, 10), (4, 3, 4, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    "same_lower": ((1, 3, 9, 10), (4, 3, 4, 3), dict(auto_pad="SAME_LOWER", strides=[2, 2])),
    # ORT refuses dilation with SAME_*: compared with onnx.reference instead (see test_conv_matches_ort)
    "same_upper_dilated": ((1, 3, 9, 9), (4, 3, 3, 3), dict(auto_pad="SAME_UPPER", dilations=[2, 2])),
    "same_lower_dilated_strided": ((1, 3, 10, 9), (4, 3, 3, 2), dict(auto_pad="SAME_LOWER", dilations=[2, 3], strides=[2, 2])),
    "valid": ((1, 3, 9, 10), (4, 3, 3, 3), dict(auto_pad="VALID", strides=[2, 3])),
    "1x1": ((2, 16, 5, 5), (8, 16, 1, 1), {}),
    "1d": ((2, 3, 40), (5, 3, 7), dict(strides=[2], pads=[3, 3])),
    "1d_dilated_asym": ((1, 4, 33), (4, 2, 4), dict(group=2, dilations=[2], pads=[1, 2])),
    "1d_same_lower": ((1, 2, 17), (3, 2, 4), dict(auto_pad="SAME_LOWER", strides=[3])),
    "3d": ((1, 3, 5, 8, 8), (4, 3, 3, 3, 3), dict(pads=[1, 1, 1, 1, 1, 1])),
    "3d_strided_grouped": ((1, 4, 6, 9, 9), (6, 2, 1, 3, 3), dict(group=2, strides=[1, 2, 2], pads=[0, 1, 1, 0, 1, 1])),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_matches_ort(case):
    x_shape, w_shape, attrs = CONV_CASES[case]
    model = conv_model("Conv", x_shape, w_shape, **attrs)
    dilated_same = attrs.get("auto_pad", "").startswith("SAME") and "dilations" in attrs
    _compare(model, {"x": random_input(x_shape)}, reference=_run_onnx_reference if dilated_same else run_ort)


CONV_TRANSPOSE_CASES = {
    "plain": ((1, 4, 5, 5), (4, 3, 3, 3), {}),
    "stride2_pads": ((2, 4, 6, 6), (4, 3, 4, 4), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "asymmetric_pads": ((1, 3, 5, 5), (3, 2, 3, 3), dict(strides=[2, 2], pads=[0, 1, 2, 0])),
    "output_padding": ((1, 4, 5, 5), (4, 3, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])),
    "output_shape": ((1, 4, 5, 5), (4, 3, 3, 3), dict(strides=[2, 2], output_shape=[10, 10])),
    "groups": ((1, 6, 4, 4), (6, 2, 3, 3), dict(group=3, strides=[2, 2], pads=[1, 1, 1, 1])),
    "depthwise": ((1, 4, 4, 4), (4, 1, 4, 4), dict(group=4, strides=[2, 2], pads=[1, 1, 1, 1])),
    "dilation": ((1, 3, 5, 5), (3, 2, 3, 3), dict(dilations=[2, 2], pads=[1, 1, 1, 1])),
    "same_upper": ((1, 3, 5, 5), (3, 2, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    "1d": ((2, 3, 10), (3, 4, 4), dict(strides=[2], pads=[1, 1])),
    "3d": ((1, 4, 3, 4, 4), (4, 2, 3, 4, 4), dict(strides=[1, 2, 2], pads=[1, 1, 1, 1, 1, 1])),
    "dcgan_first": ((2, 16, 1, 1), (16, 8, 4, 4), dict(bias=False)),
}


@pytest.mark.parametrize("case", sorted(CONV_TRANSPOSE_CASES))
def test_conv_transpose_matches_ort(case):
    x_shape, w_shape, attrs = CONV_TRANSPOSE_CASES[case]
    model = conv_model("ConvTranspose", x_shape, w_shape, **attrs)
    _compare(model, {"x": random_input(x_shape)})


@pytest.mark.parametrize("case", ["3d_strided_grouped", "dilation", "1d_dilated_asym", "plain"])
def test_conv_large_image_path(case, monkeypatch):
    """Images whose im2col columns exceed the chunk budget accumulate per kernel offset instead."""
    from convpass.ops import conv

    monkeypatch.setattr(conv, "_CHUNK_BYTES", 1)
    x_shape, w_shape, attrs = CONV_CASES[case]
    _compare(conv_model("Conv", x_shape, w_shape, **attrs), {"x": random_input(x_shape)})


@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_fp16_conv(op):
    if op == "Conv":
        x_shape, w_shape, attrs = (1, 8, 9, 9), (8, 4, 3, 3), dict(group=2, pads=[1, 1, 1, 1], strides=[2, 2])
    else:
        x_shape, w_shape, attrs = (1, 4, 5, 5), (4, 3, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])
    model = conv_model(op, x_shape, w_shape, elem_type=TensorProto.FLOAT16, **attrs)
    ex = _compare(model, {"x": random_input(x_shape, TensorProto.FLOAT16)}, FP16)
    assert ex.get_inputs()[0].type == "tensor(float16)"


def test_conv_geometry_is_the_canonical_one():
    """The cpu reference runs canonicalize_conv's plan: symmetric pads + extra pads, its cuDNN problem."""
    model = conv_model("Conv", (1, 3, 9, 10), (4, 3, 4, 3), auto_pad="SAME_UPPER", strides=[2, 2])
    ex = Executor(model)
    ex.run(None, {"x": random_input((1, 3, 9, 10))})
    (conv,) = ex.plan_summary()
    assert conv.problem.startswith("fwd|n=1|c=3|k=4|")
    geometry = ex.last_plan.steps[0].node.prepared.geometry
    assert geometry.shapes and not geometry.refusal
    assert geometry.output_shape == (1, 4, 5, 5)


# ---------------------------------------------------------------------------------------------
# BatchNormalization folding


def _conv_bn_model(extra_consumer: bool = False, op: str = "Conv", elem_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    dt = np.float16 if elem_type == TensorProto.FLOAT16 else np.float32
    k = 6
    if op == "Conv":
        w = rng.standard_normal((k, 4, 3, 3)).astype(dt)
        conv = helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1])
    else:
        w = rng.standard_normal((4, k // 2, 3, 3)).astype(dt)
        conv = helper.make_node("ConvTranspose", ["x", "w", "b"], ["c"], name="conv", group=2, strides=[2, 2])
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(rng.standard_normal(k).astype(dt), "b"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, k).astype(dt), "scale"),
        numpy_helper.from_array(rng.standard_normal(k).astype(dt), "beta"),
        numpy_helper.from_array(rng.standard_normal(k).astype(dt) * 0.1, "mean"),
        numpy_helper.from_array(rng.uniform(0.5, 2.0, k).astype(dt), "var"),
    ]
    nodes = [
        conv,
        helper.make_node("BatchNormalization", ["c", "scale", "beta", "mean", "var"], ["bn"], name="bn", epsilon=1e-3),
        helper.make_node("Relu", ["bn"], ["y"], name="relu"),
    ]
    outputs = [helper.make_tensor_value_info("y", elem_type, None)]
    if extra_consumer:
        nodes.append(helper.make_node("Sigmoid", ["c"], ["s"], name="side"))
        outputs.append(helper.make_tensor_value_info("s", elem_type, None))
    return _model(nodes, [_vi("x", [1, 4, 6, 6], elem_type)], outputs, inits)


@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_batchnorm_folded_into_conv(op):
    model = _conv_bn_model(op=op)
    ex = _compare(model, {"x": random_input((1, 4, 6, 6))})
    assert ex.folded_batchnorms == ["bn"]
    assert [s.node.op_type for s in ex.last_plan.steps] == [op, "Relu"]


def test_batchnorm_not_folded_when_conv_output_is_shared():
    model = _conv_bn_model(extra_consumer=True)
    ex = _compare(model, {"x": random_input((1, 4, 6, 6))})
    assert ex.folded_batchnorms == []
    assert "BatchNormalization" in [s.node.op_type for s in ex.last_plan.steps]


def test_batchnorm_fold_fp16():
    model = _conv_bn_model(elem_type=TensorProto.FLOAT16)
    ex = _compare(model, {"x": random_input((1, 4, 6, 6), TensorProto.FLOAT16)}, FP16)
    assert ex.folded_batchnorms == ["bn"]


@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_batchnorm_fold_is_the_float64_formula_rounded_once(op):
    """The folded weights are W * gamma / sqrt(var + eps) per output channel and
    (b - mean) * that + beta, computed in float64 and rounded once; the outputs match ONNX Runtime
    CPU on the unfolded model within float32 rounding."""
    model = _conv_bn_model(op=op)
    ex = _compare(model, {"x": random_input((1, 4, 6, 6))}, dict(rtol=1e-5, atol=1e-6))
    p = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    scale = p["scale"] / np.sqrt(p["var"] + 1e-3)
    if op == "Conv":
        w = p["w"] * scale[:, None, None, None]
    else:  # group 2: input channels 0-1 feed output channels 0-2, input channels 2-3 feed 3-5
        w = p["w"] * np.repeat(scale.reshape(2, 3), 2, axis=0)[:, :, None, None]
    (conv,) = [n for n in ex._nodes if n.op_type == op]
    np.testing.assert_array_equal(ex._constants[conv.inputs[1]], w.astype(np.float32))
    np.testing.assert_array_equal(ex._constants[conv.inputs[2]], ((p["b"] - p["mean"]) * scale + p["beta"]).astype(np.float32))


def test_batchnorm_folded_into_a_conv_and_into_a_fused_kernel_is_one_rule():
    """The executor's conv fold and the cuda backend's fused element-wise kernel (an unfolded
    BatchNormalization read as x * scale + shift) give one BatchNormalization the same numbers:
    after a 1x1 identity conv without bias, the folded weight's diagonal is the kernel's scale and
    the folded bias its shift."""
    from convpass.kernels import elementwise

    k = 6
    rng = np.random.default_rng(5)
    params = {"scale": rng.uniform(0.5, 1.5, k), "beta": rng.standard_normal(k), "mean": rng.standard_normal(k), "var": rng.uniform(0.5, 2, k)}
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in params.items()]
    bn = helper.make_node("BatchNormalization", ["c", "scale", "beta", "mean", "var"], ["y"], name="bn", epsilon=1e-3)
    eye = numpy_helper.from_array(np.eye(k, dtype=np.float32).reshape(k, k, 1, 1), "w")
    folded = Executor(_model([helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), bn], [_vi("x", [1, k, 2, 2])],
                             [_vi("y", None)], [eye, *inits]))
    assert folded.folded_batchnorms == ["bn"]
    (conv,) = folded._nodes
    weight, bias = folded._constants[conv.inputs[1]], folded._constants[conv.inputs[2]]
    alone = Executor(_model([helper.make_node("BatchNormalization", ["x", "scale", "beta", "mean", "var"], ["y"], epsilon=1e-3)],
                            [_vi("x", [1, k, 2, 2])], [_vi("y", None)], inits))
    alone.run(None, {"x": random_input((1, k, 2, 2))})
    plan = alone.last_plan
    _, scale, shift = elementwise._folded_batchnorm(plan, plan.steps[0], np.asarray, np.asarray)
    np.testing.assert_array_equal(np.diagonal(weight[:, :, 0, 0]), plan.template[scale])
    np.testing.assert_array_equal(bias, plan.template[shift])


def test_batchnorm_fold_can_be_disabled():
    ex = Executor(_conv_bn_model(), fold_batchnorm=False)
    assert ex.folded_batchnorms == []


# ---------------------------------------------------------------------------------------------
# tuned models (domain ai.convpass)


def test_annotated_model_runs_and_reports_decisions():
    base = conv_model("Conv", (1, 4, 8, 8), (6, 4, 3, 3), pads=[1, 1, 1, 1])
    decision = annotation.ConvDecision(
        algo="implicit_precomp_gemm", memory_format="NHWC", math_mode="fma", workspace_bytes=1024, time_ms=0.01,
        problem_key="fwd|n=1|c=4|k=6|in=8x8|ker=3x3|pad=1x1|str=1x1|dil=1x1|g=1|float32|nhwc|fma", source="measure",
    )
    model = annotated(base, {"conv": [decision]})
    onnx.checker.check_model(model, full_check=True)
    x = random_input((1, 4, 8, 8))
    ex = _compare(model, {"x": x})
    np.testing.assert_allclose(ex.run(None, {"x": x})[0], Executor(base).run(None, {"x": x})[0], rtol=0, atol=0)
    (s,) = ex.plan_summary()
    assert (s.node, s.op_type, s.tuned) == ("conv", "Conv", True)
    assert (s.algo, s.memory_format, s.math_mode, s.source) == ("implicit_precomp_gemm", "NHWC", "fma", "measure")
    assert s.problem + "|nhwc|fma" == s.recorded_problem_key
    assert ex.model_info is not None and ex.model_info.device.startswith("NVIDIA H200")
    assert "implicit_precomp_gemm" in ex.format_plan_summary()
    call = ex.last_plan.steps[0].node.prepared
    assert call.decision.algo == decision.algo and call.decision.problem_key == decision.problem_key and call.profile == 0


def test_annotated_model_picks_the_decision_of_the_matching_profile():
    base = conv_model("ConvTranspose", ["N", 4, 5, 5], (4, 3, 3, 3), strides=[2, 2])
    d1 = annotation.ConvDecision(algo="algo_1", memory_format="NCHW", math_mode="default", source="measure")
    d8 = annotation.ConvDecision(algo="fft_tiling", memory_format="NHWC", math_mode="fma", source="cache")
    profiles = [annotation.Profile("b1", {"x": (1, 4, 5, 5)}), annotation.Profile("b8", {"x": (8, 4, 5, 5)})]
    model = annotated(base, {"conv": [d1, d8]}, profiles)
    ex = Executor(model)
    before = ex.plan_summary()
    assert before[0].algo == "algo_1" and before[0].problem is None
    for batch, algo, profile in ((8, "fft_tiling", 1), (1, "algo_1", 0), (3, "auto", None)):
        x = random_input((batch, 4, 5, 5))
        np.testing.assert_allclose(ex.run(None, {"x": x})[0], run_ort(model, {"x": x})[0], **FP32)
        (s,) = ex.plan_summary()
        assert (s.algo, s.profile) == (algo, profile)
        assert s.problem.startswith(f"dgrad|n={batch}|c=3|k=4|")
    assert "no shape profile matches" in ex.plan_summary()[0].note
    assert len(ex.plans) == 3


# ---------------------------------------------------------------------------------------------
# sample models

SAMPLES = sorted(MODELS.glob("*.onnx"))


@pytest.mark.parametrize("path", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_sample_model_matches_ort(path: Path):
    model = onnx.load(path)
    ex = Executor(str(path))
    feeds = {}
    for i, arg in enumerate(ex.get_inputs()):
        shape = [d if isinstance(d, int) else 2 for d in arg.shape]
        feeds[arg.name] = random_input(shape, seed=10 + i) if arg.type == "tensor(float)" else np.zeros(shape, arg.dtype)
    got = ex.run(None, feeds)
    ref = run_ort(model, feeds)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, **FP32)
    assert len(ex.plan_summary()) == sum(n.op_type in ("Conv", "ConvTranspose") for n in model.graph.node)


def test_sample_models_present():
    if not SAMPLES:
        pytest.skip("models/*.onnx not built yet")
    assert {p.stem for p in SAMPLES} >= {"residual_cnn"}


# ---------------------------------------------------------------------------------------------
# op coverage beyond convs: torchvision-style subgraphs against ORT


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    """A model; outputs declared without a shape get the inferred type (the checker wants one)."""
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    inferred = {o.name: o.type for o in onnx.shape_inference.infer_shapes(model).graph.output}
    for o in model.graph.output:
        if not o.type.tensor_type.HasField("shape") and inferred[o.name].tensor_type.HasField("shape"):
            o.type.CopyFrom(inferred[o.name])
    return model


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _const(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def test_shape_subgraph_is_folded_per_signature():
    """torch.onnx's Shape -> Gather -> Unsqueeze -> Concat -> Reshape (flatten) runs as one Reshape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
        helper.make_node("Concat", ["n1", "m1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["flat"]),
        helper.make_node("Gemm", ["flat", "wg", "bg"], ["y"], transB=1),
    ]
    rng = np.random.default_rng(0)
    inits = [
        _const("i0", np.array(0, np.int64)),
        _const("ax0", np.array([0], np.int64)),
        _const("m1", np.array([-1], np.int64)),
        _const("wg", rng.standard_normal((5, 48)).astype(np.float32)),
        _const("bg", rng.standard_normal(5).astype(np.float32)),
    ]
    model = _model(nodes, [_vi("x", ["batch", 3, 4, 4])], [_vi("y", ["batch", 5])], inits)
    ex = Executor(model)
    for batch in (1, 3):
        x = random_input((batch, 3, 4, 4))
        np.testing.assert_allclose(ex.run(None, {"x": x})[0], run_ort(model, {"x": x})[0], **FP32)
        assert [s.node.op_type for s in ex.last_plan.steps] == ["Reshape", "Gemm"]
        assert ex.last_plan.folded_nodes == 4
    assert len(ex.plans) == 2


def _convnext_block(elem=TensorProto.FLOAT):
    """Depthwise 7x7 conv, permute, LayerNorm (decomposed as torch exports it), Linear, GELU (Erf), Linear, scale, residual."""
    dt = np.float16 if elem == TensorProto.FLOAT16 else np.float32
    rng = np.random.default_rng(1)
    c = 8
    inits = [
        _const("dw", (rng.standard_normal((c, 1, 7, 7)) * 0.2).astype(dt)),
        _const("db", rng.standard_normal(c).astype(dt)),
        _const("two", np.array(2.0, dt)),
        _const("eps", np.array(1e-6, dt)),
        _const("g", rng.uniform(0.5, 1.5, c).astype(dt)),
        _const("beta", rng.standard_normal(c).astype(dt)),
        _const("w1", (rng.standard_normal((c, 4 * c)) * 0.3).astype(dt)),
        _const("b1", rng.standard_normal(4 * c).astype(dt)),
        _const("sqrt2", np.array(math.sqrt(2), dt)),
        _const("one", np.array(1.0, dt)),
        _const("half", np.array(0.5, dt)),
        _const("w2", (rng.standard_normal((4 * c, c)) * 0.3).astype(dt)),
        _const("b2", rng.standard_normal(c).astype(dt)),
        _const("ls", rng.uniform(0.1, 0.2, (c, 1, 1)).astype(dt)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "dw", "db"], ["d"], group=c, pads=[3, 3, 3, 3], kernel_shape=[7, 7]),
        helper.make_node("Transpose", ["d"], ["t"], perm=[0, 2, 3, 1]),
        helper.make_node("ReduceMean", ["t"], ["mu"], axes=[-1]),
        helper.make_node("Sub", ["t", "mu"], ["xc"]),
        helper.make_node("Pow", ["xc", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["xc", "sd"], ["nrm"]),
        helper.make_node("Mul", ["nrm", "g"], ["ng"]),
        helper.make_node("Add", ["ng", "beta"], ["ln"]),
        helper.make_node("MatMul", ["ln", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h"]),
        helper.make_node("Div", ["h", "sqrt2"], ["hs"]),
        helper.make_node("Erf", ["hs"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["h", "e1"], ["he"]),
        helper.make_node("Mul", ["he", "half"], ["gelu"]),
        helper.make_node("MatMul", ["gelu", "w2"], ["o0"]),
        helper.make_node("Add", ["o0", "b2"], ["o"]),
        helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 3, 1, 2]),
        helper.make_node("Mul", ["ot", "ls"], ["os"]),
        helper.make_node("Add", ["x", "os"], ["y"]),
    ]
    return _model(nodes, [_vi("x", [1, c, 6, 6], elem)], [_vi("y", [1, c, 6, 6], elem)], inits)


def test_convnext_block_fp32():
    _compare(_convnext_block(), {"x": random_input((1, 8, 6, 6))})


def test_convnext_block_fp16():
    _compare(_convnext_block(TensorProto.FLOAT16), {"x": random_input((1, 8, 6, 6), TensorProto.FLOAT16)}, FP16)


def test_transformer_ops():
    """LayerNormalization, Gelu (opset 20), Softmax, Split, Concat, Where, Expand, Slice."""
    rng = np.random.default_rng(2)
    inits = [
        _const("g", rng.uniform(0.5, 1.5, 8).astype(np.float32)),
        _const("b", rng.standard_normal(8).astype(np.float32)),
        _const("split", np.array([3, 5], np.int64)),
        _const("zero", np.array(0.0, np.float32)),
        _const("shape", np.array([2, 4, 8], np.int64)),
        _const("st", np.array([1], np.int64)),
        _const("en", np.array([-1], np.int64)),
        _const("axs", np.array([1], np.int64)),
    ]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1, epsilon=1e-5),
        helper.make_node("Gelu", ["ln"], ["ge"], approximate="tanh"),
        helper.make_node("Gelu", ["ln"], ["gx"]),
        helper.make_node("Softmax", ["gx"], ["sm"], axis=-1),
        helper.make_node("Split", ["sm", "split"], ["s0", "s1"], axis=-1),
        helper.make_node("Concat", ["s1", "s0"], ["cat"], axis=-1),
        helper.make_node("Greater", ["cat", "zero"], ["pos"]),
        helper.make_node("Where", ["pos", "ge", "cat"], ["w"]),
        helper.make_node("Expand", ["w", "shape"], ["ex"]),
        helper.make_node("Slice", ["ex", "st", "en", "axs"], ["y"]),
    ]
    model = _model(nodes, [_vi("x", [1, 4, 8])], [_vi("y", None)], inits, opset=20)
    _compare(model, {"x": random_input((1, 4, 8))})


def test_pooling_and_head_ops():
    nodes = [
        helper.make_node("MaxPool", ["x"], ["mp"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("MaxPool", ["x"], ["mpc"], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
        helper.make_node("AveragePool", ["x"], ["ap"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1),
        helper.make_node("AveragePool", ["x"], ["ap2"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
        helper.make_node("GlobalAveragePool", ["x"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"], axis=1),
        helper.make_node("HardSigmoid", ["flat"], ["hsg"], alpha=1 / 6, beta=0.5),
        helper.make_node("HardSwish", ["flat"], ["hsw"]),
        helper.make_node("Clip", ["flat", "lo", "hi"], ["relu6"]),
        helper.make_node("Tanh", ["flat"], ["th"]),
        helper.make_node("Sigmoid", ["flat"], ["sg"]),
        helper.make_node("Sum", ["hsg", "hsw", "relu6", "th", "sg"], ["y"]),
    ]
    inits = [_const("lo", np.array(0, np.float32)), _const("hi", np.array(6, np.float32))]
    model = _model(nodes, [_vi("x", [2, 3, 9, 9])], [_vi(n, None) for n in ("mp", "mpc", "ap", "ap2", "y")], inits)
    _compare(model, {"x": random_input((2, 3, 9, 9)) * 4})


RESIZE_CASES = {
    "linear_half_pixel_scales": dict(mode="linear", scales=[1, 1, 2, 2]),
    "linear_align_corners_sizes": dict(mode="linear", coordinate_transformation_mode="align_corners", sizes=[1, 3, 11, 7]),
    "linear_pytorch_half_pixel_down": dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel", sizes=[1, 3, 3, 1]),
    "linear_asymmetric": dict(mode="linear", coordinate_transformation_mode="asymmetric", scales=[1, 1, 1.5, 2]),
    "nearest_asymmetric_floor": dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor", scales=[1, 1, 2, 2]),
    "nearest_half_pixel": dict(mode="nearest", sizes=[1, 3, 13, 9]),
    "nearest_round_prefer_ceil_down": dict(mode="nearest", nearest_mode="round_prefer_ceil", scales=[1, 1, 0.5, 0.75]),
    "cubic": dict(mode="cubic", scales=[1, 1, 2, 1.5]),
    "cubic_align_corners_exclude": dict(mode="cubic", coordinate_transformation_mode="align_corners", exclude_outside=1, sizes=[1, 3, 9, 5]),
    "linear_antialias_down": dict(mode="linear", antialias=1, sizes=[1, 3, 3, 2], opset=18),
}


@pytest.mark.parametrize("case", sorted(RESIZE_CASES))
def test_resize_matches_ort(case):
    attrs = dict(RESIZE_CASES[case])
    opset = attrs.pop("opset", 17)
    scales, sizes = attrs.pop("scales", None), attrs.pop("sizes", None)
    inits = [_const("roi", np.zeros(0, np.float32))]
    if scales is not None:
        inits.append(_const("scales", np.array(scales, np.float32)))
        inputs = ["x", "roi", "scales"]
    else:
        inits.append(_const("sizes", np.array(sizes, np.int64)))
        inputs = ["x", "roi", "", "sizes"]
    model = _model([helper.make_node("Resize", inputs, ["y"], **attrs)], [_vi("x", [1, 3, 6, 4])], [_vi("y", None)], inits, opset=opset)
    _compare(model, {"x": random_input((1, 3, 6, 4))})


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
def test_segmentation_head_resize_to_input_size(elem):
    """torch.onnx's F.interpolate(size=x.shape[-2:], mode="bilinear"): sizes computed from Shape, folded."""
    dt = np.float16 if elem == TensorProto.FLOAT16 else np.float32
    rng = np.random.default_rng(4)
    inits = [
        _const("w", (rng.standard_normal((5, 3, 3, 3)) * 0.3).astype(dt)),
        _const("s0", np.array([0], np.int64)),
        _const("s2", np.array([2], np.int64)),
        _const("s4", np.array([4], np.int64)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["f"], strides=[2, 2], pads=[1, 1, 1, 1], dilations=[1, 1]),
        helper.make_node("Shape", ["f"], ["fs"]),
        helper.make_node("Slice", ["fs", "s0", "s2"], ["nc"]),
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Slice", ["xs", "s2", "s4"], ["hw"]),
        helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["f", "", "", "sizes"], ["y"], mode="linear", coordinate_transformation_mode="pytorch_half_pixel", cubic_coeff_a=-0.75, nearest_mode="floor"),
    ]
    model = _model(nodes, [_vi("x", ["N", 3, "H", "W"], elem)], [_vi("y", ["N", 5, "H", "W"], elem)], inits)
    ex = Executor(model)
    for shape in ((1, 3, 9, 11), (2, 3, 8, 8)):
        x = random_input(shape, elem)
        got = ex.run(None, {"x": x})[0]
        assert got.shape == (shape[0], 5, *shape[2:]) and got.dtype == dt
        np.testing.assert_allclose(got.astype(np.float32), run_ort(model, {"x": x})[0].astype(np.float32), **(FP16 if dt == np.float16 else FP32))
        assert [s.node.op_type for s in ex.last_plan.steps] == ["Conv", "Resize"]


# ---------------------------------------------------------------------------------------------
# plans: caching, liveness


def test_plan_cache_and_liveness():
    path = MODELS / "mobile_block.onnx"
    if not path.exists():
        pytest.skip("models/mobile_block.onnx not built yet")
    ex = Executor(str(path))
    name = ex.get_inputs()[0].name
    assert ex.get_inputs()[0].shape[0] == "batch"
    a = ex.run(None, {name: random_input((1, 3, 32, 32))})[0]
    plan = ex.last_plan
    b = ex.run(None, {name: random_input((1, 3, 32, 32))})[0]
    assert ex.last_plan is plan and a.shape == b.shape
    ex.run(None, {name: random_input((2, 3, 32, 32))})
    assert len(ex.plans) == 2
    # every intermediate is released after its last reader; outputs are kept
    freed = {s for step in plan.steps for s in step.free}
    produced = {s for step in plan.steps for s in step.outputs if s >= 0}
    assert produced - freed == set(plan.output_slots)
    assert all(plan.value_info[s][0] for s in produced)


def test_output_subset_and_order():
    model = _model(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["b"]), helper.make_node("Abs", ["x"], ["c"])],
        [_vi("x", [2, 3])],
        [_vi("a", [2, 3]), _vi("b", [2, 3]), _vi("c", [2, 3])],
    )
    ex = Executor(model)
    x = random_input((2, 3))
    c, a = ex.run(["c", "a"], {"x": x})
    np.testing.assert_array_equal(c, np.abs(x))
    np.testing.assert_array_equal(a, np.maximum(x, 0))
    assert [s.node.op_type for s in ex.last_plan.steps] == ["Relu", "Abs"]


def test_constant_and_identity_outputs_are_copies():
    model = _model(
        [helper.make_node("Identity", ["x"], ["same"]), helper.make_node("Identity", ["k"], ["kk"])],
        [_vi("x", [2])],
        [_vi("same", [2]), _vi("kk", [2])],
        [_const("k", np.array([1.0, 2.0], np.float32))],
    )
    ex = Executor(model)
    x = np.array([3.0, 4.0], np.float32)
    for _ in range(2):
        same, kk = ex.run(None, {"x": x})
        same[0] = kk[0] = -1
    np.testing.assert_array_equal(x, [3.0, 4.0])
    np.testing.assert_array_equal(ex.run(["kk"], {"x": x})[0], [1.0, 2.0])


# ---------------------------------------------------------------------------------------------
# errors


def test_unsupported_ops_are_listed_all_at_once():
    nodes = [
        helper.make_node("Unique", ["x"], ["u"], name="uniq"),
        helper.make_node("Frobnicate", ["x"], ["f"], name="frob1", domain="com.example"),
        helper.make_node("Frobnicate", ["x"], ["g"], name="frob2", domain="com.example"),
        helper.make_node("Relu", ["x"], ["r"], name="fine"),
        helper.make_node("Cast", ["x"], ["bf"], name="to_bf16", to=TensorProto.BFLOAT16),
    ]
    graph = helper.make_graph(nodes, "g", [_vi("x", [4])], [_vi(n, [None]) for n in ("u", "f", "g", "r")] + [_vi("bf", [4], TensorProto.BFLOAT16)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)], ir_version=8)
    with pytest.raises(ExecutorError) as e:
        Executor(model)
    msg = str(e.value)
    for text in ("Unique (domain ai.onnx, opset 17)", "'uniq'", "Frobnicate (domain com.example, opset 1)", "'frob1'", "'frob2'", "BFLOAT16"):
        assert text in msg, msg
    assert "fine" not in msg
    report = check_support(model)
    assert len(report.unsupported_ops) == 2 and not report.ok


@pytest.fixture(scope="module")
def two_input_executor() -> Executor:
    model = _model(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [_vi("a", ["N", 3, 4]), _vi("b", ["N", 3, 4])],
        [_vi("y", ["N", 3, 4])],
    )
    return Executor(model)


@pytest.mark.parametrize(
    "feeds, expected",
    [
        ({"a": np.zeros((1, 3, 4), np.float32), "b": np.zeros((1, 3, 4), np.float32), "c": 1}, "unknown input name(s) 'c'; the model's inputs are: 'a' (tensor(float) [N, 3, 4]), 'b'"),
        ({"a": np.zeros((1, 3, 4), np.float32)}, "missing input(s) 'b'"),
        ({"a": np.zeros((1, 3, 4), np.float32), "b": np.zeros((1, 3), np.float32)}, "input 'b' has rank 2 (shape (1, 3)); the model expects rank 3"),
        ({"a": np.zeros((1, 3, 5), np.float32), "b": np.zeros((1, 3, 4), np.float32)}, "input 'a' dim 2 is 5; the model expects 4"),
        ({"a": np.zeros((1, 3, 4), np.float64), "b": np.zeros((1, 3, 4), np.float32)}, "input 'a' has dtype float64; the model expects float32 (tensor(float))"),
        ({"a": np.zeros((1, 3, 4), np.float32), "b": np.zeros((2, 3, 4), np.float32)}, "input 'b' dim 0 ('N') is 2, but input 'a' dim 0 ('N') is 1"),
    ],
    ids=["unknown", "missing", "rank", "dim", "dtype", "symbolic"],
)
def test_bad_feeds(two_input_executor, feeds, expected):
    with pytest.raises(ExecutorError) as e:
        two_input_executor.run(None, feeds)
    assert expected in str(e.value)


def test_bad_output_name_and_device(two_input_executor):
    feeds = {"a": np.zeros((1, 3, 4), np.float32), "b": np.zeros((1, 3, 4), np.float32)}
    with pytest.raises(ExecutorError, match="unknown output name.*'z'.*outputs are: 'y'"):
        two_input_executor.run(["z"], feeds)
    inputs = two_input_executor.get_inputs()
    assert [(a.name, a.shape, a.type) for a in inputs] == [("a", ["N", 3, 4], "tensor(float)"), ("b", ["N", 3, 4], "tensor(float)")]
    assert two_input_executor.get_outputs()[0].name == "y"


def test_cuda_device_without_backend_is_a_clear_error():
    from convpass.runtime import cuda_available

    if cuda_available():
        pytest.skip("a cuda backend is usable here")
    with pytest.raises(ExecutorError, match="cuda backend not available"):
        Executor(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), device="cuda")


def test_invalid_model_is_rejected(tmp_path):
    with pytest.raises(ExecutorError, match="model file not found"):
        Executor(str(tmp_path / "missing.onnx"))
    bad = _model([helper.make_node("Relu", ["nope"], ["y"])], [_vi("x", [1])], [_vi("y", [1])])
    with pytest.raises(ExecutorError, match="onnx.checker"):
        Executor(bad)


def test_runtime_shape_error_names_the_node():
    model = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="bad_reshape")], [_vi("x", [2, 3]), _vi("s", [2], TensorProto.INT64)], [_vi("y", None)])
    with pytest.raises(ExecutorError, match="bad_reshape"):
        Executor(model).run(None, {"x": np.zeros((2, 3), np.float32), "s": np.array([4, 4], np.int64)})


# ---------------------------------------------------------------------------------------------
# convpass run


def _run_cli(argv):
    import argparse

    from convpass.cli.run import add_run_parser

    parser = argparse.ArgumentParser(prog="convpass")
    add_run_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_run_saves_outputs(tmp_path, capsys):
    model = _model(
        [helper.make_node("Relu", ["x"], ["/head/out:0"]), helper.make_node("Neg", ["x"], ["neg"])],
        [_vi("x", [2, 3])],
        [_vi("/head/out:0", [2, 3]), _vi("neg", [2, 3])],
    )
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    x = random_input((2, 3))
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert _run_cli(["run", str(path), "--input", f"x={tmp_path / 'x.npy'}", "--output-dir", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "/head/out:0" in printed and "shape (2, 3)" in printed and "float32" in printed
    assert sorted(os.listdir(out)) == ["_head_out_0.npy", "neg.npy"]
    np.testing.assert_array_equal(np.load(out / "_head_out_0.npy"), np.maximum(x, 0))
    # a single-input model takes a bare FILE.npy
    assert _run_cli(["run", str(path), "-i", str(tmp_path / "x.npy")]) == 0


def test_cli_run_summary_says_whether_the_plan_is_one_cuda_graph(tmp_path, capsys):
    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    assert _run_cli(["run", str(path), "-i", str(tmp_path / "x.npy"), "--device", "cpu", "--summary"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # the CPU backend has no CUDA graphs: said so, before the conv table
    assert "CUDA graph: n/a (cpu backend)" in lines
    assert lines.index("CUDA graph: n/a (cpu backend)") < next(i for i, line in enumerate(lines) if line.startswith("node"))


def test_graph_status_before_and_after_a_run():
    ex = Executor(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)))
    assert ex.graph_status().captured is None and "no plan has run yet" in ex.graph_status().reason
    ex.run(None, {"x": random_input((1, 3, 8, 8))})
    status = ex.graph_status()
    assert status.captured is None and status.describe() == "CUDA graph: n/a (cpu backend)"


def test_cli_run_errors(tmp_path):
    from convpass.core.errors import ConvpassError

    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    np.save(tmp_path / "x64.npy", np.zeros((1, 3, 8, 8)))
    with pytest.raises(ConvpassError, match="dtype float64"):
        _run_cli(["run", str(path), "--input", f"x={tmp_path / 'x64.npy'}"])
    with pytest.raises(ConvpassError, match="file not found"):
        _run_cli(["run", str(path), "--input", f"x={tmp_path / 'nope.npy'}"])
    with pytest.raises(ConvpassError, match="holds no array named 'x'"):
        np.savez(tmp_path / "two.npz", a=np.zeros((1, 3, 8, 8), np.float32), b=np.zeros((1, 3, 8, 8), np.float32))
        _run_cli(["run", str(path), "--input", f"x={tmp_path / 'two.npz'}"])


# ---------------------------------------------------------------------------------------------
# onnx backend API


def test_onnx_backend_api():
    from convpass.runtime.onnx_backend import ConvpassBackend

    assert ConvpassBackend.supports_device("CPU")
    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1])
    x = random_input((1, 3, 8, 8))
    rep = ConvpassBackend.prepare(model, "CPU")
    (y,) = rep.run([x])
    np.testing.assert_allclose(y, run_ort(model, {"x": x})[0], **FP32)
    np.testing.assert_allclose(rep.run({"x": x}).out, y)
    node = helper.make_node("LeakyRelu", ["a"], ["b"], alpha=0.2)
    (b,) = ConvpassBackend.run_node(node, [np.array([-1.0, 2.0], np.float32)])
    np.testing.assert_allclose(b, [-0.2, 2.0], rtol=1e-6)
    assert ConvpassBackend.is_compatible(model)


def test_prepare_builds_the_plan_the_first_run_reuses():
    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3))
    x = random_input((1, 3, 8, 8))
    ex = Executor(model)
    plan = ex.prepare({"x": x})
    assert len(ex.plans) == 1
    (y,) = ex.run(None, {"x": x})
    assert ex.plans == [plan] and ex.last_plan is plan
    np.testing.assert_allclose(y, run_ort(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert ex.prepare({"x": x}) is plan  # prepared already: nothing is rebuilt
    with pytest.raises(ExecutorError):
        ex.prepare({"x": x[:, :2]})


def test_plan_summary_names_an_engine_beside_a_legacy_epilogue_or_a_malformed_one():
    """The summary's algorithm name never fails: a legacy epilogue beside an engine is the fused
    graph it runs, part of its name, and an engine or fusion text that does not parse is shown as
    recorded (building the conv warns)."""
    from convpass.runtime.summaries import _engine_algo

    assert _engine_algo("eng99999", "bias+relu") == "engine:eng99999+bias+relu"
    assert _engine_algo("eng99999", "bias+gelu") == "eng99999"
    assert _engine_algo("eng5_k2=1", "bias+swish") == "engine:eng5_k2=1+bias+swish"
    assert _engine_algo("not-an-engine") == "not-an-engine"


def test_a_plan_the_backend_replays_runs_outside_errstate():
    """A plan the backend can replay without host work (a captured CUDA graph) is run by
    ``Backend.replay`` and never enters ``errstate`` (on the cuda backend: the matmul math switch, a
    host cost larger than a batch-1 replay); the plan's first run, and any plan the backend does not
    replay, runs inside it."""
    from convpass.kernels.backends import CpuBackend

    class Replaying(CpuBackend):
        def __init__(self):
            super().__init__()
            self.scopes, self.replayed = 0, 0
            self.replays = False

        def errstate(self):
            self.scopes += 1
            return super().errstate()

        def replay(self, plan, feeds):
            if not self.replays:
                return None
            self.replayed += 1
            return ["replayed"]

    model = conv_model("Conv", [1, 3, 8, 8], [4, 3, 3, 3])
    backend = Replaying()
    ex = Executor(model, device=backend)
    x = random_input([1, 3, 8, 8])
    first = ex.run(None, {"x": x})
    assert backend.scopes == 1  # the plan is built inside it (nothing compiled: the recording run is the plan's)
    np.testing.assert_allclose(ex.run(None, {"x": x})[0], first[0])
    assert backend.scopes == 2 and backend.replayed == 0  # not replayable: run inside it
    backend.replays = True
    assert ex.run(None, {"x": x}) == ["replayed"] and backend.scopes == 2 and backend.replayed == 1


@pytest.mark.parametrize("compiles", [True, False])
def test_the_first_run_returns_what_the_plan_computes_not_the_recording_run(compiles):
    """Building a plan runs the graph op by op once; where the backend compiles the plan (the GPU:
    fused epilogues and engines as recorded) the results a first run returns are the compiled
    plan's (its warm-up), so that every run of a signature computes the same thing, the first
    included; where it compiles nothing, the recording run was the plan's steps, returned as they are."""
    from convpass.kernels.backends import CpuBackend

    class Replaying(CpuBackend):
        def compile_plan(self, plan):
            plan.backend_state = "compiled" if compiles else None

        def replay(self, plan, feeds):
            return ["the plan's"]

    ex = Executor(conv_model("Conv", [1, 3, 8, 8], [4, 3, 3, 3]), device=Replaying())
    x = random_input([1, 3, 8, 8])
    first = ex.run(None, {"x": x})
    assert (first == ["the plan's"]) if compiles else isinstance(first[0], np.ndarray)
    assert ex.run(None, {"x": x}) == ["the plan's"]


def test_open_ahead_waits_for_nothing_on_the_host_and_never_raises(monkeypatch):
    """The executor starts a GPU's set-up on a helper thread before it reads the model; on the host
    there is nothing to start, and a GPU that cannot be set up is said where the backend is made."""
    import threading

    from convpass.kernels.backends import host_backend
    from convpass.native import cuda as native_cuda
    from convpass.runtime import devices

    before = threading.active_count()
    assert devices.open_ahead("cpu")() is None and devices.open_ahead(host_backend())() is None
    assert threading.active_count() == before
    monkeypatch.setattr(native_cuda, "_probe", lambda: "no CUDA GPU is visible")
    monkeypatch.setattr(native_cuda, "_reason_cache", [])
    wait = devices.open_ahead("cuda:3")
    assert wait() is None  # the helper found no GPU and stopped, saying nothing
    with pytest.raises(ExecutorError, match="cuda backend not available: no CUDA GPU is visible"):
        Executor(MODELS / "residual_cnn.onnx", device="cuda")


def test_a_model_whose_initializer_holds_too_few_bytes_is_refused_checker_or_not(tmp_path):
    m = onnx.load(MODELS / "residual_cnn.onnx")
    t = m.graph.initializer[0]
    t.raw_data = t.raw_data[:-4]  # truncated
    path = tmp_path / "bad.onnx"
    onnx.save(m, path)
    for check_model in (True, False):  # the size check is no part of the checker one may turn off
        with pytest.raises(ExecutorError, match=rf"initializer {t.name!r} declares dims \[16, 3, 3, 3\] \(1,728 bytes\) but holds 1,724 bytes"):
            Executor(path, check_model=check_model)

"""Conv weights computed in the graph from initializers only are folded at optimize and tuned.

Each pattern is built as exporters write it (with onnx.helper: torch is not a test dependency):
weight standardization through ReduceMean / Sub / Div / Sqrt and through a BatchNormalization
applied to the weight (BiT's StdConv2d, also exactly as torch's TorchScript exporter writes it, and
then checked against the float64 value of the ONNX spec), weight normalization (wav2vec2's positional conv), NF-Net's
scaled weight standardization, and Reshape / Transpose / Cast / DequantizeLinear chains. Each conv
must come out with a problem key (canonicalized, collected, annotated) and no warning, ONNX Runtime
must give the tuned model the original's outputs, and the weight the compiler folds must be the
very array the executor folds from the original model.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import random_input, run_ort
from onnx import TensorProto, helper, numpy_helper

import convpass
from convpass.compiler.passes import fold_conv_weights
from convpass.compiler.passes.fold_conv_weights import FoldConvWeightsPass
from convpass.compiler.passes.resolve_shapes import SKIP_KEY
from convpass.core import annotation
from convpass.core.model_io import load_model
from convpass.runtime import Executor

N = helper.make_node
RNG = np.random.default_rng(7)
EPS = 1e-5


class _Graph:
    """A model under construction: initializers, nodes, one input ``x`` and one output ``y``."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def ints(self, name: str, values: list[int]) -> str:
        return self.init(name, np.array(values, np.int64))

    def scalar(self, name: str, value: float) -> str:
        """A float32 scalar as a Constant node, as exporters write literals."""
        self.nodes.append(N("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.float32))))
        return name

    def op(self, op_type: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(N(op_type, inputs, [output], name=output, **attrs))
        return output

    def model(self, x_shape: tuple[int, ...], y_shape: tuple[int, ...], opset: int, inputs=(), domains=()) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape)), *inputs],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))], self.inits)
        opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in domains)]
        model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
        onnx.checker.check_model(model, full_check=not domains)
        return model


def _weight(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.2 + 0.05).astype(np.float32)


def weight_standardized() -> onnx.ModelProto:
    """BiT's StdConv2d as torch's var_mean exports it: (w - mean) / sqrt(var + eps), two convs."""
    g = _Graph()
    axes = g.ints("axes", [1, 2, 3])
    eps = g.scalar("eps", EPS)
    x = "x"
    for i, (k, c) in enumerate(((8, 4), (6, 8))):
        w = g.init(f"w{i}", _weight(k, c, 3, 3))
        mean = g.op("ReduceMean", [w, axes], f"mean{i}", keepdims=1)
        d = g.op("Sub", [w, mean], f"d{i}")
        var = g.op("ReduceMean", [g.op("Mul", [d, d], f"sq{i}"), axes], f"var{i}", keepdims=1)
        std = g.op("Sqrt", [g.op("Add", [var, eps], f"ve{i}")], f"std{i}")
        ws = g.op("Div", [d, std], f"ws{i}")
        x = g.op("Relu", [g.op("Conv", [x, ws], f"conv{i}", pads=[1, 1, 1, 1])], "y" if i else f"r{i}")
    return g.model((2, 4, 10, 10), (2, 6, 10, 10), opset=18)


def weight_standardized_by_batchnorm() -> onnx.ModelProto:
    """timm's StdConv2d as torch exports it: a training-mode BatchNormalization over the weight seen
    as 1 x K x fan_in (its running-stat outputs unused), reshaped back with Shape(w)."""
    g = _Graph()
    k, c = 8, 4
    w = g.init("w", _weight(k, c, 3, 3))
    flat = g.op("Reshape", [w, g.ints("flat_shape", [1, k, -1])], "flat")
    params = [g.init(n, np.full(k, v, np.float32)) for n, v in (("ones", 1.0), ("zeros", 0.0), ("rmean", 0.0), ("rvar", 1.0))]
    g.nodes.append(N("BatchNormalization", [flat, *params], ["normed", "run_mean", "run_var"], name="bn_w",
                     epsilon=EPS, momentum=1.0, training_mode=1))
    ws = g.op("Reshape", ["normed", g.op("Shape", [w], "w_shape")], "ws")
    g.op("Conv", ["x", ws, g.init("b", RNG.standard_normal(k).astype(np.float32))], "y", pads=[1, 1, 1, 1], strides=[2, 2])
    return g.model((2, 4, 12, 12), (2, 8, 6, 6), opset=15)


def _std_conv_weight(g: _Graph, w: np.ndarray, eps: float, p: str = "") -> str:
    """timm's StdConv2d weight as the TorchScript exporter writes it (opset 17): ``F.batch_norm(w.reshape(1,
    K, -1), None, None, training=True, momentum=0., eps)`` becomes a training-mode BatchNormalization
    (momentum 1 - 0) whose absent running statistics the exporter computes from the input itself
    (``_var_mean`` over its transpose, no correction), over the weight folded by torch to ``1 x K x
    fan_in`` (and a second, transposed copy), reshaped back to the weight's shape."""
    k = w.shape[0]
    flat = w.reshape(1, k, -1)
    flat_name = g.init(f"{p}flat", flat)
    flat_t = g.init(f"{p}flat_t", np.ascontiguousarray(flat.transpose(0, 2, 1)))
    g.nodes.append(N("Constant", [], [f"{p}ones"], value=numpy_helper.from_array(np.ones(k, np.float32))))
    g.nodes.append(N("Constant", [], [f"{p}zeros"], value=numpy_helper.from_array(np.zeros(k, np.float32))))
    run_mean = g.op("ReduceMean", [flat_t], f"{p}rmean", axes=[0, 1], keepdims=0)
    d = g.op("Sub", [flat_t, g.op("ReduceMean", [flat_t], f"{p}tmean", axes=[0, 1], keepdims=1)], f"{p}d")
    run_var = g.op("ReduceMean", [g.op("Mul", [d, d], f"{p}sq")], f"{p}rvar", axes=[0, 1], keepdims=0)
    g.nodes.append(N("BatchNormalization", [flat_name, f"{p}ones", f"{p}zeros", run_mean, run_var], [f"{p}normed", f"{p}bn1", f"{p}bn2"],
                     name=f"{p}bn_w", epsilon=eps, momentum=1.0, training_mode=1))
    return g.op("Reshape", [f"{p}normed", g.ints(f"{p}w_shape", list(w.shape))], f"{p}ws")


def weight_standardized_as_exported() -> onnx.ModelProto:
    """BiT's StdConv2d (eps 1e-8) as ``torch.onnx.export(..., dynamo=False, opset_version=17)``
    writes it (:func:`_std_conv_weight`), two convs."""
    g = _Graph()
    x = "x"
    for i, (k, c) in enumerate(((8, 4), (6, 8))):
        ws = _std_conv_weight(g, _weight(k, c, 3, 3), 1e-8, f"c{i}_")
        x = g.op("Relu", [g.op("Conv", [x, ws], f"conv{i}", pads=[1, 1, 1, 1])], "y" if i else f"r{i}")
    return g.model((2, 4, 10, 10), (2, 6, 10, 10), opset=17)


def weight_normalized() -> onnx.ModelProto:
    """wav2vec2's positional conv: weight_norm(dim=2) of a grouped 1-D conv, g * v / ||v|| with
    the norm over every axis but 2 (ReduceL2), the bias an initializer."""
    g = _Graph()
    k, groups, width = 16, 4, 9
    v = g.init("v", _weight(k, k // groups, width))
    gain = g.init("g", RNG.uniform(0.5, 2.0, (1, 1, width)).astype(np.float32))
    norm = g.op("ReduceL2", [v, g.ints("axes", [0, 1])], "norm", keepdims=1)
    w = g.op("Mul", [g.op("Div", [v, norm], "direction"), gain], "w")
    g.op("Conv", ["x", w, g.init("b", RNG.standard_normal(k).astype(np.float32))], "y", group=groups, pads=[4, 4])
    return g.model((2, k, 40), (2, k, 40), opset=18)


def scaled_weight_standardized() -> onnx.ModelProto:
    """NF-Net's ScaledStdConv2d: gain * (w - mean) / (std * sqrt(fan_in)), the std with its eps."""
    g = _Graph()
    k, c = 12, 6
    w = g.init("w", _weight(k, c, 3, 3))
    axes = g.ints("axes", [1, 2, 3])
    mean = g.op("ReduceMean", [w, axes], "mean", keepdims=1)
    d = g.op("Sub", [w, mean], "d")
    var = g.op("ReduceMean", [g.op("Pow", [d, g.scalar("two", 2.0)], "sq"), axes], "var", keepdims=1)
    std = g.op("Sqrt", [g.op("Add", [var, g.scalar("eps", 1e-4)], "ve")], "std")
    denominator = g.op("Mul", [std, g.scalar("sqrt_fan_in", float(np.sqrt(c * 9)))], "den")
    ws = g.op("Mul", [g.init("gain", RNG.uniform(0.5, 1.5, (k, 1, 1, 1)).astype(np.float32)), g.op("Div", [d, denominator], "q")], "ws")
    g.op("Conv", ["x", ws], "y", pads=[1, 1, 1, 1])
    return g.model((1, c, 9, 9), (1, k, 9, 9), opset=18)


def reshape_transpose_cast() -> onnx.ModelProto:
    """A weight stored float16 as kh x kw x C x K (Cast, Transpose, Identity, Reshape), its bias a
    Constant times a scale; then a conv whose weight is int8, dequantized per output channel."""
    g = _Graph()
    k, c = 8, 4
    hwck = g.init("w_hwck", _weight(3, 3, c, k).astype(np.float16))
    w32 = g.op("Cast", [hwck], "w32", to=TensorProto.FLOAT)
    kchw = g.op("Transpose", [w32], "kchw", perm=[3, 2, 0, 1])
    w = g.op("Reshape", [g.op("Identity", [kchw], "kchw_i"), g.ints("shape", [k, c, 3, 3])], "w")
    g.nodes.append(N("Constant", [], ["b_raw"], value=numpy_helper.from_array(RNG.standard_normal(k).astype(np.float32))))
    b = g.op("Mul", ["b_raw", g.scalar("b_scale", 0.5)], "b")
    h = g.op("Conv", ["x", w, b], "h", pads=[1, 1, 1, 1])
    q = np.clip(np.round(_weight(k, k, 1, 1) / 0.01), -127, 127).astype(np.int8)
    scale = g.init("q_scale", RNG.uniform(0.005, 0.02, k).astype(np.float32))
    wq = g.op("DequantizeLinear", [g.init("wq", q), scale, g.init("q_zero", np.zeros(k, np.int8))], "w2", axis=0)
    g.op("Conv", [h, wq], "y")
    return g.model((1, c, 7, 7), (1, k, 7, 7), opset=13)


PATTERNS = {
    "weight_standardized": weight_standardized,
    "weight_standardized_by_batchnorm": weight_standardized_by_batchnorm,
    "weight_standardized_as_exported": weight_standardized_as_exported,
    "weight_normalized": weight_normalized,
    "scaled_weight_standardized": scaled_weight_standardized,
    "reshape_transpose_cast": reshape_transpose_cast,
}


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    x = model.graph.input[0]
    return {"x": random_input([d.dim_value for d in x.type.tensor_type.shape.dim])}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_computed_weights_are_folded_tuned_and_run_the_same(pattern, caplog):
    model = PATTERNS[pattern]()
    with caplog.at_level(logging.WARNING, logger="convpass"):
        tuned = convpass.optimize(model, quiet=True)
    assert "untuned" not in caplog.text and "run time" not in caplog.text
    convs = [n for n in tuned.graph.node if annotation.standard_op_type(n) in annotation.CONV_OPS]
    assert convs and all(n.domain == annotation.DOMAIN for n in convs), "every conv annotated"
    initializers = {t.name for t in tuned.graph.initializer}
    assert all(n.input[1] in initializers for n in convs), "every weight a constant"
    records = convpass.inspect(tuned)
    assert len(records) == len(convs) and all(r["problem_key"] for r in records), records
    assert {annotation.standard_op_type(n) for n in tuned.graph.node} <= {"Relu", *annotation.CONV_OPS}, "the weight subgraphs are gone"
    feeds = _feeds(model)
    for want, got in zip(run_ort(model, feeds), run_ort(tuned, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_compiler_and_executor_fold_the_same_weights(pattern):
    """The initializer the compiler writes is bit for bit the constant the executor computes when
    it loads the original model (one implementation: convpass.ops.constant_folding)."""
    original = PATTERNS[pattern]()
    ir_model = load_model(original)
    convs = [n.name for n in ir_model.graph if n.op_type == "Conv"]
    FoldConvWeightsPass()(ir_model)
    executor = Executor(original, fold_batchnorm=False)
    by_name = {n.name: n for n in executor._nodes}
    compared = 0
    for node in ir_model.graph:
        if node.name not in convs:
            continue
        for index, value in enumerate(node.inputs[1:], start=1):
            if value is None or not value.name.endswith("__folded"):
                continue
            computed = executor._constants[by_name[node.name].inputs[index]]
            folded = value.const_value.numpy()
            assert folded.dtype == computed.dtype and folded.shape == computed.shape
            assert np.array_equal(folded, computed), f"{node.name} input {index}"
            compared += 1
    assert compared >= len(convs)


def test_the_executor_runs_the_original_as_ort_does():
    """The executor folds the same subgraphs at load: its outputs on the original models match ORT."""
    for make in PATTERNS.values():
        model = make()
        feeds = _feeds(model)
        (want,) = run_ort(model, feeds)
        (got,) = Executor(model).run(None, feeds)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def _standardized64(w: np.ndarray, eps: float) -> np.ndarray:
    """BatchNormalization in training mode over ``w`` seen as ``1 x K x fan_in``, per the ONNX spec in
    float64: the batch's mean and its population (biased) variance, ``epsilon`` as the float32 attribute holds it."""
    f = w.astype(np.float64).reshape(w.shape[0], -1)
    mean = f.mean(axis=1, keepdims=True)
    var = ((f - mean) ** 2).mean(axis=1, keepdims=True)
    return ((f - mean) / np.sqrt(var + float(np.float32(eps)))).reshape(w.shape)


# BiT's convs (3x3 of fan-in 576, the 7x7 stem, a wide 1x1); per-channel means; a weight whose
# variance is eps's size (eps then changes the result by a third); a zero weight (zero_init_last)
STD_CONV_CASES = {
    "3x3_576": ((64, 64, 3, 3), 0.05, 0.02), "stem_7x7": ((64, 3, 7, 7), 0.05, 0.02), "1x1_1024": ((256, 1024, 1, 1), 0.03, 0.01),
    "var_near_eps": ((16, 16, 3, 3), 1e-4, 0.0), "zero": ((32, 16, 3, 3), 0.0, 0.0),
}


@pytest.mark.parametrize("eps", [1e-8, 1e-6], ids=["bit_eps", "timm_default_eps"])
@pytest.mark.parametrize("case", STD_CONV_CASES)
def test_the_exported_weight_standardization_folds_to_the_spec_value(case, eps):
    """The folded weight of timm's StdConv2d as torch exports it is the float64 value the ONNX spec
    gives, within float32 rounding (max-abs-relative 1e-6; the sample variance instead of the
    population one would be 1 / (2 (fan_in - 1)) off: 8.7e-4 at fan-in 576), and so is ONNX
    Runtime CPU's, the reference the precision work measures against (docs/precision.md)."""
    shape, std, channel_std = STD_CONV_CASES[case]
    rng = np.random.default_rng(3)
    w = (rng.standard_normal(shape) * std + rng.standard_normal((shape[0], 1, 1, 1)) * channel_std).astype(np.float32)
    g = _Graph()
    g.op("Conv", ["x", _std_conv_weight(g, w, eps)], "y", pads=[shape[2] // 2] * 4)
    model = g.model((1, shape[1], 5, 5), (1, shape[0], 5, 5), opset=17)
    ir_model = load_model(model)
    FoldConvWeightsPass()(ir_model)
    (conv,) = [n for n in ir_model.graph if n.op_type == "Conv"]
    folded = conv.inputs[1].const_value.numpy()
    want = _standardized64(w, eps)
    model.graph.output.append(helper.make_tensor_value_info("ws", TensorProto.FLOAT, list(shape)))
    _, by_ort = run_ort(model, {"x": np.zeros((1, shape[1], 5, 5), np.float32)})
    scale = max(float(np.abs(want).max()), 1e-30)
    assert np.isfinite(folded).all() and folded.dtype == np.float32
    assert float(np.abs(folded - want).max()) / scale <= 1e-6
    assert float(np.abs(by_ort - want).max()) / scale <= 1e-6
    if case == "zero":
        assert not folded.any()


def test_a_shared_computed_weight_is_folded_once():
    g = _Graph()
    w = g.op("Transpose", [g.init("w_t", _weight(4, 4, 3, 3))], "w", perm=[1, 0, 2, 3])
    h = g.op("Conv", ["x", w], "h", pads=[1, 1, 1, 1])
    g.op("Conv", [h, w], "y", pads=[1, 1, 1, 1])
    model = load_model(g.model((1, 4, 6, 6), (1, 4, 6, 6), opset=17))
    FoldConvWeightsPass()(model)
    first, second = (n for n in model.graph if n.op_type == "Conv")
    assert first.inputs[1] is second.inputs[1] and first.inputs[1].is_initializer()
    assert list(model.graph.initializers) == ["w__folded"], "the transposed source is dropped"


def test_a_weight_from_an_input_names_the_input():
    g = _Graph()
    w = g.op("Mul", ["scale_in", g.init("w0", _weight(4, 3, 3, 3))], "w")
    g.op("Conv", ["x", w], "y")
    model = g.model((1, 3, 6, 6), (1, 4, 4, 4), opset=17, inputs=[helper.make_tensor_value_info("scale_in", TensorProto.FLOAT, [1])])
    ir_model = load_model(model)
    FoldConvWeightsPass()(ir_model)
    (conv,) = [n for n in ir_model.graph if n.op_type == "Conv"]
    assert conv.meta[SKIP_KEY] == "its weight 'w' is computed from the graph input 'scale_in' without an initializer (known only at run time)"


def test_a_weight_by_an_op_convpass_lacks_is_left_untuned_with_the_reason(caplog):
    g = _Graph()
    w = g.op("Transpose", [g.init("w0", _weight(3, 4, 3, 3))], "wt", perm=[1, 0, 2, 3])
    g.nodes.append(N("Custom", [w], ["w"], name="custom", domain="example.ops"))
    g.op("Conv", ["x", "w"], "y")
    model = g.model((1, 3, 6, 6), (1, 4, 4, 4), opset=17, domains=["example.ops"])
    ir_model = load_model(model)
    with caplog.at_level(logging.WARNING, logger="convpass"):
        FoldConvWeightsPass()(ir_model)
    (conv,) = [n for n in ir_model.graph if n.op_type == "Conv"]
    assert conv.meta[SKIP_KEY] == "its weight 'w' is computed by Custom (domain example.ops) node 'custom', which convpass cannot evaluate ahead of time"
    assert "left untuned" in caplog.text


def test_a_weight_much_larger_than_its_sources_is_folded_with_a_note(monkeypatch):
    """Expand of a small tensor into a conv's weight: tuning needs it, so it folds, and the report
    says how much the model grew."""
    monkeypatch.setattr(fold_conv_weights, "GROWTH_BYTES", 1024)
    g = _Graph()
    w = g.op("Expand", [g.init("w_row", _weight(1, 16, 3, 3)), g.ints("shape", [32, 16, 3, 3])], "w")
    g.op("Conv", ["x", w], "y", pads=[1, 1, 1, 1])
    model = load_model(g.model((1, 16, 5, 5), (1, 32, 5, 5), opset=17))
    fold = FoldConvWeightsPass()
    fold(model)
    (note,) = fold.notes
    assert note.startswith("Conv 'y': its weight 'w' was folded to a constant of 0.0 MiB") and "grew" in note
    assert [n.op_type for n in model.graph] == ["Conv"]


def test_ir_model_keeps_other_constant_expressions():
    """Only what feeds a conv's weight or bias folds: a constant Expand that a non-conv reads stays
    an Expand (the model does not grow by its output)."""
    g = _Graph()
    w = g.op("Transpose", [g.init("w_t", _weight(4, 3, 3, 3))], "w", perm=[0, 1, 2, 3])
    h = g.op("Conv", ["x", w], "h", pads=[1, 1, 1, 1])
    big = g.op("Expand", [g.init("one", np.ones((1, 1, 1, 1), np.float32)), g.ints("big_shape", [1, 4, 6, 6])], "big")
    g.op("Add", [h, big], "y")
    model = load_model(g.model((1, 3, 6, 6), (1, 4, 6, 6), opset=17))
    FoldConvWeightsPass()(model)
    assert [n.op_type for n in model.graph] == ["Conv", "Expand", "Add"]
    assert ir.DataType.FLOAT == model.graph.initializers["w__folded"].dtype

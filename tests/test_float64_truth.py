"""The float64 truth of a model (convpass.compiler.precision.float64) and ``local_errors.py --truth f64``:
the rewrite leaves no float32 value, the truth is float64 arithmetic (NumPy float64 and ONNX Runtime's
float64 kernels agree with it to 1e-12), float32 ONNX Runtime is a float32-sized distance from it, and
a node computed off shows against it."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import benchmark_script
from onnx import TensorProto, helper, numpy_helper
from test_local_errors_benchmark import bit_block, skewed_conv_setup

from convpass.compiler.precision.float64 import FLOAT_TYPES, float64_outputs, relative_errors, to_float64
from convpass.core.errors import ConvpassError

N = helper.make_node


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _float_values(model: onnx.ModelProto) -> list[str]:
    """Every float32 / float16 / bfloat16 value left in ``model``: tensors, types, Cast targets."""
    g = model.graph
    left = [t.name for t in g.initializer if t.data_type in FLOAT_TYPES]
    left += [vi.name for vi in (*g.input, *g.output, *g.value_info) if vi.type.tensor_type.elem_type in FLOAT_TYPES]
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type in FLOAT_TYPES:
                left.append(f"{n.name}.{a.name}")
            if a.name in ("value_float", "value_floats") or (n.op_type == "Cast" and a.i in FLOAT_TYPES):
                left.append(f"{n.name}.{a.name}")
    return left


def mlp() -> onnx.ModelProto:
    """Ops ONNX Runtime's CPU provider runs in float64 too: MatMul, Add, a layer norm written out
    (ReduceMean, Sub, Mul, Sqrt, Div), Softmax; a Constant ``value_float``, a ConstantOfShape and a Cast."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((32, 64)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "b")
    nodes = [N("MatMul", ["x", "w"], ["xw"], name="mm"), N("Add", ["xw", "b"], ["h"], name="add"),
             N("ReduceMean", ["h"], ["m"], axes=[-1], name="mean"), N("Sub", ["h", "m"], ["d"], name="sub"),
             N("Mul", ["d", "d"], ["d2"], name="sq"), N("ReduceMean", ["d2"], ["v"], axes=[-1], name="var"),
             N("Constant", [], ["eps"], value_float=1e-5, name="eps"), N("Add", ["v", "eps"], ["ve"], name="add_eps"),
             N("Sqrt", ["ve"], ["s"], name="sqrt"), N("Div", ["d", "s"], ["z"], name="div"),
             N("Shape", ["z"], ["zs"], name="shape"), N("ConstantOfShape", ["zs"], ["half"], name="half",
                                                        value=numpy_helper.from_array(np.array([0.5], np.float32))),
             N("Mul", ["z", "half"], ["zh"], name="scale"), N("Cast", ["zh"], ["zc"], to=TensorProto.FLOAT, name="cast"),
             N("Softmax", ["zc"], ["y"], axis=-1, name="softmax")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])], [w, b],
                              value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT, ["n", 64])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def bit_block_float64(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """tests/test_local_errors_benchmark.py's bit_block written out in NumPy float64 from its initializers."""
    le = benchmark_script("local_errors")
    p = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}

    def std_weight(prefix: str) -> np.ndarray:
        flat = p[f"{prefix}flat"]
        eps = float(np.float32(1e-8))
        w = (flat - flat.mean(-1, keepdims=True)) / np.sqrt(flat.var(-1, keepdims=True) + eps)
        return w.reshape(p[f"{prefix}w_shape"].astype(int))

    def gn(v: np.ndarray, name: str) -> np.ndarray:
        return le.group_norm64(v, 4, float(np.float32(1e-5)), p[f"{name}_gamma"], p[f"{name}_beta"], relu=False)

    t = gn(x, "n1")
    h = le.conv64(t, std_weight("c1_"), None, {})
    y2 = le.conv64(gn(h, "n2"), std_weight("c2_"), p["b2"], {"pads": [1, 1, 1, 1], "strides": [2, 2]})
    return y2 + le.conv64(t, std_weight("sc_"), None, {"strides": [2, 2]})


def test_the_rewrite_leaves_no_float32_value_and_checks():
    m64 = to_float64(mlp())
    assert _float_values(mlp()), "the check finds the float32 values of the original"
    assert _float_values(m64) == []
    onnx.checker.check_model(m64, full_check=True)


def test_the_truth_is_float64_arithmetic_where_onnx_runtime_can_check_it():
    """On ops ONNX Runtime runs in float64, its float64 outputs and the truth agree to 1e-13, and
    float32 ONNX Runtime is a float32-sized distance from both."""
    model = mlp()
    x = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
    (truth,) = float64_outputs(model, [{"x": x}])
    assert truth[0].dtype == np.float64
    ort64 = _ort(to_float64(model), {"x": x.astype(np.float64)})
    assert relative_errors([ort64], [truth])["max-rel"] < 1e-13
    e32 = relative_errors([_ort(model, {"x": x})], [truth])["max-rel"]
    assert 1e-9 < e32 < 1e-5, e32


def test_resize_scales_stay_float32():
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    graph = helper.make_graph([N("Resize", ["x", "", "scales"], ["y"], mode="linear", name="up")], "r",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])], [scales])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    m64 = to_float64(model)
    onnx.checker.check_model(m64, full_check=True)
    (resize,) = [n for n in m64.graph.node if n.op_type == "Resize"]
    (cast,) = [n for n in m64.graph.node if n.op_type == "Cast"]
    assert cast.output[0] == resize.input[2] and helper.get_attribute_value(cast.attribute[0]) == TensorProto.FLOAT
    x = np.random.default_rng(0).standard_normal((1, 2, 3, 3)).astype(np.float32)
    (truth,) = float64_outputs(model, [{"x": x}])
    assert truth[0].dtype == np.float64 and relative_errors([_ort(model, {"x": x})], [truth])["max-rel"] < 1e-6


def test_the_truth_of_a_conv_groupnorm_block_is_numpy_float64_and_onnx_runtime_float32_is_a_float32_rounding_off():
    """bit_block: Conv and InstanceNormalization have no float64 kernel in ONNX Runtime, so the truth
    runs on the convpass CPU executor; it equals the block in NumPy float64 to 1e-12 (a float32 op
    anywhere would be 1e-7 off), and float32 ONNX Runtime differs from it by float32 roundings."""
    model = bit_block()
    x = np.random.default_rng(1).standard_normal((2, 16, 9, 9)).astype(np.float32)
    (truth,) = float64_outputs(model, [{"x": x}])
    want = bit_block_float64(model, x)
    assert relative_errors([truth], [[want]])["max-rel"] < 1e-12
    e32 = relative_errors([_ort(model, {"x": x})], [truth])
    assert 1e-8 < e32["max-rel"] < 2e-6 and 1e-8 < e32["rel-l2"] < 1e-6, e32


def test_a_quantized_model_has_no_float64_form():
    graph = helper.make_graph([N("QuantizeLinear", ["x", "s"], ["q"], name="quant")], "q",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("q", TensorProto.UINT8, [4])],
                              [numpy_helper.from_array(np.array(0.1, np.float32), "s")])
    with pytest.raises(ConvpassError, match="'quant'.*quantized"):
        to_float64(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_local_errors_against_the_truth_on_the_cpu(tmp_path, capsys):
    path = tmp_path / "bit.onnx"
    onnx.save(bit_block(), path)
    out = tmp_path / "errors.json"
    script = benchmark_script("local_errors")
    assert script.main(["--model", str(path), "--batch", "2", "--device", "cpu", "--cache", str(tmp_path / "c.db"),
                        "--truth", "f64", "--json", str(out)]) == 0
    truth = json.loads(out.read_text())["truth"]
    for who in ("ort_float32", "device"):
        assert 1e-8 < truth[who]["max-rel"] < 2e-6 and 1e-8 < truth[who]["rel-l2"] < 1e-6, truth
    assert truth["ort_float64_gaps"] == ["Conv", "InstanceNormalization"]
    printed = capsys.readouterr().out
    assert "ort/f64" in printed and "ONNX Runtime CPU float32 against the float64 truth" in printed


def test_a_node_computed_off_shows_against_the_truth():
    """The device's conv ``h`` computed with its weight off by 1e-3 (random per element: the GroupNorm
    after it cannot normalize it away): the device is 1e-3-sized off the truth from ``h`` on, where
    ONNX Runtime float32 stays at float32's size."""
    script, model, tuned, feeds, skewed = skewed_conv_setup()
    result = script.local_errors(model, tuned, feeds, skewed, truth=True)
    rows = {r["node"]: r for r in result["nodes"]}
    assert 5e-4 < rows["h"]["device_truth"] < 2e-3 and rows["h"]["ort_truth"] < 1e-6
    assert rows["n1/InstanceNormalization"]["device_truth"] < 1e-6
    assert result["truth"]["device"]["max-rel"] > 1e-4 and result["truth"]["device"]["rel-l2"] > 1e-4
    assert result["truth"]["ort_float32"]["max-rel"] < 2e-6

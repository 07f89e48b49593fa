"""Shared builders for hand-made test models."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "models"

_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.DOUBLE: np.float64}


def conv_model(
    op_type: str,
    x_shape: Sequence,
    w_shape: Sequence[int],
    *,
    bias: bool = True,
    elem_type: int = TensorProto.FLOAT,
    opset: int = 17,
    ir_version: int = 8,
    seed: int = 0,
    **attrs,
) -> onnx.ModelProto:
    """One Conv / ConvTranspose followed by Relu, with random weights; output shape left to inference."""
    rng = np.random.default_rng(seed)
    dtype = _NP[elem_type]
    w = rng.standard_normal(w_shape).astype(dtype)
    inits = [numpy_helper.from_array(w, "w")]
    inputs = ["x", "w"]
    if bias:
        out_channels = w_shape[0] if op_type == "Conv" else w_shape[1] * attrs.get("group", 1)
        inits.append(numpy_helper.from_array(rng.standard_normal(out_channels).astype(dtype), "b"))
        inputs.append("b")
    nodes = [
        helper.make_node(op_type, inputs, ["y"], name="conv", **attrs),
        helper.make_node("Relu", ["y"], ["out"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_tensor_value_info("x", elem_type, list(x_shape))],
        [helper.make_tensor_value_info("out", elem_type, None)],
        inits,
    )
    # Infer the output shape at a modern opset (old opsets infer less), then build at the requested one.
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    out_type = onnx.shape_inference.infer_shapes(probe).graph.output[0].type
    graph.output[0].type.CopyFrom(out_type)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


def random_input(shape: Sequence[int], elem_type: int = TensorProto.FLOAT, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(_NP[elem_type])


def silu_model(x_shape: Sequence[int] = (2, 16, 12, 12), seed: int = 0) -> onnx.ModelProto:
    """EfficientNet's pattern: a 1x1 Conv and a depthwise 3x3 Conv, each with bias and SiLU
    (``Mul(y, Sigmoid(y))``, as torch exports it), then a plain Conv whose output is the graph's."""
    rng = np.random.default_rng(seed)
    c = x_shape[1]

    def init(name, *shape, scale=1.0):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [init("w1", 2 * c, c, 1, 1, scale=c ** -0.5), init("b1", 2 * c), init("w2", 2 * c, 1, 3, 3, scale=1 / 3),
             init("b2", 2 * c), init("w3", c, 2 * c, 1, 1, scale=(2 * c) ** -0.5), init("b3", c)]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["y1"], name="expand"),
        helper.make_node("Sigmoid", ["y1"], ["s1"], name="sig1"),
        helper.make_node("Mul", ["y1", "s1"], ["a1"], name="silu1"),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["y2"], name="dw", group=2 * c, pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["y2"], ["s2"], name="sig2"),
        helper.make_node("Mul", ["s2", "y2"], ["a2"], name="silu2"),
        helper.make_node("Conv", ["a2", "w3", "b3"], ["out"], name="project"),
    ]
    graph = helper.make_graph(nodes, "silu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, list(x_shape))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own tuning cache; nobody's real cache is touched."""
    monkeypatch.setenv("CONVPASS_CACHE", str(tmp_path / "tuning.db"))


def panel_models() -> list[str]:
    """The benchmark panel's model names, in panel order, read from ``models/export_panel.py``
    (importing it needs only the standard library), so the tests never drift from the exporter."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_export_panel_names", MODELS / "export_panel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.panel_names()

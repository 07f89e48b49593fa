"""A DenseNet-style block at batch 16, tuned in NHWC, on the cuda backend: the BatchNormalization +
Relu of each layer reads its channel slice of the block's channels-last Concat buffer and gives the
NHWC 1x1 conv a packed channels-last tensor, so no conv launch copies its input but the stem's
(the graph input, channels-first); the outputs match ONNX Runtime (CPU). The CPU side of the rule:
tests/test_dense_block_storage.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_cuda_backend")]

cp = pytest.importorskip("cupy")

from conftest import run_ort, steady_run  # noqa: E402

import convpass  # noqa: E402

BATCH, STEM, GROWTH, WIDTH, HW = 16, 64, 32, 128, 28


def _dense_block() -> onnx.ModelProto:
    """x -> 3x3 conv + bias -> Relu -> x0; two layers of Concat(x0, f1, ...) -> BatchNormalization ->
    Relu -> 1x1 conv + bias -> Relu -> 3x3 conv (no bias) = f_k; Concat(x0, f1, f2) ->
    BatchNormalization -> Relu -> y (torchvision's DenseNet as exported, its second BatchNormalization
    folded into the 1x1 conv)."""
    rng = np.random.default_rng(3)
    inits, nodes = [], []

    def const(name, shape, scale=0.1, low=None):
        a = rng.uniform(low, 1.5, shape) if low is not None else rng.standard_normal(shape) * scale
        inits.append(numpy_helper.from_array(np.asarray(a, np.float32), name))
        return name

    nodes.append(helper.make_node("Conv", ["x", const("ws", (STEM, 3, 3, 3)), const("bs", (STEM,))], ["s"], name="stem", pads=[1] * 4))
    nodes.append(helper.make_node("Relu", ["s"], ["x0"], name="stem_relu"))
    feats, channels = ["x0"], STEM
    for k in (1, 2, 3):
        nodes.append(helper.make_node("Concat", list(feats), [f"cat{k}"], name=f"cat{k}", axis=1))
        params = [const(f"g{k}", (channels,), low=0.5), const(f"b{k}", (channels,)), const(f"m{k}", (channels,)), const(f"v{k}", (channels,), low=0.5)]
        nodes.append(helper.make_node("BatchNormalization", [f"cat{k}", *params], [f"n{k}"], name=f"norm{k}"))
        nodes.append(helper.make_node("Relu", [f"n{k}"], [f"r{k}"] if k < 3 else ["y"], name=f"relu{k}"))
        if k == 3:
            break
        nodes.append(helper.make_node("Conv", [f"r{k}", const(f"wa{k}", (WIDTH, channels, 1, 1)), const(f"ba{k}", (WIDTH,))], [f"a{k}"], name=f"conv{k}a"))
        nodes.append(helper.make_node("Relu", [f"a{k}"], [f"ra{k}"], name=f"relu{k}a"))
        nodes.append(helper.make_node("Conv", [f"ra{k}", const(f"wb{k}", (GROWTH, WIDTH, 3, 3))], [f"f{k}"], name=f"conv{k}b", pads=[1] * 4))
        feats.append(f"f{k}")
        channels += GROWTH
    graph = helper.make_graph(nodes, "dense_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, 3, HW, HW])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, channels, HW, HW])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)



def test_a_dense_block_in_nhwc_copies_no_conv_input_but_the_graph_inputs(tmp_path):
    model = _dense_block()
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, tf32="on", engines="legacy", layout="nhwc")
    assert {r["memory_format"] for r in convpass.inspect(tuned)} == {"NHWC"}
    x = np.random.default_rng(4).standard_normal((BATCH, 3, HW, HW)).astype(np.float32)
    (y,), added = steady_run(tuned, {"x": x})
    copies = added["layout_copies"]
    assert copies == 1, f"{copies} conv inputs copied in one run (the stem's graph input only expected)"
    (want,) = run_ort(model, {"x": x})
    err = float(np.linalg.norm(y - want) / np.linalg.norm(want))
    assert err <= 5e-3, f"normwise relative error {err:.3g}"

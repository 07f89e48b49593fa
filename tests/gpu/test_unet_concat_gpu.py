"""A UNet up block on the GPU: the ConvTranspose writes its half of the decoder Concat through a
Pad of zero widths (from Shape arithmetic, as milesial's Pytorch-UNet exports it) and the Concat
copies nothing; outputs against ONNX Runtime (CPU), eagerly and replayed from the CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import run_ort  # noqa: E402

import convpass  # noqa: E402
from convpass.runtime import Executor  # noqa: E402

N, C, HW = 16, 32, 64
TF32_TOL = 5e-3
NODE = helper.make_node


def _up_block(hw: int) -> object:
    """skip = Relu(Conv3x3(x) + b); u = ConvTranspose2x2s2(MaxPool(skip)) + bias (C channels);
    p = Pad(u, end widths from Shape(skip) - Shape(u)); y = Relu(Conv3x3(Concat(skip, p)) + b)."""
    rng = np.random.default_rng(5)

    def t(name, shape, scale=0.1):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [t("w1", (C, 3, 3, 3)), t("b1", (C,)), t("wt", (C, C, 2, 2)), t("bt", (C,)), t("w2", (C, 2 * C, 3, 3)), t("b2", (C,)),
             numpy_helper.from_array(np.zeros(4, np.int64), "zeros")]
    nodes = [
        NODE("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]), NODE("Relu", ["c1"], ["skip"]),
        NODE("MaxPool", ["skip"], ["m"], kernel_shape=[2, 2], strides=[2, 2]),
        NODE("ConvTranspose", ["m", "wt", "bt"], ["u"], kernel_shape=[2, 2], strides=[2, 2]),
        NODE("Shape", ["skip"], ["s_skip"]), NODE("Shape", ["u"], ["s_u"]), NODE("Sub", ["s_skip", "s_u"], ["d"]),
        NODE("Concat", ["zeros", "d"], ["pads"], axis=0), NODE("Pad", ["u", "pads"], ["p"]),
        NODE("Concat", ["skip", "p"], ["cat"], axis=1),
        NODE("Conv", ["cat", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]), NODE("Relu", ["c2"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "up", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, 3, hw, hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, C, hw, hw])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm((got - want).ravel()) / max(np.linalg.norm(want.ravel()), 1e-30))


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_the_convtranspose_writes_its_concat_slice_and_the_concat_copies_nothing(layout):
    from convpass.runtime.cuda import CudaBackend

    model = _up_block(HW)
    tuned = convpass.optimize(model, quiet=True, tf32="on", engines="legacy", layout=layout)
    x = np.random.default_rng(6).standard_normal((N, 3, HW, HW)).astype(np.float32)
    ex = Executor(tuned, device=CudaBackend())
    outs = [ex.run(None, {"x": x})[0] for _ in range(4)]  # op by op, the plan's launches (warm-up, capture), replayed
    assert ex.graph_status().captured, ex.graph_status().describe()
    launches = ex.last_plan.backend_state.launch_list()
    labels = [launch.label for launch in launches]
    assert "Concat (in place)" in labels and "Concat" not in labels, labels
    (up,) = [launch for launch in launches if launch.node.op_type == "ConvTranspose"]
    assert up.placement is not None and (up.placement.offset, up.placement.length) == (C, C), up.describe()
    (ref,) = run_ort(model, {"x": x})
    for out in outs:
        assert _rel(out, ref) <= TF32_TOL, _rel(out, ref)


def test_an_odd_size_still_pads_and_copies():
    """Sizes not divisible by 2: the Pad adds a row and a column, so the Concat copies that half."""
    from convpass.runtime.cuda import CudaBackend

    model = _up_block(HW + 1)
    tuned = convpass.optimize(model, quiet=True, tf32="on", engines="legacy", layout="nhwc")
    x = np.random.default_rng(7).standard_normal((N, 3, HW + 1, HW + 1)).astype(np.float32)
    ex = Executor(tuned, device=CudaBackend())
    outs = [ex.run(None, {"x": x})[0] for _ in range(3)]
    labels = [launch.label for launch in ex.last_plan.backend_state.launch_list()]
    assert "Concat" in labels, labels
    (ref,) = run_ort(model, {"x": x})
    for out in outs:
        assert _rel(out, ref) <= TF32_TOL, _rel(out, ref)

"""One rule for what a conv's step absorbs (convpass.core.fusion.absorbed): the compiler, which
tunes the step, and the runtime, which runs it, find the same epilogue for every conv."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import leaky_model, residual_block_model, silu_model
from onnx import TensorProto, helper, numpy_helper

from convpass.compiler.pipeline import OptimizeReport, prepare_model
from convpass.core.fusion import absorbed
from convpass.core.options import TuneOptions
from convpass.kernels.plan_steps import PlanSteps
from convpass.runtime import Executor

MODELS = Path(__file__).resolve().parents[1] / "models"


def _bn_relu_model() -> onnx.ModelProto:
    """A bias-less Conv -> BatchNormalization -> Relu, then a conv whose output is a graph output."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((8, 8, 1, 1)).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b2")]
    for name, value in (("g", 1.5), ("beta", 0.1), ("mean", 0.2), ("var", 2.0)):
        inits.append(numpy_helper.from_array(np.full(8, value, np.float32), name))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="c0", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], ["bn"], name="bn0"),
             helper.make_node("Relu", ["bn"], ["r"], name="relu0"),
             helper.make_node("Conv", ["r", "w2", "b2"], ["y"], name="c1")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _compiler(proto: onnx.ModelProto) -> dict[str, str]:
    model = ir.serde.deserialize_model(proto)
    problems = prepare_model(model, TuneOptions(engines="all"), [], OptimizeReport())
    return {use.node.name: p.fusion for p, uses in problems.items() if p.direction == "fwd" for use in uses}


def _runtime(proto: onnx.ModelProto) -> dict[str, str]:
    ex = Executor(proto, device="cpu")
    feeds = {a.name: np.zeros([d if isinstance(d, int) else 1 for d in a.shape], np.float32) for a in ex.get_inputs()}
    ex.run(None, feeds)
    [plan] = ex._plans.values()
    found = {}
    taken: set[int] = set()
    view = PlanSteps(plan, taken)
    for i, st in enumerate(plan.steps):
        if st.node.op_type == "Conv" and st.node.prepared is not None and st.node.prepared.geometry.op_type == "Conv":
            view.conv = i
            a = absorbed(view, i)
            taken.update(a.nodes)
            found[st.node.name] = a.epilogue
    return found


@pytest.mark.parametrize("name", ["residual_cnn", "mobile_block", "audio_frontend_1d", "video_block_3d", "encoder_decoder", "silu", "residual_block", "bn_relu", "leaky"])
def test_compiler_and_runtime_absorb_the_same_epilogue(name):
    if name == "silu":
        proto = silu_model()
    elif name == "residual_block":
        proto = residual_block_model()
    elif name == "bn_relu":
        proto = _bn_relu_model()
    elif name == "leaky":
        proto = leaky_model()
    else:
        proto = onnx.load(MODELS / f"{name}.onnx")
        if name == "mobile_block":
            proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    compiled = _compiler(proto)
    ran = _runtime(proto)
    assert compiled and compiled == {k: v for k, v in ran.items() if k in compiled}, (compiled, ran)


def test_a_batchnorm_after_a_conv_is_folded_at_optimize_so_the_conv_is_tuned_with_its_relu():
    assert _compiler(_bn_relu_model()) == {"c0": "bias+relu", "c1": ""}

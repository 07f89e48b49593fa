"""Channel-attention gates on the cuda backend's path, checked on the CPU: ECA's gate as torch exports
it (ReduceMean over H, W without keepdims -> 1-D conv across channels -> Sigmoid -> Reshape -> Expand
-> Mul), its pooling taken by the global pooling kernel in either memory format, and the Expand read
as a broadcast inside the fused Mul (no copy of the gate per element)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from fused_models import N, const, eca, feeds
from onnx import TensorProto, helper

from convpass.kernels import elementwise, pooling
from convpass.runtime.executor import Executor


@pytest.mark.parametrize("residual", [False, True])
def test_the_gate_runs_as_pooling_a_small_middle_and_one_fused_pass(residual):
    shape = (2, 64, 7, 7)
    model = eca(shape, residual=residual)
    f = feeds(shape)
    ex = Executor(model, device="cpu")
    got = ex.run(None, f)[0]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, f)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plan = ex.last_plan
    groups = elementwise.plan_groups(plan, [None] * len(plan.steps))
    assert [g.ops for g in groups] == [("Sigmoid",), ("Expand", "Mul", "Add", "Relu") if residual else ("Expand", "Mul")]
    fused = groups[-1]
    expanded = next(s.outputs[0] for s in plan.steps if s.node.op_type == "Expand")
    assert expanded not in fused.inputs, "the Expand's output is never stored"
    assert any(plan.info(s)[0] == (2, 64, 1, 1) for s in fused.inputs), "the gate is read per channel"
    pool = next(i for i, s in enumerate(plan.steps) if s.node.op_type == "ReduceMean")
    launch = pooling.lower_global_pool(plan, pool, None, np.asarray)
    assert launch is not None and launch.out_shape == (2, 64) and launch.label == "ReduceMean (kernel)"


def test_an_expand_is_never_a_groups_root():
    """An Expand whose output is stored (read by a non-element-wise op) runs on the op library: a
    group writes the broadcast shape of its inputs, not the Expand's target."""
    nodes = [N("Sigmoid", ["g"], ["s"], name="s"), N("Expand", ["s", "shape"], ["e"], name="e"), N("Transpose", ["e"], ["y"], perm=[0, 1, 3, 2])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("g", TensorProto.FLOAT, (2, 3, 1, 1))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, (2, 3, 5, 4))], [const("shape", (2, 3, 4, 5), np.int64)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    ex = Executor(model, device="cpu")
    ex.run(None, {"g": np.ones((2, 3, 1, 1), np.float32)})
    plan = ex.last_plan
    assert [g.ops for g in elementwise.plan_groups(plan, [None] * len(plan.steps))] == [("Sigmoid",)]

"""What the cuda backend's runner reports about a compiled plan (convpass.runtime.cuda.runner), on CPU.

The capture itself needs a GPU (tests/gpu/test_kernels.py); the report a user sees, and how the
warm-up marks a launch that needs the host, are plain logic.
"""

from __future__ import annotations

from convpass.runtime.cuda import runner
from convpass.runtime.cuda.launch import Launch
from convpass.runtime.registry import NodeInfo


def _launch(name: str, op: str, step: int) -> Launch:
    return Launch(step, NodeInfo(name, op, "", 17, {}, ["a"], ["b"]), op, (step,))


def _state(**kw) -> runner.CompiledPlan:
    launches = [_launch("c", "Conv", 0), _launch("nz", "NonZero", 1), _launch("r", "Relu", 2)]
    return runner.CompiledPlan(launches=launches, free=[(), (), ()], **kw)


def test_status_before_capture_eager_and_off():
    state = _state(capturable=True, mode="graph")
    status = state.graph_status(cuda_graph=True)
    assert status.captured is None and "warm-up" in status.reason
    assert _state(capturable=False, mode="eager").graph_status(cuda_graph=False).describe() == "CUDA graph: n/a (cuda_graph=False)"


def test_a_launch_that_needs_the_host_is_named_once():
    state = _state(capturable=True, mode="graph")
    runner._mark(state, 1, "needs the host while running (1 device -> host copies)")
    runner._mark(state, 2, "cannot be captured: whatever")
    assert state.uncapturable == {1, 2}
    # the first node that broke the graph is the one the report names
    assert state.break_node == "nz" and state.note == "node 'nz' (NonZero) needs the host while running (1 device -> host copies)"
    state.mode = "segmented"
    status = state.graph_status(cuda_graph=True)
    assert status.captured is False and status.node == "nz" and status.describe().startswith("CUDA graph: no (node 'nz' (NonZero)")


def test_one_graph_is_captured_and_segments_are_not():
    state = _state(capturable=True, mode="graph", note="3 launch(es) in one CUDA graph")
    state.segments = [object()]
    assert state.captured and state.graph is state.segments[0]
    assert state.graph_status(cuda_graph=True).describe() == "CUDA graph: yes (3 launch(es) in one CUDA graph)"
    state.segments = [object(), runner._EagerPart(1, [], []), object()]
    assert not state.captured and state.graph is None

"""A captured graph's programmatic edges made default (convpass.native.cuda_graph_edges), the
runner's use of it with ``conv_exec.FENCE == "edges"`` and its fallbacks, and which launches
``fence_needed`` fences under each ``FENCE``: on CPU, over a libcuda stood in for."""

from __future__ import annotations

import ctypes
import gc
import types

import numpy as np
import pytest
from conftest import FakeLibcuda, fake_cuda

from convpass.compiler.passes.canonicalize_convs import canonicalize_conv
from convpass.core.algo import Algo
from convpass.kernels import conv_exec
from convpass.native import cuda_graph_edges as edges
from convpass.runtime.cuda import runner

PDL = (1, 0, 1)  # (from_port, to_port, type): a programmatic edge
ORDER = (2, 0, 0)  # a default-type edge from a kernel's launch-order port
DEFAULT = (0, 0, 0)
STREAM = types.SimpleNamespace(ptr=9)
CAPTURED = [(1, 2, DEFAULT), (2, 3, PDL), (3, 4, DEFAULT), (4, 5, ORDER), (5, 6, PDL)]


@pytest.fixture
def libcuda(monkeypatch):
    """Install a :class:`FakeLibcuda` as the process's driver: ``libcuda(edges, missing=..., failing=...)``."""

    def install(edge_list=CAPTURED, **kw):
        lib = FakeLibcuda(edge_list, **kw)
        monkeypatch.setattr(edges, "_cache", {})
        monkeypatch.setattr(edges, "_load", lambda: edges.Driver(lib))
        return lib

    return install


def _cupy_graph(handle=1):
    return types.SimpleNamespace(graph=handle, launch=lambda stream=None: None, upload=lambda stream=None: None)


def test_programmatic_edges_become_default_ones_and_default_edges_stay(libcuda):
    lib = libcuda()
    assert edges.default_edges(1) == 3  # two programmatic edges and one from a launch-order port
    assert sorted(lib.graphs[1]) == sorted((a, b, DEFAULT) for a, b, _ in CAPTURED)
    assert edges.default_edges(1) == 0 and len(lib.graphs[1]) == 5


def test_a_graph_without_programmatic_edges_is_left_to_cupy(libcuda):
    lib = libcuda([(1, 2, DEFAULT), (2, 3, DEFAULT)])
    assert edges.rewritten(_cupy_graph()) is None
    assert 2 not in lib.graphs and not lib.execs


def test_the_copy_is_rewritten_instantiated_launched_and_freed_and_cupys_graph_left_alone(libcuda):
    lib = libcuda()
    source = _cupy_graph()
    g = edges.rewritten(source)
    assert g is not None and g.rewritten == 3 and g.source is source and g.graph == 1
    assert lib.graphs[1] == CAPTURED  # the graph as captured: untouched
    assert lib.execs[g.exec] == sorted((a + 1000, b + 1000, DEFAULT) for a, b, _ in CAPTURED)
    g.launch(types.SimpleNamespace(ptr=77))
    assert lib.launched == [(g.exec, 77)]
    exec_ = g.exec
    del g
    gc.collect()
    assert sorted(lib.destroyed) == [2, exec_]  # the clone and its executable, once, not CuPy's graph


def test_a_failed_call_names_the_function_and_leaves_nothing_allocated(libcuda):
    lib = libcuda(failing={"cuGraphInstantiateWithFlags"})
    with pytest.raises(edges.DriverError, match=r"cuGraphInstantiateWithFlags: CUDA_ERROR_INVALID_VALUE \(1\)"):
        edges.rewritten(_cupy_graph())
    assert lib.destroyed == [2]


def test_a_driver_without_the_functions_says_which_and_disable_sticks(libcuda):
    libcuda(missing={"cuGraphGetEdges_v2", "cuGraphAddDependencies_v2"})
    why = edges.unavailable_reason()
    assert why == "libcuda.so.1 has no cuGraphGetEdges_v2, cuGraphAddDependencies_v2 (a driver older than CUDA 12.3)"
    with pytest.raises(edges.EdgesUnavailable, match="older than CUDA 12.3"):
        edges.rewritten(_cupy_graph())
    libcuda()
    assert edges.unavailable_reason() is None
    edges.disable("a call failed")
    assert edges.unavailable_reason() == "a call failed"


def test_no_libcuda_is_unavailable(monkeypatch):
    def no_library():
        raise edges.EdgesUnavailable("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(edges, "_cache", {})
    monkeypatch.setattr(edges, "_load", no_library)
    assert edges.unavailable_reason() == "libcuda.so.1: cannot open shared object file"


def test_the_edge_data_has_the_drivers_layout():
    assert ctypes.sizeof(edges.EdgeData) == 8 and bytes(edges.EdgeData(1, 0, 1)) == b"\x01\x00\x01" + bytes(5)


# ---------------------------------------------------------------------------------------------
# the runner


class _Rt:
    def __init__(self) -> None:
        self.counters: dict[str, int] = {"programmatic_edges_rewritten": 0}
        self.warnings: list[str] = []

    def warn_capture(self, note: str) -> None:
        if note not in self.warnings:  # once per reason, as the backend's note_once
            self.warnings.append(note)


def test_the_runner_replays_the_rewritten_copy_and_counts_its_edges(libcuda):
    libcuda()
    rt, cupy_graph, eager = _Rt(), _cupy_graph(), runner._EagerPart(1, [], [])
    segments, outputs = runner._default_edges(rt, None, None, {}, STREAM, None, ([cupy_graph, eager], ["y"]))
    assert isinstance(segments[0], edges.DefaultEdgeGraph) and segments[0].source is cupy_graph and segments[1] is eager
    assert outputs == ["y"] and rt.counters["programmatic_edges_rewritten"] == 3 and not rt.warnings


def test_without_the_functions_the_runner_keeps_cupys_graph_and_says_so_once(libcuda):
    libcuda(missing={"cuGraphRemoveDependencies_v2"})
    rt, cupy_graph = _Rt(), _cupy_graph()
    for _ in range(2):
        segments, _ = runner._default_edges(rt, None, None, {}, STREAM, None, ([cupy_graph], []))
        assert segments == [cupy_graph]
    assert len(rt.warnings) == 1 and "no cuGraphRemoveDependencies_v2" in rt.warnings[0] and "fenced with a memset" in rt.warnings[0]
    assert rt.counters["programmatic_edges_rewritten"] == 0


def test_a_failed_rewrite_captures_the_plan_again_with_fences(libcuda, monkeypatch):
    lib = libcuda(failing={"cuGraphRemoveDependencies_v2"})
    recaptured = []
    conv = _engine("engine:eng4+bias+add+relu")
    monkeypatch.setattr(conv_exec, "FENCE", "edges")

    def capture_plan(rt, plan, state, static, stream, pool):
        recaptured.append(conv_exec.fence_needed(conv))  # the fence is back for the new capture
        return [_cupy_graph(1)], ["y2"]

    monkeypatch.setattr(runner, "_capture_plan", capture_plan)
    rt = _Rt()
    assert not conv_exec.fence_needed(conv)
    segments, outputs = runner._default_edges(rt, None, None, {}, STREAM, None, ([_cupy_graph()], ["y"]))
    assert recaptured == [True] and outputs == ["y2"] and not isinstance(segments[0], edges.DefaultEdgeGraph)
    assert len(rt.warnings) == 1 and "cuGraphRemoveDependencies_v2: CUDA_ERROR_INVALID_VALUE" in rt.warnings[0]
    assert "captured again" in rt.warnings[0] and lib.destroyed == [2]
    assert edges.unavailable_reason().startswith("an earlier rewrite failed")


def test_the_plans_status_names_the_rewritten_edges(libcuda, monkeypatch):
    """Through ``_warm_up_and_capture``: CuPy stood in for by NumPy; the plan's one graph is the
    rewritten copy, its status says so; with ``FENCE == "memset"`` nothing is rewritten."""
    lib = libcuda()
    for fence, rewritten in (("memset", 0), ("edges", 3)):
        monkeypatch.setattr(conv_exec, "FENCE", fence)
        rt, state, plan = _fake_rt(), _one_launch_state(), types.SimpleNamespace(template=[None, None], feed_slots={"x": 0}, output_slots=[1])
        monkeypatch.setattr(runner, "_capture", lambda rt, plan, state, static, stream: ([_cupy_graph()], [np.zeros(2)]))
        runner._warm_up_and_capture(rt, plan, state, {"x": np.ones(2, np.float32)})
        assert state.captured and isinstance(state.graph, edges.DefaultEdgeGraph) == bool(rewritten)
        assert rt.counters["programmatic_edges_rewritten"] == rewritten
        assert state.note.endswith(", 3 programmatic edge(s) made default" if rewritten else "launch(es) in one CUDA graph")
    assert len(lib.execs) == 1


def _fake_rt():
    class Stream:
        ptr = 5

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def record(self):
            return None

        def wait_event(self, e):
            pass

        def synchronize(self):
            pass

    cuda = types.SimpleNamespace(get_current_stream=Stream, Stream=lambda non_blocking: Stream(), MemoryPool=lambda: types.SimpleNamespace(malloc=None),
                                 using_allocator=lambda malloc: Stream())
    cp = types.SimpleNamespace(cuda=cuda, empty=lambda shape, dtype: np.empty(shape, dtype), copyto=np.copyto)
    rt = types.SimpleNamespace(cp=cp, counters={"programmatic_edges_rewritten": 0}, host_syncs=0, uploads=0, check_first_run=False,
                               warn_capture=lambda note: None)
    return rt


def _one_launch_state():
    class Copy:
        node, label, outputs = types.SimpleNamespace(name="n", op_type="Relu"), "Relu", (1,)

        def run(self, env):
            env[1] = env[0] * 1

    return runner.CompiledPlan(launches=[Copy()], free=[()], capturable=True, mode="graph")


# ---------------------------------------------------------------------------------------------
# fence_needed


def _engine(algo: str):
    fusion = Algo.parse(algo).fusion
    key = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, (2, 16, 14, 14), (16, 16, 3, 3)).shapes[0].key("nhwc", "default")
    plan = types.SimpleNamespace(config=types.SimpleNamespace(algo=algo), workspace_bytes=0, execute=lambda *a, **k: None)
    conv = conv_exec.EngineConv(key, Algo.parse(algo), fusion, types.SimpleNamespace(cuda=fake_cuda([], CAPTURING)), plan)
    conv._pass = lambda y, bias, z: None
    return conv


CAPTURING = [True]  # the fake current stream's capture status (_engine's convs read it)


@pytest.fixture(autouse=True)
def _captured():
    CAPTURING[0] = True
    yield
    CAPTURING[0] = True


def test_memset_fences_every_fused_launch_and_edges_only_eager_ones_or_where_the_driver_cannot_rewrite(libcuda, monkeypatch):
    fused, bare = _engine("engine:eng4+bias+add+relu"), _engine("engine:eng4")
    libcuda()
    for capturing in (True, False):
        CAPTURING[0] = capturing
        monkeypatch.setattr(conv_exec, "FENCE", "memset")
        assert [conv_exec.fence_needed(c) for c in (fused, bare)] == [True, False]
        monkeypatch.setattr(conv_exec, "FENCE", "edges")
        assert [conv_exec.fence_needed(c) for c in (fused, bare)] == [not capturing, False]  # eager: fenced; captured: edges
    libcuda(missing={"cuGraphGetEdges_v2"})
    for capturing in (True, False):
        CAPTURING[0] = capturing
        assert [conv_exec.fence_needed(c) for c in (fused, bare)] == [True, False]
    assert conv_exec.FENCES == ("memset", "edges")


def test_a_graph_without_edges_is_asked_once(libcuda):
    """One kernel captured: no edges to fetch (the driver refuses arrays for none), nothing rewritten."""
    lib = libcuda()
    lib.graphs[1] = []
    assert edges.graph_edges(edges.driver(), 1) == [] and edges.default_edges(1) == 0

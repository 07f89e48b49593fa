"""The checks of a plan's first run on the cuda backend, on the CPU (CuPy, cuDNN and the engine
plans stood in for by NumPy): each graph-API engine step against a legacy algorithm of its
problem (:mod:`convpass.kernels.engine_check`), and a captured plan's first replay against its
eager warm-up (:func:`convpass.runtime.cuda.runner.first_replay_differs`).

An engine configuration the tuner checked once (fresh buffers, its own plan, alone) gave wrong
model outputs in the executor at batch 16 (ResNet-50, ``bias+add+relu``): the executor no longer
takes the tuner's check for the conditions it runs the plan in."""

from __future__ import annotations

import collections
import contextlib
import math
import sys
import types

import numpy as np
import pytest
from conftest import fake_cuda, no_plan_side_car, numpy_epilogue_kernel

from convpass.compiler.passes.canonicalize_convs import canonicalize_conv
from convpass.core import annotation
from convpass.core.fusion import LEGACY, parts
from convpass.kernels import conv_exec, engine_check
from convpass.native import cudnn
from convpass.native.cudnn import graph_api
from convpass.runtime.cuda import runner

X = (2, 16, 14, 14)
SHAPE = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, X, (16, 16, 3, 3)).shapes[0]
KEY = SHAPE.key("nhwc", "default")


def _geometry():
    from convpass.ops.conv import conv_geometry

    return conv_geometry("Conv", {"pads": [1, 1, 1, 1]}, X, (16, 16, 3, 3))


def _conv(x, w):
    from convpass.ops.conv import conv_reference

    return conv_reference(np, np.asarray(x, np.float64), np.asarray(w, np.float64), None, _geometry())


class _Plan:
    """An engine plan computing its graph in NumPy; ``wrong``: it leaves its residual out, as a
    plan that reads another buffer than the one it is given would."""

    wrong = False
    executed: list = []

    def __init__(self, key, config, enumerated=None):
        self.config, self.workspace_bytes = config, 0

    def execute(self, x, w, y, workspace=None, bias=None, z=None):
        _Plan.executed.append(self.config.algo)
        v = _conv(x, w)
        if self.config.fusion:
            zz = np.zeros_like(z) if (_Plan.wrong and z is not None) else z
            v = graph_api.fusion_of(self.config.fusion).reference(np, v + bias.reshape(1, -1, 1, 1), zz)
        y[...] = v


class _Cuda:
    """CuPy's allocator switch and what a stream fence calls, stood in for."""

    def __init__(self) -> None:
        vars(self).update(vars(fake_cuda([])))

    @staticmethod
    def using_allocator(malloc=None):
        return contextlib.nullcontext()


@pytest.fixture
def convs(monkeypatch):
    """The executor's conv family over NumPy, with the first-run check on: warnings in
    ``.warnings``, cuDNN's legacy forward calls (the check's reference and the fallback's conv) in
    ``.legacy``."""
    from convpass.kernels.convolution import Convolutions

    fake_cp = types.ModuleType("cupy")
    fake_cp.empty, fake_cp.uint8, fake_cp.float64, fake_cp.ascontiguousarray, fake_cp.maximum = (
        np.empty, np.uint8, np.float64, np.ascontiguousarray, np.maximum)
    fake_cp.cuda = _Cuda()
    fake_cp.get_default_memory_pool = lambda: types.SimpleNamespace(malloc=None)
    monkeypatch.setitem(sys.modules, "cupy", fake_cp)
    monkeypatch.setattr(graph_api, "EnginePlan", _Plan)
    monkeypatch.setattr(_Plan, "executed", [])
    monkeypatch.setattr(_Plan, "wrong", False)
    no_plan_side_car(monkeypatch)
    legacy = []

    def run(descs, direction, algo, x, w, y, workspace=None, **kw):
        legacy.append(algo)
        y[...] = _conv(x, w)

    monkeypatch.setattr(cudnn, "ConvDescriptors", lambda key: types.SimpleNamespace(key=key))
    monkeypatch.setattr(cudnn, "workspace_size", lambda descs, direction, algo, **strides: 0)
    monkeypatch.setattr(cudnn, "run", run)
    monkeypatch.setattr(cudnn, "heuristic", lambda descs, *a, **kw: [types.SimpleNamespace(ok=True, algo="implicit_gemm")])
    monkeypatch.setattr(conv_exec, "epilogue_kernel", lambda cp, *flags, **kw: numpy_epilogue_kernel(cp, *flags))
    warnings: list[str] = []
    rt = types.SimpleNamespace(cp=fake_cp, fuse=False, counters=collections.Counter(), capturing=False, recorded_device="", current_device=None,
                               device_id=0, is_constant=lambda a: False, warn_node=lambda node, m: warnings.append(m),
                               note_once=lambda *a, **kw: None, check_first_run=True)
    c = Convolutions(rt)
    c.warnings, c.legacy = warnings, legacy  # type: ignore[attr-defined]
    return c


def _call(fusion, algo="implicit_precomp_gemm"):
    from convpass.ops.conv import ConvCall

    d = annotation.ConvDecision(algo=algo, engine="eng4_k24=2", fusion=fusion, memory_format="NHWC", math_mode="default", problem_key=str(KEY))
    return ConvCall("res3", _geometry(), d)


def _nhwc(a):
    out = np.empty((a.shape[0], *a.shape[2:], a.shape[1]), a.dtype).transpose(0, 3, 1, 2)
    out[...] = a
    return out


def _inputs(name, seed=7):
    residual, relu = parts(name)
    rng = np.random.default_rng(seed)
    x, z = _nhwc(rng.standard_normal(X).astype(np.float32)), _nhwc(rng.standard_normal(X).astype(np.float32))
    w = (rng.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    v = _conv(x, w) + b.reshape(1, -1, 1, 1) + (np.asarray(z, np.float64) if residual else 0)
    return x, w, b, (z if residual else None), (np.maximum(v, 0) if relu else v)


def _run(convs, name, x, w, b, z):
    return convs.run(_call(name), x, w, b, relu=parts(name)[1], z=z, fusion=name)


@pytest.mark.parametrize("name", [n for n in LEGACY if parts(n)[0]])
def test_an_engine_step_wrong_on_its_first_run_gives_way_to_the_fallback_said_once(convs, name):
    _Plan.wrong = True
    x, w, b, z, want = _inputs(name)
    y = _run(convs, name, x, w, b, z)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)  # the fallback's result, in the same run
    assert _Plan.executed == ["engine:eng4_k24=2+" + name]
    assert convs.legacy == ["implicit_precomp_gemm"] * 2  # the check's reference, then the fallback: the recorded legacy algorithm
    [warning] = convs.warnings
    assert "node 'res3'" in warning and f"engine:eng4_k24=2+{name}" in warning and "differs from cuDNN's legacy 'implicit_precomp_gemm'" in warning
    assert "running its recorded legacy algorithm 'implicit_precomp_gemm' (NHWC, default) instead" in warning
    y = _run(convs, name, x, w, b, z)  # from then on: the fallback alone, no second check, no second warning
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    assert len(_Plan.executed) == 1 and convs.legacy[2:] == ["implicit_precomp_gemm"] and len(convs.warnings) == 1
    ex = convs.resolve(_call(name), np.float32, name)
    assert ex.algo == "implicit_precomp_gemm" and ex.layout == "nhwc" and ex.source == "recorded"


def test_an_engine_recorded_without_a_legacy_algorithm_falls_back_to_the_heuristic(convs):
    _Plan.wrong = True
    name = "bias+add+relu"
    x, w, b, z, want = _inputs(name)
    call = _call(name, algo=annotation.AUTO)
    np.testing.assert_allclose(convs.run(call, x, w, b, relu=True, z=z, fusion=name), want, rtol=1e-4, atol=1e-4)
    [warning] = convs.warnings
    assert "differs from cuDNN's legacy 'implicit_precomp_gemm'" in warning and "running cuDNN's heuristic choice 'implicit_gemm' (NCHW" in warning
    assert convs.resolve(call, np.float32, name).source == "fallback"


@pytest.mark.parametrize("name", LEGACY)
def test_a_right_engine_step_is_checked_once_then_runs_alone(convs, name):
    x, w, b, z, want = _inputs(name)
    for _ in range(3):
        np.testing.assert_allclose(_run(convs, name, x, w, b, z), want, rtol=1e-4, atol=1e-4)
    assert _Plan.executed == ["engine:eng4_k24=2+" + name] * 3 and convs.legacy == ["implicit_precomp_gemm"] and convs.warnings == []
    assert convs.rt.counters["graph_api_calls"] == 3


def test_the_reference_is_the_first_legacy_algorithm_cuDNN_takes(convs, monkeypatch):
    """A decision recorded beside no legacy algorithm (``auto``): the check's own choices, in order."""
    refused = []

    def run(descs, direction, algo, x, w, y, workspace=None, **kw):
        if algo == "implicit_precomp_gemm":
            refused.append(algo)
            raise cudnn.CudnnError(3000, "CUDNN_STATUS_NOT_SUPPORTED")
        convs.legacy.append(algo)
        y[...] = _conv(x, w)

    monkeypatch.setattr(cudnn, "run", run)
    name = "bias+add+relu"
    x, w, b, z, want = _inputs(name)
    call = _call(name, algo=annotation.AUTO)
    assert convs.resolve(call, np.float32, name).legacy_algo == ""
    np.testing.assert_allclose(convs.run(call, x, w, b, relu=True, z=z, fusion=name), want, rtol=1e-4, atol=1e-4)
    assert refused == ["implicit_precomp_gemm"] and convs.legacy == ["implicit_gemm"] and convs.warnings == []


def test_a_check_that_cannot_run_leaves_the_step_unchecked_and_warns(convs, monkeypatch):
    noted = []
    convs.rt.note_once = lambda tag, message, warn=True: noted.append((tag, message, warn))

    def run(*a, **kw):
        raise MemoryError("out of memory allocating 51380224 bytes")

    monkeypatch.setattr(cudnn, "run", run)
    name = "bias+add+relu"
    x, w, b, z, want = _inputs(name)
    np.testing.assert_allclose(_run(convs, name, x, w, b, z), want, rtol=1e-4, atol=1e-4)  # the engine's own result
    assert noted == [("engine-check:res3", "node 'res3': the first run of engine:eng4_k24=2+bias+add+relu "
                                           "was not checked (out of memory allocating 51380224 bytes); it runs as recorded, unverified", True)]
    _run(convs, name, x, w, b, z)
    assert len(noted) == 1  # once: the step counts as checked


def _refusing_strided(convs, monkeypatch, packed_too=False):
    """cuDNN's legacy calls refusing an x read with a slice's strides (every one, with
    ``packed_too``); the check's reference calls are kept in ``convs.legacy`` as (algo, strided)."""
    def run(descs, direction, algo, x, w, y, workspace=None, **kw):
        if "x_strides" in kw or packed_too:
            raise cudnn.CudnnError(3000, "CUDNN_STATUS_NOT_SUPPORTED")
        convs.legacy.append(algo)
        y[...] = _conv(x, w)

    monkeypatch.setattr(cudnn, "run", run)


def _slice_of_wider(x):
    """``x`` (NHWC) as channels 2.. of a channels-last buffer 5 channels wider."""
    n, c, h, w = x.shape
    buffer = np.zeros((n, h, w, c + 5), x.dtype).transpose(0, 3, 1, 2)
    view = buffer[:, 2:2 + c]
    view[...] = x
    assert cudnn.channel_slice(view, "nhwc")
    return view


def test_a_slice_every_legacy_algorithm_refuses_is_checked_on_a_packed_copy(convs, monkeypatch):
    """The engine read a slice in place; the legacy reference refuses its strides: the check runs
    on a packed copy and finds the wrong step (it does not pass it unchecked)."""
    _refusing_strided(convs, monkeypatch)
    _Plan.wrong = True
    name = "bias+add+relu"
    x, w, b, z, want = _inputs(name)
    check = engine_check.check_step(convs.cp, convs.resources, types.SimpleNamespace(key=KEY, algo="engine:eng4_k24=2+" + name, epilogue=name),
                                    "implicit_precomp_gemm", _slice_of_wider(x), w, np.zeros(want.shape, np.float32), b, z)
    assert check is not None and "differs from cuDNN's legacy 'implicit_precomp_gemm'" in check
    assert convs.legacy == ["implicit_precomp_gemm"]  # on the packed copy, after the strided tries


def test_a_step_nothing_can_check_is_said_once(convs, monkeypatch):
    noted = []
    convs.rt.note_once = lambda tag, message, warn=True: noted.append((tag, message, warn))
    _refusing_strided(convs, monkeypatch, packed_too=True)
    name = "bias+add+relu"
    x, w, b, z, want = _inputs(name)
    for _ in range(2):
        np.testing.assert_allclose(_run(convs, name, x, w, b, z), want, rtol=1e-4, atol=1e-4)  # the engine's own
    assert noted == [("engine-check:res3", "node 'res3': the first run of engine:eng4_k24=2+bias+add+relu was not checked "
                                           "(no legacy algorithm of cuDNN computes its problem); it runs as recorded, unverified", False)]


def test_no_check_while_a_graph_is_captured_nor_when_turned_off(convs):
    _Plan.wrong = True
    name = "bias+add+relu"
    x, w, b, z, want = _inputs(name)
    convs.rt.check_first_run = False
    y = _run(convs, name, x, w, b, z)
    assert not np.allclose(y, want, rtol=1e-3, atol=1e-3) and convs.legacy == [] and convs.warnings == []  # turned off: what the plan gives
    convs.rt.check_first_run, convs.rt.capturing = True, True
    _run(convs, name, x, w, b, z)
    assert convs.legacy == [] and not convs.resolve(_call(name), np.float32, name).engine_checked  # left for the first eager run


@pytest.mark.parametrize("chunk", [engine_check.CHUNK_ELEMENTS, 12, 1])
def test_relative_error_sums_every_sample_and_says_inf_for_unwritten_output(monkeypatch, chunk):
    monkeypatch.setattr(engine_check, "CHUNK_ELEMENTS", chunk)  # one chunk, one sample per chunk, and less than a sample
    ref = np.arange(36, dtype=np.float32).reshape(3, 3, 4) + 1
    assert engine_check.relative_error(np, ref.copy(), ref) == 0.0
    out = ref.copy()
    out[2] *= 1.1  # the last sample off
    want = np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref.astype(np.float64))
    assert engine_check.relative_error(np, out, ref) == pytest.approx(want)
    out[0, 0, 0] = np.nan
    assert engine_check.relative_error(np, out, ref) == math.inf
    assert engine_check.relative_error(np, np.float32(3.0) * np.ones(5, np.float32), 3 * np.ones(5, np.float32)) == 0.0  # 1-D outputs


class _NoScalarOperators(np.ndarray):
    """An array that refuses to meet a Python scalar in an operator, as CuPy's does at a cost: its
    operator path with a scalar imports cupyx and SciPy (convpass/ops/arrays.py)."""

    def _refuse(self, other):
        if isinstance(other, (int, float)):
            raise AssertionError(f"a Python scalar {other!r} met an array in an operator")
        return NotImplemented

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse


def test_relative_error_never_adds_a_python_float_to_a_device_array():
    """The first run of a fresh process checks its engine steps with this function: a float meeting
    a CuPy array there imported cupyx and SciPy at start-up (0.3 s)."""
    class Xp:
        float64 = np.float64

    ref = (np.arange(24, dtype=np.float32) + 1).reshape(2, 3, 4)
    out = ref * np.float32(1.01)
    sums = []

    def sum_of(a):
        s = np.asarray(np.sum(np.asarray(a))).view(_NoScalarOperators)  # a 0-d device array, as CuPy's sum gives
        sums.append(s)
        return s

    class Arr(np.ndarray):
        def astype(self, dtype):
            return np.asarray(self).astype(dtype).view(Arr)

        def sum(self):
            return sum_of(self)

    err = engine_check.relative_error(Xp, out.view(Arr), ref.view(Arr))
    assert sums and err == pytest.approx(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref.astype(np.float64)))


# ---------------------------------------------------------------------------------------------
# a captured plan's first replay against its eager warm-up


class _Stream:
    """A CUDA stream whose capture records nothing: the graph it ends replays ``box["replay"]``."""

    def __init__(self, box):
        self.box = box

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def record(self):
        return None

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def begin_capture(self):
        pass

    def end_capture(self):
        box = self.box
        return types.SimpleNamespace(launch=lambda stream: box["replay"]())


class _Doubler:
    """A launch writing twice its input into a new array (as a plan's launch allocates its output)."""

    def __init__(self):
        from convpass.ops.registry import NodeInfo

        self.node = NodeInfo("double", "Mul", "", 17, {}, ["x"], ["y"])
        self.label, self.outputs = "Mul", (1,)

    def run(self, env):
        env[1] = env[0] * 2


def _capture_with(replay, monkeypatch):
    """Warm up and capture a one-launch plan whose graph replays ``replay(state)``; (state,
    the warm-up's results, the capture warnings). Fences, not edges (no driver here)."""
    monkeypatch.setattr(conv_exec, "FENCE", "memset")
    box = {}
    fake_cp = types.SimpleNamespace(
        empty=np.empty, copyto=np.copyto, float64=np.float64,
        cuda=types.SimpleNamespace(get_current_stream=lambda: _Stream(box), Stream=lambda non_blocking=True: _Stream(box),
                                   MemoryPool=lambda: types.SimpleNamespace(malloc=None), using_allocator=_Cuda.using_allocator))
    warned = []
    rt = types.SimpleNamespace(cp=fake_cp, capturing=False, host_syncs=0, uploads=0, check_first_run=True, warn_capture=warned.append)
    state = runner.CompiledPlan(launches=[_Doubler()], free=[()], capturable=True, mode="graph")
    box["replay"] = lambda: replay(state)
    plan = types.SimpleNamespace(template=[None, None], feed_slots={"x": 0}, output_slots=[1])
    results = runner._warm_up_and_capture(rt, plan, state, {"x": np.arange(6, dtype=np.float32)})
    return state, results, warned


def test_a_captured_plan_whose_first_replay_matches_its_warm_up_replays(monkeypatch):
    def faithful(state):
        state.outputs[0][...] = state.static_inputs["x"] * 2

    state, results, warned = _capture_with(faithful, monkeypatch)
    np.testing.assert_array_equal(results[0], np.arange(6) * 2)
    assert state.captured and state.mode == "graph" and warned == []


def test_a_captured_plan_whose_first_replay_differs_from_its_warm_up_runs_eagerly_said_once(monkeypatch):
    def stale(state):
        state.outputs[0][...] = state.static_inputs["x"] * 2 + 1  # what a launch reading stale buffers gives

    state, results, warned = _capture_with(stale, monkeypatch)
    np.testing.assert_array_equal(results[0], np.arange(6) * 2)  # the warm-up's: the plan's meaning
    assert not state.captured and state.segments is None and state.mode == "eager" and not state.capturable
    [note] = warned
    assert note == state.note and "output 0 of the captured graph's first replay differs from the eager warm-up's" in note
    assert note.endswith(": plan runs eagerly") and state.graph_status(cuda_graph=True).captured is False


def test_the_first_replay_is_not_checked_when_turned_off_and_only_floats_are_compared():
    launched = []
    state = runner.CompiledPlan(launches=[], free=[], capturable=True, mode="graph")
    state.segments = [types.SimpleNamespace(launch=lambda stream: launched.append(stream))]
    state.outputs = [np.array([1, 2, 3]), np.ones(3, np.float16) * 1.05]
    cp = types.SimpleNamespace(float64=np.float64, cuda=types.SimpleNamespace(get_current_stream=lambda: "stream"))
    rt = types.SimpleNamespace(cp=cp, check_first_run=False)
    assert runner.first_replay_differs(rt, state, [np.array([9, 9, 9]), np.ones(3, np.float16)]) is None and launched == []
    rt.check_first_run = True
    assert runner.first_replay_differs(rt, state, [np.array([9, 9, 9]), np.ones(3, np.float16) * 1.04]) is None  # ints skipped; fp16 within 1e-2
    why = runner.first_replay_differs(rt, state, [np.array([9, 9, 9]), np.ones(3, np.float16)])
    assert launched == ["stream", "stream"] and why.startswith("output 1 of the captured graph's first replay differs") and "(> 1e-02)" in why

"""A fresh process's GPU start-up work that runs beside the executor's own (CPU: fakes of the
driver, cuDNN and CuPy). The GPU side is tests/gpu/test_cold_start.py."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import types

import pytest

from convpass.core import annotation
from convpass.core.cudnn_enums import CudnnError
from convpass.core.problem import ConvShape, ProblemKey
from convpass.kernels.convolution import Convolutions
from convpass.native import cuda as common
from convpass.native import cudnn
from convpass.runtime.executor import _by_profile


class FakeDriver:
    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.fail = fail

    def __getattr__(self, name: str):
        def call(*args):
            self.calls.append((name, args))
            return 100 if name == self.fail else 0

        return call


def test_the_primary_context_is_made_through_the_driver_for_the_device_asked(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver if name == "libcuda.so.1" else pytest.fail(name))
    common.retain_primary_context(2)
    assert [c[0] for c in driver.calls] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]
    assert driver.calls[0][1] == (0,) and driver.calls[1][1][1] == 2


def test_a_driver_error_names_the_call_and_open_ahead_still_never_raises(monkeypatch):
    driver = FakeDriver(fail="cuDeviceGet")
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver)
    with pytest.raises(RuntimeError, match="cuDeviceGet returned CUDA error 100"):
        common.retain_primary_context(0)
    assert [c[0] for c in driver.calls] == ["cuInit", "cuDeviceGet"]  # stops at the failure
    monkeypatch.setattr(common, "_probe", lambda: "no CUDA GPU is visible")
    monkeypatch.setattr(common, "_reason_cache", [])
    assert common.open_ahead("cuda")() is None
    common.join_helpers()


def _key(c: int, layout: str = "nchw") -> str:
    return str(ProblemKey(ConvShape("fwd", 1, c, 8, (14, 14), (3, 3), (1, 1), (1, 1), (1, 1)), layout, "default"))


def _convs(recorded_device: str = "", current_device: str = "", device_id: int = 3) -> Convolutions:
    used: list[int] = []

    def device(i):
        used.append(i)
        return contextlib.nullcontext()

    cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0), Device=device)
    rt = types.SimpleNamespace(cp=types.SimpleNamespace(cuda=cuda), device_id=device_id, recorded_device=recorded_device,
                               current_device=current_device, devices_used=used)
    return Convolutions(rt)


@pytest.fixture
def fake_cudnn(monkeypatch):
    asked: list[tuple[str, str, object, object]] = []  # (problem, algo, handle, thread)
    handles: list[object] = []

    class Handle:
        def __init__(self, device):
            self.device, self.closed = device, False
            handles.append(self)

        def close(self):
            self.closed = True

    def workspace_size(descs, direction, algo, handle=None):
        asked.append((str(descs), algo, handle, threading.current_thread()))
        if algo == "winograd":
            raise CudnnError(3000, "cudnnGetConvolutionForwardWorkspaceSize")
        return 1000 + descs.shape.c

    monkeypatch.setattr(cudnn.api, "Handle", Handle)
    monkeypatch.setattr(cudnn, "workspace_size", workspace_size)
    monkeypatch.setattr(cudnn, "ConvDescriptors", lambda key: key)
    return asked, handles


def test_prefetch_asks_each_recorded_legacy_algorithm_once_on_a_thread_of_its_own(fake_cudnn):
    asked, handles = fake_cudnn
    D = annotation.ConvDecision
    convs = _convs(device_id=3)
    known = ProblemKey.parse(_key(5))
    convs.resources._workspace_bytes[(known, "gemm")] = 7  # asked already: not again
    decisions = [
        D(algo="implicit_gemm", problem_key=_key(3)),
        D(algo="implicit_gemm", problem_key=_key(3)),  # the same problem at another node
        D(algo="implicit_gemm", problem_key=_key(3, "nhwc")),
        D(algo="winograd", problem_key=_key(4)),  # refused by cuDNN: left for the plan to report
        D(algo="gemm", problem_key=_key(5)),
        D(algo="auto", problem_key=_key(6)),  # cuDNN's heuristic decides: nothing to ask
        D(algo="convpass_depthwise_r4", problem_key=_key(7)),  # convpass's own kernel
        D(algo="implicit_gemm", problem_key=""),  # no recorded problem
        D(algo="implicit_gemm", problem_key="not a key"),
    ]
    convs.prefetch_workspaces(decisions)
    common.join_helpers()
    assert [(k, a) for k, a, _, _ in asked] == [(_key(3), "implicit_gemm"), (_key(3, "nhwc"), "implicit_gemm"), (_key(4), "winograd")]
    # one handle of its own, on the backend's device (cuda:3), used and closed by the helper thread alone
    assert len(handles) == 1 and handles[0].device == 3 and handles[0].closed and convs.rt.devices_used == [3]
    assert {(h, t) for _, _, h, t in asked} == {(handles[0], convs.resources._prefetch)} and convs.resources._prefetch is not threading.current_thread()
    assert convs.resources._workspace_bytes == {
        (ProblemKey.parse(_key(3)), "implicit_gemm"): 1003,
        (ProblemKey.parse(_key(3, "nhwc")), "implicit_gemm"): 1003,
        (known, "gemm"): 7,
    }
    # what the plan asks later comes from the memo
    assert convs.resources.workspace_bytes(ProblemKey.parse(_key(3)), "implicit_gemm") == 1003 and len(asked) == 3


def test_no_prefetch_for_a_model_tuned_on_another_gpu_or_with_nothing_to_ask(fake_cudnn):
    asked, handles = fake_cudnn
    D = annotation.ConvDecision
    convs = _convs(recorded_device="NVIDIA H100 80GB HBM3|sm_90", current_device="NVIDIA H200|sm_90")
    convs.prefetch_workspaces([D(algo="implicit_gemm", problem_key=_key(3))])
    assert convs.resources._prefetch is None
    convs = _convs()
    convs.prefetch_workspaces([D(algo="auto", problem_key=_key(3))])
    common.join_helpers()
    assert convs.resources._prefetch is None and asked == [] and handles == []


def test_a_context_made_ahead_is_released_when_the_gpu_cannot_be_used(monkeypatch):
    """device='auto' on a machine with a driver but no CuPy or cuDNN runs on the host: the context
    the driver made ahead must not stay (it holds device memory for the life of the process)."""
    driver = FakeDriver()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver)
    monkeypatch.setattr(common, "_probe", lambda: "CuPy is not installed")
    monkeypatch.setattr(common, "_reason_cache", [])
    assert common.open_ahead("cuda:1")() is None
    assert [c[0] for c in driver.calls] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2"]
    assert driver.calls[1][1][1] == 1


def test_the_first_profiles_decisions_come_first():
    D = annotation.ConvDecision
    a = (D(algo="a1"), D(algo="a2"))
    b = (D(algo="b1"),)
    c = (D(algo="c1"), D(algo="c2"), D(algo="c3"))
    assert [d.algo for d in _by_profile([a, b, c])] == ["a1", "b1", "c1", "a2", "c2", "c3"]
    assert _by_profile([]) == []


def _bare_backend(allow_tf32: bool = True, epilogues: bool = True):
    from convpass.runtime.cuda.backend import CudaBackend

    rt = object.__new__(CudaBackend)  # no GPU here: only what ready_libraries and blas() read
    rt.cp, rt._device = types.SimpleNamespace(), contextlib.nullcontext()
    rt._blas, rt._blas_ahead, rt.capturing = None, None, False
    rt._allow_tf32, rt.matmul_epilogues, rt._warned, rt.notes = allow_tf32, epilogues, set(), []
    return rt


class _FakeBlas:
    made: list[tuple[str, object]] = []
    fail_warm = False

    def __init__(self, cupy) -> None:
        self.thread = threading.current_thread().name
        _FakeBlas.made.append(("made", self.thread))

    def warm(self, allow_tf32: bool, epilogues: bool) -> None:
        _FakeBlas.made.append(("warm", (allow_tf32, epilogues, threading.current_thread().name)))
        if _FakeBlas.fail_warm:
            raise RuntimeError("cuBLAS status 3")


@pytest.fixture
def fake_blas(monkeypatch):
    from convpass.native import cublas as blas

    monkeypatch.setattr(blas, "Blas", _FakeBlas)
    _FakeBlas.made, _FakeBlas.fail_warm = [], False
    yield _FakeBlas
    common.join_helpers()


def test_cublas_is_made_and_warmed_on_a_helper_thread_for_a_model_with_matmul(fake_blas):
    rt = _bare_backend(allow_tf32=False, epilogues=True)
    rt.ready_libraries({"Conv", "Relu", "Gemm"})
    made = rt.blas()  # waits for the helper
    assert isinstance(made, _FakeBlas) and made.thread == "convpass-cublas"
    assert fake_blas.made == [("made", "convpass-cublas"), ("warm", (False, True, "convpass-cublas"))]
    rt.ready_libraries({"MatMul"})  # made already: nothing more
    assert rt.blas() is made and len(fake_blas.made) == 2


def test_no_cublas_ahead_for_a_model_without_matmul_and_a_failure_ahead_is_met_again_by_the_plan(fake_blas):
    rt = _bare_backend()
    rt.ready_libraries({"Conv", "Relu", "GlobalAveragePool"})
    assert rt._blas_ahead is None and fake_blas.made == []
    fake_blas.fail_warm = True
    rt.ready_libraries({"MatMul"})
    rt._blas_ahead.join()
    assert rt._blas is None  # the helper's failure is not kept: blas() makes the handle again, on its own thread
    fake_blas.fail_warm = False
    made = rt.blas()
    assert made.thread == threading.current_thread().name


def test_the_executor_tells_its_backend_the_graph_s_op_types_before_any_plan():
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from convpass.kernels.backends import CpuBackend
    from convpass.runtime.executor import Executor

    class Recording(CpuBackend):
        told: list[set[str]] = []

        def ready_libraries(self, op_types):
            self.told.append(set(op_types))

    w = helper.make_tensor("w", TensorProto.FLOAT, (4, 2), np.ones(8, np.float32))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (3, 4))], [helper.make_tensor_value_info("z", TensorProto.FLOAT, (3, 2))], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    backend = Recording()
    ex = Executor(model, device=backend)
    assert Recording.told == [{"MatMul", "Relu"}]
    assert ex.run(None, {"x": np.ones((3, 4), np.float32)})[0].tolist() == [[4.0, 4.0]] * 3


@pytest.mark.parametrize("why_none,warns", [("", True), ("there is no kernel side-car m.onnx.kernels beside the model", False)])
def test_a_side_car_that_cannot_be_loaded_for_want_of_the_compiler_seam_is_said(monkeypatch, why_none, warns):
    """Without CuPy's compiler seam no binary loads and nothing is counted as compiled at start-up,
    so the note at the first run never comes: a side-car given is said to be unused at once."""
    from pathlib import Path

    from convpass.native import prebuilt
    from convpass.runtime.cuda import startup

    monkeypatch.setattr(prebuilt, "install", lambda: "CuPy 99 has no _compile_module_with_cache")
    monkeypatch.setattr(prebuilt, "use", lambda kernels: pytest.fail("no seam to load through"))
    said = []
    backend = types.SimpleNamespace(note_once=lambda tag, message, **kw: said.append(message))
    kernels = types.SimpleNamespace(path=Path("/models/m.onnx.kernels")) if warns else None
    startup.use_kernel_file(backend, kernels, why_none)
    assert backend.kernel_file is None and "CuPy 99" in backend._kernels_why
    if warns:
        assert len(said) == 1 and "m.onnx.kernels" in said[0] and "CuPy 99" in said[0] and "compile and cuDNN plans are built at start-up" in said[0], said
    else:
        assert said == []


# ---------------------------------------------------------------------------------------------
# the note on convs that run cuDNN's heuristic: untuned, or tuned for other shapes


def _heuristic_notes(profiles, plan_profile, decisions):
    """What lowering says about convs resolved to cuDNN's heuristic (``decisions``: node -> the
    decision its call carries, None for an untuned conv) in a plan of ``plan_profile``."""
    import numpy as np

    from convpass.kernels.convolution import ConvLaunch
    from convpass.ops.conv import ConvCall
    from convpass.runtime.cuda import lowering

    launches = []
    for node, decision in decisions.items():
        launch = object.__new__(ConvLaunch)
        launch.call = ConvCall(node, None, decision, None)
        launch.exec = types.SimpleNamespace(source="untuned")
        launches.append(launch)
    plan = types.SimpleNamespace(convs=[], profile=plan_profile, feed_slots={"input": 0, "mask": 1},
                                 value_info={0: ((8, 3, 224, 224), np.dtype(np.float32)), 1: ((8, 4), np.dtype(np.float32))})
    said = []
    rt = types.SimpleNamespace(profiles=profiles, convs=types.SimpleNamespace(mismatch_nodes=[]),
                               note_once=lambda tag, message, **kw: said.append((tag, message)))
    lowering._conv_notes(rt, plan, launches)
    return said


def test_a_tuned_model_run_at_a_shape_of_none_of_its_profiles_says_so_not_untuned():
    profiles = (annotation.Profile("b1", {"input": (1, 3, 224, 224)}), annotation.Profile("b32", {"input": (32, 3, 224, 224)}))
    [(tag, message)] = _heuristic_notes(profiles, None, {"c1": annotation.ConvDecision(), "c2": annotation.ConvDecision()})
    assert "untuned" not in message and "\n" not in message, message
    assert "tuned for shape profiles input=1x3x224x224, input=32x3x224x224" in message
    assert "input=8x3x224x224 matches none" in message and "'c1', 'c2'" in message
    assert "`convpass optimize --retune --shape input=1x3x224x224 --shape input=32x3x224x224 --shape input=8x3x224x224`" in message
    assert "shapes=" in message
    assert _heuristic_notes(profiles, None, {"c1": annotation.ConvDecision()})[0][0] == tag  # said once per shape


def test_an_untuned_model_or_conv_is_still_called_untuned():
    [(_, message)] = _heuristic_notes((), 0, {"c1": None})
    assert message.startswith("1 convolution(s) untuned: using cuDNN's heuristic (NCHW) for 'c1'") and "convpass optimize" in message
    profiles = (annotation.Profile("b1", {"input": (1, 3, 224, 224)}),)
    said = _heuristic_notes(profiles, None, {"c1": None, "c2": annotation.ConvDecision()})  # a conv the tuner left alone
    assert [m.split(" (NCHW) for ")[0] for _, m in said] == ["1 convolution(s) untuned: using cuDNN's heuristic", "1 convolution(s) run cuDNN's heuristic"], said
    assert said[0][1].startswith("1 convolution(s) untuned: using cuDNN's heuristic (NCHW) for 'c1';") and "'c2'" in said[1][1]


# ---------------------------------------------------------------------------------------------
# the start-up compile note counts the whole first call: the op-by-op run that records the plan too


def test_kernels_compiled_by_the_run_that_records_a_plan_are_counted_at_start_up(monkeypatch):
    from convpass.native import prebuilt
    from convpass.runtime.cuda import lowering, runner
    from convpass.runtime.cuda.runner import CompiledPlan

    monkeypatch.setattr(prebuilt, "COMPILATIONS", ["from an earlier executor"])
    said = []
    rt = _bare_backend()
    rt.note_once = lambda tag, message, **kw: said.append((tag, message, kw.get("category")))
    rt.convs = types.SimpleNamespace(engine_builds=[("earlier", 9.0, "")])
    rt.kernel_file, rt._kernels_why, rt._tf32_now = None, "there is no kernel side-car m.onnx.kernels beside the model", False

    def lower(backend, plan):
        prebuilt.COMPILATIONS.append("convpass_ew_lowered")
        rt.convs.engine_builds.append(("c2", 0.3, "no side-car"))
        return CompiledPlan(launches=[], free=[], capturable=True, mode="graph")

    def first_run(backend, plan, feeds):
        prebuilt.COMPILATIONS.append("cupy_copy_warm_up")
        return []

    monkeypatch.setattr(lowering, "compile_plan", lower)
    monkeypatch.setattr(runner, "run_plan", first_run)
    rt.begin_plan()  # the plan builder's op-by-op run starts here
    prebuilt.COMPILATIONS += ["cupy_add_op_by_op", "convpass_relu_op_by_op"]
    rt.convs.engine_builds.append(("c1", 0.4, "no side-car"))
    plan = types.SimpleNamespace(steps=[object()], matmul_allow_tf32=False, backend_state=None)
    rt.compile_plan(plan)
    rt.run_plan(plan, {})
    from convpass.native.cuda import StartupCompileWarning

    by_tag = {tag: (message, category) for tag, message, category in said}
    message, category = by_tag["startup-compile"]
    assert category is StartupCompileWarning and message.startswith("4 kernel(s) compiled at start-up (convpass_ew_lowered, "), message
    assert "cupy_add_op_by_op" in message and "convpass_relu_op_by_op" in message and "earlier" not in message
    assert by_tag["engine-build"][0].startswith("2 cuDNN graph-API plan(s) built at start-up in 0.70 s"), by_tag["engine-build"]
    rt.run_plan(plan, {})  # later runs: nothing more said
    assert [tag for tag, _, _ in said if tag in ("startup-compile", "engine-build")] == ["engine-build", "startup-compile"]


def test_the_plan_builder_marks_the_start_of_a_plan_before_its_op_by_op_run():
    import numpy as np
    from conftest import conv_model

    from convpass.kernels.backends import CpuBackend
    from convpass.runtime.executor import Executor

    class Recording(CpuBackend):
        calls: list[str] = []

        def begin_plan(self):
            self.calls.append("begin_plan")

        def conv(self, x, w, b, call):
            self.calls.append("conv")
            return super().conv(x, w, b, call)

        def compile_plan(self, plan):
            self.calls.append("compile_plan")

    ex = Executor(conv_model("Conv", [1, 4, 6, 6], (3, 4, 3, 3)), device=Recording())
    ex.run(None, {"x": np.ones((1, 4, 6, 6), np.float32)})
    ex.run(None, {"x": np.ones((1, 4, 6, 6), np.float32)})
    assert Recording.calls[:3] == ["begin_plan", "conv", "compile_plan"]

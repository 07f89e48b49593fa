"""The cuda backend: CuPy arrays on one GPU, the executor's :class:`~convpass.kernels.backends.Backend`.

This module holds what is about arrays and the device: transfers (uploads with a host mirror so
constants never need a device sync, feeds adopted from DLPack), the matmul path that CUDA graphs
can capture (cuBLAS by ctypes, :mod:`convpass.native.cublas`), the model's TF32 switch for Gemm / MatMul, and the
notes and warnings. What runs how is decided elsewhere, in layers that depend one way:

    lowering (:mod:`convpass.runtime.cuda.lowering`: per step, which kernel — :mod:`convpass.kernels.convolution`, :mod:`convpass.kernels.elementwise`,
    :mod:`convpass.kernels.normalization`, :mod:`convpass.kernels.pooling`, :mod:`convpass.kernels.tensor_ops`, or the op library)
    -> memory plan (:mod:`convpass.runtime.cuda.memory`: Concat buffers that producers write into)
    -> compiled plan (every launch prepared: kernels built, descriptors, workspaces, tables)
    -> runner (:mod:`convpass.runtime.cuda.runner`: warm-up, capture as CUDA graphs, replay)

Memory formats: arrays keep their logical ONNX (channels-first) shapes; an NHWC conv stores its
output channels-last (a transposed view, :func:`convpass.native.cudnn.empty_like_layout`), element-wise
ops, pooling, Resize and the fused groups run on that storage and keep it, so a chain of NHWC
convs never transposes (the layout planner's assumption). Other ops work on the logical view.

Gemm / MatMul: cuBLAS through :mod:`convpass.native.cublas` because CuPy refuses cuBLAS calls during stream
capture; cases it does not cover go to ``cupy.matmul`` (and that launch then runs eagerly between
graphs). TF32 follows the model's ``convpass.matmul_allow_tf32``: ``CUBLAS_COMPUTE_32F_FAST_TF32``
or ``CUBLAS_COMPUTE_32F``; for the ``cupy.matmul`` fallback CuPy's float32 compute type and the
math mode of CuPy's cuBLAS handle are set while the executor runs and restored after.

Options: ``CudaBackend(device=0, cuda_graph=True, *, fuse=True, fuse_residual=True, kernels=True,
concat_in_place=True, pooling="auto", matmul_epilogues=True)``: ``fuse=False`` turns every fusion
off (conv epilogues, element-wise groups, MatMul / Gemm epilogues); ``matmul_epilogues=False`` runs
a MatMul's bias, residual and ReLU as element-wise ops instead of cuBLASLt epilogues
(:mod:`convpass.kernels.matmul`); ``kernels=False`` leaves normalization, softmax, pooling and Resize to the op
library; ``concat_in_place=False`` makes every Concat copy; ``pooling`` is ``"auto"`` (the measured
choice), ``"cudnn"`` or ``"kernel"``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import warnings
from typing import Any

import numpy as np

from convpass.kernels.backends import Backend
from convpass.ops.conv import ConvCall
from convpass.runtime.cuda import lowering, runner
from convpass.native import prebuilt
from convpass.native.cuda import CaptureBreak, ExecutorWarning, StartupCompileWarning, device_index, start_helper, unavailable_reason
from convpass.native.cudnn.graph_api import FUSIONS
from convpass.kernels.convolution import ENGINE_BUILD_NOTE_S, Convolutions, fusion_counter
from convpass.core.errors import ExecutorError
from convpass.kernels.plan import GraphStatus, Plan

logger = logging.getLogger("convpass")

__all__ = ["CudaBackend"]

# Host tables up to this size are cached by content in ``constant`` (pool offsets, resize indices).
_CONTENT_KEY_BYTES = 1 << 16
# DLPack device types of CUDA memory (kDLCUDA, kDLCUDAHost, kDLCUDAManaged).
_DLPACK_CUDA = (2, 3, 13)
_POOLING = ("auto", "cudnn", "kernel")


class _Namespace:
    """``cupy`` for the ops, except ``matmul``: the backend's capturable cuBLAS path."""

    def __init__(self, cupy: Any, backend: "CudaBackend") -> None:
        self.__dict__["_cupy"] = cupy
        self.__dict__["_backend"] = backend

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._cupy, name)
        self.__dict__[name] = value  # looked up once
        return value

    def matmul(self, a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        return self._backend._matmul(a, b, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<cupy namespace of the convpass cuda backend (CuPy {self._cupy.__version__})>"


class CudaBackend(Backend):
    """CuPy + cuDNN on one GPU (see the module docstring)."""

    name = "cuda"

    def __init__(
        self,
        device: Any = 0,
        cuda_graph: bool = True,
        *,
        fuse: bool = True,
        fuse_residual: bool = True,
        kernels: bool = True,
        concat_in_place: bool = True,
        pooling: str = "auto",
        matmul_epilogues: bool = True,
    ) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise ExecutorError(f"cuda backend not available: {reason}")
        if pooling not in _POOLING:
            raise ExecutorError(f"pooling must be one of {', '.join(_POOLING)}, not {pooling!r}")
        import cupy

        self.cp = cupy
        self.xp = _Namespace(cupy, self)
        self.device_id = device_index(device)
        count = int(cupy.cuda.runtime.getDeviceCount())
        if not 0 <= self.device_id < count:
            raise ExecutorError(f"CUDA device {self.device_id} does not exist ({count} visible)")
        self._device = cupy.cuda.Device(self.device_id)
        self.cuda_graph = bool(cuda_graph)
        self.fuse = bool(fuse)
        self.fuse_residual = bool(fuse and fuse_residual)
        self.kernels = bool(kernels)
        self.concat_in_place = bool(concat_in_place)
        self.pooling = pooling
        self.matmul_epilogues = bool(fuse and matmul_epilogues)
        self._mirror: dict[int, tuple[Any, np.ndarray]] = {}  # id(device array) -> (device array, host array)
        self._consts: dict[Any, tuple[Any, Any]] = {}
        self.capturing = False  # a CUDA graph is being captured: transfers are refused
        self.host_syncs = 0  # device -> host copies of computed values
        self.uploads = 0  # host -> device copies while running
        self._allow_tf32 = False
        self._tf32_now = False
        self._blas: Any = None  # blas.Blas, False when it cannot be loaded
        self._blas_ahead: Any = None  # the helper thread that makes it ahead (ready_libraries)
        self._erf_kernel: Any = None
        self.recorded_device = ""
        self.current_device: Any = None
        self._warned: set[str] = set()
        self.notes: list[str] = []  # every warning / note this backend emitted, in order
        self.kernel_file: Any = None  # the model's kernel side-car in use (convpass.core.kernel_file.KernelFile)
        self._kernels_why = "no model was bound"
        # Set to a list to profile eager runs: (launch label, op type of its node, start event, end event)
        # per launch run; the label says which kernel ran ("fused Sigmoid+Mul", "MaxPool (kernel)", ...).
        self.step_events: list[tuple[str, str, Any, Any, str]] | None = None
        self.step_event_ops: frozenset[str] | None = None  # only launches of these op types get events (None: all)
        # a Counter: a launch kind with no entry yet counts from 0 instead of failing the run
        self.counters: collections.Counter[str] = collections.Counter({
            "cudnn_calls": 0, "fused_relu": 0, "fused_identity": 0, "fused_residual_relu": 0, "fused_residual_identity": 0,
            "reference_convs": 0, "graph_replays": 0, "layout_copies": 0, "fused_elementwise": 0, "graph_api_calls": 0,
            "own_kernel_calls": 0, **{fusion_counter(f): 0 for f in FUSIONS},
        })
        self.convs = Convolutions(self)

    # ------------------------------------------------------------------ Backend interface

    def describe(self) -> str:
        cp = self.cp
        try:
            from convpass.native.cudnn import library

            props = cp.cuda.runtime.getDeviceProperties(self.device_id)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            v = library.version()
            cudnn = f"cuDNN {v // 10000}.{v // 100 % 100}.{v % 100}"
        except Exception:  # noqa: BLE001
            name, cudnn = "?", "cuDNN ?"
        graphs = "CUDA graphs" if self.cuda_graph else "eager"
        return f"cuda:{self.device_id} ({name}, {cudnn}, CuPy {cp.__version__}, {graphs})"

    def fingerprint(self) -> Any:
        """This GPU's device fingerprint (detected once, on this backend's device)."""
        if self.current_device is None:
            from convpass.native import device as device_mod

            with self._device:
                self.current_device = device_mod.detect()
        return self.current_device

    def bind_model(self, model_info: Any) -> None:
        """The executor's model metadata: the device whose decisions it holds (to re-validate against
        this GPU: a model without a table for this GPU runs cuDNN's heuristic, with one warning), the
        matmul TF32 switch."""
        self._allow_tf32 = bool(model_info is not None and model_info.matmul_allow_tf32)
        self.recorded_device = (model_info.device if model_info is not None else "") or ""
        self.fingerprint()

    def prefetch(self, decisions: Any) -> None:
        self.convs.prefetch_workspaces(decisions)

    def use_kernels(self, kernels: Any, why_none: str) -> None:
        """The model's kernel side-car: its binaries replace start-up compilation (:mod:`convpass.native.prebuilt`).
        A refused side-car is warned about now; kernels built anyway are warned about at the first run."""
        reason = prebuilt.install()
        if reason is not None:
            why_none = f"kernels cannot be loaded prebuilt here: {reason}"
        elif kernels is not None:
            prebuilt.use(kernels)
        self.kernel_file = kernels if reason is None else None
        self._kernels_why = why_none
        if kernels is None and why_none.startswith("the side-car was refused"):
            self.note_once("kernels", f"kernel side-car: {why_none.removeprefix('the side-car was refused: ')}; kernels compile at start-up")

    def _note_startup_compilations(self, built: list[str]) -> None:
        names = sorted(set(built))
        listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        kf = self.kernel_file
        if kf is None:
            why = self._kernels_why
        else:
            arch = prebuilt.device_arch()
            if arch not in kf.archs:
                why = f"{kf.path.name} holds binaries for sm_{', sm_'.join(kf.archs) or '-'} and this GPU is sm_{arch} (`convpass compile --arch {arch}` adds it)"
            else:
                why = (f"{kf.path.name} lacks them (written by convpass {kf.convpass_version}, CuPy {kf.cupy_version}; "
                       f"this is CuPy {self.cp.__version__}): run `convpass compile` on the model again")
        self.note_once("startup-compile", f"{len(built)} kernel(s) compiled at start-up ({listed}): {why}", category=StartupCompileWarning)

    def upload(self, array: np.ndarray) -> Any:
        if self.capturing:
            raise CaptureBreak("host -> device upload")
        self.uploads += 1
        return self._upload(array)

    def _upload(self, array: Any) -> Any:
        host = np.asarray(array)
        with self._device:
            dev = self.cp.asarray(host)
        self._mirror[id(dev)] = (dev, host)
        return dev

    def upload_constant(self, array: np.ndarray) -> Any:
        """A table built when a plan is compiled (not counted as an upload while running)."""
        return self._upload(array)

    def upload_input(self, array: np.ndarray) -> Any:
        """A feed: uploaded without a host mirror (it is not kept)."""
        with self._device:
            return self.cp.asarray(array)

    def adopt(self, value: Any) -> Any:
        """A CUDA array of another library (DLPack), as a CuPy array without a copy; None if not one."""
        if isinstance(value, self.cp.ndarray):
            return value
        probe = getattr(value, "__dlpack_device__", None)
        if probe is None or not hasattr(value, "__dlpack__"):
            return None
        try:
            kind, _ = probe()
        except Exception:  # noqa: BLE001
            return None
        if int(kind) not in _DLPACK_CUDA:
            return None
        with self._device:
            return self.cp.from_dlpack(value)

    def constant(self, array: np.ndarray) -> Any:
        a = np.asarray(array)
        if a.nbytes <= _CONTENT_KEY_BYTES:
            key: Any = ("value", a.dtype.str, a.shape, a.tobytes())
            hit = self._consts.get(key)
        else:
            key = ("id", id(array))
            hit = self._consts.get(key)
            if hit is not None and hit[0] is not array:
                hit = None
        if hit is None:
            if self.capturing:
                raise CaptureBreak("host -> device upload of a new table")
            hit = self._consts[key] = (array, self._upload(a))
        return hit[1]

    def is_constant(self, a: Any) -> bool:
        hit = self._mirror.get(id(a))
        return hit is not None and hit[0] is a

    def to_host(self, x: Any) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x
        hit = self._mirror.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        if not isinstance(x, self.cp.ndarray):
            return np.asarray(x)
        if self.capturing:
            raise CaptureBreak("device -> host copy")
        self.host_syncs += 1
        with self._device:
            return self.cp.asnumpy(x)

    def erf(self, x: Any) -> Any:
        # A kernel of our own, not cupyx.scipy.special.erf: importing cupyx imports SciPy, 0.3 s of
        # a fresh process's start-up (measured on the H200 machine). float16 is computed in float32.
        if self._erf_kernel is None:
            self._erf_kernel = self.cp.ElementwiseKernel("T x", "T y", "y = erf(x)", "convpass_erf")
        wide = x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)
        return self._erf_kernel(wide).astype(x.dtype, copy=False)

    def errstate(self) -> contextlib.AbstractContextManager[Any]:
        return self._scope(self._allow_tf32)

    @contextlib.contextmanager
    def _scope(self, allow_tf32: bool):
        with self._device, self._matmul_math(allow_tf32):
            yield

    def synchronize(self) -> None:
        with self._device:
            self.cp.cuda.get_current_stream().synchronize()

    def conv(self, x: Any, w: Any, b: Any, call: ConvCall) -> Any:
        return self.convs.run(call, x, w, b)

    def conv_transpose(self, x: Any, w: Any, b: Any, call: ConvCall) -> Any:
        return self.convs.run(call, x, w, b)

    # ------------------------------------------------------------------ plans

    def compile_plan(self, plan: Plan) -> None:
        """Lower, plan memory and prepare every launch (:mod:`convpass.runtime.cuda.lowering`); take over execution."""
        if not plan.steps:
            return
        mark = len(prebuilt.COMPILATIONS)
        engines_mark = len(self.convs.engine_builds)
        with self._device:
            plan.backend_state = lowering.compile_plan(self, plan)
        plan.backend_state.compilations_from = mark
        self._note_engine_builds(self.convs.engine_builds[engines_mark:])

    def _note_engine_builds(self, builds: list[tuple[str, float, str]]) -> None:
        seconds = sum(s for _, s, _ in builds)
        if seconds >= ENGINE_BUILD_NOTE_S:
            slow = sorted(builds, key=lambda b: -b[1])[:3]
            listed = ", ".join(f"{node!r} {s:.2f} s" for node, s, _ in slow)
            whys = sorted({why for _, _, why in builds})
            why = whys[0] if len(whys) == 1 else "; ".join(whys[:3])
            hint = "" if self.kernel_file is not None else " (`convpass compile` on a GPU stores them)"
            self.note_once("engine-build", f"{len(builds)} cuDNN graph-API plan(s) built at start-up in {seconds:.2f} s "
                           f"(slowest: {listed}): cuDNN compiles some engines when their plan is built, and {why}{hint}",
                           category=StartupCompileWarning)

    def run_plan(self, plan: Plan, feeds: dict[str, Any]) -> list[Any]:
        with self._device, self._matmul_math(plan.matmul_allow_tf32):
            outs = runner.run_plan(self, plan, feeds)
        state = plan.backend_state
        if state.compilations_from is not None:  # the first run: lowering, warm-up and capture are done
            built = prebuilt.COMPILATIONS[state.compilations_from:]
            state.compilations_from = None
            if built:
                self._note_startup_compilations(built)
        return outs

    def replay(self, plan: Plan, feeds: dict[str, Any]) -> list[Any] | None:
        with self._device:
            return runner.replay_whole(self, plan, feeds)

    def warm_up(self, plan: Plan, feeds: dict[str, Any]) -> None:
        state = plan.backend_state
        if state is not None and state.compilations_from is not None:  # its first run has not happened
            self.run_plan(plan, feeds)

    def graph_status(self, plan: Plan) -> GraphStatus:
        state = plan.backend_state
        if state is None:
            return GraphStatus(None, "the plan has no steps" if not plan.steps else "not compiled")
        return state.graph_status(self.cuda_graph)

    def concat_allocator(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """The function that allocates a Concat family's buffer in a memory format (:mod:`convpass.runtime.cuda.memory`)."""
        from convpass.native import cudnn

        def allocate(layout: str) -> Any:
            if len(shape) >= 3:
                return cudnn.empty_like_layout(shape, dtype, layout)
            return self.cp.empty(shape, dtype=dtype)

        return allocate

    # ------------------------------------------------------------------ matmul TF32

    def _matmul(self, a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        """``xp.matmul``: cuBLAS by ctypes (capturable, explicit TF32 switch), else ``cupy.matmul``."""
        cp = self.cp
        if not args and not kwargs and isinstance(a, cp.ndarray) and isinstance(b, cp.ndarray):
            blas = self.blas()
            if blas:
                try:
                    out = blas.matmul(a, b, self._tf32_now)
                except RuntimeError as e:
                    if self.capturing:
                        raise
                    logger.debug("cuBLAS by ctypes failed (%s): cupy.matmul instead", e)
                    out = None
                if out is not None:
                    return out
        if self.capturing:
            raise CaptureBreak(f"a matmul of shapes {getattr(a, 'shape', '?')} @ {getattr(b, 'shape', '?')} needs cupy.matmul, which cannot be captured")
        return cp.matmul(a, b, *args, **kwargs)

    def ready_libraries(self, op_types: Any) -> None:
        """cuBLAS made ahead, on a helper thread, for a model with MatMul or Gemm (top-level nodes):
        the handle, its workspace and a first small product (:meth:`convpass.native.cublas.Blas.warm`). A fresh
        ConvNeXt process's plan was sampled about 0.15 s in its first GEMM calls on an H200; these
        are ctypes calls, which let go of the GIL while the executor goes on reading the model and
        building its plan. A failure there is only logged (debug): :meth:`blas` then makes the
        handle on the calling thread, as without this, and reports what fails there."""
        if self._blas is not None or self._blas_ahead is not None or not {"MatMul", "Gemm"} & set(op_types):
            return
        from convpass.native import cublas as blas

        def make() -> None:
            try:
                with self._device:
                    made = blas.Blas(self.cp)
                    made.warm(self._allow_tf32, self.matmul_epilogues)
                self._blas = made
            except Exception as e:  # noqa: BLE001
                logger.debug("cuBLAS ahead of time failed (%s); it is made again when needed", e)

        self._blas_ahead = start_helper(make, "convpass-cublas")

    def blas(self) -> Any:
        """The backend's :class:`convpass.native.cublas.Blas` (created on first use, or ahead by
        :meth:`ready_libraries`; never during capture), or False when cuBLAS cannot be called
        directly (noted once)."""
        if self._blas_ahead is not None:
            self._blas_ahead.join()
            self._blas_ahead = None
        if self._blas is None:
            if self.capturing:
                raise CaptureBreak("cuBLAS handle created during capture")
            from convpass.native import cublas as blas

            try:
                with self._device:
                    self._blas = blas.Blas(self.cp)
            except Exception as e:  # noqa: BLE001
                self._blas = False
                self.note_once("blas", f"cuBLAS cannot be called directly ({e}): Gemm / MatMul use cupy.matmul, which runs eagerly between CUDA graphs")
        return self._blas

    @contextlib.contextmanager
    def _matmul_math(self, allow_tf32: bool):
        restore = []
        tf32_before = self._tf32_now
        self._tf32_now = bool(allow_tf32)
        restore.append(lambda: setattr(self, "_tf32_now", tf32_before))

        def cupy_compute_type() -> tuple[Any, Any, Any]:
            from cupy._core import _routines_linalg as lin

            f32 = np.dtype(np.float32)
            want = getattr(lin, "COMPUTE_TYPE_TF32", 7) if allow_tf32 else getattr(lin, "COMPUTE_TYPE_DEFAULT", 1)
            return (lambda: lin.get_compute_type(f32)), (lambda v: lin.set_compute_type(f32, v)), want

        def cublas_math_mode() -> tuple[Any, Any, Any]:
            from cupy_backends.cuda.libs import cublas

            handle = self.cp.cuda.device.get_cublas_handle()
            want = getattr(cublas, "CUBLAS_TF32_TENSOR_OP_MATH", 3) if allow_tf32 else getattr(cublas, "CUBLAS_DEFAULT_MATH", 0)
            return (lambda: cublas.getMathMode(handle)), (lambda v: cublas.setMathMode(handle, v)), want

        for tag, what, switch in (("compute_type", "CuPy's float32 matmul compute type", cupy_compute_type),
                                  ("cublas_math", "the cuBLAS math mode", cublas_math_mode)):
            try:
                get, put, want = switch()
                before = get()
                if before != want:
                    put(want)
                    restore.append(lambda put=put, before=before: put(before))
            except Exception as e:  # noqa: BLE001
                self.note_once(tag, f"cannot set {what}: {e}", warn=False)
        try:
            yield
        finally:
            for undo in reversed(restore):
                try:
                    undo()
                except Exception:  # noqa: BLE001
                    pass

    # ------------------------------------------------------------------ notes

    def note_once(self, tag: str, message: str, warn: bool = True, category: type[Warning] = ExecutorWarning) -> None:
        if tag in self._warned:
            return
        self._warned.add(tag)
        self.notes.append(message)
        if warn:
            warnings.warn(message, category, stacklevel=4)
        else:
            logger.debug("%s", message)

    def warn_node(self, node: str, message: str) -> None:
        """One warning per node, whatever else was said about it."""
        self.note_once(f"node:{node}", message)

    def warn_capture(self, note: str) -> None:
        """A plan that does not run as one CUDA graph: warned once per reason (runner, lowering)."""
        self.note_once(f"capture:{note}", f"CUDA graph: {note}")

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
capture, with the model's TF32 switch (:mod:`convpass.runtime.cuda.matmul_path`). The device it
opens: :mod:`convpass.runtime.cuda.device`; what it builds at start-up (the kernel side-car, the
notes on what compiles anyway): :mod:`convpass.runtime.cuda.startup`.

Options: ``CudaBackend(device=0, cuda_graph=True, *, fuse=True, fuse_residual=True, kernels=True,
concat_in_place=True, pooling="auto", matmul_epilogues=True, check_first_run=True)``: ``fuse=False`` turns every fusion
off (conv epilogues, element-wise groups, MatMul / Gemm epilogues); ``matmul_epilogues=False`` runs
a MatMul's bias, residual and ReLU as element-wise ops instead of cuBLASLt epilogues
(:mod:`convpass.kernels.matmul`); ``kernels=False`` leaves normalization, softmax, pooling and Resize to the op
library; ``concat_in_place=False`` makes every Concat copy; ``pooling`` is ``"auto"`` (the measured
choice), ``"cudnn"`` or ``"kernel"``; ``check_first_run=False`` skips the checks of a plan's first
run: each graph-API engine step against a legacy algorithm of its problem
(:mod:`convpass.kernels.engine_check`), and the captured graph's first replay against the eager
warm-up (:mod:`convpass.runtime.cuda.runner`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import warnings
from typing import Any

import numpy as np

from convpass.core.errors import ExecutorError
from convpass.kernels.backends import Backend
from convpass.kernels.conv_exec import EPILOGUE_PASSES
from convpass.kernels.convolution import Convolutions
from convpass.kernels.plan import GraphStatus, Plan
from convpass.native import prebuilt
from convpass.native.cuda import CaptureBreak, ExecutorWarning, unavailable_reason
from convpass.native.cudnn.graph_api import FUSION_COUNTERS
from convpass.ops.conv import ConvCall
from convpass.runtime.cuda import device as cuda_device
from convpass.runtime.cuda import lowering, matmul_path, runner, startup

logger = logging.getLogger("convpass")

__all__ = ["CudaBackend"]

# Host tables up to this size are cached by content in ``constant`` (pool offsets, resize indices).
_CONTENT_KEY_BYTES = 1 << 16
# DLPack device types of CUDA memory (kDLCUDA, kDLCUDAHost, kDLCUDAManaged).
_DLPACK_CUDA = (2, 3, 13)
_POOLING = ("auto", "cudnn", "kernel")


def launch_counters() -> collections.Counter[str]:
    """The backend's launch counters, every known kind at 0 (a Counter: a launch kind with no entry
    yet counts from 0 instead of failing the run)."""
    return collections.Counter({
        "cudnn_calls": 0, "fused_relu": 0, "fused_identity": 0, "fused_residual_relu": 0, "fused_residual_identity": 0,
        "reference_convs": 0, "graph_replays": 0, "layout_copies": 0, "layout_conversions": 0, "slice_reads": 0, "slice_copies": 0, "slice_writes": 0, "slice_write_copies": 0,
        "residual_slice_reads": 0, "residual_copies": 0, "fused_elementwise": 0, "graph_api_calls": 0, "programmatic_edges_rewritten": 0,
        "own_kernel_calls": 0, EPILOGUE_PASSES: 0, **dict.fromkeys(FUSION_COUNTERS, 0),
    })


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
        check_first_run: bool = True,
    ) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise ExecutorError(f"cuda backend not available: {reason}")
        if pooling not in _POOLING:
            raise ExecutorError(f"pooling must be one of {', '.join(_POOLING)}, not {pooling!r}")
        self.cp, self.device_id, self._device = cuda_device.open_device(device)
        self.xp = matmul_path.CupyNamespace(self.cp, self)
        self.cuda_graph = bool(cuda_graph)
        self.fuse = bool(fuse)
        self.fuse_residual = bool(fuse and fuse_residual)
        self.kernels = bool(kernels)
        self.concat_in_place = bool(concat_in_place)
        self.pooling = pooling
        self.matmul_epilogues = bool(fuse and matmul_epilogues)
        self.check_first_run = bool(check_first_run)
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
        self.profiles: tuple[Any, ...] = ()  # the model's shape profiles (annotation.Profile)
        self.current_device: Any = None
        self._warned: set[str] = set()
        self.notes: list[str] = []  # every warning / note this backend emitted, in order
        self._plan_marks: tuple[int, int] | None = None  # at begin_plan: lengths of the compilation and engine-build lists
        self.kernel_file: Any = None  # the model's kernel side-car in use (convpass.core.kernel_file.KernelFile)
        self._kernels_why = "no model was bound"
        # Set to a list to profile eager runs: (launch label, op type of its node, start event, end event)
        # per launch run; the label says which kernel ran ("fused Sigmoid+Mul", "MaxPool (kernel)", ...).
        self.step_events: list[tuple[str, str, Any, Any, str]] | None = None
        self.step_event_ops: frozenset[str] | None = None  # only launches of these op types get events (None: all)
        self.counters = launch_counters()
        self.convs = Convolutions(self)

    # ------------------------------------------------------------------ Backend interface

    def describe(self) -> str:
        return cuda_device.describe(self.cp, self.device_id, self.cuda_graph)

    def fingerprint(self) -> Any:
        """This GPU's device fingerprint (detected once, on this backend's device)."""
        if self.current_device is None:
            from convpass.native import device as device_mod

            with self._device:
                self.current_device = device_mod.detect()
        return self.current_device

    def bind_model(self, model_info: Any) -> None:
        """The executor's model metadata: the device whose decisions it holds (to re-validate against
        this GPU: a model without a table for this GPU runs cuDNN's heuristic, with one warning), its
        shape profiles (named when a run's shape matches none), the matmul TF32 switch."""
        self._allow_tf32 = bool(model_info is not None and model_info.matmul_allow_tf32)
        self.recorded_device = (model_info.device if model_info is not None else "") or ""
        self.profiles = tuple(model_info.profiles) if model_info is not None else ()
        self.fingerprint()

    def prefetch(self, decisions: Any) -> None:
        self.convs.prefetch_workspaces(decisions)

    def use_kernels(self, kernels: Any, why_none: str) -> None:
        """The model's kernel side-car (:func:`convpass.runtime.cuda.startup.use_kernel_file`)."""
        startup.use_kernel_file(self, kernels, why_none)

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
        # A kernel of our own, not cupyx.scipy.special.erf: importing cupyx imports SciPy, a large
        # part of a fresh process's start-up. float16 is computed in float32.
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

    def begin_plan(self) -> None:
        """The op-by-op run that records a plan starts: what it compiles is start-up work of that plan."""
        self._plan_marks = (len(prebuilt.COMPILATIONS), len(self.convs.engine_builds))

    def compile_plan(self, plan: Plan) -> None:
        """Lower, plan memory and prepare every launch (:mod:`convpass.runtime.cuda.lowering`); take over execution."""
        marks, self._plan_marks = self._plan_marks, None
        if not plan.steps:
            return
        mark, engines_mark = marks or (len(prebuilt.COMPILATIONS), len(self.convs.engine_builds))
        with self._device:
            plan.backend_state = lowering.compile_plan(self, plan)
        plan.backend_state.compilations_from = mark
        startup.note_engine_builds(self, self.convs.engine_builds[engines_mark:])

    def run_plan(self, plan: Plan, feeds: dict[str, Any]) -> list[Any]:
        with self._device, self._matmul_math(plan.matmul_allow_tf32):
            outs = runner.run_plan(self, plan, feeds)
        state = plan.backend_state
        if state.compilations_from is not None:  # the first run: lowering, warm-up and capture are done
            built = prebuilt.COMPILATIONS[state.compilations_from:]
            state.compilations_from = None
            if built:
                startup.note_startup_compilations(self, built)
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

    # ------------------------------------------------------------------ matmul (convpass.runtime.cuda.matmul_path)

    def ready_libraries(self, op_types: Any) -> None:
        """cuBLAS made ahead on a helper thread for a model with MatMul or Gemm (:func:`matmul_path.ready_libraries`)."""
        matmul_path.ready_libraries(self, op_types)

    def blas(self) -> Any:
        """The backend's :class:`convpass.native.cublas.Blas`, or False when cuBLAS cannot be called directly (:func:`matmul_path.blas`)."""
        return matmul_path.blas(self)

    def _matmul_math(self, allow_tf32: bool) -> contextlib.AbstractContextManager[None]:
        return matmul_path.matmul_math(self, allow_tf32)

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

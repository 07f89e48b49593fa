"""The cuda backend: CuPy arrays, cuDNN convolutions with the recorded choices, CUDA-graph replay.

``CudaBackend(device=0, cuda_graph=True)`` implements :class:`convpass.runtime.backends.Backend`
with ``xp = cupy``. :func:`unavailable_reason` says why it cannot run here (no CuPy, no GPU, no
cuDNN), ``None`` when it can. Importing this module imports neither CuPy nor cuDNN.

Convolutions
    Every Conv / ConvTranspose runs through :mod:`convpass.cudnn` with the decision recorded in the
    model: the algorithm by name, the memory format (NCHW / NHWC; NCW / NWC run as the 2-D mapping
    the problem key names, NCDHW / NDHWC as 5-D descriptors) and the math type. Descriptors are
    built once per :class:`~convpass.problem.ProblemKey` and kept; the workspace comes from one
    arena (a single CuPy buffer) sized to the largest workspace a plan needs. Conv with
    ``extra_pads`` zero-pads the input first (one copy, which also converts the memory format);
    ConvTranspose is cuDNN's backward data into a buffer of the uncropped size, then a cropped view.
    Bias: fused into ``cudnnConvolutionBiasActivationForward`` as ``relu`` when the only reader of
    the conv is a Relu (the Relu step then disappears from the plan), as ``identity`` when the
    algorithm is ``implicit_precomp_gemm`` (the only one cuDNN fuses an identity with); otherwise
    one broadcast add. A residual ``Add`` that is the conv's only reader, whose other operand is
    computed before the conv with the same shape, goes into the same call as its ``z`` input
    (``y = act(conv(x, w) + z + bias)``), with the following Relu when there is one
    (``CudaBackend(fuse_residual=False)`` turns that off). A fused call cuDNN refuses falls back to
    the unfused form for good.

    * Untuned convs (no decision) and ``algo == "auto"``: cuDNN's heuristic first choice that is
      usable, in NCHW, with the recorded math mode when there is one (``default`` otherwise): one
      :class:`ExecutorWarning` per executor counts them.
    * Re-validation: when the model's recorded device fingerprint (``convpass.device``) is not
      this GPU, recorded algorithms are not trusted: every tuned conv takes the heuristic (NCHW,
      recorded math mode, so TF32 stays as decided) and one warning names the devices and the
      nodes. A recorded algorithm cuDNN refuses here (``workspace_size`` or the launch raises
      :class:`~convpass.cudnn.CudnnError`), or a recorded problem key that is not the problem the
      plan computes, falls back the same way with one warning naming the node. Nothing crashes,
      nothing changes silently. The executor never calls cuDNN's Find.
    * Geometries cuDNN cannot express (``shapes == ()``) or dtypes it is not asked for (float64)
      run :func:`convpass.runtime.conv.conv_reference` over CuPy.

Memory formats
    Arrays keep their logical ONNX (channels-first) shapes; an NHWC conv stores its output
    channels-last (a transposed view, :func:`convpass.cudnn.empty_like_layout`). A conv converts
    its input only when it arrives in another format (one :func:`convpass.cudnn.as_layout` copy).
    CuPy allocates every element-wise result C-contiguous in the shape it is given, so the plan's
    runner calls element-wise ops (Add, Relu, Clip, HardSwish, Mul, Sigmoid, ...) on the
    channels-last storage view when a full-rank input is channels-last: their outputs stay
    channels-last and a chain of NHWC convs with residual adds between them never transposes (the
    layout plan's assumption that such ops pass the format through). Bias adds and activations
    that are not fused also run in storage order. Every other op works on the logical view;
    reshapes copy when the storage needs it. Weights of NHWC convs are converted once and cached.

Element-wise fusion
    Chains of element-wise ops (Sigmoid + Mul as SiLU, HardSigmoid + Mul gates, decomposed GELU,
    HardSwish, Clip, ...) run as one generated ``cupy.ElementwiseKernel`` each, in float32 math for
    float16 tensors: :mod:`convpass.runtime.cuda_fusion` states the rules. Kernels are built when
    the plan is compiled; one that does not build leaves its ops running one by one, with a warning.
    LayerNormalization over the last axis is one hand-written kernel
    (:mod:`convpass.runtime.cuda_kernels`). ``fuse=False`` turns every fusion (conv, element-wise,
    LayerNormalization) off.

Gemm / MatMul
    cuBLAS, through :mod:`convpass.runtime.cuda_blas` (ctypes on the libcublas CuPy loaded, own
    handle and workspace) because CuPy refuses cuBLAS calls during stream capture; cases it does
    not cover go to ``cupy.matmul`` (the plan then runs eagerly). TF32 follows the model's
    ``convpass.matmul_allow_tf32``: ``CUBLAS_COMPUTE_32F_FAST_TF32`` or ``CUBLAS_COMPUTE_32F``;
    for the ``cupy.matmul`` fallback CuPy's float32 compute type
    (``cupy._core._routines_linalg.set_compute_type``: ``COMPUTE_TYPE_TF32`` or
    ``COMPUTE_TYPE_DEFAULT``, what ``CUPY_TF32`` sets at start-up) and the math mode of CuPy's cuBLAS
    handle (``CUBLAS_TF32_TENSOR_OP_MATH`` / ``CUBLAS_DEFAULT_MATH``) are set while the executor runs
    and restored after.

Plans and CUDA graphs
    ``compile_plan`` resolves every conv of a static plan (descriptors, algorithm, workspace,
    weight conversion, fusions), sizes the workspace arena and takes over execution
    (``run_plan``). With ``cuda_graph=True`` the next run (the first one after the plan was built)
    is the eager warm-up: feeds are copied into static input buffers and the plan runs on a
    private non-blocking stream, allocating from a private CuPy memory pool (intermediates are
    released when their last reader ran, so the pool holds what the plan's liveness needs); then
    the plan is captured on that stream into a CUDA graph, reusing the same pool blocks at fixed
    addresses. Later runs copy the feeds into the static buffers, replay the graph on CuPy's
    current stream and return copies of the outputs. A plan whose ops need the host (a device ->
    host copy or an upload while running: NonZero, data-dependent shapes, values read on the host)
    or whose capture fails runs eagerly instead, with a debug log line (``plan.backend_state.mode``
    and ``.note`` say which and why). ``cuda_graph=False``: always eager (same kernels, same
    fusions). Eager runs are bound by host time: cuDNN 9's legacy API costs about 0.1 ms of host
    time per convolution call, which replaying the graph removes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import Any

import numpy as np

from convpass import annotation
from convpass.problem import MATH_MODES, ProblemKey, layout_from_memory_format, memory_format_name
from convpass.runtime import conv as conv_kernels
from convpass.runtime import cuda_fusion, cuda_kernels
from convpass.runtime.backends import Backend
from convpass.runtime.conv import ConvCall, ConvGeometry
from convpass.runtime.errors import ExecutorError
from convpass.runtime.executor import store_outputs, unshare_outputs
from convpass.runtime.registry import OpContext

logger = logging.getLogger("convpass")

__all__ = ["CudaBackend", "ExecutorWarning", "unavailable_reason"]

# Heuristic picks above this workspace are skipped while a smaller usable one exists.
HEURISTIC_WORKSPACE_LIMIT = 512 << 20
# Host tables up to this size are cached by content in ``constant`` (pool offsets, resize indices).
_CONTENT_KEY_BYTES = 1 << 16
# DLPack device types of CUDA memory (kDLCUDA, kDLCUDAHost, kDLCUDAManaged).
_DLPACK_CUDA = (2, 3, 13)


class ExecutorWarning(UserWarning):
    """The cuda executor runs a conv otherwise than the model records (or the model records nothing)."""


class _CaptureBreak(RuntimeError):
    """An op needs the host while a CUDA graph is being captured."""


# ---------------------------------------------------------------------------------------------
# availability

_reason_cache: list[str | None] = []


def _probe() -> str | None:
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e}); install convpass[gpu] (cupy-cuda13x, nvidia-cudnn-cu13)"
    except Exception as e:  # noqa: BLE001  (a broken CuPy install)
        return f"CuPy cannot be imported: {e}"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001
        return f"no usable CUDA driver or GPU: {e}"
    if count < 1:
        return "no CUDA GPU is visible"
    try:
        from convpass.cudnn import library

        library.version()
    except Exception as e:  # noqa: BLE001
        return f"cuDNN cannot be loaded: {str(e).splitlines()[0]}"
    return None


def unavailable_reason() -> str | None:
    """None when the cuda backend can run here, else why not (checked once per process)."""
    if not _reason_cache:
        _reason_cache.append(_probe())
    return _reason_cache[0]


def _device_index(device: Any) -> int:
    if device is None:
        return 0
    if isinstance(device, (int, np.integer)):
        return int(device)
    text = str(device).strip().lower()
    if text in ("", "cuda", "gpu", "auto"):
        return 0
    for prefix in ("cuda:", "gpu:"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    try:
        return int(text)
    except ValueError:
        raise ExecutorError(f"cannot read a CUDA device from {device!r}; use 0, 1, 'cuda' or 'cuda:1'") from None


# ---------------------------------------------------------------------------------------------
# conv execution records


@dataclasses.dataclass
class _ConvExec:
    """How one conv of one plan runs: problem key, descriptors, algorithm, workspace."""

    node: str
    op_type: str
    geometry: ConvGeometry
    key: ProblemKey
    descs: Any
    algo: str
    workspace: int
    insert_axis: int | None  # 1-D convs: 2 for the (1, L) mapping, 3 for (L, 1)
    source: str  # "recorded", "untuned" or "fallback"
    note: str = ""
    fuse_relu_ok: bool = True
    fuse_identity_ok: bool = True
    fuse_residual_ok: bool = True

    @property
    def layout(self) -> str:
        return self.key.layout

    @property
    def direction(self) -> str:
        return self.key.shape.direction

    @property
    def memory_format(self) -> str:
        return memory_format_name(self.geometry.spatial_rank, self.key.layout)


_REFERENCE = "reference"  # cache marker: run the CuPy reference kernel

# Ops whose result does not depend on the memory order of their operands: in a plan they run on the
# channels-last storage of channels-last inputs, so their outputs stay channels-last (CuPy allocates
# every element-wise result C-contiguous in the shape it is given).
_ELEMENTWISE = frozenset(
    """Abs Neg Exp Log Sqrt Reciprocal Floor Ceil Round Sign Sin Cos Tan Asin Acos Atan Sinh Cosh Asinh
    Acosh Atanh Tanh Relu Not IsNaN Softsign Sigmoid Softplus Mish Erf IsInf LeakyRelu Elu Celu Selu
    ThresholdedRelu HardSigmoid HardSwish Swish Shrink Gelu Clip Add Sub Mul Div Pow Mod Equal Less
    LessOrEqual Greater GreaterOrEqual And Or Xor Where Cast Max Min Sum Mean""".split()
)


def _insert_axis(g: ConvGeometry, key: ProblemKey) -> int | None:
    if g.spatial_rank != 1:
        return None
    s = key.shape
    row = s.spatial[0] == 1 and s.kernel[0] == 1 and s.pads[0] == 0 and s.strides[0] == 1 and s.dilations[0] == 1
    return 2 if row else 3


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _same_device(recorded: str, current: Any) -> bool:
    from convpass.device import DeviceFingerprint

    if current is None:
        return False
    try:
        return DeviceFingerprint.parse(recorded) == current
    except ValueError:
        return recorded.strip() == str(current)


# ---------------------------------------------------------------------------------------------
# per-plan state


@dataclasses.dataclass
class _PlanState:
    # per step: None (the op), "elementwise", "skip", ("relu", out slot) / ("residual", z slot,
    # activation, out slot) for fused convs, ("fused", FusedGroup, kernel) for element-wise groups,
    # ("layernorm", epsilon) for LayerNormalization by cuda_kernels
    actions: list[Any]
    free: list[tuple[int, ...]]  # per step: slots released after it ran (plan.steps' free, moved by fusion)
    capturable: bool
    mode: str  # "graph" (warm-up pending / captured), "eager"
    note: str = ""
    arena: Any = None
    stream: Any = None
    pool: Any = None
    static_inputs: dict[str, Any] | None = None
    graph: Any = None
    outputs: list[Any] | None = None
    replays: int = 0

    @property
    def captured(self) -> bool:
        return self.graph is not None


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

    def __init__(self, device: Any = 0, cuda_graph: bool = True, *, fuse: bool = True, fuse_residual: bool = True) -> None:
        self.fuse_residual = bool(fuse and fuse_residual)
        reason = unavailable_reason()
        if reason is not None:
            raise ExecutorError(f"cuda backend not available: {reason}")
        import cupy

        self._cp = cupy
        self.xp = _Namespace(cupy, self)
        self.device_id = _device_index(device)
        count = int(cupy.cuda.runtime.getDeviceCount())
        if not 0 <= self.device_id < count:
            raise ExecutorError(f"CUDA device {self.device_id} does not exist ({count} visible)")
        self._device = cupy.cuda.Device(self.device_id)
        self.cuda_graph = bool(cuda_graph)
        self.fuse = bool(fuse)
        self._mirror: dict[int, tuple[Any, np.ndarray]] = {}  # id(device array) -> (device array, host array)
        self._consts: dict[Any, tuple[Any, Any]] = {}
        self._descs: dict[ProblemKey, Any] = {}
        self._execs: dict[Any, Any] = {}
        self._by_call: dict[int, tuple[Any, Any, Any]] = {}
        self._weights: dict[Any, tuple[Any, Any]] = {}
        self._biases: dict[Any, tuple[Any, Any]] = {}
        self._arena: Any = None
        self._capturing = False
        self._host_syncs = 0
        self._uploads = 0
        self._allow_tf32 = False
        self._tf32_now = False
        self._blas: Any = None  # cuda_blas.Blas, False when it cannot be loaded
        self._recorded_device = ""
        self._current_device: Any = None
        self._device_mismatch = False
        self._warned_nodes: set[str] = set()
        self._warned: set[str] = set()
        self._mismatch_nodes: list[str] = []
        self.notes: list[str] = []  # every warning / note this backend emitted, in order
        # Set to a list to profile eager runs: (step label, start event, end event) per step run.
        self.step_events: list[tuple[str, Any, Any]] | None = None
        self.counters = {"cudnn_calls": 0, "fused_relu": 0, "fused_identity": 0, "fused_residual_relu": 0, "fused_residual_identity": 0, "reference_convs": 0, "graph_replays": 0, "layout_copies": 0, "fused_elementwise": 0}

    # ------------------------------------------------------------------ Backend interface

    def describe(self) -> str:
        cp = self.xp
        try:
            from convpass.cudnn import library

            props = cp.cuda.runtime.getDeviceProperties(self.device_id)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            v = library.version()
            cudnn = f"cuDNN {v // 10000}.{v // 100 % 100}.{v % 100}"
        except Exception:  # noqa: BLE001
            name, cudnn = "?", "cuDNN ?"
        graphs = "CUDA graphs" if self.cuda_graph else "eager"
        return f"cuda:{self.device_id} ({name}, {cudnn}, CuPy {cp.__version__}, {graphs})"

    def bind_model(self, model_info: Any) -> None:
        """The executor's model metadata: device fingerprint to re-validate, matmul TF32 switch."""
        from convpass import device as device_mod

        self._allow_tf32 = bool(model_info is not None and model_info.matmul_allow_tf32)
        self._recorded_device = (model_info.device if model_info is not None else "") or ""
        with self._device:
            self._current_device = device_mod.detect()
        self._device_mismatch = bool(self._recorded_device) and not _same_device(self._recorded_device, self._current_device)

    def upload(self, array: np.ndarray) -> Any:
        if self._capturing:
            raise _CaptureBreak("host -> device upload")
        self._uploads += 1
        return self._upload(array)

    def _upload(self, array: Any) -> Any:
        host = np.asarray(array)
        with self._device:
            dev = self.xp.asarray(host)
        self._mirror[id(dev)] = (dev, host)
        return dev

    def upload_input(self, array: np.ndarray) -> Any:
        """A feed: uploaded without a host mirror (it is not kept)."""
        with self._device:
            return self.xp.asarray(array)

    def adopt(self, value: Any) -> Any:
        """A CUDA array of another library (DLPack), as a CuPy array without a copy; None if not one."""
        if isinstance(value, self.xp.ndarray):
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
            return self.xp.from_dlpack(value)

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
            if self._capturing:
                raise _CaptureBreak("host -> device upload of a new table")
            hit = self._consts[key] = (array, self._upload(a))
        return hit[1]

    def to_host(self, x: Any) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x
        hit = self._mirror.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        if not isinstance(x, self.xp.ndarray):
            return np.asarray(x)
        if self._capturing:
            raise _CaptureBreak("device -> host copy")
        self._host_syncs += 1
        with self._device:
            return self.xp.asnumpy(x)

    def erf(self, x: Any) -> Any:
        from cupyx.scipy.special import erf

        return erf(x).astype(x.dtype, copy=False)  # CuPy computes float16 in float32 and returns float32

    def errstate(self) -> contextlib.AbstractContextManager[Any]:
        return self._scope(self._allow_tf32)

    @contextlib.contextmanager
    def _scope(self, allow_tf32: bool):
        with self._device, self._matmul_math(allow_tf32):
            yield

    def synchronize(self) -> None:
        with self._device:
            self.xp.cuda.get_current_stream().synchronize()

    def conv(self, x: Any, w: Any, b: Any, call: ConvCall) -> Any:
        return self._conv(call, x, w, b)

    def conv_transpose(self, x: Any, w: Any, b: Any, call: ConvCall) -> Any:
        return self._conv(call, x, w, b)

    # ------------------------------------------------------------------ matmul TF32

    def _matmul(self, a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        """``xp.matmul``: cuBLAS by ctypes (capturable, explicit TF32 switch), else ``cupy.matmul``."""
        cp = self._cp
        if not args and not kwargs and isinstance(a, cp.ndarray) and isinstance(b, cp.ndarray):
            blas = self._get_blas()
            if blas:
                try:
                    out = blas.matmul(a, b, self._tf32_now)
                except RuntimeError as e:
                    if self._capturing:
                        raise
                    logger.debug("cuBLAS by ctypes failed (%s): cupy.matmul instead", e)
                    out = None
                if out is not None:
                    return out
        if self._capturing:
            raise _CaptureBreak(f"a matmul of shapes {getattr(a, 'shape', '?')} @ {getattr(b, 'shape', '?')} needs cupy.matmul, which cannot be captured")
        return cp.matmul(a, b, *args, **kwargs)

    def _get_blas(self) -> Any:
        if self._blas is None:
            if self._capturing:
                raise _CaptureBreak("cuBLAS handle created during capture")
            from convpass.runtime import cuda_blas

            try:
                with self._device:
                    self._blas = cuda_blas.Blas(self._cp)
            except Exception as e:  # noqa: BLE001
                self._blas = False
                self._note_once("blas", f"cuBLAS cannot be called directly ({e}): Gemm / MatMul use cupy.matmul, plans with them run eagerly", warn=False)
        return self._blas

    @contextlib.contextmanager
    def _matmul_math(self, allow_tf32: bool):
        restore = []
        tf32_before = self._tf32_now
        self._tf32_now = bool(allow_tf32)
        restore.append(lambda: setattr(self, "_tf32_now", tf32_before))
        try:
            from cupy._core import _routines_linalg as lin

            f32 = np.dtype(np.float32)
            want = getattr(lin, "COMPUTE_TYPE_TF32", 7) if allow_tf32 else getattr(lin, "COMPUTE_TYPE_DEFAULT", 1)
            before = lin.get_compute_type(f32)
            if before != want:
                lin.set_compute_type(f32, want)
                restore.append(lambda: lin.set_compute_type(f32, before))
        except Exception as e:  # noqa: BLE001
            self._note_once("compute_type", f"cannot set CuPy's float32 matmul compute type: {e}", warn=False)
        try:
            from cupy_backends.cuda.libs import cublas

            handle = self.xp.cuda.device.get_cublas_handle()
            mode = getattr(cublas, "CUBLAS_TF32_TENSOR_OP_MATH", 3) if allow_tf32 else getattr(cublas, "CUBLAS_DEFAULT_MATH", 0)
            old = cublas.getMathMode(handle)
            if old != mode:
                cublas.setMathMode(handle, mode)
                restore.append(lambda: cublas.setMathMode(handle, old))
        except Exception as e:  # noqa: BLE001
            self._note_once("cublas_math", f"cannot set the cuBLAS math mode: {e}", warn=False)
        try:
            yield
        finally:
            for undo in reversed(restore):
                try:
                    undo()
                except Exception:  # noqa: BLE001
                    pass

    # ------------------------------------------------------------------ notes

    def _note_once(self, tag: str, message: str, warn: bool = True) -> None:
        if tag in self._warned:
            return
        self._warned.add(tag)
        self.notes.append(message)
        if warn:
            warnings.warn(message, ExecutorWarning, stacklevel=4)
        else:
            logger.debug("%s", message)

    def _warn_node(self, node: str, message: str) -> None:
        if node in self._warned_nodes:
            return
        self._warned_nodes.add(node)
        self.notes.append(message)
        warnings.warn(message, ExecutorWarning, stacklevel=4)

    # ------------------------------------------------------------------ conv resolution

    def _descriptors(self, key: ProblemKey) -> Any:
        d = self._descs.get(key)
        if d is None:
            from convpass import cudnn

            d = self._descs[key] = cudnn.ConvDescriptors(key)
        return d

    def _resolve(self, call: ConvCall, dtype: Any) -> Any:
        # fast path: a plan's steps hold the same ConvCall objects run after run
        hit = self._by_call.get(id(call))
        if hit is not None and hit[0] is call and hit[1] == dtype:
            return self._execs[hit[2]]
        cache_key = (call.node_name, call.geometry, call.decision, np.dtype(dtype).str)
        if cache_key not in self._execs:
            self._execs[cache_key] = self._make_exec(call, dtype)
        self._by_call[id(call)] = (call, dtype, cache_key)
        return self._execs[cache_key]

    def _make_exec(self, call: ConvCall, dtype: Any) -> Any:
        g = call.geometry
        node = call.node_name
        if not g.shapes:
            return _REFERENCE
        if np.dtype(dtype).name != g.shapes[0].dtype:
            # Conv requires X and W of one type: an input of another dtype means an op before it
            # changed the dtype, which is an executor bug worth hearing about
            self._warn_node(node, f"node {node!r}: input is {np.dtype(dtype).name}, the model says {g.shapes[0].dtype}: running CuPy reference kernels")
            return _REFERENCE
        d = call.decision
        math = "default"
        if d is not None and d.math_mode in MATH_MODES:
            math = d.math_mode
        if d is None or d.algo == annotation.AUTO:
            return self._heuristic_exec(call, "untuned", "")
        if self._device_mismatch:
            self._mismatch_nodes.append(node)
            return self._heuristic_exec(call, "fallback", f"tuned on {self._recorded_device}", math)
        key, why = self._recorded_key(d, g)
        if key is not None:
            from convpass import cudnn

            try:
                descs = self._descriptors(key)
                ws = cudnn.workspace_size(descs, None, d.algo)
            except (cudnn.CudnnError, ValueError) as e:
                why = f"recorded algorithm {d.algo!r} ({key.layout}, {key.math}) is not usable here: {_first_line(e)}"
            else:
                return _ConvExec(node, call.geometry.op_type, g, key, descs, d.algo, ws, _insert_axis(g, key), "recorded")
        ex = self._heuristic_exec(call, "fallback", why, math)
        self._warn_node(node, f"node {node!r}: {why}; running cuDNN's heuristic choice {self._describe_exec(ex)} instead")
        return ex

    @staticmethod
    def _recorded_key(d: annotation.ConvDecision, g: ConvGeometry) -> tuple[ProblemKey | None, str]:
        if d.problem_key:
            try:
                key = ProblemKey.parse(d.problem_key)
            except ValueError:
                return None, f"recorded problem key {d.problem_key!r} cannot be read"
            if key.shape not in g.shapes:
                return None, f"recorded problem {d.problem_key} is not the problem this plan computes ({g.shapes[0]})"
            return key, ""
        layout = "nchw"
        if d.memory_format not in ("", annotation.AUTO):
            try:
                _, layout = layout_from_memory_format(d.memory_format)
            except ValueError:
                return None, f"unknown recorded memory format {d.memory_format!r}"
        math = d.math_mode if d.math_mode in MATH_MODES else "default"
        return ProblemKey(g.shapes[0], layout, math), ""

    def _heuristic_exec(self, call: ConvCall, source: str, note: str, math: str = "default") -> Any:
        from convpass import cudnn

        g = call.geometry
        attempts = [("nchw", math)] + ([("nchw", "default")] if math != "default" else [])
        for layout, m in attempts:
            key = ProblemKey(g.shapes[0], layout, m)
            try:
                descs = self._descriptors(key)
                ranking = cudnn.heuristic(descs)
            except (cudnn.CudnnError, ValueError) as e:
                logger.debug("node %r: no cuDNN descriptors / heuristic for %s: %s", call.node_name, key, e)
                continue
            usable = []
            for p in ranking:
                if not p.ok:
                    continue
                try:
                    ws = cudnn.workspace_size(descs, None, p.algo)
                except (cudnn.CudnnError, ValueError):
                    continue
                usable.append((p.algo, ws))
            if not usable:
                continue
            small = [u for u in usable if u[1] <= HEURISTIC_WORKSPACE_LIMIT]
            algo, ws = (small or usable)[0]
            return _ConvExec(call.node_name, g.op_type, g, key, descs, algo, ws, _insert_axis(g, key), source, note)
        self._warn_node(call.node_name, f"node {call.node_name!r}: cuDNN offers no usable algorithm for {g.shapes[0]}: running CuPy reference kernels")
        return _REFERENCE

    @staticmethod
    def _describe_exec(ex: Any) -> str:
        if ex is _REFERENCE:
            return "(none: CuPy reference kernels)"
        return f"{ex.algo!r} ({ex.memory_format}, {ex.key.math})"

    # ------------------------------------------------------------------ conv execution

    def _map(self, a: Any, ex: _ConvExec) -> Any:
        if ex.insert_axis == 2:
            return a[:, :, None]
        if ex.insert_axis == 3:
            return a[:, :, :, None]
        return a

    def _is_constant(self, a: Any) -> bool:
        hit = self._mirror.get(id(a))
        return hit is not None and hit[0] is a

    def _weight(self, w: Any, ex: _ConvExec) -> Any:
        from convpass import cudnn

        key = (id(w), ex.layout, ex.insert_axis)
        hit = self._weights.get(key)
        if hit is not None and hit[0] is w:
            return hit[1]
        wk = cudnn.as_layout(self._map(w, ex), ex.layout)
        if self._is_constant(w):
            self._weights[key] = (w, wk)
        return wk

    def _bias(self, b: Any) -> Any:
        if b.flags.c_contiguous:
            return b
        key = id(b)
        hit = self._biases.get(key)
        if hit is not None and hit[0] is b:
            return hit[1]
        out = self.xp.ascontiguousarray(b)
        if self._is_constant(b):
            self._biases[key] = (b, out)
        return out

    def _workspace(self, nbytes: int) -> Any:
        if nbytes <= 0:
            return (0, 0)
        if self._arena is None or self._arena.nbytes < nbytes:
            if self._capturing:
                raise _CaptureBreak("workspace arena too small")
            with self._device:
                self._arena = self.xp.empty(int(nbytes), dtype=np.uint8)
        return self._arena

    def _prepad(self, x: Any, g: ConvGeometry, layout: str) -> Any:
        from convpass import cudnn

        r = g.spatial_rank
        eb, ee = g.extra_pads[:r], g.extra_pads[r:]
        shape = (x.shape[0], x.shape[1], *(x.shape[2 + i] + eb[i] + ee[i] for i in range(r)))
        out = cudnn.empty_like_layout(shape, x.dtype, layout)
        _storage(out, layout).fill(0)  # in memory order: coalesced
        out[(slice(None), slice(None), *(slice(eb[i], eb[i] + x.shape[2 + i]) for i in range(r)))] = x
        return out

    def _reference(self, call: ConvCall, x: Any, w: Any, b: Any, relu: bool, z: Any = None) -> Any:
        self.counters["reference_convs"] += 1
        g = call.geometry
        if g.op_type == "ConvTranspose":
            y = conv_kernels.conv_transpose_reference(self.xp, x, w, b, g)
        else:
            y = conv_kernels.conv_reference(self.xp, x, w, b, g)
        if z is not None:
            y = y + z
        if relu:
            y = self.xp.maximum(y, y.dtype.type(0))
        return y

    def _conv(self, call: ConvCall, x: Any, w: Any, b: Any, relu: bool = False, z: Any = None) -> Any:
        """The conv of ``call`` plus bias, plus the residual ``z`` when given, then ReLU if asked."""
        from convpass import cudnn

        ex = self._resolve(call, x.dtype)
        if ex is _REFERENCE or w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
            return self._reference(call, x, w, b, relu, z)
        try:
            return self._run_conv(ex, x, w, b, relu, z)
        except cudnn.CudnnError as e:
            if self._capturing or ex.source != "recorded":
                raise
            # the recorded algorithm was accepted by workspace_size but cuDNN refuses to run it
            why = f"recorded algorithm {ex.algo!r} ({ex.layout}, {ex.key.math}) failed here: {_first_line(e)}"
            math = ex.key.math
            new = self._heuristic_exec(call, "fallback", why, math)
            self._execs[(call.node_name, call.geometry, call.decision, np.dtype(x.dtype).str)] = new  # _by_call points here
            self._warn_node(call.node_name, f"node {call.node_name!r}: {why}; running cuDNN's heuristic choice {self._describe_exec(new)} instead")
            if new is _REFERENCE:
                return self._reference(call, x, w, b, relu, z)
            return self._run_conv(new, x, w, b, relu, z)

    def _run_conv(self, ex: _ConvExec, x: Any, w: Any, b: Any, relu: bool, z: Any = None) -> Any:
        from convpass import cudnn

        g = ex.geometry
        r = g.spatial_rank
        wk = self._weight(w, ex)
        ws = self._workspace(ex.workspace)
        if ex.op_type == "ConvTranspose":
            mapped = self._map(x, ex)
            dy = cudnn.as_layout(mapped, ex.layout)
            if dy is not mapped:
                self.counters["layout_copies"] += 1
            full_spatial = tuple(g.output_shape[2 + i] + g.extra_pads[i] + g.extra_pads[r + i] for i in range(r))
            full = cudnn.empty_like_layout((g.output_shape[0], g.output_shape[1], *full_spatial), x.dtype, ex.layout)
            cudnn.run(ex.descs, "dgrad", ex.algo, self._map(full, ex), wk, dy, workspace=ws)
            self.counters["cudnn_calls"] += 1
            y = full
            if any(g.extra_pads):
                y = full[(slice(None), slice(None), *(slice(g.extra_pads[i], g.extra_pads[i] + g.output_shape[2 + i]) for i in range(r)))]
            self._bias_relu(y, b, relu, ex.layout)
            return y
        xin = self._prepad(x, g, ex.layout) if any(g.extra_pads) else x
        mapped = self._map(xin, ex)
        x4 = cudnn.as_layout(mapped, ex.layout)
        if x4 is not mapped:
            self.counters["layout_copies"] += 1
        y = cudnn.empty_like_layout(g.output_shape, x.dtype, ex.layout)
        y4 = self._map(y, ex)
        z4 = None
        if z is not None:  # the residual, in the conv's own memory format
            mapped_z = self._map(z, ex)
            z4 = cudnn.as_layout(mapped_z, ex.layout)
            if z4 is not mapped_z:
                self.counters["layout_copies"] += 1
        activation = None
        if b is not None and self.fuse:
            if z4 is not None:
                if ex.fuse_residual_ok and (relu or ex.algo == "implicit_precomp_gemm"):
                    activation = "relu" if relu else "identity"
            elif relu and ex.fuse_relu_ok:
                activation = "relu"
            elif not relu and ex.algo == "implicit_precomp_gemm" and ex.fuse_identity_ok:
                activation = "identity"
        if activation is not None:
            try:
                cudnn.conv_bias_activation_forward(ex.descs, ex.algo, x4, wk, y4, self._bias(b), z=z4, activation=activation, workspace=ws)
            except (cudnn.CudnnError, ValueError) as e:
                if z4 is not None:
                    ex.fuse_residual_ok = False
                elif activation == "relu":
                    ex.fuse_relu_ok = False
                else:
                    ex.fuse_identity_ok = False
                what = f"{'residual + ' if z4 is not None else ''}{activation}"
                logger.debug("node %r: cuDNN refuses the fused conv + bias + %s (%s); running them apart", ex.node, what, _first_line(e))
            else:
                self.counters["cudnn_calls"] += 1
                self.counters["fused_" + ("residual_" if z4 is not None else "") + activation] += 1
                return y
        cudnn.run(ex.descs, "fwd", ex.algo, x4, wk, y4, workspace=ws)
        self.counters["cudnn_calls"] += 1
        if z4 is not None:
            y4 += z4  # same memory format on both sides: one pass over the storage
        self._bias_relu(y, b, relu, ex.layout)
        return y

    def _bias_relu(self, y: Any, b: Any, relu: bool, layout: str) -> None:
        """In place, on the storage order of ``y`` (element-wise kernels over a channels-last array
        seen channels-first would read and write with a stride of C elements)."""
        if b is None and not relu:
            return
        phys = _storage(y, layout)
        if b is not None:
            phys += b if phys is not y else b.reshape((1, -1) + (1,) * (y.ndim - 2))
        if relu:
            self._cp.maximum(phys, phys.dtype.type(0), out=phys)

    # ------------------------------------------------------------------ plans

    def compile_plan(self, plan: Any) -> None:
        """Resolve the plan's convs, size the workspace arena, plan fusions; take over execution."""
        if not plan.steps:
            return
        with self._device:
            need = 0
            untuned, reference = [], []
            summaries = {s.node: i for i, s in enumerate(plan.convs)}
            for step in plan.steps:
                call = step.node.prepared
                if not isinstance(call, ConvCall):
                    continue
                info = plan.value_info.get(step.inputs[0])
                if info is None:
                    continue
                ex = self._resolve(call, info[1])
                w = plan.template[step.inputs[1]] if len(step.inputs) > 1 and step.inputs[1] >= 0 else None
                if ex is _REFERENCE:
                    reference.append(call.node_name)
                else:
                    need = max(need, ex.workspace)
                    if w is not None and w.dtype == info[1]:
                        self._weight(w, ex)  # NHWC weights converted once, here at the latest
                    if ex.source == "untuned":
                        untuned.append(call.node_name)
                i = summaries.get(call.node_name)
                if i is not None:
                    plan.convs[i] = self._summary(plan.convs[i], ex)
            if need:
                self._workspace(need)
            if untuned:
                self._note_once(
                    "untuned",
                    f"{len(untuned)} convolution(s) untuned: using cuDNN's heuristic (NCHW) for "
                    + ", ".join(repr(n) for n in untuned[:5])
                    + (f", ... (+{len(untuned) - 5} more)" if len(untuned) > 5 else "")
                    + "; tune the model with `convpass optimize` to run measured choices",
                )
            if reference:
                self._note_once(
                    "reference", f"{len(reference)} convolution(s) cuDNN cannot express run as CuPy reference kernels: {', '.join(map(repr, reference[:5]))}", warn=False
                )
            if self._mismatch_nodes and "device" not in self._warned:
                nodes = self._mismatch_nodes
                self._note_once(
                    "device",
                    f"the model was tuned on {self._recorded_device!r}, this GPU is {str(self._current_device)!r}: "
                    f"the recorded cuDNN choices are not used; {len(nodes)} convolution(s) run cuDNN's heuristic choice "
                    f"(NCHW, recorded math mode): {', '.join(repr(n) for n in nodes[:5])}"
                    + (f", ... (+{len(nodes) - 5} more)" if len(nodes) > 5 else "")
                    + "; re-tune on this GPU with `convpass optimize`",
                )
            actions = self._plan_fusions(plan)
            free = [st.free for st in plan.steps]
            for group in self._plan_elementwise(plan, actions):
                for i in group.members[:-1]:
                    actions[i] = "skip"
                    free[group.root] += free[i]  # the root reads what members read last
                    free[i] = ()
            self._plan_layer_norms(plan, actions)
            for i, st in enumerate(plan.steps):
                node = st.node
                if actions[i] is None and node.domain == "" and (
                    node.op_type in _ELEMENTWISE or (node.op_type == "PRelu" and node.opset >= 7)
                ):
                    actions[i] = "elementwise"
            blockers = [s.node for s in plan.steps if s.node.impl is not None and s.node.impl.data_dependent_shape]
            capturable = self.cuda_graph and not blockers
            note = ""
            if self.cuda_graph and blockers:
                note = f"{blockers[0].op_type} node {blockers[0].name!r} has a data-dependent output shape: plan runs eagerly"
                logger.debug("cuda graph: %s", note)
            plan.backend_state = _PlanState(
                actions=actions,
                free=free,
                capturable=capturable,
                mode="graph" if capturable else "eager",
                note=note or ("" if self.cuda_graph else "cuda_graph=False"),
                arena=self._arena,
            )

    def _summary(self, s: Any, ex: Any) -> Any:
        if ex is _REFERENCE:
            return dataclasses.replace(s, algo="reference", note=(s.note + "; " if s.note else "") + "runs CuPy reference kernels")
        if ex.source == "recorded":
            return s
        note = "cuDNN heuristic" if ex.source == "untuned" else f"recorded {s.algo!r} not used ({ex.note}): cuDNN heuristic"
        return dataclasses.replace(
            s,
            source=s.source if ex.source == "untuned" else "fallback",
            algo=ex.algo,
            memory_format=ex.memory_format,
            math_mode=ex.key.math,
            workspace_bytes=ex.workspace,
            note=(s.note + "; " if s.note and s.note != "untuned" else "") + note,
        )

    def _plan_fusions(self, plan: Any) -> list[Any]:
        steps = plan.steps
        actions: list[Any] = [None] * len(steps)
        if not self.fuse:
            return actions
        readers: dict[int, list[int]] = {}
        for i, st in enumerate(steps):
            for s in st.inputs:
                if s >= 0:
                    readers.setdefault(s, []).append(i)
        outputs = set(plan.output_slots)
        producer = {s: i for i, st in enumerate(steps) for s in st.outputs if s >= 0}

        def only_reader(slot: int, after: int, op_type: str) -> int | None:
            """The step that is the one reader of ``slot``, if it is a plain ``op_type`` after ``after``."""
            if slot < 0 or slot in outputs or len(readers.get(slot, ())) != 1:
                return None
            k = readers[slot][0]
            st = steps[k]
            ok = k > after and st.node.op_type == op_type and st.node.domain == "" and actions[k] is None
            return k if ok and st.outputs and st.outputs[0] >= 0 else None

        for i, st in enumerate(steps):
            node = st.node
            if node.op_type != "Conv" or not isinstance(node.prepared, ConvCall) or not node.prepared.geometry.shapes:
                continue
            if len(st.inputs) < 3 or st.inputs[2] < 0 or plan.template[st.inputs[2]] is None:
                continue
            y = st.outputs[0] if st.outputs else -1
            if y < 0 or y in outputs or len(readers.get(y, ())) != 1:
                continue
            # conv + bias + residual Add (+ Relu): y = act(conv(x, w) + z + b) in one cuDNN call, when the
            # residual z is computed before the conv and has the conv output's exact shape and dtype.
            j = only_reader(y, i, "Add") if self.fuse_residual else None
            if j is not None and len(steps[j].inputs) == 2:
                z = steps[j].inputs[1] if steps[j].inputs[0] == y else steps[j].inputs[0]
                ready = z >= 0 and z != y and producer.get(z, -1) < i
                if ready and plan.value_info.get(z) == plan.value_info.get(y) and plan.value_info.get(y) is not None:
                    k = only_reader(steps[j].outputs[0], j, "Relu")
                    if k is not None and len(steps[k].inputs) == 1:
                        actions[i] = ("residual", z, "relu", steps[k].outputs[0])
                        actions[j] = actions[k] = "skip"
                    else:
                        actions[i] = ("residual", z, "identity", steps[j].outputs[0])
                        actions[j] = "skip"
                    continue
            j = readers[y][0]
            relu = steps[j]
            if (
                j <= i
                or relu.node.op_type != "Relu"
                or relu.node.domain != ""
                or actions[j] is not None
                or len(relu.inputs) != 1
                or relu.inputs[0] != y
                or not relu.outputs
                or relu.outputs[0] < 0
            ):
                continue
            actions[i] = ("relu", relu.outputs[0])
            actions[j] = "skip"
        return actions

    def _plan_elementwise(self, plan: Any, actions: list[Any]) -> list[Any]:
        """Element-wise groups (:mod:`convpass.runtime.cuda_fusion`) whose kernel compiles, as actions."""
        if not self.fuse:
            return []
        groups = []
        for group in cuda_fusion.plan_groups(plan, actions):
            try:
                kern = cuda_fusion.kernel(self._cp, group)
                probe = [self._cp.zeros((1,), dtype=group.dtype) for _ in group.inputs]
                kern(*probe)  # compiles now (or loads CuPy's kernel cache), not inside a capture
            except Exception as e:  # noqa: BLE001  (a compiler or driver error: run the ops one by one)
                self._note_once(
                    "fusion",
                    f"fused element-wise kernel for {'+'.join(group.ops)} did not build ({_first_line(e)}): "
                    "those ops run one by one",
                )
                continue
            actions[group.root] = ("fused", group, kern)
            groups.append(group)
        return groups

    def _plan_layer_norms(self, plan: Any, actions: list[Any]) -> None:
        """LayerNormalization over the last axis, Y only, float32 / float16: one kernel (cuda_kernels)."""
        if not self.fuse:
            return
        for i, st in enumerate(plan.steps):
            node = st.node
            if actions[i] is not None or node.op_type != "LayerNormalization" or node.domain != "":
                continue
            info = plan.value_info.get(st.inputs[0])
            if info is None or not info[0] or np.dtype(info[1]) not in cuda_kernels.LAYER_NORM_DTYPES:
                continue
            shape, dtype = info[0], np.dtype(info[1])
            axis = int(node.attr("axis", -1))
            if axis not in (-1, len(shape) - 1) or int(node.attr("stash_type", 1)) != 1:
                continue
            if any(o >= 0 for o in st.outputs[1:]) or st.outputs[0] < 0:
                continue  # Mean / InvStdDev wanted: the op library computes them
            params = [plan.value_info.get(s) or (None if plan.template[s] is None else (plan.template[s].shape, plan.template[s].dtype))
                      for s in st.inputs[1:] if s >= 0]
            if any(p is None or int(np.prod(p[0])) != shape[-1] or np.dtype(p[1]) != dtype for p in params):
                continue
            try:
                cuda_kernels.layer_norm_kernel(self._cp, dtype)
            except Exception as e:  # noqa: BLE001  (a compiler or driver error: the op library runs it)
                self._note_once(f"layernorm-{dtype}", f"LayerNormalization kernel for {dtype} did not build ({_first_line(e)}): running it op by op")
                continue
            actions[i] = ("layernorm", float(node.attr("epsilon", 1e-5)))

    def _run_steps(self, plan: Any, state: _PlanState, env: list[Any]) -> list[Any]:
        ctx = OpContext(self)
        timing = None if self._capturing else self.step_events
        for i, step in enumerate(plan.steps):
            action = state.actions[i]
            if timing is not None and action != "skip":
                start = self._cp.cuda.Event()
                start.record()
            if action != "skip":
                args = [env[s] if s >= 0 else None for s in step.inputs]
                try:
                    if action == "elementwise":
                        store_outputs(env, step.outputs, self._elementwise(step.node.impl.value_inputs, args, lambda *a: step.fn(ctx, step.node, *a)))
                    elif action is not None and action[0] == "layernorm":
                        env[step.outputs[0]] = cuda_kernels.layer_norm(self._cp, args[0], args[1], args[2] if len(args) > 2 else None, action[1])
                    elif action is not None and action[0] == "fused":
                        group, kern = action[1], action[2]
                        env[group.output] = self._elementwise((), [env[s] for s in group.inputs], kern)
                        self.counters["fused_elementwise"] += 1
                    elif action is not None:
                        x, w = args[0], args[1]
                        b = args[2] if len(args) > 2 else None
                        if action[0] == "relu":
                            env[action[1]] = self._conv(step.node.prepared, x, w, b, relu=True)
                        else:  # ("residual", z slot, activation, output slot)
                            z = env[action[1]]
                            env[action[3]] = self._conv(step.node.prepared, x, w, b, relu=action[2] == "relu", z=z)
                    else:
                        store_outputs(env, step.outputs, step.fn(ctx, step.node, *args))
                except (_CaptureBreak, ExecutorError):
                    raise
                except (ValueError, IndexError, TypeError) as e:
                    shapes = [None if a is None else tuple(a.shape) for a in args]
                    raise ExecutorError(f"node {step.node.name!r} ({step.node.op_type}) failed on inputs of shapes {shapes}: {e}") from None
            if timing is not None and action != "skip":
                end = self._cp.cuda.Event()
                end.record()
                timing.append((_step_label(step, action), start, end))
            for s in state.free[i]:
                env[s] = None
        return [env[s] for s in plan.output_slots]

    def _elementwise(self, value_inputs: tuple[int, ...], args: list[Any], fn: Any) -> Any:
        """``fn(*args)``, an element-wise computation, on the channels-last storage when a full-rank input has it."""
        from convpass import cudnn

        r = max((a.ndim for a in args if a is not None), default=0)
        if not 3 <= r <= 5 or not any(a is not None and a.ndim == r and cudnn.layout_of(a) == "nhwc" for a in args):
            return fn(*args)
        perm = (0, *range(2, r), 1)
        inv = (0, r - 1, *range(1, r - 1))
        moved = []
        for i, a in enumerate(args):
            if a is None or a.ndim == 0 or i in value_inputs:
                moved.append(a)
            else:
                full = a if a.ndim == r else a.reshape((1,) * (r - a.ndim) + tuple(a.shape))
                moved.append(full.transpose(perm))
        outs = fn(*moved)
        if isinstance(outs, (tuple, list)):
            return [o.transpose(inv) if o is not None and o.ndim == r else o for o in outs]
        return outs.transpose(inv) if outs.ndim == r else outs

    def run_plan(self, plan: Any, feeds: dict[str, Any]) -> list[Any]:
        state: _PlanState = plan.backend_state
        with self._device, self._matmul_math(plan.matmul_allow_tf32):
            if state.graph is not None:
                return self._replay(plan, state, feeds)
            if state.capturable:
                return self._warm_up_and_capture(plan, state, feeds)
            env = list(plan.template)
            for name, s in plan.feed_slots.items():
                env[s] = feeds[name]
            return unshare_outputs(self._run_steps(plan, state, env), plan, feeds)

    def _replay(self, plan: Any, state: _PlanState, feeds: dict[str, Any]) -> list[Any]:
        cp = self.xp
        for name, buf in state.static_inputs.items():
            src = feeds[name]
            if src is not buf:
                cp.copyto(buf, src)
        state.graph.launch(cp.cuda.get_current_stream())
        state.replays += 1
        self.counters["graph_replays"] += 1
        return [o.copy() for o in state.outputs]

    def _warm_up_and_capture(self, plan: Any, state: _PlanState, feeds: dict[str, Any]) -> list[Any]:
        """Eager warm-up on a private stream and memory pool, then capture (module docstring)."""
        cp = self.xp
        current = cp.cuda.get_current_stream()
        stream = cp.cuda.Stream(non_blocking=True)
        pool = cp.cuda.MemoryPool()
        stream.wait_event(current.record())
        syncs, uploads = self._host_syncs, self._uploads
        with cp.cuda.using_allocator(pool.malloc), stream:
            static = {name: cp.empty(tuple(feeds[name].shape), dtype=feeds[name].dtype) for name in plan.feed_slots}
            for name, buf in static.items():
                cp.copyto(buf, feeds[name])
            env = list(plan.template)
            for name, s in plan.feed_slots.items():
                env[s] = static[name]
            outs = self._run_steps(plan, state, env)
            del env
        current.wait_event(stream.record())
        results = [o.copy() for o in outs]  # on the caller's stream and pool
        del outs
        host_work = []
        if self._host_syncs != syncs:
            host_work.append(f"{self._host_syncs - syncs} device -> host copies")
        if self._uploads != uploads:
            host_work.append(f"{self._uploads - uploads} uploads")
        if host_work:
            self._go_eager(state, f"ops need the host while running ({', '.join(host_work)}): plan runs eagerly")
            return results
        if state.arena is not self._arena:
            state.arena = self._arena
        graph, error = None, None
        with cp.cuda.using_allocator(pool.malloc), stream:
            env = list(plan.template)
            for name, s in plan.feed_slots.items():
                env[s] = static[name]
            self._capturing = True
            try:
                stream.begin_capture()
                try:
                    outs = self._run_steps(plan, state, env)
                except BaseException as e:  # noqa: BLE001  (end the capture whatever happened)
                    error = e
                    outs = None
                finally:
                    self._capturing = False
                    try:
                        graph = stream.end_capture()
                    except Exception as e:  # noqa: BLE001
                        graph = None
                        error = error or e
            except Exception as e:  # noqa: BLE001  (begin_capture refused)
                error = error or e
            finally:
                self._capturing = False
            del env
        if error is not None or graph is None:
            if error is not None and not isinstance(error, (_CaptureBreak, Exception)):
                raise error  # KeyboardInterrupt and the like
            try:
                stream.synchronize()
            except Exception:  # noqa: BLE001
                pass
            self._go_eager(state, f"CUDA graph capture failed ({_first_line(error) if error else 'no graph'}): plan runs eagerly")
            return results
        upload = getattr(graph, "upload", None)
        if upload is not None:
            try:
                upload(stream)
            except Exception:  # noqa: BLE001
                pass
        current.wait_event(stream.record())
        state.graph = graph
        state.outputs = outs
        state.static_inputs = static
        state.stream = stream
        state.pool = pool
        state.note = f"captured: {len(plan.steps)} step(s) in one CUDA graph"
        logger.debug("cuda graph: %s", state.note)
        return results

    def _go_eager(self, state: _PlanState, note: str) -> None:
        state.capturable = False
        state.mode = "eager"
        state.note = note
        logger.debug("cuda graph: %s", note)


def _step_label(step: Any, action: Any) -> str:
    """What a step runs, for profiles: its op type, or the fusion it heads."""
    if isinstance(action, tuple):
        if action[0] == "layernorm":
            return "LayerNormalization kernel"
        if action[0] == "fused":
            return "fused " + "+".join(action[1].ops)
        return f"{step.node.op_type}+{action[0]}" + (f"+{action[2]}" if action[0] == "residual" else "")
    return step.node.op_type


def _storage(a: Any, layout: str) -> Any:
    """``a`` (logical channels-first) in its memory order: the channels-last view for ``nhwc``."""
    if layout != "nhwc" or a.ndim < 3:
        return a
    return a.transpose(0, *range(2, a.ndim), 1)

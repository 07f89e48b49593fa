"""The convolution calls: handles, heuristics, search, workspace sizes and execution.

Arrays are CuPy arrays (or raw device pointers as ints), streams CuPy streams (or raw ``cudaStream_t``
ints); the arrays' rules (logical channels-first shapes, memory formats, the checks before any cuDNN
call, workspaces) are in :mod:`convpass.native.cudnn.arrays`.

Directions (always over the forward geometry ``y = conv(x, w)``):

* ``fwd``:   y = conv(x, w)              (cudnnConvolutionForward)
* ``dgrad``: x = conv_backward_data(y, w)    (cudnnConvolutionBackwardData; ONNX ConvTranspose)
* ``wgrad``: w = conv_backward_filter(x, y)  (cudnnConvolutionBackwardFilter)

Every result is ``alpha * op(...) + beta * out``; alpha / beta are C floats because the compute
type is float for every data type convpass uses. With ``beta == 0`` the output is not read.

Instrumentation: every execution (:func:`run`, :func:`conv_bias_activation_forward`) goes through
one internal function, which after a successful launch tells each listener registered with
:func:`add_call_listener` a :class:`CudnnCall` (call name, direction, algorithm, problem key). The
executor's tests use it to prove the recorded algorithm is the one cuDNN was asked to run.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from ctypes import byref, c_float, c_int, c_size_t, c_void_p

from convpass.core import cudnn_enums as enums
from convpass.core.cudnn_enums import CudnnError
from convpass.core.problem import ProblemKey
from convpass.native.cudnn import library
from convpass.native.cudnn.arrays import checked_pointer, require_cupy, workspace_arg
from convpass.native.cudnn.descriptors import ConvDescriptors, TensorParams

__all__ = [
    "AlgoPerf",
    "CudnnCall",
    "Handle",
    "add_call_listener",
    "conv_bias_activation_forward",
    "find",
    "get_handle",
    "heuristic",
    "make_handle_for",
    "record_calls",
    "remove_call_listener",
    "run",
    "workspace_size",
]


# ---------------------------------------------------------------------------------------------
# handles
# ---------------------------------------------------------------------------------------------


def _stream_ptr(stream) -> int:
    if stream is None:
        return int(require_cupy().cuda.get_current_stream().ptr)
    if isinstance(stream, int):
        return stream
    return int(stream.ptr)


class Handle:
    """One ``cudnnHandle_t``, bound to the CUDA device that was current when it was made.

    cuDNN handles must not be shared between threads; :func:`get_handle` keeps one per (device,
    thread). ``ptr`` is the raw handle for ctypes calls.
    """

    def __init__(self, device: int | None = None) -> None:
        cupy = require_cupy()
        self.device = int(cupy.cuda.runtime.getDevice() if device is None else device)
        self.thread = threading.get_ident()
        h = c_void_p()
        with cupy.cuda.Device(self.device):
            library.call("cudnnCreate", byref(h))
        self.ptr: int | None = h.value
        self._stream: int | None = None

    def set_stream(self, stream=None) -> Handle:
        """Point the handle at a CuPy stream (or raw ``cudaStream_t``); ``None``: the current one."""
        ptr = _stream_ptr(stream)
        if ptr != self._stream:
            library.call("cudnnSetStream", self.ptr, ptr)
            self._stream = ptr
        return self

    @property
    def stream(self) -> int | None:
        """The raw stream the handle was last pointed at (``None`` before the first set)."""
        return self._stream

    def close(self) -> None:
        ptr, self.ptr = self.ptr, None
        if ptr:
            library.call("cudnnDestroy", ptr)

    def __del__(self) -> None:
        if sys.is_finalizing():
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def __repr__(self) -> str:
        return f"Handle(device={self.device}, ptr={self.ptr:#x}, stream={self._stream})" if self.ptr else "Handle(closed)"


_tls = threading.local()
# Handles made ahead by another thread, keyed by (thread they are for, device): see make_handle_for.
_made_ahead: dict[tuple[int, int], Handle] = {}
# Devices each thread holds a handle of its own for: make_handle_for has nothing to do for them.
# Keyed by the Thread object, not its ident: idents are reused once a thread ends.
_held: weakref.WeakKeyDictionary[threading.Thread, set[int]] = weakref.WeakKeyDictionary()


def get_handle(stream=None) -> Handle:
    """The calling thread's handle for the current device, pointed at ``stream`` (a CuPy stream or
    raw ``cudaStream_t``; ``None``: CuPy's current stream). Created on first use, or taken over from
    :func:`make_handle_for`."""
    cupy = require_cupy()
    device = int(cupy.cuda.runtime.getDevice())
    handles = getattr(_tls, "handles", None)
    if handles is None:
        handles = _tls.handles = {}
    h = handles.get(device)
    if h is None or h.ptr is None:
        h = _made_ahead.pop((threading.get_ident(), device), None) or Handle(device)
        h.thread = threading.get_ident()
        handles[device] = h
        _held.setdefault(threading.current_thread(), set()).add(device)
    return h.set_stream(stream)


def make_handle_for(thread: threading.Thread, device: int | None = None) -> None:
    """Create, from this thread, the handle that ``thread`` will get from :func:`get_handle` on
    ``device`` (default: the current one). Creating a handle loads cuDNN's libraries; a thread that
    has other start-up work (reading a model) lets a helper thread do it meanwhile. The handle is
    only ever used by ``thread``, after this returns."""
    cupy = require_cupy()
    dev = int(cupy.cuda.runtime.getDevice() if device is None else device)
    key = (thread.ident, dev)
    if dev in _held.get(thread, ()) or key in _made_ahead:  # it has one already (e.g. a second executor)
        return
    _made_ahead[key] = Handle(dev)


def _handle_ptr(handle) -> int:
    if handle is None:
        return get_handle().ptr  # type: ignore[return-value]
    if isinstance(handle, Handle):
        if handle.ptr is None:
            raise ValueError("the cuDNN handle is closed")
        return handle.ptr
    return int(handle)


# ---------------------------------------------------------------------------------------------
# algorithm queries
# ---------------------------------------------------------------------------------------------


class _PerfStruct(ctypes.Structure):
    """cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t: the three share one layout."""

    _fields_ = [
        ("algo", c_int),
        ("status", c_int),
        ("time", ctypes.c_float),
        ("memory", c_size_t),
        ("determinism", c_int),
        ("mathType", c_int),
        ("reserved", c_int * 3),
    ]


@dataclasses.dataclass(frozen=True)
class AlgoPerf:
    """One entry of a heuristic or search result."""

    algo: str  # convpass algorithm name (enums.algo_names(direction))
    status: str  # cudnnStatus_t name; only "CUDNN_STATUS_SUCCESS" entries are usable
    time_ms: float  # measured by Find; -1.0 from the heuristic
    workspace_bytes: int
    deterministic: bool
    math: str  # convpass math name of the math type cuDNN used / would use

    @property
    def ok(self) -> bool:
        return self.status == "CUDNN_STATUS_SUCCESS"


def _perf(direction: str, s: _PerfStruct) -> AlgoPerf:
    try:
        name = enums.algo_name(direction, s.algo)
    except ValueError:
        name = f"unknown_{s.algo}"
    try:
        math = enums.math_name(s.mathType)
    except ValueError:
        math = f"unknown_{s.mathType}"
    return AlgoPerf(
        algo=name,
        status=enums.status_name(s.status),
        time_ms=float(s.time),
        workspace_bytes=int(s.memory),
        deterministic=s.determinism == enums.CUDNN_DETERMINISTIC,
        math=math,
    )


_CALLS = {
    "fwd": {
        "max": "cudnnGetConvolutionForwardAlgorithmMaxCount",
        "heuristic": "cudnnGetConvolutionForwardAlgorithm_v7",
        "find": "cudnnFindConvolutionForwardAlgorithmEx",
        "workspace": "cudnnGetConvolutionForwardWorkspaceSize",
        "run": "cudnnConvolutionForward",
    },
    "dgrad": {
        "max": "cudnnGetConvolutionBackwardDataAlgorithmMaxCount",
        "heuristic": "cudnnGetConvolutionBackwardDataAlgorithm_v7",
        "find": "cudnnFindConvolutionBackwardDataAlgorithmEx",
        "workspace": "cudnnGetConvolutionBackwardDataWorkspaceSize",
        "run": "cudnnConvolutionBackwardData",
    },
    "wgrad": {
        "max": "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount",
        "heuristic": "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
        "find": "cudnnFindConvolutionBackwardFilterAlgorithmEx",
        "workspace": "cudnnGetConvolutionBackwardFilterWorkspaceSize",
        "run": "cudnnConvolutionBackwardFilter",
    },
}


def _direction(descs: ConvDescriptors, direction: str | None) -> str:
    return enums.check_direction(descs.key.shape.direction if direction is None else direction)


def _descs_in_order(descs: ConvDescriptors, direction: str) -> tuple[int, int, int]:
    """The three data descriptors in the order cuDNN's queries take them (inputs first, output last)."""
    if direction == "fwd":
        return descs.x, descs.w, descs.y  # x, w -> y
    if direction == "dgrad":
        return descs.w, descs.y, descs.x  # w, dy -> dx
    return descs.x, descs.y, descs.w  # x, dy -> dw


def _max_count(direction: str, h: int) -> int:
    n = c_int()
    library.call(_CALLS[direction]["max"], h, byref(n))
    return max(int(n.value), len(enums.algos(direction)))


def heuristic(descs: ConvDescriptors, direction: str | None = None, handle=None) -> list[AlgoPerf]:
    """cuDNN's heuristic ranking (``cudnnGet...Algorithm_v7``): every entry it returns, best
    first, unsupported ones included with their status. ``direction`` defaults to the key's."""
    direction = _direction(descs, direction)
    h = _handle_ptr(handle)
    n = _max_count(direction, h)
    perf = (_PerfStruct * n)()
    got = c_int()
    a, b, out = _descs_in_order(descs, direction)
    library.call(_CALLS[direction]["heuristic"], h, a, b, descs.conv, out, n, byref(got), perf)
    return [_perf(direction, perf[i]) for i in range(got.value)]


def find(descs: ConvDescriptors, direction: str | None, x, w, y, workspace=None, handle=None) -> list[AlgoPerf]:
    """cuDNN's own trial search (``cudnnFind...AlgorithmEx``), fastest first.

    It runs every algorithm once on the given buffers and overwrites the direction's output (y for
    fwd, x for dgrad, w for wgrad). Algorithms needing more than ``workspace`` (None / an int
    byte count to allocate / a buffer) come back with a failure status. Timings are single cold
    runs; convpass's tuner measures properly on its own.
    """
    direction = _direction(descs, direction)
    h = _handle_ptr(handle)
    p = descs.params
    xp = checked_pointer(x, "x", p.x, p.dtype, p.layout)
    wp = checked_pointer(w, "w", p.w, p.dtype, p.layout)
    yp = checked_pointer(y, "y", p.y, p.dtype, p.layout)
    ws_ptr, ws_size, keep = workspace_arg(workspace)
    n = _max_count(direction, h)
    perf = (_PerfStruct * n)()
    got = c_int()
    if direction == "fwd":
        data = (descs.x, xp, descs.w, wp, descs.conv, descs.y, yp)
    elif direction == "dgrad":
        data = (descs.w, wp, descs.y, yp, descs.conv, descs.x, xp)
    else:
        data = (descs.x, xp, descs.y, yp, descs.conv, descs.w, wp)
    library.call(_CALLS[direction]["find"], h, *data, n, byref(got), perf, ws_ptr, ws_size)
    del keep
    return [_perf(direction, perf[i]) for i in range(got.value)]


def workspace_size(descs: ConvDescriptors, direction: str | None, algo_name: str, handle=None,
                   x_strides: tuple[int, ...] | None = None, y_strides: tuple[int, ...] | None = None) -> int:
    """Bytes of workspace ``algo_name`` needs for this problem (forward: with ``x`` and ``y`` slices
    of these element strides, as :func:`run` is given them). Raises :class:`CudnnError` (with
    ``.not_supported`` true, usually ``CUDNN_STATUS_NOT_SUPPORTED``) when the algorithm cannot run
    the problem."""
    direction = _direction(descs, direction)
    algo = enums.algo_id(direction, algo_name)
    _forward_only(direction, x_strides, y_strides)
    return _workspace_size(descs, direction, algo, _handle_ptr(handle), x_strides, y_strides)


def _forward_only(direction: str, x_strides, y_strides) -> None:
    if (x_strides is not None or y_strides is not None) and direction != "fwd":
        raise ValueError("x_strides and y_strides are for the forward direction")


def _workspace_size(descs: ConvDescriptors, direction: str, algo: int, h: int, x_strides=None, y_strides=None) -> int:
    size = c_size_t()
    a, b, out = _descs_in_order(descs, direction)
    if direction == "fwd":
        a, out = descs.input(x_strides), descs.output(y_strides)
    library.call(_CALLS[direction]["workspace"], h, a, b, descs.conv, out, algo, byref(size))
    return int(size.value)


# ---------------------------------------------------------------------------------------------
# execution and its listeners
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CudnnCall:
    """What a call listener is told about one cuDNN execution."""

    call: str  # e.g. "cudnnConvolutionForward", "cudnnConvolutionBiasActivationForward"
    direction: str
    algo: str  # convpass algorithm name
    key: ProblemKey
    workspace_bytes: int
    stream: int | None  # raw cudaStream_t the handle was on, when known


CallListener = Callable[[CudnnCall], None]
_listeners: tuple[CallListener, ...] = ()
_listeners_lock = threading.Lock()


def add_call_listener(fn: CallListener) -> None:
    """Call ``fn(CudnnCall)`` after every successful cuDNN execution, from the executing thread."""
    global _listeners
    with _listeners_lock:
        _listeners = _listeners + (fn,)


def remove_call_listener(fn: CallListener) -> None:
    """Remove one registration of ``fn`` (no error when it is not registered)."""
    global _listeners
    with _listeners_lock:
        items = list(_listeners)
        if fn in items:
            items.remove(fn)
        _listeners = tuple(items)


@contextlib.contextmanager
def record_calls() -> Iterator[list[CudnnCall]]:
    """``with record_calls() as calls: ...`` collects the executions made inside the block."""
    calls: list[CudnnCall] = []
    add_call_listener(calls.append)
    try:
        yield calls
    finally:
        remove_call_listener(calls.append)


def _execute(call: str, direction: str, algo: str, key: ProblemKey, args: tuple, workspace_bytes: int, handle) -> None:
    """The one place every cuDNN execution goes through."""
    status = library.function(call)(*args)
    if status != enums.SUCCESS:
        raise CudnnError(status, call, library.last_error_string())
    listeners = _listeners
    if listeners:
        stream = handle.stream if isinstance(handle, Handle) else None
        record = CudnnCall(call, direction, algo, key, workspace_bytes, stream)
        for fn in listeners:
            fn(record)


def _described(t: TensorParams, strides: tuple[int, ...] | None) -> TensorParams:
    """What an array is checked against: the packed layout's strides, or the slice's given."""
    return t if strides is None else TensorParams(t.dims, tuple(int(v) for v in strides))


def _resolve(handle) -> tuple[int, object]:
    if handle is None:
        handle = get_handle()
    return _handle_ptr(handle), handle


def run(
    descs: ConvDescriptors,
    direction: str | None,
    algo_name: str,
    x,
    w,
    y,
    workspace=None,
    alpha: float = 1.0,
    beta: float = 0.0,
    handle=None,
    y_strides: tuple[int, ...] | None = None,
    x_strides: tuple[int, ...] | None = None,
) -> None:
    """Run one direction with one algorithm, asynchronously on the handle's stream.

    ``fwd``: y = alpha * conv(x, w) + beta * y; ``dgrad``: x = alpha * dgrad(y, w) + beta * x;
    ``wgrad``: w = alpha * wgrad(x, y) + beta * w. ``workspace``: a buffer (CuPy array,
    MemoryPointer or ``(ptr, nbytes)``) of at least :func:`workspace_size` bytes; ``None`` queries
    the size and allocates from CuPy's pool. ``y_strides`` / ``x_strides`` (forward only): ``y`` /
    ``x`` is a strided slice of a larger buffer with these element strides (see
    :meth:`ConvDescriptors.output`, :meth:`ConvDescriptors.input`); the array's strides must be
    these. Raises :class:`CudnnError` on failure.
    """
    direction = _direction(descs, direction)
    info = enums.algo_info(direction, algo_name)
    h, handle = _resolve(handle)
    p = descs.params
    _forward_only(direction, x_strides, y_strides)
    xp = checked_pointer(x, "x", _described(p.x, x_strides), p.dtype, p.layout)
    wp = checked_pointer(w, "w", p.w, p.dtype, p.layout)
    yp = checked_pointer(y, "y", _described(p.y, y_strides), p.dtype, p.layout)
    if workspace is None:
        workspace = _workspace_size(descs, direction, info.id, h, x_strides, y_strides)
    ws_ptr, ws_size, keep = workspace_arg(workspace)
    a, b = c_float(alpha), c_float(beta)
    if direction == "fwd":
        x_desc, y_desc = descs.input(x_strides), descs.output(y_strides)
        args = (h, byref(a), x_desc, xp, descs.w, wp, descs.conv, info.id, ws_ptr, ws_size, byref(b), y_desc, yp)
    elif direction == "dgrad":
        args = (h, byref(a), descs.w, wp, descs.y, yp, descs.conv, info.id, ws_ptr, ws_size, byref(b), descs.x, xp)
    else:
        args = (h, byref(a), descs.x, xp, descs.y, yp, descs.conv, info.id, ws_ptr, ws_size, byref(b), descs.w, wp)
    _execute(_CALLS[direction]["run"], direction, info.name, descs.key, args, ws_size, handle)
    del keep


def conv_bias_activation_forward(
    descs: ConvDescriptors,
    algo_name: str,
    x,
    w,
    y,
    bias,
    z=None,
    activation: str = "relu",
    alpha1: float = 1.0,
    alpha2: float | None = None,
    workspace=None,
    handle=None,
    y_strides: tuple[int, ...] | None = None,
    x_strides: tuple[int, ...] | None = None,
) -> None:
    """Fused ``y = act(alpha1 * conv(x, w) + alpha2 * z + bias)`` (cudnnConvolutionBiasActivationForward).

    ``bias``: ``k`` values, shaped ``(k,)`` or ``(1, k, 1, 1[, 1])``, in the data type of y.
    ``z``: optional residual shaped like y (may be y itself); ``alpha2`` defaults to 1 with z and 0
    without (then y is passed as z and not read). ``activation``: ``relu`` or ``identity`` -- cuDNN
    implements ``identity`` only with the ``implicit_precomp_gemm`` algorithm, so any other pairing
    raises ``ValueError`` here instead of a bare ``CUDNN_STATUS_NOT_SUPPORTED`` later.
    ``y_strides``: ``y`` (and ``z``, which must then be ``None`` or ``y``) is a strided slice of a
    larger buffer with these element strides; ``x_strides``: ``x`` is one.
    """
    if activation not in enums.FUSED_ACTIVATIONS:
        raise ValueError(
            f"cudnnConvolutionBiasActivationForward supports activations {enums.FUSED_ACTIVATIONS}, not {activation!r}"
        )
    info = enums.algo_info("fwd", algo_name)
    if activation == "identity" and info.name != "implicit_precomp_gemm":
        raise ValueError(
            "cuDNN's fused conv + bias + activation supports the 'identity' activation only with the "
            f"'implicit_precomp_gemm' forward algorithm, not {info.name!r}; use 'relu', that algorithm, "
            "or run the convolution and add the bias separately"
        )
    if alpha2 is None:
        alpha2 = 0.0 if z is None else 1.0
    if z is None and alpha2 != 0.0:
        raise ValueError("alpha2 != 0 needs a residual tensor z")
    h, handle = _resolve(handle)
    p = descs.params
    xp = checked_pointer(x, "x", _described(p.x, x_strides), p.dtype, p.layout)
    wp = checked_pointer(w, "w", p.w, p.dtype, p.layout)
    if y_strides is not None and z is not None and z is not y:
        raise ValueError("a strided y takes no separate residual z")
    x_desc, y_desc = descs.input(x_strides), descs.output(y_strides)
    yp = checked_pointer(y, "y", _described(p.y, y_strides), p.dtype, p.layout)
    zp = yp if z is None or z is y else checked_pointer(z, "z", p.y, p.dtype, p.layout)
    bp = checked_pointer(bias, "bias", p.bias, p.dtype, p.layout)
    if workspace is None:
        workspace = _workspace_size(descs, "fwd", info.id, h, x_strides, y_strides)
    ws_ptr, ws_size, keep = workspace_arg(workspace)
    a1, a2 = c_float(alpha1), c_float(alpha2)
    args = (
        h,
        byref(a1),
        x_desc,
        xp,
        descs.w,
        wp,
        descs.conv,
        info.id,
        ws_ptr,
        ws_size,
        byref(a2),
        y_desc,
        zp,
        descs.bias,
        bp,
        descs.activation(activation),
        y_desc,
        yp,
    )
    _execute("cudnnConvolutionBiasActivationForward", "fwd", info.name, descs.key, args, ws_size, handle)
    del keep

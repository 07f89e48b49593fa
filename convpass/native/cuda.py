"""What every module of the cuda backend shares: availability, warnings, memory-format helpers.

Importing this module imports neither CuPy nor cuDNN.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from convpass.core.errors import ExecutorError

logger = logging.getLogger("convpass")

__all__ = [
    "CaptureBreak",
    "ELEMENTWISE",
    "ExecutorWarning",
    "channels_last",
    "copy_into",
    "device_index",
    "first_line",
    "open_ahead",
    "storage",
    "unavailable_reason",
]


class ExecutorWarning(UserWarning):
    """The cuda executor runs something otherwise than the model records, or cannot capture a plan."""


class StartupCompileWarning(UserWarning):
    """Kernels were compiled at start-up: the model has no usable kernel side-car for this GPU.
    What runs is unchanged (a category of its own, so a deployment can make it an error)."""


class CaptureBreak(RuntimeError):
    """An op needs the host (an upload, a device -> host copy, an allocation) while a CUDA graph is
    being captured. Raised by the backend's transfer hooks; the runner reports the node."""


# Ops whose result does not depend on the memory order of their operands: they run on the
# channels-last storage of channels-last inputs, so their outputs stay channels-last (CuPy allocates
# every element-wise result C-contiguous in the shape it is given).
ELEMENTWISE = frozenset(
    """Abs Neg Exp Log Sqrt Reciprocal Floor Ceil Round Sign Sin Cos Tan Asin Acos Atan Sinh Cosh Asinh
    Acosh Atanh Tanh Relu Not IsNaN Softsign Sigmoid Softplus Mish Erf IsInf LeakyRelu Elu Celu Selu
    ThresholdedRelu HardSigmoid HardSwish Swish Shrink Gelu Clip Add Sub Mul Div Pow Mod Equal Less
    LessOrEqual Greater GreaterOrEqual And Or Xor Where Cast Max Min Sum Mean""".split()
)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def channels_last(a: Any) -> bool:
    """Whether ``a`` (logical channels-first, rank 3-5) is stored channels-last and not also
    channels-first (C == 1 or 1x1 spatial arrays are both)."""
    from convpass.native import cudnn

    return a.ndim >= 3 and cudnn.layout_of(a) == "nhwc"


def storage(a: Any) -> Any:
    """``a`` in its memory order: the channels-last view ``(n, *spatial, c)`` for channels-last
    arrays, ``a`` itself otherwise."""
    if channels_last(a):
        return a.transpose(0, *range(2, a.ndim), 1)
    return a


def copy_into(dst: Any, src: Any) -> None:
    """``dst[...] = src``, walked in memory order. CuPy's copy walks the logical order and merges
    only adjacent dimensions, so channels-last arrays seen channels-first were copied with a stride
    of C elements between neighbouring threads (a UNet's NHWC skip Concats took three times as long
    as the same copies in NCHW; docs/measurements/2026-11-23-nhwc-passthrough.md); both in their
    channels-last view, the copy is rows of channels."""
    from convpass.core.layout import storage_order

    order = storage_order(dst)
    if order is not None and storage_order(src) == order:
        dst.transpose(order)[...] = src.transpose(order)
    else:
        dst[...] = src


_FENCE_BYTES = 16
_fences: dict[int, Any] = {}  # device index -> a scratch buffer only fences write


def stream_fence(cp: Any) -> None:
    """A 16-byte memset of a scratch buffer on the current stream: the next launch starts only once
    every earlier one has finished. A kernel that cuDNN launches to overlap the end of its producer
    (a programmatic dependency) becomes, in a captured graph, a node that may start before that
    producer is done; a memset node between them is a full dependency. Some fused graph-API engine
    graphs computed wrong outputs in captured plans without it, and right ones with it
    (docs/measurements/2026-11-28-engine-epilogue-fence.md)."""
    dev = cp.cuda.runtime.getDevice()
    buf = _fences.get(dev)
    if buf is None:
        buf = _fences[dev] = cp.cuda.runtime.malloc(_FENCE_BYTES)  # outside the plans' pools, never freed
    cp.cuda.runtime.memsetAsync(buf, 0, _FENCE_BYTES, cp.cuda.get_current_stream().ptr)


def elements(strides: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    return tuple(int(s) // itemsize for s in strides)


_reason_cache: list[str | None] = []
_reason_lock = threading.Lock()  # the executor's helper thread (open_ahead) may ask at the same time


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
        from convpass.native.cudnn import library

        library.version()
    except Exception as e:  # noqa: BLE001
        return f"cuDNN cannot be loaded: {str(e).splitlines()[0]}"
    return None


def unavailable_reason() -> str | None:
    """None when the cuda backend can run here, else why not (checked once per process)."""
    with _reason_lock:
        if not _reason_cache:
            _reason_cache.append(_probe())
        return _reason_cache[0]


_helpers: set[threading.Thread] = set()
_helpers_lock = threading.Lock()


def start_helper(target: Callable[[], None], name: str) -> threading.Thread:
    """Start a daemon thread that does CUDA work ahead of the caller (a fresh process's set-up,
    cuDNN queries ahead of a plan). It is registered until it ends, so that every capture waits
    for it (:func:`quiet_for_capture`), and so does the interpreter's exit (a thread left inside a
    CUDA library while the process tears it down may crash it). ``target`` must not raise."""

    def run() -> None:
        try:
            target()
        finally:
            with _helpers_lock:
                _helpers.discard(thread)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _helpers_lock:
        _helpers.add(thread)
    thread.start()
    return thread


def join_helpers(timeout: float | None = None) -> None:
    """Wait for every helper thread :func:`start_helper` started (each at most ``timeout`` s)."""
    with _helpers_lock:
        running = [t for t in _helpers if t is not threading.current_thread()]
    for t in running:
        t.join(timeout)


atexit.register(join_helpers, 10.0)


@contextlib.contextmanager
def quiet_for_capture() -> Iterator[None]:
    """What must not happen while a stream captures (the executor's plans, the tuner's timing
    graphs) held off. Helper threads are waited for: their CUDA calls (a cuDNN handle made or
    destroyed, kernels readied) would fall inside the capture. Python's cyclic garbage collector is
    paused: a collection may free what an older plan or backend left (its CuPy memory pool gives
    its blocks back to the device, a library handle frees device memory), and freeing device
    memory inside a capture invalidates it: the capture's next launch then fails (cuBLAS status
    13 or 14)."""
    join_helpers()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def open_ahead(device: Any) -> Callable[[], None]:
    """Start a GPU's one-time set-up on helper threads: CUDA's driver and the device's primary
    context (:func:`retain_primary_context`, beside CuPy's import), then cuDNN's libraries and the
    calling thread's cuDNN handle (0.3-0.5 s of a fresh process), so that it overlaps what the
    caller does next (the executor: reading the model). Returns the function that waits for it.
    Nothing fails here: what went wrong is met again, and raised, where it is needed (making the
    backend, getting the handle). When the GPU turns out unusable (no CuPy, no cuDNN), the context
    made through the driver is released again."""
    caller = threading.current_thread()
    retained: list[Callable[[], None]] = []

    def open_context() -> None:
        try:
            retained.append(retain_primary_context(device_index(device)))
        except Exception as e:  # noqa: BLE001
            logger.debug("CUDA context ahead of time through the driver failed (%s); CuPy creates it", e)

    def open_device() -> None:
        try:
            if unavailable_reason() is not None:  # imports CuPy, initializes CUDA, loads cuDNN
                context.join()
                for release in retained:  # no backend will use it: give its memory back
                    release()
                return
            import cupy

            from convpass.native import cudnn

            index = device_index(device)
            with cupy.cuda.Device(index):
                context.join()
                cupy.cuda.runtime.free(0)  # the primary context (made already, unless the driver API failed)
                cudnn.api.make_handle_for(caller, index)
        except Exception as e:  # noqa: BLE001
            logger.debug("CUDA set-up ahead of time failed (%s); it is done again when needed", e)

    context = start_helper(open_context, "convpass-cuda-context")
    opener = start_helper(open_device, "convpass-cuda-open")
    return opener.join


def retain_primary_context(index: int) -> Callable[[], None]:
    """Initialize CUDA's driver and create device ``index``'s primary context through the driver
    API (libcuda by ctypes, which lets go of the GIL): a large part of a fresh process's start,
    which then runs beside CuPy's import (which holds the GIL). The CUDA runtime, and so CuPy,
    uses that same primary context, and keeps it for the life of the process. Returns the function
    that releases this reference. Raises OSError without a driver, RuntimeError with the driver's
    error code."""
    import ctypes
    import functools

    from convpass.native.device import driver_call

    libcuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    call = functools.partial(driver_call, libcuda)
    call("cuInit", 0)
    call("cuDeviceGet", ctypes.byref(dev), index)
    call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    return lambda: call("cuDevicePrimaryCtxRelease_v2", dev)  # the name cuda.h maps the call to since CUDA 11


def device_index(device: Any) -> int:
    """The CUDA device a name or number means (0 for 'cuda', 'gpu', 'auto' and None)."""
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

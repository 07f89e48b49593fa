"""The local GPU's fingerprint, asked of the CUDA driver: :func:`detect`.

:class:`~convpass.core.device.DeviceFingerprint` (what a measurement belongs to) lives in the core;
this module asks the driver and cuDNN for the one of this machine.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.util
import sys
import threading
from typing import Any

from convpass.core.device import DeviceFingerprint, cudnn_version_string

__all__ = ["DeviceFingerprint", "cudnn_version_string", "detect", "driver_call", "start_driver"]


def detect() -> DeviceFingerprint | None:
    """The fingerprint of the current CUDA device, or None when no GPU / CuPy / cuDNN is usable.

    Asked of the CUDA driver (libcuda, by ctypes), not of CuPy: importing CuPy to ask was a large
    part of a cached ``convpass optimize``, which then has nothing else to use CuPy for. CuPy must
    still be installed (the tuner and the executor run on it). The current device is CuPy's: the
    one whose context is current on this thread, else device 0.

    CuPy's import is not tried here: a CuPy that cannot use this GPU (a broken install, a driver
    older than its CUDA) fails at the first measurement, not as "no GPU".

    Never raises for a missing GPU stack: callers decide what to do without one.
    """
    if not _cupy_installed():
        return None
    try:
        try:
            libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError:  # no driver library by that name: CuPy's own answer (or its failure), as before
            name, cc, sms = _asked_of_cupy()
        else:
            name, cc, sms = _asked_of_driver(libcuda)
        from convpass.native.cudnn import library

        cudnn_version = library.version()
    except Exception:  # noqa: BLE001  (any failure means: no usable GPU here)
        return None
    return DeviceFingerprint(name=name, compute_capability=cc, sm_count=sms, cudnn_version=int(cudnn_version))


def _cupy_installed() -> bool:
    return "cupy" in sys.modules or importlib.util.find_spec("cupy") is not None


_driver_lock = threading.Lock()
_driver_thread: threading.Thread | None = None


def start_driver() -> None:
    """Start CUDA's driver (``cuInit``: a large part of a cached ``convpass optimize``, spent
    without the GIL) and load cuDNN on a helper thread, once per process, so that a later
    :func:`detect` finds both ready while the caller imports and reads its model meanwhile. Which
    device is current is still decided by :func:`detect`, on the caller's thread. A failure here
    is left for :func:`detect` to meet (it then answers None)."""
    global _driver_thread
    with _driver_lock:
        if _driver_thread is not None or not _cupy_installed():
            return

        def start() -> None:
            try:
                ctypes.CDLL("libcuda.so.1").cuInit(0)
                from convpass.native.cudnn import library

                library.load()
            except Exception:  # noqa: BLE001
                pass

        _driver_thread = threading.Thread(target=start, name="convpass-driver", daemon=True)
        _driver_thread.start()
        # a run that fails in its first 0.2 s must not exit while the thread is inside the driver
        # or a dlopen (the libraries' destructors would run beside it)
        atexit.register(_driver_thread.join, 10)


# CUdevice_attribute values (cuda.h)
_MULTIPROCESSOR_COUNT, _CC_MAJOR, _CC_MINOR = 16, 75, 76


def driver_call(libcuda: ctypes.CDLL, fn: str, *args: Any) -> None:
    """Call the CUDA driver's ``fn`` (libcuda by ctypes); RuntimeError with its status on failure."""
    status = getattr(libcuda, fn)(*args)
    if status != 0:
        raise RuntimeError(f"{fn} returned CUDA error {status}")


def _asked_of_driver(libcuda: ctypes.CDLL) -> tuple[str, str, int]:
    """(name, compute capability, SM count) of the current device through the driver API.
    Raises RuntimeError with the driver's status, or LookupError without a device."""
    call = functools.partial(driver_call, libcuda)
    call("cuInit", 0)
    count = ctypes.c_int()
    call("cuDeviceGetCount", ctypes.byref(count))
    if count.value < 1:
        raise LookupError("no CUDA device")
    context, device = ctypes.c_void_p(), ctypes.c_int()
    call("cuCtxGetCurrent", ctypes.byref(context))
    if context.value:
        call("cuCtxGetDevice", ctypes.byref(device))
    else:
        call("cuDeviceGet", ctypes.byref(device), 0)
    name = ctypes.create_string_buffer(256)
    call("cuDeviceGetName", name, len(name), device)

    def attribute(which: int) -> int:
        value = ctypes.c_int()
        call("cuDeviceGetAttribute", ctypes.byref(value), which, device)
        return value.value

    return name.value.decode(), f"{attribute(_CC_MAJOR)}.{attribute(_CC_MINOR)}", attribute(_MULTIPROCESSOR_COUNT)


def _asked_of_cupy() -> tuple[str, str, int]:
    import cupy
    from cupy.cuda import runtime

    if runtime.getDeviceCount() < 1:
        raise LookupError("no CUDA device")
    props = runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return name, f"{props['major']}.{props['minor']}", int(props["multiProcessorCount"])

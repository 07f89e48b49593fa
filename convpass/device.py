"""Device fingerprints: which GPU and cuDNN a measurement belongs to.

A measurement is only valid on the GPU model and cuDNN version it was taken with. The fingerprint
is part of every tuning-cache key and is recorded in every tuned model, so the executor can tell
when it runs somewhere else.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import importlib.util
import re
import sys
import threading
from typing import Any


@dataclasses.dataclass(frozen=True)
class DeviceFingerprint:
    """GPU name, compute capability, SM count and cuDNN version (e.g. 91900 for 9.19.0)."""

    name: str
    compute_capability: str
    sm_count: int
    cudnn_version: int

    def __str__(self) -> str:
        return f"{self.name}|sm_{self.compute_capability}|{self.sm_count}sm|cudnn{self.cudnn_version}"

    @property
    def cudnn_version_str(self) -> str:
        return cudnn_version_string(self.cudnn_version)

    @classmethod
    def parse(cls, text: str) -> "DeviceFingerprint":
        m = re.fullmatch(r"(?P<name>.+)\|sm_(?P<cc>\d+\.\d+)\|(?P<sms>\d+)sm\|cudnn(?P<ver>\d+)", text.strip())
        if not m:
            raise ValueError(f"not a convpass device fingerprint: {text!r}")
        return cls(m["name"], m["cc"], int(m["sms"]), int(m["ver"]))

    def matches_name(self, name: str) -> bool:
        """Whether a user's ``--device-name`` (e.g. ``H200`` or ``NVIDIA H100 80GB HBM3``) names it."""
        wanted = name.strip().lower()
        return wanted == str(self).lower() or wanted in self.name.lower()


def cudnn_version_string(version: int) -> str:
    """cuDNN 9 encodes versions as major*10000 + minor*100 + patch (91900 -> '9.19.0')."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def detect() -> DeviceFingerprint | None:
    """The fingerprint of the current CUDA device, or None when no GPU / CuPy / cuDNN is usable.

    Asked of the CUDA driver (libcuda, by ctypes), not of CuPy: importing CuPy to ask took 0.3 s
    of a 1.7 s cached ``convpass optimize`` on an H200, which then has nothing else to use CuPy
    for. CuPy must still be installed (the tuner and the executor run on it). The current device
    is CuPy's: the one whose context is current on this thread, else device 0.

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
        from convpass.cudnn import library

        cudnn_version = library.version()
    except Exception:  # noqa: BLE001  (any failure means: no usable GPU here)
        return None
    return DeviceFingerprint(name=name, compute_capability=cc, sm_count=sms, cudnn_version=int(cudnn_version))


def _cupy_installed() -> bool:
    return "cupy" in sys.modules or importlib.util.find_spec("cupy") is not None


_driver_lock = threading.Lock()
_driver_thread: threading.Thread | None = None


def start_driver() -> None:
    """Start CUDA's driver (``cuInit``: 0.2 s of a cached ``convpass optimize`` on an H200, spent
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
                from convpass.cudnn import library

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

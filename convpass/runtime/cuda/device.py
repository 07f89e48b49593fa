"""The GPU a cuda backend runs on: opened (CuPy imported, the index checked against the visible
devices) and described in one line."""

from __future__ import annotations

from typing import Any

from convpass.core.errors import ExecutorError
from convpass.native.cuda import device_index


def open_device(device: Any) -> tuple[Any, int, Any]:
    """``(cupy, device index, cupy.cuda.Device)`` for ``device`` (an index, ``"cuda:N"``, ...);
    :class:`ExecutorError` for a device that does not exist. The caller has checked that the cuda
    backend can run here (:func:`convpass.native.cuda.unavailable_reason`)."""
    import cupy

    device_id = device_index(device)
    count = int(cupy.cuda.runtime.getDeviceCount())
    if not 0 <= device_id < count:
        raise ExecutorError(f"CUDA device {device_id} does not exist ({count} visible)")
    return cupy, device_id, cupy.cuda.Device(device_id)


def describe(cp: Any, device_id: int, cuda_graph: bool) -> str:
    """``cuda:N (GPU name, cuDNN version, CuPy version, CUDA graphs | eager)``; ``?`` for what cannot be read."""
    try:
        from convpass.native.cudnn import library

        props = cp.cuda.runtime.getDeviceProperties(device_id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        v = library.version()
        cudnn = f"cuDNN {v // 10000}.{v // 100 % 100}.{v % 100}"
    except Exception:  # noqa: BLE001
        name, cudnn = "?", "cuDNN ?"
    graphs = "CUDA graphs" if cuda_graph else "eager"
    return f"cuda:{device_id} ({name}, {cudnn}, CuPy {cp.__version__}, {graphs})"

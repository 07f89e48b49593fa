"""Which backend runs a model: ``get_backend("cpu" | "cuda" | "cuda:1" | "auto" | Backend)``.

The one module that knows both backends: the executor asks it, the backends never import it, so
the dependencies run one way (executor -> devices -> backends / cuda -> backends, plan).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from convpass.core.errors import ExecutorError
from convpass.kernels.backends import Backend, host_backend

DEVICES = ("cpu", "cuda")


def cuda_unavailable_reason() -> str | None:
    """None when the cuda backend can run here, else why not."""
    try:
        from convpass.runtime import cuda
    except ImportError as e:
        return f"cannot import the CuPy + cuDNN backend: {e}"
    return cuda.unavailable_reason()


def cuda_available() -> bool:
    return cuda_unavailable_reason() is None


def default_device() -> str:
    """'cuda' when the cuda backend is usable here, else 'cpu'."""
    return "cuda" if cuda_available() else "cpu"


def open_ahead(device: str | Backend) -> Callable[[], None]:
    """Start the set-up of the GPU ``device`` names ('cuda', 'cuda:N', 'auto') on a helper thread,
    before its backend is made (:func:`convpass.runtime.cuda.open_ahead`); returns the function
    that waits for it (nothing to wait for on the host, or for a backend already made)."""
    if isinstance(device, Backend):
        return lambda: None
    name = str(device).lower()
    if not (name.startswith("cuda") or name in ("auto", "")):
        return lambda: None
    try:
        from convpass.runtime import cuda
    except ImportError:
        return lambda: None
    return cuda.open_ahead(name)


def get_backend(device: str | Backend, **options: Any) -> Backend:
    """The backend for ``device`` ('cpu', 'cuda', 'cuda:N', 'auto' or a Backend instance)."""
    if isinstance(device, Backend):
        return device
    name = str(device).lower()
    if name in ("auto", ""):
        name = default_device()
    if name.startswith("cuda"):
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise ExecutorError(f"cuda backend not available: {reason}; use device='cpu'")
        from convpass.runtime import cuda

        return cuda.CudaBackend(device=name, **options)
    if name == "cpu":
        return host_backend()
    raise ExecutorError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)} or 'auto'")

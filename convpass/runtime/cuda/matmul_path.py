"""The cuda backend's Gemm / MatMul path: cuBLAS by ctypes, which CUDA graphs can capture, and the
model's TF32 switch.

The ops see ``cupy`` through :class:`CupyNamespace`, whose ``matmul`` is :func:`matmul`: cuBLAS
through :mod:`convpass.native.cublas` (CuPy refuses cuBLAS calls during stream capture); cases it
does not cover go to ``cupy.matmul`` (and that launch then runs eagerly between graphs). TF32
follows the model's ``convpass.matmul_allow_tf32``: ``CUBLAS_COMPUTE_32F_FAST_TF32`` or
``CUBLAS_COMPUTE_32F``; for the ``cupy.matmul`` fallback :func:`matmul_math` sets CuPy's float32
compute type and the math mode of CuPy's cuBLAS handle while the executor runs, and restores them.

The functions are the backend's matmul methods (:class:`convpass.runtime.cuda.backend.CudaBackend`
delegates to them): they keep their state on the backend (``_blas``, ``_blas_ahead``, ``_tf32_now``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from convpass.native.cuda import CaptureBreak, start_helper

logger = logging.getLogger("convpass")


class CupyNamespace:
    """``cupy`` for the ops, except ``matmul``: the backend's capturable cuBLAS path."""

    def __init__(self, cupy: Any, backend: Any) -> None:
        self.__dict__["_cupy"] = cupy
        self.__dict__["_backend"] = backend

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._cupy, name)
        self.__dict__[name] = value  # looked up once
        return value

    def matmul(self, a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        return matmul(self._backend, a, b, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<cupy namespace of the convpass cuda backend (CuPy {self._cupy.__version__})>"


def matmul(backend: Any, a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
    """``xp.matmul``: cuBLAS by ctypes (capturable, explicit TF32 switch), else ``cupy.matmul``."""
    cp = backend.cp
    if not args and not kwargs and isinstance(a, cp.ndarray) and isinstance(b, cp.ndarray):
        blas = backend.blas()
        if blas:
            try:
                out = blas.matmul(a, b, backend._tf32_now)
            except RuntimeError as e:
                if backend.capturing:
                    raise
                logger.debug("cuBLAS by ctypes failed (%s): cupy.matmul instead", e)
                out = None
            if out is not None:
                return out
    if backend.capturing:
        raise CaptureBreak(f"a matmul of shapes {getattr(a, 'shape', '?')} @ {getattr(b, 'shape', '?')} needs cupy.matmul, which cannot be captured")
    return cp.matmul(a, b, *args, **kwargs)


def ready_libraries(backend: Any, op_types: Iterable[str]) -> None:
    """cuBLAS made ahead, on a helper thread, for a model with MatMul or Gemm (top-level nodes):
    the handle, its workspace and a first small product (:meth:`convpass.native.cublas.Blas.warm`),
    in ctypes calls that let go of the GIL while the executor goes on reading the model and
    building its plan. A failure there is only logged (debug): :func:`blas` then makes the handle
    on the calling thread, as without this, and reports what fails there."""
    if backend._blas is not None or backend._blas_ahead is not None or not {"MatMul", "Gemm"} & set(op_types):
        return
    from convpass.native import cublas as blas

    def make() -> None:
        try:
            with backend._device:
                made = blas.Blas(backend.cp)
                made.warm(backend._allow_tf32, backend.matmul_epilogues)
            backend._blas = made
        except Exception as e:  # noqa: BLE001
            logger.debug("cuBLAS ahead of time failed (%s); it is made again when needed", e)

    backend._blas_ahead = start_helper(make, "convpass-cublas")


def blas(backend: Any) -> Any:
    """The backend's :class:`convpass.native.cublas.Blas` (created on first use, or ahead by
    :func:`ready_libraries`; never during capture), or False when cuBLAS cannot be called
    directly (noted once)."""
    if backend._blas_ahead is not None:
        backend._blas_ahead.join()
        backend._blas_ahead = None
    if backend._blas is None:
        if backend.capturing:
            raise CaptureBreak("cuBLAS handle created during capture")
        from convpass.native import cublas as blas

        try:
            with backend._device:
                backend._blas = blas.Blas(backend.cp)
        except Exception as e:  # noqa: BLE001
            backend._blas = False
            backend.note_once("blas", f"cuBLAS cannot be called directly ({e}): Gemm / MatMul use cupy.matmul, which runs eagerly between CUDA graphs")
    return backend._blas


@contextlib.contextmanager
def matmul_math(backend: Any, allow_tf32: bool) -> Iterator[None]:
    """TF32 on or off for the backend's matmuls while the block runs: its own cuBLAS path, CuPy's
    float32 compute type and the math mode of CuPy's cuBLAS handle; what could not be set is noted."""
    restore = []
    tf32_before = backend._tf32_now
    backend._tf32_now = bool(allow_tf32)
    restore.append(lambda: setattr(backend, "_tf32_now", tf32_before))

    def cupy_compute_type() -> tuple[Any, Any, Any]:
        from cupy._core import _routines_linalg as lin

        f32 = np.dtype(np.float32)
        want = getattr(lin, "COMPUTE_TYPE_TF32", 7) if allow_tf32 else getattr(lin, "COMPUTE_TYPE_DEFAULT", 1)
        return (lambda: lin.get_compute_type(f32)), (lambda v: lin.set_compute_type(f32, v)), want

    def cublas_math_mode() -> tuple[Any, Any, Any]:
        from cupy_backends.cuda.libs import cublas

        handle = backend.cp.cuda.device.get_cublas_handle()
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
            backend.note_once(tag, f"cannot set {what}: {e}", warn=False)
    try:
        yield
    finally:
        for undo in reversed(restore):
            try:
                undo()
            except Exception:  # noqa: BLE001
                pass

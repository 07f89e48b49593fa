"""Matrix products for the cuda backend that CUDA graphs can capture.

CuPy refuses any cuBLAS call while a stream is capturing (its ``cublas.setStream`` raises
``NotImplementedError: calling cuBLAS API during stream capture is currently unsupported``), although
cuBLAS itself supports capture when the handle has a user workspace. So the cuda backend runs
``matmul`` through its own cuBLAS handle, by ctypes, on the very ``libcublas`` CuPy loaded:
``cublasGemmEx`` / ``cublasGemmStridedBatchedEx`` with a fixed workspace (``cublasSetWorkspace``,
set again after every ``cublasSetStream``, which resets it) and an explicit compute type:
``CUBLAS_COMPUTE_32F_FAST_TF32`` when the model allows TF32 for Gemm / MatMul
(``convpass.matmul_allow_tf32``), ``CUBLAS_COMPUTE_32F`` otherwise.

Covered: float32 / float16 operands of rank >= 2 whose batch dimensions are either the full
broadcast batch or absent / all ones (stride 0); row-major or transposed (column-major) 2-D
operands are used in place, anything else is made contiguous first. Everything else (1-D
operands, general broadcasting, other dtypes, a library that cannot be loaded) goes to
``cupy.matmul``, which is correct but cannot be captured: such a plan runs eagerly.
"""

from __future__ import annotations

import ctypes
import math
import sys
from ctypes import POINTER, byref, c_float, c_int, c_longlong, c_size_t, c_void_p
from typing import Any

import numpy as np

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
CUBLAS_GEMM_DEFAULT = -1
CUDA_R_32F, CUDA_R_16F = 0, 2
_DATA_TYPES = {np.dtype(np.float32): CUDA_R_32F, np.dtype(np.float16): CUDA_R_16F}
WORKSPACE_BYTES = 32 << 20  # what cuBLAS recommends for Hopper


class BlasUnavailable(RuntimeError):
    pass


def _library() -> ctypes.CDLL:
    """CuPy's libcublas (found in this process's mappings), else the usual sonames."""
    try:
        import cupy

        cupy.cuda.device.get_cublas_handle()  # makes sure CuPy has loaded its cuBLAS
    except Exception:  # noqa: BLE001
        pass
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                name = path.rsplit("/", 1)[-1]
                if name.startswith("libcublas.so") and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    errors = []
    for candidate in paths + ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]:
        try:
            lib = ctypes.CDLL(candidate)
            lib.cublasGemmStridedBatchedEx  # noqa: B018  (the symbols we need)
            return lib
        except (OSError, AttributeError) as e:
            errors.append(f"{candidate}: {e}")
    raise BlasUnavailable("cannot load libcublas: " + "; ".join(errors))


def _declare(lib: ctypes.CDLL) -> None:
    lib.cublasCreate_v2.argtypes = [POINTER(c_void_p)]
    lib.cublasDestroy_v2.argtypes = [c_void_p]
    lib.cublasSetStream_v2.argtypes = [c_void_p, c_void_p]
    lib.cublasSetWorkspace_v2.argtypes = [c_void_p, c_void_p, c_size_t]
    lib.cublasGemmEx.argtypes = [
        c_void_p, c_int, c_int, c_int, c_int, c_int,  # handle, transa, transb, m, n, k
        c_void_p,  # alpha
        c_void_p, c_int, c_int,  # A, Atype, lda
        c_void_p, c_int, c_int,  # B, Btype, ldb
        c_void_p,  # beta
        c_void_p, c_int, c_int,  # C, Ctype, ldc
        c_int, c_int,  # computeType, algo
    ]
    lib.cublasGemmStridedBatchedEx.argtypes = [
        c_void_p, c_int, c_int, c_int, c_int, c_int,
        c_void_p,
        c_void_p, c_int, c_int, c_longlong,  # A, Atype, lda, strideA
        c_void_p, c_int, c_int, c_longlong,  # B, Btype, ldb, strideB
        c_void_p,
        c_void_p, c_int, c_int, c_longlong,  # C, Ctype, ldc, strideC
        c_int, c_int, c_int,  # batchCount, computeType, algo
    ]
    for name in ("cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasGemmEx", "cublasGemmStridedBatchedEx"):
        getattr(lib, name).restype = c_int


class Blas:
    """One cuBLAS handle with its own workspace, on the current CUDA device."""

    def __init__(self, cupy: Any) -> None:
        self.cp = cupy
        self.lib = _library()
        _declare(self.lib)
        h = c_void_p()
        self._check(self.lib.cublasCreate_v2(byref(h)), "cublasCreate")
        self.handle = h
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=np.uint8)
        self._stream: int | None = None
        self._one = c_float(1.0)
        self._zero = c_float(0.0)
        self.calls = 0

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call} failed: cuBLAS status {status}")

    def close(self) -> None:
        h, self.handle = getattr(self, "handle", None), None
        if h is not None and h.value:
            try:
                self.lib.cublasDestroy_v2(h)
            except Exception:  # noqa: BLE001
                pass

    def __del__(self) -> None:
        if not sys.is_finalizing():
            self.close()

    def _bind_stream(self) -> None:
        ptr = int(self.cp.cuda.get_current_stream().ptr)
        if ptr != self._stream:
            self._check(self.lib.cublasSetStream_v2(self.handle, c_void_p(ptr)), "cublasSetStream")
            # cublasSetStream resets the workspace to cuBLAS's own pool: set ours again
            self._check(
                self.lib.cublasSetWorkspace_v2(self.handle, c_void_p(int(self.workspace.data.ptr)), c_size_t(self.workspace.nbytes)),
                "cublasSetWorkspace",
            )
            self._stream = ptr

    # ------------------------------------------------------------------ matmul

    @staticmethod
    def _operand(x: Any) -> tuple[Any, int, int] | None:
        """(array, op, ld) so that the column-major view of the memory, after op, is x^T."""
        itemsize = x.itemsize
        r, c = x.shape[-2:]
        s0, s1 = x.strides[-2] // itemsize, x.strides[-1] // itemsize
        if (s1 == 1 or c == 1) and s0 >= max(1, c):
            return x, CUBLAS_OP_N, max(1, s0 if r > 1 else c)
        if (s0 == 1 or r == 1) and s1 >= max(1, r):
            return x, CUBLAS_OP_T, max(1, s1 if c > 1 else r)
        return None

    def matmul(self, a: Any, b: Any, allow_tf32: bool) -> Any | None:
        """``a @ b`` through cuBLAS, or None when this case is left to ``cupy.matmul``."""
        cp = self.cp
        if a.ndim < 2 or b.ndim < 2 or a.dtype != b.dtype or a.dtype not in _DATA_TYPES:
            return None
        m, k = a.shape[-2:]
        k2, n = b.shape[-2:]
        if k != k2 or 0 in a.shape or 0 in b.shape:
            return None
        dtype = a.dtype
        dt = _DATA_TYPES[dtype]
        compute = CUBLAS_COMPUTE_32F_FAST_TF32 if (allow_tf32 and dtype == np.float32) else CUBLAS_COMPUTE_32F
        try:
            batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        except ValueError:
            return None
        count = math.prod(batch)
        if b.ndim == 2 and a.ndim > 2:
            # (..., m, k) @ (k, n): one gemm over the flattened rows of a
            a2 = a if a.flags.c_contiguous else cp.ascontiguousarray(a)
            out = self._gemm(a2.reshape(-1, k), b, dt, compute)
            return out.reshape(*a.shape[:-1], n)
        if a.ndim == 2 and b.ndim == 2:
            return self._gemm(a, b, dt, compute)

        def batch_stride(x: Any) -> int | None:
            bdims = x.shape[:-2]
            if all(d == 1 for d in bdims):
                return 0
            if len(bdims) == len(batch) and tuple(bdims) == batch:
                return x.shape[-2] * x.shape[-1]
            return None

        sa, sb = batch_stride(a), batch_stride(b)
        if sa is None or sb is None:
            return None
        a = a if a.flags.c_contiguous else cp.ascontiguousarray(a)
        b = b if b.flags.c_contiguous else cp.ascontiguousarray(b)
        out = cp.empty((*batch, m, n), dtype=dtype)
        self._bind_stream()
        # column-major: C^T (n x m) = B^T (n x k) . A^T (k x m)
        status = self.lib.cublasGemmStridedBatchedEx(
            self.handle, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k,
            byref(self._one),
            c_void_p(int(b.data.ptr)), dt, n, sb,
            c_void_p(int(a.data.ptr)), dt, k, sa,
            byref(self._zero),
            c_void_p(int(out.data.ptr)), dt, n, m * n,
            count, compute, CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip
        self._check(status, "cublasGemmStridedBatchedEx")
        self.calls += 1
        return out

    def _gemm(self, a: Any, b: Any, dt: int, compute: int) -> Any:
        cp = self.cp
        m, k = a.shape
        n = b.shape[1]
        opa = self._operand(a)
        if opa is None:
            a = cp.ascontiguousarray(a)
            opa = self._operand(a)
        opb = self._operand(b)
        if opb is None:
            b = cp.ascontiguousarray(b)
            opb = self._operand(b)
        a, op_a, lda = opa
        b, op_b, ldb = opb
        out = cp.empty((m, n), dtype=a.dtype)
        self._bind_stream()
        status = self.lib.cublasGemmEx(
            self.handle, op_b, op_a, n, m, k,
            byref(self._one),
            c_void_p(int(b.data.ptr)), dt, ldb,
            c_void_p(int(a.data.ptr)), dt, lda,
            byref(self._zero),
            c_void_p(int(out.data.ptr)), dt, n,
            compute, CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip
        self._check(status, "cublasGemmEx")
        self.calls += 1
        return out

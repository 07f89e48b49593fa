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

Epilogues (:meth:`Blas.matmul_epilogue`): ``relu(a @ b + bias + residual)`` as one
``cublasLtMatmul`` on ``libcublasLt`` (the library cuBLAS itself loads): ``CUBLASLT_EPILOGUE_BIAS``
/ ``RELU`` / ``RELU_BIAS`` with the residual as matrix C (beta 1), so a Linear layer's bias, a
transformer block's residual Add and a classifier's ReLU cost no pass over memory of their own.
cuBLASLt's GELU epilogues compute the tanh approximation, not the erf GELU that ``torch.onnx``
exports, so they are not used. One descriptor set and one heuristic algorithm (cuBLASLt's first
choice for the shape, the epilogue and 16-byte aligned operands) per problem, found at the first
(eager) run and reused by every later run and by capture.
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Callable
from ctypes import POINTER, byref, c_float, c_int, c_int32, c_longlong, c_size_t, c_uint32, c_uint64, c_void_p
from typing import Any

import numpy as np

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
CUBLAS_GEMM_DEFAULT = -1
CUDA_R_32F, CUDA_R_16F = 0, 2
_DATA_TYPES = {np.dtype(np.float32): CUDA_R_32F, np.dtype(np.float16): CUDA_R_16F}
WORKSPACE_BYTES = 32 << 20  # what cuBLAS recommends for Hopper

# cuBLASLt (cublasLt.h): descriptor and preference attributes, epilogues
LT_DESC_TRANSA, LT_DESC_TRANSB, LT_DESC_EPILOGUE, LT_DESC_BIAS_POINTER = 3, 4, 7, 8
LT_PREF_MAX_WORKSPACE_BYTES = 1
LT_PREF_MIN_ALIGNMENT = {"a": 5, "b": 6, "c": 7, "d": 8}  # CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{A,B,C,D}_BYTES
LT_EPILOGUE_DEFAULT, LT_EPILOGUE_RELU, LT_EPILOGUE_BIAS, LT_EPILOGUE_RELU_BIAS = 1, 2, 4, 6


class _LtHeuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t (96 bytes)."""

    _fields_ = [("algo", c_uint64 * 8), ("workspace_size", c_size_t), ("state", c_int), ("waves", c_float), ("reserved", c_int * 4)]


class BlasUnavailable(RuntimeError):
    pass


def _library(stem: str = "libcublas", symbol: str = "cublasGemmStridedBatchedEx") -> ctypes.CDLL:
    """CuPy's ``stem`` library (libcublas, or the libcublasLt it loads), found in this process's
    mappings, else the usual sonames."""
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
                if name.startswith(stem + ".so") and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    errors = []
    for candidate in paths + [f"{stem}.so.13", f"{stem}.so.12", f"{stem}.so"]:
        try:
            lib = ctypes.CDLL(candidate)
            getattr(lib, symbol)  # the symbols we need
            return lib
        except (OSError, AttributeError) as e:
            errors.append(f"{candidate}: {e}")
    raise BlasUnavailable(f"cannot load {stem}: " + "; ".join(errors))


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


def _declare_lt(lib: ctypes.CDLL) -> None:
    lib.cublasLtCreate.argtypes = [POINTER(c_void_p)]
    lib.cublasLtDestroy.argtypes = [c_void_p]
    lib.cublasLtMatmulDescCreate.argtypes = [POINTER(c_void_p), c_int, c_int]
    lib.cublasLtMatmulDescDestroy.argtypes = [c_void_p]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [c_void_p, c_int, c_void_p, c_size_t]
    lib.cublasLtMatrixLayoutCreate.argtypes = [POINTER(c_void_p), c_int, c_uint64, c_uint64, c_longlong]
    lib.cublasLtMatrixLayoutDestroy.argtypes = [c_void_p]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [POINTER(c_void_p)]
    lib.cublasLtMatmulPreferenceDestroy.argtypes = [c_void_p]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [c_void_p, c_int, c_void_p, c_size_t]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [
        c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,  # handle, op, A, B, C, D layouts, preference
        c_int, POINTER(_LtHeuristic), POINTER(c_int),
    ]
    lib.cublasLtMatmul.argtypes = [
        c_void_p, c_void_p, c_void_p,  # handle, op descriptor, alpha
        c_void_p, c_void_p, c_void_p, c_void_p,  # A, Adesc, B, Bdesc
        c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,  # beta, C, Cdesc, D, Ddesc
        c_void_p, c_void_p, c_size_t, c_void_p,  # algo, workspace, its size, stream
    ]
    for name in ("cublasLtCreate", "cublasLtDestroy", "cublasLtMatmulDescCreate", "cublasLtMatmulDescDestroy", "cublasLtMatmulDescSetAttribute",
                 "cublasLtMatrixLayoutCreate", "cublasLtMatrixLayoutDestroy", "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceDestroy",
                 "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul"):
        getattr(lib, name).restype = c_int


# The alignment cuBLASLt's heuristic is told every operand has (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*):
# one fixed value, so that the algorithm found at the first (eager) run is the one every later run
# and the capture use, whatever addresses their buffers have; an operand less aligned is not given
# to cuBLASLt. 16 bytes is what Hopper's TMA loads need, and every pool allocation has it.
LT_ALIGNMENT = 16


class _LtProblem:
    """The descriptors and chosen algorithm of one cuBLASLt problem (shape, operand forms, dtype,
    math, epilogue); ``algo`` None when cuBLASLt has none for it."""

    def __init__(self, lib: ctypes.CDLL, handle: c_void_p, key: tuple[Any, ...], workspace_bytes: int, bias_ptr: int) -> None:
        self.lib = lib
        self.desc = c_void_p()
        self.layouts: list[c_void_p] = []
        self.algo: _LtHeuristic | None = None
        try:
            self._build(handle, key, workspace_bytes, bias_ptr)
        except BaseException:
            self.close()  # the descriptors made before the failure
            raise

    def _build(self, handle: c_void_p, key: tuple[Any, ...], workspace_bytes: int, bias_ptr: int) -> None:
        (n, m, k, op_b, ldb, op_a, lda, dt, compute, epilogue, _) = key
        lib = self.lib
        _check(lib.cublasLtMatmulDescCreate(byref(self.desc), compute, CUDA_R_32F), "cublasLtMatmulDescCreate")
        for attr, value in ((LT_DESC_TRANSA, c_int32(op_b)), (LT_DESC_TRANSB, c_int32(op_a)), (LT_DESC_EPILOGUE, c_uint32(epilogue))):
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, byref(value), ctypes.sizeof(value)), "cublasLtMatmulDescSetAttribute")
        if bias_ptr:
            self.set_bias(bias_ptr)
        # column-major: D^T (n x m) = op(B^T) (n x k) . op(A^T) (k x m); layouts describe the stored matrices
        shapes = ((n, k) if op_b == CUBLAS_OP_N else (k, n), ldb), ((k, m) if op_a == CUBLAS_OP_N else (m, k), lda), ((n, m), n)
        for (rows, cols), ld in shapes:
            layout = c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(byref(layout), dt, rows, cols, ld), "cublasLtMatrixLayoutCreate")
            self.layouts.append(layout)
        pref = c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            limits = [(LT_PREF_MAX_WORKSPACE_BYTES, c_uint64(workspace_bytes))]
            limits += [(attr, c_uint32(LT_ALIGNMENT)) for attr in LT_PREF_MIN_ALIGNMENT.values()]
            for attr, value in limits:
                _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, byref(value), ctypes.sizeof(value)), "cublasLtMatmulPreferenceSetAttribute")
            found, count = _LtHeuristic(), c_int(0)
            a_desc, b_desc, d_desc = self.layouts
            status = lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, a_desc, b_desc, d_desc, d_desc, pref, 1, byref(found), byref(count))
            if status == 0 and count.value > 0 and found.state == 0:
                self.algo = found
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)

    def set_bias(self, ptr: int) -> None:
        value = c_void_p(ptr)
        _check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, LT_DESC_BIAS_POINTER, byref(value), ctypes.sizeof(value)), "cublasLtMatmulDescSetAttribute")

    def close(self) -> None:
        for layout in self.layouts:
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        self.layouts = []
        if self.desc.value:
            self.lib.cublasLtMatmulDescDestroy(self.desc)
            self.desc = c_void_p()


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed: cuBLAS status {status}")


_RETIRED: list[Callable[[], None]] = []  # destructions that a garbage collection put off (Blas.__del__)


def reap() -> None:
    """Destroy the handles of :class:`Blas` objects that were garbage-collected. Called when a
    :class:`Blas` is created or closed, which never happens inside a stream capture."""
    while _RETIRED:
        try:
            _RETIRED.pop()()
        except Exception:  # noqa: BLE001  (a handle of a context already gone)
            pass


class Blas:
    """One cuBLAS handle with its own workspace, on the current CUDA device."""

    def __init__(self, cupy: Any) -> None:
        reap()
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
        self.lt_calls = 0
        self._lt: Any = None  # (library, handle) once loaded; False when it cannot be
        self._lt_problems: dict[tuple[Any, ...], _LtProblem] = {}

    _check = staticmethod(_check)

    def _detach(self) -> Callable[[], None]:
        """Take the handles and descriptors off this object; returns what destroys them."""
        problems, self._lt_problems = list(getattr(self, "_lt_problems", {}).values()), {}
        lt, self._lt = getattr(self, "_lt", None), None
        h, self.handle = getattr(self, "handle", None), None
        lib = getattr(self, "lib", None)

        def destroy() -> None:
            for problem in problems:
                problem.close()
            if lt:
                lt[0].cublasLtDestroy(lt[1])
            if h is not None and h.value:
                lib.cublasDestroy_v2(h)

        return destroy

    def close(self) -> None:
        """Destroy the handles now (and any an earlier garbage collection left: :func:`reap`)."""
        self._detach()()
        reap()

    def __del__(self) -> None:
        # A backend is freed by Python's cyclic garbage collector, which may run inside another
        # plan's stream capture; destroying a cuBLAS handle frees device memory, which invalidates
        # that capture (a later launch in it then fails: cuBLAS status 13). So the
        # handles are destroyed later, at a point that never captures (:func:`reap`). (Captures
        # also pause the collector, common.quiet_for_capture; this covers the other ways in.)
        if not sys.is_finalizing():
            _RETIRED.append(self._detach())

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

    def _operands(self, a: Any, b: Any) -> tuple[tuple[Any, int, int], tuple[Any, int, int]]:
        """2-D ``a`` and ``b`` as (array, op, ld) each, made contiguous where cuBLAS cannot read them."""
        out = []
        for x in (a, b):
            op = self._operand(x)
            if op is None:
                op = self._operand(self.cp.ascontiguousarray(x))
            out.append(op)
        return out[0], out[1]

    def _gemm(self, a: Any, b: Any, dt: int, compute: int) -> Any:
        m, n, k = a.shape[0], b.shape[1], a.shape[1]
        (a, op_a, lda), (b, op_b, ldb) = self._operands(a, b)
        out = self.cp.empty((m, n), dtype=a.dtype)
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

    def warm(self, allow_tf32: bool, epilogues: bool) -> None:
        """One small product through each path the plans will take (cuBLAS, and cuBLASLt with a
        bias epilogue), finished: a fresh process's first cuBLAS call readies the library (tens of
        milliseconds), which a helper thread then pays instead of the plan's."""
        a = self.cp.zeros((64, 64), dtype=np.float32)
        self.matmul(a, a, allow_tf32)
        if epilogues:
            self.matmul_epilogue(a, a, allow_tf32, bias=self.cp.zeros((64,), dtype=np.float32))
        self.cp.cuda.get_current_stream().synchronize()

    # ------------------------------------------------------------------ cuBLASLt epilogues

    def _get_lt(self) -> Any:
        if self._lt is None:
            try:
                lib = _library("libcublasLt", "cublasLtMatmul")
                _declare_lt(lib)
                h = c_void_p()
                self._check(lib.cublasLtCreate(byref(h)), "cublasLtCreate")
                self._lt = (lib, h)
            except (BlasUnavailable, RuntimeError, AttributeError, OSError):
                self._lt = False
        return self._lt

    def matmul_epilogue(self, a: Any, b: Any, allow_tf32: bool, *, bias: Any = None, residual: Any = None, relu: bool = False) -> Any | None:
        """``relu?(a @ b + bias + residual)`` as one ``cublasLtMatmul`` (module docstring), or None
        when this case is not covered here (the caller then runs the plain product and the ops).

        ``a``: (..., m, k); ``b``: (k, n), any strides; ``bias``: (n,) contiguous; ``residual``: the
        result's shape; all one float dtype."""
        cp = self.cp
        dtype = a.dtype
        if a.ndim < 2 or b.ndim != 2 or dtype not in _DATA_TYPES or b.dtype != dtype or a.shape[-1] != b.shape[0] or 0 in a.shape or 0 in b.shape:
            return None
        k, n = b.shape
        shape = (*a.shape[:-1], n)
        if bias is not None and (bias.dtype != dtype or bias.shape != (n,) or not bias.flags.c_contiguous):
            return None
        if residual is not None and (residual.dtype != dtype or tuple(residual.shape) != shape):
            return None
        lt = self._get_lt()
        if not lt:
            return None
        lib, handle = lt
        if a.ndim > 2:
            a = (a if a.flags.c_contiguous else cp.ascontiguousarray(a)).reshape(-1, k)
        m = a.shape[0]
        (a, op_a, lda), (b, op_b, ldb) = self._operands(a, b)
        c = None
        if residual is not None:
            c = (residual if residual.flags.c_contiguous else cp.ascontiguousarray(residual)).reshape(m, n)
        out = cp.empty((m, n), dtype=dtype)
        dt = _DATA_TYPES[dtype]
        compute = CUBLAS_COMPUTE_32F_FAST_TF32 if (allow_tf32 and dtype == np.float32) else CUBLAS_COMPUTE_32F
        epilogue = (LT_EPILOGUE_RELU_BIAS if relu else LT_EPILOGUE_BIAS) if bias is not None else (LT_EPILOGUE_RELU if relu else LT_EPILOGUE_DEFAULT)
        c_ptr = int((c if c is not None else out).data.ptr)
        bias_ptr = int(bias.data.ptr) if bias is not None else 0
        if any(int(x.data.ptr) % LT_ALIGNMENT for x in (a, b, out)) or c_ptr % LT_ALIGNMENT or bias_ptr % LT_ALIGNMENT:
            return None
        key = (n, m, k, op_b, ldb, op_a, lda, dt, compute, epilogue, c is not None)
        problem = self._lt_problems.get(key)
        if problem is None:
            if cp.cuda.get_current_stream().is_capturing():
                return None  # the heuristic is asked at the eager run, not inside a capture
            problem = self._lt_problems[key] = _LtProblem(lib, handle, key, self.workspace.nbytes, bias_ptr)
        elif bias_ptr:
            problem.set_bias(bias_ptr)
        if problem.algo is None:
            return None
        a_desc, b_desc, d_desc = problem.layouts
        status = lib.cublasLtMatmul(
            handle, problem.desc, byref(self._one),
            c_void_p(int(b.data.ptr)), a_desc, c_void_p(int(a.data.ptr)), b_desc,
            byref(self._one if c is not None else self._zero), c_void_p(c_ptr), d_desc, c_void_p(int(out.data.ptr)), d_desc,
            byref(problem.algo.algo), c_void_p(int(self.workspace.data.ptr)), c_size_t(self.workspace.nbytes),
            c_void_p(int(cp.cuda.get_current_stream().ptr)),
        )  # fmt: skip
        self._check(status, "cublasLtMatmul")
        self.lt_calls += 1
        return out.reshape(shape)

"""Row-wise ops of the cuda backend: normalizations that cannot be folded into a conv, softmax.

Every op here is a reduction over *rows* of a C-contiguous tensor seen as ``(rows, L)``:

* LayerNormalization, any ``axis``: rows = prod(shape[:axis]), L = prod(shape[axis:]); scale and
  bias have the normalized shape (indexed by the column).
* InstanceNormalization: rows = N * C, L = spatial size; scale and bias per channel. Rows of 1-4
  thousand elements run as cuDNN's batch norm over N * C channels instead (the way frameworks run
  InstanceNormalization on cuDNN), where it measured faster (:data:`CUDNN_INSTANCE_NORM_KINDS`).
* GroupNormalization (opset 21: per-channel scale and bias): rows = N * G, L = (C / G) * spatial
  size.
* Softmax / LogSoftmax over the last axis, and the opset < 13 forms (which flatten ``axis..``):
  cuDNN's ``cudnnSoftmaxForward`` (:class:`SoftmaxLaunch`), measured faster than a hand-written
  warp-per-row kernel (benchmarks/op_kernels.py; docs/measurements/2026-11-23-runtime-between-convs.md).

The op library writes each normalization as a dozen NumPy-style calls (casts, two means,
subtract, square, sqrt, reciprocal, multiply, add), each a pass over the whole tensor: several
times slower, and slower than cuDNN's batch-norm-as-instance-norm, than these kernels. Statistics are
in float32 (float16 tensors too, as ONNX's default ``stash_type=1`` says), the variance is that of
the centred row (two passes over the row, not ``E[x^2] - E[x]^2``, which cancels), the result is
written once. Four shapes of launch, chosen when the plan is compiled (:func:`norm_kind`):

* ``warp_<n>``: one warp per row of up to 32 n elements (n = 1 ... 32), the row held in
  registers, so it is read from memory once (ConvNeXt's channels-last LayerNorm);
* ``block_16``: one 256-thread block per row of up to 4096 elements, held in registers;
* ``block``: longer rows, when there are enough of them to fill the GPU: the row is read three
  times (the second and third time from L2);
* ``split``: few long rows (GroupNorm(1, C) of a 1-D audio model at batch 1: a handful of rows
  of a million elements): each row is cut into chunks; a first kernel writes every chunk's
  (count, mean, M2), a second combines a row's chunks (Chan et al.'s parallel variance) and
  normalizes its own chunk. The scratch buffer for the partials is allocated when the plan is
  compiled, so the launch can be captured.

:func:`lower_norm` / :func:`lower_softmax` decide whether a plan step runs here (float16 / float32,
C-contiguous rows after the op's own reshapes) and return the launch; anything else stays with the
op library, which computes the same.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from convpass.kernels.launch import Launch
from convpass.native import nvrtc as compiler

__all__ = ["NORM_DTYPES", "NormLaunch", "SoftmaxLaunch", "lower_norm", "lower_softmax", "row_norm"]

_BLOCK = 256  # threads of the block and split kernels
_ROWS_PER_BLOCK = 8  # warps of a 256-thread block in the warp kernels
_CHUNK = 16384  # elements per chunk of the split kernels
_FILL_ROWS = 264  # two blocks per SM of a 132-SM GPU: enough rows for the block kernel

_SOURCE = r"""
#HEADER
#define FULL 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
// Sum over the block (blockDim.x a multiple of 32); every thread gets it. sh: 33 floats.
__device__ float block_sum(float v, float* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // sh may still be read by the previous call
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < warps ? sh[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) sh[32] = t;
    }
    __syncthreads();
    return sh[32];
}
// Scale / bias index of element (row, col): the column (LayerNorm) or the channel.
__device__ __forceinline__ long long pindex(long long row, long long col, long long L, long long inner, long long channels, int per_column) {
    return per_column ? col : ((row * L + col) / inner) % channels;
}

struct NormArgs {
    const TYPE* x; const TYPE* g; const TYPE* b; TYPE* y;
    long long rows, L, inner, channels;
    float eps; int per_column, has_bias;
};
// Every norm kernel takes these parameters first (CuPy passes scalars and pointers, not structs).
#define NORM_PARAMS const TYPE* x, const TYPE* g, const TYPE* b, TYPE* y, long long rows, long long L, \
    long long inner, long long channels, float eps, int per_column, int has_bias
#define NORM_ARGS const NormArgs a = {x, g, b, y, rows, L, inner, channels, eps, per_column, has_bias}

__device__ __forceinline__ void norm_write(const NormArgs& a, long long row, long long c0, long long c1, long long step, float mean, float inv) {
    const TYPE* xr = a.x + row * a.L;
    TYPE* yr = a.y + row * a.L;
    for (long long c = c0; c < c1; c += step) {
        const long long p = pindex(row, c, a.L, a.inner, a.channels, a.per_column);
        float r = (LOAD(xr[c]) - mean) * inv * LOAD(a.g[p]);
        if (a.has_bias) r += LOAD(a.b[p]);
        yr[c] = STORE(r);
    }
}

// Values cached in registers: each row is read from memory once. VALS values per thread.
template <int VALS>
__device__ __forceinline__ void norm_warp_impl(const NormArgs& a) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= a.rows) return;  // the whole warp: one row per warp
    const TYPE* xr = a.x + row * a.L;
    float v[VALS];
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < VALS; ++k) {
        const long long c = lane + 32LL * k;
        v[k] = c < a.L ? LOAD(xr[c]) : 0.f;
        s += v[k];
    }
    const float mean = warp_sum(s) / (float)a.L;
    float q = 0.f;
#pragma unroll
    for (int k = 0; k < VALS; ++k) {
        const long long c = lane + 32LL * k;
        if (c < a.L) { const float d = v[k] - mean; q += d * d; }
    }
    const float inv = rsqrtf(warp_sum(q) / (float)a.L + a.eps);
    TYPE* yr = a.y + row * a.L;
#pragma unroll
    for (int k = 0; k < VALS; ++k) {
        const long long c = lane + 32LL * k;
        if (c < a.L) {
            const long long p = pindex(row, c, a.L, a.inner, a.channels, a.per_column);
            float r = (v[k] - mean) * inv * LOAD(a.g[p]);
            if (a.has_bias) r += LOAD(a.b[p]);
            yr[c] = STORE(r);
        }
    }
}

template <int VALS>
__device__ __forceinline__ void norm_block_impl(const NormArgs& a) {
    __shared__ float sh[33];
    const long long row = blockIdx.x;
    const TYPE* xr = a.x + row * a.L;
    float v[VALS];
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < VALS; ++k) {
        const long long c = threadIdx.x + (long long)blockDim.x * k;
        v[k] = c < a.L ? LOAD(xr[c]) : 0.f;
        s += v[k];
    }
    const float mean = block_sum(s, sh) / (float)a.L;
    float q = 0.f;
#pragma unroll
    for (int k = 0; k < VALS; ++k) {
        const long long c = threadIdx.x + (long long)blockDim.x * k;
        if (c < a.L) { const float d = v[k] - mean; q += d * d; }
    }
    const float inv = rsqrtf(block_sum(q, sh) / (float)a.L + a.eps);
    TYPE* yr = a.y + row * a.L;
#pragma unroll
    for (int k = 0; k < VALS; ++k) {
        const long long c = threadIdx.x + (long long)blockDim.x * k;
        if (c < a.L) {
            const long long p = pindex(row, c, a.L, a.inner, a.channels, a.per_column);
            float r = (v[k] - mean) * inv * LOAD(a.g[p]);
            if (a.has_bias) r += LOAD(a.b[p]);
            yr[c] = STORE(r);
        }
    }
}

extern "C" __global__ void norm_warp_1(NORM_PARAMS) { NORM_ARGS; norm_warp_impl<1>(a); }
extern "C" __global__ void norm_warp_2(NORM_PARAMS) { NORM_ARGS; norm_warp_impl<2>(a); }
extern "C" __global__ void norm_warp_4(NORM_PARAMS) { NORM_ARGS; norm_warp_impl<4>(a); }
extern "C" __global__ void norm_warp_8(NORM_PARAMS) { NORM_ARGS; norm_warp_impl<8>(a); }
extern "C" __global__ void norm_warp_16(NORM_PARAMS) { NORM_ARGS; norm_warp_impl<16>(a); }
extern "C" __global__ void norm_warp_32(NORM_PARAMS) { NORM_ARGS; norm_warp_impl<32>(a); }
extern "C" __global__ void norm_block_16(NORM_PARAMS) { NORM_ARGS; norm_block_impl<16>(a); }

// Rows too long to cache: the row is read three times (it is in L2 the second and third time).
extern "C" __global__ void norm_block(NORM_PARAMS) {
    NORM_ARGS;
    __shared__ float sh[33];
    const long long row = blockIdx.x;
    const TYPE* xr = a.x + row * a.L;
    float s = 0.f;
    for (long long c = threadIdx.x; c < a.L; c += blockDim.x) s += LOAD(xr[c]);
    const float mean = block_sum(s, sh) / (float)a.L;
    float v = 0.f;
    for (long long c = threadIdx.x; c < a.L; c += blockDim.x) { const float d = LOAD(xr[c]) - mean; v += d * d; }
    const float inv = rsqrtf(block_sum(v, sh) / (float)a.L + a.eps);
    norm_write(a, row, threadIdx.x, a.L, blockDim.x, mean, inv);
}

// Split rows: blockIdx.x = chunk, blockIdx.y = row. partial[(row * chunks + chunk) * 3 + {0,1,2}] =
// (count, mean, M2) of the chunk.
extern "C" __global__ void norm_partial(NORM_PARAMS, float* partial, long long chunk, int chunks) {
    NORM_ARGS;
    __shared__ float sh[33];
    const long long row = blockIdx.y, c0 = (long long)blockIdx.x * chunk;
    const long long c1 = min(a.L, c0 + chunk);
    const TYPE* xr = a.x + row * a.L;
    float s = 0.f;
    for (long long c = c0 + threadIdx.x; c < c1; c += blockDim.x) s += LOAD(xr[c]);
    const float n = (float)(c1 - c0);
    const float mean = block_sum(s, sh) / n;
    float v = 0.f;
    for (long long c = c0 + threadIdx.x; c < c1; c += blockDim.x) { const float d = LOAD(xr[c]) - mean; v += d * d; }
    const float m2 = block_sum(v, sh);
    if (threadIdx.x == 0) {
        float* p = partial + (row * chunks + blockIdx.x) * 3;
        p[0] = n; p[1] = mean; p[2] = m2;
    }
}

__device__ __forceinline__ void chan_merge(float& n, float& mean, float& m2, float nb, float mb, float m2b) {
    const float total = n + nb;
    if (total == 0.f) return;
    const float d = mb - mean;
    mean += d * (nb / total);
    m2 += m2b + d * d * (n * nb / total);
    n = total;
}

extern "C" __global__ void norm_apply(NORM_PARAMS, const float* partial, long long chunk, int chunks) {
    NORM_ARGS;
    __shared__ float stats[2];
    const long long row = blockIdx.y, c0 = (long long)blockIdx.x * chunk;
    if (threadIdx.x < 32) {  // warp 0 combines the row's chunks
        float n = 0.f, mean = 0.f, m2 = 0.f;
        for (int k = threadIdx.x; k < chunks; k += 32) {
            const float* p = partial + (row * chunks + k) * 3;
            chan_merge(n, mean, m2, p[0], p[1], p[2]);
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float nb = __shfl_xor_sync(FULL, n, o), mb = __shfl_xor_sync(FULL, mean, o), m2b = __shfl_xor_sync(FULL, m2, o);
            chan_merge(n, mean, m2, nb, mb, m2b);
        }
        if (threadIdx.x == 0) { stats[0] = mean; stats[1] = rsqrtf(m2 / n + a.eps); }
    }
    __syncthreads();
    norm_write(a, row, c0 + threadIdx.x, min(a.L, c0 + chunk), blockDim.x, stats[0], stats[1]);
}

"""

NORM_DTYPES = compiler.DTYPES
_WARP_VALS = (1, 2, 4, 8, 16, 32)  # norm_warp_<n>: n values per lane, rows up to 32 * n
_BLOCK_VALS = 16  # norm_block_16: rows up to 256 * 16 cached in registers
_ENTRIES = tuple(f"norm_warp_{n}" for n in _WARP_VALS) + ("norm_block_16", "norm_block", "norm_partial", "norm_apply")


def source(dtype: Any) -> compiler.KernelSource:
    """The kernels' source for ``dtype`` (float32 or float16)."""
    return compiler.typed("rows", _SOURCE, _ENTRIES, dtype)


# ---------------------------------------------------------------------------------------------
# host side: the launch geometry and the kernels' argument struct


def _norm_args(x: Any, g: Any, b: Any, y: Any, rows: int, length: int, inner: int, channels: int, per_column: bool, eps: float) -> tuple:
    """The ``NORM_PARAMS`` every norm kernel takes first."""
    return (x, g, g if b is None else b, y, np.int64(rows), np.int64(length), np.int64(inner), np.int64(channels),
            np.float32(eps), np.int32(per_column), np.int32(b is not None))


def norm_kind(rows: int, length: int) -> str:
    """Which launch normalizes ``rows`` rows of ``length`` elements (module docstring)."""
    if length <= 32 * _WARP_VALS[-1]:
        return f"warp_{next(n for n in _WARP_VALS if 32 * n >= length)}"
    if length <= _BLOCK * _BLOCK_VALS:
        return f"block_{_BLOCK_VALS}"
    if rows >= _FILL_ROWS:
        return "block"
    return "split"


def split_chunks(rows: int, length: int) -> tuple[int, int]:
    """(chunk length, chunks per row) of the split kernels: enough blocks to fill the GPU."""
    chunks = max(1, min(math.ceil(length / 1024), math.ceil(2 * _FILL_ROWS / max(rows, 1)), 4096))
    chunk = math.ceil(length / chunks)
    chunk = (chunk + 31) // 32 * 32
    return chunk, math.ceil(length / chunk)


def row_norm(cupy: Any, x: Any, g: Any, b: Any | None, *, rows: int, length: int, inner: int, channels: int, per_column: bool,
             eps: float, y: Any = None, scratch: Any = None) -> Any:
    """Normalize ``x`` (C-contiguous, ``rows * length`` elements) row by row; see the module docstring.
    ``scratch``: float32 buffer of ``rows * chunks * 3`` for the split path (allocated if None)."""
    y = cupy.empty_like(x) if y is None else y
    if rows == 0 or length == 0:
        return y
    src = source(x.dtype)
    args = _norm_args(x, g, b, y, rows, length, inner, channels, per_column, eps)
    kind = norm_kind(rows, length)
    if kind.startswith("warp"):
        grid = ((rows + _ROWS_PER_BLOCK - 1) // _ROWS_PER_BLOCK,)
        compiler.function(cupy, src, f"norm_{kind}")(grid, (32 * _ROWS_PER_BLOCK,), args)
    elif kind.startswith("block"):
        compiler.function(cupy, src, "norm_block" if kind == "block" else f"norm_{kind}")((rows,), (_BLOCK,), args)
    else:
        chunk, chunks = split_chunks(rows, length)
        if scratch is None:
            scratch = cupy.empty(rows * chunks * 3, dtype=np.float32)
        extra = (scratch, np.int64(chunk), np.int32(chunks))
        compiler.function(cupy, src, "norm_partial")((chunks, rows), (_BLOCK,), (*args, *extra))
        compiler.function(cupy, src, "norm_apply")((chunks, rows), (_BLOCK,), (*args, *extra))
    return y


# ---------------------------------------------------------------------------------------------
# lowering


# Row shapes where cuDNN's batch norm ran InstanceNormalization faster than convpass's kernel
# (benchmarks/op_kernels.py); the kernel won by far on long rows (split launches: GroupNorm(1, C)
# of 1-D audio models).
CUDNN_INSTANCE_NORM_KINDS = frozenset({"block_16", "block"})


class NormLaunch(Launch):
    """LayerNormalization / InstanceNormalization / GroupNormalization as :func:`row_norm`, or as
    cuDNN's batch norm (:func:`convpass.native.cudnn.rowwise.instance_norm_rows`) for the
    InstanceNormalizations it runs faster (:data:`CUDNN_INSTANCE_NORM_KINDS`)."""

    def __init__(self, plan: Any, index: int, cupy: Any, geometry: dict[str, Any], scale: int, bias: int) -> None:
        step = plan.steps[index]
        kind = norm_kind(geometry["rows"], geometry["length"])
        self.use_cudnn = (
            step.node.op_type == "InstanceNormalization" and kind in CUDNN_INSTANCE_NORM_KINDS
            and geometry["eps"] >= _cudnn_min_eps() and plan.template[scale] is not None and plan.template[bias] is not None
        )
        super().__init__(index, step.node, f"{step.node.op_type} " + ("(cuDNN)" if self.use_cudnn else f"kernel ({kind})"), step.outputs[:1])
        self.dtype = np.dtype(plan.info(step.inputs[0])[1])
        self.cp = cupy
        self.x = step.inputs[0]
        self.scale, self.bias = scale, bias
        self.geometry = geometry
        self.scratch = None
        self.rows_params: tuple[Any, Any] | None = None
        if self.use_cudnn:  # per-row float32 scale / bias: the channel's, repeated for every sample
            n = geometry["rows"] // geometry["channels"]
            self.rows_params = tuple(cupy.tile(plan.template[s].reshape(-1).astype(np.float32), n) for s in (scale, bias))

    def prepare(self) -> None:
        g = self.geometry
        if self.use_cudnn:
            self.scratch = self.cp.empty(2 * g["rows"], dtype=np.float32)
        elif norm_kind(g["rows"], g["length"]) == "split":
            _, chunks = split_chunks(g["rows"], g["length"])
            self.scratch = self.cp.empty(g["rows"] * chunks * 3, dtype=np.float32)

    def run(self, env: list[Any]) -> None:
        cp = self.cp
        x = env[self.x]
        if not x.flags.c_contiguous:
            x = cp.ascontiguousarray(x)
        g = self.geometry
        if self.use_cudnn:
            from convpass.native import cudnn
            from convpass.native.cudnn.rowwise import instance_norm_rows

            y = cp.empty_like(x)
            instance_norm_rows(x, y, g["rows"], g["length"], self.rows_params[0], self.rows_params[1], g["eps"], self.scratch,
                               cudnn.get_handle().ptr)
            env[self.outputs[0]] = y
            return
        scale = env[self.scale]
        bias = env[self.bias] if self.bias >= 0 else None
        scale = scale if scale.flags.c_contiguous else cp.ascontiguousarray(scale)
        bias = bias if bias is None or bias.flags.c_contiguous else cp.ascontiguousarray(bias)
        env[self.outputs[0]] = row_norm(cp, x, scale, bias, eps=g["eps"], scratch=self.scratch, **{k: v for k, v in g.items() if k != "eps"})


def _cudnn_min_eps() -> float:
    from convpass.native.cudnn.rowwise import MIN_EPSILON

    return MIN_EPSILON


def lower_norm(plan: Any, index: int, cupy: Any) -> NormLaunch | None:
    """A :class:`NormLaunch` for plan step ``index`` when its op, dtypes and attributes are covered
    here (module docstring), else None."""
    step = plan.steps[index]
    node = step.node
    if node.domain != "" or node.op_type not in ("LayerNormalization", "InstanceNormalization", "GroupNormalization"):
        return None
    if any(o >= 0 for o in step.outputs[1:]) or step.outputs[0] < 0 or len(step.inputs) < 2:
        return None  # Mean / InvStdDev wanted: the op library computes them
    info = plan.info(step.inputs[0])
    if info is None or np.dtype(info[1]) not in NORM_DTYPES or not info[0]:
        return None
    shape, dtype = tuple(info[0]), np.dtype(info[1])
    scale = step.inputs[1]
    bias = step.inputs[2] if len(step.inputs) > 2 else -1
    for s in (scale, bias):
        p = plan.info(s)
        if s >= 0 and (p is None or np.dtype(p[1]) != dtype):
            return None
    eps = float(node.attr("epsilon", 1e-5))
    size = math.prod(shape)
    if node.op_type == "LayerNormalization":
        if int(node.attr("stash_type", 1)) != 1:
            return None
        axis = int(node.attr("axis", -1))
        axis = axis + len(shape) if axis < 0 else axis
        if not 0 <= axis < len(shape):
            return None
        length = math.prod(shape[axis:])
        normalized = shape[axis:]
        squeezed = tuple(d for d in normalized if d != 1)
        for s in (scale, bias):  # parameters must cover the normalized shape (no broadcasting)
            p = plan.info(s)
            if s >= 0 and (p is None or tuple(d for d in p[0] if d != 1) != squeezed):
                return None
        geometry = {"rows": size // max(length, 1), "length": length, "inner": 1, "channels": max(length, 1), "per_column": True}
    else:
        if len(shape) < 3 or bias < 0:
            return None
        n, c = shape[:2]
        inner = math.prod(shape[2:])
        if node.op_type == "InstanceNormalization":
            groups = c
        else:
            groups = int(node.attr("num_groups", 0))
            if node.opset >= 21 and int(node.attr("stash_type", 1)) != 1:
                return None
            if groups <= 0 or c % groups:
                return None
        per_group = c // groups
        for s in (scale, bias):  # per-channel parameters (GroupNormalization-18's per-group ones: the op library)
            p = plan.info(s)
            if p is None or math.prod(p[0]) != c:
                return None
        geometry = {"rows": n * groups, "length": per_group * inner, "inner": inner, "channels": c, "per_column": False}
    geometry["eps"] = eps
    return NormLaunch(plan, index, cupy, geometry, scale, bias)


class SoftmaxLaunch(Launch):
    """Softmax / LogSoftmax over contiguous rows: cuDNN's ``cudnnSoftmaxForward``
    (:func:`convpass.native.cudnn.rowwise.softmax_rows`), measured faster than a hand-written kernel."""

    def __init__(self, plan: Any, index: int, cupy: Any, rows: int, length: int, log: bool) -> None:
        step = plan.steps[index]
        super().__init__(index, step.node, f"{step.node.op_type} (cuDNN)", step.outputs[:1])
        self.dtype = np.dtype(plan.info(step.inputs[0])[1])
        self.cp, self.x, self.rows, self.length, self.log = cupy, step.inputs[0], rows, length, log

    def run(self, env: list[Any]) -> None:
        from convpass.native import cudnn
        from convpass.native.cudnn.rowwise import softmax_rows

        x = env[self.x]
        if not x.flags.c_contiguous:
            x = self.cp.ascontiguousarray(x)
        y = self.cp.empty_like(x)
        softmax_rows(x, y, self.rows, self.length, self.log, cudnn.get_handle().ptr)
        env[self.outputs[0]] = y


def lower_softmax(plan: Any, index: int, cupy: Any) -> SoftmaxLaunch | None:
    """Softmax / LogSoftmax whose reduced elements are the trailing axes of a float16 / float32 tensor."""
    step = plan.steps[index]
    node = step.node
    if node.domain != "" or node.op_type not in ("Softmax", "LogSoftmax") or step.outputs[0] < 0:
        return None
    info = plan.info(step.inputs[0])
    if info is None or np.dtype(info[1]) not in NORM_DTYPES or not info[0]:
        return None
    shape = tuple(info[0])
    rank = len(shape)
    axis = int(node.attr("axis", -1 if node.opset >= 13 else 1))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        return None
    if node.opset >= 13 and axis != rank - 1:
        return None  # softmax over an inner axis: the op library
    length = math.prod(shape[axis:]) if node.opset < 13 else shape[-1]
    return SoftmaxLaunch(plan, index, cupy, math.prod(shape) // max(length, 1), length, node.op_type == "LogSoftmax")

"""Fused normalization of the cuda backend: a ``FusedNorm`` step (:mod:`convpass.ops.fused`: group
or instance normalization, per-channel scale and shift, then the unit's element-wise epilogue)
as one statistics pass and one apply pass, on channels-first and channels-last storage.

Statistics and coefficients (float32, per sample and channel group, then per sample and channel;
written once per step into scratch buffers allocated when the plan is compiled, so the launches
can be captured):

* ``gn_moments_rows`` — channels-first storage, where a group's elements are one contiguous row
  (``C / G * S`` elements): blocks of 256 threads over chunks of the rows (enough chunks per row
  to give the GPU about :data:`_TARGET_BLOCKS_PER_SM` blocks per SM), each thread reading four
  strided elements per step;
* ``gn_moments_cl_<v>`` — channels-last storage (channels adjacent, any position stride: a
  Concat slice too): a block per (sample, run of positions), its threads laid out as channel
  lanes (reading adjacent channels of one position: coalesced, ``v`` channels each) and position
  lanes; the lanes' moments are merged per group in shared memory;
* the *finish* both kernels end with: the last block to store its moments finalizes them, so
  the finalize takes no launch of its own (at batch 1 such a launch costs more than its work).
  Each block counts itself on a counter in scratch with ``atomicInc``, which wraps the counter to
  0 at the last block: every counter is 0 again when a launch ends, and the next launch (or graph
  replay) starts from 0 (the counters are zeroed once, when the plan is compiled). A
  ``__threadfence`` before the count makes the block's moments visible to the block that
  finalizes, which reads them past its L1 cache. The count is per unit of the grid (a row of the
  rows kernel; a sample of the channels-last kernel, whose blocks each store all its groups) and
  per *segment* of chunks: where the finishing block would merge more than :data:`_ONE_LEVEL`
  moments (a sample of the channels-last kernel at batch 1: 32 groups times hundreds of chunks),
  the last block of each segment of about ``sqrt(chunks)`` chunks merges the segment into one
  (count, mean, M2) per row, and the last of those blocks finalizes from them; neither level
  reads more than about ``G * sqrt(chunks)`` moments. Finalizing: the block's threads, a
  power-of-two team per row, merge the row's moments (a strided share each, then the team's tree)
  into its mean and ``rstd = 1 / sqrt(var + eps)``, and write the row's channels' coefficients
  ``A[n, c] = rstd * scale[c]`` and ``B[n, c] = shift[c] - mean * A[n, c]`` (each rounded once:
  ``B`` by one fused multiply-add) into a second scratch buffer. The merge is the same Chan
  formula in float32 in a fixed order of the stored moments, whichever block finishes: the
  result does not depend on the blocks' timing.

Each thread accumulates its values shifted by the first one it reads (sums of ``v - shift`` and
their squares: no cancellation while the shift is near the data), turns them into (count, mean,
M2) and moments are merged with Chan et al.'s parallel formula: the variance is that of the centred
values, as ONNX specifies, from one read of the input. Block reductions go through shared memory
only (no warp shuffles), so a block of one thread is valid: the CPU tests run these kernels as host
C++, a block's threads in turn (blocks of one thread) or as threads of their own that meet at the
barriers, the blocks in order or shuffled.

Apply: ``y = epilogue(x * A[n, c] + B[n, c])``, one fused multiply-add (``(x - mean) * rstd *
scale + shift`` up to a few units in the last place of ``x * A``, as ``x - mean`` rounds in that
form), over the *frame* of the tensor: ``x`` (``(N, C, *spatial)``) seen without a copy as ``(N,
C, S)``, or ``(N, S, C)`` in channels-last storage (:func:`frame`). It runs on a kernel of its own
(:mod:`convpass.kernels.group_norm_apply`: channels-last, a thread per run of a pixel's channels
with their coefficients in registers; channels-first, a block row per ``(n, c)`` plane; 16-byte
vectors where the storage and alignment allow). Where that kernel's rules do not take the unit's
operands (an operand that varies over positions but not channels), the apply is the generic
element-wise kernel (:class:`convpass.kernels.broadcast.BroadcastKernel`) over the same frame, the
coefficients seen as ``(N, C, 1)`` / ``(N, 1, C)`` (:func:`coefficient_frames`) so that they
broadcast over it. The epilogue's operands (a residual, per-channel constants, a gate) are seen in
the same frame with their own strides; the output is written in ``x``'s memory format, or into its
slice of a Concat buffer. Everything is computed in float32 and rounded once.

Inputs whose spatial positions are not one evenly strided run, or channels-last inputs with more
than :data:`MAX_CL_CHANNELS` channels, are made contiguous first (one copy); float64 and shapes the
apply kernels do not take (module rule 3 of :mod:`convpass.kernels.group_norm_apply`) run the op
library's fused step over CuPy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from convpass.kernels import broadcast, elementwise, group_norm_apply
from convpass.kernels.launch import Launch
from convpass.native import nvrtc as compiler
from convpass.native.cuda import channels_last, elements
from convpass.ops.fused import FUSED_DOMAIN, NormSpec

__all__ = ["DTYPES", "FusedNormLaunch", "MAX_CL_CHANNELS", "REVISION", "apply_classes", "apply_group", "coefficient_frames", "frame", "lower_fused_norm", "moments_plan", "source"]

DTYPES = compiler.DTYPES
_THREADS = 256
# Bumped when these kernels' speed changes: fused units' timings in a tuning cache are keyed by it
# (convpass.compiler.fusions), so a cached re-run times them again instead of planning with stale ones.
REVISION = 5
_TARGET_BLOCKS_PER_SM = 4
_MIN_ROW_CHUNK = 2048  # elements a rows block reads at least
_CL_VALS = (1, 2, 4, 8, 16)  # channels per channel lane of the channels-last kernels
_CL_SHARED = 4096  # floats per shared array of the channels-last kernel: position lanes x channels
MAX_CL_CHANNELS = _THREADS * _CL_VALS[-1]
_ONE_LEVEL = 4096  # moments the finishing block merges at most in one level (rows x chunks); more: segments (module docstring)

_SOURCE = r"""
#HEADER
#define MAXT 256

// Chan et al.: merge moments (nb, mb, m2b) into (n, mean, m2)
__device__ __forceinline__ void chan(float& n, float& mean, float& m2, float nb, float mb, float m2b) {
    if (nb == 0.f) return;
    if (n == 0.f) { n = nb; mean = mb; m2 = m2b; return; }
    const float t = n + nb, d = mb - mean;
    mean += d * (nb / t);
    m2 += m2b + d * d * (n * nb / t);
    n = t;
}

// moments of the values a thread read, shifted by the first one
__device__ __forceinline__ void moments(float cnt, float shift, float s1, float s2, float& mean, float& m2) {
    mean = cnt > 0.f ? shift + s1 / cnt : 0.f;
    m2 = cnt > 0.f ? fmaxf(s2 - s1 * (s1 / cnt), 0.f) : 0.f;
}

// the threads' moments slots in shared memory (thread t's at [t]), for the block's trees
__shared__ float s_n[MAXT], s_mean[MAXT], s_m2[MAXT];

// the block's moments merged (a tree in shared memory, any block size up to MAXT); thread 0 gets them
__device__ void block_merge(float& n, float& mean, float& m2) {
    const unsigned t = threadIdx.x + threadIdx.y * blockDim.x, size = blockDim.x * blockDim.y;
    s_n[t] = n; s_mean[t] = mean; s_m2[t] = m2;
    __syncthreads();
    for (unsigned stride = 1; stride < size; stride <<= 1) {
        if (t % (2 * stride) == 0 && t + stride < size) {
            float a = s_n[t], b = s_mean[t], c = s_m2[t];
            chan(a, b, c, s_n[t + stride], s_mean[t + stride], s_m2[t + stride]);
            s_n[t] = a; s_mean[t] = b; s_m2[t] = c;
        }
        __syncthreads();
    }
    n = s_n[0]; mean = s_mean[0]; m2 = s_m2[0];
}

__device__ __forceinline__ void store_moments(float* part, long long at, float n, float mean, float m2) {
    part[3 * at] = n; part[3 * at + 1] = mean; part[3 * at + 2] = m2;
}

// The block merges the len moments src[3 * (r * stride + k)], k < len, of each row r = first + q, q < count
// (read past the L1 cache: other blocks of this launch wrote them): P threads a row (a power of two, P * count
// <= T while P < len), T / P rows a pass, each thread a strided share, then a tree per row. After each pass,
// emit(q0, m, P): row first + q0 + i (i < m) merged at slot i * P of s_n, s_mean, s_m2.
template <class Emit>
__device__ void merge_rows(const float* src, long long stride, int len, unsigned first, unsigned count, Emit emit) {
    const unsigned t = threadIdx.x + threadIdx.y * blockDim.x, T = blockDim.x * blockDim.y;
    unsigned P = 1;
    while (2 * P * count <= T && (int)P < len) P <<= 1;
    const unsigned per_pass = T / P, q = t / P, sub = t % P;
    for (unsigned q0 = 0; q0 < count; q0 += per_pass) {
        const unsigned m = min(per_pass, count - q0);
        float n = 0.f, mean = 0.f, m2 = 0.f;
        if (q < m) {
            const float* p = src + 3 * ((long long)(first + q0 + q) * stride);
#pragma unroll 4
            for (int k = sub; k < len; k += P) chan(n, mean, m2, __ldcg(p + 3 * k), __ldcg(p + 3 * k + 1), __ldcg(p + 3 * k + 2));
        }
        s_n[t] = n; s_mean[t] = mean; s_m2[t] = m2;
        __syncthreads();
        for (unsigned s = 1; s < P; s <<= 1) {
            if (q < m && sub % (2 * s) == 0 && sub + s < P) {
                float a = s_n[t], b = s_mean[t], c = s_m2[t];
                chan(a, b, c, s_n[t + s], s_mean[t + s], s_m2[t + s]);
                s_n[t] = a; s_mean[t] = b; s_m2[t] = c;
            }
            __syncthreads();
        }
        emit(q0, m, P);
        __syncthreads();
    }
}

// After the block stored its moments of rows first .. first + count - 1 (chunk blockIdx.x of unit blockIdx.y):
// blocks count themselves per segment of seg chunks with a counter that wraps to 0 at its last block
// (atomicInc), so each counter is 0 again when the launch ends (the next launch, or graph replay, starts
// from 0). With one segment, its last block finalizes the unit's rows. With several, the last block of
// each segment merges the segment's chunks into one (count, mean, M2) per row, stored after the chunks'
// moments, and the last of those blocks finalizes from them. Finalizing: a row r = n * G + g's mean and
// rstd = 1 / sqrt(var + eps), then its PER channels' coefficients A[n, c] = rstd * scale[c] at
// coef[r * PER + j] and B[n, c] = shift[c] - mean * A[n, c] rows * PER floats after it.
// Out of line: the statistics loops keep their registers (4 blocks of 256 threads an SM up to 8 channels a lane).
__device__ __noinline__ void finish(float* __restrict__ part, unsigned* __restrict__ counters, const float* __restrict__ scale,
                       const float* __restrict__ shift, float* __restrict__ coef, unsigned G, unsigned per, float eps,
                       int chunks, int seg, unsigned first, unsigned count) {
    __shared__ bool last;
    const unsigned t = threadIdx.x + threadIdx.y * blockDim.x, T = blockDim.x * blockDim.y;
    const unsigned unit = blockIdx.y, units = gridDim.y, rows = units * count;
    const int segs = (chunks + seg - 1) / seg, s = (int)blockIdx.x / seg, k0 = s * seg, in_seg = min(seg, chunks - k0);
    __syncthreads();  // the block's moments are stored
    if (t == 0) {
        __threadfence();  // ... and visible to every block before the count says so
        last = atomicInc(counters + (long long)unit * segs + s, (unsigned)in_seg - 1) == (unsigned)in_seg - 1;
        __threadfence();
    }
    __syncthreads();
    if (!last) return;  // the whole block
    const float* src = part;
    long long stride = chunks;
    int len = chunks;
    if (segs > 1) {
        float* mid = part + 3LL * rows * chunks;  // (row, segment) moments after the chunks'
        merge_rows(part + 3LL * k0, chunks, in_seg, first, count, [&](unsigned q0, unsigned m, unsigned P) {
            for (unsigned i = t; i < m; i += T) store_moments(mid, (long long)(first + q0 + i) * segs + s, s_n[i * P], s_mean[i * P], s_m2[i * P]);
        });
        if (t == 0) {
            __threadfence();
            last = atomicInc(counters + (long long)units * segs + unit, (unsigned)segs - 1) == (unsigned)segs - 1;
            __threadfence();
        }
        __syncthreads();
        if (!last) return;
        src = mid; stride = segs; len = segs;
    }
    merge_rows(src, stride, len, first, count, [&](unsigned q0, unsigned m, unsigned P) {
        for (unsigned j = t; j < m * per; j += T) {
            const unsigned i = j / per, r = first + q0 + i, c = (r % G) * per + j % per;
            const float rstd = 1.f / sqrtf(s_m2[i * P] / s_n[i * P] + eps), a = rstd * scale[c];
            coef[(long long)r * per + j % per] = a;
            coef[((long long)rows + r) * per + j % per] = fmaf(-s_mean[i * P], a, shift[c]);
        }
    });
}

// channels-first: row (n, g) = L contiguous elements at x + n * sN + g * sG; block (chunk k, row)
extern "C" __global__ void gn_moments_rows(const TYPE* __restrict__ x, float* __restrict__ part, unsigned G, long long L,
                                           long long sN, long long sG, long long chunk, int chunks, FINISH_PARAMS) {
    const unsigned row = blockIdx.y, k = blockIdx.x;
    const TYPE* xr = x + (long long)(row / G) * sN + (long long)(row % G) * sG;
    const long long c1 = min(L, (long long)k * chunk + chunk), T = blockDim.x;
    long long c = (long long)k * chunk + threadIdx.x;
    const float shift = c < c1 ? LOAD(xr[c]) : 0.f;
    float s1 = 0.f, s2 = 0.f, cnt = 0.f;
    for (; c + 3 * T < c1; c += 4 * T) {
        const float v0 = LOAD(xr[c]) - shift, v1 = LOAD(xr[c + T]) - shift, v2 = LOAD(xr[c + 2 * T]) - shift, v3 = LOAD(xr[c + 3 * T]) - shift;
        s1 += (v0 + v1) + (v2 + v3);
        s2 += (v0 * v0 + v1 * v1) + (v2 * v2 + v3 * v3);
        cnt += 4.f;
    }
    for (; c < c1; c += T) { const float v = LOAD(xr[c]) - shift; s1 += v; s2 += v * v; cnt += 1.f; }
    float mean, m2;
    moments(cnt, shift, s1, s2, mean, m2);
    block_merge(cnt, mean, m2);
    if (threadIdx.x == 0) store_moments(part, (long long)row * chunks + k, cnt, mean, m2);
    finish(part, counters, scale, shift_, coef, G, per, eps, chunks, seg, row, 1);
}

// channels-last: element (n, s, c) at x + n * sN + s * sS + c; block (run of positions k, sample n),
// threads (channel lane, position lane); VALS channels per channel lane
template <int VALS>
__device__ __forceinline__ void moments_cl(const TYPE* __restrict__ x, float* __restrict__ part, unsigned C, unsigned G, long long S,
                                           long long sN, long long sS, long long chunk, int chunks, FINISH_PARAMS) {
    __shared__ float shm[CL_SHARED], shq[CL_SHARED];
    const unsigned TC = blockDim.x, TS = blockDim.y, tc = threadIdx.x, ts = threadIdx.y, n = blockIdx.y, k = blockIdx.x;
    const long long p0 = (long long)k * chunk, p1 = min(S, p0 + chunk);
    const TYPE* xb = x + (long long)n * sN;
    float shift[VALS], s1[VALS], s2[VALS];
#pragma unroll
    for (int v = 0; v < VALS; ++v) {
        const unsigned c = tc + v * TC;
        shift[v] = (c < C && p0 + ts < p1) ? LOAD(xb[(p0 + ts) * sS + c]) : 0.f;
        s1[v] = 0.f; s2[v] = 0.f;
    }
    float cnt = 0.f;
#pragma unroll 4
    for (long long p = p0 + ts; p < p1; p += TS) {
        cnt += 1.f;
#pragma unroll
        for (int v = 0; v < VALS; ++v) {
            const unsigned c = tc + v * TC;
            if (c < C) { const float d = LOAD(xb[p * sS + c]) - shift[v]; s1[v] += d; s2[v] += d * d; }
        }
    }
#pragma unroll
    for (int v = 0; v < VALS; ++v) {
        const unsigned c = tc + v * TC;
        if (c < C) moments(cnt, shift[v], s1[v], s2[v], shm[ts * C + c], shq[ts * C + c]);
    }
    __syncthreads();
    for (unsigned g = tc + ts * TC; g < G; g += TC * TS) {
        float gn = 0.f, gm = 0.f, gq = 0.f;
        for (unsigned l = 0; l < TS; ++l) {
            const long long first = p0 + l;
            const float lc = first < p1 ? (float)((p1 - first + TS - 1) / TS) : 0.f;
            for (unsigned c = g * per; c < (g + 1) * per; ++c) chan(gn, gm, gq, lc, shm[l * C + c], shq[l * C + c]);
        }
        store_moments(part, ((long long)n * G + g) * chunks + k, gn, gm, gq);
    }
    finish(part, counters, scale, shift_, coef, G, per, eps, chunks, seg, n * G, G);
}

#ENTRIES
"""

_CL_ENTRIES = tuple(f"gn_moments_cl_{v}" for v in _CL_VALS)
_ENTRIES = ("gn_moments_rows", *_CL_ENTRIES)
# the parameters of the finishing step every statistics kernel ends with (module docstring)
_FINISH_PARAMS = ("unsigned* __restrict__ counters, const float* __restrict__ scale, const float* __restrict__ shift_, "
                  "float* __restrict__ coef, unsigned per, float eps, int seg")


def source(dtype: Any) -> compiler.KernelSource:
    """The statistics kernels for ``dtype`` (float32 or float16)."""
    entries = "\n".join(
        f'extern "C" __global__ void gn_moments_cl_{v}(const TYPE* __restrict__ x, float* __restrict__ part, unsigned C, unsigned G, '
        f"long long S, long long sN, long long sS, long long chunk, int chunks, FINISH_PARAMS) "
        f"{{ moments_cl<{v}>(x, part, C, G, S, sN, sS, chunk, chunks, counters, scale, shift_, coef, per, eps, seg); }}"
        for v in _CL_VALS)
    code = _SOURCE.replace("#ENTRIES", entries).replace("CL_SHARED", str(_CL_SHARED)).replace("FINISH_PARAMS", _FINISH_PARAMS)
    return compiler.typed("group_norm", code, _ENTRIES, dtype)


# ---------------------------------------------------------------------------------------------
# host side: frames and launch geometry (NumPy and CuPy alike)


def _positions(shape: Sequence[int], strides: Sequence[int]) -> int | None:
    """The element stride that walks the spatial positions of ``(N, C, *spatial)`` in order (0
    for one position), or None when they are not one evenly strided run."""
    dims = [(int(d), int(s)) for d, s in zip(shape[2:], strides[2:]) if int(d) > 1]
    for (_d0, s0), (d1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * d1:
            return None
    return dims[-1][1] if dims else 0


def frame(xp: Any, a: Any, shape: Sequence[int], last: bool) -> Any | None:
    """``a`` broadcast to ``shape`` (``(N, C, *spatial)``) and seen, without a copy, as ``(N, C,
    S)``, or ``(N, S, C)`` when ``last`` (channels-last order); None when its spatial positions
    are not one evenly strided run (module docstring)."""
    b = xp.broadcast_to(a, tuple(shape))
    st = elements(b.strides, b.itemsize)
    s_pos = _positions(b.shape, st)
    if s_pos is None:
        return None
    dims = (int(shape[0]), int(shape[1]), math.prod(int(d) for d in shape[2:]))
    steps = (st[0], st[1], s_pos)
    if last:
        dims, steps = (dims[0], dims[2], dims[1]), (steps[0], steps[2], steps[1])
    return xp.lib.stride_tricks.as_strided(b, dims, tuple(s * b.itemsize for s in steps))


def coefficient_frames(xp: Any, coef: Any, n: int, c: int, last: bool) -> tuple[Any, Any]:
    """The per-(sample, channel) coefficients ``A`` and ``B`` of ``coef`` (``2 * N * C`` floats,
    ``A`` first, each ``(N, C)`` row-major) as frames of ``(N, C, 1)`` (or ``(N, 1, C)``), sharing
    their strides."""
    item = coef.itemsize
    dims, steps = (n, c, 1), (c * item, item, 0)
    if last:
        dims, steps = (n, 1, c), (c * item, 0, item)
    strided = xp.lib.stride_tricks.as_strided
    return strided(coef, dims, steps), strided(coef[n * c:], dims, steps)


def _finish_plan(chunks: int, units: int, count: int) -> dict[str, int]:
    """How the blocks of ``units`` units (grid rows) of ``chunks`` chunks, each block storing the
    moments of ``count`` rows, finish (module docstring): ``seg`` chunks a segment (all of them
    where the finishing block merges at most :data:`_ONE_LEVEL` moments; else about the square
    root of ``chunks``, so both levels merge about as many), and the scratch that takes: ``part``
    floats, ``counters`` 32-bit counters."""
    seg = chunks if chunks * count <= _ONE_LEVEL else math.isqrt(chunks - 1) + 1
    segs = math.ceil(chunks / seg)
    rows = units * count
    return {"chunks": chunks, "seg": seg, "segs": segs, "part": 3 * rows * (chunks + (segs if segs > 1 else 0)),
            "counters": units * (segs + 1)}


def moments_plan(shape: Sequence[int], strides: Sequence[int], groups: int, sms: int, threads: int = _THREADS) -> dict[str, Any] | None:
    """Which statistics kernel reads ``x`` (logical shape, element strides) and its geometry:
    ``{"kernel": "rows" | "cl_<v>", "grid", "block", "chunks", "seg", "segs", "part", "counters",
    "args"}`` for blocks of ``threads`` threads (:func:`_finish_plan`); None when neither takes
    these strides (the launch then reads a contiguous copy)."""
    n, c = int(shape[0]), int(shape[1])
    size = math.prod(int(d) for d in shape[2:])
    s_pos = _positions(shape, strides)
    if s_pos is None or n * c * size == 0:
        return None
    per = c // groups
    target = _TARGET_BLOCKS_PER_SM * sms
    s_n, s_c = int(strides[0]), int(strides[1])
    if (size > 1 and s_pos == 1 and (s_c == size or per == 1)) or (size == 1 and (s_c == 1 or per == 1)):
        # channels-first: each group one contiguous row of per * size elements, per * s_c apart
        length = per * size
        chunks = max(1, min(math.ceil(target / (n * groups)), math.ceil(length / _MIN_ROW_CHUNK)))
        chunk = math.ceil(length / chunks)
        chunks = math.ceil(length / chunk)
        return {"kernel": "rows", "grid": (chunks, n * groups), "block": (threads, 1), **_finish_plan(chunks, n * groups, 1),
                "args": (np.uint32(groups), np.int64(length), np.int64(s_n), np.int64(per * s_c), np.int64(chunk), np.int32(chunks))}
    lanes = min(threads, 32 * math.ceil(c / 32))
    if s_c == 1 and c <= lanes * _CL_VALS[-1]:
        vals = next(v for v in _CL_VALS if v * lanes >= c)
        rows = max(1, min(threads // lanes, _CL_SHARED // c))
        chunks = max(1, min(math.ceil(target / n), math.ceil(size / (4 * rows))))
        chunk = math.ceil(size / chunks)
        chunks = math.ceil(size / chunk)
        return {"kernel": f"cl_{vals}", "grid": (chunks, n), "block": (lanes, rows), **_finish_plan(chunks, n, groups),
                "args": (np.uint32(c), np.uint32(groups), np.int64(size), np.int64(s_n), np.int64(s_pos), np.int64(chunk), np.int32(chunks))}
    return None


def apply_group(spec: NormSpec, dtype: Any, operand_kinds: Sequence[str]) -> elementwise.FusedGroup:
    """The apply pass as a generated element-wise group over the inputs ``(x, A, B, *operands)``
    (the coefficients in float32): the normalized value ``x * A + B``, then the epilogue's
    expressions (:data:`convpass.kernels.elementwise.EXPRESSIONS`). ``operand_kinds``: per operand,
    ``"constant"`` or ``"value"`` (which share offsets: :func:`apply_classes`). ValueError when an
    epilogue node has no expression or reads the step's scale or shift (folded into ``A``, ``B``)."""
    n = 3 + len(operand_kinds)
    lines = ["typedef float A;"] + [f"const A a{k} = (A)in{k};" for k in range(n)]
    lines.append("const A tn = fmaf(a0, a1, a2);")
    names: list[str] = []
    for j, st in enumerate(spec.chain):
        # ("in", k): the step's input k, (x, scale, shift, *operands); the kernel's inputs are (x, A, B, *operands)
        if any(kind == "in" and k in (1, 2) for kind, k in st.args):
            raise ValueError(f"{st.node.op_type} node {st.node.name!r} reads the normalization's scale or shift")
        ops = [None if kind == "none" else "tn" if kind == "norm" else names[k] if kind == "step" else f"a{k}" for kind, k in st.args]
        expr = elementwise.EXPRESSIONS.get(st.node.op_type)
        code = expr(st.node, ops) if expr is not None else None
        if code is None:
            raise ValueError(f"no fused expression for {st.node.op_type} node {st.node.name!r}")
        names.append(f"t{j}")
        lines.append(f"const A t{j} = {code};")
    lines.append(f"out0 = (T){names[-1] if names else 'tn'};")
    types = ("T", "float", "float") + ("T",) * len(operand_kinds)
    return elementwise.FusedGroup(root=0, members=(0,), inputs=tuple(range(n)), output=-1, dtype=np.dtype(dtype), code="\n".join(lines),
                                  ops=("FusedNorm", *(st.node.op_type for st in spec.chain)), input_types=types)


def apply_classes(operand_kinds: Sequence[str], operand_shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Offset classes of the apply pass's inputs: x; A and B; then constant operands of one shape
    together, every computed operand on its own."""
    classes = [0, 1, 1]
    first: dict[tuple, int] = {}
    for k, (kind, shape) in enumerate(zip(operand_kinds, operand_shapes)):
        key = ("constant", tuple(shape)) if kind == "constant" else ("value", k)
        classes.append(first.setdefault(key, 2 + len(first)))
    return tuple(classes)


@functools.cache
def _sm_count(device: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])


# ---------------------------------------------------------------------------------------------
# the launch


def _packed_strides(shape: Sequence[int], last: bool) -> tuple[int, ...]:
    """Element strides of a packed ``(N, C, *spatial)`` array, channels-first or channels-last."""
    order = [0, *range(2, len(shape)), 1] if last else list(range(len(shape)))
    strides, step = [0] * len(shape), 1
    for axis in reversed(order):
        strides[axis] = step
        step *= int(shape[axis])
    return tuple(strides)


def _empty(xp: Any, shape: Sequence[int], dtype: Any, last: bool) -> Any:
    """An array of logical shape ``(N, C, *spatial)``, stored channels-last when ``last``."""
    if not last:
        return xp.empty(tuple(shape), dtype=dtype)
    r = len(shape)
    return xp.empty((shape[0], *shape[2:], shape[1]), dtype=dtype).transpose(0, r - 1, *range(1, r - 1))


def _compiled(cupy: Any) -> Any:
    return lambda src, name: compiler.function(cupy, src, name)


class FusedNormLaunch(Launch):
    """A ``FusedNorm`` step in two launches: statistics (finalized by their last block) and apply
    (module docstring). Writes into a Concat slice when the memory plan places it. ``fallback``:
    ``(ctx, node, fn)``, the op library's fused step, for what the kernels do not take.
    ``entry(source, name)``: a compiled entry point (default: NVRTC through
    :mod:`convpass.native.nvrtc`; the CPU tests pass host builds, with ``threads`` and ``sms``
    given)."""

    supports_placement = True

    def __init__(self, plan: Any, index: int, cupy: Any, fallback: Any, *, entry: Any = None, threads: int = _THREADS,
                 sms: int | None = None) -> None:
        step = plan.steps[index]
        spec: NormSpec = step.node.prepared
        label = "FusedNorm" + "".join("+" + st.node.op_type for st in spec.chain)
        super().__init__(index, step.node, label, step.outputs[:1])
        self.cp = cupy
        self.spec = spec
        self.inputs = step.inputs
        info = plan.info(step.inputs[0])
        self.shape, self.dtype = tuple(int(d) for d in info[0]), np.dtype(info[1])
        self.operands = step.inputs[3:]
        kinds = ["constant" if plan.template[s] is not None else "value" for s in self.operands]
        shapes = [tuple(plan.info(s)[0]) for s in self.operands]
        self.entry = entry or _compiled(cupy)
        self.threads = threads
        self.sms = sms
        group = apply_group(spec, self.dtype, kinds)
        read_as = group_norm_apply.operand_kinds(self.shape, shapes)
        self.apply = self.kernel = None  # the dedicated apply kernel, or else the generic one (module docstring)
        if read_as is not None:
            self.apply = group_norm_apply.ApplyKernel(cupy, group, read_as, lambda: self.sms, entry=self.entry, threads=threads)
        else:
            classes = apply_classes(kinds, shapes)
            apply_src = broadcast.broadcast_source(group, classes, broadcast.unroll_for(group))
            self.kernel = broadcast.BroadcastKernel(cupy, group, classes, entry=lambda name: self.entry(apply_src, name))
        self.fallback = fallback
        self.part = self.counters = self.coef = None

    def prepare(self) -> None:
        xp = self.cp
        if self.sms is None:
            self.sms = _sm_count(int(xp.cuda.runtime.getDevice()))
        n, g = self.shape[0], self.spec.groups
        plans = [p for last in (False, True) if (p := moments_plan(self.shape, _packed_strides(self.shape, last), g, self.sms, self.threads))]
        self.part = xp.empty(max((p["part"] for p in plans), default=3 * n * g), dtype=np.float32)
        # zero once: every launch leaves the counters it used at 0 again (module docstring)
        self.counters = xp.zeros(max((p["counters"] for p in plans), default=1), dtype=np.uint32)
        self.coef = xp.empty(2 * n * self.shape[1], dtype=np.float32)  # A, then B (module docstring)

    def run(self, env: list[Any]) -> None:
        x = env[self.inputs[0]]
        y = self._run(x, [env[s] for s in self.operands], env)
        if y is None:  # a geometry the kernels do not take
            ctx, node, fn = self.fallback
            y = fn(ctx, node, *[env[s] for s in self.inputs])
            out = self.destination(env, "nhwc" if channels_last(x) else "nchw")
            if out is not None:
                out[...] = y
                y = out
        env[self.outputs[0]] = y

    def _run(self, x: Any, operands: list[Any], env: list[Any]) -> Any | None:
        xp, spec = self.cp, self.spec
        g = spec.groups
        geo = moments_plan(x.shape, elements(x.strides, x.itemsize), g, self.sms, self.threads)
        if geo is None or geo["part"] > self.part.size or geo["counters"] > self.counters.size:
            x = xp.ascontiguousarray(x)
            geo = moments_plan(x.shape, elements(x.strides, x.itemsize), g, self.sms, self.threads)
        if geo is None:
            return None
        last = geo["kernel"] != "rows"
        out = self.destination(env, "nhwc" if last else "nchw")
        if out is None:
            out = _empty(xp, x.shape, x.dtype, last)
        frames = [frame(xp, a, x.shape, last) for a in (x, *operands, out)]
        if any(f is None for f in frames):
            return None
        n, c = x.shape[:2]
        finish = (self.counters, env[self.inputs[1]], env[self.inputs[2]], self.coef, np.uint32(c // g), np.float32(spec.eps), np.int32(geo["seg"]))
        self.entry(source(x.dtype), f"gn_moments_{geo['kernel']}")(geo["grid"], geo["block"], (x, self.part, *geo["args"], *finish))
        if self.apply is not None:
            done = self.apply(frames[0], self.coef, frames[1:-1], frames[-1], last)
        else:
            a, b = coefficient_frames(xp, self.coef, n, c, last)
            done = self.kernel([frames[0], a, b, *frames[1:-1]], frames[-1])
        return None if done is None else out

    def sources(self) -> list[compiler.KernelSource]:
        """The kernel sources this step runs (compiled at plan time, recorded for the side-car)."""
        return [source(self.dtype)] + ([self.apply.source] if self.apply is not None else [self.kernel.source])

    def apply_paths(self) -> set[str]:
        """How the apply pass ran so far: the dedicated kernel's entries, or ``"broadcast_d<k>"``."""
        if self.apply is not None:
            return set(self.apply.planned)
        return {f"broadcast_d{d}" for d in self.kernel.planned_dims()}


def lower_fused_norm(plan: Any, index: int, cupy: Any, ctx: Any) -> FusedNormLaunch | None:
    """A :class:`FusedNormLaunch` for a ``FusedNorm`` step of float16 / float32 (others: None, the
    op library runs it). ``ctx``: the op context its fallback runs in. Raises what building the
    apply kernel raises (a compiler error)."""
    step = plan.steps[index]
    node = step.node
    if node.domain != FUSED_DOMAIN or node.op_type != "FusedNorm":
        return None
    info = plan.info(step.inputs[0])
    if info is None or np.dtype(info[1]) not in DTYPES or not 3 <= len(info[0]) <= 5:
        return None
    if any(plan.info(s) is None for s in step.inputs[3:]):
        return None
    return FusedNormLaunch(plan, index, cupy, (ctx, node, step.fn))

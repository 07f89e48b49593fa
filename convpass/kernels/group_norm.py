"""Fused normalization of the cuda backend: a ``FusedNorm`` step (:mod:`convpass.ops.fused`: group
or instance normalization, per-channel scale and shift, then the unit's element-wise epilogue)
as one statistics pass and one apply pass, on channels-first and channels-last storage.

Where the unit's groups are small and its operands are ones the dedicated apply kernel reads, the
step is one launch instead (:mod:`convpass.kernels.group_norm_onepass`: a block per sample and
group computes the group's moments, then applies the epilogue to it; the rules are that module's
:func:`~convpass.kernels.group_norm_onepass.fits`); it reads and writes the storage orders the
three kernels below would, and needs no scratch. Everything below describes the three kernels.

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
* ``gn_finalize`` — one block per (sample, group) merges its chunks' moments (its threads a
  strided share each, then the block's tree) into the group's mean and ``rstd = 1 / sqrt(var +
  eps)``, and its threads write the group's channels' coefficients ``A[n, c] = rstd * scale[c]``
  and ``B[n, c] = shift[c] - mean * A[n, c]`` (each rounded once: ``B`` by one fused
  multiply-add) into a second scratch buffer. (One thread per (sample, group) merging every chunk
  in turn made a channels-last step of one sample, with hundreds of chunks, several times slower
  than its channels-first form.)

Each thread accumulates its values shifted by the first one it reads (sums of ``v - shift`` and
their squares: no cancellation while the shift is near the data), turns them into (count, mean,
M2) and moments are merged with Chan et al.'s parallel formula: the variance is that of the centred
values, as ONNX specifies, from one read of the input. Block reductions go through shared memory
only (no warp shuffles), so a block of one thread is valid: the CPU tests run these kernels as host
C++ thread by thread.

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

from convpass.kernels import broadcast, elementwise, group_norm_apply, group_norm_onepass
from convpass.kernels.launch import Launch
from convpass.native import nvrtc as compiler
from convpass.native.cuda import channels_last, elements
from convpass.ops.fused import FUSED_DOMAIN, NormSpec

__all__ = ["DTYPES", "FusedNormLaunch", "MAX_CL_CHANNELS", "REVISION", "apply_classes", "apply_group", "coefficient_frames", "frame", "lower_fused_norm", "moments_plan", "source"]

DTYPES = compiler.DTYPES
_THREADS = 256
_FINALIZE_THREADS = 128  # at most, per (sample, group): a channels-last step of one sample has hundreds of chunks
# Bumped when these kernels' speed changes: fused units' timings in a tuning cache are keyed by it
# (convpass.compiler.fusions), so a cached re-run times them again instead of planning with stale ones.
REVISION = 6
_TARGET_BLOCKS_PER_SM = 4
_MIN_ROW_CHUNK = 2048  # elements a rows block reads at least
_CL_VALS = (1, 2, 4, 8, 16)  # channels per channel lane of the channels-last kernels
_CL_SHARED = 4096  # floats per shared array of the channels-last kernel: position lanes x channels
MAX_CL_CHANNELS = _THREADS * _CL_VALS[-1]

_SOURCE = r"""
#HEADER
#define MAXT 256

#MOMENTS

__device__ __forceinline__ void store_moments(float* part, long long at, float n, float mean, float m2) {
    part[3 * at] = n; part[3 * at + 1] = mean; part[3 * at + 2] = m2;
}

// channels-first: row (n, g) = L contiguous elements at x + n * sN + g * sG; block (chunk k, row)
extern "C" __global__ void gn_moments_rows(const TYPE* __restrict__ x, float* __restrict__ part, unsigned G, long long L,
                                           long long sN, long long sG, long long chunk, int chunks) {
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
}

// channels-last: element (n, s, c) at x + n * sN + s * sS + c; block (run of positions k, sample n),
// threads (channel lane, position lane); VALS channels per channel lane
template <int VALS>
__device__ __forceinline__ void moments_cl(const TYPE* __restrict__ x, float* __restrict__ part, unsigned C, unsigned G, long long S,
                                           long long sN, long long sS, long long chunk, int chunks) {
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
    const unsigned per = C / G;
    for (unsigned g = tc + ts * TC; g < G; g += TC * TS) {
        float gn = 0.f, gm = 0.f, gq = 0.f;
        for (unsigned l = 0; l < TS; ++l) {
            const long long first = p0 + l;
            const float lc = first < p1 ? (float)((p1 - first + TS - 1) / TS) : 0.f;
            for (unsigned c = g * per; c < (g + 1) * per; ++c) chan(gn, gm, gq, lc, shm[l * C + c], shq[l * C + c]);
        }
        store_moments(part, ((long long)n * G + g) * chunks + k, gn, gm, gq);
    }
}

#ENTRIES

// one block per (sample, group) r = n * G + g: its threads merge the chunks' moments k, k + T, ..., then
// the block's (every thread gets them); then they write the group's PER channels' coefficients,
// A[n, c] = rstd * scale[c] at coef[n * C + c] = coef[r * PER + j] and B[n, c] = shift[c] - mean * A[n, c]
// rows * PER floats after it
extern "C" __global__ void gn_finalize(const float* __restrict__ part, const float* __restrict__ scale, const float* __restrict__ shift,
                                       float* __restrict__ coef, unsigned rows, unsigned G, unsigned per, int chunks, float eps) {
    const unsigned r = blockIdx.x;
    if (r >= rows) return;  // the whole block: no thread waits at a barrier below
    float n = 0.f, mean = 0.f, m2 = 0.f;
    for (int k = threadIdx.x; k < chunks; k += blockDim.x) {
        const float* p = part + 3 * ((long long)r * chunks + k);
        chan(n, mean, m2, p[0], p[1], p[2]);
    }
    block_merge(n, mean, m2);
    const float rstd = 1.f / sqrtf(m2 / n + eps);
    const unsigned c0 = (r % G) * per;
    float* a = coef + (long long)r * per;
    float* b = coef + ((long long)rows + r) * per;
    for (unsigned j = threadIdx.x; j < per; j += blockDim.x) {
        const float s = rstd * scale[c0 + j];
        a[j] = s;
        b[j] = fmaf(-mean, s, shift[c0 + j]);
    }
}
"""

_CL_ENTRIES = tuple(f"gn_moments_cl_{v}" for v in _CL_VALS)
_ENTRIES = ("gn_moments_rows", *_CL_ENTRIES, "gn_finalize")


def source(dtype: Any) -> compiler.KernelSource:
    """The statistics kernels for ``dtype`` (float32 or float16)."""
    entries = "\n".join(
        f'extern "C" __global__ void gn_moments_cl_{v}(const TYPE* __restrict__ x, float* __restrict__ part, unsigned C, unsigned G, '
        f"long long S, long long sN, long long sS, long long chunk, int chunks) {{ moments_cl<{v}>(x, part, C, G, S, sN, sS, chunk, chunks); }}"
        for v in _CL_VALS)
    code = _SOURCE.replace("#MOMENTS", group_norm_onepass.MOMENTS).replace("#ENTRIES", entries).replace("CL_SHARED", str(_CL_SHARED))
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


def moments_plan(shape: Sequence[int], strides: Sequence[int], groups: int, sms: int, threads: int = _THREADS) -> dict[str, Any] | None:
    """Which statistics kernel reads ``x`` (logical shape, element strides) and its geometry:
    ``{"kernel": "rows" | "cl_<v>", "grid", "block", "chunks", "args"}`` for blocks of ``threads``
    threads; None when neither takes these strides (the launch then reads a contiguous copy)."""
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
        return {"kernel": "rows", "grid": (chunks, n * groups), "block": (threads, 1), "chunks": chunks,
                "args": (np.uint32(groups), np.int64(length), np.int64(s_n), np.int64(per * s_c), np.int64(chunk), np.int32(chunks))}
    lanes = min(threads, 32 * math.ceil(c / 32))
    if s_c == 1 and c <= lanes * _CL_VALS[-1]:
        vals = next(v for v in _CL_VALS if v * lanes >= c)
        rows = max(1, min(threads // lanes, _CL_SHARED // c))
        chunks = max(1, min(math.ceil(target / n), math.ceil(size / (4 * rows))))
        chunk = math.ceil(size / chunks)
        chunks = math.ceil(size / chunk)
        return {"kernel": f"cl_{vals}", "grid": (chunks, n), "block": (lanes, rows), "chunks": chunks,
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
    """A ``FusedNorm`` step: one launch where its groups are small, else statistics, finalize and
    apply (module docstring). Writes into a Concat slice when the memory plan places it.
    ``fallback``: ``(ctx, node, fn)``, the op library's fused step, for what the kernels do not
    take. ``entry(source, name)``: a compiled entry point (default: NVRTC through
    :mod:`convpass.native.nvrtc`; the CPU tests pass host builds, with ``threads`` (the most
    threads a block of any kernel has; default: each kernel's own) and ``sms`` given)."""

    supports_placement = True

    def __init__(self, plan: Any, index: int, cupy: Any, fallback: Any, *, entry: Any = None, threads: int | None = None,
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
        self.threads = threads or _THREADS
        self.sms = sms
        group = apply_group(spec, self.dtype, kinds)
        read_as = group_norm_apply.operand_kinds(self.shape, shapes)
        # the one-launch kernel, or the dedicated apply kernel, or else the generic one (module docstring)
        self.onepass = self.apply = self.kernel = None
        if read_as is not None and group_norm_onepass.fits(self.shape, spec.groups):
            self.onepass = group_norm_onepass.OnePassKernel(cupy, group, read_as, self.shape, spec.groups, spec.eps, lambda: self.sms,
                                                            entry=self.entry, threads=threads or group_norm_onepass.MAX_THREADS)
        elif read_as is not None:
            self.apply = group_norm_apply.ApplyKernel(cupy, group, read_as, lambda: self.sms, entry=self.entry, threads=self.threads)
        else:
            classes = apply_classes(kinds, shapes)
            apply_src = broadcast.broadcast_source(group, classes, broadcast.unroll_for(group))
            self.kernel = broadcast.BroadcastKernel(cupy, group, classes, entry=lambda name: self.entry(apply_src, name))
        self.fallback = fallback
        self.part = self.coef = None

    def prepare(self) -> None:
        xp = self.cp
        if self.sms is None:
            self.sms = _sm_count(int(xp.cuda.runtime.getDevice()))
        if self.onepass is not None:
            return  # no scratch: statistics and coefficients stay in the block
        n, g = self.shape[0], self.spec.groups
        plans = [moments_plan(self.shape, _packed_strides(self.shape, last), g, self.sms, self.threads) for last in (False, True)]
        most = max((p["chunks"] for p in plans if p is not None), default=1)
        self.part = xp.empty(n * g * most * 3, dtype=np.float32)
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
        threads = _THREADS if self.onepass is not None else self.threads  # the one launch only asks which storage order
        geo = moments_plan(x.shape, elements(x.strides, x.itemsize), g, self.sms, threads)
        if geo is None or (self.onepass is None and geo["chunks"] * x.shape[0] * g * 3 > self.part.size):
            x = xp.ascontiguousarray(x)
            geo = moments_plan(x.shape, elements(x.strides, x.itemsize), g, self.sms, threads)
        if geo is None:
            return None
        last = geo["kernel"] != "rows"
        out = self.destination(env, "nhwc" if last else "nchw")
        if out is None:
            out = _empty(xp, x.shape, x.dtype, last)
        frames = [frame(xp, a, x.shape, last) for a in (x, *operands, out)]
        if any(f is None for f in frames):
            return None
        if self.onepass is not None:
            done = self.onepass(frames[0], env[self.inputs[1]], env[self.inputs[2]], frames[1:-1], frames[-1], last)
            return None if done is None else out
        src = source(x.dtype)
        self.entry(src, f"gn_moments_{geo['kernel']}")(geo["grid"], geo["block"], (x, self.part, *geo["args"]))
        n, c = x.shape[:2]
        rows = n * g
        block = min(_FINALIZE_THREADS, self.threads, 32 * math.ceil(max(geo["chunks"], c // g) / 32))
        self.entry(src, "gn_finalize")((rows,), (block,), (self.part, env[self.inputs[1]], env[self.inputs[2]], self.coef, np.uint32(rows),
                                                           np.uint32(g), np.uint32(c // g), np.int32(geo["chunks"]), np.float32(spec.eps)))
        if self.apply is not None:
            done = self.apply(frames[0], self.coef, frames[1:-1], frames[-1], last)
        else:
            a, b = coefficient_frames(xp, self.coef, n, c, last)
            done = self.kernel([frames[0], a, b, *frames[1:-1]], frames[-1])
        return None if done is None else out

    def sources(self) -> list[compiler.KernelSource]:
        """The kernel sources this step runs (compiled at plan time, recorded for the side-car)."""
        if self.onepass is not None:
            return [self.onepass.source]
        return [source(self.dtype)] + ([self.apply.source] if self.apply is not None else [self.kernel.source])

    def apply_paths(self) -> set[str]:
        """How the apply pass ran so far: the one-launch kernel's entries (``"gn_onepass_*"``), the
        dedicated apply kernel's (``"gn_apply_*"``), or ``"broadcast_d<k>"``."""
        if self.onepass is not None:
            return set(self.onepass.planned)
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

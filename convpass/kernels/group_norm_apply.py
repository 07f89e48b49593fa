"""The apply pass of a fused normalization unit (:mod:`convpass.kernels.group_norm`) as a kernel of
its own: ``y = epilogue(x * A[n, c] + B[n, c])`` over the frame of ``x`` — ``(N, S, C)`` in
channels-last storage, ``(N, C, S)`` channels-first (:func:`convpass.kernels.group_norm.frame`) —
with the per-(sample, channel) coefficients ``A``, ``B`` (float32, ``(N, C)`` row-major, ``B``
``N * C`` floats after ``A``) that the finalize wrote, and the epilogue's operands.

* ``gn_apply_cl_<v>`` — channels-last: a thread owns ``v`` consecutive channels of one sample (a
  *channel lane*) and walks pixels of a run of positions, its ``A``, ``B`` and per-sample operands
  held in registers; a block is (channel lanes, pixel rows), the lanes of a row reading one pixel's
  adjacent channels (a packed array: the whole block reads one contiguous stretch). Blocks
  ``(run of positions, sample * channel tiles)``; more than :data:`THREADS` lanes make tiles.
* ``gn_apply_cf_<v>`` — channels-first: a block row per ``(n, c)`` plane (several planes a block
  where a plane is short), its coefficient loaded once, ``v`` consecutive positions a thread;
  blocks ``(planes, runs of positions)``.

``v`` is 16 bytes of storage (4 float32, 8 float16: one 128-bit load or store) where every array
walked per pixel (``x``, the output, per-pixel operands) takes it — the vectorized dimension
contiguous (channels-last: ``C`` channels, channels-first: the ``S`` positions), its count a
multiple of ``v``, the other strides multiples of ``v`` and the addresses 16-byte aligned — else 1.
Each thread loads :data:`IN_FLIGHT` vectors (``v`` = 1: :data:`IN_FLIGHT_SCALAR`) of every
array before it stores any. The epilogue's code is the apply group's
(:func:`convpass.kernels.group_norm.apply_group`: the expressions of
:data:`convpass.kernels.elementwise.EXPRESSIONS`), computed in float32 per element, rounded once;
offsets are 64-bit.

Rules (:func:`operand_kinds`; where they fail, the apply pass runs on the generic broadcasting
kernel, :class:`convpass.kernels.broadcast.BroadcastKernel`, as before this kernel existed):

1. ``x`` is float16 or float32, of rank 3 to 5 (the fused step's own rule);
2. every epilogue operand varies over all spatial positions *and* all channels (a residual: read
   per pixel at its own strides, in either storage), or over no spatial position (per-channel
   constants, scalars, a ``(N, C, 1, 1)`` gate: read once per thread into registers); an operand
   that varies over positions but not channels (``(N, 1, H, W)``) takes the generic kernel;
3. at run time, a launch whose grid exceeds CUDA's limits (more than 65535 samples times channel
   tiles, or runs of positions) is refused: the op library's fused step runs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from convpass.kernels.elementwise import PREAMBLE, FusedGroup
from convpass.native import nvrtc as compiler

__all__ = ["IN_FLIGHT", "IN_FLIGHT_SCALAR", "THREADS", "ApplyKernel", "apply_geometry", "compile_entries", "element_code", "operand_kinds", "prelude", "source",
           "vector_width"]

THREADS = 256
IN_FLIGHT = 2  # vectors of every array a thread loads before it stores any
IN_FLIGHT_SCALAR = 4  # the same, one element a vector
_VECTOR_BYTES = 16
_BLOCKS_PER_SM = 16  # blocks the launch aims for per SM (two waves of 256-thread blocks at full occupancy)
_GRID_Y = 65535
_STORAGE = {np.dtype(np.float16): "__half", np.dtype(np.float32): "float"}

_PRELUDE = r"""
#HEADER
#PREAMBLE
typedef #STORAGE T;
template <int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };
template <int V> __device__ __forceinline__ Pack<V> load(const T* p) { return *reinterpret_cast<const Pack<V>*>(p); }
template <int V> __device__ __forceinline__ void store(T* p, const Pack<V>& v) { *reinterpret_cast<Pack<V>*>(p) = v; }"""

_SOURCE = r"""#PRELUDE

// channels-last: thread (channel lane, pixel row) of block (run k of positions, n * tiles + tile);
// element (n, s, c) of array q at q + n * sq_n + s * sq_s + c * sq_c
template <int V, int U>
__device__ __forceinline__ void apply_cl(#PARAMS) {
    const unsigned n = blockIdx.y / tiles, c0 = ((blockIdx.y % tiles) * blockDim.x + threadIdx.x) * V;
    if (c0 >= C) return;
    const long long step = blockDim.y, p1 = min(S, ((long long)blockIdx.x + 1) * chunk);
    long long p = (long long)blockIdx.x * chunk + threadIdx.y;
    float ka[V], kb[V];
#SAMPLE_DECL_V
#pragma unroll
    for (int j = 0; j < V; ++j) {
        ka[j] = coef[(long long)n * C + c0 + j];
        kb[j] = coef[NC + (long long)n * C + c0 + j];
#SAMPLE_LOAD_CL
    }
#POINTERS_CL
    for (; p < p1; p += U * step) {
#BODY
    }
}

// channels-first: thread (position lane, plane row) of block (planes, run k of positions);
// element (n, c, s) of array q at q + n * sq_n + c * sq_c + s * sq_s
template <int V, int U>
__device__ __forceinline__ void apply_cf(#PARAMS) {
    const long long plane = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    if (plane >= NC) return;
    const unsigned n = (unsigned)(plane / C), c = (unsigned)(plane % C);
    const long long step = (long long)blockDim.x * V, p1 = min(S, ((long long)blockIdx.y + 1) * chunk);
    long long p = (long long)blockIdx.y * chunk + (long long)threadIdx.x * V;
    const float ka = coef[plane], kb = coef[NC + plane];
#SAMPLE_LOAD_CF
#POINTERS_CF
    for (; p < p1; p += U * step) {
#BODY
    }
}
#ENTRIES
"""


def operand_kinds(x_shape: Sequence[int], operand_shapes: Sequence[Sequence[int]]) -> tuple[str, ...] | None:
    """Per epilogue operand, how the kernel reads it: ``"pixel"`` (every position and channel) or
    ``"sample"`` (no position: registers); None when one is neither (module rule 2)."""
    r = len(x_shape)
    kinds = []
    for shape in operand_shapes:
        s = (1,) * (r - len(shape)) + tuple(int(d) for d in shape)
        spatial = s[2:]
        if all(d == 1 for d in spatial):
            kinds.append("sample")
        elif tuple(spatial) == tuple(int(d) for d in x_shape[2:]) and s[1] == int(x_shape[1]):
            kinds.append("pixel")
        else:
            return None
    return tuple(kinds)


def vector_width(dtype: Any) -> int:
    """Elements of ``dtype`` in one 16-byte vector."""
    return _VECTOR_BYTES // np.dtype(dtype).itemsize


def prelude(dtype: Any) -> str:
    """The head of a generated kernel over storage ``dtype``: its header, the element-wise
    preamble, the storage type ``T`` and the vector type ``Pack<V>`` with its loads and stores."""
    dtype = np.dtype(dtype)
    return (_PRELUDE.replace("#HEADER", "#include <cuda_fp16.h>" if dtype == np.float16 else "").replace("#PREAMBLE", PREAMBLE)
            .replace("#STORAGE", _STORAGE[dtype]))


def element_code(group: FusedGroup, kinds: Sequence[str], sample: Callable[[int], str]) -> list[str]:
    """The lines that compute element ``j`` of vector ``u`` (``vy.v[j]``) by ``group``'s code:
    ``x`` as ``vx[u].v[j]``, the coefficients as ``KA`` and ``KB`` (for the caller to replace), a
    per-pixel operand ``k`` as ``vx<k>[u].v[j]``, a per-sample one as ``sample(k)``."""
    lines = ["const T in0 = vx[u].v[j];", "const float in1 = KA, in2 = KB;"]
    lines += [f"const T in{k} = {f'vx{k}[u].v[j]' if kind == 'pixel' else sample(k)};" for k, kind in zip(range(3, 3 + len(kinds)), kinds)]
    return lines + ["T out0;", "{", *("    " + line for line in group.code.splitlines()), "}", "vy.v[j] = out0;"]


def _entries(v: int) -> tuple[str, ...]:
    return tuple(f"gn_apply_{order}_{w}" for order in ("cl", "cf") for w in dict.fromkeys((1, v)))


def source(group: FusedGroup, kinds: Sequence[str]) -> compiler.KernelSource:
    """The apply kernels of ``group`` (inputs ``(x, A, B, *operands)``, code from
    :func:`convpass.kernels.group_norm.apply_group`) with operands read as ``kinds``. Entries
    ``gn_apply_{cl,cf}_{1,v}`` (``v``: :func:`vector_width`), parameters ``(x, coef, *operands, y,
    C, tiles, NC, S, chunk, strides...)``: the strides (elements) of x, every operand and y in
    frame order ``(n, s, c)`` channels-last or ``(n, c, s)`` channels-first."""
    dtype = np.dtype(group.dtype)
    ops = [3 + k for k in range(len(kinds))]
    arrays = ["x", *(f"x{k}" for k in ops), "y"]
    pixel = ["x", *(f"x{k}" for k, kind in zip(ops, kinds) if kind == "pixel")]
    params = ["const T* x", "const float* coef", *(f"const T* x{k}" for k in ops), "T* y", "unsigned C", "unsigned tiles",
              "long long NC", "long long S", "long long chunk"]
    params += [f"long long s{a}_{d}" for a in arrays for d in "nsc"]
    call = ", ".join(p.rsplit(" ", 1)[1].lstrip("*") for p in params)
    samples = [k for k, kind in zip(ops, kinds) if kind == "sample"]

    def pointers(order_cl: bool) -> str:
        base = "c0" if order_cl else "c"
        lines = []
        for a in pixel + ["y"]:
            const = "T*" if a == "y" else "const T*"
            lines.append(f"    {const} p{a} = {a} + (long long)n * s{a}_n + (long long){base} * s{a}_c + p * s{a}_s;")
            lines.append(f"    const long long d{a} = step * s{a}_s;")
        return "\n".join(lines)

    body = [f"        Pack<V> v{a}[U];" for a in pixel]
    body += ["#pragma unroll", "        for (int u = 0; u < U; ++u) {", "            if (p + u * step < p1) {"]
    body += [f"                v{a}[u] = load<V>(p{a} + u * d{a});" for a in pixel]
    body += ["            }", "        }", "#pragma unroll", "        for (int u = 0; u < U; ++u) {", "            if (p + u * step < p1) {",
             "                Pack<V> vy;", "#pragma unroll", "                for (int j = 0; j < V; ++j) {"]
    body += ["                    " + line for line in element_code(group, kinds, lambda k: f"SAMPLE{k}")]
    body += ["                }", "                store<V>(py + u * dy, vy);", "            }", "        }"]
    body += [f"        p{a} += U * d{a};" for a in pixel + ["y"]]
    body_text = "\n".join(body)
    v = vector_width(dtype)
    entries = []
    for name in _entries(v):
        order, width = name.split("_")[2:]
        unroll = IN_FLIGHT if int(width) > 1 else IN_FLIGHT_SCALAR
        entries.append(f'extern "C" __global__ void {name}({", ".join(params)}) {{ apply_{order}<{width}, {unroll}>({call}); }}')
    body_cl = body_text.replace("KA", "ka[j]").replace("KB", "kb[j]")
    body_cf = body_text.replace("KA", "ka").replace("KB", "kb")
    for k in samples:
        body_cl = body_cl.replace(f"SAMPLE{k}", f"r{k}[j]")
        body_cf = body_cf.replace(f"SAMPLE{k}", f"r{k}")
    code = (_SOURCE.replace("#PRELUDE", prelude(dtype)).replace("#PARAMS", ", ".join(params))
            .replace("#SAMPLE_DECL_V", "\n".join(f"    T r{k}[V];" for k in samples))
            .replace("#SAMPLE_LOAD_CL", "\n".join(f"        r{k}[j] = x{k}[(long long)n * sx{k}_n + (long long)(c0 + j) * sx{k}_c];" for k in samples))
            .replace("#SAMPLE_LOAD_CF", "\n".join(f"    const T r{k} = x{k}[(long long)n * sx{k}_n + (long long)c * sx{k}_c];" for k in samples))
            .replace("#POINTERS_CL", pointers(True)).replace("#POINTERS_CF", pointers(False))
            .replace("#BODY", body_cl, 1).replace("#BODY", body_cf, 1).replace("#ENTRIES", "\n".join(entries)))
    tag = "".join("p" if kind == "pixel" else "s" for kind in kinds)
    return compiler.KernelSource(f"convpass_gn_apply_{group.name.removeprefix('convpass_ew_')}_{tag}", code, _entries(v))


def apply_geometry(last: bool, dims: tuple[int, int, int], strides: Sequence[tuple[int, int, int]], pixel: Sequence[bool],
                   addresses: Sequence[int], itemsize: int, sms: int, threads: int = THREADS) -> dict[str, Any] | None:
    """Which entry runs the apply and its geometry: ``{"entry", "width", "grid", "block", "args"}``
    (``args``: the scalars after the arrays), or None (module rule 3).

    ``dims``: the frame ``(N, S, C)`` when ``last``, else ``(N, C, S)``; ``strides``: every
    array's frame strides (elements; x, the operands, the output); ``pixel``: per array, whether
    it is walked per pixel (x and the output always); ``addresses``: their data addresses."""
    n, c, s = (dims[0], dims[2], dims[1]) if last else dims
    if n * c * s == 0:
        return None  # nothing to launch (the fused step's statistics refuse an empty tensor first)
    v = _VECTOR_BYTES // itemsize
    walked = [(st, a) for st, a, p in zip(strides, addresses, pixel) if p]
    along = c if last else s  # the vectorized dimension: the frame's innermost either way
    vec = v > 1 and along % v == 0 and all(st[2] == 1 and st[0] % v == 0 and st[1] % v == 0 and a % _VECTOR_BYTES == 0 for st, a in walked)
    width = v if vec else 1
    unroll = IN_FLIGHT if width > 1 else IN_FLIGHT_SCALAR
    target = _BLOCKS_PER_SM * sms
    lanes_total = math.ceil(along / width)
    lanes = max(1, min(lanes_total, threads))
    rows = max(1, threads // lanes)
    if last:
        tiles = math.ceil(lanes_total / lanes)
        chunks = max(1, min(math.ceil(target / (n * tiles)), math.ceil(s / (rows * unroll))))
        chunk = math.ceil(s / chunks)
        chunks = math.ceil(s / chunk)
        grid = (chunks, n * tiles)
    else:
        tiles = 1
        planes = math.ceil(n * c / rows)
        chunks = max(1, min(math.ceil(target / planes), math.ceil(lanes_total / (lanes * unroll))))
        chunk = math.ceil(lanes_total / chunks) * width  # positions, a multiple of the vector
        chunks = math.ceil(s / chunk)
        grid = (planes, chunks)
    if grid[1] > _GRID_Y:
        return None
    flat = [np.int64(v_) for st in strides for v_ in (st if last else (st[0], st[2], st[1]))]  # (n, s, c) either way
    args = (np.uint32(c), np.uint32(tiles), np.int64(n * c), np.int64(s), np.int64(chunk), *flat)
    return {"entry": f"gn_apply_{'cl' if last else 'cf'}_{width}", "width": width, "grid": grid, "block": (lanes, rows), "args": args}


def _address(a: Any) -> int:
    data = a.data
    return int(data.ptr) if hasattr(data, "ptr") else int(a.ctypes.data)


def compile_entries(cupy: Any, src: compiler.KernelSource, entry: Callable[[compiler.KernelSource, str], Any] | None) -> dict[str, Any]:
    """Every entry point of ``src`` built by ``entry(source, name)`` (default: NVRTC through ``cupy``)."""
    build = entry if entry is not None else (lambda s, name: compiler.function(cupy, s, name))
    return {name: build(src, name) for name in src.entries}


class ApplyKernel:
    """The apply kernels of a fused step, compiled when built (at plan time). Called with the
    frames of ``x``, the operands and the output (:func:`convpass.kernels.group_norm.frame`) and
    the coefficients, it launches and returns the output, or None for a geometry it refuses.
    ``entry(source, name)``: a compiled entry point (default NVRTC; the CPU tests pass host builds)."""

    def __init__(self, cupy: Any, group: FusedGroup, kinds: Sequence[str], sms: Callable[[], int],
                 entry: Callable[[compiler.KernelSource, str], Any] | None = None, threads: int = THREADS) -> None:
        self.kinds = tuple(kinds)
        self.source = source(group, self.kinds)
        self.entries = compile_entries(cupy, self.source, entry)
        self.sms = sms
        self.threads = threads
        self._plans: dict[tuple, Any] = {}
        self.planned: set[str] = set()  # the entries launched so far

    def __call__(self, x: Any, coef: Any, operands: Sequence[Any], out: Any, last: bool) -> Any | None:
        arrays = [x, *operands, out]
        key = (last, *((a.shape, a.strides, _address(a) % _VECTOR_BYTES) for a in arrays))
        geo = self._plans.get(key)
        if geo is None:
            pixel = [True, *(k == "pixel" for k in self.kinds), True]
            strides = [tuple(st // a.itemsize for st in a.strides) for a in arrays]
            geo = self._plans[key] = apply_geometry(last, tuple(x.shape), strides, pixel, [_address(a) for a in arrays], x.itemsize,
                                                    self.sms(), self.threads) or False
        if geo is False:
            return None
        self.planned.add(geo["entry"])
        if x.size:
            self.entries[geo["entry"]](geo["grid"], geo["block"], (x, coef, *operands, out, *geo["args"]))
        return out

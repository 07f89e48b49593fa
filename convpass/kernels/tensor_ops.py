"""Data-movement ops of the cuda backend: Resize / Upsample as one kernel, Concat into shared buffers.

Resize
    The op library resamples one axis at a time (``take`` for nearest, a matmul with the axis's
    interpolation matrix for linear / cubic), each a pass over a growing tensor plus the moves
    around it. The kernels here do all of it in one pass, reading per-axis tables (input index and
    weight per output index and tap) built from the op library's own
    :class:`~convpass.ops.resize.ResizeGeometry`, so both compute the same function; the tables
    carry the ONNX coordinate transform, the kernels never compute a coordinate. Inputs and outputs
    may have any strides (channels-first, channels-last, a slice of a Concat buffer).

    * ``resize_nearest_{cl,cf}_{1,v}`` (:func:`resize_nearest`): nearest upsampling as a copy,
      bit-exact (the storage's bits, any dtype of that size). Channels-last output: a block is one
      output row ``(n, oh)``, a thread owns ``v`` consecutive channels of a pixel (walking further
      channels where ``C`` exceeds a block's lanes) for :data:`IN_FLIGHT` pixels of the row, its
      source pixel ``(iy[oh], ix[ow])``. Channels-first output: a block is a run of output rows of
      one ``(n, c)`` plane, a thread owns ``v`` consecutive outputs of a row, gathered from input
      row ``iy[oh]`` at ``ix[ow]``. ``v`` is 16 bytes of storage (4 float32, 8 float16) where the
      vectorized dimension (channels-last: ``C`` of input and output; channels-first: the output's
      ``W``) is contiguous, its count and the other strides are multiples of ``v`` and the
      addresses 16-byte aligned; else 1. Grids ``(runs, OH or C, N)``: no division per element.
    * ``resize_2d`` (:func:`resize_2d`): everything else, one output element per thread from up to
      ``taps x taps`` inputs (nearest: one tap of weight 1, bit-exact; linear / cubic: the same
      weights as the op library, summed in float32 in one go).

    Rules (:func:`lower_resize`):

    1. the kernels take float16 / float32 inputs of rank 3 or 4 whose resize changes only the
       trailing two axes (rank 3: the last), without extrapolation (tf_crop_and_resize outside its
       roi); Resizes of the batch or channel axis and the rest stay with the op library;
    2. ``resize_nearest`` runs a nearest resize whose resized axes each grow by a whole factor
       (output length a multiple of the input length: x2, x3, ...) and whose grid fits CUDA's
       limits (``N``, ``C`` and the output height at most 65535);
    3. ``resize_2d`` runs the others: linear, cubic, and nearest with a fractional factor or a
       downsampling.

Concat
    :class:`ConcatLaunch` writes each input into its slice of the output. The memory planner
    (:mod:`convpass.runtime.cuda.memory`) makes Concats share buffers and lets producers write into their slices
    directly; a ConcatLaunch then copies only the inputs nobody placed, and a Concat whose inputs
    are a run of a larger Concat's inputs (DenseNet's growing feature lists) is a view of that
    larger buffer and copies nothing that is already there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from convpass.kernels.launch import Launch, Placement
from convpass.native import nvrtc as compiler
from convpass.native.cuda import copy_into, elements
from convpass.ops.resize import resize_arguments, resize_geometry

__all__ = ["ConcatLaunch", "ResizeLaunch", "lower_resize", "nearest_geometry", "nearest_source", "resize_2d", "resize_nearest", "resize_taps",
           "vector_width"]

_BLOCK = 256

_SOURCE = r"""
#HEADER
extern "C" __global__ void resize_2d(
    const TYPE* __restrict__ x, TYPE* __restrict__ y, unsigned total, unsigned C, unsigned OH, unsigned OW, int channels_last,
    long long xsn, long long xsc, long long xsh, long long xsw, long long ysn, long long ysc, long long ysh, long long ysw,
    const int* __restrict__ iy, const float* __restrict__ wy, int ty, const int* __restrict__ ix, const float* __restrict__ wx, int tx)
{
    // 32-bit index arithmetic (the host keeps total below 2^31): 64-bit division is many times slower
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        unsigned r = i, n, c, oh, ow;
        if (channels_last) { c = r % C; r /= C; ow = r % OW; r /= OW; oh = r % OH; n = r / OH; }
        else { ow = r % OW; r /= OW; oh = r % OH; r /= OH; c = r % C; n = r / C; }
        const TYPE* xb = x + n * xsn + c * xsc;
        float acc = 0.f;
        for (int a = 0; a < ty; ++a) {
            const float w1 = wy[oh * ty + a];
            if (w1 == 0.f) continue;
            const TYPE* xr = xb + (long long)iy[oh * ty + a] * xsh;
            for (int b = 0; b < tx; ++b) {
                const float w2 = wx[ow * tx + b];
                if (w2 != 0.f) acc += w1 * w2 * LOAD(xr[(long long)ix[ow * tx + b] * xsw]);
            }
        }
        y[n * ysn + c * ysc + oh * ysh + ow * ysw] = STORE(acc);
    }
}
"""

_NEAREST_SOURCE = r"""
// Nearest upsampling as a copy of storage bits (module docstring). Element (n, c, h, w) of x at
// x + n * xsn + c * xsc + h * xsh + w * xsw, likewise y; iy[oh], ix[ow]: the source row and column.
typedef ELEMENT T;
template <int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

// channels-last: block (run of pixels, oh, n), thread (channel lane, pixel row)
template <int V, int U>
__device__ __forceinline__ void nearest_cl(const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ iy, const int* __restrict__ ix,
    unsigned C, unsigned OW, long long xsn, long long xsc, long long xsh, long long xsw, long long ysn, long long ysc, long long ysh, long long ysw)
{
    const unsigned n = blockIdx.z, oh = blockIdx.y, rows = blockDim.y;
    const unsigned ow0 = blockIdx.x * rows * U + threadIdx.y;
    const T* xr = x + n * xsn + (long long)iy[oh] * xsh;
    T* yr = y + n * ysn + (long long)oh * ysh;
    long long xo[U], yo[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const unsigned ow = ow0 + u * rows;
        xo[u] = ow < OW ? (long long)ix[ow] * xsw : 0;
        yo[u] = (long long)ow * ysw;
    }
    for (unsigned c = threadIdx.x * V; c < C; c += blockDim.x * V) {
        Pack<V> v[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (ow0 + u * rows < OW) v[u] = *reinterpret_cast<const Pack<V>*>(xr + xo[u] + c * xsc);
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (ow0 + u * rows < OW) *reinterpret_cast<Pack<V>*>(yr + yo[u] + c * ysc) = v[u];
    }
}

// channels-first: block (run of rows, c, n), thread (column lane, row)
template <int V, int U>
__device__ __forceinline__ void nearest_cf(const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ iy, const int* __restrict__ ix,
    unsigned OH, unsigned OW, long long xsn, long long xsc, long long xsh, long long xsw, long long ysn, long long ysc, long long ysh, long long ysw)
{
    const unsigned n = blockIdx.z, c = blockIdx.y, rows = blockDim.y;
    const unsigned oh0 = blockIdx.x * rows * U + threadIdx.y;
    const T* xp = x + n * xsn + c * xsc;
    T* yp = y + n * ysn + c * ysc;
    const T* xr[U];
    T* yr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const unsigned oh = oh0 + u * rows;
        xr[u] = xp + (oh < OH ? (long long)iy[oh] * xsh : 0);
        yr[u] = yp + (long long)oh * ysh;
    }
    for (unsigned w = threadIdx.x * V; w < OW; w += blockDim.x * V) {
        long long xi[V];
#pragma unroll
        for (int j = 0; j < V; ++j) xi[j] = (long long)ix[w + j] * xsw;
        Pack<V> v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (oh0 + u * rows < OH) {
#pragma unroll
                for (int j = 0; j < V; ++j) v[u].v[j] = xr[u][xi[j]];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (oh0 + u * rows < OH) *reinterpret_cast<Pack<V>*>(yr[u] + w * ysw) = v[u];
    }
}

#define NEAREST_ENTRY(order, V, U, extent) \
extern "C" __global__ void resize_nearest_##order##_##V(const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ iy, \
    const int* __restrict__ ix, unsigned C, unsigned OH, unsigned OW, long long xsn, long long xsc, long long xsh, long long xsw, \
    long long ysn, long long ysc, long long ysh, long long ysw) \
{ nearest_##order<V, U>(x, y, iy, ix, extent, OW, xsn, xsc, xsh, xsw, ysn, ysc, ysh, ysw); }
NEAREST_ENTRY(cl, 1, IN_FLIGHT_SCALAR, C)
NEAREST_ENTRY(cl, VECTOR, IN_FLIGHT, C)
NEAREST_ENTRY(cf, 1, IN_FLIGHT_SCALAR, OH)
NEAREST_ENTRY(cf, VECTOR, IN_FLIGHT, OH)
"""

RESIZE_DTYPES = compiler.DTYPES
IN_FLIGHT = 2  # vectors a thread loads before it stores any (the pixels / rows it owns)
IN_FLIGHT_SCALAR = 4  # the same, one element a vector
NEAREST_THREADS = 256
_VECTOR_BYTES = 16
_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
_ELEMENT = {2: "unsigned short", 4: "unsigned int"}  # storage bits: nearest copies them


def source(dtype: Any) -> compiler.KernelSource:
    return compiler.typed("resize", _SOURCE, ("resize_2d",), dtype)


def vector_width(dtype: Any) -> int:
    """Elements of ``dtype`` in one 16-byte vector."""
    return _VECTOR_BYTES // np.dtype(dtype).itemsize


def nearest_source(dtype: Any) -> compiler.KernelSource:
    """The nearest kernels for ``dtype``: entries ``resize_nearest_{cl,cf}_{1,v}`` (``v``: :func:`vector_width`)."""
    dtype = np.dtype(dtype)
    v = vector_width(dtype)
    code = (_NEAREST_SOURCE.replace("ELEMENT", _ELEMENT[dtype.itemsize]).replace("IN_FLIGHT_SCALAR", str(IN_FLIGHT_SCALAR))
            .replace("IN_FLIGHT", str(IN_FLIGHT)).replace("VECTOR", str(v)))
    entries = tuple(f"resize_nearest_{order}_{w}" for order in ("cl", "cf") for w in (1, v))
    return compiler.KernelSource(f"convpass_resize_nearest_{dtype.name}", code, entries)


def resize_taps(kind: str | None, table: Any, in_len: int, out_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Per output index, the input indices and weights of its taps: ``(idx[out, taps], w[out, taps])``
    (int32, float32) from a :func:`~convpass.ops.resize._resize_axis` table; ``kind`` None: the
    identity (an axis that does not change). Unused taps have weight 0."""
    if kind is None:
        return np.arange(out_len, dtype=np.int32).reshape(-1, 1), np.ones((out_len, 1), np.float32)
    if kind == "index":
        return np.asarray(table, dtype=np.int32).reshape(-1, 1), np.ones((out_len, 1), np.float32)
    m = np.asarray(table, dtype=np.float64)  # M[in, out]
    nonzero = [np.flatnonzero(m[:, o]) for o in range(out_len)]
    taps = max(1, max(len(z) for z in nonzero))
    idx = np.zeros((out_len, taps), np.int32)
    w = np.zeros((out_len, taps), np.float32)
    for o, z in enumerate(nonzero):
        idx[o, : len(z)] = z
        w[o, : len(z)] = m[z, o]
    return idx, w


def _channels_last(a: Any) -> bool:
    st = elements(a.strides, a.itemsize)
    return a.ndim >= 3 and a.shape[1] > 1 and st[1] == 1


def resize_2d(cupy: Any, x: Any, y: Any, tables: tuple[Any, Any, Any, Any], function: Any = None) -> Any:
    """``y`` = ``x`` resampled on its two trailing axes with device tables ``(iy, wy, ix, wx)``;
    rank-3 arrays are resampled on the last axis (their height is 1). ``function``: the compiled
    ``resize_2d`` entry (default: NVRTC's for ``x``'s dtype)."""
    total = y.size
    if total == 0:
        return y
    iy, wy, ix, wx = tables
    xs, ys = elements(x.strides, x.itemsize), elements(y.strides, y.itemsize)
    if x.ndim == 3:
        xs, ys = (*xs[:2], 0, xs[2]), (*ys[:2], 0, ys[2])
        oh, ow = 1, y.shape[2]
    else:
        oh, ow = y.shape[2], y.shape[3]
    params = (
        x, y, np.uint32(total), np.uint32(y.shape[1]), np.uint32(oh), np.uint32(ow), np.int32(_channels_last(y)),
        *(np.int64(v) for v in xs), *(np.int64(v) for v in ys),
        iy, wy, np.int32(iy.shape[1]), ix, wx, np.int32(ix.shape[1]),
    )
    blocks = min(math.ceil(total / _BLOCK), 65535 * 4)
    if function is None:
        function = compiler.function(cupy, source(x.dtype), "resize_2d")
    function((blocks,), (_BLOCK,), params)
    return y


def _frame(a: Any) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """``(N, C, H, W)`` and its element strides; rank 3 as height 1 (stride 0)."""
    st = elements(a.strides, a.itemsize)
    if a.ndim == 3:
        return (a.shape[0], a.shape[1], 1, a.shape[2]), (st[0], st[1], 0, st[2])
    return (a.shape[0], a.shape[1], a.shape[2], a.shape[3]), (st[0], st[1], st[2], st[3])


def _address(a: Any) -> int:
    data = a.data
    return int(data.ptr) if hasattr(data, "ptr") else int(a.ctypes.data)


def nearest_geometry(last: bool, dims: tuple[int, int, int, int], xs: tuple[int, ...], ys: tuple[int, ...], addresses: tuple[int, int],
                     itemsize: int, threads: int = NEAREST_THREADS) -> dict[str, Any]:
    """Which nearest entry runs and its launch: ``{"entry", "grid", "block"}``. ``last``: the
    channels-last kernel; ``dims``: the output's ``(N, C, OH, OW)``; ``xs``, ``ys``: element
    strides ``(n, c, h, w)`` of input and output; ``addresses``: theirs (module docstring)."""
    n, c, oh, ow = dims
    v = _VECTOR_BYTES // itemsize
    if last:
        along, walked, extent = c, ow, oh
        vec = c % v == 0 and xs[1] == 1 and ys[1] == 1 and all(s_ % v == 0 for s_ in (*xs[::2], xs[3], *ys[::2], ys[3]))
        vec = vec and all(a % _VECTOR_BYTES == 0 for a in addresses)
    else:
        along, walked, extent = ow, oh, c
        vec = ow % v == 0 and ys[3] == 1 and all(s_ % v == 0 for s_ in ys[:3]) and addresses[1] % _VECTOR_BYTES == 0
    width = v if vec and v > 1 else 1
    unroll = IN_FLIGHT if width > 1 else IN_FLIGHT_SCALAR
    lanes = max(1, min(math.ceil(along / width), threads))
    rows = max(1, min(threads // lanes, math.ceil(walked / unroll)))
    grid = (math.ceil(walked / (rows * unroll)), extent, n)
    return {"entry": f"resize_nearest_{'cl' if last else 'cf'}_{width}", "grid": grid, "block": (lanes, rows)}


def nearest_fits(out_shape: tuple[int, ...]) -> bool:
    """Whether both nearest kernels' grids fit CUDA's limits for this output shape (module rule 2)."""
    n, c = out_shape[:2]
    oh = out_shape[2] if len(out_shape) == 4 else 1
    return max(n, c, oh) <= _GRID_YZ


def resize_nearest(x: Any, y: Any, iy: Any, ix: Any, entry: Callable[[str], Any], threads: int = NEAREST_THREADS) -> str:
    """``y`` = ``x`` resampled by nearest on its two trailing axes from the device index tables
    ``iy`` (``(OH, 1)``; rank 3: ``[[0]]``) and ``ix`` (``(OW, 1)``); ``entry(name)``: the compiled
    entry point of :func:`nearest_source`. Returns the entry that ran."""
    dims, ys = _frame(y)
    _, xs = _frame(x)
    geo = nearest_geometry(_channels_last(y), dims, xs, ys, (_address(x), _address(y)), x.itemsize, threads)
    if y.size:
        params = (x, y, iy, ix, *(np.uint32(d) for d in dims[1:]), *(np.int64(v) for v in xs), *(np.int64(v) for v in ys))
        entry(geo["entry"])(geo["grid"], geo["block"], params)
    return geo["entry"]


class ResizeLaunch(Launch):
    """Resize / Upsample on the two trailing axes as one launch: :func:`resize_nearest` when
    ``nearest`` (module rule 2), else :func:`resize_2d`. ``entry(source, name)``: a compiled entry
    point (default NVRTC; the CPU tests pass host builds). ``paths``: the entries launched so far."""

    supports_placement = True

    def __init__(self, plan: Any, index: int, cupy: Any, tables: tuple[Any, Any, Any, Any], out_shape: tuple[int, ...],
                 nearest: bool = False, entry: Callable[[compiler.KernelSource, str], Any] | None = None) -> None:
        step = plan.steps[index]
        super().__init__(index, step.node, f"{step.node.op_type} kernel{' (nearest)' if nearest else ''}", step.outputs[:1])
        self.dtype = np.dtype(plan.info(step.inputs[0])[1])
        self.cp, self.x, self.tables, self.out_shape, self.nearest = cupy, step.inputs[0], tables, out_shape, nearest
        self.entry = entry if entry is not None else (lambda src, name: compiler.function(cupy, src, name))
        self.functions: dict[str, Any] = {}
        self.paths: set[str] = set()
        self.threads = NEAREST_THREADS

    def sources(self) -> list[compiler.KernelSource]:
        """The kernel source this launch runs (compiled at plan time)."""
        return [nearest_source(self.dtype) if self.nearest else source(self.dtype)]

    def prepare(self) -> None:
        for src in self.sources():
            self.functions.update((name, self.entry(src, name)) for name in src.entries)

    def run(self, env: list[Any]) -> None:
        x = env[self.x]
        layout = "nhwc" if _channels_last(x) else "nchw"
        y = self.destination(env, layout)
        if y is None:
            from convpass.native import cudnn

            y = cudnn.empty_like_layout(self.out_shape, x.dtype, layout)
        if self.nearest:
            self.paths.add(resize_nearest(x, y, self.tables[0], self.tables[2], self.functions.__getitem__, self.threads))
        else:
            resize_2d(self.cp, x, y, self.tables, self.functions["resize_2d"])
            self.paths.add("resize_2d")
        env[self.outputs[0]] = y


def _integer_upsampling(g: Any) -> bool:
    """Every resized axis of ``g`` nearest, its output length a whole multiple of its input length."""
    return g.mode == "nearest" and all(kind == "index" and g.out_shape[a] % g.in_shape[a] == 0 for a, kind, _, _ in g.axes)


def lower_resize(plan: Any, index: int, cupy: Any, host: Any, upload: Any,
                 entry: Callable[[compiler.KernelSource, str], Any] | None = None) -> ResizeLaunch | None:
    """A :class:`ResizeLaunch` for a Resize / Upsample step whose resampling these kernels cover
    (module rules). ``host(device constant)`` reads its scales / sizes / roi; ``upload(host array)``
    makes the tables; ``entry``: see :class:`ResizeLaunch`."""
    step = plan.steps[index]
    node = step.node
    if node.domain != "" or node.op_type not in ("Resize", "Upsample") or step.outputs[0] < 0:
        return None
    info = plan.info(step.inputs[0])
    if info is None or np.dtype(info[1]) not in RESIZE_DTYPES or len(info[0]) not in (3, 4):
        return None
    values: list[Any] = [None]
    for s in step.inputs[1:]:
        if s < 0:
            values.append(None)
            continue
        const = plan.template[s]
        if const is None:
            return None  # computed on the device: the op library
        values.append(np.asarray(host(const)))
    try:
        g = resize_geometry(node, tuple(info[0]), info[1], **resize_arguments(node, values))
    except Exception:  # noqa: BLE001  (the op library raises the proper error when the step runs)
        return None
    rank = len(g.in_shape)
    if g.extrapolates or any(kind == "empty" or a < rank - 2 for a, kind, _, _ in g.axes) or (rank == 3 and any(a != 2 for a, *_ in g.axes)):
        return None
    if tuple(plan.info(step.outputs[0])[0]) != g.out_shape or math.prod(g.out_shape) > (1 << 31) - 1:
        return None  # (the kernel's 32-bit index arithmetic)
    by_axis = {a: (kind, table) for a, kind, table, _ in g.axes}
    h_axis, w_axis = (rank - 2, rank - 1) if rank == 4 else (None, 2)
    if h_axis is None:
        iy, wy = np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32)
    else:
        iy, wy = resize_taps(*by_axis.get(h_axis, (None, None)), g.in_shape[h_axis], g.out_shape[h_axis])
    ix, wx = resize_taps(*by_axis.get(w_axis, (None, None)), g.in_shape[w_axis], g.out_shape[w_axis])
    tables = tuple(upload(np.ascontiguousarray(t)) for t in (iy, wy, ix, wx))
    nearest = _integer_upsampling(g) and nearest_fits(g.out_shape)
    return ResizeLaunch(plan, index, cupy, tables, g.out_shape, nearest, entry)


class ConcatLaunch(Launch):
    """A Concat whose buffer the memory planner arranged (:mod:`convpass.runtime.cuda.memory`).

    ``copies``: ``(slot, offset, length)`` of the inputs this launch copies into the buffer (the
    others are there already); ``own``: how the buffer is found — this Concat's own buffer, or
    (``placement``) a slice of a larger Concat's buffer.
    """

    supports_placement = True

    def __init__(self, plan: Any, index: int, axis: int, copies: list[tuple[int, int, int]], own: Placement) -> None:
        step = plan.steps[index]
        super().__init__(index, step.node, "Concat" + (" (in place)" if not copies else ""), step.outputs[:1])
        self.axis = axis
        self.copies = copies
        self.own = own

    def run(self, env: list[Any]) -> None:
        layout = "nhwc" if self.copies and _channels_last(env[self.copies[0][0]]) else "nchw"
        buf = self.destination(env, layout) if self.placement is not None else self.own.buffer(env, layout)
        for slot, offset, length in self.copies:
            index = (slice(None),) * self.axis + (slice(offset, offset + length),)
            copy_into(buf[index], env[slot])
        env[self.outputs[0]] = buf

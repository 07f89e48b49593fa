"""Data-movement ops of the cuda backend: Resize / Upsample as one kernel, Concat into shared buffers.

Resize
    The op library resamples one axis at a time (``take`` for nearest, a matmul with the axis's
    interpolation matrix for linear / cubic), each a pass over a growing tensor plus the moves
    around it. ``resize_2d`` does all of it in one pass: per output element, the taps of the two
    trailing axes from per-axis tables (input index and weight per output index and tap) built from
    the op library's own :class:`~convpass.ops.resize.ResizeGeometry`, so both compute the
    same function (nearest: one tap of weight 1, bit-exact; linear: the same weights, summed in
    float32 in one go). Inputs and outputs with any strides (channels-first or channels-last).
    Resizes of the batch or channel axis, and tf_crop_and_resize's extrapolation, stay with the op
    library.

Concat
    :class:`ConcatLaunch` writes each input into its slice of the output. The memory planner
    (:mod:`convpass.runtime.cuda.memory`) makes Concats share buffers and lets producers write into their slices
    directly; a ConcatLaunch then copies only the inputs nobody placed, and a Concat whose inputs
    are a run of a larger Concat's inputs (DenseNet's growing feature lists) is a view of that
    larger buffer and copies nothing that is already there.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from convpass.kernels.launch import Launch, Placement
from convpass.native import nvrtc as compiler
from convpass.native.cuda import copy_into, elements
from convpass.ops.resize import resize_arguments, resize_geometry

__all__ = ["ConcatLaunch", "ResizeLaunch", "lower_resize", "resize_2d", "resize_taps"]

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

RESIZE_DTYPES = compiler.DTYPES


def source(dtype: Any) -> compiler.KernelSource:
    return compiler.typed("resize", _SOURCE, ("resize_2d",), dtype)


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


def resize_2d(cupy: Any, x: Any, y: Any, tables: tuple[Any, Any, Any, Any]) -> Any:
    """``y`` = ``x`` resampled on its two trailing axes with device tables ``(iy, wy, ix, wx)``;
    rank-3 arrays are resampled on the last axis (their height is 1)."""
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
    compiler.function(cupy, source(x.dtype), "resize_2d")((blocks,), (_BLOCK,), params)
    return y


class ResizeLaunch(Launch):
    """Resize / Upsample on the two trailing axes as one :func:`resize_2d` launch."""

    supports_placement = True

    def __init__(self, plan: Any, index: int, cupy: Any, tables: tuple[Any, Any, Any, Any], out_shape: tuple[int, ...]) -> None:
        step = plan.steps[index]
        super().__init__(index, step.node, f"{step.node.op_type} kernel", step.outputs[:1])
        self.dtype = np.dtype(plan.info(step.inputs[0])[1])
        self.cp, self.x, self.tables, self.out_shape = cupy, step.inputs[0], tables, out_shape

    def run(self, env: list[Any]) -> None:
        from convpass.native import cudnn

        x = env[self.x]
        layout = "nhwc" if _channels_last(x) else "nchw"
        y = self.destination(env, layout)
        if y is None:
            y = cudnn.empty_like_layout(self.out_shape, x.dtype, layout)
        env[self.outputs[0]] = resize_2d(self.cp, x, y, self.tables)


def lower_resize(plan: Any, index: int, cupy: Any, host: Any, upload: Any) -> ResizeLaunch | None:
    """A :class:`ResizeLaunch` for a Resize / Upsample step whose resampling this kernel covers
    (float16 / float32, rank 3 or 4, only the trailing two axes change, no extrapolation).
    ``host(device constant)`` reads its scales / sizes / roi; ``upload(host array)`` makes the tables."""
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
    return ResizeLaunch(plan, index, cupy, tables, g.out_shape)


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

"""Pooling for the cuda backend: window pooling and global pooling, in the tensor's memory format.

The op library writes pooling as a padded copy of the input, a strided window view and a
reduction over it (AveragePool twice: once more over a tensor of ones for the divisor), and its
padding goes through ``cupy.pad``, which uploads its fill value: a plan with a padded pooling
could not be captured as a CUDA graph. Here each pooling is one kernel launch over the input as it
is stored (channels-first, channels-last, or a slice of a Concat buffer: every array is passed
with its strides), writing its output where the plan wants it.

Kernels (one CUDA source, float32 / float16 data, float32 accumulation):

* ``pool_window``: MaxPool, AveragePool, LpPool of 1-D, 2-D and 3-D windows with all of ONNX's
  attributes: asymmetric pads, ``auto_pad``, ``ceil_mode`` (the window geometry comes from the op
  library's :func:`~convpass.runtime.ops_nn._pool_geometry`, so both agree by construction),
  dilations, ``count_include_pad`` (the divisor counts window positions inside the input and its
  explicit pads, never the ceil-mode tail), NaN propagated by MaxPool. One thread per output
  element, threads ordered as the output's memory, so channels-last reads are coalesced.
* ``pool_global_rows`` / ``pool_global_cl``: GlobalAveragePool, GlobalMaxPool and ReduceMean /
  ReduceMax over all spatial axes (squeeze-excitation blocks): a warp or a block per (n, c) row
  for channels-first data, 32 channels x 8 lanes of the spatial axis per block for channels-last.
* cuDNN's ``cudnnPoolingForward`` (:mod:`convpass.cudnn.pooling`) for the window poolings it
  expresses (2-D / 3-D, symmetric pads, no dilation, no ceil-mode tail): chosen per family by
  :data:`CUDNN_FAMILIES` from the measured comparison in ``benchmarks/op_kernels.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from convpass.runtime.cuda import compiler
from convpass.runtime.cuda.common import elements
from convpass.runtime.cuda.launch import Launch
from convpass.runtime.ops_nn import _pool_geometry

__all__ = ["CUDNN_FAMILIES", "POOL_DTYPES", "PoolLaunch", "lower_pool", "pool_global", "pool_window"]

# Window poolings cuDNN runs where it can ("max", "average"); the rest run convpass's kernel.
# Set from benchmarks/op_kernels.py: see the README's kernel table.
CUDNN_FAMILIES: frozenset[str] = frozenset()

_BLOCK = 256

_SOURCE = r"""
#HEADER
#define NEG_INF __int_as_float(0xff800000)
#define FULL 0xffffffffu

// mode: 0 max, 1 average, 2 Lp
extern "C" __global__ void pool_window(
    const TYPE* __restrict__ x, TYPE* __restrict__ y, long long total,
    int C, int OD, int OH, int OW, int channels_last,
    long long xsn, long long xsc, long long xsd, long long xsh, long long xsw,
    long long ysn, long long ysc, long long ysd, long long ysh, long long ysw,
    int ID, int IH, int IW, int KD, int KH, int KW, int SD, int SH, int SW, int DD, int DH, int DW,
    int PD, int PH, int PW, int ED, int EH, int EW, int mode, int count_include_pad, float p)
{
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long r = i, n;
        int c, od, oh, ow;
        if (channels_last) { c = r % C; r /= C; ow = r % OW; r /= OW; oh = r % OH; r /= OH; od = r % OD; n = r / OD; }
        else { ow = r % OW; r /= OW; oh = r % OH; r /= OH; od = r % OD; r /= OD; c = r % C; n = r / C; }
        const TYPE* xb = x + n * xsn + c * xsc;
        const int d0 = od * SD - PD, h0 = oh * SH - PH, w0 = ow * SW - PW;
        float acc = mode == 0 ? NEG_INF : 0.f;
        int inside = 0;
        for (int kd = 0; kd < KD; ++kd) {
            const int id = d0 + kd * DD;
            if (id < 0 || id >= ID) continue;
            for (int kh = 0; kh < KH; ++kh) {
                const int ih = h0 + kh * DH;
                if (ih < 0 || ih >= IH) continue;
                for (int kw = 0; kw < KW; ++kw) {
                    const int iw = w0 + kw * DW;
                    if (iw < 0 || iw >= IW) continue;
                    const float v = LOAD(xb[id * xsd + ih * xsh + iw * xsw]);
                    if (mode == 0) acc = (v != v || v > acc) ? v : acc;  // NaN sticks, as NumPy's max
                    else if (mode == 1) acc += v;
                    else acc += powf(fabsf(v), p);
                    ++inside;
                }
            }
        }
        if (mode == 1) {
            float divisor = (float)inside;
            if (count_include_pad) {  // window positions inside input + explicit pads
                int cd = 0, ch = 0, cw = 0;
                for (int kd = 0; kd < KD; ++kd) { const int id = d0 + kd * DD; cd += id >= -PD && id < ID + ED; }
                for (int kh = 0; kh < KH; ++kh) { const int ih = h0 + kh * DH; ch += ih >= -PH && ih < IH + EH; }
                for (int kw = 0; kw < KW; ++kw) { const int iw = w0 + kw * DW; cw += iw >= -PW && iw < IW + EW; }
                divisor = (float)(cd * ch * cw);
            }
            acc = acc / fmaxf(divisor, 1.f);
        } else if (mode == 2) {
            acc = powf(acc, 1.f / p);
        }
        y[n * ysn + c * ysc + od * ysd + oh * ysh + ow * ysw] = STORE(acc);
    }
}

__device__ __forceinline__ float combine(float a, float v, int mode) {
    return mode == 0 ? ((v != v || v > a) ? v : a) : a + v;
}
__device__ __forceinline__ float warp_combine(float v, int mode) {
    for (int o = 16; o > 0; o >>= 1) {
        const float u = __shfl_xor_sync(FULL, v, o);
        v = mode == 0 ? ((u != u || u > v) ? u : v) : v + u;
    }
    return v;
}

// Channels-first global pooling: rows = n * c of L contiguous elements; y[row * ys].
// A warp per row (8 rows per 256-thread block) when warp_rows, else a block per row.
extern "C" __global__ void pool_global_rows(const TYPE* __restrict__ x, TYPE* __restrict__ y, long long rows, long long L,
                                            long long C, long long ysn, long long ysc, int mode, int warp_rows) {
    __shared__ float sh[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    long long row;
    int start, step;
    if (warp_rows) { row = (long long)blockIdx.x * (blockDim.x >> 5) + warp; start = lane; step = 32; }
    else { row = blockIdx.x; start = threadIdx.x; step = blockDim.x; }
    float acc = mode == 0 ? NEG_INF : 0.f;
    if (row < rows) {
        const TYPE* xr = x + row * L;
        for (long long k = start; k < L; k += step) acc = combine(acc, LOAD(xr[k]), mode);
    }
    acc = warp_combine(acc, mode);
    if (!warp_rows) {
        if (lane == 0) sh[warp] = acc;
        __syncthreads();
        if (warp == 0) {
            acc = lane < (int)(blockDim.x >> 5) ? sh[lane] : (mode == 0 ? NEG_INF : 0.f);
            acc = warp_combine(acc, mode);
        }
    }
    if (row < rows && (warp_rows ? lane == 0 : threadIdx.x == 0)) {
        y[(row / C) * ysn + (row % C) * ysc] = STORE(mode == 1 ? acc / (float)L : acc);
    }
}

// Channels-last global pooling: block (32 channels) x (8 lanes over the L spatial positions).
extern "C" __global__ void pool_global_cl(const TYPE* __restrict__ x, TYPE* __restrict__ y, long long C, long long L,
                                          long long xsn, long long xsc, long long xsl, long long ysn, long long ysc, int mode) {
    __shared__ float sh[8][33];
    const long long n = blockIdx.y, c = (long long)blockIdx.x * 32 + threadIdx.x;
    float acc = mode == 0 ? NEG_INF : 0.f;
    if (c < C) {
        const TYPE* xb = x + n * xsn + c * xsc;
        for (long long k = threadIdx.y; k < L; k += blockDim.y) acc = combine(acc, LOAD(xb[k * xsl]), mode);
    }
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        for (int k = 1; k < blockDim.y; ++k) acc = combine(acc, sh[k][threadIdx.x], mode);
        y[n * ysn + c * ysc] = STORE(mode == 1 ? acc / (float)L : acc);
    }
}
"""

_VARIANTS = {
    np.dtype(np.float32): {"#HEADER": "", "TYPE": "float", "LOAD": "", "STORE": ""},
    np.dtype(np.float16): {"#HEADER": "#include <cuda_fp16.h>", "TYPE": "__half", "LOAD": "__half2float", "STORE": "__float2half_rn"},
}
POOL_DTYPES = frozenset(_VARIANTS)
_MODES = {"max": 0, "average": 1, "lp": 2}


def source(dtype: Any) -> compiler.KernelSource:
    dtype = np.dtype(dtype)
    code = _SOURCE
    for token, text in _VARIANTS[dtype].items():
        code = code.replace(token, text)
    return compiler.KernelSource(f"convpass_pool_{dtype.name}", code, ("pool_window", "pool_global_rows", "pool_global_cl"))


def _pad3(values: tuple[int, ...] | list[int], fill: int) -> tuple[int, ...]:
    return (fill,) * (3 - len(values)) + tuple(int(v) for v in values)


def _strides5(a: Any) -> tuple[int, ...]:
    """Element strides of ``a`` as (n, c, d, h, w), size-1 spatial dims added in front."""
    st = elements(a.strides, a.itemsize)
    return (st[0], st[1], *_pad3(st[2:], 0))


def _channels_last(a: Any) -> bool:
    st = elements(a.strides, a.itemsize)
    return a.ndim >= 3 and a.shape[1] > 1 and st[1] == 1


def pool_window(cupy: Any, x: Any, y: Any, *, mode: str, kernel: tuple[int, ...], strides: list[int], dilations: list[int],
                begin: list[int], end: list[int], count_include_pad: bool = False, p: float = 2.0) -> Any:
    """``y`` = the pooling of ``x`` (both logical ``(n, c, *spatial)``, any strides); returns ``y``."""
    total = y.size
    if total == 0:
        return y
    n, c, *out = y.shape
    od, oh, ow = _pad3(out, 1)
    idd, ih, iw = _pad3(x.shape[2:], 1)
    params = (
        x, y, np.int64(total), np.int32(c), np.int32(od), np.int32(oh), np.int32(ow), np.int32(_channels_last(y)),
        *(np.int64(s) for s in _strides5(x)), *(np.int64(s) for s in _strides5(y)),
        np.int32(idd), np.int32(ih), np.int32(iw),
        *(np.int32(v) for v in _pad3(kernel, 1)), *(np.int32(v) for v in _pad3(strides, 1)), *(np.int32(v) for v in _pad3(dilations, 1)),
        *(np.int32(v) for v in _pad3(begin, 0)), *(np.int32(v) for v in _pad3(end, 0)),
        np.int32(_MODES[mode]), np.int32(count_include_pad), np.float32(p),
    )
    blocks = min(math.ceil(total / _BLOCK), 65535 * 4)
    compiler.function(cupy, source(x.dtype), "pool_window")((blocks,), (_BLOCK,), params)
    return y


def pool_global(cupy: Any, x: Any, y: Any, *, mode: str) -> Any:
    """``y[n, c] = max / mean of x[n, c, ...]`` over all spatial positions (any memory format)."""
    n, c = x.shape[:2]
    length = math.prod(x.shape[2:])
    if y.size == 0:
        return y
    src = source(x.dtype)
    ys = elements(y.strides, y.itemsize)
    if x.flags.c_contiguous or length == 1:
        rows = n * c
        warp_rows = length <= 1024
        grid = (math.ceil(rows / (_BLOCK // 32)),) if warp_rows else (rows,)
        xin = x if x.flags.c_contiguous else cupy.ascontiguousarray(x)
        compiler.function(cupy, src, "pool_global_rows")(
            grid, (_BLOCK,), (xin, y, np.int64(rows), np.int64(length), np.int64(c), np.int64(ys[0]), np.int64(ys[1]),
                              np.int32(_MODES[mode]), np.int32(warp_rows)))
        return y
    xs = elements(x.strides, x.itemsize)
    spatial = xs[2:]
    # the spatial axes must be one strided run (packed channels-last: stride of the last = C)
    run_ok = all(spatial[i] == spatial[i + 1] * x.shape[3 + i] for i in range(len(spatial) - 1))
    if not run_ok:
        x = cupy.ascontiguousarray(x)
        return pool_global(cupy, x, y, mode=mode)
    compiler.function(cupy, src, "pool_global_cl")(
        (math.ceil(c / 32), n), (32, 8), (x, y, np.int64(c), np.int64(length), np.int64(xs[0]), np.int64(xs[1]), np.int64(spatial[-1]),
                                          np.int64(ys[0]), np.int64(ys[1]), np.int32(_MODES[mode])))
    return y


# ---------------------------------------------------------------------------------------------
# lowering


class PoolLaunch(Launch):
    """One pooling step: convpass's kernel or cuDNN's, into a new array or a placement."""

    supports_placement = True

    def __init__(self, plan: Any, index: int, cupy: Any, spec: dict[str, Any], use_cudnn: bool) -> None:
        step = plan.steps[index]
        self.use_cudnn = use_cudnn
        which = "cuDNN" if use_cudnn else "kernel"
        super().__init__(index, step.node, f"{step.node.op_type} ({which})", step.outputs[:1])
        self.dtype = np.dtype(plan.info(step.inputs[0])[1])
        self.cp = cupy
        self.x = step.inputs[0]
        self.spec = spec
        self.out_shape = tuple(plan.info(step.outputs[0])[0])
        self._cudnn: dict[tuple, Any] = {}

    def _output(self, env: list[Any], x: Any) -> Any:
        out = self.destination(env)
        if out is not None:
            return out
        from convpass import cudnn

        layout = "nhwc" if _channels_last(x) else "nchw"
        return cudnn.empty_like_layout(self.out_shape, x.dtype, layout)

    def run(self, env: list[Any]) -> None:
        x = env[self.x]
        y = self._output(env, x)
        s = self.spec
        if s["kind"] == "global":
            pool_global(self.cp, x, y, mode=s["mode"])
        elif self.use_cudnn:
            self._run_cudnn(x, y)
        else:
            pool_window(self.cp, x, y, mode=s["mode"], kernel=s["kernel"], strides=s["strides"], dilations=s["dilations"],
                        begin=s["begin"], end=s["end"], count_include_pad=s["count_include_pad"], p=s["p"])
        env[self.outputs[0]] = y

    def _run_cudnn(self, x: Any, y: Any) -> None:
        from convpass import cudnn
        from convpass.cudnn.pooling import PoolingDescriptors, pooling_forward

        s = self.spec
        xs, ys = elements(x.strides, x.itemsize), elements(y.strides, y.itemsize)
        key = (x.shape, xs, y.shape, ys, str(x.dtype))
        descs = self._cudnn.get(key)
        if descs is None:
            mode = "max" if s["mode"] == "max" else ("average_include_pad" if s["count_include_pad"] else "average_exclude_pad")
            descs = self._cudnn[key] = PoolingDescriptors(mode, s["kernel"], s["begin"], s["strides"], x.shape, xs, y.shape, ys, str(x.dtype))
        pooling_forward(descs, int(x.data.ptr), int(y.data.ptr), cudnn.get_handle().ptr)


def _cudnn_expressible(spec: dict[str, Any], rank: int) -> bool:
    """cuDNN's pooling computes this window pooling exactly (module docstring)."""
    if spec["kind"] != "window" or spec["mode"] == "lp" or rank not in (4, 5):
        return False
    if any(d != 1 for d in spec["dilations"]) or spec["begin"] != spec["end"]:
        return False
    # no ceil-mode tail: cuDNN's floor output size must be the ONNX one
    return all(
        (spec["in"][i] + 2 * spec["begin"][i] - spec["kernel"][i]) // spec["strides"][i] + 1 == spec["out"][i]
        for i in range(len(spec["kernel"]))
    )


def lower_pool(plan: Any, index: int, cupy: Any, host: Any, prefer: str = "auto") -> PoolLaunch | None:
    """A :class:`PoolLaunch` for plan step ``index`` when it is a pooling this module runs.

    ``host(device constant) -> numpy array`` reads constant inputs (ReduceMean's axes). ``prefer``: ``"auto"`` (cuDNN for the families in :data:`CUDNN_FAMILIES` where it expresses
    the problem), ``"cudnn"`` (wherever it does), ``"kernel"`` (never)."""
    step = plan.steps[index]
    node = step.node
    if node.domain != "" or step.outputs[0] < 0 or any(o >= 0 for o in step.outputs[1:]):
        return None  # MaxPool's Indices output: the op library
    info = plan.info(step.inputs[0])
    if info is None or np.dtype(info[1]) not in POOL_DTYPES or not 3 <= len(info[0]) <= 5:
        return None
    shape = tuple(info[0])
    rank = len(shape)
    op = node.op_type
    spec: dict[str, Any]
    if op in ("GlobalAveragePool", "GlobalMaxPool"):
        spec = {"kind": "global", "mode": "max" if op == "GlobalMaxPool" else "average"}
    elif op in ("ReduceMean", "ReduceMax"):
        axes = _reduce_axes(plan, step, rank, host)
        if axes != tuple(range(2, rank)) or not int(node.attr("keepdims", 1)):
            return None
        spec = {"kind": "global", "mode": "max" if op == "ReduceMax" else "average"}
    elif op in ("MaxPool", "AveragePool", "LpPool"):
        kernel = tuple(int(k) for k in node.attr("kernel_shape") or ())
        if len(kernel) != rank - 2 or node.attr("storage_order", 0):
            return None
        begin, end, strides, dilations, out = _pool_geometry(node, shape[2:], kernel)
        if op == "AveragePool" and node.opset < 19 and any(d != 1 for d in dilations):
            return None  # dilations on AveragePool exist from opset 19 on
        mode = {"MaxPool": "max", "AveragePool": "average", "LpPool": "lp"}[op]
        spec = {
            "kind": "window", "mode": mode, "kernel": kernel, "strides": strides, "dilations": dilations, "begin": begin, "end": end,
            "count_include_pad": bool(node.attr("count_include_pad", 0)), "p": float(node.attr("p", 2)), "in": shape[2:], "out": out,
        }
    else:
        return None
    family = "max" if spec["mode"] == "max" else "average"
    expressible = _cudnn_expressible(spec, rank)
    use_cudnn = expressible and (prefer == "cudnn" or (prefer == "auto" and family in CUDNN_FAMILIES))
    return PoolLaunch(plan, index, cupy, spec, use_cudnn)


def _reduce_axes(plan: Any, step: Any, rank: int, host: Any) -> tuple[int, ...] | None:
    node = step.node
    axes = node.attr("axes")
    if axes is None and len(step.inputs) > 1 and step.inputs[1] >= 0:
        const = plan.template[step.inputs[1]]
        if const is None:
            return None
        axes = np.asarray(host(const)).reshape(-1).tolist()
    if axes is None:
        return None
    return tuple(sorted(int(a) + rank if int(a) < 0 else int(a) for a in axes))

"""Window pooling for the cuda backend (MaxPool, AveragePool, LpPool), in the tensor's memory format.

The op library writes pooling as a padded copy of the input, a strided window view and a
reduction over it (AveragePool twice: once more over a tensor of ones for the divisor), and its
padding goes through ``cupy.pad``: several times slower than cuDNN (benchmarks/op_kernels.py). Each
pooling is one launch instead, on the input as it is stored (channels-first, channels-last, or a
slice of a Concat buffer: arrays are passed with their strides), writing its output where the plan
wants it:

* :class:`StripPool`, convpass's strip kernel, for 2-D max and average poolings (any pads, strides,
  dilations, ``ceil_mode``, ``count_include_pad``): the depthwise kernel's scheme, several outputs
  per thread and the window unrolled. It beat cuDNN's pooling on every case both run, in both
  layouts, alone (``benchmarks/op_kernels.py --only Pool``) and inside Inception-v3 (``convpass
  bench --profile-ops``), and ``pool_window`` where cuDNN has no form (ceil_mode)
  (docs/measurements/2026-11-23-runtime-between-convs.md);
* cuDNN's ``cudnnPoolingForward`` (:mod:`convpass.native.cudnn.pooling`) for the 3-D max and average
  poolings it expresses (symmetric pads, no dilation, no ceil-mode tail; :data:`CUDNN_FAMILIES`),
  and wherever ``pooling="cudnn"`` asks for it;
* ``pool_window``, convpass's generic kernel, for everything else ONNX allows: 1-D and 3-D windows
  cuDNN does not take, LpPool. The window geometry comes from the op library's
  :func:`~convpass.ops.nn._pool_geometry`, so all agree by construction;
  ``count_include_pad`` counts window positions inside the input and its explicit pads, never the
  ceil-mode tail; MaxPool propagates NaN. One thread per output element, threads ordered as the
  output's memory, 32-bit index arithmetic (outputs up to 2^31 elements).

Global pooling (GlobalAveragePool, GlobalMaxPool, and ReduceMean / ReduceMax over exactly the spatial
axes, with ``keepdims`` or without (``x.mean((2, 3))`` of an ECA gate): squeeze-excitation blocks
run one per block) is one launch too
(:func:`lower_global_pool`), in the input's memory format: a warp per ``(n, c)`` row for
channels-first inputs; for channels-last ones, a block per batch item and 32 channels whose threads
read 32 adjacent channels (coalesced) and stride over the positions, then reduce through shared
memory. Float32 accumulation; the max propagates NaN. Two measurements disagree
(docs/measurements/2026-11-23-runtime-between-convs.md): inside models (EfficientNet-B0's
squeeze-excitation poolings, MobileNetV3, GhostNet: ``convpass bench --profile-ops``) this kernel
took a third to two thirds of the op library's CuPy reduction; alone in a one-op model
(``benchmarks/op_kernels.py --only GlobalAveragePool``) CuPy's reduction was faster for some
shapes. The kernel is the default for what models run; why CuPy's reduction is slower inside them
is not known.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from convpass.kernels.launch import Launch
from convpass.native import nvrtc as compiler
from convpass.native.cuda import elements
from convpass.ops.nn import _pool_geometry

__all__ = ["CUDNN_FAMILIES", "MAX_ELEMENTS", "POOL_DTYPES", "GlobalPoolLaunch", "PoolLaunch", "StripPool", "global_pool", "lower_global_pool", "lower_pool",
           "pool_window"]

# Window poolings cuDNN runs where StripPool does not take them and cuDNN expresses them (3-D);
# pool_window was slower than cuDNN there (docs/measurements/2026-11-23-runtime-between-convs.md).
CUDNN_FAMILIES: frozenset[str] = frozenset({"max", "average"})
MAX_ELEMENTS = (1 << 31) - 1  # the kernel's 32-bit index arithmetic

_BLOCK = 256
# StripPool: outputs per thread (stride 1, larger strides), and the limits of its unrolled window
STRIP_OUTPUTS, STRIP_OUTPUTS_STRIDED = 4, 2
STRIP_MAX_SPAN, STRIP_MAX_TAPS = 48, 121

_SOURCE = r"""
#HEADER
#define NEG_INF __int_as_float(0xff800000)
#define FULL 0xffffffffu

// mode: 0 max, 1 average, 2 Lp
extern "C" __global__ void pool_window(
    const TYPE* __restrict__ x, TYPE* __restrict__ y, unsigned total,
    unsigned C, unsigned OD, unsigned OH, unsigned OW, int channels_last,
    long long xsn, long long xsc, long long xsd, long long xsh, long long xsw,
    long long ysn, long long ysc, long long ysd, long long ysh, long long ysw,
    int ID, int IH, int IW, int KD, int KH, int KW, int SD, int SH, int SW, int DD, int DH, int DW,
    int PD, int PH, int PW, int ED, int EH, int EW, int mode, int count_include_pad, float p)
{
    // 32-bit index arithmetic (the host keeps total below 2^31): 64-bit division is many times slower
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        unsigned r = i, n, c, od, oh, ow;
        if (channels_last) { c = r % C; r /= C; ow = r % OW; r /= OW; oh = r % OH; r /= OH; od = r % OD; n = r / OD; }
        else { ow = r % OW; r /= OW; oh = r % OH; r /= OH; od = r % OD; r /= OD; c = r % C; n = r / C; }
        const TYPE* xb = x + n * xsn + c * xsc;
        const int d0 = (int)od * SD - PD, h0 = (int)oh * SH - PH, w0 = (int)ow * SW - PW;
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
"""

_GLOBAL_SOURCE = r"""
#HEADER
#define NEG_INF __int_as_float(0xff800000)
#define FULL 0xffffffffu
#define ROWS 32

__device__ __forceinline__ float combine(float acc, float v, int mode) {
    return mode == 0 ? ((v != v || v > acc) ? v : acc) : acc + v;  // max keeps NaN, as NumPy's
}

// channels-first: one warp per (n, c) row of L elements (element stride xsl)
extern "C" __global__ void global_pool_rows(
    const TYPE* __restrict__ x, TYPE* __restrict__ y, unsigned rows, unsigned C, unsigned L,
    long long xsn, long long xsc, long long xsl, long long ysn, long long ysc, int mode)
{
    const unsigned row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (row >= rows) return;
    const unsigned n = row / C, c = row % C;
    const TYPE* xr = x + n * xsn + c * xsc;
    float acc = mode == 0 ? NEG_INF : 0.f;
    for (unsigned i = lane; i < L; i += 32) acc = combine(acc, LOAD(xr[i * xsl]), mode);
    for (int o = 16; o > 0; o >>= 1) acc = combine(acc, __shfl_xor_sync(FULL, acc, o), mode);
    if (lane == 0) y[n * ysn + c * ysc] = STORE(mode == 0 ? acc : acc / (float)L);
}

// channels-last: block (32 channels, ROWS position lanes) per (channel tile, n); channel stride 1
extern "C" __global__ void global_pool_channels_last(
    const TYPE* __restrict__ x, TYPE* __restrict__ y, unsigned C, unsigned L,
    long long xsn, long long xsl, long long ysn, long long ysc, int mode)
{
    __shared__ float part[ROWS][33];
    const unsigned n = blockIdx.y, c = blockIdx.x * 32 + threadIdx.x;
    float acc = mode == 0 ? NEG_INF : 0.f;
    if (c < C) {
        const TYPE* xb = x + n * xsn + c;
        for (unsigned i = threadIdx.y; i < L; i += ROWS) acc = combine(acc, LOAD(xb[i * xsl]), mode);
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        for (int r = 1; r < ROWS; ++r) acc = combine(acc, part[r][threadIdx.x], mode);
        y[n * ysn + c * ysc] = STORE(mode == 0 ? acc : acc / (float)L);
    }
}
"""

POOL_DTYPES = compiler.DTYPES
_MODES = {"max": 0, "average": 1, "lp": 2}
_GLOBAL_ENTRIES = ("global_pool_rows", "global_pool_channels_last")


def source(dtype: Any) -> compiler.KernelSource:
    return compiler.typed("pool", _SOURCE, ("pool_window",), dtype)


def global_source(dtype: Any) -> compiler.KernelSource:
    return compiler.typed("global_pool", _GLOBAL_SOURCE, _GLOBAL_ENTRIES, dtype)


def _flat_positions(a: Any) -> int | None:
    """The element stride that walks every spatial position of ``a`` (logical ``(n, c, *spatial)``)
    in order, or None when the positions are not one evenly strided run."""
    st = elements(a.strides, a.itemsize)[2:]
    dims = a.shape[2:]
    for k in range(len(dims) - 1):
        if dims[k] > 1 and st[k] != st[k + 1] * dims[k + 1]:
            return None
    return st[-1] if dims else 1


def global_pool(cupy: Any, x: Any, y: Any, mode: str) -> Any:
    """``y`` (``(n, c, 1, ..., 1)`` or ``(n, c)``) = the max or average of ``x`` over all its spatial positions."""
    n, c = x.shape[:2]
    length = math.prod(x.shape[2:])
    step = _flat_positions(x)
    if step is None or n * c == 0 or length == 0:
        raise ValueError(f"global pooling of a {x.shape} array with strides {x.strides}: positions not evenly strided")
    xs, ys = elements(x.strides, x.itemsize), elements(y.strides, y.itemsize)
    src = global_source(x.dtype)
    if _channels_last(x):
        fn = compiler.function(cupy, src, "global_pool_channels_last")
        fn((math.ceil(c / 32), n), (32, 32), (x, y, np.uint32(c), np.uint32(length), np.int64(xs[0]), np.int64(step),
                                             np.int64(ys[0]), np.int64(ys[1]), np.int32(_MODES[mode])))
    else:
        rows = n * c
        fn = compiler.function(cupy, src, "global_pool_rows")
        fn((math.ceil(rows / 8),), (256,), (x, y, np.uint32(rows), np.uint32(c), np.uint32(length), np.int64(xs[0]), np.int64(xs[1]),
                                            np.int64(step), np.int64(ys[0]), np.int64(ys[1]), np.int32(_MODES[mode])))
    return y


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
        x, y, np.uint32(total), np.uint32(c), np.uint32(od), np.uint32(oh), np.uint32(ow), np.int32(_channels_last(y)),
        *(np.int64(s) for s in _strides5(x)), *(np.int64(s) for s in _strides5(y)),
        np.int32(idd), np.int32(ih), np.int32(iw),
        *(np.int32(v) for v in _pad3(kernel, 1)), *(np.int32(v) for v in _pad3(strides, 1)), *(np.int32(v) for v in _pad3(dilations, 1)),
        *(np.int32(v) for v in _pad3(begin, 0)), *(np.int32(v) for v in _pad3(end, 0)),
        np.int32(_MODES[mode]), np.int32(count_include_pad), np.float32(p),
    )
    blocks = min(math.ceil(total / _BLOCK), 65535 * 4)
    compiler.function(cupy, source(x.dtype), "pool_window")((blocks,), (_BLOCK,), params)
    return y


_STRIP_SOURCE = r"""
#HEADER
#define NEG_INF __int_as_float(0xff800000)
extern "C" __global__ void pool_strip(
    const TYPE* __restrict__ x, TYPE* __restrict__ y, unsigned total, unsigned C, unsigned OH, unsigned strips,
    int H, int W, int OW, int PH, int PW, int EH, int EW,
    long long xsn, long long xsc, long long xsh, long long xsw, long long ysn, long long ysc, long long ysh, long long ysw)
{
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        unsigned r = i, n, c, oh, s;
        ORDER
        const int ow0 = (int)s * R;
        float acc[R];
        for (int j = 0; j < R; ++j) acc[j] = INIT;
        const TYPE* xb = x + n * xsn + c * xsc;
        const int ih0 = (int)oh * SH - PH, iw0 = ow0 * SW - PW;
        #pragma unroll
        for (int kh = 0; kh < KH; ++kh) {
            const int ih = ih0 + kh * DH;
            if (ih < 0 || ih >= H) continue;
            const TYPE* row = xb + ih * xsh;
            WINDOW
        }
        for (int j = 0; j < R; ++j) {
            const int ow = ow0 + j;
            if (ow >= OW) break;
            float v = acc[j];
            FINISH
            y[n * ysn + c * ysc + oh * ysh + ow * ysw] = STORE(v);
        }
    }
}
"""

# max: NaN sticks (as NumPy's max); positions outside the input are -inf, which changes nothing
_STRIP_COMBINE = {"max": "acc[{j}] = (v{u} != v{u} || v{u} > acc[{j}]) ? v{u} : acc[{j}];", "average": "acc[{j}] += v{u};"}
# the divisor of an average: window positions inside the input, or (count_include_pad) inside the
# input and its explicit pads; never the ceil-mode tail (as pool_window)
_STRIP_DIVISOR = """{{ int ch = 0, cw = 0;
              for (int kh = 0; kh < KH; ++kh) {{ const int ih = ih0 + kh * DH; ch += ih >= {lo_h} && ih < {hi_h}; }}
              for (int kw = 0; kw < KW; ++kw) {{ const int iw = ow * SW - PW + kw * DW; cw += iw >= {lo_w} && iw < {hi_w}; }}
              v = v / fmaxf((float)(ch * cw), 1.f); }}"""


@dataclasses.dataclass(frozen=True)
class StripPool:
    """convpass's 2-D window pooling for one geometry (max or average): the depthwise kernel's
    scheme (:mod:`convpass.kernels.depthwise`) with a max or a sum for the multiply-add. A thread computes ``r``
    horizontally adjacent outputs of one ``(n, c, oh)`` row and loads, per window row, the inputs
    they share once into registers; window size, strides, dilations, ``r``, the mode and the thread
    order (channels fastest for a channels-last output) are compile-time constants, the loops
    unroll. ``pool_window`` evaluates every output's window on its own, with run-time bounds."""

    mode: str  # "max" or "average"
    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilations: tuple[int, int]
    count_include_pad: bool
    channels_last: bool
    r: int

    @classmethod
    def for_spec(cls, spec: dict[str, Any], channels_last: bool) -> StripPool | None:
        """The kernel of a 2-D max or average pooling spec (:func:`lower_pool`), or None when it
        does not take it (LpPool, other ranks, a row window wider than :data:`STRIP_MAX_SPAN`)."""
        if spec["mode"] not in _STRIP_COMBINE or len(spec["kernel"]) != 2:
            return None
        kernel, strides, dilations = (tuple(int(v) for v in spec[k]) for k in ("kernel", "strides", "dilations"))
        r = STRIP_OUTPUTS if strides[1] == 1 else STRIP_OUTPUTS_STRIDED
        if (r - 1) * strides[1] + (kernel[1] - 1) * dilations[1] + 1 > STRIP_MAX_SPAN or math.prod(kernel) > STRIP_MAX_TAPS:
            return None
        return cls(spec["mode"], kernel, strides, dilations, bool(spec["count_include_pad"]) and spec["mode"] == "average", channels_last, r)  # type: ignore[arg-type]

    def source(self, dtype: Any) -> compiler.KernelSource:
        from convpass.kernels.depthwise import THREAD_ORDERS

        (kh, kw), (sh, sw), (dh, dw), r = self.kernel, self.strides, self.dilations, self.r
        pad_value = "NEG_INF" if self.mode == "max" else "0.f"
        used = sorted({j * sw + t * dw for j in range(r) for t in range(kw)})
        lines = [f"const float v{u} = (iw0 + {u} >= 0 && iw0 + {u} < W) ? LOAD(row[(iw0 + {u}) * xsw]) : {pad_value};" for u in used]
        lines += [_STRIP_COMBINE[self.mode].format(j=j, u=j * sw + t * dw) for t in range(kw) for j in range(r)]
        if self.mode == "max":
            finish = ""
        elif self.count_include_pad:
            finish = _STRIP_DIVISOR.format(lo_h="-PH", hi_h="H + EH", lo_w="-PW", hi_w="W + EW")
        else:
            finish = _STRIP_DIVISOR.format(lo_h="0", hi_h="H", lo_w="0", hi_w="W")
        constants = "".join(f"\n#define {k} {v}" for k, v in (("KH", kh), ("KW", kw), ("SH", sh), ("SW", sw), ("DH", dh), ("DW", dw), ("R", r),
                                                                ("INIT", pad_value)))
        code = (_STRIP_SOURCE.replace("#HEADER", "#HEADER" + constants, 1).replace("ORDER", THREAD_ORDERS[self.channels_last])
                .replace("WINDOW", "\n            ".join(lines)).replace("FINISH", finish))
        family = (f"pool_strip_{self.mode}{'_incl' if self.count_include_pad else ''}_k{kh}x{kw}_s{sh}x{sw}_d{dh}x{dw}_r{r}_"
                  f"{'nhwc' if self.channels_last else 'nchw'}")
        return compiler.typed(family, code, ("pool_strip",), dtype)

    def __call__(self, cupy: Any, x: Any, y: Any, begin: list[int], end: list[int]) -> Any:
        """``y`` = the pooling of ``x`` (logical ``(n, c, h, w)``, any strides); returns ``y``."""
        n, c, oh, ow = y.shape
        strips = -(-ow // self.r)
        total = n * c * oh * strips
        if total == 0:
            return y
        params = (
            x, y, np.uint32(total), np.uint32(c), np.uint32(oh), np.uint32(strips), np.int32(x.shape[2]), np.int32(x.shape[3]), np.int32(ow),
            np.int32(begin[0]), np.int32(begin[1]), np.int32(end[0]), np.int32(end[1]),
            *(np.int64(v) for v in elements(x.strides, x.itemsize)), *(np.int64(v) for v in elements(y.strides, y.itemsize)),
        )
        blocks = min(math.ceil(total / _BLOCK), 65535 * 8)
        compiler.function(cupy, self.source(x.dtype), "pool_strip")((blocks,), (_BLOCK,), params)
        return y


# ---------------------------------------------------------------------------------------------
# lowering


class _PoolingStep(Launch):
    """A pooling step's launch: one input ``x``, one output of ``out_shape``; ``which`` runs it."""

    def __init__(self, plan: Any, index: int, cupy: Any, which: str) -> None:
        step = plan.steps[index]
        super().__init__(index, step.node, f"{step.node.op_type} ({which})", step.outputs[:1])
        self.dtype = np.dtype(plan.info(step.inputs[0])[1])
        self.cp = cupy
        self.x = step.inputs[0]
        self.out_shape = tuple(plan.info(step.outputs[0])[0])


class PoolLaunch(_PoolingStep):
    """One pooling step: convpass's kernel or cuDNN's, into a new array or a placement."""

    supports_placement = True

    def __init__(self, plan: Any, index: int, cupy: Any, spec: dict[str, Any], use_cudnn: bool, strip: bool = False) -> None:
        super().__init__(plan, index, cupy, "cuDNN" if use_cudnn else ("strip kernel" if strip else "kernel"))
        self.use_cudnn = use_cudnn
        self.strip = strip
        self.spec = spec
        self._cudnn: dict[tuple, Any] = {}
        self._strips: dict[bool, StripPool] = {}  # by the output's memory order

    def _output(self, env: list[Any], x: Any) -> Any:
        from convpass.native import cudnn

        layout = "nhwc" if _channels_last(x) else "nchw"
        out = self.destination(env, layout)
        return out if out is not None else cudnn.empty_like_layout(self.out_shape, x.dtype, layout)

    def run(self, env: list[Any]) -> None:
        x = env[self.x]
        y = self._output(env, x)
        s = self.spec
        if self.use_cudnn:
            self._run_cudnn(x, y)
        elif self.strip:
            order = _channels_last(y)
            kernel = self._strips.get(order) or self._strips.setdefault(order, StripPool.for_spec(s, order))  # type: ignore[arg-type]
            kernel(self.cp, x, y, s["begin"], s["end"])
        else:
            pool_window(self.cp, x, y, mode=s["mode"], kernel=s["kernel"], strides=s["strides"], dilations=s["dilations"],
                        begin=s["begin"], end=s["end"], count_include_pad=s["count_include_pad"], p=s["p"])
        env[self.outputs[0]] = y

    def _run_cudnn(self, x: Any, y: Any) -> None:
        from convpass.native import cudnn
        from convpass.native.cudnn.pooling import PoolingDescriptors, pooling_forward

        s = self.spec
        xs, ys = elements(x.strides, x.itemsize), elements(y.strides, y.itemsize)
        key = (x.shape, xs, y.shape, ys, str(x.dtype))
        descs = self._cudnn.get(key)
        if descs is None:
            mode = "max" if s["mode"] == "max" else ("average_include_pad" if s["count_include_pad"] else "average_exclude_pad")
            descs = self._cudnn[key] = PoolingDescriptors(mode, s["kernel"], s["begin"], s["strides"], x.shape, xs, y.shape, ys, str(x.dtype))
        pooling_forward(descs, int(x.data.ptr), int(y.data.ptr), cudnn.get_handle().ptr)


class GlobalPoolLaunch(_PoolingStep):
    """One global pooling step (GlobalAveragePool / GlobalMaxPool, or a spatial ReduceMean / ReduceMax)
    in convpass's kernel; an input whose positions are not one evenly strided run
    is made contiguous first (never on the planned path: producers write packed arrays)."""

    def __init__(self, plan: Any, index: int, cupy: Any, mode: str) -> None:
        super().__init__(plan, index, cupy, "kernel")
        self.mode = mode

    def run(self, env: list[Any]) -> None:
        x = env[self.x]
        if _flat_positions(x) is None:
            x = self.cp.ascontiguousarray(x)
        env[self.outputs[0]] = global_pool(self.cp, x, self.cp.empty(self.out_shape, dtype=x.dtype), self.mode)


def lower_global_pool(plan: Any, index: int, cupy: Any, host: Any) -> GlobalPoolLaunch | None:
    """A :class:`GlobalPoolLaunch` for plan step ``index`` when it is a global pooling (module
    docstring); ``host(device constant)`` reads a ReduceMean's axes input."""
    step = plan.steps[index]
    node = step.node
    if node.domain != "" or not step.outputs or step.outputs[0] < 0:
        return None
    info, out = plan.info(step.inputs[0]), plan.info(step.outputs[0])
    if info is None or out is None or np.dtype(info[1]) not in POOL_DTYPES or not 3 <= len(info[0]) <= 5:
        return None
    rank = len(info[0])
    if node.op_type in ("GlobalAveragePool", "GlobalMaxPool"):
        mode = "max" if node.op_type == "GlobalMaxPool" else "average"
    elif node.op_type in ("ReduceMean", "ReduceMax"):
        axes = node.attr("axes")
        if len(step.inputs) > 1 and step.inputs[1] >= 0:
            const = plan.template[step.inputs[1]]
            if const is None:
                return None
            axes = [int(a) for a in np.asarray(host(const)).ravel()]
        if axes is None or sorted(a % rank for a in axes) != list(range(2, rank)):
            return None
        mode = "max" if node.op_type == "ReduceMax" else "average"
    else:
        return None
    pooled = (*info[0][:2], *(1,) * (rank - 2)) if node.op_type.startswith("Global") or node.attr("keepdims", 1) else tuple(info[0][:2])
    if tuple(out[0]) != pooled or math.prod(info[0][:2]) >= 1 << 31 or math.prod(info[0][2:]) >= 1 << 31:
        return None
    return GlobalPoolLaunch(plan, index, cupy, mode)


def _cudnn_expressible(spec: dict[str, Any], rank: int) -> bool:
    """cuDNN's pooling computes this window pooling exactly (module docstring)."""
    if spec["mode"] == "lp" or rank not in (4, 5):
        return False
    if any(d != 1 for d in spec["dilations"]) or spec["begin"] != spec["end"]:
        return False
    # no ceil-mode tail: cuDNN's floor output size must be the ONNX one
    return all(
        (spec["in"][i] + 2 * spec["begin"][i] - spec["kernel"][i]) // spec["strides"][i] + 1 == spec["out"][i]
        for i in range(len(spec["kernel"]))
    )


def lower_pool(plan: Any, index: int, cupy: Any, prefer: str = "auto") -> PoolLaunch | None:
    """A :class:`PoolLaunch` for plan step ``index`` when it is a window pooling this module runs.

    ``prefer``: ``"auto"`` (:class:`StripPool` where it takes the pooling, else cuDNN for the
    families in :data:`CUDNN_FAMILIES` where it expresses the problem), ``"cudnn"`` (wherever it
    does), ``"kernel"`` (convpass's kernels only: :class:`StripPool`, else ``pool_window``)."""
    step = plan.steps[index]
    node = step.node
    if node.domain != "" or node.op_type not in ("MaxPool", "AveragePool", "LpPool"):
        return None
    if step.outputs[0] < 0 or any(o >= 0 for o in step.outputs[1:]):
        return None  # MaxPool's Indices output: the op library
    info = plan.info(step.inputs[0])
    if info is None or np.dtype(info[1]) not in POOL_DTYPES or not 3 <= len(info[0]) <= 5:
        return None
    shape = tuple(info[0])
    rank = len(shape)
    kernel = tuple(int(k) for k in node.attr("kernel_shape") or ())
    if len(kernel) != rank - 2 or node.attr("storage_order", 0):
        return None
    begin, end, strides, dilations, out = _pool_geometry(node, shape[2:], kernel)
    if math.prod((*shape[:2], *out)) > MAX_ELEMENTS:
        return None
    mode = {"MaxPool": "max", "AveragePool": "average", "LpPool": "lp"}[node.op_type]
    spec = {
        "mode": mode, "kernel": kernel, "strides": strides, "dilations": dilations, "begin": begin, "end": end,
        "count_include_pad": bool(node.attr("count_include_pad", 0)), "p": float(node.attr("p", 2)), "in": shape[2:], "out": out,
    }
    family = "max" if mode == "max" else "average"
    strip = StripPool.for_spec(spec, False) is not None
    use_cudnn = _cudnn_expressible(spec, rank) and (prefer == "cudnn" or (prefer == "auto" and not strip and family in CUDNN_FAMILIES))
    return PoolLaunch(plan, index, cupy, spec, use_cudnn, strip=strip and not use_cudnn)

"""convpass's own depthwise convolution kernel: a tuning candidate beside cuDNN's algorithms.

cuDNN's kernels for depthwise convolutions (``groups == C == K``) run far above the memory bound
(ConvNeXt's 7x7 convs were most of its conv time; docs/measurements/2026-11-23-depthwise-kernel.md).
A depthwise conv reads each
input element ``KH * KW`` times from cache and does ``KH * KW`` multiply-adds per output: it is a
stencil, which a plain kernel runs near the memory bound. This one is a candidate the tuner times
and checks like any cuDNN algorithm (:data:`ALGO`); it runs only where it measured fastest.

Rules
-----
* **Where it applies** (:func:`unsupported` says why not): a forward 2-D convolution (1-D convs
  are mapped to 2-D, as for cuDNN) with ``groups == C == K``, float32 or float16 data (float32
  accumulation), a kernel of at most :data:`MAX_TAPS` taps and a row window of at most
  :data:`MAX_SPAN` inputs (:func:`candidates`: the variants the tuner times). Its math is plain
  FMA: exact float32 products, valid under every math mode.
* **One thread, one strip.** A thread computes ``R`` horizontally adjacent outputs of one
  ``(n, c, oh)`` row: per kernel row it loads the inputs its outputs share once into registers and
  does every multiply-add from there. ``R`` is part of the candidate's name
  (``convpass_depthwise_r8``): the tuner times the variants of :data:`STRIPS` and records the
  fastest. Threads are ordered as the output's memory: channels fastest for channels-last, strips
  fastest for channels-first, so neighbouring threads read neighbouring addresses. No shared
  memory, no cooperation between threads: the source also compiles as host C++ (the CPU tests run
  it against NumPy).
* **Any strides.** Input, weight, residual and output are passed with their element strides: the
  kernel reads a slice of a Concat buffer and writes into one, in either memory format. Its
  weights are read best tap-major in the channels-last order (:meth:`DepthwiseKernel.weight`:
  neighbouring threads are neighbouring channels); the tuner times and the executor runs that copy.
* **Epilogue in the kernel.** ``y = act(conv(x, w) + z + b)`` with the bias, the residual and the
  ReLU of a legacy epilogue (:mod:`convpass.core.fusion`) each optional: the tuner times the bare
  variants and the fastest with the problem's epilogue (``convpass_depthwise_r8+bias+relu``), the
  executor runs what was recorded.
* **One source per geometry.** Kernel size, strides, dilations, ``R`` and the thread order are
  compile-time constants (the loops unroll; the window loads are exact), so a model has one small
  source per distinct depthwise geometry, compiled ahead of time into its kernel side-car like
  every generated kernel.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from convpass.core.algo import Algo
from convpass.core.problem import ConvShape
from convpass.native import nvrtc as compiler
from convpass.native.cuda import elements

__all__ = ["ALGO", "MAX_SPAN", "MAX_TAPS", "THREAD_ORDERS", "DepthwiseKernel", "algo_name", "candidates", "strip_of", "unsupported"]

ALGO = "convpass_depthwise"  # the family's name; a candidate is ALGO + "_r<R>" (:func:`algo_name`)
MAX_TAPS = 121  # 11x11: the unrolled body stays small
MAX_SPAN = 48  # inputs of one kernel row a thread keeps in registers
# Outputs per thread the tuner tries, by horizontal stride: R = 8 was fastest for most stride-1
# convs (ConvNeXt's 7x7 among them), R = 4 for some 3x3 NCHW ones, and R = 2 or 4 at stride 2
# (docs/measurements/2026-11-23-depthwise-kernel.md).
STRIPS = {1: (4, 8)}
STRIPS_STRIDED = (2, 4)
_BLOCK = 256
_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16)}
_NAME = re.compile(re.escape(ALGO) + r"_r(\d+)")


def algo_name(r: int) -> str:
    """The algorithm name of the kernel computing ``r`` outputs per thread."""
    return f"{ALGO}_r{r}"


def strip_of(algo: str) -> int:
    """``R`` of a candidate's name (``convpass_depthwise_r8+bias`` -> 8); ValueError otherwise."""
    m = _NAME.fullmatch(Algo.parse(algo).name)
    if not m or int(m[1]) < 1:
        raise ValueError(f"{algo!r} is not a convpass depthwise kernel (expected e.g. {algo_name(4)!r})")
    return int(m[1])


def _span(shape: ConvShape, r: int) -> int:
    return (r - 1) * shape.strides[1] + (shape.kernel[1] - 1) * shape.dilations[1] + 1


def unsupported(shape: ConvShape, r: int = 1) -> str | None:
    """Why the kernel computing ``r`` outputs per thread cannot compute ``shape`` (None: it can)."""
    if shape.direction != "fwd":
        return f"it computes forward convolutions, not {shape.direction}"
    if shape.rank != 2:
        return "it computes 1-D and 2-D convolutions"
    if not (shape.groups == shape.c == shape.k and shape.groups > 1):
        return f"it computes depthwise convolutions (groups == C == K), not g={shape.groups}, C={shape.c}, K={shape.k}"
    if shape.dtype not in _DTYPES:
        return f"it computes float32 and float16, not {shape.dtype}"
    if math.prod(shape.kernel) > MAX_TAPS:
        return f"kernel {shape.kernel} has more than {MAX_TAPS} taps"
    if _span(shape, r) > MAX_SPAN:
        return f"a row window of {_span(shape, r)} inputs (strides x dilations) is more than {MAX_SPAN}"
    if shape.n * shape.c * shape.output_spatial[0] * math.ceil(shape.output_spatial[1] / r) >= 1 << 31:
        return "more than 2^31 output strips"
    return None


def candidates(shape: ConvShape) -> tuple[str, ...]:
    """The kernel's variants the tuner times for ``shape`` (none where it does not apply)."""
    width = shape.output_spatial[1] if shape.rank == 2 else 1
    rs = [r for r in STRIPS.get(shape.strides[-1], STRIPS_STRIDED) if r // 2 < width] or [1]  # strips at least half used
    return tuple(algo_name(r) for r in rs if unsupported(shape, r) is None)


_TEMPLATE = r"""
#HEADER
extern "C" __global__ void depthwise_conv(
    const TYPE* __restrict__ x, const TYPE* __restrict__ w, const TYPE* __restrict__ b, const TYPE* __restrict__ z,
    TYPE* __restrict__ y, unsigned total, unsigned C, unsigned OH, unsigned strips, int H, int W, int OW, int PH, int PW,
    long long xsn, long long xsc, long long xsh, long long xsw, long long wsc, long long wsh, long long wsw,
    long long ysn, long long ysc, long long ysh, long long ysw, long long zsn, long long zsc, long long zsh, long long zsw,
    int relu)
{
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        unsigned r = i, n, c, oh, s;
        ORDER
        const int ow0 = (int)s * R;
        float acc[R];
        for (int j = 0; j < R; ++j) acc[j] = 0.f;
        const TYPE* xb = x + n * xsn + c * xsc;
        const TYPE* wb = w + c * wsc;
        const int ih0 = (int)oh * SH - PH, iw0 = ow0 * SW - PW;
        #pragma unroll
        for (int kh = 0; kh < KH; ++kh) {
            const int ih = ih0 + kh * DH;
            if (ih < 0 || ih >= H) continue;
            const TYPE* row = xb + ih * xsh;
            const TYPE* wr = wb + kh * wsh;
            WINDOW
        }
        const float bias = b ? LOAD(b[c]) : 0.f;
        for (int j = 0; j < R; ++j) {
            const int ow = ow0 + j;
            if (ow >= OW) break;
            float v = acc[j] + bias;
            if (z) v += LOAD(z[n * zsn + c * zsc + oh * zsh + ow * zsw]);
            if (relu) v = v < 0.f ? 0.f : v;  // NaN stays NaN, as the executor's ReLU
            y[n * ysn + c * ysc + oh * ysh + ow * ysw] = STORE(v);
        }
    }
}
"""

_FUNCTIONS: dict[tuple[DepthwiseKernel, int], Any] = {}


def _or_null(a: Any) -> Any:
    """An optional array argument: the array, or a null pointer."""
    return np.uint64(0) if a is None else a


# How a thread's flat index splits into (n, c, oh, strip); shared with pooling's strip kernel
THREAD_ORDERS = {
    True: "c = r % C; r /= C; s = r % strips; r /= strips; oh = r % OH; n = r / OH;",  # channels fastest
    False: "s = r % strips; r /= strips; oh = r % OH; r /= OH; c = r % C; n = r / C;",  # strips fastest
}


@dataclasses.dataclass(frozen=True)
class DepthwiseKernel:
    """The kernel of one depthwise geometry in one memory format (see the module rules)."""

    shape: ConvShape
    channels_last: bool
    r: int = 4  # outputs per thread

    def __post_init__(self) -> None:
        why = unsupported(self.shape, self.r)
        if why is not None:
            raise ValueError(f"{algo_name(self.r)} cannot compute {self.shape}: {why}")

    @classmethod
    def of(cls, algo: str, shape: ConvShape, layout: str) -> DepthwiseKernel:
        """The kernel a recorded algorithm names, for ``shape`` in ``layout``; ValueError when it
        names none or cannot compute the shape."""
        return cls(shape, layout == "nhwc", strip_of(algo))

    @property
    def algo(self) -> str:
        return algo_name(self.r)

    def source(self) -> compiler.KernelSource:
        """The CUDA source of this geometry (its name carries the compile-time constants)."""
        (kh, kw), (sh, sw), (dh, dw) = self.shape.kernel, self.shape.strides, self.shape.dilations
        r = self.r
        used = sorted({j * sw + t * dw for j in range(r) for t in range(kw)})
        lines = [f"float v{u} = (iw0 + {u} >= 0 && iw0 + {u} < W) ? LOAD(row[(iw0 + {u}) * xsw]) : 0.f;" for u in used]
        for t in range(kw):
            lines.append(f"{{ const float wt = LOAD(wr[{t} * wsw]);")
            lines += [f"  acc[{j}] = fmaf(v{j * sw + t * dw}, wt, acc[{j}]);" for j in range(r)]
            lines.append("}")
        constants = "".join(f"\n#define {name} {value}" for name, value in (("KH", kh), ("SH", sh), ("SW", sw), ("DH", dh), ("R", r)))
        code = (_TEMPLATE.replace("#HEADER", "#HEADER" + constants, 1).replace("ORDER", THREAD_ORDERS[self.channels_last])
                .replace("WINDOW", "\n            ".join(lines)))
        family = f"depthwise_k{kh}x{kw}_s{sh}x{sw}_d{dh}x{dw}_r{r}_{'nhwc' if self.channels_last else 'nchw'}"
        return compiler.typed(family, code, ("depthwise_conv",), _DTYPES[self.shape.dtype])

    def weight(self, cupy: Any, w: Any) -> Any:
        """``w`` (logical ``(c, 1, kh, kw)``, any strides) as this kernel reads it fastest: for the
        channels-last thread order a tap-major copy (memory ``(kh, kw, c)``), seen as ``(c, 1, kh, kw)``,
        so that a warp's 32 neighbouring channels read one tap's weights from adjacent addresses
        instead of 32 addresses ``kh * kw`` elements apart; for the channels-first order (a warp's
        threads share ``c``: one broadcast read) ``w`` as it is. Called once per weight at plan
        time (the executor keeps it with the model's constants), never per launch."""
        if not self.channels_last:
            return w
        return cupy.ascontiguousarray(w.transpose(1, 2, 3, 0)).transpose(3, 0, 1, 2)

    def build(self, cupy: Any) -> Any:
        """The compiled entry point (from the model's kernel side-car when it has it), built once
        per device."""
        key = (self, int(cupy.cuda.runtime.getDevice()))
        fn = _FUNCTIONS.get(key)
        if fn is None:
            fn = _FUNCTIONS[key] = compiler.function(cupy, self.source(), "depthwise_conv")
        return fn

    def __call__(self, cupy: Any, x: Any, w: Any, y: Any, bias: Any = None, z: Any = None, relu: bool = False) -> Any:
        """``y = act(conv(x, w) + z + bias)`` (logical ``(n, c, h, w)`` arrays of any strides;
        ``w``: ``(c, 1, kh, kw)`` of any strides, fastest as :meth:`weight` gives it; ``bias``: None
        or a contiguous ``(c,)``); returns ``y``."""
        s = self.shape
        n, c, h, width = x.shape
        oh, ow = y.shape[2:]
        if (n, c) != (s.n, s.c) or (h, width) != s.spatial or (oh, ow) != s.output_spatial:
            raise ValueError(f"{ALGO}: arrays {x.shape} -> {y.shape} are not the geometry {s}")
        strips = math.ceil(ow / self.r)
        total = n * c * oh * strips
        if total == 0:
            return y
        zs = (0, 0, 0, 0) if z is None else elements(z.strides, z.itemsize)
        ws = elements(w.strides, w.itemsize)
        params = (
            x, w, _or_null(bias), _or_null(z), y, np.uint32(total), np.uint32(c), np.uint32(oh), np.uint32(strips),
            np.int32(h), np.int32(width), np.int32(ow), np.int32(s.pads[0]), np.int32(s.pads[1]),
            *(np.int64(v) for v in elements(x.strides, x.itemsize)), np.int64(ws[0]), np.int64(ws[2]), np.int64(ws[3]),
            *(np.int64(v) for v in elements(y.strides, y.itemsize)), *(np.int64(v) for v in zs), np.int32(bool(relu)),
        )
        blocks = min(math.ceil(total / _BLOCK), 65535 * 8)
        self.build(cupy)((blocks,), (_BLOCK,), params)
        return y

"""Hand-written CUDA kernels of the cuda backend, for ops CuPy would run as many kernels.

LayerNormalization over the last axis (``layer_norm``): the op library writes it as a dozen
NumPy-style calls (casts, two means, subtract, square, sqrt, reciprocal, multiply, add), each a
pass over the whole tensor; convnext_tiny runs 23 of them on large activations. Here one warp
normalizes one row: the mean, then the variance of the centred row (two passes, not
``E[x^2] - E[x]^2``, which cancels), both in float32 with warp shuffles, then the scaled and
shifted row in the tensor's dtype. The row is re-read from cache, not from DRAM, for rows up to
tens of KB. float32 and float16 tensors; float16 is computed in float32 as ONNX's default
``stash_type=1`` says.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["LAYER_NORM_DTYPES", "layer_norm", "layer_norm_kernel"]

_LAYER_NORM = r"""
#HEADER
extern "C" __global__ void convpass_layer_norm(const TYPE* __restrict__ x, const TYPE* __restrict__ g,
                                               const TYPE* __restrict__ b, TYPE* __restrict__ y,
                                               long long rows, int C, float eps, int has_bias) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;  // the whole warp: one row per warp
    const TYPE* xr = x + row * C;
    float s = 0.f;
    for (int c = lane; c < C; c += 32) s += LOAD(xr[c]);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const float mean = s / C;
    float v = 0.f;
    for (int c = lane; c < C; c += 32) { const float d = LOAD(xr[c]) - mean; v += d * d; }
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const float inv = 1.f / sqrtf(v / C + eps);
    TYPE* yr = y + row * C;
    for (int c = lane; c < C; c += 32) {
        float r = (LOAD(xr[c]) - mean) * inv * LOAD(g[c]);
        if (has_bias) r += LOAD(b[c]);
        yr[c] = STORE(r);
    }
}
"""

_VARIANTS = {
    np.dtype(np.float32): {"#HEADER": "", "TYPE": "float", "LOAD": "", "STORE": ""},
    np.dtype(np.float16): {"#HEADER": "#include <cuda_fp16.h>", "TYPE": "__half", "LOAD": "__half2float", "STORE": "__float2half_rn"},
}
LAYER_NORM_DTYPES = frozenset(_VARIANTS)
_ROWS_PER_BLOCK = 8  # warps of a 256-thread block
_KERNELS: dict[np.dtype, Any] = {}


def layer_norm_kernel(cupy: Any, dtype: Any) -> Any:
    """The compiled kernel for ``dtype`` (float32 or float16), built on first use."""
    dtype = np.dtype(dtype)
    k = _KERNELS.get(dtype)
    if k is None:
        code = _LAYER_NORM
        for token, text in _VARIANTS[dtype].items():
            code = code.replace(token, text)
        k = cupy.RawKernel(code, "convpass_layer_norm")
        k.compile()
        _KERNELS[dtype] = k
    return k


def layer_norm(cupy: Any, x: Any, scale: Any, bias: Any | None, eps: float) -> Any:
    """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last axis of ``x``; scale and bias of shape (C,)."""
    x = cupy.ascontiguousarray(x)
    c = int(x.shape[-1])
    rows = x.size // c if c else 0
    y = cupy.empty_like(x)
    if rows:
        scale = cupy.ascontiguousarray(scale.reshape(c))
        bias = scale if bias is None else cupy.ascontiguousarray(bias.reshape(c))
        grid = ((rows + _ROWS_PER_BLOCK - 1) // _ROWS_PER_BLOCK,)
        layer_norm_kernel(cupy, x.dtype)(
            grid, (32 * _ROWS_PER_BLOCK,), (x, scale, bias, y, np.int64(rows), np.int32(c), np.float32(eps), np.int32(bias is not scale))
        )
    return y

"""The NumPy / CuPy reference convolutions, and the call a backend's conv kernel gets.

Every Conv / ConvTranspose runs from its geometry (:class:`convpass.core.geometry.ConvGeometry`,
the one implementation of ONNX's padding and output rules, which the compiler reads too):
symmetric per-dimension pads (what cuDNN takes) plus ``extra_pads`` — for Conv a zero pre-pad of
the input, for ConvTranspose a crop of the output (negative: zeros ONNX adds) — and the ONNX output
shape, so the CPU reference executes exactly the plan the cuda backend executes.

The reference kernels work on any spatial rank (1-D, 2-D, 3-D) over an array namespace ``xp``:

* Conv: im2col through a strided view of the padded input, one batched matmul per group
  (chunked over the batch to bound memory, each chunk written into the one output array).
* ConvTranspose: one matmul to columns, then col2im by accumulating each kernel offset into the
  strided output positions it reaches (the backward-data computation cuDNN runs).

float16 / bfloat16 are computed in float32 and cast back, as cuDNN's pseudo-half configuration does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from convpass.core.geometry import ConvGeometry
from convpass.core.geometry import conv_geometry as _conv_geometry

_CHUNK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class ConvCall:
    """What a backend's conv kernel gets: the geometry and the decision recorded for it."""

    node_name: str
    geometry: ConvGeometry
    decision: Any = None  # annotation.ConvDecision, or None for an untuned conv
    profile: int | None = None  # index of the shape profile the decision belongs to


def _dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    return name if name in ("float32", "float16", "bfloat16") else "float32"


def conv_geometry(
    op_type: str,
    attrs: Mapping[str, Any],
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    dtype: Any = "float32",
    node_name: str = "<conv>",
) -> ConvGeometry:
    """The geometry of a conv node for concrete input shapes (:func:`convpass.core.geometry.conv_geometry`,
    the one implementation of ONNX's rules); a conv cuDNN cannot run has ``shapes == ()``, which
    the reference kernels run and a cuDNN backend runs on its reference path."""
    return _conv_geometry(op_type, attrs, tuple(int(d) for d in x_shape), tuple(int(d) for d in w_shape), _dtype_name(dtype), node_name)


# ---------------------------------------------------------------------------------------------
# reference kernels


def _compute_dtype(dtype: Any) -> Any:
    dt = np.dtype(dtype)
    return dt if dt == np.float64 else np.dtype(np.float32)


def _pad_or_crop(xp: Any, x: Any, begin: Sequence[int], end: Sequence[int]) -> Any:
    """Zero-pad (positive) or crop (negative) the spatial dims of an N, C, spatial... tensor."""
    if all(b == 0 for b in begin) and all(e == 0 for e in end):
        return x
    if min(*begin, *end) < 0:
        index = [slice(None), slice(None)]
        for i, (b, e) in enumerate(zip(begin, end)):
            size = x.shape[2 + i]
            index.append(slice(max(0, -b), size - max(0, -e)))
        x = x[tuple(index)]
    widths = [(0, 0), (0, 0)] + [(max(0, b), max(0, e)) for b, e in zip(begin, end)]
    return xp.pad(x, widths)


def conv_reference(xp: Any, x: Any, w: Any, b: Any, g: ConvGeometry) -> Any:
    """Forward convolution (ONNX Conv) with the geometry ``g``."""
    out_dtype = x.dtype
    ct = _compute_dtype(out_dtype)
    r = g.spatial_rank
    n, c = x.shape[:2]
    k = w.shape[0]
    groups = g.group
    cg, kg = c // groups, k // groups
    out_spatial = tuple(g.output_shape[2:])
    if x.size == 0 or math.prod(out_spatial) == 0:
        return xp.zeros((n, k, *out_spatial), dtype=out_dtype)
    x = _pad_or_crop(xp, x.astype(ct, copy=False), g.begin, g.end)
    x = xp.ascontiguousarray(x)
    wm = w.astype(ct, copy=False).reshape(groups, kg, cg * math.prod(g.kernel))
    kk = math.prod(g.kernel)
    p = math.prod(out_spatial)
    if cg == 1 and groups > 1:
        y = _depthwise(xp, x, wm, g, out_spatial, kg).reshape(n, k, *out_spatial)
        if b is not None:
            y = y + b.astype(ct, copy=False).reshape((1, k) + (1,) * r)
        return y.astype(out_dtype, copy=False)
    per_image = groups * cg * kk * p * x.itemsize
    if per_image > _CHUNK_BYTES and kk > 1:
        # one image's columns alone are too big (3-D video convs): accumulate per kernel offset
        y = _per_offset(xp, x, wm.reshape(groups, kg, cg, kk), g, out_spatial).reshape(n, k, *out_spatial)
        if b is not None:
            y = y + b.astype(ct, copy=False).reshape((1, k) + (1,) * r)
        return y.astype(out_dtype, copy=False)
    chunk = max(1, min(n, _CHUNK_BYTES // max(1, per_image)))
    y = xp.empty((n, groups, kg, p), dtype=ct)  # each chunk's product is written in place: no second copy of the output
    as_strided = xp.lib.stride_tricks.as_strided
    for start in range(0, n, chunk):
        xs = x[start : start + chunk]
        m = xs.shape[0]
        st = xs.strides
        view = as_strided(
            xs,
            shape=(m, c, *g.kernel, *out_spatial),
            strides=(
                st[0],
                st[1],
                *(st[2 + i] * g.dilations[i] for i in range(r)),
                *(st[2 + i] * g.strides[i] for i in range(r)),
            ),
        )
        cols = view.reshape(m, groups, cg * kk, p)
        xp.matmul(wm, cols, out=y[start : start + m])
    y = y.reshape(n, k, *out_spatial)
    if b is not None:
        y += b.astype(ct, copy=False).reshape((1, k) + (1,) * r)
    return y.astype(out_dtype, copy=False)


def _per_offset(xp: Any, x: Any, w4: Any, g: ConvGeometry, out_spatial: tuple[int, ...]) -> Any:
    """y[n, g, k, p] = sum over kernel offsets of w[g, k, c, offset] @ x_offset[n, g, c, p]."""
    n, c = x.shape[:2]
    groups, kg, cg = w4.shape[:3]
    p = math.prod(out_spatial)
    y = xp.zeros((n, groups, kg, p), dtype=x.dtype)
    for i, offset in enumerate(itertools.product(*(range(kv) for kv in g.kernel))):
        index = tuple(
            slice(o * g.dilations[d], o * g.dilations[d] + g.strides[d] * (out_spatial[d] - 1) + 1, g.strides[d])
            for d, o in enumerate(offset)
        )
        patch = x[(slice(None), slice(None), *index)].reshape(n, groups, cg, p)
        y += xp.matmul(w4[:, :, :, i], patch)
    return y


def _depthwise(xp: Any, x: Any, wm: Any, g: ConvGeometry, out_spatial: tuple[int, ...], kg: int) -> Any:
    """One input channel per group: accumulate each kernel offset's strided slice (no tiny matmuls)."""
    r = g.spatial_rank
    n, c = x.shape[:2]
    y = xp.zeros((n, c, kg, *out_spatial), dtype=x.dtype)
    for i, offset in enumerate(itertools.product(*(range(kv) for kv in g.kernel))):
        index = tuple(
            slice(o * g.dilations[d], o * g.dilations[d] + g.strides[d] * (out_spatial[d] - 1) + 1, g.strides[d])
            for d, o in enumerate(offset)
        )
        patch = x[(slice(None), slice(None), *index)]  # N, C, out...
        y += patch[:, :, None] * wm[:, :, i].reshape((1, c, kg) + (1,) * r)
    return y


def conv_transpose_reference(xp: Any, x: Any, w: Any, b: Any, g: ConvGeometry) -> Any:
    """Transposed convolution (ONNX ConvTranspose; cuDNN backward data) with the geometry ``g``."""
    out_dtype = x.dtype
    ct = _compute_dtype(out_dtype)
    r = g.spatial_rank
    n, c = x.shape[:2]
    groups = g.group
    cg = c // groups
    kg = w.shape[1]
    k = kg * groups
    in_spatial = tuple(x.shape[2:])
    out_spatial = tuple(g.output_shape[2:])
    kk = math.prod(g.kernel)
    full = tuple(g.strides[i] * (in_spatial[i] - 1) + (g.kernel[i] - 1) * g.dilations[i] + 1 for i in range(r))
    if x.size == 0 or math.prod(out_spatial) == 0:
        return xp.zeros((n, k, *out_spatial), dtype=out_dtype)
    wt = w.astype(ct, copy=False).reshape(groups, cg, kg * kk).transpose(0, 2, 1)
    xm = x.astype(ct, copy=False).reshape(n, groups, cg, math.prod(in_spatial))
    cols = xp.matmul(wt, xm).reshape(n, k, *g.kernel, *in_spatial)
    y = xp.zeros((n, k, *full), dtype=ct)
    for offset in itertools.product(*(range(kv) for kv in g.kernel)):
        target = tuple(
            slice(o * g.dilations[i], o * g.dilations[i] + g.strides[i] * (in_spatial[i] - 1) + 1, g.strides[i])
            for i, o in enumerate(offset)
        )
        y[(slice(None), slice(None), *target)] += cols[(slice(None), slice(None), *offset)]
    begin = g.begin
    end_crop = tuple(full[i] - begin[i] - out_spatial[i] for i in range(r))
    y = _pad_or_crop(xp, y, tuple(-v for v in begin), tuple(-v for v in end_crop))
    if b is not None:
        y = y + b.astype(ct, copy=False).reshape((1, k) + (1,) * r)
    return y.astype(out_dtype, copy=False)

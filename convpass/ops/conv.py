"""Convolution geometry and the NumPy reference kernels.

Every Conv / ConvTranspose runs from its *canonical geometry*: symmetric per-dimension pads (what
cuDNN takes) plus ``extra_pads`` — for Conv a zero pre-pad of the input, for ConvTranspose a crop
of the output — and the ONNX output shape. When ``convpass.compiler.passes.canonicalize_convs`` is
installed its ``canonicalize_conv`` computes that geometry, so the CPU reference executes exactly
the plan the cuda backend executes; otherwise :func:`onnx_geometry` derives the same from ONNX
semantics (auto_pad, output_padding, output_shape included).

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

from convpass.core.errors import ConvAttributeError
from convpass.core.problem import ConvShape
from convpass.core.errors import ExecutorError

from convpass.core.geometry import canonicalize_conv as _canonicalize_conv

_CHUNK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """The canonical plan of one conv for fixed input shapes (see the module docstring)."""

    op_type: str
    spatial_rank: int
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    group: int
    pads: tuple[int, ...]  # symmetric, per spatial dim
    extra_pads: tuple[int, ...]  # (begins..., ends...)
    output_shape: tuple[int, ...]  # ONNX output shape (N, K, spatial...)
    shapes: tuple[ConvShape, ...] = ()
    source: str = "onnx"  # "canonicalize_convs" or "onnx" (fallback derivation)

    @property
    def begin(self) -> tuple[int, ...]:
        """Total pad (Conv) / crop (ConvTranspose) at the start of each spatial dim."""
        r = self.spatial_rank
        return tuple(p + e for p, e in zip(self.pads, self.extra_pads[:r]))

    @property
    def end(self) -> tuple[int, ...]:
        r = self.spatial_rank
        return tuple(p + e for p, e in zip(self.pads, self.extra_pads[r:]))

    @property
    def problem(self) -> ConvShape | None:
        return self.shapes[0] if self.shapes else None


@dataclasses.dataclass(frozen=True)
class ConvCall:
    """What a backend's conv kernel gets: the geometry and the decision recorded for it."""

    node_name: str
    geometry: ConvGeometry
    decision: Any = None  # annotation.ConvDecision, or None for an untuned conv
    profile: int | None = None  # index of the shape profile the decision belongs to


def _ints(value: Any, n: int, default: int) -> tuple[int, ...]:
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return (default,) * n
    return tuple(int(v) for v in value)


def _auto_pad(attrs: Mapping[str, Any]) -> str:
    value = attrs.get("auto_pad", "NOTSET")
    if isinstance(value, bytes):
        value = value.decode()
    return value or "NOTSET"


def _dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    return name if name in ("float32", "float16", "bfloat16") else "float32"


def _as_2d(values: tuple[int, ...], fill: int) -> tuple[int, ...]:
    return (fill, *values) if len(values) == 1 else values


def _make_shape(direction: str, n: int, c: int, k: int, spatial, kernel, pads, strides, dilations, group, dtype) -> tuple[ConvShape, ...]:
    try:
        return (
            ConvShape(
                direction=direction,  # type: ignore[arg-type]
                n=n,
                c=c,
                k=k,
                spatial=_as_2d(tuple(spatial), 1),
                kernel=_as_2d(tuple(kernel), 1),
                pads=_as_2d(tuple(pads), 0),
                strides=_as_2d(tuple(strides), 1),
                dilations=_as_2d(tuple(dilations), 1),
                groups=group,
                dtype=_dtype_name(dtype),
            ),
        )
    except ValueError:
        return ()  # not expressible as a cuDNN problem (e.g. empty tensors); the reference still runs


def onnx_geometry(op_type: str, attrs: Mapping[str, Any], x_shape: Sequence[int], w_shape: Sequence[int], dtype: Any = "float32") -> ConvGeometry:
    """Canonical geometry derived from ONNX semantics (the fallback of :func:`conv_geometry`)."""
    x_shape = tuple(int(d) for d in x_shape)
    w_shape = tuple(int(d) for d in w_shape)
    r = len(x_shape) - 2
    if r < 1 or len(w_shape) != r + 2:
        raise ExecutorError(f"{op_type}: input rank {len(x_shape)} and weight rank {len(w_shape)} do not make a convolution")
    kernel = tuple(int(k) for k in (attrs.get("kernel_shape") or w_shape[2:]))
    strides = _ints(attrs.get("strides"), r, 1)
    dilations = _ints(attrs.get("dilations"), r, 1)
    group = int(attrs.get("group", 1) or 1)
    auto_pad = _auto_pad(attrs)
    pads_attr = _ints(attrs.get("pads"), 2 * r, 0)
    spatial = x_shape[2:]
    n = x_shape[0]
    if len(kernel) != r or len(strides) != r or len(dilations) != r or len(pads_attr) != 2 * r:
        raise ExecutorError(f"{op_type}: kernel_shape/strides/dilations/pads do not match {r} spatial dims")

    if op_type == "Conv":
        if x_shape[1] != w_shape[1] * group:
            raise ExecutorError(f"Conv: input has {x_shape[1]} channels, weight expects {w_shape[1]} x group {group}")
        begin, end = list(pads_attr[:r]), list(pads_attr[r:])
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            for i in range(r):
                out = -(-spatial[i] // strides[i])
                total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - spatial[i])
                small, big = total // 2, total - total // 2
                begin[i], end[i] = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
        elif auto_pad == "VALID":
            begin, end = [0] * r, [0] * r
        out_spatial = tuple(
            (spatial[i] + begin[i] + end[i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1 for i in range(r)
        )
        sym = tuple(max(0, min(b, e)) for b, e in zip(begin, end))
        extra = tuple(b - p for b, p in zip(begin, sym)) + tuple(e - p for e, p in zip(end, sym))
        k = w_shape[0]
        pre_padded = tuple(spatial[i] + extra[i] + extra[r + i] for i in range(r))
        shapes = _make_shape("fwd", n, x_shape[1], k, pre_padded, kernel, sym, strides, dilations, group, dtype)
        return ConvGeometry("Conv", r, kernel, strides, dilations, group, sym, extra, (n, k, *out_spatial), shapes)

    if op_type != "ConvTranspose":
        raise ExecutorError(f"not a convolution: {op_type}")
    if x_shape[1] != w_shape[0]:
        raise ExecutorError(f"ConvTranspose: input has {x_shape[1]} channels, weight has {w_shape[0]}")
    out_pad = _ints(attrs.get("output_padding"), r, 0)
    if len(out_pad) == 2 * r:  # some exporters write begins+ends; only ends grow the output
        out_pad = out_pad[r:]
    full = tuple(strides[i] * (spatial[i] - 1) + (kernel[i] - 1) * dilations[i] + 1 for i in range(r))
    out_shape_attr = attrs.get("output_shape")
    if out_shape_attr or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        # the crop that gives the asked-for output size, split as auto_pad says (extra at the end for SAME_UPPER)
        if out_shape_attr:
            out_spatial = tuple(int(v) for v in out_shape_attr)[-r:]
        else:
            out_spatial = tuple(spatial[i] * strides[i] for i in range(r))
        begin, end = [], []
        for i in range(r):
            total = full[i] + out_pad[i] - out_spatial[i]
            small, big = total // 2, total - total // 2
            b, e = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
            begin.append(b)
            end.append(e)
    else:
        begin, end = (list(pads_attr[:r]), list(pads_attr[r:])) if auto_pad != "VALID" else ([0] * r, [0] * r)
        out_spatial = tuple(full[i] + out_pad[i] - begin[i] - end[i] for i in range(r))
    # crop of the full (stride-dilated) result: begin at the start, end_crop at the end (< 0: zeros)
    end_crop = [full[i] - begin[i] - out_spatial[i] for i in range(r)]
    sym = tuple(max(0, min(begin[i], end_crop[i])) for i in range(r))
    extra = tuple(begin[i] - sym[i] for i in range(r)) + tuple(end_crop[i] - sym[i] for i in range(r))
    k_out = w_shape[1] * group
    # dgrad problem: forward conv x (the ConvTranspose output, before the extra crop) -> y (its input)
    x_spatial = tuple(out_spatial[i] + extra[i] + extra[r + i] for i in range(r))
    shapes: tuple[ConvShape, ...] = ()
    if min(extra, default=0) >= 0:
        shapes = _make_shape("dgrad", n, k_out, x_shape[1], x_spatial, kernel, sym, strides, dilations, group, dtype)
        if shapes and shapes[0].output_spatial[-r:] != spatial:
            shapes = ()
    return ConvGeometry(
        "ConvTranspose", r, kernel, strides, dilations, group, sym, extra, (n, k_out, *out_spatial), shapes
    )


def _from_canonical(c: Any) -> ConvGeometry:
    return ConvGeometry(
        op_type=str(c.op_type),
        spatial_rank=int(c.spatial_rank),
        kernel=tuple(int(v) for v in c.kernel),
        strides=tuple(int(v) for v in c.strides),
        dilations=tuple(int(v) for v in c.dilations),
        group=int(c.group),
        pads=tuple(int(v) for v in c.pads),
        extra_pads=tuple(int(v) for v in c.extra_pads),
        output_shape=tuple(int(v) for v in c.output_shape),
        shapes=tuple(c.shapes),
        source="canonicalize_convs",
    )


def conv_geometry(
    op_type: str,
    attrs: Mapping[str, Any],
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    dtype: Any = "float32",
    node_name: str = "<conv>",
) -> ConvGeometry:
    """The canonical geometry of a conv node for concrete input shapes.

    From :func:`convpass.core.geometry.canonicalize_conv`. Where it refuses a conv that ONNX
    defines (e.g. a ConvTranspose ``output_shape`` larger than the natural output, empty tensors,
    4-D convs) the geometry comes from :func:`onnx_geometry` with no cuDNN problem
    (``shapes == ()``): the reference kernels still run it, a cuDNN backend must run the reference
    path for it.
    """
    try:
        canonical = _canonicalize_conv(op_type, attrs, tuple(x_shape), tuple(w_shape), _dtype_name(dtype), node_name)
    except ConvAttributeError as refused:
        g = onnx_geometry(op_type, attrs, x_shape, w_shape, dtype)
        return dataclasses.replace(g, shapes=(), source=f"onnx (canonicalize_convs refused: {refused})")
    return _from_canonical(canonical)


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

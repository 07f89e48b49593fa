"""Resize and Upsample over ``xp``, and the geometry the GPU kernels share with them.

Nearest, linear and cubic resampling, one axis at a time: :func:`resize_arguments` reads a
node's attributes and inputs, :func:`resize_geometry` turns them into one table per resized axis
(:class:`ResizeGeometry`). The op here and the cuda backend's resize kernel
(:mod:`convpass.kernels.tensor_ops`) both read those tables, so they compute the same thing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from convpass.core.errors import ExecutorError
from convpass.ops.arrays import _axis, _like
from convpass.ops.registry import NodeInfo, OpContext, register

# ---------------------------------------------------------------------------------------------
# resize


def _source_coords(mode: str, out_len: int, in_len: int, scale: float, roi: tuple[float, float] | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Output index -> input coordinate (ONNX coordinate_transformation_mode), and extrapolation mask."""
    y = np.arange(out_len, dtype=np.float64)
    out_w = scale * in_len
    outside = None
    if mode == "align_corners":
        x = np.zeros(out_len) if out_w == 1 else y * (in_len - 1) / (out_w - 1)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_half_pixel_for_nn":
        x = (y + 0.5) / scale
    elif mode == "tf_crop_and_resize":
        if roi is None:
            raise ExecutorError("Resize: tf_crop_and_resize needs roi")
        start, end = roi
        if out_w == 1:
            x = np.full(out_len, (end - start) * (in_len - 1) / 2)
        else:
            x = y * (end - start) * (in_len - 1) / (out_w - 1)
        x = x + start * (in_len - 1)
        outside = (x < 0) | (x > in_len - 1)
    elif mode == "pytorch_half_pixel":
        x = np.full(out_len, -0.5) if out_w == 1 else (y + 0.5) / scale - 0.5
    elif mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif mode == "half_pixel_symmetric":
        adjustment = out_len / out_w
        offset = in_len / 2 * (1 - adjustment)
        x = offset + (y + 0.5) / scale - 0.5
    else:
        raise ExecutorError(f"Resize: coordinate_transformation_mode {mode!r} is not supported")
    return x, outside


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    x = np.abs(x)
    return np.where(
        x <= 1,
        ((a + 2) * x - (a + 3)) * x * x + 1,
        np.where(x < 2, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0),
    )


@functools.lru_cache(maxsize=256)
def _resize_axis(
    mode: str,
    coord_mode: str,
    nearest_mode: str,
    in_len: int,
    out_len: int,
    scale: float,
    roi: tuple[float, float] | None,
    cubic_a: float,
    exclude_outside: bool,
    antialias: bool,
    dtype: str = "float32",
) -> tuple[str, np.ndarray, np.ndarray | None]:
    """('index', indices, outside) for nearest, ('matrix', M[in, out] in ``dtype``, outside) otherwise.

    Cached: the same arrays come back for the same resize, so backends upload them once.
    """
    x, outside = _source_coords(coord_mode, out_len, in_len, scale, roi)
    base = np.ceil(x).astype(np.int64) - 1  # left neighbour; ratio in (0, 1]
    ratio = x - base
    if mode == "nearest":
        if nearest_mode == "simple":  # Upsample / Resize-10
            idx = np.ceil(x) if scale < 1 else np.floor(x)
            idx = idx.astype(np.int64)
        else:
            integer = ratio == 1.0
            if nearest_mode == "round_prefer_floor":
                up = ratio > 0.5
            elif nearest_mode == "round_prefer_ceil":
                up = ratio >= 0.5
            elif nearest_mode == "floor":
                up = np.zeros_like(integer)
            elif nearest_mode == "ceil":
                up = np.ones_like(integer)
            else:
                raise ExecutorError(f"Resize: nearest_mode {nearest_mode!r} is not supported")
            idx = base + (up | integer)
        return "index", np.clip(idx, 0, in_len - 1), outside
    s = min(scale, 1.0) if antialias else 1.0
    if mode == "linear":
        start = int(np.floor(-1 / s) + 1)
        offsets = np.arange(start, 2 - start)
        coeffs = np.clip(1 - np.abs((offsets[None, :] - ratio[:, None]) * s), 0, 1)
    elif mode == "cubic":
        start = int(np.floor(-2 / s) + 1)
        offsets = np.arange(start, 2 - start)
        coeffs = _cubic((offsets[None, :] - ratio[:, None]) * s, cubic_a)
    else:
        raise ExecutorError(f"Resize: mode {mode!r} is not supported")
    if antialias:
        coeffs = coeffs / coeffs.sum(axis=1, keepdims=True)
    idx = base[:, None] + offsets[None, :]
    if exclude_outside:
        coeffs = np.where((idx < 0) | (idx >= in_len), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    matrix = np.zeros((out_len, in_len), dtype=np.float64)
    rows = np.repeat(np.arange(out_len), idx.shape[1])
    np.add.at(matrix, (rows, np.clip(idx, 0, in_len - 1).reshape(-1)), coeffs.reshape(-1))
    return "matrix", np.ascontiguousarray(matrix.T.astype(dtype)), outside


@dataclasses.dataclass(frozen=True)
class ResizeGeometry:
    """How a Resize / Upsample maps ``in_shape`` to ``out_shape``.

    ``axes``: per axis that changes, in order, ``(axis, kind, table, outside)`` from
    :func:`_resize_axis` (``kind`` "index" for nearest, "matrix" for linear / cubic, "empty" when
    the axis has no elements), in the compute dtype. The op library applies them axis by axis; the
    cuda backend's resize kernel (:mod:`convpass.kernels.tensor_ops`) reads the same tables.
    """

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    mode: str
    axes: tuple[tuple[int, str, Any, Any], ...]
    compute_dtype: np.dtype
    extrapolation_value: float

    @property
    def extrapolates(self) -> bool:
        return any(outside is not None and outside.any() for _, _, _, outside in self.axes)


def resize_arguments(node: NodeInfo, values: Sequence[Any]) -> dict[str, Any]:
    """The resampling arguments of a Resize / Upsample node: ``mode``, ``coord_mode``,
    ``nearest_mode``, ``scales``, ``sizes``, ``roi``, ``axes``; ``values`` are its inputs as host
    arrays (``values[0]``, the data, is not read; absent inputs None)."""
    def get(i: int) -> Any:
        v = values[i] if i < len(values) else None
        return None if v is None or np.asarray(v).size == 0 else np.asarray(v).reshape(-1)

    mode = node.attr("mode", "nearest")
    since = node.impl.since if node.impl is not None else node.opset
    if node.op_type == "Upsample" or since < 11:
        mode = "linear" if mode == "bilinear" else mode
        scales = node.attr("scales") if node.op_type == "Upsample" and since < 9 else get(1)
        return {"mode": mode, "coord_mode": "asymmetric", "nearest_mode": "simple", "roi": None, "sizes": None,
                "scales": None if scales is None else [float(v) for v in scales], "axes": None}
    if mode not in ("nearest", "linear", "cubic"):
        raise ExecutorError(f"node {node.name!r}: Resize mode {mode!r} is not supported")
    roi, scales, sizes = get(1), get(2), get(3)
    return {
        "mode": mode,
        "coord_mode": node.attr("coordinate_transformation_mode", "half_pixel"),
        "nearest_mode": node.attr("nearest_mode", "round_prefer_floor"),
        "roi": None if roi is None else [float(v) for v in roi],
        "scales": None if scales is None else [float(v) for v in scales],
        "sizes": None if sizes is None else [int(v) for v in sizes],
        "axes": node.attr("axes"),
    }


def resize_geometry(
    node: NodeInfo,
    shape: tuple[int, ...],
    dtype: Any,
    *,
    scales: list[float] | None,
    sizes: list[int] | None,
    roi: list[float] | None,
    mode: str,
    coord_mode: str,
    nearest_mode: str,
    axes: list[int] | None = None,
) -> ResizeGeometry:
    """The :class:`ResizeGeometry` of a Resize / Upsample on an input of ``shape`` (ONNX semantics)."""
    r = len(shape)
    shape = tuple(int(d) for d in shape)
    axes = list(range(r)) if axes is None else [_axis(a, r) for a in axes]
    full_scales = [1.0] * r
    out = list(shape)
    full_roi: list[tuple[float, float] | None] = [None] * r
    if roi is not None and len(roi) == 2 * len(axes):
        for i, a in enumerate(axes):
            full_roi[a] = (float(roi[i]), float(roi[len(axes) + i]))
    if sizes is not None:
        for i, a in enumerate(axes):
            out[a] = int(sizes[i])
            full_scales[a] = out[a] / shape[a] if shape[a] else 1.0
        policy = node.attr("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            ratios = [full_scales[a] for a in axes]
            s = min(ratios) if policy == "not_larger" else max(ratios)
            for a in axes:
                full_scales[a] = s
                out[a] = int(s * shape[a] + 0.5)
    elif scales is not None:
        for i, a in enumerate(axes):
            full_scales[a] = float(scales[i])
            out[a] = int(math.floor(shape[a] * full_scales[a]))
    else:
        raise ExecutorError(f"node {node.name!r}: Resize needs scales or sizes")
    ct = np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)
    cubic_a = float(node.attr("cubic_coeff_a", -0.75))
    exclude = bool(node.attr("exclude_outside", 0))
    antialias = bool(node.attr("antialias", 0))
    steps = []
    for a in range(r):
        if out[a] == shape[a] and math.isclose(full_scales[a], 1.0) and (
            full_roi[a] is None or (math.isclose(full_roi[a][0], 0.0) and math.isclose(full_roi[a][1], 1.0))
        ):
            continue
        if out[a] == 0 or shape[a] == 0:
            steps.append((a, "empty", None, None))
            continue
        kind, table, outside = _resize_axis(
            mode, coord_mode, nearest_mode, shape[a], out[a], full_scales[a], full_roi[a], cubic_a, exclude, antialias, ct.name
        )
        steps.append((a, kind, table, outside))
    return ResizeGeometry(shape, tuple(out), mode, tuple(steps), ct, float(node.attr("extrapolation_value", 0.0)))


def _resize(ctx: OpContext, node: NodeInfo, x: Any, values: Sequence[Any]) -> Any:
    xp = ctx.xp
    g = resize_geometry(node, tuple(x.shape), x.dtype, **resize_arguments(node, values))
    r = x.ndim
    dtype = x.dtype
    y = x if g.mode == "nearest" else x.astype(g.compute_dtype, copy=False)
    outside_total = None
    for a, kind, table, outside in g.axes:
        if kind == "empty":
            new_shape = list(y.shape)
            new_shape[a] = g.out_shape[a]
            y = xp.zeros(new_shape, dtype=y.dtype)
            continue
        if kind == "index":
            y = xp.take(y, ctx.backend.constant(table), axis=a)
        else:
            m = ctx.backend.constant(table)
            y = xp.moveaxis(xp.matmul(xp.moveaxis(y, a, -1), m), -1, a)
        if outside is not None and outside.any():
            mask = outside.reshape([g.out_shape[a] if i == a else 1 for i in range(r)])
            outside_total = mask if outside_total is None else (outside_total | mask)
    if outside_total is not None:  # tf_crop_and_resize only
        y = xp.where(ctx.backend.constant(outside_total), _like(xp, g.extrapolation_value, y.dtype), y)
    if y.dtype != dtype:
        if np.dtype(dtype).kind in "iu":
            info = np.iinfo(dtype)
            y = xp.clip(xp.round(y), info.min, info.max)
        y = y.astype(dtype)
    return xp.ascontiguousarray(y)


def _host_values(ctx: OpContext, inputs: Sequence[Any]) -> list[Any]:
    return [None, *(None if v is None else ctx.host(v) for v in inputs)]


@register("Resize", 10, value_inputs=(1,))
def _resize_10(ctx: OpContext, node: NodeInfo, x: Any, scales: Any) -> Any:
    return _resize(ctx, node, x, _host_values(ctx, [scales]))


@register("Resize", 11, value_inputs=(1, 2, 3))
def _resize_11(ctx: OpContext, node: NodeInfo, x: Any, roi: Any = None, scales: Any = None, sizes: Any = None) -> Any:
    return _resize(ctx, node, x, _host_values(ctx, [roi, scales, sizes]))


@register("Upsample", 7)
def _upsample_7(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    return _resize(ctx, node, x, [None])


@register("Upsample", 9, value_inputs=(1,))
def _upsample_9(ctx: OpContext, node: NodeInfo, x: Any, scales: Any) -> Any:
    return _resize(ctx, node, x, _host_values(ctx, [scales]))

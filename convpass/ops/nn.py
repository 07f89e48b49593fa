"""Neural-network ops: convolution, pooling, normalization, pad (resize: :mod:`convpass.ops.resize`).

Conv / ConvTranspose (standard and ``ai.convpass`` domain) go through the backend's conv kernels
with the canonical geometry (:mod:`convpass.ops.conv`), prepared once per static plan.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from convpass.core import annotation
from convpass.core.errors import ExecutorError
from convpass.core.layout import storage_order
from convpass.ops.arrays import _axes, _axis, _like, acc
from convpass.ops.conv import ConvCall, conv_geometry
from convpass.ops.registry import NodeInfo, OpContext, register

# ---------------------------------------------------------------------------------------------
# convolution


def prepare_conv(node: NodeInfo, shapes: list[tuple[int, ...] | None], dtypes: list[Any]) -> ConvCall:
    """Canonical geometry of a conv node for fixed input shapes (decision attached by the executor)."""
    if shapes[0] is None or shapes[1] is None:
        raise ExecutorError(f"node {node.name!r}: {node.op_type} needs X and W")
    try:
        geometry = conv_geometry(node.op_type, node.attrs, shapes[0], shapes[1], dtypes[0], node.name)
    except ExecutorError as e:
        raise ExecutorError(f"node {node.name!r}: {e}") from None
    except ValueError as e:
        raise ExecutorError(f"node {node.name!r}: {node.op_type} with input {shapes[0]} and weight {shapes[1]}: {e}") from None
    return ConvCall(node.name, geometry)


def _call(node: NodeInfo, x: Any, w: Any) -> ConvCall:
    if node.prepared is not None:
        return node.prepared
    return prepare_conv(node, [tuple(x.shape), tuple(w.shape)], [x.dtype, w.dtype])


@register("Conv", 1, prepare=prepare_conv)
@register("Conv", annotation.DOMAIN_VERSION, domain=annotation.DOMAIN, prepare=prepare_conv)
def _conv(ctx: OpContext, node: NodeInfo, x: Any, w: Any, b: Any = None) -> Any:
    return ctx.backend.conv(x, w, b, _call(node, x, w))


@register("ConvTranspose", 1, prepare=prepare_conv)
@register("ConvTranspose", annotation.DOMAIN_VERSION, domain=annotation.DOMAIN, prepare=prepare_conv)
def _conv_transpose(ctx: OpContext, node: NodeInfo, x: Any, w: Any, b: Any = None) -> Any:
    return ctx.backend.conv_transpose(x, w, b, _call(node, x, w))


# ---------------------------------------------------------------------------------------------
# pooling


def _pool_geometry(node: NodeInfo, spatial: tuple[int, ...], kernel: tuple[int, ...]) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(begin pads, end pads, strides, dilations, output sizes) of a pooling node."""
    r = len(spatial)
    strides = list(node.attr("strides") or [1] * r)
    dilations = list(node.attr("dilations") or [1] * r)
    pads = list(node.attr("pads") or [0] * (2 * r))
    ceil_mode = bool(node.attr("ceil_mode", 0))
    auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
    begin, end, out = [0] * r, [0] * r, [0] * r
    for i in range(r):
        window = (kernel[i] - 1) * dilations[i] + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out[i] = -(-spatial[i] // strides[i])
            total = max(0, (out[i] - 1) * strides[i] + window - spatial[i])
            small, big = total // 2, total - total // 2
            begin[i], end[i] = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
        else:
            if auto_pad != "VALID":
                begin[i], end[i] = pads[i], pads[r + i]
            span = spatial[i] + begin[i] + end[i] - window
            if ceil_mode:
                out[i] = -(-span // strides[i]) + 1
                # the last window must start inside the input or its left padding
                if (out[i] - 1) * strides[i] >= spatial[i] + begin[i]:
                    out[i] -= 1
            else:
                out[i] = span // strides[i] + 1
    return begin, end, strides, dilations, out


def _windows(xp: Any, x: Any, begin: list[int], end: list[int], strides: list[int], dilations: list[int], out: list[int], kernel: tuple[int, ...], fill: Any) -> Any:
    """A (N, C, *out, *kernel) view of x padded with ``fill`` (ceil-mode tail included)."""
    r = len(kernel)
    need_end = [
        max(end[i], (out[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - x.shape[2 + i] - begin[i]) for i in range(r)
    ]
    widths = [(0, 0), (0, 0)] + [(begin[i], need_end[i]) for i in range(r)]
    if any(w != (0, 0) for w in widths):
        x = xp.pad(x, widths, mode="constant", constant_values=fill)
    x = xp.ascontiguousarray(x)
    st = x.strides
    return xp.lib.stride_tricks.as_strided(
        x,
        shape=(*x.shape[:2], *out, *kernel),
        strides=(st[0], st[1], *(st[2 + i] * strides[i] for i in range(r)), *(st[2 + i] * dilations[i] for i in range(r))),
    )


def _kernel(node: NodeInfo, x: Any) -> tuple[int, ...]:
    k = node.attr("kernel_shape")
    if not k:
        raise ExecutorError(f"node {node.name!r}: {node.op_type} needs kernel_shape")
    return tuple(int(v) for v in k)


def _min_value(dtype: Any) -> Any:
    dt = np.dtype(dtype)
    return -np.inf if dt.kind == "f" else np.iinfo(dt).min


@register("MaxPool")
def _max_pool(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    kernel = _kernel(node, x)
    r = len(kernel)
    begin, end, strides, dilations, out = _pool_geometry(node, tuple(x.shape[2:]), kernel)
    view = _windows(xp, x, begin, end, strides, dilations, out, kernel, _min_value(x.dtype))
    axes = tuple(range(2 + r, 2 + 2 * r))
    y = xp.max(view, axis=axes)
    if len(node.outputs) < 2 or not node.outputs[1]:
        return y
    # Indices: flat position in the (unpadded) input, row-major (storage_order 0) or column-major
    n, c = x.shape[:2]
    flat = view.reshape(*view.shape[: 2 + r], -1)
    arg = xp.argmax(flat, axis=-1)
    offs = np.unravel_index(np.arange(math.prod(kernel)), kernel)
    coords = []
    for i in range(r):
        k_off = ctx.backend.constant(offs[i])[arg]
        o = xp.arange(out[i]).reshape([out[i] if j == i else 1 for j in range(r)])
        coords.append(o * strides[i] - begin[i] + k_off * dilations[i])
    spatial = x.shape[2:]
    if node.attr("storage_order", 0):
        lin = coords[-1] * 0
        mult = 1
        for i in range(r):
            lin = lin + coords[i] * mult
            mult *= spatial[i]
    else:
        lin = coords[0] * 0
        for i in range(r):
            lin = lin * spatial[i] + coords[i]
    base = (xp.arange(n * c).reshape(n, c) * int(math.prod(spatial))).reshape((n, c) + (1,) * r)
    return y, (lin + base).astype(np.int64)


@register("AveragePool")
def _average_pool(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    kernel = _kernel(node, x)
    r = len(kernel)
    begin, end, strides, dilations, out = _pool_geometry(node, tuple(x.shape[2:]), kernel)
    xf = acc(x)
    axes = tuple(range(2 + r, 2 + 2 * r))
    total = xp.sum(_windows(xp, xf, begin, end, strides, dilations, out, kernel, 0), axis=axes)
    # divisor: window elements inside the input (+ explicit pads when count_include_pad)
    if node.attr("count_include_pad", 0):
        ones = xp.ones((1, 1, *(x.shape[2 + i] + begin[i] + end[i] for i in range(r))), dtype=xf.dtype)
        count = xp.sum(_windows(xp, ones, [0] * r, [0] * r, strides, dilations, out, kernel, 0), axis=axes)
    else:
        ones = xp.ones((1, 1, *x.shape[2:]), dtype=xf.dtype)
        count = xp.sum(_windows(xp, ones, begin, end, strides, dilations, out, kernel, 0), axis=axes)
    return (total / xp.maximum(count, _like(xp, 1, count.dtype))).astype(x.dtype, copy=False)


@register("LpPool")
def _lp_pool(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    kernel = _kernel(node, x)
    r = len(kernel)
    p = node.attr("p", 2)
    begin, end, strides, dilations, out = _pool_geometry(node, tuple(x.shape[2:]), kernel)
    xf = acc(x)
    view = _windows(xp, xp.power(xp.abs(xf), p), begin, end, strides, dilations, out, kernel, 0)
    return xp.power(xp.sum(view, axis=tuple(range(2 + r, 2 + 2 * r))), 1.0 / p).astype(x.dtype, copy=False)


@register("GlobalAveragePool")
def _global_average_pool(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    axes = tuple(range(2, x.ndim))
    return ctx.xp.mean(acc(x), axis=axes, keepdims=True).astype(x.dtype, copy=False)


@register("GlobalMaxPool")
def _global_max_pool(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    return ctx.xp.max(x, axis=tuple(range(2, x.ndim)), keepdims=True)


@register("GlobalLpPool", 2)
def _global_lp_pool(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    p = node.attr("p", 2)
    xf = acc(x)
    s = ctx.xp.sum(ctx.xp.power(ctx.xp.abs(xf), p), axis=tuple(range(2, x.ndim)), keepdims=True)
    return ctx.xp.power(s, 1.0 / p).astype(x.dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# normalization


def _channel_shape(param: Any, x: Any) -> tuple[int, ...]:
    if param.ndim > 1:  # opset < 9 per-activation (spatial=0) parameters: C x spatial
        return (1, *param.shape)
    return (1, -1) + (1,) * (x.ndim - 2)


@register("BatchNormalization", 1)
def _batch_norm(ctx: OpContext, node: NodeInfo, x: Any, scale: Any, bias: Any, mean: Any, var: Any) -> Any:
    xp = ctx.xp
    eps = node.attr("epsilon", 1e-5)
    dtype = x.dtype
    xf = acc(x)
    training = bool(node.attr("training_mode", 0)) and node.opset >= 14
    if training:
        axes = (0,) + tuple(range(2, x.ndim))
        cur_mean = xp.mean(xf, axis=axes)
        cur_var = xp.var(xf, axis=axes)
        m, v = cur_mean, cur_var
    else:
        m, v = acc(mean), acc(var)
    cs = _channel_shape(scale, x)
    inv = acc(scale).reshape(cs) / xp.sqrt(xp.add(v.reshape(_channel_shape(v, x)), _like(xp, eps, xf.dtype)))
    y = ((xf - m.reshape(_channel_shape(m, x))) * inv + acc(bias).reshape(_channel_shape(bias, x))).astype(dtype, copy=False)
    if not training:
        return y
    momentum = node.attr("momentum", 0.9)
    run_mean = xp.add(xp.multiply(acc(mean), momentum), xp.multiply(cur_mean, 1 - momentum)).astype(mean.dtype, copy=False)
    run_var = xp.add(xp.multiply(acc(var), momentum), xp.multiply(cur_var, 1 - momentum)).astype(var.dtype, copy=False)
    return y, run_mean, run_var


@register("InstanceNormalization", 6)
def _instance_norm(ctx: OpContext, node: NodeInfo, x: Any, scale: Any, bias: Any) -> Any:
    xp = ctx.xp
    eps = node.attr("epsilon", 1e-5)
    xf = acc(x)
    axes = tuple(range(2, x.ndim))
    m = xp.mean(xf, axis=axes, keepdims=True)
    d = xf - m
    v = xp.mean(d * d, axis=axes, keepdims=True)
    cs = (1, -1) + (1,) * (x.ndim - 2)
    y = d / xp.sqrt(xp.add(v, _like(xp, eps, xf.dtype))) * acc(scale).reshape(cs) + acc(bias).reshape(cs)
    return y.astype(x.dtype, copy=False)


def _normalized_axes(node: NodeInfo, x: Any) -> tuple[float, tuple[int, ...], Any, Any]:
    """LayerNormalization / RMSNormalization: (epsilon, axes from ``axis`` on, compute dtype, x in it)."""
    axis = _axis(node.attr("axis", -1), x.ndim)
    ct = np.float32 if node.attr("stash_type", 1) == 1 and x.dtype != np.float64 else x.dtype
    return node.attr("epsilon", 1e-5), tuple(range(axis, x.ndim)), ct, x.astype(ct, copy=False)


@register("LayerNormalization", 17)
def _layer_norm(ctx: OpContext, node: NodeInfo, x: Any, scale: Any, bias: Any = None) -> Any:
    xp = ctx.xp
    eps, axes, ct, xf = _normalized_axes(node, x)
    m = xp.mean(xf, axis=axes, keepdims=True)
    d = xf - m
    v = xp.mean(d * d, axis=axes, keepdims=True)
    inv = xp.reciprocal(xp.sqrt(xp.add(v, _like(xp, eps, ct))))
    y = d * inv * scale.astype(ct, copy=False)
    if bias is not None:
        y = y + bias.astype(ct, copy=False)
    return y.astype(x.dtype, copy=False), m, inv


@register("RMSNormalization", 23)
def _rms_norm(ctx: OpContext, node: NodeInfo, x: Any, scale: Any) -> Any:
    xp = ctx.xp
    eps, axes, ct, xf = _normalized_axes(node, x)
    inv = xp.reciprocal(xp.sqrt(xp.add(xp.mean(xf * xf, axis=axes, keepdims=True), _like(xp, eps, ct))))
    return (xf * inv * scale.astype(ct, copy=False)).astype(x.dtype, copy=False)


@register("GroupNormalization", 18)
def _group_norm(ctx: OpContext, node: NodeInfo, x: Any, scale: Any, bias: Any) -> Any:
    xp = ctx.xp
    eps = node.attr("epsilon", 1e-5)
    g = node.attr("num_groups")
    n, c = x.shape[:2]
    ct = np.float32 if x.dtype != np.float64 else x.dtype
    if node.opset >= 21 and node.attr("stash_type", 1) != 1:
        ct = x.dtype
    xf = x.astype(ct, copy=False).reshape(n, g, -1)
    m = xp.mean(xf, axis=-1, keepdims=True)
    d = xf - m
    v = xp.mean(d * d, axis=-1, keepdims=True)
    y = (d / xp.sqrt(xp.add(v, _like(xp, eps, ct)))).reshape(x.shape)
    if scale.shape[0] == c:  # opset 21: per channel
        cs = (1, c) + (1,) * (x.ndim - 2)
        s, b = scale.reshape(cs), bias.reshape(cs)
    else:  # opset 18: per group
        rep = c // g
        cs = (1, c) + (1,) * (x.ndim - 2)
        s = xp.repeat(scale, rep).reshape(cs)
        b = xp.repeat(bias, rep).reshape(cs)
    return (y * s.astype(ct) + b.astype(ct)).astype(x.dtype, copy=False)


@register("LpNormalization")
def _lp_norm(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    axis = _axis(node.attr("axis", -1), x.ndim)
    p = node.attr("p", 2)
    xf = acc(x)
    if p == 1:
        norm = xp.sum(xp.abs(xf), axis=axis, keepdims=True)
    else:
        norm = xp.sqrt(xp.sum(xf * xf, axis=axis, keepdims=True))
    zero = xp.equal(norm, 0)
    safe = xp.where(zero, xp.ones_like(norm), norm)
    return xp.where(zero, xp.zeros_like(xf), xf / safe).astype(x.dtype, copy=False)


@register("MeanVarianceNormalization", 9)
def _mvn(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    axes = _axes(node.attr("axes", [0, 2, 3]), x.ndim)
    xf = acc(x)
    m = xp.mean(xf, axis=axes, keepdims=True)
    v = xp.mean(xf * xf, axis=axes, keepdims=True) - m * m
    return ((xf - m) / xp.add(xp.sqrt(v), 1e-9)).astype(x.dtype, copy=False)


@register("LRN")
def _lrn(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    size = node.attr("size")
    alpha, beta, bias = node.attr("alpha", 1e-4), node.attr("beta", 0.75), node.attr("bias", 1.0)
    xf = acc(x)
    sq = xf * xf
    c = x.shape[1]
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    padded = xp.pad(sq, [(0, 0), (lo, hi)] + [(0, 0)] * (x.ndim - 2))
    s = xp.zeros_like(sq)
    for i in range(size):
        s = s + padded[:, i : i + c]
    return (xf / xp.power(xp.add(xp.multiply(s, alpha / size), bias), beta)).astype(x.dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# pad


def _do_pad(ctx: OpContext, node: NodeInfo, x: Any, pads: list[int], value: Any, mode: str, axes: list[int] | None) -> Any:
    xp = ctx.xp
    r = x.ndim
    if axes is None:
        axes = list(range(r))
    axes = [_axis(a, r) for a in axes]
    n = len(axes)
    if len(pads) != 2 * n:
        raise ExecutorError(f"node {node.name!r}: Pad has {len(pads)} pads for {n} axes")
    begin, end = [0] * r, [0] * r
    for i, a in enumerate(axes):
        begin[a], end[a] = pads[i], pads[n + i]
    if min(begin + end) < 0:  # negative pads crop
        index = tuple(slice(max(0, -b), x.shape[i] - max(0, -e)) for i, (b, e) in enumerate(zip(begin, end)))
        x = x[index]
    widths = [(max(0, b), max(0, e)) for b, e in zip(begin, end)]
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise ExecutorError(f"node {node.name!r}: Pad mode {mode!r} is not supported")
    if not any(b or e for b, e in widths):
        return x  # pads of zero: the tensor itself, as Identity (a UNet's Pad to the skip's size)
    kwargs = {"constant_values": 0 if value is None else value} if mode == "constant" else {}
    # a channels-last tensor is padded in its memory order, so the result keeps that format (the
    # layout planner lets Pad pass NHWC through) and the copy reads and writes whole rows
    order = storage_order(x)
    if order is None:
        return xp.pad(x, widths, mode=mode, **kwargs)
    y = xp.pad(x.transpose(order), [widths[a] for a in order], mode=mode, **kwargs)
    return y.transpose(np.argsort(order))


@register("Pad", 1)
def _pad_attr(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    pads = node.attr("pads", node.attr("paddings"))
    return _do_pad(ctx, node, x, list(pads), node.attr("value", 0.0), node.attr("mode", "constant"), None)


@register("Pad", 11, value_inputs=(1, 3))
def _pad(ctx: OpContext, node: NodeInfo, x: Any, pads: Any, value: Any = None, axes: Any = None) -> Any:
    v = None if value is None or ctx.host(value).size == 0 else ctx.scalar(value)
    return _do_pad(ctx, node, x, ctx.ints(pads), v, node.attr("mode", "constant"), None if axes is None else ctx.ints(axes))

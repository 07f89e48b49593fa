"""Contractions and reductions over ``xp``: MatMul, Gemm, Einsum, CumSum, the Reduce* ops,
ArgMax / ArgMin, Softmax / LogSoftmax / Hardmax, TopK. float16 inputs are accumulated in float32.

One implementation per op; opset differences are separate registrations (``since=``) where the
interface changed (attributes that became inputs, new attributes). Only functions numpy and cupy
both have are used, and scalars meet arrays in ufuncs only (:mod:`convpass.ops.arrays`). See
:mod:`convpass.ops.registry` for the calling convention.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from convpass.core.errors import ExecutorError
from convpass.ops.arrays import _axes, _axis, _is_float, _is_int, _like, acc
from convpass.ops.registry import NodeInfo, OpContext, register

# ---------------------------------------------------------------------------------------------
# scans and contractions


@register("CumSum", 11, value_inputs=())
def _cumsum(ctx: OpContext, node: NodeInfo, x: Any, axis: Any) -> Any:
    xp = ctx.xp
    a = _axis(int(ctx.scalar(axis)), x.ndim)
    y = xp.flip(x, a) if node.attr("reverse", 0) else x
    out = xp.cumsum(y, axis=a, dtype=x.dtype)
    if node.attr("exclusive", 0):
        index = [slice(None)] * x.ndim
        index[a] = slice(0, -1)
        pad = [(0, 0)] * x.ndim
        pad[a] = (1, 0)
        out = xp.pad(out[tuple(index)], pad)
    return xp.flip(out, a) if node.attr("reverse", 0) else out


@register("Einsum", 12)
def _einsum(ctx: OpContext, node: NodeInfo, *xs: Any) -> Any:
    eq = node.attr("equation").replace(" ", "")
    dtype = xs[0].dtype
    return ctx.xp.einsum(eq, *[acc(x) for x in xs]).astype(dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# matmul


@register("MatMul")
def _matmul(ctx: OpContext, node: NodeInfo, a: Any, b: Any) -> Any:
    dtype = a.dtype
    return ctx.xp.matmul(acc(a), acc(b)).astype(dtype, copy=False)


@register("Gemm")
def _gemm(ctx: OpContext, node: NodeInfo, a: Any, b: Any, c: Any = None) -> Any:
    xp = ctx.xp
    dtype = a.dtype
    aa, bb = acc(a), acc(b)
    if node.attr("transA", 0):
        aa = aa.T
    if node.attr("transB", 0):
        bb = bb.T
    y = xp.matmul(aa, bb)
    alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 1.0)
    if alpha != 1.0:
        y = xp.multiply(y, _like(xp, alpha, y.dtype))
    if c is not None and beta != 0.0:
        cc = acc(c)
        y = y + (cc if beta == 1.0 else xp.multiply(cc, _like(xp, beta, cc.dtype)))
    return y.astype(dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# reductions, softmax, arg/topk


def _reduce_axes(ctx: OpContext, node: NodeInfo, x: Any, axes_input: Any, from_input: bool) -> tuple[int, ...] | None:
    """The reduced axes; None = nothing to do (noop_with_empty_axes)."""
    if from_input:
        axes = None if axes_input is None else ctx.ints(axes_input)
    else:
        axes = node.attr("axes")
    if not axes:
        if node.attr("noop_with_empty_axes", 0):
            return None
        return tuple(range(x.ndim))
    return _axes(axes, x.ndim)


_EMPTY_FILL = {
    "ReduceSum": 0,
    "ReduceSumSquare": 0,
    "ReduceL1": 0,
    "ReduceL2": 0,
    "ReduceProd": 1,
    "ReduceMax": -np.inf,
    "ReduceMin": np.inf,
    "ReduceLogSum": -np.inf,
    "ReduceLogSumExp": -np.inf,
    "ReduceMean": np.nan,
}


def _reduce_compute(xp: Any, name: str, x: Any, axes: tuple[int, ...], keep: bool) -> Any:
    dtype = x.dtype
    xf = acc(x)
    if name == "ReduceSum":
        y = xp.sum(xf, axis=axes, keepdims=keep, dtype=xf.dtype)
    elif name == "ReduceMean":
        y = xp.mean(xf, axis=axes, keepdims=keep, dtype=xf.dtype if _is_float(xf) else np.float64)
    elif name == "ReduceMax":
        y = xp.max(x, axis=axes, keepdims=keep)
    elif name == "ReduceMin":
        y = xp.min(x, axis=axes, keepdims=keep)
    elif name == "ReduceProd":
        y = xp.prod(xf, axis=axes, keepdims=keep, dtype=xf.dtype)
    elif name == "ReduceL1":
        y = xp.sum(xp.abs(xf), axis=axes, keepdims=keep, dtype=xf.dtype)
    elif name == "ReduceL2":
        y = xp.sqrt(xp.sum(xf * xf, axis=axes, keepdims=keep, dtype=xf.dtype))
    elif name == "ReduceSumSquare":
        y = xp.sum(xf * xf, axis=axes, keepdims=keep, dtype=xf.dtype)
    elif name == "ReduceLogSum":
        y = xp.log(xp.sum(xf, axis=axes, keepdims=keep, dtype=xf.dtype))
    elif name == "ReduceLogSumExp":
        m = xp.max(xf, axis=axes, keepdims=True)
        m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))
        y = xp.log(xp.sum(xp.exp(xf - m), axis=axes, keepdims=True)) + m
        if not keep:
            y = y.reshape([d for i, d in enumerate(y.shape) if i not in axes])
    else:  # pragma: no cover
        raise ExecutorError(f"unknown reduction {name}")
    return y.astype(dtype, copy=False)


def _reduce(ctx: OpContext, node: NodeInfo, x: Any, axes_input: Any, from_input: bool) -> Any:
    xp = ctx.xp
    axes = _reduce_axes(ctx, node, x, axes_input, from_input)
    keep = bool(node.attr("keepdims", 1))
    if axes is None:
        return x.copy()
    if any(x.shape[a] == 0 for a in axes):
        shape = [(1 if i in axes else d) for i, d in enumerate(x.shape)] if keep else [d for i, d in enumerate(x.shape) if i not in axes]
        fill = _EMPTY_FILL[node.op_type]
        if x.dtype == np.bool_:
            fill = node.op_type == "ReduceMin"
        elif _is_int(x) and not np.isfinite(fill):
            info = np.iinfo(x.dtype)
            fill = info.min if fill < 0 else info.max
        return xp.full(shape, fill, dtype=x.dtype)
    return _reduce_compute(xp, node.op_type, x, axes, keep)


_REDUCE_AXES_INPUT_SINCE = {
    "ReduceSum": 13,
    "ReduceMean": 18,
    "ReduceMax": 18,
    "ReduceMin": 18,
    "ReduceProd": 18,
    "ReduceL1": 18,
    "ReduceL2": 18,
    "ReduceSumSquare": 18,
    "ReduceLogSum": 18,
    "ReduceLogSumExp": 18,
}


def _register_reduce(name: str, since_input: int) -> None:
    @register(name, 1)
    def _attr(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
        return _reduce(ctx, node, x, None, False)

    @register(name, since_input, value_inputs=(1,))
    def _inp(ctx: OpContext, node: NodeInfo, x: Any, axes: Any = None) -> Any:
        return _reduce(ctx, node, x, axes, True)


for _name, _since in _REDUCE_AXES_INPUT_SINCE.items():
    _register_reduce(_name, _since)


def _arg(ctx: OpContext, node: NodeInfo, x: Any, largest: bool) -> Any:
    xp = ctx.xp
    axis = _axis(node.attr("axis", 0), x.ndim)
    keep = node.attr("keepdims", 1)
    fn = xp.argmax if largest else xp.argmin
    if node.attr("select_last_index", 0):
        idx = xp.subtract(x.shape[axis] - 1, fn(xp.flip(x, axis), axis=axis))
    else:
        idx = fn(x, axis=axis)
    idx = idx.astype(np.int64)
    return xp.expand_dims(idx, axis) if keep else idx


@register("ArgMax")
def _argmax(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    return _arg(ctx, node, x, True)


@register("ArgMin")
def _argmin(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    return _arg(ctx, node, x, False)


def _softmax_core(xp: Any, x: Any, axis: int, kind: str) -> Any:
    xf = acc(x)
    if kind == "hardmax":
        idx = xp.argmax(xf, axis=axis)
        n = x.shape[axis]
        hot = xp.expand_dims(idx, axis) == xp.arange(n).reshape([n if i == axis else 1 for i in range(x.ndim)])
        return hot.astype(x.dtype)
    m = xp.max(xf, axis=axis, keepdims=True)
    z = xf - m
    e = xp.exp(z)
    s = xp.sum(e, axis=axis, keepdims=True)
    y = z - xp.log(s) if kind == "log" else e / s
    return y.astype(x.dtype, copy=False)


def _register_softmax(name: str, kind: str) -> None:
    @register(name, 1)
    def _old(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
        axis = _axis(node.attr("axis", 1), x.ndim)
        shape = x.shape
        flat = x.reshape(int(math.prod(shape[:axis])), int(math.prod(shape[axis:])))
        return _softmax_core(ctx.xp, flat, 1, kind).reshape(shape)

    @register(name, 13)
    def _new(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
        return _softmax_core(ctx.xp, x, _axis(node.attr("axis", -1), x.ndim), kind)


_register_softmax("Softmax", "softmax")
_register_softmax("LogSoftmax", "log")
_register_softmax("Hardmax", "hardmax")


@register("TopK", 1)
def _topk_attr(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    return _do_topk(ctx, node, x, int(node.attr("k")))


@register("TopK", 10, value_inputs=(1,))
def _topk(ctx: OpContext, node: NodeInfo, x: Any, k: Any) -> Any:
    return _do_topk(ctx, node, x, int(ctx.scalar(k)))


def _do_topk(ctx: OpContext, node: NodeInfo, x: Any, kk: int) -> Any:
    xp = ctx.xp
    axis = _axis(node.attr("axis", -1), x.ndim)
    largest = node.attr("largest", 1)
    if largest:
        key = -(x.astype(np.int64) if np.dtype(x.dtype).kind == "u" else x)
    else:
        key = x
    # ties keep the lower index first: a stable sort (cupy's sort is always stable)
    order = xp.argsort(key, axis=axis, kind="stable") if xp is np else xp.argsort(key, axis=axis)
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, kk)
    idx = order[tuple(index)]
    return xp.take_along_axis(x, idx, axis=axis), idx.astype(np.int64)

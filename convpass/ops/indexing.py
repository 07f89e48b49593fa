"""Indexing ops over ``xp``: Gather / GatherElements / GatherND, ScatterND / ScatterElements (with
their reductions), OneHot, NonZero, and the generated tensors Range, EyeLike, Trilu.

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
from convpass.ops.arrays import _axis
from convpass.ops.registry import NodeInfo, OpContext, np_dtype, register

# ---------------------------------------------------------------------------------------------
# gather and scatter


def _normalize_indices(xp: Any, idx: Any, dim: int) -> Any:
    idx = idx.astype(np.int64, copy=False)
    return xp.where(xp.less(idx, 0), xp.add(idx, dim), idx)


@register("Gather")
def _gather(ctx: OpContext, node: NodeInfo, x: Any, idx: Any) -> Any:
    axis = _axis(node.attr("axis", 0), x.ndim)
    return ctx.xp.take(x, _normalize_indices(ctx.xp, idx, x.shape[axis]), axis=axis)


@register("GatherElements", 11)
def _gather_elements(ctx: OpContext, node: NodeInfo, x: Any, idx: Any) -> Any:
    axis = _axis(node.attr("axis", 0), x.ndim)
    return ctx.xp.take_along_axis(x, _normalize_indices(ctx.xp, idx, x.shape[axis]), axis=axis)


@register("GatherND", 11)
def _gather_nd(ctx: OpContext, node: NodeInfo, x: Any, idx: Any) -> Any:
    xp = ctx.xp
    b = node.attr("batch_dims", 0)
    m = idx.shape[-1]
    batch_shape = x.shape[:b]
    nb = int(math.prod(batch_shape))
    data = x.reshape((nb,) + x.shape[b:])
    ind = idx.reshape((nb,) + idx.shape[b:])
    ind = ind.astype(np.int64, copy=False)
    lead = ind.shape[1:-1]
    keys = [xp.arange(nb).reshape((nb,) + (1,) * len(lead))]
    for j in range(m):
        k = ind[..., j]
        keys.append(xp.where(xp.less(k, 0), xp.add(k, x.shape[b + j]), k))
    out = data[tuple(keys)]
    return out.reshape(batch_shape + lead + x.shape[b + m :])


_SCATTER_REDUCTIONS = {"add": "add", "mul": "multiply", "max": "maximum", "min": "minimum"}


def _scatter(ctx: OpContext, node: NodeInfo, x: Any, keys: tuple[Any, ...], updates: Any) -> Any:
    """A copy of ``x`` with ``updates`` written (or reduced, ``reduction``) at the index arrays
    ``keys``. Duplicate keys without a reduction: ONNX leaves the result open (NumPy keeps the last
    write; on a GPU any one of them may win)."""
    xp = ctx.xp
    out = x.copy()
    reduction = node.attr("reduction", "none")
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    if reduction == "none":
        out[keys] = updates
        return out
    if reduction not in _SCATTER_REDUCTIONS:
        raise ExecutorError(f"{node.op_type} {node.name!r}: reduction {reduction!r} is not one of none, {', '.join(_SCATTER_REDUCTIONS)}")
    ufunc = getattr(xp, _SCATTER_REDUCTIONS[reduction])
    try:
        ufunc.at(out, keys, updates)
    except (NotImplementedError, TypeError):  # CuPy: ufunc.at for add, subtract, maximum, minimum, on some dtypes only
        _reduce_at_in_rounds(xp, ufunc, out, keys, updates)
    return out


def _reduce_at_in_rounds(xp: Any, ufunc: Any, out: Any, keys: tuple[Any, ...], updates: Any) -> None:
    """``ufunc.at(out, keys, updates)`` for an array library without it: each round applies, for
    every target still owed an update, the first of its updates left, so duplicate targets reduce in
    order. As many rounds as the most repeated target; the round sizes are read on the host."""
    keys = xp.broadcast_arrays(*keys)
    if keys[0].size == 0 or out.size == 0:
        return
    m = len(keys)
    lead = keys[0].shape
    rows = xp.ravel_multi_index(tuple(k.ravel() for k in keys), out.shape[:m])
    flat = out.reshape((int(np.prod(out.shape[:m], dtype=np.int64)), -1))  # out is a fresh copy: a view
    upd = xp.broadcast_to(updates, lead + out.shape[m:]).reshape((rows.size, -1))
    left = xp.arange(rows.size)
    while left.size:
        _, first = xp.unique(rows[left], return_index=True)
        now = left[first]
        flat[rows[now]] = ufunc(flat[rows[now]], upd[now])
        rest = xp.ones(left.size, dtype=bool)
        rest[first] = False
        left = left[rest]


@register("ScatterND", 11)
def _scatter_nd(ctx: OpContext, node: NodeInfo, x: Any, idx: Any, updates: Any) -> Any:
    ind = idx.astype(np.int64, copy=False)
    keys = tuple(_normalize_indices(ctx.xp, ind[..., j], x.shape[j]) for j in range(ind.shape[-1]))
    return _scatter(ctx, node, x, keys, updates)


@register(["Scatter", "ScatterElements"], 9)
def _scatter_elements(ctx: OpContext, node: NodeInfo, x: Any, idx: Any, updates: Any) -> Any:
    xp = ctx.xp
    axis = _axis(node.attr("axis", 0), x.ndim)
    keys = []
    for d in range(idx.ndim):
        if d == axis:
            keys.append(_normalize_indices(xp, idx, x.shape[axis]))
        else:
            keys.append(xp.arange(idx.shape[d]).reshape((1,) * d + (-1,) + (1,) * (idx.ndim - d - 1)))
    return _scatter(ctx, node, x, tuple(keys), updates)



# ---------------------------------------------------------------------------------------------
# one-hot, non-zero and generated tensors


@register("Range", 11, value_inputs=(0, 1, 2))
def _range(ctx: OpContext, node: NodeInfo, start: Any, limit: Any, delta: Any) -> Any:
    s, lim, d = ctx.scalar(start), ctx.scalar(limit), ctx.scalar(delta)
    n = max(int(math.ceil((lim - s) / d)), 0)
    dtype = start.dtype
    if np.dtype(dtype).kind in "iu":
        return ctx.xp.asarray(s + d * np.arange(n, dtype=np.int64), dtype=dtype)
    return ctx.xp.asarray(s + d * np.arange(n, dtype=np.float64), dtype=dtype)


@register("EyeLike", 9)
def _eye_like(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    dtype = node.attr("dtype")
    dtype = x.dtype if dtype is None else np_dtype(int(dtype))
    return ctx.xp.eye(x.shape[0], x.shape[1], k=node.attr("k", 0), dtype=dtype)


@register("Trilu", 14, value_inputs=())
def _trilu(ctx: OpContext, node: NodeInfo, x: Any, k: Any = None) -> Any:
    kk = 0 if k is None else int(ctx.scalar(k))
    if node.attr("upper", 1):
        return ctx.xp.triu(x, kk)
    return ctx.xp.tril(x, kk)


@register("OneHot", 11, value_inputs=(1,))
def _one_hot(ctx: OpContext, node: NodeInfo, indices: Any, depth: Any, values: Any) -> Any:
    xp = ctx.xp
    d = int(ctx.scalar(depth))
    idx = indices.astype(np.int64)
    idx = xp.where(xp.less(idx, 0), xp.add(idx, d), idx)
    rank = indices.ndim + 1
    axis = _axis(node.attr("axis", -1), rank)
    hot = xp.equal(xp.expand_dims(idx, -1), xp.arange(d).reshape((1,) * indices.ndim + (d,)))
    out = xp.where(hot, values[1], values[0])
    return xp.moveaxis(out, -1, axis)


@register("NonZero", 9, data_dependent_shape=True)
def _nonzero(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    if x.ndim == 0:
        return xp.zeros((0, int(bool(x))), dtype=np.int64)
    return xp.stack(xp.nonzero(x)).astype(np.int64)

"""Shape and data-movement ops over ``xp``: casts and constants, Shape / Size, Reshape, Flatten,
Squeeze / Unsqueeze, Transpose, Concat, Split, Slice, Expand, Tile, DepthToSpace / SpaceToDepth.

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
from convpass.core.layout import storage_order
from convpass.ops.arrays import _axes, _axis
from convpass.ops.registry import NodeInfo, OpContext, np_dtype, register

# ---------------------------------------------------------------------------------------------
# types, constants, shapes


@register("Cast")
def _cast(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    to = node.attr("to")
    dtype = np_dtype(int(to)) if not isinstance(to, str) else np.dtype(to.lower())
    return x.astype(dtype)


@register("CastLike", 15)
def _cast_like(ctx: OpContext, node: NodeInfo, x: Any, like: Any) -> Any:
    return x.astype(like.dtype)


@register("Constant")
def _constant(ctx: OpContext, node: NodeInfo) -> Any:
    xp = ctx.xp
    a = node.attrs
    if "value" in a:
        return ctx.backend.upload(np.asarray(a["value"]))
    if "value_float" in a:
        return xp.asarray(a["value_float"], dtype=np.float32)
    if "value_floats" in a:
        return xp.asarray(a["value_floats"], dtype=np.float32)
    if "value_int" in a:
        return xp.asarray(a["value_int"], dtype=np.int64)
    if "value_ints" in a:
        return xp.asarray(a["value_ints"], dtype=np.int64)
    raise ExecutorError(f"node {node.name!r}: Constant with attributes {sorted(a)} is not supported")


@register("ConstantOfShape", 9, value_inputs=(0,))
def _constant_of_shape(ctx: OpContext, node: NodeInfo, shape: Any) -> Any:
    value = node.attr("value")
    if value is None:
        value = np.zeros((1,), dtype=np.float32)
    value = np.asarray(value)
    return ctx.xp.full(tuple(ctx.ints(shape)), value.reshape(-1)[0], dtype=value.dtype)


@register("Shape", 1)
def _shape(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    shape = list(x.shape)
    if node.opset >= 15:
        r = len(shape)
        start = node.attr("start", 0)
        end = node.attr("end", r)
        start = min(max(start + r if start < 0 else start, 0), r)
        end = min(max(end + r if end < 0 else end, 0), r)
        shape = shape[start:end]
    return ctx.xp.asarray(shape, dtype=np.int64)


@register("Size")
def _size(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    return ctx.xp.asarray(int(math.prod(x.shape)), dtype=np.int64)


@register("Reshape", 1)
def _reshape_v1(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    return _do_reshape(x, list(node.attr("shape", [])), False)


@register("Reshape", 5, value_inputs=(1,))
def _reshape(ctx: OpContext, node: NodeInfo, x: Any, shape: Any) -> Any:
    return _do_reshape(x, ctx.ints(shape), bool(node.attr("allowzero", 0)))


def _do_reshape(x: Any, shape: list[int], allowzero: bool) -> Any:
    target = []
    for i, d in enumerate(shape):
        if d == 0 and not allowzero:
            if i >= x.ndim:
                raise ExecutorError(f"Reshape: 0 at position {i} copies a dim the input (rank {x.ndim}) lacks")
            d = x.shape[i]
        target.append(d)
    if -1 in target:
        known = math.prod(d for d in target if d != -1)
        if known == 0:
            target[target.index(-1)] = 0
    try:
        return x.reshape(target)
    except ValueError as e:
        raise ExecutorError(f"Reshape: cannot reshape {tuple(x.shape)} to {shape}: {e}") from None


@register("Flatten")
def _flatten(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    axis = node.attr("axis", 1)
    axis = axis + x.ndim if axis < 0 else axis
    return x.reshape(int(math.prod(x.shape[:axis])), int(math.prod(x.shape[axis:])))


@register("Squeeze", 1)
def _squeeze_attr(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    return _do_squeeze(ctx.xp, x, node.attr("axes"))


@register("Squeeze", 13, value_inputs=(1,))
def _squeeze(ctx: OpContext, node: NodeInfo, x: Any, axes: Any = None) -> Any:
    return _do_squeeze(ctx.xp, x, None if axes is None else ctx.ints(axes))


def _do_squeeze(xp: Any, x: Any, axes: Any) -> Any:
    if axes is None or len(axes) == 0:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = _axes(axes, x.ndim)
    for a in axes:
        if x.shape[a] != 1:
            raise ExecutorError(f"Squeeze: dim {a} of shape {tuple(x.shape)} is not 1")
    return x.reshape([d for i, d in enumerate(x.shape) if i not in axes])


@register("Unsqueeze", 1)
def _unsqueeze_attr(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    return _do_unsqueeze(x, node.attr("axes", []))


@register("Unsqueeze", 13, value_inputs=(1,))
def _unsqueeze(ctx: OpContext, node: NodeInfo, x: Any, axes: Any) -> Any:
    return _do_unsqueeze(x, ctx.ints(axes))


def _do_unsqueeze(x: Any, axes: Any) -> Any:
    rank = x.ndim + len(axes)
    axes = _axes(axes, rank)
    if len(set(axes)) != len(axes):
        raise ExecutorError(f"Unsqueeze: repeated axes {list(axes)}")
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return x.reshape(shape)


@register("Transpose")
def _transpose(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    perm = node.attr("perm")
    if not perm:
        perm = list(range(x.ndim))[::-1]
    return ctx.xp.transpose(x, perm)


@register("Concat")
def _concat(ctx: OpContext, node: NodeInfo, *xs: Any) -> Any:
    xs = [x for x in xs if x is not None]
    axis = _axis(node.attr("axis", 1), xs[0].ndim)
    orders = {storage_order(x) for x in xs}
    if len(orders) == 1 and (order := orders.pop()) is not None:  # all channels-last: so is the result
        y = ctx.xp.concatenate([x.transpose(order) for x in xs], axis=order.index(axis))
        return y.transpose(np.argsort(order))
    return ctx.xp.concatenate(xs, axis=axis)


def _split_sizes(total: int, n: int) -> list[int]:
    size = -(-total // n)
    sizes = [size] * (n - 1)
    sizes.append(total - size * (n - 1))
    return sizes


def _do_split(xp: Any, x: Any, axis: int, sizes: list[int]) -> tuple[Any, ...]:
    axis = _axis(axis, x.ndim)
    if sum(sizes) != x.shape[axis] or min(sizes, default=0) < 0:
        raise ExecutorError(f"Split: sizes {sizes} do not split dim {axis} of {tuple(x.shape)}")
    out, start = [], 0
    for s in sizes:
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, start + s)
        out.append(x[tuple(index)])
        start += s
    return tuple(out)


@register("Split", 1)
def _split_attr(ctx: OpContext, node: NodeInfo, x: Any, split: Any = None) -> Any:
    axis = node.attr("axis", 0)
    sizes = node.attr("split") or (ctx.ints(split) if split is not None else None)
    n = len(node.outputs)
    if not sizes:
        dim = x.shape[_axis(axis, x.ndim)]
        if dim % n:
            raise ExecutorError(f"Split: dim {dim} does not split evenly into {n} outputs")
        sizes = [dim // n] * n
    return _do_split(ctx.xp, x, axis, list(sizes))


@register("Split", 13, value_inputs=(1,))
def _split(ctx: OpContext, node: NodeInfo, x: Any, split: Any = None) -> Any:
    axis = node.attr("axis", 0)
    dim = x.shape[_axis(axis, x.ndim)]
    if split is not None and ctx.host(split).size:
        sizes = ctx.ints(split)
    else:
        n = node.attr("num_outputs") or len(node.outputs)
        sizes = _split_sizes(dim, n) if node.opset >= 18 else ([dim // n] * n if dim % n == 0 else None)
        if sizes is None:
            raise ExecutorError(f"Split: dim {dim} does not split evenly into {n} outputs")
    return _do_split(ctx.xp, x, axis, sizes)


def _slice_index(shape: tuple[int, ...], starts: list[int], ends: list[int], axes: list[int] | None, steps: list[int] | None) -> tuple[slice, ...]:
    rank = len(shape)
    if axes is None:
        axes = list(range(len(starts)))
    if steps is None:
        steps = [1] * len(starts)
    index = [slice(None)] * rank
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = _axis(a, rank)
        dim = shape[a]
        if st == 0:
            raise ExecutorError("Slice: step 0")
        s = s + dim if s < 0 else s
        e = e + dim if e < 0 else e
        if st > 0:
            s = min(max(s, 0), dim)
            e = min(max(e, 0), dim)
            index[a] = slice(s, e, st)
        else:
            s = min(max(s, 0), dim - 1)
            e = min(max(e, -1), dim - 1)
            index[a] = slice(s, None if e < 0 else e, st)
    return tuple(index)


@register("Slice", 1)
def _slice_attr(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    return x[_slice_index(x.shape, node.attr("starts"), node.attr("ends"), node.attr("axes"), None)]


@register("Slice", 10, value_inputs=(1, 2, 3, 4))
def _slice(ctx: OpContext, node: NodeInfo, x: Any, starts: Any, ends: Any, axes: Any = None, steps: Any = None) -> Any:
    return x[
        _slice_index(
            x.shape,
            ctx.ints(starts),
            ctx.ints(ends),
            None if axes is None else ctx.ints(axes),
            None if steps is None else ctx.ints(steps),
        )
    ]



@register("Expand", 8, value_inputs=(1,))
def _expand(ctx: OpContext, node: NodeInfo, x: Any, shape: Any) -> Any:
    xp = ctx.xp
    target = ctx.ints(shape)
    out_shape = np.broadcast_shapes(tuple(x.shape), tuple(target))
    return xp.ascontiguousarray(xp.broadcast_to(x, out_shape))


@register("Tile", 6, value_inputs=(1,))
def _tile(ctx: OpContext, node: NodeInfo, x: Any, repeats: Any) -> Any:
    return ctx.xp.tile(x, tuple(ctx.ints(repeats)))



@register("DepthToSpace")
def _depth_to_space(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    b = node.attr("blocksize")
    n, c, h, w = x.shape
    if node.attr("mode", "DCR") == "CRD":
        y = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    else:
        y = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    return xp.ascontiguousarray(y).reshape(n, c // (b * b), h * b, w * b)


@register("SpaceToDepth")
def _space_to_depth(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    b = node.attr("blocksize")
    n, c, h, w = x.shape
    if node.attr("mode", "DCR") == "CRD":  # opset 28
        y = x.reshape(n, c, h // b, b, w // b, b).transpose(0, 1, 3, 5, 2, 4)
    else:
        y = x.reshape(n, c, h // b, b, w // b, b).transpose(0, 3, 5, 1, 2, 4)
    return xp.ascontiguousarray(y).reshape(n, c * b * b, h // b, w // b)

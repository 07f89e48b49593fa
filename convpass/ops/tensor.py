"""Element-wise, tensor-manipulation, reduction and math ops over ``xp``.

One implementation per op; opset differences are separate registrations (``since=``) where the
interface changed (attributes that became inputs, new attributes). Only functions numpy and cupy
both have are used. See :mod:`convpass.ops.registry` for the calling convention; neural-net
ops (conv, pooling, normalization, resize) are in :mod:`convpass.ops.nn`.

An array and a scalar meet in a ufunc (``xp.multiply(x, s)``, ``xp.greater(x, 0)``), never in an
operator (``x * s``, ``x > 0``; between two arrays operators are fine): CuPy's operator path with a
scalar imports cupyx and, through it, SciPy, which costs a fresh process 0.3-0.45 s of start-up
(measured on the H200 machine). tests/test_ops_rules.py holds the ops to it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from convpass.core.errors import ExecutorError
from convpass.core.layout import storage_order
from convpass.ops.registry import NodeInfo, OpContext, np_dtype, register

# ---------------------------------------------------------------------------------------------
# helpers


def _is_float(x: Any) -> bool:
    return np.dtype(x.dtype).kind == "f"


def _is_int(x: Any) -> bool:
    return np.dtype(x.dtype).kind in "iu"


def acc(x: Any) -> Any:
    """float16 computed in float32 (sums, means, matmuls)."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


def _axis(axis: int, rank: int) -> int:
    a = int(axis)
    if a < 0:
        a += rank
    if not 0 <= a < max(rank, 1):
        raise ExecutorError(f"axis {axis} out of range for rank {rank}")
    return a


def _axes(axes: Any, rank: int) -> tuple[int, ...]:
    return tuple(sorted(_axis(a, rank) for a in axes))


def _like(xp: Any, value: Any, dtype: Any) -> Any:
    """A typed scalar: combines with arrays without promotion and without a device allocation."""
    return np.dtype(dtype).type(value)


# ---------------------------------------------------------------------------------------------
# unary element-wise


def _unary(name: str, fn: Any, since: int = 1) -> None:
    @register(name, since)
    def _op(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
        return fn(ctx.xp, x)

    _op.__name__ = name


_unary("Abs", lambda xp, x: xp.abs(x))
_unary("Neg", lambda xp, x: xp.negative(x))
_unary("Exp", lambda xp, x: xp.exp(x))
_unary("Log", lambda xp, x: xp.log(x))
_unary("Sqrt", lambda xp, x: xp.sqrt(x))
_unary("Reciprocal", lambda xp, x: xp.reciprocal(x))
_unary("Floor", lambda xp, x: xp.floor(x))
_unary("Ceil", lambda xp, x: xp.ceil(x))
_unary("Round", lambda xp, x: xp.round(x))  # half to even, as ONNX
_unary("Sign", lambda xp, x: xp.sign(x))
_unary("Sin", lambda xp, x: xp.sin(x))
_unary("Cos", lambda xp, x: xp.cos(x))
_unary("Tan", lambda xp, x: xp.tan(x))
_unary("Asin", lambda xp, x: xp.arcsin(x))
_unary("Acos", lambda xp, x: xp.arccos(x))
_unary("Atan", lambda xp, x: xp.arctan(x))
_unary("Sinh", lambda xp, x: xp.sinh(x))
_unary("Cosh", lambda xp, x: xp.cosh(x))
_unary("Asinh", lambda xp, x: xp.arcsinh(x))
_unary("Acosh", lambda xp, x: xp.arccosh(x))
_unary("Atanh", lambda xp, x: xp.arctanh(x))
_unary("Tanh", lambda xp, x: xp.tanh(x))
_unary("Relu", lambda xp, x: xp.maximum(x, _like(xp, 0, x.dtype)))
_unary("Not", lambda xp, x: xp.logical_not(x))
_unary("IsNaN", lambda xp, x: xp.isnan(x))
_unary("Softsign", lambda xp, x: xp.divide(x, xp.add(xp.abs(x), 1)))
_unary("BitwiseNot", lambda xp, x: xp.invert(x))


@register("Sigmoid")
def _sigmoid(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    # exp of a non-positive number only: no overflow for either sign
    e = xp.exp(xp.negative(xp.abs(x)))
    d = xp.add(e, 1)
    return xp.where(xp.greater_equal(x, 0), xp.reciprocal(d), xp.divide(e, d)).astype(x.dtype, copy=False)


@register("Softplus")
def _softplus(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    return (xp.maximum(x, _like(xp, 0, x.dtype)) + xp.log1p(xp.exp(-xp.abs(x)))).astype(x.dtype, copy=False)


@register("Mish")
def _mish(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    sp = xp.maximum(x, _like(xp, 0, x.dtype)) + xp.log1p(xp.exp(-xp.abs(x)))
    return (x * xp.tanh(sp)).astype(x.dtype, copy=False)


@register("Erf")
def _erf(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    if not _is_float(x):
        return ctx.backend.erf(x.astype(np.float64)).astype(x.dtype)
    return ctx.backend.erf(x).astype(x.dtype, copy=False)


@register("IsInf", 10)
def _isinf(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    pos, neg = node.attr("detect_positive", 1), node.attr("detect_negative", 1)
    if pos and neg:
        return xp.isinf(x)
    if pos:
        return xp.isinf(x) & xp.greater(x, 0)
    if neg:
        return xp.isinf(x) & xp.less(x, 0)
    return xp.zeros(x.shape, dtype=bool)


@register("LeakyRelu")
def _leaky_relu(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    alpha = node.attr("alpha", 0.01)
    return ctx.xp.where(ctx.xp.greater_equal(x, 0), x, ctx.xp.multiply(x, _like(ctx.xp, alpha, x.dtype)))


@register("Elu")
def _elu(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    alpha = _like(xp, node.attr("alpha", 1.0), x.dtype)
    return xp.where(xp.greater(x, 0), x, xp.multiply(xp.expm1(xp.minimum(x, _like(xp, 0, x.dtype))), alpha))


@register("Celu", 12)
def _celu(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    alpha = node.attr("alpha", 1.0)
    neg = xp.multiply(xp.expm1(xp.divide(xp.minimum(x, _like(xp, 0, x.dtype)), alpha)), alpha)
    return xp.where(xp.greater(x, 0), x, neg).astype(x.dtype, copy=False)


@register("Selu")
def _selu(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    alpha = _like(xp, node.attr("alpha", 1.67326319217681884765625), x.dtype)
    gamma = _like(xp, node.attr("gamma", 1.05070102214813232421875), x.dtype)
    return xp.multiply(xp.where(xp.greater(x, 0), x, xp.multiply(xp.expm1(xp.minimum(x, _like(xp, 0, x.dtype))), alpha)), gamma)


@register("ThresholdedRelu", 10)
def _thresholded_relu(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    alpha = node.attr("alpha", 1.0)
    return ctx.xp.where(ctx.xp.greater(x, alpha), x, _like(ctx.xp, 0, x.dtype))


@register("HardSigmoid")
def _hard_sigmoid(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    alpha = _like(xp, node.attr("alpha", 0.2), x.dtype)
    beta = _like(xp, node.attr("beta", 0.5), x.dtype)
    return xp.clip(xp.add(xp.multiply(x, alpha), beta), _like(xp, 0, x.dtype), _like(xp, 1, x.dtype))


@register("HardSwish", 14)
def _hard_swish(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    hs = xp.add(xp.multiply(x, _like(xp, 1 / 6, x.dtype)), _like(xp, 0.5, x.dtype))
    return xp.multiply(x, xp.clip(hs, _like(xp, 0, x.dtype), _like(xp, 1, x.dtype)))


@register("Swish", 24)
def _swish(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    alpha = node.attr("alpha", 1.0)
    s = _sigmoid(ctx, node, ctx.xp.multiply(x, _like(ctx.xp, alpha, x.dtype)))
    return ctx.xp.multiply(x, s)


@register("Shrink", 9)
def _shrink(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    lambd, bias = node.attr("lambd", 0.5), node.attr("bias", 0.0)
    zero = xp.zeros_like(x)
    b = _like(xp, bias, x.dtype)
    return xp.where(xp.less(x, -lambd), xp.add(x, b), xp.where(xp.greater(x, lambd), xp.subtract(x, b), zero))


@register("Gelu", 20)
def _gelu(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    xp = ctx.xp
    dt = x.dtype
    xf = acc(x)
    if node.attr("approximate", "none") == "tanh":
        cube = xp.multiply(xp.multiply(xf, xf), xf)
        inner = xp.multiply(xp.add(xf, xp.multiply(cube, _like(xp, 0.044715, xf.dtype))), _like(xp, math.sqrt(2 / math.pi), xf.dtype))
        y = xp.multiply(xp.multiply(xf, _like(xp, 0.5, xf.dtype)), xp.add(xp.tanh(inner), 1))
    else:
        e = ctx.backend.erf(xp.multiply(xf, _like(xp, 1 / math.sqrt(2), xf.dtype)))
        y = xp.multiply(xp.multiply(xf, _like(xp, 0.5, xf.dtype)), xp.add(e, 1))
    return y.astype(dt, copy=False)


@register("PRelu")
def _prelu(ctx: OpContext, node: NodeInfo, x: Any, slope: Any) -> Any:
    xp = ctx.xp
    if node.opset < 7 and slope.ndim == 1 and x.ndim > 2 and slope.shape[0] == x.shape[1]:
        slope = slope.reshape((1, -1) + (1,) * (x.ndim - 2))
    return xp.where(xp.less(x, 0), x * slope, x).astype(x.dtype, copy=False)


@register("Clip", 1)
def _clip_attrs(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    lo = node.attr("min", -np.inf)
    hi = node.attr("max", np.inf)
    xp = ctx.xp
    return xp.minimum(xp.maximum(x, _like(xp, lo, x.dtype)), _like(xp, hi, x.dtype))


@register("Clip", 11)
def _clip(ctx: OpContext, node: NodeInfo, x: Any, lo: Any = None, hi: Any = None) -> Any:
    xp = ctx.xp
    y = x
    if lo is not None:
        y = xp.maximum(y, lo.astype(x.dtype, copy=False))
    if hi is not None:
        y = xp.minimum(y, hi.astype(x.dtype, copy=False))
    return y if y is not x else x.copy()


@register("Identity")
def _identity(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    return x


@register("Dropout", 1)
def _dropout_old(ctx: OpContext, node: NodeInfo, x: Any) -> Any:
    # is_test / ratio attributes; inference only
    return x, ctx.xp.ones(x.shape, dtype=bool)


@register("Dropout", 12, value_inputs=(2,))
def _dropout(ctx: OpContext, node: NodeInfo, x: Any, ratio: Any = None, training_mode: Any = None) -> Any:
    if training_mode is not None and bool(ctx.scalar(training_mode)):
        r = 0.5 if ratio is None else float(ctx.scalar(ratio))
        if r != 0.0:
            raise ExecutorError(f"node {node.name!r}: Dropout in training mode (ratio {r}) is not supported by this inference executor")
    return x, ctx.xp.ones(x.shape, dtype=bool)


# ---------------------------------------------------------------------------------------------
# binary / variadic element-wise


def _legacy_broadcast(node: NodeInfo, a: Any, b: Any) -> Any:
    """opset < 7 'broadcast' + 'axis' attributes: align b's dims with a's starting at axis."""
    if node.opset < 7 and node.attr("broadcast", 0) and b.ndim and b.ndim < a.ndim:
        axis = node.attr("axis", a.ndim - b.ndim)
        axis = axis + a.ndim if axis < 0 else axis
        b = b.reshape(b.shape + (1,) * (a.ndim - axis - b.ndim))
    return b


def _binary(name: str, fn: Any) -> None:
    @register(name)
    def _op(ctx: OpContext, node: NodeInfo, a: Any, b: Any) -> Any:
        return fn(ctx.xp, a, _legacy_broadcast(node, a, b))

    _op.__name__ = name


_binary("Add", lambda xp, a, b: xp.add(a, b))
_binary("Sub", lambda xp, a, b: xp.subtract(a, b))
_binary("Mul", lambda xp, a, b: xp.multiply(a, b))
_binary("Equal", lambda xp, a, b: xp.equal(a, b))
_binary("Less", lambda xp, a, b: xp.less(a, b))
_binary("LessOrEqual", lambda xp, a, b: xp.less_equal(a, b))
_binary("Greater", lambda xp, a, b: xp.greater(a, b))
_binary("GreaterOrEqual", lambda xp, a, b: xp.greater_equal(a, b))
_binary("And", lambda xp, a, b: xp.logical_and(a, b))
_binary("Or", lambda xp, a, b: xp.logical_or(a, b))
_binary("Xor", lambda xp, a, b: xp.logical_xor(a, b))
_binary("BitwiseAnd", lambda xp, a, b: xp.bitwise_and(a, b))
_binary("BitwiseOr", lambda xp, a, b: xp.bitwise_or(a, b))
_binary("BitwiseXor", lambda xp, a, b: xp.bitwise_xor(a, b))


@register("Div")
def _div(ctx: OpContext, node: NodeInfo, a: Any, b: Any) -> Any:
    xp = ctx.xp
    b = _legacy_broadcast(node, a, b)
    if _is_int(a):
        # C-style division: truncate toward zero
        safe = xp.where(xp.equal(b, 0), xp.ones_like(b), b)
        q = xp.floor_divide(a, safe)
        fix = xp.not_equal(a - q * safe, 0) & xp.not_equal(xp.less(a, 0), xp.less(safe, 0))
        return (q + fix.astype(q.dtype)).astype(a.dtype, copy=False)
    return xp.divide(a, b)


@register("Pow")
def _pow(ctx: OpContext, node: NodeInfo, a: Any, b: Any) -> Any:
    xp = ctx.xp
    b = _legacy_broadcast(node, a, b)
    if _is_int(a) and _is_int(b):
        return xp.power(a, b.astype(a.dtype, copy=False))
    if _is_float(a) and a.dtype == b.dtype:
        return xp.power(a, b)
    return xp.power(a.astype(np.float64), b.astype(np.float64)).astype(a.dtype)


@register("Mod", 10)
def _mod(ctx: OpContext, node: NodeInfo, a: Any, b: Any) -> Any:
    xp = ctx.xp
    if node.attr("fmod", 0):
        return xp.fmod(a, b)
    return xp.mod(a, b)


@register("BitShift", 11)
def _bitshift(ctx: OpContext, node: NodeInfo, a: Any, b: Any) -> Any:
    xp = ctx.xp
    if node.attr("direction") == "LEFT":
        return xp.left_shift(a, b)
    return xp.right_shift(a, b)


def _variadic(name: str, fn: Any, mean: bool = False) -> None:
    @register(name)
    def _op(ctx: OpContext, node: NodeInfo, *xs: Any) -> Any:
        xs = [x for x in xs if x is not None]
        if len(xs) == 1:
            return xs[0].copy()
        y = xs[0]
        for x in xs[1:]:
            y = fn(ctx.xp, y, x)
        if mean:
            y = ctx.xp.divide(y, len(xs)).astype(xs[0].dtype, copy=False)
        return y

    _op.__name__ = name


_variadic("Max", lambda xp, a, b: xp.maximum(a, b))
_variadic("Min", lambda xp, a, b: xp.minimum(a, b))
_variadic("Sum", lambda xp, a, b: xp.add(a, b))
_variadic("Mean", lambda xp, a, b: xp.add(a, b), mean=True)


@register("Where", 9)
def _where(ctx: OpContext, node: NodeInfo, cond: Any, a: Any, b: Any) -> Any:
    return ctx.xp.where(cond, a, b)


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


@register("Expand", 8, value_inputs=(1,))
def _expand(ctx: OpContext, node: NodeInfo, x: Any, shape: Any) -> Any:
    xp = ctx.xp
    target = ctx.ints(shape)
    out_shape = np.broadcast_shapes(tuple(x.shape), tuple(target))
    return xp.ascontiguousarray(xp.broadcast_to(x, out_shape))


@register("Tile", 6, value_inputs=(1,))
def _tile(ctx: OpContext, node: NodeInfo, x: Any, repeats: Any) -> Any:
    return ctx.xp.tile(x, tuple(ctx.ints(repeats)))


@register("Range", 11, value_inputs=(0, 1, 2))
def _range(ctx: OpContext, node: NodeInfo, start: Any, limit: Any, delta: Any) -> Any:
    s, l, d = ctx.scalar(start), ctx.scalar(limit), ctx.scalar(delta)
    n = max(int(math.ceil((l - s) / d)), 0)
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

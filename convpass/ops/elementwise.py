"""Element-wise ops over ``xp``: unary math and activations, Clip, Identity, Dropout (inference),
binary and variadic arithmetic, comparison and logic, Where.

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
from convpass.ops.arrays import _is_float, _is_int, _like, acc
from convpass.ops.registry import NodeInfo, OpContext, register

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

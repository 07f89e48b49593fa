"""Inference BatchNormalization as a per-channel affine map, and that map folded into a conv.

The one implementation of the rule: the executor folds a BatchNormalization into the Conv or
ConvTranspose before it with :func:`fold_into_conv`, and the cuda backend's fused element-wise
kernels read an unfolded one as ``x * scale + shift`` from :func:`affine`.

Math::

    y = (x - mean) * gamma / sqrt(var + epsilon) + beta = x * scale + shift
    scale = gamma / sqrt(var + epsilon),  shift = beta - mean * scale

After a Conv (weight ``K x C/g x k...``, bias ``b``, ``K`` output channels)::

    W'[k] = W[k] * scale[k],  b' = (b - mean) * scale + beta

After a ConvTranspose (weight ``C x K/g x k...``): output channel ``k`` of group ``i`` is
``i * K/g + j`` and reads ``W[c, j]`` for the input channels ``c`` of that group, so
``W'[c, j] = W[c, j] * scale[i * K/g + j]``; the bias as for a Conv.

Rules:

0. Where (:func:`fold_site`): a BatchNormalization of the standard domain with five inputs, whose
   only other readers are none (its running-mean / variance outputs unused), reading the one
   output of a Conv or ConvTranspose that nothing else reads and that is no graph output, with
   the conv's weight (and bias, if any) and the four parameters constant. The executor asks this
   when it loads a model, the compiler when it optimizes one, so a tuned conv runs the epilogue
   it was timed with.
1. Only inference mode folds: ``training_mode`` 0 (opset 14 on), ``spatial`` 1 (before opset 9).
2. The parameters are computed in float64 and rounded once, to the type the caller stores them in.
3. Shapes that do not fit (``len(gamma)`` not the conv's output channels, channels that do not
   split into the groups, a non-float weight) do not fold: :func:`fold_into_conv` returns None.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from convpass.ops.registry import NodeInfo

__all__ = ["affine", "fold_into_conv", "fold_site", "is_inference"]

CONV_OPS = ("Conv", "ConvTranspose")


def is_inference(node: NodeInfo) -> bool:
    """Whether a BatchNormalization node normalizes with its given mean and variance (rule 1)."""
    if node.opset >= 14 and node.attr("training_mode", 0):
        return False
    return not (node.opset < 9 and not node.attr("spatial", 1))


def affine(gamma: Any, beta: Any, mean: Any, var: Any, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, shift)`` in float64, one value per channel (module math)."""
    gamma, beta, mean, var = (np.asarray(p, dtype=np.float64).reshape(-1) for p in (gamma, beta, mean, var))
    scale = gamma / np.sqrt(var + float(epsilon))
    return scale, beta - mean * scale


def fold_into_conv(op_type: str, weight: np.ndarray, bias: np.ndarray | None, gamma: Any, beta: Any, mean: Any, var: Any,
                   epsilon: float, group: int = 1) -> tuple[np.ndarray, np.ndarray] | None:
    """The weight and bias of ``op_type`` (Conv or ConvTranspose) with the BatchNormalization that
    reads its output folded in, in the weight's type; None where it does not fold (rule 3)."""
    if weight.dtype.kind != "f":
        return None
    scale, _ = affine(gamma, beta, mean, var, epsilon)
    k = scale.shape[0]
    w64 = weight.astype(np.float64)
    if op_type == "Conv":
        if weight.shape[0] != k:
            return None
        w_new = w64 * scale.reshape((k,) + (1,) * (weight.ndim - 1))
    elif op_type == "ConvTranspose":
        cin, kg = weight.shape[0], weight.shape[1]
        if kg * group != k or cin % group:
            return None
        per = np.repeat(scale.reshape(group, kg), cin // group, axis=0)  # (C_in, K/g)
        w_new = w64 * per.reshape(per.shape + (1,) * (weight.ndim - 2))
    else:
        return None
    b_old = np.zeros(k) if bias is None else np.asarray(bias, dtype=np.float64).reshape(-1)
    if b_old.shape[0] != k:
        return None
    b_new = (b_old - np.asarray(mean, dtype=np.float64).reshape(-1)) * scale + np.asarray(beta, dtype=np.float64).reshape(-1)
    return w_new.astype(weight.dtype), b_new.astype(weight.dtype)


def fold_site(bn: NodeInfo, producer: Any, readers: Any, graph_outputs: Any, is_constant: Any) -> NodeInfo | None:
    """The conv that ``bn`` folds into by rule 0, or None. ``producer(name)``: the node computing a
    value (None for inputs and constants); ``readers(name)``: the nodes reading it;
    ``graph_outputs``: the graph's output names; ``is_constant(name)``: whether a value is constant.
    Nodes are :class:`~convpass.ops.registry.NodeInfo` (standard op types; a tuned conv keeps its
    standard op type, its domain aside)."""
    if bn.op_type != "BatchNormalization" or bn.domain != "" or len(bn.inputs) < 5 or not is_inference(bn):
        return None
    if any(o and (o in graph_outputs or readers(o)) for o in bn.outputs[1:]):
        return None
    conv = producer(bn.inputs[0])
    if conv is None or conv.op_type not in CONV_OPS or len(conv.outputs) != 1:
        return None
    y = conv.outputs[0]
    if y in graph_outputs or len(readers(y)) != 1:
        return None
    w = conv.inputs[1] if len(conv.inputs) > 1 else ""
    b = conv.inputs[2] if len(conv.inputs) > 2 else ""
    if not w or not is_constant(w) or (b and not is_constant(b)) or not all(p and is_constant(p) for p in bn.inputs[1:5]):
        return None
    return conv

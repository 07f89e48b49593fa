"""DequantizeLinear: ``y = (x - zero_point) * scale``, per tensor, per axis or per block.

Quantized exports keep a conv's weight as integers and a DequantizeLinear before the conv; the
compiler folds that chain into a float weight, and the executor runs it where it is not constant.

Rules:

1. ``scale`` is a scalar (per tensor), a 1-D tensor along ``axis`` (per axis, opset 13 on), or,
   with ``block_size`` (opset 21 on), a tensor of ``x``'s rank whose ``axis`` dimension counts
   the blocks of ``block_size`` elements.
2. As ONNX Runtime computes it: the difference ``x - zero_point`` in integers, then the product in
   float32, rounded once to the output type: ``output_dtype`` when given (opset 23 on), else the
   type of ``scale``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from convpass.core.errors import ExecutorError
from convpass.ops.registry import NodeInfo, OpContext, np_dtype, register


def _per_element(xp: Any, p: Any, x: Any, axis: int, block_size: int) -> Any:
    """A scale or zero point, shaped to broadcast over ``x`` (rule 1)."""
    if p.ndim == 0 or p.size == 1 and not block_size:
        return p.reshape(())
    if block_size:
        if p.ndim != x.ndim:
            raise ExecutorError(f"blocked DequantizeLinear needs a scale of rank {x.ndim}, not {p.ndim}")
        return xp.take(xp.repeat(p, block_size, axis=axis), xp.arange(x.shape[axis]), axis=axis)
    if p.ndim != 1 or p.shape[0] != x.shape[axis]:
        raise ExecutorError(f"per-axis DequantizeLinear needs a 1-D scale of {x.shape[axis]} values along axis {axis}, not shape {p.shape}")
    shape = [1] * x.ndim
    shape[axis] = -1
    return p.reshape(shape)


@register("DequantizeLinear", 10)
def _dequantize_linear(ctx: OpContext, node: NodeInfo, x: Any, scale: Any, zero_point: Any = None) -> Any:
    xp = ctx.xp
    axis = int(node.attr("axis", 1))
    axis = axis + x.ndim if axis < 0 else axis
    block_size = int(node.attr("block_size", 0))
    out = np_dtype(int(node.attr("output_dtype"))) if node.attr("output_dtype", 0) else scale.dtype
    centered = x.astype(np.int64)
    if zero_point is not None:
        centered = centered - _per_element(xp, zero_point, x, axis, block_size).astype(np.int64)
    s = _per_element(xp, scale, x, axis, block_size).astype(np.float32)
    return (centered.astype(np.float32) * s).astype(out, copy=False)

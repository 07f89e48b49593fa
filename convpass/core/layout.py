"""Memory formats of arrays: which logical-NCHW arrays are stored channels-last.

The executor keeps ONNX's channels-first semantics and holds some tensors channels-last, as
PyTorch's ``channels_last`` does; ops that move data keep the format they were given.
"""

from __future__ import annotations

from typing import Any

__all__ = ["storage_order"]


def storage_order(x: Any) -> tuple[int, ...] | None:
    """``(0, 2, ..., 1)`` when ``x`` (rank 3-5, logical channels-first) is stored channels-last,
    else None. Ops that move data (Pad, Concat) work on that order, so their results keep the
    format: the layout planner lets them pass NHWC through."""
    if not 3 <= x.ndim <= 5 or x.shape[1] == 1:
        return None
    spatial = [s for d, s in zip(x.shape[2:], x.strides[2:]) if d > 1]
    if not spatial or x.strides[1] >= min(spatial):
        return None
    return (0, *range(2, x.ndim), 1)

"""cuDNN's pooling (``cudnnPoolingForward``): max and average pooling over 2-D / 3-D windows.

What cuDNN's pooling expresses: symmetric pads, no dilation, output size
``floor((in + 2 * pad - window) / stride) + 1``; modes ``max`` (NaN propagated, as ONNX's MaxPool
through NumPy semantics), ``average_include_pad`` and ``average_exclude_pad``. Tensors are
described by explicit strides, so channels-first, channels-last and slices of a larger buffer
are all accepted. ``float32`` and ``float16`` data; alpha / beta are C floats.

The cuda backend uses it where it is the faster measured kernel (benchmarks/op_kernels.py);
everything ONNX allows beyond it (ceil mode, asymmetric pads, dilations, LpPool) runs convpass's
own pooling kernel (:mod:`convpass.kernels.pooling`).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from ctypes import byref, c_float, c_void_p

from convpass.core import cudnn_enums as enums
from convpass.native.cudnn import library

__all__ = ["PoolingDescriptors", "pooling_forward"]


def _ints(values: Sequence[int]) -> ctypes.Array:
    values = [int(v) for v in values]
    return (ctypes.c_int * len(values))(*values)


class PoolingDescriptors:
    """The pooling descriptor plus the x / y tensor descriptors of one pooling problem.

    ``window`` / ``pads`` / ``strides``: per spatial dim (2 or 3 of them); ``x_dims`` / ``y_dims``:
    logical ``(n, c, *spatial)``; ``*_strides`` in elements. Raises ``ValueError`` when cuDNN's
    output dims are not ``y_dims`` (the problem is not one cuDNN's pooling expresses) and
    :class:`~convpass.core.cudnn_enums.CudnnError` when cuDNN rejects a parameter.
    """

    def __init__(self, mode: str, window: Sequence[int], pads: Sequence[int], strides: Sequence[int],
                 x_dims: Sequence[int], x_strides: Sequence[int], y_dims: Sequence[int], y_strides: Sequence[int], dtype: str) -> None:
        self._owned: list[tuple[str, int]] = []
        self.mode = mode
        try:
            data_type = enums.data_type(dtype)
            self.pool = self._create("cudnnCreatePoolingDescriptor", "cudnnDestroyPoolingDescriptor")
            library.call("cudnnSetPoolingNdDescriptor", self.pool, enums.pooling_mode(mode), enums.CUDNN_PROPAGATE_NAN,
                         len(window), _ints(window), _ints(pads), _ints(strides))
            self.x = self._tensor(data_type, x_dims, x_strides)
            self.y = self._tensor(data_type, y_dims, y_strides)
            got = (ctypes.c_int * len(x_dims))()
            library.call("cudnnGetPoolingNdForwardOutputDim", self.pool, self.x, len(x_dims), got)
            if tuple(got) != tuple(int(d) for d in y_dims):
                raise ValueError(f"cuDNN pooling gives output dims {tuple(got)}, the problem needs {tuple(y_dims)}")
        except BaseException:
            self.close()
            raise

    def _create(self, create: str, destroy: str) -> int:
        h = c_void_p()
        library.call(create, byref(h))
        self._owned.append((destroy, h.value))
        return h.value

    def _tensor(self, data_type: int, dims: Sequence[int], strides: Sequence[int]) -> int:
        h = self._create("cudnnCreateTensorDescriptor", "cudnnDestroyTensorDescriptor")
        library.call("cudnnSetTensorNdDescriptor", h, data_type, len(dims), _ints(dims), _ints(strides))
        return h

    def close(self) -> None:
        owned, self._owned = self._owned, []
        for destroy, h in reversed(owned):
            try:
                library.call(destroy, h)
            except Exception:  # noqa: BLE001
                pass

    def __del__(self) -> None:
        if not sys.is_finalizing():
            self.close()


_ONE, _ZERO = c_float(1.0), c_float(0.0)


def pooling_forward(descs: PoolingDescriptors, x_ptr: int, y_ptr: int, handle: int) -> None:
    """``y = pool(x)`` asynchronously on the handle's stream (raw device pointers, raw handle)."""
    library.call("cudnnPoolingForward", handle, descs.pool, byref(_ONE), descs.x, x_ptr, byref(_ZERO), descs.y, y_ptr)

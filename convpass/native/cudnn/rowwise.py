"""cuDNN's softmax and batch normalization over rows, for the cuda backend's row-wise ops
(:mod:`convpass.kernels.normalization`).

* :func:`softmax_rows`: ``cudnnSoftmaxForward`` over a C-contiguous ``(rows, L)`` tensor, seen as
  ``(rows, L, 1, 1)`` with ``CUDNN_SOFTMAX_MODE_CHANNEL`` (accurate or log softmax): the backend's
  Softmax / LogSoftmax.
* :func:`instance_norm_rows`: InstanceNormalization the way frameworks run it on cuDNN: the
  ``(n, c, L)`` tensor seen as one sample of ``n * c`` channels, ``cudnnBatchNormalizationForward
  Training`` in spatial mode with the per-channel scale and bias repeated ``n`` times. The backend
  runs it where it measured faster than convpass's kernel (many rows of 1-4 thousand elements).
"""

from __future__ import annotations

import ctypes
from ctypes import byref, c_double, c_float, c_void_p
from typing import Any

from convpass.core import cudnn_enums as enums
from convpass.native.cudnn import library

__all__ = ["instance_norm_rows", "softmax_rows"]

_SOFTMAX_ACCURATE, _SOFTMAX_LOG = 1, 2
_SOFTMAX_MODE_CHANNEL = 1
_BATCHNORM_SPATIAL = 1
_ONE, _ZERO = c_float(1.0), c_float(0.0)


class _Tensor:
    """A packed NCHW 4-D tensor descriptor, destroyed with the object."""

    def __init__(self, dtype: str, dims: tuple[int, int, int, int]) -> None:
        h = c_void_p()
        library.call("cudnnCreateTensorDescriptor", byref(h))
        self.h = h.value
        n, c, hh, w = dims
        strides = (c * hh * w, hh * w, w, 1)
        arr = ctypes.c_int * 4
        library.call("cudnnSetTensorNdDescriptor", self.h, enums.data_type(dtype), 4, arr(*dims), arr(*strides))

    def __del__(self) -> None:
        try:
            library.call("cudnnDestroyTensorDescriptor", self.h)
        except Exception:  # noqa: BLE001
            pass


_DESCS: dict[tuple, _Tensor] = {}


def _desc(dtype: str, dims: tuple[int, int, int, int]) -> int:
    key = (dtype, dims)
    d = _DESCS.get(key)
    if d is None:
        d = _DESCS[key] = _Tensor(dtype, dims)
    return d.h


def softmax_rows(x: Any, y: Any, rows: int, length: int, log: bool, handle: int) -> None:
    """``y = softmax(x)`` (or log-softmax) over each row of ``length`` elements (CuPy arrays)."""
    d = _desc(str(x.dtype), (rows, length, 1, 1))
    library.call("cudnnSoftmaxForward", handle, _SOFTMAX_LOG if log else _SOFTMAX_ACCURATE, _SOFTMAX_MODE_CHANNEL,
                 byref(_ONE), d, int(x.data.ptr), byref(_ZERO), d, int(y.data.ptr))


MIN_EPSILON = 1e-5  # CUDNN_BN_MIN_EPSILON of the cuDNN versions convpass supports, at most


def instance_norm_rows(x: Any, y: Any, rows: int, length: int, scale_rows: Any, bias_rows: Any, eps: float, save: Any, handle: int) -> None:
    """InstanceNormalization of ``x`` (``rows = n * c`` rows of ``length``) by cuDNN's batch norm;
    ``scale_rows`` / ``bias_rows``: float32 per row; ``save``: float32 scratch of ``2 * rows``;
    ``eps`` at least :data:`MIN_EPSILON`."""
    if eps < MIN_EPSILON:
        raise ValueError(f"cuDNN's batch norm takes epsilon >= {MIN_EPSILON:g}, not {eps:g}")
    d = _desc(str(x.dtype), (1, rows, length, 1))
    p = _desc("float32", (1, rows, 1, 1))
    library.call("cudnnBatchNormalizationForwardTraining", handle, _BATCHNORM_SPATIAL, byref(_ONE), byref(_ZERO),
                 d, int(x.data.ptr), d, int(y.data.ptr), p, int(scale_rows.data.ptr), int(bias_rows.data.ptr),
                 c_double(1.0), None, None, c_double(eps), int(save.data.ptr), int(save.data.ptr) + 4 * rows)

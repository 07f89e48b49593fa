"""convpass.native.cudnn: the cuDNN 9 legacy convolution API through ctypes, on CuPy arrays and streams.

* :mod:`convpass.native.cudnn.library` finds and loads ``libcudnn.so.9`` (``version()``, ``path()``).
* :mod:`convpass.core.cudnn_enums` owns cuDNN's numbering: algorithm names per direction, determinism,
  math / data types, formats, status codes, and the exceptions ``CudnnError`` / ``CudnnNotFound``.
* :mod:`convpass.native.cudnn.descriptors` derives descriptor parameters from a ``ProblemKey`` (pure
  Python) and builds the descriptors (``ConvDescriptors``).
* :mod:`convpass.native.cudnn.api` holds handles, heuristics, search, workspace sizes, execution and the
  call listeners; :mod:`convpass.native.cudnn.arrays` the arrays they are given (storage dtypes,
  memory formats, the checks against the descriptors, workspaces).
* :mod:`convpass.native.cudnn.graph_api` is the second tuning space: cuDNN's graph-API engine
  configurations through NVIDIA's ``nvidia-cudnn-frontend`` package (optional; not imported here).

Importing this package neither imports CuPy nor loads cuDNN; both happen on first use.
"""

from convpass.core.cudnn_enums import CudnnError, CudnnNotFound, algo_id, algo_name, algo_names, is_deterministic
from convpass.native.cudnn.api import (
    AlgoPerf,
    CudnnCall,
    Handle,
    add_call_listener,
    conv_bias_activation_forward,
    find,
    get_handle,
    heuristic,
    record_calls,
    remove_call_listener,
    run,
    workspace_size,
)
from convpass.native.cudnn.arrays import as_layout, channel_slice, empty_like_layout, layout_of, storage_dtype
from convpass.native.cudnn.descriptors import ConvDescriptors, DescriptorParams, descriptor_params, strides_for

__all__ = [
    "AlgoPerf",
    "ConvDescriptors",
    "CudnnCall",
    "CudnnError",
    "CudnnNotFound",
    "DescriptorParams",
    "Handle",
    "add_call_listener",
    "algo_id",
    "algo_name",
    "algo_names",
    "as_layout",
    "channel_slice",
    "conv_bias_activation_forward",
    "descriptor_params",
    "empty_like_layout",
    "find",
    "get_handle",
    "heuristic",
    "is_deterministic",
    "layout_of",
    "record_calls",
    "remove_call_listener",
    "run",
    "storage_dtype",
    "strides_for",
    "workspace_size",
]

"""A model file as the executor reads it: parsed once, its SHA-256 computed beside the parse (the
kernel side-car vouches for exactly those bytes), and its initializers as arrays, those stored as
external data memory-mapped copy on write rather than read (no whole-model copies at start-up).

- :func:`load`: the ``ModelProto`` of a path, bytes or proto, and a function giving the file's hash;
  the file is read as :mod:`convpass.core.files` reads (no FIFO or device, at most 2 GiB) and checked
  as :mod:`convpass.core.model_check` checks every model. Tensors besides the graph's initializers that are stored outside are read in from the model's
  folder; given without a path, such a tensor is an :class:`ExecutorError`.
- :func:`read_initializers`: the graph's initializers as NumPy arrays, external ones mapped from
  files under the model's folder (a location outside it, a truncated file or a wrong length is an
  error naming the initializer).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.defs
import onnx.external_data_helper
from onnx import numpy_helper

from convpass.core import model_check
from convpass.core.errors import ConvpassError, ExecutorError, FileError
from convpass.core.files import MODEL_LIMIT, read_bytes

__all__ = ["folder", "load", "read_initializers"]


def folder(model: Any) -> str | None:
    """The folder external data is found in: the model file's, or None for a model not given as a path."""
    return os.path.dirname(os.path.abspath(model)) if isinstance(model, (str, os.PathLike)) else None


def load(model: Any, min_opset: int = 1) -> tuple[onnx.ModelProto, Callable[[], str | None]]:
    """The model, and a function that returns the SHA-256 of its file's bytes (None when it was
    given as a ModelProto). The hash is computed on a thread of its own (hashlib lets go of the GIL
    on large buffers: 0.05-0.1 s for 100 MB), beside the parse and whatever the caller does before
    it asks for it. ``min_opset``: the lowest ``ai.onnx`` opset taken. The model is checked as :mod:`convpass.core.model_check` checks every model
    (opset, text, tensor sizes, external data) and its tensors stored outside, but for the main
    graph's initializers, are read in."""
    if isinstance(model, onnx.ModelProto):
        _check(model, "model", None, min_opset)
        return model, lambda: None
    if isinstance(model, (bytes, bytearray)):
        try:
            proto = onnx.load_from_string(bytes(model))
        except Exception as e:  # noqa: BLE001
            raise ExecutorError(f"cannot parse the model bytes: {e}") from None
        _check(proto, "model bytes", None, min_opset)
        return proto, lambda: hashlib.sha256(model).hexdigest()
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.exists(path):
            raise ExecutorError(f"model file not found: {path}")
        try:
            data = read_bytes(path, "model", MODEL_LIMIT)  # read once: parsed and hashed from the same bytes
        except FileError as e:
            raise ExecutorError(str(e)) from None
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="convpass-sha256")
        digest = pool.submit(lambda: hashlib.sha256(data).hexdigest())
        pool.shutdown(wait=False)  # its one job runs on
        try:
            proto = onnx.load_from_string(data)
        except Exception as e:  # noqa: BLE001
            raise ExecutorError(f"cannot load {path}: not an ONNX model, or the file is truncated ({type(e).__name__})") from None
        base_dir = Path(folder(path))  # type: ignore[arg-type]
        _check(proto, path, base_dir, min_opset)
        # the graph's initializers stay in their external file (read_initializers maps them);
        # every other tensor stored outside (a Constant's value, a sub-graph's initializer) is
        # read in, so the model's other readers never meet a file reference
        model_check.inline_external_tensors(proto, base_dir)
        return proto, digest.result
    raise ExecutorError(f"expected an onnx.ModelProto, a path or bytes, not {type(model).__name__}")


def _check(proto: onnx.ModelProto, label: str, base_dir: Path | None, min_opset: int = 1) -> None:
    """:mod:`convpass.core.model_check`'s checks, as an :class:`ExecutorError`. A model given
    without a path (``base_dir`` None) may hold no tensor stored outside (onnx would look for it in
    the working folder) but for the main graph's initializers, which :func:`read_initializers`
    refuses by name."""
    try:
        model_check.check_opset(proto, label, onnx.defs.onnx_opset_version(), "the convpass executor runs", lowest=min_opset)
        if base_dir is not None:
            model_check.check_model_file(proto, label, base_dir)
            return
        main = {id(t) for t in proto.graph.initializer}
        for where, t in model_check.tensors(proto):
            if onnx.external_data_helper.uses_external_data(t):
                if id(t) in main:
                    continue
                raise ExecutorError(f"tensor {t.name!r} is stored in an external file, and the model was not given as a path to find it by")
            model_check.check_tensor(t, where, label, None)
    except ExecutorError:
        raise
    except ConvpassError as e:
        raise ExecutorError(str(e)) from None


# element types whose external data is mapped as it lies on disk (little-endian, one element per
# item); the rest (strings, packed 4-bit / 2-bit / 6-bit, ml_dtypes' floats) are read by onnx
_MAPPABLE = frozenset({
    onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BOOL,
    onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16,
    onnx.TensorProto.INT32, onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64,
})


def read_initializers(proto: onnx.ModelProto, base_dir: str | None = None) -> dict[str, np.ndarray]:
    """The initializers as arrays. One stored as external data (the file beside the model,
    ``base_dir``) is memory-mapped copy on write (:func:`_map_external`): no copy of the weights
    is made in host memory before they go where they are used, and nothing the executor does to an
    array reaches the file. The file stays mapped while the executor (or an array of it) lives:
    replace it by a new file (as convpass writes models: a rename), never cut it short in place,
    which makes a later read of the lost pages end the process (SIGBUS)."""
    constants: dict[str, np.ndarray] = {}
    for t in proto.graph.initializer:
        try:
            if onnx.external_data_helper.uses_external_data(t):
                if base_dir is None:
                    raise ValueError("its data is in an external file, and the model was not given as a path to find it by")
                constants[t.name] = _map_external(t, base_dir)
            else:
                constants[t.name] = numpy_helper.to_array(t)
        except Exception as e:  # noqa: BLE001
            raise ExecutorError(f"cannot read initializer {t.name!r}: {e}") from None
    return constants


def _map_external(t: onnx.TensorProto, base_dir: str) -> np.ndarray:
    """``t``'s external data as a copy-on-write memory map (what onnx reads for the types it
    cannot map). The file must lie under ``base_dir`` (as onnx requires: no absolute location, no
    way out through ``..`` or a link) and hold the bytes the tensor's shape needs."""
    if t.data_type not in _MAPPABLE or not np.little_endian:
        return numpy_helper.to_array(t, base_dir)
    info = onnx.external_data_helper.ExternalDataInfo(t)
    root = os.path.realpath(base_dir)
    path = os.path.realpath(os.path.join(root, info.location))
    if not info.location or os.path.isabs(info.location) or os.path.commonpath([root, path]) != root:
        raise ValueError(f"external data location {info.location!r} is outside the model's folder")
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).newbyteorder("<")
    dims = tuple(int(d) for d in t.dims)
    nbytes = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    offset = info.offset or 0
    if info.length is not None and info.length != nbytes:
        raise ValueError(f"external data length {info.length} is not the {nbytes} bytes of shape {list(dims)} {dtype.name}")
    size = os.path.getsize(path)
    if offset + nbytes > size:
        raise ValueError(f"external data file {info.location!r} holds {size} bytes, fewer than offset {offset} + {nbytes}")
    if nbytes == 0:
        return np.empty(dims, dtype)
    if offset % dtype.alignment:  # onnx packs small tensors unaligned: a copy, aligned for whoever reads it
        with open(path, "rb") as f:
            f.seek(offset)
            return np.frombuffer(f.read(nbytes), dtype=dtype).reshape(dims).copy()
    # a plain array over the map (which it keeps open): results computed from it are plain arrays too
    return np.memmap(path, dtype=dtype, mode="c", offset=offset, shape=dims or (1,)).view(np.ndarray).reshape(dims)

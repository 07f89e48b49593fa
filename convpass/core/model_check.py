"""What convpass checks in a model file beyond ``onnx.checker``: the file came from anywhere.

Rules (each failure is one :class:`~convpass.core.errors.ModelLoadError` naming the file and the
tensor, node or field):

1. The ``ai.onnx`` opset is one convpass supports (:data:`MIN_OPSET` to :data:`MAX_OPSET` to
   optimize; the executor up to the newest opset the installed ``onnx`` defines, from
   :data:`MIN_OPSET` in ``convpass run``, from opset 1 through its Python API, which ONNX's
   backend tests drive).
2. Every text field is valid UTF-8 (protobuf hands invalid text over as bytes, which every reader
   after the parse trips on).
3. Every tensor, wherever it is (the graph's initializers, node attributes, sub-graphs of If / Loop
   / Scan at any depth, model-local functions), has non-negative dims and holds exactly the data
   its dims declare: a tensor that declares 10^12 elements and holds none is refused, not
   allocated.
4. A tensor stored as external data names a regular file inside the model's folder (no absolute
   path, no way out through ``..`` or a link; no FIFO, device or folder), with a non-negative
   integer offset and a length equal to the bytes its dims need, all within the file.
5. :func:`inline_external_tensors`: after the checks, every tensor stored outside that is not an
   initializer of the main graph (a Constant's value, a sub-graph's initializer) is read into the
   model, so that whatever convpass writes from it is complete wherever it is saved and
   whichever the working folder; the main graph's initializers stay outside (they may be large).
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import onnx
from google.protobuf.descriptor import FieldDescriptor

from convpass.core.errors import ModelLoadError
from convpass.core.files import kind_of

__all__ = ["MAX_OPSET", "MIN_OPSET", "check_model_file", "check_opset", "check_opset_version", "check_tensor", "expected_bytes", "inline_external_tensors", "tensors"]

MIN_OPSET = 7
MAX_OPSET = 21

_T = onnx.TensorProto
_PACKED_BITS = {_T.INT4: 4, _T.UINT4: 4, _T.FLOAT4E2M1: 4, getattr(_T, "INT2", -1): 2, getattr(_T, "UINT2", -1): 2}
# the typed field that holds a tensor's data when it is not raw, and how many field entries one element takes
_FIELDS: dict[int, tuple[str, float]] = {
    _T.FLOAT: ("float_data", 1), _T.COMPLEX64: ("float_data", 2), _T.DOUBLE: ("double_data", 1), _T.COMPLEX128: ("double_data", 2),
    _T.INT64: ("int64_data", 1), _T.UINT32: ("uint64_data", 1), _T.UINT64: ("uint64_data", 1), _T.STRING: ("string_data", 1),
    **{t: ("int32_data", 1) for t in (_T.INT32, _T.INT16, _T.INT8, _T.UINT16, _T.UINT8, _T.BOOL, _T.FLOAT16, _T.BFLOAT16,
                                      _T.FLOAT8E4M3FN, _T.FLOAT8E4M3FNUZ, _T.FLOAT8E5M2, _T.FLOAT8E5M2FNUZ)},
    **{t: ("int32_data", bits / 8) for t, bits in _PACKED_BITS.items() if t >= 0},
}


def check_opset(proto: onnx.ModelProto, label: str, highest: int = MAX_OPSET, what: str = "convpass supports",
                lowest: int = MIN_OPSET) -> None:
    """Rule 1; ``lowest``, ``highest``, ``what``: another range (the executor runs every opset ONNX defines)."""
    opsets = {o.domain or "ai.onnx": o.version for o in proto.opset_import}
    version = opsets.get("ai.onnx")
    if version is None:
        raise ModelLoadError(f"{label}: the model imports no ai.onnx opset")
    check_opset_version(version, label, lowest, highest, what)


def check_opset_version(version: int, label: str, lowest: int = MIN_OPSET, highest: int = MAX_OPSET, what: str = "convpass supports") -> None:
    if not lowest <= version <= highest:
        raise ModelLoadError(
            f"{label}: unsupported opset {version} ({what} ai.onnx opsets {lowest} to {highest}); "
            "convert it with onnx.version_converter first"
        )


def check_model_file(proto: onnx.ModelProto, label: str, base_dir: Path | None) -> None:
    """Rules 2 to 4 (``base_dir``: the model's folder, None when it came without a path)."""
    _check_text(proto, label)
    for where, tensor in tensors(proto):
        check_tensor(tensor, where, label, base_dir)


def tensors(proto: onnx.ModelProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    """Every tensor of the model with where it is: ``("initializer 'w'", tensor)``; the main
    graph's initializers first."""
    for t in proto.graph.initializer:
        yield f"initializer {t.name!r}", t
    for s in proto.graph.sparse_initializer:
        yield f"sparse initializer {s.values.name!r}", s.values
        yield f"sparse initializer {s.values.name!r} (indices)", s.indices
    yield from _in_nodes(proto.graph.node, "")
    for f in proto.functions:
        yield from _in_nodes(f.node, f" of function {f.name!r}")


def _in_nodes(nodes, where: str) -> Iterator[tuple[str, onnx.TensorProto]]:
    for node in nodes:
        label = f"node {node.name or (node.output[0] if node.output else node.op_type)!r}{where}"
        for a in node.attribute:
            if a.HasField("t"):
                yield f"tensor attribute {a.name!r} of {label}", a.t
            for t in a.tensors:
                yield f"tensor attribute {a.name!r} of {label}", t
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                inner = f" in sub-graph {a.name!r} of {label}"
                for t in g.initializer:
                    yield f"initializer {t.name!r}{inner}", t
                yield from _in_nodes(g.node, inner)


def _check_text(message, label: str, path: str = "") -> None:
    """Rule 2: every string field of ``message`` and of the messages in it."""
    for field, value in message.ListFields():
        name = f"{path}.{field.name}" if path else field.name
        if field.type == FieldDescriptor.TYPE_STRING:
            values = value if field.is_repeated else [value]
            for v in values:
                if isinstance(v, bytes):
                    raise ModelLoadError(f"{label}: field {name} is not valid UTF-8 text ({v[:40]!r}): not a valid ONNX model")
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if not field.is_repeated:
                _check_text(value, label, name)
                continue
            for i, v in enumerate(value):
                _check_text(v, label, f"{name}[{i}]")


def element_count(tensor: onnx.TensorProto) -> int:
    return math.prod(int(d) for d in tensor.dims)


def expected_bytes(tensor: onnx.TensorProto) -> int | None:
    """The bytes of the tensor's data as stored raw, or None for a type that has no fixed size."""
    n = element_count(tensor)
    bits = _PACKED_BITS.get(tensor.data_type)
    if bits is not None:
        return (n * bits + 7) // 8
    if tensor.data_type in (_T.STRING, _T.UNDEFINED) or tensor.data_type not in _FIELDS:
        return None
    return n * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _size(n: int) -> str:
    return f"{n:,}"


def check_tensor(tensor: onnx.TensorProto, where: str, label: str, base_dir: Path | None) -> None:
    """Rules 3 and 4 for one tensor."""
    if any(d < 0 for d in tensor.dims):
        raise ModelLoadError(f"{label}: {where} has negative dims {list(tensor.dims)}")
    n = element_count(tensor)
    nbytes = expected_bytes(tensor)
    if tensor.data_location == _T.EXTERNAL:
        _check_external(tensor, where, label, base_dir, nbytes)
        return
    if tensor.HasField("raw_data"):
        if nbytes is not None and len(tensor.raw_data) != nbytes:
            raise ModelLoadError(
                f"{label}: {where} declares dims {list(tensor.dims)} ({_size(nbytes)} bytes) but holds {_size(len(tensor.raw_data))} bytes"
            )
        return
    field, per = _FIELDS.get(tensor.data_type, ("", 0))
    if not field:
        return
    held = len(getattr(tensor, field))
    wanted = math.ceil(n * per)
    if held != wanted:
        raise ModelLoadError(f"{label}: {where} declares dims {list(tensor.dims)} ({_size(n)} elements) but holds {_size(held)} values")


def _external_info(tensor: onnx.TensorProto, where: str, label: str) -> tuple[str, int, int | None]:
    entries = {e.key: e.value for e in tensor.external_data}
    location = entries.get("location", "")
    numbers = {}
    for key in ("offset", "length"):
        text = entries.get(key)
        if text is None:
            continue
        try:
            value = int(text)
        except ValueError:
            raise ModelLoadError(f"{label}: external data of {where} has {key} {text[:40]!r}, not an integer") from None
        if value < 0:
            raise ModelLoadError(f"{label}: external data of {where} has a negative {key} ({value})")
        numbers[key] = value
    return location, numbers.get("offset", 0), numbers.get("length")


def _check_external(tensor: onnx.TensorProto, where: str, label: str, base_dir: Path | None, nbytes: int | None) -> None:
    location, offset, length = _external_info(tensor, where, label)
    if base_dir is None:
        raise ModelLoadError(f"{label}: {where} has external data ({location!r}); pass the model's path, not the model itself")
    if not location:
        raise ModelLoadError(f"{label}: {where} is stored as external data but names no location")
    try:
        target = (base_dir / location).resolve()
    except (OSError, RuntimeError) as e:  # a link loop
        raise ModelLoadError(f"{label}: external data file {location!r} of {where} cannot be followed ({e})") from None
    if os.path.isabs(location) or base_dir.resolve() not in target.parents:
        raise ModelLoadError(f"{label}: external data of {where} points outside the model's folder ({location!r}); refused")
    try:
        st = os.stat(target)
    except FileNotFoundError:
        raise ModelLoadError(f"{label}: external data file {location!r} of {where} is missing") from None
    except OSError as e:
        raise ModelLoadError(f"{label}: external data file {location!r} of {where}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelLoadError(f"{label}: external data file {location!r} of {where} is {kind_of(st.st_mode)}, not a regular file: refused")
    if nbytes is None:
        raise ModelLoadError(f"{label}: {where} of type {onnx.helper.tensor_dtype_to_string(tensor.data_type)} cannot be stored as external data")
    if length is not None and length != nbytes:
        raise ModelLoadError(
            f"{label}: external data of {where} has length {_size(length)}, but its dims {list(tensor.dims)} need {_size(nbytes)} bytes"
        )
    if offset + nbytes > st.st_size:
        raise ModelLoadError(
            f"{label}: external data file {location!r} holds {_size(st.st_size)} bytes, fewer than {where} needs "
            f"(offset {_size(offset)} + {_size(nbytes)} bytes): the file is truncated"
        )


def inline_external_tensors(proto: onnx.ModelProto, base_dir: Path) -> None:
    """Rule 5, in place; after :func:`check_model_file`."""
    main = {id(t) for t in proto.graph.initializer}
    for _, tensor in tensors(proto):
        if id(tensor) in main or tensor.data_location != _T.EXTERNAL:
            continue
        location, offset, _ = _external_info(tensor, "", "")
        nbytes = expected_bytes(tensor) or 0
        with open((base_dir / location).resolve(), "rb") as f:
            f.seek(offset)
            data = f.read(nbytes)
        tensor.raw_data = data
        tensor.data_location = _T.DEFAULT
        del tensor.external_data[:]

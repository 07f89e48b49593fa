"""Loading and saving models: validation of what comes in, atomic writes of what goes out.

Loading refuses, with one clear line each: missing files, special files (FIFOs, devices) and files
larger than a protobuf can be, files that are not ONNX (or truncated), empty graphs, and everything
:mod:`convpass.core.model_check` checks (opsets, text, tensor sizes, external data); tensors stored
outside that are not main-graph initializers are read in. Saving refuses the outputs
:func:`convpass.core.files.check_output` refuses (the input model and its data among them), writes
into a temporary folder beside the destination and renames into place, so a failed run never leaves
a partial output; models too large for one protobuf (2 GB) and models that came with external data
are written with their tensors in ``<output>.data`` beside the output.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from convpass.core import model_check
from convpass.core.errors import FileError, ModelLoadError
from convpass.core.files import check_output, os_error, read_bytes
from convpass.core.model_check import MAX_OPSET, MIN_OPSET  # noqa: F401  (where callers have always found them)

_PROTOBUF_LIMIT = 2**31 - 1
# Above this many bytes of tensor data a model is saved with external data even if it came without.
_EXTERNAL_DATA_THRESHOLD = 1 << 30
SOURCE_FILES_KEY = "convpass.source_files"  # model.meta: the files the model was read from (never written over)


def load_model(source: str | os.PathLike | onnx.ModelProto | bytes) -> ir.Model:
    """Read and validate a model from a path, a ModelProto or serialized bytes
    (:mod:`convpass.core.model_check` says what is checked)."""
    base_dir = None
    data: bytes | None = None  # the serialized model, when it came serialized: the checker reads it as it is
    if isinstance(source, onnx.ModelProto):
        proto, label = source, "model"
    elif isinstance(source, bytes):
        data, label = source, "model bytes"
        proto = _parse(data, label)
    else:
        path = Path(source)
        label = str(path)
        data = _read(path)
        proto = _parse(data, label)
        base_dir = path.resolve().parent
    _validate(proto, label, base_dir)
    _check(proto, label, data)
    if base_dir is not None and _has_external_data(proto, everywhere=True):
        if data is not None:
            data = None  # the proto changes below: the bytes no longer describe it
        model_check.inline_external_tensors(proto, base_dir)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as e:  # noqa: BLE001  (onnx-ir raises several kinds on what the checker lets through)
        raise ModelLoadError(f"{label}: cannot read the model: {_first_line(e)}") from None
    if base_dir is not None:
        ir.external_data.set_base_dir(model.graph, base_dir)
    model.meta["convpass.source_has_external_data"] = _has_external_data(proto)
    files: list = []
    if base_dir is not None and isinstance(source, (str, os.PathLike)):
        files = _source_files(Path(source), proto, base_dir)
    model.meta[SOURCE_FILES_KEY] = files
    return model


def _read(path: Path) -> bytes:
    try:
        data = read_bytes(path, "model", _PROTOBUF_LIMIT)
    except FileError as e:
        raise ModelLoadError(str(e).replace("model ", "", 1) if "no such file" in str(e) else str(e)) from None
    if not data:
        raise ModelLoadError(f"{path}: file is empty, not an ONNX model")
    return data


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _source_files(path: Path, proto: onnx.ModelProto, base_dir: Path) -> list[Path]:
    """The model file and its external data files: what an output must never replace."""
    files = [path]
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in t.external_data if e.key == "location"), "")
            files.append(base_dir / location)
    return list(dict.fromkeys(files))


def _parse(data: bytes, label: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelLoadError(f"{label}: not an ONNX model, or the file is truncated ({type(e).__name__})") from None
    if not proto.HasField("graph") or proto.ir_version <= 0:
        raise ModelLoadError(f"{label}: not an ONNX model, or the file is truncated (no graph / IR version)")
    return proto


def _has_external_data(proto: onnx.ModelProto, everywhere: bool = False) -> bool:
    """Whether a main-graph initializer (``everywhere``: any tensor but those) is stored outside."""
    if not everywhere:
        return any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    main = {id(t) for t in proto.graph.initializer}
    return any(t.data_location == onnx.TensorProto.EXTERNAL and id(t) not in main for _, t in model_check.tensors(proto))


def _validate(proto: onnx.ModelProto, label: str, base_dir: Path | None) -> None:
    if len(proto.graph.node) == 0:
        raise ModelLoadError(f"{label}: the graph is empty (no nodes)")
    model_check.check_opset(proto, label)
    model_check.check_model_file(proto, label, base_dir)


def _check(proto: onnx.ModelProto, label: str, data: bytes | None = None) -> None:
    """ONNX's checker; with external data it needs the model's folder, which it takes from a path.
    ``data``: ``proto`` serialized, when it was read that way. The checker takes bytes, so a model
    read from a file is checked without serializing it again (a 100 MB model: 0.2 s, and as much
    again for the protobuf's size)."""
    try:
        if _has_external_data(proto):
            onnx.checker.check_model(label)
        elif data is not None:
            if len(data) < _PROTOBUF_LIMIT:
                onnx.checker.check_model(data)
        elif proto.ByteSize() < _PROTOBUF_LIMIT:
            onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{label}: invalid ONNX model: {first}") from None


def _tensor_bytes(model: ir.Model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            total += value.const_value.nbytes
    return total


def save_model(model: ir.Model, path: str | os.PathLike, protect: Iterable[tuple[str | os.PathLike, str]] = ()) -> list[Path]:
    """Write ``model`` to ``path`` atomically; returns the files written (the model, maybe its data).

    External data is used when the source model had it or the tensors exceed 1 GiB; it goes to
    ``<path name>.data`` beside the output. Refused (:func:`convpass.core.files.check_output`): an
    empty path, a folder, a special file, and the files the model was read from or ``protect``
    names (``(path, what it is)``, e.g. the tuning cache).
    """
    use_external = bool(model.meta.get("convpass.source_has_external_data")) or _tensor_bytes(model) > _EXTERNAL_DATA_THRESHOLD
    sources = [(f, "the input model" if i == 0 else "the input model's external data")
               for i, f in enumerate(model.meta.get(SOURCE_FILES_KEY, []))]
    guarded = [*sources, *protect]
    out = check_output(path, "output", guarded)
    folder = out.parent
    data_name = out.name + ".data"
    if use_external:
        check_output(folder / data_name, "the output's external data", guarded)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=folder))
    except OSError as e:
        raise os_error(out, e) from None
    try:
        staged = staging / out.name
        try:
            if use_external:
                _save_with_external_data(model, staged, data_name)
            else:
                ir.save(model, staged)
            written = []
            if use_external and (staging / data_name).exists():
                os.replace(staging / data_name, folder / data_name)
                written.append(folder / data_name)
            os.replace(staged, out)
        except OSError as e:
            raise os_error(out, e) from None
        written.insert(0, out)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _save_with_external_data(model: ir.Model, path: Path, data_name: str, threshold: int = 256) -> None:
    """``ir.save`` with the main graph's initializers over ``threshold`` bytes in ``data_name``
    beside ``path``, and every other tensor in the model file: ONNX Runtime resolves a sub-graph's
    external data against the working folder, not the model's, so a sub-graph's initializer stored
    outside would load only when started from the right folder. The model is unchanged after."""
    moved: list[tuple[ir.Value, Any]] = []
    try:
        outside = [v for v in model.graph.initializers.values() if v.const_value is not None and v.const_value.nbytes > threshold]
        if outside:
            tensors = ir.external_data.convert_tensors_to_external([v.const_value for v in outside if v.const_value is not None], path.parent, data_name)
            for value, tensor in zip(outside, tensors):
                moved.append((value, value.const_value))
                value.const_value = tensor
        for graph in model.graphs():
            for value in graph.initializers.values():
                if isinstance(value.const_value, ir.ExternalTensor) and not any(value is m for m, _ in moved):
                    moved.append((value, value.const_value))
                    (value.const_value,) = ir.external_data.convert_tensors_from_external([value.const_value])
        ir.save(model, path)
    finally:
        for value, tensor in moved:
            value.const_value = tensor


def to_proto(model: ir.Model) -> onnx.ModelProto:
    return ir.serde.serialize_model(model)

"""Loading and saving models: validation of what comes in, atomic writes of what goes out.

Loading refuses, with one clear line each: missing files, files that are not ONNX (or truncated),
empty graphs, opsets outside what convpass supports, and external-data paths that escape the
model's folder. Saving writes into a temporary folder beside the destination and renames into place,
so a failed run never leaves a partial output; models too large for one protobuf (2 GB) and models
that came with external data are written with their tensors in ``<output>.data`` beside the output.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from convpass.core.errors import ModelLoadError

MIN_OPSET = 7
MAX_OPSET = 21
_PROTOBUF_LIMIT = 2**31 - 1
# Above this many bytes of tensor data a model is saved with external data even if it came without.
_EXTERNAL_DATA_THRESHOLD = 1 << 30


def load_model(source: str | os.PathLike | onnx.ModelProto | bytes) -> ir.Model:
    """Read and validate a model from a path, a ModelProto or serialized bytes."""
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
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such file")
        if path.stat().st_size == 0:
            raise ModelLoadError(f"{path}: file is empty, not an ONNX model")
        data = path.read_bytes()
        proto = _parse(data, label)
        base_dir = path.resolve().parent
    _validate(proto, label, base_dir)
    _check(proto, label, data)
    model = ir.serde.deserialize_model(proto)
    if base_dir is not None:
        ir.external_data.set_base_dir(model.graph, base_dir)
    model.meta["convpass.source_has_external_data"] = _has_external_data(proto)
    return model


def _parse(data: bytes, label: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelLoadError(f"{label}: not an ONNX model, or the file is truncated ({type(e).__name__})") from None
    if not proto.HasField("graph") or proto.ir_version <= 0:
        raise ModelLoadError(f"{label}: not an ONNX model, or the file is truncated (no graph / IR version)")
    return proto


def _tensors(proto: onnx.ModelProto):
    yield from proto.graph.initializer
    for node in proto.graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t


def _has_external_data(proto: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in _tensors(proto))


def _validate(proto: onnx.ModelProto, label: str, base_dir: Path | None) -> None:
    if len(proto.graph.node) == 0:
        raise ModelLoadError(f"{label}: the graph is empty (no nodes)")
    opsets = {o.domain or "ai.onnx": o.version for o in proto.opset_import}
    version = opsets.get("ai.onnx")
    if version is None:
        raise ModelLoadError(f"{label}: the model imports no ai.onnx opset")
    if not MIN_OPSET <= version <= MAX_OPSET:
        raise ModelLoadError(
            f"{label}: unsupported opset {version} (convpass supports ai.onnx opsets {MIN_OPSET} to {MAX_OPSET}); "
            "convert it with onnx.version_converter first"
        )
    for tensor in _tensors(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        if base_dir is None:
            raise ModelLoadError(
                f"{label}: tensor {tensor.name!r} has external data ({location!r}); pass the model's path, not the proto"
            )
        target = (base_dir / location).resolve()
        if os.path.isabs(location) or base_dir not in target.parents:
            raise ModelLoadError(
                f"{label}: external data of tensor {tensor.name!r} points outside the model's folder ({location!r}); refused"
            )
        if not target.is_file():
            raise ModelLoadError(f"{label}: external data file {location!r} of tensor {tensor.name!r} is missing")


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


def save_model(model: ir.Model, path: str | os.PathLike) -> list[Path]:
    """Write ``model`` to ``path`` atomically; returns the files written (the model, maybe its data).

    External data is used when the source model had it or the tensors exceed 1 GiB; it goes to
    ``<path name>.data`` beside the output.
    """
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise ModelLoadError(f"output directory {folder} does not exist")
    use_external = bool(model.meta.get("convpass.source_has_external_data")) or _tensor_bytes(model) > _EXTERNAL_DATA_THRESHOLD
    data_name = out.name + ".data"
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=folder))
    try:
        staged = staging / out.name
        if use_external:
            ir.save(model, staged, external_data=data_name)
        else:
            ir.save(model, staged)
        written = []
        if use_external and (staging / data_name).exists():
            os.replace(staging / data_name, folder / data_name)
            written.append(folder / data_name)
        os.replace(staged, out)
        written.insert(0, out)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def to_proto(model: ir.Model) -> onnx.ModelProto:
    return ir.serde.serialize_model(model)


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename: a reader, or an
    interrupted run, never sees half a file, and a failure leaves whatever was there before."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target

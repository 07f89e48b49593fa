"""The op table: one implementation per ONNX op, written over an array namespace ``xp``.

An implementation is registered for ``(domain, op_type)`` from an opset version on
(``since``); a node is bound to the registration with the largest ``since`` not above the
version of the node's *schema* (``onnx.defs.get_schema(op, opset, domain).since_version``), so
a registration keeps covering later opsets until the op's semantics change and somebody registers
a newer implementation.

Calling convention::

    fn(ctx: OpContext, node: NodeInfo, *inputs) -> array | tuple[array | None, ...]

``inputs`` are backend arrays (numpy here, cupy on the cuda backend) or ``None`` for an absent
optional input. Implementations never write into their inputs. Inputs whose *values* an op
reads on the host (Reshape's shape, Slice's starts, ...) are read with ``ctx.ints(x)`` /
``ctx.host(x)``; the executor folds those values to constants per input-shape signature, so on a
GPU they never cost a device->host copy. Registrations declare those inputs
(``value_inputs``): the executor uses them to know which output shapes are fixed by the input
shapes alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from convpass.core.errors import ExecutorError

DEFAULT_DOMAIN = ""
_DOMAIN_ALIASES = {"ai.onnx": ""}


def normalize_domain(domain: str) -> str:
    return _DOMAIN_ALIASES.get(domain, domain)


@dataclasses.dataclass
class NodeInfo:
    """A graph node as the executor sees it: attributes decoded once, at load."""

    name: str
    op_type: str
    domain: str
    opset: int
    attrs: dict[str, Any]
    inputs: list[str]
    outputs: list[str]
    # The registration the node runs with (set at load).
    impl: OpImpl | None = None
    # Per-plan data an op prepared for fixed input shapes (conv geometry + decision).
    prepared: Any = None

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def with_prepared(self, prepared: Any) -> NodeInfo:
        return dataclasses.replace(self, prepared=prepared)


@dataclasses.dataclass(frozen=True)
class OpImpl:
    domain: str
    op_type: str
    since: int
    fn: Callable[..., Any]
    # Inputs whose values (not only shapes) decide the output shapes.
    value_inputs: tuple[int, ...] = ()
    # Output shape depends on the data itself (NonZero): never fixed by input shapes.
    data_dependent_shape: bool = False
    # Called at plan time with fixed input shapes; result lands in NodeInfo.prepared.
    prepare: Callable[..., Any] | None = None


_TABLE: dict[tuple[str, str], list[OpImpl]] = {}


def register(
    op_types: str | Sequence[str],
    since: int = 1,
    *,
    domain: str = DEFAULT_DOMAIN,
    value_inputs: Sequence[int] = (),
    data_dependent_shape: bool = False,
    prepare: Callable[..., Any] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn`` for one or several op types from opset ``since`` on."""
    names = [op_types] if isinstance(op_types, str) else list(op_types)

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            entries = _TABLE.setdefault((domain, name), [])
            entries.append(
                OpImpl(domain, name, since, fn, tuple(value_inputs), data_dependent_shape, prepare)
            )
            entries.sort(key=lambda e: e.since)
        return fn

    return deco


def supported_ops() -> dict[tuple[str, str], list[int]]:
    """(domain, op_type) -> the opset versions from which an implementation is registered."""
    return {key: [e.since for e in entries] for key, entries in sorted(_TABLE.items())}


def _schema_since(op_type: str, opset: int, domain: str) -> int | None:
    try:
        return onnx.defs.get_schema(op_type, opset, domain).since_version
    except onnx.defs.SchemaError:
        return None


def lookup(op_type: str, domain: str, opset: int) -> OpImpl | None:
    """The implementation for a node of ``op_type`` in ``domain`` at ``opset``, or None."""
    domain = normalize_domain(domain)
    entries = _TABLE.get((domain, op_type))
    if not entries:
        return None
    if domain == DEFAULT_DOMAIN:
        version = _schema_since(op_type, opset, domain)
        if version is None:
            return None
    else:
        version = opset
    best = None
    for entry in entries:
        if entry.since <= version:
            best = entry
    return best


# ---------------------------------------------------------------------------------------------
# attributes and types

# Element types the executor computes with (numpy has them natively; so has cupy).
SUPPORTED_ELEM_TYPES: dict[int, np.dtype] = {
    t: np.dtype(helper.tensor_dtype_to_np_dtype(t))
    for t in (
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.BOOL,
        onnx.TensorProto.INT8,
        onnx.TensorProto.INT16,
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT64,
        onnx.TensorProto.UINT8,
        onnx.TensorProto.UINT16,
        onnx.TensorProto.UINT32,
        onnx.TensorProto.UINT64,
    )
}
_NP_TO_ELEM = {dt: t for t, dt in SUPPORTED_ELEM_TYPES.items()}


def elem_type_name(elem_type: int) -> str:
    try:
        return onnx.TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"type {elem_type}"


def np_dtype(elem_type: int) -> np.dtype:
    try:
        return SUPPORTED_ELEM_TYPES[elem_type]
    except KeyError:
        raise ExecutorError(f"tensor element type {elem_type_name(elem_type)} is not supported") from None


def ort_type_string(elem_type: int) -> str:
    """ORT NodeArg-style type string: 'tensor(float)', 'tensor(int64)', ..."""
    names = {
        onnx.TensorProto.FLOAT: "float",
        onnx.TensorProto.FLOAT16: "float16",
        onnx.TensorProto.DOUBLE: "double",
        onnx.TensorProto.BOOL: "bool",
        onnx.TensorProto.STRING: "string",
        onnx.TensorProto.BFLOAT16: "bfloat16",
    }
    if elem_type in names:
        return f"tensor({names[elem_type]})"
    return f"tensor({elem_type_name(elem_type).lower()})"


def decode_attribute(attr: onnx.AttributeProto) -> Any:
    """An attribute as a Python value: strings decoded, tensors as numpy arrays."""
    if attr.ref_attr_name:
        raise ExecutorError(f"attribute {attr.name!r} refers to {attr.ref_attr_name!r} outside a function")
    value = helper.get_attribute_value(attr)
    t = attr.type
    A = onnx.AttributeProto
    if t == A.STRING:
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    if t == A.STRINGS:
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value]
    if t == A.TENSOR:
        return numpy_helper.to_array(value)
    if t == A.TENSORS:
        return [numpy_helper.to_array(v) for v in value]
    if t in (A.INTS, A.FLOATS):
        return list(value)
    return value


def decode_attributes(attrs: Sequence[onnx.AttributeProto]) -> dict[str, Any]:
    return {a.name: decode_attribute(a) for a in attrs}


# ---------------------------------------------------------------------------------------------
# execution context


class OpContext:
    """What an op implementation sees of the backend it runs on."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.xp = backend.xp

    def host(self, x: Any) -> np.ndarray:
        """A value on the host (numpy), for inputs an op reads as Python values."""
        return self.backend.to_host(x)

    def ints(self, x: Any) -> list[int]:
        return [int(v) for v in np.asarray(self.host(x)).reshape(-1).tolist()]

    def floats(self, x: Any) -> list[float]:
        return [float(v) for v in np.asarray(self.host(x)).reshape(-1).tolist()]

    def scalar(self, x: Any) -> Any:
        a = np.asarray(self.host(x))
        if a.size != 1:
            raise ExecutorError(f"expected a scalar, got a tensor of shape {a.shape}")
        return a.reshape(-1)[0].item()


Inputs = Sequence[Any]
AttrMap = Mapping[str, Any]


def call_node(ctx: OpContext, node: NodeInfo, args: list[Any], host: bool) -> tuple[Any, ...]:
    """Run ``node``'s implementation on ``args`` (``None`` for an absent input): its outputs, one
    per output name. ``host``: a run on the host backend that prepares the node first where its op
    needs it (convs on constants). Failures name the node (:class:`ExecutorError`)."""
    impl = node.impl
    if impl is None:  # pragma: no cover  (checked at load)
        raise ExecutorError(f"node {node.name!r}: no implementation of {node.op_type}")
    try:
        if host and impl.prepare is not None and node.prepared is None:
            shapes = [None if a is None else tuple(a.shape) for a in args]
            node = node.with_prepared(impl.prepare(node, shapes, [None if a is None else a.dtype for a in args]))
        outs = impl.fn(ctx, node, *args)
    except ExecutorError as e:
        msg = str(e)
        if node.name not in msg:
            msg = f"node {node.name!r} ({node.op_type}): {msg}"
        raise ExecutorError(msg) from None
    except (ValueError, IndexError, TypeError) as e:
        shapes = [None if a is None else tuple(a.shape) for a in args]
        raise ExecutorError(f"node {node.name!r} ({node.op_type}) failed on inputs of shapes {shapes}: {e}") from None
    if not isinstance(outs, (tuple, list)):
        outs = (outs,)
    if len(outs) < len([o for o in node.outputs if o]) and any(node.outputs[len(outs) :]):
        wanted = [o for o in node.outputs[len(outs) :] if o]
        raise ExecutorError(f"node {node.name!r} ({node.op_type}): output(s) {wanted} are not supported")
    return tuple(outs[: len(node.outputs)])

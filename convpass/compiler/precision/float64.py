"""The float64 truth of a model: the same graph, every floating-point value in float64.

A float32 runtime (ONNX Runtime's CPU provider included) rounds at every operation; a model that
amplifies what each layer adds (normalizations that rescale a residual stream) carries those
roundings to its outputs. The error of any float32 computation, the float32 reference's own, is
measured against the model computed in float64, whose rounding is 2**29 times finer.

:func:`to_float64` rewrites a model so that it computes in float64:

1. every float32, float16 and bfloat16 tensor becomes float64: initializers, ``Constant`` values
   (``value``, ``value_float``, ``value_floats``), ``ConstantOfShape`` values, the element types
   of the graph's inputs, outputs and value_info, in subgraphs and model-local functions too;
2. ``Cast`` to a float type casts to float64, and so does a ``dtype`` attribute naming one
   (``EyeLike``, the random generators);
3. an input ONNX types as float32 whatever the data (``Resize``'s and ``Upsample``'s scales) is
   cast back to float32 where it is read: scales are exact in both types;
4. quantization operators (their scales are float32 by the standard) are refused, and so is a
   sparse ``Constant``: the model has no float64 form.

:func:`float64_outputs` runs the rewritten model on the convpass CPU executor, whose NumPy op
library computes float64 arrays in float64 (convolutions, normalizations, reductions), fusions
off; feeds are cast to float64. ONNX Runtime's CPU provider cannot be the float64 runtime: it has
no float64 kernel for ``Conv`` or ``InstanceNormalization`` (``benchmarks/local_errors.py --truth
f64`` lists what it refuses for the model it measures).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from convpass.compiler.passes.reduce_precision import unique_name
from convpass.core.errors import ConvpassError

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16})
# (op type, input index) that ONNX types tensor(float) whatever the data's type
_FLOAT32_INPUTS = frozenset({("Resize", 2), ("Upsample", 1)})
_QUANTIZED = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
                        "ConvInteger", "MatMulInteger"})


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` that computes every floating-point value in float64 (module docstring).

    ``model`` must hold its initializers' data (load it with its external data)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _graph(out.graph)
    for f in out.functions:
        _nodes(f.node, f.name)
        for vi in f.value_info:
            _value_info(vi)
    return out


def float64_outputs(model: onnx.ModelProto, feeds: Iterable[Mapping[str, np.ndarray]]) -> list[list[np.ndarray]]:
    """The float64 truth of ``model`` (a float32 model, or one :func:`to_float64` made) for each feed:
    its outputs in graph order, computed in float64 by the convpass CPU executor."""
    from convpass.runtime import Executor

    m64 = model if _is_float64(model) else to_float64(model)
    executor = Executor(m64, device="cpu", fusions=False, check_model=False)
    out = []
    for feed in feeds:
        f64 = {k: np.asarray(v).astype(np.float64) if np.issubdtype(np.asarray(v).dtype, np.floating) else np.asarray(v)
               for k, v in feed.items()}
        got = [np.asarray(v) for v in executor.run(None, f64)]
        for o, v in zip(m64.graph.output, got):
            if np.issubdtype(v.dtype, np.floating) and v.dtype != np.float64:
                raise ConvpassError(f"the float64 truth of output {o.name!r} came back as {v.dtype}")
        out.append(got)
    return out


# ---------------------------------------------------------------------------------------------
# the rewrite


def _is_float64(model: onnx.ModelProto) -> bool:
    ios = [*model.graph.input, *model.graph.output]
    return not any(vi.type.tensor_type.elem_type in FLOAT_TYPES for vi in ios) and not any(
        t.data_type in FLOAT_TYPES for t in model.graph.initializer)


def _tensor(t: TensorProto) -> None:
    if t.data_type in FLOAT_TYPES:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))


def _value_info(vi: onnx.ValueInfoProto) -> None:
    _type(vi.type)


def _type(tp: onnx.TypeProto) -> None:
    kind = tp.WhichOneof("value")
    if kind == "tensor_type" and tp.tensor_type.elem_type in FLOAT_TYPES:
        tp.tensor_type.elem_type = TensorProto.DOUBLE
    elif kind == "sequence_type":
        _type(tp.sequence_type.elem_type)
    elif kind == "optional_type":
        _type(tp.optional_type.elem_type)


def _graph(g: onnx.GraphProto) -> None:
    for t in g.initializer:
        _tensor(t)
    if len(g.sparse_initializer):
        raise ConvpassError(f"graph {g.name!r} has sparse initializers: no float64 form of it is made")
    for vi in (*g.input, *g.output, *g.value_info):
        _value_info(vi)
    _nodes(g.node, g.name)
    _float32_inputs(g)


def _nodes(nodes: Sequence[onnx.NodeProto], where: str) -> None:
    for n in nodes:
        if n.op_type in _QUANTIZED:
            raise ConvpassError(f"node {n.name or n.op_type!r} of {where!r} is {n.op_type}: a quantized model has no float64 form")
        for a in n.attribute:
            _attribute(n, a)


def _attribute(node: onnx.NodeProto, a: onnx.AttributeProto) -> None:
    if a.type == onnx.AttributeProto.TENSOR:
        _tensor(a.t)
    elif a.type == onnx.AttributeProto.TENSORS:
        for t in a.tensors:
            _tensor(t)
    elif a.type == onnx.AttributeProto.GRAPH:
        _graph(a.g)
    elif a.type == onnx.AttributeProto.GRAPHS:
        for sub in a.graphs:
            _graph(sub)
    elif a.type == onnx.AttributeProto.SPARSE_TENSOR:
        raise ConvpassError(f"node {node.name or node.op_type!r} holds a sparse tensor: no float64 form of it is made")
    elif a.type == onnx.AttributeProto.INT and ((node.op_type == "Cast" and a.name == "to") or a.name == "dtype") and a.i in FLOAT_TYPES:
        a.i = TensorProto.DOUBLE
    elif node.op_type == "Constant" and a.name in ("value_float", "value_floats"):
        value = np.asarray(a.f if a.name == "value_float" else list(a.floats), np.float64)
        a.CopyFrom(helper.make_attribute("value", numpy_helper.from_array(value)))


def _float32_inputs(g: onnx.GraphProto) -> None:
    """Cast back to float32 the inputs ONNX types float32 whatever the data (rule 3)."""
    taken = {v for n in g.node for v in (*n.input, *n.output)} | {vi.name for vi in g.input}
    nodes: list[onnx.NodeProto] = []
    for n in g.node:
        for i, name in enumerate(n.input):
            if name and (n.op_type, i) in _FLOAT32_INPUTS:
                cast = unique_name(f"{name}_float32", taken)
                nodes.append(helper.make_node("Cast", [name], [cast], to=TensorProto.FLOAT, name=unique_name(f"{cast}_cast", taken)))
                n.input[i] = cast
        nodes.append(n)
    if len(nodes) != len(g.node):
        del g.node[:]
        g.node.extend(nodes)


def relative_errors(outputs: Sequence[Sequence[np.ndarray]], truth: Sequence[Sequence[np.ndarray]]) -> dict[str, Any]:
    """``outputs`` against ``truth`` (per feed, per output): ``max-rel`` and ``rel-l2`` as
    :func:`convpass.compiler.precision.data.model_error` defines them."""
    from convpass.compiler.precision.data import METRICS, model_error

    return {m: model_error(outputs, truth, m) for m in METRICS}

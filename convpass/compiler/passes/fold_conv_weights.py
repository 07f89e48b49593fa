"""Fold the constant computations that produce convolution weights and biases into initializers.

Weight standardization (BiT's ``(w - mean) / std``, through ReduceMean / Sub / Div / Sqrt or a
BatchNormalization applied to the weight), weight normalization (wav2vec2's ``g * v / ||v||``),
NF-Net's scaled standardization, and the Reshape / Transpose / Cast / DequantizeLinear chains of
exporters all compute a conv's weight in the graph from initializers only. Folded here, the conv
is canonicalized, tuned and annotated like any other.

Rules:

* A conv's weight (and bias) that is an initializer is already constant, including initializers
  that old models (IR < 4) also list as graph inputs.
* A weight or bias computed from constants only (initializers and Constant nodes), through ops of
  the standard domain that the op library implements, is evaluated with
  :func:`convpass.ops.constant_folding.fold_constants`: the same code, on the same host arrays,
  with which the executor folds it when it loads the original model, in the ops' own element
  types as ONNX Runtime computes them at run time. The result becomes a new initializer that the
  conv reads; the subgraph and the initializers it read are removed once nothing else uses them.
* Only subgraphs that feed a conv's weight or bias are folded. Other constant expressions stay as
  they are (the executor and ONNX Runtime fold them at load), so folding never grows a model by
  materializing an Expand, Tile or ConstantOfShape that no conv reads. A conv's weight is folded
  whatever its size, since tuning needs it; where it is much larger than the constants it was
  computed from (over :data:`GROWTH_FACTOR` times and by more than :data:`GROWTH_BYTES`), a note
  says how much the model grew.
* Folding into an IR-3 model raises its IR version to 4. IR 3 requires every initializer to be
  a graph input too, so new initializers that are not inputs make the model invalid, and ONNX shape
  inference (which at IR 3 only reads initializers that are inputs) then loses every shape behind
  the conv. Listing them as inputs instead would keep IR 3 but make the folded weights overridable
  inputs, which ONNX Runtime does not treat as constants. IR 4 only relaxed this rule (and added
  the bfloat16 type), ONNX Runtime reads IR 4 to 10, and the annotated model needs IR 8 anyway
  (model-local functions).
* A weight that is truly dynamic (a graph input without initializer, or computed from one), or
  computed by an op the op library lacks or of another domain, cannot be tuned ahead of time: the
  node is marked ``convpass.skip`` with the reason, stays a plain standard op, and a warning says so.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from convpass.compiler.passes import state
from convpass.compiler.passes.folding import MIN_IR_WITHOUT_INPUT_INITIALIZERS
from convpass.compiler.passes.state import CONV_OPS, SKIP_KEY, node_label
from convpass.core.errors import ExecutorError
from convpass.kernels.backends import host_backend
from convpass.ops.constant_folding import fold_constants
from convpass.ops.registry import SUPPORTED_ELEM_TYPES, NodeInfo, OpContext, decode_attributes, lookup, normalize_domain

logger = logging.getLogger("convpass")


GROWTH_FACTOR = 4  # a folded weight this many times its sources' bytes ...
GROWTH_BYTES = 1 << 20  # ... and this much larger is noted


class _Dynamic(Exception):
    """The value cannot be known before run time, or not by convpass."""


class FoldConvWeightsPass(ir.passes.InPlacePass):
    """Makes every conv weight / bias an initializer, or marks the conv as not tunable (module
    rules). :attr:`notes`: the report's lines on folded weights that grew the model. Ensures the
    folded weights later passes require (:mod:`~convpass.compiler.passes.state`)."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[str] = []

    def ensures(self, model: ir.Model) -> None:
        state.ensure(self, model, state.WEIGHTS_FOLDED)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.notes = []
        folded: dict[ir.Value, ir.Value] = {}  # a computed weight -> its initializer (convs may share one)
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):  # bodies of If / Loop / Scan too
            if node.op_type not in CONV_OPS or node.domain not in ("", "ai.onnx"):
                continue
            for index in (1, 2):
                if index >= len(node.inputs) or node.inputs[index] is None:
                    continue
                value = node.inputs[index]
                if value.const_value is not None:
                    continue
                role = "weight" if index == 1 else "bias"
                if value not in folded:
                    try:
                        folded[value] = self._fold(model, value, node, role)
                    except _Dynamic as why:
                        node.meta[SKIP_KEY] = f"its {role} {value.name!r} {why}"
                        logger.warning("%s %r is left untuned: its %s %r %s", node.op_type, node_label(node), role, value.name, why)
                        break
                node.replace_input_with(index, folded[value])
        if folded:
            # See the module rules: IR 3 would need every new initializer listed as a graph input.
            model.ir_version = max(model.ir_version, MIN_IR_WITHOUT_INPUT_INITIALIZERS)
            ir.passes.common.RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=bool(folded))

    def _fold(self, model: ir.Model, value: ir.Value, conv: ir.Node, role: str) -> ir.Value:
        array, source_bytes = _evaluate(value, model.opset_imports)
        name = f"{value.name}__folded"
        folded = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        folded.shape = ir.Shape(array.shape)
        folded.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
        model.graph.register_initializer(folded)
        if array.nbytes > GROWTH_FACTOR * source_bytes and array.nbytes - source_bytes > GROWTH_BYTES:
            self.notes.append(
                f"{conv.op_type} {node_label(conv)!r}: its {role} {value.name!r} was folded to a constant of "
                f"{array.nbytes / 2**20:.1f} MiB, computed from {source_bytes / 2**20:.1f} MiB of constants; the model grew by the difference"
            )
        return folded


def _evaluate(value: ir.Value, opsets: dict[str, int]) -> tuple[np.ndarray, int]:
    """The value of ``value``, computed from constants only, and the bytes of the constants it
    read; raise _Dynamic where it cannot be computed ahead of time."""
    nodes = _subgraph(value, opsets)
    constants: dict[str, np.ndarray] = {}
    for node in nodes:
        for v in node.inputs:
            if v is not None and v.const_value is not None and v.name not in constants:
                array = v.const_value.numpy()
                if array.dtype not in SUPPORTED_ELEM_TYPES.values():
                    raise _Dynamic(f"could not be folded: the constant {v.name!r} has element type {v.dtype}, which convpass does not compute with")
                constants[v.name] = array
    source_bytes = sum(a.nbytes for a in constants.values())
    infos = [_node_info(n, opsets) for n in nodes]
    try:
        left = fold_constants(infos, constants, OpContext(host_backend()))
    except ExecutorError as e:
        raise _Dynamic(f"could not be folded ({e})") from None
    if left or value.name not in constants:  # pragma: no cover  (every input is constant by construction)
        raise _Dynamic(f"could not be folded (node {left[0].name if left else '?'!r} was not evaluated)")
    source_bytes += sum(np.asarray(n.attrs.get("value", ())).nbytes for n in infos if n.op_type == "Constant")
    return constants[value.name], source_bytes


def _subgraph(value: ir.Value, opsets: dict[str, int]) -> list[ir.Node]:
    """The nodes ``value`` is computed by, in topological order; raise _Dynamic when one of them
    reads a value known only at run time or cannot be evaluated here."""
    order: list[ir.Node] = []
    state: dict[int, bool] = {}  # id(node) -> finished
    stack: list[tuple[ir.Value, bool]] = [(value, False)]
    while stack:
        v, done = stack.pop()
        producer = v.producer()
        if done:
            state[id(producer)] = True
            order.append(producer)
            continue
        if v.const_value is not None:
            continue
        if producer is None:
            where = "is a graph input" if v is value else f"is computed from the graph input {v.name!r}"
            raise _Dynamic(f"{where} without an initializer (known only at run time)")
        if id(producer) in state:
            continue
        _check_foldable(producer, opsets)
        state[id(producer)] = False
        stack.append((v, True))
        stack.extend((i, False) for i in producer.inputs if i is not None)
    return order


def _check_foldable(node: ir.Node, opsets: dict[str, int]) -> None:
    domain = normalize_domain(node.domain)
    if domain != "" or lookup(node.op_type, domain, opsets.get("", 1)) is None:
        where = f" (domain {node.domain})" if domain else ""
        raise _Dynamic(f"is computed by {node.op_type}{where} node {node_label(node)!r}, which convpass cannot evaluate ahead of time")


def _node_info(node: ir.Node, opsets: dict[str, int]) -> NodeInfo:
    """``node`` as the op library takes it (as the executor binds it at load)."""
    opset = opsets.get("", 1)
    proto = ir.serde.serialize_node(node)
    info = NodeInfo(node_label(node), node.op_type, "", opset, decode_attributes(proto.attribute), list(proto.input), list(proto.output))
    info.impl = lookup(node.op_type, "", opset)
    return info

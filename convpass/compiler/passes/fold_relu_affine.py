"""Fold a constant affine after a conv's ReLU into the conv: a positive scale into its weight and
bias, a zero shift away.

HGNetV2's learnable affine block (``scale * x + bias`` after the activation of every ConvBNAct with
``use_lab``) is exported as ``Conv -> Relu -> Mul(s) -> Add(t)`` with scalar constants. The conv's
step absorbs the ReLU (``bias+relu``) but nothing after it, so the Mul and the Add ran as one more
element-wise pass over the conv's output (a read and a write of the whole tensor). The math:

* ``s * relu(u) = relu(s * u)`` for ``s > 0``, and ``s * u = conv(x, s * W) + s * b`` when ``s`` is
  one value per output channel: the Mul goes into the conv's weight and bias.
* ``v + 0 = v``: an Add of constant zeros goes (only the sign of a zero can differ, ``-0 + 0 = +0``).

Rules:

1. A site is a Conv of the standard domain with a constant weight and a constant bias or none,
   whose output is read only by a Relu, then, each the only reader of the value before it and
   none a graph output's producer unless it is the last, an optional Mul by a constant ``s`` and an
   optional Add of a constant ``t`` (at least one of the two). Constants are initializers or
   Constant nodes, also through Identity nodes (as exporters share parameters).
2. ``s`` folds when it is finite, every value is greater than zero, it has the conv output's
   float type, and it broadcasts per output channel: rank at most the output's, every dim 1 but
   the channel dim (1 or K). Otherwise the site is left as it is.
3. ``t`` goes when every value is zero, of a float type, and it broadcasts per output channel as
   ``s`` must (so it cannot widen the output); a shift that is not zero stays, as an Add after the ReLU (it is then the ReLU's only reader).
4. The folded weight and bias are new initializers (another node reading the old ones is
   unaffected); the removed nodes' output names go to the ReLU's output, so a graph output keeps
   its name. Initializers nothing reads any more are removed, and an IR-3 model is raised to IR 4
   (:mod:`convpass.compiler.passes.fold_conv_weights` says why).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from convpass.compiler.passes.folding import FoldIntoConvsPass
from convpass.compiler.passes.state import node_label

__all__ = ["FoldReluAffinePass"]

_STANDARD = ("", "ai.onnx")


class FoldReluAffinePass(FoldIntoConvsPass):
    """Folds the constant affine after a conv's Relu into the conv (module rules). ``folded``: the
    names of the Mul and Add nodes removed by the last call."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.folded = []
        graph = model.graph
        outputs = set(graph.outputs)
        for conv in [n for n in graph if n.op_type == "Conv" and n.domain in _STANDARD]:
            relu = _only_reader(conv, "Relu", outputs)
            if relu is None:
                continue
            mul = _only_reader(relu, "Mul", outputs)
            scale = _constant_operand(mul, relu.outputs[0]) if mul is not None else None
            if scale is not None and _fold_scale(graph, conv, scale):
                self._drop(graph, mul, relu)
            after = _only_reader(relu, "Add", outputs)
            shift = _constant_operand(after, relu.outputs[0]) if after is not None else None
            if shift is not None and _zero_shift(shift, conv):
                self._drop(graph, after, relu)
        return self.finish(model)

    def _drop(self, graph: ir.Graph, node: ir.Node, relu: ir.Node) -> None:
        """Remove ``node`` (an identity now), its readers reading the Relu's output (rule 4)."""
        y, out = relu.outputs[0], node.outputs[0]
        name = out.name
        y.type, y.shape = y.type or out.type, y.shape or out.shape  # the same values: a graph output keeps its type
        ir.convenience.replace_all_uses_with(out, y, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        y.name = name
        self.folded.append(node_label(node))


def _only_reader(node: ir.Node, op_type: str, outputs: set[ir.Value]) -> ir.Node | None:
    """The one reader of ``node``'s only output, when it is a standard ``op_type`` node and that
    output is no graph output."""
    if len(node.outputs) != 1 or node.outputs[0] in outputs:
        return None
    uses = list(node.outputs[0].uses())
    if len(uses) != 1:
        return None
    reader = uses[0].node
    ok = reader.op_type == op_type and reader.domain in _STANDARD and len(reader.outputs) == 1
    return reader if ok and (op_type == "Relu" or len(reader.inputs) == 2) else None


def _constant(value: ir.Value | None) -> np.ndarray | None:
    """The constant array of ``value`` (an initializer, a Constant's output, through Identity)."""
    while value is not None and value.const_value is None:
        producer = value.producer()
        if producer is None or producer.domain not in _STANDARD:
            return None
        if producer.op_type == "Identity":
            value = producer.inputs[0]
        elif producer.op_type == "Constant" and "value" in producer.attributes:
            return producer.attributes["value"].as_tensor().numpy()
        else:
            return None
    return None if value is None else value.const_value.numpy()


def _constant_operand(node: ir.Node, data: ir.Value) -> np.ndarray | None:
    """The constant operand of a two-input ``node`` whose other operand is ``data``."""
    a, b = node.inputs
    if a is data and b is not data:
        return _constant(b)
    if b is data and a is not data:
        return _constant(a)
    return None


def _fold_scale(graph: ir.Graph, conv: ir.Node, scale: np.ndarray) -> bool:
    """Multiply the conv's weight and bias by ``scale`` (rule 2); False where it does not fold."""
    w = _constant(conv.inputs[1]) if len(conv.inputs) > 1 else None
    has_bias = len(conv.inputs) > 2 and conv.inputs[2] is not None
    b = _constant(conv.inputs[2]) if has_bias else None
    if w is None or (has_bias and b is None) or w.ndim < 3 or scale.dtype != w.dtype or not np.issubdtype(w.dtype, np.floating):
        return False
    k = w.shape[0]
    dims = (1,) * (w.ndim - scale.ndim) + scale.shape
    if scale.ndim > w.ndim or any(d != 1 for i, d in enumerate(dims) if i != 1) or dims[1] not in (1, k):
        return False
    if not (np.all(np.isfinite(scale)) and np.all(scale > 0)):
        return False
    per_k = np.broadcast_to(scale.reshape(-1), (k,)).astype(w.dtype)
    tag = f"{node_label(conv)}::relu_scaled"
    arrays = [("W", w * per_k.reshape((k,) + (1,) * (w.ndim - 1)))] + ([("B", b * per_k)] if has_bias else [])
    for index, (suffix, array) in enumerate(arrays, start=1):
        value = ir.Value(name=f"{tag}/{suffix}", const_value=ir.tensor(np.ascontiguousarray(array), name=f"{tag}/{suffix}"))
        value.shape = ir.Shape(array.shape)
        value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
        graph.register_initializer(value)
        conv.replace_input_with(index, value)
    return True


def _zero_shift(shift: np.ndarray, conv: ir.Node) -> bool:
    """Whether adding ``shift`` to the conv's (activated) output leaves it as it is (rule 3): zeros
    of a float type, every dim 1 but the channel dim (1 or K), rank at most the output's (the
    weight's), so that it cannot widen the output under broadcasting."""
    w = _constant(conv.inputs[1]) if len(conv.inputs) > 1 else None
    if w is None or not np.issubdtype(shift.dtype, np.floating) or np.any(shift != 0) or shift.ndim > w.ndim:
        return False
    dims = (1,) * (w.ndim - shift.ndim) + shift.shape
    return all(d == 1 for i, d in enumerate(dims) if i != 1) and dims[1] in (1, w.shape[0])

"""Fold each inference BatchNormalization into the Conv or ConvTranspose before it.

Rules: :mod:`convpass.ops.batchnorm_folding` (where a BatchNormalization folds and the arithmetic),
the same module the executor folds with when it loads a model. Folding here, before the problems
are collected, makes the tuner time the step the executor runs: a bias-less Conv followed by a
BatchNormalization and a Relu runs as one conv + bias + ReLU step once folded, and is tuned as
that step (``bias+relu``), not as a bare conv followed by passes nobody timed.

* The folded weight and bias become new initializers; the BatchNormalization is removed and the
  conv's output takes its name (a graph output keeps its name).
* Initializers nothing reads any more are removed; an IR-3 model is raised to IR 4, as
  :mod:`convpass.compiler.passes.fold_conv_weights` says why.
"""

from __future__ import annotations

import onnx_ir as ir

from convpass.compiler.passes.folding import FoldIntoConvsPass
from convpass.compiler.passes.state import node_label
from convpass.ops import batchnorm_folding
from convpass.ops.registry import NodeInfo, decode_attributes

__all__ = ["FoldBatchNormsPass"]


class FoldBatchNormsPass(FoldIntoConvsPass):
    """Folds inference BatchNormalizations into the convs they follow (module rules). ``folded``:
    the names of the BatchNormalization nodes folded by the last call. Requires the folded conv
    weights of ``FoldConvWeightsPass`` (:mod:`~convpass.compiler.passes.state`): a conv whose weight
    is still computed would keep its BatchNormalization, which the executor folds."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.folded = []
        graph = model.graph
        opset = model.opset_imports.get("", 1)
        infos = {id(n): _info(n, opset) for n in graph}
        values = {v.name: v for n in graph for v in (*n.inputs, *n.outputs) if v is not None}
        values.update({v.name: v for v in graph.inputs})
        outputs = {v.name for v in graph.outputs}

        def producer(name: str) -> NodeInfo | None:
            v = values.get(name)
            p = v.producer() if v is not None else None
            return infos.get(id(p)) if p is not None else None

        def readers(name: str) -> list[NodeInfo]:
            v = values.get(name)
            return [infos[id(u)] for u, _ in v.uses()] if v is not None else []

        def is_constant(name: str) -> bool:
            v = values.get(name)
            return v is not None and v.const_value is not None

        for bn in list(graph):
            info = infos[id(bn)]
            conv_info = batchnorm_folding.fold_site(info, producer, readers, outputs, is_constant)
            if conv_info is None:
                continue
            conv = next(n for n in graph if infos.get(id(n)) is conv_info)
            if self._fold(graph, conv, bn, conv_info, info):
                self.folded.append(node_label(bn))
        return self.finish(model)

    @staticmethod
    def _fold(graph: ir.Graph, conv: ir.Node, bn: ir.Node, conv_info: NodeInfo, bn_info: NodeInfo) -> bool:
        w = conv.inputs[1].const_value.numpy()
        b = conv.inputs[2].const_value.numpy() if len(conv.inputs) > 2 and conv.inputs[2] is not None else None
        params = [bn.inputs[i].const_value.numpy() for i in range(1, 5)]
        folded = batchnorm_folding.fold_into_conv(conv_info.op_type, w, b, *params, float(bn_info.attr("epsilon", 1e-5)),
                                                  int(conv_info.attr("group", 1) or 1))
        if folded is None:
            return False
        tag = f"{node_label(conv)}::bn_folded"
        new = []
        for suffix, array in zip(("W", "B"), folded):
            value = ir.Value(name=f"{tag}/{suffix}", const_value=ir.tensor(array, name=f"{tag}/{suffix}"))
            value.shape = ir.Shape(array.shape)
            value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
            graph.register_initializer(value)
            new.append(value)
        if len(conv.inputs) < 3:
            conv.resize_inputs(3)
        conv.replace_input_with(1, new[0])
        conv.replace_input_with(2, new[1])
        y, out = conv.outputs[0], bn.outputs[0]
        name = out.name
        ir.convenience.replace_all_uses_with(out, y, replace_graph_outputs=True)
        graph.remove(bn, safe=True)
        y.name = name
        return True


def _info(node: ir.Node, opset: int) -> NodeInfo:
    """``node`` as the op library sees it (attributes decoded, value names)."""
    proto = ir.serde.serialize_node(node)
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    return NodeInfo(node_label(node), node.op_type, domain, opset, decode_attributes(proto.attribute), list(proto.input), list(proto.output))

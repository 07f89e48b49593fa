"""The model's main graph as the executor runs it: its inputs and outputs, its nodes bound to the
op library, its constants folded.

Read once per model, after :func:`convpass.runtime.support.prepare_model` inlined what it could:

1. every node becomes a :class:`~convpass.ops.registry.NodeInfo` bound to its op implementation,
   its attributes decoded (an ``ai.convpass`` conv runs as its standard op), in topological order;
2. nodes whose inputs are all constants are evaluated once on the host
   (:mod:`convpass.ops.constant_folding`, the code ``optimize`` folds conv weights with) — first,
   so BatchNormalization parameters given by Constant nodes fold too;
3. with ``fold_batchnorm``, each inference BatchNormalization is folded into the Conv /
   ConvTranspose before it where exact (:mod:`convpass.ops.batchnorm_folding`);
4. constants nothing reads any more (conv weights replaced by their folded copies) are dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx

from convpass.core import annotation
from convpass.core.errors import ExecutorError
from convpass.kernels.backends import host_backend
from convpass.ops import batchnorm_folding
from convpass.ops.constant_folding import fold_constants
from convpass.ops.registry import SUPPORTED_ELEM_TYPES, NodeInfo, OpContext, decode_attributes, lookup, normalize_domain, ort_type_string
from convpass.runtime.support import model_opsets, node_name


@dataclasses.dataclass(frozen=True)
class NodeArg:
    """An input or output of the model, like ONNX Runtime's ``NodeArg``."""

    name: str
    shape: list[int | str | None] | None  # None: rank unknown
    type: str
    elem_type: int

    @property
    def dtype(self) -> np.dtype:
        return SUPPORTED_ELEM_TYPES[self.elem_type]


class ModelGraph:
    """The graph of a prepared model (see the module docstring); ``constants`` are its
    initializers by name, as read from the file, and grow with what folding computes."""

    def __init__(self, proto: onnx.ModelProto, constants: dict[str, np.ndarray], *, fold_batchnorm: bool = True) -> None:
        self.opsets = model_opsets(proto)
        g = proto.graph
        init_names = {t.name for t in g.initializer}
        self.constants = constants
        self.inputs: list[NodeArg] = [node_arg(vi) for vi in g.input if vi.name not in init_names]
        self.overridable = [vi.name for vi in g.input if vi.name in init_names]
        self.outputs: list[NodeArg] = [node_arg(vi) for vi in g.output]
        self.input_map = {a.name: a for a in self.inputs}
        self.output_names = [a.name for a in self.outputs]
        self.nodes = _toposort(self._read_nodes(proto), set(self.constants) | set(self.input_map))
        self.folded_batchnorms: list[str] = []
        # constants first, so BatchNormalization parameters given by Constant nodes fold too
        self.folded_constants = self._fold_constants()
        if fold_batchnorm:
            self._fold_batchnorms()
        # drop constants nothing reads any more (e.g. conv weights replaced by their BN-folded copies)
        live = {i for n in self.nodes for i in n.inputs} | set(self.output_names)
        self.constants = {k: v for k, v in self.constants.items() if k in live}
        self.producers = {o: n for n in self.nodes for o in n.outputs if o}

    def conv_nodes(self) -> list[NodeInfo]:
        return [n for n in self.nodes if n.op_type in annotation.CONV_OPS]

    def needed(self, outputs: Sequence[str]) -> list[NodeInfo]:
        """The nodes computing ``outputs`` need, in graph order."""
        want = {o for o in outputs if o not in self.constants}
        needed: set[int] = set()
        stack = list(want)
        seen = set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            node = self.producers.get(v)
            if node is None:
                continue
            if id(node) not in needed:
                needed.add(id(node))
                stack.extend(i for i in node.inputs if i and i not in self.constants)
        return [n for n in self.nodes if id(n) in needed]

    def _read_nodes(self, proto: onnx.ModelProto) -> list[NodeInfo]:
        nodes = []
        for i, n in enumerate(proto.graph.node):
            domain = normalize_domain(n.domain)
            opset = self.opsets.get(domain, 1 if domain == annotation.DOMAIN else 0)
            attrs = annotation.standard_attributes(n) if annotation.is_annotated_conv(n) else list(n.attribute)
            info = NodeInfo(
                name=node_name(n, i),
                op_type=annotation.standard_op_type(n),  # a bias-less tuned conv runs as its op
                domain=domain,
                opset=opset,
                attrs=decode_attributes(attrs),
                inputs=list(n.input),
                outputs=list(n.output),
            )
            info.impl = lookup(info.op_type, domain, opset)
            nodes.append(info)
        return nodes

    def _fold_batchnorms(self) -> None:
        """Fold each BatchNormalization into the conv before it (:mod:`convpass.ops.batchnorm_folding`:
        where and how, the rules the compiler follows too)."""
        consumers: dict[str, list[NodeInfo]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i:
                    consumers.setdefault(i, []).append(n)
        producers = {o: n for n in self.nodes for o in n.outputs if o}
        graph_outputs = set(self.output_names)
        removed: set[int] = set()
        c = self.constants
        for bn in self.nodes:
            conv = batchnorm_folding.fold_site(bn, producers.get, lambda v: consumers.get(v, []), graph_outputs, c.__contains__)
            if conv is None:
                continue
            b_name = conv.inputs[2] if len(conv.inputs) > 2 else ""
            group = int(conv.attr("group", 1) or 1)
            folded = batchnorm_folding.fold_into_conv(conv.op_type, c[conv.inputs[1]], c[b_name] if b_name else None,
                                                      *(c[p] for p in bn.inputs[1:5]), float(bn.attr("epsilon", 1e-5)), group)
            if folded is None:
                continue
            tag = f"{conv.name}::bn_folded"
            c[f"{tag}/W"], c[f"{tag}/B"] = folded
            conv.inputs = [conv.inputs[0], f"{tag}/W", f"{tag}/B"]
            conv.outputs = [bn.outputs[0]]
            removed.add(id(bn))
            self.folded_batchnorms.append(bn.name)
        if removed:
            self.nodes = [n for n in self.nodes if id(n) not in removed]

    def _fold_constants(self) -> int:
        """Evaluate nodes whose inputs are all constants, once, on the host (:mod:`convpass.ops.constant_folding`)."""
        count = len(self.nodes)
        self.nodes = fold_constants(self.nodes, self.constants, OpContext(host_backend()))
        return count - len(self.nodes)


def node_arg(vi: onnx.ValueInfoProto) -> NodeArg:
    tt = vi.type.tensor_type
    shape: list[int | str | None] | None = None
    if tt.HasField("shape"):
        shape = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                shape.append(int(d.dim_value))
            elif d.HasField("dim_param"):
                shape.append(d.dim_param)
            else:
                shape.append(None)
    return NodeArg(vi.name, shape, ort_type_string(tt.elem_type), tt.elem_type)


def _toposort(nodes: list[NodeInfo], available: set[str]) -> list[NodeInfo]:
    """Nodes in an order where every input is produced before use (stable for sorted graphs)."""
    produced_by: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for o in n.outputs:
            if o:
                if o in produced_by:
                    raise ExecutorError(f"value {o!r} is produced by two nodes")
                produced_by[o] = i
    deps = []
    for _i, n in enumerate(nodes):
        d = set()
        for inp in n.inputs:
            if not inp or inp in available:
                continue
            if inp not in produced_by:
                raise ExecutorError(f"node {n.name!r} reads {inp!r}, which no node, input or initializer provides")
            d.add(produced_by[inp])
        deps.append(d)
    if all(all(j < i for j in d) for i, d in enumerate(deps)):
        return nodes
    order, done = [], set()
    pending = list(range(len(nodes)))
    while pending:
        progress = False
        rest = []
        for i in pending:
            if deps[i] <= done:
                order.append(i)
                done.add(i)
                progress = True
            else:
                rest.append(i)
        if not progress:
            raise ExecutorError(f"the graph has a cycle through node {nodes[rest[0]].name!r}")
        pending = rest
    return [nodes[i] for i in order]

"""Rewrite the graph so that a chosen region of nodes computes in float16, with Casts at its boundary.

Rules (the region comes from :mod:`convpass.compiler.passes.plan_precision`, by node name):

* Every data tensor a region node writes (:func:`~convpass.compiler.passes.plan_precision.data_outputs`)
  becomes float16. Its data inputs (:func:`~convpass.compiler.passes.plan_precision.data_inputs`) are
  read in float16: a constant input (weight, bias, BatchNormalization parameter, a Constant node's
  value) is replaced by a float16 initializer (``<name>_fp16``, one per constant, shared by every
  region node reading it); a non-constant float32 input by the output of one ``Cast`` per value,
  placed right after the value's producer and shared by every region node reading it.
* A float16 value read as float32 by anything outside the region (a wide node, a slot that is not
  the op's data type) gets one ``Cast`` back to float32, right after its producer, shared by those
  readers. Graph outputs keep their names and type: the float16 value is renamed
  ``<name>_fp16`` and the Cast writes the output's name.
* Float32 initializers no longer read by anything are removed. Node names are unchanged (the
  pass names its Casts ``<value>/to_fp16`` and ``<value>/to_fp32``).
* Each conv in the region then has a float16 input and weight: its cuDNN problem has data type
  float16 with float32 accumulation (cuDNN's pseudo-half configuration), which the tuner measures
  and the executor runs as recorded; ONNX Runtime runs the same graph.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import onnx_ir as ir

from convpass.compiler.passes.plan_precision import constant_array, data_inputs, data_outputs

HALF = ir.DataType.FLOAT16
FLOAT = ir.DataType.FLOAT


class ReducePrecisionPass(ir.passes.InPlacePass):
    """Puts the named nodes in float16 with Casts at the region's boundary (module rules)."""

    def __init__(self, region: Collection[str]) -> None:
        super().__init__()
        self.region = frozenset(region)
        self.casts = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        nodes = [n for n in graph if n.name in self.region]
        if not nodes:
            return ir.passes.PassResult(model, modified=False)
        names = _names(graph)
        halves: dict[ir.Value, ir.Value] = {}  # constant or wide value -> its float16 version
        for node in nodes:  # graph order is topological: a region producer is rewritten before its readers
            for slot in data_inputs(node):
                value = node.inputs[slot]
                if value.dtype == HALF:
                    continue
                if value not in halves:
                    halves[value] = self._half_of(graph, value, names)
                node.replace_input_with(slot, halves[value])
            for value in data_outputs(node):
                value.dtype = HALF
        created = {v.producer() for v in halves.values() if v.producer() is not None}
        for node in nodes:
            for value in data_outputs(node):
                self._cast_back(graph, node, value, created, names)
        _drop_unused_initializers(graph)
        return ir.passes.PassResult(model, modified=True)

    def _half_of(self, graph: ir.Graph, value: ir.Value, names: set[str]) -> ir.Value:
        array = constant_array(value)
        if array is not None:
            name = unique_name(f"{value.name}_fp16", names)
            half = ir.Value(name=name, shape=value.shape, type=ir.TensorType(HALF),
                            const_value=ir.tensor(np.asarray(array, dtype=np.float16), name=name))
            graph.register_initializer(half)
            return half
        cast = ir.Node("", "Cast", [value], attributes=[ir.AttrInt64("to", HALF.value)], name=unique_name(f"{value.name}/to_fp16", names))
        out = cast.outputs[0]
        out.name, out.shape, out.type = unique_name(f"{value.name}_fp16", names), value.shape, ir.TensorType(HALF)
        producer = value.producer()
        if producer is not None:
            graph.insert_after(producer, cast)
        else:
            graph.insert_before(graph.node(0), cast)
        self.casts += 1
        return out

    def _cast_back(self, graph: ir.Graph, node: ir.Node, value: ir.Value, created: set, names: set[str]) -> None:
        wide = [(user, slot) for user, slot in value.uses()
                if user not in created and (user.name not in self.region or slot not in data_inputs(user))]
        output = value.is_graph_output()
        if not wide and not output:
            return
        cast = ir.Node("", "Cast", [value], attributes=[ir.AttrInt64("to", FLOAT.value)], name=unique_name(f"{value.name}/to_fp32", names))
        out = cast.outputs[0]
        out.shape, out.type = value.shape, ir.TensorType(FLOAT)
        original = value.name
        if output:
            value.name = unique_name(f"{original}_fp16", names)
            out.name = original
            for i, v in enumerate(graph.outputs):
                if v is value:
                    graph.outputs[i] = out
        else:
            out.name = unique_name(f"{original}_fp32", names)
        for user, slot in wide:
            user.replace_input_with(slot, out)
        graph.insert_after(node, cast)
        self.casts += 1


def _names(graph: ir.Graph) -> set[str]:
    names = {v.name for v in graph.inputs} | {v.name for v in graph.initializers.values()}
    names |= {v.name for n in graph for v in n.outputs} | {n.name for n in graph}
    return {n for n in names if n}


def unique_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name_2``, ``name_3``, ... : the first not in ``taken`` (which it joins)."""
    out, i = name, 1
    while out in taken:
        i += 1
        out = f"{name}_{i}"
    taken.add(out)
    return out


def _drop_unused_initializers(graph: ir.Graph) -> None:
    inputs = set(graph.inputs)
    for name, value in list(graph.initializers.items()):
        if not value.uses() and not value.is_graph_output() and value not in inputs:
            del graph.initializers[name]

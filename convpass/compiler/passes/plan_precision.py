"""Choose which nodes compute in a reduced type (float16) for the whole graph at once: an s-t minimum cut.

The model is the layout planner's (:mod:`convpass.compiler.passes.plan_layouts`), with data types
where it has memory formats and Casts where it has transposes.

Rules:

* Every float32 tensor is either kept ("wide") or stored in the reduced type. A node in the reduced
  region reads and writes its data tensors in that type; a wide node reads and writes float32.
* Every conv has a cost per precision it may take (its best measured configuration, summed over the
  shape profiles): in the wide region the cheaper of its allowed wide precisions (``fp32`` = FMA
  math, ``tf32``; ``fp32-strict``, FMA math without transform algorithms), in the reduced region its
  reduced-type time. A precision it may not take (the
  budget loop's floor, the options) or has no measurement for costs infinity.
* Precision-agnostic ops (:data:`PRECISION_AGNOSTIC`: element-wise arithmetic and activations,
  BatchNormalization, pooling, Resize, Pad, Concat and the reshaping ops) whose data tensors are all
  float32 may join the region at no cost of their own: they pass the type through, as they pass a
  memory format through. Every other op, graph inputs and graph outputs are float32 (ONNX
  semantics as exported). Shape and Size read no data: any type suits them.
* A value whose producer and some reader are on different sides is cast once for all the readers
  on the other side (the rewrite shares one Cast per value and direction,
  :mod:`convpass.compiler.passes.reduce_precision`), costing ``cast_ms(value)``. This is modelled
  exactly with two auxiliary vertices per value: ``up`` (on the reduced side as soon as one reader
  is) with an edge producer -> up of the cast's cost, and ``down`` (on the wide side as soon as one
  reader is) with an edge down -> producer.
* Constant inputs (weights, biases, BatchNormalization's parameters) are converted once when the
  model is written: no run-time cost. A node with a constant data input outside the reduced type's
  finite range stays wide.
* Source side = wide, sink side = reduced; capacities in integer nanoseconds (networkx's max-flow
  is exact on integers only). Among plans of equal cost the one with the smallest reduced region
  is taken (the nodes that can reach the sink in the residual graph), so ties go to float32.

The result names, for every conv with costs, the precision it runs in, and the set of reduced nodes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import networkx as nx
import numpy as np
import onnx_ir as ir

from convpass.compiler.passes.min_cut import INF, add_capacity
from convpass.compiler.passes.plan_layouts import METADATA_OPS
from convpass.core.options import WIDE_PRECISIONS

PRECISION_AGNOSTIC = frozenset(
    {
        "Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu",
        "Softplus", "Gelu", "Erf", "Neg", "Abs", "Identity", "Dropout",
        "Add", "Sub", "Mul", "Max", "Min", "Sum", "Mean", "BatchNormalization",
        "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Resize", "Upsample", "Pad", "Concat",
        "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze",
    }
)
CONV_OPS = ("Conv", "ConvTranspose")
# input slots that hold the op's data type T (the rest: shapes, axes, scales, ratios); default: all
_DATA_INPUTS = {"Resize": (0,), "Upsample": (0,), "Pad": (0, 2), "Dropout": (0,), "MaxPool": (0,), "AveragePool": (0,),
                "GlobalAveragePool": (0,), "GlobalMaxPool": (0,), "Reshape": (0,), "Flatten": (0,), "Transpose": (0,),
                "Squeeze": (0,), "Unsqueeze": (0,)}
# outputs that are not of type T (MaxPool's indices, Dropout's mask)
_DATA_OUTPUTS = {"MaxPool": (0,), "Dropout": (0,)}
RANGES = {"fp16": float(np.finfo(np.float16).max)}
DTYPES = {"fp16": ir.DataType.FLOAT16}


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    precisions: dict[ir.Node, str]  # every conv with costs -> fp32-strict | fp32 | tf32 | the reduced precision
    reduced: frozenset[ir.Node]  # the nodes computing in the reduced type (convs and the ops between them)
    cost_ms: float  # conv times + casts
    casts: int


def data_inputs(node: ir.Node) -> list[int]:
    """The input slots of a node that carry its data type (the ones a Cast would convert)."""
    slots = _DATA_INPUTS.get(node.op_type)
    return [i for i in range(len(node.inputs)) if (slots is None or i in slots) and node.inputs[i] is not None]


def data_outputs(node: ir.Node) -> list[ir.Value]:
    slots = _DATA_OUTPUTS.get(node.op_type)
    return [v for i, v in enumerate(node.outputs) if slots is None or i in slots]


Types = Mapping[str, int]  # value name -> ONNX element type, where the graph's values do not say


def is_float32(value: ir.Value, types: Types) -> bool:
    dtype = value.dtype if value.dtype is not None else types.get(value.name)
    return dtype is not None and int(dtype) == ir.DataType.FLOAT.value


def constant_array(value: ir.Value) -> np.ndarray | None:
    """The value's constant data (an initializer or a Constant node's), or None."""
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def _fits(node: ir.Node, reduced: str, types: Types) -> bool:
    """Whether every data tensor of a node is float32 and could be of the reduced type: constants within its range."""
    limit = RANGES[reduced]
    for i in data_inputs(node):
        v = node.inputs[i]
        if not is_float32(v, types):
            return False
        array = constant_array(v)
        if array is not None and array.size and np.any(np.abs(array[np.isfinite(array)]) > limit):
            return False
    return all(is_float32(v, types) for v in data_outputs(node))


def movable_nodes(graph: ir.Graph, conv_costs: Mapping[ir.Node, Mapping[str, float]], reduced: str, types: Types) -> set[ir.Node]:
    """The nodes the plan may put in the reduced type (module rules)."""
    out = set()
    for node in graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        conv = node in conv_costs and conv_costs[node].get(reduced, INF) < INF
        if (conv or node.op_type in PRECISION_AGNOSTIC) and _fits(node, reduced, types):
            out.add(node)
    return out


def _readers(value: ir.Value, movable: set[ir.Node]) -> tuple[list[ir.Node], bool]:
    """The movable nodes reading ``value`` in a data slot, and whether something must read it as float32."""
    movers: dict[ir.Node, None] = {}
    wide = value.is_graph_output()
    for user, slot in value.uses():
        if user.op_type in METADATA_OPS and user.domain in ("", "ai.onnx"):
            continue
        if user in movable and slot in data_inputs(user):
            movers.setdefault(user)
        else:
            wide = True
    return list(movers), wide


def crossing_values(graph: ir.Graph, movable: set[ir.Node], types: Types) -> list[ir.Value]:
    """The non-constant float32 values a cut could separate from some reader, in graph order."""
    values: dict[ir.Value, None] = {}
    candidates = list(graph.inputs) + [v for n in graph for v in n.outputs]
    for v in candidates:
        if not is_float32(v, types) or constant_array(v) is not None:
            continue
        producer = v.producer()
        movers, _ = _readers(v, movable)
        if movers or (producer is not None and producer in movable):
            values.setdefault(v)
    return list(values)


def plan_precision(
    graph: ir.Graph,
    conv_costs: Mapping[ir.Node, Mapping[str, float]],
    reduced: str,
    cast_ms: Callable[[ir.Value], float],
    types: Types | None = None,
) -> PrecisionPlan:
    """The min-cut precision assignment (module rules). ``conv_costs``: per conv, the time of every
    precision it may take (``fp32-strict``, ``fp32``, ``tf32``, ``reduced``); missing = not allowed. ``types``: value
    element types where the values themselves have none (shape inference's, by value name)."""
    conv_costs = {n: c for n, c in conv_costs.items() if c}
    types = types or {}
    movable = movable_nodes(graph, conv_costs, reduced, types)
    if not any(n in conv_costs for n in movable):
        return _evaluate(graph, set(), conv_costs, reduced, cast_ms, movable, types)
    g = nx.DiGraph()
    source, sink = "<wide>", "<reduced>"

    add = functools.partial(add_capacity, g)  # integer nanoseconds (min_cut's rules)

    for node in graph:
        if node not in movable:
            continue
        g.add_node(node)
        if node in conv_costs:
            add(source, node, conv_costs[node].get(reduced, INF))
            add(node, sink, _wide_cost(conv_costs[node], reduced)[1])
    for i, value in enumerate(crossing_values(graph, movable, types)):
        producer = value.producer()
        here = producer if producer is not None and producer in movable else source
        movers, wide = _readers(value, movable)
        cost = cast_ms(value)
        if movers:  # producer wide, a reader reduced: one cast to the reduced type
            up = ("up", i)
            add(here, up, cost)
            for reader in movers:
                add(up, reader, INF)
        if here is not source:  # producer reduced, a reader wide: one cast back
            down = ("down", i)
            if wide:
                add(source, down, INF)
            for reader in movers:
                add(reader, down, INF)
            add(down, here, cost)
    _, residual = _max_flow(g, source, sink)
    on_sink = _reaching(residual, sink)
    chosen = {n for n in movable if n in on_sink}
    return _evaluate(graph, chosen, conv_costs, reduced, cast_ms, movable, types)


def _max_flow(g: nx.DiGraph, source, sink):
    residual = nx.algorithms.flow.preflow_push(g, source, sink)
    return residual.graph["flow_value"], residual


def _reaching(residual: nx.DiGraph, sink) -> set:
    """The vertices that reach ``sink`` through edges with residual capacity: the smallest sink side
    of a minimum cut (ties: wide)."""
    seen = {sink}
    stack = [sink]
    while stack:
        v = stack.pop()
        for u in residual.predecessors(v):
            edge = residual[u][v]
            if u not in seen and edge["capacity"] - edge["flow"] > 0:
                seen.add(u)
                stack.append(u)
    return seen


def _wide_cost(costs: Mapping[str, float], reduced: str) -> tuple[str | None, float]:
    """The cheapest allowed wide precision of a conv and its cost (ties: the more accurate, so a conv
    whose fastest FMA configuration is no transform algorithm is ``fp32-strict``)."""
    options = [(costs[p], -rank, p) for rank, p in enumerate(WIDE_PRECISIONS) if costs.get(p, INF) < INF]
    if not options:
        return None, INF
    best = min(options)
    return best[2], best[0]


def _evaluate(graph, chosen: set, conv_costs, reduced: str, cast_ms, movable: set, types: Types) -> PrecisionPlan:
    """Cost of an assignment: conv times plus one cast per value and direction that crosses."""
    precisions, total = {}, 0.0
    for node, costs in conv_costs.items():
        if node in chosen:
            precisions[node], cost = reduced, costs.get(reduced, INF)
        else:
            name, cost = _wide_cost(costs, reduced)
            precisions[node] = name or "fp32"
        total += cost
    casts = 0
    for value in crossing_values(graph, movable, types):
        producer = value.producer()
        down = producer is not None and producer in chosen
        movers, wide = _readers(value, movable)
        crossings = int(any(r not in chosen for r in movers) or wide) if down else int(any(r in chosen for r in movers))
        if crossings:
            total += cast_ms(value)
            casts += 1
    return PrecisionPlan(precisions, frozenset(chosen), total, casts)


def evaluate_assignment(graph: ir.Graph, chosen: set, conv_costs, reduced: str, cast_ms, types: Types | None = None) -> PrecisionPlan:
    """The cost of a given reduced region (for tests and for plans built by hand)."""
    conv_costs = {n: c for n, c in conv_costs.items() if c}
    types = types or {}
    return _evaluate(graph, set(chosen), conv_costs, reduced, cast_ms, movable_nodes(graph, conv_costs, reduced, types), types)

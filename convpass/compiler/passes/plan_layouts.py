"""Choose each convolution's memory format for the whole graph at once: an s-t minimum cut.

Rules (per shape profile):

* Every conv has a measured cost in NCHW and in NHWC (its best configuration in each). A conv with
  no measurement in a layout cannot take it (infinite cost).
* Layout-agnostic ops (:data:`AGNOSTIC_OPS`) take whatever format their tensors arrive in and pass
  it on: element-wise ops, BatchNormalization and activations, and the ops the cuda backend runs in
  the tensor's own memory format (window and global pooling, Resize, Pad). A Concat is agnostic too
  when it stands alone (:func:`standalone_concats`): its buffer takes its producers' format and its
  readers read it whole (a UNet's skip connections). Concats that share a buffer (DenseNet's
  growing ``cat``, Inception's inner ``cat``) stay in NCHW: their channel slices of a channels-last
  buffer are strided rows for the convs that write them and the BatchNormalization + ReLU that
  read them, a cost this plan does not see (DenseNet-121 at batch 32 on an H200: 5.76 ms with its
  Concats in NCHW, 9.40 ms when every Concat passed NHWC through).
  Shape and Size (:data:`METADATA_OPS`) read no data (the executor folds them to constants), so
  reading a tensor in either format costs them nothing. Every other op, graph inputs and graph
  outputs are fixed in NCHW (ONNX semantics).
* A Transpose that moves the channels last (perm ``(0, 2, ..., r-1, 1)``, rank 4 or 5: the
  ``permute(0, 2, 3, 1)`` of ConvNeXt's LayerNorm and MLP) reads its input in NHWC: of a
  channels-last tensor it is a free view with C-contiguous rows, of an NCHW one a copy. Its output
  is an ordinary tensor (NCHW side). The Transpose that moves them back (perm
  ``(0, r-1, 1, ..., r-2)``) reads ordinary rows and gives a channels-last tensor for free: its
  output is on the NHWC side (:func:`channel_moves`). Without this rule the plan saw ConvNeXt's
  permutes as fixed NCHW ops and kept its depthwise convs in NCHW, where each LayerNorm then
  copied its input (H200, batch 32: 0.08 ms per stage-1 LayerNorm instead of 0.026, and the 7x7
  depthwise convs at 0.22 ms instead of about 0.11 in NHWC).
* An edge between two nodes whose formats differ costs one transpose of the tensor on that edge
  (measured on the GPU, by tensor size; nothing for a tensor whose two formats are one memory
  order: one channel, or one spatial position). A value is converted once per node that reads it.
* Source side = NCHW, sink side = NHWC: conv ``v`` gets ``s -> v`` with its NHWC cost and
  ``v -> t`` with its NCHW cost; fixed-NCHW nodes are tied to the source; each data edge gets its
  transpose cost both ways. The minimum cut is the cheapest assignment (networkx, on integer
  nanoseconds: its partitions are exact only on integer capacities).

The result is ``{node: "nchw" | "nhwc"}`` for the convs; the caller then takes each conv's best
configuration in its planned layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import networkx as nx
import onnx_ir as ir

AGNOSTIC_OPS = frozenset(
    {
        "Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu",
        "Softplus", "Gelu", "Erf", "Exp", "Log", "Sqrt", "Neg", "Abs", "Identity", "Dropout", "Cast",
        "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "BatchNormalization",
        # run in the input's memory format (convpass.kernels.pooling, .tensor_ops, the op
        # library's Pad)
        "MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "Resize", "Upsample", "Pad",
    }
)
# read only their input's shape: a tensor's format is nothing to them (exported models compute
# UNet's Pad widths and many Reshape targets from Shape of the feature maps)
METADATA_OPS = frozenset({"Shape", "Size"})
INF = float("inf")
_NS_PER_MS = 1_000_000


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    layouts: dict[ir.Node, str]
    cost_ms: float  # conv times + transposes of the plan
    per_conv_best_ms: float  # conv times if every conv took its own best layout (transposes ignored)
    transposes: int


def plan_layouts(
    graph: ir.Graph,
    conv_costs: Mapping[ir.Node, Mapping[str, float]],
    transpose_ms: Callable[[ir.Value], float],
) -> LayoutPlan:
    """The min-cut layout assignment (see the module rules)."""
    conv_costs = {n: c for n, c in conv_costs.items() if c}
    if not conv_costs:
        return LayoutPlan({}, 0.0, 0.0, 0)
    g = nx.DiGraph()
    source, sink = "<nchw>", "<nhwc>"

    def add(u, v, capacity):
        if capacity <= 0:
            return
        if capacity != INF:
            # integer nanoseconds: networkx's max-flow is exact only on integers; on float
            # capacities its partition missed the minimum cut by up to 0.07 ms on EfficientNet-V2-S
            # (and differed from run to run, with the order of the graph's nodes in memory)
            capacity = max(1, round(capacity * _NS_PER_MS))
        if g.has_edge(u, v):
            g[u][v]["capacity"] += capacity
        else:
            g.add_edge(u, v, capacity=capacity)

    movable = movable_nodes(graph, conv_costs)
    moves = channel_moves(graph)
    # a node's vertex is where it reads its inputs; a channel move's outputs get a vertex of their own
    out_vertex = {node: (node, "out") for node in moves}
    for node in graph:
        if node in conv_costs:
            costs = conv_costs[node]
            add(source, node, costs.get("nhwc", INF))
            add(node, sink, costs.get("nchw", INF))
        elif node in moves:
            to_last = moves[node] == "to_last"
            add(node, sink, INF) if to_last else add(source, node, INF)
            add(out_vertex[node], sink, INF) if not to_last else add(source, out_vertex[node], INF)
        elif node not in movable:
            add(source, node, INF)
        else:
            g.add_node(node)
    for node in graph:
        here = out_vertex.get(node, node)
        for value in node.outputs:
            consumers = dict.fromkeys(c for c, _ in value.uses())  # in use order: a deterministic graph
            for consumer in consumers:
                if node in movable or consumer in movable or node in moves or consumer in moves:
                    cost = transpose_ms(value)
                    add(here, consumer, cost)
                    add(consumer, here, cost)
            if value.is_graph_output() and (node in movable or node in moves):
                add(source, here, transpose_ms(value))  # outputs are NCHW: NHWC here costs a transpose
    # Graph inputs feeding movable nodes: a transpose if that node ends up NHWC.
    for value in graph.inputs:
        for consumer in dict.fromkeys(c for c, _ in value.uses()):
            if consumer in movable or consumer in moves:
                add(source, consumer, transpose_ms(value))
    # Constants (weights, BN params) are pre-transformed once: no run-time cost.
    _, (s_side, _) = nx.minimum_cut(g, source, sink)
    fmt = {n: ("nchw" if n in s_side or n not in g else "nhwc") for n in movable}
    return _evaluate(graph, fmt, conv_costs, transpose_ms)


def channel_moves(graph: ir.Graph) -> dict[ir.Node, str]:
    """The Transposes that move the channels last (``"to_last"``: perm ``(0, 2, ..., r-1, 1)``) or
    back (``"to_first"``: ``(0, r-1, 1, ..., r-2)``), rank 4 or 5 (module rules; in rank 3 both are
    ``(0, 2, 1)``, and which side is the channels cannot be told)."""
    moves = {}
    for node in graph:
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        attr = node.attributes.get("perm")
        perm = tuple(attr.as_ints()) if attr is not None else ()
        r = len(perm)
        if r not in (4, 5):
            continue
        if perm == (0, *range(2, r), 1):
            moves[node] = "to_last"
        elif perm == (0, r - 1, *range(1, r - 1)):
            moves[node] = "to_first"
    return moves


def movable_nodes(graph: ir.Graph, conv_costs: Mapping[ir.Node, Mapping[str, float]]) -> set[ir.Node]:
    """The nodes the plan may put in NHWC: the convs with costs, the agnostic and metadata ops and
    the standalone Concats (module rules)."""
    standard = [n for n in graph if n.domain in ("", "ai.onnx")]
    free = AGNOSTIC_OPS | METADATA_OPS
    return set(conv_costs) | {n for n in standard if n.op_type in free} | standalone_concats(standard)


def standalone_concats(nodes: Iterable[ir.Node]) -> set[ir.Node]:
    """The Concats that share a buffer with no other Concat: none of their inputs is a Concat's
    output, their output is read by no Concat, and their inputs are not a contiguous run of
    another Concat's on the same axis, nor the other way round (the cuda backend's families,
    :mod:`convpass.runtime.cuda.memory`)."""
    concats = [n for n in nodes if n.op_type == "Concat"]

    def axis(node: ir.Node) -> int | None:  # normalized; None: a negative axis of unknown rank
        a = node.attributes.get_int("axis", 0)
        shape = node.outputs[0].shape
        return a if a >= 0 else (a + len(shape) if shape is not None else None)

    def inside(inner: ir.Node, outer: ir.Node) -> bool:
        a, b = list(inner.inputs), list(outer.inputs)
        same_axis = None in (axis(inner), axis(outer)) or axis(inner) == axis(outer)  # unknown: assume shared
        return same_axis and len(a) < len(b) and any(b[i:i + len(a)] == a for i in range(len(b) - len(a) + 1))

    alone = set()
    for node in concats:
        fed = any(v is not None and v.producer() is not None and v.producer().op_type == "Concat" for v in node.inputs)
        feeds = any(user.op_type == "Concat" for out in node.outputs for user, _ in out.uses())
        nested = any(other is not node and (inside(node, other) or inside(other, node)) for other in concats)
        if not (fed or feeds or nested):
            alone.add(node)
    return alone


def _evaluate(graph, fmt, conv_costs, transpose_ms) -> LayoutPlan:
    """Total cost of an assignment: conv times plus a transpose (one that costs anything) per
    (value, reader) whose formats differ.

    (A value read by several consumers in the other format is counted once per consumer: the
    executor may share one transposed copy, so this slightly over-estimates mixed plans.)
    """
    layouts = {n: fmt[n] for n in conv_costs}
    total = sum(conv_costs[n].get(layouts[n], INF) for n in layouts)
    transposes = 0
    moves = channel_moves(graph)
    reads = {n: "nhwc" if m == "to_last" else "nchw" for n, m in moves.items()}
    writes = {n: "nchw" if m == "to_last" else "nhwc" for n, m in moves.items()}
    for node in graph:
        here = reads.get(node) or fmt.get(node, "nchw")
        for value in dict.fromkeys(node.inputs):  # a value read twice by one node is converted once
            if value is None or value.const_value is not None:
                continue
            producer = value.producer()
            there = (writes.get(producer) or fmt.get(producer, "nchw")) if producer is not None else "nchw"
            if here != there and (ms := transpose_ms(value)) > 0:
                total += ms
                transposes += 1
        written = writes.get(node) or fmt.get(node, "nchw")
        for value in node.outputs:
            if value.is_graph_output() and written != "nchw" and (ms := transpose_ms(value)) > 0:
                total += ms
                transposes += 1
    best = sum(min(c.values()) for c in conv_costs.values())
    return LayoutPlan(layouts, total, best, transposes)

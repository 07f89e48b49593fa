"""Choose each convolution's memory format for the whole graph at once: an s-t minimum cut.

Rules (per shape profile):

* Every conv has a measured cost in NCHW and in NHWC (its best configuration in each). A conv with
  no measurement in a layout cannot take it (infinite cost).
* Layout-agnostic ops (:data:`AGNOSTIC_OPS`) take whatever format their tensors arrive in and pass
  it on: element-wise ops, BatchNormalization and activations, and the ops the cuda backend runs in
  the tensor's own memory format (window and global pooling, Resize, Pad). A channel slice of a
  channels-last buffer arrives channels-last: the element-wise step that reads it (a dense layer's
  BatchNormalization + Relu) writes a packed channels-last tensor
  (:mod:`convpass.kernels.elementwise_launch`), so its NHWC conv reads it without a copy. Concats are agnostic
  too, one *family* at a time (:func:`concat_families`): the Concats that share one buffer in the
  cuda backend (DenseNet's and RRDB's growing ``cat``: each a contiguous run of the next one's
  inputs) are tied together (infinite edges both ways), since the buffer has one format; its
  producers write their slices (channels-last slices are strided rows: the convs through strided
  output descriptors, element-wise kernels at any strides), a producer in the other format through
  a transposing copy: the edge from it to the family's root costs that transpose, once (an input
  the root reads is not counted again at the Concats inside it). Concats of different families
  (Inception's inner ``cat`` placed into the block's) are joined by ordinary edges. A conv that
  reads a channel slice of a shared buffer (a dense block's next conv reading the features so
  far) copies it to a packed tensor first (:func:`convpass.native.cudnn.as_layout`; priced as a
  transpose of the slice), except an NCHW slice of one sample, which is packed: at batch 1 the copy
  is charged only with buffer and conv both in NHWC (strided rows); with more samples an NCHW slice's
  samples lie the buffer's channels apart, so it is copied in every pair of formats and favours
  neither. (A forward conv on cuDNN's legacy API reads such a slice in its own memory order in
  place where cuDNN takes the slice's strides, :mod:`convpass.kernels.convolution`; the plan
  still prices the copy, which is what runs where cuDNN refuses.) A conv whose costs were timed
  reading its slice (``priced_slices``: its problem names the slice, and the tuner timed the read
  in place or the copy and the conv, per format) has the read in its costs: its edge from the
  buffer is an ordinary one (a transpose where the formats differ, nothing where they agree), never
  the copy again. (Charged the copy twice, an RRDB net's dense convs at batch 1 went to NCHW,
  where their timed costs were 1.2 to 1.7x their NHWC ones, the copy included.) (Charged free in NCHW at every batch, an ESRGAN-style RRDB net's dense convs stayed in
  NCHW at batch 16, where cuDNN's kernels converted every input and output to NHWC inside the call
  and the slices were copied all the same: its conv time was about 1.7x its NHWC plan's.) (Before
  families were tied, DenseNet-121 ran much slower when every Concat passed NHWC through on its
  own than with its Concats in NCHW: members of one buffer in two formats;
  docs/measurements/2026-11-23-nhwc-passthrough.md.)
  A Split along the channels (:func:`channel_splits`: a selective-kernel block splitting its input
  between its paths, ``torch.split(x, c, 1)``) is agnostic too: its outputs are channel slices,
  views of the input in its format, which a conv reads in place where cuDNN's legacy API takes
  the slice's strides (and copies to a packed tensor otherwise) in either format alike; an edge
  from it costs a transpose where the formats differ, as any other. (Held in NCHW, the Splits kept
  SK-ResNet-18's path convs in NCHW, where each ran about twice its NHWC time.)
  Shape and Size (:data:`METADATA_OPS`) read no data (the executor folds them to constants), so
  reading a tensor in either format costs them nothing. A ReduceMean / ReduceMax over exactly the
  spatial axes (:func:`spatial_reductions`: a squeeze-excitation or ECA gate's pooling, ``x.mean((2,
  3))``) is global pooling, which the cuda backend runs on either storage; an Expand of a tensor
  with one spatial position (a gate broadcast to its feature map, :func:`broadcast_gates`) is
  agnostic too: the fused element-wise group that reads it takes its input as a broadcast. Every
  other op, graph inputs and graph outputs are fixed in NCHW (ONNX semantics).
* A fusion unit the executor runs fused (``units``: :mod:`convpass.core.fusion_units`, e.g. a
  GroupNorm exported as Reshape -> InstanceNormalization -> Reshape -> Mul -> Add, with its SiLU)
  reads and writes either format as one step: its nodes are movable and tied together (infinite
  edges both ways), so its inner Reshapes do not pin it to NCHW. The fused step runs in the
  storage its input arrives in (the cuda backend converts nothing before it), so where that input
  is a conv's output and the step was timed in both formats (``unit_costs``:
  :func:`convpass.compiler.fusions.fused_unit_costs`), the unit is tied to that conv and costs its
  time in their common format, as a conv does; any other unit costs nothing in either format. (A
  channels-last GroupNorm step measured up to 4x its channels-first time on large feature maps;
  free in either format, the plan kept such units in NHWC beside NHWC convs where a channels-first
  conv before the step and a transpose after it were cheaper.)
* A Transpose that moves the channels last (perm ``(0, 2, ..., r-1, 1)``, rank 4 or 5: the
  ``permute(0, 2, 3, 1)`` of ConvNeXt's LayerNorm and MLP) reads its input in NHWC: of a
  channels-last tensor it is a free view with C-contiguous rows, of an NCHW one a copy. Its output
  is an ordinary tensor (NCHW side). The Transpose that moves them back (perm
  ``(0, r-1, 1, ..., r-2)``) reads ordinary rows and gives a channels-last tensor for free: its
  output is on the NHWC side (:func:`channel_moves`). Without this rule the plan saw ConvNeXt's
  permutes as fixed NCHW ops and kept its depthwise convs in NCHW, where each LayerNorm then
  copied its input, and the 7x7 depthwise convs ran about twice as long as in NHWC
  (docs/measurements/2026-11-23-wide-panel-one-run.md).
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
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import networkx as nx
import onnx_ir as ir

from convpass.compiler.passes.min_cut import INF, add_capacity

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
SPATIAL_REDUCTIONS = frozenset({"ReduceMean", "ReduceMax"})  # global pooling when over the spatial axes
# read only their input's shape: a tensor's format is nothing to them (exported models compute
# UNet's Pad widths and many Reshape targets from Shape of the feature maps)
METADATA_OPS = frozenset({"Shape", "Size"})


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    layouts: dict[ir.Node, str]
    cost_ms: float  # conv times + timed fused units' times + transposes of the plan
    per_conv_best_ms: float  # conv times if every conv took its own best layout (transposes ignored)
    transposes: int
    timed_units: int = 0  # fused units whose time per format the plan weighed (part of cost_ms)


def plan_layouts(
    graph: ir.Graph,
    conv_costs: Mapping[ir.Node, Mapping[str, float]],
    transpose_ms: Callable[[ir.Value], float],
    units: Iterable[Iterable[ir.Node]] = (),
    shapes: Mapping[str, Sequence[Any]] | None = None,
    unit_costs: Mapping[ir.Node, Mapping[str, float]] | None = None,
    priced_slices: Iterable[ir.Node] = (),
) -> LayoutPlan:
    """The min-cut layout assignment (see the module rules); ``units``: the node sets of the
    fusion units that run fused; ``shapes``: value name -> dims of the profile (where values do
    not carry their shapes); ``unit_costs``: a fused unit's first node -> its time per format
    (``{"nchw": ms, "nhwc": ms}``; a unit without both runs free in either); ``priced_slices``: the
    convs whose costs include reading their channel slice of a shared buffer (module rules)."""
    priced = frozenset(priced_slices)
    units = [list(u) for u in units if u]
    conv_costs = {n: c for n, c in conv_costs.items() if c}
    # a timed unit whose input a conv writes: (unit's first node, that conv) -> the unit's costs
    fed = {u[0]: _input_conv(u[0], conv_costs) for u in units}
    unit_costs = {u[0]: dict(unit_costs[u[0]]) for u in units
                  if unit_costs and fed[u[0]] is not None and _both(unit_costs.get(u[0]))}
    if not conv_costs:
        return LayoutPlan({}, 0.0, 0.0, 0)
    g = nx.DiGraph()
    source, sink = "<nchw>", "<nhwc>"

    add = functools.partial(add_capacity, g)  # integer nanoseconds (min_cut's rules)

    movable = movable_nodes(graph, conv_costs, units, shapes)
    moves = channel_moves(graph)
    families = concat_families(n for n in graph if n.domain in ("", "ai.onnx"))
    ties = ([list(unit) for unit in units] + [[root, node] for node, root in families.items() if node is not root]
            + [[root, fed[root]] for root in unit_costs])  # a timed unit runs in the storage its conv writes
    for tied in ties:  # one step, or one buffer: one format
        for node in tied[1:]:
            add(tied[0], node, INF)
            add(node, tied[0], INF)
    # a node's vertex is where it reads its inputs; a channel move's outputs get a vertex of their own
    out_vertex = {node: (node, "out") for node in moves}
    for node in graph:
        if node in conv_costs or node in unit_costs:
            costs = conv_costs.get(node) or unit_costs[node]
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
                if _reads_into_family(value, consumer, families):
                    continue
                if node in movable or consumer in movable or node in moves or consumer in moves:
                    cost = transpose_ms(value)
                    if consumer in conv_costs and families.get(node, node) is not node and consumer not in priced:
                        # a conv reading a channel slice of a shared Concat buffer (module rules)
                        if not _packed_nchw_slice(value, shapes):
                            continue  # copied to a packed tensor in any pair of formats: no preference
                        # one sample: in NCHW the slice is packed; in NHWC it is strided rows, which the
                        # conv copies to a packed tensor first (about a transpose's bytes). Costs (buffer,
                        # conv): NCHW/NCHW 0, apart a transpose, NHWC/NHWC the copy: cut as
                        # T*[buffer NHWC] + T*[buffer NCHW, conv NHWC]
                        add(source, here, cost)
                        add(here, consumer, cost)
                        continue
                    add(here, consumer, cost)
                    add(consumer, here, cost)
            if value.is_graph_output() and (node in movable or node in moves):
                add(source, here, transpose_ms(value))  # outputs are NCHW: NHWC here costs a transpose
    # Graph inputs feeding movable nodes: a transpose if that node ends up NHWC.
    for value in graph.inputs:
        for consumer in dict.fromkeys(c for c, _ in value.uses()):
            if (consumer in movable or consumer in moves) and not _reads_into_family(value, consumer, families):
                add(source, consumer, transpose_ms(value))
    # Constants (weights, BN params) are pre-transformed once: no run-time cost.
    _, (s_side, _) = nx.minimum_cut(g, source, sink)
    fmt = {n: ("nchw" if n in s_side or n not in g else "nhwc") for n in movable}
    return _evaluate(graph, fmt, conv_costs, transpose_ms, families, unit_costs, shapes, priced)


def _packed_nchw_slice(value: ir.Value, shapes: Mapping[str, Sequence[Any]] | None) -> bool:
    """Whether a channel slice ``value`` of a shared Concat buffer is a packed NCHW tensor: with one
    sample, or an unknown batch (taken as one). With a known batch of more, its samples lie the whole
    buffer's channels apart, and the conv reading it copies it to a packed tensor first, as it does a
    channels-last slice."""
    dims = _dims(value, shapes)
    return not (dims and isinstance(dims[0], int) and dims[0] > 1)


def _input_conv(first: ir.Node, conv_costs: Mapping[ir.Node, Any]) -> ir.Node | None:
    """The conv (with costs) whose output a unit's first node reads as its data input, if any."""
    x = first.inputs[0] if first.inputs else None
    producer = x.producer() if x is not None else None
    return producer if producer in conv_costs else None


def _both(costs: Mapping[str, float] | None) -> bool:
    return bool(costs) and all(isinstance(costs.get(k), (int, float)) and costs[k] >= 0 for k in ("nchw", "nhwc"))


def _dims(value: ir.Value | None, shapes: Mapping[str, Sequence[Any]] | None) -> list[Any] | None:
    if value is None:
        return None
    dims = shapes.get(value.name) if shapes and value.name else None
    if dims is None and value.shape is not None:
        dims = list(value.shape)
    return None if dims is None else list(dims)


def broadcast_gates(nodes: Iterable[ir.Node], shapes: Mapping[str, Sequence[Any]] | None = None) -> set[ir.Node]:
    """The Expand nodes whose input has one spatial position (or no spatial axes)."""
    found = set()
    for node in nodes:
        dims = _dims(node.inputs[0], shapes) if node.op_type == "Expand" and node.inputs else None
        if dims is not None and all(d == 1 for d in dims[2:]):
            found.add(node)
    return found


def spatial_reductions(nodes: Iterable[ir.Node], shapes: Mapping[str, Sequence[Any]] | None = None) -> set[ir.Node]:
    """The ReduceMean / ReduceMax nodes over exactly the spatial axes of a rank 3-5 input (axes
    from the attribute, or from a constant second input from opset 18 on)."""
    found = set()
    for node in nodes:
        if node.op_type not in SPATIAL_REDUCTIONS or not node.inputs:
            continue
        shape = _dims(node.inputs[0], shapes)
        if shape is None or not 3 <= len(shape) <= 5:
            continue
        attr = node.attributes.get("axes")
        axes = list(attr.as_ints()) if attr is not None else None
        if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
            const = ir.convenience.get_const_tensor(node.inputs[1])
            axes = [int(a) for a in const.numpy().reshape(-1)] if const is not None else None
        rank = len(shape)
        if axes is not None and sorted(a % rank for a in axes) == list(range(2, rank)):
            found.add(node)
    return found


def channel_splits(nodes: Iterable[ir.Node], shapes: Mapping[str, Sequence[Any]] | None = None) -> set[ir.Node]:
    """The Split nodes along axis 1 of a rank 3-5 input (the channels)."""
    found = set()
    for node in nodes:
        dims = _dims(node.inputs[0], shapes) if node.op_type == "Split" and node.inputs else None
        if dims is not None and 3 <= len(dims) <= 5 and node.attributes.get_int("axis", 0) % len(dims) == 1:
            found.add(node)
    return found


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


def movable_nodes(graph: ir.Graph, conv_costs: Mapping[ir.Node, Mapping[str, float]], units: Iterable[Iterable[ir.Node]] = (),
                  shapes: Mapping[str, Sequence[Any]] | None = None) -> set[ir.Node]:
    """The nodes the plan may put in NHWC: the convs with costs, the agnostic and metadata ops,
    the spatial reductions, the channel Splits, the standalone Concats and the nodes of fused units
    (module rules)."""
    standard = [n for n in graph if n.domain in ("", "ai.onnx")]
    free = AGNOSTIC_OPS | METADATA_OPS
    fused = {n for unit in units for n in unit}
    return (set(conv_costs) | {n for n in standard if n.op_type in free | {"Concat"}}
            | spatial_reductions(standard, shapes) | channel_splits(standard, shapes) | broadcast_gates(standard, shapes) | fused)


def concat_families(nodes: Iterable[ir.Node]) -> dict[ir.Node, ir.Node]:
    """Every Concat -> the root of its family, the Concats that share one buffer in the cuda
    backend (:mod:`convpass.runtime.cuda.memory`): a Concat whose inputs are a contiguous run of a
    larger one's on the same axis belongs to that one's family (transitively; an axis that cannot
    be told, a negative one of unknown rank, counts as the same)."""
    concats = [n for n in nodes if n.op_type == "Concat"]

    def axis(node: ir.Node) -> int | None:
        a = node.attributes.get_int("axis", 0)
        shape = node.outputs[0].shape
        return a if a >= 0 else (a + len(shape) if shape is not None else None)

    def inside(inner: ir.Node, outer: ir.Node) -> bool:
        a, b = list(inner.inputs), list(outer.inputs)
        same_axis = None in (axis(inner), axis(outer)) or axis(inner) == axis(outer)
        return same_axis and len(a) < len(b) and any(b[i:i + len(a)] == a for i in range(len(b) - len(a) + 1))

    parent = {}
    for node in concats:
        outers = [o for o in concats if o is not node and inside(node, o)]
        if outers:
            parent[node] = max(outers, key=lambda o: len(o.inputs))
    root = {}
    for node in concats:
        top, seen = node, {node}
        while top in parent and parent[top] not in seen:
            top = parent[top]
            seen.add(top)
        root[node] = top
    return root


def _reads_into_family(value: ir.Value, consumer: ir.Node, families: Mapping[ir.Node, ir.Node]) -> bool:
    """Whether ``consumer`` is a Concat inside a family whose root reads ``value`` too: the family's
    buffer holds it once, so the edge is the root's alone."""
    root = families.get(consumer)
    return root is not None and root is not consumer and any(v is value for v in root.inputs)


def _evaluate(graph, fmt, conv_costs, transpose_ms, families=None, unit_costs=None, shapes=None, priced=frozenset()) -> LayoutPlan:
    """Total cost of an assignment: conv times, timed fused units' times (``unit_costs``, by a
    unit's first node) plus a transpose (one that costs anything) per (value, reader) whose formats
    differ (``families``: :func:`concat_families`, when known), and the copy a conv makes of its
    channel slice of a shared buffer unless its costs hold it (``priced``: the module rules).

    (A value read by several consumers in the other format is counted once per consumer: the
    executor shares one copy among the plain 2-D Conv readers of a value in one format that
    read it in their own launch (:mod:`convpass.runtime.cuda.shared_layouts`, rule 1: not
    ConvTranspose, 1-D or padded convs, nor values written into a Concat slice), so this
    over-estimates plans where such readers share it.)
    """
    layouts = {n: fmt[n] for n in conv_costs}
    total = sum(conv_costs[n].get(layouts[n], INF) for n in layouts)
    total += sum(costs[fmt.get(n, "nchw")] for n, costs in (unit_costs or {}).items())
    transposes = 0
    moves = channel_moves(graph)
    if families is None:
        families = concat_families(n for n in graph if n.domain in ("", "ai.onnx"))
    if any(fmt.get(node, "nchw") != fmt.get(root, "nchw") for node, root in families.items()):
        total = INF  # one buffer in two formats: not a plan the cut can give (the members are tied)
    reads = {n: "nhwc" if m == "to_last" else "nchw" for n, m in moves.items()}
    writes = {n: "nchw" if m == "to_last" else "nhwc" for n, m in moves.items()}
    for node in graph:
        here = reads.get(node) or fmt.get(node, "nchw")
        for value in dict.fromkeys(node.inputs):  # a value read twice by one node is converted once
            if value is None or value.const_value is not None or _reads_into_family(value, node, families):
                continue
            producer = value.producer()
            there = (writes.get(producer) or fmt.get(producer, "nchw")) if producer is not None else "nchw"
            if here != there and (ms := transpose_ms(value)) > 0:
                total += ms
                transposes += 1
            elif (here == there and node in conv_costs and node not in priced and producer is not None
                  and families.get(producer, producer) is not producer
                  and (here == "nhwc" or not _packed_nchw_slice(value, shapes))):
                total += transpose_ms(value)  # the conv copies its channel slice of a shared buffer to a packed tensor
        written = writes.get(node) or fmt.get(node, "nchw")
        for value in node.outputs:
            if value.is_graph_output() and written != "nchw" and (ms := transpose_ms(value)) > 0:
                total += ms
                transposes += 1
    best = sum(min(c.values()) for c in conv_costs.values())
    return LayoutPlan(layouts, total, best, transposes, len(unit_costs or {}))

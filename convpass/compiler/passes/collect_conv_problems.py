"""Collect the distinct cuDNN problems of a model.

Rules:

* Every canonicalized conv node contributes one problem per shape profile and per direction: the
  direction that runs it (``fwd`` for Conv, ``dgrad`` for ConvTranspose) and, for Conv, any extra
  training directions asked for (``dgrad``, ``wgrad``).
* A problem is the tuple of its candidate geometries (two for a 1-D conv: both 2-D mappings, one
  otherwise); identical problems anywhere in the model are listed once, with every use.
* A forward Conv with a constant bias is a problem with its ``fusion``: the epilogue its step
  absorbs by :func:`convpass.core.fusion.absorbed` (the one rule the runtime follows too), which
  the tuner times with it. With ``fusions`` on (graph-API engines tuned) that includes
  ``bias+swish``, a SiLU ``Mul(y, Sigmoid(y))`` fused into the engine's graph, and
  ``bias+leakyrelu<alpha>`` (``bias+leakyrelu0.2``), a ``LeakyRelu`` fused the same way, and
  either followed by ``+add`` where a residual ``Add`` is the activation's only reader
  (``bias+leakyrelu0.01+add``: CSPDarknet's residual blocks; the tuner times its shorter graph too).
  A forward Conv with no bias input whose output only a residual ``Add`` reads is the same
  problem as with a bias, ``bias+add`` (``bias+add+relu`` with the Relu after it): the executor
  runs it with a zero bias (:mod:`convpass.core.fusion`, "A conv without a bias").
* A forward Conv whose input the executor will read as a channel slice of a wider buffer (a
  Concat family's, a Split's input: :func:`convpass.core.concat_slices.channel_slices`, the rule the
  runtime's memory planner follows too) is a problem with its ``x_slice``, which the tuner times
  reading that slice (or with the copy it needs). Only where the executor reads it in place: a
  conv of its own 2-D or 3-D geometry (no 1-D mapping, no zero pre-pad). Kept per profile in
  ``node.meta[X_SLICE_KEY]``, so the decisions' pass finds the same problem.
* A forward Conv whose step writes its output into its channel slice of a Concat family's buffer
  (rules 3 and 4 of :mod:`convpass.core.concat_slices`, the rule the runtime's memory planner
  places it by: its step's epilogue none, a bias, a ReLU or a graph-API activation alone
  (``bias+leakyrelu0.2``: ESRGAN's dense blocks), its output placed in the family; a
  zero-width Pad between them whose widths are constants here passes the slice on) is a problem
  with its ``y_slice``, which the tuner times writing into that slice (or with the copy it
  needs). Only a conv of its own 2-D or 3-D geometry (no 1-D mapping: the executor copies its
  packed output); a ConvTranspose so placed writes its slice from its bias pass (its backward
  data runs packed either way), no slice in its problem. Kept per profile in
  ``node.meta[Y_SLICE_KEY]``. A conv reading one slice and writing another names both.
* A forward Conv whose step adds a residual after its activation (a graph-API fusion's ``+add``:
  :func:`convpass.core.fusion.adds_residual`) whose ``z`` the executor reads as a channel slice by
  the same rule (CSPDarknet's first block of a stage adds the second half of its stage's Split)
  is a problem with its ``z_slice``, which the tuner times reading that slice (or with the copy
  it needs). Only a conv of its own 2-D or 3-D geometry (a 1-D mapping maps ``z`` too). Kept per
  profile in ``node.meta[Z_SLICE_KEY]``. Any other residual (a legacy epilogue's) is timed packed.
* Results: ``model.meta["convpass.problems"]`` (and ``self.problems``): an insertion-ordered dict
  ``ConvProblem -> [ProblemUse, ...]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from convpass.compiler.passes import state
from convpass.compiler.passes.state import CANONICAL_KEY, PROBLEMS_KEY, VALUE_SHAPES_KEY
from convpass.core import concat_slices
from convpass.core.concat_slices import ConcatInfo, SplitInfo, conv_step_writes_slice
from convpass.core.fusion import Absorbed, absorbed, adds_residual
from convpass.core.problem import ConvProblem, Direction, InputSlice, OutputSlice, ResidualSlice, keyed_slice

X_SLICE_KEY = "convpass.x_slice"  # node.meta: per profile, the InputSlice the conv's input is read as, or None
Y_SLICE_KEY = "convpass.y_slice"  # node.meta: per profile, the OutputSlice the conv's output is written into, or None
Z_SLICE_KEY = "convpass.z_slice"  # node.meta: per profile, the ResidualSlice the conv's step reads its residual as, or None


@dataclasses.dataclass(frozen=True)
class ProblemUse:
    """One node at one profile that needs a problem decided."""

    node: ir.Node
    profile: int


class _IrSteps:
    """The onnx-ir graph as :class:`convpass.core.fusion.StepGraph` (``shapes``: the profile's
    resolved value shapes, read where the graph's own are not concrete)."""

    def __init__(self, shapes: Mapping[str, Sequence[int]]) -> None:
        self.shapes = shapes

    def op(self, node: ir.Node) -> str:
        return node.op_type if node.domain in ("", "ai.onnx") else ""

    def inputs(self, node: ir.Node) -> Sequence[ir.Value | None]:
        return node.inputs

    def outputs(self, node: ir.Node) -> Sequence[ir.Value]:
        return node.outputs

    def readers(self, value: ir.Value) -> list[ir.Node]:
        return [user for user, _ in value.uses()]

    def is_output(self, value: ir.Value) -> bool:
        return value.is_graph_output()

    def is_constant(self, value: ir.Value) -> bool:
        return value.const_value is not None or value.is_initializer()

    def same_shape_and_type(self, a: ir.Value, b: ir.Value) -> bool:
        if None not in (a.dtype, b.dtype) and a.dtype != b.dtype:  # ONNX's Add needs one type anyway
            return False
        da = self._dims(a)
        return da is not None and da == self._dims(b)

    def _dims(self, v: ir.Value) -> tuple | None:
        d = tuple(self.shapes[v.name]) if v.name in self.shapes else (None if v.shape is None else tuple(v.shape))
        return d if d is not None and all(isinstance(n, int) for n in d) else None

    def ready_before(self, value: ir.Value, node: ir.Node) -> bool:
        producer = value.producer()
        if producer is None:
            return True
        graph = node.graph
        if graph is None or producer.graph is not graph:
            return False
        for n in graph:
            if n is producer:
                return True
            if n is node:
                return False
        return False

    def free(self, node: ir.Node) -> bool:
        return True

    def attribute(self, node: ir.Node, name: str, default: object) -> object:
        attr = node.attributes.get(name)
        return default if attr is None else attr.value


def conv_fusion(node: ir.Node, graph_fusions: bool = True, shapes: Mapping[str, Sequence[int]] | None = None) -> str:
    """The epilogue a Conv node runs in its step (:func:`convpass.core.fusion.absorbed`, the rule
    the runtime runs too), or ``""``; ``graph_fusions``: whether graph-API fused graphs are
    candidates; ``shapes``: the profile's value shapes
    (:data:`convpass.compiler.passes.resolve_shapes.VALUE_SHAPES_KEY`)."""
    if node.op_type != "Conv":
        return ""
    return conv_step(node, graph_fusions, shapes).epilogue


def conv_step(node: ir.Node, graph_fusions: bool = True, shapes: Mapping[str, Sequence[int]] | None = None) -> Absorbed:
    """What the step of a Conv / ConvTranspose node absorbs and the value it writes
    (:func:`convpass.core.fusion.absorbed`; arguments as :func:`conv_fusion`)."""
    return absorbed(_IrSteps(shapes or {}), node, graph_fusions=graph_fusions)


def node_problems(node: ir.Node, profile: int, directions: Sequence[Direction], fusions: bool = False,
                  value_shapes: Sequence[Mapping[str, Sequence[int]]] = ()) -> list[ConvProblem]:
    """The problems a canonicalized node needs at a profile: its own direction first, with its
    epilogue (graph-API ones when ``fusions``; ``value_shapes``: per profile, as
    :data:`~convpass.compiler.passes.resolve_shapes.VALUE_SHAPES_KEY` holds them)."""
    canonical = node.meta[CANONICAL_KEY][profile]
    own = canonical.shapes[0].direction
    wanted = [own] + [d for d in directions if d != "fwd" and own == "fwd" and d != own]
    shapes = value_shapes[profile] if profile < len(value_shapes) else None
    fusion = conv_fusion(node, fusions, shapes) if own == "fwd" else ""
    x_slice, y_slice, z_slice = (_at(node.meta.get(k, ()), profile) for k in (X_SLICE_KEY, Y_SLICE_KEY, Z_SLICE_KEY))
    return [ConvProblem(tuple(s.with_direction(d) for s in canonical.shapes), fusion if d == own else "",
                        x_slice if d == own else None, y_slice if d == own else None, z_slice if d == own else None)
            for d in wanted]


def _at(per_profile: Sequence[Any], profile: int) -> Any:
    """What ``node.meta`` keeps for ``profile`` of a per-profile list (None past its end)."""
    return per_profile[profile] if profile < len(per_profile) else None


def _axis(node: ir.Node, rank: int, default: int) -> int | None:
    attr = node.attributes.get("axis")
    axis = default if attr is None else int(attr.value)
    axis = axis + rank if axis < 0 else axis
    return axis if 0 <= axis < rank else None


@dataclasses.dataclass(frozen=True)
class GraphSlices:
    """The channel slices of one graph at one profile: value -> the slice it is read as, and conv
    node -> the slice its step writes its output into."""

    reads: dict[ir.Value, InputSlice]
    writes: dict[ir.Node, OutputSlice]


def graph_slices(graph: ir.Graph, shapes: Mapping[str, Sequence[int]], fusions: bool = False) -> GraphSlices:
    """The channel slices of ``graph`` at a profile's ``shapes`` (:mod:`convpass.core.concat_slices`
    over the onnx-ir graph; ``fusions``: graph-API fused steps are candidates, as
    :func:`conv_fusion` takes them). The runtime places a value only where its producer's launch
    writes into a given array; the compiler, which has no launches, takes a conv's step by rule 4
    there and any other node of that one value but a Pad (a zero-width one passes its input's
    slice on)."""
    infos: dict[ir.Node, ConcatInfo] = {}
    splits: list[SplitInfo] = []
    steps: dict[ir.Value, ir.Node | None] = {}  # value -> the conv whose step writes it (None: a step that writes packed)
    for node in graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type in ("Conv", "ConvTranspose"):
            step = conv_step(node, fusions, shapes)
            if step.output is not None:
                steps[step.output] = node if conv_step_writes_slice(node.op_type, step.epilogue) else None
        if node.op_type not in ("Concat", "Split"):
            continue
        values = node.inputs if node.op_type == "Concat" else node.outputs
        dims = [_IrSteps(shapes)._dims(v) if v is not None else None for v in values]
        if not values or any(d is None for d in dims) or len({len(d) for d in dims if d is not None}) != 1:
            continue
        rank = len(dims[0])  # type: ignore[arg-type]
        axis = _axis(node, rank, 1 if node.op_type == "Concat" else 0)
        if axis is None:
            continue
        lengths = tuple(d[axis] for d in dims)  # type: ignore[index]
        if node.op_type == "Concat":
            if len({v.dtype for v in node.inputs if v is not None and v.dtype is not None}) <= 1:
                infos[node] = ConcatInfo(axis, tuple(node.inputs), lengths)
        elif node.inputs and node.inputs[0] is not None:
            splits.append(SplitInfo(axis, node.inputs[0], tuple(node.outputs), lengths))

    def aliasable(v: ir.Value) -> bool:
        return not (v.is_graph_input() or v.is_graph_output() or v.is_initializer() or v.const_value is not None)

    def writer(v: ir.Value) -> ir.Node | None:
        if v in steps:
            return steps[v]
        producer = v.producer()
        if producer is None or len(producer.outputs) != 1 or _is_pad(producer):
            return None
        return producer

    reads = concat_slices.channel_slices(infos, {n: n.outputs[0] for n in infos}, aliasable, writer, splits, _zero_pad_input)
    writes = concat_slices.output_slices(infos, aliasable, writer, _zero_pad_input)
    return GraphSlices(reads, writes)


def _is_pad(node: ir.Node) -> bool:
    return node.op_type == "Pad" and node.domain in ("", "ai.onnx")


def _zero_pad_input(v: ir.Value) -> ir.Value | None:
    """The data input ``u`` of the Pad computing ``v`` when its widths are constant zeros (an
    input from opset 11, the attribute before) and it is ``u``'s only reader; else None."""
    pad = v.producer()
    if pad is None or not _is_pad(pad) or not pad.inputs or pad.inputs[0] is None:
        return None
    u = pad.inputs[0]
    if len(pad.inputs) > 1 and pad.inputs[1] is not None:
        const = pad.inputs[1].const_value
        widths = None if const is None else const.numpy()
    else:
        attr = pad.attributes.get("pads") or pad.attributes.get("paddings")
        widths = None if attr is None else attr.value
    if widths is None or any(int(w) != 0 for w in np.asarray(widths).reshape(-1)):
        return None
    return u if [user for user, _ in u.uses()] == [pad] else None


def _own_geometry(node: ir.Node, profile: int) -> bool:
    """Whether a canonicalized node is a forward Conv run in its own 2-D or 3-D geometry (no 1-D mapping)."""
    canonical = node.meta[CANONICAL_KEY][profile]
    if node.op_type != "Conv" or len(canonical.shapes) != 1 or not node.inputs or node.inputs[0] is None:
        return False
    return canonical.shapes[0].direction == "fwd" and canonical.spatial_rank == canonical.shapes[0].rank


def conv_input_slice(node: ir.Node, profile: int, slices: Mapping[ir.Value, InputSlice]) -> InputSlice | None:
    """The slice a canonicalized forward Conv reads its input as at ``profile``, where the
    executor reads it in place (module rules); else None."""
    if not _own_geometry(node, profile) or any(node.meta[CANONICAL_KEY][profile].extra_pads):
        return None
    x_slice = slices.get(node.inputs[0])
    shape = node.meta[CANONICAL_KEY][profile].shapes[0]
    if x_slice is None or x_slice.first + shape.c > x_slice.channels:
        return None
    return keyed_slice(x_slice, shape.dtype)


def conv_residual_slice(node: ir.Node, profile: int, slices: Mapping[ir.Value, InputSlice], fusions: bool = False,
                        shapes: Mapping[str, Sequence[int]] | None = None) -> ResidualSlice | None:
    """The slice a canonicalized forward Conv's step reads its residual ``z`` as at ``profile``,
    where its epilogue adds the residual after its activation (module rules; ``fusions`` and
    ``shapes``: as :func:`conv_fusion` takes them); else None."""
    if not _own_geometry(node, profile):
        return None
    step = conv_step(node, fusions, shapes)
    read = slices.get(step.z) if adds_residual(step.epilogue) and step.z is not None else None
    shape = node.meta[CANONICAL_KEY][profile].shapes[0]
    if read is None or read.first + shape.k > read.channels:
        return None
    return keyed_slice(ResidualSlice(read.first, read.channels), shape.dtype)


def conv_output_slice(node: ir.Node, profile: int, slices: Mapping[ir.Node, OutputSlice]) -> OutputSlice | None:
    """The slice a canonicalized forward Conv's step writes its output into at ``profile``, where
    the executor writes it in place (module rules); else None."""
    y_slice = slices.get(node)
    if y_slice is None or not _own_geometry(node, profile):
        return None
    shape = node.meta[CANONICAL_KEY][profile].shapes[0]
    return keyed_slice(y_slice, shape.dtype) if y_slice.first + shape.k <= y_slice.channels else None


class CollectConvProblemsPass(ir.passes.InPlacePass):
    """Lists the distinct problems of the model with their uses (see the module rules).

    Requires the canonical forms ``CanonicalizeConvsPass`` computes; ensures a use of every
    canonical conv at every profile (:mod:`~convpass.compiler.passes.state`)."""

    def __init__(self, directions: Sequence[Direction] = ("fwd",), fusions: bool = False) -> None:
        super().__init__()
        self.directions = tuple(directions)
        self.fusions = fusions
        self.problems: dict[ConvProblem, list[ProblemUse]] = {}

    def requires(self, model: ir.Model) -> None:
        state.require(self, model, state.CANONICAL)

    def ensures(self, model: ir.Model) -> None:
        state.ensure(self, model, state.PROBLEMS_COLLECTED)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.problems = {}
        value_shapes = model.meta.get(VALUE_SHAPES_KEY, ())
        slices: dict[tuple[int, int], GraphSlices] = {}  # (graph, profile) -> its slices
        for node in ir.traversal.RecursiveGraphIterator(model.graph):  # bodies of If / Loop / Scan too
            profiles = range(len(node.meta.get(CANONICAL_KEY, ())))
            if node.graph is not None and profiles:
                for p in profiles:
                    if (id(node.graph), p) not in slices:
                        slices[(id(node.graph), p)] = graph_slices(node.graph, value_shapes[p] if p < len(value_shapes) else {}, self.fusions)
                node.meta[X_SLICE_KEY] = [conv_input_slice(node, p, slices[(id(node.graph), p)].reads) for p in profiles]
                node.meta[Y_SLICE_KEY] = [conv_output_slice(node, p, slices[(id(node.graph), p)].writes) for p in profiles]
                node.meta[Z_SLICE_KEY] = [conv_residual_slice(node, p, slices[(id(node.graph), p)].reads, self.fusions,
                                                              value_shapes[p] if p < len(value_shapes) else None) for p in profiles]
            for profile in profiles:
                for problem in node_problems(node, profile, self.directions, self.fusions, model.meta.get(VALUE_SHAPES_KEY, ())):
                    self.problems.setdefault(problem, []).append(ProblemUse(node, profile))
        model.meta[PROBLEMS_KEY] = self.problems
        return ir.passes.PassResult(model, modified=False)

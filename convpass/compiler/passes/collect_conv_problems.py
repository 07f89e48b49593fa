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
* Results: ``model.meta["convpass.problems"]`` (and ``self.problems``): an insertion-ordered dict
  ``ConvProblem -> [ProblemUse, ...]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import onnx_ir as ir

from convpass.compiler.passes import state
from convpass.compiler.passes.state import CANONICAL_KEY, PROBLEMS_KEY, VALUE_SHAPES_KEY
from convpass.core import concat_slices
from convpass.core.concat_slices import ConcatInfo, SplitInfo
from convpass.core.fusion import absorbed
from convpass.core.problem import ConvProblem, Direction, InputSlice

X_SLICE_KEY = "convpass.x_slice"  # node.meta: per profile, the InputSlice the conv's input is read as, or None


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
    return absorbed(_IrSteps(shapes or {}), node, graph_fusions=graph_fusions).epilogue


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
    slices = node.meta.get(X_SLICE_KEY, ())
    x_slice = slices[profile] if profile < len(slices) else None
    return [ConvProblem(tuple(s.with_direction(d) for s in canonical.shapes), fusion if d == own else "", x_slice if d == own else None)
            for d in wanted]


def _axis(node: ir.Node, rank: int, default: int) -> int | None:
    attr = node.attributes.get("axis")
    axis = default if attr is None else int(attr.value)
    axis = axis + rank if axis < 0 else axis
    return axis if 0 <= axis < rank else None


def graph_slices(graph: ir.Graph, shapes: Mapping[str, Sequence[int]]) -> dict[ir.Value, InputSlice]:
    """value -> the channel slice it is read as in ``graph`` at a profile's ``shapes``
    (:func:`convpass.core.concat_slices.channel_slices` over the onnx-ir graph). The runtime places
    a value only where its producer's launch writes into a given array; the compiler, which has no
    launches, takes any producer of that one value."""
    infos: dict[ir.Node, ConcatInfo] = {}
    splits: list[SplitInfo] = []
    for node in graph:
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Concat", "Split"):
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

    def places(v: ir.Value) -> bool:
        producer = v.producer()
        return producer is not None and len(producer.outputs) == 1

    return concat_slices.channel_slices(infos, {n: n.outputs[0] for n in infos}, aliasable, places, splits)


def conv_input_slice(node: ir.Node, profile: int, slices: Mapping[ir.Value, InputSlice]) -> InputSlice | None:
    """The slice a canonicalized forward Conv reads its input as at ``profile``, where the
    executor reads it in place (module rules); else None."""
    canonical = node.meta[CANONICAL_KEY][profile]
    if node.op_type != "Conv" or len(canonical.shapes) != 1 or any(canonical.extra_pads) or not node.inputs or node.inputs[0] is None:
        return None
    shape = canonical.shapes[0]
    x_slice = slices.get(node.inputs[0])
    if x_slice is None or shape.direction != "fwd" or canonical.spatial_rank != shape.rank:
        return None
    if x_slice.first + shape.c > x_slice.channels:
        return None
    return x_slice


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
        slices: dict[tuple[int, int], dict[ir.Value, InputSlice]] = {}  # (graph, profile) -> its slices
        for node in ir.traversal.RecursiveGraphIterator(model.graph):  # bodies of If / Loop / Scan too
            profiles = range(len(node.meta.get(CANONICAL_KEY, ())))
            if node.graph is not None and profiles:
                for p in profiles:
                    if (id(node.graph), p) not in slices:
                        slices[(id(node.graph), p)] = graph_slices(node.graph, value_shapes[p] if p < len(value_shapes) else {})
                node.meta[X_SLICE_KEY] = [conv_input_slice(node, p, slices[(id(node.graph), p)]) for p in profiles]
            for profile in profiles:
                for problem in node_problems(node, profile, self.directions, self.fusions, model.meta.get(VALUE_SHAPES_KEY, ())):
                    self.problems.setdefault(problem, []).append(ProblemUse(node, profile))
        model.meta[PROBLEMS_KEY] = self.problems
        return ir.passes.PassResult(model, modified=False)

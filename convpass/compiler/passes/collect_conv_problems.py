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
* Results: ``model.meta["convpass.problems"]`` (and ``self.problems``): an insertion-ordered dict
  ``ConvProblem -> [ProblemUse, ...]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import onnx_ir as ir

from convpass.compiler.passes import state
from convpass.compiler.passes.state import CANONICAL_KEY, PROBLEMS_KEY, VALUE_SHAPES_KEY
from convpass.core.fusion import absorbed
from convpass.core.problem import ConvProblem, Direction


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
    return [ConvProblem(tuple(s.with_direction(d) for s in canonical.shapes), fusion if d == own else "") for d in wanted]


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
        for node in ir.traversal.RecursiveGraphIterator(model.graph):  # bodies of If / Loop / Scan too
            for profile in range(len(node.meta.get(CANONICAL_KEY, ()))):
                for problem in node_problems(node, profile, self.directions, self.fusions, model.meta.get(VALUE_SHAPES_KEY, ())):
                    self.problems.setdefault(problem, []).append(ProblemUse(node, profile))
        model.meta[PROBLEMS_KEY] = self.problems
        return ir.passes.PassResult(model, modified=False)

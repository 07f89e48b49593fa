"""Collect the distinct cuDNN problems of a model.

Rules:

* Every canonicalized conv node contributes one problem per shape profile and per direction: the
  direction that runs it (``fwd`` for Conv, ``dgrad`` for ConvTranspose) and, for Conv, any extra
  training directions asked for (``dgrad``, ``wgrad``).
* A problem is the tuple of its candidate geometries (two for a 1-D conv: both 2-D mappings, one
  otherwise); identical problems anywhere in the model are listed once, with every use.
* A forward Conv with a constant bias is a problem with its ``fusion``: the epilogue the executor
  runs in the conv's step (:mod:`convpass.core.fusion`), which the tuner times with it. The rules
  are the executor's (:func:`convpass.kernels.convolution.lower_convs`): the output is no graph
  output; a residual ``Add`` that is its only reader, whose other operand has the output's shape
  and type and is ready before the conv (a graph input, a constant, or produced by an earlier node),
  then a one-input ``Relu`` that is the Add's only reader (``bias+add+relu``; ``bias+add``
  without it); else a ``Relu`` that is its only reader (``bias+relu``); else ``bias``.
* With ``fusions`` on (graph-API engines tuned), a Conv whose output is read only by an epilogue
  that cuDNN's graph API can fuse (:data:`convpass.native.cudnn.graph_api.FUSIONS`) takes that one
  instead: its candidates include the fused graphs. Today that is SiLU: ``Mul(y, Sigmoid(y))``,
  ``y`` and the Sigmoid read by nothing else (``bias+swish``).
* Results: ``model.meta["convpass.problems"]`` (and ``self.problems``): an insertion-ordered dict
  ``ConvProblem -> [ProblemUse, ...]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import onnx_ir as ir

from convpass.core.fusion import legacy_name
from convpass.compiler.passes.canonicalize_convs import META_KEY as CANONICAL_KEY
from convpass.compiler.passes.resolve_shapes import VALUE_SHAPES_KEY
from convpass.core.problem import ConvProblem, Direction

PROBLEMS_KEY = "convpass.problems"


@dataclasses.dataclass(frozen=True)
class ProblemUse:
    """One node at one profile that needs a problem decided."""

    node: ir.Node
    profile: int


def conv_fusion(node: ir.Node, graph_fusions: bool = True, shapes: Mapping[str, Sequence[int]] | None = None) -> str:
    """The epilogue a Conv node runs in its step (module rules), or ``""``; ``graph_fusions``:
    whether graph-API fused graphs are candidates; ``shapes``: the profile's value shapes
    (:data:`convpass.compiler.passes.resolve_shapes.VALUE_SHAPES_KEY`), which the residual's check reads
    where the graph's own shapes are not concrete."""
    if node.op_type != "Conv" or len(node.inputs) < 3 or node.inputs[2] is None or not node.outputs:
        return ""
    if node.inputs[2].const_value is None and not node.inputs[2].is_initializer():
        return ""
    y = node.outputs[0]
    if y.is_graph_output():
        return ""
    if graph_fusions and _swish_reads(y):
        return "bias+swish"
    uses = list(y.uses())
    if len(uses) != 1:
        return legacy_name(False, False)
    reader = uses[0][0]
    if _plain(reader, "Relu") and len(reader.inputs) == 1:
        return legacy_name(False, True)
    if not (_plain(reader, "Add") and len(reader.inputs) == 2 and reader.inputs[0] is not reader.inputs[1]):
        return legacy_name(False, False)
    z = reader.inputs[1] if reader.inputs[0] is y else reader.inputs[0]
    other_type = z is not None and None not in (z.dtype, y.dtype) and z.dtype != y.dtype  # ONNX's Add needs one type anyway
    if z is None or other_type or not _same_shape(z, y, shapes or {}) or not _ready_before(z, node):
        return legacy_name(False, False)
    out = reader.outputs[0]
    after = list(out.uses())
    relu = not out.is_graph_output() and len(after) == 1 and _plain(after[0][0], "Relu") and len(after[0][0].inputs) == 1
    return legacy_name(True, relu)


def _plain(node: ir.Node, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def _swish_reads(y: ir.Value) -> bool:
    """Whether ``y`` is read only by ``Mul(y, Sigmoid(y))``, the Sigmoid read by nothing else."""
    readers = {user for user, _ in y.uses()}
    sigmoid = next((n for n in readers if _plain(n, "Sigmoid")), None)
    mul = next((n for n in readers if _plain(n, "Mul")), None)
    if sigmoid is None or mul is None or len(readers) != 2 or len(y.uses()) != 2:
        return False
    s = sigmoid.outputs[0]
    return not s.is_graph_output() and len(s.uses()) == 1 and {v.name for v in mul.inputs if v is not None} == {y.name, s.name}


def _same_shape(a: ir.Value, b: ir.Value, shapes: Mapping[str, Sequence[int]]) -> bool:
    """Whether two values have one concrete shape (each from the profile's resolved shapes, else the
    graph's own)."""
    def dims(v: ir.Value) -> tuple | None:
        d = tuple(shapes[v.name]) if v.name in shapes else (None if v.shape is None else tuple(v.shape))
        return d if d is not None and all(isinstance(n, int) for n in d) else None

    da = dims(a)
    return da is not None and da == dims(b)


def _ready_before(z: ir.Value, conv: ir.Node) -> bool:
    """Whether ``z`` exists before ``conv`` runs: a graph input, a constant, or the output of a node
    earlier in the graph's (topological) order."""
    producer = z.producer()
    if producer is None:
        return True
    graph = conv.graph
    if graph is None or producer.graph is not graph:
        return False
    for n in graph:
        if n is producer:
            return True
        if n is conv:
            return False
    return False


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
    """Lists the distinct problems of the model with their uses (see the module rules)."""

    def __init__(self, directions: Sequence[Direction] = ("fwd",), fusions: bool = False) -> None:
        super().__init__()
        self.directions = tuple(directions)
        self.fusions = fusions
        self.problems: dict[ConvProblem, list[ProblemUse]] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.problems = {}
        for node in ir.traversal.RecursiveGraphIterator(model.graph):  # bodies of If / Loop / Scan too
            for profile in range(len(node.meta.get(CANONICAL_KEY, ()))):
                for problem in node_problems(node, profile, self.directions, self.fusions, model.meta.get(VALUE_SHAPES_KEY, ())):
                    self.problems.setdefault(problem, []).append(ProblemUse(node, profile))
        model.meta[PROBLEMS_KEY] = self.problems
        return ir.passes.PassResult(model, modified=False)

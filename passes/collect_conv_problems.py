"""Collect the distinct cuDNN problems of a model.

Rules:

* Every canonicalized conv node contributes one problem per shape profile and per direction: the
  direction that runs it (``fwd`` for Conv, ``dgrad`` for ConvTranspose) and, for Conv, any extra
  training directions asked for (``dgrad``, ``wgrad``).
* A problem is the tuple of its candidate geometries (two for a 1-D conv: both 2-D mappings, one
  otherwise); identical problems anywhere in the model are listed once, with every use.
* With ``fusions`` on, a forward Conv whose output is read only by an epilogue that cuDNN's graph
  API can fuse (:data:`convpass.cudnn.graph_api.FUSIONS`; :func:`conv_fusion` matches it) is a
  problem of its own, with that ``fusion``: its candidates include the fused graphs. Today that is
  SiLU after a Conv with bias: ``Mul(y, Sigmoid(y))``, ``y`` and the Sigmoid read by nothing else.
* Results: ``model.meta["convpass.problems"]`` (and ``self.problems``): an insertion-ordered dict
  ``ConvProblem -> [ProblemUse, ...]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import onnx_ir as ir

from convpass.passes.canonicalize_convs import META_KEY as CANONICAL_KEY
from convpass.problem import ConvShape, Direction

PROBLEMS_KEY = "convpass.problems"


@dataclasses.dataclass(frozen=True)
class ConvProblem:
    """What must be decided once: the candidate geometries of one convolution computation."""

    candidates: tuple[ConvShape, ...]
    fusion: str = ""  # the fused epilogue its conv can take (a key of graph_api.FUSIONS), or ""

    @property
    def direction(self) -> Direction:
        return self.candidates[0].direction

    @property
    def primary(self) -> ConvShape:
        return self.candidates[0]

    def __str__(self) -> str:
        mapping = f" (+{len(self.candidates) - 1} mapping)" if len(self.candidates) > 1 else ""
        return str(self.primary) + mapping + (f" + {self.fusion}" if self.fusion else "")


@dataclasses.dataclass(frozen=True)
class ProblemUse:
    """One node at one profile that needs a problem decided."""

    node: ir.Node
    profile: int


def conv_fusion(node: ir.Node) -> str:
    """The fused epilogue a Conv node can take (module rules), or ``""``."""
    if node.op_type != "Conv" or len(node.inputs) < 3 or node.inputs[2] is None or not node.outputs:
        return ""
    y = node.outputs[0]
    if y.is_graph_output():
        return ""
    readers = {user for user, _ in y.uses()}
    sigmoid = next((n for n in readers if n.op_type == "Sigmoid" and n.domain in ("", "ai.onnx")), None)
    mul = next((n for n in readers if n.op_type == "Mul" and n.domain in ("", "ai.onnx")), None)
    if sigmoid is None or mul is None or len(readers) != 2 or len(y.uses()) != 2:
        return ""
    s = sigmoid.outputs[0]
    if s.is_graph_output() or len(s.uses()) != 1 or {v.name for v in mul.inputs if v is not None} != {y.name, s.name}:
        return ""
    return "bias+swish"


def node_problems(node: ir.Node, profile: int, directions: Sequence[Direction], fusions: bool = False) -> list[ConvProblem]:
    """The problems a canonicalized node needs at a profile: its own direction first (with its
    fused epilogue when ``fusions``)."""
    canonical = node.meta[CANONICAL_KEY][profile]
    own = canonical.shapes[0].direction
    wanted = [own] + [d for d in directions if d != "fwd" and own == "fwd" and d != own]
    fusion = conv_fusion(node) if fusions and own == "fwd" else ""
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
        for node in model.graph:
            for profile in range(len(node.meta.get(CANONICAL_KEY, ()))):
                for problem in node_problems(node, profile, self.directions, self.fusions):
                    self.problems.setdefault(problem, []).append(ProblemUse(node, profile))
        model.meta[PROBLEMS_KEY] = self.problems
        return ir.passes.PassResult(model, modified=False)

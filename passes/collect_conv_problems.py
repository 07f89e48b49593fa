"""Collect the distinct cuDNN problems of a model.

Rules:

* Every canonicalized conv node contributes one problem per shape profile and per direction: the
  direction that runs it (``fwd`` for Conv, ``dgrad`` for ConvTranspose) and, for Conv, any extra
  training directions asked for (``dgrad``, ``wgrad``).
* A problem is the tuple of its candidate geometries (two for a 1-D conv: both 2-D mappings, one
  otherwise); identical problems anywhere in the model are listed once, with every use.
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

    @property
    def direction(self) -> Direction:
        return self.candidates[0].direction

    @property
    def primary(self) -> ConvShape:
        return self.candidates[0]

    def __str__(self) -> str:
        return str(self.primary) + (f" (+{len(self.candidates) - 1} mapping)" if len(self.candidates) > 1 else "")


@dataclasses.dataclass(frozen=True)
class ProblemUse:
    """One node at one profile that needs a problem decided."""

    node: ir.Node
    profile: int


def node_problems(node: ir.Node, profile: int, directions: Sequence[Direction]) -> list[ConvProblem]:
    """The problems a canonicalized node needs at a profile: its own direction first."""
    canonical = node.meta[CANONICAL_KEY][profile]
    own = canonical.shapes[0].direction
    wanted = [own] + [d for d in directions if d != "fwd" and own == "fwd" and d != own]
    return [ConvProblem(tuple(s.with_direction(d) for s in canonical.shapes)) for d in wanted]


class CollectConvProblemsPass(ir.passes.InPlacePass):
    """Lists the distinct problems of the model with their uses (see the module rules)."""

    def __init__(self, directions: Sequence[Direction] = ("fwd",)) -> None:
        super().__init__()
        self.directions = tuple(directions)
        self.problems: dict[ConvProblem, list[ProblemUse]] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.problems = {}
        for node in model.graph:
            for profile in range(len(node.meta.get(CANONICAL_KEY, ()))):
                for problem in node_problems(node, profile, self.directions):
                    self.problems.setdefault(problem, []).append(ProblemUse(node, profile))
        model.meta[PROBLEMS_KEY] = self.problems
        return ir.passes.PassResult(model, modified=False)

"""What the graph passes hand on to each other, and the checks that say it is there.

The passes leave what they find in onnx-ir's ``node.meta`` and ``model.meta`` (analysis results,
never written to the model file) under the keys below. A pass whose input depends on what an
earlier pass left says so in its ``requires()``, and a pass that promises something checkable says
so in its ``ensures()``, both with the checks of this module.

Rules:

1. A *tuned conv* is a Conv / ConvTranspose of the standard domain, in the main graph or in any
   If / Loop / Scan body, that no pass marked ``convpass.skip``.
2. :data:`WEIGHTS_FOLDED` (ensured by FoldConvWeightsPass; required by FoldBatchNormsPass and
   ResolveShapesPass): every tuned conv reads a constant weight and a constant bias, or none.
3. :data:`SHAPES_RESOLVED` (ensured by ResolveShapesPass; required by CanonicalizeConvsPass):
   ``model.meta`` holds the shape profiles and every tuned conv one shape entry per profile.
4. :data:`CANONICAL` (ensured by CanonicalizeConvsPass; required by CollectConvProblemsPass): every
   tuned conv holds its canonical cuDNN form, one per profile.
5. :data:`PROBLEMS_COLLECTED` (ensured by CollectConvProblemsPass; required by AnnotateConvsPass):
   ``model.meta`` holds the problems, with a use of every canonical conv at every profile.
6. :data:`ANNOTATED` (ensured by AnnotateConvsPass): no canonical conv is left in the standard domain.
7. A check that fails raises ``ir.passes.PreconditionError`` (from ``requires``) or
   ``ir.passes.PostconditionError`` (from ``ensures``): one line naming the pass, what it lacks,
   the node it lacks it for, and the pass that provides it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import onnx_ir as ir

__all__ = [
    "ANNOTATED", "CANONICAL", "CANONICAL_KEY", "CONV_OPS", "PROBLEMS_COLLECTED", "PROBLEMS_KEY", "PROFILES_KEY", "SHAPES_KEY",
    "SHAPES_RESOLVED", "SKIP_KEY", "VALUE_SHAPES_KEY", "VALUE_TYPES_KEY", "WEIGHTS_FOLDED", "State", "ensure", "node_label",
    "require", "tuned_convs",
]

SKIP_KEY = "convpass.skip"  # node.meta: why the conv is left untuned
SHAPES_KEY = "convpass.shapes"  # node.meta: per profile, (input shape, weight shape, data type)
PROFILES_KEY = "convpass.profiles"  # model.meta: the shape profiles
VALUE_SHAPES_KEY = "convpass.value_shapes"  # model.meta: per profile, {value name: dims}
VALUE_TYPES_KEY = "convpass.value_types"  # model.meta: {value name: ONNX element type}, as inference gave them
CANONICAL_KEY = "convpass.canonical"  # node.meta: per profile, the conv's canonical cuDNN form
PROBLEMS_KEY = "convpass.problems"  # model.meta: {ConvProblem: [ProblemUse, ...]}
CONV_OPS = ("Conv", "ConvTranspose")


def node_label(node: ir.Node) -> str:
    """A node's name, or its first output's name when it has none."""
    return node.name or (node.outputs[0].name if node.outputs and node.outputs[0].name else f"<{node.op_type}>")


def tuned_convs(model: ir.Model) -> Iterator[ir.Node]:
    """The tuned convs of rule 1, in graph order."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type in CONV_OPS and node.domain in ("", "ai.onnx") and SKIP_KEY not in node.meta:
            yield node


def _conv(node: ir.Node) -> str:
    return f"{node.op_type} {node_label(node)!r}"


def _weights_folded(model: ir.Model) -> str | None:
    for node in tuned_convs(model):
        for index, role in ((1, "weight"), (2, "bias")):
            value = node.inputs[index] if index < len(node.inputs) else None
            if value is not None and value.const_value is None:
                return f"{_conv(node)} reads the computed {role} {value.name!r}"
    return None


def _per_profile(model: ir.Model, key: str, what: str) -> str | None:
    """The first tuned conv without one ``key`` entry per profile."""
    profiles = len(model.meta.get(PROFILES_KEY, ()))
    for node in tuned_convs(model):
        if key not in node.meta:
            return f"{_conv(node)} has no {what}"
        if len(node.meta[key]) != profiles:
            return f"{_conv(node)} has {what} for {len(node.meta[key])} of {profiles} profile(s)"
    return None


def _shapes_resolved(model: ir.Model) -> str | None:
    if PROFILES_KEY not in model.meta:
        return "the model has no shape profiles"
    return _per_profile(model, SHAPES_KEY, "shapes")


def _canonical(model: ir.Model) -> str | None:
    return _per_profile(model, CANONICAL_KEY, "canonical form")


def _problems_collected(model: ir.Model) -> str | None:
    problems = model.meta.get(PROBLEMS_KEY)
    if problems is None:
        return "the model has no collected problems"
    used = {(use.node, use.profile) for uses in problems.values() for use in uses}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for profile in range(len(node.meta.get(CANONICAL_KEY, ()))):
            if (node, profile) not in used:
                return f"{_conv(node)} has no problem at profile {profile}"
    return None


def _annotated(model: ir.Model) -> str | None:
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if CANONICAL_KEY in node.meta and node.domain in ("", "ai.onnx"):
            return f"{_conv(node)} is still a standard op"
    return None


@dataclasses.dataclass(frozen=True)
class State:
    """One thing a pass hands on: what it is called, the pass that provides it, and its check
    (the first thing missing, in words, or None)."""

    name: str
    provider: str
    missing: Callable[[ir.Model], str | None]


WEIGHTS_FOLDED = State("folded conv weights", "FoldConvWeightsPass", _weights_folded)
SHAPES_RESOLVED = State("resolved shapes", "ResolveShapesPass", _shapes_resolved)
CANONICAL = State("canonical convs", "CanonicalizeConvsPass", _canonical)
PROBLEMS_COLLECTED = State("collected problems", "CollectConvProblemsPass", _problems_collected)
ANNOTATED = State("annotated convs", "AnnotateConvsPass", _annotated)


def require(pass_: ir.passes.PassBase, model: ir.Model, *states: State) -> None:
    """A pass's precondition (rule 7): ``states`` hold in ``model``."""
    for state in states:
        missing = state.missing(model)
        if missing is not None:
            raise ir.passes.PreconditionError(f"{type(pass_).__name__} requires {state.name}: {missing} "
                                              f"(run {state.provider} before it)")


def ensure(pass_: ir.passes.PassBase, model: ir.Model, state: State) -> None:
    """A pass's postcondition (rule 7): ``state`` holds in ``model`` after it."""
    missing = state.missing(model)
    if missing is not None:
        raise ir.passes.PostconditionError(f"{type(pass_).__name__} ensures {state.name}, but {missing}")

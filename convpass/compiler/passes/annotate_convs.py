"""Write the decisions into the model, in the annotation format of ``convpass.core.annotation``.

Rules:

* Every canonicalized Conv / ConvTranspose moves to domain ``ai.convpass`` (a bias-less one as
  ``ConvNoBias`` / ``ConvTransposeNoBias``: ``annotation.annotated_op_type``) with its original
  attributes unchanged plus the decision attributes: one table of decisions per device (in the
  order of ``ModelInfo.devices``), one decision per shape profile in each; undecided problems are
  recorded as ``auto`` (chosen at run time), never as made-up measurements.
* Convs marked ``convpass.skip`` (dynamic weights, untunable data types) stay standard ops.
* Unnamed conv nodes get a name (``<op>_<n>``) so reports and warnings can point at them.
* Where errors were measured (``--precision``), each conv also gets its error contribution and
  sensitivity (``errors``: node name -> the two numbers; :func:`annotation.precision_attributes`).
* A conv asked to run at ``fp32-strict`` (``strict``: node names) gets that level
  (:func:`annotation.level_attributes`).
* The model gets the ``ai.convpass`` opset import, one model-local function per annotated op type
  (the standard op at the model's opset), an IR version that allows functions (at least 8, never
  above what ONNX Runtime reads), and the convpass metadata (replacing any a previous tuning wrote).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import onnx_ir as ir

from convpass.compiler.passes import state
from convpass.compiler.passes.collect_conv_problems import ConvProblem, node_problems
from convpass.compiler.passes.state import CANONICAL_KEY, VALUE_SHAPES_KEY
from convpass.core import annotation
from convpass.core.algo import Algo
from convpass.core.annotation import ConvDecision, ModelInfo
from convpass.core.problem import memory_format_name
from convpass.tuning.decide import Choice


def _ir_attr(name: str, value: Any) -> ir.Attr:
    if isinstance(value, str):
        return ir.AttrString(name, value)
    if isinstance(value, bool) or isinstance(value, int):
        return ir.AttrInt64(name, int(value))
    if isinstance(value, float):
        return ir.AttrFloat32(name, value)
    values = list(value)
    if all(isinstance(v, str) for v in values):
        return ir.AttrStrings(name, values)
    if all(isinstance(v, int) for v in values):
        return ir.AttrInt64s(name, values)
    return ir.AttrFloat32s(name, [float(v) for v in values])


def decision_for(
    node: ir.Node,
    profile: int,
    choices: Mapping[ConvProblem, Choice | None],
    directions,
    overrides: Mapping[tuple[ir.Node, int], Choice] | None = None,
    fusions: bool = False,
    value_shapes: Sequence[Mapping[str, Sequence[int]]] = (),
    undecided_math: str = annotation.AUTO,
) -> ConvDecision:
    """The ConvDecision of a node at a profile: the layout plan's choice for this node if there is
    one (``overrides``), else the backend's choice for its problem (``fusions``, ``value_shapes``:
    as collected). Undecided, a float32 conv records ``undecided_math``: the math its options
    force (``fma`` under --tf32 off or --precision fp32), so that cuDNN's heuristic runs it under
    that math at run time."""
    canonical = node.meta[CANONICAL_KEY][profile]
    own, *training = node_problems(node, profile, directions, fusions, value_shapes)
    chosen = (overrides or {}).get((node, profile)) or choices.get(own)
    extra = {}
    for problem in training:
        c = choices.get(problem)
        extra[f"{problem.direction}_algo"] = annotation.AUTO if c is None else c.algo
    if chosen is None:
        math = undecided_math if own.primary.dtype == "float32" else annotation.AUTO
        return ConvDecision(problem_key=str(own.primary), math_mode=math, **extra)
    algo = Algo.parse(chosen.algo)
    return ConvDecision(
        algo=(chosen.fallback or annotation.AUTO) if algo.is_engine else str(algo.bare),
        engine=algo.name if algo.is_engine else "",
        fusion=algo.fusion,
        memory_format=memory_format_name(canonical.spatial_rank, chosen.key.layout),
        math_mode=chosen.key.math,
        workspace_bytes=chosen.workspace_bytes,
        time_ms=chosen.time_ms,
        problem_key=str(chosen.key),
        source=chosen.source,
        **extra,
    )


@dataclasses.dataclass(frozen=True)
class DeviceChoices:
    """One device's decisions: the backend's choice per problem, and the layout plan's choice per
    (node, profile) where the plan overrides it."""

    choices: Mapping[ConvProblem, Choice | None]
    overrides: Mapping[tuple[ir.Node, int], Choice] = dataclasses.field(default_factory=dict)


class AnnotateConvsPass(ir.passes.InPlacePass):
    """Records the choices on the conv nodes and makes the model self-describing (module rules).

    Requires the problems ``CollectConvProblemsPass`` collects; ensures no canonical conv is left a
    standard op (:mod:`~convpass.compiler.passes.state`)."""

    def __init__(self, tables: Sequence[DeviceChoices], info: ModelInfo, directions=("fwd",), fusions: bool = False,
                 errors: Mapping[str, tuple[float | None, float | None]] | None = None,
                 undecided_math: str = annotation.AUTO, undecided_math_of: Mapping[str, str] | None = None,
                 strict: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.strict = strict  # the convs (node names) asked to run at fp32-strict
        # the math an undecided float32 conv records: the options' (one math type, or auto), or its own
        self.undecided_math = undecided_math
        self.undecided_math_of = dict(undecided_math_of or {})
        self.errors = dict(errors or {})
        self.fusions = fusions
        if len(tables) != info.tables:
            raise ValueError(f"{len(tables)} decision tables for {info.tables} device table(s) {list(info.devices)}")
        self.tables = tuple(tables)
        self.info = info
        self.directions = tuple(directions)

    def requires(self, model: ir.Model) -> None:
        state.require(self, model, state.PROBLEMS_COLLECTED)

    def ensures(self, model: ir.Model) -> None:
        state.ensure(self, model, state.ANNOTATED)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        used_ops: set[str] = set()
        counters: dict[str, int] = {}
        for node in ir.traversal.RecursiveGraphIterator(model.graph):  # bodies of If / Loop / Scan too
            if CANONICAL_KEY not in node.meta:
                continue
            counters[node.op_type] = counters.get(node.op_type, 0) + 1
            if not node.name:
                node.name = f"{node.op_type}_{counters[node.op_type]}"
            decisions = [
                decision_for(node, p, table.choices, self.directions, table.overrides, self.fusions, model.meta.get(VALUE_SHAPES_KEY, ()),
                             self.undecided_math_of.get(node.name, self.undecided_math))
                for table in self.tables
                for p in range(len(node.meta[CANONICAL_KEY]))
            ]
            measured = {**annotation.precision_attributes(*self.errors.get(node.name, (None, None))),
                        **annotation.level_attributes(node.name in self.strict)}
            for name, value in {**annotation.decision_attributes(decisions), **measured}.items():
                node.attributes[name] = _ir_attr(name, value)
            node.domain = annotation.DOMAIN
            has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
            if not has_bias:
                node.resize_inputs(2)  # an empty bias name ("") too: the X, W function takes two inputs
            node.op_type = annotation.annotated_op_type(annotation.ANNOTATED_OPS.get(node.op_type, node.op_type), has_bias)
            used_ops.add(node.op_type)
        for op_type in sorted(used_ops):
            function = ir.serde.deserialize_function(annotation.conv_function(op_type, opset))
            model.functions[function.identifier()] = function
        if used_ops:
            model.opset_imports[annotation.DOMAIN] = annotation.DOMAIN_VERSION
            model.ir_version = max(model.ir_version, annotation.MIN_IR_VERSION)
        entries = annotation.metadata_entries(self.info)
        for key in [k for k in model.metadata_props if k.startswith(annotation.META_PREFIX) and k not in entries]:
            del model.metadata_props[key]
        for key, value in entries.items():
            model.metadata_props[key] = value
        return ir.passes.PassResult(model, modified=True)

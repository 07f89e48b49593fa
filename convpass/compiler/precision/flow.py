"""``optimize --precision``: choose each conv's precision, prove the model's error end to end, write it.

Steps (on the model ``optimize`` is given, in place):

1. Every node gets a unique name (the plan names nodes across copies of the graph); the constant
   weight computations and the BatchNormalizations after convs are folded; every candidate is
   built from this float32 graph. The reference is the model as given, run in float32.
2. The graph passes run as usual (shapes, canonical convs, problems); the decision backend decides
   every conv problem and its float16 variant, which gives each conv's cost per precision
   (:mod:`convpass.compiler.precision.choose`).
3. ``auto``: the budget loop (:mod:`convpass.compiler.precision.budget`) plans, builds each
   candidate (the float16 region with its Casts, every conv decided under its precision: the
   model as it will be written), runs it with the evaluator on the calibration set and compares
   with the float32 reference. A forced precision is one plan, measured the same way.
4. The chosen plan is written: the float16 region (:mod:`convpass.compiler.passes.reduce_precision`),
   the graph passes again, every conv decided under its precision, and the annotation with each
   conv's error contribution and the model's errors on both sets (``convpass.precision``).

The evaluator is the convpass executor on the GPU where the decisions are measured on this
machine's GPU, else the CPU emulation (:mod:`convpass.compiler.precision.evaluate`), which the
record names.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import onnx
import onnx_ir as ir

from convpass.compiler.passes import manager
from convpass.compiler.passes.reduce_precision import ReducePrecisionPass
from convpass.compiler.passes.resolve_shapes import VALUE_TYPES_KEY
from convpass.compiler.precision import budget
from convpass.compiler.precision.choose import CastCosts, GraphPlanner, conv_costs, levels_for
from convpass.compiler.precision.data import InputSet, load_feeds, model_error, random_feeds, reference_outputs
from convpass.compiler.precision.evaluate import CpuEvaluator, CudaEvaluator, Evaluator
from convpass.core import annotation
from convpass.core.algo import is_transform
from convpass.core.errors import ConvpassError
from convpass.core.options import STRICT, WIDE_PRECISIONS, TuneOptions


def name_nodes(model: ir.Model) -> None:
    """Give every unnamed node, and every node whose name another node has, a unique name."""
    seen: set[str] = set()
    taken = {n.name for n in model.graph if n.name}
    for i, node in enumerate(model.graph):
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        base = node.name or f"{node.op_type}_{i}"
        name, k = base, 1
        while name in taken or name in seen:
            k += 1
            name = f"{base}_{k}"
        node.name = name
        seen.add(name)
        taken.add(name)


@dataclasses.dataclass(frozen=True)
class Steps:
    """The pipeline's steps this flow runs (handed in: the pipeline imports this module, not the reverse).

    ``prepare(model, options, shapes, report) -> uses``, ``decide(model, options, uses, backends,
    report, precision_of, errors)``, ``report() -> a new OptimizeReport``."""

    prepare: Callable[..., Any]
    decide: Callable[..., None]
    report: Callable[[], Any]


class _Candidates:
    """Builds the model a plan writes and measures its error on an input set."""

    def __init__(self, steps: Steps, original: onnx.ModelProto, options: TuneOptions, shapes, backend, evaluator: Evaluator,
                 sets: dict[str, InputSet], metric: str, given: onnx.ModelProto) -> None:
        """``original``: the float32 graph every candidate is built from; ``given``: the model as the
        user gave it, whose float32 outputs are the reference."""
        self.steps = steps
        self.original, self.options, self.shapes, self.backend = original, options, shapes, backend
        self.evaluator, self.sets, self.metric = evaluator, sets, metric
        self.reference = {name: reference_outputs(given, s) for name, s in sets.items()}
        self._last: tuple[Any, onnx.ModelProto] | None = None

    def build(self, plan: budget.Assignment) -> onnx.ModelProto:
        if self._last is None or self._last[0] != plan.key:
            model = ir.serde.deserialize_model(self.original)
            write_plan(self.steps, model, plan, self.options, self.shapes, self.backend, self.steps.report())
            self._last = (plan.key, ir.serde.serialize_model(model))
        return self._last[1]

    def error(self, plan: budget.Assignment, inputs: str) -> float:
        tf32 = [c for c, p in plan.precisions.items() if p == "tf32"]
        outputs = self.evaluator.outputs(self.build(plan), tf32, self.sets[inputs])
        return model_error(outputs, self.reference[inputs], self.metric)


def write_plan(steps: Steps, model: ir.Model, plan: budget.Assignment, options: TuneOptions, shapes, backend, report,
               errors: dict[str, tuple[float | None, float | None]] | None = None) -> None:
    """The plan into ``model`` (the original graph): the float16 region, the graph passes, every conv
    decided under its precision, the annotation (step 4 of the module docstring)."""
    ReducePrecisionPass(plan.reduced)(model)
    uses = steps.prepare(model, options, shapes, report)
    precision_of = {c: p for c, p in plan.precisions.items() if p in WIDE_PRECISIONS}
    steps.decide(model, options, uses, [backend] if uses and backend is not None else [], report, precision_of, errors)


def optimize_precision(steps: Steps, model: ir.Model, options: TuneOptions, shapes: Sequence[str | dict], make_backend, report,
                       calibration: Sequence[str | os.PathLike] = (), holdout: Sequence[str | os.PathLike] = (),
                       evaluator: Evaluator | None = None) -> None:
    """The whole of the module docstring on ``model``; fills ``report`` as ``optimize_model`` does,
    plus ``report.precision``."""
    name_nodes(model)
    given = ir.serde.serialize_model(model)
    manager.run(manager.folding(), model)  # in float32, as the written model has them: every candidate starts from here
    original = ir.serde.serialize_model(model)
    scratch = steps.report()
    uses = steps.prepare(model, options, shapes, scratch)
    if not uses:
        raise ConvpassError(f"--precision {options.precision}: the model has no convolution convpass can tune")
    sets = {"calibration": _input_set(original, calibration, scratch, "calibration"),  # read before any tuning
            "holdout": _input_set(original, holdout, scratch, "holdout")}
    backend = make_backend()
    levels = levels_for(options)
    has_rows = backend is not None and getattr(backend, "rows", None) is not None
    if options.precision == "auto" and not (backend is not None and backend.device is not None and has_rows):
        raise ConvpassError("--precision auto chooses by measured speed: it needs a GPU, or --device-name with a tuning cache "
                            "of that GPU type holding the model's timings")
    costs = conv_costs(backend, uses, options, levels) if has_rows else {n: {} for n in _conv_nodes(uses)}
    tuned = copy.copy(getattr(backend, "summary", None))
    casts = CastCosts(model, backend)
    planner = GraphPlanner(model.graph, costs, casts, levels, model.meta.get(VALUE_TYPES_KEY, {}))
    evaluator = evaluator or _default_evaluator(backend)
    candidates = _Candidates(steps, original, options, shapes, backend, evaluator, sets, options.error_metric, given)
    if options.precision == "auto":
        result = budget.fit_budget(planner, candidates.error, options.max_error)
    else:
        result = budget.measure_plan(planner, candidates.error, planner.forced(options.precision), options.max_error)
    report.precision = _record(result, options, sets, evaluator)
    predicted = planner.predicted() if options.precision == "auto" else None
    if predicted is not None:
        report.precision["predicted_ms"] = {"plan": result.assignment.cost_ms, **predicted}
    report.notes.extend(_notes(result, sets, planner, casts, evaluator, predicted))
    errors = {c: (result.contribution(c), result.sensitivity.get(c, {}).get(budget.REDUCED)) for c in result.assignment.precisions}
    if tuned is not None:  # the tuner's counts of the problems this run decided, not of every candidate's look-ups
        backend.summary = tuned
    write_plan(steps, model, result.assignment, options, shapes, backend, report, errors)
    report.notes.extend(strict_notes(model, result.assignment, len(report.profiles)))


def strict_notes(model: ir.Model, plan: budget.Assignment, profiles: int) -> list[str]:
    """What the written model cannot honour of ``fp32-strict``: convs put there whose decisions run a
    transform algorithm (none without one was measured: the fastest fp32 configuration runs), or
    leave the algorithm to cuDNN's heuristic at run time."""
    strict = {c for c, p in plan.precisions.items() if p == STRICT}
    transform, undecided = [], []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.name not in strict or node.domain != annotation.DOMAIN:
            continue
        decisions = annotation.read_node(ir.serde.serialize_node(node), max(1, profiles)).tables
        flat = [d for table in decisions for d in table]
        if any(is_transform(a) for d in flat for a in (d.algo, d.dgrad_algo, d.wgrad_algo)):
            transform.append(node.name)
        elif not all(d.honours_strict for d in flat):
            undecided.append(node.name)
    notes = []
    if transform:
        notes.append(f"{len(transform)} conv(s) at {STRICT} have no measured configuration without a Winograd or FFT "
                     f"algorithm and run their fastest fp32 one: {_shown(transform)}")
    if undecided:
        notes.append(f"{len(undecided)} conv(s) at {STRICT} have no decided algorithm: cuDNN's heuristic chooses at run time "
                     f"and may choose a Winograd or FFT algorithm: {_shown(undecided)}")
    return notes


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _conv_nodes(uses) -> list[ir.Node]:
    return list(dict.fromkeys(use.node for problem_uses in uses.values() for use in problem_uses))


def _input_set(original: onnx.ModelProto, paths, report, name: str) -> InputSet:
    if paths:
        return load_feeds(list(paths), original, name)
    return random_feeds(original, report.profiles, name)


def _default_evaluator(backend: Any) -> Evaluator:
    """The GPU executor where decisions are measured on this machine's GPU, else the CPU emulation."""
    if getattr(backend, "measures", False) and getattr(backend, "device", None) is not None:
        return CudaEvaluator()
    return CpuEvaluator()


def _record(result: budget.BudgetResult, options: TuneOptions, sets, evaluator) -> dict[str, Any]:
    """The ``convpass.precision`` metadata (:mod:`convpass.core.annotation`)."""
    counts: dict[str, int] = {}
    for p in result.assignment.precisions.values():
        counts[p] = counts.get(p, 0) + 1
    return {
        "mode": options.precision,
        "metric": options.error_metric,
        "max_error": options.max_error,
        "reduced": "float16",
        "evaluator": evaluator.description,
        "calibration": {"error": result.calibration_error, "inputs": sets["calibration"].source},
        "holdout": {"error": result.holdout_error, "inputs": sets["holdout"].source},
        "within_budget": result.within_budget,
        "convs": counts,
        "casts": result.assignment.casts,
        "evaluations": result.evaluations,
        "rounds": result.rounds,
        "note": result.message,
    }


def _notes(result: budget.BudgetResult, sets, planner: GraphPlanner, casts: CastCosts, evaluator,
           predicted: dict[str, float | None] | None = None) -> list[str]:
    notes = []
    if result.message:
        notes.append(result.message)
    half, wide = (predicted or {}).get("float16"), (predicted or {}).get("wide")
    if half is not None and wide is not None and not result.assignment.reduced and result.rounds == 0:
        notes.append(f"no conv runs in float16: by the measured timings the float16 region costs {half:.4f} ms "
                     f"(conv steps and casts) against {wide:.4f} ms without it")
    if any(s.random for s in sets.values()):
        notes.append("the errors were measured on random-normal inputs: real inputs (--calibration, --holdout .npz files) "
                     "measure what the model will see")
    if not result.holdout_within:
        notes.append(f"the held-out error {result.holdout_error:.3g} is over the budget {result.max_error:.3g} "
                     f"(calibration: {result.calibration_error:.3g}): the calibration inputs do not represent the held-out ones")
    if isinstance(evaluator, CpuEvaluator):
        notes.append("errors measured by the CPU emulation of the GPU's precision (no GPU here): rerun optimize on the GPU to "
                     "measure the tuned model itself")
    unmeasured = [c for c in planner.convs if budget.REDUCED in planner.levels and budget.REDUCED not in planner.costs[c]]
    if unmeasured and planner.levels[0] != planner.levels[-1]:
        shown = ", ".join(unmeasured[:3]) + (", ..." if len(unmeasured) > 3 else "")
        notes.append(f"{len(unmeasured)} conv(s) have no float16 measurement and were planned in float32 only: {shown}")
    if planner.unplanned:
        shown = ", ".join(planner.unplanned[:3]) + (", ..." if len(planner.unplanned) > 3 else "")
        notes.append(f"{len(planner.unplanned)} conv(s) have no measurement at every precision and keep their type and math: {shown}")
    if casts.nominal:
        notes.append(f"{len(casts.nominal)} tensor(s) have no measured copy time: their casts are priced at a nominal bandwidth")
    return notes

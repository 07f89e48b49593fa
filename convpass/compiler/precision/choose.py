"""The precision plan of a prepared model: per-precision conv costs from the decision backend,
cast costs, the min-cut planner the budget loop drives, and the errors measured end to end.

Costs:

* A conv's cost at a precision is the time of its best configuration there (what the backend's
  selection rule picks: :func:`convpass.tuning.decide.select`), with its epilogue, summed over the
  shape profiles: ``fp32-strict``, ``fp32`` and ``tf32`` from its float32 problem under FMA math
  without and with transform algorithms and under default math, ``fp16`` from the same problem with
  data type float16 (another problem key, measured by the tuner or read from the tuning cache like
  any other). A precision without a measurement in some profile is not available to that conv; a
  conv with no measured configuration but transform ones costs at ``fp32-strict`` what it costs at
  ``fp32`` (the selection rule's), and the written model says so.
* A Cast reads 4 bytes and writes 2 per element; a float32 transpose reads and writes 4. Where the
  backend has the tensor's float32 transpose time (measured by the tuner, or in the tuning cache),
  the cast costs 3/4 of it; elsewhere (a cache without it, tensors of rank below 3) its bytes at
  :data:`NOMINAL_GBPS` plus :data:`NOMINAL_LAUNCH_MS`, and a note says so.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import onnx_ir as ir

from convpass.compiler.passes.plan_precision import plan_precision
from convpass.compiler.passes.resolve_shapes import VALUE_SHAPES_KEY
from convpass.compiler.precision.budget import LEVELS, REDUCED, Assignment
from convpass.core.options import STRICT, TuneOptions
from convpass.core.problem import ConvProblem
from convpass.tuning.decide import choice_from, select

NOMINAL_GBPS = 2000.0  # a copy kernel's bandwidth on a current data-center GPU, where nothing was measured
NOMINAL_LAUNCH_MS = 0.002
CAST_PER_TRANSPOSE = 0.75  # 6 bytes moved per element against 8
_HALF_BYTES = {"fp16": 2}


def half_problem(problem: ConvProblem) -> ConvProblem:
    """The same convolution with float16 data (float32 accumulation)."""
    return dataclasses.replace(problem, candidates=tuple(dataclasses.replace(s, dtype="float16") for s in problem.candidates))


def own_problems(uses: Mapping[ConvProblem, Sequence[Any]]) -> dict[ir.Node, list[ConvProblem | None]]:
    """Per conv node, its own-direction float32 problem at each profile (None where it has none)."""
    out: dict[ir.Node, dict[int, ConvProblem]] = {}
    for problem, problem_uses in uses.items():
        if problem.direction == "wgrad" or problem.primary.dtype != "float32":
            continue
        for use in problem_uses:
            if (use.node.op_type == "ConvTranspose") == (problem.direction == "dgrad"):
                out.setdefault(use.node, {}).setdefault(use.profile, problem)
    profiles = 1 + max((p for per in out.values() for p in per), default=0)
    return {node: [per.get(i) for i in range(profiles)] for node, per in out.items()}


def conv_costs(backend: Any, uses: Mapping[ConvProblem, Sequence[Any]], options: TuneOptions, levels: Sequence[str]) -> dict[ir.Node, dict[str, float]]:
    """Per conv node, the time of each precision in ``levels`` it has a measurement for (module docstring).
    Asks the backend to decide the float16 variants (the tuner measures them; the cache backend reads them)."""
    per_node = own_problems(uses)
    wanted = {p for problems in per_node.values() for p in problems if p is not None}
    if REDUCED in levels:
        halves = [half_problem(p) for p in wanted]
        backend.decide(list(wanted) + halves, options)
    else:
        backend.decide(list(wanted), options)
    rows = backend.rows
    plain = dataclasses.replace(options, precision=None, max_error=None)
    rules = {STRICT: dataclasses.replace(plain, tf32="off", precision=STRICT), "fp32": dataclasses.replace(plain, tf32="off"),
             "tf32": dataclasses.replace(plain, tf32="on"), REDUCED: plain}
    picks: dict[tuple, float | None] = {}

    def time_of(problem: ConvProblem, level: str) -> float | None:
        target = half_problem(problem) if level == REDUCED else problem
        if (target, level) not in picks:
            found = rows.get(target, [])
            pick = select(found, target, rules[level])
            picks[(target, level)] = None if pick is None else choice_from(pick, "", found, target).time_ms
        return picks[(target, level)]

    out = {}
    for node, problems in per_node.items():
        costs = {}
        for level in levels:
            times = [None if p is None else time_of(p, level) for p in problems]
            if times and all(t is not None for t in times):
                costs[level] = float(sum(times))
        out[node] = costs
    return out


class CastCosts:
    """Per value, the summed cost over profiles of casting it (module docstring)."""

    def __init__(self, model: ir.Model, backend: Any) -> None:
        self.shapes = model.meta.get(VALUE_SHAPES_KEY, [])
        self.transpose_ms = getattr(backend, "transpose_ms", None)
        self.nominal: set[str] = set()
        self.cache: dict[str, float] = {}

    def __call__(self, value: ir.Value) -> float:
        if value.name not in self.cache:
            self.cache[value.name] = sum(self._one(tuple(p[value.name]), value.name) for p in self.shapes if value.name in p)
        return self.cache[value.name]

    def _one(self, dims: tuple, name: str) -> float:
        if not dims or not all(isinstance(d, int) for d in dims):
            return NOMINAL_LAUNCH_MS
        measured = self.transpose_ms(dims, "float32") if self.transpose_ms is not None and 3 <= len(dims) <= 5 else None
        if measured is not None:
            return CAST_PER_TRANSPOSE * measured
        self.nominal.add(name)
        return NOMINAL_LAUNCH_MS + math.prod(dims) * (4 + _HALF_BYTES[REDUCED]) / (NOMINAL_GBPS * 1e6)


class GraphPlanner:
    """The budget loop's planner over a prepared model (:class:`convpass.compiler.precision.budget.Planner`):
    floors become allowed precisions, the min cut places the reduced region. ``costs`` holds every
    conv with a problem (an empty dict where nothing was measured); the loop plans those that can
    run at the top level, the others keep the data type and math the options give them."""

    def __init__(self, graph: ir.Graph, costs: Mapping[ir.Node, Mapping[str, float]], cast_ms: Callable[[ir.Value], float],
                 levels: Sequence[str], types: Mapping[str, int] | None = None) -> None:
        self.graph = graph
        self.levels = tuple(levels)
        self.all_nodes = {n.name: n for n in graph if n in costs}
        self.costs = {name: dict(costs[node]) for name, node in self.all_nodes.items()}
        self.convs = tuple(name for name, c in self.costs.items() if self.levels[-1] in c)
        self.cast_ms = cast_ms
        self.types = types or {}

    @property
    def unplanned(self) -> list[str]:
        return [name for name in self.all_nodes if name not in self.convs]

    def plan(self, floors: Mapping[str, str]) -> Assignment:
        allowed = {}
        for name in self.convs:
            lowest = self.levels.index(floors.get(name, self.levels[0]))
            allowed[self.all_nodes[name]] = {p: t for p, t in self.costs[name].items() if p in self.levels[lowest:]}
        return self._cut(allowed)

    def alone(self, conv: str, precision: str) -> Assignment:
        precisions = {c: self.levels[-1] for c in self.all_nodes}
        precisions[conv] = precision
        return Assignment(precisions, frozenset({conv}) if precision == REDUCED else frozenset())

    def forced(self, precision: str) -> Assignment:
        """Every conv at ``precision`` (a forced ``--precision``; measured or not), the float16 region
        placed by the min cut. A conv that cannot compute in float16 (a constant outside its range)
        stays at the top level."""
        if precision != REDUCED:
            return Assignment({c: precision for c in self.all_nodes})
        plan = self._cut({node: {REDUCED: self.costs[name].get(REDUCED, 0.0)} for name, node in self.all_nodes.items()})
        return dataclasses.replace(plan, precisions={c: (p if c in plan.reduced else self.levels[-1]) for c, p in plan.precisions.items()})

    def predicted(self) -> dict[str, float | None]:
        """The cost by the measured timings (conv steps and casts, ms) of the two plans the loop's
        first one lies between: ``wide``, no float16 region (every conv at its cheapest wide level);
        ``float16``, every conv with a float16 timing in the region, the others at their cheapest
        wide level. None where such a plan cannot be formed (a conv the region cannot hold)."""
        wide = {self.all_nodes[n]: {p: t for p, t in self.costs[n].items() if p != REDUCED} for n in self.convs}
        half = {node: ({REDUCED: self.costs[n][REDUCED]} if REDUCED in self.costs[n] else wide[node])
                for n, node in self.all_nodes.items() if n in self.convs}
        return {"wide": _finite(self._cut(wide).cost_ms), "float16": _finite(self._cut(half).cost_ms)}

    def _cut(self, allowed: Mapping[ir.Node, Mapping[str, float]]) -> Assignment:
        plan = plan_precision(self.graph, allowed, REDUCED, self.cast_ms, self.types)
        return Assignment({n.name: p for n, p in plan.precisions.items()}, frozenset(n.name for n in plan.reduced), plan.cost_ms, plan.casts)


def _finite(ms: float | None) -> float | None:
    return ms if ms is not None and math.isfinite(ms) else None


def levels_for(options: TuneOptions) -> tuple[str, ...]:
    """The precisions the plan chooses among, least accurate first: for ``auto``, :data:`LEVELS` less
    what ``--tf32`` excludes (``fp32-strict`` the top unless ``--tf32 on``); for a forced precision,
    it and the most accurate one the options allow (the level every other conv is at while one
    conv's contribution is measured: ``fp32`` for a forced ``fp16``, as before ``fp32-strict``)."""
    wide = options.wide_precisions
    if options.precision == "auto":
        return tuple(p for p in LEVELS if p == REDUCED or p in wide)
    return tuple(dict.fromkeys((options.precision, wide[-1])))

"""The budget loop: the fastest precision plan whose measured end-to-end error is within E.

Levels, least accurate first: the reduced type (fp16), tf32, fp32 (FMA math, any algorithm),
fp32-strict (FMA math, no Winograd or FFT algorithm: :data:`convpass.core.options.STRICT`); those
the options allow, the last being the "top". Each conv has a floor, the lowest level it may take; the planner returns the
fastest plan with every conv at or above its floor (the min cut of
:mod:`convpass.compiler.passes.plan_precision`).

1. Every floor at the lowest level: the fastest plan. Its error on the calibration set is measured
   end to end (the whole model, every output, against the float32 reference).
2. While the error exceeds E, move convs up one level from where the plan has them: the most
   sensitive first. A conv's sensitivity at a level is measured by perturbation: the model's error
   with that conv alone at that level and every other conv at the top (measured once, when first
   needed). How many convs move at once is estimated from the sensitivities: rounding errors of
   different layers are independent and add in quadrature (``sqrt(sum s_i^2)``), and that sum,
   scaled by the measured error of the plan over its own estimate, says how many of the largest
   terms must go for the plan to fit. At least one conv moves each round, so the loop ends after
   at most (levels - 1) x convs rounds. Every plan it returns was measured end to end.
3. If even every conv at the top level exceeds E, that plan is returned as over budget, with a
   message: the budget is below what the top precision gives on these inputs.
4. The plan's error on the held-out set is measured and recorded beside the calibration error;
   it may exceed E (the sets differ), which the result says.
5. Each conv of the final plan below the top gets its contribution recorded: its sensitivity at
   the level it runs in (measured now where the loop did not need it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from convpass.core.options import WIDE_PRECISIONS

REDUCED = "fp16"
LEVELS = (REDUCED, *WIDE_PRECISIONS)  # least accurate first: fp16, tf32, fp32, fp32-strict


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A precision per conv (by node name) and the nodes computing in the reduced type."""

    precisions: Mapping[str, str]
    reduced: frozenset[str] = frozenset()
    cost_ms: float | None = None
    casts: int = 0

    @property
    def key(self) -> tuple:
        return tuple(sorted(self.precisions.items())), tuple(sorted(self.reduced))


class Planner(Protocol):
    levels: tuple[str, ...]  # least accurate first
    convs: tuple[str, ...]  # in graph order

    def plan(self, floors: Mapping[str, str]) -> Assignment:
        """The fastest plan with every conv at or above its floor."""
        ...

    def alone(self, conv: str, precision: str) -> Assignment:
        """``conv`` at ``precision``, every other conv at the top level."""
        ...


# error of an assignment on an input set ("calibration" | "holdout")
ErrorOf = Callable[[Assignment, str], float]


@dataclasses.dataclass
class BudgetResult:
    assignment: Assignment
    calibration_error: float
    holdout_error: float
    max_error: float
    within_budget: bool  # the calibration error is within E
    sensitivity: dict[str, dict[str, float]]  # conv -> level -> the model's error with it alone there
    evaluations: int
    rounds: int
    message: str = ""

    @property
    def holdout_within(self) -> bool:
        return self.holdout_error <= self.max_error

    def contribution(self, conv: str) -> float | None:
        """The conv's error contribution at the precision it runs in (None: not measured / top)."""
        return self.sensitivity.get(conv, {}).get(self.assignment.precisions.get(conv, ""))


class _Errors:
    """The measured errors, each assignment and set measured once."""

    def __init__(self, error_of: ErrorOf) -> None:
        self.error_of = error_of
        self.known: dict[tuple, float] = {}

    def __call__(self, assignment: Assignment, inputs: str = "calibration") -> float:
        key = (assignment.key, inputs)
        if key not in self.known:
            value = float(self.error_of(assignment, inputs))
            self.known[key] = value if not math.isnan(value) else math.inf
        return self.known[key]


def fit_budget(planner: Planner, error_of: ErrorOf, max_error: float) -> BudgetResult:
    """The loop of the module docstring."""
    levels, top = planner.levels, planner.levels[-1]
    errors = _Errors(error_of)
    sensitivity: dict[str, dict[str, float]] = {}

    def sens(conv: str, level: str) -> float:
        if level == top:
            return 0.0
        per = sensitivity.setdefault(conv, {})
        if level not in per:
            per[level] = errors(planner.alone(conv, level))
        return per[level]

    floors = {c: levels[0] for c in planner.convs}
    plan = planner.plan(floors)
    error = errors(plan)
    rounds = 0
    while error > max_error:
        below = [c for c in planner.convs if plan.precisions[c] != top]
        if not below:
            break
        order = {c: i for i, c in enumerate(planner.convs)}
        ranked = sorted(below, key=lambda c: (-sens(c, plan.precisions[c]), order[c]))
        for conv in ranked[:_how_many(error, [sens(c, plan.precisions[c]) for c in ranked], max_error)]:
            floors[conv] = levels[levels.index(plan.precisions[conv]) + 1]
        plan = planner.plan(floors)
        error = errors(plan)
        rounds += 1
    within = error <= max_error
    for conv in planner.convs:
        sens(conv, plan.precisions[conv])  # the record: every conv's contribution (step 5)
    holdout = errors(plan, "holdout")
    message = "" if within else (
        f"even with every conv in {top} the model's error is {error:.3g}, over the budget {max_error:.3g}: these inputs "
        f"cannot be computed that closely to the float32 reference here; the model is written in {top}")
    return BudgetResult(plan, error, holdout, max_error, within, sensitivity, len(errors.known), rounds, message)


def _how_many(error: float, ranked_sens: Sequence[float], max_error: float) -> int:
    """How many of the most sensitive convs to move up this round (module docstring, step 2)."""
    if not all(math.isfinite(s) for s in ranked_sens[:1]) or not math.isfinite(error):
        return max(1, sum(1 for s in ranked_sens if not math.isfinite(s)))
    total = sum(s * s for s in ranked_sens)
    if total <= 0:
        return 1
    scale = error / math.sqrt(total)  # the measured error over its quadrature estimate
    remaining, k = total, 0
    while k < len(ranked_sens) and scale * math.sqrt(max(remaining, 0.0)) > max_error:
        remaining -= ranked_sens[k] ** 2
        k += 1
    return max(1, k)


def measure_plan(planner: Planner, error_of: ErrorOf, plan: Assignment, max_error: float | None) -> BudgetResult:
    """A given (forced) plan's errors on both sets and each conv's contribution, without the loop."""
    errors = _Errors(error_of)
    top = planner.levels[-1]
    sensitivity = {c: {p: errors(planner.alone(c, p))} for c, p in plan.precisions.items() if p != top}
    calibration = errors(plan)
    budget = math.inf if max_error is None else max_error
    within = calibration <= budget
    message = "" if within else f"the forced precision's error {calibration:.3g} is over the budget {budget:.3g}"
    return BudgetResult(plan, calibration, errors(plan, "holdout"), budget, within, sensitivity, len(errors.known), 0, message)

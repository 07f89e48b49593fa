"""The budget loop against a fake planner and fake errors with known per-layer contributions: it
converges, never returns a plan over budget, and says so when even the top level (FP32-strict) is."""

from __future__ import annotations

import math
import random

import pytest

from convpass.compiler.precision.budget import LEVELS, Assignment, fit_budget, measure_plan

TOP = LEVELS[-1]


class FakePlanner:
    """Independent convs: each takes the cheapest level at or above its floor (fp16 < tf32 < fp32 <
    fp32-strict in time)."""

    levels = LEVELS

    def __init__(self, n: int, times=None) -> None:
        self.convs = tuple(f"c{i}" for i in range(n))
        self.times = times or {c: {"fp16": 1.0, "tf32": 2.0, "fp32": 5.0, "fp32-strict": 6.0} for c in self.convs}
        self.plans = 0

    def plan(self, floors):
        self.plans += 1
        precisions = {}
        for c in self.convs:
            allowed = self.levels[self.levels.index(floors[c]):]
            precisions[c] = min(allowed, key=lambda p: (self.times[c][p], -self.levels.index(p)))
        return Assignment(precisions, frozenset(c for c, p in precisions.items() if p == "fp16"),
                          sum(self.times[c][p] for c, p in precisions.items()))

    def alone(self, conv, precision):
        precisions = {c: self.levels[-1] for c in self.convs}
        precisions[conv] = precision
        return Assignment(precisions, frozenset({conv}) if precision == "fp16" else frozenset())


class FakeErrors:
    """A model whose layer errors add in quadrature (``combine="l2"``) or linearly (``"sum"``), plus a floor."""

    def __init__(self, per_layer, combine="l2", floor=0.0, holdout_scale=1.0) -> None:
        self.per_layer, self.combine, self.floor, self.holdout_scale = per_layer, combine, floor, holdout_scale
        self.calls = 0

    def __call__(self, plan: Assignment, inputs: str) -> float:
        self.calls += 1
        terms = [self.per_layer[c][p] for c, p in plan.precisions.items() if p != TOP]
        value = math.sqrt(sum(t * t for t in terms)) if self.combine == "l2" else sum(terms)
        return (value + self.floor) * (self.holdout_scale if inputs == "holdout" else 1.0)


def _layers(n, seed, scale=1e-3):
    rng = random.Random(seed)
    return {f"c{i}": {"fp16": rng.uniform(0.1, 1.0) * scale * (10 if i % 7 == 0 else 1),
                      "tf32": rng.uniform(0.01, 0.1) * scale, "fp32": rng.uniform(0.001, 0.01) * scale} for i in range(n)}


def test_the_fastest_plan_is_kept_when_within_budget():
    planner, errors = FakePlanner(5), FakeErrors(_layers(5, 0))
    result = fit_budget(planner, errors, max_error=1.0)
    assert set(result.assignment.precisions.values()) == {"fp16"} and result.within_budget and result.rounds == 0
    # one plan, the holdout, each conv's contribution at fp16
    assert result.evaluations == 1 + 1 + 5
    assert result.contribution("c0") == pytest.approx(errors.per_layer["c0"]["fp16"])


@pytest.mark.parametrize("combine", ["l2", "sum"])
@pytest.mark.parametrize("budget", [3e-3, 1e-3, 3e-4, 1e-4, 3e-5])
def test_the_loop_converges_within_budget_and_moves_the_most_sensitive_first(combine, budget):
    for seed in range(20):
        planner, errors = FakePlanner(12), FakeErrors(_layers(12, seed), combine)
        result = fit_budget(planner, errors, budget)
        assert result.within_budget and result.calibration_error <= budget, seed
        assert result.calibration_error == errors(result.assignment, "calibration")  # measured, not estimated
        # what stayed in fp16 is never more sensitive than what moved up
        kept = [errors.per_layer[c]["fp16"] for c, p in result.assignment.precisions.items() if p == "fp16"]
        moved = [errors.per_layer[c]["fp16"] for c, p in result.assignment.precisions.items() if p != "fp16"]
        assert not kept or not moved or max(kept) <= min(moved), seed
        assert result.rounds <= 2 * len(planner.convs)


def test_the_loop_does_not_move_every_conv_when_a_few_suffice():
    layers = {f"c{i}": {"fp16": 1e-5, "tf32": 1e-6, "fp32": 1e-7} for i in range(10)}
    layers["c3"]["fp16"] = 5e-3  # one bad layer
    planner, errors = FakePlanner(10), FakeErrors(layers)
    result = fit_budget(planner, errors, 1e-3)
    assert result.assignment.precisions["c3"] == "tf32"
    assert sum(p == "fp16" for p in result.assignment.precisions.values()) == 9 and result.rounds == 1


def test_over_budget_even_at_the_top_returns_the_top_plan_with_a_message():
    planner, errors = FakePlanner(4), FakeErrors(_layers(4, 1), floor=1e-3)
    result = fit_budget(planner, errors, 1e-4)
    assert not result.within_budget and set(result.assignment.precisions.values()) == {"fp32-strict"}
    assert "over the budget" in result.message and "every conv in fp32-strict" in result.message
    assert result.calibration_error == pytest.approx(1e-3)


def test_non_finite_errors_move_the_overflowing_layers_first():
    layers = _layers(6, 2)
    layers["c4"]["fp16"] = math.inf  # float16 overflow
    planner, errors = FakePlanner(6), FakeErrors(layers)
    result = fit_budget(planner, errors, 1e-2)
    assert result.within_budget and result.assignment.precisions["c4"] != "fp16"
    assert result.assignment.precisions["c0"] == "fp16"


def test_the_held_out_error_is_measured_and_reported_not_hidden():
    planner, errors = FakePlanner(4), FakeErrors(_layers(4, 3), holdout_scale=50.0)
    result = fit_budget(planner, errors, 2e-3)
    assert result.within_budget and result.holdout_error == pytest.approx(50 * result.calibration_error)
    assert not result.holdout_within


def test_a_loop_whose_estimate_is_wrong_still_never_returns_over_budget():
    """Errors that interact (a product term) break the quadrature estimate; only measurements decide."""
    layers = _layers(8, 4, scale=1e-2)

    def interacting(plan, inputs):
        reduced = [layers[c]["fp16"] for c, p in plan.precisions.items() if p == "fp16"]
        return sum(reduced) * (1 + len(reduced)) + sum(layers[c]["tf32"] for c, p in plan.precisions.items() if p == "tf32")

    result = fit_budget(FakePlanner(8), interacting, 1e-2)
    assert result.within_budget and result.calibration_error <= 1e-2


def test_without_tf32_the_levels_are_fp16_and_fp32():
    planner = FakePlanner(3)
    planner.levels = ("fp16", "fp32")
    layers = {c: {"fp16": 1e-2} for c in planner.convs}

    def errors(plan, inputs):
        assert "tf32" not in plan.precisions.values()
        return sum(layers[c][p] for c, p in plan.precisions.items() if p == "fp16")

    result = fit_budget(planner, errors, 2.5e-2)
    assert sorted(result.assignment.precisions.values()) == ["fp16", "fp16", "fp32"]


def test_a_forced_plan_is_measured_with_each_conv_alone():
    planner, errors = FakePlanner(3), FakeErrors(_layers(3, 5))
    plan = planner.plan({c: "fp16" for c in planner.convs})
    result = measure_plan(planner, errors, plan, 1e-9)
    assert not result.within_budget and "over the budget" in result.message
    assert result.contribution("c1") == pytest.approx(errors.per_layer["c1"]["fp16"])
    assert result.evaluations == 3 + 2


def test_the_strict_level_is_the_top_and_the_loop_reaches_it_for_a_budget_only_it_meets():
    """A model that amplifies the rounding of transform algorithms: every conv in fp32 is over the
    budget, every conv in fp32-strict within it. The loop moves convs to the strict level until the
    plan fits, and the plan it returns was measured within the budget."""
    assert LEVELS == ("fp16", "tf32", "fp32", "fp32-strict")
    layers = {f"c{i}": {"fp16": 1e-2, "tf32": 5e-3, "fp32": 1.5e-3 * (i + 1)} for i in range(6)}
    for combine in ("l2", "sum"):
        planner, errors = FakePlanner(6), FakeErrors(layers, combine)
        assert errors(Assignment({c: "fp32" for c in planner.convs}), "calibration") > 1e-3  # fp32 everywhere: over
        result = fit_budget(planner, errors, 1e-3)
        assert result.within_budget and result.calibration_error <= 1e-3
        strict = {c for c, p in result.assignment.precisions.items() if p == "fp32-strict"}
        assert strict and "c5" in strict  # the most amplified conv runs without transforms
        assert result.calibration_error == errors(result.assignment, "calibration")
        # the sensitivities at fp32 were measured with every other conv at the top: fp32-strict
        assert result.sensitivity["c0"]["fp32"] == pytest.approx(1.5e-3)


def test_a_budget_only_the_strict_level_meets_is_never_returned_over_budget():
    for seed in range(20):
        rng = random.Random(seed)
        layers = {f"c{i}": {"fp16": rng.uniform(1e-3, 1e-2), "tf32": rng.uniform(1e-4, 1e-3), "fp32": rng.uniform(1e-5, 5e-4)}
                  for i in range(10)}
        for budget in (1e-4, 3e-5, 1e-5):
            result = fit_budget(FakePlanner(10), FakeErrors(layers), budget)
            assert result.within_budget and result.calibration_error <= budget, (seed, budget)

"""The in-place check of tuned convs, on stand-ins for the executor and the GPU's clock.

The stand-in clock charges every launch timed between two events a constant ``overhead`` (what an
event pair costs on a GPU), the plan's conv launches and the clock's empty launches alike."""

from __future__ import annotations

import types

import pytest

from convpass.kernels.plan import ConvSummary
from convpass.runtime.in_place import FLOOR_LAUNCHES, RUNS, SLOW_RATIO, check_in_place


class _Event:
    def __init__(self, t: float) -> None:
        self.t = t


class _Clock:
    """Events carry their time; the hold holds (``holds``) or not; an empty launch takes the
    per-launch ``overhead`` (in turn from ``empties`` where given); ``log`` is the order of calls."""

    note = ""

    def __init__(self, holds: bool = True, overhead: float = 0.0, empties: list[float] | None = None) -> None:
        self.holds, self.overhead, self.empties = holds, overhead, list(empties or ())
        self.log: list[str] = []

    def sync(self) -> None:
        self.log.append("sync")

    def elapsed_ms(self, a: _Event, b: _Event) -> float:
        return b.t - a.t

    def hold(self, seconds: float):
        self.log.append("hold")
        if not self.holds:
            return None
        return lambda: self.log.append("check") or True

    def empty(self):
        self.log.append("empty")
        return _Event(0.0), _Event(self.empties.pop(0) if self.empties else self.overhead)


class _Executor:
    """Runs 'launches' of fixed GPU times, each timed with the clock's per-launch overhead on top;
    records them when step events are on."""

    def __init__(self, launches: dict[str, float], tuned: dict[str, float | None], clock: _Clock | None = None) -> None:
        self.launches, self.tuned, self.clock = launches, tuned, clock
        self.backend = types.SimpleNamespace(step_events=None)

    def run(self, names, feeds):
        events = self.backend.step_events
        if events is not None:
            overhead = self.clock.overhead if self.clock is not None else 0.0
            if self.clock is not None:
                self.clock.log.append("run")
            t = 0.0
            for node, ms in self.launches.items():
                events.append(("Conv", "Conv", _Event(t), _Event(t + ms + overhead), node))
                t += ms + overhead

    def plan_summary(self):
        return [ConvSummary(node, "Conv", True, "implicit_gemm", "NHWC", "default", "measure", 0, ms, "", None, 0)
                for node, ms in self.tuned.items()]


def test_a_conv_slower_in_place_than_tuned_is_named():
    ex = _Executor({"fast": 0.10, "slow": 0.20, "auto": 0.3}, {"fast": 0.10, "slow": 0.20 / (SLOW_RATIO + 0.05), "auto": None})
    report = check_in_place(ex, {}, clock=_Clock())
    assert report.reliable and {c.node for c in report.convs} == {"fast", "slow"}  # nothing recorded for "auto"
    assert [c.node for c in report.slow] == ["slow"]
    assert "'slow' runs 0.2000 ms in place" in report.slow[0].line() and report.to_json()["convs"][1]["ratio"] > SLOW_RATIO


def test_the_timings_own_cost_per_launch_flags_no_conv():
    """Small convs that run exactly their tuned time, each timed 3 us longer by the method: raw,
    every one is over the ratio; less the floor, none is."""
    tuned = {"a": 0.0043, "b": 0.0047, "c": 0.0039}
    clock = _Clock(overhead=0.003)
    report = check_in_place(_Executor(tuned, tuned, clock), {}, clock=clock)
    assert report.reliable and len(report.convs) == 3 and report.slow == []
    assert report.floor_ms == pytest.approx(0.003)
    for c in report.convs:
        assert c.raw_ms == pytest.approx(tuned[c.node] + 0.003) and c.raw_ms / c.tuned_ms > SLOW_RATIO  # what was flagged before
        assert c.in_place_ms == pytest.approx(tuned[c.node]) and c.floor_ms == pytest.approx(0.003) and not c.slow
    assert "less a floor of 0.0030 ms per launch" in report.how


def test_a_conv_truly_twice_its_tuned_time_is_the_one_named_with_the_floor():
    tuned = {"a": 0.0043, "b": 0.017, "c": 0.0039}
    clock = _Clock(overhead=0.003)
    report = check_in_place(_Executor(dict(tuned, b=0.034), tuned, clock), {}, clock=clock)
    assert [c.node for c in report.slow] == ["b"]
    b = report.slow[0]
    assert (b.in_place_ms, b.raw_ms, b.floor_ms) == (pytest.approx(0.034), pytest.approx(0.037), pytest.approx(0.003))
    assert b.ratio == pytest.approx(2.0) and b.excess_ms == pytest.approx(0.017)
    assert "'b' runs 0.0340 ms in place (0.0370 ms timed, less the 0.0030 ms floor) against 0.0170 ms tuned (2.00x" in b.line()
    doc = report.to_json()
    assert doc["floor_ms"] == pytest.approx(0.003) and doc["reliable"] is True
    row = next(r for r in doc["convs"] if r["node"] == "b")
    assert (row["in_place_ms"], row["raw_ms"], row["floor_ms"], row["ratio"]) == (
        pytest.approx(0.034), pytest.approx(0.037), pytest.approx(0.003), 2.0)


def test_slow_convs_come_worst_first_by_excess_time():
    tuned = {"small": 0.01, "big": 0.5, "mid": 0.1}
    truth = {"small": 0.05, "big": 0.7, "mid": 0.2}  # ratios 5x, 1.4x, 2x; excess 0.04, 0.2, 0.1 ms
    report = check_in_place(_Executor(truth, tuned), {}, clock=_Clock())
    assert [c.node for c in report.slow] == ["big", "mid", "small"]


def test_the_floor_is_the_median_empty_launch_queued_behind_the_same_hold():
    times = [0.003] * (RUNS * FLOOR_LAUNCHES)
    times[0], times[5] = 0.5, 0.4  # outliers: the median ignores them
    clock = _Clock(empties=times)
    report = check_in_place(_Executor({"a": 0.1}, {"a": 0.1}, clock), {}, clock=clock)
    assert report.floor_ms == pytest.approx(0.003) and report.convs[0].in_place_ms == pytest.approx(0.097)
    first = clock.log.index("hold")  # a timed run: hold, empties, the plan's launches, empties, then the check
    run = clock.log[first:clock.log.index("sync", first)]
    half = FLOOR_LAUNCHES - FLOOR_LAUNCHES // 2
    assert run == ["hold"] + ["empty"] * half + ["run"] + ["empty"] * (FLOOR_LAUNCHES // 2) + ["check"]
    assert clock.log.count("empty") == RUNS * FLOOR_LAUNCHES


def test_a_time_under_the_floor_is_zero_not_negative():
    clock = _Clock(overhead=0.003, empties=[0.006] * (RUNS * FLOOR_LAUNCHES))
    report = check_in_place(_Executor({"a": 0.001}, {"a": 0.001}, clock), {}, clock=clock)
    assert report.convs[0].raw_ms == pytest.approx(0.004) and report.convs[0].in_place_ms == 0.0 and report.slow == []


def test_without_runs_queued_whole_nothing_is_called_slow():
    ex = _Executor({"slow": 0.5}, {"slow": 0.1})
    report = check_in_place(ex, {}, clock=_Clock(holds=False))
    assert not report.reliable and report.slow == [] and "host launch overhead included" in report.how

"""The in-place check of tuned convs, on stand-ins for the executor and the GPU's clock."""

from __future__ import annotations

import types

from convpass.kernels.plan import ConvSummary
from convpass.runtime.in_place import SLOW_RATIO, check_in_place


class _Event:
    def __init__(self, t: float) -> None:
        self.t = t


class _Clock:
    """Events carry their time; the hold holds (``holds``) or not."""

    note = ""

    def __init__(self, holds: bool = True) -> None:
        self.holds = holds

    def sync(self) -> None:
        pass

    def elapsed_ms(self, a: _Event, b: _Event) -> float:
        return b.t - a.t

    def hold(self, seconds: float):
        return (lambda: True) if self.holds else None


class _Executor:
    """Runs 'launches' of fixed GPU times; records them when step events are on."""

    def __init__(self, launches: dict[str, float], tuned: dict[str, float | None]) -> None:
        self.launches, self.tuned = launches, tuned
        self.backend = types.SimpleNamespace(step_events=None)

    def run(self, names, feeds):
        events = self.backend.step_events
        if events is not None:
            t = 0.0
            for node, ms in self.launches.items():
                events.append(("Conv", "Conv", _Event(t), _Event(t + ms), node))
                t += ms

    def plan_summary(self):
        return [ConvSummary(node, "Conv", True, "implicit_gemm", "NHWC", "default", "measure", 0, ms, "", None, 0)
                for node, ms in self.tuned.items()]


def test_a_conv_slower_in_place_than_tuned_is_named():
    ex = _Executor({"fast": 0.10, "slow": 0.20, "auto": 0.3}, {"fast": 0.10, "slow": 0.20 / (SLOW_RATIO + 0.05), "auto": None})
    report = check_in_place(ex, {}, clock=_Clock())
    assert report.reliable and {c.node for c in report.convs} == {"fast", "slow"}  # nothing recorded for "auto"
    assert [c.node for c in report.slow] == ["slow"]
    assert "'slow' runs 0.2000 ms in place" in report.slow[0].line() and report.to_json()["convs"][1]["ratio"] > SLOW_RATIO


def test_without_runs_queued_whole_nothing_is_called_slow():
    ex = _Executor({"slow": 0.5}, {"slow": 0.1})
    report = check_in_place(ex, {}, clock=_Clock(holds=False))
    assert not report.reliable and report.slow == [] and "host launch overhead included" in report.how

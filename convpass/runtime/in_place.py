"""Every tuned conv timed in place, against the time it was tuned at.

A conv is tuned alone (:mod:`convpass.tuning.harness`); it runs between its neighbours, in the
memory format the plan gave it, with its epilogue, on buffers other launches just wrote. This
check times each conv's launch inside the model's plan (:mod:`convpass.runtime.cuda.timing`: the
launches a captured graph replays, queued back to back behind a hold kernel, GPU time per launch)
and compares it with the decision's recorded time for the same profile.

Rules:

* Only convs with a recorded time above zero are judged (a conv left to run time has none).
* The timing has a cost of its own per launch (the event pair around it), near-constant and of
  the order of a small conv: the **floor**, measured in the same runs as the median time of an
  empty kernel's launch timed the same way. A conv's time in place is its median launch time less
  the floor, never below zero; both the raw time and the floor are reported.
* A conv is **slow** when its time in place is more than :data:`SLOW_RATIO` times its tuned time.
  The launch includes what the conv's step does in place: its fused epilogue (as tuned) and any
  memory-format conversion of its input (which the layout plan charged as a transpose).
* The result says how it was timed; where runs could not be queued whole, host gaps are included
  and the verdict is marked unreliable rather than reported as a slow conv.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from typing import Any

from convpass.runtime.cuda.timing import Clock, CupyClock, timed_runs

__all__ = ["SLOW_RATIO", "ConvInPlace", "InPlaceReport", "check_in_place"]

SLOW_RATIO = 1.15
CONV_OPS = frozenset({"Conv", "ConvTranspose"})
RUNS = 5
FLOOR_LAUNCHES = 8  # empty launches timed per run for the floor


@dataclasses.dataclass(frozen=True)
class ConvInPlace:
    node: str
    profile: int
    tuned_ms: float
    in_place_ms: float  # raw_ms less floor_ms, never below zero: what is judged
    algo: str
    memory_format: str
    raw_ms: float  # the median launch time as timed
    floor_ms: float  # the timing's own cost per launch (module rules)

    @property
    def ratio(self) -> float:
        return self.in_place_ms / self.tuned_ms if self.tuned_ms > 0 else float("inf")

    @property
    def excess_ms(self) -> float:
        """How much longer it runs in place than tuned."""
        return self.in_place_ms - self.tuned_ms

    @property
    def slow(self) -> bool:
        return self.ratio > SLOW_RATIO

    def line(self) -> str:
        return (f"conv {self.node!r} runs {self.in_place_ms:.4f} ms in place ({self.raw_ms:.4f} ms timed, less the "
                f"{self.floor_ms:.4f} ms floor) against {self.tuned_ms:.4f} ms tuned ({self.ratio:.2f}x; {self.algo}, "
                f"{self.memory_format})")


@dataclasses.dataclass(frozen=True)
class InPlaceReport:
    convs: list[ConvInPlace]
    how: str
    reliable: bool  # every run was queued whole: GPU time only
    floor_ms: float = 0.0  # the timing's own cost per launch, subtracted from every conv's time

    @property
    def slow(self) -> list[ConvInPlace]:
        """The slow convs, the one with the most excess time first (none when not reliable)."""
        return sorted((c for c in self.convs if c.slow), key=lambda c: -c.excess_ms) if self.reliable else []

    def to_json(self) -> dict[str, Any]:
        return {"how": self.how, "reliable": self.reliable, "slow_ratio": SLOW_RATIO, "floor_ms": self.floor_ms,
                "convs": [dict(dataclasses.asdict(c), ratio=round(c.ratio, 4)) for c in self.convs]}


def check_in_place(executor: Any, feeds: Mapping[str, Any], profile: int = 0, *, runs: int = RUNS, clock: Clock | None = None) -> InPlaceReport:
    """Time every tuned conv of ``executor``'s plan for ``feeds`` in place (module rules).
    ``executor``: a cuda executor made with ``cuda_graph=False``; ``profile``: the index of the
    shape profile ``feeds`` has (whose recorded times are compared)."""
    clock = clock or CupyClock()
    timed = timed_runs(executor, feeds, runs, clock=clock, ops=CONV_OPS, floor=FLOOR_LAUNCHES)
    per_node = timed.per_node_ms(clock)
    measured = timed.floor_ms(clock)
    floor = measured if measured is not None else 0.0
    how = timed.how + (f"; less a floor of {floor:.4f} ms per launch (an empty kernel timed the same way)" if measured is not None
                       else "; no floor measured (no empty kernel)")
    convs = []
    for s in executor.plan_summary():
        times = per_node.get(s.node)
        if s.time_ms is None or s.time_ms <= 0 or not times or not s.tuned or s.source in ("fallback", "untuned"):
            continue  # nothing recorded to compare with, or not the recorded choice that runs
        where = s.profile if s.profile is not None else profile
        raw = statistics.median(times)
        convs.append(ConvInPlace(s.node, where, float(s.time_ms), max(raw - floor, 0.0), s.algo, s.memory_format, raw, floor))
    return InPlaceReport(convs, how, timed.whole, floor)

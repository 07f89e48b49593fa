"""Every tuned conv timed in place, against the time it was tuned at.

A conv is tuned alone (:mod:`convpass.tuning.harness`); it runs between its neighbours, in the
memory format the plan gave it, with its epilogue, on buffers other launches just wrote. This
check times each conv's launch inside the model's plan (:mod:`convpass.runtime.cuda.timing`: the
launches a captured graph replays, queued back to back behind a hold kernel, GPU time per launch)
and compares it with the decision's recorded time for the same profile.

Rules:

* Only convs with a recorded time are judged (a conv left to run time has none).
* A conv is **slow** when its median time in place is more than :data:`SLOW_RATIO` times its tuned
  time. The launch includes what the conv's step does in place: its fused epilogue (as tuned) and
  any memory-format conversion of its input (which the layout plan charged as a transpose).
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


@dataclasses.dataclass(frozen=True)
class ConvInPlace:
    node: str
    profile: int
    tuned_ms: float
    in_place_ms: float
    algo: str
    memory_format: str

    @property
    def ratio(self) -> float:
        return self.in_place_ms / self.tuned_ms if self.tuned_ms > 0 else float("inf")

    @property
    def slow(self) -> bool:
        return self.ratio > SLOW_RATIO

    def line(self) -> str:
        return (f"conv {self.node!r} runs {self.in_place_ms:.4f} ms in place against {self.tuned_ms:.4f} ms tuned "
                f"({self.ratio:.2f}x; {self.algo}, {self.memory_format})")


@dataclasses.dataclass(frozen=True)
class InPlaceReport:
    convs: list[ConvInPlace]
    how: str
    reliable: bool  # every run was queued whole: GPU time only

    @property
    def slow(self) -> list[ConvInPlace]:
        return [c for c in self.convs if c.slow] if self.reliable else []

    def to_json(self) -> dict[str, Any]:
        return {"how": self.how, "reliable": self.reliable, "slow_ratio": SLOW_RATIO,
                "convs": [dict(dataclasses.asdict(c), ratio=round(c.ratio, 4)) for c in self.convs]}


def check_in_place(executor: Any, feeds: Mapping[str, Any], profile: int = 0, *, runs: int = RUNS, clock: Clock | None = None) -> InPlaceReport:
    """Time every tuned conv of ``executor``'s plan for ``feeds`` in place (module rules).
    ``executor``: a cuda executor made with ``cuda_graph=False``; ``profile``: the index of the
    shape profile ``feeds`` has (whose recorded times are compared)."""
    clock = clock or CupyClock()
    timed = timed_runs(executor, feeds, runs, clock=clock, ops=CONV_OPS)
    per_node = timed.per_node_ms(clock)
    convs = []
    for s in executor.plan_summary():
        times = per_node.get(s.node)
        if s.time_ms is None or not times or not s.tuned or s.source in ("fallback", "untuned"):
            continue  # nothing recorded to compare with, or not the recorded choice that runs
        where = s.profile if s.profile is not None else profile
        convs.append(ConvInPlace(s.node, where, float(s.time_ms), statistics.median(times), s.algo, s.memory_format))
    return InPlaceReport(convs, timed.how, timed.whole)

"""GPU time per launch of a compiled plan, as the GPU runs it: what the in-place check, the per-conv
account and ``bench --profile-ops`` measure.

The plan runs eagerly (the same launches a captured graph replays, in the same order, on the same
buffers) with every launch bracketed by two CUDA events (``backend.step_events``). Eager launches
are bound by host time, and an event pair around a launch the GPU had to wait for would time the
host, not the GPU; so each timed run is queued whole before the GPU starts it: a *hold* kernel
that spins for longer than the host needs to enqueue one run goes first, and after the run is
enqueued the host checks that the hold is still spinning; runs where it is not are retried with a
longer hold. What the events then time is GPU time per launch, back to back, neighbours and memory
formats as they run. Where no run can be queued whole (a launch that waits for the host, a run
longer than the stream's launch queue, no hold kernel), :attr:`TimedRuns.whole` is False and
:attr:`TimedRuns.how` says that host gaps are included.

An event pair costs GPU time of its own: what it times is the launch plus a near-constant
per-launch cost of the method (a few microseconds), large beside a small kernel. Asked for a
``floor``, each run also times that many launches of an empty kernel (half before the plan's
launches, half after, behind the same hold, between the same kind of events, on the same stream);
:meth:`TimedRuns.floor_ms` is their median, the method's own time per launch.

The clock is injectable (:class:`CupyClock` is the real one): tests drive it with fakes.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

__all__ = ["MAX_HOLD_S", "Clock", "CupyClock", "TimedRuns", "timed_runs"]

Events = tuple[Any, Any]  # the (start, end) CUDA events around one launch

MAX_HOLD_S = 0.25  # longest hold kernel tried (a run that needs longer overflows the launch queue anyway)


class Clock(Protocol):
    """What :func:`timed_runs` needs from the GPU (:class:`CupyClock`; tests pass a fake)."""

    note: str

    def sync(self) -> None: ...

    def elapsed_ms(self, start: Any, end: Any) -> float: ...

    def hold(self, seconds: float) -> Callable[[], bool] | None:
        """Queue a hold of ``seconds`` on the stream; returns the check "is it still holding?" (called
        once the run is enqueued), or None when no hold can be queued (``note`` says why)."""
        ...

    def empty(self) -> Events | None:
        """Queue one launch of an empty kernel between two events, as the runner brackets a timed
        launch; returns the events, or None when no empty kernel can be built."""
        ...


_SOURCE = r"""
extern "C" __global__ void convpass_empty() {}

extern "C" __global__ void convpass_hold(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


class CupyClock:
    """CUDA events, the hold kernel and the empty kernel on CuPy's current stream (the stream eager
    runs launch on)."""

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self.note = ""
        self._kernels: tuple[Any, Any] | bool | None = None  # (hold, empty); False: they do not build

    def sync(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(self.cp.cuda.get_elapsed_time(start, end))

    def _built(self) -> tuple[Any, Any] | None:
        import numpy as np

        if self._kernels is None:
            try:
                module = self.cp.RawModule(code=_SOURCE)
                hold, empty = module.get_function("convpass_hold"), module.get_function("convpass_empty")
                hold((1,), (1,), (np.uint64(0),))  # compiles them
                empty((1,), (1,), ())
                self._kernels = (hold, empty)
            except Exception as e:  # noqa: BLE001
                self._kernels = False
                self.note = f"no hold kernel ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"
        return self._kernels if isinstance(self._kernels, tuple) else None

    def hold(self, seconds: float) -> Callable[[], bool] | None:
        import numpy as np

        kernels = self._built()
        if kernels is None:
            return None
        kernels[0]((1,), (1,), (np.uint64(int(seconds * 1e9)),))
        released = self.cp.cuda.Event(disable_timing=True)
        released.record()
        return lambda: not released.done

    def empty(self) -> Events | None:
        kernels = self._built()
        if kernels is None:
            return None
        begin = self.cp.cuda.Event()  # as the runner's events around a launch (runner._run_eager)
        begin.record()
        kernels[1]((1,), (1,), ())
        end = self.cp.cuda.Event()
        end.record()
        return begin, end


@dataclasses.dataclass
class TimedRuns:
    """The event pairs of each kept run: ``(label, op_type, start, end, node name)`` per launch."""

    runs: list[list[tuple[Any, ...]]]
    whole: bool  # every kept run was queued whole behind the hold: GPU time, host gaps excluded
    how: str  # the method, in words
    floors: list[list[Events]] = dataclasses.field(default_factory=list)  # per kept run: its empty launches

    def floor_ms(self, clock: Clock) -> float | None:
        """The method's own time per launch: the median over the kept runs of the empty launches'
        times (None when none was timed)."""
        times = [clock.elapsed_ms(start, end) for run in self.floors for start, end in run]
        return statistics.median(times) if times else None

    def per_node_ms(self, clock: Clock) -> dict[str, list[float]]:
        """Each launch's GPU time per run, by the name of the node it runs (a fused launch under
        its last node)."""
        out: dict[str, list[float]] = {}
        for run in self.runs:
            for _label, _op, start, end, *rest in run:
                if rest:
                    out.setdefault(rest[0], []).append(clock.elapsed_ms(start, end))
        return out


def timed_runs(executor: Any, feeds: Mapping[str, Any], runs: int, *, clock: Clock, warmup: int = 2,
               host_clock: Callable[[], float] = time.perf_counter, ops: frozenset[str] | None = None,
               floor: int = 0) -> TimedRuns:
    """``runs`` runs of an eager executor (``cuda_graph=False``) with an event pair around every
    launch: ``warmup`` untimed runs first (the first builds the plan), then the host time of one
    run's enqueue sizes the hold, then up to ``runs + 2`` attempts to get ``runs`` runs queued whole
    (module docstring). ``executor.backend.step_events`` is set during the timed runs only;
    ``ops``: time only launches of these op types (the others run between them, untimed);
    ``floor``: empty launches to time in each run (module docstring)."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    backend = executor.backend
    for _ in range(max(warmup, 1)):
        executor.run(None, feeds)
    clock.sync()
    t0 = host_clock()
    executor.run(None, feeds)
    hold_s = min(MAX_HOLD_S, 2.0 * (host_clock() - t0) + 1e-3)
    clock.sync()
    whole: list[list[tuple[Any, ...]]] = []
    other: list[list[tuple[Any, ...]]] = []
    floors: dict[bool, list[list[Events]]] = {True: [], False: []}
    events: list[tuple[Any, ...]] = []
    backend.step_events = events
    backend.step_event_ops = ops
    try:
        for _ in range(runs + 2):
            start = len(events)
            holding = clock.hold(hold_s)
            empties = _empties(clock, floor - floor // 2)
            executor.run(None, feeds)
            empties += _empties(clock, floor // 2)
            queued = holding() if holding is not None else False
            clock.sync()
            (whole if queued else other).append(events[start:])
            floors[bool(queued)].append(empties)
            if len(whole) == runs or (holding is None and len(other) == runs):
                break
            if holding is not None and not queued:
                hold_s = min(MAX_HOLD_S, 2.0 * hold_s)
    finally:
        backend.step_events = None
        backend.step_event_ops = None
    if whole:
        return TimedRuns(whole, True, "each run queued whole behind a hold kernel: GPU time, host launch overhead excluded",
                         floors[True])
    why = clock.note or "the hold ended before the run was enqueued (a launch waits for the host inside the run)"
    return TimedRuns(other[:runs], False, f"host launch overhead included ({why})", floors[False][:runs])


def _empties(clock: Clock, n: int) -> list[Events]:
    """``n`` empty launches queued between event pairs (fewer where the clock has no empty kernel)."""
    out = []
    for _ in range(n):
        pair = clock.empty()
        if pair is None:
            break
        out.append(pair)
    return out

"""Timing on the GPU, done the way that gives numbers worth recording.

* Clocks are warmed by a large matrix product before timing, at most once every 30 s (idle GPUs
  sit at low clocks).
* Every launch gets a warm-up first (module loading and lazy kernel selection stay out).
* Launches run back to back between CUDA events, in groups captured once into a CUDA graph and
  replayed, so small kernels are timed as the GPU runs them, not as fast as Python can launch them
  (eager launches are the fallback when a call cannot be captured); the recorded time is the median
  of the groups' per-launch times. The number of launches per group adapts to the first estimate so a
  group lasts about ``group_ms``: big problems are not repeated for ever, small ones are not noise.
* Inputs rotate among several random sets whose total size exceeds the L2 cache, so small problems
  are timed from device memory as in a real network, not from a warm cache.
* A candidate clearly slower than the best one already timed for the same problem is stopped after
  its estimate (and says so): over :data:`EARLY_STOP_RATIO` times the best and
  :data:`EARLY_STOP_MIN_MS` above it. It will not be chosen, and timing it fully would only cost
  tuning time: most of cuDNN's graph-API engine configurations for a conv are well above the best,
  and timing them in full was most of a ResNet-50's tuning time
  (docs/measurements/2026-11-24-tuning-time.md). One that passes the estimate but whose first
  :data:`LATE_STOP_GROUPS` groups both take over :data:`LATE_STOP_RATIO` times the best is stopped
  there, where it is also 2 µs above the best (``Timing.stopped_by`` says so, ``early_stop`` stays
  False): groups are precise to a few percent, so its time is a measurement like any other, from
  fewer groups; about half of the candidates timed in full ended well above their problem's best
  (docs/measurements/2026-11-27-tuning-time-third-pass.md).
* An estimate under :data:`CONFIRM_RATIO` times the best (and :data:`CONFIRM_LATENCY_MS`) that
  would stop a candidate is taken once more, and the lower reading counts: what one replay carries
  besides the kernels (the graph's launch latency, a large part of one replay of a few
  microsecond-kernels; once 0.125 ms in a one-launch graph) must not stop it. From
  :data:`CONFIRM_REPLAYS` replays back to back when its graph lasts under :data:`CONFIRM_GRAPH_MS`,
  else from one more replay.
* Candidates timed one after the other drift with the GPU's state between their timings (by more
  than each timing's own precision over its groups), which flips choices between near-equal ones
  from run to run. So the tuner replays the captured groups of the close ones in turn, round after
  round (:func:`head_to_head`; which ones: ``shape_bench.ShapeBench.settle``), and orders them by
  that.
* A first launch over 4x the best and :data:`SLOW_LAUNCH_MS` is launched once more, eagerly; when
  that one is too, the candidate is stopped there (``a second launch over 4x the best and 2 ms``): a slow
  algorithm is not captured into any graph.
* The caller may have launched set 0 once already (the tuner's correctness check): its time
  (``first_ms``) stands in for the warm-up launch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any


def cupy():
    import cupy as cp

    return cp


# A launch slower than this (and 4x the best) twice in a row ends a candidate before its estimate.
# The second launch is eager and may still be loading: second launches of microsecond kernels can
# take a millisecond, and a 4x-only rule stopped the best candidate of a geometry that way (a
# decision 2x off; docs/measurements/2026-11-27-fleet-tuner-defects.md). Below this the estimate
# decides.
SLOW_LAUNCH_MS = 2.0
# The first estimate (a captured graph of 4 launches, after a warm-up launch) is within ~20% of the
# full timing; a candidate this far above the best is not a close call.
EARLY_STOP_RATIO = 1.5
EARLY_STOP_MIN_MS = 0.002  # tiny kernels: a graph launch's own latency weighs in a 4-launch estimate
# An estimate under CONFIRM_RATIO times the best, plus CONFIRM_LATENCY_MS (a graph's launch latency
# spread over its launches, a few microseconds a launch), that would stop a candidate is taken
# again: over CONFIRM_REPLAYS replays of its graph when the graph lasts under CONFIRM_GRAPH_MS, else
# over one.
# One replay of 4 launches reads microsecond kernels up to about twice their full timings, which
# dropped candidates close to their best, own kernels whose fused epilogue then went untimed among
# them (docs/measurements/2026-11-27-fleet-tuner-defects.md). A batch-32 problem rotates one input
# set, so its estimate is one launch: one such reading stopped ResNet-50's fused 1x1 stride-2 conv +
# residual, and the bare conv and a separate pass ran instead, slower
# (docs/measurements/2026-11-27-tuning-time-after-fleet-fixes.md). Taking them again costs a small
# part of a tuning's GPU time.
CONFIRM_RATIO = 3.0
CONFIRM_LATENCY_MS = 0.005
CONFIRM_GRAPH_MS = 0.2
CONFIRM_REPLAYS = 8
# Rounds of head_to_head: close candidates' groups replayed in turn this many times.
HEAD_TO_HEAD_ROUNDS = 5
# After this many groups (each a full rotation, a millisecond or more), a candidate over this ratio of
# the best is no close call either.
LATE_STOP_GROUPS = 2
LATE_STOP_RATIO = 1.15


@dataclasses.dataclass(frozen=True)
class Timing:
    time_ms: float
    launches: int
    spread: float  # (max - min) / median of the group times
    early_stop: bool = False  # stopped after an estimate: time_ms is that estimate, not a measurement
    eager: bool = False  # launches could not be captured: times include Python's launch cost
    stopped_by: str = ""  # why timing stopped before every group ran (an early stop, or a late one: see the module docstring)
    # the captured group the groups replayed (None: early stop or eager), for a head-to-head later
    group: Any = dataclasses.field(default=None, compare=False, repr=False)
    group_launches: int = 0


_clocks_warmed_at = 0.0


def warm_clocks(seconds: float = 0.2) -> None:
    """Keep the GPU busy with a large matmul for ``seconds`` (at most once every 30 s)."""
    global _clocks_warmed_at
    if time.monotonic() - _clocks_warmed_at < 30:
        return
    cp = cupy()
    a = cp.random.standard_normal((4096, 4096), dtype=cp.float32)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(4):
            a @ a
        cp.cuda.get_current_stream().synchronize()
    _clocks_warmed_at = time.monotonic()


def prod(values) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def l2_cache_bytes() -> int:
    return _l2_cache_bytes(cupy().cuda.Device().id)


@functools.cache
def _l2_cache_bytes(device: int) -> int:
    # asked per candidate: cudaGetDeviceProperties took 1.2 ms a call (6 s of a ResNet-50 tuning)
    try:
        return int(cupy().cuda.runtime.getDeviceProperties(device)["l2CacheSize"])
    except Exception:  # noqa: BLE001
        return 50 << 20


def rotation_sets(bytes_per_set: int, limit: int = 64) -> int:
    """How many input sets to rotate so that together they exceed twice the L2 cache."""
    return max(1, min(limit, math.ceil(2 * l2_cache_bytes() / max(1, bytes_per_set))))


def random_array(shape, dtype: str, layout: str, rng_seed: int, scale: float = 1.0):
    """Random (never zero) device data of a convpass dtype, stored in ``layout``."""
    from convpass.native.cudnn import empty_like_layout

    cp = cupy()
    rs = cp.random.RandomState(rng_seed)
    values = rs.standard_normal(shape, dtype=cp.float32) * scale
    out = empty_like_layout(shape, dtype, layout)
    out[...] = to_storage(values, dtype)
    return out


def to_storage(values, dtype: str):
    """float32 CuPy values in the storage dtype of ``dtype`` (bfloat16 as raw uint16 bits)."""
    cp = cupy()
    if dtype == "bfloat16":
        bits = values.astype(cp.float32).view(cp.uint32)
        rounded = bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))
        return (rounded >> 16).astype(cp.uint16)
    return values.astype(dtype)


def to_float32(array, dtype: str):
    """Device data stored in the convpass dtype ``dtype`` as float32 (itself when float32 already)."""
    cp = cupy()
    if dtype == "bfloat16":
        return (cp.ascontiguousarray(array).astype(cp.uint32) << 16).view(cp.float32)
    return array.astype(cp.float32, copy=False)


_error_sums: Any = None  # the kernel (CuPy compiles and caches it per device)


def relative_error(out, ref) -> float:
    """Normwise ||out - ref|| / ||ref||; inf when out has NaN or Inf (e.g. unwritten elements).

    ``out`` in its storage dtype (float32 or float16; bfloat16 through :func:`to_float32`), ``ref``
    of the same logical shape, in any memory order. Both sums of squares come from one pass over
    the data and one transfer: this runs for every candidate a tuning checks (thousands), so a
    chain of separate CuPy calls would cost several times more per check.
    """
    global _error_sums
    cp = cupy()
    if _error_sums is None:
        # double sums: a batch-32 output has tens of millions of elements
        _error_sums = cp.ReductionKernel(
            "T x, float32 r", "complex128 s",
            "complex<double>(((double)x - r) * ((double)x - r), (double)r * r)",
            "a + b", "s = a", "complex<double>(0, 0)", "convpass_error_sums")
    # Over all axes but the batch and the first spatial one: CuPy's reduction runs one block per
    # output, and a scalar's single block takes milliseconds over a batch-32 output
    axes = tuple(a for a in range(ref.ndim) if a not in (0, 2))
    sums = complex(_error_sums(out, ref.astype(cp.float32, copy=False), axis=axes).sum().get())
    if not math.isfinite(sums.real):
        return math.inf
    return math.sqrt(sums.real) / max(math.sqrt(sums.imag), 1e-30)


def first_launch_ms(launch: Callable[[], None]) -> float:
    """Run ``launch()`` once between CUDA events on the current stream and return its time (ms):
    the first launch of a candidate, which :func:`time_launches` takes as its warm-up."""
    cp = cupy()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    launch()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop)


def time_launches(
    launch: Callable[[int], None],
    sets: int,
    best_ms: float | None = None,
    group_ms: float = 1.0,
    max_groups: int = 7,
    budget_ms: float = 40.0,
    first_ms: float | None = None,
) -> Timing:
    """Median per-launch time of ``launch(set_index)`` (see the module docstring).

    ``first_ms``: the time of a launch of set 0 the caller made just before (with
    :func:`first_launch_ms`), in place of the warm-up launch.
    Must run with a non-default CuPy stream current (CUDA graphs cannot capture the legacy stream).
    """
    cp = cupy()
    stream = cp.cuda.get_current_stream()
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def timed(replay, count: int, replays: int = 1) -> float:
        start.record()
        if replay is not None:
            for _ in range(replays):
                replay.launch(stream)
        else:
            for i in range(count):
                launch(i % sets)
        stop.record()
        stop.synchronize()
        return cp.cuda.get_elapsed_time(start, stop) / (count * (replays if replay is not None else 1))

    def stops(estimate: float) -> bool:
        return best_ms is not None and estimate > EARLY_STOP_RATIO * best_ms and estimate > best_ms + EARLY_STOP_MIN_MS

    warm = first_launch_ms(lambda: launch(0)) if first_ms is None else first_ms  # module load, lazy setup
    launched = 1
    if best_ms is not None and warm > max(4 * best_ms, SLOW_LAUNCH_MS):
        # Slow, or slow only because of loading? One more launch tells, before any group of them.
        again = timed(None, 1)
        launched += 1
        if again > max(4 * best_ms, SLOW_LAUNCH_MS):
            return Timing(again, launched, 0.0, early_stop=True,
                          stopped_by=f"a second launch over 4x the best and {SLOW_LAUNCH_MS:g} ms")
    # First estimate from a short captured graph: eager launches would measure Python, not the GPU.
    probe = min(sets, 4)
    graph = _capture(launch, sets, probe, stream)
    if graph is not None:
        # uploaded, not replayed once untimed: a fraction of a millisecond less per candidate, and
        # the estimates stay well inside the early stop's 1.5x of the full timing
        graph.upload(stream)
    estimate = timed(graph, probe)
    launched += probe
    if graph is not None and stops(estimate) and estimate < CONFIRM_RATIO * best_ms + CONFIRM_LATENCY_MS:
        # One replay carries more than its kernels (the graph's launch latency, at times more):
        # taken again before the candidate is dropped on it; neither reading is below its kernels.
        replays = CONFIRM_REPLAYS if estimate * probe < CONFIRM_GRAPH_MS else 1
        estimate = min(estimate, timed(graph, probe, replays))
        launched += probe * replays
    if stops(estimate):
        return Timing(estimate, launched, 0.0, early_stop=True, stopped_by=f"estimate over {EARLY_STOP_RATIO:g}x the best")
    per_group = max(1, min(200, round(group_ms / max(estimate, 1e-3))))
    # One graph covers every rotation set, so replays never re-read a set still in L2 (for slow
    # launches, only as many sets as a quarter of the budget allows: those are not cache-bound).
    rotate = min(sets, 256, max(1, int(budget_ms / 4 / max(estimate, 1e-3))))
    per_group = max(per_group, rotate)
    groups = max(3, min(max_groups, int(budget_ms / max(per_group * estimate, 1e-3))))
    replay = _capture(launch, sets, per_group, stream) if graph is not None else None
    if replay is not None:
        # uploaded outside the timed groups; any extra cost of a first replay is left out by their
        # median (a late stop's two groups are averaged)
        replay.upload(stream)
    times = []
    for _ in range(groups):
        times.append(timed(replay, per_group))
        if (best_ms is not None and len(times) == LATE_STOP_GROUPS
                and min(times) > LATE_STOP_RATIO * best_ms and min(times) > best_ms + EARLY_STOP_MIN_MS):
            return Timing(statistics.median(times), launched + len(times) * per_group, _spread(times), eager=replay is None,
                          stopped_by=f"{len(times)} groups over {LATE_STOP_RATIO:g}x the best", group=replay, group_launches=per_group)
    return Timing(statistics.median(times), launched + groups * per_group, _spread(times), eager=replay is None,
                  group=replay, group_launches=per_group)


def head_to_head(groups: list[tuple[Any, int]], rounds: int = HEAD_TO_HEAD_ROUNDS) -> list[float]:
    """Median per-launch time of each captured group (``(graph, launches)``, from
    :attr:`Timing.group`), replayed in turn, ``rounds`` times round: candidates timed one after
    the other drift apart with the GPU's state between their timings (two runs can differ by more
    than each run's spread over its groups; docs/measurements/2026-11-27-fleet-tuner-defects.md),
    candidates timed in turn share it.
    Must run on the stream the groups were captured on."""
    cp = cupy()
    stream = cp.cuda.get_current_stream()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times: list[list[float]] = [[] for _ in groups]
    for _ in range(rounds):
        for i, (graph, launches) in enumerate(groups):
            start.record()
            graph.launch(stream)
            stop.record()
            stop.synchronize()
            times[i].append(cp.cuda.get_elapsed_time(start, stop) / launches)
    return [statistics.median(t) for t in times]


def _spread(times: list[float]) -> float:
    median = statistics.median(times)
    return (max(times) - min(times)) / median if median > 0 else 0.0


def _capture(launch: Callable[[int], None], sets: int, count: int, stream):
    """A CUDA graph of ``count`` launches, or None when the calls cannot be captured."""
    from convpass.native.cuda import quiet_for_capture

    try:
        with quiet_for_capture():
            stream.begin_capture()
            try:
                for i in range(count):
                    launch(i % sets)
            finally:
                graph = stream.end_capture()
        return graph
    except Exception:  # noqa: BLE001  (capture unsupported for this call: time eagerly)
        stream.synchronize()
        return None

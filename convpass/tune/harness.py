"""Timing on the GPU, done the way that gives numbers worth recording.

* Clocks are warmed once per session by a large matrix product (idle GPUs sit at low clocks).
* Every launch gets a warm-up first (module loading and lazy kernel selection stay out).
* Launches run back to back between CUDA events, in groups captured once into a CUDA graph and
  replayed, so small kernels are timed as the GPU runs them, not as fast as Python can launch them
  (eager launches are the fallback when a call cannot be captured); the recorded time is the median
  of the groups' per-launch times. The number of launches per group adapts to the first estimate so a
  group lasts about ``group_ms``: big problems are not repeated for ever, small ones are not noise.
* Inputs rotate among several random sets whose total size exceeds the L2 cache, so small problems
  are timed from device memory as in a real network, not from a warm cache.
* A candidate clearly slower than the best one already timed for the same problem is stopped after
  its estimate (and says so): over :data:`EARLY_STOP_RATIO` times the best and :data:`EARLY_STOP_MIN_MS`
  above it. It will not be chosen, and timing it fully would only cost tuning time: on an H200 most
  of cuDNN's ~40 graph-API engine configurations per conv are 1.5-4x the best, and timing them in
  full was most of a ResNet-50's tuning time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable

import numpy as np


def cupy():
    import cupy as cp

    return cp


# The first estimate (a captured graph of 4 launches, after a warm-up launch) is within ~20% of the
# full timing; a candidate this far above the best is not a close call.
EARLY_STOP_RATIO = 1.5
EARLY_STOP_MIN_MS = 0.002  # tiny kernels: a graph launch's own latency weighs in a 4-launch estimate


@dataclasses.dataclass(frozen=True)
class Timing:
    time_ms: float
    launches: int
    spread: float  # (max - min) / median of the group times
    early_stop: bool = False
    eager: bool = False  # launches could not be captured: times include Python's launch cost


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


@functools.lru_cache(maxsize=None)
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
    from convpass.cudnn import empty_like_layout

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
    """A float32 copy of device data stored in the convpass dtype ``dtype``."""
    cp = cupy()
    if dtype == "bfloat16":
        return (cp.ascontiguousarray(array).astype(cp.uint32) << 16).view(cp.float32)
    return array.astype(cp.float32)


def relative_error(out, ref) -> float:
    """Normwise ||out - ref|| / ||ref||; inf when out has NaN or Inf (e.g. unwritten elements)."""
    cp = cupy()
    # both norms in one transfer: each float() of a device value waits for the GPU
    diff, norm = (float(v) for v in cp.stack((cp.linalg.norm((out - ref).ravel()), cp.linalg.norm(ref.ravel()))).get())
    if not np.isfinite(diff):
        return math.inf
    return diff / max(norm, 1e-30)


def time_launches(
    launch: Callable[[int], None],
    sets: int,
    best_ms: float | None = None,
    group_ms: float = 1.0,
    max_groups: int = 7,
    budget_ms: float = 40.0,
) -> Timing:
    """Median per-launch time of ``launch(set_index)`` (see the module docstring).

    Must run with a non-default CuPy stream current (CUDA graphs cannot capture the legacy stream).
    """
    cp = cupy()
    stream = cp.cuda.get_current_stream()
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def timed(replay, count: int) -> float:
        start.record()
        if replay is not None:
            replay.launch(stream)
        else:
            for i in range(count):
                launch(i % sets)
        stop.record()
        stop.synchronize()
        return cp.cuda.get_elapsed_time(start, stop) / count

    start.record()
    launch(0)  # warm-up (module load, lazy setup)
    stop.record()
    stop.synchronize()
    if best_ms is not None and cp.cuda.get_elapsed_time(start, stop) > max(4 * best_ms, 2.0):
        # Slow, or slow only because of loading? One more launch tells, before any group of them.
        again = timed(None, 1)
        if again > 4 * best_ms:
            return Timing(again, 2, 0.0, early_stop=True)
    # First estimate from a short captured graph: eager launches would measure Python, not the GPU.
    probe = min(sets, 4)
    graph = _capture(launch, sets, probe, stream)
    if graph is not None:
        timed(graph, probe)  # first replay uploads the graph
    estimate = timed(graph, probe)
    if best_ms is not None and estimate > EARLY_STOP_RATIO * best_ms and estimate > best_ms + EARLY_STOP_MIN_MS:
        return Timing(estimate, probe + 1, 0.0, early_stop=True)
    per_group = max(1, min(200, round(group_ms / max(estimate, 1e-3))))
    # One graph covers every rotation set, so replays never re-read a set still in L2 (for slow
    # launches, only as many sets as a quarter of the budget allows: those are not cache-bound).
    rotate = min(sets, 256, max(1, int(budget_ms / 4 / max(estimate, 1e-3))))
    per_group = max(per_group, rotate)
    groups = max(3, min(max_groups, int(budget_ms / max(per_group * estimate, 1e-3))))
    replay = _capture(launch, sets, per_group, stream) if graph is not None else None
    if replay is not None:
        timed(replay, per_group)
    times = [timed(replay, per_group) for _ in range(groups)]
    median = statistics.median(times)
    return Timing(median, probe + (groups + 1) * per_group, (max(times) - min(times)) / median if median > 0 else 0.0, eager=replay is None)


def _capture(launch: Callable[[int], None], sets: int, count: int, stream):
    """A CUDA graph of ``count`` launches, or None when the calls cannot be captured."""
    from convpass.runtime.cuda.common import quiet_for_capture

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

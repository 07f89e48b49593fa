"""How ``convpass bench`` measures every contender alike: inputs, steady-state timing, the GPU's
clocks and memory, the output check.

Every contender is timed the same way (:func:`time_steady`): ``warmup`` untimed runs, then ``runs``
runs each followed by ``cudaDeviceSynchronize``, timed on the host clock (``perf_counter``) from
before the call to after the synchronize, so every runtime pays its own launch and Python overhead
(ONNX Runtime runs on its own stream, so CUDA events on CuPy's stream would not bracket it). Inputs
and outputs stay on the device. The clocks are warmed by a short matmul before each contender's
steady-state runs (:func:`warm_gpu`).
"""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from convpass.bench.records import judge
from convpass.bench.stats import relative_error, tolerance_for
from convpass.core.profiles import model_inputs

TIMING = "host perf_counter around each run + cudaDeviceSynchronize; device-resident input and output"


def make_feeds(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]], seed: int = 0) -> dict[str, np.ndarray]:
    """Random host inputs: standard normal for floats, small integers otherwise (never all zeros)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, _, dtype in model_inputs(model):
        shape = tuple(shapes[name])
        if dtype.kind == "f":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[name] = rng.integers(0, 2, shape).astype(dtype)
        else:
            feeds[name] = rng.integers(1, 10, shape).astype(dtype)
    return feeds


def time_steady(run: Callable[[], Any], sync: Callable[[], None], runs: int, warmup: int,
                clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """``warmup`` untimed runs, then ``runs`` timed runs (ms), each ended by ``sync``."""
    for _ in range(warmup):
        run()
        sync()
    times = []
    for _ in range(runs):
        t0 = clock()
        run()
        sync()
        times.append((clock() - t0) * 1e3)
    return times


def cupy() -> Any:
    import cupy as cp

    return cp


def device_sync() -> None:
    cupy().cuda.runtime.deviceSynchronize()


def warm_gpu(seconds: float = 0.05) -> None:
    """Bring the clocks up before a steady-state measurement (idle GPUs sit at low clocks)."""
    cp = cupy()
    a = cp.ones((2048, 2048), dtype=cp.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(4):
            a @ a
        device_sync()


def free_gpu_memory() -> None:
    gc.collect()
    cp = cupy()
    device_sync()
    cp.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass


def host(x: Any) -> np.ndarray:
    """An output in host memory (CuPy arrays through ``.get()``)."""
    if isinstance(x, np.ndarray):
        return x
    get = getattr(x, "get", None)
    if callable(get):  # CuPy
        return get()
    return np.asarray(x)


def check(c: dict[str, Any], output_sets: Sequence[Sequence[Any] | None], ref: Sequence[np.ndarray] | None,
          tf32: bool | None, dtype: str) -> dict[str, Any]:
    """Judge a timed contender against the reference: the worst error over its output sets (the
    first run's and the last steady-state run's, so a broken replay cannot hide behind a good first run)."""
    tol = tolerance_for(tf32, dtype)
    if ref is None:
        return judge(c, None, tol)
    worst = 0.0
    for outputs in output_sets:
        worst = max(worst, math.inf if outputs is None else relative_error(outputs, ref))
    return judge(c, worst, tol)

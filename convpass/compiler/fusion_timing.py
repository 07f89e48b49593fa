"""Timing one fusion unit on the GPU, fused or not (rule 1 of :mod:`convpass.compiler.fusions`).

The unit's own model is built by the cuda executor (``fusions=True`` or ``False``; no CUDA graph of
its own), and the compiled plan's launches are run twice from a private memory pool on a private
stream, then captured once as a CUDA graph (the allocations repeat, so the capture reuses the
pool's blocks, as the executor's own capture does). The graph's replays are timed by
:func:`convpass.tuning.harness.time_launches` after warming the clocks: what is recorded is the
GPU time of the unit's launches, without Python's launch overhead.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import onnx

__all__ = ["time_unit"]


def _feeds(cp: Any, proto: onnx.ModelProto, x_name: str, channels_last: bool) -> dict[str, Any]:
    """Random inputs of the unit model's shapes; ``x_name`` stored channels-last when asked."""
    from onnx import helper

    rng = cp.random.RandomState(0)
    feeds = {}
    for vi in proto.graph.input:
        shape = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        a = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        if channels_last and vi.name == x_name and 3 <= len(shape) <= 5:
            r = len(shape)
            a = cp.ascontiguousarray(a.transpose(0, *range(2, r), 1)).transpose(0, r - 1, *range(1, r - 1))
        feeds[vi.name] = a
    return feeds


def time_unit(proto: onnx.ModelProto, x_name: str, fused: bool, channels_last: bool) -> float:
    """Milliseconds of one run of the unit model's launches (module docstring)."""
    import cupy as cp

    from convpass.runtime.cuda import CudaBackend
    from convpass.runtime.executor import Executor
    from convpass.tuning import harness

    backend = CudaBackend(cuda_graph=False)
    with warnings.catch_warnings():  # start-up compilation of a model of its own: nothing to say
        warnings.simplefilter("ignore")
        executor = Executor(proto, device=backend, fusions=fused, kernels=False, check_model=False)
        feeds = _feeds(cp, proto, x_name, channels_last)
        plan = executor.prepare(feeds)
    state = plan.backend_state
    slots = plan.feed_slots

    def run(_set: int = 0) -> None:
        env = list(plan.template)
        for name, slot in slots.items():
            env[slot] = feeds[name]
        for i, launch in enumerate(state.launches):
            if launch is not None:
                launch.run(env)
            for s in state.free[i]:
                env[s] = None

    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc), stream:
        run()
        run()
        stream.begin_capture()
        try:
            run()
        finally:
            graph = stream.end_capture()
        graph.upload(stream)
        harness.warm_clocks()
        timing = harness.time_launches(lambda _i: graph.launch(stream), sets=1)
    stream.synchronize()
    return float(timing.time_ms)

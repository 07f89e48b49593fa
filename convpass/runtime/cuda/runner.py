"""Running a compiled plan: eagerly, or captured once as CUDA graphs and replayed.

The first run of a plan (right after the executor built it) is the *warm-up*: feeds are copied
into static input buffers and every launch runs eagerly on a private non-blocking stream,
allocating from a private CuPy memory pool (intermediates are released when their last reader
ran, so the pool holds what the plan's liveness needs). Each launch is watched: one that copies
to the host or uploads while it runs (an op that reads values on the host) cannot be captured.

Then the plan is captured on that stream, reusing the same pool blocks at fixed addresses. A
launch that fails while capturing (CuPy refuses an operation, cuDNN cannot be captured, ...) is
reported by node and reason and the capture starts again without it: the plan is cut into
*segments*, maximal runs of capturable launches, each captured as its own CUDA graph, with the
launches that cannot be captured run eagerly between them. An eager launch is replayed from the
environment it saw while capturing (its inputs are the graphs' fixed buffers) and its outputs are
copied into the buffers the later graphs read. Later runs copy the feeds into the static inputs,
replay the segments on CuPy's current stream, and return copies of the outputs.

With ``conv_exec.FENCE == "edges"`` (:func:`~convpass.kernels.conv_exec.fence_needed`), each
captured graph with programmatic edges (a kernel allowed to start before its producer ends) is
replaced by a copy whose edges are all default ones (:mod:`convpass.native.cuda_graph_edges`),
instantiated and replayed in CuPy's graph's place; the status says how many edges, the counter
``programmatic_edges_rewritten`` counts them. Where the driver cannot, the plan keeps fences.

The first replay is checked against the warm-up (:func:`first_replay_differs`, the backend's
``check_first_run``): a graph whose outputs differ from its eager launches' is dropped, with a
warning, and the plan runs eagerly from then on.

Nothing is silent: :meth:`CompiledPlan.graph_status` says "yes" only when the whole plan is one
graph; otherwise which node stopped it and why, and the backend warns once
(:class:`~convpass.native.cuda.ExecutorWarning`). A plan with a data-dependent output shape (NonZero) runs
eagerly as a whole: its shapes change between runs, so no graph can hold it.

``cuda_graph=False``: always eager (same launches). Eager runs are bound by host time: cuDNN 9's
legacy API costs about 0.1 ms of host time per convolution call, which replaying removes.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from convpass.core.errors import ExecutorError
from convpass.kernels import conv_exec
from convpass.kernels.launch import Launch
from convpass.kernels.plan import GraphStatus, unshare_outputs
from convpass.native import cuda_graph_edges
from convpass.native.cuda import CaptureBreak, first_line, quiet_for_capture

logger = logging.getLogger("convpass")

__all__ = ["REPLAY_TOLERANCE", "CompiledPlan", "first_replay_differs", "replay_whole", "run_plan"]

_MAX_CAPTURE_ATTEMPTS = 8
# relative difference allowed between a captured plan's first replay and its eager warm-up, by the
# outputs' item size: the same launches, so only kernels that sum in another order may differ
REPLAY_TOLERANCE = {2: 1e-2, 4: 1e-3}


@dataclasses.dataclass
class _EagerPart:
    """A launch replayed eagerly between graph segments (module docstring)."""

    index: int  # step
    env: list[Any]  # the environment it ran in while capturing
    outputs: list[Any]  # its outputs then: the buffers later graphs read


@dataclasses.dataclass
class CompiledPlan:
    """What :meth:`CudaBackend.compile_plan` keeps in ``plan.backend_state``."""

    launches: list[Launch | None]  # per step: the launch that runs at it (None: absorbed or nothing)
    free: list[tuple[int, ...]]  # per step: slots released after it
    capturable: bool
    mode: str  # "graph" (warm-up pending or captured), "segmented", "eager"
    note: str = ""
    break_node: str = ""  # the node that kept the plan from being one graph
    uncapturable: set[int] = dataclasses.field(default_factory=set)  # steps run eagerly between graphs
    segments: list[Any] | None = None  # after capture: graphs and _EagerParts, in order
    stream: Any = None
    pool: Any = None
    static_inputs: dict[str, Any] | None = None
    outputs: list[Any] | None = None
    replays: int = 0
    compilations_from: int | None = None  # until the first run ends: prebuilt.COMPILATIONS' length when the plan's recording run began

    @property
    def captured(self) -> bool:
        """The whole plan replays as one CUDA graph."""
        return self.segments is not None and len(self.segments) == 1 and not isinstance(self.segments[0], _EagerPart)

    @property
    def graph(self) -> Any:
        return self.segments[0] if self.captured else None

    def graph_status(self, cuda_graph: bool) -> GraphStatus:
        if not cuda_graph:
            return GraphStatus(None, "cuda_graph=False")
        if self.captured:
            return GraphStatus(True, self.note)
        if self.mode in ("eager", "segmented"):
            return GraphStatus(False, self.note, self.break_node)
        return GraphStatus(None, "not captured yet: the plan is built, its warm-up and capture come with its first run")

    def launch_list(self) -> list[Launch]:
        return [launch for launch in self.launches if launch is not None]


def _run_launch(launch: Launch, env: list[Any]) -> None:
    try:
        launch.run(env)
    except (CaptureBreak, ExecutorError):
        raise
    except (ValueError, IndexError, TypeError) as e:
        raise ExecutorError(f"node {launch.node.name!r} ({launch.node.op_type}, run as {launch.label}) failed: {e}") from None


def _run_eager(rt: Any, state: CompiledPlan, env: list[Any]) -> None:
    """Run every step on ``env`` eagerly, with per-launch CUDA events when ``rt.step_events`` is set
    (only around launches of ``rt.step_event_ops`` when that is set: fewer events keep a long run
    within the stream's launch queue)."""
    timing = rt.step_events
    only = getattr(rt, "step_event_ops", None)
    cp = rt.cp
    for i, launch in enumerate(state.launches):
        if launch is not None:
            timed = timing is not None and (only is None or launch.node.op_type in only)
            if timed:
                begin = cp.cuda.Event()
                begin.record()
            _run_launch(launch, env)
            if timed:
                end = cp.cuda.Event()
                end.record()
                timing.append((launch.label, launch.node.op_type, begin, end, launch.node.name))
        for s in state.free[i]:
            env[s] = None


def run_plan(rt: Any, plan: Any, feeds: dict[str, Any]) -> list[Any]:
    """Run a compiled plan (module docstring)."""
    state: CompiledPlan = plan.backend_state
    if state.segments is not None:
        return _replay(rt, plan, state, feeds)
    if state.capturable:
        return _warm_up_and_capture(rt, plan, state, feeds)
    env = list(plan.template)
    for name, s in plan.feed_slots.items():
        env[s] = feeds[name]
    _run_eager(rt, state, env)
    return unshare_outputs([env[s] for s in plan.output_slots], plan, feeds)


def replay_whole(rt: Any, plan: Any, feeds: dict[str, Any]) -> list[Any] | None:
    """Replay a plan captured as one CUDA graph; None for any other plan. Such a replay runs no
    launch on the host, so the caller needs none of the host-side settings eager launches read
    (the matmul math mode): on a batch-1 model those cost more host time than the replay itself."""
    state = plan.backend_state
    if state is None or not state.captured:
        return None
    return _replay(rt, plan, state, feeds)


def _replay(rt: Any, plan: Any, state: CompiledPlan, feeds: dict[str, Any]) -> list[Any]:
    cp = rt.cp
    stream = cp.cuda.get_current_stream()
    for name, buf in state.static_inputs.items():
        src = feeds[name]
        if src is not buf:
            _copy(cp, buf, src, stream)
    _launch_segments(cp, state, stream)
    state.replays += 1
    rt.counters["graph_replays"] += 1
    return [_copy(cp, cp.empty(o.shape, dtype=o.dtype), o, stream) if o.flags.c_contiguous else o.copy() for o in state.outputs]


def _launch_segments(cp: Any, state: CompiledPlan, stream: Any) -> None:
    """Replay the captured segments on ``stream``, the eager launches between them as they ran."""
    for seg in state.segments:
        if isinstance(seg, _EagerPart):
            env = list(seg.env)
            _run_launch(state.launches[seg.index], env)
            for slot, static in zip(state.launches[seg.index].outputs, seg.outputs):
                if slot >= 0 and env[slot] is not static:
                    cp.copyto(static, env[slot])
        else:
            seg.launch(stream)


def first_replay_differs(rt: Any, state: CompiledPlan, warm: list[Any]) -> str | None:
    """Why the captured plan's first replay is not to be trusted, or None: it is replayed once on
    the warm-up's inputs (still in its static input buffers) and each floating-point output is
    compared with the eager warm-up's ``warm`` (normwise, sums in float64): a relative difference
    above :data:`REPLAY_TOLERANCE` for its item size, or a non-finite one where the warm-up's is
    finite, is a graph that computes something else than its launches did (a library call that
    does not replay as it ran). Costs one replay and one host synchronization, once per plan;
    skipped (None) without the backend's ``check_first_run``."""
    if not getattr(rt, "check_first_run", False):
        return None
    from convpass.kernels.engine_check import relative_error

    cp = rt.cp
    _launch_segments(cp, state, cp.cuda.get_current_stream())
    for i, (a, b) in enumerate(zip(warm, state.outputs)):
        kind = getattr(getattr(a, "dtype", None), "kind", "")
        if kind != "f" or getattr(b, "shape", None) != a.shape or a.size == 0:
            continue
        tol = REPLAY_TOLERANCE[4 if a.dtype.itemsize >= 4 else 2]
        err = relative_error(cp, b, a)
        if not err <= tol:
            return f"output {i} of the captured graph's first replay differs from the eager warm-up's by a relative error of {err:.2e} (> {tol:.0e})"
    return None


def _copy(cp: Any, dst: Any, src: Any, stream: Any) -> Any:
    """``dst[...] = src``: one device-to-device memcpy where both are C-contiguous arrays of one
    shape and dtype on the device (CuPy's ``copyto`` and ``copy`` check and dispatch for longer
    than a small copy takes), else ``cupy.copyto``."""
    if (isinstance(src, cp.ndarray) and src.dtype == dst.dtype and src.shape == dst.shape and src.flags.c_contiguous
            and dst.flags.c_contiguous and src.device == dst.device):
        if src.nbytes:
            dst.data.copy_from_device_async(src.data, src.nbytes, stream)
    else:
        cp.copyto(dst, src)
    return dst


def _warm_up(rt: Any, plan: Any, state: CompiledPlan, static: dict[str, Any]) -> list[Any]:
    """The eager warm-up run (module docstring); marks launches that need the host."""
    env = list(plan.template)
    for name, s in plan.feed_slots.items():
        env[s] = static[name]
    for i, launch in enumerate(state.launches):
        if launch is not None:
            before = (rt.host_syncs, rt.uploads)
            _run_launch(launch, env)
            after = (rt.host_syncs, rt.uploads)
            if after != before:
                what = []
                if after[0] != before[0]:
                    what.append(f"{after[0] - before[0]} device -> host copies")
                if after[1] != before[1]:
                    what.append(f"{after[1] - before[1]} uploads")
                _mark(state, i, f"needs the host while running ({', '.join(what)})")
        for s in state.free[i]:
            env[s] = None
    return [env[s] for s in plan.output_slots]


def _mark(state: CompiledPlan, index: int, reason: str) -> None:
    node = state.launches[index].node
    state.uncapturable.add(index)
    if not state.break_node:
        state.break_node = node.name
        state.note = f"node {node.name!r} ({node.op_type}) {reason}"


def _capture(rt: Any, plan: Any, state: CompiledPlan, static: dict[str, Any], stream: Any) -> tuple[list[Any], list[Any]] | int:
    """Capture the plan as segments; returns (segments, outputs) or the step whose launch failed."""
    env = list(plan.template)
    for name, s in plan.feed_slots.items():
        env[s] = static[name]
    segments: list[Any] = []
    n = len(state.launches)
    i = 0
    while i < n:
        if i in state.uncapturable:
            launch = state.launches[i]
            snapshot = list(env)
            _run_launch(launch, env)
            segments.append(_EagerPart(i, snapshot, [env[s] if s >= 0 else None for s in launch.outputs]))
            for s in state.free[i]:
                env[s] = None
            i += 1
            continue
        stop = i
        while stop < n and stop not in state.uncapturable:
            stop += 1
        rt.capturing = True
        try:
            with quiet_for_capture():
                failed, error, graph = _capture_segment(rt, state, env, stream, i, stop)
        finally:
            rt.capturing = False
        if error is not None and not isinstance(error, Exception):
            raise error  # KeyboardInterrupt and the like
        if failed is not None:
            _mark(state, failed, f"cannot be captured: {first_line(error)}")
            return failed
        if graph is None or error is not None:
            # the capture as a whole was refused: blame the segment's first launch
            first = next(k for k in range(i, stop) if state.launches[k] is not None)
            _mark(state, first, f"capture failed: {first_line(error) if error else 'no graph'}")
            return first
        upload = getattr(graph, "upload", None)
        if upload is not None:
            try:
                upload(stream)
            except Exception:  # noqa: BLE001  (an optimization only)
                pass
        segments.append(graph)
        i = stop
    return segments, [env[s] for s in plan.output_slots]


def _capture_segment(rt: Any, state: CompiledPlan, env: list[Any], stream: Any, start: int, stop: int) -> tuple[int | None, BaseException | None, Any]:
    """Capture launches ``start`` to ``stop`` on ``stream``: (the step that failed, the error, the graph)."""
    failed, error, graph = None, None, None
    stream.begin_capture()
    try:
        for k in range(start, stop):
            launch = state.launches[k]
            if launch is not None:
                try:
                    _run_launch(launch, env)
                except BaseException as e:  # noqa: BLE001  (end the capture whatever happened)
                    failed, error = k, e
                    break
            for s in state.free[k]:
                env[s] = None
    finally:
        rt.capturing = False
        try:
            graph = stream.end_capture()
        except Exception as e:  # noqa: BLE001
            graph = None
            if error is None:
                error = e
    return failed, error, graph


def _warm_up_and_capture(rt: Any, plan: Any, state: CompiledPlan, feeds: dict[str, Any]) -> list[Any]:
    cp = rt.cp
    current = cp.cuda.get_current_stream()
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    stream.wait_event(current.record())
    with cp.cuda.using_allocator(pool.malloc), stream:
        static = {name: cp.empty(tuple(feeds[name].shape), dtype=feeds[name].dtype) for name in plan.feed_slots}
        for name, buf in static.items():
            cp.copyto(buf, feeds[name])
        outs = _warm_up(rt, plan, state, static)
    current.wait_event(stream.record())
    results = [o.copy() for o in outs]  # on the caller's stream and pool
    del outs
    captured = _capture_plan(rt, plan, state, static, stream, pool)
    if captured is not None and conv_exec.FENCE == "edges":
        captured = _default_edges(rt, plan, state, static, stream, pool, captured)
    if captured is None:
        state.mode = "eager"
        state.capturable = False
        state.note = (state.note or "CUDA graph capture failed") + ": plan runs eagerly"
        rt.warn_capture(state.note)
        return results
    segments, outputs = captured
    current.wait_event(stream.record())
    state.segments = segments
    state.outputs = outputs
    state.static_inputs = static
    state.stream = stream
    state.pool = pool
    why = first_replay_differs(rt, state, results)
    if why is not None:  # the eager launches are the plan's meaning: they run from now on
        _close(segments)
        state.segments = state.outputs = state.static_inputs = state.stream = state.pool = None
        state.mode = "eager"
        state.capturable = False
        state.note = f"{why}: plan runs eagerly"
        rt.warn_capture(state.note)
        return results
    launches = len(state.launch_list())
    if state.uncapturable:
        graphs = sum(1 for s in segments if not isinstance(s, _EagerPart))
        state.mode = "segmented"
        state.note += f": {graphs} CUDA graph(s) with {len(state.uncapturable)} launch(es) run eagerly between them"
        rt.warn_capture(state.note)
    else:
        state.mode = "graph"
        state.note = f"{launches} launch(es) in one CUDA graph"
    edges = sum(getattr(s, "rewritten", 0) for s in segments if not isinstance(s, _EagerPart))
    if edges:
        state.note += f", {edges} programmatic edge(s) made default"
    logger.debug("cuda graph: %s", state.note)
    return results


def _capture_plan(rt: Any, plan: Any, state: CompiledPlan, static: dict[str, Any], stream: Any, pool: Any) -> tuple[list[Any], list[Any]] | None:
    """The plan captured (:func:`_capture`), a launch that cannot be captured left out at each
    attempt; None where no attempt succeeded."""
    cp = rt.cp
    for _ in range(_MAX_CAPTURE_ATTEMPTS):
        if len(state.uncapturable) >= sum(1 for launch in state.launches if launch is not None):
            return None
        with cp.cuda.using_allocator(pool.malloc), stream:
            attempt = _capture(rt, plan, state, static, stream)
        if not isinstance(attempt, int):
            return attempt
        try:
            stream.synchronize()
        except Exception:  # noqa: BLE001
            pass
    return None


def _default_edges(rt: Any, plan: Any, state: CompiledPlan, static: dict[str, Any], stream: Any, pool: Any,
                   captured: tuple[list[Any], list[Any]]) -> tuple[list[Any], list[Any]] | None:
    """With ``conv_exec.FENCE == "edges"`` (:func:`~convpass.kernels.conv_exec.fence_needed`): each
    captured graph that has programmatic edges replaced by its copy with default ones
    (:func:`convpass.native.cuda_graph_edges.rewritten`), the edges counted in
    ``programmatic_edges_rewritten``. Where the driver cannot, the fused launches were captured
    with fences and the graphs stay as captured; where a call fails, no rewrite is tried again in
    this process and the plan is captured again, with fences. Either is warned once."""
    why = cuda_graph_edges.unavailable_reason()
    if why is not None:
        rt.warn_capture(f"programmatic edges are not made default ({why}): fused engine launches are fenced with a memset")
        return captured
    segments, outputs = captured
    out: list[Any] = []
    try:
        for seg in segments:
            new = None if isinstance(seg, _EagerPart) else cuda_graph_edges.rewritten(seg)
            out.append(seg if new is None else new)
    except (cuda_graph_edges.EdgesUnavailable, cuda_graph_edges.DriverError) as e:
        _close(out)
        cuda_graph_edges.disable(f"an earlier rewrite failed: {e}")
        rt.warn_capture(f"programmatic edges could not be made default ({e}): fused engine launches are fenced with a memset, "
                        "the plan captured again")
        return _capture_plan(rt, plan, state, static, stream, pool)
    for seg in out:
        if isinstance(seg, cuda_graph_edges.DefaultEdgeGraph):
            rt.counters["programmatic_edges_rewritten"] += seg.rewritten
            try:
                seg.upload(stream)
            except cuda_graph_edges.DriverError:  # an optimization only
                pass
    return out, outputs


def _close(segments: list[Any]) -> None:
    """Free the driver objects of the graphs made here (CuPy's free their own when collected)."""
    for seg in segments:
        if isinstance(seg, cuda_graph_edges.DefaultEdgeGraph):
            seg.close()

"""What the cuda backend's runner reports about a compiled plan (convpass.runtime.cuda.runner), and
how it and the tuner's harness capture (no garbage collection inside), on CPU.

The capture itself needs a GPU (tests/gpu/test_kernels.py); the report a user sees, and how the
warm-up marks a launch that needs the host, are plain logic.
"""

from __future__ import annotations

import gc
import threading
import types

import pytest

from convpass.kernels.launch import Launch
from convpass.ops.registry import NodeInfo
from convpass.runtime.cuda import runner


def _launch(name: str, op: str, step: int) -> Launch:
    return Launch(step, NodeInfo(name, op, "", 17, {}, ["a"], ["b"]), op, (step,))


def _state(**kw) -> runner.CompiledPlan:
    launches = [_launch("c", "Conv", 0), _launch("nz", "NonZero", 1), _launch("r", "Relu", 2)]
    return runner.CompiledPlan(launches=launches, free=[(), (), ()], **kw)


def test_status_before_capture_eager_and_off():
    state = _state(capturable=True, mode="graph")
    status = state.graph_status(cuda_graph=True)
    assert status.captured is None and "warm-up" in status.reason
    assert _state(capturable=False, mode="eager").graph_status(cuda_graph=False).describe() == "CUDA graph: n/a (cuda_graph=False)"


def test_a_launch_that_needs_the_host_is_named_once():
    state = _state(capturable=True, mode="graph")
    runner._mark(state, 1, "needs the host while running (1 device -> host copies)")
    runner._mark(state, 2, "cannot be captured: whatever")
    assert state.uncapturable == {1, 2}
    # the first node that broke the graph is the one the report names
    assert state.break_node == "nz" and state.note == "node 'nz' (NonZero) needs the host while running (1 device -> host copies)"
    state.mode = "segmented"
    status = state.graph_status(cuda_graph=True)
    assert status.captured is False and status.node == "nz" and status.describe().startswith("CUDA graph: no (node 'nz' (NonZero)")


def test_one_graph_is_captured_and_segments_are_not():
    state = _state(capturable=True, mode="graph", note="3 launch(es) in one CUDA graph")
    state.segments = [object()]
    assert state.captured and state.graph is state.segments[0]
    assert state.graph_status(cuda_graph=True).describe() == "CUDA graph: yes (3 launch(es) in one CUDA graph)"
    state.segments = [object(), runner._EagerPart(1, [], []), object()]
    assert not state.captured and state.graph is None


class _Stream:
    def __init__(self):
        self.calls = []

    def begin_capture(self):
        self.calls.append("begin")

    def end_capture(self):
        self.calls.append("end")
        return types.SimpleNamespace()  # a graph (no upload)


class _WatchedLaunch:
    """Records whether Python's garbage collector could run while it was captured."""

    def __init__(self, step: int):
        self.node = NodeInfo(f"n{step}", "Relu", "", 17, {}, ["a"], ["b"])
        self.label, self.outputs, self.collector = "Relu", (step + 1,), []

    def run(self, env):
        self.collector.append(gc.isenabled())
        env[self.outputs[0]] = env[self.outputs[0] - 1]


def test_no_garbage_collection_runs_inside_a_capture():
    """A collection inside a capture may free an older plan's device memory or library handles,
    which invalidates the capture: the collector is paused while the stream captures, and
    restored after, also when a launch fails."""
    launches = [_WatchedLaunch(0), _WatchedLaunch(1)]
    state = runner.CompiledPlan(launches=launches, free=[(), ()], capturable=True, mode="graph")
    plan = types.SimpleNamespace(template=[None, None, None], feed_slots={"x": 0}, output_slots=[2])
    rt, stream = types.SimpleNamespace(capturing=False), _Stream()
    assert gc.isenabled()
    segments, outputs = runner._capture(rt, plan, state, {"x": "X"}, stream)
    assert [launch.collector for launch in launches] == [[False], [False]]
    assert gc.isenabled() and not rt.capturing and stream.calls == ["begin", "end"] and outputs == ["X"] and len(segments) == 1

    def fail(env):
        raise RuntimeError("cuBLAS status 14")

    launches[1].run = fail
    assert runner._capture(rt, plan, state, {"x": "X"}, _Stream()) == 1
    assert gc.isenabled() and state.uncapturable == {1} and "status 14" in state.note


def test_a_capture_waits_for_the_helper_threads():
    """A helper thread's CUDA calls (cuDNN queries ahead of a plan) must not fall inside a capture."""
    from convpass.native import cuda as common

    release, done = threading.Event(), []

    def helper():
        release.wait(5)
        done.append(True)

    common.start_helper(helper, "test-helper")
    threading.Timer(0.05, release.set).start()
    launch = _WatchedLaunch(0)
    launch.run = lambda env: launch.collector.append(list(done))
    state = runner.CompiledPlan(launches=[launch], free=[()], capturable=True, mode="graph")
    plan = types.SimpleNamespace(template=[None, None], feed_slots={"x": 0}, output_slots=[1])
    runner._capture(types.SimpleNamespace(capturing=False), plan, state, {"x": "X"}, _Stream())
    assert launch.collector == [[True]]


def test_the_tuners_timing_graphs_are_captured_without_garbage_collection():
    from convpass.tuning import harness

    seen = []
    graph = harness._capture(lambda i: seen.append(gc.isenabled()), sets=2, count=3, stream=_Stream())
    assert graph is not None and seen == [False, False, False] and gc.isenabled()


class _FakeGpu:
    """A GPU whose every launch takes ``ms``: events read its clock, captured graphs replay their launches."""

    def __init__(self, ms: float, latency: float = 0.0):
        # latency: the time from an event to the first graph replay after it (a graph's launch latency)
        self.ms, self.clock, self.capturing, self.latency, self.pending = ms, 0.0, None, latency, 0.0
        gpu = self

        class Event:
            def record(self):
                self.t = gpu.clock
                gpu.pending = gpu.latency

            def synchronize(self):
                pass

        class Stream:
            def begin_capture(self):
                gpu.capturing = 0

            def end_capture(self):
                n, gpu.capturing = gpu.capturing, None
                def replay(stream):
                    gpu.clock += gpu.pending + n * gpu.ms
                    gpu.pending = 0.0

                return types.SimpleNamespace(launch=replay, upload=lambda stream: None)

            def synchronize(self):
                pass

        stream = Stream()
        self.cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
            Event=Event, get_current_stream=lambda: stream, get_elapsed_time=lambda a, b: b.t - a.t))

    def launch(self, i: int) -> None:
        if self.capturing is None:
            self.clock += self.ms
        else:
            self.capturing += 1


def test_the_tuner_stops_a_candidate_clearly_slower_than_the_best_after_its_estimate(monkeypatch):
    """Over 1.5x the best and 2 us above it: stopped after the estimate (not a close call); over
    1.15x, after its first two groups; within 1.15x, or a tiny kernel within 2 us, timed in full."""
    from convpass.tuning import harness

    gpus = []

    def timing(ms: float, best_ms: float, **kwargs) -> harness.Timing:
        gpus.append(_FakeGpu(ms))
        monkeypatch.setattr(harness, "cupy", lambda: gpus[-1].cupy)
        return harness.time_launches(gpus[-1].launch, sets=4, best_ms=best_ms, **kwargs)

    slow = timing(0.016, best_ms=0.010)
    # a small kernel's estimate is confirmed by 8 replays of its 4-launch graph
    assert slow.early_stop and abs(slow.time_ms - 0.016) < 1e-9 and slow.launches == 5 + 32
    assert slow.stopped_by == "estimate over 1.5x the best"
    # the GPU ran the warm-up, the estimate's 4 launches and their confirmation: that graph is
    # uploaded, not replayed untimed first
    assert abs(gpus[-1].clock - 37 * 0.016) < 1e-9
    big = timing(0.16, best_ms=0.10)  # a graph over CONFIRM_GRAPH_MS: taken again from one more replay
    assert big.early_stop and big.launches == 9 and abs(gpus[-1].clock - 9 * 0.16) < 1e-9
    far = timing(0.04, best_ms=0.010)  # over CONFIRM_RATIO times the best and the latency: not taken again
    assert far.early_stop and far.launches == 5
    later = timing(0.014, best_ms=0.010)
    # a measurement from two groups, not an estimate
    assert not later.early_stop and abs(later.time_ms - 0.014) < 1e-9 and later.stopped_by == "2 groups over 1.15x the best"
    close = timing(0.011, best_ms=0.010)
    assert not close.early_stop and abs(close.time_ms - 0.011) < 1e-9 and close.launches > later.launches
    tiny = timing(0.0025, best_ms=0.001)  # 2.5x, but 1.5 us: the estimate's own latency could be that
    assert not tiny.early_stop
    assert timing(0.0035, best_ms=0.001).early_stop
    # the caller's own first launch of set 0 stands in for the warm-up: the GPU runs one launch fewer
    timing(0.016, best_ms=0.010)
    warmed_here = gpus[-1].clock
    timing(0.016, best_ms=0.010, first_ms=0.016)
    assert abs(warmed_here - gpus[-1].clock - 0.016) < 1e-9


def test_a_graphs_launch_latency_does_not_stop_a_tiny_kernel(monkeypatch):
    """A 2.3 us kernel behind 8.5 us of graph launch latency reads 4.4 us from one replay of its
    4-launch graph (as an H100 read one), over 1.5x the best (2.3 us) and 2 us above it; its
    eight confirming replays read 2.6 us: it is timed in full. A kernel really that slow is still
    stopped."""
    from convpass.tuning import harness

    gpu = _FakeGpu(0.0023, latency=0.0085)
    monkeypatch.setattr(harness, "cupy", lambda: gpu.cupy)
    timing = harness.time_launches(gpu.launch, sets=4, best_ms=0.0023)
    assert not timing.early_stop and not timing.stopped_by
    gpu = _FakeGpu(0.0044, latency=0.0085)
    monkeypatch.setattr(harness, "cupy", lambda: gpu.cupy)
    timing = harness.time_launches(gpu.launch, sets=4, best_ms=0.0023)
    assert timing.early_stop and timing.time_ms == pytest.approx(0.0044 + 0.0085 / 32)


def test_a_one_launch_estimate_is_confirmed_before_it_stops_a_candidate(monkeypatch):
    """A batch-32 problem rotates one input set: its estimate is one replay of a one-launch graph.
    An H200 read ResNet-50's fused 1x1 stride-2 conv with its residual (0.046 ms in full) as 0.171 ms
    from that replay, over 1.5x the best (0.0957 ms: the bare conv and its pass), and stopped it;
    eight replays back to back read 0.062 ms, and it is timed in full. A candidate that slow in
    full is still stopped (after one more replay, its graph being longer)."""
    from convpass.tuning import harness

    gpu = _FakeGpu(0.0464, latency=0.125)
    monkeypatch.setattr(harness, "cupy", lambda: gpu.cupy)
    timing = harness.time_launches(gpu.launch, sets=1, best_ms=0.0957)
    assert not timing.early_stop and not timing.stopped_by  # (this stand-in GPU adds the latency to every group)
    gpu = _FakeGpu(0.15, latency=0.125)  # a graph of 0.275 ms: taken again from one more replay
    monkeypatch.setattr(harness, "cupy", lambda: gpu.cupy)
    timing = harness.time_launches(gpu.launch, sets=1, best_ms=0.0957)
    assert timing.early_stop and timing.launches == 3 and timing.time_ms == pytest.approx(0.275)


def test_a_slow_first_launch_gets_one_more_before_any_group(monkeypatch):
    """A first launch over 4x the best (and 2 ms) is launched once more; still over 4x: stopped there."""
    from convpass.tuning import harness

    gpu = _FakeGpu(10.0)
    monkeypatch.setattr(harness, "cupy", lambda: gpu.cupy)
    stopped = harness.time_launches(gpu.launch, sets=4, best_ms=1.0, first_ms=10.0)
    assert stopped.early_stop and stopped.stopped_by == "a second launch over 4x the best and 2 ms" and gpu.clock == 10.0
    assert stopped.launches == 2


def test_a_second_launch_still_loading_does_not_stop_a_fast_kernel(monkeypatch):
    """A 6.4 us kernel whose first launch took 3 ms and whose second still 0.39 ms (as an H100 timed
    one, the best of its geometry: the best so far was 12.7 us) is judged by its graph estimate and
    timed in full, not stopped as over 4x the best."""
    from convpass.tuning import harness

    gpu = _FakeGpu(0.0064)
    loading = [0.3855]

    def launch(i: int) -> None:
        if gpu.capturing is None and loading:
            gpu.clock += loading.pop()
        else:
            gpu.launch(i)

    monkeypatch.setattr(harness, "cupy", lambda: gpu.cupy)
    timing = harness.time_launches(launch, sets=4, best_ms=0.0127, first_ms=3.0)
    assert not timing.early_stop and not timing.stopped_by and abs(timing.time_ms - 0.0064) < 1e-9


def test_a_full_timing_keeps_its_group_and_close_candidates_are_replayed_in_turn(monkeypatch):
    """The group a full timing replayed comes back with it (an early stop has none); the
    head-to-head replays each candidate's group in turn, round after round, and takes each one's
    median per-launch time: a GPU drifting slower carries into the comparison only the drift between
    two adjacent replays, not that of a whole timing."""
    from convpass.tuning import harness

    gpu = _FakeGpu(0.010)
    monkeypatch.setattr(harness, "cupy", lambda: gpu.cupy)
    full = harness.time_launches(gpu.launch, sets=4, best_ms=0.010)
    assert full.group_launches == 100  # a group of about group_ms (1 ms), not the 4-launch estimate's
    before = gpu.clock
    full.group.launch(None)
    assert gpu.clock - before == pytest.approx(100 * 0.010)
    assert harness.time_launches(gpu.launch, sets=4, best_ms=0.001).group is None  # stopped early

    order, slow = [], [1.0]

    def group(name: str, ms: float, launches: int):
        def launch(stream):
            order.append(name)
            gpu.clock += launches * ms * slow[0]
            slow[0] *= 1.02  # the GPU drifts slower with every replay
        return types.SimpleNamespace(launch=launch), launches

    turns = harness.head_to_head([group("a", 0.0100, 50), group("b", 0.0102, 20)], rounds=5)
    assert order == ["a", "b"] * 5
    # each round's b follows its a by one replay: 2% slower, as b really is here, plus 2% drift
    assert turns[1] / turns[0] == pytest.approx(1.02 * 1.02, rel=1e-9)

"""A fleet task is one geometry's problems (the same conv with different epilogues), so that every
decision compares rows that one worker measured: in two 2-H200 fleet checks (2026-11-27) an r3d_18
conv read 20% faster in the tasks one GPU ran than in the other's, and a problem whose bare conv came
from one GPU's task and its fused call from the other's was decided 1.065-1.08x off. The grouping (fleet.models.Geometries), the
scheduler's rules for a task that replaces an earlier one, the driver's settling of problems that
two tasks measure, and the measurer's one-after-the-other measuring with the earlier rows standing."""

from __future__ import annotations

import types

from recorded import H200

from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem, ConvShape
from convpass.fleet import driver
from convpass.fleet import models as fleet_models
from convpass.fleet import scheduler as sched
from convpass.fleet.measurers import CudnnMeasurer
from convpass.fleet.model_procs import ModelSpec
from convpass.fleet.report import FleetReport
from convpass.tuning.cache_rows import Measurement

A = ConvShape("fwd", 1, 64, 64, (14, 14), (3, 3), (1, 1), (1, 1), (1, 1))
B = ConvShape("fwd", 32, 64, 64, (14, 14), (3, 3), (1, 1), (1, 1), (1, 1))
C = ConvShape("fwd", 1, 64, 128, (14, 14), (1, 1), (0, 0), (1, 1), (1, 1))


def row(shape: ConvShape, algo: str = "implicit_gemm") -> Measurement:
    return Measurement(shape.key("nhwc", "default"), algo, "ok", 0.01, 0, True, 1.0, "measure")


def test_the_problems_of_one_geometry_are_one_group_and_a_later_one_takes_the_earlier_in():
    g = fleet_models.Geometries()
    relu, plain, other = ConvProblem((A,), "bias+relu"), ConvProblem((A,), "bias"), ConvProblem((C,), "bias")
    assert g.add([relu, other, plain]) == [((relu, plain), []), ((other,), [])]
    add = ConvProblem((A,), "bias+add+relu")
    assert g.add([add, ConvProblem((B,))]) == [((relu, plain, add), [(relu, plain)]), ((ConvProblem((B,)),), [])]
    # a problem whose candidates (a mapping) meet two groups joins them
    bridge = ConvProblem((C, B), "bias")
    assert g.add([bridge]) == [((other, ConvProblem((B,)), bridge), [(other,), (ConvProblem((B,)),)])]


class _Executor:
    name = "stand-in"

    def __init__(self):
        self.submitted: list[tuple[str, int]] = []

    def submit(self, slot_id, task, options):
        self.submitted.append((slot_id, task.id))

    def stop(self):
        pass


class _Cache:
    def __init__(self):
        self.puts: list[list[str]] = []
        self.replaced: list[set] = []

    def put(self, device, rows, forget=()):
        self.puts.append([m.algo for m in rows])
        self.replaced.append({algo for _, algo, _ in forget})


def _run():
    executor, cache, settled = _Executor(), _Cache(), []
    scheduler = sched.Scheduler(executor, cache, TuneOptions(), on_settled=lambda t, f: settled.append((t.id, f)))
    slots = [sched.Slot("a", H200, "a"), sched.Slot("b", H200, "b")]
    return sched._Run(scheduler, [], slots, [], None), executor, cache, settled


def test_a_task_replacing_a_running_one_waits_for_it_and_its_rows_are_written_last():
    run, executor, cache, settled = _run()
    p, q, r = ConvProblem((A,), "bias"), ConvProblem((A,), "bias+relu"), ConvProblem((C,))
    run.add([sched.Task(0, H200, (r,)), sched.Task(1, H200, (p,))])
    run.assign()
    assert executor.submitted == [("a", 0), ("b", 1)]
    run.add([sched.Task(2, H200, (p, q), replaces=(1,))])
    run.handle(sched.Finished("a", 0, [row(C)], 0.1))
    run.flush()
    run.assign()
    assert executor.submitted == [("a", 0), ("b", 1)]  # slot a is free, but task 1 still runs
    run.handle(sched.Finished("b", 1, [row(A, "old")], 0.1))
    run.flush()
    run.assign()
    assert executor.submitted[-1][1] == 2
    run.handle(sched.Finished(executor.submitted[-1][0], 2, [row(A, "new")], 0.1))
    run.flush()
    assert cache.puts == [["implicit_gemm"], ["old"], ["new"]]
    assert cache.replaced == [set(), set(), {"old"}]  # task 1's rows that task 2 did not take again go
    assert settled == [(0, True), (1, True), (2, True)] and run.result.superseded == {}


def test_a_task_waits_for_every_earlier_task_of_its_geometry_that_runs():
    """Task 1 runs; task 2 replaces it and waits; task 3 replaces both (the driver names every
    earlier task of the geometry): task 2 is dropped, task 3 still waits for task 1."""
    run, executor, cache, settled = _run()
    p, q, r = ConvProblem((A,), "bias"), ConvProblem((A,), "bias+relu"), ConvProblem((A,), "bias+add+relu")
    run.add([sched.Task(1, H200, (p,))])
    run.assign()
    run.add([sched.Task(2, H200, (p, q), replaces=(1,))])
    run.add([sched.Task(3, H200, (p, q, r), replaces=(2, 1))])
    run.assign()
    assert executor.submitted == [("a", 1)] and run.result.superseded == {2: 3}
    run.handle(sched.Finished("a", 1, [row(A)], 0.1))
    run.flush()
    run.assign()
    assert executor.submitted[-1][1] == 3


def test_a_replaced_task_not_started_or_failing_is_dropped_for_its_replacement():
    run, executor, cache, settled = _run()
    p, q = ConvProblem((A,), "bias"), ConvProblem((A,), "bias+relu")
    busy = [sched.Task(0, H200, (ConvProblem((C,)),)), sched.Task(1, H200, (ConvProblem((B,)),))]
    run.add([*busy, sched.Task(2, H200, (p,))])
    run.assign()  # both slots busy: task 2 waits
    run.add([sched.Task(3, H200, (p, q), replaces=(2,))])
    assert run.result.superseded == {2: 3} and settled == [(2, None)]
    assert [t.id for t in run.pending[H200]] == [3]
    # a running task replaced meanwhile that fails is not tried again: its replacement measures it
    run.add([sched.Task(4, H200, (ConvProblem((C,), "bias"),), replaces=(0,))])
    run.handle(sched.Failed("a", 0, "MeasureError: boom"))
    assert run.result.superseded[0] == 4 and settled[-1] == (0, None) and 0 not in run.result.failed
    assert [t.id for t in run.pending[H200]] == [3, 4]


def test_a_problem_two_tasks_measure_settles_with_the_first_that_finishes():
    """The driver's side: a model waiting for a problem completes with the first task of it that
    finished; a task that failed leaves the problem to another still measuring it; a replaced one
    leaves it to its replacement; a problem no task finished is failed."""
    report = FleetReport("stand-in", "c.db", [])
    stream = driver._Stream(report, TuneOptions(), procs=None, started=0.0)
    stream.failed = {H200: set()}
    completed = []
    stream._complete = completed.append
    p, q = ConvProblem((A,), "bias"), ConvProblem((A,), "bias+relu")
    t1, t2 = sched.Task(1, H200, (p,)), sched.Task(2, H200, (p, q), replaces=(1,))
    for t in (t1, t2):
        for x in t.problems:
            stream.pending.add((H200, x))
            stream.covering.setdefault((H200, x), set()).add(t.id)
    stream.waiting = {(H200, p): [0], (H200, q): [1]}
    stream.unsettled = {0: 1, 1: 1}
    stream.settled(t1, False)  # task 2 still measures p
    assert completed == [] and stream.failed[H200] == set()
    stream.settled(t2, True)
    assert completed == [0, 1] and stream.failed[H200] == set()
    # replaced before it started: nothing settles; the replacement fails: the problem is failed
    t3, t4 = sched.Task(3, H200, (q,)), sched.Task(4, H200, (q,), replaces=(3,))
    stream.finished.clear()
    for t in (t3, t4):
        stream.covering.setdefault((H200, q), set()).add(t.id)
    stream.waiting = {(H200, q): [2]}
    stream.unsettled[2] = 1
    stream.settled(t3, None)
    assert 2 not in completed
    stream.settled(t4, False)
    assert completed[-1] == 2 and stream.failed[H200] == {q}
    # failed, then measured by a later task: no longer failed
    t5 = sched.Task(5, H200, (q,))
    stream.covering[(H200, q)] = {5}
    stream.settled(t5, True)
    assert stream.failed[H200] == set()


def test_a_later_model_adding_an_epilogue_to_a_finished_geometry_waits_only_for_what_is_new(tmp_path):
    """Its task measures the geometry again and names every earlier task of it; a problem an earlier
    task finished stays settled, so a failing new task cannot keep the model from being written."""
    from convpass.tuning.cache import TuningCache

    report = FleetReport("stand-in", "c.db", [fleet_models.ModelProblems(ModelSpec(tmp_path / f"m{i}.onnx"), tmp_path / f"m{i}.tuned.onnx")
                                                      for i in range(3)])
    report.devices = [H200]
    stream = driver._Stream(report, TuneOptions(), procs=None, started=0.0)
    completed = []
    stream._complete = completed.append
    p, q, r = ConvProblem((A,), "bias"), ConvProblem((A,), "bias+relu"), ConvProblem((A,), "bias+add+relu")
    measurer = types.SimpleNamespace(complete=lambda *a: False)
    with TuningCache(tmp_path / "c.db") as db:
        stream.begin(db, [H200], measurer)
        for i, problems in enumerate(([p], [p, q], [p, q, r])):
            stream.arrived[i] = types.SimpleNamespace(problems=problems, report=None, shapes=(), notes=[])
            (task,) = stream._release()
            assert task.problems == (p, q, r)[:i + 1] and task.replaces == ((), (0,), (1, 0))[i]
            if i == 0:
                stream.settled(task, True)
        assert completed == [0]
        stream.settled(task, False)  # the last task (p, q, r) fails; task 1 (p, q) was replaced
        stream.settled(sched.Task(1, H200, (p, q), replaces=(0,)), None)
        assert completed == [0, 1, 2] and stream.failed[H200] == {q, r}


def test_the_gpu_measurer_measures_a_geometrys_problems_one_after_the_other(monkeypatch):
    """The later problem gets the earlier ones' rows as the tuner gets the cache's: it adds only
    what its epilogue needs."""
    from convpass.tuning import tuner

    calls = []

    def measure_problem(problem, options, have=()):
        calls.append((problem.fusion, [m.algo for m in have]))
        return [row(A, f"conv for {problem.fusion}")]

    monkeypatch.setattr(tuner, "measure_problem", measure_problem)
    measurer = CudnnMeasurer()
    measurer._stream = _NullStream()
    rows = measurer.measure([ConvProblem((A,), "bias"), ConvProblem((A,), "bias+relu")], TuneOptions())
    assert calls == [("bias", []), ("bias+relu", ["conv for bias"])]
    assert [m.algo for m in rows] == ["conv for bias", "conv for bias+relu"]


class _NullStream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

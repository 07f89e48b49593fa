"""The fleet driver: many models, many GPUs, one tuning cache, one tuned model per input.

1. **Start, and collect meanwhile.** The workers start (:mod:`convpass.fleet.local` or
   :mod:`convpass.fleet.ray_cluster`: spawn, load cuDNN, warm the GPU; each reports the fingerprint
   of the device it measures on) and, beside them, model processes
   (:mod:`convpass.fleet.model_procs`) run the optimize pipeline's graph passes
   (:func:`convpass.compiler.pipeline.prepare_model`) on the models in the order given, several at once
   with several processes. The driver launches both before it imports anything heavy, and it
   never runs graph passes itself: they would hold its interpreter while it hands out tasks.
2. **Target devices,** once every worker started or failed to: every device type in the cluster, or
   those ``devices`` names. A name that matches no worker's device is looked up in the tuning cache
   (e.g. measurements exported on another GPU and merged with ``convpass cache import``): that
   device is *cache-only*, its decisions come from the cache as with ``optimize --device-name`` and
   nothing is measured for it.
3. **Tune while collecting.** Each model, as soon as it is collected (in the order given), adds the
   problems no model before it had, the largest first, as tasks for each measured device whose
   rows the cache does not already cover; the scheduler (:mod:`convpass.fleet.scheduler`) hands
   them out while later models are still being collected, so the progress bar's total grows as
   they come. A problem two models share is measured once. This is :func:`~convpass.fleet.models.tuning_order`,
   taken model by model. The problems of one geometry (the same conv with different epilogues) are one
   task, measured one after the other by one worker (:class:`~convpass.fleet.models.Geometries`; the scheduler's rules
   say why): a later model's problem of a geometry already given comes as a task that measures the
   geometry's earlier problems again with it, and replaces the earlier task where that has not
   started. The driver writes every finished task's rows into its cache as they arrive, so
   an interrupted run keeps them and a re-run measures only the rest.
4. **Write each model as soon as it is collected and all of its tasks are settled** (finished or
   failed), in a model process while the workers measure the other models' problems: atomically,
   with one decision table per target device, decided from the cache by the same rule as
   ``optimize --device-name``; a problem that failed is ``auto`` for that device. Models complete
   one after another in that order, so after the last task only the models it completed
   are left to write, and the process that collected the last model still holds it prepared.
   An interrupted run writes nothing more: the models written before it are complete, the report
   lists which were written and which not.

A model that cannot be prepared (or written) stops the run. Before any task ran, at once: the
workers are stopped while they start, nothing is written. Later, gently: no task starts any more,
those running finish and their rows go to the cache, then the error is raised, saying what the run
kept (problems measured, models written); the same command again measures only what is missing.

Layout: decisions are per conv (``--layout per-conv``, the default here) or one forced format.
``--layout auto`` plans the whole graph with transpose timings that only a GPU in the same process
measures, and the tuning cache does not hold them: it is refused here rather than silently changed.

The models' specs, collection and tuning order are in :mod:`convpass.fleet.models`, the run's
report in :mod:`convpass.fleet.report`. Importing these modules is cheap (no ONNX, onnx-ir or graph
passes): the command line launches the workers first and imports those while they start.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from convpass.core.device import DeviceFingerprint
from convpass.core.errors import ConvpassError, OptionError
from convpass.core.options import TuneOptions
from convpass.fleet import scheduler as sched
from convpass.fleet.measurers import CudnnMeasurer, Measurer
from convpass.fleet.model_procs import Collected, CollectJob, ModelProcesses, ModelSpec, RemoteTraceback, WriteJob, default_count
from convpass.fleet.models import Geometries, ModelProblems, group_order, outputs_of
from convpass.fleet.report import FleetReport

if TYPE_CHECKING:
    from convpass.compiler.pipeline import OptimizeReport
    from convpass.core.problem import ConvProblem
    from convpass.tuning.cache import TuningCache


def resolve_devices(
    names: Sequence[str], slots: Sequence[sched.Slot], not_started: Sequence[str], cache: TuningCache
) -> tuple[list[DeviceFingerprint], list[DeviceFingerprint]]:
    """The target devices (module docstring, step 3), in the order named, and which of them are
    cache-only (no worker measures them)."""
    from convpass.tuning.cache_rows import CacheError

    cluster = list(dict.fromkeys(s.device for s in slots))
    if not names:
        if not cluster:
            why = "; ".join(not_started) or "the cluster has no GPU"
            raise ConvpassError(
                f"no worker started ({why}), so there is no device to tune for; to write models from "
                "measurements the tuning cache holds, name their devices with --devices (e.g. --devices H100,H200)"
            )
        return cluster, []
    targets: list[DeviceFingerprint] = []
    cache_only: list[DeviceFingerprint] = []
    for name in names:
        matches = [d for d in cluster if d.matches_name(name)]
        if not matches:
            try:
                matches = [cache.resolve_device(name)]
            except CacheError as e:
                listing = "; ".join(map(str, cluster)) or "no workers"
                raise ConvpassError(f"--devices {name!r}: no GPU of the cluster matches (cluster: {listing}), and {e}") from None
            cache_only += [d for d in matches if d not in cache_only]
        targets += [d for d in matches if d not in targets]
    return targets, cache_only


def make_executor(cluster: str) -> sched.Executor:
    """``local`` | ``ray`` (``ray.init()``'s default: ``RAY_ADDRESS``, else the cluster last started on
    this machine, else a new local Ray) | ``ray://HOST:PORT``."""
    if cluster == "local":
        from convpass.fleet.local import LocalExecutor

        return LocalExecutor()
    if cluster == "ray" or cluster.startswith("ray://"):
        try:
            from convpass.fleet.ray_cluster import RayExecutor
        except ImportError as e:
            raise OptionError(f"--cluster {cluster}: Ray is not installed here ({e}); pip install 'convpass[fleet]'") from None
        return RayExecutor(None if cluster == "ray" else cluster)
    raise OptionError(f"--cluster {cluster!r}: expected local, ray or ray://HOST:PORT")


def tune(
    specs: Sequence[ModelSpec],
    output_dir: str | os.PathLike[str],
    options: TuneOptions | Mapping[str, Any],
    *,
    cluster: str | sched.Executor = "local",
    devices: Sequence[str] = (),
    cache: str | os.PathLike[str] | None = None,
    measurer: Measurer | None = None,
    retries: int = 2,
    task_timeout: float | None = None,
    console: Console | None = None,
    on_progress: Callable[[sched.Progress], None] | None = None,
    model_processes: int | None = None,
) -> FleetReport:
    """Tune every model for every target device on a cluster (the module docstring's steps).

    ``options``: :class:`TuneOptions`, or ``optimize``'s keyword values (built once the workers are
    launched: building them imports the pipeline); ``cluster``: ``"local"``, ``"ray"``,
    ``"ray://HOST:PORT"`` or an executor object; ``measurer``: what workers measure with (default:
    :class:`CudnnMeasurer`, the GPU tuner); ``on_progress``: called with every
    :class:`~convpass.fleet.scheduler.Progress` snapshot; ``model_processes``: how many processes
    collect and write models (default: :func:`~convpass.fleet.model_procs.default_count`).
    """
    started = time.perf_counter()
    console = console or Console(stderr=True, soft_wrap=True)
    out_dir = Path(output_dir)
    if not out_dir.is_dir():
        raise ConvpassError(f"output directory {out_dir} does not exist")
    layout = options.get("layout") if isinstance(options, Mapping) else options.layout
    if layout == "auto":
        raise OptionError(
            "--layout auto plans the whole graph with transpose timings measured in the same process as the "
            "convs, which fleet workers do not send back: use --layout per-conv (default for tune), nchw or nhwc"
        )
    if not specs:
        raise ConvpassError("no models given")
    outputs = outputs_of(specs, out_dir)
    measurer = measurer or CudnnMeasurer()
    executor = make_executor(cluster) if isinstance(cluster, str) else cluster
    report = FleetReport(cluster=cluster if isinstance(cluster, str) else executor.name, cache="",
                         models=[ModelProblems(spec, out) for spec, out in zip(specs, outputs)])
    procs = ModelProcesses(model_processes or default_count(len(specs)), [str(spec.path) for spec in specs])
    stream: _Stream | None = None
    try:
        procs.start()  # first: they read the first model while the workers start
        executor.launch(measurer)  # on this thread: ray.init installs signal handlers
        if not isinstance(options, TuneOptions):
            from convpass.compiler.pipeline import build_options

            options = build_options(dict(options))
        _import_for_results()
        stream = _Stream(report, options, procs, started)
        slots, not_started = executor.wait_started(stream.poll)  # a model that cannot be prepared ends the wait
        report.seconds["workers"] = time.perf_counter() - started
        from convpass.tuning.cache import TuningCache

        db = TuningCache(cache)
    except BaseException:
        procs.stop()
        executor.shutdown()
        raise
    stopped_by: Exception | None = None
    with db:
        report.cache = str(db.path)
        try:
            report.devices, report.cache_only = resolve_devices(devices, slots, not_started, db)
            stream.begin(db, [d for d in report.devices if d not in report.cache_only], measurer)
            report.schedule = result = _schedule(executor, db, options, retries, task_timeout, slots, not_started,
                                                 measurer, console, on_progress, stream)
            ended, tuning_ended = time.perf_counter(), time.time()
            if result.first_task_at is not None:
                report.seconds["first_task"] = result.first_task_at - started
            report.seconds["tune"] = (result.last_settled_at or ended) - (result.first_task_at or ended)
            report.interrupted = result.interrupted
            stopped_by = result.stopped_by
            if not report.interrupted and stopped_by is None:
                try:
                    stream.finish()
                except KeyboardInterrupt:
                    report.interrupted = True
                report.seconds["write"] = time.perf_counter() - ended
        finally:
            stream.stop()  # a model being written is finished; nothing else is
            executor.shutdown()  # asked to stop when the scheduler returned: gone by now
            if report.schedule is not None:
                report.written_during_tune = sum(1 for t in stream.written_at.values() if t <= tuning_ended)
    report.seconds["total"] = time.perf_counter() - started
    if stopped_by is not None:
        raise _what_was_kept(stopped_by, report)
    return report


def _import_for_results() -> None:
    """What unpickling the model processes' answers and checking the cache for each new problem
    import (the tuner's completeness rule: no GPU library), imported now, while the workers start,
    rather than in the middle of handing out tasks."""
    import convpass.compiler.pipeline  # noqa: F401
    import convpass.core.problem  # noqa: F401
    import convpass.tuning.cache  # noqa: F401
    import convpass.tuning.decide  # noqa: F401
    import convpass.tuning.tuner  # noqa: F401


def _what_was_kept(error: Exception, report: FleetReport) -> Exception:
    """The error that stopped a run, saying what the run kept (when it kept anything)."""
    measured = report.to_json()["problems_measured"]
    if not isinstance(error, ConvpassError) or not (measured or report.written):
        return error
    written = ", ".join(p.name for p in report.written)
    note = (f"the run stopped: the {measured} problem(s) it measured are in the tuning cache {report.cache}; "
            + (f"written: {written}" if written else "no model was written")
            + "; once fixed, the same command measures only what is missing")
    try:
        return type(error)(f"{error} ({note})")
    except Exception:  # noqa: BLE001  (an error type that takes other arguments)
        return ConvpassError(f"{error} ({note})")


class _Stream:
    """The scheduler's feed (:class:`~convpass.fleet.scheduler.Feed`): models collected by the
    model processes become tasks as they come, in model order, and complete models go back to a
    model process to be written (module docstring, steps 3 and 4)."""

    def __init__(self, report: FleetReport, options: TuneOptions, procs: ModelProcesses, started: float) -> None:
        self.report, self.options, self.procs, self.started = report, options, procs, started
        self.cwd = os.getcwd()
        self.to_collect = collections.deque(range(len(report.models)))
        self.arrived: dict[int, Collected] = {}  # collected, not released yet (they are released in order)
        self.released = 0
        self.resolved: dict[int, ModelSpec] = {}  # with the profiles collect resolved
        # set by begin(), once the devices are known
        self.db: TuningCache | None = None
        self.devices: list[DeviceFingerprint] = []  # measured here
        self.measurer: Measurer | None = None
        self.seen: set[ConvProblem] = set()
        self.geometries = Geometries()
        self.task_of: dict[tuple[DeviceFingerprint, tuple[ConvProblem, ...]], sched.Task] = {}  # (device, group) -> its task
        self.covering: dict[tuple[DeviceFingerprint, ConvProblem], set[int]] = {}  # -> unsettled tasks that measure it
        self.finished: set[tuple[DeviceFingerprint, ConvProblem]] = set()
        self.next_id = 0
        self.pending: set[tuple[DeviceFingerprint, ConvProblem]] = set()  # problems not settled
        self.waiting: dict[tuple[DeviceFingerprint, ConvProblem], list[int]] = {}  # -> models waiting for it
        self.unsettled: dict[int, int] = {}
        self.failed: dict[DeviceFingerprint, set[ConvProblem]] = {}
        self.to_write: dict[int, WriteJob] = {}  # complete models not handed to a process yet, in order
        self.written_at: dict[int, float] = {}  # model index -> time.time() when it was written
        self.stopped = False

    def begin(self, db: TuningCache, measured_here: list[DeviceFingerprint], measurer: Measurer) -> None:
        self.db, self.devices, self.measurer = db, measured_here, measurer
        self.failed = {d: set() for d in self.report.devices}

    # -- the scheduler's feed ---------------------------------------------------------------------

    def poll(self) -> list[sched.Task]:
        """New tasks; raises what a model process raised (the run stops)."""
        for answer in self.procs.receive():
            self._answer(*answer)
        tasks = self._release() if self.db is not None else []
        self._dispatch()
        return tasks

    def open(self) -> bool:
        return self.released < len(self.report.models)

    def busy(self) -> bool:
        return bool(self.to_write or self.procs.in_flight())

    def settled(self, task: sched.Task, finished: bool | None) -> None:
        """A problem is settled by the first task of it that finished, else, once no task of it is
        left, as failed (a task replaced before it started, ``None``, leaves it to its replacement)."""
        for problem in task.problems:
            key = (task.device, problem)
            covering = self.covering.get(key, set())
            covering.discard(task.id)
            if finished:
                self.finished.add(key)
                self.failed[task.device].discard(problem)
            elif key not in self.finished:
                if covering:
                    continue
                self.failed[task.device].add(problem)
            self.pending.discard(key)
            for i in self.waiting.pop(key, ()):
                self.unsettled[i] -= 1
                if self.unsettled[i] == 0:
                    self._complete(i)

    # -- the end ----------------------------------------------------------------------------------

    def finish(self) -> None:
        """Wait until every complete model is written (after the last task)."""
        while self.to_write or self.procs.in_flight():
            self._dispatch()
            for answer in self.procs.receive(timeout=1.0):
                self._answer(*answer)

    def stop(self) -> None:
        """Stop the model processes: a model being written is finished (and counted), no other."""
        self.stopped = True
        for kind, index, payload, _ in self.procs.stop():
            if kind == "written":
                self._written(index, payload)

    # -- internals --------------------------------------------------------------------------------

    def _answer(self, kind: str, index: int, payload: Any, where: str) -> None:
        if kind == "collected":
            self.arrived[index] = payload
            if index == 0:
                self.report.seconds["first_model"] = time.perf_counter() - self.started
            if self.released + len(self.arrived) == len(self.report.models):
                self.report.seconds["collect"] = time.perf_counter() - self.started
        elif kind == "written":
            self._written(index, payload)
        else:
            if where and not isinstance(payload, ConvpassError):
                payload.__cause__ = RemoteTraceback(where)
            raise payload

    def _written(self, index: int, answer: tuple[OptimizeReport, float]) -> None:
        m = self.report.models[index]
        m.report, self.written_at[index] = answer  # the report counted again from the model written
        self.report.written.append(m.output)

    def _release(self) -> list[sched.Task]:
        """The tasks of the models collected next in order (module docstring, step 3)."""
        from convpass.tuning.decide import cached_rows

        assert self.db is not None and self.measurer is not None
        tasks: list[sched.Task] = []
        while self.released in self.arrived:
            i = self.released
            got = self.arrived.pop(i)
            self.released += 1
            m = self.report.models[i]
            m.problems, m.report = got.problems, got.report
            self.resolved[i] = ModelSpec(m.spec.path, got.shapes)
            self.report.notes.extend(got.notes)
            new = group_order(got.problems, self.seen)
            self.seen.update(new)
            self.report.problems = len(self.seen)
            groups = self.geometries.add(new)
            for device in self.devices:
                for group, earlier in groups:
                    if all(self.measurer.complete(device, cached_rows(self.db, device, p), p, self.options) for p in group):
                        self.report.cached += 1
                        continue
                    latest = [self.task_of[(device, g)] for g in earlier if (device, g) in self.task_of]
                    replaces = tuple(dict.fromkeys(i for t in latest for i in (t.id, *t.replaces)))
                    task = sched.Task(self.next_id, device, group, replaces)
                    self.next_id += 1
                    self.task_of[(device, group)] = task
                    self.report.tasks.append(task)
                    for p in group:
                        if (device, p) not in self.finished:  # a problem finished stays settled
                            self.pending.add((device, p))
                        self.covering.setdefault((device, p), set()).add(task.id)
                    tasks.append(task)
            self.unsettled[i] = 0
            for key in ((d, p) for p in dict.fromkeys(got.problems) for d in self.devices):
                if key in self.pending:
                    self.waiting.setdefault(key, []).append(i)
                    self.unsettled[i] += 1
            if self.unsettled[i] == 0:  # every problem in the cache already (or none)
                self._complete(i)
        return tasks

    def _complete(self, index: int) -> None:
        """A model collected with all of its tasks settled: to be written, with what this run did to its problems."""
        m = self.report.models[index]
        tables = [
            (d, d in self.devices, [p for p in m.problems if p in self.failed[d]])
            for d in (self.report.devices if m.problems else ())  # no problems: one table of auto decisions
        ]
        self.to_write[index] = WriteJob(self.resolved[index], m.output, self.options, self.cwd, str(self.report.cache), tables)
        self._dispatch()  # at once, where a process is idle

    def _dispatch(self) -> None:
        """A job to each idle model process: a complete model it holds prepared; else the next model
        to collect (collecting comes first: the workers wait for problems, not for tuned models);
        else the oldest complete model that no other process holds."""
        if self.stopped:
            return
        for number in self.procs.idle():
            index = next((i for i in self.to_write if self.procs.holder(i) == number), None)
            if index is None and self.to_collect:
                index = self.to_collect.popleft()
                self.procs.submit(number, "collect", index, CollectJob(self.report.models[index].spec, self.options, self.cwd))
                continue
            if index is None:
                index = next((i for i in self.to_write if self.procs.holder(i) is None), None)
            if index is not None:
                self.procs.submit(number, "write", index, self.to_write.pop(index))


def _schedule(executor, db, options, retries, task_timeout, slots, not_started, measurer, console, on_progress, stream) -> sched.ScheduleResult:
    unit = "GPUs" if measurer.needs_gpu else "workers"
    models = len(stream.report.models)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("tuning"), BarColumn(), MofNCompleteColumn(), TextColumn("tasks"),
               TextColumn("{task.fields[busy]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        handle = bar.add_task("tuning", total=0, busy="")

        def show(p: sched.Progress) -> None:
            busy = ", ".join(f"{name} {b}/{n}" for name, (b, n) in p.busy_by_device.items()) or "none"
            extra = (f", {p.retried} retried" if p.retried else "") + (f", {p.failed} failed" if p.failed else "")
            collecting = f"; models collected {stream.released}/{models}" if stream.open() else ""
            bar.update(handle, total=p.total, completed=p.finished + p.failed, busy=f"{unit} in use: {busy}{extra}{collecting}")
            if on_progress is not None:
                on_progress(p)

        runner = sched.Scheduler(executor, db, options, retries=retries, task_timeout=task_timeout, on_progress=show, on_settled=stream.settled)
        return runner.run([], slots, not_started, feed=stream)

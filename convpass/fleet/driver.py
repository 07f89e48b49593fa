"""The fleet driver: many models, many GPUs, one tuning cache, one tuned model per input.

1. **Collect and start the workers, at once.** Each model runs the optimize pipeline's graph passes
   (:func:`convpass.pipeline.prepare_model`) for its shape profiles, in a thread of the driver,
   while the workers start (:mod:`convpass.fleet.local` or :mod:`convpass.fleet.ray_cluster`:
   spawn, load cuDNN, warm the GPU; each reports the fingerprint of the device it measures on).
   The distinct problems of all models and profiles are listed once (a problem two models share is
   measured once). A model that cannot be prepared stops the workers and raises its error.
2. **Target devices:** every device type in the cluster, or those ``devices`` names. A name that
   matches no worker's device is looked up in the tuning cache (e.g. measurements exported on
   another GPU and merged with ``convpass cache import``): that device is *cache-only*, its
   decisions come from the cache as with ``optimize --device-name`` and nothing is measured for it.
3. **Schedule** one task per (cluster device, problem) that the cache does not already cover
   (:mod:`convpass.fleet.scheduler`), in :func:`tuning_order`; the driver writes every finished
   task's rows into its cache as they arrive, so an interrupted run keeps them and a re-run
   measures only the rest.
4. **Write each model as soon as all of its tasks are settled** (finished or failed), from a
   thread of the driver while the workers measure the other models' problems: atomically, with one
   decision table per target device, decided from the cache by the same rule as
   ``optimize --device-name``; a problem that failed is ``auto`` for that device. Models complete
   one after another in :func:`tuning_order`, so after the last task only the models it completed
   are left to write. An interrupted run writes nothing more: the models written before it are
   complete, the report lists which were written and which not.

Layout: decisions are per conv (``--layout per-conv``, the default here) or one forced format.
``--layout auto`` plans the whole graph with transpose timings that only a GPU in the same process
measures, and the tuning cache does not hold them: it is refused here rather than silently changed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import onnx
import onnx_ir as ir
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from convpass.cache import CacheError, TuningCache
from convpass.decide import CacheBackend, Choice, cached_rows
from convpass.device import DeviceFingerprint
from convpass.errors import ConvpassError, OptionError
from convpass.fleet import scheduler as sched
from convpass.fleet.measurers import CudnnMeasurer, Measurer
from convpass.model_io import load_model, save_model
from convpass.options import TuneOptions
from convpass.passes.collect_conv_problems import ConvProblem, ProblemUse
from convpass.pipeline import OptimizeReport, decide_and_annotate, prepare_model

OUTPUT_SUFFIX = ".tuned.onnx"

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model to tune, with its shape profiles (``--shape`` strings; none: its own shapes)."""

    path: Path
    shapes: tuple[str, ...] = ()


def specs_from_batches(paths: Sequence[str | os.PathLike[str]], batch_specs: Sequence[str]) -> tuple[list[ModelSpec], list[str]]:
    """Models with one profile per batch size (``--batch 1,32 --batch r3d_18=1,8``, as ``convpass
    bench``): the batch axis is the first dim of every input; other dims must be fixed. A batch a
    model's fixed batch dim rules out is left out for that model, with a note."""
    from convpass.bench.cli import parse_batches
    from convpass.bench.contenders import CaseSkipped, input_shapes, shape_spec

    default, per_model = parse_batches(list(batch_specs))
    stems = {Path(p).stem for p in paths}
    unknown = sorted(set(per_model) - stems)
    if unknown:
        raise OptionError(f"--batch names model(s) not given: {', '.join(unknown)}")
    specs, notes = [], []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ConvpassError(f"{path}: no such file")
        try:
            proto = onnx.load(path, load_external_data=False)
        except Exception:  # noqa: BLE001  (not ONNX, truncated...: load_model says precisely what)
            load_model(path)
            raise
        shapes = []
        for batch in per_model.get(path.stem, default):
            try:
                shapes.append(shape_spec(input_shapes(proto, batch)))
            except CaseSkipped as e:
                notes.append(f"{path.name}: batch {batch} left out: {e}")
            except ValueError as e:
                raise ConvpassError(f"{path}: --batch: {e}") from None
        if not shapes:
            raise ConvpassError(f"{path}: none of the batch sizes {list(per_model.get(path.stem, default))} fits the model")
        specs.append(ModelSpec(path, tuple(shapes)))
    return specs, notes


Prepared = tuple[ir.Model, dict[ConvProblem, list[ProblemUse]]]


@dataclasses.dataclass
class ModelProblems:
    spec: ModelSpec
    output: Path
    problems: list[ConvProblem]
    report: OptimizeReport
    # The model as collect prepared it, kept for one model only (see collect) until it is written.
    prepared: Prepared | None = dataclasses.field(default=None, repr=False)


def collect(specs: Sequence[ModelSpec], options: TuneOptions, output_dir: Path) -> tuple[list[ModelProblems], list[ConvProblem]]:
    """Every model's problems (graph passes only, nothing decided) and the distinct problems of
    all of them, in first-seen order.

    The last model that brings new problems keeps its prepared form: in :func:`tuning_order` it
    completes last, when nothing else is left to overlap its write with, so its write must not
    prepare it again. The others are prepared again when written (during tuning): a registry may
    hold hundreds of models, too many to keep in memory."""
    outputs: dict[Path, Path] = {}
    for spec in specs:
        out = output_dir / (spec.path.stem + OUTPUT_SUFFIX)
        if out in outputs:
            raise ConvpassError(f"{spec.path} and {outputs[out]} would both be written to {out}: rename one")
        outputs[out] = spec.path
    models: list[ModelProblems] = []
    seen: set[ConvProblem] = set()
    last_new: ModelProblems | None = None
    for spec, out in zip(specs, outputs):
        report = OptimizeReport()
        model, uses = _prepared(spec, options, report)
        models.append(ModelProblems(spec, out, list(uses), report))
        if not seen.issuperset(uses):
            seen.update(uses)
            if last_new is not None:
                last_new.prepared = None
            last_new = models[-1]
            last_new.prepared = (model, uses)
    return models, list(dict.fromkeys(p for m in models for p in m.problems))


def tuning_order(models: Sequence[ModelProblems]) -> list[ConvProblem]:
    """The distinct problems in the order workers take them: grouped by the first model that needs
    them (in model order), the largest (FLOPs) first within a group.

    Why: a model is written as soon as all of its problems are settled. In this order the models
    complete one after another while the GPUs go on measuring, and are written meanwhile; with every
    problem largest first across all models (load balancing alone), every model would complete only
    at the very end and all the writing would be serial work after tuning. What it costs is at the
    run's tail: the run ends on the smallest problems of the last group, not on the smallest of all,
    so the GPUs still finish within about one small problem of each other (only a last group with
    fewer problems than GPUs could end on a large one)."""
    first: dict[ConvProblem, int] = {}
    for i, m in enumerate(models):
        for p in m.problems:
            first.setdefault(p, i)
    return sorted(first, key=lambda p: (first[p], -p.primary.flops))


def _prepared(spec: ModelSpec, options: TuneOptions, report: OptimizeReport) -> Prepared:
    model = load_model(spec.path)
    try:
        return model, prepare_model(model, options, spec.shapes, report)
    except ConvpassError as e:
        raise type(e)(f"{spec.path}: {e}") from None


def resolve_devices(
    names: Sequence[str], slots: Sequence[sched.Slot], not_started: Sequence[str], cache: TuningCache
) -> tuple[list[DeviceFingerprint], list[DeviceFingerprint]]:
    """The target devices (module docstring, step 3), in the order named, and which of them are
    cache-only (no worker measures them)."""
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


class FleetBackend:
    """One target device's decisions from the driver's cache, by ``CacheBackend``'s rule; problems
    measured in this run carry the strategy that measured them as their source, problems that
    failed in this run stay undecided (``auto``)."""

    def __init__(self, cache: TuningCache, device: DeviceFingerprint, measured: set[ConvProblem], failed: set[ConvProblem]) -> None:
        self.device = device
        self._from_cache = CacheBackend(cache, device)
        self.measured = measured
        self.failed = failed

    def decide(self, problems: Sequence[ConvProblem], options: TuneOptions) -> dict[ConvProblem, Choice | None]:
        out = self._from_cache.decide([p for p in problems if p not in self.failed], options)
        for p in problems:
            choice = out.get(p)
            if p in self.failed:
                out[p] = None
            elif p in self.measured and choice is not None:
                out[p] = dataclasses.replace(choice, source=options.strategy(p.direction)[0])
        return out


@dataclasses.dataclass
class FleetReport:
    """What a fleet run did; :meth:`to_json` is the ``--json`` summary."""

    cluster: str
    cache: str
    models: list[ModelProblems]
    problems: int = 0
    devices: list[DeviceFingerprint] = dataclasses.field(default_factory=list)
    cache_only: list[DeviceFingerprint] = dataclasses.field(default_factory=list)
    tasks: list[sched.Task] = dataclasses.field(default_factory=list)
    cached: int = 0
    schedule: sched.ScheduleResult | None = None
    written: list[Path] = dataclasses.field(default_factory=list)  # in the order they were written
    written_during_tune: int = 0  # of them, while tasks were still running
    interrupted: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)
    # collect; start: waiting for the workers after it; tune; write: after the last task; total
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        s = self.schedule
        by_id = {t.id: t for t in self.tasks}

        def task_json(task_id: int, reasons: list[str]) -> dict[str, Any]:
            t = by_id[task_id]
            return {"device": str(t.device), "problem": str(t.problem), "attempts": s.attempts.get(task_id, 0) if s else 0, "reasons": reasons}

        finished = s.finished if s else {}
        return {
            "cluster": self.cluster,
            "cache": self.cache,
            "devices": [str(d) for d in self.devices],
            "cache_only_devices": [str(d) for d in self.cache_only],
            "slots": [{"id": x.id, "device": str(x.device), "where": x.where} for x in (s.slots if s else [])],
            "workers_not_started": s.not_started if s else [],
            "models": [
                {
                    "model": str(m.spec.path),
                    "output": str(m.output) if m.output in self.written else None,
                    "profiles": [p.name for p in m.report.profiles],
                    "convs": m.report.convs,
                    "untuned_convs": [{"node": n, "why": w} for n, w in m.report.skipped],
                    "problems": len(m.problems),
                    "decided": {d: v[0] for d, v in m.report.by_device.items()},
                    "undecided": {d: v[1] for d, v in m.report.by_device.items()},
                }
                for m in self.models
            ],
            "problems": self.problems,
            "tasks": len(self.tasks) + self.cached,  # (problem, cluster device) pairs
            "cached": self.cached,
            "measured": len(finished),
            "failed": [task_json(i, r) for i, r in sorted(s.failed.items())] if s else [],
            "missing": [str(by_id[t].problem) for t in sorted(set(by_id) - set(finished) - set(s.failed if s else {}))],
            "retried": s.retried if s else 0,
            "retries": [task_json(i, r) for i, r in sorted(s.reasons.items()) if i in finished] if s else [],
            "workers_lost": [{"slot": sid, "reason": why} for sid, why in (s.lost if s else [])],
            "slots_retired": s.retired if s else {},
            "measured_by_slot": _count(finished.values()),
            "cache_writes": {"tasks": len(s.writes), "max_per_task": max(s.writes.values(), default=0)} if s else {},
            "written_during_tune": self.written_during_tune,
            "interrupted": self.interrupted,
            "notes": self.notes,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


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
    options: TuneOptions,
    *,
    cluster: str | sched.Executor = "local",
    devices: Sequence[str] = (),
    cache: str | os.PathLike[str] | None = None,
    measurer: Measurer | None = None,
    retries: int = 2,
    task_timeout: float | None = None,
    console: Console | None = None,
    on_progress: Callable[[sched.Progress], None] | None = None,
) -> FleetReport:
    """Tune every model for every target device on a cluster (the module docstring's steps).

    ``cluster``: ``"local"``, ``"ray"``, ``"ray://HOST:PORT"`` or an executor object;
    ``measurer``: what workers measure with (default: :class:`CudnnMeasurer`, the GPU tuner);
    ``on_progress``: called with every :class:`~convpass.fleet.scheduler.Progress` snapshot.
    """
    started = time.perf_counter()
    console = console or Console(stderr=True, soft_wrap=True)
    out_dir = Path(output_dir)
    if not out_dir.is_dir():
        raise ConvpassError(f"output directory {out_dir} does not exist")
    if options.layout == "auto":
        raise OptionError(
            "--layout auto plans the whole graph with transpose timings measured in the same process as the "
            "convs, which fleet workers do not send back: use --layout per-conv (default for tune), nchw or nhwc"
        )
    if not specs:
        raise ConvpassError("no models given")
    measurer = measurer or CudnnMeasurer()
    executor = make_executor(cluster) if isinstance(cluster, str) else cluster
    collected = _in_thread(collect, specs, options, out_dir)
    try:
        executor.launch(measurer)  # on this thread: ray.init installs signal handlers
        models, distinct = collected()
        report = FleetReport(cluster=cluster if isinstance(cluster, str) else executor.name, cache="", models=models, problems=len(distinct))
        report.seconds["collect"] = time.perf_counter() - started
        db = TuningCache(cache)
    except BaseException:
        executor.shutdown()
        raise
    writer: _ModelWriter | None = None
    with db:
        report.cache = str(db.path)
        try:
            t0 = time.perf_counter()
            slots, not_started = executor.wait_started()
            report.seconds["start"] = time.perf_counter() - t0
            report.devices, report.cache_only = resolve_devices(devices, slots, not_started, db)
            measured_here = [d for d in report.devices if d not in report.cache_only]
            for task in sched.make_tasks(tuning_order(models), measured_here):
                if measurer.complete(task.device, cached_rows(db, task.device, task.problem), task.problem, options):
                    report.cached += 1
                else:
                    report.tasks.append(task)
            writer = _ModelWriter(report, db, options)
            t0 = time.perf_counter()
            report.schedule = _schedule(executor, db, options, retries, task_timeout, report.tasks, slots, not_started,
                                        measurer, console, on_progress, writer.settled)
            report.seconds["tune"] = time.perf_counter() - t0
            report.written_during_tune = len(report.written)
            report.interrupted = report.schedule.interrupted
            if not report.interrupted:
                t0 = time.perf_counter()
                try:
                    writer.close(write_rest=True)
                except KeyboardInterrupt:
                    report.interrupted = True
                report.seconds["write"] = time.perf_counter() - t0
        finally:
            executor.shutdown()  # done already when the scheduler ran
            if writer is not None:
                writer.close(write_rest=False)
    report.seconds["total"] = time.perf_counter() - started
    return report


def _in_thread(fn: Callable[..., _T], *args: Any) -> Callable[[], _T]:
    """Start ``fn(*args)`` in a daemon thread (never keeps the process alive); the function returned
    waits for its result or raises its exception."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001  (raised again in the caller's thread)
            outcome["error"] = e

    thread = threading.Thread(target=run, name=f"convpass-{fn.__name__}", daemon=True)
    thread.start()

    def result() -> _T:
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return result


class _ModelWriter:
    """Writes each model, in a thread of its own, as soon as all of its tasks are settled (finished
    or failed for good), while the scheduler goes on giving the workers tasks. One model at a time,
    in the order they complete; each is prepared again unless collect kept it prepared.

    The driver's thread calls :meth:`settled` (the scheduler's hook) and :meth:`close`; the writer
    thread decides from the cache, which serializes its calls, and never sees a model before all
    of its rows are in. A model's failed problems are ``auto`` in it."""

    def __init__(self, report: FleetReport, db: TuningCache, options: TuneOptions) -> None:
        self.report, self.db, self.options = report, db, options
        self.needed_by: dict[ConvProblem, list[int]] = {}  # problem -> the models (indices) that need it
        for i, m in enumerate(report.models):
            for p in m.problems:
                self.needed_by.setdefault(p, []).append(i)
        self.unsettled = [0] * len(report.models)  # per model: its tasks not settled yet
        for task in report.tasks:
            for i in self.needed_by[task.problem]:
                self.unsettled[i] += 1
        self.measured: dict[DeviceFingerprint, set[ConvProblem]] = {d: set() for d in report.devices}
        self.failed: dict[DeviceFingerprint, set[ConvProblem]] = {d: set() for d in report.devices}
        self.jobs: queue.SimpleQueue[tuple[int, list[FleetBackend]] | None] = queue.SimpleQueue()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="convpass-model-writer", daemon=True)
        self.thread.start()
        for i, n in enumerate(self.unsettled):
            if n == 0:  # every problem in the cache already (or none)
                self._complete(i)

    # -- the driver's thread ----------------------------------------------------------------------

    def settled(self, task: sched.Task, finished: bool) -> None:
        """A task finished (its rows are in the cache) or failed for good; raises the writer's error."""
        self._raise()
        (self.measured if finished else self.failed)[task.device].add(task.problem)
        for i in self.needed_by[task.problem]:
            self.unsettled[i] -= 1
            if self.unsettled[i] == 0:
                self._complete(i)

    def close(self, write_rest: bool) -> None:
        """Wait for the thread to end: after writing every model handed to it (``write_rest``), else
        after the one it is writing now. Raises the writer's error, once."""
        if not write_rest:
            self.stopping.set()
        self.jobs.put(None)
        self.thread.join()
        for m in self.report.models:
            m.prepared = None  # the report outlives the run
        self._raise()

    def _complete(self, index: int) -> None:
        """Hand a model whose tasks are all settled to the thread, with what this run did to its problems."""
        problems = self.report.models[index].problems
        backends = [
            FleetBackend(self.db, d, {p for p in problems if p in self.measured[d]}, {p for p in problems if p in self.failed[d]})
            for d in (self.report.devices if problems else ())  # no problems: one table of auto decisions
        ]
        self.jobs.put((index, backends))

    def _raise(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error

    # -- the writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self.stopping.is_set():
            job = self.jobs.get()
            if job is None or self.stopping.is_set():
                return
            try:
                self._write(*job)
            except BaseException as e:  # noqa: BLE001  (raised in the driver's thread)
                self.error = e
                return

    def _write(self, index: int, backends: list[FleetBackend]) -> None:
        m = self.report.models[index]
        prepared, m.prepared = m.prepared, None
        if prepared is None:
            m.report = OptimizeReport()  # counted again from the prepared model that is written
            prepared = _prepared(m.spec, self.options, m.report)
        model, uses = prepared
        decide_and_annotate(model, self.options, uses, backends, m.report)
        save_model(model, m.output)
        self.report.written.append(m.output)


def _schedule(executor, db, options, retries, task_timeout, tasks, slots, not_started, measurer, console, on_progress, on_settled) -> sched.ScheduleResult:
    unit = "GPUs" if measurer.needs_gpu else "workers"
    columns = (TextColumn("tuning"), BarColumn(), MofNCompleteColumn(), TextColumn("problems"),
               TextColumn("{task.fields[busy]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        handle = bar.add_task("tuning", total=len(tasks), busy="")

        def show(p: sched.Progress) -> None:
            busy = ", ".join(f"{name} {b}/{n}" for name, (b, n) in p.busy_by_device.items()) or "none"
            extra = (f", {p.retried} retried" if p.retried else "") + (f", {p.failed} failed" if p.failed else "")
            bar.update(handle, completed=p.finished + p.failed, busy=f"{unit} in use: {busy}{extra}")
            if on_progress is not None:
                on_progress(p)

        runner = sched.Scheduler(executor, db, options, retries=retries, task_timeout=task_timeout, on_progress=show, on_settled=on_settled)
        return runner.run(tasks, slots, not_started)


def print_report(report: FleetReport, console: Console) -> None:
    doc = report.to_json()
    console.print(
        f"[bold]convpass tune[/]: {len(report.models)} model(s), {report.problems} distinct problems, "
        f"{len(report.devices)} device type(s); cluster {report.cluster}: "
        + (", ".join(f"{x['id']} ({DeviceFingerprint.parse(x['device']).name})" for x in doc["slots"]) or "no workers")
    )
    for why in doc["workers_not_started"]:
        console.print(f"  [yellow]note[/]: {why}")
    for device in report.cache_only:
        console.print(f"  {device}: no worker of this type; decisions from the tuning cache only")
    console.print(
        f"  {doc['tasks']} (problem, device) pairs: {doc['cached']} already in the tuning cache, {doc['measured']} measured, "
        f"{len(doc['failed'])} failed" + (f", {doc['retried']} retries" if doc["retried"] else "")
    )
    console.print(
        "  seconds: " + ", ".join(f"{phase} {s:.1f}" for phase, s in report.seconds.items())
        + f"; {report.written_during_tune} of {len(report.models)} model(s) written while tuning"
    )
    for lost in doc["workers_lost"]:
        console.print(f"  [yellow]worker lost[/] {lost['slot']}: {lost['reason']}")
    for sid, why in doc["slots_retired"].items():
        console.print(f"  [yellow]retired[/] {sid}: {why}")
    for f in doc["failed"]:
        console.print(f"  [red]failed[/] {f['problem']} on {f['device']} after {f['attempts']} attempt(s): {f['reasons'][-1]} -> algo=auto")
    for note in report.notes:
        console.print(f"  [yellow]note[/]: {note}")
    for m in doc["models"]:
        if m["output"] is not None:
            decided = ", ".join(f"{DeviceFingerprint.parse(d).name} {n}/{m['problems']}" for d, n in m["decided"].items())
            console.print(f"  wrote {m['output']}: {m['convs']} convs, {m['problems']} problems; decided {decided or '-'}")
    if report.interrupted:
        not_written = [m["model"] for m in doc["models"] if m["output"] is None]
        written = (
            f"{len(report.written)} model(s) complete before the interrupt were written (above)"
            + (f"; not written: {', '.join(not_written)}" if not_written else "")
            if report.written else "no model was written"
        )
        console.print(
            f"  [yellow]interrupted[/]: {doc['measured']} measured problems are in {report.cache}; {written}; "
            "run the same command again to measure only the rest"
        )


def summary_json(report: FleetReport) -> str:
    return json.dumps(report.to_json(), indent=1)

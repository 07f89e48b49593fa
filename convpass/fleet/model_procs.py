"""The driver's graph work in processes of their own: collecting a model's problems (the optimize
pipeline's graph passes, :func:`prepare`) and writing a tuned model (:func:`write`).

Why not threads of the driver: reading a model, ONNX's shape inference and serializing a model are
long calls into C++ that hold the interpreter lock, up to a second on a large model. A driver
thread in one of them keeps the driver from handing the next task to a worker that has just
finished one: on a CPU, with stand-in workers that sleep 50 ms per task (then one problem each), the workers of an
8-model panel run stood idle about 3 s each, in pauses of up to 0.7 s, while the driver's thread
wrote the models (about 0.2 s once the writes moved here). In processes of their own, that work
runs beside the scheduling, and several models are prepared at once.

:class:`ModelProcesses` runs them for the driver. They start with the ``forkserver`` method where
the platform has it (the server imports the graph passes once, so that every process after the
first starts in milliseconds), else ``spawn``. Each keeps the last model it collected, prepared: a
write of that model (the driver sends it there when it can) does not prepare it again. They only
read the tuning cache (SQLite in WAL mode lets them read while the driver writes); the driver
alone writes it.

Messages, driver to process: ``("collect", index, CollectJob)``, ``("write", index, WriteJob)``,
``None`` (exit). Answers: ``("collected", index, Collected)``, ``("written", index,
(OptimizeReport, when the file was complete, as time.time()))`` or ``("error", index, exception,
traceback text)``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convpass.core.device import DeviceFingerprint
from convpass.core.errors import ConvpassError
from convpass.core.options import TuneOptions

if TYPE_CHECKING:
    from convpass.compiler.pipeline import OptimizeReport
    from convpass.core.problem import ConvProblem
    from convpass.tuning.cache import TuningCache
    from convpass.tuning.decide import Choice

# What a model process imports before its first job (the forkserver imports it once for all).
PRELOAD = ["convpass.fleet.preload", "convpass.compiler.pipeline", "convpass.tuning.cache", "convpass.core.model_io", "convpass.bench.contenders"]
WRITE_STOP_S = 120.0  # how long stopping waits for a model being written (it is never left half-written)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model to tune, with its shape profiles: ``--shape`` strings (none: its own shapes), or
    ``batches``: one profile per batch size on the first dim of every input, resolved when the
    model is read (as ``convpass bench``; a batch the model's fixed batch dim rules out is left
    out, with a note)."""

    path: Path
    shapes: tuple[str, ...] = ()
    batches: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class CollectJob:
    spec: ModelSpec
    options: TuneOptions
    cwd: str  # the driver's: paths are relative to it


@dataclasses.dataclass(frozen=True)
class Collected:
    problems: list[ConvProblem]  # in graph order
    report: OptimizeReport
    shapes: tuple[str, ...]  # the profiles it was prepared with (batches resolved)
    notes: list[str]  # batches left out


@dataclasses.dataclass(frozen=True)
class WriteJob:
    spec: ModelSpec  # with the profiles collect resolved
    output: Path
    options: TuneOptions
    cwd: str
    cache: str  # the driver's tuning cache, read only
    # device, whether the fleet measures on it (not a cache-only device), problems failed here
    tables: list[tuple[DeviceFingerprint, bool, list[ConvProblem]]]


class FleetBackend:
    """One target device's decisions from the driver's cache, by ``CacheBackend``'s rule; problems
    that failed in this run stay undecided (``auto``). On a device the fleet measures on, a
    decision names the strategy that took it, measured in this run or an earlier one, as the
    tuner's do (``DecisionBackend.measures``); on a cache-only device, ``cache``."""

    def __init__(self, cache: TuningCache, device: DeviceFingerprint, measures: bool, failed: set[ConvProblem]) -> None:
        from convpass.tuning.decide import CacheBackend

        self.device = device
        self.cache = cache  # where the fusion units' timings are kept too, so a re-run times none of them again
        self._from_cache = CacheBackend(cache, device)
        self.measures = measures
        self.failed = failed

    def decide(self, problems: Sequence[ConvProblem], options: TuneOptions) -> dict[ConvProblem, Choice | None]:
        out = self._from_cache.decide([p for p in problems if p not in self.failed], options)
        for p in problems:
            choice = out.get(p)
            if p in self.failed:
                out[p] = None
            elif self.measures and choice is not None:
                out[p] = dataclasses.replace(choice, source=options.strategy(p.direction)[0])
        return out


# ---- the graph work (in a model process, or in the caller's for collect()) -----------------------


def prepare(spec: ModelSpec, options: TuneOptions) -> tuple[Any, dict, OptimizeReport, tuple[str, ...], list[str]]:
    """Read a model and run the graph passes for its profiles: (model, problems with their uses,
    report, the profiles, notes on batches left out)."""
    from convpass.compiler.pipeline import OptimizeReport, prepare_model, untuned
    from convpass.core.model_io import load_model

    model = load_model(spec.path)
    untuned(model, spec.path, retune=False, hint="tune the model it was tuned from (`convpass optimize --retune` re-tunes a tuned one)")
    shapes, notes = spec.shapes, []
    if spec.batches:
        shapes, notes = batch_profiles(model, spec)
    report = OptimizeReport()
    try:
        uses = prepare_model(model, options, shapes, report)
    except ConvpassError as e:
        raise type(e)(f"{spec.path}: {e}") from None
    return model, uses, report, tuple(shapes), notes


def batch_profiles(model: Any, spec: ModelSpec) -> tuple[tuple[str, ...], list[str]]:
    """``--batch`` profiles of a read model, by ``convpass bench``'s rule (its input_shapes, on the
    graph inputs alone: nothing else of the model is serialized again)."""
    import onnx
    import onnx_ir as ir

    from convpass.core.profiles import profiles_for_batches

    inputs = onnx.ModelProto()
    inputs.graph.input.extend(ir.serde.serialize_value(v) for v in model.graph.inputs if v.name not in model.graph.initializers)
    return profiles_for_batches(spec.path, inputs, spec.batches)


def write(job: WriteJob, prepared: tuple[Any, dict, OptimizeReport] | None, cache: TuningCache) -> OptimizeReport:
    """Decide the model's problems from the cache, one table per device, and write it (atomically).
    ``prepared``: the model as collect left it, else it is prepared again."""
    from convpass.compiler.pipeline import decide_and_annotate
    from convpass.core.model_io import save_model

    if prepared is None:
        model, uses, report, _, _ = prepare(job.spec, job.options)  # counted again from the model written
    else:
        model, uses, report = prepared
    backends = [FleetBackend(cache, device, measures, set(failed)) for device, measures, failed in job.tables]
    decide_and_annotate(model, job.options, uses, backends, report)
    save_model(model, job.output)
    return report


# ---- a model process -------------------------------------------------------------------------------


def process_main(conn: Any, stopping: Any) -> None:
    """Main of a model process: jobs in, answers out (module docstring), in the order sent, until
    None, the pipe closes or ``stopping`` (an Event) is set: then no further job is started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the driver decides
    for name in PRELOAD:
        __import__(name)
    from convpass.tuning.cache import TuningCache

    held: tuple[int, Any, dict, Any] | None = None  # (index, model, uses, report) of the last model collected
    caches: dict[str, TuningCache] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message is None or stopping.is_set():
            break
        kind, index, job = message
        try:
            os.chdir(job.cwd)
            if kind == "collect":
                held = None  # one prepared model at a time
                model, uses, report, shapes, notes = prepare(job.spec, job.options)
                answer: tuple = ("collected", index, Collected(list(uses), report, shapes, notes))
                held = (index, model, uses, report)
            elif kind == "write":
                mine = held[1:] if held is not None and held[0] == index else None
                if mine is not None:
                    held = None
                cache = caches.get(job.cache) or caches.setdefault(job.cache, TuningCache(job.cache))
                report = write(job, mine, cache)
                # when its content was complete (before the rename made it visible), not when this line ran
                answer = ("written", index, (report, min(time.time(), os.stat(job.output).st_mtime)))
            else:
                raise ValueError(f"unknown job {kind!r}")
        except Exception as e:  # noqa: BLE001  (raised again in the driver)
            answer = ("error", index, _portable(e), traceback.format_exc())
        try:
            conn.send(answer)
        except (BrokenPipeError, EOFError, OSError):
            break
    os._exit(0)  # nothing to clean up that the operating system does not


def _portable(error: Exception) -> Exception:
    """The exception itself if it survives pickling, else one that says the same."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        text = f"{type(error).__name__}: {error}"
        return ConvpassError(str(error)) if isinstance(error, ConvpassError) else RuntimeError(text)


class RemoteTraceback(Exception):
    """The traceback of an error raised in a model process (the cause of the error raised again)."""

    def __str__(self) -> str:
        return self.args[0]


class ModelProcessError(ConvpassError):
    """A model process died."""


# ---- the driver's side --------------------------------------------------------------------------


def default_count(models: int) -> int:
    """Model processes for a run: one per 4 CPUs, 1 to 4, never more than the models."""
    return max(1, min(models, 4, (os.cpu_count() or 1) // 4))


def _contexts() -> list[Any]:
    """forkserver (where there is one), then spawn should it fail to start."""
    out = []
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # only if the server is not running yet
        out.append(ctx)
    return out + [mp.get_context("spawn")]


@dataclasses.dataclass
class _Process:
    process: Any
    conn: Any
    jobs: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (kind, model index) sent, not answered: the first is under way
    holds: int | None = None  # the model index it keeps prepared (when its jobs reach a write of it)


class ModelProcesses:
    """``count`` model processes and the jobs sent to each (the driver sends one at a time to an
    idle process; more would queue in its pipe and run in order); ``names`` names the models (by
    index) in messages."""

    def __init__(self, count: int, names: Sequence[str]) -> None:
        if count < 1:
            raise ValueError("count must be >= 1")
        self.count = count
        self.names = list(names)  # the models, for messages
        self._procs: list[_Process] = []
        self._lock = threading.Lock()
        self._start_error: BaseException | None = None
        self._starter: threading.Thread | None = None
        self._stopping: Any = None

    def start(self) -> None:
        """Start the processes from a thread (the forkserver's first start waits for its imports)."""
        self._starter = threading.Thread(target=self._start_all, name="convpass-model-processes", daemon=True)
        self._starter.start()

    def _start_all(self) -> None:
        for ctx in _contexts():
            try:
                self._stopping = ctx.Event()
                for _ in range(self.count):
                    parent, child = ctx.Pipe()
                    process = ctx.Process(target=process_main, args=(child, self._stopping), name="convpass-model-process", daemon=True)
                    process.start()
                    child.close()
                    with self._lock:
                        self._procs.append(_Process(process, parent))
                return
            except Exception as e:  # noqa: BLE001  (the next way to start them, else raised by receive())
                self._start_error = e
                with self._lock:
                    started, self._procs = self._procs, []
                for p in started:
                    p.process.kill()
        self._stopping = None

    def _started(self) -> list[_Process]:
        with self._lock:
            return list(self._procs)

    # -- jobs -------------------------------------------------------------------------------------

    def idle(self) -> list[int]:
        """The started processes with no job, by number."""
        return [i for i, p in enumerate(self._started()) if not p.jobs]

    def holder(self, index: int) -> int | None:
        """The process that keeps model ``index`` prepared, if one does."""
        return next((i for i, p in enumerate(self._started()) if p.holds == index), None)

    def in_flight(self) -> list[tuple[str, int]]:
        return [job for p in self._started() for job in p.jobs]

    def submit(self, number: int, kind: str, index: int, job: CollectJob | WriteJob) -> None:
        p = self._started()[number]
        try:
            p.conn.send((kind, index, job))
        except (BrokenPipeError, EOFError, OSError):
            pass  # it died: the next receive() says so
        p.jobs.append((kind, index))
        if kind == "collect" or p.holds == index:
            p.holds = None  # it drops the model it keeps when it starts this job

    def receive(self, timeout: float = 0.0) -> list[tuple[str, int, Any, str]]:
        """Answers that arrived, waiting up to ``timeout`` for one; raises ModelProcessError for a
        process that died, and what starting them raised."""
        if self._start_error is not None and self._stopping is None and not (self._starter and self._starter.is_alive()):
            error = self._start_error
            raise ConvpassError(f"cannot start the model processes: {type(error).__name__}: {error}") from error
        procs = self._started()
        handles = [p.conn for p in procs] + [p.process.sentinel for p in procs]
        if timeout > 0:
            if handles:
                wait_any(handles, timeout)
            else:
                time.sleep(timeout)
        answers = []
        for p in procs:
            while True:
                try:
                    if not p.conn.poll(0):
                        break
                    kind, index, *payload = p.conn.recv()
                except (EOFError, OSError):
                    raise ModelProcessError(self._death(p)) from None
                answers.append(self._answered(p, kind, index, payload))
            if not p.process.is_alive():
                raise ModelProcessError(self._death(p))
        return answers

    def _answered(self, p: _Process, kind: str, index: int, payload: list) -> tuple[str, int, Any, str]:
        p.jobs.pop(0)
        if kind == "collected":
            p.holds = index
        return kind, index, payload[0], payload[1] if len(payload) > 1 else ""

    def _death(self, p: _Process) -> str:
        from convpass.fleet.local import _exit_reason

        p.process.join(1)
        doing = f" while {'collecting' if p.jobs[0][0] == 'collect' else 'writing'} {self.names[p.jobs[0][1]]}" if p.jobs else ""
        return f"a model process (pid {p.process.pid}) {_exit_reason(p.process.exitcode)}{doing}"

    def stop(self) -> list[tuple[str, int, Any, str]]:
        """Stop every process: one writing a model finishes it (never half-written: the answers are
        returned) and starts no other job; one collecting is stopped at once. Waits until they are
        gone."""
        if self._starter is not None:
            self._starter.join()
        if self._stopping is not None:
            self._stopping.set()
        answers = []
        for p in self._started():
            # the write under way, and one it may have started before it saw the event
            while p.jobs and p.jobs[0][0] == "write" and p.process.is_alive():
                try:
                    if not p.conn.poll(WRITE_STOP_S):
                        break
                    kind, index, *payload = p.conn.recv()
                except (EOFError, OSError):
                    break  # it exited: the jobs left were not started
                answers.append(self._answered(p, kind, index, payload))
            if p.jobs and p.jobs[0][0] == "collect":
                p.process.kill()
            else:
                try:
                    p.conn.send(None)
                except (BrokenPipeError, EOFError, OSError):
                    pass
        for p in self._started():
            p.process.join(5)
            if p.process.is_alive():
                p.process.kill()
                p.process.join(5)
            p.conn.close()
        with self._lock:
            self._procs.clear()
        return answers

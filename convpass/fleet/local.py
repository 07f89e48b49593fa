"""The embedded executor: one worker process per local GPU, no Ray needed (``--cluster local``).

Workers are started with the ``spawn`` method (a fresh interpreter: no CUDA state inherited from
the driver) and each sees only its own GPU through ``CUDA_VISIBLE_DEVICES``. The GPUs are those
``CUDA_VISIBLE_DEVICES`` lists, else every GPU CuPy counts (none without CuPy). A measurer that
needs no GPU runs in ``workers`` plain processes instead.

Driver and worker talk over one pipe per worker; the driver waits on the pipes and the processes'
exit sentinels together, so a worker that dies (killed, out of memory, a GPU fault) is noticed at
once and reported as :class:`~convpass.fleet.scheduler.Lost`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait as wait_any
from typing import Any

from convpass.core.options import TuneOptions
from convpass.fleet import worker
from convpass.fleet.measurers import Measurer
from convpass.fleet.scheduler import FEED_POLL_S, Event, Failed, Finished, Lost, Ready, Slot, StartFailed, Task

START_TIMEOUT_S = 300.0  # CUDA context, cuDNN load and clock warm-up; generous for a busy host
STOP_GRACE_S = 2.0


def visible_gpus() -> list[str]:
    """The GPUs this host offers: ``CUDA_VISIBLE_DEVICES`` entries if set, else CuPy's count."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    try:
        from cupy.cuda import runtime

        return [str(i) for i in range(runtime.getDeviceCount())]
    except Exception:  # noqa: BLE001  (no CuPy or no driver: no GPUs)
        return []


class _Worker:
    def __init__(self, process: Any, conn: Any, gpu: str | None) -> None:
        self.process = process
        self.conn = conn
        self.gpu = gpu
        self.state = "starting"  # starting | ready | stopping (asked to) | dead
        self.deadline = time.monotonic() + START_TIMEOUT_S


class LocalExecutor:
    """Worker processes on this host, one per GPU (see the module docstring)."""

    name = "local"

    def __init__(self, gpus: Sequence[str] | None = None, workers: int | None = None) -> None:
        if workers is not None and workers < 1:
            raise ValueError("workers must be >= 1")
        self.gpus = None if gpus is None else list(gpus)
        self.workers = workers
        self._ctx = mp.get_context("spawn")
        self._measurer: Measurer | None = None
        self._procs: dict[str, _Worker] = {}
        self._slots: dict[str, Slot] = {}

    # -- Executor -----------------------------------------------------------------------------------

    def launch(self, measurer: Measurer) -> None:
        self._measurer = measurer
        if measurer.needs_gpu:
            gpus: list[str | None] = list(self.gpus if self.gpus is not None else visible_gpus())
            if self.workers is not None:
                gpus = gpus[: self.workers]
            ids = [f"gpu{g}" for g in gpus]
        else:
            gpus = [None] * (self.workers or os.cpu_count() or 1)
            ids = [f"proc{i}" for i in range(len(gpus))]
        for sid, gpu in zip(ids, gpus):
            self._spawn(sid, gpu)

    def wait_started(self, poll: Callable[[], None] | None = None) -> tuple[list[Slot], list[str]]:
        problems: list[str] = []
        while any(w.state == "starting" for w in self._procs.values()):
            if poll is not None:
                poll()
            for event in self.wait(None if poll is None else FEED_POLL_S):
                if isinstance(event, StartFailed):
                    problems.append(f"worker {event.slot_id} did not start: {event.reason}")
        return [self._slots[sid] for sid, w in self._procs.items() if w.state == "ready"], problems

    def submit(self, slot_id: str, task: Task, options: TuneOptions) -> None:
        w = self._procs[slot_id]
        try:
            w.conn.send((task.id, task.problems, options))
        except (BrokenPipeError, EOFError, OSError):
            pass  # the worker died: its sentinel reports it at the next wait()

    def wait(self, timeout: float | None) -> list[Event]:
        live = {sid: w for sid, w in self._procs.items() if w.state != "dead"}
        starting = [w.deadline for w in live.values() if w.state == "starting"]
        if starting:
            until = max(0.0, min(starting) - time.monotonic())
            timeout = until if timeout is None else min(timeout, until)
        handles: dict[Any, str] = {}
        for sid, w in live.items():
            handles[w.conn] = sid
            handles[w.process.sentinel] = sid
        if not handles:
            return []
        ready = {handles[h] for h in wait_any(list(handles), timeout)}
        events: list[Event] = []
        for sid in sorted(ready):
            events += self._drain(sid)
        now = time.monotonic()
        for sid, w in live.items():
            if w.state == "starting" and now > w.deadline:
                self._stop(w, kill=True)
                events.append(StartFailed(sid, f"not ready after {START_TIMEOUT_S:.0f} s"))
        return events

    def kill(self, slot_id: str) -> None:
        self._stop(self._procs[slot_id], kill=True)

    def restart(self, slot_id: str) -> None:
        old = self._procs[slot_id]
        if old.state != "dead":
            self._stop(old, kill=True)
        self._spawn(slot_id, old.gpu)

    def stop(self) -> None:
        for w in self._procs.values():
            if w.state == "starting":
                w.process.kill()  # it would read the request to stop only once started
                w.state = "stopping"
            elif w.state == "ready":
                try:
                    w.conn.send(None)  # an idle worker exits at once; a busy one after its task
                except (BrokenPipeError, EOFError, OSError):
                    pass
                w.state = "stopping"

    def shutdown(self) -> None:
        self.stop()
        deadline = time.monotonic() + STOP_GRACE_S
        for w in self._procs.values():
            if w.state != "dead":
                w.process.join(max(0.0, deadline - time.monotonic()))
                self._stop(w, kill=True)

    # -- internals --------------------------------------------------------------------------------

    def _spawn(self, sid: str, gpu: str | None) -> None:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=worker.local_main, args=(child, self._measurer, gpu), name=f"convpass-worker-{sid}", daemon=True
        )
        process.start()
        child.close()  # the worker's end lives in the worker: EOF here when it dies
        self._procs[sid] = _Worker(process, parent, gpu)

    def _where(self, w: _Worker, pid: int) -> str:
        return f"GPU {w.gpu} of this host, pid {pid}" if w.gpu is not None else f"worker process, pid {pid}"

    def _drain(self, sid: str) -> list[Event]:
        """Every message the worker sent, then its death if it died."""
        w = self._procs[sid]
        events: list[Event] = []
        while w.state != "dead":
            try:
                if not w.conn.poll(0):
                    break
                message = w.conn.recv()
            except (EOFError, OSError):
                break
            kind, *payload = message
            if kind == "ready":
                device, pid = payload
                w.state = "ready"
                slot = self._slots[sid] = Slot(sid, device, self._where(w, pid))
                events.append(Ready(slot))
            elif kind == "start_failed":
                self._stop(w, kill=True)
                events.append(StartFailed(sid, payload[0]))
            elif kind == "finished":
                task_id, rows, seconds = payload
                events.append(Finished(sid, task_id, rows, seconds))
            elif kind == "failed":
                task_id, reason = payload
                events.append(Failed(sid, task_id, reason))
            else:
                raise RuntimeError(f"worker {sid} sent an unknown message {kind!r}")
        if w.state != "dead" and not w.process.is_alive():
            code = w.process.exitcode
            was = w.state
            self._stop(w, kill=False)
            why = _exit_reason(code)
            events.append(StartFailed(sid, f"worker process {why} while starting") if was == "starting" else Lost(sid, f"worker process {why}"))
        return events

    def _stop(self, w: _Worker, kill: bool) -> None:
        if kill and w.process.is_alive():
            w.process.kill()
        w.process.join(5)
        w.conn.close()
        w.state = "dead"


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "vanished"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"

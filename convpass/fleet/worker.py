"""What runs inside a fleet worker, for every executor: start the measurer once, then measure one
task (one geometry's problems) per request and hand the rows back. Workers never open the driver's tuning cache.

A measurer that raises :class:`~convpass.fleet.measurers.MeasureError` failed on that task
only: the worker goes on. Any other exception may have left the process unusable (a CUDA error
poisons its context), so the worker reports the failure and exits; its executor starts a new one.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Any

from convpass.core.device import DeviceFingerprint
from convpass.fleet.measurers import MeasureError, Measurer


def describe(error: BaseException) -> str:
    """One line for a worker's failure: the exception and where it was raised."""
    text = str(error).strip().splitlines()
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames and not isinstance(error, MeasureError) else ""
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ") + where


class WorkerCore:
    """One worker's measurer and what it answers; shared by the local process and the Ray actor."""

    def __init__(self, measurer: Measurer) -> None:
        self.measurer = measurer
        self.device: DeviceFingerprint | None = None

    def start(self) -> DeviceFingerprint:
        # What every task's request unpickles (problems: onnx-ir), loaded now rather than in the first task.
        import convpass.core.problem  # noqa: F401

        self.device = self.measurer.start()
        return self.device

    def measure(self, task_id: int, problems: Any, options: Any) -> tuple[str, tuple[Any, ...], bool]:
        """("finished", (task_id, rows, seconds)) or ("failed", (task_id, reason)), and whether the
        worker must exit (an unexpected exception)."""
        started = time.perf_counter()
        try:
            rows = self.measurer.measure(problems, options)
        except MeasureError as e:
            return "failed", (task_id, describe(e)), False
        except Exception as e:  # noqa: BLE001  (reported to the driver, which retries elsewhere)
            return "failed", (task_id, describe(e) + "; worker restarted"), True
        return "finished", (task_id, rows, time.perf_counter() - started), False


def local_main(conn: Any, measurer: Measurer, gpu: str | None) -> None:
    """Main of a local worker process (spawned): one GPU, requests and answers over ``conn``.

    Messages sent: ("ready", fingerprint, pid) | ("start_failed", reason) once, then per request
    ("finished", task_id, rows, seconds) | ("failed", task_id, reason). A request is
    (task_id, problems, options); None or a closed pipe ends the worker at once, without the
    interpreter's clean-up (freeing CuPy's pools, destroying the CUDA context: the operating system
    releases all of it with the process), so that the driver does not wait on it.
    """
    # Ctrl-C reaches the whole foreground process group: the driver alone decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before anything touches CUDA in this process
    core = WorkerCore(measurer)
    try:
        device = core.start()
    except Exception as e:  # noqa: BLE001
        conn.send(("start_failed", describe(e)))
        return
    conn.send(("ready", device, os.getpid()))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            request = None  # the driver is gone
        if request is None:
            _exit_now(0)
        kind, payload, fatal = core.measure(*request)
        conn.send((kind, *payload))
        if fatal:
            _exit_now(3)


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001  (closed or gone: nothing to keep)
            pass
    os._exit(code)

"""Measurers for the fleet tests: the recorded replay (``RecordedMeasurer``) plus the faults a real
fleet meets. They live in a module of their own because worker processes (spawned, or Ray actors)
unpickle them by module name. Every measurement they return is a recorded one (tests/recorded.py).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from convpass.core.device import DeviceFingerprint
from convpass.fleet.measurers import RecordedMeasurer


def _first(marker: Path) -> bool:
    """True in exactly one process, the first to get here (the marker file is created atomically)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class KilledMidTask(RecordedMeasurer):
    """The first worker to reach its ``nth`` task is killed (SIGKILL) in the middle of it."""

    def __init__(self, cache_path, device, marker: Path, nth: int = 2) -> None:
        super().__init__(cache_path, device)
        self.marker, self.nth, self.count = marker, nth, 0

    def __getstate__(self):
        return {**super().__getstate__(), "marker": self.marker, "nth": self.nth}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.marker, self.nth, self.count = state["marker"], state["nth"], 0

    def measure(self, problems, options):
        self.count += 1
        rows = super().measure(problems, options)
        if self.count == self.nth and _first(self.marker):
            os.kill(os.getpid(), signal.SIGKILL)
        return rows


class HangsOnce(RecordedMeasurer):
    """The first worker to measure a task of batch ``n`` hangs on it (a stuck GPU)."""

    def __init__(self, cache_path, device, marker: Path, n: int) -> None:
        super().__init__(cache_path, device)
        self.marker, self.n = marker, n

    def __getstate__(self):
        return {**super().__getstate__(), "marker": self.marker, "n": self.n}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.marker, self.n = state["marker"], state["n"]

    def measure(self, problems, options):
        if problems[0].primary.n == self.n and _first(self.marker):
            time.sleep(3600)
        return super().measure(problems, options)


class ReplayPerGpu(RecordedMeasurer):
    """A worker holding a GPU (``CUDA_VISIBLE_DEVICES`` set by the local executor) that replays the
    recorded run of the device its GPU stands for: a mixed cluster without GPUs. A GPU in ``broken``
    kills every worker on it in its first task."""

    needs_gpu = True

    def __init__(self, cache_path, devices: dict[str, DeviceFingerprint], broken: tuple[str, ...] = ()) -> None:
        super().__init__(cache_path, next(iter(devices.values())))
        self.devices, self.broken = devices, broken

    def __getstate__(self):
        return {**super().__getstate__(), "devices": self.devices, "broken": self.broken}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.devices, self.broken = state["devices"], state["broken"]

    def start(self) -> DeviceFingerprint:
        self.device = self.devices[os.environ["CUDA_VISIBLE_DEVICES"]]
        return super().start()

    def measure(self, problems, options):
        if os.environ["CUDA_VISIBLE_DEVICES"] in self.broken:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().measure(problems, options)


class SlowReplay(RecordedMeasurer):
    """A replay that takes ``delay`` seconds per task (a GPU takes about 0.24 s per problem)."""

    def __init__(self, cache_path, device, delay: float) -> None:
        super().__init__(cache_path, device)
        self.delay = delay

    def __getstate__(self):
        return {**super().__getstate__(), "delay": self.delay}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.delay = state["delay"]

    def measure(self, problems, options):
        time.sleep(self.delay)
        return super().measure(problems, options)


class NotStarting(RecordedMeasurer):
    """A worker whose GPU cannot be used: start() fails."""

    def start(self) -> DeviceFingerprint:
        raise RuntimeError("CUDA_ERROR_NO_DEVICE (recorded replay standing in for a GPU that is gone)")


class SlowStart(RecordedMeasurer):
    """A worker whose start takes a minute (a GPU slow to come up)."""

    def start(self) -> DeviceFingerprint:
        time.sleep(60)
        return super().start()

"""What a fleet worker measures problems with.

A :class:`Measurer` is created by the driver, pickled to every worker process and started there
once. It measures one task at a time, a geometry's problems one after the other (as one GPU's
tuner measures them: a later problem only adds what its epilogue needs to the rows of the earlier
ones), and returns the rows; it never writes a tuning cache (only the driver does). The driver also asks it whether rows already stored cover a problem, so a re-run
measures only what is missing.

* :class:`CudnnMeasurer` times problems on the worker's GPU with the tuner
  (:func:`convpass.tuning.tuner.measure_problem`). Everything a first problem would otherwise pay
  for is done when the worker starts, while the driver still collects problems: the CUDA context,
  cuDNN's handle, the tuner's imports, one small convolution through the tuner's own path (cuDNN
  loads its sub-libraries and CuPy its kernels on first use), and the GPU's clocks warmed.
* :class:`RecordedMeasurer` replays measurements recorded in a tuning cache for one device, through
  the cache-only decision path's own read (:func:`convpass.tuning.decide.cached_rows`): no GPU, nothing
  timed. It rehearses a fleet run (scheduling, faults, models written) on machines without GPUs,
  and it is what the CPU tests run. Its cache file must be readable at the same path by every
  worker (a local cluster, or a file system the Ray nodes share).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from convpass.core.device import DeviceFingerprint
from convpass.core.options import TuneOptions

if TYPE_CHECKING:  # not at run time: the driver imports this module before launching its workers
    from convpass.core.problem import ConvProblem
    from convpass.tuning.cache import TuningCache
    from convpass.tuning.cache_rows import Measurement


class MeasureError(Exception):
    """A problem a worker could not measure; the message says why (the worker itself is fine)."""


class Measurer(Protocol):
    """Measures problems inside a worker (see the module docstring). Must be picklable."""

    needs_gpu: bool  # True: one worker per GPU; False: workers are plain processes

    def start(self) -> DeviceFingerprint:
        """In the worker, once before its first problem: set up, warm up; the device it measures."""
        ...

    def measure(self, problems: Sequence[ConvProblem], options: TuneOptions) -> list[Measurement]:
        """Every row measured for ``problems``, one geometry's (raises :class:`MeasureError` when it cannot)."""
        ...

    def complete(self, device: DeviceFingerprint, rows: Sequence[Measurement], problem: ConvProblem, options: TuneOptions) -> bool:
        """In the driver: whether ``rows`` stored for ``device`` hold what :meth:`measure` would return."""
        ...


class CudnnMeasurer:
    """Times problems on the worker's GPU with convpass's tuner (CuPy + cuDNN)."""

    needs_gpu = True

    def __init__(self) -> None:
        self._stream: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {}  # a started measurer holds a CUDA stream: each worker starts its own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._stream = None

    def start(self) -> DeviceFingerprint:
        from convpass.native import device as device_mod

        fingerprint = device_mod.detect()
        if fingerprint is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
            raise MeasureError(f"no usable GPU, CuPy or cuDNN in this worker (CUDA_VISIBLE_DEVICES={visible})")
        import cupy as cp

        from convpass.native.cudnn import get_handle
        from convpass.tuning import harness, tuner

        self._stream = cp.cuda.Stream(non_blocking=True)
        with self._stream:
            get_handle()  # load cuDNN and create the handle before the first timing
            self._first_use(tuner)
            harness.warm_clocks()  # idle GPUs sit at low clocks: every worker warms its own
        return fingerprint

    @staticmethod
    def _first_use(tuner: Any) -> None:
        """One small convolution through the tuner (heuristic, reference, check, timing), rows
        dropped: what cuDNN and CuPy load or compile on first use is loaded now, not in the first
        problem. Best effort: a problem it shows would show in the first task as well."""
        from convpass.core.problem import ConvProblem, ConvShape

        shape = ConvShape("fwd", 1, 8, 8, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1))
        try:
            tuner.measure_problem(ConvProblem((shape,)), TuneOptions(mode="heuristic", layout="nchw", tf32="on"))
        except Exception as e:  # noqa: BLE001
            import logging

            logging.getLogger("convpass").debug("fleet worker warm-up: %s", e)

    def measure(self, problems: Sequence[ConvProblem], options: TuneOptions) -> list[Measurement]:
        from convpass.tuning.tuner import measure_problem

        if self._stream is None:
            raise MeasureError("CudnnMeasurer.measure before start()")
        rows: list[Measurement] = []
        with self._stream:
            for problem in problems:
                # what the earlier problems measured stands, as the tuning cache's rows do for the tuner
                have = [m for m in rows if m.key.shape in problem.candidates]
                rows += measure_problem(problem, options, have)
        return rows

    def complete(self, device: DeviceFingerprint, rows: Sequence[Measurement], problem: ConvProblem, options: TuneOptions) -> bool:
        from convpass.tuning.tuner import problem_complete

        return problem_complete(list(rows), problem, options)


class RecordedMeasurer:
    """Replays one device's measurements from a tuning cache file (see the module docstring)."""

    needs_gpu = False

    def __init__(self, cache_path: str | os.PathLike[str], device: DeviceFingerprint) -> None:
        self.cache_path = Path(cache_path)
        self.device = device
        self._cache: TuningCache | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"cache_path": self.cache_path, "device": self.device}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.cache_path, self.device, self._cache = state["cache_path"], state["device"], None

    def _recorded(self, device: DeviceFingerprint, problem: ConvProblem) -> list[Measurement]:
        from convpass.tuning.cache import TuningCache
        from convpass.tuning.decide import cached_rows

        if self._cache is None:
            if not self.cache_path.is_file():
                raise MeasureError(f"recorded tuning cache {self.cache_path} does not exist")
            self._cache = TuningCache(self.cache_path)
        return cached_rows(self._cache, device, problem)

    def start(self) -> DeviceFingerprint:
        if not self.cache_path.is_file():
            raise MeasureError(f"recorded tuning cache {self.cache_path} does not exist")
        return self.device

    def measure(self, problems: Sequence[ConvProblem], options: TuneOptions) -> list[Measurement]:
        rows: dict[tuple, Measurement] = {}
        for problem in problems:
            recorded = self._recorded(self.device, problem)
            if not recorded:
                raise MeasureError(f"no measurement of {problem} for {self.device} recorded in {self.cache_path}")
            rows.update(((m.key, m.algo, m.method), m) for m in recorded)
        return list(rows.values())

    def complete(self, device: DeviceFingerprint, rows: Sequence[Measurement], problem: ConvProblem, options: TuneOptions) -> bool:
        recorded = {(m.key, m.algo, m.method) for m in self._recorded(device, problem)}
        return bool(recorded) and recorded <= {(m.key, m.algo, m.method) for m in rows}

"""What ``inspect --html`` shows beside a recorded decision: every candidate the tuning cache timed for it.

For one record of :func:`convpass.inspect` (a conv, a device, a profile), :class:`CandidateSource`
reads the tuning cache's rows of the decided geometry on that device (every memory format, math
mode and algorithm measured for it) and returns a :class:`Comparison`:

* the candidates, each with the time convpass measured for it (the conv's step: a call that fuses
  the decision's epilogue includes it; an unfused one adds the epilogue's own pass where the
  decision fuses one and the cache timed that pass, an unfused engine in place of the bias pass
  its time holds, as :func:`convpass.tuning.decide.cost_ms`);
* which of them is the recorded choice, the runner-up (the fastest other candidate) and cuDNN's
  heuristic first choice (NCHW, default math: the baseline ``optimize`` reports), with their
  margins over the choice;
* the candidates that did not run (unsupported, failed the check, ...), counted by status.

Without a cache, a device or rows for the geometry, :meth:`CandidateSource.compare` says why
candidates are not available; the report then shows what the model records, and says so.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path
from typing import Any

from convpass.core.algo import Algo
from convpass.core.device import DeviceFingerprint
from convpass.core.errors import ConvpassError
from convpass.core.problem import ConvProblem, ConvShape, ProblemKey
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_file import default_cache_path
from convpass.tuning.cache_rows import CacheError, Measurement
from convpass.tuning.decide import EPILOGUE_METHOD, bias_ms, cost_ms

__all__ = ["Candidate", "CandidateSource", "Comparison", "cache_algo"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    algo: str  # as the tuning cache names it (engine:..., implicit_gemm+bias+relu, ...)
    layout: str
    math: str
    time_ms: float
    workspace_bytes: int
    chosen: bool = False
    heuristic: bool = False  # cuDNN's heuristic first choice (NCHW, default math)

    @property
    def label(self) -> str:
        return f"{self.algo} | {self.layout.upper()} | {self.math}"

    def to_json(self) -> dict[str, Any]:
        return {"algo": self.algo, "layout": self.layout, "math": self.math, "time_ms": self.time_ms,
                "workspace_bytes": self.workspace_bytes, "chosen": self.chosen, "heuristic": self.heuristic}


@dataclasses.dataclass
class Comparison:
    """The candidates of one decision, or why there are none (``missing``)."""

    candidates: list[Candidate] = dataclasses.field(default_factory=list)
    not_run: dict[str, int] = dataclasses.field(default_factory=dict)  # status -> count
    chosen_ms: float | None = None
    runner_up: Candidate | None = None
    heuristic_ms: float | None = None
    heuristic_algo: str | None = None
    missing: str = ""

    def margin(self, other_ms: float | None) -> float | None:
        """How much slower ``other_ms`` is than the choice, as a fraction (0.12 = 12% slower)."""
        if other_ms is None or not self.chosen_ms:
            return None
        return other_ms / self.chosen_ms - 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "candidates": [c.to_json() for c in self.candidates],
            "not_run": dict(self.not_run),
            "chosen_ms": self.chosen_ms,
            "runner_up": self.runner_up.to_json() if self.runner_up else None,
            "runner_up_margin": self.margin(self.runner_up.time_ms if self.runner_up else None),
            "heuristic_algo": self.heuristic_algo,
            "heuristic_ms": self.heuristic_ms,
            "heuristic_margin": self.margin(self.heuristic_ms),
            "missing": self.missing or None,
        }


def cache_algo(record: dict[str, Any]) -> str | None:
    """The tuning-cache name of a record's chosen configuration (None: not decided)."""
    fusion = record.get("fusion") or ""
    if record.get("engine"):
        return str(Algo("engine", record["engine"], fusion))
    algo = Algo.maybe(record.get("algo"))
    if algo is None or algo.family in ("auto", "pass"):
        return None
    return str(algo.fused(fusion))


class CandidateSource:
    """The tuning cache a report reads candidates from: ``--cache`` (it must exist), else the
    default cache where one exists. Never creates a cache."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.cache: TuningCache | None = None
        self.why_not = ""
        self._rows: dict[tuple[str, ConvShape], list[Measurement]] = {}
        if path is not None and not Path(path).expanduser().is_file():
            raise ConvpassError(f"--cache {path}: no tuning cache there")
        target = Path(path).expanduser() if path is not None else default_cache_path()
        self.path = target
        if not target.is_file():
            self.why_not = f"no tuning cache at {target} (give one with --cache)"
            return
        try:
            self.cache = TuningCache(target)
        except CacheError as e:
            if path is not None:
                raise
            self.why_not = f"the tuning cache {target} cannot be read ({e})"

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def compare(self, record: dict[str, Any]) -> Comparison:
        """The candidates of one :func:`convpass.inspect` record (module docstring)."""
        if self.cache is None:
            return Comparison(missing=self.why_not)
        if not record.get("device") or not record.get("problem_key"):
            return Comparison(missing="the model records no device or problem for this decision")
        try:
            key = ProblemKey.parse(record["problem_key"])
            device = DeviceFingerprint.parse(record["device"])
        except ValueError as e:
            return Comparison(missing=f"the recorded problem or device cannot be read ({e})")
        rows = self._geometry_rows(device, key.shape)
        if not rows:
            return Comparison(missing=f"the tuning cache {self.path} has no rows for this problem on this device")
        return _compare(rows, key, record)

    def _geometry_rows(self, device: DeviceFingerprint, shape: ConvShape) -> list[Measurement]:
        index = (str(device), shape)
        if index not in self._rows:
            assert self.cache is not None
            self._rows[index] = self.cache.get(device, shape)
        return self._rows[index]


def _compare(rows: list[Measurement], key: ProblemKey, record: dict[str, Any]) -> Comparison:
    fusion = record.get("fusion") or ""
    epilogue = {m.key: m.time_ms for m in rows
                if m.method == EPILOGUE_METHOD and m.algo == fusion and m.status == "ok" and m.time_ms is not None}
    bias = bias_ms(rows, ConvProblem((key.shape,), fusion))  # what an unfused engine's time holds (decide.cost_ms)
    chosen_algo = cache_algo(record)
    out = Comparison()
    timed: list[tuple[Measurement, float]] = []
    not_run: Counter[str] = Counter()
    for m in rows:
        if m.method != "measure" or m.key.shape != key.shape:
            continue
        row_fusion = Algo.parse(str(m.algo)).fusion
        if row_fusion and row_fusion != fusion:
            continue  # a fused call of another epilogue: not this conv's candidate
        if m.status != "ok" or m.time_ms is None:
            not_run[m.status] += 1
            continue
        cost = cost_ms(m, epilogue, fusion, bias=bias)
        if cost is not None:
            timed.append((m, cost))
    heuristic = next((m for m in rows if m.key == key.shape.key("nchw", "default") and m.method == "heuristic"
                      and m.heuristic_rank == 0 and m.status == "ok"), None)
    for m, cost in sorted(timed, key=lambda mc: (mc[1], mc[0].algo)):
        out.candidates.append(Candidate(
            m.algo, m.key.layout, m.key.math, cost, m.workspace_bytes,
            chosen=m.key == key and m.algo == chosen_algo,
            heuristic=heuristic is not None and m.key == heuristic.key and m.algo == heuristic.algo))
    out.not_run = dict(sorted(not_run.items()))
    chosen = next((c for c in out.candidates if c.chosen), None)
    out.chosen_ms = chosen.time_ms if chosen else record.get("time_ms")
    out.runner_up = next((c for c in out.candidates if not c.chosen), None)
    if heuristic is not None:
        out.heuristic_algo = heuristic.algo
        out.heuristic_ms = next((c.time_ms for c in out.candidates if c.heuristic), None)
    if chosen is None:
        out.missing = "the tuning cache holds candidates for this problem but not the recorded choice (tuned with another cache?)"
    return out

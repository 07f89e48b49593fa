"""A row of the tuning cache: the :class:`Measurement` type, the checks of its fields, and its
stored form; a transpose timing's row; a fusion unit's stored timings; the errors the tuning cache raises.

A measurement is one candidate algorithm for one problem key on one device, and what happened to
it (:mod:`convpass.tuning.cache` says what the store holds). Every field is checked when a
:class:`Measurement` is made, so a stored row or an imported entry that is not a valid
measurement is refused with a message naming the field (:func:`check_field`). Which stored rows
every decision reads, the tuner's and those made without a GPU alike, is :func:`current`: engine
rows timed before engine plans read input slices or wrote output slices (:func:`superseded`) are no
decision's.

The errors live here, below the store (:mod:`convpass.tuning.cache`, :mod:`convpass.tuning.cache_file`)
and the exchange format (:mod:`convpass.tuning.cache_exchange`), which all raise them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable
from typing import Any

from convpass.core import json_text
from convpass.core.algo import Algo
from convpass.core.device import DeviceFingerprint
from convpass.core.errors import ConvpassError
from convpass.core.problem import ProblemKey

__all__ = [
    "COLUMNS",
    "METHODS",
    "PACKED_READS",
    "PACKED_WRITES",
    "STATUSES",
    "TRANSPOSE_DTYPES",
    "CacheError",
    "CacheWarning",
    "Measurement",
    "check_field",
    "current",
    "dims_text",
    "fusion_times",
    "is_int",
    "is_real",
    "short",
    "stored_row",
    "superseded",
    "transpose_row",
    "valid_transpose",
]

# "skipped": not run, on purpose (the note says why, e.g. an algorithm known to take seconds per launch).
STATUSES: tuple[str, ...] = ("ok", "unsupported", "wrong_result", "error", "oom", "skipped")
METHODS: tuple[str, ...] = ("measure", "find", "heuristic", "epilogue")
TRANSPOSE_DTYPES = ("float16", "bfloat16", "float32", "float64")

_INT64_MAX = 2**63 - 1  # SQLite's INTEGER
_LATEST_TIME = 253402300799  # 9999-12-31T23:59:59 UTC: a date Python can print
_FUSION_TIMES_LIMIT = 1 << 16  # characters of a fusion unit's stored timings (a few names and numbers)

# The columns of the measurements table, in the order of :func:`stored_row`.
COLUMNS = (
    "device",
    "key",
    "shape",
    "algo",
    "method",
    "status",
    "time_ms",
    "workspace_bytes",
    "deterministic",
    "measured_at",
    "note",
    "heuristic_rank",
    "find_rank",
)


class CacheError(ConvpassError):
    """A tuning-cache problem the user must act on; its message is one line."""


class CacheWarning(UserWarning):
    """A damaged cache file was moved aside and a fresh cache started, or stored rows that are not
    valid measurements were skipped."""


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def short(v: object, limit: int = 60) -> str:
    text = repr(v).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_field(name: str, value: object, status: object = None) -> str | None:
    """Why ``value`` is not valid for Measurement field ``name`` (None when it is)."""
    if name == "algo":
        if not isinstance(value, str) or not value:
            return f"must be a non-empty string, got {short(value)}"
    elif name == "status":
        if value not in STATUSES:
            return f"{short(value)} is not one of {', '.join(STATUSES)}"
    elif name == "method":
        if value not in METHODS:
            return f"{short(value)} is not one of {', '.join(METHODS)}"
    elif name == "time_ms":
        if value is None:
            return None
        if not is_real(value) or value < 0:  # type: ignore[operator]
            return f"must be a finite number >= 0 or null, got {short(value)}"
        if status != "ok":
            return f"must be null unless status is 'ok' (status is {short(status)})"
    elif name == "workspace_bytes":
        if not is_int(value) or not 0 <= value <= _INT64_MAX:  # type: ignore[operator]
            return f"must be an integer from 0 to {_INT64_MAX}, got {short(value)}"
    elif name == "deterministic":
        if not isinstance(value, bool):
            return f"must be true or false, got {short(value)}"
    elif name == "measured_at":
        if not is_real(value) or not 0 <= value <= _LATEST_TIME:  # type: ignore[operator]
            return f"must be a unix time (a number from 0 to {_LATEST_TIME}, the end of year 9999), got {short(value)}"
    elif name == "note":
        if not isinstance(value, str):
            return f"must be a string, got {short(value)}"
    elif name in ("heuristic_rank", "find_rank"):
        if value is not None and (not is_int(value) or not 0 <= value <= _INT64_MAX):  # type: ignore[operator]
            return f"must be an integer from 0 to {_INT64_MAX} or null, got {short(value)}"
    return None


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One candidate algorithm for one problem key on one device, and what happened to it.

    ``time_ms`` is None unless ``status == "ok"`` (and may be None then too, for ``heuristic``
    rows, which are ranked, not timed). ``heuristic_rank`` is the position in cuDNN's ``_v7``
    heuristic list for this key (0 = cuDNN's first choice); ``find_rank`` the position in
    cuDNN Find's result list.
    """

    key: ProblemKey
    algo: str
    status: str
    time_ms: float | None
    workspace_bytes: int
    deterministic: bool
    measured_at: float
    method: str
    note: str = ""
    heuristic_rank: int | None = None
    find_rank: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.key, ProblemKey):
            raise TypeError(f"Measurement.key must be a ProblemKey, got {short(self.key)}")
        for name in _CHECKED_FIELDS:  # every row a cached run reads (50,000 for a ResNet-50) comes here
            why = check_field(name, getattr(self, name), self.status)
            if why:
                raise ValueError(f"Measurement.{name} {why}")
        # Normalize ints given for float fields so equality survives a round trip.
        if self.time_ms is not None:
            object.__setattr__(self, "time_ms", float(self.time_ms))
        object.__setattr__(self, "measured_at", float(self.measured_at))


_CHECKED_FIELDS = tuple(f.name for f in dataclasses.fields(Measurement) if f.name != "key")


def stored_row(device: str, m: Measurement) -> tuple[Any, ...]:
    """The measurements-table row of ``m`` on ``device``, in :data:`COLUMNS` order."""
    return (
        device,
        str(m.key),
        str(m.key.shape),
        m.algo,
        m.method,
        m.status,
        m.time_ms,
        m.workspace_bytes,
        int(m.deterministic),
        m.measured_at,
        m.note,
        m.heuristic_rank,
        m.find_rank,
    )


# --------------------------------------------------------------------------------------------
# Transpose timings
# --------------------------------------------------------------------------------------------


def dims_text(dims: Iterable[int]) -> str:
    """The stored form of a transpose's tensor dims (``1x64x56x56``); ValueError when they are no shape."""
    values = [int(d) for d in dims]
    if not 0 < len(values) <= 8 or any(not 0 < d <= 2**31 - 1 for d in values):
        raise ValueError(f"transpose dims must be 1 to 8 integers from 1 to {2**31 - 1}, got {short(values)}")
    return "x".join(map(str, values))


def transpose_row(device: str, dims: Iterable[int], dtype: str, time_ms: float, measured_at: float) -> tuple[Any, ...]:
    """The transposes-table row (device, dims, dtype, time_ms, measured_at); ValueError naming a bad field."""
    if dtype not in TRANSPOSE_DTYPES:
        raise ValueError(f"transpose dtype must be one of {', '.join(TRANSPOSE_DTYPES)}, got {short(dtype)}")
    if not is_real(time_ms) or not math.isfinite(time_ms) or time_ms < 0:
        raise ValueError(f"transpose time_ms must be a finite non-negative number, got {short(time_ms)}")
    if not is_real(measured_at) or not 0 <= measured_at <= _LATEST_TIME:
        raise ValueError(f"transpose measured_at must be a unix time from 0 to {_LATEST_TIME}, got {short(measured_at)}")
    return (device, dims_text(dims), dtype, float(time_ms), float(measured_at))


def valid_transpose(row: tuple[Any, ...]) -> bool:
    """Whether a stored transpose row (device, dims, dtype, time_ms, measured_at) can be exported."""
    try:
        DeviceFingerprint.parse(row[0])
        transpose_row(row[0], [int(x) for x in str(row[1]).split("x")], row[2], row[3], row[4])
        return True
    except (ValueError, TypeError):
        return False


def fusion_times(stored: object, required: Collection[str] = ()) -> dict[str, float]:
    """A fusion unit's timings from the ``times`` column of its stored row: a JSON object of names
    to finite times >= 0 (ms) holding every ``required`` name; ValueError saying what it is instead."""
    if isinstance(stored, bytes):
        stored = stored.decode("utf-8", errors="strict")  # (UnicodeDecodeError is a ValueError)
    if not isinstance(stored, str):
        raise ValueError(f"times must be JSON text, got {short(stored)}")
    if len(stored) > _FUSION_TIMES_LIMIT:
        raise ValueError(f"times is {len(stored)} characters long, more than the {_FUSION_TIMES_LIMIT} of any timings")
    times = json_text.loads(stored)
    if not isinstance(times, dict):
        raise ValueError(f"times must be a JSON object of names and times, got {short(times)}")
    for name, value in times.items():
        if not is_real(value) or value < 0:
            raise ValueError(f"time {short(name)} must be a finite number >= 0, got {short(value)}")
    missing = [n for n in required if n not in times]
    if missing:
        raise ValueError(f"times has no {', '.join(missing)}")
    return {str(k): float(v) for k, v in times.items()}


PACKED_READS = "the object reads packed inputs"  # why an input slice is copied for an object of a family that reads no slices
PACKED_WRITES = "the object writes packed outputs"  # why an output is copied into its slice for one of a family that writes none


def superseded(row: Measurement) -> bool:
    """Whether ``row`` is a graph-API engine's of a key with an input (output) slice timed with the
    copy of the slice because engine plans read packed inputs (wrote packed outputs) then: its note
    says so; an engine's row now says it read (wrote) the slice in place, or why cuDNN refused it."""
    stale = ((row.key.x_slice is not None and f"input copied first ({PACKED_READS})" in row.note)
             or (row.key.y_slice is not None and f"output copied into its slice after ({PACKED_WRITES})" in row.note))
    return stale and Algo.parse(row.algo).is_engine


def current(rows: Iterable[Measurement]) -> list[Measurement]:
    """``rows`` as every decision reads them (the tuner's, and those made without a GPU): without
    :func:`superseded` rows, and without the engine rows of each key and graph (bare, or a
    fusion) whose newest superseded row no engine row of it is newer than (``measured_at``): the
    tuner then finds them missing and times them again. Once they are, a superseded row of a
    configuration no longer offered (never timed again) no longer makes them stale."""
    rows = list(rows)
    newest: dict[tuple[ProblemKey, str], float] = {}
    for m in rows:
        if superseded(m):
            graph = (m.key, Algo.parse(m.algo).fusion)
            newest[graph] = max(newest.get(graph, m.measured_at), m.measured_at)
    if not newest:
        return rows

    def engine_graph(m: Measurement) -> tuple[ProblemKey, str] | None:
        return (m.key, Algo.parse(m.algo).fusion) if m.method == "measure" and Algo.parse(m.algo).is_engine else None

    retimed = {g for m in rows if (g := engine_graph(m)) in newest and not superseded(m) and m.measured_at > newest[g]}
    return [m for m in rows if not superseded(m) and not ((g := engine_graph(m)) in newest and g not in retimed)]

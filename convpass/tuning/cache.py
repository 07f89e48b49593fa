"""The tuning cache: every measurement convpass has taken, per device, in one SQLite file.

What it holds
    One row per (device fingerprint, problem key, algorithm, method): the candidate's status,
    time, workspace, determinism, when it was measured, and where cuDNN ranked it. ``method`` says
    how the row came about: ``measure`` (convpass's own timing harness), ``find`` (cuDNN's Find),
    ``heuristic`` (not timed, only ranked by cuDNN's ``_v7`` heuristic) or ``epilogue`` (the
    activation of a fused epilogue timed as its own pass over the key's output; its algo is the
    fusion's name: :mod:`convpass.tuning.decide`). Graph-API engines are ``measure`` rows whose algo is
    ``engine:<cuDNN plan name>[+<fusion>]``. Lookups by geometry
    (:meth:`TuningCache.get`) return every memory format, math mode and algorithm measured for a
    :class:`~convpass.core.problem.ConvShape` in one indexed query.

    Beside them, one row per (device, tensor dims, dtype) in ``transposes``: the measured time of
    converting such a tensor between channels-first and channels-last
    (:meth:`TuningCache.put_transpose`). The whole-graph layout plan weighs conv times against these
    (:mod:`convpass.compiler.passes.plan_layouts`); keeping them makes a cached re-run plan the same layouts as
    the run that measured, and lets a machine without a GPU plan them too.

Where it lives
    ``TuningCache(path)``; with no path, ``$CONVPASS_CACHE`` if set, else
    ``$XDG_CACHE_HOME/convpass/tuning.db`` (``~/.cache/convpass/tuning.db`` by default).

Concurrency
    WAL journal mode, a busy timeout, short ``BEGIN IMMEDIATE`` write transactions and a retry
    loop with jittered backoff on "database is locked", so several tuning processes can share one
    file.

Damage and foreign files
    A file that is not a cache of this format is refused with a :class:`CacheError` and left as it
    is: not SQLite (a model, a text file), another program's SQLite database, a cache of a newer
    convpass (a higher schema version), a FIFO or a device. A cache of this format that is damaged
    (truncated, failing SQLite's integrity check, or found damaged while in use) is, when the
    command writes the cache, renamed to ``<name>.corrupt-<timestamp>`` (with its ``-wal``/``-shm``
    siblings), a :class:`CacheWarning` names both paths, and a fresh cache is started. A location
    that cannot be created or written raises :class:`CacheError`.

    Read-only use (``TuningCache(path, readonly=True)``: ``cache stats``, ``cache export``,
    ``optimize --device-name``) changes nothing: a missing file is an error (nothing is created at
    a mistyped path), a damaged one is refused, a version-1 cache is read without upgrading it.
    Stored rows that are not valid measurements (written by another program or by hand) are
    skipped with a :class:`CacheWarning`.

    Opening (check, move aside, create) runs under an exclusive ``flock`` on ``<name>.lock``, so
    of several processes that find the same damaged file exactly one moves it aside and the
    others open the fresh cache it started; a file is only moved aside if it is still the very
    file (device and inode) that the failing connection opened, never one another process put
    in its place.

Exchange
    :meth:`TuningCache.export_json` / :meth:`TuningCache.import_json` move measurements between
    machines (a GPU fleet tunes, a GPU-less build machine applies) as JSON::

        {"format": "convpass-tuning-cache", "version": 2, "exported_at": <unix time>,
         "entries": [{"device": "<fingerprint>", "key": "<problem key>", "algo": ..., ...}],
         "transposes": [...]}

    Version 2 added ``"transposes"``: ``{"device", "dims": [..], "dtype", "time_ms", "measured_at"}``
    each; version 1 files (no transposes) still import. Import checks the whole file before writing
    anything and writes it in one transaction.

Schema versions
    1: measurements only. 2: adds ``transposes``. A version-1 file is upgraded in place when opened
    (the table is added; nothing else changes).

No pickle is used anywhere: rows are plain columns, exchange files are plain JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import sqlite3
import tempfile
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no cross-process open lock
    fcntl = None  # type: ignore[assignment]

from convpass.core.errors import ConvpassError, FileError
from convpass.core.files import check_output, check_readable, os_error, read_bytes
from convpass.core.text import literal, markup, printable
from convpass.core.device import DeviceFingerprint
from convpass.core.problem import ConvShape, ProblemKey

__all__ = [
    "STATUSES",
    "METHODS",
    "SCHEMA_VERSION",
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "CacheError",
    "CacheWarning",
    "Measurement",
    "TuningCache",
    "default_cache_path",
]

# "skipped": not run, on purpose (the note says why, e.g. an algorithm known to take seconds per launch).
STATUSES: tuple[str, ...] = ("ok", "unsupported", "wrong_result", "error", "oom", "skipped")
METHODS: tuple[str, ...] = ("measure", "find", "heuristic", "epilogue")

SCHEMA_VERSION = 2
EXPORT_FORMAT = "convpass-tuning-cache"
EXPORT_VERSION = 2
_READABLE_EXPORT_VERSIONS = (1, 2)

_APP_TAG = "convpass-tuning-cache"
_BUSY_TIMEOUT_MS = 5_000
_LOCK_RETRY_SECONDS = 60.0  # give up on a lock held this long (beyond the busy timeout)

_T = TypeVar("_T")
_INT64_MAX = 2**63 - 1  # SQLite's INTEGER
_LATEST_TIME = 253402300799  # 9999-12-31T23:59:59 UTC: a date Python can print
EXPORT_LIMIT = 1 << 30  # the largest export file convpass reads
_OURS = b"SQLite format 3\x00"


class CacheError(ConvpassError):
    """A tuning-cache problem the user must act on; its message is one line."""


class CacheWarning(UserWarning):
    """A damaged cache file was moved aside and a fresh cache started, or stored rows that are not
    valid measurements were skipped."""


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _short(v: object, limit: int = 60) -> str:
    text = repr(v).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_field(name: str, value: object, status: object = None) -> str | None:
    """Why ``value`` is not valid for Measurement field ``name`` (None when it is)."""
    if name == "algo":
        if not isinstance(value, str) or not value:
            return f"must be a non-empty string, got {_short(value)}"
    elif name == "status":
        if value not in STATUSES:
            return f"{_short(value)} is not one of {', '.join(STATUSES)}"
    elif name == "method":
        if value not in METHODS:
            return f"{_short(value)} is not one of {', '.join(METHODS)}"
    elif name == "time_ms":
        if value is None:
            return None
        if not _is_real(value) or value < 0:  # type: ignore[operator]
            return f"must be a finite number >= 0 or null, got {_short(value)}"
        if status != "ok":
            return f"must be null unless status is 'ok' (status is {_short(status)})"
    elif name == "workspace_bytes":
        if not _is_int(value) or not 0 <= value <= _INT64_MAX:  # type: ignore[operator]
            return f"must be an integer from 0 to {_INT64_MAX}, got {_short(value)}"
    elif name == "deterministic":
        if not isinstance(value, bool):
            return f"must be true or false, got {_short(value)}"
    elif name == "measured_at":
        if not _is_real(value) or not 0 <= value <= _LATEST_TIME:  # type: ignore[operator]
            return f"must be a unix time (a number from 0 to {_LATEST_TIME}, the end of year 9999), got {_short(value)}"
    elif name == "note":
        if not isinstance(value, str):
            return f"must be a string, got {_short(value)}"
    elif name in ("heuristic_rank", "find_rank"):
        if value is not None and (not _is_int(value) or not 0 <= value <= _INT64_MAX):  # type: ignore[operator]
            return f"must be an integer from 0 to {_INT64_MAX} or null, got {_short(value)}"
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
            raise TypeError(f"Measurement.key must be a ProblemKey, got {_short(self.key)}")
        for name in _CHECKED_FIELDS:  # every row a cached run reads (50,000 for a ResNet-50) comes here
            why = _check_field(name, getattr(self, name), self.status)
            if why:
                raise ValueError(f"Measurement.{name} {why}")
        # Normalize ints given for float fields so equality survives a round trip.
        if self.time_ms is not None:
            object.__setattr__(self, "time_ms", float(self.time_ms))
        object.__setattr__(self, "measured_at", float(self.measured_at))


_CHECKED_FIELDS = tuple(f.name for f in dataclasses.fields(Measurement) if f.name != "key")

# JSON entry fields: (name, required). Optional ones take the Measurement default.
_ENTRY_FIELDS: tuple[tuple[str, bool], ...] = (
    ("device", True),
    ("key", True),
    ("algo", True),
    ("status", True),
    ("time_ms", True),
    ("workspace_bytes", True),
    ("deterministic", True),
    ("measured_at", True),
    ("method", True),
    ("note", False),
    ("heuristic_rank", False),
    ("find_rank", False),
)
_ENTRY_NAMES = {n for n, _ in _ENTRY_FIELDS}
_TOP_LEVEL = {"format", "version", "exported_at", "entries", "convpass_version", "transposes"}
_TRANSPOSE_FIELDS = ("device", "dims", "dtype", "time_ms", "measured_at")
TRANSPOSE_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _entry(device: str, m: Measurement) -> dict[str, Any]:
    return {
        "device": device,
        "key": str(m.key),
        "algo": m.algo,
        "status": m.status,
        "time_ms": m.time_ms,
        "workspace_bytes": m.workspace_bytes,
        "deterministic": m.deterministic,
        "measured_at": m.measured_at,
        "method": m.method,
        "note": m.note,
        "heuristic_rank": m.heuristic_rank,
        "find_rank": m.find_rank,
    }


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------


def default_cache_path() -> Path:
    """``$CONVPASS_CACHE`` if set, else ``$XDG_CACHE_HOME/convpass/tuning.db``.

    Per the XDG spec an unset, empty or relative ``XDG_CACHE_HOME`` means ``~/.cache``.
    """
    env = os.environ.get("CONVPASS_CACHE", "").strip()
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "convpass" / "tuning.db"


# --------------------------------------------------------------------------------------------
# SQLite error classification
# --------------------------------------------------------------------------------------------

_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_CORRUPT, _SQLITE_NOTADB = 5, 6, 11, 26


def _errcode(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    return None if code is None else code & 0xFF


def _is_locked(exc: BaseException) -> bool:
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = _errcode(exc)
    if code is not None:
        return code in (_SQLITE_BUSY, _SQLITE_LOCKED)
    msg = str(exc).lower()
    return "locked" in msg or "busy" in msg


def _is_corrupt(exc: BaseException) -> bool:
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = _errcode(exc)
    if code is not None:
        return code in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    msg = str(exc).lower()
    return "not a database" in msg or "malformed" in msg or "corrupt" in msg


class _Damaged(Exception):
    """Internal: the file is not a usable convpass cache (reason in args[0])."""


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------

_COLUMNS = (
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

# Added in schema version 2 (a version-1 file gets it when opened: _validate_schema).
_TRANSPOSES_TABLE = """CREATE TABLE IF NOT EXISTS transposes (
    device      TEXT NOT NULL,
    dims        TEXT NOT NULL,
    dtype       TEXT NOT NULL,
    time_ms     REAL NOT NULL,
    measured_at REAL NOT NULL,
    PRIMARY KEY (device, dims, dtype)
)"""

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS measurements (
    device          TEXT    NOT NULL,
    key             TEXT    NOT NULL,
    shape           TEXT    NOT NULL,
    algo            TEXT    NOT NULL,
    method          TEXT    NOT NULL,
    status          TEXT    NOT NULL,
    time_ms         REAL,
    workspace_bytes INTEGER NOT NULL,
    deterministic   INTEGER NOT NULL,
    measured_at     REAL    NOT NULL,
    note            TEXT    NOT NULL DEFAULT '',
    heuristic_rank  INTEGER,
    find_rank       INTEGER,
    PRIMARY KEY (device, key, algo, method)
);
CREATE INDEX IF NOT EXISTS measurements_device_shape ON measurements (device, shape);
{_TRANSPOSES_TABLE};
INSERT OR IGNORE INTO meta (name, value) VALUES ('format', '{_APP_TAG}');
INSERT OR IGNORE INTO meta (name, value) VALUES ('schema_version', '{SCHEMA_VERSION}');
"""

_UPSERT = (
    f"INSERT OR REPLACE INTO measurements ({', '.join(_COLUMNS)}) "
    f"VALUES ({', '.join('?' for _ in _COLUMNS)})"
)
_SELECT = (
    "SELECT device, key, algo, method, status, time_ms, workspace_bytes, deterministic, "
    "measured_at, note, heuristic_rank, find_rank FROM measurements"
)
_ORDER = " ORDER BY key, method, time_ms IS NULL, time_ms, algo"


def _in_order(measurements: list[Measurement]) -> list[Measurement]:
    """``measurements`` sorted as :data:`_ORDER` sorts rows. Sorted here, not in SQL: with that
    ORDER BY, SQLite's planner reads the whole device through the primary key instead of the
    (device, shape) index (72 ms against 3 ms per lookup in a 140,000-row cache)."""
    return sorted(measurements, key=lambda m: (str(m.key), m.method, m.time_ms is None, m.time_ms or 0.0, m.algo))


def _row(device: str, m: Measurement) -> tuple[Any, ...]:
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


class TuningCache:
    """The SQLite tuning cache (see the module docstring). Use as a context manager or ``close()``.

    One instance may be shared between threads (calls are serialized); separate processes open
    their own instance on the same file.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, readonly: bool = False) -> None:
        """``readonly``: read an existing cache and change nothing (no file created, upgraded or
        moved aside; a missing or damaged cache is a :class:`CacheError`)."""
        self.path = Path(path).expanduser() if path is not None else default_cache_path()
        self.readonly = readonly
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._keys: dict[str, ProblemKey] = {}
        self._ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the file _conn opened
        self._flock_fd: int | None = None
        self._flock_depth = 0
        self._has_transposes = True  # a version-1 cache read without upgrading it has none
        self._integrity = True  # run SQLite's quick_check when opening (not for the read-only probe of a write)
        if os.path.lexists(self.path) and not self.path.is_dir():
            try:
                check_readable(self.path, "tuning cache")  # no FIFO or device: SQLite would block on it or write to it
            except FileError as e:
                raise CacheError(str(e)) from None
        if readonly:
            if self.path.is_dir():
                raise CacheError(f"tuning cache path {self.path} is a directory; give a file path")
            if not self.path.exists():
                raise CacheError(f"no tuning cache at {self.path} (nothing was created); check the path given with --cache or CONVPASS_CACHE")
            try:
                self._conn = self._retry(self._connect_and_check)
            except _Damaged as d:
                raise CacheError(f"tuning cache {self.path} is damaged ({d}): refused, nothing was changed; a command that writes "
                                 "the cache moves it aside and starts a fresh one") from None
            return
        if self.path.is_file() and self.path.stat().st_size:
            self._probe()  # refused before anything (the open lock's file included) is created beside it
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(
                f"cannot create the tuning cache directory {self.path.parent}: {e.strerror or e}; "
                "choose a writable location with --cache or CONVPASS_CACHE"
            ) from None
        if self.path.is_dir():
            raise CacheError(f"tuning cache path {self.path} is a directory; give a file path")
        self._open()

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> "TuningCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TuningCache({str(self.path)!r})"

    def _unwritable(self, e: BaseException) -> CacheError:
        return CacheError(
            f"tuning cache {self.path} cannot be opened for writing ({e}); "
            "choose a writable location with --cache or CONVPASS_CACHE"
        )

    def _open(self) -> None:
        """Open (creating or repairing) the database; at most a few attempts at moving damage aside.

        Runs under the cross-process open lock, so no other convpass process creates, checks or
        moves the file at this path meanwhile: the file a connection opened is the file at the
        path until this returns.
        """
        with self._lock, self._file_lock():
            for _ in range(8):
                ident = self._identity()
                try:
                    self._conn = self._retry(self._connect_and_check)
                    return
                except _Damaged as d:
                    self.close()
                    self._move_aside(str(d), self._ident)
                except CacheError:
                    # A file replaced under us (a process outside the lock, e.g. a user, moved it)
                    # shows up as "readonly" or I/O errors: open the new file instead.
                    if self._identity() == ident:
                        raise
            raise CacheError(f"tuning cache {self.path} keeps turning out damaged; remove it by hand")

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        """Hold an exclusive ``flock`` on ``<path>.lock`` (reentrant within this instance).

        Serializes opening, checking, moving aside and creating the database between processes.
        """
        if fcntl is None:
            yield
            return
        with self._lock:
            if self._flock_depth == 0:
                lock_path = f"{self.path}.lock"
                try:
                    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
                except OSError as e:
                    raise self._unwritable(e) from None
                try:
                    deadline = time.monotonic() + _LOCK_RETRY_SECONDS
                    delay = 0.002
                    while True:
                        try:
                            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                            break
                        except BlockingIOError:
                            if time.monotonic() > deadline:
                                raise CacheError(
                                    f"tuning cache {self.path}: lock file {lock_path} stayed locked "
                                    f"for over {_LOCK_RETRY_SECONDS:.0f} s"
                                ) from None
                            time.sleep(delay * (0.5 + random.random()))
                            delay = min(delay * 2, 0.1)
                except BaseException:
                    os.close(fd)
                    raise
                self._flock_fd = fd
            self._flock_depth += 1
            try:
                yield
            finally:
                self._flock_depth -= 1
                if self._flock_depth == 0 and self._flock_fd is not None:
                    fd, self._flock_fd = self._flock_fd, None
                    os.close(fd)  # releases the flock

    def _identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino)

    def _connect_and_check(self) -> sqlite3.Connection:
        wanted = os.R_OK if self.readonly else os.R_OK | os.W_OK
        if os.path.exists(self.path) and not os.access(self.path, wanted):
            raise CacheError(
                f"tuning cache {self.path} is not {'readable' if self.readonly else 'readable and writable'}; "
                "choose another location with --cache or CONVPASS_CACHE"
            )
        # read-only: the file as it is when no writer has it open (no -wal file): SQLite then
        # creates no -wal or -shm file beside it, which a read-only connection could not remove
        immutable = "&immutable=1" if not os.path.exists(f"{self.path}-wal") else ""
        try:
            conn = sqlite3.connect(
                f"file:{urllib.parse.quote(os.fspath(self.path.absolute()))}?mode=ro{immutable}" if self.readonly else self.path,
                timeout=_BUSY_TIMEOUT_MS / 1000,
                isolation_level=None,  # we issue BEGIN / COMMIT ourselves
                check_same_thread=False,
                uri=self.readonly,
            )
        except sqlite3.OperationalError as e:
            raise self._unwritable(e) from None
        # sqlite3.connect has opened (or created) the file: under the open lock nothing else moves
        # it, so the path's identity now is the identity of the file this connection reads.
        self._ident = self._identity()
        try:
            conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            self._check_and_init(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _check_and_init(self, conn: sqlite3.Connection) -> None:
        if self.readonly:
            self._check_readonly(conn)
            return
        try:
            # The schema check and creation happen under the write lock, so a process that opens
            # the file while another is creating it waits and then sees the finished schema. The
            # file is not modified before it is known to be ours (or empty).
            conn.execute("BEGIN IMMEDIATE")
            try:
                tables = {
                    r[0]
                    for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                    if not r[0].startswith("sqlite_")
                }
                if not tables:
                    # (not executescript: it would COMMIT the open transaction first)
                    for stmt in _SCHEMA.split(";"):
                        if stmt.strip():
                            conn.execute(stmt)
                else:
                    self._validate_schema(conn, tables)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()
            if mode is None or str(mode[0]).lower() != "wal":
                raise CacheError(f"tuning cache {self.path}: cannot enable WAL journal mode (got {mode})")
            conn.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.DatabaseError as e:
            if _is_corrupt(e):
                self._damaged(f"not a readable SQLite database ({e})")
            if _is_locked(e):
                raise
            raise self._unwritable(e) from None

    def _probe(self) -> None:
        """Before a write-mode open: refuse, changing nothing, a file that is no cache of this
        format (:meth:`_damaged`); a damaged one of this format is left to the open, which moves it aside."""
        self.readonly, self._integrity = True, False
        try:
            self._retry(self._connect_and_check).close()
        except _Damaged:
            pass
        finally:
            self.readonly, self._integrity, self._has_transposes = False, True, True

    def _check_readonly(self, conn: sqlite3.Connection) -> None:
        """:meth:`_check_and_init` for a read-only cache: check, change nothing."""
        try:
            conn.execute("BEGIN")
            try:
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'") if not r[0].startswith("sqlite_")}
                if tables:
                    self._validate_schema(conn, tables)
            finally:
                conn.execute("ROLLBACK")
        except sqlite3.DatabaseError as e:
            if _is_corrupt(e):
                self._damaged(f"not a readable SQLite database ({e})")
            if _is_locked(e):
                raise
            raise CacheError(f"tuning cache {self.path} cannot be read ({e})") from None

    def _damaged(self, reason: str) -> None:
        """Raise for a file that is no usable cache: :class:`_Damaged` (when writing: moved aside,
        a fresh cache started) only for a cache of this convpass's format that is damaged;
        :class:`CacheError` (refused, nothing changed) for everything else: a file that is not
        SQLite (a model, a text file), another program's database, a cache of a newer convpass."""
        if self._ours():
            raise _Damaged(reason)
        raise CacheError(f"tuning cache {self.path} is not a convpass tuning cache ({reason}): refused, nothing was changed; "
                         "give another path with --cache or CONVPASS_CACHE")

    def _ours(self) -> bool:
        """Whether the file is a SQLite database that holds this cache format's tag (found in its
        first MiB even when SQLite cannot read it: the meta table is written first)."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(1 << 20)
        except OSError:
            return False
        return head.startswith(_OURS) and _APP_TAG.encode() in head

    def _validate_schema(self, conn: sqlite3.Connection, tables: set[str]) -> None:
        """Check an existing file; upgrade a version-1 cache (module docstring: schema versions)."""
        try:
            meta = dict(conn.execute("SELECT name, value FROM meta").fetchall()) if "meta" in tables else {}
        except sqlite3.OperationalError:
            meta = {}
        version = meta.get("schema_version")
        if meta.get("format") == _APP_TAG and str(version).isdigit() and int(str(version)) > SCHEMA_VERSION:
            raise CacheError(f"tuning cache {self.path} was written by a newer convpass (schema {version}; this one reads up to "
                             f"{SCHEMA_VERSION}): refused, nothing was changed; upgrade convpass or give another path with --cache")
        if meta.get("format") != _APP_TAG or not {"meta", "measurements"} <= tables or tables - {"meta", "measurements", "transposes"}:
            found = f"meta format {printable(_short(meta.get('format')))}" if meta else f"tables {printable(_short(sorted(tables), 120))}"
            raise CacheError(f"tuning cache {self.path} is another program's SQLite database ({found}), not a convpass tuning cache: "
                             "refused, nothing was changed; give another path with --cache or CONVPASS_CACHE")
        if version == "1" and "transposes" not in tables:
            if self.readonly:
                self._has_transposes = False
            else:
                conn.execute(_TRANSPOSES_TABLE)
                conn.execute("UPDATE meta SET value = ? WHERE name = 'schema_version'", (str(SCHEMA_VERSION),))
        elif version != str(SCHEMA_VERSION) or "transposes" not in tables:
            self._damaged(f"schema version {printable(_short(version))} with tables {sorted(tables)}, expected {SCHEMA_VERSION}")
        cols = tuple(r[1] for r in conn.execute("PRAGMA table_info(measurements)"))
        if set(cols) != set(_COLUMNS):
            self._damaged(f"measurements table has columns {printable(_short(list(cols), 200))}")
        check = conn.execute("PRAGMA quick_check").fetchall() if self._integrity else [("ok",)]
        if check != [("ok",)]:
            self._damaged(f"integrity check failed: {printable(_short(check[0][0] if check else 'no answer', 200))}")

    def _move_aside(self, reason: str, ident: tuple[int, int] | None) -> None:
        """Rename the damaged file ``ident`` (the one our connection opened) out of the way.

        Called with the open lock held, so the identity check and the renames are atomic with
        respect to other convpass processes: a file that is not ``ident`` (a fresh cache another
        process started after moving the damage aside) is never touched.
        """
        assert fcntl is None or self._flock_depth > 0, "_move_aside needs the open lock"
        current = self._identity()
        if current is None or ident is None or current != ident:
            # Another process already moved the damaged file (and maybe started a fresh one).
            return
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while aside.exists():
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return  # someone else moved it already
        except OSError as e:
            raise CacheError(f"tuning cache {self.path} is damaged ({reason}) and cannot be moved aside: {e}") from None
        for suffix in ("-wal", "-shm"):
            side = Path(f"{self.path}{suffix}")
            try:
                os.replace(side, Path(f"{aside}{suffix}"))
            except OSError:
                pass
        warnings.warn(
            f"tuning cache {self.path} was damaged ({reason}); moved it to {aside} and started a fresh cache",
            CacheWarning,
            stacklevel=4,
        )

    # -- retry / transactions -------------------------------------------------------------------

    def _retry(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` again with jittered exponential backoff while the database is locked."""
        deadline = time.monotonic() + _LOCK_RETRY_SECONDS
        delay = 0.005
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as e:
                if not _is_locked(e):
                    raise
                if time.monotonic() > deadline:
                    raise CacheError(
                        f"tuning cache {self.path} stayed locked for over {_LOCK_RETRY_SECONDS:.0f} s ({e})"
                    ) from None
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.5)

    def _run(self, fn: Callable[[sqlite3.Connection], _T], write: bool) -> _T:
        """Run ``fn(conn)`` in one short transaction, retrying on locks, repairing damage once."""

        def attempt() -> _T:
            conn = self._conn
            if conn is None:
                raise CacheError(f"tuning cache {self.path} is closed")
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                result = fn(conn)
                conn.execute("COMMIT")
                return result
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

        with self._lock:
            for repaired in (False, True):
                try:
                    return self._retry(attempt)
                except sqlite3.DatabaseError as e:
                    if _is_corrupt(e) and not repaired:
                        with self._file_lock():
                            ident = self._ident  # the file our connection opened, not the path's now
                            self.close()
                            self._move_aside(f"damaged while in use ({e})", ident)
                            self._open()
                        continue
                    if isinstance(e, sqlite3.OperationalError):
                        raise CacheError(f"tuning cache {self.path}: {e}") from None
                    raise CacheError(f"tuning cache {self.path} is damaged: {e}") from None
            raise AssertionError("unreachable")

    # -- conversion ------------------------------------------------------------------------------

    def _parse_key(self, text: str) -> ProblemKey:
        key = self._keys.get(text)
        if key is None:
            key = self._keys[text] = ProblemKey.parse(text)
        return key

    def _measurement(self, row: tuple[Any, ...], key: ProblemKey | None = None) -> Measurement:
        (_, key_s, algo, method, status, time_ms, ws, det, at, note, hrank, frank) = row
        return Measurement(
            key=key if key is not None else self._parse_key(key_s),
            algo=algo,
            status=status,
            time_ms=time_ms,
            workspace_bytes=ws,
            deterministic=bool(det),
            measured_at=at,
            method=method,
            note=note,
            heuristic_rank=hrank,
            find_rank=frank,
        )

    def _valid_rows(self, rows: list[tuple[Any, ...]]) -> list[tuple[tuple[Any, ...], Measurement]]:
        """(row, measurement) of every row that is a valid measurement on a device fingerprint; the
        rest are skipped as :meth:`_measurements` skips them."""
        pairs, bad = [], []
        for r in rows:
            try:
                DeviceFingerprint.parse(r[0])
                pairs.append((r, self._measurement(r)))
            except (ValueError, TypeError, OverflowError) as e:
                bad.append(str(e))
        self._warn_skipped(bad)
        return pairs

    def _measurements(self, rows: Iterable[tuple[Any, ...]], key: ProblemKey | None = None) -> list[Measurement]:
        """The rows as measurements; a stored row that is not a valid one (written by hand or by
        another program: a status it does not know, a time of 1e300, text where a number goes) is
        skipped, and a :class:`CacheWarning` says how many were."""
        out, bad = [], []
        for r in rows:
            try:
                out.append(self._measurement(r, key))
            except (ValueError, TypeError, OverflowError) as e:
                bad.append(str(e))
        self._warn_skipped(bad)
        return out

    def _warn_skipped(self, reasons: list[str]) -> None:
        if reasons:
            warnings.warn(f"tuning cache {self.path}: skipped {len(reasons)} stored row(s) that are not valid measurements "
                          f"(the first: {printable(_short(reasons[0], 160))})", CacheWarning, stacklevel=4)

    # -- public API ------------------------------------------------------------------------------

    def put(self, device: DeviceFingerprint, measurements: Iterable[Measurement],
            forget: Iterable[tuple[ProblemKey, str, str]] = ()) -> None:
        """Insert or overwrite measurements (one row per key, algo, method) in one transaction;
        ``forget``: rows (key, algo, method) on ``device`` deleted first, in the same transaction
        (those of an earlier measurement that a new one replaces and did not take again, so that no
        old row is left beside the new ones)."""
        if not isinstance(device, DeviceFingerprint):
            raise TypeError(f"device must be a DeviceFingerprint, got {_short(device)}")
        dev = str(device)
        rows = []
        for m in measurements:
            if not isinstance(m, Measurement):
                raise TypeError(f"expected Measurement, got {_short(m)}")
            rows.append(_row(dev, m))
        gone = [(dev, str(key), algo, method) for key, algo, method in forget]

        def write(c: sqlite3.Connection) -> None:
            c.executemany("DELETE FROM measurements WHERE device = ? AND key = ? AND algo = ? AND method = ?", gone)
            c.executemany(_UPSERT, rows)

        if rows or gone:
            self._run(write, write=True)

    def get(self, device: DeviceFingerprint, shape: ConvShape) -> list[Measurement]:
        """Every layout, math mode, algorithm and method measured for this geometry on ``device``."""
        rows = self._run(
            lambda c: c.execute(_SELECT + " WHERE device = ? AND shape = ?", (str(device), str(shape))).fetchall(),
            write=False,
        )
        return _in_order(self._measurements(rows))

    def get_key(self, device: DeviceFingerprint, key: ProblemKey) -> list[Measurement]:
        """Every algorithm and method measured for exactly this problem key on ``device``."""
        rows = self._run(
            lambda c: c.execute(
                _SELECT + " WHERE device = ? AND key = ?" + _ORDER, (str(device), str(key))
            ).fetchall(),
            write=False,
        )
        return self._measurements(rows, key)

    def put_transpose(self, device: DeviceFingerprint, dims: Iterable[int], dtype: str, time_ms: float) -> None:
        """Record the measured time of converting a ``dims`` tensor of ``dtype`` between
        channels-first and channels-last on ``device`` (overwrites an older row)."""
        row = _transpose_row(str(device), dims, dtype, time_ms, time.time())
        self._run(lambda c: c.execute(_TRANSPOSE_UPSERT, row), write=True)

    def get_transpose(self, device: DeviceFingerprint, dims: Iterable[int], dtype: str) -> float | None:
        """The recorded transpose time of :meth:`put_transpose`, or None."""
        text = _dims_text(dims)
        if not self._has_transposes:
            return None
        row = self._run(
            lambda c: c.execute(
                "SELECT time_ms FROM transposes WHERE device = ? AND dims = ? AND dtype = ?", (str(device), text, dtype)
            ).fetchone(),
            write=False,
        )
        try:
            return None if row is None else float(row[0])
        except (TypeError, ValueError):  # a stored row that is no time: as if none were stored
            return None

    def devices(self) -> list[tuple[DeviceFingerprint, int]]:
        """The devices the cache knows, each with its number of distinct problem keys."""
        rows = self._run(
            lambda c: c.execute(
                "SELECT device, COUNT(DISTINCT key) FROM measurements GROUP BY device ORDER BY device"
            ).fetchall(),
            write=False,
        )
        out, bad = [], 0
        for d, n in rows:
            try:
                out.append((DeviceFingerprint.parse(d), n))
            except (ValueError, TypeError):
                bad += 1
        if bad:
            warnings.warn(f"tuning cache {self.path}: skipped the rows of {bad} stored device name(s) that are not device fingerprints",
                          CacheWarning, stacklevel=2)
        return out

    def resolve_device(self, name: str) -> DeviceFingerprint:
        """The cached device a user's ``--device-name`` means.

        Rules, in order:

        1. a full fingerprint string (case-insensitive) names that device;
        2. otherwise every device whose GPU name contains ``name`` (case-insensitive) matches;
        3. no match: :class:`CacheError` listing the devices the cache knows;
        4. several: the one with the newest cuDNN version; among those, the one with the most
           problem keys; if that still ties (different GPUs with identical counts),
           :class:`CacheError` listing the tied fingerprints, so nothing is picked at random.
        """
        if not name.strip():
            raise CacheError("--device-name is empty, which would name every device; give a GPU name (e.g. H100) or a full fingerprint"
                             + (", or --all to clear every device" if self.readonly is False else ""))
        known = self.devices()
        wanted = name.strip().lower()
        exact = [d for d, _ in known if str(d).lower() == wanted]
        if exact:
            return exact[0]
        matches = [(d, n) for d, n in known if d.matches_name(name)]
        if not matches:
            listing = "; ".join(f"{d} ({n} keys)" for d, n in known) or "none (the cache is empty)"
            raise CacheError(f"no device matching {name!r} in tuning cache {self.path}; known devices: {printable(listing)}")
        best = max((d.cudnn_version, n) for d, n in matches)
        top = [d for d, n in matches if (d.cudnn_version, n) == best]
        if len(top) > 1:
            raise CacheError(
                f"device name {name!r} is ambiguous in tuning cache {self.path}: "
                f"{'; '.join(map(str, top))}; give the full fingerprint"
            )
        return top[0]

    def stats(self, device: DeviceFingerprint | None = None) -> dict[str, Any]:
        """Path, size on disk (database + WAL), and per-device key / measurement counts and ages.

        With ``device``, only that device's row (and totals) are reported.
        """
        where, params = ("", ()) if device is None else (" WHERE device = ?", (str(device),))

        def q(c: sqlite3.Connection) -> list[tuple[Any, ...]]:
            return c.execute(
                "SELECT device, COUNT(DISTINCT key), COUNT(*), MIN(measured_at), MAX(measured_at) "
                f"FROM measurements{where} GROUP BY device ORDER BY device",
                params,
            ).fetchall()

        rows = self._run(q, write=False)
        transposes = (self._run(lambda c: c.execute(f"SELECT COUNT(*) FROM transposes{where}", params).fetchone()[0], write=False)
                      if self._has_transposes else 0)
        size = 0
        for p in (self.path, Path(f"{self.path}-wal")):
            try:
                size += p.stat().st_size
            except OSError:
                pass
        devices = [
            {"device": d, "keys": k, "measurements": m, "oldest_measured_at": lo, "newest_measured_at": hi}
            for d, k, m, lo, hi in rows
        ]
        return {
            "path": str(self.path),
            "size_bytes": size,
            "schema_version": SCHEMA_VERSION,
            "devices": devices,
            "keys": sum(d["keys"] for d in devices),
            "measurements": sum(d["measurements"] for d in devices),
            "transposes": transposes,
            "oldest_measured_at": min((d["oldest_measured_at"] for d in devices), default=None),
            "newest_measured_at": max((d["newest_measured_at"] for d in devices), default=None),
        }

    def export_json(self, path: str | os.PathLike[str], device: DeviceFingerprint | None = None) -> int:
        """Write the cache (or one device's part) as JSON, atomically; returns the entry count."""
        where, params = ("", ()) if device is None else (" WHERE device = ?", (str(device),))
        rows = self._run(
            lambda c: c.execute(_SELECT + where + " ORDER BY device, key, method, algo", params).fetchall(),
            write=False,
        )
        entries = [_entry(r[0], m) for r, m in self._valid_rows(rows)]
        transposes = self._run(
            lambda c: c.execute(
                "SELECT device, dims, dtype, time_ms, measured_at FROM transposes" + where + " ORDER BY device, dtype, dims", params
            ).fetchall(),
            write=False,
        ) if self._has_transposes else []
        transposes = [t for t in transposes if _valid_transpose(t)]
        from convpass.core.version import __version__

        doc = {
            "format": EXPORT_FORMAT,
            "version": EXPORT_VERSION,
            "exported_at": time.time(),
            "convpass_version": __version__,
            "entries": entries,
            "transposes": [
                {"device": d, "dims": [int(x) for x in dims.split("x")], "dtype": t, "time_ms": ms, "measured_at": at}
                for d, dims, t, ms, at in transposes
            ],
        }
        try:  # never a special file, a folder or the cache itself
            target = check_output(path, "export file", [(self.path, "the tuning cache")])
        except FileError as e:
            raise CacheError(str(e)) from None
        tmp_name = None
        try:
            fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1, allow_nan=False)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, target)
            tmp_name = None
        except OSError as e:
            raise CacheError(str(os_error(target, e))) from None
        finally:
            if tmp_name is not None:
                try:
                    os.unlink(tmp_name)
                except OSError:
                    pass
        return len(entries)

    def import_json(self, path: str | os.PathLike[str]) -> int:
        """Read an export file into the cache; all or nothing. Returns the number of measurement
        rows imported (its transpose timings are imported with them).

        The whole file is validated first; a bad one raises :class:`CacheError` naming the
        problem and where it is (entry index, field), and the cache is left unchanged. Entries
        overwrite existing rows with the same (device, key, algo, method).
        """
        return self.import_rows(read_export(path))

    def import_rows(self, export: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]) -> int:
        """Write what :func:`read_export` read (measurement rows, transpose rows) in one transaction."""
        rows, transposes = export

        def write(c: sqlite3.Connection) -> None:
            c.executemany(_UPSERT, rows)
            c.executemany(_TRANSPOSE_UPSERT, transposes)

        if rows or transposes:
            self._run(write, write=True)
        return len(rows)

    def clear(self, device: DeviceFingerprint | None = None) -> int:
        """Delete every row (or one device's rows); returns how many were deleted."""
        where, params = ("", ()) if device is None else (" WHERE device = ?", (str(device),))

        def delete(c: sqlite3.Connection) -> int:
            c.execute("DELETE FROM transposes" + where, params)
            return c.execute("DELETE FROM measurements" + where, params).rowcount

        return self._run(delete, write=True)


_TRANSPOSE_UPSERT = "INSERT OR REPLACE INTO transposes (device, dims, dtype, time_ms, measured_at) VALUES (?, ?, ?, ?, ?)"


def _dims_text(dims: Iterable[int]) -> str:
    values = [int(d) for d in dims]
    if not 0 < len(values) <= 8 or any(not 0 < d <= 2**31 - 1 for d in values):
        raise ValueError(f"transpose dims must be 1 to 8 integers from 1 to {2**31 - 1}, got {_short(values)}")
    return "x".join(map(str, values))


def _transpose_row(device: str, dims: Iterable[int], dtype: str, time_ms: float, measured_at: float) -> tuple[Any, ...]:
    if dtype not in TRANSPOSE_DTYPES:
        raise ValueError(f"transpose dtype must be one of {', '.join(TRANSPOSE_DTYPES)}, got {_short(dtype)}")
    if not _is_real(time_ms) or not math.isfinite(time_ms) or time_ms < 0:
        raise ValueError(f"transpose time_ms must be a finite non-negative number, got {_short(time_ms)}")
    if not _is_real(measured_at) or not 0 <= measured_at <= _LATEST_TIME:
        raise ValueError(f"transpose measured_at must be a unix time from 0 to {_LATEST_TIME}, got {_short(measured_at)}")
    return (device, _dims_text(dims), dtype, float(time_ms), float(measured_at))


def _valid_transpose(row: tuple[Any, ...]) -> bool:
    """Whether a stored transpose row (device, dims, dtype, time_ms, measured_at) can be exported."""
    try:
        DeviceFingerprint.parse(row[0])
        _transpose_row(row[0], [int(x) for x in str(row[1]).split("x")], row[2], row[3], row[4])
        return True
    except (ValueError, TypeError):
        return False


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def read_export(path: str | os.PathLike[str]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Validate an export file completely and return the measurement and transpose rows to upsert
    (:meth:`TuningCache.import_rows`)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CacheError(f"cannot read {path}: No such file or directory")
    try:
        data = read_bytes(path, "tuning-cache export", EXPORT_LIMIT)  # no FIFO, no device, bounded
    except FileError as e:
        raise CacheError(str(e)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CacheError(f"{path}: not a convpass tuning-cache export (not UTF-8 text: {e.reason})") from None
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise CacheError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:
        raise CacheError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise CacheError(f"{path}: not a convpass tuning-cache export (JSON nested too deeply)") from None

    def bad(where: str, why: str) -> CacheError:
        return CacheError(f"{path}: {where}: {why}")

    if not isinstance(doc, dict):
        raise bad("top level", f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != EXPORT_FORMAT:
        raise bad("field 'format'", f"expected {EXPORT_FORMAT!r}, got {_short(doc.get('format'))}")
    version = doc.get("version")
    if not _is_int(version) or version not in _READABLE_EXPORT_VERSIONS:
        raise bad("field 'version'", f"unsupported version {_short(version)} (this convpass reads "
                  f"{' and '.join(map(str, _READABLE_EXPORT_VERSIONS))})")
    if version == 1 and "transposes" in doc:
        raise bad("field 'transposes'", "version 1 exports have no transposes")
    extra = sorted(set(doc) - _TOP_LEVEL)
    if extra:
        raise bad("top level", f"unknown field(s) {', '.join(map(repr, extra))}")
    if "exported_at" in doc and not _is_real(doc["exported_at"]):
        raise bad("field 'exported_at'", f"must be a unix time, got {_short(doc['exported_at'])}")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise bad("field 'entries'", f"must be a list, got {_short(entries)}")

    devices: dict[str, str] = {}
    keys: dict[str, ProblemKey] = {}
    rows: list[tuple[Any, ...]] = []
    for i, e in enumerate(entries):
        where = f"entry {i}"
        if not isinstance(e, dict):
            raise bad(where, f"expected a JSON object, got {_short(e)}")
        for name, required in _ENTRY_FIELDS:
            if required and name not in e:
                raise bad(where, f"missing field {name!r}")
        unknown = sorted(set(e) - _ENTRY_NAMES)
        if unknown:
            raise bad(where, f"unknown field(s) {', '.join(map(repr, unknown))}")
        dev_s = e["device"]
        if not isinstance(dev_s, str):
            raise bad(f"{where}, field 'device'", f"must be a string, got {_short(dev_s)}")
        if dev_s not in devices:
            try:
                devices[dev_s] = str(DeviceFingerprint.parse(dev_s))
            except ValueError:
                raise bad(f"{where}, field 'device'", f"not a device fingerprint: {_short(dev_s)}") from None
        key_s = e["key"]
        if not isinstance(key_s, str):
            raise bad(f"{where}, field 'key'", f"must be a string, got {_short(key_s)}")
        if key_s not in keys:
            try:
                keys[key_s] = ProblemKey.parse(key_s)
            except ValueError as err:
                raise bad(f"{where}, field 'key'", f"not a problem key: {_short(key_s)} ({_short(str(err), 200)})") from None
        for name, _ in _ENTRY_FIELDS[2:]:
            if name in e:
                why = _check_field(name, e[name], e["status"])
                if why:
                    raise bad(f"{where}, field {name!r}", why)
        m = Measurement(
            key=keys[key_s],
            **{n: e[n] for n, _ in _ENTRY_FIELDS[2:] if n in e},
        )
        rows.append(_row(devices[dev_s], m))

    transposes = doc.get("transposes", [])
    if not isinstance(transposes, list):
        raise bad("field 'transposes'", f"must be a list, got {_short(transposes)}")
    transpose_rows = []
    for i, t in enumerate(transposes):
        where = f"transpose {i}"
        if not isinstance(t, dict) or set(t) != set(_TRANSPOSE_FIELDS):
            raise bad(where, f"expected an object with exactly the fields {', '.join(_TRANSPOSE_FIELDS)}, got {_short(t)}")
        dev_s = t["device"]
        try:
            device = str(DeviceFingerprint.parse(dev_s)) if isinstance(dev_s, str) else None
        except ValueError:
            device = None
        if device is None:
            raise bad(f"{where}, field 'device'", f"not a device fingerprint: {_short(dev_s)}")
        if not isinstance(t["dims"], list) or not all(_is_int(d) for d in t["dims"]):
            raise bad(f"{where}, field 'dims'", f"must be a list of integers, got {_short(t['dims'])}")
        if not _is_real(t["measured_at"]):
            raise bad(f"{where}, field 'measured_at'", f"must be a unix time, got {_short(t['measured_at'])}")
        try:
            transpose_rows.append(_transpose_row(device, t["dims"], t["dtype"], t["time_ms"], t["measured_at"]))
        except ValueError as err:
            raise bad(where, str(err)) from None
    return rows, transpose_rows

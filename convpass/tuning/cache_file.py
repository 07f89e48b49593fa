"""The tuning cache's SQLite file: where it lives, its schema, and opening it safely.

:class:`CacheFile` opens the file and runs short transactions on it; the store
(:class:`convpass.tuning.cache.TuningCache`) builds its queries on top.

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

Schema versions
    1: measurements only. 2: adds ``transposes``. 3: adds ``fusion_timings``. An older file is
    upgraded in place when opened to write (the tables are added; nothing else changes); opened
    read-only it is read as it is.

No pickle is used anywhere: rows are plain columns.
"""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no cross-process open lock
    fcntl = None  # type: ignore[assignment]

from convpass.core.errors import FileError
from convpass.core.files import check_readable
from convpass.core.text import printable
from convpass.tuning.cache_rows import COLUMNS, CacheError, CacheWarning, short

__all__ = ["SCHEMA_VERSION", "CacheFile", "default_cache_path"]

SCHEMA_VERSION = 3

_APP_TAG = "convpass-tuning-cache"
_BUSY_TIMEOUT_MS = 5_000
_LOCK_RETRY_SECONDS = 60.0  # give up on a lock held this long (beyond the busy timeout)

_T = TypeVar("_T")
_OURS = b"SQLite format 3\x00"


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
# Schema
# --------------------------------------------------------------------------------------------

# Added in schema version 2 (a version-1 file gets it when opened: CacheFile._validate_schema).
_TRANSPOSES_TABLE = """CREATE TABLE IF NOT EXISTS transposes (
    device      TEXT NOT NULL,
    dims        TEXT NOT NULL,
    dtype       TEXT NOT NULL,
    time_ms     REAL NOT NULL,
    measured_at REAL NOT NULL,
    PRIMARY KEY (device, dims, dtype)
)"""

# Added in schema version 3 (a version-1 or -2 file gets it when opened): the timings of fusion
# units (convpass.compiler.fusions), one row per (device, unit signature), so that a cached re-run
# times nothing and writes the same model.
_FUSIONS_TABLE = """CREATE TABLE IF NOT EXISTS fusion_timings (
    device      TEXT NOT NULL,
    signature   TEXT NOT NULL,
    times       TEXT NOT NULL,
    measured_at REAL NOT NULL,
    PRIMARY KEY (device, signature)
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
{_FUSIONS_TABLE};
INSERT OR IGNORE INTO meta (name, value) VALUES ('format', '{_APP_TAG}');
INSERT OR IGNORE INTO meta (name, value) VALUES ('schema_version', '{SCHEMA_VERSION}');
"""


# --------------------------------------------------------------------------------------------
# The file at a path
# --------------------------------------------------------------------------------------------


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def _ours(path: Path) -> bool:
    """Whether the file is a SQLite database that holds this cache format's tag (found in its
    first MiB even when SQLite cannot read it: the meta table is written first)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
    except OSError:
        return False
    return head.startswith(_OURS) and _APP_TAG.encode() in head


def _move_aside(path: Path, reason: str, ident: tuple[int, int] | None) -> None:
    """Rename the damaged file ``ident`` (the one our connection opened) out of the way.

    Called with the open lock held, so the identity check and the renames are atomic with
    respect to other convpass processes: a file that is not ``ident`` (a fresh cache another
    process started after moving the damage aside) is never touched.
    """
    current = _identity(path)
    if current is None or ident is None or current != ident:
        # Another process already moved the damaged file (and maybe started a fresh one).
        return
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return  # someone else moved it already
    except OSError as e:
        raise CacheError(f"tuning cache {path} is damaged ({reason}) and cannot be moved aside: {e}") from None
    for suffix in ("-wal", "-shm"):
        side = Path(f"{path}{suffix}")
        try:
            os.replace(side, Path(f"{aside}{suffix}"))
        except OSError:
            pass
    warnings.warn(
        f"tuning cache {path} was damaged ({reason}); moved it to {aside} and started a fresh cache",
        CacheWarning,
        stacklevel=4,
    )


def _flock(fd: int, path: Path, lock_path: str) -> None:
    """Take an exclusive ``flock`` on ``fd`` (the open lock of the cache at ``path``), waiting with
    jittered backoff for at most :data:`_LOCK_RETRY_SECONDS`."""
    deadline = time.monotonic() + _LOCK_RETRY_SECONDS
    delay = 0.002
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise CacheError(
                    f"tuning cache {path}: lock file {lock_path} stayed locked "
                    f"for over {_LOCK_RETRY_SECONDS:.0f} s"
                ) from None
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.1)


def _retry(fn: Callable[[], _T], path: Path) -> _T:
    """Run ``fn`` again with jittered exponential backoff while the database at ``path`` is locked."""
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
                    f"tuning cache {path} stayed locked for over {_LOCK_RETRY_SECONDS:.0f} s ({e})"
                ) from None
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.5)


class CacheFile:
    """An open tuning-cache file (see the module docstring): checked, created, upgraded or moved
    aside when opened; :meth:`_run` runs a function in one short transaction on it.

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
        self._ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the file _conn opened
        self._flock_fd: int | None = None
        self._flock_depth = 0
        self._has_transposes = True  # a version-1 cache read without upgrading it has none
        self._has_fusions = True  # a version-1 or -2 cache read without upgrading it has none
        self._integrity = True  # run SQLite's quick_check when opening (not for the read-only probe of a write)
        if os.path.lexists(self.path) and not self.path.is_dir():
            try:
                check_readable(self.path, "tuning cache")  # no FIFO or device: SQLite would block on it or write to it
            except FileError as e:
                if os.path.lexists(self.path):  # gone meanwhile: another process moved damage aside; opened below as absent
                    raise CacheError(str(e)) from None
        if readonly:
            if self.path.is_dir():
                raise CacheError(f"tuning cache path {self.path} is a directory; give a file path")
            if not self.path.exists():
                raise CacheError(f"no tuning cache at {self.path} (nothing was created); check the path given with --cache or CONVPASS_CACHE")
            try:
                self._conn = _retry(self._connect_and_check, self.path)
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

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

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
                ident = _identity(self.path)
                try:
                    self._conn = _retry(self._connect_and_check, self.path)
                    return
                except _Damaged as d:
                    self.close()
                    _move_aside(self.path, str(d), self._ident)
                except CacheError:
                    # A file replaced under us (a process outside the lock, e.g. a user, moved it)
                    # shows up as "readonly" or I/O errors: open the new file instead.
                    if _identity(self.path) == ident:
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
                    _flock(fd, self.path, lock_path)
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
        self._ident = _identity(self.path)
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
            try:
                _retry(self._connect_and_check, self.path).close()
            except CacheError:
                if not os.path.exists(f"{self.path}.lock"):
                    raise
                # another convpass process may be starting a fresh cache here this moment (after
                # moving a damaged one aside): look again once it is done, under the open lock
                with self._file_lock():
                    _retry(self._connect_and_check, self.path).close()
        except _Damaged:
            pass
        finally:
            self.readonly, self._integrity, self._has_transposes, self._has_fusions = False, True, True, True

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
        if _ours(self.path):
            raise _Damaged(reason)
        raise CacheError(f"tuning cache {self.path} is not a convpass tuning cache ({reason}): refused, nothing was changed; "
                         "give another path with --cache or CONVPASS_CACHE")

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
        if meta.get("format") != _APP_TAG or not {"meta", "measurements"} <= tables or tables - {"meta", "measurements", "transposes", "fusion_timings"}:
            found = f"meta format {printable(short(meta.get('format')))}" if meta else f"tables {printable(short(sorted(tables), 120))}"
            raise CacheError(f"tuning cache {self.path} is another program's SQLite database ({found}), not a convpass tuning cache: "
                             "refused, nothing was changed; give another path with --cache or CONVPASS_CACHE")
        if version in ("1", "2") and ("transposes" in tables) == (version == "2") and "fusion_timings" not in tables:
            if self.readonly:
                self._has_transposes, self._has_fusions = "transposes" in tables, False
            else:
                conn.execute(_TRANSPOSES_TABLE)
                conn.execute(_FUSIONS_TABLE)
                conn.execute("UPDATE meta SET value = ? WHERE name = 'schema_version'", (str(SCHEMA_VERSION),))
        elif version != str(SCHEMA_VERSION) or not {"transposes", "fusion_timings"} <= tables:
            self._damaged(f"schema version {printable(short(version))} with tables {sorted(tables)}, expected {SCHEMA_VERSION}")
        cols = tuple(r[1] for r in conn.execute("PRAGMA table_info(measurements)"))
        if set(cols) != set(COLUMNS):
            self._damaged(f"measurements table has columns {printable(short(list(cols), 200))}")
        check = conn.execute("PRAGMA quick_check").fetchall() if self._integrity else [("ok",)]
        if check != [("ok",)]:
            self._damaged(f"integrity check failed: {printable(short(check[0][0] if check else 'no answer', 200))}")

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
                    return _retry(attempt, self.path)
                except sqlite3.DatabaseError as e:
                    if _is_corrupt(e) and not repaired:
                        with self._file_lock():
                            ident = self._ident  # the file our connection opened, not the path's now
                            self.close()
                            _move_aside(self.path, f"damaged while in use ({e})", ident)
                            self._open()
                        continue
                    if isinstance(e, sqlite3.OperationalError):
                        raise CacheError(f"tuning cache {self.path}: {e}") from None
                    raise CacheError(f"tuning cache {self.path} is damaged: {e}") from None
            raise AssertionError("unreachable")

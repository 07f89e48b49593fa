"""The tuning cache: every measurement convpass has taken, per device, in one SQLite file.

What it holds
    One row per (device fingerprint, problem key, algorithm, method): the candidate's status,
    time, workspace, determinism, when it was measured, and where cuDNN ranked it
    (:class:`~convpass.tuning.cache_rows.Measurement`). ``method`` says how the row came about:
    ``measure`` (convpass's own timing harness), ``find`` (cuDNN's Find), ``heuristic`` (not
    timed, only ranked by cuDNN's ``_v7`` heuristic) or ``epilogue`` (the activation of a fused
    epilogue timed as its own pass over the key's output; its algo is the fusion's name:
    :mod:`convpass.tuning.decide`). Graph-API engines are ``measure`` rows whose algo is
    ``engine:<cuDNN plan name>[+<fusion>]``. Lookups by geometry (:meth:`TuningCache.get`) return
    every memory format, math mode, channel slice (keys ending ``|xslice=..`` / ``|yslice=..`` /
    ``|zslice=..``: the input read from, the output written into, the fused residual read from a
    slice of a wider buffer) and algorithm
    measured for a :class:`~convpass.core.problem.ConvShape` in one indexed query.

    Beside them, one row per (device, tensor dims, dtype) in ``transposes``: the measured time of
    converting such a tensor between channels-first and channels-last
    (:meth:`TuningCache.put_transpose`). The whole-graph layout plan weighs conv times against these
    (:mod:`convpass.compiler.passes.plan_layouts`); keeping them makes a cached re-run plan the same layouts as
    the run that measured, and lets a machine without a GPU plan them too.

The file
    Where it lives, how several processes share it, how damaged and foreign files are refused or
    moved aside, and its schema versions: :mod:`convpass.tuning.cache_file`.

Exchange
    :meth:`TuningCache.export_json` / :meth:`TuningCache.import_json` move measurements between
    machines as JSON: :mod:`convpass.tuning.cache_exchange`.

No pickle is used anywhere: rows are plain columns, exchange files are plain JSON.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import time
import warnings
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from convpass.core.device import DeviceFingerprint
from convpass.core.problem import ConvShape, ProblemKey
from convpass.core.text import printable
from convpass.tuning.cache_exchange import export_document, export_entry, read_export, write_export
from convpass.tuning.cache_file import SCHEMA_VERSION, CacheFile
from convpass.tuning.cache_rows import (
    COLUMNS,
    CacheError,
    CacheWarning,
    Measurement,
    dims_text,
    fusion_times,
    short,
    stored_row,
    transpose_row,
    valid_transpose,
)

__all__ = ["TuningCache"]

_UPSERT = (
    f"INSERT OR REPLACE INTO measurements ({', '.join(COLUMNS)}) "
    f"VALUES ({', '.join('?' for _ in COLUMNS)})"
)
_SELECT = (
    "SELECT device, key, algo, method, status, time_ms, workspace_bytes, deterministic, "
    "measured_at, note, heuristic_rank, find_rank FROM measurements"
)
_ORDER = " ORDER BY key, method, time_ms IS NULL, time_ms, algo"
_TRANSPOSE_UPSERT = "INSERT OR REPLACE INTO transposes (device, dims, dtype, time_ms, measured_at) VALUES (?, ?, ?, ?, ?)"


def _in_order(measurements: list[Measurement]) -> list[Measurement]:
    """``measurements`` sorted as :data:`_ORDER` sorts rows. Sorted here, not in SQL: with that
    ORDER BY, SQLite's planner reads the whole device through the primary key instead of the
    (device, shape) index (72 ms against 3 ms per lookup in a 140,000-row cache)."""
    return sorted(measurements, key=lambda m: (str(m.key), m.method, m.time_ms is None, m.time_ms or 0.0, m.algo))


def _size_on_disk(path: Path) -> int:
    """Bytes of the database and its WAL file."""
    size = 0
    for p in (path, Path(f"{path}-wal")):
        try:
            size += p.stat().st_size
        except OSError:
            pass
    return size


class TuningCache(CacheFile):
    """The SQLite tuning cache (see the module docstring): ``TuningCache(path, readonly=False)``
    (:class:`~convpass.tuning.cache_file.CacheFile` opens the file). Use as a context manager or
    ``close()``.

    One instance may be shared between threads (calls are serialized); separate processes open
    their own instance on the same file.
    """

    def __enter__(self) -> TuningCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TuningCache({str(self.path)!r})"

    # -- conversion ------------------------------------------------------------------------------

    @functools.cached_property
    def _keys(self) -> dict[str, ProblemKey]:
        """The problem keys parsed so far, by their text: each stored key is parsed once."""
        return {}

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
                          f"(the first: {printable(short(reasons[0], 160))})", CacheWarning, stacklevel=4)

    # -- public API ------------------------------------------------------------------------------

    def put(self, device: DeviceFingerprint, measurements: Iterable[Measurement],
            forget: Iterable[tuple[ProblemKey, str, str]] = ()) -> None:
        """Insert or overwrite measurements (one row per key, algo, method) in one transaction;
        ``forget``: rows (key, algo, method) on ``device`` deleted first, in the same transaction
        (those of an earlier measurement that a new one replaces and did not take again, so that no
        old row is left beside the new ones)."""
        if not isinstance(device, DeviceFingerprint):
            raise TypeError(f"device must be a DeviceFingerprint, got {short(device)}")
        dev = str(device)
        rows = []
        for m in measurements:
            if not isinstance(m, Measurement):
                raise TypeError(f"expected Measurement, got {short(m)}")
            rows.append(stored_row(dev, m))
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

    def device_rows(self, device: DeviceFingerprint) -> list[Measurement]:
        """Every measurement of ``device``, in one query (a run's history: :mod:`convpass.tuning.prune`)."""
        rows = self._run(lambda c: c.execute(_SELECT + " WHERE device = ?", (str(device),)).fetchall(), write=False)
        return self._measurements(rows)

    def put_transpose(self, device: DeviceFingerprint, dims: Iterable[int], dtype: str, time_ms: float) -> None:
        """Record the measured time of converting a ``dims`` tensor of ``dtype`` between
        channels-first and channels-last on ``device`` (overwrites an older row)."""
        row = transpose_row(str(device), dims, dtype, time_ms, time.time())
        self._run(lambda c: c.execute(_TRANSPOSE_UPSERT, row), write=True)

    def get_transpose(self, device: DeviceFingerprint, dims: Iterable[int], dtype: str) -> float | None:
        """The recorded transpose time of :meth:`put_transpose`, or None."""
        text = dims_text(dims)
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


    def put_fusion(self, device: DeviceFingerprint, signature: str, times: Mapping[str, float]) -> None:
        """Record the timings of a fusion unit of ``signature`` (its kind, ops and shapes, as
        :mod:`convpass.compiler.fusions` names them) on ``device`` (overwrites an older row)."""
        row = (str(device), signature, json.dumps({k: float(v) for k, v in times.items()}, sort_keys=True), time.time())
        self._run(lambda c: c.execute("INSERT OR REPLACE INTO fusion_timings (device, signature, times, measured_at) VALUES (?, ?, ?, ?)", row),
                  write=True)

    def get_fusion(self, device: DeviceFingerprint, signature: str, required: Collection[str] = ()) -> dict[str, float] | None:
        """The timings :meth:`put_fusion` recorded (holding at least the ``required`` names), or None.
        A stored value that is not such timings (written by hand or by another program: not JSON,
        nested too deeply, a time that is not a finite number >= 0, a name missing) is as if none
        were stored, and a :class:`CacheWarning` says so: the unit is timed again where a GPU
        measures, else recorded as not measured."""
        if not self._has_fusions:
            return None
        found = self._run(lambda c: c.execute("SELECT times FROM fusion_timings WHERE device = ? AND signature = ?",
                                              (str(device), signature)).fetchone(), write=False)
        if found is None:
            return None
        try:
            return fusion_times(found[0], required)
        except ValueError as e:
            warnings.warn(f"tuning cache {self.path}: skipped the stored timings of 1 fusion unit(s) that are not valid timings "
                          f"(the first: {printable(short(str(e), 160))})", CacheWarning, stacklevel=2)
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
        size = _size_on_disk(self.path)
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
        """Write the cache (or one device's part) as JSON, atomically; returns the entry count
        (the format: :mod:`convpass.tuning.cache_exchange`)."""
        where, params = ("", ()) if device is None else (" WHERE device = ?", (str(device),))
        rows = self._run(
            lambda c: c.execute(_SELECT + where + " ORDER BY device, key, method, algo", params).fetchall(),
            write=False,
        )
        entries = [export_entry(r[0], m) for r, m in self._valid_rows(rows)]
        transposes = self._run(
            lambda c: c.execute(
                "SELECT device, dims, dtype, time_ms, measured_at FROM transposes" + where + " ORDER BY device, dtype, dims", params
            ).fetchall(),
            write=False,
        ) if self._has_transposes else []
        transposes = [t for t in transposes if valid_transpose(t)]
        write_export(path, export_document(entries, transposes), self.path)
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
        """Write what :func:`~convpass.tuning.cache_exchange.read_export` read (measurement rows,
        transpose rows) in one transaction."""
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

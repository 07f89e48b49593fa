"""The tuning cache's exchange format: JSON export files, their writing and their validation.

:meth:`TuningCache.export_json <convpass.tuning.cache.TuningCache.export_json>` /
:meth:`TuningCache.import_json <convpass.tuning.cache.TuningCache.import_json>` move measurements
between machines (a GPU fleet tunes, a GPU-less build machine applies) as JSON::

    {"format": "convpass-tuning-cache", "version": 2, "exported_at": <unix time>,
     "entries": [{"device": "<fingerprint>", "key": "<problem key>", "algo": ..., ...}],
     "transposes": [...]}

Version 2 added ``"transposes"``: ``{"device", "dims": [..], "dtype", "time_ms", "measured_at"}``
each; version 1 files (no transposes) still import. Import checks the whole file before writing
anything (:func:`read_export`) and writes it in one transaction.

No pickle is used: exchange files are plain JSON.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from convpass.core.device import DeviceFingerprint
from convpass.core.errors import FileError
from convpass.core.files import check_output, os_error, read_bytes
from convpass.core.problem import ProblemKey
from convpass.tuning.cache_rows import CacheError, Measurement, check_field, is_int, is_real, short, stored_row, transpose_row

__all__ = ["EXPORT_FORMAT", "EXPORT_LIMIT", "EXPORT_VERSION", "export_document", "export_entry", "read_export", "write_export"]

EXPORT_FORMAT = "convpass-tuning-cache"
EXPORT_VERSION = 2
_READABLE_EXPORT_VERSIONS = (1, 2)
EXPORT_LIMIT = 1 << 30  # the largest export file convpass reads

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


def export_entry(device: str, m: Measurement) -> dict[str, Any]:
    """The JSON entry of measurement ``m`` on ``device``."""
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


def export_document(entries: list[dict[str, Any]], transposes: list[tuple[Any, ...]]) -> dict[str, Any]:
    """The export file's JSON document: ``entries`` (:func:`export_entry`) and stored transpose rows
    (device, dims text, dtype, time_ms, measured_at)."""
    from convpass.core.version import __version__

    return {
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


def write_export(path: str | os.PathLike[str], doc: dict[str, Any], cache_path: Path) -> None:
    """Write ``doc`` to ``path`` atomically; never to a special file, a folder or the cache itself."""
    try:
        target = check_output(path, "export file", [(cache_path, "the tuning cache")])
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


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def read_export(path: str | os.PathLike[str]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Validate an export file completely and return the measurement and transpose rows to upsert
    (:meth:`TuningCache.import_rows <convpass.tuning.cache.TuningCache.import_rows>`)."""
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
        raise bad("field 'format'", f"expected {EXPORT_FORMAT!r}, got {short(doc.get('format'))}")
    version = doc.get("version")
    if not is_int(version) or version not in _READABLE_EXPORT_VERSIONS:
        raise bad("field 'version'", f"unsupported version {short(version)} (this convpass reads "
                  f"{' and '.join(map(str, _READABLE_EXPORT_VERSIONS))})")
    if version == 1 and "transposes" in doc:
        raise bad("field 'transposes'", "version 1 exports have no transposes")
    extra = sorted(set(doc) - _TOP_LEVEL)
    if extra:
        raise bad("top level", f"unknown field(s) {', '.join(map(repr, extra))}")
    if "exported_at" in doc and not is_real(doc["exported_at"]):
        raise bad("field 'exported_at'", f"must be a unix time, got {short(doc['exported_at'])}")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise bad("field 'entries'", f"must be a list, got {short(entries)}")

    devices: dict[str, str] = {}
    keys: dict[str, ProblemKey] = {}
    rows: list[tuple[Any, ...]] = []
    for i, e in enumerate(entries):
        where = f"entry {i}"
        if not isinstance(e, dict):
            raise bad(where, f"expected a JSON object, got {short(e)}")
        for name, required in _ENTRY_FIELDS:
            if required and name not in e:
                raise bad(where, f"missing field {name!r}")
        unknown = sorted(set(e) - _ENTRY_NAMES)
        if unknown:
            raise bad(where, f"unknown field(s) {', '.join(map(repr, unknown))}")
        dev_s = e["device"]
        if not isinstance(dev_s, str):
            raise bad(f"{where}, field 'device'", f"must be a string, got {short(dev_s)}")
        if dev_s not in devices:
            try:
                devices[dev_s] = str(DeviceFingerprint.parse(dev_s))
            except ValueError:
                raise bad(f"{where}, field 'device'", f"not a device fingerprint: {short(dev_s)}") from None
        key_s = e["key"]
        if not isinstance(key_s, str):
            raise bad(f"{where}, field 'key'", f"must be a string, got {short(key_s)}")
        if key_s not in keys:
            try:
                keys[key_s] = ProblemKey.parse(key_s)
            except ValueError as err:
                raise bad(f"{where}, field 'key'", f"not a problem key: {short(key_s)} ({short(str(err), 200)})") from None
        for name, _ in _ENTRY_FIELDS[2:]:
            if name in e:
                why = check_field(name, e[name], e["status"])
                if why:
                    raise bad(f"{where}, field {name!r}", why)
        m = Measurement(
            key=keys[key_s],
            **{n: e[n] for n, _ in _ENTRY_FIELDS[2:] if n in e},
        )
        rows.append(stored_row(devices[dev_s], m))

    transposes = doc.get("transposes", [])
    if not isinstance(transposes, list):
        raise bad("field 'transposes'", f"must be a list, got {short(transposes)}")
    transpose_rows = []
    for i, t in enumerate(transposes):
        where = f"transpose {i}"
        if not isinstance(t, dict) or set(t) != set(_TRANSPOSE_FIELDS):
            raise bad(where, f"expected an object with exactly the fields {', '.join(_TRANSPOSE_FIELDS)}, got {short(t)}")
        dev_s = t["device"]
        try:
            device = str(DeviceFingerprint.parse(dev_s)) if isinstance(dev_s, str) else None
        except ValueError:
            device = None
        if device is None:
            raise bad(f"{where}, field 'device'", f"not a device fingerprint: {short(dev_s)}")
        if not isinstance(t["dims"], list) or not all(is_int(d) for d in t["dims"]):
            raise bad(f"{where}, field 'dims'", f"must be a list of integers, got {short(t['dims'])}")
        if not is_real(t["measured_at"]):
            raise bad(f"{where}, field 'measured_at'", f"must be a unix time, got {short(t['measured_at'])}")
        try:
            transpose_rows.append(transpose_row(device, t["dims"], t["dtype"], t["time_ms"], t["measured_at"]))
        except ValueError as err:
            raise bad(where, str(err)) from None
    return rows, transpose_rows

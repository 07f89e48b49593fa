"""``convpass cache stats | export FILE.json | import FILE.json | clear [--device-name NAME] [--cache PATH]``.

The command line of the tuning cache (:mod:`convpass.tuning.cache` is the store). ``stats`` and
``export`` only read: a cache file that does not exist is an error there, not a new empty cache.
With ``--json`` each action prints one ``convpass.cache/1`` document (docs/cli.md).
"""

from __future__ import annotations

import argparse
import datetime as _dt
from pathlib import Path
from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table

from convpass.cli.output import add_json_options, emit_json, printable, result_console
from convpass.core.device import DeviceFingerprint
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_exchange import read_export
from convpass.tuning.cache_file import default_cache_path
from convpass.tuning.cache_rows import CacheError

__all__ = ["ACTIONS", "add_cache_parser", "cache_command"]

ACTIONS = ("stats", "export", "import", "clear")
SCHEMA = "convpass.cache/1"


def add_cache_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cache`` on an argparse subparsers object; sets ``func=cache_command``."""
    p = subparsers.add_parser(
        "cache",
        help="inspect, export, import or clear the tuning cache",
        description=(
            "Inspect, export, import or clear the tuning cache. "
            "Default location: $CONVPASS_CACHE, else $XDG_CACHE_HOME/convpass/tuning.db."
        ),
    )
    p.add_argument("action", choices=ACTIONS,
                   help="stats (what the cache holds), export FILE.json, import FILE.json, clear (delete measurements)")
    p.add_argument("file", nargs="?", help="the JSON file for export / import")
    p.add_argument(
        "--device-name", metavar="NAME",
        help="limit to one device: a full fingerprint or part of the GPU name (e.g. H200); "
        "several matches pick the newest cuDNN, then the most entries",
    )
    p.add_argument("--all", action="store_true", help="clear: every device's rows (clear needs --device-name or --all)")
    p.add_argument("--cache", metavar="PATH", help="tuning cache file (default: $CONVPASS_CACHE or the XDG cache dir)")
    add_json_options(p, SCHEMA)
    p.set_defaults(func=cache_command)
    return p


def _when(ts: Any) -> str:
    if ts is None:
        return "-"
    try:
        return _dt.datetime.fromtimestamp(float(ts), tz=_dt.timezone.utc).strftime("%Y-%m-%d")
    except (TypeError, ValueError, OverflowError, OSError):  # a stored row's time that is no date
        return "?"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _check_args(action: str, file: str | None, name: str | None, cache: str | None, clear_all: bool) -> None:
    if action in ("export", "import") and file is None:
        raise CacheError(f"'convpass cache {action}' needs a FILE.json")
    if action in ("stats", "clear") and file:
        raise CacheError(f"'convpass cache {action}' takes no FILE (got {file!r})")
    if action == "import" and name is not None:
        raise CacheError("--device-name does not apply to 'cache import' (a file is imported whole)")
    if name is not None and not name.strip():
        raise CacheError("--device-name is empty, which would name every device; give a GPU name (e.g. H100) or a full fingerprint"
                         + (", or --all to clear every device" if action == "clear" else ""))
    if clear_all and (action != "clear" or name is not None):
        raise CacheError("--all goes with 'cache clear' alone (every device's rows), not with --device-name or another action")
    if action == "clear" and name is None and not clear_all:
        raise CacheError("'convpass cache clear' needs --device-name NAME (that device's rows) or --all (every device's rows); "
                         "nothing was deleted")
    path = Path(cache).expanduser() if cache else default_cache_path()
    if action in ("stats", "export", "clear") and not path.exists():  # never create a cache where none is
        raise CacheError(f"no tuning cache at {path} (--cache PATH names another; nothing was created)")


def _stats_table(st: dict[str, Any]) -> Table:
    table = Table(box=box.SIMPLE_HEAD)
    for col, just in (("device", "left"), ("sm", "left"), ("SMs", "right"), ("cuDNN", "left"), ("keys", "right"),
                      ("rows", "right"), ("oldest", "left"), ("newest", "left")):
        table.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
    for d in st["devices"]:
        try:
            fp = DeviceFingerprint.parse(d["device"])
            named = [fp.name, fp.compute_capability, str(fp.sm_count), fp.cudnn_version_str]
        except (ValueError, TypeError):  # a stored device name that is no fingerprint: shown escaped
            named = [str(d["device"])[:80], "?", "?", "?"]
        cells = [*named, str(d["keys"]), str(d["measurements"]), _when(d["oldest_measured_at"]), _when(d["newest_measured_at"])]
        table.add_row(*(escape(printable(c)) for c in cells))
    return table


def cache_command(args: argparse.Namespace) -> int:
    """Handler of ``convpass cache``; raises :class:`CacheError` on any user-facing problem."""
    action = args.action
    file = getattr(args, "file", None)
    name = getattr(args, "device_name", None)
    clear_all = bool(getattr(args, "all", False))
    _check_args(action, file, name, getattr(args, "cache", None), clear_all)
    console = result_console(args)
    imported = read_export(file) if action == "import" else None  # the whole file checked before the cache is opened (or made)
    with TuningCache(getattr(args, "cache", None), readonly=action in ("stats", "export")) as cache:
        device = cache.resolve_device(name) if name is not None else None
        if action == "stats":
            st = cache.stats(device)
            emit_json(args, {"schema": SCHEMA, "action": "stats", **st})
            console.print(
                f"tuning cache [bold]{escape(printable(st['path']))}[/bold] ({_size(st['size_bytes'])}): "
                f"{st['measurements']} measurements of {st['keys']} problem keys, {st['transposes']} transpose timings; dates in UTC"
            )
            console.print(_stats_table(st) if st["devices"] else "no measurements")
            return 0
        if action == "export":
            n = cache.export_json(file, device)
            result = {"file": str(file), "device": str(device) if device else None, "entries": n}
            text = f"exported {n} measurements{f' for {device}' if device else ''} to {file}"
        elif action == "import":
            n = cache.import_rows(imported)  # type: ignore[arg-type]
            result = {"file": str(file), "entries": n, "cache": str(cache.path)}
            text = f"imported {n} measurements from {file} into {cache.path}"
        else:  # clear
            n = cache.clear(device)
            result = {"device": str(device) if device else None, "deleted": n, "cache": str(cache.path)}
            text = f"cleared {n} measurements {f'for {device}' if device else '(all devices)'} from {cache.path}"
        emit_json(args, {"schema": SCHEMA, "action": action, **result})
        console.print(printable(text), markup=False)
    return 0

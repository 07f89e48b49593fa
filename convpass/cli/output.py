"""What every verb of the command line shares: ``-v`` / ``-q``, ``--json`` / ``--json-file`` and where output goes.

* ``-v`` / ``--verbose`` sets convpass's own logger (``convpass``) to DEBUG; other libraries'
  loggers (onnx-ir's, ...) stay at WARNING. ``-q`` / ``--quiet`` prints errors only. Both are
  accepted before the verb and after it.
* ``--json`` prints the verb's result as one JSON document on stdout (its schema: docs/cli.md,
  :mod:`convpass.cli.schemas`), and nothing else goes to stdout then: messages, warnings and
  progress go to stderr. ``--json-file PATH`` writes the same document to a file, atomically.
* A result a person reads goes to stdout (:func:`result_console`); messages go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

from convpass.core.errors import ConvpassError
from convpass.core.text import PrintableFilter
from convpass.core.text import printable as _printable

__all__ = ["add_common_options", "add_json_options", "configure_logging", "emit_json", "message_console", "printable",
           "result_console", "write_text_atomic"]

_HANDLER_NAME = "convpass-cli"


def add_common_options(p: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``-v`` and ``-q``. On a verb their default is left unset, so a flag given before the verb
    (on the top-level parser, ``top=True``) is not reset by the verb's parser."""
    default: Any = False if top else argparse.SUPPRESS
    group = p.add_argument_group("output")
    group.add_argument("-v", "--verbose", action="store_true", default=default,
                       help="debug messages from convpass (logger 'convpass'; other libraries stay at warnings)")
    group.add_argument("-q", "--quiet", action="store_true", default=default, help="print errors only")


def add_json_options(p: argparse.ArgumentParser, schema: str) -> None:
    """``--json`` (stdout) and ``--json-file PATH``; ``schema``: the document's name (docs/cli.md)."""
    group = p.add_argument_group("machine-readable output")
    group.add_argument("--json", action="store_true",
                       help=f"print the result as one JSON document ({schema}, docs/cli.md) on stdout; messages go to stderr")
    group.add_argument("--json-file", metavar="PATH", help=f"write the same JSON document ({schema}) to PATH (atomically)")


def printable(text: object) -> str:
    """Text from a file, safe for a terminal (:func:`convpass.core.text.printable`), lines kept."""
    return _printable(text, keep_newlines=True)


def configure_logging(verbose: bool, quiet: bool) -> None:
    """convpass's logger at DEBUG (``-v``), ERROR (``-q``) or WARNING, through one rich handler on
    stderr; the root logger (every other library's) at WARNING."""
    logger = logging.getLogger("convpass")
    # neither flag: the level the root logger gives (WARNING here; an embedding program's own)
    logger.setLevel(logging.DEBUG if verbose else logging.ERROR if quiet else logging.NOTSET)
    root = logging.getLogger()
    if not root.handlers:  # an embedding program that set up logging keeps its own
        handler = RichHandler(console=Console(stderr=True), show_time=False, show_path=False, markup=False)
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(PrintableFilter())  # names in messages come from files: no control character reaches the terminal
        root.addHandler(handler)
        root.setLevel(logging.WARNING)


def result_console(args: argparse.Namespace) -> Console:
    """Where a verb prints the result a person reads: stdout; silent under ``--json`` (stdout holds
    the document then) and ``-q``. The width is the terminal's (80 columns when not a terminal,
    or ``COLUMNS``)."""
    return Console(quiet=bool(getattr(args, "json", False) or getattr(args, "quiet", False)), highlight=False)


def message_console(args: argparse.Namespace) -> Console:
    """Where a verb's messages and progress go: stderr, silent under ``-q``."""
    return Console(stderr=True, quiet=bool(getattr(args, "quiet", False)), highlight=False, soft_wrap=True)


def emit_json(args: argparse.Namespace, document: dict[str, Any]) -> None:
    """The verb's result document: on stdout under ``--json``, into ``--json-file``'s file."""
    text = json.dumps(document, indent=2, allow_nan=False, default=str)
    if getattr(args, "json", False):
        print(text, flush=True)
    path = getattr(args, "json_file", None)
    if path:
        write_text_atomic(path, text + "\n", "--json-file")


def write_text_atomic(path: str | os.PathLike[str], text: str, option: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it into place; refuses a
    target that exists and is not a regular file (a folder, a device, a FIFO). ``option`` names the
    option the path came from, for the message."""
    target = Path(path)
    if str(path) == "":
        raise ConvpassError(f"{option}: empty path")
    if target.exists() and not target.is_file():
        raise ConvpassError(f"{option} {path}: exists and is not a regular file; nothing was written")
    folder = target.resolve().parent
    if not folder.is_dir():
        raise ConvpassError(f"{option} {path}: folder {folder} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise ConvpassError(f"{option} {path}: cannot write in {folder} ({e.strerror})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise ConvpassError(f"{option} {path}: cannot write ({e.strerror})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

"""What every verb of the command line shares: ``-v`` / ``-q``, ``--json`` / ``--json-file`` and where output goes.

* ``-v`` / ``--verbose`` sets convpass's own logger (``convpass``) to DEBUG; other libraries'
  loggers (onnx-ir's, ...) stay at WARNING. ``-q`` / ``--quiet`` prints errors only. Both are
  accepted before the verb and after it.
* ``--json`` prints the verb's result as one JSON document on stdout (its schema: docs/cli.md,
  :mod:`convpass.cli.schemas`), and nothing else goes to stdout then: messages, warnings and
  progress go to stderr. ``--json-file PATH`` writes the same document to a file, atomically.
* ``--json-file``, ``--html`` (inspect) and ``--plot`` (bench) are checked before the verb does any work (:func:`check_outputs`)
  and again when written (:func:`convpass.core.files.write_text_atomically`): never a folder, a
  device, a FIFO, nor one of the files the command reads or writes otherwise (:func:`protected`:
  the input model, the tuning cache, the output model, ...).
* A result a person reads goes to stdout (:func:`result_console`); messages go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

from convpass.core.files import check_output, write_text_atomically
from convpass.core.text import PrintableFilter
from convpass.core.text import printable as _printable

__all__ = ["add_common_options", "add_json_options", "check_outputs", "configure_logging", "emit_json", "message_console",
           "printable", "protected", "result_console", "write_report"]

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


# what each option's files are, in refusals: (attribute, what it is, its side files)
_FILES = (("model", "the input model", (".kernels", "the kernel side-car")), ("models", "an input model", None),
          ("output", "the output model", (".kernels", "the output's kernel side-car")), ("html", "the --html report", None),
          ("json_file", "the --json-file document", None), ("calibration", "a --calibration file", None),
          ("holdout", "a --holdout file", None), ("from_json", "a --from-json document", None), ("targets", "the --targets file", None),
          ("panel_json", "the --panel-json file", None), ("plot", "the --plot chart", None), ("file", "the cache export", None))


def _paths(value: Any) -> Iterator[str]:
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(v, (str, os.PathLike)) and os.fspath(v):
            yield os.fspath(v)


def protected(args: argparse.Namespace, option: str) -> list[tuple[str, str]]:
    """``(path, what it is)`` of every file the command reads or writes other than ``option``'s
    (an attribute of ``args``: ``json_file``, ``html``): the tuning cache (``--cache``, else the
    default), the models, their side-cars, the other outputs, ``run``'s input files."""
    from convpass.tuning.cache_file import default_cache_path

    out = [(os.fspath(getattr(args, "cache", None) or default_cache_path()), "the tuning cache")]
    for attr, what, side in _FILES:
        if attr == option:
            continue
        for path in _paths(getattr(args, attr, None)):
            out.append((path, what))
            if side is not None:
                out.append((path + side[0], side[1]))
    out += [(spec.partition("=")[2] or spec, "a --input file") for spec in _paths(getattr(args, "input", None))]
    return out


def check_outputs(args: argparse.Namespace) -> None:
    """``--json-file``, ``--html`` and ``--plot`` as outputs that may be written (module docstring), before the
    verb does any work; :class:`~convpass.core.errors.FileError` otherwise."""
    for attr, option in (("json_file", "--json-file"), ("html", "--html"), ("plot", "--plot")):
        path = getattr(args, attr, None)
        if path is not None:
            check_output(path, option, protected(args, attr))


def write_report(args: argparse.Namespace, attr: str, text: str) -> None:
    """``text`` into the file of ``args.<attr>`` (``json_file``, ``html``), atomically, checked again."""
    write_text_atomically(getattr(args, attr), text, "--" + attr.replace("_", "-"), protected(args, attr))


def emit_json(args: argparse.Namespace, document: dict[str, Any]) -> None:
    """The verb's result document: on stdout under ``--json``, into ``--json-file``'s file."""
    text = json.dumps(document, indent=2, allow_nan=False, default=str)
    if getattr(args, "json", False):
        print(text, flush=True)
    if getattr(args, "json_file", None) is not None:
        write_report(args, "json_file", text + "\n")

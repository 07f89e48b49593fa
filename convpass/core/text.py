"""Text from files, made safe for a terminal.

Names, device strings and metadata come from files convpass did not write. Before any of them
reaches a terminal:

1. control characters (C0, DEL, C1) and the Unicode controls that reorder or break lines (bidi
   overrides and isolates, line and paragraph separators) are shown as Python escapes
   (``\\x1b``, ``\\u202e``), so no escape sequence reaches the terminal as one;
2. where the text goes through rich, its markup is escaped too (:func:`markup`), or it is
   handed over as a :class:`rich.text.Text` (:func:`literal`), which rich never parses: a name
   such as ``[bold]`` is shown as written.

Log records get rule 1 through :class:`PrintableFilter`. JSON output needs none of this: ``json.dumps`` escapes control characters itself.
"""

from __future__ import annotations

import logging
import re

__all__ = ["PrintableFilter", "literal", "markup", "printable"]

# C0 controls, DEL, C1 controls; bidi embeddings, overrides and isolates; line / paragraph separators
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")
_UNSAFE_KEEP_LINES = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: object, *, keep_newlines: bool = False) -> str:
    """``str(text)`` with every control character shown as an escape (rule 1); ``keep_newlines``:
    leave ``\\n`` as it is (a message of several lines)."""
    return (_UNSAFE_KEEP_LINES if keep_newlines else _UNSAFE).sub(_escape, str(text))


def markup(text: object) -> str:
    """:func:`printable` text to put inside a rich markup string: its own brackets escaped."""
    from rich.markup import escape

    return escape(printable(text))


def literal(text: object, style: str = ""):
    """:func:`printable` text as a rich ``Text`` (never parsed as markup): a table cell, a line."""
    from rich.text import Text

    return Text(printable(text), style=style)


class PrintableFilter(logging.Filter):
    """A logging filter that makes every record's message :func:`printable` (lines kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = printable(record.getMessage(), keep_newlines=True), None
        return True

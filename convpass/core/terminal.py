"""Text from a model, a cache or any other file, made safe for a terminal.

A node name, a device name from an imported cache or a file name can hold control characters,
escape sequences among them (``ESC ] 0 ; ...`` retitles a terminal window). :func:`printable`
shows each one as ``\\xNN`` instead; newlines and tabs stay. rich markup is a second matter:
print such text as :class:`rich.text.Text`, with ``markup=False``, or through
:func:`rich.markup.escape`.
"""

from __future__ import annotations

import re

__all__ = ["printable"]

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: object) -> str:
    """``str(text)`` with every control character but newline and tab shown as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))

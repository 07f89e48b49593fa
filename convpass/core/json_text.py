"""JSON text from files convpass did not write, parsed strictly.

1. Only JSON: ``NaN``, ``Infinity`` and ``-Infinity`` (which Python's ``json`` accepts) are refused.
2. Nesting is bounded: ``[[[[...]]]]`` 100,000 deep is refused, not a ``RecursionError``.
3. Every refusal is a ``ValueError`` whose message is one short line (where, and why).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads"]


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str | bytes) -> Any:
    """The value of the JSON ``text`` (module docstring), or ``ValueError`` saying why not in one line."""
    try:
        return json.loads(text, parse_constant=_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None

"""The one place the bench imports ``jsonschema`` (lazily, so that importing the bench does not
need it): the errors of a JSON value against a JSON Schema (draft 2020-12) as ``$.path: message``
lines, and a one-line :class:`~convpass.core.errors.ConvpassError` when the library is missing.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import Any

from convpass.core.errors import ConvpassError


def _jsonschema() -> Any:
    try:
        import jsonschema
    except ImportError as e:
        raise ConvpassError(f"jsonschema is not installed ({e}); pip install jsonschema (a dependency of convpass)") from None
    return jsonschema


@functools.cache
def _validator(schema_json: str) -> Any:
    jsonschema = _jsonschema()
    return jsonschema.Draft202012Validator(json.loads(schema_json))


def where(path: Iterable[Any]) -> str:
    """``$.cases[1].batch``: a JSON path as the errors name it."""
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _short(text: str, limit: int = 300) -> str:
    """``text`` cut in the middle past ``limit`` characters: a value from a file may be megabytes long."""
    return text if len(text) <= limit else f"{text[:limit // 2]} ... {text[-limit // 2:]}"


def _message(error: Any) -> str:
    if error.validator == "required":
        missing = str(error.message).split("'")[1] if "'" in error.message else "?"
        return f"{where([*error.absolute_path, missing])}: missing"
    return _short(f"{where(error.absolute_path)}: {error.message}")


def errors(value: Any, schema: dict[str, Any]) -> list[str]:
    """Every error of ``value`` against ``schema``, sorted (empty when valid)."""
    return sorted(_message(e) for e in _validator(json.dumps(schema, sort_keys=True)).iter_errors(value))


def first_error(value: Any, schema: dict[str, Any]) -> str | None:
    """The most relevant error (``jsonschema``'s best match), or None when valid."""
    jsonschema = _jsonschema()
    error = jsonschema.exceptions.best_match(_validator(json.dumps(schema, sort_keys=True)).iter_errors(value))
    return None if error is None else _message(error)

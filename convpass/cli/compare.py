"""What ``convpass run`` says about its outputs: a summary of each, and (``--compare ort``) its error
against ONNX Runtime's CPU execution provider on the same inputs (its result-changing rewrites off:
:mod:`convpass.core.ort_reference`).

Errors, per output, over all elements (``a``: convpass, ``b``: the reference):

* max abs error: ``max |a - b|``;
* max rel error: ``max |a - b| / |b|`` over the elements where ``b != 0`` (an element where
  ``b == 0`` and ``a != 0`` makes it infinite);
* the output passes when every element satisfies ``|a - b| <= atol + rtol * |b|`` (NumPy's
  ``allclose``; NaN where both are NaN passes), shapes and dtypes equal; integer and boolean
  outputs must be equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from convpass.core.errors import ConvpassError
from convpass.core.ort_reference import cpu_session

__all__ = ["OutputError", "compare", "ort_outputs", "summary"]


def summary(value: np.ndarray) -> dict[str, Any]:
    """Shape, dtype, min / max / mean (finite elements only; None for an empty tensor) and the
    count of non-finite elements."""
    a = np.asarray(value)
    out: dict[str, Any] = {"shape": list(a.shape), "dtype": str(a.dtype), "min": None, "max": None, "mean": None, "nonfinite": 0}
    if a.size == 0 or a.dtype.kind not in "biuf" and a.dtype.name != "bfloat16":
        return out
    x = a.astype(np.float64)
    finite = np.isfinite(x)
    out["nonfinite"] = int(x.size - np.count_nonzero(finite))
    if out["nonfinite"]:
        x = x[finite]
    if x.size:
        out.update(min=float(x.min()), max=float(x.max()), mean=float(x.mean()))
    return out


@dataclasses.dataclass
class OutputError:
    name: str
    max_abs_error: float | None
    max_rel_error: float | None
    ok: bool
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        """As a dict; an infinite relative error (the reference is 0 where convpass is not) is null."""
        out = dataclasses.asdict(self)
        for key in ("max_abs_error", "max_rel_error"):
            if out[key] is not None and not np.isfinite(out[key]):
                out[key] = None
        return out


def _error(name: str, a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> OutputError:
    if a.shape != b.shape:
        return OutputError(name, None, None, False, f"shape {tuple(a.shape)} against the reference's {tuple(b.shape)}")
    if a.dtype != b.dtype:
        return OutputError(name, None, None, False, f"dtype {a.dtype} against the reference's {b.dtype}")
    if a.dtype.kind not in "f" and a.dtype.name != "bfloat16":
        equal = bool(np.array_equal(a, b))
        return OutputError(name, 0.0 if equal else None, 0.0 if equal else None, equal, "" if equal else "values differ")
    if a.size == 0:
        return OutputError(name, 0.0, 0.0, True)
    x, y = a.astype(np.float64), b.astype(np.float64)
    both_nan = np.isnan(x) & np.isnan(y)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(both_nan, 0.0, np.abs(x - y))
        rel = np.where(y != 0, diff / np.abs(np.where(y != 0, y, 1.0)), np.where(diff == 0, 0.0, np.inf))
        ok = bool(np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True))
    max_abs = float(np.max(diff))
    return OutputError(name, max_abs, float(np.max(rel)), ok, "" if ok else f"over atol {atol:g} + rtol {rtol:g} x |reference|")


def compare(names: Sequence[str], ours: Sequence[np.ndarray], reference: dict[str, np.ndarray], rtol: float, atol: float) -> list[OutputError]:
    """Each output's :class:`OutputError` against ``reference`` (by output name)."""
    return [_error(n, np.asarray(a), np.asarray(reference[n]), rtol, atol) for n, a in zip(names, ours)]


def ort_outputs(model: str, feeds: dict[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
    """The outputs ``names`` of ONNX Runtime's CPU execution provider on ``feeds``."""
    from convpass.core.extras import require

    ort = require("onnxruntime", "--compare ort")
    try:
        session = cpu_session(ort, model)
        values = session.run(list(names), feeds)
    except Exception as e:  # noqa: BLE001  (ONNX Runtime raises its own types for a model it refuses)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConvpassError(f"--compare ort: ONNX Runtime cannot run {model}: {first}") from None
    return dict(zip(names, values))

"""Statistics of ``convpass bench``: run-time summaries, geometric means, output errors and the
tolerances they are judged by. Pure functions on numbers and arrays; nothing here touches a GPU.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["TOL_FP32", "TOL_HALF", "TOL_TF32", "geomean", "percentile", "relative_error", "summarize_times", "tolerance_for"]

# Normwise relative error allowed against the fp32 ONNX Runtime CPU reference.
TOL_TF32 = 5e-3
TOL_FP32 = 1e-4
TOL_HALF = 1e-2


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (NumPy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(float(v) for v in values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_times(times_ms: Sequence[float]) -> dict[str, Any]:
    """Median, p10, p90, min and count of steady-state run times (ms)."""
    if not times_ms:
        raise ValueError("no run times")
    return {
        "median_ms": statistics.median(times_ms),
        "p10_ms": percentile(times_ms, 10),
        "p90_ms": percentile(times_ms, 90),
        "min_ms": min(times_ms),
        "runs": len(times_ms),
    }


def geomean(values: Iterable[float]) -> float | None:
    """Geometric mean; None for no values; ValueError for a value <= 0."""
    xs = list(values)
    if not xs:
        return None
    if any(not (isinstance(x, (int, float)) and x > 0 and math.isfinite(x)) for x in xs):
        raise ValueError(f"geometric mean needs positive finite values, got {xs}")
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def relative_error(outputs: Sequence[Any], references: Sequence[Any]) -> float:
    """Normwise ||out - ref|| / ||ref||, the largest over the outputs; inf on NaN / Inf / shape mismatch."""
    import numpy as np

    if len(outputs) != len(references):
        return math.inf
    worst = 0.0
    for out, ref in zip(outputs, references):
        o = np.asarray(out, dtype=np.float64)
        r = np.asarray(ref, dtype=np.float64)
        if o.shape != r.shape:
            return math.inf
        diff = float(np.linalg.norm((o - r).ravel()))
        if not math.isfinite(diff):
            return math.inf
        worst = max(worst, diff / max(float(np.linalg.norm(r.ravel())), 1e-30))
    return worst


def tolerance_for(tf32: bool | None, dtype: str = "float32") -> float:
    """The allowed normwise relative error: 1e-2 for half types, 5e-3 with TF32, 1e-4 in full fp32."""
    if dtype in ("float16", "bfloat16"):
        return TOL_HALF
    return TOL_TF32 if tf32 or tf32 is None else TOL_FP32

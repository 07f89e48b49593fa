"""Helpers the op modules share: element-type tests, float16 accumulation, axis normalization, typed scalars.

An array and a scalar meet in a ufunc (``xp.multiply(x, s)``, ``xp.greater(x, 0)``), never in an
operator (``x * s``, ``x > 0``; between two arrays operators are fine): CuPy's operator path with a
scalar imports cupyx and, through it, SciPy, which costs a fresh process 0.3-0.45 s of start-up.
tests/test_ops_rules.py holds the ops to it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from convpass.core.errors import ExecutorError


def _is_float(x: Any) -> bool:
    return np.dtype(x.dtype).kind == "f"


def _is_int(x: Any) -> bool:
    return np.dtype(x.dtype).kind in "iu"


def acc(x: Any) -> Any:
    """float16 computed in float32 (sums, means, matmuls)."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


def _axis(axis: int, rank: int) -> int:
    a = int(axis)
    if a < 0:
        a += rank
    if not 0 <= a < max(rank, 1):
        raise ExecutorError(f"axis {axis} out of range for rank {rank}")
    return a


def _axes(axes: Any, rank: int) -> tuple[int, ...]:
    return tuple(sorted(_axis(a, rank) for a in axes))


def _like(xp: Any, value: Any, dtype: Any) -> Any:
    """A typed scalar: combines with arrays without promotion and without a device allocation."""
    return np.dtype(dtype).type(value)

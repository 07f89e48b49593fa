"""The roofline of a tuned model's convolutions, and the GPU peaks it is drawn with.

For every conv record of a tuned model (``convpass.inspect``) that has a problem key and a measured
time::

    bound = max(FLOPs / peak matmul rate, bytes / device copy bandwidth)

with FLOPs from :attr:`convpass.core.problem.ConvShape.flops` and bytes = (x + w + y elements) x the
element size, i.e. each tensor read or written once, which no algorithm can beat. The peak rate is
the measured TF32 matmul rate for convs that may use TF32 (math ``default`` / ``tensor_op``) and
for half types (so for those the "bound" is not a true lower bound: their tensor-core rate is
higher), and the measured full-FP32 rate for convs tuned with TF32 off (``fma``) when it was
measured. The sum of the bounds is set next to the sum of the recorded ``time_ms``: the distance to
the hardware limit. ``efficiency`` = bound / measured (1.0 = at the roofline).

:func:`measure_peaks` measures the peaks once per run with CuPy: a large float32 matmul with TF32
allowed and one without, and a large device-to-device copy counted as read + write bytes, each
timed with CUDA events, the best of several repeats after a warm-up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from convpass.core.problem import ProblemKey

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def conv_cost(problem_key: str | ProblemKey) -> tuple[int, int, bool]:
    """(FLOPs, bytes moved at least once, whether TF32 / tensor cores may be used) of one problem."""
    key = ProblemKey.parse(problem_key) if isinstance(problem_key, str) else problem_key
    s = key.shape
    nbytes = (_prod(s.x_shape) + _prod(s.w_shape) + _prod(s.y_shape)) * ITEMSIZE[s.dtype]
    fast = s.dtype != "float32" or key.tf32
    return s.flops, nbytes, fast


def conv_bound_s(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> tuple[float, bool]:
    """(roofline time in seconds, compute-bound?) of one conv."""
    if peak_flops <= 0 or bandwidth <= 0:
        raise ValueError("peaks must be positive")
    compute, memory = flops / peak_flops, nbytes / bandwidth
    return max(compute, memory), compute >= memory


def conv_roofline(records: Sequence[Mapping[str, Any]], peaks: Mapping[str, Any] | None,
                  profile: str | None = None) -> dict[str, Any]:
    """The roofline summary of a tuned model's conv records (one profile: ``profile`` or all records).

    Records without a problem key or without a measured ``time_ms`` are left out of both sums (the
    comparison stays like for like) and counted in ``convs - counted``.
    """
    tf32 = (peaks or {}).get("tf32_flops_per_s")
    fp32 = (peaks or {}).get("fp32_flops_per_s")
    bw = (peaks or {}).get("copy_bytes_per_s")
    have_peaks = isinstance(tf32, (int, float)) and tf32 > 0 and isinstance(bw, (int, float)) and bw > 0
    rows = [r for r in records if profile is None or r.get("profile") in (None, profile)]
    per_conv: list[dict[str, Any]] = []
    flops_sum = bytes_sum = 0
    bound_s = measured_ms = 0.0
    compute_bound = 0
    notes = []
    fp32_missing = False
    for r in rows:
        key, t = r.get("problem_key"), r.get("time_ms")
        if not key or not isinstance(t, (int, float)) or not math.isfinite(t):
            continue
        try:
            flops, nbytes, fast = conv_cost(key)
        except ValueError:
            continue
        row: dict[str, Any] = {"node": r.get("node"), "flops": flops, "bytes": nbytes, "time_ms": t, "bound_ms": None}
        flops_sum += flops
        bytes_sum += nbytes
        measured_ms += t
        if have_peaks:
            peak = tf32
            if not fast:
                if isinstance(fp32, (int, float)) and fp32 > 0:
                    peak = fp32
                else:
                    fp32_missing = True
            b, is_compute = conv_bound_s(flops, nbytes, peak, bw)
            bound_s += b
            compute_bound += int(is_compute)
            row["bound_ms"] = b * 1e3
        per_conv.append(row)
    if fp32_missing:
        notes.append("TF32-off convs bounded by the TF32 rate (no FP32 peak measured)")
    if not have_peaks:
        notes.append("no measured peaks")
    elif not per_conv:
        notes.append("no conv has a recorded problem key and time (decisions left to run time?)")
    bound_ms = bound_s * 1e3 if have_peaks and per_conv else None
    return {
        "convs": len(rows),
        "counted": len(per_conv),
        "flops": flops_sum,
        "bytes": bytes_sum,
        "bound_ms": bound_ms,
        "measured_conv_ms": measured_ms if per_conv else None,
        "efficiency": bound_ms / measured_ms if bound_ms is not None and measured_ms > 0 else None,
        "compute_bound_convs": compute_bound,
        "peaks": {k: (peaks or {}).get(k) for k in ("tf32_flops_per_s", "fp32_flops_per_s", "copy_bytes_per_s")},
        "per_conv": per_conv,
        "note": "; ".join(notes) or None,
    }


# ---------------------------------------------------------------------------------------------
# measuring the peaks (GPU)

# cupy/_core/_routines_linalg.pxd: COMPUTE_TYPE_DEFAULT = 1, COMPUTE_TYPE_FP32 = 4, COMPUTE_TYPE_TF32 = 7
_COMPUTE_TYPE_FP32 = 4
_COMPUTE_TYPE_TF32 = 7


def _best_rate(cp: Any, fn: Any, work: float, per_group: int, repeats: int) -> float:
    """Largest work / second over ``repeats`` groups of ``per_group`` back-to-back calls, timed with events."""
    for _ in range(2):
        fn()
    cp.cuda.get_current_stream().synchronize()
    best = 0.0
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(per_group):
            fn()
        end.record()
        end.synchronize()
        ms = cp.cuda.get_elapsed_time(start, end) / per_group
        if ms > 0:
            best = max(best, work / (ms * 1e-3))
    return best


def measure_peaks(matmul_n: int = 8192, copy_bytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Measured TF32 and FP32 matmul rates (FLOP/s) and device copy bandwidth (bytes/s, read + write)."""
    import cupy as cp
    from cupy._core import _routines_linalg as linalg

    n = int(matmul_n)
    a = cp.random.standard_normal((n, n), dtype=cp.float32)
    b = cp.random.standard_normal((n, n), dtype=cp.float32)
    c = cp.empty((n, n), dtype=cp.float32)
    old = linalg.get_compute_type(cp.float32)
    peaks: dict[str, float] = {}
    try:
        linalg.set_compute_type(cp.float32, _COMPUTE_TYPE_TF32)
        peaks["tf32_flops_per_s"] = _best_rate(cp, lambda: cp.matmul(a, b, out=c), 2.0 * n**3, 10, repeats)
        linalg.set_compute_type(cp.float32, _COMPUTE_TYPE_FP32)
        peaks["fp32_flops_per_s"] = _best_rate(cp, lambda: cp.matmul(a, b, out=c), 2.0 * n**3, 4, repeats)
    finally:
        linalg.set_compute_type(cp.float32, old)
    a = b = c = None  # freed before the copy test
    count = int(copy_bytes) // 4
    src = cp.ones(count, dtype=cp.float32)
    dst = cp.empty_like(src)
    nbytes = src.nbytes
    stream = cp.cuda.get_current_stream()
    peaks["copy_bytes_per_s"] = _best_rate(
        cp, lambda: dst.data.copy_from_device_async(src.data, nbytes, stream), 2.0 * nbytes, 10, repeats
    )
    src = dst = None
    cp.get_default_memory_pool().free_all_blocks()
    return peaks

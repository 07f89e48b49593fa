"""Synthetic tuning-cache rows for the pruning tests: problems of one geometry class whose
candidates are a fast legacy algorithm, a slow one, a middling engine and an unsupported one."""

from __future__ import annotations

from convpass.core.device import DeviceFingerprint
from convpass.core.problem import ConvShape
from convpass.tuning.cache_rows import Measurement

DEVICE = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)


def row(key, algo, time_ms, at, status="ok", method="measure", rank=None, note="") -> Measurement:
    return Measurement(key=key, algo=algo, status=status, time_ms=time_ms, workspace_bytes=0, deterministic=True,
                       measured_at=at, method=method, note=note, heuristic_rank=rank)


def shape(n: int, c: int) -> ConvShape:
    return ConvShape("fwd", n, c, c, (28, 28), (3, 3), (1, 1), (1, 1), (1, 1), 1, "float32")


def problem_rows(s: ConvShape, at: float, times: dict[str, float | None]) -> list[Measurement]:
    """One NCHW key of ``s``: heuristic ranks in the order of ``times``, then each candidate's
    measure row (None: unsupported), one after the other from ``at``."""
    key = s.key("nchw", "default")
    rows = [row(key, a, None, at, method="heuristic", rank=i) for i, a in enumerate(a for a in times if not a.startswith("engine:"))]
    for i, (algo, t) in enumerate(times.items()):
        rows.append(row(key, algo, t, at + 0.01 * (i + 1), status="ok" if t is not None else "unsupported"))
    return rows


def models(count: int = 2, per_model: int = 6, times: dict[str, float | None] | None = None) -> list[Measurement]:
    """``count`` models, each tuned at batch 1 then batch 16 (runs a minute apart), of
    ``per_model`` geometries each."""
    times = times or {"implicit_gemm": 0.30, "implicit_precomp_gemm": 0.10, "fft": 0.50, "winograd": None, "engine:eng7_k2=1": 0.12}
    out, at = [], 1000.0
    for m in range(count):
        for n in (1, 16):
            for i in range(per_model):
                out += problem_rows(shape(n, 8 + m * per_model + i), at, times)
                at += 1.0
            at += 60.0
    return out

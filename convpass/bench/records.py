"""The records ``convpass bench`` keeps: a *contender* (one runtime configuration timed on one
model and batch) and what is read off a *case* (one model at one batch). Plain dicts, the JSON
document's own form, so a recorded run can be judged and rendered again without a GPU.

A contender (:func:`contender`) has ``name`` (``convpass``, ``ort EXHAUSTIVE nhwc``,
``ort-graph HEURISTIC nchw``, ``torch channels_last``, ``torch.compile reduce-overhead``...),
``family`` (:data:`FAMILIES`), ``config``, ``status`` and ``reason``, the timings
(``cold_start_s``; ONNX Runtime's ``session_s`` + ``first_run_s``; torch.compile's ``compile_s``,
its first call; ``median_ms``, ``p10_ms``, ``p90_ms``, ``min_ms`` and every steady-state run in
``times_ms``), the output check (``rel_err`` against the reference, ``tolerance``) and
``ratio_to_best_peer``. Statuses:

* ``ok`` — timed and its output matched the reference within the tolerance;
* ``unchecked`` — timed, but there was no reference output to check it against (said so);
* ``wrong`` — its output did not match: it is shown, never ranked (no ratio, never a "best");
* ``unavailable`` — the runtime is missing here (no onnxruntime-gpu, no torch, no cuda executor);
* ``skipped`` — not applicable (PyTorch for a model no known builder made);
* ``refused`` — the runtime declined the configuration for this model (ONNX Runtime will not
  capture a CUDA graph of a model with CPU-placed nodes, control flow or dynamic shapes); the
  reason is the runtime's own message, first line;
* ``failed`` — it raised while running (the reason holds the error's first line).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from convpass.bench.stats import summarize_times

FAMILIES = ("convpass", "ort", "ort-graph", "torch", "torch-compile")
PEER_FAMILIES = FAMILIES[1:]
FAMILY_TITLES = {
    "convpass": "convpass",
    "ort": "ONNX Runtime CUDA EP",
    "ort-graph": "ONNX Runtime CUDA EP with CUDA graphs",
    "torch": "PyTorch eager",
    "torch-compile": "torch.compile",
}
STATUSES = ("ok", "unchecked", "wrong", "unavailable", "skipped", "refused", "failed")
RANKABLE = ("ok", "unchecked")
BATCH_GROUPS = ("batch 1", "batch > 1")

CONTENDER_KEYS = (
    "name", "family", "config", "status", "reason", "cold_start_s", "session_s", "first_run_s", "compile_s", "median_ms",
    "p10_ms", "p90_ms", "min_ms", "runs", "times_ms", "rel_err", "tolerance", "tf32", "ratio_to_best_peer", "tuning", "cuda_graph",
    "fresh",
)


def contender(name: str, family: str, config: Mapping[str, Any] | None = None, status: str = "ok",
              reason: str | None = None, **values: Any) -> dict[str, Any]:
    """A contender record with every key present (None where it does not apply)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    unknown = set(values) - set(CONTENDER_KEYS)
    if unknown:
        raise ValueError(f"unknown contender field(s): {', '.join(sorted(unknown))}")
    c: dict[str, Any] = {k: None for k in CONTENDER_KEYS}
    c.update(name=name, family=family, config=dict(config or {}), status=status, reason=reason, times_ms=[])
    c.update(values)
    if c["times_ms"] and c["median_ms"] is None:
        c.update(summarize_times(c["times_ms"]))
    return c


def unavailable(name: str, family: str, reason: str, config: Mapping[str, Any] | None = None,
                status: str = "unavailable") -> dict[str, Any]:
    """A contender that could not run here (or was declined), with the reason in plain words."""
    return contender(name, family, config, status=status, reason=reason)


def judge(c: dict[str, Any], rel_err: float | None, tolerance: float) -> dict[str, Any]:
    """Record the output check on a timed contender: ``ok``, ``wrong`` (with why) or ``unchecked``."""
    c["tolerance"] = tolerance
    if rel_err is None:
        c["status"] = "unchecked"
        c["reason"] = c.get("reason") or "no reference output to check against"
        return c
    c["rel_err"] = rel_err if math.isfinite(rel_err) else None
    if not math.isfinite(rel_err):
        c["status"] = "wrong"
        c["reason"] = "output has NaN / Inf or the wrong shape"
    elif rel_err > tolerance:
        c["status"] = "wrong"
        c["reason"] = f"relative error {rel_err:.2e} > tolerance {tolerance:.0e}"
    else:
        c["status"] = "ok"
    return c


def rankable(c: Mapping[str, Any]) -> bool:
    return c.get("status") in RANKABLE and isinstance(c.get("median_ms"), (int, float)) and c["median_ms"] > 0


def find(case: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    for c in case.get("contenders", []):
        if c.get("name") == name:
            return c
    return None


def case_label(case: Mapping[str, Any]) -> str:
    return f"{case.get('model')} b{case.get('batch')}"


def batch_group(batch: Any) -> str:
    """Cases are judged as "batch 1" and "batch > 1" apart (the large batch differs between models:
    32, or 16 / 8 for video and audio models)."""
    return BATCH_GROUPS[0] if batch == 1 else BATCH_GROUPS[1]


def graph_status_record(status: Any) -> dict[str, Any]:
    """The JSON form of the executor's :class:`~convpass.kernels.plan.GraphStatus` (duck-typed)."""
    return {"captured": status.captured, "reason": status.reason or "", "node": status.node or "", "text": status.describe()}


def convpass_graph(case: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The convpass contender's recorded graph status, or None (not recorded, or convpass did not run)."""
    return (find(case, "convpass") or {}).get("cuda_graph")


def convpass_invalid(cases: list[Mapping[str, Any]] | tuple[Mapping[str, Any], ...]) -> list[str]:
    """Cases where convpass itself gave no valid result (wrong output, or it failed)."""
    return [case_label(c) for c in cases if (find(c, "convpass") or {}).get("status") in ("wrong", "failed")]


def fresh_invalid(cases: list[Mapping[str, Any]] | tuple[Mapping[str, Any], ...]) -> list[str]:
    """Cases where convpass's fresh process gave no valid result (wrong output, or it failed)."""
    return [case_label(c) for c in cases if ((find(c, "convpass") or {}).get("fresh") or {}).get("status") in ("wrong", "failed")]

"""The pure logic of ``convpass bench``: statistics, verdicts, ratios, targets, tables, JSON.

Nothing here touches a GPU; everything works on plain dicts (the JSON document's own form), so a
recorded run can be re-rendered (``convpass bench --from-json``) and every rule is testable on a
machine without a GPU.

Data
----
A *contender* is one runtime configuration timed on one model and batch (see :func:`contender`):
``name`` (``convpass``, ``ort EXHAUSTIVE nhwc``, ``torch channels_last``...), ``family``
(``convpass`` / ``ort`` / ``torch``), ``config``, ``status`` and ``reason``, the timings
(``cold_start_s``; ORT's ``session_s`` + ``first_run_s``; ``median_ms``, ``p10_ms``, ``p90_ms``,
``min_ms`` and every steady-state run in ``times_ms``), the output check (``rel_err`` against the
reference, ``tolerance``) and ``ratio_to_best_peer``. Statuses:

* ``ok`` — timed and its output matched the reference within the tolerance;
* ``unchecked`` — timed, but there was no reference output to check it against (said so);
* ``wrong`` — its output did not match: it is shown, never ranked (no ratio, never a "best");
* ``unavailable`` — the runtime is missing here (no onnxruntime-gpu, no torch, no cuda executor);
* ``skipped`` — not applicable (PyTorch for a model no known builder made);
* ``failed`` — it raised while running (the reason holds the error's first line).

A *case* is one model at one batch: its contenders, the best peer (fastest rankable ORT or PyTorch
configuration), ``ratios``, the ``roofline`` and, with ``--profile-ops``, the ``op_profile`` (GPU
time per launch of the tuned model in eager runs, by op family: :mod:`convpass.bench.opprofile`).
With ``--fresh-process``, every contender also has a ``fresh`` record: the same model, batch and
inputs once more in a fresh Python process of its own (:mod:`convpass.bench.fresh`): ``status``
(as above; its first output checked against the reference), ``reason``, ``parts`` (seconds:
interpreter, import, inputs, context, model read, plan, first run, total; ``None`` for a part the
runtime cannot separate from the next), and for convpass the run-time ``compilations`` (with the
kernel names in ``compiled``), the ``cache_files`` CuPy wrote and the ``module`` folder of the
convpass package the child imported. A case records ``model_order``:
1 for the first case of its model in the bench process, 2 for the next batch size, and so on.
The convpass contender also records ``cuda_graph``: the executor's
:class:`~convpass.kernels.plan.GraphStatus` after its steady-state runs (``captured`` true / false /
null, ``reason``, ``node``, and its ``text``, "CUDA graph: yes (...)" / "CUDA graph: no (...)").
The *document* adds the environment, the settings, the measured peaks and the ``summary`` against
the targets.

Documents are ``convpass.bench/3``; ``convpass.bench/2`` (before issue 10: no ``fresh``, no
``model_order``) and ``convpass.bench/1`` documents (before issue 9: no ``cuda_graph``, no
``op_profile``, the issue-5 summary) are read too: ``--from-json`` recomputes the summary, and what
they did not record shows as ``?`` / not measured (their ``model_order`` is their cases' order: the
bench has always run a model's batch sizes one after the other in one process).

Targets, reported met / not met / not measured, never tuned to pass
-------------------------------------------------------------------
Issue 9 (the wide panel, batch 1 and a large batch: 32, or 16 / 8 for video and audio models):

* steady state: geometric mean of convpass median / best ORT configuration median at most 0.85,
  over the batch-1 cases and over the batch > 1 cases separately (the large batch differs between
  models, so the cases are grouped as batch 1 vs batch > 1);
* steady state: convpass / best ORT at most 1.10 in every case (the worst case is named);
* steady state: convpass / best PyTorch eager at most 1.00 in every case;
* every case runs in one captured CUDA graph (the failing cases are listed with node and reason);
* ``--profile-ops`` reports every case's GPU time outside convolutions and its top op family.

Issue 10 (cold start as a deployment meets it; the fresh-process targets need ``--fresh-process``):

* convpass's fresh-process time to the first result (spawn -> first result in host memory) at
  most ONNX Runtime HEURISTIC's (the faster of its two layouts: its fastest start, no search) in
  every case;
* at most 0.5x ONNX Runtime EXHAUSTIVE's (the faster of its two layouts), geometric mean over the cases;
* a model's second batch size in the same process starts in at most 0.15 s: convpass's in-process
  cold start (construct -> first result) of every case with ``model_order`` >= 2;
* zero run-time compilations in convpass's fresh process: its compilation count and the files in
  its (new, empty) CuPy kernel cache both 0, in every case.

Issue 5's cold-start target is still computed and printed, labelled as issue 5's and not one of
issue 9's: ORT EXHAUSTIVE (session creation + first run, the faster of its two layouts) at least
5x convpass's (executor construction -> first result) in every case. Issue 5's steady-state
geometric mean over all cases pooled is superseded by the per-batch split; it is still shown, as
information, next to the worst case.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from convpass.bench import fresh, opprofile

SCHEMA_ID = "convpass.bench/3"
READABLE_SCHEMAS = ("convpass.bench/1", "convpass.bench/2", SCHEMA_ID)  # --from-json reads these

FAMILIES = ("convpass", "ort", "torch")
STATUSES = ("ok", "unchecked", "wrong", "unavailable", "skipped", "failed")
RANKABLE = ("ok", "unchecked")
VERDICTS = ("met", "not met", "not measured")

# Normwise relative error allowed against the fp32 ONNX Runtime CPU reference.
TOL_TF32 = 5e-3
TOL_FP32 = 1e-4
TOL_HALF = 1e-2

TARGETS: dict[str, float] = {
    "steady_vs_best_ort_geomean": 0.85,  # issue 9: geomean of convpass / best ORT per batch group, at most
    "steady_vs_best_ort_worst": 1.10,  # issue 9: convpass / best ORT in every case, at most
    "steady_vs_best_torch": 1.00,  # issue 9 (and 5): convpass / best torch in every case, at most
    "cold_start_speedup_vs_ort_exhaustive": 5.0,  # issue 5: ORT EXHAUSTIVE cold / convpass cold in every case, at least
    "fresh_vs_ort_heuristic": 1.00,  # issue 10: convpass fresh process / fastest ORT HEURISTIC's in every case, at most
    "fresh_vs_ort_exhaustive_geomean": 0.50,  # issue 10: geomean of convpass fresh process / fastest ORT EXHAUSTIVE's, at most
    "second_case_cold_start_s": 0.15,  # issue 10: a later batch size in the executor that ran the first: call -> result, at most
    "fresh_compilations": 0,  # issue 10: run-time compilations (and CuPy cache files) in convpass's fresh process
}
BATCH_GROUPS = ("batch 1", "batch > 1")

CONTENDER_KEYS = (
    "name", "family", "config", "status", "reason", "cold_start_s", "session_s", "first_run_s", "median_ms",
    "p10_ms", "p90_ms", "min_ms", "runs", "times_ms", "rel_err", "tolerance", "tf32", "ratio_to_best_peer", "tuning", "cuda_graph",
    "fresh",
)


# ---------------------------------------------------------------------------------------------
# statistics and checks


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
    """A contender that could not run here, with the reason in plain words."""
    return contender(name, family, config, status=status, reason=reason)


def rankable(c: Mapping[str, Any]) -> bool:
    return c.get("status") in RANKABLE and isinstance(c.get("median_ms"), (int, float)) and c["median_ms"] > 0


# ---------------------------------------------------------------------------------------------
# ratios


def geomean(values: Iterable[float]) -> float | None:
    """Geometric mean; None for no values; ValueError for a value <= 0."""
    xs = list(values)
    if not xs:
        return None
    if any(not (isinstance(x, (int, float)) and x > 0 and math.isfinite(x)) for x in xs):
        raise ValueError(f"geometric mean needs positive finite values, got {xs}")
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def best_of(contenders: Sequence[Mapping[str, Any]], families: Sequence[str]) -> Mapping[str, Any] | None:
    """The rankable contender of the given families with the lowest median (None when there is none)."""
    pool = [c for c in contenders if c.get("family") in families and rankable(c)]
    return min(pool, key=lambda c: c["median_ms"]) if pool else None


def find(case: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    for c in case.get("contenders", []):
        if c.get("name") == name:
            return c
    return None


def ort_exhaustive_cold(case: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ORT EXHAUSTIVE configuration with the shortest session + first run (the one kindest to ORT)."""
    pool = [
        c for c in case.get("contenders", [])
        if c.get("family") == "ort" and (c.get("config") or {}).get("cudnn_conv_algo_search") == "EXHAUSTIVE"
        and c.get("status") in RANKABLE and isinstance(c.get("cold_start_s"), (int, float))
    ]
    return min(pool, key=lambda c: c["cold_start_s"]) if pool else None


def fresh_total(c: Mapping[str, Any] | None) -> float | None:
    """A contender's fresh-process time to the first result (spawn -> first result in host memory),
    when its fresh process gave a valid result; else None."""
    rec = (c or {}).get("fresh") or {}
    total = (rec.get("parts") or {}).get("total_s")
    return float(total) if rec.get("status") in RANKABLE and isinstance(total, (int, float)) and total > 0 else None


def fastest_fresh(case: Mapping[str, Any], family: str, search: str | None = None) -> Mapping[str, Any] | None:
    """The ``family`` contender (ORT: of ``cudnn_conv_algo_search`` ``search``) with the shortest
    fresh-process time (the layout kindest to the peer), or None."""
    pool = [
        c for c in case.get("contenders", [])
        if c.get("family") == family and fresh_total(c) is not None
        and (search is None or (c.get("config") or {}).get("cudnn_conv_algo_search") == search)
    ]
    return min(pool, key=fresh_total) if pool else None


def annotate_case(case: dict[str, Any]) -> dict[str, Any]:
    """Fill ``best_peer`` / ``best_ort`` / ``best_torch``, each contender's ``ratio_to_best_peer`` and ``ratios``."""
    cs = case.get("contenders", [])
    best_peer = best_of(cs, ("ort", "torch"))
    best_ort = best_of(cs, ("ort",))
    best_torch = best_of(cs, ("torch",))
    for c in cs:
        c["ratio_to_best_peer"] = c["median_ms"] / best_peer["median_ms"] if best_peer and rankable(c) else None
    case["best_peer"] = best_peer["name"] if best_peer else None
    case["best_ort"] = best_ort["name"] if best_ort else None
    case["best_torch"] = best_torch["name"] if best_torch else None
    ours = find(case, "convpass")
    ok = ours is not None and rankable(ours)
    cold = ort_exhaustive_cold(case)
    ours_cold = ours.get("cold_start_s") if ok else None
    ours_fresh = fresh_total(ours)
    heuristic, exhaustive = fastest_fresh(case, "ort", "HEURISTIC"), fastest_fresh(case, "ort", "EXHAUSTIVE")
    later = (case.get("model_order") or 0) >= 2
    same = case.get("same_executor") or {}
    case["ratios"] = {
        "vs_best_ort": ours["median_ms"] / best_ort["median_ms"] if ok and best_ort else None,
        "vs_best_torch": ours["median_ms"] / best_torch["median_ms"] if ok and best_torch else None,
        "cold_start_speedup_vs_ort_exhaustive": (
            cold["cold_start_s"] / ours_cold if cold and isinstance(ours_cold, (int, float)) and ours_cold > 0 else None
        ),
        "ort_exhaustive_cold": cold["name"] if cold else None,
        "fresh_vs_ort_heuristic": ours_fresh / fresh_total(heuristic) if ours_fresh and heuristic else None,
        "fresh_vs_ort_exhaustive": ours_fresh / fresh_total(exhaustive) if ours_fresh and exhaustive else None,
        "ort_heuristic_fresh": heuristic["name"] if heuristic else None,
        "ort_exhaustive_fresh": exhaustive["name"] if exhaustive else None,
        # seconds, not a ratio: a model's second (or later) batch size in the same process, i.e. in
        # the executor that ran its first one (cli: contenders.run_batch_sizes_in_one_executor)
        "second_case_cold_start_s": same.get("seconds") if later and same.get("status") == "ok" else None,
    }
    return case


def case_label(case: Mapping[str, Any]) -> str:
    return f"{case.get('model')} b{case.get('batch')}"


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "not met")


def batch_group(batch: Any) -> str:
    """Issue 9 judges "batch 1" and "batch > 1" apart (the large batch is 32, or 16 / 8 for video and audio)."""
    return BATCH_GROUPS[0] if batch == 1 else BATCH_GROUPS[1]


# ---------------------------------------------------------------------------------------------
# CUDA graph status


def graph_status_record(status: Any) -> dict[str, Any]:
    """The JSON form of the executor's :class:`~convpass.kernels.plan.GraphStatus` (duck-typed)."""
    return {"captured": status.captured, "reason": status.reason or "", "node": status.node or "", "text": status.describe()}


def convpass_graph(case: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The convpass contender's recorded graph status, or None (not recorded, or convpass did not run)."""
    return (find(case, "convpass") or {}).get("cuda_graph")


def graph_text(case: Mapping[str, Any]) -> str:
    """The per-case line: the executor's own "CUDA graph: yes / no (reason)", or "?" and why not known."""
    g = convpass_graph(case)
    if g is not None:
        return g["text"]
    ours = find(case, "convpass")
    if ours is not None and "cuda_graph" not in ours:
        return "CUDA graph: ? (not recorded in this document)"
    return "CUDA graph: ? (convpass did not reach its steady-state runs)"


def graph_mark(case: Mapping[str, Any]) -> str:
    """``yes`` / ``no`` / ``n/a`` (not applicable or not known yet) / ``?`` (not recorded)."""
    g = convpass_graph(case)
    if g is None:
        return "?"
    return {True: "yes", False: "no"}.get(g.get("captured"), "n/a")


# ---------------------------------------------------------------------------------------------
# targets


def _ratios(cases: Sequence[Mapping[str, Any]], key: str) -> tuple[dict[str, float], list[str]]:
    """A ratio of ``case["ratios"]`` per case label; the labels of the cases without one."""
    got, missing = {}, []
    for case in cases:
        v = (case.get("ratios") or {}).get(key)
        if isinstance(v, (int, float)) and v > 0:
            got[case_label(case)] = float(v)
        else:
            missing.append(case_label(case))
    return got, missing


def _convpass_invalid(cases: Sequence[Mapping[str, Any]]) -> list[str]:
    """Cases where convpass itself gave no valid result (wrong output, or it failed)."""
    return [case_label(c) for c in cases if (find(c, "convpass") or {}).get("status") in ("wrong", "failed")]


def _fresh_invalid(cases: Sequence[Mapping[str, Any]]) -> list[str]:
    """Cases where convpass's fresh process gave no valid result (wrong output, or it failed)."""
    return [case_label(c) for c in cases if ((find(c, "convpass") or {}).get("fresh") or {}).get("status") in ("wrong", "failed")]


def geomean_target(cases: Sequence[Mapping[str, Any]], key: str, target: float, rule: str, issue: int,
                   invalid: list[str] | None = None) -> dict[str, Any]:
    """Geometric mean of a ratio over ``cases`` at most ``target``. ``invalid``: the cases where
    convpass gave no valid result (default: its in-process run's)."""
    got, missing = _ratios(cases, key)
    bad = _convpass_invalid(cases) if invalid is None else invalid
    gm = geomean(got.values())
    ok = False if bad else (None if gm is None else gm <= target)
    return {"issue": issue, "rule": rule, "target": target, "verdict": _verdict(ok), "n": len(got), "geomean": gm,
            "per_case": got, "not_measured": missing, "convpass_invalid": bad}


def every_case_target(cases: Sequence[Mapping[str, Any]], key: str, target: float, rule: str, issue: int,
                      at_least: bool = False, invalid: list[str] | None = None) -> dict[str, Any]:
    """A ratio at most (``at_least``: at least) ``target`` in every case: the worst case named, the
    failing listed. ``invalid`` as for :func:`geomean_target`."""
    got, missing = _ratios(cases, key)
    bad = _convpass_invalid(cases) if invalid is None else invalid
    pick = min if at_least else max
    worst = pick(got.items(), key=lambda kv: kv[1]) if got else None
    failing = [k for k, v in got.items() if (v < target if at_least else v > target)]
    ok = False if bad else (None if not got else not failing)
    return {"issue": issue, "rule": rule, "target": target, "verdict": _verdict(ok), "n": len(got),
            "geomean": geomean(got.values()), "worst": worst[1] if worst else None, "worst_case": worst[0] if worst else None,
            "failing": failing, "per_case": got, "not_measured": missing, "convpass_invalid": bad}


def capture_target(cases: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every case runs in one captured CUDA graph; the others listed with the executor's reason.

    A status that is not recorded, or recorded as not applicable / not known, is "not measured"
    (never "met").
    """
    captured, failing, missing = [], {}, []
    for case in cases:
        g = convpass_graph(case)
        state = None if g is None else g.get("captured")
        if state is True:
            captured.append(case_label(case))
        elif state is False:
            failing[case_label(case)] = g.get("reason") or "no reason recorded"
        else:
            missing.append(case_label(case))
    bad = _convpass_invalid(cases)
    ok = False if bad else (None if not captured and not failing else not failing)
    return {"issue": 9, "rule": "every case runs in one captured CUDA graph", "target": None, "verdict": _verdict(ok),
            "n": len(captured) + len(failing), "captured": captured, "failing": failing, "not_measured": missing,
            "convpass_invalid": bad}


def profile_target(cases: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every case's GPU time outside convolutions and top non-conv op family reported (``--profile-ops``)."""
    reported, failing, missing = {}, {}, []
    for case in cases:
        p = case.get("op_profile")
        if not p:
            missing.append(case_label(case))
        elif p.get("status") == "ok":
            reported[case_label(case)] = opprofile.short_text(p)
        else:
            failing[case_label(case)] = p.get("reason") or str(p.get("status"))
    ok = None if not reported and not failing else not failing
    return {"issue": 9, "rule": "GPU time outside convolutions and the top non-conv op family reported for every case",
            "target": None, "verdict": _verdict(ok), "n": len(reported) + len(failing), "per_case": reported,
            "failing": failing, "not_measured": missing}


def compilations_target(cases: Sequence[Mapping[str, Any]], target: float = 0) -> dict[str, Any]:
    """Zero run-time compilations in convpass's fresh process of every case: its compilation count
    and the files CuPy wrote into its empty kernel cache, both at most ``target`` (either unknown:
    not measured)."""
    per_case: dict[str, dict[str, int]] = {}
    failing, missing = [], []
    for case in cases:
        rec = (find(case, "convpass") or {}).get("fresh") or {}
        n, files = rec.get("compilations"), rec.get("cache_files")
        if rec.get("status") in ("ok", "unchecked", "wrong") and isinstance(n, int) and isinstance(files, int):
            per_case[case_label(case)] = {"compilations": n, "cache_files": files}
            if n > target or files > target:
                failing.append(case_label(case))
        else:
            missing.append(case_label(case))
    bad = _fresh_invalid(cases)
    ok = False if bad else (None if not per_case else not failing)
    return {"issue": 10, "rule": "zero run-time compilations (and no file in CuPy's empty kernel cache) in convpass's fresh process, "
            "in every case", "target": target, "verdict": _verdict(ok), "n": len(per_case),
            "per_case": per_case, "failing": failing, "not_measured": missing, "convpass_invalid": bad}


def summarize(cases: Sequence[Mapping[str, Any]], targets: Mapping[str, float] = TARGETS) -> dict[str, Any]:
    """Every target's measured value and verdict (module docstring): issue 9's, issue 10's, issue 5's.

    A case where convpass itself is wrong or failed makes the targets it belongs to ``not met``
    (convpass gave no valid result there), whatever the other cases measured; cases where a peer or
    a status could not be measured are left out and listed; with no case measured the verdict is
    ``not measured``.
    """
    summary: dict[str, Any] = {"cases": len(cases)}
    geo = targets["steady_vs_best_ort_geomean"]
    for key, group in zip(("steady_vs_best_ort_batch1", "steady_vs_best_ort_large_batch"), BATCH_GROUPS):
        members = [c for c in cases if batch_group(c.get("batch")) == group]
        rec = geomean_target(members, "vs_best_ort", geo, f"geometric mean of convpass / best ORT over the {group} cases <= {geo:g}", 9)
        rec.update(group=group, batches=sorted({c.get("batch") for c in members}))
        summary[key] = rec
    worst = targets["steady_vs_best_ort_worst"]
    summary["steady_vs_best_ort_worst"] = every_case_target(
        cases, "vs_best_ort", worst, f"convpass / best ORT <= {worst:g} in every case", 9)
    torch_t = targets["steady_vs_best_torch"]
    summary["steady_vs_best_torch"] = every_case_target(
        cases, "vs_best_torch", torch_t, f"convpass / best PyTorch eager <= {torch_t:g} in every case", 9)
    summary["cuda_graph"] = capture_target(cases)
    summary["op_profile"] = profile_target(cases)
    bad = _fresh_invalid(cases)
    heuristic = targets["fresh_vs_ort_heuristic"]
    summary["fresh_vs_ort_heuristic"] = every_case_target(
        cases, "fresh_vs_ort_heuristic", heuristic,
        f"convpass fresh process (spawn -> first result) <= {heuristic:g}x the fastest ORT HEURISTIC one, in every case", 10, invalid=bad)
    exhaustive = targets["fresh_vs_ort_exhaustive_geomean"]
    summary["fresh_vs_ort_exhaustive"] = geomean_target(
        cases, "fresh_vs_ort_exhaustive", exhaustive,
        f"geometric mean of convpass fresh process / the fastest ORT EXHAUSTIVE one <= {exhaustive:g}", 10, invalid=bad)
    second = targets["second_case_cold_start_s"]
    summary["second_case_cold_start"] = every_case_target(
        [c for c in cases if (c.get("model_order") or 0) >= 2], "second_case_cold_start_s", second,
        f"a model's second and later batch sizes in the executor that ran its first: call -> first result <= {second:g} s", 10)
    summary["fresh_compilations"] = compilations_target(cases, targets["fresh_compilations"])
    cold = targets["cold_start_speedup_vs_ort_exhaustive"]
    summary["cold_start_vs_ort_exhaustive"] = every_case_target(
        cases, "cold_start_speedup_vs_ort_exhaustive", cold,
        f"ORT EXHAUSTIVE session + first run >= {cold:g}x convpass construct -> first result, in every case", 5, at_least=True)
    return summary


# ---------------------------------------------------------------------------------------------
# the document


def build_document(environment: Mapping[str, Any], settings: Mapping[str, Any], peaks: Mapping[str, Any] | None,
                   cases: Sequence[dict[str, Any]], created: str | None = None,
                   notes: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON document: environment, settings, peaks, the annotated cases and the summary."""
    for case in cases:
        annotate_case(case)
    return {
        "schema": SCHEMA_ID,
        "created": created,
        "environment": copy.deepcopy(dict(environment)),
        "settings": copy.deepcopy(dict(settings)),
        "peaks": dict(peaks) if peaks else None,
        "cases": list(cases),
        "summary": summarize(cases),
        "notes": list(notes),
    }


def merge_documents(docs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several recorded runs as one document (cases concatenated, summary recomputed).

    The environment and settings of the first run are kept (its ``targets`` become this version's,
    which the recomputed summary judges by); runs on another device are noted.
    """
    if not docs:
        raise ValueError("nothing to merge")
    first = docs[0]
    cases = []
    for d in docs:
        order: dict[Any, int] = {}
        for c in d.get("cases", []):
            order[c.get("model")] = order.get(c.get("model"), 0) + 1
            # before convpass.bench/3: a run's cases in the order its process ran them
            cases.append(dict(c) if c.get("model_order") is not None else dict(c, model_order=order[c.get("model")]))
    notes = list(dict.fromkeys(n for d in docs for n in d.get("notes", [])))  # parts of one run share their notes
    devices = {(d.get("environment") or {}).get("device") for d in docs}
    if len(devices) > 1:
        notes.append(f"merged runs from different devices: {', '.join(sorted(map(str, devices)))}; ratios are per run")
    # the summary is recomputed, so against this version's targets (a convpass.bench/1 run recorded issue 5's)
    settings = dict(first.get("settings") or {}, targets=dict(TARGETS))
    return build_document(first.get("environment") or {}, settings, first.get("peaks"), cases, first.get("created"), notes)


# ---------------------------------------------------------------------------------------------
# schema


class Opt:
    """Schema: the key may be absent or None, else matches ``spec``."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec


class Enum:
    def __init__(self, *values: Any) -> None:
        self.values = values


class MapOf:
    """Schema: an object with any string keys whose values match ``spec``."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec


NUM = "number"
ANY = "any"

CONTENDER_SCHEMA = {
    "name": str,
    "family": Enum(*FAMILIES),
    "config": MapOf(ANY),
    "status": Enum(*STATUSES),
    "reason": Opt(str),
    "cold_start_s": Opt(NUM),
    "session_s": Opt(NUM),
    "first_run_s": Opt(NUM),
    "median_ms": Opt(NUM),
    "p10_ms": Opt(NUM),
    "p90_ms": Opt(NUM),
    "min_ms": Opt(NUM),
    "runs": Opt(int),
    "times_ms": [NUM],
    "rel_err": Opt(NUM),
    "tolerance": Opt(NUM),
    "tf32": Opt(bool),
    "ratio_to_best_peer": Opt(NUM),
    "tuning": Opt(MapOf(ANY)),
    "cuda_graph": Opt({"captured": Opt(bool), "reason": str, "node": str, "text": str}),
    "fresh": Opt({
        "status": Enum(*STATUSES),
        "reason": Opt(str),
        "parts": Opt(MapOf(Opt(NUM))),
        "compilations": Opt(int),
        "compiled": Opt([str]),
        "cache_files": Opt(int),
        "module": Opt(str),
        "rel_err": Opt(NUM),
        "tolerance": Opt(NUM),
    }),
}

OP_PROFILE_SCHEMA = {
    "status": Enum("ok", "failed"),
    "reason": Opt(str),
    "runs": Opt(int),
    "method": Opt(str),
    "host_gaps_excluded": Opt(bool),
    "launches": Opt(int),
    "total_ms": Opt(NUM),
    "conv_ms": Opt(NUM),
    "non_conv_ms": Opt(NUM),
    "non_conv_pct": Opt(NUM),
    "top_non_conv_family": Opt(Enum(*opprofile.FAMILIES)),
    "top_non_conv_ms": Opt(NUM),
    "families": Opt(MapOf({"ms": NUM, "launches": int})),
    "labels": Opt([{"label": str, "op_type": str, "family": Enum(*opprofile.FAMILIES), "ms": NUM, "launches": int}]),
}

ROOFLINE_SCHEMA = {
    "convs": int,
    "counted": int,
    "flops": NUM,
    "bytes": NUM,
    "bound_ms": Opt(NUM),
    "measured_conv_ms": Opt(NUM),
    "efficiency": Opt(NUM),
    "compute_bound_convs": int,
    "peaks": MapOf(Opt(NUM)),
    "per_conv": [MapOf(ANY)],
    "note": Opt(str),
}

CASE_SCHEMA = {
    "model": str,
    "file": str,
    "batch": int,
    "inputs": MapOf([int]),
    "dtype": str,
    "reference": Opt(str),
    "contenders": [CONTENDER_SCHEMA],
    "best_peer": Opt(str),
    "best_ort": Opt(str),
    "best_torch": Opt(str),
    "ratios": {
        "vs_best_ort": Opt(NUM),
        "vs_best_torch": Opt(NUM),
        "cold_start_speedup_vs_ort_exhaustive": Opt(NUM),
        "ort_exhaustive_cold": Opt(str),
        "fresh_vs_ort_heuristic": Opt(NUM),
        "fresh_vs_ort_exhaustive": Opt(NUM),
        "ort_heuristic_fresh": Opt(str),
        "ort_exhaustive_fresh": Opt(str),
        "second_case_cold_start_s": Opt(NUM),
    },
    "model_order": Opt(int),
    "same_executor": Opt({"status": Enum("ok", "failed"), "seconds": Opt(NUM), "after": int, "reason": Opt(str)}),
    "roofline": Opt(ROOFLINE_SCHEMA),
    "op_profile": Opt(OP_PROFILE_SCHEMA),
    "notes": [str],
}

_TARGET_SCHEMA = {
    "issue": int,
    "rule": str,
    "target": Opt(NUM),
    "verdict": Enum(*VERDICTS),
    "n": int,
    "not_measured": [str],
}
_RATIO_TARGET_SCHEMA = dict(_TARGET_SCHEMA, target=NUM, geomean=Opt(NUM), per_case=MapOf(NUM), convpass_invalid=[str])
_GROUP_TARGET_SCHEMA = dict(_RATIO_TARGET_SCHEMA, group=Enum(*BATCH_GROUPS), batches=[int])
_EVERY_CASE_TARGET_SCHEMA = dict(_RATIO_TARGET_SCHEMA, worst=Opt(NUM), worst_case=Opt(str), failing=[str])

DOCUMENT_SCHEMA = {
    "schema": Enum(SCHEMA_ID),
    "created": Opt(str),
    "environment": {
        "device": Opt(str),
        "driver": Opt(str),
        "cuda_runtime": Opt(str),
        "cuda_driver_api": Opt(str),
        "cudnn": Opt(str),
        "packages": MapOf(Opt(str)),
    },
    "settings": {
        "runs": int,
        "warmup": int,
        "batches": MapOf([int]),
        "vs": [str],
        "tf32": str,
        "timing": str,
        "profile_ops": Opt(int),
        "fresh_process": Opt({"timeout_s": NUM}),
    },
    "peaks": Opt(MapOf(Opt(NUM))),
    "cases": [CASE_SCHEMA],
    "summary": {
        "cases": int,
        "steady_vs_best_ort_batch1": _GROUP_TARGET_SCHEMA,
        "steady_vs_best_ort_large_batch": _GROUP_TARGET_SCHEMA,
        "steady_vs_best_ort_worst": _EVERY_CASE_TARGET_SCHEMA,
        "steady_vs_best_torch": _EVERY_CASE_TARGET_SCHEMA,
        "cuda_graph": dict(_TARGET_SCHEMA, captured=[str], failing=MapOf(str), convpass_invalid=[str]),
        "op_profile": dict(_TARGET_SCHEMA, per_case=MapOf(str), failing=MapOf(str)),
        "cold_start_vs_ort_exhaustive": _EVERY_CASE_TARGET_SCHEMA,
        "fresh_vs_ort_heuristic": _EVERY_CASE_TARGET_SCHEMA,
        "fresh_vs_ort_exhaustive": _RATIO_TARGET_SCHEMA,
        "second_case_cold_start": _EVERY_CASE_TARGET_SCHEMA,
        "fresh_compilations": dict(_TARGET_SCHEMA, per_case=MapOf({"compilations": int, "cache_files": int}), failing=[str],
                                   convpass_invalid=[str]),
    },
    "notes": [str],
}


def _check(value: Any, spec: Any, path: str, errors: list[str]) -> None:
    if isinstance(spec, Opt):
        if value is not None:
            _check(value, spec.spec, path, errors)
        return
    if spec is ANY:
        return
    if spec is NUM:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.append(f"{path}: expected a number, got {type(value).__name__}")
        return
    if isinstance(spec, Enum):
        if value not in spec.values:
            errors.append(f"{path}: {value!r} is not one of {', '.join(map(repr, spec.values))}")
        return
    if isinstance(spec, MapOf):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
            return
        for k, v in value.items():
            if not isinstance(k, str):
                errors.append(f"{path}: key {k!r} is not a string")
            _check(v, spec.spec, f"{path}.{k}", errors)
        return
    if isinstance(spec, list):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, v in enumerate(value):
            _check(v, spec[0], f"{path}[{i}]", errors)
        return
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
            return
        for k, sub in spec.items():
            if k not in value:
                if not isinstance(sub, Opt):
                    errors.append(f"{path}.{k}: missing")
                continue
            _check(value[k], sub, f"{path}.{k}", errors)
        return
    if isinstance(spec, type):
        ok = isinstance(value, spec) and not (spec is int and isinstance(value, bool))
        if not ok:
            errors.append(f"{path}: expected {spec.__name__}, got {type(value).__name__}")
        return
    raise TypeError(f"bad schema spec at {path}: {spec!r}")


# a recorded document to re-render: any readable schema version; its summary is recomputed, not read
RECORDED_SCHEMA = {k: v for k, v in DOCUMENT_SCHEMA.items() if k != "summary"} | {"schema": Enum(*READABLE_SCHEMAS)}


def validate_document(doc: Any, recorded: bool = False) -> list[str]:
    """Schema errors of a bench document (empty when valid); also checks it survives a JSON round trip.

    ``recorded``: check a document to re-render (``--from-json``) instead of one this version
    writes: ``convpass.bench/1`` is accepted and the summary is not checked (it is recomputed).
    """
    errors: list[str] = []
    _check(doc, RECORDED_SCHEMA if recorded else DOCUMENT_SCHEMA, "$", errors)
    if not errors:
        try:
            json.loads(json.dumps(doc, allow_nan=False))
        except (TypeError, ValueError) as e:
            errors.append(f"$: not JSON-serializable without NaN / Inf: {e}")
    return errors


def to_json(doc: Mapping[str, Any]) -> str:
    return json.dumps(_finite(doc), indent=2) + "\n"


def _finite(x: Any) -> Any:
    """NaN / Inf (not JSON) become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------------
# text


def _ms(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) else "-"


def _s(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) else "-"


def _x(v: Any) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def _sci(v: Any) -> str:
    return f"{v:.1e}" if isinstance(v, (int, float)) else "-"


def _cold_detail(c: Mapping[str, Any]) -> str:
    if c.get("family") == "ort" and isinstance(c.get("session_s"), (int, float)):
        return f"{_s(c['cold_start_s'])} ({_s(c['session_s'])}+{_s(c['first_run_s'])})"
    return _s(c.get("cold_start_s"))


def _check_text(c: Mapping[str, Any]) -> str:
    st = c.get("status")
    if st == "ok":
        return "ok"
    if st == "wrong":
        return f"WRONG: {c.get('reason') or ''}".rstrip(": ")
    if st == "unchecked":
        return f"unchecked: {c.get('reason') or ''}".rstrip(": ")
    return f"{st}: {c.get('reason') or ''}".rstrip(": ")


def _table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [(c.rjust(w) if i in right else c.ljust(w)) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def tuning_line(t: Mapping[str, Any] | None) -> str | None:
    """One line on how convpass's decisions were taken (measured or all from the tuning cache)."""
    if not t:
        return None
    wall = t.get("optimize_s")
    measured, cached, failed = t.get("measured"), t.get("cached"), t.get("failed")
    if measured is None:
        where = "no GPU tuner ran"
    elif t.get("all_cached"):
        where = f"every decision from the tuning cache ({cached} problems), nothing timed"
    else:
        where = f"{measured} problems measured, {cached} from the tuning cache" + (f", {failed} failed" if failed else "")
    extra = ""
    if t.get("undecided"):
        extra = f"; {t['undecided']} left to run time (auto)"
    if t.get("engine_decisions"):
        extra += f"; {t['engine_decisions']} run a cuDNN graph-API engine"
    if t.get("own_kernel_decisions"):
        extra += f"; {t['own_kernel_decisions']} run convpass's own depthwise kernel"
    if t.get("fused_decisions"):
        extra += f"; {t['fused_decisions']} run their epilogue fused into the conv's call"
    tuning = t.get("tuning_s")
    tail = f", tuner {tuning:.1f} s" if isinstance(tuning, (int, float)) else ""
    line = f"convpass optimize: {_s(wall)} s{tail} ({where}{extra})"
    if t.get("kernels") and t.get("kernels_s") is None:
        line += f"; kernels: {t['kernels']}"
    elif t.get("kernels"):
        line += f"; kernels ahead of time ({_s(t.get('kernels_s'))} s): {t['kernels']}"
    return line


def roofline_line(r: Mapping[str, Any] | None) -> str | None:
    if not r:
        return None
    if r.get("bound_ms") is None:
        return f"roofline: not computed ({r.get('note') or 'no measured peaks'})"
    eff = r.get("efficiency")
    pk = r.get("peaks") or {}
    tf = pk.get("tf32_flops_per_s")
    bw = pk.get("copy_bytes_per_s")
    peaks = []
    if isinstance(tf, (int, float)):
        peaks.append(f"TF32 {tf / 1e12:.0f} TFLOP/s")
    if isinstance(bw, (int, float)):
        peaks.append(f"copy {bw / 1e12:.2f} TB/s")
    line = (
        f"roofline: {r['counted']} convs, {r['flops'] / 1e9:.2f} GFLOP, {r['bytes'] / 1e6:.1f} MB -> bound "
        f"{_ms(r['bound_ms'])} ms ({r['compute_bound_convs']} compute-bound; {', '.join(peaks)}); "
        f"measured conv time {_ms(r.get('measured_conv_ms'))} ms"
    )
    if isinstance(eff, (int, float)) and eff > 0:
        line += f", {1 / eff:.1f}x the bound ({100 * eff:.0f}% of the roofline)"
    if r.get("note"):
        line += f" [{r['note']}]"
    return line


def format_case(case: Mapping[str, Any]) -> str:
    """The per-case table: cold start, steady median, p10-p90, ratio to the best peer, correctness."""
    inputs = ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in (case.get("inputs") or {}).items())
    ours = find(case, "convpass") or {}
    tf32 = ours.get("tf32")
    head = (
        f"{case.get('model')} batch {case.get('batch')} ({inputs}; {case.get('dtype')}"
        + ("" if tf32 is None else f"; TF32 {'on' if tf32 else 'off'}")
        + f"); reference: {case.get('reference') or 'none'}"
    )
    lines = [head]
    tl = tuning_line(ours.get("tuning"))
    if tl:
        lines.append("  " + tl)
    rows = [["contender", "cold start s", "median ms", "p10-p90 ms", "vs best peer", "rel err", "check"]]
    for c in case.get("contenders", []):
        if c.get("status") in ("unavailable", "skipped", "failed") and c.get("median_ms") is None:
            rows.append([c["name"], "-", "-", "-", "-", "-", _check_text(c)])
            continue
        ratio = _x(c.get("ratio_to_best_peer"))
        if c.get("name") == case.get("best_peer"):
            ratio += " (best)"
        if c.get("status") == "wrong":
            ratio = "not ranked"
        spread = f"{_ms(c.get('p10_ms'))}-{_ms(c.get('p90_ms'))}" if c.get("p10_ms") is not None else "-"
        rows.append([c["name"], _cold_detail(c), _ms(c.get("median_ms")), spread, ratio, _sci(c.get("rel_err")), _check_text(c)])
    lines += ["  " + line for line in _table(rows, right=(1, 2, 3, 4, 5))]
    rl = roofline_line(case.get("roofline"))
    if rl:
        lines.append("  " + rl)
    r = case.get("ratios") or {}
    lines.append(
        "  convpass vs best ORT {}, vs best PyTorch {}, cold start {} sooner than {}".format(
            _x(r.get("vs_best_ort")), _x(r.get("vs_best_torch")), _x(r.get("cold_start_speedup_vs_ort_exhaustive")),
            r.get("ort_exhaustive_cold") or "ORT EXHAUSTIVE",
        )
    )
    lines.append("  " + graph_text(case))
    profile = case.get("op_profile")
    for line in (opprofile.summary_line(profile), opprofile.family_line(profile)):
        if line:
            lines.append("  " + line)
    same = same_executor_line(case)
    if same:
        lines.append("  " + same)
    lines += ["  " + line for line in fresh_lines(case)]
    for n in case.get("notes") or []:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def same_executor_line(case: Mapping[str, Any]) -> str | None:
    """A later batch size of a model run by the executor that ran its first (None: not measured)."""
    same = case.get("same_executor")
    if not same:
        return None
    head = f"same process, next batch size: the executor that ran b{same['after']} (one model tuned for both) ran b{case['batch']}"
    if same["status"] != "ok":
        return f"{head}: failed ({same.get('reason') or '?'})"
    return f"{head} from the call to its first result in {_s(same['seconds'])} s (plan, warm-up, capture, first run)"


def _compiled_text(rec: Mapping[str, Any]) -> str:
    """``N / M files``: run-time compilations / files in CuPy's kernel cache ("?": not known)."""
    n, files = rec.get("compilations"), rec.get("cache_files")
    if n is None and files is None:
        return "?"
    return f"{'?' if n is None else n} / {'?' if files is None else files} files"


def fresh_lines(case: Mapping[str, Any]) -> list[str]:
    """The per-case fresh-process table (its parts beside the in-process cold start) and the ratios
    to ONNX Runtime's; no lines when the case has no fresh records."""
    cs = [c for c in case.get("contenders", []) if c.get("fresh")]
    if not cs:
        return []
    rows = [["contender", "in-process cold s", "interpreter", "import", "inputs", "context", "model read", "plan",
             "first run", "total s", "compiled", "check"]]
    for c in cs:
        rec = c["fresh"]
        p = rec.get("parts") or {}
        compiled = _compiled_text(rec) if c.get("family") == "convpass" and rec.get("parts") else ""
        rows.append([c["name"], _s(c.get("cold_start_s")), *(_s(p.get(k)) for k in fresh.PART_KEYS), compiled, _check_text(rec)])
    r = case.get("ratios") or {}
    return [
        "fresh process, spawn -> first result in host memory, s ('-': a part the runtime cannot separate, in the next one):",
        *("  " + line for line in _table(rows, right=tuple(range(1, 10)))),
        f"fresh process: convpass vs fastest ORT HEURISTIC {_x(r.get('fresh_vs_ort_heuristic'))} "
        f"({r.get('ort_heuristic_fresh') or '-'}), vs fastest ORT EXHAUSTIVE {_x(r.get('fresh_vs_ort_exhaustive'))} "
        f"({r.get('ort_exhaustive_fresh') or '-'})",
    ]


def has_fresh(cases: Sequence[Mapping[str, Any]]) -> bool:
    return any(c.get("fresh") for case in cases for c in case.get("contenders", []))


def fresh_note() -> str:
    """What each part of a fresh process is, per runtime (a note of the document that has them)."""
    return "fresh process (--fresh-process): " + "; ".join(f"{k}: {v}" if k != "all" else v for k, v in fresh.LEGEND.items())


def _tail(s: Mapping[str, Any], hint: str = "") -> str:
    """What a target's verdict leaves out: unmeasured cases (all of them in a word), invalid convpass results."""
    parts = []
    missing = s.get("not_measured") or []
    if missing:
        parts.append("not measured for any case" if not s.get("n") else f"not measured for {', '.join(missing)}")
        if hint:
            parts.append(hint)
    if s.get("convpass_invalid"):
        parts.append(f"convpass output wrong or failed for {', '.join(s['convpass_invalid'])}")
    return f" ({'; '.join(parts)})" if parts else ""


def _group_line(s: Mapping[str, Any]) -> str:
    batches = f"batches {', '.join(map(str, s['batches']))}; " if s["group"] != BATCH_GROUPS[0] and s["batches"] else ""
    return (f"steady state vs best ORT configuration, {s['group']} ({batches}{s['n']} case(s)): geometric mean "
            f"{_x(s.get('geomean'))}; target <= {s['target']:.2f}x: {s['verdict'].upper()}{_tail(s)}")


def _every_case_line(title: str, s: Mapping[str, Any], pooled: str = "geometric mean", hint: str = "") -> str:
    worst, above = _worst_and_above(s, _x, f"{s['target']:.2f}x")
    return (f"{title}: {worst}{above}{pooled} {_x(s.get('geomean'))} over {s['n']} case(s); "
            f"target <= {s['target']:.2f}x in every case: {s['verdict'].upper()}{_tail(s, hint)}")


def _worst_and_above(s: Mapping[str, Any], fmt: Any, target: str) -> tuple[str, str]:
    """"worst V (case); " and "above TARGET: case V, ...; " of an every-case summary (or "")."""
    worst = f"worst {fmt(s['worst'])} ({s['worst_case']}); " if s.get("worst") is not None else ""
    above = f"above {target}: " + ", ".join(f"{k} {fmt(s['per_case'][k])}" for k in s["failing"]) + "; " if s.get("failing") else ""
    return worst, above


def _fresh_hint(s: Mapping[str, Any]) -> str:
    """How to measure a fresh-process target that nothing measured (not said when a run failed)."""
    return "" if s["n"] or s.get("convpass_invalid") else "run with --fresh-process"


def _fresh_geomean_line(s: Mapping[str, Any]) -> str:
    return (f"fresh process, convpass / fastest ORT EXHAUSTIVE: geometric mean {_x(s.get('geomean'))} over {s['n']} case(s); "
            f"target <= {s['target']:.2f}x: {s['verdict'].upper()}{_tail(s, _fresh_hint(s))}")


def _second_case_line(s: Mapping[str, Any]) -> str:
    title = "a model's second and later batch sizes in the same process (the executor that ran its first), call -> first result"
    if not s["n"] and not s["not_measured"]:
        return f"{title}: no model ran a second batch size; target <= {s['target']:g} s: {s['verdict'].upper()}"
    worst, above = _worst_and_above(s, lambda v: f"{_s(v)} s", f"{s['target']:g} s")
    return (f"{title}: {worst}{above}{s['n']} case(s); target <= {s['target']:g} s in every such case: "
            f"{s['verdict'].upper()}{_tail(s)}")


def _compilations_line(s: Mapping[str, Any]) -> str:
    failing = "".join(f"; {k}: {s['per_case'][k]['compilations']} compilation(s), {s['per_case'][k]['cache_files']} cache file(s)"
                      for k in s["failing"])
    return (f"run-time compilations in convpass's fresh process (count / files in CuPy's empty kernel cache): none in "
            f"{s['n'] - len(s['failing'])} of {s['n']} case(s){failing}; target: none in every case: "
            f"{s['verdict'].upper()}{_tail(s, _fresh_hint(s))}")


def _capture_line(s: Mapping[str, Any]) -> str:
    failing = "".join(f"; not captured: {k}: {why}" for k, why in s["failing"].items())
    return (f"every case in one captured CUDA graph: {len(s['captured'])} of {s['n'] + len(s['not_measured'])} case(s) "
            f"captured{failing}; target: every case: {s['verdict'].upper()}{_tail(s)}")


def _profile_line(s: Mapping[str, Any]) -> str:
    failing = "".join(f"; failed for {k}: {why}" for k, why in s["failing"].items())
    return (f"GPU time outside convolutions and top non-conv op family: reported for {len(s['per_case'])} of "
            f"{s['n'] + len(s['not_measured'])} case(s){failing}; target: every case: {s['verdict'].upper()}"
            f"{_tail(s, hint='run with --profile-ops')}")


def _cold_line(s: Mapping[str, Any]) -> str:
    least = f"least {_x(s['worst'])} ({s['worst_case']}), " if s.get("worst") is not None else ""
    return (f"cold start, ORT EXHAUSTIVE (session + first run) / convpass (construct -> first result): {least}"
            f"geometric mean {_x(s.get('geomean'))}; target >= {s['target']:.0f}x in every case: {s['verdict'].upper()}{_tail(s)}")


def format_summary(summary: Mapping[str, Any]) -> str:
    """Every target with its measured value and an honest met / not met / not measured: issue 9's,
    issue 10's, then issue 5's cold start (still reported, not an issue-9 target)."""
    s = summary
    return "\n".join([
        f"Summary over {s.get('cases', 0)} model/batch case(s)",
        "  Issue 9 targets:",
        "    " + _group_line(s["steady_vs_best_ort_batch1"]),
        "    " + _group_line(s["steady_vs_best_ort_large_batch"]),
        "    " + _every_case_line("steady state vs best ORT configuration, every case", s["steady_vs_best_ort_worst"],
                                  "geometric mean of all cases pooled (issue 5's form)"),
        "    " + _every_case_line("steady state vs best PyTorch eager, every case", s["steady_vs_best_torch"]),
        "    " + _capture_line(s["cuda_graph"]),
        "    " + _profile_line(s["op_profile"]),
        "  Issue 10 targets (cold start as a deployment meets it):",
        "    " + _every_case_line("fresh process (spawn -> first result), convpass / fastest ORT HEURISTIC, every case",
                                  s["fresh_vs_ort_heuristic"], hint=_fresh_hint(s["fresh_vs_ort_heuristic"])),
        "    " + _fresh_geomean_line(s["fresh_vs_ort_exhaustive"]),
        "    " + _second_case_line(s["second_case_cold_start"]),
        "    " + _compilations_line(s["fresh_compilations"]),
        "  Also reported (issue 5's target, not one of issue 9's):",
        "    " + _cold_line(s["cold_start_vs_ort_exhaustive"]),
    ])


def format_markdown(cases: Sequence[Mapping[str, Any]]) -> str:
    """One Markdown row per case, for the README's Performance section; cases not in one CUDA graph
    are marked ``no†N`` with the executor's reason in a footnote under the table."""
    head = ("| model, batch | convpass ms | best ORT ms (config) | best PyTorch ms (config) | vs ORT | vs PyTorch "
            "| CUDA graph | non-conv GPU time (top family) | convpass cold s | ORT EXHAUSTIVE cold s | cold speedup "
            "| conv time vs roofline |")
    rows = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    footnotes = []
    for case in cases:
        ours = find(case, "convpass") or {}
        bo = find(case, case.get("best_ort") or "") or {}
        bt = find(case, case.get("best_torch") or "") or {}
        r = case.get("ratios") or {}
        cold = find(case, r.get("ort_exhaustive_cold") or "") or {}
        ours_ms = _ms(ours.get("median_ms")) if ours.get("status") in RANKABLE else (ours.get("status") or "-")
        roof = case.get("roofline") or {}
        eff = roof.get("efficiency")
        roof_txt = f"{_ms(roof.get('measured_conv_ms'))} / {_ms(roof.get('bound_ms'))} ms ({100 * eff:.0f}%)" if isinstance(eff, (int, float)) else "-"
        graph = graph_mark(case)
        if graph == "no":
            footnotes.append(f"†{len(footnotes) + 1} {case.get('model')}, {case.get('batch')}: not one CUDA graph: "
                             f"{convpass_graph(case)['reason']}")
            graph += f"†{len(footnotes)}"
        rows.append(
            f"| {case.get('model')}, {case.get('batch')} | {ours_ms} | "
            f"{_ms(bo.get('median_ms'))} ({bo.get('name', '-').replace('ort ', '')}) | "
            f"{_ms(bt.get('median_ms'))} ({bt.get('name', '-').replace('torch ', '')}) | "
            f"{_x(r.get('vs_best_ort'))} | {_x(r.get('vs_best_torch'))} | {graph} | "
            f"{opprofile.short_text(case.get('op_profile'))} | {_s(ours.get('cold_start_s'))} | "
            f"{_s(cold.get('cold_start_s'))} | {_x(r.get('cold_start_speedup_vs_ort_exhaustive'))} | {roof_txt} |"
        )
    if footnotes:
        rows += ["", *(f"- {f}" for f in footnotes)]
    return "\n".join(rows)


def format_fresh_markdown(cases: Sequence[Mapping[str, Any]]) -> str:
    """One Markdown row per case: the fresh-process times to the first result (convpass's in parts),
    ONNX Runtime's fastest HEURISTIC and EXHAUSTIVE and PyTorch's fastest, the ratios, convpass's
    run-time compilations and its in-process cold start beside them."""
    head = ("| model, batch | convpass fresh s (import / context / model read / plan / first run) | ORT HEURISTIC fresh s "
            "| ORT EXHAUSTIVE fresh s | PyTorch fresh s | vs HEURISTIC | vs EXHAUSTIVE | compilations / cache files "
            "| convpass in-process cold s |")
    rows = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]

    def peer(c: Mapping[str, Any] | None, prefix: str) -> str:
        return f"{_s(fresh_total(c))} ({c['name'].replace(prefix, '')})" if c else "-"

    for case in cases:
        ours = find(case, "convpass") or {}
        rec = ours.get("fresh") or {}
        p = rec.get("parts") or {}
        if fresh_total(ours) is not None:
            split = " / ".join(_s(p.get(k)) for k in ("import_s", "context_s", "model_read_s", "plan_s", "first_run_s"))
            mine = f"{_s(p.get('total_s'))} ({split})"
        else:
            mine = rec.get("status") or "-"
        r = case.get("ratios") or {}
        rows.append(
            f"| {case.get('model')}, {case.get('batch')} | {mine} | {peer(fastest_fresh(case, 'ort', 'HEURISTIC'), 'ort ')} | "
            f"{peer(fastest_fresh(case, 'ort', 'EXHAUSTIVE'), 'ort ')} | {peer(fastest_fresh(case, 'torch'), 'torch ')} | "
            f"{_x(r.get('fresh_vs_ort_heuristic'))} | {_x(r.get('fresh_vs_ort_exhaustive'))} | "
            f"{_compiled_text(rec) if rec.get('parts') else '-'} | {_s(ours.get('cold_start_s'))} |"
        )
    return "\n".join(rows)


def format_environment(env: Mapping[str, Any], settings: Mapping[str, Any], peaks: Mapping[str, Any] | None) -> str:
    pk = ", ".join(f"{k}={v}" for k, v in sorted((env.get("packages") or {}).items()) if v)
    lines = [
        f"device: {env.get('device') or '?'}; driver {env.get('driver') or '?'}; CUDA runtime {env.get('cuda_runtime') or '?'} "
        f"(driver API {env.get('cuda_driver_api') or '?'}); cuDNN {env.get('cudnn') or '?'}",
        f"packages: {pk}",
        f"runs: {settings.get('runs')} timed after {settings.get('warmup')} warm-up; timing: {settings.get('timing')}",
    ]
    if peaks:
        tf, fp, bw = peaks.get("tf32_flops_per_s"), peaks.get("fp32_flops_per_s"), peaks.get("copy_bytes_per_s")
        bits = []
        if isinstance(tf, (int, float)):
            bits.append(f"TF32 matmul {tf / 1e12:.1f} TFLOP/s")
        if isinstance(fp, (int, float)):
            bits.append(f"FP32 matmul {fp / 1e12:.1f} TFLOP/s")
        if isinstance(bw, (int, float)):
            bits.append(f"device copy {bw / 1e12:.2f} TB/s (read + write)")
        lines.append("measured peaks: " + ", ".join(bits))
    return "\n".join(lines)


def format_report(doc: Mapping[str, Any]) -> str:
    """Everything a run prints: environment, one table per case, the summary, the Markdown panel table."""
    parts = [format_environment(doc.get("environment") or {}, doc.get("settings") or {}, doc.get("peaks"))]
    parts += [format_case(c) for c in doc.get("cases", [])]
    parts.append(format_summary(doc["summary"]))
    if doc.get("cases"):
        parts.append(format_markdown(doc["cases"]))
    if has_fresh(doc.get("cases", [])):
        parts.append(format_fresh_markdown(doc["cases"]))
    for n in doc.get("notes") or []:
        parts.append(f"note: {n}")
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------
# plot


class PlotUnavailable(RuntimeError):
    """matplotlib is not importable: no chart was written."""


def write_plot(doc: Mapping[str, Any], path: str, importer: Callable[[], Any] | None = None) -> str:
    """A bar chart per case: convpass, the best ORT and the best PyTorch median, relative to the best ORT.

    Raises :class:`PlotUnavailable` when matplotlib is missing. Returns the path written.
    """
    try:
        plt = importer() if importer else _pyplot()
    except ImportError as e:
        raise PlotUnavailable(f"matplotlib is not installed ({e}); no plot written (pip install matplotlib)") from None
    cases = doc.get("cases", [])
    labels = [case_label(c) for c in cases]
    series = {"convpass": [], "best ORT": [], "best PyTorch": []}
    for case in cases:
        base = find(case, case.get("best_ort") or "")
        base_ms = base["median_ms"] if base else None
        picks = {"convpass": find(case, "convpass"), "best ORT": base, "best PyTorch": find(case, case.get("best_torch") or "")}
        for k, c in picks.items():
            ok = c is not None and rankable(c) and base_ms
            series[k].append(c["median_ms"] / base_ms if ok else 0.0)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) + 2), 4))
    width = 0.27
    for i, (k, vals) in enumerate(series.items()):
        xs = [j + (i - 1) * width for j in range(len(labels))]
        ax.bar(xs, vals, width, label=k)
    geo, worst = TARGETS["steady_vs_best_ort_geomean"], TARGETS["steady_vs_best_ort_worst"]
    ax.axhline(geo, linestyle="--", linewidth=1, color="gray", label=f"target: geometric mean per batch group <= {geo:g}x")
    ax.axhline(worst, linestyle=":", linewidth=1, color="gray", label=f"target: every case <= {worst:g}x")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("steady-state median / best ORT configuration")
    env = doc.get("environment") or {}
    ax.set_title(f"convpass bench on {env.get('device') or 'GPU'} (lower is better; 0 = not measured / wrong)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

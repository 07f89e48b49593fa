"""The targets ``convpass bench`` judges: read from a data file, judged on the cases, reported
met / not met / not measured and never tuned to pass.

The file (the packaged ``convpass/bench/targets.json`` unless ``convpass bench --targets FILE``)
is a JSON object whose ``targets`` is a list; each target has

* ``name`` — what it judges, in a few words (``steady_vs_ort_every_case``); unique;
* ``judges`` — one sentence saying it in full (printed with the verdict);
* ``measure`` — what is read off each case, one of :data:`MEASURES`: a ratio of the case's
  ``ratios`` (``vs_ort_any``, ``vs_torch_compile``, ``cold_start_speedup_vs_ort_exhaustive``,
  ``non_conv_share``...), or ``cuda_graph`` (convpass ran as one captured CUDA graph),
  ``op_profile`` (the op profile was reported), ``fresh_compilations`` (run-time compilations and
  CuPy cache files in convpass's fresh process), ``in_place_slow_convs`` (the tuned convs that the
  in-place check of the kernel compile found slow: convpass's ``tuning.in_place.slow``);
* ``rule`` — ``every_case`` (every case within the bound; the worst case named, the failing ones
  listed), ``geomean`` (the geometric mean over the cases within the bound) or
  ``geomean_per_batch_group`` (the same over the batch-1 cases and over the batch > 1 cases apart);
* ``at_most`` or ``at_least`` — the bound (ratios, seconds, shares, counts); none for
  ``cuda_graph`` and ``op_profile``;
* ``cases`` (optional) — which cases it judges: ``all`` (default), ``batch 1``, ``batch > 1``, or
  ``later batch sizes`` (a model's second and later batch sizes in one bench process).

Verdicts: a case where convpass gave no valid result (wrong output or failure; for the
fresh-process measures, its fresh process's) makes the targets that read it ``not met``; cases
where the measure could not be taken are left out and listed (``not_measured``; for
``in_place_slow_convs`` also ``not_judged``: checks timed with host gaps, which name no slow
conv); with none taken the verdict is ``not measured``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from convpass.bench import jsonschema_check, opprofile
from convpass.bench.ranking import PEER_GROUPS, ratio_key
from convpass.bench.records import BATCH_GROUPS, batch_group, case_label, convpass_graph, convpass_invalid, find, fresh_invalid
from convpass.bench.stats import geomean
from convpass.core import json_text
from convpass.core.errors import ConvpassError
from convpass.core.files import read_text

DEFAULT_FILE = Path(__file__).with_name("targets.json")
TARGETS_LIMIT = 1 << 20  # bytes of a targets file
VERDICTS = ("met", "not met", "not measured")
RULES = ("every_case", "geomean", "geomean_per_batch_group")
CASE_FILTERS: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "all": lambda c: True,
    "batch 1": lambda c: batch_group(c.get("batch")) == BATCH_GROUPS[0],
    "batch > 1": lambda c: batch_group(c.get("batch")) == BATCH_GROUPS[1],
    "later batch sizes": lambda c: (c.get("model_order") or 0) >= 2,
}


@dataclasses.dataclass(frozen=True)
class Measure:
    """What a target reads off each case. ``kind``: ``ratio`` (a number of ``case["ratios"]``),
    ``captured``, ``reported``, ``compilations`` or ``slow_convs``; ``unit``: ``x``, ``s``, ``%`` (a
    share shown as a percentage) or ``n`` (a count); ``valid``: whose invalid results fail the target (``convpass``, ``fresh``, or
    none); ``hint``: how to take it when no case did."""

    title: str
    kind: str = "ratio"
    unit: str = "x"
    valid: str | None = "convpass"
    hint: str = ""


_FRESH = "run with --fresh-process"
MEASURES: dict[str, Measure] = {
    **{ratio_key(g): Measure(f"steady state, convpass / best of {title}") for g, (_, title) in PEER_GROUPS.items()},
    "cold_start_speedup_vs_ort_exhaustive": Measure(
        "cold start, ORT EXHAUSTIVE (session + first run) / convpass (construct -> first result)"),
    "fresh_vs_ort_heuristic": Measure("fresh process (spawn -> first result), convpass / fastest ORT HEURISTIC", valid="fresh",
                                      hint=_FRESH),
    "fresh_vs_ort_exhaustive": Measure("fresh process (spawn -> first result), convpass / fastest ORT EXHAUSTIVE", valid="fresh",
                                       hint=_FRESH),
    "second_case_cold_start_s": Measure("a model's next batch size in the executor that ran its first, call -> first result",
                                        unit="s"),
    "non_conv_share": Measure("GPU time outside convolutions / the tuned model's GPU time (eager op profile)", unit="%",
                              hint="run with --profile-ops"),
    "cuda_graph": Measure("every case in one captured CUDA graph", kind="captured"),
    "op_profile": Measure("GPU time outside convolutions and top non-conv op family", kind="reported", valid=None,
                          hint="run with --profile-ops"),
    "fresh_compilations": Measure("run-time compilations in convpass's fresh process (count / files in CuPy's empty kernel cache)",
                                  kind="compilations", valid="fresh", hint=_FRESH),
    "in_place_slow_convs": Measure("tuned convs over their tuned time inside the plan (the kernel compile's in-place check)",
                                   kind="slow_convs", unit="n", hint="bench without --no-kernels, on a GPU"),
}
COUNT_KINDS = ("compilations", "slow_convs")  # counts, judged in every case against at_most

FILE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["targets"],
    "properties": {
        "about": {"type": "string"},
        "targets": {"type": "array", "items": {
            "type": "object",
            "required": ["name", "judges", "measure", "rule"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z][a-z0-9_]*$"},
                "judges": {"type": "string", "minLength": 1},
                "measure": {"enum": list(MEASURES)},
                "rule": {"enum": list(RULES)},
                "cases": {"enum": list(CASE_FILTERS)},
                "at_most": {"type": "number"},
                "at_least": {"type": "number"},
            },
        }},
    },
}


def load(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The targets of ``path`` (default :data:`DEFAULT_FILE`), checked; ConvpassError naming the
    file and the target when one is malformed. The file is read as every file convpass reads
    (no FIFO or device, at most 1 MiB) and parsed strictly (:mod:`convpass.core.json_text`)."""
    where = Path(path) if path is not None else DEFAULT_FILE
    text = read_text(where, "--targets file", TARGETS_LIMIT)
    try:
        doc = json_text.loads(text)
    except ValueError as e:
        raise ConvpassError(f"--targets {where}: cannot read a targets file ({e})") from None
    return check(doc, str(where))


def check(doc: Any, where: str = "targets") -> list[dict[str, Any]]:
    """The targets of a parsed targets document, checked (see the module docstring)."""
    error = jsonschema_check.first_error(doc, FILE_SCHEMA)
    if error is not None:
        raise ConvpassError(f"--targets {where}: {error}")
    targets = [dict(t) for t in doc["targets"]]
    seen: set[str] = set()
    for t in targets:
        name, measure = t["name"], MEASURES[t["measure"]]
        if name in seen:
            raise ConvpassError(f"--targets {where}: target {name!r} is named twice")
        seen.add(name)
        bounds = [k for k in ("at_most", "at_least") if k in t]
        if measure.kind in ("captured", "reported"):
            if bounds or t["rule"] != "every_case":
                raise ConvpassError(f"--targets {where}: target {name!r}: measure {t['measure']!r} takes rule every_case and no bound")
        elif len(bounds) != 1:
            raise ConvpassError(f"--targets {where}: target {name!r}: give one of at_most / at_least")
        elif not math.isfinite(t[bounds[0]]):
            raise ConvpassError(f"--targets {where}: target {name!r}: {bounds[0]} must be a finite number, not {t[bounds[0]]}")
        elif measure.kind in COUNT_KINDS and (bounds != ["at_most"] or t["rule"] != "every_case"):
            raise ConvpassError(f"--targets {where}: target {name!r}: measure {t['measure']} takes rule every_case and at_most")
    return targets


# ---------------------------------------------------------------------------------------------
# judging


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "not met")


def _within(value: float, target: Mapping[str, Any]) -> bool:
    return value >= target["at_least"] if "at_least" in target else value <= target["at_most"]


def _invalid(cases: Sequence[Mapping[str, Any]], measure: Measure) -> list[str]:
    if measure.valid == "convpass":
        return convpass_invalid(cases)
    return fresh_invalid(cases) if measure.valid == "fresh" else []


def _values(cases: Sequence[Mapping[str, Any]], key: str, measure: Measure) -> tuple[dict[str, float], list[str]]:
    """A number of ``case["ratios"]`` per case label (a share may be 0, a ratio or time may not);
    the labels of the cases without one."""
    got, missing = {}, []
    for case in cases:
        v = (case.get("ratios") or {}).get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (v > 0 or (v == 0 and measure.unit == "%")):
            got[case_label(case)] = float(v)
        else:
            missing.append(case_label(case))
    return got, missing


def _positive_geomean(values: Mapping[str, float]) -> float | None:
    xs = [v for v in values.values() if v > 0]
    return geomean(xs) if xs and len(xs) == len(values) else None


def _base(target: Mapping[str, Any], cases: Sequence[Mapping[str, Any]], measure: Measure) -> dict[str, Any]:
    bound = {k: target[k] for k in ("at_most", "at_least") if k in target}
    return {"name": target["name"], "judges": target["judges"], "measure": target["measure"], "rule": target["rule"],
            "cases": target.get("cases", "all"), **bound, "convpass_invalid": _invalid(cases, measure)}


def _geomean(target: Mapping[str, Any], cases: Sequence[Mapping[str, Any]], measure: Measure) -> dict[str, Any]:
    rec = _base(target, cases, measure)
    got, missing = _values(cases, target["measure"], measure)
    gm = _positive_geomean(got)
    ok = False if rec["convpass_invalid"] else (None if gm is None else _within(gm, target))
    return rec | {"verdict": _verdict(ok), "n": len(got), "geomean": gm, "per_case": got, "not_measured": missing}


def _per_batch_group(target: Mapping[str, Any], cases: Sequence[Mapping[str, Any]], measure: Measure) -> dict[str, Any]:
    groups = []
    for group in BATCH_GROUPS:
        members = [c for c in cases if batch_group(c.get("batch")) == group]
        rec = _geomean(target, members, measure)
        groups.append({k: rec[k] for k in ("verdict", "n", "geomean", "per_case", "not_measured", "convpass_invalid")}
                      | {"group": group, "batches": sorted({c.get("batch") for c in members})})
    verdicts = [g["verdict"] for g in groups]
    verdict = "not met" if "not met" in verdicts else ("not measured" if set(verdicts) == {"not measured"} else "met")
    rec = _base(target, cases, measure)
    return rec | {"verdict": verdict, "n": sum(g["n"] for g in groups), "groups": groups,
                  "not_measured": [k for g in groups for k in g["not_measured"]]}


def _every_case(target: Mapping[str, Any], cases: Sequence[Mapping[str, Any]], measure: Measure) -> dict[str, Any]:
    rec = _base(target, cases, measure)
    got, missing = _values(cases, target["measure"], measure)
    at_least = "at_least" in target
    worst = (min if at_least else max)(got.items(), key=lambda kv: kv[1]) if got else None
    failing = [k for k, v in got.items() if not _within(v, target)]
    ok = False if rec["convpass_invalid"] else (None if not got else not failing)
    return rec | {"verdict": _verdict(ok), "n": len(got), "geomean": _positive_geomean(got), "worst": worst[1] if worst else None,
                  "worst_case": worst[0] if worst else None, "failing": failing, "per_case": got, "not_measured": missing}


def _captured(target: Mapping[str, Any], cases: Sequence[Mapping[str, Any]], measure: Measure) -> dict[str, Any]:
    """A status that is not recorded, or recorded as not applicable / not known, is "not measured" (never "met")."""
    rec = _base(target, cases, measure)
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
    ok = False if rec["convpass_invalid"] else (None if not captured and not failing else not failing)
    return rec | {"verdict": _verdict(ok), "n": len(captured) + len(failing), "captured": captured, "failing": failing,
                  "not_measured": missing}


def _reported(target: Mapping[str, Any], cases: Sequence[Mapping[str, Any]], measure: Measure) -> dict[str, Any]:
    rec = _base(target, cases, measure)
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
    return rec | {"verdict": _verdict(ok), "n": len(reported) + len(failing), "per_case": reported, "failing": failing,
                  "not_measured": missing}


def _compilations(target: Mapping[str, Any], cases: Sequence[Mapping[str, Any]], measure: Measure) -> dict[str, Any]:
    """The compilation count and the files CuPy wrote into its empty kernel cache, both at most the
    bound (either unknown: not measured)."""
    rec = _base(target, cases, measure)
    per_case: dict[str, dict[str, int]] = {}
    failing, missing = [], []
    for case in cases:
        fresh = (find(case, "convpass") or {}).get("fresh") or {}
        n, files = fresh.get("compilations"), fresh.get("cache_files")
        if fresh.get("status") in ("ok", "unchecked", "wrong") and isinstance(n, int) and isinstance(files, int):
            per_case[case_label(case)] = {"compilations": n, "cache_files": files}
            if n > target["at_most"] or files > target["at_most"]:
                failing.append(case_label(case))
        else:
            missing.append(case_label(case))
    ok = False if rec["convpass_invalid"] else (None if not per_case else not failing)
    return rec | {"verdict": _verdict(ok), "n": len(per_case), "per_case": per_case, "failing": failing, "not_measured": missing}


def _slow_convs(target: Mapping[str, Any], cases: Sequence[Mapping[str, Any]], measure: Measure) -> dict[str, Any]:
    """The slow convs the in-place check of the kernel compile named per case, at most the bound.
    A case whose check did not run (no kernels compiled, no GPU) is not measured; one whose check
    was timed with host gaps names no slow conv and is left out as ``not_judged``."""
    rec = _base(target, cases, measure)
    per_case: dict[str, float] = {}
    missing, unjudged = [], []
    for case in cases:
        placed = ((find(case, "convpass") or {}).get("tuning") or {}).get("in_place")
        if not placed:
            missing.append(case_label(case))
        elif not placed.get("judged"):
            unjudged.append(case_label(case))
        else:
            per_case[case_label(case)] = len(placed.get("slow") or ())
    worst = max(per_case.items(), key=lambda kv: kv[1]) if per_case else None
    failing = [k for k, v in per_case.items() if not _within(v, target)]
    ok = False if rec["convpass_invalid"] else (None if not per_case else not failing)
    return rec | {"verdict": _verdict(ok), "n": len(per_case), "worst": worst[1] if worst else None,
                  "worst_case": worst[0] if worst else None, "failing": failing, "per_case": per_case, "not_measured": missing,
                  "not_judged": unjudged}


def judge(target: Mapping[str, Any], cases: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One target's verdict on the (annotated) cases it applies to."""
    measure = MEASURES[target["measure"]]
    cases = [c for c in cases if CASE_FILTERS[target.get("cases", "all")](c)]
    kind = {"captured": _captured, "reported": _reported, "compilations": _compilations, "slow_convs": _slow_convs}.get(measure.kind)
    if kind is not None:
        return kind(target, cases, measure)
    rule = {"every_case": _every_case, "geomean": _geomean, "geomean_per_batch_group": _per_batch_group}[target["rule"]]
    return rule(target, cases, measure)


def judge_all(cases: Sequence[Mapping[str, Any]], targets: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [judge(t, cases) for t in targets]

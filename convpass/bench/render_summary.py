"""The summary ``convpass bench`` prints: convpass against the best of each peer group (geometric
mean per batch group, worst case, stand-ins), then every target of the targets file with its
measured value and its verdict (met / not met / not measured) and what the verdict leaves out.
Works on the document's ``summary`` alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from convpass.bench.records import BATCH_GROUPS
from convpass.bench.targets import MEASURES


def fmt_x(v: Any) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def fmt_s(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) else "-"


def _value(v: Any, unit: str) -> str:
    """A measured value in its unit: ``0.63x``, ``0.120 s``, ``25%``."""
    if not isinstance(v, (int, float)):
        return "-"
    return {"x": fmt_x(v), "s": f"{fmt_s(v)} s", "%": f"{100 * v:.0f}%"}.get(unit, f"{v:g}")


def _bound(t: Mapping[str, Any], unit: str) -> str:
    if "at_least" in t and t["at_least"] is not None:
        return f">= {_bound_value(t['at_least'], unit)}"
    return f"<= {_bound_value(t.get('at_most'), unit)}"


def _bound_value(v: Any, unit: str) -> str:
    if not isinstance(v, (int, float)):
        return "?"
    return {"x": f"{v:.2f}x", "s": f"{v:g} s", "%": f"{100 * v:g}%"}.get(unit, f"{v:g}")


# ---------------------------------------------------------------------------------------------
# rankings


def ranking_line(r: Mapping[str, Any]) -> str:
    """convpass against one peer group: per batch group, worst case, stand-ins."""
    if not r.get("n"):
        return f"{r['title']}: not measured"
    groups = "; ".join(f"{g} {fmt_x(r['groups'][g]['geomean'])} ({r['groups'][g]['n']} case(s))"
                       for g in BATCH_GROUPS if r["groups"][g]["n"])
    line = f"{r['title']}: {groups}; worst {fmt_x(r.get('worst'))} ({r.get('worst_case')})"
    if r.get("stand_ins"):
        line += "; best configuration without CUDA graphs standing in (ONNX Runtime refused to capture) for " + ", ".join(
            f"{k} ({why})" for k, why in r["stand_ins"].items())
    if r.get("not_measured"):
        line += f"; no ratio for {', '.join(r['not_measured'])}"
    return line


# ---------------------------------------------------------------------------------------------
# targets


def _tail(s: Mapping[str, Any], hint: str = "") -> str:
    """What a target's verdict leaves out: unmeasured cases (all of them in a word), cases measured
    but not judged, invalid convpass results."""
    parts = []
    missing = s.get("not_measured") or []
    if missing:
        parts.append("not measured for any case" if not s.get("n") else f"not measured for {', '.join(missing)}")
        if hint and not s.get("convpass_invalid"):
            parts.append(hint)
    if s.get("not_judged"):
        parts.append(f"timed with host gaps, not judged for {', '.join(s['not_judged'])}")
    if s.get("convpass_invalid"):
        parts.append(f"convpass output wrong or failed for {', '.join(s['convpass_invalid'])}")
    return f" ({'; '.join(parts)})" if parts else ""


def _group_line(t: Mapping[str, Any], g: Mapping[str, Any], unit: str, hint: str) -> str:
    batches = f"batches {', '.join(map(str, g['batches']))}; " if g["group"] != BATCH_GROUPS[0] and g["batches"] else ""
    return (f"{g['group']} ({batches}{g['n']} case(s)): geometric mean {_value(g.get('geomean'), unit)}; "
            f"target {_bound(t, unit)}: {g['verdict'].upper()}{_tail(g, hint)}")


def _geomean_line(t: Mapping[str, Any], unit: str, hint: str) -> str:
    measured = f"geometric mean {_value(t.get('geomean'), unit)} over {t['n']} case(s)" if t["n"] else "no case measured"
    return (f"{measured}; target {_bound(t, unit)}: "
            f"{t['verdict'].upper()}{_tail(t, hint)}")


def _every_case_line(t: Mapping[str, Any], unit: str, hint: str) -> str:
    if not t["n"] and not t["not_measured"] and not t.get("not_judged") and not t.get("convpass_invalid"):
        return f"no case to judge; target {_bound(t, unit)} in every case: {t['verdict'].upper()}"
    if not t["n"]:
        return f"no case measured; target {_bound(t, unit)} in every case: {t['verdict'].upper()}{_tail(t, hint)}"
    worst = f"{'least' if 'at_least' in t else 'worst'} {_value(t['worst'], unit)} ({t['worst_case']}); " if t.get("worst") is not None else ""
    above = ""
    if t.get("failing"):
        above = (f"{'below' if 'at_least' in t else 'above'} {_bound_value(t.get('at_least', t.get('at_most')), unit)}: "
                 + ", ".join(f"{k} {_value(t['per_case'][k], unit)}" for k in t["failing"]) + "; ")
    pooled = f"geometric mean {_value(t.get('geomean'), unit)} over " if unit == "x" else ""
    return (f"{worst}{above}{pooled}{t['n']} case(s); target {_bound(t, unit)} in every case: "
            f"{t['verdict'].upper()}{_tail(t, hint)}")


def _captured_line(t: Mapping[str, Any]) -> str:
    failing = "".join(f"; not captured: {k}: {why}" for k, why in t["failing"].items())
    return (f"{len(t['captured'])} of {t['n'] + len(t['not_measured'])} case(s) captured{failing}; target: every case: "
            f"{t['verdict'].upper()}{_tail(t)}")


def _reported_line(t: Mapping[str, Any], hint: str) -> str:
    failing = "".join(f"; failed for {k}: {why}" for k, why in t["failing"].items())
    return (f"reported for {len(t['per_case'])} of {t['n'] + len(t['not_measured'])} case(s){failing}; target: every case: "
            f"{t['verdict'].upper()}{_tail(t, hint)}")


def _compilations_line(t: Mapping[str, Any], hint: str) -> str:
    failing = "".join(f"; {k}: {t['per_case'][k]['compilations']} compilation(s), {t['per_case'][k]['cache_files']} cache file(s)"
                      for k in t["failing"])
    return (f"none in {t['n'] - len(t['failing'])} of {t['n']} case(s){failing}; target: at most {t.get('at_most'):g} in every "
            f"case: {t['verdict'].upper()}{_tail(t, hint)}")


def target_lines(t: Mapping[str, Any]) -> list[str]:
    """A target's verdict: its name and what it judges, then its result line(s)."""
    measure = MEASURES.get(t["measure"])
    unit, hint, kind = (measure.unit, measure.hint, measure.kind) if measure else ("x", "", "ratio")
    scope = "" if t.get("cases", "all") == "all" else f" [cases: {t['cases']}]"
    head = f"{t['name']}: {t['judges']}{scope}"
    if kind == "captured":
        return [head, "  " + _captured_line(t)]
    if kind == "reported":
        return [head, "  " + _reported_line(t, hint)]
    if kind == "compilations":
        return [head, "  " + _compilations_line(t, hint)]
    if t["rule"] == "geomean_per_batch_group":
        return [head, *("  " + _group_line(t, g, unit, hint) for g in t["groups"])]
    if t["rule"] == "geomean":
        return [head, "  " + _geomean_line(t, unit, hint)]
    return [head, "  " + _every_case_line(t, unit, hint)]


def format_summary(summary: Mapping[str, Any], targets_file: str | None = None) -> str:
    """The rankings against every peer group, then every target with its measured value and an
    honest met / not met / not measured."""
    lines = [f"Summary over {summary.get('cases', 0)} model/batch case(s)",
             "  convpass / the best of each peer (steady-state medians; geometric mean per batch group, worst case):"]
    lines += ["    " + ranking_line(r) for r in (summary.get("rankings") or {}).values()]
    lines.append(f"  Targets{f' ({targets_file})' if targets_file else ''}:")
    for t in summary.get("targets") or []:
        lines += ["    " + line for line in target_lines(t)]
    return "\n".join(lines)

"""What ``convpass bench`` prints about its cases: the environment, one table per case (every
contender's cold start, steady state, ratio to the best peer and output check; the best of each
peer group; convpass's tuning, roofline, CUDA graph status, op profile and fresh processes), the
Markdown tables for the README and the whole report of a document (:func:`format_report`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from convpass.bench import fresh, opprofile
from convpass.bench.ranking import PEER_GROUPS, fastest_fresh, fresh_total, ratio_key
from convpass.bench.records import RANKABLE, convpass_graph, find
from convpass.bench.render_summary import fmt_s as _s
from convpass.bench.render_summary import fmt_x as _x
from convpass.bench.render_summary import format_summary
from convpass.compiler.aot import SHOWN_SLOW


def _ms(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) else "-"


def _sci(v: Any) -> str:
    return f"{v:.1e}" if isinstance(v, (int, float)) else "-"


def _table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [(c.rjust(w) if i in right else c.ljust(w)) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


# ---------------------------------------------------------------------------------------------
# CUDA graph status


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
# one case


def _cold_detail(c: Mapping[str, Any]) -> str:
    if c.get("family") in ("ort", "ort-graph") and isinstance(c.get("session_s"), (int, float)):
        return f"{_s(c.get('cold_start_s'))} ({_s(c['session_s'])}+{_s(c.get('first_run_s'))})"
    if c.get("family") == "torch-compile" and isinstance(c.get("compile_s"), (int, float)):
        return f"{_s(c.get('cold_start_s'))} (first call {_s(c['compile_s'])})"
    return _s(c.get("cold_start_s"))


def check_text(c: Mapping[str, Any]) -> str:
    st = c.get("status")
    if st == "ok":
        return "ok"
    label = "WRONG" if st == "wrong" else st
    return f"{label}: {c.get('reason') or ''}".rstrip(": ")


def tuning_line(t: Mapping[str, Any] | None) -> str | None:
    """One line on how convpass's decisions were taken (measured or all from the tuning cache), the
    kernels compiled ahead of time and their in-place check (with its slow convs beneath)."""
    if not t:
        return None
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
    line = f"convpass optimize: {_s(t.get('optimize_s'))} s{tail} ({where}{extra})"
    if t.get("kernels") and t.get("kernels_s") is None:
        line += f"; kernels: {t['kernels']}"
    elif t.get("kernels"):
        line += f"; kernels ahead of time ({_s(t.get('kernels_s'))} s): {t['kernels']}"
    placed = t.get("in_place")
    if placed:
        line += f"; {placed['line']}" + "".join(f"\n    {s}" for s in slow_conv_lines(placed.get("slow") or []))  # worst first
    return line


def slow_conv_lines(slow: Sequence[str]) -> list[str]:
    """The first :data:`convpass.compiler.aot.SHOWN_SLOW` slow convs of the in-place check (worst
    first), then "... and N more"."""
    shown = list(slow[:SHOWN_SLOW])
    rest = len(slow) - len(shown)
    return shown + ([f"... and {rest} more (the JSON record lists every one)"] if rest else [])


def roofline_line(r: Mapping[str, Any] | None) -> str | None:
    if not r:
        return None
    if r.get("bound_ms") is None:
        return f"roofline: not computed ({r.get('note') or 'no measured peaks'})"
    eff = r.get("efficiency")
    pk = r.get("peaks") or {}
    tf, bw = pk.get("tf32_flops_per_s"), pk.get("copy_bytes_per_s")
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


def peers_line(case: Mapping[str, Any]) -> str:
    """convpass against the best of each peer group that ran, and who that best was."""
    best, r = case.get("best") or {}, case.get("ratios") or {}
    parts = []
    for group, (_, title) in PEER_GROUPS.items():
        name = best.get(group)
        if name is None:
            continue
        stand = " standing in" if group in (case.get("stand_ins") or {}) else ""
        parts.append(f"{title} {_x(r.get(ratio_key(group)))} ({name}{stand})")
    return "convpass vs the best of " + ("; ".join(parts) if parts else "no peer (none ran)")


def format_case(case: Mapping[str, Any]) -> str:
    """The per-case table: cold start, steady median, p10-p90, ratio to the best peer, correctness."""
    inputs = ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in (case.get("inputs") or {}).items())
    ours = find(case, "convpass") or {}
    tf32 = ours.get("tf32")
    lines = [
        f"{case.get('model')} batch {case.get('batch')} ({inputs}; {case.get('dtype')}"
        + ("" if tf32 is None else f"; TF32 {'on' if tf32 else 'off'}")
        + f"); reference: {case.get('reference') or 'none'}"
    ]
    tl = tuning_line(ours.get("tuning"))
    if tl:
        lines.append("  " + tl)
    best_peer = (case.get("best") or {}).get("all")
    rows = [["contender", "cold start s", "median ms", "p10-p90 ms", "vs best peer", "rel err", "check"]]
    for c in case.get("contenders", []):
        if c.get("status") in ("unavailable", "skipped", "refused", "failed") and c.get("median_ms") is None:
            rows.append([c["name"], "-", "-", "-", "-", "-", check_text(c)])
            continue
        ratio = _x(c.get("ratio_to_best_peer"))
        if c.get("name") == best_peer:
            ratio += " (best)"
        if c.get("status") == "wrong":
            ratio = "not ranked"
        spread = f"{_ms(c.get('p10_ms'))}-{_ms(c.get('p90_ms'))}" if c.get("p10_ms") is not None else "-"
        rows.append([c["name"], _cold_detail(c), _ms(c.get("median_ms")), spread, ratio, _sci(c.get("rel_err")), check_text(c)])
    lines += ["  " + line for line in _table(rows, right=(1, 2, 3, 4, 5))]
    rl = roofline_line(case.get("roofline"))
    if rl:
        lines.append("  " + rl)
    r = case.get("ratios") or {}
    lines.append("  " + peers_line(case))
    for group, why in (case.get("stand_ins") or {}).items():
        lines.append(f"  {PEER_GROUPS[group][1]}: refused ({why}); {(case.get('best') or {}).get(group)} stands in")
    lines.append(f"  cold start: convpass {_x(r.get('cold_start_speedup_vs_ort_exhaustive'))} sooner than "
                 f"{r.get('ort_exhaustive_cold') or 'ORT EXHAUSTIVE'}")
    lines.append("  " + graph_text(case))
    profile = case.get("op_profile")
    for line in (opprofile.summary_line(profile), opprofile.family_line(profile)):
        if line:
            lines.append("  " + line)
    same = same_executor_line(case)
    if same:
        lines.append("  " + same)
    lines += ["  " + line for line in fresh_lines(case)]
    lines += [f"  note: {n}" for n in case.get("notes") or []]
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


# ---------------------------------------------------------------------------------------------
# fresh processes


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
        rows.append([c["name"], _s(c.get("cold_start_s")), *(_s(p.get(k)) for k in fresh.PART_KEYS), compiled, check_text(rec)])
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
    return ("fresh process (--fresh-process): " + "; ".join(f"{k}: {v}" if k != "all" else v for k, v in fresh.LEGEND.items())
            + "; ONNX Runtime with CUDA graphs and torch.compile are not run in fresh processes")


# ---------------------------------------------------------------------------------------------
# Markdown


def _best_cell(case: Mapping[str, Any], group: str, prefix: str) -> str:
    name = (case.get("best") or {}).get(group)
    c = find(case, name or "") or {}
    if not c:
        return "-"
    stand = ", stand-in" if group in (case.get("stand_ins") or {}) else ""
    return f"{_ms(c.get('median_ms'))} ({c['name'].replace(prefix, '').replace('ort ', 'no graph: ')}{stand})"


def format_markdown(cases: Sequence[Mapping[str, Any]]) -> str:
    """One Markdown row per case, for the README's Performance section; cases not in one CUDA graph
    are marked ``no†N`` with the executor's reason in a footnote under the table."""
    head = ("| model, batch | convpass ms | best ORT ms (config) | best ORT + CUDA graph ms (config) | best PyTorch eager ms (config) "
            "| best torch.compile ms (mode) | vs ORT (any) | vs torch.compile | vs best peer | CUDA graph "
            "| non-conv GPU time (top family) | convpass cold s | ORT EXHAUSTIVE cold s | cold speedup | torch.compile first call s "
            "| conv time vs roofline |")
    rows = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    footnotes = []
    for case in cases:
        ours = find(case, "convpass") or {}
        r = case.get("ratios") or {}
        cold = find(case, r.get("ort_exhaustive_cold") or "") or {}
        compiled = find(case, (case.get("best") or {}).get("torch-compile") or "") or {}
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
            f"| {case.get('model')}, {case.get('batch')} | {ours_ms} | {_best_cell(case, 'ort', 'ort ')} | "
            f"{_best_cell(case, 'ort-graph', 'ort-graph ')} | {_best_cell(case, 'torch', 'torch ')} | "
            f"{_best_cell(case, 'torch-compile', 'torch.compile ')} | {_x(r.get('vs_ort_any'))} | {_x(r.get('vs_torch_compile'))} | "
            f"{_x(r.get('vs_all'))} | {graph} | {opprofile.short_text(case.get('op_profile'))} | {_s(ours.get('cold_start_s'))} | "
            f"{_s(cold.get('cold_start_s'))} | {_x(r.get('cold_start_speedup_vs_ort_exhaustive'))} | {_s(compiled.get('compile_s'))} | "
            f"{roof_txt} |"
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


# ---------------------------------------------------------------------------------------------
# the whole report


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


def format_tail(doc: Mapping[str, Any]) -> str:
    """What follows the cases: the summary, the Markdown tables and the notes."""
    cases = doc.get("cases", [])
    parts = [format_summary(doc["summary"], (doc.get("settings") or {}).get("targets_file"))]
    if cases:
        parts.append(format_markdown(cases))
    if has_fresh(cases):
        parts.append(format_fresh_markdown(cases))
    parts += [f"note: {n}" for n in doc.get("notes") or []]
    return "\n\n".join(parts)


def format_report(doc: Mapping[str, Any]) -> str:
    """Everything a run prints: environment, one table per case, the summary, the Markdown tables, the notes."""
    parts = [format_environment(doc.get("environment") or {}, doc.get("settings") or {}, doc.get("peaks"))]
    parts += [format_case(c) for c in doc.get("cases", [])]
    parts.append(format_tail(doc))
    return "\n\n".join(parts)

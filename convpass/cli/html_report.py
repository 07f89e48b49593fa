"""``convpass inspect MODEL --html PATH``: a per-layer report of a tuned model in one self-contained HTML page.

Rules of the page:

1. Nothing is fetched: the CSS, the script and every chart (inline SVG) are in the file.
2. One ``<section class="conv">`` per convolution, device table and profile (the records of
   :func:`convpass.inspect`, in graph order), holding the choice (algorithm or engine, fused
   epilogue, source), its time, its margin over the runner-up and over cuDNN's heuristic first
   choice where the tuning cache recorded them, the workspace, the precision (data type and math
   mode: TF32 or not) and the memory format; and a bar chart of every candidate the tuning cache
   timed for it (:mod:`convpass.cli.candidates`), the choice highlighted. Where no candidates are
   available the section says why.
3. Every string from the model or the cache is escaped (:func:`html.escape`); the data of the page
   is also embedded as JSON (``<script type="application/json" id="convpass-data">``, schema
   ``convpass.inspect-html/1``) with ``<``, ``>`` and ``&`` written as ``\\u003c`` ... so that no
   string can close the script element.
4. The page's script (a filter by node name) checks that the embedded data parses and that every
   record has its section, then adds ``<p id="convpass-rendered">``: a headless browser's DOM shows
   whether the page rendered without a script error.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from typing import Any

from convpass.cli.candidates import Candidate, Comparison

__all__ = ["MAX_BARS", "SCHEMA", "render"]

SCHEMA = "convpass.inspect-html/1"
MAX_BARS = 40  # the fastest candidates charted per section; the rest are counted

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:70rem;padding:0 1rem;color:#1d2430}
h1{font-size:1.4rem;margin-bottom:.2rem}h2{font-size:1.05rem;margin:0 0 .4rem}
code,.key{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px;overflow-wrap:anywhere}
section.conv{border:1px solid #d7dce3;border-radius:6px;padding:.8rem 1rem;margin:1rem 0}
dl{display:grid;grid-template-columns:max-content 1fr;gap:.15rem 1rem;margin:.3rem 0 .6rem}dt{color:#5b6675}dd{margin:0}
.na{color:#8a5300}.meta{color:#5b6675}input{font:inherit;padding:.2rem .4rem;width:20rem}
svg text{font:11px ui-monospace,Menlo,monospace;fill:#1d2430}.bar{fill:#9db4d6}.bar.chosen{fill:#1f7a3a}.bar.heuristic{fill:#c08a2e}
"""

_SCRIPT = """
(function () {
  var data = JSON.parse(document.getElementById("convpass-data").textContent);
  var sections = document.querySelectorAll("section.conv");
  if (data.schema !== "SCHEMA_ID" || sections.length !== data.sections.length) {
    throw new Error("convpass report: " + sections.length + " sections for " + data.sections.length + " records");
  }
  var box = document.getElementById("filter");
  box.addEventListener("input", function () {
    var text = box.value.toLowerCase();
    for (var i = 0; i < sections.length; i++) {
      var node = data.sections[i].node.toLowerCase();
      sections[i].hidden = text !== "" && node.indexOf(text) < 0;
    }
  });
  var done = document.createElement("p");
  done.id = "convpass-rendered";
  done.className = "meta";
  done.textContent = "report rendered: " + sections.length + " sections";
  document.body.appendChild(done);
})();
""".replace("SCHEMA_ID", SCHEMA)


def _e(value: Any) -> str:
    return html.escape("-" if value is None else str(value), quote=True)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f} ms"


def _margin(comparison: Comparison, other_ms: float | None, what: str) -> str:
    fraction = comparison.margin(other_ms)
    if fraction is None:
        return f"not recorded ({what})"
    return f"{_ms(other_ms)}, {abs(fraction) * 100:.1f}% {'slower' if fraction >= 0 else 'faster'} than the choice"


def _precision(record: dict[str, Any]) -> str:
    key = record.get("problem_key") or ""
    dtype = key.split("|")[-3] if key.count("|") >= 3 else "-"
    math = record.get("math_mode")
    tf32 = record.get("tf32")
    tf32_text = "" if tf32 is None else (", TF32 allowed" if tf32 else ", TF32 off (FMA)")
    return f"{dtype}, math {math or '-'}{tf32_text if dtype == 'float32' else ''}"


def _choice(record: dict[str, Any]) -> str:
    if record.get("source") == "untuned":
        return "not tuned (a plain standard op)"
    name = record.get("engine") and f"graph-API engine {record['engine']}" or record.get("algo") or "auto"
    if record.get("fusion"):
        name += f" with {record['fusion']} fused"
    return f"{name} (source: {record.get('source')})"


def _chart(candidates: Sequence[Candidate]) -> str:
    """A horizontal bar per candidate (fastest first), the choice and cuDNN's heuristic first choice
    marked, as inline SVG."""
    shown = list(candidates[:MAX_BARS])
    label_w, bar_w, row_h = 360, 320, 18
    longest = max(c.time_ms for c in shown) or 1.0
    height = row_h * len(shown) + 6
    rows = []
    for i, c in enumerate(shown):
        y = 3 + i * row_h
        width = max(1.0, bar_w * c.time_ms / longest)
        kind = " chosen" if c.chosen else " heuristic" if c.heuristic else ""
        mark = " (chosen)" if c.chosen else " (cuDNN heuristic)" if c.heuristic else ""
        label = c.label if len(c.label) <= 52 else c.label[:51] + "…"
        rows.append(
            f'<g><title>{_e(c.label)}: {c.time_ms:.4f} ms, workspace {c.workspace_bytes} B{_e(mark)}</title>'
            f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end">{_e(label)}</text>'
            f'<rect class="bar{kind}" x="{label_w}" y="{y}" width="{width:.1f}" height="{row_h - 4}"/>'
            f'<text x="{label_w + width + 4:.1f}" y="{y + 12}">{c.time_ms:.4f} ms{_e(mark)}</text></g>'
        )
    total_w = label_w + bar_w + 190
    return (f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{total_w}" height="{height}" '
            f'viewBox="0 0 {total_w} {height}" aria-label="candidate times">{"".join(rows)}</svg>')


def _section(index: int, record: dict[str, Any], comparison: Comparison) -> str:
    fields = [
        ("profile", record.get("profile")),
        ("device", record.get("device")),
        ("choice", _choice(record)),
        ("time", _ms(record.get("time_ms"))),
        ("over the runner-up", _margin(comparison, comparison.runner_up.time_ms if comparison.runner_up else None,
                                       "no other candidate timed" if not comparison.missing else "candidates not available")),
        ("over cuDNN's heuristic", (f"{comparison.heuristic_algo}, " if comparison.heuristic_algo else "")
         + _margin(comparison, comparison.heuristic_ms, "its first choice was not timed" if not comparison.missing
                   else "candidates not available")),
        ("workspace", "-" if record.get("workspace_bytes") in (None, -1) else f"{record['workspace_bytes']} B"),
        ("precision", _precision(record)),
        ("layout", record.get("memory_format")),
        ("problem", record.get("problem_key") or "-"),
    ]
    rows = "".join(f"<dt>{_e(name)}</dt><dd{' class=key' if name == 'problem' else ''}>{_e(value)}</dd>" for name, value in fields)
    if comparison.candidates:
        extra = len(comparison.candidates) - MAX_BARS
        body = _chart(comparison.candidates)
        notes = []
        if extra > 0:
            notes.append(f"{extra} slower candidates not charted")
        if comparison.not_run:
            notes.append("did not run: " + ", ".join(f"{n} {status}" for status, n in comparison.not_run.items()))
        if comparison.missing:
            notes.append(comparison.missing)
        body += "".join(f'<p class="meta">{_e(n)}</p>' for n in notes)
    else:
        reason = comparison.missing or "no candidate was timed"
        body = f'<p class="na">Candidates are not available: {_e(reason)}. Shown: what the model records.</p>'
    title = f"{record.get('node')} ({record.get('op')})"
    return (f'<section class="conv" id="conv-{index}" data-node="{_e(record.get("node"))}">'
            f"<h2>{_e(title)}</h2><dl>{rows}</dl>{body}</section>")


def _json_for_script(document: dict[str, Any]) -> str:
    text = json.dumps(document, allow_nan=False, default=str)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def render(model: str, records: Sequence[dict[str, Any]], comparisons: Sequence[Comparison], *, cache: str,
           kernels: str = "") -> str:
    """The page (module docstring) of ``records`` (:func:`convpass.inspect`) and their
    ``comparisons`` (one each); ``cache`` says where the candidates came from."""
    sections = [_section(i, r, c) for i, (r, c) in enumerate(zip(records, comparisons))]
    document = {
        "schema": SCHEMA,
        "model": model,
        "cache": cache,
        "sections": [{**r, **c.to_json()} for r, c in zip(records, comparisons)],
    }
    convs = len({r.get("node") for r in records})
    summary = f"{convs} convolutions, {len(records)} decisions (one section per conv, device and profile). Candidates: {cache}."
    return "".join([
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>convpass report: {_e(model)}</title><style>{_CSS}</style></head><body>",
        f"<h1>convpass report: <code>{_e(model)}</code></h1><p class=\"meta\">{_e(summary)}</p>",
        f"<p class=\"meta\">{_e(kernels)}</p>" if kernels else "",
        '<p><label>Filter by node: <input id="filter" type="search" autocomplete="off"></label></p>',
        "\n".join(sections),
        f'<script type="application/json" id="convpass-data">{_json_for_script(document)}</script>',
        f"<script>{_SCRIPT}</script></body></html>\n",
    ])

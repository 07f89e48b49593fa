"""``convpass bench --plot``: a bar chart per case (matplotlib, imported only here): convpass, the
best ONNX Runtime configuration and the best PyTorch (eager or torch.compile) median, relative to
the best ONNX Runtime configuration, with the bounds of the targets that judge that ratio.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from convpass.bench.records import find, rankable
from convpass.core.errors import ConvpassError
from convpass.core.files import write_bytes_atomically


class PlotUnavailable(RuntimeError):
    """matplotlib is not importable: no chart can be written."""


def pyplot(importer: Callable[[], Any] | None = None) -> Any:
    """matplotlib's pyplot on the Agg backend; :class:`PlotUnavailable` (one line) when it is missing."""
    try:
        return importer() if importer else _agg_pyplot()
    except ImportError as e:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed ({e}); pip install matplotlib") from None


def _agg_pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bounds(doc: Mapping[str, Any]) -> list[tuple[float, str]]:
    """The at-most bounds of the targets on convpass / best ONNX Runtime configuration, with their labels."""
    out = []
    for t in (doc.get("settings") or {}).get("targets") or []:
        if isinstance(t, Mapping) and t.get("measure") == "vs_ort_any" and isinstance(t.get("at_most"), (int, float)):
            what = "geometric mean per batch group" if t.get("rule") == "geomean_per_batch_group" else (
                "geometric mean" if t.get("rule") == "geomean" else "every case")
            out.append((float(t["at_most"]), f"target: {what} <= {t['at_most']:g}x"))
    return out


def write_plot(doc: Mapping[str, Any], path: str, importer: Callable[[], Any] | None = None,
               protect: Sequence[tuple[str, str]] = ()) -> str:
    """Write the chart to ``path`` (in the format its suffix names, PNG without one) and return it:
    drawn in memory, then written as every output is (:func:`convpass.core.files.write_bytes_atomically`,
    never over a file ``protect`` names); :class:`PlotUnavailable` when matplotlib is missing."""
    plt = pyplot(importer)
    cases = doc.get("cases", [])
    labels = [f"{c.get('model')} b{c.get('batch')}" for c in cases]
    series: dict[str, list[float]] = {"convpass": [], "best ONNX Runtime": [], "best PyTorch": []}
    for case in cases:
        best = case.get("best") or {}
        base = find(case, best.get("ort-any") or "")
        torch_best = [find(case, best.get(g) or "") for g in ("torch", "torch-compile")]
        torch_best = [c for c in torch_best if c is not None and rankable(c)]
        picks = {"convpass": find(case, "convpass"), "best ONNX Runtime": base,
                 "best PyTorch": min(torch_best, key=lambda c: c["median_ms"]) if torch_best else None}
        for k, c in picks.items():
            ok = c is not None and rankable(c) and base is not None
            series[k].append(c["median_ms"] / base["median_ms"] if ok else 0.0)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) + 2), 4))
    width = 0.27
    for i, (k, vals) in enumerate(series.items()):
        ax.bar([j + (i - 1) * width for j in range(len(labels))], vals, width, label=k)
    for bound, label in _bounds(doc):
        ax.axhline(bound, linestyle="--", linewidth=1, color="gray", label=label)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("steady-state median / best ONNX Runtime configuration")
    env = doc.get("environment") or {}
    ax.set_title(f"convpass bench on {env.get('device') or 'GPU'} (lower is better; 0 = not measured / wrong)")
    ax.legend()
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, dpi=120, format=Path(path).suffix.lstrip(".").lower() or "png")
    except ValueError as e:  # a format matplotlib does not write
        raise ConvpassError(f"--plot {path}: cannot draw the chart ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    finally:
        plt.close(fig)
    write_bytes_atomically(path, image.getvalue(), "--plot", protect)
    return path

"""``convpass inspect MODEL [--device NAME] [--json] [--json-file PATH] [--html PATH [--cache PATH]]``.

Lists every convolution of a model with its recorded decisions, per device and profile: a table
that fits the terminal (long problem keys fold), one ``convpass.inspect/1`` JSON document
(``--json``), or a self-contained HTML report with each conv's candidates (``--html``,
:mod:`convpass.cli.html_report`). Every string from the model reaches the terminal as text, never
as rich markup.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from convpass.cli.output import add_json_options, emit_json, message_console, printable, result_console, write_report

__all__ = ["SCHEMA", "add_inspect_parser", "inspect_command"]

SCHEMA = "convpass.inspect/1"


def add_inspect_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "inspect",
        help="list every convolution of a model and its recorded decisions, per device",
        description="List every convolution of a model and the decisions recorded for it, per device and shape profile; "
        "--html writes a per-layer report with each conv's candidates and their times.",
    )
    p.add_argument("model", help="an ONNX model (tuned or not)")
    p.add_argument("--device", metavar="NAME", help="only the decisions for devices matching NAME (e.g. H100, or a full fingerprint)")
    p.add_argument("--html", metavar="PATH",
                   help="also write a self-contained HTML report to PATH (atomically): per conv and profile, the candidates "
                   "and their times as a chart, the choice and its margins, workspace, precision and layout")
    p.add_argument("--cache", metavar="PATH",
                   help="the tuning cache that holds the candidates' times for --html (default: $CONVPASS_CACHE or the "
                   "XDG cache dir, where it exists)")
    add_json_options(p, SCHEMA)
    p.set_defaults(func=inspect_command)
    return p


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}{unit}"
    return f"{value}{unit}"


def _size(n: int | None) -> str:
    if n is None or n < 0:
        return "-"
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.1f} GiB"


def _decision(r: dict[str, Any]) -> str:
    """The algorithm or engine that runs the conv, with the epilogue fused into its call
    (``implicit_gemm +bias+relu``, ``engine eng67_k2=16 +bias+swish``, ``engine eng5 +bias+leakyrelu0.2``)."""
    name = f"engine {r['engine']}" if r.get("engine") else r["algo"]
    if name is None:
        return "-"
    return f"{name} +{r['fusion']}" if r.get("fusion") else name


def _table(model: str, records: list[dict[str, Any]]) -> Table:
    """The decisions as a table that fits the terminal: short columns; each problem key (up to 120
    characters) goes below the table (:func:`_problem_keys`)."""
    devices = list(dict.fromkeys(r["device"] for r in records if r["device"]))
    title = f"{model}: {len({r['node'] for r in records})} convolutions"
    if len(devices) == 1:
        title += f", decisions for {devices[0]}"
    elif devices:
        title += f", decisions for {len(devices)} devices"
    with_op = any(r["op"] != "Conv" for r in records)
    table = Table(title=Text(printable(title)), box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    measured = any(r.get("precision_error") is not None or r.get("precision_sensitivity") is not None for r in records)
    columns = ["node"] + (["op"] if with_op else []) + (["device"] if len(devices) > 1 else []) + [
        "profile", "decision", "format", "math", "precision"] + (["error", "fp16 alone"] if measured else []) + [
        "workspace", "time", "source"]
    for col in columns:  # every column folds but the time; rich measures the terminal
        table.add_column(col, overflow="fold", no_wrap=col == "time", min_width=10 if col == "decision" else None)
    for r in records:
        row = [r["node"]] + ([r["op"]] if with_op else []) + ([_fmt(r["device"])] if len(devices) > 1 else []) + [
            _fmt(r["profile"]), _decision(r), _fmt(r["memory_format"]), _fmt(r["math_mode"]), _fmt(r.get("precision"))] + (
            [_sci(r.get("precision_error")), _sci(r.get("precision_sensitivity"))] if measured else []) + [
            _size(r["workspace_bytes"]), _fmt(r["time_ms"], " ms"), r["source"]]
        table.add_row(*(Text(printable(cell)) for cell in row))  # text, not markup: names come from the file
    return table


def _sci(value: Any) -> str:
    return "-" if value is None else f"{value:.2e}"


def _model_precision(model: Any) -> dict:
    """The model's ``convpass.precision`` record (empty for a model tuned without --precision)."""
    from convpass.core import annotation
    from convpass.core.model_io import load_model, to_proto

    info = annotation.read_model_info(to_proto(load_model(model)))
    return dict(info.precision) if info is not None else {}


def _problem_keys(records: list[dict[str, Any]]) -> Text:
    """``node [profile]: problem key`` per decided record, folded at the terminal's width."""
    text = Text("problem keys:")
    for r in records:
        if r["problem_key"]:
            text.append(printable(f"\n  {r['node']} [{r['profile']}]: {r['problem_key']}"))
    return text


def _write_html(args: argparse.Namespace, records: list[dict[str, Any]], kernels: str) -> None:
    from convpass.cli.candidates import CandidateSource
    from convpass.cli.html_report import render

    source = CandidateSource(args.cache)
    try:
        comparisons = [source.compare(r) for r in records]
        where = f"tuning cache {source.path}" if source.cache is not None else f"not available ({source.why_not})"
    finally:
        source.close()
    write_report(args, "html", render(str(args.model), records, comparisons, cache=where, kernels=kernels))
    message_console(args).print(f"wrote {args.html}", markup=False)


def inspect_command(args: argparse.Namespace) -> int:
    from convpass.compiler.pipeline import inspect

    records = inspect(args.model, device=args.device)
    kernels = ""
    if isinstance(args.model, str) and os.path.isfile(args.model):
        from convpass.core.kernel_file import describe

        kernels = describe(args.model)
    if args.cache and not args.html:
        from convpass.core.errors import OptionError

        raise OptionError("--cache applies to --html only (the candidates' times)")
    if args.html:
        _write_html(args, records, kernels)
    emit_json(args, {"schema": SCHEMA, "model": str(args.model), "records": records, "kernels": kernels or None})
    console = result_console(args)
    console.print(_table(str(args.model), records))
    if any(r["problem_key"] for r in records):
        console.print(_problem_keys(records), overflow="fold")
    precision = _model_precision(args.model)
    if precision:
        from convpass.compiler.pipeline import precision_line

        console.print(printable(precision_line(precision)), markup=False)
    if kernels:
        console.print(printable(kernels), markup=False)
    return 0

"""What the executor says about the convs it runs: per conv the recorded decision it runs with
(:class:`~convpass.kernels.plan.ConvSummary`), and the table ``format_plan_summary`` prints."""

from __future__ import annotations

from collections.abc import Sequence

from convpass.core import annotation
from convpass.kernels.plan import ConvSummary
from convpass.ops.conv import ConvCall
from convpass.ops.registry import NodeInfo


def conv_summary(node: NodeInfo, d: annotation.ConvDecision | None, call: ConvCall | None, profile: int | None, note: str) -> ConvSummary:
    """The summary row of a conv: ``d`` the decision it runs with (None: untuned), ``call`` its
    prepared call once a plan knows its shapes (it names the problem), ``note`` why not as recorded."""
    problem = None
    if call is not None and call.geometry.shapes:
        candidates = [str(c) for c in call.geometry.shapes]  # 1-D convs have two 2-D mappings
        recorded = d.problem_key if d is not None else ""
        problem = next((c for c in candidates if recorded.startswith(c + "|")), candidates[0])
    if d is None:
        return ConvSummary(node.name, node.op_type, False, "-", "NCHW" if call is not None else "-", "-", "untuned", None, None, "", problem, None, note or "untuned")
    return ConvSummary(
        node=node.name,
        op_type=node.op_type,
        tuned=True,
        algo=_engine_algo(d.engine, d.fusion) if d.engine else d.algo,
        memory_format=d.memory_format,
        math_mode=d.math_mode,
        source=d.source,
        workspace_bytes=d.workspace_bytes,
        time_ms=d.time_ms,
        recorded_problem_key=d.problem_key,
        problem=problem,
        profile=profile,
        note=note,
    )


def _engine_algo(engine: str, fusion: str = "") -> str:
    """The recorded engine's algorithm name, with the fused graph its ``fusion`` names (a legacy
    epilogue's or an activation's: the epilogue runs in the engine's call). An engine or fusion
    that does not parse is shown as recorded: building the conv warns about it and runs the legacy
    algorithm."""
    from convpass.native.cudnn.graph_api import EngineConfig

    try:
        return EngineConfig.parse(engine, fusion).algo
    except ValueError:
        return engine


def format_conv_table(rows: Sequence[ConvSummary]) -> str:
    """One line per conv: node, op, algo, memory format, math, source and problem, in columns."""
    if not rows:
        return "no convolutions"
    head = ("node", "op", "algo", "memory_format", "math", "source", "problem")
    table = [head] + [
        (r.node, r.op_type, r.algo, r.memory_format, r.math_mode, r.source, r.problem or r.recorded_problem_key or "-") for r in rows
    ]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head) - 1)]
    lines = []
    for row in table:
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(row, widths)) + "  " + str(row[-1]))
    return "\n".join(lines)

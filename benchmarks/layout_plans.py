"""The whole-graph layout plan of each panel model, from a tuning cache, on any machine.

For every model: how many convs the plan puts in NHWC, how many transposes it pays, and its
predicted cost (the convs' recorded times in their planned layouts plus the recorded transpose
times), next to the sum of each conv's own best time. Nothing is timed: the figures are the tuning
cache's, read as ``convpass optimize --device-name`` reads them, so a change to the planner can be
compared before and after on a machine without a GPU (run this at both commits). ``--pinned`` adds,
per model, the ops the plan keeps in NCHW (not the channel-moving Transposes, which read or give
NHWC by rule) that exchange a tensor with a recorded transpose time
with a node it may put in NHWC (count, and the sum of those times): where the plan's rules, not
the conv times, hold NCHW::

    python models/export_panel.py --out /tmp/panel                 # needs PyTorch
    python benchmarks/layout_plans.py --panel /tmp/panel --cache tune.db --device H200 --batch 32
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import sys
from pathlib import Path

from rich.console import Console

from convpass.compiler import pipeline
from convpass.compiler.passes import plan_layouts as planner
from convpass.compiler.pipeline import build_options, optimize_model
from convpass.core.errors import ConvpassError
from convpass.core.model_io import load_model


def _pinned_ops(graph, conv_costs, transpose_ms, units=(), shapes=None) -> str:
    movable = planner.movable_nodes(graph, conv_costs, units, shapes)
    moves = planner.channel_moves(graph)  # read or give NHWC by rule: not pinned
    count: collections.Counter = collections.Counter()
    ms: collections.Counter = collections.Counter()
    for node in graph:
        if node in movable or node in moves:
            continue
        # the values that join it to a node the plan may put in NHWC
        joined = [v for v in node.inputs if v is not None and v.producer() in movable]
        joined += [v for v in node.outputs if any(user in movable for user, _ in v.uses())]
        touched = [transpose_ms(v) for v in joined]
        if any(t > 0 for t in touched):
            count[node.op_type] += 1
            ms[node.op_type] += sum(touched)
    return ", ".join(f"{op} {count[op]} ({ms[op]:.3f} ms)" for op, _ in ms.most_common()) or "none"


def plan_row(path: Path, input_name: str, dims: list, cache: str, device: str, tf32: str, pinned: bool = False) -> str:
    model = load_model(str(path))
    profile = f"{input_name}={'x'.join(str(d) for d in dims)}"
    seen: list[str] = []
    plan_layouts = pipeline.plan_layouts

    def planning(graph, conv_costs, transpose_ms, units=(), shapes=None, unit_costs=None, priced_slices=()):  # the pipeline's own call, looked at on the way
        seen.append(_pinned_ops(graph, conv_costs, transpose_ms, units, shapes))
        return plan_layouts(graph, conv_costs, transpose_ms, units, shapes, unit_costs, priced_slices)

    pipeline.plan_layouts = planning
    try:
        report = optimize_model(model, build_options({"tf32": tf32}), [profile], cache, device, console=Console(file=io.StringIO()))
    finally:
        pipeline.plan_layouts = plan_layouts
    plans = list(report.layout_plans.values())
    if not plans:
        return f"no plan ({(report.notes or ['no layout plan'])[0][:100]})"
    plan = plans[0]
    nhwc = sum(v == "nhwc" for v in plan.layouts.values())
    row = (f"{nhwc:3d}/{len(plan.layouts):3d} convs NHWC, {plan.transposes:3d} transposes, plan {plan.cost_ms:8.3f} ms "
           f"(each conv's own best {plan.per_conv_best_ms:.3f} ms)")
    return row + (f"; pinned: {seen[0]}" if pinned and seen else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--panel", required=True, help="folder of models/export_panel.py (with panel.json)")
    ap.add_argument("--cache", required=True, help="tuning cache recorded on the GPU type of --device")
    ap.add_argument("--device", default="H200", help="the GPU whose decisions to read (as optimize --device-name)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tf32", default="on")
    ap.add_argument("--models", help="comma-separated panel names (default: every fp32 model)")
    ap.add_argument("--pinned", action="store_true", help="also the NCHW-pinned ops next to nodes the plan may put in NHWC")
    args = ap.parse_args(argv)
    panel = Path(args.panel)
    try:
        models = json.loads((panel / "panel.json").read_text())["models"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"layout_plans: {panel / 'panel.json'} is not a panel of models/export_panel.py ({err})", file=sys.stderr)
        return 2
    entries = [e for e in models if e["file"] == f"{e['name']}.onnx"]
    if args.models:
        wanted = args.models.split(",")
        entries = [e for e in entries if e["name"] in wanted]
    for e in entries:
        dims = [args.batch, *e["input_shape"][1:]]
        try:
            row = plan_row(panel / e["file"], e["input"], dims, args.cache, args.device, args.tf32, args.pinned)
        except ConvpassError as err:
            print(f"layout_plans: {e['name']}: {err}", file=sys.stderr)
            return 2
        print(f"{e['name']:30s} {row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

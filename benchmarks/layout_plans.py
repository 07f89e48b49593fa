"""The whole-graph layout plan of each panel model, from a tuning cache, on any machine.

For every model: how many convs the plan puts in NHWC, how many transposes it pays, and its
predicted cost (the convs' recorded times in their planned layouts plus the recorded transpose
times), next to the sum of each conv's own best time. Nothing is timed: the figures are the tuning
cache's, read as ``convpass optimize --device-name`` reads them, so a change to the planner can be
compared before and after on a machine without a GPU (run this at both commits)::

    python models/export_panel.py --out /tmp/panel                 # needs PyTorch
    python benchmarks/layout_plans.py --panel /tmp/panel --cache tune.db --device H200 --batch 32
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from rich.console import Console

from convpass.errors import ConvpassError
from convpass.model_io import load_model
from convpass.pipeline import build_options, optimize_model


def plan_row(path: Path, input_name: str, dims: list, cache: str, device: str, tf32: str) -> str:
    model = load_model(str(path))
    profile = f"{input_name}={'x'.join(str(d) for d in dims)}"
    report = optimize_model(model, build_options({"tf32": tf32}), [profile], cache, device, console=Console(file=io.StringIO()))
    plans = list(report.layout_plans.values())
    if not plans:
        return f"no plan ({(report.notes or ['no layout plan'])[0][:100]})"
    plan = plans[0]
    nhwc = sum(v == "nhwc" for v in plan.layouts.values())
    return (f"{nhwc:3d}/{len(plan.layouts):3d} convs NHWC, {plan.transposes:3d} transposes, plan {plan.cost_ms:8.3f} ms "
            f"(each conv's own best {plan.per_conv_best_ms:.3f} ms)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--panel", required=True, help="folder of models/export_panel.py (with panel.json)")
    ap.add_argument("--cache", required=True, help="tuning cache recorded on the GPU type of --device")
    ap.add_argument("--device", default="H200", help="the GPU whose decisions to read (as optimize --device-name)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tf32", default="on")
    ap.add_argument("--models", help="comma-separated panel names (default: every fp32 model)")
    args = ap.parse_args(argv)
    panel = Path(args.panel)
    entries = [e for e in json.loads((panel / "panel.json").read_text())["models"] if e["file"] == f"{e['name']}.onnx"]
    if args.models:
        wanted = args.models.split(",")
        entries = [e for e in entries if e["name"] in wanted]
    for e in entries:
        dims = [args.batch, *e["input_shape"][1:]]
        try:
            row = plan_row(panel / e["file"], e["input"], dims, args.cache, args.device, args.tf32)
        except ConvpassError as err:
            print(f"layout_plans: {e['name']}: {err}", file=sys.stderr)
            return 2
        print(f"{e['name']:30s} {row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per conv, what ``--precision auto`` weighs: the cost of each precision by a tuning cache's timings,
with the configuration each comes from, and the casts' and plans' totals. Needs no GPU: it reads
the cache a tuning on the GPU filled (``--device-name`` names the GPU type in it)::

    python benchmarks/precision_costs.py --model resnet50.onnx --shape input=16x3x224x224 \\
        --cache prec.db --device-name H200

The rows are those the plan chose among (:mod:`convpass.compiler.precision.choose`): a conv whose
``fp16`` cell is ``-`` has no float16 timing in the cache; ``fp16/tf32`` is the ratio of the two
costs (below 1: float16 is faster by the timings).
"""

from __future__ import annotations

import argparse
import dataclasses
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from convpass.compiler.passes import manager
from convpass.compiler.passes.resolve_shapes import VALUE_TYPES_KEY
from convpass.compiler.pipeline import OptimizeReport, build_options, prepare_model
from convpass.compiler.precision.budget import REDUCED
from convpass.compiler.precision.choose import CastCosts, GraphPlanner, conv_costs, half_problem, levels_for, own_problems
from convpass.compiler.precision.flow import name_nodes
from convpass.core.errors import ConvpassError
from convpass.core.model_io import load_model
from convpass.tuning.cache import TuningCache
from convpass.tuning.decide import CacheBackend, select


def _pick(backend: CacheBackend, problem, options) -> str:
    rows = backend.rows.get(problem, [])
    m = select(rows, problem, options)
    return "-" if m is None else f"{m.key.layout} {m.algo}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--shape", action="append", default=[], help="input=NxCxHxW (repeatable, as optimize --shape)")
    p.add_argument("--cache", required=True)
    p.add_argument("--device-name", required=True)
    args = p.parse_args(argv)
    cache_path = Path(args.cache)
    try:
        if not stat.S_ISREG(cache_path.stat().st_mode):
            p.error(f"--cache {args.cache}: not a regular file")
    except OSError as e:  # never create an empty cache where the one asked for is missing
        p.error(f"--cache {args.cache}: {e.strerror}")
    try:
        return _report(args)
    except ConvpassError as e:
        print(f"precision_costs: {e}", file=sys.stderr)
        return 2


def _report(args: argparse.Namespace) -> int:
    options = build_options({"precision": "auto", "max_error": 1e-2})
    model = load_model(args.model)
    name_nodes(model)
    manager.run(manager.folding(), model)
    uses = prepare_model(model, options, args.shape, OptimizeReport())
    cache = TuningCache(args.cache)
    backend = CacheBackend(cache, cache.resolve_device(args.device_name))
    levels = levels_for(options)
    costs = conv_costs(backend, uses, options, levels)
    tf32 = dataclasses.replace(options, precision=None, max_error=None, tf32="on")
    plain = dataclasses.replace(options, precision=None, max_error=None)
    totals = dict.fromkeys(levels, 0.0)
    print(f"{'conv':<44} {'fp16 ms':>9} {'tf32 ms':>9} {'fp16/tf32':>9}  fp16 from | tf32 from")
    for node, problems in own_problems(uses).items():
        c = costs.get(node, {})
        for level in levels:
            totals[level] += c.get(level, 0.0)
        first = problems[0]
        half, wide = c.get(REDUCED), c.get("tf32")
        ratio = f"{half / wide:9.2f}" if half is not None and wide else f"{'-':>9}"
        cell = lambda v: f"{v:9.4f}" if v is not None else f"{'-':>9}"  # noqa: E731
        sources = "-" if first is None else f"{_pick(backend, half_problem(first), plain)} | {_pick(backend, first, tf32)}"
        print(f"{node.name[:44]:<44} {cell(half)} {cell(wide)} {ratio}  {sources}")
    if not any(costs.values()):
        print("no conv of this model has a timing in the cache for these shapes (tune it there first)", file=sys.stderr)
        return 1
    print("sums (conv steps, ms): " + ", ".join(f"{level} {t:.4f}" for level, t in totals.items()))
    planner = GraphPlanner(model.graph, costs, CastCosts(model, backend), levels, model.meta.get(VALUE_TYPES_KEY, {}))
    plan = planner.plan({c: levels[0] for c in planner.convs})
    predicted = planner.predicted()
    ms = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    print(f"first plan of the loop: {sum(1 for p in plan.precisions.values() if p == REDUCED)} fp16 conv(s), {plan.casts} cast(s), "
          f"{ms(plan.cost_ms)} ms; the float16 region {ms(predicted['float16'])} ms, none {ms(predicted['wide'])} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

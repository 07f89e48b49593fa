"""``convpass account MODEL``: where each tuned convolution's time goes, on this GPU
(:mod:`convpass.bench.account`)."""

from __future__ import annotations

import argparse
import sys

from convpass.cli.output import write_report
from convpass.core.errors import ConvpassError

__all__ = ["add_account_parser"]


def add_account_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "account", help="per-conv account of a tuned model on this GPU: tuned, in place, and the best of cuDNN's routes",
        description="For every tuned conv: its tuned time, its time in place (inside the plan), and the best bare-conv time "
                    "by each route to cuDNN (legacy algorithms and their heuristic pick, graph-API engines of heuristics "
                    "modes A and B and the fallback list, PyTorch's cudnn.benchmark where PyTorch is installed), in NCHW and NHWC.")
    p.add_argument("model", help="a tuned model (convpass optimize's output)")
    p.add_argument("--cache", help="tuning cache to read (and to add what is measured now); default: convpass's")
    p.add_argument("--no-torch", action="store_true", help="leave PyTorch's route out")
    p.add_argument("--no-measure", action="store_true", help="only what the cache holds; time nothing but the model in place")
    p.add_argument("--json", action="store_true", help="the rows as JSON on stdout")
    p.add_argument("--json-file", metavar="FILE", help="also write the rows as JSON to FILE")
    p.set_defaults(func=account_command)
    return p


def account_command(args: argparse.Namespace) -> int:
    from convpass.bench.account import account, render
    from convpass.bench.document import to_json

    rows = account(args.model, args.cache, torch=not args.no_torch, measure_missing=not args.no_measure)
    if not rows:
        raise ConvpassError(f"{args.model}: no tuned convolution to account for (was it optimized on a GPU?)")
    doc = to_json({"format": "convpass.account/1", "model": str(args.model), "convs": rows})  # NaN / Inf (not JSON): null
    if args.json_file is not None:
        write_report(args, "json_file", doc)
    if args.json:
        print(doc, end="")
    else:
        print("\n".join(render(rows)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)

"""The decision options that ``optimize`` and ``tune`` share, declared and read in one place."""

from __future__ import annotations

import argparse

__all__ = ["add_decision_options", "decision_options"]


def add_decision_options(p: argparse.ArgumentParser, layout_default: str, layout_help: str) -> None:
    """The options that say how decisions are taken: shared by ``optimize`` and ``tune``."""
    p.add_argument("--mode", default="measure", choices=["heuristic", "exhaustive", "measure"],
                   help="heuristic: cuDNN's first choice (MindSpore 'normal'); exhaustive: cuDNN's Find "
                   "(MindSpore 'performance'); measure: convpass's own timing harness (default)")
    p.add_argument("--cache", help="tuning cache file (default: $CONVPASS_CACHE or $XDG_CACHE_HOME/convpass/tuning.db)")
    for flag, what in (("--fprop-algo", "forward"), ("--dgrad-algo", "backward-data"), ("--wgrad-algo", "backward-filter")):
        p.add_argument(flag, metavar="NAME", help=f"{what} algorithm: normal, performance or a cuDNN algorithm name")
    p.add_argument("--tf32", default="auto", help="TF32 for float32 convs: auto (measure both), on, off")
    p.add_argument("--layout", default=layout_default, help=layout_help)
    p.add_argument("--matmul-tf32", default="off", choices=["on", "off"], help="TF32 for Gemm / MatMul (MindSpore matmul_allow_tf32)")
    p.add_argument("--workspace-limit", metavar="SIZE", help="largest workspace an algorithm may use, e.g. 256MiB")
    p.add_argument("--deterministic", action="store_true", help="only deterministic algorithms")
    p.add_argument("--directions", default="fwd", help="fwd, or fwd,dgrad,wgrad to also tune training passes of Conv")
    p.add_argument("--engines", default="all", choices=["legacy", "graph", "all"],
                   help="candidates for forward convs under --mode measure: cuDNN's legacy algorithms, its graph-API "
                   "engine configurations (needs nvidia-cudnn-frontend: in pip install convpass[gpu], or convpass[graph]), or all (default; "
                   "legacy only, with a warning, where the graph API is not installed)")


def decision_options(args: argparse.Namespace) -> dict:
    """The values of :func:`add_decision_options` as keyword arguments of ``optimize``."""
    return dict(
        mode=args.mode,
        fprop_algo=args.fprop_algo,
        dgrad_algo=args.dgrad_algo,
        wgrad_algo=args.wgrad_algo,
        tf32=args.tf32,
        layout=args.layout,
        matmul_tf32=args.matmul_tf32,
        workspace_limit=args.workspace_limit,
        deterministic=args.deterministic,
        directions=args.directions,
        engines=args.engines,
    )

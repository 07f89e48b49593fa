"""The decision options that ``optimize`` and ``tune`` share, declared and read in one place.

The accepted values come from :mod:`convpass.core.options` (the one validation layer); argparse's
``choices`` and the help texts are built from them, so the parser and its help agree.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from convpass.core.options import ALGO_KEYWORDS, ALGORITHMS, CLI, ENGINE_CHOICES, MODES, PRUNE_CHOICES, TF32_CHOICES, TuneOptions, tune_options

__all__ = ["add_decision_options", "decision_options", "tune_options_of"]

_DIRECTION_NAMES = {"fwd": "forward", "dgrad": "backward-data", "wgrad": "backward-filter"}


def add_decision_options(p: argparse.ArgumentParser, layouts: Sequence[str], layout_default: str, layout_help: str) -> None:
    """The options that say how decisions are taken: shared by ``optimize`` and ``tune``;
    ``layouts``: the ``--layout`` values this verb accepts."""
    g = p.add_argument_group("decisions")
    g.add_argument("--mode", default="measure", choices=MODES,
                   help="heuristic: cuDNN's first choice (MindSpore 'normal'); exhaustive: cuDNN's Find "
                   "(MindSpore 'performance'); measure: convpass's own timing harness (default)")
    g.add_argument("--cache", metavar="PATH",
                   help="tuning cache file (default: $CONVPASS_CACHE or $XDG_CACHE_HOME/convpass/tuning.db)")
    for direction in ("fwd", "dgrad", "wgrad"):
        flag = {"fwd": "--fprop-algo", "dgrad": "--dgrad-algo", "wgrad": "--wgrad-algo"}[direction]
        g.add_argument(flag, choices=ALGO_KEYWORDS + ALGORITHMS[direction], metavar="NAME",
                       help=f"{_DIRECTION_NAMES[direction]} algorithm: normal (cuDNN's heuristic), performance (cuDNN's Find) "
                       f"or one of {', '.join(ALGORITHMS[direction])}, which is then forced (default: --mode)")
    g.add_argument("--tf32", default="auto", choices=TF32_CHOICES,
                   help="TF32 for float32 convs: auto (measure with and without, keep the faster; default), on, off")
    g.add_argument("--layout", default=layout_default, choices=layouts, help=layout_help)
    g.add_argument("--matmul-tf32", default="off", choices=["on", "off"],
                   help="TF32 for Gemm / MatMul: on or off (default; MindSpore matmul_allow_tf32)")
    g.add_argument("--workspace-limit", metavar="SIZE",
                   help="largest workspace an algorithm may use: bytes or a size such as 64MiB, 1GB; none = no limit (default)")
    g.add_argument("--deterministic", action="store_true", help="only deterministic algorithms")
    g.add_argument("--directions", default="fwd", metavar="fwd[,dgrad][,wgrad]",
                   help="fwd (default), or fwd,dgrad,wgrad to also tune the training passes of Conv")
    g.add_argument("--engines", default="all", choices=ENGINE_CHOICES,
                   help="candidates for forward convs under --mode measure: legacy (cuDNN's legacy algorithms), graph "
                   "(its graph-API engine configurations; needs nvidia-cudnn-frontend, in pip install 'convpass[gpu]'), "
                   "or all (default; legacy only, with a warning, where the graph API is not installed)")
    g.add_argument("--prune", default="off", choices=PRUNE_CHOICES,
                   help="off (default: every candidate measured) or learned: within a geometry class, candidates in order of how "
                   "often they won on this GPU in the tuning cache, and those that never won nor came near in enough problems skipped")


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
        prune=args.prune,
    )


def tune_options_of(args: argparse.Namespace) -> TuneOptions:
    """The checked :class:`TuneOptions` of the parsed flags (a wrong value named by its flag)."""
    return tune_options(decision_options(args), CLI)

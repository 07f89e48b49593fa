"""The ``convpass`` command line: optimize, tune, compile, inspect, run, cache, bench.

Errors about the user's input are printed as one line (``convpass: error: ...``) with exit code 1;
argparse's own usage errors exit with 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from convpass.cli.options import add_decision_options, decision_options
from convpass.core.errors import ConvpassError
from convpass.core.files import os_error
from convpass.core.text import PrintableFilter, literal, printable
from convpass.core.version import __version__


def _add_optimize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "optimize",
        help="tune every convolution of a model and write the annotated model",
        description="Measure (or look up) the best cuDNN algorithm, memory format and math mode for every "
        "convolution and record them in the model.",
    )
    p.add_argument("model", help="input ONNX model")
    p.add_argument("-o", "--output", required=True, help="where to write the tuned model (written atomically)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS[,NAME=DIMS]",
                   help="a shape profile, e.g. input=1x3x224x224; repeat for several profiles (batch 1 and 32)")
    p.add_argument("--device-name", help="take decisions from the cache for this GPU (e.g. H200) instead of measuring")
    add_decision_options(
        p, "auto",
        "memory format: auto (whole-graph plan: conv times + transposes), per-conv (each conv its own best, "
        "transposes ignored), nchw, nhwc",
    )
    p.add_argument("--no-kernels", dest="kernels", action="store_false",
                   help="do not compile the GPU kernels of the tuned model ahead of time (<output>.kernels; "
                   "default: compiled when this machine has a GPU)")
    p.add_argument("--retune", action="store_true",
                   help="tune a model convpass tuned already again (its recorded profiles unless --shape is given) and say "
                   "what changed; without it such a model is refused")
    p.add_argument("-q", "--quiet", action="store_true", help="print errors only")
    p.set_defaults(func=_optimize)


def _optimize(args: argparse.Namespace) -> int:
    from convpass.native import device

    device.start_driver()  # beside the imports below (0.4 s)
    from convpass.compiler.pipeline import optimize_ir

    optimize_ir(
        args.model,
        args.output,
        shapes=args.shape,
        cache=args.cache,
        device_name=args.device_name,
        quiet=args.quiet,
        kernels=args.kernels,
        retune=args.retune,
        **decision_options(args),
    )
    return 0


def _add_compile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compile",
        help="compile the GPU kernels a tuned model needs ahead of time (writes <model>.kernels)",
        description="Build and run the model's plans on this GPU, once per shape profile, in a fresh process, and store "
        "every kernel they compile (element-wise groups, normalization, pooling, CuPy's own) in <model>.kernels, so "
        "an executor starts without compiling anything. Needs a GPU; --arch adds binaries for other GPU architectures.",
    )
    p.add_argument("model", help="a tuned ONNX model (its side-car is written beside it)")
    p.add_argument("--arch", default="", metavar="LIST",
                   help="also compile for these GPU architectures, e.g. 80,90,100 (this GPU's is always included)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS[,NAME=DIMS]",
                   help="build plans for these input shapes (default: the profiles the model was tuned for)")
    p.set_defaults(func=_compile)


def _compile(args: argparse.Namespace) -> int:
    from convpass.compiler.aot import compile_kernels, parse_archs
    from convpass.core.profiles import parse_shape_spec

    report = compile_kernels(args.model, archs=parse_archs(args.arch), shapes=[parse_shape_spec(s) for s in args.shape])
    Console(stderr=True, soft_wrap=True).print(report.line())
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="list every convolution of a model and its recorded decisions, per device")
    p.add_argument("model")
    p.add_argument("--device", metavar="NAME", help="only the decisions for devices matching NAME (e.g. H100, or a full fingerprint)")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON list")
    p.set_defaults(func=_inspect)


def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}{unit}"
    return f"{value}{unit}"


def _with_fusion(name: str | None, fusion: str | None) -> str | None:
    """An algorithm or engine with the epilogue fused into its call (``implicit_gemm +bias+relu``)."""
    return f"{name} +{fusion}" if name and fusion else name


def _inspect(args: argparse.Namespace) -> int:
    from convpass.compiler.pipeline import inspect

    records = inspect(args.model, device=args.device)
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    devices = list(dict.fromkeys(r["device"] for r in records if r["device"]))
    title = f"{args.model}: {len({r['node'] for r in records})} convolutions"
    if len(devices) == 1:
        title += f", decisions for {devices[0]}"
    elif devices:
        title += f", decisions for {len(devices)} devices"
    table = Table(title=literal(title))
    columns = ["node", "op"] + (["device"] if len(devices) > 1 else []) + [
        "profile", "algo", "engine", "format", "math", "tf32", "workspace", "time", "source", "problem key"]
    for col in columns:
        table.add_column(col, overflow="fold")
    for r in records:
        row = [r["node"], r["op"]] + ([_fmt(r["device"])] if len(devices) > 1 else []) + [
            _fmt(r["profile"]), _fmt(_with_fusion(r["algo"], None if r.get("engine") else r.get("fusion"))),
            _fmt(r.get("engine") and _with_fusion(r["engine"], r.get("fusion"))), _fmt(r["memory_format"]), _fmt(r["math_mode"]), _fmt(r["tf32"]),
            _fmt(r["workspace_bytes"], " B"), _fmt(r["time_ms"], " ms"), r["source"], r["problem_key"] or "-"]
        table.add_row(*map(literal, row))  # names and decisions come from the file: never markup, never raw controls
    console = Console(width=200)
    console.print(table)
    if isinstance(args.model, str) and os.path.isfile(args.model):
        from convpass.core.kernel_file import describe

        console.print(literal(describe(args.model)))
    return 0


def _add_tune(sub: argparse._SubParsersAction) -> None:
    from convpass.cli.tune import add_tune_parser

    add_tune_parser(sub)


def _add_run(sub: argparse._SubParsersAction) -> None:
    from convpass.cli.run import add_run_parser

    add_run_parser(sub)


def _add_cache(sub: argparse._SubParsersAction) -> None:
    from convpass.tuning.cache import add_cache_parser

    add_cache_parser(sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from convpass.cli.bench import add_bench_parser

    add_bench_parser(sub)


# In the order --help lists them. Each imports its own module only when its parser is built.
_SUBCOMMANDS = {"optimize": _add_optimize, "tune": _add_tune, "compile": _add_compile, "inspect": _add_inspect,
                "run": _add_run, "cache": _add_cache, "bench": _add_bench}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; ``command``: build only that subcommand's (a faster start: e.g.
    ``tune`` launches its workers without first importing the executor's and the benchmark's modules)."""
    parser = argparse.ArgumentParser(
        prog="convpass",
        description="Measured, ahead-of-time cuDNN convolution tuning for ONNX models.",
    )
    parser.add_argument("--version", action="version", version=f"convpass {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add in _SUBCOMMANDS.items():
        if command is None or name == command:
            add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and argv[0] in _SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=Console(stderr=True), show_time=False, show_path=False)],
    )
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, PrintableFilter) for f in handler.filters):
            handler.addFilter(PrintableFilter())
    try:
        return args.func(args)
    except ConvpassError as e:
        print(f"convpass: error: {printable(e, keep_newlines=True)}", file=sys.stderr)
        return 1
    except OSError as e:  # a file-system error no module turned into a ConvpassError: still one line
        print(f"convpass: error: {printable(os_error(e.filename or '', e, 'use'))}", file=sys.stderr)
        return 1
    except MemoryError:
        print("convpass: error: out of memory", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("convpass: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

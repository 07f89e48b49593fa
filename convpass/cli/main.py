"""The ``convpass`` command line: optimize, tune, compile, inspect, run, cache, bench.

Every verb takes ``-v`` / ``-q`` (before or after the verb) and, except ``bench``, ``--json``
(one JSON document on stdout) and ``--json-file PATH`` (:mod:`convpass.cli.output`). Errors about
the user's input are printed as one line (``convpass: error: ...``) with exit code 1; argparse's
own usage errors exit with 2; an interrupt exits with 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
from collections.abc import Callable, Sequence

from convpass.cli.options import add_decision_options, decision_options
from convpass.cli.output import add_common_options, add_json_options, check_outputs, configure_logging, emit_json, message_console
from convpass.core.errors import ConvpassError
from convpass.core.files import os_error
from convpass.core.options import LAYOUT_CHOICES, PRECISION_CHOICES
from convpass.core.text import printable
from convpass.core.version import __version__

_SHAPE_HELP = ("a shape profile: NAME=DIMS[,NAME=DIMS] with DIMS as 1x3x224x224, e.g. input=1x3x224x224; "
               "repeat for several profiles (batch 1 and 32)")


def _add_optimize(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "optimize",
        help="tune every convolution of a model and write the annotated model",
        description="Measure (or look up) the best cuDNN algorithm, memory format and math mode for every "
        "convolution and record them in the model.",
    )
    p.add_argument("model", help="input ONNX model")
    p.add_argument("-o", "--output", required=True, metavar="PATH", help="where to write the tuned model (written atomically)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS[,NAME=DIMS]", help=_SHAPE_HELP)
    p.add_argument("--device-name", metavar="NAME",
                   help="take decisions from the tuning cache for this GPU (part of its name, e.g. H200, or a full "
                   "fingerprint) instead of measuring")
    add_decision_options(
        p, LAYOUT_CHOICES, "auto",
        "memory format: auto (default: whole-graph plan, conv times + transposes), per-conv (each conv its own best, "
        "transposes ignored), nchw, nhwc",
    )
    _add_precision_options(p)
    p.add_argument("--no-kernels", dest="kernels", action="store_false",
                   help="do not compile the GPU kernels of the tuned model ahead of time (<output>.kernels; "
                   "default: compiled when this machine has a GPU)")
    p.add_argument("--retune", action="store_true",
                   help="tune a model convpass tuned already again (its recorded profiles unless --shape is given) and say "
                   "what changed; without it such a model is refused")
    add_json_options(p, "convpass.optimize/1")
    p.set_defaults(func=_optimize)
    return p


def _add_precision_options(p: argparse.ArgumentParser) -> None:
    """Precision per conv within an error budget (docs/precision.md)."""
    p.add_argument("--precision", choices=list(PRECISION_CHOICES),
                   help="auto: each conv's precision (FP32-strict, FP32, TF32, FP16) chosen by measured speed within "
                   "--max-error, the model's error measured end to end; fp32-strict / fp32 / tf32 / fp16: that precision "
                   "for every conv (errors measured and recorded). fp32 is FP32 arithmetic (TF32 off) with any cuDNN "
                   "algorithm, Winograd and FFT included; fp32-strict the same with GEMM-based and direct algorithms "
                   "only, the most accurate. Default: the model's data types, --tf32 deciding float32 convs")
    p.add_argument("--max-error", type=float, metavar="E", help="the largest error of the outputs to accept (with --precision auto)")
    p.add_argument("--error-metric", default="max-rel", choices=["max-rel", "rel-l2"],
                   help="max-rel (default): max |y - y_ref| / max |y_ref|; rel-l2: ||y - y_ref|| / ||y_ref||; the worst output")
    p.add_argument("--calibration", action="append", default=[], metavar="FILE.npz",
                   help="inputs to measure the error on (one array per model input); repeat for more (default: random normal)")
    p.add_argument("--holdout", action="append", default=[], metavar="FILE.npz",
                   help="held-out inputs the chosen plan is validated on (default: random normal, another seed)")


def _optimize(args: argparse.Namespace) -> int:
    from convpass.native import device

    device.start_driver()  # beside the imports below (0.4 s)
    from convpass.compiler.optimize import report_json, run_optimize
    from convpass.core.options import CLI, parse_profiles, tune_options

    options = tune_options(dict(decision_options(args), precision=args.precision, max_error=args.max_error,
                                error_metric=args.error_metric), CLI)
    profiles = parse_profiles(args.shape, CLI)
    _, report = run_optimize(args.model, args.output, options, profiles, cache=args.cache, device_name=args.device_name,
                             kernels=args.kernels, console=message_console(args), names=CLI,
                             calibration=args.calibration, holdout=args.holdout, retune=args.retune)
    emit_json(args, report_json(report, str(args.model), str(args.output)))
    return 0


def _add_compile(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "compile",
        help="compile the GPU kernels a tuned model needs ahead of time (writes <model>.kernels)",
        description="Build and run the model's plans on this GPU, once per shape profile, in a fresh process, and store "
        "every kernel they compile (element-wise groups, normalization, pooling, CuPy's own) in <model>.kernels, so "
        "an executor starts without compiling anything. Needs a GPU; --arch adds binaries for other GPU architectures.",
    )
    p.add_argument("model", help="a tuned ONNX model (its side-car is written beside it)")
    p.add_argument("--arch", default="", metavar="LIST",
                   help="also compile for these GPU architectures, comma-separated: 80,90,100 or sm_90 "
                   "(this GPU's is always included)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS[,NAME=DIMS]",
                   help="build plans for these input shapes, e.g. input=1x3x224x224 (default: the profiles the model was tuned for)")
    add_json_options(p, "convpass.compile/1")
    p.set_defaults(func=_compile)
    return p


def _compile(args: argparse.Namespace) -> int:
    from convpass.compiler.aot import compile_kernels, parse_archs
    from convpass.core.options import CLI, parse_profiles

    report = compile_kernels(args.model, archs=parse_archs(args.arch), shapes=parse_profiles(args.shape, CLI))
    console = message_console(args)
    console.print(report.line(), markup=False)
    in_place = report.in_place_line()
    if in_place:
        console.print(in_place, markup=False)
    for slow in report.slow_shown(args.model):  # as optimize says it: the worst named, the rest counted
        logging.getLogger("convpass").warning("%s", slow)
    emit_json(args, {"schema": "convpass.compile/1", "model": str(args.model), "sidecar": str(report.path),
                     "kernels": report.kernels, "archs": dict(report.archs), "profiles": list(report.profiles),
                     "plans": report.plans, "failed": list(report.failed), "seconds": report.seconds,
                     "in_place": list(report.in_place) or None})
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from convpass.cli.inspect import add_inspect_parser

    return add_inspect_parser(sub)


def _add_tune(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from convpass.cli.tune import add_tune_parser

    return add_tune_parser(sub)


def _add_run(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from convpass.cli.run import add_run_parser

    return add_run_parser(sub)


def _add_cache(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from convpass.cli.cache import add_cache_parser

    return add_cache_parser(sub)


def _add_account(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from convpass.cli.account import add_account_parser

    return add_account_parser(sub)


def _add_bench(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from convpass.cli.bench import add_bench_parser

    return add_bench_parser(sub)


# In the order --help lists them. Each imports its own module only when its parser is built.
_SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], argparse.ArgumentParser]] = {
    "optimize": _add_optimize, "tune": _add_tune, "compile": _add_compile, "inspect": _add_inspect,
    "run": _add_run, "cache": _add_cache, "account": _add_account, "bench": _add_bench}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; ``command``: build only that subcommand's (a faster start: e.g.
    ``tune`` launches its workers without first importing the executor's and the benchmark's modules)."""
    parser = argparse.ArgumentParser(
        prog="convpass",
        description="Measured, ahead-of-time cuDNN convolution tuning for ONNX models.",
    )
    parser.add_argument("--version", action="version", version=f"convpass {__version__}")
    add_common_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, add in _SUBCOMMANDS.items():
        if command is None or name == command:
            add_common_options(add(sub))
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The verb, past the options that may come before it (-v, -q)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in _SUBCOMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    from convpass.core.deferred_imports import defer_sympy

    defer_sympy()  # before any command imports onnx-ir (convpass.core.deferred_imports)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    configure_logging(args.verbose, args.quiet)
    logging.getLogger("convpass").debug("convpass %s on Python %s: %s", __version__, platform.python_version(), " ".join(argv))
    try:
        check_outputs(args)  # --json-file, --html: refused before any work, not after it
        return args.func(args)
    except ConvpassError as e:
        print(f"convpass: error: {printable(e, keep_newlines=True)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout closed early (| head): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
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

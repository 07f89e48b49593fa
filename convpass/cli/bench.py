"""``convpass bench MODEL.onnx ... [--batch 1,32] [--vs all] [--torch-compile-modes default,reduce-overhead] [--runs N]
[--profile-ops] [--fresh-process] [--targets FILE] [--json | --json-file FILE] [--plot FILE.png]``.

One process, one run per model and batch: convpass (optimize, then the executor) against the
strongest configuration of each peer, every output checked against ONNX Runtime CPU: ONNX
Runtime's CUDA EP in four configurations without CUDA graphs and four with them, PyTorch eager in
two layouts and torch.compile in each mode asked for. Prints a table per case (with whether
convpass ran as one captured CUDA graph), the roofline, the summary (convpass against the best of
every peer and of each peer family; the targets of the targets file judged) and a Markdown table;
``--profile-ops`` adds, per case, the tuned model's GPU time by op family in eager runs
(:mod:`convpass.bench.opprofile`); ``--fresh-process`` runs every contender of every case once more
in a fresh Python process of its own and splits its time to the first result into parts
(:mod:`convpass.bench.fresh`); ``--json-file`` writes everything (device, driver, CUDA, cuDNN,
versions, every timing) to a file, ``--json`` prints it on stdout (the text then goes to stderr),
``--plot`` writes a bar chart. ``--from-json A.json B.json`` re-renders (and merges) recorded runs
without a GPU, documents of earlier versions included.

Exit status: 0 when the benchmark ran (whatever the verdicts); 2 with one line when there is no
usable GPU; 1 for bad input (``convpass: error: ...``, e.g. ``--plot`` without matplotlib);
argparse usage errors exit with 2.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from convpass.bench import document, opprofile, plot, render, schema, stats, targets
from convpass.bench.peers import COMPILE_MODES, DEFAULT_COMPILE_MODES, parse_compile_modes
from convpass.cli.output import check_outputs, protected
from convpass.core import json_text
from convpass.core.errors import ConvpassError
from convpass.core.files import read_text
from convpass.core.profiles import DEFAULT_BATCHES, CaseSkipped, parse_batches  # noqa: F401  (parse_batches: used by tests as this module's)
from convpass.core.text import printable

DEFAULT_FRESH_TIMEOUT = 600.0
PEERS = ("ort", "ort-graph", "torch", "torch-compile")  # the families --vs names (convpass.bench.contenders.PEERS)
VS_WORDS = (*PEERS, "all", "none")
VS_HELP = (f"peers to compare with: a comma-separated list of {', '.join(PEERS)}; or all (every one of them, "
           "the default); or none. ort: ONNX Runtime's CUDA EP without CUDA graphs; ort-graph: with CUDA graphs; "
           "torch: PyTorch eager; torch-compile: torch.compile (--torch-compile-modes)")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmark the tuned executor against ONNX Runtime (with and without CUDA graphs), PyTorch and torch.compile (GPU)",
        description="Tune each model, run it with the convpass executor and compare cold start and steady-state "
        "latency with the strongest configuration of each peer: ONNX Runtime's CUDA EP (EXHAUSTIVE / HEURISTIC x "
        "NCHW / NHWC, without and with CUDA graphs), PyTorch eager (cudnn.benchmark, channels_last off / on) and "
        "torch.compile, every output checked against ONNX Runtime CPU.",
    )
    p.add_argument("models", nargs="*", metavar="MODEL.onnx", help="models with a symbolic (or matching) batch axis")
    p.add_argument("--batch", action="append", default=[], metavar="N[,N] | NAME=N[,N]",
                   help="batch sizes (default: the model's bench_batches in panel.json, else 1,32); "
                   "NAME=N[,N] overrides them for the model whose file stem is NAME")
    p.add_argument("--vs", default="all", metavar="LIST", help=VS_HELP)
    p.add_argument("--torch-compile-modes", default=",".join(DEFAULT_COMPILE_MODES), metavar="LIST",
                   help=f"torch.compile's modes, a comma-separated list of {', '.join(COMPILE_MODES)} (default "
                   f"{','.join(DEFAULT_COMPILE_MODES)}; max-autotune compiles for minutes per model)")
    p.add_argument("--runs", type=int, default=50, help="timed steady-state runs per contender (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed runs before them (default 10)")
    p.add_argument("--tf32", default="auto", choices=["auto", "on", "off"],
                   help="convpass --tf32; ONNX Runtime's use_tf32 and torch's allow_tf32 are 1 unless this is off")
    p.add_argument("--engines", default="all", choices=["legacy", "graph", "all"],
                   help="convpass --engines: the cuDNN tuning space (default all; legacy = the legacy algorithms only)")
    p.add_argument("--cache", help="tuning cache file (default: $CONVPASS_CACHE or the XDG cache dir)")
    p.add_argument("--panel-json", help="panel.json of models/export_panel.py (default: the one next to each model)")
    p.add_argument("--targets", metavar="FILE", help="the targets to judge (JSON; default: the packaged convpass/bench/targets.json)")
    p.add_argument("--json", action="store_true", help="print every result as JSON on stdout (the report goes to stderr)")
    p.add_argument("--json-file", metavar="FILE", help="write every result as JSON to FILE (written atomically)")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart (needs matplotlib)")
    p.add_argument("--no-roofline", action="store_true", help="do not measure the GPU peaks (no roofline)")
    p.add_argument("--no-kernels", action="store_true",
                   help="do not compile the tuned models' kernels ahead of time (faster runs of many cases; convpass's "
                   "cold start then includes the compilation; steady state is unaffected)")
    p.add_argument("--profile-ops", action="store_true",
                   help=f"after each case's timed runs, run the tuned model eagerly {opprofile.PROFILE_RUNS} times with CUDA "
                   "events around every launch: GPU time outside convolutions and per op family")
    p.add_argument("--fresh-process", action="store_true",
                   help="after each case's in-process runs, run every contender again in a fresh Python process (empty "
                   "kernel caches): process start -> first result in host memory, in parts (seconds per contender and case)")
    p.add_argument("--fresh-timeout", type=float, default=DEFAULT_FRESH_TIMEOUT, metavar="SECONDS",
                   help=f"give each fresh process this long before it is killed and reported as failed (default {DEFAULT_FRESH_TIMEOUT:g})")
    p.add_argument("--from-json", nargs="+", metavar="FILE.json",
                   help="no benchmark: print (and with --json / --json-file / --plot, write) the report of recorded runs, merged")
    p.set_defaults(func=bench_command)
    return p


# ---------------------------------------------------------------------------------------------
# option parsing (pure)


def model_batches(paths: list[Path], specs: list[str], panel_json: str | None = None) -> dict[str, tuple[int, ...]]:
    """The batches of each model (by file stem), first rule that applies: ``--batch NAME=N[,N]``;
    a plain ``--batch N[,N]``; the model's ``bench_batches`` in its ``panel.json`` (written by
    ``models/export_panel.py``, which owns the panel's per-model defaults); 1,32."""
    default, per_model = parse_batches(specs)
    explicit = any("=" not in spec for spec in specs)
    out: dict[str, tuple[int, ...]] = {}
    for path in paths:
        batches = per_model.get(path.stem)
        if batches is None and not explicit:
            from convpass.bench.peers import panel_entry

            entry, _ = panel_entry(path, panel_json)
            listed = (entry or {}).get("bench_batches")
            if isinstance(listed, list) and listed and all(type(b) is int and b >= 1 for b in listed):
                batches = tuple(dict.fromkeys(listed))
        out[path.stem] = batches or default
    return out


def parse_vs(text: str) -> tuple[str, ...]:
    """The peer families of ``--vs``, in :data:`PEERS` order: a comma list of them, ``all`` (every
    one) or ``none``; ConvpassError naming what it accepts for anything else."""
    items = [t.strip().lower() for t in (text or "").split(",") if t.strip()]
    bad = [t for t in items if t not in VS_WORDS]
    if bad or not items or ("none" in items and len(items) > 1):
        raise ConvpassError(f"--vs {text!r}: expected a comma-separated list of {', '.join(PEERS)}; or all; or none")
    if items == ["none"]:
        return ()
    return PEERS if "all" in items else tuple(p for p in PEERS if p in items)


def gpu_unavailable_reason() -> str | None:
    """None when there is a CUDA GPU CuPy and cuDNN can use, else why not (one line)."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'convpass[gpu]')"
    except Exception as e:  # noqa: BLE001
        return f"CuPy cannot be imported: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    try:
        if int(cupy.cuda.runtime.getDeviceCount()) < 1:
            return "no CUDA GPU is visible"
    except Exception as e:  # noqa: BLE001
        return f"no usable CUDA driver or GPU ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    try:
        from convpass.native.cudnn import library

        library.version()
    except Exception as e:  # noqa: BLE001
        return f"cuDNN cannot be loaded ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    return None


# ---------------------------------------------------------------------------------------------
# the command


def _say(*parts: str, file: TextIO | None = None, flush: bool = False) -> None:
    """``print`` for the bench's text: what comes from models and recorded documents (names, devices,
    notes) reaches the terminal :func:`~convpass.core.text.printable`."""
    print(*(printable(p, keep_newlines=True) for p in parts), file=file or sys.stdout, flush=flush)


def _report_stream(args: argparse.Namespace) -> TextIO:
    """Where the text report goes: stdout, or stderr when stdout carries the JSON document."""
    return sys.stderr if args.json else sys.stdout


def _load_targets(args: argparse.Namespace) -> list[dict[str, Any]]:
    return targets.load(args.targets)


def _targets_file(args: argparse.Namespace) -> str:
    return args.targets or str(targets.DEFAULT_FILE)


def _require_plot(args: argparse.Namespace) -> None:
    """``--plot`` without matplotlib: one line, before anything runs."""
    if args.plot:
        try:
            plot.pyplot()
        except plot.PlotUnavailable as e:
            raise ConvpassError(str(e)) from None


def _out(doc: dict[str, Any], args: argparse.Namespace) -> None:
    errors = schema.validate_document(doc)
    if errors:  # a bug in this module, not the user's: say so, still write what we have
        _say(f"convpass bench: warning: the JSON document does not match its schema: {errors[0]}", file=sys.stderr)
    if args.json_file is not None:
        document.write_json(args.json_file, doc, "--json-file", protected(args, "json_file"))
        _say(f"wrote {args.json_file}", file=sys.stderr)
    if args.json:
        sys.stdout.write(document.to_json(doc))
    if args.plot:
        try:
            plot.write_plot(doc, args.plot, protect=protected(args, "plot"))
        except plot.PlotUnavailable as e:
            raise ConvpassError(str(e)) from None
        _say(f"wrote {args.plot}", file=sys.stderr)


def _from_json(args: argparse.Namespace) -> int:
    _require_plot(args)
    judged = _load_targets(args)
    docs = []
    for f in args.from_json:
        text = read_text(f, "--from-json document", document.DOCUMENT_LIMIT)  # no FIFO or device, bounded
        try:
            docs.append(json_text.loads(text))
        except ValueError as e:
            raise ConvpassError(f"--from-json {f}: cannot read a bench JSON document ({e})") from None
        errors = schema.validate_document(docs[-1], recorded=True)
        if errors:
            raise ConvpassError(f"--from-json {f}: not a convpass bench document ({errors[0]})")
    doc = document.merge_documents(docs, judged)
    doc["settings"]["targets_file"] = _targets_file(args)
    _say(render.format_report(doc), file=_report_stream(args))
    _out(doc, args)
    return 0


def _check_args(args: argparse.Namespace) -> None:
    if not args.models:
        raise ConvpassError("give one or more MODEL.onnx files (or --from-json FILE.json)")
    if args.no_kernels and args.fresh_process:
        raise ConvpassError("--fresh-process measures a deployment's start, which has the kernel side-car: not with --no-kernels")
    if args.runs < 1 or args.warmup < 0:
        raise ConvpassError("--runs must be >= 1 and --warmup >= 0")
    if args.fresh_timeout <= 0:
        raise ConvpassError("--fresh-timeout must be > 0")


def _notes(args: argparse.Namespace, vs: tuple[str, ...]) -> list[str]:
    notes = [
        "convpass's executor replays a CUDA graph after its first run; ONNX Runtime runs without CUDA graphs (ort) and "
        "with enable_cuda_graph=1 and fixed IOBinding buffers (ort-graph); PyTorch eager launches op by op; "
        "torch.compile's reduce-overhead mode replays CUDA graphs.",
        "cold start: convpass = Executor construction (model read, checks, plan) -> first result; ONNX Runtime = "
        "session creation + first run (incl. its algorithm search, and its capture with CUDA graphs); PyTorch = "
        "module.to(cuda) + first forward; torch.compile = module.to(cuda) + the first call, which compiles. "
        "All in one process whose CUDA context already exists; convpass's tuning is ahead of time and reported apart.",
    ]
    if "ort-graph" in vs:
        notes.append("where ONNX Runtime refuses to capture a CUDA graph (CPU-placed nodes, control flow, dynamic shapes), "
                     "its reason is shown and its best configuration without CUDA graphs stands in for ort-graph.")
    if args.fresh_process:
        notes.append(render.fresh_note())
    if args.no_kernels:
        notes.append("--no-kernels: the tuned models carry no kernel side-car, so convpass's cold start (and the second batch "
                     "size's start) includes compiling its kernels, unlike a deployment's; steady state is unaffected.")
    if args.profile_ops:
        notes.append("--profile-ops: GPU time per launch of the tuned model in eager runs (cuda_graph=False, the launches "
                     "a graph replays), each run queued whole behind a hold kernel so that host launch overhead is not "
                     "timed; after the case's timed runs, so the steady-state figures are not affected.")
    return notes


def bench_command(args: argparse.Namespace) -> int:
    if args.from_json:
        return _from_json(args)
    _check_args(args)
    _, per_model = parse_batches(list(args.batch))
    vs = parse_vs(args.vs)
    try:
        compile_modes = parse_compile_modes(args.torch_compile_modes)
    except ValueError as e:
        raise ConvpassError(f"--torch-compile-modes: {e}") from None
    judged = _load_targets(args)
    _require_plot(args)
    reason = gpu_unavailable_reason()
    if reason is not None:
        _say(f"convpass bench: no usable GPU here: {reason}; nothing was benchmarked", file=sys.stderr)
        return 2
    paths = [Path(m) for m in args.models]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ConvpassError(f"no such model file(s): {', '.join(missing)}")
    unknown = sorted(set(per_model) - {p.stem for p in paths})
    if unknown:
        raise ConvpassError(f"--batch names model(s) not given: {', '.join(unknown)}")
    batches = model_batches(paths, list(args.batch), args.panel_json)

    from convpass.bench import contenders
    from convpass.bench.environment import environment
    from convpass.bench.measure import TIMING
    from convpass.bench.roofline import measure_peaks

    out = _report_stream(args)

    def log(msg: str) -> None:
        _say(f"[bench] {msg}", file=sys.stderr, flush=True)

    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    env = environment()
    notes = _notes(args, vs)
    peaks = None
    if not args.no_roofline:
        log("measuring peaks (TF32 / FP32 matmul, device copy)")
        try:
            peaks = measure_peaks()
        except Exception as e:  # noqa: BLE001
            notes.append(f"peaks not measured ({type(e).__name__}: {e}); no roofline")
    settings = {
        "runs": args.runs,
        "warmup": args.warmup,
        "batches": {p.stem: list(batches[p.stem]) for p in paths},
        "vs": list(vs),
        "torch_compile_modes": list(compile_modes) if "torch-compile" in vs else [],
        "tf32": args.tf32,
        "engines": args.engines,
        "kernels": not args.no_kernels,
        "timing": TIMING,
        "cache": args.cache,
        "tolerances": {"tf32": stats.TOL_TF32, "fp32": stats.TOL_FP32, "half": stats.TOL_HALF},
        "targets_file": _targets_file(args),
        "profile_ops": opprofile.PROFILE_RUNS if args.profile_ops else 0,
        "fresh_process": {"timeout_s": args.fresh_timeout} if args.fresh_process else None,
        "argv": sys.argv[1:],
    }
    _say(render.format_environment(env, settings, peaks), file=out, flush=True)

    def keep(cases: list[dict[str, Any]]) -> dict[str, Any]:
        doc = document.build_document(env, settings, peaks, cases, created, notes, judged)
        if args.json_file is not None:  # every finished case is kept, should a later one be interrupted
            document.write_json(args.json_file, doc, "--json-file", protected(args, "json_file"))
        return doc

    cases: list[dict[str, Any]] = []
    module_cache: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="convpass-bench-") as tmp:
        for path in paths:
            for batch in batches[path.stem]:
                try:
                    case = contenders.bench_case(
                        path, batch, vs=vs, runs=args.runs, warmup=args.warmup, tf32=args.tf32, cache=args.cache, engines=args.engines,
                        panel_json=args.panel_json, peaks=peaks, workdir=Path(tmp), module_cache=module_cache, log=log,
                        profile_runs=settings["profile_ops"], fresh_timeout=args.fresh_timeout if args.fresh_process else None,
                        kernels=not args.no_kernels, compile_modes=compile_modes,
                    )
                except CaseSkipped as e:
                    notes.append(f"{path.stem} b{batch} skipped: {e}")
                    log(f"{path.stem} b{batch}: skipped ({e})")
                    continue
                except ValueError as e:
                    raise ConvpassError(f"{path}: {e}") from None
                # the bench runs a model's batches one after the other in this process: the next
                # batch size's start is read from the cases after a model's first
                case["model_order"] = 1 + sum(c["model"] == case["model"] for c in cases)
                cases.append(case)
                keep(cases)
                _say("\n" + render.format_case(case), file=out, flush=True)
            _same_executor(path, [c for c in cases if c["model"] == path.stem], args, Path(tmp), log)
            keep(cases)
    module_cache.clear()
    doc = keep(cases)
    _say("\n" + render.format_tail(doc), file=out)
    _out(doc, args)
    return 0


def _same_executor(path: Path, model_cases: list[dict[str, Any]], args: argparse.Namespace, workdir: Path,
                   log: Callable[[str], None]) -> None:
    """The next batch size's start for a model whose cases ran: one executor, its batch sizes in the
    order the cases ran; recorded in the later cases (which are annotated again)."""
    from convpass.bench.convpass_contender import run_batch_sizes_in_one_executor
    from convpass.bench.ranking import annotate_case
    from convpass.bench.records import find

    ran = [c["batch"] for c in model_cases if (find(c, "convpass") or {}).get("status") in ("ok", "unchecked")]
    if len(ran) < 2:
        return
    log(f"{path.stem}: batch sizes {', '.join(map(str, ran))} in one executor")
    records = run_batch_sizes_in_one_executor(path, ran, args.tf32, args.cache, workdir, args.engines, not args.no_kernels)
    for case in model_cases:
        if case["batch"] in records:
            case["same_executor"] = records[case["batch"]]
            annotate_case(case)
            _say("  " + (render.same_executor_line(case) or ""), file=_report_stream(args), flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m convpass.cli.bench MODEL.onnx ...``: the same command without the ``convpass`` entry point."""
    parser = argparse.ArgumentParser(prog="convpass")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        check_outputs(args)
        return args.func(args)
    except ConvpassError as e:
        _say(f"convpass: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""``convpass run MODEL [--input NAME=FILE]... [--shape NAME=DIMS]... [--batch N] [--seed N] [--runs N]
[--warmup N] [--compare ort [--rtol R] [--atol A]] [--output-dir DIR] [--device auto|cpu|cuda] [--json]``.

Runs a model (tuned or not) with the convpass executor: inputs from ``.npy`` / ``.npz`` files or
generated (:mod:`convpass.cli.feeds`), ``--warmup`` untimed runs then ``--runs`` timed ones
(median and p90 latency of ``Executor.run`` with host inputs and outputs), a summary of each
output (shape, dtype, min / max / mean), and with ``--compare ort`` each output's max abs and max
relative error against ONNX Runtime CPU on the same inputs (:mod:`convpass.cli.compare`).
``--output-dir`` saves each output as ``DIR/<output name>.npy`` (written atomically; characters
other than letters, digits, ``.``, ``-``, ``_`` in a name become ``_``).

Exit status: 0 on success; 1 for errors about the model, the inputs or the files, and when an
output of ``--compare`` is over ``--rtol`` / ``--atol`` (after everything is printed); 2 for usage
errors.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from typing import Any

import numpy as np

from convpass.cli.output import add_json_options, emit_json, printable, result_console
from convpass.core.errors import ConvpassError
from convpass.core.files import check_output, os_error
from convpass.core.model_check import MIN_OPSET

__all__ = ["SCHEMA", "add_run_parser", "output_file_name", "run_command", "save_atomic"]

SCHEMA = "convpass.run/1"


def add_run_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run",
        help="run a model (tuned or not) with the convpass executor on given or generated inputs",
        description="Run an ONNX model with the convpass executor, using the conv decisions recorded in it; time it and "
        "compare its outputs with ONNX Runtime's.",
    )
    p.add_argument("model", help="ONNX model (tuned by `convpass optimize` or not)")
    g = p.add_argument_group("inputs (every input no file gives is generated)")
    g.add_argument("--input", "-i", action="append", default=[], metavar="NAME=FILE",
                   help="an input from a .npy file, or the array NAME of an .npz; a bare FILE.npz gives every input it "
                   "names, a bare FILE.npy the one input of a single-input model; repeatable")
    g.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS[,NAME=DIMS]",
                   help="the shape of a generated input, e.g. input=1x3x224x224; repeatable")
    g.add_argument("--batch", type=int, default=1, metavar="N",
                   help="a symbolic first dimension of a generated input (default 1)")
    g.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the generated inputs: floats standard normal, integers 0..3, booleans (default 0)")
    t = p.add_argument_group("timing")
    t.add_argument("--runs", type=int, default=1, metavar="N", help="timed runs (default 1); median and p90 latency are printed")
    t.add_argument("--warmup", type=int, default=0, metavar="N", help="untimed runs before them (default 0)")
    c = p.add_argument_group("checking")
    c.add_argument("--compare", choices=["ort"],
                   help="ort: also run ONNX Runtime CPU on the same inputs and print each output's max abs and max relative "
                   "error; exit 1 when one is over --rtol / --atol")
    c.add_argument("--rtol", type=float, default=1e-3, metavar="R", help="relative tolerance of --compare (default 1e-3)")
    c.add_argument("--atol", type=float, default=1e-4, metavar="A", help="absolute tolerance of --compare (default 1e-4)")
    p.add_argument("--output-dir", "-o", metavar="DIR", help="save each output as DIR/<output name>.npy")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where to run: cuda (CuPy + cuDNN), cpu (NumPy reference); default auto: cuda when usable, else cpu")
    p.add_argument("--no-cuda-graph", action="store_true", help="cuda: launch kernels one by one instead of replaying a CUDA graph")
    p.add_argument(
        "--summary",
        action="store_true",
        help="also print whether the plan runs as one CUDA graph (and if not, which node stops it and why) and each conv's decision "
        "(algo, memory format, math)",
    )
    add_json_options(p, SCHEMA)
    p.set_defaults(func=run_command)
    return p


def output_file_name(name: str) -> str:
    """A safe file name for an output: characters other than letters, digits, '.', '-', '_' become '_'."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")
    return (safe or "output") + ".npy"


def save_atomic(path: str, value: np.ndarray) -> None:
    """np.save to a temporary file next to ``path``, then rename it into place."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".convpass-", suffix=".npy.tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, value, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise os_error(path, e, "write") from None
        raise


def _check_args(args: argparse.Namespace) -> None:
    if args.runs < 1:
        raise ConvpassError(f"--runs must be >= 1, got {args.runs}")
    if args.warmup < 0:
        raise ConvpassError(f"--warmup must be >= 0, got {args.warmup}")
    for flag, value in (("--rtol", args.rtol), ("--atol", args.atol)):
        if not np.isfinite(value) or value < 0:
            raise ConvpassError(f"{flag} must be a finite number >= 0, got {value}")


def _targets(outputs: list[Any], output_dir: str | None, protect: list[tuple[str, str]]) -> dict[str, str]:
    if output_dir is None:
        return {}
    if not output_dir.strip():
        raise ConvpassError("--output-dir: an empty path; give a folder")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConvpassError(f"--output-dir {output_dir} is not a folder")
    os.makedirs(output_dir, exist_ok=True)
    targets: dict[str, str] = {}
    seen: dict[str, str] = {}
    for o in outputs:
        fname = output_file_name(o.name)
        if fname in seen:
            raise ConvpassError(f"outputs {seen[fname]!r} and {o.name!r} would both be saved as {fname}")
        seen[fname] = o.name
        targets[o.name] = os.fspath(check_output(os.path.join(output_dir, fname), f"output {o.name!r}", protect))
    return targets


def _timed(executor: Any, feeds: dict[str, Any], runs: int, warmup: int) -> tuple[list[Any], list[float]]:
    for _ in range(warmup):
        executor.run(None, feeds)
    times, results = [], []
    for _ in range(runs):
        start = time.perf_counter()
        results = executor.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return results, times


def _latency(times: list[float], warmup: int) -> dict[str, Any]:
    t = np.asarray(times)
    return {"runs": len(times), "warmup": warmup, "median": float(np.median(t)), "p90": float(np.percentile(t, 90)),
            "min": float(t.min()), "max": float(t.max())}


def _stat(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def run_command(args: argparse.Namespace) -> int:
    from convpass.cli.compare import compare, ort_outputs, summary
    from convpass.cli.feeds import make_feeds, parse_run_shapes
    from convpass.runtime.devices import default_device
    from convpass.runtime.executor import Executor

    _check_args(args)
    if args.compare:
        from convpass.core.extras import require

        require("onnxruntime", "--compare ort")  # before the model runs, not after
    device = default_device() if args.device == "auto" else args.device
    # opsets from the one optimize takes at its low end (the executor's API runs older ones, for ONNX's backend tests)
    executor = Executor(args.model, device=device, cuda_graph=not args.no_cuda_graph, min_opset=MIN_OPSET)
    feeds = make_feeds(executor.get_inputs(), args.input, parse_run_shapes(args.shape), args.batch, args.seed)
    arrays = {f.name: f.value for f in feeds}
    outputs = executor.get_outputs()
    targets = _targets(outputs, args.output_dir, [(str(args.model), "the model")] + [(spec.partition("=")[2] or spec, "an input") for spec in args.input])
    results, times = _timed(executor, arrays, args.runs, args.warmup)
    results = [np.asarray(v) for v in results]
    records = []
    for o, value in zip(outputs, results):
        record = {"name": o.name, **summary(value), "file": targets.get(o.name)}
        if o.name in targets:
            save_atomic(targets[o.name], value)
        records.append(record)
    errors = None
    if args.compare:
        names = [o.name for o in outputs]
        errors = compare(names, results, ort_outputs(str(args.model), arrays, names), args.rtol, args.atol)
    latency = _latency(times, args.warmup)
    document = {
        "schema": SCHEMA, "model": str(args.model), "device": executor.device, "backend": executor.backend.describe(),
        "inputs": [f.to_json() for f in feeds], "outputs": records, "latency_ms": latency,
        "compare": None if errors is None else {"reference": "onnxruntime CPUExecutionProvider", "rtol": args.rtol,
                                                "atol": args.atol, "ok": all(e.ok for e in errors),
                                                "outputs": [e.to_json() for e in errors]},
    }
    emit_json(args, document)
    _print(args, executor, feeds, records, latency, errors)
    if errors is not None and not all(e.ok for e in errors):
        bad = [e for e in errors if not e.ok]
        raise ConvpassError(f"--compare ort: {len(bad)} of {len(errors)} outputs differ from ONNX Runtime beyond --rtol {args.rtol:g} "
                            f"/ --atol {args.atol:g}: {', '.join(repr(e.name) for e in bad)}")
    return 0


def _print(args: argparse.Namespace, executor: Any, feeds: list[Any], records: list[dict[str, Any]],
           latency: dict[str, Any], errors: list[Any] | None) -> None:
    console = result_console(args)

    def say(text: str) -> None:  # names come from the model: text, never markup or escape sequences
        console.print(printable(text), markup=False, highlight=False, soft_wrap=True)

    say(f"{args.model}: ran on {executor.backend.describe()}")
    for f in feeds:
        say(f"  input  {f.name}  shape {tuple(f.value.shape)}  {f.value.dtype}  "
            f"{'generated (seed ' + str(args.seed) + ')' if f.source == 'generated' else 'from ' + f.source}")
    for r in records:
        line = (f"  output {r['name']}  shape {tuple(r['shape'])}  {r['dtype']}  min {_stat(r['min'])}  max {_stat(r['max'])}  "
                f"mean {_stat(r['mean'])}")
        if r["nonfinite"]:
            line += f"  non-finite {r['nonfinite']}"
        if r["file"]:
            line += f"  -> {r['file']}"
        say(line)
    first = " (the first run builds the plan: --warmup 1 for steady state)" if latency["warmup"] == 0 else ""
    say(f"  latency  median {latency['median']:.3f} ms  p90 {latency['p90']:.3f} ms  over {latency['runs']} run(s) "
        f"after {latency['warmup']} warm-up{first}")
    if errors is not None:
        say(f"  compared with ONNX Runtime CPU (rtol {args.rtol:g}, atol {args.atol:g}):")
        for e in errors:
            verdict = "ok" if e.ok else "DIFFERS" + (f": {e.note}" if e.note else "")
            say(f"    {e.name}  max abs error {_stat(e.max_abs_error)}  max rel error {_stat(e.max_rel_error)}  {verdict}")
    if args.summary:
        say(executor.graph_status().describe())
        say(executor.format_plan_summary())
    sys.stdout.flush()

"""``convpass run MODEL --input NAME=FILE.npy ... [--output-dir DIR] [--device cuda|cpu]``.

Runs a model (tuned or not) with the convpass executor: inputs from ``.npy`` files, each output
printed (name, shape, dtype) and, with ``--output-dir``, saved as ``DIR/<output name>.npy``
(written atomically: a temporary file in DIR renamed into place). Output names that are not safe
file names (``/``, ``:``, ...) have those characters replaced by ``_``.

Exit status: 0 on success; 1 for errors about the model, the inputs or the files (one
``convpass: error: ...`` message); argparse usage errors exit with 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from typing import Any

import numpy as np

from convpass.core.errors import ConvpassError
from convpass.core.files import check_output, check_readable, os_error
from convpass.core.model_check import MIN_OPSET
from convpass.core.text import printable
from convpass.runtime.devices import default_device


def add_run_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run",
        help="run a model (tuned or not) with the convpass executor on .npy inputs",
        description="Run an ONNX model with the convpass executor, using the conv decisions recorded in it.",
    )
    p.add_argument("model", help="ONNX model (tuned by `convpass optimize` or not)")
    p.add_argument(
        "--input",
        "-i",
        action="append",
        default=[],
        metavar="NAME=FILE.npy",
        help="an input tensor from a .npy file; repeat per input (a single-input model also takes just FILE.npy)",
    )
    p.add_argument("--output-dir", "-o", metavar="DIR", help="save each output as DIR/<output name>.npy")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where to run: cuda (CuPy + cuDNN), cpu (NumPy reference); default: cuda when usable, else cpu",
    )
    p.add_argument("--no-cuda-graph", action="store_true", help="cuda: launch kernels one by one instead of replaying a CUDA graph")
    p.add_argument(
        "--summary",
        action="store_true",
        help="also print whether the plan runs as one CUDA graph (and if not, which node stops it and why) and each conv's decision "
        "(algo, memory format, math); on cuda the model runs twice so that the plan is captured",
    )
    p.set_defaults(func=run_command)
    return p


def _parse_inputs(specs: list[str], input_names: list[str]) -> dict[str, str]:
    files: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            if len(input_names) != 1:
                raise ConvpassError(
                    f"--input {spec!r} has no NAME=; the model has {len(input_names)} inputs ({', '.join(input_names) or 'none'}): "
                    "use --input NAME=FILE.npy"
                )
            name, path = input_names[0], spec
        if not name or not path:
            raise ConvpassError(f"--input {spec!r}: expected NAME=FILE.npy")
        if name in files:
            raise ConvpassError(f"input {name!r} given twice")
        files[name] = path
    return files


def _load_npy(name: str, path: str) -> np.ndarray:
    if not os.path.exists(path):
        raise ConvpassError(f"input {name!r}: file not found: {path}")
    check_readable(path, f"input {name!r}: file")  # no FIFO or device: np.load would block on it or read it without end
    try:
        value = np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001  (any unreadable file)
        raise ConvpassError(f"input {name!r}: cannot read {path} as a .npy array: {e}") from None
    if not isinstance(value, np.ndarray):
        raise ConvpassError(f"input {name!r}: {path} holds several arrays (.npz); give one .npy per input")
    return value


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
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _output_dir(path: str) -> None:
    """Make the ``--output-dir`` folder, or say in one line why not."""
    if not path.strip():
        raise ConvpassError("--output-dir: an empty path; give a folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConvpassError(f"--output-dir {path} is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise os_error(path, e, "create") from None


def run_command(args: argparse.Namespace) -> int:
    from convpass.runtime.executor import Executor

    device = default_device() if args.device == "auto" else args.device
    # opsets from the one optimize takes at its low end (the executor's API runs older ones, for ONNX's backend tests)
    executor = Executor(args.model, device=device, cuda_graph=not getattr(args, "no_cuda_graph", False), min_opset=MIN_OPSET)
    input_names = [a.name for a in executor.get_inputs()]
    files = _parse_inputs(list(args.input), input_names)
    feeds: dict[str, Any] = {name: _load_npy(name, path) for name, path in files.items()}
    outputs = executor.get_outputs()
    targets: dict[str, str] = {}
    if args.output_dir is not None:
        _output_dir(args.output_dir)
        seen: dict[str, str] = {}
        for o in outputs:
            fname = output_file_name(o.name)
            if fname in seen:
                raise ConvpassError(f"outputs {seen[fname]!r} and {o.name!r} would both be saved as {fname}")
            seen[fname] = o.name
            targets[o.name] = os.fspath(check_output(os.path.join(args.output_dir, fname), f"output {o.name!r}",
                                                     [(args.model, "the model")] + [(p, "an input") for p in files.values()]))
    results = executor.run(None, feeds)
    if args.summary and executor.device == "cuda" and executor.cuda_graph:
        executor.run(None, feeds)  # the second run captures the plan: the summary says whether it could
    print(printable(f"{args.model}: ran on {executor.backend.describe()}"))
    width = max((len(o.name) for o in outputs), default=0)
    for o, value in zip(outputs, results):
        line = f"  {o.name.ljust(width)}  shape {tuple(value.shape)}  {value.dtype}"
        if o.name in targets:
            try:
                save_atomic(targets[o.name], np.asarray(value))
            except OSError as e:
                raise os_error(targets[o.name], e) from None
            line += f"  -> {targets[o.name]}"
        print(printable(line))
    if args.summary:
        print(printable(executor.graph_status().describe(), keep_newlines=True))
        print(printable(executor.format_plan_summary(), keep_newlines=True))
    sys.stdout.flush()
    return 0

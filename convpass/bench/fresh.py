"""Cold start as a deployment meets it: a fresh Python process, from its start to the first result
in host memory, for one runtime, one model and one batch.

The child (``python -m convpass.bench.fresh``)::

    python -m convpass.bench.fresh --runtime convpass|ort|torch [--config NAME] --model PATH --inputs FEEDS.npz
        [--device cuda|cpu] [--tf32 on|off] [--weights STATE_DICT.pt] [--panel-json FILE] [--out OUT.npz]
        [--spawn-time T]

runs the case and prints one JSON line: the wall-clock stamps (``time.time()``, comparable between
processes), the parts between them (:func:`parts`), for convpass the run-time compilations
(``convpass.native.nvrtc.COMPILATIONS``) and the files in ``$CUPY_CACHE_DIR``, or the
error and the phase it happened in (exit status 1). ``--spawn-time`` is when the parent asked for
the process; without it there is no interpreter part and no total. ``--out`` writes the outputs
(after the last stamp) for the parent's output check.

Stamps, in order: ``main`` (the child's ``main`` starts), ``import``, ``inputs`` (the input file is
read: the same ``.npz`` for every runtime), ``context``, ``model_read``, ``plan``, ``first_result``.
What each runtime does between them is :data:`LEGEND`; a runtime that cannot separate two parts
takes no stamp between them (``None``) and the time goes to the next part.

The parent side: :func:`child_command` builds a child's command line, :func:`spawn` runs it with
``CUPY_CACHE_DIR`` and ``CUDA_CACHE_PATH`` pointed at new empty folders (the rest of the
environment kept) and a timeout, and returns the record ``convpass bench --fresh-process`` keeps
(:data:`RECORD_KEYS`); a child that fails, exits non-zero, prints no result or times out gives a
``failed`` record with the reason, never numbers.

Standard library only at import: the child's import part must be its runtime's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from convpass.bench import peers

RUNTIMES = ("convpass", "ort", "torch")
STAMPS = ("main", "import", "inputs", "context", "model_read", "plan", "first_result")
# each part ends at its stamp and starts at the previous stamp taken (``spawn`` for the first)
PARTS: tuple[tuple[str, str], ...] = (
    ("interpreter_s", "main"), ("import_s", "import"), ("inputs_s", "inputs"), ("context_s", "context"),
    ("model_read_s", "model_read"), ("plan_s", "plan"), ("first_run_s", "first_result"),
)
PART_KEYS = tuple(k for k, _ in PARTS) + ("total_s",)
# the stamps a runtime cannot take: the time between goes to the next part
UNSEPARATED: dict[str, tuple[str, ...]] = {"convpass": ("context",), "ort": ("context", "model_read"), "torch": ()}
RECORD_KEYS = ("status", "reason", "parts", "compilations", "compiled", "cache_files", "module", "rel_err", "tolerance")

LEGEND: dict[str, str] = {
    "all": "interpreter = spawn -> the child's main (Python start-up); inputs = reading the input .npz (the same "
           "file for every runtime); first run = host inputs in -> first result in host memory; total = spawn -> "
           "first result; CUPY_CACHE_DIR and CUDA_CACHE_PATH are new empty folders in every child; each runtime's first "
           "child is preceded by an unmeasured one that writes the bytecode of what it imports (as an installed "
           "environment has it); '-' = a part the runtime cannot separate, its time is in the next part",
    "convpass": "import = numpy, convpass.runtime (what a deployment imports); context: inside model read = "
                "Executor(tuned model, with its kernel side-car), which, on helper threads while it reads the model, "
                "creates the CUDA context through the driver API beside CuPy's import, loads cuDNN and creates its handle; "
                "plan = Executor.prepare(inputs): lower, compile, warm up, capture (cuDNN's workspace queries on a helper thread); "
                "compiled = run-time compilations / files in CuPy's kernel cache",
    "ort": "import = numpy, onnxruntime; context and model read: inside InferenceSession(), reported in plan = "
           "InferenceSession(original model) (CUDA context, cuDNN, model read, graph optimization); first run = "
           "session.run with host inputs (incl. the cuDNN algorithm search of the configuration)",
    "torch": "import = numpy, torch, torchvision and the model's library; context = CUDA context + cuDNN version; "
             "model read = build the architecture (models/export_panel.py) + load_state_dict from the file the "
             "bench saved; plan = module.to(cuda) (+ channels_last); first run = input to the GPU + first forward "
             "(incl. cudnn.benchmark's search) + .cpu()",
}


def parts(stamps: Mapping[str, float | None]) -> dict[str, float | None]:
    """Seconds per part (:data:`PART_KEYS`) from the stamps; ``None`` for a stamp not taken."""
    out: dict[str, float | None] = {}
    prev = stamps.get("spawn")
    for key, stamp in PARTS:
        t = stamps.get(stamp)
        out[key] = t - prev if t is not None and prev is not None else None
        if t is not None:
            prev = t
    first, spawned = stamps.get("first_result"), stamps.get("spawn")
    out["total_s"] = first - spawned if first is not None and spawned is not None else None
    return out


# ---------------------------------------------------------------------------------------------
# the child


Mark = Callable[[str], None]


def _read_inputs(np: Any, path: str) -> dict[str, Any]:
    with np.load(path) as z:
        return {name: z[name] for name in z.files}


def _pick(configs: Sequence[Mapping[str, Any]], label: Callable[[Mapping[str, Any]], str], name: str | None) -> Mapping[str, Any]:
    return next(c for c in configs if label(c) == name)


def _run_convpass(args: argparse.Namespace, mark: Mark) -> list[Any]:
    import numpy as np

    from convpass.runtime import Executor  # what a deployment imports

    mark("import")
    feeds = _read_inputs(np, args.inputs)
    mark("inputs")
    # no context step of its own: the executor imports CuPy, creates the CUDA context and loads
    # cuDNN on a helper thread while it reads the model, as in a deployment (its time is in model read)
    ex = Executor(args.model, device=args.device)
    mark("model_read")
    ex.prepare(feeds)
    mark("plan")
    outs = ex.run(None, feeds)  # NumPy in, NumPy out
    mark("first_result")
    return outs


def _run_ort(args: argparse.Namespace, mark: Mark) -> list[Any]:
    import numpy as np
    import onnxruntime as ort

    mark("import")
    feeds = _read_inputs(np, args.inputs)
    mark("inputs")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    providers: list[Any] = ["CPUExecutionProvider"]
    if args.device == "cuda":
        cfg = _pick(peers.ort_configs(args.tf32 == "on"), peers.ort_label, args.config)
        providers.insert(0, ("CUDAExecutionProvider", peers.ort_provider_options(cfg, 0)))
    sess = ort.InferenceSession(args.model, so, providers=providers)
    if args.device == "cuda" and "CUDAExecutionProvider" not in sess.get_providers():
        raise RuntimeError(peers.CUDA_EP_DID_NOT_LOAD)
    mark("plan")
    outs = sess.run(None, feeds)
    mark("first_result")
    return outs


def _run_torch(args: argparse.Namespace, mark: Mark) -> list[Any]:
    import importlib

    import numpy as np
    import torch

    entry, why = peers.panel_entry(args.model, args.panel_json)
    if entry is None:
        raise LookupError(why)
    panel = peers.load_export_panel()
    # the model's code, imported up front as a deployment imports it (every panel build needs torchvision)
    for library in dict.fromkeys(("torchvision", str(entry.get("builder") or "").split(".")[0])):
        if library and library != "export_panel":
            importlib.import_module(library)
    mark("import")
    feeds = _read_inputs(np, args.inputs)
    if len(feeds) != 1:
        raise ValueError("the PyTorch contender supports single-input models only")
    (x,) = feeds.values()
    mark("inputs")
    device = args.device
    if device == "cuda":
        torch.zeros(1, device=device)  # creates the CUDA context
        torch.backends.cudnn.version()
        torch.cuda.synchronize()
    mark("context")
    module, _ = panel.build_torch_model(entry.get("name") or os.path.splitext(os.path.basename(args.model))[0])
    module.load_state_dict(torch.load(args.weights, map_location="cpu", weights_only=True))
    if entry.get("dtype") == "float16":
        module = module.half()
    mark("model_read")
    cfg = _pick(peers.torch_configs(args.tf32 == "on"), peers.torch_label, args.config)
    fmt = peers.torch_memory_format(torch, x.ndim) if cfg["channels_last"] else None
    if cfg["channels_last"] and fmt is None:
        raise ValueError(f"channels_last does not apply to rank-{x.ndim} inputs")
    with peers.torch_flags(torch, cfg):
        m = module.to(device)
        if fmt is not None:
            m = m.to(memory_format=fmt)
        if device == "cuda":
            torch.cuda.synchronize()
        mark("plan")
        with torch.inference_mode():
            xt = torch.from_numpy(x).to(device)
            if fmt is not None:
                xt = xt.contiguous(memory_format=fmt)
            y = peers.first_tensor(m(xt)).cpu().numpy()  # .cpu() waits for the GPU
        mark("first_result")
    return [y]


RUNNERS: dict[str, Callable[[argparse.Namespace, Mark], list[Any]]] = {
    "convpass": _run_convpass, "ort": _run_ort, "torch": _run_torch,
}
CONFIGS: dict[str, tuple[str, ...]] = {
    "convpass": (),
    "ort": tuple(peers.ort_label(c) for c in peers.ort_configs(True)),
    "torch": tuple(peers.torch_label(c) for c in peers.torch_configs(True)),
}


def _compilations() -> list[str] | None:
    """The kernels compiled at run time in this process, and the cuDNN graph-API plans whose build
    took long enough to be a compilation (``convolution.ENGINE_COMPILATIONS``); None when convpass's
    compiler was never imported."""
    compiler = sys.modules.get("convpass.native.nvrtc")
    if compiler is None:
        return None
    convolution = sys.modules.get("convpass.kernels.convolution")
    return list(compiler.COMPILATIONS) + list(getattr(convolution, "ENGINE_COMPILATIONS", ()))


def _convpass_folder() -> str | None:
    """The folder of the convpass package this child imported (which tree ran: benchmarks/fresh_ab.py)."""
    module = sys.modules.get("convpass")
    return os.path.dirname(os.path.abspath(module.__file__)) if module is not None and module.__file__ else None


def _cache_files() -> int | None:
    """Files in ``$CUPY_CACHE_DIR`` (CuPy writes every kernel it compiles there); None when it is not set."""
    folder = os.environ.get("CUPY_CACHE_DIR")
    return sum(len(files) for _, _, files in os.walk(folder)) if folder else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m convpass.bench.fresh",
                                description="One runtime, one model, one batch, in this fresh process: prints one JSON line.")
    p.add_argument("--runtime", required=True, choices=RUNTIMES)
    p.add_argument("--config", help="ort: EXHAUSTIVE-nchw | EXHAUSTIVE-nhwc | HEURISTIC-nchw | HEURISTIC-nhwc; "
                   "torch: nchw | channels_last; convpass: none")
    p.add_argument("--model", required=True, help="convpass: the tuned model; ort: the original; torch: the original "
                   "(it names the panel.json entry)")
    p.add_argument("--inputs", required=True, metavar="FEEDS.npz", help="the inputs, by input name")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the CPU executor / CPU EP / CPU module (tests)")
    p.add_argument("--tf32", default="on", choices=["on", "off"], help="ort: use_tf32; torch: allow_tf32 (default on)")
    p.add_argument("--weights", metavar="STATE_DICT.pt", help="torch: the module's weights (torch.save of its state_dict)")
    p.add_argument("--panel-json", help="torch: panel.json of models/export_panel.py (default: beside the model)")
    p.add_argument("--out", metavar="OUT.npz", help="write the outputs here (after the last stamp)")
    p.add_argument("--spawn-time", type=float, help="time.time() when the parent asked for this process")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    started = time.time()
    parser = _parser()
    args = parser.parse_args(argv)
    known = CONFIGS[args.runtime]
    if known and args.config not in known:
        parser.error(f"--runtime {args.runtime} needs --config, one of {', '.join(known)}")
    if not known and args.config:
        parser.error(f"--runtime {args.runtime} has no configurations")
    if args.runtime == "torch" and not args.weights:
        parser.error("--runtime torch needs --weights")
    stamps: dict[str, float | None] = {"spawn": args.spawn_time, "main": started}
    record: dict[str, Any] = {"runtime": args.runtime, "config": args.config, "device": args.device, "model": args.model}

    def mark(stamp: str) -> None:
        stamps[stamp] = time.time()

    try:
        outs = RUNNERS[args.runtime](args, mark)
        if args.out:
            import numpy as np

            np.savez(args.out, *[np.asarray(o) for o in outs])
        error = None
    except Exception as e:  # noqa: BLE001  (reported as the result, with the phase it happened in)
        taken = [s for s in STAMPS if s not in UNSEPARATED[args.runtime]]
        phase = next((s for s in taken if s not in stamps), "output")
        error = f"{phase}: {peers.first_line(e)}"
    record.update(stamps=stamps, parts=parts(stamps), error=error)
    if args.runtime == "convpass":
        compiled = _compilations()
        record.update(compilations=None if compiled is None else len(compiled), compiled=compiled, cache_files=_cache_files(),
                      module=_convpass_folder())
    print(json.dumps(record), flush=True)
    return 1 if error else 0


# ---------------------------------------------------------------------------------------------
# the parent


def child_command(runtime: str, model: str | os.PathLike, inputs: str | os.PathLike, *, config: str | None = None,
                  device: str = "cuda", tf32: bool = True, weights: str | os.PathLike | None = None,
                  panel_json: str | os.PathLike | None = None, out: str | os.PathLike | None = None) -> list[str]:
    """The command line of one child (without ``--spawn-time``: :func:`spawn` adds it)."""
    cmd = [sys.executable, "-m", "convpass.bench.fresh", "--runtime", runtime, "--model", os.fspath(model),
           "--inputs", os.fspath(inputs), "--device", device, "--tf32", "on" if tf32 else "off"]
    for flag, value in (("--config", config), ("--weights", weights), ("--panel-json", panel_json), ("--out", out)):
        if value is not None:
            cmd += [flag, os.fspath(value)]
    return cmd


def warm_bytecode(cmd: Sequence[str], timeout: float, workdir: str | os.PathLike) -> str:
    """Run a child once, unmeasured, letting Python write the bytecode of what it imports: an
    installed environment has it (``pip install`` byte-compiles every package), a source tree or an
    image built with ``PYTHONDONTWRITEBYTECODE`` has none, and each fresh process there compiles
    every module it imports from source (numpy, CUDA's Python bindings, torch, convpass: tenths of
    a second a process). The bench runs this once per runtime, before its first measured
    child; what happened, for its log."""
    rec = spawn(cmd, timeout, workdir, write_bytecode=True)
    if rec["status"] != "ok":
        return f"the bytecode warm-up run failed ({rec['reason']}); the measured processes may compile Python sources"
    return "bytecode warm-up run done"


def record(status: str, reason: str | None = None, **values: Any) -> dict[str, Any]:
    """A fresh-process record with every key of :data:`RECORD_KEYS` (None where it does not apply)."""
    out: dict[str, Any] = dict.fromkeys(RECORD_KEYS)
    out.update(status=status, reason=reason, **values)
    return out


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _result_line(stdout: str) -> dict[str, Any] | None:
    for line in reversed((stdout or "").strip().splitlines()):
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and "stamps" in doc:
                return doc
    return None


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def spawn(cmd: Sequence[str], timeout: float, workdir: str | os.PathLike, *, write_bytecode: bool = False,
          env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None) -> dict[str, Any]:
    """Run one child (``cmd`` + ``--spawn-time``) with new empty kernel-cache folders under
    ``workdir``; the record of its result (status ``ok``) or of its failure (status ``failed``).
    ``write_bytecode``: without ``PYTHONDONTWRITEBYTECODE``, so that Python writes the bytecode of
    every module the child imports, where it can (see :func:`warm_bytecode`). ``env``: variables
    set for the child over this process's; ``cwd``: its working folder (``python -m`` looks there
    first)."""
    caches = tempfile.mkdtemp(prefix="fresh-", dir=workdir)
    env = {**os.environ, **(env or {})}
    if write_bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    for var, sub in (("CUPY_CACHE_DIR", "cupy"), ("CUDA_CACHE_PATH", "cuda")):
        env[var] = os.path.join(caches, sub)
        os.mkdir(env[var])
    try:
        spawned = time.time()
        done = subprocess.run([*cmd, "--spawn-time", repr(spawned)], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        tail = _last_line(err)
        return record("failed", f"timed out after {timeout:g} s" + (f" (last words: {tail})" if tail else ""))
    except OSError as e:
        return record("failed", f"could not start: {peers.first_line(e)}")
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    doc = _result_line(done.stdout)
    if doc is not None and doc.get("error"):
        return record("failed", str(doc["error"]))
    if done.returncode != 0:
        tail = _last_line(done.stderr) or _last_line(done.stdout)
        return record("failed", _exit_text(done.returncode) + (f": {tail}" if tail else ""))
    if doc is None:
        tail = _last_line(done.stderr)
        return record("failed", "no result line on stdout" + (f" (stderr: {tail})" if tail else ""))
    return record("ok", parts=doc["parts"], compilations=doc.get("compilations"), compiled=doc.get("compiled"),
                  cache_files=doc.get("cache_files"), module=doc.get("module"))


if __name__ == "__main__":
    sys.exit(main())

"""Precision per conv on the panel: speed and held-out error of the budgeted plans against all-TF32,
all-FP32 and the peers at their fastest reduced precision (docs/precision.md).

For every model and batch, in one process on one GPU:

* convpass tunes the model four times, with one tuning cache: ``--precision fp32``, ``--precision
  tf32`` (the all-TF32 baseline), ``--precision auto --max-error 1e-2`` and ``1e-3`` (random-normal
  calibration, seed 0, the tuning's own held-out set seed 1);
* each tuned model is timed with the convpass executor on the GPU (CUDA graphs, steady state,
  median of ``--runs``), and its error measured here again on a held-out input (random normal,
  seed 1; the model's inputs at the batch) against ONNX Runtime CPU on the original model;
* ``--peers``: ONNX Runtime's CUDA EP on an FP16 model (onnxconverter-common's
  ``convert_float_to_float16(keep_io_types=True)`` where installed, else convpass's own Cast-based
  conversion: the ``--precision fp16`` model's graph with its convs back in the standard domain),
  the fastest of its four configurations (EXHAUSTIVE / HEURISTIC x NCHW / NHWC), and
  ``torch.compile`` under ``torch.autocast("cuda", torch.float16)`` (panel models with a PyTorch
  builder, ``models/export_panel.py``), each with its error on the same held-out input.

Printed: one row per case, then per batch the geometric mean of the speedup of ``auto 1e-2`` over
all-TF32, the worst held-out errors against their budgets, the worst ratio of ``auto 1e-3`` to
all-FP32, and ``auto 1e-2`` against the faster peer, each with the target it answers and met / not
met. ``--out FILE`` writes every figure as JSON, atomically after every case (``complete``: false
until the last one), so a run cut off keeps the cases it finished::

    python models/export_panel.py --out /tmp/panel
    python benchmarks/precision_panel.py --panel /tmp/panel --batches 1,16 --cache /tmp/prec.db --peers --out prec.json
    python benchmarks/precision_panel.py --model bit.onnx --batches 1,16 ...   # any ONNX model with one float input
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import convpass
from convpass.bench import environment, measure, ort_contender, peers, torch_contender
from convpass.bench.document import to_json
from convpass.bench.reference import reference_outputs
from convpass.compiler.precision.data import model_error
from convpass.core import annotation
from convpass.core.errors import FileError
from convpass.core.files import check_output, write_text_atomically

CONFIGS = {"fp32": {"precision": "fp32"}, "tf32": {"precision": "tf32"},
           "auto-1e-2": {"precision": "auto", "max_error": 1e-2}, "auto-1e-3": {"precision": "auto", "max_error": 1e-3}}
ORT_SEARCH = [("EXHAUSTIVE", 0), ("EXHAUSTIVE", 1), ("HEURISTIC", 0), ("HEURISTIC", 1)]


def _input(model: onnx.ModelProto) -> tuple[str, list[int | None]]:
    inits = {t.name for t in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in inits]
    if len(inputs) != 1:
        raise SystemExit(f"{model.graph.name}: {len(inputs)} inputs; this benchmark takes one float input")
    dims = [d.dim_value if d.HasField("dim_value") else None for d in inputs[0].type.tensor_type.shape.dim]
    return inputs[0].name, dims


def _shape(dims: Sequence[int | None], batch: int, entry: dict | None) -> tuple[int, ...]:
    if entry and entry.get("shape"):
        return (batch, *entry["shape"][1:])
    if any(d is None for d in dims[1:]):
        raise SystemExit("the model's input has symbolic dims besides the batch: export it with fixed ones")
    return (batch, *dims[1:])


def _time_convpass(path: Path, x_dev, runs: int, warmup: int) -> tuple[float, np.ndarray]:
    from convpass.runtime.executor import Executor

    measure.free_gpu_memory()
    ex = Executor(str(path), device="cuda", output_kind="device")
    out: list[Any] = []

    def run() -> None:
        out[:] = ex.run(None, x_dev)

    measure.warm_gpu()
    times = measure.time_steady(run, measure.device_sync, runs, warmup)
    host = [np.asarray(o.get()) for o in out]
    out.clear()
    return float(np.median(times)), host


def _fp16_model(original: Path, spec: str, cache: str, work: Path) -> tuple[Path, str]:
    """The FP16 model ONNX Runtime runs (module docstring)."""
    try:
        from onnxconverter_common import float16

        converted = float16.convert_float_to_float16(onnx.load(original), keep_io_types=True)
        how = "onnxconverter-common convert_float_to_float16(keep_io_types=True)"
    except ImportError:
        tuned = convpass.optimize(str(original), None, shapes=[spec], cache=cache, quiet=True, kernels=False, precision="fp16")
        converted = annotation.standard_model(tuned)
        how = "convpass --precision fp16 graph, standard ops (onnxconverter-common not installed)"
    path = work / f"{original.stem}.{spec.replace('=', '_')}.ort_fp16.onnx"
    onnx.save(converted, path)
    return path, how


def _time_ort(path: Path, name: str, x: np.ndarray, ref: list[np.ndarray], runs: int, warmup: int) -> dict[str, Any]:
    """The fastest of :data:`ORT_SEARCH` (its figures, at the top level) and every configuration
    tried (``tried``; none of them holds the list)."""
    import onnxruntime as ort

    cp = measure.cupy()
    tried: list[dict[str, Any]] = []
    for search, nhwc in ORT_SEARCH:
        cfg = {"cudnn_conv_algo_search": search, "prefer_nhwc": nhwc, "use_tf32": 1}
        measure.free_gpu_memory()
        try:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            dev = cp.cuda.Device().id
            sess = ort.InferenceSession(str(path), so, providers=[("CUDAExecutionProvider", peers.ort_provider_options(cfg, dev))])
            x_dev = cp.asarray(x)
            binding = sess.io_binding()
            binding.bind_input(name, "cuda", dev, np.float32, list(x.shape), x_dev.data.ptr)
            for o in sess.get_outputs():
                binding.bind_output(o.name, "cuda", dev)
            sess.run_with_iobinding(binding)
            measure.warm_gpu()
            times = measure.time_steady(lambda s=sess, b=binding: s.run_with_iobinding(b), measure.device_sync, runs, warmup)
            outs = [np.asarray(o.numpy()) for o in binding.get_outputs()]
            entry = {"config": f"{search}-{'nhwc' if nhwc else 'nchw'}", "ms": float(np.median(times)),
                     "error": model_error([outs], [ref], "max-rel")}
        except Exception as e:  # noqa: BLE001 - reported, the others still run
            entry = {"config": f"{search}-{'nhwc' if nhwc else 'nchw'}", "failed": peers.first_line(e)}
        tried.append(entry)
    best = min((e for e in tried if "ms" in e), key=lambda e: e["ms"], default={})
    return {**best, "tried": tried}


def _time_torch(model_path: Path, panel_json: str | None, x: np.ndarray, ref: list[np.ndarray], runs: int, warmup: int) -> dict[str, Any]:
    reason = torch_contender.torch_unavailable_reason()
    if reason is not None:
        return {"skipped": reason}
    entry, why = peers.panel_entry(model_path, panel_json)
    if entry is None:
        return {"skipped": why}
    import torch

    module, _ = peers.load_export_panel().build_torch_model(entry.get("name") or model_path.stem)
    m = module.to("cuda").eval().to(memory_format=torch.channels_last) if x.ndim == 4 else module.to("cuda").eval()
    compiled = torch.compile(m)
    xt = torch.from_numpy(x).to("cuda")
    if x.ndim == 4:
        xt = xt.contiguous(memory_format=torch.channels_last)
    out: list[Any] = [None]

    def run() -> None:
        out[0] = compiled(xt)

    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16):
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        measure.warm_gpu()
        times = measure.time_steady(run, torch.cuda.synchronize, runs, warmup)
    y = peers.first_tensor(out[0]).detach().float().cpu().numpy()
    out.clear()
    return {"ms": float(np.median(times)), "error": model_error([[y]], [ref[:1]], "max-rel"), "compile_s": compile_s}


def bench_case(path: Path, batch: int, cache: str, work: Path, runs: int, warmup: int, with_peers: bool, panel_json: str | None) -> dict[str, Any]:
    original = onnx.load(path)
    name, dims = _input(original)
    entry, _ = peers.panel_entry(path, panel_json)
    shape = _shape(dims, batch, entry)
    spec = f"{name}={'x'.join(map(str, shape))}"
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)  # the held-out input
    ref, _, _ = reference_outputs(path, {name: x})
    case: dict[str, Any] = {"model": path.stem, "batch": batch, "input": spec}
    x_dev = {name: measure.cupy().asarray(x)}
    for label, options in CONFIGS.items():
        out = work / f"{path.stem}.b{batch}.{label}.onnx"
        t0 = time.perf_counter()
        tuned = convpass.optimize(str(path), str(out), shapes=[spec], cache=cache, quiet=True, **options)
        record = dict(annotation.read_model_info(tuned).precision)
        ms, outs = _time_convpass(out, x_dev, runs, warmup)
        case[label] = {"ms": ms, "error": model_error([outs], [ref], "max-rel"), "tuning_s": time.perf_counter() - t0,
                       "convs": record.get("convs"), "casts": record.get("casts"),
                       "calibration_error": record.get("calibration", {}).get("error"),
                       "holdout_error": record.get("holdout", {}).get("error"), "within_budget": record.get("within_budget"),
                       "rounds": record.get("rounds"), "evaluations": record.get("evaluations"), "predicted_ms": record.get("predicted_ms")}
    if with_peers:
        reason = ort_contender.ort_unavailable_reason()
        if reason is None:
            fp16, how = _fp16_model(path, spec, cache, work)
            case["ort_fp16"] = dict(_time_ort(fp16, name, x, ref, runs, warmup), conversion=how)
        else:
            case["ort_fp16"] = {"skipped": reason}
        try:
            case["torch_compile_fp16"] = _time_torch(path, panel_json, x, ref, runs, warmup)
        except Exception as e:  # noqa: BLE001
            case["torch_compile_fp16"] = {"failed": peers.first_line(e)}
    return case


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def _row(c: dict[str, Any]) -> str:
    def cell(key: str) -> str:
        v = c.get(key, {})
        return f"{v['ms']:.3f} ms err {v['error']:.1e}" if "ms" in v else (v.get("skipped") or v.get("failed") or "-")[:40]

    speed = c["tf32"]["ms"] / c["auto-1e-2"]["ms"]
    return (f"{c['model']:<28} b{c['batch']:<3} fp32 {cell('fp32')} | tf32 {cell('tf32')} | auto1e-2 {cell('auto-1e-2')} "
            f"({speed:.2f}x tf32, {c['auto-1e-2']['convs']}{_predicted(c['auto-1e-2'])}) | auto1e-3 {cell('auto-1e-3')} ({c['auto-1e-3']['ms'] / c['fp32']['ms']:.2f} of fp32) "
            f"| ort fp16 {cell('ort_fp16')} | torch.compile fp16 {cell('torch_compile_fp16')}")


def _predicted(entry: dict[str, Any]) -> str:
    """The plan's predicted costs (conv steps and casts by the measured timings) and its rounds, where recorded."""
    p = entry.get("predicted_ms") or {}
    ms = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    if not p:
        return ""
    return (f"; predicted: plan {ms(p.get('plan'))} ms, fp16 region {ms(p.get('float16'))}, none {ms(p.get('wide'))}; "
            f"{entry.get('rounds')} rounds")


def summarize(cases: list[dict[str, Any]]) -> list[str]:
    lines = []
    ok = [c for c in cases if "error" not in c]
    for batch in sorted({c["batch"] for c in ok}):
        here = [c for c in ok if c["batch"] == batch]
        speedups = [c["tf32"]["ms"] / c["auto-1e-2"]["ms"] for c in here]
        worst2 = max(here, key=lambda c: c["auto-1e-2"]["error"])
        worst3 = max(here, key=lambda c: c["auto-1e-3"]["error"])
        slow3 = max(here, key=lambda c: c["auto-1e-3"]["ms"] / c["fp32"]["ms"])
        g = _geomean(speedups)
        lines.append(f"batch {batch}, {len(here)} models:")
        lines.append(f"  auto 1e-2 over all-TF32: geomean {g:.2f}x, worst {min(speedups):.2f}x "
                     f"({min(here, key=lambda c: c['tf32']['ms'] / c['auto-1e-2']['ms'])['model']}); target 1.5x at batch 16/32: "
                     f"{'met' if g >= 1.5 else 'not met'}")
        lines.append(f"  held-out error, auto 1e-2: worst {worst2['auto-1e-2']['error']:.2e} ({worst2['model']}): "
                     f"{'met' if worst2['auto-1e-2']['error'] <= 1e-2 else 'not met'}")
        lines.append(f"  held-out error, auto 1e-3: worst {worst3['auto-1e-3']['error']:.2e} ({worst3['model']}): "
                     f"{'met' if worst3['auto-1e-3']['error'] <= 1e-3 else 'not met'}")
        ratio = slow3["auto-1e-3"]["ms"] / slow3["fp32"]["ms"]
        lines.append(f"  auto 1e-3 against all-FP32: worst {ratio:.2f} of FP32's time ({slow3['model']}): "
                     f"{'met' if ratio <= 1.0 else 'not met'} (no slower anywhere)")
        peer = [(c["auto-1e-2"]["ms"], min(c[p]["ms"] for p in ("ort_fp16", "torch_compile_fp16") if "ms" in c.get(p, {})))
                for c in here if any("ms" in c.get(p, {}) for p in ("ort_fp16", "torch_compile_fp16"))]
        if peer:
            gp = _geomean([a / b for a, b in peer])
            lines.append(f"  auto 1e-2 against the faster peer (ORT FP16 / torch.compile autocast FP16), {len(peer)} models: "
                         f"geomean {gp:.2f} of the peer's time: {'met' if gp <= 1.0 else 'not met'}")
    failed = [c for c in cases if "error" in c]
    for c in failed:
        lines.append(f"failed: {c['model']} b{c['batch']}: {c['error']}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--panel", help="folder of exported panel models (models/export_panel.py)")
    p.add_argument("--models", default="", help="comma-separated panel model names (default: every .onnx in --panel)")
    p.add_argument("--model", action="append", default=[], help="a model file (repeatable), besides the panel")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--cache", help="tuning cache (default: a fresh one in a temporary folder)")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--peers", action="store_true", help="also ONNX Runtime CUDA EP (FP16 model) and torch.compile (autocast FP16)")
    p.add_argument("--panel-json", help="panel.json (default: beside each model)")
    p.add_argument("--out", help="write every figure as JSON here")
    args = p.parse_args(argv)
    paths = [Path(m) for m in args.model]
    if args.panel:
        names = [n for n in args.models.split(",") if n]
        paths += [Path(args.panel) / f"{n}.onnx" for n in names] if names else sorted(Path(args.panel).glob("*.onnx"))
    if not paths:
        p.error("give --panel or --model")
    batches = [int(b) for b in args.batches.split(",")]
    protect = [*((str(m), "a model of the panel") for m in paths), *([(args.cache, "the tuning cache")] if args.cache else []),
               *([(args.panel_json, "the --panel-json file")] if args.panel_json else [])]
    if args.out:
        try:
            check_output(args.out, "--out", protect)  # before the first case, not after it
        except FileError as e:
            p.error(str(e))
    work = Path(tempfile.mkdtemp(prefix="convpass-precision-"))
    cache = args.cache or str(work / "tuning.db")
    env = environment.environment()
    cases: list[dict[str, Any]] = []
    for path in paths:
        for batch in batches:
            print(f"{path.stem} batch {batch} ...", file=sys.stderr, flush=True)
            try:
                case = bench_case(path, batch, cache, work, args.runs, args.warmup, args.peers, args.panel_json)
                print(_row(case), flush=True)
            except Exception as e:  # noqa: BLE001 - one case's failure is reported, the panel goes on
                traceback.print_exc()
                case = {"model": path.stem, "batch": batch, "error": peers.first_line(e)}
            cases.append(case)
            if args.out:
                write_out(args.out, cases, env, complete=False, protect=protect)
    print("\n".join(summarize(cases)))
    if args.out:
        write_out(args.out, cases, env, complete=True, protect=protect)
    return 0


def write_out(path: str, cases: list[dict[str, Any]], env: dict[str, Any], complete: bool,
              protect: Sequence[tuple[str, str]] = ()) -> None:
    """The figures so far as JSON (NaN / Inf, not JSON: null), through a temporary file beside
    ``path`` and a rename, never over a file ``protect`` names (the cache, the models)."""
    doc = {"cases": cases, "summary": summarize(cases), "environment": env, "complete": complete}
    write_text_atomically(path, to_json(doc), "--out", protect)


if __name__ == "__main__":
    sys.exit(main())

"""The fusion units of tuned models, end to end: what ``optimize`` found and decided, the model's time
with its fusions as recorded and with none, and its outputs against ONNX Runtime CPU.

For each model: optimize it for one batch size (``--cache``: the tuning cache to reuse), then

* ``units``: the fusion units found, per kind, and how many run fused (measured, or by rule);
* ``layout``: how many convs the layout plan put in NHWC;
* ``fused_ms`` / ``unfused_ms``: the tuned model replayed from its CUDA graph with its fusions as
  recorded, and with ``Executor(fusions=False)`` (same decisions and layouts: what the fused
  steps save inside this plan), median of groups of replays;
* ``max_rel_err``: the fused model's outputs against ONNX Runtime CPU (the original model).

    python benchmarks/fusion_check.py --panel .panel --models vae_decoder,rrdb_sr,ecaresnet50d --batch 16 --json out.json
    python benchmarks/fusion_check.py --model model.onnx --batch 1 --device cpu     # a smoke run, no timing
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPS = 20


def _time_ms(run, reps: int = REPS, groups: int = 5) -> float:
    """Median over ``groups`` of the mean time of ``reps`` back-to-back runs (GPU: events)."""
    import cupy as cp

    for _ in range(3):
        run()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(groups):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(reps):
            run()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / reps)
    return statistics.median(times)


def check(path: Path, batch: int, cache: str | None, device: str) -> dict:
    import onnx
    import onnxruntime as ort
    from rich.console import Console

    from convpass.compiler.pipeline import optimize_model
    from convpass.core.model_io import load_model, save_model
    from convpass.core.options import TuneOptions
    from convpass.core.ort_reference import cpu_session
    from convpass.core.profiles import input_shapes, model_inputs, shape_spec
    from convpass.runtime.executor import Executor

    proto = onnx.load(path, load_external_data=False)
    shapes = input_shapes(proto, batch)
    out = path.with_name(f"{path.stem}.b{batch}.fusions.onnx")
    t0 = time.perf_counter()
    model = load_model(path)
    report = optimize_model(model, TuneOptions(tf32="on", matmul_tf32=True), [shape_spec(shapes)], cache, None, Console(file=io.StringIO()))
    save_model(model, out)
    tune_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(shapes[n]).astype(np.float32) for n, _, _ in model_inputs(proto)}
    plans = list(report.layout_plans.values())
    row = {"model": path.stem, "batch": batch, "tune_s": round(tune_s, 1), "units": dict(report.fusion_kinds),
           "measured": report.fusion_measured, "measured_fused": report.fusion_fused,
           "layout": f"{sum(v == 'nhwc' for v in plans[0].layouts.values())}/{len(plans[0].layouts)} convs NHWC" if plans else "no plan"}
    ex = Executor(out, device=device)
    if device == "cpu":
        got = ex.run(None, feeds)
        got = ex.run(None, feeds)
    else:
        import cupy as cp

        dev = {k: cp.asarray(v) for k, v in feeds.items()}
        got = [cp.asnumpy(o) for o in ex.run(None, dev)]
        got = [cp.asnumpy(o) for o in ex.run(None, dev)]
        row["fused_ms"] = round(_time_ms(lambda: ex.run(None, dev)), 4)
        unfused = Executor(out, device=device, fusions=False)
        row["unfused_ms"] = round(_time_ms(lambda: unfused.run(None, dev)), 4)
        row["graph"] = ex.graph_status().describe()
    summary = ex.fusion_summary()
    row["ran_fused"] = {k: f"{sum(s.fused for s in summary if s.kind == k)}/{sum(s.kind == k for s in summary)}"
                        for k in sorted({s.kind for s in summary})}
    row["unfused_notes"] = sorted({s.note for s in summary if not s.fused and s.note})[:3]
    want = cpu_session(ort, str(path)).run(None, feeds)
    row["max_rel_err"] = max(float(np.max(np.abs(g.astype(np.float64) - w)) / max(float(np.max(np.abs(w))), 1e-30)) for g, w in zip(got, want))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--panel", type=Path, help="folder of exported panel models (models/export_panel.py --out)")
    ap.add_argument("--models", default="", help="comma-separated model names in --panel")
    ap.add_argument("--model", type=Path, action="append", default=[], help="a model file (repeatable)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cache", default=None, help="tuning cache (default: convpass's)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    paths = list(args.model) + [args.panel / f"{m}.onnx" for m in args.models.split(",") if m and args.panel]
    if not paths:
        ap.error("give --model or --panel with --models")
    rows = []
    for path in paths:
        row = check(path, args.batch, args.cache, args.device)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

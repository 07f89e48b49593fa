"""Where a tuned model's convolution time goes, conv by conv, beside what PyTorch reaches from cuDNN.

For each model and batch: tune (or reuse the cache), then for every conv node of the tuned model

* ``tuned``: the tuner's recorded time of the decision (annotation);
* ``in place``: the conv's launch (with its fused epilogue) timed inside the executor's plan,
  eagerly, each run queued whole behind a hold kernel (GPU time, neighbours as they run);
* ``legacy`` / ``engine``: the best legacy algorithm and the best graph-API engine configuration
  the tuning cache holds for the conv's geometry, per memory format (what the tuner saw);
* ``torch``: ``torch.nn.functional.conv2d`` on the same geometry with ``cudnn.benchmark`` and TF32
  on, NCHW and channels_last, timed back to back with CUDA events (PyTorch's own route through
  cuDNN: its engine heuristics and benchmark of the configurations they return).

Then the top GPU kernels of the whole model under each runtime (torch.profiler), so the kernels
each one reaches can be compared by name. Needs a GPU, CuPy, cuDNN and torch.

    python benchmarks/conv_gap.py --panel .panel --models vae_decoder,rrdb_sr --batch 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPS = 20


def torch_conv_ms(shape, layout: str) -> float:
    import torch
    import torch.nn.functional as F

    x = torch.randn(shape.x_shape, device="cuda")
    w = torch.randn(shape.w_shape, device="cuda")
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    pad = tuple(shape.pads)

    def run():
        return F.conv2d(x, w, None, tuple(shape.strides), pad, tuple(shape.dilations), shape.groups)

    for _ in range(5):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(REPS):
            run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / REPS)
    return statistics.median(times)


def in_place_ms(executor, feeds) -> dict[str, float]:
    from convpass.bench import opprofile

    backend = executor.backend
    clock = opprofile.CupyClock()
    for _ in range(3):
        executor.run(None, feeds)
    clock.sync()
    per_node: dict[str, list[float]] = {}
    for _ in range(5):
        events: list = []
        backend.step_events = events
        holding = clock.hold(0.2)
        executor.run(None, feeds)
        queued = holding() if holding is not None else False
        clock.sync()
        backend.step_events = None
        for _label, op_type, a, b, name in events:
            if op_type in ("Conv", "ConvTranspose"):
                per_node.setdefault(name, []).append(clock.elapsed_ms(a, b))
        if not queued:
            print("  note: a run was not queued whole (host gaps included)", file=sys.stderr)
    return {k: statistics.median(v) for k, v in per_node.items()}


def top_kernels(fn, n: int = 12) -> list[tuple[str, float, int]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            t, c = rows.get(e.name, (0.0, 0))
            rows[e.name] = (t + e.device_time_total / 1000.0, c + 1)
    return sorted(((k[:110], round(t, 4), c) for k, (t, c) in rows.items()), key=lambda r: -r[1])[:n]


def account(path: Path, batch: int, cache: str) -> dict:
    import onnx
    import torch
    from rich.console import Console

    from convpass.compiler.pipeline import inspect, optimize_model
    from convpass.core.model_io import load_model, save_model
    from convpass.core.options import TuneOptions
    from convpass.core.problem import ProblemKey
    from convpass.core.profiles import input_shapes, model_inputs, shape_spec
    from convpass.native import device as device_mod
    from convpass.runtime.executor import Executor
    from convpass.tuning.cache import TuningCache

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import export_panel

    proto = onnx.load(path, load_external_data=False)
    shapes = input_shapes(proto, batch)
    out = path.with_name(f"{path.stem}.b{batch}.tuned.onnx")
    t0 = time.perf_counter()
    model = load_model(path)
    rep = optimize_model(model, TuneOptions(tf32="on", matmul_tf32=True, engines="all"), [shape_spec(shapes)], cache, None, Console(stderr=True))
    save_model(model, out)
    tune_s = time.perf_counter() - t0
    records = [r for r in inspect(out) if r["problem_key"]]
    dev = device_mod.detect()
    store = TuningCache(cache)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(shapes[n]).astype(np.float32) for n, _, _ in model_inputs(proto)}
    ex = Executor(out, device="cuda")
    import cupy as cp

    dfeeds = {k: cp.asarray(v) for k, v in feeds.items()}
    placed = in_place_ms(Executor(out, device="cuda", cuda_graph=False), dfeeds)
    # whole model, graph replay
    for _ in range(5):
        ex.run(None, dfeeds)
    cp.cuda.Device().synchronize()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    for _ in range(REPS):
        ex.run(None, dfeeds)
    b.record()
    b.synchronize()
    convpass_model_ms = cp.cuda.get_elapsed_time(a, b) / REPS

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    rows, torch_cache = [], {}
    for r in records:
        key = ProblemKey.parse(r["problem_key"])
        s = key.shape
        geom = str(s)
        if geom not in torch_cache and s.direction == "fwd" and s.rank == 2:
            torch_cache[geom] = {lay: torch_conv_ms(s, lay) for lay in ("nchw", "nhwc")}
        best = {}
        for m in store.get(dev, s):
            if m.status != "ok" or m.time_ms is None or m.key.math == "fma" or "+" in m.algo:
                continue
            fam = "engine" if m.algo.startswith("engine:") else ("own" if m.algo.startswith("convpass") else "legacy")
            k = f"{fam}_{m.key.layout}"
            if k not in best or m.time_ms < best[k][0]:
                best[k] = (m.time_ms, m.algo)
        rows.append({
            "node": r["node"], "key": r["problem_key"], "algo": r["algo"], "engine": r["engine"], "fusion": r["fusion"],
            "format": r["memory_format"], "tuned_ms": r["time_ms"], "in_place_ms": placed.get(r["node"]),
            "torch_ms": torch_cache.get(geom), "cache_best": {k: v[0] for k, v in best.items()},
            "cache_best_algo": {k: v[1] for k, v in best.items()}, "gflop": s.flops / 1e9,
        })
    module, _ = export_panel.build_torch_model(path.stem)
    module = module.cuda().to(memory_format=torch.channels_last)
    xt = torch.from_numpy(next(iter(feeds.values()))).cuda().contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for _ in range(5):
            module(xt)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(REPS):
            module(xt)
        e1.record()
        e1.synchronize()
        torch_model_ms = e0.elapsed_time(e1) / REPS
        torch_top = top_kernels(lambda: module(xt))
    eager = Executor(out, device="cuda", cuda_graph=False)
    convpass_top = top_kernels(lambda: eager.run(None, dfeeds))
    return {"model": path.stem, "batch": batch, "tune_s": tune_s, "problems": rep.problems, "convs": rows,
            "convpass_model_ms": convpass_model_ms, "torch_eager_cl_model_ms": torch_model_ms,
            "torch_top_kernels": torch_top, "convpass_top_kernels": convpass_top}


def summarize(doc: dict) -> None:
    rows = doc["convs"]
    tot = lambda f: sum(f(r) or 0.0 for r in rows)  # noqa: E731
    torch_best = lambda r: min(r["torch_ms"].values()) if r["torch_ms"] else None  # noqa: E731
    print(f"\n== {doc['model']} b{doc['batch']}: tune {doc['tune_s']:.0f} s; model: convpass {doc['convpass_model_ms']:.2f} ms, "
          f"torch eager channels_last {doc['torch_eager_cl_model_ms']:.2f} ms")
    print(f"   conv sums: tuned {tot(lambda r: r['tuned_ms']):.2f}  in place {tot(lambda r: r['in_place_ms']):.2f}  "
          f"torch best-of-layout {tot(torch_best):.2f}  (torch nchw {tot(lambda r: (r['torch_ms'] or {}).get('nchw')):.2f}, "
          f"nhwc {tot(lambda r: (r['torch_ms'] or {}).get('nhwc')):.2f})")
    worst = sorted(rows, key=lambda r: -((r["in_place_ms"] or 0) - (torch_best(r) or 0)))[:12]
    for r in worst:
        print(f"   {r['node'][:38]:38} {r['format']:5} {str(r['engine'] or r['algo'])[:28]:28} {r['fusion'] or '':10} tuned {r['tuned_ms'] or 0:.3f} "
              f"in-place {r['in_place_ms'] or 0:.3f} torch {r['torch_ms']} cache {json.dumps({k: round(v, 3) for k, v in r['cache_best'].items()})}")
    print("   torch top kernels:")
    for k in doc["torch_top_kernels"][:8]:
        print("     ", k)
    print("   convpass top kernels:")
    for k in doc["convpass_top_kernels"][:8]:
        print("     ", k)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--panel", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--cache", default="/tmp/conv_gap.db")
    ap.add_argument("--json")
    args = ap.parse_args()
    docs = []
    for name in args.models.split(","):
        try:
            doc = account(Path(args.panel) / f"{name}.onnx", args.batch, args.cache)
        except Exception as e:  # noqa: BLE001  (one model failing must not lose the others)
            import traceback

            traceback.print_exc()
            print(f"{name}: failed: {e}", file=sys.stderr)
            continue
        docs.append(doc)
        summarize(doc)
        if args.json:
            Path(args.json).write_text(json.dumps(docs, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Speed of the cuda executor on tuned models: cold start and steady-state latency.

For each model and batch:

1. tune with ``convpass.optimize`` (measure mode; the tuning cache in ``--cache`` makes re-runs cheap)
   and save the tuned model;
2. cold start: ``Executor(tuned_path, device="cuda")`` construction, then the first ``run`` with a
   NumPy input until its NumPy result is back. Done twice in this process and the *second* one is
   reported: CuPy is imported, cuDNN loaded and CuPy's kernel cache warm by then (the first one is
   printed too, as ``cold (1st)``);
3. steady state: the input resident on the device (a CuPy array), outputs left on the device,
   ``cuda_graph`` on and off, and on without cuDNN's fused conv + bias + activation; after 5 warm-up runs, the median wall time of 50 runs, each followed by
   a stream synchronize. The same for the untuned model (cuDNN's heuristic, CUDA graph on) for
   comparison.

    python benchmarks/executor_speed.py --panel DIR [--models resnet50,mobilenet_v3_large] [--batches 1,32]
                                        [--cache FILE] [--runs 50] [--json OUT.json]

DIR holds ``<model>.onnx`` files exported by ``models/export_panel.py`` (dynamic batch axis).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx


def _input(model: onnx.ModelProto, batch: int) -> tuple[str, tuple[int, ...]]:
    inits = {t.name for t in model.graph.initializer}
    (inp,) = [i for i in model.graph.input if i.name not in inits]
    dims = tuple(d.dim_value if d.HasField("dim_value") else batch for d in inp.type.tensor_type.shape.dim)
    return inp.name, dims


def _cold_start(path: Path, feeds: dict) -> dict:
    from convpass.runtime import Executor

    t0 = time.perf_counter()
    ex = Executor(path, device="cuda")
    t1 = time.perf_counter()
    out = ex.run(None, feeds)
    t2 = time.perf_counter()
    assert all(isinstance(o, np.ndarray) for o in out)
    return {"construct_s": t1 - t0, "first_run_s": t2 - t1, "total_s": t2 - t0}


def _steady(model, feeds_dev: dict, cuda_graph: bool, runs: int, fuse: bool = True) -> tuple[float, dict]:
    import cupy as cp

    from convpass.runtime import Executor
    from convpass.runtime.cuda import CudaBackend

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the untuned model's note
        ex = Executor(model, device=CudaBackend(cuda_graph=cuda_graph, fuse=fuse), cuda_graph=cuda_graph, output_kind="device")
        stream = cp.cuda.get_current_stream()
        for _ in range(5):
            ex.run(None, feeds_dev)
    stream.synchronize()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        ex.run(None, feeds_dev)
        stream.synchronize()
        times.append(time.perf_counter() - t0)
    status = ex.graph_status()
    info = {"captured": status.captured is True, "note": status.describe(), "counters": dict(ex.backend.counters)}
    return statistics.median(times) * 1e3, info


def measure(path: Path, batch: int, workdir: Path, cache: Path, runs: int) -> dict:
    import cupy as cp

    import convpass

    model = onnx.load(path, load_external_data=False)
    name, shape = _input(model, batch)
    spec = f"{name}={'x'.join(map(str, shape))}"
    t0 = time.perf_counter()
    tuned = convpass.optimize(path, shapes=[spec], cache=cache, quiet=True)
    tune_s = time.perf_counter() - t0
    tuned_path = workdir / f"{path.stem}-b{batch}.tuned.onnx"
    onnx.save(tuned, tuned_path)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    feeds = {name: x}
    cold1 = _cold_start(tuned_path, feeds)
    cold2 = _cold_start(tuned_path, feeds)
    feeds_dev = {name: cp.asarray(x)}
    graph_ms, ginfo = _steady(tuned, feeds_dev, True, runs)
    eager_ms, einfo = _steady(tuned, feeds_dev, False, runs)
    unfused_ms, _ = _steady(tuned, feeds_dev, True, runs, fuse=False)
    untuned_ms, uinfo = _steady(model, feeds_dev, True, runs)
    return {
        "model": path.stem,
        "batch": batch,
        "tune_s": tune_s,
        "cold_first": cold1,
        "cold": cold2,
        "graph_ms": graph_ms,
        "eager_ms": eager_ms,
        "unfused_graph_ms": unfused_ms,
        "untuned_graph_ms": untuned_ms,
        "layout_copies_per_run": einfo["counters"].get("layout_copies", 0) / (runs + 6),
        "graph_captured": ginfo["captured"],
        "graph_note": ginfo["note"],
        "untuned_captured": uinfo["captured"],
        "counters_eager": einfo["counters"],
    }


def _warm_eager(path: Path, batch: int, cache: Path | None) -> tuple[Any, dict[str, Any]]:
    """The tuned model in an eager (no CUDA graph) cuda executor, warmed up, and its device feeds."""
    import cupy as cp

    import convpass
    from convpass.runtime import Executor

    model = onnx.load(path, load_external_data=False)
    name, shape = _input(model, batch)
    with tempfile.TemporaryDirectory() as tmp:
        tuned = convpass.optimize(path, shapes=[f"{name}={'x'.join(map(str, shape))}"], cache=cache or Path(tmp) / "c.db", quiet=True)
    ex = Executor(tuned, device="cuda", cuda_graph=False, output_kind="device")
    feeds = {name: cp.asarray(np.random.default_rng(0).standard_normal(shape).astype(np.float32))}
    for _ in range(3):
        ex.run(None, feeds)
    return ex, feeds


def _profile_ops(path: Path, batch: int, cache: Path | None, runs: int = 10) -> dict[str, Any]:
    """GPU time per launch in eager runs, by op family: convpass bench's --profile-ops measurement and
    classification (convpass.bench.opprofile), printed with the launch labels that took the most."""
    from convpass.bench import opprofile

    ex, feeds = _warm_eager(path, batch, cache)
    prof = opprofile.profile_executor(ex, feeds, runs=runs)
    print(f"GPU time per op, {path.stem} batch {batch} ({prof['method']}):")
    print(f"  {opprofile.summary_line(prof)}")
    print(f"  {opprofile.family_line(prof)}")
    for line in opprofile.label_lines(prof, top=16):
        print(f"  {line}")
    return prof


def _profile_eager(path: Path, batch: int, cache: Path | None) -> None:
    import cProfile
    import pstats

    import cupy as cp

    ex, feeds = _warm_eager(path, batch, cache)
    cp.cuda.get_current_stream().synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        ex.run(None, feeds)
    cp.cuda.get_current_stream().synchronize()
    prof.disable()
    print(f"eager host profile, {path.stem} batch {batch}, 20 runs:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def _table(rows: list[dict]) -> str:
    head = ("model", "batch", "tune s", "cold (1st) s", "construct s", "first run s", "cold s", "graph ms", "eager ms", "graph unfused ms", "untuned graph ms", "captured")
    lines = [head]
    for r in rows:
        c = r["cold"]
        lines.append(
            (
                r["model"],
                str(r["batch"]),
                f"{r['tune_s']:.2f}",
                f"{r['cold_first']['total_s']:.3f}",
                f"{c['construct_s']:.3f}",
                f"{c['first_run_s']:.3f}",
                f"{c['total_s']:.3f}",
                f"{r['graph_ms']:.3f}",
                f"{r['eager_ms']:.3f}",
                f"{r['unfused_graph_ms']:.3f}",
                f"{r['untuned_graph_ms']:.3f}",
                "yes" if r["graph_captured"] else r["graph_note"],
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--panel", required=True, type=Path, help="folder with <model>.onnx from models/export_panel.py")
    p.add_argument("--models", default="resnet50,mobilenet_v3_large")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--cache", type=Path, default=None, help="tuning cache (default: a temporary one)")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--profile-eager", action="store_true", help="also print where eager runs spend host time (cProfile)")
    p.add_argument("--profile-ops", action="store_true",
                   help="also print GPU time per launch for every model and batch: outside convolutions, per op family "
                   "and per launch label (convpass bench --profile-ops's measurement)")
    args = p.parse_args(argv)

    from convpass.native import device as device_mod
    from convpass.runtime import cuda_available

    if not cuda_available():
        from convpass.runtime.devices import cuda_unavailable_reason

        print(f"cuda backend not available: {cuda_unavailable_reason()}", file=sys.stderr)
        return 2
    dev = device_mod.detect()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        cache = args.cache or workdir / "tuning.db"
        for name in [m for m in args.models.split(",") if m]:
            path = args.panel / f"{name}.onnx"
            if not path.exists():
                print(f"skipping {name}: {path} not found", file=sys.stderr)
                continue
            for batch in [int(b) for b in args.batches.split(",") if b]:
                r = measure(path, batch, workdir, cache, args.runs)
                rows.append(r)
                print(
                    f"{name} b{batch}: cold {r['cold']['total_s']:.3f} s (1st in process {r['cold_first']['total_s']:.3f} s), "
                    f"graph {r['graph_ms']:.3f} ms, eager {r['eager_ms']:.3f} ms, unfused {r['unfused_graph_ms']:.3f} ms, "
                    f"untuned {r['untuned_graph_ms']:.3f} ms, layout copies/run {r['layout_copies_per_run']:.1f}",
                    file=sys.stderr,
                    flush=True,
                )
    print(f"device: {dev}")
    print("cold = Executor(tuned.onnx, device='cuda') + first run (NumPy in/out), second time in this process "
          "(CuPy imported, cuDNN loaded, CuPy kernel cache warm); latency = median of "
          f"{args.runs} runs, input on the device, synchronized")
    print(_table(rows))
    if args.profile_ops:
        for r in rows:
            r["op_profile"] = _profile_ops(args.panel / f"{r['model']}.onnx", r["batch"], args.cache or None)
    if args.profile_eager and rows:
        _profile_eager(args.panel / f"{rows[0]['model']}.onnx", rows[0]["batch"], args.cache or None)
    if args.json:
        args.json.write_text(json.dumps({"device": str(dev), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Every GPU kernel a tuned model launches, by name, with its total time: the convpass executor run
eagerly (``cuda_graph=False``: the launches a captured graph replays; ``--cuda-graph``: the graphs replayed) under torch.profiler, whose
CUPTI tracing records CuPy's, cuDNN's and cuBLAS's kernels alike.

Where ``bench --profile-ops`` sums GPU time per op family, this table names the kernels, so that a
family that costs more than its memory traffic (a normalization step, say) shows which of its
launches is slow: its statistics pass, its finalize or its apply pass.

    python benchmarks/kernel_table.py --model vae.onnx --batch 16 --cache tune.db [--tf32 on] [--runs 5] [--json out.json]

Needs a GPU, CuPy, and torch (only for its profiler).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx

from convpass.bench.document import to_json
from convpass.core.errors import FileError
from convpass.core.files import check_output, write_text_atomically


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cache", default=None, help="tuning cache (decisions come from it; convs not in it are tuned)")
    ap.add_argument("--tf32", default="on")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cuda-graph", action="store_true", help="replay the plan as captured CUDA graphs (default: eager launches)")
    args = ap.parse_args(argv)
    protect = [(args.model, "the --model"), *([(args.cache, "the tuning cache")] if args.cache else [])]
    if args.json is not None:
        try:
            check_output(args.json, "--json", protect)  # before the GPU work, not after it
        except FileError as e:
            ap.error(str(e))

    import torch
    from torch.profiler import ProfilerActivity, profile

    import convpass

    model = onnx.load(args.model)
    inp = model.graph.input[0]
    dims = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    shape = [args.batch, *dims[1:]]
    tuned = convpass.optimize(model, shapes=[f"{inp.name}={'x'.join(map(str, shape))}"], tf32=args.tf32, cache=args.cache, quiet=True)
    ex = convpass.Executor(tuned, device="cuda", cuda_graph=args.cuda_graph, output_kind="device")
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for _ in range(3):
        ex.run(None, {inp.name: x})
    torch.cuda.synchronize()
    before = dict(ex.backend.counters)
    print(f"{ex.graph_status().describe()}; programmatic edges made default at capture: {before.get('programmatic_edges_rewritten', 0)}")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.runs):
            ex.run(None, {inp.name: x})
        import cupy

        cupy.cuda.Device().synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = totals[ev.name]
            t[0] += ev.device_time_total / args.runs
            t[1] += 1 / args.runs
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    whole = sum(v[0] for _, v in rows)
    print(f"{Path(args.model).stem} b{args.batch}: {whole / 1e3:.3f} ms of GPU time per run in {sum(v[1] for _, v in rows):.0f} launches")
    print(f"{'us/run':>10} {'launches':>8} {'share':>6}  kernel")
    for name, (us, n) in rows[: args.top]:
        print(f"{us:10.1f} {n:8.0f} {100 * us / whole:5.1f}%  {name[:140]}")
    counted = {k: (v - before.get(k, 0)) / args.runs for k, v in ex.backend.counters.items() if v != before.get(k, 0)}
    print("executor counters per run: " + (", ".join(f"{k} {v:g}" for k, v in sorted(counted.items())) or "none"))
    if args.json is not None:
        write_text_atomically(args.json, to_json({"model": args.model, "batch": args.batch, "total_us": whole,
                                                  "kernels": [{"name": k, "us": v[0], "launches": v[1]} for k, v in rows],
                                                  "counters_per_run": counted}),
                              "--json", protect)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""cuDNN graph-API engine configurations against the legacy algorithms, per conv, on one clock.

The probe behind issue 12's first step (README, ``--engines``): for every distinct conv of the
models named (their problems read from an anchors ``oracle_detail.jsonl``: ``shared/anchors/``),
it times

* the 8 legacy forward algorithms in NCHW and NHWC (convpass's ``cudnn`` binding), and
* every engine configuration of cuDNN's heuristic modes A and B and its fallback list, through
  ``nvidia-cudnn-frontend``, for the bare conv (NCHW and NHWC) and for ``conv + bias + swish`` and
  ``conv + bias + relu`` (NHWC), each checked against the legacy result,

all with convpass's timing harness (``convpass.tuning.harness``: captured groups, inputs rotating
past the L2 cache; TF32 on), plus each engine's plan-build time and host time per call. One JSON
line per conv problem goes to ``--out``; a line per problem to stdout.

    PYTHONPATH=/path/to/nvidia-cudnn-frontend python benchmarks/graph_api_probe.py \
        --oracle oracle_detail.jsonl --models efficientnet_b0:32 --out fe.jsonl [--deadline 420]

Its H200 run of 2026-11-23 (EfficientNet-B0, batch 32; frontend 1.32.0, cuDNN 9.19.0) is
``benchmarks/results/graph-api-probe-h200-2026-11-23.jsonl``.
"""
import argparse
import json
import time
import traceback

import numpy as np

from convpass.core.problem import ConvShape
from convpass.native.cudnn import ConvDescriptors, CudnnError, run, workspace_size
from convpass.tuning import harness

ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
ap.add_argument("--oracle", required=True, help="an anchors oracle_detail.jsonl (the conv problems of each model)")
ap.add_argument("--models", default="efficientnet_b0:32", help="MODEL:BATCH[,MODEL:BATCH...]")
ap.add_argument("--out", default="fe.jsonl", help="JSON lines, one per conv problem")
ap.add_argument("--deadline", type=float, default=420.0, help="seconds after which no new problem starts")
args = ap.parse_args()

import cudnn as fe  # noqa: E402  (nvidia-cudnn-frontend)
import cupy as cp  # noqa: E402

T0 = time.time()
DEADLINE = args.deadline
out = open(args.out, "w")


def emit(d):
    out.write(json.dumps(d) + "\n")
    out.flush()


emit({"fe_version": fe.__version__, "backend": fe.backend_version()})

models = args.models.split(",")
probs = []
for line in open(args.oracle):
    d = json.loads(line)
    if f"{d['model']}:{d['batch']}" in models:
        for p in d["detail"]:
            probs.append((d["model"], d["batch"], p["problem"], p["count"]))
seen = set()
uniq = []
for m, b, p, c in probs:
    k = json.dumps(p)
    if k not in seen:
        seen.add(k)
        uniq.append((m, b, p, c))
LEGACY = ["implicit_gemm", "implicit_precomp_gemm", "gemm", "direct", "fft", "fft_tiling", "winograd", "winograd_nonfused"]
stream = cp.cuda.Stream(non_blocking=True)
stream.use()
h = fe.create_handle()
fe.set_stream(h, stream.ptr)
harness.warm_clocks()

def strides(dims, layout):
    n, c, hh, ww = dims
    return [c * hh * ww, hh * ww, ww, 1] if layout == "nchw" else [hh * ww * c, 1, ww * c, c]

def graph_for(shape, layout, act=None, bias=False):
    g = fe.pygraph(io_data_type=fe.data_type.FLOAT, intermediate_data_type=fe.data_type.FLOAT,
                   compute_data_type=fe.data_type.FLOAT, handle=h)
    X = g.tensor(name="X", dim=list(shape.x_shape), stride=strides(shape.x_shape, layout), data_type=fe.data_type.FLOAT)
    W = g.tensor(name="W", dim=list(shape.w_shape), stride=strides(shape.w_shape, layout), data_type=fe.data_type.FLOAT)
    Y = g.conv_fprop(image=X, weight=W, padding=list(shape.pads), stride=list(shape.strides), dilation=list(shape.dilations),
                     compute_data_type=fe.data_type.FLOAT, name="conv")
    tensors = {"X": X, "W": W}
    if bias:
        B = g.tensor(name="B", dim=[1, shape.k, 1, 1], stride=[shape.k, 1, shape.k, shape.k], data_type=fe.data_type.FLOAT)
        tensors["B"] = B
        Y = g.bias(input=Y, bias=B, name="bias")
    if act == "swish":
        Y = g.swish(input=Y, name="act")
    elif act == "relu":
        Y = g.relu(input=Y, name="act")
    Y.set_output(True).set_dim(list(shape.y_shape)).set_stride(strides(shape.y_shape, layout)).set_data_type(fe.data_type.FLOAT)
    tensors["Y"] = Y
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([fe.heur_mode.A, fe.heur_mode.B, fe.heur_mode.FALLBACK])
    return g, tensors

for model, batch, p, count in uniq:
    if time.time() - T0 > DEADLINE:
        emit({"stop": "deadline"})
        break
    n, c, hh, ww, k, kh, kw, pads, strd, dil, groups = p
    shape = ConvShape("fwd", n, c, k, (hh, ww), (kh, kw), tuple(pads), tuple(strd), tuple(dil), groups)
    rec = {"model": model, "batch": batch, "problem": p, "count": count, "legacy": {}, "graph": {}, "fused": {}}
    try:
        sets_n = harness.rotation_sets((harness.prod(shape.x_shape) + harness.prod(shape.w_shape) + harness.prod(shape.y_shape)) * 4)
        for layout in ("nchw", "nhwc"):
            sets = [{nm: harness.random_array(dims, "float32", layout, 7 + 3 * i + j) for j, (nm, dims) in enumerate((("x", shape.x_shape), ("w", shape.w_shape), ("y", shape.y_shape)))} for i in range(sets_n)]
            bias = cp.random.standard_normal(shape.k, dtype=cp.float32)
            key = shape.key(layout, "default")
            best = None
            ref = None
            with ConvDescriptors(key) as descs:
                for algo in LEGACY:
                    if algo == "fft_tiling" and groups > 8:
                        continue
                    try:
                        ws = workspace_size(descs, None, algo)
                    except CudnnError:
                        continue
                    wsb = cp.empty(max(ws, 1), cp.uint8)
                    try:
                        run(descs, None, algo, sets[0]["x"], sets[0]["w"], sets[0]["y"], workspace=wsb)
                        if ref is None and algo in ("implicit_gemm", "implicit_precomp_gemm"):
                            ref = sets[0]["y"].astype(cp.float32).copy()
                        t = harness.time_launches(lambda i, algo=algo, sets=sets, wsb=wsb: run(descs, None, algo, sets[i]["x"], sets[i]["w"], sets[i]["y"], workspace=wsb), len(sets), best)
                    except Exception as e:  # noqa
                        rec["legacy"][f"{layout}/{algo}"] = str(e)[:100]
                        continue
                    rec["legacy"][f"{layout}/{algo}"] = t.time_ms
                    if not t.early_stop:
                        best = t.time_ms if best is None else min(best, t.time_ms)
            # graph API, plain conv
            for variant, act, use_bias in (("conv", None, False), ("conv+bias+swish", "swish", True), ("conv+bias+relu", "relu", True)):
                if variant != "conv" and layout == "nchw":
                    continue
                try:
                    g, tens = graph_for(shape, layout, act, use_bias)
                except Exception as e:  # noqa
                    rec["graph" if variant == "conv" else "fused"][f"{layout}/{variant}"] = "build: " + str(e)[:200]
                    continue
                cnt = g.get_execution_plan_count()
                res = {}
                gbest = None
                for i in range(cnt):
                    if time.time() - T0 > DEADLINE:
                        break
                    try:
                        eid, knobs = g.get_engine_and_knobs_at_index(i)
                        name = g.get_plan_name_at_index(i)
                    except Exception as e:  # noqa
                        res[str(i)] = "meta: " + str(e)[:80]
                        continue
                    if eid >= 20000:
                        res[str(i)] = f"python engine {eid} skipped"
                        continue
                    tb = time.time()
                    try:
                        g.build_plan_at_index(i)
                        ws = g.get_workspace_size_plan_at_index(i)
                    except Exception as e:  # noqa
                        res[name] = "unbuildable: " + str(e)[:80]
                        continue
                    buildt = time.time() - tb
                    wsb = cp.empty(max(ws, 1), cp.uint8)
                    def go(j, i=i, g=g, tens=tens, sets=sets, bias=bias, wsb=wsb):
                        pack = {tens["X"]: sets[j]["x"].data.ptr, tens["W"]: sets[j]["w"].data.ptr, tens["Y"]: sets[j]["y"].data.ptr}
                        if "B" in tens:
                            pack[tens["B"]] = bias.data.ptr
                        g.execute_plan_at_index(pack, wsb.data.ptr, index=i, handle=h)
                    try:
                        sets[0]["y"].fill(np.nan)
                        go(0)
                        stream.synchronize()
                        err = None
                        if variant == "conv" and ref is not None:
                            err = float(harness.relative_error(sets[0]["y"].astype(cp.float32), ref))
                        t0 = time.perf_counter()
                        for _ in range(20):
                            go(0)
                        host_us = (time.perf_counter() - t0) / 20 * 1e6
                        stream.synchronize()
                        t = harness.time_launches(go, len(sets), gbest)
                    except Exception as e:  # noqa
                        res[name] = "exec: " + str(e)[:120]
                        continue
                    res[name] = {"eid": eid, "knobs": {str(kk): vv for kk, vv in knobs.items()}, "ws": ws, "ms": t.time_ms, "eager": t.eager,
                                 "early": t.early_stop, "err": err, "build_s": round(buildt, 3), "host_us": round(host_us, 1)}
                    if not t.early_stop:
                        gbest = t.time_ms if gbest is None else min(gbest, t.time_ms)
                rec["graph" if variant == "conv" else "fused"][f"{layout}/{variant}"] = {"count": cnt, "best": gbest, "plans": res}
            del sets
            go = None  # its default arguments hold the sets too: let them go before the pool is freed
            cp.get_default_memory_pool().free_all_blocks()
    except Exception:  # noqa: BLE001  (recorded in the line, the next problem runs)
        rec["error"] = traceback.format_exc()[-800:]
    rec["t"] = round(time.time() - T0, 1)
    emit(rec)
    lb = min([v for v in rec["legacy"].values() if isinstance(v, float)] or [None]) if rec["legacy"] else None
    gb = [v.get("best") for v in rec["graph"].values() if isinstance(v, dict)]
    fb = {kk: v.get("best") for kk, v in rec["fused"].items() if isinstance(v, dict)}
    print(p, "legacy", lb, "graph", gb, "fused", fb, "t", rec["t"], flush=True)
out.close()

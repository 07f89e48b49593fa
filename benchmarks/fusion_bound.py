"""How far fused graph-API epilogues could take a tuned model's conv time, from recorded timings.

For every conv of a tuned model, from the tuning cache that tuned it: the chosen step (the conv
with its epilogue, as recorded in the model) against the fastest bare conv measured for its
geometry in either memory format (a legacy algorithm without epilogue, or a graph-API engine row
less the cheapest epilogue pass timed for its key: engine rows are timed with their bias pass).
A fused conv + epilogue graph is no faster than its bare conv, and a residual ``Add`` still has to
be read: the second bound adds reading the residual at the GPU's peak memory bandwidth. Issue 12
asks for ResNet-50's conv time at batch 32 at most 0.93x of the best legacy-only choice.

    python benchmarks/fusion_bound.py --model resnet50.tuned.onnx --cache tune.db [--bandwidth-tbs 4.8]

The model is tuned with ``--engines legacy`` (or from a cache whose choices are legacy); the
numbers are the tuner's own, no new timing.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
from pathlib import Path

import convpass
from convpass.core.device import DeviceFingerprint
from convpass.core.problem import ProblemKey
from convpass.tuning.cache import TuningCache

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def bare_best_ms(rows, key: ProblemKey) -> float | None:
    """The fastest bare conv of ``key``'s geometry in any memory format and math mode."""
    passes = collections.defaultdict(list)
    for m in rows:
        if m.method == "epilogue" and m.status == "ok" and m.time_ms is not None:
            passes[m.key].append(m.time_ms)
    best = None
    for m in rows:
        if m.method != "measure" or m.status != "ok" or m.time_ms is None or "+" in m.algo or "early stop" in m.note:
            continue
        t = m.time_ms - min(passes[m.key]) if m.algo.startswith("engine:") and passes[m.key] else m.time_ms
        if not m.algo.startswith("engine:") or passes[m.key]:
            best = t if best is None else min(best, t)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8, help="peak memory bandwidth, TB/s (H200: 4.8)")
    args = ap.parse_args(argv)
    for what, path in (("model", args.model), ("tuning cache", args.cache)):
        if not Path(path).is_file():  # a cache path that does not exist would be created empty
            ap.error(f"{what} {path} does not exist")
    records = [r for r in convpass.inspect(args.model) if r["time_ms"] is not None and r["algo"] not in (None, "auto")]
    if not records:
        ap.error(f"{args.model} records no timed conv decision (tune it first: convpass optimize ... --engines legacy)")
    cache = TuningCache(args.cache)
    sums: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in records:
        key = ProblemKey.parse(r["problem_key"])
        bare = bare_best_ms(cache.get(DeviceFingerprint.parse(r["device"]), key.shape), key) or r["time_ms"]
        y = key.shape.y_shape
        residual = 0.0
        if "add" in (r["fusion"] or "").split("+"):
            residual = _BYTES[key.shape.dtype] * math.prod(y) / (args.bandwidth_tbs * 1e12) * 1e3
        s = sums[r["profile"]]
        s[0] += r["time_ms"]
        s[1] += min(r["time_ms"], bare)
        s[2] += min(r["time_ms"], bare + residual)
    cache.close()
    print("profile | chosen steps ms | bound: bare convs ms (ratio) | bound: bare convs + residual read ms (ratio)")
    for profile, (chosen, bare, with_residual) in sums.items():
        print(f"{profile} | {chosen:.4f} | {bare:.4f} ({bare / chosen:.3f}x) | {with_residual:.4f} ({with_residual / chosen:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

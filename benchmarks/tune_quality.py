"""Tuning quality on a GPU: convpass's choices against cuDNN's heuristic, cuDNN Find, and a fresh
re-measurement of every candidate (the oracle).

For each model and batch:
1. ``optimize --layout per-conv`` (measure mode, empty cache): the tuning time and convpass's
   choice per conv (the whole-graph layout plan trades conv time for fewer transposes, which this
   per-conv comparison cannot see: the executor benchmark measures that);
2. ``optimize`` again on the same cache: the cached re-run time (nothing is timed);
3. ``optimize --mode exhaustive --layout nchw`` on another empty cache: cuDNN Find's choices;
4. a fresh ``optimize`` on a third empty cache re-measures every candidate: the oracle's times.
All sums use the oracle run's times, so every contender is timed by the same, independent run:
the chosen configuration, the heuristic's first NCHW choice, Find's choice and the fastest candidate.

    python benchmarks/tune_quality.py --panel DIR [--models resnet50,...] [--batches 1,32] [--json OUT.json]

DIR holds ``<model>.onnx`` files exported by ``models/export_panel.py`` with a dynamic batch axis.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import onnx

import convpass
from convpass.core.problem import ProblemKey
from convpass.native import device as device_mod
from convpass.tuning.cache import TuningCache


def _input_spec(model: onnx.ModelProto, batch: int) -> str:
    (inp,) = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    dims = [d.dim_value if d.HasField("dim_value") else batch for d in inp.type.tensor_type.shape.dim]
    return f"{inp.name}={'x'.join(map(str, dims))}"


def _choices(tuned: onnx.ModelProto) -> list[tuple[str, ProblemKey, str, float | None]]:
    return [
        (r["node"], ProblemKey.parse(r["problem_key"]), r["algo"], r["time_ms"])
        for r in convpass.inspect(tuned)
        if r["algo"] not in (None, "auto")
    ]


def measure(path: Path, batch: int, workdir: Path) -> dict:
    model = onnx.load(path, load_external_data=False)
    spec = _input_spec(model, batch)
    dev = device_mod.detect()
    caches = {name: workdir / f"{path.stem}-{batch}-{name}.db" for name in ("tune", "find", "oracle")}
    t0 = time.perf_counter()
    tuned = convpass.optimize(path, shapes=[spec], cache=caches["tune"], layout="per-conv", quiet=True)
    tune_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    convpass.optimize(path, shapes=[spec], cache=caches["tune"], layout="per-conv", quiet=True)
    cached_s = time.perf_counter() - t0
    found = convpass.optimize(path, shapes=[spec], cache=caches["find"], mode="exhaustive", layout="nchw", tf32="on", quiet=True)
    convpass.optimize(path, shapes=[spec], cache=caches["oracle"], quiet=True)

    oracle = TuningCache(caches["oracle"])
    find_by_node = {node: (key, algo) for node, key, algo, _ in _choices(found)}
    sums = {"chosen": 0.0, "heuristic": 0.0, "find": 0.0, "oracle": 0.0}
    per_problem: dict[str, float] = {}
    detail: dict[str, dict] = {}
    convs = 0
    for node, key, algo, tuned_ms in _choices(tuned):
        rows = [m for m in oracle.get(dev, key.shape) if m.status == "ok"]
        timed = {(m.key, m.algo): m.time_ms for m in rows if m.method == "measure" and m.time_ms is not None}
        if not timed:
            continue
        base_key = key.shape.key("nchw", "default")
        first = min((m for m in rows if m.method == "heuristic" and m.key == base_key), key=lambda m: m.heuristic_rank, default=None)
        fkey, falgo = find_by_node.get(node, (None, None))
        values = {
            "chosen": timed.get((key, algo)),
            "heuristic": timed.get((base_key, first.algo)) if first else None,
            "find": timed.get((fkey, falgo)),
            "oracle": min(timed.values()),
        }
        if any(v is None for v in values.values()):
            print(f"  note: {node}: missing a time ({values}); left out of the sums", file=sys.stderr)
            continue
        for k, v in values.items():
            sums[k] += v
        per_problem[str(key.shape)] = values["chosen"] / values["oracle"]
        best = min(timed, key=timed.get)
        detail[str(key.shape)] = {
            "chosen": f"{key.layout}/{key.math}/{algo}",
            "chosen_ms_tuning_run": tuned_ms,
            "chosen_ms_oracle_run": values["chosen"],
            "oracle": f"{best[0].layout}/{best[0].math}/{best[1]}",
            "oracle_ms": values["oracle"],
            "heuristic_ms": values["heuristic"],
        }
        convs += 1
    within = sum(1 for r in per_problem.values() if r <= 1.03)
    return {
        "model": path.stem,
        "batch": batch,
        "convs": convs,
        "problems": len(per_problem),
        "tune_s": round(tune_s, 2),
        "cached_s": round(cached_s, 2),
        **{f"{k}_ms": round(v, 4) for k, v in sums.items()},
        "chosen_vs_heuristic": round(sums["chosen"] / sums["heuristic"], 3),
        "chosen_vs_find": round(sums["chosen"] / sums["find"], 3),
        "chosen_vs_oracle": round(sums["chosen"] / sums["oracle"], 3),
        "within_3pct_of_oracle": f"{within}/{len(per_problem)}",
        "device": str(dev),
        "detail": detail,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--panel", required=True, type=Path)
    parser.add_argument("--models", default="resnet50,mobilenet_v3_large,efficientnet_b0")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if device_mod.detect() is None:
        print("tune_quality: no usable GPU / cuDNN here", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                result = measure(args.panel / f"{name}.onnx", batch, Path(tmp))
                results.append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "detail"}), flush=True)
    header = f"{'model':<20}{'batch':>6}{'convs':>6}{'tune s':>8}{'cached s':>9}{'chosen':>9}{'heur':>9}{'find':>9}{'oracle':>9}{'vs heur':>8}{'vs find':>8}{'<=3%':>8}"
    print(header)
    for r in results:
        print(
            f"{r['model']:<20}{r['batch']:>6}{r['convs']:>6}{r['tune_s']:>8}{r['cached_s']:>9}{r['chosen_ms']:>9}{r['heuristic_ms']:>9}"
            f"{r['find_ms']:>9}{r['oracle_ms']:>9}{r['chosen_vs_heuristic']:>8}{r['chosen_vs_find']:>8}{r['within_3pct_of_oracle']:>8}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

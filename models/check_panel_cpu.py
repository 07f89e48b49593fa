#!/usr/bin/env python
"""Check an exported panel on the CPU, model by model, and report what each model exercises.

For every model of ``DIR/panel.json`` (written by ``export_panel.py``; or ``--models``):

1. ``convpass optimize`` (the command line, in a subprocess) with two shape profiles, batch 1 and
   batch 32 (``--shape input=1x... --shape input=32x...``). Without a GPU every graph pass runs
   and the decisions are left to run time; a failure is recorded with its message verbatim.
2. The tuned model passes ``onnx.checker.check_model(full_check=True)`` and ONNX Runtime (CPU)
   gives the original's outputs on it (batch 1, standard-normal input, seed 0).
3. The convpass CPU executor (``convpass.Executor(tuned, device="cpu")``) matches ONNX Runtime
   at batch 1: normwise relative error < 1e-4 (fp32), timed (construction + first run).
4. An op histogram: every op type with its node count, and the attribute variants of the ops
   whose kernels differ by attribute (convolution kinds, pooling, Resize, Softmax, Pad, ...).

Needs convpass (this project), onnx and onnxruntime, not torch::

    python models/check_panel_cpu.py --panel DIR [--models a,b] [--json OUT.json] [--markdown OUT.md]

Prints one line per model as it goes and a Markdown report at the end (results and op
histogram); exit status 1 when any model failed a check, 0 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import onnx
from onnx import helper

EXECUTOR_TOL = 1e-4
PROFILE_BATCHES = (1, 32)


# ---------------------------------------------------------------------------------------------
# op histogram


def _attrs(node: onnx.NodeProto) -> Dict[str, Any]:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else (list(v) if isinstance(v, (list, tuple)) else v)
    return out


def _conv_kind(node: onnx.NodeProto, weights: Dict[str, List[int]], channels: Dict[str, int]) -> str:
    """'2-D', '2-D depthwise', '2-D grouped', '3-D', '1-D dilated', ... for a Conv / ConvTranspose."""
    a = _attrs(node)
    w = weights.get(node.input[1])
    rank = len(w) - 2 if w else len(a.get("kernel_shape", [])) or "?"
    group = int(a.get("group", 1))
    kind = f"{rank}-D"
    if group > 1:
        cin = channels.get(node.input[0])
        per_group = w[1] if w and node.op_type == "Conv" else None
        kind += " depthwise" if per_group == 1 or (cin is not None and cin == group) else " grouped"
    if any(d != 1 for d in a.get("dilations", [])):
        kind += " dilated"
    if any(s != 1 for s in a.get("strides", [])) and node.op_type == "Conv":
        kind += " strided"
    if w and all(k == 1 for k in w[2:]):
        kind += " 1x1"
    return kind


def op_histogram(model: onnx.ModelProto) -> Dict[str, Any]:
    """{"nodes": N, "ops": {op: count}, "variants": {op: {variant: count}}} for ``model``."""
    ops = collections.Counter(n.op_type for n in model.graph.node)
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
        channels = {}
        for vi in list(inferred.graph.value_info) + list(inferred.graph.input):
            dims = vi.type.tensor_type.shape.dim
            if len(dims) >= 2 and dims[1].HasField("dim_value"):
                channels[vi.name] = dims[1].dim_value
    except Exception:  # noqa: BLE001  (the histogram does without channel counts)
        channels = {}
    variants: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for n in model.graph.node:
        a = _attrs(n)
        op = n.op_type
        if op in ("Conv", "ConvTranspose"):
            v = _conv_kind(n, weights, channels)
            if op == "ConvTranspose":
                v += f" k{'x'.join(map(str, weights.get(n.input[1], [0, 0])[2:]))} s{'x'.join(map(str, a.get('strides', [])))}"
        elif op in ("MaxPool", "AveragePool", "LpPool"):
            v = (f"k{'x'.join(map(str, a.get('kernel_shape', [])))} s{'x'.join(map(str, a.get('strides', [1])))}"
                 f" pads{a.get('pads', [0])} ceil={a.get('ceil_mode', 0)}")
            if op == "AveragePool":
                v += f" count_include_pad={a.get('count_include_pad', 0)}"
        elif op == "Resize":
            v = f"{a.get('mode', 'nearest')}/{a.get('coordinate_transformation_mode', 'half_pixel')}"
            if a.get("mode", "nearest") == "nearest":
                v += f"/{a.get('nearest_mode', 'round_prefer_floor')}"
        elif op in ("Softmax", "LogSoftmax", "Concat", "Split", "Flatten", "Gather", "LayerNormalization"):
            v = f"axis={a.get('axis', 'default')}"
        elif op == "Pad":
            v = f"mode={a.get('mode', 'constant')}"
        elif op in ("DepthToSpace", "SpaceToDepth"):
            v = f"blocksize={a.get('blocksize')} mode={a.get('mode', 'DCR')}"
        elif op == "Transpose":
            v = f"perm={a.get('perm')}"
        elif op == "Gemm":
            v = f"transB={a.get('transB', 0)}"
        elif op.startswith("Reduce"):
            v = f"keepdims={a.get('keepdims', 1)}" + (f" axes={a['axes']}" if "axes" in a else " axes=input")
        elif op == "Clip":
            v = f"{len(n.input)} inputs"
        elif op == "InstanceNormalization":
            v = f"epsilon={a.get('epsilon', 1e-5):g}"
        else:
            continue
        variants[op][v] += 1
    return {
        "nodes": len(model.graph.node),
        "ops": dict(ops.most_common()),
        "variants": {k: dict(c.most_common()) for k, c in variants.items()},
    }


def _histogram_cells(h: Dict[str, Any]) -> List[str]:
    ops = h["ops"]
    convs = []
    for op in ("Conv", "ConvTranspose"):
        for v, c in h["variants"].get(op, {}).items():
            convs.append(f"{op} {v} ×{c}")
    groups = {
        "pooling": ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool"),
        "normalization": ("BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization"),
    }
    def cell(names):
        parts = []
        for op in names:
            if op in ops:
                var = h["variants"].get(op)
                detail = "; ".join(f"{v} ×{c}" for v, c in var.items()) if var else ""
                parts.append(f"{op} ×{ops[op]}" + (f" ({detail})" if detail else ""))
        return "<br>".join(parts) or "—"
    shown = {"Conv", "ConvTranspose", *groups["pooling"], *groups["normalization"]}
    rest = []
    for op, c in ops.items():
        if op in shown:
            continue
        var = h["variants"].get(op)
        detail = f" ({'; '.join(f'{v} ×{n}' for v, n in var.items())})" if var else ""
        rest.append(f"{op} ×{c}{detail}")
    return [str(h["nodes"]), "<br>".join(convs) or "—", cell(groups["pooling"]), cell(groups["normalization"]),
            ", ".join(rest) or "—"]


# ---------------------------------------------------------------------------------------------
# checks


def _run_ort(model: onnx.ModelProto | str, feeds: Dict[str, np.ndarray]) -> List[np.ndarray]:
    import onnxruntime as ort

    from convpass.core.ort_reference import cpu_session

    so = ort.SessionOptions()
    so.log_severity_level = 3
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return cpu_session(ort, src, so).run(None, feeds)


def _rel_err(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        den = np.linalg.norm(w64)
        worst = max(worst, float(np.linalg.norm(g64 - w64) / (den if den > 0 else 1.0)))
    return worst


def _input_dims(model: onnx.ModelProto) -> tuple[str, List[int], np.dtype]:
    inits = {t.name for t in model.graph.initializer}
    (inp,) = [i for i in model.graph.input if i.name not in inits]
    tt = inp.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
    return inp.name, dims, np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))


def check_model(path: Path, workdir: Path) -> Dict[str, Any]:
    """Every check of the module docstring on one exported model; never raises for a model's fault."""
    r: Dict[str, Any] = {"file": path.name}
    model = onnx.load(path)
    r["histogram"] = op_histogram(model)
    name, dims, dtype = _input_dims(model)
    profiles = [[b, *dims[1:]] for b in PROFILE_BATCHES]
    tuned_path = workdir / f"{path.stem}.tuned.onnx"
    cmd = [sys.executable, "-c", "import sys; from convpass.cli.main import main; sys.exit(main())",
           "optimize", str(path), "-o", str(tuned_path)]
    for p in profiles:
        cmd += ["--shape", f"{name}={'x'.join(map(str, p))}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CONVPASS_CACHE": str(workdir / "cache.db")})
    r["optimize_s"] = round(time.perf_counter() - t0, 2)
    r["optimize_command"] = "convpass optimize " + " ".join(cmd[5:])
    if proc.returncode != 0:
        r["optimize"] = "failed"
        r["optimize_error"] = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [f"exit {proc.returncode}"]
        r["optimize_error"] = r["optimize_error"][0]
        return r
    r["optimize"] = "ok"
    r["optimize_notes"] = [ln.strip() for ln in proc.stderr.splitlines() if "run time" in ln or "undecided" in ln][:3]
    tuned = onnx.load(tuned_path)
    try:
        onnx.checker.check_model(tuned, full_check=True)
        r["check_model"] = "ok"
    except Exception as e:  # noqa: BLE001
        r["check_model"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"
    x = np.random.default_rng(0).standard_normal([1, *dims[1:]]).astype(dtype)
    feeds = {name: x}
    ref = _run_ort(str(path), feeds)
    try:
        got = _run_ort(tuned, feeds)
        r["ort_tuned_max_abs_diff"] = max(float(np.max(np.abs(np.asarray(g, np.float64) - w))) for g, w in zip(got, ref))
        r["ort_tuned_equal"] = all(np.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, ref))
    except Exception as e:  # noqa: BLE001
        r["ort_tuned_equal"] = False
        r["ort_tuned_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    from convpass.runtime.executor import Executor

    try:
        t0 = time.perf_counter()
        outs = Executor(tuned, device="cpu").run(None, feeds)
        r["executor_s"] = round(time.perf_counter() - t0, 2)
        r["executor_rel_err"] = _rel_err(outs, ref)
        r["executor_ok"] = r["executor_rel_err"] < EXECUTOR_TOL
    except Exception as e:  # noqa: BLE001
        r["executor_ok"] = False
        r["executor_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    r["output_rms"] = float(np.sqrt(np.mean(np.square(np.asarray(ref[0], np.float64)))))
    return r


def passed(r: Dict[str, Any]) -> bool:
    return r.get("optimize") == "ok" and r.get("check_model") == "ok" and bool(r.get("ort_tuned_equal")) \
        and bool(r.get("executor_ok"))


# ---------------------------------------------------------------------------------------------
# report


def markdown(results: Dict[str, Dict[str, Any]], entries: Dict[str, Dict[str, Any]]) -> str:
    lines = ["| model | export s | optimize (b1 + b32 profiles) | check_model | ORT tuned = original | executor rel. err (b1) | executor s |",
             "|---|---|---|---|---|---|---|"]
    for n, r in results.items():
        e = entries.get(n, {})
        opt = f"ok, {r['optimize_s']} s" if r.get("optimize") == "ok" else f"**failed** ({r.get('optimize_s')} s): `{r.get('optimize_error')}`"
        ort_cell = "—" if r.get("optimize") != "ok" else (
            f"yes (max abs diff {r['ort_tuned_max_abs_diff']:.1e})" if r.get("ort_tuned_equal") else f"**no** {r.get('ort_tuned_error', '')}")
        if r.get("optimize") != "ok":
            ex, ex_s = "—", "—"
        elif "executor_rel_err" in r:
            ex = f"{r['executor_rel_err']:.1e}" + ("" if r["executor_ok"] else " **(> 1e-4)**")
            ex_s = str(r["executor_s"])
        else:
            ex, ex_s = f"**failed**: `{r.get('executor_error')}`", "—"
        lines.append(f"| {n} | {e.get('export_seconds', '—')} | {opt} | {r.get('check_model', '—')} | {ort_cell} | {ex} | {ex_s} |")
    lines += ["", "| model | nodes | convolutions | pooling | normalization | other ops |", "|---|---|---|---|---|---|"]
    for n, r in results.items():
        lines.append(f"| {n} | " + " | ".join(_histogram_cells(r["histogram"])) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Check an exported convpass panel on the CPU.")
    ap.add_argument("--panel", required=True, type=Path, help="folder written by export_panel.py")
    ap.add_argument("--models", help="comma-separated subset (default: every fp32 model of panel.json)")
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    ap.add_argument("--markdown", type=Path, help="write the Markdown report")
    args = ap.parse_args(argv)
    doc = json.loads((args.panel / "panel.json").read_text())
    entries = {e["name"]: e for e in doc.get("models", []) if e.get("dtype") == "float32"}
    names = [n.strip() for n in args.models.split(",")] if args.models else list(entries)
    results: Dict[str, Dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="check-panel-") as tmp:
        for n in names:
            path = args.panel / (entries[n]["file"] if n in entries else f"{n}.onnx")
            if not path.is_file():
                results[n] = {"file": path.name, "optimize": "failed", "optimize_error": "not exported",
                              "histogram": {"nodes": 0, "ops": {}, "variants": {}}}
            else:
                results[n] = check_model(path, Path(tmp))
                for f in Path(tmp).glob("*.tuned.onnx*"):
                    f.unlink()
            r = results[n]
            status = "ok" if passed(r) else "FAILED"
            print(f"{n}: {status} optimize={r.get('optimize')} ({r.get('optimize_s')} s) check={r.get('check_model')} "
                  f"ort_equal={r.get('ort_tuned_equal')} executor_err={r.get('executor_rel_err', r.get('executor_error'))} "
                  f"({r.get('executor_s')} s) {r.get('optimize_error', '')}", flush=True)
    text = markdown(results, entries)
    print("\n" + text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0 if all(passed(r) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

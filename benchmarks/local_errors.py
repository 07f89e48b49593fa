"""Where a tuned model's float32 error comes from: each conv's and each GroupNorm unit's own error on
the device, against float64 NumPy on the very input the device computed.

Every conv of the tuned model and every GroupNorm unit of the pattern the TorchScript exporter writes
(Reshape -> InstanceNormalization -> Reshape -> Mul -> Add, then a Relu if one follows) has its input
and output made graph outputs; the tuned model runs once on the device (the convpass executor, its
recorded decisions) and the original model once on ONNX Runtime CPU. Printed per node, in graph order:

* ``local``: ``||y - f64(x)|| / ||f64(x)||`` with ``x`` and ``y`` the device's own input and output of
  the node and ``f64`` the node's math in float64 (the conv with the tuned model's weight and bias;
  the GroupNorm, its affine and Relu): the node's own error, free of what came before it. A float32
  conv or normalization computed with float32 arithmetic is near 1e-7; TF32 near 1e-4.
* ``cumulative``: ``||y - y_ort|| / ||y_ort||``, what came before included;
* for convs, the decision recorded for them (algorithm, memory format, math).

Then the model's end-to-end error (its outputs, max-abs-relative as ``--precision`` measures it),
with and without the extra outputs: an output the graph exposes ends a fusion unit there (a conv
fused with its residual Add runs it as a pass of its own), so the two runs may differ slightly;
the algorithms and math modes are the recorded ones in both.

``--truth f64`` also runs the original model in float64 (:mod:`convpass.compiler.precision.float64`:
every value float64, on the convpass CPU executor) and measures against it what ``--truth ort``
takes as the reference: per node, ONNX Runtime CPU float32's own drift (``ort/f64``) and the
device's (``dev/f64``), both relative L2; end to end, ONNX Runtime CPU float32 and the tuned model on
the device, max-abs-relative and relative L2 (``model_error``'s ``max-rel`` and ``rel-l2``). A model
that amplifies float32 rounding shows it in ``ort/f64``: no float32 computation is closer to ONNX
Runtime float32 than about twice that.

    python benchmarks/local_errors.py --model bit.onnx --tuned bit_fp32.onnx --batch 1
    python benchmarks/local_errors.py --model bit.onnx --precision fp32 --cache /tmp/c.db --batch 16 --json out.json
    python benchmarks/local_errors.py --model bit.onnx --precision fp32 --batch 1 --device cpu    # CPU executor
    python benchmarks/local_errors.py --model bit.onnx --precision fp32 --batch 1 --truth f64     # and the float64 truth
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from convpass.bench.document import to_json
from convpass.core.errors import FileError
from convpass.core.files import check_output, write_text_atomically
from convpass.core.text import printable

Runner = Callable[[onnx.ModelProto, dict[str, np.ndarray]], list[np.ndarray]]


def conv64(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, attrs: dict[str, Any]) -> np.ndarray:
    """A 2-D Conv in float64 (ONNX semantics: explicit pads, strides, dilations, groups)."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    k, cg, kh, kw = w.shape
    group = attrs.get("group", 1)
    sh, sw = attrs.get("strides", [1, 1])
    dh, dw = attrs.get("dilations", [1, 1])
    t, left, bottom, right = attrs.get("pads", [0, 0, 0, 0])
    xp = np.pad(x, ((0, 0), (0, 0), (t, bottom), (left, right)))
    win = np.lib.stride_tricks.sliding_window_view(xp, ((kh - 1) * dh + 1, (kw - 1) * dw + 1), axis=(2, 3))
    win = win[:, :, ::sh, ::sw, ::dh, ::dw]  # (N, C, OH, OW, kh, kw)
    per = k // group
    parts = [np.tensordot(win[:, g * cg:(g + 1) * cg], w[g * per:(g + 1) * per], axes=([1, 4, 5], [1, 2, 3])) for g in range(group)]
    y = np.concatenate(parts, axis=-1).transpose(0, 3, 1, 2)
    return y if b is None else y + b.astype(np.float64).reshape(1, -1, 1, 1)


def group_norm64(x: np.ndarray, groups: int, eps: float, gamma: np.ndarray, beta: np.ndarray, relu: bool) -> np.ndarray:
    """The exporter's GroupNorm pattern in float64: per sample and group, mean and population variance."""
    n = x.shape[0]
    g = x.astype(np.float64).reshape(n, groups, -1)
    y = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + eps)).reshape(x.shape)
    y = y * gamma.astype(np.float64) + beta.astype(np.float64)
    return np.maximum(y, 0) if relu else y


def _rel(y: np.ndarray, ref: np.ndarray) -> float:
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm((np.asarray(y, np.float64) - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-30))


def _const(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for n in model.graph.node:  # in order: an Identity of a constant (torch shares equal initializers so) follows it
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            values[n.output[0]] = onnx.numpy_helper.to_array(n.attribute[0].t)
        elif n.op_type == "Identity" and n.input[0] in values:
            values[n.output[0]] = values[n.input[0]]
    return values


def sites(tuned: onnx.ModelProto) -> list[dict[str, Any]]:
    """The convs and GroupNorm units of ``tuned`` in graph order: kind, name, input, output and what
    their float64 math needs."""
    from convpass.core import annotation

    consts = _const(tuned)
    producer = {o: n for n in tuned.graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in tuned.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def only_reader(value: str, op: str) -> onnx.NodeProto | None:
        r = readers.get(value, [])
        return r[0] if len(r) == 1 and r[0].op_type == op else None

    out = []
    for n in tuned.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if annotation.standard_op_type(n) == "Conv" and n.input[1] in consts:
            bias = consts.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
            out.append({"kind": "conv", "name": n.name, "x": n.input[0], "y": n.output[0], "w": consts[n.input[1]], "b": bias, "attrs": attrs})
        elif n.op_type == "InstanceNormalization":
            reshape = producer.get(n.input[0])
            back = only_reader(n.output[0], "Reshape")
            mul = back and only_reader(back.output[0], "Mul")
            add = mul and only_reader(mul.output[0], "Add")
            if reshape is None or reshape.op_type != "Reshape" or add is None or mul.input[1] not in consts or add.input[1] not in consts:
                continue
            relu = only_reader(add.output[0], "Relu")
            groups = int(consts[n.input[1]].shape[0])
            out.append({"kind": "groupnorm", "name": n.name, "x": reshape.input[0], "y": (relu or add).output[0], "groups": groups,
                        "eps": float(np.float32(attrs.get("epsilon", 1e-5))), "gamma": consts[mul.input[1]], "beta": consts[add.input[1]],
                        "relu": relu is not None})
    return out


def _expose(model: onnx.ModelProto, names: Sequence[str], shapes: dict[str, tuple[int, ...]] | None) -> onnx.ModelProto:
    """``model`` with ``names`` as extra float graph outputs (typed with ``shapes`` where given)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for name in dict.fromkeys(names):
        if name in have:
            continue
        if shapes is None:
            m.graph.output.append(helper.make_value_info(name, onnx.TypeProto()))
        else:
            m.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shapes[name])))
    return m


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``model`` on ONNX Runtime CPU as convpass's reference runs it (its result-changing rewrites off:
    :mod:`convpass.core.ort_reference`)."""
    import onnxruntime as ort

    from convpass.core.ort_reference import cpu_session

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return cpu_session(ort, model.SerializeToString(), so).run(None, feeds)


def executor_runner(device: str) -> Runner:
    def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        from convpass.runtime import Executor

        return [np.asarray(v) for v in Executor(model, device=device).run(None, feeds)]
    return run


def local_errors(original: onnx.ModelProto, tuned: onnx.ModelProto, feeds: dict[str, np.ndarray], run: Runner,
                 truth: bool = False) -> dict[str, Any]:
    """Per conv and GroupNorm unit: its local and cumulative error (module docstring); the model's
    end-to-end errors, with and without the extra outputs; with ``truth``, the errors of ONNX
    Runtime float32 and of the device against the float64 truth."""
    import convpass

    found = sites(tuned)
    names = [v for s in found for v in (s["x"], s["y"]) if v not in feeds]
    n_out = len(original.graph.output)
    ref = run_ort(_expose(original, names, None), feeds)
    ref_of = {**feeds, **dict(zip([o.name for o in original.graph.output] + list(dict.fromkeys(n for n in names if n not in {o.name for o in original.graph.output})), ref))}
    shapes = {k: v.shape for k, v in ref_of.items()}
    exposed = _expose(tuned, names, shapes)
    got = run(exposed, feeds)
    got_of = {**feeds, **dict(zip([o.name for o in exposed.graph.output], got))}
    plain = run(tuned, feeds)
    decisions = {r["node"]: r for r in convpass.inspect(tuned)}
    rows = []
    for s in found:
        x, y = got_of[s["x"]], got_of[s["y"]]
        want = conv64(x, s["w"], s["b"], s["attrs"]) if s["kind"] == "conv" else group_norm64(x, s["groups"], s["eps"], s["gamma"], s["beta"], s["relu"])
        row = {"kind": s["kind"], "node": s["name"], "local": _rel(y, want), "cumulative": _rel(y, ref_of[s["y"]])}
        d = decisions.get(s["name"])
        if d is not None:
            row.update(algo=d.get("algo"), memory_format=d.get("memory_format"), math_mode=d.get("math_mode"))
        rows.append(row)

    def end_to_end(outs: Sequence[np.ndarray]) -> float:
        return max(float(np.abs(np.asarray(o, np.float64) - r).max() / max(np.abs(r).max(), 1e-30)) for o, r in zip(outs[:n_out], ref[:n_out]))
    result = {"nodes": rows, "end_to_end": end_to_end(plain), "end_to_end_exposed": end_to_end(got)}
    if truth:
        result["truth"] = _against_truth(_expose(original, names, None), feeds, rows, found, ref_of, got_of, ref[:n_out], plain[:n_out])
    return result


def _against_truth(exposed: onnx.ModelProto, feeds: dict[str, np.ndarray], rows: list[dict[str, Any]], found: list[dict[str, Any]],
                   ref_of: dict[str, np.ndarray], got_of: dict[str, np.ndarray], ref: Sequence[np.ndarray], plain: Sequence[np.ndarray]) -> dict[str, Any]:
    """ONNX Runtime float32's and the device's errors against the float64 truth: per node (``ort_truth``,
    ``device_truth`` added to ``rows``) and end to end."""
    from convpass.compiler.precision.float64 import float64_outputs, relative_errors

    (outs,) = float64_outputs(exposed, [feeds])
    truth_of = {**feeds, **dict(zip([o.name for o in exposed.graph.output], outs))}
    for row, s in zip(rows, found):
        row.update(ort_truth=_rel(ref_of[s["y"]], truth_of[s["y"]]), device_truth=_rel(got_of[s["y"]], truth_of[s["y"]]))
    final = outs[:len(ref)]
    return {"ort_float32": relative_errors([ref], [final]), "device": relative_errors([plain], [final])}


def ort_float64_gaps(model: onnx.ModelProto) -> list[str]:
    """The op types of ``model`` (float32) whose float64 form ONNX Runtime's CPU provider cannot run:
    each is tried alone, as a one-node float64 model with the node's own attributes and input shapes."""
    import onnxruntime as ort

    from convpass.compiler.precision import float64

    m = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type for vi in (*m.graph.input, *m.graph.value_info, *m.graph.output)}
    types.update({t.name: helper.make_tensor_type_proto(t.data_type, list(t.dims)) for t in m.graph.initializer})
    tried: dict[str, bool] = {}
    so = ort.SessionOptions()
    so.log_severity_level = 4
    for node in m.graph.node:
        if node.op_type in tried or node.domain not in ("", "ai.onnx") or node.op_type in ("Constant",):
            continue
        ins = [i for i in node.input if i]
        if not all(i in types for i in ins) or not any(types[i].tensor_type.elem_type in float64.FLOAT_TYPES for i in ins):
            continue
        lone = helper.make_graph([node], "one", [helper.make_value_info(i, types[i]) for i in dict.fromkeys(ins)],
                                 [helper.make_value_info(o, onnx.TypeProto()) for o in node.output if o])
        one = float64.to_float64(helper.make_model(lone, opset_imports=list(model.opset_import), ir_version=model.ir_version))
        try:
            ort.InferenceSession(one.SerializeToString(), so, providers=["CPUExecutionProvider"])
            tried[node.op_type] = True
        except Exception:  # noqa: BLE001 - ORT raises its own exception types
            tried[node.op_type] = False
    return sorted(op for op, ok in tried.items() if not ok)



def _table(result: dict[str, Any]) -> str:
    truth = "truth" in result
    lines = [f"{'node':64s} {'kind':9s} {'local':>8s} {'cumul.':>8s}" + (f" {'ort/f64':>8s} {'dev/f64':>8s}" if truth else "") + "  decision"]
    for r in result["nodes"]:
        decision = " ".join(str(r[k]) for k in ("algo", "memory_format", "math_mode") if r.get(k) is not None)
        against = f" {r['ort_truth']:8.1e} {r['device_truth']:8.1e}" if truth else ""
        lines.append(f"{printable(r['node'])[-64:]:64s} {r['kind']:9s} {r['local']:8.1e} {r['cumulative']:8.1e}{against}  {decision}")
    worst = max(result["nodes"], key=lambda r: r["local"], default=None)
    if worst is not None:
        lines.append(f"largest local error: {worst['local']:.1e} at {printable(worst['node'])} ({worst['kind']})")
    lines.append(f"end to end (max-abs-relative): {result['end_to_end']:.2e}; with the nodes exposed: {result['end_to_end_exposed']:.2e}")
    if truth:
        for who, label in (("ort_float32", "ONNX Runtime CPU float32"), ("device", "the tuned model on the device")):
            e = result["truth"][who]
            lines.append(f"{label} against the float64 truth: max-abs-relative {e['max-rel']:.2e}, relative L2 {e['rel-l2']:.2e}")
        if result["truth"].get("ort_float64_gaps"):
            lines.append(f"(the truth runs on the convpass CPU executor: ONNX Runtime CPU has no float64 kernel for "
                         f"{', '.join(result['truth']['ort_float64_gaps'])})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="the original model (one float input)")
    ap.add_argument("--tuned", type=Path, default=None, help="its tuned model; without it, --precision tunes one here")
    ap.add_argument("--precision", default="fp32", help="the precision to tune with when no --tuned is given (default fp32)")
    ap.add_argument("--cache", default=None, help="tuning cache (default: convpass's)")
    ap.add_argument("--fprop-algo", default=None,
                    help="tune with this forward algorithm for every conv (optimize's fprop_algo; e.g. implicit_precomp_gemm, "
                         "to see what a transform algorithm's rounding costs)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1, help="the standard-normal input's seed (1: the held-out set's)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--truth", default="ort", choices=("ort", "f64"),
                    help="f64: also measure ONNX Runtime float32 and the device against the model computed in float64")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    protect = [(p, what) for p, what in ((args.model, "the --model"), (args.tuned, "the --tuned model"),
                                         (args.cache, "the tuning cache")) if p is not None]
    if args.json is not None:
        try:
            check_output(args.json, "--json", protect)  # before the runs, not after them
        except FileError as e:
            ap.error(str(e))
    import convpass

    original = onnx.load(str(args.model))  # with its external data: the float64 truth converts it
    inits = {t.name for t in original.graph.initializer}
    (inp,) = [i for i in original.graph.input if i.name not in inits]
    dims = [d.dim_value if d.HasField("dim_value") else None for d in inp.type.tensor_type.shape.dim]
    shape = (args.batch, *dims[1:])
    if any(d is None for d in shape):
        ap.error("the model's input has symbolic dims besides the batch")
    if args.tuned is not None:
        tuned = onnx.load(str(args.tuned))
    else:
        tuned = convpass.optimize(original, shapes=[f"{inp.name}={'x'.join(map(str, shape))}"], precision=args.precision,
                                  cache=args.cache, fprop_algo=args.fprop_algo, quiet=True)
    feeds = {inp.name: np.random.default_rng(args.seed).standard_normal(shape).astype(np.float32)}
    result = local_errors(original, tuned, feeds, executor_runner(args.device), truth=args.truth == "f64")
    if args.truth == "f64":
        result["truth"]["ort_float64_gaps"] = ort_float64_gaps(original)
    print(_table(result))
    if args.json is not None:
        write_text_atomically(args.json, to_json(result), "--json", protect)  # NaN / Inf (not JSON): null
    return 0


if __name__ == "__main__":
    sys.exit(main())

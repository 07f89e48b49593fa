"""GPU time of the cuda executor per launch, grouped by op family: ``convpass bench --profile-ops``
and ``benchmarks/executor_speed.py --profile-ops``.

Families (:func:`op_family`, one table: :data:`FAMILY_OPS`)
------------------------------------------------------------
Every launch of a compiled plan reports ``(label, op_type)``: the label names the kernel that ran
("Conv+residual+relu", "fused Sigmoid+Mul", "MaxPool (kernel)", "Concat (in place)", or a plain op
type for ops run by the op library) and ``op_type`` is the ONNX op type of the launch's node.

* A fused element-wise group (label ``"fused A+B+..."``) is classified by its head ``A``, the first
  op of the label: ``normalization`` when the head is a normalization op (an inference
  BatchNormalization with its activation fused behind it), ``elementwise`` otherwise. The label is
  read, not ``op_type``: the runtime records a fused launch under the node that runs the kernel,
  the group's *last* node (``Relu`` for "fused BatchNormalization+Relu").
* Every other launch is classified by ``op_type`` through the table: ``conv`` (Conv, ConvTranspose,
  with their fused bias / activation / residual epilogues and the layout copies a conv launch does:
  how many, per run, is ``conv_input_copies``, said in the summary line),
  ``elementwise``, ``normalization`` (with convpass's fused normalization unit, ``FusedNorm``: statistics and
  apply passes with the chain behind them), ``pooling`` (MaxPool, AveragePool, LpPool, Global*Pool and
  ReduceMean / ReduceMax: in the panel's CNNs those two are the spatial means and maxima PyTorch
  exports for ``x.mean((2, 3))``; a launch carries no axes, so one over other axes counts here too),
  ``concat_copy`` (Concat, Transpose, Reshape-like ops, Split, Slice, Pad, DepthToSpace,
  SpaceToDepth, Expand, Tile, Gather...: data movement), ``resize``, ``matmul``, ``softmax``,
  ``reduce`` (the other reductions, ArgMax / ArgMin); op types in no row are ``other``.

Measurement (:func:`profile_executor`)
--------------------------------------
Each launch's GPU time, the tuned model run eagerly with each run queued whole behind a hold
kernel (:mod:`convpass.runtime.cuda.timing`, which says how and when host gaps are included),
less the timing's own cost per launch: an event pair costs a few microseconds of GPU time, which
a step that launches nothing (a Reshape that is a view) would otherwise report as its time, and
every small kernel carries. The floor is an empty kernel timed the same way in each run
(``floor_ms``; :data:`convpass.runtime.in_place.FLOOR_LAUNCHES` of them), as the in-place check does.

The clock is injectable (:class:`CupyClock` is the real one): the aggregation and the retry logic
are tested on a CPU with synthetic events.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from convpass.runtime.cuda.timing import Clock, CupyClock, timed_runs
from convpass.runtime.in_place import FLOOR_LAUNCHES

__all__ = [
    "FAMILIES", "FAMILY_OPS", "OP_FAMILY", "PROFILE_RUNS", "CupyClock", "aggregate", "failed", "family_line",
    "label_lines", "op_family", "profile_executor", "short_text", "summary_line",
]

PROFILE_RUNS = 5  # timed eager runs per case
FUSED_PREFIX = "fused "

FAMILY_OPS: dict[str, tuple[str, ...]] = {
    "conv": ("Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "DeformConv"),
    "elementwise": (
        "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Sqrt", "Reciprocal", "Exp", "Log", "Neg", "Abs", "Sign", "Floor",
        "Ceil", "Round", "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "Gelu", "ThresholdedRelu", "Shrink",
        "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Softplus", "Softsign", "Mish", "Erf", "Clip", "Sin", "Cos",
        "Max", "Min", "Mean", "Sum", "Where", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not",
        "And", "Or", "Xor", "IsNaN", "IsInf", "BitShift", "Cast", "CastLike", "Dropout",
    ),
    "normalization": (
        "BatchNormalization", "InstanceNormalization", "GroupNormalization", "LayerNormalization",
        "RMSNormalization", "LpNormalization", "MeanVarianceNormalization", "LRN",
        "FusedNorm",  # convpass's fused GroupNorm / InstanceNorm unit with its activation and residual chain
    ),
    "pooling": (
        "MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool", "MaxRoiPool",
        "RoiAlign", "ReduceMean", "ReduceMax",
    ),
    "concat_copy": (
        "Concat", "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Split", "Slice", "Pad",
        "DepthToSpace", "SpaceToDepth", "Expand", "Tile", "Gather", "GatherElements", "GatherND", "ScatterND",
        "ScatterElements", "Col2Im",
    ),
    "resize": ("Resize", "Upsample"),
    "matmul": ("MatMul", "Gemm", "Einsum", "MatMulInteger", "QLinearMatMul"),
    "softmax": ("Softmax", "LogSoftmax", "Hardmax"),
    "reduce": (
        "ReduceSum", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
        "ReduceSumSquare", "ArgMax", "ArgMin", "CumSum",
    ),
}
FAMILIES: tuple[str, ...] = (*FAMILY_OPS, "other")
OP_FAMILY: dict[str, str] = {op: family for family, ops in FAMILY_OPS.items() for op in ops}


def op_family(label: str, op_type: str) -> str:
    """The op family of one launch (module docstring): a fused group by its head op, else by ``op_type``."""
    if label.startswith(FUSED_PREFIX):
        head = label[len(FUSED_PREFIX):].split("+", 1)[0].strip()
        return "normalization" if OP_FAMILY.get(head) == "normalization" else "elementwise"
    return OP_FAMILY.get(op_type, "other")


# ---------------------------------------------------------------------------------------------
# aggregation (pure)


def aggregate(samples: Iterable[tuple[str, str, float]], runs: int, *, host_gaps_excluded: bool,
              method: str) -> dict[str, Any]:
    """The op-profile record of ``runs`` runs' launches, ``(label, op_type, GPU ms)`` each.

    Times are per run (the sum over the runs divided by ``runs``); ``launches`` counts per run too.
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    per_label: dict[tuple[str, str], list[float]] = {}
    for label, op_type, ms in samples:
        per_label.setdefault((label, op_type), []).append(float(ms))
    labels = [
        {"label": label, "op_type": op_type, "family": op_family(label, op_type), "ms": sum(ts) / runs,
         "launches": round(len(ts) / runs)}
        for (label, op_type), ts in per_label.items()
    ]
    labels.sort(key=lambda r: (-r["ms"], r["label"]))
    families: dict[str, dict[str, Any]] = {}
    for r in labels:
        f = families.setdefault(r["family"], {"ms": 0.0, "launches": 0})
        f["ms"] += r["ms"]
        f["launches"] += r["launches"]
    order = {f: i for i, f in enumerate(FAMILIES)}
    families = dict(sorted(families.items(), key=lambda kv: (-kv[1]["ms"], order[kv[0]])))
    total = sum(r["ms"] for r in labels)
    conv = families.get("conv", {}).get("ms", 0.0)
    non_conv = total - conv
    top = next(((f, v["ms"]) for f, v in families.items() if f != "conv"), (None, None))
    return {
        "status": "ok",
        "reason": None,
        "runs": runs,
        "method": method,
        "host_gaps_excluded": host_gaps_excluded,
        "launches": sum(r["launches"] for r in labels),
        "total_ms": total,
        "conv_ms": conv,
        "non_conv_ms": non_conv,
        "non_conv_pct": 100.0 * non_conv / total if total > 0 else None,
        "top_non_conv_family": top[0],
        "top_non_conv_ms": top[1],
        "families": families,
        "labels": labels,
    }


def failed(reason: str) -> dict[str, Any]:
    """The record of a profile that could not be taken (``reason``: one line)."""
    return {"status": "failed", "reason": reason}


# ---------------------------------------------------------------------------------------------
# measurement


def profile_executor(executor: Any, feeds: Mapping[str, Any], runs: int = PROFILE_RUNS, *, clock: Clock | None = None,
                     warmup: int = 2, host_clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """GPU time per launch of an eager executor (``cuda_graph=False``) over ``runs`` runs, by family.

    ``warmup`` untimed runs first (the first builds the plan); then the host time of one run's
    enqueue sizes the hold; then up to ``runs + 2`` attempts to get ``runs`` runs queued whole
    (module docstring). ``executor.backend.step_events`` is set during the timed runs only.
    """
    clock = clock or CupyClock()
    timed = timed_runs(executor, feeds, runs, clock=clock, warmup=warmup, host_clock=host_clock, floor=FLOOR_LAUNCHES)
    kept, whole = timed.runs, timed.whole
    floor = timed.floor_ms(clock)
    less = floor or 0.0
    samples = [(label, op_type, max(clock.elapsed_ms(a, b) - less, 0.0)) for run in kept for label, op_type, a, b, *_ in run]
    head = f"eager (cuda_graph=False), CUDA events around each launch, mean of {len(kept)} run(s)"
    each = (f"; each launch less the timing's own {floor:.4f} ms (an empty launch timed the same way)" if floor is not None
            else "; the timing's own cost per launch included (no empty kernel)")
    out = aggregate(samples, len(kept), host_gaps_excluded=whole, method=f"{head}; {timed.how}{each}")
    out["floor_ms"] = floor
    out["conv_input_copies"] = _conv_input_copies(executor, feeds)
    return out


def _conv_input_copies(executor: Any, feeds: Mapping[str, Any]) -> int | None:
    """How many inputs the conv launches of one run copy first (a Concat slice, a tensor in the
    other memory format): their time is in the conv family, since they run inside the conv's
    launch. Counted over one more eager run by the backend's ``layout_copies`` counter; None where
    the backend keeps no such counter."""
    counters = getattr(getattr(executor, "backend", None), "counters", None)
    if not isinstance(counters, Mapping) or "layout_copies" not in counters:
        return None
    before = counters["layout_copies"]
    executor.run(None, feeds)
    return int(counters["layout_copies"] - before)


# ---------------------------------------------------------------------------------------------
# text


def _pct(part: float | None, total: float | None) -> str:
    return f"{100 * part / total:.1f}%" if isinstance(part, (int, float)) and total else "-"


def summary_line(p: Mapping[str, Any] | None) -> str | None:
    """The two figures: GPU time outside convolutions and the top non-conv op family (None: not profiled)."""
    if not p:
        return None
    if p.get("status") != "ok":
        return f"GPU time by op family: {p.get('status')}: {p.get('reason') or ''}".rstrip(": ")
    gaps = "host gaps excluded" if p.get("host_gaps_excluded") else "HOST LAUNCH OVERHEAD INCLUDED"
    top = p.get("top_non_conv_family")
    top_txt = f"{top} {p['top_non_conv_ms']:.3f} ms ({_pct(p['top_non_conv_ms'], p['total_ms'])})" if top else "none"
    copies = p.get("conv_input_copies")
    copied = f" (with {copies} input copies made inside conv launches)" if copies else ""
    return (
        f"GPU time per eager run ({p['runs']} run(s), {gaps}): {p['total_ms']:.3f} ms in {p['launches']} launches; "
        f"conv {p['conv_ms']:.3f} ms{copied}, non-conv {p['non_conv_ms']:.3f} ms ({_pct(p['non_conv_ms'], p['total_ms'])}); "
        f"top non-conv family: {top_txt}"
    )


def family_line(p: Mapping[str, Any] | None) -> str | None:
    """GPU ms per family, largest first."""
    if not p or p.get("status") != "ok":
        return None
    return "by family: " + ", ".join(f"{f} {v['ms']:.3f}" for f, v in p["families"].items()) + " ms"


def label_lines(p: Mapping[str, Any], top: int = 16) -> list[str]:
    """The ``top`` launch labels by GPU time: ms per run, share, launches per run, label (family)."""
    total = p.get("total_ms") or 0.0
    return [
        f"{r['ms']:8.3f} ms  {_pct(r['ms'], total):>6}  x{r['launches']:<4d} {r['label']} ({r['family']})"
        for r in p.get("labels", [])[:top]
    ]


def short_text(p: Mapping[str, Any] | None) -> str:
    """Non-conv GPU time, its share and the top family in a few characters (table cells)."""
    if not p:
        return "-"
    if p.get("status") != "ok":
        return str(p.get("status"))
    share = p.get("non_conv_pct")
    return (f"{p['non_conv_ms']:.3f} ms, {share:.0f}% ({p.get('top_non_conv_family') or 'none'})"
            if share is not None else "-")


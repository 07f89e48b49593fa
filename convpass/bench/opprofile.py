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
  with their fused bias / activation / residual epilogues and the layout copies a conv launch does),
  ``elementwise``, ``normalization``, ``pooling`` (MaxPool, AveragePool, LpPool, Global*Pool and
  ReduceMean / ReduceMax: in the panel's CNNs those two are the spatial means and maxima PyTorch
  exports for ``x.mean((2, 3))``; a launch carries no axes, so one over other axes counts here too),
  ``concat_copy`` (Concat, Transpose, Reshape-like ops, Split, Slice, Pad, DepthToSpace,
  SpaceToDepth, Expand, Tile, Gather...: data movement), ``resize``, ``matmul``, ``softmax``,
  ``reduce`` (the other reductions, ArgMax / ArgMin); op types in no row are ``other``.

Measurement (:func:`profile_executor`)
--------------------------------------
The tuned model runs eagerly (``cuda_graph=False``, the same launches a captured graph replays)
with ``backend.step_events`` set, so every launch is bracketed by two CUDA events. Eager launches
are bound by host time (cuDNN's legacy API alone costs about 0.1 ms of host time per call), and an
event pair around a launch the GPU had to wait for would time the host, not the GPU. So each timed
run is queued whole before the GPU starts it: a *hold* kernel that spins for longer than the host
needs to enqueue one run goes first, and after the run is enqueued the host checks that the hold
is still spinning; runs where it is not are retried with a longer hold. What the events then time
is GPU time per launch, back to back, as in a graph replay. Where no run can be queued whole (a
launch that waits for the host inside the run; a run with more pending launches and events than the
stream's launch queue holds, where the host blocks until the hold ends and the GPU may run dry
later; or no hold kernel), the record says that host launch overhead is included
(``host_gaps_excluded: false``).

The clock is injectable (:class:`CupyClock` is the real one): the aggregation and the retry logic
are tested on a CPU with synthetic events.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

__all__ = [
    "FAMILIES", "FAMILY_OPS", "OP_FAMILY", "PROFILE_RUNS", "CupyClock", "aggregate", "failed", "family_line",
    "label_lines", "op_family", "profile_executor", "short_text", "summary_line",
]

PROFILE_RUNS = 5  # timed eager runs per case
FUSED_PREFIX = "fused "
MAX_HOLD_S = 0.25  # longest hold kernel tried (a run that needs longer overflows the launch queue anyway)

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


class Clock(Protocol):
    """What :func:`profile_executor` needs from the GPU (:class:`CupyClock`; tests pass a fake)."""

    note: str

    def sync(self) -> None: ...

    def elapsed_ms(self, start: Any, end: Any) -> float: ...

    def hold(self, seconds: float) -> Callable[[], bool] | None:
        """Queue a hold of ``seconds`` on the stream; returns the check "is it still holding?" (called
        once the run is enqueued), or None when no hold can be queued (``note`` says why)."""
        ...


_HOLD_SOURCE = r"""
extern "C" __global__ void convpass_bench_hold(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


class CupyClock:
    """CUDA events and the hold kernel on CuPy's current stream (the stream eager runs launch on)."""

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self.note = ""
        self._kernel: Any = None

    def sync(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(self.cp.cuda.get_elapsed_time(start, end))

    def hold(self, seconds: float) -> Callable[[], bool] | None:
        import numpy as np

        cp = self.cp
        if self._kernel is None:
            try:
                kernel = cp.RawKernel(_HOLD_SOURCE, "convpass_bench_hold")
                kernel((1,), (1,), (np.uint64(0),))  # compiles it
                self._kernel = kernel
            except Exception as e:  # noqa: BLE001
                self._kernel = False
                self.note = f"no hold kernel ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"
        if self._kernel is False:
            return None
        self._kernel((1,), (1,), (np.uint64(int(seconds * 1e9)),))
        released = cp.cuda.Event(disable_timing=True)
        released.record()
        return lambda: not released.done


def profile_executor(executor: Any, feeds: Mapping[str, Any], runs: int = PROFILE_RUNS, *, clock: Clock | None = None,
                     warmup: int = 2, host_clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """GPU time per launch of an eager executor (``cuda_graph=False``) over ``runs`` runs, by family.

    ``warmup`` untimed runs first (the first builds the plan); then the host time of one run's
    enqueue sizes the hold; then up to ``runs + 2`` attempts to get ``runs`` runs queued whole
    (module docstring). ``executor.backend.step_events`` is set during the timed runs only.
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    clock = clock or CupyClock()
    backend = executor.backend
    for _ in range(max(warmup, 1)):
        executor.run(None, feeds)
    clock.sync()
    t0 = host_clock()
    executor.run(None, feeds)
    hold_s = min(MAX_HOLD_S, 2.0 * (host_clock() - t0) + 1e-3)
    clock.sync()
    whole: list[list[tuple[str, str, Any, Any]]] = []
    other: list[list[tuple[str, str, Any, Any]]] = []
    events: list[tuple[str, str, Any, Any]] = []
    backend.step_events = events
    try:
        for _ in range(runs + 2):
            start = len(events)
            holding = clock.hold(hold_s)
            executor.run(None, feeds)
            queued = holding() if holding is not None else False
            clock.sync()
            (whole if queued else other).append(events[start:])
            if len(whole) == runs or (holding is None and len(other) == runs):
                break
            if holding is not None and not queued:
                hold_s = min(MAX_HOLD_S, 2.0 * hold_s)
    finally:
        backend.step_events = None
    kept = whole if whole else other[:runs]
    samples = [(label, op_type, clock.elapsed_ms(a, b)) for run in kept for label, op_type, a, b, *_ in run]
    head = f"eager (cuda_graph=False), CUDA events around each launch, mean of {len(kept)} run(s)"
    if whole:
        method = f"{head}; each run queued whole behind a hold kernel: GPU time, host launch overhead excluded"
    else:
        why = clock.note or "the hold ended before the run was enqueued (a launch waits for the host inside the run)"
        method = f"{head}; host launch overhead included ({why})"
    return aggregate(samples, len(kept), host_gaps_excluded=bool(whole), method=method)


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
    return (
        f"GPU time per eager run ({p['runs']} run(s), {gaps}): {p['total_ms']:.3f} ms in {p['launches']} launches; "
        f"conv {p['conv_ms']:.3f} ms, non-conv {p['non_conv_ms']:.3f} ms ({_pct(p['non_conv_ms'], p['total_ms'])}); "
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


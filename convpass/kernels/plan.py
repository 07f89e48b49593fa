"""The static execution plan: what the executor builds once per input-shape signature and a backend
compiles and runs. Plain data; it depends on nothing but the op registry's node type, so the
executor, the backends and the cuda package all import it and none of them imports another.

* :class:`Plan` — the steps the outputs need, in topological order, each value in a slot, the
  constants at their slots (``template``), each value's shape and dtype, liveness (``free``).
* :class:`ConvSummary` — how one conv of a plan runs (its decision), for summaries and tests.
* :class:`GraphStatus` — whether a compiled plan replays as one CUDA graph, and if not, why
  (node and reason). Every backend answers it (:meth:`Backend.graph_status`), so ``convpass run
  --summary`` and ``convpass bench`` can say "CUDA graph: yes / no (reason)" for every case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from convpass.ops.registry import NodeInfo


@dataclasses.dataclass(frozen=True)
class ConvSummary:
    """How one conv runs in a plan: its recorded decision and the problem it computes."""

    node: str
    op_type: str
    tuned: bool
    algo: str
    memory_format: str
    math_mode: str
    source: str
    workspace_bytes: int | None
    time_ms: float | None
    recorded_problem_key: str
    problem: str | None  # computed ConvShape of this plan (None before a plan exists)
    profile: int | None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PlanStep:
    node: NodeInfo
    fn: Any
    inputs: tuple[int, ...]  # slots, -1 = absent optional input
    outputs: tuple[int, ...]  # slots, -1 = output nobody reads
    free: tuple[int, ...]  # slots whose last reader is this step


@dataclasses.dataclass
class Plan:
    """A static execution plan for one input-shape signature."""

    signature: tuple[Any, ...]
    output_names: tuple[str, ...]
    steps: list[PlanStep]
    slot_names: list[str]
    template: list[Any]  # constants at their slots, None elsewhere
    feed_slots: dict[str, int]
    output_slots: list[int]
    value_info: dict[int, tuple[tuple[int, ...], np.dtype]]
    profile: int | None
    convs: list[ConvSummary]
    folded_nodes: int  # nodes folded to constants for this signature
    matmul_allow_tf32: bool = False  # the model's convpass.matmul_allow_tf32 (Gemm / MatMul)
    fusions: list[Any] = dataclasses.field(default_factory=list)  # FusionSummary per fusion unit found (convpass.kernels.fused_steps)
    backend_state: Any = None  # whatever Backend.compile_plan keeps; with it set, Backend.run_plan runs the plan

    def describe(self) -> str:
        lines = [f"plan: {len(self.steps)} step(s), {len(self.slot_names)} value(s), {self.folded_nodes} node(s) folded for these shapes"]
        for i, s in enumerate(self.steps):
            ins = ", ".join(self.slot_names[j] if j >= 0 else "-" for j in s.inputs)
            lines.append(f"  {i:4d} {s.node.op_type:<18} {s.node.name}  ({ins})")
        return "\n".join(lines)

    def readers(self) -> dict[int, list[int]]:
        """slot -> the steps that read it, in plan order."""
        out: dict[int, list[int]] = {}
        for i, st in enumerate(self.steps):
            for s in st.inputs:
                if s >= 0:
                    out.setdefault(s, []).append(i)
        return out

    def refresh_liveness(self) -> None:
        """Recompute every step's ``free``: a value is released after its last reader (or after the
        step that computes it, when nothing reads it); graph outputs and constants never are, feeds
        nobody reads after the first step."""
        last: dict[int, int] = {}
        for i, st in enumerate(self.steps):
            for s in (*st.inputs, *st.outputs):
                if s >= 0 and (s in st.inputs or s not in last):
                    last[s] = i
        keep = set(self.output_slots)
        free: dict[int, list[int]] = {}
        for s, i in last.items():
            if s not in keep and self.template[s] is None:
                free.setdefault(i, []).append(s)
        for s in self.feed_slots.values():
            if s not in last and s not in keep:
                free.setdefault(0, []).append(s)
        for i, st in enumerate(self.steps):
            st.free = tuple(free.get(i, ()))

    def producers(self) -> dict[int, int]:
        """slot -> the step that computes it."""
        return {s: i for i, st in enumerate(self.steps) for s in st.outputs if s >= 0}

    def add_constant(self, name: str, value: Any) -> int:
        """A new slot holding the constant ``value`` (a backend array; e.g. parameters that a
        lowering derived from other constants); returns its slot."""
        self.slot_names.append(name)
        self.template.append(value)
        return len(self.template) - 1

    def add_value(self, name: str, shape: tuple[int, ...], dtype: Any) -> int:
        """A new slot for a value computed by a step (a rewrite of the plan added it); returns its slot."""
        self.slot_names.append(name)
        self.template.append(None)
        slot = len(self.template) - 1
        self.value_info[slot] = (tuple(shape), np.dtype(dtype))
        return slot

    def info(self, slot: int) -> tuple[tuple[int, ...], np.dtype] | None:
        """(shape, dtype) of a slot: computed values from ``value_info``, constants from the template."""
        if slot < 0:
            return None
        hit = self.value_info.get(slot)
        if hit is not None:
            return hit[0], np.dtype(hit[1])
        const = self.template[slot]
        return None if const is None else (tuple(const.shape), np.dtype(const.dtype))


@dataclasses.dataclass(frozen=True)
class GraphStatus:
    """Whether a plan runs as one captured CUDA graph.

    ``captured``: True (replays one graph), False (runs eagerly or in pieces: ``reason`` says which
    node and why), None (not applicable: CPU backend or ``cuda_graph=False``; or not known yet:
    the plan has not run yet).
    """

    captured: bool | None
    reason: str = ""
    node: str = ""  # the node that broke capture, when one did

    def describe(self) -> str:
        if self.captured is True:
            return "CUDA graph: yes" + (f" ({self.reason})" if self.reason else "")
        if self.captured is False:
            return f"CUDA graph: no ({self.reason})"
        return f"CUDA graph: n/a ({self.reason})" if self.reason else "CUDA graph: n/a"


def _root(a: Any) -> Any:
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


def store_outputs(env: list[Any], slots: Sequence[int], outs: Any) -> None:
    """Put an op's result (one array, or a tuple with one entry per output) into its slots."""
    if not isinstance(outs, (tuple, list)):
        env[slots[0]] = outs
        return
    for s, o in zip(slots, outs):
        if s >= 0:
            env[s] = o


def unshare_outputs(results: list[Any], plan: Plan, feeds: Mapping[str, Any]) -> list[Any]:
    """Outputs that are (views of) feeds or constants are copied: callers may write into outputs."""
    owned = {id(_root(a)) for a in plan.template if a is not None}
    owned.update(id(_root(a)) for a in feeds.values())
    return [r.copy() if id(_root(r)) in owned else r for r in results]

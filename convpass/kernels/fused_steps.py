"""Fusion units in an executor plan: found on the plan (:class:`PlanView`, the rules of
:mod:`convpass.core.fusion_units`), and each one the model's decision (or the kind's rule) says
runs fused rewritten:

* a normalization unit becomes one step of the op library's fused ops (:mod:`convpass.ops.fused`),
  at the position of its last node. Every backend runs that step: the CPU one with NumPy, the cuda
  one with its own kernels (:mod:`convpass.kernels.group_norm`) or, where they do not take a case,
  the same op over CuPy;
* a conv bias unit loses the conv's bias input, and an ``Add`` of the bias (seen as ``(K, 1, ...,
  1)``) follows the conv, so the cuda backend's element-wise fusion puts it in the kernel of the
  node that reads the conv (:mod:`convpass.kernels.elementwise`). Only where the conv would run its
  bias as a pass of its own (its decision fuses no epilogue into cuDNN's call), or when forced.

What was found and what ran is recorded on the plan (:attr:`Plan.fusions`, one
:class:`FusionSummary` per unit) for the executor's plan summary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from convpass.core.annotation import DOMAIN as TUNED_DOMAIN
from convpass.core.fusion_units import BiasUnit, GraphView, NormUnit, find_units
from convpass.kernels.plan import Plan, PlanStep
from convpass.ops.fused import FUSED_DOMAIN, ChainStep, NormSpec, norm_impl
from convpass.ops.registry import NodeInfo, lookup

__all__ = ["FusionSummary", "PlanView", "apply_fusions", "describe_fusions"]


@dataclasses.dataclass(frozen=True)
class FusionSummary:
    """One fusion unit of a plan: its kind and nodes, whether it ran fused and why (``measured``:
    the model's measured decision; ``rule``: nothing measured, the kind's rule; ``off``: fusion
    turned off), and a note."""

    kind: str
    nodes: tuple[str, ...]
    fused: bool
    why: str
    note: str = ""

    def describe(self) -> str:
        head = f"{self.kind} [{self.nodes[0]} .. {self.nodes[-1]}] ({len(self.nodes)} nodes)"
        return f"{head}: {'fused' if self.fused else 'unfused'} ({self.why}{'; ' + self.note if self.note else ''})"


class PlanView(GraphView):
    """A :class:`~convpass.kernels.plan.Plan` seen by the unit rules: nodes are step indices,
    values are slots; constants are read on the host with ``to_host``."""

    def __init__(self, plan: Plan, to_host: Callable[[Any], np.ndarray] = np.asarray) -> None:
        self.plan = plan
        self.to_host = to_host
        self._readers = {s: list(dict.fromkeys(r)) for s, r in plan.readers().items()}
        self._outputs = set(plan.output_slots)

    def nodes(self) -> Sequence[int]:
        return range(len(self.plan.steps))

    def op(self, node: int) -> str:
        info = self.plan.steps[node].node
        if info.domain == TUNED_DOMAIN and info.op_type in ("Conv", "ConvTranspose"):
            return info.op_type  # a tuned conv runs as the standard op
        return info.op_type if info.domain == "" else ""

    def opset(self, node: int) -> int:
        return int(self.plan.steps[node].node.opset)

    def attr(self, node: int, name: str, default: Any = None) -> Any:
        return self.plan.steps[node].node.attr(name, default)

    def name(self, node: int) -> str:
        return self.plan.steps[node].node.name

    def inputs(self, node: int) -> list[int | None]:
        return [s if s >= 0 else None for s in self.plan.steps[node].inputs]

    def outputs(self, node: int) -> list[int | None]:
        return [s if s >= 0 else None for s in self.plan.steps[node].outputs]

    def readers(self, value: int) -> list[int]:
        return self._readers.get(value, [])

    def is_output(self, value: int) -> bool:
        return value in self._outputs

    def const(self, value: int) -> np.ndarray | None:
        c = self.plan.template[value]
        return None if c is None else np.asarray(self.to_host(c))

    def shape(self, value: int) -> tuple[int, ...] | None:
        info = self.plan.info(value)
        return None if info is None else tuple(int(d) for d in info[0])

    def dtype(self, value: int) -> np.dtype | None:
        info = self.plan.info(value)
        return None if info is None else np.dtype(info[1])


Decide = Callable[[NormUnit | BiasUnit], tuple[bool, str, str]]  # unit -> (fused, why, note)


def apply_fusions(plan: Plan, decide: Decide, to_host: Callable[[Any], np.ndarray] = np.asarray,
                  upload: Callable[[np.ndarray], Any] = lambda a: a) -> list[FusionSummary]:
    """Find the plan's fusion units, rewrite each one ``decide`` fuses (module docstring), refresh
    the plan's liveness and record a :class:`FusionSummary` per unit in ``plan.fusions``."""
    units = find_units(PlanView(plan, to_host))
    summaries = []
    replaced: dict[int, list[PlanStep]] = {}  # step -> the steps that run in its place (none: removed)
    for unit in units:
        fused, why, note = decide(unit)
        if fused and unit.kind == "bias" and why != "forced" and not _bias_is_a_pass(plan.steps[unit.conv]):
            fused, note = False, "the conv adds no bias in a pass of its own (untuned, or fused into cuDNN's call): nothing to move"
        summaries.append(FusionSummary(unit.kind, unit.names, fused, why, note))
        if not fused:
            continue
        if unit.kind == "bias":
            replaced.update(_moved_bias(plan, unit, upload))
            continue
        members = sorted(unit.nodes)
        for i in members:
            replaced[i] = []
        replaced[members[-1]] = [_norm_step(plan, unit, upload)]
    if replaced:
        plan.steps = [new for i, st in enumerate(plan.steps) for new in replaced.get(i, [st])]
        plan.refresh_liveness()
    plan.fusions = summaries
    return summaries


def _bias_is_a_pass(step: PlanStep) -> bool:
    """Whether a conv step adds its bias in a pass of its own: a tuned decision that fuses no
    epilogue into its call (a legacy algorithm, convpass's own kernel, or a graph-API engine of the
    bare conv)."""
    decision = getattr(step.node.prepared, "decision", None)
    return decision is not None and not decision.is_auto and not decision.fusion


def _moved_bias(plan: Plan, unit: BiasUnit, upload: Callable[[np.ndarray], Any]) -> dict[int, list[PlanStep]]:
    """The conv without its bias, an Add of the bias after it, the reader reading that sum."""
    conv_i, reader_i = unit.nodes
    conv, reader = plan.steps[conv_i], plan.steps[reader_i]
    y = conv.outputs[0]
    shape, dtype = plan.info(y)
    name = conv.node.name
    view = np.asarray(unit.bias).reshape((-1,) + (1,) * (len(shape) - 2)).astype(dtype)
    bias = plan.add_constant(f"{name}::bias", upload(view))
    summed = plan.add_value(f"{plan.slot_names[y]}::biased", shape, dtype)
    add = NodeInfo(f"{name}::bias", "Add", "", 14, {}, [plan.slot_names[y], plan.slot_names[bias]], [plan.slot_names[summed]],
                   impl=lookup("Add", "", 14))
    bare = PlanStep(conv.node, conv.fn, (*conv.inputs[:2], -1), conv.outputs, ())
    added = PlanStep(add, add.impl.fn, (y, bias), (summed,), ())
    reads = PlanStep(reader.node, reader.fn, tuple(summed if s == y else s for s in reader.inputs), reader.outputs, ())
    return {conv_i: [bare, added], reader_i: [reads]}


def _norm_step(plan: Plan, unit: NormUnit, upload: Callable[[np.ndarray], Any]) -> PlanStep:
    """The ``FusedNorm`` step of a unit: inputs ``(x, scale, shift, *externals)``."""
    x_info = plan.info(unit.x)
    c = int(x_info[0][1])
    dtype = np.float64 if np.dtype(x_info[1]) == np.float64 else np.float32
    per = c // unit.groups if unit.per_group else 1
    scale = np.repeat(np.asarray(unit.scale, np.float64), per) if unit.scale is not None else np.ones(c)
    shift = np.repeat(np.asarray(unit.bias, np.float64), per) if unit.bias is not None else np.zeros(c)
    head = unit.names[0]
    scale_slot = plan.add_constant(f"{head}::fused_scale", upload(scale.astype(dtype)))
    shift_slot = plan.add_constant(f"{head}::fused_shift", upload(shift.astype(dtype)))
    inputs = (unit.x, scale_slot, shift_slot, *unit.externals)
    core_out = plan.steps[unit.nodes[unit.core - 1]].outputs[0]
    position = {plan.steps[k].outputs[0]: j for j, k in enumerate(unit.epilogue)}
    chain = []
    for k in unit.epilogue:
        st = plan.steps[k]
        args = []
        for s in st.inputs:
            if s < 0:
                args.append(("none", 0))
            elif s == core_out:
                args.append(("norm", 0))
            elif s in position:
                args.append(("step", position[s]))
            else:
                args.append(("in", 3 + unit.externals.index(s)))
        chain.append(ChainStep(st.node, tuple(args)))
    spec = NormSpec(unit.groups, unit.eps, tuple(chain), unit.names)
    last = plan.steps[unit.nodes[-1]]
    names = [plan.slot_names[s] for s in inputs]
    node = NodeInfo(head, "FusedNorm", FUSED_DOMAIN, 1, {"groups": unit.groups, "epsilon": unit.eps}, names,
                    [plan.slot_names[unit.output]], impl=norm_impl(), prepared=spec)
    return PlanStep(node, node.impl.fn, inputs, (unit.output,), last.free)


def describe_fusions(summaries: Sequence[FusionSummary]) -> str:
    """The plan summary's lines about fusion units (one per unit), or ``""`` when there are none."""
    if not summaries:
        return ""
    fused = sum(1 for s in summaries if s.fused)
    lines = [f"fusion units: {fused} of {len(summaries)} run fused"]
    lines += ["  " + s.describe() for s in summaries]
    return "\n".join(lines)

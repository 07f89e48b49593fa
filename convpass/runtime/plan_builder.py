"""Building the executor's :class:`~convpass.kernels.plan.Plan` for one input-shape signature (the
feeds' names, shapes and dtypes, and the requested outputs).

1. The nodes the outputs need, in topological order (:meth:`ModelGraph.needed`).
2. Shape computations (``Shape`` of a tensor whose shape the signature fixes and everything
   computed from such values and constants) are folded to constants on the host, so the plan
   holds only data-dependent computation.
3. Convs get their canonical geometry and the decision of the shape profile the feeds match
   (none matching: decided at run time); each fusion unit is fused or not as the model's record,
   the ``fusions`` option or the kind's rule says (:func:`convpass.kernels.fused_steps.apply_fusions`).
4. Every value gets a slot; after each step the slots whose last reader ran are released
   (liveness), which is all "buffer reuse" means on numpy; the plan records every value's shape
   and dtype so a device backend can preallocate (:meth:`Backend.compile_plan`).

The plan is built by running its nodes once on the backend, so building also gives that run's
results (the first run's where the backend compiles nothing; :meth:`Executor.run`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from convpass.core import annotation
from convpass.core.errors import ExecutorError
from convpass.core.fusion_units import RULES, unit_key
from convpass.kernels.backends import Backend, host_backend
from convpass.kernels.fused_steps import FusionSummary, apply_fusions
from convpass.kernels.plan import ConvSummary, Plan, PlanStep, unshare_outputs
from convpass.native.cuda import ExecutorWarning
from convpass.ops.conv import ConvCall
from convpass.ops.registry import NodeInfo, OpContext, call_node
from convpass.runtime.model_graph import ModelGraph
from convpass.runtime.summaries import conv_summary


class _ShapeOnly:
    """Stands for a tensor whose shape (not value) is known, for Shape / Size at plan time."""

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.shape = shape
        self.ndim = len(shape)
        self.dtype = dtype


@dataclasses.dataclass
class _Val:
    static: bool
    value: Any  # host numpy array if static, backend array otherwise
    shape: tuple[int, ...]
    dtype: Any
    determined: bool  # shape is fixed by the input-shape signature


class PlanBuilder:
    """Builds plans of ``graph`` on ``backend`` with the model's recorded decisions: ``decisions``
    by conv node name (one per shape profile), ``model_info`` and ``fusion_record`` as
    :mod:`convpass.core.annotation` reads them. Constants uploaded once serve every plan."""

    def __init__(self, backend: Backend, graph: ModelGraph, decisions: Mapping[str, Sequence[annotation.ConvDecision]],
                 model_info: Any, fusion_record: Any) -> None:
        self.backend = backend
        self.graph = graph
        self.decisions = decisions
        self.model_info = model_info
        self.fusion_record = fusion_record
        self._device_constants: dict[str, Any] = {}
        self._regrouped: set[str] = set()  # recorded fusion units said not to match a plan's

    def profile_for(self, arrays: Mapping[str, Any]) -> int | None:
        """The shape profile the feeds match (0 for a model without profiles; None: none matches)."""
        info = self.model_info
        if info is None or not info.profiles:
            return 0
        for i, p in enumerate(info.profiles):
            if all(name in arrays and tuple(arrays[name].shape) == tuple(shape) for name, shape in p.inputs.items()):
                return i
        return None

    def build(self, key: tuple[Any, ...], arrays: dict[str, Any], outputs: tuple[str, ...], fusions: bool | None) -> tuple[Plan, list[Any]]:
        """The plan for ``key`` (the signature of ``arrays`` and ``outputs``), compiled by the
        backend, and its results on ``arrays``. ``fusions`` is the executor's option."""
        backend = self.backend
        backend.begin_plan()
        constants = self.graph.constants
        ctx = OpContext(backend)
        hctx = OpContext(host_backend())
        profile = self.profile_for(arrays)
        vals: dict[str, _Val] = {}
        for name, a in arrays.items():
            vals[name] = _Val(False, a, tuple(a.shape), a.dtype, True)
        plan_consts: dict[str, Any] = {}
        steps: list[tuple[NodeInfo, list[str], list[str]]] = []
        convs: list[ConvSummary] = []
        folded = 0

        def get(name: str) -> _Val | None:
            if not name:
                return None
            v = vals.get(name)
            if v is None:
                c = constants.get(name)
                if c is None:
                    raise ExecutorError(f"value {name!r} is used but never produced")
                v = vals[name] = _Val(True, c, tuple(c.shape), c.dtype, True)
            return v

        needed = self.graph.needed(outputs)
        last_read = _last_reads(needed, outputs)
        for index, node in enumerate(needed):
            impl = node.impl
            ins = [get(n) for n in node.inputs]
            present = [v for v in ins if v is not None]
            if all(v.static for v in present):
                outs = call_node(hctx, node, [v.value if v else None for v in ins], host=True)
                for name, o in zip(node.outputs, outs):
                    if name:
                        o = np.asarray(o)
                        vals[name] = _Val(True, o, tuple(o.shape), o.dtype, True)
                folded += 1
                continue
            if node.domain == "" and node.op_type in ("Shape", "Size") and ins[0] is not None and ins[0].determined:
                o = np.asarray(impl.fn(hctx, node, _ShapeOnly(ins[0].shape, ins[0].dtype)))
                vals[node.outputs[0]] = _Val(True, o, tuple(o.shape), o.dtype, True)
                folded += 1
                continue
            args = [None if v is None else (self._device_constant(n, v.value, plan_consts) if v.static else v.value) for n, v in zip(node.inputs, ins)]
            run_node = node
            if impl.prepare is not None:
                prepared = impl.prepare(node, [v.shape if v else None for v in ins], [v.dtype if v else None for v in ins])
                if isinstance(prepared, ConvCall):
                    decision, note = self._decision(node, profile)
                    prepared = dataclasses.replace(prepared, decision=decision, profile=profile if decision is not None else None)
                    convs.append(conv_summary(node, decision, prepared, prepared.profile, note))
                run_node = node.with_prepared(prepared)
            outs = call_node(ctx, run_node, args, host=False)
            determined = (
                all(v.determined for v in present)
                and not impl.data_dependent_shape
                and all(ins[i] is None or ins[i].static for i in impl.value_inputs if i < len(ins))
            )
            for name, o in zip(node.outputs, outs):
                if name:
                    vals[name] = _Val(False, o, tuple(o.shape), o.dtype, determined)
            steps.append((run_node, list(node.inputs), list(node.outputs)))
            # as the plan's runs do (its liveness): a computed value no later node reads is let go, its
            # shape and type kept for the plan; the first run holds the live values only, not all of them
            for name in (*node.inputs, *node.outputs):
                v = vals.get(name) if name else None
                if v is not None and not v.static and last_read.get(name, -1) <= index:
                    v.value = None

        results = [vals[n].value if n in vals else constants[n] for n in outputs]
        plan = self._assemble(key, outputs, steps, vals, arrays, plan_consts, profile, convs, folded)
        apply_fusions(plan, functools.partial(self._fusion_decision, fusions=fusions, profile=profile), backend.to_host, backend.upload)
        if fusions is None:
            self._note_regrouped(plan.fusions, {node.name for node, _, _ in steps}, profile)
        backend.compile_plan(plan)
        return plan, unshare_outputs(results, plan, arrays)

    def _device_constant(self, name: str, value: np.ndarray, plan_consts: dict[str, Any]) -> Any:
        constants = self.graph.constants
        if name in constants and constants[name] is value:
            dev = self._device_constants.get(name)
            if dev is None:
                dev = self._device_constants[name] = self.backend.upload(value)
            return dev
        dev = plan_consts.get(name)
        if dev is None:
            dev = plan_consts[name] = self.backend.upload(value)
        return dev

    def _fusion_decision(self, unit: Any, *, fusions: bool | None, profile: int | None) -> tuple[bool, str, str]:
        """(fused, why, note) for a fusion unit of the plan being built (the ``fusions`` option)."""
        if fusions is not None:
            return bool(fusions), "forced" if fusions else "off", "Executor(fusions=...)"
        if not getattr(self.backend, "fuse", True):
            return False, "off", "the backend was made with fuse=False"
        decision = None
        if self.fusion_record is not None and profile is not None:
            decision = self.fusion_record.decision(unit_key(unit.names), self._device(), profile)
        if decision is None or decision.fused is None:
            return True, "rule", RULES[unit.kind]
        times = ", ".join(f"{k} {v:.4f} ms" for k, v in sorted(decision.times_ms.items()))
        return decision.fused, "measured", times

    def _device(self) -> Any:
        """The device whose fusion decisions apply: this backend's, else the model's (CPU)."""
        return self.backend.fingerprint() or (self.model_info.device if self.model_info else "")

    def _note_regrouped(self, summaries: Sequence[FusionSummary], present: set[str], profile: int | None) -> None:
        """Warn once per recorded unit whose measured decision this plan cannot apply: its nodes run
        here but are grouped otherwise (the model edited, or another convpass's unit rules)."""
        record = self.fusion_record
        if record is None or profile is None or not getattr(self.backend, "fuse", True):
            return
        formed = {unit_key(s.nodes) for s in summaries}
        for key, (_kind, nodes, _decisions) in record.units.items():
            decision = record.decision(key, self._device(), profile)
            if key in formed or key in self._regrouped or decision is None or decision.fused is None or not present.intersection(nodes):
                continue
            self._regrouped.add(key)
            formed_here = " and ".join(f"{unit_key(s.nodes)!r} ({'fused' if s.fused else 'unfused'}, {'by the rule' if s.why == 'rule' else s.why})"
                                       for s in summaries if set(s.nodes) & set(nodes))
            instead = f"this plan forms {formed_here}" if formed_here else "this plan forms no fusion unit of those nodes: they run unfused"
            warnings.warn(f"fusion unit {key!r} recorded in {annotation.FUSIONS_KEY} ({'fused' if decision.fused else 'unfused'}, "
                          f"{decision.source}) matches no unit of this plan, so its decision is not applied: {instead}",
                          ExecutorWarning, stacklevel=5)

    def _decision(self, node: NodeInfo, profile: int | None) -> tuple[annotation.ConvDecision | None, str]:
        decisions = self.decisions.get(node.name)
        if decisions is None:
            return None, "untuned"
        if profile is None:
            return annotation.ConvDecision(), "no shape profile matches the inputs: decided at run time"
        return decisions[min(profile, len(decisions) - 1)], ""

    def _assemble(self, key, outputs, steps, vals, arrays, plan_consts, profile, convs, folded) -> Plan:
        constants = self.graph.constants
        slot_of: dict[str, int] = {}
        names: list[str] = []

        def slot(name: str) -> int:
            if name not in slot_of:
                slot_of[name] = len(names)
                names.append(name)
            return slot_of[name]

        for n in arrays:
            slot(n)
        for _node, ins, outs in steps:
            for n in ins:
                if n:
                    slot(n)
            for n in outs:
                if n:
                    slot(n)
        for n in outputs:
            slot(n)
        template: list[Any] = [None] * len(names)
        for n, i in slot_of.items():
            v = vals.get(n)
            if v is not None and v.static:
                template[i] = self._device_constant(n, v.value, plan_consts)
            elif v is None and n in constants:
                template[i] = self._device_constant(n, constants[n], plan_consts)
        last_use: dict[str, int] = {}
        for idx, (_node, ins, outs) in enumerate(steps):
            for n in ins:
                if n:
                    last_use[n] = idx
            for n in outs:
                if n and n not in last_use:
                    last_use[n] = idx  # produced, maybe never read
        keep = set(outputs)
        free_at: dict[int, list[int]] = {}
        for n, idx in last_use.items():
            if n in keep or template[slot_of[n]] is not None:
                continue
            free_at.setdefault(idx, []).append(slot_of[n])
        # feeds nobody reads
        for n in arrays:
            if n not in last_use and n not in keep:
                free_at.setdefault(0, []).append(slot_of[n])
        plan_steps = []
        for idx, (node, ins, outs) in enumerate(steps):
            used_outs = tuple(slot_of[n] if n else -1 for n in outs)
            plan_steps.append(
                PlanStep(node, node.impl.fn, tuple(slot_of[n] if n else -1 for n in ins), used_outs, tuple(free_at.get(idx, ())))
            )
        value_info = {slot_of[n]: (v.shape, np.dtype(v.dtype)) for n, v in vals.items() if n in slot_of}
        return Plan(
            signature=key,
            output_names=tuple(outputs),
            steps=plan_steps,
            slot_names=names,
            template=template,
            feed_slots={n: slot_of[n] for n in arrays},
            output_slots=[slot_of[n] for n in outputs],
            value_info=value_info,
            profile=profile,
            convs=convs,
            folded_nodes=folded,
            matmul_allow_tf32=bool(self.model_info and self.model_info.matmul_allow_tf32),
        )


def _last_reads(nodes: Sequence[NodeInfo], outputs: Sequence[str]) -> dict[str, int]:
    """Value name -> the index in ``nodes`` of its last reader; the outputs wanted are read after all."""
    last: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for name in node.inputs:
            if name:
                last[name] = i
    for name in outputs:
        last[name] = len(nodes)
    return last

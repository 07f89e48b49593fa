"""Fusion decisions at ``optimize``: find the model's fusion units (:mod:`convpass.core.fusion_units`,
on the onnx-ir graph through :class:`IrView`), decide per device and shape profile whether each
runs fused, and record that in the model (``convpass.fusions``, :mod:`convpass.core.annotation`).

Rules:

1. On a GPU (a backend that measures, with the cuda backend usable), every unit is timed for each
   profile's shapes: its nodes as a model of their own (inputs: the unit's input and the operands
   it reads from outside; its constants; the shape inputs of its Reshapes / Expands as the
   constants the profile makes them), compiled by the cuda executor with the unit fused and with
   it unfused, the compiled launches captured once as a CUDA graph and the graph replayed
   (:func:`convpass.tuning.harness.time_launches`: warm clocks, groups, median). Fused is timed
   on channels-first and on channels-last input (the normalized tensor, or a bias unit's conv
   input), unfused on channels-first (its ops' own memory format). A bias unit's conv runs
   untuned there (cuDNN's heuristic): forced, its bias moves whatever the conv would do. The unit runs fused when the fused step is no slower than the unfused launches on
   channels-first input; all three times are recorded. Units of one structure and shapes are
   timed once.
2. Without a GPU (or when the unit cannot be cut out: a shape input computed some other way) the
   decision is recorded as ``not measured``: the executor then applies the kind's rule
   (:data:`convpass.core.fusion_units.RULES`).
3. The layout plan treats the units that run fused (measured so, or not measured: the rule fuses
   every normalization unit) as one node each that reads and writes either memory format
   (:func:`convpass.compiler.passes.plan_layouts.plan_layouts`'s ``units``); a unit timed fused in
   both formats costs its time in the format the plan gives it (:func:`fused_unit_costs`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from convpass.core.annotation import ANNOTATED_OPS, MEASURED, NOT_MEASURED, FusionDecision, FusionRecord, fusion_entries
from convpass.core.annotation import DOMAIN as ANNOTATED
from convpass.core.fusion_units import RULES, BiasUnit, GraphView, NormUnit, unit_key
from convpass.core.fusion_units import find_units as find_graph_units
from convpass.kernels import group_norm

logger = logging.getLogger("convpass")

__all__ = ["IrView", "Timer", "decide_fusions", "find_units", "fused_nodes", "fused_unit_costs", "gpu_timer", "unit_model", "write_record"]

Timer = Callable[[onnx.ModelProto, str, bool, bool], float]  # (unit model, input name, fused, channels-last) -> ms


class IrView(GraphView):
    """An onnx-ir graph seen by the unit rules, with the value shapes of one shape profile
    (``shapes``: value name -> dims, as :mod:`convpass.compiler.passes.resolve_shapes` records them)."""

    def __init__(self, graph: ir.Graph, shapes: Mapping[str, Sequence[Any]]) -> None:
        self.graph = graph
        self.shapes = shapes
        self._nodes = list(graph)
        self._opset = int(graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 0)))

    def nodes(self) -> Sequence[ir.Node]:
        return self._nodes

    def op(self, node: ir.Node) -> str:
        if node.domain == ANNOTATED and node.op_type in ANNOTATED_OPS:
            return ANNOTATED_OPS[node.op_type]  # a tuned conv runs as the standard op
        return node.op_type if node.domain in ("", "ai.onnx") else ""

    def opset(self, node: ir.Node) -> int:
        return int(node.version) if node.version is not None else self._opset

    def attr(self, node: ir.Node, name: str, default: Any = None) -> Any:
        a = node.attributes.get(name)
        return default if a is None else a.value

    def name(self, node: ir.Node) -> str:
        return node.name or (node.outputs[0].name if node.outputs else "")

    def inputs(self, node: ir.Node) -> Sequence[ir.Value | None]:
        return list(node.inputs)

    def outputs(self, node: ir.Node) -> Sequence[ir.Value | None]:
        return list(node.outputs)

    def readers(self, value: ir.Value) -> list[ir.Node]:
        return list(dict.fromkeys(user for user, _ in value.uses()))

    def is_output(self, value: ir.Value) -> bool:
        return value.is_graph_output()

    def const(self, value: ir.Value) -> np.ndarray | None:
        t = ir.convenience.get_const_tensor(value)
        return None if t is None else t.numpy()

    def shape(self, value: ir.Value) -> tuple[int, ...] | None:
        dims = self.shapes.get(value.name) if value.name else None
        if dims is None and value.shape is not None:
            dims = tuple(value.shape)
        if dims is None or not all(isinstance(d, int) for d in dims):
            return None
        return tuple(int(d) for d in dims)

    def dtype(self, value: ir.Value) -> np.dtype | None:
        """The value's element type; one the graph does not record is its producer's first input's
        (the ops units are made of keep their input's type; a Cast's is its ``to``)."""
        for _ in range(64):  # a chain of untyped values, walked back to a typed one
            if value.dtype is not None:
                try:
                    return np.dtype(value.dtype.numpy())
                except (TypeError, ValueError):
                    return None
            node = value.producer()
            if node is None:
                return None
            if node.op_type == "Cast":
                to = self.attr(node, "to")
                return None if to is None else np.dtype(helper.tensor_dtype_to_np_dtype(int(to)))
            first = next((v for v in node.inputs if v is not None), None)
            if first is None or node.op_type in ("Shape", "Size"):
                return None
            value = first
        return None


Unit = NormUnit | BiasUnit


def find_units(model: ir.Model, value_shapes: Sequence[Mapping[str, Sequence[Any]]]) -> list[list[Unit]]:
    """The fusion units of ``model``, per shape profile (``value_shapes``: one mapping each; one
    empty mapping when there are none)."""
    return [find_graph_units(IrView(model.graph, shapes)) for shapes in (value_shapes or [{}])]


def _input_of(unit: Unit) -> ir.Value:
    """The value a unit's timing stores channels-last: its normalized input, or its conv's input."""
    return unit.x if isinstance(unit, NormUnit) else unit.conv.inputs[0]


def unit_model(model: ir.Model, unit: Unit, view: IrView) -> tuple[onnx.ModelProto | None, str]:
    """The unit's nodes as a model of their own for one profile's shapes (rule 1), or None and why."""
    produced = {v for n in unit.nodes for v in n.outputs}
    inits: dict[str, onnx.TensorProto] = {}
    inputs: dict[str, onnx.ValueInfoProto] = {}
    for node in unit.nodes:
        for k, v in enumerate(node.inputs):
            if v is None or v in produced or v.name in inits or v.name in inputs:
                continue
            const = view.const(v)
            if const is not None:
                inits[v.name] = numpy_helper.from_array(np.asarray(const), v.name)
            elif view.op(node) in ("Reshape", "Expand") and k == 1 and view.shape(node.outputs[0]) is not None:
                inits[v.name] = numpy_helper.from_array(np.asarray(view.shape(node.outputs[0]), np.int64), v.name)
            elif view.shape(v) is not None and view.dtype(v) is not None:
                elem = helper.np_dtype_to_tensor_dtype(view.dtype(v))
                inputs[v.name] = helper.make_tensor_value_info(v.name, elem, view.shape(v))
            else:
                return None, f"input {v.name!r} of node {view.name(node)!r} has no known shape"
    out = unit.output if isinstance(unit, NormUnit) else unit.nodes[-1].outputs[0]  # a bias unit ends at its element-wise node
    if view.shape(out) is None or view.dtype(out) is None:
        return None, f"output {out.name!r} has no known shape"
    nodes = [ir.serde.serialize_node(n) for n in unit.nodes]
    graph = helper.make_graph(nodes, "unit", list(inputs.values()),
                              [helper.make_tensor_value_info(out.name, helper.np_dtype_to_tensor_dtype(view.dtype(out)), view.shape(out))],
                              list(inits.values()))
    opsets = [helper.make_opsetid(d, v) for d, v in model.graph.opset_imports.items() if d in ("", "ai.onnx")]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9), ""


def _signature(unit: Unit, view: IrView) -> tuple:
    """What decides a unit's times: its ops and attributes, the shapes and types it reads, and the
    revision of the fused kernels that run it (:data:`convpass.kernels.group_norm.REVISION`)."""
    ops = tuple((view.op(n), tuple(sorted((k, repr(a.value)) for k, a in n.attributes.items()))) for n in unit.nodes)
    produced = {v for n in unit.nodes for v in n.outputs}
    reads = tuple((view.shape(v), str(view.dtype(v))) for n in unit.nodes for v in n.inputs if v is not None and v not in produced)
    return (unit.kind, ops, reads) if unit.kind != NormUnit.kind else (unit.kind, ops, reads, group_norm.REVISION)


def decide_fusions(model: ir.Model, units: Sequence[Sequence[Unit]], value_shapes: Sequence[Mapping[str, Sequence[Any]]],
                   device: str, timer: Timer | None, notes: list[str], store: Any = None,
                   fingerprint: Any = None, timed_now: list[str] | None = None) -> dict[str, tuple[str, tuple[str, ...], list[FusionDecision]]]:
    """Every unit's decisions for ``device`` (rules 1-2); ``timer``: None records ``not measured``
    unless ``store`` (the tuning cache) holds the unit's timings on ``fingerprint``, which a
    measured unit's timings are written to: a cached re-run times nothing and writes the same
    model. ``timed_now`` collects the signatures timed in this call (not found in ``store``)."""
    record: dict[str, tuple[str, tuple[str, ...], list[FusionDecision]]] = {}
    timed: dict[tuple, dict[str, float] | None] = {}
    failed: list[str] = []
    for profile, profile_units in enumerate(units):
        view = IrView(model.graph, value_shapes[profile] if profile < len(value_shapes) else {})
        for unit in profile_units:
            times = None
            sig = _signature(unit, view)
            if sig not in timed:
                timed[sig] = _stored_or_measured(model, unit, view, sig, timer, failed, store, fingerprint, timed_now)
            times = timed[sig]
            if times is None:
                decision = FusionDecision(device, profile, None, NOT_MEASURED)
            else:
                decision = FusionDecision(device, profile, times["fused_nchw"] <= times["unfused_nchw"], MEASURED, times)
            entry = record.setdefault(unit_key(unit.names), (unit.kind, unit.names, []))
            entry[2].append(decision)
    if failed:
        notes.append(f"{len(failed)} fusion unit(s) could not be timed ({'; '.join(failed[:3])}): recorded as not measured, "
                     "the executor applies the rule")
    return record


def signature_text(sig: tuple) -> str:
    """A unit signature as the tuning cache keys it: a hash of its kind, ops, attributes and shapes."""
    return "fusion-" + hashlib.sha256(repr(sig).encode()).hexdigest()[:32]


def _stored_or_measured(model: ir.Model, unit: Unit, view: IrView, sig: tuple, timer: Timer | None, failed: list[str],
                        store: Any, fingerprint: Any, timed_now: list[str] | None = None) -> dict[str, float] | None:
    """The unit's timings from the tuning cache, else timed now (and kept there), else None."""
    key = signature_text(sig)
    if store is not None and fingerprint is not None:
        found = store.get_fusion(fingerprint, key, required=("fused_nchw", "unfused_nchw"))
        if found is not None:
            return found
    if timer is None:
        return None
    times = _measure(model, unit, view, timer, failed)
    if timed_now is not None:
        timed_now.append(key)
    if times is not None and store is not None and fingerprint is not None and not getattr(store, "readonly", False):
        store.put_fusion(fingerprint, key, times)
    return times


def _measure(model: ir.Model, unit: Unit, view: IrView, timer: Timer, failed: list[str]) -> dict[str, float] | None:
    proto, why = unit_model(model, unit, view)
    if proto is None:
        failed.append(f"{unit.names[0]}: {why}")
        return None
    x = _input_of(unit).name
    try:
        return {
            "fused_nchw": timer(proto, x, True, False),
            "fused_nhwc": timer(proto, x, True, True),
            "unfused_nchw": timer(proto, x, False, False),
        }
    except Exception as e:  # noqa: BLE001  (a unit that does not run alone: not measured, said once)
        failed.append(f"{unit.names[0]}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        return None


def fused_nodes(units: Sequence[Unit], record: Mapping[str, tuple[str, tuple[str, ...], Sequence[FusionDecision]]], device: str,
                profile: int) -> list[list[ir.Node]]:
    """The node lists of the normalization units that run fused on ``device`` for ``profile`` (rule
    3; a bias unit changes no node's format)."""
    out = []
    for unit in units:
        if unit.kind != "norm":
            continue
        entry = record.get(unit_key(unit.names))
        decision = next((d for d in entry[2] if d.device == device and d.profile == profile), None) if entry else None
        fused = unit.kind in RULES if decision is None or decision.fused is None else decision.fused
        if fused:
            out.append(list(unit.nodes))
    return out


def fused_unit_costs(units: Sequence[Unit], record: Mapping[str, tuple[str, tuple[str, ...], Sequence[FusionDecision]]], device: str,
                     profile: int) -> dict[ir.Node, dict[str, float]]:
    """The time per memory format of each normalization unit that runs fused on ``device`` for
    ``profile`` and was timed in both (rule 1's ``fused_nchw`` and ``fused_nhwc``), by the unit's
    first node: the layout plan's cost of the step in the format it runs in (rule 3)."""
    out = {}
    for unit in units:
        entry = record.get(unit_key(unit.names)) if unit.kind == "norm" else None
        decision = next((d for d in entry[2] if d.device == device and d.profile == profile), None) if entry else None
        if decision is None or not decision.fused:
            continue
        times = decision.times_ms
        if all(isinstance(times.get(k), (int, float)) for k in ("fused_nchw", "fused_nhwc")):
            out[unit.nodes[0]] = {"nchw": float(times["fused_nchw"]), "nhwc": float(times["fused_nhwc"])}
    return out


def write_record(model: ir.Model, record: Mapping[str, tuple[str, tuple[str, ...], Sequence[FusionDecision]]]) -> None:
    """The record into the model's metadata (nothing when there are no units)."""
    if not record:
        return
    full = FusionRecord({k: (kind, names, tuple(ds)) for k, (kind, names, ds) in record.items()})
    model.metadata_props.update(fusion_entries(full))


def gpu_timer() -> Timer:
    """The GPU timer of rule 1. It asks for the cuda backend only when a unit is timed, so an
    optimize whose unit timings are all in the tuning cache imports no CuPy; where the backend
    cannot run, timing fails and the unit is recorded as not measured, with a note."""

    def timer(proto: Any, x_name: str, fused: bool, channels_last: bool) -> float:
        from convpass.native.cuda import unavailable_reason

        why = unavailable_reason()
        if why is not None:
            raise RuntimeError(f"the cuda backend cannot run here: {why}")
        from convpass.compiler.fusion_timing import time_unit

        return time_unit(proto, x_name, fused, channels_last)

    return timer

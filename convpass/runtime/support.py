"""What of a model the executor can run, and the inlining that lets it run more.

:func:`check_support` lists every op (type, domain, opset) with no implementation in the op
library (:mod:`convpass.ops.registry`) and every element type it does not support, at once, in a
:class:`SupportReport`. :func:`prepare_model` first inlines model-local functions (except the
``ai.convpass`` convs, which run natively) and then, while that helps, the schema functions of
ops with no kernel here; an inlined model that fails ``onnx.checker`` is not taken.
"""

from __future__ import annotations

import dataclasses

import onnx
import onnx.external_data_helper
import onnx.inliner

from convpass.core import annotation
from convpass.ops.registry import SUPPORTED_ELEM_TYPES, elem_type_name, lookup, normalize_domain


@dataclasses.dataclass
class SupportReport:
    """What of a model this executor cannot run."""

    # (op_type, domain, opset) -> node names
    unsupported_ops: dict[tuple[str, str, int], list[str]] = dataclasses.field(default_factory=dict)
    # type description -> where it occurs
    unsupported_types: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.unsupported_ops and not self.unsupported_types

    def message(self) -> str:
        lines = []
        if self.unsupported_ops:
            n = sum(len(v) for v in self.unsupported_ops.values())
            lines.append(f"model uses {len(self.unsupported_ops)} operator(s) the convpass executor does not implement ({n} node(s)):")
            for (op, domain, opset), names in sorted(self.unsupported_ops.items()):
                shown = ", ".join(repr(x) for x in names[:5]) + (f", ... (+{len(names) - 5} more)" if len(names) > 5 else "")
                lines.append(f"  {op} (domain {domain or 'ai.onnx'}, opset {opset}): node(s) {shown}")
        if self.unsupported_types:
            lines.append("model uses element types the convpass executor does not support:")
            for t, where in sorted(self.unsupported_types.items()):
                shown = ", ".join(repr(x) for x in where[:5]) + (f", ... (+{len(where) - 5} more)" if len(where) > 5 else "")
                lines.append(f"  {t}: {shown}")
        return "\n".join(lines)


def model_opsets(model: onnx.ModelProto) -> dict[str, int]:
    """Domain (normalized) -> the opset the model imports."""
    return {normalize_domain(o.domain): int(o.version) for o in model.opset_import}


def node_name(node: onnx.NodeProto, index: int) -> str:
    """The name the executor gives a node: its own, else its first output's, else ``<op>_<index>``."""
    return node.name or (node.output[0] if node.output and node.output[0] else f"{node.op_type}_{index}")


def _type_problem(tp: onnx.TypeProto) -> str | None:
    kind = tp.WhichOneof("value")
    if kind is None:
        return None
    if kind != "tensor_type":
        return f"non-tensor type ({kind})"
    et = tp.tensor_type.elem_type
    if et != onnx.TensorProto.UNDEFINED and et not in SUPPORTED_ELEM_TYPES:
        return elem_type_name(et)
    return None


def _node_type_problems(node: onnx.NodeProto) -> list[str]:
    problems = []
    for a in node.attribute:
        if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            problems.append("subgraph attribute")
        elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type not in SUPPORTED_ELEM_TYPES:
            problems.append(elem_type_name(a.t.data_type))
        elif a.type == onnx.AttributeProto.SPARSE_TENSOR:
            problems.append("sparse tensor")
        elif a.type in (onnx.AttributeProto.STRING, onnx.AttributeProto.STRINGS) and node.op_type == "Constant":
            problems.append("STRING")
    if node.op_type in ("Cast", "EyeLike", "RandomNormalLike") and node.domain in ("", "ai.onnx"):
        for a in node.attribute:
            if a.name in ("to", "dtype") and a.i not in SUPPORTED_ELEM_TYPES:
                problems.append(elem_type_name(a.i))
    return problems


def check_support(model: onnx.ModelProto) -> SupportReport:
    """The ops and element types of ``model``'s main graph this executor cannot run."""
    report = SupportReport()
    opsets = model_opsets(model)
    for i, node in enumerate(model.graph.node):
        name = node_name(node, i)
        domain = normalize_domain(node.domain)
        opset = opsets.get(domain, 1 if domain == annotation.DOMAIN else 0)
        op_type = annotation.standard_op_type(node)
        if lookup(op_type, domain, opset) is None:
            report.unsupported_ops.setdefault((op_type, domain, opset), []).append(name)
        for p in _node_type_problems(node):
            report.unsupported_types.setdefault(p, []).append(f"node {name}")
    g = model.graph
    for kind, infos in (("input", g.input), ("output", g.output), ("value", g.value_info)):
        for vi in infos:
            p = _type_problem(vi.type)
            if p:
                report.unsupported_types.setdefault(p, []).append(f"{kind} {vi.name}")
    for init in g.initializer:
        if init.data_type not in SUPPORTED_ELEM_TYPES:
            report.unsupported_types.setdefault(elem_type_name(init.data_type), []).append(f"initializer {init.name}")
    if g.sparse_initializer:
        report.unsupported_types.setdefault("sparse tensor", []).extend(f"initializer {s.values.name}" for s in g.sparse_initializer)
    return report


def _schema_function_ops(model: onnx.ModelProto, report: SupportReport) -> list[tuple[str, str]]:
    """Unsupported ops that ONNX defines as functions of other ops (they can be inlined)."""
    out = []
    for op, domain, opset in report.unsupported_ops:
        try:
            schema = onnx.defs.get_schema(op, opset, domain)
        except onnx.defs.SchemaError:
            continue
        if schema.has_function or schema.has_context_dependent_function:
            out.append((domain, op))
    return out


def prepare_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, SupportReport]:
    """Inline what can be inlined (local functions, schema functions of ops with no kernel) and check."""
    keep = [(annotation.DOMAIN, op) for op in annotation.ANNOTATED_OPS]
    if any((f.domain, f.name) not in keep for f in model.functions):
        model = onnx.inliner.inline_selected_functions(model, keep, exclude=True)
    report = check_support(model)
    for _ in range(4):  # expanded bodies may use ops that are functions themselves
        if report.ok:
            break
        ids = _schema_function_ops(model, report)
        if not ids:
            break
        try:
            inlined = onnx.inliner.inline_selected_functions(model, ids, exclude=False, inline_schema_functions=True)
            # the inliner can leave references to unset attributes with defaults behind: keep only valid results
            _check_in_memory(inlined)
        except Exception:  # noqa: BLE001  (inliner failure: report the ops as unsupported)
            break
        new_report = check_support(inlined)
        if sum(map(len, new_report.unsupported_ops.values())) >= sum(map(len, report.unsupported_ops.values())) and (
            new_report.unsupported_ops.keys() == report.unsupported_ops.keys()
        ):
            break
        model, report = inlined, new_report
    return model, report


def _check_in_memory(model: onnx.ModelProto) -> None:
    """``onnx.checker.check_model`` of ``model`` in memory. The main graph's initializers stored
    outside (the executor maps them; the checker, with no folder, would look in the working one)
    are checked as graph inputs of their type and shape: taken off for the check (they hold no
    data, so this copies nothing large), then put back at the end of the list."""
    g = model.graph
    at = [i for i, t in enumerate(g.initializer) if onnx.external_data_helper.uses_external_data(t)]
    if not at:
        onnx.checker.check_model(model)
        return
    external = [onnx.TensorProto.FromString(g.initializer[i].SerializeToString()) for i in at]
    inputs = {i.name for i in g.input}
    added = [onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external if t.name not in inputs]
    for i in reversed(at):
        del g.initializer[i]
    g.input.extend(added)
    try:
        onnx.checker.check_model(model)
    finally:
        del g.input[len(g.input) - len(added):]
        g.initializer.extend(external)


def is_supported(model: onnx.ModelProto) -> bool:
    return prepare_model(model)[1].ok

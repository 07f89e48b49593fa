"""A tuned model back to the standard model it was tuned from, with its old decisions read out.

Rules:

1. Every annotated conv (domain ``ai.convpass``, at any depth: If / Loop / Scan bodies too) becomes
   the standard op it runs (:data:`convpass.core.annotation.ANNOTATED_OPS`), its decision
   attributes removed, its standard attributes and inputs kept (a bias-less one keeps its two).
2. The ``ai.convpass`` model-local functions, the ``ai.convpass`` opset import and the
   ``convpass.*`` metadata are removed: what is left is what ``optimize`` read the first time.
3. :attr:`StripAnnotationsPass.previous` keeps what the model recorded (its metadata and every
   conv's decisions, as :func:`convpass.core.annotation.read_annotations` reads them) for the
   caller to say what re-tuning changed (:func:`changes`).
"""

from __future__ import annotations

import dataclasses

import onnx
import onnx_ir as ir

from convpass.core import annotation

__all__ = ["Previous", "StripAnnotationsPass", "changes", "is_tuned"]


@dataclasses.dataclass(frozen=True)
class Previous:
    """A tuned model's recorded metadata and decisions (node name -> its decision tables)."""

    info: annotation.ModelInfo
    decisions: dict[str, annotation.NodeAnnotation]


def _annotated(model: ir.Model) -> list[ir.Node]:
    return [n for n in ir.traversal.RecursiveGraphIterator(model.graph)
            if n.domain == annotation.DOMAIN and n.op_type in annotation.ANNOTATED_OPS]


def is_tuned(model: ir.Model) -> bool:
    """Whether ``model`` carries convpass decisions (annotated convs or convpass metadata)."""
    return bool(_annotated(model)) or any(k.startswith(annotation.META_PREFIX) for k in model.metadata_props)


def _metadata(model: ir.Model) -> onnx.ModelProto:
    """A ModelProto holding only the model's metadata: what :func:`annotation.read_model_info` reads."""
    proto = onnx.ModelProto()
    for key, value in model.metadata_props.items():
        proto.metadata_props.add(key=key, value=value)
    return proto


class StripAnnotationsPass(ir.passes.InPlacePass):
    """Turns a tuned model back into the standard one (module rules)."""

    def __init__(self) -> None:
        super().__init__()
        self.previous: Previous | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        info = annotation.read_model_info(_metadata(model))
        nodes = _annotated(model)
        if info is not None:
            n_profiles = max(1, len(info.profiles))
            read = [annotation.read_node(ir.serde.serialize_node(n), n_profiles, info.tables) for n in nodes]
            self.previous = Previous(info, {a.node_name: a for a in read})
        for node in nodes:
            node.op_type = annotation.ANNOTATED_OPS[node.op_type]
            node.domain = ""
            for name in (*annotation.DECISION_ATTRIBUTES, *annotation.PRECISION_ATTRIBUTES, annotation.LEVEL_ATTRIBUTE):
                node.attributes.pop(name, None)
        for key in [k for k in model.functions if k[0] == annotation.DOMAIN]:
            del model.functions[key]
        model.opset_imports.pop(annotation.DOMAIN, None)
        for key in [k for k in model.metadata_props if k.startswith(annotation.META_PREFIX)]:
            del model.metadata_props[key]
        return ir.passes.PassResult(model, modified=bool(nodes) or info is not None)


def _what(d: annotation.ConvDecision) -> str:
    runs = f"engine {d.engine}" if d.engine else d.algo
    return f"{runs} {d.memory_format} {d.math_mode}" if not d.is_auto else "auto"


def changes(previous: Previous, model: ir.Model, limit: int = 4) -> list[str]:
    """What re-tuning changed, in report lines: the device and profiles if they differ, then how many
    decisions changed (the old table of the same device, else the first), naming the first few."""
    now_info = annotation.read_model_info(_metadata(model))
    if now_info is None:
        return []
    lines = []
    old, new = previous.info, now_info
    if list(old.devices) != list(new.devices):
        lines.append(f"re-tuned for {', '.join(new.devices) or 'no device'} (it was tuned for {', '.join(old.devices) or 'no device'})")
    old_profiles, new_profiles = [p.name for p in old.profiles], [p.name for p in new.profiles]
    if old_profiles != new_profiles:
        lines.append(f"profiles now {new_profiles} (were {old_profiles})")
    table = (old.table_of(new.devices[0]) if new.devices else None) or 0
    changed, compared, added = [], 0, []
    now = _annotated(model)
    for node in now:
        before = previous.decisions.get(node.name)
        if before is None:
            added.append(node.name)
            continue
        after = annotation.read_node(ir.serde.serialize_node(node), max(1, len(new.profiles)), new.tables).decisions
        for i, d in enumerate(after):
            if table >= len(before.tables) or i >= len(before.tables[table]) or (old_profiles and old_profiles != new_profiles):
                continue  # other profiles: nothing to compare with
            compared += 1
            was = before.tables[table][i]
            if _what(was) != _what(d):
                label = new.profiles[i].name if i < len(new.profiles) else str(i)
                changed.append(f"{node.name} [{label}]: {_what(was)} -> {_what(d)}")
    gone = sorted(set(previous.decisions) - {n.name for n in now})
    line = f"re-tuned: {len(changed)} of {compared} recorded decisions changed"
    if changed:
        line += " (" + "; ".join(changed[:limit]) + (f"; and {len(changed) - limit} more" if len(changed) > limit else "") + ")"
    if added:
        line += f"; newly tuned: {', '.join(added[:limit])}" + (" ..." if len(added) > limit else "")
    if gone:
        line += f"; no longer tuned: {', '.join(gone[:limit])}" + (" ..." if len(gone) > limit else "")
    lines.append(line)
    return lines

"""Shapes inside the bodies of If, Loop and Scan, where ONNX shape inference alone does not reach.

Rules (on the serialized model :mod:`convpass.compiler.passes.resolve_shapes` infers, per profile):

1. If branches need nothing: ONNX's inference reaches them (outer-scope values carry their shapes in).
2. Loop and Scan bodies: ONNX types a body's inputs from the node's inputs, but not their shapes. Each
   body input is given the shape of what feeds it (Loop: the trip counter and condition are scalars,
   a carried value has its initial value's shape; Scan: a state has its initial value's shape, a scan
   element its scan input's shape without the scan axis) and inference runs again, as long as that
   teaches it something new (a body inside a body needs one round more).
3. A Loop whose carried value leaves a trip with another shape than it came in with has no one shape
   for the values of its body: they are left unresolved (:attr:`BodyShapes.unresolved` says why).
4. The shapes of every body's values are gathered by name, with the main graph's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import onnx

__all__ = ["BodyShapes", "bodies", "value_names"]

Dims = tuple  # of int | str | None


def bodies(graph: onnx.GraphProto) -> Iterator[tuple[onnx.NodeProto, str, onnx.GraphProto]]:
    """(node, attribute name, sub-graph) of every sub-graph, at any depth, outer ones first."""
    for node in graph.node:
        for a in node.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield node, a.name, g
                yield from bodies(g)


def value_names(graph: onnx.GraphProto) -> set[str]:
    """Every value a graph and the graphs inside it define: inputs, initializers, node outputs."""
    names = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(o for o in node.output if o)
    for _, _, g in bodies(graph):
        names |= value_names(g)
    return names


def _dims(vi: onnx.ValueInfoProto) -> Dims | None:
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)


def set_dims(vi: onnx.ValueInfoProto, dims: Sequence[int | str | None]) -> None:
    """Write ``dims`` into a tensor value info's shape: ints as values, strings as symbols, None unknown."""
    shape = vi.type.tensor_type.shape
    shape.ClearField("dim")
    for d in dims:
        if isinstance(d, int):
            shape.dim.add().dim_value = d
        elif isinstance(d, str):
            shape.dim.add().dim_param = d
        else:
            shape.dim.add()


class BodyShapes:
    """Rules 2 to 4 on one serialized model, which it edits in place (body inputs and value_info)."""

    def __init__(self, proto: onnx.ModelProto) -> None:
        self.proto = proto
        # what each body declares, restored before every profile's inference
        self._declared = [(g, [onnx.ValueInfoProto.FromString(v.SerializeToString()) for v in g.input]) for _, _, g in bodies(proto.graph)]
        self.unresolved: dict[str, str] = {}  # value name -> why its shape is not known

    @property
    def loops(self) -> bool:
        """Whether the model has Loop or Scan bodies (If branches need no help: rule 1)."""
        return any(node.op_type in ("Loop", "Scan") for node, _, _ in bodies(self.proto.graph))

    def reset(self) -> None:
        for g, declared in self._declared:
            del g.input[:]
            g.input.extend(onnx.ValueInfoProto.FromString(v.SerializeToString()) for v in declared)
            del g.value_info[:]
        self.unresolved = {}

    def seed(self, shapes: Mapping[str, Dims]) -> bool:
        """Rule 2: body inputs shaped from what feeds them; whether any shape was new."""
        changed = False
        for node, _, g in bodies(self.proto.graph):
            for vi, dims in zip(g.input, _feeding(node, g, shapes)):
                if dims is not None and _dims(vi) != dims:
                    set_dims(vi, dims)
                    changed = True
        return changed

    def collect(self, inferred: onnx.ModelProto, shapes: dict[str, Dims], types: dict[str, int]) -> None:
        """Rules 3 and 4: every body's shapes into ``shapes`` (and element types into ``types``),
        the values of a Loop whose carried shapes change from trip to trip out of it."""
        for _node, _, g in bodies(inferred.graph):
            for vi in [*g.input, *g.value_info, *g.output]:
                if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                    types.setdefault(vi.name, vi.type.tensor_type.elem_type)
                dims = _dims(vi)
                if dims is not None and vi.name not in shapes:
                    shapes[vi.name] = dims
        for node, _, g in bodies(inferred.graph):
            if node.op_type != "Loop":
                continue
            carried = len(node.input) - 2
            for vin, vout in zip(g.input[2:2 + carried], g.output[1:1 + carried]):
                before, after = shapes.get(vin.name), shapes.get(vout.name)
                if before is not None and after is not None and before != after:
                    why = (f"the carried value {vin.name!r} leaves a trip as {_text(after)} after coming in as {_text(before)}, "
                           "so the values of the body have no one shape")
                    for name in value_names(g):
                        self.unresolved.setdefault(name, why)
                        shapes.pop(name, None)
                    break


def _text(dims: Dims) -> str:
    return "x".join("?" if d is None else str(d) for d in dims)


def _feeding(node: onnx.NodeProto, g: onnx.GraphProto, shapes: Mapping[str, Dims]) -> list[Dims | None]:
    """The shape each input of ``node``'s body ``g`` gets from what feeds it (rule 2); None: unknown."""
    if node.op_type == "Loop":
        return [(), ()] + [shapes.get(name) for name in node.input[2:]]
    if node.op_type == "Scan" and not any(a.name == "batch_axis" for a in node.attribute):  # opset 9 on
        n_scan = next((a.i for a in node.attribute if a.name == "num_scan_inputs"), 0)
        n_state = len(node.input) - n_scan
        axes = next((list(a.ints) for a in node.attribute if a.name == "scan_input_axes"), [0] * n_scan)
        out: list[Dims | None] = [shapes.get(name) for name in node.input[:n_state]]
        for name, axis in zip(node.input[n_state:], axes):
            dims = shapes.get(name)
            out.append(None if dims is None or not dims else dims[: axis % len(dims)] + dims[axis % len(dims) + 1:])
        return out
    return [None] * len(g.input)

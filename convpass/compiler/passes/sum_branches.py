"""Sum a stack of branches without stacking them: a ReduceSum over the axis a Concat of Unsqueezes
built becomes Adds of the branches (selective-kernel attention's weighted sum of its paths).

Exported selective-kernel blocks (timm's ``SelectiveKernel``) stack their ``k`` paths as
``S = Concat(Unsqueeze(x_1, [a]), ..., Unsqueeze(x_k, [a]), axis=a)`` (``[N, k, C, H, W]``) and
sum them twice: ``ReduceSum(S, [a])`` feeds the attention, ``ReduceSum(Mul(S, W), [a])`` with the
attention weights ``W`` (``[N, k, C, 1, 1]``, a softmax over ``a``) is the block's output. On the
GPU the Concat is a copy of every path and each ReduceSum a reduction kernel over an axis of ``k``
elements, and the layout plan keeps the convs around them in NCHW (the 5-D ops take no other
format). Since ``sum_i S[.., i, ..] = x_1 + ... + x_k`` and ``sum_i (S * W)[.., i, ..] = x_1 * W_1 +
... + x_k * W_k`` with ``W_i = Squeeze(Split(W, a)_i, [a])``, the rewrite computes the same values
from 4-D element-wise ops only: the convs around it can take either format, and the weighted sum
is one fused element-wise kernel.

Rules:

1. A standard ``ReduceSum`` with ``keepdims=0`` over one constant axis ``a`` (after normalizing a
   negative axis) whose data input is either ``S`` above (every Concat input an ``Unsqueeze`` of
   exactly ``[a]``, the Concat on axis ``a``) or a ``Mul`` of ``S`` and ``W`` (either order), is
   replaced by ``((x_1 + x_2) + x_3) + ...`` or ``((x_1 * W_1 + x_2 * W_2) + ...)``, in branch
   order (for two branches the same rounding as the reduction).
2. The ``Mul`` form applies only where every shape profile gives ``W`` the rank of ``S`` and ``k``
   on axis ``a``, and gives the product ``S``'s dims, all known (so ``W`` broadcasts into ``S``
   without growing it, and each ``W_i`` into its branch; ``W``'s other dims may be unknown, as
   inference leaves a Reshape's target computed from Shape arithmetic); ``W`` is split into views (``Split`` with constant sizes, ``Squeeze`` with
   constant axes: opset 13 and later). Anything else does not apply and is left as it is.
3. The ReduceSum's output keeps its name, type and shape; the new values get this pass's names and
   their shapes and types in every profile's maps (``convpass.value_shapes`` /
   ``convpass.value_types``), which the layout planner prices transposes with. A ReduceSum whose
   output is a graph output is left alone. ``S`` and the ``Mul`` go when nothing else reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from convpass.compiler.passes import state
from convpass.compiler.passes.state import VALUE_SHAPES_KEY, VALUE_TYPES_KEY

__all__ = ["SumBranchesPass"]

_MIN_OPSET = 13  # ReduceSum's, Split's and Squeeze's axes and sizes as inputs


class SumBranchesPass(ir.passes.InPlacePass):
    """Rewrites branch sums over a stacked axis as element-wise sums (module rules). ``rewritten``:
    the names of the ReduceSum nodes replaced by the last call."""

    def __init__(self) -> None:
        super().__init__()
        self.rewritten: list[str] = []

    def requires(self, model: ir.Model) -> None:
        state.require(self, model, state.SHAPES_RESOLVED)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.rewritten = []
        if model.opset_imports.get("", 1) < _MIN_OPSET:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        shapes = model.meta.get(VALUE_SHAPES_KEY) or []
        types = model.meta.setdefault(VALUE_TYPES_KEY, {})
        names = {v.name for n in graph for v in (*n.inputs, *n.outputs) if v is not None and v.name}
        names.update(v.name for v in graph.inputs if v.name)
        names.update(graph.initializers)
        for node in list(graph):
            site = _site(node, shapes)
            if site is None:
                continue
            _Rewrite(graph, node, site, shapes, types, names).apply()
            self.rewritten.append(state.node_label(node))
        if self.rewritten:
            onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=bool(self.rewritten))


def _ints(value: ir.Value | None) -> list[int] | None:
    const = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if const is None else [int(a) for a in np.asarray(const.numpy()).reshape(-1)]


def _standard(node: ir.Node | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def _rank(value: ir.Value, shapes: Sequence[dict]) -> int | None:
    dims = [p.get(value.name) for p in shapes] or [None]
    if dims[0] is None and value.shape is not None:
        return len(value.shape)
    return len(dims[0]) if dims[0] is not None else None


def _branches(stack: ir.Value, axis: int, rank: int) -> list[ir.Value] | None:
    """``x_i`` when ``stack`` (of rank ``rank``) is ``Concat(Unsqueeze(x_i, [axis]), ..., axis=axis)``."""
    cat = stack.producer()
    if not _standard(cat, "Concat") or len(cat.inputs) < 2:
        return None
    a = cat.attributes.get_int("axis", 0)
    if (a + rank if a < 0 else a) != axis:
        return None
    xs = []
    for u in cat.inputs:
        p = u.producer() if u is not None else None
        if not _standard(p, "Unsqueeze") or len(p.inputs) < 2 or p.inputs[0] is None:
            return None
        axes = _ints(p.inputs[1])
        if axes is None or len(axes) != 1 or (axes[0] + rank if axes[0] < 0 else axes[0]) != axis:
            return None
        xs.append(p.inputs[0])
    return xs


def _site(node: ir.Node, shapes: Sequence[dict]) -> tuple[int, list[ir.Value], ir.Value | None] | None:
    """(axis, branches, weights or None) where rules 1 and 2 apply to ``node``, else None."""
    if not _standard(node, "ReduceSum") or node.attributes.get_int("keepdims", 1) != 0 or len(node.inputs) < 2:
        return None
    if node.outputs[0].is_graph_output() or node.inputs[0] is None:
        return None
    axes = _ints(node.inputs[1])
    rank = _rank(node.inputs[0], shapes)
    if axes is None or len(axes) != 1 or rank is None:
        return None
    axis = axes[0] + rank if axes[0] < 0 else axes[0]
    xs = _branches(node.inputs[0], axis, rank)
    if xs is not None:
        return axis, xs, None
    mul = node.inputs[0].producer()
    if not _standard(mul, "Mul") or len(mul.inputs) != 2:
        return None
    for stack, w in (mul.inputs, mul.inputs[::-1]):
        xs = _branches(stack, axis, rank) if stack is not None else None
        if xs is not None and w is not None and _weights_fit(w, stack, mul.outputs[0], axis, len(xs), shapes):
            return axis, xs, w
    return None


def _weights_fit(w: ir.Value, stack: ir.Value, product: ir.Value, axis: int, k: int, shapes: Sequence[dict]) -> bool:
    """Rule 2, in every profile: ``W`` has the stack's rank and ``k`` on ``axis``, and the product
    has the stack's dims (so ``W`` broadcasts into the stack, each ``W_i`` into its branch)."""
    if not shapes:
        return False
    for profile in shapes:
        wd, sd, pd = profile.get(w.name), profile.get(stack.name), profile.get(product.name)
        if wd is None or sd is None or pd is None or len(wd) != len(sd) or wd[axis] != k:
            return False
        if any(not isinstance(d, int) for d in sd) or list(pd) != list(sd):
            return False
    return True


class _Rewrite:
    """One ReduceSum's replacement (rules 1 and 3)."""

    def __init__(self, graph: ir.Graph, node: ir.Node, site: tuple[int, list[ir.Value], ir.Value | None],
                 shapes: Sequence[dict], types: dict, names: set[str]) -> None:
        self.graph, self.node, self.shapes, self.types, self.names = graph, node, shapes, types, names
        self.axis, self.xs, self.w = site
        self.base = node.outputs[0].name or state.node_label(node)
        self.new: list[ir.Node] = []

    def apply(self) -> None:
        terms = list(self.xs) if self.w is None else self._weighted()
        total = terms[0]
        for i, term in enumerate(terms[1:]):
            total = self._add("Add", [total, term], f"sum{i}", self._dims_of(self.xs[0]))
        old = self.node.outputs[0]
        name = old.name
        self.graph.insert_before(self.node, self.new)
        ir.convenience.replace_all_uses_with(old, total)
        self.graph.remove(self.node, safe=True)
        total.name, total.type, total.shape = name, old.type, old.shape

    def _weighted(self) -> list[ir.Value]:
        k, a = len(self.xs), self.axis
        sizes = self._const("sizes", np.ones(k, np.int64))
        axes = self._const("axis", np.array([a], np.int64))
        split = ir.node("Split", [self.w, sizes], attributes={"axis": a}, num_outputs=k, name=self._name("w_split"))
        self.new.append(split)
        terms = []
        for i, (x, part) in enumerate(zip(self.xs, split.outputs)):
            self._record(part, [d[:a] + [1] + d[a + 1:] for d in self._dims_of(self.w)], f"w_split{i}", self.w)
            w_i = self._add("Squeeze", [part, axes], f"w{i}", [d[:a] + d[a + 1:] for d in self._dims_of(self.w)], like=self.w)
            terms.append(self._add("Mul", [x, w_i], f"mul{i}", self._dims_of(x)))
        return terms

    def _add(self, op: str, inputs: list[ir.Value], tag: str, dims: list[Any], like: ir.Value | None = None) -> ir.Value:
        node = ir.node(op, inputs, name=self._name(tag))
        self.new.append(node)
        self._record(node.outputs[0], dims, tag, like or self.xs[0])
        return node.outputs[0]

    def _record(self, value: ir.Value, dims: list[Any], tag: str, like: ir.Value) -> None:
        value.name = self._name(tag)
        value.type = like.type
        for profile, d in zip(self.shapes, dims):
            profile[value.name] = list(d)
        if like.name in self.types:
            self.types[value.name] = self.types[like.name]

    def _dims_of(self, value: ir.Value) -> list[list[Any]]:
        return [list(p[value.name]) for p in self.shapes if p.get(value.name) is not None]

    def _const(self, tag: str, array: np.ndarray) -> ir.Value:
        name = self._name(tag)
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        value.shape = ir.Shape(array.shape)
        value.type = ir.TensorType(ir.DataType.INT64)
        self.graph.register_initializer(value)
        return value

    def _name(self, tag: str) -> str:
        name, n = f"{self.base}::branch_sum/{tag}", 1
        while name in self.names:
            name, n = f"{self.base}::branch_sum/{tag}_{n}", n + 1
        self.names.add(name)
        return name

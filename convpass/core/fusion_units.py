"""Fusion units: groups of graph nodes that may run as one fused step, found by one set of rules
for the compiler (on the onnx-ir graph, to plan layouts and measure) and the executor (on its
plan, to run them). Both walk the graph through a :class:`GraphView`.

A unit is a candidate, not a rewrite: whether it runs fused is the model's recorded decision
(:mod:`convpass.core.annotation`, ``convpass.fusions``), or the rule of its kind where nothing
was measured (:data:`RULES`).

Normalization units (kind ``norm``)
-----------------------------------
``y = epilogue(norm(x))`` where

* the *core* normalizes ``x`` (rank 3-5, ``(N, C, *spatial)``) per sample and channel group:

  1. ``GroupNormalization`` (opset 18: per-group scale and bias; opset 21: per-channel);
  2. ``InstanceNormalization`` of ``x`` itself (groups = C);
  3. the form ``torch.onnx.export`` writes for ``nn.GroupNorm`` below opset 18:
     ``Reshape(x) -> (N, G, C / G * S)``, ``InstanceNormalization`` of that (per-group scale and
     bias), ``Reshape`` back to ``x``'s shape; each of the three read only by the next;

  scale and bias are constants;
* the *epilogue* is the run of element-wise nodes that follow (:data:`EPILOGUE_OPS`: the
  exported GroupNorm's per-channel ``Mul`` / ``Add``, an activation — ``x * Sigmoid(x)`` (SiLU),
  ReLU, LeakyReLU, GELU, Mish, HardSwish, ... — a residual ``Add``), in graph order: a node joins
  when it reads a value of the unit, its output has ``x``'s shape and each of its other operands
  is a constant or a value from outside the unit that broadcasts to ``x``'s shape per sample (1
  or N), per channel (1 or C) and over all spatial positions at once (1 or every one): scalars,
  per-channel parameters, a residual, a ``(N, C, 1, 1)`` gate. The scan stops at the first node
  that reads a unit value and cannot join;
* of those, the longest prefix in which every value but the last is read only inside the unit
  (and is no graph output) is the unit; its last value is the unit's output.

A core of forms 1 and 2 with an empty epilogue is no unit (there is nothing to fuse).

Conv bias units (kind ``bias``)
-------------------------------
A ``Conv`` (standard, or a tuned one of ``ai.convpass``) with a constant bias whose output is read by
exactly one node, an element-wise one (:data:`EPILOGUE_OPS`) other than ``Relu`` and ``Add`` (the
conv's own epilogue already takes those in its pass: :mod:`convpass.kernels.convolution`), with
an output of the conv's shape, and is no graph output: RRDB's ``LeakyReLU(conv(x) + b)``, its
residual scaling ``conv(x) * 0.2``. Fused, the conv runs without its bias and the bias is added
in the element-wise kernel that follows (one pass over the conv's output instead of two); the
executor does that only where the conv runs its bias as a pass of its own (a tuned decision with
no epilogue fused into cuDNN's call: a legacy algorithm, or a graph-API engine of the bare conv).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["EPILOGUE_OPS", "RULES", "BiasUnit", "GraphView", "NormUnit", "find_bias_units", "find_norm_units", "find_units", "unit_key"]

# Element-wise ops an epilogue may contain (each has an expression in the cuda backend's
# generated kernels: convpass.kernels.elementwise.EXPRESSIONS).
EPILOGUE_OPS = frozenset(
    """Add Sub Mul Div Pow Max Min Neg Abs Exp Log Sqrt Reciprocal Tanh Erf Relu Sigmoid Softsign Softplus
    Mish HardSigmoid HardSwish LeakyRelu Elu Clip PRelu Gelu Swish""".split()
)

# What the executor does with a unit the model records no measurement for (the rule is said in
# the docstring of the kind's fused step).
RULES = {
    "norm": "fewer passes: the fused step reads the input twice and writes once, the unfused steps add a pass per element-wise step",
    "bias": "fewer passes: the bias is added in the element-wise pass that follows instead of a pass of its own",
}

_FLOAT = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))
_SCAN_WINDOW = 8  # nodes after the unit's last member that the epilogue scan looks at


class GraphView(abc.ABC):
    """What the unit rules read of a graph: nodes in topological order, each with an op type,
    attributes, and input and output values (None: absent); a value's readers, producer, constant
    value (host), shape and dtype. Node and value handles are whatever the graph uses."""

    @abc.abstractmethod
    def nodes(self) -> Sequence[Any]: ...

    @abc.abstractmethod
    def op(self, node: Any) -> str:
        """The op type of a node of the standard domain; ``""`` for any other domain."""

    @abc.abstractmethod
    def opset(self, node: Any) -> int: ...

    @abc.abstractmethod
    def attr(self, node: Any, name: str, default: Any = None) -> Any: ...

    @abc.abstractmethod
    def name(self, node: Any) -> str: ...

    @abc.abstractmethod
    def inputs(self, node: Any) -> Sequence[Any]: ...

    @abc.abstractmethod
    def outputs(self, node: Any) -> Sequence[Any]: ...

    @abc.abstractmethod
    def readers(self, value: Any) -> Sequence[Any]:
        """The distinct nodes that read ``value``, in graph order."""

    @abc.abstractmethod
    def is_output(self, value: Any) -> bool: ...

    @abc.abstractmethod
    def const(self, value: Any) -> np.ndarray | None: ...

    @abc.abstractmethod
    def shape(self, value: Any) -> tuple[int, ...] | None:
        """Concrete dims, or None when any is unknown."""

    @abc.abstractmethod
    def dtype(self, value: Any) -> np.dtype | None: ...


@dataclasses.dataclass(frozen=True)
class NormUnit:
    """A normalization unit (module rules). ``nodes``: the core's nodes, then the epilogue's;
    ``core``: how many of them are the core; ``scale`` / ``bias``: host constants, per group
    (``per_group``) or per channel, None when absent (ONNX's GroupNormalization needs both)."""

    nodes: tuple[Any, ...]
    names: tuple[str, ...]
    core: int
    x: Any
    output: Any
    groups: int
    eps: float
    scale: np.ndarray | None
    bias: np.ndarray | None
    per_group: bool
    externals: tuple[Any, ...]  # epilogue operands from outside the unit (constants included), by first use

    kind = "norm"

    @property
    def epilogue(self) -> tuple[Any, ...]:
        return self.nodes[self.core:]


@dataclasses.dataclass(frozen=True)
class BiasUnit:
    """A conv bias unit (module rules): the conv and the element-wise node that reads it."""

    nodes: tuple[Any, ...]
    names: tuple[str, ...]
    bias: np.ndarray

    kind = "bias"

    @property
    def conv(self) -> Any:
        return self.nodes[0]


def find_units(view: GraphView) -> list[NormUnit | BiasUnit]:
    """Every fusion unit of the graph, normalization units first (a node belongs to one unit)."""
    norms = find_norm_units(view)
    taken = {n for u in norms for n in u.nodes}
    return [*norms, *(u for u in find_bias_units(view) if not taken.intersection(u.nodes))]


def find_bias_units(view: GraphView) -> list[BiasUnit]:
    """Every conv bias unit of the graph (module rules), in graph order."""
    units = []
    for node in view.nodes():
        ins = list(view.inputs(node))
        if view.op(node) != "Conv" or len(ins) < 3 or ins[2] is None or not view.outputs(node):
            continue
        bias, y = view.const(ins[2]), view.outputs(node)[0]
        if bias is None or bias.ndim != 1 or y is None or view.is_output(y) or view.shape(y) is None:
            continue
        readers = view.readers(y)
        if len(readers) != 1 or view.op(readers[0]) not in EPILOGUE_OPS - {"Relu", "Add"}:
            continue
        reader = readers[0]
        out = view.outputs(reader)[0] if view.outputs(reader) else None
        if out is None or view.shape(out) != view.shape(y) or view.opset(reader) < 7:
            continue
        units.append(BiasUnit((node, reader), (view.name(node), view.name(reader)), bias))
    return units


def unit_key(names: Sequence[str]) -> str:
    """A unit's key in the model's record: its node names, in order."""
    return "|".join(names)


def find_norm_units(view: GraphView) -> list[NormUnit]:
    """Every normalization unit of the graph (module rules), in graph order; a node belongs to one
    unit at most."""
    order = list(view.nodes())
    position = {n: i for i, n in enumerate(order)}
    taken: set[Any] = set()
    units = []
    for node in order:
        if node in taken:
            continue
        core = _core(view, node)
        if core is None:
            continue
        nodes, x, groups, eps, scale, bias, per_group = core
        unit = _with_epilogue(view, order, position, nodes, x, groups, eps, scale, bias, per_group, taken)
        if unit is not None:
            units.append(unit)
            taken.update(unit.nodes)
    return units


# ---------------------------------------------------------------------------------------------
# the core


def _single_reader(view: GraphView, value: Any, op: str) -> Any | None:
    if value is None or view.is_output(value):
        return None
    readers = view.readers(value)
    return readers[0] if len(readers) == 1 and view.op(readers[0]) == op else None


def _params(view: GraphView, node: Any, sizes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, bias) constants of a normalization node, each of one of ``sizes`` elements."""
    ins = list(view.inputs(node)) + [None, None]
    scale, bias = (view.const(v) if v is not None else None for v in ins[1:3])
    if scale is None or bias is None or scale.size not in sizes or bias.size not in sizes:
        return None
    return scale.reshape(-1), bias.reshape(-1)


def _core(view: GraphView, node: Any) -> tuple | None:
    """(nodes, x, groups, eps, scale, bias, per_group) of a normalization core starting at ``node``."""
    op = view.op(node)
    if op not in ("GroupNormalization", "InstanceNormalization", "Reshape"):
        return None
    if any(o is not None and view.readers(o) and o != view.outputs(node)[0] for o in view.outputs(node)[1:]):
        return None
    x = view.inputs(node)[0] if view.inputs(node) else None
    shape = view.shape(x) if x is not None else None
    if shape is None or not 3 <= len(shape) <= 5 or view.dtype(x) not in _FLOAT:
        return None
    n, c = shape[:2]
    if op == "GroupNormalization":
        groups = int(view.attr(node, "num_groups", 0))
        if groups <= 0 or c % groups or (view.opset(node) >= 21 and int(view.attr(node, "stash_type", 1)) != 1):
            return None
        params = _params(view, node, (groups, c) if view.opset(node) >= 21 else (groups,))
        if params is None:
            return None
        per_group = params[0].size == groups and groups != c
        return (node,), x, groups, float(view.attr(node, "epsilon", 1e-5)), *params, per_group
    if op == "InstanceNormalization":
        params = _params(view, node, (c,))
        return None if params is None else ((node,), x, c, float(view.attr(node, "epsilon", 1e-5)), *params, False)
    # Reshape(x) -> (N, G, C / G * S) -> InstanceNormalization -> Reshape back (form 3)
    r1 = view.outputs(node)[0]
    grouped = view.shape(r1)
    spatial = int(np.prod(shape[2:]))
    if grouped is None or len(grouped) != 3 or grouped[0] != n or grouped[1] <= 0 or c % grouped[1]:
        return None
    groups = int(grouped[1])
    if grouped[2] != c // groups * spatial:
        return None
    norm = _single_reader(view, r1, "InstanceNormalization")
    if norm is None or view.inputs(norm)[0] != r1:
        return None
    params = _params(view, norm, (groups,))
    back = _single_reader(view, view.outputs(norm)[0], "Reshape")
    if params is None or back is None or view.shape(view.outputs(back)[0]) != tuple(shape):
        return None
    return (node, norm, back), x, groups, float(view.attr(norm, "epsilon", 1e-5)), *params, groups != c


# ---------------------------------------------------------------------------------------------
# the epilogue


def _operand_fits(view: GraphView, value: Any, shape: tuple[int, ...]) -> bool:
    """An epilogue operand from outside the unit: broadcasts to ``shape`` per sample, per channel
    and over all spatial positions at once (module rules)."""
    s = view.shape(value)
    if s is None or len(s) > len(shape) or view.dtype(value) not in _FLOAT:
        return False
    s = (1,) * (len(shape) - len(s)) + tuple(s)
    spatial = s[2:]
    return (s[0] in (1, shape[0]) and s[1] in (1, shape[1])
            and (all(d == 1 for d in spatial) or tuple(spatial) == tuple(shape[2:])))


def _joins(view: GraphView, node: Any, inside: set[int], shape: tuple[int, ...], dtype: Any) -> bool | None:
    """True: ``node`` joins the epilogue; False: it does not read the unit; None: it reads the unit
    but cannot join (the scan stops)."""
    ins = [v for v in view.inputs(node) if v is not None]
    reads = any(v in inside for v in ins)
    if not reads:
        return False
    if view.op(node) not in EPILOGUE_OPS or view.opset(node) < 7:
        return None
    outs = [o for o in view.outputs(node) if o is not None]
    if len(outs) != 1 or view.shape(outs[0]) != tuple(shape) or view.dtype(outs[0]) != dtype:
        return None
    if view.op(node) in ("Max", "Min") and len(ins) != 2:
        return None
    for v in ins:
        if v not in inside and not _operand_fits(view, v, shape):
            return None
    return True


def _valid(view: GraphView, nodes: list[Any]) -> bool:
    """Every value of ``nodes`` but the last node's output is read only by ``nodes`` and is no graph output."""
    members = set(nodes)
    for node in nodes[:-1]:
        for v in view.outputs(node):
            if v is None:
                continue
            if view.is_output(v) or any(r not in members for r in view.readers(v)):
                return False
    return True


def _with_epilogue(view: GraphView, order: list[Any], position: dict[Any, int], core: tuple[Any, ...], x: Any, groups: int,
                   eps: float, scale: np.ndarray, bias: np.ndarray, per_group: bool, taken: set[Any]) -> NormUnit | None:
    shape = view.shape(x)
    dtype = view.dtype(x)
    if shape is None:
        return None  # a unit needs its input's shape (the finder checked it; said for the type checker)
    nodes = list(core)
    if not _valid(view, nodes):
        return None  # the core's inner values are read elsewhere
    inside = {v for n in core for v in view.outputs(n) if v is not None}
    best = len(nodes) if len(core) > 1 else None  # forms 1 and 2 need an epilogue
    i = position[core[-1]] + 1
    skipped = 0
    while i < len(order) and skipped <= _SCAN_WINDOW:
        node = order[i]
        i += 1
        joins = _joins(view, node, inside, shape, dtype) if node not in taken else None
        if joins is False:
            skipped += 1
            continue
        if joins is None:
            break
        nodes.append(node)
        inside.update(v for v in view.outputs(node) if v is not None)
        skipped = 0
        if _valid(view, nodes):
            best = len(nodes)
    if best is None:
        return None
    nodes = nodes[:best]
    produced = {v for n in nodes for v in view.outputs(n) if v is not None}
    externals: list[Any] = []
    for node in nodes[len(core):]:
        for v in view.inputs(node):
            if v is not None and v not in produced and v not in externals:
                externals.append(v)
    output = view.outputs(nodes[-1])[0]
    return NormUnit(tuple(nodes), tuple(view.name(n) for n in nodes), len(core), x, output, groups, eps, scale, bias, per_group,
                    tuple(externals))

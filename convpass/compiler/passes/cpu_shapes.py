"""Resolve, by running part of the graph on the CPU, the shapes ONNX shape inference leaves unknown.

Used by :class:`~convpass.compiler.passes.resolve_shapes.ResolveShapesPass` for one shape profile when a
tensor a conv needs still has an unknown or symbolic dim after inference (Slice ends computed by
Shape -> Gather -> Div chains, Reshape targets computed by integer arithmetic, data-dependent ops).

Rules:

* Only what the sought shapes depend on is computed. Walking back from the sought tensors, a
  node's inputs are needed for their *values* when the executor's op table says they decide the
  output shape (Reshape's shape, Slice's starts / ends, every input of a data-dependent op such as
  NonZero) or when the node's own values are needed; otherwise only for their *shapes* (a Shape
  node needs only its input's shape). A tensor needed for its shape only whose shape inference
  already knows is not computed: it is fed as zeros of that shape and type (its values cannot
  change the result). Tensors needed for their values are computed from the graph inputs.
* Rounds: each round runs only the *frontier* -- the nodes with an unknown output that need no
  other unknown-shape tensor -- pins the shapes it saw, and reruns ONNX shape inference with them,
  which then carries them through everything it can infer (convs, element-wise ops...). So the
  convs of the model never run unless their own output shape is unknown, and the cost hardly grows
  with the batch: a round runs a handful of cheap nodes at the profile's real shapes, never a
  smaller stand-in (no proof needed that the batch does not matter). A ShuffleNet V2 export
  (712 nodes) takes 27 rounds, 0.4 s at batch 1 and 32 alike, mostly in shape inference; a whole
  forward pass at batch 32 on the executor takes 1.3 s on 2 cores.
* The run uses the convpass CPU executor (``Executor(..., device="cpu")``, NumPy), not ONNX
  Runtime: it is always installed (ONNX Runtime is only a test dependency), it implements the same
  op table whose ``value_inputs`` drive the walk above, and the rounds run so little that speed
  does not matter.
* Graph inputs whose values can matter are fed random data of the profile's shape, the same for
  every round of a profile (seeded): floats standard normal, integers uniform in 0..3 (small and
  non-negative, so they are valid indices and sizes), booleans uniform. Graph inputs the run needs
  must have concrete dims in the profile; otherwise nothing runs and the caller's error asks for
  ``--shape``.
* A shape that truly depends on input values -- as the executor decides it: downstream of a
  data-dependent op, or of an op whose shape-deciding input is computed from data -- is resolved
  to the shape seen on those random inputs, and reported as such (:attr:`CpuShapes.value_dependent`).
* A failing run raises :class:`~convpass.core.errors.ShapeError` naming the profile and what the
  executor said about the node (nothing is written).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_ir as ir

from convpass.core import annotation
from convpass.core.annotation import Profile
from convpass.core.errors import ShapeError

if TYPE_CHECKING:
    from convpass.ops.registry import OpImpl

logger = logging.getLogger("convpass")

_SHAPE, _VALUE = 1, 2  # what of a tensor a run needs: its shape only, or its values
_SHAPE_OPS = ("Shape", "Size")  # their output values depend on their input's shape only
INT_HIGH = 4  # random integer feeds are uniform in [0, INT_HIGH)

# value name -> dims; value name -> ONNX element type
Shapes = dict[str, tuple]
Types = dict[str, int]
# pins (value name -> (dims, element type)) -> shape inference with them
Infer = Callable[[Mapping[str, tuple[tuple[int, ...], int]]], tuple[Shapes, Types]]


@dataclasses.dataclass
class CpuShapes:
    """What resolving one profile's unknown shapes on the CPU did."""

    profile: str
    resolved: dict[str, tuple[int, ...]]  # the sought tensors inference left unknown -> dims seen
    value_dependent: dict[str, str]  # of those, the ones whose shape depends on input values -> why
    ops_run: dict[str, int]  # op type -> node executions over all rounds
    rounds: int
    seconds: float

    @property
    def nodes_run(self) -> int:
        return sum(self.ops_run.values())


def concrete(dims: Sequence | None) -> bool:
    return dims is not None and all(isinstance(d, int) and d > 0 for d in dims)


def _domain(node: ir.Node) -> str:
    return "" if node.domain == "ai.onnx" else node.domain


def _label(node: ir.Node) -> str:
    return node.name or (node.outputs[0].name if node.outputs else node.op_type)


class _OpTable:
    """The executor's registrations for this model's nodes (what decides their output shapes)."""

    def __init__(self, model: ir.Model) -> None:
        from convpass.ops.registry import lookup

        self._lookup = lookup
        self._opsets = dict(model.opset_imports)
        self._cache: dict[tuple[str, str], OpImpl | None] = {}

    def impl(self, node: ir.Node) -> OpImpl | None:
        key = (_domain(node), node.op_type)
        if key not in self._cache:
            if key[0] == annotation.DOMAIN and node.op_type in annotation.ANNOTATED_OPS:  # a tuned conv: the standard op's rules
                self._cache[key] = self._lookup(annotation.ANNOTATED_OPS[node.op_type], "", self._opsets.get("", 0))
            else:
                self._cache[key] = self._lookup(node.op_type, key[0], self._opsets.get(key[0], 0))
        return self._cache[key]

    def input_kind(self, node: ir.Node, index: int, need: int) -> int:
        """What of input ``index`` computing ``need`` (shape / values) of ``node``'s outputs takes."""
        if node.op_type in _SHAPE_OPS and _domain(node) == "":
            return _SHAPE
        if need == _VALUE:
            return _VALUE
        impl = self.impl(node)
        if impl is None or impl.data_dependent_shape or index in impl.value_inputs:
            return _VALUE
        return _SHAPE


def value_dependence(model: ir.Model, table: _OpTable | None = None) -> dict[str, str]:
    """Every value whose shape is not fixed by the graph-input shapes -> the node that makes it so.

    The executor's rule (``_Val.determined`` in :mod:`convpass.runtime.plan_builder`): values computed
    from constants and from Shape / Size of determined tensors are known from the shapes alone; an
    output is determined when all inputs are, the op is not data-dependent (NonZero) and every
    shape-deciding input is such a shape-only value.
    """
    table = table or _OpTable(model)
    static: set[str] = set()
    cause: dict[str, str] = {}
    for node in model.graph:
        inputs = [v for v in node.inputs if v is not None]
        outputs = [v.name for v in node.outputs]
        if all(v.const_value is not None or v.name in static for v in inputs):
            static.update(outputs)
            continue
        if node.op_type in _SHAPE_OPS and _domain(node) == "" and inputs and inputs[0].name not in cause:
            static.update(outputs)
            continue
        impl = table.impl(node)
        what = f"{node.op_type} {_label(node)!r} upstream"
        why = None
        if impl is None:
            # conservative: the executor has no shape rule for it, so nothing shows it does not depend on values
            why = f"{what} is an op the convpass executor does not implement, whose shape may depend on them"
        elif impl.data_dependent_shape:
            why = f"{what} has a data-dependent output shape"
        else:
            for i in impl.value_inputs:
                v = node.inputs[i] if i < len(node.inputs) else None
                if v is not None and v.const_value is None and v.name not in static:
                    why = f"{what} takes its shape from {v.name!r}, which is computed from input values"
                    break
            else:
                why = next((cause[v.name] for v in inputs if v.name in cause), None)
        if why is not None:
            for name in outputs:
                cause[name] = why
    return cause


class _Region:
    """The nodes that compute what ``targets`` need, and how each tensor is needed."""

    def __init__(self, graph: ir.Graph, table: _OpTable, targets: Iterable[ir.Value], shapes: Shapes, types: Types) -> None:
        self.kind: dict[str, int] = {v.name: _SHAPE for v in targets}
        self.nodes: list[ir.Node] = []
        for node in reversed(list(graph)):
            run = False
            need = _SHAPE
            for out in node.outputs:
                k = self.kind.get(out.name)
                if k == _VALUE:
                    run, need = True, _VALUE
                elif k == _SHAPE and not _feedable(out.name, shapes, types):
                    run = True
            if not run:
                continue  # its outputs, if needed at all, are needed for known shapes only: fed as zeros
            self.nodes.append(node)
            for i, v in enumerate(node.inputs):
                if v is not None and v.const_value is None:
                    self.kind[v.name] = max(self.kind.get(v.name, 0), table.input_kind(node, i, need))
        self.nodes.reverse()
        produced = {v.name for n in self.nodes for v in n.outputs}
        # what the region needs but does not compute: graph inputs and known-shape cuts
        self.feeds = [name for name in self.kind if name not in produced]

    def unknown_outputs(self, node: ir.Node, shapes: Shapes) -> list[ir.Value]:
        return [v for v in node.outputs if v.name in self.kind and not concrete(shapes.get(v.name))]

    def frontier(self, shapes: Shapes) -> list[ir.Value]:
        """The unknown outputs of the nodes that need no other unknown-shape tensor."""
        waits: set[str] = set()  # tensors that are unknown or computed from an unknown one
        found = []
        for node in self.nodes:
            if any(v is not None and v.name in waits for v in node.inputs):
                waits.update(v.name for v in node.outputs)
                continue
            unknown = self.unknown_outputs(node, shapes)
            if unknown:
                found.extend(unknown)
                waits.update(v.name for v in node.outputs)
        return found


def _feedable(name: str, shapes: Shapes, types: Types) -> bool:
    from convpass.ops.registry import SUPPORTED_ELEM_TYPES

    return concrete(shapes.get(name)) and types.get(name) in SUPPORTED_ELEM_TYPES


def _random(rng: np.random.Generator, dims: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Random data of one of the executor's types (floats, integers, bool)."""
    if dtype.kind == "f":
        return rng.standard_normal(dims).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, INT_HIGH, size=dims).astype(dtype)
    return rng.random(dims) < 0.5


def _submodel(model: ir.Model, nodes: Sequence[ir.Node], feeds: Mapping[str, tuple[tuple[int, ...], int]], outputs: Sequence[str]) -> onnx.ModelProto:
    """A model of ``nodes`` alone: ``feeds`` as its inputs, the constants they read, ``outputs``."""
    constants: dict[str, ir.Value] = {}
    for node in nodes:
        for v in node.inputs:
            if v is not None and v.const_value is not None:
                constants[v.name] = v
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes],
        "convpass_shapes",
        [onnx.helper.make_tensor_value_info(name, elem, list(dims)) for name, (dims, elem) in feeds.items()],
        [onnx.helper.make_empty_tensor_value_info(name) for name in outputs],
        [onnx.numpy_helper.from_array(v.const_value.numpy(), name) for name, v in constants.items()],
    )
    proto = onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()],
        # initializers that are not inputs need IR 4, model-local functions IR 8
        ir_version=max(model.ir_version or 0, 8),
    )
    proto.functions.extend(ir.serde.serialize_function(f) for f in model.functions.values())
    return proto


def resolve_on_cpu(
    model: ir.Model,
    profile: Profile,
    sought: Sequence[ir.Value],
    shapes: Shapes,
    types: Types,
    infer: Infer,
) -> tuple[Shapes, Types, CpuShapes | None]:
    """Resolve the unknown shapes among ``sought`` for ``profile`` (see the module rules).

    ``shapes`` / ``types`` are what shape inference gave; ``infer(pins)`` reruns it with tensors'
    shapes pinned. Returns the final inference results and what ran, or ``None`` when nothing was
    unknown or the run needs a graph input whose profile shape is not concrete (the caller reports).
    """
    from convpass.core.errors import ExecutorError
    from convpass.ops.registry import SUPPORTED_ELEM_TYPES
    from convpass.runtime.executor import Executor

    unknown = [v for v in sought if not concrete(shapes.get(v.name))]
    if not unknown:
        return shapes, types, None
    start = time.perf_counter()
    table = _OpTable(model)
    graph_inputs = {v.name for v in model.graph.inputs}
    rng = np.random.default_rng(0)
    random_feeds: dict[str, np.ndarray] = {}  # graph inputs: the same data in every round
    pins: dict[str, tuple[tuple[int, ...], int]] = {}
    rounds = 0
    ops_run: collections.Counter[str] = collections.Counter()
    pending = unknown
    while pending:
        region = _Region(model.graph, table, pending, shapes, types)
        for name in region.feeds:
            if not concrete(shapes.get(name)):
                # a graph input without concrete dims in this profile: the caller asks for --shape
                logger.info("profile %r: cannot run the graph on the CPU: input %r has no concrete shape", profile.name, name)
                return shapes, types, None
            if types.get(name) not in SUPPORTED_ELEM_TYPES:
                raise ShapeError(
                    f"profile {profile.name!r}: resolving shapes on the CPU needs {name!r}, of a type the convpass "
                    f"executor does not support ({onnx.helper.tensor_dtype_to_string(types.get(name, 0))})"
                )
        frontier = region.frontier(shapes)
        if not frontier:  # pragma: no cover  (an unknown tensor that is not fed has a producer in the region)
            raise ShapeError(f"profile {profile.name!r}: no node to run for {[v.name for v in pending]}")
        run = _Region(model.graph, table, frontier, shapes, types)
        feeds: dict[str, np.ndarray] = {}
        for name in run.feeds:
            dims, elem = tuple(shapes[name]), types[name]
            dtype = SUPPORTED_ELEM_TYPES[elem]
            if name in graph_inputs and run.kind[name] == _VALUE:
                if name not in random_feeds:
                    random_feeds[name] = _random(rng, dims, dtype)
                feeds[name] = random_feeds[name]
            else:
                feeds[name] = np.zeros(dims, dtype)  # only its shape matters
        outputs = [v.name for v in frontier]
        sub = _submodel(model, run.nodes, {n: (a.shape, types[n]) for n, a in feeds.items()}, outputs)
        try:
            # No onnx.checker: the nodes come from a model checked at load, and the outputs are
            # declared without a type (their shapes are what the run is for), which it refuses.
            results = Executor(sub, device="cpu", check_model=False).run(None, feeds)
        except ExecutorError as e:
            detail = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
            raise ShapeError(
                f"resolving shapes on the CPU for profile {profile.name!r} failed (computing {', '.join(map(repr, outputs))}): {detail}"
            ) from None
        for name, array in zip(outputs, results):
            pins[name] = (tuple(int(d) for d in array.shape), onnx.helper.np_dtype_to_tensor_dtype(array.dtype))
        rounds += 1
        ops_run.update(n.op_type for n in run.nodes)
        logger.info("profile %r, round %d: ran %d node(s) on the CPU for %s", profile.name, rounds, len(run.nodes), outputs)
        shapes, types = infer(pins)
        disputed = [name for name, (dims, _) in pins.items() if shapes.get(name) != dims]
        if disputed:  # the executor and ONNX's shape rules disagree: trust neither
            raise ShapeError(
                f"profile {profile.name!r}: ONNX shape inference disagrees with the CPU run about the shape of "
                f"{', '.join(map(repr, disputed))}"
            )
        pending = [v for v in pending if not concrete(shapes.get(v.name))]
    cause = value_dependence(model, table)
    result = CpuShapes(
        profile=profile.name,
        resolved={v.name: tuple(shapes[v.name]) for v in unknown},
        value_dependent={v.name: cause[v.name] for v in unknown if v.name in cause},
        ops_run=dict(ops_run),
        rounds=rounds,
        seconds=time.perf_counter() - start,
    )
    return shapes, types, result

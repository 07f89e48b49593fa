"""The executor: runs an ONNX model (tuned by convpass or not) with a static plan per input shape.

Load (once per model)
    read the file once (initializers stored as external data are memory-mapped, copy on write,
    not read: :mod:`convpass.runtime.model_file`); find its kernel side-car (``<model>.kernels``, :mod:`convpass.core.kernel_file`:
    the GPU kernels its plans need, compiled ahead of time) and hand it to the backend; validate
    (``onnx.checker``, whatever the side-car says); inline model-local functions (except the ``ai.convpass`` convs,
    which run natively) and schema functions of ops with no kernel here, bind every node to its
    op implementation — listing *all* unsupported ops and element types in one
    :class:`ExecutorError` — decode attributes, fold constant subgraphs
    (:mod:`convpass.ops.constant_folding`, the code ``optimize`` folds conv weights with), fold
    inference BatchNormalization into the preceding Conv / ConvTranspose weights where exact
    (:mod:`convpass.ops.batchnorm_folding`), and read the recorded conv decisions
    (:func:`convpass.core.annotation.read_annotations`).

Plan (once per input-shape signature: the feeds' names, shapes and dtypes, and the requested outputs)
    the nodes the outputs need, in topological order. Shape computations (``Shape`` of a tensor
    whose shape the signature fixes and everything computed from such values and constants) are
    folded to constants on the host, so the plan holds only data-dependent computation; convs get
    their canonical geometry and the decision of the shape profile the feeds match. Every value
    gets a slot; after each step the slots whose last reader ran are released (liveness), which is
    all "buffer reuse" means on numpy; the plan records every value's shape and dtype so a device
    backend can preallocate (:meth:`Backend.compile_plan`).

Run
    feeds are validated (names, dtypes, ranks, fixed and symbolic dims), the cached plan's steps
    run on the backend, outputs come back as numpy arrays (``output_kind="numpy"``), backend
    arrays (``output_kind="device"``) or, by default (``output_kind=None``), in the kind of the
    feeds: device arrays when any feed is one (CuPy, CUDA DLPack), numpy otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.external_data_helper
import onnx.inliner

from convpass.core import annotation, kernel_file
from convpass.core.fusion_units import RULES, unit_key
from convpass.runtime import model_file
from convpass.kernels.backends import Backend, host_backend
from convpass.kernels.fused_steps import FusionSummary, apply_fusions, describe_fusions
from convpass.ops.conv import ConvCall
from convpass.runtime.devices import get_backend, open_ahead
from convpass.core.errors import ExecutorError
from convpass.kernels.plan import ConvSummary, GraphStatus, Plan, PlanStep, store_outputs, unshare_outputs
from convpass.ops import batchnorm_folding
from convpass.ops.constant_folding import fold_constants
from convpass.ops.registry import (SUPPORTED_ELEM_TYPES, NodeInfo, OpContext, call_node, decode_attributes, elem_type_name, lookup,
                                   normalize_domain, ort_type_string)

# ---------------------------------------------------------------------------------------------
# support check


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


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {normalize_domain(o.domain): int(o.version) for o in model.opset_import}


def _node_name(node: onnx.NodeProto, index: int) -> str:
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
    opsets = _opsets(model)
    for i, node in enumerate(model.graph.node):
        name = _node_name(node, i)
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


# ---------------------------------------------------------------------------------------------
# public data


@dataclasses.dataclass(frozen=True)
class NodeArg:
    """An input or output of the model, like ONNX Runtime's ``NodeArg``."""

    name: str
    shape: list[int | str | None] | None  # None: rank unknown
    type: str
    elem_type: int

    @property
    def dtype(self) -> np.dtype:
        return SUPPORTED_ELEM_TYPES[self.elem_type]


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


# ---------------------------------------------------------------------------------------------
# the executor


class Executor:
    """Runs an ONNX model (tuned by convpass or not) with the conv decisions recorded in it.

    * ``run(output_names, feeds)`` -> list of outputs (``output_names`` None = all).
    * ``prepare(feeds)``: build (compile, capture) the plan for those input shapes ahead of the first run.
    * ``get_inputs()`` / ``get_outputs()`` -> :class:`NodeArg` (``.name``, ``.shape``, ``.type``).
    * ``plan_summary()`` -> :class:`ConvSummary` per conv: the recorded algo / memory format / math;
      ``fusion_summary()`` -> :class:`FusionSummary` per fusion unit of the last plan: whether it ran
      fused and why.

    Args:
        model: The model: a path, serialized bytes or an ``onnx.ModelProto``.
        device: ``"cpu"`` (the NumPy reference), ``"cuda"`` (CuPy + cuDNN), ``"auto"`` (cuda
            where usable), or a backend object.
        cuda_graph: On cuda, capture each plan once and replay it as a CUDA graph.
        output_kind: ``"numpy"``, ``"device"`` (backend arrays) or None (the kind of the feeds).
        fold_batchnorm: Fold inference BatchNormalization into the preceding conv where exact.
        check_model: Run ``onnx.checker`` on the model first (unless its kernel side-car vouches
            for this exact file).
        kernels: The kernel side-car to load (default: ``<model path>.kernels`` when the model
            is a file and it exists; ``False``: none). A side-car of another model is refused
            with a warning.
        fusions: ``None`` (default) runs each fusion unit (:mod:`convpass.core.fusion_units`) as
            the model's ``convpass.fusions`` record decided for this device and shape profile, and
            by the kind's rule where nothing was measured (:data:`convpass.core.fusion_units.RULES`);
            ``True`` fuses every unit, ``False`` none. A backend made with ``fuse=False`` fuses none.
        min_opset: The lowest ``ai.onnx`` opset taken (default 1: every opset ONNX defines up to
            the installed ``onnx``'s newest; ``convpass run`` takes 7 on, as ``optimize`` does).

    Raises:
        ExecutorError: a model the executor cannot run (every unsupported op and type named at
            once), a model that fails ``onnx.checker``, or unreadable annotations.
    """

    def __init__(
        self,
        model: onnx.ModelProto | str | os.PathLike[str] | bytes,
        device: str | Backend = "cpu",
        cuda_graph: bool = True,
        output_kind: str | None = None,
        *,
        fold_batchnorm: bool = True,
        check_model: bool = True,
        kernels: str | os.PathLike[str] | bool | None = None,
        fusions: bool | None = None,
        min_opset: int = 1,
    ) -> None:
        if output_kind not in (None, "numpy", "device"):
            raise ExecutorError(f"output_kind must be None, 'numpy' or 'device', not {output_kind!r}")
        self.output_kind = output_kind or "auto"
        self.cuda_graph = bool(cuda_graph)
        # A fresh process's GPU set-up (CUDA, the context, cuDNN: 0.3-0.5 s) runs on helper threads
        # while the model and its kernel side-car are read; the initializers are converted while the
        # file's hash is computed (hashlib and zlib let go of the GIL). Nothing here touches the GPU
        # before the wait.
        gpu_ready = open_ahead(device)
        try:
            proto, pending_digest = model_file.load(model, min_opset)
            try:
                constants, constants_error = model_file.read_initializers(proto, model_file.folder(model)), None
            except ExecutorError as e:  # said after onnx.checker, whose message names the fault better
                constants, constants_error = {}, e
            digest = pending_digest()
            self.kernel_file, why = _kernel_file(model, digest, kernels)
        finally:
            gpu_ready()
        self._backend = get_backend(device, cuda_graph=self.cuda_graph) if not isinstance(device, Backend) else device
        self.device = self._backend.name
        self._backend.use_kernels(self.kernel_file, why)
        if check_model:  # whatever a side-car says: its "verified" is its writer's word, not a check made here
            try:
                # a path lets the checker handle models over 2 GB
                onnx.checker.check_model(os.fspath(model) if isinstance(model, (str, os.PathLike)) else proto)
            except (onnx.checker.ValidationError, ValueError) as e:
                raise ExecutorError(f"model fails onnx.checker: {_first_line(e)}") from None
        # the side-car's claim and this model's own check agree
        self.trusted = check_model and self.kernel_file is not None and self.kernel_file.verified and digest is not None
        if constants_error is not None:
            raise constants_error
        try:
            # a model tuned for several GPU types carries one decision table per device: this one's
            self.model_info, annotations = annotation.read_annotations(proto, device=self._backend.fingerprint())
        except annotation.AnnotationError as e:
            raise ExecutorError(str(e)) from None
        try:
            self.fusion_record = annotation.read_fusions(proto)
        except annotation.AnnotationError as e:
            raise ExecutorError(str(e)) from None
        self.fusions = fusions
        self._backend.bind_model(self.model_info)
        self._backend.ready_libraries({n.op_type for n in proto.graph.node if n.domain in ("", "ai.onnx")})
        # decisions by node name (the key annotation.read_node uses)
        self._decisions: dict[str, tuple[annotation.ConvDecision, ...]] = {
            ann.node_name: ann.decisions for ann in annotations
        }
        proto, report = prepare_model(proto)
        if not report.ok:
            raise ExecutorError(report.message())
        self._backend.prefetch(_by_profile(self._decisions.values()))
        self.opsets = _opsets(proto)
        self._init_io(proto, constants)
        self._nodes = self._init_nodes(proto)
        self.folded_batchnorms: list[str] = []
        # constants first, so BatchNormalization parameters given by Constant nodes fold too
        self.folded_constants = self._fold_constants()
        if fold_batchnorm:
            self._fold_batchnorms()
        # drop constants nothing reads any more (e.g. conv weights replaced by their BN-folded copies)
        live = {i for n in self._nodes for i in n.inputs} | set(self._output_names)
        self._constants = {k: v for k, v in self._constants.items() if k in live}
        self._producers = {o: n for n in self._nodes for o in n.outputs if o}
        self._device_constants: dict[str, Any] = {}
        self._plans: dict[tuple[Any, ...], Plan] = {}
        self._last_plan: Plan | None = None
        self._plan_profile: int | None = None

    # ------------------------------------------------------------------ load

    def _init_io(self, proto: onnx.ModelProto, constants: dict[str, np.ndarray]) -> None:
        g = proto.graph
        init_names = {t.name for t in g.initializer}
        self._constants = constants
        self._inputs: list[NodeArg] = [_node_arg(vi) for vi in g.input if vi.name not in init_names]
        self._overridable = [vi.name for vi in g.input if vi.name in init_names]
        self._outputs: list[NodeArg] = [_node_arg(vi) for vi in g.output]
        self._input_map = {a.name: a for a in self._inputs}
        self._output_names = [a.name for a in self._outputs]

    def _init_nodes(self, proto: onnx.ModelProto) -> list[NodeInfo]:
        nodes = []
        for i, n in enumerate(proto.graph.node):
            domain = normalize_domain(n.domain)
            opset = self.opsets.get(domain, 1 if domain == annotation.DOMAIN else 0)
            attrs = annotation.standard_attributes(n) if annotation.is_annotated_conv(n) else list(n.attribute)
            info = NodeInfo(
                name=_node_name(n, i),
                op_type=annotation.standard_op_type(n),  # a bias-less tuned conv runs as its op
                domain=domain,
                opset=opset,
                attrs=decode_attributes(attrs),
                inputs=list(n.input),
                outputs=list(n.output),
            )
            info.impl = lookup(info.op_type, domain, opset)
            nodes.append(info)
        return _toposort(nodes, set(self._constants) | set(self._input_map))

    def _fold_batchnorms(self) -> None:
        """Fold each BatchNormalization into the conv before it (:mod:`convpass.ops.batchnorm_folding`:
        where and how, the rules the compiler follows too)."""
        consumers: dict[str, list[NodeInfo]] = {}
        for n in self._nodes:
            for i in n.inputs:
                if i:
                    consumers.setdefault(i, []).append(n)
        producers = {o: n for n in self._nodes for o in n.outputs if o}
        graph_outputs = set(self._output_names)
        removed: set[int] = set()
        c = self._constants
        for bn in self._nodes:
            conv = batchnorm_folding.fold_site(bn, producers.get, lambda v: consumers.get(v, []), graph_outputs, c.__contains__)
            if conv is None:
                continue
            b_name = conv.inputs[2] if len(conv.inputs) > 2 else ""
            group = int(conv.attr("group", 1) or 1)
            folded = batchnorm_folding.fold_into_conv(conv.op_type, c[conv.inputs[1]], c[b_name] if b_name else None,
                                                      *(c[p] for p in bn.inputs[1:5]), float(bn.attr("epsilon", 1e-5)), group)
            if folded is None:
                continue
            tag = f"{conv.name}::bn_folded"
            c[f"{tag}/W"], c[f"{tag}/B"] = folded
            conv.inputs = [conv.inputs[0], f"{tag}/W", f"{tag}/B"]
            conv.outputs = [bn.outputs[0]]
            removed.add(id(bn))
            self.folded_batchnorms.append(bn.name)
        if removed:
            self._nodes = [n for n in self._nodes if id(n) not in removed]

    def _fold_constants(self) -> int:
        """Evaluate nodes whose inputs are all constants, once, on the host (:mod:`convpass.ops.constant_folding`)."""
        count = len(self._nodes)
        self._nodes = fold_constants(self._nodes, self._constants, OpContext(host_backend()))
        return count - len(self._nodes)

    # ------------------------------------------------------------------ public

    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    @property
    def backend(self) -> Backend:
        return self._backend

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[Any]:
        """Run the model: ``feeds`` maps input names to arrays; returns the outputs in order."""
        names = self._check_output_names(output_names)
        arrays = self._check_feeds(feeds)
        xp = self._backend.xp
        device_out = self.output_kind == "device" or (
            self.output_kind == "auto" and xp is not np and any(_on_device(v, xp) for v in feeds.values())
        )
        plan, results = self._plan_and_run(arrays, names)
        self._last_plan = plan
        return [self._finish(r, device_out) for r in results]

    def prepare(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None) -> Plan:
        """Build the plan for inputs of ``feeds``' shapes and dtypes now (on the GPU: lower, compile,
        warm up and capture it), so that the first :meth:`run` with such inputs only replays it.
        A deployment calls this at start-up for each profile it serves; ``run`` does it by itself
        for a shape it has not seen. Returns the plan (already built: returned as it is)."""
        names = self._check_output_names(output_names)
        arrays = self._check_feeds(feeds)
        plan, _ = self._plan_and_run(arrays, names, run_cached=False)
        with self._backend.errstate():
            self._backend.warm_up(plan, arrays)
        return plan

    def _plan_and_run(self, arrays: dict[str, Any], names: tuple[str, ...], run_cached: bool = True) -> tuple[Plan, list[Any]]:
        """The plan for these inputs (built, and run once, on first use) and its results: the
        results of running it when it was cached and ``run_cached`` (else none)."""
        signature = tuple((n, tuple(a.shape), str(a.dtype)) for n, a in sorted(arrays.items()))
        key = (signature, names)
        plan = self._plans.get(key)
        if plan is None:
            with self._backend.errstate():
                plan, results = self._build_plan(key, arrays, names)
            self._plans[key] = plan
            return plan, results
        if not run_cached:
            return plan, []
        results = self._backend.replay(plan, arrays)
        if results is None:
            with self._backend.errstate():
                results = self._execute(plan, arrays)
        return plan, results

    def plan_summary(self) -> list[ConvSummary]:
        """Per conv: the decision it runs with (from the last plan; the recorded ones before any run)."""
        if self._last_plan is not None:
            return list(self._last_plan.convs)
        out = []
        for node in self._all_conv_nodes():
            decisions = self._decisions.get(node.name)
            d = decisions[0] if decisions else None
            out.append(_summary(node, d, None, 0 if decisions else None, ""))
        return out

    def fusion_summary(self) -> list[FusionSummary]:
        """Per fusion unit of the last plan: its nodes, whether it ran fused and why (empty before any run)."""
        return list(self._last_plan.fusions) if self._last_plan is not None else []

    def format_plan_summary(self) -> str:
        fusions = describe_fusions(self.fusion_summary())
        convs = self._format_conv_summary()
        return convs + ("\n" + fusions if fusions else "")

    def _format_conv_summary(self) -> str:
        rows = self.plan_summary()
        if not rows:
            return "no convolutions"
        head = ("node", "op", "algo", "memory_format", "math", "source", "problem")
        table = [head] + [
            (r.node, r.op_type, r.algo, r.memory_format, r.math_mode, r.source, r.problem or r.recorded_problem_key or "-") for r in rows
        ]
        widths = [max(len(str(row[i])) for row in table) for i in range(len(head) - 1)]
        lines = []
        for row in table:
            lines.append("  ".join(str(v).ljust(w) for v, w in zip(row, widths)) + "  " + str(row[-1]))
        return "\n".join(lines)

    @property
    def last_plan(self) -> Plan | None:
        return self._last_plan

    def graph_status(self) -> GraphStatus:
        """Whether the last plan runs as one captured CUDA graph, and if not, which node stopped it
        and why (:class:`~convpass.kernels.plan.GraphStatus`). Known from the second run of a plan on
        (the first builds it, the second warms it up and captures it)."""
        if self._last_plan is None:
            return GraphStatus(None, "no plan has run yet")
        return self._backend.graph_status(self._last_plan)

    @property
    def plans(self) -> list[Plan]:
        return list(self._plans.values())

    def __repr__(self) -> str:
        return (
            f"Executor(device={self.device!r}, inputs={[a.name for a in self._inputs]}, outputs={self._output_names}, "
            f"nodes={len(self._nodes)}, tuned={self.model_info is not None})"
        )

    # ------------------------------------------------------------------ feeds

    def _check_output_names(self, output_names: Sequence[str] | None) -> tuple[str, ...]:
        if output_names is None:
            return tuple(self._output_names)
        if isinstance(output_names, str):
            output_names = [output_names]
        unknown = [n for n in output_names if n not in self._output_names]
        if unknown:
            raise ExecutorError(
                f"unknown output name(s) {', '.join(map(repr, unknown))}; the model's outputs are: {', '.join(map(repr, self._output_names))}"
            )
        return tuple(output_names)

    def _describe_inputs(self) -> str:
        return ", ".join(f"{a.name!r} ({a.type} {_fmt_shape(a.shape)})" for a in self._inputs) or "(none)"

    def _check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(feeds, Mapping):
            raise ExecutorError(f"feeds must be a dict of input name -> array, not {type(feeds).__name__}")
        unknown = [k for k in feeds if k not in self._input_map]
        if unknown:
            over = [k for k in unknown if k in self._overridable]
            if over:
                raise ExecutorError(
                    f"input(s) {', '.join(map(repr, over))} have initializers, which the convpass executor treats as constants; "
                    "they cannot be fed"
                )
            raise ExecutorError(f"unknown input name(s) {', '.join(map(repr, unknown))}; the model's inputs are: {self._describe_inputs()}")
        missing = [a.name for a in self._inputs if a.name not in feeds]
        if missing:
            raise ExecutorError(f"missing input(s) {', '.join(map(repr, missing))}; the model's inputs are: {self._describe_inputs()}")
        arrays: dict[str, Any] = {}
        symbols: dict[str, tuple[int, str, int]] = {}
        xp = self._backend.xp
        for arg in self._inputs:
            value = feeds[arg.name]
            if not isinstance(value, (np.ndarray, xp.ndarray)) and xp is not np:
                adopted = self._backend.adopt(value)
                if adopted is not None:
                    value = adopted
            if not isinstance(value, (np.ndarray, xp.ndarray)):
                try:
                    value = np.asarray(value)
                except Exception as e:  # noqa: BLE001
                    raise ExecutorError(f"input {arg.name!r}: cannot convert {type(value).__name__} to an array: {e}") from None
            if value.dtype != arg.dtype:
                raise ExecutorError(
                    f"input {arg.name!r} has dtype {value.dtype}; the model expects {arg.dtype} ({arg.type})"
                )
            shape = tuple(int(d) for d in value.shape)
            if arg.shape is not None and len(arg.shape) != len(shape):
                raise ExecutorError(
                    f"input {arg.name!r} has rank {len(shape)} (shape {shape}); the model expects rank {len(arg.shape)} "
                    f"(shape {_fmt_shape(arg.shape)})"
                )
            for i, (want, got) in enumerate(zip(arg.shape or [], shape)):
                if isinstance(want, int) and want != got:
                    raise ExecutorError(
                        f"input {arg.name!r} dim {i} is {got}; the model expects {want} (shape {_fmt_shape(arg.shape)}, got {shape})"
                    )
                if isinstance(want, str) and want:
                    seen = symbols.get(want)
                    if seen is not None and seen[2] != got:
                        raise ExecutorError(
                            f"input {arg.name!r} dim {i} ({want!r}) is {got}, but input {seen[1]!r} dim {seen[0]} ({want!r}) is {seen[2]}"
                        )
                    symbols.setdefault(want, (i, arg.name, got))
            if xp is np or not isinstance(value, np.ndarray):
                arrays[arg.name] = value
            else:
                arrays[arg.name] = self._backend.upload_input(value)
        return arrays

    def _finish(self, value: Any, device_out: bool) -> Any:
        if device_out:
            return value
        return self._backend.to_host(value)

    # ------------------------------------------------------------------ plans

    def _all_conv_nodes(self) -> list[NodeInfo]:
        return [n for n in self._nodes if n.op_type in annotation.CONV_OPS]

    def _profile_for(self, arrays: Mapping[str, Any]) -> int | None:
        info = self.model_info
        if info is None or not info.profiles:
            return 0
        for i, p in enumerate(info.profiles):
            if all(name in arrays and tuple(arrays[name].shape) == tuple(shape) for name, shape in p.inputs.items()):
                return i
        return None

    def _needed(self, outputs: Sequence[str]) -> list[NodeInfo]:
        want = {o for o in outputs if o not in self._constants}
        needed: set[int] = set()
        stack = list(want)
        seen = set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            node = self._producers.get(v)
            if node is None:
                continue
            if id(node) not in needed:
                needed.add(id(node))
                stack.extend(i for i in node.inputs if i and i not in self._constants)
        return [n for n in self._nodes if id(n) in needed]

    def _device_constant(self, name: str, value: np.ndarray, plan_consts: dict[str, Any]) -> Any:
        if name in self._constants and self._constants[name] is value:
            dev = self._device_constants.get(name)
            if dev is None:
                dev = self._device_constants[name] = self._backend.upload(value)
            return dev
        dev = plan_consts.get(name)
        if dev is None:
            dev = plan_consts[name] = self._backend.upload(value)
        return dev

    def _build_plan(self, key: tuple[Any, ...], arrays: dict[str, Any], outputs: tuple[str, ...]) -> tuple[Plan, list[Any]]:
        backend = self._backend
        ctx = OpContext(backend)
        hctx = OpContext(host_backend())
        profile = self._plan_profile = self._profile_for(arrays)
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
                c = self._constants.get(name)
                if c is None:
                    raise ExecutorError(f"value {name!r} is used but never produced")
                v = vals[name] = _Val(True, c, tuple(c.shape), c.dtype, True)
            return v

        needed = self._needed(outputs)
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
                    convs.append(_summary(node, decision, prepared, prepared.profile, note))
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

        results = [vals[n].value if n in vals else self._constants[n] for n in outputs]
        plan = self._assemble(key, outputs, steps, vals, arrays, plan_consts, profile, convs, folded)
        apply_fusions(plan, self._fusion_decision, backend.to_host, backend.upload)
        backend.compile_plan(plan)
        return plan, unshare_outputs(results, plan, arrays)

    def _fusion_decision(self, unit: Any) -> tuple[bool, str, str]:
        """(fused, why, note) for a fusion unit of the plan being built (the ``fusions`` option)."""
        if self.fusions is not None:
            return bool(self.fusions), "forced" if self.fusions else "off", "Executor(fusions=...)"
        if not getattr(self._backend, "fuse", True):
            return False, "off", "the backend was made with fuse=False"
        decision = None
        if self.fusion_record is not None and self._plan_profile is not None:
            device = self._backend.fingerprint() or (self.model_info.device if self.model_info else "")
            decision = self.fusion_record.decision(unit_key(unit.names), device, self._plan_profile)
        if decision is None or decision.fused is None:
            return True, "rule", RULES[unit.kind]
        times = ", ".join(f"{k} {v:.4f} ms" for k, v in sorted(decision.times_ms.items()))
        return decision.fused, "measured", times

    def _decision(self, node: NodeInfo, profile: int | None) -> tuple[annotation.ConvDecision | None, str]:
        decisions = self._decisions.get(node.name)
        if decisions is None:
            return None, "untuned"
        if profile is None:
            return annotation.ConvDecision(), "no shape profile matches the inputs: decided at run time"
        return decisions[min(profile, len(decisions) - 1)], ""

    def _assemble(self, key, outputs, steps, vals, arrays, plan_consts, profile, convs, folded) -> Plan:
        slot_of: dict[str, int] = {}
        names: list[str] = []

        def slot(name: str) -> int:
            if name not in slot_of:
                slot_of[name] = len(names)
                names.append(name)
            return slot_of[name]

        for n in arrays:
            slot(n)
        for node, ins, outs in steps:
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
            elif v is None and n in self._constants:
                template[i] = self._device_constant(n, self._constants[n], plan_consts)
        last_use: dict[str, int] = {}
        for idx, (node, ins, outs) in enumerate(steps):
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

    def _execute(self, plan: Plan, arrays: Mapping[str, Any]) -> list[Any]:
        runner = getattr(self._backend, "run_plan", None)
        if runner is not None and plan.backend_state is not None:
            return runner(plan, arrays)
        env = list(plan.template)
        for name, s in plan.feed_slots.items():
            env[s] = arrays[name]
        ctx = OpContext(self._backend)
        for step in plan.steps:
            args = [env[i] if i >= 0 else None for i in step.inputs]
            try:
                outs = step.fn(ctx, step.node, *args)
            except ExecutorError as e:
                msg = str(e)
                raise ExecutorError(msg if step.node.name in msg else f"node {step.node.name!r} ({step.node.op_type}): {msg}") from None
            except (ValueError, IndexError, TypeError) as e:
                shapes = [None if a is None else tuple(a.shape) for a in args]
                raise ExecutorError(f"node {step.node.name!r} ({step.node.op_type}) failed on inputs of shapes {shapes}: {e}") from None
            store_outputs(env, step.outputs, outs)
            for s in step.free:
                env[s] = None
        return unshare_outputs([env[s] for s in plan.output_slots], plan, arrays)


# ---------------------------------------------------------------------------------------------
# helpers


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _on_device(value: Any, xp: Any) -> bool:
    """Whether a feed is a device array: an ``xp`` array or a CUDA DLPack tensor."""
    if isinstance(value, np.ndarray):
        return False
    if isinstance(value, xp.ndarray):
        return True
    probe = getattr(value, "__dlpack_device__", None)
    if probe is None:
        return False
    try:
        return int(probe()[0]) in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
    except Exception:  # noqa: BLE001
        return False


def _engine_algo(engine: str, fusion: str = "") -> str:
    """The recorded engine's algorithm name; ``fusion`` counts only when it is a graph-API fusion (a
    legacy epilogue beside an engine is the conv's business, not the name's). An engine that does
    not parse is shown as recorded: building the conv warns about it and runs the legacy algorithm."""
    from convpass.native.cudnn.graph_api import FUSIONS, EngineConfig

    try:
        return EngineConfig.parse(engine, fusion if fusion in FUSIONS else "").algo
    except ValueError:
        return engine


def _summary(node: NodeInfo, d: annotation.ConvDecision | None, call: ConvCall | None, profile: int | None, note: str) -> ConvSummary:
    problem = None
    if call is not None and call.geometry.shapes:
        candidates = [str(c) for c in call.geometry.shapes]  # 1-D convs have two 2-D mappings
        recorded = d.problem_key if d is not None else ""
        problem = next((c for c in candidates if recorded.startswith(c + "|")), candidates[0])
    if d is None:
        return ConvSummary(node.name, node.op_type, False, "-", "NCHW" if call is not None else "-", "-", "untuned", None, None, "", problem, None, note or "untuned")
    return ConvSummary(
        node=node.name,
        op_type=node.op_type,
        tuned=True,
        algo=_engine_algo(d.engine, d.fusion) if d.engine else d.algo,
        memory_format=d.memory_format,
        math_mode=d.math_mode,
        source=d.source,
        workspace_bytes=d.workspace_bytes,
        time_ms=d.time_ms,
        recorded_problem_key=d.problem_key,
        problem=problem,
        profile=profile,
        note=note,
    )


def _fmt_shape(shape: Sequence[Any] | None) -> str:
    if shape is None:
        return "[?]"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _node_arg(vi: onnx.ValueInfoProto) -> NodeArg:
    tt = vi.type.tensor_type
    shape: list[int | str | None] | None = None
    if tt.HasField("shape"):
        shape = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                shape.append(int(d.dim_value))
            elif d.HasField("dim_param"):
                shape.append(d.dim_param)
            else:
                shape.append(None)
    return NodeArg(vi.name, shape, ort_type_string(tt.elem_type), tt.elem_type)


def _by_profile(decisions: Iterable[Sequence[annotation.ConvDecision]]) -> list[annotation.ConvDecision]:
    """Every node's decisions, the first profile's (in node order) first."""
    columns = list(decisions)
    return [ds[i] for i in range(max(map(len, columns), default=0)) for ds in columns if i < len(ds)]


def _kernel_file(model: Any, digest: str | None, kernels: Any) -> tuple[kernel_file.KernelFile | None, str]:
    """The side-car to use, or None and why there is none (said if kernels compile at start-up)."""
    if kernels is False:
        return None, "the executor was made with kernels=False"
    if isinstance(kernels, (str, os.PathLike)):
        path = Path(kernels)
    elif isinstance(model, (str, os.PathLike)):
        path = kernel_file.sidecar_path(model)
        if not path.exists():
            return None, f"there is no kernel side-car {path.name} beside the model (`convpass compile {os.fspath(model)}` writes one)"
    else:
        return None, "the model was not given as a file, so no kernel side-car was looked for (Executor(..., kernels=PATH))"
    try:
        return kernel_file.read(path, model_sha256=digest), ""
    except kernel_file.KernelFileError as e:
        return None, f"the side-car was refused: {e}"


def _toposort(nodes: list[NodeInfo], available: set[str]) -> list[NodeInfo]:
    """Nodes in an order where every input is produced before use (stable for sorted graphs)."""
    produced_by: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for o in n.outputs:
            if o:
                if o in produced_by:
                    raise ExecutorError(f"value {o!r} is produced by two nodes")
                produced_by[o] = i
    deps = []
    for i, n in enumerate(nodes):
        d = set()
        for inp in n.inputs:
            if not inp or inp in available:
                continue
            if inp not in produced_by:
                raise ExecutorError(f"node {n.name!r} reads {inp!r}, which no node, input or initializer provides")
            d.add(produced_by[inp])
        deps.append(d)
    if all(all(j < i for j in d) for i, d in enumerate(deps)):
        return nodes
    order, done = [], set()
    pending = list(range(len(nodes)))
    while pending:
        progress = False
        rest = []
        for i in pending:
            if deps[i] <= done:
                order.append(i)
                done.add(i)
                progress = True
            else:
                rest.append(i)
        if not progress:
            raise ExecutorError(f"the graph has a cycle through node {nodes[rest[0]].name!r}")
        pending = rest
    return [nodes[i] for i in order]

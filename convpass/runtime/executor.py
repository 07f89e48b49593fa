"""The executor: runs an ONNX model (tuned by convpass or not) with a static plan per input shape.

Load (once per model, :class:`Executor`'s construction)
    read the file once (external initializers memory-mapped: :mod:`convpass.runtime.model_file`);
    hand its kernel side-car (``<model>.kernels``, :mod:`convpass.core.kernel_file`: the GPU
    kernels its plans need, compiled ahead of time) to the backend; validate (``onnx.checker``,
    whatever the side-car says); read the recorded decisions (:mod:`convpass.core.annotation`);
    inline what can be inlined and list *all* unsupported ops and element types in one
    :class:`ExecutorError` (:mod:`convpass.runtime.support`); bind every node to its op
    implementation, fold constants and BatchNormalization (:mod:`convpass.runtime.model_graph`).

Plan (once per input-shape signature: the feeds' names, shapes and dtypes, and the requested outputs)
    shapes folded on the host, convs given their shape profile's decision, a slot per value
    released after its last reader (:mod:`convpass.runtime.plan_builder`), then compiled by the backend.

Run
    feeds validated (:mod:`convpass.runtime.feeds`), the cached plan run on the backend; outputs
    as numpy arrays (``output_kind="numpy"``), backend arrays (``"device"``) or, by default
    (None), in the kind of the feeds: device arrays when any feed is one (CuPy, CUDA DLPack).
    What ran how: :mod:`convpass.runtime.summaries`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from convpass.core import annotation, kernel_file
from convpass.core.errors import ExecutorError
from convpass.kernels.backends import Backend
from convpass.kernels.fused_steps import FusionSummary, describe_fusions
from convpass.kernels.plan import ConvSummary, GraphStatus, Plan, store_outputs, unshare_outputs
from convpass.ops.registry import OpContext
from convpass.runtime import model_file
from convpass.runtime.devices import get_backend, open_ahead
from convpass.runtime.feeds import check_feeds, check_output_names, on_device
from convpass.runtime.model_graph import ModelGraph, NodeArg
from convpass.runtime.plan_builder import PlanBuilder
from convpass.runtime.summaries import conv_summary, format_conv_table
from convpass.runtime.support import SupportReport, check_support, is_supported, prepare_model

__all__ = ["Executor", "NodeArg", "SupportReport", "check_support", "is_supported", "prepare_model"]


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
            self.fusion_record = annotation.read_fusions(proto)
        except annotation.AnnotationError as e:
            raise ExecutorError(str(e)) from None
        self.fusions = fusions
        self._backend.bind_model(self.model_info)
        self._backend.ready_libraries({n.op_type for n in proto.graph.node if n.domain in ("", "ai.onnx")})
        # decisions by node name (the key annotation.read_node uses)
        self._decisions: dict[str, tuple[annotation.ConvDecision, ...]] = {ann.node_name: ann.decisions for ann in annotations}
        proto, report = prepare_model(proto)
        if not report.ok:
            raise ExecutorError(report.message())
        self._backend.prefetch(_by_profile(self._decisions.values()))
        self._graph = graph = ModelGraph(proto, constants, fold_batchnorm=fold_batchnorm)
        self.opsets, self.folded_constants, self.folded_batchnorms = graph.opsets, graph.folded_constants, graph.folded_batchnorms
        self._inputs, self._outputs, self._output_names = graph.inputs, graph.outputs, graph.output_names
        self._nodes, self._constants = graph.nodes, graph.constants
        self._builder = PlanBuilder(self._backend, graph, self._decisions, self.model_info, self.fusion_record)
        self._plans: dict[tuple[Any, ...], Plan] = {}
        self._last_plan: Plan | None = None

    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    @property
    def backend(self) -> Backend:
        return self._backend

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[Any]:
        """Run the model: ``feeds`` maps input names to arrays; returns the outputs in order. The
        first call with inputs of new shapes or dtypes builds their plan (on the GPU: and warms it up
        and captures it, which :meth:`prepare` does ahead of time); later calls replay it."""
        names = check_output_names(output_names, self._output_names)
        arrays = check_feeds(feeds, self._graph, self._backend)
        xp = self._backend.xp
        device_out = self.output_kind == "device" or (
            self.output_kind == "auto" and xp is not np and any(on_device(v, xp) for v in feeds.values())
        )
        plan, results = self._plan_and_run(arrays, names)
        self._last_plan = plan
        return [r if device_out else self._backend.to_host(r) for r in results]

    def prepare(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None) -> Plan:
        """Build the plan for inputs of ``feeds``' shapes and dtypes now (on the GPU: lower, compile,
        warm up and capture it), so that the first :meth:`run` with such inputs only replays it.
        A deployment calls this at start-up for each profile it serves; ``run`` does it by itself
        for a shape it has not seen. Returns the plan (already built: returned as it is)."""
        names = check_output_names(output_names, self._output_names)
        arrays = check_feeds(feeds, self._graph, self._backend)
        plan, _ = self._plan_and_run(arrays, names, run_cached=False)
        with self._backend.errstate():
            self._backend.warm_up(plan, arrays)
        return plan

    def _plan_and_run(self, arrays: dict[str, Any], names: tuple[str, ...], run_cached: bool = True) -> tuple[Plan, list[Any]]:
        """The plan for these inputs (built on first use) and the results of running it when
        ``run_cached`` (else none). Building runs the graph op by op once to record the plan; where
        the backend compiled the plan (the GPU: fused epilogues, engines, their algorithms, which
        compute within rounding of the op-by-op run but not bit for bit) those results are dropped
        and the plan runs at once (warm-up and capture in the first call), so every run, the first
        included, returns what the plan computes; where it compiled nothing, the recording run was
        the plan's steps and its results are returned."""
        signature = tuple((n, tuple(a.shape), str(a.dtype)) for n, a in sorted(arrays.items()))
        key = (signature, names)
        plan = self._plans.get(key)
        if plan is None:
            with self._backend.errstate():
                plan, results = self._builder.build(key, arrays, names, self.fusions)
            self._plans[key] = plan
            if plan.backend_state is None and run_cached:  # nothing compiled (the host): its steps are what just ran
                return plan, results
        if not run_cached:
            return plan, []
        results = self._backend.replay(plan, arrays)
        if results is None:
            with self._backend.errstate():
                results = _run_steps(self._backend, plan, arrays)
        return plan, results

    def plan_summary(self) -> list[ConvSummary]:
        """Per conv: the decision it runs with (from the last plan; the recorded ones before any run)."""
        if self._last_plan is not None:
            return list(self._last_plan.convs)
        out = []
        for node in self._graph.conv_nodes():
            decisions = self._decisions.get(node.name)
            d = decisions[0] if decisions else None
            out.append(conv_summary(node, d, None, 0 if decisions else None, ""))
        return out

    def fusion_summary(self) -> list[FusionSummary]:
        """Per fusion unit of the last plan: its nodes, whether it ran fused and why (empty before any run)."""
        return list(self._last_plan.fusions) if self._last_plan is not None else []

    def format_plan_summary(self) -> str:
        fusions = describe_fusions(self.fusion_summary())
        convs = format_conv_table(self.plan_summary())
        return convs + ("\n" + fusions if fusions else "")

    @property
    def last_plan(self) -> Plan | None:
        return self._last_plan

    def graph_status(self) -> GraphStatus:
        """Whether the last plan runs as one captured CUDA graph, and if not, which node stopped it
        and why (:class:`~convpass.kernels.plan.GraphStatus`). Known from the first run of a plan on
        (it builds the plan, then warms it up and captures it)."""
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


def _run_steps(backend: Backend, plan: Plan, arrays: Mapping[str, Any]) -> list[Any]:
    """Run ``plan``'s steps one by one with the op library (a backend that compiled the plan runs it itself)."""
    runner = getattr(backend, "run_plan", None)
    if runner is not None and plan.backend_state is not None:
        return runner(plan, arrays)
    env = list(plan.template)
    for name, s in plan.feed_slots.items():
        env[s] = arrays[name]
    ctx = OpContext(backend)
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


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

"""Convolutions of the cuda backend: the recorded choices, their fallbacks, fused epilogues. One
concept, how a conv's step runs (its decision, launch, epilogue, fallbacks and lowering), makes
this module longer than 600 lines.

Every Conv / ConvTranspose runs with the decision recorded in the model: the algorithm by name,
the memory format (NCHW / NHWC; NCW / NWC run as the 2-D mapping the problem key names, NCDHW /
NDHWC as 5-D descriptors) and the math type. A decision resolves
(:mod:`convpass.kernels.conv_resolve`) to the execution object the tuner timed
(:mod:`convpass.kernels.conv_exec`: a legacy cuDNN algorithm, cuDNN's fused call, a graph-API
engine, convpass's own kernel), and each launch of a conv's step calls that object's ``launch``
with its epilogue. Descriptors are built once per :class:`~convpass.core.problem.ProblemKey` and
kept; the workspace comes from one arena (a single CuPy buffer) sized, when the plan is compiled,
to the largest workspace the plan needs (:mod:`convpass.kernels.conv_resources`). This module is
the execution part. Conv with ``extra_pads`` zero-pads the input first (one copy, which also
converts the memory format); ConvTranspose is cuDNN's backward data into a buffer of the
uncropped size, its epilogue over it, then a cropped view.

Epilogues (:func:`lower_convs`, by the rule :func:`convpass.core.fusion.absorbed`): bias fused into ``cudnnConvolutionBiasActivationForward`` as
``relu`` when the only reader of the conv is a Relu (the Relu step is absorbed), as ``identity``
when the algorithm is ``implicit_precomp_gemm`` (the only one cuDNN fuses an identity with);
otherwise one element-wise pass (bias, residual and ReLU together). A residual ``Add`` that is the conv's only reader, whose other
operand is computed before the conv with the same shape, goes into the same call as its ``z``
input (``y = act(conv(x, w) + z + bias)``), with the following Relu when there is one; a Conv
without a bias does the same with the resources' zero bias (:meth:`ConvResources.zero_bias
<convpass.kernels.conv_resources.ConvResources.zero_bias>`, made when the plan is compiled). A fused
call cuDNN refuses falls back to the unfused form for good. A ConvTranspose adds its bias in one
element-wise pass after cuDNN's backward data; a Relu that is its only reader joins that pass.

Legacy epilogues in a graph-API engine: a Conv whose decision records an engine with a legacy
``fusion`` (``bias+add+relu``, ...) and whose step in the plan absorbs that epilogue runs conv,
bias, ``z`` and ReLU in the engine's one call (no pass after it:
:data:`~convpass.kernels.conv_exec.EPILOGUE_PASSES` counts none); a plan whose step is another
(fusion off, other readers) warns and runs the recorded legacy ``algo`` and one pass. An engine
recorded without a ``fusion`` runs the bare conv, then the epilogue as one pass.

Fused graph-API epilogues: a Conv whose decision records a fused engine (``fusion``, e.g.
``bias+swish``, ``bias+leakyrelu0.2``) and whose output is read only by that epilogue in the plan
(``Mul(y, Sigmoid(y))``, a ``LeakyRelu`` of that alpha) runs conv, bias and activation in the engine's one call, and its launch absorbs the epilogue's
steps; with ``+add`` the residual Add too (its other operand ``z`` read from the plan, in the conv's
memory format, copied there if it is not, or a channel slice read in place where the decision's
key names it: :mod:`convpass.kernels.conv_slices`; the launch writes the Add's output), or, where the decision
is the activation's graph alone, the Add stays the plan's own step. When the plan does not offer the epilogue (fusion off, another graph) the recorded legacy
``algo`` runs, with one warning; when the fused plan cannot be built, the same, and the epilogue's
steps run as usual. A decision of the engine's conv + bias graph (``fusion`` ``bias``: a model
tuned while an activation a Concat reads stayed out of the conv's step) runs that graph, and the
activation's steps as the plan's own, with no warning.

Slices of shared buffers (:mod:`convpass.kernels.conv_slices`): a conv reads a channel slice of a
Concat buffer, and writes its output into its slice of one, and a fused step reads its residual
from a channel slice, in place where its object and cuDNN take the strides, else with a copy; the
copies no tuning timed are said once per model (the residual's noted per node).

Decisions:

* Untuned convs (no decision, or ``algo == "auto"`` without an engine): cuDNN's heuristic first choice that is
  usable, in NCHW, with the recorded math mode when there is one (``default`` otherwise): one
  :class:`~convpass.native.cuda.ExecutorWarning` per executor counts them. The convs of a tuned
  model run at input shapes none of its profiles matches take the heuristic too, with one warning
  per shape naming the profiles (:mod:`convpass.runtime.cuda.lowering`), not called untuned.
* Re-validation: when the model's recorded device fingerprint is not this GPU, recorded
  algorithms are not trusted: every tuned conv takes the heuristic (NCHW, recorded math mode, so
  TF32 stays as decided) and one warning names the devices and the nodes. A recorded algorithm
  cuDNN refuses here (``workspace_size`` or the launch raises
  :class:`~convpass.native.cudnn.CudnnError`), or a recorded problem key that is not the problem the
  plan computes, falls back the same way with one warning naming the node. Nothing crashes,
  nothing changes silently. The executor never calls cuDNN's Find.
* Graph-API engines (a decision with ``engine``): the plan of ``y = conv(x, w)`` is built at
  plan-compile time (:class:`convpass.native.cudnn.graph_api.EnginePlan`) and enqueued on the stream, so
  it is captured like any launch; the residual, the bias and a Relu follow in one element-wise pass.
  cuDNN compiles some engines when their plan is built (a fraction of a second each), so built
  plans are stored in the model's kernel side-car (``convpass compile`` records them, as it does
  the CuPy kernels) and loaded from there in milliseconds; plans built at start-up anyway (no
  side-car, another cuDNN, a refused entry) that took :data:`ENGINE_BUILD_NOTE_S` or more in all
  are reported once as start-up compilation (:class:`~convpass.native.cuda.StartupCompileWarning`), with why.
  An engine that cannot be built here (package missing, another cuDNN, refused) warns once,
  naming the node, and the recorded legacy ``algo`` runs instead. The first eager run of each
  engine step is checked against a legacy algorithm of its problem (:mod:`convpass.kernels.engine_check`):
  one that computes wrongly there fails as one cuDNN refuses to run does: warned, and the recorded
  legacy ``algo`` runs instead (in the engine's memory format), else the heuristic's choice.
* convpass's own depthwise kernel (a decision whose ``algo`` names it:
  :mod:`convpass.kernels.depthwise`) is built at plan-compile time (from the kernel side-car
  when the model has one) and runs with the legacy epilogue in the kernel where the decision
  recorded that, else the bare kernel and one pass; it writes into Concat slices directly. A name
  or geometry it refuses, or a kernel that does not build, warns once naming the node and runs
  cuDNN's heuristic choice.
* Geometries cuDNN cannot express (``shapes == ()``) or dtypes it is not asked for (float64) run
  :func:`convpass.ops.conv.conv_reference` over CuPy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from convpass.core import annotation
from convpass.core.concat_slices import conv_step_writes_slice
from convpass.core.fusion import absorbed, adds_residual, is_graph_fusion, is_legacy, legacy_name
from convpass.kernels import engine_check
from convpass.kernels.conv_exec import (
    EPILOGUE_PASSES,
    ConvExec,
    EngineConv,
    FusedLegacyConv,
    LegacyConv,
    apply_epilogue,
    conv_exec,
    refuses_slice,
    step_epilogue,
)
from convpass.kernels.conv_resolve import ENGINE_BUILD_NOTE_S, ENGINE_COMPILATIONS, REFERENCE, ConvResolution, ConvResolver, describe_exec, summarize
from convpass.kernels.conv_resources import ConvResources, map_1d
from convpass.kernels.conv_slices import (
    copy_why,
    priced,
    reads_in_place,
    remember_refusal,
    remember_residual_refusal,
    residual_copied,
    residual_in_place,
    said_if_unpriced,
    same_order,
    slice_copy,
    slice_words,
    unpriced_copy,
    writes_in_place,
)
from convpass.kernels.launch import Launch
from convpass.kernels.plan_steps import PlanSteps
from convpass.native import cudnn
from convpass.native.cuda import CaptureBreak, copy_into, first_line, storage
from convpass.native.cudnn import graph_api
from convpass.native.cudnn.graph_api import GraphApiError, InputRefused, OutputRefused, ResidualRefused
from convpass.ops import conv as conv_kernels
from convpass.ops.conv import ConvCall, ConvGeometry

logger = logging.getLogger("convpass")

# the backend and the lowering reach the conv family through this module
__all__ = ["ENGINE_BUILD_NOTE_S", "ENGINE_COMPILATIONS", "REFERENCE", "ConvLaunch", "Convolutions", "lower_convs", "summarize"]


class Convolutions:
    """The conv state of one backend: its resolutions (:class:`~convpass.kernels.conv_resolve.ConvResolver`),
    descriptors, converted weights and the workspace arena (:class:`~convpass.kernels.conv_resources.ConvResources`),
    and the execution of each launch. ``rt`` is the backend: ``cp``, ``device_id``, ``fuse``, ``counters``,
    ``is_constant(a)``, ``warn_node(node, message)``, ``note_once(tag, message)``, ``capturing``, and the
    device check (``recorded_device``, ``current_device``)."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.cp = rt.cp
        self.resources = ConvResources(rt)
        self.resolver = ConvResolver(rt, self.resources)

    @property
    def engine_builds(self) -> list[tuple[str, float, str]]:
        """(node, seconds, why not loaded) per graph-API plan built."""
        return self.resolver.engine_builds

    @property
    def executions(self) -> list[Any]:
        """The execution objects resolved so far, one per (convolution, dtype, fusion)."""
        return self.resolver.executions()

    @property
    def mismatch_nodes(self) -> list[str]:
        """The nodes whose decisions were taken on another GPU."""
        return self.resolver.mismatch_nodes

    def prefetch_workspaces(self, decisions: Iterable[annotation.ConvDecision]) -> None:
        """:meth:`ConvResources.prefetch_workspaces <convpass.kernels.conv_resources.ConvResources.prefetch_workspaces>`,
        unless the recorded algorithms do not run here (another GPU: the heuristic runs instead)."""
        if not self.resolver.device_mismatch:
            self.resources.prefetch_workspaces(decisions)

    def resolve(self, call: ConvCall, dtype: Any, fusion: str | None = None) -> Any:
        """:meth:`ConvResolver.resolve <convpass.kernels.conv_resolve.ConvResolver.resolve>`."""
        return self.resolver.resolve(call, dtype, fusion)

    # ------------------------------------------------------------------ compile time

    def prepare(self, call: ConvCall, x_dtype: Any, w: Any, fusion: str | None = None) -> Any:
        """Resolve ``call`` for inputs of ``x_dtype``, convert a constant weight to what its execution
        object reads and grow the workspace arena: everything a launch must not do while a CUDA
        graph is captured. Returns the resolution."""
        ex = self.resolve(call, x_dtype, fusion)
        if ex is not REFERENCE:
            if w is not None and w.dtype == x_dtype:
                self.resources.weight(w, ex)
            self.resources.workspace(ex.workspace)
        return ex

    # ------------------------------------------------------------------ execution

    def run(self, call: ConvCall, x: Any, w: Any, b: Any, relu: bool = False, z: Any = None, out: Any = None,
            fusion: str | None = None, fused: bool = False) -> Any:
        """The conv of ``call`` plus bias, plus the residual ``z`` when given, then ReLU if asked;
        written into ``out`` (a slice of a Concat buffer) when given. ``fusion``: the epilogue the
        plan lets this conv fuse (as at :meth:`prepare`; None: op by op, see :meth:`resolve`);
        ``fused``: the launch owns it, so its activation is applied here (in the engine's call, or
        as a pass after a fallback), and with a fused graph's ``+add`` its residual ``z`` after
        the activation, not before as a legacy epilogue's. A legacy ``fusion`` is always the
        launch's own (its Add and Relu are absorbed): the engine's graph of it runs where the
        decision records one, else the conv and its epilogue as ever."""
        ex = self.resolve(call, x.dtype, fusion)
        if _runs_fused(ex) and not fused and not is_legacy(ex.conv.epilogue):  # its activation would run twice (the plan's own steps too)
            raise RuntimeError(f"node {call.node_name!r}: a fused graph-API engine resolved for a launch that does not own its epilogue")
        after = (fusion or "") if fused and not _runs_fused(ex) else ""
        pre, post = _residual_order(after, z)
        if ex is REFERENCE or w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
            return self._into(self._activate(self._reference(call, x, w, b, relu, pre), after, post), out)
        try:
            return self._finish(self._run(ex, x, w, b, relu, pre, None if after else out), after, out, post)
        except (cudnn.CudnnError, GraphApiError) as e:
            if self.rt.capturing or ex.source != "recorded":
                raise
            # the recorded algorithm was accepted by workspace_size but cuDNN refuses to run it
            why = f"recorded algorithm {ex.algo!r} ({ex.layout}, {ex.key.math}) failed here: {first_line(e)}"
            new = self.resolver.legacy_instead(ex) if isinstance(ex.conv, EngineConv) else None
            instead = "its recorded legacy algorithm" if new is not None else "cuDNN's heuristic choice"
            new = new or self.resolver.heuristic_exec(call, "fallback", why, ex.key.math)
            self.resolver.replace(call, x.dtype, fusion, new)
            self.rt.warn_node(call.node_name, f"node {call.node_name!r}: {why}; running {instead} {describe_exec(new)} instead")
            after = (fusion or "") if fused else ""
            pre, post = _residual_order(after, z)
            if new is REFERENCE:
                return self._into(self._activate(self._reference(call, x, w, b, relu, pre), after, post), out)
            self.resources.workspace(new.workspace)
            return self._finish(self._run(new, x, w, b, relu, pre, None if after else out), after, out, post)

    def _finish(self, y: Any, after: str, out: Any, z: Any = None) -> Any:
        return self._into(self._activate(y, after, z), out) if after else y

    def _activate(self, y: Any, fusion: str, z: Any = None) -> Any:
        """``fusion``'s activation over ``y`` in place, with CuPy ufuncs (the reference of
        :func:`~convpass.native.cudnn.graph_api.fusion_of`), then ``+ z`` for a fusion with its
        residual: only where a fused engine could not run after its launch absorbed the epilogue
        (warned), never on the planned path."""
        if not fusion:
            return y
        if adds_residual(fusion) and z is None:
            raise ValueError(f"the epilogue {fusion!r} adds a residual, and none was given")
        self.rt.counters[EPILOGUE_PASSES] += 1
        phys = storage(y)
        phys[...] = graph_api.fusion_of(fusion).apply(self.cp, phys)
        if z is not None:
            self.cp.add(y, z, out=y)
        return y

    def _into(self, y: Any, out: Any) -> Any:
        """``y``, or copied into ``out`` (its Concat slice), a copy counted in ``slice_write_copies``."""
        if out is None:
            return y
        self.rt.counters["slice_write_copies"] += 1
        copy_into(out, y)
        return out

    def _reference(self, call: ConvCall, x: Any, w: Any, b: Any, relu: bool, z: Any = None) -> Any:
        self.rt.counters["reference_convs"] += 1
        g = call.geometry
        if g.op_type == "ConvTranspose":
            y = conv_kernels.conv_transpose_reference(self.cp, x, w, b, g)
        else:
            y = conv_kernels.conv_reference(self.cp, x, w, b, g)
        if z is not None:
            y = y + z
        if relu:
            y = self.cp.maximum(y, y.dtype.type(0))
        return y

    def _prepad(self, x: Any, g: ConvGeometry, layout: str) -> Any:
        r = g.spatial_rank
        eb, ee = g.extra_pads[:r], g.extra_pads[r:]
        shape = (x.shape[0], x.shape[1], *(x.shape[2 + i] + eb[i] + ee[i] for i in range(r)))
        out = cudnn.empty_like_layout(shape, x.dtype, layout)
        storage(out).fill(0)  # in memory order: coalesced
        out[(slice(None), slice(None), *(slice(eb[i], eb[i] + x.shape[2 + i]) for i in range(r)))] = x
        return out

    def _in_layout(self, a: Any, ex: ConvResolution) -> Any:
        """``a`` mapped as the conv runs (1-D convs) and in its memory format (a counted copy when not)."""
        mapped = map_1d(a, ex.insert_axis)
        stored = cudnn.as_layout(mapped, ex.layout)
        if stored is not mapped:
            self.rt.counters["layout_copies"] += 1
        return stored

    def _launch(self, conv: ConvExec, x: Any, w: Any, y: Any, ws: Any, b: Any, z: Any = None) -> None:
        """``conv.launch`` with the bias it reads, and the backend's counters of it."""
        bias = self.resources.bias(b) if b is not None and conv.contiguous_bias else b
        conv.launch(x, w, y, ws, bias, z)
        for counter in conv.counts:
            self.rt.counters[counter] += 1

    def _run(self, ex: ConvResolution, x: Any, w: Any, b: Any, relu: bool, z: Any = None, out: Any = None,
             slices: tuple[bool, bool] | None = None) -> Any:
        """``act(conv(x, w) + z + b)`` by the execution object of the step (:meth:`_step`): its
        input padded, mapped and in its memory format or the Concat slice itself where the object
        reads slices, its output packed or ``out`` itself where the object writes slices (module
        docstring, placement). ``slices``: (read, write) a slice where the object can, for this
        launch only, a refusal raised (None: as ``ex`` learned, a refusal handled)."""
        g = ex.geometry
        wk = self.resources.weight(w, ex)
        ws = self.resources.workspace(ex.workspace)
        if ex.op_type == "ConvTranspose":
            return self._run_transpose(ex, x, wk, b, relu, ws, out)
        read_ok, write_ok = (ex.strided_input_ok, ex.strided_output_ok) if slices is None else slices
        conv = self._step(ex, b, relu, z)
        z4, z_read = (None, False) if z is None else self._residual(z, ex, conv)  # as the step's object reads it
        xp = self._prepad(x, g, ex.layout) if any(g.extra_pads) else x
        sliced = ex.insert_axis is None and cudnn.channel_slice(xp, ex.layout)
        # an engine's plan built for the key's slice reads any x of those strides (by strides: at
        # batch 1 a channels-first slice looks packed); legacy calls read any channel slice
        own = ex.insert_axis is None and conv.input_slice_strides is not None
        read = read_ok and (own or sliced) and reads_in_place(conv, xp)
        if sliced and not read and ex.source == "recorded" and not priced(ex.key.x_strides, xp):
            unpriced_copy(self.rt, ex, copy_why(ex, conv))
        elif own and read_ok and not read and ex.source == "recorded":  # a packed x copied into the slice's strides
            unpriced_copy(self.rt, ex, copy_why(ex, conv), packed=True)
        x4 = xp if read else self._input(xp, ex, conv)
        direct = out is not None and ex.insert_axis is None and (
            conv.output_strides == "any"
            or (conv.output_strides == "same_order" and z is None and write_ok and same_order(out, ex.layout))
            or (write_ok and writes_in_place(conv, out)))
        write = direct and conv.output_strides != "any"  # cuDNN writes the slice (its legacy call, or an engine's plan)
        y = out if direct else self._output(g.output_shape, x.dtype, ex, conv)
        y4 = map_1d(y, ex.insert_axis)
        try:
            self._launch(conv, x4, wk, y4, ws, b, z4)
        except (cudnn.CudnnError, ValueError, GraphApiError) as e:
            if z_read and isinstance(e, ResidualRefused):  # its residual slice refused: copied from now on
                remember_residual_refusal(self.rt, ex, e)
                return self._run(ex, x, w, b, relu, z, out, slices)
            # its plan refuses the input slice, or the output slice, in place: copied from now on
            plan_refused = (read and isinstance(e, InputRefused), write and isinstance(e, OutputRefused))
            if any(plan_refused):
                if slices is not None:
                    raise
                return self._slices_refused(ex, e, *plan_refused, x, w, b, relu, z, out)
            if isinstance(e, GraphApiError):
                raise
            if (read or write) and refuses_slice(e, write):
                if slices is not None:
                    raise
                return self._slices_refused(ex, e, read, write, x, w, b, relu, z, out)
            if isinstance(conv, FusedLegacyConv):  # cuDNN refuses the fused call: the conv, then one pass
                self._fused_refused(ex, conv, e)
                self._launch(self._step(ex, b, relu, z4), x4, wk, y4, ws, b, z4)
            else:
                raise
        if isinstance(conv, EngineConv) and not ex.engine_checked:  # wrong: a GraphApiError, run()'s warned fallback
            engine_check.first_run(self, ex, conv, x4, wk, y4, b, z4)
        if z_read:
            self.rt.counters["residual_slice_reads"] += 1
        if read:
            self.rt.counters["slice_reads"] += 1
        elif sliced:  # counted once the launch ran: a refused try of the warm-up run copies for nothing
            self.rt.counters["slice_copies"] += 1
        if direct:
            self.rt.counters["slice_writes"] += 1
            return y
        if out is not None:
            said_if_unpriced(self.rt, ex, conv, out)
        elif conv.output_slice_strides is not None:  # a plan writing a slice's strides, its output wanted packed
            if ex.source == "recorded":  # tuned writing the slice in place (a bare engine whose activation runs as its own step)
                unpriced_copy(self.rt, ex, "its engine's plan writes its Concat slice's strides only, and the activation after it "
                              "runs as the plan's own step", which="output", packed=True)
            return self._in_layout(y, ex)
        return self._into(y, out)

    def _run_transpose(self, ex: ConvResolution, x: Any, wk: Any, b: Any, relu: bool, ws: Any, out: Any) -> Any:
        """A ConvTranspose: cuDNN's backward data into a buffer of the uncropped size, its bias
        (and ReLU) as one pass, then a cropped view. Written into ``out`` (a Concat slice), the
        pass reads the conv's result and writes the slice: no copy after it."""
        g = ex.geometry
        r = g.spatial_rank
        dy = self._in_layout(x, ex)
        full_spatial = tuple(g.output_shape[2 + i] + g.extra_pads[i] + g.extra_pads[r + i] for i in range(r))
        full = cudnn.empty_like_layout((g.output_shape[0], g.output_shape[1], *full_spatial), x.dtype, ex.layout)
        into = out is not None and (b is not None or relu)
        if into:
            self._launch(self._step(ex, None, False, None), map_1d(full, ex.insert_axis), wk, dy, ws, None)
        else:
            self._launch(self._step(ex, b, relu, None), map_1d(full, ex.insert_axis), wk, dy, ws, b)
        y = full
        if any(g.extra_pads):
            y = full[(slice(None), slice(None), *(slice(g.extra_pads[i], g.extra_pads[i] + g.output_shape[2 + i]) for i in range(r)))]
        if into:
            apply_epilogue(self.cp, out, b, relu, src=y)
            self.rt.counters["slice_writes"] += 1
            self.rt.counters[EPILOGUE_PASSES] += 1
            return out
        return self._into(y, out)  # without a pass, backward data's packed result is copied in

    def _step(self, ex: ConvResolution, b: Any, relu: bool, z4: Any) -> ConvExec:
        """The execution object of the step ``act(conv + z + b)`` (a fused engine: its graph's
        epilogue), made once per resolution and step from the decision's object: the legacy
        epilogue fused into the algorithm's call or convpass's kernel where :meth:`_fused_activation`
        says so (a legacy call only with the backend's fusion on), else run as one pass after."""
        step = step_epilogue(b is not None, z4 is not None, relu)
        name = ex.conv.epilogue if _runs_fused(ex) else step
        if is_legacy(name) and name != step:  # an engine's legacy graph runs exactly its launch's step
            raise RuntimeError(f"node {ex.node!r}: the engine's fused graph runs conv + {name}, not this launch's conv + {step}")
        conv = ex.steps.get(name)
        if conv is None:
            fuse = False
            if b is not None and ex.key.shape.direction == "fwd" and not isinstance(ex.conv, EngineConv):
                legacy = isinstance(ex.conv, LegacyConv)
                fuse = (self.rt.fuse or not legacy) and self._fused_activation(ex, b, relu, z4) is not None
            if name == ex.conv.epilogue and not fuse:
                conv = ex.steps[name] = ex.conv
            else:
                conv = ex.steps[name] = conv_exec(ex.key, ex.conv.algo.fused(name) if fuse else ex.conv.algo, name, like=ex.conv)
        return conv

    def _fused_activation(self, ex: ConvResolution, b: Any, relu: bool, z4: Any) -> str | None:
        """The activation to pass cuDNN's fused conv + bias call (or convpass's kernel), or None to
        run the conv alone and the epilogue as one pass: what the recorded decision measured
        (``ex.fused_call``); for an untuned conv, the fused call wherever cuDNN has not refused it."""
        step = legacy_name(z4 is not None, relu)
        if ex.fused_call is not None:
            if ex.fused_call and ex.fused_call != step and not ex.op_by_op:
                self.rt.warn_node(ex.node, f"node {ex.node!r}: the recorded fused call runs conv + {ex.fused_call}, but this plan's step "
                                           f"is conv + {step} (fusion off, or its readers differ): running the conv, then one pass")
            return None if ex.fused_call != step else ("relu" if relu else "identity")
        if z4 is not None:
            ok = ex.fuse_residual_ok and (relu or ex.algo == "implicit_precomp_gemm")
        elif relu:
            ok = ex.fuse_relu_ok
        else:
            ok = ex.algo == "implicit_precomp_gemm" and ex.fuse_identity_ok
        return ("relu" if relu else "identity") if ok else None

    def _fused_refused(self, ex: ConvResolution, conv: FusedLegacyConv, e: Exception) -> None:
        """cuDNN refused the fused call ``conv``: the conv and one pass from now on, said once where
        the decision recorded that call (the tuner ran it), quietly for an untuned conv."""
        if conv.residual:
            ex.fuse_residual_ok = False
        elif conv.relu:
            ex.fuse_relu_ok = False
        else:
            ex.fuse_identity_ok = False
        activation = "relu" if conv.relu else "identity"
        what = f"{'residual + ' if conv.residual else ''}{activation}"
        message = f"node {ex.node!r}: cuDNN refuses the fused conv + bias + {what} ({first_line(e)}); running them apart"
        if ex.fused_call:  # the tuner ran this call: a refusal here is news
            self.rt.warn_node(ex.node, message)
            ex.fused_call = ""
        else:
            logger.debug(message)
        ex.steps.clear()

    def _slices_refused(self, ex: ConvResolution, e: Exception, read: bool, write: bool,
                        x: Any, w: Any, b: Any, relu: bool, z: Any, out: Any) -> Any:
        """cuDNN refused a launch that read its input from a Concat slice (``read``) or wrote its
        output into one (``write``): where it did both, each alone is tried to learn which it
        refuses; what it refuses runs packed (a copy) from now on, said once at debug level. Never
        while a CUDA graph is captured: the warm-up run before it meets every refusal."""
        if self.rt.capturing:
            raise CaptureBreak(f"cuDNN refused to {slice_words(read, write)} during capture: {first_line(e)}")
        for alone in ((False, True), (True, False)) if read and write else ():
            try:
                y = self._run(ex, x, w, b, relu, z, out, slices=alone)
            except (cudnn.CudnnError, GraphApiError):  # cuDNN's refusal, or an engine plan's (InputRefused, OutputRefused)
                continue
            remember_refusal(ex, e, not alone[0], not alone[1])
            return y
        remember_refusal(ex, e, read, write)
        return self._run(ex, x, w, b, relu, z, out)

    def _output(self, shape: tuple[int, ...], dtype: Any, ex: ConvResolution, conv: ConvExec) -> Any:
        """A new output of ``shape`` as the step's object ``conv`` writes it where not the slice itself
        (rule 1 of :mod:`convpass.kernels.conv_slices`): packed in the conv's memory format, or for a
        plan built for the key's output slice the first channels of a buffer of those strides."""
        if conv.output_slice_strides is None or ex.key.y_slice is None:
            return cudnn.empty_like_layout(shape, dtype, ex.layout)
        return cudnn.empty_like_layout((shape[0], ex.key.y_slice.channels, *shape[2:]), dtype, ex.layout)[:, :shape[1]]

    def _input(self, x: Any, ex: ConvResolution, conv: ConvExec) -> Any:
        """The input ``x`` as the step's object ``conv`` reads it where not the slice itself (rule 2 of
        :mod:`convpass.kernels.conv_slices`): in the conv's memory format, or for a plan built for
        the key's input slice copied into a buffer of those strides (a counted layout copy)."""
        if conv.input_slice_strides is None or ex.key.x_slice is None:
            return self._in_layout(x, ex)
        self.rt.counters["layout_copies"] += 1
        return slice_copy(map_1d(x, ex.insert_axis), ex.key.x_slice.channels, ex.layout)

    def _residual(self, z: Any, ex: ConvResolution, conv: ConvExec) -> tuple[Any, bool]:
        """The residual ``z`` as the step's object ``conv`` reads it, and whether that is ``z``
        itself, read in place (rule 5 of :mod:`convpass.kernels.conv_slices`)."""
        if residual_in_place(ex, conv, z):
            return z, True
        z4 = self._in_layout(z, ex) if conv.residual_strides is None else slice_copy(z, ex.key.z_slice.channels if ex.key.z_slice else z.shape[1], ex.layout)
        if z4 is not map_1d(z, ex.insert_axis):
            residual_copied(self.rt, ex, conv, z)
        return z4, False


def _residual_order(after: str, z: Any) -> tuple[Any, Any]:
    """``(z added before the activation, z added after it)`` of a launch whose fused epilogue
    ``after`` runs apart from the conv: a graph-API fusion's ``+add`` adds its residual after the
    activation; otherwise ``z`` is a legacy epilogue's, added before the ReLU."""
    return (None, z) if adds_residual(after) else (z, None)


def _runs_fused(ex: Any) -> bool:
    """Whether a resolution runs a fused graph-API epilogue in its engine's call."""
    return isinstance(ex, ConvResolution) and isinstance(ex.conv, EngineConv) and ex.conv.fused


# ---------------------------------------------------------------------------------------------
# lowering


class ConvLaunch(Launch):
    """One Conv / ConvTranspose step with its fused epilogue (``epilogue``: None, ``"relu"``,
    ``("residual", z slot, activation)`` or ``("engine", fusion, z slot or None)``: a fused
    graph-API engine, the slot of its residual where the fusion ends with ``+add``).
    ``fusion``: the epilogue the plan lets this conv fuse, which its exec is resolved with (the
    launch owns a graph-API activation's only with an ``"engine"`` epilogue, a legacy one's always)."""

    def __init__(self, plan: Any, index: int, convs: Convolutions, epilogue: Any, output: int, absorbs: tuple[int, ...],
                 fusion: str = "") -> None:
        step = plan.steps[index]
        label = step.node.op_type
        if epilogue == "relu":
            label += "+relu"
        elif epilogue is not None and epilogue[0] == "engine":
            label += f"+{epilogue[1]}"
        elif epilogue is not None:
            label += f"+residual+{epilogue[2]}"
        super().__init__(index, step.node, label, (output,), absorbs)
        self.fusion = fusion
        self.convs = convs
        self.call: ConvCall = step.node.prepared
        self.inputs = step.inputs
        self.epilogue = epilogue
        # a plain Conv writes into a Concat slice through a strided output descriptor, a ConvTranspose
        # through its epilogue's pass (or a copy where it has none): rule 4 of convpass.core.concat_slices
        self.supports_placement = conv_step_writes_slice(step.node.op_type, _epilogue_name(epilogue))
        x = plan.info(step.inputs[0])
        self.x_dtype = None if x is None else x[1]
        self.w_const = plan.template[step.inputs[1]] if len(step.inputs) > 1 and step.inputs[1] >= 0 else None
        self.exec: Any = None
        # a residual step of a conv without a bias reads a zero bias (convpass.core.fusion, "A conv without a bias")
        self.zero_bias = epilogue is not None and epilogue[0] == "residual" and not (len(step.inputs) > 2 and step.inputs[2] >= 0)
        self._zeros: Any = None

    def prepare(self) -> None:
        if self.x_dtype is not None:
            self.exec = self.convs.prepare(self.call, self.x_dtype, self.w_const, self.fusion)
            if self.zero_bias:
                self._zeros = self.convs.resources.zero_bias(self.call.geometry.output_shape[1], self.x_dtype)

    def run(self, env: list[Any]) -> None:
        ins = self.inputs
        x, w = env[ins[0]], env[ins[1]]
        b = env[ins[2]] if len(ins) > 2 and ins[2] >= 0 else None
        if self.zero_bias:
            b = self._zeros if self._zeros is not None else self.convs.resources.zero_bias(self.call.geometry.output_shape[1], x.dtype)
        e = self.epilogue
        out = self.destination(env, self._layout())
        if e is None or e == "relu":
            env[self.outputs[0]] = self.convs.run(self.call, x, w, b, relu=e == "relu", out=out, fusion=self.fusion)
        elif e[0] == "engine":
            z = None if e[2] is None else env[e[2]]
            env[self.outputs[0]] = self.convs.run(self.call, x, w, b, z=z, out=out, fusion=self.fusion, fused=True)
        else:
            env[self.outputs[0]] = self.convs.run(self.call, x, w, b, relu=e[2] == "relu", z=env[e[1]], out=out, fusion=self.fusion)

    def _layout(self) -> str:
        return self.exec.layout if isinstance(self.exec, ConvResolution) else "nchw"


def _epilogue_name(epilogue: Any) -> str:
    """The :mod:`convpass.core.fusion` name of a :class:`ConvLaunch`'s ``epilogue`` (a bias alone: ``""``)."""
    if epilogue is None or epilogue == "relu":
        return epilogue or ""
    return epilogue[1] if epilogue[0] == "engine" else legacy_name(True, epilogue[2] == "relu")


def _declined_graph_fusion(d: annotation.ConvDecision | None) -> str:
    """The ``fusion`` of a launch whose graph-API fusion does not run fused (its activation's nodes
    run as the plan's own steps): ``bias``, the only epilogue the launch owns without the
    activation, where the decision records an engine's fused graph of it, else ``""``. A model
    tuned while a graph-API activation that a Concat reads was not absorbed records such a conv
    so (its step was ``bias``): its engine's conv + bias graph runs, as it was timed."""
    bias = legacy_name(False, False)
    return bias if d is not None and d.engine and d.fusion == bias else ""


def lower_convs(plan: Any, convs: Convolutions, fuse: bool, fuse_residual: bool) -> dict[int, ConvLaunch]:
    """A launch per Conv / ConvTranspose step of ``plan``, each absorbing what
    :func:`convpass.core.fusion.absorbed` gives its step (the rule the tuner timed); the steps they
    absorb are listed in each launch's ``absorbs``. A legacy epilogue's step (``bias``,
    ``bias+relu``, ``bias+add``, ``bias+add+relu``) is its launch's ``fusion``: the engine's fused
    graph of it runs in the launch where its decision records that graph, else the conv and one
    pass (or cuDNN's legacy fused call). A graph-API fusion's step (``bias+swish``,
    ``bias+leakyrelu<alpha>``, either with ``+add``) runs fused only when its recorded decision is
    that fused graph and its plan builds here; a step with its residual whose decision is the
    shorter graph (the activation's alone) runs that, the Add as the plan's own step; otherwise the
    conv runs with its bias and the activation's nodes (Sigmoid and Mul, the LeakyRelu, the Add)
    run as the plan's own steps; the launch's ``fusion`` is then ``bias`` where the decision records
    an engine's fused conv + bias graph (:func:`_declined_graph_fusion`), so that graph runs. A step
    that absorbs the Add writes the Add's output slot (the conv's own output is never stored)."""
    steps = plan.steps
    taken: set[int] = set()
    view = PlanSteps(plan, taken)
    launches: dict[int, ConvLaunch] = {}
    for i, st in enumerate(steps):
        node = st.node
        if not isinstance(node.prepared, ConvCall):
            continue
        y = st.outputs[0] if st.outputs else -1
        epilogue, out, absorbs, fusion = None, y, (), ""
        if fuse and node.prepared.geometry.shapes:
            view.conv = i
            a = absorbed(view, i, residual=fuse_residual)
            if is_graph_fusion(a.epilogue):
                d = node.prepared.decision
                x = plan.info(st.inputs[0])
                form = next((f for f in (a, a.shorter) if f is not None and d is not None and d.fusion == f.epilogue), None)
                if form is not None and x is not None and _runs_fused(convs.resolve(node.prepared, x[1], form.epilogue)):
                    epilogue, out, absorbs, fusion = ("engine", form.epilogue, form.z), form.output, form.nodes, form.epilogue
                else:
                    fusion = _declined_graph_fusion(d)
            elif a.epilogue in ("bias+add", "bias+add+relu"):
                epilogue, out, absorbs = ("residual", a.z, "relu" if a.epilogue.endswith("+relu") else "identity"), a.output, a.nodes
            elif a.epilogue in ("bias+relu", "relu"):
                epilogue, out, absorbs = "relu", a.output, a.nodes
            if is_legacy(a.epilogue):  # the launch owns it: an engine's graph of it runs where the decision records one
                fusion = a.epilogue
        taken.update(absorbs)
        launches[i] = ConvLaunch(plan, i, convs, epilogue, out, absorbs, fusion)
    return launches

"""Convolutions of the cuda backend: the recorded cuDNN choices, their fallbacks, fused epilogues.

Every Conv / ConvTranspose runs through :mod:`convpass.native.cudnn` with the decision recorded in the
model: the algorithm by name, the memory format (NCHW / NHWC; NCW / NWC run as the 2-D mapping
the problem key names, NCDHW / NDHWC as 5-D descriptors) and the math type. Descriptors are
built once per :class:`~convpass.core.problem.ProblemKey` and kept; the workspace comes from one
arena (a single CuPy buffer) sized, when the plan is compiled, to the largest workspace the plan
needs. Conv with ``extra_pads`` zero-pads the input first (one copy, which also converts the
memory format); ConvTranspose is cuDNN's backward data into a buffer of the uncropped size, then
a cropped view.

Epilogues (:func:`lower_convs`, by the rule :func:`convpass.core.fusion.absorbed`): bias fused into ``cudnnConvolutionBiasActivationForward`` as
``relu`` when the only reader of the conv is a Relu (the Relu step is absorbed), as ``identity``
when the algorithm is ``implicit_precomp_gemm`` (the only one cuDNN fuses an identity with);
otherwise one element-wise pass (bias, residual and ReLU together). A residual ``Add`` that is the conv's only reader, whose other
operand is computed before the conv with the same shape, goes into the same call as its ``z``
input (``y = act(conv(x, w) + z + bias)``), with the following Relu when there is one. A fused
call cuDNN refuses falls back to the unfused form for good. A ConvTranspose adds its bias in one
element-wise pass after cuDNN's backward data; a Relu that is its only reader joins that pass.

Fused graph-API epilogues: a Conv whose decision records a fused engine (``fusion``, e.g.
``bias+swish``) and whose output is read only by that epilogue in the plan (``Mul(y, Sigmoid(y))``)
runs conv, bias and activation in the engine's one call, and its launch absorbs the epilogue's
steps. When the plan does not offer the epilogue (fusion off, another graph) the recorded legacy
``algo`` runs, with one warning; when the fused plan cannot be built, the same, and the epilogue's
steps run as usual.

Placement: a Conv without residual whose epilogue is not fused into cuDNN's call (DenseNet's convs;
a bias and ReLU run as their own pass) writes its output straight into its slice of a Concat buffer
(:mod:`convpass.runtime.cuda.memory`), channels-first or channels-last: cuDNN gets an output
descriptor with the slice's strides, and the epilogue pass runs on the slice in place, in its
memory order. When cuDNN refuses that (some algorithms want packed outputs), and for a conv whose
epilogue runs fused in cuDNN's call, the conv writes a packed output that is copied into the slice.

Decisions:

* Untuned convs (no decision) and ``algo == "auto"``: cuDNN's heuristic first choice that is
  usable, in NCHW, with the recorded math mode when there is one (``default`` otherwise): one
  :class:`~convpass.native.cuda.ExecutorWarning` per executor counts them.
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
  cuDNN compiles some engines when their plan is built (0.15-0.6 s each on an H200), so built
  plans are stored in the model's kernel side-car (``convpass compile`` records them, as it does
  the CuPy kernels) and loaded from there in milliseconds; plans built at start-up anyway (no
  side-car, another cuDNN, a refused entry) that took :data:`ENGINE_BUILD_NOTE_S` or more in all
  are reported once as start-up compilation (:class:`~convpass.native.cuda.StartupCompileWarning`), with why.
  An engine that cannot be built here (package missing, another cuDNN, refused) warns once,
  naming the node, and the recorded legacy ``algo`` runs instead.
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

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from convpass.core import annotation, kernel_file
from convpass.core.algo import Algo
from convpass.core.fusion import LEGACY, absorbed, is_legacy, legacy_name
from convpass.core.layout import storage_order
from convpass.core.problem import MATH_MODES, ProblemKey, layout_from_memory_format, memory_format_name
from convpass.ops import conv as conv_kernels
from convpass.ops.conv import ConvCall, ConvGeometry
from convpass.native.cuda import CaptureBreak, copy_into, elements, first_line, start_helper, storage
from convpass.kernels.launch import Launch

logger = logging.getLogger("convpass")

__all__ = ["ConvLaunch", "Convolutions", "lower_convs"]

# Graph-API plan builds at start-up that take this long in all are reported (module docstring);
# one that takes this long alone is cuDNN compiling it, listed in ENGINE_COMPILATIONS (process-wide,
# like compiler.COMPILATIONS: the fresh-process benchmark counts both).
ENGINE_BUILD_NOTE_S = 0.05
ENGINE_COMPILATIONS: list[str] = []
# Heuristic picks above this workspace are skipped while a smaller usable one exists.
HEURISTIC_WORKSPACE_LIMIT = 512 << 20

REFERENCE = "reference"  # exec marker: run the CuPy reference kernel


@dataclasses.dataclass
class ConvExec:
    """How one conv of one plan runs: problem key, descriptors, algorithm, workspace."""

    node: str
    op_type: str
    geometry: ConvGeometry
    key: ProblemKey
    descs: Any
    algo: str
    workspace: int
    insert_axis: int | None  # 1-D convs: 2 for the (1, L) mapping, 3 for (L, 1)
    source: str  # "recorded", "untuned" or "fallback"
    note: str = ""
    fuse_relu_ok: bool = True
    fuse_identity_ok: bool = True
    fuse_residual_ok: bool = True
    strided_output_ok: bool = True
    engine: Any = None  # the graph-API EnginePlan when a recorded engine runs
    kernel: Any = None  # convpass's own kernel (a depthwise.DepthwiseKernel) when a recorded one runs
    # how a legacy algorithm runs its step's epilogue (convpass.core.fusion): None = not tuned, cuDNN's
    # fused call where it takes it; "" = recorded unfused (the conv, then one pass); a legacy
    # epilogue name = recorded fused into the call
    fused_call: str | None = None
    op_by_op: bool = False  # resolved for the op-by-op run that records the plan (its steps are not the plan's)

    @property
    def layout(self) -> str:
        return self.key.layout

    @property
    def memory_format(self) -> str:
        return memory_format_name(self.geometry.spatial_rank, self.key.layout)


def _insert_axis(g: ConvGeometry, key: ProblemKey) -> int | None:
    if g.spatial_rank != 1:
        return None
    s = key.shape
    row = s.spatial[0] == 1 and s.kernel[0] == 1 and s.pads[0] == 0 and s.strides[0] == 1 and s.dilations[0] == 1
    return 2 if row else 3


def _same_device(recorded: str, current: Any) -> bool:
    from convpass.core.device import DeviceFingerprint

    if current is None:
        return False
    try:
        return DeviceFingerprint.parse(recorded) == current
    except ValueError:
        return recorded.strip() == str(current)


class Convolutions:
    """The conv state of one backend: descriptors, resolved executions, converted weights, the
    workspace arena. ``rt`` is the backend: ``cp``, ``device_id``, ``fuse``, ``counters``, ``is_constant(a)``,
    ``warn_node(node, message)``, ``note_once(tag, message)``, ``capturing``, and the device check (``recorded_device``,
    ``current_device``)."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.cp = rt.cp
        self._descs: dict[ProblemKey, Any] = {}
        self._workspace_bytes: dict[tuple[ProblemKey, str], int] = {}
        self._prefetch: threading.Thread | None = None
        self._execs: dict[Any, Any] = {}
        self._by_call: dict[int, tuple[Any, Any, Any]] = {}
        self._weights: dict[Any, tuple[Any, Any]] = {}
        self._biases: dict[Any, tuple[Any, Any]] = {}
        self.arena: Any = None
        self.mismatch_nodes: list[str] = []
        self._plans: dict[str, Any] = {}  # graph-API plans by graph_api.plan_id
        self.engine_builds: list[tuple[str, float, str]] = []  # (node, seconds, why not loaded) per graph-API plan built

    @property
    def device_mismatch(self) -> bool:
        recorded = self.rt.recorded_device
        return bool(recorded) and not _same_device(recorded, self.rt.current_device)

    # ------------------------------------------------------------------ resolution

    def descriptors(self, key: ProblemKey) -> Any:
        d = self._descs.get(key)
        if d is None:
            from convpass.native import cudnn

            d = self._descs[key] = cudnn.ConvDescriptors(key)
        return d

    def workspace_bytes(self, key: ProblemKey, algo: str) -> int:
        """The workspace ``algo`` needs for ``key``, asked of cuDNN once per problem and algorithm:
        each query costs a fresh process 1-3 ms, and a plan resolves every conv twice (op by op,
        then lowered) over problems that repeat. Raises as :func:`convpass.native.cudnn.workspace_size`."""
        ws = self._workspace_bytes.get((key, algo))
        if ws is None:
            from convpass.native import cudnn

            ws = self._workspace_bytes[(key, algo)] = cudnn.workspace_size(self.descriptors(key), None, algo)
        return ws

    def prefetch_workspaces(self, decisions: Iterable[annotation.ConvDecision]) -> None:
        """Ask cuDNN the workspace of every recorded legacy algorithm ahead of the plan, on a helper
        thread with a cuDNN handle of its own. A fresh process's first query of an algorithm family
        costs 0.05-0.13 s on an H200 (cuDNN readies its kernels then; ctypes lets go of the GIL),
        so these run beside the plan's op-by-op Python instead of inside it. Answers fill the memo
        :meth:`workspace_bytes` reads; one not there yet is asked by the plan itself (the same
        answer), and one cuDNN refuses is left for the plan to meet and report. Every capture waits
        for the helper (:func:`~convpass.native.cuda.quiet_for_capture`: no CUDA call of another thread may fall
        inside a capture)."""
        if self.device_mismatch:  # the heuristic runs instead of the recorded algorithms
            return
        wanted: dict[tuple[ProblemKey, str], None] = {}
        for d in decisions:
            if d.algo == annotation.AUTO or Algo.parse(d.algo).is_own or not d.problem_key:
                continue
            try:
                key = ProblemKey.parse(d.problem_key)
            except ValueError:
                continue  # said by the plan, which cannot run it either
            if (key, d.algo) not in self._workspace_bytes:
                wanted[(key, d.algo)] = None
        if not wanted:
            return
        device = self.rt.device_id
        memo = self._workspace_bytes

        def ask() -> None:
            from convpass.native import cudnn

            try:
                with self.cp.cuda.Device(device):
                    handle = cudnn.api.Handle(device)
                    try:
                        for key, algo in wanted:
                            if (key, algo) in memo:
                                continue
                            try:
                                ws = cudnn.workspace_size(cudnn.ConvDescriptors(key), None, algo, handle=handle)
                            except (cudnn.CudnnError, ValueError):
                                continue
                            memo.setdefault((key, algo), ws)
                    finally:
                        handle.close()
            except Exception as e:  # noqa: BLE001  (the plan asks for itself)
                logger.debug("asking cuDNN's workspaces ahead of the plan failed: %s", e)

        self._prefetch = start_helper(ask, "convpass-cudnn-prefetch")

    def resolve(self, call: ConvCall, dtype: Any, fusion: str | None = None) -> Any:
        """The :class:`ConvExec` (or :data:`REFERENCE`) ``call`` runs with for inputs of ``dtype``
        (``fusion``: the epilogue the plan lets this conv fuse, ``""`` none; None: the conv runs op
        by op, as in the run that records a plan, so a fused decision runs its legacy algorithm)."""
        hit = self._by_call.get(id(call))  # fast path: a plan holds the same ConvCall objects run after run
        if hit is not None and hit[0] is call and hit[1] == dtype and hit[2] == fusion:
            return self._execs[hit[3]]
        cache_key = self._cache_key(call, dtype, fusion)
        if cache_key not in self._execs:
            self._execs[cache_key] = self._make_exec(call, dtype, fusion)
        self._by_call[id(call)] = (call, dtype, fusion, cache_key)
        return self._execs[cache_key]

    @staticmethod
    def _cache_key(call: ConvCall, dtype: Any, fusion: str | None) -> tuple:
        return (call.node_name, call.geometry, call.decision, np.dtype(dtype).str, fusion)

    def _make_exec(self, call: ConvCall, dtype: Any, fusion: str | None = None) -> Any:
        g = call.geometry
        node = call.node_name
        if not g.shapes:
            return REFERENCE
        if np.dtype(dtype).name != g.shapes[0].dtype:
            # Conv requires X and W of one type: an input of another dtype means an op before it
            # changed the dtype, which is an executor bug worth hearing about
            self.rt.warn_node(node, f"node {node!r}: input is {np.dtype(dtype).name}, the model says {g.shapes[0].dtype}: running CuPy reference kernels")
            return REFERENCE
        d = call.decision
        math = d.math_mode if d is not None and d.math_mode in MATH_MODES else "default"
        if d is None or d.algo == annotation.AUTO:
            return self.heuristic_exec(call, "untuned", "")
        if self.device_mismatch:
            self.mismatch_nodes.append(node)
            return self.heuristic_exec(call, "fallback", f"tuned on {self.rt.recorded_device}", math)
        key, why = self._recorded_key(d, g)
        odd = odd_fusion(d)
        if odd:  # its own tag: the node's one warning may still be needed for what runs instead
            self.rt.note_once(f"fusion:{node}", f"node {node!r}: {odd}")
        graph_fusion = "" if is_legacy(d.fusion) else d.fusion  # a legacy epilogue belongs to the legacy call, not an engine
        if key is not None and d.engine and graph_fusion and graph_fusion != fusion:
            instead = f"the recorded legacy algorithm {d.algo!r}" if d.algo != annotation.AUTO else "cuDNN's heuristic choice"
            if fusion is None:  # the op-by-op run that records the plan: its plan runs the engine
                logger.debug("node %r: run op by op: %s instead of the fused engine %r", node, instead, d.engine)
            else:
                self.rt.warn_node(node, f"node {node!r}: recorded cuDNN graph-API engine {d.engine!r} is the fused graph conv + {d.fusion}, "
                                        f"which this plan does not run fused (fusion off, or the conv's readers differ); running {instead} instead")
            if d.algo == annotation.AUTO:
                return self.heuristic_exec(call, "fallback", f"recorded engine {d.engine!r} ({d.fusion}) not fused in this plan", math)
        elif key is not None and d.engine:
            ex = self._engine_exec(call, d, key)
            if ex is not None:
                return ex
            if d.algo == annotation.AUTO:
                return self.heuristic_exec(call, "fallback", f"recorded engine {d.engine!r} not usable here", math)
        if key is not None and Algo.parse(d.algo).is_own:
            ex, why = self._own_exec(call, d, key, fusion)
            if ex is not None:
                return ex
        elif key is not None:
            from convpass.native import cudnn

            try:
                descs = self.descriptors(key)
                ws = self.workspace_bytes(key, d.algo)
            except (cudnn.CudnnError, ValueError) as e:
                why = f"recorded algorithm {d.algo!r} ({key.layout}, {key.math}) is not usable here: {first_line(e)}"
            else:
                fused_call = d.fusion if is_legacy(d.fusion) and not d.engine else ""
                return ConvExec(node, g.op_type, g, key, descs, d.algo, ws, _insert_axis(g, key), "recorded", fused_call=fused_call,
                                op_by_op=fusion is None)
        ex = self.heuristic_exec(call, "fallback", why, math)
        self.rt.warn_node(node, f"node {node!r}: {why}; running cuDNN's heuristic choice {describe_exec(ex)} instead")
        return ex

    def _engine_exec(self, call: ConvCall, d: annotation.ConvDecision, key: ProblemKey) -> ConvExec | None:
        """The exec of a recorded graph-API engine, its plan built now (plan-compile time); None,
        with a warning naming the node and the legacy algorithm that runs instead, when it cannot."""
        from convpass.native.cudnn import graph_api

        g = call.geometry
        try:
            if g.op_type != "Conv":
                raise graph_api.GraphApiError(f"engines run forward convolutions, not {g.op_type}")
            plan = self._engine_plan(call.node_name, key, graph_api.EngineConfig.parse(d.engine, "" if is_legacy(d.fusion) else d.fusion))
        except (graph_api.GraphApiError, ValueError) as e:
            instead = f"the recorded legacy algorithm {d.algo!r}" if d.algo != annotation.AUTO else "cuDNN's heuristic choice"
            self.rt.warn_node(call.node_name, f"node {call.node_name!r}: recorded cuDNN graph-API engine {d.engine!r} is not usable here ({first_line(e)}); running {instead} instead")
            return None
        ex = ConvExec(call.node_name, g.op_type, g, key, None, plan.config.algo, plan.workspace_bytes,
                      _insert_axis(g, key), "recorded", engine=plan)
        ex.strided_output_ok = False  # the plan was built for a packed output
        return ex

    def _own_exec(self, call: ConvCall, d: annotation.ConvDecision, key: ProblemKey, fusion: str | None) -> tuple[ConvExec | None, str]:
        """The exec of a recorded convpass kernel, built now (plan-compile time), or None and why
        it cannot run here."""
        from convpass.kernels.depthwise import DepthwiseKernel

        g = call.geometry
        try:
            if g.op_type != "Conv":
                raise ValueError(f"it computes Conv, not {g.op_type}")
            kernel = DepthwiseKernel.of(d.algo, key.shape, key.layout)
            kernel.build(self.cp)
        except Exception as e:  # noqa: BLE001  (a name or shape it refuses, a compiler error)
            return None, f"recorded kernel {d.algo!r} ({key.layout}) is not usable here: {first_line(e)}"
        fused_call = d.fusion if is_legacy(d.fusion) and not d.engine else ""
        return ConvExec(call.node_name, g.op_type, g, key, None, d.algo, 0, _insert_axis(g, key), "recorded", fused_call=fused_call,
                        op_by_op=fusion is None, kernel=kernel), ""

    def _engine_plan(self, node: str, key: ProblemKey, config: Any) -> Any:
        """``config``'s plan for ``key``, one per problem and configuration: loaded from the
        model's kernel side-car when it stores one for this cuDNN, else built (timed into
        :attr:`engine_builds` with the reason, and stored in the side-car being recorded, if any)."""
        from convpass.native.cudnn import graph_api

        ident = graph_api.plan_id(key, config)
        if ident in self._plans:  # the same problem elsewhere in the model: one plan serves every node
            return self._plans[ident]
        self._plans[ident] = plan = self._load_or_build_plan(node, key, config, ident)
        return plan

    def _load_or_build_plan(self, node: str, key: ProblemKey, config: Any, ident: str) -> Any:
        from convpass.native.cudnn import graph_api
        from convpass.native import prebuilt

        entry = prebuilt.stored(ident)
        why = "the model's kernel side-car does not store it"
        if entry is not None:
            try:
                plan = graph_api.EnginePlan.load(key, config, entry.payload)
            except graph_api.GraphApiError as e:
                why = f"its stored plan was refused: {first_line(e)}"
            else:
                prebuilt.record_entry(ident, entry.name, entry.payload)
                return plan
        started = time.perf_counter()
        plan = graph_api.EnginePlan(key, config)
        seconds = time.perf_counter() - started
        self.engine_builds.append((node, seconds, why))
        if seconds >= ENGINE_BUILD_NOTE_S:
            ENGINE_COMPILATIONS.append(f"cuDNN plan {config.name} of {node!r} ({seconds:.2f} s)")
        if prebuilt.recording_active():
            try:
                prebuilt.record_entry(ident, kernel_file.PLAN_PREFIX + config.algo, plan.serialize())
            except graph_api.GraphApiError as e:
                self.rt.warn_node(node, f"node {node!r}: the cuDNN plan {config.algo} is not stored with the model ({first_line(e)}); it is built at start-up")
        return plan

    @staticmethod
    def _recorded_key(d: annotation.ConvDecision, g: ConvGeometry) -> tuple[ProblemKey | None, str]:
        if d.problem_key:
            try:
                key = ProblemKey.parse(d.problem_key)
            except ValueError:
                return None, f"recorded problem key {d.problem_key!r} cannot be read"
            if key.shape not in g.shapes:
                return None, f"recorded problem {d.problem_key} is not the problem this plan computes ({g.shapes[0]})"
            return key, ""
        layout = "nchw"
        if d.memory_format not in ("", annotation.AUTO):
            try:
                _, layout = layout_from_memory_format(d.memory_format)
            except ValueError:
                return None, f"unknown recorded memory format {d.memory_format!r}"
        math = d.math_mode if d.math_mode in MATH_MODES else "default"
        return ProblemKey(g.shapes[0], layout, math), ""

    def heuristic_exec(self, call: ConvCall, source: str, note: str, math: str = "default") -> Any:
        from convpass.native import cudnn

        g = call.geometry
        attempts = [("nchw", math)] + ([("nchw", "default")] if math != "default" else [])
        for layout, m in attempts:
            key = ProblemKey(g.shapes[0], layout, m)
            try:
                descs = self.descriptors(key)
                ranking = cudnn.heuristic(descs)
            except (cudnn.CudnnError, ValueError) as e:
                logger.debug("node %r: no cuDNN descriptors / heuristic for %s: %s", call.node_name, key, e)
                continue
            usable = []
            for p in ranking:
                if not p.ok:
                    continue
                try:
                    ws = self.workspace_bytes(key, p.algo)
                except (cudnn.CudnnError, ValueError):
                    continue
                usable.append((p.algo, ws))
            if not usable:
                continue
            small = [u for u in usable if u[1] <= HEURISTIC_WORKSPACE_LIMIT]
            algo, ws = (small or usable)[0]
            return ConvExec(call.node_name, g.op_type, g, key, descs, algo, ws, _insert_axis(g, key), source, note)
        self.rt.warn_node(call.node_name, f"node {call.node_name!r}: cuDNN offers no usable algorithm for {g.shapes[0]}: running CuPy reference kernels")
        return REFERENCE

    # ------------------------------------------------------------------ compile time

    def prepare(self, call: ConvCall, x_dtype: Any, w: Any, fusion: str | None = None) -> Any:
        """Resolve ``call`` for inputs of ``x_dtype``, convert a constant weight to the conv's
        memory format and grow the workspace arena: everything a launch must not do while a CUDA
        graph is captured. Returns the exec."""
        ex = self.resolve(call, x_dtype, fusion)
        if ex is not REFERENCE:
            if w is not None and w.dtype == x_dtype:
                self.weight(w, ex)
            self.workspace(ex.workspace)
        return ex

    def weight(self, w: Any, ex: ConvExec) -> Any:
        from convpass.native import cudnn

        tap_major = ex.kernel is not None and ex.kernel.channels_last  # own kernels read their own copy
        key = (id(w), ex.layout, ex.insert_axis, tap_major)
        hit = self._weights.get(key)
        if hit is not None and hit[0] is w:
            return hit[1]
        wk = cudnn.as_layout(self._map(w, ex), ex.layout)
        if ex.kernel is not None:
            wk = ex.kernel.weight(self.cp, wk)
        if self.rt.is_constant(w):
            self._weights[key] = (w, wk)
        return wk

    def _bias(self, b: Any) -> Any:
        if b.flags.c_contiguous:
            return b
        key = id(b)
        hit = self._biases.get(key)
        if hit is not None and hit[0] is b:
            return hit[1]
        out = self.cp.ascontiguousarray(b)
        if self.rt.is_constant(b):
            self._biases[key] = (b, out)
        return out

    def workspace(self, nbytes: int) -> Any:
        if nbytes <= 0:
            return (0, 0)
        if self.arena is None or self.arena.nbytes < nbytes:
            if self.rt.capturing:
                raise CaptureBreak("the cuDNN workspace arena is too small")
            self.arena = self.cp.empty(int(nbytes), dtype=np.uint8)
        return self.arena

    # ------------------------------------------------------------------ execution

    @staticmethod
    def _map(a: Any, ex: ConvExec) -> Any:
        if ex.insert_axis == 2:
            return a[:, :, None]
        if ex.insert_axis == 3:
            return a[:, :, :, None]
        return a

    def _prepad(self, x: Any, g: ConvGeometry, layout: str) -> Any:
        from convpass.native import cudnn

        r = g.spatial_rank
        eb, ee = g.extra_pads[:r], g.extra_pads[r:]
        shape = (x.shape[0], x.shape[1], *(x.shape[2 + i] + eb[i] + ee[i] for i in range(r)))
        out = cudnn.empty_like_layout(shape, x.dtype, layout)
        storage(out).fill(0)  # in memory order: coalesced
        out[(slice(None), slice(None), *(slice(eb[i], eb[i] + x.shape[2 + i]) for i in range(r)))] = x
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

    def run(self, call: ConvCall, x: Any, w: Any, b: Any, relu: bool = False, z: Any = None, out: Any = None,
            fusion: str | None = None, fused: bool = False) -> Any:
        """The conv of ``call`` plus bias, plus the residual ``z`` when given, then ReLU if asked;
        written into ``out`` (a slice of a Concat buffer) when given. ``fusion``: the epilogue the
        plan lets this conv fuse (as at :meth:`prepare`; None: op by op, see :meth:`resolve`);
        ``fused``: the launch owns it, so its activation is applied here (in the engine's call, or
        as a pass after a fallback)."""
        from convpass.native import cudnn
        from convpass.native.cudnn.graph_api import GraphApiError

        ex = self.resolve(call, x.dtype, fusion)
        if _runs_fused(ex) and not fused:  # its activation would run twice (the plan's own steps too)
            raise RuntimeError(f"node {call.node_name!r}: a fused graph-API engine resolved for a launch that does not own its epilogue")
        after = (fusion or "") if fused and not _runs_fused(ex) else ""
        if ex is REFERENCE or w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
            return self._into(self._activate(self._reference(call, x, w, b, relu, z), after), out)
        try:
            return self._finish(self._run(ex, x, w, b, relu, z, None if after else out), after, out)
        except (cudnn.CudnnError, GraphApiError) as e:
            if self.rt.capturing or ex.source != "recorded":
                raise
            # the recorded algorithm was accepted by workspace_size but cuDNN refuses to run it
            why = f"recorded algorithm {ex.algo!r} ({ex.layout}, {ex.key.math}) failed here: {first_line(e)}"
            new = self.heuristic_exec(call, "fallback", why, ex.key.math)
            self._execs[self._cache_key(call, x.dtype, fusion)] = new  # _by_call points here
            self.rt.warn_node(call.node_name, f"node {call.node_name!r}: {why}; running cuDNN's heuristic choice {describe_exec(new)} instead")
            after = (fusion or "") if fused else ""
            if new is REFERENCE:
                return self._into(self._activate(self._reference(call, x, w, b, relu, z), after), out)
            self.workspace(new.workspace)
            return self._finish(self._run(new, x, w, b, relu, z, None if after else out), after, out)

    def _finish(self, y: Any, after: str, out: Any) -> Any:
        return self._into(self._activate(y, after), out) if after else y

    def _activate(self, y: Any, fusion: str) -> Any:
        """``fusion``'s activation over ``y`` in place, with CuPy ufuncs: only where a fused engine
        could not run after its launch absorbed the epilogue (warned), never on the planned path."""
        if not fusion:
            return y
        cp = self.cp
        phys = storage(y)
        t = cp.negative(phys)
        cp.exp(t, out=t)
        cp.add(t, phys.dtype.type(1), out=t)
        cp.divide(phys, t, out=phys)  # the one fusion today: SiLU, y / (1 + exp(-y))
        return y

    def _into(self, y: Any, out: Any) -> Any:
        if out is None:
            return y
        copy_into(out, y)
        return out

    def _run(self, ex: ConvExec, x: Any, w: Any, b: Any, relu: bool, z: Any = None, out: Any = None) -> Any:
        from convpass.native import cudnn

        g = ex.geometry
        r = g.spatial_rank
        counters = self.rt.counters
        wk = self.weight(w, ex)
        ws = self.workspace(ex.workspace)
        if ex.op_type == "ConvTranspose":
            mapped = self._map(x, ex)
            dy = cudnn.as_layout(mapped, ex.layout)
            if dy is not mapped:
                counters["layout_copies"] += 1
            full_spatial = tuple(g.output_shape[2 + i] + g.extra_pads[i] + g.extra_pads[r + i] for i in range(r))
            full = cudnn.empty_like_layout((g.output_shape[0], g.output_shape[1], *full_spatial), x.dtype, ex.layout)
            cudnn.run(ex.descs, "dgrad", ex.algo, self._map(full, ex), wk, dy, workspace=ws)
            counters["cudnn_calls"] += 1
            y = full
            if any(g.extra_pads):
                y = full[(slice(None), slice(None), *(slice(g.extra_pads[i], g.extra_pads[i] + g.output_shape[2 + i]) for i in range(r)))]
            apply_epilogue(self.cp, y, b, relu)
            return self._into(y, out)
        xin = self._prepad(x, g, ex.layout) if any(g.extra_pads) else x
        mapped = self._map(xin, ex)
        x4 = cudnn.as_layout(mapped, ex.layout)
        if x4 is not mapped:
            counters["layout_copies"] += 1
        z4 = None
        if z is not None:  # the residual, in the conv's own memory format
            mapped_z = self._map(z, ex)
            z4 = cudnn.as_layout(mapped_z, ex.layout)
            if z4 is not mapped_z:
                counters["layout_copies"] += 1
        if ex.engine is not None:
            return self._into(self._run_engine(ex, x4, wk, b, relu, z4, ws), out)
        if ex.kernel is not None:
            return self._run_own(ex, x4, wk, b, relu, z4, out)
        activation = self._fused_activation(ex, b, relu, z4) if b is not None and self.rt.fuse else None
        # Only cudnnConvolutionForward writes through a strided output descriptor: the fused bias +
        # activation call wrote packed rows into a Concat slice on an H200 (cuDNN 9.19), so a fused
        # conv computes into a packed buffer that is then copied into its slice. A conv whose bias
        # (and ReLU) run as their own pass writes into the slice and that pass runs there, in place.
        y_strides = None
        if (out is not None and z is None and activation is None and ex.strided_output_ok and ex.insert_axis is None
                and _same_order(out, ex.layout)):
            y, y_strides = out, elements(out.strides, out.itemsize)
        else:
            y = cudnn.empty_like_layout(g.output_shape, x.dtype, ex.layout)
        y4 = self._map(y, ex)
        if activation is not None:
            try:
                cudnn.conv_bias_activation_forward(ex.descs, ex.algo, x4, wk, y4, self._bias(b), z=z4, activation=activation, workspace=ws)
            except (cudnn.CudnnError, ValueError) as e:
                if z4 is not None:
                    ex.fuse_residual_ok = False
                elif activation == "relu":
                    ex.fuse_relu_ok = False
                else:
                    ex.fuse_identity_ok = False
                what = f"{'residual + ' if z4 is not None else ''}{activation}"
                message = f"node {ex.node!r}: cuDNN refuses the fused conv + bias + {what} ({first_line(e)}); running them apart"
                if ex.fused_call:  # the tuner ran this call: a refusal here is news
                    self.rt.warn_node(ex.node, message)
                    ex.fused_call = ""
                else:
                    logger.debug(message)
            else:
                counters["cudnn_calls"] += 1
                counters["fused_" + ("residual_" if z4 is not None else "") + activation] += 1
                return self._into(y, out)
        try:
            cudnn.run(ex.descs, "fwd", ex.algo, x4, wk, y4, workspace=ws, y_strides=y_strides)
        except cudnn.CudnnError as e:
            if y_strides is None:
                raise
            return self._strided_refused(ex, e, x, w, b, relu, out)
        counters["cudnn_calls"] += 1
        apply_epilogue(self.cp, y4, b, relu, z4)
        return y if y_strides is not None else self._into(y, out)

    def _fused_activation(self, ex: ConvExec, b: Any, relu: bool, z4: Any) -> str | None:
        """The activation to pass cuDNN's fused conv + bias call, or None to run the conv alone and
        the epilogue as one pass: what the recorded decision measured (``ex.fused_call``); for an
        untuned conv, the fused call wherever cuDNN has not refused it."""
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

    def _run_engine(self, ex: ConvExec, x4: Any, wk: Any, b: Any, relu: bool, z4: Any, ws: Any) -> Any:
        """``act(conv(x, w) + z + b)``: the conv in its graph-API plan, then one element-wise pass."""
        from convpass.native import cudnn

        y = cudnn.empty_like_layout(ex.geometry.output_shape, x4.dtype, ex.layout)
        y4 = self._map(y, ex)
        if _runs_fused(ex):  # act(conv + bias) in the engine's one call
            ex.engine.execute(x4, wk, y4, ws if ex.workspace > 0 else None, bias=self._bias(b))
            self.rt.counters["graph_api_calls"] += 1
            self.rt.counters[fusion_counter(ex.engine.config.fusion)] += 1
            return y
        ex.engine.execute(x4, wk, y4, ws if ex.workspace > 0 else None)
        self.rt.counters["graph_api_calls"] += 1
        apply_epilogue(self.cp, y4, b, relu, z4)
        return y

    def _run_own(self, ex: ConvExec, x4: Any, wk: Any, b: Any, relu: bool, z4: Any, out: Any) -> Any:
        """``act(conv(x, w) + z + b)`` in convpass's own kernel: with the epilogue in the kernel
        where the decision recorded that, else the bare kernel and one element-wise pass. Writes
        straight into ``out`` (a Concat slice: the kernel takes any output strides)."""
        from convpass.native import cudnn

        direct = out is not None and ex.insert_axis is None
        y = out if direct else cudnn.empty_like_layout(ex.geometry.output_shape, x4.dtype, ex.layout)
        y4 = self._map(y, ex)
        if b is not None and self._fused_activation(ex, b, relu, z4) is not None:
            ex.kernel(self.cp, x4, wk, y4, self._bias(b), z4, relu)
            self.rt.counters["fused_" + ("residual_" if z4 is not None else "") + ("relu" if relu else "identity")] += 1
        else:
            ex.kernel(self.cp, x4, wk, y4)
            apply_epilogue(self.cp, y4, b, relu, z4)
        self.rt.counters["own_kernel_calls"] += 1
        return y if direct else self._into(y, out)

    def _strided_refused(self, ex: ConvExec, e: Exception, x: Any, w: Any, b: Any, relu: bool, out: Any) -> Any:
        if self.rt.capturing:
            raise CaptureBreak(f"cuDNN refused a strided output during capture: {first_line(e)}")
        ex.strided_output_ok = False
        logger.debug("node %r: cuDNN %r does not write into a Concat slice (%s): packed output + copy", ex.node, ex.algo, first_line(e))
        return self._run(ex, x, w, b, relu, None, out)

def apply_epilogue(cp: Any, y: Any, b: Any, relu: bool, z: Any = None) -> None:
    """``y = act(y + z + b)`` in place, in one element-wise pass (``b``: None or the ``(K,)`` bias;
    ``z``: None or an array of ``y``'s shape): a conv's epilogue when it does not run fused into the
    conv's call, as the tuner times it (:mod:`convpass.core.fusion`). The pass runs over the storage
    order of ``y`` where ``z`` has the same one: over a channels-last array seen channels-first,
    element-wise kernels read and write with a stride of C elements."""
    order = storage_order(y)  # a channels-last array, or a channel slice of one (a Concat buffer's)
    phys = y.transpose(order) if order else y
    if b is None and z is None:
        if relu:
            cp.maximum(phys, y.dtype.type(0), out=phys)
        return
    zp = None if z is None else (z.transpose(order) if order else z)
    if z is not None and storage_order(z) != order:
        phys, zp = y, z  # logical views: right whatever the strides
    args = [] if b is None else [b if phys is not y else b.reshape((1, -1) + (1,) * (y.ndim - 2))]
    args += [] if zp is None else [zp]
    epilogue_kernel(cp, b is not None, z is not None, relu)(*args, phys)


_epilogue_kernels: dict[tuple[Any, bool, bool, bool], Any] = {}


def epilogue_kernel(cp: Any, bias: bool, residual: bool, relu: bool) -> Any:
    """The CuPy element-wise kernel ``y = act(y + z + b)`` over the operands present (inputs ``b``
    then ``z``, broadcast to ``y``; ``y`` read and written in place; a ReLU that keeps NaN)."""
    key = (cp, bias, residual, relu)
    if key not in _epilogue_kernels:
        inputs = [name for name, on in (("T b", bias), ("T z", residual)) if on]
        value = " + ".join(["y"] + [name[2:] for name in inputs])
        body = f"T v = {value}; y = v < (T)0 ? (T)0 : v" if relu else f"y = {value}"
        name = "convpass_epilogue" + "".join(part for part, on in (("_bias", bias), ("_residual", residual), ("_relu", relu)) if on)
        _epilogue_kernels[key] = cp.ElementwiseKernel(", ".join(inputs), "T y", body, name)
    return _epilogue_kernels[key]


def fusion_counter(fusion: str) -> str:
    """The backend counter of launches that ran a fused graph-API epilogue (``fused_bias_swish``)."""
    return "fused_" + fusion.replace("+", "_")


def _runs_fused(ex: Any) -> bool:
    """Whether an exec runs a fused graph-API epilogue in its engine's call."""
    return isinstance(ex, ConvExec) and ex.engine is not None and bool(ex.engine.config.fusion)


def _same_order(a: Any, layout: str) -> bool:
    """Whether a slice of a Concat buffer is stored in ``layout``'s order (channels-first: the
    channel stride above the spatial ones; channels-last: channels adjacent)."""
    st = elements(a.strides, a.itemsize)
    if layout == "nhwc":
        return st[1] == 1
    return all(st[1] >= st[k] for k in range(2, a.ndim))


def odd_fusion(d: annotation.ConvDecision) -> str | None:
    """What is wrong with a decision's recorded ``fusion`` (an edited or damaged model), or None:
    without an engine it must name a legacy epilogue; beside an engine, not one."""
    if not d.fusion:
        return None
    if not d.engine and not is_legacy(d.fusion):
        return (f"recorded fusion {d.fusion!r} names no legacy epilogue ({', '.join(LEGACY)}) and no engine records it: "
                "running the conv, then its epilogue as one pass")
    if d.engine and is_legacy(d.fusion):
        return (f"recorded fusion {d.fusion!r} is a legacy fused call, not a graph of engine {d.engine!r}: "
                "the engine runs the bare conv, then its epilogue as one pass")
    return None


def describe_exec(ex: Any) -> str:
    if ex is REFERENCE:
        return "(none: CuPy reference kernels)"
    return f"{ex.algo!r} ({ex.memory_format}, {ex.key.math})"


def summarize(s: Any, ex: Any) -> Any:
    """A plan's :class:`~convpass.kernels.plan.ConvSummary` updated with how the conv really runs."""
    if ex is REFERENCE:
        return dataclasses.replace(s, algo="reference", note=(s.note + "; " if s.note else "") + "runs CuPy reference kernels")
    if ex.source == "recorded":
        if ex.algo == s.algo:
            return s
        # a recorded graph-API engine not usable here: its legacy algorithm runs (warned once)
        return dataclasses.replace(s, algo=ex.algo, workspace_bytes=ex.workspace,
                                   note=(s.note + "; " if s.note else "") + f"recorded {s.algo!r} not usable here: its legacy algorithm runs")
    note = "cuDNN heuristic" if ex.source == "untuned" else f"recorded {s.algo!r} not used ({ex.note}): cuDNN heuristic"
    return dataclasses.replace(
        s,
        source=s.source if ex.source == "untuned" else "fallback",
        algo=ex.algo,
        memory_format=ex.memory_format,
        math_mode=ex.key.math,
        workspace_bytes=ex.workspace,
        note=(s.note + "; " if s.note and s.note != "untuned" else "") + note,
    )


# ---------------------------------------------------------------------------------------------
# lowering


class ConvLaunch(Launch):
    """One Conv / ConvTranspose step with its fused epilogue (``epilogue``: None, ``"relu"``,
    ``("residual", z slot, activation)`` or ``("engine", fusion)``: a fused graph-API engine).
    ``fusion``: the graph-API epilogue the plan lets this conv fuse, which its exec is resolved
    with (the launch owns it only with an ``"engine"`` epilogue)."""

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
        # a plain Conv writes into a Concat slice through a strided output descriptor
        self.supports_placement = step.node.op_type == "Conv" and (epilogue is None or epilogue == "relu")
        x = plan.info(step.inputs[0])
        self.x_dtype = None if x is None else x[1]
        self.w_const = plan.template[step.inputs[1]] if len(step.inputs) > 1 and step.inputs[1] >= 0 else None
        self.exec: Any = None

    def prepare(self) -> None:
        if self.x_dtype is not None:
            self.exec = self.convs.prepare(self.call, self.x_dtype, self.w_const, self.fusion)

    def run(self, env: list[Any]) -> None:
        ins = self.inputs
        x, w = env[ins[0]], env[ins[1]]
        b = env[ins[2]] if len(ins) > 2 and ins[2] >= 0 else None
        e = self.epilogue
        out = self.destination(env, self._layout())
        if e is None or e == "relu":
            env[self.outputs[0]] = self.convs.run(self.call, x, w, b, relu=e == "relu", out=out, fusion=self.fusion)
        elif e[0] == "engine":
            env[self.outputs[0]] = self.convs.run(self.call, x, w, b, out=out, fusion=self.fusion, fused=True)
        else:
            env[self.outputs[0]] = self.convs.run(self.call, x, w, b, relu=e[2] == "relu", z=env[e[1]], out=out, fusion=self.fusion)

    def _layout(self) -> str:
        return self.exec.layout if isinstance(self.exec, ConvExec) else "nchw"


class _PlanSteps:
    """A plan as :class:`convpass.core.fusion.StepGraph`: nodes are step indices, values slots.
    A step is free when it comes after the conv and no earlier conv's launch took it."""

    def __init__(self, plan: Any, taken: set[int]) -> None:
        self.plan, self.steps, self.taken = plan, plan.steps, taken
        self._readers = plan.readers()
        self._outputs = set(plan.output_slots)
        self._producer = plan.producers()
        self.conv = -1

    def op(self, k: int) -> str:
        node = self.steps[k].node
        if isinstance(node.prepared, ConvCall):  # a tuned conv keeps convpass's domain in the plan
            return node.prepared.geometry.op_type
        return node.op_type if node.domain == "" else ""

    def inputs(self, k: int) -> tuple[int | None, ...]:
        return tuple(None if s < 0 else s for s in self.steps[k].inputs)

    def outputs(self, k: int) -> tuple[int, ...]:
        outs = self.steps[k].outputs
        return tuple(outs) if outs and outs[0] >= 0 else ()

    def readers(self, slot: int) -> list[int]:
        return self._readers.get(slot, [])

    def is_output(self, slot: int) -> bool:
        return slot in self._outputs

    def is_constant(self, slot: int) -> bool:
        return slot >= 0 and self.plan.template[slot] is not None

    def same_shape_and_type(self, a: int, b: int) -> bool:
        info = self.plan.value_info
        return info.get(b) is not None and info.get(a) == info.get(b)

    def ready_before(self, slot: int, k: int) -> bool:
        return slot >= 0 and self._producer.get(slot, -1) < k

    def free(self, k: int) -> bool:
        return k > self.conv and k not in self.taken


def lower_convs(plan: Any, convs: Convolutions, fuse: bool, fuse_residual: bool) -> dict[int, ConvLaunch]:
    """A launch per Conv / ConvTranspose step of ``plan``, each absorbing what
    :func:`convpass.core.fusion.absorbed` gives its step (the rule the tuner timed); the steps they
    absorb are listed in each launch's ``absorbs``. A ``bias+swish`` step runs fused only when its
    recorded decision is that fused graph and its plan builds here; otherwise the conv runs with
    its bias and the Sigmoid and Mul run as the plan's own steps."""
    steps = plan.steps
    taken: set[int] = set()
    view = _PlanSteps(plan, taken)
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
            if a.epilogue == "bias+swish":
                d = node.prepared.decision
                x = plan.info(st.inputs[0])
                if d is not None and d.fusion == a.epilogue and x is not None and _runs_fused(convs.resolve(node.prepared, x[1], a.epilogue)):
                    epilogue, out, absorbs, fusion = ("engine", a.epilogue), a.output, a.nodes, a.epilogue
            elif a.epilogue in ("bias+add", "bias+add+relu"):
                epilogue, out, absorbs = ("residual", a.z, "relu" if a.epilogue.endswith("+relu") else "identity"), a.output, a.nodes
            elif a.epilogue in ("bias+relu", "relu"):
                epilogue, out, absorbs = "relu", a.output, a.nodes
        taken.update(absorbs)
        launches[i] = ConvLaunch(plan, i, convs, epilogue, out, absorbs, fusion)
    return launches

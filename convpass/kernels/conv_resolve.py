"""How each conv of a plan runs: its recorded decision resolved to an execution object, or the
fallback that runs instead, said once.

A decision resolves to the :mod:`convpass.kernels.conv_exec` object of its algorithm, the object
class the tuner timed: a legacy algorithm's :class:`~convpass.kernels.conv_exec.LegacyConv`, a
graph-API engine's :class:`~convpass.kernels.conv_exec.EngineConv` (its plan loaded from the
model's kernel side-car, else built), convpass's kernel's :class:`~convpass.kernels.conv_exec.OwnConv`
(built now). The execution part (:mod:`convpass.kernels.convolution`) derives from it the object
of each step's epilogue. The rules of the fallbacks are in that module's docstring.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from convpass.core import annotation, kernel_file
from convpass.core.algo import Algo
from convpass.core.fusion import LEGACY, is_legacy
from convpass.core.problem import MATH_MODES, ProblemKey, layout_from_memory_format, memory_format_name
from convpass.kernels.conv_exec import ConvExec, EngineConv, OwnConv, conv_exec
from convpass.kernels.conv_resources import ConvResources
from convpass.native import cudnn
from convpass.native.cuda import first_line
from convpass.native.cudnn import graph_api
from convpass.ops.conv import ConvCall, ConvGeometry

logger = logging.getLogger("convpass")

__all__ = ["ENGINE_BUILD_NOTE_S", "ENGINE_COMPILATIONS", "REFERENCE", "ConvResolution", "ConvResolver", "describe_exec", "odd_fusion", "summarize"]

# Graph-API plan builds at start-up that take this long in all are reported (module docstring of
# convpass.kernels.convolution); one that takes this long alone is cuDNN compiling it, listed in
# ENGINE_COMPILATIONS (process-wide, like nvrtc.COMPILATIONS: the fresh-process benchmark counts both).
ENGINE_BUILD_NOTE_S = 0.05
ENGINE_COMPILATIONS: list[str] = []
# Heuristic picks above this workspace are skipped while a smaller usable one exists.
HEURISTIC_WORKSPACE_LIMIT = 512 << 20

REFERENCE = "reference"  # resolution marker: run the CuPy reference kernel


@dataclasses.dataclass
class ConvResolution:
    """How one conv of one plan runs: the node, the execution object of its decision (``conv``:
    the bare conv, or a fused graph's engine), where the choice came from, and what the runtime
    learned of it."""

    node: str
    op_type: str
    geometry: ConvGeometry
    conv: ConvExec
    insert_axis: int | None  # 1-D convs: 2 for the (1, L) mapping, 3 for (L, 1)
    source: str  # "recorded", "untuned" or "fallback"
    note: str = ""
    fuse_relu_ok: bool = True
    fuse_identity_ok: bool = True
    fuse_residual_ok: bool = True
    strided_output_ok: bool = True
    strided_input_ok: bool = True
    strided_residual_ok: bool = True  # the step's object reads its residual slice in place (convpass.kernels.conv_slices)
    # how a legacy algorithm runs its step's epilogue (convpass.core.fusion): None = not tuned, cuDNN's
    # fused call where it takes it; "" = recorded unfused (the conv, then one pass); a legacy
    # epilogue name = recorded fused into the call
    fused_call: str | None = None
    op_by_op: bool = False  # resolved for the op-by-op run that records the plan (its steps are not the plan's)
    steps: dict[str, ConvExec] = dataclasses.field(default_factory=dict)  # the object each step epilogue runs
    # a recorded engine: the decision's legacy algorithm ("" when none), and whether its first run
    # was checked against it (convpass.kernels.engine_check)
    legacy_algo: str = ""
    engine_checked: bool = False

    @property
    def key(self) -> ProblemKey:
        return self.conv.key

    @property
    def algo(self) -> str:
        """The algorithm the decision runs: a legacy or own kernel's bare name, an engine's
        configuration (with a fused graph's epilogue)."""
        return str(self.conv.algo)

    @property
    def workspace(self) -> int:
        return self.conv.workspace_bytes

    @property
    def descs(self) -> Any:
        return getattr(self.conv, "descs", None)

    @property
    def engine(self) -> Any:
        """The graph-API plan when a recorded engine runs."""
        return self.conv.plan if isinstance(self.conv, EngineConv) else None

    @property
    def kernel(self) -> Any:
        """convpass's own kernel when a recorded one runs."""
        return self.conv.kernel if isinstance(self.conv, OwnConv) else None

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


def _instead(d: annotation.ConvDecision) -> str:
    return f"the recorded legacy algorithm {d.algo!r}" if d.algo != annotation.AUTO else "cuDNN's heuristic choice"


class ConvResolver:
    """Decisions to :class:`ConvResolution` s, one per node, dtype and plan fusion, kept. ``rt``
    is the backend: ``cp``, ``warn_node(node, message)``, ``note_once(tag, message)`` and the
    device check (``recorded_device``, ``current_device``)."""

    def __init__(self, rt: Any, resources: ConvResources) -> None:
        self.rt = rt
        self.cp = rt.cp
        self.resources = resources
        self._execs: dict[Any, Any] = {}
        self._by_call: dict[int, tuple[Any, Any, Any, Any]] = {}
        self.mismatch_nodes: list[str] = []
        self._plans: dict[str, Any] = {}  # graph-API plans by graph_api.plan_id
        self.engine_builds: list[tuple[str, float, str]] = []  # (node, seconds, why not loaded) per graph-API plan built

    @property
    def device_mismatch(self) -> bool:
        recorded = self.rt.recorded_device
        return bool(recorded) and not _same_device(recorded, self.rt.current_device)

    def resolve(self, call: ConvCall, dtype: Any, fusion: str | None = None) -> Any:
        """The :class:`ConvResolution` (or :data:`REFERENCE`) ``call`` runs with for inputs of ``dtype``
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

    def executions(self) -> list[Any]:
        """The execution objects resolved so far."""
        return list(self._execs.values())

    def replace(self, call: ConvCall, dtype: Any, fusion: str | None, ex: Any) -> None:
        """From now on ``call`` runs ``ex`` (a fallback after a recorded choice failed to run)."""
        self._execs[self._cache_key(call, dtype, fusion)] = ex  # _by_call points here

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
        if d is None or d.is_auto:
            # untuned: cuDNN's heuristic, under the math the model asks for (an untuned conv of an
            # --tf32 off / --precision fp32 model runs FMA math, not TF32); "auto": default math.
            # An engine recorded beside algo "auto" (no legacy fallback measured) is tuned: below
            # it runs its engine, and the heuristic only where the engine cannot run (warned)
            return self.heuristic_exec(call, "untuned", "", math)
        if self.device_mismatch:
            self.mismatch_nodes.append(node)
            return self.heuristic_exec(call, "fallback", f"tuned on {self.rt.recorded_device}", math)
        key, why = self._recorded_key(d, g)
        odd = odd_fusion(d)
        if odd:  # its own tag: the node's one warning may still be needed for what runs instead
            self.rt.note_once(f"fusion:{node}", f"node {node!r}: {odd}")
        # beside an engine, any fusion is its graph's (a legacy epilogue's too); without one, a legacy fused call's
        graph_fusion = d.fusion if d.engine else ""
        if key is not None and d.engine and graph_fusion and graph_fusion != fusion:
            if fusion is None:  # the op-by-op run that records the plan: its plan runs the engine
                logger.debug("node %r: run op by op: %s instead of the fused engine %r", node, _instead(d), d.engine)
            else:
                self.rt.warn_node(node, f"node {node!r}: recorded cuDNN graph-API engine {d.engine!r} is the fused graph conv + {d.fusion}, "
                                        f"which this plan does not run fused (fusion off, or the conv's readers differ); running {_instead(d)} instead")
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
            try:
                conv = conv_exec(key, d.algo, cp=self.cp, descs=self.resources.descriptors(key),
                                 workspace_bytes=self.resources.workspace_bytes(key, d.algo))
            except (cudnn.CudnnError, ValueError) as e:
                why = f"recorded algorithm {d.algo!r} ({key.layout}, {key.math}) is not usable here: {first_line(e)}"
            else:
                fused_call = d.fusion if is_legacy(d.fusion) and not d.engine else ""
                return ConvResolution(node, g.op_type, g, conv, _insert_axis(g, key), "recorded", fused_call=fused_call, op_by_op=fusion is None)
        ex = self.heuristic_exec(call, "fallback", why, math)
        self.rt.warn_node(node, f"node {node!r}: {why}; running cuDNN's heuristic choice {describe_exec(ex)} instead")
        return ex

    def _engine_exec(self, call: ConvCall, d: annotation.ConvDecision, key: ProblemKey) -> ConvResolution | None:
        """The resolution of a recorded graph-API engine, its plan built now (plan-compile time);
        None, with a warning naming the node and the legacy algorithm that runs instead, when it cannot."""
        g = call.geometry
        try:
            if g.op_type != "Conv":
                raise graph_api.GraphApiError(f"engines run forward convolutions, not {g.op_type}")
            plan = self._engine_plan(call.node_name, key, graph_api.EngineConfig.parse(d.engine, d.fusion))
        except (graph_api.GraphApiError, ValueError) as e:
            self.rt.warn_node(call.node_name, f"node {call.node_name!r}: recorded cuDNN graph-API engine {d.engine!r} is not usable here ({first_line(e)}); running {_instead(d)} instead")
            return None
        conv = conv_exec(key, plan.config.algo, plan.config.fusion, cp=self.cp, plan=plan)
        legacy = d.algo if d.algo != annotation.AUTO and Algo.parse(d.algo).bare_of("legacy") else ""
        return ConvResolution(call.node_name, g.op_type, g, conv, _insert_axis(g, key), "recorded", legacy_algo=legacy)

    def legacy_instead(self, ex: ConvResolution) -> ConvResolution | None:
        """The resolution of a recorded engine's legacy algorithm (its problem, memory format and
        math; the conv, then its epilogue as one pass), for an engine that failed to run here; None
        where none is recorded or cuDNN refuses it."""
        if not ex.legacy_algo:
            return None
        try:
            conv = conv_exec(ex.key, ex.legacy_algo, cp=self.cp, descs=self.resources.descriptors(ex.key),
                             workspace_bytes=self.resources.workspace_bytes(ex.key, ex.legacy_algo))
        except (cudnn.CudnnError, ValueError):
            return None
        return ConvResolution(ex.node, ex.op_type, ex.geometry, conv, ex.insert_axis, "recorded", fused_call="", op_by_op=ex.op_by_op)

    def _own_exec(self, call: ConvCall, d: annotation.ConvDecision, key: ProblemKey,
                  fusion: str | None) -> tuple[ConvResolution | None, str]:
        """The resolution of a recorded convpass kernel, built now (plan-compile time), or None and
        why it cannot run here."""
        g = call.geometry
        try:
            if g.op_type != "Conv":
                raise ValueError(f"it computes Conv, not {g.op_type}")
            conv = conv_exec(key, Algo.parse(d.algo).bare, cp=self.cp)
            conv.build()
        except Exception as e:  # noqa: BLE001  (a name or shape it refuses, a compiler error)
            return None, f"recorded kernel {d.algo!r} ({key.layout}) is not usable here: {first_line(e)}"
        fused_call = d.fusion if is_legacy(d.fusion) and not d.engine else ""
        return ConvResolution(call.node_name, g.op_type, g, conv, _insert_axis(g, key), "recorded", fused_call=fused_call,
                              op_by_op=fusion is None), ""

    def _engine_plan(self, node: str, key: ProblemKey, config: Any) -> Any:
        """``config``'s plan for ``key``, one per problem and configuration: loaded from the
        model's kernel side-car when it stores one for this cuDNN, else built (timed into
        :attr:`engine_builds` with the reason, and stored in the side-car being recorded, if any)."""
        ident = graph_api.plan_id(key, config)
        if ident in self._plans:  # the same problem elsewhere in the model: one plan serves every node
            return self._plans[ident]
        self._plans[ident] = plan = self._load_or_build_plan(node, key, config, ident)
        return plan

    def _load_or_build_plan(self, node: str, key: ProblemKey, config: Any, ident: str) -> Any:
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
        """cuDNN's heuristic first choice that is usable, in NCHW, with ``math`` (else default math,
        warned), preferring a workspace under :data:`HEURISTIC_WORKSPACE_LIMIT`; :data:`REFERENCE`, warned,
        when cuDNN offers none."""
        g = call.geometry
        attempts = [("nchw", math)] + ([("nchw", "default")] if math != "default" else [])
        for layout, m in attempts:
            key = ProblemKey(g.shapes[0], layout, m)
            try:
                descs = self.resources.descriptors(key)
                ranking = cudnn.heuristic(descs)
            except (cudnn.CudnnError, ValueError) as e:
                logger.debug("node %r: no cuDNN descriptors / heuristic for %s: %s", call.node_name, key, e)
                continue
            usable = []
            for p in ranking:
                if not p.ok:
                    continue
                try:
                    ws = self.resources.workspace_bytes(key, p.algo)
                except (cudnn.CudnnError, ValueError):
                    continue
                usable.append((p.algo, ws))
            if not usable:
                continue
            small = [u for u in usable if u[1] <= HEURISTIC_WORKSPACE_LIMIT]
            algo, ws = (small or usable)[0]
            conv = conv_exec(key, algo, cp=self.cp, descs=descs, workspace_bytes=ws)
            if m != math:
                self.rt.warn_node(call.node_name, f"node {call.node_name!r}: cuDNN's heuristic offers no usable algorithm under "
                                                  f"{math} math for {g.shapes[0]}: running it under default math (TF32 allowed)")
            return ConvResolution(call.node_name, g.op_type, g, conv, _insert_axis(g, key), source, note)
        self.rt.warn_node(call.node_name, f"node {call.node_name!r}: cuDNN offers no usable algorithm for {g.shapes[0]}: running CuPy reference kernels")
        return REFERENCE


def odd_fusion(d: annotation.ConvDecision) -> str | None:
    """What is wrong with a decision's recorded ``fusion`` (an edited or damaged model), or None:
    without an engine it must name a legacy epilogue (beside an engine it names the engine's
    graph, a legacy epilogue's or an activation's; one the engine cannot parse is warned where
    its plan is built)."""
    if d.fusion and not d.engine and not is_legacy(d.fusion):
        return (f"recorded fusion {d.fusion!r} names no legacy epilogue ({', '.join(LEGACY)}) and no engine records it: "
                "running the conv, then its epilogue as one pass")
    return None


def describe_exec(ex: Any) -> str:
    if ex is REFERENCE:
        return "(none: CuPy reference kernels)"
    return f"{ex.algo!r} ({ex.memory_format}, {ex.key.math})"


def summarize(s: Any, ex: Any) -> Any:
    """A plan's :class:`~convpass.kernels.plan.ConvSummary` updated with how the conv really runs:
    the algorithm (an engine's id, knobs and fused graph), memory format, math and workspace of
    the execution object the decision resolved to."""
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

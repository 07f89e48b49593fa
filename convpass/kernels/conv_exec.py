"""One execution object per candidate family: what the tuner times is what the executor runs.

A convolution candidate is built once, from its problem key, its algorithm
(:class:`~convpass.core.algo.Algo`) and the epilogue its step runs (:mod:`convpass.core.fusion`
names), by :func:`conv_exec`. It is launched by one method, ``launch(x, w, y, workspace, bias=None,
z=None)``. The tuner (:mod:`convpass.tuning.candidates`) checks that launch against its reference
and times it through :mod:`convpass.tuning.harness`; the executor
(:mod:`convpass.kernels.convolution`) resolves a decision to an object of the same class, with the
same algorithm and workspace, and calls the same launch.

=================  ==========================================  ============================================
class              algorithm (:class:`~convpass.core.algo.Algo`)  one launch
=================  ==========================================  ============================================
``LegacyConv``     a cuDNN legacy algorithm                    the conv, then the epilogue as one pass
``FusedLegacyConv`` ``<legacy>+bias[+add][+relu]``             cuDNN's fused conv + bias (+ z) + identity /
                                                               ReLU call
``EngineConv``     ``engine:<config>``, ``...+bias+swish``     the graph-API plan (a fused graph: its
                   (``+add``: with the residual),              epilogue in the call; else one pass after)
                   ``...+bias+add+relu`` (a legacy epilogue)
``OwnConv``        ``convpass_depthwise_r<R>[+<epilogue>]``    convpass's kernel, its epilogue in it (a
                                                               fused name) or as one pass after
=================  ==========================================  ============================================

Rules
-----
1. Arrays are named as the forward geometry names them (``x`` input, ``w`` filter, ``y`` output),
   logical channels-first, stored in the key's memory format, of the key's rank (a 1-D conv's
   arrays mapped to 2-D by the caller). The launch writes its direction's output: ``y`` (fwd),
   ``x`` (dgrad), ``w`` (wgrad); the epilogue runs over that output.
2. Epilogues: ``""`` (none), ``"relu"`` (a ConvTranspose's absorbed Relu, no bias), the legacy
   ones (``bias``, ``bias+relu``, ``bias+add``, ``bias+add+relu``: ``z`` added before the
   ReLU), and a fused graph's (``bias+swish``, ``bias+leakyrelu<alpha>``, either followed by
   ``+add``: ``z`` added after the activation; an engine's only; an engine also runs the legacy
   ones as fused graphs, ``z`` before the ReLU). ``bias``: the ``(K,)`` values,
   contiguous where :attr:`ConvExec.contiguous_bias` says so (zeros for a conv without a bias
   whose step adds a residual: :mod:`convpass.core.fusion`, "A conv without a bias"); ``z``: the residual, shaped as the
   output (a fused graph's: packed like ``y``, or with a key's residual slice that slice, rule 3,
   and never sharing its memory: the launch refuses ``y`` aliasing ``z``).
3. Outputs: packed in the key's memory format, or where :attr:`ConvExec.output_strides` allows a
   slice of a larger buffer (a Concat's): ``"same_order"`` in the key's memory order (cuDNN's
   forward call takes the slice's strides), ``"any"`` with any strides (convpass's kernel), or
   where :attr:`ConvExec.output_slice_strides` names strides (a graph-API plan of a key with an
   :class:`~convpass.core.problem.OutputSlice`, bare or fused, built writing ``y`` with the slice's
   strides where cuDNN builds it so: :attr:`ConvExec.output_refusal` says why not) a channel slice
   of exactly those. Inputs ``x``: packed in the key's memory format, or where :attr:`ConvExec.input_strides` is
   ``"slice"`` a channel slice of a buffer packed in that format
   (:func:`~convpass.native.cudnn.arrays.channel_slice`: cuDNN's forward call, plain or fused,
   takes the slice's strides), or where :attr:`ConvExec.input_slice_strides` names strides (a
   graph-API plan of a key with an :class:`~convpass.core.problem.InputSlice`, built reading ``x``
   with the slice's strides where cuDNN builds it so: :attr:`ConvExec.input_refusal` says why
   not) a channel slice of exactly those. The tuner times the input the key names: packed, or where the key
   has an :class:`~convpass.core.problem.InputSlice` that slice of a wider buffer, read in place
   where the object reads slices and cuDNN takes them, else copied first as the executor copies it
   (:func:`refuses_slice`), the copy in the time; so for the output a key names as an
   :class:`~convpass.core.problem.OutputSlice` (written in place where the object writes slices
   and cuDNN takes them, else written packed and copied into the slice after, as the executor
   does). A residual ``z``: packed like ``y``, or where :attr:`ConvExec.residual_strides` names
   strides (a graph-API fused graph of a key with a :class:`~convpass.core.problem.ResidualSlice`:
   its plan is built reading ``z`` with the slice's strides) exactly those; the tuner times the
   key's slice read in place there, and copied into a packed buffer first for an object that
   reads a packed ``z`` (cuDNN's legacy fused call), as the executor copies it. A key's
   workspace covers its strided calls (:func:`legacy_workspace`); a strided call whose workspace
   would outgrow the object's is refused here as cuDNN refuses a stride it does not take
   (:class:`~convpass.core.cudnn_enums.CudnnError`, ``CUDNN_STATUS_BAD_PARAM``).
4. A launch allocates nothing and waits for nothing, so it can be captured into a CUDA graph.
   :attr:`ConvExec.counts` names the executor's counters a launch adds one to
   (:data:`EPILOGUE_PASSES` once more where its epilogue runs as a pass of its own).
5. A fused engine graph's launch may overlap the end of its producer (a programmatic dependency);
   that overlap is prevented by a memset fence before the launch, or in a captured plan by the
   runner making the graph's programmatic edges default ones: :data:`FENCE` chooses,
   :func:`fence_needed` states the trade-off (which the tuner's times hold and which they miss).
6. Every launch tells the listeners (:func:`add_launch_listener`, :func:`record_launches`) the
   object and its arguments: the tests' proof that the tuner and the executor launch the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

from convpass.core.algo import Algo
from convpass.core.cudnn_enums import STATUS, CudnnError
from convpass.core.fusion import is_legacy, legacy_name, parts, takes_residual
from convpass.core.layout import storage_order
from convpass.core.problem import ProblemKey
from convpass.kernels import depthwise
from convpass.native import cuda_graph_edges, cudnn
from convpass.native.cuda import elements, stream_fence
from convpass.native.cudnn import graph_api

__all__ = [
    "EPILOGUE_PASSES", "FENCE", "FENCES", "ConvExec", "EngineConv", "ExecIdentity", "FusedLegacyConv", "LaunchRecord", "LegacyConv", "OwnConv", "add_launch_listener",
    "apply_epilogue", "conv_exec", "epilogue_kernel", "fence_needed", "fusion_counter", "legacy_workspace", "refuses_slice", "remove_launch_listener",
    "record_launches", "step_epilogue",
]

_OUTPUT = {"fwd": 2, "dgrad": 0, "wgrad": 1}  # which of (x, w, y) a direction writes
EPILOGUE_PASSES = "epilogue_passes"  # the counter of epilogues run as an element-wise pass after their conv (rule 4)
# cuDNN refusing a strided tensor it does not take (rule 3)
_REFUSALS = (STATUS["CUDNN_STATUS_BAD_PARAM"], STATUS["CUDNN_STATUS_NOT_SUPPORTED"])


def refuses_slice(e: BaseException, write: bool = False) -> bool:
    """Whether ``e`` is cuDNN refusing a launch's strided tensors (rule 3): ``CUDNN_STATUS_NOT_SUPPORTED``
    or ``BAD_PARAM`` (the workspace check of :class:`_StridedCalls` raises the latter); where the
    launch wrote a slice (``write``), any cuDNN error."""
    return isinstance(e, CudnnError) and (write or e.category in _REFUSALS)


def legacy_workspace(descs: Any, key: ProblemKey, algo: str, handle: Any = None) -> int:
    """The workspace a legacy algorithm needs for ``key``: the packed call's, and for a key whose
    input or output is a channel slice (:attr:`~convpass.core.problem.ProblemKey.x_strides`,
    ``y_strides``) each strided call the launch may make where cuDNN takes it (both slices, and
    each alone after a refusal of the other; where cuDNN takes none, the launch is refused and
    the slice copied, rule 3). Raises :class:`~convpass.core.cudnn_enums.CudnnError` where the
    packed call is refused."""
    kw = {} if handle is None else {"handle": handle}
    ws = cudnn.workspace_size(descs, None, algo, **kw)
    xs, ys = key.x_strides, key.y_strides
    if key.shape.direction != "fwd" or (xs is None and ys is None):
        return ws
    for strided in dict.fromkeys(c for c in ((xs, ys), (xs, None), (None, ys)) if c != (None, None)):
        try:
            ws = max(ws, cudnn.workspace_size(descs, None, algo, x_strides=strided[0], y_strides=strided[1], **kw))
        except CudnnError as e:
            if not refuses_slice(e, write=strided[1] is not None):
                raise
    return ws


def step_epilogue(bias: bool, residual: bool, relu: bool) -> str:
    """The name of the epilogue a step runs after its conv (rule 2): the legacy name with a bias,
    ``"relu"`` or ``""`` without one."""
    if bias:
        return legacy_name(residual, relu)
    if residual:
        raise ValueError("a conv step adds a residual only with a bias (a conv without one is given a zero bias)")
    return "relu" if relu else ""


def _pass_parts(name: str) -> tuple[bool, bool, bool]:
    """``(bias, residual, relu)`` of an epilogue run as one element-wise pass (rule 2)."""
    if name in ("", "relu"):
        return False, False, name == "relu"
    return (True, *parts(name))


def fusion_counter(fusion: str) -> str:
    """The backend counter of launches that ran a fused graph-API epilogue (``fused_bias_swish``,
    ``fused_bias_leakyrelu`` for any alpha; ``..._add`` with the residual; a legacy epilogue's
    graph ``fused_bias``, ``fused_bias_relu``, ``fused_bias_add``, ``fused_bias_add_relu``)."""
    return graph_api.fusion_of(fusion).counter


def _fused_counter(residual: bool, relu: bool) -> str:
    """The backend counter of a conv whose legacy epilogue ran in its own call."""
    return "fused_" + ("residual_" if residual else "") + ("relu" if relu else "identity")


@dataclasses.dataclass(frozen=True)
class ExecIdentity:
    """What identifies an execution object: its class, problem, exact algorithm (engine id and
    knobs, fused epilogue), the epilogue its step runs and its workspace."""

    kind: str
    key: ProblemKey
    algo: str
    epilogue: str
    workspace_bytes: int


class ConvExec:
    """One candidate of one problem key, ready to launch (see the module rules)."""

    output_strides = "packed"  # rule 3
    input_strides = "packed"  # rule 3
    input_slice_strides: tuple[int, ...] | None = None  # rule 3: the element strides of the only x slice it reads in place (None: see input_strides)
    input_refusal = ""  # rule 3: why an object of a key with an input slice reads a packed x where its family could read the slice
    output_slice_strides: tuple[int, ...] | None = None  # rule 3: the element strides of the only y slice it writes in place (None: see output_strides)
    output_refusal = ""  # rule 3: why an object of a key with an output slice writes a packed y where its family could write the slice
    residual_strides: tuple[int, ...] | None = None  # rule 3: the element strides of the z it reads (None: packed)
    contiguous_bias = False  # rule 2

    def __init__(self, key: ProblemKey, algo: Algo, epilogue: str, cp: Any, workspace_bytes: int) -> None:
        self.key, self.algo, self.epilogue, self.cp = key, algo, epilogue, cp
        self.workspace_bytes = int(workspace_bytes)

    def launch(self, x: Any, w: Any, y: Any, workspace: Any, bias: Any = None, z: Any = None) -> None:
        """The conv's step: the conv and its epilogue (module rules), enqueued on CuPy's current stream."""
        self._launch(x, w, y, workspace, bias, z)
        listeners = _listeners
        if listeners:
            for fn in listeners:
                fn(self, (x, w, y, workspace, bias, z))

    def _launch(self, x: Any, w: Any, y: Any, workspace: Any, bias: Any, z: Any) -> None:
        raise NotImplementedError

    @property
    def _pass_counts(self) -> tuple[str, ...]:
        """:data:`EPILOGUE_PASSES` where :meth:`_pass` runs one, else nothing."""
        return (EPILOGUE_PASSES,) if self.epilogue else ()

    def _pass(self, out: Any, bias: Any, z: Any) -> None:
        """The epilogue as one element-wise pass over ``out`` (none for ``""``)."""
        if not self.epilogue:
            return
        with_bias, residual, relu = _pass_parts(self.epilogue)
        if (with_bias and bias is None) or (residual and z is None):
            raise ValueError(f"{self.describe()}: the epilogue needs {'its bias' if bias is None else 'its residual'}")
        apply_epilogue(self.cp, out, bias if with_bias else None, relu, z if residual else None)

    def prepare_weight(self, w: Any) -> Any:
        """``w`` as the launch reads it fastest (called once per weight, never per launch)."""
        return w

    @property
    def weight_form(self) -> str:
        """Names :meth:`prepare_weight`'s form (``""``: the weight as it is), for caches of it."""
        return ""

    @property
    def counts(self) -> tuple[str, ...]:
        """The executor's counters one launch adds one to (rule 4)."""
        raise NotImplementedError

    @property
    def identity(self) -> ExecIdentity:
        return ExecIdentity(type(self).__name__, self.key, str(self.algo), self.epilogue, self.workspace_bytes)

    def describe(self) -> str:
        then = f", then {self.epilogue} as one pass" if self.epilogue and not self.algo.fusion else ""
        return f"{type(self).__name__} {str(self.algo)!r} ({self.key.layout}, {self.key.math}{then}; workspace {self.workspace_bytes} B)"

    def __repr__(self) -> str:
        return f"<{self.describe()}>"


class _StridedCalls:
    """Rule 3's strided forward calls of cuDNN's legacy API: the element strides of the slices a
    launch passes, each set's workspace asked of cuDNN once and checked against the object's."""

    def __init__(self) -> None:
        self.fits: dict[tuple[tuple[int, ...] | None, tuple[int, ...] | None], int] = {}

    def strides(self, conv: Any, x: Any, y: Any | None) -> dict[str, Any]:
        """``x_strides`` / ``y_strides`` of the slices among ``x`` (a channel slice; any other
        layout is left to the call's check) and ``y`` (None: packed)."""
        layout = conv.key.layout
        strided: dict[str, Any] = {}
        if cudnn.channel_slice(x, layout):
            strided["x_strides"] = elements(x.strides, x.itemsize)
        if y is not None and cudnn.layout_of(y) not in (layout, "both"):
            strided["y_strides"] = elements(y.strides, y.itemsize)
        if strided:
            self._check(conv, strided.get("x_strides"), strided.get("y_strides"))
        return strided

    def _check(self, conv: Any, xs: tuple[int, ...] | None, ys: tuple[int, ...] | None) -> None:
        need = self.fits.get((xs, ys))
        if need is None:
            need = self.fits[(xs, ys)] = cudnn.workspace_size(conv.descs, None, conv.algo.name, x_strides=xs, y_strides=ys)
        if need > conv.workspace_bytes:
            raise CudnnError(STATUS["CUDNN_STATUS_BAD_PARAM"], f"the workspace check of a strided call (x strides {xs}, "
                             f"y strides {ys}: {need} B of workspace needed, {conv.workspace_bytes} B given)")


class LegacyConv(ConvExec):
    """A cuDNN legacy algorithm: the conv (``cudnn.run``, the key's direction), then the epilogue as one pass."""

    def __init__(self, key: ProblemKey, algo: Algo, epilogue: str, cp: Any, descs: Any, workspace_bytes: int | None = None) -> None:
        if not algo.bare_of("legacy"):
            raise ValueError(f"{algo} is not a bare cuDNN legacy algorithm")
        _pass_parts(epilogue)
        if workspace_bytes is None:
            workspace_bytes = legacy_workspace(descs, key, algo.name)
        super().__init__(key, algo, epilogue, cp, workspace_bytes)
        self.descs = descs
        self.direction = key.shape.direction
        self._strided = _StridedCalls()
        if self.direction == "fwd":
            self.output_strides = "same_order"
            self.input_strides = "slice"

    def _launch(self, x: Any, w: Any, y: Any, workspace: Any, bias: Any, z: Any) -> None:
        strided = self._strided.strides(self, x, y) if self.direction == "fwd" else {}  # slices of larger buffers (rule 3)
        cudnn.run(self.descs, None, self.algo.name, x, w, y, workspace=workspace, **strided)
        self._pass((x, w, y)[_OUTPUT[self.direction]], bias, z)

    @property
    def counts(self) -> tuple[str, ...]:
        return ("cudnn_calls", *self._pass_counts)


class FusedLegacyConv(ConvExec):
    """cuDNN's fused ``act(conv(x, w) + z + bias)`` call (``cudnnConvolutionBiasActivationForward``)
    of a legacy algorithm, its epilogue the algorithm's fusion."""

    contiguous_bias = True
    input_strides = "slice"  # rule 3

    def __init__(self, key: ProblemKey, algo: Algo, epilogue: str, cp: Any, descs: Any, workspace_bytes: int | None = None) -> None:
        if algo.family != "legacy" or not is_legacy(algo.fusion) or epilogue != algo.fusion or key.shape.direction != "fwd":
            raise ValueError(f"{algo} is no fused forward call of the epilogue {epilogue!r}")
        if workspace_bytes is None:
            workspace_bytes = legacy_workspace(descs, key, algo.name)
        super().__init__(key, algo, epilogue, cp, workspace_bytes)
        self.descs = descs
        self.residual, self.relu = parts(epilogue)
        self._strided = _StridedCalls()

    def _launch(self, x: Any, w: Any, y: Any, workspace: Any, bias: Any, z: Any) -> None:
        strided = self._strided.strides(self, x, None)  # an input slice (rule 3); the output is packed
        cudnn.conv_bias_activation_forward(self.descs, self.algo.name, x, w, y, bias, z=z if self.residual else None,
                                           activation="relu" if self.relu else "identity", workspace=workspace, **strided)

    @property
    def counts(self) -> tuple[str, ...]:
        return ("cudnn_calls", _fused_counter(self.residual, self.relu))


# How a fused engine graph is kept from overlapping the end of its producer: "memset", a fence
# before each launch; "edges", a fence before each eager launch only, the captured graphs'
# programmatic edges made default before they are instantiated (where the driver cannot, "memset").
# See fence_needed.
FENCE = "edges"
FENCES = ("memset", "edges")


def fence_needed(conv: EngineConv) -> bool:
    """Whether a stream fence (:func:`~convpass.native.cuda.stream_fence`) goes before ``conv``'s
    launch, so that it starts only after everything before it on its stream: never a bare
    engine's; a fused graph's by :data:`FENCE`. The launch asks this one function (a module
    attribute) every time.

    A fused graph's kernels may start before their producer has finished (a programmatic
    dependency, which stream capture records as a programmatic edge); some then read inputs not
    yet written, in captured plans and in eager runs alike. Two ways out:

    - ``"memset"``: a 16-byte memset before every fused launch, eager or captured (a few
      microseconds per launch, in graphs too).
    - ``"edges"``: a memset before every eager fused launch, none while the stream is captured;
      the runner makes every programmatic edge of a captured graph a default one
      (:mod:`convpass.native.cuda_graph_edges`), which costs nothing in the graph but the overlap
      those edges allowed. The tuner times its launches in captured graphs (unfenced, edges as
      captured: its times may be lower than the executor's graph by that overlap); its first,
      checked launch is eager and fenced. Where the driver cannot rewrite edges (older than
      CUDA 12.3, or a call failed), every fused launch is fenced as with ``"memset"``.
    """
    if not conv.fused:
        return False
    if FENCE == "edges" and cuda_graph_edges.unavailable_reason() is None:
        return not conv.cp.cuda.get_current_stream().is_capturing()
    return True


class EngineConv(ConvExec):
    """A graph-API engine configuration's plan (:class:`~convpass.native.cudnn.graph_api.EnginePlan`):
    a fused graph (an activation's, or a legacy epilogue's) runs its epilogue in its call, ``z``
    included where it reads one; a bare one runs the step's epilogue as one pass after. A stream
    fence goes before the launches :func:`fence_needed` names."""

    def __init__(self, key: ProblemKey, algo: Algo, epilogue: str, cp: Any, plan: Any) -> None:
        if not algo.is_engine or plan.config.algo != str(algo):
            raise ValueError(f"the plan of {plan.config.algo} does not run {algo}")
        self.fused = bool(algo.fusion)
        if self.fused and epilogue != algo.fusion:
            raise ValueError(f"{algo} runs the epilogue {algo.fusion!r}, not {epilogue!r}")
        if not self.fused:
            _pass_parts(epilogue)
        super().__init__(key, algo, epilogue, cp, plan.workspace_bytes)
        self.plan = plan
        self.contiguous_bias = self.fused
        self.residual = self.fused and takes_residual(algo.fusion)  # its graph reads z (before or after its activation)
        self.residual_strides = key.z_strides if self.residual else None  # its plan reads z with the key's slice strides
        # its plan reads x with the key's input slice strides, or packed where cuDNN did not build it so (a plan that names none: packed)
        reads = getattr(plan, "x_strides", None)
        self.input_slice_strides = reads if reads is not None and reads == key.x_strides else None
        self.input_refusal = getattr(plan, "x_refusal", "") if key.x_strides is not None and self.input_slice_strides is None else ""
        writes = getattr(plan, "y_strides", None)  # likewise y and the key's output slice
        self.output_slice_strides = writes if writes is not None and writes == key.y_strides else None
        self.output_refusal = getattr(plan, "y_refusal", "") if key.y_strides is not None and self.output_slice_strides is None else ""

    def _launch(self, x: Any, w: Any, y: Any, workspace: Any, bias: Any, z: Any) -> None:
        ws = workspace if self.workspace_bytes > 0 else None
        odd = graph_api.misaligned(x=x, w=w, y=y, bias=bias if self.fused else None, z=z if self.residual else None)
        if odd:  # a view at an odd offset: refused as cuDNN refuses, never a misaligned read (a sticky CUDA error)
            # x, y or z (the first of them; w and the bias aligned): a copy of it, at an aligned start, may run
            refusals = {"x": graph_api.InputRefused, "y": graph_api.OutputRefused, "z": graph_api.ResidualRefused}
            refused = refusals.get(odd[0], graph_api.GraphApiError) if set(odd) <= set(refusals) else graph_api.GraphApiError
            raise refused(f"{self.algo}: {', '.join(odd)} not {graph_api.ALIGNMENT}-byte aligned, as its plan assumes")
        if fence_needed(self):
            stream_fence(self.cp)  # timed with the launch it guards: the tuner's rows hold it
        if self.fused:
            if self.residual:
                self.plan.execute(x, w, y, ws, bias=bias, z=z)
            else:
                self.plan.execute(x, w, y, ws, bias=bias)
            return
        self.plan.execute(x, w, y, ws)
        self._pass(y, bias, z)

    @property
    def counts(self) -> tuple[str, ...]:
        return ("graph_api_calls", fusion_counter(self.algo.fusion)) if self.fused else ("graph_api_calls", *self._pass_counts)


class OwnConv(ConvExec):
    """convpass's depthwise kernel (:mod:`convpass.kernels.depthwise`): a fused name runs its legacy
    epilogue in the kernel, a bare one runs the step's epilogue as one pass after. Writes into
    outputs of any strides."""

    output_strides = "any"

    def __init__(self, key: ProblemKey, algo: Algo, epilogue: str, cp: Any, kernel: Any = None) -> None:
        if not algo.is_own:
            raise ValueError(f"{algo} is not a convpass kernel")
        self.in_kernel = bool(algo.fusion)
        if self.in_kernel and (epilogue != algo.fusion or not is_legacy(epilogue)):
            raise ValueError(f"{algo} runs the epilogue {algo.fusion!r}, not {epilogue!r}")
        _pass_parts(epilogue)
        super().__init__(key, algo, epilogue, cp, 0)
        self.kernel = kernel if kernel is not None else depthwise.DepthwiseKernel.of(algo.name, key.shape, key.layout)
        self.contiguous_bias = self.in_kernel

    def build(self) -> None:
        """Compile the kernel now (from the kernel side-car when the model has one)."""
        self.kernel.build(self.cp)

    def prepare_weight(self, w: Any) -> Any:
        return self.kernel.weight(self.cp, w)

    @property
    def weight_form(self) -> str:
        return "tap_major" if self.kernel.channels_last else ""

    def _launch(self, x: Any, w: Any, y: Any, workspace: Any, bias: Any, z: Any) -> None:
        if self.in_kernel:
            _, residual, relu = _pass_parts(self.epilogue)
            self.kernel(self.cp, x, w, y, bias, z if residual else None, relu)
            return
        self.kernel(self.cp, x, w, y)
        self._pass(y, bias, z)

    @property
    def counts(self) -> tuple[str, ...]:
        if self.in_kernel:
            _, residual, relu = _pass_parts(self.epilogue)
            return (_fused_counter(residual, relu), "own_kernel_calls")
        return ("own_kernel_calls", *self._pass_counts)


def conv_exec(key: ProblemKey, algo: Algo | str, epilogue: str = "", *, cp: Any = None, descs: Any = None,
              workspace_bytes: int | None = None, plan: Any = None, enumerated: Any = None, kernel: Any = None,
              like: ConvExec | None = None) -> ConvExec:
    """The execution object of ``algo`` for ``key`` running the step's ``epilogue``: a bare legacy
    algorithm a :class:`LegacyConv`, a fused one a :class:`FusedLegacyConv`, an engine an
    :class:`EngineConv`, convpass's kernel an :class:`OwnConv`. What it needs comes from the keywords
    or from ``like`` (an object of the same algorithm: its descriptors, workspace, plan or kernel):
    a legacy algorithm's ``descs`` (the key's :class:`~convpass.native.cudnn.ConvDescriptors`);
    what else is missing is made here (the workspace size cuDNN answers, the engine's plan on
    ``enumerated`` if given, the kernel object). Raises what making them raises
    (:class:`~convpass.core.cudnn_enums.CudnnError`, :class:`~convpass.native.cudnn.graph_api.GraphApiError`,
    ValueError for a name or geometry a family refuses)."""
    algo = Algo.parse(algo) if isinstance(algo, str) else algo
    if like is not None:
        if like.algo.bare != algo.bare:
            raise ValueError(f"{algo} cannot be made like {like.algo}")
        cp = like.cp if cp is None else cp
        descs = getattr(like, "descs", None) if descs is None else descs
        plan = getattr(like, "plan", None) if plan is None else plan
        kernel = getattr(like, "kernel", None) if kernel is None else kernel
        workspace_bytes = like.workspace_bytes if workspace_bytes is None else workspace_bytes
    if algo.family == "legacy":
        return (FusedLegacyConv if algo.fusion else LegacyConv)(key, algo, epilogue, cp, descs, workspace_bytes)
    if algo.family == "engine":
        if plan is None:
            plan = graph_api.EnginePlan(key, graph_api.EngineConfig.parse(str(algo)), enumerated)
        return EngineConv(key, algo, epilogue, cp, plan)
    if algo.family == "own":
        return OwnConv(key, algo, epilogue, cp, kernel)
    raise ValueError(f"{algo} runs no convolution of its own")


# ---------------------------------------------------------------------------------------------
# the epilogue as one element-wise pass


def apply_epilogue(cp: Any, y: Any, b: Any, relu: bool, z: Any = None, src: Any = None) -> None:
    """``y = act(y + z + b)`` in place, in one element-wise pass (``b``: None or the ``(K,)`` bias;
    ``z``: None or an array of ``y``'s shape): a conv's epilogue when it does not run fused into the
    conv's call (:mod:`convpass.core.fusion`). With ``src`` (an array of ``y``'s shape), ``y =
    act(src + z + b)``: the pass reads the conv's result and writes ``y`` (a ConvTranspose's into its
    Concat slice). The pass runs over the storage order of ``y`` where ``z`` and ``src`` have the
    same one: over a channels-last array seen channels-first, element-wise kernels read and write
    with a stride of C elements."""
    order = storage_order(y)  # a channels-last array, or a channel slice of one (a Concat buffer's)
    phys = y.transpose(order) if order else y
    if b is None and z is None and src is None:
        if relu:
            cp.maximum(phys, y.dtype.type(0), out=phys)
        return
    others = [a for a in (src, z) if a is not None]
    if any(storage_order(a) != order for a in others):
        phys = y  # logical views: right whatever the strides
    view = (lambda a: a.transpose(order)) if phys is not y else (lambda a: a)
    args = [] if src is None else [view(src)]
    args += [] if b is None else [b if phys is not y else b.reshape((1, -1) + (1,) * (y.ndim - 2))]
    args += [] if z is None else [view(z)]
    if src is None:
        epilogue_kernel(cp, b is not None, z is not None, relu)(*args, phys)
    else:
        epilogue_kernel(cp, b is not None, z is not None, relu, source=True)(*args, phys)


_epilogue_kernels: dict[tuple[Any, bool, bool, bool, bool], Any] = {}


def epilogue_kernel(cp: Any, bias: bool, residual: bool, relu: bool, source: bool = False) -> Any:
    """The CuPy element-wise kernel ``y = act(y + z + b)`` over the operands present (inputs ``b``
    then ``z``, broadcast to ``y``; ``y`` read and written in place; a ReLU that keeps NaN);
    ``source``: ``y = act(s + z + b)`` with a first input ``s`` of ``y``'s shape, ``y`` only written."""
    key = (cp, bias, residual, relu, source)
    if key not in _epilogue_kernels:
        inputs = [name for name, on in (("T s", source), ("T b", bias), ("T z", residual)) if on]
        terms = [name[2:] for name in inputs]
        value = " + ".join(terms if source else ["y", *terms])
        body = f"T v = {value}; y = v < (T)0 ? (T)0 : v" if relu else f"y = {value}"
        name = "convpass_epilogue" + "".join(part for part, on in (("_from", source), ("_bias", bias), ("_residual", residual), ("_relu", relu)) if on)
        _epilogue_kernels[key] = cp.ElementwiseKernel(", ".join(inputs), "T y", body, name)
    return _epilogue_kernels[key]


# ---------------------------------------------------------------------------------------------
# launch listeners (rule 6)

LaunchListener = Callable[[ConvExec, tuple[Any, ...]], None]
_listeners: tuple[LaunchListener, ...] = ()
_listeners_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class LaunchRecord:
    """One launch as :func:`record_launches` keeps it: the object's identity and each argument's
    shape, dtype and element strides (no reference to the arrays)."""

    identity: ExecIdentity
    args: tuple[Any, ...]  # (x, w, y, workspace, bias, z), each _signature'd


def _signature(a: Any) -> Any:
    if a is None or not hasattr(a, "shape"):
        return None if a is None else type(a).__name__
    return tuple(a.shape), str(a.dtype), elements(a.strides, a.itemsize)


def add_launch_listener(fn: LaunchListener) -> None:
    """Call ``fn(exec, (x, w, y, workspace, bias, z))`` after every launch, from the launching thread."""
    global _listeners
    with _listeners_lock:
        _listeners = _listeners + (fn,)


def remove_launch_listener(fn: LaunchListener) -> None:
    """Remove one registration of ``fn`` (no error when it is not registered)."""
    global _listeners
    with _listeners_lock:
        items = list(_listeners)
        if fn in items:
            items.remove(fn)
        _listeners = tuple(items)


@contextlib.contextmanager
def record_launches() -> Iterator[list[LaunchRecord]]:
    """``with record_launches() as launched: ...`` keeps a :class:`LaunchRecord` per launch made inside."""
    launched: list[LaunchRecord] = []

    def keep(conv: ConvExec, args: tuple[Any, ...]) -> None:
        launched.append(LaunchRecord(conv.identity, tuple(_signature(a) for a in args)))

    add_launch_listener(keep)
    try:
        yield launched
    finally:
        remove_launch_listener(keep)

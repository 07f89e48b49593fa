"""cuDNN's graph API as a second tuning space: engine configurations of ``y = conv(x, w)``, and
of fused graphs ``y = act(conv(x, w) + b)`` and ``y = act(conv(x, w) + b + z)``.

The legacy API offers 8 forward algorithms; cuDNN 9's graph API offers the engine configurations
its heuristics (modes A and B) and fallback list return for an operation graph, with their knobs
(tile sizes, split-K, ...). Some convolutions run several times faster on graph-API engines than
on any legacy algorithm (EfficientNet-B0's depthwise convs in NHWC:
docs/measurements/2026-11-23-graph-api-engines.md). This module reaches
that API through NVIDIA's own Python binding, the ``nvidia-cudnn-frontend`` package (imported as
``cudnn``; in ``pip install convpass[gpu]``, or ``convpass[graph]`` alone), and is the one place that knows it.

Rules
-----
* **One operation graph per problem key and epilogue.** Every engine candidate is an engine
  configuration of the graph ``y = conv_fprop(x, w)``, or of one fused graph below: the forward
  direction only, over the key's shapes, memory format and data type, compute in float32. The
  bare graph has no bias: the fast depthwise engine offered for the bare conv was not offered
  once a bias add was in the graph (the tuner then found only generic engines, several times
  slower), so the executor adds the bias after a bare conv, and the tuner times a bare engine
  with that pass (a legacy algorithm often has its bias fused into its call: timed by the bare
  conv, engines won where they lost in the network).
* **Fused epilogues** (:func:`fusion_of`). Where a conv's only readers are an activation cuDNN's
  graph API can fuse, the tuner also measures the graph ``y = act(conv(x, w) + b)``: conv, bias
  and activation in one engine, named by the part after the conv (``bias+swish``: SiLU, read in
  ONNX as ``Mul(y, Sigmoid(y))``; ``bias+leakyrelu<alpha>``: ONNX's ``LeakyRelu``, its alpha in
  the name, :func:`convpass.core.fusion.leakyrelu_name`, which cuDNN's legacy fused call cannot
  run: its activations are identity and ReLU), and either followed by a residual Add,
  ``y = act(conv(x, w) + b) + z`` (``bias+swish+add``, ``bias+leakyrelu<alpha>+add``:
  :func:`convpass.core.fusion.residual_fusion`): a pointwise ADD whose second input is the
  residual ``z``, a tensor of the output's dims and strides that the plan reads at execution
  (never the output itself: :meth:`EnginePlan.execute` refuses ``z`` overlapping ``y``; for a key
  with a residual slice, ``zslice``, the slice's strides, and a ``z`` of others is refused: :class:`ResidualRefused`). A fused depthwise conv costs about what the bare conv does,
  which removes two passes over the output (the bias and the SiLU kernel).
* **Input slices.** For a key whose input is a channel slice (``xslice``: a dense block's conv
  reading a prefix of its Concat buffer), every graph, bare or fused, reads ``x`` with the
  slice's strides (:attr:`~convpass.core.problem.ProblemKey.x_strides`), so a plan reads the
  slice in place. A configuration cuDNN does not offer or build for those strides is built
  reading a packed ``x`` (:func:`enumerate_configs` lists both graphs' configurations; a plan
  tries the slice's strides first): :attr:`EnginePlan.x_strides` says which a plan reads,
  :attr:`EnginePlan.x_refusal` why not the slice's, and :meth:`EnginePlan.execute` refuses an
  ``x`` of other strides (:class:`InputRefused`: a copy of ``x`` into them may run).
* **Output slices.** Likewise for a key whose output is written into a channel slice
  (``yslice``: a dense block's conv, its LeakyRelu fused, writing its slice of the Concat
  buffer): every graph writes ``y`` with the slice's strides
  (:attr:`~convpass.core.problem.ProblemKey.y_strides`) where cuDNN builds it so, else a packed
  ``y`` (:attr:`EnginePlan.y_strides`, :attr:`EnginePlan.y_refusal`); :meth:`EnginePlan.execute`
  refuses, for such a key, a ``y`` of other strides (:class:`OutputRefused`: the launch into a
  buffer of the plan's strides, then a copy, may run). A key with both slices tries both, then
  each alone, then neither (:func:`~convpass.native.cudnn.graph_strides.io_choices`), one graph
  each.
* **Legacy epilogues as fused graphs.** The legacy epilogues (:data:`convpass.core.fusion.LEGACY`)
  are graphs too, named the same: ``bias`` (conv -> add(bias)), ``bias+relu`` (-> ReLU),
  ``bias+add`` (-> add(z)) and ``bias+add+relu`` (-> add(z) -> ReLU: ``z`` before the ReLU, as
  the legacy fused call adds it). A ``bias + relu`` graph was not offered the fast depthwise
  engine (an order of magnitude slower: docs/measurements/2026-11-23-graph-api-engines.md), so
  such graphs are measured candidates beside the bare engines and their one pass, never
  assumed: the tuner keeps whichever costs less, and where cuDNN offers no configuration of a
  graph it records that as a value (``engine:none+<epilogue>``).
* **Math modes.** Engines are candidates with TF32 allowed (``default``, ``tensor_op``). For
  ``fma`` (TF32 off) none is offered: the frontend's numerical-note filter does not remove the
  tensor-core engines from the list it enumerates (a test measured TF32-sized errors on
  "filtered" configurations), so TF32-off convolutions keep the legacy algorithms, whose math type
  is exact.
* **Names.** A configuration is named as cuDNN names its plans: ``eng<id>`` followed by
  ``_k<knob id>=<value>`` per knob, in knob-id order (``eng67_k2=16_k13=0``). The tuning cache
  records ``engine:<name>`` as the algorithm (:attr:`EngineConfig.algo`), with ``+<fusion>`` for
  a fused graph (``engine:eng5_k2=1+bias+swish``, ``engine:eng12+bias+add+relu``); the annotation writes the name in its
  ``engine`` attribute and the fusion in ``fusion``; :meth:`EngineConfig.parse` reads either back.
  Engine ids are not stable across cuDNN versions; the device fingerprint, which names the cuDNN
  version, keeps a decision from being replayed on another.
* **Stored plans.** A built plan serializes (:meth:`EnginePlan.serialize`: the frontend's own
  form behind a JSON header naming the problem key, the configuration, the tensor uids, the
  strides it reads ``x`` and writes ``y`` with and the cuDNN and frontend versions; :data:`PLAN_FORMAT` for a plan
  reading a packed ``x`` and writing a packed ``y``, :data:`PLAN_FORMAT_SLICE` for one reading or writing a slice's strides, so
  that a reader that knows only packed plans refuses it rather than running it on a packed copy) and loads back in another process in milliseconds
  (:meth:`EnginePlan.load`), against tenths of a second to build one that cuDNN compiles. A stored plan is only loaded by the cuDNN and frontend versions that wrote it, for the
  same key and configuration: anything else raises :class:`GraphApiError`, and the caller builds
  the plan instead. It runs through the frontend's ``execute`` (a loaded graph has no plan list
  to index). :func:`plan_id` names a stored plan in the kernel side-car.
* **Only backend engines.** The frontend's own Python-implemented engines (ids from 20000, CUTLASS
  DSL kernels compiled at plan build) are not candidates: they compile at start-up, which the
  executor must not do.
* **No silent fallback.** :func:`unavailable` says why the package cannot be used (not installed,
  no cuDNN); callers report it. A configuration cuDNN will not build raises :class:`GraphApiError`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import threading
from typing import Any

from convpass.core.algo import ENGINE_PREFIX, Algo
from convpass.core.fusion import is_engine_fusion, takes_residual
from convpass.core.problem import ProblemKey, ResidualSlice
from convpass.native.cudnn.graph_fusions import FUSION_COUNTERS, RESIDUAL_COUNTER, Fusion, fusion_of
from convpass.native.cudnn.graph_strides import ALIGNMENT, io_choices, misaligned
from convpass.native.cudnn.graph_strides import has_strides as _has_strides
from convpass.native.cudnn.graph_strides import overlap as _overlap
from convpass.native.cudnn.graph_strides import z_strides as _z_strides

__all__ = ["ALIGNMENT", "FUSION_COUNTERS", "PLAN_FORMAT", "PLAN_FORMAT_SLICE", "RESIDUAL_COUNTER", "EngineConfig", "Fusion", "fusion_of", "EnginePlan", "Enumerated", "GraphApiError", "InputRefused",
           "OutputRefused", "ResidualRefused", "enumerate_configs", "misaligned", "plan_id", "unavailable"]

PYTHON_ENGINE_ID_BASE = 20000  # the frontend's Python-implemented engines (see the rules)
PLAN_FORMAT = "convpass.engine-plan/1"  # the header of a stored plan reading a packed x and writing a packed y (EnginePlan.serialize)
PLAN_FORMAT_SLICE = "convpass.engine-plan/2"  # ... reading x or writing y with a slice's strides (a reader of /1 only would copy it packed)


_NAME = re.compile(r"eng(\d+)((?:_k\d+=-?\d+)*)")


class GraphApiError(RuntimeError):
    """The graph API cannot do what was asked (package missing, graph or plan refused)."""


class ResidualRefused(GraphApiError):
    """A plan refusing its residual ``z`` alone (misaligned, or not of its strides): a copy of ``z`` may run."""


class InputRefused(GraphApiError):
    """A plan refusing its input ``x`` (misaligned, or not of its strides): a copy of ``x`` may run."""


class OutputRefused(GraphApiError):
    """A plan refusing its output ``y`` (misaligned, or not of its strides): a launch into a buffer of its strides, then a copy, may run."""


@dataclasses.dataclass(frozen=True, order=True)
class EngineConfig:
    """An engine id and its knob values (knob id -> value), as cuDNN numbers them, of the bare
    conv graph or of a fused one (``fusion``: a name :func:`fusion_of` knows)."""

    engine_id: int
    knobs: tuple[tuple[int, int], ...] = ()
    fusion: str = ""

    @property
    def name(self) -> str:
        """cuDNN's plan name (the fusion is not part of it)."""
        return f"eng{self.engine_id}" + "".join(f"_k{k}={v}" for k, v in self.knobs)

    @property
    def algo(self) -> str:
        return str(Algo("engine", self.name, self.fusion))

    @classmethod
    def parse(cls, text: str, fusion: str = "") -> EngineConfig:
        """From ``eng67_k2=16_k13=0`` or ``engine:eng67_k2=16_k13=0`` (``+bias+swish`` or
        ``fusion`` for a fused graph)."""
        bad = f"{text!r} is not a cuDNN engine configuration (expected e.g. 'engine:eng67_k2=16_k13=0')"
        try:
            algo = Algo.parse(text if text.startswith(ENGINE_PREFIX) else ENGINE_PREFIX + text)
        except ValueError:
            raise ValueError(bad) from None
        m = _NAME.fullmatch(algo.name)
        if not m or (algo.fusion and not is_engine_fusion(algo.fusion)):
            raise ValueError(bad)
        if fusion and not is_engine_fusion(fusion):
            fusion_of(fusion)  # raises: names the fusions convpass knows
        if fusion and algo.fusion and fusion != algo.fusion:
            raise ValueError(f"{text!r} names the fusion {algo.fusion!r}, not {fusion!r}")
        knobs = tuple(sorted((int(k), int(v)) for k, v in re.findall(r"_k(\d+)=(-?\d+)", m[2])))
        return cls(int(m[1]), knobs, algo.fusion or fusion)


def _why(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@functools.lru_cache(maxsize=1)
def _frontend() -> Any:
    import cudnn as fe  # nvidia-cudnn-frontend

    fe.backend_version()  # loads libcudnn: fails here, not at the first graph
    return fe


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the graph API cannot be used here, or None when it can (asked once per process: the
    tuner asks per problem, and a failed import is not cached by Python)."""
    try:
        _frontend()
    except ImportError as e:
        return f"the nvidia-cudnn-frontend package is not installed ({e}; pip install convpass[gpu], or convpass[graph])"
    except Exception as e:  # noqa: BLE001  (no libcudnn, wrong CUDA: the package's own error)
        return f"the nvidia-cudnn-frontend package cannot load cuDNN: {type(e).__name__}: {str(e).strip()[:200]}"
    return None


def _require() -> Any:
    why = unavailable()
    if why is not None:
        raise GraphApiError(why)
    return _frontend()


def versions() -> dict[str, str]:
    """The cuDNN library and frontend package versions a stored plan is bound to."""
    fe = _require()
    return {"cudnn": str(fe.backend_version()), "frontend": str(getattr(fe, "__version__", ""))}


def plan_id(key: ProblemKey, config: EngineConfig) -> str:
    """The name of ``config``'s stored plan for ``key`` under this cuDNN and frontend (a hash: the
    kernel side-car keys entries by it)."""
    doc = {"format": PLAN_FORMAT, **versions(), "key": str(key), "algo": config.algo}
    return "plan-" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:27]


_DATA_TYPES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BFLOAT16"}
_handles = threading.local()


def _handle(fe: Any, device: int) -> Any:
    """The frontend's cuDNN handle of this thread on ``device`` (made once)."""
    have = _handles.__dict__.setdefault("by_device", {})
    if device not in have:
        have[device] = fe.create_handle()
    return have[device]


def _current(cp: Any) -> tuple[int, int]:
    return cp.cuda.Device().id, cp.cuda.get_current_stream().ptr


def _graph(fe: Any, key: ProblemKey, handle: Any, fusion: str = "", x_strides: tuple[int, ...] | None = None,
           y_strides: tuple[int, ...] | None = None) -> tuple[Any, dict[str, Any]]:
    """The operation graph ``y = conv(x, w)`` of ``key`` (forward only), or with ``fusion``
    ``y = act(conv(x, w) + b)`` (a legacy epilogue without a ReLU: no activation), ``+ z`` after
    the activation for a graph-API fusion with its residual, before it for a legacy epilogue with
    one (``z``: the output's dims, and its strides or the key's residual slice's); ``x`` read with
    ``x_strides``, ``y`` written with ``y_strides`` (None: packed)."""
    from convpass.native.cudnn.descriptors import descriptor_params

    if key.shape.direction != "fwd":
        raise GraphApiError(f"graph-API engines are tuned for forward convolutions only, not {key.shape.direction}")
    p = descriptor_params(key)
    dt = getattr(fe.data_type, _DATA_TYPES[key.shape.dtype])
    g = fe.pygraph(io_data_type=dt, intermediate_data_type=fe.data_type.FLOAT, compute_data_type=fe.data_type.FLOAT, handle=handle)
    x = g.tensor(name="x", dim=list(p.x.dims), stride=list(x_strides or p.x.strides), data_type=dt)
    w = g.tensor(name="w", dim=list(p.w.dims), stride=list(p.w.strides), data_type=dt)
    y = g.conv_fprop(image=x, weight=w, padding=list(p.pads), stride=list(p.strides), dilation=list(p.dilations),
                     compute_data_type=fe.data_type.FLOAT, name="conv")
    tensors = {"x": x, "w": w}
    if fusion:
        rank = len(p.y.dims)
        k = p.y.dims[1]
        # a [1, K, 1, ...] tensor; its strides are packed whichever way the spatial ones of 1 go
        b = g.tensor(name="b", dim=[1, k] + [1] * (rank - 2), stride=[k, 1] + [k] * (rank - 2), data_type=dt)
        y = g.bias(input=y, bias=b, name="bias")
        f = fusion_of(fusion)
        tensors["b"] = b
        if f.takes_z:
            tensors["z"] = g.tensor(name="z", dim=list(p.y.dims), stride=list(_z_strides(key)), data_type=dt)
        if f.residual_first:
            y = g.add(a=y, b=tensors["z"], name="residual")
        if f.frontend_op:
            y = getattr(g, f.frontend_op)(input=y, **dict(f.frontend_args), name="act")
        if f.residual:
            y = g.add(a=y, b=tensors["z"], name="residual")
    tensors["y"] = y
    y.set_output(True).set_dim(list(p.y.dims)).set_stride(list(y_strides or p.y.strides)).set_data_type(dt)
    g.validate()
    g.build_operation_graph()
    return g, tensors



def _enumerate(fe: Any, g: Any, key: ProblemKey, modes: tuple[str, ...] = ("A", "B", "FALLBACK")) -> list[str]:
    """cuDNN's configurations for ``g`` from heuristic ``modes``, by plan name (list index = plan
    index). Names, not ``get_engine_and_knobs_at_index``: the frontend's Python knob enum maps knob
    ids it does not list (3 and 5 in frontend 1.32) to NOT_SET, which loses them."""
    if key.math == "fma":
        raise GraphApiError(f"no graph-API engines with TF32 off ({key}): only the legacy algorithms run with FMA math")
    g.create_execution_plans([getattr(fe.heur_mode, m) for m in modes])
    return [g.get_plan_name_at_index(i) for i in range(g.get_execution_plan_count())]


@dataclasses.dataclass
class Enumerated:
    """``key``'s operation graph (the bare conv, or ``fusion``'s) with cuDNN's configurations
    enumerated on it: plans of any of them are built on this one graph (:class:`EnginePlan`), so a
    tuner timing all of them enumerates once per key, not once per candidate (which was a third
    of a ResNet-50's tuning time: docs/measurements/2026-11-24-tuning-time.md). For a key with an
    input or output slice, ``packed`` is the same graph over the next strides tried (a packed ``x``
    and / or ``y``: module rules, input and output slices)."""

    key: ProblemKey
    fusion: str
    graph: Any
    tensors: dict[str, Any]
    names: list[str]  # plan name per plan index
    x_strides: tuple[int, ...] = ()  # the element strides its graph reads x with
    packed: Enumerated | None = None
    y_strides: tuple[int, ...] = ()  # the element strides its graph writes y with
    x_refusal: str = ""  # why cuDNN enumerated nothing for the first graph reading the key's input slice ("": it did, or none)
    y_refusal: str = ""  # ... writing the key's output slice

    def graphs(self) -> list[Enumerated]:
        """This graph, then the ones over the next strides tried (``packed``), in order."""
        return [self] if self.packed is None else [self, *self.packed.graphs()]

    def configs(self) -> list[EngineConfig]:
        """The configurations, duplicates once, in cuDNN's order (the slice's graph's first)."""
        found = [EngineConfig.parse(name, self.fusion) for e in self.graphs() for name in e.names]
        return list(dict.fromkeys(c for c in found if c.engine_id < PYTHON_ENGINE_ID_BASE))


def enumerate_configs(key: ProblemKey, fusion: str = "") -> Enumerated:
    """Every backend engine configuration cuDNN offers for ``key``'s graph, the bare conv or the
    ``fusion`` (:func:`fusion_of`; heuristic modes A and B, then the fallback list): for a key
    with an input or output slice, one graph per strides tried, those cuDNN offers any
    configuration of (module rules). None for TF32 off (see the rules)."""
    fe = _require()
    import cupy as cp

    device, _ = _current(cp)
    what = f"{key} + {fusion}" if fusion else str(key)
    found: list[Enumerated] = []
    x_refusal = y_refusal = ""
    for xs, ys in io_choices(key):
        try:
            g, tensors = _graph(fe, key, _handle(fe, device), fusion, xs, ys)
            names = _enumerate(fe, g, key)
        except GraphApiError:
            raise
        except Exception as e:  # noqa: BLE001  (cudnnGraphNotSupportedError and friends: no engine for this graph)
            failed = e
            x_refusal = x_refusal or (_why(e) if xs == key.x_strides else "")  # the slices' graphs are tried first
            y_refusal = y_refusal or (_why(e) if ys == key.y_strides else "")
            continue
        found.append(Enumerated(key, fusion, g, tensors, names, xs, y_strides=ys))
    if not found:
        raise GraphApiError(f"cuDNN's graph API has no engine for {what}: {_why(failed)}") from failed
    for graph, packed in zip(found, found[1:]):
        graph.packed = packed
    found[0].x_refusal = "" if found[0].x_strides == key.x_strides else x_refusal
    found[0].y_refusal = "" if found[0].y_strides == key.y_strides else y_refusal
    return found[0]


class EnginePlan:
    """A built execution plan of one engine configuration for one problem key (its graph: the
    bare conv, or the configuration's fusion; ``x`` read with :attr:`x_strides`).

    Built once (plan-compile time in the executor, once per candidate in the tuner), then
    :meth:`execute` enqueues the conv on CuPy's current stream: no allocation, no
    synchronization, so it can be captured into a CUDA graph.
    """

    x_refusal = ""  # why a plan of a key with an input slice reads a packed x (module rules); "": it reads the slice's strides
    y_refusal = ""  # why a plan of a key with an output slice writes a packed y; "": it writes the slice's strides

    def __init__(self, key: ProblemKey, config: EngineConfig, enumerated: Enumerated | None = None) -> None:
        """``enumerated``: the key's graph with its configurations already enumerated on this
        device (the tuner's), on which the plan is built; else a graph of the plan's own. For a key
        with an input or output slice, the strides tried in order (module rules)."""
        fe = _require()
        import cupy as cp

        self.key = key
        self.config = config
        self._fe = fe
        self._device, _ = _current(cp)
        self._handle = _handle(fe, self._device)
        *sliced, packed = io_choices(key)
        t = None
        for xs, ys in sliced:  # the key's slices, read and written in place where cuDNN builds the plan so
            try:
                t = self._build(xs, ys, enumerated)
            except GraphApiError as e:
                why = str(e).splitlines()[0]
                self.x_refusal = self.x_refusal or (why if xs == key.x_strides else "")
                self.y_refusal = self.y_refusal or (why if ys == key.y_strides else "")
                continue
            self.x_strides, self.y_strides = xs, ys
            break
        if t is None:
            self.x_strides, self.y_strides = packed
            t = self._build(*packed, enumerated)
        if self.x_strides == key.x_strides:
            self.x_refusal = ""
        if self.y_strides == key.y_strides:
            self.y_refusal = ""
        self._uids = (t["x"], t["w"], t["y"])
        self._bias_uid = t.get("b")
        self._residual_uid = t.get("z")
        self.z_strides = _z_strides(key)

    def _build(self, x_strides: tuple[int, ...], y_strides: tuple[int, ...], enumerated: Enumerated | None) -> dict[str, Any]:
        """Build the plan on the key's graph reading ``x`` with ``x_strides`` and writing ``y`` with
        ``y_strides`` (``enumerated``'s where it is the key's, else a graph of its own); the graph's tensors."""
        fe, key, config = self._fe, self.key, self.config
        fusion = config.fusion
        what = f"{config.name} ({fusion})" if fusion else config.name
        try:
            if enumerated is not None and (enumerated.key, enumerated.fusion) == (key, fusion):
                mine = next((e for e in enumerated.graphs() if (e.x_strides, e.y_strides) == (x_strides, y_strides)), None)
                if mine is None:
                    why = dict.fromkeys(r for r, mine in ((enumerated.x_refusal, x_strides == key.x_strides),
                                                          (enumerated.y_refusal, y_strides == key.y_strides)) if r and mine)
                    raise GraphApiError(f"cuDNN offers no configuration of {key} reading x with the element strides {x_strides} "
                                        f"and writing y with {y_strides}" + "".join(f": {r}" for r in why))
                self._graph, t, names = mine.graph, mine.tensors, mine.names
            else:
                self._graph, t = _graph(fe, key, self._handle, fusion, x_strides, y_strides)
                # The configuration is found again among cuDNN's own for this graph, by name:
                # rebuilding it from (engine id, knobs) through the frontend's knob enum gave
                # configurations that cuDNN refused to finalize (the frontend's enum is not cuDNN's
                # knob numbering). Mode A alone first (the instant heuristic: start-up
                # time), the full list when needed.
                try:
                    names = _enumerate(fe, self._graph, key, ("A",))
                except GraphApiError:
                    raise
                except Exception:  # noqa: BLE001  (mode A offers nothing for this graph: the full list below)
                    names = []
                if config.name not in names:
                    self._graph, t = _graph(fe, key, self._handle, fusion, x_strides, y_strides)
                    names = _enumerate(fe, self._graph, key)
            if config.name not in names:
                raise GraphApiError(f"cuDNN does not offer {what} for {key} here")
            self._index = names.index(config.name)
            self._graph.build_plan_at_index(self._index)
            self.workspace_bytes = int(self._graph.get_workspace_size_plan_at_index(self._index))
        except Exception as e:  # noqa: BLE001
            raise GraphApiError(f"cuDNN does not build {what} for {key}: {_why(e)}") from e
        return t

    def serialize(self, verify: bool = True) -> bytes:
        """The built plan as bytes :meth:`load` reads back (module rules). ``verify``: load it here
        and require the loaded plan to compute bit for bit what this one does on random inputs
        (the frontend stores its current candidate plan: this proves it is the one built)."""
        if self._index is None:
            raise GraphApiError(f"{self.config.algo} was loaded, not built: store the bytes it was loaded from")
        try:
            blob = bytes(self._graph.serialize())
        except Exception as e:  # noqa: BLE001
            raise GraphApiError(f"cuDNN does not serialize {self.config.algo} for {self.key}: {_why(e)}") from e
        extra = [t for t in (self._bias_uid, self._residual_uid) if t is not None]  # the bias, then the residual
        uids = [int(t.get_uid()) for t in (*self._uids, *extra)]
        packed = (self.x_strides, self.y_strides) == io_choices(self.key)[-1]
        header = {"format": PLAN_FORMAT if packed else PLAN_FORMAT_SLICE, **versions(), "key": str(self.key), "algo": self.config.algo, "uids": uids,
                  "workspace": self.workspace_bytes, "x_strides": list(self.x_strides), "y_strides": list(self.y_strides)}
        data = json.dumps(header, sort_keys=True).encode() + b"\n" + blob
        if verify:
            _same_results(self, EnginePlan.load(self.key, self.config, data))
        return data

    @classmethod
    def load(cls, key: ProblemKey, config: EngineConfig, data: bytes) -> EnginePlan:
        """A plan from :meth:`serialize`'s bytes, for exactly ``key`` and ``config`` under the
        cuDNN and frontend versions that wrote it (else :class:`GraphApiError`, nothing loaded)."""
        fe = _require()
        import cupy as cp

        head, sep, blob = bytes(data).partition(b"\n")
        try:
            header = json.loads(head) if sep else None
        except ValueError:
            header = None
        if not isinstance(header, dict) or header.get("format") not in (PLAN_FORMAT, PLAN_FORMAT_SLICE):
            raise GraphApiError(f"not a stored cuDNN plan of convpass ({PLAN_FORMAT} or {PLAN_FORMAT_SLICE})")
        here = {**versions(), "key": str(key), "algo": config.algo}
        for field, want in here.items():
            if header.get(field) != want:
                raise GraphApiError(f"the stored plan is for {field} {header.get(field)!r}, not {want!r}")
        packed = [list(s) for s in io_choices(key)[-1]]  # a plan stored without them reads a packed x, writes a packed y
        strides = [header.get(f"{t}_strides", packed[i]) for i, t in enumerate("xy")]
        if (strides == packed) != (header["format"] == PLAN_FORMAT):
            raise GraphApiError(f"the stored plan's format {header['format']} does not fit the element strides it reads x with, "
                                f"{strides[0]!r}, and writes y with, {strides[1]!r}")
        if strides not in [[list(x), list(y)] for x, y in io_choices(key)]:
            raise GraphApiError(f"the stored plan reads x with the element strides {strides[0]!r} and writes y with {strides[1]!r}, "
                                f"neither packed nor the key's slices'")
        self = cls.__new__(cls)
        self.key, self.config, self._fe = key, config, fe
        self.x_strides, self.y_strides, self.z_strides = tuple(strides[0]), tuple(strides[1]), _z_strides(key)
        self._device, _ = _current(cp)
        self._handle = _handle(fe, self._device)
        try:
            # the handle's stream may be one that is gone (an earlier executor's): cuDNN asks it
            # whether it is capturing while it loads the plan
            fe.set_stream(self._handle, cp.cuda.get_current_stream().ptr)
            self._graph = fe.pygraph(handle=self._handle)
            self._graph.deserialize(self._handle, blob)
        except Exception as e:  # noqa: BLE001
            raise GraphApiError(f"cuDNN does not load the stored plan {config.algo} for {key}: {_why(e)}") from e
        self._index = None
        uids = [int(u) for u in header["uids"]]
        self._uids, self._bias_uid = tuple(uids[:3]), (uids[3] if len(uids) > 3 else None)
        self._residual_uid = uids[4] if len(uids) > 4 else None
        if (self._bias_uid is not None) != bool(config.fusion):
            raise GraphApiError(f"the stored plan of {config.algo} has {'a' if self._bias_uid is not None else 'no'} bias tensor")
        if (self._residual_uid is not None) != takes_residual(config.fusion):
            raise GraphApiError(f"the stored plan of {config.algo} has {'a' if self._residual_uid is not None else 'no'} residual tensor")
        self.workspace_bytes = int(header["workspace"])
        return self

    def execute(self, x: Any, w: Any, y: Any, workspace: Any = None, bias: Any = None, z: Any = None) -> None:
        """``y = conv(x, w)`` on the current CuPy stream (arrays in the key's memory format, ``x`` of
        :attr:`x_strides`: packed or the key's input slice's; ``y``, for a key with an output slice,
        of :attr:`y_strides`: packed or that slice's); for a fused configuration ``y =
        act(conv(x, w) + bias)`` (``bias``: K contiguous values), ``+ z`` for one with its residual
        (``z``: of :attr:`z_strides`, ``y``'s or the key's slice's, apart from ``y``)."""
        import cupy as cp

        if not _has_strides(x, self.x_strides):
            raise InputRefused(f"{self.config.algo}: the input x is not of the element strides its plan reads, {self.x_strides}")
        if self.key.y_slice is not None and not _has_strides(y, self.y_strides):
            raise OutputRefused(f"{self.config.algo}: the output y is not of the element strides its plan writes, {self.y_strides}")
        if (self._bias_uid is None) != (bias is None):
            raise GraphApiError(f"{self.config.algo} takes {'a' if self._bias_uid is not None else 'no'} bias")
        if (self._residual_uid is None) != (z is None):
            raise GraphApiError(f"{self.config.algo} takes {'a' if self._residual_uid is not None else 'no'} residual z")
        if z is not None and _overlap(z, y):
            raise GraphApiError(f"{self.config.algo}: the residual z shares memory with the output y (it must not alias it)")
        if z is not None and not _has_strides(z, self.z_strides):
            raise ResidualRefused(f"{self.config.algo}: the residual z is not of the element strides its plan reads, {self.z_strides}")
        self._fe.set_stream(self._handle, cp.cuda.get_current_stream().ptr)
        pack = dict(zip(self._uids, (x.data.ptr, w.data.ptr, y.data.ptr)))
        if bias is not None:
            pack[self._bias_uid] = bias.data.ptr
        if z is not None:
            pack[self._residual_uid] = z.data.ptr
        ws = 0 if workspace is None or getattr(workspace, "nbytes", 0) == 0 else workspace.data.ptr
        try:
            if self._index is None:  # loaded: the graph holds this one plan
                self._graph.execute(pack, ws, handle=self._handle)
            else:
                self._graph.execute_plan_at_index(pack, ws, index=self._index, handle=self._handle)
        except Exception as e:  # noqa: BLE001
            raise GraphApiError(f"{self.config.algo} failed to execute for {self.key}: {_why(e)}") from e



def _same_results(built: EnginePlan, loaded: EnginePlan) -> None:
    """Run both plans on the same random inputs; :class:`GraphApiError` unless bit for bit equal."""
    import cupy as cp

    from convpass.native.cudnn.arrays import empty_like_layout

    shape, layout = built.key.shape, built.key.layout

    def values(dims: tuple[int, ...], phase: float) -> Any:  # cheap, deterministic, varied in sign and size
        a = empty_like_layout(dims, shape.dtype, layout)
        a[...] = cp.sin(cp.arange(a.size, dtype=cp.float32) * 0.7 + phase).reshape(dims)
        return a

    # a plan reading an input slice reads x with its strides: the first channels of a buffer as wide (an aligned start)
    x_channels = built.key.x_slice.channels if built.x_strides == built.key.x_strides and built.key.x_slice is not None else shape.c
    x, w = values((shape.n, x_channels, *shape.spatial), 0.0)[:, :shape.c], values(shape.w_shape, 1.0)
    bias = cp.sin(cp.arange(shape.k, dtype=cp.float32) + 2.0).astype(shape.dtype) if built.config.fusion else None
    # a plan of a residual slice reads z with its strides: the first channels of a buffer as wide (an aligned start, whatever the key's first)
    s = built.key.z_slice or ResidualSlice(0, shape.k)
    z = values((shape.n, s.channels, *shape.output_spatial), 3.0)[:, :shape.k] if takes_residual(built.config.fusion) else None
    ws = cp.empty(max(built.workspace_bytes, loaded.workspace_bytes, 1), dtype=cp.uint8)
    # a plan writing an output slice writes y with its strides: the first channels of a buffer as wide
    y_channels = built.key.y_slice.channels if built.y_strides == built.key.y_strides and built.key.y_slice is not None else shape.k
    outs = []
    for plan in (built, loaded):
        y = empty_like_layout((shape.n, y_channels, *shape.output_spatial), shape.dtype, layout)[:, :shape.k]
        y.fill(0)
        plan.execute(x, w, y, ws, bias=bias, z=z)
        outs.append(y)
    cp.cuda.get_current_stream().synchronize()
    if not bool(cp.array_equal(outs[0], outs[1], equal_nan=True)):
        raise GraphApiError(f"the stored plan of {built.config.algo} does not compute what the built one does for {built.key}")

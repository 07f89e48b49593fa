"""Conv epilogues: what runs after a convolution inside its executor step, and their names.

The executor runs a forward Conv that has a constant bias as one step ``y = act(conv(x, w) + z + b)``:
the bias, a residual ``Add`` whose other operand ``z`` is ready before the conv, and a ``Relu``
that is the only reader (a Conv without a bias: the residual ``Add`` and its ``Relu``, ``b = 0``);
or, fused into a graph-API engine, ``y = act(conv(x, w) + b) + z``: an
activation (SiLU, LeakyRelu) and the residual ``Add`` that is its only reader. :func:`absorbed` is that rule, asked by the compiler (which tunes the
step: :mod:`convpass.compiler.passes.collect_conv_problems`) and by the runtime (which runs it:
:func:`convpass.kernels.convolution.lower_convs`) over their own graphs. The tuner must time the
step, not the bare conv: for some shapes the same algorithm ran several times slower through
cuDNN's fused bias + activation call than its bare conv was timed at (another kernel, or an old
non-tensor-core one; docs/measurements/2026-11-23-conv-epilogues.md).

Names
-----
An epilogue is named by what follows the conv, in order:

===================  ===========================================
``bias``             ``y = conv + b``
``bias+relu``        ``y = relu(conv + b)``
``bias+add``         ``y = conv + z + b`` (the residual Add; ``b = 0`` for a conv without a bias)
``bias+add+relu``    ``y = relu(conv + z + b)``
===================  ===========================================

These are the :data:`LEGACY` epilogues: cuDNN's legacy ``cudnnConvolutionBiasActivationForward``
runs each in one call (identity or ReLU activation, ``z`` through ``alpha2``), and a graph-API
engine runs each as the fused graph of the same name (conv -> add(bias) [-> add(z)] [-> relu]: the
residual before the ReLU, ResNet's order). The graph API's fused graphs of an activation
(:func:`convpass.native.cudnn.graph_api.fusion_of`) use the same naming:

=========================  ===========================================================
``bias+swish``             ``y = silu(conv + b)`` (ONNX: ``Mul(y, Sigmoid(y))``)
``bias+leakyrelu<alpha>``  ``y = leaky_relu(conv + b, alpha)`` (ONNX: ``LeakyRelu``), e.g.
                           ``bias+leakyrelu0.2``
=========================  ===========================================================

A graph-API fusion may also take a residual ``Add`` that follows its activation (CSPDarknet's and
YOLO's residual blocks: ``x + act(conv(x') + b)``), the order the legacy epilogues do not run (they
add ``z`` before their ReLU): its name is the activation's followed by :data:`RESIDUAL`:

=============================  ===============================================================
``bias+swish+add``             ``y = silu(conv + b) + z``
``bias+leakyrelu<alpha>+add``  ``y = leaky_relu(conv + b, alpha) + z``, e.g. ``bias+leakyrelu0.01+add``
=============================  ===============================================================

:func:`residual_fusion` writes such a name, :func:`without_residual` reads back the activation's
(its *shorter* graph), :func:`adds_residual` tells one apart. A ReLU followed by an Add
(``relu(conv + b) + z``) has no such form: the ReLU's fused graphs are the legacy epilogues', which
add ``z`` before it (:func:`takes_residual` tells of either order).

A conv without a bias
~~~~~~~~~~~~~~~~~~~~~
A forward Conv with no bias input (BiT's weight-standardized convs) whose output only a residual
``Add`` reads (pre-activation ResNets: ``conv3(...) + shortcut``) absorbs that Add, and a ``Relu``
after it, exactly where a conv with a bias would (:func:`absorbed`, rules 2 and 4): its step is ``bias+add`` / ``bias+add+relu`` with ``b = 0``, so ``y = conv + z`` /
``relu(conv + z)``. The name stays the legacy one on purpose: cuDNN's fused call needs a bias
tensor, and every candidate of the step (the fused call, the conv and one pass, convpass's kernel
with its epilogue, an engine and one pass) reads one, so the step is the same problem as the
biased conv's (one tuning-cache row, one decision) and the tuner times it with a bias of its own;
no kernel's time depends on the bias's values. The executor passes a zero bias made once per
channel count and dtype at plan compile time
(:meth:`convpass.kernels.conv_resources.ConvResources.zero_bias`), never per launch. Such a conv
absorbs nothing else (no ``bias+relu`` of its own, no graph-API fusion: those need a bias
constant). A model tuned before this rule recorded such a conv with no ``fusion``: the executor
runs its conv, then the zero bias and the residual as one pass (a legacy decision without a fused
call), and an older executor given a newer model runs the conv and leaves the Add to its plan.

A LeakyRelu's ``alpha`` is part of its name (:func:`leakyrelu_name`), written as the shortest
decimal that reads back to the same float32 (ONNX stores ``alpha`` as a float32): the name is the
one string that travels through the problem (``ConvProblem.fusion``), the tuning cache (the
algorithm ``engine:eng5+bias+leakyrelu0.2`` and the epilogue-pass row ``bias+leakyrelu0.2``) and
the annotation (the ``fusion`` attribute), so alpha 0.2 and 0.1 are distinct problems, cache rows
and engine graphs with no new field, column or schema version anywhere; one spelling per alpha
(``bias+leakyrelu0.20`` is no name) keeps one cache row per alpha. Older names and annotations
read unchanged.

Rules
-----
* **Two ways to run a legacy epilogue, both timed.** (a) the conv, then one element-wise pass
  over its output (the ``epilogue`` row of the tuning cache: :data:`convpass.tuning.decide.EPILOGUE_METHOD`);
  (b) the fused call, per legacy algorithm (a row whose algorithm is ``<algo>+<epilogue>``,
  :class:`convpass.core.algo.Algo` with its ``fusion``). The tuner times (b) for the :data:`FUSED_CALL_CANDIDATES` fastest legacy
  algorithms of each key only: the fused call reuses the algorithm's kernels or falls back to
  slower ones, and it never ran faster than the bare conv in the profiles measured
  (docs/measurements/2026-11-23-conv-epilogues.md).
* **Activation, then the residual: timed both ways.** A conv whose step absorbs ``<act>+add`` is a
  problem of that fusion; the tuner times its fused graph, the shorter graph ``<act>`` (the Add then
  runs as its own pass: the ``add`` row, :data:`RESIDUAL_PASS`) and the unfused configurations (the
  activation and the Add as one pass after them: the ``<act>+add`` row), and keeps the cheapest
  (:mod:`convpass.tuning.decide`). A decision of the shorter graph runs its activation fused and
  leaves the Add to the plan.
* **A legacy epilogue in an engine's call, timed too.** Where graph-API engines are candidates, a
  conv whose step absorbs a legacy epilogue is also timed as every engine configuration of that
  epilogue's fused graph (the algorithm ``engine:<config>+<epilogue>``, :func:`is_engine_fusion`),
  against the bare engines with the epilogue as one pass after them; where cuDNN offers no
  configuration of the graph that is a row saying so (``engine:none+<epilogue>``), and the bare
  engine and its pass stay candidates.
* **Recorded.** A decision whose ``fusion`` names a legacy epilogue and that has no graph-API
  engine runs the fused call (annotation schema 5); a legacy decision without one runs (a). A
  decision with an ``engine`` runs that configuration's graph: with a ``fusion`` (a legacy
  epilogue or an activation's), the epilogue inside the engine's call; without one, the bare
  conv and the epilogue as one pass after it. A model tuned before schema 5 recorded no fused
  call: its convs run as they were timed, (a); no model recorded an engine beside a legacy
  epilogue before the tuner timed those graphs, so every earlier decision reads as it did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = [
    "FUSED_CALL_CANDIDATES", "LEAKYRELU", "LEGACY", "RESIDUAL", "RESIDUAL_PASS", "SWISH", "Absorbed", "StepGraph", "absorbed",
    "adds_residual", "is_engine_fusion", "is_graph_fusion", "is_legacy", "leakyrelu_alpha", "leakyrelu_name", "legacy_name", "parts",
    "residual_fusion", "takes_residual", "without_residual",
]

LEGACY: tuple[str, ...] = ("bias", "bias+relu", "bias+add", "bias+add+relu")
FUSED_CALL_CANDIDATES = 2  # legacy algorithms per key whose fused call the tuner times
SWISH = "bias+swish"  # the graph-API fusion of a SiLU
LEAKYRELU = "bias+leakyrelu"  # the graph-API fusion of a LeakyRelu: its alpha follows (leakyrelu_name)
ONNX_LEAKYRELU_ALPHA = 0.01  # ONNX's default alpha
RESIDUAL = "+add"  # what a graph-API fusion's name ends with when its residual Add follows the activation
RESIDUAL_PASS = "add"  # the epilogue-pass row of that Add run as its own pass (after the shorter graph)


def legacy_name(residual: bool, relu: bool) -> str:
    """The legacy epilogue of a conv with a bias, a residual Add or not and a ReLU or not."""
    return "bias" + ("+add" if residual else "") + ("+relu" if relu else "")


def is_legacy(name: str | None) -> bool:
    """Whether ``name`` is an epilogue cuDNN's legacy fused call runs."""
    return name in LEGACY


def leakyrelu_name(alpha: float) -> str:
    """The fusion of a LeakyRelu of ``alpha``: ``bias+leakyrelu`` and alpha as the shortest decimal
    that reads back to the same float32 (``0.2`` -> ``bias+leakyrelu0.2``). ValueError for an
    alpha that is not finite (no engine computes it, and no name could read back)."""
    a = np.float32(alpha)
    if not np.isfinite(a):
        raise ValueError(f"LeakyRelu alpha {alpha!r} is not finite")
    text = np.format_float_positional(a, trim="-")
    return LEAKYRELU + ("0" if text == "-0" else text)


def leakyrelu_alpha(name: str | None) -> float | None:
    """The alpha a ``bias+leakyrelu<alpha>`` fusion names, or None when ``name`` is no such name
    (another epilogue, or an alpha not written as :func:`leakyrelu_name` writes it)."""
    if not name or not name.startswith(LEAKYRELU):
        return None
    try:
        alpha = float(name[len(LEAKYRELU):])
        return alpha if leakyrelu_name(alpha) == name else None
    except ValueError:
        return None


def _is_activation(name: str | None) -> bool:
    """Whether ``name`` is a graph-API fusion of an activation alone (``bias+swish``, ``bias+leakyrelu<alpha>``)."""
    return name == SWISH or leakyrelu_alpha(name) is not None


def adds_residual(name: str | None) -> bool:
    """Whether ``name`` is a graph-API fusion whose residual Add follows its activation (``...+add``)."""
    return name is not None and name.endswith(RESIDUAL) and _is_activation(name[: -len(RESIDUAL)])


def is_graph_fusion(name: str | None) -> bool:
    """Whether ``name`` is an epilogue fused into a graph-API engine's graph (the tables above)."""
    return _is_activation(name) or adds_residual(name)


def is_engine_fusion(name: str | None) -> bool:
    """Whether ``name`` is a fused graph a graph-API engine configuration may run: an activation's
    (:func:`is_graph_fusion`) or a legacy epilogue's (:data:`LEGACY`)."""
    return is_graph_fusion(name) or is_legacy(name)


def takes_residual(name: str | None) -> bool:
    """Whether the epilogue ``name`` reads a residual ``z``: a legacy one with its Add (before its
    ReLU) or a graph-API fusion's ``+add`` (after its activation)."""
    return adds_residual(name) or (is_legacy(name) and "+add" in str(name))


def residual_fusion(name: str) -> str:
    """The fusion of ``name``'s activation followed by a residual Add (``bias+swish`` ->
    ``bias+swish+add``); ValueError for a name that is no activation's graph-API fusion."""
    if not _is_activation(name):
        raise ValueError(f"{name!r} is no graph-API activation fusion to add a residual to")
    return name + RESIDUAL


def without_residual(name: str) -> str:
    """The shorter graph of a fusion with a residual (``bias+swish+add`` -> ``bias+swish``); any
    other name unchanged."""
    return name[: -len(RESIDUAL)] if adds_residual(name) else name


def parts(name: str) -> tuple[bool, bool]:
    """``(residual, relu)`` of a legacy epilogue; ValueError for any other name."""
    if name not in LEGACY:
        raise ValueError(f"{name!r} is not a legacy conv epilogue ({', '.join(LEGACY)})")
    return "+add" in name, name.endswith("+relu")


# ---------------------------------------------------------------------------------------------
# what a conv's step absorbs: the one rule the compiler (which tunes the step) and the runtime
# (which runs it) both ask


class StepGraph(Protocol):
    """The little a graph must answer for :func:`absorbed`: the compiler answers it over onnx-ir
    (nodes and values), the runtime over its plan (step indices and slots)."""

    def op(self, node: Any) -> str:
        """The node's op type in the standard domain, ``""`` for any other domain."""

    def inputs(self, node: Any) -> Sequence[Any]:
        """The node's inputs in order (None for an omitted one)."""

    def outputs(self, node: Any) -> Sequence[Any]:
        """The node's outputs in order."""

    def readers(self, value: Any) -> Sequence[Any]:
        """The nodes that read ``value``, one entry per use."""

    def is_output(self, value: Any) -> bool:
        """Whether ``value`` is a graph output."""

    def is_constant(self, value: Any) -> bool:
        """Whether ``value`` is an initializer or a constant."""

    def same_shape_and_type(self, a: Any, b: Any) -> bool:
        """Whether two values have one concrete shape and one element type."""

    def ready_before(self, value: Any, node: Any) -> bool:
        """Whether ``value`` exists before ``node`` runs (graph input, constant, earlier node)."""

    def free(self, node: Any) -> bool:
        """Whether ``node`` may still be absorbed (no earlier conv's step took it)."""

    def attribute(self, node: Any, name: str, default: Any) -> Any:
        """The node's attribute ``name`` (its value; ``default`` when the node has none)."""


@dataclasses.dataclass(frozen=True)
class Absorbed:
    """What one conv's step computes beyond the conv: ``epilogue`` (a name of the tables above,
    ``""``: nothing), the ``nodes`` it takes over, the residual operand ``z`` (``bias+add...``,
    ``...+add``), and the value the step writes (the last absorbed node's output, else the
    conv's). ``shorter``: for a graph-API fusion with its residual, the same step without the Add
    (what runs where the decision is the shorter graph)."""

    epilogue: str
    nodes: tuple[Any, ...] = ()
    z: Any = None
    output: Any = None
    shorter: Absorbed | None = None


def absorbed(g: StepGraph, conv: Any, *, residual: bool = True, graph_fusions: bool = True) -> Absorbed:
    """What the step of ``conv`` absorbs (the rules, in order):

    1. A ConvTranspose absorbs a ``Relu`` that is its only reader (``relu``: its bias is always
       its own pass after cuDNN's backward data, which the Relu joins).
    2. A Conv absorbs nothing unless its output is no graph output and its bias is a constant;
       a Conv with no bias input at all absorbs rule 4 alone (a residual Add and its Relu, named
       as with a bias: the module's "A conv without a bias"), else nothing.
    3. The graph-API fusions, when ``graph_fusions`` (their engines are candidates):
       ``bias+swish`` when the output is read only by ``Mul(y, Sigmoid(y))``, the Sigmoid by
       nothing else; ``bias+leakyrelu<alpha>`` when its only reader is a one-input
       ``LeakyRelu`` (its ``alpha``, ONNX's 0.01 when it has none, in the name); a Concat reading
       the activation's output is no bar (the engine writes its slice: rule 4 of
       :mod:`convpass.core.concat_slices`). Then, when
       ``residual``, the activation's ``+add`` (:func:`residual_fusion`) when the activation's
       output is no graph output and its only reader is a residual Add (:func:`_residual_add`)
       whose output no Concat reads; the step then writes the Add's output (a graph output, or
       read by several nodes, alike), and its ``shorter`` form is the activation's.
    4. ``bias+add`` / ``bias+add+relu`` (when ``residual``): the only reader is a residual Add
       (:func:`_residual_add`); then a ``Relu`` that is the Add's only reader joins.
    5. ``bias+relu``: the only reader is a one-input ``Relu``.
    6. Otherwise ``bias``.
    """
    ys = g.outputs(conv)
    y = ys[0] if ys else None
    op = g.op(conv)
    if op == "ConvTranspose":
        relu = _only_reader(g, y, "Relu") if y is not None else None
        return Absorbed("relu", (relu,), output=g.outputs(relu)[0]) if relu is not None else Absorbed("", output=y)
    ins = g.inputs(conv)
    if op != "Conv" or y is None or g.is_output(y):
        return Absorbed("", output=y)
    if len(ins) < 3 or ins[2] is None:  # no bias: rule 4 alone, run with a zero bias
        found = _residual_add(g, conv, y, y) if residual else None
        return _legacy_residual(g, *found) if found is not None else Absorbed("", output=y)
    if not g.is_constant(ins[2]):
        return Absorbed("", output=y)
    activation = _graph_activation(g, y) if graph_fusions else None
    if activation is not None:
        found = _residual_add(g, conv, y, activation.output) if residual else None
        if found is not None and not _read_by_concat(g, g.outputs(found[0])[0]):
            add, z = found
            return Absorbed(residual_fusion(activation.epilogue), (*activation.nodes, add), z, g.outputs(add)[0], activation)
        return activation
    found = _residual_add(g, conv, y, y) if residual else None
    if found is not None:
        return _legacy_residual(g, *found)
    relu = _only_reader(g, y, "Relu")
    if relu is not None:
        return Absorbed(legacy_name(False, True), (relu,), output=g.outputs(relu)[0])
    return Absorbed(legacy_name(False, False), output=y)


def _legacy_residual(g: StepGraph, add: Any, z: Any) -> Absorbed:
    """Rule 4: ``bias+add`` through the residual ``add``, ``bias+add+relu`` where a ``Relu`` is the Add's only reader."""
    out = g.outputs(add)[0]
    relu = None if g.is_output(out) else _only_reader(g, out, "Relu")
    if relu is not None:
        return Absorbed(legacy_name(True, True), (add, relu), z, g.outputs(relu)[0])
    return Absorbed(legacy_name(True, False), (add,), z, out)


def _graph_activation(g: StepGraph, y: Any) -> Absorbed | None:
    """Rule 3's activation of the conv output ``y``, absorbed without a residual; None when there is none."""
    pair = _swish_readers(g, y)
    if pair is not None:
        return Absorbed(SWISH, pair, output=g.outputs(pair[1])[0])
    leaky = _only_reader(g, y, "LeakyRelu")
    if leaky is not None:
        alpha = float(g.attribute(leaky, "alpha", ONNX_LEAKYRELU_ALPHA))
        if np.isfinite(np.float32(alpha)):
            return Absorbed(leakyrelu_name(alpha), (leaky,), output=g.outputs(leaky)[0])
    return None


def _residual_add(g: StepGraph, conv: Any, y: Any, value: Any) -> tuple[Any, Any] | None:
    """``(Add, z)`` when the only reader of ``value`` (the conv output ``y``, or the output of the
    activation the step absorbs) is a free two-input ``Add`` whose other operand ``z`` is a
    residual the step can read: not ``value`` itself, of ``y``'s exact shape and type (no
    broadcasting) and ready before the conv runs (so absorbing the Add creates no cycle)."""
    add = _only_reader(g, value, "Add", inputs=2)
    if add is None:
        return None
    a, b = g.inputs(add)
    z = b if a == value else a
    if a == b or z is None or not g.same_shape_and_type(z, y) or not g.ready_before(z, conv):
        return None
    return add, z


def _read_by_concat(g: StepGraph, value: Any) -> bool:
    """Whether a Concat reads ``value``. A step whose residual Add a Concat reads is not fused: the
    Add's own pass writes its slice of the buffer directly, where the fused step would write a
    packed output the plan copies into it (rule 4 of :mod:`convpass.core.concat_slices`)."""
    return any(g.op(r) == "Concat" for r in g.readers(value))


def _only_reader(g: StepGraph, value: Any, op_type: str, inputs: int = 1) -> Any:
    """The one node reading ``value``, when it is a free ``op_type`` node with ``inputs`` inputs."""
    readers = g.readers(value)
    if len(readers) != 1 or g.is_output(value):
        return None
    node = readers[0]
    ok = g.op(node) == op_type and len(g.inputs(node)) == inputs and g.free(node) and bool(g.outputs(node))
    return node if ok else None


def _swish_readers(g: StepGraph, y: Any) -> tuple[Any, Any] | None:
    """``(Sigmoid, Mul)`` when ``y`` is read only by ``Mul(y, Sigmoid(y))``, the Sigmoid by nothing else."""
    readers = list(g.readers(y))
    if len(readers) != 2:
        return None
    sigmoid = next((n for n in readers if g.op(n) == "Sigmoid"), None)
    mul = next((n for n in readers if g.op(n) == "Mul"), None)
    if sigmoid is None or mul is None or not (g.free(sigmoid) and g.free(mul)) or not g.outputs(sigmoid) or not g.outputs(mul):
        return None
    s = g.outputs(sigmoid)[0]
    if g.is_output(s) or list(g.readers(s)) != [mul] or set(g.inputs(mul)) != {y, s} or len(g.inputs(mul)) != 2:
        return None
    return sigmoid, mul

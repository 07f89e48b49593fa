"""The fused epilogues of cuDNN graph-API operation graphs (:mod:`convpass.native.cudnn.graph_api`):
per name (:mod:`convpass.core.fusion`), the frontend op of its activation and its arguments, the
activation over an array module (the tuner's reference and the executor's fallback), its CUDA C
form (the tuner times it as its own pass) and the executor's counter of launches that ran it fused.
``graph_api`` re-exports every name here."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from convpass.core.fusion import LEAKYRELU, LEGACY, SWISH, adds_residual, is_legacy, leakyrelu_alpha, leakyrelu_name, parts, without_residual

__all__ = ["FUSION_COUNTERS", "RESIDUAL_COUNTER", "Fusion", "fusion_of"]


@dataclasses.dataclass(frozen=True)
class Fusion:
    """A fused epilogue: what follows the conv in the graph, the frontend op of its activation
    (called with ``frontend_args``; ``""``: none, the bias alone), and the activation itself over
    an array module (NumPy or CuPy: the tuner's reference and the executor's fallback);
    ``residual``: a residual Add follows the activation; ``residual_first``: one comes before it
    (a legacy epilogue's ``+add``; :meth:`reference`)."""

    name: str
    frontend_op: str
    apply: Callable[[Any, Any], Any]  # (xp, float array) -> the activation of it, same dtype
    cuda: str  # the activation of a float ``v`` in CUDA C (the tuner times it as its own pass)
    frontend_args: tuple[tuple[str, float], ...] = ()
    counter: str = ""  # the executor's counter of launches that ran it fused (one per kind, any alpha)
    residual: bool = False
    residual_first: bool = False

    @property
    def takes_z(self) -> bool:
        """Whether the graph reads a residual ``z``."""
        return self.residual or self.residual_first

    def reference(self, xp: Any, pre: Any, z: Any = None) -> Any:
        """The fused epilogue over ``pre = conv + b``: ``act(pre)``, then ``+ z`` where the fusion
        adds a residual after its activation, ``act(pre + z)`` where before it (``z`` of ``pre``'s
        shape; ValueError without it). A new array."""
        if self.takes_z and z is None:
            raise ValueError(f"the fused epilogue {self.name} needs its residual z")
        if self.residual_first:
            return self.apply(xp, pre + z)
        out = self.apply(xp, pre)
        return out + z if self.residual else out


def _leaky_relu(name: str, alpha: float) -> Fusion:
    """``bias+leakyrelu<alpha>``: cuDNN's pointwise ``CUDNN_POINTWISE_RELU_FWD`` (100) with
    ``CUDNN_ATTR_POINTWISE_RELU_LOWER_CLIP_SLOPE`` (5) = alpha, as the frontend's ``leaky_relu``
    sets it from its ``negative_slope`` (lower clip 0, no upper clip): ``y if y > 0 else alpha *
    y``, ONNX's LeakyRelu (equal at 0)."""
    a32 = float(np.float32(alpha))
    lit = f"{a32!r}f"  # a float literal that is exactly the float32 alpha

    def apply(xp: Any, v: Any) -> Any:
        return xp.where(v > 0, v, v * v.dtype.type(a32))

    return Fusion(name, "leaky_relu", apply, f"(v > 0.0f ? v : {lit} * v)", (("negative_slope", a32),), "fused_bias_leakyrelu")


def _legacy(name: str) -> Fusion:
    """A legacy epilogue's graph (module rules): the bias, ``z`` where it adds one, then
    ``CUDNN_POINTWISE_RELU_FWD`` (the frontend's ``relu``, no clip slope: ``max(v, 0)``) where it
    ends with one; counted as ``fused_`` and its name's parts (``fused_bias_add_relu``)."""
    residual, relu = parts(name)
    counter = "fused_" + name.replace("+", "_")
    if relu:
        return Fusion(name, "relu", lambda xp, a: xp.maximum(a, a.dtype.type(0)), "fmaxf(v, 0.0f)", counter=counter, residual_first=residual)
    return Fusion(name, "", lambda xp, a: a.copy(), "v", counter=counter, residual_first=residual)


_SWISH = Fusion(SWISH, "swish", lambda xp, a: a / (a.dtype.type(1) + xp.exp(-a)), "v / (1.0f + expf(-v))", counter="fused_bias_swish")
RESIDUAL_COUNTER = "_add"  # a fusion with its residual counts under its activation's counter + this
# every Fusion.counter: the activations' (any alpha), with their residual, and the legacy epilogues' graphs
FUSION_COUNTERS = ("fused_bias_swish", "fused_bias_leakyrelu", "fused_bias_swish_add", "fused_bias_leakyrelu_add",
                   *("fused_" + name.replace("+", "_") for name in LEGACY))


@functools.lru_cache(maxsize=64)
def fusion_of(name: str) -> Fusion:
    """The fused epilogue ``name`` names (:mod:`convpass.core.fusion`: ``bias+swish``,
    ``bias+leakyrelu<alpha>``, either with ``+add``, or a legacy epilogue); ValueError for any
    other name. Made once per name (a launch's counters ask for it)."""
    if is_legacy(name):
        return _legacy(name)
    if adds_residual(name):
        f = fusion_of(without_residual(name))
        return dataclasses.replace(f, name=name, counter=f.counter + RESIDUAL_COUNTER, residual=True)
    if name == SWISH:
        return _SWISH
    alpha = leakyrelu_alpha(name)
    if alpha is None:
        raise ValueError(f"{name!r} is not a fused epilogue convpass knows ({SWISH}, {LEAKYRELU}<alpha> e.g. {leakyrelu_name(0.2)}, "
                         f"either followed by +add; {', '.join(LEGACY)})")
    return _leaky_relu(name, alpha)

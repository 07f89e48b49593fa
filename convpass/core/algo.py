"""How one convolution runs: the typed name of a tuning candidate and of a recorded decision.

An algorithm is written as text in the tuning cache and in tuned models (a stable, parseable
form) and handled everywhere else as an :class:`Algo`. The text is the algorithm's name, then,
after a ``+``, the epilogue its call runs fused (:mod:`convpass.core.fusion`):

=====================================  ===========  ==================================================
text                                   family       what runs
=====================================  ===========  ==================================================
``implicit_precomp_gemm``              ``legacy``   a cuDNN legacy algorithm, the conv alone
``implicit_precomp_gemm+bias+relu``    ``legacy``   cuDNN's fused conv + bias (+ residual) + ReLU call
``engine:eng67_k2=16_k13=0``           ``engine``   a graph-API engine configuration of the bare conv
``engine:eng5_k2=1+bias+swish``        ``engine``   an engine configuration of a fused graph
``engine:eng5+bias+leakyrelu0.2``      ``engine``   the same, a LeakyRelu of alpha 0.2 fused
``engine:none``                        ``engine``   the marker row: cuDNN offers no configuration
``convpass_depthwise_r8``              ``own``      convpass's own kernel (``+bias...``: fused)
``bias+relu``                          ``pass``     the epilogue as one element-wise pass (a cache row)
``add``                                ``pass``     a residual Add as its own pass (a cache row)
``auto``                               ``auto``     cuDNN's heuristic decides at run time
=====================================  ===========  ==================================================

:meth:`Algo.parse` reads any of them and ``str(algo)`` writes it back unchanged. Nothing here
imports a backend: the compiler and the tuner ask "is this an engine?" of the type, not of cuDNN.

**Transform algorithms** (:attr:`Algo.is_transform`, :func:`is_transform`) compute the convolution
in another basis: Winograd's minimal-filtering transform or the FFT. Their rounding error is about
ten times that of a GEMM-based or direct algorithm in FP32, which the ``fp32-strict`` precision
excludes (docs/precision.md). They are the legacy algorithms of :data:`TRANSFORM_ALGORITHMS`, in
every direction. Graph-API engines are not told apart (convpass does not read the numerical notes
cuDNN reports for an engine configuration): none counts as a transform. Engines are candidates only
with TF32 allowed, so the FMA-math precisions never choose one. Convpass's own kernels are direct.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

__all__ = ["AUTO", "ENGINE_PREFIX", "OWN_PREFIX", "TRANSFORM_ALGORITHMS", "Algo", "Family", "is_transform"]

Family = Literal["legacy", "engine", "own", "pass", "auto"]
AUTO = "auto"
ENGINE_PREFIX = "engine:"
OWN_PREFIX = "convpass_"
# The names an epilogue pass row starts with (the pass's own name is the epilogue's, or ``add``:
# convpass.core.fusion.RESIDUAL_PASS).
_PASS_HEADS = ("bias", "add")
# The legacy algorithms that compute in a transformed basis (module docstring), of every direction:
# forward, backward data and backward filter use these same names.
TRANSFORM_ALGORITHMS = frozenset({"winograd", "winograd_nonfused", "fft", "fft_tiling"})


@dataclasses.dataclass(frozen=True)
class Algo:
    """One algorithm: ``family``, ``name`` (without prefix or fusion) and the fused ``fusion``."""

    family: Family
    name: str
    fusion: str = ""

    def __post_init__(self) -> None:
        if not self.name and self.family != "auto":
            raise ValueError(f"an algorithm of family {self.family!r} needs a name")
        if "+" in self.name and self.family != "pass":
            raise ValueError(f"algorithm name {self.name!r} holds a '+': write the fusion apart")

    @classmethod
    def parse(cls, text: str) -> Algo:
        """The algorithm a recorded text names (table in the module docstring); ValueError for
        an empty text. Parsed once per distinct text (a cached re-run reads every row of a model's
        problems: tens of thousands)."""
        return _parse(text)

    @classmethod
    def _parse(cls, text: str) -> Algo:
        text = text.strip()
        if not text:
            raise ValueError("empty algorithm name")
        if text == AUTO:
            return cls("auto", AUTO)
        if text.startswith(ENGINE_PREFIX):
            name, _, fusion = text[len(ENGINE_PREFIX):].partition("+")
            return cls("engine", name, fusion)
        head, _, fusion = text.partition("+")
        if head in _PASS_HEADS:
            return cls("pass", text)
        if head.startswith(OWN_PREFIX):
            return cls("own", head, fusion)
        return cls("legacy", head, fusion)

    @classmethod
    def maybe(cls, text: str | None) -> Algo | None:
        """:meth:`parse` of a text that may be missing (None or empty: None)."""
        return cls.parse(text) if text else None

    def __str__(self) -> str:
        if self.family == "auto":
            return AUTO
        head = ENGINE_PREFIX + self.name if self.family == "engine" else self.name
        return head + (f"+{self.fusion}" if self.fusion else "")

    @property
    def is_engine(self) -> bool:
        return self.family == "engine"

    @property
    def is_own(self) -> bool:
        return self.family == "own"

    @property
    def is_legacy(self) -> bool:
        return self.family == "legacy"

    @property
    def is_transform(self) -> bool:
        """Whether this is a transform algorithm, Winograd or FFT (module docstring)."""
        return self.family == "legacy" and self.name in TRANSFORM_ALGORITHMS

    def bare_of(self, family: Family) -> bool:
        """Whether this is an algorithm of ``family`` running nothing fused."""
        return self.family == family and not self.fusion

    @property
    def bare(self) -> Algo:
        """The same algorithm without its fused epilogue."""
        return dataclasses.replace(self, fusion="") if self.family != "pass" else self

    def fused(self, fusion: str) -> Algo:
        """The same algorithm running ``fusion`` in its call (``""``: the bare one)."""
        if self.family in ("pass", "auto"):
            raise ValueError(f"{self} runs no conv to fuse an epilogue into")
        return dataclasses.replace(self, fusion=fusion)


def is_transform(text: str | None) -> bool:
    """Whether a recorded algorithm text names a transform algorithm (module docstring); False for
    none or an empty text."""
    return Algo.parse(text).is_transform if text else False


@functools.lru_cache(maxsize=8192)
def _parse(text: str) -> Algo:
    return Algo._parse(text)

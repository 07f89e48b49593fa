"""The convolution problem key: one normalized, hashable description of a cuDNN convolution.

A :class:`ConvShape` is the geometry of a convolution as cuDNN sees it, after canonicalization
(symmetric pads, 1-D mapped to 2-D). It is always phrased as the *forward* convolution
``y = conv(x, w)``:

* ``x``: ``n x c x spatial``        (the forward input)
* ``w``: ``k x (c / groups) x kernel``
* ``y``: ``n x k x output_spatial``

and ``direction`` says which of the three computations over that geometry is run:
``fwd`` computes y from x and w (ONNX ``Conv``), ``dgrad`` computes x from y and w (the
backward-data pass; ONNX ``ConvTranspose`` is exactly this, with its input as ``y``), ``wgrad``
computes w from x and y (backward filter, for training).

A :class:`ProblemKey` adds what the tuner chooses besides the algorithm: the memory format
(channels first or channels last) and the cuDNN math type, and for a forward conv that reads its
input from a channel slice of a larger buffer (a Concat's, a Split's input) that slice
(:class:`InputSlice`), for one that writes its output into a channel slice of a Concat's buffer
that slice (:class:`OutputSlice`): a different measurement than a packed read or write, so a
different key. It is what the tuning cache is indexed by and what a tuned model records per
convolution. Its string form is stable and parseable; a key without a slice reads as it always did.
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar, Literal, TypeVar

Direction = Literal["fwd", "dgrad", "wgrad"]
DIRECTIONS: tuple[Direction, ...] = ("fwd", "dgrad", "wgrad")

# Data types a convolution can have; compute is float32 for all of them (fp16 / bf16 use cuDNN's
# "pseudo" configuration with float accumulation, as PyTorch does).
DTYPES = ("float32", "float16", "bfloat16")

Layout = Literal["nchw", "nhwc"]
LAYOUTS: tuple[Layout, ...] = ("nchw", "nhwc")

# cuDNN math types. "default" lets cuDNN use TF32 tensor cores for float32 data on Ampere and
# later; "fma" forbids tensor cores, which is the only way to turn TF32 off per convolution.
MathMode = Literal["default", "tensor_op", "fma"]
MATH_MODES: tuple[MathMode, ...] = ("default", "tensor_op", "fma")

# Normwise relative error a conv result may have against an FMA (no TF32) reference, by data type
# and math type: what the tuner accepts of a candidate, and what the executor's check of an
# engine's first run allows (twice this: both sides of that comparison may be this far off).
TOLERANCE = {
    ("float32", "fma"): 1e-3,  # FFT / Winograd reorder sums (winograd_nonfused 5x5: ~5e-4); < TF32's
    ("float32", "default"): 5e-3,  # TF32: 10-bit mantissa products, ~3e-4 typical
    ("float32", "tensor_op"): 5e-3,
    ("float16", "default"): 1e-2,
    ("float16", "tensor_op"): 1e-2,
    ("float16", "fma"): 1e-2,
    ("bfloat16", "default"): 3e-2,
    ("bfloat16", "tensor_op"): 3e-2,
    ("bfloat16", "fma"): 3e-2,
}

_LAYOUT_NAMES = {
    # (spatial rank, channels_last) -> user-facing memory-format name
    (1, False): "NCW",
    (1, True): "NWC",
    (2, False): "NCHW",
    (2, True): "NHWC",
    (3, False): "NCDHW",
    (3, True): "NDHWC",
}


def memory_format_name(spatial_rank: int, layout: Layout) -> str:
    """The user-facing memory-format name (NCW, NHWC, NDHWC, ...) for a layout at a rank."""
    return _LAYOUT_NAMES[(spatial_rank, layout == "nhwc")]


def layout_from_memory_format(name: str) -> tuple[int, Layout]:
    """Inverse of :func:`memory_format_name`: ``"NDHWC"`` -> ``(3, "nhwc")``."""
    for (rank, last), fmt in _LAYOUT_NAMES.items():
        if fmt == name.upper():
            return rank, ("nhwc" if last else "nchw")
    raise ValueError(f"unknown memory format {name!r}; expected one of {sorted(set(_LAYOUT_NAMES.values()))}")


@dataclasses.dataclass(frozen=True)
class ChannelSlice:
    """A tensor of ``c`` channels is channels ``[first, first + c)`` of a buffer of ``channels``
    channels stored in the key's memory format (channels-last: pixels ``channels`` elements apart;
    channels-first: samples ``channels`` planes apart). Written ``<tag>=<first>/<channels>``."""

    first: int
    channels: int
    tag: ClassVar[str] = "slice"

    def __str__(self) -> str:
        return f"{self.tag}={self.first}/{self.channels}"


class InputSlice(ChannelSlice):
    """The forward input ``x`` read as a :class:`ChannelSlice`: ``xslice=<first>/<channels>``."""

    tag = "xslice"


class OutputSlice(ChannelSlice):
    """The forward output ``y`` written into a :class:`ChannelSlice` (a Concat's buffer):
    ``yslice=<first>/<channels>``."""

    tag = "yslice"


class ResidualSlice(ChannelSlice):
    """The residual ``z`` a fused step adds after its activation (a graph-API fusion's ``+add``),
    read as a :class:`ChannelSlice` (a Split's half, a Concat's buffer): ``zslice=<first>/<channels>``."""

    tag = "zslice"


SLICE_KEY_BYTES = 128  # a slice key keeps its first channel's offset modulo this many bytes (see keyed_slice)
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

SliceT = TypeVar("SliceT", bound=ChannelSlice)


def keyed_slice(where: SliceT, dtype: str) -> SliceT:
    """``where`` as a problem key names it: a conv reading or writing a channel slice runs at a speed
    set by the slice's strides (the buffer's ``channels``) and by the byte alignment of its first
    element, not by where in the buffer it starts; so ``first`` is kept modulo
    :data:`SLICE_KEY_BYTES` bytes' worth of channels (32 float32, 64 float16), which keeps the
    alignment class in either memory format (channels-last: ``first`` elements in; channels-first:
    ``first`` planes in). A dense block's layers, each writing the next channels of one buffer,
    are then one problem, tuned once, not one per layer."""
    step = SLICE_KEY_BYTES // _DTYPE_BYTES[dtype]
    return dataclasses.replace(where, first=where.first % step)


def slice_strides(dims: tuple[int, ...], where: ChannelSlice, layout: Layout) -> tuple[int, ...]:
    """Element strides of a tensor of logical shape ``dims`` (``(n, c, *spatial)``) that is the
    channel slice ``where`` of its buffer stored in ``layout`` (logical channels-first order)."""
    total, spatial = where.channels, dims[2:]
    step = 1 if layout == "nchw" else total  # the innermost spatial axis's stride
    rest: list[int] = []
    for d in reversed(spatial):
        rest.insert(0, step)
        step *= d
    # step is now the plane (channels-first) or the sample (channels-last) stride
    if layout == "nchw":
        return (total * step, step, *rest)
    return (step, 1, *rest)


def conv_output_size(size: int, kernel: int, pad_total: int, stride: int, dilation: int) -> int:
    """Forward convolution output length along one axis (pads already summed)."""
    return (size + pad_total - dilation * (kernel - 1) - 1) // stride + 1


@dataclasses.dataclass(frozen=True)
class ConvShape:
    """Geometry of one convolution, in forward-convolution terms (see the module docstring)."""

    direction: Direction
    n: int
    c: int
    k: int
    spatial: tuple[int, ...]
    kernel: tuple[int, ...]
    pads: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    groups: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        rank = len(self.spatial)
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if rank not in (2, 3):
            raise ValueError(f"cuDNN problems are 2-D or 3-D (1-D is mapped to 2-D); got rank {rank}")
        for name in ("kernel", "pads", "strides", "dilations"):
            if len(getattr(self, name)) != rank:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {rank} spatial dims")
        if min(self.n, self.c, self.k, self.groups, *self.spatial, *self.kernel) < 1:
            raise ValueError(f"sizes must be positive: {self}")
        if min(self.strides + self.dilations) < 1 or min(self.pads) < 0:
            raise ValueError(f"strides/dilations must be >= 1 and pads >= 0: {self}")
        if self.c % self.groups or self.k % self.groups:
            raise ValueError(f"groups={self.groups} does not divide C={self.c} and K={self.k}")
        if min(self.output_spatial) < 1:
            raise ValueError(f"kernel larger than padded input: {self}")

    @property
    def rank(self) -> int:
        return len(self.spatial)

    @property
    def output_spatial(self) -> tuple[int, ...]:
        return tuple(
            conv_output_size(s, k, 2 * p, st, d)
            for s, k, p, st, d in zip(self.spatial, self.kernel, self.pads, self.strides, self.dilations)
        )

    @property
    def x_shape(self) -> tuple[int, ...]:
        return (self.n, self.c, *self.spatial)

    @property
    def w_shape(self) -> tuple[int, ...]:
        return (self.k, self.c // self.groups, *self.kernel)

    @property
    def y_shape(self) -> tuple[int, ...]:
        return (self.n, self.k, *self.output_spatial)

    @property
    def is_depthwise(self) -> bool:
        return self.groups > 1 and self.groups == self.c

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of the computation (the same for all three directions)."""
        out = 1
        for s in self.output_spatial:
            out *= s
        ker = 1
        for s in self.kernel:
            ker *= s
        return 2 * self.n * self.k * out * (self.c // self.groups) * ker

    def with_direction(self, direction: Direction) -> ConvShape:
        return dataclasses.replace(self, direction=direction)

    def key(self, layout: Layout, math: MathMode, x_slice: InputSlice | None = None, y_slice: OutputSlice | None = None,
            z_slice: ResidualSlice | None = None) -> ProblemKey:
        return ProblemKey(self, layout, math, x_slice, y_slice, z_slice)

    def __str__(self) -> str:
        x = lambda t: "x".join(map(str, t))  # noqa: E731
        return (
            f"{self.direction}|n={self.n}|c={self.c}|k={self.k}|in={x(self.spatial)}|ker={x(self.kernel)}"
            f"|pad={x(self.pads)}|str={x(self.strides)}|dil={x(self.dilations)}|g={self.groups}|{self.dtype}"
        )


_KEY_RE = re.compile(
    r"^(?P<direction>fwd|dgrad|wgrad)\|n=(?P<n>\d+)\|c=(?P<c>\d+)\|k=(?P<k>\d+)\|in=(?P<spatial>[\dx]+)"
    r"\|ker=(?P<kernel>[\dx]+)\|pad=(?P<pads>[\dx]+)\|str=(?P<strides>[\dx]+)\|dil=(?P<dilations>[\dx]+)"
    r"\|g=(?P<groups>\d+)\|(?P<dtype>float32|float16|bfloat16)\|(?P<layout>nchw|nhwc)\|(?P<math>default|tensor_op|fma)"
    r"(?:\|xslice=(?P<first>\d+)/(?P<channels>\d+))?(?:\|yslice=(?P<yfirst>\d+)/(?P<ychannels>\d+))?"
    r"(?:\|zslice=(?P<zfirst>\d+)/(?P<zchannels>\d+))?$"
)


@dataclasses.dataclass(frozen=True)
class ProblemKey:
    """A :class:`ConvShape` plus the memory format and math type it runs in.

    ``str(key)`` is the stable form stored in tuned models and in the tuning cache, e.g.
    ``fwd|n=1|c=3|k=64|in=224x224|ker=7x7|pad=3x3|str=2x2|dil=1x1|g=1|float32|nchw|default``;
    :meth:`parse` reads it back. ``x_slice``: the forward input is that channel slice of a wider
    buffer (``...|nhwc|default|xslice=0/192``); ``y_slice``: the forward output is written into
    that channel slice of a wider buffer (``...|nhwc|default|yslice=160/192``; both:
    ``...|xslice=0/128|yslice=160/192``); ``z_slice``: the residual the fused step adds is read
    from that channel slice of a wider buffer (``...|nhwc|default|zslice=16/32``, after any
    ``xslice``: CSPDarknet's first block of a stage adds the second half of its stage's Split);
    None: packed.
    """

    shape: ConvShape
    layout: Layout
    math: MathMode
    x_slice: InputSlice | None = None
    y_slice: OutputSlice | None = None
    z_slice: ResidualSlice | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.math not in MATH_MODES:
            raise ValueError(f"math must be one of {MATH_MODES}, got {self.math!r}")
        for s, what, c in ((self.x_slice, "an input", self.shape.c), (self.y_slice, "an output", self.shape.k),
                           (self.z_slice, "a residual", self.shape.k)):
            if s is None:
                continue
            if self.shape.direction != "fwd":
                raise ValueError(f"{what} slice is a forward conv's, not {self.shape.direction}'s")
            if s.first < 0 or s.first + c > s.channels or s.channels <= c:
                raise ValueError(f"channels {s.first}..{s.first + c} of a {s.channels}-channel buffer are no channel slice")

    @property
    def packed(self) -> ProblemKey:
        """This key reading a packed input (and residual) and writing a packed output."""
        if self.x_slice is None and self.y_slice is None and self.z_slice is None:
            return self
        return dataclasses.replace(self, x_slice=None, y_slice=None, z_slice=None)

    @property
    def x_strides(self) -> tuple[int, ...] | None:
        """Element strides of the input slice (:func:`slice_strides`); None: packed."""
        return None if self.x_slice is None else slice_strides(self.shape.x_shape, self.x_slice, self.layout)

    @property
    def y_strides(self) -> tuple[int, ...] | None:
        """Element strides of the output slice (:func:`slice_strides`); None: packed."""
        return None if self.y_slice is None else slice_strides(self.shape.y_shape, self.y_slice, self.layout)

    @property
    def z_strides(self) -> tuple[int, ...] | None:
        """Element strides of the residual slice (:func:`slice_strides`); None: packed."""
        return None if self.z_slice is None else slice_strides(self.shape.y_shape, self.z_slice, self.layout)

    @property
    def tf32(self) -> bool:
        """Whether float32 data may be computed with TF32 tensor cores under this math type."""
        return self.shape.dtype == "float32" and self.math != "fma"

    def __str__(self) -> str:
        return f"{self.shape}|{self.layout}|{self.math}" + "".join(f"|{s}" for s in (self.x_slice, self.y_slice, self.z_slice) if s is not None)

    @classmethod
    def parse(cls, text: str) -> ProblemKey:
        m = _KEY_RE.match(text.strip())
        if not m:
            raise ValueError(f"not a convpass problem key: {text!r}")
        dims = lambda s: tuple(int(v) for v in m[s].split("x"))  # noqa: E731
        shape = ConvShape(
            direction=m["direction"],  # type: ignore[arg-type]
            n=int(m["n"]),
            c=int(m["c"]),
            k=int(m["k"]),
            spatial=dims("spatial"),
            kernel=dims("kernel"),
            pads=dims("pads"),
            strides=dims("strides"),
            dilations=dims("dilations"),
            groups=int(m["groups"]),
            dtype=m["dtype"],
        )
        x_slice = InputSlice(int(m["first"]), int(m["channels"])) if m["channels"] is not None else None
        y_slice = OutputSlice(int(m["yfirst"]), int(m["ychannels"])) if m["ychannels"] is not None else None
        z_slice = ResidualSlice(int(m["zfirst"]), int(m["zchannels"])) if m["zchannels"] is not None else None
        return cls(shape, m["layout"], m["math"], x_slice, y_slice, z_slice)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class ConvProblem:
    """What must be decided once: the candidate geometries of one convolution computation."""

    candidates: tuple[ConvShape, ...]
    fusion: str = ""  # the epilogue run in its conv's step (:mod:`convpass.core.fusion`), or ""
    x_slice: InputSlice | None = None  # the input is read as this channel slice (forward, 2-D geometry only)
    y_slice: OutputSlice | None = None  # the output is written into this channel slice (forward, 2-D geometry only)
    z_slice: ResidualSlice | None = None  # the fusion's residual (adds_residual) is read as this channel slice (likewise)

    @property
    def direction(self) -> Direction:
        return self.candidates[0].direction

    @property
    def primary(self) -> ConvShape:
        return self.candidates[0]

    def __str__(self) -> str:
        mapping = f" (+{len(self.candidates) - 1} mapping)" if len(self.candidates) > 1 else ""
        read = f" reading {self.x_slice}" if self.x_slice is not None else ""
        write = f" writing {self.y_slice}" if self.y_slice is not None else ""
        residual = f" adding {self.z_slice}" if self.z_slice is not None else ""
        return str(self.primary) + mapping + (f" + {self.fusion}" if self.fusion else "") + read + write + residual

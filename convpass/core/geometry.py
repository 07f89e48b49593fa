"""The geometry of one Conv / ConvTranspose at concrete shapes, and its cuDNN problem: the one
implementation of ONNX's padding and output-size rules (:func:`conv_geometry`).

The compiler (:mod:`convpass.compiler.passes.canonicalize_convs`, whose module docstring states the
canonical form) and the executor's kernels (:mod:`convpass.ops.conv`, the cuDNN backend) read the
same :class:`ConvGeometry`: symmetric pads plus ``extra_pads`` (a Conv's zero pre-pad, a
ConvTranspose's crop; a negative crop is zeros ONNX adds), the ONNX output shape, and the cuDNN
problem(s) in ``shapes``. A convolution ONNX defines but cuDNN cannot express (more than three
spatial dims, an empty tensor, a ConvTranspose ``output_shape`` larger than what it computes,
sizes past cuDNN's ``int``) gets its geometry with ``shapes == ()`` and the reason in
``refusal``: the reference kernels run it; :func:`canonicalize_conv` (the compiler's entry)
refuses it as an :class:`~convpass.core.errors.UnsupportedConvError`. Attributes that make no
convolution at all are a :class:`~convpass.core.errors.ConvAttributeError` either way. No onnx-ir
here: the executor imports this at start-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, overload

from convpass.core.errors import ConvAttributeError, UnsupportedConvError
from convpass.core.problem import ConvShape

__all__ = ["CONV_OPS", "ConvGeometry", "canonicalize_conv", "conv_geometry"]

CONV_OPS = ("Conv", "ConvTranspose")
INT_MAX = 2**31 - 1  # cuDNN's descriptors take int: no dimension, pad, stride or dilation above it


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """One conv node at one shape profile (see the module docstring)."""

    op_type: str
    spatial_rank: int
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    output_shape: tuple[int, ...]  # ONNX output shape (N, K, spatial...)
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    group: int
    pads: tuple[int, ...]  # symmetric, per spatial dim
    extra_pads: tuple[int, ...]  # (begins..., ends...)
    dtype: str
    shapes: tuple[ConvShape, ...]
    refusal: str = ""  # why cuDNN cannot run it (shapes == ()), or ""

    @property
    def has_extra_pads(self) -> bool:
        return any(self.extra_pads)

    @property
    def begin(self) -> tuple[int, ...]:
        """Total pad (Conv) / crop (ConvTranspose) at the start of each spatial dim."""
        r = self.spatial_rank
        return tuple(p + e for p, e in zip(self.pads, self.extra_pads[:r]))

    @property
    def end(self) -> tuple[int, ...]:
        r = self.spatial_rank
        return tuple(p + e for p, e in zip(self.pads, self.extra_pads[r:]))

    @property
    def problem(self) -> ConvShape | None:
        return self.shapes[0] if self.shapes else None


@overload
def _ints(attrs: Mapping[str, Any], name: str, default: Sequence[int]) -> tuple[int, ...]: ...


@overload
def _ints(attrs: Mapping[str, Any], name: str, default: None) -> tuple[int, ...] | None: ...


def _ints(attrs: Mapping[str, Any], name: str, default: Sequence[int] | None) -> tuple[int, ...] | None:
    value = attrs.get(name)
    if value is None:
        return None if default is None else tuple(default)
    return tuple(int(v) for v in value)


def _same_pads(total: int, mode: str) -> tuple[int, int]:
    small, large = total // 2, total - total // 2
    return (small, large) if mode == "SAME_UPPER" else (large, small)


def canonicalize_conv(
    op_type: str,
    attrs: Mapping[str, Any],
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    dtype: str = "float32",
    node_name: str = "<conv>",
) -> ConvGeometry:
    """The canonical cuDNN form of a Conv / ConvTranspose with concrete input and weight shapes;
    :class:`~convpass.core.errors.UnsupportedConvError` for one cuDNN cannot run."""
    g = conv_geometry(op_type, attrs, x_shape, w_shape, dtype, node_name)
    if g.refusal:
        raise UnsupportedConvError(f"{op_type} {node_name!r}: {g.refusal}")
    return g


def conv_geometry(
    op_type: str,
    attrs: Mapping[str, Any],
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    dtype: str = "float32",
    node_name: str = "<conv>",
) -> ConvGeometry:
    """The geometry of a Conv / ConvTranspose with concrete input and weight shapes (module
    docstring): every convolution ONNX defines, with its cuDNN problem where cuDNN can run it."""

    def fail(msg: str) -> ConvAttributeError:
        return ConvAttributeError(f"{op_type} {node_name!r}: {msg}")

    refusals: list[str] = []

    if op_type not in CONV_OPS:
        raise fail("not a convolution")
    x_shape, w_shape = tuple(int(d) for d in x_shape), tuple(int(d) for d in w_shape)
    if len(x_shape) != len(w_shape) or len(x_shape) < 3:
        raise fail(f"input shape {list(x_shape)} and weight shape {list(w_shape)} must have the same rank >= 3")
    rank = len(x_shape) - 2
    if rank > 3:
        refusals.append(f"{rank}-D convolution is not supported (cuDNN takes 1-D, 2-D and 3-D)")
    kernel = tuple(w_shape[2:])
    declared = _ints(attrs, "kernel_shape", None)
    if declared is not None and declared != kernel:
        raise fail(f"kernel_shape {list(declared)} does not match the weight's spatial shape {list(kernel)}")
    strides = _ints(attrs, "strides", [1] * rank)
    dilations = _ints(attrs, "dilations", [1] * rank)
    group = int(attrs.get("group", 1))
    for name, values in (("strides", strides), ("dilations", dilations)):
        if len(values) != rank:
            raise fail(f"{name} has {len(values)} entries for a {rank}-D convolution")
        if min(values) < 1:
            raise fail(f"{name} must be >= 1, got {list(values)}")
        if max(values) > INT_MAX:
            refusals.append(f"{name} {list(values)} are larger than cuDNN takes ({INT_MAX})")
    if group < 1:
        raise fail(f"group must be >= 1, got {group}")
    if group > INT_MAX:
        refusals.append(f"group {group} is larger than cuDNN takes ({INT_MAX})")
    if min(*x_shape, *w_shape) < 0:
        raise fail(f"negative dims in input {list(x_shape)} or weight {list(w_shape)}")
    if min(*x_shape, *w_shape) == 0:
        refusals.append(f"zero-sized input {list(x_shape)} or weight {list(w_shape)}")
    auto_pad = attrs.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    if auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise fail(f"unknown auto_pad {auto_pad!r}")
    extent = tuple((k - 1) * d + 1 for k, d in zip(kernel, dilations))
    n, spatial = x_shape[0], x_shape[2:]

    if op_type == "Conv":
        c, k = x_shape[1], w_shape[0]
        if c != w_shape[1] * group:
            raise fail(f"input has {c} channels but weight expects {w_shape[1]} x group {group} = {w_shape[1] * group}")
        if k % group:
            raise fail(f"group {group} does not divide the {k} output channels")
        begin, end = _conv_pads(attrs, auto_pad, rank, spatial, strides, extent, fail)
        out = tuple((s + b + e - x) // st + 1 for s, b, e, x, st in zip(spatial, begin, end, extent, strides))
        if min(out) < 1:
            raise fail(f"kernel extent {list(extent)} is larger than the padded input {[s + b + e for s, b, e in zip(spatial, begin, end)]}")
        sym = tuple(min(b, e) for b, e in zip(begin, end))
        extra_begin = tuple(b - p for b, p in zip(begin, sym))
        # Trim end padding that no window reads (common with SAME on stride-2 convs).
        extra_end = tuple(
            max(0, min(e - p, (o - 1) * st - b + x - s - p))
            for e, p, o, st, b, x, s in zip(end, sym, out, strides, begin, extent, spatial)
        )
        cudnn_spatial = tuple(s + b + e for s, b, e in zip(spatial, extra_begin, extra_end))
        output_shape = (n, k, *out)
        direction, fwd_c, fwd_k = "fwd", c, k
    else:
        c_in, c_out = x_shape[1], w_shape[1] * group
        if c_in != w_shape[0]:
            raise fail(f"input has {c_in} channels but weight expects {w_shape[0]}")
        if c_in % group:
            raise fail(f"group {group} does not divide the {c_in} input channels")
        out_pad = _ints(attrs, "output_padding", [0] * rank)
        if len(out_pad) == 2 * rank:  # some exporters write begins + ends; only the ends grow the output
            out_pad = out_pad[rank:]
        if len(out_pad) != rank:
            raise fail(f"output_padding has {len(out_pad)} entries for a {rank}-D convolution")
        for op, st, d in zip(out_pad, strides, dilations):
            if op < 0 or op >= max(st, d):
                raise fail(f"output_padding {list(out_pad)} must be >= 0 and < stride (or dilation)")
        natural = tuple(st * (s - 1) + op + x for st, s, op, x in zip(strides, spatial, out_pad, extent))
        begin, end = _conv_transpose_pads(attrs, auto_pad, rank, spatial, strides, natural, fail, refusals)
        out = tuple(nat - b - e for nat, b, e in zip(natural, begin, end))
        if min(out) < 1:
            raise fail(f"pads {list(begin) + list(end)} leave an empty output")
        sym = tuple(max(0, min(b, e)) for b, e in zip(begin, end))
        extra_begin = tuple(b - p for b, p in zip(begin, sym))
        extra_end = tuple(e - p for e, p in zip(end, sym))
        cudnn_spatial = tuple(o + b + e for o, b, e in zip(out, extra_begin, extra_end))
        output_shape = (n, c_out, *out)
        direction, fwd_c, fwd_k = "dgrad", c_out, c_in

    if max(output_shape) > INT_MAX:
        refusals.append(f"its output {list(output_shape)} is larger than cuDNN takes ({INT_MAX} per dimension)")
    shapes: tuple[ConvShape, ...] = ()
    if not refusals:
        try:
            shapes = tuple(
                ConvShape(direction, n, fwd_c, fwd_k, sp, kr, pd, st, dl, group, dtype)  # type: ignore[arg-type]
                for sp, kr, pd, st, dl in _cudnn_candidates(cudnn_spatial, kernel, sym, strides, dilations)
            )
        except ValueError as e:
            refusals.append(str(e))
    if shapes and op_type == "Conv" and rank > 1 and shapes[0].output_spatial != output_shape[2:]:
        raise AssertionError(f"canonical form of {node_name!r} changes its output: {shapes[0]} vs {output_shape}")
    return ConvGeometry(
        op_type=op_type,
        spatial_rank=rank,
        x_shape=x_shape,
        w_shape=w_shape,
        output_shape=output_shape,
        kernel=kernel,
        strides=strides,
        dilations=dilations,
        group=group,
        pads=sym,
        extra_pads=extra_begin + extra_end,
        dtype=dtype,
        shapes=shapes,
        refusal="; ".join(refusals),
    )


def _explicit_pads(attrs: Mapping[str, Any], rank: int, fail) -> tuple[tuple[int, ...], tuple[int, ...]]:
    pads = _ints(attrs, "pads", [0] * (2 * rank))
    if len(pads) != 2 * rank:
        raise fail(f"pads has {len(pads)} entries; a {rank}-D convolution needs {2 * rank}")
    if min(pads) < 0:
        raise fail(f"negative pads {list(pads)} are not supported")
    if max(pads) > INT_MAX:
        raise fail(f"pads {list(pads)} are larger than cuDNN takes ({INT_MAX})")
    return pads[:rank], pads[rank:]


def _conv_pads(attrs, auto_pad, rank, spatial, strides, extent, fail):
    if auto_pad == "NOTSET":
        return _explicit_pads(attrs, rank, fail)
    if auto_pad == "VALID":
        return (0,) * rank, (0,) * rank
    pairs = []
    for s, st, x in zip(spatial, strides, extent):
        out = -(-s // st)
        pairs.append(_same_pads(max(0, (out - 1) * st + x - s), auto_pad))
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _conv_transpose_pads(attrs, auto_pad, rank, spatial, strides, natural, fail, refusals):
    requested = _ints(attrs, "output_shape", None)
    if requested is not None:
        requested = requested[-rank:] if len(requested) in (rank, rank + 2) else None
        if requested is None:
            raise fail(f"output_shape must have {rank} (or {rank + 2}) entries")
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        requested = tuple(s * st for s, st in zip(spatial, strides))
    if requested is None:
        if auto_pad == "VALID":
            return (0,) * rank, (0,) * rank
        return _explicit_pads(attrs, rank, fail)
    pairs = []
    for nat, want in zip(natural, requested):
        total = nat - want
        if total < 0 and not refusals:
            refusals.append(f"output_shape {list(requested)} is larger than the transposed conv produces "
                            f"({list(natural)}); ONNX pads the rest with zeros, which is no cuDNN problem")
        # ONNX: SAME_UPPER puts the larger half at the end, anything else at the beginning.
        pairs.append(_same_pads(total, "SAME_UPPER" if auto_pad == "SAME_UPPER" else "SAME_LOWER"))
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _cudnn_candidates(spatial, kernel, pads, strides, dilations):
    """cuDNN problem geometries for the spatial part: 1-D has two 2-D mappings, others one."""
    if len(spatial) != 1:
        return [(spatial, kernel, pads, strides, dilations)]
    as_row = ((1, spatial[0]), (1, kernel[0]), (0, pads[0]), (1, strides[0]), (1, dilations[0]))
    as_col = ((spatial[0], 1), (kernel[0], 1), (pads[0], 0), (strides[0], 1), (dilations[0], 1))
    return [as_row, as_col]

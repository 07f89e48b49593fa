"""The broadcasting kernel of a fused element-wise group (:mod:`convpass.kernels.elementwise`):
its CUDA source, its launch geometry, and the kernel object that runs it.

The kernel (:class:`BroadcastKernel`, float16 / float32 / float64) is generated per group code,
not per shape. Its launch geometry is worked out on the host (:func:`broadcast_geometry`): every
operand's strides are broadcast to the output's shape and put in the output's memory order, and
adjacent dimensions that every operand walks contiguously are merged (a per-channel parameter
over NCHW leaves three: N, C, H * W; over NHWC two: N * H * W, C; same-shape operands one). A
thread then splits its element index over those (at most :data:`MAX_DIMS`) with 32-bit
divisions and reads every operand at its own strides, so any layout works: a channels-last
operand next to a channels-first one, a Concat slice as the output. A result the kernel allocates
is stored channels-last where a full-rank operand is stored so, packed or as a channel slice of a
channels-last Concat buffer (and walked in that order), else channels-first. Offsets are computed once
per class of operands that share strides (:func:`broadcast_classes`: a BatchNormalization's
parameters), with the terms of absent dimensions compiled out (one entry per dimension count).
Each thread loads :data:`UNROLL` adjacent elements (:data:`UNROLL_HEAVY` for heavier math)
before it stores any. CuPy's ``ElementwiseKernel`` of the same code keeps one load in flight per
thread and indexes every operand on its own; in one-op models replayed as graphs
(benchmarks/op_kernels.py), this kernel ran a bias Add, ConvNeXt's layer scale + residual, bias +
erf GELU and BatchNormalization + Relu (its parameters folded, as
:mod:`convpass.kernels.elementwise` says) faster than CuPy's
(docs/measurements/2026-11-23-broadcast-kernel.md). CuPy's kernel still
runs the shapes this one does not take (more than :data:`MAX_DIMS` dimensions after merging,
2^31 elements or more).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from convpass.core.layout import storage_order
from convpass.kernels.elementwise import PREAMBLE, FusedGroup
from convpass.native import nvrtc as compiler
from convpass.native.cuda import elements

__all__ = ["ENTRIES", "MAX_DIMS", "UNROLL", "UNROLL_HEAVY", "BroadcastKernel", "Geometry", "broadcast_classes", "broadcast_geometry",
           "broadcast_source", "needs_fallback", "unroll_for"]

# elements per thread, all loaded before any is stored: 4 for groups of a few multiplies and adds,
# 2 where the math is heavier (erf, exp, division, ...): the best of 2, 4 and 8 for each kind in a
# raw-launch probe (at 8 the kernel was slower than CuPy's)
UNROLL = 4
UNROLL_HEAVY = 2
_HEAVY_MATH = ("erf", "exp", "log", "tanh", "sqrt", "pow", "/")
MAX_DIMS = 4  # dimensions after merging (rank 4 always fits; rank 5 when two dimensions merge)
_BLOCK = 256
_INDEX_LIMIT = 2**31  # indices and offsets are 32-bit in the kernel
_STORAGE = {np.dtype(np.float16): "__half", np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
ENTRIES = tuple(f"convpass_broadcast_d{d}" for d in range(1, MAX_DIMS + 1))  # one per dimension count

_BROADCAST_SOURCE = r"""
#HEADER
#PREAMBLE
typedef #STORAGE T;
// D dimensions after merging: q0 the outermost index, q1 ... q3 the ones below it (extents e1 ... e3);
// the terms of the dimensions that are not there are compiled out.
template <int D>
__device__ __forceinline__ void broadcast(#PARAMS) {
    const unsigned base = (blockIdx.x * blockDim.x + threadIdx.x) * #UNROLL;
#ARRAYS
    int oy[#UNROLL];
    // every element's loads first, then the math and the stores: the loads are in flight together
    // (y may alias an input, so a store would hold back the loads after it)
#pragma unroll
    for (int j = 0; j < #UNROLL; ++j) {
        const unsigned i = base + j;
        if (i < n) {
            unsigned q0 = 0, q1 = 0, q2 = 0, q3 = i;
            if (D >= 2) {
                const unsigned t = i / e3;
                q3 = i - t * e3;
                if (D == 2) {
                    q0 = t;
                } else {
                    const unsigned u = t / e2;
                    q2 = t - u * e2;
                    if (D == 3) { q0 = u; } else { q0 = u / e1; q1 = u - q0 * e1; }
                }
            }
#OFFSETS
#LOADS
            oy[j] = oc_y;
        }
    }
#pragma unroll
    for (int j = 0; j < #UNROLL; ++j) {
        if (base + j < n) {
#VALUES
            T out0;
            {
#CODE
            }
            y[oy[j]] = out0;
        }
    }
}
#ENTRIES
"""


def broadcast_classes(plan: Any, group: FusedGroup) -> tuple[int, ...]:
    """Which of the group's inputs share their offsets (a class number per input, numbered in
    order of first appearance): constant inputs read as the same shape do (packed arrays of one
    shape have one set of strides: a BatchNormalization's four parameters are one class); every
    other input is a class of its own."""
    keys = []
    for k, slot in enumerate(group.inputs):
        const = plan.template[slot]
        keys.append(("constant", tuple(group.view_of(k) or const.shape)) if const is not None else ("value", k))
    first: dict[tuple, int] = {}
    return tuple(first.setdefault(key, len(first)) for key in keys)


def unroll_for(group: FusedGroup) -> int:
    """:data:`UNROLL`, or :data:`UNROLL_HEAVY` when the group's math has a transcendental or a division."""
    return UNROLL_HEAVY if any(f in group.code for f in _HEAVY_MATH) else UNROLL


def broadcast_source(group: FusedGroup, classes: Sequence[int] | None = None, unroll: int | None = None) -> compiler.KernelSource:
    """The group's broadcasting kernel (module docstring): entries :data:`ENTRIES` (by the number of
    merged dimensions), parameters ``(x0 ... x{n-1}, y, n, e1, e2, e3, strides...)``: the element
    count, the extents of the merged dimensions below the outermost, then the four strides
    (elements; :class:`Geometry`) of every offset class (``classes``: per input, from
    :func:`broadcast_classes`; default one per input), then the output's."""
    n = len(group.inputs)
    classes = tuple(range(n)) if classes is None else tuple(classes)
    default_unroll = unroll_for(group)
    unroll = default_unroll if unroll is None else unroll
    names = [f"c{c}" for c in dict.fromkeys(classes)] + ["y"]
    params = [f"const {group.type_of(k)}* x{k}" for k in range(n)] + ["T* y"]
    params += [f"unsigned {v}" for v in ("n", "e1", "e2", "e3")]
    params += [f"int s{a}_{d}" for a in names for d in range(4)]
    call = ", ".join(p.rsplit(" ", 1)[1].lstrip("*") for p in params)
    offsets = [f"            const int oc_{a} = (D >= 2 ? (int)q0 * s{a}_0 : 0) + (D == 4 ? (int)q1 * s{a}_1 : 0) "
               f"+ (D >= 3 ? (int)q2 * s{a}_2 : 0) + (int)q3 * s{a}_3;" for a in names]
    arrays_ = [f"    {group.type_of(k)} v{k}[{unroll}];" for k in range(n)]
    loads = [f"            v{k}[j] = x{k}[oc_c{classes[k]}];" for k in range(n)]
    values = [f"            const {group.type_of(k)} in{k} = v{k}[j];" for k in range(n)]
    entries = [f'extern "C" __global__ void {e}({", ".join(params)}) {{ broadcast<{d}>({call}); }}' for d, e in enumerate(ENTRIES, 1)]
    code = (_BROADCAST_SOURCE.replace("#HEADER", "#include <cuda_fp16.h>" if group.dtype == np.float16 else "")
            .replace("#PREAMBLE", PREAMBLE).replace("#STORAGE", _STORAGE[group.dtype]).replace("#PARAMS", ", ".join(params))
            .replace("#UNROLL", str(unroll)).replace("#ARRAYS", "\n".join(arrays_)).replace("#OFFSETS", "\n".join(offsets))
            .replace("#LOADS", "\n".join(loads)).replace("#VALUES", "\n".join(values)).replace("#CODE", group.code)
            .replace("#ENTRIES", "\n".join(entries)))
    tag = "" if classes == tuple(range(n)) else "_c" + "".join(map(str, classes))
    suffix = "" if unroll == default_unroll else f"_u{unroll}"
    return compiler.KernelSource("convpass_bcast_" + group.name.removeprefix("convpass_ew_") + tag + suffix, code, ENTRIES)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A broadcast element-wise launch: ``n`` elements in the output's memory order, over at most
    four merged dimensions; ``extents`` are the three below the outermost (``e1, e2, e3``, the
    innermost last; 1 where there are fewer dimensions), ``strides[k]`` array k's strides
    (elements) along the outermost dimension and those three (inputs first, the output last)."""

    n: int
    extents: tuple[int, int, int]
    strides: tuple[tuple[int, int, int, int], ...]

    @property
    def dims(self) -> int:
        """How many merged dimensions there are (the kernel entry that takes them)."""
        return 1 + sum(1 for e in self.extents if e > 1) if self.n > self.extents[2] else 1

    def launch(self, unroll: int) -> tuple[int, int]:
        """(blocks, threads per block): ``unroll`` adjacent elements per thread, one pass."""
        return max(1, -(-self.n // (_BLOCK * unroll))), _BLOCK


def broadcast_geometry(shape: Sequence[int], operands: Sequence[tuple[Sequence[int], Sequence[int]]],
                       out_strides: Sequence[int], channels_last_order: bool) -> Geometry | None:
    """The launch geometry of an element-wise kernel writing ``shape`` (module docstring).

    ``operands``: (shape, element strides) of every input, broadcast NumPy-style to ``shape``;
    ``out_strides``: the output's element strides; ``channels_last_order``: walk the elements in
    channels-last order (the output's memory order). None when more than :data:`MAX_DIMS`
    dimensions remain after merging, or an index or offset needs more than 31 bits."""
    r = len(shape)
    per_array: list[list[int]] = []
    for op_shape, op_strides in operands:
        pad = r - len(op_shape)
        if pad < 0:
            return None
        dims = [1] * pad + list(op_shape)
        st = [0] * pad + [int(v) for v in op_strides]
        per_array.append([0 if dims[d] == 1 and shape[d] != 1 else st[d] for d in range(r)])
    per_array.append([int(v) for v in out_strides])
    order = [0, *range(2, r), 1] if channels_last_order and 3 <= r <= 5 else list(range(r))
    extents: list[int] = []
    merged: list[list[int]] = [[] for _ in per_array]
    for d in order:
        size = int(shape[d])
        if size == 1:
            continue
        if extents and all(m[-1] == a[d] * size for m, a in zip(merged, per_array)):
            extents[-1] *= size
            for m, a in zip(merged, per_array):
                m[-1] = a[d]
            continue
        extents.append(size)
        for m, a in zip(merged, per_array):
            m.append(a[d])
    if not extents:  # one element
        extents = [1]
        merged = [[0] for _ in per_array]
    n = math.prod(extents)
    if len(extents) > MAX_DIMS or n >= _INDEX_LIMIT:
        return None
    for m in merged:
        if any(v < 0 for v in m) or sum((e - 1) * v for e, v in zip(extents, m)) >= _INDEX_LIMIT:
            return None
    # the outermost dimension, then up to three below it (e1 outermost of those): padded where
    # there are fewer, so that the kernel's divisions skip what is not there
    d = len(extents)
    index = [0, 1 if d == 4 else None, d - 2 if d >= 3 else None, d - 1 if d >= 2 else None]
    if d == 1:
        index = [None, None, None, 0]
    ext = tuple(extents[i] if i is not None else 1 for i in index[1:])
    strides = tuple(tuple(m[i] if i is not None else 0 for i in index) for m in merged)
    return Geometry(n, ext, strides)  # type: ignore[arg-type]


class BroadcastKernel:
    """A fused group's broadcasting kernel, compiled when built (at plan time); called with the
    group's input arrays and an optional output array (a Concat slice), it returns the output, or
    None for a geometry it does not take (:func:`broadcast_geometry`). ``classes``: inputs that
    share offsets (:func:`broadcast_classes`)."""

    def __init__(self, cupy: Any, group: FusedGroup, classes: Sequence[int] | None = None, entry: Callable[[str], Any] | None = None) -> None:
        self.cp = cupy
        self.group = group
        self.classes = tuple(range(len(group.inputs))) if classes is None else tuple(classes)
        self.unroll = unroll_for(group)
        self.source = broadcast_source(group, self.classes, self.unroll)
        # entry(name): a compiled entry point, called as fn(grid, block, args) (tests pass a host build)
        get = entry if entry is not None else (lambda name: compiler.function(cupy, self.source, name))
        self.entries = [get(name) for name in ENTRIES]
        self._plans: dict[tuple, Any] = {}

    def __call__(self, args: Sequence[Any], out: Any = None) -> Any | None:
        key = tuple((a.shape, a.strides) for a in args) + ((out.shape, out.strides) if out is not None else None,)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(args, out)
        if plan is False:
            return None
        fn, grid, block, scalars, alloc = plan
        if out is None:
            out = self.cp.empty(alloc[0], dtype=self.group.dtype).transpose(alloc[1])
        if out.size:
            fn((grid,), (block,), (*args, out, *scalars))
        return out

    def planned_dims(self) -> set[int]:
        """How many merged dimensions the launches planned so far walk (one per geometry taken)."""
        return {self.entries.index(plan[0]) + 1 for plan in self._plans.values() if plan is not False}

    def _plan(self, args: Sequence[Any], out: Any) -> Any:
        shape = tuple(np.broadcast_shapes(*(a.shape for a in args)))
        if out is not None and tuple(out.shape) != shape:
            return False
        r = len(shape)
        # the output's memory order; a channel slice of a channels-last Concat buffer is channels-last too,
        # as an output (walked channels-first, a LeakyReLU writing such slices ran at a fifth of its packed
        # speed) and as an input (a dense layer's BatchNormalization + Relu of the features so far: a
        # channels-first result made the channels-last conv after it copy its input)
        nhwc = 3 <= r <= 5 and (storage_order(out) is not None if out is not None
                                else any(a.ndim == r and storage_order(a) is not None for a in args))
        alloc = None
        if out is None:
            perm = (0, *range(2, r), 1) if nhwc else tuple(range(r))
            inv = tuple(int(i) for i in np.argsort(perm))
            alloc = (tuple(shape[p] for p in perm), inv)  # allocated in memory order, then seen logically
            packed = _contiguous_strides(alloc[0])
            out_strides = tuple(packed[i] for i in inv)
        else:
            out_strides = elements(out.strides, out.itemsize)
        g = broadcast_geometry(shape, [(a.shape, elements(a.strides, a.itemsize)) for a in args], out_strides, nhwc)
        if g is None:
            return False
        per_class: dict[int, tuple[int, ...]] = {}
        for c, st in zip(self.classes, g.strides[:-1]):
            if per_class.setdefault(c, st) != st:  # a class whose members are not alike: not for this kernel
                return False
        grid, block = g.launch(self.unroll)
        u32, i32 = np.uint32, np.int32
        scalars = [u32(g.n), *(u32(e) for e in g.extents)]
        scalars += [i32(v) for st in [*per_class.values(), g.strides[-1]] for v in st]
        return self.entries[g.dims - 1], grid, block, tuple(scalars), alloc


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def needs_fallback(plan: Any, group: FusedGroup) -> bool:
    """Whether the group's output may take a shape :class:`BroadcastKernel` does not (rank above
    :data:`MAX_DIMS`, 2^31 elements or more, or unknown): then CuPy's kernel is built too."""
    info = plan.info(group.output)
    return info is None or len(info[0]) > MAX_DIMS or math.prod(info[0]) >= _INDEX_LIMIT

"""The element strides of a graph-API plan's tensors: which ones a plan of a problem key may be
built with (its input, output and residual slices', else packed), and the checks
:meth:`~convpass.native.cudnn.graph_api.EnginePlan.execute` makes of the arrays it is given
(their strides, their alignment, a residual apart from the output).

Rules:

1. **The order tried** (:func:`io_choices`). A plan reads ``x`` and writes ``y`` with the key's
   slices' strides where it names them (``xslice``, ``yslice``), both first, then each alone (the
   input slice's first), then both packed; a key without a slice: packed alone. The first pair
   cuDNN builds the plan for is the plan's.
2. **The residual** ``z`` is read with the key's residual slice's strides (``zslice``), else
   packed like ``y`` (:func:`z_strides`).
3. **Alignment.** The plans are built for tensors at :data:`ALIGNMENT`-byte aligned starts: a view
   at an odd offset is refused before cuDNN reads it (:func:`misaligned`).
"""

from __future__ import annotations

from typing import Any

from convpass.core.problem import ProblemKey

__all__ = ["ALIGNMENT", "has_strides", "io_choices", "misaligned", "overlap", "x_choices", "z_strides"]

Strides = tuple[int, ...]
ALIGNMENT = 16  # bytes: the cudnn frontend's default tensor alignment, which the plans are built with


def io_choices(key: ProblemKey) -> tuple[tuple[Strides, Strides], ...]:
    """``(x strides, y strides)`` a plan of ``key`` may be built with, in the order tried (rule 1)."""
    from convpass.native.cudnn.descriptors import descriptor_params

    p = descriptor_params(key)
    px, py = p.x.strides, p.y.strides
    sx, sy = key.x_strides or px, key.y_strides or py
    return tuple(dict.fromkeys(((sx, sy), (sx, py), (px, sy), (px, py))))


def x_choices(key: ProblemKey) -> tuple[Strides, ...]:
    """The element strides a plan of ``key`` may read ``x`` with, in the order tried (rule 1)."""
    return tuple(dict.fromkeys(x for x, _ in io_choices(key)))


def z_strides(key: ProblemKey) -> Strides:
    """The element strides of the residual ``z`` a plan of ``key`` reads (rule 2)."""
    from convpass.native.cudnn.descriptors import descriptor_params

    return key.z_strides or descriptor_params(key).y.strides


def misaligned(**arrays: Any) -> list[str]:
    """The names of the given device arrays (None: absent) whose data pointer is not
    :data:`ALIGNMENT`-byte aligned: a view at an odd offset (a batch or channel slice) that a plan
    built for aligned tensors would read with misaligned vector loads, a sticky CUDA error."""
    ptrs = {name: getattr(getattr(a, "data", None), "ptr", None) for name, a in arrays.items() if a is not None}
    return [name for name, ptr in ptrs.items() if ptr is not None and int(ptr) % ALIGNMENT]  # host arrays (CPU stand-ins) have none


def has_strides(a: Any, want: Strides) -> bool:
    """Whether the device array ``a`` has the element strides ``want`` (unit axes aside; a host stand-in passes)."""
    have, shape = getattr(a, "strides", None), getattr(a, "shape", None)
    return have is None or shape is None or all(int(h) // a.itemsize == w for h, w, d in zip(have, want, shape) if d > 1)


def overlap(a: Any, b: Any) -> bool:
    """Whether two device arrays' memory spans (first to last byte their strides reach) overlap."""
    def span(v: Any) -> tuple[int, int]:
        start = int(v.data.ptr)
        shape, strides = getattr(v, "shape", None), getattr(v, "strides", None)
        if shape is None or strides is None:
            return start, start + max(int(getattr(v, "nbytes", 0)), 1)
        if 0 in shape:
            return start, start
        low = sum((d - 1) * s for d, s in zip(shape, strides) if s < 0)
        high = sum((d - 1) * s for d, s in zip(shape, strides) if s > 0) + v.itemsize
        return start + low, start + high

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1

"""The arrays the convolution calls are given: storage dtypes, memory formats, checks, workspaces.

Every array is described by its *logical* channels-first shape (``x``: ``n, c, *spatial``,
``w``: ``k, c/g, *kernel``, ``y``: ``n, k, *out``); a problem key with layout ``nhwc`` expects all
three channels-last in memory (see :func:`empty_like_layout`). Arrays are checked against the
descriptors (shape, dtype, strides) before any cuDNN call (:func:`checked_pointer`), so a wrong
layout is an error rather than garbage. A forward call also reads ``x`` from, and writes ``y`` into,
a channel slice of a larger buffer stored in the key's memory format (a Concat's,
:func:`channel_slice`), described to cuDNN with the slice's own strides. ``bfloat16`` data is held in ``uint16`` arrays of raw bits
unless the caller's CuPy has a bfloat16 dtype.
"""

from __future__ import annotations

import functools

from convpass.native.cudnn.descriptors import TensorParams, strides_for

__all__ = ["as_layout", "channel_slice", "checked_pointer", "empty_like_layout", "layout_of", "require_cupy", "storage_dtype", "workspace_arg"]


def require_cupy():
    """The ``cupy`` module (an ImportError saying how to install it where it is missing)."""
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - exercised only without the GPU extra
        raise ImportError("convpass.native.cudnn needs CuPy for device arrays: pip install 'convpass[gpu]'") from e
    return cupy


_ACCEPTED_DTYPES = {
    "float32": ("float32",),
    "float16": ("float16",),
    "bfloat16": ("bfloat16", "uint16", "int16"),  # raw bits are fine: cuDNN only sees bytes
}


def storage_dtype(dtype):
    """The NumPy / CuPy dtype that holds data of a convpass dtype name (``bfloat16`` -> ``uint16``
    raw bits); any other dtype is returned as ``numpy.dtype(dtype)``."""
    import numpy as np

    if isinstance(dtype, str) and dtype == "bfloat16":
        return np.dtype(np.uint16)
    return np.dtype(dtype)


def empty_like_layout(shape, dtype, layout: str):
    """An uninitialized CuPy array of *logical* shape ``(n, c, *spatial)`` stored in ``layout``.

    For ``nhwc`` it allocates ``(n, *spatial, c)`` and returns the transposed view, so indexing and
    shapes stay channels-first while memory is channels-last (like PyTorch's channels_last).
    """
    cupy = require_cupy()
    shape = tuple(int(s) for s in shape)
    dt = storage_dtype(dtype)
    if layout == "nchw":
        return cupy.empty(shape, dtype=dt)
    if layout != "nhwc":
        raise ValueError(f"unknown layout {layout!r}; expected 'nchw' or 'nhwc'")
    nd = len(shape)
    physical = (shape[0], *shape[2:], shape[1])
    return cupy.empty(physical, dtype=dt).transpose(0, nd - 1, *range(1, nd - 1))


def as_layout(array, layout: str):
    """``array`` (logical channels-first) in ``layout``: itself when already so, else a copy,
    walked in memory order where both are stored in one (as :func:`convpass.native.cuda.copy_into`: a
    channel slice of a channels-last Concat buffer, copied in the logical order, read one element
    per Concat-width stride and took several times a transpose's time)."""
    if layout_of(array) in (layout, "both"):
        return array
    from convpass.core.layout import storage_order

    out = empty_like_layout(array.shape, array.dtype, layout)
    order = storage_order(out)
    if order is not None and storage_order(array) == order:
        out.transpose(order)[...] = array.transpose(order)
    else:
        out[...] = array
    return out


def _matches(shape, strides, want) -> bool:
    return all(d == 1 or s == w for d, s, w in zip(shape, strides, want))


def layout_of(array) -> str | None:
    """``"nchw"`` or ``"nhwc"`` when ``array`` is densely packed in that memory format, ``"both"``
    when it is both (e.g. c == 1), ``None`` otherwise."""
    itemsize = array.itemsize
    return _layout_of(tuple(array.shape), tuple(s // itemsize for s in array.strides))


@functools.lru_cache(maxsize=1024)
def _layout_of(shape: tuple[int, ...], strides: tuple[int, ...]) -> str | None:
    # asked before every launch of an epilogue or engine (85,000 times in a ResNet-50's tuning):
    # few geometries, so remembered
    nchw = _matches(shape, strides, strides_for(shape, "nchw"))
    nhwc = _matches(shape, strides, strides_for(shape, "nhwc"))
    if nchw and nhwc:
        return "both"
    return "nchw" if nchw else "nhwc" if nhwc else None


def channel_slice(array, layout: str) -> bool:
    """Whether ``array`` (logical channels-first) is a channel slice of a larger tensor packed in
    ``layout`` (a Concat buffer's): its strides are those of a packed tensor of that layout with
    more channels (``nhwc``: channel stride 1, pixels the buffer's channels apart; ``nchw``: samples
    the buffer's channels apart). An array packed itself is no slice."""
    itemsize = array.itemsize
    return _channel_slice(tuple(array.shape), tuple(s // itemsize for s in array.strides), layout)


@functools.lru_cache(maxsize=1024)
def _channel_slice(shape: tuple[int, ...], strides: tuple[int, ...], layout: str) -> bool:
    if len(shape) < 3 or _layout_of(shape, strides) in (layout, "both"):
        return False
    n, c, spatial = shape[0], shape[1], shape[2:]
    inner = 1
    for d in spatial:
        inner *= d
    if n > 1:  # the sample stride holds the buffer's channel count in both layouts
        total = strides[0] // inner if inner and strides[0] % inner == 0 else 0
    elif layout == "nhwc":  # one sample: the innermost spatial axis that is no unit
        axes = [a for a in range(2, len(shape)) if shape[a] > 1]
        after = 1
        for d in shape[axes[-1] + 1:] if axes else ():
            after *= d
        total = strides[axes[-1]] // after if axes else 0
    else:
        return False  # one channels-first sample is packed once it is a slice at all
    return total > c and _matches(shape, strides, strides_for((n, total, *spatial), layout))


def checked_pointer(array, role: str, t: TensorParams, dtype: str, layout: str) -> int:
    """Device pointer of ``array`` after checking it against the descriptor it will be read with
    (``t.strides``: the packed layout's, or the strides of a slice the caller describes to cuDNN;
    None: any strides)."""
    if isinstance(array, int):
        return array
    shape = getattr(array, "shape", None)
    if shape is None or not hasattr(array, "data"):
        raise TypeError(f"{role}: expected a CuPy array or a device pointer (int), got {type(array).__name__}")
    shape = tuple(shape)
    if shape != t.dims and not (role == "bias" and shape == (t.dims[1],)):
        raise ValueError(f"{role}: shape {shape} does not match the problem's {t.dims}")
    dt = str(array.dtype)
    if dt not in _ACCEPTED_DTYPES[dtype]:
        raise ValueError(f"{role}: dtype {dt} does not match the problem's {dtype}")
    if shape == t.dims:
        strides = tuple(s // array.itemsize for s in array.strides)
        if t.strides is not None and not _matches(shape, strides, t.strides):
            raise ValueError(
                f"{role}: element strides {strides} do not match the descriptor's {t.strides} (a packed {layout} "
                f"tensor of shape {shape}, or the slice's strides given); use empty_like_layout / as_layout"
            )
    elif array.strides[0] != array.itemsize:
        raise ValueError(f"{role}: a 1-D bias must be contiguous")
    return int(array.data.ptr)


def workspace_arg(workspace) -> tuple[int | None, int, object]:
    """(pointer, bytes, object to keep alive) for a workspace given as None, a byte count (allocated
    here), a CuPy array, a CuPy MemoryPointer or a ``(ptr, nbytes)`` pair."""
    if workspace is None:
        return None, 0, None
    if isinstance(workspace, int):
        if workspace <= 0:
            return None, 0, None
        buf = require_cupy().empty(workspace, dtype="uint8")
        return int(buf.data.ptr), int(workspace), buf
    if isinstance(workspace, tuple):
        ptr, size = workspace
        return int(ptr), int(size), None
    if hasattr(workspace, "nbytes") and hasattr(workspace, "data"):
        return int(workspace.data.ptr), int(workspace.nbytes), workspace
    if hasattr(workspace, "mem") and hasattr(workspace, "ptr"):  # cupy.cuda.MemoryPointer
        size = int(workspace.mem.size) - (int(workspace.ptr) - int(workspace.mem.ptr))
        return int(workspace.ptr), size, workspace
    raise TypeError(f"workspace: expected None, an int, a CuPy array or MemoryPointer, or (ptr, nbytes); got {workspace!r}")

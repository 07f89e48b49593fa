"""cuDNN descriptors for one convolution problem.

Two halves:

* :func:`descriptor_params` derives, in pure Python, every number the descriptors are built from
  (dims, strides per layout, filter dims and format, pads / strides / dilations, group count, enum
  values) from a :class:`~convpass.core.problem.ProblemKey`. It is unit-tested on CPU.
* :class:`ConvDescriptors` makes the ctypes calls that consume those numbers.

Conventions (see ``convpass/problem.py``): the geometry is always the forward convolution
``x[n, c, *spatial] * w[k, c/g, *kernel] -> y[n, k, *out]``; the same descriptors serve all three
directions (for ``dgrad`` x is dx and y is dy, for ``wgrad`` w is dw). Dims are always given to
cuDNN in logical channels-first order; the memory format lives in the strides (tensors) and in the
filter format (``CUDNN_TENSOR_NHWC`` means the filter is stored ``k, *kernel, c/g``). For an
``nhwc`` key all three tensors, the filter included, are channels-last in memory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys
from ctypes import c_int, c_void_p

from convpass.core import cudnn_enums as enums
from convpass.core.problem import ProblemKey


def strides_for(shape, layout: str) -> tuple[int, ...]:
    """Element strides of a densely packed tensor of logical shape ``(n, c, *spatial)``.

    ``nchw``: row-major. ``nhwc``: channels last, i.e. memory order ``n, *spatial, c``:
    ``strides_for((2, 3, 4, 5), "nhwc") == (60, 1, 15, 3)``.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 3:
        raise ValueError(f"need at least (n, c, spatial...), got shape {shape}")
    if layout == "nchw":
        order = list(range(len(shape)))
    elif layout == "nhwc":
        order = [0, *range(2, len(shape)), 1]
    else:
        raise ValueError(f"unknown layout {layout!r}; expected 'nchw' or 'nhwc'")
    strides = [0] * len(shape)
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= shape[axis]
    return tuple(strides)


@dataclasses.dataclass(frozen=True)
class TensorParams:
    """Logical (channels-first) dims and element strides of one tensor."""

    dims: tuple[int, ...]
    strides: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DescriptorParams:
    """Everything the cuDNN descriptors of one problem are built from."""

    key: ProblemKey
    nb_dims: int  # 4 for 2-D convolutions, 5 for 3-D
    data_type: int  # cudnnDataType_t of x, w, y (and bias)
    compute_type: int  # cudnnDataType_t of the convolution descriptor (always float)
    tensor_format: int  # cudnnTensorFormat_t (filter format; tensors use explicit strides)
    x: TensorParams
    w: TensorParams  # dims are k, c/g, *kernel; strides describe the memory format
    y: TensorParams
    bias: TensorParams  # 1, k, 1, ... (for the fused bias + activation forward)
    pads: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    mode: int  # cudnnConvolutionMode_t: cross-correlation
    groups: int
    math_type: int  # cudnnMathType_t

    @property
    def dtype(self) -> str:
        return self.key.shape.dtype

    @property
    def layout(self) -> str:
        return self.key.layout


def descriptor_params(key: ProblemKey) -> DescriptorParams:
    """Derive every descriptor parameter of ``key`` (pure Python, no cuDNN needed)."""
    if not isinstance(key, ProblemKey):
        raise TypeError(f"expected a ProblemKey, got {type(key).__name__}")
    s = key.shape
    layout = key.layout

    def tensor(shape) -> TensorParams:
        return TensorParams(tuple(shape), strides_for(shape, layout))

    bias_shape = (1, s.k) + (1,) * s.rank
    return DescriptorParams(
        key=key,
        nb_dims=s.rank + 2,
        data_type=enums.data_type(s.dtype),
        compute_type=enums.COMPUTE_TYPE,
        tensor_format=enums.tensor_format(layout),
        x=tensor(s.x_shape),
        w=tensor(s.w_shape),
        y=tensor(s.y_shape),
        bias=tensor(bias_shape),
        pads=tuple(s.pads),
        strides=tuple(s.strides),
        dilations=tuple(s.dilations),
        mode=enums.CUDNN_CROSS_CORRELATION,
        groups=s.groups,
        math_type=enums.math_type(key.math),
    )


def _ints(values) -> ctypes.Array:
    values = list(values)
    return (c_int * len(values))(*values)


class ConvDescriptors:
    """The cuDNN descriptors of one :class:`ProblemKey`: ``x``, ``y`` (tensors), ``w`` (filter),
    ``conv`` (convolution, with group count and math type), lazily ``bias``, activation ones and
    ``x`` / ``y`` with the strides of a slice of a larger buffer (:meth:`input`, :meth:`output`).

    Attributes hold the raw descriptor handles (ints). Release with :meth:`close`, a ``with``
    block, or by dropping the object. Raises :class:`~convpass.core.cudnn_enums.CudnnError` when cuDNN
    rejects a parameter and ``ValueError`` when cuDNN's output dims differ from the key's.
    """

    def __init__(self, key: ProblemKey) -> None:
        from convpass.native.cudnn import library

        self._lib = library
        self.key = key
        self.params = p = descriptor_params(key)
        self._owned: list[tuple[str, int]] = []  # (destroy function, handle)
        self._activations: dict[str, int] = {}
        self._bias: int | None = None
        self._strided: dict[tuple[str, tuple[int, ...]], int] = {}
        try:
            self.x = self._tensor(p.x)
            self.y = self._tensor(p.y)
            self.w = self._filter()
            self.conv = self._conv()
            self._verify_output_dims()
        except BaseException:
            self.close()
            raise

    # -- construction -------------------------------------------------------------------------

    def _create(self, create: str, destroy: str) -> int:
        h = c_void_p()
        self._lib.call(create, ctypes.byref(h))
        self._owned.append((destroy, h.value))
        return h.value

    def _tensor(self, t: TensorParams) -> int:
        h = self._create("cudnnCreateTensorDescriptor", "cudnnDestroyTensorDescriptor")
        self._lib.call(
            "cudnnSetTensorNdDescriptor", h, self.params.data_type, len(t.dims), _ints(t.dims), _ints(t.strides)
        )
        return h

    def _filter(self) -> int:
        p = self.params
        h = self._create("cudnnCreateFilterDescriptor", "cudnnDestroyFilterDescriptor")
        self._lib.call("cudnnSetFilterNdDescriptor", h, p.data_type, p.tensor_format, len(p.w.dims), _ints(p.w.dims))
        return h

    def _conv(self) -> int:
        p = self.params
        h = self._create("cudnnCreateConvolutionDescriptor", "cudnnDestroyConvolutionDescriptor")
        self._lib.call(
            "cudnnSetConvolutionNdDescriptor",
            h,
            len(p.pads),
            _ints(p.pads),
            _ints(p.strides),
            _ints(p.dilations),
            p.mode,
            p.compute_type,
        )
        self._lib.call("cudnnSetConvolutionGroupCount", h, p.groups)
        self._lib.call("cudnnSetConvolutionMathType", h, p.math_type)
        return h

    def _verify_output_dims(self) -> None:
        p = self.params
        out = (c_int * p.nb_dims)()
        self._lib.call("cudnnGetConvolutionNdForwardOutputDim", self.conv, self.x, self.w, p.nb_dims, out)
        got = tuple(out)
        if got != p.y.dims:
            raise ValueError(
                f"cuDNN computes output dims {got} for {self.key}, but the problem key says {p.y.dims}"
            )

    @property
    def bias(self) -> int:
        """Tensor descriptor of the per-channel bias ``1 x k x 1 x 1 (x 1)`` (created on first use)."""
        if self._bias is None:
            self._bias = self._tensor(self.params.bias)
        return self._bias

    def input(self, strides: tuple[int, ...] | None) -> int:
        """Tensor descriptor of ``x`` with element ``strides`` (None: the key's packed layout), for
        an input read from a slice of a larger buffer (created once per strides)."""
        return self._strided_tensor("x", strides)

    def output(self, strides: tuple[int, ...] | None) -> int:
        """Tensor descriptor of ``y`` with element ``strides`` (None: the key's packed layout), for
        an output written into a slice of a larger buffer (created once per strides)."""
        return self._strided_tensor("y", strides)

    def _strided_tensor(self, role: str, strides: tuple[int, ...] | None) -> int:
        packed, t = (self.x, self.params.x) if role == "x" else (self.y, self.params.y)
        if strides is None or tuple(strides) == t.strides:
            return packed
        strides = tuple(int(v) for v in strides)
        h = self._strided.get((role, strides))
        if h is None:
            h = self._strided[(role, strides)] = self._tensor(TensorParams(t.dims, strides))
        return h

    def activation(self, name: str, coef: float = 0.0) -> int:
        """Activation descriptor (``relu``, ``identity``, ...), created once per name."""
        h = self._activations.get(name)
        if h is None:
            mode = enums.activation_mode(name)
            h = self._create("cudnnCreateActivationDescriptor", "cudnnDestroyActivationDescriptor")
            self._lib.call("cudnnSetActivationDescriptor", h, mode, enums.CUDNN_NOT_PROPAGATE_NAN, float(coef))
            self._activations[name] = h
        return h

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return getattr(self, "conv", None) is None

    def close(self) -> None:
        owned, self._owned = getattr(self, "_owned", []), []
        first_error: Exception | None = None
        for destroy, h in reversed(owned):
            try:
                self._lib.call(destroy, h)
            except Exception as e:  # noqa: BLE001  (destroy everything, report the first failure)
                first_error = first_error or e
        self.x = self.y = self.w = self.conv = None  # type: ignore[assignment]
        self._bias = None
        self._activations = {}
        self._strided = {}
        if first_error is not None:
            raise first_error

    def __enter__(self) -> ConvDescriptors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if sys.is_finalizing():
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def __repr__(self) -> str:
        return f"ConvDescriptors({self.key})"

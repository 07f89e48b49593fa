"""cuDNN enumerations with convpass's user-facing names, and the binding's two exception classes.

This is the one module that knows cuDNN's numbering. Every value below was checked against the
cuDNN 9 headers (``cudnn_graph.h`` for status / data / math / format / activation codes,
``cudnn_ops.h`` / ``cudnn_cnn.h`` for the convolution algorithms and the perf structs).

Algorithm names are the short, lower-case forms of cuDNN's own (``CUDNN_CONVOLUTION_FWD_ALGO_
IMPLICIT_PRECOMP_GEMM`` -> ``implicit_precomp_gemm``), the vocabulary users know from PyTorch,
MindSpore and MIOpen. Directions are convpass's: ``fwd`` (forward), ``dgrad`` (backward data),
``wgrad`` (backward filter).

Nothing here needs a GPU, cuDNN or CuPy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

DIRECTIONS = ("fwd", "dgrad", "wgrad")

# ---------------------------------------------------------------------------------------------
# Exceptions (the only place the binding defines them)
# ---------------------------------------------------------------------------------------------


class CudnnNotFound(RuntimeError):
    """No usable ``libcudnn.so.9`` could be loaded; the message lists every place searched."""


class CudnnError(RuntimeError):
    """A cuDNN call returned a status other than ``CUDNN_STATUS_SUCCESS``.

    ``str(err)`` reads ``"cudnnConvolutionForward failed: CUDNN_STATUS_NOT_SUPPORTED (3000)"``,
    followed on a second line by cuDNN's own last-error text when it gave one (``.detail``).
    """

    def __init__(self, status: int, call: str, detail: str | None = None) -> None:
        self.status = int(status)
        self.status_name = status_name(self.status)
        self.call = call
        self.detail = detail or None
        msg = f"{call} failed: {self.status_name} ({self.status})"
        if self.detail:
            msg += f"\n  cuDNN says: {self.detail}"
        super().__init__(msg)

    @property
    def category(self) -> int:
        """cuDNN 9 groups codes by thousands: 2000 bad param, 3000 not supported, 4000 internal..."""
        return status_category(self.status)

    @property
    def not_supported(self) -> bool:
        """Whether cuDNN refused the problem / algorithm (any ``CUDNN_STATUS_NOT_SUPPORTED*``)."""
        return self.category == STATUS["CUDNN_STATUS_NOT_SUPPORTED"]

    def __reduce__(self):  # keep the exception picklable (multiprocessing tuners)
        return (type(self), (self.status, self.call, self.detail))


# ---------------------------------------------------------------------------------------------
# cudnnStatus_t (cuDNN 9, cudnn_graph.h)
# ---------------------------------------------------------------------------------------------

STATUS: Mapping[str, int] = {
    "CUDNN_STATUS_SUCCESS": 0,
    # uncategorized
    "CUDNN_STATUS_NOT_INITIALIZED": 1001,
    "CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH": 1002,
    "CUDNN_STATUS_SERIALIZATION_VERSION_MISMATCH": 1003,
    "CUDNN_STATUS_DEPRECATED": 1004,
    "CUDNN_STATUS_LICENSE_ERROR": 1005,
    "CUDNN_STATUS_RUNTIME_IN_PROGRESS": 1006,
    "CUDNN_STATUS_RUNTIME_FP_OVERFLOW": 1007,
    "CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED": 1008,
    # bad parameter
    "CUDNN_STATUS_BAD_PARAM": 2000,
    "CUDNN_STATUS_INVALID_VALUE": 2001,  # deprecated alias kept by cuDNN 9
    "CUDNN_STATUS_BAD_PARAM_NULL_POINTER": 2002,
    "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER": 2003,
    "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED": 2004,
    "CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND": 2005,
    "CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT": 2006,
    "CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH": 2007,
    "CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH": 2008,
    "CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES": 2009,
    "CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE": 2010,
    "CUDNN_STATUS_BAD_PARAM_CUDA_GRAPH_MISMATCH": 2011,
    "CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE": 2012,
    # not supported
    "CUDNN_STATUS_NOT_SUPPORTED": 3000,
    "CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN": 3001,
    "CUDNN_STATUS_NOT_SUPPORTED_SHAPE": 3002,
    "CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE": 3003,
    "CUDNN_STATUS_NOT_SUPPORTED_LAYOUT": 3004,
    "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER": 3005,
    "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDART": 3006,
    "CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH": 3007,
    "CUDNN_STATUS_NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING": 3008,
    "CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE": 3009,
    "CUDNN_STATUS_NOT_SUPPORTED_SHARED_MEMORY_INSUFFICIENT": 3010,
    "CUDNN_STATUS_NOT_SUPPORTED_PADDING": 3011,
    "CUDNN_STATUS_NOT_SUPPORTED_BAD_LAUNCH_PARAM": 3012,
    "CUDNN_STATUS_NOT_SUPPORTED_CUDA_GRAPH_NATIVE_API": 3013,
    # internal
    "CUDNN_STATUS_INTERNAL_ERROR": 4000,
    "CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED": 4001,
    "CUDNN_STATUS_INTERNAL_ERROR_UNEXPECTED_VALUE": 4002,
    "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED": 4003,  # == deprecated ALLOC_FAILED
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED": 4004,
    "CUDNN_STATUS_INTERNAL_ERROR_BAD_LAUNCH_PARAM": 4005,
    "CUDNN_STATUS_INTERNAL_ERROR_TEXTURE_CREATION_FAILED": 4006,  # == deprecated MAPPING_ERROR
    # execution
    "CUDNN_STATUS_EXECUTION_FAILED": 5000,
    "CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER": 5001,
    "CUDNN_STATUS_EXECUTION_FAILED_CUBLAS": 5002,
    "CUDNN_STATUS_EXECUTION_FAILED_CUDART": 5003,
    "CUDNN_STATUS_EXECUTION_FAILED_CURAND": 5004,
}
_STATUS_BY_CODE = {code: name for name, code in STATUS.items()}
SUCCESS = 0


def status_name(status: int) -> str:
    """``3000 -> "CUDNN_STATUS_NOT_SUPPORTED"``; an unknown code reads ``CUDNN_STATUS_UNKNOWN``."""
    return _STATUS_BY_CODE.get(int(status), "CUDNN_STATUS_UNKNOWN")


def status_category(status: int) -> int:
    """cuDNN's ``CUDNN_STATUS_CATEGORY``: the code rounded down to its thousand."""
    return int(status) // 1000 * 1000


# ---------------------------------------------------------------------------------------------
# Convolution algorithms
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AlgoInfo:
    """One cuDNN convolution algorithm of one direction."""

    direction: str
    name: str  # convpass / user-facing name
    id: int  # cuDNN enum value
    cudnn_name: str  # the C enumerator
    deterministic: bool  # bitwise reproducible run to run
    implemented: bool = True  # bwd-filter WINOGRAD is declared in the header but never implemented


def _algos(direction: str, prefix: str, rows) -> tuple[AlgoInfo, ...]:
    def cname(name: str) -> str:  # algo_0 -> CUDNN_..._ALGO_0, fft -> CUDNN_..._ALGO_FFT
        return prefix + (name[len("algo_") :] if name.startswith("algo_") else name).upper()

    return tuple(AlgoInfo(direction, name, i, cname(name), det, impl) for i, (name, det, impl) in enumerate(rows))


# Order is the header's enumeration order: the position is the cuDNN value.
_ALGOS: dict[str, tuple[AlgoInfo, ...]] = {
    "fwd": _algos(
        "fwd",
        "CUDNN_CONVOLUTION_FWD_ALGO_",
        [
            ("implicit_gemm", True, True),  # 0
            ("implicit_precomp_gemm", True, True),  # 1
            ("gemm", True, True),  # 2
            ("direct", True, True),  # 3
            ("fft", True, True),  # 4
            ("fft_tiling", True, True),  # 5
            ("winograd", True, True),  # 6
            ("winograd_nonfused", True, True),  # 7
        ],
    ),
    "dgrad": _algos(
        "dgrad",
        "CUDNN_CONVOLUTION_BWD_DATA_ALGO_",
        [
            ("algo_0", False, True),  # 0, non-deterministic
            ("algo_1", True, True),  # 1
            ("fft", True, True),  # 2
            ("fft_tiling", True, True),  # 3
            ("winograd", True, True),  # 4
            ("winograd_nonfused", True, True),  # 5
        ],
    ),
    "wgrad": _algos(
        "wgrad",
        "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_",
        [
            ("algo_0", False, True),  # 0, non-deterministic
            ("algo_1", True, True),  # 1
            ("fft", True, True),  # 2
            ("algo_3", False, True),  # 3, non-deterministic
            ("winograd", True, False),  # 4, "not implemented" per cudnn_ops.h
            ("winograd_nonfused", True, True),  # 5
            ("fft_tiling", True, True),  # 6
        ],
    ),
}
_BY_NAME = {d: {a.name: a for a in algos} for d, algos in _ALGOS.items()}
_BY_CUDNN_NAME = {d: {a.cudnn_name.lower(): a for a in algos} for d, algos in _ALGOS.items()}

# The C "perf" struct's determinism field (cudnnDeterminism_t).
CUDNN_NON_DETERMINISTIC = 0
CUDNN_DETERMINISTIC = 1


def check_direction(direction: str) -> str:
    if direction not in _ALGOS:
        raise ValueError(f"unknown convolution direction {direction!r}; expected one of {DIRECTIONS}")
    return direction


def algos(direction: str) -> tuple[AlgoInfo, ...]:
    """All algorithms of a direction, in cuDNN's enumeration order."""
    return _ALGOS[check_direction(direction)]


def algo_names(direction: str, implemented_only: bool = False) -> tuple[str, ...]:
    """The algorithm names of a direction, in cuDNN order (``implemented_only`` drops bwd-filter
    ``winograd``, which cuDNN declares but never implemented)."""
    return tuple(a.name for a in algos(direction) if a.implemented or not implemented_only)


def algo_info(direction: str, name: str) -> AlgoInfo:
    """Look an algorithm up by convpass name (case-insensitive) or by its C enumerator name."""
    table = _BY_NAME[check_direction(direction)]
    key = str(name).strip().lower()
    info = table.get(key) or _BY_CUDNN_NAME[direction].get(key)
    if info is None:
        raise ValueError(
            f"unknown {direction} convolution algorithm {name!r}; valid names are: "
            + ", ".join(algo_names(direction))
        )
    return info


def algo_id(direction: str, name: str) -> int:
    """``algo_id("fwd", "winograd") -> 6``; ValueError listing the valid names for an unknown name."""
    return algo_info(direction, name).id


def algo_name(direction: str, algo: int) -> str:
    """``algo_name("wgrad", 3) -> "algo_3"``; ValueError for a value outside the enumeration."""
    table = algos(direction)
    if not 0 <= int(algo) < len(table):
        raise ValueError(f"{direction} convolution algorithm id {algo} is outside 0..{len(table) - 1}")
    return table[int(algo)].name


def is_deterministic(direction: str, name: str) -> bool:
    """Whether an algorithm gives bitwise-identical results run to run (bwd-data ``algo_0`` and
    bwd-filter ``algo_0`` / ``algo_3`` accumulate with atomics and do not)."""
    return algo_info(direction, name).deterministic


def is_implemented(direction: str, name: str) -> bool:
    return algo_info(direction, name).implemented


# ---------------------------------------------------------------------------------------------
# Math types, data types, formats, modes
# ---------------------------------------------------------------------------------------------

# cudnnMathType_t. convpass's math modes are default / tensor_op / fma (problem.MATH_MODES);
# tensor_op_allow_conversion only ever comes back from cuDNN in perf results.
MATH_TYPES: Mapping[str, int] = {
    "default": 0,  # CUDNN_DEFAULT_MATH: TF32 allowed for fp32 on Ampere+
    "tensor_op": 1,  # CUDNN_TENSOR_OP_MATH
    "tensor_op_allow_conversion": 2,  # CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION
    "fma": 3,  # CUDNN_FMA_MATH: no tensor cores, so no TF32
}
_MATH_BY_ID = {v: k for k, v in MATH_TYPES.items()}


def math_type(name: str) -> int:
    if name not in MATH_TYPES:
        raise ValueError(f"unknown math type {name!r}; expected one of {tuple(MATH_TYPES)}")
    return MATH_TYPES[name]


def math_name(math: int) -> str:
    if int(math) not in _MATH_BY_ID:
        raise ValueError(f"unknown cudnnMathType_t value {math}")
    return _MATH_BY_ID[int(math)]


# cudnnDataType_t
CUDNN_DATA_FLOAT = 0
CUDNN_DATA_DOUBLE = 1
CUDNN_DATA_HALF = 2
CUDNN_DATA_BFLOAT16 = 9
DATA_TYPES: Mapping[str, int] = {
    "float32": CUDNN_DATA_FLOAT,
    "float16": CUDNN_DATA_HALF,
    "bfloat16": CUDNN_DATA_BFLOAT16,
}
# Compute (accumulation) type of every convolution convpass runs: float, also for fp16 / bf16
# data (cuDNN's PSEUDO_HALF / PSEUDO_BFLOAT16 configurations). Scaling factors alpha / beta are
# therefore always C floats.
COMPUTE_TYPE = CUDNN_DATA_FLOAT

ELEMENT_BYTES: Mapping[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


def data_type(name: str) -> int:
    if name not in DATA_TYPES:
        raise ValueError(f"unsupported data type {name!r}; expected one of {tuple(DATA_TYPES)}")
    return DATA_TYPES[name]


# cudnnTensorFormat_t
CUDNN_TENSOR_NCHW = 0
CUDNN_TENSOR_NHWC = 1
TENSOR_FORMATS: Mapping[str, int] = {"nchw": CUDNN_TENSOR_NCHW, "nhwc": CUDNN_TENSOR_NHWC}


def tensor_format(layout: str) -> int:
    if layout not in TENSOR_FORMATS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {tuple(TENSOR_FORMATS)}")
    return TENSOR_FORMATS[layout]


# cudnnConvolutionMode_t: ONNX / PyTorch "convolution" is cross-correlation.
CUDNN_CONVOLUTION = 0
CUDNN_CROSS_CORRELATION = 1

# cudnnPoolingMode_t and cudnnNanPropagation_t (pooling: ONNX's MaxPool propagates NaN, like NumPy's max)
POOLING_MODES: Mapping[str, int] = {
    "max": 0,  # CUDNN_POOLING_MAX
    "average_include_pad": 1,  # CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING
    "average_exclude_pad": 2,  # CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING
    "max_deterministic": 3,  # CUDNN_POOLING_MAX_DETERMINISTIC
}
CUDNN_NOT_PROPAGATE_NAN = 0
CUDNN_PROPAGATE_NAN = 1


def pooling_mode(name: str) -> int:
    if name not in POOLING_MODES:
        raise ValueError(f"unknown pooling mode {name!r}; expected one of {tuple(POOLING_MODES)}")
    return POOLING_MODES[name]


# cudnnActivationMode_t
ACTIVATION_MODES: Mapping[str, int] = {
    "sigmoid": 0,
    "relu": 1,
    "tanh": 2,
    "clipped_relu": 3,
    "elu": 4,
    "identity": 5,
    "swish": 6,
}
# The only activations cudnnConvolutionBiasActivationForward accepts. LeakyReLU has no mode here:
# it runs fused only in a graph-API engine (the pointwise mode CUDNN_POINTWISE_RELU_FWD = 100 with
# CUDNN_ATTR_POINTWISE_RELU_LOWER_CLIP_SLOPE = 5 set to alpha, which nvidia-cudnn-frontend's
# ``leaky_relu`` sets: convpass.native.cudnn.graph_api.fusion_of).
FUSED_ACTIVATIONS = ("relu", "identity")

# cudnnNanPropagation_t
CUDNN_NOT_PROPAGATE_NAN = 0
CUDNN_PROPAGATE_NAN = 1


def activation_mode(name: str) -> int:
    if name not in ACTIVATION_MODES:
        raise ValueError(f"unknown activation {name!r}; expected one of {tuple(ACTIVATION_MODES)}")
    return ACTIVATION_MODES[name]

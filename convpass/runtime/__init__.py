"""convpass.runtime: the executor that runs (tuned) ONNX models, its op library and backends.

``Executor(model, device="cpu")`` runs a model; ``check_support(model)`` says what it cannot run;
``supported_ops()`` lists the op table. See :mod:`convpass.runtime.executor`.
"""

from convpass.core.errors import ExecutorError
from convpass.kernels.backends import Backend, CpuBackend
from convpass.kernels.plan import ConvSummary, GraphStatus, Plan
from convpass.ops.registry import supported_ops
from convpass.runtime.devices import cuda_available, default_device, get_backend
from convpass.runtime.executor import Executor
from convpass.runtime.model_graph import NodeArg
from convpass.runtime.support import SupportReport, check_support, is_supported, prepare_model

__all__ = [
    "Backend",
    "ConvSummary",
    "CpuBackend",
    "Executor",
    "GraphStatus",
    "ExecutorError",
    "NodeArg",
    "Plan",
    "SupportReport",
    "check_support",
    "cuda_available",
    "default_device",
    "get_backend",
    "is_supported",
    "prepare_model",
    "supported_ops",
]

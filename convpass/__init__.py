"""convpass: measured, ahead-of-time cuDNN convolution tuning for ONNX models.

The public API (docs/python-api.md):

* :func:`optimize` - tune every convolution of a model and return the tuned ``onnx.ModelProto``;
* :func:`inspect` - the decisions a tuned model records, one record per conv, device and profile;
* :class:`Executor` - run a model (tuned or not) with the recorded decisions, on CUDA or the CPU;
* :class:`ConvpassError` - what every one of them raises for bad input, with a one-line message.

``import convpass`` imports nothing else and changes nothing in the interpreter: each name is
loaded at its first use (PEP 562), and only then does convpass prepare the import of onnx-ir
(:func:`convpass.core.deferred_imports.defer_sympy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from convpass.core.errors import ConvpassError
from convpass.core.version import __version__

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from convpass.compiler.optimize import optimize
    from convpass.compiler.pipeline import inspect
    from convpass.runtime.executor import Executor

__all__ = ["ConvpassError", "Executor", "__version__", "inspect", "optimize"]

_LAZY = {
    "optimize": ("convpass.compiler.optimize", "optimize"),
    "inspect": ("convpass.compiler.pipeline", "inspect"),
    "Executor": ("convpass.runtime.executor", "Executor"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'convpass' has no attribute {name!r}")
    import importlib

    from convpass.core.deferred_imports import defer_sympy

    defer_sympy()  # convpass is about to import onnx-ir for its own use
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # once loaded, a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

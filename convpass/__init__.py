"""convpass: measured, ahead-of-time cuDNN convolution tuning for ONNX models.

Public API: :func:`optimize`, :func:`inspect`, :class:`Executor` (see the README).
"""

from __future__ import annotations

from typing import Any

from convpass.core.deferred_imports import defer_sympy

# before anything imports onnx-ir, which imports SymPy for arithmetic convpass never does
defer_sympy()

from convpass.core.version import __version__
__all__ = ["optimize", "inspect", "Executor", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import convpass` stays cheap and never pulls in GPU libraries.
    if name in ("optimize", "inspect"):
        from convpass.compiler import pipeline

        return getattr(pipeline, name)
    if name == "Executor":
        from convpass.runtime.executor import Executor

        return Executor
    raise AttributeError(f"module 'convpass' has no attribute {name!r}")

"""Optional dependencies: which pip extra installs each, and one clear error where one is missing.

    pip install 'convpass[gpu]'      CuPy, cuDNN and its graph-API frontend for CUDA 13
    pip install 'convpass[cuda12]'   the same for CUDA 12
    pip install 'convpass[plot]'     matplotlib (bench --plot)
    pip install 'convpass[fleet]'    Ray (tune --cluster ray)
    pip install onnxruntime          ONNX Runtime CPU (run --compare ort; in convpass[dev])

:func:`require` imports a module or raises :class:`~convpass.core.errors.OptionError` naming the
option that needs it and the command that installs it, so a missing package is never a silent
no-op (a ``--plot`` that writes nothing, say). Call it before the work the option belongs to.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from convpass.core.errors import OptionError

__all__ = ["INSTALL", "require"]

# module -> what installs it
INSTALL = {
    "cupy": "pip install 'convpass[gpu]' (CUDA 13; 'convpass[cuda12]' for CUDA 12)",
    "cudnn": "pip install 'convpass[gpu]' (nvidia-cudnn-frontend)",
    "matplotlib": "pip install 'convpass[plot]'",
    "ray": "pip install 'convpass[fleet]'",
    "onnxruntime": "pip install onnxruntime",
}


def require(module: str, option: str) -> ModuleType:
    """The module ``module``, imported; ``option`` (``--plot``) is what needs it, for the message."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        how = INSTALL.get(module.split(".")[0], f"pip install {module.split('.')[0]}")
        raise OptionError(f"{option} needs {module}, which is not installed here ({e}): {how}") from None

"""The one place the cuda backend turns CUDA C++ source into callable kernels.

Every hand-written kernel family (:mod:`convpass.kernels.normalization`, :mod:`convpass.kernels.pooling`, :mod:`convpass.kernels.tensor_ops`)
declares its code as a :class:`KernelSource` — a name, the source text, and the ``extern "C"``
entry points — and asks :func:`function` for an entry point. Sources are built once per process
through ``cupy.RawModule``, which goes through :mod:`convpass.native.prebuilt`: a binary from the model's kernel
side-car when there is one, else NVRTC, counted in :data:`COMPILATIONS`. Kernels are built when a
plan is compiled, never while a CUDA graph is captured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from typing import Any

import numpy as np

from convpass.native.prebuilt import COMPILATIONS, install

__all__ = ["COMPILATIONS", "DTYPES", "KernelSource", "function", "typed"]

# Compiler options for every source: fast math is off (ONNX semantics: exact exp / division / sqrt).
OPTIONS = ("-std=c++17",)


@dataclasses.dataclass(frozen=True)
class KernelSource:
    """CUDA C++ source with ``extern "C" __global__`` entry points named in ``entries``."""

    name: str
    code: str
    entries: tuple[str, ...]

    @property
    def digest(self) -> str:
        return hashlib.sha1(self.code.encode()).hexdigest()[:16]


# The kernel families are written once over TYPE (storage), LOAD (to float) and STORE (from float);
# each dtype they run on is one instantiation of those tokens, with its header.
_TYPE_TOKENS: dict[np.dtype, dict[str, str]] = {
    np.dtype(np.float32): {"#HEADER": "", "TYPE": "float", "LOAD": "", "STORE": ""},
    np.dtype(np.float16): {"#HEADER": "#include <cuda_fp16.h>", "TYPE": "__half", "LOAD": "__half2float", "STORE": "__float2half_rn"},
}
DTYPES = frozenset(_TYPE_TOKENS)  # the dtypes hand-written kernels run on (float32 math inside)


def typed(family: str, code: str, entries: tuple[str, ...], dtype: Any) -> KernelSource:
    """``code`` (written over TYPE / LOAD / STORE, with a ``#HEADER`` line) for ``dtype``."""
    dtype = np.dtype(dtype)
    for token, text in _TYPE_TOKENS[dtype].items():
        code = code.replace(token, text)
    return KernelSource(f"convpass_{family}_{dtype.name}", code, entries)


_MODULES: dict[tuple[str, str, int], Any] = {}
_LOCK = threading.Lock()


def module(cupy: Any, source: KernelSource) -> Any:
    """The compiled ``cupy.RawModule`` of ``source`` on the current device (built on first use)."""
    device = int(cupy.cuda.runtime.getDevice())
    key = (source.name, source.digest, device)
    mod = _MODULES.get(key)
    if mod is None:
        with _LOCK:
            mod = _MODULES.get(key)
            if mod is None:
                install()
                mod = cupy.RawModule(code=source.code, options=OPTIONS, name_expressions=None)
                mod.compile()
                _MODULES[key] = mod
    return mod


def function(cupy: Any, source: KernelSource, entry: str) -> Any:
    """Entry point ``entry`` of ``source`` as a ``cupy.RawKernel``-like callable."""
    if entry not in source.entries:
        raise KeyError(f"{source.name} has no entry {entry!r} (it has {', '.join(source.entries)})")
    return module(cupy, source).get_function(entry)

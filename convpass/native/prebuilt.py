"""Kernels compiled ahead of time: one seam under CuPy's compiler.

Every kernel a plan compiles at run time — convpass's own families (:mod:`convpass.native.nvrtc`), the
generated element-wise groups (:mod:`convpass.kernels.elementwise`) and the CuPy kernels the op library calls
(copies, reductions, casts) — is built by CuPy through one function,
``cupy.cuda.compiler._compile_module_with_cache`` (CuPy's core looks it up on the module at every
call). :func:`install` wraps it, once per process:

* every call is keyed by :func:`kernel_key` (source, options without include paths, CuPy version);
* a key whose binary for this GPU is loaded (:func:`use`, from a side-car,
  :mod:`convpass.core.kernel_file`) is loaded as it is: ``cuModuleLoadData``, no NVRTC, no CuPy
  kernel cache;
* any other call goes to CuPy as before (NVRTC, or CuPy's kernel cache when it is warm), and is
  counted in :data:`COMPILATIONS`;
* inside :func:`recording`, every kernel's binary is kept (CuPy's cache backend is wrapped to see
  the bytes it loads or stores), and :func:`compile_for` builds the same kernels for other GPU
  architectures, so ``convpass compile`` can write the side-car.

Built cuDNN graph-API plans travel in the same side-car (:func:`record_entry` while recording,
:func:`stored` at start-up; the executor's conv code owns when to use them), for this GPU's
architecture only: cuDNN builds them on the GPU.

A binary that does not load (another driver, a corrupt file) is compiled instead, with a warning:
a side-car can cost start-up time, never a wrong result. CuPy's private compiler API is checked
once; a CuPy without it gets start-up compilation and one warning, not an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from convpass.core.kernel_file import KernelEntry, KernelFile

__all__ = ["COMPILATIONS", "Recorder", "compile_for", "device_arch", "install", "kernel_key", "record_entry", "recording",
           "recording_active", "stored", "use"]

# names of the kernels built at run time in this process (not loaded from a side-car), in order
COMPILATIONS: list[str] = []

_LOCK = threading.RLock()
_STATE: dict[str, Any] = {"installed": None}  # None: not tried; True; or the reason it cannot be
_LOADED: dict[tuple[str, str], KernelEntry] = {}  # (key, arch) -> binary, from every side-car used
_RECORDERS: list[Recorder] = []
_NAME = re.compile(r"__global__\s+void\s+(\w+)\s*\(")


@dataclasses.dataclass
class _Call:
    """One compile call, as CuPy's core made it (kept while recording, to build other archs)."""

    source: str
    options: tuple[str, ...]
    kwargs: dict[str, Any]


class Recorder:
    """The kernels compiled or loaded while :func:`recording` was active."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], KernelEntry] = {}
        self.calls: dict[str, _Call] = {}


def kernel_label(source: str) -> str:
    """A readable name for a kernel source: its first ``__global__`` function."""
    m = _NAME.search(source)
    return m.group(1) if m else f"kernel {hashlib.sha1(source.encode()).hexdigest()[:8]}"


def _digest(text: str) -> str:
    """SHA-256 of ``text``, remembered: CuPy passes the same ``extra_source`` (the content of its
    headers) with every kernel, and hashing it each time was a visible part of a fresh ConvNeXt
    start (a dict finds the same string object by identity, without hashing it again)."""
    digest = _DIGESTS.get(text)
    if digest is None:
        digest = _DIGESTS[text] = hashlib.sha256(text.encode()).hexdigest()
    return digest


_DIGESTS: dict[str, str] = {}


def kernel_key(source: str, options: Sequence[str], kwargs: dict[str, Any], cupy_version: str) -> str:
    """The hash of everything a binary depends on. Include paths (``-I``) are install locations:
    they are left out, and the content of CuPy's headers is in ``extra_source``."""
    doc = {
        "cupy": cupy_version,
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "options": [o for o in options if not str(o).startswith("-I")],
        "extra": _digest(str(kwargs.get("extra_source") or "")),
        "backend": kwargs.get("backend", "nvrtc"),
        "cooperative": bool(kwargs.get("enable_cooperative_groups")),
        "names": sorted(kwargs.get("name_expressions") or ()),
        "jitify": bool(kwargs.get("jitify")),
        "ltoir": bool(kwargs.get("to_ltoir")),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def install() -> str | None:
    """Put the seam under CuPy's compiler (idempotent); returns why it cannot be, or None."""
    with _LOCK:
        if _STATE["installed"] is None:
            _STATE["installed"] = _install()
        state = _STATE["installed"]
    return None if state is True else state


def _install() -> bool | str:
    try:
        import cupy
        from cupy.cuda import compiler, function
    except ImportError as e:
        return f"CuPy is not importable ({e})"
    original = getattr(compiler, "_compile_module_with_cache", None)
    if original is None or not hasattr(compiler, "_kernel_cache_backend") or not hasattr(function, "Module"):
        return f"CuPy {cupy.__version__} has no _compile_module_with_cache / _kernel_cache_backend (convpass knows CuPy 14)"
    version = cupy.__version__

    def compile_module(source: str, options: tuple[str, ...] = (), *args: Any, **kwargs: Any) -> Any:
        if args:  # a call shape this seam does not know: compiled as CuPy would, and counted
            COMPILATIONS.append(kernel_label(source))
            return original(source, options, *args, **kwargs)
        arch = str(kwargs.get("arch") or device_arch())
        key = kernel_key(source, options, kwargs, version)
        entry = _LOADED.get((key, arch))
        if entry is not None:
            loaded = _load(function, compiler, entry, kwargs)
            if loaded is not None:
                _record(key, arch, entry, source, options, kwargs)
                return loaded
        COMPILATIONS.append(kernel_label(source))
        with _capture(compiler) as seen:
            result = original(source, options, **kwargs)
        if seen:
            _record(key, arch, KernelEntry(key, arch, kernel_label(source), seen[-1]), source, options, kwargs)
        return result

    compiler._compile_module_with_cache = compile_module
    _STATE["original"] = original
    return True


def device_arch() -> str:
    """The current GPU's architecture as CuPy names it (compute capability digits, e.g. ``"90"``)."""
    from cupy.cuda import device

    return str(device.Device().compute_capability)


def _load(function: Any, compiler: Any, entry: KernelEntry, kwargs: dict[str, Any]) -> Any:
    """The module of ``entry``'s binary, or None (warned) when it does not load."""
    try:
        if kwargs.get("to_ltoir"):
            return entry.payload
        mod = function.Module()
        names = kwargs.get("name_expressions")
        if names:
            decoded = compiler._decode_cache_payload(entry.payload, len(names))
            if decoded is None:
                raise ValueError("the stored binary carries no name mapping")
            mangled, cubin = decoded
            mod.load(cubin)
            mod._set_mapping(dict(zip(sorted(names), mangled)))
        else:
            mod.load(entry.payload)
        return mod
    except Exception as e:  # noqa: BLE001  (a driver that refuses the image: compile instead)
        warnings.warn(f"convpass: the prebuilt kernel {entry.name} (sm_{entry.arch}) did not load ({e}); it is compiled now", stacklevel=2)
        return None


@contextlib.contextmanager
def _capture(compiler: Any, always: bool = False) -> Iterator[list[bytes]]:
    """While recording (or ``always``): wrap CuPy's kernel-cache backend to see the binary it
    loads or stores."""
    if not (_RECORDERS or always):
        yield []
        return
    seen: list[bytes] = []
    inner = compiler._kernel_cache_backend

    class Seeing:
        def load(self, name: str) -> Any:
            payload = inner.load(name)
            if payload is not None:
                seen.append(payload)
            return payload

        def save(self, name: str, payload: bytes, source: Any = None) -> Any:
            seen.append(payload)
            return inner.save(name, payload, source)

        def __getattr__(self, attr: str) -> Any:
            return getattr(inner, attr)

    with _LOCK:
        compiler._kernel_cache_backend = Seeing()
        try:
            yield seen
        finally:
            compiler._kernel_cache_backend = inner


def _record(key: str, arch: str, entry: KernelEntry, source: str, options: tuple[str, ...], kwargs: dict[str, Any]) -> None:
    for r in _RECORDERS:
        r.entries[(key, arch)] = entry
        r.calls.setdefault(key, _Call(source, tuple(options), dict(kwargs)))


def stored(key: str) -> KernelEntry | None:
    """The entry ``key`` (e.g. a stored cuDNN plan, :mod:`convpass.native.cudnn.graph_api`) of this GPU's
    architecture among the side-cars in use, or None."""
    with _LOCK:
        return _LOADED.get((key, device_arch()))


def record_entry(key: str, name: str, payload: bytes) -> None:
    """Keep a binary that is not a CuPy kernel (a built cuDNN plan) for this GPU's architecture in
    every active :func:`recording`."""
    with _LOCK:
        if _RECORDERS:
            arch = device_arch()
            for r in _RECORDERS:
                r.entries[(key, arch)] = KernelEntry(key, arch, name, payload)


def recording_active() -> bool:
    return bool(_RECORDERS)


def use(kernels: KernelFile) -> None:
    """Make the binaries of a side-car available to every later compile call in this process."""
    with _LOCK:
        _LOADED.update(kernels.entries)


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Keep the binary of every kernel compiled or loaded inside the block."""
    reason = install()
    if reason is not None:
        raise RuntimeError(f"cannot record kernels: {reason}")
    r = Recorder()
    with _LOCK:
        _RECORDERS.append(r)
    try:
        yield r
    finally:
        with _LOCK:
            _RECORDERS.remove(r)


def compile_for(recorder: Recorder, archs: Sequence[str]) -> list[str]:
    """Compile every recorded kernel for each of ``archs`` too (NVRTC needs no GPU of that
    architecture); the binaries go into ``recorder``. Returns the kernels that failed, with why."""
    from cupy.cuda import compiler

    original = _STATE["original"]
    failed = []
    for arch in archs:
        for key, call in list(recorder.calls.items()):
            if (key, arch) in recorder.entries:
                continue
            kwargs = {**call.kwargs, "arch": arch}
            with _capture(compiler, always=True) as seen:
                try:
                    original(call.source, call.options, **kwargs)
                except Exception as e:  # noqa: BLE001
                    # loading a binary of another architecture on this GPU fails after it was built
                    if not seen:
                        failed.append(f"{kernel_label(call.source)} for sm_{arch}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            if seen:
                recorder.entries[(key, arch)] = KernelEntry(key, arch, kernel_label(call.source), seen[-1])
    return failed

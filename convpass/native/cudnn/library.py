"""Finding and loading ``libcudnn.so.9``, and calling into it through ctypes.

Discovery order (the first that loads, and reports cuDNN 9 or later, wins):

1. ``$CONVPASS_CUDNN_LIBRARY``: an explicit path to ``libcudnn.so.9`` (or to the folder holding it).
2. The ``nvidia-cudnn-cu13`` / ``nvidia-cudnn-cu12`` wheel: ``nvidia/cudnn/lib/libcudnn.so.9``,
   found through ``importlib`` (``nvidia.cudnn``) and a scan of ``sys.path`` / site-packages. CuPy
   is not imported.
3. The system's: ``ctypes.util.find_library("cudnn")``, then ``libcudnn.so.9`` by soname.

cuDNN 9 ships as a thin "shim" ``libcudnn.so.9`` that dlopens its sub-libraries
(``libcudnn_graph``, ``_ops``, ``_cnn``, ``_engines_*``, ...) by soname at first use. When another
cuDNN 9 is registered with the system loader (a system cuDNN 9 of another minor version beside
the wheel's), that lookup can pick the wrong copy and fail with
``CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED`` / ``..._VERSION_MISMATCH``. So when the shim is loaded
from a folder, its sub-libraries found in that same folder are preloaded first (``RTLD_GLOBAL``,
dependencies first): a later dlopen by soname then reuses them. A sub-library that fails to preload
is recorded in :func:`diagnostics` and left to cuDNN's own lazy loading.

The library is loaded once per process, under a lock. :func:`call` is the checked way to call any
cuDNN function: it raises :class:`~convpass.core.cudnn_enums.CudnnError` naming the call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import site
import sys
import threading
import warnings
from ctypes import POINTER, c_char_p, c_double, c_int, c_size_t, c_void_p
from pathlib import Path

from convpass.core.cudnn_enums import SUCCESS, CudnnError, CudnnNotFound

ENV_VAR = "CONVPASS_CUDNN_LIBRARY"
SONAME = "libcudnn.so.9"
MIN_VERSION = 90000

# Preload order: every library after its cuDNN dependencies.
SUBLIBRARIES = (
    "libcudnn_graph.so.9",
    "libcudnn_engines_precompiled.so.9",
    "libcudnn_engines_runtime_compiled.so.9",
    "libcudnn_heuristic.so.9",
    "libcudnn_ops.so.9",
    "libcudnn_cnn.so.9",
    "libcudnn_adv.so.9",
)

_FIX = (
    "Fix: pip install 'convpass[gpu]' (installs nvidia-cudnn-cu13; 'convpass[cuda12]' for CUDA 12), "
    f"or set {ENV_VAR} to the full path of libcudnn.so.9."
)

_lock = threading.Lock()
_state: _Loaded | None = None


class _Loaded:
    def __init__(self, cdll: ctypes.CDLL, path: str, source: str, notes: list[str]) -> None:
        self.cdll = cdll
        self.path = path
        self.source = source
        self.notes = notes
        self.functions: dict[str, object] = {}


# ---------------------------------------------------------------------------------------------
# discovery
# ---------------------------------------------------------------------------------------------


def _wheel_dirs() -> list[Path]:
    """Existing folders where an nvidia-cudnn-cu13 / -cu12 wheel keeps libcudnn.so.9."""
    dirs: list[Path] = []
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or ():
            dirs.append(Path(loc) / "lib")
    roots: list[str] = list(sys.path)
    try:
        roots += site.getsitepackages()
    except AttributeError:  # some virtualenv builds lack it
        pass
    try:
        roots.append(site.getusersitepackages())
    except AttributeError:
        pass
    for root in roots:
        if root:
            dirs.append(Path(root) / "nvidia" / "cudnn" / "lib")
    seen: set[str] = set()
    out = []
    for d in dirs:
        key = os.path.realpath(str(d))
        if key not in seen and d.is_dir():
            seen.add(key)
            out.append(d)
    return out


def _find_system_library() -> str | None:
    return ctypes.util.find_library("cudnn")


def candidates() -> list[tuple[str, str, bool]]:
    """Where :func:`load` looks, in order: ``(description, path or soname, is_file_path)``."""
    out: list[tuple[str, str, bool]] = []
    env = os.environ.get(ENV_VAR)
    if env:
        p = Path(env).expanduser()
        if p.is_dir():
            p = p / SONAME
        out.append((f"${ENV_VAR}", str(p), True))
    wheel = "nvidia-cudnn-cu13/-cu12 wheel"
    dirs = _wheel_dirs()
    for d in dirs:
        out.append((wheel, str(d / SONAME), True))
    if not dirs:
        out.append((f"{wheel} (nvidia/cudnn/lib via importlib, sys.path and site-packages)", "", False))
    found = _find_system_library()
    out.append(("system: ctypes.util.find_library('cudnn')", found or "", False))
    out.append(("system loader (soname)", SONAME, False))
    return out


def _dlopen(path: str, mode: int) -> ctypes.CDLL:
    return ctypes.CDLL(path, mode=mode)


def _preload_sublibraries(folder: Path, notes: list[str]) -> None:
    if os.environ.get("CONVPASS_CUDNN_NO_PRELOAD"):
        notes.append("sub-library preload disabled by CONVPASS_CUDNN_NO_PRELOAD")
        return
    for name in SUBLIBRARIES:
        p = folder / name
        if not p.exists():
            notes.append(f"preload {name}: not in {folder}")
            continue
        try:
            _dlopen(str(p), ctypes.RTLD_GLOBAL)
            notes.append(f"preload {name}: ok")
        except OSError as e:
            notes.append(f"preload {name}: failed ({e})")


def _try(path: str, is_file: bool) -> tuple[ctypes.CDLL | None, str, list[str]]:
    """Load one candidate; returns (cdll or None, why not, notes)."""
    notes: list[str] = []
    if not path:
        return None, "nothing found", notes
    if is_file and not Path(path).is_file():
        return None, "file does not exist", notes
    if is_file:
        _preload_sublibraries(Path(path).parent, notes)
    try:
        cdll = _dlopen(path, ctypes.RTLD_GLOBAL)
    except OSError as e:
        return None, f"dlopen failed: {e}", notes
    try:
        fn = cdll.cudnnGetVersion
        fn.restype, fn.argtypes = c_size_t, []
        ver = int(fn())
    except (AttributeError, OSError) as e:
        return None, f"loaded, but cudnnGetVersion is unusable: {e}", notes
    if ver < MIN_VERSION:
        return None, f"loaded, but it is cuDNN {ver}; convpass needs cuDNN 9", notes
    return cdll, "", notes


def load() -> ctypes.CDLL:
    """The loaded cuDNN library (loaded once, thread-safe). Raises :class:`CudnnNotFound`."""
    return _load().cdll


def _load() -> _Loaded:
    global _state
    st = _state
    if st is not None:
        return st
    with _lock:
        if _state is not None:
            return _state
        tried: list[str] = []
        for source, path, is_file in candidates():
            cdll, why, notes = _try(path, is_file)
            if cdll is not None:
                if tried and os.environ.get(ENV_VAR):
                    warnings.warn(
                        f"{ENV_VAR} is set but could not be loaded; using {path} instead:\n" + "\n".join(tried),
                        RuntimeWarning,
                        stacklevel=3,
                    )
                if not is_file:
                    # Resolve the real file for path() when the loader found it by name.
                    path = _resolved_path(cdll) or path
                _state = _Loaded(cdll, path, source, notes)
                return _state
            shown = path or "(none)"
            tried.append(f"  - {source}: {shown}: {why}")
        raise CudnnNotFound(
            "cuDNN 9 (libcudnn.so.9) could not be loaded. Searched, in order:\n" + "\n".join(tried) + "\n" + _FIX
        )


def _resolved_path(cdll: ctypes.CDLL) -> str | None:
    """The file the dynamic loader picked for a library loaded by name (Linux, via dladdr)."""
    try:

        class _DlInfo(ctypes.Structure):
            _fields_ = [("dli_fname", c_char_p), ("dli_fbase", c_void_p), ("dli_sname", c_char_p), ("dli_saddr", c_void_p)]

        libdl = ctypes.CDLL(None)
        dladdr = libdl.dladdr
        dladdr.argtypes = [c_void_p, POINTER(_DlInfo)]
        dladdr.restype = c_int
        info = _DlInfo()
        addr = ctypes.cast(cdll.cudnnGetVersion, c_void_p)
        if dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except Exception:  # noqa: BLE001  (only used for display)
        return None
    return None


def path() -> str:
    """Path of the loaded libcudnn.so.9 (loads it if needed)."""
    return _load().path


def source() -> str:
    """Which discovery step found the library (e.g. ``"nvidia-cudnn-cu13/-cu12 wheel"``)."""
    return _load().source


def diagnostics() -> list[str]:
    """What loading did besides the shim (sub-library preloads and their outcome)."""
    return list(_load().notes)


def version() -> int:
    """``cudnnGetVersion()``, e.g. 91900 for cuDNN 9.19.0."""
    return int(function("cudnnGetVersion")())


def _reset_for_tests() -> None:
    global _state
    with _lock:
        _state = None


# ---------------------------------------------------------------------------------------------
# prototypes and checked calls
# ---------------------------------------------------------------------------------------------

_P = c_void_p  # handles, descriptors, device pointers, host pointers to scalars
_I = c_int
_IP = POINTER(c_int)
_SP = POINTER(c_size_t)

# name -> (restype, argtypes). Enums are C ints; every pointer is a void*.
PROTOTYPES: dict[str, tuple[object, list[object]]] = {
    "cudnnGetVersion": (c_size_t, []),
    "cudnnGetErrorString": (c_char_p, [_I]),
    "cudnnGetLastErrorString": (None, [c_char_p, c_size_t]),
    "cudnnCreate": (_I, [POINTER(c_void_p)]),
    "cudnnDestroy": (_I, [_P]),
    "cudnnSetStream": (_I, [_P, _P]),
    "cudnnGetStream": (_I, [_P, POINTER(c_void_p)]),
    # tensors / filters
    "cudnnCreateTensorDescriptor": (_I, [POINTER(c_void_p)]),
    "cudnnDestroyTensorDescriptor": (_I, [_P]),
    "cudnnSetTensorNdDescriptor": (_I, [_P, _I, _I, _IP, _IP]),
    "cudnnSetTensorNdDescriptorEx": (_I, [_P, _I, _I, _I, _IP]),
    "cudnnCreateFilterDescriptor": (_I, [POINTER(c_void_p)]),
    "cudnnDestroyFilterDescriptor": (_I, [_P]),
    "cudnnSetFilterNdDescriptor": (_I, [_P, _I, _I, _I, _IP]),
    # convolution descriptor
    "cudnnCreateConvolutionDescriptor": (_I, [POINTER(c_void_p)]),
    "cudnnDestroyConvolutionDescriptor": (_I, [_P]),
    "cudnnSetConvolutionNdDescriptor": (_I, [_P, _I, _IP, _IP, _IP, _I, _I]),
    "cudnnSetConvolutionGroupCount": (_I, [_P, _I]),
    "cudnnSetConvolutionMathType": (_I, [_P, _I]),
    "cudnnGetConvolutionMathType": (_I, [_P, _IP]),
    "cudnnGetConvolutionNdForwardOutputDim": (_I, [_P, _P, _P, _I, _IP]),
    # pooling
    "cudnnCreatePoolingDescriptor": (_I, [POINTER(c_void_p)]),
    "cudnnDestroyPoolingDescriptor": (_I, [_P]),
    "cudnnSetPoolingNdDescriptor": (_I, [_P, _I, _I, _I, _IP, _IP, _IP]),
    "cudnnGetPoolingNdForwardOutputDim": (_I, [_P, _P, _I, _IP]),
    "cudnnPoolingForward": (_I, [_P, _P, _P, _P, _P, _P, _P, _P]),
    # softmax, batch normalization (the library baselines of the cuda backend's row-wise kernels)
    "cudnnSoftmaxForward": (_I, [_P, _I, _I, _P, _P, _P, _P, _P, _P]),
    "cudnnBatchNormalizationForwardTraining": (
        _I,
        [_P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, c_double, _P, _P, c_double, _P, _P],
    ),
    # activation
    "cudnnCreateActivationDescriptor": (_I, [POINTER(c_void_p)]),
    "cudnnDestroyActivationDescriptor": (_I, [_P]),
    "cudnnSetActivationDescriptor": (_I, [_P, _I, _I, c_double]),
    # algorithm counts, heuristics, search, workspace
    "cudnnGetConvolutionForwardAlgorithmMaxCount": (_I, [_P, _IP]),
    "cudnnGetConvolutionBackwardDataAlgorithmMaxCount": (_I, [_P, _IP]),
    "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount": (_I, [_P, _IP]),
    "cudnnGetConvolutionForwardAlgorithm_v7": (_I, [_P, _P, _P, _P, _P, _I, _IP, _P]),
    "cudnnGetConvolutionBackwardDataAlgorithm_v7": (_I, [_P, _P, _P, _P, _P, _I, _IP, _P]),
    "cudnnGetConvolutionBackwardFilterAlgorithm_v7": (_I, [_P, _P, _P, _P, _P, _I, _IP, _P]),
    "cudnnFindConvolutionForwardAlgorithmEx": (_I, [_P, _P, _P, _P, _P, _P, _P, _P, _I, _IP, _P, _P, c_size_t]),
    "cudnnFindConvolutionBackwardDataAlgorithmEx": (_I, [_P, _P, _P, _P, _P, _P, _P, _P, _I, _IP, _P, _P, c_size_t]),
    "cudnnFindConvolutionBackwardFilterAlgorithmEx": (_I, [_P, _P, _P, _P, _P, _P, _P, _P, _I, _IP, _P, _P, c_size_t]),
    "cudnnGetConvolutionForwardWorkspaceSize": (_I, [_P, _P, _P, _P, _P, _I, _SP]),
    "cudnnGetConvolutionBackwardDataWorkspaceSize": (_I, [_P, _P, _P, _P, _P, _I, _SP]),
    "cudnnGetConvolutionBackwardFilterWorkspaceSize": (_I, [_P, _P, _P, _P, _P, _I, _SP]),
    # execution
    "cudnnConvolutionForward": (_I, [_P, _P, _P, _P, _P, _P, _P, _I, _P, c_size_t, _P, _P, _P]),
    "cudnnConvolutionBackwardData": (_I, [_P, _P, _P, _P, _P, _P, _P, _I, _P, c_size_t, _P, _P, _P]),
    "cudnnConvolutionBackwardFilter": (_I, [_P, _P, _P, _P, _P, _P, _P, _I, _P, c_size_t, _P, _P, _P]),
    "cudnnConvolutionBiasActivationForward": (
        _I,
        [_P, _P, _P, _P, _P, _P, _P, _I, _P, c_size_t, _P, _P, _P, _P, _P, _P, _P, _P],
    ),
}


def function(name: str):
    """The prototyped ctypes function ``name`` of the loaded library (cached)."""
    st = _load()
    fn = st.functions.get(name)
    if fn is None:
        restype, argtypes = PROTOTYPES[name]
        fn = getattr(st.cdll, name)
        fn.restype = restype
        fn.argtypes = argtypes
        st.functions[name] = fn
    return fn


def last_error_string() -> str:
    """cuDNN's ``cudnnGetLastErrorString`` (cuDNN 9), or ``""`` when unavailable."""
    try:
        buf = ctypes.create_string_buffer(1024)
        function("cudnnGetLastErrorString")(buf, 1024)
        return buf.value.decode(errors="replace").strip()
    except Exception:  # noqa: BLE001
        return ""


def check(status: int, call: str) -> None:
    """Raise :class:`CudnnError` for a failed status."""
    if status != SUCCESS:
        raise CudnnError(status, call, last_error_string())


def call(name: str, *args) -> None:
    """Call cuDNN function ``name`` and raise :class:`CudnnError` (naming it) on failure."""
    status = function(name)(*args)
    if status != SUCCESS:
        raise CudnnError(status, name, last_error_string())


__all__ = [
    "ENV_VAR",
    "SONAME",
    "CudnnError",
    "CudnnNotFound",
    "call",
    "candidates",
    "check",
    "diagnostics",
    "function",
    "load",
    "path",
    "source",
    "version",
]

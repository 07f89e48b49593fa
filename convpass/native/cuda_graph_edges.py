"""A captured CUDA graph's programmatic edges made default ones, through the CUDA driver API.

A kernel launched with programmatic dependent launch may start before the kernel it depends on
has finished (only its own ``griddepcontrol.wait`` holds it back); stream capture records such a
dependency as a *programmatic* edge (``CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC``, or a default edge
from a kernel's programmatic or launch-order port). A default edge makes the dependent node wait
for the whole producer. :func:`default_edges` rewrites every edge that is not default in an
uninstantiated graph (a clone of the one CuPy captured: CuPy's own is left as it is) and
:class:`DefaultEdgeGraph` is that clone instantiated and launched in place of CuPy's.

The functions come from ``libcuda.so.1`` through ``ctypes`` (CuPy binds none of them):
``cuGraphGetEdges_v2``, ``cuGraphRemoveDependencies_v2`` and ``cuGraphAddDependencies_v2`` came with
CUDA 12.3; an older driver lacks them and :func:`unavailable_reason` says so. Importing this
module loads nothing.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any, NamedTuple

__all__ = [
    "REQUIRED", "DefaultEdgeGraph", "Driver", "DriverError", "Edge", "EdgeData", "EdgesUnavailable", "default_edges", "disable",
    "driver", "graph_edges", "is_default", "rewritten", "unavailable_reason",
]

# what a graph's copy with default edges needs from the driver
REQUIRED = ("cuGraphGetEdges_v2", "cuGraphClone", "cuGraphRemoveDependencies_v2", "cuGraphAddDependencies_v2",
            "cuGraphInstantiateWithFlags", "cuGraphLaunch", "cuGraphExecDestroy", "cuGraphDestroy")


class EdgesUnavailable(Exception):
    """The driver or one of its functions is not to be had."""


class DriverError(Exception):
    """A driver call returned a status other than ``CUDA_SUCCESS``; the message names the function."""


class EdgeData(ctypes.Structure):
    """``CUgraphEdgeData`` (8 bytes): all zero is a default edge."""

    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


class Edge(NamedTuple):
    """One edge: its nodes' handles and its data."""

    a: int
    b: int
    type: int
    from_port: int
    to_port: int


def is_default(e: Any) -> bool:
    return e.type == 0 and e.from_port == 0 and e.to_port == 0


class Driver:
    """libcuda's functions by name: ``drv(("cuX_v2", "cuX"), *args)`` calls the first one the
    library has (:class:`EdgesUnavailable` where none), :class:`DriverError` on a failed status."""

    def __init__(self, lib: Any = None) -> None:
        if lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise EdgesUnavailable(f"libcuda.so.1: {e}") from None
        self.lib = lib

    def has(self, name: str) -> bool:
        return getattr(self.lib, name, None) is not None

    def function(self, name: str) -> Any:
        """The function ``name``, returning ``CUresult``."""
        if not self.has(name):
            raise EdgesUnavailable(f"libcuda.so.1 has no {name}")
        fn = getattr(self.lib, name)
        fn.restype = ctypes.c_int
        return fn

    def __call__(self, names: tuple[str, ...], *args: Any) -> None:
        name = next((n for n in names if self.has(n)), None)
        if name is None:
            raise EdgesUnavailable(f"libcuda.so.1 has no {' or '.join(names)}")
        self.check(name, self.function(name)(*args))

    def check(self, name: str, status: int) -> None:
        if status:
            raise DriverError(f"{name}: {self.error_name(status)}")

    def error_name(self, status: int) -> str:
        text = ctypes.c_char_p()
        if self.has("cuGetErrorName"):
            self.lib.cuGetErrorName(ctypes.c_int(status), ctypes.byref(text))
        return f"{text.value.decode() if text.value else 'CUresult'} ({status})"


def _load() -> Driver:
    return Driver()


_lock = threading.Lock()
_cache: dict[str, Any] = {}  # "driver": the Driver; "why": why none is to be used (None: usable)


def _probe() -> None:
    with _lock:
        if "why" in _cache:
            return
        try:
            drv = _load()
            missing = [n for n in REQUIRED if not drv.has(n)]
            if missing:
                raise EdgesUnavailable(f"libcuda.so.1 has no {', '.join(missing)} (a driver older than CUDA 12.3)")
            _cache["driver"], _cache["why"] = drv, None
        except EdgesUnavailable as e:
            _cache["driver"], _cache["why"] = None, str(e)


def unavailable_reason() -> str | None:
    """Why this process cannot make a graph's edges default (the driver, a missing function, or
    an earlier failure: :func:`disable`), or None. Asked once, then cached."""
    if "why" not in _cache:
        _probe()
    return _cache["why"]


def driver() -> Driver:
    """The driver, every function of :data:`REQUIRED` present (:class:`EdgesUnavailable` otherwise)."""
    why = unavailable_reason()
    if why is not None:
        raise EdgesUnavailable(why)
    return _cache["driver"]


def disable(reason: str) -> None:
    """No more rewrites in this process (a call failed): :func:`unavailable_reason` is ``reason`` from now on."""
    _probe()
    with _lock:
        _cache["driver"], _cache["why"] = None, reason


def graph_edges(drv: Driver, graph: int) -> list[Edge]:
    """The edges of ``graph`` (a ``CUgraph``) with their data (``cuGraphGetEdges_v2``)."""
    g, count = ctypes.c_void_p(graph), ctypes.c_size_t(0)
    drv(("cuGraphGetEdges_v2",), g, None, None, None, ctypes.byref(count))
    n = count.value
    if not n:  # asked for no edges with arrays given, the driver answers CUDA_ERROR_INVALID_VALUE
        return []
    frm, to, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (EdgeData * n)()
    drv(("cuGraphGetEdges_v2",), g, frm, to, data, ctypes.byref(count))
    return [Edge(frm[i] or 0, to[i] or 0, data[i].type, data[i].from_port, data[i].to_port) for i in range(min(count.value, n))]


def default_edges(graph: int, drv: Driver | None = None) -> int:
    """Every edge of ``graph`` (uninstantiated: a clone, never a graph whose executable is in use)
    that is not a default edge removed and added back as a default one, between the same nodes;
    returns how many. Default edges are left as they are."""
    drv = driver() if drv is None else drv
    odd = [e for e in graph_edges(drv, graph) if not is_default(e)]
    if not odd:
        return 0
    n, g = len(odd), ctypes.c_void_p(graph)
    frm, to = (ctypes.c_void_p * n)(*[e.a for e in odd]), (ctypes.c_void_p * n)(*[e.b for e in odd])
    data = (EdgeData * n)(*[EdgeData(e.from_port, e.to_port, e.type) for e in odd])
    drv(("cuGraphRemoveDependencies_v2",), g, frm, to, data, ctypes.c_size_t(n))
    drv(("cuGraphAddDependencies_v2",), g, frm, to, None, ctypes.c_size_t(n))  # no edge data: default edges
    return n


def _destroy(drv: Driver, clone: int, exec_: int) -> None:
    """Free a clone and its executable (each where made); at interpreter exit, errors are moot."""
    try:
        if exec_:
            drv(("cuGraphExecDestroy",), ctypes.c_void_p(exec_))
        if clone:
            drv(("cuGraphDestroy",), ctypes.c_void_p(clone))
    except (DriverError, EdgesUnavailable):
        pass


class DefaultEdgeGraph:
    """A clone of a captured graph whose programmatic edges were made default, instantiated: it
    launches in place of ``source`` (CuPy's :class:`cupy.cuda.graph.Graph`, kept alive: it owns the
    graph as captured, whose handle :attr:`graph` still gives). The clone and its executable are
    freed by :meth:`close`, or when this object is collected."""

    def __init__(self, drv: Driver, source: Any, clone: int, exec_: int, rewritten: int) -> None:
        self.source, self.clone, self.exec, self.rewritten = source, clone, exec_, rewritten
        self._launch = drv.function("cuGraphLaunch")
        self._upload = drv.function("cuGraphUpload") if drv.has("cuGraphUpload") else None
        self._drv = drv
        self._free = weakref.finalize(self, _destroy, drv, clone, exec_)
        self._free.atexit = False  # at exit the driver may be gone; the process's end frees them

    @property
    def graph(self) -> int:
        """The graph as captured (CuPy's ``cudaGraph_t``)."""
        return int(getattr(self.source, "graph", 0) or 0)

    def launch(self, stream: Any = None) -> None:
        """Launch on ``stream`` (a CuPy stream; None: CuPy's current one)."""
        self._drv.check("cuGraphLaunch", self._launch(ctypes.c_void_p(self.exec), ctypes.c_void_p(_stream_ptr(stream))))

    def upload(self, stream: Any = None) -> None:
        if self._upload is not None:
            self._drv.check("cuGraphUpload", self._upload(ctypes.c_void_p(self.exec), ctypes.c_void_p(_stream_ptr(stream))))

    def close(self) -> None:
        self._free()


def _stream_ptr(stream: Any) -> int:
    if stream is None:
        import cupy

        stream = cupy.cuda.get_current_stream()
    return int(stream.ptr)


def rewritten(source: Any) -> DefaultEdgeGraph | None:
    """``source`` (a CuPy graph, its handle in ``.graph``) cloned, the clone's programmatic edges
    made default and the clone instantiated; None where the graph has no such edge (CuPy's
    executable is the one to launch). Raises :class:`EdgesUnavailable` where the driver or the
    graph's handle is not to be had, :class:`DriverError` where a call fails (nothing is left
    allocated)."""
    drv = driver()
    handle = int(getattr(source, "graph", 0) or 0)
    if not handle:
        raise EdgesUnavailable("the captured graph's handle is not to be had (CuPy's Graph has no .graph)")
    if all(is_default(e) for e in graph_edges(drv, handle)):
        return None
    clone, exec_ = ctypes.c_void_p(), ctypes.c_void_p()
    try:
        drv(("cuGraphClone",), ctypes.byref(clone), ctypes.c_void_p(handle))
        n = default_edges(int(clone.value or 0), drv)
        drv(("cuGraphInstantiateWithFlags",), ctypes.byref(exec_), clone, ctypes.c_ulonglong(0))
    except BaseException:
        _destroy(drv, int(clone.value or 0), int(exec_.value or 0))
        raise
    return DefaultEdgeGraph(drv, source, int(clone.value or 0), int(exec_.value or 0), n)

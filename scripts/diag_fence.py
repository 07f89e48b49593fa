"""The stream fence before fused graph-API engine launches: which launches need it, and what one
costs. The fence part of scripts/diag_engine_epilogue.py (not part of the package).

The product fences every fused engine launch (``convpass.kernels.conv_exec.fence_needed``: a
16-byte memset on the stream before the launch, so that in a captured graph the launch cannot
overlap the end of its producer). Here that predicate is replaced by a narrower *scope* for one
model run at a time (the bench's condition: side-car plans, one captured graph), and each captured
fused launch is recorded with what ran right before it:

=================  ==================================================================
scope              fences the fused launches ...
=================  ==================================================================
``none``           none (the control: wrong where the fence is needed at all)
``residual``       of graphs that read a residual ``z`` (``EngineConv.residual``)
``eng4``           of engine 4's configurations (``eng4``, ``eng4_k24=2``, not ``eng45``)
``eng4+residual``  of engine 4's graphs that read a residual
``after-cudnn``    right after a cuDNN conv call (see :class:`FenceScope`)
``every-fused``    all of them (the product's default)
=================  ==================================================================

The smallest right scope is the right one (every run's error within the bench's tolerance, the
plan one captured graph) with the fewest fences in the graph (:func:`scope_verdict`).

The fence's cost (:func:`fence_cost`): CUDA graphs of ``n`` fences against an empty graph, and of
``n`` no-op kernels with and without a fence before each; the same kernels launched eagerly.

What the fence replaces (:func:`edges_check`, with scope ``none``): the captured graph's edges by
kind through the CUDA driver API (programmatic edges, which let a kernel start before its producer
has finished, are what the fence is thought to break), and the graph with each of them made a
default edge replayed against the reference. One concept, the fence, makes this module longer
than 600 lines.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

TOL_MODEL = 5e-3  # the bench's tolerance with TF32 (relative, normwise)
START, LEGACY, ENGINE, OTHER = "start", "cudnn legacy", "cudnn engine", "other"


def log(*parts: Any) -> None:
    print("DIAG", *parts, flush=True)


def _cp() -> Any:
    import cupy

    return cupy


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


# ---------------------------------------------------------------------------------------------
# scopes


def engine_id(conv: Any) -> int | None:
    """The cuDNN engine id of an engine conv's configuration (``engine:eng4_k24=2+bias+add+relu``: 4)."""
    from convpass.native.cudnn import graph_api

    try:
        return graph_api.EngineConfig.parse(str(conv.algo)).engine_id
    except ValueError:
        return None


# name -> whether a fused launch of ``conv`` coming right after ``after`` (a kind of FenceScope) is fenced
SCOPES: dict[str, Callable[[Any, str], bool]] = {
    "none": lambda conv, after: False,
    "residual": lambda conv, after: bool(conv.residual),
    "eng4": lambda conv, after: engine_id(conv) == 4,
    "eng4+residual": lambda conv, after: engine_id(conv) == 4 and bool(conv.residual),
    "after-cudnn": lambda conv, after: after in (LEGACY, ENGINE),
    "every-fused": lambda conv, after: True,
}
CONTROL, DEFAULT = "none", "every-fused"


def last_kernel(conv: Any) -> str:
    """What a conv's launch enqueued last: its cuDNN call (legacy or graph API) where no epilogue
    pass runs after it, else :data:`OTHER` (convpass's own kernels too)."""
    from convpass.kernels.conv_exec import EngineConv, FusedLegacyConv, LegacyConv

    if isinstance(conv, FusedLegacyConv):
        return LEGACY
    if isinstance(conv, LegacyConv):
        return OTHER if conv.epilogue else LEGACY
    if isinstance(conv, EngineConv):
        return ENGINE if conv.fused or not conv.epilogue else OTHER
    return OTHER


def _ptr(a: Any) -> Any:
    return getattr(getattr(a, "data", None), "ptr", None)


class FenceScope:
    """``conv_exec.fence_needed`` replaced by scope ``name`` (fused launches only, as the product),
    each fused launch made while a stream captures recorded: its node, configuration, what came
    right before it and whether it was fenced (the last capture's, restarted when a capture begins
    at the plan's first launch).

    What came before (``last``): :data:`START` (the first launch of a run or of a graph),
    :data:`LEGACY` / :data:`ENGINE` (a conv whose launch ended in that cuDNN call), :data:`OTHER`
    (anything else the plan enqueued: an epilogue pass, a layout, padding or slice copy inside a
    conv's launch, any launch that is no conv; cuDNN's softmax, instance norm and 3-D pooling are
    counted here)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.test = SCOPES[name]
        self.last = START
        self.node: str | None = None
        self.captured: list[dict[str, Any]] = []
        self.capturing: Callable[[], bool] = lambda: bool(_cp().cuda.get_current_stream().is_capturing())

    def needed(self, conv: Any) -> bool:
        """The predicate put in place of ``fence_needed``."""
        on = bool(conv.fused) and bool(self.test(conv, self.last))
        if conv.fused and self.capturing():
            self.captured.append({"node": self.node, "algo": str(conv.algo), "after": self.last, "fenced": on})
        return on

    def launched(self, conv: Any, _args: tuple) -> None:
        """A conv launch listener: what the launch enqueued last."""
        self.last = last_kernel(conv)

    def summary(self) -> dict[str, Any]:
        fenced = [r for r in self.captured if r["fenced"]]
        return {"scope": self.name, "fences": len(fenced), "fused": len(self.captured),
                "after": dict(Counter(r["after"] for r in self.captured)), "fenced_after": dict(Counter(r["after"] for r in fenced)),
                "launches": self.captured}

    def patches(self) -> list[Any]:
        """The context managers that put the scope in place for one executor's life."""
        from convpass.kernels import conv_exec
        from convpass.kernels.convolution import ConvLaunch, Convolutions
        from convpass.runtime.cuda import runner

        scope = self
        run_launch, warm_up, run_eager, segment = runner._run_launch, runner._warm_up, runner._run_eager, runner._capture_segment

        def _run_launch(launch, env):
            scope.node = launch.node.name
            try:
                run_launch(launch, env)
            finally:
                scope.node = None
                if not isinstance(launch, ConvLaunch):
                    scope.last = OTHER

        def _warm_up(rt, plan, state, static):
            scope.last = START
            return warm_up(rt, plan, state, static)

        def _run_eager(rt, state, env):
            scope.last = START
            return run_eager(rt, state, env)

        def _capture_segment(rt, state, env, stream, start, stop):
            scope.last = START
            if start == 0:
                scope.captured = []
            return segment(rt, state, env, stream, start, stop)

        def other_after(name: str, copies: Callable[[tuple, Any], bool]) -> Any:
            orig = getattr(Convolutions, name)

            def wrapped(self, *a, **k):
                out = orig(self, *a, **k)
                if copies(a, out):
                    scope.last = OTHER
                return out

            return patched(Convolutions, name, wrapped)

        @contextlib.contextmanager
        def listening():
            conv_exec.add_launch_listener(self.launched)
            try:
                yield
            finally:
                conv_exec.remove_launch_listener(self.launched)

        return [patched(conv_exec, "fence_needed", self.needed), listening(),
                patched(runner, "_run_launch", _run_launch), patched(runner, "_warm_up", _warm_up),
                patched(runner, "_run_eager", _run_eager), patched(runner, "_capture_segment", _capture_segment),
                other_after("_prepad", lambda a, out: True),
                other_after("_in_layout", lambda a, out: _ptr(out) != _ptr(a[0])),  # the residual's copy too
                other_after("_into", lambda a, out: a[1] is not None),
                other_after("_activate", lambda a, out: bool(a[1]))]


# ---------------------------------------------------------------------------------------------
# verdicts


def is_right(r: dict[str, Any] | None, tol: float = TOL_MODEL) -> bool:
    """A scope's run is right: it ran, as one captured graph, and every run's error is within ``tol``."""
    return (r is not None and bool(r.get("errors")) and str(r.get("graph", "")).startswith("CUDA graph: yes")
            and all(e <= tol for e in r["errors"]))


def scope_verdict(results: Iterable[dict[str, Any] | None], tol: float = TOL_MODEL) -> dict[str, Any]:
    """The smallest right scope among ``results`` (one per scope, listed narrow to wide: ``scope``,
    ``errors``, ``graph``, ``fences``, ``fused``; None or without errors where the run failed):
    the right one with the fewest fences, the first listed among equals. ``control_right``: whether
    the control (no fence) is right, None where it did not run; when it is, the race did not show
    and the scopes are not told apart."""
    results = [r for r in results if r is not None]
    right = [r for r in results if is_right(r, tol)]
    failed = [r["scope"] for r in results if not r.get("errors") or not str(r.get("graph", "")).startswith("CUDA graph: yes")]
    wrong = [r["scope"] for r in results if r not in right and r["scope"] not in failed]
    control = next((r for r in results if r["scope"] == CONTROL and r["scope"] not in failed), None)
    best = min(right, key=lambda r: r["fences"]) if right else None
    return {"smallest": None if best is None else best["scope"], "fences": None if best is None else best["fences"],
            "fused": None if best is None else best.get("fused"), "right": [r["scope"] for r in right], "wrong": wrong,
            "failed": failed, "control_right": None if control is None else is_right(control, tol)}


def verdict_line(what: str, v: dict[str, Any]) -> str:
    """One line of a :func:`scope_verdict`."""
    if v["smallest"] is None:
        head = "NO scope is right" + (" (none ran)" if not v["wrong"] else "")
    else:
        head = f"smallest right scope {v['smallest']!r} ({v['fences']} of {v['fused']} captured fused launches fenced)"
    if v["control_right"]:
        head += "; the control (no fence) is right too: the race did not show, the scopes are not told apart"
    elif v["control_right"] is None:
        head += "; the control (no fence) did not run"
    tail = f"; right: {v['right']}; wrong: {v['wrong']}" + (f"; failed or not one graph: {v['failed']}" if v["failed"] else "")
    return f"VERDICT fence scope, {what}: {head}{tail}"


def across_models(per_model: dict[str, list[dict[str, Any] | None]]) -> list[dict[str, Any]]:
    """Per scope, one result over every model: the errors of all its runs, the fences and fused
    launches summed, one graph only where every model's was; a scope a model lacks (or failed on)
    is failed."""
    names = list(dict.fromkeys(r["scope"] for rs in per_model.values() for r in rs if r is not None))
    out = []
    for name in names:
        runs = [next((r for r in rs if r is not None and r["scope"] == name), None) for rs in per_model.values()]
        if any(r is None or not r.get("errors") for r in runs):
            out.append({"scope": name, "errors": [], "graph": "", "fences": 0, "fused": 0})
            continue
        graph = "CUDA graph: yes" if all(str(r.get("graph", "")).startswith("CUDA graph: yes") for r in runs) else "not one graph everywhere"
        out.append({"scope": name, "errors": [e for r in runs for e in r["errors"]], "graph": graph,
                    "fences": sum(r["fences"] for r in runs), "fused": sum(r.get("fused", 0) for r in runs)})
    return out


def scope_line(r: dict[str, Any], tol: float = TOL_MODEL) -> str:
    """One scope's run: its fences and what its fused launches came right after."""
    after = ", ".join(f"{k} {v}" for k, v in sorted(r.get("after", {}).items()))
    fenced = ", ".join(f"{k} {v}" for k, v in sorted(r.get("fenced_after", {}).items()))
    return (f"fence scope {r['scope']!r}: {'right' if is_right(r, tol) else 'WRONG or not run'}; fenced {r.get('fences')} of "
            f"{r.get('fused')} captured fused launches (fenced after: {fenced or '-'}; all come after: {after or '-'})")


# ---------------------------------------------------------------------------------------------
# the cost of one fence


def per_fence_us(with_ms: float, without_ms: float, n: int) -> float:
    """Microseconds per fence from ``n`` fences' total with and without them (ms)."""
    return (with_ms - without_ms) * 1e3 / n


def cost_lines(c: dict[str, Any]) -> list[str]:
    """The ``FENCE cost`` lines of a :func:`fence_cost` result."""
    n, t = c["n"], c["ms"]
    lines = []
    if "fences" in t and "empty" in t:
        lines.append(f"FENCE cost, captured: one graph of {n} fences {t['fences']:.3f} ms, an empty graph {t['empty']:.3f} ms: "
                     f"{c['us']['graph_fences']:.2f} us per fence")
    if "kernels" in t and "kernels+fences" in t:
        lines.append(f"FENCE cost, captured: {n} no-op kernels {t['kernels']:.3f} ms ({t['kernels'] * 1e3 / n:.2f} us each), with a fence "
                     f"before each {t['kernels+fences']:.3f} ms: {c['us']['graph_between_kernels']:.2f} us per fence")
    if "eager kernels" in t and "eager kernels+fences" in t:
        lines.append(f"FENCE cost, eager: {n} no-op kernels {t['eager kernels']:.3f} ms, with a fence before each "
                     f"{t['eager kernels+fences']:.3f} ms (GPU clock): {c['us']['eager_between_kernels']:.2f} us per fence; "
                     f"host time {c['us']['host_per_fence_call']:.2f} us per fence call")
    lines += [f"FENCE cost: {k} failed: {v}" for k, v in c.get("errors", {}).items()]
    return lines


_noop: list[Any] = []


def noop_kernel(_y: Any = None) -> None:
    """A one-thread kernel that does nothing."""
    cp = _cp()
    if not _noop:
        _noop.append(cp.RawKernel(r'extern "C" __global__ void diag_noop() {}', "diag_noop"))
    _noop[0]((1,), (1,), ())


def fence_cost(n: int = 200, reps: int = 30) -> dict[str, Any]:
    """The product's fence (``convpass.native.cuda.stream_fence``) timed on this GPU: CUDA graphs of
    ``n`` fences and of nothing, of ``n`` no-op kernels with and without a fence before each, and
    the kernels launched eagerly with and without fences (medians of ``reps`` launches, CUDA events
    on the stream); the host time of one fence call."""
    from convpass.native.cuda import quiet_for_capture, stream_fence

    cp = _cp()
    stream = cp.cuda.Stream(non_blocking=True)

    def fences() -> None:
        for _ in range(n):
            stream_fence(cp)

    def kernels(fenced: bool) -> Callable[[], None]:
        def body() -> None:
            for _ in range(n):
                if fenced:
                    stream_fence(cp)
                noop_kernel()
        return body

    def capture(body: Callable[[], None]) -> Any:
        with quiet_for_capture():
            stream.begin_capture()
            try:
                body()
            finally:
                graph = stream.end_capture()
        return graph

    def gpu_ms(launch: Callable[[], None]) -> float:
        for _ in range(3):
            launch()
        stream.synchronize()
        times = []
        for _ in range(reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            launch()
            b.record(stream)
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b))
        return float(np.median(times))

    out: dict[str, Any] = {"n": n, "reps": reps, "ms": {}, "us": {}, "errors": {}}
    with stream:
        stream_fence(cp)  # the fence's buffer and the kernel made outside any capture
        noop_kernel()
        stream.synchronize()
        bodies = {"empty": lambda: None, "fences": fences, "kernels": kernels(False), "kernels+fences": kernels(True)}
        for name, body in bodies.items():
            try:
                graph = capture(body)
                out["ms"][name] = gpu_ms(lambda graph=graph: graph.launch(stream))
            except Exception as e:  # noqa: BLE001
                out["errors"][f"graph {name}"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
        for name, body in (("eager kernels", kernels(False)), ("eager kernels+fences", kernels(True))):
            out["ms"][name] = gpu_ms(body)
        stream.synchronize()
        t0 = time.perf_counter()
        fences()
        host = time.perf_counter() - t0
        stream.synchronize()
    t, us = out["ms"], out["us"]
    if "fences" in t and "empty" in t:
        us["graph_fences"] = per_fence_us(t["fences"], t["empty"], n)
    if "kernels" in t and "kernels+fences" in t:
        us["graph_between_kernels"] = per_fence_us(t["kernels+fences"], t["kernels"], n)
    us["eager_between_kernels"] = per_fence_us(t["eager kernels+fences"], t["eager kernels"], n)
    us["host_per_fence_call"] = host * 1e6 / n
    return out


# ---------------------------------------------------------------------------------------------
# the captured graph's edges (CUDA driver API through ctypes)
#
# The hypothesis: cuDNN launches some kernels with programmatic stream serialization, which stream
# capture records as programmatic edges (the consumer may start before its producer has finished);
# the fence puts a memset node, so a default edge, in between. Here the plan is captured without a
# fence, its edges are counted by kind, and a copy of the graph whose every non-default edge is
# made a default one is replayed against the reference: a zero-cost fix where it is right.

EDGE_TYPES = {0: "default", 1: "programmatic"}  # CUgraphDependencyType
FROM_PORTS = {0: "default", 1: "programmatic", 2: "launch order"}  # CU_GRAPH_KERNEL_NODE_PORT_*
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child graph", 5: "empty", 6: "event wait", 7: "event record",
              8: "semaphore signal", 9: "semaphore wait", 10: "mem alloc", 11: "mem free", 12: "batch mem op", 13: "conditional"}
EDGE_RUNS = 6  # replays of each graph


class EdgeData(ctypes.Structure):
    """CUgraphEdgeData (8 bytes)."""

    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2, with room after it for a longer one."""

    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p),
                ("_room", ctypes.c_ubyte * 64)]


class Edge(NamedTuple):
    src: str  # what the node at each end is (a kernel's name, else the node's type)
    dst: str
    type: int
    from_port: int
    to_port: int
    a: int = 0  # the nodes' handles
    b: int = 0


class EdgesUnavailable(Exception):
    """The graph or a driver symbol is not to be had: the check is skipped, said so."""


class DriverError(Exception):
    """A driver call returned an error."""


def edge_kind(e: Edge) -> str:
    return f"{EDGE_TYPES.get(e.type, f'type {e.type}')}/{FROM_PORTS.get(e.from_port, f'port {e.from_port}')}"


def is_default(e: Edge) -> bool:
    return e.type == 0 and e.from_port == 0 and e.to_port == 0


def edge_summary(edges: list[Edge], nodes: int | None = None) -> dict[str, Any]:
    """The edges counted by kind (``type/from_port``); the programmatic ones (type 1) by the pair
    of nodes they join, most frequent first; the non-default ones (any type or port not 0)."""
    prog = Counter(f"{e.src} -> {e.dst}" for e in edges if e.type == 1)
    return {"edges": len(edges), "nodes": nodes, "kinds": dict(Counter(edge_kind(e) for e in edges)), "programmatic": sum(prog.values()),
            "non_default": sum(1 for e in edges if not is_default(e)), "pairs": dict(prog.most_common())}


def _short(pair: str, n: int = 48) -> str:
    """``a -> b`` with each name cut to ``n`` characters."""
    return " -> ".join(x if len(x) <= n else x[:n - 3] + "..." for x in pair.split(" -> "))


def runs_text(errors: list[float], tol: float = TOL_MODEL) -> str:
    marks = " ".join(f"{e:.2e}{'' if e <= tol else '!'}" for e in errors)
    return f"runs 1..{len(errors)}: {marks}"


def replay_word(errors: list[float] | None, tol: float = TOL_MODEL) -> str:
    return "not tried" if not errors else "right" if all(e <= tol for e in errors) else "WRONG"


def edge_lines(s: dict[str, Any]) -> list[str]:
    """The ``EDGES`` lines of an :func:`edges_check` result."""
    if s.get("unavailable"):
        return [f"EDGES unavailable: {s['unavailable']}"]
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["kinds"].items()))
    lines = [f"EDGES captured without a fence: {s['edges']} edge(s) between {s['nodes']} node(s): {kinds or '-'}; "
             f"{s['programmatic']} programmatic, {s['non_default']} not default"]
    lines += [f"EDGES   programmatic x{n}: {p}" for p, n in s["pairs"].items()]
    for what, key in (("as captured (a copy, replayed the same way)", "captured"), ("rewritten", "rewritten")):
        if s.get(key):
            lines.append(f"EDGES {what}: {runs_text(s[key])}: {replay_word(s[key])}")
        if s.get(f"{key}_error"):
            lines.append(f"EDGES {what}: failed: {s[f'{key}_error']}")
    if s.get("rewired") is not None:
        lines.append(f"EDGES rewritten: {s['rewired']} edge(s) made default; {s.get('left', '?')} non-default left")
    return lines


def edges_verdict_line(what: str, s: dict[str, Any]) -> str:
    """``VERDICT edges``: the programmatic edges of the plan captured without a fence, and whether
    the graph with them made default edges is right."""
    if s.get("unavailable"):
        return f"VERDICT edges, {what}: unavailable: {s['unavailable']}"
    pairs = list(s["pairs"].items())
    kernels = "; ".join(f"{_short(a)} x{n}" for a, n in pairs[:4]) + (f"; {len(pairs) - 4} more pair(s)" if len(pairs) > 4 else "")
    rewritten = replay_word(s.get("rewritten"))
    if s.get("rewritten_error"):
        rewritten += f" ({s['rewritten_error']})"
    captured = replay_word(s.get("captured"))
    line = (f"VERDICT edges, {what}: {s['programmatic']} programmatic edge(s) of {s['edges']} (kernels {kernels or '-'}); "
            f"rewritten to default: {rewritten}; as captured, replayed the same way: {captured}")
    if s["programmatic"] == 0:
        line += "; no programmatic edge: the hypothesis does not hold"
    elif rewritten == "right" and captured == "WRONG":
        line += "; the programmatic edges are the cause: default edges in their place are the zero-cost fix"
    elif captured == "right":
        line += "; the race did not show in this replay: not told apart"
    return line


class Driver:
    """libcuda.so.1's functions by name: ``drv(("cuX_v2", "cuX"), *args)`` calls the first one it
    has (:class:`EdgesUnavailable` where none), :class:`DriverError` on a status other than 0."""

    def __init__(self, lib: Any = None) -> None:
        if lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise EdgesUnavailable(f"libcuda.so.1: {e}") from None
        self.lib = lib

    def has(self, name: str) -> bool:
        return getattr(self.lib, name, None) is not None

    def __call__(self, names: tuple[str, ...], *args: Any) -> None:
        name = next((n for n in names if self.has(n)), None)
        if name is None:
            raise EdgesUnavailable(f"libcuda.so.1 has no {' or '.join(names)}")
        fn = getattr(self.lib, name)
        fn.restype = ctypes.c_int
        status = fn(*args)
        if status:
            raise DriverError(f"{name}: {self.error_name(status)}")

    def error_name(self, status: int) -> str:
        text = ctypes.c_char_p()
        if self.has("cuGetErrorName"):
            self.lib.cuGetErrorName(ctypes.c_int(status), ctypes.byref(text))
        return f"{text.value.decode() if text.value else 'CUresult'} ({status})"


def node_name(drv: Driver, node: int) -> str:
    """A kernel node's function name (``cuFuncGetName``, ``cuKernelGetName``), else the node's type."""
    kind = ctypes.c_int(-1)
    try:
        drv(("cuGraphNodeGetType",), ctypes.c_void_p(node), ctypes.byref(kind))
    except (DriverError, EdgesUnavailable):
        return "node"
    if kind.value != 0:
        return NODE_TYPES.get(kind.value, f"node type {kind.value}")
    params, name = KernelNodeParams(), ctypes.c_char_p()
    try:
        drv(("cuGraphKernelNodeGetParams_v2", "cuGraphKernelNodeGetParams"), ctypes.c_void_p(node), ctypes.byref(params))
        if params.func:
            drv(("cuFuncGetName",), ctypes.byref(name), ctypes.c_void_p(params.func))
        elif params.kern:
            drv(("cuKernelGetName",), ctypes.byref(name), ctypes.c_void_p(params.kern))
    except (DriverError, EdgesUnavailable):
        pass
    return name.value.decode(errors="replace") if name.value else "kernel"


def graph_edges(drv: Driver, graph: int, names: bool = True) -> tuple[list[Edge], int]:
    """The graph's edges (``cuGraphGetEdges_v2``) and its node count."""
    g, count = ctypes.c_void_p(graph), ctypes.c_size_t(0)
    drv(("cuGraphGetNodes",), g, None, ctypes.byref(count))
    nodes = count.value
    count = ctypes.c_size_t(0)
    drv(("cuGraphGetEdges_v2",), g, None, None, None, ctypes.byref(count))
    n = count.value
    frm, to, data = (ctypes.c_void_p * max(n, 1))(), (ctypes.c_void_p * max(n, 1))(), (EdgeData * max(n, 1))()
    drv(("cuGraphGetEdges_v2",), g, frm, to, data, ctypes.byref(count))
    seen: dict[int, str] = {}

    def name(h: int) -> str:
        if h not in seen:
            seen[h] = node_name(drv, h) if names else ""
        return seen[h]

    return [Edge(name(frm[i] or 0), name(to[i] or 0), data[i].type, data[i].from_port, data[i].to_port, frm[i] or 0, to[i] or 0)
            for i in range(count.value)], nodes


def rewrite_to_default(drv: Driver, graph: int, edges: list[Edge]) -> int:
    """Every non-default edge of ``edges`` removed and added back as a default one."""
    bad = [e for e in edges if not is_default(e)]
    if not bad:
        return 0
    n, g = len(bad), ctypes.c_void_p(graph)
    frm, to = (ctypes.c_void_p * n)(*[e.a for e in bad]), (ctypes.c_void_p * n)(*[e.b for e in bad])
    data = (EdgeData * n)(*[EdgeData(e.from_port, e.to_port, e.type) for e in bad])
    drv(("cuGraphRemoveDependencies_v2",), g, frm, to, data, ctypes.c_size_t(n))
    if drv.has("cuGraphAddDependencies_v2"):
        drv(("cuGraphAddDependencies_v2",), g, frm, to, None, ctypes.c_size_t(n))  # no edge data: default edges
    else:
        drv(("cuGraphAddDependencies",), g, frm, to, ctypes.c_size_t(n))
    return n


def _instantiate(drv: Driver, graph: int) -> int:
    ex = ctypes.c_void_p()
    drv(("cuGraphInstantiateWithFlags",), ctypes.byref(ex), ctypes.c_void_p(graph), ctypes.c_ulonglong(0))
    return int(ex.value or 0)


def _replays(drv: Driver, exec_: int, state: Any, feeds: dict[str, Any], error_of: Callable[[list[Any]], float], runs: int) -> list[float]:
    """``runs`` launches of a graph exec on the current stream, each from the feeds copied into the
    plan's static inputs and its outputs NaN-filled: the error of each."""
    cp = _cp()
    stream = cp.cuda.get_current_stream()
    inputs = {id(a) for a in state.static_inputs.values()}
    errs = []
    for _ in range(runs):
        for name, buf in state.static_inputs.items():
            cp.copyto(buf, feeds[name])
        for o in state.outputs:
            if getattr(o.dtype, "kind", "") == "f" and id(o) not in inputs:
                o.fill(float("nan"))
        drv(("cuGraphLaunch",), ctypes.c_void_p(exec_), ctypes.c_void_p(stream.ptr))
        stream.synchronize()
        errs.append(error_of(state.outputs))
    return errs


def edges_check(ex: Any, feeds: dict[str, Any], error_of: Callable[[list[Any]], float], runs: int = EDGE_RUNS) -> dict[str, Any]:
    """The edges of the executor's captured plan (:func:`edge_summary`), then a copy of its graph
    replayed ``runs`` times as captured (``captured``: errors) and with its non-default edges made
    default (``rewritten``); ``unavailable`` where the graph or the driver's functions are not to
    be had. Prints the ``EDGES`` lines."""
    try:
        out = _edges_check(ex, feeds, error_of, runs)
    except (EdgesUnavailable, DriverError) as e:
        out = {"unavailable": f"{type(e).__name__}: {e}"}
    for line in edge_lines(out):
        log(line)
    return out


def _edges_check(ex: Any, feeds: dict[str, Any], error_of: Callable[[list[Any]], float], runs: int) -> dict[str, Any]:
    plan = getattr(ex, "last_plan", None)
    state = getattr(plan, "backend_state", None)
    if state is None or not getattr(state, "captured", False):
        raise EdgesUnavailable("the plan is not one captured CUDA graph")
    handle = int(getattr(state.graph, "graph", 0) or 0)
    if not handle:
        raise EdgesUnavailable(f"CuPy {_cp().__version__}'s Graph keeps no cudaGraph_t (its .graph is 0 or absent)")
    drv = Driver()
    edges, nodes = graph_edges(drv, handle)
    out = edge_summary(edges, nodes)
    clone = ctypes.c_void_p()
    drv(("cuGraphClone",), ctypes.byref(clone), ctypes.c_void_p(handle))  # the executor's graph left as it is
    execs: list[int] = []
    try:
        for key in ("captured", "rewritten"):
            try:
                if key == "rewritten":
                    mine, _ = graph_edges(drv, clone.value, names=False)
                    if not any(not is_default(e) for e in mine):
                        out["rewritten_error"] = "no non-default edge in the copy"
                        break
                    out["rewired"] = rewrite_to_default(drv, clone.value, mine)
                    out["left"] = sum(1 for e in graph_edges(drv, clone.value, names=False)[0] if not is_default(e))
                execs.append(_instantiate(drv, clone.value))
                out[key] = _replays(drv, execs[-1], state, feeds, error_of, runs)
            except DriverError as e:
                out[f"{key}_error"] = str(e)
    finally:
        for e in execs:
            drv(("cuGraphExecDestroy",), ctypes.c_void_p(e))
        drv(("cuGraphDestroy",), clone)
    return out

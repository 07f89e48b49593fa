"""The per-conv account of a tuned model: where each convolution's time goes, against the best that
cuDNN offers by the routes its peers use (``convpass account MODEL``).

For every tuned conv and profile, one row:

* ``tuned``: the decision's recorded time (the conv's step with its epilogue, timed alone);
* ``in place``: its launch timed inside the plan it runs in, less the timing's own cost per launch
  (:mod:`convpass.runtime.in_place`; the rows keep the time as timed and that floor too);
* per memory format (NCHW, NHWC), the best measured time of the bare conv by each route:
  ``legacy`` (cuDNN's legacy algorithms; ``heuristic``: its first choice, what frameworks run
  without a search), ``engines A`` / ``engines B`` / ``fallback`` (graph-API engine
  configurations from heuristics mode A, mode B and the fallback list: the configurations
  PyTorch's ``cudnn.benchmark`` route enumerates and times), from the tuning cache (the tuner's own
  rows, timed by the same harness); rows not in the cache are measured now;
* ``torch``: where PyTorch is installed, ``torch.nn.functional.conv2d`` / ``conv3d`` on the same
  geometry with ``cudnn.benchmark`` and TF32 as the decision's math mode, timed back to back with
  CUDA events, NCHW and channels_last (PyTorch's own route through cuDNN, end to end).

``best`` is the fastest bare conv over every route and format; ``in place / best`` says how far
the running conv is from it. The module's :func:`account` returns plain records (JSON-ready);
:func:`render` is the table.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ROUTES", "account", "render"]

ROUTES = ("legacy", "heuristic", "engines A", "engines B", "fallback", "torch")
REPS = 20


def _engine_routes(key: Any) -> dict[str, set[str]]:
    """The configuration names each heuristics mode offers for ``key``'s bare conv graph."""
    from convpass.native.cudnn import graph_api

    out: dict[str, set[str]] = {}
    if graph_api.unavailable() is not None or key.math == "fma":
        return out
    fe = graph_api._require()
    import cupy as cp

    device, _ = graph_api._current(cp)
    for route, mode in (("engines A", "A"), ("engines B", "B"), ("fallback", "FALLBACK")):
        try:
            g, _ = graph_api._graph(fe, key, graph_api._handle(fe, device))
            out[route] = set(graph_api._enumerate(fe, g, key, (mode,)))
        except Exception:  # noqa: BLE001  (a mode that offers nothing for this graph)
            out[route] = set()
    return out


def _route_times(rows: Sequence[Any], key: Any, engine_routes: Mapping[str, set[str]]) -> dict[str, float]:
    """Best bare-conv time per route for ``key`` (its layout and math), from measured rows."""
    from convpass.core.algo import Algo

    best: dict[str, float] = {}

    def keep(route: str, ms: float) -> None:
        if route not in best or ms < best[route]:
            best[route] = ms

    for m in rows:
        if m.key != key or m.status != "ok" or m.time_ms is None:
            continue
        algo = Algo.parse(m.algo)
        if algo.fusion or algo.family == "pass":
            continue
        if m.method == "measure" and algo.is_legacy:
            keep("legacy", m.time_ms)
            if m.heuristic_rank == 0:
                keep("heuristic", m.time_ms)
        elif m.method == "measure" and algo.is_engine:
            for route, names in engine_routes.items():
                if algo.name in names:
                    keep(route, m.time_ms)
    ranked = [m for m in rows if m.key == key and m.method == "heuristic" and m.heuristic_rank == 0]
    if ranked and "heuristic" not in best:  # the heuristic's pick, timed by the tuner under its own row
        timed = {m.algo: m.time_ms for m in rows if m.key == key and m.method == "measure" and m.time_ms is not None}
        if ranked[0].algo in timed:
            best["heuristic"] = timed[ranked[0].algo]
    return best


def _torch_ms(shape: Any, layout: str, tf32: bool) -> float | None:
    """PyTorch's conv of ``shape`` with cudnn.benchmark, or None without torch or for a geometry it
    is not asked (backward directions)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if shape.direction != "fwd" or not torch.cuda.is_available():
        return None
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = tf32
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[shape.dtype]
    x = torch.randn(shape.x_shape, device="cuda", dtype=dtype)
    w = torch.randn(shape.w_shape, device="cuda", dtype=dtype)
    if layout == "nhwc":
        fmt = torch.channels_last if shape.rank == 2 else torch.channels_last_3d
        x, w = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)
    conv = F.conv2d if shape.rank == 2 else F.conv3d

    def run() -> Any:
        return conv(x, w, None, tuple(shape.strides), tuple(shape.pads), tuple(shape.dilations), shape.groups)

    for _ in range(5):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(REPS):
            run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / REPS)
    return statistics.median(times)


def account(model: Any, cache: Any = None, *, torch: bool = True, measure_missing: bool = True) -> list[dict[str, Any]]:
    """The account's rows for a tuned model (a path) on this GPU (module docstring). ``cache``: the
    tuning cache path (default: convpass's); ``torch``: add PyTorch's route where it is installed;
    ``measure_missing``: time now what the cache lacks."""
    from convpass.compiler.aot import _feeds, _profiles
    from convpass.core.errors import ConvpassError
    from convpass.core.options import TuneOptions
    from convpass.core.problem import ConvProblem, ProblemKey
    from convpass.native import device as device_mod
    from convpass.runtime import Executor
    from convpass.runtime.in_place import check_in_place
    from convpass.tuning.cache import TuningCache
    from convpass.tuning.cache_rows import current
    from convpass.tuning.tuner import measure_problem

    device = device_mod.detect()
    if device is None:
        raise ConvpassError("the per-conv account times convolutions: it needs a usable GPU with CuPy and cuDNN")
    import cupy as cp

    store = TuningCache(cache)
    executor = Executor(model, device="cuda", cuda_graph=False)
    rows: list[dict[str, Any]] = []
    routes_of: dict[ProblemKey, dict[str, set[str]]] = {}
    torch_of: dict[tuple[str, str, bool], float | None] = {}
    for profile, shapes in enumerate(_profiles(executor, ())):
        feeds = {k: cp.asarray(v) for k, v in _feeds(executor, shapes).items()}
        placed = {c.node: c for c in check_in_place(executor, feeds, profile).convs}
        for s in executor.plan_summary():
            if not s.recorded_problem_key or s.node not in placed:
                continue
            key = ProblemKey.parse(s.recorded_problem_key)
            row: dict[str, Any] = {"node": s.node, "profile": profile, "problem_key": str(key), "algo": s.algo,
                                   "memory_format": s.memory_format, "tuned_ms": s.time_ms, "in_place_ms": placed[s.node].in_place_ms,
                                   "in_place_raw_ms": placed[s.node].raw_ms, "floor_ms": placed[s.node].floor_ms}
            found = current(store.get(device, key.shape))
            if measure_missing and not any(m.method == "measure" and m.key.math == key.math and m.key.x_slice == key.x_slice and m.key.y_slice == key.y_slice and m.key.z_slice == key.z_slice for m in found):
                options = TuneOptions(tf32="on" if key.tf32 else "off", layout="per-conv")
                store.put(device, measure_problem(ConvProblem((key.shape,), x_slice=key.x_slice, y_slice=key.y_slice, z_slice=key.z_slice), options, found))
                found = current(store.get(device, key.shape))
            for layout in ("nchw", "nhwc"):
                lk = ProblemKey(key.shape, layout, key.math, key.x_slice, key.y_slice, key.z_slice)
                if lk not in routes_of:
                    routes_of[lk] = _engine_routes(lk)
                for route, ms in _route_times(found, lk, routes_of[lk]).items():
                    row[f"{route} {layout}"] = ms
                if torch:
                    tk = (str(key.shape), layout, key.tf32)
                    if tk not in torch_of:
                        torch_of[tk] = _torch_ms(key.shape, layout, key.tf32)
                    if torch_of[tk] is not None:
                        row[f"torch {layout}"] = torch_of[tk]
            bests = [v for k, v in row.items() if k.split(" ")[0] in {r.split(" ")[0] for r in ROUTES} and isinstance(v, float)]
            row["best_ms"] = min(bests) if bests else None
            row["in_place_over_best"] = row["in_place_ms"] / row["best_ms"] if row["best_ms"] else None
            rows.append(row)
    return rows


def render(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The account as text lines: one per conv, then the sums per column. Names from the model are
    :func:`~convpass.core.text.printable`."""
    from convpass.core.text import printable

    cols = ["tuned_ms", "in_place_ms", "best_ms"] + [f"{r} {lay}" for r in ROUTES for lay in ("nchw", "nhwc")]
    cols = [c for c in cols if any(isinstance(r.get(c), float) for r in rows)]
    head = "node".ljust(36) + " fmt   " + " ".join(c.replace("_ms", "")[:11].rjust(11) for c in cols)
    lines = [head]
    for r in rows:
        lines.append(printable(r["node"])[:36].ljust(36) + f" {printable(r['memory_format']):5} " +
                     " ".join((f"{r[c]:.4f}" if isinstance(r.get(c), float) else "-").rjust(11) for c in cols))
    sums = {c: sum(r[c] for r in rows if isinstance(r.get(c), float)) for c in cols}
    lines.append("sum".ljust(36) + " " * 7 + " ".join(f"{sums[c]:.4f}".rjust(11) for c in cols))
    floors = sorted({f"{r['floor_ms']:.4f}" for r in rows if isinstance(r.get("floor_ms"), float)}, key=float)
    if floors:
        lines.append(f"in_place: each launch as timed less the timing's own {' / '.join(floors)} ms per launch (an empty kernel timed the same way)")
    return lines

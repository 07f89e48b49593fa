"""The measuring decision backend: tunes every problem on the local GPU through cuDNN.

For each distinct problem and each candidate configuration (geometry mapping x memory format x math
type allowed by the options):

* cuDNN's heuristic ranking (``_v7``) is recorded for every configuration (it is also the baseline
  the summary compares against: its first choice in NCHW with default math, as frameworks run);
* ``exhaustive`` mode adds cuDNN's own Find; ``measure`` mode (the default) times every algorithm
  cuDNN supports with :mod:`convpass.tuning.harness`, and convpass's own kernels where they apply
  (:mod:`convpass.kernels.depthwise`: depthwise convs; :func:`own_space`); ``heuristic`` / ``exhaustive`` / forced modes
  time only the configuration they pick, so every recorded time comes from the same harness;
* every timed algorithm is first run once and checked against a reference computed by a
  deterministic algorithm with FMA math (no TF32) on the same random inputs, within a tolerance that
  fits its math type; a wrong result, an error or running out of memory is recorded as such and
  the algorithm is skipped — tuning always continues;
* everything measured goes to the tuning cache (per device fingerprint); a problem whose
  measurements are all in the cache is decided from there without timing anything.

Measuring and storing are apart: :func:`measure_problem` times one problem and returns its rows,
:func:`problem_complete` says whether stored rows already cover it. :class:`CudnnTuner` stores the
rows in its cache itself; fleet workers (:mod:`convpass.fleet`) send them to the driver, the only
writer of the cache.

The choice among measurements is :func:`convpass.tuning.decide.select`, the same rule the GPU-less cache
backend uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement
from convpass.core import fusion as epilogue
from convpass.tuning.decide import EPILOGUE_METHOD, Choice, allowed, cached_rows, choice_from, cost_ms, epilogue_ms, select
from convpass.core.algo import Algo
from convpass.core.device import DeviceFingerprint
from convpass.core.errors import OptionError
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem
from convpass.core.problem import ConvShape, ProblemKey
from convpass.kernels import depthwise
from convpass.tuning import harness

logger = logging.getLogger("convpass")

# Normwise relative error allowed against the FMA reference, by data type and math type.
TOLERANCE = {
    ("float32", "fma"): 1e-3,  # FFT / Winograd reorder sums (winograd_nonfused 5x5: ~5e-4); < TF32's
    ("float32", "default"): 5e-3,  # TF32: 10-bit mantissa products, ~3e-4 typical
    ("float32", "tensor_op"): 5e-3,
    ("float16", "default"): 1e-2,
    ("float16", "tensor_op"): 1e-2,
    ("float16", "fma"): 1e-2,
    ("bfloat16", "default"): 3e-2,
    ("bfloat16", "tensor_op"): 3e-2,
    ("bfloat16", "fma"): 3e-2,
}
# Deterministic algorithms a reference can be computed with, in order of preference.
REFERENCE_ALGOS = {
    "fwd": ("implicit_gemm", "implicit_precomp_gemm", "gemm", "direct"),
    "dgrad": ("algo_1", "fft_tiling", "fft"),
    "wgrad": ("algo_1", "fft", "fft_tiling"),
}
# cuDNN's legacy API runs FFT tiling once per group: on depthwise convs one launch takes seconds
# (measured on an H200: 22 s for g=960 at 14x14). Above this many groups it is skipped unless forced.
FFT_TILING_MAX_GROUPS = 8
# Close candidates are timed again in turn (_ShapeBench.settle): those within this margin of the
# best by the decision's cost, at most this many.
HEAD_TO_HEAD_MARGIN = 0.05
HEAD_TO_HEAD_MAX = 3
# Workspace a geometry's kept groups may hold for that (at most 1/32 of the GPU's memory): a
# candidate whose workspace would pass it keeps no group, and a decision it is close in is then not
# settled in turn.
HEAD_TO_HEAD_WORKSPACE_BYTES = 1 << 30
# What each direction reads and writes.
OUTPUT = {"fwd": "y", "dgrad": "x", "wgrad": "w"}


@dataclasses.dataclass
class TuningSummary:
    measured: int = 0  # problems timed now
    cached: int = 0  # problems whose rows the tuning cache held
    failed: int = 0  # problems left undecided (no configuration passed)
    cached_decided: int = 0  # of the cached problems, those decided
    seconds: float = 0.0


class CudnnTuner:
    """Decides problems by measuring them on the local GPU (see the module docstring)."""

    measures = True  # a decision names the strategy that took it, timed now or before (DecisionBackend)

    def __init__(self, cache: TuningCache, device: DeviceFingerprint, console: Console | None = None) -> None:
        self.cache = cache
        self.device = device
        self.console = console or Console(stderr=True)
        self.summary = TuningSummary()
        # cuDNN heuristic's first choice (NCHW, default math) per problem, timed by us: the baseline.
        self.baseline_ms: dict[ConvProblem, float] = {}
        self.chosen_ms: dict[ConvProblem, float] = {}
        # every measurement of every decided problem: the layout planner chooses among them
        self.rows: dict[ConvProblem, list[Measurement]] = {}
        self._transpose_ms: dict[tuple, float] = {}
        self._measure_stream: Any = None

    # ---------------------------------------------------------------------------------------
    def decide(self, problems: Sequence[ConvProblem], options: TuneOptions) -> dict[ConvProblem, Choice | None]:
        started = time.perf_counter()
        out: dict[ConvProblem, Choice | None] = {}
        columns = (TextColumn("tuning"), BarColumn(), MofNCompleteColumn(), TextColumn("problems"), TimeRemainingColumn())
        with Progress(*columns, console=self.console, transient=True) as progress:
            task = progress.add_task("tuning", total=len(problems))
            for problem in problems:
                out[problem] = self._decide_one(problem, options)
                progress.advance(task)
        self.summary.seconds = time.perf_counter() - started
        return out

    def _decide_one(self, problem: ConvProblem, options: TuneOptions) -> Choice | None:
        strategy, _ = options.strategy(problem.direction)
        rows = cached_rows(self.cache, self.device, problem)
        from_cache = problem_complete(rows, problem, options)
        if from_cache:
            self.summary.cached += 1
        else:
            with self._stream():
                fresh = measure_problem(problem, options, rows)
            self.cache.put(self.device, fresh)
            self.summary.measured += 1
            fresh_ids = {(m.key, m.algo, m.method) for m in fresh}
            rows = fresh + [m for m in rows if (m.key, m.algo, m.method) not in fresh_ids]
        self._record_baseline(problem, rows)
        self.rows[problem] = rows
        chosen = select(rows, problem, options)
        if chosen is None:
            self.summary.failed += 1
            logger.warning("no %s configuration of %s passed the constraints and checks: left to run time", problem.direction, problem)
            return None
        if from_cache:
            self.summary.cached_decided += 1
        choice = choice_from(chosen, strategy, rows, problem)  # timed now or before: DecisionBackend.measures
        if choice.time_ms is not None and chosen.method == "measure":
            self.chosen_ms[problem] = choice.time_ms
        return choice

    def _stream(self) -> Any:
        """The non-blocking stream measurements run on, made at the first one: a run that finds
        every problem in the cache makes none (whether anything else then creates a CUDA context
        was not checked on a GPU)."""
        if self._measure_stream is None:
            import cupy as cp

            self._measure_stream = cp.cuda.Stream(non_blocking=True)
        return self._measure_stream

    def transpose_ms(self, dims: tuple[int, ...], dtype: str) -> float:
        """Time of converting a tensor (rank 3-5) between channels-first and channels-last: the tuning cache's
        record, else measured now (warm clocks, as every conv was) and recorded, so that a cached
        re-run plans the same layouts as this one."""
        key = (tuple(dims), dtype)
        if key not in self._transpose_ms:
            recorded = self.cache.get_transpose(self.device, dims, dtype)
            if recorded is None:
                recorded = measure_transpose(tuple(dims), dtype)
                self.cache.put_transpose(self.device, dims, dtype, recorded)
            self._transpose_ms[key] = recorded
        return self._transpose_ms[key]

    def _record_baseline(self, problem: ConvProblem, rows: list[Measurement]) -> None:
        key = problem.primary.key("nchw", "default")
        first = next((m for m in rows if m.key == key and m.method == "heuristic" and m.heuristic_rank == 0 and m.status == "ok"), None)
        if first is None:
            return
        timed = next((m for m in rows if m.key == key and m.algo == first.algo and m.method == "measure" and m.time_ms is not None), None)
        if timed is not None:  # with its epilogue as its own pass, as the chosen time has it
            self.baseline_ms[problem] = cost_ms(timed, epilogue_ms(rows, problem), problem.fusion)


def measure_transpose(dims: tuple[int, ...], dtype: str) -> float:
    """Measured time (ms) of converting a ``dims`` tensor from channels-first to channels-last, on
    the current GPU with its clocks warmed first, as for every conv it is weighed against (an H200
    probe timed cold and warm copies within 1% of each other; the warm-up keeps the harness one)."""
    import cupy as cp

    from convpass.native.cudnn import empty_like_layout

    harness.warm_clocks()
    with cp.cuda.Stream(non_blocking=True):
        sets = harness.rotation_sets(harness.prod(dims) * 4)
        # copies of one random tensor: a copy's speed does not depend on the values (drawing them
        # for each of up to 64 sets took 0.86 s of a ResNet-50's layout plan, in a profile)
        first = harness.random_array(dims, dtype, "nchw", 100)
        sources = [first] + [first.copy() for _ in range(sets - 1)]
        targets = [empty_like_layout(dims, dtype, "nhwc") for _ in range(sets)]

        def convert(i: int) -> None:
            targets[i][...] = sources[i]

        return harness.time_launches(convert, sets).time_ms


def measure_problem(problem: ConvProblem, options: TuneOptions, have: Sequence[Measurement] = ()) -> list[Measurement]:
    """Measure one problem on the current GPU as ``options`` ask and return every row; writes
    nothing (the caller stores the rows: the tuner in its cache, a fleet worker by sending them to
    the driver). Runs with a non-default CuPy stream current; warms the clocks first.

    ``have``: rows already stored for the problem. When they hold every legacy measurement, only
    the graph-API engines are measured (a cache filled before engines existed is not re-timed);
    when they also hold the engines, only the problem's fused epilogue.
    """
    strategy, forced = options.strategy(problem.direction)
    harness.warm_clocks()
    legacy, engines = spaces(problem, options)
    own = own_space(problem, options, legacy)
    fusion = problem.fusion if engines or epilogue.is_legacy(problem.fusion) else ""
    own_fusion = problem.fusion if epilogue.is_legacy(problem.fusion) else ""
    keys = candidate_keys(problem, options)
    have = list(have)
    best = None
    legacy_fusion = legacy and epilogue.is_legacy(fusion)
    if legacy and complete(have, keys, strategy, forced, legacy=True, engines=False):
        legacy = False
        if engines and complete(have, keys, strategy, forced, legacy=False, engines=True):
            engines = False
        timed = [m.time_ms for m in have if m.key in keys and m.status == "ok" and m.method == "measure" and m.time_ms]
        best = min(timed, default=None)
    if legacy_fusion and complete(have, keys, strategy, forced, legacy=False, engines=False, fusion=fusion):
        legacy_fusion = False
    if own and own_complete(have, keys, own_fusion):
        own = False
    return _measure(problem, options, keys, strategy, forced, legacy, engines, best, fusion if legacy_fusion or not epilogue.is_legacy(fusion) else "", have,
                    own=own, own_fusion=own_fusion)


def problem_complete(rows: list[Measurement], problem: ConvProblem, options: TuneOptions) -> bool:
    """Whether ``rows`` (e.g. the cache's for this problem) hold everything :func:`measure_problem`
    would measure under ``options``: then nothing needs timing."""
    strategy, forced = options.strategy(problem.direction)
    legacy, engines = spaces(problem, options)
    fusion = problem.fusion if (engines and not epilogue.is_legacy(problem.fusion)) or (legacy and epilogue.is_legacy(problem.fusion)) else ""
    keys = candidate_keys(problem, options)
    own_fusion = problem.fusion if epilogue.is_legacy(problem.fusion) else ""
    return (complete(rows, keys, strategy, forced, legacy, engines, fusion)
            and (not own_space(problem, options, legacy) or own_complete(rows, keys, own_fusion)))


def own_space(problem: ConvProblem, options: TuneOptions, legacy: bool = True) -> bool:
    """Whether convpass's own kernels (:mod:`convpass.kernels.depthwise`) are timed for a
    problem: by the measure strategy, with the legacy space (they run where cuDNN's legacy
    algorithms do), where a geometry of the problem has a candidate."""
    strategy, _ = options.strategy(problem.direction)
    return strategy == "measure" and legacy and any(depthwise.candidates(shape) for shape in problem.candidates)


def own_complete(rows: Sequence[Measurement], keys: Sequence[ProblemKey], fusion: str = "") -> bool:
    """Whether ``rows`` hold every own-kernel candidate of ``keys`` and, for a legacy epilogue
    ``fusion``, the fastest one's fused row (where one of them was measured, not only estimated: the rule
    :meth:`_ShapeBench.measure_own` follows, so a cached re-run times nothing)."""
    for key in keys:
        timed = {m.algo: m for m in rows if m.key == key and m.method == "measure"}
        if not set(depthwise.candidates(key.shape)) <= set(timed):
            return False
        ran = any(Algo.parse(a).bare_of('own') and was_measured(m) for a, m in timed.items())
        if fusion and ran and not any(Algo.parse(a).is_own and Algo.parse(a).fusion == fusion for a in timed):
            return False
    return True


_warned_no_graph_api: set[str] = set()


def spaces(problem: ConvProblem, options: TuneOptions) -> tuple[bool, bool]:
    """(time legacy algorithms, time graph-API engines) for a problem under ``options``.

    Engines need the nvidia-cudnn-frontend package: ``--engines graph`` without it is an error;
    ``--engines all`` without it tunes the legacy algorithms and says so once.
    """
    from convpass.native.cudnn import graph_api

    legacy, engines = options.engine_space(problem.direction)
    if engines:
        why = graph_api.unavailable()
        if why is not None:
            if options.engines == "graph":
                raise OptionError(f"--engines graph: {why}")
            if why not in _warned_no_graph_api:
                _warned_no_graph_api.add(why)
                logger.warning("cuDNN graph-API engines are not tuned: %s. Legacy algorithms only.", why)
            return True, False
    return legacy, engines


def _measure(problem: ConvProblem, options: TuneOptions, keys: list[ProblemKey], strategy: str, forced: str | None, legacy: bool = True,
             engines: bool = False, best: float | None = None, fusion: str = "", have: Sequence[Measurement] = (),
             own: bool = False, own_fusion: str = "") -> list[Measurement]:
    """Every row of the problem's ``keys`` this call is asked for: the legacy algorithms, the
    graph-API engines, the epilogue ``fusion`` (a legacy one: its pass and the fused calls of
    the fastest legacy algorithms timed here or in ``have``; a graph-API one: its activation pass
    and fused graphs), and with ``own`` convpass's own kernels (bare, and the fastest with the
    legacy epilogue ``own_fusion``)."""
    from convpass.native.cudnn import ConvDescriptors, find, heuristic

    rows: list[Measurement] = []
    for shape in problem.candidates:
        bench = _ShapeBench(shape)
        try:
            # descriptors stay until the close candidates' head-to-head has replayed their groups
            with contextlib.ExitStack() as keep:
                for key in (k for k in keys if k.shape == shape):
                    now = time.time()
                    descs = keep.enter_context(ConvDescriptors(key))
                    ranked = heuristic(descs)
                    ok_ranked = [p for p in ranked if p.ok]
                    for rank, perf in enumerate(ok_ranked):
                        rows.append(_row(key, perf.algo, "ok", None, perf.workspace_bytes, perf.deterministic, now, "heuristic", heuristic_rank=rank))
                    to_time: list[str]
                    if strategy == "measure" and not legacy:
                        to_time = []
                    elif strategy == "measure":
                        from convpass.native.cudnn import algo_names

                        to_time = list(algo_names(shape.direction))
                    elif strategy == "forced":
                        to_time = [forced]
                    elif strategy == "heuristic":
                        to_time = [ok_ranked[0].algo] if ok_ranked else []
                    else:
                        buffers = bench.buffers(key.layout, 1)[0]
                        found = [p for p in find(descs, None, buffers["x"], buffers["w"], buffers["y"], workspace=bench.find_workspace()) if p.ok]
                        for rank, perf in enumerate(found):
                            rows.append(_row(key, perf.algo, "ok", perf.time_ms, perf.workspace_bytes, perf.deterministic, now, "find", find_rank=rank))
                        to_time = [found[0].algo] if found else []
                    # Also time the heuristic's first NCHW/default choice: it is the summary's baseline.
                    if (strategy != "measure" or not legacy) and key.layout == "nchw" and key.math == "default" and ok_ranked and ok_ranked[0].algo not in to_time:
                        to_time.append(ok_ranked[0].algo)
                    # cuDNN's own pick first: a good early "best" lets slow candidates stop early.
                    preferred = [p.algo for p in ok_ranked]
                    to_time.sort(key=lambda a: preferred.index(a) if a in preferred else len(preferred))
                    for algo in to_time:
                        t0 = time.perf_counter()
                        row = bench.measure(descs, key, algo, best, forced=strategy == "forced")
                        logger.debug("%s %s %s: %s %s (%.0f ms) %s", shape, key.layout, key.math, algo, row.status,
                                     (time.perf_counter() - t0) * 1e3, row.note)
                        rows.append(row)
                        best = _best_after(best, row)
                    if epilogue.is_legacy(fusion):
                        algos = fused_call_candidates([*rows, *have], key)
                        rows.extend(bench.measure_legacy_epilogue(descs, key, fusion, algos, best))
                    if own:
                        for row in bench.measure_own(key, own_fusion, best, [*rows, *have]):
                            rows.append(row)
                            best = _best_after(best, row) if not Algo.parse(row.algo).fusion else best
                    if engines:
                        for row in bench.measure_engines(key, best):
                            rows.append(row)
                            best = _best_after(best, row)
                    if fusion and not epilogue.is_legacy(fusion):
                        rows.extend(bench.measure_fused(key, fusion, best))
                rows = bench.settle(rows, problem, options, have)
        finally:
            bench.release()
    return rows


def fused_call_candidates(rows: Sequence[Measurement], key: ProblemKey) -> list[str]:
    """The legacy algorithms of ``key`` whose fused call with an epilogue is timed: the
    :data:`convpass.core.fusion.FUSED_CALL_CANDIDATES` fastest bare ones measured (not early-stopped estimates)."""
    timed = {m.algo: m.time_ms for m in rows
             if m.key == key and m.method == "measure" and was_measured(m)
             and Algo.parse(m.algo).bare_of('legacy')}
    return sorted(timed, key=lambda a: (timed[a], a))[:epilogue.FUSED_CALL_CANDIDATES]


def was_measured(row: Measurement) -> bool:
    """Whether ``row`` ran and was measured (an early-stopped estimate was not; a late stop's
    groups were: :mod:`convpass.tuning.harness`)."""
    return row.status == "ok" and row.time_ms is not None and "early stop" not in row.note


def _best_after(best: float | None, row: Measurement) -> float | None:
    """The best time so far after ``row`` (early-stopped estimates do not count)."""
    if was_measured(row):
        return row.time_ms if best is None else min(best, row.time_ms)
    return best


def skip_reason(key: ProblemKey, algo: str, forced: bool) -> str | None:
    """Why a candidate is not run at all (None: run it). Forced choices are always run."""
    if algo == "fft_tiling" and key.shape.groups > FFT_TILING_MAX_GROUPS and not forced:
        return f"skipped: cuDNN runs FFT tiling once per group (g={key.shape.groups}); seconds per launch"
    return None


def candidate_keys(problem: ConvProblem, options: TuneOptions) -> list[ProblemKey]:
    return [
        shape.key(layout, math)  # type: ignore[arg-type]
        for shape in problem.candidates
        for layout in options.layouts
        for math in options.math_modes(shape.dtype)
    ]


def complete(rows: list[Measurement], keys: list[ProblemKey], strategy: str, forced: str | None, legacy: bool = True,
             engines: bool = False, fusion: str = "") -> bool:
    """Whether the cache already holds everything this strategy needs for these keys (graph-API
    engines: at least one engine row per key, which :meth:`_ShapeBench.measure_engines` always
    writes, an ``unsupported`` one when cuDNN offers none; a ``fusion``: its epilogue row and at
    least one fused row per key, which :meth:`_ShapeBench.measure_fused` always writes for a
    graph-API fusion and :meth:`_ShapeBench.measure_legacy_epilogue` for a legacy one where a
    legacy algorithm of the key was timed)."""
    from convpass.core.cudnn_enums import algo_names

    for key in keys:
        mine = [m for m in rows if m.key == key]
        if not any(m.method == "heuristic" for m in mine):
            return False
        timed = {m.algo for m in mine if m.method == "measure"}
        if strategy == "measure" and legacy and not set(algo_names(key.shape.direction)) <= timed:
            return False
        if engines and not any(Algo.parse(a).is_engine and not Algo.parse(a).fusion for a in timed):
            return False
        if fusion and not any(m.method == EPILOGUE_METHOD and m.algo == fusion for m in mine):
            return False
        fused_rows = any(Algo.parse(a).fusion == fusion for a in timed)
        if fusion and not epilogue.is_legacy(fusion) and not fused_rows:
            return False
        if epilogue.is_legacy(fusion) and fused_call_candidates(mine, key) and not fused_rows:
            return False
        if strategy == "forced" and forced not in timed:
            return False
        if strategy == "exhaustive" and not any(m.method == "find" for m in mine):
            return False
        if strategy == "heuristic":
            first = min((m for m in mine if m.method == "heuristic"), key=lambda m: m.heuristic_rank, default=None)
            if first is not None and first.algo not in timed:
                return False
    return True


def _row(key, algo, status, time_ms, workspace, deterministic, now, method, note="", heuristic_rank=None, find_rank=None) -> Measurement:
    return Measurement(
        key=key,
        algo=algo,
        status=status,
        time_ms=time_ms,
        workspace_bytes=int(max(0, workspace)),
        deterministic=bool(deterministic),
        measured_at=now,
        method=method,
        note=note,
        heuristic_rank=heuristic_rank,
        find_rank=find_rank,
    )


_activation_kernels: dict[str, Any] = {}


def _activation_kernel(fusion: str) -> Any:
    """A CuPy element-wise kernel of ``fusion``'s activation (tuning time only: the executor runs
    its own generated kernels, compiled ahead of time)."""
    import cupy as cp

    from convpass.native.cudnn import graph_api

    if fusion not in _activation_kernels:
        expression = graph_api.FUSIONS[fusion].cuda
        _activation_kernels[fusion] = cp.ElementwiseKernel(
            "T x", "T y", f"float v = (float)x; y = (T)({expression});", f"convpass_{graph_api.FUSIONS[fusion].frontend_op}")
    return _activation_kernels[fusion]


class _ShapeBench:
    """Random inputs, rotation sets and the reference output for one geometry."""

    def __init__(self, shape: ConvShape) -> None:
        self.shape = shape
        self._sets: dict[str, list[dict]] = {}
        self._reference = None
        self._engine_biases: dict[str, tuple[Any, Any]] = {}
        # (key, algo) -> the captured group its timing replayed, and what that group needs kept
        # alive (its workspace, its plan or kernel): for the close candidates' head-to-head
        self._groups: dict[tuple[ProblemKey, str], tuple[Any, int, Any]] = {}
        self._group_budget: int | None = None
        self._base = {
            name: harness.random_array(dims, shape.dtype, "nchw", seed, scale)
            for name, dims, seed, scale in (
                ("x", shape.x_shape, 1, 1.0),
                ("w", shape.w_shape, 2, (shape.c // shape.groups * harness.prod(shape.kernel)) ** -0.5),
                ("y", shape.y_shape, 3, 1.0),
            )
        }

    def buffers(self, layout: str, count: int) -> list[dict]:
        """``count`` input sets in ``layout``: set 0 holds the random base data (the one checked);
        the others exist to rotate the data out of L2 between launches, so they are copies of that
        (a conv's speed does not depend on its values; drawing random numbers for each of up to 64
        sets took 4 s of a ResNet-50's tuning)."""
        from convpass.native.cudnn import as_layout, empty_like_layout

        have = self._sets.setdefault(layout, [])
        if not have:
            have.append({name: as_layout(array, layout).copy() if layout == "nchw" else as_layout(array, layout) for name, array in self._base.items()})

        def copy(a: Any) -> Any:
            out = empty_like_layout(a.shape, self.shape.dtype, layout)
            out[...] = a
            return out

        while len(have) < count:  # from the base data: set 0's output holds whatever the last check wrote
            have.append({name: copy(a) for name, a in self._base.items()})
        return have[:count]

    def find_workspace(self) -> int:
        import cupy as cp

        free, _ = cp.cuda.runtime.memGetInfo()
        return int(min(free // 4, 1 << 30))

    def reference(self):
        """float32 output of a deterministic FMA algorithm on set 0 (NCHW), computed once."""
        if self._reference is not None:
            return self._reference
        from convpass.native.cudnn import ConvDescriptors, CudnnError, run

        key = self.shape.key("nchw", "fma")
        out_name = OUTPUT[self.shape.direction]
        base = self.buffers("nchw", 1)[0]
        with ConvDescriptors(key) as descs:
            for algo in REFERENCE_ALGOS[self.shape.direction]:
                try:
                    run(descs, None, algo, base["x"], base["w"], base["y"])
                except CudnnError:
                    continue
                self._reference = harness.to_float32(base[out_name], self.shape.dtype).copy()
                # restore the output buffer's random content for later timings of other directions
                return self._reference
        raise RuntimeError(f"no deterministic reference algorithm supports {self.shape}")

    def measure(self, descs, key: ProblemKey, algo: str, best_ms: float | None, forced: bool = False) -> Measurement:
        """One legacy algorithm: checked against the reference, then timed."""
        import cupy as cp

        from convpass.native.cudnn import CudnnError, is_deterministic, run, workspace_size

        now = time.time()
        det = is_deterministic(key.shape.direction, algo)
        why = skip_reason(key, algo, forced)
        if why:
            return _row(key, algo, "skipped", None, 0, det, now, "measure", note=why)
        try:
            ws = workspace_size(descs, None, algo)
        except CudnnError as e:
            status = "unsupported" if e.not_supported else "error"
            return _row(key, algo, status, None, 0, det, now, "measure", note=str(e))
        try:
            return self._checked_and_timed(
                key, algo, ws, det, now, best_ms,
                lambda b, workspace: run(descs, None, algo, b["x"], b["w"], b["y"], workspace=workspace))
        except cp.cuda.memory.OutOfMemoryError as e:
            return _row(key, algo, "oom", None, ws, det, now, "measure", note=str(e).splitlines()[0])
        except CudnnError as e:
            status = "oom" if "ALLOC" in e.status_name else ("unsupported" if e.not_supported else "error")
            return _row(key, algo, status, None, ws, det, now, "measure", note=str(e))

    def measure_engines(self, key: ProblemKey, best_ms: float | None, fusion: str = "") -> list[Measurement]:
        """Every graph-API engine configuration of ``key`` (``y = conv(x, w)``, or the graph of
        ``fusion``), checked against the reference and timed like the legacy algorithms. Always at
        least one row: ``engine:none`` (unsupported) when cuDNN offers no configuration."""
        from convpass.native.cudnn import graph_api

        now = time.time()
        none = str(Algo("engine", "none", fusion))
        try:
            enumerated = graph_api.enumerate_configs(key, fusion)
        except graph_api.GraphApiError as e:
            return [_row(key, none, "unsupported", None, 0, True, now, "measure", note=str(e))]
        found = enumerated.configs()
        if not found:
            return [_row(key, none, "unsupported", None, 0, True, now, "measure", note="cuDNN offers no engine configuration")]
        rows = []
        for config in found:
            row = self._measure_engine(key, config, best_ms, enumerated)
            rows.append(row)
            best_ms = _best_after(best_ms, row)
        return rows

    def measure_fused(self, key: ProblemKey, fusion: str, best_ms: float | None) -> list[Measurement]:
        """A fused epilogue for ``key``: its activation timed as its own pass over the output (the
        ``epilogue`` row every unfused configuration adds: :mod:`convpass.tuning.decide`), then every
        engine configuration of the fused graph (:meth:`measure_engines`)."""
        epilogue = self._measure_activation(key, fusion)
        if epilogue.status == "ok" and best_ms is not None:
            best_ms += epilogue.time_ms  # an early stop compares a fused graph with conv + pass
        return [epilogue, *self.measure_engines(key, best_ms, fusion)]

    def _measure_activation(self, key: ProblemKey, fusion: str) -> Measurement:
        """The activation of ``fusion`` as the executor runs it after an unfused conv: one
        element-wise pass over the output's storage, in place."""
        import cupy as cp

        from convpass.native.cuda import storage

        now = time.time()
        try:
            kernel = _activation_kernel(fusion)
            sets = self.buffers(key.layout, harness.rotation_sets(sum(a.nbytes for a in self._base.values())))
            timing = harness.time_launches(lambda i: kernel(storage(sets[i]["y"]), storage(sets[i]["y"])), len(sets))
        except cp.cuda.memory.OutOfMemoryError as e:
            return _row(key, fusion, "oom", None, 0, True, now, EPILOGUE_METHOD, note=str(e).splitlines()[0])
        return _row(key, fusion, "ok", timing.time_ms, 0, True, now, EPILOGUE_METHOD,
                    note=f"its activation as its own pass over the output; {timing.launches} launches, spread {timing.spread:.1%}")

    def measure_legacy_epilogue(self, descs, key: ProblemKey, name: str, algos: Sequence[str], best_ms: float | None) -> list[Measurement]:
        """A legacy epilogue for ``key`` (:mod:`convpass.core.fusion`): the executor's one-pass
        epilogue over the output (the ``epilogue`` row an unfused configuration adds), then
        cuDNN's fused conv + bias + activation call of each of ``algos``, checked and timed."""
        rows = [self._measure_epilogue_pass(key, name)]
        if rows[0].status == "ok" and best_ms is not None:
            best_ms += rows[0].time_ms  # an early stop compares a fused call with conv + pass
        for algo in algos:
            rows.append(self._measure_fused_call(descs, key, algo, name, best_ms))
            best_ms = _best_after(best_ms, rows[-1])
        return rows

    def measure_own(self, key: ProblemKey, fusion: str, best_ms: float | None, have: Sequence[Measurement] = ()) -> list[Measurement]:
        """convpass's own kernels for ``key`` (:func:`convpass.kernels.depthwise.candidates`),
        checked and timed like the legacy algorithms; then, with a legacy epilogue ``fusion``, the
        fastest of them (timed here or in ``have``) with the epilogue in the kernel. Candidates
        already in ``have`` are not timed again."""
        done = {m.algo for m in have if m.key == key and m.method == "measure"}
        rows = []
        for algo in depthwise.candidates(key.shape):
            if algo not in done:
                rows.append(self._measure_own(key, algo, "", best_ms))
                best_ms = _best_after(best_ms, rows[-1])
        bare = [m for m in [*rows, *have] if m.key == key and m.method == "measure" and was_measured(m)
                and Algo.parse(m.algo).bare_of('own')]
        if epilogue.is_legacy(fusion) and bare:
            fastest = min(bare, key=lambda m: (m.time_ms, m.algo)).algo
            if str(Algo.parse(fastest).fused(fusion)) not in done:
                rows.append(self._measure_own(key, fastest, fusion, None))
        return rows

    def _measure_own(self, key: ProblemKey, algo: str, fusion: str, best_ms: float | None) -> Measurement:
        """One own kernel, bare or with the legacy epilogue ``fusion`` in it."""
        import cupy as cp

        now = time.time()
        name = str(Algo.parse(algo).fused(fusion))
        try:
            kernel = depthwise.DepthwiseKernel.of(algo, key.shape, key.layout)
        except ValueError as e:  # a shape or name it refuses
            return _row(key, name, "unsupported", None, 0, True, now, "measure", note=str(e).splitlines()[0])
        try:
            kernel.build(cp)
        except Exception as e:  # noqa: BLE001  (a compiler or driver error: recorded, tuning goes on with the others)
            return _row(key, name, "error", None, 0, True, now, "measure", note=f"the kernel did not build: {str(e).splitlines()[0]}")
        try:
            sets = self.buffers(key.layout, harness.rotation_sets(sum(a.nbytes for a in self._base.values())))
            bias, expected, residual, relu = None, None, False, False
            if fusion:
                residual, relu = epilogue.parts(fusion)
                bias, expected = self._epilogue_inputs(key, fusion, sets)

            weights = {id(b): kernel.weight(cp, b["w"]) for b in sets}  # as the executor passes them

            def launch(b: dict, workspace: Any) -> None:
                kernel(cp, b["x"], weights[id(b)], b["y"], bias, b["z"] if residual else None, relu)

            row = self._checked_and_timed(key, name, 0, True, now, best_ms, launch, capture_required=True, expected=expected)
        except cp.cuda.memory.OutOfMemoryError as e:
            return _row(key, name, "oom", None, 0, True, now, "measure", note=str(e).splitlines()[0])
        if row.status == "ok":
            row = dataclasses.replace(row, note=f"{row.note}; convpass's own kernel{f', {fusion} in it' if fusion else ''}")
        return row

    def _epilogue_inputs(self, key: ProblemKey, name: str, sets: list[dict]) -> tuple[Any, Any]:
        """The bias of a legacy epilogue's timings (and its residual in every set), and what the
        conv with that epilogue must give on set 0: ``act(reference + b + z)``."""
        import cupy as cp

        residual, relu = epilogue.parts(name)
        bias = self._bias_and_residuals(key, residual, sets)
        expected = self.reference() + harness.to_float32(bias, key.shape.dtype).reshape((1, -1) + (1,) * len(key.shape.spatial))
        if residual:
            expected = expected + harness.to_float32(sets[0]["z"], key.shape.dtype)
        return bias, (cp.maximum(expected, 0) if relu else expected)

    def _bias_and_residuals(self, key: ProblemKey, residual: bool, sets: list[dict]) -> Any:
        """The bias of the epilogue timings (``(K,)``), and with ``residual`` a ``z`` in every set."""
        if residual:
            for i, b in enumerate(sets):
                if "z" not in b:
                    b["z"] = harness.random_array(self.shape.y_shape, self.shape.dtype, key.layout, 40 + i)
        return harness.random_array((self.shape.k,), self.shape.dtype, "nchw", 5)

    def _measure_epilogue_pass(self, key: ProblemKey, name: str) -> Measurement:
        import cupy as cp

        from convpass.kernels.convolution import apply_epilogue

        now = time.time()
        residual, relu = epilogue.parts(name)
        try:
            sets = self.buffers(key.layout, harness.rotation_sets(sum(a.nbytes for a in self._base.values())))
            bias = self._bias_and_residuals(key, residual, sets)
            timing = harness.time_launches(lambda i: apply_epilogue(cp, sets[i]["y"], bias, relu, sets[i]["z"] if residual else None), len(sets))
        except cp.cuda.memory.OutOfMemoryError as e:
            return _row(key, name, "oom", None, 0, True, now, EPILOGUE_METHOD, note=str(e).splitlines()[0])
        return _row(key, name, "ok", timing.time_ms, 0, True, now, EPILOGUE_METHOD,
                    note=f"the executor's one element-wise pass over the output; {timing.launches} launches, spread {timing.spread:.1%}")

    def _measure_fused_call(self, descs, key: ProblemKey, algo: str, name: str, best_ms: float | None) -> Measurement:
        """``algo`` with the epilogue fused into its call (cudnnConvolutionBiasActivationForward)."""
        import cupy as cp

        from convpass.native.cudnn import CudnnError, conv_bias_activation_forward, is_deterministic, workspace_size

        now = time.time()
        fused = str(Algo.parse(algo).fused(name))
        det = is_deterministic("fwd", algo)
        residual, relu = epilogue.parts(name)
        activation = "relu" if relu else "identity"
        ws = 0
        try:
            ws = workspace_size(descs, None, algo)
            sets = self.buffers(key.layout, harness.rotation_sets(sum(a.nbytes for a in self._base.values())))
            bias, expected = self._epilogue_inputs(key, name, sets)

            def launch(b: dict, workspace: Any) -> None:
                conv_bias_activation_forward(descs, algo, b["x"], b["w"], b["y"], bias, z=b["z"] if residual else None,
                                             activation=activation, workspace=workspace)

            row = self._checked_and_timed(key, fused, ws, det, now, best_ms, launch, expected=expected)
        except cp.cuda.memory.OutOfMemoryError as e:
            return _row(key, fused, "oom", None, ws, det, now, "measure", note=str(e).splitlines()[0])
        except ValueError as e:  # a pairing cuDNN does not implement (identity needs implicit_precomp_gemm)
            return _row(key, fused, "unsupported", None, ws, det, now, "measure", note=str(e))
        except CudnnError as e:
            status = "oom" if "ALLOC" in e.status_name else ("unsupported" if e.not_supported else "error")
            return _row(key, fused, status, None, ws, det, now, "measure", note=str(e))
        if row.status == "ok":
            row = dataclasses.replace(row, note=f"{row.note}; the conv with {name} in one cuDNN call")
        return row

    def _engine_bias(self, fusion: str) -> tuple[Any, Any]:
        """The bias every engine candidate of this geometry is timed with, and the expected output
        of conv + bias (+ ``fusion``'s activation): made once per fusion, not per candidate."""
        import cupy as cp

        from convpass.native.cudnn import graph_api

        if fusion not in self._engine_biases:
            shape = self.shape
            bias = harness.random_array((1, shape.k) + (1,) * len(shape.spatial), shape.dtype, "nchw", 5)
            expected = self.reference() + harness.to_float32(bias, shape.dtype)
            if fusion:
                expected = graph_api.FUSIONS[fusion].apply(cp, expected)
            self._engine_biases[fusion] = (bias, expected)
        return self._engine_biases[fusion]

    def _measure_engine(self, key: ProblemKey, config, best_ms: float | None, enumerated=None) -> Measurement:
        import cupy as cp

        from convpass.native.cudnn import graph_api
        from convpass.native.cuda import storage

        now = time.time()
        algo = config.algo
        try:
            started = time.perf_counter()
            plan = graph_api.EnginePlan(key, config, enumerated)
            build_s = time.perf_counter() - started
        except graph_api.GraphApiError as e:
            return _row(key, algo, "unsupported", None, 0, True, now, "measure", note=str(e))
        ws = plan.workspace_bytes
        try:
            # Timed as the executor runs it: the conv, then the bias as its own pass (legacy algorithms
            # are timed without their bias, which the executor can often fuse into their call); a fused
            # graph in its one call. The executor replays a captured CUDA graph: an engine that cannot
            # be captured is no candidate.
            bias, expected = self._engine_bias(config.fusion)
            if config.fusion:
                flat = bias.reshape(-1)

                def launch(b: dict, workspace: Any) -> None:
                    plan.execute(b["x"], b["w"], b["y"], workspace, bias=flat)
            else:
                def launch(b: dict, workspace: Any) -> None:
                    plan.execute(b["x"], b["w"], b["y"], workspace)
                    phys = storage(b["y"])
                    phys += bias if phys is b["y"] else bias.reshape(-1)

            row = self._checked_and_timed(key, algo, ws, True, now, best_ms, launch, capture_required=True, expected=expected)
        except cp.cuda.memory.OutOfMemoryError as e:
            return _row(key, algo, "oom", None, ws, True, now, "measure", note=str(e).splitlines()[0])
        except graph_api.GraphApiError as e:
            return _row(key, algo, "error", None, ws, True, now, "measure", note=str(e))
        if row.status == "ok":
            how = f"fused {config.fusion} in one call" if config.fusion else "conv then bias pass"
            row = dataclasses.replace(row, note=f"{row.note}; graph API, {how}; plan built in {build_s:.3f} s")
        return row

    def _checked_and_timed(self, key: ProblemKey, algo: str, ws: int, det: bool, now: float, best_ms: float | None,
                           launch: Callable[[dict, Any], None], capture_required: bool = False, expected: Any = None) -> Measurement:
        """``launch(buffers, workspace)`` run once on set 0 and checked against the reference (or
        ``expected``; a
        ``wrong_result`` row past the tolerance), then timed over the rotation sets (an ``ok``
        row; ``unsupported`` when ``capture_required`` and its launches could not be captured).
        CUDA and cuDNN errors propagate: the callers know what they mean."""
        import cupy as cp

        out_name = OUTPUT[key.shape.direction]
        reference = self.reference() if expected is None else expected
        workspace = cp.empty(max(ws, 1), dtype=cp.uint8)
        per_set = sum(a.nbytes for a in self._base.values())
        sets = self.buffers(key.layout, harness.rotation_sets(per_set))
        check = sets[0]
        check[out_name].fill(float("nan")) if key.shape.dtype != "bfloat16" else check[out_name].fill(0x7FC0)
        first_ms = harness.first_launch_ms(lambda: launch(check, workspace))  # also the timing's warm-up
        out = check[out_name] if key.shape.dtype != "bfloat16" else harness.to_float32(check[out_name], "bfloat16")
        err = harness.relative_error(out, reference)
        tolerance = TOLERANCE[(key.shape.dtype, key.math)]
        if not err <= tolerance:
            return _row(key, algo, "wrong_result", None, ws, det, now, "measure", note=f"relative error {err:.2e} > {tolerance:.0e}")
        timing = harness.time_launches(lambda i: launch(sets[i], workspace), len(sets), best_ms, first_ms=first_ms)
        if capture_required and timing.eager:
            return _row(key, algo, "unsupported", None, ws, det, now, "measure", note="its launches cannot be captured into a CUDA graph")
        if timing.group is not None and self.group_bytes() + ws <= self.group_budget():
            self._groups[(key, algo)] = (timing.group, timing.group_launches, (workspace, launch))
        note = f"relative error {err:.1e}; {timing.launches} launches, spread {timing.spread:.1%}"
        if timing.early_stop:
            note += f"; early stop: {timing.stopped_by} ({best_ms:.4f} ms)"
        elif timing.stopped_by:  # a late stop: a measurement from fewer groups, not an estimate
            note += f"; stopped there, {timing.stopped_by} ({best_ms:.4f} ms)"
        if timing.eager:
            note += "; eager launches (not capturable): includes launch overhead"
        return _row(key, algo, "ok", timing.time_ms, ws, det, now, "measure", note=note)

    def group_bytes(self) -> int:
        """Workspace the kept groups hold."""
        return sum(workspace.nbytes for _, _, (workspace, _) in self._groups.values())

    def group_budget(self) -> int:
        """Bytes of workspace the kept groups may hold (:data:`HEAD_TO_HEAD_WORKSPACE_BYTES`)."""
        if self._group_budget is None:
            import cupy as cp

            self._group_budget = min(HEAD_TO_HEAD_WORKSPACE_BYTES, cp.cuda.runtime.memGetInfo()[1] // 32)
        return self._group_budget

    def settle(self, rows: list[Measurement], problem: ConvProblem, options: TuneOptions,
               have: Sequence[Measurement] = ()) -> list[Measurement]:
        """``rows`` with this geometry's close candidates timed again in turn
        (:func:`convpass.tuning.harness.head_to_head`). Close: allowed by ``options`` and within
        :data:`HEAD_TO_HEAD_MARGIN` of the best of all the problem's rows (``have`` too) by the
        decision's cost (:func:`convpass.tuning.decide.cost_ms`), the :data:`HEAD_TO_HEAD_MAX` best of
        them. Only when every one of them kept its group here; else ``rows`` as they are, since a
        candidate not timed in turn could not be weighed against the others. Their times take their
        order from the turns and keep their first timings' mean, so that the fastest of them stays at
        or below the first timing of any candidate left out. A CUDA or cuDNN error in the turns
        leaves ``rows`` as they are, with a warning."""
        strategy, _ = options.strategy(problem.direction)
        if strategy not in ("measure", "forced") or len(self._groups) < 2:
            return rows
        considered = [*rows, *have]
        epilogue_of = epilogue_ms(considered, problem)
        ok = allowed(problem, options, epilogue_of)
        timed = sorted((cost, i) for i, m in enumerate(considered) if m.method == "measure" and ok(m)
                       and (cost := cost_ms(m, epilogue_of, problem.fusion)) is not None)
        close = [i for cost, i in timed if cost <= timed[0][0] * (1 + HEAD_TO_HEAD_MARGIN)][:HEAD_TO_HEAD_MAX] if timed else []
        if len(close) < 2 or any(i >= len(rows) or (rows[i].key, rows[i].algo) not in self._groups for i in close):
            return rows
        try:
            turns = harness.head_to_head([self._groups[(rows[i].key, rows[i].algo)][:2] for i in close])
        except Exception as e:  # noqa: BLE001  (a CUDA or cuDNN error: the first timings stand)
            logger.warning("the close candidates of %s were not timed again in turn: %s", self.shape, e)
            return rows
        level = statistics.fmean(rows[i].time_ms for i in close) / statistics.fmean(turns)
        out = list(rows)
        for i, t in zip(close, turns):
            m = rows[i]
            out[i] = dataclasses.replace(m, time_ms=t * level, note=f"{m.note}; timed again in turn with {len(close) - 1} close "
                                                                       f"candidate(s): {t:.5f} ms, {m.time_ms:.5f} -> {t * level:.5f} ms at the first timings' level")
        return out

    def release(self) -> None:
        self._groups.clear()
        self._sets.clear()
        self._base.clear()
        self._engine_biases.clear()
        self._reference = None

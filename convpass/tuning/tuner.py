"""The measuring decision backend: tunes every problem on the local GPU through cuDNN.

For each distinct problem and each candidate configuration (geometry mapping x memory format x math
type allowed by the options):

* cuDNN's heuristic ranking (``_v7``) is recorded for every configuration (it is also the baseline
  the summary compares against: its first choice in NCHW with default math, as frameworks run);
* ``exhaustive`` mode adds cuDNN's own Find; ``measure`` mode (the default) times every algorithm
  cuDNN supports with :mod:`convpass.tuning.harness`, and convpass's own kernels where they apply
  (:mod:`convpass.kernels.depthwise`: depthwise convs; :func:`own_space`); ``heuristic`` / ``exhaustive`` / forced modes
  time only the configuration they pick, so every recorded time comes from the same harness;
* every candidate is the execution object the executor runs for that decision
  (:mod:`convpass.kernels.conv_exec`), made and timed per family by
  :mod:`convpass.tuning.candidates`; its launch is first run once and checked against a reference
  computed by a deterministic algorithm with FMA math (no TF32) on the same random inputs, within a
  tolerance that fits its math type (:mod:`convpass.tuning.shape_bench`); a wrong result, an error
  or running out of memory is recorded as such and the algorithm is skipped — tuning always continues;
* a problem whose input is a channel slice (``ConvProblem.x_slice``: a Concat's buffer, a Split's
  input) is measured under keys that name it: every candidate reads that slice, or is timed with
  the copy the executor makes where it cannot (:mod:`convpass.tuning.shape_bench`); its rows never
  stand for the packed read's, nor these for its; so for a problem whose output is written into a
  channel slice of a Concat's buffer (``ConvProblem.y_slice``), in place or with the copy into it,
  and for one whose fused residual is read from a channel slice (``ConvProblem.z_slice``), in
  place where the fused graph takes its strides, else with the copy into a packed residual;
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
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from convpass.core import fusion as epilogue
from convpass.core.algo import Algo
from convpass.core.device import DeviceFingerprint
from convpass.core.errors import OptionError
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem, ProblemKey
from convpass.kernels import depthwise
from convpass.tuning import harness
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement, current
from convpass.tuning.candidates import Candidates
from convpass.tuning.decide import EPILOGUE_METHOD, Choice, cached_rows, choice_from, cost_ms, epilogue_ms, select
from convpass.tuning.prune import PRUNED, History, Pruner, needs_fallback
from convpass.tuning.shape_bench import ShapeBench, best_after, make_row, was_measured

logger = logging.getLogger("convpass")


@dataclasses.dataclass
class TuningSummary:
    measured: int = 0  # problems timed now
    cached: int = 0  # problems whose rows the tuning cache held
    failed: int = 0  # problems left undecided (no configuration passed)
    cached_decided: int = 0  # of the cached problems, those decided
    seconds: float = 0.0
    pruning: str = ""  # with --prune learned: what it skipped, or why it skipped nothing


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
        self.pruner: Pruner | None = None

    # ---------------------------------------------------------------------------------------
    def decide(self, problems: Sequence[ConvProblem], options: TuneOptions) -> dict[ConvProblem, Choice | None]:
        started = time.perf_counter()
        self.pruner = self._pruner(options)
        out: dict[ConvProblem, Choice | None] = {}
        columns = (TextColumn("tuning"), BarColumn(), MofNCompleteColumn(), TextColumn("problems"), TimeRemainingColumn())
        with Progress(*columns, console=self.console, transient=True) as progress:
            task = progress.add_task("tuning", total=len(problems))
            for problem in problems:
                out[problem] = self._decide_one(problem, options)
                progress.advance(task)
        self.summary.seconds = time.perf_counter() - started
        if self.pruner is not None:
            rule = self.pruner.rule
            self.summary.pruning = (
                f"--prune learned: {self.pruner.skipped} candidate(s) skipped (families that never won nor came within "
                f"{100 * rule.near:.0f}% in {rule.min_problems} or more problems of their geometry class on this GPU); "
                f"{self.pruner.full} key(s) searched in full (a class with fewer known problems, or every {rule.explore_every}-th of a class)")
            logger.debug("%s", self.summary.pruning)
        return out

    def _pruner(self, options: TuneOptions) -> Pruner | None:
        """The pruning rule of this run: the cache's history on this device, read once; None with
        ``--prune off`` or where the device has no history (then everything is measured, and said)."""
        if options.prune != "learned":
            return None
        history = History.learn(self.cache.device_rows(self.device))
        if not history:
            self.summary.pruning = f"--prune learned: the tuning cache has no history on {self.device}: every candidate is measured"
            logger.debug("%s", self.summary.pruning)
            return None
        return Pruner(history)

    def _decide_one(self, problem: ConvProblem, options: TuneOptions) -> Choice | None:
        strategy, _ = options.strategy(problem.direction)
        rows = current(cached_rows(self.cache, self.device, problem))
        from_cache = problem_complete(rows, problem, options)
        if from_cache:
            self.summary.cached += 1
        else:
            with self._stream():
                fresh = measure_problem(problem, options, rows, self.pruner)
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
        key = problem.primary.key("nchw", "default", problem.x_slice, problem.y_slice, problem.z_slice)
        first = next((m for m in rows if m.key == key and m.method == "heuristic" and m.heuristic_rank == 0 and m.status == "ok"), None)
        if first is None:
            return
        timed = next((m for m in rows if m.key == key and m.algo == first.algo and m.method == "measure" and m.time_ms is not None), None)
        if timed is not None:  # with its epilogue as its own pass, as the chosen time has it
            self.baseline_ms[problem] = cost_ms(timed, epilogue_ms(rows, problem), problem.fusion)


def measure_transpose(dims: tuple[int, ...], dtype: str) -> float:
    """Measured time (ms) of converting a ``dims`` tensor from channels-first to channels-last, on
    the current GPU with its clocks warmed first, as for every conv it is weighed against (cold and
    warm copies time alike; the warm-up keeps the harness one)."""
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


def measure_problem(problem: ConvProblem, options: TuneOptions, have: Sequence[Measurement] = (),
                    pruner: Pruner | None = None) -> list[Measurement]:
    """Measure one problem on the current GPU as ``options`` ask and return every row; writes
    nothing (the caller stores the rows: the tuner in its cache, a fleet worker by sending them to
    the driver). Runs with a non-default CuPy stream current; warms the clocks first.

    ``have``: rows already stored for the problem. When they hold every legacy measurement, only
    the graph-API engines are measured (a cache filled before engines existed is not re-timed);
    when they also hold the engines, only the problem's fused epilogue (a legacy epilogue's
    engine graphs too, where engines are tuned: :func:`engine_epilogue_complete`).

    ``pruner`` (:mod:`convpass.tuning.prune`): the legacy algorithms and engines of each key are
    timed in its order and those it skips are ``skipped`` rows saying why; where none of the kept
    ones ran, the skipped ones are timed too.
    """
    strategy, forced = options.strategy(problem.direction)
    have = current(have)  # engine rows timed before plans read input (wrote output) slices: timed again
    harness.warm_clocks()
    legacy, engines = spaces(problem, options)
    own = own_space(problem, options, legacy)
    fusion = problem.fusion if engines or epilogue.is_legacy(problem.fusion) else ""
    engine_fusion = problem.fusion if engines and epilogue.is_legacy(problem.fusion) else ""
    own_fusion = problem.fusion if epilogue.is_legacy(problem.fusion) else ""
    keys = candidate_keys(problem, options)
    have = list(have)
    best = None
    legacy_fusion = legacy and epilogue.is_legacy(fusion)
    pruned_ok = options.prune == "learned"
    if legacy and complete(have, keys, strategy, forced, legacy=True, engines=False, pruned_ok=pruned_ok):
        legacy = False
        if engines and complete(have, keys, strategy, forced, legacy=False, engines=True, pruned_ok=pruned_ok):
            engines = False
        timed = [m.time_ms for m in have if m.key in keys and m.status == "ok" and m.method == "measure" and m.time_ms]
        best = min(timed, default=None)
    if legacy_fusion and complete(have, keys, strategy, forced, legacy=False, engines=False, fusion=fusion, pruned_ok=pruned_ok):
        legacy_fusion = False
    if own and own_complete(have, keys, own_fusion):
        own = False
    if engine_fusion and engine_epilogue_complete(have, keys, engine_fusion):
        engine_fusion = ""
    return _measure(problem, options, keys, strategy, forced, legacy, engines, best, fusion if legacy_fusion or not epilogue.is_legacy(fusion) else "", have,
                    own=own, own_fusion=own_fusion, pruner=pruner if strategy == "measure" else None, engine_fusion=engine_fusion)


def problem_complete(rows: list[Measurement], problem: ConvProblem, options: TuneOptions) -> bool:
    """Whether ``rows`` (e.g. the cache's for this problem) hold everything :func:`measure_problem`
    would measure under ``options``: then nothing needs timing (rows :func:`~convpass.tuning.shape_bench.current`
    drops do not count)."""
    rows = current(rows)
    strategy, forced = options.strategy(problem.direction)
    legacy, engines = spaces(problem, options)
    fusion = problem.fusion if (engines and not epilogue.is_legacy(problem.fusion)) or (legacy and epilogue.is_legacy(problem.fusion)) else ""
    keys = candidate_keys(problem, options)
    own_fusion = problem.fusion if epilogue.is_legacy(problem.fusion) else ""
    return (complete(rows, keys, strategy, forced, legacy, engines, fusion, pruned_ok=options.prune == "learned")
            and (not own_space(problem, options, legacy) or own_complete(rows, keys, own_fusion))
            and (not engines or not epilogue.is_legacy(problem.fusion) or engine_epilogue_complete(rows, keys, problem.fusion)))


def engine_epilogue_complete(rows: Sequence[Measurement], keys: Sequence[ProblemKey], fusion: str) -> bool:
    """Whether ``rows`` hold, for every key, what
    :meth:`~convpass.tuning.candidates.Candidates.measure_engine_epilogue` writes for the legacy
    epilogue ``fusion``: its pass row, the bias pass row and at least one row of its engine graph
    (``engine:none+<fusion>`` where cuDNN offers none)."""
    for key in keys:
        mine = [m for m in rows if m.key == key]
        passes = {m.algo for m in mine if m.method == EPILOGUE_METHOD}
        if not {fusion, epilogue.LEGACY[0]} <= passes:
            return False
        if not any(m.method == "measure" and Algo.parse(m.algo).is_engine and Algo.parse(m.algo).fusion == fusion for m in mine):
            return False
    return True


def own_space(problem: ConvProblem, options: TuneOptions, legacy: bool = True) -> bool:
    """Whether convpass's own kernels (:mod:`convpass.kernels.depthwise`) are timed for a
    problem: by the measure strategy, with the legacy space (they run where cuDNN's legacy
    algorithms do), where a geometry of the problem has a candidate."""
    strategy, _ = options.strategy(problem.direction)
    return strategy == "measure" and legacy and any(depthwise.candidates(shape) for shape in problem.candidates)


def own_complete(rows: Sequence[Measurement], keys: Sequence[ProblemKey], fusion: str = "") -> bool:
    """Whether ``rows`` hold every own-kernel candidate of ``keys`` and, for a legacy epilogue
    ``fusion``, the fastest one's fused row (where one of them was measured, not only estimated: the rule
    :meth:`~convpass.tuning.candidates.Candidates.measure_own` follows, so a cached re-run times nothing)."""
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
             own: bool = False, own_fusion: str = "", pruner: Pruner | None = None, engine_fusion: str = "") -> list[Measurement]:
    """Every row of the problem's ``keys`` this call is asked for: the legacy algorithms, the
    graph-API engines, the epilogue ``fusion`` (a legacy one: its pass and the fused calls of
    the fastest legacy algorithms timed here or in ``have``; a graph-API one: its activation pass
    and fused graphs), with ``own`` convpass's own kernels (bare, and the fastest with the
    legacy epilogue ``own_fusion``), and with ``engine_fusion`` (a legacy epilogue) the engines'
    fused graphs of it."""
    from convpass.native.cudnn import ConvDescriptors, as_layout, find, heuristic

    rows: list[Measurement] = []
    for shape in problem.candidates:
        bench = ShapeBench(shape, problem.x_slice, problem.y_slice, problem.z_slice)
        candidates = Candidates(bench)
        try:
            # descriptors stay until the close candidates' head-to-head has replayed their groups
            with contextlib.ExitStack() as keep:
                for key in (k for k in keys if k.shape == shape):
                    now = time.time()
                    descs = keep.enter_context(ConvDescriptors(key))
                    ranked = heuristic(descs)
                    ok_ranked = [p for p in ranked if p.ok]
                    for rank, perf in enumerate(ok_ranked):
                        rows.append(make_row(key, perf.algo, "ok", None, perf.workspace_bytes, perf.deterministic, now, "heuristic", heuristic_rank=rank))
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
                        # Find takes packed tensors: its pick is timed below as the key reads and writes
                        x, y = as_layout(buffers["x"], key.layout), as_layout(buffers["y"], key.layout)
                        found = [p for p in find(descs, None, x, buffers["w"], y, workspace=bench.find_workspace()) if p.ok]
                        packed = [what for what, s in (("input", key.x_slice), ("output", key.y_slice)) if s is not None]
                        for rank, perf in enumerate(found):
                            note = f"Find timed a packed copy of the {' and the '.join(packed)}" if packed else ""
                            rows.append(make_row(key, perf.algo, "ok", perf.time_ms, perf.workspace_bytes, perf.deterministic, now, "find",
                                                 note, find_rank=rank))
                        to_time = [found[0].algo] if found else []
                    # Also time the heuristic's first NCHW/default choice: it is the summary's baseline.
                    if (strategy != "measure" or not legacy) and key.layout == "nchw" and key.math == "default" and ok_ranked and ok_ranked[0].algo not in to_time:
                        to_time.append(ok_ranked[0].algo)
                    # cuDNN's own pick first: a good early "best" lets slow candidates stop early.
                    preferred = [p.algo for p in ok_ranked]
                    to_time.sort(key=lambda a: preferred.index(a) if a in preferred else len(preferred))
                    plan = pruner.plan(key) if pruner is not None else None
                    if plan is not None:
                        to_time, skipped = plan.order(to_time)
                        rows.extend(make_row(key, algo, "skipped", None, 0, True, now, "measure", note=why) for algo, why in skipped)
                    for algo in to_time:
                        t0 = time.perf_counter()
                        row = candidates.measure_legacy(descs, key, algo, best, forced=strategy == "forced")
                        logger.debug("%s %s %s: %s %s (%.0f ms) %s", shape, key.layout, key.math, algo, row.status,
                                     (time.perf_counter() - t0) * 1e3, row.note)
                        rows.append(row)
                        best = best_after(best, row)
                    if epilogue.is_legacy(fusion):
                        algos = fused_call_candidates([*rows, *have], key)
                        rows.extend(candidates.measure_legacy_epilogue(descs, key, fusion, algos, best))
                    if own:
                        for row in candidates.measure_own(key, own_fusion, best, [*rows, *have]):
                            rows.append(row)
                            best = best_after(best, row) if not Algo.parse(row.algo).fusion else best
                    if engines:
                        for row in candidates.measure_engines(key, best, order=plan.order if plan is not None else None):
                            rows.append(row)
                            best = best_after(best, row)
                    if plan is not None:
                        rows, best = _fallback(rows, key, candidates, descs, best, engines)
                        pruner.skipped += sum(1 for m in rows if m.key == key and is_pruned(m))
                    if fusion and not epilogue.is_legacy(fusion):
                        rows.extend(measure_graph_fusion(candidates, key, fusion, best, [*rows, *have]))
                    if engine_fusion:
                        rows.extend(candidates.measure_engine_epilogue(key, engine_fusion, best, [*rows, *have],
                                                                       order=plan.order if plan is not None else None))
                rows = bench.settle(rows, problem, options, have)
        finally:
            candidates.release()
    return rows


def is_pruned(m: Measurement) -> bool:
    """Whether ``m`` is the row of a candidate the pruning rule skipped."""
    return m.status == "skipped" and m.note.startswith(PRUNED)


def _fallback(rows: list[Measurement], key: ProblemKey, candidates: Candidates, descs: Any, best: float | None,
              engines: bool) -> tuple[list[Measurement], float | None]:
    """``rows`` with ``key``'s pruned candidates timed after all where none of its kept ones ran
    (the only candidate that supports a problem is never skipped), and the best time after them."""
    pruned = [m for m in rows if m.key == key and is_pruned(m)]
    if not pruned or not needs_fallback(rows, key):
        return rows, best
    logger.info("--prune learned: no kept candidate of %s ran: its %d skipped candidate(s) are timed too", key, len(pruned))
    rows = [m for m in rows if not (m.key == key and is_pruned(m))]
    legacy = [m.algo for m in pruned if not Algo.parse(m.algo).is_engine]
    for algo in legacy:
        rows.append(candidates.measure_legacy(descs, key, algo, best))
        best = best_after(best, rows[-1])
    engine_algos = {m.algo for m in pruned if Algo.parse(m.algo).is_engine}
    if engines and engine_algos:
        for row in candidates.measure_engines(key, best, order=lambda algos: ([a for a in algos if a in engine_algos], [])):
            rows.append(row)
            best = best_after(best, row)
    return rows, best


def fused_call_candidates(rows: Sequence[Measurement], key: ProblemKey) -> list[str]:
    """The legacy algorithms of ``key`` whose fused call with an epilogue is timed: the
    :data:`convpass.core.fusion.FUSED_CALL_CANDIDATES` fastest bare ones measured (not early-stopped estimates)."""
    timed = {m.algo: m.time_ms for m in rows
             if m.key == key and m.method == "measure" and was_measured(m)
             and Algo.parse(m.algo).bare_of('legacy')}
    return sorted(timed, key=lambda a: (timed[a], a))[:epilogue.FUSED_CALL_CANDIDATES]


def measure_graph_fusion(candidates: Any, key: ProblemKey, fusion: str, best: float | None, have: Sequence[Measurement]) -> list[Measurement]:
    """The rows of a graph-API ``fusion`` of ``key``
    (:meth:`~convpass.tuning.candidates.Candidates.measure_fused`); for one with its residual, its
    shorter graph's too (the activation alone fused, the Add after it: a candidate of the same
    problem, :mod:`convpass.tuning.decide`), unless ``have`` holds them already (another conv of
    the key without the residual measured them)."""
    rows = list(candidates.measure_fused(key, fusion, best))
    shorter = epilogue.without_residual(fusion)
    if shorter != fusion and not fused_complete([*rows, *have], key, shorter):
        rows.extend(candidates.measure_fused(key, shorter, best))
    return rows


def fused_complete(rows: Sequence[Measurement], key: ProblemKey, fusion: str) -> bool:
    """Whether ``rows`` hold what :meth:`~convpass.tuning.candidates.Candidates.measure_fused` writes
    for a graph-API ``fusion`` of ``key``: its epilogue row and at least one fused row (an
    ``unsupported`` one when cuDNN offers none); with the residual, also the ``add`` row and the
    shorter graph's own rows (the tuner measures both graphs)."""
    mine = [m for m in rows if m.key == key]
    passes = {m.algo for m in mine if m.method == EPILOGUE_METHOD}
    fused = {Algo.parse(m.algo).fusion for m in mine if m.method == "measure"}
    if fusion not in passes or fusion not in fused:
        return False
    shorter = epilogue.without_residual(fusion)
    return shorter == fusion or (epilogue.RESIDUAL_PASS in passes and fused_complete(mine, key, shorter))


def candidate_keys(problem: ConvProblem, options: TuneOptions) -> list[ProblemKey]:
    return [
        shape.key(layout, math, problem.x_slice, problem.y_slice, problem.z_slice)  # type: ignore[arg-type]
        for shape in problem.candidates
        for layout in options.layouts
        for math in options.math_modes(shape.dtype)
    ]


def complete(rows: list[Measurement], keys: list[ProblemKey], strategy: str, forced: str | None, legacy: bool = True,
             engines: bool = False, fusion: str = "", pruned_ok: bool = False) -> bool:
    """Whether the cache already holds everything this strategy needs for these keys (graph-API
    engines: at least one engine row per key, which :meth:`~convpass.tuning.candidates.Candidates.measure_engines` always
    writes, an ``unsupported`` one when cuDNN offers none; a ``fusion``: its epilogue row and at
    least one fused row per key, which :meth:`~convpass.tuning.candidates.Candidates.measure_fused` always writes for a
    graph-API fusion (:func:`fused_complete`: with the residual, its shorter graph's too) and
    :meth:`~convpass.tuning.candidates.Candidates.measure_legacy_epilogue` for a legacy one where a
    legacy algorithm of the key was timed). A key with candidates the pruning rule skipped is
    complete only with ``pruned_ok`` (``--prune learned``): without pruning they are measured."""
    from convpass.core.cudnn_enums import algo_names

    for key in keys:
        mine = [m for m in rows if m.key == key]
        if not pruned_ok and any(is_pruned(m) for m in mine):
            return False
        if not any(m.method == "heuristic" for m in mine):
            return False
        timed = {m.algo for m in mine if m.method == "measure"}
        if strategy == "measure" and legacy and not set(algo_names(key.shape.direction)) <= timed:
            return False
        if engines and not any(Algo.parse(a).is_engine and not Algo.parse(a).fusion for a in timed):
            return False
        if fusion and not epilogue.is_legacy(fusion) and not fused_complete(mine, key, fusion):
            return False
        if epilogue.is_legacy(fusion) and not any(m.method == EPILOGUE_METHOD and m.algo == fusion for m in mine):
            return False
        if epilogue.is_legacy(fusion) and fused_call_candidates(mine, key) and not any(Algo.parse(a).fusion == fusion for a in timed):
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

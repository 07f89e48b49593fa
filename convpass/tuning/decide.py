"""The decision seam: who decides each convolution problem.

``optimize`` hands the model's distinct problems to a :class:`DecisionBackend` and records what
comes back. Two backends exist:

* :class:`CacheBackend` - no GPU needed: takes decisions from the tuning cache for a named device
  (``--device-name``); a problem with no usable measurement stays ``auto`` (chosen at run time).
  With the cache's transpose timings it plans layouts over the whole graph as the tuner does.
* ``convpass.tuning.tuner.CudnnTuner`` - measures on the local GPU (and fills the cache).

:func:`select` is the one rule for picking a configuration from measurements; both backends use it.
At the ``fp32-strict`` precision :func:`allowed` excludes the transform algorithms (Winograd, FFT:
:func:`convpass.core.algo.is_transform`).

Epilogues: a problem with a ``fusion`` (what its conv's step runs after the conv: a legacy
epilogue of :mod:`convpass.core.fusion`, or an activation cuDNN's graph API fuses) compares every
configuration by what its conv and epilogue cost together, on one clock: a fused call's or fused
graph's own time, against an unfused configuration's time plus the measured time of the epilogue
as its own pass (the ``epilogue`` row of the same key: :data:`EPILOGUE_METHOD`). A fused
configuration is a candidate only where that row exists. An unfused graph-API engine was timed
with its bias pass (its rows are shared by every epilogue of its key): for a legacy epilogue it
costs its own time less that bias pass plus the epilogue's pass (the ``bias`` and the epilogue's
``epilogue`` rows of its key: :func:`bias_ms`; the residual read and the ReLU that pass adds),
or, where either row is missing (a cache filled before), its own time. A graph-API engine's fused
graph of a legacy epilogue (``engine:<config>+bias+add+relu``) costs its own time, like a legacy
fused call.

A graph-API fusion with its residual (``<act>+add``: :mod:`convpass.core.fusion`) has a third
kind of candidate: a configuration of its shorter graph (``<act>`` fused, the Add after it as the
plan's own step), which costs its time plus the residual Add's own pass (the ``add`` row of the
key: :func:`residual_ms`), and is a candidate only where that row exists. Its fused graph costs
its own time, an unfused configuration its time plus the ``<act>+add`` row (the activation and the
Add as the one pass the plan runs them in).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from convpass.core.algo import Algo
from convpass.core.device import DeviceFingerprint
from convpass.core.fusion import LEGACY, RESIDUAL_PASS, adds_residual, is_engine_fusion, is_legacy, without_residual
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem, ProblemKey
from convpass.tuning.cache_rows import current

if TYPE_CHECKING:
    from convpass.tuning.cache import TuningCache
    from convpass.tuning.cache_rows import Measurement

logger = logging.getLogger("convpass")

# The method of a tuning-cache row that times a fused epilogue's activation as its own pass over a
# key's output (algo: the fusion's name): what an unfused configuration adds.
EPILOGUE_METHOD = "epilogue"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The decided configuration of one problem."""

    key: ProblemKey
    algo: str
    time_ms: float | None  # of the conv's step: the conv with its problem's epilogue (cost_ms)
    workspace_bytes: int | None
    source: str  # measure | exhaustive | heuristic | forced | cache
    # when ``algo`` is a graph-API engine: the legacy algorithm nearest to it (the fastest measured,
    # else cuDNN's heuristic first choice, for the same key), what runs where the engine cannot
    fallback: str | None = None


class DecisionBackend(Protocol):
    device: DeviceFingerprint | None
    # True: decisions rest on convpass's timings on this GPU type (made now or in an earlier run),
    # and record the strategy that took them as their source; False: looked up in a tuning cache
    # without that GPU (source "cache"). The same cache then writes the same model, byte for byte.
    measures: bool

    def decide(self, problems: Sequence[ConvProblem], options: TuneOptions) -> dict[ConvProblem, Choice | None]:
        """A choice per problem; None where nothing could be decided (recorded as auto)."""
        ...


def epilogue_ms(measurements: Iterable[Measurement], problem: ConvProblem) -> dict[ProblemKey, float]:
    """Per key, the measured time of ``problem``'s fused epilogue run as its own pass (module
    docstring); empty for a problem without a fusion."""
    if not problem.fusion:
        return {}
    return {m.key: m.time_ms for m in measurements
            if m.method == EPILOGUE_METHOD and m.algo == problem.fusion and m.status == "ok" and m.time_ms is not None}


def residual_ms(measurements: Iterable[Measurement], problem: ConvProblem) -> dict[ProblemKey, float]:
    """Per key, the measured time of the residual Add as its own pass (the ``add`` row), what a
    configuration of the shorter graph adds (module docstring); empty for a problem whose fusion
    has no residual after its activation."""
    if not adds_residual(problem.fusion):
        return {}
    return {m.key: m.time_ms for m in measurements
            if m.method == EPILOGUE_METHOD and m.algo == RESIDUAL_PASS and m.status == "ok" and m.time_ms is not None}


def bias_ms(measurements: Iterable[Measurement], problem: ConvProblem) -> dict[ProblemKey, float]:
    """Per key, the measured time of the bias alone as its own pass (the ``bias`` epilogue row),
    the pass an unfused engine's time holds (module docstring); empty for a problem whose fusion is
    no legacy epilogue."""
    if not is_legacy(problem.fusion):
        return {}
    rows = list(measurements)
    # only keys the engine-epilogue tuner went through (its fused-graph rows, engine:none+<f> too):
    # a bias row of an older cache may be a sibling problem's, and its engines stay costed as before
    marked = {m.key for m in rows if m.method != EPILOGUE_METHOD and Algo.parse(m.algo).is_engine and Algo.parse(m.algo).fusion == problem.fusion}
    return {m.key: m.time_ms for m in rows
            if m.key in marked and m.method == EPILOGUE_METHOD and m.algo == LEGACY[0] and m.status == "ok" and m.time_ms is not None}


def cost_ms(m: Measurement, epilogue: dict[ProblemKey, float], fusion: str = "",
            residual: dict[ProblemKey, float] | None = None, bias: dict[ProblemKey, float] | None = None) -> float | None:
    """What a timed configuration costs with its problem's epilogue ``fusion`` (``epilogue``: from
    :func:`epilogue_ms`): a fused call or graph its own time, an unfused one its time plus the pass
    (module docstring: an unfused engine under a legacy epilogue, its time with the bias pass it
    holds, ``bias`` from :func:`bias_ms`, swapped for the epilogue's pass where both are known);
    a configuration of the shorter graph of a fusion with its residual, its time plus the Add's
    pass (``residual``: from :func:`residual_ms`; None where that is not known)."""
    if m.time_ms is None:
        return None
    algo = Algo.parse(m.algo)
    if algo.fusion and algo.fusion != fusion and adds_residual(fusion) and algo.fusion == without_residual(fusion):
        add = (residual or {}).get(m.key)
        return None if add is None else m.time_ms + add
    if algo.fusion:
        return m.time_ms
    if algo.is_engine and is_legacy(fusion):
        own, held = epilogue.get(m.key), (bias or {}).get(m.key)
        return m.time_ms if own is None or held is None else m.time_ms - held + own
    return m.time_ms + epilogue.get(m.key, 0.0)


def allowed(problem: ConvProblem, options: TuneOptions, epilogue: dict[ProblemKey, float] | None = None,
            residual: dict[ProblemKey, float] | None = None) -> Callable[[Measurement], bool]:
    """Whether a measured configuration satisfies the user's constraints for this problem (a fused
    call or graph: only the problem's own fusion, where ``epilogue`` has its key, or the shorter
    graph of a fusion with its residual, where ``residual`` has its key). The options are read once
    per problem: a cached re-run asks this of every cached row (50,000 for a ResNet-50)."""
    direction = problem.direction
    strategy, forced = options.strategy(direction)
    legacy_ok, engines_ok = options.engine_space(direction)
    layouts = options.layouts
    math_modes = {shape.dtype: options.math_modes(shape.dtype) for shape in problem.candidates}
    transforms = options.transforms
    epilogue = epilogue or {}
    residual = residual or {}
    shorter = without_residual(problem.fusion) if adds_residual(problem.fusion) else None

    def fused_ok(fusion: str, key: ProblemKey) -> bool:
        return not fusion or (fusion == problem.fusion and key in epilogue) or (fusion == shorter and key in residual)

    def ok(m: Measurement) -> bool:
        algo = Algo.parse(m.algo)
        return (
            m.status == "ok"
            and (engines_ok if algo.is_engine else legacy_ok)
            and (transforms or not algo.is_transform)
            # an engine's fused graph this version builds (a shared cache may hold rows of graphs it does not)
            and (not algo.is_engine or not algo.fusion or is_engine_fusion(algo.fusion))
            and fused_ok(algo.fusion, m.key)
            and m.key.shape in problem.candidates
            and m.key.x_slice == problem.x_slice  # a slice read and a packed read are different measurements
            and m.key.y_slice == problem.y_slice  # so are a slice write and a packed write
            and m.key.z_slice == problem.z_slice  # and a residual read from a slice and a packed one
            and m.key.layout in layouts
            and m.key.math in math_modes[m.key.shape.dtype]
            and (options.workspace_limit is None or m.workspace_bytes <= options.workspace_limit)
            and (not options.deterministic or m.deterministic)
            and (strategy != "forced" or str(algo.bare) == forced)
        )

    return ok


def select(measurements: Iterable[Measurement], problem: ConvProblem, options: TuneOptions) -> Measurement | None:
    """The configuration to run (:func:`select_allowed`); at the ``fp32-strict`` precision, where
    no configuration without a transform algorithm is measured, the ``fp32`` one: the fastest FMA
    configuration (the written model shows it: the caller says so)."""
    measurements = list(measurements)
    pick = select_allowed(measurements, problem, options)
    if pick is None and not options.transforms:
        return select_allowed(measurements, problem, _fp32(options))
    return pick


def _fp32(options: TuneOptions) -> TuneOptions:
    return dataclasses.replace(options, precision="fp32", max_error=None, tf32="off")


def select_allowed(measurements: Iterable[Measurement], problem: ConvProblem, options: TuneOptions) -> Measurement | None:
    """The configuration to run among those the options allow, by the strategy of the problem's direction.

    measure / forced: the fastest configuration convpass timed itself (with the problem's epilogue:
    :func:`cost_ms`); heuristic: cuDNN's first
    heuristic choice (per layout and math type its ranking differs; ties go to NCHW and default
    math, cuDNN's conventional setting); exhaustive: the fastest by cuDNN Find's own timing. For
    heuristic and exhaustive picks, the returned record is convpass's own timing of that choice when
    there is one (so recorded times are always comparable), else the ranking record; where the pick's
    fused call with the problem's epilogue was timed too, the cheaper of the two.
    """
    strategy, _ = options.strategy(problem.direction)
    measurements = list(measurements)
    epilogue = epilogue_ms(measurements, problem)
    residual = residual_ms(measurements, problem)
    bias = bias_ms(measurements, problem)
    ok = list(filter(allowed(problem, options, epilogue, residual), measurements))
    timed = {(m.key, m.algo): m for m in ok if m.method == "measure" and m.time_ms is not None}
    if strategy == "heuristic":
        ranked = [m for m in ok if m.method == "heuristic" and m.heuristic_rank is not None]
        best = min(ranked, key=lambda m: (m.heuristic_rank, _layout_pref(m), m.key.math != "default"), default=None)
    elif strategy == "exhaustive":
        found = [m for m in ok if m.method == "find" and m.time_ms is not None]
        best = min(found, key=lambda m: (m.time_ms, _layout_pref(m), m.key.math != "default", m.algo), default=None)
    else:
        # equal times (event-resolution ties on tiny convs) break the same way whatever order the
        # rows came in (live measurements or the cache's ORDER BY): the cached re-run reproduces the choice
        return min(timed.values(), key=lambda m: (cost_ms(m, epilogue, problem.fusion, residual, bias), _layout_pref(m), m.key.math != "default",
                                                  m.algo), default=None)
    if best is None:
        return None
    # the algorithm is the strategy's pick; how its epilogue runs is measured like any other choice
    fused = str(Algo.parse(best.algo).fused(problem.fusion))
    variants = [m for m in (timed.get((best.key, best.algo)), timed.get((best.key, fused))) if m is not None]
    return min(variants, key=lambda m: (cost_ms(m, epilogue, problem.fusion, residual, bias), m.algo), default=best)


def _layout_pref(m: Measurement) -> int:
    return 0 if m.key.layout == "nchw" else 1


def choice_from(m: Measurement, source: str, rows: Iterable[Measurement] = (), problem: ConvProblem | None = None) -> Choice:
    """The Choice of a selected measurement; ``rows`` (the problem's measurements) give an engine's
    legacy fallback and, with ``problem``, the epilogue its time includes (:func:`cost_ms`: the
    recorded time is what the conv's step costs)."""
    rows = list(rows)
    time_ms = m.time_ms if problem is None else cost_ms(m, epilogue_ms(rows, problem), problem.fusion, residual_ms(rows, problem),
                                                        bias_ms(rows, problem))
    return Choice(key=m.key, algo=m.algo, time_ms=time_ms, workspace_bytes=m.workspace_bytes, source=source,
                  fallback=legacy_fallback(rows, m.key) if Algo.parse(m.algo).is_engine else None)


def legacy_fallback(rows: Iterable[Measurement], key: ProblemKey) -> str | None:
    """The legacy algorithm nearest to a graph-API engine chosen for ``key``: the fastest cuDNN
    legacy algorithm measured for the same key, else cuDNN's heuristic first choice; None without
    either."""
    same = [m for m in rows if m.key == key and m.status == "ok" and Algo.parse(m.algo).bare_of("legacy")]
    timed = [m for m in same if m.method == "measure" and m.time_ms is not None]
    if timed:
        return min(timed, key=lambda m: (m.time_ms, m.algo)).algo
    ranked = [m for m in same if m.method == "heuristic" and m.heuristic_rank is not None]
    return min(ranked, key=lambda m: m.heuristic_rank).algo if ranked else None


def cached_rows(cache: TuningCache, device: DeviceFingerprint, problem: ConvProblem) -> list[Measurement]:
    """Every measurement the cache holds for a problem on a device (all its candidate geometries)."""
    return [m for shape in problem.candidates for m in cache.get(device, shape)]


class CacheBackend:
    """Decides from the tuning cache only: for machines without a GPU (see the module docstring)."""

    measures = False

    def __init__(self, cache: TuningCache | None, device: DeviceFingerprint | None) -> None:
        self.cache = cache
        self.device = device
        # every cached measurement of every decided problem: the layout planner chooses among them
        self.rows: dict[ConvProblem, list[Measurement]] = {}

    def decide(self, problems: Sequence[ConvProblem], options: TuneOptions) -> dict[ConvProblem, Choice | None]:
        out: dict[ConvProblem, Choice | None] = {}
        for problem in problems:
            # as the tuner reads them (cache_rows.current): rows it would time again are no decision's
            rows = current(cached_rows(self.cache, self.device, problem)) if self.cache is not None and self.device is not None else []
            self.rows[problem] = rows
            chosen = select(rows, problem, options)
            out[problem] = None if chosen is None else choice_from(chosen, "cache", rows, problem)
        return out

    def transpose_ms(self, dims: tuple[int, ...], dtype: str) -> float | None:
        """The cache's transpose time of a rank 3-5 tensor for the layout planner; None where the
        cache has none (the tuner records one for every tensor it planned on a GPU)."""
        if self.cache is None or self.device is None:
            return None
        return self.cache.get_transpose(self.device, dims, dtype)

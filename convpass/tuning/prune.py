"""Learned pruning of tuning candidates: what the tuning cache's history on a device says about
which candidate families win for a class of geometry, and the order and cuts that follow.

* A **geometry class** (:func:`geometry_class`) is a small description of a problem key:
  direction, depthwise / grouped / dense, kernel 1x1 / 3x3 / other, stride 1 / 2 / other, memory
  format, data type and math, and a size bucket by output elements.
* A candidate's **family** (:func:`family`) is its legacy algorithm, its graph-API engine (the
  engine id without its knobs) or its own kernel; a fused call belongs to the family of its bare
  algorithm.
* The **history** (:class:`History`) is learned from the rows of fully searched problems: per
  class, how many problems, and per family how often it was a candidate, won the problem's
  decision (:func:`convpass.tuning.decide.select`, the tuner's own rule) or came within
  :attr:`Rule.near` of the winner's cost. Rows cut by pruning (:data:`PRUNED`) are no evidence.
* The **rule** (:class:`Rule`, :class:`Pruner`): within a class, candidates are tried in order of
  their family's win rate (ties keep the tuner's order), so that the best comes early and the
  early stop cuts more; a family that was a candidate in at least :attr:`Rule.min_problems`
  problems of the class and never won nor came near is skipped. A class with fewer known
  problems, and every :attr:`Rule.explore_every`-th problem of a class in a run, is searched in
  full. A key none of whose kept candidates ran is searched in full too (:func:`needs_fallback`):
  the only supporting candidate is never skipped.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from convpass.core.algo import Algo
from convpass.core.fusion import LEGACY, RESIDUAL_PASS
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem, ProblemKey
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.decide import EPILOGUE_METHOD, allowed, bias_ms, cost_ms, epilogue_ms, residual_ms, select

__all__ = ["PRUNED", "SIZE_BUCKETS", "History", "KeyPlan", "Pruner", "Rule", "decision", "family", "family_costs", "geometry_class", "needs_fallback",
           "problems_of"]

# The note a row of a candidate the rule skipped starts with (status "skipped").
PRUNED = "pruned"
# Output elements (N x K x output spatial) at which the size buckets start: xs, s, m, l.
SIZE_BUCKETS = ((0, "xs"), (1 << 16, "s"), (1 << 19, "m"), (1 << 22, "l"))


@dataclasses.dataclass(frozen=True)
class Rule:
    """The pruning rule's parameters (module docstring)."""

    near: float = 0.03  # a family within this share of the winner's cost counts as near
    min_problems: int = 12  # problems of a class (and of a family in it) before anything is skipped
    explore_every: int = 20  # every k-th problem of a class in a run is searched in full


def geometry_class(key: ProblemKey) -> str:
    """The geometry class of a key (module docstring), e.g. ``fwd/dense/3x3/s1/nhwc/float32-default/m``."""
    shape = key.shape
    kind = "depthwise" if shape.is_depthwise else "grouped" if shape.groups > 1 else "dense"
    kernel = "1x1" if all(k == 1 for k in shape.kernel) else "3x3" if all(k == 3 for k in shape.kernel) else "kother"
    stride = "s1" if all(s == 1 for s in shape.strides) else "s2" if all(s == 2 for s in shape.strides) else "sother"
    out = shape.n * shape.k
    for s in shape.output_spatial:
        out *= s
    size = [name for start, name in SIZE_BUCKETS if out >= start][-1]
    return f"{shape.direction}/{kind}/{kernel}/{stride}/{key.layout}/{shape.dtype}-{key.math}/{size}"


def family(algo: str) -> str:
    """The family of a candidate (module docstring): ``legacy:fft``, ``engine:eng67``, ``own:convpass_depthwise_r4``."""
    parsed = Algo.parse(algo)
    name = parsed.name.split("_k", 1)[0] if parsed.is_engine else parsed.name
    return f"{parsed.family}:{name}"


def _pruned(m: Measurement) -> bool:
    return m.status == "skipped" and m.note.startswith(PRUNED)


def problems_of(rows: Iterable[Measurement]) -> dict[tuple[ProblemKey, str], list[Measurement]]:
    """The rows of each (key, fusion) the rows tell of: one problem per epilogue row of a key (its
    fusion; the residual Add's own pass is no fusion), or the key's bare problem where it has none."""
    by_key: dict[ProblemKey, list[Measurement]] = defaultdict(list)
    for m in rows:
        by_key[m.key].append(m)
    out = {}
    for key, mine in by_key.items():
        passes = {m.algo for m in mine if m.method == EPILOGUE_METHOD and m.algo != RESIDUAL_PASS}
        if LEGACY[0] in passes and passes & set(LEGACY[1:]) and not any(
                m.method != EPILOGUE_METHOD and Algo.parse(m.algo).fusion == LEGACY[0] for m in mine):
            passes.discard(LEGACY[0])  # the bias pass a longer legacy epilogue's engines are costed with: no problem of its own
        fusions = sorted(passes) or [""]
        for fusion in fusions:
            out[(key, fusion)] = mine
    return out


_OPTIONS = TuneOptions()


def decision(key: ProblemKey, fusion: str, rows: Sequence[Measurement]) -> Measurement | None:
    """The tuner's decision among ``rows`` for one key and fusion (:func:`~convpass.tuning.decide.select`)."""
    return select([m for m in rows if m.key == key], ConvProblem((key.shape,), fusion, key.x_slice, key.y_slice, key.z_slice), _OPTIONS)


def family_costs(key: ProblemKey, fusion: str, rows: Sequence[Measurement]) -> dict[str, float]:
    """Each family's best cost among ``rows`` for one key and fusion (by the decision's cost)."""
    problem = ConvProblem((key.shape,), fusion, key.x_slice, key.y_slice, key.z_slice)
    epilogue, residual, bias = epilogue_ms(rows, problem), residual_ms(rows, problem), bias_ms(rows, problem)
    ok = allowed(problem, _OPTIONS, epilogue, residual)
    best: dict[str, float] = {}
    for m in rows:
        if m.key == key and m.method == "measure" and ok(m) and (cost := cost_ms(m, epilogue, fusion, residual, bias)) is not None:
            name = family(m.algo)
            best[name] = min(cost, best.get(name, cost))
    return best


@dataclasses.dataclass
class History:
    """Per geometry class: problems seen, and per family how often it was a candidate, won, came near."""

    near: float = Rule.near
    problems: Counter = dataclasses.field(default_factory=Counter)
    present: Counter = dataclasses.field(default_factory=Counter)  # (class, family) -> problems
    wins: Counter = dataclasses.field(default_factory=Counter)
    close: Counter = dataclasses.field(default_factory=Counter)

    @classmethod
    def learn(cls, rows: Iterable[Measurement], near: float = Rule.near) -> History:
        """The history of ``rows`` (every row of a device, or of some of its problems)."""
        out = cls(near=near)
        for (key, fusion), mine in problems_of(rows).items():
            out.add(key, fusion, mine)
        return out

    def add(self, key: ProblemKey, fusion: str, rows: Sequence[Measurement]) -> None:
        winner = decision(key, fusion, rows)
        if winner is None:
            return
        cls = geometry_class(key)
        costs = family_costs(key, fusion, rows)
        won = family(winner.algo)
        self.problems[cls] += 1
        self.wins[(cls, won)] += 1
        limit = costs[won] * (1 + self.near)
        for name in {family(m.algo) for m in rows if m.key == key and m.method == "measure" and not _pruned(m)}:
            self.present[(cls, name)] += 1
            if name in costs and costs[name] <= limit:
                self.close[(cls, name)] += 1

    def __bool__(self) -> bool:
        return bool(self.problems)

    def win_rate(self, cls: str, name: str) -> float:
        seen = self.present[(cls, name)]
        return self.wins[(cls, name)] / seen if seen else 0.0


@dataclasses.dataclass(frozen=True)
class KeyPlan:
    """What the rule does for one key: ``full`` (search everything in the tuner's order), else
    order by win rate and skip the families that never won nor came near."""

    cls: str
    full: bool
    history: History
    rule: Rule

    def order(self, algos: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
        """``algos`` (in the tuner's order) as (kept, in the order to try; skipped, each with why)."""
        if self.full:
            return list(algos), []
        h, cls = self.history, self.cls
        kept, skipped = [], []
        for algo in algos:
            name = family(algo)
            seen = h.present[(cls, name)]
            if seen >= self.rule.min_problems and not h.wins[(cls, name)] and not h.close[(cls, name)]:
                skipped.append((algo, f"{PRUNED}: {name} never won nor came within {h.near:.0%} in {seen} problems of {cls}"))
            else:
                kept.append(algo)
        kept.sort(key=lambda a: -h.win_rate(cls, family(a)))  # stable: ties keep the tuner's order
        return kept, skipped


class Pruner:
    """The rule over one run (module docstring): the history is learned once, the problems of each
    class counted as they come, for the re-exploration."""

    def __init__(self, history: History, rule: Rule = Rule()) -> None:
        self.history = history
        self.rule = rule
        self._seen: Counter = Counter()
        self.skipped = 0
        self.full = 0

    def plan(self, key: ProblemKey) -> KeyPlan:
        cls = geometry_class(key)
        self._seen[cls] += 1
        full = self.history.problems[cls] < self.rule.min_problems or self._seen[cls] % self.rule.explore_every == 0
        self.full += full
        return KeyPlan(cls, full, self.history, self.rule)


def needs_fallback(rows: Iterable[Measurement], key: ProblemKey) -> bool:
    """Whether none of ``key``'s candidates in ``rows`` ran: the skipped ones are then tried too."""
    return not any(m.key == key and m.method == "measure" and m.status == "ok" and m.time_ms is not None for m in rows)

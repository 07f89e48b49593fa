"""Offline replay of learned candidate pruning over a tuning cache (no GPU).

    python benchmarks/prune_replay.py CACHE [--json out.json] [--near 0.1 --min-problems 8 --explore-every 10] [--grid]

For every problem key of the cache (one per key and fused epilogue: ``convpass.tuning.prune.problems_of``)
it replays what the tuner would measure under a pruning policy: which candidates, in which order,
which of them the early stop would cut given the rows' real times (a candidate over 1.5x the best so
far and 2 us above it: ``convpass.tuning.harness``), and what it would choose, by the tuner's own
decision rule (``convpass.tuning.decide.select``) over the rows it measured, against the decision
from every row.

Policies are learned leave-one-model-out. The cache does not name models; a model is inferred: each
geometry belongs to the tuning run that measured it first, runs are separated by a pause of more
than ``--gap`` seconds between first measurements, and consecutive runs whose geometries differ only
in the batch size are one model (a geometry an earlier model measured belongs to that one). Each
model's problems are replayed with a history learned from the other models' rows only.

The order replayed per key is the tuner's: the legacy algorithms in cuDNN's heuristic order (the
unranked after, in enum order), the epilogue's pass and the fused calls (a fused call is tried where
its bare algorithm is), convpass's own kernels, then the graph-API engines in the order they were
measured. A row the cache holds as an early-stopped estimate stands for its candidate's time when
the replay times it in full (the estimate is within about 20% of a full timing).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections import defaultdict

from convpass.bench.document import to_json
from convpass.core.algo import Algo
from convpass.core.cudnn_enums import algo_names
from convpass.core.device import DeviceFingerprint
from convpass.core.errors import FileError
from convpass.core.files import check_output, write_text_atomically
from convpass.core.problem import ConvProblem, ProblemKey
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.decide import bias_ms, cost_ms, epilogue_ms, residual_ms
from convpass.tuning.harness import EARLY_STOP_MIN_MS, EARLY_STOP_RATIO
from convpass.tuning.prune import History, KeyPlan, Pruner, Rule, decision, geometry_class, needs_fallback, problems_of

GAP_S = 20.0
GRID = {"near": (0.03, 0.05, 0.10, 0.20), "min_problems": (3, 5, 8, 12), "explore_every": (5, 10, 20)}


@dataclasses.dataclass
class KeyResult:
    key: str
    fusion: str
    cls: str
    model: int
    today: int  # candidates the tuner measures today (timed in full or cut by the early stop)
    tried: int  # candidates the policy measures
    full: int  # of those, timed in full
    cut: int  # of those, cut by the early stop
    skipped: int
    identical: bool
    ratio: float  # the policy's decision's cost over the full search's


def models_of(rows: list[Measurement], gap_s: float = GAP_S) -> dict[str, int]:
    """Model index per geometry text (module docstring), numbered in the order they were tuned."""
    first: dict[str, float] = {}
    for m in rows:
        shape = str(m.key.shape)
        first[shape] = min(m.measured_at, first.get(shape, m.measured_at))
    runs: list[list[str]] = []
    last = None
    for shape, at in sorted(first.items(), key=lambda item: item[1]):
        if last is None or at - last > gap_s:
            runs.append([])
        runs[-1].append(shape)
        last = at
    out, model = {}, -1
    for i, run in enumerate(runs):
        if i == 0 or _unbatched(run) != _unbatched(runs[i - 1]):
            model += 1
        out.update(dict.fromkeys(run, model))
    return out


def _unbatched(shapes: list[str]) -> set[str]:
    return {"|".join(p for p in s.split("|") if not p.startswith("n=")) for s in shapes}


def today_order(key: ProblemKey, rows: list[Measurement]) -> dict[str, list[Measurement]]:
    """The key's measured rows by group, each in the tuner's order (module docstring)."""
    mine = [m for m in rows if m.key == key and m.method == "measure"]
    ranked = {m.algo: m.heuristic_rank for m in rows if m.key == key and m.method == "heuristic" and m.heuristic_rank is not None}
    enum = list(algo_names(key.shape.direction))
    legacy = sorted((m for m in mine if Algo.parse(m.algo).bare_of("legacy")),
                    key=lambda m: (ranked.get(m.algo, len(ranked)), enum.index(m.algo) if m.algo in enum else len(enum)))
    return {"legacy": legacy,
            "fused": sorted((m for m in mine if Algo.parse(m.algo).is_legacy and Algo.parse(m.algo).fusion), key=lambda m: m.measured_at),
            "own": sorted((m for m in mine if Algo.parse(m.algo).is_own), key=lambda m: (bool(Algo.parse(m.algo).fusion), m.measured_at)),
            "engines": sorted((m for m in mine if Algo.parse(m.algo).is_engine), key=lambda m: m.measured_at)}


def _stops(t: float, best: float | None) -> bool:
    return best is not None and t > EARLY_STOP_RATIO * best and t > best + EARLY_STOP_MIN_MS


def replay_key(key: ProblemKey, fusion: str, rows: list[Measurement], plan: KeyPlan, best: float | None) -> tuple[list[Measurement], int, int, int, float | None]:
    """(rows the policy measured, how many timed in full, cut, skipped; the best after) for one key."""
    groups = today_order(key, rows)
    by_algo = {m.algo: m for ms in groups.values() for m in ms}
    legacy, skip_legacy = plan.order([m.algo for m in groups["legacy"]])
    engines, skip_engines = plan.order([m.algo for m in groups["engines"]])
    if needs_fallback([by_algo[a] for a in legacy + engines] + groups["own"], key):
        legacy, engines = legacy + [a for a, _ in skip_legacy], engines + [a for a, _ in skip_engines]
        skip_legacy, skip_engines = [], []
    tried_bare = set(legacy)
    fused = [m.algo for m in groups["fused"] if str(Algo.parse(m.algo).bare) in tried_bare]
    pass_ms = epilogue_ms(rows, ConvProblem((key.shape,), fusion)).get(key)
    full = cut = 0

    def time(algos: list[str], best: float | None, moves_best: bool = True, extra: float = 0.0) -> float | None:
        nonlocal full, cut
        for algo in algos:
            m = by_algo[algo]
            if m.status != "ok" or m.time_ms is None:
                continue
            if _stops(m.time_ms, None if best is None else best + extra):
                cut += 1
                continue
            full += 1
            if moves_best:
                best = m.time_ms if best is None else min(best, m.time_ms)
        return best

    best = time(legacy, best)
    time(fused, best, moves_best=False, extra=pass_ms or 0.0)
    own = [m.algo for m in groups["own"]]
    best = time([a for a in own if not Algo.parse(a).fusion], best)
    time([a for a in own if Algo.parse(a).fusion], None)
    best = time(engines, best)
    algos = set(legacy) | set(fused) | set(own) | set(engines)
    measured = [m for m in rows if m.key == key and (m.method != "measure" or m.algo in algos)]
    return measured, full, cut, len(skip_legacy) + len(skip_engines), best


def replay(rows: list[Measurement], rule: Rule | None, models: dict[str, int], histories: dict[int, History] | None = None) -> list[KeyResult]:
    """Every problem key replayed under ``rule`` (None: today's full search), leave-one-model-out."""
    problems = problems_of(rows)
    by_problem: dict[tuple[str, str], list[ProblemKey]] = defaultdict(list)
    first = {}
    for (key, fusion), mine in problems.items():
        by_problem[(str(key.shape), fusion)].append(key)
        first[(str(key.shape), fusion)] = min(m.measured_at for m in mine)
    out = []
    for model in sorted(set(models.values())):
        history = History() if rule is None else (histories or {}).get(model) or learn_without(rows, models, model, rule.near)
        pruner = Pruner(history, rule or Rule())
        mine = sorted((p for p in by_problem if models[p[0]] == model), key=lambda p: first[p])
        for shape, fusion in mine:
            best = None
            for key in sorted(by_problem[(shape, fusion)], key=lambda k: (k.layout, k.math)):
                key_rows = problems[(key, fusion)]
                plan = pruner.plan(key) if rule is not None else KeyPlan(geometry_class(key), True, history, Rule())
                measured, full, cut, skipped, best = replay_key(key, fusion, key_rows, plan, best)
                today = sum(1 for m in key_rows if m.key == key and m.method == "measure")
                out.append(_result(key, fusion, model, key_rows, measured, today, full, cut, skipped))
    return out


def learn_without(rows: list[Measurement], models: dict[str, int], model: int, near: float) -> History:
    return History.learn([m for m in rows if models[str(m.key.shape)] != model], near)


def _result(key, fusion, model, rows, measured, today, full, cut, skipped) -> KeyResult:
    best, chosen = decision(key, fusion, rows), decision(key, fusion, measured)
    problem = ConvProblem((key.shape,), fusion)
    ratio = 1.0
    if best is not None:
        if chosen is None:
            ratio = float("inf")
        else:
            epilogue, residual, bias = epilogue_ms(rows, problem), residual_ms(rows, problem), bias_ms(rows, problem)
            ratio = cost_ms(chosen, epilogue, fusion, residual, bias) / cost_ms(best, epilogue, fusion, residual, bias)
    tried = sum(1 for m in measured if m.method == "measure")
    return KeyResult(str(key), fusion, geometry_class(key), model, today, tried, full, cut, skipped,
                     (best.algo if best else None) == (chosen.algo if chosen else None), ratio)


def summary(results: list[KeyResult], baseline: list[KeyResult]) -> dict:
    """The figures of one replay (overall)."""
    keys = len(results)
    worst = max(results, key=lambda r: r.ratio, default=None)
    today = sum(r.today for r in results)
    return {"keys": keys, "today": today, "measured": sum(r.tried for r in results),
            "share": sum(r.tried for r in results) / today if today else 0.0,
            "full_today": sum(r.full for r in baseline), "full": sum(r.full for r in results),
            "cut_today": sum(r.cut for r in baseline), "cut": sum(r.cut for r in results),
            "skipped": sum(r.skipped for r in results),
            "identical": sum(r.identical for r in results), "within_3": sum(r.ratio <= 1.03 for r in results),
            "within_10": sum(r.ratio <= 1.10 for r in results),
            "worst_ratio": worst.ratio if worst else 1.0, "worst_key": f"{worst.key} + {worst.fusion}" if worst else ""}


def by_class(results: list[KeyResult], baseline: list[KeyResult]) -> dict[str, dict]:
    groups, base = defaultdict(list), defaultdict(list)
    for r, b in zip(results, baseline):
        groups[r.cls].append(r)
        base[b.cls].append(b)
    return {cls: summary(groups[cls], base[cls]) for cls in sorted(groups)}


def grid(rows: list[Measurement], models: dict[str, int], baseline: list[KeyResult]) -> list[dict]:
    """The overall figures of every rule of :data:`GRID`."""
    out = []
    for near in GRID["near"]:
        histories = {m: learn_without(rows, models, m, near) for m in set(models.values())}
        for n, k in itertools.product(GRID["min_problems"], GRID["explore_every"]):
            rule = Rule(near, n, k)
            out.append({**dataclasses.asdict(rule), **summary(replay(rows, rule, models, histories), baseline)})
    return out


def table(title: str, figures: dict[str, dict]) -> str:
    lines = [title, f"{'class':44} {'keys':>5} {'today':>6} {'measured':>8} {'share':>6} {'full':>5} {'cut':>5} "
                    f"{'same':>5} {'<=3%':>5} {'<=10%':>5} {'worst':>6}"]
    for name, s in figures.items():
        lines.append(f"{name:44} {s['keys']:5d} {s['today']:6d} {s['measured']:8d} {s['share']:6.1%} {s['full']:5d} {s['cut']:5d} "
                     f"{s['identical']:5d} {s['within_3']:5d} {s['within_10']:5d} {s['worst_ratio']:6.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--device", help="device fingerprint (default: the cache's only one)")
    ap.add_argument("--near", type=float, default=Rule.near)
    ap.add_argument("--min-problems", type=int, default=Rule.min_problems)
    ap.add_argument("--explore-every", type=int, default=Rule.explore_every)
    ap.add_argument("--gap", type=float, default=GAP_S, help="seconds between tuning runs (model inference)")
    ap.add_argument("--grid", action="store_true", help="also replay every rule of the grid")
    args = ap.parse_args(argv)
    protect = [(args.cache, "the tuning cache")]  # --json never replaces the cache it replays
    if args.json is not None:
        try:
            check_output(args.json, "--json", protect)  # before the replay, not after it
        except FileError as e:
            ap.error(str(e))
    with TuningCache(args.cache, readonly=True) as cache:
        devices = [d for d, _ in cache.devices()]
        if args.device is None and len(devices) != 1:
            ap.error(f"{args.cache} holds {len(devices)} devices: name one with --device")
        device = DeviceFingerprint.parse(args.device) if args.device else devices[0]
        rows = cache.device_rows(device)
    models = models_of(rows, args.gap)
    rule = Rule(args.near, args.min_problems, args.explore_every)
    baseline = replay(rows, None, models)
    results = replay(rows, rule, models)
    overall = summary(results, baseline)
    classes = by_class(results, baseline)
    per_model = {f"model {m}": summary([r for r in results if r.model == m], [b for b in baseline if b.model == m])
                 for m in sorted(set(models.values()))}
    print(f"{args.cache}: {len(rows)} rows, {overall['keys']} problem keys, {len(set(models.values()))} models inferred; "
          f"rule near={rule.near:g} min_problems={rule.min_problems} explore_every={rule.explore_every}")
    print(table("per geometry class", classes))
    print(table("per model (leave-one-model-out)", per_model))
    print(table("all", {"all": overall}))
    print(f"worst: {overall['worst_ratio']:.3f}x at {overall['worst_key']}")
    document = {"cache": str(args.cache), "device": str(device), "rule": dataclasses.asdict(rule), "overall": overall,
                "classes": classes, "models": per_model, "keys": [dataclasses.asdict(r) for r in results]}
    if args.grid:
        document["grid"] = grid(rows, models, baseline)
        print("grid: near min_problems explore_every -> share measured, <=3%, <=10%, worst")
        for g in document["grid"]:
            print(f"  {g['near']:.2f} {g['min_problems']:3d} {g['explore_every']:3d} -> {g['share']:6.1%} "
                  f"{g['within_3'] / g['keys']:7.2%} {g['within_10'] / g['keys']:7.2%} {g['worst_ratio']:.3f}")
    if args.json is not None:
        write_text_atomically(args.json, to_json(document), "--json", protect)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fleet tuning on several GPUs against one: wall time, decisions re-timed on one clock, a killed worker.

Phases (each one ``convpass tune`` run on a fresh cache, so every phase fits the device machine's
10-minute limit per command; results go to WORK, the report to OUT):

    python benchmarks/fleet_scaling.py run    --name one    --gpus 0   --panel .panel --work W
    python benchmarks/fleet_scaling.py run    --name two    --gpus 0,1 --panel .panel --work W [--cluster ray]
    python benchmarks/fleet_scaling.py run    --name retime --gpus 0   --panel .panel --work W
    python benchmarks/fleet_scaling.py kill   --name kill   --gpus 0,1 --panel .panel --work W
    python benchmarks/fleet_scaling.py reclock --gpus 0 --rounds 3 --work W
    python benchmarks/fleet_scaling.py report --work W --out OUT

* ``run``: ``convpass tune`` of every ``.panel/*.onnx`` (``--batch``, default 1,32) on the GPUs
  named (``CUDA_VISIBLE_DEVICES``); records the command's wall time and its ``--json`` summary.
* ``kill``: the same on two GPUs (``--cluster local``: the workers are the driver's children);
  once ``--kill-after`` geometries are in the cache it kills one worker process (SIGKILL, in the
  middle of a problem: workers are busy while problems remain) and checks that the run completes
  with no problem missing and none written twice.
* ``reclock``: every problem whose decision differs between ``one`` and ``two`` measured again,
  ``--rounds`` times on one GPU in this process (each round into a cache of its own,
  ``reclock-<round>.db``): with the ``retime`` run, several independent timings of each candidate
  of those problems. (A problem both runs decided alike costs the same on any clock.)
* ``report``: wall time of ``two`` / the faster of the 1-GPU runs ``one`` and ``retime`` (target
  <= 0.55; both ratios are printed); every problem's decision of ``two``
  and of ``one`` re-timed on one clock, the ``retime`` run's measurements of every candidate
  (target: ``two``'s within 3% of ``one``'s), and, after ``reclock``, on the median clock (each
  candidate's median over the retime run and the rounds: :func:`median_clock`), with the spread of
  one configuration's time between those timings (the clock's own noise); the tuner's own
  run-to-run noise on the same clock (``one``'s and ``two``'s decisions against what the tuner
  decides from ``retime``); the kill run. Prints a short table, writes ``fleet-check.json``.

:func:`retimed`, :func:`compare`, :func:`median_clock` and :func:`clock_spread` are pure and tested
on CPU with recorded runs (tests/test_fleet_benchmark.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from convpass.core.options import TuneOptions
    from convpass.core.problem import ConvProblem
    from convpass.tuning.cache_rows import Measurement

Clock = Mapping[str, Sequence["Measurement"]]  # geometry -> the clock run's ok rows (timed configurations, epilogue passes)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a tuned model runs for one problem: the configuration's problem key and the tuning-cache
    row it was decided from (a legacy algorithm, an engine, or either's fused call)."""

    problem: ConvProblem  # as the driver collected it, its epilogue included
    key: str
    row: str


# ------------------------------------------------------------------------------------------------
# pure: decisions against a clock


def tune_options() -> TuneOptions:
    """The decision options the phases' ``convpass tune`` runs with (its defaults)."""
    from convpass.cli.main import build_parser
    from convpass.cli.options import decision_options
    from convpass.compiler.pipeline import build_options

    return build_options(decision_options(build_parser().parse_args(["tune", "m.onnx", "-o", "."])))


def decisions_of(tuned_models: Sequence[Path | str], options: TuneOptions) -> dict[tuple[str, str], Decision]:
    """(device, problem) -> the Decision of every decided conv of the models. Each conv's problem is
    collected again from the tuned model at its own profiles, with ``options``: what the tuner timed
    it as, with its epilogue, which the row's time alone does not say (an unfused configuration
    costs its time plus the epilogue's pass)."""
    import convpass
    from convpass.compiler.pipeline import OptimizeReport, prepare_model
    from convpass.core import annotation
    from convpass.core.algo import Algo
    from convpass.core.model_io import load_model, to_proto

    out: dict[tuple[str, str], Decision] = {}
    for path in tuned_models:
        tuned = to_proto(load_model(path))
        records = convpass.inspect(tuned)
        info, _ = annotation.read_annotations(tuned)
        profiles = [p.name for p in info.profiles]
        plain = load_model(annotation.standard_model(tuned))
        uses = prepare_model(plain, options, [dict(p.inputs) for p in info.profiles], OptimizeReport())
        problem_of = {(u.node.name, u.profile): p for p, us in uses.items() for u in us}
        for r in records:
            if r["algo"] in (None, "auto") or not r["problem_key"]:
                continue
            problem = problem_of.get((r["node"], profiles.index(r["profile"])))
            if problem is None:
                raise SystemExit(f"fleet_scaling: {path}: conv {r['node']!r} at profile {r['profile']} has a decision but no "
                                 "problem when collected with convpass tune's default options (was it tuned with others?)")
            row = Algo("engine", r["engine"]) if r["engine"] else Algo.parse(r["algo"])
            out[(r["device"], str(problem))] = Decision(problem, r["problem_key"], str(row.fused(r["fusion"] or "")))
    return out


def retimed(decisions: Mapping[Any, Decision], clock: Clock, options: TuneOptions) -> dict[Any, dict[str, float]]:
    """Each decision's time on the clock run and the time of what the tuner decides from the clock,
    by decision key. Both are the conv's step by the tuner's own rule (:func:`convpass.tuning.decide.cost_ms`:
    a fused call its own time, an unfused configuration its time plus its epilogue's pass), and
    the clock's choice is :func:`convpass.tuning.decide.select`'s under ``options``. Decisions whose
    configuration the clock did not time are left out."""
    from convpass.tuning.decide import bias_ms, cost_ms, epilogue_ms, residual_ms, select

    out = {}
    for k, d in decisions.items():
        rows = [m for shape in d.problem.candidates for m in clock.get(str(shape), ())]
        epilogue, residual, bias = epilogue_ms(rows, d.problem), residual_ms(rows, d.problem), bias_ms(rows, d.problem)
        timed = next((m for m in rows if m.method == "measure" and m.algo == d.row and str(m.key) == d.key), None)
        best = select(rows, d.problem, options)
        if timed is not None and best is not None:
            out[k] = {"time_ms": cost_ms(timed, epilogue, d.problem.fusion, residual, bias),
                      "best_ms": cost_ms(best, epilogue, d.problem.fusion, residual, bias)}
    return out


def _spread(ratios: Sequence[float]) -> dict[str, Any]:
    ordered = sorted(ratios)
    if not ordered:
        return {"problems": 0}
    return {
        "problems": len(ordered),
        "within_3pct": sum(1 for r in ordered if r <= 1.03),
        "median": round(statistics.median(ordered), 4),
        "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4),
        "max": round(ordered[-1], 4),
    }


def compare(a: Mapping[Any, Decision], b: Mapping[Any, Decision], clock: Clock, options: TuneOptions) -> dict[str, Any]:
    """Run ``b``'s decisions against run ``a``'s, both re-timed on ``clock`` (:func:`retimed`).

    ``b_vs_a``: time(b's decision) / time(a's decision) per problem both decided (target <= 1.03);
    ``a_vs_best`` / ``b_vs_best``: each run's decision against the clock's own choice, i.e. the
    tuner's run-to-run noise as the same clock sees it.
    """
    ta, tb = retimed(a, clock, options), retimed(b, clock, options)
    both = sorted(set(ta) & set(tb), key=str)
    ratios = {k: tb[k]["time_ms"] / ta[k]["time_ms"] for k in both}
    worst = sorted(ratios.items(), key=lambda kv: -kv[1])[:5]
    return {
        "decided": {"a": len(a), "b": len(b), "retimed_both": len(both)},
        "same_choice": sum(1 for k in both if (a[k].key, a[k].row) == (b[k].key, b[k].row)),
        "b_vs_a": _spread(list(ratios.values())),
        "a_vs_best": _spread([t["time_ms"] / t["best_ms"] for t in ta.values()]),
        "b_vs_best": _spread([t["time_ms"] / t["best_ms"] for t in tb.values()]),
        "worst_b_vs_a": [{"problem": str(k), "ratio": round(r, 4), "a": [a[k].key, a[k].row], "b": [b[k].key, b[k].row]} for k, r in worst],
    }


def median_clock(clocks: Sequence[Clock]) -> dict[str, list[Measurement]]:
    """One clock from several: every configuration (problem key, row, method) at the median of its
    times in the clocks that timed it. One timing of a configuration can read 5-10% off its next
    (r3d_18's 3-D convs, two H200 runs), and a decision between near-equal candidates then looks
    that far off on a single clock."""
    times: dict[str, dict[tuple[str, str, str], list[Measurement]]] = {}
    for clock in clocks:
        for geometry, rows in clock.items():
            for m in rows:
                times.setdefault(geometry, {}).setdefault((str(m.key), m.algo, m.method), []).append(m)
    out: dict[str, list[Measurement]] = {}
    for geometry, configs in times.items():
        out[geometry] = []
        for rows in configs.values():
            # an early-stopped estimate (over 1.5x its best) counts only where no clock measured it
            rows = [m for m in rows if "early stop" not in m.note] or rows
            out[geometry].append(dataclasses.replace(rows[0], time_ms=statistics.median(m.time_ms for m in rows),
                                                     note=f"median of {len(rows)} clocks: " + ", ".join(f"{m.time_ms:.5f}" for m in rows)))
    return out


def clock_spread(decisions: Sequence[Decision], clocks: Sequence[Clock]) -> dict[str, Any]:
    """How far apart the clocks time the same configuration: for each decision's row (and each
    pass of its problem's epilogue) measured by at least two clocks, its slowest time / its
    fastest (``problems`` in the result counts those rows)."""
    ratios = []
    seen = set()
    for d in decisions:
        for shape in d.problem.candidates:
            for method, key, row in (("measure", d.key, d.row), ("epilogue", None, d.problem.fusion)):
                found: dict[tuple[str, str], list[float]] = {}
                for clock in clocks:
                    for m in clock.get(str(shape), ()):
                        if (m.method == method and m.algo == row and (key is None or str(m.key) == key)
                                and "early stop" not in m.note):
                            found.setdefault((str(m.key), m.algo), []).append(m.time_ms)
                for ident, ts in found.items():
                    if len(ts) >= 2 and (method, ident) not in seen:
                        seen.add((method, ident))
                        ratios.append(max(ts) / min(ts))
    return _spread(ratios)


def problem_time_lines(runs: Mapping[str, Any]) -> list[str]:
    """Where the runs' tuning time went (the summaries' ``task_seconds``): depthwise problems (the
    family convpass's own kernels are built for, one source per geometry) against the others, and the problems whose time differs most between ``one`` and ``retime``."""
    tasks = {n: runs[n]["summary"].get("task_seconds", []) for n in ("one", "two", "retime") if n in runs}
    tasks = {n: v for n, v in tasks.items() if v}
    if not tasks:
        return []
    lines = ["  seconds of the problems' tasks, depthwise / others: " + ", ".join(
        f"{n} {sum(t['seconds'] for t in v if t['depthwise']):.1f} / {sum(t['seconds'] for t in v if not t['depthwise']):.1f}"
        for n, v in tasks.items())]
    seconds = {n: {t["problem"]: t["seconds"] for t in v} for n, v in tasks.items()}
    if "one" in seconds and "retime" in seconds:
        both = set(seconds["one"]) & set(seconds["retime"])
        worst = sorted(both, key=lambda p: -abs(seconds["one"][p] - seconds["retime"][p]))[:5]
        lines += [f"    one {seconds['one'][p]:.2f} s, retime {seconds['retime'][p]:.2f} s: {p}" for p in worst]
    return lines


def clock_of(cache_path: Path, device: str) -> dict[str, list[Measurement]]:
    """geometry -> a tuning cache's ok rows with a time (``measure`` and epilogue passes) on ``device``."""
    from convpass.core.device import DeviceFingerprint
    from convpass.core.problem import ProblemKey
    from convpass.tuning.cache import TuningCache

    with sqlite3.connect(f"file:{cache_path}?mode=ro", uri=True) as c:
        keys = [k for (k,) in c.execute("SELECT DISTINCT key FROM measurements WHERE device = ?", (device,))]
    fingerprint, out = DeviceFingerprint.parse(device), {}
    with TuningCache(cache_path) as cache:
        for key in keys:
            for m in cache.get_key(fingerprint, ProblemKey.parse(key)):
                if m.status == "ok" and m.time_ms is not None:
                    out.setdefault(str(m.key.shape), []).append(m)
    return out


# ------------------------------------------------------------------------------------------------
# phases on the GPU machine


def _tune_command(args: argparse.Namespace, name: str) -> tuple[list[str], Path, dict[str, str]]:
    work = Path(args.work)
    (work / name).mkdir(parents=True, exist_ok=True)
    cache = work / f"{name}.db"
    for p in work.glob(f"{name}.db*"):
        p.unlink()  # a fresh cache: everything is measured
    models = sorted(str(p) for p in Path(args.panel).glob("*.onnx") if not p.stem.endswith("_fp16"))
    if not models:
        sys.exit(f"fleet_scaling: no models in {args.panel} (run models/export_panel.py --out {args.panel})")
    cmd = [sys.executable, "-m", "convpass.cli.main", "tune", *models, "-o", str(work / name), "--cache", str(cache),
           "--cluster", args.cluster, "--json", *sum((["--batch", b] for b in args.batch), [])]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": args.gpus, "PYTHONUNBUFFERED": "1"}
    return cmd, cache, env


def _finish(name: str, args: argparse.Namespace, proc: subprocess.Popen, started: float, extra: dict[str, Any]) -> dict[str, Any]:
    out, err = proc.communicate()
    wall = time.perf_counter() - started
    work = Path(args.work)
    (work / f"{name}.log").write_text(err)
    if proc.returncode != 0:
        print(err[-3000:], file=sys.stderr)
        sys.exit(f"fleet_scaling {name}: convpass tune exited with {proc.returncode}")
    doc = {"name": name, "gpus": args.gpus, "cluster": args.cluster, "wall_s": round(wall, 2), "summary": json.loads(out), **extra}
    (work / f"{name}.json").write_text(json.dumps(doc, indent=1))
    s = doc["summary"]
    print(f"{name}: {wall:.1f} s wall on GPUs {args.gpus} ({args.cluster}); {s['measured']} tasks measured "
          f"({s.get('problems_measured', s['measured'])} problems), {len(s['failed'])} failed, "
          f"{len(s['workers_lost'])} workers lost, max cache writes per task {s['cache_writes'].get('max_per_task')}")
    return doc


def run_phase(args: argparse.Namespace) -> int:
    cmd, _, env = _tune_command(args, args.name)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _finish(args.name, args, proc, started, {})
    return 0


def _workers_of(pid: int) -> list[int]:
    """The driver's worker processes: its children started by multiprocessing's spawn."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
    return sorted(found)


def kill_phase(args: argparse.Namespace) -> int:
    cmd, cache, env = _tune_command(args, args.name)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    killed: dict[str, Any] = {}
    while proc.poll() is None and not killed:
        time.sleep(0.5)
        try:
            with sqlite3.connect(f"file:{cache}?mode=ro", uri=True, timeout=1) as c:
                done = c.execute("SELECT COUNT(DISTINCT shape) FROM measurements").fetchone()[0]
        except sqlite3.Error:
            continue
        workers = _workers_of(proc.pid)
        if done >= args.kill_after and len(workers) >= 2:
            victim = workers[-1]
            os.kill(victim, signal.SIGKILL)
            killed = {"pid": victim, "after_s": round(time.perf_counter() - started, 2), "geometries_in_cache": done}
            print(f"kill: SIGKILL to worker pid {victim} after {killed['after_s']} s, {done} geometries measured", flush=True)
    doc = _finish(args.name, args, proc, started, {"killed": killed})
    s = doc["summary"]
    checks = {
        "a worker was killed": bool(killed),
        "the driver saw it": len(s["workers_lost"]) >= 1,
        "no problem missing": s["missing"] == [],
        "no problem failed": s["failed"] == [],
        "every problem written to the cache once": s["cache_writes"].get("max_per_task") == 1
        and s["cache_writes"].get("tasks") == s["measured"]
        and s.get("problems_measured", s["measured"]) == s["problems"],
    }
    doc["checks"] = checks
    Path(args.work, f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    for what, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    return 0 if all(checks.values()) else 1


def differing(a: Mapping[Any, Decision], b: Mapping[Any, Decision]) -> list[Decision]:
    """The problems both runs decided, but differently (``a``'s decision of each)."""
    return [a[k] for k in sorted(set(a) & set(b), key=str) if (a[k].key, a[k].row) != (b[k].key, b[k].row)]


def _run_doc(work: Path, name: str) -> dict[str, Any]:
    """The record of phase ``name`` in ``work``; exits with one line when that phase has not run."""
    path = work / f"{name}.json"
    if not path.is_file():
        sys.exit(f"fleet_scaling: {path} is missing: run the {name!r} phase first")
    return json.loads(path.read_text())


def _decisions_of_run(work: Path, name: str, options: TuneOptions) -> dict[tuple[str, str], Decision]:
    summary = _run_doc(work, name)["summary"]
    return decisions_of([m["output"] for m in summary["models"] if m["output"]], options)


def reclock_phase(args: argparse.Namespace) -> int:
    work = Path(args.work)
    retimed_on = _run_doc(work, "retime")["summary"]["devices"][0]
    options = tune_options()
    todo = differing(_decisions_of_run(work, "one", options), _decisions_of_run(work, "two", options))

    os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus  # before anything starts CUDA in this process
    import cupy as cp

    from convpass.native.device import detect
    from convpass.tuning.cache import TuningCache
    from convpass.tuning.tuner import measure_problem

    device = detect()
    if device is None:
        sys.exit("fleet_scaling reclock: no GPU (or no cuDNN) here")
    if str(device) != retimed_on:
        sys.exit(f"fleet_scaling reclock: this GPU is {device}, the retime run's was {retimed_on}")
    started = time.perf_counter()
    with cp.cuda.Stream(non_blocking=True):
        for r in range(args.rounds):
            path = work / f"reclock-{r}.db"
            for p in work.glob(f"reclock-{r}.db*"):
                p.unlink()
            with TuningCache(path) as cache:
                for d in todo:
                    cache.put(device, measure_problem(d.problem, options))
            print(f"reclock: round {r + 1} of {args.rounds}, {len(todo)} problems, {time.perf_counter() - started:.1f} s", flush=True)
    doc = {"name": "reclock", "gpus": args.gpus, "device": str(device), "rounds": args.rounds, "problems": [str(d.problem) for d in todo],
           "seconds": round(time.perf_counter() - started, 2)}
    (work / "reclock.json").write_text(json.dumps(doc, indent=1))
    return 0


def report_phase(args: argparse.Namespace) -> int:
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {n: json.loads((work / f"{n}.json").read_text()) for n in ("one", "two", "retime", "kill", "two-ray") if (work / f"{n}.json").is_file()}
    doc: dict[str, Any] = {"runs": runs}
    lines = []
    if "one" in runs and "two" in runs:
        one, two = runs["one"], runs["two"]
        # the retime run is a 1-GPU run of the same problems too: the ratio is taken against the
        # faster of the two (the same 1-GPU run was measured 20% apart on one machine)
        singles = {n: runs[n]["wall_s"] for n in ("one", "retime") if n in runs}
        fastest = min(singles.values())
        ratio = two["wall_s"] / fastest
        measured = one["summary"].get("problems_measured", one["summary"]["measured"])  # (one task per problem before 2026-11-27)
        doc["wall"] = {"one_gpu_s": one["wall_s"], "one_gpu_runs_s": singles, "two_gpus_s": two["wall_s"], "ratio": round(ratio, 3),
                       "ratio_per_run": {n: round(two["wall_s"] / w, 3) for n, w in singles.items()}, "target": 0.55,
                       "met": ratio <= 0.55, "problems": measured,
                       "one_gpu_s_per_problem": round(one["summary"]["seconds"]["tune"] / max(1, measured), 3)}
        lines.append(f"wall time, {measured} problems: 1 GPU {' / '.join(f'{w:.1f} s ({n})' for n, w in singles.items())}, "
                     f"2 GPUs {two['wall_s']:.1f} s -> {ratio:.2f}x of the faster 1-GPU run (target <= 0.55: "
                     f"{'met' if ratio <= 0.55 else 'NOT met'}); {doc['wall']['one_gpu_s_per_problem']} s per problem on 1 GPU")
        for name in ("one", "two"):  # where the wall time went: the serial part and the GPUs' idle time
            secs, busy = runs[name]["summary"]["seconds"], runs[name]["summary"].get("busy_s_by_slot", {})
            lines.append(f"  {name}: wall {runs[name]['wall_s']:.1f} s = outside the command's timed span "
                         f"{runs[name]['wall_s'] - secs.get('total', 0):.1f} s + first task at {secs.get('first_task', 0):.1f} s "
                         f"+ tuning {secs.get('tune', 0):.1f} s + writing {secs.get('write', 0):.2f} s; GPU busy in tuning: "
                         + ", ".join(f"{sid} {b:.1f} s ({b / max(secs.get('tune', 0), 1e-9):.0%})" for sid, b in busy.items()))
        lines += problem_time_lines(runs)
        if "two-ray" in runs:
            r = runs["two-ray"]["wall_s"] / fastest
            doc["wall"]["ray_two_gpus_s"], doc["wall"]["ray_ratio"] = runs["two-ray"]["wall_s"], round(r, 3)
            lines.append(f"  the same on Ray: 2 GPUs {runs['two-ray']['wall_s']:.1f} s -> {r:.2f}x of the faster 1-GPU run")
        if "retime" in runs:
            device = one["summary"]["devices"][0]
            clock = clock_of(work / "retime.db", device)
            options = tune_options()
            a, b = _decisions_of_run(work, "one", options), _decisions_of_run(work, "two", options)
            cmp = compare(a, b, clock, options)
            doc["decisions"] = cmp
            ba, na, nb = cmp["b_vs_a"], cmp["a_vs_best"], cmp["b_vs_best"]
            lines.append(f"decisions re-timed on one clock (the retime run), {ba['problems']} problems: 2-GPU within 3% of 1-GPU "
                         f"on {ba['within_3pct']}/{ba['problems']} (max {ba['max']}x; target: all); same choice on {cmp['same_choice']}")
            lines.append(f"  run-to-run noise on that clock: 1-GPU run within 3% of the best on {na['within_3pct']}/{na['problems']} "
                         f"(max {na['max']}x), 2-GPU run on {nb['within_3pct']}/{nb['problems']} (max {nb['max']}x)")
            if (work / "reclock.json").is_file():
                reclock = json.loads((work / "reclock.json").read_text())
                clocks = [clock, *(clock_of(work / f"reclock-{r}.db", device) for r in range(reclock["rounds"]))]
                cmp = compare(a, b, median_clock(clocks), options)
                todo = differing(a, b)
                spread = clock_spread([*todo, *differing(b, a)], clocks)
                doc["decisions_median_clock"] = {**cmp, "clocks": len(clocks), "reclocked_problems": len(reclock["problems"]),
                                                 "reclock_seconds": reclock["seconds"], "clock_spread": spread}
                ba = cmp["b_vs_a"]
                lines.append(f"the same on the median of {len(clocks)} clocks (the retime run and {reclock['rounds']} re-measurements of the "
                             f"{len(reclock['problems'])} problems decided differently, {reclock['seconds']:.0f} s): 2-GPU within 3% of 1-GPU on "
                             f"{ba['within_3pct']}/{ba['problems']} (max {ba['max']}x; target: all)")
                lines.append(f"  one configuration's slowest / fastest time between those clocks (the clock's own noise), "
                             f"{spread.get('problems', 0)} rows: median {spread.get('median')}x, p95 {spread.get('p95')}x, max {spread.get('max')}x")
                lines += [f"    {w['ratio']}x {w['problem']}: 1-GPU {w['a']}, 2-GPU {w['b']}" for w in cmp["worst_b_vs_a"][:3] if w["ratio"] > 1.03]
    if "kill" in runs:
        k = runs["kill"]
        ok = all(k.get("checks", {}).values()) and bool(k.get("checks"))
        doc["kill"] = {"killed": k.get("killed"), "checks": k.get("checks"), "met": ok}
        lines.append(f"kill a worker mid-run: {'met' if ok else 'NOT met'} " + json.dumps(k.get("checks")))
    (out / "fleet-check.json").write_text(json.dumps(doc, indent=1))
    print("\n".join(lines) if lines else "no runs found in " + str(work))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="phase", required=True)
    for phase in ("run", "kill"):
        q = sub.add_parser(phase)
        q.add_argument("--name", required=True)
        q.add_argument("--gpus", required=True, help="CUDA_VISIBLE_DEVICES for the run, e.g. 0 or 0,1")
        q.add_argument("--panel", default=".panel")
        q.add_argument("--work", default=".fleet-check")
        q.add_argument("--cluster", default="local")
        q.add_argument("--batch", action="append", default=None, help="as convpass tune --batch (default 1,32)")
        if phase == "kill":
            q.add_argument("--kill-after", type=int, default=40, help="kill once this many geometries are in the cache")
    q = sub.add_parser("reclock")
    q.add_argument("--gpus", default="0", help="CUDA_VISIBLE_DEVICES: one GPU of the retime run's type")
    q.add_argument("--work", default=".fleet-check")
    q.add_argument("--rounds", type=int, default=3)
    q = sub.add_parser("report")
    q.add_argument("--work", default=".fleet-check")
    q.add_argument("--out", default=os.environ.get("OUT", "fleet-check-out"))
    args = p.parse_args(argv)
    if getattr(args, "batch", "unset") is None:
        args.batch = ["1,32"]
    return {"run": run_phase, "kill": kill_phase, "reclock": reclock_phase, "report": report_phase}[args.phase](args)


if __name__ == "__main__":
    sys.exit(main())

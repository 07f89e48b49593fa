"""convpass's fresh-process start under two (or more) source trees, interleaved on one machine,
and beside it ONNX Runtime's configurations on the original models.

A change to start-up is judged against the tree before it, in the same call on the same machine:
single fresh processes vary by about +-0.15 s on an H200, more than most start-up changes move.
Each tree's child is the bench's own (``python -m convpass.bench.fresh --runtime convpass``, new
empty kernel-cache folders, :func:`convpass.bench.fresh.spawn`), with the tree first on
``PYTHONPATH`` and a working folder outside every tree (``python -m`` looks in its working folder
before ``PYTHONPATH``: a child started in the repository root imports the repository's convpass
whatever the path says). Before any timing, a probe process per tree, started the same way,
imports the modules the child imports at its start and lists every ``convpass`` module then
loaded (the GPU path's later imports are not seen): one from outside
the tree (e.g. an editable install's mapping of a sub-package) fails the run. Children of trees
since 6c2f103 also report the convpass folder they imported, checked the same way. One unmeasured
child per tree first writes its bytecode. A child that fails is recorded and the runs go on.

    git archive REV convpass passes | tar x -C /tmp/old          # the tree before the change
    python benchmarks/fresh_ab.py --tree old=/tmp/old --tree new=. \\
        --case resnet50.b1=tuned/resnet50.tuned.onnx,in1.npz [--case ...] [--runs 6] [--device cuda] [--json ab.json]

With ``--ort CONFIG`` (``HEURISTIC-nchw``, ``HEURISTIC-nhwc``, ``EXHAUSTIVE-nchw``,
``EXHAUSTIVE-nhwc``; repeatable) ONNX Runtime's fresh child (the bench's, its CUDA EP in that
configuration) runs each case's original model, given as the case's third path, as one more
contender in the same rotation; it imports the bench's child module from the last tree. Issue 10's
two start-up targets are then judged for each tree, on the medians: at or below ONNX Runtime
HEURISTIC's fastest configuration in every case, and at most 0.5x EXHAUSTIVE's fastest, geometric
mean over the cases.

    python benchmarks/fresh_ab.py --tree old=/tmp/old --tree new=. --ort HEURISTIC-nchw --ort EXHAUSTIVE-nchw \\
        --case resnet50.b1=tuned/resnet50.tuned.onnx,in1.npz,panel/resnet50.onnx [...]

Prints per case and contender the median of each part and the total, with every run's total; the
runs go round-robin (run 1 of every case and contender, then run 2, ...), the contenders' order
reversed every other run (A B, B A, ...), so drift falls on all alike.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from convpass.bench import fresh, peers

ORT_LABELS = tuple(peers.ort_label(c) for c in peers.ort_configs(True))
ORT_PREFIX = "ort:"


class Case(NamedTuple):
    name: str
    model: Path  # the tuned model (its .kernels side-car beside it)
    inputs: Path
    original: Path | None = None  # the model before tuning: what ONNX Runtime runs


def _pair(text: str, what: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"{what} is NAME=VALUE, not {text!r}")
    return name, value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fresh_ab.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, type=lambda t: _pair(t, "--tree"), metavar="NAME=FOLDER",
                   help="a source tree: the folder that holds its convpass package (twice or more)")
    p.add_argument("--case", action="append", required=True, type=lambda t: _pair(t, "--case"), metavar="NAME=MODEL,INPUTS.npz[,ORIGINAL]",
                   help="a tuned model (its .kernels side-car beside it), its inputs, and for --ort the original model (paths without commas)")
    p.add_argument("--ort", action="append", default=[], choices=ORT_LABELS, metavar="CONFIG",
                   help="an ONNX Runtime CUDA EP configuration to run on each case's original model: " + ", ".join(ORT_LABELS))
    p.add_argument("--runs", type=int, default=6, help="measured children per case and tree (default 6)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a child may take (default 300)")
    p.add_argument("--json", metavar="FILE", help="write every record here")
    return p


# what the probe imports: the child's imports (convpass.bench.fresh, then the executor)
_PROBE = ("import json, sys, convpass.bench.fresh, convpass.runtime.executor; "
          "print(json.dumps({n: m.__file__ for n, m in list(sys.modules.items()) if n.split('.')[0] == 'convpass' and getattr(m, '__file__', None)}))")


def _under(path: str | None, folder: Path) -> bool:
    if path is None:
        return False
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([real, root]) == root


def _check_tree(tree: Path, work: str, timeout: float) -> None:
    """RuntimeError unless a process started as the children are imports every convpass module
    from ``tree``."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=work, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": _pythonpath(tree)})
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"importing convpass from {tree} took over {timeout:g} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"importing convpass from {tree} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    outside = {n: f for n, f in json.loads(done.stdout.strip().splitlines()[-1]).items() if not _under(f, tree)}
    if outside:
        raise RuntimeError(f"a process for {tree} imported convpass modules from elsewhere: "
                           + ", ".join(f"{n} ({f})" for n, f in sorted(outside.items())))


def run(trees: Sequence[tuple[str, Path]], cases: Sequence[Sequence[Any]], runs: int, device: str,
        timeout: float, log=print, ort: Sequence[str] = ()) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every case under every tree (and every ONNX Runtime configuration of ``ort``, on the case's
    original model) ``runs`` times, round-robin, the contenders' order reversed every other run;
    ``{case: {contender: [record, ...]}}``, ONNX Runtime's contenders named ``ort:CONFIG`` (a
    failed child's record has status "failed"). ``cases``: :class:`Case` or its fields. Raises
    RuntimeError when a tree's processes import convpass from elsewhere."""
    trees = [(name, Path(tree).resolve()) for name, tree in trees]
    cases = [Case(*c) for c in cases]
    if ort and any(c.original is None for c in cases):
        raise ValueError("ONNX Runtime's contenders need every case's original model")
    contenders = [(name, tree, None) for name, tree in trees] + [(ORT_PREFIX + config, trees[-1][1], config) for config in ort]
    records: dict[str, dict[str, list[dict[str, Any]]]] = {c.name: {name: [] for name, _, _ in contenders} for c in cases}
    with tempfile.TemporaryDirectory(prefix="fresh-ab-") as work:
        def child(tree: Path, config: str | None, case: Case, write_bytecode: bool = False) -> dict[str, Any]:
            if config is None:
                cmd = fresh.child_command("convpass", case.model, case.inputs, device=device)
            else:
                cmd = fresh.child_command("ort", case.original, case.inputs, device=device, config=config)
            rec = fresh.spawn(cmd, timeout, work, write_bytecode=write_bytecode, env={"PYTHONPATH": _pythonpath(tree)}, cwd=work)
            if config is None and rec["status"] == "ok" and rec.get("module") is not None and not _under(rec["module"], tree):
                raise RuntimeError(f"the child for {tree} imported convpass from {rec['module']}, not from {tree}")
            return rec

        for _name, tree in trees:
            _check_tree(tree, work, timeout)
        for name, tree, config in contenders[: len(trees) + min(len(ort), 1)]:  # ONNX Runtime's Python: once
            rec = child(tree, config, cases[0], write_bytecode=True)
            done = "imports checked, bytecode written" if config is None else "bytecode written"
            log(f"{name}: {done} ({tree})" + ("" if rec["status"] == "ok" else f"; the run failed: {rec['reason']}"))
        for i in range(runs):
            for case in cases:
                for name, tree, config in (contenders if i % 2 == 0 else contenders[::-1]):
                    rec = child(tree, config, case)
                    records[case.name][name].append(rec)
                    said = f"{rec['parts']['total_s']:.3f} s" if rec["status"] == "ok" else f"failed: {rec['reason']}"
                    log(f"run {i + 1}/{runs} {case.name} {name}: {said}")
    return records


def _pythonpath(tree: Path) -> str:
    rest = os.environ.get("PYTHONPATH")
    return os.fspath(tree) + (os.pathsep + rest if rest else "")


def table(records: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    """One line per case and contender: the median of each part and of the total, every total, and
    the failed runs and convpass's run-time compilations where there were any."""
    lines = []
    for case, by_tree in records.items():
        for tree, recs in by_tree.items():
            parts = [r["parts"] for r in recs if r["status"] == "ok"]
            failed = len(recs) - len(parts)
            tail = f"  {failed} failed" if failed else ""
            # a stale or missing kernel side-car compiles at start-up: its times are not comparable
            compiled = sum(r.get("compilations") or 0 for r in recs if r["status"] == "ok")
            tail += f"  {compiled} run-time compilation(s)" if compiled else ""
            if not parts:
                lines.append(f"{case:24s} {tree:19s} no run succeeded{tail}")
                continue
            med = {k: statistics.median(vals) for k in fresh.PART_KEYS if (vals := [p[k] for p in parts if p.get(k) is not None])}
            shown = " ".join(f"{k[:-2]}={v:.3f}" for k, v in med.items() if k != "total_s")
            totals = ", ".join(f"{p['total_s']:.3f}" for p in parts)
            lines.append(f"{case:24s} {tree:19s} total median {med['total_s']:.3f} s  ({shown})  runs [{totals}]{tail}")
    return lines


def _median_total(recs: Sequence[dict[str, Any]]) -> float | None:
    totals = [r["parts"]["total_s"] for r in recs if r["status"] == "ok"]
    return statistics.median(totals) if totals else None


def _fastest(by_contender: dict[str, list[dict[str, Any]]], search: str) -> tuple[float, str] | None:
    """The fastest median of ONNX Runtime's configurations of ``search``, and its name."""
    found = [(m, name) for name, recs in by_contender.items()
             if name.startswith(ORT_PREFIX + search + "-") and (m := _median_total(recs)) is not None]
    return min(found) if found else None


def targets(records: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    """Issue 10's two start-up targets for each tree against ONNX Runtime's contenders, on the
    medians: per case the ratio to the fastest configuration of each search that ran (HEURISTIC,
    EXHAUSTIVE), then one verdict line per tree. Each target is judged only when its search ran; a
    case where the tree or every configuration of that search failed is "not measured" there, and
    the target is then not met."""
    some = next(iter(records.values()), {})
    trees = [name for name in some if not name.startswith(ORT_PREFIX)]
    searches = [s for s in ("HEURISTIC", "EXHAUSTIVE") if any(n.startswith(f"{ORT_PREFIX}{s}-") for n in some)]
    if not searches:
        return []
    lines = []
    for tree in trees:
        ratios: dict[str, list[float]] = {s: [] for s in searches}
        missing = dict.fromkeys(searches, 0)
        for case, by_contender in records.items():
            mine = _median_total(by_contender[tree])
            said = []
            for search in searches:
                peer = _fastest(by_contender, search)
                if mine is None or peer is None:
                    missing[search] += 1
                    said.append(f"{search} not measured (no successful run of {'this tree' if mine is None else search})")
                    continue
                ratios[search].append(mine / peer[0])
                said.append(f"{ratios[search][-1]:.2f}x ONNX Runtime {search} ({peer[0]:.3f} s, {peer[1][len(ORT_PREFIX):]})")
            head = f"{mine:.3f} s" if mine is not None else "no successful run"
            lines.append(f"{case:24s} {tree:19s} {head}: " + ", ".join(said))
        verdicts = []
        for search in searches:
            r, gap = ratios[search], f", {missing[search]} case(s) not measured" if missing[search] else ""
            if search == "HEURISTIC":
                above = sum(x > 1.0 for x in r)
                met = bool(r) and not above and not missing[search]
                verdicts.append(f"at or below ONNX Runtime HEURISTIC in every case: {'met' if met else 'not met'} ({len(r) - above} of {len(r)}{gap})")
            elif r:
                geomean = math.exp(statistics.fmean(math.log(x) for x in r))
                met = geomean <= 0.5 and not missing[search]
                verdicts.append(f"at most 0.5x EXHAUSTIVE, geometric mean: {'met' if met else 'not met'} ({geomean:.2f}x{gap})")
            else:
                verdicts.append("at most 0.5x EXHAUSTIVE, geometric mean: not measured")
        lines.append(f"{tree}: " + "; ".join(verdicts))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.runs < 1:
        raise SystemExit("fresh_ab.py: --runs must be at least 1")
    trees = [(name, Path(folder).resolve()) for name, folder in args.tree]
    if len(trees) < (1 if args.ort else 2) or len({n for n, _ in trees}) != len(trees):
        raise SystemExit("fresh_ab.py: give two or more --tree (one is enough beside --ort), each with its own name")
    if any(n.startswith(ORT_PREFIX) for n, _ in trees) or len(set(args.ort)) != len(args.ort):
        raise SystemExit(f"fresh_ab.py: a tree's name may not begin with {ORT_PREFIX!r}, and each --ort is given once")
    for name, tree in trees:
        if not (tree / "convpass" / "__init__.py").is_file():
            raise SystemExit(f"fresh_ab.py: tree {name!r}: {tree} holds no convpass package")
    cases = []
    for name, spec in args.case:
        paths = spec.split(",")
        if len(paths) not in (2, 3) or not all(paths):
            raise SystemExit(f"fresh_ab.py: --case {name}={spec}: give MODEL,INPUTS.npz or MODEL,INPUTS.npz,ORIGINAL")
        if args.ort and len(paths) < 3:
            raise SystemExit(f"fresh_ab.py: --case {name}={spec}: --ort needs the original model (MODEL,INPUTS.npz,ORIGINAL)")
        cases.append(Case(name, *(Path(p).resolve() for p in paths)))
    try:
        records = run(trees, cases, args.runs, args.device, args.timeout, log=lambda s: print(s, file=sys.stderr, flush=True), ort=args.ort)
    except RuntimeError as e:
        print(f"fresh_ab.py: {e}", file=sys.stderr)
        return 1
    print("\n".join(table(records) + targets(records)))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 1 if any(r["status"] != "ok" for by_tree in records.values() for recs in by_tree.values() for r in recs) else 0


if __name__ == "__main__":
    sys.exit(main())

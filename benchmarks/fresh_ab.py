"""convpass's fresh-process start under two (or more) source trees, interleaved on one machine.

A change to start-up is judged against the tree before it, in the same call on the same machine:
single fresh processes vary by about +-0.15 s on an H200, more than most start-up changes move.
Each tree's child is the bench's own (``python -m convpass.bench.fresh --runtime convpass``, new
empty kernel-cache folders, :func:`convpass.bench.fresh.spawn`), with the tree first on
``PYTHONPATH`` and a working folder outside every tree (``python -m`` looks in its working folder
before ``PYTHONPATH``: a child started in the repository root imports the repository's convpass
whatever the path says). Every child reports the convpass folder it imported, and a child that
imported another tree's fails the run. One unmeasured child per tree first writes its bytecode.

    git archive REV convpass passes | tar x -C /tmp/old          # the tree before the change
    python benchmarks/fresh_ab.py --tree old=/tmp/old --tree new=. \\
        --case resnet50.b1=tuned/resnet50.tuned.onnx,in1.npz [--case ...] [--runs 6] [--device cuda] [--json ab.json]

Prints per case and tree the median of each part and the total, with every run's total; the
runs go round-robin (run 1 of every case and tree, then run 2, ...), so drift falls on all alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from convpass.bench import fresh


def _pair(text: str, what: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"{what} is NAME=VALUE, not {text!r}")
    return name, value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fresh_ab.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, type=lambda t: _pair(t, "--tree"), metavar="NAME=FOLDER",
                   help="a source tree: the folder that holds its convpass package (twice or more)")
    p.add_argument("--case", action="append", required=True, type=lambda t: _pair(t, "--case"), metavar="NAME=MODEL,INPUTS.npz",
                   help="a tuned model (its .kernels side-car beside it) and its inputs")
    p.add_argument("--runs", type=int, default=6, help="measured children per case and tree (default 6)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a child may take (default 300)")
    p.add_argument("--json", metavar="FILE", help="write every record here")
    return p


def _same_folder(a: str | None, b: Path) -> bool:
    return a is not None and os.path.realpath(a) == os.path.realpath(b)


def run(trees: Sequence[tuple[str, Path]], cases: Sequence[tuple[str, Path, Path]], runs: int, device: str,
        timeout: float, log=print) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every case under every tree ``runs`` times, round-robin; ``{case: {tree: [record, ...]}}``.
    Raises RuntimeError when a child fails or imported a convpass other than its tree's."""
    records: dict[str, dict[str, list[dict[str, Any]]]] = {c: {t: [] for t, _ in trees} for c, _, _ in cases}
    with tempfile.TemporaryDirectory(prefix="fresh-ab-") as work:
        def child(tree: Path, model: Path, inputs: Path, write_bytecode: bool = False) -> dict[str, Any]:
            cmd = fresh.child_command("convpass", model, inputs, device=device)
            rec = fresh.spawn(cmd, timeout, work, write_bytecode=write_bytecode, env={"PYTHONPATH": _pythonpath(tree)}, cwd=work)
            if rec["status"] != "ok":
                raise RuntimeError(f"{model.name} under {tree}: {rec['reason']}")
            if not _same_folder(rec["module"], tree / "convpass"):
                raise RuntimeError(f"the child for {tree} imported convpass from {rec['module']}, not {tree / 'convpass'}")
            return rec

        for name, tree in trees:
            child(tree, cases[0][1], cases[0][2], write_bytecode=True)
            log(f"{name}: bytecode written ({tree})")
        for i in range(runs):
            for case, model, inputs in cases:
                for name, tree in trees:
                    rec = child(tree, model, inputs)
                    records[case][name].append(rec)
                    log(f"run {i + 1}/{runs} {case} {name}: {rec['parts']['total_s']:.3f} s")
    return records


def _pythonpath(tree: Path) -> str:
    rest = os.environ.get("PYTHONPATH")
    return os.fspath(tree) + (os.pathsep + rest if rest else "")


def table(records: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    """One line per case and tree: the median of each part and of the total, and every total."""
    lines = []
    for case, by_tree in records.items():
        for tree, recs in by_tree.items():
            parts = [r["parts"] for r in recs]
            med = {k: statistics.median(p[k] for p in parts) for k in fresh.PART_KEYS if all(p.get(k) is not None for p in parts)}
            shown = " ".join(f"{k[:-2]}={v:.3f}" for k, v in med.items() if k != "total_s")
            totals = ", ".join(f"{p['total_s']:.3f}" for p in parts)
            lines.append(f"{case:24s} {tree:8s} total median {med['total_s']:.3f} s  ({shown})  runs [{totals}]")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    trees = [(name, Path(folder).resolve()) for name, folder in args.tree]
    if len(trees) < 2 or len({n for n, _ in trees}) != len(trees):
        raise SystemExit("fresh_ab.py: give two or more --tree, each with its own name")
    for name, tree in trees:
        if not (tree / "convpass" / "__init__.py").is_file():
            raise SystemExit(f"fresh_ab.py: tree {name!r}: {tree} holds no convpass package")
    cases = []
    for name, spec in args.case:
        model, sep, inputs = spec.partition(",")
        if not sep:
            raise SystemExit(f"fresh_ab.py: --case {name}={spec}: give MODEL,INPUTS.npz")
        cases.append((name, Path(model).resolve(), Path(inputs).resolve()))
    try:
        records = run(trees, cases, args.runs, args.device, args.timeout, log=lambda s: print(s, file=sys.stderr, flush=True))
    except RuntimeError as e:
        print(f"fresh_ab.py: {e}", file=sys.stderr)
        return 1
    print("\n".join(table(records)))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""pytest plugin for ``scripts/gpu-tests.sh``: one shard of the GPU tests, resumable across calls.

The device machine allows 10 minutes a call; the GPU suite with the exported panel models takes
longer. So each GPU runs one shard, and every finished test is written down as it ends:

* ``GPU_TESTS_SHARD=k/n``: keep the k-th of every n collected tests (collection order, which is
  the same in every call on one machine);
* ``GPU_TESTS_LOG=PATH``: every finished test is appended as ``<outcome>\\t<node id>`` (outcomes:
  passed, failed, error, skipped, xfailed, xpassed), a failure's report to ``PATH.failures``, and
  the number of tests collected to ``PATH.collected``, and each finished test's seconds (setup,
  call and teardown: a module fixture that tunes a model counts in its first test) to
  ``PATH.seconds``; tests already in the log are deselected, so the next call runs only what is
  left. A test cut off by the call's end is not in the log and runs again.

``python3 scripts/gpu_tests_progress.py summary PATH`` prints the totals, the failures, what is
left and the slowest tests (where the device time of the suite goes).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

_WORST = ("error", "failed", "xpassed", "passed", "xfailed", "skipped")  # one id's several lines: the first of these wins


def _shard() -> tuple[int, int] | None:
    spec = os.environ.get("GPU_TESTS_SHARD")
    if not spec:
        return None
    try:
        k, n = (int(v) for v in spec.split("/"))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise pytest.UsageError(f"GPU_TESTS_SHARD={spec!r}: want k/n with 0 <= k < n (the k-th of n shards)")
    return k, n


def read_log(path: str | os.PathLike) -> dict[str, str]:
    """Node id -> outcome (the worst of its lines) of every test the log holds."""
    outcomes: dict[str, str] = {}
    p = Path(path)
    if not p.exists():
        return outcomes
    for line in p.read_text().splitlines():
        outcome, _, nodeid = line.partition("\t")
        if nodeid and outcome in _WORST:
            old = outcomes.get(nodeid)
            if old is None or _WORST.index(outcome) < _WORST.index(old):
                outcomes[nodeid] = outcome
    return outcomes


@pytest.hookimpl(trylast=True)  # after ``-m gpu`` has deselected the rest: shard and count only what runs
def pytest_collection_modifyitems(config, items):
    shard, log = _shard(), os.environ.get("GPU_TESTS_LOG")
    done = read_log(log) if log else {}
    mine = [item for i, item in enumerate(items) if shard is None or i % shard[1] == shard[0]]
    if log:
        Path(f"{log}.collected").write_text(f"{len(items)}\n")
    keep = [item for item in mine if item.nodeid not in done]
    kept = set(keep)
    dropped = [item for item in items if item not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _outcome(report) -> str | None:
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            return "xfailed" if report.skipped else "xpassed"
        return report.outcome
    if report.when == "setup" and not report.passed:
        if hasattr(report, "wasxfail"):
            return "xfailed"
        return "skipped" if report.skipped else "error"
    if report.when == "teardown" and report.failed:
        return "error"
    return None


_seconds: dict[str, float] = {}  # node id -> its phases' seconds so far (this process)


def pytest_runtest_logreport(report):
    log = os.environ.get("GPU_TESTS_LOG")
    if log:
        _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + float(getattr(report, "duration", 0.0) or 0.0)
        if report.when == "teardown":
            with open(f"{log}.seconds", "a") as f:
                f.write(f"{_seconds.pop(report.nodeid):.2f}\t{report.nodeid}\n")
    outcome = _outcome(report)
    if not log or outcome is None:
        return
    with open(log, "a") as f:
        f.write(f"{outcome}\t{report.nodeid}\n")
    if outcome in ("failed", "error", "xpassed"):
        with open(f"{log}.failures", "a") as f:
            f.write(f"=== {outcome} {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n")


def summary(path: str, slowest: int = 12) -> str:
    outcomes = read_log(path)
    counts = Counter(outcomes.values())
    collected = Path(f"{path}.collected")
    total = int(collected.read_text().strip() or 0) if collected.exists() else None
    lines = [", ".join(f"{counts[o]} {o}" for o in _WORST if counts[o]) or "no test finished yet"]
    lines.append("nothing collected yet" if total is None else f"{max(total - len(outcomes), 0)} of {total} left")
    lines += [f"  {o.upper()} {nodeid}" for nodeid, o in sorted(outcomes.items()) if o in ("failed", "error", "xpassed")]
    seconds = read_seconds(f"{path}.seconds")
    if seconds:
        lines.append(f"{sum(seconds.values()):.0f} s in {len(seconds)} tests; the slowest:")
        lines += [f"  {t:7.1f} s  {nodeid}" for nodeid, t in sorted(seconds.items(), key=lambda kv: -kv[1])[:slowest]]
    return "\n".join(lines)


def read_seconds(path: str | os.PathLike) -> dict[str, float]:
    """Node id -> seconds of its latest finished run, from a ``PATH.seconds`` file (none: empty)."""
    found: dict[str, float] = {}
    p = Path(path)
    if p.exists():
        for line in p.read_text().splitlines():
            secs, _, nodeid = line.partition("\t")
            try:
                found[nodeid] = float(secs)
            except ValueError:
                continue
    return found


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "summary":
        sys.exit("usage: python3 scripts/gpu_tests_progress.py summary LOG")
    print(summary(sys.argv[2]))

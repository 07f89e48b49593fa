"""What a fleet run did: :class:`FleetReport`, its ``--json`` summary and the lines ``convpass tune``
prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console

from convpass.core.device import DeviceFingerprint
from convpass.core.text import markup
from convpass.fleet import scheduler as sched
from convpass.fleet.models import ModelProblems


@dataclasses.dataclass
class FleetReport:
    """What a fleet run did; :meth:`to_json` is the ``--json`` summary."""

    cluster: str
    cache: str
    models: list[ModelProblems]
    problems: int = 0  # distinct problems of the models collected
    devices: list[DeviceFingerprint] = dataclasses.field(default_factory=list)
    cache_only: list[DeviceFingerprint] = dataclasses.field(default_factory=list)
    tasks: list[sched.Task] = dataclasses.field(default_factory=list)
    cached: int = 0
    schedule: sched.ScheduleResult | None = None
    written: list[Path] = dataclasses.field(default_factory=list)  # in the order they were written
    written_during_tune: int = 0  # of them, while tasks were still running
    interrupted: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)
    # Seconds from the start of the run (they overlap): workers (all started), first_model (the
    # first model collected), collect (every model collected), first_task (given to a worker);
    # and spans: tune (first task to the last task settled), write (the models left to write after
    # tuning), total. See print_report / seconds_line.
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        s = self.schedule
        by_id = {t.id: t for t in self.tasks}

        def task_json(task_id: int, reasons: list[str]) -> dict[str, Any]:
            t = by_id[task_id]
            return {"device": str(t.device), "problem": str(t), "attempts": s.attempts.get(task_id, 0) if s else 0, "reasons": reasons}

        finished = s.finished if s else {}
        superseded = s.superseded if s else {}
        measured_pairs = {(by_id[i].device, p) for i in finished for p in by_id[i].problems}
        return {
            "cluster": self.cluster,
            "cache": self.cache,
            "devices": [str(d) for d in self.devices],
            "cache_only_devices": [str(d) for d in self.cache_only],
            "slots": [{"id": x.id, "device": str(x.device), "where": x.where} for x in (s.slots if s else [])],
            "workers_not_started": s.not_started if s else [],
            "models": [
                {
                    "model": str(m.spec.path),
                    "output": str(m.output) if m.output in self.written else None,
                    "collected": m.collected,
                    "profiles": [p.name for p in m.report.profiles] if m.report else [],
                    "convs": m.report.convs if m.report else 0,
                    "untuned_convs": [{"node": n, "why": w} for n, w in m.report.skipped] if m.report else [],
                    "problems": len(m.problems),
                    "decided": {d: v[0] for d, v in m.report.by_device.items()} if m.report else {},
                    "undecided": {d: v[1] for d, v in m.report.by_device.items()} if m.report else {},
                }
                for m in self.models
            ],
            "problems": self.problems,
            "tasks": len(self.tasks) - len(superseded) + self.cached,  # (geometry's problems, cluster device) pairs
            "cached": self.cached,
            "measured": len(finished),
            "problems_measured": len(measured_pairs),  # (problem, device) pairs
            "problems_measured_again": sum(len(by_id[i].problems) for i in finished) - len(measured_pairs),
            "superseded": len(superseded),
            "failed": [task_json(i, r) for i, r in sorted(s.failed.items())] if s else [],
            "missing": [str(by_id[t]) for t in sorted(set(by_id) - set(finished) - set(s.failed if s else {}) - set(superseded))],
            "retried": s.retried if s else 0,
            "retries": [task_json(i, r) for i, r in sorted(s.reasons.items()) if i in finished] if s else [],
            "workers_lost": [{"slot": sid, "reason": why} for sid, why in (s.lost if s else [])],
            "slots_retired": s.retired if s else {},
            "measured_by_slot": _count(finished.values()),
            "busy_s_by_slot": {sid: round(v, 3) for sid, v in sorted(s.busy.items())} if s else {},
            "task_seconds": [{"device": str(by_id[i].device), "problem": str(by_id[i]), "problems": len(by_id[i].problems),
                              "depthwise": by_id[i].problems[0].primary.is_depthwise,
                              "slot": finished.get(i), "seconds": round(v, 6)} for i, v in sorted(s.task_seconds.items())] if s else [],
            "cache_writes": {"tasks": len(s.writes), "max_per_task": max(s.writes.values(), default=0)} if s else {},
            "written_during_tune": self.written_during_tune,
            "interrupted": self.interrupted,
            "notes": self.notes,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def seconds_line(seconds: Mapping[str, float]) -> str:
    """The report's line of :attr:`FleetReport.seconds`: the run's total as the time to the first
    task, the tuning and the writing after it; then when the overlapping steps ended."""
    tuned = "first_task" in seconds
    parts = [f"first task at {seconds['first_task']:.1f}" if tuned else "no task",
             *(f"{what} {seconds[k]:.1f}" for k, what in (("tune", "tuning"), ("write", "writing after it")) if k in seconds and (tuned or k != "tune"))]
    points = [f"{what} {seconds[k]:.1f}" for k, what in (("workers", "workers started"), ("first_model", "first model collected"),
                                                       ("collect", "all collected")) if k in seconds]
    return f"total {seconds.get('total', 0.0):.1f} = " + " + ".join(parts) + (f"; since the start: {', '.join(points)}" if points else "")


def print_report(report: FleetReport, console: Console) -> None:
    doc = report.to_json()
    console.print(
        f"[bold]convpass tune[/]: {len(report.models)} model(s), {report.problems} distinct problems, "
        f"{len(report.devices)} device type(s); cluster {report.cluster}: "
        + (", ".join(f"{x['id']} ({DeviceFingerprint.parse(x['device']).name})" for x in doc["slots"]) or "no workers")
    )
    for why in doc["workers_not_started"]:
        console.print(f"  [yellow]note[/]: {markup(why)}")
    for device in report.cache_only:
        console.print(f"  {markup(device)}: no worker of this type; decisions from the tuning cache only")
    console.print(
        f"  {doc['tasks']} tasks (a geometry's problems on one device type): {doc['cached']} already in the tuning cache, "
        f"{doc['measured']} measured ({doc['problems_measured']} problems), {len(doc['failed'])} failed"
        + (f", {doc['retried']} retries" if doc["retried"] else "")
        + (f", {doc['problems_measured_again']} problems measured again with a later model's problem of their geometry"
           if doc["problems_measured_again"] else "")
        + (f", {doc['superseded']} replaced by a later model's task of the same geometry" if doc["superseded"] else "")
    )
    console.print(f"  seconds: {seconds_line(report.seconds)}; {report.written_during_tune} of {len(report.models)} model(s) written while tuning")
    for lost in doc["workers_lost"]:
        console.print(f"  [yellow]worker lost[/] {markup(lost['slot'])}: {markup(lost['reason'])}")
    for sid, why in doc["slots_retired"].items():
        console.print(f"  [yellow]retired[/] {markup(sid)}: {markup(why)}")
    for f in doc["failed"]:
        console.print(f"  [red]failed[/] {markup(f['problem'])} on {markup(f['device'])} after {f['attempts']} attempt(s): {markup(f['reasons'][-1])} -> algo=auto")
    for note in report.notes:
        console.print(f"  [yellow]note[/]: {markup(note)}")
    for m in doc["models"]:
        if m["output"] is not None:
            decided = ", ".join(f"{DeviceFingerprint.parse(d).name} {n}/{m['problems']}" for d, n in m["decided"].items())
            console.print(f"  wrote {markup(m['output'])}: {m['convs']} convs, {m['problems']} problems; decided {markup(decided or '-')}")
    if report.interrupted:
        not_written = [m["model"] for m in doc["models"] if m["output"] is None]
        written = (
            f"{len(report.written)} model(s) complete before the interrupt were written (above)"
            + (f"; not written: {', '.join(not_written)}" if not_written else "")
            if report.written else "no model was written"
        )
        console.print(
            f"  [yellow]interrupted[/]: {doc['problems_measured']} measured problems are in {report.cache}; {written}; "
            "run the same command again to measure only the rest"
        )

"""The fleet scheduler: problems for device types as tasks on worker slots, with retries; the
driver that runs it is the only writer of the tuning cache.

Rules:

* A task is one geometry's problems for one device type (a fingerprint): the problems whose
  candidate geometries meet (the same conv with different epilogues), measured one after the other
  by one worker, as one GPU's tuner measures them. A decision compares rows of its geometry with its
  own fused calls; rows two workers measured are not comparable (one conv read markedly faster in
  the tasks one GPU ran than in the task the other ran, and a problem decided from both tasks' rows
  was off; docs/measurements/2026-11-27-fleet-rows-of-two-gpus.md). A task may replace earlier ones
  (``replaces``, every earlier task of its geometry): a later model's problem of a geometry already
  given is measured with that geometry's earlier problems. A replaced task not started yet, or one
  that would be tried again, is dropped (``ScheduleResult.superseded``); the task replacing one that
  is running waits for it; and when a task that replaces finished ones is written, their rows it did
  not measure again are deleted (rows of other runs stay). So the rows this run wrote of a geometry
  are one task's. It runs only on a slot of that type;
  a slot is one worker holding one GPU (or one process, for measurers that need none), running one
  task at a time. How slots exist is the executor's business (:mod:`convpass.fleet.local`,
  :mod:`convpass.fleet.ray_cluster`); the bookkeeping here is the same for all of them.
* A free slot takes the first pending task of its device type in the order the tasks were given
  (the driver orders them: :func:`convpass.fleet.models.tuning_order`); a task tried again goes
  back to its place in that order, to another slot of its type while one is alive.
* A finished task's rows are written to the cache at once, in one transaction (just after its
  worker was given its next task): nothing finished is lost whatever happens later, and a task is
  written once.
* The measurer raised: the worker lives on and the task is tried again, up to ``1 + retries``
  attempts. The worker died, was killed or passed ``task_timeout``: its task is tried again
  elsewhere and the worker restarted; a slot that loses ``SLOT_LOSSES`` workers in a row without
  finishing a task in between is retired (a broken GPU must not eat every task's attempts).
* A task that failed every attempt is recorded as failed with every attempt's reason; a task whose
  device type has no live slot (none in the cluster, or all retired) fails with that reason.
* ``on_settled`` hears of every task once, as soon as it is settled: finished (its rows are in the
  cache), failed for good, or replaced before it started (``None``: the task that replaced it
  measures its problems). The driver writes a model as soon as all of its tasks are.
* Tasks may keep coming while the run goes on: a :class:`Feed` (the driver's, which collects models
  while the workers measure) is asked for new tasks at every turn of the loop; they queue after
  the tasks already given, in the order the feed gives them, and the run ends when every task is
  settled and the feed has nothing more to give.
* An exception in the driver (Ctrl-C is ``KeyboardInterrupt``) stops the workers at once; what was
  written stays. ``KeyboardInterrupt`` returns a result marked ``interrupted``; others propagate.
  An exception raised by the feed (a model that cannot be prepared or written) stops the run more
  gently: no task is started any more, the tasks running finish (their rows are written), then
  the workers stop and the result says what stopped it (``stopped_by``); what was not settled is
  neither finished nor failed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from convpass.core.device import DeviceFingerprint
from convpass.core.options import TuneOptions

if TYPE_CHECKING:  # not at run time: this module is imported before the driver launches its workers
    from convpass.core.problem import ConvProblem, ConvShape
    from convpass.fleet.measurers import Measurer
    from convpass.tuning.cache import TuningCache
    from convpass.tuning.cache_rows import Measurement

SLOT_LOSSES = 3
FEED_POLL_S = 0.02  # how long the loop may wait on the workers before asking an open or busy feed again


@dataclasses.dataclass(frozen=True)
class Task:
    """One geometry's problems to measure, in this order, for one device type (module rules)."""

    id: int
    device: DeviceFingerprint
    problems: tuple[ConvProblem, ...]
    replaces: tuple[int, ...] = ()  # ids of the earlier tasks of its geometry, whose problems this one measures again

    @property
    def shapes(self) -> set[ConvShape]:
        """The candidate geometries of its problems: what its rows may be of."""
        return {shape for p in self.problems for shape in p.candidates}

    def __str__(self) -> str:
        return "; ".join(map(str, self.problems))


@dataclasses.dataclass(frozen=True)
class Slot:
    """One worker that runs one task at a time on one device."""

    id: str
    device: DeviceFingerprint
    where: str  # for people: "GPU 1 of this host, pid 4242", "node 10.0.0.3, pid 77"


# ---- what an executor reports (Executor.wait) --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Finished:
    slot_id: str
    task_id: int
    rows: list[Measurement]
    seconds: float


@dataclasses.dataclass(frozen=True)
class Failed:
    """The measurer raised; the worker is alive and free."""

    slot_id: str
    task_id: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Lost:
    """The worker is gone (died, killed, node lost); its task, if it had one, did not finish."""

    slot_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Ready:
    """A restarted worker is ready (its slot, with the device it reported)."""

    slot: Slot


@dataclasses.dataclass(frozen=True)
class StartFailed:
    slot_id: str
    reason: str


Event = Finished | Failed | Lost | Ready | StartFailed


class Executor(Protocol):
    """Runs workers: a local process per GPU, Ray actors, ... (see the module docstring)."""

    name: str

    def launch(self, measurer: Measurer) -> None:
        """Start the workers without waiting for them (the driver collects problems meanwhile)."""
        ...

    def wait_started(self, poll: Callable[[], None] | None = None) -> tuple[list[Slot], list[str]]:
        """Wait until every launched worker is ready or failed to start; the slots that are ready,
        and why the others did not start. ``poll`` is called at least every :data:`FEED_POLL_S`
        seconds meanwhile; what it raises ends the wait (the caller then shuts the workers down)."""
        ...

    def submit(self, slot_id: str, task: Task, options: TuneOptions) -> None:
        """Give a free slot a task; its outcome comes back from :meth:`wait`."""
        ...

    def wait(self, timeout: float | None) -> list[Event]:
        """What happened since the last call; blocks until something did or ``timeout`` passed."""
        ...

    def kill(self, slot_id: str) -> None:
        """Stop a slot's worker now (its task timed out); no event follows for it."""
        ...

    def restart(self, slot_id: str) -> None:
        """Start a new worker for a slot whose worker is gone; Ready or StartFailed follows."""
        ...

    def stop(self) -> None:
        """Ask every worker to stop (at once, whatever they are doing) without waiting for them to
        be gone; :meth:`shutdown` waits."""
        ...

    def shutdown(self) -> None:
        """Stop every worker (at once, whatever they are doing) and wait until they are gone."""
        ...


class Feed(Protocol):
    """Tasks that come while a run goes on (see the module docstring)."""

    def poll(self) -> list[Task]:
        """New tasks, numbered after every task given before; may raise to stop the run."""
        ...

    def open(self) -> bool:
        """Whether more tasks may still come."""
        ...

    def busy(self) -> bool:
        """Whether the feed has work under way that :meth:`poll` must see soon, though no task may come."""
        ...


@dataclasses.dataclass(frozen=True)
class Progress:
    """A snapshot for progress displays and callers' hooks."""

    total: int
    finished: int
    failed: int
    retried: int
    busy: int
    slots: int
    busy_by_device: dict[str, tuple[int, int]]  # device name -> (busy, live slots)


@dataclasses.dataclass
class ScheduleResult:
    slots: list[Slot]
    not_started: list[str]  # why workers did not start
    finished: dict[int, str] = dataclasses.field(default_factory=dict)  # task id -> slot that measured it
    failed: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # task id -> why each attempt failed
    reasons: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # task id -> failed attempts, also retried ones
    attempts: dict[int, int] = dataclasses.field(default_factory=dict)  # task id -> attempts started
    writes: dict[int, int] = dataclasses.field(default_factory=dict)  # task id -> cache writes of its rows
    superseded: dict[int, int] = dataclasses.field(default_factory=dict)  # task id -> the task that replaced it before it started or was tried again
    lost: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (slot id, reason) per lost worker
    retired: dict[str, str] = dataclasses.field(default_factory=dict)  # slot id -> why it was retired
    retried: int = 0
    interrupted: bool = False
    seconds: float = 0.0
    stopped_by: Exception | None = None  # what the feed raised (the run stopped early)
    first_task_at: float | None = None  # time.perf_counter() when the first task was given to a worker
    last_settled_at: float | None = None  # ... when the last task was settled
    busy: dict[str, float] = dataclasses.field(default_factory=dict)  # slot id -> seconds it held a task (any outcome)
    task_seconds: dict[int, float] = dataclasses.field(default_factory=dict)  # task id -> seconds its finishing attempt held a slot


class Scheduler:
    """Runs tasks on an executor's slots and writes finished rows into ``cache`` (module rules)."""

    def __init__(
        self,
        executor: Executor,
        cache: TuningCache,
        options: TuneOptions,
        retries: int = 2,
        task_timeout: float | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_settled: Callable[[Task, bool | None], None] | None = None,
    ) -> None:
        if retries < 0:
            raise ValueError("retries must be >= 0")
        if task_timeout is not None and task_timeout <= 0:
            raise ValueError("task_timeout must be > 0 seconds")
        self.executor = executor
        self.cache = cache
        self.options = options
        self.retries = retries
        self.task_timeout = task_timeout
        self.on_progress = on_progress
        # (task, finished): True when its rows are in the cache, False when it failed, None when it
        # was replaced before it started
        self.on_settled = on_settled

    def run(self, tasks: Sequence[Task], slots: Sequence[Slot], not_started: Sequence[str] = (), feed: Feed | None = None) -> ScheduleResult:
        """Run ``tasks`` (in this order of preference), and those ``feed`` gives meanwhile, on the
        executor's started ``slots`` until each finished or failed. Returns with the workers asked to
        stop (:meth:`Executor.stop`); the caller waits for them with :meth:`Executor.shutdown`."""
        started = time.perf_counter()
        try:
            run = _Run(self, tasks, slots, not_started, feed)
        except BaseException:
            self.executor.stop()
            raise
        try:
            run.loop()
        except KeyboardInterrupt:
            run.result.interrupted = True
        finally:
            self.executor.stop()
            run.flush(hooks=False)  # rows received before an interrupt are kept too
            run.result.seconds = time.perf_counter() - started
        return run.result


class _Run:
    """The state of one :meth:`Scheduler.run`."""

    def __init__(self, s: Scheduler, tasks: Sequence[Task], slots: Sequence[Slot], not_started: Sequence[str], feed: Feed | None) -> None:
        self.s = s
        self.feed = feed
        self.stopping: Exception | None = None  # the feed raised: finish the running tasks, then stop
        self.tasks: dict[int, Task] = {}
        self.result = ScheduleResult(slots=list(slots), not_started=list(not_started))
        self.slots: dict[str, Slot] = {slot.id: slot for slot in slots}  # live: ready or restarting
        self.restarting: set[str] = set()
        self.running: dict[str, tuple[Task, float]] = {}  # slot id -> (task, started at)
        self.losses: dict[str, int] = {}  # slot id -> workers lost in a row
        self.failed_on: dict[int, set[str]] = {}
        self.rank: dict[int, int] = {}  # the order tasks are taken in
        self.pending: dict[DeviceFingerprint, list[Task]] = {}
        self.replaced_by: dict[int, int] = {}  # task id -> the task that replaces it
        self.wrote: dict[int, set[tuple]] = {}  # task id -> the rows (key, algo, method) it wrote
        self.received: list[tuple[Task, str, list[Measurement]]] = []  # finished, rows not written yet
        self.add(tasks)

    def add(self, tasks: Sequence[Task]) -> None:
        for task in tasks:
            if task.id in self.tasks:
                raise ValueError("task ids must be unique")
            queue = self.pending.setdefault(task.device, [])
            for old in task.replaces:
                self.replaced_by[old] = task.id
                waiting = next((t for t in queue if t.id == old), None)
                if waiting is not None:  # not started: its problems are this task's
                    queue.remove(waiting)
                    self.result.superseded[old] = task.id
                    self.settled(waiting, None)
            self.tasks[task.id] = task
            self.rank[task.id] = len(self.rank)
            queue.append(task)

    # -- the loop ---------------------------------------------------------------------------------

    def loop(self) -> None:
        self.progress()
        while True:
            more = self.poll_feed()
            self.fail_orphans()
            self.assign()
            self.flush()  # after assign: a worker that finished gets its next task before the rows are written
            if self.stopping is not None and not self.running:
                self.result.stopped_by = self.stopping
                return
            if not self.running and not self.restarting:
                if not more:
                    return  # nothing pending can run (fail_orphans failed those without slots)
                self.idle()  # nothing to run until the feed gives more
                continue
            timeout = self.wait_timeout()
            if more or (self.feed is not None and self.stopping is None and self.feed.busy()):
                timeout = FEED_POLL_S if timeout is None else min(timeout, FEED_POLL_S)
            for event in self.s.executor.wait(timeout):
                self.handle(event)
            self.check_timeouts()

    def poll_feed(self) -> bool:
        """New tasks from the feed; whether more may come. What the feed raises stops the run gently."""
        if self.feed is None or self.stopping is not None:
            return False
        try:
            new = self.feed.poll()
        except Exception as e:  # noqa: BLE001  (the result's stopped_by, once the running tasks are settled)
            self.stopping = e
            for queue in self.pending.values():
                queue.clear()  # started no more; the running tasks finish
            return False
        if new:
            self.add(new)
            self.progress()
        return self.feed.open()

    def idle(self) -> None:
        """Wait up to FEED_POLL_S for the workers (a lost one, say); an executor with no live worker
        or nothing under way may return at once."""
        until = time.monotonic() + FEED_POLL_S
        events = self.s.executor.wait(FEED_POLL_S)
        for event in events:
            self.handle(event)
        if not events and time.monotonic() < until:
            time.sleep(until - time.monotonic())

    def wait_timeout(self) -> float | None:
        if self.s.task_timeout is None or not self.running:
            return None
        first = min(started for _, started in self.running.values())
        return max(0.0, first + self.s.task_timeout - time.monotonic())

    def progress(self) -> None:
        if self.s.on_progress is None:
            return
        by_device: dict[str, tuple[int, int]] = {}
        for slot in self.slots.values():
            busy, live = by_device.get(slot.device.name, (0, 0))
            by_device[slot.device.name] = (busy + (slot.id in self.running), live + 1)
        self.s.on_progress(
            Progress(
                total=len(self.tasks) - len(self.result.superseded),
                finished=len(self.result.finished),
                failed=len(self.result.failed),
                retried=self.result.retried,
                busy=len(self.running),
                slots=len(self.slots),
                busy_by_device=by_device,
            )
        )

    # -- assignment -------------------------------------------------------------------------------

    def live_slots(self, device: DeviceFingerprint) -> set[str]:
        return {sid for sid, slot in self.slots.items() if slot.device == device}

    def fail_orphans(self) -> None:
        for device, queue in self.pending.items():
            if queue and not self.live_slots(device):
                why = f"no live worker for {device} in the cluster"
                if self.result.retired:
                    why += f" (retired: {'; '.join(f'{k}: {v}' for k, v in self.result.retired.items())})"
                for task in queue:
                    self.result.failed[task.id] = self.result.reasons.setdefault(task.id, []) + [why]
                    self.settled(task, False)
                queue.clear()
                self.progress()

    def assign(self) -> None:
        for sid, slot in self.slots.items():
            if sid in self.running or sid in self.restarting:
                continue
            queue = self.pending.get(slot.device)
            if not queue:
                continue
            live = self.live_slots(slot.device)
            running = {t.id for t, _ in self.running.values()}
            for i, task in enumerate(queue):
                if running.intersection(task.replaces):
                    continue  # after the task it replaces: its rows must be the last written
                tried = self.failed_on.get(task.id, set())
                if sid not in tried or live <= tried:  # elsewhere while another slot of the type lives
                    del queue[i]
                    self.result.attempts[task.id] = self.result.attempts.get(task.id, 0) + 1
                    if self.result.first_task_at is None:
                        self.result.first_task_at = time.perf_counter()
                    self.running[sid] = (task, time.monotonic())
                    self.s.executor.submit(sid, task, self.s.options)
                    break
        self.progress()

    # -- outcomes ---------------------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        if isinstance(event, Ready):
            self.restarting.discard(event.slot.id)
            self.slots[event.slot.id] = event.slot
        elif isinstance(event, StartFailed):
            self.restarting.discard(event.slot_id)
            self.retire(event.slot_id, f"its worker did not start again: {event.reason}")
        elif isinstance(event, Finished):
            task, held = self.took_back(event.slot_id, event.task_id)
            shapes = task.shapes
            wrong = [m for m in event.rows if m.key.shape not in shapes]
            if wrong:
                self.retry(task, event.slot_id, f"worker returned rows of another problem ({wrong[0].key})")
            else:
                self.received.append((task, event.slot_id, event.rows))  # written by flush()
                self.result.task_seconds[task.id] = held
                self.losses[event.slot_id] = 0
        elif isinstance(event, Failed):
            self.retry(self.took_back(event.slot_id, event.task_id)[0], event.slot_id, event.reason)
        elif isinstance(event, Lost):
            self.lose(event.slot_id, event.reason)
        self.progress()

    def flush(self, hooks: bool = True) -> None:
        """Write the rows received (each task's in one transaction), and settle their tasks; with
        ``hooks=False`` (the run is over) nobody else hears of it."""
        while self.received:
            task, sid, rows = self.received[0]
            # measured again after earlier tasks of the geometry wrote: none of their rows stays beside these
            ids = {(m.key, m.algo, m.method) for m in rows}
            stale = set().union(*(self.wrote.get(old, ()) for old in task.replaces)) - ids
            self.s.cache.put(task.device, rows, forget=sorted(stale, key=str))
            self.wrote[task.id] = ids
            self.received.pop(0)
            self.result.writes[task.id] = self.result.writes.get(task.id, 0) + 1
            self.result.finished[task.id] = sid
            if hooks:
                self.settled(task, True)
                self.progress()
            else:
                self.result.last_settled_at = time.perf_counter()

    def settled(self, task: Task, finished: bool | None) -> None:
        self.result.last_settled_at = time.perf_counter()
        if self.s.on_settled is not None:
            self.s.on_settled(task, finished)

    def took_back(self, sid: str, task_id: int) -> tuple[Task, float]:
        """The task a slot reported on, and the seconds it held the slot."""
        running = self.running.pop(sid, None)
        if running is None or running[0].id != task_id:
            held = "nothing" if running is None else f"task {running[0].id}"
            raise RuntimeError(f"executor bug: slot {sid} reported task {task_id} while running {held}")
        return running[0], self.count_busy(sid, running[1])

    def count_busy(self, sid: str, started: float) -> float:
        held = time.monotonic() - started
        self.result.busy[sid] = self.result.busy.get(sid, 0.0) + held
        return held

    def lose(self, sid: str, reason: str) -> None:
        slot = self.slots.get(sid)
        where = f" ({slot.where})" if slot else ""
        self.result.lost.append((sid, reason))
        running = self.running.pop(sid, None)
        if running is not None:
            self.count_busy(sid, running[1])
            self.retry(running[0], sid, f"worker {sid}{where} lost: {reason}")
        self.losses[sid] = self.losses.get(sid, 0) + 1
        if self.losses[sid] >= SLOT_LOSSES:
            self.retire(sid, f"lost {SLOT_LOSSES} workers in a row, the last: {reason}")
        elif self.stopping is None:
            self.restarting.add(sid)
            self.s.executor.restart(sid)

    def retire(self, sid: str, why: str) -> None:
        self.slots.pop(sid, None)
        self.result.retired[sid] = why

    def retry(self, task: Task, sid: str, reason: str) -> None:
        reasons = self.result.reasons.setdefault(task.id, [])
        reasons.append(reason)
        self.failed_on.setdefault(task.id, set()).add(sid)
        if task.id in self.replaced_by:  # the task replacing it measures its problems
            self.result.superseded[task.id] = self.replaced_by[task.id]
            self.settled(task, None)
            return
        if self.result.attempts.get(task.id, 0) > self.s.retries:
            self.result.failed[task.id] = list(reasons)
            self.settled(task, False)
            return
        if self.stopping is not None:  # started no more: it stays unsettled (missing)
            return
        self.result.retried += 1
        queue = self.pending.setdefault(task.device, [])
        queue.append(task)
        queue.sort(key=lambda t: self.rank[t.id])

    def check_timeouts(self) -> None:
        if self.s.task_timeout is None:
            return
        now = time.monotonic()
        for sid, (task, started) in list(self.running.items()):
            if now - started > self.s.task_timeout:
                self.s.executor.kill(sid)
                self.lose(sid, f"task {task.id} ({task}) ran over --task-timeout {self.s.task_timeout:g} s")
        self.progress()

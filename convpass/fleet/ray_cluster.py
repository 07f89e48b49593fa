"""The Ray executor (``--cluster ray`` / ``ray://HOST:PORT``): one Ray actor per GPU of the cluster.

Ray is an optional dependency (``pip install 'convpass[fleet]'``); this module imports it and
nothing else in convpass does, so convpass without Ray works.

* **Workers.** For every alive node, one actor per GPU it offers, each holding one GPU
  (``num_gpus=1``) and pinned to its node (node affinity, not soft). An actor, not a Ray task per
  fleet task: Ray runs each GPU task in a new worker process by default, and a fresh process would
  pay CUDA start-up and cuDNN loading per task; the actor starts and warms its GPU once.
* **Device types.** Each actor reports the fingerprint of its GPU (name, compute capability, SM
  count, cuDNN version) when it starts; that fingerprint is the slot's device, and the scheduler
  gives a task only to slots of the device type it is tuned for. No custom resources need to be
  declared when the cluster is started, and nodes with different GPUs or cuDNN versions mix.
* **Faults.** An actor that dies (killed, out of memory, node lost) fails its pending call with a
  Ray error: reported as lost, and the scheduler retries the task elsewhere and asks for a new
  actor on that node. Actors have ``max_restarts=0``: the scheduler, not Ray, restarts and counts.
* **One writer.** Actors return rows to the driver; only the driver opens the tuning cache, so no
  SQLite file is shared between hosts. convpass must be installed on every node.

A Ray runtime already initialized in the driver process is used as it is and left running;
otherwise ``ray.init(address)`` connects (``address=None``: ``RAY_ADDRESS``, else the cluster last
started on this machine, else a new local Ray)
and :meth:`RayExecutor.shutdown` disconnects.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from convpass.core.errors import ConvpassError
from convpass.core.options import TuneOptions
from convpass.fleet.measurers import Measurer
from convpass.fleet.scheduler import FEED_POLL_S, Event, Failed, Finished, Lost, Ready, Slot, StartFailed, Task
from convpass.fleet.worker import WorkerCore, describe

START_TIMEOUT_S = 300.0


@ray.remote(max_restarts=0, max_task_retries=0)
class FleetWorker:
    """One worker: a measurer started once, then one task (a geometry's problems) per call."""

    def __init__(self, measurer: Measurer) -> None:
        self.core = WorkerCore(measurer)

    def start(self) -> tuple[Any, int, str]:
        return self.core.start(), os.getpid(), ray.util.get_node_ip_address()

    def measure(self, task_id: int, problems: Any, options: TuneOptions) -> tuple[str, tuple[Any, ...], bool]:
        return self.core.measure(task_id, problems, options)


class RayExecutor:
    """Ray actors as worker slots (see the module docstring)."""

    name = "ray"

    def __init__(self, address: str | None = None, workers: int | None = None) -> None:
        if workers is not None and workers < 1:
            raise ValueError("workers must be >= 1")
        self.address = address
        self.workers = workers
        self._connected_here = False
        self._measurer: Measurer | None = None
        self._actors: dict[str, Any] = {}
        self._placement: dict[str, str] = {}  # slot id -> node id, in launch order
        self._not_started: list[str] = []
        self._refs: dict[Any, tuple[str, str, float]] = {}  # ref -> (slot id, "start" | "measure", deadline)

    # -- Executor -----------------------------------------------------------------------------------

    def launch(self, measurer: Measurer) -> None:
        self._measurer = measurer
        if not ray.is_initialized():
            try:
                ray.init(address=self.address)
            except (ConnectionError, RuntimeError, ValueError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ConvpassError(f"--cluster {self.address or 'ray'}: cannot start or reach Ray: {first}") from None
            self._connected_here = True
        resource = "GPU" if measurer.needs_gpu else "CPU"
        placements = []
        for node in sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"]):
            for i in range(int(node.get("Resources", {}).get(resource, 0))):
                placements.append((f"{node['NodeID'][:8]}/{resource.lower()}{i}", node["NodeID"]))
        if self.workers is not None:
            placements = placements[: self.workers]
        if not placements:
            self._not_started.append(f"the Ray cluster offers no {resource}")
        for sid, node_id in placements:
            self._placement[sid] = node_id
            self._spawn(sid)

    def wait_started(self, poll: Callable[[], None] | None = None) -> tuple[list[Slot], list[str]]:
        slots: list[Slot] = []
        problems = self._not_started
        while any(kind == "start" for _, kind, _ in self._refs.values()):
            if poll is not None:
                poll()
            for event in self.wait(None if poll is None else FEED_POLL_S):
                if isinstance(event, Ready):
                    slots.append(event.slot)
                elif isinstance(event, StartFailed):
                    problems.append(f"worker {event.slot_id} did not start: {event.reason}")
        order = list(self._placement)
        return sorted(slots, key=lambda s: order.index(s.id)), problems

    def submit(self, slot_id: str, task: Task, options: TuneOptions) -> None:
        ref = self._actors[slot_id].measure.remote(task.id, task.problems, options)
        self._refs[ref] = (slot_id, "measure", float("inf"))

    def wait(self, timeout: float | None) -> list[Event]:
        if not self._refs:
            return []
        starts = [deadline for _, kind, deadline in self._refs.values() if kind == "start"]
        if starts:
            until = max(0.0, min(starts) - time.monotonic())
            timeout = until if timeout is None else min(timeout, until)
        refs = list(self._refs)
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:  # and whatever else is done already
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        events: list[Event] = []
        for ref in ready:
            sid, kind, _ = self._refs.pop(ref)
            events += self._outcome(ref, sid, kind)
        now = time.monotonic()
        for _ref, (sid, kind, deadline) in list(self._refs.items()):
            if kind == "start" and now > deadline:
                self.kill(sid)
                events.append(StartFailed(sid, f"not ready after {START_TIMEOUT_S:.0f} s"))
        return events

    def kill(self, slot_id: str) -> None:
        actor = self._actors.pop(slot_id, None)
        for ref, (sid, _, _) in list(self._refs.items()):
            if sid == slot_id:
                del self._refs[ref]
        if actor is not None:
            ray.kill(actor, no_restart=True)

    def restart(self, slot_id: str) -> None:
        self.kill(slot_id)
        self._spawn(slot_id)

    def stop(self) -> None:
        for sid in list(self._actors):
            self.kill(sid)  # ray.kill does not wait

    def shutdown(self) -> None:
        self.stop()
        if self._connected_here:
            ray.shutdown()
            self._connected_here = False

    # -- internals --------------------------------------------------------------------------------

    def _spawn(self, sid: str) -> None:
        assert self._measurer is not None
        gpu = self._measurer.needs_gpu
        actor = FleetWorker.options(
            num_gpus=1 if gpu else 0,
            num_cpus=0 if gpu else 1,  # a GPU worker must not wait for a CPU on a CPU-poor node
            scheduling_strategy=NodeAffinitySchedulingStrategy(self._placement[sid], soft=False),
        ).remote(self._measurer)
        self._actors[sid] = actor
        self._refs[actor.start.remote()] = (sid, "start", time.monotonic() + START_TIMEOUT_S)

    def _outcome(self, ref: Any, sid: str, kind: str) -> list[Event]:
        try:
            value = ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # raised past WorkerCore's handlers: start over
            cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
            self.kill(sid)
            return [StartFailed(sid, describe(cause))] if kind == "start" else [Lost(sid, f"worker raised {describe(cause)}")]
        except ray.exceptions.RayError as e:  # the actor, its process or its node is gone
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            reason = f"{type(e).__name__}: {first}".rstrip(": ")
            self._actors.pop(sid, None)
            return [StartFailed(sid, reason)] if kind == "start" else [Lost(sid, reason)]
        if kind == "start":
            device, pid, ip = value
            return [Ready(Slot(sid, device, f"node {ip}, pid {pid}"))]
        outcome, payload, fatal = value
        if outcome == "finished":
            task_id, rows, seconds = payload
            return [Finished(sid, task_id, rows, seconds)]
        events: list[Event] = [Failed(sid, *payload)]
        if fatal:  # as a local worker exits: the process may be unusable
            self.kill(sid)
            events.append(Lost(sid, f"worker stopped after {payload[1]}"))
        return events

"""The unit of a compiled plan: a :class:`Launch` runs one plan step, or a group of fused steps.

Lowering (:mod:`convpass.runtime.cuda.lowering`) turns every step of a :class:`~convpass.kernels.plan.Plan` into a
launch or marks it absorbed by one; the memory planner (:mod:`convpass.runtime.cuda.memory`) may give a launch a
:class:`Placement` (write your output into this slice of that buffer); the runner (:mod:`convpass.runtime.cuda.runner`)
calls :meth:`Launch.run` on every launch in order, eagerly or while capturing a CUDA graph.

A launch reads and writes the runner's environment: a list with one entry per plan slot. It must
not upload, copy to the host, synchronize or compile anything in ``run``: everything of that kind
happens in its constructor or in :meth:`Launch.prepare`, which the backend calls once when the plan
is compiled. That is what lets the whole plan be captured as one CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from convpass.ops.registry import NodeInfo

__all__ = ["Launch", "Placement"]


class Placement:
    """Where a launch writes its output: a slice of a shared buffer along ``axis``.

    The buffer lives in the environment at ``slot`` (the Concat's output); the first launch that
    needs it allocates it with ``allocate(layout)`` (``layout``: the memory format that launch
    would have written, "nchw" or "nhwc", so the buffer takes the format of its first producer);
    every member then sees ``buffer[..., offset:offset + length, ...]``.
    """

    def __init__(self, slot: int, axis: int, offset: int, length: int, allocate: Callable[[str], Any]) -> None:
        self.slot = slot
        self.axis = axis
        self.offset = offset
        self.length = length
        self.allocate = allocate

    def buffer(self, env: list[Any], layout: str = "nchw") -> Any:
        buf = env[self.slot]
        if buf is None:
            buf = env[self.slot] = self.allocate(layout)
        return buf

    def view(self, env: list[Any], layout: str = "nchw") -> Any:
        index = (slice(None),) * self.axis + (slice(self.offset, self.offset + self.length),)
        return self.buffer(env, layout)[index]

    def __repr__(self) -> str:
        return f"Placement(slot={self.slot}, axis={self.axis}, [{self.offset}:{self.offset + self.length}])"


class Launch:
    """One unit of a compiled plan (see the module docstring).

    ``step``: the plan step it runs at (a fused group's last step); ``node``: that step's node
    (errors and capture reports name it); ``label``: what profiles call it; ``outputs``: the slots
    it writes; ``absorbs``: other steps it computes (they are skipped). ``supports_placement``:
    whether :meth:`run` honours :attr:`placement` for ``outputs[0]``.
    """

    supports_placement = False

    def __init__(self, step: int, node: NodeInfo, label: str, outputs: Sequence[int], absorbs: Sequence[int] = ()) -> None:
        self.step = step
        self.node = node
        self.label = label
        self.outputs = tuple(outputs)
        self.absorbs = tuple(absorbs)
        self.placement: Placement | None = None

    def prepare(self) -> None:
        """Compile-time work (build kernels, upload tables); called once, never during capture."""

    def run(self, env: list[Any]) -> None:
        raise NotImplementedError

    def destination(self, env: list[Any], layout: str = "nchw") -> Any | None:
        """The array ``outputs[0]`` must be written into, or None to allocate a new one; ``layout``:
        the memory format this launch would allocate (it decides a buffer's format when the buffer
        does not exist yet)."""
        return None if self.placement is None else self.placement.view(env, layout)

    def describe(self) -> str:
        where = f" -> {self.placement}" if self.placement is not None else ""
        return f"{self.label} [{self.node.name}]{where}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

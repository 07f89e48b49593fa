"""A plan seen as :class:`convpass.core.fusion.StepGraph`: what the runtime's lowering
(:func:`convpass.kernels.convolution.lower_convs`) asks the absorption rule
(:func:`convpass.core.fusion.absorbed`) over, as the compiler asks it over the onnx-ir graph."""

from __future__ import annotations

from typing import Any

from convpass.ops.conv import ConvCall

__all__ = ["PlanSteps"]


class PlanSteps:
    """A plan as :class:`convpass.core.fusion.StepGraph`: nodes are step indices, values slots.
    A step is free when it comes after the conv and no earlier conv's launch took it."""

    def __init__(self, plan: Any, taken: set[int]) -> None:
        self.plan, self.steps, self.taken = plan, plan.steps, taken
        self._readers = plan.readers()
        self._outputs = set(plan.output_slots)
        self._producer = plan.producers()
        self.conv = -1

    def op(self, k: int) -> str:
        node = self.steps[k].node
        if isinstance(node.prepared, ConvCall):  # a tuned conv keeps convpass's domain in the plan
            return node.prepared.geometry.op_type
        return node.op_type if node.domain == "" else ""

    def inputs(self, k: int) -> tuple[int | None, ...]:
        return tuple(None if s < 0 else s for s in self.steps[k].inputs)

    def outputs(self, k: int) -> tuple[int, ...]:
        outs = self.steps[k].outputs
        return tuple(outs) if outs and outs[0] >= 0 else ()

    def readers(self, slot: int) -> list[int]:
        return self._readers.get(slot, [])

    def is_output(self, slot: int) -> bool:
        return slot in self._outputs

    def is_constant(self, slot: int) -> bool:
        return slot >= 0 and self.plan.template[slot] is not None

    def same_shape_and_type(self, a: int, b: int) -> bool:
        info = self.plan.value_info
        return info.get(b) is not None and info.get(a) == info.get(b)

    def ready_before(self, slot: int, k: int) -> bool:
        return slot >= 0 and self._producer.get(slot, -1) < k

    def free(self, k: int) -> bool:
        return k > self.conv and k not in self.taken

    def attribute(self, k: int, name: str, default: Any) -> Any:
        return self.steps[k].node.attr(name, default)

"""One layout conversion for the convs that read one tensor in a memory format it is not stored in.

A conv launch converts its input to its own memory format when the input arrives in the other
one (:meth:`convpass.kernels.convolution.Convolutions.run`, counted in ``layout_copies``): a copy
inside its launch that the tuner never timed (it times each conv on a packed input in the conv's
format). Where several convs read one tensor in the same format (an attention block's q, k and v
1x1 convs reading its GroupNorm's output), each would make that copy: the layout plan
(:mod:`convpass.compiler.passes.plan_layouts`) charges one transpose for such a tensor where it
places it before the fused normalization, and the executor, which runs the normalization in the
storage its input arrives in, made one copy per reader.

Rules (:func:`share_conversions`, on a compiled plan's launches once they are prepared):

1. The readers are the Conv launches (not ConvTranspose, not 1-D convs mapped to 2-D, not convs
   whose extra pads give them a padded copy of their own) whose resolved execution has a memory
   format, reading the tensor as their data input ``x``.
2. A tensor that at least two such readers want in one format gets one conversion launch
   (:class:`LayoutLaunch`) just before the first of them, into a slot of its own; those readers
   read that slot, and it is released after the last of them. The conversion is
   :func:`convpass.native.cudnn.as_layout`: nothing when the tensor already is in that format or
   is a channel slice stored in that order (a Split's output, a Concat member's view:
   :func:`convpass.native.cudnn.channel_slice`, which its readers may read in place; the launch
   then only names it), else one copy, counted in ``layout_conversions``.
3. A tensor written into a Concat slice (its producer has a placement) is left to its readers:
   a conv may read its slice in place (:mod:`convpass.kernels.conv_slices`).

The converted tensor is the same logical (channels-first) tensor: a reader whose execution changes
at run time (a recorded algorithm refused, a fallback in another format) still reads the right
values, converting again as it would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from convpass.kernels.convolution import ConvLaunch
from convpass.kernels.launch import Launch
from convpass.native import cudnn
from convpass.ops.registry import NodeInfo

__all__ = ["LayoutLaunch", "conv_reader", "share_conversions"]

COUNTER = "layout_conversions"


class LayoutLaunch(Launch):
    """The tensor at slot ``source`` in ``layout``, written to slot ``target`` (module rule 2)."""

    def __init__(self, step: int, node: NodeInfo, source: int, target: int, layout: str, counters: Any) -> None:
        super().__init__(step, node, f"layout to {layout} (shared by its convs)", (target,))
        self.inputs = (source,)
        self.layout = layout
        self.counters = counters

    def run(self, env: list[Any]) -> None:
        x = env[self.inputs[0]]
        y = x if cudnn.channel_slice(x, self.layout) else cudnn.as_layout(x, self.layout)  # a slice in order: read in place
        if y is not x:
            self.counters[COUNTER] += 1
        env[self.outputs[0]] = y


def conv_reader(launch: Launch | None) -> tuple[int, str] | None:
    """``(x slot, memory format)`` of a launch that reads its input in its own format (module
    rule 1), else None."""
    if not isinstance(launch, ConvLaunch) or not launch.inputs or launch.inputs[0] < 0:
        return None
    ex = launch.exec
    layout = getattr(ex, "layout", None) if ex is not None and getattr(ex, "op_type", "") == "Conv" else None
    if layout not in ("nchw", "nhwc") or ex.insert_axis is not None or any(ex.geometry.extra_pads):
        return None
    return launch.inputs[0], layout


def share_conversions(plan: Any, launches: Sequence[Launch | None], free: Sequence[tuple[int, ...]],
                      counters: Any) -> tuple[list[Launch | None], list[tuple[int, ...]]]:
    """``launches`` and ``free`` (aligned, per position) with a :class:`LayoutLaunch` before the
    first reader of each tensor that several convs read in one format (module rules); those readers
    are rewired to its slot. New slots are added to ``plan``."""
    placed = {s for launch in launches if launch is not None and launch.placement is not None for s in launch.outputs[:1]}
    groups: dict[tuple[int, str], list[int]] = {}
    for i, launch in enumerate(launches):
        read = conv_reader(launch)
        if read is not None and read[0] not in placed and plan.template[read[0]] is None:
            groups.setdefault(read, []).append(i)
    before: dict[int, list[LayoutLaunch]] = {}
    extra_free: dict[int, list[int]] = {}
    for (source, layout), readers in groups.items():
        if len(readers) < 2:
            continue
        target = _new_slot(plan, source, layout)
        first = launches[readers[0]]
        name = f"{plan.slot_names[source]} to {layout}"
        node = NodeInfo(name, "Transpose", "ai.convpass", 1, {}, [plan.slot_names[source]], [name])
        before.setdefault(readers[0], []).append(LayoutLaunch(first.step, node, source, target, layout, counters))
        for i in readers:
            reader = launches[i]
            reader.inputs = (target, *reader.inputs[1:])
        extra_free.setdefault(readers[-1], []).append(target)
    if not before:
        return list(launches), list(free)
    out_launches: list[Launch | None] = []
    out_free: list[tuple[int, ...]] = []
    for i, launch in enumerate(launches):
        for conversion in before.get(i, ()):
            out_launches.append(conversion)
            out_free.append(())
        out_launches.append(launch)
        out_free.append((*free[i], *extra_free.get(i, ())))
    return out_launches, out_free


def _new_slot(plan: Any, source: int, layout: str) -> int:
    """A slot for ``source``'s value in ``layout``: its name, no constant, the same shape and dtype."""
    plan.slot_names.append(f"{plan.slot_names[source]}@{layout}")
    plan.template.append(None)
    target = len(plan.template) - 1
    if source in plan.value_info:
        plan.value_info[target] = plan.value_info[source]
    return target

"""Memory planning of the cuda backend's compiled plans: Concat without copies.

ONNX's Concat copies every input into a new tensor. Networks built on concatenation pay that
again and again: a DenseNet block concatenates *all* earlier features before every layer (the
copied volume grows with the square of the block's depth), Inception modules concatenate their
branches, a UNet its skip connections. :func:`plan_concats` arranges the plan so that producers
write their results straight into the slice of the buffer they end up in.

Rules:

* Concats are grouped into families, and the inputs a producer may write in place are found, by
  the rule :mod:`convpass.core.concat_slices` states (the compiler asks it too, to tune the convs
  that read such slices): each Concat belongs to the largest Concat that contains it, its *root*.
* A root's output slot holds the family's buffer. It is allocated by the first launch that
  writes into it (a placed producer, or a Concat of the family), in the memory format that
  launch would have produced, from the same pool as every other intermediate, so the CUDA-graph
  capture sees the same allocation sequence as the warm-up run.
* A Concat inside a root is a view of the root's buffer at its offset: it copies nothing that
  is already there.
* An input ``v`` of a root is *placed* — its producer writes into the root's slice — by rules 2
  and 3 of :mod:`convpass.core.concat_slices` (``v`` appears once among the root's inputs and in
  no other family, is neither a graph input, a constant nor a graph output; a zero-width Pad
  passes its input's slice on), this planner's writer of a value being a launch that can write
  into a given array (:attr:`~convpass.kernels.launch.Launch.supports_placement`; a conv's step by
  rule 4 there), computes only that value, and has no placement yet. A Concat that is itself an
  input of another family (Inception's inner ``cat``) can be placed that way; its own inputs are
  then copied.
* A Pad whose widths are all zero (a plan constant: UNet's Pad of the upsampled map to the skip's
  size, its widths folded from ``Shape`` arithmetic) is its input itself: the op library returns
  that array, not a copy; the placement of its output goes to its input's producer (rule 3).
* Every other input is copied once, by the first Concat of its family (in plan order) that
  contains it.

Nothing else changes: values keep their slots, readers read the slices as the strided views
they are (every kernel of this backend takes strided inputs; cuDNN's legacy convolutions read a
channel slice in their own memory order through its strides, and convert an input they cannot
read to their format, as for any other producer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from convpass.core import concat_slices
from convpass.core.concat_slices import ConcatFamily, ConcatInfo
from convpass.kernels.launch import Launch, Placement
from convpass.kernels.tensor_ops import ConcatLaunch

__all__ = ["ConcatFamily", "concat_infos", "families", "plan_concats"]


def _concat_info(plan: Any, index: int) -> tuple[int, list[int], list[int]] | None:
    """(axis, input slots, their lengths along the axis) of a Concat step, or None when it is not
    one this planner handles (absent inputs, unknown shapes)."""
    st = plan.steps[index]
    node = st.node
    if node.op_type != "Concat" or node.domain != "" or st.outputs[0] < 0 or not st.inputs or any(s < 0 for s in st.inputs):
        return None
    out = plan.info(st.outputs[0])
    if out is None or not out[0]:
        return None
    rank = len(out[0])
    axis = int(node.attr("axis", 1))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        return None
    lengths = []
    for s in st.inputs:
        info = plan.info(s)
        if info is None or len(info[0]) != rank or np.dtype(info[1]) != np.dtype(out[1]):
            return None
        lengths.append(int(info[0][axis]))
    return axis, list(st.inputs), lengths


def concat_infos(plan: Any) -> dict[int, ConcatInfo]:
    """step -> :class:`~convpass.core.concat_slices.ConcatInfo` of every Concat this planner handles."""
    out = {}
    for i, st in enumerate(plan.steps):
        info = _concat_info(plan, i) if st.node.op_type == "Concat" else None
        if info is not None:
            out[i] = ConcatInfo(info[0], tuple(info[1]), tuple(info[2]))
    return out


def families(plan: Any) -> list[ConcatFamily]:
    """The Concat families of ``plan`` (:func:`convpass.core.concat_slices.families`)."""
    return concat_slices.families(concat_infos(plan))


def _zero_pad_input(plan: Any, index: int, to_host: Callable[[Any], Any]) -> int | None:
    """The data input of step ``index`` when it is a Pad whose widths are all zero (a constant of the
    plan, or the attribute before opset 11), else None."""
    st = plan.steps[index]
    node = st.node
    if node.op_type != "Pad" or node.domain != "" or not st.inputs or st.inputs[0] < 0 or st.outputs[0] < 0:
        return None
    if node.opset >= 11:
        pads = plan.template[st.inputs[1]] if len(st.inputs) > 1 and st.inputs[1] >= 0 else None
        pads = None if pads is None else np.asarray(to_host(pads))
    else:
        pads = node.attr("pads", node.attr("paddings"))
    if pads is None or np.any(np.asarray(pads) != 0):
        return None
    return st.inputs[0]


def plan_concats(plan: Any, launches: Mapping[int, Launch], allocator: Callable[[tuple[int, ...], Any], Callable[[str], Any]],
                 to_host: Callable[[Any], Any] = np.asarray) -> dict[int, ConcatLaunch]:
    """Place Concat inputs and build the Concat launches (module rules).

    ``launches``: step -> the launch that computes the step's outputs (fused members map to their
    group's launch); placements are set on them here. ``allocator(shape, dtype)`` gives the
    function that allocates a family's buffer in a memory format; ``to_host``: a plan constant as
    a NumPy array (a Pad's widths). Returns step -> ConcatLaunch for every Concat the planner took;
    others stay with the op library.
    """
    infos = concat_infos(plan)
    fams = concat_slices.families(infos)
    graph_outputs = set(plan.output_slots)
    feeds = set(plan.feed_slots.values())
    producers = plan.producers()
    readers = plan.readers()
    seen_in = concat_slices.times_in_families(infos, fams)  # input slot -> number of families that read it
    result: dict[int, ConcatLaunch] = {}
    lookup: dict[int, Launch] = dict(launches)  # + the Concat launches made so far
    family_of: dict[int, ConcatFamily] = {}
    for fam in fams:
        axis, ins, lengths = _concat_info(plan, fam.root)
        root_slot = plan.steps[fam.root].outputs[0]
        shape, dtype = plan.info(root_slot)
        allocate = allocator(tuple(shape), dtype)
        offsets = [sum(lengths[:k]) for k in range(len(ins))]
        placed: set[tuple[int, int]] = set()  # (slot, offset in the root's buffer)

        def writer(s: int, fam: ConcatFamily = fam) -> Launch | None:
            p = producers.get(s)
            launch = lookup.get(p) if p is not None else None
            if not _placeable(launch, s):
                return None
            if isinstance(launch, ConcatLaunch) and (launch.step in fam.members or family_of[launch.step].placed):
                return None  # a view of this buffer already, or its own inputs write into its own buffer
            return launch

        def pad_input(s: int) -> int | None:
            p = producers.get(s)
            u = _zero_pad_input(plan, p, to_host) if p is not None else None
            return u if u is not None and readers.get(u) == [p] else None

        aliasable = lambda v: _aliasable(plan, v, graph_outputs, feeds)  # noqa: E731
        for p in concat_slices.place(fam, infos, seen_in, aliasable, writer, pad_input):
            p.writer.placement = Placement(root_slot, axis, offsets[p.k], lengths[p.k], allocate)
            placed.add((p.value, offsets[p.k]))
            fam.placed.append(p.value)
        copied = set(placed)  # (slot, offset) already in the buffer
        for step in sorted(fam.members):
            base = fam.members[step]
            _, step_ins, step_lengths = _concat_info(plan, step)
            copies = []
            for k, s in enumerate(step_ins):
                at = base + sum(step_lengths[:k])
                if (s, at) in copied:
                    continue
                copies.append((s, at, step_lengths[k]))
                copied.add((s, at))
            # offsets above are relative to the root; a view Concat writes through the root's buffer
            own = Placement(root_slot, axis, 0, int(shape[axis]), allocate)
            launch = ConcatLaunch(plan, step, axis, copies, own)
            if step != fam.root:
                launch.placement = Placement(root_slot, axis, base, sum(step_lengths), allocate)
                launch.copies = [(s, off - base, n) for s, off, n in copies]
            result[step] = lookup[step] = launch
            family_of[step] = fam
    return result


def _aliasable(plan: Any, s: int, graph_outputs: set[int], feeds: set[int]) -> bool:
    """Whether value ``s`` may live in a slice of a shared buffer: no graph output, feed or constant."""
    return s not in graph_outputs and s not in feeds and plan.template[s] is None


def _placeable(launch: Launch | None, s: int) -> bool:
    """Whether ``launch`` can be told to write ``s`` into a slice: it honours placements, computes
    only ``s`` and has no placement yet."""
    return launch is not None and launch.supports_placement and launch.placement is None and launch.outputs == (s,)

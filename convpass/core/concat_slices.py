"""Which values live in a channel slice of a shared buffer, and which steps write them there:
Concat families, their placed inputs, a Split's outputs. One rule, asked by the runtime's memory
planner (which places them: :mod:`convpass.runtime.cuda.memory`, over its plan's steps, slots and
launches) and by the compiler (which tunes the convs that read and write such slices:
:mod:`convpass.compiler.passes.collect_conv_problems`, over the onnx-ir graph), each giving it its
graph as plain data: node -> :class:`ConcatInfo`, and its steps through callbacks.

Rules:

1. **Families.** A Concat is *inside* another when its inputs are a contiguous run of the other's
   inputs, on the same axis; each Concat belongs to the largest Concat that contains it
   (transitively; ties: the later one): its *root*, whose output holds the family's buffer. A
   member is a view of that buffer at the offset of its first input (:func:`families`).
2. **Placement candidates.** An input ``v`` of a root may be written by its producer straight into
   its slice when ``v`` appears once among the root's inputs, in no other family, and may live in a
   shared buffer (``aliasable``: no graph input, output or constant) (:func:`placement_candidates`).
3. **Placements** (:func:`place`). A candidate ``v`` is placed when ``writer(v)`` names the step
   that computes it and writes into a given array (the caller's to say: the runtime, a launch that
   honours placements, computes only ``v`` and has none yet; the compiler, a conv's step by rule 4
   and any other one-output node but a Pad). A zero-width Pad passes a slice on: where ``v`` has no
   writer and ``pad_input(v)`` names ``u`` (``v`` is a Pad of zero widths over ``u``, that Pad
   ``u``'s only reader), ``u`` is placed in ``v``'s stead, written by ``writer(u)``, when ``u`` is
   in no family and aliasable; the Pad's output is then ``u``'s array itself.
4. **A conv's step writes into a given array** (:func:`conv_step_writes_slice`) when it is a
   Conv or ConvTranspose whose epilogue (:mod:`convpass.core.fusion` names) is none, ``bias``,
   ``relu`` or ``bias+relu``, or a forward Conv whose epilogue is a graph-API activation alone
   (``bias+leakyrelu<alpha>``, ``bias+swish``: an engine's plan writes the slice with its strides,
   :mod:`convpass.kernels.conv_slices`); a residual Add (legacy or fused) writes a packed output.
   A forward Conv so placed writes its output into its channel slice (:func:`output_slices`).
5. **Channel slices** (:func:`channel_slices`), of a family on axis 1 whose root has ``T`` channels:
   a member Concat that is not the root reads as channels ``[offset, offset + length)`` of ``T``;
   so does a placed value (rule 3) at its offset. A Split on axis 1 of a value that is no slice
   itself gives its outputs as slices of its input (the op library returns views). The root
   itself, a value as wide as its root's buffer, and every other value, is packed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from convpass.core.fusion import adds_residual, is_graph_fusion, legacy_name
from convpass.core.problem import InputSlice, OutputSlice

__all__ = ["ConcatFamily", "ConcatInfo", "Placed", "SplitInfo", "channel_slices", "conv_step_writes_slice", "families", "output_slices",
           "place", "placement_candidates", "times_in_families"]

# rule 4: the epilogues a conv's step runs while writing into a given array
_WRITES_SLICE = frozenset({"", "relu", legacy_name(False, False), legacy_name(False, True)})


@dataclasses.dataclass(frozen=True)
class ConcatInfo:
    """A Concat the rule handles: its axis (non-negative), input values and their lengths along it."""

    axis: int
    inputs: tuple[Any, ...]
    lengths: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    """A Split: its axis (non-negative), input value, output values and their lengths along it."""

    axis: int
    input: Any
    outputs: tuple[Any, ...]
    lengths: tuple[int, ...]


@dataclasses.dataclass
class ConcatFamily:
    """A root Concat and the Concats inside it (as ``node -> offset`` into the root's buffer)."""

    root: Any
    axis: int
    members: dict[Any, int]  # concat node -> offset of its first input in the root's buffer
    placed: list[Any] = dataclasses.field(default_factory=list)  # values written in place (the runtime's record)


def _run_at(inner: Sequence[Any], outer: Sequence[Any]) -> int | None:
    """Where ``inner`` occurs as a contiguous run of ``outer`` (first occurrence), or None."""
    n = len(inner)
    for k in range(len(outer) - n + 1):
        if list(outer[k : k + n]) == list(inner):
            return k
    return None


def families(infos: Mapping[Any, ConcatInfo]) -> list[ConcatFamily]:
    """The Concat families of the Concats ``infos`` describes (rule 1), in the order of their roots
    in ``infos`` (the caller's node order)."""
    order = {node: i for i, node in enumerate(infos)}
    parent: dict[Any, tuple[Any, int]] = {}  # node -> (containing node, index of its first input there)
    for i, info in infos.items():
        best: tuple[Any, int] | None = None
        for j, other in infos.items():
            if j == i or other.axis != info.axis or len(other.inputs) <= len(info.inputs):
                continue
            at = _run_at(info.inputs, other.inputs)
            if at is None:
                continue
            if best is None:
                best = (j, at)
                continue
            size, best_size = len(other.inputs), len(infos[best[0]].inputs)
            if size > best_size or (size == best_size and order[j] > order[best[0]]):
                best = (j, at)
        if best is not None:
            parent[i] = best
    result: dict[Any, ConcatFamily] = {}
    for i in infos:
        node, offset_inputs = i, 0
        while node in parent:
            up, at = parent[node]
            offset_inputs += at
            node = up
        fam = result.setdefault(node, ConcatFamily(node, infos[node].axis, {}))
        fam.members[i] = sum(infos[node].lengths[:offset_inputs])
    return sorted(result.values(), key=lambda f: order[f.root])


def times_in_families(infos: Mapping[Any, ConcatInfo], fams: Iterable[ConcatFamily]) -> dict[Any, int]:
    """value -> the number of families whose root reads it."""
    seen: dict[Any, int] = {}
    for fam in fams:
        for v in set(infos[fam.root].inputs):
            seen[v] = seen.get(v, 0) + 1
    return seen


def placement_candidates(fam: ConcatFamily, infos: Mapping[Any, ConcatInfo], seen_in: Mapping[Any, int],
                         aliasable: Callable[[Any], bool]) -> list[tuple[int, Any, int]]:
    """``(k, v, offset)`` of each input ``v`` (the root's ``k``-th, at ``offset`` in its buffer)
    that rule 2 lets its producer write in place."""
    root = infos[fam.root]
    out = []
    for k, v in enumerate(root.inputs):
        if root.inputs.count(v) == 1 and seen_in.get(v, 0) == 1 and aliasable(v):
            out.append((k, v, sum(root.lengths[:k])))
    return out


@dataclasses.dataclass(frozen=True)
class Placed:
    """A placement (rule 3): the root's ``k``-th input ``value``, at ``offset`` in its buffer of
    ``total`` along the family's axis, ``length`` long, computed into its slice by ``writer`` (the
    caller's object) as ``written`` (``value``, or the input of the zero-width Pad giving it)."""

    k: int
    value: Any
    offset: int
    length: int
    total: int
    writer: Any
    written: Any


def conv_step_writes_slice(op_type: str, epilogue: str) -> bool:
    """Rule 4: whether the step of a conv (``op_type``) running ``epilogue`` after it writes its
    output into a given array (a Concat's slice)."""
    if is_graph_fusion(epilogue):
        return op_type == "Conv" and not adds_residual(epilogue)
    return op_type in ("Conv", "ConvTranspose") and epilogue in _WRITES_SLICE


def place(fam: ConcatFamily, infos: Mapping[Any, ConcatInfo], seen_in: Mapping[Any, int], aliasable: Callable[[Any], bool],
          writer: Callable[[Any], Any], pad_input: Callable[[Any], Any] = lambda v: None) -> list[Placed]:
    """The placements of one family (rule 3): ``writer(v)``, the step that writes ``v`` into a
    given array or None; ``pad_input(v)``, the input ``u`` of the zero-width Pad that computes
    ``v`` and is ``u``'s only reader, or None."""
    total = sum(infos[fam.root].lengths)
    out = []
    for k, v, offset in placement_candidates(fam, infos, seen_in, aliasable):
        written, step = v, writer(v)
        if step is None:
            u = pad_input(v)
            if u is None or u in seen_in or not aliasable(u):
                continue
            written, step = u, writer(u)
            if step is None:
                continue
        out.append(Placed(k, v, offset, infos[fam.root].lengths[k], total, step, written))
    return out


def _placements(infos: Mapping[Any, ConcatInfo], aliasable: Callable[[Any], bool], writer: Callable[[Any], Any],
                pad_input: Callable[[Any], Any]) -> list[tuple[ConcatFamily, list[Placed]]]:
    fams = families(infos)
    seen_in = times_in_families(infos, fams)
    return [(fam, place(fam, infos, seen_in, aliasable, writer, pad_input)) for fam in fams]


def output_slices(infos: Mapping[Any, ConcatInfo], aliasable: Callable[[Any], bool], writer: Callable[[Any], Any],
                  pad_input: Callable[[Any], Any] = lambda v: None) -> dict[Any, OutputSlice]:
    """writer -> the :class:`~convpass.core.problem.OutputSlice` its output is written into (rules
    3 and 4: a channel family's placement narrower than its buffer), over every family."""
    out: dict[Any, OutputSlice] = {}
    for fam, placed in _placements(infos, aliasable, writer, pad_input):
        if fam.axis == 1:
            out.update((p.writer, OutputSlice(p.offset, p.total)) for p in placed if p.length < p.total)
    return out


def channel_slices(infos: Mapping[Any, ConcatInfo], outputs: Mapping[Any, Any], aliasable: Callable[[Any], bool],
                   writer: Callable[[Any], Any], splits: Iterable[SplitInfo] = (),
                   pad_input: Callable[[Any], Any] = lambda v: None) -> dict[Any, InputSlice]:
    """value -> the :class:`~convpass.core.problem.InputSlice` it is read as (rule 5).
    ``outputs``: Concat node -> its output value; ``writer`` and ``pad_input``: as :func:`place`."""
    slices: dict[Any, InputSlice] = {}
    for fam, placed in _placements(infos, aliasable, writer, pad_input):
        root = infos[fam.root]
        if fam.axis != 1:
            continue
        total = sum(root.lengths)
        for node, offset in fam.members.items():
            if node != fam.root and sum(infos[node].lengths) < total:
                slices[outputs[node]] = InputSlice(offset, total)
        for p in placed:
            if p.length < total:
                slices[p.value] = slices[p.written] = InputSlice(p.offset, total)
    for split in splits:
        total = sum(split.lengths)
        if split.axis != 1 or split.input in slices or len(split.outputs) < 2:
            continue
        for k, v in enumerate(split.outputs):
            if split.lengths[k] < total:
                slices[v] = InputSlice(sum(split.lengths[:k]), total)
    return slices

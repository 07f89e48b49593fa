"""Running element-wise work in a compiled plan: a fused group's launch, and any element-wise
computation on the storage its operands have.

:class:`FusedLaunch` runs a group (:mod:`convpass.kernels.elementwise`) with its broadcasting
kernel (:mod:`convpass.kernels.broadcast`), or with CuPy's kernel for the shapes that one does not
take.

Memory order: a group with a full-rank input stored channels-last runs on the channels-last storage
(:func:`in_storage_order`), so its output stays channels-last. A channel slice of a channels-last
Concat buffer counts as channels-last (:func:`~convpass.core.layout.storage_order`): the
BatchNormalization + Relu of a dense layer reads such a slice, and the layout plan, which passes
the buffer's format through it, puts the conv after it in NHWC; a channels-first result there
would be copied again inside that conv's launch. A group can also write straight into a slice of
a Concat buffer (:attr:`FusedLaunch.supports_placement`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from convpass.core.layout import storage_order
from convpass.kernels.broadcast import BroadcastKernel
from convpass.kernels.elementwise import FusedGroup
from convpass.kernels.launch import Launch

__all__ = ["FusedLaunch", "in_storage_order"]


def in_storage_order(args: Sequence[Any], fn: Callable[..., Any], value_inputs: Sequence[int] = (), out: Any = None) -> Any:
    """``fn(*args)`` (or ``fn(*args, out)``), an element-wise computation, on the channels-last storage
    when a full-rank input has it (packed, or a channel slice of a channels-last buffer): element-wise
    kernels over a channels-last array seen channels-first would read and write with a stride of C
    elements, and CuPy would allocate the result channels-first. Inputs listed in ``value_inputs``
    (read as values, e.g. Clip's bounds) and 0-d ones are passed as they are."""
    r = max((a.ndim for a in args if a is not None), default=0)
    if not 3 <= r <= 5 or not any(a is not None and a.ndim == r and storage_order(a) is not None for a in args):
        return fn(*args) if out is None else fn(*args, out)
    perm = (0, *range(2, r), 1)
    inv = (0, r - 1, *range(1, r - 1))
    moved = []
    for i, a in enumerate(args):
        if a is None or a.ndim == 0 or i in value_inputs:
            moved.append(a)
        else:
            full = a if a.ndim == r else a.reshape((1,) * (r - a.ndim) + tuple(a.shape))
            moved.append(full.transpose(perm))
    outs = fn(*moved) if out is None else fn(*moved, out.transpose(perm))
    if isinstance(outs, (tuple, list)):
        return [o.transpose(inv) if o is not None and o.ndim == r else o for o in outs]
    return outs.transpose(inv) if outs.ndim == r else outs


class FusedLaunch(Launch):
    """One fused group: its broadcasting kernel over the group's external inputs (CuPy's
    ``fallback`` kernel, when given, for shapes that kernel does not take)."""

    supports_placement = True

    def __init__(self, plan: Any, group: FusedGroup, broadcast: BroadcastKernel | None, fallback: Any, counters: dict[str, int]) -> None:
        node = plan.steps[group.root].node
        super().__init__(group.root, node, "fused " + "+".join(group.ops), (group.output,), absorbs=group.members[:-1])
        if broadcast is None and fallback is None:
            raise ValueError("a fused group needs a kernel")
        self.group = group
        self.broadcast = broadcast
        self.fallback = fallback
        self.counters = counters
        # constant inputs viewed once, here; computed ones at run time. Packed (C order), as
        # broadcast_classes assumes: constants read as one shape then have one set of strides.
        self._fixed = [None if plan.template[s] is None else _packed(_as_view(plan.template[s], group.view_of(k)))
                       for k, s in enumerate(group.inputs)]

    def run(self, env: list[Any]) -> None:
        g = self.group
        args = [f if f is not None else _as_view(env[s], g.view_of(k)) for k, (s, f) in enumerate(zip(g.inputs, self._fixed))]
        out = None
        if self.placement is not None:
            layout = "nhwc" if any(a is not None and storage_order(a) is not None for a in args) else "nchw"
            out = self.destination(env, layout)
        y = self.broadcast(args, out) if self.broadcast is not None else None
        if y is None:
            if self.fallback is None:
                raise RuntimeError(f"fused {'+'.join(g.ops)}: shape {[a.shape for a in args]} needs CuPy's kernel, which this plan did not build")
            y = in_storage_order(args, self.fallback, out=out)
        env[g.output] = y
        self.counters["fused_elementwise"] += 1


def _as_view(a: Any, view: tuple[int, ...] | None) -> Any:
    return a if view is None else a.reshape(view)


def _packed(a: Any) -> Any:
    """``a`` in C order (a copy when it is not: NumPy and CuPy arrays alike)."""
    return a if a.flags.c_contiguous else a.copy()

"""Fused steps of the op library: what an executor plan runs in place of a fusion unit
(:mod:`convpass.core.fusion_units`), written over ``xp`` like every op, so the CPU executor runs
them on NumPy and the cuda backend can run them on CuPy where its own kernels do not take a case.

``FusedNorm`` — a normalization unit: ``y = epilogue(norm(x) * scale + shift)``, where ``norm``
standardizes ``x`` over each sample's channel group (statistics in float32, float64 for float64
tensors: the mean, then the variance of the centred values, ONNX's ``stash_type`` 1), ``scale``
and ``shift`` are per-channel (the core's own parameters, per group ones repeated over the
group's channels) and the epilogue is the unit's element-wise nodes, each run by its own op
implementation in order. The normalized value is rounded to ``x``'s dtype once, before the
epilogue (the unfused ops round after every step: float16 results may differ in the last bit).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from convpass.ops.registry import NodeInfo, OpContext, OpImpl

__all__ = ["FUSED_DOMAIN", "ChainStep", "NormSpec", "fused_norm", "group_norm", "norm_impl"]

FUSED_DOMAIN = "ai.convpass.fused"  # the domain of plan steps that run a fusion unit (never in a model)


@dataclasses.dataclass(frozen=True)
class ChainStep:
    """One epilogue node of a fused step and where each of its inputs comes from: ``("none", 0)``
    absent, ``("norm", 0)`` the normalized value, ``("step", k)`` the output of epilogue node
    ``k``, ``("in", j)`` the fused step's input ``j``."""

    node: NodeInfo
    args: tuple[tuple[str, int], ...]


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """A ``FusedNorm`` step: the group count, epsilon and the epilogue."""

    groups: int
    eps: float
    chain: tuple[ChainStep, ...]
    names: tuple[str, ...]  # the unit's node names


def group_norm(xp: Any, x: Any, scale: Any, shift: Any, groups: int, eps: float) -> Any:
    """``x`` (``(N, C, *spatial)``, any strides) standardized per sample and channel group, times
    the per-channel ``scale`` plus ``shift`` (``(C,)``), in ``x``'s dtype (module docstring)."""
    ct = np.float64 if x.dtype == np.float64 else np.float32
    n, c = x.shape[:2]
    xf = x.astype(ct).reshape(n, groups, -1)
    mean = xp.mean(xf, axis=-1, keepdims=True)
    d = xf - mean
    var = xp.mean(d * d, axis=-1, keepdims=True)
    y = (d / xp.sqrt(var + ct(eps))).reshape(x.shape)
    view = (1, c) + (1,) * (x.ndim - 2)
    return (y * scale.astype(ct).reshape(view) + shift.astype(ct).reshape(view)).astype(x.dtype, copy=False)


def fused_norm(ctx: OpContext, node: NodeInfo, x: Any, scale: Any, shift: Any, *operands: Any) -> Any:
    """The ``FusedNorm`` step (module docstring); ``operands``: its inputs after ``shift``."""
    spec: NormSpec = node.prepared
    y = group_norm(ctx.xp, x, scale, shift, spec.groups, spec.eps)
    inputs = (x, scale, shift, *operands)
    outs: list[Any] = []
    for step in spec.chain:
        args = []
        for kind, k in step.args:
            args.append(None if kind == "none" else y if kind == "norm" else outs[k] if kind == "step" else inputs[k])
        out = step.node.impl.fn(ctx, step.node, *args)
        outs.append(out[0] if isinstance(out, (tuple, list)) else out)
    return outs[-1] if outs else y


def norm_impl() -> OpImpl:
    """The registration a ``FusedNorm`` plan step runs with (not in the op table: no model holds one)."""
    return OpImpl(FUSED_DOMAIN, "FusedNorm", 1, fused_norm)

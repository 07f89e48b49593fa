"""The first run of each graph-API engine step checked against a legacy algorithm of its key.

The tuner checks an engine configuration once, on fresh buffers, with the plan it built on the
graph it enumerated, alone. The executor runs it otherwise: a plan loaded from the kernel
side-car in another process, one plan serving every node of its problem (launched at other
buffers, between other kernels), inputs another launch just wrote. Fused engine graphs right in
the tuner's check have given wrong model outputs in the executor, so the executor checks each
engine step the first time it runs it.

Rules:

1. Which: every launch of a :class:`~convpass.kernels.conv_exec.EngineConv` (a fused graph, or a
   bare engine with its epilogue as one pass after it) of a recorded decision, once per node and
   plan: the first eager run of the plan (a captured plan's warm-up), never while a CUDA graph is
   captured. The backend's ``check_first_run`` turns it off.
2. Against what: the same step computed apart, on the very arrays the launch read (an input
   slice read in place with its strides): cuDNN's legacy
   forward call of the key (its memory format and math mode) with the decision's recorded legacy
   algorithm, else the first of ``implicit_precomp_gemm`` / ``implicit_gemm`` cuDNN accepts (where
   every one refuses the input slice's strides, on a packed copy of it: the check runs outside
   capture), then the step's epilogue (bias, residual, activation) over it with CuPy array operations.
3. Judged: normwise relative error (sums in float64, a few samples at a time); wrong above twice the
   tuner's :data:`~convpass.core.problem.TOLERANCE` for the key's data and math type (each side
   may be that far from the exact result), or non-finite where the reference is finite. A step
   of another storage dtype is not judged; one whose reference no legacy algorithm computes runs
   unchecked, said once (not warned); one whose check fails to run (out of memory, say) runs unchecked, warned once. A wrong
   step is reported by :func:`first_run` as the engine failing: the executor's warned fallback
   then runs instead, from that run on.
4. Cost, once per node: one legacy conv of the key into a scratch output (with its own
   workspace), the epilogue's element-wise passes, the sums and one host synchronization; the
   scratch memory comes from CuPy's default pool, not the plan's, and is freed after.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from convpass.core.problem import TOLERANCE
from convpass.native import cudnn
from convpass.native.cuda import elements, first_line
from convpass.native.cudnn import graph_api

logger = logging.getLogger("convpass")

__all__ = ["REFERENCE_ALGOS", "Unchecked", "check_step", "first_run", "relative_error"]

# legacy forward algorithms the reference is computed with when the decision records none
REFERENCE_ALGOS = ("implicit_precomp_gemm", "implicit_gemm")


def first_run(convs: Any, ex: Any, conv: Any, x: Any, w: Any, y: Any, b: Any, z: Any) -> None:
    """Check the launch of the engine step ``conv`` of the resolution ``ex`` that just ran (module
    rules) with the arrays it was given (``b``: the step's bias as the plan holds it); raises
    :class:`~convpass.native.cudnn.graph_api.GraphApiError` saying why where it computed wrongly.
    ``convs``: the backend's :class:`~convpass.kernels.convolution.Convolutions`."""
    rt = convs.rt
    if rt.capturing or not getattr(rt, "check_first_run", False):
        return
    ex.engine_checked = True
    bias = convs.resources.bias(b) if b is not None and conv.contiguous_bias else b
    try:
        why = check_step(convs.cp, convs.resources, conv, ex.legacy_algo, x, w, y, bias, z)
    except Unchecked as e:  # nothing to check it against: it runs as recorded, said once
        rt.note_once(f"engine-check:{ex.node}", f"node {ex.node!r}: the first run of {conv.algo} was not checked ({e}); "
                                                f"it runs as recorded, unverified", warn=False)
        return
    except Exception as e:  # noqa: BLE001  (the check itself failed: the step runs unchecked, said once)
        rt.note_once(f"engine-check:{ex.node}", f"node {ex.node!r}: the first run of {conv.algo} was not checked ({first_line(e)}); "
                                                f"it runs as recorded, unverified", warn=True)
        return
    if why is not None:
        raise graph_api.GraphApiError(f"{conv.algo}: {why}")


def check_step(cp: Any, resources: Any, conv: Any, legacy_algo: str, x: Any, w: Any, y: Any, bias: Any, z: Any) -> str | None:
    """Why the engine step ``conv`` computed ``y`` wrongly from ``x``, ``w``, ``bias`` and ``z`` (the
    arrays its launch was given, after it ran), or None when it is right or its storage dtype
    cannot be judged; :class:`Unchecked` where no legacy algorithm computes the reference (module
    rules). ``resources``: the backend's :class:`~convpass.kernels.conv_resources.ConvResources`."""
    key = conv.key
    dtype = key.shape.dtype
    if dtype not in ("float32", "float16") or str(getattr(y, "dtype", "")) != dtype:
        return None
    with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):  # scratch apart from the plan's pool
        made = _reference(cp, resources, conv, legacy_algo, x, w, y, bias, z)
        if made is None and cudnn.channel_slice(x, key.layout):  # every algorithm refuses the slice: a packed copy
            made = _reference(cp, resources, conv, legacy_algo, cudnn.as_layout(x, key.layout), w, y, bias, z)
        if made is None:
            raise Unchecked("no legacy algorithm of cuDNN computes its problem")
        ref, algo = made
        err = relative_error(cp, y, ref)
    tol = 2 * TOLERANCE[(dtype, key.math)]
    if err <= tol:
        return None
    return (f"its first run here differs from cuDNN's legacy {algo!r} of the same problem by a relative error of "
            f"{err:.2e} (> {tol:.0e})")


class Unchecked(Exception):
    """No reference for an engine step: nothing checks it (rule 3)."""


def _reference(cp: Any, resources: Any, conv: Any, legacy_algo: str, x: Any, w: Any, y: Any, bias: Any, z: Any) -> tuple[Any, str] | None:
    """The step computed apart (rule 2), with the algorithm used; None when no legacy algorithm
    takes the key."""
    key = conv.key
    descs = resources.descriptors(key)
    strided = {"x_strides": elements(x.strides, x.itemsize)} if cudnn.channel_slice(x, key.layout) else {}  # an input slice read in place
    for algo in dict.fromkeys([a for a in (legacy_algo, *REFERENCE_ALGOS) if a]):
        try:
            ref = cudnn.empty_like_layout(y.shape, y.dtype, key.layout)
            cudnn.run(descs, "fwd", algo, x, w, ref, **strided)  # its workspace asked and allocated here, then freed
        except (cudnn.CudnnError, ValueError) as e:
            logger.debug("%s: no reference with %r: %s", conv.algo, algo, e)
            continue
        return _epilogue(cp, ref, conv.epilogue, bias, z), algo
    return None


def _epilogue(cp: Any, v: Any, name: str, bias: Any, z: Any) -> Any:
    """``name``'s epilogue over the conv ``v`` (a legacy epilogue or a graph fusion, ``"relu"``,
    or ``""``), as :func:`~convpass.native.cudnn.graph_api.fusion_of` computes it."""
    if name == "relu":
        return cp.maximum(v, v.dtype.type(0))
    if not name:
        return v
    if bias is not None:
        v += bias.reshape((1, -1) + (1,) * (v.ndim - 2))
    return graph_api.fusion_of(name).reference(cp, v, z)


CHUNK_ELEMENTS = 1 << 23  # float64 temporaries of at most this many elements (64 MiB) at a time


def relative_error(cp: Any, out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` over all elements, summed in float64 a few samples (first axis)
    at a time (:data:`CHUNK_ELEMENTS`); inf where ``out`` is not finite and ``ref`` is."""
    if out.ndim < 2:
        out, ref = out.reshape(1, -1), ref.reshape(1, -1)
    step = max(1, CHUNK_ELEMENTS // max(1, out[0].size))
    num = den = 0.0
    for i in range(0, out.shape[0], step):
        o, r = out[i:i + step].astype(cp.float64), ref[i:i + step].astype(cp.float64)
        d = o - r
        # summed on the host: a Python float meeting a CuPy array in an operator imports cupyx
        # and SciPy (convpass/ops/arrays.py), which a fresh process's first run must not pay
        num += float((d * d).sum())
        den += float((r * r).sum())
    if not math.isfinite(num):
        return 0.0 if not math.isfinite(den) else math.inf
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)

"""What the convolutions of one cuda backend keep between launches: cuDNN descriptors and workspace
sizes per problem, the converted weights and biases, and the workspace arena.

* Descriptors are built once per :class:`~convpass.core.problem.ProblemKey`; workspace sizes are
  asked of cuDNN once per problem and algorithm, some of them ahead of the plan on a helper thread
  (:meth:`ConvResources.prefetch_workspaces`).
* A constant weight is converted once to what its execution object reads (the conv's memory format,
  the 1-D mapping, convpass's kernel's own order: :meth:`~convpass.kernels.conv_exec.ConvExec.prepare_weight`);
  a constant bias that is not contiguous is copied once where its object needs it contiguous.
* A conv without a bias whose step adds a residual runs it with a zero bias
  (:mod:`convpass.core.fusion`, "A conv without a bias"): one ``(K,)`` array of zeros per channel
  count and dtype, made when the plan is compiled and shared by every such conv (nothing writes
  it); making one while a CUDA graph is captured breaks the capture.
* The workspace comes from one arena (a single CuPy buffer) grown, when the plan is compiled, to
  the largest workspace the plan needs; growing it while a CUDA graph is captured breaks the capture.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from convpass.core import annotation
from convpass.core.algo import Algo
from convpass.core.problem import ProblemKey
from convpass.kernels.conv_exec import legacy_workspace
from convpass.native import cudnn
from convpass.native.cuda import CaptureBreak, start_helper

logger = logging.getLogger("convpass")

__all__ = ["ConvResources", "map_1d"]


def map_1d(a: Any, insert_axis: int | None) -> Any:
    """``a`` seen as the 2-D problem a 1-D conv runs as: a unit axis inserted at ``insert_axis``
    (2 for the ``(1, L)`` mapping, 3 for ``(L, 1)``; None: ``a`` itself)."""
    if insert_axis == 2:
        return a[:, :, None]
    if insert_axis == 3:
        return a[:, :, :, None]
    return a


class ConvResources:
    """Descriptors, workspace sizes, converted weights and biases, and the workspace arena of one
    backend ``rt`` (``cp``, ``device_id``, ``capturing``, ``is_constant(a)``)."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.cp = rt.cp
        self._descs: dict[ProblemKey, Any] = {}
        self._workspace_bytes: dict[tuple[ProblemKey, str], int] = {}
        self._prefetch: threading.Thread | None = None
        self._weights: dict[Any, tuple[Any, Any]] = {}
        self._biases: dict[Any, tuple[Any, Any]] = {}
        self._zero_biases: dict[tuple[int, str], Any] = {}
        self.arena: Any = None

    def descriptors(self, key: ProblemKey) -> Any:
        d = self._descs.get(key)
        if d is None:
            d = self._descs[key] = cudnn.ConvDescriptors(key)
        return d

    def workspace_bytes(self, key: ProblemKey, algo: str) -> int:
        """The workspace ``algo`` needs for ``key`` (:func:`~convpass.kernels.conv_exec.legacy_workspace`: a
        key that reads a channel slice, its strided call's too), asked of cuDNN once per problem and algorithm:
        each query costs a fresh process 1-3 ms, and a plan resolves every conv twice (op by op,
        then lowered) over problems that repeat. Raises as :func:`convpass.native.cudnn.workspace_size`."""
        ws = self._workspace_bytes.get((key, algo))
        if ws is None:
            ws = self._workspace_bytes[(key, algo)] = legacy_workspace(self.descriptors(key), key, algo)
        return ws

    def prefetch_workspaces(self, decisions: Iterable[annotation.ConvDecision]) -> None:
        """Ask cuDNN the workspace of every recorded legacy algorithm ahead of the plan, on a helper
        thread with a cuDNN handle of its own. A fresh process's first query of an algorithm family
        costs 0.05-0.13 s (cuDNN readies its kernels then; ctypes lets go of the GIL), so these run
        beside the plan's op-by-op Python instead of inside it. Answers fill the memo
        :meth:`workspace_bytes` reads; one not there yet is asked by the plan itself (the same
        answer), and one cuDNN refuses is left for the plan to meet and report. Every capture waits
        for the helper (:func:`~convpass.native.cuda.quiet_for_capture`: no CUDA call of another thread may fall
        inside a capture)."""
        wanted: dict[tuple[ProblemKey, str], None] = {}
        for d in decisions:
            if d.algo == annotation.AUTO or Algo.parse(d.algo).is_own or not d.problem_key:
                continue
            try:
                key = ProblemKey.parse(d.problem_key)
            except ValueError:
                continue  # said by the plan, which cannot run it either
            if (key, d.algo) not in self._workspace_bytes:
                wanted[(key, d.algo)] = None
        if not wanted:
            return
        device = self.rt.device_id
        memo = self._workspace_bytes

        def ask() -> None:
            try:
                with self.cp.cuda.Device(device):
                    handle = cudnn.api.Handle(device)
                    try:
                        for key, algo in wanted:
                            if (key, algo) in memo:
                                continue
                            try:
                                ws = legacy_workspace(cudnn.ConvDescriptors(key), key, algo, handle=handle)
                            except (cudnn.CudnnError, ValueError):
                                continue
                            memo.setdefault((key, algo), ws)
                    finally:
                        handle.close()
            except Exception as e:  # noqa: BLE001  (the plan asks for itself)
                logger.debug("asking cuDNN's workspaces ahead of the plan failed: %s", e)

        self._prefetch = start_helper(ask, "convpass-cudnn-prefetch")

    def weight(self, w: Any, ex: Any) -> Any:
        """``w`` as the execution object of the resolved conv ``ex`` reads it (module docstring);
        a constant's conversion is kept."""
        key = (id(w), ex.layout, ex.insert_axis, ex.conv.weight_form)
        hit = self._weights.get(key)
        if hit is not None and hit[0] is w:
            return hit[1]
        wk = ex.conv.prepare_weight(cudnn.as_layout(map_1d(w, ex.insert_axis), ex.layout))
        if self.rt.is_constant(w):
            self._weights[key] = (w, wk)
        return wk

    def bias(self, b: Any) -> Any:
        """``b`` contiguous (a constant's copy kept)."""
        if b.flags.c_contiguous:
            return b
        key = id(b)
        hit = self._biases.get(key)
        if hit is not None and hit[0] is b:
            return hit[1]
        out = self.cp.ascontiguousarray(b)
        if self.rt.is_constant(b):
            self._biases[key] = (b, out)
        return out

    def zero_bias(self, channels: int, dtype: Any) -> Any:
        """The ``(channels,)`` zeros of ``dtype`` a conv without a bias passes its residual step
        (module docstring): made once, then the same array every time."""
        key = (int(channels), np.dtype(dtype).str)
        zeros = self._zero_biases.get(key)
        if zeros is None:
            if self.rt.capturing:
                raise CaptureBreak(f"a zero bias of {channels} channels was not made before the capture")
            zeros = self._zero_biases[key] = self.cp.zeros(key[0], dtype=dtype)
        return zeros

    def workspace(self, nbytes: int) -> Any:
        """The arena, at least ``nbytes`` large (``(0, 0)``: no workspace)."""
        if nbytes <= 0:
            return (0, 0)
        if self.arena is None or self.arena.nbytes < nbytes:
            if self.rt.capturing:
                raise CaptureBreak("the cuDNN workspace arena is too small")
            self.arena = self.cp.empty(int(nbytes), dtype=np.uint8)
        return self.arena

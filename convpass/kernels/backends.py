"""Backends: where the executor's arrays live and what computes the convolutions.

The executor and the op library only talk to a :class:`Backend`:

* ``xp`` — the array namespace every op is written over (numpy here, cupy on a GPU);
* ``upload`` / ``to_host`` — host <-> backend transfers (constants go up once per model / plan;
  ``to_host`` of a constant must not cost a device sync: backends keep a host mirror of what they
  uploaded); ``constant`` — cached upload of host-built tables ops reuse (resize weights);
* ``conv`` / ``conv_transpose`` — the convolution kernels, given the canonical geometry and the
  recorded decision (:class:`convpass.ops.conv.ConvCall`);
* ``erf`` — the one special function numpy lacks;
* ``errstate`` / ``synchronize`` — execution scope and completion;
* ``begin_plan`` — a hook called when a new signature's first run starts, before the op-by-op run
  that records its plan (the cuda backend counts what compiles from there as start-up work);
* ``compile_plan`` — a hook called once per static plan (input-shape signature): the cuda backend
  lowers every step to a kernel, plans Concat buffers, resolves cuDNN algorithms and workspaces
  from the decisions, and captures the plan into CUDA graphs on its next run;
* ``graph_status`` — whether a compiled plan replays as one CUDA graph.

:class:`CpuBackend` is the NumPy reference. The cuda backend lives in the package ``convpass.runtime.cuda``
(``CudaBackend(device=..., cuda_graph=...)``, ``unavailable_reason() -> str | None``) and
is picked by :func:`convpass.runtime.devices.get_backend` (this module never imports it: the
dependencies run executor -> devices -> {backends, cuda} -> backends). What it has to provide,
beyond ``xp = cupy``:

* ``conv`` / ``conv_transpose``: cuDNN forward / backward-data from ``call.geometry`` (symmetric
  ``pads`` for cuDNN; ``extra_pads`` = zero pre-pad of the input for Conv, crop of the output for
  ConvTranspose; ``shapes`` = the cuDNN problems, two 2-D mappings for 1-D convs) and
  ``call.decision`` (``algo`` by name, ``memory_format`` NCHW / NHWC -> tensor descriptors and the
  transposes the plan needs, ``math_mode`` -> ``cudnnSetConvolutionMathType``, ``workspace_bytes``;
  ``None`` for untuned convs and ``algo == "auto"`` where no profile matched: pick at run time).
  A geometry with ``shapes == ()`` is one canonicalization refused: run
  :func:`convpass.ops.conv.conv_reference` with ``xp = cupy`` (the kernels are xp-generic).
* ``erf``: a CuPy element-wise kernel of CUDA's ``erf`` (cupyx would import SciPy).
* ``fingerprint()``: this GPU's :class:`convpass.core.device.DeviceFingerprint`; the executor reads the
  decision table recorded for it (a model may carry several devices' tables);
* ``bind_model(model_info)``: the model's metadata, once per executor (recorded device
  fingerprint to re-validate the decisions against, ``matmul_allow_tf32``);
  ``upload_input`` / ``adopt``: feeds (NumPy uploaded without a host mirror; CuPy and CUDA
  DLPack arrays used in place).
* ``compile_plan(plan)``: ``plan.steps`` (with ``free`` = liveness), ``plan.value_info`` (shape,
  dtype per slot) and ``plan.template`` (constants, uploaded once) are what a preallocating,
  graph-capturing runner needs; set ``plan.backend_state`` and implement
  ``run_plan(plan, feeds) -> outputs`` to take over execution; ``plan.matmul_allow_tf32`` is the
  model's Gemm / MatMul TF32 switch. The first run of a signature executes op by op eagerly (it builds
  the plan), then runs the compiled plan: its warm-up and capture.
* ``graph_status(plan)``: a :class:`convpass.kernels.plan.GraphStatus` — whether the compiled plan
  replays as one CUDA graph and, if not, which node stopped it and why.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from convpass.kernels.plan import GraphStatus, Plan
from convpass.ops import conv as conv_kernels


class Backend:
    """The interface; see the module docstring."""

    name = "abstract"
    xp: Any = None

    def upload(self, array: np.ndarray) -> Any:
        raise NotImplementedError

    def to_host(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def upload_input(self, array: np.ndarray) -> Any:
        """``upload`` for a feed: not kept, so no host mirror (the default is ``upload``)."""
        return self.upload(array)

    def adopt(self, value: Any) -> Any:
        """A foreign array already in this backend's memory (e.g. a CUDA DLPack tensor) as an ``xp``
        array without a copy, or None when ``value`` is not one."""
        return None

    def fingerprint(self) -> Any:
        """The device fingerprint whose decision table this backend runs (None: no GPU, the first table)."""
        return None

    def bind_model(self, model_info: Any) -> None:
        """Called once by the executor with the model's convpass metadata (None for untuned models)."""
        return None

    def prefetch(self, decisions: Iterable[Any]) -> None:
        """Called once by the executor with the recorded conv decisions its plans will run (the
        first profile's first), before any plan: a backend may ready them meanwhile (the cuda one
        asks cuDNN their workspaces on a helper thread)."""
        return None

    def ready_libraries(self, op_types: Iterable[str]) -> None:
        """Called once by the executor with the op types of the model's graph, before any plan: a
        backend may ready the libraries they need meanwhile (the cuda one makes cuBLAS ready on a
        helper thread for MatMul / Gemm)."""
        return None

    def warm_up(self, plan: Plan, feeds: dict[str, Any]) -> None:
        """Do a compiled plan's first-run work now (e.g. warm-up and CUDA-graph capture), for
        :meth:`Executor.prepare`; nothing when the plan has none left."""
        return None

    def use_kernels(self, kernels: Any, why_none: str) -> None:
        """Called once by the executor with the model's kernel side-car
        (:class:`convpass.core.kernel_file.KernelFile`), or None and why there is none. Backends that
        compile nothing at run time ignore it."""
        return None

    def constant(self, array: np.ndarray) -> Any:
        """``upload`` for host-built tables ops reuse (resize weights, pool offsets): cached by identity,
        so a device backend uploads each once and never copies host->device while replaying a plan."""
        key = id(array)
        hit = self._constants.get(key)
        if hit is None or hit[0] is not array:
            hit = self._constants[key] = (array, self.upload(array))
        return hit[1]

    @property
    def _constants(self) -> dict[int, tuple[np.ndarray, Any]]:
        cache = self.__dict__.get("_constant_cache")
        if cache is None:
            cache = self.__dict__["_constant_cache"] = {}
        return cache

    def conv(self, x: Any, w: Any, b: Any, call: conv_kernels.ConvCall) -> Any:
        raise NotImplementedError

    def conv_transpose(self, x: Any, w: Any, b: Any, call: conv_kernels.ConvCall) -> Any:
        raise NotImplementedError

    def erf(self, x: Any) -> Any:
        raise NotImplementedError

    def errstate(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        return None

    def begin_plan(self) -> None:
        """Called when a new signature's first run starts, before the op-by-op run that records its
        plan: what a backend builds from here to the end of that plan's first run is its start-up
        work (the cuda backend counts the kernels compiled)."""
        return None

    def compile_plan(self, plan: Any) -> None:
        """Called once when a static plan is built (see the module docstring)."""
        return None

    def replay(self, plan: Plan, feeds: dict[str, Any]) -> list[Any] | None:
        """The outputs of a plan that replays without host work (a captured CUDA graph), run
        outside :meth:`errstate`; None where the plan must run the usual way."""
        return None

    def graph_status(self, plan: Plan) -> GraphStatus:
        """Whether ``plan`` runs as one captured CUDA graph (not applicable here)."""
        return GraphStatus(None, f"{self.name} backend")

    def describe(self) -> str:
        return self.name


class CpuBackend(Backend):
    """NumPy: the reference path. Decisions don't change its math; it runs every conv in NCHW."""

    name = "cpu"
    xp = np

    def __init__(self) -> None:
        self._erf = np.frompyfunc(math.erf, 1, 1)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.asarray(array)

    def constant(self, array: np.ndarray) -> np.ndarray:
        return array

    def to_host(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def conv(self, x: Any, w: Any, b: Any, call: conv_kernels.ConvCall) -> np.ndarray:
        return conv_kernels.conv_reference(np, x, w, b, call.geometry)

    def conv_transpose(self, x: Any, w: Any, b: Any, call: conv_kernels.ConvCall) -> np.ndarray:
        return conv_kernels.conv_transpose_reference(np, x, w, b, call.geometry)

    def erf(self, x: np.ndarray) -> np.ndarray:
        # math.erf is exact to double precision; fine for a reference path.
        return self._erf(x.astype(np.float64, copy=False)).astype(x.dtype)

    def errstate(self) -> contextlib.AbstractContextManager[Any]:
        # Overflow / division by zero give inf / nan as ONNX Runtime does; no warnings.
        return np.errstate(all="ignore")

    def describe(self) -> str:
        return f"cpu (numpy {np.__version__})"


_HOST = CpuBackend()


def host_backend() -> CpuBackend:
    """The backend the executor folds constants and shape computations with."""
    return _HOST

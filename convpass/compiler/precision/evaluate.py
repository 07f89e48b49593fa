"""Evaluators: run a candidate model end to end on an input set, as it will run.

* :class:`CudaEvaluator` runs the convpass executor on the GPU (``device="cuda"``): the recorded
  decisions, the float16 region and its Casts, TF32 where the decisions say so. What it measures
  is the tuned model's own error on that GPU.
* :class:`CpuEvaluator` runs the convpass CPU executor and emulates the GPU's reduced precision:
  the float16 region really computes in float16 (NumPy's half type; convs accumulate in float32
  and round their output to float16, cuDNN's pseudo-half configuration), and a TF32 conv rounds
  its input and weight to TF32 (10 mantissa bits, to nearest, ties away from zero, as
  ``cvt.rna.tf32.f32`` does) before a float32 convolution. It makes the whole budget loop run on
  a machine without a GPU (with the tuning cache of the target GPU for the speeds); its errors are
  an emulation, recorded as such. The GPU's kernels may sum in another order or truncate to TF32
  instead of rounding: errors of the same magnitude, not the same bits.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from typing import Any, Protocol

import numpy as np
import onnx

from convpass.compiler.precision.data import InputSet
from convpass.kernels.backends import CpuBackend

_TF32_DROPPED_BITS = 13  # float32 has 23 mantissa bits, TF32 10


class Evaluator(Protocol):
    description: str

    def outputs(self, model: onnx.ModelProto, tf32: Collection[str], inputs: InputSet) -> list[list[np.ndarray]]:
        """The model's outputs (all of them, in graph order) for every feed of ``inputs``; ``tf32``:
        the convs (by node name) that compute in TF32."""
        ...


def round_to_tf32(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 (10 mantissa bits; to nearest, ties away from zero), as float32."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    half = np.uint32(1 << (_TF32_DROPPED_BITS - 1))
    mask = np.uint32((0xFFFFFFFF >> _TF32_DROPPED_BITS) << _TF32_DROPPED_BITS)
    finite = np.isfinite(a)
    rounded = np.where(finite, (bits + half) & mask, bits)
    return rounded.view(np.float32).reshape(np.shape(a))


class _Tf32Cpu(CpuBackend):
    """The NumPy backend with TF32 emulated for the named convs (module docstring)."""

    def __init__(self, tf32: Collection[str]) -> None:
        super().__init__()
        self.tf32 = frozenset(tf32)

    def _inputs(self, x: Any, w: Any, name: str) -> tuple[Any, Any]:
        if name in self.tf32 and x.dtype == np.float32:
            return round_to_tf32(x), round_to_tf32(w)
        return x, w

    def conv(self, x, w, b, call):
        x, w = self._inputs(x, w, call.node_name)
        return super().conv(x, w, b, call)

    def conv_transpose(self, x, w, b, call):
        x, w = self._inputs(x, w, call.node_name)
        return super().conv_transpose(x, w, b, call)

    def describe(self) -> str:
        return f"cpu (numpy {np.__version__}), TF32 emulated"


class CpuEvaluator:
    """The convpass CPU executor with the GPU's rounding emulated (module docstring)."""

    description = "convpass CPU executor, GPU precision emulated"

    def outputs(self, model: onnx.ModelProto, tf32: Collection[str], inputs: InputSet) -> list[list[np.ndarray]]:
        from convpass.runtime.executor import Executor

        executor = Executor(model, device=_Tf32Cpu(tf32), kernels=False)
        return [list(executor.run(None, feed)) for feed in inputs.feeds]


class CudaEvaluator:
    """The convpass executor on the GPU, with the candidate's recorded decisions (module docstring)."""

    def __init__(self, device: str = "cuda") -> None:
        self.device = device
        self.description = "convpass executor on the GPU"

    def outputs(self, model: onnx.ModelProto, tf32: Collection[str], inputs: InputSet) -> list[list[np.ndarray]]:
        from convpass.native.cuda import StartupCompileWarning
        from convpass.runtime.executor import Executor

        with warnings.catch_warnings():
            # a candidate has no kernel side-car: its kernels compile here, which is expected (the
            # written model gets its side-car); every other warning is still said
            warnings.simplefilter("ignore", StartupCompileWarning)
            executor = Executor(model, device=self.device, output_kind="numpy", kernels=False)
            return [list(executor.run(None, feed)) for feed in inputs.feeds]

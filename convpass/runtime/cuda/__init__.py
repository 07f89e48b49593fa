"""The cuda backend of the executor: CuPy + cuDNN with the recorded choices, CUDA-graph replay.

``CudaBackend(device=0, cuda_graph=True, ...)`` implements
:class:`convpass.kernels.backends.Backend` with ``xp = cupy``; :func:`unavailable_reason` says why
it cannot run here (no CuPy, no GPU, no cuDNN), ``None`` when it can; :func:`open_ahead` starts a
GPU's set-up on a helper thread. Importing this package
imports neither CuPy nor cuDNN.

One module per concern, dependencies one way (:mod:`convpass.runtime.cuda.backend` is the only one that knows them all):

* :mod:`convpass.runtime.cuda.lowering` — which kernel runs each plan step; :mod:`convpass.runtime.cuda.memory` — Concat buffers;
  :mod:`convpass.runtime.cuda.runner` — warm-up, capture, replay; :mod:`convpass.kernels.launch` — the unit of a compiled plan;
* the backend's parts: :mod:`convpass.runtime.cuda.device` — the GPU opened and described;
  :mod:`convpass.runtime.cuda.startup` — the kernel side-car and the notes on what compiles at start-up;
  :mod:`convpass.runtime.cuda.matmul_path` — capturable cuBLAS and the TF32 switch;
* kernel families: :mod:`convpass.kernels.convolution` (cuDNN convolutions and their epilogues), :mod:`convpass.kernels.depthwise`
  (convpass's own depthwise conv kernel, a tuning candidate beside cuDNN's algorithms),
  :mod:`convpass.kernels.elementwise` (generated element-wise groups), :mod:`convpass.kernels.normalization` (row-wise norms and
  softmax), :mod:`convpass.kernels.pooling` (window and global pooling), :mod:`convpass.kernels.tensor_ops` (Resize, Concat),
  :mod:`convpass.native.cublas` (capturable cuBLAS);
* :mod:`convpass.native.nvrtc` — the one place CUDA source becomes kernels; :mod:`convpass.native.prebuilt` — the seam under
  CuPy's compiler that loads kernels compiled ahead of time (the model's ``.kernels`` side-car) and
  counts what still compiles; :mod:`convpass.native.cuda` — shared helpers.
"""

from convpass.native.cuda import ExecutorWarning, StartupCompileWarning, open_ahead, unavailable_reason


def __getattr__(name: str):  # CudaBackend without importing CuPy-facing modules at package import
    if name == "CudaBackend":
        from convpass.runtime.cuda.backend import CudaBackend

        return CudaBackend
    raise AttributeError(name)


__all__ = ["CudaBackend", "ExecutorWarning", "StartupCompileWarning", "open_ahead", "unavailable_reason"]

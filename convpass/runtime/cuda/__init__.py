"""The cuda backend of the executor: CuPy + cuDNN with the recorded choices, CUDA-graph replay.

``CudaBackend(device=0, cuda_graph=True, ...)`` implements
:class:`convpass.runtime.backends.Backend` with ``xp = cupy``; :func:`unavailable_reason` says why
it cannot run here (no CuPy, no GPU, no cuDNN), ``None`` when it can; :func:`open_ahead` starts a
GPU's set-up on a helper thread. Importing this package
imports neither CuPy nor cuDNN.

One module per concern, dependencies one way (:mod:`.backend` is the only one that knows them all):

* :mod:`.lowering` — which kernel runs each plan step; :mod:`.memory` — Concat buffers;
  :mod:`.runner` — warm-up, capture, replay; :mod:`.launch` — the unit of a compiled plan;
* kernel families: :mod:`.convolution` (cuDNN convolutions and their epilogues), :mod:`.depthwise`
  (convpass's own depthwise conv kernel, a tuning candidate beside cuDNN's algorithms),
  :mod:`.elementwise` (generated element-wise groups), :mod:`.normalization` (row-wise norms and
  softmax), :mod:`.pooling` (window and global pooling), :mod:`.tensor_ops` (Resize, Concat),
  :mod:`.blas` (capturable cuBLAS);
* :mod:`.compiler` — the one place CUDA source becomes kernels; :mod:`.prebuilt` — the seam under
  CuPy's compiler that loads kernels compiled ahead of time (the model's ``.kernels`` side-car) and
  counts what still compiles; :mod:`.common` — shared helpers.
"""

from convpass.runtime.cuda.common import ExecutorWarning, StartupCompileWarning, open_ahead, unavailable_reason


def __getattr__(name: str):  # CudaBackend without importing CuPy-facing modules at package import
    if name == "CudaBackend":
        from convpass.runtime.cuda.backend import CudaBackend

        return CudaBackend
    raise AttributeError(name)


__all__ = ["CudaBackend", "ExecutorWarning", "StartupCompileWarning", "open_ahead", "unavailable_reason"]

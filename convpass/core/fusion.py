"""Conv epilogues: what runs after a convolution inside its executor step, and their names.

The executor runs a forward Conv that has a constant bias as one step ``y = act(conv(x, w) + z + b)``
(:func:`convpass.kernels.convolution.lower_convs`): the bias, a residual ``Add`` whose other
operand ``z`` is ready before the conv, and a ``Relu`` that is the only reader. The tuner must time
that step, not the bare conv: on an H200 (cuDNN 9.19) the same algorithm ran 1.5-5x slower through
cuDNN's fused bias + activation call than its bare conv was timed at (DenseNet-121 and
MobileNetV3 at batch 32: another kernel, or an old non-tensor-core one, for some shapes).

Names
-----
An epilogue is named by what follows the conv, in order:

===================  ===========================================
``bias``             ``y = conv + b``
``bias+relu``        ``y = relu(conv + b)``
``bias+add``         ``y = conv + z + b`` (the residual Add)
``bias+add+relu``    ``y = relu(conv + z + b)``
===================  ===========================================

These are the :data:`LEGACY` epilogues: cuDNN's legacy ``cudnnConvolutionBiasActivationForward``
runs each in one call (identity or ReLU activation, ``z`` through ``alpha2``). The graph API's fused
graphs (``bias+swish``: :data:`convpass.native.cudnn.graph_api.FUSIONS`) use the same naming.

Rules
-----
* **Two ways to run a legacy epilogue, both timed.** (a) the conv, then one element-wise pass
  over its output (the ``epilogue`` row of the tuning cache: :data:`convpass.tuning.decide.EPILOGUE_METHOD`);
  (b) the fused call, per legacy algorithm (a row whose algorithm is ``<algo>+<epilogue>``,
  :class:`convpass.core.algo.Algo` with its ``fusion``). The tuner times (b) for the :data:`FUSED_CALL_CANDIDATES` fastest legacy
  algorithms of each key only: the fused call reuses the algorithm's kernels or falls back to
  slower ones, and it never ran faster than the bare conv in the H200 profiles.
* **Recorded.** A decision whose ``fusion`` names a legacy epilogue and that has no graph-API
  engine runs the fused call (annotation schema 5); a legacy decision without one runs (a). A
  model tuned before schema 5 recorded no fused call: its convs run as they were timed, (a).
"""

from __future__ import annotations

__all__ = ["FUSED_CALL_CANDIDATES", "LEGACY", "is_legacy", "legacy_name", "parts"]

LEGACY: tuple[str, ...] = ("bias", "bias+relu", "bias+add", "bias+add+relu")
FUSED_CALL_CANDIDATES = 2  # legacy algorithms per key whose fused call the tuner times


def legacy_name(residual: bool, relu: bool) -> str:
    """The legacy epilogue of a conv with a bias, a residual Add or not and a ReLU or not."""
    return "bias" + ("+add" if residual else "") + ("+relu" if relu else "")


def is_legacy(name: str | None) -> bool:
    """Whether ``name`` is an epilogue cuDNN's legacy fused call runs."""
    return name in LEGACY


def parts(name: str) -> tuple[bool, bool]:
    """``(residual, relu)`` of a legacy epilogue; ValueError for any other name."""
    if name not in LEGACY:
        raise ValueError(f"{name!r} is not a legacy conv epilogue ({', '.join(LEGACY)})")
    return "+add" in name, name.endswith("+relu")

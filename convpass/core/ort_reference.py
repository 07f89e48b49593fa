"""ONNX Runtime's CPU provider as the float32 reference, with its result-changing rewrite turned off.

Every place convpass measures a model against ONNX Runtime (the ``--precision`` budget, ``run
--compare ort``, ``bench``'s output check) makes its session here, so that all of them compute
what the model says.

ONNX Runtime's level-1 rewrite ``Pad_Fusion`` moves a constant zero ``Pad`` into the ``pads`` of
the ``Conv`` or ``MaxPool`` that reads it. For a Conv that is exact. For a MaxPool it is not:
MaxPool's own pads count as minus infinity, so a window whose values are all negative yields
their maximum instead of the zero the Pad put there. ONNX Runtime 1.30 and 1.31 fuse into MaxPool
(1.32 does not; onnx-optimizer's and onnxsim's pad-into-pool rewrite has the same flaw). A model with ``Conv -> Pad(0) -> MaxPool`` and no activation between them (the
stem of timm's BiT ResNet-v2 models) then has its border windows wrong wherever all their
values are negative, and every float32 runtime that computes the model as written looks about
1e-3 off. :func:`cpu_session` turns the rewrite off by the rule's name (a name ONNX Runtime does
not know is ignored, so the option is harmless where the rewrite is gone).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DISABLED_REWRITES", "cpu_session"]

# ONNX Runtime graph rewrites that change a model's results, by the names ONNX Runtime gives them
DISABLED_REWRITES: tuple[str, ...] = ("Pad_Fusion",)


def cpu_session(ort: Any, model: Any, options: Any = None) -> Any:
    """An ``ort.InferenceSession`` on the CPU provider for ``model`` (a path or serialized bytes),
    with ``options`` (``ort.SessionOptions``) and :data:`DISABLED_REWRITES` off."""
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"], disabled_optimizers=list(DISABLED_REWRITES))

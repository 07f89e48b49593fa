"""The op library: one implementation per ONNX op, written over an array namespace (NumPy or CuPy).

Importing the package fills the op table (:mod:`.registry`) with the ops of :mod:`.elementwise`,
:mod:`.shape`, :mod:`.indexing`, :mod:`.reduction`, :mod:`.nn`, :mod:`.resize`, :mod:`.quantize`
and the reference convolutions of :mod:`.conv`; Python imports the package before any of its
modules, so every lookup sees the whole table. The host-side folding rules that the compiler and
the executor share live here too: :mod:`.constant_folding` and :mod:`.batchnorm_folding`.
"""

from convpass.ops import elementwise, indexing, nn, quantize, reduction, resize, shape  # noqa: F401  (registration)

__all__ = ["elementwise", "indexing", "nn", "quantize", "reduction", "resize", "shape"]

"""The optimize pipeline's pass sequences, as onnx-ir pass managers, and how they are run.

Rules:

1. :func:`folding`: ``FoldConvWeightsPass`` then ``FoldBatchNormsPass``, the constant weight
   computations and then the BatchNormalizations after convs, folded as the executor folds them
   when it loads the model, so that the tuner times the steps that run; then
   ``FoldReluAffinePass``, a constant affine after a conv's Relu folded into the conv (the step
   then ends at the Relu it absorbs).
2. :func:`preparation`: every pass before a decision, in the order their ``requires()`` state
   (:mod:`~convpass.compiler.passes.state`): the folding, ``ResolveShapesPass``,
   ``SumBranchesPass`` (before anything reads the graph around the convs: the planners and the
   fusions see the rewritten sums), ``CanonicalizeConvsPass``, ``CollectConvProblemsPass``. It runs once (no fixed point).
3. :func:`run` runs a sequence on a model in place. An error a pass raises comes out as the pass
   raised it: onnx-ir wraps it in ``PassError`` once per sequence level, and a ``ConvpassError``
   must reach the CLI as its one line.
"""

from __future__ import annotations

import onnx_ir as ir

from convpass.compiler.passes.canonicalize_convs import CanonicalizeConvsPass
from convpass.compiler.passes.collect_conv_problems import CollectConvProblemsPass
from convpass.compiler.passes.fold_batchnorms import FoldBatchNormsPass
from convpass.compiler.passes.fold_conv_weights import FoldConvWeightsPass
from convpass.compiler.passes.fold_relu_affine import FoldReluAffinePass
from convpass.compiler.passes.resolve_shapes import ResolveShapesPass
from convpass.compiler.passes.sum_branches import SumBranchesPass

__all__ = ["folding", "preparation", "run"]


def folding(fold: FoldConvWeightsPass | None = None) -> ir.passes.Sequential:
    """Rule 1 (``fold``: the weight-folding pass whose notes the caller reads; None: a new one)."""
    return ir.passes.Sequential(fold or FoldConvWeightsPass(), FoldBatchNormsPass(), FoldReluAffinePass())


def preparation(fold: FoldConvWeightsPass, resolve: ResolveShapesPass, collect: CollectConvProblemsPass) -> ir.passes.PassManager:
    """Rule 2, with the passes whose results the caller reads (notes, problems) handed in."""
    return ir.passes.PassManager([folding(fold), resolve, SumBranchesPass(), CanonicalizeConvsPass(), collect], steps=1, early_stop=False)


def run(passes: ir.passes.PassBase, model: ir.Model) -> ir.passes.PassResult:
    """Rule 3."""
    try:
        return passes(model)
    except ir.passes.PassError as e:
        error: BaseException = e
        while isinstance(error, ir.passes.PassError) and error.__cause__ is not None:
            error = error.__cause__
        if error is e:
            raise
        raise error from None

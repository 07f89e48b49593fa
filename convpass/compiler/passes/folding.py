"""What the passes that fold nodes into the convs before them share (BatchNormalizations, a
constant affine after a Relu): they need the convs' weights constant
(:data:`~convpass.compiler.passes.state.WEIGHTS_FOLDED`), list the names of the nodes they folded,
and end alike when they folded any: the model's IR version raised to one whose initializers need
not be graph inputs (the folded weights are new initializers), and the nodes nothing reads any
more removed.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common

from convpass.compiler.passes import state

__all__ = ["MIN_IR_WITHOUT_INPUT_INITIALIZERS", "FoldIntoConvsPass"]

# IR 3 needs every initializer listed as a graph input; from IR 4 on it need not be
MIN_IR_WITHOUT_INPUT_INITIALIZERS = 4


class FoldIntoConvsPass(ir.passes.InPlacePass):
    """An in-place pass that folds nodes into convs. ``folded``: the names of the nodes the last
    call folded (a subclass's ``call`` starts it empty and ends with :meth:`finish`)."""

    def __init__(self) -> None:
        super().__init__()
        self.folded: list[str] = []

    def requires(self, model: ir.Model) -> None:
        state.require(self, model, state.WEIGHTS_FOLDED)

    def finish(self, model: ir.Model) -> ir.passes.PassResult:
        """The call's result, the model tidied where anything was folded (module docstring)."""
        if self.folded:
            model.ir_version = max(model.ir_version, MIN_IR_WITHOUT_INPUT_INITIALIZERS)
            onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=bool(self.folded))

"""Fold the constant computations that produce convolution weights and biases into initializers.

Rules:

* A conv's weight (and bias) that is an initializer is already constant, including initializers
  that old models (IR < 4) also list as graph inputs.
* A weight computed only from constants through Constant, Identity, Cast, Reshape, Transpose,
  Squeeze, Unsqueeze, ConstantOfShape or DequantizeLinear is evaluated (with ONNX's reference
  evaluator) and becomes a new initializer that the conv reads; the chain is removed once nothing
  else uses it.
* Folding into an IR-3 model raises its IR version to 4. IR 3 requires every initializer to be
  a graph input too, so new initializers that are not inputs make the model invalid, and ONNX shape
  inference (which at IR 3 only reads initializers that are inputs) then loses every shape behind
  the conv. Listing them as inputs instead would keep IR 3 but make the folded weights overridable
  inputs, which ONNX Runtime does not treat as constants. IR 4 only relaxed this rule (and added
  the bfloat16 type), ONNX Runtime reads IR 4 to 10, and the annotated model needs IR 8 anyway
  (model-local functions).
* A weight that is truly dynamic (a graph input without initializer, or computed from one, or
  through any other op) cannot be tuned ahead of time: the node is marked ``convpass.skip`` with
  the reason, stays a plain standard op, and a warning says so.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from convpass.compiler.passes.canonicalize_convs import CONV_OPS, node_label
from convpass.compiler.passes.resolve_shapes import SKIP_KEY

logger = logging.getLogger("convpass")

FOLDABLE_OPS = frozenset(
    {"Constant", "Identity", "Cast", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "ConstantOfShape", "DequantizeLinear"}
)


# From IR version 4 on, initializers need not be graph inputs.
_MIN_IR_WITHOUT_INPUT_INITIALIZERS = 4


class DequantizeLinear(OpRun):
    """DequantizeLinear (per tensor or per axis) for every opset: ONNX's reference evaluator only
    implements opset 19+, while quantized model-zoo exports use 10 and 13."""

    op_domain = ""

    def _run(self, x, scale, zero_point=None, axis=None, block_size=None, output_dtype=None):  # noqa: ARG002
        axis = 1 if axis is None else axis
        shape = [1] * x.ndim
        if np.ndim(scale) == 1:
            shape[axis] = -1
        zp = 0 if zero_point is None else np.reshape(zero_point, shape).astype(np.float32)
        return (((x.astype(np.float32) - zp) * np.reshape(scale, shape)).astype(scale.dtype),)


class _Dynamic(Exception):
    """The value depends on something only known at run time."""


class FoldConvWeightsPass(ir.passes.InPlacePass):
    """Makes every conv weight / bias an initializer, or marks the conv as not tunable (module rules)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = model.opset_imports.get("", 1)
        modified = False
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):  # bodies of If / Loop / Scan too
            if node.op_type not in CONV_OPS or node.domain not in ("", "ai.onnx"):
                continue
            for index in (1, 2):
                if index >= len(node.inputs) or node.inputs[index] is None:
                    continue
                value = node.inputs[index]
                if value.const_value is not None:
                    continue
                try:
                    array = _evaluate(value, opset)
                except _Dynamic as why:
                    node.meta[SKIP_KEY] = f"its {'weight' if index == 1 else 'bias'} {value.name!r} {why}"
                    logger.warning(
                        "%s %r is left untuned: its %s %r %s",
                        node.op_type,
                        node_label(node),
                        "weight" if index == 1 else "bias",
                        value.name,
                        why,
                    )
                    break
                folded = ir.Value(name=f"{value.name}__folded", const_value=ir.tensor(array, name=f"{value.name}__folded"))
                folded.shape = ir.Shape(array.shape)
                folded.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
                model.graph.register_initializer(folded)
                node.replace_input_with(index, folded)
                modified = True
        if modified:
            # See the module rules: IR 3 would need every new initializer listed as a graph input.
            model.ir_version = max(model.ir_version, _MIN_IR_WITHOUT_INPUT_INITIALIZERS)
            ir.passes.common.RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=modified)


def _evaluate(value: ir.Value, opset: int) -> np.ndarray:
    """Evaluate a value computed from constants only; raise _Dynamic otherwise."""
    nodes: list[ir.Node] = []
    constants: dict[str, ir.Value] = {}
    seen: set[int] = set()

    def visit(v: ir.Value) -> None:
        if v.const_value is not None:
            constants[v.name] = v
            return
        producer = v.producer()
        if producer is None:
            raise _Dynamic("is a graph input without an initializer (known only at run time)")
        if producer.op_type not in FOLDABLE_OPS or producer.domain not in ("", "ai.onnx"):
            raise _Dynamic(f"is computed at run time by {producer.op_type} node {node_label(producer)!r}")
        if id(producer) in seen:
            return
        seen.add(id(producer))
        for inp in producer.inputs:
            if inp is not None:
                visit(inp)
        nodes.append(producer)

    visit(value)
    proto_nodes = [ir.serde.serialize_node(n) for n in nodes]
    initializers = [ir.serde.serialize_tensor(v.const_value) for v in constants.values()]
    for tensor, name in zip(initializers, constants):
        tensor.name = name
    out_info = onnx.helper.make_empty_tensor_value_info(value.name)
    fold_model = onnx.helper.make_model(
        onnx.helper.make_graph(proto_nodes, "fold", [], [out_info], initializers),
        opset_imports=[onnx.helper.make_opsetid("", opset)],
        ir_version=8,
    )
    try:
        (result,) = ReferenceEvaluator(fold_model, new_ops=[DequantizeLinear]).run(None, {})
    except Exception as e:  # noqa: BLE001  (the evaluator raises many kinds)
        raise _Dynamic(f"could not be folded ({type(e).__name__}: {e})") from None
    return np.asarray(result)

"""The model-local functions of a tuned model: for each annotated op type in ``ai.convpass``, a
function whose body is the standard op (:func:`conv_function`), so ONNX's checker accepts the
model and ONNX Runtime runs it unchanged; the check that a model's functions still run what their
nodes name (:func:`verify_functions`); and the way back to standard ops (:func:`standard_model`).

The format is described once, in :mod:`convpass.core.annotation`, which is also where callers
import these names from.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from convpass.core.annotation_decisions import (
    ANNOTATED_OPS,
    DECISION_ATTRIBUTES,
    DOMAIN,
    LEVEL_ATTRIBUTE,
    PRECISION_ATTRIBUTES,
    AnnotationError,
    all_nodes,
    is_annotated_conv,
    standard_op_type,
)

__all__ = [
    "DOMAIN_VERSION",
    "MAX_IR_VERSION",
    "MIN_IR_VERSION",
    "STANDARD_ATTRIBUTES",
    "conv_function",
    "standard_attributes",
    "standard_model",
    "verify_functions",
]

DOMAIN_VERSION = 1

# Lowest IR version with model-local functions; and the highest ONNX Runtime 1.31 reads.
MIN_IR_VERSION = 8
MAX_IR_VERSION = 13

_A = onnx.AttributeProto
STANDARD_ATTRIBUTES: dict[str, dict[str, int]] = {
    "Conv": {
        "auto_pad": _A.STRING,
        "dilations": _A.INTS,
        "group": _A.INT,
        "kernel_shape": _A.INTS,
        "pads": _A.INTS,
        "strides": _A.INTS,
    },
    "ConvTranspose": {
        "auto_pad": _A.STRING,
        "dilations": _A.INTS,
        "group": _A.INT,
        "kernel_shape": _A.INTS,
        "output_padding": _A.INTS,
        "output_shape": _A.INTS,
        "pads": _A.INTS,
        "strides": _A.INTS,
    },
}


def conv_function(annotated_op: str, opset_version: int) -> onnx.FunctionProto:
    """The model-local function ``ai.convpass.<annotated_op>``: the standard op, attributes by
    reference; ``X, W`` only for a bias-less op type."""
    op_type = ANNOTATED_OPS[annotated_op]
    standard = STANDARD_ATTRIBUTES[op_type]
    inputs = ["X", "W"] if annotated_op != op_type else ["X", "W", "B"]
    body = helper.make_node(op_type, inputs, ["Y"])
    for name, attr_type in standard.items():
        ref = onnx.AttributeProto()
        ref.name = name
        ref.ref_attr_name = name
        ref.type = attr_type  # type: ignore[assignment]
        body.attribute.append(ref)
    return helper.make_function(
        DOMAIN,
        annotated_op,
        inputs,
        ["Y"],
        [body],
        [helper.make_opsetid("", opset_version)],
        attributes=[*standard, *DECISION_ATTRIBUTES, *PRECISION_ATTRIBUTES, LEVEL_ATTRIBUTE],
        doc_string=f"convpass-tuned {op_type}: runs as the standard {op_type}; decisions are attributes.",
    )


def verify_functions(model: onnx.ModelProto, annotated: Sequence[onnx.NodeProto]) -> None:
    """Refuse a tuned model whose annotated convs would not run as the standard op they name: the
    model-local function of each used op type, where the model has it, must have the body
    :func:`conv_function` writes (the standard op, inputs and attributes passed through). ONNX
    Runtime runs the body, the executor the node's op: a body that differs (a Conv made a
    ConvTranspose) would make the two compute different things."""
    functions = {f.name: f for f in model.functions if f.domain == DOMAIN}
    for op_type in dict.fromkeys(n.op_type for n in annotated):
        f = functions.get(op_type)
        users = [n.name or n.output[0] for n in annotated if n.op_type == op_type]
        where = f"tuned conv {users[0]!r}" + (f" (and {len(users) - 1} more)" if len(users) > 1 else "")
        if f is None:
            continue  # ONNX Runtime cannot run the node at all (it has no op of that name): nothing to disagree with
        want = conv_function(op_type, 1)
        body = [(n.op_type, n.domain or "", list(n.input), list(n.output), sorted((a.name, a.ref_attr_name) for a in n.attribute)) for n in f.node]
        expected = [(n.op_type, "", list(n.input), list(n.output), sorted((a.name, a.ref_attr_name) for a in n.attribute)) for n in want.node]
        if body != expected or list(f.input) != list(want.input) or list(f.output) != list(want.output):
            runs = ", ".join(n.op_type for n in f.node) or "nothing"
            raise AnnotationError(f"{where}: its function {DOMAIN}.{op_type} does not run the standard {ANNOTATED_OPS[op_type]} "
                                  f"(its body runs {runs}): the tuned model was altered; re-run `convpass optimize` on the original model")


def standard_attributes(node: onnx.NodeProto) -> list[onnx.AttributeProto]:
    """The node's attributes less the decision attributes: what the standard op takes."""
    return [a for a in node.attribute if a.name not in DECISION_ATTRIBUTES and a.name not in PRECISION_ATTRIBUTES
            and a.name != LEVEL_ATTRIBUTE]


def standard_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a tuned model with every annotated conv back in the standard domain with its
    standard attributes: the model the graph passes collected the problems of."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in all_nodes(out.graph):
        if is_annotated_conv(node):
            keep = standard_attributes(node)
            del node.attribute[:]
            node.attribute.extend(keep)
            node.op_type = standard_op_type(node)
            node.domain = ""
    return out

"""Canonicalize every Conv / ConvTranspose into cuDNN problems.

Rules (per conv node and per shape profile; results in ``node.meta["convpass.canonical"]``):

* ``auto_pad`` becomes explicit pads: SAME_UPPER puts the odd extra pad at the end, SAME_LOWER at the
  beginning (with the dilated kernel extent), VALID is zero padding. The node's attributes are not
  changed: the canonical form is an analysis result, the ONNX semantics stay as written.
* Pads that differ between begin and end are split into a symmetric part that cuDNN takes and an
  explicit remainder (``extra_pads``): for Conv a zero pre-pad of the input (trimmed to what a
  window actually reads), for ConvTranspose a crop of the output.
* ConvTranspose is the backward-data pass of a forward conv from its output to its input:
  ``output_shape`` and ``output_padding`` are resolved to pads, and its problem has direction
  ``dgrad``, with ``c`` = its output channels and ``k`` = its input channels.
* 1-D convs map to two 2-D candidates, N x C x 1 x W and N x C x W x 1, both kept for measuring;
  3-D stays 3-D; groups (depthwise included) and dilations are preserved.
* Invalid attributes (negative pads, wrong lengths, stride or dilation < 1, values beyond cuDNN's
  int, kernel larger than the padded input, group not dividing channels, output_padding >= stride)
  and invalid operands (a weight or bias of another element type than the input, a bias that is
  not one value per output channel) raise ConvAttributeError naming the node. Valid convs that are no cuDNN problem (a ConvTranspose ``output_shape`` larger
  than its natural output, which ONNX fills with zeros) raise UnsupportedConvError in
  ``canonicalize_conv``; the pass marks those nodes ``convpass.skip`` with a warning instead.
"""

from __future__ import annotations

import logging
from typing import Any

import onnx_ir as ir

from convpass.compiler.passes import state
from convpass.compiler.passes.state import CANONICAL_KEY as META_KEY
from convpass.compiler.passes.state import SHAPES_KEY, SKIP_KEY, node_label
from convpass.core.errors import ConvAttributeError, UnsupportedConvError
from convpass.core.geometry import CONV_OPS, ConvGeometry, canonicalize_conv

logger = logging.getLogger("convpass")

__all__ = ["CONV_OPS", "META_KEY", "CanonicalizeConvsPass", "ConvGeometry", "canonicalize_conv", "node_label"]


def attribute_values(node: ir.Node) -> dict[str, Any]:
    return {name: attr.value for name, attr in node.attributes.items()}


class CanonicalizeConvsPass(ir.passes.InPlacePass):
    """Computes the canonical cuDNN form of every conv for every profile (see the module rules).

    Requires the shapes ``ResolveShapesPass`` resolves; ensures every tuned conv's canonical form
    per profile (:mod:`~convpass.compiler.passes.state`). Nodes marked to skip (``convpass.skip``
    in their meta, e.g. dynamic weights) are left alone. The graph is not modified.
    """

    def requires(self, model: ir.Model) -> None:
        state.require(self, model, state.SHAPES_RESOLVED)

    def ensures(self, model: ir.Model) -> None:
        state.ensure(self, model, state.CANONICAL)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        for node in ir.traversal.RecursiveGraphIterator(model.graph):  # bodies of If / Loop / Scan too
            if node.op_type not in CONV_OPS or node.domain not in ("", "ai.onnx") or SKIP_KEY in node.meta:
                continue
            attrs = attribute_values(node)
            try:
                node.meta[META_KEY] = tuple(
                    canonicalize_conv(node.op_type, attrs, x, w, dtype, node_label(node))
                    for x, w, dtype in node.meta[SHAPES_KEY]
                )
            except UnsupportedConvError as e:
                node.meta[SKIP_KEY] = str(e).split(": ", 1)[1]
                logger.warning("%s is left untuned: %s", node_label(node), node.meta[SKIP_KEY])
                continue
            check_operands(node, node.meta[META_KEY][0].output_shape[1])
        return ir.passes.PassResult(model, modified=False)


def _dtype(value: ir.Value | None) -> ir.DataType | None:
    if value is None:
        return None
    return value.const_value.dtype if value.const_value is not None else value.dtype


def _shape(value: ir.Value) -> tuple | None:
    shape = value.const_value.shape if value.const_value is not None else value.shape
    return None if shape is None else tuple(d if isinstance(d, int) else None for d in shape)


def check_operands(node: ir.Node, out_channels: int) -> None:
    """The operand rules ONNX states and shape inference does not enforce: the weight and bias of
    the input's element type, the bias a vector of one value per output channel."""
    x, w = node.inputs[0], node.inputs[1]
    b = node.inputs[2] if len(node.inputs) > 2 else None
    label = f"{node.op_type} {node_label(node)!r}"
    want = _dtype(x)
    for role, value in (("weight", w), ("bias", b)):
        got = _dtype(value)
        if value is not None and want is not None and got is not None and got != want:
            raise ConvAttributeError(f"{label}: its {role} {value.name!r} is {got.name.lower()}, its input {x.name!r} {want.name.lower()}: "
                                     "ONNX's Conv takes one element type")
    if b is not None:
        shape = _shape(b)
        if shape is not None and len(shape) != 1:
            raise ConvAttributeError(f"{label}: its bias {b.name!r} has shape {list(shape)}; it must be a vector of {out_channels} values")
        if shape is not None and shape[0] is not None and shape[0] != out_channels:
            raise ConvAttributeError(f"{label}: its bias {b.name!r} has {shape[0]} values for {out_channels} output channels")

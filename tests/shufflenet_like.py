"""A ShuffleNet V2 as ``torch.onnx.export`` writes torchvision's ``shufflenet_v2`` (opset 17, dynamic
batch, eval mode so BatchNormalization is folded into the convs), built with ``onnx.helper``.

What makes it hard for ONNX shape inference is reproduced node for node from the exporter:

* ``x.chunk(2, dim=1)`` (``prim::ConstantChunk``): Shape -> Gather -> Add -> Div -> Mul gives the
  Slice ends, so both Slice outputs -- and the branch convs reading them -- lose every dim.
* ``channel_shuffle``: ``x.size()`` as Shape -> Gather per dim, ``num_channels // groups`` as
  ``floor_divide`` on integers (Div plus the sign fix-up Less / Xor / Equal / Not / And / Cast / Sub),
  Unsqueeze + Concat into the shapes of ``view(b, groups, c // groups, h, w)`` and
  ``view(b, -1, h, w)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Builder:
    def __init__(self, seed: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self.counts: dict[str, int] = {}
        self._consts: dict[tuple, str] = {}

    def op(self, scope: str, op_type: str, inputs: Sequence[str], n_out: int = 1, **attrs) -> str | list[str]:
        i = self.counts.get((scope, op_type), 0)
        self.counts[(scope, op_type)] = i + 1
        name = f"{scope}/{op_type}" + (f"_{i}" if i else "")
        outs = [f"{name}_output_{k}" for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype=np.int64) -> str:
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            name = f"onnx::Constant_{len(self._consts)}"
            self.inits.append(numpy_helper.from_array(array, name))
            self._consts[key] = name
        return self._consts[key]

    def conv(self, scope: str, x: str, cin: int, cout: int, k: int, stride: int = 1, group: int = 1, relu: bool = False) -> str:
        w = (self.rng.standard_normal((cout, cin // group, k, k)) * np.sqrt(2.0 / (cin // group * k * k))).astype(np.float32)
        b = (self.rng.standard_normal(cout) * 0.1).astype(np.float32)
        wn, bn = f"{scope}.weight", f"{scope}.bias"
        self.inits += [numpy_helper.from_array(w, wn), numpy_helper.from_array(b, bn)]
        y = self.op(scope, "Conv", [x, wn, bn], kernel_shape=[k, k], pads=[k // 2] * 4, strides=[stride, stride], group=group, dilations=[1, 1])
        return self.op(scope, "Relu", [y]) if relu else y

    def dim(self, scope: str, x: str, index: int) -> str:
        """``x.size(index)`` as the exporter writes it: a scalar from Shape -> Gather."""
        return self.op(scope, "Gather", [self.op(scope, "Shape", [x]), self.const(index)], axis=0)

    def floor_divide(self, scope: str, a: str, b: int) -> str:
        div = self.op(scope, "Div", [a, self.const(b)])
        negative = self.op(scope, "Xor", [self.op(scope, "Less", [a, self.const(0)]), self.const(b < 0, np.bool_)])
        mod = self.op(scope, "Sub", [a, self.op(scope, "Mul", [div, self.const(b)])])
        fixup_mask = self.op(scope, "And", [negative, self.op(scope, "Not", [self.op(scope, "Equal", [mod, self.const(0)])])])
        fixup = self.op(scope, "Cast", [fixup_mask], to=TensorProto.INT64)
        return self.op(scope, "Sub", [div, self.op(scope, "Mul", [fixup, self.const(1)])])

    def shape_of(self, scope: str, dims: Sequence[str | int]) -> str:
        parts = [self.const([d]) if isinstance(d, int) else self.op(scope, "Unsqueeze", [d, self.const([0])]) for d in dims]
        return self.op(scope, "Concat", parts, axis=0)

    def channel_shuffle(self, scope: str, x: str, groups: int) -> str:
        b, c, h, w = (self.dim(scope, x, i) for i in range(4))
        per_group = self.floor_divide(scope, c, groups)
        x = self.op(scope, "Reshape", [x, self.shape_of(scope, [b, groups, per_group, h, w])])
        x = self.op(scope, "Transpose", [x], perm=[0, 2, 1, 3, 4])
        return self.op(scope, "Reshape", [x, self.shape_of(scope, [b, -1, h, w])])

    def chunk2(self, scope: str, x: str) -> tuple[str, str]:
        size = self.op(scope, "Gather", [self.op(scope, "Shape", [x]), self.const([1])], axis=0)
        chunk = self.op(scope, "Div", [self.op(scope, "Add", [size, self.const([1])]), self.const([2])])
        end0 = self.op(scope, "Mul", [chunk, self.const([1])])
        end1 = self.op(scope, "Mul", [chunk, self.const([2])])
        axis = self.const([1])
        return self.op(scope, "Slice", [x, self.const([0]), end0, axis]), self.op(scope, "Slice", [x, end0, end1, axis])

    def block(self, scope: str, x: str, cin: int, cout: int, stride: int) -> str:
        half = cout // 2
        if stride == 1:
            x1, x2 = self.chunk2(scope, x)
            branch_in = cin // 2
        else:
            x1 = self.conv(f"{scope}/branch1/branch1.0", x, cin, cin, 3, stride, group=cin)
            x1 = self.conv(f"{scope}/branch1/branch1.2", x1, cin, half, 1, relu=True)
            x2, branch_in = x, cin
        y = self.conv(f"{scope}/branch2/branch2.0", x2, branch_in, half, 1, relu=True)
        y = self.conv(f"{scope}/branch2/branch2.3", y, half, half, 3, stride, group=half)
        y = self.conv(f"{scope}/branch2/branch2.5", y, half, half, 1, relu=True)
        return self.channel_shuffle(scope, self.op(scope, "Concat", [x1, y], axis=1), 2)


def shufflenet_like(
    widths: Sequence[int] = (24, 116, 232, 464, 1024),
    repeats: Sequence[int] = (4, 8, 4),
    size: int = 224,
    classes: int = 1000,
    seed: int = 0,
) -> onnx.ModelProto:
    """``widths`` = stem, one per stage, last conv (torchvision's x1_0 by default); input
    ``input`` of shape ``batch x 3 x size x size``, output ``output`` of shape ``batch x classes``."""
    g = _Builder(seed)
    x = g.conv("/conv1/conv1.0", "input", 3, widths[0], 3, 2, relu=True)
    x = g.op("/maxpool", "MaxPool", [x], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2])
    cin = widths[0]
    for s, (cout, n) in enumerate(zip(widths[1:-1], repeats)):
        for i in range(n):
            x = g.block(f"/stage{s + 2}/stage{s + 2}.{i}", x, cin, cout, 2 if i == 0 else 1)
            cin = cout
    x = g.conv("/conv5/conv5.0", x, cin, widths[-1], 1, relu=True)
    x = g.op("", "ReduceMean", [x], axes=[2, 3], keepdims=0)
    fc_w = (g.rng.standard_normal((classes, widths[-1])) / np.sqrt(widths[-1])).astype(np.float32)
    g.inits += [numpy_helper.from_array(fc_w, "fc.weight"), numpy_helper.from_array(np.zeros(classes, np.float32), "fc.bias")]
    g.nodes.append(helper.make_node("Gemm", [x, "fc.weight", "fc.bias"], ["output"], name="/fc/Gemm", alpha=1.0, beta=1.0, transB=1))
    graph = helper.make_graph(
        g.nodes,
        "main_graph",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", classes])],
        g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8, producer_name="pytorch")
    onnx.checker.check_model(model, full_check=True)
    return model

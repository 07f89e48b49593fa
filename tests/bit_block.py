"""A BiT-like pre-activation bottleneck (timm's ``PreActBottleneck`` of ``resnetv2_50x1_bit``, made
small) for the tests of a residual Add absorbed by a conv without a bias (CPU and GPU):

    x -> GroupNorm -> Relu = p
    shortcut: x itself, or (``shortcut="conv"``) Conv 1x1 of p (the stage's downsample, no bias)
    p -> c1 (Conv 1x1, no bias) -> GroupNorm -> Relu -> c2 (Conv 3x3, no bias) -> Add(c2, shortcut) [-> Relu]

BiT's convs carry no bias (weight standardization, a GroupNorm after each); the block's output is
``c2 + shortcut`` (BiT's own blocks have no Relu after the Add; ``relu=True`` adds one, as a
post-activation block would). ``bias=True`` gives every conv a bias (the same step with one).
"""

from __future__ import annotations

import numpy as np
from fused_models import N, const, norm
from onnx import TensorProto, helper

GROUPS = 4


def bit_block(x_shape=(2, 8, 6, 6), out_channels: int | None = None, *, shortcut: str = "identity", relu: bool = True,
              bias: bool = False, seed: int = 0):
    """The block (module docstring) as an ONNX model of opset 21 with input ``x`` and output ``y``;
    ``out_channels`` (with ``shortcut="conv"``): the block's output channels."""
    rng = np.random.default_rng(seed)
    n, c, *spatial = x_shape
    k = c if out_channels is None else out_channels
    if k != c and shortcut != "conv":
        raise ValueError("an identity shortcut keeps the channel count")
    nodes, inits, p = norm("gn21", "n0", "x", c, GROUPS, rng)
    nodes.append(N("Relu", [p], ["p"], name="preact"))
    inits = list(inits)

    def conv(name, src, cin, cout, kernel):
        w = const(f"{name}_w", rng.standard_normal((cout, cin, kernel, kernel)) * (1.0 / np.sqrt(cin * kernel * kernel)))
        inputs = [src, w.name]
        inits.append(w)
        if bias:
            inits.append(const(f"{name}_b", rng.standard_normal(cout) * 0.1))
            inputs.append(f"{name}_b")
        nodes.append(N("Conv", inputs, [f"{name}_y"], name=name, pads=[kernel // 2] * 4))
        return f"{name}_y"

    s = conv("down", "p", c, k, 1) if shortcut == "conv" else "x"
    h = conv("c1", "p", c, c, 1)
    more, more_inits, h = norm("gn21", "n1", h, c, GROUPS, rng)
    nodes += more
    inits += more_inits
    nodes.append(N("Relu", [h], ["h"], name="act1"))
    y = conv("c2", "h", c, k, 3)
    nodes.append(N("Add", [y, s], ["sum" if relu else "y"], name="add"))
    if relu:
        nodes.append(N("Relu", ["sum"], ["y"], name="relu"))
    graph = helper.make_graph(nodes, "bit_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, k, *spatial])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def bit_input(x_shape, seed: int = 1) -> dict[str, np.ndarray]:
    """The block's feed: values of mean well away from zero (GroupNorm's variance must not cancel)."""
    return {"x": (np.random.default_rng(seed).standard_normal(x_shape) + 1.0).astype(np.float32)}

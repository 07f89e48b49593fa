#!/usr/bin/env python
"""Build the small sample ONNX models committed in ``models/``.

Only ``onnx`` and ``numpy`` are needed (no torch). Weights are random with a fixed seed
(``numpy.random.default_rng(0)``, one generator per model), so running this script twice
writes byte-identical files::

    python models/build_samples.py [--out models/]

All models use opset 17 and IR version 8 (ONNX Runtime 1.31 refuses IR 14, the default of
recent ``onnx.helper``). Each model exercises a different set of convolution variants; see
``models/README.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
SEED = 0
PRODUCER = "convpass.models.build_samples"


class GraphBuilder:
    """Tiny helper: named nodes, seeded initializers, unique value names."""

    def __init__(self, name: str, seed: int = SEED) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: List[onnx.NodeProto] = []
        self.initializers: List[onnx.TensorProto] = []
        self._names: set = set()

    # -- initializers -------------------------------------------------------------
    def const(self, name: str, array: np.ndarray) -> str:
        assert name not in self._names, name
        self._names.add(name)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def weight(self, name: str, shape: Sequence[int], fan_in: int) -> str:
        std = np.sqrt(2.0 / max(fan_in, 1))
        w = (self.rng.standard_normal(tuple(shape)) * std).astype(np.float32)
        return self.const(name, w)

    def bias(self, name: str, n: int) -> str:
        return self.const(name, (self.rng.standard_normal(n) * 0.05).astype(np.float32))

    # -- nodes --------------------------------------------------------------------
    def node(self, op: str, name: str, inputs: Sequence[str], n_out: int = 1,
             **attrs) -> str | List[str]:
        assert name not in self._names, name
        self._names.add(name)
        outputs = [name if n_out == 1 else f"{name}:{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, list(inputs), outputs, name=name, **attrs))
        return outputs[0] if n_out == 1 else outputs

    def conv(self, name: str, x: str, c_in: int, c_out: int, kernel: Sequence[int],
             group: int = 1, bias: bool = True, **attrs) -> str:
        kernel = list(kernel)
        fan_in = (c_in // group) * int(np.prod(kernel))
        w = self.weight(f"{name}.weight", [c_out, c_in // group] + kernel, fan_in)
        inputs = [x, w]
        if bias:
            inputs.append(self.bias(f"{name}.bias", c_out))
        if group != 1:
            attrs["group"] = group
        return self.node("Conv", name, inputs, kernel_shape=kernel, **attrs)

    def conv_transpose(self, name: str, x: str, c_in: int, c_out: int,
                       kernel: Sequence[int], **attrs) -> str:
        kernel = list(kernel)
        fan_in = c_in * int(np.prod(kernel))
        w = self.weight(f"{name}.weight", [c_in, c_out] + kernel, fan_in)
        b = self.bias(f"{name}.bias", c_out)
        return self.node("ConvTranspose", name, [x, w, b], kernel_shape=kernel, **attrs)

    def bn(self, name: str, x: str, c: int) -> str:
        r = self.rng
        scale = self.const(f"{name}.scale", (1.0 + 0.1 * r.standard_normal(c)).astype(np.float32))
        shift = self.const(f"{name}.shift", (0.1 * r.standard_normal(c)).astype(np.float32))
        mean = self.const(f"{name}.mean", (0.1 * r.standard_normal(c)).astype(np.float32))
        var = self.const(f"{name}.var", r.uniform(0.5, 1.5, c).astype(np.float32))
        return self.node("BatchNormalization", name, [x, scale, shift, mean, var], epsilon=1e-5)

    def relu(self, name: str, x: str) -> str:
        return self.node("Relu", name, [x])

    # -- model --------------------------------------------------------------------
    def model(self, inputs: List[onnx.ValueInfoProto], outputs: List[onnx.ValueInfoProto],
              doc: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, inputs, outputs,
                                  initializer=self.initializers, doc_string=doc)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  ir_version=IR_VERSION, producer_name=PRODUCER,
                                  producer_version="1", doc_string=doc)
        return model

    def output(self, value: str, new_name: str) -> str:
        """Rename the last node's output to the graph output name."""
        last = self.nodes[-1]
        assert list(last.output) == [value], (last.output, value)
        del last.output[:]
        last.output.append(new_name)
        return new_name


def _vi(name: str, shape: Sequence) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


# ---------------------------------------------------------------------------------------
# residual_cnn: ResNet-style 2-D CNN, static shapes
# ---------------------------------------------------------------------------------------
def build_residual_cnn() -> onnx.ModelProto:
    g = GraphBuilder("residual_cnn")
    x = "input"
    # stem: 3x64x64 -> 16x32x32 -> maxpool 16x16x16
    y = g.conv("stem/conv", x, 3, 16, [3, 3], strides=[2, 2], pads=[1, 1, 1, 1], bias=False)
    y = g.bn("stem/bn", y, 16)
    y = g.relu("stem/relu", y)
    y = g.node("MaxPool", "stem/maxpool", [y], kernel_shape=[3, 3], strides=[2, 2],
               pads=[1, 1, 1, 1])

    # block1: identity shortcut, 16 -> 16 at 16x16
    s = y
    y = g.conv("block1/conv1", s, 16, 16, [3, 3], pads=[1, 1, 1, 1], bias=False)
    y = g.bn("block1/bn1", y, 16)
    y = g.relu("block1/relu1", y)
    y = g.conv("block1/conv2", y, 16, 16, [3, 3], pads=[1, 1, 1, 1], bias=False)
    y = g.bn("block1/bn2", y, 16)
    y = g.node("Add", "block1/add", [y, s])
    y = g.relu("block1/relu2", y)

    # block2: stride-2 projection shortcut, 16 -> 32 at 8x8
    s = y
    y = g.conv("block2/conv1", s, 16, 32, [3, 3], strides=[2, 2], pads=[1, 1, 1, 1], bias=False)
    y = g.bn("block2/bn1", y, 32)
    y = g.relu("block2/relu1", y)
    y = g.conv("block2/conv2", y, 32, 32, [3, 3], pads=[1, 1, 1, 1], bias=False)
    y = g.bn("block2/bn2", y, 32)
    p = g.conv("block2/downsample/conv", s, 16, 32, [1, 1], strides=[2, 2], bias=False)
    p = g.bn("block2/downsample/bn", p, 32)
    y = g.node("Add", "block2/add", [y, p])
    y = g.relu("block2/relu2", y)

    # head
    y = g.node("GlobalAveragePool", "head/gap", [y])
    y = g.node("Flatten", "head/flatten", [y], axis=1)
    w = g.weight("head/fc.weight", [10, 32], 32)
    b = g.bias("head/fc.bias", 10)
    y = g.node("Gemm", "head/fc", [y, w, b], transB=1)
    g.output(y, "logits")
    doc = ("residual_cnn: small ResNet-style classifier. Stem Conv 3x3/s2 + BN + ReLU, "
           "MaxPool 3x3/s2, one basic block with identity shortcut and one with a stride-2 "
           "1x1 projection shortcut, GlobalAveragePool, Flatten, Gemm to 10 classes. "
           "Input 1x3x64x64, random weights (seed 0).")
    return g.model([_vi("input", [1, 3, 64, 64])], [_vi("logits", [1, 10])], doc)


# ---------------------------------------------------------------------------------------
# mobile_block: MobileNetV3 inverted residual with SE, symbolic batch
# ---------------------------------------------------------------------------------------
def build_mobile_block() -> onnx.ModelProto:
    g = GraphBuilder("mobile_block")
    c, e, sq = 16, 64, 16
    x = "input"
    # stem: 3 -> 16 channels so the block has a proper residual
    y = g.conv("stem/conv", x, 3, c, [3, 3], pads=[1, 1, 1, 1])
    y = g.node("HardSwish", "stem/hardswish", [y])
    s = y
    lo = g.const("block/relu6.min", np.array(0.0, dtype=np.float32))
    hi = g.const("block/relu6.max", np.array(6.0, dtype=np.float32))
    # expand 1x1 + ReLU6
    y = g.conv("block/expand/conv", s, c, e, [1, 1])
    y = g.node("Clip", "block/expand/relu6", [y, lo, hi])
    # depthwise 3x3 + HardSwish
    y = g.conv("block/depthwise/conv", y, e, e, [3, 3], group=e, pads=[1, 1, 1, 1])
    y = g.node("HardSwish", "block/depthwise/hardswish", [y])
    # squeeze-excitation
    t = g.node("GlobalAveragePool", "block/se/gap", [y])
    t = g.conv("block/se/fc1", t, e, sq, [1, 1])
    t = g.relu("block/se/relu", t)
    t = g.conv("block/se/fc2", t, sq, e, [1, 1])
    t = g.node("HardSigmoid", "block/se/hardsigmoid", [t], alpha=1.0 / 6.0, beta=0.5)
    y = g.node("Mul", "block/se/scale", [y, t])
    # project 1x1 (linear) + residual
    y = g.conv("block/project/conv", y, e, c, [1, 1])
    y = g.node("Add", "block/add", [y, s])
    g.output(y, "output")
    doc = ("mobile_block: MobileNetV3-style inverted residual with symbolic batch 'batch' "
           "(use --shape to fix it). Stem Conv 3x3 + HardSwish, pointwise expand 16->64 + "
           "ReLU6 (Clip), depthwise Conv 3x3 (group=64) + HardSwish, squeeze-excitation "
           "(GlobalAveragePool, 1x1 Conv, ReLU, 1x1 Conv, HardSigmoid, Mul), pointwise project "
           "64->16, residual Add. Input batchx3x32x32, random weights (seed 0).")
    return g.model([_vi("input", ["batch", 3, 32, 32])],
                   [_vi("output", ["batch", c, 32, 32])], doc)


# ---------------------------------------------------------------------------------------
# audio_frontend_1d: 1-D convolutions over a waveform
# ---------------------------------------------------------------------------------------
def build_audio_frontend_1d() -> onnx.ModelProto:
    g = GraphBuilder("audio_frontend_1d")
    x = "audio"
    # 1x4000 -> 16x800
    y = g.conv("frontend/conv1", x, 1, 16, [11], strides=[5], pads=[5, 5])
    y = g.relu("frontend/relu1", y)
    # dilated: 16x800 -> 32x800
    y = g.conv("frontend/conv2_dilated", y, 16, 32, [3], dilations=[2], pads=[2, 2])
    y = g.relu("frontend/relu2", y)
    # asymmetric pads, even kernel: 32x800 -> 32x800
    y = g.conv("frontend/conv3_asym", y, 32, 32, [4], pads=[1, 2])
    y = g.relu("frontend/relu3", y)
    # depthwise with auto_pad SAME_UPPER: 32x800 -> 32x800
    y = g.conv("frontend/conv4_depthwise", y, 32, 32, [5], group=32, auto_pad="SAME_UPPER")
    y = g.node("ReduceMean", "frontend/mean_time", [y], axes=[2], keepdims=0)
    g.output(y, "features")
    doc = ("audio_frontend_1d: 1-D convolutional audio front end. Conv1d k=11 s=5 pads 5,5 + "
           "ReLU, Conv1d k=3 dilation 2 pads 2,2 + ReLU, Conv1d k=4 asymmetric pads 1,2 + ReLU, "
           "depthwise Conv1d k=5 (group=32) auto_pad SAME_UPPER, ReduceMean over time. "
           "Input 1x1x4000, output 1x32, random weights (seed 0).")
    return g.model([_vi("audio", [1, 1, 4000])], [_vi("features", [1, 32])], doc)


# ---------------------------------------------------------------------------------------
# video_block_3d: 3-D convolutions over a clip
# ---------------------------------------------------------------------------------------
def build_video_block_3d() -> onnx.ModelProto:
    g = GraphBuilder("video_block_3d")
    x = "clip"
    # 3x8x32x32 -> 16x8x32x32
    y = g.conv("stem/conv", x, 3, 16, [3, 3, 3], pads=[1, 1, 1, 1, 1, 1], bias=False)
    y = g.bn("stem/bn", y, 16)
    y = g.relu("stem/relu", y)
    # spatial-only (1,3,3) stride (1,2,2): -> 32x8x16x16
    y = g.conv("block/conv_spatial", y, 16, 32, [1, 3, 3], strides=[1, 2, 2],
               pads=[0, 1, 1, 0, 1, 1])
    y = g.relu("block/relu1", y)
    # grouped 3x3x3, group=2: -> 32x8x16x16
    y = g.conv("block/conv_grouped", y, 32, 32, [3, 3, 3], group=2, pads=[1, 1, 1, 1, 1, 1])
    y = g.relu("block/relu2", y)
    # -> 32x4x8x8
    y = g.node("MaxPool", "block/maxpool", [y], kernel_shape=[2, 2, 2], strides=[2, 2, 2])
    y = g.node("GlobalAveragePool", "head/gap", [y])
    y = g.node("Flatten", "head/flatten", [y], axis=1)
    g.output(y, "embedding")
    doc = ("video_block_3d: 3-D convolutional clip encoder. Conv3d 3x3x3 pads 1 + BN + ReLU, "
           "Conv3d (1,3,3) stride (1,2,2) + ReLU, grouped Conv3d 3x3x3 (group=2) + ReLU, "
           "MaxPool 2x2x2, GlobalAveragePool, Flatten. Input 1x3x8x32x32, output 1x32, "
           "random weights (seed 0).")
    return g.model([_vi("clip", [1, 3, 8, 32, 32])], [_vi("embedding", [1, 32])], doc)


# ---------------------------------------------------------------------------------------
# encoder_decoder: strided convs down, transposed convs up, skip connections
# ---------------------------------------------------------------------------------------
def build_encoder_decoder() -> onnx.ModelProto:
    g = GraphBuilder("encoder_decoder")
    x = "image"
    # encoder: 3x32x32 -> 16x16x16 -> 32x8x8
    e1 = g.conv("encoder/conv1", x, 3, 16, [3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    e1 = g.relu("encoder/relu1", e1)
    e2 = g.conv("encoder/conv2", e1, 16, 32, [3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    e2 = g.relu("encoder/relu2", e2)
    # decoder up 1: ConvTranspose k4 s2 pads 1 -> 32x16x16
    d = g.conv_transpose("decoder/up1", e2, 32, 32, [4, 4], strides=[2, 2], pads=[1, 1, 1, 1])
    d = g.relu("decoder/relu1", d)
    # skips: encoder feature e1 (16x16) and e2 upsampled by nearest Resize x2 (16x16)
    scales = g.const("skip/resize.scales", np.array([1.0, 1.0, 2.0, 2.0], dtype=np.float32))
    r = g.node("Resize", "skip/resize_e2", [e2, "", scales], mode="nearest")
    d = g.node("Concat", "skip/concat", [d, e1, r], axis=1)  # 32 + 16 + 32 = 80 channels
    d = g.conv("skip/fuse", d, 80, 32, [1, 1])
    d = g.relu("skip/relu", d)
    # decoder up 2: ConvTranspose k3 s2 pads 1 output_padding 1 -> 16x32x32
    d = g.conv_transpose("decoder/up2", d, 32, 16, [3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                         output_padding=[1, 1])
    d = g.relu("decoder/relu2", d)
    # head: ConvTranspose k3 s1 with output_shape (implied pads 1,1) -> 3x32x32
    d = g.conv_transpose("decoder/head", d, 16, 3, [3, 3], strides=[1, 1],
                         output_shape=[32, 32])
    d = g.node("Sigmoid", "decoder/sigmoid", [d])
    g.output(d, "reconstruction")
    doc = ("encoder_decoder: small convolutional autoencoder. Encoder Conv 3x3/s2 + ReLU twice; "
           "decoder ConvTranspose k4 s2 pads 1 + ReLU, skip Concat of the decoder feature with "
           "encoder feature 1 and encoder feature 2 upsampled by Resize (nearest, x2), 1x1 Conv "
           "+ ReLU, ConvTranspose k3 s2 pads 1 output_padding 1 + ReLU, ConvTranspose k3 s1 "
           "with output_shape 32x32, Sigmoid. Input 1x3x32x32, random weights (seed 0).")
    return g.model([_vi("image", [1, 3, 32, 32])], [_vi("reconstruction", [1, 3, 32, 32])], doc)


BUILDERS: Dict[str, Callable[[], onnx.ModelProto]] = {
    "residual_cnn": build_residual_cnn,
    "mobile_block": build_mobile_block,
    "audio_frontend_1d": build_audio_frontend_1d,
    "video_block_3d": build_video_block_3d,
    "encoder_decoder": build_encoder_decoder,
}


def build_all(out_dir: str, names: Optional[Sequence[str]] = None,
              check: bool = True) -> Dict[str, str]:
    """Build the sample models into ``out_dir``; return {name: path}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for name in names or BUILDERS:
        model = BUILDERS[name]()
        if check:
            onnx.checker.check_model(model, full_check=True)
        path = os.path.join(out_dir, f"{name}.onnx")
        data = model.SerializeToString(deterministic=True)
        with open(path, "wb") as f:
            f.write(data)
        paths[name] = path
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)),
                    help="output folder (default: the folder of this script)")
    ap.add_argument("--models", default=None,
                    help="comma-separated subset of: " + ",".join(BUILDERS))
    args = ap.parse_args(argv)
    names = args.models.split(",") if args.models else None
    if names:
        unknown = [n for n in names if n not in BUILDERS]
        if unknown:
            ap.error(f"unknown model(s): {', '.join(unknown)}")
    for name, path in build_all(args.out, names).items():
        print(f"{name}: {path} ({os.path.getsize(path)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

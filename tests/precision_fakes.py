"""Helpers of the precision tests.

* Synthetic tuning caches: every problem of a model timed at every data type, math mode and
  layout by a simple rate model, so that the real cache backend decides from them on a machine
  without a GPU. The rates are made up (a test double, not a measurement): FMA float32 20
  TFLOP/s, TF32 60, float16 150, plus 5 us per conv; a transpose or cast moves its bytes at
  2 TB/s plus 2 us.
* :func:`residual_model`: a ResNet-style stage at real sizes (64 channels at 56x56, symbolic
  batch), large enough that float16 pays for its casts on a GPU (the GPU tests' model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from convpass.compiler.passes.resolve_shapes import VALUE_SHAPES_KEY
from convpass.core.device import DeviceFingerprint
from convpass.core.problem import ConvProblem, ConvShape
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement

DEVICE = DeviceFingerprint("NVIDIA Synthetic GPU", "9.0", 132, 91900)
RATES = {("float32", "fma"): 20e12, ("float32", "default"): 60e12, ("float16", "default"): 150e12,
         ("bfloat16", "default"): 150e12}


def conv_ms(shape: ConvShape, math: str, rates: Mapping[tuple[str, str], float] = RATES) -> float:
    return 0.005 + shape.flops / rates[(shape.dtype, math)] * 1e3


def copy_ms(dims: Sequence[int], itemsize: int) -> float:
    n = 1
    for d in dims:
        n *= int(d)
    return 0.002 + 2 * n * itemsize / 2e12 * 1e3


# the algorithms of every problem, each a factor on the rate model's time
GEMM_ONLY = {"implicit_gemm": 1.0}
# a transform algorithm faster than the GEMM-based one (as Winograd is on 3x3 convs)
WITH_TRANSFORMS = {"implicit_gemm": 1.0, "winograd_nonfused": 0.5, "fft_tiling": 0.7}


def rows_for(problem: ConvProblem, rates: Mapping[tuple[str, str], float] = RATES, dtypes=("float32", "float16"),
             algos: Mapping[str, float] = GEMM_ONLY) -> list[Measurement]:
    out = []
    for shape in problem.candidates:
        for dtype in dtypes:
            s = dataclasses.replace(shape, dtype=dtype)
            for layout in ("nchw", "nhwc"):
                for math in ("default", "fma") if dtype == "float32" else ("default",):
                    t = conv_ms(s, math, rates) * (1.0 if layout == "nchw" else 1.05)
                    out += [Measurement(s.key(layout, math), algo, "ok", t * f, 0, True, 1.0, "measure") for algo, f in algos.items()]
    return out


def synthetic_cache(path: Path, model: onnx.ModelProto, shapes: Sequence[str] = (), rates=RATES,
                    dtypes: Sequence[str] = ("float32", "float16"),
                    algos: Callable[[ConvProblem], Mapping[str, float]] = lambda problem: GEMM_ONLY) -> TuningCache:
    """A tuning cache at ``path`` holding rows for every problem of ``model`` (float32 and float16;
    the algorithms ``algos`` names for it) and transpose times for every tensor shape of it."""
    from convpass.compiler.pipeline import OptimizeReport, build_options, prepare_model
    from convpass.core.model_io import load_model

    work = load_model(model)
    uses = prepare_model(work, build_options({}), shapes, OptimizeReport())
    cache = TuningCache(path)
    for problem in uses:
        cache.put(DEVICE, rows_for(problem, rates, dtypes, algos(problem)))
    seen = set()
    for profile in work.meta.get(VALUE_SHAPES_KEY, []):
        for dims in profile.values():
            if dims and all(isinstance(d, int) for d in dims) and 3 <= len(dims) <= 5 and tuple(dims) not in seen:
                seen.add(tuple(dims))
                for dtype, size in (("float32", 4), ("float16", 2)):
                    cache.put_transpose(DEVICE, tuple(dims), dtype, copy_ms(dims, size))
    return cache


def residual_model(channels: int = 64, size: int = 56, blocks: int = 3, classes: int = 100, seed: int = 0) -> onnx.ModelProto:
    """input [batch, channels, size, size] -> ``blocks`` residual blocks (conv3x3 + BN + ReLU, conv3x3
    + BN, Add, ReLU), a strided 1x1 conv to 2x channels, GlobalAveragePool, Flatten, Gemm -> output
    [batch, classes]. He-initialized random weights; BatchNormalization with random statistics."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def tensor(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array, np.float32), name))
        return name

    def conv_bn(name, x, c, k, kernel, stride=1):
        w = tensor(f"{name}.w", rng.standard_normal((k, c, kernel, kernel)) * np.sqrt(2.0 / (c * kernel * kernel)))
        nodes.append(helper.make_node("Conv", [x, w], [f"{name}.c"], name=name, kernel_shape=[kernel, kernel],
                                      pads=[kernel // 2] * 4, strides=[stride, stride]))
        bn = [tensor(f"{name}.{p}", v) for p, v in (("scale", rng.uniform(0.5, 1.0, k)), ("bias", rng.normal(0, 0.1, k)),
                                                   ("mean", rng.normal(0, 0.1, k)), ("var", rng.uniform(0.5, 1.5, k)))]
        nodes.append(helper.make_node("BatchNormalization", [f"{name}.c", *bn], [f"{name}.bn"], name=f"{name}/bn"))
        return f"{name}.bn"

    x = "input"
    for b in range(blocks):
        h = conv_bn(f"block{b}/conv1", x, channels, channels, 3)
        nodes.append(helper.make_node("Relu", [h], [f"block{b}.r1"], name=f"block{b}/relu1"))
        h = conv_bn(f"block{b}/conv2", f"block{b}.r1", channels, channels, 3)
        nodes.append(helper.make_node("Add", [h, x], [f"block{b}.add"], name=f"block{b}/add"))
        nodes.append(helper.make_node("Relu", [f"block{b}.add"], [f"block{b}.out"], name=f"block{b}/relu2"))
        x = f"block{b}.out"
    h = conv_bn("down", x, channels, 2 * channels, 1, stride=2)
    nodes += [helper.make_node("Relu", [h], ["down.r"], name="down/relu"),
              helper.make_node("GlobalAveragePool", ["down.r"], ["gap"], name="gap"),
              helper.make_node("Flatten", ["gap"], ["flat"], name="flatten")]
    fc_w = tensor("fc.w", rng.standard_normal((classes, 2 * channels)) / np.sqrt(2 * channels))
    fc_b = tensor("fc.b", np.zeros(classes))
    nodes.append(helper.make_node("Gemm", ["flat", fc_w, fc_b], ["output"], name="fc", transB=1))
    graph = helper.make_graph(nodes, "residual_stage",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", channels, size, size])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", classes])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

"""Recorded GPU measurements as tuning-cache rows, and small models whose convolutions are exactly
the recorded problems: what the CPU tests of the fleet (and of schema compatibility) measure with.

Source: ``benchmarks/results/tune-quality-h200-2026-11-22-*.json``, written by
``benchmarks/tune_quality.py`` on an NVIDIA H200 (cuDNN 9.19.0). For every problem of resnet50,
mobilenet_v3_large and efficientnet_b0 at batch 1 and 32 it holds two independent runs of the
tuner on that GPU:

* the **tuning run**: the configuration convpass chose and its time (``chosen_ms_tuning_run``);
* the **oracle run**, a fresh measurement of every candidate: the fastest configuration
  (``oracle_ms``) and the time of the tuning run's choice on that clock (``chosen_ms_oracle_run``).

Each run becomes a list of ``measure`` rows with the recorded configuration, algorithm and time.
Nothing is invented: what the files do not hold is said in each row's note (the workspace size,
recorded as 0 because the results do not carry it; the time of day, taken as the run's date).
Problems measured in two models' runs (mobilenet and efficientnet share 18) keep the first run's
rows in file order.
"""

from __future__ import annotations

import calendar
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from convpass.core.cudnn_enums import is_deterministic
from convpass.core.device import DeviceFingerprint
from convpass.core.problem import ConvShape, ProblemKey
from convpass.tuning.cache_rows import Measurement

REPO = Path(__file__).resolve().parent.parent
RESULTS = sorted((REPO / "benchmarks" / "results").glob("tune-quality-h200-2026-11-22-*.json"))
MEASURED_AT = float(calendar.timegm((2026, 11, 22, 0, 0, 0)))

# The GPU the results were measured on (their "device" field).
H200 = DeviceFingerprint.parse("NVIDIA H200|sm_9.0|132sm|cudnn91900")
# The tuning run's rows under a fingerprint of their own, where a test needs two devices' tables that
# differ: both runs are the H200's, and this name says so; no other GPU was measured.
H200_TUNING_RUN = DeviceFingerprint("NVIDIA H200 (2026-11-22 tuning run)", "9.0", 132, 91900)


def _config(text: str, shape: ConvShape) -> tuple[ProblemKey, str]:
    layout, math, algo = text.split("/")
    return shape.key(layout, math), algo  # type: ignore[arg-type]


def _row(key: ProblemKey, algo: str, time_ms: float, run: str, source: str) -> Measurement:
    return Measurement(
        key=key,
        algo=algo,
        status="ok",
        time_ms=time_ms,
        workspace_bytes=0,
        deterministic=is_deterministic(key.shape.direction, algo),
        measured_at=MEASURED_AT,
        method="measure",
        note=f"recorded {run} run ({source}); workspace not recorded",
    )


def recorded_rows(run: str) -> dict[ConvShape, list[Measurement]]:
    """The ``tuning`` or ``oracle`` run's rows by problem geometry (see the module docstring)."""
    if run not in ("tuning", "oracle"):
        raise ValueError(f"run must be 'tuning' or 'oracle', not {run!r}")
    out: dict[ConvShape, list[Measurement]] = {}
    for path in RESULTS:
        for result in json.loads(path.read_text()):
            for shape_text, d in result["detail"].items():
                shape = ProblemKey.parse(f"{shape_text}|nchw|default").shape
                if shape in out:
                    continue
                chosen_key, chosen_algo = _config(d["chosen"], shape)
                if run == "tuning":
                    out[shape] = [_row(chosen_key, chosen_algo, d["chosen_ms_tuning_run"], run, path.name)]
                    continue
                rows = [_row(chosen_key, chosen_algo, d["chosen_ms_oracle_run"], run, path.name)]
                best_key, best_algo = _config(d["oracle"], shape)
                if (best_key, best_algo) != (chosen_key, chosen_algo):
                    rows.append(_row(best_key, best_algo, d["oracle_ms"], run, path.name))
                out[shape] = rows
    return out


# ----------------------------------------------------------------------------------------------
# models whose convolutions are recorded problems (ResNet-50 and MobileNet-v3 / EfficientNet layers)


def _conv(name: str, x: str, y: str, c: int, k: int, kernel: int, stride: int = 1, group: int = 1, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((k, c // group, kernel, kernel)).astype(np.float32) * 0.05
    pad = kernel // 2
    node = helper.make_node("Conv", [x, f"{name}.w"], [y], name=name, kernel_shape=[kernel, kernel],
                            strides=[stride, stride], pads=[pad] * 4, group=group)
    return node, numpy_helper.from_array(w, f"{name}.w")


def _model(name: str, channels: int, size: int, layers: Sequence[tuple]) -> onnx.ModelProto:
    """A chain of Conv (+ Relu) layers on a ``batch x channels x size x size`` input.

    ``layers``: (c, k, kernel, stride, group) per conv, or ``"maxpool"`` (3x3, stride 2, pad 1).
    """
    nodes, inits, x = [], [], "input"
    for i, layer in enumerate(layers):
        if layer == "maxpool":
            nodes.append(helper.make_node("MaxPool", [x], [f"p{i}"], name=f"pool{i}", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4))
            x = f"p{i}"
            continue
        c, k, kernel, stride, group = layer
        node, w = _conv(f"conv{i}", x, f"c{i}", c, k, kernel, stride, group, seed=i)
        nodes += [node, helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        inits.append(w)
        x = f"r{i}"
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", channels, size, size])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    graph.output[0].type.CopyFrom(onnx.shape_inference.infer_shapes(model).graph.output[0].type)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def resnet_stem() -> onnx.ModelProto:
    """ResNet-50's stem and the first bottleneck's convs: 4 recorded problems per batch size."""
    return _model("resnet_stem", 3, 224, [(3, 64, 7, 2, 1), "maxpool", (64, 64, 1, 1, 1), (64, 64, 3, 1, 1), (64, 256, 1, 1, 1)])


def resnet_block() -> onnx.ModelProto:
    """A ResNet-50 layer-1 bottleneck on 56x56: 3 of its 4 problems are ``resnet_stem``'s too."""
    return _model("resnet_block", 64, 56, [(64, 64, 1, 1, 1), (64, 64, 3, 1, 1), (64, 256, 1, 1, 1), (256, 64, 1, 1, 1)])


def inverted_residual() -> onnx.ModelProto:
    """Expand 1x1, depthwise 3x3 stride 2, project 1x1: layers MobileNet-v3 and EfficientNet share."""
    return _model("inverted_residual", 40, 28, [(40, 240, 1, 1, 1), (240, 240, 3, 2, 240), (240, 80, 1, 1, 1)])


def resnet_unrecorded() -> onnx.ModelProto:
    """ResNet-50's stem followed by a conv no recorded run measured (64 -> 48 channels)."""
    return _model("resnet_unrecorded", 3, 224, [(3, 64, 7, 2, 1), "maxpool", (64, 48, 1, 1, 1)])


def save(model: onnx.ModelProto, folder: Path, name: str) -> Path:
    path = folder / f"{name}.onnx"
    onnx.save(model, path)
    return path

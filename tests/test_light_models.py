"""The model-zoo exports ``onnx`` ships in light form (opset 9 or so, IR version 3, every weight made
by a ConstantOfShape node) optimize on CPU, stay valid, and run with ONNX Runtime CPU's results on
the CPU executor.

Their weights are one constant each (0.02): every classifier output is the same number (softmax of
equal logits, 0.001), so comparing the outputs alone proves little. Each model is therefore also
compared at its last feature map before the classifier (an extra graph output), whose values vary
with the input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import random_input, run_ort

import convpass

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
MODELS = sorted(LIGHT.glob("light_*.onnx"))


def _feature_map(model: onnx.ModelProto) -> onnx.ValueInfoProto:
    """The last 4-D output with more than one spatial position of a node that is not a conv or a
    BatchNormalization (so tapping it keeps the executor's conv + BN folding intact)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    infos = {vi.name: vi for vi in inferred.graph.value_info}
    tap = None
    for node in model.graph.node:
        vi = infos.get(node.output[0])
        if node.op_type in ("Conv", "BatchNormalization") or vi is None:
            continue
        dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if len(dims) == 4 and dims[2] * dims[3] > 1:
            tap = vi
    assert tap is not None
    return tap


def _with_output(model: onnx.ModelProto, value: onnx.ValueInfoProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.output.append(value)
    return out


def test_every_light_model_is_here():
    assert [p.stem for p in MODELS] == [
        "light_bvlc_alexnet", "light_densenet121", "light_inception_v1", "light_inception_v2", "light_resnet50",
        "light_shufflenet", "light_squeezenet", "light_vgg19", "light_zfnet512",
    ]


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem.removeprefix("light_"))
def test_light_model_optimizes_and_matches_onnxruntime(path, tmp_path, capsys):
    original = onnx.load(path)
    assert original.ir_version == 3
    out = tmp_path / "tuned.onnx"
    convpass.optimize(path, out)
    assert "on the CPU" not in capsys.readouterr().err, "ONNX shape inference resolves every conv (IR 3 regression)"
    tuned = onnx.load(out)  # the written model, not the one in memory
    onnx.checker.check_model(tuned, full_check=True)
    convs = [n for n in original.graph.node if n.op_type == "Conv"]
    records = convpass.inspect(tuned)
    assert len({r["node"] for r in records}) == len(convs)
    assert all(r["algo"] == "auto" for r in records), "no GPU: every decision is left to run time"

    initializers = {t.name for t in original.graph.initializer}
    (data,) = [i for i in original.graph.input if i.name not in initializers]
    feeds = {data.name: random_input([d.dim_value for d in data.type.tensor_type.shape.dim])}
    tap = _feature_map(original)
    want = run_ort(_with_output(original, tap), feeds)
    assert np.unique(want[-1]).size > 10, "the feature map varies with the input (over positions; its channels are equal)"
    assert np.unique(want[0]).size == 1, "the classifier output is degenerate (constant weights)"

    got_ort = run_ort(_with_output(tuned, tap), feeds)
    got_cpu = convpass.Executor(_with_output(tuned, tap), device="cpu").run(None, feeds)
    for w, o, c in zip(want, got_ort, got_cpu):
        # fp32 sums in another order (ONNX Runtime fuses the function-wrapped convs differently)
        atol = 1e-6 * float(np.abs(w).max())
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=atol)
        np.testing.assert_allclose(c, w, rtol=1e-5, atol=atol)

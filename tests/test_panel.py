"""The benchmark panel on CPU: every model optimizes (batch 1 and batch 32 profiles) to a valid tuned
model that ONNX Runtime runs unchanged, and the CPU executor matches ONNX Runtime. Needs the exported
panel (torch is not a CI dependency): ``python models/export_panel.py --out DIR`` where torch,
torchvision, timm and torchaudio are installed, then ``CONVPASS_PANEL=DIR python -m pytest
tests/test_panel.py``. Skipped without it; a model missing from DIR is skipped with the command that
exports it. The model list is ``export_panel.PANEL``; ``models/check_panel_cpu.py`` runs the same
checks as a report (timings, op histograms)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest

import convpass
from conftest import panel_models, run_ort

PANEL = Path(os.environ.get("CONVPASS_PANEL", "")) if os.environ.get("CONVPASS_PANEL") else None
MODELS = panel_models()


def test_panel_is_wide():
    """Issue 9: at least 20 architectures, the first eight kept."""
    assert len(MODELS) >= 20 and len(set(MODELS)) == len(MODELS)
    assert MODELS[:8] == ["resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "r3d_18",
                          "fcn_resnet50", "deeplabv3_mobilenet_v3_large", "dcgan_generator"]


def test_pin_output_dims(tmp_path):
    """Symbolic non-batch output dims left by the exporter become the sizes torch produced; the
    batch dim is named ``batch``."""
    from onnx import TensorProto, helper

    from convpass.bench.contenders import load_export_panel

    graph = helper.make_graph(
        [helper.make_node("Identity", ["input"], ["output"])], "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 2, 8])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["Identityoutput_dim_0", 2, "Reshapeoutput_dim_2"])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), path)
    load_export_panel()._pin_output_dims(str(path), [1, 2, 8])
    dims = onnx.load(path).graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", 2, 8]


@pytest.mark.skipif(PANEL is None, reason="set CONVPASS_PANEL to an exported panel directory")
@pytest.mark.parametrize("name", MODELS)
def test_panel_model_on_cpu(name):
    path = PANEL / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} not exported (python models/export_panel.py --out {PANEL} --models {name})")
    model = onnx.load(path, load_external_data=False)
    inp = model.graph.input[0]
    dims = [d.dim_value if d.HasField("dim_value") else 1 for d in inp.type.tensor_type.shape.dim]
    x = np.random.default_rng(0).standard_normal(dims).astype(np.float32)
    profiles = [f"{inp.name}={'x'.join(map(str, [batch, *dims[1:]]))}" for batch in (1, 32)]
    tuned = convpass.optimize(path, shapes=profiles, quiet=True)
    onnx.checker.check_model(tuned, full_check=True)
    reference = run_ort(onnx.load(path), {inp.name: x})
    for want, got in zip(reference, run_ort(tuned, {inp.name: x})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    convs = [n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")]
    assert len(convpass.inspect(tuned)) == len(convs) * len(profiles)
    for want, got in zip(reference, convpass.Executor(tuned, device="cpu").run(None, {inp.name: x})):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4

"""The torchvision panel on CPU: every model optimizes to a valid tuned model that ONNX Runtime runs
unchanged, and the CPU executor matches ONNX Runtime. Needs the exported panel (torch is not a CI
dependency): ``python models/export_panel.py --out DIR`` where torch + torchvision are installed,
then ``CONVPASS_PANEL=DIR python -m pytest tests/test_panel.py``. Skipped without it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest

import convpass
from conftest import run_ort

PANEL = Path(os.environ.get("CONVPASS_PANEL", "")) if os.environ.get("CONVPASS_PANEL") else None
MODELS = ["resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "r3d_18", "fcn_resnet50",
          "deeplabv3_mobilenet_v3_large", "dcgan_generator"]


@pytest.mark.skipif(PANEL is None, reason="set CONVPASS_PANEL to an exported panel directory")
@pytest.mark.parametrize("name", MODELS)
def test_panel_model_on_cpu(name):
    path = PANEL / f"{name}.onnx"
    model = onnx.load(path, load_external_data=False)
    inp = model.graph.input[0]
    dims = [d.dim_value if d.HasField("dim_value") else 1 for d in inp.type.tensor_type.shape.dim]
    x = np.random.default_rng(0).standard_normal(dims).astype(np.float32)
    tuned = convpass.optimize(path, shapes=[f"{inp.name}={'x'.join(map(str, dims))}"], quiet=True)
    onnx.checker.check_model(tuned, full_check=True)
    reference = run_ort(onnx.load(path), {inp.name: x})
    for want, got in zip(reference, run_ort(tuned, {inp.name: x})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    convs = [n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")]
    assert len(convpass.inspect(tuned)) == len(convs)
    for want, got in zip(reference, convpass.Executor(tuned, device="cpu").run(None, {inp.name: x})):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5

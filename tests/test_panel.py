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
from conftest import as_float32, panel_models, run_ort
from onnx import TensorProto, helper, numpy_helper

import convpass

PANEL = Path(os.environ.get("CONVPASS_PANEL", "")) if os.environ.get("CONVPASS_PANEL") else None
MODELS = panel_models()


def test_a_float16_model_widened_to_float32_computes_with_its_own_weights():
    """The GPU panel tests' float16 reference (conftest.as_float32): weights, constants, Casts and
    the interface widened exactly; ONNX Runtime CPU runs it."""
    w = np.array([[[[0.1, -1 / 3], [2.5, 1e-3]]]], np.float16)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["y"], name="conv"),
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array([1 / 3], np.float16), "c")),
        helper.make_node("Add", ["y", "c"], ["s"]),
        helper.make_node("Cast", ["s"], ["h"], to=TensorProto.FLOAT16),
        helper.make_node("Relu", ["h"], ["out"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 1, 3, 3])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT16, [1, 1, 2, 2])],
                              [numpy_helper.from_array(w, "w")],
                              value_info=[helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 1, 2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    wide = as_float32(model)
    onnx.checker.check_model(wide, full_check=True)
    assert numpy_helper.to_array(wide.graph.initializer[0]).dtype == np.float32
    assert (numpy_helper.to_array(wide.graph.initializer[0]) == w.astype(np.float32)).all()
    assert model.graph.initializer[0].data_type == TensorProto.FLOAT16  # the original is untouched
    x = np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3) - 4
    [got] = run_ort(wide, {"x": x})
    wf, cf = w.astype(np.float64)[0, 0], float(np.float16(1 / 3))
    want = np.array([[(x[0, 0, i:i + 2, j:j + 2] * wf).sum() for j in range(2)] for i in range(2)]) + cf
    assert got.dtype == np.float32
    np.testing.assert_allclose(got[0, 0], np.maximum(want, 0), rtol=1e-6)


def test_panel_is_wide():
    """Issue 9: at least 20 architectures, the first eight kept."""
    assert len(MODELS) >= 20 and len(set(MODELS)) == len(MODELS)
    assert MODELS[:8] == ["resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "r3d_18",
                          "fcn_resnet50", "deeplabv3_mobilenet_v3_large", "dcgan_generator"]


def test_the_sweep_is_apart_from_the_panel():
    """The CPU sweep (models a new user might bring, not benchmarked) shares no model with the
    panel, names the same keys, and ``--sweep`` exports only its own models."""
    from convpass.bench.peers import load_export_panel

    ep = load_export_panel()
    assert len(ep.SWEEP) >= 30 and not set(ep.SWEEP) & set(ep.PANEL)
    for name, spec in ep.SWEEP.items():
        assert {"builder", "kwargs", "shape", "input_kind", "family"} <= set(spec), name
        assert spec["input_kind"] in ep.INPUT_KINDS and spec["shape"][0] == 1, name
        assert ep.bench_batches(name) == ep.DEFAULT_BATCHES
    with pytest.raises(SystemExit):  # a panel model is not in the sweep
        ep.main(["--out", "unused", "--sweep", "--models", "resnet50"])
    with pytest.raises(KeyError, match="unknown panel model"):
        ep.bench_batches("no_such_model")


def test_pin_output_dims(tmp_path):
    """Symbolic non-batch output dims left by the exporter become the sizes torch produced; the
    batch dim is named ``batch``."""
    from onnx import TensorProto, helper

    from convpass.bench.peers import load_export_panel

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

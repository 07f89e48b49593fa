"""The committed sample models in models/: present, small, valid, runnable, reproducible,
and exercising the convolution variants that models/README.md promises."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
BUILDER = os.path.join(MODELS, "build_samples.py")
EXPORTER = os.path.join(MODELS, "export_panel.py")

SAMPLES = {
    # name: (input name, input shape (None = symbolic), output name, output shape)
    "residual_cnn": ("input", [1, 3, 64, 64], "logits", [1, 10]),
    "mobile_block": ("input", [None, 3, 32, 32], "output", [None, 16, 32, 32]),
    "audio_frontend_1d": ("audio", [1, 1, 4000], "features", [1, 32]),
    "video_block_3d": ("clip", [1, 3, 8, 32, 32], "embedding", [1, 32]),
    "encoder_decoder": ("image", [1, 3, 32, 32], "reconstruction", [1, 3, 32, 32]),
}


def _path(name: str) -> str:
    return os.path.join(MODELS, f"{name}.onnx")


def _load(name: str) -> onnx.ModelProto:
    return onnx.load(_path(name))


def _builder():
    spec = importlib.util.spec_from_file_location("convpass_build_samples", BUILDER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _convs(model: onnx.ModelProto, op: str = "Conv"):
    return [(n, _attrs(n)) for n in model.graph.node if n.op_type == op]


def _weight_shapes(model: onnx.ModelProto) -> dict:
    return {i.name: list(i.dims) for i in model.graph.initializer}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_committed_model_valid(name):
    path = _path(name)
    assert os.path.isfile(path), f"{path} missing: run python models/build_samples.py"
    assert os.path.getsize(path) < 2 * 1024 * 1024
    m = _load(name)
    onnx.checker.check_model(m, full_check=True)
    assert m.ir_version == 8
    assert [(o.domain, o.version) for o in m.opset_import] == [("", 17)]
    assert m.graph.doc_string
    names = [n.name for n in m.graph.node]
    assert all(names) and len(set(names)) == len(names), "node names must be unique, non-empty"

    in_name, in_shape, out_name, out_shape = SAMPLES[name]
    (inp,) = m.graph.input
    assert inp.name == in_name
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert dims == [d if d is not None else "batch" for d in in_shape]
    assert [o.name for o in m.graph.output] == [out_name]

    # every intermediate value has a fully inferable shape
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
    shapes = {v.name: v.type.tensor_type.shape for v in
              list(inferred.graph.value_info) + list(inferred.graph.output)}
    for node in m.graph.node:
        for out in node.output:
            assert out in shapes, f"{name}: no inferred shape for {out}"
            for d in shapes[out].dim:
                assert d.HasField("dim_value") or d.dim_param == "batch", (name, out, d)


@pytest.mark.parametrize("name", list(SAMPLES))
def test_runs_in_onnxruntime(name):
    ort = pytest.importorskip("onnxruntime")
    in_name, in_shape, out_name, out_shape = SAMPLES[name]
    sess = ort.InferenceSession(_path(name), providers=["CPUExecutionProvider"])
    batch = 2 if in_shape[0] is None else in_shape[0]
    x = np.random.default_rng(1).standard_normal([batch] + in_shape[1:]).astype(np.float32)
    (y,) = sess.run([out_name], {in_name: x})
    assert list(y.shape) == [batch] + out_shape[1:]
    assert y.dtype == np.float32
    assert np.isfinite(y).all()


def test_rebuild_is_byte_identical(tmp_path):
    mod = _builder()
    assert set(mod.BUILDERS) == set(SAMPLES)
    paths = mod.build_all(str(tmp_path))
    for name in SAMPLES:
        with open(paths[name], "rb") as f:
            rebuilt = f.read()
        with open(_path(name), "rb") as f:
            committed = f.read()
        assert rebuilt == committed, (
            f"{name}.onnx differs from a fresh build: rerun python models/build_samples.py")


def test_builder_cli(tmp_path):
    r = subprocess.run([sys.executable, BUILDER, "--out", str(tmp_path),
                        "--models", "audio_frontend_1d"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["audio_frontend_1d.onnx"]


def test_residual_cnn_variants():
    m = _load("residual_cnn")
    convs = _convs(m)
    w = _weight_shapes(m)
    assert len(convs) == 6
    strided = [a for _, a in convs if a.get("strides") == [2, 2]]
    assert len(strided) == 3  # stem, block2/conv1, projection shortcut
    assert any(w[n.input[1]][2:] == [1, 1] and a.get("strides") == [2, 2] for n, a in convs)
    ops = {n.op_type for n in m.graph.node}
    assert {"BatchNormalization", "MaxPool", "Add", "GlobalAveragePool", "Flatten",
            "Gemm"} <= ops
    (gemm,) = [n for n in m.graph.node if n.op_type == "Gemm"]
    assert _attrs(gemm)["transB"] == 1


def test_mobile_block_variants():
    m = _load("mobile_block")
    w = _weight_shapes(m)
    convs = _convs(m)
    dw = [(n, a) for n, a in convs if a.get("group", 1) > 1]
    assert len(dw) == 1
    n, a = dw[0]
    assert w[n.input[1]] == [a["group"], 1, 3, 3]  # depthwise: group == channels
    pointwise = [n for n, a in convs if w[n.input[1]][2:] == [1, 1]]
    assert len(pointwise) >= 4  # expand, SE fc1/fc2, project
    ops = [n.op_type for n in m.graph.node]
    for op in ("Clip", "HardSwish", "HardSigmoid", "Mul", "GlobalAveragePool", "Add"):
        assert op in ops, op


def test_audio_frontend_variants():
    m = _load("audio_frontend_1d")
    w = _weight_shapes(m)
    convs = _convs(m)
    assert len(convs) == 4
    assert all(len(w[n.input[1]]) == 3 for n, _ in convs)  # 1-D kernels
    assert any(a.get("strides") == [5] and w[n.input[1]][2] == 11 for n, a in convs)
    assert any(a.get("dilations") == [2] for _, a in convs)
    asym = [a["pads"] for _, a in convs if "pads" in a and a["pads"][0] != a["pads"][1]]
    assert asym == [[1, 2]]
    same = [(n, a) for n, a in convs if a.get("auto_pad") == b"SAME_UPPER"]
    assert len(same) == 1 and same[0][1].get("group") == 32
    assert "ReduceMean" in {n.op_type for n in m.graph.node}


def test_video_block_variants():
    m = _load("video_block_3d")
    w = _weight_shapes(m)
    convs = _convs(m)
    kernels = [w[n.input[1]][2:] for n, _ in convs]
    assert all(len(k) == 3 for k in kernels)  # 3-D kernels
    assert [3, 3, 3] in kernels and [1, 3, 3] in kernels
    assert any(a.get("strides") == [1, 2, 2] for _, a in convs)
    assert any(a.get("group") == 2 for _, a in convs)
    (pool,) = [n for n in m.graph.node if n.op_type == "MaxPool"]
    assert len(_attrs(pool)["kernel_shape"]) == 3


def test_encoder_decoder_variants():
    m = _load("encoder_decoder")
    cts = _convs(m, "ConvTranspose")
    assert len(cts) == 3
    assert any(a.get("output_padding") == [1, 1] and a.get("pads") == [1, 1, 1, 1]
               for _, a in cts)
    assert any("output_shape" in a and "pads" not in a for _, a in cts)
    w = _weight_shapes(m)
    assert any(w[n.input[1]][2:] == [4, 4] and a.get("strides") == [2, 2] for n, a in cts)
    convs = _convs(m)
    assert sum(a.get("strides") == [2, 2] for _, a in convs) == 2
    (concat,) = [n for n in m.graph.node if n.op_type == "Concat"]
    assert _attrs(concat)["axis"] == 1
    producers = {o: n for n in m.graph.node for o in n.output}
    consumers = [n for n in m.graph.node if concat.output[0] in n.input]
    assert [n.op_type for n in consumers] == ["Conv"]
    assert w[consumers[0].input[1]][2:] == [1, 1]
    assert any(producers[i].name.startswith("encoder/") for i in concat.input)
    (resize,) = [n for n in m.graph.node if n.op_type == "Resize"]
    assert _attrs(resize)["mode"] == b"nearest"
    scales = [i for i in m.graph.initializer if i.name == resize.input[2]][0]
    assert onnx.numpy_helper.to_array(scales).tolist() == [1.0, 1.0, 2.0, 2.0]
    assert m.graph.node[-1].op_type == "Sigmoid"


def test_export_panel_script_without_torch(tmp_path):
    py_compile.compile(EXPORTER, doraise=True, cfile=str(tmp_path / "export_panel.pyc"))
    try:
        import torch  # noqa: F401
        import torchvision  # noqa: F401
        pytest.skip("torch is installed: the missing-torch path is not testable here")
    except ImportError:
        pass
    r = subprocess.run([sys.executable, EXPORTER, "--out", str(tmp_path / "panel")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "torch" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "panel").exists()

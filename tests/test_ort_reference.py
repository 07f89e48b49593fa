"""ONNX Runtime as the float32 reference computes ``Pad(0) -> MaxPool`` as written.

ONNX Runtime 1.31's ``Pad_Fusion`` rewrite moves a zero Pad into the next MaxPool's ``pads``, where
padding counts as minus infinity: a border window whose values are all negative then gives their
maximum instead of 0. BiT's stem (Conv -> Pad(0) -> MaxPool, no activation between) gave a
reference 1.5e-3 off its own model that way, which every correct runtime, the convpass CPU
executor included, then appeared to miss by. ONNX Runtime 1.32 no longer fuses into MaxPool, so the
tests install the old rewrite in front of the real session (:func:`pad_fusion_131`, applied
unless the session turns ``Pad_Fusion`` off, as 1.31 does) and check every reference convpass
makes (``--precision``'s, ``run --compare ort``'s, ``bench``'s, benchmarks/local_errors.py's)
against NumPy's Pad then MaxPool.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import benchmark_script
from onnx import TensorProto, helper, numpy_helper

from convpass.core import ort_reference

SHAPE = (1, 3, 10, 10)


def stem_tail() -> onnx.ModelProto:
    """``x -> Pad(constant 0, one on every side of H and W) -> MaxPool(3x3, stride 2, pads 0)``, as
    the TorchScript exporter writes timm's BiT stem after its conv (pads and value as constants)."""
    inits = [numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads"),
             numpy_helper.from_array(np.array(0, np.float32), "value")]
    nodes = [helper.make_node("Pad", ["x", "pads", "value"], ["padded"], name="pad", mode="constant"),
             helper.make_node("MaxPool", ["padded"], ["y"], name="pool", kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 0, 0],
                              ceil_mode=0, dilations=[1, 1])]
    graph = helper.make_graph(nodes, "stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 5, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def bit_stem(size: int = 64) -> onnx.ModelProto:
    """BiT's stem and first GroupNorm as exported: ``Conv(7x7, 3 -> 64, stride 2, pads 3) -> Pad(0) ->
    MaxPool(3x3, stride 2) -> GroupNorm(32) as Reshape / InstanceNormalization / Reshape / Mul / Add
    -> Relu``; a conv weight of zero mean per output channel (weight-standardized), so half the
    conv's outputs are negative."""
    from fused_models import N, norm

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 3, 7, 7))
    w = ((w - w.mean(axis=(1, 2, 3), keepdims=True)) / w.std(axis=(1, 2, 3), keepdims=True)).astype(np.float32)
    gn, gn_inits, t = norm("gn17", "norm1", "pooled", 64, 32, rng, eps=1e-5)
    nodes = [N("Conv", ["x", "w"], ["stem"], kernel_shape=[7, 7], strides=[2, 2], pads=[3, 3, 3, 3], name="stem/conv"),
             N("Pad", ["stem", "pads", "value"], ["padded"], mode="constant", name="stem/pad"),
             N("MaxPool", ["padded"], ["pooled"], kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 0, 0], name="stem/pool"),
             *gn, N("Relu", [t], ["y"], name="norm1/act")]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads"),
             numpy_helper.from_array(np.array(0, np.float32), "value"), *gn_inits]
    out = size // 4
    graph = helper.make_graph(nodes, "bit_stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64, out, out])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _pooled(x: np.ndarray, fill: float) -> np.ndarray:
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=fill)
    return np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))[:, :, ::2, ::2].max(axis=(-1, -2))


@pytest.fixture
def x() -> np.ndarray:
    """All negative: every window that reaches the padding takes its zero."""
    return -np.abs(np.random.default_rng(0).standard_normal(SHAPE)).astype(np.float32) - 0.1


def _fuse_pad_into_maxpool(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX Runtime 1.31's Pad_Fusion on ``Pad(constant 0) -> MaxPool``: the Pad's spatial pads
    added to the MaxPool's, the Pad removed."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    for pad in [n for n in m.graph.node if n.op_type == "Pad"]:
        readers = [n for n in m.graph.node if pad.output[0] in n.input]
        if len(readers) != 1 or readers[0].op_type != "MaxPool" or np.any(inits[pad.input[2]] != 0):
            continue
        pads = inits[pad.input[1]].tolist()
        rank = len(pads) // 2
        attr = next(a for a in readers[0].attribute if a.name == "pads")
        old = list(attr.ints)
        attr.ClearField("ints")
        attr.ints.extend([old[i] + pads[2 + i] for i in range(rank - 2)] + [old[rank - 2 + i] + pads[rank + 2 + i] for i in range(rank - 2)])
        readers[0].input[0] = pad.input[0]
        m.graph.node.remove(pad)
    used = {i for n in m.graph.node for i in n.input}
    for t in [t for t in m.graph.initializer if t.name not in used]:
        m.graph.initializer.remove(t)
    return m


@pytest.fixture
def pad_fusion_131(monkeypatch):
    """``onnxruntime.InferenceSession`` that fuses a zero Pad into MaxPool as ONNX Runtime 1.31 does,
    unless ``disabled_optimizers`` names ``Pad_Fusion``."""
    real = ort.InferenceSession

    class Session(real):  # type: ignore[misc,valid-type]
        def __init__(self, model, sess_options=None, providers=None, provider_options=None, **kwargs):
            if "Pad_Fusion" not in (kwargs.get("disabled_optimizers") or ()):
                proto = onnx.load(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else onnx.load_from_string(model)
                model = _fuse_pad_into_maxpool(proto).SerializeToString()
            super().__init__(model, sess_options, providers, provider_options, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", Session)
    return Session


def test_the_emulated_rewrite_is_the_wrong_one(pad_fusion_131, x):
    """The fixture changes results as ONNX Runtime 1.31 does (so the tests below can fail), and a
    session with the rewrite off computes the model as written."""
    model = stem_tail().SerializeToString()
    fused = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(fused, _pooled(x, -np.inf))
    assert not np.array_equal(fused, _pooled(x, 0.0))
    np.testing.assert_array_equal(ort_reference.cpu_session(ort, model).run(None, {"x": x})[0], _pooled(x, 0.0))


def test_the_installed_onnxruntime_with_the_rewrite_off_computes_the_model_as_written(x):
    got = ort_reference.cpu_session(ort, stem_tail().SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, _pooled(x, 0.0))


def test_the_precision_reference_pads_with_zero(pad_fusion_131, x):
    from convpass.compiler.precision.data import InputSet, reference_outputs

    (outs,) = reference_outputs(stem_tail(), InputSet("calibration", ({"x": x},), "test"))
    np.testing.assert_array_equal(outs[0], _pooled(x, 0.0))


def test_run_compare_ort_pads_with_zero(pad_fusion_131, x, tmp_path):
    from convpass.cli.compare import ort_outputs

    path = tmp_path / "stem.onnx"
    onnx.save(stem_tail(), path)
    np.testing.assert_array_equal(ort_outputs(str(path), {"x": x}, ["y"])["y"], _pooled(x, 0.0))


def test_the_bench_reference_pads_with_zero(pad_fusion_131, x, tmp_path):
    from convpass.bench.reference import reference_outputs

    path = tmp_path / "stem.onnx"
    onnx.save(stem_tail(), path)
    outs, label, note = reference_outputs(path, {"x": x})
    assert label.startswith("onnxruntime") and note is None
    np.testing.assert_array_equal(outs[0], _pooled(x, 0.0))


def test_local_errors_reference_pads_with_zero(pad_fusion_131, x):
    local_errors = benchmark_script("local_errors")
    np.testing.assert_array_equal(local_errors.run_ort(stem_tail(), {"x": x})[0], _pooled(x, 0.0))


def test_the_cpu_executor_on_bits_stem_is_a_float32_rounding_off_the_reference(pad_fusion_131):
    """What BiT showed at its first GroupNorm: the executor computes the model as written and the
    reference must too (under 1.31's rewrite, left on, they differ by about 1e-3 relative L2)."""
    from convpass.compiler.precision.data import InputSet, reference_outputs
    from convpass.runtime.executor import Executor

    model = bit_stem()
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, 64, 64)).astype(np.float32)}
    (ref,) = reference_outputs(model, InputSet("holdout", (feeds,), "test"))
    got = Executor(model, device="cpu").run(None, feeds)[0]
    assert np.linalg.norm(got - ref[0]) / np.linalg.norm(ref[0]) < 5e-6
    fused = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.linalg.norm(fused - ref[0]) / np.linalg.norm(ref[0]) > 1e-4  # the rewrite the reference turns off

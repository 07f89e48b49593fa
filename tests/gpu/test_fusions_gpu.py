"""Fusions around convolutions on a GPU, each against ONNX Runtime CPU, run eagerly (cuda_graph=False)
and replayed from a CUDA graph: fused normalization units (convpass.kernels.group_norm) in float32 and
float16, channels-first and channels-last, into a Concat slice, as one launch (their groups are
small: convpass.kernels.group_norm_onepass) and as the three kernels; the apply kernel of the three
(convpass.kernels.group_norm_apply) against float64 in both orders, vector and scalar; their
measured decision at optimize;
global pooling without keepdims and gates read through an Expand."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_cuda_backend")]

cp = pytest.importorskip("cupy")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fused_models import N, activation, block, const, eca, feeds, norm  # noqa: E402

from convpass.kernels import group_norm_onepass  # noqa: E402
from convpass.runtime import Executor  # noqa: E402
from convpass.runtime.cuda import StartupCompileWarning  # noqa: E402


@pytest.fixture
def three_kernels(monkeypatch):
    """Units of any size run as the three kernels (statistics, finalize, apply), not one launch."""
    monkeypatch.setattr(group_norm_onepass, "MAX_GROUP_ELEMENTS", 0)


def _ort(model, f):
    f32 = {k: v.astype(np.float32) for k, v in f.items()}
    m = onnx.ModelProto.FromString(model.SerializeToString())
    if any(v.dtype == np.float16 for v in f.values()):
        from onnx import numpy_helper

        for vi in [*m.graph.input, *m.graph.output]:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
        for i, t in enumerate(m.graph.initializer):
            if t.data_type == TensorProto.FLOAT16:
                m.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, f32)


def _channels_last(a):
    if a.ndim < 3:
        return a
    return cp.moveaxis(cp.ascontiguousarray(cp.moveaxis(a, 1, -1)), -1, 1)


def _check(model, f, tol, *, graph, channels_last=False, expect=None, **executor):
    """The cuda executor (eager or captured) against ONNX Runtime CPU over four runs; returns it."""
    from convpass.runtime.cuda import CudaBackend

    refs = _ort(model, f)
    dev = {k: cp.asarray(v) for k, v in f.items()}
    if channels_last:
        dev = {k: _channels_last(v) for k, v in dev.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StartupCompileWarning)
        ex = Executor(model, device=CudaBackend(cuda_graph=graph), output_kind="numpy", **executor)
        for run in range(4):
            for got, want in zip(ex.run(None, dev), refs):
                scale = float(np.max(np.abs(want), initial=1.0))
                np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * scale, err_msg=f"run {run + 1}")
    if graph:
        assert ex.graph_status().captured, ex.graph_status().describe()
    if expect is not None:
        labels = [launch.label for launch in ex.last_plan.backend_state.launch_list()]
        assert any(expect in label for label in labels), labels
    return ex


# (shape, groups, form, activation): VAE-decoder-like GroupNorm(32) + SiLU at several widths (512
# channels: two per channel lane of the channels-last statistics), odd sizes, 1-D and 3-D maps
CASES = [
    ((2, 64, 32, 32), 32, "gn17", "silu"), ((1, 256, 16, 16), 32, "gn17", "silu"), ((4, 512, 8, 8), 32, "gn17", "silu"),
    ((2, 8, 5, 6), 4, "gn21", "LeakyRelu"), ((2, 64, 32, 32), 64, "instance", "HardSwish"), ((2, 32, 50), 8, "gn17", "Gelu"),
    ((1, 16, 4, 6, 8), 4, "gn21", "Mish"), ((2, 128, 20, 20), 32, "gn17", "Relu"),
]
TOL = {np.float32: 3e-5, np.float16: 5e-3}
# against ONNX Runtime when an untuned conv (TF32 allowed) sits between the units; the fused and the
# unfused plans on the GPU run the same conv and are compared at TOL
TF32_TOL = {np.float32: 3e-3, np.float16: 1e-2}


@pytest.mark.parametrize("graph,path", [(False, "one-launch"), (True, "one-launch"), (True, "three-kernel")],
                         ids=["eager", "graph", "graph-three-kernel"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape,groups,form,act", CASES, ids=[f"{'x'.join(map(str, c[0][1:]))}-{c[2]}-{c[3]}" for c in CASES])
def test_fused_normalization_units(shape, groups, form, act, dtype, channels_last, graph, path, monkeypatch):
    """Both units of the block run as FusedNorm launches on either storage: one launch (every
    case's groups are small), or statistics + apply where the limit is set to 0."""
    if path == "three-kernel":
        monkeypatch.setattr(group_norm_onepass, "MAX_GROUP_ELEMENTS", 0)
    else:
        monkeypatch.setattr(group_norm_onepass, "MIN_PAIRS", 1)  # small units: the one launch whatever their pair count
    model = block(form, act, shape, groups, dtype=dtype)
    f = feeds(shape, dtype=dtype)
    ex = _check(model, f, TF32_TOL[dtype], graph=graph, channels_last=channels_last, expect="FusedNorm")
    assert [s.fused for s in ex.fusion_summary()] == [True, True]
    labels = [launch.label for launch in ex.last_plan.backend_state.launch_list()]
    assert sum(label.startswith("FusedNorm") for label in labels) == 2, labels
    _assert_apply_on_its_kernel(ex, "gn_onepass_" if path == "one-launch" else "gn_apply_")
    # the same conv either way: the fused units against the unfused ops, on the GPU
    fused = ex.run(None, {k: cp.asarray(v) for k, v in f.items()})[0]
    unfused = Executor(model, device=_backend(graph), output_kind="numpy", fusions=False)
    for _ in range(2):
        want = unfused.run(None, {k: cp.asarray(v) for k, v in f.items()})[0]
    scale = float(np.max(np.abs(want.astype(np.float64))))
    np.testing.assert_allclose(fused.astype(np.float64), want.astype(np.float64), rtol=TF32_TOL[dtype], atol=TF32_TOL[dtype] * scale)  # the conv before may run another algorithm unfused


def _fused_launches(ex):
    return [launch for launch in ex.last_plan.backend_state.launch_list() if launch.label.startswith("FusedNorm")]


def _assert_apply_on_its_kernel(ex, kernel=("gn_onepass_", "gn_apply_")):
    """Every FusedNorm launch ran its apply pass on the one-launch kernel
    (convpass.kernels.group_norm_onepass) or the dedicated apply kernel
    (convpass.kernels.group_norm_apply) — ``kernel``: the entries' prefix expected — not the
    generic one nor the op library's fallback."""
    for launch in _fused_launches(ex):
        paths = launch.apply_paths()
        assert paths and all(p.startswith(kernel) for p in paths), (launch.label, paths)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_a_vae_groupnorm_with_a_mean_far_from_zero_matches_float64(dtype, channels_last):
    """GroupNorm(32) of 128 channels (four a group) + SiLU in the exported form, alone, on inputs
    whose mean is 50 standard deviations from zero (x * A and B nearly cancel in the apply pass),
    in the storage the input arrives in, against float64 NumPy (ONNX Runtime's own float32
    statistics are not that close on such inputs), eager and replayed."""
    shape, groups, eps = (2, 128, 24, 24), 32, 1e-6
    rng = np.random.default_rng(0)
    nodes, inits, t = norm("gn17", "n1", "x", shape[1], groups, rng, dtype, eps=eps)
    more, t = activation("silu", "a1", t)
    tp = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    graph = helper.make_graph(nodes + more, "g", [helper.make_tensor_value_info("x", tp, shape)], [helper.make_tensor_value_info(t, tp, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    x = feeds(shape, dtype=dtype, offset=50.0)["x"]
    params = {i.name: onnx.numpy_helper.to_array(i).astype(np.float64).reshape(-1) for i in inits}
    g = x.astype(np.float64).reshape(shape[0], groups, -1)
    y = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + eps)).reshape(shape)
    y = y * params["n1_gamma"].reshape(1, -1, 1, 1) + params["n1_beta"].reshape(1, -1, 1, 1)
    want = y / (1 + np.exp(-y))
    tol = TOL[dtype]
    dev = cp.asarray(x)
    if channels_last:
        dev = _channels_last(dev)
    for graph_mode in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StartupCompileWarning)
            ex = Executor(model, device=_backend(graph_mode), output_kind="numpy")
            for run in range(3):
                got = ex.run(None, {"x": dev})[0].astype(np.float64)
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()), err_msg=f"run {run + 1}")
        assert [launch.label for launch in _fused_launches(ex)] == ["FusedNorm+Mul+Add+Sigmoid+Mul"]
        _assert_apply_on_its_kernel(ex)


def _apply_model(shape, groups, residual, last, dtype):
    """GroupNorm (exported form) + SiLU (+ a residual input z): x and z given as NHWC inputs and
    read through a Transpose (a view: channels-last storage even from a captured graph) when
    ``last``. Returns (model, params)."""
    rng = np.random.default_rng(0)
    c, r = shape[1], len(shape)
    tp = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    nodes, ins = [], []
    for v in ["x", "z"] if residual else ["x"]:
        if last:
            nodes.append(N("Transpose", [f"{v}_nhwc"], [v], perm=[0, r - 1, *range(1, r - 1)], name=f"{v}/to_logical"))
            ins.append(helper.make_tensor_value_info(f"{v}_nhwc", tp, [shape[0], *shape[2:], c]))
        else:
            ins.append(helper.make_tensor_value_info(v, tp, shape))
    more, inits, t = norm("gn17", "n1", "x", c, groups, rng, dtype)
    act, t = activation("silu", "a1", t)
    nodes += more + act
    if residual:
        nodes.append(N("Add", [t, "z"], ["y"], name="residual"))
        t = "y"
    graph = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info(t, tp, shape)], inits)
    params = {i.name: onnx.numpy_helper.to_array(i).astype(np.float64).reshape(-1) for i in inits}
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), params


# (shape, groups): C % 4 == 0 and S % 8 == 0; neither; C % 8 == 0 with S % 4 == 0 but not % 8
APPLY_SHAPES = [((2, 128, 24, 24), 32), ((2, 30, 7, 9), 10), ((1, 96, 10, 10), 32)]


@pytest.mark.usefixtures("three_kernels")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("residual", [False, True], ids=["silu", "silu+residual"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape,groups", APPLY_SHAPES, ids=["c128", "c30-odd", "c96-b1"])
def test_the_apply_kernel_matches_float64_in_both_orders(shape, groups, dtype, channels_last, residual, graph):
    """The dedicated apply kernel (16-byte vectors where the vectorized dimension, C channels-last or
    S channels-first, is a multiple of the vector; else one element a thread) against float64 NumPy
    of GroupNorm + SiLU (+ residual) computed from the same stored inputs, eager and replayed (the
    three kernels forced: these groups are small enough for the one launch)."""
    model, params = _apply_model(shape, groups, residual, channels_last, dtype)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 2 + 3).astype(dtype)
    z = rng.standard_normal(shape).astype(dtype)
    c = shape[1]
    g = x.astype(np.float64).reshape(shape[0], groups, -1)
    y = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + 1e-6)).reshape(shape)
    view = (1, c) + (1,) * (len(shape) - 2)
    y = y * params["n1_gamma"].reshape(view) + params["n1_beta"].reshape(view)
    want = y / (1 + np.exp(-y)) + (z.astype(np.float64) if residual else 0)
    feed = {"x": x, "z": z} if residual else {"x": x}
    if channels_last:
        feed = {f"{k}_nhwc": np.ascontiguousarray(np.moveaxis(v, 1, -1)) for k, v in feed.items()}
    dev = {k: cp.asarray(v) for k, v in feed.items()}
    tol = TOL[dtype]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StartupCompileWarning)
        ex = Executor(model, device=_backend(graph), output_kind="numpy")
        for run in range(3):
            got = ex.run(None, dev)[0].astype(np.float64)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()), err_msg=f"run {run + 1}")
    if graph:
        assert ex.graph_status().captured, ex.graph_status().describe()
    (launch,) = _fused_launches(ex)
    v = 16 // np.dtype(dtype).itemsize
    along = c if channels_last else int(np.prod(shape[2:]))
    assert launch.apply_paths() == {f"gn_apply_{'cl' if channels_last else 'cf'}_{v if along % v == 0 else 1}"}


def _backend(graph):
    from convpass.runtime.cuda import CudaBackend

    return CudaBackend(cuda_graph=graph)


@pytest.mark.parametrize("path", ["one-launch", "three-kernel"])
def test_a_fused_unit_writes_into_its_concat_slice(path, monkeypatch):
    """GroupNorm + SiLU whose output is concatenated: the FusedNorm launch writes into the buffer."""
    if path == "three-kernel":
        monkeypatch.setattr(group_norm_onepass, "MAX_GROUP_ELEMENTS", 0)
    else:
        monkeypatch.setattr(group_norm_onepass, "MIN_PAIRS", 1)  # small units: the one launch whatever their pair count
    rng = np.random.default_rng(0)
    shape = (2, 32, 16, 16)
    nodes, inits, t = norm("gn17", "n1", "x", 32, 8, rng)
    more, t = activation("silu", "a1", t)
    nodes += more + [N("Relu", ["x"], ["r"], name="other"), N("Concat", [t, "r"], ["y"], axis=1, name="cat")]
    out_shape = (2, 64, 16, 16)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    for layout in (False, True):
        ex = _check(model, feeds(shape), TOL[np.float32], graph=True, channels_last=layout)
        fused = _fused_launches(ex)
        assert len(fused) == 1 and fused[0].placement is not None
        _assert_apply_on_its_kernel(ex, "gn_onepass_" if path == "one-launch" else "gn_apply_")


def test_optimize_measures_each_unit_and_the_executor_runs_the_decision(tmp_path):
    """On the GPU, optimize times every unit fused (both formats) and unfused, records it, and the
    tuned model runs what was recorded, within tolerance of ONNX Runtime."""
    import convpass
    from convpass.core import annotation

    shape = (2, 64, 32, 32)
    model = block("gn17", "silu", shape, 32)
    out = tmp_path / "tuned.onnx"
    convpass.optimize(model, out, shapes=[f"x={'x'.join(map(str, shape))}"], quiet=True, cache=tmp_path / "cache.db", tf32="off", kernels=False)
    tuned = onnx.load(out)
    record = annotation.read_fusions(tuned)
    decisions = [d for _, _, ds in record.units.values() for d in ds]
    assert len(decisions) == 2 and all(d.source == annotation.MEASURED for d in decisions)
    assert all(set(d.times_ms) == {"fused_nchw", "fused_nhwc", "unfused_nchw"} and min(d.times_ms.values()) > 0 for d in decisions)
    assert all(d.fused == (d.times_ms["fused_nchw"] <= d.times_ms["unfused_nchw"]) for d in decisions)
    print(json.dumps([d.to_json() for d in decisions], indent=1))  # the times, for the record
    ex = _check(tuned, feeds(shape), TOL[np.float32], graph=True)
    assert [s.why for s in ex.fusion_summary()] == ["measured", "measured"]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_global_pooling_without_keepdims_and_a_gate_through_expand(channels_last):
    """ECA's gate: x.mean((2, 3)) (keepdims 0) on the global pooling kernel, a 1-D conv across
    channels, Sigmoid, Reshape, Expand to x's shape, Mul: the Expand is read as a broadcast inside
    the fused Mul, not copied."""
    c, k = 64, 5
    shape = (2, c, 14, 14)
    model = eca(shape, k, residual=False)
    for graph_mode in (False, True):
        ex = _check(model, feeds(shape), TF32_TOL[np.float32], graph=graph_mode, channels_last=channels_last)
        labels = [launch.label for launch in ex.last_plan.backend_state.launch_list()]
        assert "ReduceMean (kernel)" in labels and any(label == "fused Expand+Mul" for label in labels), labels


def _rrdb_like(shape):
    rng = np.random.default_rng(0)
    c = shape[1]
    nodes = [N("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"), N("LeakyRelu", ["c1"], ["f1"], alpha=0.2, name="lrelu"),
             N("Concat", ["x", "f1"], ["cat"], axis=1, name="cat"), N("Conv", ["cat", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             N("Mul", ["c2", "scale"], ["m"], name="scale"), N("Add", ["m", "x"], ["y"], name="residual")]
    inits = [const("w1", rng.standard_normal((c, c, 3, 3)) * 0.05), const("b1", rng.standard_normal(c)),
             const("w2", rng.standard_normal((c, 2 * c, 3, 3)) * 0.05), const("b2", rng.standard_normal(c)), const("scale", 0.2)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_convs_bias_moves_into_the_element_wise_kernel_after_it(graph, tmp_path):
    """Forced: each conv runs bare and its bias is added in the fused LeakyRelu / Mul + Add kernel;
    tuned: the units run as recorded (moved only where the tuned conv adds its bias in a pass of
    its own). Untuned convs may use TF32 (a looser tolerance); the tuned model has it off."""
    import convpass

    shape = (2, 64, 32, 32)
    model = _rrdb_like(shape)
    ex = _check(model, feeds(shape), 5e-3, graph=graph, fusions=True)
    labels = [launch.label for launch in ex.last_plan.backend_state.launch_list()]
    assert "fused Add+LeakyRelu" in labels and "fused Add+Mul+Add" in labels, labels
    out = tmp_path / "tuned.onnx"
    convpass.optimize(model, out, shapes=[f"x={'x'.join(map(str, shape))}"], quiet=True, cache=tmp_path / "cache.db", tf32="off", kernels=False)
    ex = _check(onnx.load(out), feeds(shape), 2e-4, graph=graph)
    assert [s.kind for s in ex.fusion_summary()] == ["bias", "bias"]

"""The one-launch fused normalization (convpass.kernels.group_norm_onepass) on a GPU, eager and
replayed from a CUDA graph, over several runs with other inputs each time (a launch that kept
anything between runs — a counter, a scratch buffer — fails from the second run on): BiT's
GroupNorm(32) + Mul + Add + Relu units, a VAE decoder's GroupNorm(32) + SiLU (+ residual) at batch
1, a gate and a residual, InstanceNorm, in float32 and float16, channels-first and channels-last,
against float64 NumPy written from the definitions; a BiT pre-activation block against ONNX
Runtime CPU; the one launch against the three kernels on the same inputs."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_cuda_backend")]

cp = pytest.importorskip("cupy")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fused_models import N, activation, const, norm, unit, unit_feeds, unit_inputs, unit_reference64  # noqa: E402

from convpass.kernels import group_norm_onepass  # noqa: E402
from convpass.runtime import Executor  # noqa: E402
from convpass.runtime.cuda import CudaBackend, StartupCompileWarning  # noqa: E402

TOL = {np.float32: 3e-5, np.float16: 5e-3}
RUNS = 4  # a first run (the plan is built), then replays: the second and third are where stale state shows

# (id, form, activation, gate, residual)
EPILOGUES = {"bit": ("gn17", "Relu", False, False), "vae": ("gn17", "silu", False, True), "gate": ("gn21", "silu", True, True),
             "instance": ("instance", "LeakyRelu", False, False)}
# (shape, groups, epilogue): BiT-like units — 64 channels at 7 x 7 (odd positions), 2 channels a group
# at batch 16 (channels-last: four groups a block), 8 channels a group with a residual (float16
# channels-last: two groups a block) —, a VAE decoder's 512 x 32 x 32 at batch 1 (32 blocks of 1024
# threads), a gate and a residual on an odd size, InstanceNorm
CASES = [((4, 2048, 7, 7), 32, "bit"), ((16, 64, 28, 28), 32, "bit"), ((8, 256, 14, 14), 32, "vae"), ((1, 512, 32, 32), 32, "vae"),
         ((2, 96, 9, 11), 8, "gate"), ((2, 64, 20, 20), 64, "instance")]


DEFAULT_MIN_PAIRS = group_norm_onepass.MIN_PAIRS


@pytest.fixture(autouse=True)
def _any_pairs(monkeypatch):
    """The units here are small (a few (sample, group) pairs): they take the one launch whatever
    their pair count, so the kernel itself is what is checked; the defaults' own test restores it."""
    monkeypatch.setattr(group_norm_onepass, "MIN_PAIRS", 1)


def _executor(model, graph):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StartupCompileWarning)
        return Executor(model, device=CudaBackend(cuda_graph=graph), output_kind="numpy")


def _fused(ex):
    return [launch for launch in ex.last_plan.backend_state.launch_list() if launch.label.startswith("FusedNorm")]


def _runs(model, shape, groups, form, act, dtype, graph):
    """The executor over RUNS runs, each on other inputs (means 3, 1, -1, ..), each against its
    float64 reference; returns the executor."""
    ex = _executor(model, graph)
    tol = TOL[dtype]
    for run in range(RUNS):
        values = unit_inputs(shape, dtype, seed=10 + run, offset=3.0 - 2 * run)
        got = ex.run(None, {k: cp.asarray(v) for k, v in unit_feeds(model, values).items()})[0].astype(np.float64)
        want = unit_reference64(model, form, act, groups, values)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()), err_msg=f"run {run + 1}")
    if graph:
        assert ex.graph_status().captured, ex.graph_status().describe()
    return ex


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape,groups,epilogue", CASES, ids=[f"{'x'.join(map(str, c[0]))}-{c[2]}" for c in CASES])
def test_the_one_launch_matches_float64_over_runs(shape, groups, epilogue, dtype, channels_last, graph):
    form, act, gate, residual = EPILOGUES[epilogue]
    if form == "instance":
        groups = shape[1]
    model = unit(form, act, shape, groups, gate, residual, dtype, nhwc=channels_last)
    ex = _runs(model, shape, groups, form, act, dtype, graph)
    (launch,) = _fused(ex)
    (ran,) = launch.apply_paths()
    assert ran.startswith(f"gn_onepass_{'cl' if channels_last else 'cf'}_"), ran
    assert launch.onepass is not None and launch.part is None and launch.coef is None
    if channels_last and shape == (16, 64, 28, 28):
        assert launch.onepass.geometry["groups_per_block"] > 1, launch.onepass.geometry


def _bit_block(shape, groups):
    """BiT's pre-activation pieces: GroupNorm (exported) + ReLU -> conv 1x1 -> GroupNorm + ReLU."""
    rng = np.random.default_rng(0)
    c = shape[1]
    nodes, inits, t = norm("gn17", "n1", "x", c, groups, rng)
    more, t = activation("Relu", "a1", t)
    nodes += more + [N("Conv", [t, "w"], ["h"], name="conv")]
    inits.append(const("w", rng.standard_normal((c, c, 1, 1)) / np.sqrt(c)))
    n2, i2, t = norm("gn17", "n2", "h", c, groups, rng)
    more, t = activation("Relu", "a2", t)
    nodes += n2 + more
    inits += i2
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(t, TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_bit_block_matches_onnxruntime(graph):
    """Two BiT units around a conv (TF32 allowed: a conv's tolerance) against ONNX Runtime CPU over
    four runs on other inputs."""
    shape = (4, 512, 14, 14)
    model = _bit_block(shape, 32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ex = _executor(model, graph)
    for run in range(RUNS):
        x = (np.random.default_rng(run).standard_normal(shape) + 2 - run).astype(np.float32)
        want = sess.run(None, {"x": x})[0].astype(np.float64)
        got = ex.run(None, {"x": cp.asarray(x)})[0]
        np.testing.assert_allclose(got, want, rtol=3e-3, atol=3e-3 * float(np.abs(want).max()), err_msg=f"run {run + 1}")
    labels = [launch.label for launch in _fused(ex)]
    assert labels == ["FusedNorm+Mul+Add+Relu"] * 2, labels
    assert all(p.startswith("gn_onepass_") for launch in _fused(ex) for p in launch.apply_paths())


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_the_one_launch_and_the_three_kernels_agree(dtype, channels_last, monkeypatch):
    """The same unit (a gate and a residual) on the same inputs, one launch and three kernels,
    both replayed: within the storage type's rounding of each other."""
    shape, groups = (4, 256, 14, 14), 32
    form, act, gate, residual = EPILOGUES["gate"]
    model = unit(form, act, shape, groups, gate, residual, dtype, nhwc=channels_last)
    feeds = {k: cp.asarray(v) for k, v in unit_feeds(model, unit_inputs(shape, dtype, seed=3)).items()}
    outs = {}
    for limit in (group_norm_onepass.MAX_GROUP_ELEMENTS, 0):
        monkeypatch.setattr(group_norm_onepass, "MAX_GROUP_ELEMENTS", limit)
        ex = _executor(model, True)
        for _ in range(3):
            outs[limit] = ex.run(None, feeds)[0].astype(np.float64)
        (launch,) = _fused(ex)
        assert next(iter(launch.apply_paths())).startswith("gn_onepass_" if limit else "gn_apply_")
    one, three = outs.values()
    tol = TOL[dtype]
    np.testing.assert_allclose(one, three, rtol=tol, atol=tol * float(np.abs(three).max()))

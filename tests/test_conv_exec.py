"""The execution objects of :mod:`convpass.kernels.conv_exec` on the CPU: the factory maps each
algorithm family to its class and epilogue; a launch computes the conv's step (NumPy stand-ins for
cuDNN, the graph API and convpass's kernel); and the tuner's timed launch and the executor's launch
of the same decision call the same method of an object of the same class, algorithm, epilogue and
workspace, with arguments of the same shapes, types and strides."""

from __future__ import annotations

import collections
import re
import types

import numpy as np
import pytest
from conftest import no_plan_side_car, numpy_candidates, numpy_epilogue_kernel, offer_configs

from convpass.core import annotation
from convpass.core.algo import Algo
from convpass.core.problem import ConvShape
from convpass.kernels import conv_exec, depthwise
from convpass.kernels.conv_exec import EngineConv, FusedLegacyConv, LegacyConv, OwnConv
from convpass.native import cudnn
from convpass.native.cudnn import graph_api
from convpass.native.cudnn.graph_api import EngineConfig

DW = ConvShape("fwd", 2, 8, 8, (6, 6), (3, 3), (1, 1), (1, 1), (1, 1), groups=8)  # every family computes it
KEY = DW.key("nchw", "default")
WORKSPACE = 256


class _Plan:
    """A graph-API plan stood in for: ``y = x.sum()`` (the all-ones weights' conv of the bench),
    with a fused graph's bias and SiLU."""

    def __init__(self, key, config, enumerated=None):
        self.key, self.config, self.workspace_bytes, self.enumerated = key, config, WORKSPACE, enumerated

    def execute(self, x, w, y, workspace=None, bias=None):
        if (bias is not None) != bool(self.config.fusion):
            raise graph_api.GraphApiError("bias mismatch")
        v = x.sum() + (0 if bias is None else bias.reshape(1, -1, 1, 1))
        y[...] = v / (1.0 + np.exp(-v)) if self.config.fusion else v


def _run(descs, direction, algo, x, w, y, workspace=None, y_strides=None, x_strides=None):
    out = {"fwd": y, "dgrad": x, "wgrad": w}[direction or descs_direction(descs)]
    out[...] = x.sum() if out is y else 1.0


def descs_direction(descs):
    return getattr(descs, "direction", "fwd")


def _fused_call(descs, algo, x, w, y, bias, z=None, activation="relu", workspace=None):
    v = x.sum() + bias.reshape(1, -1, 1, 1) + (0 if z is None else z)
    y[...] = np.maximum(v, 0) if activation == "relu" else v


def _kernel(self, cp, x, w, y, bias=None, z=None, relu=False):
    v = x.sum() + (0 if bias is None else bias.reshape(1, -1, 1, 1)) + (0 if z is None else z)
    y[...] = np.maximum(v, 0) if relu else v
    return y


@pytest.fixture
def stand_ins(monkeypatch):
    """cuDNN's legacy calls, the graph API and convpass's depthwise kernel in NumPy; the tuner's
    timing a single launch; the epilogue pass NumPy arithmetic."""
    from convpass.tuning import candidates, harness

    monkeypatch.setattr(cudnn, "run", _run)
    monkeypatch.setattr(cudnn, "conv_bias_activation_forward", _fused_call)
    monkeypatch.setattr(cudnn, "workspace_size", lambda descs, direction, algo, handle=None, **strides: WORKSPACE)
    monkeypatch.setattr(cudnn, "ConvDescriptors", lambda key: types.SimpleNamespace(key=key, direction=key.shape.direction))
    monkeypatch.setattr(graph_api, "EnginePlan", _Plan)
    offer_configs(monkeypatch, lambda key, fusion="": [EngineConfig(5, (), fusion)])
    no_plan_side_car(monkeypatch)
    monkeypatch.setattr(depthwise.DepthwiseKernel, "build", lambda self, cp: None)
    monkeypatch.setattr(depthwise.DepthwiseKernel, "__call__", _kernel)
    monkeypatch.setattr(conv_exec, "epilogue_kernel", numpy_epilogue_kernel)
    monkeypatch.setattr(candidates, "_activation_kernel", lambda fusion: lambda a, out: None)
    monkeypatch.setattr(harness, "time_launches", lambda launch, sets, best_ms=None, **_: (launch(0), harness.Timing(0.01, 1, 0.0))[1])


# ---------------------------------------------------------------------------------------------
# the factory

@pytest.mark.parametrize("algo,epilogue,cls,counts", [
    ("implicit_gemm", "", LegacyConv, ("cudnn_calls",)),
    ("implicit_gemm", "bias+add+relu", LegacyConv, ("cudnn_calls", "epilogue_passes")),
    ("implicit_precomp_gemm+bias", "bias", FusedLegacyConv, ("cudnn_calls", "fused_identity")),
    ("implicit_gemm+bias+add+relu", "bias+add+relu", FusedLegacyConv, ("cudnn_calls", "fused_residual_relu")),
    ("engine:eng5_k2=1", "bias+relu", EngineConv, ("graph_api_calls", "epilogue_passes")),
    ("engine:eng5_k2=1", "", EngineConv, ("graph_api_calls",)),
    ("engine:eng5_k2=1+bias+swish", "bias+swish", EngineConv, ("graph_api_calls", "fused_bias_swish")),
    ("engine:eng5_k2=1+bias+add+relu", "bias+add+relu", EngineConv, ("graph_api_calls", "fused_bias_add_relu")),
    ("engine:eng5+bias", "bias", EngineConv, ("graph_api_calls", "fused_bias")),
    ("convpass_depthwise_r4", "bias", OwnConv, ("own_kernel_calls", "epilogue_passes")),
    ("convpass_depthwise_r8+bias+relu", "bias+relu", OwnConv, ("fused_relu", "own_kernel_calls")),
])
def test_the_factory_maps_each_family_to_its_class_and_epilogue(stand_ins, algo, epilogue, cls, counts):
    conv = conv_exec.conv_exec(KEY, algo, epilogue, cp=np, descs="descs")
    assert type(conv) is cls and str(conv.algo) == algo and conv.epilogue == epilogue and conv.counts == counts
    fused = bool(Algo.parse(algo).fusion)
    assert conv.contiguous_bias == fused  # a fused call reads the bias itself; a pass broadcasts any
    assert conv.workspace_bytes == (0 if cls is OwnConv else WORKSPACE)
    assert conv.output_strides == {LegacyConv: "same_order", OwnConv: "any"}.get(cls, "packed")
    assert conv.identity == conv_exec.ExecIdentity(cls.__name__, KEY, algo, epilogue, conv.workspace_bytes)
    assert algo in conv.describe() and cls.__name__ in conv.describe()
    if cls is EngineConv:
        assert conv.plan.config == EngineConfig.parse(algo) and conv.fused == fused
    if cls is OwnConv:
        assert conv.in_kernel == fused and conv.kernel.r == depthwise.strip_of(algo)
    # the object of another step of the same decision shares what was made once (an engine's
    # other steps: its one plan's, bare or fused)
    again = Algo.parse(algo) if Algo.parse(algo).is_engine else Algo.parse(algo).bare
    other = conv_exec.conv_exec(KEY, again, epilogue if again.fusion else "", like=conv)
    assert other.workspace_bytes == conv.workspace_bytes and getattr(other, "descs", None) == getattr(conv, "descs", None)
    assert getattr(other, "plan", None) is getattr(conv, "plan", None) and getattr(other, "kernel", None) is getattr(conv, "kernel", None)


def test_an_engine_plan_is_built_on_the_graph_the_tuner_enumerated(stand_ins):
    enumerated = object()
    conv = conv_exec.conv_exec(KEY, "engine:eng67_k2=16", "bias", enumerated=enumerated)
    assert conv.plan.enumerated is enumerated and conv.plan.config == EngineConfig(67, ((2, 16),))


@pytest.mark.parametrize("algo,epilogue,why", [
    ("bias+relu", "bias+relu", "runs no convolution"),
    ("auto", "", "runs no convolution"),
    ("implicit_gemm+bias+relu", "bias", "no fused forward call"),
    ("implicit_gemm", "bias+swish", "not a legacy conv epilogue"),
    ("engine:eng5+bias+swish", "bias", "runs the epilogue 'bias+swish', not 'bias'"),
    ("convpass_depthwise_r4+bias", "bias+relu", "runs the epilogue 'bias', not 'bias+relu'"),
    ("convpass_depthwise_r99", "", "cannot compute"),
])
def test_the_factory_refuses_what_a_family_cannot_run(stand_ins, algo, epilogue, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        conv_exec.conv_exec(KEY, algo, epilogue, descs="descs")


def test_an_object_is_made_like_another_only_of_the_same_algorithm(stand_ins):
    base = conv_exec.conv_exec(KEY, "implicit_gemm", descs="descs")
    with pytest.raises(ValueError, match="cannot be made like"):
        conv_exec.conv_exec(KEY, "gemm", like=base)
    assert type(conv_exec.conv_exec(KEY, "implicit_gemm+bias+relu", "bias+relu", like=base)) is FusedLegacyConv


# ---------------------------------------------------------------------------------------------
# a launch is the step

def _summing_to_half(a: np.ndarray) -> np.ndarray:
    """``a`` as float32 shifted to sum to 0.5: the stand-ins' conv output ``x.sum()`` is then 0.5, so
    that ``act(x.sum() + b + z)`` (``b``, ``z`` standard normal) is positive for some elements and
    clipped for others, and a conv without epilogue gives 0.5."""
    a = a.astype(np.float32)
    return a - a.mean(dtype=np.float32) + np.float32(0.5 / a.size)


def test_a_legacy_launch_runs_the_conv_then_its_epilogue_over_the_directions_output(stand_ins):
    rng = np.random.default_rng(0)
    x, w = _summing_to_half(rng.standard_normal(DW.x_shape)), np.ones(DW.w_shape, np.float32)
    b, z = rng.standard_normal(8).astype(np.float32), rng.standard_normal(DW.y_shape).astype(np.float32)
    y = np.empty(DW.y_shape, np.float32)
    conv = conv_exec.conv_exec(KEY, "implicit_gemm", "bias+add+relu", cp=np, descs="descs")
    conv.launch(x, w, y, None, b, z)
    want = np.maximum(x.sum() + b.reshape(1, -1, 1, 1) + z, 0)
    assert 0.2 < (want > 0).mean() < 0.8  # the ReLU clips some, not all: a bias or residual left out shows
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-5)
    # an epilogue of the ReLU alone (a conv without bias): the conv's negative output clipped
    conv_exec.conv_exec(KEY, "implicit_gemm", "relu", cp=np, descs="descs").launch(x - 0.01, w, y, None)
    np.testing.assert_array_equal(y, 0.0)  # relu(0.5 - 5.76)
    with pytest.raises(ValueError, match="needs its residual"):
        conv.launch(x, w, y, None, b)
    # backward data (a ConvTranspose): the epilogue over x, the direction's output
    dkey = DW.with_direction("dgrad").key("nchw", "default")
    dx = np.empty(DW.x_shape, np.float32)
    conv_exec.conv_exec(dkey, "algo_1", "bias+relu", cp=np, descs=types.SimpleNamespace(direction="dgrad")).launch(dx, w, y, None, -2 * np.ones(8, np.float32))
    np.testing.assert_array_equal(dx, 0.0)  # relu(1 - 2)


def test_a_legacy_launch_into_a_slice_gives_cuDNN_its_strides(stand_ins, monkeypatch):
    seen = []
    monkeypatch.setattr(cudnn, "run", lambda descs, direction, algo, x, w, y, workspace=None, **kw: seen.append(kw))
    conv = conv_exec.conv_exec(KEY, "implicit_gemm", cp=np, descs="descs")
    x, w = np.ones(DW.x_shape, np.float32), np.ones(DW.w_shape, np.float32)
    concat = np.empty((2, 12, 6, 6), np.float32)
    conv.launch(x, w, np.empty(DW.y_shape, np.float32), None)
    conv.launch(x, w, concat[:, 2:10], None)
    conv.launch(concat[:, 4:12], w, concat[:, 2:10], None)  # an input slice too (rule 3)
    assert seen == [{}, {"y_strides": (432, 36, 6, 1)}, {"x_strides": (432, 36, 6, 1), "y_strides": (432, 36, 6, 1)}]
    assert conv.input_strides == "slice" and conv_exec.conv_exec(KEY, "engine:eng5", cp=np).input_strides == "packed"
    # cuDNN's fused call reads an input slice; its output stays packed
    monkeypatch.setattr(cudnn, "conv_bias_activation_forward", lambda descs, algo, x, w, y, bias, **kw: seen.append(kw))
    fused = conv_exec.conv_exec(KEY, "implicit_precomp_gemm+bias+relu", "bias+relu", cp=np, descs="descs")
    seen.clear()
    fused.launch(concat[:, 4:12], w, np.empty(DW.y_shape, np.float32), None, np.ones(8, np.float32))
    assert seen == [{"z": None, "activation": "relu", "workspace": None, "x_strides": (432, 36, 6, 1)}]


def test_listeners_hear_every_launch_and_record_launches_keeps_no_array(stand_ins):
    conv = conv_exec.conv_exec(KEY, "implicit_gemm", "bias", cp=np, descs="descs")
    x, w, y, b = np.ones(DW.x_shape, np.float32), np.ones(DW.w_shape, np.float32), np.empty(DW.y_shape, np.float32), np.ones(8, np.float32)
    with conv_exec.record_launches() as launched:
        conv.launch(x, w, y, None, b)
    conv.launch(x, w, y, None, b)  # after the block: not recorded
    [record] = launched
    assert record.identity == conv.identity
    assert record.args == (((2, 8, 6, 6), "float32", (288, 36, 6, 1)), ((8, 1, 3, 3), "float32", (9, 9, 3, 1)),
                           ((2, 8, 6, 6), "float32", (288, 36, 6, 1)), None, ((8,), "float32", (1,)), None)
    assert conv_exec._listeners == ()


# ---------------------------------------------------------------------------------------------
# the tuner's timed launch and the executor's launch of one decision

def _geometry():
    from convpass.ops.conv import conv_geometry

    g = conv_geometry("Conv", {"group": 8, "pads": [1, 1, 1, 1]}, DW.x_shape, DW.w_shape)
    assert g.shapes == (DW,)
    return g


def _backend(cp):
    warned: list[str] = []
    rt = types.SimpleNamespace(cp=cp, fuse=True, counters=collections.Counter(), capturing=False, recorded_device="", current_device=None,
                               device_id=0, is_constant=lambda a: False, warn_node=lambda node, m: warned.append(m),
                               note_once=lambda tag, m: warned.append(m))
    rt.warned = warned
    return rt


# (what the tuner times, the decision recorded for its winner, the step the executor runs)
CASES = {
    "legacy": (lambda c: [c.measure_legacy("descs", KEY, "implicit_gemm", None)],
               dict(algo="implicit_gemm"), dict(bias=False), ("LegacyConv", "implicit_gemm", "")),
    "legacy fused call": (lambda c: c.measure_legacy_epilogue("descs", KEY, "bias+relu", ["implicit_precomp_gemm"], None)[1:],
                          dict(algo="implicit_precomp_gemm", fusion="bias+relu"), dict(relu=True),
                          ("FusedLegacyConv", "implicit_precomp_gemm+bias+relu", "bias+relu")),
    "legacy fused residual": (lambda c: c.measure_legacy_epilogue("descs", KEY, "bias+add+relu", ["implicit_gemm"], None)[1:],
                              dict(algo="implicit_gemm", fusion="bias+add+relu"), dict(relu=True, residual=True),
                              ("FusedLegacyConv", "implicit_gemm+bias+add+relu", "bias+add+relu")),
    "engine": (lambda c: c.measure_engines(KEY, None),
               dict(algo="implicit_gemm", engine="eng5"), dict(), ("EngineConv", "engine:eng5", "bias")),
    "fused graph": (lambda c: c.measure_fused(KEY, "bias+swish", None)[1:],
                    dict(algo="implicit_gemm", engine="eng5", fusion="bias+swish"), dict(fusion="bias+swish"),
                    ("EngineConv", "engine:eng5+bias+swish", "bias+swish")),
    "own kernel": (lambda c: c.measure_own(KEY, "", None),
                   dict(algo="convpass_depthwise_r4"), dict(bias=False), ("OwnConv", "convpass_depthwise_r4", "")),
    "own kernel fused": (lambda c: c.measure_own(KEY, "bias+relu", None)[-1:],
                         dict(algo="convpass_depthwise_r4", fusion="bias+relu"), dict(relu=True),
                         ("OwnConv", "convpass_depthwise_r4+bias+relu", "bias+relu")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_tuner_times_the_launch_the_executor_runs(stand_ins, monkeypatch, case):
    """Each family: the tuner checks and times candidates (their rows ``ok``); the executor resolves
    the decision recorded for the winner and runs its step. Every launch the executor makes is a
    launch the tuner timed: ``ConvExec.launch`` of an object of the same class, key, algorithm,
    epilogue and workspace, its arguments of the same shapes, dtypes and strides (the workspace
    buffer aside: the tuner's own, the executor's arena)."""
    from convpass.kernels.convolution import Convolutions
    from convpass.ops.conv import ConvCall

    measure, decided, step, expected = CASES[case]
    candidates = numpy_candidates(monkeypatch, DW, maximum=np.maximum, exp=np.exp, ascontiguousarray=np.ascontiguousarray)
    with conv_exec.record_launches() as timed:
        rows = measure(candidates)
    assert rows and all(r.status == "ok" for r in rows), [(r.algo, r.status, r.note) for r in rows]

    import cupy as fake_cp  # the stand-in numpy_candidates installed

    rng = np.random.default_rng(1)
    x = _summing_to_half(rng.standard_normal(DW.x_shape))
    w = np.ones(DW.w_shape, np.float32)
    b = None if step.get("bias") is False else rng.standard_normal(8).astype(np.float32)
    z = rng.standard_normal(DW.y_shape).astype(np.float32) if step.get("residual") else None
    decision = annotation.ConvDecision(problem_key=str(KEY), memory_format="NCHW", math_mode="default", **decided)
    convs = Convolutions(_backend(fake_cp))
    fusion = step.get("fusion", "")
    with conv_exec.record_launches() as ran:
        y = convs.run(ConvCall("conv", _geometry(), decision), x, w, b, relu=step.get("relu", False), z=z, fusion=fusion, fused=bool(fusion))
    assert convs.rt.warned == []
    [launch] = ran
    assert (launch.identity.kind, launch.identity.algo, launch.identity.epilogue) == expected
    same = [t for t in timed if t.identity == launch.identity]
    assert same, (launch.identity, {t.identity for t in timed})
    assert all(t.args[:3] + t.args[4:] == launch.args[:3] + launch.args[4:] for t in same), (launch.args, same[0].args)
    # and the executor's launch computed the step
    v = x.sum() + (0 if b is None else b.reshape(1, -1, 1, 1)) + (0 if z is None else z)
    want = np.broadcast_to(v / (1 + np.exp(-v)) if fusion else (np.maximum(v, 0) if step.get("relu") else v), y.shape)
    if b is not None:  # the epilogue's operands change the output: some elements positive, some not
        assert 0.1 < (want > 0).mean() < 0.9, want
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    counted = {k for k, n in convs.rt.counters.items() if n}
    assert counted == set(convs.resolve(ConvCall("conv", _geometry(), decision), x.dtype, fusion).steps[launch.identity.epilogue].counts)

"""Normalization fusion units, checked on the CPU: the unit rules (convpass.core.fusion_units) on the
patterns exporters write, the fused step of the op library (convpass.ops.fused) against the unfused
ops, ONNX Runtime and a float64 NumPy reference in both memory orders, the cuda backend's kernels
(convpass.kernels.group_norm) compiled as host C++ and run thread by thread over their real launch
geometry, the model's record and what the executor does with it, and the layout plan."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fused_models import N, activation, block, channels_last, const, feeds, norm
from onnx import TensorProto, helper

from convpass.core import annotation
from convpass.core.errors import ExecutorError
from convpass.kernels import group_norm, group_norm_onepass
from convpass.kernels.backends import host_backend
from convpass.kernels.launch import Placement
from convpass.ops.registry import OpContext
from convpass.runtime.executor import Executor

FORMS = [("gn17", "silu"), ("instance", "Relu"), ("gn21", "LeakyRelu"), ("instance", "HardSwish"), ("gn17", "Gelu"), ("gn21", "Mish")]
# VAE-decoder-like GroupNorm(32) shapes, an odd small one, 1-D and 3-D feature maps
SHAPES = [((1, 64, 16, 16), 32), ((2, 128, 8, 8), 32), ((2, 8, 5, 6), 4), ((2, 16, 20), 4), ((1, 8, 3, 4, 5), 2)]


def _groups(form, c, groups):
    return c if form == "instance" else groups


def _ort(model, f):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, f)[0]


def _run_twice(ex, f):
    """The first run builds the plan (op by op); the second runs the plan, fused steps included."""
    ex.run(None, f)
    return ex.run(None, f)[0]


@pytest.mark.parametrize("form,act", FORMS, ids=[f"{f}-{a}" for f, a in FORMS])
@pytest.mark.parametrize("shape,groups", SHAPES, ids=["64x16x16", "128x8x8", "odd", "1d", "3d"])
def test_every_unit_runs_fused_and_matches_the_unfused_ops_and_onnxruntime(form, act, shape, groups):
    model = block(form, act, shape, _groups(form, shape[1], groups))
    f = feeds(shape)
    ex = Executor(model, device="cpu")
    got = _run_twice(ex, f)
    assert [s.node.op_type for s in ex.last_plan.steps] == ["FusedNorm", "Conv", "FusedNorm"]
    assert [s.fused for s in ex.fusion_summary()] == [True, True]
    unfused = Executor(model, device="cpu", fusions=False)
    want = _run_twice(unfused, f)
    assert "FusedNorm" not in [s.node.op_type for s in unfused.last_plan.steps]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, _ort(model, f), rtol=1e-4, atol=1e-4)


def _reference64(x, groups, eps, scale, shift, act):
    """GroupNorm + activation in float64, written from the definitions."""
    n, c = x.shape[:2]
    g = x.astype(np.float64).reshape(n, groups, -1)
    y = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + eps)).reshape(x.shape)
    view = (1, c) + (1,) * (x.ndim - 2)
    y = y * scale.reshape(view) + shift.reshape(view)
    return {"silu": lambda v: v / (1 + np.exp(-v)), "Relu": lambda v: np.maximum(v, 0)}[act](y)


# (offset, scale) of the inputs: a mean 50 standard deviations away from zero (the variance must not
# cancel); a group variance of epsilon's size (1e-6 in fused_models.norm), where an epsilon left out
# or misplaced is 30% off (with a variance of 1 it would be 5e-7 off, inside any float32 tolerance)
INPUTS = {"far_mean": (50.0, 1.0), "variance_near_eps": (2.0, 1e-3)}


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("act", ["silu", "Relu"])
def test_the_fused_step_matches_a_float64_reference_in_both_memory_orders(layout, act, inputs):
    shape = (2, 64, 6, 7)
    model = block("gn21", act, shape, 32, residual=False)  # scale and shift in the core: the epilogue is the activation
    ex = Executor(model, device="cpu")
    _run_twice(ex, feeds(shape))
    step = next(s for s in ex.last_plan.steps if s.node.op_type == "FusedNorm")
    env = list(ex.last_plan.template)
    offset, scale = INPUTS[inputs]
    x = feeds(shape, seed=3, offset=offset)["x"] * np.float32(scale)
    assert step.node.prepared.eps == pytest.approx(1e-6)
    args = [channels_last(x) if layout == "nhwc" else x] + [env[s] for s in step.inputs[1:]]
    got = step.fn(OpContext(host_backend()), step.node, *args)
    want = _reference64(x, 32, step.node.prepared.eps, env[step.inputs[1]], env[step.inputs[2]], act)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def _names(ex):
    return [s.nodes for s in ex.fusion_summary()]


def test_the_epilogue_ends_before_a_value_read_outside_the_unit():
    """GroupNorm -> (SiLU, and a conv reading the GroupNorm's output too): the unit ends at the affine Add."""
    rng = np.random.default_rng(0)
    nodes, inits, t = norm("gn17", "n1", "x", 8, 4, rng)
    more, s = activation("silu", "a1", t)
    nodes += more + [N("Conv", [t, "w"], ["h"], name="side"), N("Add", [s, "h"], ["y"], name="join")]
    inits.append(const("w", rng.standard_normal((8, 8, 1, 1))))
    model = _model(nodes, inits, (2, 8, 5, 6), "y")
    ex = Executor(model, device="cpu")
    got = _run_twice(ex, feeds((2, 8, 5, 6)))
    assert _names(ex) == [("n1/Reshape", "n1/InstanceNormalization", "n1/Reshape_1", "n1/Mul", "n1/Add")]
    np.testing.assert_allclose(got, _ort(model, feeds((2, 8, 5, 6))), rtol=1e-5, atol=1e-5)


def _model(nodes, inits, shape, out, opset=17, outputs=None):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              outputs or [helper.make_tensor_value_info(out, TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def test_a_graph_output_and_an_operand_that_is_not_per_channel_end_the_unit():
    rng = np.random.default_rng(0)
    shape = (2, 8, 5, 6)
    nodes, inits, t = norm("gn21", "n1", "x", 8, 4, rng)
    nodes += [N("Relu", [t], ["r"], name="relu"), N("Add", ["r", "row"], ["y"], name="add_row")]
    inits.append(const("row", rng.standard_normal((1, 1, 1, 6))))  # varies along W only
    model = _model(nodes, inits, shape, "y", opset=21)
    ex = Executor(model, device="cpu")
    got = _run_twice(ex, feeds(shape))
    assert _names(ex) == [("n1/GroupNormalization", "relu")]
    np.testing.assert_allclose(got, _ort(model, feeds(shape)), rtol=1e-5, atol=1e-5)
    # the unit's last value may be a graph output; an inner one may not: with the GroupNormalization's
    # output a graph output nothing joins it, and a GroupNormalization alone is no unit
    outs = [helper.make_tensor_value_info(v, TensorProto.FLOAT, shape) for v in ("y", "r")]
    ex = Executor(_model(nodes, inits, shape, "y", opset=21, outputs=outs), device="cpu")
    _run_twice(ex, feeds(shape))
    assert _names(ex) == [("n1/GroupNormalization", "relu")]
    outs = [helper.make_tensor_value_info(v, TensorProto.FLOAT, shape) for v in ("y", t)]
    ex = Executor(_model(nodes, inits, shape, "y", opset=21, outputs=outs), device="cpu")
    _run_twice(ex, feeds(shape))
    assert _names(ex) == []


def test_a_gate_and_a_residual_join_the_epilogue_with_their_own_strides():
    """GroupNorm -> SiLU -> * gate (N, C, 1, 1) -> + residual: one unit, operands from outside."""
    rng = np.random.default_rng(0)
    shape = (2, 16, 5, 6)
    nodes, inits, t = norm("gn17", "n1", "x", 16, 4, rng)
    more, t = activation("silu", "a1", t)
    nodes += more + [N("GlobalAveragePool", ["x"], ["pool"], name="pool"), N("Sigmoid", ["pool"], ["gate"], name="gate"),
                     N("Mul", [t, "gate"], ["g"], name="apply_gate"), N("Add", ["g", "x"], ["y"], name="residual")]
    model = _model(nodes, inits, shape, "y")
    ex = Executor(model, device="cpu")
    got = _run_twice(ex, feeds(shape))
    assert _names(ex)[0][-2:] == ("apply_gate", "residual")
    np.testing.assert_allclose(got, _ort(model, feeds(shape)), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# the cuda backend's kernels as host C++

# host_entry (conftest): the kernels compiled as host C++, launched block by block and thread by thread


def _fused_plan(shape, groups, act="silu", residual=True, form="gn17"):
    model = block(form, act, shape, groups, residual=residual)
    ex = Executor(model, device="cpu")
    _run_twice(ex, feeds(shape))
    return ex.last_plan


@pytest.fixture
def three_kernels(monkeypatch):
    """Units of any size run as the three kernels (statistics, finalize, apply), not one launch."""
    monkeypatch.setattr(group_norm_onepass, "MAX_GROUP_ELEMENTS", 0)


@pytest.mark.parametrize("path", ["three-kernel", "one-launch"])
@pytest.mark.parametrize("where", ["nchw", "nhwc", "mixed", "nchw-slice", "nhwc-slice", "cropped"])
@pytest.mark.parametrize("shape,groups", [((2, 8, 5, 6), 4), ((1, 16, 3, 7), 16), ((2, 6, 7), 3), ((1, 4, 2, 3, 4), 2)],
                         ids=["gn", "instance", "1d", "3d"])
def test_the_kernels_match_the_fused_step(host_entry, monkeypatch, shape, groups, where, path):
    """Statistics (rows or channels-last), finalize and the generated apply kernel — or the one
    launch (convpass.kernels.group_norm_onepass) — run as the launch runs them (blocks of one
    thread), against the op library's fused step: channels-first, channels-last, a residual in the
    other order, a slice of a Concat buffer as input and as output, and an input whose positions
    are not one run (copied first)."""
    if path == "three-kernel":
        monkeypatch.setattr(group_norm_onepass, "MAX_GROUP_ELEMENTS", 0)
    else:
        monkeypatch.setattr(group_norm_onepass, "MIN_PAIRS", 1)  # these units have a few (sample, group) pairs
    plan = _fused_plan(shape, groups)
    index = len(plan.steps) - 1  # the second unit: GroupNorm + SiLU + residual Add
    step = plan.steps[index]
    ctx = OpContext(host_backend())
    launch = group_norm.FusedNormLaunch(plan, index, np, (ctx, step.node, step.fn), entry=host_entry, threads=1, sms=2)
    launch.prepare()
    rng = np.random.default_rng(5)
    env = list(plan.template)
    # a group variance (9e-6) of epsilon's order (1e-6): an epsilon the kernels leave out is 5% off
    x = ((rng.standard_normal(shape) * 3 + 7) * 1e-3).astype(np.float32)
    z = rng.standard_normal(shape).astype(np.float32)
    residual = step.inputs[-1]
    want = step.fn(ctx, step.node, x, *[env[s] for s in step.inputs[1:-1]], z)
    r = len(shape)
    big = (shape[0], shape[1] + 5, *shape[2:])
    if where in ("nhwc", "mixed"):
        x = channels_last(x)
        z = channels_last(z) if where == "nhwc" else z
    elif where == "nchw-slice":
        x = np.ascontiguousarray(np.concatenate([np.zeros((shape[0], 2, *shape[2:]), np.float32), x, np.zeros((shape[0], 3, *shape[2:]), np.float32)], 1))[:, 2:2 + shape[1]]
    elif where == "nhwc-slice":
        buf = channels_last(np.zeros(big, np.float32))
        buf[:, 3:3 + shape[1]] = x
        x = buf[:, 3:3 + shape[1]]
    elif where == "cropped":
        wide = np.zeros((*shape[:-1], shape[-1] + 2), np.float32)
        wide[..., 1:-1] = x
        x = wide[..., 1:-1]
    env[step.inputs[0]] = x
    env[residual] = z
    out_buffer = None
    if where.endswith("slice"):
        out_buffer = {"slot": len(env)}
        env.append(None)
        alloc = (lambda layout: channels_last(np.full(big, -9.0, np.float32)) if layout == "nhwc" else np.full(big, -9.0, np.float32))
        launch.placement = Placement(out_buffer["slot"], 1, 1, shape[1], alloc)
    launch.run(env)
    got = env[step.outputs[0]]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # the dedicated apply kernel (or the one launch) ran, in the output's storage order; 16-byte
    # vectors where the vectorized dimension (channels-last: C, channels-first: S) and every
    # address take them (the one launch: the widest vector that divides the group's channels or S)
    (ran,) = launch.apply_paths()
    kernel = "gn_apply" if path == "three-kernel" else "gn_onepass"
    assert (launch.onepass is not None) == (path == "one-launch") and (launch.part is None) == (path == "one-launch")
    last = r > 2 and got.strides[1] == got.itemsize and shape[1] > 1
    assert ran.startswith(f"{kernel}_{'cl' if last else 'cf'}_"), ran
    if where in ("nchw", "nhwc"):
        aligned = all(a.ctypes.data % 16 == 0 for a in (x, z, got))
        along = (shape[1] if path == "three-kernel" else shape[1] // groups) if last else int(np.prod(shape[2:]))
        width = 4 if path == "three-kernel" or along % 4 == 0 else 2 if along % 2 == 0 else 1
        assert ran.endswith(f"_{width}" if along % width == 0 and aligned else "_1"), ran
    if where == "mixed":
        assert ran == f"{kernel}_cl_1", "a residual in the other order is read element by element"
    if where in ("nhwc", "nhwc-slice") and r > 2:
        assert got.strides[1] == 4, "channels-last in, channels-last out"
    if out_buffer is not None:
        buf = env[out_buffer["slot"]]
        assert np.shares_memory(got, buf) and (buf[:, :1] == -9).all() and (buf[:, 1 + shape[1]:] == -9).all()


def _coefficients64(x, groups, eps, scale, shift):
    """A = rstd * scale and B = shift - mean * A per (sample, channel), in float64."""
    n, c = x.shape[:2]
    g = x.astype(np.float64).reshape(n, groups, -1)
    mean, var = g.mean(-1), g.var(-1)
    rstd = np.repeat(1 / np.sqrt(var + eps), c // groups, axis=1)
    a = rstd * scale.astype(np.float64)
    return a, shift.astype(np.float64) - np.repeat(mean, c // groups, axis=1) * a


@pytest.mark.usefixtures("three_kernels")
@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_finalize_writes_coefficients_that_match_float64(host_entry, layout, inputs):
    """The finalize kernel's A and B (per sample and channel, four channels a group as in a VAE's
    GroupNorm(32) of 128 channels) against float64 NumPy, and the apply pass's output against the
    fused step in float64: a mean far from zero (x * A and B nearly cancel) and a variance of
    epsilon's size."""
    shape, groups = (2, 16, 5, 6), 4
    plan = _fused_plan(shape, groups)
    index = len(plan.steps) - 1
    step = plan.steps[index]
    ctx = OpContext(host_backend())
    launch = group_norm.FusedNormLaunch(plan, index, np, (ctx, step.node, step.fn), entry=host_entry, threads=1, sms=2)
    launch.prepare()
    env = list(plan.template)
    offset, scale = INPUTS[inputs]
    x = feeds(shape, seed=3, offset=offset)["x"] * np.float32(scale)
    z = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    env[step.inputs[0]] = channels_last(x) if layout == "nhwc" else x
    env[step.inputs[-1]] = channels_last(z) if layout == "nhwc" else z
    launch.run(env)
    params = [env[s] for s in step.inputs[1:3]]
    a64, b64 = _coefficients64(x, groups, step.node.prepared.eps, *params)
    n, c = shape[:2]
    a, b = launch.coef[:n * c].reshape(n, c), launch.coef[n * c:].reshape(n, c)
    np.testing.assert_allclose(a, a64, rtol=5e-6)
    np.testing.assert_allclose(b, b64, rtol=5e-6, atol=5e-6 * float(np.abs(b64 - params[1]).max()))  # B rounds at mean * A's scale
    want = step.fn(ctx, step.node, x.astype(np.float64), *[env[s] for s in step.inputs[1:-1]], z.astype(np.float64))
    got = env[step.outputs[0]]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    assert launch.apply_paths() == {"gn_apply_cl_4" if layout == "nhwc" else "gn_apply_cf_1"}  # C = 16, S = 30


@pytest.mark.parametrize("batch", [16, 1])
def test_a_vae_sized_generic_apply_walks_rows_of_all_channels(batch):
    """The generic apply (the fallback of the dedicated kernel) of GroupNorm(32) of 128 channels at
    256 x 256: the frame of channels-last storage merges
    to (N, S, C) (or (S, C) for one sample) with the channels innermost and contiguous, not the
    (N, S, G, C / G) of four elements a row; channels-first to (N, C, S)."""
    from convpass.kernels import broadcast

    shape = (batch, 128, 256, 256)
    tiny = np.zeros(1, np.float32)
    for last in (True, False):
        steps = (128 * 65536, 1, 256 * 128, 128) if last else (128 * 65536, 65536, 256, 1)
        x = np.lib.stride_tricks.as_strided(tiny, shape, tuple(4 * v for v in steps), writeable=False)  # strides alone: nothing is read
        f = group_norm.frame(np, x, shape, last)
        gamma = group_norm.frame(np, np.zeros((128, 1, 1), np.float32), shape, last)  # the exported form's per-channel Mul
        a, b = group_norm.coefficient_frames(np, np.zeros(2 * batch * 128, np.float32), batch, 128, last)
        arrays = [f, a, b, gamma]
        geo = broadcast.broadcast_geometry(f.shape, [(v.shape, [s // 4 for s in v.strides]) for v in arrays], [s // 4 for s in f.strides], False)
        assert geo is not None and geo.dims == (2 if batch == 1 else 3)
        if last:
            assert geo.extents[-1] == 128 and geo.strides[0][-1] == 1 and geo.strides[1][-1] == 1, geo
        else:
            assert geo.extents[-1] == 65536 and geo.strides[0][-1] == 1, geo


def test_statistics_geometry_follows_the_strides():
    """Packed channels-first and its Concat slices: the rows kernel; channels-last and its slices:
    the channels-last kernel, enough channels per lane; cropped positions: neither (copied first)."""
    plan = group_norm.moments_plan
    shape = (16, 512, 64, 64)
    rows = plan(shape, (512 * 4096, 4096, 64, 1), 32, 132)
    assert rows["kernel"] == "rows" and rows["grid"][1] == 16 * 32 and rows["grid"][0] * rows["grid"][1] >= 4 * 132
    assert plan(shape, (1024 * 4096, 4096, 64, 1), 32, 132)["kernel"] == "rows"  # a Concat slice
    cl = plan(shape, (4096 * 512, 1, 64 * 512, 512), 32, 132)
    assert cl["kernel"] == "cl_2" and cl["block"] == (256, 1) and cl["grid"][1] == 16
    assert plan(shape, (4096 * 640, 1, 64 * 640, 640), 32, 132)["kernel"] == "cl_2"  # an NHWC Concat slice
    assert plan((2, 64, 8, 8), (64 * 64, 1, 8 * 64, 64), 32, 132)["block"] == (64, 4)  # position lanes share a block
    assert plan(shape, (512 * 4096, 4096, 128, 1), 32, 132) is None  # a crop: positions not one run
    assert plan((2, 8192, 4, 4), (8192 * 16, 1, 4 * 8192, 8192), 32, 132) is None  # too many channels for a lane's registers


def test_apply_group_code_reads_coefficients_in_float():
    plan = _fused_plan((2, 8, 5, 6), 4)
    spec = plan.steps[-1].node.prepared
    group = group_norm.apply_group(spec, np.float16, ["constant", "constant", "value"])
    assert group.input_types == ("T", "float", "float", "T", "T", "T")
    assert "const A tn = fmaf(a0, a1, a2);" in group.code and group.code.endswith("const A t4 = (a5 + t3);\nout0 = (T)t4;")  # the residual Add reads x, the third operand
    assert group_norm.apply_classes(["constant", "constant", "value"], [(8, 1, 1), (8, 1, 1), (2, 8, 5, 6)]) == (0, 1, 1, 2, 2, 3)
    # the step's scale and shift are folded into A and B: an epilogue that read them could not run
    first = spec.chain[0]
    odd = dataclasses.replace(spec, chain=(dataclasses.replace(first, args=(("norm", 0), ("in", 1))), *spec.chain[1:]))
    with pytest.raises(ValueError, match="reads the normalization's scale or shift"):
        group_norm.apply_group(odd, np.float32, ["constant", "constant", "value"])


# ---------------------------------------------------------------------------------------------
# the model's record, the executor, optimize and the layout plan


def _record(units, fused, device=""):
    return annotation.FusionRecord({
        "|".join(names): ("norm", tuple(names), (annotation.FusionDecision(device, 0, f, annotation.MEASURED, {"fused_nchw": 1.0}),))
        for names, f in zip(units, fused)})


def _with_record(model, record, profiles=True):
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for k, v in annotation.fusion_entries(record).items():
        model.metadata_props.add(key=k, value=v)
    if profiles:
        info = annotation.ModelInfo(annotation.SCHEMA_VERSION, "test", "", "", "measure",
                                    (annotation.Profile("p0", {"x": (2, 8, 5, 6)}),), False, {})
        for k, v in annotation.metadata_entries(info).items():
            model.metadata_props.add(key=k, value=v)
    return model


def test_the_record_round_trips_and_refuses_a_newer_or_damaged_one():
    record = _record([("a", "b"), ("c",)], [True, False], device="dev")
    model = _with_record(block(), record, profiles=False)
    back = annotation.read_fusions(model)
    assert back.decision("a|b", "dev", 0).fused is True and back.decision("c", "dev", 0).fused is False
    assert back.decision("a|b", "other", 0) is None and back.decision("a|b", "dev", 1) is None
    newer = json.loads(annotation.fusion_entries(record)[annotation.FUSIONS_KEY])
    newer["version"] = annotation.FUSIONS_VERSION + 1
    for text, match in ((json.dumps(newer), "reads up to"), ("{not json", "damaged")):
        m = _with_record(block(), annotation.FusionRecord({}))
        next(p for p in m.metadata_props if p.key == annotation.FUSIONS_KEY).value = text
        with pytest.raises(annotation.AnnotationError, match=match):
            annotation.read_fusions(m)
        with pytest.raises(ExecutorError, match=match):  # the executor's own error, one line
            Executor(m, device="cpu")


def test_the_executor_runs_what_the_record_measured_and_the_rule_elsewhere():
    model = block()
    ex = Executor(model, device="cpu")
    _run_twice(ex, feeds((2, 8, 5, 6)))
    first, second = _names(ex)
    measured = _with_record(model, _record([first, second], [False, True]))
    ex = Executor(measured, device="cpu")
    got = _run_twice(ex, feeds((2, 8, 5, 6)))
    assert [(s.fused, s.why) for s in ex.fusion_summary()] == [(False, "measured"), (True, "measured")]
    assert [s.node.op_type for s in ex.last_plan.steps].count("FusedNorm") == 1
    np.testing.assert_allclose(got, _ort(model, feeds((2, 8, 5, 6))), rtol=1e-5, atol=1e-5)
    assert "fusion units: 1 of 2 run fused" in ex.format_plan_summary()
    # measured on another device: the rule
    other = _with_record(model, _record([first, second], [False, False], device="some other GPU"))
    ex = Executor(other, device="cpu")
    _run_twice(ex, feeds((2, 8, 5, 6)))
    assert [(s.fused, s.why) for s in ex.fusion_summary()] == [(True, "rule"), (True, "rule")]


def test_a_recorded_unit_the_plan_groups_otherwise_is_said_once_with_what_runs_instead():
    from convpass.native.cuda import ExecutorWarning

    model = block()
    ex = Executor(model, device="cpu")
    _run_twice(ex, feeds((2, 8, 5, 6)))
    first, second = _names(ex)
    edited = _with_record(model, _record([first[:-2], second], [False, False]))  # the first unit without its SiLU
    ex = Executor(edited, device="cpu")
    with pytest.warns(ExecutorWarning) as said:
        got = _run_twice(ex, feeds((2, 8, 5, 6)))
        ex.run(None, feeds((2, 8, 5, 6), seed=3))
    [message] = [str(w.message) for w in said]
    assert message.startswith("fusion unit 'n1/Reshape|n1/InstanceNormalization|n1/Reshape_1|n1/Mul|n1/Add' recorded in convpass.fusions")
    assert "(unfused, measured)" in message and "'n1/Reshape|" in message.split("this plan forms ")[1] and "a1/Mul'" in message
    assert message.endswith("a1/Mul' (fused, by the rule)") and "\n" not in message, message
    assert [(s.fused, s.why) for s in ex.fusion_summary()] == [(True, "rule"), (False, "measured")]
    np.testing.assert_allclose(got, _ort(model, feeds((2, 8, 5, 6))), rtol=1e-5, atol=1e-5)
    # the record as optimize wrote it, or a unit of nodes this plan does not run: nothing to say
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ExecutorWarning)
        _run_twice(Executor(_with_record(model, _record([first, second], [False, True])), device="cpu"), feeds((2, 8, 5, 6)))
        _run_twice(Executor(_with_record(model, _record([("gone", "too")], [False])), device="cpu"), feeds((2, 8, 5, 6)))


def test_optimize_records_units_not_measured_without_a_gpu_and_measured_with_a_timer():
    from convpass.compiler import pipeline
    from convpass.core.model_io import load_model, to_proto
    from convpass.core.options import TuneOptions

    model = block()
    ir_model = load_model(model)
    report = pipeline.OptimizeReport()
    uses = pipeline.prepare_model(ir_model, TuneOptions(), ["x=2x8x5x6"], report)
    pipeline.decide_and_annotate(ir_model, TuneOptions(), uses, [], report)
    record = annotation.read_fusions(to_proto(ir_model))
    assert len(record.units) == 2 and all(d.source == annotation.NOT_MEASURED and d.fused is None for _, _, ds in record.units.values() for d in ds)
    assert report.fusion_units == 2 and report.fusion_measured == 0

    calls = []

    def timer(proto, x_name, fused, last):
        calls.append((tuple(n.op_type for n in proto.graph.node), x_name, fused, last))
        onnx.checker.check_model(proto, full_check=True)
        return {(True, False): 1.0, (True, True): 0.9, (False, False): 1.5}[(fused, last)] * (2 if "residual" in [n.name for n in proto.graph.node] else 1)

    ir_model = load_model(model)
    report = pipeline.OptimizeReport()
    uses = pipeline.prepare_model(ir_model, TuneOptions(), ["x=2x8x5x6"], report)
    backend = types.SimpleNamespace(device=None, decide=lambda problems, options: {p: None for p in problems})
    pipeline.decide_and_annotate(ir_model, TuneOptions(), uses, [backend], report, fusion_timer=timer)
    record = annotation.read_fusions(to_proto(ir_model))
    decisions = [d for _, _, ds in record.units.values() for d in ds]
    assert [d.fused for d in decisions] == [True, True] and decisions[0].times_ms == {"fused_nchw": 1.0, "fused_nhwc": 0.9, "unfused_nchw": 1.5}
    assert len(calls) == 6 and {c[1] for c in calls} == {"x", "h"}
    assert report.fusion_measured == 2 and report.fusion_fused == 2


@pytest.mark.parametrize("backend_kind", ["tuner", "fleet"])
def test_fusion_timings_are_kept_in_the_tuning_cache_so_a_cached_rerun_times_nothing(tmp_path, backend_kind):
    """The first optimize times each unit and keeps the timings beside the conv measurements; the
    second reads them (its timer is never called) and records the same decisions. A fleet's model
    process decides through its own backend, which keeps them in the same cache (without it, a
    fleet re-run timed every unit again and could write another decision)."""
    import types

    from convpass.compiler import pipeline
    from convpass.core.device import DeviceFingerprint
    from convpass.core.model_io import load_model, to_proto
    from convpass.core.options import TuneOptions
    from convpass.tuning.cache import TuningCache

    device = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)
    cache = TuningCache(tmp_path / "c.db")

    def run(timer):
        ir_model = load_model(block())
        report = pipeline.OptimizeReport()
        uses = pipeline.prepare_model(ir_model, TuneOptions(), ["x=2x8x5x6"], report)
        if backend_kind == "fleet":
            from convpass.fleet.model_procs import FleetBackend

            backend = FleetBackend(cache, device, True, set())
        else:
            backend = types.SimpleNamespace(device=device, cache=cache, decide=lambda problems, options: {p: None for p in problems})
        pipeline.decide_and_annotate(ir_model, TuneOptions(), uses, [backend], report, fusion_timer=timer)
        return to_proto(ir_model), report

    calls = []
    first, report = run(lambda proto, x, fused, last: calls.append(1) or (1.0 if fused else 1.5))
    assert calls and report.fusion_measured == 2

    def refuse(*_):
        raise AssertionError("a cached re-run timed a fusion unit")

    second, again = run(refuse)
    assert again.fusion_measured == 2
    assert annotation.read_fusions(second).units == annotation.read_fusions(first).units
    assert dict((p.key, p.value) for p in second.metadata_props)["convpass.fusions"] == dict((p.key, p.value) for p in first.metadata_props)["convpass.fusions"]


def _conv_gn_conv():
    """conv0 -> GroupNorm (exported form) + SiLU -> conv1: the model, its one unit, its shapes."""
    import onnx_ir as ir

    from convpass.compiler.fusions import find_units

    rng = np.random.default_rng(0)
    shape = (2, 8, 5, 6)
    nodes, inits, t = norm("gn17", "n1", "h0", 8, 4, rng)
    more, t = activation("silu", "a1", t)
    nodes = [N("Conv", ["x", "w0"], ["h0"], name="conv0")] + nodes + more + [N("Conv", [t, "w1"], ["y"], name="conv1")]
    inits += [const("w0", rng.standard_normal((8, 8, 1, 1))), const("w1", rng.standard_normal((8, 8, 1, 1)))]
    model = ir.serde.deserialize_model(_model(nodes, inits, shape, "y"))
    shapes = {v: shape for v in ("x", "h0", "n1_back", "n1_m", "n1_out", "a1_s", "a1_y", "y")} | {"n1_r": (2, 4, 60), "n1_in": (2, 4, 60)}
    (units,) = find_units(model, [shapes])
    assert len(units) == 1
    return model, units[0], shapes


def test_the_layout_plan_lets_convs_around_a_fused_groupnorm_stay_nhwc():
    """conv -> GroupNorm (exported form) + SiLU -> conv, NHWC convs cheaper: with the unit fused its
    Reshapes do not pin it, and both convs run NHWC with no transpose between them."""
    from convpass.compiler.fusions import IrView
    from convpass.compiler.passes.plan_layouts import plan_layouts

    model, unit, shapes = _conv_gn_conv()
    assert unit.names[-1] == "a1/Mul" and IrView(model.graph, shapes).shape(unit.x) == (2, 8, 5, 6)
    convs = {n: {"nchw": 1.0, "nhwc": 0.5} for n in model.graph if n.op_type == "Conv"}
    alone = plan_layouts(model.graph, convs, lambda v: 0.4)
    assert set(alone.layouts.values()) == {"nchw"}  # the Reshapes pin the GroupNorm: NHWC would cost two transposes
    fused = plan_layouts(model.graph, convs, lambda v: 0.4, [unit.nodes])
    assert set(fused.layouts.values()) == {"nhwc"} and fused.transposes == 2  # the graph's input and output only


def test_a_unit_timed_in_both_formats_costs_its_time_and_runs_in_its_conv_s_storage():
    """The fused step runs in the storage its input conv writes: timed 20x slower channels-last,
    the plan keeps that conv and the step NCHW and transposes once before the NHWC conv after it;
    untimed, the step is free in either format and everything runs NHWC."""
    from convpass.compiler.passes.plan_layouts import plan_layouts

    model, unit, _ = _conv_gn_conv()
    conv0, conv1 = (n for n in model.graph if n.op_type == "Conv")
    convs = {conv0: {"nchw": 1.0, "nhwc": 0.5}, conv1: {"nchw": 1.0, "nhwc": 0.5}}
    step = {unit.nodes[0]: {"nchw": 0.1, "nhwc": 2.0}}
    free = plan_layouts(model.graph, convs, lambda v: 0.1, [unit.nodes])
    assert set(free.layouts.values()) == {"nhwc"} and free.timed_units == 0 and free.cost_ms == pytest.approx(1.2)
    timed = plan_layouts(model.graph, convs, lambda v: 0.1, [unit.nodes], unit_costs=step)
    assert timed.layouts == {conv0: "nchw", conv1: "nhwc"} and timed.timed_units == 1
    assert timed.cost_ms == pytest.approx(1.0 + 0.1 + 0.5 + 0.1 + 0.1)  # conv0, step, conv1, the transpose before conv1, the output's
    cheap_nhwc = plan_layouts(model.graph, convs, lambda v: 0.1, [unit.nodes], unit_costs={unit.nodes[0]: {"nchw": 0.1, "nhwc": 0.12}})
    assert set(cheap_nhwc.layouts.values()) == {"nhwc"} and cheap_nhwc.cost_ms == pytest.approx(0.5 + 0.12 + 0.5 + 0.1 + 0.1)
    # a step whose input no planned conv writes runs in whatever storage arrives: its times are not weighed
    untuned = plan_layouts(model.graph, {conv1: convs[conv1]}, lambda v: 0.1, [unit.nodes], unit_costs=step)
    assert untuned.timed_units == 0 and untuned.layouts == {conv1: "nhwc"}


def test_the_plan_reads_a_fused_unit_s_times_from_its_decision():
    from convpass.compiler import fusions

    model, unit, _ = _conv_gn_conv()
    key = "|".join(unit.names)

    def record(fused, times):
        return {key: ("norm", tuple(unit.names), [annotation.FusionDecision("gpu", 0, fused, annotation.MEASURED, times)])}

    both = {"fused_nchw": 0.1, "fused_nhwc": 0.4, "unfused_nchw": 0.2}
    assert fusions.fused_unit_costs([unit], record(True, both), "gpu", 0) == {unit.nodes[0]: {"nchw": 0.1, "nhwc": 0.4}}
    assert fusions.fused_unit_costs([unit], record(True, both), "gpu", 1) == {}  # another profile: no decision
    assert fusions.fused_unit_costs([unit], record(True, both), "other", 0) == {}  # another device
    assert fusions.fused_unit_costs([unit], record(False, both), "gpu", 0) == {}  # runs unfused
    assert fusions.fused_unit_costs([unit], record(True, {"fused_nchw": 0.1}), "gpu", 0) == {}  # timed in one format


# ---------------------------------------------------------------------------------------------
# conv bias units


def _rrdb_like(shape=(2, 8, 6, 6)):
    """RRDB's pieces: LeakyReLU(conv(x) + b) into a Concat, and conv(..) * 0.2 + x."""
    rng = np.random.default_rng(0)
    c = shape[1]
    nodes = [N("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"), N("LeakyRelu", ["c1"], ["f1"], alpha=0.2, name="lrelu"),
             N("Concat", ["x", "f1"], ["cat"], axis=1, name="cat"), N("Conv", ["cat", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             N("Mul", ["c2", "scale"], ["m"], name="scale"), N("Add", ["m", "x"], ["y"], name="residual"),
             N("Conv", ["y", "w3", "b3"], ["c3"], name="conv3"), N("Relu", ["c3"], ["out"], name="relu")]
    inits = [const("w1", rng.standard_normal((c, c, 3, 3)) * 0.2), const("b1", rng.standard_normal(c)),
             const("w2", rng.standard_normal((c, 2 * c, 3, 3)) * 0.2), const("b2", rng.standard_normal(c)), const("scale", 0.2),
             const("w3", rng.standard_normal((c, c, 1, 1))), const("b3", rng.standard_normal(c))]
    return _model(nodes, inits, shape, "out")


def test_a_convs_bias_moves_into_the_element_wise_step_that_reads_it():
    """conv1 -> LeakyRelu and conv2 -> Mul are units (conv3 -> Relu is not: the conv's own epilogue
    takes a ReLU). Untuned convs may add the bias in cuDNN's call: nothing moves by rule; forced, the
    conv loses its bias and an Add of it joins the reader's fused element-wise group."""
    from convpass.kernels import elementwise

    model = _rrdb_like()
    f = feeds((2, 8, 6, 6))
    ex = Executor(model, device="cpu")
    _run_twice(ex, f)
    assert [(s.kind, s.nodes, s.fused) for s in ex.fusion_summary()] == [("bias", ("conv1", "lrelu"), False), ("bias", ("conv2", "scale"), False)]
    assert "nothing to move" in ex.fusion_summary()[0].note
    forced = Executor(model, device="cpu", fusions=True)
    got = _run_twice(forced, f)
    np.testing.assert_allclose(got, _ort(model, f), rtol=1e-5, atol=1e-5)
    plan = forced.last_plan
    convs = [s for s in plan.steps if s.node.op_type == "Conv"]
    assert [len(s.inputs) > 2 and s.inputs[2] >= 0 for s in convs] == [False, False, True]
    groups = elementwise.plan_groups(plan, [None] * len(plan.steps))
    assert [g.ops for g in groups] == [("Add", "LeakyRelu"), ("Add", "Mul", "Add")]


def test_a_bias_moves_only_where_the_conv_runs_it_as_a_pass_of_its_own():
    from convpass.kernels.fused_steps import _bias_is_a_pass

    def step(**decision):
        d = annotation.ConvDecision(**decision) if decision else None
        return types.SimpleNamespace(node=types.SimpleNamespace(prepared=types.SimpleNamespace(decision=d)))

    assert _bias_is_a_pass(step(algo="implicit_gemm", memory_format="NHWC"))
    assert not _bias_is_a_pass(step(algo="implicit_precomp_gemm", fusion="bias"))  # cuDNN's fused call adds it
    assert _bias_is_a_pass(step(algo="implicit_gemm", engine="eng67_k2=2"))  # the engine's bare conv, then a pass
    assert not _bias_is_a_pass(step(algo="implicit_gemm", engine="eng0", fusion="bias+swish"))
    assert not _bias_is_a_pass(step()) and not _bias_is_a_pass(step(algo="auto"))  # untuned: cuDNN's heuristic may fuse it

"""The one-launch fused normalization (convpass.kernels.group_norm_onepass), checked on the CPU: the
kernel compiled as host C++ and run by the fused step's launch at real block sizes (each block's
threads at once, with real barriers: conftest.host_block_entry) and in blocks of one thread,
against float64 NumPy written from the definitions, in both storage orders, for every epilogue kind
a unit has (per-channel constants, an activation, a per-(sample, channel) gate, a residual),
float32 and float16; which units take it (the group size limit, the operands); its geometry; its
source; and the CPU executor's results, which do not go through it."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fused_models import N, channels_last, const, feeds, norm, unit, unit_feeds, unit_inputs, unit_reference64
from onnx import TensorProto, helper

from convpass.kernels import group_norm, group_norm_onepass
from convpass.kernels.backends import host_backend
from convpass.kernels.launch import Placement
from convpass.ops.registry import OpContext
from convpass.runtime.executor import Executor

DEFAULT_MIN_PAIRS = group_norm_onepass.MIN_PAIRS


@pytest.fixture(autouse=True)
def _any_pairs(monkeypatch):
    """The units here are small (a few (sample, group) pairs): they take the one launch whatever
    their pair count, so the kernel itself is what is checked; the defaults' own test restores it."""
    monkeypatch.setattr(group_norm_onepass, "MIN_PAIRS", 1)


def _launch(model, values, entry, threads):
    """The plan's FusedNorm step as the cuda backend's launch, its kernels host builds; returns
    (launch, step, env)."""
    ex = Executor(model, device="cpu")
    f = unit_feeds(model, values)
    ex.run(None, f)
    ex.run(None, f)
    plan = ex.last_plan
    (index,) = [i for i, st in enumerate(plan.steps) if st.node.op_type == "FusedNorm"]
    step = plan.steps[index]
    ctx = OpContext(host_backend())
    launch = group_norm.FusedNormLaunch(plan, index, np, (ctx, step.node, step.fn), entry=entry, threads=threads, sms=2)
    launch.prepare()
    return launch, step, list(plan.template)


def _bind(model, step, env, values, last):
    """The step's input slots given the values (stored channels-last when ``last``)."""
    slots = {name: s for name, s in zip(step.node.inputs, step.inputs)}
    for name in ("x", "gate", "z"):
        if name in slots:
            v = values[name]
            env[slots[name]] = channels_last(v) if last and name != "gate" else v


TOL = {np.float32: 2e-5, np.float16: 4e-3}  # float16: the output's own rounding (2**-11) and inputs' range

# (epilogue id, form, activation, gate, residual): every kind of operand and each activation
EPILOGUES = [("bit", "gn17", "Relu", False, False), ("vae", "gn17", "silu", False, True), ("gate", "gn21", "silu", True, True),
             ("instance-leaky", "instance", "LeakyRelu", False, False), ("hardswish", "gn21", "HardSwish", True, False),
             ("gelu", "gn17", "Gelu", False, True), ("mish", "gn21", "Mish", False, False)]
# (shape, groups): groups of 4 channels x 90 positions; one channel (instance) x 63; odd sizes (C / G
# = 4, S = 35); 1-D; 3-D
SHAPES = [((2, 32, 9, 10), 8), ((2, 6, 7, 9), 6), ((1, 12, 7, 5), 3), ((2, 16, 20), 4), ((1, 8, 3, 4, 5), 2)]


def _check(host_block_entry, epilogue, shape, groups, layout, dtype=np.float32, threads=48, runs=1):
    _, form, act, gate, residual = epilogue
    if form == "instance":
        groups = shape[1]
    model = unit(form, act, shape, groups, gate, residual, dtype)
    launch, step, env = _launch(model, unit_inputs(shape, dtype), host_block_entry, threads)
    assert launch.onepass is not None and launch.apply is None and launch.kernel is None and launch.part is None
    for run in range(runs):  # a second and third run with other inputs: nothing kept between launches
        values = unit_inputs(shape, dtype, seed=1 + run, offset=3.0 - 2 * run)
        _bind(model, step, env, values, layout == "nhwc")
        launch.run(env)
        got = env[step.outputs[0]]
        want = unit_reference64(model, form, act, groups, values)
        tol = TOL[np.dtype(dtype).type]
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * float(np.abs(want).max()), err_msg=f"run {run + 1}")
        assert got.dtype == dtype
    (ran,) = launch.apply_paths()
    last = layout == "nhwc"
    assert ran.startswith(f"gn_onepass_{'cl' if last else 'cf'}_"), ran
    if last:
        assert got.strides[1] == got.itemsize, "channels-last in, channels-last out"
    return launch, ran


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=[e[0] for e in EPILOGUES])
def test_every_epilogue_kind_matches_float64(host_block_entry, epilogue, layout):
    """Blocks of up to 48 threads (their moments merged through shared memory at a real barrier),
    groups of 4 channels x 90 positions: per-channel constants, each activation, a gate, a
    residual."""
    _check(host_block_entry, epilogue, SHAPES[0][0], SHAPES[0][1], layout)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("shape,groups", SHAPES[1:], ids=["one-channel", "odd", "1d", "3d"])
def test_every_shape_matches_float64(host_block_entry, shape, groups, layout):
    _check(host_block_entry, EPILOGUES[2], shape, groups, layout)  # the unit with the most operands: gate and residual


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("epilogue", [EPILOGUES[0], EPILOGUES[2]], ids=["bit", "gate"])
def test_float16_computes_in_float32_and_rounds_once(host_block_entry, epilogue, layout):
    """float16 storage, 16-byte vectors of 8 (8 channels a group channels-last, 48 positions
    channels-first), against float64 within the output's rounding."""
    launch, ran = _check(host_block_entry, epilogue, (2, 32, 6, 8), 4, layout, dtype=np.float16)
    assert ran.endswith("_8"), ran


def test_a_second_and_third_run_match(host_block_entry):
    """The launch keeps nothing between runs (no scratch, no counters): three runs on other
    inputs (means 3, 1, -1) each match float64."""
    _check(host_block_entry, EPILOGUES[1], (2, 32, 9, 10), 8, "nchw", runs=3)
    _check(host_block_entry, EPILOGUES[1], (2, 32, 9, 10), 8, "nhwc", runs=3)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_a_block_of_one_thread_is_valid(host_entry, layout):
    """The kernel in blocks of one thread (conftest.host_entry: its threads run in turn, so the
    block's cooperation must be trivial): the thread walks every slot of its group, one group a
    block."""
    launch, _ = _check(host_entry, EPILOGUES[2], (2, 32, 9, 10), 8, layout, threads=1)
    assert launch.onepass.geometry["block"] == (1,) and launch.onepass.geometry["groups_per_block"] == 1


@pytest.mark.parametrize("shape,groups,k", [((2, 32, 9, 10), 8, 2), ((2, 6, 7, 9), 6, 2), ((1, 16, 3, 4, 5), 8, 4), ((1, 12, 7, 5), 3, 1)],
                         ids=["4-channels", "instance", "3d-2-channels", "odd-groups"])
def test_channels_last_blocks_take_several_groups_where_a_group_s_channels_are_short(host_block_entry, shape, groups, k):
    """Channels-last groups of fewer than 32 bytes a position: a block takes two or four adjacent
    groups (its threads' moments merged per group: a tree over the block's rows, then within each
    group's channel vectors), an odd group count one; against float64."""
    epilogue = EPILOGUES[3] if groups == shape[1] else EPILOGUES[2]
    launch, _ = _check(host_block_entry, epilogue, shape, groups, "nhwc")
    geo = launch.onepass.geometry
    lanes = k * shape[1] // groups // geo["width"]
    assert geo["groups_per_block"] == k and geo["grid"] == (shape[0] * groups // k,) and geo["block"][0] % lanes == 0, geo
    assert geo["block"][0] > lanes or k == 1, "several rows of threads: the merge over rows runs"


@pytest.mark.parametrize("inputs", ["far_mean", "variance_near_eps"])
def test_statistics_hold_far_from_zero_and_near_epsilon(host_block_entry, inputs):
    """A mean 50 standard deviations from zero (shifted sums: no cancellation) and a group
    variance of epsilon's size (an epsilon left out is 30% off): (normal + offset) * scale, as
    tests/test_fused_norm.py's INPUTS."""
    shape, groups = (2, 32, 9, 10), 8
    offset, scale = {"far_mean": (50.0, 1.0), "variance_near_eps": (2.0, 1e-3)}[inputs]
    model = unit("gn17", "silu", shape, groups)
    values = unit_inputs(shape, offset=offset * scale, scale=scale)
    launch, step, env = _launch(model, values, host_block_entry, 48)
    for last in (False, True):
        _bind(model, step, env, values, last)
        launch.run(env)
        want = unit_reference64(model, "gn17", "silu", groups, values)
        np.testing.assert_allclose(env[step.outputs[0]], want, rtol=2e-5, atol=2e-5 * float(np.abs(want).max()))


def test_it_writes_into_a_concat_slice_and_leaves_the_rest(host_block_entry):
    shape, groups = (2, 32, 9, 10), 8
    model = unit("gn21", "silu", shape, groups, residual=True)
    values = unit_inputs(shape)
    launch, step, env = _launch(model, values, host_block_entry, 48)
    big = (2, 40, 9, 10)
    for last in (False, True):
        slot = len(env)
        env.append(None)
        launch.placement = Placement(slot, 1, 3, 32, lambda layout: channels_last(np.full(big, -9.0, np.float32)) if layout == "nhwc"
                                     else np.full(big, -9.0, np.float32))
        _bind(model, step, env, values, last)
        launch.run(env)
        buf = env[slot]
        want = unit_reference64(model, "gn21", "silu", groups, values)
        np.testing.assert_allclose(buf[:, 3:35], want, rtol=2e-5, atol=2e-5 * float(np.abs(want).max()))
        assert (buf[:, :3] == -9).all() and (buf[:, 35:] == -9).all() and (buf.strides[1] == 4) == last


# ---------------------------------------------------------------------------------------------
# which units take it


def test_the_group_size_limit_selects_the_one_launch(monkeypatch):
    shape, groups = (2, 32, 9, 10), 8  # 4 channels x 90 positions = 360 elements a group
    model = unit("gn17", "silu", shape, groups, residual=True)
    values = unit_inputs(shape)
    no_build = lambda src, name: None  # noqa: E731  (nothing is launched)
    monkeypatch.setattr(group_norm_onepass, "MAX_GROUP_ELEMENTS", 360)
    monkeypatch.setattr(group_norm_onepass, "MIN_PAIRS", 16)  # 2 samples x 8 groups
    launch, *_ = _launch(model, values, no_build, None)
    assert launch.onepass is not None and launch.apply is None and launch.part is None
    assert [s.name for s in launch.sources()] == [launch.onepass.source.name]
    monkeypatch.setattr(group_norm_onepass, "MAX_GROUP_ELEMENTS", 359)
    launch, *_ = _launch(model, values, no_build, None)
    assert launch.onepass is None and launch.apply is not None and launch.part is not None
    monkeypatch.setattr(group_norm_onepass, "MAX_GROUP_ELEMENTS", 360)
    monkeypatch.setattr(group_norm_onepass, "MIN_PAIRS", 17)  # one pair short
    launch, *_ = _launch(model, values, no_build, None)
    assert launch.onepass is None and launch.apply is not None
    assert [s.name for s in launch.sources()] == [group_norm.source(np.float32).name, launch.apply.source.name]


def test_the_default_limits_take_bit_at_batch_16_not_batch_1_nor_large_groups(monkeypatch):
    monkeypatch.setattr(group_norm_onepass, "MIN_PAIRS", DEFAULT_MIN_PAIRS)
    fits = group_norm_onepass.fits
    for shape in ((16, 512, 28, 28), (16, 1024, 14, 14), (16, 2048, 7, 7), (16, 64, 56, 56), (4, 512, 32, 32)):
        assert fits(shape, 32), shape
    for shape in ((16, 256, 56, 56), (1, 512, 32, 32), (1, 2048, 7, 7), (1, 256, 128, 128), (16, 128, 256, 256)):
        assert not fits(shape, 32), shape  # a group over the limit, or too few (sample, group) pairs
    assert fits((2, 64, 128, 128), 64) and not fits((2, 64, 256, 256), 64)  # InstanceNorm: one channel a group


def test_an_operand_per_pixel_but_not_per_channel_keeps_the_generic_path():
    """A spatial mask (1, 1, H, W) in the epilogue: the apply kernels' rule 2 refuses it, so does the one launch."""
    rng = np.random.default_rng(0)
    shape = (2, 8, 5, 6)
    nodes, inits, t = norm("gn21", "n1", "x", 8, 4, rng)
    nodes += [N("Relu", [t], ["r"], name="relu"), N("Mul", ["r", "mask"], ["y"], name="mask")]
    inits.append(const("mask", rng.standard_normal((1, 1, 5, 6))))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=9)
    launch, *_ = _launch(model, {"x": feeds(shape)["x"]}, lambda src, name: None, None)
    assert launch.onepass is None and launch.apply is None and launch.kernel is not None


# ---------------------------------------------------------------------------------------------
# geometry and source


def _geo(last, dims, groups, itemsize=4, strides=None, addresses=None, pixel=None, sms=132):
    n, a, b = dims
    shape = (n, b, a) if last else dims
    packed = (a * b, b, 1)
    strides = strides or [packed, packed]
    w = group_norm_onepass.widths((shape[0], shape[1], shape[2]), groups, np.float16 if itemsize == 2 else np.float32)
    return group_norm_onepass.onepass_geometry(last, dims, groups, strides, pixel or [True] * len(strides), addresses or [0] * len(strides),
                                               itemsize, w, sms)


def test_bit_units_at_batch_16_run_in_one_wave_of_blocks_per_group():
    """GroupNorm(32) at batch 16: a block per (sample, group), 256 threads (all resident on 132
    SMs), the widest vector that divides the group's channels (channels-last) or the positions;
    channels-last groups of 2 channels (8 bytes a position) four to a block (a 32-byte sector a
    position), 128 blocks of 1024 threads."""
    # (C, S): (channels-last: width, groups a block, threads), (channels-first: width, threads)
    table = {(256, 3136): ((4, 1, 256), (4, 256)), (64, 3136): ((2, 4, 1024), (4, 256)), (2048, 49): ((4, 1, 224), (1, 256)),
             (512, 784): ((4, 1, 256), (4, 256))}
    for (c, s), ((cl_width, k, cl_threads), (cf_width, cf_threads)) in table.items():
        cl = _geo(True, (16, s, c), 32)
        assert (cl["width"], cl["groups_per_block"], cl["block"], cl["grid"]) == (cl_width, k, (cl_threads,), (512 // k,)), (c, s, cl)
        assert cl["entry"] == f"gn_onepass_cl_{cl_width}" and cl["block"][0] % (k * c // 32 // cl_width) == 0
        cf = _geo(False, (16, c, s), 32)
        assert (cf["width"], cf["groups_per_block"], cf["block"], cf["grid"]) == (cf_width, 1, (cf_threads,), (512,)), (c, s, cf)
    half = _geo(True, (16, 3136, 256), 32, itemsize=2)
    assert half["width"] == 8 and half["groups_per_block"] == 2  # 8 channels a group: 16 bytes of float16, two groups a block
    assert _geo(True, (1, 3136, 64), 32)["groups_per_block"] == 1  # batch 1: 32 blocks are fewer than the SMs already


def test_a_few_large_groups_get_large_blocks_and_tiny_groups_a_warp():
    assert _geo(False, (1, 512, 1024), 32)["block"] == (1024,)  # a VAE decoder's 512 x 32 x 32 at batch 1: 32 blocks
    assert _geo(False, (16, 2048, 1), 32)["block"] == (32,)  # 64 elements a group


def test_strides_and_alignment_decide_the_vector():
    cl = (256 * 3136, 256, 1)
    assert _geo(True, (2, 3136, 256), 32, strides=[cl, cl])["width"] == 4
    assert _geo(True, (2, 3136, 256), 32, strides=[cl, cl], addresses=[0, 8])["width"] == 1  # the output 8 bytes off
    assert _geo(True, (2, 3136, 256), 32, strides=[(3136 * 260, 260, 1), cl], addresses=[16, 0])["width"] == 4  # a Concat slice, aligned
    assert _geo(True, (2, 3136, 256), 32, strides=[cl, (256 * 3136, 1, 3136), cl])["width"] == 1  # a residual stored channels-first
    # a per-sample operand (read per channel, not walked) does not decide it
    assert _geo(True, (2, 3136, 256), 32, strides=[cl, (256, 0, 1), cl], pixel=[True, False, True], addresses=[0, 4, 0])["width"] == 4


def _source(dtype=np.float32, act="silu", gate=True, residual=True, shape=(2, 32, 9, 10), groups=8):
    model = unit("gn21", act, shape, groups, gate, residual, dtype)
    launch, *_ = _launch(model, unit_inputs(shape, dtype), lambda src, name: None, None)
    return launch.onepass.source, launch


def test_the_source_reuses_the_apply_group_code_and_keeps_no_state():
    src, launch = _source()
    code = src.code
    assert src.entries == ("gn_onepass_cl_1", "gn_onepass_cl_4", "gn_onepass_cf_1", "gn_onepass_cf_2")
    assert all(f"__launch_bounds__(MAXT) {e}(" in code for e in src.entries) and "#define MAXT 1024" in code
    assert "onepass<4, 2, true>(" in code and "onepass<2, 2, false>(" in code and "onepass<1, 4, false>(" in code
    group = group_norm.apply_group(launch.spec, np.float32, ["value", "value"])
    for line in group.code.splitlines():
        assert line in code, line
    assert "const float in1 = ka, in2 = kb;" in code and "fmaf(-mean, ka, shift[c])" in code
    # the gate read per (sample, channel), the residual walked per pixel; statistics as the three kernels compute them
    assert launch.onepass.kinds == ("sample", "pixel")
    assert "const T in3 = x3[(long long)n * sx3_n + (long long)c * sx3_c];" in code and "vx4[u] = load<V>(px4 + o * ox4 + i * ix4);" in code
    assert group_norm_onepass.MOMENTS in code and group_norm_onepass.MOMENTS in group_norm.source(np.float32).code
    assert code.count("__syncthreads()") == code.count("__syncthreads()", code.index("__device__ void block_merge"), code.index("advance("))  # block_merge's only
    assert not re.search(r"atomic|__threadfence|__device__ (unsigned|int|float) ", code), "no global counters or state"


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler (nvcc) on this machine")
@pytest.mark.parametrize("dtype,act", [(np.float32, "Gelu"), (np.float16, "Mish")])
def test_the_kernels_compile_for_hopper_within_their_launch_bounds(dtype, act, tmp_path):
    """sm_90, no spills, at most 64 registers a thread (1024-thread blocks) with the longest
    epilogues (a gate and a residual besides); 16-byte loads in the vector entries."""
    src, _ = _source(dtype, act, shape=(2, 64, 8, 8), groups=8)
    path = tmp_path / f"{src.name}.cu"
    path.write_text(src.code)
    nvcc = [NVCC, "-std=c++17", "-arch=sm_90", str(path)]
    done = subprocess.run([*nvcc, "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert all(f"Compiling entry function '{e}'" in done.stderr for e in src.entries), done.stderr
    assert all(line.strip().startswith("0 bytes stack frame, 0 bytes spill stores") for line in done.stderr.splitlines() if "spill stores" in line)
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", done.stderr)]
    assert len(registers) == len(src.entries) and max(registers) <= 64, registers
    subprocess.run([*nvcc, "-ptx", "-o", str(tmp_path / "k.ptx")], check=True, capture_output=True)
    ptx = (tmp_path / "k.ptx").read_text()
    assert ("ld.global.v4.f32" if dtype == np.float32 else "ld.global.v4.u32") in ptx


# ---------------------------------------------------------------------------------------------
# the CPU executor


@pytest.mark.parametrize("epilogue", [EPILOGUES[0], EPILOGUES[2]], ids=["bit", "gate"])
def test_the_cpu_executor_runs_the_op_library_s_fused_step_as_before(epilogue):
    """The CPU executor's FusedNorm steps are the op library's (no kernel): fused, they match the
    unfused ops and ONNX Runtime as they did."""
    _, form, act, gate, residual = epilogue
    shape = (2, 32, 9, 10)
    model = unit(form, act, shape, 8, gate, residual)
    f = unit_feeds(model, unit_inputs(shape))
    ex = Executor(model, device="cpu")
    ex.run(None, f)
    got = ex.run(None, f)[0]
    (step,) = [s for s in ex.last_plan.steps if s.node.op_type == "FusedNorm"]
    from convpass.ops.fused import fused_norm

    assert step.fn is fused_norm
    unfused = Executor(model, device="cpu", fusions=False)
    unfused.run(None, f)
    np.testing.assert_allclose(got, unfused.run(None, f)[0], rtol=1e-5, atol=1e-5)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, f)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    onnx.checker.check_model(model)


def test_the_benchmark_forces_either_path_whatever_the_group_size():
    """benchmarks/op_kernels.py's "one launch" and "three kernels" variants of a normalization unit:
    a group over the limit in one launch, one under it in three kernels; the limit is back
    afterwards."""
    from conftest import benchmark_script

    ok = benchmark_script("op_kernels")
    limit = group_norm_onepass.MAX_GROUP_ELEMENTS
    no_build = lambda src, name: None  # noqa: E731  (nothing is launched)

    def onepass(shape):
        model = ok._exported_group_norm(shape, 2, np.random.default_rng(0), "relu")
        return _launch(model, {"x": feeds(shape)["x"]}, no_build, None)[0].onepass is not None

    small, large = (1, 16, 16, 16), (1, 64, 64, 64)  # 2,048 and 131,072 elements a group
    assert onepass(small) and not onepass(large)
    with ok._norm_path("three"):
        assert not onepass(small)
    with ok._norm_path("one"):
        assert onepass(large)
    assert group_norm_onepass.MAX_GROUP_ELEMENTS == limit and group_norm_onepass.MIN_PAIRS == 1
    rows = [c for c in ok.cases() if c["name"].startswith(("GroupNorm+Relu (BiT", "GroupNorm+SiLU"))]
    assert len(rows) == 16 and all(c["variants"]["one launch"] == {"fusions": True, ok.NORM_PATH: "one"} for c in rows)

"""The apply pass of a fused normalization unit as its own kernel (convpass.kernels.group_norm_apply),
checked on the CPU: which operands it takes, its generated source (entries, vector and scalar
loads, the epilogue's code), its launch geometry (the vector width each storage and alignment
gets, blocks over the VAE's sizes), and the kernels compiled as host C++ and run thread by thread
at their real block sizes against float64 NumPy in both storage orders; a unit it does not take
runs the generic broadcasting kernel."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from fused_models import N, channels_last, const, feeds, norm
from onnx import TensorProto, helper

from convpass.kernels import group_norm, group_norm_apply
from convpass.kernels.backends import host_backend
from convpass.ops.registry import OpContext
from convpass.runtime.executor import Executor


def _fused_plan(model, shape):
    ex = Executor(model, device="cpu")
    ex.run(None, feeds(shape))
    ex.run(None, feeds(shape))
    return ex.last_plan


def _silu_residual_model(shape, groups):
    """GroupNorm (exported form: per-channel gamma, beta) + SiLU + residual z: operands gamma, beta, z."""
    rng = np.random.default_rng(0)
    c = shape[1]
    nodes, inits, t = norm("gn17", "n1", "x", c, groups, rng, rank=len(shape))
    nodes += [N("Sigmoid", [t], ["s"], name="sig"), N("Mul", [t, "s"], ["a"], name="silu"), N("Add", ["a", "z"], ["y"], name="residual")]
    ins = [helper.make_tensor_value_info(v, TensorProto.FLOAT, shape) for v in ("x", "z")]
    graph = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _step(shape, groups):
    model = _silu_residual_model(shape, groups)
    ex = Executor(model, device="cpu")
    f = {**feeds(shape), "z": feeds(shape, seed=2)["x"]}
    ex.run(None, f)
    ex.run(None, f)
    plan = ex.last_plan
    (index,) = [i for i, st in enumerate(plan.steps) if st.node.op_type == "FusedNorm"]
    return plan, index


def test_operands_read_per_pixel_or_per_sample_and_the_rest_go_to_the_generic_kernel():
    kinds = group_norm_apply.operand_kinds
    x = (2, 8, 5, 6)
    assert kinds(x, [(8, 1, 1), (1, 8, 1, 1), (), (2, 8, 1, 1), (2, 8, 5, 6), (1, 8, 5, 6)]) == ("sample",) * 4 + ("pixel",) * 2
    assert kinds(x, [(2, 1, 5, 6)]) is None  # a spatial mask, the same for every channel
    assert kinds(x, [(8, 1, 1), (5, 6)]) is None
    assert kinds(x, []) == ()


@pytest.mark.parametrize("dtype,width", [(np.float32, 4), (np.float16, 8)])
def test_the_source_has_a_vector_and_a_scalar_entry_per_order(dtype, width):
    plan, index = _step((2, 8, 5, 6), 4)
    spec = plan.steps[index].node.prepared
    group = group_norm.apply_group(spec, dtype, ["constant", "constant", "value"])
    src = group_norm_apply.source(group, ["sample", "sample", "pixel"])
    assert src.entries == ("gn_apply_cl_1", f"gn_apply_cl_{width}", "gn_apply_cf_1", f"gn_apply_cf_{width}")
    code = src.code
    for entry, (v, u) in (("cl_1", (1, 4)), (f"cl_{width}", (width, 2)), ("cf_1", (1, 4)), (f"cf_{width}", (width, 2))):
        assert f'__global__ void gn_apply_{entry}(' in code and f"apply_{entry[:2]}<{v}, {u}>(" in code
    assert "struct alignas(sizeof(T) * V) Pack" in code and ("#include <cuda_fp16.h>" in code) == (dtype == np.float16)
    # x and the residual walked per pixel as vectors; gamma and beta held in registers, per channel
    # of the thread (channels-last) or per plane (channels-first); the output stored as vectors
    assert "vx[u] = load<V>(px + u * dx);" in code and "vx5[u] = load<V>(px5 + u * dx5);" in code
    assert "load<V>(px3" not in code and "r3[j] = x3[(long long)n * sx3_n + (long long)(c0 + j) * sx3_c];" in code
    assert "const T r4 = x4[(long long)n * sx4_n + (long long)c * sx4_c];" in code
    assert code.count("store<V>(py + u * dy, vy);") == 2
    assert code.count("const float in1 = ka[j], in2 = kb[j];") == 1 and code.count("const float in1 = ka, in2 = kb;") == 1
    assert code.count("const A tn = fmaf(a0, a1, a2);") == 2 and code.count("const A t4 = (t3 + a5);") == 2  # the group's code, both orders
    assert src.name != group_norm_apply.source(group, ["sample", "sample", "sample"]).name


def _geo(last, dims, strides, pixel=None, addresses=None, itemsize=4, sms=132):
    pixel = pixel or [True] * len(strides)
    addresses = addresses or [0] * len(strides)
    return group_norm_apply.apply_geometry(last, dims, strides, pixel, addresses, itemsize, sms)


def test_the_vector_width_follows_the_storage_the_counts_and_the_alignment():
    cl = (128 * 65536, 128, 1)  # (n, s, c) of a packed (16, 65536, 128) frame
    cf = (128 * 65536, 65536, 1)  # (n, c, s)
    assert _geo(True, (16, 65536, 128), [cl, cl])["entry"] == "gn_apply_cl_4"
    assert _geo(False, (16, 128, 65536), [cf, cf])["entry"] == "gn_apply_cf_4"
    assert _geo(True, (16, 65536, 128), [cl, cl], itemsize=2)["entry"] == "gn_apply_cl_8"
    assert _geo(True, (2, 30, 6), [(180, 6, 1)] * 2)["entry"] == "gn_apply_cl_1"  # C % 4
    assert _geo(False, (2, 8, 30), [(240, 30, 1)] * 2)["entry"] == "gn_apply_cf_1"  # S % 4
    assert _geo(True, (16, 65536, 128), [cl, cl], addresses=[0, 8])["entry"] == "gn_apply_cl_1"  # an output 8 bytes off
    # a channels-last Concat slice: channels 4.. of 136 keep 16-byte vectors, channels 3.. do not
    assert _geo(True, (2, 64, 128), [(64 * 136, 136, 1), cl], addresses=[16, 0])["entry"] == "gn_apply_cl_4"
    assert _geo(True, (2, 64, 128), [(64 * 136, 136, 1), cl], addresses=[12, 0])["entry"] == "gn_apply_cl_1"
    assert _geo(True, (2, 64, 128), [(64 * 130, 130, 1), cl])["entry"] == "gn_apply_cl_1"  # pixels 130 channels apart
    # a residual stored channels-first under a channels-last x: read element by element
    assert _geo(True, (2, 64, 128), [cl, (128 * 64, 1, 64), cl])["entry"] == "gn_apply_cl_1"
    # per-sample operands (registers, read once) do not decide it
    assert _geo(True, (2, 64, 128), [cl, (0, 0, 3), cl], pixel=[True, False, True], addresses=[0, 4, 0])["entry"] == "gn_apply_cl_4"


@pytest.mark.parametrize("batch", [16, 1])
def test_vae_sized_launches_fill_the_gpu_with_coalesced_blocks(batch):
    """GroupNorm(32) of 128 channels at 256 x 256: channels-last, a warp of 32 channel lanes reads one
    pixel's 128 channels (512 contiguous bytes) and eight pixel rows make a block of 256 threads;
    channels-first, 256 lanes of float4 over a plane; both about 16 blocks an SM."""
    sms = 132
    cl = _geo(True, (batch, 65536, 128), [(128 * 65536, 128, 1)] * 2, sms=sms)
    assert cl["block"] == (32, 8) and cl["grid"][1] == batch and cl["width"] == 4
    assert 8 * sms <= cl["grid"][0] * cl["grid"][1] <= 32 * sms
    cf = _geo(False, (batch, 128, 65536), [(128 * 65536, 65536, 1)] * 2, sms=sms)
    assert cf["block"] == (256, 1) and cf["grid"][0] == batch * 128 and cf["width"] == 4
    assert 8 * sms <= cf["grid"][0] * cf["grid"][1] <= 32 * sms
    chunk = int(cf["args"][4])
    assert chunk % 4 == 0 and cf["grid"][1] == -(-65536 // chunk)
    # many channels: tiles of 256 lanes; short planes: several a block
    wide = _geo(True, (2, 16, 4096), [(16 * 4096, 4096, 1)] * 2)
    assert wide["block"] == (256, 1) and wide["grid"][1] == 2 * 4
    short = _geo(False, (2, 512, 30), [(512 * 30, 30, 1)] * 2)
    assert short["block"] == (30, 8) and short["grid"][0] == 2 * 512 // 8


def _offset(a, elements):
    """``a`` copied into a buffer at ``elements`` past an aligned start, in the same storage order."""
    order = np.argsort(a.strides)[::-1]
    packed = np.ascontiguousarray(a.transpose(order))
    buf = np.zeros(packed.size + elements, a.dtype)
    view = buf[elements:].reshape(packed.shape)
    view[...] = packed
    return view.transpose(np.argsort(order))


def _reference(x, a, b, gamma, beta, z):
    n, c = x.shape[:2]
    view = (n, c) + (1,) * (x.ndim - 2)
    t = x.astype(np.float64) * a.reshape(view) + b.reshape(view)
    t = t * gamma.reshape((1, c) + (1,) * (x.ndim - 2)) + beta.reshape((1, c) + (1,) * (x.ndim - 2))
    return z.astype(np.float64) + t / (1 + np.exp(-t))


@pytest.mark.parametrize("storage", ["nchw", "nhwc", "mixed", "misaligned"])
@pytest.mark.parametrize("shape", [(2, 8, 5, 6), (2, 6, 4, 4), (1, 12, 2, 3, 2), (1, 1028, 3, 1)], ids=["c8", "c6", "3d", "tiles"])
def test_the_kernels_at_full_blocks_match_float64(host_entry, shape, storage):
    """The apply kernels with their real blocks (256 threads, 2 SMs' worth of blocks) run as host C++,
    against float64 NumPy of x * A + B, gamma, beta, SiLU and the residual: C % 4 == 0 and not, S % 4
    == 0 and not, 3-D maps, more channels than a block's lanes (tiles), the residual in the other
    order, and 4 bytes off alignment (the scalar entries)."""
    plan, index = _step(shape, 2)
    step = plan.steps[index]
    env = list(plan.template)
    gamma, beta = (np.asarray(env[s]) for s in step.inputs[3:5])
    spec = step.node.prepared
    group = group_norm.apply_group(spec, np.float32, ["constant", "constant", "value"])
    kernel = group_norm_apply.ApplyKernel(np, group, ["sample", "sample", "pixel"], lambda: 2, entry=host_entry)
    rng = np.random.default_rng(1)
    n, c = shape[:2]
    x, z = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    coef = rng.standard_normal(2 * n * c).astype(np.float32)
    last = storage in ("nhwc", "mixed", "misaligned")
    out = group_norm._empty(np, shape, np.float32, last)
    if last:
        x = channels_last(x)
        z = z if storage == "mixed" else channels_last(z)
    if storage == "misaligned":
        out = _offset(out, 1)
    frames = [group_norm.frame(np, v, shape, last) for v in (x, gamma, beta, z, out)]
    assert kernel(frames[0], coef, frames[1:4], frames[4], last) is frames[4]
    want = _reference(x, coef[:n * c], coef[n * c:], gamma, beta, z)
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6 * float(np.abs(want).max()))
    (path,) = kernel.planned
    along = c if last else int(np.prod(shape[2:]))
    vector = along % 4 == 0 and storage in ("nchw", "nhwc")
    assert path == f"gn_apply_{'cl' if last else 'cf'}_{4 if vector else 1}", path


def test_an_operand_per_pixel_but_not_per_channel_runs_the_generic_kernel(host_entry):
    """GroupNorm + Relu times a spatial mask (1, 1, H, W): the unit fuses it, the dedicated kernel
    does not take it, the generic broadcasting kernel runs the apply, matching the fused step."""
    rng = np.random.default_rng(0)
    shape = (2, 8, 5, 6)
    nodes, inits, t = norm("gn21", "n1", "x", 8, 4, rng)
    nodes += [N("Relu", [t], ["r"], name="relu"), N("Mul", ["r", "mask"], ["y"], name="mask")]
    inits.append(const("mask", rng.standard_normal((1, 1, 5, 6))))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=9)
    plan = _fused_plan(model, shape)
    (index,) = [i for i, st in enumerate(plan.steps) if st.node.op_type == "FusedNorm"]
    step = plan.steps[index]
    ctx = OpContext(host_backend())
    launch = group_norm.FusedNormLaunch(plan, index, np, (ctx, step.node, step.fn), entry=host_entry, threads=1, sms=2)
    launch.prepare()
    assert launch.apply is None and launch.kernel is not None
    env = list(plan.template)
    x = feeds(shape, seed=4)["x"]
    for storage in (x, channels_last(x)):
        env[step.inputs[0]] = storage
        launch.run(env)
        want = step.fn(ctx, step.node, x, *[env[s] for s in step.inputs[1:]])
        np.testing.assert_allclose(env[step.outputs[0]], want, rtol=2e-5, atol=2e-5)
    assert launch.apply_paths() and all(p.startswith("broadcast_d") for p in launch.apply_paths())
    assert launch.sources()[1].name == launch.kernel.source.name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA compiler (nvcc) on this machine")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_kernels_compile_for_hopper_with_128_bit_loads_and_no_spills(dtype, tmp_path):
    plan, index = _step((2, 8, 5, 6), 4)
    group = group_norm.apply_group(plan.steps[index].node.prepared, dtype, ["constant", "constant", "value"])
    src = group_norm_apply.source(group, ["sample", "sample", "pixel"])
    path = tmp_path / f"{src.name}.cu"
    path.write_text(src.code)
    nvcc = [shutil.which("nvcc"), "-std=c++17", "-arch=sm_90", str(path)]
    done = subprocess.run([*nvcc, "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert all(f"Compiling entry function '{e}'" in done.stderr for e in src.entries), done.stderr
    assert all(line.strip().startswith("0 bytes stack frame, 0 bytes spill stores") for line in done.stderr.splitlines() if "spill stores" in line)
    subprocess.run([*nvcc, "-ptx", "-o", str(tmp_path / "k.ptx")], check=True, capture_output=True)
    ptx = (tmp_path / "k.ptx").read_text()
    vector = "v4.f32" if dtype == np.float32 else "v4.u32"
    # the vector entries: x and the residual, two vectors each in flight (channels-last and channels-first), the output stored so
    assert ptx.count(f"ld.global.{vector}") == 8 and ptx.count(f"st.global.{vector}") == 4, ptx.count(f"ld.global.{vector}")


def test_the_op_kernels_nhwc_case_gives_the_fused_step_channels_last_storage():
    """benchmarks/op_kernels.py's channels-last rows read their input through a Transpose of an NHWC
    input (a view), so the fused step sees channels-last storage even from a captured graph, whose
    input buffers are packed copies of the feeds; the outputs match the channels-first model's."""
    from conftest import benchmark_script

    from convpass.native.cuda import channels_last

    ok = benchmark_script("op_kernels")
    shape = (2, 8, 4, 4)
    model = ok._exported_group_norm(shape, 4, np.random.default_rng(0))
    nhwc = ok._nhwc_input(model)
    x = feeds(shape)["x"]
    ex = Executor(nhwc, device="cpu", fusions=True)
    f = {"x_nhwc": np.ascontiguousarray(np.moveaxis(x, 1, -1))}
    ex.run(None, f)
    (step,) = [st for st in ex.last_plan.steps if st.node.op_type == "FusedNorm"]
    seen, fn = [], step.fn
    step.fn = lambda ctx, node, *args: seen.append(channels_last(args[0])) or fn(ctx, node, *args)
    got = ex.run(None, f)[0]
    assert seen == [True] and not channels_last(x)
    want = Executor(model, device="cpu").run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

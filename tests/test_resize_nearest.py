"""The nearest Resize kernels (convpass.kernels.tensor_ops.resize_nearest), checked on the CPU.

The kernels copy storage bits and use no warp or block cooperation, so their CUDA source compiles
as host C++ (tests/conftest.py's ``host_library``) for float32 and float16 alike and runs block by
block, thread by thread, on the tables the lowering builds: bit-exact against the op library (the
CPU executor) and NumPy's repeat, channels-last and channels-first, vector and scalar entries, a
slice of a Concat buffer (aligned and not), several blocks of channels. The lowering's choice of
path (nearest kernel or the generic ``resize_2d``) is checked on one-step plans. The same on a GPU:
tests/gpu/test_kernels.py.
"""

from __future__ import annotations

import shutil
import subprocess
import types

import numpy as np
import pytest
from conftest import host_args, host_library
from onnx import TensorProto, helper, numpy_helper

from convpass.kernels import tensor_ops
from convpass.kernels.launch import Placement
from convpass.ops.registry import NodeInfo, decode_attributes, lookup
from convpass.runtime.executor import Executor

_SETTER = ('\nextern "C" void set_index(unsigned bx, unsigned by, unsigned bz, unsigned tx, unsigned ty, unsigned bdx, unsigned bdy, '
           'unsigned gdx, unsigned gdy, unsigned gdz) { blockIdx = {bx, by, bz}; threadIdx = {tx, ty, 0}; blockDim = {bdx, bdy, 1}; '
           'gridDim = {gdx, gdy, gdz}; }\n')


@pytest.fixture(scope="module")
def host_entry(tmp_path_factory):
    """``entry(source, name)``: a kernel of ``source`` compiled as host C++, launched block by block
    and thread by thread (the nearest and resize_2d kernels need no cooperation)."""
    libs = {}
    d = tmp_path_factory.mktemp("resize")

    def entry(src, name):
        if src.name not in libs:
            libs[src.name] = host_library(d, src.code + _SETTER, src.name)
        lib = libs[src.name]
        kernel = getattr(lib, name)

        def launch(grid, block, args):
            conv = host_args(args)
            gx, gy, gz = (*grid, 1, 1)[:3]
            bx, by = (*block, 1)[:2]
            for k in range(gz):
                for j in range(gy):
                    for i in range(gx):
                        for ty in range(by):
                            for tx in range(bx):
                                lib.set_index(i, j, k, tx, ty, bx, by, gx, gy, gz)
                                kernel(*conv)
        return launch

    return entry


def _aligned(shape, dtype, layout="nchw", shift=0):
    """An array of logical ``shape`` stored in ``layout``, its data at a 64-byte boundary plus
    ``shift`` elements."""
    dtype = np.dtype(dtype)
    phys = shape if layout == "nchw" else (shape[0], *shape[2:], shape[1])
    count = int(np.prod(phys))
    raw = np.zeros(count * dtype.itemsize + 128 + shift * dtype.itemsize, np.uint8)
    start = (-raw.ctypes.data) % 64 + shift * dtype.itemsize
    a = raw[start:start + count * dtype.itemsize].view(dtype).reshape(phys)
    return a if layout == "nchw" else np.moveaxis(a, -1, 1)


def _lowered(shape, scales=None, sizes=None, dtype=np.float32, entry=None, op="Resize", opset=19, **attrs):
    """lower_resize over a one-step plan: slot 0 the input, 1 the output, 2 the scales or sizes
    (host arrays stand for device ones; nothing is uploaded)."""
    if op == "Upsample":
        names, slots = ["x", "scales"], [0, 2]
    elif sizes is not None:
        names, slots = ["x", "", "", "sizes"], [0, -1, -1, 2]
    else:
        names, slots = ["x", "", "scales"], [0, -1, 2]
    proto = helper.make_node(op, names, ["y"], name=op.lower(), **attrs)
    node = NodeInfo(proto.name, op, "", opset, decode_attributes(list(proto.attribute)), names, ["y"])
    node.impl = lookup(op, "", opset)
    if sizes is not None:
        const, out = np.asarray(sizes, np.int64), tuple(int(v) for v in sizes)
    else:
        const, out = np.asarray(scales, np.float32), tuple(int(np.floor(d * s)) for d, s in zip(shape, scales))
    infos = {0: (tuple(shape), np.dtype(dtype)), 1: (out, np.dtype(dtype))}
    plan = types.SimpleNamespace(steps=[types.SimpleNamespace(node=node, inputs=slots, outputs=[1])], info=infos.get, template={2: const})
    launch = tensor_ops.lower_resize(plan, 0, None, lambda c: c, lambda a: a, entry)
    return launch, out


def _run(launch, x, buf, offset=0):
    """Run ``launch`` (host entries) on ``x`` into channels ``offset:`` of ``buf`` (a Concat's buffer)."""
    launch.prepare()
    launch.placement = Placement(2, 1, offset, launch.out_shape[1], lambda layout: buf)
    env = [x, None, None]
    launch.run(env)
    return env[1]


def _reference(x, scales, **attrs):
    """The op library (the CPU executor) on a one-node model, in x's dtype."""
    tp = TensorProto.FLOAT if x.dtype == np.float32 else TensorProto.FLOAT16
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", tp, x.shape)],
                              [helper.make_tensor_value_info("y", tp, ["?"] * x.ndim)],
                              [numpy_helper.from_array(np.asarray(scales, np.float32), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    (y,) = Executor(model, device="cpu").run(None, {"x": np.ascontiguousarray(x)})
    return y


# (shape, factor, threads a block): the last two walk several lanes' worth of channels / columns
CASES = [((2, 8, 5, 4), 2, 256), ((2, 6, 5, 4), 2, 256), ((1, 8, 4, 5), 3, 256), ((2, 24, 3, 4), 2, 4), ((2, 12, 4, 4), 3, 8)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("where", ["nchw", "nhwc", "nchw-slice", "nhwc-slice", "nchw-misaligned", "nhwc-misaligned"])
@pytest.mark.parametrize("shape,factor,threads", CASES, ids=[f"{'x'.join(map(str, c[0]))}-x{c[1]}-t{c[2]}" for c in CASES])
def test_nearest_kernel_is_bit_exact(host_entry, shape, factor, threads, where, dtype):
    """Every output element is its source's bits (a NaN's payload too), in the output's storage
    order, inside the Concat buffer's slice and nowhere else; the vector entry runs exactly where
    the vectorized dimension and every address take 16 bytes."""
    layout = where.split("-")[0]
    bits = np.uint32 if dtype == np.float32 else np.uint16
    x = _aligned(shape, dtype, layout)
    x[...] = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    x.view(bits)[0, 0, 0, 0] = 0x7FC12345 if dtype == np.float32 else 0x7E15
    scales = [1, 1, factor, factor]
    launch, out = _lowered(shape, scales, dtype=dtype, entry=host_entry)
    assert launch.nearest and launch.label == "Resize kernel (nearest)"
    launch.threads = threads
    n, c = out[:2]
    # slice: 8 channels of another input before this one (16-byte aligned); misaligned: 1 channel
    # (channels-last: 1 element off), channels-first also a buffer 1 element off
    extra = {"slice": 8, "misaligned": 3}.get(where.partition("-")[2], 0)
    offset = {"slice": 8, "misaligned": 1}.get(where.partition("-")[2], 0)
    buf = _aligned((n, c + extra, *out[2:]), dtype, layout, shift=int(where == "nchw-misaligned"))
    buf.view(bits)[...] = np.iinfo(bits).max
    y = _run(launch, x, buf, offset)
    assert np.shares_memory(y, buf), "written into the Concat's slice"
    want = _reference(x, scales)
    np.testing.assert_array_equal(y.view(bits), want.view(bits))
    np.testing.assert_array_equal(y.view(bits), np.repeat(np.repeat(x, factor, axis=2), factor, axis=3).view(bits))
    rest = np.delete(buf, range(offset, offset + c), axis=1)
    assert (rest.view(bits) == np.iinfo(bits).max).all(), "nothing outside the slice written"
    v = 16 // np.dtype(dtype).itemsize
    last = layout == "nhwc"
    vec = (c if last else out[3]) % v == 0 and not where.endswith("misaligned")
    assert launch.paths == {f"resize_nearest_{'cl' if last else 'cf'}_{v if vec else 1}"}, launch.paths
    assert (y.strides[1] == y.itemsize) == last, "the output keeps the input's storage order"


@pytest.mark.parametrize("where", ["nchw", "nhwc"])
def test_a_rank3_nearest_resize_runs_on_its_last_axis(host_entry, where):
    shape = (2, 8, 6)
    rng = np.random.default_rng(2)
    x = _aligned(shape + (1,), np.float32, where)[..., 0]
    x[...] = rng.standard_normal(shape)
    launch, out = _lowered(shape, [1, 1, 2], entry=host_entry)
    assert launch.nearest
    buf = _aligned(out + (1,), np.float32, where)[..., 0]
    y = _run(launch, x, buf)
    np.testing.assert_array_equal(y, np.repeat(x, 2, axis=2))
    assert launch.paths == {"resize_nearest_cl_4" if where == "nhwc" else "resize_nearest_cf_4"}


@pytest.mark.parametrize("attrs", [{}, {"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
                                   {"coordinate_transformation_mode": "align_corners"}, {"nearest_mode": "round_prefer_ceil"}],
                         ids=["half_pixel", "asymmetric", "align_corners", "prefer_ceil"])
@pytest.mark.parametrize("where", ["nchw", "nhwc"])
def test_the_tables_carry_the_coordinate_transform(host_entry, attrs, where):
    """An integer factor under every coordinate transform (align_corners does not repeat blocks):
    the kernel reads the tables, so it matches the op library whatever they say."""
    shape = (1, 4, 5, 6)
    x = _aligned(shape, np.float32, where)
    x[...] = np.random.default_rng(3).standard_normal(shape)
    scales = [1, 1, 2, 3]
    launch, out = _lowered(shape, scales, entry=host_entry, mode="nearest", **attrs)
    assert launch.nearest
    buf = _aligned(out, np.float32, where)
    y = _run(launch, x, buf)
    np.testing.assert_array_equal(y, _reference(x, scales, mode="nearest", **attrs))


@pytest.mark.parametrize("scales,sizes,attrs,nearest", [
    ([1, 1, 2, 2], None, {}, True),
    ([1, 1, 3, 3], None, {"mode": "nearest"}, True),
    ([1, 1, 2, 1], None, {}, True),
    (None, [2, 8, 16, 24], {}, True),
    (None, [2, 8, 20, 24], {}, False),
    ([1, 1, 1.5, 1.5], None, {}, False),
    ([1, 1, 2, 2.5], None, {}, False),
    ([1, 1, 0.5, 0.5], None, {}, False),
    ([1, 1, 2, 2], None, {"mode": "linear"}, False),
    ([1, 1, 2, 2], None, {"mode": "cubic"}, False),
], ids=["x2", "x3", "x2-h-only", "sizes-x2-x3", "sizes-x2.5-x3", "x1.5", "x2-x2.5", "down", "linear", "cubic"])
def test_the_lowering_chooses_the_nearest_kernel_for_whole_factors(scales, sizes, attrs, nearest):
    launch, _ = _lowered((2, 8, 8, 8), scales, sizes, **attrs)
    assert launch is not None and launch.nearest == nearest
    assert launch.label == ("Resize kernel (nearest)" if nearest else "Resize kernel")
    (src,) = launch.sources()
    assert src.name == ("convpass_resize_nearest_float32" if nearest else "convpass_resize_float32")


def test_upsample_nearest_takes_the_nearest_kernel():
    launch, _ = _lowered((1, 4, 6, 6), [1, 1, 2, 2], op="Upsample", opset=9, mode="nearest")
    assert launch.nearest and launch.label == "Upsample kernel (nearest)"


def test_a_grid_beyond_cudas_limits_takes_the_generic_kernel():
    assert tensor_ops.nearest_fits((16, 128, 512, 512))
    assert not tensor_ops.nearest_fits((1, 70000, 2, 2)) and not tensor_ops.nearest_fits((1, 4, 70000, 2))
    assert not tensor_ops.nearest_fits((70000, 4, 2))


def test_a_fractional_nearest_resize_runs_resize_2d_unchanged(host_entry):
    """x1.5 nearest: the generic kernel, bit-exact against the op library (one tap of weight 1)."""
    shape = (2, 6, 4, 6)
    x = _aligned(shape, np.float32, "nhwc")
    x[...] = np.random.default_rng(4).standard_normal(shape)
    launch, out = _lowered(shape, [1, 1, 1.5, 1.5], entry=host_entry)
    assert not launch.nearest
    buf = _aligned(out, np.float32, "nhwc")
    y = _run(launch, x, buf)
    np.testing.assert_array_equal(y, _reference(x, [1, 1, 1.5, 1.5]))
    assert launch.paths == {"resize_2d"}


@pytest.mark.parametrize("last,dims,xs,ys,addresses,itemsize,want", [
    # the VAE decoder's x2: 128 channels, one warp a pixel, 8 pixels a row block, 2 a thread
    (True, (16, 128, 256, 256), (128 * 128 * 128, 1, 128 * 128, 128), (256 * 256 * 128, 1, 256 * 128, 128), (0, 0), 4,
     {"entry": "resize_nearest_cl_4", "grid": (16, 256, 16), "block": (32, 8)}),
    (False, (16, 128, 256, 256), (128 * 128 * 128, 128 * 128, 128, 1), (128 * 256 * 256, 256 * 256, 256, 1), (0, 0), 4,
     {"entry": "resize_nearest_cf_4", "grid": (32, 128, 16), "block": (64, 4)}),
    (True, (16, 128, 256, 256), (128 * 128 * 128, 1, 128 * 128, 128), (256 * 256 * 128, 1, 256 * 128, 128), (0, 0), 2,
     {"entry": "resize_nearest_cl_8", "grid": (8, 256, 16), "block": (16, 16)}),
    # an input slice whose channel stride breaks the vector: scalar
    (True, (1, 6, 8, 8), (4 * 4 * 6, 1, 4 * 6, 6), (8 * 8 * 6, 1, 8 * 6, 6), (0, 0), 4,
     {"entry": "resize_nearest_cl_1", "grid": (1, 8, 1), "block": (6, 2)}),
    (False, (1, 6, 8, 8), (96, 16, 4, 1), (384, 64, 8, 1), (0, 8), 4,
     {"entry": "resize_nearest_cf_1", "grid": (1, 6, 1), "block": (8, 2)}),
])
def test_nearest_geometry(last, dims, xs, ys, addresses, itemsize, want):
    assert tensor_ops.nearest_geometry(last, dims, xs, ys, addresses, itemsize) == want


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler (nvcc) on this machine")
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32"])
def test_nearest_source_compiles_for_hopper(dtype, tmp_path):
    src = tensor_ops.nearest_source(dtype)
    path = tmp_path / f"{src.name}.cu"
    path.write_text(src.code)
    done = subprocess.run([NVCC, "-std=c++17", "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert all(f"Compiling entry function '{e}'" in done.stderr for e in src.entries), done.stderr
    assert all(line.strip().startswith("0 bytes stack frame, 0 bytes spill stores") for line in done.stderr.splitlines() if "spill stores" in line)

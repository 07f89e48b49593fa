"""The cuda backend's per-element kernels, checked on the CPU.

``pool_window`` (MaxPool / AveragePool / LpPool) and ``resize_2d`` compute one output element per
loop iteration and use no warp or block cooperation, so their CUDA source compiles as host C++
(``__global__`` and friends defined away, the grid one thread that strides over every output) and
runs here on the same inputs as the NumPy op library: every ONNX attribute the kernels take
(pads, ceil_mode, dilations, count_include_pad, auto_pad; resize modes and coordinate transforms)
and both memory orders are checked without a GPU. The kernels on a GPU, and the ones that use
warps (normalizations), are checked in tests/gpu/test_kernels.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess
import types

import numpy as np
import pytest
from conftest import channels_last_array, host_library
from onnx import TensorProto, helper, numpy_helper

from convpass.kernels import pooling, tensor_ops
from convpass.ops.nn import _pool_geometry
from convpass.ops.registry import NodeInfo, decode_attributes, lookup
from convpass.ops.resize import resize_arguments, resize_geometry
from convpass.runtime.executor import Executor


@pytest.fixture(scope="module")
def pool_lib(tmp_path_factory):
    return host_library(tmp_path_factory.mktemp("pool"), pooling.source(np.float32).code, "pool")


@pytest.fixture(scope="module")
def resize_lib(tmp_path_factory):
    return host_library(tmp_path_factory.mktemp("resize"), tensor_ops.source(np.float32).code, "resize")


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def _elements(a: np.ndarray) -> tuple[int, ...]:
    return tuple(s // a.itemsize for s in a.strides)


def _node(op: str, opset: int, **attrs) -> NodeInfo:
    proto = helper.make_node(op, ["x"], ["y"], name=op.lower(), **attrs)
    node = NodeInfo(proto.name, op, "", opset, decode_attributes(list(proto.attribute)), ["x"], ["y"])
    node.impl = lookup(op, "", opset)
    return node


def _reference(op: str, opset: int, x: np.ndarray, inits=(), extra_inputs=(), **attrs) -> np.ndarray:
    node = helper.make_node(op, ["x", *extra_inputs], ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["?"] * x.ndim)], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    return Executor(model, device="cpu").run(None, {"x": np.ascontiguousarray(x)})[0]


def _run_pool(lib, x: np.ndarray, out_shape, mode: str, kernel, begin, end, strides, dilations, include_pad=False, p=2.0, channels_last=False):
    pad3 = pooling._pad3
    y = (channels_last_array(out_shape, np.random.default_rng(0)) if channels_last else np.empty(out_shape, np.float32))
    y[...] = np.nan  # poison: every element must be written
    xs5 = (*_elements(x)[:2], *pad3(_elements(x)[2:], 0))
    ys5 = (*_elements(y)[:2], *pad3(_elements(y)[2:], 0))
    n, c, *out = y.shape
    od, oh, ow = pad3(out, 1)
    idd, ih, iw = pad3(x.shape[2:], 1)
    ll, i, u = ctypes.c_longlong, ctypes.c_int, ctypes.c_uint
    args = [_ptr(x), _ptr(y), u(y.size), u(c), u(od), u(oh), u(ow), i(int(channels_last)), *(ll(v) for v in xs5), *(ll(v) for v in ys5),
            i(idd), i(ih), i(iw), *(i(v) for v in pad3(kernel, 1)), *(i(v) for v in pad3(strides, 1)), *(i(v) for v in pad3(dilations, 1)),
            *(i(v) for v in pad3(begin, 0)), *(i(v) for v in pad3(end, 0)), i(pooling._MODES[mode]), i(int(include_pad)), ctypes.c_float(p)]
    lib.pool_window(*args)
    return y


POOL_CASES = [
    ("MaxPool", (2, 3, 9, 11), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("MaxPool", (1, 4, 10, 10), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ("MaxPool", (1, 2, 12, 12), {"kernel_shape": [2, 3], "dilations": [2, 2], "pads": [0, 1, 2, 0]}),
    ("MaxPool", (2, 3, 7, 8), {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ("MaxPool", (2, 3, 17), {"kernel_shape": [4], "strides": [3], "pads": [1, 2]}),
    ("MaxPool", (1, 2, 5, 6, 7), {"kernel_shape": [2, 3, 3], "strides": [1, 2, 2], "pads": [0, 1, 1, 1, 0, 1]}),
    ("AveragePool", (2, 3, 9, 9), {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ("AveragePool", (2, 3, 9, 9), {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "count_include_pad": 0}),
    ("AveragePool", (1, 4, 10, 11), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1, "count_include_pad": 1}),
    ("AveragePool", (1, 4, 10, 11), {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1}),
    ("AveragePool", (1, 3, 8, 8), {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 1], "pads": [1, 0, 0, 1]}),
    ("AveragePool", (2, 2, 5, 6, 7), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2], "pads": [1, 0, 1, 0, 1, 1], "count_include_pad": 1}),
    ("LpPool", (2, 3, 8, 9), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "p": 3}),
]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("op,shape,attrs", POOL_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(POOL_CASES)])
def test_pool_window_kernel_matches_the_op_library(pool_lib, op, shape, attrs, channels_last):
    opset = 19
    rng = np.random.default_rng(1)
    x = channels_last_array(shape, rng) if channels_last else rng.standard_normal(shape).astype(np.float32)
    x.flat[0] = np.nan if op == "MaxPool" else x.flat[0]  # NaN propagates through MaxPool
    node = _node(op, opset, **attrs)
    kernel = tuple(attrs["kernel_shape"])
    begin, end, strides, dilations, out = _pool_geometry(node, shape[2:], kernel)
    mode = {"MaxPool": "max", "AveragePool": "average", "LpPool": "lp"}[op]
    got = _run_pool(pool_lib, x, (*shape[:2], *out), mode, kernel, begin, end, strides, dilations,
                    include_pad=bool(attrs.get("count_include_pad", 0)), p=float(attrs.get("p", 2)), channels_last=channels_last)
    want = _reference(op, opset, x, **attrs)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("strip", [1, 2, 3, 4])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("op,shape,attrs", [c for c in POOL_CASES if c[0] != "LpPool" and len(c[1]) == 4],
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(POOL_CASES) if c[0] != "LpPool" and len(c[1]) == 4])
def test_strip_pool_kernel_matches_the_op_library(tmp_path_factory, op, shape, attrs, channels_last, strip):
    """The 2-D strip kernel (several outputs per thread, the window unrolled) in every memory order
    and strip width, including strips that overhang the row's end: every output written, NaN kept."""
    opset = 19
    rng = np.random.default_rng(2)
    x = channels_last_array(shape, rng) if channels_last else rng.standard_normal(shape).astype(np.float32)
    x.flat[5] = np.nan if op == "MaxPool" else x.flat[5]
    node = _node(op, opset, **attrs)
    kernel = tuple(attrs["kernel_shape"])
    begin, end, strides, dilations, out = _pool_geometry(node, shape[2:], kernel)
    spec = {"mode": "max" if op == "MaxPool" else "average", "kernel": kernel, "strides": strides, "dilations": dilations,
            "count_include_pad": bool(attrs.get("count_include_pad", 0))}
    pool = dataclasses.replace(pooling.StripPool.for_spec(spec, channels_last), r=strip)
    source = pool.source(np.float32)
    lib = host_library(tmp_path_factory.mktemp("strip"), source.code, source.name)
    y = channels_last_array((*shape[:2], *out), rng) if channels_last else np.empty((*shape[:2], *out), np.float32)
    y[...] = np.nan  # poison: every element must be written
    n, c, oh, ow = y.shape
    strips = -(-ow // strip)
    i, ll = ctypes.c_int, ctypes.c_longlong
    lib.pool_strip(_ptr(x), _ptr(y), ctypes.c_uint(n * c * oh * strips), ctypes.c_uint(c), ctypes.c_uint(oh), ctypes.c_uint(strips),
                   i(shape[2]), i(shape[3]), i(ow), i(begin[0]), i(begin[1]), i(end[0]), i(end[1]), *(ll(v) for v in _elements(x)),
                   *(ll(v) for v in _elements(y)))
    want = _reference(op, opset, x, **attrs)
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=1e-6, equal_nan=True)


def test_strip_pool_takes_2d_max_and_average_only():
    spec = {"mode": "max", "kernel": (3, 3), "strides": [2, 2], "dilations": [1, 1], "count_include_pad": False}
    assert pooling.StripPool.for_spec(spec, True).r == pooling.STRIP_OUTPUTS_STRIDED
    assert pooling.StripPool.for_spec({**spec, "strides": [1, 1]}, False).r == pooling.STRIP_OUTPUTS
    assert pooling.StripPool.for_spec({**spec, "mode": "lp"}, False) is None
    assert pooling.StripPool.for_spec({**spec, "kernel": (3, 3, 3), "strides": [1, 1, 1], "dilations": [1, 1, 1]}, False) is None
    assert pooling.StripPool.for_spec({**spec, "kernel": (1, 46), "strides": [1, 1]}, False) is None  # a row window over 48 inputs


def _lowered_pool(op: str, shape, prefer: str = "auto", **attrs) -> pooling.PoolLaunch:
    """lower_pool over a one-step plan (no GPU needed: nothing is compiled or run)."""
    node = _node(op, 19, **attrs)
    out = _pool_geometry(node, shape[2:], tuple(attrs["kernel_shape"]))[4]
    infos = {0: (tuple(shape), np.dtype(np.float32)), 1: ((*shape[:2], *out), np.dtype(np.float32))}
    plan = types.SimpleNamespace(steps=[types.SimpleNamespace(node=node, inputs=[0], outputs=[1])], info=infos.get)
    return pooling.lower_pool(plan, 0, None, prefer)


@pytest.mark.parametrize("op,shape,attrs,prefer,runs", [
    ("MaxPool", (2, 8, 16, 16), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, "auto", "strip kernel"),
    ("AveragePool", (2, 8, 9, 9), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1}, "auto", "strip kernel"),
    ("MaxPool", (2, 8, 16, 16), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, "cudnn", "cuDNN"),
    ("MaxPool", (2, 8, 16, 16), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, "kernel", "strip kernel"),
    ("AveragePool", (1, 2, 5, 6, 7), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}, "auto", "cuDNN"),
    ("MaxPool", (2, 3, 17), {"kernel_shape": [4], "strides": [3], "pads": [1, 2]}, "auto", "kernel"),
    ("LpPool", (2, 3, 8, 9), {"kernel_shape": [3, 3], "strides": [2, 2], "p": 3}, "auto", "kernel"),
], ids=["max-2d", "avg-2d", "max-2d-cudnn", "max-2d-kernel", "avg-3d", "max-1d", "lp-2d"])
def test_window_pooling_runs_the_measured_choice(op, shape, attrs, prefer, runs):
    """auto: the strip kernel for 2-D max / average (measured faster than cuDNN), cuDNN for the 3-D
    poolings it expresses, pool_window for the rest; the launch's label says which."""
    launch = _lowered_pool(op, shape, prefer, **attrs)
    assert launch.label == f"{op} ({runs})"
    assert launch.strip == (runs == "strip kernel") and launch.use_cudnn == (runs == "cuDNN")


def _resize_values(node_inputs, scales=None, sizes=None):
    return [None, None, None if scales is None else np.asarray(scales, np.float32), None if sizes is None else np.asarray(sizes, np.int64)]


RESIZE_CASES = [
    ({"mode": "nearest"}, (1, 3, 5, 7), [1, 1, 2, 2], None),
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, (2, 2, 6, 5), [1, 1, 1.5, 3], None),
    ({"mode": "linear"}, (1, 3, 5, 7), None, [1, 3, 11, 16]),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, (2, 4, 8, 8), [1, 1, 2, 2], None),
    ({"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, (1, 2, 9, 9), [1, 1, 0.5, 0.5], None),
    ({"mode": "cubic", "cubic_coeff_a": -0.5}, (1, 2, 6, 6), [1, 1, 2, 1.5], None),
    ({"mode": "linear", "antialias": 1}, (1, 2, 12, 12), [1, 1, 0.5, 0.25], None),
    ({"mode": "linear"}, (2, 3, 10), [1, 1, 2.5], None),
]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("attrs,shape,scales,sizes", RESIZE_CASES, ids=[f"{c[0]['mode']}-{i}" for i, c in enumerate(RESIZE_CASES)])
def test_resize_kernel_matches_the_op_library(resize_lib, attrs, shape, scales, sizes, channels_last):
    opset = 19
    rng = np.random.default_rng(2)
    x = channels_last_array(shape, rng) if channels_last else rng.standard_normal(shape).astype(np.float32)
    node = _node("Resize", opset, **attrs)
    g = resize_geometry(node, shape, np.float32, **resize_arguments(node, _resize_values(None, scales, sizes)))
    by_axis = {a: (kind, table) for a, kind, table, _ in g.axes}
    rank = len(shape)
    if rank == 4:
        iy, wy = tensor_ops.resize_taps(*by_axis.get(2, (None, None)), shape[2], g.out_shape[2])
    else:
        iy, wy = np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32)
    ix, wx = tensor_ops.resize_taps(*by_axis.get(rank - 1, (None, None)), shape[-1], g.out_shape[-1])
    y = channels_last_array(g.out_shape, rng) if channels_last else np.empty(g.out_shape, np.float32)
    y[...] = np.nan
    xs, ys = _elements(x), _elements(y)
    if rank == 3:
        xs, ys = (*xs[:2], 0, xs[2]), (*ys[:2], 0, ys[2])
        oh, ow = 1, g.out_shape[2]
    else:
        oh, ow = g.out_shape[2:]
    tables = [np.ascontiguousarray(t) for t in (iy, wy, ix, wx)]
    ll, i, u = ctypes.c_longlong, ctypes.c_int, ctypes.c_uint
    resize_lib.resize_2d(_ptr(x), _ptr(y), u(y.size), u(g.out_shape[1]), u(oh), u(ow), i(int(channels_last)), *(ll(v) for v in xs),
                         *(ll(v) for v in ys), _ptr(tables[0]), _ptr(tables[1]), i(iy.shape[1]), _ptr(tables[2]), _ptr(tables[3]), i(ix.shape[1]))
    inits = []
    extra = ["", "scales" if scales is not None else "", "sizes" if sizes is not None else ""]
    if scales is not None:
        inits.append(numpy_helper.from_array(np.asarray(scales, np.float32), "scales"))
    if sizes is not None:
        inits.append(numpy_helper.from_array(np.asarray(sizes, np.int64), "sizes"))
    want = _reference("Resize", opset, x, inits, [e for e in extra], **attrs)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_resize_taps_identity_index_and_matrix():
    idx, w = tensor_ops.resize_taps(None, None, 4, 4)
    assert idx.ravel().tolist() == [0, 1, 2, 3] and w.ravel().tolist() == [1, 1, 1, 1]
    idx, w = tensor_ops.resize_taps("index", np.array([0, 0, 1, 1]), 2, 4)
    assert idx.ravel().tolist() == [0, 0, 1, 1]
    m = np.array([[1.0, 0.25, 0.0], [0.0, 0.75, 1.0]], np.float32)  # M[in, out]
    idx, w = tensor_ops.resize_taps("matrix", m, 2, 3)
    assert idx.tolist() == [[0, 0], [0, 1], [1, 0]] and np.allclose(w, [[1, 0], [0.25, 0.75], [1, 0]])


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler (nvcc) on this machine")
@pytest.mark.parametrize("family", ["normalization", "pooling", "tensor_ops", "group_norm"])
def test_kernel_sources_compile_for_hopper(family, tmp_path):
    """Every hand-written kernel source compiles for sm_90 without spills, in float16 (the variant
    with the cuda_fp16 header; float32 is the same code with plain floats)."""
    import importlib

    src = importlib.import_module(f"convpass.kernels.{family}").source(np.float16)
    path = tmp_path / f"{src.name}.cu"
    path.write_text(src.code)
    done = subprocess.run([NVCC, "-std=c++17", "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for entry in src.entries:
        assert f"Compiling entry function '{entry}'" in done.stderr, entry
    assert "bytes spill stores" in done.stderr and all(
        line.strip().startswith("0 bytes stack frame, 0 bytes spill stores") for line in done.stderr.splitlines() if "spill stores" in line
    ), done.stderr


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler (nvcc) on this machine")
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fused_norm_apply_kernel_compiles_for_hopper(dtype, tmp_path):
    """The generated apply kernel of a fused GroupNorm + SiLU + residual (statistics and parameters
    read as float beside the tensor's storage type) compiles for sm_90 without spills."""
    from fused_models import block, feeds

    from convpass.kernels import broadcast, group_norm

    ex = Executor(block(), device="cpu")
    ex.run(None, feeds((2, 8, 5, 6)))
    ex.run(None, feeds((2, 8, 5, 6)))
    spec = ex.last_plan.steps[-1].node.prepared
    kinds = ["constant", "constant", "value"]
    group = group_norm.apply_group(spec, dtype, kinds)
    src = broadcast.broadcast_source(group, group_norm.apply_classes(kinds, [(8, 1, 1), (8, 1, 1), (2, 8, 5, 6)]))
    path = tmp_path / f"{src.name}.cu"
    path.write_text(src.code)
    done = subprocess.run([NVCC, "-std=c++17", "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert all(f"Compiling entry function '{e}'" in done.stderr for e in src.entries), done.stderr
    assert all(line.strip().startswith("0 bytes stack frame, 0 bytes spill stores") for line in done.stderr.splitlines() if "spill stores" in line)


def test_global_pooling_walks_positions_as_one_strided_run():
    """The global pooling kernel walks the spatial positions of one (n, c) as a single strided run:
    packed channels-first (stride 1), channels-last and a channel slice of a Concat buffer (stride C),
    never a spatial crop (then the launch packs the input first)."""
    a = np.zeros((2, 6, 5, 7), np.float32)
    last = np.zeros((2, 5, 7, 6), np.float32).transpose(0, 3, 1, 2)
    concat_slice = np.zeros((2, 5, 7, 10), np.float32).transpose(0, 3, 1, 2)[:, 2:8]
    assert pooling._flat_positions(a) == 1
    assert pooling._flat_positions(last) == 6
    assert pooling._flat_positions(concat_slice) == 10
    assert pooling._flat_positions(a[:, :, 1:4, 2:6]) is None
    assert pooling._flat_positions(np.zeros((2, 6, 9), np.float32)) == 1
    assert pooling._flat_positions(np.zeros((2, 6, 1, 7), np.float32)[:, :, :, ::2]) == 2  # a size-1 dim imposes nothing

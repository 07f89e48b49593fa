"""The cuda backend's kernel families on a GPU, each against the CPU executor (the NumPy op library).

Pooling (convpass's kernel and cuDNN's), global pooling and spatial reductions (the op library,
checked for capture), normalizations (warp, block and split-row launches), softmax (cuDNN), Resize, BatchNormalization fused with what follows,
Concat written in place — in float32 and float16, channels-first and channels-last, eager and
replayed from a CUDA graph; and the capture report: every plan here is one CUDA graph, a
data-dependent plan runs eagerly and says why, an op that cannot be captured is named and the
rest of the plan still replays as graphs.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_cuda_backend")]

cp = pytest.importorskip("cupy")

from convpass.runtime import Executor  # noqa: E402
from convpass.runtime.cuda import StartupCompileWarning  # noqa: E402

N = helper.make_node
_TP = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}



def _model(nodes, inputs, outputs, dtype=np.float32, inits=(), opset=19):
    tp = _TP[dtype]
    ins = [helper.make_tensor_value_info(n, tp, s) for n, s in inputs]
    rank = len(inputs[0][1])  # every model here keeps its input's rank
    outs = [helper.make_tensor_value_info(n, tp, [f"{n}_{i}" for i in range(rank)]) for n in outputs]
    graph = helper.make_graph(nodes, "g", ins, outs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _backend(**options):
    from convpass.runtime.cuda import CudaBackend

    return CudaBackend(**options)


def _check(model, feeds, tol, *, expect_launch=None, channels_last_input=False, **options):
    """CPU reference (float32 for float16 models, then rounded) vs the cuda executor: first run,
    warm-up + capture, replays. Returns the executor."""
    ref_feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    ref_model = model
    if any(v.dtype == np.float16 for v in feeds.values()):
        ref_model = _as_float32(model)
    refs = Executor(ref_model, device="cpu").run(None, ref_feeds)
    dev_feeds = {k: cp.asarray(v) for k, v in feeds.items()}
    if channels_last_input:
        dev_feeds = {k: _to_channels_last(v) for k, v in dev_feeds.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: every plan here is one graph
        warnings.simplefilter("ignore", StartupCompileWarning)  # models given as protos: no kernel side-car
        ex = Executor(model, device=_backend(**options), output_kind="numpy")
        for run in range(4):
            outs = ex.run(None, dev_feeds)
            for got, want in zip(outs, refs):
                scale = float(np.nanmax(np.abs(want), initial=1.0))  # a NaN a max pooling propagates is compared as NaN
                np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol * scale,
                                           err_msg=f"run {run + 1}")
    status = ex.graph_status()
    assert status.captured, status.describe()
    if expect_launch is not None:
        labels = [launch.label for launch in ex.last_plan.backend_state.launch_list()]
        assert any(expect_launch in label for label in labels), labels
    return ex


def _to_channels_last(a):
    if a.ndim < 3:
        return a
    phys = cp.ascontiguousarray(cp.moveaxis(a, 1, -1))
    return cp.moveaxis(phys, -1, 1)


def _as_float32(model):
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for vi in [*m.graph.input, *m.graph.output]:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT16:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    for i, t in enumerate(m.graph.initializer):
        if t.data_type == TensorProto.FLOAT16:
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
    return m


DTYPES = [pytest.param(np.float32, id="fp32"), pytest.param(np.float16, id="fp16")]
TOL = {np.float32: 2e-5, np.float16: 4e-3}


# ---------------------------------------------------------------------------------------------
# pooling


POOLS = [
    ("MaxPool", (2, 8, 17, 19), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("MaxPool", (2, 8, 16, 16), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ("AveragePool", (2, 8, 15, 15), {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ("AveragePool", (2, 8, 15, 15), {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]}),
    ("AveragePool", (2, 8, 15, 16), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ("MaxPool", (2, 4, 6, 9, 9), {"kernel_shape": [1, 3, 3], "strides": [1, 2, 2], "pads": [0, 1, 1, 0, 1, 1]}),
    ("LpPool", (2, 8, 12, 12), {"kernel_shape": [3, 3], "strides": [2, 2], "p": 2}),
    ("MaxPool", (2, 8, 40), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
]


@pytest.mark.parametrize("prefer", ["kernel", "cudnn"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,shape,attrs", POOLS, ids=[f"{p[0]}{i}" for i, p in enumerate(POOLS)])
def test_window_pooling(op, shape, attrs, dtype, channels_last, prefer):
    model = _model([N(op, ["x"], ["y"], **attrs)], [("x", shape)], ["y"], dtype)
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    _check(model, {"x": x}, TOL[dtype], expect_launch=op, channels_last_input=channels_last, pooling=prefer)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "nodes,inits",
    [
        ([N("GlobalAveragePool", ["x"], ["y"])], []),
        ([N("GlobalMaxPool", ["x"], ["y"])], []),
        ([N("ReduceMean", ["x", "axes"], ["y"], keepdims=1)], [_const("axes", [2, 3], np.int64)]),
        ([N("ReduceMax", ["x", "axes"], ["y"], keepdims=1)], [_const("axes", [-1, -2], np.int64)]),
        ([N("ReduceMean", ["x", "axes"], ["y"], keepdims=1)], [_const("axes", [1, 2], np.int64)]),  # not spatial: the op library
    ],
    ids=["gap", "gmp", "reducemean", "reducemax", "reducemean-c-h"],
)
@pytest.mark.parametrize("shape", [(3, 40, 7, 7), (2, 24, 56, 56), (1, 1280, 7, 7), (2, 33, 1, 3)], ids=["7x7", "56x56", "c1280", "odd"])
def test_global_pooling(nodes, inits, shape, dtype, channels_last):
    """convpass's global pooling kernel (a warp per row channels-first, coalesced channel tiles
    channels-last) against the NumPy op library; NaN propagates through the max."""
    model = _model(nodes, [("x", shape)], ["y"], dtype, inits, opset=18)
    x = (1 + np.random.default_rng(1).standard_normal(shape)).astype(dtype)
    spatial = nodes[0].op_type.startswith("Global") or list(numpy_helper.to_array(inits[0])) != [1, 2]
    if nodes[0].op_type in ("GlobalMaxPool", "ReduceMax"):
        x[0, 0, 0, 0] = np.nan
    _check(model, {"x": x}, TOL[dtype] * 4, channels_last_input=channels_last,
           expect_launch=f"{nodes[0].op_type} (kernel)" if spatial else None)


# ---------------------------------------------------------------------------------------------
# normalizations and softmax


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,axis",
    [((4, 56, 56, 96), -1), ((2, 96, 28, 28), 1), ((2, 8, 5000), -1), ((2, 4, 3, 50), 2)],
    ids=["warp", "block_axis1", "block", "axis2"],
)
def test_layer_norm_any_axis(shape, axis, dtype):
    rng = np.random.default_rng(2)
    a = axis + len(shape) if axis < 0 else axis
    pshape = shape[a:]
    inits = [_const("g", 1 + 0.1 * rng.standard_normal(pshape), dtype), _const("b", rng.standard_normal(pshape), dtype)]
    model = _model([N("LayerNormalization", ["x", "g", "b"], ["y"], axis=axis, epsilon=1e-5)], [("x", shape)], ["y"], dtype, inits, 17)
    x = (3 + 2 * rng.standard_normal(shape)).astype(dtype)
    _check(model, {"x": x}, TOL[dtype] * 2, expect_launch="LayerNormalization kernel")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 16, 33), (2, 32, 40, 40), (1, 4, 300000)], ids=["small", "block", "split"])
def test_instance_norm(shape, dtype):
    rng = np.random.default_rng(3)
    c = shape[1]
    inits = [_const("s", 1 + 0.1 * rng.standard_normal(c), dtype), _const("b", rng.standard_normal(c), dtype)]
    model = _model([N("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-5)], [("x", shape)], ["y"], dtype, inits, 17)
    x = (1 + 2 * rng.standard_normal(shape)).astype(dtype)
    _check(model, {"x": x}, TOL[dtype] * 4, expect_launch="InstanceNormalization")  # kernel or cuDNN by row shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,groups", [((2, 32, 20, 20), 8), ((1, 512, 4000), 1)], ids=["g8", "g1_split"])
def test_group_norm(shape, groups, dtype):
    rng = np.random.default_rng(4)
    opset, n = 21, shape[1]
    inits = [_const("s", 1 + 0.1 * rng.standard_normal(n), dtype), _const("b", rng.standard_normal(n), dtype)]
    model = _model([N("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=groups, epsilon=1e-5)], [("x", shape)], ["y"], dtype, inits, opset)
    x = (2 * rng.standard_normal(shape)).astype(dtype)
    _check(model, {"x": x}, TOL[dtype] * 4, expect_launch="GroupNormalization kernel")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape,opset,axis", [((8, 12, 197, 197), 13, -1), ((4, 3000), 13, -1), ((2, 3, 4, 5), 11, 1)], ids=["attn", "wide", "opset11"])
def test_softmax(op, shape, opset, axis, dtype):
    model = _model([N(op, ["x"], ["y"], axis=axis)], [("x", shape)], ["y"], dtype, opset=opset)
    x = (3 * np.random.default_rng(5).standard_normal(shape)).astype(dtype)
    _check(model, {"x": x}, TOL[dtype] * 2, expect_launch=f"{op} (cuDNN)")


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_batchnorm_relu_is_one_fused_kernel(dtype, channels_last):
    rng = np.random.default_rng(6)
    c = 24
    inits = [_const("s", 1 + 0.2 * rng.standard_normal(c), dtype), _const("b", rng.standard_normal(c), dtype),
             _const("m", rng.standard_normal(c), dtype), _const("v", 0.5 + rng.random(c), dtype)]
    nodes = [N("BatchNormalization", ["x", "s", "b", "m", "v"], ["n"], epsilon=1e-5), N("Relu", ["n"], ["y"])]
    model = _model(nodes, [("x", (4, c, 14, 14))], ["y"], dtype, inits, 15)
    x = rng.standard_normal((4, c, 14, 14)).astype(dtype)
    ex = _check(model, {"x": x}, TOL[dtype] * 2, expect_launch="fused BatchNormalization+Relu", channels_last_input=channels_last)
    assert len(ex.last_plan.backend_state.launch_list()) == 1


# ---------------------------------------------------------------------------------------------
# Resize


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "attrs,scales",
    [
        ({"mode": "nearest"}, [1, 1, 2, 2]),
        ({"mode": "linear"}, [1, 1, 2, 2]),
        ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, [1, 1, 4, 4]),
        ({"mode": "cubic"}, [1, 1, 1.5, 2]),
    ],
    ids=["nearest", "linear", "align_corners", "cubic"],
)
def test_resize(attrs, scales, dtype, channels_last):
    inits = [_const("scales", scales)]
    model = _model([N("Resize", ["x", "", "scales"], ["y"], **attrs)], [("x", (2, 16, 28, 28))], ["y"], dtype, inits, 19)
    x = np.random.default_rng(7).standard_normal((2, 16, 28, 28)).astype(dtype)
    _check(model, {"x": x}, TOL[dtype] * 2, expect_launch="Resize kernel", channels_last_input=channels_last)


def _resize_launches(ex):
    from convpass.kernels.tensor_ops import ResizeLaunch

    return [launch for launch in ex.last_plan.backend_state.launch_list() if isinstance(launch, ResizeLaunch)]


def _nhwc_feeds(nodes, inputs, outputs, dtype, inits, feeds):
    """A model whose inputs arrive NHWC and are transposed (a view on the GPU) to the logical NCHW
    names the ``nodes`` read, and its feeds: the first op reads channels-last storage, also in a
    replayed graph (whose input buffers are packed copies of the feeds)."""
    heads = [N("Transpose", [f"{name}_nhwc"], [name], perm=[0, 3, 1, 2]) for name, _ in inputs]
    nhwc = [(f"{name}_nhwc", (s[0], *s[2:], s[1])) for name, s in inputs]
    return (_model(heads + nodes, nhwc, outputs, dtype, inits, 19),
            {f"{k}_nhwc": np.ascontiguousarray(np.moveaxis(v, 1, -1)) for k, v in feeds.items()})


NEAREST = [((2, 16, 28, 28), 2), ((2, 8, 14, 10), 3), ((2, 6, 9, 7), 2), ((1, 12, 6, 6), 3)]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,factor", NEAREST, ids=[f"{'x'.join(map(str, s))}-x{f}" for s, f in NEAREST])
def test_resize_nearest_kernel(shape, factor, dtype, layout):
    """Nearest upsampling by a whole factor: the nearest kernel, bit-exact, eager and replayed; the
    16-byte entry where the vectorized dimension (channels-last: C; channels-first: the output's W)
    takes it."""
    inits = [_const("scales", [1, 1, factor, factor])]
    nodes = [N("Resize", ["x", "", "scales"], ["y"], mode="nearest")]
    feeds = {"x": np.random.default_rng(7).standard_normal(shape).astype(dtype)}
    if layout == "nhwc":
        model, dev = _nhwc_feeds(nodes, [("x", shape)], ["y"], dtype, inits, feeds)
        want = np.repeat(np.repeat(feeds["x"], factor, axis=2), factor, axis=3)  # half_pixel, whole factor: o // factor
        ex = Executor(model, device=_backend(), output_kind="numpy")
        for _ in range(4):
            (got,) = ex.run(None, {k: cp.asarray(v) for k, v in dev.items()})
            np.testing.assert_array_equal(got, want)
        assert ex.graph_status().captured
    else:
        ex = _check(_model(nodes, [("x", shape)], ["y"], dtype, inits, 19), feeds, 0.0, expect_launch="Resize kernel (nearest)")
    (launch,) = _resize_launches(ex)
    v = 16 // np.dtype(dtype).itemsize
    along = shape[1] if layout == "nhwc" else shape[3] * factor
    assert launch.paths == {f"resize_nearest_{'cl' if layout == 'nhwc' else 'cf'}_{v if along % v == 0 else 1}"}, launch.paths


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels", [(8, 16), (6, 8)], ids=["aligned", "misaligned"])
def test_resize_nearest_writes_its_concat_slice(channels, dtype, layout):
    """Two upsamplings concatenated: each writes its slice of the Concat's buffer (no copy); a slice
    at channel 6 of a channels-last buffer of 14 is not 16-byte aligned: the scalar entry."""
    ca, cb = channels
    shape_a, shape_b = (2, ca, 8, 8), (2, cb, 8, 8)
    inits = [_const("scales", [1, 1, 2, 2])]
    nodes = [N("Resize", ["a", "", "scales"], ["ra"], mode="nearest"), N("Resize", ["b", "", "scales"], ["rb"], mode="nearest"),
             N("Concat", ["ra", "rb"], ["y"], axis=1)]
    rng = np.random.default_rng(8)
    feeds = {"a": rng.standard_normal(shape_a).astype(dtype), "b": rng.standard_normal(shape_b).astype(dtype)}
    want = np.concatenate([np.repeat(np.repeat(feeds[k], 2, axis=2), 2, axis=3) for k in "ab"], axis=1)
    if layout == "nhwc":
        model, dev = _nhwc_feeds(nodes, [("a", shape_a), ("b", shape_b)], ["y"], dtype, inits, feeds)
    else:
        model, dev = _model(nodes, [("a", shape_a), ("b", shape_b)], ["y"], dtype, inits, 19), feeds
    ex = Executor(model, device=_backend(), output_kind="numpy")
    for _ in range(4):
        (got,) = ex.run(None, {k: cp.asarray(v) for k, v in dev.items()})
        np.testing.assert_array_equal(got, want)
    assert ex.graph_status().captured
    launches = _resize_launches(ex)
    assert len(launches) == 2 and all(launch.placement is not None for launch in launches), launches
    v = 16 // np.dtype(dtype).itemsize
    if layout == "nhwc":
        vec = ca % v == 0 and cb % v == 0
        assert all(launch.paths == {f"resize_nearest_cl_{v if vec else 1}"} for launch in launches), [la.paths for la in launches]
    else:
        assert all(launch.paths == {f"resize_nearest_cf_{v if 16 % v == 0 else 1}"} for launch in launches), [la.paths for la in launches]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fractional_nearest_resize_takes_the_generic_kernel(dtype):
    inits = [_const("scales", [1, 1, 1.5, 2.5])]
    model = _model([N("Resize", ["x", "", "scales"], ["y"], mode="nearest")], [("x", (2, 8, 10, 10))], ["y"], dtype, inits, 19)
    x = np.random.default_rng(9).standard_normal((2, 8, 10, 10)).astype(dtype)
    ex = _check(model, {"x": x}, 0.0, expect_launch="Resize kernel")
    (launch,) = _resize_launches(ex)
    assert not launch.nearest and launch.paths == {"resize_2d"}


# ---------------------------------------------------------------------------------------------
# Concat in place, capture reports


def _dense_block(c0=16, growth=8, layers=4, dtype=np.float32):
    """DenseNet-style: features = [x0]; each layer BN -> Relu -> Conv3x3 on Concat(features)."""
    rng = np.random.default_rng(8)
    nodes = [N("MaxPool", ["x"], ["x0"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])]
    inits = []
    feats, c = ["x0"], c0
    for k in range(layers):
        cat = feats[0] if len(feats) == 1 else f"cat{k}"
        if len(feats) > 1:
            nodes.append(N("Concat", list(feats), [cat], axis=1))
        for p, v in (("s", 1 + 0.1 * rng.standard_normal(c)), ("b", 0.1 * rng.standard_normal(c)), ("m", 0.1 * rng.standard_normal(c)), ("v", 0.5 + rng.random(c))):
            inits.append(_const(f"{p}{k}", v, dtype))
        inits.append(_const(f"w{k}", 0.2 * rng.standard_normal((growth, c, 3, 3)), dtype))
        nodes += [
            N("BatchNormalization", [cat, f"s{k}", f"b{k}", f"m{k}", f"v{k}"], [f"n{k}"]),
            N("Relu", [f"n{k}"], [f"r{k}"]),
            N("Conv", [f"r{k}", f"w{k}"], [f"f{k}"], pads=[1, 1, 1, 1]),
        ]
        feats.append(f"f{k}")
        c += growth
    nodes.append(N("Concat", list(feats), ["y"], axis=1))
    return _model(nodes, [("x", (2, c0, 16, 16))], ["y"], dtype, inits, 15)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_block_concats_write_in_place_and_capture(dtype):
    model = _dense_block(dtype=dtype)
    x = np.random.default_rng(9).standard_normal((2, 16, 16, 16)).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # untuned convs: the heuristic note
        ex = _run_checked(model, {"x": x}, 5e-3 if dtype == np.float32 else 1e-2)  # the convs may use TF32
    launches = ex.last_plan.backend_state.launch_list()
    concats = [launch for launch in launches if launch.node.op_type == "Concat"]
    assert concats and all(launch.copies == [] or len(launch.copies) <= 1 for launch in concats), [c.copies for c in concats]
    assert any(launch.placement is not None for launch in launches if launch.node.op_type == "MaxPool")


def _run_checked(model, feeds, tol, **options):
    refs = Executor(model if not any(v.dtype == np.float16 for v in feeds.values()) else _as_float32(model), device="cpu").run(
        None, {k: v.astype(np.float32) for k, v in feeds.items()})
    ex = Executor(model, device=_backend(**options), output_kind="numpy")
    for _ in range(4):
        for got, want in zip(ex.run(None, feeds), refs):
            scale = float(np.max(np.abs(want), initial=1.0))
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * scale)
    assert ex.graph_status().captured, ex.graph_status().describe()
    return ex


def test_an_uncapturable_op_is_named_and_the_rest_replays_as_graphs():
    # a 1-D @ 2-D MatMul goes to cupy.matmul, which CuPy cannot capture: that launch runs eagerly
    rng = np.random.default_rng(10)
    inits = [_const("w", rng.standard_normal((6, 4)))]
    nodes = [N("Relu", ["x"], ["r"]), N("MatMul", ["r", "w"], ["m"]), N("Sigmoid", ["m"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    x = rng.standard_normal(6).astype(np.float32)
    (want,) = Executor(model, device="cpu").run(None, {"x": x})
    from convpass.runtime.cuda import ExecutorWarning

    with pytest.warns(ExecutorWarning, match="CUDA graph: node"):
        ex = Executor(model, device=_backend(), output_kind="numpy")
        for _ in range(3):
            (got,) = ex.run(None, {"x": x})
            np.testing.assert_allclose(got, want, rtol=1e-5)
    status = ex.graph_status()
    assert ex.last_plan.backend_state.mode == "segmented", status.describe()
    assert status.captured is False and "MatMul" in status.reason and status.node
    x2 = rng.standard_normal(6).astype(np.float32)
    (want2,) = Executor(model, device="cpu").run(None, {"x": x2})
    np.testing.assert_allclose(ex.run(None, {"x": x2})[0], want2, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("kernel,stride,dilation", [(3, 1, 1), (3, 2, 1), (5, 2, 1), (7, 1, 1), (3, 1, 2)])
def test_own_depthwise_kernel_matches_cudnn(kernel, stride, dilation, layout, dtype):
    """convpass's depthwise kernel, every variant the tuner times, against cuDNN's deterministic
    FMA algorithm on the same inputs (float16: both accumulate in float32)."""
    from convpass.core.problem import ConvShape
    from convpass.kernels.depthwise import DepthwiseKernel, candidates
    from convpass.native import cudnn

    pad = dilation * (kernel // 2)
    shape = ConvShape("fwd", 3, 24, 24, (17, 19), (kernel, kernel), (pad, pad), (stride, stride), (dilation, dilation), groups=24, dtype=dtype)
    rng = np.random.default_rng(kernel * 10 + stride)
    x = cudnn.as_layout(cp.asarray(rng.standard_normal(shape.x_shape).astype(dtype)), layout)
    w = cudnn.as_layout(cp.asarray((rng.standard_normal(shape.w_shape) * 0.2).astype(dtype)), layout)
    want = cudnn.empty_like_layout(shape.y_shape, dtype, layout)
    with cudnn.ConvDescriptors(shape.key(layout, "fma")) as descs:
        cudnn.run(descs, None, "implicit_gemm", x, w, want)
    ref = cp.asnumpy(want).astype(np.float64)
    assert candidates(shape)
    for algo in candidates(shape):
        y = cudnn.empty_like_layout(shape.y_shape, dtype, layout)
        y.fill(np.nan)
        kernel = DepthwiseKernel.of(algo, shape, layout)
        kernel(cp, x, kernel.weight(cp, w), y)
        got = cp.asnumpy(y).astype(np.float64)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < (2e-3 if dtype == "float16" else 1e-6), (algo, err)


# ---------------------------------------------------------------------------------------------
# ScatterND / ScatterElements (Swin's shifted windows): ONNX's own node cases on the GPU


def _scatter_cases():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.case.node import collect_testcases

        return [c for c in collect_testcases() if c.name.startswith("test_scatter") and not c.name.endswith("_expanded")]


@pytest.mark.parametrize("case", _scatter_cases(), ids=lambda c: c.name)
def test_scatter_node_cases_match_onnx_and_capture(case):
    """Each case's expected outputs, from the first run, the captured one and a replay. A reduction
    CuPy has no ``ufunc.at`` for (``mul``) reduces in rounds whose sizes the host reads: that node
    is named and runs between captured segments."""
    from convpass.runtime.cuda import ExecutorWarning

    names = [i.name for i in case.model.graph.input]
    for inputs, expected in case.data_sets:
        feeds = {n: numpy_helper.to_array(i) if not isinstance(i, np.ndarray) else i for n, i in zip(names, inputs)}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ex = Executor(case.model, device=_backend(), output_kind="numpy")
            for run in range(3):
                for got, want in zip(ex.run(None, feeds), expected):
                    want = numpy_helper.to_array(want) if not isinstance(want, np.ndarray) else want
                    assert got.dtype == want.dtype and got.shape == want.shape
                    np.testing.assert_allclose(got, want, rtol=case.rtol, atol=case.atol, err_msg=f"run {run + 1}")
        status = ex.graph_status()
        if "_mul" in case.name:
            assert not status.captured and status.node, status.describe()
            assert any(issubclass(w.category, ExecutorWarning) and "CUDA graph" in str(w.message) for w in seen)
        else:
            assert status.captured, status.describe()
            assert not [w for w in seen if issubclass(w.category, ExecutorWarning)], [str(w.message) for w in seen]

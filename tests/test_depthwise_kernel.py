"""convpass's depthwise conv kernel (:mod:`convpass.kernels.depthwise`), checked on the CPU.

The kernel uses no warp or block cooperation, so its generated CUDA source compiles as host C++
(conftest's ``host_library``) and runs here against a float64 NumPy convolution: strides,
dilations, pads, kernels that are not square, rows narrower than a strip, both thread orders,
strided inputs and outputs (Concat slices), and the epilogue (bias, residual, ReLU) in the kernel.
On a GPU it is checked by the tuner's reference check and tests/gpu/test_executor_cuda.py.
"""

from __future__ import annotations

import ctypes
import types

import numpy as np
import onnx
import pytest
from conftest import channels_last_array, host_library, numpy_candidates
from onnx import helper, numpy_helper

import convpass
from convpass.core import annotation
from convpass.core.algo import Algo
from convpass.core.cudnn_enums import algo_names
from convpass.core.device import DeviceFingerprint
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem, ConvShape
from convpass.kernels import depthwise
from convpass.tuning import tuner
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.decide import EPILOGUE_METHOD, legacy_fallback, select


def _shape(c=6, hw=(9, 11), ker=(3, 3), pads=(1, 1), strides=(1, 1), dil=(1, 1), n=2, dtype="float32") -> ConvShape:
    return ConvShape("fwd", n, c, c, hw, ker, pads, strides, dil, groups=c, dtype=dtype)


def _reference(x, w, shape: ConvShape, bias=None, z=None, relu=False) -> np.ndarray:
    """float64 depthwise conv + epilogue, straight from the definition."""
    (ph, pw), (sh, sw), (dh, dw) = shape.pads, shape.strides, shape.dilations
    oh, ow = shape.output_spatial
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    y = np.zeros((x.shape[0], x.shape[1], oh, ow))
    for i in range(shape.kernel[0]):
        for j in range(shape.kernel[1]):
            window = xp[:, :, i * dh: i * dh + (oh - 1) * sh + 1: sh, j * dw: j * dw + (ow - 1) * sw + 1: sw]
            y += window * w[:, 0, i, j].astype(np.float64)[None, :, None, None]
    if bias is not None:
        y += bias.astype(np.float64)[None, :, None, None]
    if z is not None:
        y += z
    return np.maximum(y, 0) if relu else y


def _stored(shape, channels_last: bool, rng) -> np.ndarray:
    """A float32 array of logical ``shape`` stored channels-last (a transposed view) or not."""
    return channels_last_array(shape, rng) if channels_last else rng.standard_normal(shape).astype(np.float32)


_libraries: dict[tuple, ctypes.CDLL] = {}


@pytest.fixture
def run_kernel(tmp_path_factory):
    def run(kernel: depthwise.DepthwiseKernel, x, w, y, bias=None, z=None, relu=False):
        source = kernel.source()
        lib = _libraries.get(source.name)
        if lib is None:
            lib = _libraries[source.name] = host_library(tmp_path_factory.mktemp("dw"), source.code, source.name)
        s = kernel.shape
        oh, ow = y.shape[2:]
        strips = -(-ow // kernel.r)
        el = lambda a: [ctypes.c_longlong(v // a.itemsize) for v in a.strides]  # noqa: E731
        ptr = lambda a: None if a is None else ctypes.c_void_p(a.ctypes.data)  # noqa: E731
        u, i = ctypes.c_uint, ctypes.c_int
        ws = el(w)
        lib.depthwise_conv(ptr(x), ptr(w), ptr(bias), ptr(z), ptr(y), u(y.shape[0] * y.shape[1] * oh * strips), u(s.c), u(oh), u(strips),
                           i(s.spatial[0]), i(s.spatial[1]), i(ow), i(s.pads[0]), i(s.pads[1]), *el(x), ws[0], ws[2], ws[3], *el(y),
                           *(el(z) if z is not None else [ctypes.c_longlong(0)] * 4), i(int(relu)))
        return y

    return run


GEOMETRIES = {
    "3x3": _shape(),
    "3x3-stride2": _shape(hw=(10, 13), strides=(2, 2)),
    "5x5-stride2-odd": _shape(c=5, hw=(15, 15), ker=(5, 5), pads=(2, 2), strides=(2, 2)),
    "7x7-convnext": _shape(c=8, hw=(14, 14), ker=(7, 7), pads=(3, 3)),
    "dilated": _shape(hw=(12, 12), pads=(2, 2), dil=(2, 2)),
    "not-square": _shape(hw=(8, 17), ker=(1, 5), pads=(0, 2), strides=(1, 3)),
    "narrow-rows": _shape(hw=(7, 3), ker=(3, 3), pads=(1, 1)),  # OW 3: strips of 2, the last one half used
    "one-column": _shape(hw=(6, 1), ker=(3, 1), pads=(1, 0)),  # a 1-D conv mapped to 2-D
    "no-padding": _shape(c=3, hw=(9, 9), ker=(3, 3), pads=(0, 0)),
}


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_kernel_matches_a_float64_convolution(run_kernel, name, channels_last):
    shape = GEOMETRIES[name]
    rng = np.random.default_rng(3)
    x = _stored(shape.x_shape, channels_last, rng)
    w = rng.standard_normal(shape.w_shape).astype(np.float32)
    y = _stored(shape.y_shape, channels_last, rng)
    for algo in depthwise.candidates(shape):
        kernel = depthwise.DepthwiseKernel.of(algo, shape, "nhwc" if channels_last else "nchw")
        for weight in (w, kernel.weight(np, w)):  # any strides; the form the executor passes
            y[...] = np.nan  # every output must be written
            run_kernel(kernel, x, weight, y)
            np.testing.assert_allclose(y, _reference(x, w, shape), rtol=1e-5, atol=1e-5, err_msg=algo)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_weight_is_tap_major_for_the_channels_last_order(channels_last):
    """Channels-last threads are neighbouring channels: their weights are read from a tap-major
    copy (channel stride 1), the same values; channels-first threads share a channel: as given."""
    shape = GEOMETRIES["7x7-convnext"]
    w = np.random.default_rng(6).standard_normal(shape.w_shape).astype(np.float32)
    got = depthwise.DepthwiseKernel(shape, channels_last).weight(np, w)
    np.testing.assert_array_equal(got, w)
    if channels_last:
        assert got.strides == tuple(v * 4 for v in (1, 49 * shape.c, 7 * shape.c, shape.c))
    else:
        assert got is w


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("residual,relu", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["bias", "bias+relu", "bias+add", "bias+add+relu"])
def test_epilogue_runs_in_the_kernel(run_kernel, residual, relu, channels_last):
    shape = GEOMETRIES["5x5-stride2-odd"]
    rng = np.random.default_rng(4)
    x = _stored(shape.x_shape, channels_last, rng)
    w = rng.standard_normal(shape.w_shape).astype(np.float32)
    bias = rng.standard_normal(shape.c).astype(np.float32)
    z = _stored(shape.y_shape, not channels_last, rng) if residual else None  # the residual in the other order
    y = _stored(shape.y_shape, channels_last, rng)
    run_kernel(depthwise.DepthwiseKernel(shape, channels_last, 2), x, w, y, bias=bias, z=z, relu=relu)
    expected = _reference(x, w, shape, bias, None if z is None else z.astype(np.float64), relu)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    if relu:
        assert (y >= 0).all()


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_reads_and_writes_slices_of_concat_buffers(run_kernel, channels_last):
    """Input and output are channel slices of larger buffers (DenseNet / Inception placements):
    only the slice is written."""
    shape = GEOMETRIES["3x3-stride2"]
    rng = np.random.default_rng(5)
    big_x = _stored((shape.n, shape.c + 4, *shape.spatial), channels_last, rng)
    big_y = _stored((shape.n, shape.c + 3, *shape.output_spatial), channels_last, rng)
    before = big_y.copy()
    x, y = big_x[:, 2:2 + shape.c], big_y[:, 1:1 + shape.c]
    w = rng.standard_normal(shape.w_shape).astype(np.float32)
    run_kernel(depthwise.DepthwiseKernel(shape, channels_last), x, w, y)
    np.testing.assert_allclose(y, _reference(x, w, shape), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(big_y[:, :1], before[:, :1])
    np.testing.assert_array_equal(big_y[:, 1 + shape.c:], before[:, 1 + shape.c:])


def test_nan_propagates_through_the_relu(run_kernel):
    shape = GEOMETRIES["3x3"]
    x = np.ones(shape.x_shape, np.float32)
    x[0, 0, 4, 4] = np.nan
    y = np.zeros(shape.y_shape, np.float32)
    run_kernel(depthwise.DepthwiseKernel(shape, False), x, np.ones(shape.w_shape, np.float32), y, relu=True)
    assert np.isnan(y[0, 0, 3:6, 3:6]).all() and not np.isnan(y[0, 1]).any()


@pytest.mark.parametrize("shape,why", [
    (ConvShape("fwd", 1, 8, 8, (9, 9), (3, 3), (1, 1), (1, 1), (1, 1), groups=1), "depthwise"),
    (ConvShape("fwd", 1, 8, 16, (9, 9), (3, 3), (1, 1), (1, 1), (1, 1), groups=8), "depthwise"),
    (ConvShape("dgrad", 1, 8, 8, (9, 9), (3, 3), (1, 1), (1, 1), (1, 1), groups=8), "forward"),
    (ConvShape("fwd", 1, 8, 8, (4, 9, 9), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), groups=8), "2-D"),
    (ConvShape("fwd", 1, 8, 8, (9, 9), (3, 3), (1, 1), (1, 1), (1, 1), groups=8, dtype="bfloat16"), "bfloat16"),
    (ConvShape("fwd", 1, 8, 8, (40, 40), (13, 13), (6, 6), (1, 1), (1, 1), groups=8), "taps"),
    (ConvShape("fwd", 1, 8, 8, (99, 99), (3, 3), (24, 24), (1, 1), (24, 24), groups=8), "row window"),
])
def test_says_why_it_cannot_compute_a_problem(shape, why):
    reason = depthwise.unsupported(shape, 4)
    assert reason is not None and why in reason
    with pytest.raises(ValueError, match=depthwise.ALGO):
        depthwise.DepthwiseKernel(shape, False)
    assert depthwise.candidates(shape) == ()


def test_candidates_by_stride_and_width():
    assert depthwise.candidates(GEOMETRIES["3x3"]) == ("convpass_depthwise_r4", "convpass_depthwise_r8")
    assert depthwise.candidates(GEOMETRIES["3x3-stride2"]) == ("convpass_depthwise_r2", "convpass_depthwise_r4")
    assert depthwise.candidates(_shape(hw=(7, 7))) == ("convpass_depthwise_r4", "convpass_depthwise_r8")
    assert depthwise.candidates(_shape(hw=(7, 3))) == ("convpass_depthwise_r4",)  # 3 wide: a strip of 8 would be mostly idle
    assert depthwise.candidates(GEOMETRIES["one-column"]) == ("convpass_depthwise_r1",)
    assert depthwise.strip_of("convpass_depthwise_r8+bias+relu") == 8
    for bad in ("convpass_depthwise", "convpass_depthwise_r0", "implicit_gemm", "convpass_depthwise_rx"):
        with pytest.raises(ValueError, match="not a convpass depthwise kernel"):
            depthwise.strip_of(bad)


def test_one_source_per_geometry_and_order():
    a = depthwise.DepthwiseKernel(GEOMETRIES["3x3"], False).source()
    b = depthwise.DepthwiseKernel(GEOMETRIES["3x3"], True).source()
    c = depthwise.DepthwiseKernel(_shape(c=64, hw=(9, 11), n=8), False).source()  # other sizes, same geometry
    r8 = depthwise.DepthwiseKernel(GEOMETRIES["3x3"], False, 8).source()
    half = depthwise.DepthwiseKernel(_shape(dtype="float16"), False).source()
    assert a.name != b.name and a.code != b.code and r8.name != a.name
    assert (a.name, a.code) == (c.name, c.code)
    assert "__half" in half.code and half.name.endswith("float16")
    own = lambda text: Algo.parse(text).is_own  # noqa: E731
    assert own(depthwise.algo_name(4)) and own(depthwise.algo_name(8) + "+bias+relu")
    assert not own("implicit_gemm") and not own("engine:eng5")


# ---------------------------------------------------------------------------------------------
# the kernel as a tuning candidate: rows, completeness, selection, the tuned model, the executor

DW = _shape(c=8, hw=(12, 12))
DW_KEY = DW.key("nhwc", "default")
R4, R8 = depthwise.candidates(DW)
OPTIONS = TuneOptions(tf32="on", layout="nhwc", engines="legacy")


def _row(algo, time_ms, method="measure", status="ok", key=DW_KEY, hr=None, note=""):
    return Measurement(key, algo, status, time_ms, 0, True, 1.0, method, note=note, heuristic_rank=hr)


def _cudnn_rows(key=DW_KEY):
    return [_row(a, 0.05 + 0.01 * i, key=key) for i, a in enumerate(algo_names("fwd"))] + [_row("implicit_gemm", None, "heuristic", key=key, hr=0)]


def test_own_kernels_are_timed_by_the_measure_strategy_for_depthwise_problems():
    problem = ConvProblem((DW,), "")
    assert tuner.own_space(problem, OPTIONS)
    assert not tuner.own_space(problem, OPTIONS, legacy=False)  # --engines graph: the legacy space is off
    for strategy in ("heuristic", "exhaustive"):
        assert not tuner.own_space(problem, TuneOptions(tf32="on", layout="nhwc", engines="legacy", fprop_algo=None, mode=strategy))
    dense = ConvProblem((ConvShape("fwd", 2, 8, 8, (12, 12), (3, 3), (1, 1), (1, 1), (1, 1)),), "")
    assert not tuner.own_space(dense, OPTIONS)


def test_a_cache_without_own_rows_is_incomplete_and_gets_only_them_measured(monkeypatch):
    from convpass.tuning import harness

    problem = ConvProblem((DW,), "bias+relu")
    have = _cudnn_rows() + [_row("bias+relu", 0.01, EPILOGUE_METHOD), _row("implicit_gemm+bias+relu", 0.07), _row("gemm+bias+relu", 0.08)]
    assert not tuner.problem_complete(have, problem, OPTIONS)
    seen = []
    monkeypatch.setattr(harness, "warm_clocks", lambda: None)
    monkeypatch.setattr(tuner, "_measure", lambda problem, options, keys, strategy, forced, legacy, engines, best, fusion, have=(), **own:
                        seen.append((legacy, fusion, own)) or [])
    tuner.measure_problem(problem, OPTIONS, have)
    assert seen == [(False, "", {"own": True, "own_fusion": "bias+relu", "pruner": None, "engine_fusion": ""})]
    with_own = have + [_row(R4, 0.02), _row(R8, 0.015)]
    assert not tuner.own_complete(with_own, [DW_KEY], "bias+relu")  # the fastest one's fused row is missing
    assert tuner.own_complete(with_own, [DW_KEY], "")
    assert tuner.problem_complete(with_own + [_row(R8 + "+bias+relu", 0.016)], problem, OPTIONS)
    failed = have + [_row(R4, None, status="unsupported"), _row(R8, None, status="unsupported")]
    assert tuner.own_complete(failed, [DW_KEY], "bias+relu")  # none ran: no fused row to time
    # every own kernel stopped early (slower than cuDNN's best): measure_own times no fused row, so
    # none is missing (a cached re-run measured such a problem again: GPU test_tuner, flaky)
    stopped = have + [_row(R4, 0.2, note="early stop: estimate over 1.5x"), _row(R8, 0.3, note="early stop: estimate over 1.5x")]
    assert tuner.own_complete(stopped, [DW_KEY], "bias+relu")


@pytest.fixture
def own_bench(monkeypatch):
    from convpass.tuning import harness

    timings: list[float] = []
    calls: list[tuple] = []

    def time_launches(launch, sets, best_ms=None, **_):
        launch(0)
        ms = timings.pop(0)
        return harness.Timing(ms, 10, 0.0, early_stop=best_ms is not None and ms > 4 * best_ms)

    def run(self, cp, x, w, y, bias=None, z=None, relu=False):
        calls.append((self.r, bias is not None, z is not None, relu))
        v = x.sum() + (0 if bias is None else bias.reshape(1, -1, 1, 1)) + (0 if z is None else z)
        y[...] = (np.maximum(v, 0) if relu else v) + (1e3 if self.r == 4 and bias is not None else 0.0)  # r4 fused: wrong

    monkeypatch.setattr(harness, "time_launches", time_launches)
    monkeypatch.setattr(depthwise.DepthwiseKernel, "build", lambda self, cp: None)
    monkeypatch.setattr(depthwise.DepthwiseKernel, "__call__", run)
    bench = numpy_candidates(monkeypatch, DW, maximum=np.maximum, ascontiguousarray=np.ascontiguousarray)
    bench.timings, bench.calls = timings, calls
    return bench


def test_the_tuner_times_every_variant_then_the_fastest_with_the_epilogue(own_bench):
    own_bench.timings[:] = [0.020, 0.012, 0.013]  # r4, r8, r8 with bias+add+relu
    rows = own_bench.measure_own(DW_KEY, "bias+add+relu", 0.050)
    assert [(r.algo, r.status, r.time_ms) for r in rows] == [(R4, "ok", 0.020), (R8, "ok", 0.012), (R8 + "+bias+add+relu", "ok", 0.013)]
    assert own_bench.calls[-1] == (8, True, True, True) and "own kernel, bias+add+relu in it" in rows[-1].note
    assert not own_bench.timings


def test_a_wrong_result_is_recorded_and_cached_variants_are_not_timed_again(own_bench):
    own_bench.timings[:] = [0.011]  # only r8 runs: r4 is in the cache
    rows = own_bench.measure_own(DW_KEY, "bias", None, have=[_row(R4, 0.010)])
    assert [(r.algo, r.status) for r in rows] == [(R8, "ok"), (R4 + "+bias", "wrong_result")]
    assert rows[-1].note.startswith("relative error")


def test_a_variant_that_does_not_build_is_an_error_row_and_tuning_goes_on(own_bench, monkeypatch):
    monkeypatch.setattr(depthwise.DepthwiseKernel, "build", lambda self, cp: (_ for _ in ()).throw(RuntimeError("nvrtc: error")))
    rows = own_bench.measure_own(DW_KEY, "", None)
    assert [(r.algo, r.status, r.note) for r in rows] == [(R4, "error", "the kernel did not build: nvrtc: error"),
                                                          (R8, "error", "the kernel did not build: nvrtc: error")]


def test_a_variant_the_kernel_refuses_is_unsupported(own_bench, monkeypatch):
    def refuse(algo, shape, layout):
        raise ValueError(f"{algo} cannot compute {shape}: a row window of 60 inputs")

    monkeypatch.setattr(depthwise.DepthwiseKernel, "of", staticmethod(refuse))
    rows = own_bench.measure_own(DW_KEY, "", None)
    assert [(r.algo, r.status) for r in rows] == [(R4, "unsupported"), (R8, "unsupported")]
    assert "row window" in rows[0].note and not own_bench.calls


def test_selection_and_the_recorded_decision(tmp_path):
    problem = ConvProblem((DW,), "bias+relu")
    rows = _cudnn_rows() + [_row("bias+relu", 0.004, EPILOGUE_METHOD), _row(R4, 0.010), _row(R8, 0.008), _row(R8 + "+bias+relu", 0.009)]
    chosen = select(rows, problem, OPTIONS)
    assert chosen.algo == R8 + "+bias+relu"  # 0.009 < 0.008 + 0.004
    assert legacy_fallback(rows, DW_KEY) == "implicit_gemm"  # an engine's fallback stays a cuDNN algorithm
    # the pipeline records it: algo = the variant, fusion = the epilogue in it
    h200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)
    cache = TuningCache(tmp_path / "c.db")
    cache.put(h200, rows)
    cache.close()
    tuned = convpass.optimize(_dw_model(), cache=tmp_path / "c.db", device_name=str(h200), quiet=True, tf32="on", layout="nhwc", engines="legacy")
    onnx.checker.check_model(tuned, full_check=True)
    (record,) = convpass.inspect(tuned)
    assert (record["algo"], record["fusion"], record["memory_format"]) == (R8, "bias+relu", "NHWC")
    assert record["time_ms"] == pytest.approx(0.009)


def _dw_model():
    w = numpy_helper.from_array(np.ones((8, 1, 3, 3), np.float32), "w")
    b = numpy_helper.from_array(np.ones(8, np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="dw", group=8, pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y"], ["out"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(DW.x_shape))],
                              [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, list(DW.y_shape))], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


class _Rt:
    def __init__(self):
        self.cp, self.warned = None, []
        self.recorded_device, self.current_device = "", None

    def warn_node(self, node, message):
        self.warned.append(message)

    def note_once(self, tag, message):
        self.warned.append(message)


@pytest.mark.parametrize("algo,usable", [(R8, True), ("convpass_depthwise_r99", False), ("convpass_depthwise_rx", False)])
def test_the_executor_builds_a_recorded_kernel_or_says_why_not(monkeypatch, algo, usable):
    from convpass.kernels.convolution import Convolutions
    from convpass.ops.conv import ConvCall

    monkeypatch.setattr(depthwise.DepthwiseKernel, "build", lambda self, cp: None)
    geometry = types.SimpleNamespace(op_type="Conv", spatial_rank=2)
    decision = annotation.ConvDecision(algo=algo, fusion="bias+relu", problem_key=str(DW_KEY))
    ex, why = Convolutions(_Rt()).resolver._own_exec(ConvCall("dw", geometry, decision), decision, DW_KEY, "")
    if usable:
        assert why == "" and ex.kernel.r == 8 and ex.kernel.channels_last and ex.fused_call == "bias+relu" and ex.descs is None
    else:
        assert ex is None and f"recorded kernel {algo!r} (nhwc) is not usable here" in why


def test_a_variant_right_on_its_first_launch_and_wrong_after_the_timing_is_a_wrong_result(own_bench, monkeypatch):
    """The check runs again on what the timing's launches left in set 0's output: a configuration
    right once and wrong on later launches (the executor replays it) is no candidate."""
    launches = {"n": 0}
    right = depthwise.DepthwiseKernel.__call__

    def drifting(self, cp, x, w, y, bias=None, z=None, relu=False):
        right(self, cp, x, w, y, bias, z, relu)
        launches["n"] += 1
        if self.r == 8 and launches["n"] > 1:
            y += 1e3  # from the second launch on

    monkeypatch.setattr(depthwise.DepthwiseKernel, "__call__", drifting)
    own_bench.timings[:] = [0.011]  # only r8 runs: r4 is in the cache
    rows = own_bench.measure_own(DW_KEY, "", None, have=[_row(R4, 0.010)])
    assert [(r.algo, r.status) for r in rows][:1] == [(R8, "wrong_result")]
    assert "after its first launch" in rows[0].note and "more" in rows[0].note

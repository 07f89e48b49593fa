"""A graph-API engine writing its output into a channel slice of a Concat buffer (an ESRGAN dense
block's convs, their LeakyRelu fused, each write their slice of one buffer) on the CPU: the
compiler's problems name the slice once the activation is fused; the plan of a key that names it
(``yslice``) is built writing ``y`` with the slice's strides, or a packed ``y`` where cuDNN does not
build it so, and refuses a ``y`` of other strides (``OutputRefused``), with the frontend stood in
for; the executor passing the slice itself (``slice_writes``), writing a buffer of the plan's
strides and copying otherwise, learning a refusal once; the tuner's rows (written in place, copied
where cuDNN refuses the slice, wrong where a configuration ignores the strides) and cached rows
timed before plans wrote slices timed again, with cuDNN stood in for by NumPy."""

from __future__ import annotations

import json
import logging
import types

import numpy as np
import onnx_ir as ir
import pytest
from conftest import _FakeTensor, fake_cuda, offer_configs, plans_stood_in
from test_conv_slice_problems import C as DENSE_C
from test_conv_slice_problems import G, _dense_block
from test_input_slices import _refusing_strided_x, engines_timed_again
from test_residual_slices import _ptr, engine_convs  # noqa: F401  (its plans: this module's)
from test_slice_reads import LAYOUTS, TOTAL, C, K, _buffer, _geometry, _weight, stand_in  # noqa: F401
from test_slice_tuning import bench_stand_in  # noqa: F401

from convpass.compiler.pipeline import OptimizeReport, prepare_model
from convpass.core import annotation
from convpass.core.cudnn_enums import algo_names
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem, InputSlice, OutputSlice
from convpass.kernels import conv_exec
from convpass.native.cuda import CaptureBreak, elements
from convpass.native.cudnn import graph_api, graph_strides
from convpass.native.cudnn.descriptors import descriptor_params
from convpass.native.cudnn.graph_api import EngineConfig, OutputRefused
from convpass.ops.conv import ConvCall, conv_reference
from convpass.tuning import shape_bench
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.candidates import Candidates
from convpass.tuning.shape_bench import ShapeBench

SHAPE = _geometry().shapes[0]  # N x C x 5 x 5 -> N x K x 5 x 5, 3x3, pads 1
YS = OutputSlice(5, TOTAL)  # the output: channels 5..5 + K of a TOTAL-channel buffer
XS = InputSlice(3, TOTAL)
L02 = "bias+leakyrelu0.2"


def _packed(key):
    return descriptor_params(key).y.strides


# ---------------------------------------------------------------------------------------------
# the compiler: a dense block's convs with their LeakyRelu fused name the slice they write


def test_a_dense_blocks_fused_convs_name_the_slices_they_write():
    m = ir.serde.deserialize_model(_dense_block())
    problems = prepare_model(m, TuneOptions(engines="all"), [], OptimizeReport())
    got = {uses[0].node.name: (p.fusion, p.x_slice, p.y_slice) for p, uses in problems.items()}
    total = DENSE_C + 2 * G
    assert got == {
        "stem": (L02, None, OutputSlice(0, total)),  # its LeakyRelu fused: the engine writes x0's slice
        "conv1": (L02, InputSlice(0, total), OutputSlice(DENSE_C, total)),
        "conv2": (L02, InputSlice(0, total), OutputSlice(DENSE_C + G, total)),
        "conv3": ("", None, None),  # the graph's output
    }
    legacy = prepare_model(ir.serde.deserialize_model(_dense_block()), TuneOptions(engines="legacy"), [], OptimizeReport())
    assert all(p.y_slice is None for p in legacy)  # no engines: the LeakyRelu's own pass writes the slice, the conv packed


# ---------------------------------------------------------------------------------------------
# the plan (the frontend stood in for)

def _refusing_strided_y(frontend, monkeypatch, key, refused=("eng5",), not_offered=("eng0",)):
    """The stand-in frontend's graphs writing ``y`` with ``key``'s slice strides: ``refused`` not
    built, ``not_offered`` not offered; ``written`` records the strides each graph's y was given."""
    base = frontend.pygraph
    written: list = []
    monkeypatch.setattr(_FakeTensor, "set_stride", lambda self, stride: written.append(tuple(stride)) or self)  # the output's alone

    class Graph(base):
        y = None

        def validate(self):  # right after the output's strides are set
            self.y = written[-1]
            super().validate()

        def strided(self):
            return self.y == key.y_strides

        def create_execution_plans(self, modes):
            super().create_execution_plans(modes)
            self.plans = [n for n in self.plans if not (self.strided() and n in not_offered)]
            if not self.plans:
                raise RuntimeError("cudnnGraphNotSupportedError: no engine")

        def build_plan_at_index(self, i):
            if self.strided() and self.plans[i] in refused:
                raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED: a strided y")
            super().build_plan_at_index(i)

    frontend.pygraph = Graph
    return written


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fusion", ["", L02])
def test_a_plan_of_an_output_slice_key_writes_y_with_the_slices_strides(frontend, monkeypatch, layout, fusion):
    key = SHAPE.key(layout, "default", y_slice=YS)
    written = _refusing_strided_y(frontend, monkeypatch, key, refused=(), not_offered=())
    plan = graph_api.EnginePlan(key, EngineConfig.parse("eng5", fusion))
    assert written[-1] == key.y_strides != _packed(key)
    assert plan.y_strides == key.y_strides and plan.y_refusal == "" and plan.x_strides == descriptor_params(key).x.strides
    x, w = _ptr(_buffer(layout, channels=C), 0), _ptr(np.zeros((2, 4), np.float32), 100)
    bias = _ptr(np.zeros(K, np.float32), 400) if fusion else None
    with pytest.raises(OutputRefused, match="not of the element strides its plan writes"):  # never written with strides it was not built for
        plan.execute(x, w, _ptr(_buffer(layout, channels=K), 200), None, bias=bias)
    plan.execute(x, w, _ptr(_buffer(layout)[:, 5:5 + K], 200), None, bias=bias)
    assert frontend.calls[-1][0] == "execute"
    packed = graph_api.EnginePlan(SHAPE.key(layout, "default"), EngineConfig.parse("eng5", fusion))
    assert packed.y_strides == _packed(key)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_configurations_cuDNN_will_not_give_for_the_slice_write_a_packed_y_saying_why(frontend, monkeypatch, layout):
    key = SHAPE.key(layout, "default", y_slice=YS)
    _refusing_strided_y(frontend, monkeypatch, key)
    enumerated = graph_api.enumerate_configs(key)
    assert enumerated.y_strides == key.y_strides and [e.y_strides for e in enumerated.graphs()] == [key.y_strides, _packed(key)]
    plans = {name: graph_api.EnginePlan(key, EngineConfig.parse(name), enumerated) for name in ("eng67_k2=16_k13=0", "eng5", "eng0")}
    assert plans["eng67_k2=16_k13=0"].y_strides == key.y_strides and plans["eng67_k2=16_k13=0"].y_refusal == ""
    assert plans["eng5"].y_strides == _packed(key) and "a strided y" in plans["eng5"].y_refusal
    assert plans["eng0"].y_strides == _packed(key) and "does not offer eng0" in plans["eng0"].y_refusal
    objects = {name: conv_exec.conv_exec(key, "engine:" + name, "bias", cp=np, plan=plan) for name, plan in plans.items()}
    assert objects["eng67_k2=16_k13=0"].output_slice_strides == key.y_strides and objects["eng67_k2=16_k13=0"].output_refusal == ""
    assert objects["eng5"].output_slice_strides is None and "a strided y" in objects["eng5"].output_refusal


ALL = ("eng5", "eng67_k2=16_k13=0", "eng20001", "eng13_k3=1", "eng0", "eng28_k2=4_k3=0")  # the stand-in's configurations


def test_a_slice_graph_without_any_engine_keeps_cuDNNs_reason_over_the_graphs_tried(frontend, monkeypatch):
    key = SHAPE.key("nhwc", "default", y_slice=YS)
    _refusing_strided_y(frontend, monkeypatch, key, not_offered=ALL)
    enumerated = graph_api.enumerate_configs(key)
    assert enumerated.y_strides == _packed(key) and "cudnnGraphNotSupportedError" in enumerated.y_refusal and enumerated.x_refusal == ""
    plan = graph_api.EnginePlan(key, EngineConfig.parse("eng5"), enumerated)
    assert plan.y_strides == _packed(key) and "no configuration" in plan.y_refusal and enumerated.y_refusal in plan.y_refusal


def test_an_x_refusal_survives_the_graphs_a_key_with_both_slices_tries(frontend):
    key = SHAPE.key("nhwc", "default", XS, YS)
    _refusing_strided_x(frontend, key, not_offered=ALL)  # neither graph reading the input slice has an engine
    enumerated = graph_api.enumerate_configs(key)
    assert (enumerated.x_strides, enumerated.y_strides) == (descriptor_params(key).x.strides, key.y_strides)
    assert "cudnnGraphNotSupportedError" in enumerated.x_refusal and enumerated.y_refusal == ""
    plan = graph_api.EnginePlan(key, EngineConfig.parse("eng5"), enumerated)
    assert plan.y_strides == key.y_strides and plan.y_refusal == "" and enumerated.x_refusal in plan.x_refusal


def test_a_key_with_both_slices_tries_both_then_each_alone_then_neither(frontend, monkeypatch):
    key = SHAPE.key("nhwc", "default", XS, YS)
    px, py = descriptor_params(key).x.strides, _packed(key)
    assert graph_strides.io_choices(key) == ((key.x_strides, key.y_strides), (key.x_strides, py), (px, key.y_strides), (px, py))
    assert graph_strides.io_choices(SHAPE.key("nhwc", "default")) == ((px, py),)
    _refusing_strided_y(frontend, monkeypatch, key)  # eng5: no strided y, a strided x built
    plan = graph_api.EnginePlan(key, EngineConfig.parse("eng5"))
    assert (plan.x_strides, plan.y_strides) == (key.x_strides, py) and plan.x_refusal == "" and "a strided y" in plan.y_refusal
    both = graph_api.EnginePlan(key, EngineConfig.parse("eng67_k2=16_k13=0"))
    assert (both.x_strides, both.y_strides) == (key.x_strides, key.y_strides)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("which", ["x", "y"])
def test_a_stored_plan_keeps_the_strides_it_reads_x_and_writes_y_with(frontend, layout, which):
    key = SHAPE.key(layout, "default", XS) if which == "x" else SHAPE.key(layout, "default", y_slice=YS)
    config, field = EngineConfig.parse("eng5"), f"{which}_strides"
    sliced, packed = getattr(key, field), getattr(descriptor_params(key), which).strides
    data = graph_api.EnginePlan(key, config).serialize(verify=False)
    head, _, blob = data.partition(b"\n")
    header = json.loads(head)
    assert header[field] == list(sliced) and getattr(graph_api.EnginePlan.load(key, config, data), field) == sliced
    assert header["format"] == graph_api.PLAN_FORMAT_SLICE != graph_api.PLAN_FORMAT  # a reader of packed plans only refuses it

    def stored(**change):
        doc = {k: v for k, v in header.items() if k != field} | change
        return json.dumps(doc).encode() + b"\n" + blob

    with pytest.raises(graph_api.GraphApiError, match="does not fit the element strides"):
        graph_api.EnginePlan.load(key, config, stored())  # a slice plan's format, packed strides
    with pytest.raises(graph_api.GraphApiError, match="does not fit the element strides"):
        graph_api.EnginePlan.load(key, config, stored(format=graph_api.PLAN_FORMAT, **{field: list(sliced)}))
    old = stored(format=graph_api.PLAN_FORMAT)  # stored before plans took slices: packed
    assert getattr(graph_api.EnginePlan.load(key, config, old), field) == packed
    with pytest.raises(graph_api.GraphApiError, match="neither packed nor the key's slices'"):
        graph_api.EnginePlan.load(key, config, stored(**{field: [1, 2, 3, 4]}))


def test_a_plan_is_stored_in_the_first_format_only_where_it_reads_and_writes_packed(frontend, monkeypatch):
    both, alone = SHAPE.key("nhwc", "default", XS, YS), SHAPE.key("nhwc", "default", y_slice=YS)
    _refusing_strided_y(frontend, monkeypatch, both)  # eng5: no strided y, a strided x built
    config = EngineConfig.parse("eng5")
    for key, want in ((both, graph_api.PLAN_FORMAT_SLICE), (alone, graph_api.PLAN_FORMAT)):
        plan = graph_api.EnginePlan(key, config)
        assert plan.y_strides == _packed(key) and (plan.x_strides == key.x_strides) == (key is both)
        data = plan.serialize(verify=False)
        assert json.loads(data.partition(b"\n")[0])["format"] == want
        loaded = graph_api.EnginePlan.load(key, config, data)
        assert (loaded.x_strides, loaded.y_strides) == (plan.x_strides, plan.y_strides)


def test_a_misaligned_output_slice_is_refused_as_the_output_alone():
    from convpass.core.algo import Algo

    key = SHAPE.key("nhwc", "default", y_slice=YS)
    ran = []
    plan = types.SimpleNamespace(config=types.SimpleNamespace(algo="engine:eng5"), workspace_bytes=0, y_strides=key.y_strides,
                                 execute=lambda *a, **k: ran.append(a))
    conv = conv_exec.EngineConv(key, Algo.parse("engine:eng5"), "", types.SimpleNamespace(cuda=fake_cuda([])), plan)
    assert conv.output_slice_strides == key.y_strides
    device = lambda p: types.SimpleNamespace(data=types.SimpleNamespace(ptr=p))  # noqa: E731
    with pytest.raises(OutputRefused, match="y not 16-byte aligned"):  # a launch into an aligned buffer, then a copy, may run
        conv._launch(device(16), device(256), device(520), None, None, None)
    with pytest.raises(graph_api.InputRefused, match="x, y not"):  # x first: its copy, then y's refusal
        conv._launch(device(12), device(256), device(520), None, None, None)
    with pytest.raises(graph_api.GraphApiError) as refused:  # the weights: no copy helps
        conv._launch(device(16), device(252), device(520), None, None, None)
    assert type(refused.value) is graph_api.GraphApiError
    conv._launch(device(16), device(256), device(512), None, None, None)
    assert len(ran) == 1


# ---------------------------------------------------------------------------------------------
# the executor (cuDNN stood in for)

class _YPlan:
    """A graph-API plan stood in for: ``conv(x, w)`` by the reference conv (with ``bias`` and a
    fused graph's activation where it has one), built writing ``y`` with the key's output slice
    strides (engine 2: cuDNN refusing them, a packed ``y``); a ``y`` of other strides refused as
    the real plan refuses it; engine 3 ignores the strides (writes the buffer as if packed from
    the slice's start); ``refusals``: launches with ``y`` refused first (as a misaligned start is)."""

    seen: list = []
    refusals = 0

    def __init__(self, key, config, enumerated=None):
        self.key, self.config, self.workspace_bytes = key, config, 0
        *sliced, packed = graph_strides.io_choices(key)
        self.x_strides, self.y_strides = packed if config.engine_id == 2 or not sliced else sliced[0]
        self.y_refusal = "cuDNN does not build eng2 for a strided y" if config.engine_id == 2 and sliced else ""

    def execute(self, x, w, y, workspace=None, bias=None, z=None):
        _YPlan.seen.append(y)
        if self.key.y_slice is not None and not graph_api._has_strides(y, self.y_strides):
            raise OutputRefused(f"{self.config.algo}: the output y is not of the element strides its plan writes")
        if _YPlan.refusals:
            _YPlan.refusals -= 1
            raise OutputRefused(f"{self.config.algo}: y not 16-byte aligned, as its plan assumes")
        v = conv_reference(np, np.ascontiguousarray(x), np.ascontiguousarray(w), None, _geometry())
        if bias is not None:
            v = graph_api.fusion_of(self.config.fusion).reference(np, v + bias.reshape(1, -1, 1, 1))
        if self.config.engine_id == 3:  # ignores the strides: writes past the slice's channels
            y = np.lib.stride_tricks.as_strided(y, y.shape, [s * 4 for s in _packed(self.key)])
        y[...] = v


@pytest.fixture
def plans(monkeypatch):
    return plans_stood_in(monkeypatch, _YPlan)


def _engine_call(layout: str, engine: str = "eng1", fusion: str = "", y_slice=YS) -> ConvCall:
    key = SHAPE.key(layout, "default", y_slice=y_slice)
    d = annotation.ConvDecision(algo="implicit_gemm", engine=engine, fusion=fusion, memory_format=layout.upper(), math_mode="default",
                                problem_key=str(key))
    return ConvCall("c1", _geometry(), d)


def _leaky(v):
    return np.where(v > 0, v, v * np.float32(0.2))


def _inputs(layout: str, fusion: str = "", channels: int = TOTAL):
    """x, w, b, the output slice (channels 5..5 + K of a NaN buffer of ``channels``; ``K``: packed) and what it should hold."""
    x = _buffer(layout, channels=C, seed=2)
    b = np.linspace(-1, 1, K).astype(np.float32)
    pre = conv_reference(np, x, _weight(), None, _geometry()) + b.reshape(1, -1, 1, 1)
    buf = _buffer(layout, channels=channels)
    buf[...] = np.nan
    out = buf[:, 5:5 + K] if channels > K else buf
    return x, _weight(), b, out, (_leaky(pre) if fusion else np.maximum(pre, 0))


def _run(convs, call, x, w, b, out):
    fusion = call.decision.fusion
    if fusion:
        return convs.run(call, x, w, b, out=out, fusion=fusion, fused=True)
    return convs.run(call, x, w, b, relu=True, out=out)


def _rest_is_nan(out) -> bool:
    """Whether every channel of ``out``'s buffer outside ``out`` is still NaN."""
    wide = out.base if out.base is not None else out
    wide = wide if wide.shape[1] == TOTAL else wide.transpose(0, 3, 1, 2)
    return bool(np.isnan(np.concatenate([wide[:, :5], wide[:, 5 + K:]], axis=1)).all())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fusion", ["", L02], ids=["bare, then its pass", "fused bias+leakyrelu"])
def test_an_engine_timed_writing_the_slice_writes_it_without_a_copy(engine_convs, plans, layout, fusion):
    convs = engine_convs(layout)
    x, w, b, out, want = _inputs(layout, fusion)
    call = _engine_call(layout, fusion=fusion)
    for _ in range(2):
        assert _run(convs, call, x, w, b, out) is out
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert [seen is out for seen in plans.seen] == [True, True] and _rest_is_nan(out)  # the slice itself, every run
    counters = convs.rt.counters
    assert (counters["slice_writes"], counters["slice_write_copies"]) == (2, 0) and convs.rt.notes == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_output_not_of_the_plans_strides_is_written_into_them_and_copied(engine_convs, plans, layout):
    convs = engine_convs(layout)
    x, w, b, out, want = _inputs(layout, L02, channels=TOTAL + 6)
    call = _engine_call(layout, fusion=L02)
    _run(convs, call, x, w, b, out)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    [seen] = plans.seen
    assert seen is not out and elements(seen.strides, 4) == SHAPE.key(layout, "default", y_slice=YS).y_strides  # the plan's strides
    assert (convs.rt.counters["slice_writes"], convs.rt.counters["slice_write_copies"]) == (0, 1)
    assert [tag for tag, _, _ in convs.rt.notes] == ["unpriced-write-copy:c1", "unpriced-write-copy"]  # a copy no tuning timed, said
    assert "writes only slices of its key's strides" in convs.rt.notes[0][1]
    packed = _run(convs, call, x, w, b, None)  # wanted packed: the plan's buffer copied into one
    np.testing.assert_allclose(packed, want, rtol=1e-5, atol=1e-5)
    assert graph_api._has_strides(packed, _packed(SHAPE.key(layout, "default"))) and convs.rt.counters["layout_copies"] == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plan_built_for_the_slice_whose_output_is_wanted_packed_says_its_untimed_copy(engine_convs, plans, layout):
    """A decision tuned writing its Concat slice, run where the plan stores its output packed (a bare
    engine whose activation runs as the plan's own step): the copy out of the slice-strided buffer
    is one its tuning did not time, said as the other unpriced copies are."""
    convs = engine_convs(layout)
    x, w, b, _, want = _inputs(layout, L02, channels=TOTAL + 6)
    packed = _run(convs, _engine_call(layout, fusion=L02), x, w, b, None)
    np.testing.assert_allclose(packed, want, rtol=1e-5, atol=1e-5)
    assert convs.rt.counters["layout_copies"] == 1
    assert [tag for tag, _, _ in convs.rt.notes] == ["unpriced-write-copy:c1", "unpriced-write-copy"]
    assert "writes its Concat slice's strides only" in convs.rt.notes[0][1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plan_cuDNN_built_for_a_packed_y_writes_it_and_the_copy_as_timed(engine_convs, plans, layout):
    convs = engine_convs(layout)
    x, w, b, out, want = _inputs(layout, L02)
    _run(convs, _engine_call(layout, engine="eng2", fusion=L02), x, w, b, out)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    [seen] = plans.seen
    assert graph_api._has_strides(seen, _packed(SHAPE.key(layout, "default"))) and _rest_is_nan(out)
    assert (convs.rt.counters["slice_writes"], convs.rt.counters["slice_write_copies"]) == (0, 1) and convs.rt.notes == []  # timed so


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_refused_output_slice_is_learned_once_and_copied_from_then_on(engine_convs, plans, layout, caplog):
    convs = engine_convs(layout)
    x, w, b, out, want = _inputs(layout, L02)
    plans.refusals = 1
    call = _engine_call(layout, fusion=L02)
    with caplog.at_level(logging.DEBUG, logger="convpass"):
        for _ in range(2):
            _run(convs, call, x, w, b, out)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert [seen is out for seen in plans.seen] == [True, False, False]  # tried once in place, then a buffer of its strides every run
    assert all(elements(seen.strides, 4) == SHAPE.key(layout, "default", y_slice=YS).y_strides for seen in plans.seen)
    assert convs.resolve(call, x.dtype, L02).strided_output_ok is False and _rest_is_nan(out)
    assert (convs.rt.counters["slice_writes"], convs.rt.counters["slice_write_copies"]) == (0, 2)
    said = [r for r in caplog.records if "refuses to write into a Concat slice" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_output_refusal_while_capturing_breaks_the_capture(engine_convs, plans, layout):
    convs = engine_convs(layout)
    x, w, b, out, _ = _inputs(layout, L02)
    plans.refusals = 1
    convs.rt.capturing = True
    call = _engine_call(layout, fusion=L02)
    with pytest.raises(CaptureBreak, match="write into a Concat slice during capture"):
        _run(convs, call, x, w, b, out)
    assert convs.resolve(call, x.dtype, L02).strided_output_ok  # nothing learned: the warm-up run learns


# ---------------------------------------------------------------------------------------------
# the tuner's rows (NumPy stand-ins: the times are the fakes'; what is launched on what is tested)

def _ybench() -> ShapeBench:
    bench = ShapeBench(SHAPE, None, YS)
    bench._reference = conv_reference(np, bench._base["x"], bench._base["w"], None, _geometry())
    return bench


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fusion", ["", L02])
def test_engines_of_an_output_slice_key_are_timed_writing_the_slice_in_place(bench_stand_in, plans, monkeypatch, layout, fusion):
    bench_stand_in(layout)
    bench_stand_in.cp.where, bench_stand_in.cp.cuda = np.where, fake_cuda([])
    offer_configs(monkeypatch, lambda key, fusion="": [EngineConfig(i, (), fusion) for i in (1, 2, 3)])
    key = SHAPE.key(layout, "default", y_slice=YS)
    bench = _ybench()
    rows = Candidates(bench).measure_engines(key, None, fusion)
    tail = "+" + fusion if fusion else ""
    assert [(r.algo, r.status) for r in rows] == [("engine:eng1" + tail, "ok"), ("engine:eng2" + tail, "ok"), ("engine:eng3" + tail, "wrong_result")]
    assert "output written into its slice in place" in rows[0].note
    assert "output copied into its slice after (cuDNN refuses the slice: cuDNN does not build eng2 for a strided y)" in rows[1].note
    sets = bench.rotation(layout)
    assert all(any(y is s["y"] for s in sets) for y in plans.seen[:4])  # eng1: the check and 3 timed launches, each its set's slice itself
    copied = [src for dst, src in bench_stand_in.copied if dst == key.y_strides and src == _packed(key)]
    assert len(copied) - len(sets) == 4  # past the sets' making: eng2's launches, each packed y copied into its set's slice after; eng3 never
    assert not any(shape_bench.superseded(r) for r in rows)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_engine_refusing_the_slice_in_place_is_timed_writing_a_buffer_of_its_strides(bench_stand_in, plans, monkeypatch, layout):
    bench_stand_in(layout)
    bench_stand_in.cp.cuda = fake_cuda([])
    offer_configs(monkeypatch, lambda key, fusion="": [EngineConfig(1)])
    plans.refusals = 1
    key = SHAPE.key(layout, "default", y_slice=YS)
    bench = _ybench()
    [row] = Candidates(bench).measure_engines(key, None)
    assert row.status == "ok" and "output copied into its slice after (cuDNN refuses the slice: engine:eng1: y not 16-byte aligned" in row.note
    assert [elements(y.strides, 4) for y in plans.seen] == [key.y_strides] * 5  # the refused try, then 4 launches into an aligned buffer of them
    sets = bench.rotation(layout)
    assert any(plans.seen[0] is s["y"] for s in sets) and not any(y is s["y"] for y in plans.seen[1:] for s in sets)
    assert len([c for c in bench_stand_in.copied if c == (key.y_strides, key.y_strides)]) == 4  # each copied into its set's slice


# ---------------------------------------------------------------------------------------------
# rows timed before plans wrote output slices are timed again

OLD = "relative error 1.0e-04; 3 launches, spread 1.0%; output copied into its slice after (the object writes packed outputs); graph API, conv then bias pass"
NEW = "output written into its slice in place"


def _rows(key, engine_note):
    rows = [Measurement(key, a, "ok", 0.01 * (i + 1), 0, True, 1.0, "measure", note=NEW) for i, a in enumerate(algo_names("fwd"))]
    rows.append(Measurement(key, "implicit_gemm", "ok", None, 0, True, 1.0, "heuristic", heuristic_rank=0))
    rows += [Measurement(key, "engine:eng1", "ok", 0.005, 0, True, 1.0, "measure", note=engine_note),
             Measurement(key, "engine:eng1+bias+relu", "ok", 0.006, 0, True, 1.0, "measure", note=NEW)]
    return rows


def test_engine_rows_of_an_output_slice_key_timed_with_the_old_copy_are_timed_again(monkeypatch):
    key = SHAPE.key("nhwc", "default", y_slice=YS)
    stale = _rows(key, OLD)
    assert [r.algo for r in stale if shape_bench.superseded(r)] == ["engine:eng1"]
    assert [r.algo for r in shape_bench.current(stale) if "engine" in r.algo] == ["engine:eng1+bias+relu"]  # that graph's rows go
    fresh = _rows(key, OLD.replace("output copied into its slice after (the object writes packed outputs)", NEW))
    assert shape_bench.current(fresh) == fresh
    assert not any(shape_bench.superseded(r) for r in _rows(SHAPE.key("nhwc", "default"), OLD))  # a packed key's never copied
    refused = OLD.replace("the object writes packed outputs", "cuDNN refuses the slice: a strided y")
    assert not any(shape_bench.superseded(r) for r in _rows(key, refused))  # timed with the copy since plans write slices
    engines_timed_again(monkeypatch, ConvProblem((SHAPE,), y_slice=YS), stale, fresh)

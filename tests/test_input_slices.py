"""A graph-API engine reading its input from a channel slice of a Concat buffer (a dense block's
convs read growing prefixes of one buffer) on the CPU: the plan of a key that names the slice
(``xslice``) is built reading ``x`` with the slice's strides, or with a packed ``x`` where cuDNN
does not build it so, and refuses an ``x`` of other strides (``InputRefused``), with the frontend
stood in for; the executor passing the slice itself (``slice_reads``), copying into the plan's
strides otherwise, learning a refusal once; the tuner's rows (read in place, copied where cuDNN
refuses the slice, wrong where a configuration ignores the strides) and cached rows timed before
plans read slices timed again, with cuDNN stood in for by NumPy."""

from __future__ import annotations

import dataclasses
import json
import logging
import types

import numpy as np
import pytest
from conftest import fake_cuda, offer_configs, plans_stood_in
from test_residual_slices import _ptr, engine_convs  # noqa: F401  (its plans: this module's)
from test_slice_reads import LAYOUTS, TOTAL, C, K, _buffer, _convs, _geometry, _weight, stand_in  # noqa: F401
from test_slice_tuning import bench_stand_in  # noqa: F401

from convpass.core import annotation
from convpass.core.cudnn_enums import algo_names
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem, InputSlice
from convpass.kernels import conv_exec
from convpass.native.cuda import CaptureBreak, elements
from convpass.native.cudnn import graph_api, graph_strides
from convpass.native.cudnn.descriptors import descriptor_params
from convpass.native.cudnn.graph_api import EngineConfig, InputRefused
from convpass.ops.conv import ConvCall, conv_reference
from convpass.tuning import harness, shape_bench, tuner
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.candidates import Candidates
from convpass.tuning.shape_bench import ShapeBench

SHAPE = _geometry().shapes[0]  # N x C x 5 x 5 -> N x K x 5 x 5, 3x3, pads 1
XS = InputSlice(3, TOTAL)  # the input: channels 3..3 + C of a TOTAL-channel buffer


def _packed(key):
    return descriptor_params(key).x.strides


# ---------------------------------------------------------------------------------------------
# the plan (the frontend stood in for)

def _refusing_strided_x(frontend, key, refused=("eng5",), not_offered=("eng0",)):
    """The stand-in frontend's graphs reading ``x`` with ``key``'s slice strides: ``refused`` not
    built, ``not_offered`` not offered (as cuDNN refuses a stride an engine does not take)."""
    base = frontend.pygraph

    class Graph(base):
        strided = False

        def tensor(self, name, dim, stride, data_type):
            if name == "x":
                self.strided = tuple(stride) == key.x_strides
            return super().tensor(name, dim, stride, data_type)

        def create_execution_plans(self, modes):
            super().create_execution_plans(modes)
            self.plans = [n for n in self.plans if not (self.strided and n in not_offered)]
            if not self.plans:
                raise RuntimeError("cudnnGraphNotSupportedError: no engine")

        def build_plan_at_index(self, i):
            if self.strided and self.plans[i] in refused:
                raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED: a strided x")
            super().build_plan_at_index(i)

    frontend.pygraph = Graph


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fusion", ["", "bias+relu"])
def test_a_plan_of_an_input_slice_key_reads_x_with_the_slices_strides(frontend, layout, fusion):
    key = SHAPE.key(layout, "default", XS)
    plan = graph_api.EnginePlan(key, EngineConfig.parse("eng5", fusion))
    assert ("tensor", "x", tuple(descriptor_params(key).x.dims), key.x_strides) in frontend.calls
    assert plan.x_strides == key.x_strides != _packed(key) and plan.x_refusal == ""
    w, y = _ptr(np.zeros((2, 4), np.float32), 100), _ptr(np.zeros((2, 4), np.float32), 200)
    bias = _ptr(np.zeros(K, np.float32), 400) if fusion else None
    with pytest.raises(InputRefused, match="not of the element strides its plan reads"):  # never read with strides it was not built for
        plan.execute(_ptr(_buffer(layout, channels=C), 0), w, y, None, bias=bias)
    plan.execute(_ptr(_buffer(layout)[:, 3:3 + C], 0), w, y, None, bias=bias)
    assert frontend.calls[-1][0] == "execute"
    packed = graph_api.EnginePlan(SHAPE.key(layout, "default"), EngineConfig.parse("eng5", fusion))
    assert packed.x_strides == _packed(key)
    with pytest.raises(InputRefused):  # a packed plan given a slice: refused, never read as if packed
        packed.execute(_ptr(_buffer(layout)[:, 3:3 + C], 0), w, y, None, bias=bias)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_configurations_cuDNN_will_not_give_for_the_slice_read_a_packed_x_saying_why(frontend, layout):
    key = SHAPE.key(layout, "default", XS)
    _refusing_strided_x(frontend, key)
    enumerated = graph_api.enumerate_configs(key)
    assert enumerated.x_strides == key.x_strides and enumerated.packed is not None and enumerated.packed.x_strides == _packed(key)
    assert [c.name for c in enumerated.configs()] == ["eng5", "eng67_k2=16_k13=0", "eng13_k3=1", "eng28_k2=4_k3=0", "eng0"]  # the packed graph's last
    frontend.calls.clear()
    plans = {name: graph_api.EnginePlan(key, EngineConfig.parse(name), enumerated) for name in ("eng67_k2=16_k13=0", "eng5", "eng0")}
    assert not [c for c in frontend.calls if c[0] in ("plans", "conv")]  # built on the tuner's graphs
    assert plans["eng67_k2=16_k13=0"].x_strides == key.x_strides and plans["eng67_k2=16_k13=0"].x_refusal == ""
    assert plans["eng5"].x_strides == _packed(key) and "a strided x" in plans["eng5"].x_refusal
    assert plans["eng0"].x_strides == _packed(key) and "does not offer eng0" in plans["eng0"].x_refusal
    alone = graph_api.EnginePlan(key, EngineConfig.parse("eng5"))  # the executor's: a graph of its own, the slice's first
    assert alone.x_strides == _packed(key) and "a strided x" in alone.x_refusal
    objects = {name: conv_exec.conv_exec(key, "engine:" + name, "bias", cp=np, plan=plan) for name, plan in plans.items()}
    assert objects["eng67_k2=16_k13=0"].input_slice_strides == key.x_strides and objects["eng67_k2=16_k13=0"].input_refusal == ""
    assert objects["eng5"].input_slice_strides is None and "a strided x" in objects["eng5"].input_refusal


def test_a_slice_graph_without_any_engine_leaves_the_packed_graphs(frontend):
    key = SHAPE.key("nhwc", "default", XS)
    _refusing_strided_x(frontend, key, not_offered=("eng5", "eng67_k2=16_k13=0", "eng20001", "eng13_k3=1", "eng0", "eng28_k2=4_k3=0"))
    enumerated = graph_api.enumerate_configs(key)
    assert enumerated.x_strides == _packed(key) and enumerated.packed is None and len(enumerated.configs()) == 5
    plan = graph_api.EnginePlan(key, EngineConfig.parse("eng67_k2=16_k13=0"), enumerated)
    assert plan.x_strides == _packed(key) and "no configuration" in plan.x_refusal
    assert enumerated.x_refusal and enumerated.x_refusal in plan.x_refusal  # cuDNN's own reason, kept
    assert "cudnnGraphNotSupportedError" in plan.x_refusal


# stored plans keep the strides they read x with, in the format saying so: tests/test_output_slices.py (with y's)


def test_a_plan_reading_a_packed_x_keeps_the_first_format(frontend):
    key, config = SHAPE.key("nhwc", "default", XS), EngineConfig.parse("eng5")
    _refusing_strided_x(frontend, key, not_offered=("eng5",))
    plan = graph_api.EnginePlan(key, config)
    assert plan.x_strides == _packed(key)
    data = plan.serialize(verify=False)
    assert json.loads(data.partition(b"\n")[0])["format"] == graph_api.PLAN_FORMAT
    assert graph_api.EnginePlan.load(key, config, data).x_strides == _packed(key)


def test_a_misaligned_input_slice_is_refused_as_the_input_alone():
    from convpass.core.algo import Algo

    key = SHAPE.key("nhwc", "default", XS)
    ran = []
    plan = types.SimpleNamespace(config=types.SimpleNamespace(algo="engine:eng5"), workspace_bytes=0, x_strides=key.x_strides,
                                 execute=lambda *a, **k: ran.append(a))
    conv = conv_exec.EngineConv(key, Algo.parse("engine:eng5"), "", types.SimpleNamespace(cuda=fake_cuda([])), plan)
    assert conv.input_slice_strides == key.x_strides
    device = lambda p: types.SimpleNamespace(data=types.SimpleNamespace(ptr=p))  # noqa: E731
    with pytest.raises(InputRefused, match="x not 16-byte aligned"):  # a copy of x, at an aligned start, may run
        conv._launch(device(12), device(256), device(512), None, None, None)
    conv._launch(device(16), device(256), device(512), None, None, None)
    assert len(ran) == 1


# ---------------------------------------------------------------------------------------------
# the executor (cuDNN stood in for)

class _XPlan:
    """A graph-API plan stood in for: ``conv(x, w)`` by the reference conv (with ``bias`` and a
    fused graph's activation where it has one), built reading ``x`` with the key's input slice
    strides (engine 2: cuDNN refusing them, a packed ``x``); an ``x`` of other strides refused as
    the real plan refuses it; engine 3 ignores the strides (reads the buffer as if packed from the
    slice's start); ``refusals``: launches with ``x`` refused first (as a misaligned start is)."""

    seen: list = []
    refusals = 0

    def __init__(self, key, config, enumerated=None):
        self.key, self.config, self.workspace_bytes = key, config, 0
        *sliced, packed = graph_strides.x_choices(key)
        self.x_strides = packed if config.engine_id == 2 or not sliced else sliced[0]
        self.x_refusal = "cuDNN does not build eng2 for a strided x" if config.engine_id == 2 and sliced else ""

    def execute(self, x, w, y, workspace=None, bias=None, z=None):
        _XPlan.seen.append(x)
        if not graph_api._has_strides(x, self.x_strides):
            raise InputRefused(f"{self.config.algo}: the input x is not of the element strides its plan reads")
        if _XPlan.refusals:
            _XPlan.refusals -= 1
            raise InputRefused(f"{self.config.algo}: x not 16-byte aligned, as its plan assumes")
        if self.config.engine_id == 3:  # ignores the strides: reads past the slice's channels
            x = np.lib.stride_tricks.as_strided(x, x.shape, [s * 4 for s in _packed(self.key)])
        v = conv_reference(np, np.ascontiguousarray(x), np.ascontiguousarray(w), None, _geometry())
        if bias is not None:
            v = graph_api.fusion_of(self.config.fusion).reference(np, v + bias.reshape(1, -1, 1, 1))
        y[...] = v


@pytest.fixture
def plans(monkeypatch):
    return plans_stood_in(monkeypatch, _XPlan)


def _engine_call(layout: str, engine: str = "eng1", fusion: str = "", x_slice=XS) -> ConvCall:
    key = SHAPE.key(layout, "default", x_slice)
    d = annotation.ConvDecision(algo="implicit_gemm", engine=engine, fusion=fusion, memory_format=layout.upper(), math_mode="default",
                                problem_key=str(key))
    return ConvCall("c1", _geometry(), d)


def _inputs(layout: str, channels: int = TOTAL):
    """x: channels 3..3 + C of a buffer of ``channels`` channels (``C``: packed itself)."""
    x = _buffer(layout, channels=channels, seed=2)[:, 3:3 + C] if channels > C else _buffer(layout, channels=C, seed=2)
    b = np.linspace(-1, 1, K).astype(np.float32)
    want = np.maximum(conv_reference(np, np.ascontiguousarray(x), _weight(), None, _geometry()) + b.reshape(1, -1, 1, 1), 0)
    return x, _weight(), b, want


def _run(convs, call, x, w, b):
    return convs.run(call, x, w, b, relu=True, fusion=call.decision.fusion or None)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fusion", ["", "bias+relu"], ids=["bare, then its pass", "fused bias+relu"])
def test_an_engine_timed_reading_the_slice_gets_it_without_a_copy(engine_convs, plans, layout, fusion):
    convs = engine_convs(layout)
    x, w, b, want = _inputs(layout)
    call = _engine_call(layout, fusion=fusion)
    for _ in range(2):
        np.testing.assert_allclose(_run(convs, call, x, w, b), want, rtol=1e-5, atol=1e-5)
    assert [seen is x for seen in plans.seen] == [True, True]  # the slice itself, every run
    counters = convs.rt.counters
    assert (counters["slice_reads"], counters["slice_copies"], counters["layout_copies"]) == (2, 0, 0) and convs.rt.notes == []


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("channels", [C, TOTAL + 6], ids=["packed", "wider buffer"])
def test_an_input_not_of_the_plans_strides_is_copied_into_them(engine_convs, plans, layout, channels):
    convs = engine_convs(layout)
    x, w, b, want = _inputs(layout, channels)
    call = _engine_call(layout)
    np.testing.assert_allclose(_run(convs, call, x, w, b), want, rtol=1e-5, atol=1e-5)
    [seen] = plans.seen
    assert seen is not x and elements(seen.strides, 4) == SHAPE.key(layout, "default", XS).x_strides  # a copy, of the plan's strides
    counters = convs.rt.counters
    assert (counters["slice_reads"], counters["slice_copies"], counters["layout_copies"]) == (0, int(channels != C), 1)
    # a slice of other strides than the key's, or a packed x: a copy no tuning timed, said
    assert [tag for tag, _, _ in convs.rt.notes] == ["unpriced-copy:c1", "unpriced-copy"]
    assert "reads only slices of its key's strides" in convs.rt.notes[0][1]
    assert ("its input is packed while" in convs.rt.notes[0][1]) == (channels == C)
    _run(convs, call, x, w, b)
    assert len(convs.rt.notes) == 2 and convs.rt.counters["layout_copies"] == 2  # copied again, said once


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plan_cuDNN_built_for_a_packed_x_gets_a_packed_copy_as_timed(engine_convs, plans, layout):
    convs = engine_convs(layout)
    x, w, b, want = _inputs(layout)
    np.testing.assert_allclose(_run(convs, _engine_call(layout, engine="eng2"), x, w, b), want, rtol=1e-5, atol=1e-5)
    [seen] = plans.seen
    assert graph_api._has_strides(seen, _packed(SHAPE.key(layout, "default")))
    assert (convs.rt.counters["slice_reads"], convs.rt.counters["slice_copies"]) == (0, 1) and convs.rt.notes == []  # the tuner timed that copy


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_refused_input_slice_is_learned_once_and_copied_from_then_on(engine_convs, plans, layout, caplog):
    convs = engine_convs(layout)
    x, w, b, want = _inputs(layout)
    plans.refusals = 1
    call = _engine_call(layout)
    with caplog.at_level(logging.DEBUG, logger="convpass"):
        for _ in range(2):
            np.testing.assert_allclose(_run(convs, call, x, w, b), want, rtol=1e-5, atol=1e-5)
    assert [seen is x for seen in plans.seen] == [True, False, False]  # tried once in place, then the copy every run
    assert all(elements(seen.strides, 4) == SHAPE.key(layout, "default", XS).x_strides for seen in plans.seen)
    assert convs.resolve(call, x.dtype).strided_input_ok is False
    assert (convs.rt.counters["slice_reads"], convs.rt.counters["slice_copies"]) == (0, 2)
    said = [r for r in caplog.records if "refuses to read from a Concat slice" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_input_refusal_while_capturing_breaks_the_capture(engine_convs, plans, layout):
    convs = engine_convs(layout)
    x, w, b, _ = _inputs(layout)
    plans.refusals = 1
    convs.rt.capturing = True
    call = _engine_call(layout)
    with pytest.raises(CaptureBreak, match="read from a Concat slice during capture"):
        _run(convs, call, x, w, b)
    assert convs.resolve(call, x.dtype).strided_input_ok  # nothing learned: the warm-up run learns


# ---------------------------------------------------------------------------------------------
# the tuner's rows (NumPy stand-ins: the times are the fakes'; what is launched on what is tested)

def _xbench() -> ShapeBench:
    bench = ShapeBench(SHAPE, XS)
    bench._reference = conv_reference(np, bench._base["x"], bench._base["w"], None, _geometry())
    return bench


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fusion", ["", "bias+relu"])
def test_engines_of_an_input_slice_key_are_timed_reading_the_slice_in_place(bench_stand_in, plans, monkeypatch, layout, fusion):
    bench_stand_in(layout)
    bench_stand_in.cp.where, bench_stand_in.cp.cuda = np.where, fake_cuda([])
    offer_configs(monkeypatch, lambda key, fusion="": [EngineConfig(i, (), fusion) for i in (1, 2, 3)])
    key = SHAPE.key(layout, "default", XS)
    bench = _xbench()
    rows = Candidates(bench).measure_engines(key, None, fusion)
    tail = "+" + fusion if fusion else ""
    assert [(r.algo, r.status) for r in rows] == [("engine:eng1" + tail, "ok"), ("engine:eng2" + tail, "ok"), ("engine:eng3" + tail, "wrong_result")]
    assert "input slice read in place" in rows[0].note
    assert "input copied first (cuDNN refuses the slice: cuDNN does not build eng2 for a strided x)" in rows[1].note
    sets = bench.rotation(layout)
    in_place = plans.seen[:4]  # eng1: the check and 3 timed launches, each its set's slice itself
    assert all(any(x is s["x"] for s in sets) for x in in_place)
    copied = [dst for dst, src in bench_stand_in.copied if src == key.x_strides]
    assert copied == [_packed(key)] * 4  # eng2: each launch copied its set's slice into a packed x first; eng3 never
    assert np.isnan(sets[0]["x"].base).any()  # the buffer's other channels: NaN (eng3 read them: wrong)
    assert not any(shape_bench.superseded(r) for r in rows)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_engine_refusing_the_slice_in_place_is_timed_with_the_copy_into_its_strides(bench_stand_in, plans, monkeypatch, layout):
    bench_stand_in(layout)
    bench_stand_in.cp.cuda = fake_cuda([])
    offer_configs(monkeypatch, lambda key, fusion="": [EngineConfig(1)])
    plans.refusals = 1
    key = SHAPE.key(layout, "default", XS)
    [row] = Candidates(_xbench()).measure_engines(key, None)
    assert row.status == "ok" and "input copied first (cuDNN refuses the slice: engine:eng1: x not 16-byte aligned" in row.note
    copied = [dst for dst, src in bench_stand_in.copied if src == key.x_strides]
    assert copied == [key.x_strides] * 4  # each launch after the refusal: the slice copied into a buffer of its strides, aligned
    assert [elements(x.strides, 4) for x in plans.seen] == [key.x_strides] * 5


# ---------------------------------------------------------------------------------------------
# rows timed before plans read input slices are timed again

OLD = "relative error 1.0e-04; 3 launches, spread 1.0%; input copied first (the object reads packed inputs); graph API, conv then bias pass"


def _rows(key, engine_note, fused_note="input slice read in place"):
    rows = [Measurement(key, a, "ok", 0.01 * (i + 1), 0, True, 1.0, "measure", note="input slice read in place")
            for i, a in enumerate(algo_names("fwd"))]
    rows.append(Measurement(key, "implicit_gemm", "ok", None, 0, True, 1.0, "heuristic", heuristic_rank=0))
    rows += [Measurement(key, "engine:eng1", "ok", 0.005, 0, True, 1.0, "measure", note=engine_note),
             Measurement(key, "engine:eng3", "wrong_result", None, 0, True, 1.0, "measure", note="relative error 1.0e+00 > 5e-03"),
             Measurement(key, "engine:eng1+bias+relu", "ok", 0.006, 0, True, 1.0, "measure", note=fused_note)]
    return rows


def test_engine_rows_of_an_input_slice_key_timed_with_the_old_copy_are_timed_again(monkeypatch):
    key = SHAPE.key("nhwc", "default", XS)
    stale = _rows(key, OLD)
    assert [r.algo for r in stale if shape_bench.superseded(r)] == ["engine:eng1"]
    # the bare graph's engine rows go (the wrong one too: checked with the copy), the legacy rows and another graph's stay
    assert [r.algo for r in shape_bench.current(stale) if "engine" in r.algo] == ["engine:eng1+bias+relu"]
    fresh = _rows(key, OLD.replace("input copied first (the object reads packed inputs)", "input slice read in place"))
    assert shape_bench.current(fresh) == fresh
    packed_key = SHAPE.key("nhwc", "default")  # a packed key's engine rows never copied a slice
    assert not any(shape_bench.superseded(r) for r in _rows(packed_key, OLD))
    own = Measurement(key, "convpass_depthwise_r1", "ok", 0.01, 0, True, 1.0, "measure", note=OLD)  # convpass's kernel still reads packed inputs
    assert not shape_bench.superseded(own)
    engines_timed_again(monkeypatch, ConvProblem((SHAPE,), x_slice=XS), stale, fresh)


def engines_timed_again(monkeypatch, problem, stale, fresh) -> None:
    """The tuner finds ``problem`` incomplete with the ``stale`` rows, complete with the ``fresh``
    ones, and given the stale ones times its engines again, not its legacy algorithms."""
    seen = []
    monkeypatch.setattr(harness, "warm_clocks", lambda: None)
    monkeypatch.setattr(tuner, "spaces", lambda problem, options: (True, True))
    monkeypatch.setattr(tuner, "own_space", lambda problem, options, legacy=True: False)
    monkeypatch.setattr(tuner, "_measure", lambda problem, options, keys, strategy, forced, legacy, engines, best, fusion, have=(), **own: seen.append((legacy, engines)) or [])
    options = TuneOptions(tf32="on", layout="nhwc")
    assert not tuner.problem_complete(stale, problem, options) and tuner.problem_complete(fresh, problem, options)
    tuner.measure_problem(problem, options, stale)
    assert seen == [(False, True)]  # the legacy rows stand; the engines are timed again


def test_a_superseded_row_never_timed_again_stops_the_retiming_once_the_others_are(tmp_path):
    """eng1 timed with the old copy (at t=1) and no longer offered: the engines timed again later
    (t=2) stand, the superseded row itself is dropped, and the tuner and a decision made without a
    GPU read the same rows."""
    from convpass.core.device import DeviceFingerprint
    from convpass.tuning.cache import TuningCache
    from convpass.tuning.cache_rows import current
    from convpass.tuning.decide import CacheBackend

    key = SHAPE.key("nhwc", "default", XS)
    rows = [dataclasses.replace(r, measured_at=2.0) if r.algo == "engine:eng3" else r for r in _rows(key, OLD)]
    rows.append(Measurement(key, "engine:eng4", "ok", 0.007, 0, True, 2.0, "measure", note="input slice read in place"))
    kept = [r.algo for r in current(rows) if "engine" in r.algo]
    assert kept == ["engine:eng3", "engine:eng1+bias+relu", "engine:eng4"]  # eng1 (superseded, fastest) gone
    options = TuneOptions(tf32="on", layout="nhwc")
    problem = ConvProblem((SHAPE,), x_slice=XS)
    assert tuner.problem_complete(rows, problem, options)  # nothing timed again on every run
    device = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)
    cache = TuningCache(tmp_path / "c.db")
    cache.put(device, rows)
    try:
        backend = CacheBackend(cache, device)
        [choice] = backend.decide([problem], options).values()
        assert choice is not None and choice.algo != "engine:eng1" and not any(shape_bench.superseded(r) for r in backend.rows[problem])
    finally:
        cache.close()


def test_one_sample_channels_first_slice_is_read_in_place_though_it_looks_packed(engine_convs, plans):
    """At batch 1 a channels-first slice's strides are a packed tensor's (the sample stride aside):
    the plan built for the slice reads it itself, as the tuner timed it, with no copy."""
    from convpass.ops.conv import conv_geometry

    g = conv_geometry("Conv", {"pads": [1, 1, 1, 1]}, (1, C, 5, 5), (K, C, 3, 3))
    key = g.shapes[0].key("nchw", "default", XS)
    d = annotation.ConvDecision(algo="implicit_gemm", engine="eng1", fusion="", memory_format="NCHW", math_mode="default", problem_key=str(key))
    call = ConvCall("c1", g, d)
    convs = engine_convs("nchw")
    x = np.random.default_rng(2).standard_normal((1, TOTAL, 5, 5)).astype(np.float32)[:, 3:3 + C]
    b = np.linspace(-1, 1, K).astype(np.float32)
    want = np.maximum(conv_reference(np, np.ascontiguousarray(x), _weight(), None, g) + b.reshape(1, -1, 1, 1), 0)
    for _ in range(2):
        np.testing.assert_allclose(_run(convs, call, x, _weight(), b), want, rtol=1e-5, atol=1e-5)
    assert [seen is x for seen in plans.seen] == [True, True]  # the slice itself, every run
    assert convs.rt.counters["layout_copies"] == 0 and convs.rt.notes == []

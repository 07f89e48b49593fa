"""A fused residual read from a channel slice (CSPDarknet's first block of a stage adds the second
half of its stage's Split) on the CPU: problem keys that name the slice (``zslice``) and their
round trip; the compiler marking the block's residual as that slice, and nothing else; the
tuner's rows of such a key (a graph-API fused graph reading the strided ``z``, one whose graph
cuDNN does not build a row saying so, cuDNN's legacy fused call timed with the copy into a packed
``z``, the passes reading the slice), with cuDNN stood in for by NumPy; the executor passing the
slice itself where the decision was timed so, copying and counting otherwise, learning a refusal
once; and a CSP stage tuned from a cache, run on the CPU, against ONNX Runtime and float64 NumPy."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import csp_block_model, fake_cuda, no_plan_side_car, offer_configs, plans_stood_in, run_ort
from test_slice_reads import LAYOUTS, TOTAL, C, K, _buffer, _convs, _geometry, _weight, stand_in  # noqa: F401
from test_slice_tuning import bench_stand_in  # noqa: F401

import convpass
from convpass.compiler.pipeline import OptimizeReport, prepare_model
from convpass.core import annotation
from convpass.core.device import DeviceFingerprint
from convpass.core.fusion import RESIDUAL_PASS
from convpass.core.options import TuneOptions
from convpass.core.problem import InputSlice, ProblemKey, ResidualSlice
from convpass.kernels import conv_exec
from convpass.native import cudnn
from convpass.native.cuda import CaptureBreak, elements
from convpass.native.cudnn import graph_api
from convpass.native.cudnn.graph_api import EngineConfig, GraphApiError
from convpass.ops.conv import ConvCall, conv_reference
from convpass.tuning import candidates as candidates_module
from convpass.tuning import harness
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.candidates import Candidates
from convpass.tuning.decide import EPILOGUE_METHOD
from convpass.tuning.shape_bench import ShapeBench

P = "bias+leakyrelu0.01"
F = P + "+add"
SHAPE = _geometry().shapes[0]  # N x C x 5 x 5 -> N x K x 5 x 5, 3x3, pads 1
Z = ResidualSlice(2, TOTAL)  # the residual: channels 2..2 + K of a TOTAL-channel buffer
FUSED = "engine:eng1+" + F
H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)


def _leaky(v):
    return np.where(v > 0, v, np.float32(0.01) * v)


# ---------------------------------------------------------------------------------------------
# the key


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_residual_slice_key_reads_back_and_is_a_key_of_its_own(layout):
    key = SHAPE.key(layout, "default", z_slice=Z)
    assert str(key).endswith(f"|{layout}|default|zslice=2/{TOTAL}") and ProblemKey.parse(str(key)) == key
    both = SHAPE.key(layout, "default", InputSlice(0, 8), z_slice=Z)
    assert str(both).endswith(f"|xslice=0/8|zslice=2/{TOTAL}") and ProblemKey.parse(str(both)) == both
    packed = SHAPE.key(layout, "default")
    assert key != packed and key.packed == packed and both.packed == packed
    assert ProblemKey.parse(str(packed)).z_slice is None  # a key from before: a packed residual, as it was timed
    view = _buffer(layout)[:, 2:2 + K]  # the residual's slice of a TOTAL-channel buffer stored in the layout
    assert key.z_strides == elements(view.strides, 4) != elements(_buffer(layout, channels=K).strides, 4)
    assert key.x_strides is None and key.y_strides is None and packed.z_strides is None
    with pytest.raises(ValueError, match="not a convpass problem key"):  # the grammar's order: xslice, yslice, zslice
        ProblemKey.parse(str(packed) + f"|zslice=2/{TOTAL}|xslice=0/8")
    with pytest.raises(ValueError, match="no channel slice"):
        SHAPE.key(layout, "default", z_slice=ResidualSlice(TOTAL - 2, TOTAL))  # K channels do not fit
    with pytest.raises(ValueError, match="a residual slice is a forward conv's"):
        SHAPE.with_direction("dgrad").key(layout, "default", z_slice=Z)


# ---------------------------------------------------------------------------------------------
# the compiler: which residuals are slices

X = (2, 16, 12, 12)


def _problems(model: onnx.ModelProto, engines: str = "all") -> dict:
    m = ir.serde.deserialize_model(model)
    problems = prepare_model(m, TuneOptions(engines=engines, layout="nhwc"), [], OptimizeReport())
    return {use.node.name: p for p, uses in problems.items() for use in uses}


@pytest.mark.parametrize("kw,fusion", [({}, F), ({"residual_first": True}, F), ({"swish": True}, "bias+swish+add")])
def test_the_first_block_of_a_csp_stage_adds_a_residual_read_from_its_splits_half(kw, fusion):
    c = X[1]
    found = _problems(csp_block_model(X, stage=True, **kw))
    assert found["c2"].fusion == fusion and found["c2"].z_slice == ResidualSlice(c, 2 * c)  # the Split's second half
    assert found["c2"].x_slice is None and found["c1"].x_slice == InputSlice(c, 2 * c) and found["c1"].z_slice is None
    assert [n for n, p in found.items() if p.z_slice is not None] == ["c2"]
    key = found["c2"].primary.key("nhwc", "default", found["c2"].x_slice, found["c2"].y_slice, found["c2"].z_slice)
    assert str(key).endswith(f"|nhwc|default|zslice={c}/{2 * c}")


def test_the_residual_slice_key_keeps_its_first_channel_modulo_the_alignment_rule():
    found = _problems(csp_block_model((2, 64, 6, 6), stage=True))
    assert found["c2"].z_slice == ResidualSlice(0, 128)  # channel 64: 256 bytes in, the class of channel 0


def _legacy_residual(model: onnx.ModelProto) -> onnx.ModelProto:
    """c2 -> Add(y2, xb): no activation between, the legacy bias+add (z before any ReLU)."""
    g = model.graph
    g.node.remove(next(n for n in g.node if n.name == "l2"))
    next(n for n in g.node if n.name == "add").input[0] = "y2"
    return model


@pytest.mark.parametrize("why,model,engines", [
    ("no engines: no fused activation, the Add is its own step", csp_block_model(X, stage=True), "legacy"),
    ("a legacy epilogue's residual is timed packed", _legacy_residual(csp_block_model(X, stage=True)), "all"),
    ("the residual is the graph's input, packed", csp_block_model(X), "all"),
])
def test_any_other_residual_is_no_slice(why, model, engines):
    found = _problems(model, engines)
    assert all(p.z_slice is None for p in found.values()), why
    if "legacy epilogue" in why:
        assert found["c2"].fusion == "bias+add"


# ---------------------------------------------------------------------------------------------
# the tuner's rows (NumPy stand-ins: the times are the fakes'; what is launched on what is tested)

class _Plan:
    """A graph-API plan of ``F`` stood in for: ``leaky(conv(x, w) + b) + z`` by the reference conv;
    a ``z`` of other element strides than the plan reads is refused as the real plan refuses it
    (:meth:`graph_api.EnginePlan.execute`); configuration 3 does not build (cuDNN refusing the
    strided ``z``); ``refusals``: launches with ``z`` read in place refused first (as a misaligned ``z`` is)."""

    seen: list = []
    refusals = 0

    def __init__(self, key, config, enumerated=None):
        if config.engine_id == 3:
            raise GraphApiError(f"cuDNN does not build eng3 ({config.fusion}) for {key}: a strided z is CUDNN_STATUS_NOT_SUPPORTED")
        self.key, self.config, self.workspace_bytes = key, config, 0
        self.z_strides = graph_api._z_strides(key)

    def execute(self, x, w, y, workspace=None, bias=None, z=None):
        _Plan.seen.append((elements(z.strides, 4), z))
        if not graph_api._has_strides(z, self.z_strides):
            raise GraphApiError(f"{self.config.algo}: the residual z is not of the element strides its plan reads")
        if _Plan.refusals:
            _Plan.refusals -= 1
            raise graph_api.ResidualRefused(f"{self.config.algo}: z not 16-byte aligned, as its plan assumes")
        pre = conv_reference(np, np.ascontiguousarray(x), np.ascontiguousarray(w), None, _geometry()) + bias.reshape(1, -1, 1, 1)
        y[...] = _leaky(pre) + z


@pytest.fixture
def plans(monkeypatch):
    return plans_stood_in(monkeypatch, _Plan)


def _zbench(z_slice=Z) -> ShapeBench:
    bench = ShapeBench(SHAPE, z_slice=z_slice)
    bench._reference = conv_reference(np, bench._base["x"], bench._base["w"], None, _geometry())
    return bench


def _cupy_for_engines(bench_stand_in) -> None:
    """What an engine's launch and its expected output need of the NumPy CuPy besides the slice fixture's."""
    bench_stand_in.cp.where = np.where
    bench_stand_in.cp.cuda = fake_cuda([])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_fused_graph_is_timed_reading_the_residual_slice_in_place(bench_stand_in, plans, monkeypatch, layout):
    bench_stand_in(layout)
    _cupy_for_engines(bench_stand_in)
    offer_configs(monkeypatch, lambda key, fusion="": [EngineConfig(i, (), fusion) for i in (1, 3)])
    key = SHAPE.key(layout, "default", z_slice=Z)
    bench = _zbench()
    rows = Candidates(bench).measure_engines(key, None, F)
    assert [(r.algo, r.status) for r in rows] == [(FUSED, "ok"), ("engine:eng3+" + F, "unsupported")]
    assert "residual slice read in place" in rows[0].note and "strided z" in rows[1].note  # does not apply: a value, no crash
    assert len(plans.seen) == 4 and {s for s, _ in plans.seen} == {key.z_strides}  # the check and 3 timed launches: the slice itself
    sets = bench.rotation(layout)
    assert all(any(z is b["z"] for b in sets) for _, z in plans.seen)
    assert bench_stand_in.copies.count(key.z_strides) == 0  # no copy of the slice in the time
    assert np.isnan(sets[0]["z"].base).any()  # the buffer's other channels: NaN, never read


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_graph_with_a_packed_residual_is_not_given_the_slice(bench_stand_in, plans, monkeypatch, layout):
    """A packed key's plan reads a packed z; a strided one fails the check (a wrong plan, not a crash)."""
    bench_stand_in(layout)
    _cupy_for_engines(bench_stand_in)
    offer_configs(monkeypatch, lambda key, fusion="": [EngineConfig(1, (), fusion)])
    packed = SHAPE.key(layout, "default")
    [row] = Candidates(_zbench(None)).measure_engines(packed, None, F)
    assert row.status == "ok" and "residual slice" not in row.note and "residual copied" not in row.note
    assert {s for s, _ in plans.seen} == {elements(cudnn.as_layout(np.zeros(SHAPE.y_shape, np.float32), layout).strides, 4)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_legacy_fused_call_is_timed_with_the_copy_of_the_residual_slice(bench_stand_in, monkeypatch, layout):
    fake = bench_stand_in(layout)
    monkeypatch.setattr(cudnn, "conv_bias_activation_forward", fake.fused)  # it asserts a packed z reaches cuDNN
    key = SHAPE.key(layout, "default", z_slice=Z)
    row = Candidates(_zbench())._measure_fused_call(cudnn.ConvDescriptors(key), key, "implicit_precomp_gemm", "bias+add", None)
    assert row.status == "ok" and "residual copied first (the object reads a packed residual)" in row.note, row.note
    assert [c[0] for c in fake.calls] == ["cudnnConvolutionBiasActivationForward"] * 4
    assert bench_stand_in.copies.count(key.z_strides) == 4  # each launch copied its set's slice first, the copy in the time


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_passes_read_the_residual_slice_in_the_outputs_memory_order(bench_stand_in, monkeypatch, layout):
    bench_stand_in(layout)
    launched = []
    monkeypatch.setattr(candidates_module, "_activation_kernel", lambda fusion: lambda *arrays: launched.append(arrays))
    bench_stand_in.cp.add = lambda a, b, out: launched.append((a, b, out))
    key = SHAPE.key(layout, "default", z_slice=Z)
    candidates = Candidates(_zbench())
    rows = [candidates._measure_activation(key, F), candidates._measure_residual_pass(key)]
    assert [(r.algo, r.method) for r in rows] == [(F, EPILOGUE_METHOD), (RESIDUAL_PASS, EPILOGUE_METHOD)]
    assert all(r.note.endswith("its residual read from its channel slice") for r in rows)
    sets = candidates.bench.rotation(layout)
    assert launched and all(len({a.shape for a in arrays}) == 1 for arrays in launched)  # y and z walked in one order
    assert all(any(np.shares_memory(arrays[1], b["z"]) for b in sets) for arrays in launched)  # the slice itself, no copy


def test_the_rotation_of_a_timing_with_a_residual_is_sized_with_its_z_the_slices_whole_buffer(bench_stand_in, monkeypatch):
    bench_stand_in("nhwc")
    bench_stand_in.cp.add = lambda a, b, out: None
    sized = []
    monkeypatch.setattr(harness, "rotation_sets", lambda nbytes, limit=64: sized.append(nbytes) or 2)
    packed, sliced = _zbench(None), _zbench()
    x, w, y = (packed._base[name].nbytes for name in "xwy")
    for bench in (packed, sliced):
        bench.rotation("nhwc")
        bench.rotation("nhwc", residual=True)
    assert sized == [x + w + y, x + w + 2 * y, x + w + y, x + w + y + y * TOTAL // K]  # a zslice z: its buffer of TOTAL channels
    sized.clear()
    Candidates(sliced)._measure_residual_pass(SHAPE.key("nhwc", "default", z_slice=Z))  # a timing that adds z sizes its sets so
    assert sized == [x + w + y + y * TOTAL // K]


# ---------------------------------------------------------------------------------------------
# the executor (cuDNN stood in for)

def _engine_call(layout: str, z_slice=Z) -> ConvCall:
    key = SHAPE.key(layout, "default", z_slice=z_slice)
    d = annotation.ConvDecision(algo="implicit_gemm", engine="eng1", fusion=F, memory_format=layout.upper(), math_mode="default",
                                problem_key=str(key))
    return ConvCall("c2", _geometry(), d)


@pytest.fixture
def engine_convs(stand_in, plans, monkeypatch):
    """The executor's conv family over NumPy with the engine plan stood in for: ``(convs, layout)`` per layout."""
    no_plan_side_car(monkeypatch)
    stand_in.cp.cuda = fake_cuda([])

    def make(layout: str):
        stand_in(layout)
        return _convs(stand_in.cp)

    return make


def _inputs(layout: str, z_buffer_channels: int | None = TOTAL):
    x = cudnn.as_layout(_buffer(layout, channels=C), layout)
    b = np.linspace(-1, 1, K).astype(np.float32)
    if z_buffer_channels is None:
        z = cudnn.as_layout(_buffer(layout, channels=K, seed=3), layout)
    else:
        z = _buffer(layout, channels=z_buffer_channels, seed=3)[:, 2:2 + K]
    want = _leaky(conv_reference(np, np.ascontiguousarray(x), _weight(), None, _geometry()) + b.reshape(1, -1, 1, 1)) + z
    return x, _weight(), b, z, want


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_decision_timed_reading_the_slice_passes_it_without_a_copy(engine_convs, plans, layout):
    convs = engine_convs(layout)
    x, w, b, z, want = _inputs(layout)
    call = _engine_call(layout)
    for _ in range(2):
        y = convs.run(call, x, w, b, z=z, fusion=F, fused=True)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert [seen is z for _, seen in plans.seen] == [True, True]  # the slice itself, every run
    counters = convs.rt.counters
    assert (counters["residual_slice_reads"], counters["residual_copies"], counters["layout_copies"]) == (2, 0, 0)
    assert counters["fused_bias_leakyrelu_add"] == 2 and convs.rt.notes == []


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("z_channels", [None, TOTAL + 6], ids=["packed", "wider buffer"])
def test_a_residual_not_of_the_slices_strides_is_copied_into_them_counted_and_noted(engine_convs, plans, layout, z_channels):
    convs = engine_convs(layout)
    x, w, b, z, want = _inputs(layout, z_channels)
    key = ProblemKey.parse(_engine_call(layout).decision.problem_key)
    y = convs.run(_engine_call(layout), x, w, b, z=z, fusion=F, fused=True)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    [(strides, seen)] = plans.seen
    assert strides == key.z_strides and seen is not z  # a copy, of the strides the plan reads
    assert (convs.rt.counters["residual_slice_reads"], convs.rt.counters["residual_copies"]) == (0, 1)
    assert [tag for tag, _, warned in convs.rt.notes if not warned] == ["residual-copy:c2"]  # a copy no tuning timed


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_decision_timed_with_a_packed_residual_copies_the_slice_as_ever(engine_convs, plans, layout):
    convs = engine_convs(layout)
    x, w, b, z, want = _inputs(layout)
    y = convs.run(_engine_call(layout, z_slice=None), x, w, b, z=z, fusion=F, fused=True)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    [(strides, _)] = plans.seen
    assert cudnn.layout_of(plans.seen[0][1]) in (layout, "both")
    assert (convs.rt.counters["residual_slice_reads"], convs.rt.counters["residual_copies"]) == (0, 1)
    assert [tag for tag, _, _ in convs.rt.notes] == ["residual-copy:c2"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_refused_residual_slice_is_learned_once_and_copied_from_then_on(engine_convs, plans, layout, caplog):
    convs = engine_convs(layout)
    x, w, b, z, want = _inputs(layout)
    plans.refusals = 1
    call = _engine_call(layout)
    with caplog.at_level(logging.DEBUG, logger="convpass"):
        for _ in range(2):
            np.testing.assert_allclose(convs.run(call, x, w, b, z=z, fusion=F, fused=True), want, rtol=1e-5, atol=1e-5)
    assert [seen is z for _, seen in plans.seen] == [True, False, False]  # tried once in place, then the copy every run
    assert convs.resolve(call, x.dtype, F).strided_residual_ok is False
    assert (convs.rt.counters["residual_slice_reads"], convs.rt.counters["residual_copies"]) == (0, 2)
    said = [r for r in caplog.records if "refuses to read its residual from a channel slice" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("odd", ["z", "x"])
def test_only_a_refusal_of_the_residual_itself_is_learned_as_one(engine_convs, plans, layout, odd, monkeypatch):
    """A launch refused for its residual slice alone (z misaligned) copies z from then on; one
    refused for another tensor (x misaligned) is no refusal of the slice: the warned fallback, the
    slice still read in place by the decision."""
    convs = engine_convs(layout)
    x, w, b, z, want = _inputs(layout)
    call = _engine_call(layout)
    ex = convs.resolve(call, x.dtype, F)
    tries, warned = [], []
    convs.rt.warn_node = lambda node, m: warned.append(m)

    def misaligned(**arrays):
        tries.append(arrays["z"] is z)
        return [odd] if len(tries) == 1 else []

    monkeypatch.setattr(conv_exec.graph_api, "misaligned", misaligned)
    for name in ("where", "add"):  # the fallback's activation pass and residual add
        monkeypatch.setattr(convs.rt.cp, name, getattr(np, name), raising=False)
    np.testing.assert_allclose(convs.run(call, x, w, b, z=z, fusion=F, fused=True), want, rtol=1e-5, atol=1e-5)
    assert tries[0] and ex.strided_residual_ok is (odd != "z")
    if odd == "z":
        assert tries == [True, False] and [seen is z for _, seen in plans.seen] == [False]  # then the copy
        assert (convs.rt.counters["residual_copies"], warned) == (1, [])
    else:
        assert convs.resolve(call, x.dtype, F) is not ex and [m for m in warned if "x not 16-byte aligned" in m] == warned != []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_residual_refusal_while_capturing_breaks_the_capture(engine_convs, plans, layout):
    convs = engine_convs(layout)
    x, w, b, z, _ = _inputs(layout)
    plans.refusals = 1
    convs.rt.capturing = True
    call = _engine_call(layout)
    with pytest.raises(CaptureBreak, match="residual was refused as a channel slice during capture"):
        convs.run(call, x, w, b, z=z, fusion=F, fused=True)
    assert convs.resolve(call, x.dtype, F).strided_residual_ok  # nothing learned: the warm-up run learns


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("keyed", [True, False], ids=["slice key", "packed key"])
def test_cudnns_fused_call_copies_the_slice_noted_only_where_no_tuning_timed_the_copy(stand_in, layout, keyed):
    fake = stand_in(layout)  # its fused call asserts a packed z
    convs = _convs(stand_in.cp)
    x, w, b, z, _ = _inputs(layout)
    key = SHAPE.key(layout, "default", z_slice=Z if keyed else None)
    d = annotation.ConvDecision(algo="implicit_precomp_gemm", fusion="bias+add", memory_format=layout.upper(), math_mode="default",
                                problem_key=str(key))
    y = convs.run(ConvCall("c2", _geometry(), d), x, w, b, z=z, fusion="bias+add")
    want = conv_reference(np, np.ascontiguousarray(x), w, None, _geometry()) + b.reshape(1, -1, 1, 1) + z
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert [c[0] for c in fake.calls] == ["cudnnConvolutionBiasActivationForward"]
    assert (convs.rt.counters["residual_slice_reads"], convs.rt.counters["residual_copies"]) == (0, 1)
    assert [tag for tag, _, _ in convs.rt.notes] == ([] if keyed else ["residual-copy:c2"])


def test_an_object_reads_the_strided_residual_only_of_a_fused_graph_with_its_residual(plans):
    key = SHAPE.key("nhwc", "default", z_slice=Z)
    cp = np
    fused = conv_exec.conv_exec(key, FUSED, F, cp=cp, plan=_Plan(key, EngineConfig.parse(FUSED)))
    shorter = conv_exec.conv_exec(key, "engine:eng1+" + P, P, cp=cp, plan=_Plan(key, EngineConfig.parse("engine:eng1+" + P)))
    assert fused.residual_strides == key.z_strides and shorter.residual_strides is None
    assert conv_exec.conv_exec(SHAPE.key("nhwc", "default"), FUSED, F, cp=cp, plan=_Plan(key, EngineConfig.parse(FUSED))).residual_strides is None


# ---------------------------------------------------------------------------------------------
# the operation graph the graph API is given (the frontend stood in for)

@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_fused_graph_of_a_residual_slice_key_reads_z_with_the_slices_strides(frontend, layout):
    from convpass.native.cudnn.descriptors import descriptor_params

    key = SHAPE.key(layout, "default", z_slice=Z)
    plan = graph_api.EnginePlan(key, EngineConfig.parse("eng5", F))
    y = descriptor_params(key).y
    assert ("tensor", "z", tuple(y.dims), key.z_strides) in frontend.calls and plan.z_strides == key.z_strides
    arrays = {name: np.zeros((2, 4), np.float32) for name in ("w", "y", "b")}
    arrays["x"] = _buffer(layout, channels=C)  # packed, as the plan of a key without an input slice reads it
    packed = _buffer(layout, channels=K)
    with pytest.raises(graph_api.ResidualRefused, match="not of the element strides its plan reads"):  # never read with strides it was not built for
        plan.execute(*(_ptr(arrays[n], 100 * i) for i, n in enumerate("xwy")), None, bias=_ptr(arrays["b"], 400), z=_ptr(packed, 500))
    sliced = _buffer(layout)[:, 2:2 + K]
    plan.execute(*(_ptr(arrays[n], 100 * i) for i, n in enumerate("xwy")), None, bias=_ptr(arrays["b"], 400), z=_ptr(sliced, 500))
    assert frontend.calls[-1][0] == "execute"


class _ptr:
    """A host array seen as a device array at a made-up address (what the plan's checks read)."""

    def __init__(self, a, ptr):
        self.shape, self.strides, self.itemsize, self.nbytes = a.shape, a.strides, a.itemsize, 4
        self.data = type("D", (), {"ptr": 1000 + ptr})()


# ---------------------------------------------------------------------------------------------
# a CSP stage tuned from a cache, run on the CPU

def _row(key, algo, time_ms, method="measure", hr=None):
    return Measurement(key, algo, "ok", time_ms, 0, True, 1.0, method, heuristic_rank=hr)


def _stage_rows(key):
    return [_row(key, "implicit_gemm", 0.020), _row(key, "implicit_gemm", None, "heuristic", 0), _row(key, P, 0.010, EPILOGUE_METHOD),
            _row(key, "engine:eng1+" + P, 0.019), _row(key, F, 0.012, EPILOGUE_METHOD), _row(key, RESIDUAL_PASS, 0.004, EPILOGUE_METHOD),
            _row(key, FUSED, 0.015)]


def _stage_c2():
    return _problems(csp_block_model(X, stage=True))["c2"]


def _tuned_stage(tmp_path, key) -> onnx.ModelProto:
    cache = TuningCache(tmp_path / "c.db")
    cache.put(H200, _stage_rows(key))
    cache.close()
    return convpass.optimize(csp_block_model(X, stage=True), cache=tmp_path / "c.db", device_name=str(H200), quiet=True, tf32="on",
                             layout="nhwc")


def test_a_csp_stage_decided_from_residual_slice_rows_records_its_key_and_runs_like_the_ops(tmp_path):
    c2 = _stage_c2()
    key = c2.primary.key("nhwc", "default", z_slice=c2.z_slice)
    tuned = _tuned_stage(tmp_path / "slice", key)
    onnx.checker.check_model(tuned, full_check=True)
    records = {r["node"]: r for r in convpass.inspect(tuned)}
    assert (records["c2"]["engine"], records["c2"]["fusion"], records["c2"]["problem_key"]) == ("eng1", F, str(key))
    model = csp_block_model(X, stage=True)
    x = np.random.default_rng(6).standard_normal(X).astype(np.float32)
    want = _stage64(model, x)
    np.testing.assert_allclose(convpass.Executor(tuned, device="cpu").run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(run_ort(tuned, {"x": x})[0], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(convpass.Executor(tuned, device="cpu").run(None, {"x": x})[0], run_ort(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_rows_of_a_packed_residual_do_not_decide_the_slice_problem(tmp_path):
    tuned = _tuned_stage(tmp_path, _stage_c2().primary.key("nhwc", "default"))
    c2 = next(r for r in convpass.inspect(tuned) if r["node"] == "c2")
    assert not c2["engine"] and c2["algo"] == annotation.AUTO  # left to run time: its own rows are missing


def _stage64(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """csp_block_model(stage=True)'s output op by op in float64."""
    w = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}

    def conv(v, name, pads=0):
        v = np.pad(v, [(0, 0), (0, 0), (pads, pads), (pads, pads)])
        k = w["w" + name]
        h, wd = v.shape[2] - k.shape[2] + 1, v.shape[3] - k.shape[3] + 1
        out = sum(np.einsum("nchw,kc->nkhw", v[:, :, i:i + h, j:j + wd], k[:, :, i, j]) for i in range(k.shape[2]) for j in range(k.shape[3]))
        return out + w["b" + name].reshape(1, -1, 1, 1)

    def act(v):
        return np.where(v > 0, v, float(np.float32(0.01)) * v)

    e = act(conv(np.asarray(x, np.float64), "e"))
    xs, xb = e[:, :X[1]], e[:, X[1]:]
    s = act(conv(act(conv(xb, "1")), "2", 1)) + xb
    return conv(np.concatenate([xs, act(conv(s, "tb"))], axis=1), "t")

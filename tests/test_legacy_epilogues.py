"""Legacy conv epilogues on the CPU (:mod:`convpass.core.fusion`): which epilogue a conv's step runs
(the collect pass reads the executor's lowering rules), selection between the fused cuDNN call and
the conv plus one pass, cache completeness, the tuner's rows (NumPy stand-ins for CuPy and cuDNN: no
timing invented), the annotation (schema 5) and the executor's use of the recorded choice."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import numpy_candidates, numpy_shape_bench
from onnx import helper, numpy_helper

import convpass
from convpass.compiler.passes.canonicalize_convs import canonicalize_conv
from convpass.compiler.passes.collect_conv_problems import ConvProblem, conv_fusion
from convpass.core import annotation
from convpass.core import fusion as epilogue
from convpass.core.algo import Algo
from convpass.core.cudnn_enums import algo_names
from convpass.core.device import DeviceFingerprint
from convpass.core.options import TuneOptions
from convpass.tuning import tuner
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.decide import EPILOGUE_METHOD, choice_from, cost_ms, epilogue_ms, select

H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)
X = (2, 8, 6, 6)
SHAPE = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, X, (8, 8, 3, 3)).shapes[0]
KEY = SHAPE.key("nhwc", "default")
RELU = "bias+relu"
PROBLEM = ConvProblem((SHAPE,), RELU)
OPTIONS = TuneOptions(tf32="on", layout="nhwc", engines="legacy")


def row(algo, time_ms, method="measure", status="ok", key=KEY, hr=None, note=""):
    return Measurement(key, algo, status, time_ms, 0, True, 1.0, method, note=note, heuristic_rank=hr)


# ---------------------------------------------------------------------------------------------
# names

def test_epilogue_names_and_parts():
    assert [epilogue.legacy_name(z, r) for z in (False, True) for r in (False, True)] == list(epilogue.LEGACY)
    assert [epilogue.parts(n) for n in epilogue.LEGACY] == [(False, False), (False, True), (True, False), (True, True)]
    assert str(Algo.parse("implicit_gemm").fused(RELU)) == "implicit_gemm+bias+relu"
    fused = Algo.parse("implicit_gemm+bias+relu")
    assert (fused.fusion, str(fused.bare)) == (RELU, "implicit_gemm")
    assert (Algo.parse("implicit_gemm").fusion, Algo.parse("engine:eng5+bias+swish").fusion) == ("", "bias+swish")
    assert epilogue.is_legacy("bias+add") and not epilogue.is_legacy("bias+swish") and not epilogue.is_legacy("")
    with pytest.raises(ValueError, match="not a legacy conv epilogue"):
        epilogue.parts("bias+swish")


# ---------------------------------------------------------------------------------------------
# which epilogue a conv's step runs

def _residual_model(*, relu_after_add=True, z_after_conv=False, z_shape=X, add_is_output=False, bias=True) -> onnx.ModelProto:
    """x -> c0 (Conv+bias) -> r0 (Relu) = z; z -> c1 (Conv) -> Add(y1, z) -> Relu -> out."""
    w = numpy_helper.from_array(np.ones((8, 8, 3, 3), np.float32), "w")
    b = numpy_helper.from_array(np.ones(8, np.float32), "b")
    conv = dict(pads=[1, 1, 1, 1])
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y0"], name="c0", **conv), helper.make_node("Relu", ["y0"], ["z"], name="r0")]
    c1 = helper.make_node("Conv", ["z", "w"] + (["b"] if bias else []), ["y1"], name="c1", **conv)
    other = "z"
    if z_shape != X:  # the residual through a pooling: another shape
        nodes.append(helper.make_node("MaxPool", ["z"], ["zp"], name="pool", kernel_shape=[2, 2], strides=[2, 2]))
        other = "zp"
    add = helper.make_node("Add", ["y1", other], ["s"], name="add")
    tail = [helper.make_node("Relu", ["s"], ["out"], name="r1")] if relu_after_add else [helper.make_node("Identity", ["s"], ["out"], name="id")]
    if z_after_conv:  # z computed after c1 in the graph's order: c1 reads x instead
        c1 = helper.make_node("Conv", ["x", "w", "b"], ["y1"], name="c1", **conv)
        nodes = [c1] + nodes
    else:
        nodes.append(c1)
    nodes += [add] + tail
    outputs = [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)]
    if add_is_output:
        outputs.append(helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(X))], outputs, [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def _conv(model: onnx.ModelProto, name: str) -> ir.Node:
    return {n.name: n for n in ir.serde.deserialize_model(model).graph}[name]


@pytest.mark.parametrize("why,kwargs,expected", [
    ("residual Add then Relu", {}, "bias+add+relu"),
    ("residual Add without a Relu", {"relu_after_add": False}, "bias+add"),
    ("the Add's output is read by the Relu and is a graph output", {"add_is_output": True}, "bias+add"),
    ("the residual is computed after the conv", {"z_after_conv": True}, "bias"),
    ("the residual has another shape", {"z_shape": (2, 8, 3, 3)}, "bias"),
    ("no bias: the same step, run with a zero bias", {"bias": False}, "bias+add+relu"),
])
def test_the_residual_epilogue_follows_the_executor_rules(why, kwargs, expected):
    assert conv_fusion(_conv(_residual_model(**kwargs), "c1")) == expected, why


def test_the_residual_shape_check_reads_the_profile_shapes_where_the_graph_has_none():
    model = _residual_model()
    del model.graph.value_info[:]  # as a dynamic-batch export leaves them: nothing concrete in the graph
    conv = _conv(model, "c1")
    assert conv_fusion(conv) == "bias"  # not provably the same shape: no residual epilogue
    assert conv_fusion(conv, shapes={"y1": X, "z": X}) == "bias+add+relu"
    assert conv_fusion(conv, shapes={"y1": X, "z": (1, 8, 6, 6)}) == "bias"


def test_the_pipeline_collects_each_convs_epilogue():
    """conftest's residual block as torch exports it (no shapes inside the graph; the residual is the
    graph input): the problems carry bias+relu and bias+add+relu."""
    from conftest import residual_block_model

    from convpass.compiler.pipeline import OptimizeReport, prepare_model

    model = ir.serde.deserialize_model(residual_block_model())
    problems = prepare_model(model, TuneOptions(engines="legacy"), [], OptimizeReport())
    assert sorted(p.fusion for p in problems) == ["bias+add+relu", RELU]


def test_a_relu_that_is_the_only_reader_is_the_epilogue_and_any_other_reader_leaves_the_bias():
    model = _residual_model()
    assert conv_fusion(_conv(model, "c0")) == RELU
    model.graph.node.append(helper.make_node("Identity", ["y0"], ["peek"], name="peek"))
    assert conv_fusion(_conv(model, "c0")) == "bias"


# ---------------------------------------------------------------------------------------------
# selection, the recorded time and cache completeness

BARE = [row("implicit_gemm", 0.020), row("implicit_precomp_gemm", 0.022), row(RELU, 0.006, method=EPILOGUE_METHOD)]


@pytest.mark.parametrize("fused_ms,winner", [(0.025, "implicit_gemm+bias+relu"), (0.027, "implicit_gemm"), (0.050, "implicit_gemm")])
def test_the_fused_call_wins_only_when_faster_than_the_conv_plus_its_pass(fused_ms, winner):
    rows = BARE + [row("implicit_gemm+bias+relu", fused_ms)]
    chosen = select(rows, PROBLEM, OPTIONS)
    assert chosen.algo == winner
    assert cost_ms(chosen, epilogue_ms(rows, PROBLEM), RELU) == pytest.approx(min(fused_ms, 0.026))
    assert choice_from(chosen, "measure", rows, PROBLEM).time_ms == pytest.approx(min(fused_ms, 0.026))  # the step's time is recorded


def _settling(monkeypatch, grouped, turns=(0.0685, 0.0682, 0.0690)):
    """A NumPy stand-in bench whose ``grouped`` rows kept their groups, and the head-to-head it asks
    for (each call's groups, in a list), answering ``turns``."""
    from convpass.tuning import harness

    bench = numpy_shape_bench(monkeypatch, SHAPE)
    bench._groups.update({(KEY, algo): (algo, 10, None) for algo in grouped})
    asked = []
    monkeypatch.setattr(harness, "head_to_head", lambda groups: (asked.append(groups), list(turns[:len(groups)]))[1])
    return bench, asked


# As on an H200: the bare conv read 4% low and its fused call 4% high in one timing each, so the
# bare conv + pass (0.0656 + 0.0031) beat the fused call (0.0712); in turn they take 0.0685 and 0.0682 ms.
CLOSE = [row("implicit_precomp_gemm", 0.0656), row("implicit_precomp_gemm+bias+relu", 0.0712), row(RELU, 0.0031, method=EPILOGUE_METHOD),
         row("implicit_gemm", 0.0900), row("gemm", 0.0800)]


def test_close_candidates_are_ordered_by_their_head_to_head(monkeypatch):
    """The two within 5% of the best by cost are replayed in turn; their times take that order at
    their first timings' mean, and the fused call wins. The others are left as they were."""
    bench, asked = _settling(monkeypatch, ["implicit_precomp_gemm", "implicit_precomp_gemm+bias+relu", "implicit_gemm", "gemm"])
    other = row("gemm", 0.0100, key=canonicalize_conv("Conv", {}, X, (8, 8, 1, 1)).shapes[0].key("nhwc", "default"))
    rows = CLOSE + [other]  # a row of another geometry: not this bench's
    assert select(rows, PROBLEM, OPTIONS).algo == "implicit_precomp_gemm"
    settled = bench.settle(rows, PROBLEM, OPTIONS)
    assert asked == [[("implicit_precomp_gemm", 10), ("implicit_precomp_gemm+bias+relu", 10)]]
    by = {m.algo: m for m in settled[:5]}
    level = (0.0656 + 0.0712) / (0.0685 + 0.0682)
    assert by["implicit_precomp_gemm"].time_ms == pytest.approx(0.0685 * level)
    assert by["implicit_precomp_gemm+bias+relu"].time_ms == pytest.approx(0.0682 * level)
    assert "timed again in turn with 1 close candidate(s)" in by["implicit_precomp_gemm"].note
    assert settled[2:] == rows[2:]
    assert select(settled, PROBLEM, OPTIONS).algo == "implicit_precomp_gemm+bias+relu"


def test_a_close_candidate_without_its_group_leaves_the_rows_as_they_are(monkeypatch):
    """A close candidate not timed in turn could not be weighed against those that were: one that
    kept no group (eager, over the workspace budget) or one read from the cache (``have``)."""
    close_gemm = [*CLOSE[:4], row("gemm", 0.0660)]  # 0.0660 + 0.0031 is within 5% of 0.0687
    bench, asked = _settling(monkeypatch, ["implicit_precomp_gemm", "implicit_precomp_gemm+bias+relu"])
    assert bench.settle(close_gemm, PROBLEM, OPTIONS) == close_gemm
    assert bench.settle(CLOSE[:4], PROBLEM, OPTIONS, have=[row("gemm", 0.0660)]) == CLOSE[:4]
    assert asked == []
    bench._groups[(KEY, "gemm")] = ("gemm", 10, None)  # with its group, the same rows are settled
    assert bench.settle(close_gemm, PROBLEM, OPTIONS) != close_gemm and len(asked[0]) == 3
    # alone within the margin: nothing to compare
    bench, asked = _settling(monkeypatch, ["implicit_precomp_gemm"])
    assert bench.settle(CLOSE, PROBLEM, OPTIONS) == CLOSE and asked == []


def test_only_candidates_the_options_allow_are_compared_at_most_three(monkeypatch):
    """With --deterministic a non-deterministic candidate is neither compared nor in the way; of
    four close ones the three best are compared, and the fastest of them stays at or below the
    fourth's first time."""
    nondet = Measurement(KEY, "winograd_nonfused", "ok", 0.0650, 0, False, 1.0, "measure")
    rows = [*CLOSE, nondet]
    bench, asked = _settling(monkeypatch, ["implicit_precomp_gemm", "implicit_precomp_gemm+bias+relu", "winograd_nonfused"])
    bench.settle(rows, PROBLEM, dataclasses.replace(OPTIONS, deterministic=True))
    assert asked == [[("implicit_precomp_gemm", 10), ("implicit_precomp_gemm+bias+relu", 10)]]
    four = [row("implicit_precomp_gemm", 0.0656), row("implicit_gemm", 0.0660), row("gemm", 0.0662), row("direct", 0.0664),
            row(RELU, 0.0031, method=EPILOGUE_METHOD)]
    bench, asked = _settling(monkeypatch, ["implicit_precomp_gemm", "implicit_gemm", "gemm", "direct"], turns=(0.070, 0.069, 0.068))
    settled = bench.settle(four, PROBLEM, OPTIONS)
    assert [a for a, _ in asked[0]] == ["implicit_precomp_gemm", "implicit_gemm", "gemm"] and settled[3] == four[3]
    assert min(m.time_ms for m in settled[:3]) <= four[3].time_ms


def test_a_full_timing_keeps_its_group_and_workspace_within_the_budget(monkeypatch):
    """What the head-to-head replays: the group of each candidate timed in full, with its workspace
    and launch kept alive; nothing for an early stop, nor past the geometry's workspace budget."""
    from convpass.tuning import harness

    bench = numpy_shape_bench(monkeypatch, SHAPE)
    bench._group_budget = 200
    timings = iter([harness.Timing(0.01, 50, 0.0, group="group a", group_launches=10),
                    harness.Timing(0.02, 5, 0.0, early_stop=True, stopped_by="estimate over 1.5x the best"),
                    harness.Timing(0.01, 50, 0.0, group="group c", group_launches=10),
                    harness.Timing(0.01, 50, 0.0, group="group d", group_launches=20)])
    monkeypatch.setattr(harness, "time_launches", lambda *args, **kwargs: next(timings))

    def conv(algo, ws):  # an execution object: what check_and_time reads of one
        def launch(x, w, y, workspace, bias=None, z=None):
            y[...] = bench.reference()

        return types.SimpleNamespace(key=KEY, algo=algo, workspace_bytes=ws, launch=launch, prepare_weight=lambda w: w)

    convs = {algo: conv(algo, ws) for algo, ws in (("a", 150), ("b", 0), ("c", 100), ("d", 50))}
    for c in convs.values():
        assert bench.check_and_time(c, True, 0.0, 0.01).status == "ok"
    assert set(bench._groups) == {(KEY, "a"), (KEY, "d")} and bench.group_bytes() == 200
    group, launches, (workspace, kept_conv, kept_launch) = bench._groups[(KEY, "a")]
    assert (group, launches, workspace.nbytes, kept_conv) == ("group a", 10, 150, convs["a"]) and callable(kept_launch)
    bench.release()
    assert bench._groups == {} and bench.group_bytes() == 0


def test_an_error_in_the_turns_keeps_the_first_timings(monkeypatch, caplog):
    from convpass.tuning import harness

    bench, _ = _settling(monkeypatch, ["implicit_precomp_gemm", "implicit_precomp_gemm+bias+relu"])

    def fails(groups):
        raise RuntimeError("cudaErrorLaunchFailure")

    monkeypatch.setattr(harness, "head_to_head", fails)
    assert bench.settle(CLOSE, PROBLEM, OPTIONS) == CLOSE
    assert "were not timed again in turn: cudaErrorLaunchFailure" in caplog.text


def test_a_fused_call_needs_its_problem_and_the_pass_timing():
    fast = row("implicit_gemm+bias+add+relu", 0.001)
    assert select(BARE + [fast], PROBLEM, OPTIONS).algo == "implicit_gemm"  # another epilogue
    no_pass = [r for r in BARE if r.method != EPILOGUE_METHOD] + [row("implicit_gemm+bias+relu", 0.001)]
    assert select(no_pass, PROBLEM, OPTIONS).algo == "implicit_gemm"


def test_an_unfused_engine_costs_its_own_time_under_a_legacy_epilogue():
    """Its timing ran its bias pass, the pass the executor widens to the whole epilogue."""
    rows = BARE + [row("engine:eng8", 0.023)]
    assert select(rows, PROBLEM, TuneOptions(tf32="on", layout="nhwc")).algo == "engine:eng8"  # 0.023 < 0.020 + 0.006


def test_the_heuristic_pick_runs_its_epilogue_the_measured_way():
    rows = BARE + [row("implicit_precomp_gemm", None, "heuristic", hr=0), row("implicit_precomp_gemm+bias+relu", 0.024)]
    options = TuneOptions(tf32="on", layout="nhwc", engines="legacy", fprop_algo="normal")
    assert select(rows, PROBLEM, options).algo == "implicit_precomp_gemm+bias+relu"  # 0.024 < 0.022 + 0.006


def test_a_forced_algorithm_may_run_its_fused_call():
    rows = BARE + [row("implicit_precomp_gemm+bias+relu", 0.024), row("implicit_gemm+bias+relu", 0.001)]
    assert select(rows, PROBLEM, TuneOptions(tf32="on", layout="nhwc", fprop_algo="implicit_precomp_gemm")).algo == "implicit_precomp_gemm+bias+relu"


def test_the_fused_calls_timed_are_the_fastest_bare_legacy_algorithms():
    rows = [row("gemm", 0.010), row("fft", 0.005, note="early stop: estimate over 4x"), row("implicit_gemm", 0.020),
            row("implicit_precomp_gemm", 0.030), row("engine:eng1", 0.001), row("direct", None, status="unsupported"),
            row("gemm+bias+relu", 0.001), row("winograd", 0.001, key=SHAPE.key("nchw", "default"))]
    assert tuner.fused_call_candidates(rows, KEY) == ["gemm", "implicit_gemm"][:epilogue.FUSED_CALL_CANDIDATES]


def test_a_late_stop_is_a_measurement_and_its_algorithm_may_be_fused():
    """A candidate stopped after two groups over 1.15x the best was measured (its fused call may
    still win: it saves the epilogue's pass); one stopped after its estimate was not."""
    late = row("implicit_gemm", 0.020, note="relative error 1e-04; 400 launches, spread 0.3%; stopped there, 2 groups over 1.15x the best (0.0100 ms)")
    early = row("fft", 0.030, note="relative error 1e-04; 5 launches, spread 0.0%; early stop: estimate over 1.5x the best (0.0100 ms)")
    assert tuner.was_measured(late) and not tuner.was_measured(early)
    assert tuner.fused_call_candidates([row("gemm", 0.010), late, early], KEY) == ["gemm", "implicit_gemm"][:epilogue.FUSED_CALL_CANDIDATES]


def test_the_cache_is_complete_for_a_legacy_epilogue_with_its_pass_and_a_fused_call_row():
    legacy = [row(a, 0.01 * (i + 1)) for i, a in enumerate(algo_names("fwd"))] + [row("implicit_gemm", None, method="heuristic", hr=0)]
    check = lambda rows: tuner.complete(rows, [KEY], "measure", None, True, False, RELU)  # noqa: E731
    assert tuner.complete(legacy, [KEY], "measure", None, True, False) and not check(legacy)
    assert not check(legacy + [row(RELU, 0.01, method=EPILOGUE_METHOD)])
    assert not check(legacy + [row("gemm+bias+relu", 0.01)])
    assert check(legacy + [row(RELU, 0.01, method=EPILOGUE_METHOD), row("gemm+bias+relu", None, status="unsupported")])
    # no legacy algorithm ran for the key: the pass row alone completes it
    none_ok = [row(a, None, status="unsupported") for a in algo_names("fwd")] + [row("implicit_gemm", None, method="heuristic", hr=0)]
    assert check(none_ok + [row(RELU, 0.01, method=EPILOGUE_METHOD)])


def test_a_cache_with_every_bare_row_gets_only_the_epilogue_measured(monkeypatch):
    from convpass.tuning import harness

    seen = []
    monkeypatch.setattr(harness, "warm_clocks", lambda: None)
    monkeypatch.setattr(tuner, "_measure", lambda problem, options, keys, strategy, forced, legacy, engines, best, fusion, have=(), **own: seen.append((legacy, fusion)) or [])
    have = [row(a, 0.01 * (i + 1)) for i, a in enumerate(algo_names("fwd"))] + [row("implicit_gemm", None, method="heuristic", hr=0)]
    tuner.measure_problem(PROBLEM, OPTIONS, have)  # bare rows cached: the epilogue only
    tuner.measure_problem(PROBLEM, OPTIONS, have + [row(RELU, 0.01, method=EPILOGUE_METHOD), row("gemm+bias+relu", 0.01)])
    assert seen == [(False, RELU), (False, "")]


# ---------------------------------------------------------------------------------------------
# the tuner's rows (NumPy stand-ins)

@pytest.fixture
def bench(monkeypatch):
    from convpass.kernels import conv_exec
    from convpass.native import cudnn
    from convpass.tuning import harness

    timings: list[float] = []

    def time_launches(launch, sets, best_ms=None, **_):
        launch(0)
        ms = timings.pop(0)
        return harness.Timing(ms, 10, 0.0, early_stop=best_ms is not None and ms > 4 * best_ms)

    def fused_call(descs, algo, x, w, y, bias, z=None, activation="relu", workspace=None):
        if algo == "gemm":
            raise cudnn.CudnnError(3000, "cudnnConvolutionBiasActivationForward")  # CUDNN_STATUS_NOT_SUPPORTED
        if activation == "identity" and algo != "implicit_precomp_gemm":
            raise ValueError("identity only with implicit_precomp_gemm")
        v = x.sum() + bias.reshape(1, -1, 1, 1) + (0 if z is None else z)
        y[...] = (np.maximum(v, 0) if activation == "relu" else v) + (1e3 if algo == "fft" else 0.0)  # fft: wrong

    monkeypatch.setattr(harness, "time_launches", time_launches)
    monkeypatch.setattr(cudnn, "conv_bias_activation_forward", fused_call)
    monkeypatch.setattr(cudnn, "workspace_size", lambda descs, handle, algo: 128)
    monkeypatch.setattr(conv_exec, "apply_epilogue", lambda cp, y, b, relu, z=None: None)
    bench = numpy_candidates(monkeypatch, SHAPE, maximum=np.maximum)
    bench.timings = timings
    return bench


@pytest.mark.parametrize("name", epilogue.LEGACY)
def test_a_legacy_epilogue_gets_its_pass_row_and_a_checked_row_per_fused_call(bench, name):
    residual, relu = epilogue.parts(name)
    bench.timings[:] = [0.004] + ([0.030] if relu else []) + [0.012]  # the pass, then the fused calls that run
    rows = bench.measure_legacy_epilogue(None, KEY, name, ["implicit_gemm", "implicit_precomp_gemm", "gemm", "fft"], 0.010)
    assert not bench.timings
    by = {r.algo: r for r in rows}
    assert by[name].method == EPILOGUE_METHOD and by[name].time_ms == 0.004
    gemm_row = by[str(Algo.parse("gemm").fused(name))]
    assert gemm_row.status == "unsupported" and gemm_row.algo.endswith(name)
    assert by[str(Algo.parse("fft").fused(name))].status == ("wrong_result" if relu else "unsupported")
    precomp = by[str(Algo.parse("implicit_precomp_gemm").fused(name))]
    assert precomp.status == "ok" and precomp.time_ms == 0.012 and "in one cuDNN call" in precomp.note and precomp.workspace_bytes == 128
    implicit = by[str(Algo.parse("implicit_gemm").fused(name))]
    assert implicit.status == ("ok" if relu else "unsupported")  # cuDNN's identity needs implicit_precomp_gemm
    assert ("z" in bench.bench.buffers(KEY.layout, 1)[0]) == residual


# ---------------------------------------------------------------------------------------------
# the tuned model and the executor

def test_a_tuned_model_records_the_fused_call_where_it_won(tmp_path):
    model = _residual_model()  # c0: bias+relu, c1: bias+add+relu, one problem key
    rows = [row("implicit_gemm", 0.020), row("implicit_gemm", None, "heuristic", hr=0),
            row(RELU, 0.006, EPILOGUE_METHOD), row("implicit_gemm+bias+relu", 0.010),  # c0: fused 0.010 < 0.026
            row("bias+add+relu", 0.008, EPILOGUE_METHOD), row("implicit_gemm+bias+add+relu", 0.040)]  # c1: 0.028 < 0.040
    cache = TuningCache(tmp_path / "c.db")
    cache.put(H200, rows)
    cache.close()
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", device_name=str(H200), quiet=True, tf32="on", layout="nhwc", engines="legacy")
    onnx.checker.check_model(tuned, full_check=True)
    records = {r["node"]: r for r in convpass.inspect(tuned)}
    assert {n: (r["algo"], r["fusion"], r["engine"]) for n, r in records.items()} == {
        "c0": ("implicit_gemm", RELU, None), "c1": ("implicit_gemm", None, None)}
    assert records["c0"]["time_ms"] == pytest.approx(0.010) and records["c1"]["time_ms"] == pytest.approx(0.028)  # conv + pass
    info, _ = annotation.read_annotations(tuned)
    assert info.schema_version == annotation.SCHEMA_VERSION


class _Rt:
    def __init__(self):
        self.cp, self.warned = None, []

    def warn_node(self, node, message):
        self.warned.append(message)


def _exec(fused_call, algo="implicit_gemm"):
    from convpass.kernels.conv_exec import LegacyConv
    from convpass.kernels.conv_resolve import ConvResolution

    conv = LegacyConv(KEY, Algo.parse(algo), "", None, descs="descs", workspace_bytes=0)
    return ConvResolution("c1", "Conv", None, conv, None, "recorded", fused_call=fused_call)


@pytest.mark.parametrize("fused_call,relu,residual,activation,warns", [
    (RELU, True, False, "relu", False),  # recorded fused call: cuDNN's fused call
    ("bias", False, False, "identity", False),
    ("bias+add+relu", True, True, "relu", False),
    ("", True, False, None, False),  # recorded unfused: the conv, then one pass
    (RELU, True, True, None, True),  # the plan's step differs from what was timed: said once
    (None, True, False, "relu", False),  # untuned: cuDNN's fused call, as frameworks run it
    (None, False, False, None, False),  # untuned: identity only with implicit_precomp_gemm
])
def test_the_executor_runs_the_epilogue_the_way_the_decision_recorded(fused_call, relu, residual, activation, warns):
    from convpass.kernels.convolution import Convolutions

    rt = _Rt()
    convs = Convolutions(rt)
    got = convs._fused_activation(_exec(fused_call), object(), relu, object() if residual else None)
    assert got == activation and bool(rt.warned) == warns
    if warns:
        assert "conv + bias+relu" in rt.warned[0] and "conv + bias+add+relu" in rt.warned[0]


def test_an_engine_beside_a_legacy_epilogue_builds_that_epilogue_s_fused_graph(monkeypatch):
    """An engine recorded beside a legacy epilogue is a configuration of that epilogue's fused
    graph (conv -> bias -> ReLU here): its plan is built for that graph, and no legacy fused call
    is recorded beside it."""
    from convpass.kernels.conv_resolve import ConvResolver
    from convpass.ops.conv import ConvCall

    seen = []
    monkeypatch.setattr(ConvResolver, "_engine_plan",
                        lambda self, node, key, config: seen.append(config) or types.SimpleNamespace(config=config, workspace_bytes=0))
    geometry = types.SimpleNamespace(op_type="Conv", spatial_rank=2)
    decision = annotation.ConvDecision(algo="implicit_gemm", engine="eng5", fusion=RELU)
    ex = ConvResolver(_Rt(), None)._engine_exec(ConvCall("c1", geometry, decision), decision, KEY)
    assert ex is not None and [c.fusion for c in seen] == [RELU] and ex.fused_call is None
    assert ex.conv.fused and ex.algo == "engine:eng5+" + RELU and ex.conv.counts == ("graph_api_calls", "fused_bias_relu")


@pytest.mark.parametrize("engine,fusion,complaint", [
    ("", RELU, None), ("", "", None), ("eng5", "bias+swish", None),
    ("", "bias+gelu", "names no legacy epilogue"), ("", "bias+swish", "names no legacy epilogue"),
    ("eng5", RELU, None),  # the engine's fused graph of that epilogue
])
def test_a_recorded_fusion_that_cannot_be_run_is_said(engine, fusion, complaint):
    """The executor warns (naming the node) about a fusion it cannot run as recorded; see odd_fusion."""
    from convpass.kernels.conv_resolve import odd_fusion

    got = odd_fusion(annotation.ConvDecision(algo="implicit_gemm", engine=engine, fusion=fusion))
    assert (got is None) if complaint is None else (complaint in got), got


@pytest.mark.parametrize("second_reader", [False, True])
def test_a_convtranspose_takes_its_only_reader_relu_into_its_bias_pass(second_reader):
    """cuDNN's backward data has no fused bias call: the bias is one element-wise pass after it, and
    a Relu that is the only reader of the ConvTranspose joins that pass (its step is absorbed)."""
    from convpass.kernels.convolution import lower_convs
    from convpass.runtime.executor import Executor

    n = helper.make_node
    nodes = [n("ConvTranspose", ["X", "W", "B"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]), n("Relu", ["c"], ["Y"])]
    outputs = [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, (1, 3, 10, 10))]
    if second_reader:
        nodes.append(n("Neg", ["c"], ["Z"]))
        outputs.append(helper.make_tensor_value_info("Z", onnx.TensorProto.FLOAT, (1, 3, 10, 10)))
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 4, 4)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "B")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, (1, 4, 5, 5))], outputs, initializer=inits)
    ex = Executor(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), device="cpu")
    ex.run(None, {"X": rng.standard_normal((1, 4, 5, 5)).astype(np.float32)})
    (launch,) = lower_convs(ex.last_plan, None, fuse=True, fuse_residual=True).values()
    if second_reader:
        assert (launch.label, launch.epilogue, launch.absorbs) == ("ConvTranspose", None, ())
    else:
        assert (launch.label, launch.epilogue, launch.absorbs) == ("ConvTranspose+relu", "relu", (1,))
    (unfused,) = lower_convs(ex.last_plan, None, fuse=False, fuse_residual=False).values()
    assert unfused.epilogue is None


@pytest.mark.parametrize("fusion", ["", "bias+swish"])
def test_an_engine_recorded_without_a_legacy_algorithm_runs_its_engine(monkeypatch, fusion):
    """An engine whose legacy fallback was not measured is recorded with ``algo == "auto"`` beside
    its engine (annotate_convs.decision_for): it runs its engine, not cuDNN's heuristic as if it were
    untuned; a decision without an engine still runs the heuristic."""
    from convpass.kernels.conv_resolve import ConvResolver
    from convpass.ops.conv import ConvCall

    built, heuristic = [], []
    monkeypatch.setattr(ConvResolver, "_engine_plan",
                        lambda self, node, key, config: built.append(config) or types.SimpleNamespace(config=config, workspace_bytes=0))
    monkeypatch.setattr(ConvResolver, "heuristic_exec",
                        lambda self, call, source, note, math="default": heuristic.append(source) or "heuristic")
    rt = _Rt()
    rt.recorded_device, rt.current_device, rt.note_once = "", None, lambda tag, message: rt.warned.append(message)
    geometry = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, X, (8, 8, 3, 3))
    decision = annotation.ConvDecision(engine="eng5", fusion=fusion, memory_format="nhwc", math_mode="default", problem_key=str(KEY))
    assert decision.algo == annotation.AUTO and not decision.is_auto
    ex = ConvResolver(rt, None)._make_exec(ConvCall("c1", geometry, decision), np.float32, fusion)
    assert ex != "heuristic" and ex.source == "recorded" and ex.engine is not None, heuristic
    assert [c.fusion for c in built] == [fusion] and not rt.warned and not heuristic
    untuned = annotation.ConvDecision(memory_format="nhwc", math_mode="default", problem_key=str(KEY))
    assert ConvResolver(rt, None)._make_exec(ConvCall("c1", geometry, untuned), np.float32, fusion) == "heuristic"
    assert heuristic == ["untuned"] and not rt.warned


@pytest.mark.parametrize("fma_usable", [True, False])
def test_the_heuristic_says_when_it_cannot_keep_the_math_asked_for(monkeypatch, fma_usable):
    """An untuned conv of a --tf32 off model asks cuDNN's heuristic for FMA math; where none of its
    algorithms is usable under FMA it runs under default math (TF32 allowed), and says so."""
    from convpass.kernels import conv_resolve
    from convpass.ops.conv import ConvCall

    class Resources:
        def descriptors(self, key):
            if key.math == "fma" and not fma_usable:
                raise ValueError("no FMA descriptors")
            return key.math

        def workspace_bytes(self, key, algo):
            return 0

    monkeypatch.setattr(conv_resolve.cudnn, "heuristic", lambda descs: [types.SimpleNamespace(ok=True, algo="implicit_gemm")])
    monkeypatch.setattr(conv_resolve, "conv_exec", lambda key, algo, **kw: types.SimpleNamespace(key=key, algo=algo))
    rt = _Rt()
    geometry = types.SimpleNamespace(op_type="Conv", spatial_rank=2, shapes=[SHAPE])
    got = conv_resolve.ConvResolver(rt, Resources()).heuristic_exec(ConvCall("c1", geometry, None), "untuned", "", "fma")
    assert got.conv.key.math == ("fma" if fma_usable else "default")
    assert bool(rt.warned) is not fma_usable
    if not fma_usable:
        assert "'c1'" in rt.warned[0] and "under fma math" in rt.warned[0] and "TF32 allowed" in rt.warned[0]

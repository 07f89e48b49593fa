"""The legacy conv epilogues (``bias``, ``bias+relu``, ``bias+add``, ``bias+add+relu``) inside a
graph-API engine's call, on the CPU: the names and their round trips (older names read as they
did), the operation graph the frontend is given for each epilogue (stood in for), the graphs'
math in float64, the tuner's rows (stand-ins: no timing invented) and its choice among the fused
graph, the bare engine with its one pass and the legacy space, a model tuned from a cache, and the
executor's lowering and launch: the engine's one call, no epilogue pass after it."""

from __future__ import annotations

import collections
import json
import re
import sys
import types

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import epilogue_block_model, fake_cuda, numpy_candidates, offer_configs, residual_block_model, run_ort
from onnx import helper

import convpass
from convpass.compiler.passes.canonicalize_convs import canonicalize_conv
from convpass.compiler.passes.collect_conv_problems import ConvProblem, conv_fusion
from convpass.core import annotation
from convpass.core.algo import Algo
from convpass.core.cudnn_enums import algo_names
from convpass.core.device import DeviceFingerprint
from convpass.core.fusion import LEGACY, is_engine_fusion, is_graph_fusion, parts, takes_residual
from convpass.core.options import TuneOptions
from convpass.kernels import conv_exec
from convpass.kernels.conv_resolve import odd_fusion
from convpass.native.cudnn import graph_api
from convpass.native.cudnn.graph_api import EngineConfig, GraphApiError
from convpass.runtime.summaries import _engine_algo
from convpass.tuning import tuner
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.decide import EPILOGUE_METHOD, bias_ms, choice_from, cost_ms, epilogue_ms, select

H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)
X = (2, 16, 14, 14)  # residual_block_model's input; both its convs are this problem
SHAPE = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, X, (16, 16, 3, 3)).shapes[0]
KEY = SHAPE.key("nhwc", "default")
R, F = "bias+relu", "bias+add+relu"
FUSED = "engine:eng5_k2=1+" + F


def row(algo, time_ms, method="measure", status="ok", key=KEY, hr=None):
    return Measurement(key, algo, status, time_ms, 0, True, 1.0, method, heuristic_rank=hr)


# ---------------------------------------------------------------------------------------------
# names

@pytest.mark.parametrize("name", LEGACY)
def test_a_legacy_epilogue_names_an_engine_s_fused_graph_and_reads_back(name):
    residual, relu = parts(name)
    text = "engine:eng5_k2=1+" + name
    algo = Algo.parse(text)
    assert algo == Algo("engine", "eng5_k2=1", name) and str(algo) == text and algo.bare == Algo("engine", "eng5_k2=1")
    config = EngineConfig.parse(text)
    assert (config.engine_id, config.knobs, config.fusion, config.algo) == (5, ((2, 1),), name, text)
    assert EngineConfig.parse("eng5_k2=1", name) == config  # the annotation's engine and fusion attributes
    assert is_engine_fusion(name) and not is_graph_fusion(name) and takes_residual(name) == residual
    f = graph_api.fusion_of(name)
    assert (f.frontend_op, f.residual_first, f.residual, f.takes_z) == ("relu" if relu else "", residual, False, residual)
    assert f.counter == "fused_" + name.replace("+", "_") and f.counter in graph_api.FUSION_COUNTERS
    # the legacy fused call, the one-pass row and the row of a graph cuDNN offers nothing for keep their names
    assert Algo.parse("implicit_gemm+" + name) == Algo("legacy", "implicit_gemm", name) and Algo.parse(name) == Algo("pass", name)
    assert Algo.parse("engine:none+" + name) == Algo("engine", "none", name)


def test_older_names_read_as_they_did_and_malformed_ones_are_refused():
    assert EngineConfig.parse("engine:eng67_k2=16_k13=0") == EngineConfig(67, ((2, 16), (13, 0)))  # a bare engine: one pass after it
    assert EngineConfig.parse("engine:eng5+bias+swish").fusion == "bias+swish"
    assert EngineConfig.parse("engine:eng5+bias+leakyrelu0.2+add").fusion == "bias+leakyrelu0.2+add"
    for bad in ("engine:eng5+relu", "engine:eng5+add", "engine:eng5+bias+relu+add", "engine:eng5+bias+add+relu+add", "engine:eng5+add+bias"):
        with pytest.raises(ValueError, match="not a cuDNN engine configuration"):
            EngineConfig.parse(bad)
    with pytest.raises(ValueError, match="names the fusion"):
        EngineConfig.parse(FUSED, R)
    assert not takes_residual(R) and takes_residual("bias+add") and takes_residual("bias+swish+add") and not takes_residual(None)


def test_the_annotation_says_whether_the_epilogue_runs_in_the_engine_s_call():
    """``engine`` with ``fusion`` = the fused graph (the epilogue in the call); ``engine`` alone =
    the bare conv and one pass after it (every model recorded before); ``fusion`` alone = the legacy
    fused call."""
    decisions = [annotation.ConvDecision(algo="implicit_gemm", engine="eng5_k2=1", fusion=F),
                 annotation.ConvDecision(algo="implicit_gemm", engine="eng5_k2=1"),
                 annotation.ConvDecision(algo="implicit_gemm", fusion=F)]
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], domain=annotation.DOMAIN, **annotation.decision_attributes(decisions))
    read = annotation.read_node(node, n_profiles=3).decisions
    assert [(d.engine, d.fusion) for d in read] == [("eng5_k2=1", F), ("eng5_k2=1", ""), ("", F)]
    assert [_engine_algo(d.engine, d.fusion) for d in read[:2]] == [FUSED, "engine:eng5_k2=1"]
    assert [odd_fusion(d) for d in read] == [None, None, None]


@pytest.mark.parametrize("graph_fusions", [True, False])
def test_the_gpu_tests_block_has_one_conv_per_epilogue(graph_fusions):
    """tests/gpu/test_engine_epilogues_gpu.py's block: its convs' steps, by the one rule
    (:func:`convpass.core.fusion.absorbed`), are bias, bias+relu and bias+add+relu, engines or not."""
    model = onnx.shape_inference.infer_shapes(epilogue_block_model())
    nodes = {n.name: n for n in ir.serde.deserialize_model(model).graph if n.op_type == "Conv"}
    assert {name: conv_fusion(node, graph_fusions) for name, node in nodes.items()} == {"c0": "bias", "c1": R, "c2": F}


# ---------------------------------------------------------------------------------------------
# the operation graph the graph API is given (the frontend stood in for)

GRAPHS = {"bias": ["conv", "bias"], R: ["conv", "bias", "relu"], "bias+add": ["conv", "bias", "add"], F: ["conv", "bias", "add", "relu"]}


def _arr(ptr, nbytes=64):
    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr), nbytes=nbytes)


@pytest.mark.parametrize("name", LEGACY)
def test_the_frontend_is_given_each_epilogue_s_graph_with_z_before_the_relu(frontend, name):
    from convpass.native.cudnn.descriptors import descriptor_params

    residual, relu = parts(name)
    plan = graph_api.EnginePlan(KEY, EngineConfig.parse("eng5", name))
    p = descriptor_params(KEY)
    k = p.y.dims[1]
    ops = [c for c in frontend.calls if c[0] in ("conv", "bias", "add", "relu", "swish", "leaky_relu")]
    assert [c[0] for c in ops] == GRAPHS[name]
    assert [c[1] for c in frontend.calls if c[0] == "tensor"] == ["x", "w", "b"] + (["z"] if residual else [])
    assert ("tensor", "b", (1, k, 1, 1), (k, 1, k, k)) in frontend.calls and ("bias", 4) in ops  # b, broadcast per channel
    if residual:
        assert ("tensor", "z", tuple(p.y.dims), tuple(p.y.strides)) in frontend.calls  # z: the output's dims and (NHWC) strides
        assert ("add", 5, 8) in ops  # conv + b, then + z
    if relu:
        assert ops[-1] == ("relu", 7 if residual else 5)  # the ReLU reads the sum with z: ResNet's order
    z = {"z": _arr(500)} if residual else {}
    plan.execute(_arr(100), _arr(200), _arr(300), _arr(900), bias=_arr(400), **z)
    assert frontend.calls[-1] == ("execute", "eng5", (100, 200, 300, 400) + ((500,) if residual else ()), 900)
    with pytest.raises(GraphApiError, match="takes a residual z" if residual else "takes no residual z"):
        plan.execute(_arr(100), _arr(200), _arr(300), _arr(900), bias=_arr(400), **({} if residual else {"z": _arr(500)}))
    with pytest.raises(GraphApiError, match="takes a bias"):
        plan.execute(_arr(100), _arr(200), _arr(300), _arr(900), **z)
    if residual:
        with pytest.raises(GraphApiError, match="must not alias"):
            plan.execute(_arr(100), _arr(200), _arr(300), _arr(900), bias=_arr(400), z=_arr(332))  # overlaps y


def test_the_bare_graph_has_no_epilogue(frontend):
    plan = graph_api.EnginePlan(KEY, EngineConfig.parse("eng5"))
    assert [c[0] for c in frontend.calls if c[0] in ("conv", "bias", "add", "relu")] == ["conv"]
    plan.execute(_arr(100), _arr(200), _arr(300), _arr(900))
    with pytest.raises(GraphApiError, match="takes no bias"):
        plan.execute(_arr(100), _arr(200), _arr(300), _arr(900), bias=_arr(400))


def test_a_stored_plan_of_an_epilogue_s_graph_loads_with_its_tensors_and_nothing_else(frontend):
    for name, uids in ((F, 5), (R, 4)):
        config = EngineConfig.parse("eng5", name)
        data = graph_api.EnginePlan(KEY, config).serialize(verify=False)
        head, _, blob = data.partition(b"\n")
        header = json.loads(head)
        assert len(header["uids"]) == uids and header["algo"] == "engine:eng5+" + name  # x, w, y, the bias (, z)
        graph_api.EnginePlan.load(KEY, config, data).execute(_arr(100), _arr(200), _arr(300), _arr(900), bias=_arr(400),
                                                            **({"z": _arr(500)} if name == F else {}))
        header["uids"] = header["uids"][:4] if name == F else header["uids"] + [9]
        with pytest.raises(GraphApiError, match="no residual tensor" if name == F else "a residual tensor"):
            graph_api.EnginePlan.load(KEY, config, json.dumps(header, sort_keys=True).encode() + b"\n" + blob)


# ---------------------------------------------------------------------------------------------
# the graphs' math (float64)

def test_each_graph_adds_z_before_the_relu():
    rng = np.random.default_rng(3)
    pre, z = rng.standard_normal((2, 4, 5, 5)), rng.standard_normal((2, 4, 5, 5))
    want = {"bias": pre, R: np.maximum(pre, 0), "bias+add": pre + z, F: np.maximum(pre + z, 0)}
    for name in LEGACY:
        got = graph_api.fusion_of(name).reference(np, pre, z if takes_residual(name) else None)
        np.testing.assert_array_equal(got, want[name])
        assert got is not pre  # a new array
    assert np.abs(want[F] - (np.maximum(pre, 0) + z)).max() > 1e-2  # not the order of an activation's +add
    with pytest.raises(ValueError, match="needs its residual"):
        graph_api.fusion_of(F).reference(np, pre)


# ---------------------------------------------------------------------------------------------
# the tuner's rows (stand-ins: the "times" are the fakes' numbers; statuses and checks are tested)

class _EpiloguePlan:
    """Configurations of a legacy epilogue's graph: 1 right, 2 adds z after the ReLU (the wrong
    order), 3 not buildable."""

    def __init__(self, key, config, enumerated=None):
        if config.engine_id == 3:
            raise GraphApiError(f"cuDNN does not build eng3 ({config.fusion}): NOT_SUPPORTED")
        self.config, self.workspace_bytes = config, 0

    def execute(self, x, w, y, workspace=None, bias=None, z=None):
        residual, relu = parts(self.config.fusion)
        assert bias is not None and (z is not None) == residual and (z is None or (z.shape == y.shape and z is not y))
        pre = x.sum() + bias.reshape(1, -1, 1, 1)
        if self.config.engine_id == 1:
            v = pre + z if residual else pre
            y[...] = np.maximum(v, 0) if relu else v
        else:
            v = np.maximum(pre, 0) if relu else pre
            y[...] = v + z if residual else v


@pytest.fixture
def epilogue_bench(monkeypatch):
    from convpass.tuning import harness

    monkeypatch.setattr(graph_api, "EnginePlan", _EpiloguePlan)
    offer_configs(monkeypatch, lambda key, fusion="": [EngineConfig(i, (), fusion) for i in (1, 2, 3)])
    monkeypatch.setattr(harness, "time_launches",
                        lambda launch, sets, best_ms=None, **_: (launch(0), harness.Timing(0.004, 10, 0.0, early_stop=False, eager=False))[1])
    # conv + bias just below 0 (x.sum() = -0.3, b = 0.25), z (0.25) moves it across 0: the ReLU's
    # place in the graph decides the result
    bench = numpy_candidates(monkeypatch, SHAPE, fill=0.25, x_value=-0.3 / np.prod(SHAPE.x_shape), maximum=np.maximum)
    bench.bench._base["y"].fill(0)  # the passes run over it first: no garbage (NaN) to add
    return bench


def test_a_legacy_epilogue_s_engine_rows_are_its_passes_and_every_configuration_checked(epilogue_bench):
    key = SHAPE.key("nchw", "default")
    rows = epilogue_bench.measure_engine_epilogue(key, F, best_ms=0.02)
    assert [(r.algo, r.method, r.status) for r in rows] == [
        (F, EPILOGUE_METHOD, "ok"), ("bias", EPILOGUE_METHOD, "ok"),  # the pass after a bare engine; the one its time holds
        ("engine:eng1+" + F, "measure", "ok"), ("engine:eng2+" + F, "measure", "wrong_result"), ("engine:eng3+" + F, "measure", "unsupported")]
    assert f"fused {F} in one call" in rows[2].note and "NOT_SUPPORTED" in rows[4].note
    again = epilogue_bench.measure_engine_epilogue(key, F, best_ms=None, have=rows[:2])  # the passes measured already
    assert [r.algo for r in again] == ["engine:eng1+" + F, "engine:eng2+" + F, "engine:eng3+" + F]
    bias_only = epilogue_bench.measure_engine_epilogue(key, "bias", best_ms=None)
    assert [(r.algo, r.status) for r in bias_only] == [("bias", "ok"), ("engine:eng1+bias", "ok"), ("engine:eng2+bias", "ok"),
                                                       ("engine:eng3+bias", "unsupported")]  # no z, no ReLU: both orders agree


def test_a_pruning_plan_orders_and_cuts_the_graph_s_configurations_as_the_bare_ones(epilogue_bench):
    order = lambda algos: ([algos[0]], [(a, "pruned: never won") for a in algos[1:]])  # noqa: E731
    rows = epilogue_bench.measure_engine_epilogue(SHAPE.key("nchw", "default"), F, best_ms=None, order=order)
    assert [(r.algo, r.status) for r in rows[2:]] == [("engine:eng2+" + F, "skipped"), ("engine:eng3+" + F, "skipped"), ("engine:eng1+" + F, "ok")]
    assert all(r.note.startswith("pruned") for r in rows[2:4])


def test_no_engine_for_the_epilogue_s_graph_is_a_row_saying_so(epilogue_bench, monkeypatch):
    def refuse(key, fusion=""):
        raise GraphApiError("cuDNN's graph API has no engine for this")

    offer_configs(monkeypatch, refuse)
    rows = epilogue_bench.measure_engine_epilogue(SHAPE.key("nchw", "default"), R, best_ms=None)
    assert [(r.algo, r.status) for r in rows] == [(R, "ok"), ("bias", "ok"), ("engine:none+" + R, "unsupported")]


def _legacy_rows(key=KEY):
    return [row(a, 0.02 + 0.001 * i, key=key) for i, a in enumerate(algo_names("fwd"))] + [row("implicit_gemm", None, "heuristic", key=key, hr=0)]


def test_the_tuner_measures_an_epilogue_s_engine_graphs_until_the_cache_holds_them(monkeypatch):
    from convpass.tuning import harness

    monkeypatch.setattr(graph_api, "unavailable", lambda: None)
    monkeypatch.setattr(harness, "warm_clocks", lambda: None)
    problem, options = ConvProblem((SHAPE,), F), TuneOptions(tf32="on", layout="nhwc")
    have = _legacy_rows() + [row(F, 0.012, EPILOGUE_METHOD), row("implicit_gemm+" + F, 0.03), row("engine:eng8", 0.018)]
    full = [row("bias", 0.004, EPILOGUE_METHOD), row("engine:none+" + F, None, status="unsupported")]
    assert tuner.problem_complete(have + full, problem, options)
    for missing in full:
        assert not tuner.problem_complete(have + [r for r in full if r is not missing], problem, options), missing.algo
    assert tuner.problem_complete(have, problem, TuneOptions(tf32="on", layout="nhwc", engines="legacy"))  # no engines: nothing more
    seen = []
    monkeypatch.setattr(tuner, "_measure", lambda problem, options, keys, strategy, forced, legacy, engines, best, fusion, have=(), **kw:
                        seen.append((legacy, engines, fusion, kw["engine_fusion"])) or [])
    tuner.measure_problem(problem, options, have)
    tuner.measure_problem(problem, options, have + full)
    assert seen == [(False, False, "", F), (False, False, "", "")]  # only what is missing: the engine graphs, then nothing


# ---------------------------------------------------------------------------------------------
# the choice: the fused graph, the bare engine with its pass, the legacy space

PROBLEM = ConvProblem((SHAPE,), F)
OPTIONS = TuneOptions(tf32="on", layout="nhwc")
# costs: implicit_gemm 0.020 + 0.012; its fused call 0.030; eng8 timed with its bias pass, which
# the epilogue's pass replaces: 0.018 - 0.004 + 0.012 = 0.026
BASE = [row("implicit_gemm", 0.020), row("implicit_gemm+" + F, 0.030), row("engine:eng8", 0.018),
        row(F, 0.012, EPILOGUE_METHOD), row("bias", 0.004, EPILOGUE_METHOD)]


@pytest.mark.parametrize("extra,winner,cost", [
    ([row(FUSED, 0.020)], FUSED, 0.020),  # the fused graph wins: its own time
    ([row(FUSED, 0.028)], "engine:eng8", 0.026),  # it loses to the bare engine and its pass
    ([row("engine:none+" + F, None, status="unsupported")], "engine:eng8", 0.026),  # not offered: "does not apply", a value
])
def test_the_fused_graph_is_weighed_against_the_bare_engine_and_its_pass(extra, winner, cost):
    rows = BASE + extra
    chosen = select(rows, PROBLEM, OPTIONS)
    assert chosen.algo == winner
    assert cost_ms(chosen, epilogue_ms(rows, PROBLEM), F, bias=bias_ms(rows, PROBLEM)) == pytest.approx(cost)
    assert choice_from(chosen, "measure", rows, PROBLEM).time_ms == pytest.approx(cost)


def test_each_form_is_costed_only_with_the_passes_it_needs():
    old = [r for r in BASE if r.algo != "bias"]  # a cache filled before: the bare engine costs its own time, as it did
    assert cost_ms(row("engine:eng8", 0.018), epilogue_ms(old, PROBLEM), F, bias=bias_ms(old, PROBLEM)) == pytest.approx(0.018)
    assert select(old + [row(FUSED, 0.020)], PROBLEM, OPTIONS).algo == "engine:eng8"
    no_pass = [r for r in BASE if r.algo != F] + [row(FUSED, 0.001)]
    assert select(no_pass, PROBLEM, OPTIONS).algo == "engine:eng8"  # no pass row: the fused graph is not comparable
    assert select(BASE + [row("engine:eng5+" + R, 0.001)], PROBLEM, OPTIONS).algo == "engine:eng8"  # another epilogue's graph
    legacy_only = TuneOptions(tf32="on", layout="nhwc", engines="legacy")
    assert select(BASE + [row(FUSED, 0.001)], PROBLEM, legacy_only).algo == "implicit_gemm+" + F
    marked = BASE + [row("engine:none+" + F, None, status="unsupported")]  # the engine-epilogue tuner went through the key
    assert bias_ms(marked, PROBLEM) == {KEY: 0.004} and bias_ms(marked, ConvProblem((SHAPE,), "bias+swish")) == {}
    # a bias row without that mark (an older cache, where a sibling bias problem of the key left
    # it): the bare engine is costed as before, its own time
    assert bias_ms(BASE, PROBLEM) == {}
    assert cost_ms(row("engine:eng8", 0.018), epilogue_ms(BASE, PROBLEM), F, bias=bias_ms(BASE, PROBLEM)) == pytest.approx(0.018)
    assert cost_ms(row("implicit_gemm", 0.020), epilogue_ms(BASE, PROBLEM), F, bias=bias_ms(BASE, PROBLEM)) == pytest.approx(0.032)


# ---------------------------------------------------------------------------------------------
# a model tuned from a cache, and what its executor runs

def _tuned(tmp_path, relu_ms, add_ms):
    """residual_block_model (conv1: bias+relu, conv2: bias+add+relu; one key) tuned from a cache:
    the legacy rows, the passes, a bare engine (0.018 with its bias pass: 0.020 with the ReLU's
    pass, 0.022 with the residual one) and the fused graphs at ``relu_ms`` / ``add_ms`` (None:
    cuDNN offers none)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    rows = [row("implicit_gemm", 0.020), row("implicit_gemm", None, "heuristic", hr=0), row("engine:eng8", 0.018),
            row("bias", 0.008, EPILOGUE_METHOD), row(R, 0.010, EPILOGUE_METHOD), row(F, 0.012, EPILOGUE_METHOD)]
    for name, ms in ((R, relu_ms), (F, add_ms)):
        rows.append(row("engine:none+" + name, None, status="unsupported") if ms is None else row("engine:eng5_k2=1+" + name, ms))
    cache = TuningCache(tmp_path / "c.db")
    cache.put(H200, rows)
    cache.close()
    return convpass.optimize(residual_block_model(), cache=tmp_path / "c.db", device_name=str(H200), quiet=True, tf32="on", layout="nhwc")


@pytest.mark.parametrize("relu_ms,add_ms,recorded", [
    (0.015, 0.016, {"conv1": ("eng5_k2=1", R, 0.015), "conv2": ("eng5_k2=1", F, 0.016)}),  # fused graphs win
    (0.030, 0.030, {"conv1": ("eng8", "", 0.020), "conv2": ("eng8", "", 0.022)}),  # they lose: bare engine + pass
    (None, 0.016, {"conv1": ("eng8", "", 0.020), "conv2": ("eng5_k2=1", F, 0.016)}),  # none offered for conv1's graph
])
def test_a_tuned_model_records_where_the_epilogue_runs_and_computes_the_ops(tmp_path, relu_ms, add_ms, recorded):
    tuned = _tuned(tmp_path, relu_ms, add_ms)
    onnx.checker.check_model(tuned, full_check=True)
    records = {r["node"]: (r["engine"], r["fusion"] or "", r["time_ms"]) for r in convpass.inspect(tuned)}
    assert records.keys() == recorded.keys()
    for node, (engine, fusion, ms) in recorded.items():
        assert records[node][:2] == (engine, fusion) and records[node][2] == pytest.approx(ms), node
    x = np.random.default_rng(5).standard_normal((2, 16, 14, 14)).astype(np.float32)
    want = run_ort(residual_block_model(), {"x": x})[0]
    np.testing.assert_allclose(convpass.Executor(tuned, device="cpu").run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(run_ort(tuned, {"x": x})[0], want, rtol=1e-5, atol=1e-5)  # the annotated model still runs in ONNX Runtime


def _plan(tuned):
    from convpass.runtime import Executor

    ex = Executor(tuned, device="cpu")
    ex.run(None, {"x": np.zeros((2, 16, 14, 14), np.float32)})
    [plan] = ex._plans.values()
    return plan


@pytest.mark.parametrize("fused", [True, False])
def test_the_lowering_gives_each_launch_its_epilogue_and_the_decision_s_engine(tmp_path, convs, fused):
    from convpass.kernels.convolution import lower_convs

    plan = _plan(_tuned(tmp_path, 0.015 if fused else 0.030, 0.016 if fused else 0.030))
    names = {i: st.node.name for i, st in enumerate(plan.steps)}
    index = {n: i for i, n in names.items()}
    launches = {names[i]: launch for i, launch in lower_convs(plan, convs, fuse=True, fuse_residual=True).items()}
    c1, c2 = launches["conv1"], launches["conv2"]
    x_slot = plan.steps[index["conv1"]].inputs[0]
    assert (c1.epilogue, c1.fusion, [names[k] for k in c1.absorbs]) == ("relu", R, ["relu1"])
    assert (c2.epilogue, c2.fusion, [names[k] for k in c2.absorbs]) == (("residual", x_slot, "relu"), F, ["add", "relu2"])
    assert c2.outputs == (plan.steps[index["relu2"]].outputs[0],)
    for launch, name in ((c1, R), (c2, F)):
        ex = convs.resolve(launch.call, np.float32, launch.fusion)
        if fused:
            assert ex.algo == "engine:eng5_k2=1+" + name and ex.conv.fused and ex.conv.counts == ("graph_api_calls", "fused_" + name.replace("+", "_"))
        else:  # the bare engine, as every model recorded before: the epilogue as one pass after it
            assert ex.algo == "engine:eng8" and not ex.conv.fused
    assert convs.warned == []
    off = lower_convs(plan, convs, fuse=True, fuse_residual=False)[index["conv2"]]  # residual fusion off: conv2's step is bias only
    assert (off.epilogue, off.fusion) == (None, "bias")
    ex = convs.resolve(off.call, np.float32, off.fusion)
    if fused:  # the recorded graph is not this plan's step: said, and the legacy algorithm runs with one pass
        assert ex.algo == "implicit_gemm" and any(f"fused graph conv + {F}" in m for m in convs.warned)
    else:
        assert ex.algo == "engine:eng8"


# the launch itself, over NumPy (cuDNN and the frontend stood in for)

class _NumpyEnginePlan:
    """An engine plan computing its graph with the reference conv: what it was given is recorded."""

    executed: list = []

    def __init__(self, key, config, enumerated=None):
        self.config, self.workspace_bytes = config, 0

    def execute(self, x, w, y, workspace=None, bias=None, z=None):
        from convpass.ops.conv import conv_reference

        _NumpyEnginePlan.executed.append((self.config.algo, bias is not None, z is not None))
        v = conv_reference(np, np.ascontiguousarray(x), w, None, _geometry())
        if self.config.fusion:
            v = graph_api.fusion_of(self.config.fusion).reference(np, v + bias.reshape(1, -1, 1, 1), z)
        y[...] = v


def _geometry():
    from convpass.ops.conv import conv_geometry

    return conv_geometry("Conv", {"pads": [1, 1, 1, 1]}, X, (16, 16, 3, 3))


@pytest.fixture
def numpy_convs(monkeypatch):
    """The executor's conv family over NumPy: CuPy's arrays, the engine plans and the epilogue
    pass stood in for (each pass recorded in ``.passes``)."""
    from conftest import no_plan_side_car, numpy_epilogue_kernel

    from convpass.kernels.convolution import Convolutions
    from convpass.native import cudnn

    fake_cp = types.ModuleType("cupy")
    fake_cp.empty, fake_cp.uint8, fake_cp.ascontiguousarray, fake_cp.maximum = np.empty, np.uint8, np.ascontiguousarray, np.maximum
    fake_cp.cuda = fake_cuda([])
    monkeypatch.setitem(sys.modules, "cupy", fake_cp)
    monkeypatch.setattr(graph_api, "EnginePlan", _NumpyEnginePlan)
    monkeypatch.setattr(_NumpyEnginePlan, "executed", [])
    no_plan_side_car(monkeypatch)
    monkeypatch.setattr(cudnn, "ConvDescriptors", lambda key: types.SimpleNamespace(key=key))
    monkeypatch.setattr(cudnn, "workspace_size", lambda descs, direction, algo, **strides: 0)
    passes = []
    monkeypatch.setattr(conv_exec, "epilogue_kernel", lambda cp, *flags, **kw: passes.append(flags) or numpy_epilogue_kernel(cp, *flags))
    rt = types.SimpleNamespace(cp=fake_cp, fuse=True, counters=collections.Counter(), capturing=False, recorded_device="", current_device=None,
                               device_id=0, is_constant=lambda a: False, warn_node=lambda node, m: pytest.fail(m), note_once=lambda *a, **kw: None)
    convs = Convolutions(rt)
    convs.passes = passes  # type: ignore[attr-defined]
    return convs


def _call(engine, fusion):
    from convpass.ops.conv import ConvCall

    d = annotation.ConvDecision(algo="implicit_gemm", engine=engine, fusion=fusion, memory_format="NHWC", math_mode="default", problem_key=str(KEY))
    return ConvCall("conv2", _geometry(), d)


def _nhwc(a):
    out = np.empty((a.shape[0], *a.shape[2:], a.shape[1]), a.dtype).transpose(0, 3, 1, 2)
    out[...] = a
    return out


@pytest.mark.parametrize("name", LEGACY)
def test_a_fused_decision_runs_its_step_in_the_engine_s_one_call_and_no_pass(numpy_convs, name):
    residual, relu = parts(name)
    rng = np.random.default_rng(7)
    x, z = _nhwc(rng.standard_normal(X).astype(np.float32)), _nhwc(rng.standard_normal(X).astype(np.float32))
    w = (rng.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    v = _conv64(x, w) + b.reshape(1, -1, 1, 1) + (np.asarray(z, np.float64) if residual else 0)
    want = np.maximum(v, 0) if relu else v
    assert 0.2 < (want > 0).mean() < 0.9 or not relu
    counters = numpy_convs.rt.counters
    y = numpy_convs.run(_call("eng5_k2=1", name), x, w, b, relu=relu, z=z if residual else None, fusion=name)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    assert _NumpyEnginePlan.executed == [("engine:eng5_k2=1+" + name, True, residual)] and numpy_convs.passes == []
    fused = "fused_" + name.replace("+", "_")
    assert (counters["graph_api_calls"], counters[fused], counters["epilogue_passes"]) == (1, 1, 0)
    # the same conv recorded as before (the engine, no fusion): the bare plan, then the epilogue as one pass
    y = numpy_convs.run(_call("eng5_k2=1", ""), x, w, b, relu=relu, z=z if residual else None, fusion=name)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    assert _NumpyEnginePlan.executed[-1] == ("engine:eng5_k2=1", False, False) and numpy_convs.passes == [(True, residual, relu)]
    assert (counters["graph_api_calls"], counters[fused], counters["epilogue_passes"]) == (2, 1, 1)


def test_a_fused_graph_runs_only_the_step_it_is_of(numpy_convs):
    """A launch whose step is not the recorded graph's never runs it: the resolver gives such a
    plan the legacy algorithm (tested above); a resolution reached with another step is refused."""
    rng = np.random.default_rng(8)
    x, w, b = _nhwc(rng.standard_normal(X).astype(np.float32)), rng.standard_normal((16, 16, 3, 3)).astype(np.float32), np.zeros(16, np.float32)
    ex = numpy_convs.resolve(_call("eng5_k2=1", F), np.float32, F)
    assert ex.conv.fused
    with pytest.raises(RuntimeError, match=re.escape(f"runs conv + {F}, not this launch's conv + {R}")):
        numpy_convs.run(_call("eng5_k2=1", F), x, w, b, relu=True, fusion=F)  # no z: the launch's step is bias+relu


def _conv64(x, w):
    from convpass.ops.conv import conv_reference

    return conv_reference(np, np.asarray(x, np.float64), np.asarray(w, np.float64), None, _geometry())


def test_the_bias_pass_of_a_longer_epilogue_is_no_pruning_problem_of_its_own():
    from convpass.tuning.prune import problems_of

    # the engine-epilogue tuner's bias row beside a longer legacy epilogue: one problem, F's
    assert set(problems_of(BASE)) == {(KEY, F)}
    # a real bias problem of the same key (its fused call or graph measured): both
    assert set(problems_of(BASE + [row("implicit_precomp_gemm+bias", 0.02)])) == {(KEY, F), (KEY, "bias")}
    # a key with the bias pass alone: its problem
    assert set(problems_of([row("implicit_gemm", 0.02), row("bias", 0.004, EPILOGUE_METHOD)])) == {(KEY, "bias")}

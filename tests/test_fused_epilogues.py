"""Fused graph-API epilogues on the CPU: which convs may fuse (the collect pass and the executor's
lowering read the same ``Mul(y, Sigmoid(y))`` rule), names, selection against the unfused best
plus the measured epilogue pass, cache completeness, the annotation (schema 4 ``fusion``), the
tuner's rows (NumPy stand-ins for CuPy and cuDNN: no timing invented) and the frontend graph."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import numpy_candidates, offer_configs, silu_model
from onnx import helper

import convpass
from convpass.compiler.passes.canonicalize_convs import canonicalize_conv
from convpass.compiler.passes.collect_conv_problems import ConvProblem, conv_fusion
from convpass.core import annotation
from convpass.core.algo import Algo
from convpass.core.device import DeviceFingerprint
from convpass.core.options import TuneOptions
from convpass.native.cudnn import graph_api
from convpass.native.cudnn.graph_api import EngineConfig
from convpass.tuning import tuner
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.decide import EPILOGUE_METHOD, cost_ms, epilogue_ms, select

H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)


def fusion_of(text):
    return Algo.parse(text).fusion if text else ""
SWISH = "bias+swish"
FUSED = "engine:eng5_k2=1+bias+swish"
X = (2, 16, 12, 12)
SHAPES = {  # the convs of conftest.silu_model at X
    "expand": canonicalize_conv("Conv", {}, X, (32, 16, 1, 1)).shapes[0],
    "dw": canonicalize_conv("Conv", {"group": 32, "pads": [1, 1, 1, 1]}, (2, 32, 12, 12), (32, 1, 3, 3)).shapes[0],
    "project": canonicalize_conv("Conv", {}, (2, 32, 12, 12), (16, 32, 1, 1)).shapes[0],
}
SHAPE = SHAPES["dw"]
KEY = SHAPE.key("nhwc", "default")


def row(algo, time_ms, method="measure", status="ok", key=KEY, hr=None):
    return Measurement(key, algo, status, time_ms, 0, True, 1.0, method, heuristic_rank=hr)


# ---------------------------------------------------------------------------------------------
# names

def test_a_fused_configuration_names_its_epilogue():
    config = EngineConfig.parse(FUSED)
    assert (config.engine_id, config.knobs, config.fusion) == (5, ((2, 1),), SWISH)
    assert config.name == "eng5_k2=1" and config.algo == FUSED and EngineConfig.parse(config.algo) == config
    assert EngineConfig.parse("eng5_k2=1", SWISH) == config  # the annotation's engine + fusion attributes
    assert (fusion_of(FUSED), fusion_of("engine:eng5"), fusion_of("implicit_gemm"), fusion_of(None)) == (SWISH, "", "", "")
    with pytest.raises(ValueError, match="not a fused epilogue"):
        EngineConfig.parse("eng5", "bias+gelu")
    with pytest.raises(ValueError, match="not a cuDNN engine configuration"):
        EngineConfig.parse("engine:eng5+bias+gelu")
    assert EngineConfig.parse("engine:eng5+bias+relu").fusion == "bias+relu"  # a legacy epilogue's fused graph


# ---------------------------------------------------------------------------------------------
# which convs fuse

def _nodes(model: onnx.ModelProto) -> dict[str, ir.Node]:
    return {n.name: n for n in ir.serde.deserialize_model(model).graph}


def test_silu_after_a_conv_with_bias_is_its_fusion():
    nodes = _nodes(silu_model())
    assert {name: conv_fusion(nodes[name]) for name in ("expand", "dw", "project")} == {"expand": SWISH, "dw": SWISH, "project": ""}


def _variant(edit) -> onnx.ModelProto:
    model = silu_model()
    edit(model.graph)
    return model


@pytest.mark.parametrize("why,edit,expected", [
    ("the conv output has a third reader", lambda g: g.node.insert(3, helper.make_node("Relu", ["y1"], ["extra"], name="extra")), "bias"),
    ("the Sigmoid is read elsewhere too", lambda g: g.output.append(helper.make_tensor_value_info("s1", onnx.TensorProto.FLOAT, None)), "bias"),
    ("no bias", lambda g: g.node[0].input.pop(), ""),
    ("Mul of the conv and something else", lambda g: g.node[2].input.__setitem__(1, "x"), "bias"),
])
def test_anything_else_after_the_conv_is_no_swish_fusion(why, edit, expected):
    """No SiLU graph: a conv with a bias keeps its legacy epilogue (the bias alone), one without none."""
    assert conv_fusion(_nodes(_variant(edit))["expand"]) == expected, why


def test_fused_problems_are_collected_only_when_engines_are_candidates(tmp_path):
    from convpass.compiler.pipeline import OptimizeReport, prepare_model

    for engines, expected in (("all", {SWISH: 2, "": 1}), ("legacy", {"bias": 2, "": 1})):
        model = ir.serde.deserialize_model(silu_model())
        problems = prepare_model(model, TuneOptions(engines=engines), [], OptimizeReport())
        seen: dict[str, int] = {}
        for p in problems:
            seen[p.fusion] = seen.get(p.fusion, 0) + 1
        assert seen == expected, engines
        assert all((f"+ {p.fusion}" in str(p)) == bool(p.fusion) for p in problems)


# ---------------------------------------------------------------------------------------------
# selection and completeness

FUSED_PROBLEM = ConvProblem((SHAPE,), SWISH)
PLAIN_PROBLEM = ConvProblem((SHAPE,))
BASE = [row("implicit_gemm", 0.020), row("engine:eng8", 0.018), row(SWISH, 0.010, method=EPILOGUE_METHOD)]


@pytest.mark.parametrize("fused_ms,winner", [(0.025, FUSED), (0.027, FUSED), (0.029, "engine:eng8")])
def test_a_fused_graph_wins_only_when_faster_than_the_unfused_best_plus_its_pass(fused_ms, winner):
    rows = BASE + [row(FUSED, fused_ms)]
    chosen = select(rows, FUSED_PROBLEM, TuneOptions(tf32="on", layout="nhwc"))
    assert chosen.algo == winner
    assert cost_ms(chosen, epilogue_ms(rows, FUSED_PROBLEM)) == pytest.approx(min(fused_ms, 0.028))


def test_a_cached_engine_graph_of_an_epilogue_this_version_does_not_build_is_never_chosen():
    """A shared tuning cache may hold rows another convpass wrote for fused graphs this one does not
    build (an engine running a ConvTranspose's lone ``relu``, ``engine:<cfg>+relu``): such a row is no
    candidate, while the legacy epilogues' engine graphs it does build are."""
    problem = ConvProblem((SHAPE,), "relu")
    rows = [row("implicit_gemm", 0.020), row("engine:eng8", 0.018), row("relu", 0.002, method=EPILOGUE_METHOD),
            row("engine:eng4+relu", 0.005), row("implicit_gemm+relu", 0.025)]
    assert select(rows, problem, TuneOptions(tf32="on", layout="nhwc")).algo == "engine:eng8"  # the fastest the version runs
    built = [row("implicit_gemm", 0.020), row("engine:eng8", 0.018), row("bias", 0.002, method=EPILOGUE_METHOD),
             row("engine:eng4+bias", 0.005), row("implicit_gemm+bias", 0.019)]
    assert select(built, ConvProblem((SHAPE,), "bias"), TuneOptions(tf32="on", layout="nhwc")).algo == "engine:eng4+bias"


def test_a_fused_graph_needs_its_own_problem_and_the_epilogue_timing():
    options = TuneOptions(tf32="on", layout="nhwc")
    fast = row(FUSED, 0.001)
    assert select(BASE + [fast], PLAIN_PROBLEM, options).algo == "engine:eng8"  # the conv is not followed by SiLU
    no_pass = [r for r in BASE if r.method != EPILOGUE_METHOD] + [fast]
    assert select(no_pass, FUSED_PROBLEM, options).algo == "engine:eng8"  # not comparable on one clock
    assert select(BASE + [fast], FUSED_PROBLEM, TuneOptions(tf32="on", layout="nhwc", engines="legacy")).algo == "implicit_gemm"
    assert epilogue_ms(BASE, PLAIN_PROBLEM) == {} and epilogue_ms(BASE, FUSED_PROBLEM) == {KEY: 0.010}


def test_the_cache_is_complete_for_a_fused_problem_with_its_pass_and_a_fused_row_per_key():
    from convpass.core.cudnn_enums import algo_names

    legacy = [row(a, 0.01 * (i + 1)) for i, a in enumerate(algo_names("fwd"))] + [row("implicit_gemm", None, method="heuristic", hr=0)]
    have = legacy + [row("engine:eng8", 0.02)]
    check = lambda rows: tuner.complete(rows, [KEY], "measure", None, True, True, SWISH)  # noqa: E731
    assert tuner.complete(have, [KEY], "measure", None, True, True) and not check(have)
    assert not check(have + [row(SWISH, 0.01, method=EPILOGUE_METHOD)])
    assert not check(have + [row(FUSED, 0.01)])
    assert check(have + [row(SWISH, 0.01, method=EPILOGUE_METHOD), row("engine:none+bias+swish", None, status="unsupported")])
    assert not tuner.complete(legacy + [row(FUSED, 0.01)], [KEY], "measure", None, True, True)  # a fused row is no plain engine


def test_a_cache_with_legacy_and_engine_rows_gets_only_the_fusion_measured(monkeypatch):
    from convpass.core.cudnn_enums import algo_names
    from convpass.tuning import harness

    seen = []
    monkeypatch.setattr(harness, "warm_clocks", lambda: None)
    monkeypatch.setattr(tuner, "spaces", lambda problem, options: (True, True))
    monkeypatch.setattr(tuner, "_measure", lambda problem, options, keys, strategy, forced, legacy, engines, best, fusion, have=(), **own: seen.append((legacy, engines, best, fusion)) or [])
    options = TuneOptions(tf32="on", layout="nhwc")
    have = [row(a, 0.01 * (i + 1)) for i, a in enumerate(algo_names("fwd"))] + [row("implicit_gemm", None, method="heuristic", hr=0)]
    tuner.measure_problem(FUSED_PROBLEM, options, have + [row("engine:eng8", 0.005)])
    tuner.measure_problem(FUSED_PROBLEM, options, have)
    tuner.measure_problem(PLAIN_PROBLEM, options, have)
    assert seen == [(False, False, 0.005, SWISH), (False, True, 0.01, SWISH), (False, True, 0.01, "")]


# ---------------------------------------------------------------------------------------------
# the tuned model

def _tuned(tmp_path, fused_ms, **options):
    rows = []
    for shape in SHAPES.values():
        key = shape.key("nhwc", "default")
        rows += [row("implicit_gemm", 0.020, key=key), row("implicit_gemm", None, "heuristic", key=key, hr=0),
                 row(SWISH, 0.010, EPILOGUE_METHOD, key=key), row(FUSED, fused_ms, key=key)]
    cache = TuningCache(tmp_path / "c.db")
    cache.put(H200, rows)
    cache.close()
    return convpass.optimize(silu_model(), cache=tmp_path / "c.db", device_name=str(H200), quiet=True, tf32="on", layout="nhwc", **options)


def test_a_tuned_model_records_the_fused_engine_where_it_won(tmp_path):
    tuned = _tuned(tmp_path, 0.025)
    onnx.checker.check_model(tuned, full_check=True)
    records = {r["node"]: r for r in convpass.inspect(tuned)}
    assert {n: (r["engine"], r["fusion"], r["algo"]) for n, r in records.items()} == {
        "expand": ("eng5_k2=1", SWISH, "implicit_gemm"), "dw": ("eng5_k2=1", SWISH, "implicit_gemm"), "project": (None, None, "implicit_gemm")}
    info, nodes = annotation.read_annotations(tuned)
    assert info.schema_version == annotation.SCHEMA_VERSION and [n.decisions[0].fusion for n in nodes] == [SWISH, SWISH, ""]
    slow = {r["node"]: r["fusion"] for r in convpass.inspect(_tuned(tmp_path / "slow", 0.040))}
    assert slow == {"expand": None, "dw": None, "project": None}
    legacy = _tuned(tmp_path / "legacy", 0.025, engines="legacy")
    assert not any(a.name in ("engine", "fusion") for n in legacy.graph.node for a in n.attribute)


def test_the_fusion_attribute_round_trips_and_older_schemas_read_without_it():
    decisions = [annotation.ConvDecision(algo="gemm", engine="eng5", fusion=SWISH), annotation.ConvDecision(algo="gemm", engine="eng5")]
    attrs = annotation.decision_attributes(decisions)
    assert attrs["fusion"] == [SWISH, ""]
    node = helper.make_node("Conv", ["x", "w"], ["y"], domain=annotation.DOMAIN, **attrs)
    assert [d.fusion for d in annotation.read_node(node, n_profiles=2).decisions] == [SWISH, ""]
    schema3 = helper.make_node("Conv", ["x", "w"], ["y"], domain=annotation.DOMAIN, algo="gemm", engine="eng5")
    assert annotation.read_node(schema3, n_profiles=1).decisions[0].fusion == ""
    assert "fusion" not in annotation.decision_attributes([annotation.ConvDecision(algo="gemm", engine="eng5")])


def test_the_plan_records_which_convs_may_fuse_and_the_summary_names_the_fused_engine(tmp_path):
    from convpass.core.fusion import absorbed
    from convpass.kernels.plan_steps import PlanSteps
    from convpass.runtime import Executor

    tuned = _tuned(tmp_path, 0.025)
    ex = Executor(tuned, device="cpu")
    x = np.random.default_rng(0).standard_normal(X).astype(np.float32)
    from conftest import run_ort

    np.testing.assert_allclose(ex.run(None, {"x": x})[0], run_ort(silu_model(), {"x": x})[0], rtol=1e-4, atol=1e-4)
    [plan] = ex._plans.values()
    found = {}
    for i, st in enumerate(plan.steps):
        if st.node.op_type == "Conv":
            view = PlanSteps(plan, set())
            view.conv = i
            a = absorbed(view, i)
            found[st.node.name] = (a.epilogue, a.nodes)
    ops = [st.node.op_type for st in plan.steps]
    assert found == {"expand": (SWISH, (ops.index("Sigmoid"), ops.index("Mul"))),
                     "dw": (SWISH, (ops.index("Sigmoid", 2), ops.index("Mul", 3))), "project": ("", ())}
    assert {c.node: c.algo for c in ex.plan_summary()} == {"expand": FUSED, "dw": FUSED, "project": "implicit_gemm"}
    view = PlanSteps(plan, {ops.index("Mul")})  # the Mul already taken by another launch
    view.conv = 0
    assert absorbed(view, 0).epilogue == "bias"


# ---------------------------------------------------------------------------------------------
# the tuner's rows (stand-ins: the "times" are the fakes' numbers; statuses and checks are tested)

class _FusedPlan:
    """Fused configurations: 1 right, 2 wrong (forgets the activation), 3 not buildable."""

    def __init__(self, key, config, enumerated=None):
        if config.engine_id == 3:
            raise graph_api.GraphApiError("cuDNN does not build eng3 (bias+swish): NOT_SUPPORTED")
        self.config, self.workspace_bytes = config, 0

    def execute(self, x, w, y, workspace=None, bias=None):
        assert bias is not None and bias.shape == (SHAPE.k,)
        pre = x.sum() + bias.reshape(1, -1, 1, 1)
        y[...] = pre / (1.0 + np.exp(-pre)) if self.config.engine_id == 1 else pre


@pytest.fixture
def fused_bench(monkeypatch):
    from convpass.tuning import candidates, harness

    monkeypatch.setattr(graph_api, "EnginePlan", _FusedPlan)
    offer_configs(monkeypatch, lambda key, fusion="": [EngineConfig(i, (), fusion) for i in (1, 2, 3)])
    launched = []
    monkeypatch.setattr(candidates, "_activation_kernel", lambda fusion: lambda a, out: launched.append(fusion))

    def timing(launch, sets, best_ms=None, **_):
        launch(0)
        return harness.Timing(0.004, 10, 0.0, early_stop=False, eager=False)

    monkeypatch.setattr(harness, "time_launches", timing)
    # x near 0: conv + bias near -0.7, where SiLU is far from identity
    bench = numpy_candidates(monkeypatch, SHAPE, fill=0.25, x_value=-1e-4, exp=np.exp)
    bench.launched = launched
    return bench


def test_a_fusion_gets_its_epilogue_pass_and_every_fused_configuration_a_row(fused_bench):
    rows = fused_bench.measure_fused(SHAPE.key("nchw", "default"), SWISH, best_ms=0.02)
    assert [(r.algo, r.method, r.status) for r in rows] == [
        (SWISH, EPILOGUE_METHOD, "ok"), ("engine:eng1+bias+swish", "measure", "ok"),
        ("engine:eng2+bias+swish", "measure", "wrong_result"), ("engine:eng3+bias+swish", "measure", "unsupported")]
    assert fused_bench.launched == [SWISH] and rows[0].time_ms == 0.004 and "own pass" in rows[0].note
    assert "fused bias+swish in one call" in rows[1].note and "NOT_SUPPORTED" in rows[3].note


def test_no_fused_engine_at_all_is_recorded(fused_bench, monkeypatch):
    def refuse(key, fusion=""):
        raise graph_api.GraphApiError("cuDNN's graph API has no engine for this")

    offer_configs(monkeypatch, refuse)
    rows = fused_bench.measure_fused(SHAPE.key("nchw", "default"), SWISH, best_ms=None)
    assert [(r.algo, r.status) for r in rows] == [(SWISH, "ok"), ("engine:none+bias+swish", "unsupported")]
    assert fusion_of(rows[1].algo) == SWISH


# ---------------------------------------------------------------------------------------------
# the frontend graph

def test_the_fused_graph_adds_a_bias_and_the_activation_and_its_plan_takes_the_bias(frontend):
    config = EngineConfig.parse("eng5", SWISH)
    plan = graph_api.EnginePlan(KEY, config)
    assert ("tensor", "b", (1, SHAPE.k, 1, 1), (SHAPE.k, 1, SHAPE.k, SHAPE.k)) in frontend.calls
    assert ("bias", 4) in frontend.calls and ("swish",) in frontend.calls
    arr = lambda p: types.SimpleNamespace(data=types.SimpleNamespace(ptr=p), nbytes=8)  # noqa: E731
    plan.execute(arr(1), arr(2), arr(3), arr(9), bias=arr(4))
    assert frontend.calls[-1] == ("execute", "eng5", (1, 2, 3, 4), 9)
    with pytest.raises(graph_api.GraphApiError, match="takes a bias"):
        plan.execute(arr(1), arr(2), arr(3), arr(9))
    bare = graph_api.EnginePlan(KEY, EngineConfig.parse("eng5"))
    with pytest.raises(graph_api.GraphApiError, match="takes no bias"):
        bare.execute(arr(1), arr(2), arr(3), arr(9), bias=arr(4))
    assert [c.algo for c in graph_api.enumerate_configs(KEY, SWISH).configs()][:2] == ["engine:eng5+bias+swish", "engine:eng67_k2=16_k13=0+bias+swish"]


# ---------------------------------------------------------------------------------------------
# the executor's choice for a fused decision (cuDNN stood in for: no GPU)

@dataclasses.dataclass(frozen=True)
class _Geometry:  # what the executor reads of a ConvGeometry here
    op_type: str
    spatial_rank: int
    shapes: tuple


def _call(fusion=SWISH):
    from convpass.ops.conv import ConvCall

    geometry = _Geometry("Conv", 2, (SHAPE,))
    d = annotation.ConvDecision(algo="implicit_gemm", engine="eng5_k2=1", fusion=fusion, memory_format="NHWC",
                                math_mode="default", problem_key=str(KEY))
    return ConvCall("dw", geometry, d)  # type: ignore[arg-type]


def test_a_fused_decision_runs_its_fused_engine_where_the_plan_lets_the_launch_own_the_epilogue(convs):
    ex = convs.resolve(_call(), np.float32, SWISH)
    assert ex.algo == FUSED and ex.engine.config.fusion == SWISH and convs.warned == []


def test_a_fused_decision_without_its_epilogue_in_the_plan_warns_and_runs_the_legacy_algorithm(convs):
    ex = convs.resolve(_call(), np.float32, "")
    assert (ex.algo, ex.engine, ex.source) == ("implicit_gemm", None, "recorded")
    [message] = convs.warned
    assert "'dw'" in message and "fused graph conv + bias+swish" in message and "'implicit_gemm' instead" in message


def test_the_op_by_op_run_that_records_a_plan_runs_the_legacy_algorithm_quietly(convs):
    ex = convs.resolve(_call(), np.float32, None)
    assert (ex.algo, ex.engine) == ("implicit_gemm", None) and convs.warned == []
    plain = convs.resolve(_call(fusion=""), np.float32, None)  # an unfused engine runs as recorded
    assert plain.algo == "engine:eng5_k2=1" and plain.engine.config.fusion == ""

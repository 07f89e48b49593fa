"""A LeakyRelu after a conv as a graph-API fused epilogue (``bias+leakyrelu<alpha>``), on the CPU:
its names and their round trips (fusion, engine algorithm, cache row, annotation), the one
absorption rule the compiler and the runtime both read, the reference activation against ONNX
Runtime, the tuner's rows and the frontend graph (stand-ins: no timing invented), and the
executor's choice for a fused decision."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import annotated, leaky_model, numpy_candidates, offer_configs, recorded_call, run_ort
from onnx import helper

import convpass
from convpass.compiler.passes.canonicalize_convs import canonicalize_conv
from convpass.compiler.passes.collect_conv_problems import ConvProblem, conv_fusion
from convpass.core import annotation
from convpass.core.algo import Algo
from convpass.core.device import DeviceFingerprint
from convpass.core.fusion import is_graph_fusion, is_legacy, leakyrelu_alpha, leakyrelu_name
from convpass.core.options import TuneOptions
from convpass.native.cudnn import graph_api
from convpass.native.cudnn.graph_api import EngineConfig
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.decide import EPILOGUE_METHOD, select

H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)
L02, L01 = "bias+leakyrelu0.2", "bias+leakyrelu0.1"
FUSED = "engine:eng5_k2=1+" + L02
X = (2, 8, 12, 12)
SHAPE = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, X, (8, 8, 3, 3)).shapes[0]
KEY = SHAPE.key("nhwc", "default")


def row(algo, time_ms, method="measure", status="ok", key=KEY, hr=None):
    return Measurement(key, algo, status, time_ms, 0, True, 1.0, method, heuristic_rank=hr)


# ---------------------------------------------------------------------------------------------
# names

@pytest.mark.parametrize("alpha,name", [(0.2, L02), (0.1, L01), (0.01, "bias+leakyrelu0.01"), (1.0, "bias+leakyrelu1"),
                                        (-0.5, "bias+leakyrelu-0.5"), (np.float32(0.2), L02), (0.0, "bias+leakyrelu0")])
def test_the_alpha_is_the_shortest_decimal_of_its_float32_and_reads_back(alpha, name):
    assert leakyrelu_name(alpha) == name
    assert np.float32(leakyrelu_alpha(name)) == np.float32(alpha)
    assert is_graph_fusion(name) and not is_legacy(name)


@pytest.mark.parametrize("name", ["bias+leakyrelu", "bias+leakyrelu0.20", "bias+leakyrelu.2", "bias+leakyrelu2e-1", "bias+leakyrelunan",
                                  "bias+leakyreluinf", "bias+leakyrelu 0.2", "leakyrelu0.2", "bias+relu", "", None])
def test_a_name_not_written_as_the_rule_writes_it_is_no_leakyrelu_fusion(name):
    assert leakyrelu_alpha(name) is None and not is_graph_fusion(name)


def test_a_non_finite_alpha_has_no_name():
    with pytest.raises(ValueError, match="not finite"):
        leakyrelu_name(float("nan"))


def test_alphas_are_distinct_fusions_problems_and_engine_algorithms():
    assert L02 != L01 and ConvProblem((SHAPE,), L02) != ConvProblem((SHAPE,), L01)
    assert str(ConvProblem((SHAPE,), L02)).endswith(" + " + L02)
    config = EngineConfig.parse(FUSED)
    assert (config.engine_id, config.knobs, config.fusion) == (5, ((2, 1),), L02)
    assert config.algo == FUSED and EngineConfig.parse(config.algo) == config
    assert EngineConfig.parse("eng5_k2=1", L02) == config  # the annotation's engine + fusion attributes
    assert EngineConfig.parse("eng5_k2=1", L01).algo == "engine:eng5_k2=1+" + L01
    assert Algo.parse(FUSED) == Algo("engine", "eng5_k2=1", L02) and str(Algo.parse(FUSED)) == FUSED
    assert Algo.parse(L02) == Algo("pass", L02)  # the epilogue-pass row's algorithm
    assert Algo.parse("engine:none+" + L02).fusion == L02  # the marker row: no fused engine
    with pytest.raises(ValueError, match="not a fused epilogue"):
        EngineConfig.parse("eng5", "bias+leakyrelu0.20")
    with pytest.raises(ValueError, match="not a cuDNN engine configuration"):
        EngineConfig.parse("engine:eng5+bias+leakyrelu0.20")
    with pytest.raises(ValueError, match="names the fusion"):
        EngineConfig.parse(FUSED, L01)


def test_the_tuning_cache_keeps_each_alpha_apart(tmp_path):
    rows = [row(L02, 0.010, EPILOGUE_METHOD), row(FUSED, 0.02), row(L01, 0.011, EPILOGUE_METHOD),
            row("engine:none+" + L01, None, status="unsupported")]
    cache = TuningCache(tmp_path / "c.db")
    cache.put(H200, rows)
    got = {(r.algo, r.method, r.status) for r in cache.get(H200, SHAPE) if r.key == KEY}
    cache.close()
    assert got == {(r.algo, r.method, r.status) for r in rows}


def test_the_annotation_round_trips_the_fusion_and_older_names_read_unchanged():
    decisions = [annotation.ConvDecision(algo="gemm", engine="eng5", fusion=L02), annotation.ConvDecision(algo="gemm", engine="eng5", fusion=L01),
                 annotation.ConvDecision(algo="gemm", engine="eng5", fusion="bias+swish"), annotation.ConvDecision(algo="gemm", fusion="bias+relu")]
    attrs = annotation.decision_attributes(decisions)
    assert attrs["fusion"] == [L02, L01, "bias+swish", "bias+relu"]
    node = helper.make_node("Conv", ["x", "w"], ["y"], domain=annotation.DOMAIN, **attrs)
    read = annotation.read_node(node, n_profiles=4).decisions
    assert [d.fusion for d in read] == [L02, L01, "bias+swish", "bias+relu"]
    assert [EngineConfig.parse(d.engine, d.fusion).algo for d in read[:3]] == [
        "engine:eng5+" + L02, "engine:eng5+" + L01, "engine:eng5+bias+swish"]


# ---------------------------------------------------------------------------------------------
# which convs fuse: the one rule (convpass.core.fusion.absorbed) on hand-built graphs

def _fusions(model: onnx.ModelProto, graph_fusions: bool = True) -> dict[str, str]:
    nodes = {n.name: n for n in ir.serde.deserialize_model(model).graph}
    return {name: conv_fusion(nodes[name], graph_fusions) for name in ("c1", "c2", "c3")}


def _variant(edit, **kw) -> onnx.ModelProto:
    model = leaky_model(**kw)
    edit(model.graph)
    return model


def test_a_leakyrelu_after_a_conv_with_bias_is_its_fusion_with_its_alpha():
    assert _fusions(leaky_model()) == {"c1": L02, "c2": L01, "c3": ""}  # c3's output is the graph's
    assert _fusions(leaky_model(alphas=(0.2, None)))["c2"] == "bias+leakyrelu0.01"  # ONNX's default alpha
    assert _fusions(leaky_model(), graph_fusions=False) == {"c1": "bias", "c2": "bias", "c3": ""}  # only where engines are candidates


@pytest.mark.parametrize("why,edit,expected", [
    ("the conv output has a second reader", lambda g: g.node.insert(2, helper.make_node("Relu", ["y1"], ["extra"], name="extra")), "bias"),
    ("the conv output is read twice by the LeakyRelu's node and the Concat", lambda g: g.node[4].input.__setitem__(0, "y1"), "bias"),
    ("the conv output is a graph output", lambda g: g.output.append(helper.make_tensor_value_info("y1", onnx.TensorProto.FLOAT, None)), ""),
    ("no bias", lambda g: g.node[0].input.pop(), ""),
    ("a LeakyRelu of another domain", lambda g: g.node[1].__setattr__("domain", "custom"), "bias"),
])
def test_anything_else_after_the_conv_is_no_leakyrelu_fusion(why, edit, expected):
    assert _fusions(_variant(edit))["c1"] == expected, why


def test_a_leakyrelu_whose_output_a_concat_reads_is_absorbed():
    """ESRGAN's dense block: the activations are joined by a Concat; the fused step writes its slice
    of the buffer (an engine's plan with the slice's strides), as the LeakyRelu's own pass did."""
    assert _fusions(leaky_model(join="Concat")) == {"c1": L02, "c2": "bias+leakyrelu0.1", "c3": ""}


def test_a_leakyrelu_whose_output_is_read_twice_or_is_a_graph_output_is_still_absorbed():
    """The fused step writes the LeakyRelu's output: who reads it does not matter (a1 feeds c2 and the Concat)."""
    assert _fusions(_variant(lambda g: g.output.append(helper.make_tensor_value_info("a1", onnx.TensorProto.FLOAT, None))))["c1"] == L02


def test_fused_problems_are_collected_per_alpha_only_when_engines_are_candidates():
    from convpass.compiler.pipeline import OptimizeReport, prepare_model

    # c1 and c2: one shape; c2's LeakyRelu is read only by the join Add, whose other operand (a1) is
    # ready before c2 and of its shape: with shapes known, c2's step takes that residual too
    for engines, expected in (("all", {L02: 1, L01 + "+add": 1, "": 1}), ("legacy", {"bias": 1, "": 1})):
        problems = prepare_model(ir.serde.deserialize_model(leaky_model()), TuneOptions(engines=engines), [], OptimizeReport())
        seen: dict[str, int] = {}
        for p in problems:
            seen[p.fusion] = seen.get(p.fusion, 0) + 1
        assert seen == expected, engines


def test_the_runtime_plan_absorbs_the_same_leakyrelu():
    from convpass.core.fusion import absorbed
    from convpass.kernels.plan_steps import PlanSteps
    from convpass.runtime import Executor

    ex = Executor(leaky_model(), device="cpu")
    ex.run(None, {"x": np.zeros(X, np.float32)})
    [plan] = ex._plans.values()
    ops = [st.node.op_type for st in plan.steps]
    found = {}
    for i, st in enumerate(plan.steps):
        if st.node.op_type == "Conv":
            view = PlanSteps(plan, set())
            view.conv = i
            a = absorbed(view, i)
            found[st.node.name] = (a.epilogue, a.nodes)
    first = ops.index("LeakyRelu")
    second = ops.index("LeakyRelu", first + 1)
    assert found == {"c1": (L02, (first,)), "c2": (L01 + "+add", (second, ops.index("Add"))), "c3": ("", ())}
    view = PlanSteps(plan, set())
    view.conv = ops.index("Conv", 1)
    a = absorbed(view, view.conv)
    assert a.shorter == absorbed(view, view.conv, residual=False) and (a.shorter.epilogue, a.shorter.nodes) == (L01, (second,))
    view = PlanSteps(plan, {first})  # the LeakyRelu already taken by another launch
    view.conv = 0
    assert absorbed(view, 0).epilogue == "bias"
    view = PlanSteps(plan, set())
    view.conv = 0
    assert absorbed(view, 0, graph_fusions=False).epilogue == "bias"


# ---------------------------------------------------------------------------------------------
# the reference activation: ONNX's LeakyRelu

@pytest.mark.parametrize("alpha", [0.2, 0.1, 0.01, 1.5, -0.3])
def test_the_reference_activation_is_onnx_runtime_s_leakyrelu(alpha):
    v = np.random.default_rng(1).standard_normal((2, 3, 5, 7)).astype(np.float32)
    v[0, 0, 0, :3] = [0.0, -0.0, -1e-30]
    node = helper.make_node("LeakyRelu", ["v"], ["y"], alpha=alpha)
    graph = helper.make_graph([node], "l", [helper.make_tensor_value_info("v", onnx.TensorProto.FLOAT, list(v.shape))],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, list(v.shape))])
    [want] = run_ort(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), {"v": v})
    f = graph_api.fusion_of(leakyrelu_name(alpha))
    got = f.apply(np, v)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    assert (f.frontend_op, dict(f.frontend_args)) == ("leaky_relu", {"negative_slope": float(np.float32(alpha))})
    literal = f.cuda.split("?")[1].split(":")[1].split("*")[0].strip()  # "(v > 0.0f ? v : <alpha>f * v)"
    assert literal.endswith("f") and np.float32(float(literal[:-1])) == np.float32(alpha)


def test_conv_bias_and_the_reference_activation_match_onnx_runtime_on_the_model():
    """ONNX Runtime's conv + bias (the model cut at y1), the fusion's reference over it: ONNX Runtime's a1."""
    model = leaky_model()
    x = np.random.default_rng(2).standard_normal(X).astype(np.float32)
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    cut.graph.output.extend([helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ("y1", "a1")])
    _, y1, a1 = run_ort(cut, {"x": x})
    assert (y1 < 0).mean() > 0.2 and (y1 > 0).mean() > 0.2  # both branches of the activation are checked
    np.testing.assert_array_equal(graph_api.fusion_of(L02).apply(np, y1), a1)


# ---------------------------------------------------------------------------------------------
# the tuned model, through the CPU executor

def _tuned(tmp_path, fused_ms, **options):
    rows = []
    for name, (x, w) in {"c1": (X, (8, 8, 3, 3)), "c2": (X, (8, 8, 3, 3)), "c3": ((2, 16, 12, 12), (8, 16, 1, 1))}.items():
        attrs = {} if name == "c3" else {"pads": [1, 1, 1, 1]}
        key = canonicalize_conv("Conv", attrs, x, w).shapes[0].key("nhwc", "default")
        rows += [row("implicit_gemm", 0.020, key=key), row("implicit_gemm", None, "heuristic", key=key, hr=0)]
        for fusion in (L02, L01):
            rows += [row(fusion, 0.010, EPILOGUE_METHOD, key=key), row("engine:eng5_k2=1+" + fusion, fused_ms, key=key)]
        # c2's step ends at the join Add (bias+leakyrelu0.1+add): no fused graph of it here, its
        # shorter graph (L01) plus the Add's pass against the conv plus both as one pass
        rows += [row(L01 + "+add", 0.012, EPILOGUE_METHOD, key=key), row("add", 0.003, EPILOGUE_METHOD, key=key),
                 row("engine:none+" + L01 + "+add", None, status="unsupported", key=key)]
    cache = TuningCache(tmp_path / "c.db")
    cache.put(H200, rows)
    cache.close()
    return convpass.optimize(leaky_model(), cache=tmp_path / "c.db", device_name=str(H200), quiet=True, tf32="on", layout="nhwc", **options)


def test_a_tuned_model_records_the_fused_engine_of_each_alpha_and_runs_like_onnx_runtime(tmp_path):
    tuned = _tuned(tmp_path, 0.025)
    onnx.checker.check_model(tuned, full_check=True)
    records = {r["node"]: (r["engine"], r["fusion"]) for r in convpass.inspect(tuned)}
    assert records == {"c1": ("eng5_k2=1", L02), "c2": ("eng5_k2=1", L01), "c3": (None, None)}
    x = np.random.default_rng(3).standard_normal(X).astype(np.float32)
    want = run_ort(leaky_model(), {"x": x})[0]
    np.testing.assert_allclose(convpass.Executor(tuned, device="cpu").run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run_ort(tuned, {"x": x})[0], want, rtol=1e-5, atol=1e-5)  # the annotated model still runs in ONNX Runtime
    slow = {r["node"]: r["fusion"] for r in convpass.inspect(_tuned(tmp_path / "slow", 0.040))}
    assert slow == {"c1": None, "c2": None, "c3": None}  # slower than the conv (0.020) + its pass (0.010)


def test_a_fused_leakyrelu_wins_only_when_faster_than_the_unfused_best_plus_its_pass():
    problem = ConvProblem((SHAPE,), L02)
    base = [row("implicit_gemm", 0.020), row("engine:eng8", 0.018), row(L02, 0.010, method=EPILOGUE_METHOD)]
    options = TuneOptions(tf32="on", layout="nhwc")
    assert select(base + [row(FUSED, 0.027)], problem, options).algo == FUSED
    assert select(base + [row(FUSED, 0.029)], problem, options).algo == "engine:eng8"
    other = "engine:eng5_k2=1+" + L01  # another alpha's graph is no candidate of this problem
    assert select(base + [row(other, 0.001)], problem, options).algo == "engine:eng8"


# ---------------------------------------------------------------------------------------------
# the tuner's rows (stand-ins: the "times" are the fakes' numbers; statuses and checks are tested)

class _FusedPlan:
    """Fused configurations: 1 right, 2 wrong (forgets the activation), 3 not buildable."""

    def __init__(self, key, config, enumerated=None):
        if config.engine_id == 3:
            raise graph_api.GraphApiError(f"cuDNN does not build eng3 ({L02}): NOT_SUPPORTED")
        self.config, self.workspace_bytes = config, 0

    def execute(self, x, w, y, workspace=None, bias=None):
        pre = x.sum() + bias.reshape(1, -1, 1, 1)
        y[...] = np.where(pre > 0, pre, np.float32(0.2) * pre) if self.config.engine_id == 1 else pre


@pytest.fixture
def fused_bench(monkeypatch):
    from convpass.tuning import candidates, harness

    monkeypatch.setattr(graph_api, "EnginePlan", _FusedPlan)
    offer_configs(monkeypatch, lambda key, fusion="": [EngineConfig(i, (), fusion) for i in (1, 2, 3)])
    launched = []
    monkeypatch.setattr(candidates, "_activation_kernel", lambda fusion: lambda a, out: launched.append(fusion))
    monkeypatch.setattr(harness, "time_launches", lambda launch, sets, best_ms=None, **_: (launch(0), harness.Timing(0.004, 10, 0.0, early_stop=False, eager=False))[1])
    # x below 0: conv + bias negative, where the LeakyRelu is far from identity
    bench = numpy_candidates(monkeypatch, SHAPE, fill=0.25, x_value=-1e-2, where=np.where)
    bench.launched = launched
    return bench


def test_a_leakyrelu_fusion_gets_its_pass_and_every_fused_configuration_a_row(fused_bench):
    rows = fused_bench.measure_fused(SHAPE.key("nchw", "default"), L02, best_ms=0.02)
    assert [(r.algo, r.method, r.status) for r in rows] == [
        (L02, EPILOGUE_METHOD, "ok"), ("engine:eng1+" + L02, "measure", "ok"),
        ("engine:eng2+" + L02, "measure", "wrong_result"), ("engine:eng3+" + L02, "measure", "unsupported")]
    assert fused_bench.launched == [L02] and f"fused {L02} in one call" in rows[1].note and "NOT_SUPPORTED" in rows[3].note


def test_no_fused_leakyrelu_engine_is_recorded_as_swish_s_refusal_is(fused_bench, monkeypatch):
    def refuse(key, fusion=""):
        raise graph_api.GraphApiError("cuDNN's graph API has no engine for this")

    offer_configs(monkeypatch, refuse)
    rows = fused_bench.measure_fused(SHAPE.key("nchw", "default"), L02, best_ms=None)
    assert [(r.algo, r.status) for r in rows] == [(L02, "ok"), ("engine:none+" + L02, "unsupported")]


# ---------------------------------------------------------------------------------------------
# the frontend graph

def test_the_fused_graph_adds_the_bias_then_cudnn_s_relu_with_alpha_as_its_lower_clip_slope(frontend):
    plan = graph_api.EnginePlan(KEY, EngineConfig.parse("eng5", L02))
    assert ("bias", 4) in frontend.calls and ("leaky_relu", float(np.float32(0.2))) in frontend.calls
    assert ("swish",) not in frontend.calls
    arr = lambda p: types.SimpleNamespace(data=types.SimpleNamespace(ptr=p), nbytes=8)  # noqa: E731
    plan.execute(arr(1), arr(2), arr(3), arr(9), bias=arr(4))
    assert frontend.calls[-1] == ("execute", "eng5", (1, 2, 3, 4), 9)
    assert [c.algo for c in graph_api.enumerate_configs(KEY, L01).configs()][:1] == ["engine:eng5+" + L01]


# ---------------------------------------------------------------------------------------------
# the executor's choice for a fused decision (cuDNN stood in for: no GPU)

def _call(fusion):
    return recorded_call("c1", SHAPE, KEY, fusion)


def test_a_fused_leakyrelu_decision_runs_its_engine_and_counts_under_one_counter(convs):
    ex = convs.resolve(_call(L02), np.float32, L02)
    assert ex.algo == FUSED and ex.conv.fused and convs.warned == []
    assert ex.conv.counts == ("graph_api_calls", "fused_bias_leakyrelu")
    assert "fused_bias_leakyrelu" in graph_api.FUSION_COUNTERS and "fused_bias_swish" in graph_api.FUSION_COUNTERS


def test_a_decision_for_another_alpha_than_the_plan_s_warns_and_runs_the_legacy_algorithm(convs):
    ex = convs.resolve(_call(L02), np.float32, L01)
    assert (ex.algo, ex.engine) == ("implicit_gemm", None)
    [message] = convs.warned
    assert "'c1'" in message and f"fused graph conv + {L02}" in message and "'implicit_gemm' instead" in message


# ---------------------------------------------------------------------------------------------
# the lowering of a recorded engine, of models tuned before and after a Concat's activation was absorbed

def _engine_tuned(join: str, fusions: dict[str, str]) -> onnx.ModelProto:
    """leaky_model(join=...) with c1 and c2 recorded as the engine eng5_k2=1 with ``fusions[node]``
    (c3, whose output is the graph's, left untuned)."""
    def decision(fusion):
        return annotation.ConvDecision(algo="implicit_gemm", engine="eng5_k2=1", fusion=fusion, memory_format="NHWC", math_mode="default",
                                       problem_key=str(KEY), source="measure")
    return annotated(leaky_model(join=join), {node: [decision(f)] for node, f in fusions.items()})


def _launches(tuned: onnx.ModelProto, convs) -> tuple[dict[str, Any], dict[int, str]]:
    """The conv launches of ``tuned``'s plan by node name (lower_convs, fusion on), and the plan's step names."""
    from convpass.kernels.convolution import lower_convs
    from convpass.runtime import Executor

    ex = Executor(tuned, device="cpu")
    ex.run(None, {"x": np.zeros(X, np.float32)})
    [plan] = ex._plans.values()
    names = {i: st.node.name for i, st in enumerate(plan.steps)}
    return {names[i]: launch for i, launch in lower_convs(plan, convs, fuse=True, fuse_residual=True).items()}, names


def test_a_model_tuned_before_a_concat_s_leakyrelu_was_absorbed_runs_its_engine_s_conv_and_bias(convs):
    """Before a graph-API activation that a Concat reads was absorbed, c1's and c2's steps were conv +
    bias, and a tuned model recorded the engine's fused conv + bias graph: that graph runs (no
    warning, no legacy algorithm), the LeakyRelus as the plan's own steps."""
    tuned = _engine_tuned("Concat", {"c1": "bias", "c2": "bias"})
    launches, _ = _launches(tuned, convs)
    for node in ("c1", "c2"):
        launch = launches[node]
        assert (launch.epilogue, launch.fusion, launch.absorbs) == (None, "bias", ()), node
        ex = convs.resolve(launch.call, np.float32, launch.fusion)
        assert (ex.algo, ex.conv.fused, ex.conv.epilogue) == ("engine:eng5_k2=1+bias", True, "bias"), node
    assert convs.warned == []
    x = np.random.default_rng(4).standard_normal(X).astype(np.float32)
    want = run_ort(leaky_model(join="Concat"), {"x": x})[0]
    np.testing.assert_allclose(convpass.Executor(tuned, device="cpu").run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run_ort(tuned, {"x": x})[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("join", ["Concat", "Add"])
@pytest.mark.parametrize("fused", [True, False])
def test_a_fused_or_bare_engine_of_a_leakyrelu_step_is_lowered_as_it_was_recorded(convs, join, fused):
    """A model tuned with the activation in c1's step, whether a Concat reads it or not: the fused
    graph absorbs the LeakyRelu; the bare engine (no fusion) runs the conv, the bias and the
    LeakyRelu as the plan's own steps."""
    launches, names = _launches(_engine_tuned(join, {"c1": L02 if fused else ""}), convs)
    c1 = launches["c1"]
    if fused:
        assert (c1.epilogue, c1.fusion, [names[k] for k in c1.absorbs]) == (("engine", L02, None), L02, ["l1"])
    else:
        assert (c1.epilogue, c1.fusion, c1.absorbs) == (None, "", ())
    assert convs.resolve(c1.call, np.float32, c1.fusion).algo == (FUSED if fused else "engine:eng5_k2=1")
    assert convs.warned == []

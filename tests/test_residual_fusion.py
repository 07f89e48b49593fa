"""A residual Add after a graph-API fused activation (``bias+leakyrelu<alpha>+add``,
``bias+swish+add``: CSPDarknet's and YOLO's residual blocks) on the CPU: the names and their round
trips, the one absorption rule on hand-built graphs (and its negatives), the fused step's result
against the unfused ops in float64 NumPy, the tuner's rows and choice among the fused graph, its
shorter graph plus the Add's pass and the unfused configurations (stand-ins: no timing invented),
the operation graph the graph API is given (the frontend stood in for), and the executor's lowering
and choice for such a decision."""

from __future__ import annotations

import json
import types

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import csp_block_model, fake_cuda, numpy_candidates, offer_configs, recorded_call, run_ort
from onnx import helper

import convpass
from convpass.compiler.passes.canonicalize_convs import canonicalize_conv
from convpass.compiler.passes.collect_conv_problems import ConvProblem, conv_fusion
from convpass.core import annotation
from convpass.core.algo import Algo
from convpass.core.device import DeviceFingerprint
from convpass.core.fusion import RESIDUAL_PASS, absorbed, adds_residual, is_graph_fusion, is_legacy, leakyrelu_alpha, residual_fusion, without_residual
from convpass.core.options import TuneOptions
from convpass.native.cudnn import graph_api
from convpass.native.cudnn.graph_api import EngineConfig
from convpass.tuning import tuner
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.decide import EPILOGUE_METHOD, choice_from, cost_ms, epilogue_ms, residual_ms, select

H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)
P = "bias+leakyrelu0.01"
F = P + "+add"
S = "bias+swish+add"
X = (2, 16, 12, 12)
SHAPE1 = canonicalize_conv("Conv", {}, X, (8, 16, 1, 1)).shapes[0]  # csp_block_model's c1 and c2 at X
SHAPE = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, (2, 8, 12, 12), (16, 8, 3, 3)).shapes[0]
KEY = SHAPE.key("nhwc", "default")
FUSED, SHORT = "engine:eng5_k2=1+" + F, "engine:eng5_k2=1+" + P


def row(algo, time_ms, method="measure", status="ok", key=KEY, hr=None):
    return Measurement(key, algo, status, time_ms, 0, True, 1.0, method, heuristic_rank=hr)


# ---------------------------------------------------------------------------------------------
# names

def test_the_residual_form_of_each_activation_reads_back():
    assert residual_fusion(P) == F and residual_fusion("bias+swish") == S and residual_fusion("bias+leakyrelu0.2") == "bias+leakyrelu0.2+add"
    for name, activation in ((F, P), (S, "bias+swish"), ("bias+leakyrelu-0.5+add", "bias+leakyrelu-0.5")):
        assert adds_residual(name) and is_graph_fusion(name) and not is_legacy(name) and without_residual(name) == activation
        assert residual_fusion(without_residual(name)) == name
    assert leakyrelu_alpha(F) is None and leakyrelu_alpha(P) == pytest.approx(0.01)  # the alpha is the activation's name's
    for name in (P, "bias+swish", "bias+add", "bias+add+relu", "bias"):
        assert not adds_residual(name) and without_residual(name) == name


@pytest.mark.parametrize("name", ["bias+leakyrelu0.01+add+add", "bias+add+leakyrelu0.01", "bias+relu+add", "bias+leakyrelu0.010+add",
                                  "bias+swish+Add", "+add", "add", "bias+gelu+add", "", None])
def test_a_name_not_written_as_the_rule_writes_it_is_no_residual_fusion(name):
    assert not adds_residual(name) and not is_graph_fusion(name)


def test_only_an_activation_s_fusion_takes_a_residual():
    for name in ("bias+relu", "bias+add", "bias", F):
        with pytest.raises(ValueError, match="no graph-API activation fusion"):
            residual_fusion(name)


def test_the_residual_form_is_an_engine_fusion_a_cache_row_and_a_counter_of_its_own():
    config = EngineConfig.parse(FUSED)
    assert (config.engine_id, config.knobs, config.fusion) == (5, ((2, 1),), F) and config.algo == FUSED
    assert EngineConfig.parse("eng5_k2=1", F) == config and EngineConfig.parse("eng5", S).algo == "engine:eng5+" + S
    assert Algo.parse(FUSED) == Algo("engine", "eng5_k2=1", F) and str(Algo.parse(FUSED)) == FUSED
    assert Algo.parse(F) == Algo("pass", F) and Algo.parse(RESIDUAL_PASS) == Algo("pass", "add")  # the epilogue-pass rows
    with pytest.raises(ValueError, match="not a cuDNN engine configuration"):
        EngineConfig.parse("engine:eng5+bias+relu+add")
    with pytest.raises(ValueError, match="names the fusion"):
        EngineConfig.parse(FUSED, P)
    for name, counter in ((F, "fused_bias_leakyrelu_add"), (S, "fused_bias_swish_add"), (P, "fused_bias_leakyrelu")):
        f = graph_api.fusion_of(name)
        assert (f.name, f.counter, f.residual) == (name, counter, adds_residual(name)) and counter in graph_api.FUSION_COUNTERS
    assert graph_api.fusion_of(F).frontend_args == graph_api.fusion_of(P).frontend_args


def test_the_tuning_cache_and_the_annotation_keep_the_residual_form(tmp_path):
    rows = [row(F, 0.012, EPILOGUE_METHOD), row(RESIDUAL_PASS, 0.004, EPILOGUE_METHOD), row(P, 0.010, EPILOGUE_METHOD),
            row(FUSED, 0.02), row(SHORT, 0.019), row("engine:none+" + S, None, status="unsupported")]
    cache = TuningCache(tmp_path / "c.db")
    cache.put(H200, rows)
    got = {(r.algo, r.method, r.status) for r in cache.get(H200, SHAPE) if r.key == KEY}
    cache.close()
    assert got == {(r.algo, r.method, r.status) for r in rows}
    decisions = [annotation.ConvDecision(algo="gemm", engine="eng5", fusion=F), annotation.ConvDecision(algo="gemm", engine="eng5", fusion=P)]
    node = helper.make_node("Conv", ["x", "w"], ["y"], domain=annotation.DOMAIN, **annotation.decision_attributes(decisions))
    read = annotation.read_node(node, n_profiles=2).decisions
    assert [d.fusion for d in read] == [F, P] and EngineConfig.parse(read[0].engine, read[0].fusion).algo == "engine:eng5+" + F


# ---------------------------------------------------------------------------------------------
# which steps take the Add: the one rule (convpass.core.fusion.absorbed) on hand-built graphs

def _fusions(model: onnx.ModelProto, graph_fusions: bool = True) -> dict[str, str]:
    """Each conv's fusion, with the value shapes ONNX's shape inference gives (a residual of
    unknown shape is never taken)."""
    nodes = {n.name: n for n in ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(model)).graph}
    return {name: conv_fusion(node, graph_fusions) for name, node in nodes.items() if node.op_type == "Conv"}


def _edited(edit, **kw) -> onnx.ModelProto:
    model = csp_block_model(X, **kw)
    edit(model.graph)
    return model


def _node(graph, name):
    return next(n for n in graph.node if n.name == name)


@pytest.mark.parametrize("kw,c2", [
    ({}, F),
    ({"alpha": None}, F),  # ONNX's default alpha, as timm exports LeakyReLU()
    ({"alpha": 0.2}, "bias+leakyrelu0.2+add"),  # the alpha is the node's
    ({"residual_first": True}, F),  # Add(x, act): the residual is the Add's other operand either way
    ({"swish": True}, S),
    ({"readers": 2}, F),  # the Add's output read by two nodes: the step writes it
])
def test_a_residual_add_after_the_activation_is_the_step_s(kw, c2):
    found = _fusions(csp_block_model(X, **kw))
    assert found["c2"] == c2
    assert found["c1"] == ("bias+swish" if kw.get("swish") else "bias+leakyrelu0.2" if kw.get("alpha") == 0.2 else P)  # read by a conv, not an Add
    assert _fusions(csp_block_model(X, **kw), graph_fusions=False)["c2"] == "bias"  # only where engines are candidates


def _broadcast_residual(g):
    g.input.append(helper.make_tensor_value_info("g", onnx.TensorProto.FLOAT, [2, 16, 1, 1]))
    _node(g, "add").input[1] = "g"


def _read_twice(g):
    g.node.append(helper.make_node("Relu", ["a2"], ["extra"], name="extra"))
    g.output.append(helper.make_tensor_value_info("extra", onnx.TensorProto.FLOAT, None))


def _add_before_activation(g):
    """c2 -> Add(y2, x) -> LeakyRelu: ResNet's order (the legacy bias+add; the LeakyRelu stays apart)."""
    _node(g, "add").input[:] = ["y2", "x"]
    _node(g, "add").output[0] = "pre"
    _node(g, "l2").input[0] = "pre"
    _node(g, "l2").output[0] = "out"
    order = [_node(g, n) for n in ("c1", "l1", "c2", "add", "l2")]
    del g.node[:]
    g.node.extend(order)


def _residual_after_the_conv(g):
    """The residual is computed after c2 runs (a Neg placed after it): taking the Add would make a cycle."""
    g.node.insert(3, helper.make_node("Neg", ["x"], ["later"], name="later"))
    _node(g, "add").input[1] = "later"


def _self_add(g):
    _node(g, "add").input[:] = ["a2", "a2"]


def _concat_reads_the_sum(g):
    _node(g, "add").output[0] = "sum"
    g.node.append(helper.make_node("Concat", ["sum", "x"], ["out"], name="cat", axis=1))
    g.output[0].type.tensor_type.shape.dim[1].dim_value = 32


def _activation_is_a_graph_output(g):
    g.output.append(helper.make_tensor_value_info("a2", onnx.TensorProto.FLOAT, None))


@pytest.mark.parametrize("why,edit,c2", [
    ("the residual broadcasts (N, C, 1, 1)", _broadcast_residual, P),
    ("the activation is read twice", _read_twice, P),
    ("the activation is a graph output", _activation_is_a_graph_output, P),
    ("the Add comes before the activation", _add_before_activation, "bias+add"),
    ("the residual is computed after the conv", _residual_after_the_conv, P),
    ("the Add adds the activation to itself", _self_add, P),
    ("a Concat reads the Add's output (the Add's own pass writes its slice)", _concat_reads_the_sum, P),
])
def test_anything_else_is_no_residual_fusion(why, edit, c2):
    assert _fusions(_edited(edit))["c2"] == c2, why


def test_the_runtime_plan_absorbs_the_same_add_and_writes_its_output():
    from convpass.kernels.plan_steps import PlanSteps
    from convpass.runtime import Executor

    ex = Executor(csp_block_model(X, readers=2), device="cpu")
    ex.run(None, {"x": np.zeros(X, np.float32)})
    [plan] = ex._plans.values()
    ops = {st.node.name: i for i, st in enumerate(plan.steps)}
    view = PlanSteps(plan, set())
    view.conv = ops["c2"]
    a = absorbed(view, ops["c2"])
    x_slot, sum_slot = plan.steps[ops["c1"]].inputs[0], plan.steps[ops["add"]].outputs[0]
    assert (a.epilogue, a.nodes, a.z, a.output) == (F, (ops["l2"], ops["add"]), x_slot, sum_slot)
    assert (a.shorter.epilogue, a.shorter.nodes, a.shorter.z, a.shorter.output) == (P, (ops["l2"],), None, plan.steps[ops["l2"]].outputs[0])
    assert absorbed(view, ops["c2"], residual=False) == a.shorter  # the executor's residual fusion off
    taken = PlanSteps(plan, {ops["add"]})  # the Add already taken by another launch
    taken.conv = ops["c2"]
    assert absorbed(taken, ops["c2"]).epilogue == P


# ---------------------------------------------------------------------------------------------
# the fused step's result against the unfused ops (float64 NumPy)

def _leaky64(v, alpha=0.01):
    return np.where(v > 0, v, float(np.float32(alpha)) * v)


def _conv64(x, w, b, pads):
    """float64 conv (stride 1, no groups), channels first."""
    x = np.pad(np.asarray(x, np.float64), [(0, 0), (0, 0), (pads, pads), (pads, pads)])
    w = np.asarray(w, np.float64)
    kh, kw = w.shape[2:]
    h, wd = x.shape[2] - kh + 1, x.shape[3] - kw + 1
    y = np.zeros((x.shape[0], w.shape[0], h, wd))
    for i in range(kh):
        for j in range(kw):
            y += np.einsum("nchw,kc->nkhw", x[:, :, i:i + h, j:j + wd], w[:, :, i, j])
    return y + np.asarray(b, np.float64).reshape(1, -1, 1, 1)


def _block64(model, x):
    """csp_block_model's output (``readers=0``) op by op in float64."""
    w = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    a1 = _leaky64(_conv64(x, w["w1"], w["b1"], 0))
    return _leaky64(_conv64(a1, w["w2"], w["b2"], 1)) + np.asarray(x, np.float64)


def test_the_fused_epilogue_adds_the_residual_after_the_activation():
    rng = np.random.default_rng(3)
    pre, z = rng.standard_normal((2, 4, 5, 5)), rng.standard_normal((2, 4, 5, 5))
    got = graph_api.fusion_of(F).reference(np, pre, z)
    np.testing.assert_allclose(got, _leaky64(pre) + z, rtol=0, atol=1e-15)
    assert np.abs(got - _leaky64(pre + z)).max() > 1e-2  # not ResNet's order
    with pytest.raises(ValueError, match="needs its residual"):
        graph_api.fusion_of(F).reference(np, pre)
    np.testing.assert_array_equal(graph_api.fusion_of(P).reference(np, pre, z), _leaky64(pre))  # no residual: z is not read


def _cpu_convolutions():
    """The cuda backend's conv family over NumPy (``cp`` = numpy), every conv resolved to the
    reference kernel: the path a launch that owns a fused epilogue takes where its engine cannot run."""
    from convpass.kernels import convolution

    rt = types.SimpleNamespace(cp=np, counters={"reference_convs": 0, "epilogue_passes": 0}, recorded_device="", current_device=None,
                               warn_node=lambda n, m: None)
    convs = convolution.Convolutions(rt)
    convs.resolve = lambda call, dtype, fusion=None: convolution.REFERENCE  # type: ignore[method-assign]
    return convs


def test_a_fused_step_that_falls_back_computes_the_unfused_ops():
    """Conv 2 of the block run as one step that owns LeakyRelu and the Add (its engine unusable:
    the conv, then the activation, then z), against the ops one by one in float64."""
    from convpass.runtime import Executor

    model = csp_block_model(X)
    ex = Executor(model, device="cpu")
    x = np.random.default_rng(4).standard_normal(X).astype(np.float32)
    ex.run(None, {"x": x})
    [plan] = ex._plans.values()
    call = next(st.node.prepared for st in plan.steps if st.node.name == "c2")
    w = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    a1 = _leaky64(_conv64(x, w["w1"], w["b1"], 0)).astype(np.float32)
    convs = _cpu_convolutions()
    got = convs.run(call, a1, w["w2"], w["b2"], z=x, fusion=F, fused=True)
    want = _block64(model, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert convs.rt.counters["epilogue_passes"] == 1  # the activation and z after the conv: a pass of their own
    legacy = convs.run(call, a1, w["w2"], w["b2"], z=x)  # a legacy residual step: z before the activation (none here)
    np.testing.assert_allclose(legacy, _conv64(a1, w["w2"], w["b2"], 1) + x, rtol=1e-5, atol=1e-5)


def test_a_tuned_model_records_each_form_and_runs_like_the_ops_in_float64(tmp_path):
    for fused_ms, c2 in ((0.020, ("eng5_k2=1", F)), (0.025, ("eng5_k2=1", P)), (0.040, (None, None))):
        tuned = _tuned(tmp_path / str(fused_ms), fused_ms)
        onnx.checker.check_model(tuned, full_check=True)
        records = {r["node"]: (r["engine"], r["fusion"]) for r in convpass.inspect(tuned)}
        assert records == {"c1": ("eng5_k2=1", P), "c2": c2}, fused_ms
    x = np.random.default_rng(5).standard_normal(X).astype(np.float32)
    want = _block64(csp_block_model(X), x)
    np.testing.assert_allclose(convpass.Executor(tuned, device="cpu").run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run_ort(tuned, {"x": x})[0], want, rtol=1e-5, atol=1e-5)  # the annotated model still runs in ONNX Runtime


def _tuned(tmp_path, fused_ms, fused_key=KEY):
    """csp_block_model tuned from a cache: both convs' legacy and shorter-graph rows, c2's residual
    rows (its fused graph at ``fused_ms``: 0.020 wins; 0.025 loses to the shorter graph plus the
    Add, 0.023; 0.040 too, the shorter graph still wins)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    rows = []
    for key in (SHAPE1.key("nhwc", "default"), KEY):
        rows += [row("implicit_gemm", 0.020, key=key), row("implicit_gemm", None, "heuristic", key=key, hr=0),
                 row(P, 0.010, EPILOGUE_METHOD, key=key), row(SHORT, 0.019, key=key)]
    rows += [row(F, 0.012, EPILOGUE_METHOD), row(RESIDUAL_PASS, 0.004, EPILOGUE_METHOD), row(FUSED, fused_ms, key=fused_key)]
    if fused_ms >= 0.040:
        rows = [r for r in rows if r.algo != SHORT or r.key != KEY]  # and no shorter graph either: the conv, then one pass
    cache = TuningCache(tmp_path / "c.db")
    cache.put(H200, rows)
    cache.close()
    return convpass.optimize(csp_block_model(X), cache=tmp_path / "c.db", device_name=str(H200), quiet=True, tf32="on", layout="nhwc")


# ---------------------------------------------------------------------------------------------
# the choice: fused graph, shorter graph + the Add's pass, unfused + one pass

PROBLEM = ConvProblem((SHAPE,), F)
BASE = [row("implicit_gemm", 0.020), row("engine:eng8", 0.018), row(F, 0.012, EPILOGUE_METHOD), row(P, 0.010, EPILOGUE_METHOD),
        row(RESIDUAL_PASS, 0.004, EPILOGUE_METHOD), row(SHORT, 0.019)]
OPTIONS = TuneOptions(tf32="on", layout="nhwc")


@pytest.mark.parametrize("extra,winner,cost", [
    ([row(FUSED, 0.020)], FUSED, 0.020),  # the fused graph: its own time
    ([row(FUSED, 0.025)], SHORT, 0.023),  # the shorter graph plus the Add's pass
    ([row("engine:none+" + F, None, status="unsupported")], SHORT, 0.023),  # no engine: "does not apply", the plain path stays
    ([row(FUSED, 0.040), row(SHORT, 0.040)], "engine:eng8", 0.030),  # the best unfused plus the activation and the Add in one pass
])
def test_each_form_is_costed_on_one_clock(extra, winner, cost):
    rows = [r for r in BASE if not any(r.algo == e.algo for e in extra)] + extra
    chosen = select(rows, PROBLEM, OPTIONS)
    assert chosen.algo == winner
    assert cost_ms(chosen, epilogue_ms(rows, PROBLEM), F, residual_ms(rows, PROBLEM)) == pytest.approx(cost)
    assert choice_from(chosen, "measure", rows, PROBLEM).time_ms == pytest.approx(cost)


def test_each_form_needs_the_pass_it_is_costed_with():
    no_add = [r for r in BASE if r.algo != RESIDUAL_PASS]
    assert select(no_add, PROBLEM, OPTIONS).algo == "engine:eng8"  # the shorter graph's cost is not known without the Add's pass
    assert residual_ms(no_add, PROBLEM) == {} and residual_ms(BASE, PROBLEM) == {KEY: 0.004}
    assert cost_ms(row(SHORT, 0.019), epilogue_ms(BASE, PROBLEM), F) is None  # not costed without it either
    no_pass = [r for r in BASE if r.algo != F] + [row(FUSED, 0.001)]
    assert select(no_pass, PROBLEM, OPTIONS).algo == "engine:eng8"  # the fused graph is not comparable without its own pass row
    other = "engine:eng5+bias+leakyrelu0.2+add"  # another alpha's graph is no candidate
    assert select(BASE + [row(other, 0.001)], PROBLEM, OPTIONS).algo == SHORT
    plain = ConvProblem((SHAPE,), P)  # a conv without the residual: neither the fused graph nor the Add's row counts
    assert select(BASE + [row(FUSED, 0.001)], plain, OPTIONS).algo == SHORT and residual_ms(BASE, plain) == {}
    assert select(BASE + [row(FUSED, 0.001)], PROBLEM, TuneOptions(tf32="on", layout="nhwc", engines="legacy")).algo == "implicit_gemm"


def test_the_cache_is_complete_with_both_graphs_and_the_add_s_pass():
    from convpass.core.cudnn_enums import algo_names

    have = [row(a, 0.01 * (i + 1)) for i, a in enumerate(algo_names("fwd"))] + [row("implicit_gemm", None, method="heuristic", hr=0),
                                                                               row("engine:eng8", 0.02)]
    full = [row(F, 0.012, EPILOGUE_METHOD), row(RESIDUAL_PASS, 0.004, EPILOGUE_METHOD), row("engine:none+" + F, None, status="unsupported"),
            row(P, 0.010, EPILOGUE_METHOD), row(SHORT, 0.019)]
    check = lambda rows: tuner.complete(rows, [KEY], "measure", None, True, True, F)  # noqa: E731
    assert check(have + full)
    for missing in full:
        assert not check(have + [r for r in full if r is not missing]), missing.algo
    assert tuner.fused_complete(full, KEY, P) and not tuner.fused_complete(full[:3], KEY, F)


class _Fused:
    """Candidates stood in for: measure_fused records what it was asked for."""

    def __init__(self):
        self.asked = []

    def measure_fused(self, key, fusion, best):
        self.asked.append(fusion)
        rows = [row(fusion, 0.01, EPILOGUE_METHOD, key=key), row(f"engine:eng1+{fusion}", 0.02, key=key)]
        return rows + ([row(RESIDUAL_PASS, 0.004, EPILOGUE_METHOD, key=key)] if adds_residual(fusion) else [])


def test_the_tuner_times_the_fused_graph_and_its_shorter_one_once():
    fake = _Fused()
    rows = tuner.measure_graph_fusion(fake, KEY, F, None, [])
    assert fake.asked == [F, P] and tuner.fused_complete(rows, KEY, F)
    fake = _Fused()
    tuner.measure_graph_fusion(fake, KEY, F, None, [row(P, 0.01, EPILOGUE_METHOD), row(SHORT, 0.019)])  # another conv measured it
    assert fake.asked == [F]
    fake = _Fused()
    tuner.measure_graph_fusion(fake, KEY, P, None, [])
    assert fake.asked == [P]


def test_the_add_s_pass_is_no_problem_of_its_own_for_the_pruning_history():
    from convpass.tuning.prune import problems_of

    assert set(problems_of(BASE)) == {(KEY, F), (KEY, P)}


# ---------------------------------------------------------------------------------------------
# the tuner's rows (stand-ins: the "times" are the fakes' numbers; statuses and checks are tested)

class _ResidualPlan:
    """Fused configurations of F: 1 right, 2 wrong (forgets the residual), 3 not buildable."""

    def __init__(self, key, config, enumerated=None):
        if config.engine_id == 3:
            raise graph_api.GraphApiError(f"cuDNN does not build eng3 ({F}): NOT_SUPPORTED")
        self.config, self.workspace_bytes = config, 0
        self.seen = []

    def execute(self, x, w, y, workspace=None, bias=None, z=None):
        assert z is not None and z.shape == y.shape and z is not y
        pre = x.sum() + bias.reshape(1, -1, 1, 1)
        act = np.where(pre > 0, pre, np.float32(0.01) * pre)
        y[...] = act + z if self.config.engine_id == 1 else act


@pytest.fixture
def residual_bench(monkeypatch):
    from convpass.tuning import candidates, harness

    monkeypatch.setattr(graph_api, "EnginePlan", _ResidualPlan)
    offer_configs(monkeypatch, lambda key, fusion="": [EngineConfig(i, (), fusion) for i in (1, 2, 3)])
    launched = []
    monkeypatch.setattr(candidates, "_activation_kernel", lambda fusion: lambda *arrays: launched.append((fusion, len(arrays))))
    monkeypatch.setattr(harness, "time_launches", lambda launch, sets, best_ms=None, **_: (launch(0), harness.Timing(0.004, 10, 0.0, early_stop=False, eager=False))[1])
    added = []
    # x below 0: conv + bias negative, where the LeakyRelu is far from identity; z (0.25) moves it across 0
    bench = numpy_candidates(monkeypatch, SHAPE, fill=0.25, x_value=-1e-2, where=np.where,
                             add=lambda a, b, out: added.append(a.shape) or np.add(a, b, out=out))
    bench.launched, bench.added = launched, added
    return bench


def test_a_residual_fusion_gets_both_passes_and_every_fused_configuration_a_checked_row(residual_bench):
    rows = residual_bench.measure_fused(SHAPE.key("nchw", "default"), F, best_ms=0.02)
    assert [(r.algo, r.method, r.status) for r in rows] == [
        (F, EPILOGUE_METHOD, "ok"), (RESIDUAL_PASS, EPILOGUE_METHOD, "ok"), ("engine:eng1+" + F, "measure", "ok"),
        ("engine:eng2+" + F, "measure", "wrong_result"), ("engine:eng3+" + F, "measure", "unsupported")]
    assert residual_bench.launched == [(F, 3)] and residual_bench.added == [SHAPE.y_shape]  # act(y) + z in one pass; the Add alone
    assert "activation and its residual Add as one pass" in rows[0].note and "residual Add as its own pass" in rows[1].note
    assert f"fused {F} in one call" in rows[2].note and "NOT_SUPPORTED" in rows[4].note


def test_no_fused_residual_engine_is_recorded_as_a_value(residual_bench, monkeypatch):
    def refuse(key, fusion=""):
        raise graph_api.GraphApiError("cuDNN's graph API has no engine for this")

    offer_configs(monkeypatch, refuse)
    rows = residual_bench.measure_fused(SHAPE.key("nchw", "default"), F, best_ms=None)
    assert [(r.algo, r.status) for r in rows] == [(F, "ok"), (RESIDUAL_PASS, "ok"), ("engine:none+" + F, "unsupported")]


# ---------------------------------------------------------------------------------------------
# the operation graph the graph API is given

def _arr(ptr, nbytes=64):
    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr), nbytes=nbytes)


def test_the_fused_graph_adds_the_residual_after_the_activation_with_the_output_s_layout(frontend):
    from convpass.native.cudnn.descriptors import descriptor_params

    plan = graph_api.EnginePlan(KEY, EngineConfig.parse("eng5", F))
    y = descriptor_params(KEY).y
    ops = [c for c in frontend.calls if c[0] in ("conv", "bias", "leaky_relu", "swish", "add")]
    assert [c[0] for c in ops] == ["conv", "bias", "leaky_relu", "add"]  # conv -> add(bias) -> activation -> add(z)
    assert ("leaky_relu", float(np.float32(0.01))) in ops and ("add", 6, 8) in ops  # the activation's output, then z
    assert ("tensor", "z", tuple(y.dims), tuple(y.strides)) in frontend.calls  # z: the output's dims and (NHWC) strides
    plan.execute(_arr(100), _arr(200), _arr(300), _arr(900), bias=_arr(400), z=_arr(500))
    assert frontend.calls[-1] == ("execute", "eng5", (100, 200, 300, 400, 500), 900)
    with pytest.raises(graph_api.GraphApiError, match="takes a residual"):
        plan.execute(_arr(100), _arr(200), _arr(300), _arr(900), bias=_arr(400))
    with pytest.raises(graph_api.GraphApiError, match="must not alias"):
        plan.execute(_arr(100), _arr(200), _arr(300), _arr(900), bias=_arr(400), z=_arr(332))  # overlaps y
    shorter = graph_api.EnginePlan(KEY, EngineConfig.parse("eng5", P))
    with pytest.raises(graph_api.GraphApiError, match="takes no residual"):
        shorter.execute(_arr(100), _arr(200), _arr(300), _arr(900), bias=_arr(400), z=_arr(500))
    swish = graph_api.EnginePlan(KEY, EngineConfig.parse("eng5", S))
    assert swish.config.fusion == S and [c[0] for c in frontend.calls if c[0] in ("bias", "swish", "add")][-3:] == ["bias", "swish", "add"]


def test_the_overlap_check_reads_strides():
    a = types.SimpleNamespace(data=types.SimpleNamespace(ptr=1000), shape=(2, 3), strides=(24, 4), itemsize=4)
    assert graph_api._overlap(a, _arr(1032, 4)) and not graph_api._overlap(a, _arr(1036, 4))  # a's last element: 1000 + 24 + 2 * 4
    assert not graph_api._overlap(a, _arr(900, 100)) and graph_api._overlap(a, _arr(900, 101))


def test_a_stored_residual_plan_loads_with_its_residual_tensor_and_nothing_else(frontend, monkeypatch):
    config = EngineConfig.parse("eng5", F)
    data = graph_api.EnginePlan(KEY, config).serialize(verify=False)
    head, _, blob = data.partition(b"\n")
    header = json.loads(head)
    assert len(header["uids"]) == 5 and header["algo"] == config.algo  # x, w, y, then the bias and the residual
    loaded = graph_api.EnginePlan.load(KEY, config, data)
    loaded.execute(_arr(100), _arr(200), _arr(300), _arr(900), bias=_arr(400), z=_arr(500))
    assert frontend.calls[-1][0] == "execute" and 500 in frontend.calls[-1][2]
    header["uids"] = header["uids"][:4]  # a plan stored without its residual tensor
    with pytest.raises(graph_api.GraphApiError, match="no residual tensor"):
        graph_api.EnginePlan.load(KEY, config, json.dumps(header, sort_keys=True).encode() + b"\n" + blob)


# ---------------------------------------------------------------------------------------------
# the executor's choice and lowering (cuDNN stood in for: no GPU)

def _call(fusion):
    return recorded_call("c2", SHAPE, KEY, fusion)


def test_a_residual_decision_runs_its_engine_with_z_and_counts_under_its_own_counter(convs):
    from convpass.kernels.conv_exec import conv_exec

    ex = convs.resolve(_call(F), np.float32, F)
    assert ex.algo == FUSED and ex.conv.fused and ex.conv.residual and convs.warned == []
    assert ex.conv.counts == ("graph_api_calls", "fused_bias_leakyrelu_add")
    seen = []
    plan = types.SimpleNamespace(config=EngineConfig.parse(FUSED), workspace_bytes=0,
                                 execute=lambda x, w, y, ws, **kw: seen.append(sorted(kw.items())))
    cp = types.SimpleNamespace(cuda=fake_cuda([]))
    conv_exec(KEY, FUSED, F, cp=cp, plan=plan).launch("x", "w", "y", None, "b", "z")
    short = types.SimpleNamespace(config=EngineConfig.parse(SHORT), workspace_bytes=0, execute=plan.execute)
    conv_exec(KEY, SHORT, P, cp=cp, plan=short).launch("x", "w", "y", None, "b", None)
    assert seen == [[("bias", "b"), ("z", "z")], [("bias", "b")]]


def test_a_decision_for_another_form_or_alpha_than_the_plan_s_warns_and_runs_the_legacy_algorithm(convs):
    for recorded, planned in ((F, P), ("bias+leakyrelu0.2+add", F), (P, F)):
        convs.warned.clear()
        ex = convs.resolve(_call(recorded), np.float32, planned)
        assert (ex.algo, ex.engine) == ("implicit_gemm", None), (recorded, planned)
        [message] = convs.warned
        assert f"fused graph conv + {recorded}" in message


@pytest.mark.parametrize("fused_ms,epilogue,absorbs", [
    (0.020, ("engine", F, "x"), ("l2", "add")),  # the fused graph: the Add absorbed, its output the launch's
    (0.025, ("engine", P, None), ("l2",)),  # the shorter graph: the Add stays the plan's own step
])
def test_the_lowering_absorbs_what_the_decision_runs(tmp_path, convs, fused_ms, epilogue, absorbs):
    from convpass.kernels.convolution import lower_convs
    from convpass.runtime import Executor

    ex = Executor(_tuned(tmp_path, fused_ms), device="cpu")
    ex.run(None, {"x": np.zeros(X, np.float32)})
    [plan] = ex._plans.values()
    names = {i: st.node.name for i, st in enumerate(plan.steps)}
    launches = {names[i]: launch for i, launch in lower_convs(plan, convs, fuse=True, fuse_residual=True).items()}
    c2 = launches["c2"]
    x_slot = plan.steps[0].inputs[0]
    want = (epilogue[0], epilogue[1], x_slot if epilogue[2] else None)
    assert c2.epilogue == want and tuple(names[k] for k in c2.absorbs) == absorbs and c2.fusion == epilogue[1]
    last = next(i for i, n in names.items() if n == absorbs[-1])
    assert c2.outputs == (plan.steps[last].outputs[0],) and c2.label == "Conv+" + epilogue[1]
    assert c2.supports_placement == (epilogue[2] is None)  # the activation's graph alone may write a Concat slice, never with its residual
    assert launches["c1"].epilogue == ("engine", P, None) and convs.warned == []
    off = lower_convs(plan, convs, fuse=True, fuse_residual=False)  # residual fusion off: the shorter graph at most
    assert off[next(i for i, n in names.items() if n == "c2")].epilogue == (("engine", P, None) if epilogue[1] == P else None)

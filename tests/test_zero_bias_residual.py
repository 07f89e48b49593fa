"""A residual Add (and its Relu) after a conv without a bias runs inside the conv's step, with a
zero bias (:mod:`convpass.core.fusion`, "A conv without a bias"), on the CPU: the one absorption
rule on hand-built graphs, the compiler's and the runtime's answers alike (and its negatives), the
tuner's problem (the biased conv's own), the tuned model (it still runs in ONNX Runtime), the
lowering, and the cuda backend's plan run over NumPy stand-ins for CuPy and cuDNN against ONNX
Runtime CPU, with its counters: the Add and the Relu are no launches of their own."""

from __future__ import annotations

import collections
import sys
import types

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from bit_block import bit_block, bit_input
from conftest import run_ort
from onnx import TensorProto, helper, numpy_helper

import convpass
from convpass.compiler.passes.canonicalize_convs import canonicalize_conv
from convpass.core.device import DeviceFingerprint
from convpass.core.fusion import absorbed
from convpass.core.options import TuneOptions
from convpass.kernels.plan_steps import PlanSteps
from convpass.runtime import Executor
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.decide import EPILOGUE_METHOD

H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)
X = (2, 8, 6, 6)
F = "bias+add+relu"


# ---------------------------------------------------------------------------------------------
# the rule: the compiler (onnx-ir graph) and the runtime (the executor's plan) give each conv the same step

def _compiled(model: onnx.ModelProto) -> dict[str, str]:
    """Each conv's fusion as the compiler tunes it (the optimize pipeline's problems)."""
    return {name: p.fusion for name, p in _problems(model).items()}


def _planned(model: onnx.ModelProto, feeds: dict | None = None) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """Each conv's epilogue and absorbed nodes as the runtime's lowering finds them in the CPU
    executor's plan (convs in plan order, a step taken by one launch not free for the next)."""
    ex = Executor(model, device="cpu")
    ex.run(None, feeds or bit_input(X))
    plan = ex.last_plan
    view = PlanSteps(plan, set())
    found, nodes = {}, {}
    for i, st in enumerate(plan.steps):
        if st.node.prepared is not None and st.node.op_type in ("Conv", "ConvTranspose"):
            view.conv = i
            a = absorbed(view, i)
            view.taken.update(a.nodes)
            found[st.node.name] = a.epilogue
            nodes[st.node.name] = tuple(plan.steps[k].node.name for k in a.nodes)
    return found, nodes


def _node(graph, name):
    return next(n for n in graph.node if n.name == name)


def _edited(edit, **kw) -> onnx.ModelProto:
    model = bit_block(X, **kw)
    edit(model.graph)
    return model


def _read_twice(value):
    """An edit: ``value`` read by one more node (a Neg whose output is a graph output)."""

    def edit(g):
        g.node.append(helper.make_node("Neg", [value], ["peek"], name="peek"))
        g.output.append(helper.make_tensor_value_info("peek", TensorProto.FLOAT, list(X)))

    return edit


def _an_output(value):
    """An edit: ``value`` a graph output too."""

    def edit(g):
        g.output.append(helper.make_tensor_value_info(value, TensorProto.FLOAT, list(X)))

    return edit


def _residual_after_the_conv(g):
    """The shortcut is computed after c2 runs (a Neg placed after it): taking the Add would make a cycle."""
    at = list(g.node).index(_node(g, "c2")) + 1
    g.node.insert(at, helper.make_node("Neg", ["x"], ["later"], name="later"))
    _node(g, "add").input[1] = "later"


def _broadcast_residual(g):
    g.input.append(helper.make_tensor_value_info("gate", TensorProto.FLOAT, [X[0], X[1], 1, 1]))
    _node(g, "add").input[1] = "gate"


def _self_add(g):
    _node(g, "add").input[:] = ["c2_y", "c2_y"]


def _bias_a_graph_input(g):
    g.input.append(helper.make_tensor_value_info("b2", TensorProto.FLOAT, [X[1]]))
    _node(g, "c2").input.append("b2")


def _relu_alone(g):
    """c2 -> Relu, no residual: a conv without a bias absorbs nothing but a residual Add."""
    _node(g, "add").input[:] = ["x", "x"]
    _node(g, "relu").input[0] = "c2_y"
    _node(g, "add").output[0] = "twice"
    g.output.append(helper.make_tensor_value_info("twice", TensorProto.FLOAT, list(X)))


def _feeds(model):
    f = bit_input(X)
    for v in model.graph.input[1:]:
        f[v.name] = np.random.default_rng(2).standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]).astype(np.float32)
    return f


@pytest.mark.parametrize("why,model,c2,absorbs", [
    ("absorbed without a bias: the Add and its Relu", bit_block(X), F, ("add", "relu")),
    ("no Relu after the Add", bit_block(X, relu=False), "bias+add", ("add",)),
    ("the biased conv's own step", bit_block(X, bias=True), F, ("add", "relu")),
    ("the Add's output read by another node too: the Add alone, the step writes its output", _edited(_read_twice("sum")), "bias+add", ("add",)),
    ("the Add's output a graph output: the Add alone", _edited(_an_output("sum")), "bias+add", ("add",)),
    ("the conv's output read by another node too", _edited(_read_twice("c2_y")), "", ()),
    ("the conv's output a graph output", _edited(_an_output("c2_y")), "", ()),
    ("the shortcut computed after the conv", _edited(_residual_after_the_conv), "", ()),
    ("the shortcut broadcasts (N, C, 1, 1)", _edited(_broadcast_residual), "", ()),
    ("the Add adds the conv's output to itself", _edited(_self_add), "", ()),
    ("a bias the graph computes (no constant)", _edited(_bias_a_graph_input), "", ()),
    ("a Relu without a residual: nothing", _edited(_relu_alone), "", ()),
])
def test_a_conv_without_a_bias_takes_the_residual_add_where_a_biased_one_would(why, model, c2, absorbs):
    compiled = _compiled(model)
    planned, nodes = _planned(model, _feeds(model))
    assert compiled.get("c2", "") == c2 and planned["c2"] == c2 and nodes["c2"] == absorbs, why
    assert compiled == {k: v for k, v in planned.items() if k in compiled}, why  # a conv whose bias the graph computes is not tuned
    assert compiled["c1"] == ("bias" if "bias" in why and "biased" in why else "")  # read by a GroupNorm


def test_the_downsampled_shortcut_s_conv_is_computed_first_and_the_main_conv_takes_the_add():
    """The stage's first block: Add(c2, down(p)), both convs without a bias and read only by the
    Add. ``down`` runs before c2, so its other operand is not ready: only c2 takes the Add."""
    model = bit_block(X, 16, shortcut="conv")
    compiled = _compiled(model)
    planned, nodes = _planned(model)
    assert compiled == planned == {"down": "", "c1": "", "c2": F}
    assert nodes["c2"] == ("add", "relu")


def test_a_residual_step_off_leaves_a_conv_without_a_bias_bare():
    ex = Executor(bit_block(X), device="cpu")
    ex.run(None, bit_input(X))
    plan = ex.last_plan
    view = PlanSteps(plan, set())
    c2 = next(i for i, st in enumerate(plan.steps) if st.node.name == "c2")
    view.conv = c2
    assert absorbed(view, c2, residual=False).epilogue == "" and absorbed(view, c2).epilogue == F
    assert PlanSteps(plan, set()).inputs(c2)[2:] == ()  # the plan's conv has no bias input at all


def test_a_convtranspose_without_a_bias_takes_no_residual_add():
    """A ConvTranspose's only epilogue is a Relu that is its only reader (its bias is a pass after
    cuDNN's backward data): its residual Add stays the plan's."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["t"], name="up", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["t", "x"], ["s"], name="add"), helper.make_node("Relu", ["s"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(X))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(X))],
                              [numpy_helper.from_array((rng.standard_normal((8, 8, 3, 3)) * 0.1).astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    planned, nodes_ = _planned(model)
    assert planned == {"up": ""} and nodes_ == {"up": ()}
    problems = _problems(model)
    assert [(p.direction, p.fusion) for p in problems.values()] == [("dgrad", "")]


# ---------------------------------------------------------------------------------------------
# the tuner's problem: the biased conv's own

def _problems(model: onnx.ModelProto, engines: str = "legacy") -> dict[str, object]:
    from convpass.compiler.pipeline import OptimizeReport, prepare_model

    found = prepare_model(ir.serde.deserialize_model(model), TuneOptions(engines=engines), [], OptimizeReport())
    return {use.node.name: p for p, uses in found.items() for use in uses}


@pytest.mark.parametrize("engines", ["legacy", "all"])
def test_the_tuner_s_problem_is_the_one_it_would_be_with_a_bias(engines):
    plain, biased = _problems(bit_block(X), engines), _problems(bit_block(X, bias=True), engines)
    assert plain["c2"] == biased["c2"] and hash(plain["c2"]) == hash(biased["c2"]) and plain["c2"].fusion == F
    assert (plain["c1"].fusion, biased["c1"].fusion) == ("", "bias")  # read by a GroupNorm: nothing to absorb
    assert _problems(bit_block(X, relu=False), engines)["c2"].fusion == "bias+add"


# ---------------------------------------------------------------------------------------------
# the tuned model

SHAPE1 = canonicalize_conv("Conv", {}, X, (8, 8, 1, 1)).shapes[0]
SHAPE2 = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, X, (8, 8, 3, 3)).shapes[0]
KEY1, KEY2 = SHAPE1.key("nhwc", "default"), SHAPE2.key("nhwc", "default")


def _row(key, algo, time_ms, method="measure", hr=None):
    return Measurement(key, algo, "ok", time_ms, 0, True, 1.0, method, heuristic_rank=hr)


def _tuned(tmp_path, fused_ms: float, **kw) -> onnx.ModelProto:
    """bit_block tuned from a cache (no GPU): c2's fused call at ``fused_ms`` against the conv
    (0.020) plus its one pass (0.008): 0.010 wins, 0.040 loses."""
    rows = []
    for key in (KEY1, KEY2):
        rows += [_row(key, "implicit_gemm", 0.020), _row(key, "implicit_gemm", None, "heuristic", hr=0)]
    rows += [_row(KEY2, F, 0.008, EPILOGUE_METHOD), _row(KEY2, "implicit_gemm+" + F, fused_ms)]
    cache = TuningCache(tmp_path / "c.db")
    cache.put(H200, rows)
    cache.close()
    return convpass.optimize(bit_block(X, **kw), cache=tmp_path / "c.db", device_name=str(H200), quiet=True, tf32="on", layout="nhwc",
                             engines="legacy")


@pytest.mark.parametrize("fused_ms,fusion,time_ms", [(0.010, F, 0.010), (0.040, None, 0.028)])
def test_the_tuned_model_records_the_step_and_still_runs_in_onnx_runtime(tmp_path, fused_ms, fusion, time_ms):
    tuned = _tuned(tmp_path, fused_ms)
    onnx.checker.check_model(tuned, full_check=True)
    records = {r["node"]: r for r in convpass.inspect(tuned)}
    assert (records["c2"]["algo"], records["c2"]["fusion"]) == ("implicit_gemm", fusion)
    assert records["c2"]["time_ms"] == pytest.approx(time_ms)  # the step's time: the fused call, or the conv and its pass
    assert records["c1"]["fusion"] is None
    c2 = _node(tuned.graph, "c2")
    assert (c2.op_type, list(c2.input)) == ("ConvNoBias", ["h", "c2_w"])  # no bias in the model: the zero is the executor's
    assert [n.op_type for n in tuned.graph.node if n.name in ("add", "relu")] == ["Add", "Relu"]  # the graph keeps them
    feeds = bit_input(X)
    want = run_ort(bit_block(X), feeds)[0]
    np.testing.assert_allclose(run_ort(tuned, feeds)[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(Executor(tuned, device="cpu").run(None, feeds)[0], want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# the lowering

def test_the_lowering_absorbs_the_add_and_the_relu_and_reads_a_zero_bias(tmp_path, convs):
    from convpass.kernels.convolution import lower_convs

    for bias in (False, True):
        ex = Executor(_tuned(tmp_path / str(bias), 0.010, bias=bias), device="cpu")
        ex.run(None, bit_input(X))
        plan = ex.last_plan
        names = {i: st.node.name for i, st in enumerate(plan.steps)}
        index = {n: i for i, n in names.items()}
        launches = {names[i]: launch for i, launch in lower_convs(plan, convs, fuse=True, fuse_residual=True).items()}
        c2 = launches["c2"]
        assert c2.epilogue == ("residual", plan.feed_slots["x"], "relu") and tuple(names[k] for k in c2.absorbs) == ("add", "relu")
        assert c2.outputs == plan.steps[index["relu"]].outputs and c2.label == "Conv+residual+relu" and not c2.supports_placement
        assert (c2.zero_bias, launches["c1"].zero_bias, launches["c1"].epilogue) == (not bias, False, None)
        off = lower_convs(plan, convs, fuse=True, fuse_residual=False)[index["c2"]]
        assert (off.epilogue, off.absorbs, off.zero_bias) == (None, (), False)
    assert convs.warned == []


# ---------------------------------------------------------------------------------------------
# the cuda backend's plan on NumPy: cuDNN and CuPy stood in for

class _Cudnn:
    """cuDNN's forward calls by the reference conv; each fused call's bias kept."""

    def __init__(self):
        self.biases: list[np.ndarray] = []

    @staticmethod
    def _conv(descs, x, w):
        from convpass.ops.conv import conv_reference

        g = descs.geometry
        return conv_reference(np, np.ascontiguousarray(x), np.ascontiguousarray(w), None, g)

    def run(self, descs, direction, algo, x, w, y, workspace=None, **strided):
        assert not strided
        y[...] = self._conv(descs, x, w)

    def fused(self, descs, algo, x, w, y, bias, z=None, activation="relu", workspace=None, **strided):
        self.biases.append(bias)
        v = self._conv(descs, x, w) + bias.reshape(1, -1, 1, 1) + (0 if z is None else z)
        y[...] = np.maximum(v, 0) if activation == "relu" else v


def _numpy_epilogue(cp, bias, residual, relu, source=False):
    def run(*args):
        *operands, y = args
        v = sum(operands) if source else (y + sum(operands) if operands else y.copy())
        y[...] = np.where(v < 0, 0, v) if relu else v

    return run


@pytest.fixture
def numpy_backend(monkeypatch):
    """A cuda backend stand-in over NumPy: ``(rt, cudnn stand-in)``. Geometry per key from the
    descriptors (the stand-in's), element-wise groups left to the op library."""
    from convpass.kernels import conv_exec, elementwise
    from convpass.kernels.convolution import Convolutions
    from convpass.native import cudnn
    from convpass.ops.conv import conv_geometry

    fake_cp = types.ModuleType("cupy")
    for name in ("empty", "zeros", "uint8", "ascontiguousarray", "maximum", "add", "copyto"):
        setattr(fake_cp, name, getattr(np, name))
    monkeypatch.setitem(sys.modules, "cupy", fake_cp)
    geometries = {KEY1: conv_geometry("Conv", {"pads": [0, 0, 0, 0]}, X, (8, 8, 1, 1)),
                  KEY2: conv_geometry("Conv", {"pads": [1, 1, 1, 1]}, X, (8, 8, 3, 3))}
    stand_in = _Cudnn()
    monkeypatch.setattr(cudnn, "ConvDescriptors", lambda key: types.SimpleNamespace(key=key, geometry=geometries[key]))
    monkeypatch.setattr(cudnn, "workspace_size", lambda *a, **k: 0)
    monkeypatch.setattr(cudnn, "run", stand_in.run)
    monkeypatch.setattr(cudnn, "conv_bias_activation_forward", stand_in.fused)
    monkeypatch.setattr(conv_exec, "epilogue_kernel", _numpy_epilogue)
    monkeypatch.setattr(elementwise, "plan_groups", lambda *a, **k: [])
    rt = types.SimpleNamespace(
        cp=fake_cp, xp=np, fuse=True, fuse_residual=True, matmul_epilogues=False, kernels=False, concat_in_place=False, cuda_graph=False,
        counters=collections.Counter(), capturing=False, recorded_device="", current_device=None, device_id=0, step_events=None,
        is_constant=lambda a: False, to_host=np.asarray, upload_constant=lambda a: a, warn_node=lambda node, m: pytest.fail(m), warn_capture=lambda m: None,
        note_once=lambda tag, m, warn=True, category=None: None, host_syncs=0, uploads=0)
    rt.convs = Convolutions(rt)
    return rt, stand_in


@pytest.mark.parametrize("fused_ms,counter", [(0.010, "fused_residual_relu"), (0.040, None)])
def test_the_plan_runs_the_add_and_the_relu_in_the_conv_s_step_like_onnx_runtime(tmp_path, numpy_backend, fused_ms, counter):
    """Compiled by the cuda backend's lowering (convs first, the rest by the op library) and run
    eagerly twice: no launch of the Add or the Relu, one cuDNN call per conv, c2's fused call
    (where the decision recorded it) given the resources' zero bias, made once at compile time."""
    from convpass.runtime.cuda import lowering, runner

    rt, stand_in = numpy_backend
    tuned = _tuned(tmp_path, fused_ms)
    ex = Executor(tuned, device="cpu")
    feeds = bit_input(X)
    ex.run(None, feeds)
    plan = ex.last_plan
    state = lowering.compile_plan(rt, plan)
    labels = [launch.label for launch in state.launch_list()]
    assert labels == ["FusedNorm", "Conv", "FusedNorm", "Conv+residual+relu"]  # GroupNorm + Relu units, c1, c2 with the Add and the Relu
    [zeros] = rt.convs.resources._zero_biases.values()  # made at compile time, before any run
    assert zeros.shape == (8,) and zeros.dtype == np.float32 and not zeros.any()
    want = run_ort(bit_block(X), feeds)[0]
    for _ in range(2):
        env = list(plan.template)
        for name, s in plan.feed_slots.items():
            env[s] = feeds[name]
        runner._run_eager(rt, state, env)
        np.testing.assert_allclose(env[plan.output_slots[0]], want, rtol=1e-5, atol=1e-5)
    assert rt.counters["cudnn_calls"] == 4 and rt.counters["layout_copies"] >= 0
    if counter:
        assert rt.counters[counter] == 2 and len(stand_in.biases) == 2 and all(b is zeros for b in stand_in.biases)
    else:
        assert not stand_in.biases and not any(k.startswith("fused_") for k in rt.counters)  # the conv, then one pass with the zeros
    assert len(rt.convs.resources._zero_biases) == 1


def test_a_zero_bias_is_one_array_per_channel_count_and_dtype_and_none_is_made_while_capturing(numpy_backend):
    from convpass.native.cuda import CaptureBreak

    rt, _ = numpy_backend
    resources = rt.convs.resources
    a = resources.zero_bias(8, np.float32)
    assert resources.zero_bias(8, np.dtype("float32")) is a and not a.any()
    assert resources.zero_bias(16, np.float32).shape == (16,) and resources.zero_bias(8, np.float16).dtype == np.float16
    rt.capturing = True
    assert resources.zero_bias(8, np.float32) is a  # made before: the capture reads it
    with pytest.raises(CaptureBreak, match="zero bias of 4 channels"):
        resources.zero_bias(4, np.float32)

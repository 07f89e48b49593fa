"""cuDNN graph-API engines on a real GPU: every offered configuration that builds computes
``conv(x, w)`` right (float64 NumPy reference), and every fused one ``silu(conv(x, w) + b)``; the
tuner records them; the executor runs a model tuned with them inside its captured CUDA graph (a
fused engine in place of the conv, its bias and its SiLU), or warns and runs the legacy fallback."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

from convpass.core.algo import Algo

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_graph_api")]

cp = pytest.importorskip("cupy")

from conftest import MODELS, as_float32, conv_model, residual_block_model, run_ort, silu_model  # noqa: E402

import convpass  # noqa: E402
from convpass.compiler.passes.canonicalize_convs import canonicalize_conv  # noqa: E402
from convpass.core import annotation  # noqa: E402
from convpass.native.cudnn import as_layout, graph_api  # noqa: E402
from convpass.runtime import Executor  # noqa: E402

CASES = {
    "dense3x3": ((2, 16, 14, 14), (32, 16, 3, 3), {"pads": [1, 1, 1, 1]}),
    "depthwise_s2": ((2, 32, 15, 15), (32, 1, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2], "group": 32}),
    "grouped1x1": ((2, 16, 7, 7), (32, 4, 1, 1), {"group": 4}),
    "dilated": ((1, 8, 12, 12), (8, 8, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    "conv3d": ((1, 4, 6, 8, 8), (8, 4, 3, 3, 3), {"pads": [1, 1, 1, 1, 1, 1]}),
}


def _reference(x, w, shape) -> np.ndarray:
    """float64 conv of a canonical ConvShape (symmetric pads), channels first."""
    g = shape.groups
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    r = len(shape.spatial)
    x = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in shape.pads])
    n, k = x.shape[0], w.shape[0]
    out_sp = shape.y_shape[2:]
    y = np.zeros((n, k, *out_sp))
    cg, kg = shape.c // g, k // g
    for gi in range(g):
        xs = x[:, gi * cg:(gi + 1) * cg]
        ws = w[gi * kg:(gi + 1) * kg]
        for idx in np.ndindex(*shape.kernel):
            sl = tuple(slice(idx[d] * shape.dilations[d], idx[d] * shape.dilations[d] + shape.strides[d] * (out_sp[d] - 1) + 1, shape.strides[d]) for d in range(r))
            patch = xs[(slice(None), slice(None), *sl)]
            y[:, gi * kg:(gi + 1) * kg] += np.einsum("nc...,kc->nk...", patch, ws[(slice(None), slice(None), *idx)])
    return y


def _built(key, configs, enumerated=None):
    """(config, plan) for each offered configuration that builds here (one that does not is
    recorded as unsupported by the tuner); ``enumerated``: built on that one graph, as the tuner
    builds them."""
    for config in configs:
        try:
            yield config, graph_api.EnginePlan(key, config, enumerated)
        except graph_api.GraphApiError:
            continue


def test_no_engine_is_offered_with_tf32_off():
    shape = canonicalize_conv("Conv", {}, (2, 8, 8, 8), (8, 8, 1, 1)).shapes[0]
    with pytest.raises(graph_api.GraphApiError, match="TF32 off"):
        graph_api.enumerate_configs(shape.key("nhwc", "fma"))


def _inputs(spec, layout: str, seed: int, bias: bool = False):
    """(shape, key, float64 reference of conv(x, w) [+ b], x, w, b) for a CASES entry in ``layout``."""
    x_shape, w_shape, attrs = spec
    shape = canonicalize_conv("Conv", attrs, x_shape, w_shape).shapes[0]
    rng = np.random.default_rng(seed)
    xh = rng.standard_normal(shape.x_shape).astype(np.float32)
    wh = (rng.standard_normal(shape.w_shape) / np.sqrt(np.prod(shape.w_shape[1:]))).astype(np.float32)
    want = _reference(xh, wh, shape)
    b = None
    if bias:
        bh = rng.standard_normal(shape.k).astype(np.float32)
        want = want + bh.reshape(1, -1, *([1] * len(shape.spatial)))
        b = cp.asarray(bh)
    return shape, shape.key(layout, "default"), want, as_layout(cp.asarray(xh), layout), as_layout(cp.asarray(wh), layout), b


def _check_every_plan(key, configs, shape, want, x, w, b=None, enumerated=None) -> int:
    """Run every configuration that builds into a NaN-filled output; each must match ``want``
    (TF32 tolerance). Returns how many built."""
    built = 0
    for config, plan in _built(key, configs, enumerated):
        built += 1
        y = as_layout(cp.full(shape.y_shape, cp.nan, dtype=cp.float32), key.layout)
        plan.execute(x, w, y, cp.empty(max(plan.workspace_bytes, 1), cp.uint8), bias=b)
        got = cp.asnumpy(y).astype(np.float64)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= 5e-3, f"{config.algo} ({key.layout}): relative error {err:.2e}"
        if b is not None:
            with pytest.raises(graph_api.GraphApiError, match="takes a bias"):
                plan.execute(x, w, y)
    return built


@pytest.mark.parametrize("graph", ["own", "enumerated"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_offered_configuration_computes_the_conv(case, layout, graph):
    """Each plan on a graph of its own (the executor's), and all of them on the one graph they
    were enumerated on (the tuner's)."""
    shape, key, want, x, w, _ = _inputs(CASES[case], layout, 3)
    enumerated = graph_api.enumerate_configs(key)
    configs = enumerated.configs()
    assert configs, f"cuDNN offers no engine for {key}"
    assert all(c.engine_id < graph_api.PYTHON_ENGINE_ID_BASE for c in configs)
    built = _check_every_plan(key, configs, shape, want, x, w, enumerated=enumerated if graph == "enumerated" else None)
    assert built, f"no configuration of {key} builds"


def test_the_tuner_records_engines_beside_the_legacy_algorithms(tmp_path):
    model = conv_model("Conv", (2, 32, 15, 15), (32, 1, 3, 3), pads=[1, 1, 1, 1], group=32)
    convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, tf32="on")
    from convpass.tuning.cache import TuningCache

    shape = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1], "group": 32}, (2, 32, 15, 15), (32, 1, 3, 3)).shapes[0]
    cache = TuningCache(tmp_path / "c.db")
    [(device, _)] = cache.devices()
    rows = cache.get(device, shape)
    cache.close()
    for layout in ("nchw", "nhwc"):
        mine = [r for r in rows if r.key == shape.key(layout, "default")]
        engines = [r for r in mine if Algo.parse(r.algo).is_engine]
        assert any(r.status == "ok" and r.time_ms for r in engines), [(r.algo, r.status, r.note) for r in engines]
        assert any(r.algo == "implicit_gemm" and r.method == "measure" for r in mine)


def _check(outs, refs, tol, what):
    for got, want in zip(outs, refs):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
        assert err <= tol, f"{what}: relative error {err:.2e}"


def wrong_but_refused(y, want, algo: str, layout: str, tol: float) -> str:
    """"" where ``y`` (a plan's output) matches the float64 ``want`` within ``tol``; else what is
    wrong with it, after asserting that the tuner's check refuses it too (a configuration that
    ignores a slice's strides reads its buffer's NaN channels)."""
    got = cp.asnumpy(y).astype(np.float64)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    if err <= tol:
        return ""
    from convpass.tuning import harness

    tuner_err = harness.relative_error(y, cp.asarray(want.astype(np.float32)))
    assert not tuner_err <= tol, f"{algo} ({layout}): wrong ({err:.2e}) yet within the tuner's check ({tuner_err:.2e})"
    return f"{algo} {err:.1e}"


def tuned_here(tmp_path_factory, name: str, model) -> tuple:
    """``model`` tuned here once (a module fixture's: NHWC, engines "all", TF32 on) into a cache
    of its own: (cache path, model, tuned model); skipped, saying why, where the graph API is
    unusable (a module fixture runs before ``need_graph_api``)."""
    why = graph_api.unavailable()
    if why is not None:
        pytest.skip(why)
    path = tmp_path_factory.mktemp(name) / "c.db"
    tuned = convpass.optimize(model, cache=path, quiet=True, tf32="on", layout="nhwc", engines="all")
    onnx.checker.check_model(tuned, full_check=True)
    return path, model, tuned


def cached_rows(path, key) -> list:
    """The rows of ``key`` in the cache at ``path`` (of its one device)."""
    from convpass.tuning.cache import TuningCache

    with TuningCache(path) as cache:
        [(device, _)] = cache.devices()
        return [r for r in cache.get(device, key.shape) if r.key == key]


def run_eager_and_captured(model, tuned, shape, tol, seed):
    """``tuned`` run eagerly (the plan-recording run, then a plan run) and captured (3 replays) on
    an input of ``shape`` (named ``x``), every output checked against ONNX Runtime CPU at ``tol``;
    no ExecutorWarning anywhere. Returns (the eager plan run's counters, the captured executor)."""
    from convpass.runtime.cuda import CudaBackend, ExecutorWarning

    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    refs = run_ort(model, {"x": x})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExecutorWarning)
        eager = Executor(tuned, device=CudaBackend(cuda_graph=False))
        _check(eager.run(None, {"x": x}), refs, tol, "eager, op-by-op run")
        before = dict(eager._backend.counters)
        _check(eager.run(None, {"x": x}), refs, tol, "eager, plan run")
        counters = {k: v - before.get(k, 0) for k, v in eager._backend.counters.items()}
        graphed = Executor(tuned, device="cuda")
        for i in range(3):
            _check(graphed.run(None, {"x": x}), refs, tol, f"replay {i}")
    assert graphed.graph_status().captured, graphed.graph_status().describe()
    return counters, graphed


def test_a_model_tuned_with_graph_engines_runs_them_in_its_cuda_graph(tmp_path):
    model = onnx.load(MODELS / "mobile_block.onnx")
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, shapes=["input=2x3x32x32"], tf32="on", engines="graph")
    records = convpass.inspect(tuned)
    assert records and all(r["engine"] for r in records if r["op"] == "Conv"), records
    inp = model.graph.input[0]
    dims = [2, 3, 32, 32]
    x = np.random.default_rng(5).standard_normal(dims).astype(np.float32)
    refs = run_ort(model, {inp.name: x})
    from convpass.runtime.cuda import ExecutorWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", ExecutorWarning)  # no fallback anywhere
        ex = Executor(tuned, device="cuda")
        first = ex.run(None, {inp.name: x})
    _check(first, refs, 5e-3, "first run")
    for i in range(3):
        _check(ex.run(None, {inp.name: x}), refs, 5e-3, f"replay {i}")
    assert ex.graph_status().captured, ex.graph_status().describe()
    assert ex._backend.counters["graph_api_calls"] >= 1


@pytest.mark.parametrize("case", ["dense3x3", "depthwise_s2"])
def test_a_float16_model_tuned_with_graph_engines_runs_them_in_its_cuda_graph(case, tmp_path):
    """The panel's float16 tests tune with the legacy candidates only (PANEL_OPTIONS in
    test_executor_cuda.py, for device time); engines on float16 tensors are checked here."""
    from onnx import TensorProto

    x_shape, w_shape, attrs = CASES[case]
    model = conv_model("Conv", x_shape, w_shape, elem_type=TensorProto.FLOAT16, seed=4, **attrs)
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, engines="graph")
    records = convpass.inspect(tuned)
    assert records and all(r["engine"] for r in records), records
    x = np.random.default_rng(9).standard_normal(x_shape).astype(np.float16)
    refs = [r.astype(np.float16) for r in run_ort(as_float32(model), {"x": x.astype(np.float32)})]
    from convpass.runtime.cuda import ExecutorWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", ExecutorWarning)  # no fallback anywhere
        ex = Executor(tuned, device="cuda")
        first = ex.run(None, {"x": x})
    assert first[0].dtype == np.float16
    _check(first, refs, 1e-2, f"{case} float16, first run")
    for i in range(3):
        _check(ex.run(None, {"x": x}), refs, 1e-2, f"{case} float16, replay {i}")
    assert ex.graph_status().captured, ex.graph_status().describe()
    assert ex._backend.counters["graph_api_calls"] >= 1


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_engine_convs_take_their_bias_residual_and_relu_in_one_pass(layout, tmp_path):
    """Conv + bias + Relu and Conv + bias + Add + Relu on engines only: each conv is one engine
    call, its epilogue (bias, residual, ReLU) in that call where the decision is the epilogue's
    fused graph, else one element-wise pass after it; right in eager runs and in the captured graph."""
    from convpass.runtime.cuda import CudaBackend, ExecutorWarning

    model = residual_block_model()
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, tf32="on", engines="graph", layout=layout)
    if not all(r["engine"] for r in convpass.inspect(tuned) if r["op"] == "Conv"):
        pytest.skip(f"cuDNN kept no engine for every conv in {layout} here")
    x = np.random.default_rng(8).standard_normal((2, 16, 14, 14)).astype(np.float32)
    refs = run_ort(model, {"x": x})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExecutorWarning)
        eager = Executor(tuned, device=CudaBackend(cuda_graph=False))
        eager.run(None, {"x": x})  # the plan-recording run
        before = dict(eager._backend.counters)
        _check(eager.run(None, {"x": x}), refs, 5e-3, "eager")
        counters = {k: v - before.get(k, 0) for k, v in eager._backend.counters.items()}
        assert counters.get("graph_api_calls") == 2 and not counters.get("cudnn_calls"), counters
        unfused = sum(1 for r in convpass.inspect(tuned) if r["op"] == "Conv" and not r["fusion"])
        assert counters.get("epilogue_passes", 0) == unfused, counters
        graphed = Executor(tuned, device="cuda")
        for i in range(3):
            _check(graphed.run(None, {"x": x}), refs, 5e-3, f"replay {i}")
    assert graphed.graph_status().captured, graphed.graph_status().describe()


def test_an_engine_that_cannot_be_built_warns_and_runs_the_legacy_algorithm(tmp_path):
    model = conv_model("Conv", (2, 16, 14, 14), (32, 16, 3, 3), pads=[1, 1, 1, 1])
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, tf32="on", engines="legacy")
    legacy_algo = convpass.inspect(tuned)[0]["algo"]
    for node in tuned.graph.node:
        if annotation.is_annotated_conv(node):  # beside whatever legacy epilogue its decision fused
            node.attribute.append(onnx.helper.make_attribute("engine", "eng99999"))
    x = np.random.default_rng(2).standard_normal((2, 16, 14, 14)).astype(np.float32)
    from convpass.runtime.cuda import ExecutorWarning

    with pytest.warns(ExecutorWarning, match=r"engine 'eng99999' is not usable here.*legacy algorithm '" + legacy_algo):
        outs = Executor(tuned, device="cuda").run(None, {"x": x})
    _check(outs, run_ort(model, {"x": x}), 5e-3, "legacy fallback")


FUSED_CASES = {k: CASES[k] for k in ("dense3x3", "depthwise_s2", "grouped1x1")}


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_every_fused_configuration_computes_silu_of_conv_plus_bias(case, layout):
    shape, key, pre, x, w, b = _inputs(FUSED_CASES[case], layout, 4, bias=True)
    try:
        configs = graph_api.enumerate_configs(key, "bias+swish").configs()
    except graph_api.GraphApiError as e:
        pytest.skip(f"no fused engine here: {e}")  # the tuner records this as engine:none+bias+swish
    assert configs and all(c.fusion == "bias+swish" and c.algo.endswith("+bias+swish") for c in configs), configs
    assert _check_every_plan(key, configs, shape, pre / (1.0 + np.exp(-pre)), x, w, b), f"no fused configuration of {key} builds"


def test_a_silu_model_runs_fused_engines_in_its_cuda_graph(tmp_path):
    """Tuned with every space in NHWC, then each SiLU conv forced onto its fastest fused configuration the
    tuner kept (so the fused path runs whatever won): outputs match ONNX Runtime CPU, the Sigmoid
    and Mul steps are absorbed, and the plan is captured."""
    from convpass.runtime.cuda import ExecutorWarning
    from convpass.tuning.cache import TuningCache

    model = silu_model((2, 16, 12, 12))
    # NHWC: cuDNN 9.19 on an H200 offered no fused graph in NCHW for these convs (nor for FUSED_CASES)
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, tf32="on", layout="nhwc")
    cache = TuningCache(tmp_path / "c.db")
    [(device, _)] = cache.devices()
    forced = 0
    for node in tuned.graph.node:
        if not annotation.is_annotated_conv(node) or node.name == "project":
            continue
        d = annotation.read_node(node, n_profiles=1).decisions[0]
        from convpass.core.problem import ProblemKey

        key = ProblemKey.parse(d.problem_key)
        rows = [r for r in cache.get(device, key.shape) if r.key == key]
        assert any(r.method == "epilogue" and r.algo == "bias+swish" and r.status == "ok" for r in rows), [(r.algo, r.method, r.status) for r in rows]
        fused = sorted((r for r in rows if Algo.parse(r.algo).fusion == "bias+swish" and r.status == "ok"), key=lambda r: r.time_ms)
        if not fused:
            continue
        config = graph_api.EngineConfig.parse(fused[0].algo)
        for a in list(node.attribute):
            if a.name in ("engine", "fusion"):
                node.attribute.remove(a)
        node.attribute.extend([onnx.helper.make_attribute("engine", config.name), onnx.helper.make_attribute("fusion", config.fusion)])
        forced += 1
    cache.close()
    if not forced:
        pytest.skip("cuDNN kept no fused configuration for these convs here")
    x = np.random.default_rng(6).standard_normal((2, 16, 12, 12)).astype(np.float32)
    refs = run_ort(model, {"x": x})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExecutorWarning)  # no fallback anywhere
        ex = Executor(tuned, device="cuda")
        first = ex.run(None, {"x": x})
    _check(first, refs, 5e-3, "first run")
    for i in range(3):
        _check(ex.run(None, {"x": x}), refs, 5e-3, f"replay {i}")
    assert ex.graph_status().captured, ex.graph_status().describe()
    assert ex._backend.counters["fused_bias_swish"] >= forced
    summary = {c.node: c.algo for c in ex.plan_summary()}
    assert sum(a.endswith("+bias+swish") for a in summary.values()) == forced, summary


def test_a_fused_engine_without_its_epilogue_in_the_plan_runs_the_legacy_algorithm(tmp_path):
    from convpass.runtime.cuda import CudaBackend, ExecutorWarning

    model = silu_model((2, 16, 12, 12))
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, tf32="on", engines="legacy")
    for node in tuned.graph.node:
        if node.name == "expand":  # its legacy decision may carry a legacy epilogue: replaced
            kept = [a for a in node.attribute if a.name not in ("engine", "fusion")]
            del node.attribute[:]
            node.attribute.extend(kept + [onnx.helper.make_attribute("engine", "eng0"), onnx.helper.make_attribute("fusion", "bias+swish")])
    x = np.random.default_rng(7).standard_normal((2, 16, 12, 12)).astype(np.float32)
    with pytest.warns(ExecutorWarning, match=r"fused graph conv \+ bias\+swish, which this plan does not run fused"):
        outs = Executor(tuned, device=CudaBackend(fuse=False)).run(None, {"x": x})
    _check(outs, run_ort(model, {"x": x}), 5e-3, "fusion off")

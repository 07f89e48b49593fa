"""The legacy epilogues inside a graph-API engine's call on a real GPU: every offered configuration
of the graphs conv -> add(bias) [-> add(z)] [-> ReLU] that builds computes ``relu(conv(x, w) + b +
z)`` (float64 NumPy reference, TF32 tolerance, NHWC, batch 16); a block with one conv per
epilogue (conftest's ``epilogue_block_model``: ``bias``, ``bias+relu``, ``bias+add+relu``) at batch
16 in NHWC, tuned here with engines "all", has each epilogue's passes and engine graphs measured
(``engine:none+<epilogue>`` where cuDNN offers none), records the cheapest by the tuner's own
rule, and runs it: a fused decision in the engine's one call with no epilogue pass and no launch
of its own for the Add or the Relu, right against ONNX Runtime CPU eager and captured in a CUDA
graph; the same with every conv forced onto its fastest fused configuration. Each test prints
``ENGINE-EPILOGUE`` lines (run with ``-s`` to see them)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_cuda_backend")]

cp = pytest.importorskip("cupy")

import test_graph_api_gpu as engines  # noqa: E402
from conftest import epilogue_block_model, run_ort  # noqa: E402

import convpass  # noqa: E402
from convpass.compiler.passes.canonicalize_convs import canonicalize_conv  # noqa: E402
from convpass.core import annotation  # noqa: E402
from convpass.core.algo import Algo  # noqa: E402
from convpass.core.fusion import LEGACY, parts  # noqa: E402
from convpass.core.options import TuneOptions  # noqa: E402
from convpass.core.problem import ConvProblem, ProblemKey  # noqa: E402
from convpass.kernels.conv_exec import EPILOGUE_PASSES  # noqa: E402
from convpass.native.cudnn import as_layout, graph_api  # noqa: E402
from convpass.runtime import Executor  # noqa: E402
from convpass.tuning.cache import TuningCache  # noqa: E402
from convpass.tuning.decide import select  # noqa: E402

X = (16, 64, 32, 32)  # batch 16, a ResNet stage's width
EPILOGUES = {"c0": "bias", "c1": "bias+relu", "c2": "bias+add+relu"}  # the block's convs (conftest)
ABSORBED = {"c0": (), "c1": ("r1",), "c2": ("add", "r2")}
TOL = 5e-3  # relative error (norm) of TF32 convs, as the other engine tests
OPTIONS = {"tf32": "on", "layout": "nhwc", "engines": "all"}


@pytest.fixture(autouse=True)
def _need_frontend():
    why = graph_api.unavailable()
    if why is not None:
        pytest.skip(why)


def _report(what: str) -> None:
    print(f"ENGINE-EPILOGUE {what}")


@pytest.fixture(scope="module")
def conv_inputs():
    """(shape, random x, w, b, z on the host, float64 conv(x, w)) of the block's 3x3 conv at batch 16."""
    shape = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, X, (X[1], X[1], 3, 3)).shapes[0]
    rng = np.random.default_rng(3)
    xh = rng.standard_normal(shape.x_shape).astype(np.float32)
    wh = (rng.standard_normal(shape.w_shape) / np.sqrt(np.prod(shape.w_shape[1:]))).astype(np.float32)
    bh = (0.1 * rng.standard_normal(shape.k)).astype(np.float32)
    zh = rng.standard_normal(shape.y_shape).astype(np.float32)
    return shape, xh, wh, bh, zh, engines._reference(xh, wh, shape)


@pytest.mark.parametrize("name", LEGACY)
def test_every_offered_configuration_of_an_epilogue_s_graph_computes_it(conv_inputs, name):
    residual, relu = parts(name)
    shape, xh, wh, bh, zh, conv64 = conv_inputs
    key = shape.key("nhwc", "default")
    try:
        enumerated = graph_api.enumerate_configs(key, name)
        configs = enumerated.configs()
    except graph_api.GraphApiError as e:
        _report(f"{name}: cuDNN offers no configuration ({e})")
        pytest.skip(f"no engine of {name} here: {e}")  # the tuner records this as engine:none+<name>
    assert configs and all(c.fusion == name and c.algo.endswith("+" + name) for c in configs), configs
    v = conv64 + bh.reshape(1, -1, 1, 1) + (zh if residual else 0)
    want = np.maximum(v, 0) if relu else v
    assert not relu or 0.2 < (want > 0).mean() < 0.8  # the ReLU clips about half: its place in the graph shows
    x, w, b, z = as_layout(cp.asarray(xh), "nhwc"), as_layout(cp.asarray(wh), "nhwc"), cp.asarray(bh), as_layout(cp.asarray(zh), "nhwc")
    built, right, refused, off = 0, 0, [], []
    for config, plan in engines._built(key, configs, enumerated):
        built += 1
        y = as_layout(cp.full(shape.y_shape, cp.nan, dtype=cp.float32), "nhwc")
        ws = cp.empty(max(plan.workspace_bytes, 1), cp.uint8)
        try:
            plan.execute(x, w, y, ws, bias=b, z=z if residual else None)
        except graph_api.GraphApiError as e:  # the tuner records it as an error row: never chosen
            refused.append(f"{config.algo}: {e}")
            continue
        got = cp.asnumpy(y).astype(np.float64)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        if err <= TOL:
            right += 1
        else:  # the tuner's check against its reference fails it the same way: never chosen
            off.append(f"{config.algo}: relative error {err:.2e}")
    _report(f"{name}: {len(configs)} configurations offered, {built} built, {right} right, {len(refused)} refused to execute, "
            f"{len(off)} off the reference" + "".join(f"\n  {line}" for line in refused + off))
    assert built, f"no configuration of {key} + {name} builds"
    assert right, f"no configuration of {key} + {name} computes it (the graph is wrong, not one engine):\n" + "\n".join(refused + off)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The block tuned here once (NHWC, batch 16, engines "all"). Returns (model, tuned model, cache path)."""
    why = graph_api.unavailable()  # asked here too: a module fixture runs before the autouse one
    if why is not None:
        pytest.skip(why)
    path = tmp_path_factory.mktemp("epilogues") / "c.db"
    model = epilogue_block_model(X)
    tuned_model = convpass.optimize(model, cache=path, quiet=True, **OPTIONS)
    onnx.checker.check_model(tuned_model, full_check=True)
    return model, tuned_model, path


def _rows(path, key: ProblemKey) -> list:
    """Every row the tuning cache holds for ``key``'s geometry (each memory format and math mode)."""
    cache = TuningCache(path)
    [(device, _)] = cache.devices()
    rows = cache.get(device, key.shape)
    cache.close()
    return rows


def _run_eager_and_captured(model, tuned_model, seed):
    """Eager (plan-recording run, then a plan run) and captured (3 replays) outputs checked against
    ONNX Runtime CPU; no ExecutorWarning anywhere. Returns (the eager plan run's counters, the
    captured executor)."""
    from convpass.runtime.cuda import CudaBackend, ExecutorWarning

    x = np.random.default_rng(seed).standard_normal(X).astype(np.float32)
    refs = run_ort(model, {"x": x})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExecutorWarning)
        eager = Executor(tuned_model, device=CudaBackend(cuda_graph=False))
        engines._check(eager.run(None, {"x": x}), refs, TOL, "eager, op-by-op run")
        before = dict(eager._backend.counters)
        engines._check(eager.run(None, {"x": x}), refs, TOL, "eager, plan run")
        counters = {k: v - before.get(k, 0) for k, v in eager._backend.counters.items()}
        graphed = Executor(tuned_model, device="cuda")
        for i in range(3):
            engines._check(graphed.run(None, {"x": x}), refs, TOL, f"replay {i}")
    assert graphed.graph_status().captured, graphed.graph_status().describe()
    return counters, graphed


def _conv_launches(ex) -> dict:
    """The compiled plan's launches by node name (a step another launch absorbed has none)."""
    return {launch.node.name: launch for launch in ex.last_plan.backend_state.launch_list()}


def _check_fused_launches(graphed, fused: dict[str, str]) -> None:
    """Each conv of ``fused`` (node -> epilogue) is one launch of its fused engine graph, with no
    pass of its own, and its Add and Relu have no launch."""
    launches = _conv_launches(graphed)
    for node, name in fused.items():
        conv = launches[node].exec.conv
        assert conv.fused and conv.epilogue == name and EPILOGUE_PASSES not in conv.counts, (node, conv)
        assert not set(ABSORBED[node]) & set(launches), (node, sorted(launches))
        assert graphed._backend.counters["fused_" + name.replace("+", "_")] >= 1


def test_the_block_tuned_here_records_the_cheapest_form_of_each_epilogue_and_runs_it(tuned):
    model, tuned_model, path = tuned
    records = {r["node"]: r for r in convpass.inspect(tuned_model)}
    fused, passes_expected = {}, 0
    for node, name in EPILOGUES.items():
        r = records[node]
        key = ProblemKey.parse(r["problem_key"])
        assert key.layout == "nhwc" and key.shape.n == 16
        every = _rows(path, key)
        rows = [m for m in every if m.key == key]
        passes = {m.algo: m for m in rows if m.method == "epilogue" and m.status == "ok"}
        assert {name, "bias"} <= set(passes), sorted(passes)  # the pass after a bare conv, the one a bare engine's time holds
        graph = [m for m in rows if Algo.parse(m.algo).is_engine and Algo.parse(m.algo).fusion == name]
        assert graph, f"{node}: no row of the {name} graph (not even engine:none+{name})"
        ok = sorted((m for m in graph if m.status == "ok"), key=lambda m: m.time_ms)
        chosen = select(every, ConvProblem((key.shape,), name), TuneOptions(**OPTIONS))
        recorded = str(Algo("engine", r["engine"], r["fusion"] or "")) if r["engine"] else str(Algo.parse(r["algo"]).fused(r["fusion"] or ""))
        assert recorded == chosen.algo, (node, recorded, chosen.algo)  # the tuner's own rule over its rows
        if r["engine"] and r["fusion"] == name:
            fused[node] = name
        elif not r["fusion"]:
            passes_expected += 1  # a bare conv (legacy algorithm or engine): its epilogue as one pass
        bare = sorted((m for m in rows if m.status == "ok" and m.method == "measure" and Algo.parse(m.algo).bare_of("engine")), key=lambda m: m.time_ms)
        _report(f"{node} {name}: {len(ok)} of {len(graph)} graph rows ok"
                + (f", fastest {ok[0].algo} {ok[0].time_ms:.4f} ms" if ok else f" ({graph[0].algo}: {graph[0].status})")
                + (f"; bare engine {bare[0].time_ms:.4f} ms (with bias pass {passes['bias'].time_ms:.4f}) + pass {passes[name].time_ms:.4f} ms"
                   if bare else "") + f"; decision {recorded} {r['time_ms']:.4f} ms")
    counters, graphed = _run_eager_and_captured(model, tuned_model, 5)
    assert counters.get(EPILOGUE_PASSES, 0) == passes_expected, counters  # one pass per unfused conv, none for a fused one
    for name in fused.values():
        assert counters.get("fused_" + name.replace("+", "_")) == 1, counters
    _check_fused_launches(graphed, fused)
    _report(f"tuned: fused {sorted(fused.items())}; plan-run counters {counters}")


def test_the_block_forced_onto_its_fastest_fused_configurations_runs_them_without_a_pass(tuned):
    """Every conv's decision replaced by its fastest fused configuration of the tuner's rows (so the
    fused path runs whatever won): right eager and captured, each conv one engine call, no
    epilogue pass, the Add and the Relus absorbed."""
    model, tuned_model, path = tuned
    forced = onnx.ModelProto()
    forced.CopyFrom(tuned_model)
    fused, algos, passes_expected = {}, {}, 0
    for node in forced.graph.node:
        name = EPILOGUES.get(node.name)
        if name is None:
            continue
        d = annotation.read_node(node, n_profiles=1).decisions[0]
        passes_expected += not d.fusion  # where nothing is forced: a bare decision runs its epilogue as one pass
        key = ProblemKey.parse(d.problem_key)
        ok = sorted((m for m in _rows(path, key) if m.key == key and m.status == "ok" and Algo.parse(m.algo).is_engine
                     and Algo.parse(m.algo).fusion == name), key=lambda m: m.time_ms)
        if not ok:
            _report(f"forced: cuDNN kept no {name} configuration for {node.name} here")
            continue
        config = graph_api.EngineConfig.parse(ok[0].algo)
        kept = [a for a in node.attribute if a.name not in ("engine", "fusion")]
        del node.attribute[:]
        node.attribute.extend(kept + [onnx.helper.make_attribute("engine", config.name), onnx.helper.make_attribute("fusion", config.fusion)])
        fused[node.name], algos[node.name] = name, config.algo
        passes_expected -= not d.fusion
    if not fused:
        pytest.skip("cuDNN kept no fused configuration of any epilogue here")
    counters, graphed = _run_eager_and_captured(model, forced, 11)
    assert counters.get("graph_api_calls", 0) >= len(fused), counters
    for name in fused.values():
        assert counters.get("fused_" + name.replace("+", "_")) == 1, counters
    assert counters.get(EPILOGUE_PASSES, 0) == passes_expected, counters  # none for a forced conv
    summary = {c.node: c.algo for c in graphed.plan_summary()}
    assert {node: summary[node] for node in algos} == algos, summary
    _check_fused_launches(graphed, fused)
    _report(f"forced: {sorted(fused.items())} ran fused, eager and captured, right; plan-run counters {counters}")

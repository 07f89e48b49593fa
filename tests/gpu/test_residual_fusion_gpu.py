"""A residual Add after a fused activation on a real GPU (``bias+leakyrelu0.01+add``, CSPDarknet's
residual blocks): every offered configuration of the graph conv -> bias -> LeakyRelu -> add(z)
that builds computes ``leaky_relu(conv(x, w) + b) + z`` (float64 NumPy reference, TF32 tolerance);
a CSP-like block (timm's DarkBlock after BatchNorm folding: Conv 1x1 + LeakyRelu, Conv 3x3 +
LeakyRelu, Add of the block's input) at batch 16 in NHWC, tuned here with engines "all", has its
fused graph, its shorter graph and the Add's pass measured, takes the fused graph where an engine
runs it, runs it without a launch of its own for the Add, and matches ONNX Runtime CPU eager and
captured, with the Add's output a graph output or read by two nodes; the same with the decision
forced onto the fastest fused configuration. Each test prints ``RESIDUAL-FUSION`` lines (run with
``-s`` to see them)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_graph_api")]

cp = pytest.importorskip("cupy")

import test_graph_api_gpu as engines  # noqa: E402
from conftest import csp_block_model  # noqa: E402

import convpass  # noqa: E402
from convpass.core import annotation  # noqa: E402
from convpass.core.algo import Algo  # noqa: E402
from convpass.core.fusion import RESIDUAL_PASS  # noqa: E402
from convpass.core.options import TuneOptions  # noqa: E402
from convpass.core.problem import ConvProblem, ProblemKey  # noqa: E402
from convpass.native.cudnn import as_layout, graph_api  # noqa: E402
from convpass.tuning import decide  # noqa: E402
from convpass.tuning.cache import TuningCache  # noqa: E402

P = "bias+leakyrelu0.01"
F = P + "+add"
X = (16, 64, 32, 32)  # batch 16, as the panel's cspdarknet53 runs
TOL = 5e-3  # relative error (norm) of a TF32 conv, as the other engine tests


def _report(what: str) -> None:
    print(f"RESIDUAL-FUSION {what}")


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("case", sorted(engines.FUSED_CASES))
def test_every_fused_residual_configuration_adds_z_after_the_activation(case, layout):
    shape, key, pre, x, w, b = engines._inputs(engines.FUSED_CASES[case], layout, 4, bias=True)
    try:
        enumerated = graph_api.enumerate_configs(key, F)
        configs = enumerated.configs()
    except graph_api.GraphApiError as e:
        _report(f"{case} {layout} {F}: cuDNN offers no fused engine ({e})")
        pytest.skip(f"no fused engine here: {e}")  # the tuner records this as engine:none+<name>
    assert configs and all(c.fusion == F and c.algo.endswith("+" + F) for c in configs), configs
    zh = np.random.default_rng(9).standard_normal(shape.y_shape).astype(np.float32)
    want = np.where(pre > 0, pre, float(np.float32(0.01)) * pre) + zh
    z = as_layout(cp.asarray(zh), layout)
    built = 0
    for config, plan in engines._built(key, configs, enumerated):
        built += 1
        y = as_layout(cp.full(shape.y_shape, cp.nan, dtype=cp.float32), layout)
        ws = cp.empty(max(plan.workspace_bytes, 1), cp.uint8)
        plan.execute(x, w, y, ws, bias=b, z=z)
        got = cp.asnumpy(y).astype(np.float64)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= TOL, f"{config.algo} ({layout}): relative error {err:.2e}"
        with pytest.raises(graph_api.GraphApiError, match="must not alias"):
            plan.execute(x, w, y, ws, bias=b, z=y)
    _report(f"{case} {layout}: {len(configs)} fused configurations of {F} offered, {built} built, all right")
    assert built, f"no fused configuration of {key} + {F} builds"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The block tuned here once, NHWC, engines "all" (the Add's output read by two nodes), and
    the same block with the Add's output the graph's (decided from the same cache: nothing timed
    again). Returns (cache path, {readers: (model, tuned model)})."""
    why = graph_api.unavailable()  # asked here too: a module fixture runs before need_graph_api
    if why is not None:
        pytest.skip(why)
    path = tmp_path_factory.mktemp("residual") / "c.db"
    out = {}
    for readers in (2, 0):
        model = csp_block_model(X, readers=readers)
        tuned_model = convpass.optimize(model, cache=path, quiet=True, tf32="on", layout="nhwc", engines="all")
        onnx.checker.check_model(tuned_model, full_check=True)
        out[readers] = (model, tuned_model)
    return path, out


def _rows(path, key: ProblemKey) -> list:
    cache = TuningCache(path)
    [(device, _)] = cache.devices()
    rows = [r for r in cache.get(device, key.shape) if r.key == key]
    cache.close()
    return rows


def _launches(ex) -> dict[str, str]:
    """The compiled plan's launches, node name -> label (a step another launch absorbed has none)."""
    return {launch.node.name: launch.label for launch in ex.last_plan.backend_state.launch_list()}


@pytest.mark.parametrize("readers", [2, 0])
def test_a_csp_block_tuned_here_takes_the_fused_residual_where_an_engine_runs_it(tuned, readers):
    path, models = tuned
    model, tuned_model = models[readers]
    records = {r["node"]: r for r in convpass.inspect(tuned_model)}
    key = ProblemKey.parse(records["c2"]["problem_key"])
    assert key.layout == "nhwc"
    rows = _rows(path, key)
    passes = {r.algo: r for r in rows if r.method == "epilogue" and r.status == "ok"}
    assert {F, P, RESIDUAL_PASS} <= set(passes), sorted(passes)  # both graphs' passes and the Add's own
    fused = [r for r in rows if Algo.parse(r.algo).is_engine and Algo.parse(r.algo).fusion == F]
    shorter = [r for r in rows if Algo.parse(r.algo).is_engine and Algo.parse(r.algo).fusion == P]
    assert fused and shorter, "no fused row of one of the graphs (not even engine:none+<name>)"
    ok = sorted((r for r in fused if r.status == "ok"), key=lambda r: r.time_ms)
    ok_short = sorted((r for r in shorter if r.status == "ok"), key=lambda r: r.time_ms)
    decision = records["c2"]["fusion"] or ""
    _report(f"readers={readers}: {len(ok)} of {len(fused)} fused {F} rows ok"
            + (f", fastest {ok[0].algo} {ok[0].time_ms:.4f} ms" if ok else f" ({fused[0].algo}: {fused[0].status} {fused[0].note})")
            + (f"; shorter {ok_short[0].time_ms:.4f} ms + add {passes[RESIDUAL_PASS].time_ms:.4f} ms" if ok_short else "")
            + f"; unfused pass {passes[F].time_ms:.4f} ms; decision {records['c2']['engine'] or records['c2']['algo']} +{decision or '(none)'}")
    # the decision is the cheapest of the three forms by the rows it was made from (the fused graph
    # may well lose to the shorter graph plus its Add: a measurement, not a failure)
    want = decide.select(rows, ConvProblem((key.shape,), F, key.x_slice), TuneOptions(tf32="on", layout="nhwc", engines="all"))
    fuse = want is not None and Algo.parse(want.algo).is_engine and Algo.parse(want.algo).fusion == F
    assert fuse == (decision == F), (
        f"the rows' cheapest is {want and want.algo}, the decision {decision or 'unfused'} (fused rows ok: {len(ok)}, "
        f"shorter graph {ok_short[0].time_ms if ok_short else None} + add {passes[RESIDUAL_PASS].time_ms:.4f} ms)")
    counters, graphed = engines.run_eager_and_captured(model, tuned_model, X, TOL, 5 + readers)
    launches = _launches(graphed)
    if decision == F:
        assert counters.get("fused_bias_leakyrelu_add") == 1, counters
        assert "add" not in launches and "l2" not in launches and launches["c2"] == "Conv+" + F, launches  # no launch of its own for the Add
        assert graphed._backend.counters["fused_bias_leakyrelu_add"] >= 1
    _report(f"readers={readers}: plan-run counters {counters}; launches {launches}")


def test_the_block_forced_onto_its_fastest_fused_residual_configuration_runs_it_in_its_cuda_graph(tuned):
    """c2's decision replaced by its fastest fused configuration of the tuner's rows (so the fused
    path runs whatever won): right eager and captured, the LeakyRelu and the Add absorbed, one
    fused launch per run."""
    path, models = tuned
    model, tuned_model = models[2]
    forced = onnx.ModelProto()
    forced.CopyFrom(tuned_model)
    node = next(n for n in forced.graph.node if n.name == "c2")
    d = annotation.read_node(node, n_profiles=1).decisions[0]
    ok = sorted((r for r in _rows(path, ProblemKey.parse(d.problem_key)) if r.status == "ok" and Algo.parse(r.algo).is_engine
                 and Algo.parse(r.algo).fusion == F), key=lambda r: r.time_ms)
    if not ok:
        _report("forced: cuDNN kept no fused residual configuration here")
        pytest.skip(f"cuDNN kept no fused {F} configuration for this conv here")
    config = graph_api.EngineConfig.parse(ok[0].algo)
    kept = [a for a in node.attribute if a.name not in ("engine", "fusion")]
    del node.attribute[:]
    node.attribute.extend(kept + [onnx.helper.make_attribute("engine", config.name), onnx.helper.make_attribute("fusion", config.fusion)])
    counters, graphed = engines.run_eager_and_captured(model, forced, X, TOL, 11)
    assert counters.get("fused_bias_leakyrelu_add") == 1 and counters.get("graph_api_calls", 0) >= 1, counters
    assert {c.node: c.algo for c in graphed.plan_summary()}["c2"] == config.algo
    launches = _launches(graphed)
    assert "add" not in launches and "l2" not in launches and launches["c2"] == "Conv+" + F, launches  # the Add and the LeakyRelu absorbed
    _report(f"forced: {config.algo} ran fused, eager and captured, right; launches {launches}")

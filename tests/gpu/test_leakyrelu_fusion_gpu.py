"""LeakyRelu fused into cuDNN graph-API engines on a real GPU (``bias+leakyrelu<alpha>``): every
offered fused configuration that builds computes ``leaky_relu(conv(x, w) + b, alpha)`` for its
alpha (float64 NumPy reference, TF32 tolerance); a conv + LeakyRelu model (ESRGAN's dense-block
pattern, alphas 0.2 and 0.1) tuned on this GPU and run eager and captured matches ONNX Runtime CPU,
with each conv's fused graph where it won, and again with each conv forced onto its fastest fused
configuration; a fused decision the plan cannot run warns and runs the legacy algorithm. Each test
prints ``LEAKYRELU-FUSION`` lines saying whether cuDNN offered, built and chose the fused graph
(run with ``-s`` to see them)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_graph_api")]

cp = pytest.importorskip("cupy")

import test_graph_api_gpu as engines  # noqa: E402
from conftest import leaky_model, run_ort  # noqa: E402

import convpass  # noqa: E402
from convpass.core import annotation  # noqa: E402
from convpass.core.algo import Algo  # noqa: E402
from convpass.core.fusion import adds_residual, leakyrelu_alpha, leakyrelu_name, without_residual  # noqa: E402
from convpass.core.problem import ProblemKey  # noqa: E402
from convpass.native.cudnn import graph_api  # noqa: E402
from convpass.runtime import Executor  # noqa: E402
from convpass.tuning.cache import TuningCache  # noqa: E402

X = (2, 32, 24, 24)
TOL = 5e-3  # relative error (norm) of a TF32 conv, as the other engine tests


def _report(what: str) -> None:
    print(f"LEAKYRELU-FUSION {what}")


@pytest.mark.parametrize("alpha", [0.2, 0.1])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", sorted(engines.FUSED_CASES))
def test_every_fused_configuration_computes_leaky_relu_of_conv_plus_bias(case, layout, alpha):
    shape, key, pre, x, w, b = engines._inputs(engines.FUSED_CASES[case], layout, 4, bias=True)
    name = leakyrelu_name(alpha)
    try:
        configs = graph_api.enumerate_configs(key, name).configs()
    except graph_api.GraphApiError as e:
        _report(f"{case} {layout} {name}: cuDNN offers no fused engine ({e})")
        pytest.skip(f"no fused engine here: {e}")  # the tuner records this as engine:none+<name>
    assert configs and all(c.fusion == name and c.algo.endswith("+" + name) for c in configs), configs
    want = np.where(pre > 0, pre, float(np.float32(alpha)) * pre)
    assert (pre < 0).mean() > 0.2  # the slope is checked on many outputs
    built = engines._check_every_plan(key, configs, shape, want, x, w, b)
    _report(f"{case} {layout} {name}: {len(configs)} fused configurations offered, {built} built, all right")
    assert built, f"no fused configuration of {key} builds"


def _fused_rows(cache: TuningCache, device, key: ProblemKey, fusion: str) -> tuple[list, list]:
    """(the epilogue-pass rows, the fused-graph rows) of ``key`` for ``fusion`` in the cache."""
    rows = [r for r in cache.get(device, key.shape) if r.key == key]
    return ([r for r in rows if r.method == "epilogue" and r.algo == fusion],
            [r for r in rows if Algo.parse(r.algo).is_engine and Algo.parse(r.algo).fusion == fusion])


def _tune(tmp_path, layout):
    model = leaky_model(X)
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, tf32="on", layout=layout)
    onnx.checker.check_model(tuned, full_check=True)
    return model, tuned


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_a_leaky_model_tuned_here_runs_like_onnx_runtime_eager_and_captured(tmp_path, layout):
    """Whatever won (fused graph or not), the tuner measured the fusion for both alphas, and the
    plan runs each fused decision in one engine call. c2's LeakyRelu is read only by the join Add
    (a residual: c1's activation is ready before c2), so its problem is ``<name>+add``, whose
    shorter graph is the LeakyRelu's alone: both are measured, either may win
    (tests/gpu/test_residual_fusion_gpu.py times that form)."""
    model, tuned = _tune(tmp_path, layout)
    records = {r["node"]: r for r in convpass.inspect(tuned)}
    cache = TuningCache(tmp_path / "c.db")
    [(device, _)] = cache.devices()
    for node, alpha in (("c1", 0.2), ("c2", 0.1)):
        name = leakyrelu_name(alpha)
        passes, fused = _fused_rows(cache, device, ProblemKey.parse(records[node]["problem_key"]), name)
        timed_pass = [r for r in passes if r.status == "ok"]
        assert timed_pass, f"{node}: no {name} pass row"
        assert fused, f"{node}: no fused row (not even engine:none+{name})"
        ok = sorted((r for r in fused if r.status == "ok"), key=lambda r: r.time_ms)
        took = records[node]["fusion"] == name
        _report(f"{layout} {node} {name}: {len(ok)} of {len(fused)} fused rows ok"
                + (f", fastest {ok[0].algo} {ok[0].time_ms:.4f} ms" if ok else f" ({fused[0].algo}: {fused[0].status} {fused[0].note})")
                + f"; pass {timed_pass[0].time_ms:.4f} ms; decision {records[node]['engine'] or records[node]['algo']} "
                + (f"+{name} (fused)" if took else "(unfused: conv, then the LeakyRelu as its own pass)"))
        if records[node]["fusion"]:
            recorded = without_residual(records[node]["fusion"])
            assert records[node]["fusion"] in ((name,) if node == "c1" else (name, name + "+add"))
            assert leakyrelu_alpha(recorded) == pytest.approx(alpha)
    cache.close()
    counters, _ = engines.run_eager_and_captured(model, tuned, X, TOL, 5)
    fused_nodes = sum(1 for r in records.values() if leakyrelu_alpha(r["fusion"]) is not None)
    residual_nodes = sum(1 for r in records.values() if adds_residual(r["fusion"]))
    assert counters.get("fused_bias_leakyrelu", 0) == fused_nodes and counters.get("fused_bias_leakyrelu_add", 0) == residual_nodes, counters
    fused_nodes += residual_nodes
    _report(f"{layout}: {fused_nodes} of 2 LeakyRelu convs run fused; plan-run counters {counters}")


def test_each_leaky_conv_forced_onto_its_fastest_fused_configuration_runs_fused_in_its_cuda_graph(tmp_path):
    """NHWC, each LeakyRelu conv's decision replaced by its fastest fused configuration the tuner
    kept (so the fused path runs whatever won): right eager and captured, the LeakyRelu steps
    absorbed, one fused launch per conv and run."""
    model, tuned = _tune(tmp_path, "nhwc")
    cache = TuningCache(tmp_path / "c.db")
    [(device, _)] = cache.devices()
    forced = {}
    for node in tuned.graph.node:
        if not annotation.is_annotated_conv(node) or node.name == "c3":
            continue
        d = annotation.read_node(node, n_profiles=1).decisions[0]
        name = leakyrelu_name(0.2 if node.name == "c1" else 0.1)
        _, fused = _fused_rows(cache, device, ProblemKey.parse(d.problem_key), name)
        ok = sorted((r for r in fused if r.status == "ok"), key=lambda r: r.time_ms)
        if not ok:
            _report(f"forced {node.name} {name}: no fused configuration kept ({[(r.algo, r.status) for r in fused]})")
            continue
        config = graph_api.EngineConfig.parse(ok[0].algo)
        kept = [a for a in node.attribute if a.name not in ("engine", "fusion")]
        del node.attribute[:]
        node.attribute.extend(kept + [onnx.helper.make_attribute("engine", config.name), onnx.helper.make_attribute("fusion", config.fusion)])
        forced[node.name] = config.algo
    cache.close()
    if not forced:
        pytest.skip("cuDNN kept no fused LeakyRelu configuration for these convs here")
    counters, graphed = engines.run_eager_and_captured(model, tuned, X, TOL, 6)
    assert counters.get("fused_bias_leakyrelu") == len(forced) and counters.get("graph_api_calls", 0) >= len(forced), counters
    summary = {c.node: c.algo for c in graphed.plan_summary()}
    assert {n: summary[n] for n in forced} == forced, summary
    assert graphed._backend.counters["fused_bias_leakyrelu"] >= len(forced)
    _report(f"forced: {forced} ran fused, eager and captured, right")


def test_a_fused_leaky_decision_without_its_epilogue_in_the_plan_runs_the_legacy_algorithm(tmp_path):
    from convpass.runtime.cuda import CudaBackend, ExecutorWarning

    model = leaky_model(X)
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, tf32="on", engines="legacy")
    for node in tuned.graph.node:
        if node.name == "c1":  # its legacy decision may carry a legacy epilogue: replaced
            kept = [a for a in node.attribute if a.name not in ("engine", "fusion")]
            del node.attribute[:]
            node.attribute.extend(kept + [onnx.helper.make_attribute("engine", "eng0"), onnx.helper.make_attribute("fusion", "bias+leakyrelu0.2")])
    x = np.random.default_rng(7).standard_normal(X).astype(np.float32)
    with pytest.warns(ExecutorWarning, match=r"fused graph conv \+ bias\+leakyrelu0\.2, which this plan does not run fused"):
        outs = Executor(tuned, device=CudaBackend(fuse=False)).run(None, {"x": x})
    engines._check(outs, run_ort(model, {"x": x}), TOL, "fusion off")

"""A fused residual read from a channel slice on a real GPU (CSPDarknet's first block of a stage
adds the second half of its stage's Split): every offered configuration of the graph conv -> bias
-> LeakyRelu -> add(z) for a key that names the slice (``zslice``), its plan built with the
slice's strides, computes ``leaky_relu(conv(x, w) + b) + z`` reading the slice where it lies (its
buffer's other channels NaN; float64 NumPy reference, TF32 tolerance) or, where cuDNN's engine
ignores the strides, is wrong in a way the tuner's check refuses (at least one right), and
refuses a packed ``z``;
a CSP stage (timm's CrossStage around its first DarkBlock, BatchNorms folded) at batch 16 in NHWC,
tuned here with engines "all", names the slice in that block's key, has its fused rows timed
reading it, takes what its rows make cheapest, matches ONNX Runtime CPU eager and captured, and
copies no residual on a run (where an engine runs the fused graph, it reads the slice in place);
the same with the block's conv forced onto its fastest fused configuration. Each test prints
``RESIDUAL-SLICE`` lines (run with ``-s`` to see them). The CPU side: tests/test_residual_slices.py."""

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
from convpass.core.options import TuneOptions  # noqa: E402
from convpass.core.problem import ConvProblem, ProblemKey, ResidualSlice  # noqa: E402
from convpass.native.cudnn import as_layout, empty_like_layout, graph_api  # noqa: E402
from convpass.tuning import decide  # noqa: E402

P = "bias+leakyrelu0.01"
F = P + "+add"
X = (16, 64, 32, 32)  # batch 16, as the panel's cspdarknet53 runs; the stage's expansion: 128 channels
TOL = 5e-3  # relative error (norm) of a TF32 conv, as the other engine tests
C2 = ((16, 32, 32, 32), (64, 32, 3, 3), {"pads": [1, 1, 1, 1]})  # the block's 3x3 conv at X
Z = ResidualSlice(0, 128)  # its residual: channels 64..128 of the expansion's output, keyed modulo 128 bytes


def _report(what: str) -> None:
    print(f"RESIDUAL-SLICE {what}")


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_every_fused_configuration_reads_the_residual_where_it_lies(layout):
    shape, _, pre, x, w, b = engines._inputs(C2, layout, 4, bias=True)
    key = shape.key(layout, "default", z_slice=Z)
    try:
        enumerated = graph_api.enumerate_configs(key, F)
        configs = enumerated.configs()
    except graph_api.GraphApiError as e:
        _report(f"{layout}: cuDNN offers no fused engine reading a strided z ({e})")
        pytest.skip(f"no fused engine for a strided z here: {e}")  # the tuner records this as engine:none+<name>
    zh = np.random.default_rng(9).standard_normal(shape.y_shape).astype(np.float32)
    want = np.where(pre > 0, pre, float(np.float32(0.01)) * pre) + zh
    wide = empty_like_layout((shape.n, 2 * shape.k, *shape.output_spatial), "float32", layout)
    wide.fill(cp.nan)  # the other half: a plan that strays from its slice reads NaN
    z = wide[:, shape.k:]
    z[...] = cp.asarray(zh)
    built, wrong = 0, []
    for config, plan in engines._built(key, configs, enumerated):
        built += 1
        assert plan.z_strides == key.z_strides
        y = as_layout(cp.full(shape.y_shape, cp.nan, dtype=cp.float32), layout)
        ws = cp.empty(max(plan.workspace_bytes, 1), cp.uint8)
        plan.execute(x, w, y, ws, bias=b, z=z)
        why = engines.wrong_but_refused(y, want, config.algo, layout, TOL)  # one ignoring z's strides reads the NaN half
        wrong += [why] if why else []
        with pytest.raises(graph_api.ResidualRefused, match="not of the element strides"):  # refused as z alone: the executor copies it
            plan.execute(x, w, y, ws, bias=b, z=as_layout(cp.asarray(zh), layout))
    if not built:  # offered, none built with a strided z: the tuner's rows say so per configuration, a normal outcome
        _report(f"{layout}: {len(configs)} fused configurations of {F} offered for {key}, none builds with a strided z")
        pytest.skip(f"no fused configuration of {key} + {F} builds with a strided z here")
    _report(f"{layout}: {len(configs)} fused configurations of {F} offered for {key}, {built} built, "
            f"{built - len(wrong)} right, wrong (refused by the tuner's check): {wrong or 'none'}")
    assert len(wrong) < built, f"{layout}: no fused configuration reads the residual slice right: {wrong}"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The stage tuned here once, NHWC, engines "all". Returns (cache path, model, tuned model)."""
    return engines.tuned_here(tmp_path_factory, "residual_slices", csp_block_model(X, stage=True))


_rows = engines.cached_rows


def _fused_ok(rows) -> list:
    return sorted((r for r in rows if r.status == "ok" and Algo.parse(r.algo).is_engine and Algo.parse(r.algo).fusion == F),
                  key=lambda r: r.time_ms)


def test_a_csp_stage_tuned_here_reads_its_first_blocks_residual_slice(tuned):
    path, model, tuned_model = tuned
    records = {r["node"]: r for r in convpass.inspect(tuned_model)}
    key = ProblemKey.parse(records["c2"]["problem_key"])
    assert key.layout == "nhwc" and key.z_slice == Z, key  # the Split's second half, named in the key
    assert all(ProblemKey.parse(r["problem_key"]).z_slice is None for n, r in records.items() if n != "c2" and r["problem_key"])
    rows = _rows(path, key)
    fused = [r for r in rows if Algo.parse(r.algo).is_engine and Algo.parse(r.algo).fusion == F]
    assert fused, "no fused row (not even engine:none+<name>)"
    ok = _fused_ok(rows)
    assert all("residual slice read in place" in r.note for r in ok), [r.note for r in ok]
    passes = {r.algo: r for r in rows if r.method == "epilogue" and r.status == "ok"}
    assert passes[F].note.endswith("its residual read from its channel slice"), passes[F].note
    decision = records["c2"]["fusion"] or ""
    want = decide.select(rows, ConvProblem((key.shape,), F, key.x_slice, key.y_slice, key.z_slice),
                         TuneOptions(tf32="on", layout="nhwc", engines="all"))
    fuse = want is not None and Algo.parse(want.algo).is_engine and Algo.parse(want.algo).fusion == F
    assert fuse == (decision == F), f"the rows' cheapest is {want and want.algo}, the decision {decision or 'unfused'}"
    counters, graphed = engines.run_eager_and_captured(model, tuned_model, X, TOL, 7)
    assert counters.get("residual_copies", 0) == 0, counters  # no copy of the slice on a run
    assert counters.get("residual_slice_reads", 0) == (1 if decision == F else 0), counters
    if decision == F:
        assert counters.get("fused_bias_leakyrelu_add") == 1, counters
    _report(f"{len(ok)} of {len(fused)} fused rows ok" + (f", fastest {ok[0].algo} {ok[0].time_ms:.4f} ms" if ok else f" ({fused[0].note})")
            + f"; decision {records['c2']['engine'] or records['c2']['algo']} +{decision or '(none)'} ({records['c2'].get('time_ms')} ms)"
            + f"; plan-run counters residual_slice_reads={counters.get('residual_slice_reads', 0)} residual_copies={counters.get('residual_copies', 0)}")


def test_the_stage_forced_onto_its_fastest_fused_configuration_reads_the_slice_in_its_cuda_graph(tuned):
    """c2's decision replaced by its fastest fused configuration of the tuner's rows (so the strided
    residual runs whatever won): right eager and captured, the slice read in place, no copy."""
    path, model, tuned_model = tuned
    forced = onnx.ModelProto()
    forced.CopyFrom(tuned_model)
    node = next(n for n in forced.graph.node if n.name == "c2")
    d = annotation.read_node(node, n_profiles=1).decisions[0]
    ok = _fused_ok(_rows(path, ProblemKey.parse(d.problem_key)))
    if not ok:
        _report("forced: cuDNN kept no fused configuration reading the residual slice here")
        pytest.skip(f"cuDNN kept no fused {F} configuration reading a strided z for this conv here")
    config = graph_api.EngineConfig.parse(ok[0].algo)
    kept = [a for a in node.attribute if a.name not in ("engine", "fusion")]
    del node.attribute[:]
    node.attribute.extend(kept + [onnx.helper.make_attribute("engine", config.name), onnx.helper.make_attribute("fusion", config.fusion)])
    counters, graphed = engines.run_eager_and_captured(model, forced, X, TOL, 11)
    assert counters.get("fused_bias_leakyrelu_add") == 1 and counters.get("residual_slice_reads") == 1, counters
    assert counters.get("residual_copies", 0) == 0, counters
    assert {c.node: c.algo for c in graphed.plan_summary()}["c2"] == config.algo
    assert graphed._backend.counters["residual_copies"] == 0  # the captured runs: none either
    _report(f"forced: {config.algo} read the residual slice in place, eager and captured, right; counters {counters}")

"""Graph-API engines reading their input from a channel slice of a Concat buffer on a real GPU (a
dense block's convs read growing prefixes of one buffer): every configuration of the bare conv
and of the fused ``bias+relu`` graph for a key that names the slice (``xslice``), its plan built
with the slice's strides, computes its result reading the slice where it lies (the buffer's other
channels NaN; float64 NumPy reference, TF32 tolerance) or, where cuDNN's engine ignores the
strides, is wrong in a way the tuner's check refuses (at least one right), and refuses a packed
``x``; a configuration cuDNN does not build for the strides reads a packed ``x`` and is right on
one; an RRDB-like dense block (three convs over a growing Concat, LeakyReLU 0.2) at batch 16 in
NHWC, tuned here with engines "all", has the engine rows of its slice keys timed reading the
slice in place or with the copy cuDNN's refusal needs (the note says which), matches ONNX Runtime
CPU eager and captured, and copies no slice an engine step reads in place; the same with its
slice-reading convs forced onto their fastest engine rows that read the slice in place. Each test
prints ``INPUT-SLICE`` lines (run with ``-s`` to see them). The CPU side: tests/test_input_slices.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_graph_api")]

cp = pytest.importorskip("cupy")

import test_graph_api_gpu as engines  # noqa: E402
import test_slice_tuning_gpu as dense  # noqa: E402

import convpass  # noqa: E402
from convpass.core import annotation  # noqa: E402
from convpass.core.algo import Algo  # noqa: E402
from convpass.core.problem import InputSlice, ProblemKey  # noqa: E402
from convpass.native.cudnn import as_layout, empty_like_layout, graph_api  # noqa: E402

TOL = 5e-3  # relative error (norm) of a TF32 conv, as the other engine tests
CONV = ((16, 96, 24, 24), (32, 96, 3, 3), {"pads": [1, 1, 1, 1]})  # a dense block's second conv: 96 channels of a 128-channel buffer
FIRST, TOTAL = 32, 128  # where the slice lies in its buffer (keyed at channel 0: 128 bytes in, the same alignment class)


def _report(what: str) -> None:
    print(f"INPUT-SLICE {what}")


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("fusion", ["", "bias+relu"])
def test_every_configuration_reads_the_input_where_it_lies(layout, fusion):
    shape, _, pre, xp, w, b = engines._inputs(CONV, layout, 4, bias=bool(fusion))
    want = np.maximum(pre, 0) if fusion else pre
    key = shape.key(layout, "default", InputSlice(FIRST % 32, TOTAL))
    try:
        enumerated = graph_api.enumerate_configs(key, fusion)
    except graph_api.GraphApiError as e:
        pytest.skip(f"no engine for {key} + {fusion or 'the bare conv'} here: {e}")
    configs = enumerated.configs()
    wide = empty_like_layout((shape.n, TOTAL, *shape.spatial), "float32", layout)
    wide.fill(cp.nan)  # the other channels: a plan that strays from its slice reads NaN
    x = wide[:, FIRST:FIRST + shape.c]
    x[...] = xp
    assert graph_api.misaligned(x=x) == []
    in_place, packed, wrong = 0, 0, []
    for config, plan in engines._built(key, configs, enumerated):
        y = as_layout(cp.full(shape.y_shape, cp.nan, dtype=cp.float32), layout)
        ws = cp.empty(max(plan.workspace_bytes, 1), cp.uint8)
        if plan.x_strides != key.x_strides:  # cuDNN did not build it for the slice: it reads a packed x (the tuner times the copy)
            assert plan.x_refusal, config.algo
            packed += 1
            plan.execute(xp, w, y, ws, bias=b)
            got = cp.asnumpy(y).astype(np.float64)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) <= TOL, f"{config.algo} ({layout}), packed x"
            continue
        in_place += 1
        plan.execute(x, w, y, ws, bias=b)
        why = engines.wrong_but_refused(y, want, config.algo, layout, TOL)  # one ignoring x's strides reads the NaN channels
        wrong += [why] if why else []
        with pytest.raises(graph_api.InputRefused, match="not of the element strides"):  # the executor copies x into the plan's strides
            plan.execute(xp, w, y, ws, bias=b)
    _report(f"{layout} {fusion or 'bare'}: {len(configs)} configurations offered for {key}, {in_place} built reading the slice "
            f"({in_place - len(wrong)} right, wrong and refused by the tuner's check: {wrong or 'none'}), {packed} built for a packed x")
    assert in_place > len(wrong), f"{layout} {fusion}: no configuration reads the input slice right ({in_place} built, wrong: {wrong})"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The dense block tuned here once, NHWC, engines "all". Returns (cache path, model, tuned model)."""
    return engines.tuned_here(tmp_path_factory, "input_slices", dense._dense_block())


def _rows(path, key: ProblemKey) -> list:
    return [r for r in engines.cached_rows(path, key) if r.method == "measure"]


def _slice_convs(tuned_model, which: str = "x_slice") -> dict:
    """node -> (its decision record, its key) for the convs whose key names an input slice (``which``: or another)."""
    records = {r["node"]: r for r in convpass.inspect(tuned_model)}
    keys = {n: ProblemKey.parse(r["problem_key"]) for n, r in records.items() if r["problem_key"]}
    return {n: (records[n], k) for n, k in keys.items() if getattr(k, which) is not None}


def _engine_ok(rows) -> list:
    return sorted((r for r in rows if r.status == "ok" and Algo.parse(r.algo).is_engine), key=lambda r: r.time_ms)


def test_a_dense_block_tuned_here_reads_its_slices_in_place_with_engines(tuned):
    path, model, tuned_model = tuned
    convs = _slice_convs(tuned_model)
    assert {"conv1", "conv2"} <= set(convs), sorted(convs)  # conv1 reads x0, conv2 cat1: prefixes of cat2's buffer
    may_copy = 0  # slice convs whose decision's row does not say it reads the slice in place
    for node, (record, key) in convs.items():
        rows = _rows(path, key)
        ok = _engine_ok(rows)
        assert ok, f"{node}: no engine row timed ({[(r.algo, r.status, r.note) for r in rows if Algo.parse(r.algo).is_engine][:3]})"
        assert all("input slice read in place" in r.note or "input copied first (cuDNN refuses the slice" in r.note for r in ok), \
            [r.note for r in ok if "input slice read in place" not in r.note][:3]
        assert any("input slice read in place" in r.note for r in ok), f"{node}: no engine reads its slice in place"
        ran = {"engine:" + record["engine"] + (f"+{record['fusion']}" if record["fusion"] and record["engine"] else "")} if record["engine"] \
            else {record["algo"]}
        mine = [r for r in rows if r.algo in ran]
        may_copy += not any("input slice read in place" in r.note for r in mine)
        _report(f"{node} {key}: {len(ok)} engine rows ok, {sum('read in place' in r.note for r in ok)} reading the slice in place, "
                f"fastest {ok[0].algo} {ok[0].time_ms:.4f} ms; decision {record['engine'] or record['algo']} +{record['fusion'] or '(none)'}")
    counters, graphed = engines.run_eager_and_captured(model, tuned_model, (dense.BATCH, 3, dense.HW, dense.HW), TOL, 7)
    assert counters.get("slice_copies", 0) <= may_copy, counters  # none where the decision's row read the slice in place
    _report(f"plan-run counters slice_reads={counters.get('slice_reads', 0)} slice_copies={counters.get('slice_copies', 0)} "
            f"graph_api_calls={counters.get('graph_api_calls', 0)}")


def test_the_block_forced_onto_engines_reading_the_slices_copies_none_in_its_cuda_graph(tuned):
    """conv1's and conv2's decisions replaced by their fastest engine rows that read the slice in
    place (so the strided plans run whatever won): right eager and captured, no slice copied."""
    path, model, tuned_model = tuned
    forced = onnx.ModelProto()
    forced.CopyFrom(tuned_model)
    chosen = {}
    for node_name, (_, key) in _slice_convs(tuned_model).items():
        node = next(n for n in forced.graph.node if n.name == node_name)
        d = annotation.read_node(node, n_profiles=1).decisions[0]
        ok = [r for r in _engine_ok(_rows(path, key)) if "input slice read in place" in r.note and Algo.parse(r.algo).fusion in ("", d.fusion or "")]
        if not ok:
            continue
        config = graph_api.EngineConfig.parse(ok[0].algo)
        kept = [a for a in node.attribute if a.name not in ("engine", "fusion")]
        del node.attribute[:]
        node.attribute.extend(kept + [onnx.helper.make_attribute("engine", config.name)]
                              + ([onnx.helper.make_attribute("fusion", config.fusion)] if config.fusion else []))
        chosen[node_name] = config.algo
    if not chosen:
        _report("forced: cuDNN kept no engine reading an input slice here")
        pytest.skip("cuDNN kept no engine configuration reading an input slice of this block here")
    counters, graphed = engines.run_eager_and_captured(model, forced, (dense.BATCH, 3, dense.HW, dense.HW), TOL, 11)
    # conv2 reads cat1, a prefix of cat2's buffer; conv1 reads x0 in place where the runtime placed it in that buffer
    assert counters.get("slice_copies", 0) == 0 and counters.get("slice_reads", 0) >= 1, counters
    summary = {c.node: c.algo for c in graphed.plan_summary()}
    assert all(summary[n] == a for n, a in chosen.items()), (summary, chosen)
    assert graphed._backend.counters["slice_copies"] == 0  # the captured runs: none either
    _report(f"forced: {chosen} read their slices in place, eager and captured, right; counters slice_reads={counters.get('slice_reads')} "
            f"slice_copies={counters.get('slice_copies', 0)}")

"""Graph-API engines writing their output into a channel slice of a Concat buffer on a real GPU (an
ESRGAN dense block's convs, their LeakyRelu 0.2 fused, each write the next channels of one
buffer): every configuration of the bare conv and of the fused ``bias+leakyrelu0.2`` graph for a
key that names the slice (``yslice``), its plan built with the slice's strides, writes its result
where the slice lies and nothing else (the buffer's other channels stay NaN; float64 NumPy
reference, TF32 tolerance) or, where cuDNN's engine ignores the strides, is wrong in a way the
tuner's check refuses (at least one right), and refuses a packed ``y``; a configuration cuDNN
does not build for the strides writes a packed ``y`` and is right on one; an RRDB-like dense
block (three convs over a growing Concat, LeakyReLU 0.2) at batch 16 in NHWC, tuned here with
engines "all", has the engine rows of its slice-writing keys timed writing the slice in place or
with the copy cuDNN's refusal needs (the note says which), matches ONNX Runtime CPU eager and
captured, runs each LeakyRelu whose decision is a fused engine in the engine's call (no
LeakyRelu launch of its own) and copies no output its decision writes in place; the same with
those convs forced onto their fastest fused rows that write the slice in place: no LeakyRelu
launch at all, no copy. Each test prints ``OUTPUT-SLICE`` lines (run with ``-s`` to see them).
The CPU side: tests/test_output_slices.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_graph_api")]

cp = pytest.importorskip("cupy")

import test_graph_api_gpu as engines  # noqa: E402
import test_input_slices_gpu as inputs  # noqa: E402
import test_slice_tuning_gpu as dense  # noqa: E402

from convpass.core.algo import Algo  # noqa: E402
from convpass.core.problem import OutputSlice, keyed_slice  # noqa: E402
from convpass.native.cudnn import as_layout, empty_like_layout, graph_api  # noqa: E402

TOL = 5e-3  # relative error (norm) of a TF32 conv, as the other engine tests
CONV = ((16, 96, 24, 24), (32, 96, 3, 3), {"pads": [1, 1, 1, 1]})  # a dense block's last growth conv: 32 channels into a 128-channel buffer
FIRST, TOTAL = 96, 128  # where the slice lies in its buffer
L02 = "bias+leakyrelu0.2"


def _report(what: str) -> None:
    print(f"OUTPUT-SLICE {what}")


def _leaky(v):
    return np.where(v > 0, v, 0.2 * v)


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("fusion", ["", L02])
def test_every_configuration_writes_the_output_where_it_lies(layout, fusion):
    shape, _, pre, x, w, b = engines._inputs(CONV, layout, 4, bias=bool(fusion))
    want = _leaky(pre) if fusion else pre
    key = shape.key(layout, "default", y_slice=keyed_slice(OutputSlice(FIRST, TOTAL), "float32"))
    try:
        enumerated = graph_api.enumerate_configs(key, fusion)
    except graph_api.GraphApiError as e:
        pytest.skip(f"no engine for {key} + {fusion or 'the bare conv'} here: {e}")
    configs = enumerated.configs()
    wide = empty_like_layout((shape.n, TOTAL, *shape.output_spatial), "float32", layout)
    y = wide[:, FIRST:FIRST + shape.k]
    assert graph_api.misaligned(y=y) == []
    in_place, packed, wrong = 0, 0, []
    for config, plan in engines._built(key, configs, enumerated):
        ws = cp.empty(max(plan.workspace_bytes, 1), cp.uint8)
        if plan.y_strides != key.y_strides:  # cuDNN did not build it for the slice: it writes a packed y (the tuner times the copy)
            assert plan.y_refusal, config.algo
            packed += 1
            out = as_layout(cp.full(shape.y_shape, cp.nan, dtype=cp.float32), layout)
            plan.execute(x, w, out, ws, bias=b)
            got = cp.asnumpy(out).astype(np.float64)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) <= TOL, f"{config.algo} ({layout}), packed y"
            continue
        in_place += 1
        wide.fill(cp.nan)  # the other channels: a plan that strays from its slice writes them
        plan.execute(x, w, y, ws, bias=b)
        rest = cp.concatenate([wide[:, :FIRST], wide[:, FIRST + shape.k:]], axis=1)
        if not bool(cp.isnan(rest).all()):  # wrote past its slice: the tuner's check (_strays) fails it
            wrong.append(f"{config.algo} wrote outside its slice")
        else:
            why = engines.wrong_but_refused(y, want, config.algo, layout, TOL)
            wrong += [why] if why else []
        with pytest.raises(graph_api.OutputRefused, match="not of the element strides"):  # the executor writes a buffer of its strides
            plan.execute(x, w, as_layout(cp.empty(shape.y_shape, dtype=cp.float32), layout), ws, bias=b)
    _report(f"{layout} {fusion or 'bare'}: {len(configs)} configurations offered for {key}, {in_place} built writing the slice "
            f"({in_place - len(wrong)} right, wrong and refused by the tuner's check: {wrong or 'none'}), {packed} built for a packed y")
    assert in_place > len(wrong), f"{layout} {fusion}: no configuration writes the output slice right ({in_place} built, wrong: {wrong})"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The dense block tuned here once, NHWC, engines "all". Returns (cache path, model, tuned model)."""
    return engines.tuned_here(tmp_path_factory, "output_slices", dense._dense_block())


def _writing_convs(tuned_model) -> dict:
    """node -> (its decision record, its key) for the convs whose key names an output slice."""
    return inputs._slice_convs(tuned_model, "y_slice")


def _leaky_launches(graphed) -> list[str]:
    """The labels of the captured plan's launches that run a LeakyRelu outside a conv's call."""
    labels = [launch.label for launch in graphed.last_plan.backend_state.launch_list()]
    return [label for label in labels if "leakyrelu" in label.lower() and not label.startswith("Conv")]


def test_a_dense_block_tuned_here_writes_its_slices_in_place_with_its_leakyrelus_fused(tuned):
    path, model, tuned_model = tuned
    convs = _writing_convs(tuned_model)
    assert {"stem", "conv1", "conv2"} <= set(convs), sorted(convs)  # each writes its LeakyRelu's slice of cat2's buffer
    may_copy, fused = 0, []
    for node, (record, key) in convs.items():
        assert record["fusion"] == L02 or not record["engine"], (node, record)  # the problem: the conv with its LeakyRelu
        rows = inputs._rows(path, key)
        ok = inputs._engine_ok(rows)
        assert ok, f"{node}: no engine row timed ({[(r.algo, r.status, r.note) for r in rows if Algo.parse(r.algo).is_engine][:3]})"
        assert all("output written into its slice in place" in r.note or "output copied into its slice after (cuDNN refuses the slice" in r.note
                   for r in ok), [r.note for r in ok][:3]
        assert any("output written into its slice in place" in r.note and Algo.parse(r.algo).fusion == L02 for r in ok), \
            f"{node}: no fused engine writes its slice in place"
        ran = "engine:" + record["engine"] + (f"+{record['fusion']}" if record["fusion"] else "") if record["engine"] else record["algo"]
        mine = [r for r in rows if r.algo == ran]
        may_copy += not any("written into its slice in place" in r.note for r in mine)
        fused += [node] if record["engine"] and record["fusion"] == L02 else []
        _report(f"{node} {key}: {len(ok)} engine rows ok, {sum('written into its slice in place' in r.note for r in ok)} writing the slice in "
                f"place, fastest {ok[0].algo} {ok[0].time_ms:.4f} ms; decision {ran}")
    counters, graphed = engines.run_eager_and_captured(model, tuned_model, (dense.BATCH, 3, dense.HW, dense.HW), TOL, 7)
    assert counters.get("fused_bias_leakyrelu", 0) == len(fused), (counters, fused)  # each fused decision: its LeakyRelu in the engine's call
    assert len(_leaky_launches(graphed)) == 3 - len(fused), _leaky_launches(graphed)  # the others: the LeakyRelu's own pass
    assert counters.get("slice_write_copies", 0) <= may_copy, counters  # none where the decision's row wrote the slice in place
    _report(f"fused {fused}; plan-run counters slice_writes={counters.get('slice_writes', 0)} slice_write_copies="
            f"{counters.get('slice_write_copies', 0)} fused_bias_leakyrelu={counters.get('fused_bias_leakyrelu', 0)}; "
            f"LeakyRelu launches of their own: {_leaky_launches(graphed)}")


def test_the_block_forced_onto_fused_engines_writing_the_slices_runs_no_leakyrelu_and_copies_nothing(tuned):
    """stem's, conv1's and conv2's decisions replaced by their fastest fused rows that write the
    slice in place (so the strided fused plans run whatever won): right eager and captured, no
    LeakyRelu launch of its own, no output copied into its slice."""
    path, model, tuned_model = tuned
    forced = onnx.ModelProto()
    forced.CopyFrom(tuned_model)
    chosen = {}
    for node_name, (_, key) in _writing_convs(tuned_model).items():
        node = next(n for n in forced.graph.node if n.name == node_name)
        ok = [r for r in inputs._engine_ok(inputs._rows(path, key)) if "output written into its slice in place" in r.note and Algo.parse(r.algo).fusion == L02]
        if not ok:
            continue
        config = graph_api.EngineConfig.parse(ok[0].algo)
        kept = [a for a in node.attribute if a.name not in ("engine", "fusion")]
        del node.attribute[:]
        node.attribute.extend(kept + [onnx.helper.make_attribute("engine", config.name), onnx.helper.make_attribute("fusion", config.fusion)])
        chosen[node_name] = config.algo
    if len(chosen) < 3:
        _report(f"forced: cuDNN kept a fused engine writing the slice for {sorted(chosen)} only")
        pytest.skip(f"cuDNN kept no fused engine writing its output slice for {sorted(set(_writing_convs(tuned_model)) - set(chosen))} here")
    counters, graphed = engines.run_eager_and_captured(model, forced, (dense.BATCH, 3, dense.HW, dense.HW), TOL, 11)
    assert counters.get("fused_bias_leakyrelu", 0) == 3 and counters.get("slice_writes", 0) >= 3, counters
    assert counters.get("slice_write_copies", 0) == 0, counters
    assert _leaky_launches(graphed) == []
    summary = {c.node: c.algo for c in graphed.plan_summary()}
    assert all(summary[n] == a for n, a in chosen.items()), (summary, chosen)
    assert graphed._backend.counters["slice_write_copies"] == 0  # the captured runs: none either
    _report(f"forced: {chosen} wrote their slices in place with their LeakyRelu fused, eager and captured, right; counters "
            f"slice_writes={counters.get('slice_writes')} slice_write_copies={counters.get('slice_write_copies', 0)}")

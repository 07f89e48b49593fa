"""What is timed is what runs, on a real GPU: for every conv decision of a small model, the
execution object (:mod:`convpass.kernels.conv_exec`) the tuner timed for the recorded algorithm
and the one the executor's plan runs are of the same class, with the same problem key, the same
algorithm (a graph-API engine's id and knobs, a fused epilogue) and the same workspace."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import MODELS, leaky_model, run_ort, silu_model  # noqa: E402

import convpass  # noqa: E402
from convpass.kernels import conv_exec  # noqa: E402
from convpass.kernels.convolution import ConvLaunch  # noqa: E402
from convpass.runtime import Executor  # noqa: E402

CASES = {
    "residual_cnn": (lambda: onnx.load(MODELS / "residual_cnn.onnx"), {"input": (1, 3, 64, 64)}),  # legacy calls, fused residuals
    "mobile_block": (lambda: onnx.load(MODELS / "mobile_block.onnx"), {"input": (2, 3, 32, 32)}),  # depthwise: own kernels
    "silu": (silu_model, {"x": (2, 16, 12, 12)}),  # graph-API engines, the fused bias+swish graph
    "leaky": (leaky_model, {"x": (2, 8, 12, 12)}),  # the fused bias+leakyrelu0.2 / 0.1 graphs
}



def _runs(record: dict) -> str:
    """The algorithm text of what a recorded decision runs (:class:`convpass.core.algo.Algo`)."""
    fusion = f"+{record['fusion']}" if record["fusion"] else ""
    return f"engine:{record['engine']}{fusion}" if record["engine"] else record["algo"] + fusion


@pytest.mark.parametrize("case", list(CASES))
def test_each_decision_runs_the_object_the_tuner_timed(case, tmp_path):
    make, inputs = CASES[case]
    shapes = [",".join(f"{name}={'x'.join(map(str, dims))}" for name, dims in inputs.items())]
    with conv_exec.record_launches() as timed:
        convpass.optimize(make(), tmp_path / "m.onnx", shapes=shapes, cache=tmp_path / "c.db", quiet=True, tf32="on")
    records = {r["node"]: r for r in convpass.inspect(onnx.load(tmp_path / "m.onnx"))}
    assert records and all(r["source"] == "measure" for r in records.values()), records

    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(dims).astype(np.float32) for name, dims in inputs.items()}
    ex = Executor(str(tmp_path / "m.onnx"), device="cuda", cuda_graph=False)
    ex.run(None, feeds)  # the op-by-op run that records the plan
    with conv_exec.record_launches() as ran:
        ex.run(None, feeds)  # the plan's launches
    launches = [launch for launch in ex.last_plan.backend_state.launch_list() if isinstance(launch, ConvLaunch)]
    assert sorted(launch.call.node_name for launch in launches) == sorted(records)

    runs = []
    for launch in launches:
        node, resolution = launch.call.node_name, launch.exec
        record = records[node]
        assert resolution.source == "recorded", (node, resolution.source, resolution.note)
        [conv] = resolution.steps.values()  # the one object the plan's launch of this conv runs
        runs.append(conv.identity)
        assert (str(conv.key), str(conv.algo)) == (record["problem_key"], _runs(record)), (node, conv, record)
        assert conv.workspace_bytes == record["workspace_bytes"], (node, conv, record)
        tuned = {t.identity for t in timed if (t.identity.key, t.identity.algo) == (conv.key, str(conv.algo))}
        assert tuned, f"{node}: the tuner never launched {conv}"
        assert {(t.kind, t.workspace_bytes) for t in tuned} == {(type(conv).__name__, conv.workspace_bytes)}, (node, conv, tuned)
        print(f"{node}: {conv.describe()}")
    assert collections.Counter(r.identity for r in ran) == collections.Counter(runs)  # and nothing else launched


# ---------------------------------------------------------------------------------------------
# convs reading their input from a channel slice of a Concat buffer (an RRDB / DenseNet dense block)


def _dense_block(n: int = 4, c: int = 16, g: int = 8, hw: int = 16) -> onnx.ModelProto:
    """``x = conv0(input)``; ``c1 = LeakyRelu(conv1(x))``; ``c2 = conv2(Concat(x, c1))``;
    ``y = conv3(Concat(x, c1, c2))``: the executor keeps ``x``, ``c1`` and ``c2`` in one Concat
    buffer, so conv1 reads the channel slice ``[0, c)`` of it, conv2 the slice ``[0, c + g)`` (and
    writes ``[c + g, c + 2g)``), conv3 all of it (packed)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(21)

    def conv(name, x, k, cin):
        w = numpy_helper.from_array((rng.standard_normal((k, cin, 3, 3)) / np.sqrt(9 * cin)).astype(np.float32), f"{name}.w")
        b = numpy_helper.from_array((rng.standard_normal(k) * 0.1).astype(np.float32), f"{name}.b")
        return helper.make_node("Conv", [x, w.name, b.name], [f"{name}.y"], name=name, pads=[1, 1, 1, 1]), [w, b]

    nodes, inits = [], []
    for name, x, k, cin in (("conv0", "input", c, 8), ("conv1", "conv0.y", g, c), ("conv2", "cat1", g, c + g), ("conv3", "cat2", 8, c + 2 * g)):
        node, params = conv(name, x, k, cin)
        nodes.append(node)
        inits += params
        if name == "conv1":
            nodes.append(helper.make_node("LeakyRelu", ["conv1.y"], ["c1"], name="lrelu1", alpha=0.2))
            nodes.append(helper.make_node("Concat", ["conv0.y", "c1"], ["cat1"], name="cat1", axis=1))
        if name == "conv2":
            nodes.append(helper.make_node("Concat", ["conv0.y", "c1", "conv2.y"], ["cat2"], name="cat2", axis=1))
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [n, 8, hw, hw])],
                              [helper.make_tensor_value_info("conv3.y", TensorProto.FLOAT, [n, 8, hw, hw])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _rel(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("tf32", ["off", "on"])
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_a_dense_blocks_convs_read_their_concat_slices_in_place_or_copy_where_cudnn_refuses(layout, tf32, tmp_path, caplog):
    """Tuned and run at batch 4, eagerly and captured, against ONNX Runtime CPU. A conv whose
    input is a channel slice of the block's Concat buffer reads it through cuDNN's strided input
    descriptor, or copies it where cuDNN refused that in the warm-up (said at debug level): printed
    per conv, so a run shows what this cuDNN takes. Refusals never break the capture."""
    import logging

    from convpass.native import cudnn
    from convpass.runtime.cuda import CudaBackend

    model = _dense_block()
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, tf32=tf32, engines="legacy", layout=layout)
    assert {r["memory_format"] for r in convpass.inspect(tuned)} == {layout.upper()}
    x = np.random.default_rng(22).standard_normal((4, 8, 16, 16)).astype(np.float32)
    [want] = run_ort(model, {"input": x})
    tol = 5e-3 if tf32 == "on" else 1e-4
    for cuda_graph in (False, True):
        backend = CudaBackend()
        ex = Executor(tuned, device=backend, cuda_graph=cuda_graph)
        with caplog.at_level(logging.DEBUG, logger="convpass"):
            first = ex.run(None, {"input": x})  # op by op: the run that records the plan
            before = dict(backend.counters)
            with conv_exec.record_launches() as ran:
                second = ex.run(None, {"input": x})  # the plan's launches (captured: the warm-up, then the capture)
        counters = {k: v - before.get(k, 0) for k, v in backend.counters.items()}
        outs = [first, second] + [ex.run(None, {"input": x}) for _ in range(2)]  # replayed when captured
        for i, [y] in enumerate(outs):
            assert _rel(y, want) <= tol, f"{layout} tf32 {tf32} cuda_graph={cuda_graph} run {i + 1}: {_rel(y, want):.3g} > {tol:g}"
        if cuda_graph:
            assert ex.graph_status().captured, ex.graph_status().describe()
        launches = [launch for launch in ex.last_plan.backend_state.launch_list() if isinstance(launch, ConvLaunch)]
        assert [launch.call.node_name for launch in launches] == ["conv0", "conv1", "conv2", "conv3"]
        def reads_slice(record, layout=layout) -> bool:  # x not packed: a launch reads a slice (the executor copies any other)
            shape, _, strides = record.args[0]
            return not all(d == 1 or s == p for d, s, p in zip(shape, strides, cudnn.strides_for(shape, layout)))

        assert counters.get("slice_reads", 0) == sum(reads_slice(r) for r in ran), counters
        for launch, record in zip(launches, ran):  # the plan's first launches (captured: the warm-up's; the capture's follow)
            res, node, read = launch.exec, launch.call.node_name, reads_slice(record)
            slice_in = node in ("conv1", "conv2")
            print(f"{layout} tf32 {tf32} graph={cuda_graph} {node}: {record.identity.kind} {record.identity.algo!r}; "
                  f"input {'read in place, strides ' + str(record.args[0][2]) if read else 'packed'}"
                  f"{' (a Concat slice)' if slice_in else ''}; strided input ok {res.strided_input_ok}, strided output ok {res.strided_output_ok}")
            if not slice_in:
                assert not read, node
            elif record.identity.kind in ("LegacyConv", "FusedLegacyConv"):
                assert read == res.strided_input_ok, (node, read, res.strided_input_ok)
        refusals = [r.getMessage() for r in caplog.records if "refuses to read from a Concat slice" in r.getMessage()]
        for message in refusals:
            print("  refused:", message)
        caplog.clear()

"""An RRDB-like dense block (three 3x3 convs over a growing Concat, LeakyReLU 0.2) at batch 16,
tuned in NHWC with legacy algorithms and with every engine: the convs that read a slice of the
Concat buffer are decided under keys that name the slice, and each either reads it in place on
every run or was timed with the copy its refusal needs (its cache row says so): no input copy on
a run that the decision did not price, and no warning about one. The outputs match ONNX Runtime
(CPU). The CPU side: tests/test_conv_slice_problems.py, tests/test_slice_tuning.py."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import run_ort  # noqa: E402

import convpass  # noqa: E402
from convpass.core.problem import ProblemKey  # noqa: E402
from convpass.native.device import detect  # noqa: E402
from convpass.runtime import Executor  # noqa: E402
from convpass.tuning.cache import TuningCache  # noqa: E402

BATCH, NF, GC, HW = 16, 64, 32, 48


def _dense_block() -> onnx.ModelProto:
    """stem conv -> LeakyRelu = x0; f_k = LeakyRelu(conv_k(cat(x0, f_1, .. f_{k-1}))) for k = 1, 2;
    y = conv_3(cat(x0, f1, f2)) + x0 (ESRGAN's dense block, three convs deep)."""
    rng = np.random.default_rng(5)
    inits, nodes = [], []

    def w(name, shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * (2.0 / np.prod(shape[1:])) ** 0.5).astype(np.float32), name))
        return name

    nodes.append(helper.make_node("Conv", ["x", w("ws", (NF, 3, 3, 3)), w("bs", (NF,))], ["s"], name="stem", pads=[1] * 4))
    nodes.append(helper.make_node("LeakyRelu", ["s"], ["x0"], name="stem_act", alpha=0.2))
    feats, channels = ["x0"], NF
    for k in (1, 2):
        src = "x0" if k == 1 else f"cat{k - 1}"
        nodes.append(helper.make_node("Conv", [src, w(f"w{k}", (GC, channels, 3, 3)), w(f"b{k}", (GC,))], [f"c{k}"], name=f"conv{k}", pads=[1] * 4))
        nodes.append(helper.make_node("LeakyRelu", [f"c{k}"], [f"f{k}"], name=f"act{k}", alpha=0.2))
        feats.append(f"f{k}")
        channels += GC
        nodes.append(helper.make_node("Concat", list(feats), [f"cat{k}"], name=f"cat{k}", axis=1))
    nodes.append(helper.make_node("Conv", ["cat2", w("w3", (NF, channels, 3, 3)), w("b3", (NF,))], ["c3"], name="conv3", pads=[1] * 4))
    nodes.append(helper.make_node("Add", ["c3", "x0"], ["y"], name="residual"))
    graph = helper.make_graph(nodes, "rrdb_dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, 3, HW, HW])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, NF, HW, HW])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _runs(record: dict) -> set[str]:
    """The algorithm names a decision record may run under in the cache: its legacy algorithm and,
    with an engine, the engine's row."""
    engine = record.get("engine") or ""
    return {record["algo"], engine, "engine:" + engine} - {""}


@pytest.fixture(autouse=True)
def _need_cuda():
    from convpass.runtime import cuda

    reason = cuda.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("engines", ["legacy", "all"])
def test_a_dense_blocks_slice_reads_are_tuned_as_they_run(tmp_path, engines):
    model = _dense_block()
    cache = tmp_path / "c.db"
    tuned = convpass.optimize(model, cache=cache, quiet=True, tf32="on", engines=engines, layout="nhwc")
    records = {r["node"]: r for r in convpass.inspect(tuned)}
    keys = {name: ProblemKey.parse(records[name]["problem_key"]) for name in ("conv1", "conv2", "conv3")}
    assert keys["conv1"].x_slice is not None and keys["conv2"].x_slice is not None, "the convs of the Concat's slices name them"
    assert keys["conv3"].x_slice is None  # the root: the whole buffer, packed
    with TuningCache(cache) as store:
        rows = {name: [m for m in store.get(detect(), keys[name].shape) if m.key == keys[name] and m.method == "measure"
                       and m.algo in _runs(records[name])] for name in ("conv1", "conv2")}
    assert all(rows.values()), "the decision's own rows are the slice key's"
    copied_by_decision = {name: any("input copied first" in m.note for m in rs) for name, rs in rows.items()}

    x = np.random.default_rng(4).standard_normal((BATCH, 3, HW, HW)).astype(np.float32)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ex = Executor(tuned, device="cuda", cuda_graph=False)
        for _ in range(2):  # op by op, then the compiled plan's first run (refusals learned)
            ex.run(None, {"x": x})
        counters = ex._backend.counters
        before = dict(counters)
        (y,) = ex.run(None, {"x": x})
    assert not [w for w in said if "copied on every run" in str(w.message)], "a copy the tuning did not price"
    copies = counters["slice_copies"] - before["slice_copies"]
    reads = counters["slice_reads"] - before["slice_reads"]
    priced = sum(copied_by_decision.values())
    # conv1 and conv2 read channel slices: in place, or copied where their decision priced the copy;
    # where the runtime did not place a value the compiler expected in a slice (a fused engine's
    # epilogue writes no slice) a conv reads it packed, neither read nor copied
    assert copies <= priced, f"{copies} channel slices copied in one run, {priced} priced by the tuning ({copied_by_decision})"
    assert reads + copies <= 2 and (engines != "legacy" or reads + copies == 2), f"{reads} slice reads, {copies} slice copies"
    (want,) = run_ort(model, {"x": x})
    err = float(np.linalg.norm(y - want) / np.linalg.norm(want))
    assert err <= 5e-3, f"normwise relative error {err:.3g}"

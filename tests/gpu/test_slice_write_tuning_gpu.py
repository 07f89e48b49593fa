"""A DenseNet-like dense block at batch 16 (a stem, four BN-ReLU-1x1-ReLU-3x3 layers whose 3x3 conv
writes its 32 channels into the block's Concat buffer, then one 3x3 conv that reads the buffer's
slice and writes its own: DenseNet's and RRDB's two cases), tuned in NHWC with legacy algorithms:
the convs that write a slice are decided under keys that name it (``yslice``), each either writes
it in place on every run or was timed with the copy its refusal needs (its cache row says so); no
copy on a run that the decision did not price, and no warning about one; the outputs match ONNX
Runtime (CPU); and timed in place inside the plan, no slice-writing conv runs more than the
in-place check's 15% over its tuned time (they ran 1.25x when the tuner timed a packed output).
The CPU side: tests/test_conv_output_slices.py, tests/test_slice_write_tuning.py, tests/test_slice_writes.py."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_cuda_backend")]

cp = pytest.importorskip("cupy")

from conftest import run_ort, steady_run  # noqa: E402

import convpass  # noqa: E402
from convpass.core.problem import ProblemKey  # noqa: E402
from convpass.native.device import detect  # noqa: E402
from convpass.runtime import Executor  # noqa: E402
from convpass.runtime.in_place import SLOW_RATIO, check_in_place  # noqa: E402
from convpass.tuning.cache import TuningCache  # noqa: E402

BATCH, C0, GROWTH, BOTTLENECK, HW, LAYERS = 16, 128, 32, 128, 28, 4
TOTAL = C0 + (LAYERS + 1) * GROWTH


def _dense_block() -> onnx.ModelProto:
    """stem = Relu(conv 3x3/2 (x) + b) = x0 (16x128x28x28); layer k: Relu(BN(cat_{k-1})) ->
    conv1 1x1 + bias -> Relu -> conv2 3x3, no bias = f_k; cat_k = Concat(x0, f_1, .. f_k); then
    f5 = Relu(conv5 3x3 (cat4) + b) (reads a slice, writes a slice); y = conv_t 1x1 (Relu(cat5))."""
    rng = np.random.default_rng(11)
    inits, nodes = [], []

    def w(name, shape, scale=None):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        data = rng.standard_normal(shape) * (scale if scale is not None else (2.0 / fan_in) ** 0.5)
        inits.append(numpy_helper.from_array(data.astype(np.float32), name))
        return name

    def bn(name, src, channels):
        scale = numpy_helper.from_array((1 + 0.1 * rng.standard_normal(channels)).astype(np.float32), f"{name}_s")
        shift = numpy_helper.from_array((0.1 * rng.standard_normal(channels)).astype(np.float32), f"{name}_b")
        mean = numpy_helper.from_array((0.1 * rng.standard_normal(channels)).astype(np.float32), f"{name}_m")
        var = numpy_helper.from_array((1 + 0.1 * rng.random(channels)).astype(np.float32), f"{name}_v")
        inits.extend([scale, shift, mean, var])
        nodes.append(helper.make_node("BatchNormalization", [src, scale.name, shift.name, mean.name, var.name], [name], name=name))
        return name

    nodes.append(helper.make_node("Conv", ["x", w("ws", (C0, 3, 3, 3)), w("bs", (C0,), 0.1)], ["s"], name="stem", pads=[1] * 4, strides=[2, 2]))
    nodes.append(helper.make_node("Relu", ["s"], ["x0"], name="stem_act"))
    feats, channels = ["x0"], C0
    for k in range(1, LAYERS + 1):
        src = "x0" if k == 1 else f"cat{k - 1}"
        nodes.append(helper.make_node("Relu", [bn(f"norm{k}", src, channels)], [f"a{k}"], name=f"relu{k}a"))
        nodes.append(helper.make_node("Conv", [f"a{k}", w(f"w{k}a", (BOTTLENECK, channels, 1, 1)), w(f"b{k}a", (BOTTLENECK,), 0.1)], [f"h{k}"],
                                      name=f"layer{k}_conv1"))
        nodes.append(helper.make_node("Relu", [f"h{k}"], [f"r{k}"], name=f"relu{k}b"))
        nodes.append(helper.make_node("Conv", [f"r{k}", w(f"w{k}b", (GROWTH, BOTTLENECK, 3, 3))], [f"f{k}"], name=f"layer{k}_conv2", pads=[1] * 4))
        feats.append(f"f{k}")
        channels += GROWTH
        nodes.append(helper.make_node("Concat", list(feats), [f"cat{k}"], name=f"cat{k}", axis=1))
    nodes.append(helper.make_node("Conv", [f"cat{LAYERS}", w("w5", (GROWTH, channels, 3, 3)), w("b5", (GROWTH,), 0.1)], ["c5"], name="reads_and_writes",
                                  pads=[1] * 4))
    nodes.append(helper.make_node("Relu", ["c5"], ["f5"], name="relu5"))
    feats.append("f5")
    nodes.append(helper.make_node("Concat", list(feats), ["cat5"], name="cat5", axis=1))
    nodes.append(helper.make_node("Relu", ["cat5"], ["t"], name="transition_relu"))
    nodes.append(helper.make_node("Conv", ["t", w("wt", (C0, TOTAL, 1, 1))], ["y"], name="transition"))
    graph = helper.make_graph(nodes, "dense_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, 3, 2 * HW, 2 * HW])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, C0, HW, HW])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


WRITERS = ["stem", *(f"layer{k}_conv2" for k in range(1, LAYERS + 1)), "reads_and_writes"]
# judged in place: the stem's launch also converts the NCHW graph input to its format, which its
# tuning did not time (the in-place check counts it in; tests/gpu/test_in_place_gpu.py)
JUDGED = WRITERS[1:]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    if detect() is None:
        pytest.skip("no usable GPU / cuDNN")
    cache = tmp_path_factory.mktemp("yslice") / "c.db"
    model = _dense_block()
    return model, convpass.optimize(model, cache=cache, quiet=True, tf32="on", engines="legacy", layout="nhwc"), cache


def _feeds():
    return {"x": np.random.default_rng(4).standard_normal((BATCH, 3, 2 * HW, 2 * HW)).astype(np.float32)}


def test_the_slice_writing_convs_are_tuned_writing_their_slices_and_run_so(tuned):
    model, tuned_model, cache = tuned
    records = {r["node"]: r for r in convpass.inspect(tuned_model)}
    keys = {name: ProblemKey.parse(r["problem_key"]) for name, r in records.items()}
    assert all(keys[name].y_slice is not None for name in WRITERS), {n: str(keys[n]) for n in WRITERS}
    assert keys["reads_and_writes"].x_slice is not None, "the conv reading the buffer's slice names it too"
    assert keys["transition"].y_slice is None and keys["transition"].x_slice is None  # the root, packed; y a graph output
    with TuningCache(cache) as store:
        rows = {name: [m for m in store.get(detect(), keys[name].shape) if m.key == keys[name] and m.method == "measure"
                       and m.algo == records[name]["algo"]] for name in WRITERS}
    assert all(rows.values()), "the decisions' own rows are the slice keys'"
    copied = {name: any("output copied into its slice after" in m.note for m in rs) for name, rs in rows.items()}

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        outputs, added = steady_run(tuned_model, _feeds())
    assert not [w for w in said if "copied on every run" in str(w.message)], "a copy the tuning did not price"
    assert added["slice_write_copies"] <= sum(copied.values()), (added, copied)
    assert added["slice_writes"] + added["slice_write_copies"] == len(WRITERS), added
    (want,) = run_ort(model, _feeds())
    err = float(np.linalg.norm(outputs[0] - want) / np.linalg.norm(want))
    assert err <= 5e-3, f"normwise relative error {err:.3g}"


def test_no_slice_writing_conv_runs_over_the_in_place_checks_bound(tuned):
    _, tuned_model, _ = tuned
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = Executor(tuned_model, device="cuda", cuda_graph=False)
        report = check_in_place(ex, {"x": cp.asarray(_feeds()["x"])})
    print("\n".join(c.line() for c in report.convs))
    assert report.reliable, report.how
    timed = {c.node: c for c in report.convs}
    assert set(JUDGED) <= set(timed), sorted(timed)
    slow = [timed[name].line() for name in JUDGED if timed[name].ratio > SLOW_RATIO]
    assert not slow, "\n".join(slow)

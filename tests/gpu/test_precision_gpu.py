"""Precision per conv on a real GPU: float16 / bfloat16 conv candidates against a float64 reference,
a mixed-precision model tuned within its budget and checked end to end, the GPU evaluator against
the CPU emulation, a tuned model's outputs the same bits in two fresh processes, and ``fp32-strict``
recording no transform algorithm and matching the float64 truth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import REPO  # noqa: E402
from precision_fakes import residual_model  # noqa: E402

import convpass  # noqa: E402
from convpass.compiler.pipeline import inspect  # noqa: E402
from convpass.compiler.precision.data import InputSet, model_error  # noqa: E402
from convpass.compiler.precision.evaluate import CpuEvaluator, CudaEvaluator  # noqa: E402
from convpass.core import annotation  # noqa: E402
from convpass.core.options import TuneOptions  # noqa: E402
from convpass.core.problem import ConvProblem, ConvShape  # noqa: E402

BATCH = 16
SPEC = f"input={BATCH}x64x56x56"



# ------------------------------------------------------------------ conv candidates

# float32 accumulation: inputs exactly representable (the reference reads the rounded inputs), sums
# off by about sqrt(K) * 2^-24, the output rounded once to the data type: 2^-11 (float16) or 2^-8
# (bfloat16) of each element at most. Twice that, normwise.
TOLERANCE = {"float16": 1e-3, "bfloat16": 8e-3}
SHAPES = {
    "3x3": dict(n=8, c=64, k=64, spatial=(28, 28), kernel=(3, 3), pads=(1, 1), strides=(1, 1), dilations=(1, 1)),
    "1x1s2": dict(n=8, c=128, k=256, spatial=(28, 28), kernel=(1, 1), pads=(0, 0), strides=(2, 2), dilations=(1, 1)),
    "depthwise": dict(n=8, c=96, k=96, spatial=(28, 28), kernel=(3, 3), pads=(1, 1), strides=(1, 1), dilations=(1, 1), groups=96),
}


def _reference(x: np.ndarray, w: np.ndarray, shape: ConvShape) -> np.ndarray:
    from convpass.ops.conv import conv_geometry, conv_reference

    attrs = {"pads": list(shape.pads) * 2, "strides": list(shape.strides), "dilations": list(shape.dilations), "group": shape.groups}
    return conv_reference(np, x, w, None, conv_geometry("Conv", attrs, x.shape, w.shape, "float32"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_reduced_precision_candidates_match_a_float64_reference(dtype, name):
    """Every legacy algorithm the tuner accepts for the float16 / bfloat16 problem, in both layouts,
    run through the binding and compared with float64 NumPy on the same (rounded) inputs."""
    from convpass.core.algo import Algo
    from convpass.native import cudnn
    from convpass.tuning import harness
    from convpass.tuning.tuner import measure_problem

    shape = ConvShape("fwd", dtype=dtype, **SHAPES[name])
    with cp.cuda.Stream(non_blocking=True):  # as the tuner measures
        rows = measure_problem(ConvProblem((shape,)), TuneOptions(engines="legacy"))
    ok = [m for m in rows if m.status == "ok" and m.method == "measure" and Algo.parse(m.algo).bare_of("legacy")]
    assert ok, f"no {dtype} candidate passed the tuner for {shape}"
    checked = []
    for m in ok:
        layout = m.key.layout
        x = harness.random_array(shape.x_shape, dtype, layout, 1)
        w = harness.random_array(shape.w_shape, dtype, layout, 2, scale=(shape.c // shape.groups * 9) ** -0.5)
        y = cudnn.empty_like_layout(shape.y_shape, dtype, layout)
        with cudnn.ConvDescriptors(m.key) as descs:
            cudnn.run(descs, "fwd", m.algo, x, w, y)
        cp.cuda.runtime.deviceSynchronize()
        host = lambda a: cp.ascontiguousarray(harness.to_float32(a, dtype)).get().astype(np.float64)  # noqa: E731
        ref = _reference(host(x), host(w), shape)
        got = host(y)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err <= TOLERANCE[dtype], f"{m.key} {m.algo}: relative L2 error {err:.2e} > {TOLERANCE[dtype]}"
        checked.append((layout, m.algo))
    assert {layout for layout, _ in checked} == {"nchw", "nhwc"} or shape.is_depthwise, checked


# ------------------------------------------------------------------ a model end to end


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("precision") / "residual.onnx"
    onnx.save(residual_model(), path)
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One tuning cache for the module: the model is measured once, the other tests read it."""
    return str(tmp_path_factory.mktemp("cache") / "c.db")


def _held_out(seed: int = 1) -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(seed).standard_normal((BATCH, 64, 56, 56)).astype(np.float32)}


def _reference_of(model_path, feed):
    return ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"]).run(None, feed)


@pytest.mark.parametrize("budget", [1e-2, 1e-3])
def test_a_mixed_precision_model_is_within_budget_end_to_end(model_path, tmp_path, cache, budget):
    out = tmp_path / "tuned.onnx"
    tuned = convpass.optimize(str(model_path), str(out), shapes=[SPEC], cache=cache,
                              precision="auto", max_error=budget, quiet=True)
    info = annotation.read_model_info(tuned)
    record = info.precision
    print(json.dumps(record, indent=1))
    print([(r["node"], r["precision"], r["time_ms"], r["precision_error"]) for r in inspect(tuned)])
    assert record["within_budget"] and record["calibration"]["error"] <= budget
    assert record["evaluator"] == CudaEvaluator().description
    assert all(r["source"] == "measure" for r in inspect(tuned))
    # the held-out error again, here: the tuned model on the GPU executor against ONNX Runtime CPU
    feed = _held_out()
    got = convpass.Executor(str(out), device="cuda", output_kind="numpy").run(None, feed)
    error = model_error([got], [_reference_of(model_path, feed)], "max-rel")
    assert error == pytest.approx(record["holdout"]["error"], rel=1e-3, abs=1e-7)
    # which precisions pay for their casts is measured, not assumed: the benchmark reports the speed
    # ONNX Runtime runs the same model: its float16 arithmetic differs, its error is of the same size
    ort_out = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feed)
    assert model_error([ort_out], [_reference_of(model_path, feed)], "max-rel") <= 3 * budget


def test_the_gpu_evaluator_and_the_cpu_emulation_agree_on_a_float16_model(model_path, tmp_path, cache):
    out = tmp_path / "fp16.onnx"
    tuned = convpass.optimize(str(model_path), str(out), shapes=[SPEC], cache=cache, precision="fp16", quiet=True)
    assert {r["precision"] for r in inspect(tuned)} == {"fp16"}
    feed = _held_out(3)
    inputs = InputSet("holdout", (feed,), "seed 3")
    ref = [_reference_of(model_path, feed)]
    gpu = model_error(CudaEvaluator().outputs(tuned, [], inputs), ref, "max-rel")
    cpu = model_error(CpuEvaluator().outputs(tuned, [], inputs), ref, "max-rel")
    print(f"float16 model: GPU {gpu:.3e}, CPU emulation {cpu:.3e}")
    assert 1e-5 < gpu < 1e-2 and cpu / 3 <= gpu <= 3 * cpu


def test_a_cached_re_run_writes_the_same_model(model_path, tmp_path, cache):
    first = convpass.optimize(str(model_path), None, shapes=[SPEC], cache=cache, precision="auto", max_error=1e-2, quiet=True)
    again = convpass.optimize(str(model_path), None, shapes=[SPEC], cache=cache, precision="auto", max_error=1e-2, quiet=True)
    assert first.SerializeToString() == again.SerializeToString()


_RUN = """
import hashlib, sys
import numpy as np
from convpass.runtime import Executor
ex = Executor(sys.argv[1], device="cuda", output_kind="numpy")
x = np.random.default_rng(11).standard_normal(({batch}, 64, 56, 56)).astype(np.float32)
print(" ".join(hashlib.sha256(b"".join(o.tobytes() for o in ex.run(None, {{"input": x}}))).hexdigest() for _ in range(3)))
"""


def test_a_tuned_model_gives_the_same_bits_in_two_fresh_processes(model_path, tmp_path, cache):
    out = tmp_path / "tuned.onnx"
    convpass.optimize(str(model_path), str(out), shapes=[SPEC], cache=cache, precision="auto", max_error=1e-2, quiet=True)
    script = _RUN.format(batch=BATCH)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    runs = [subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, env=env, cwd=REPO) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    first, second = (r.stdout.split() for r in runs)
    assert len(first) == 3 and first == second, (first, second)  # eager run and graph replays, per process


def test_a_panel_model_when_given(tmp_path):
    """``CONVPASS_PANEL_MODEL=path/to/resnet50.onnx``: that model at batch 16 within 1e-2 end to end."""
    path = os.environ.get("CONVPASS_PANEL_MODEL")
    if not path:
        pytest.skip("CONVPASS_PANEL_MODEL names no panel model")
    model = onnx.load(path)
    dims = [d.dim_value or BATCH for d in model.graph.input[0].type.tensor_type.shape.dim]
    name = model.graph.input[0].name
    spec = f"{name}={'x'.join(map(str, dims))}"
    out = tmp_path / "tuned.onnx"
    tuned = convpass.optimize(path, str(out), shapes=[spec], cache=str(tmp_path / "c.db"), precision="auto", max_error=1e-2, quiet=True)
    record = annotation.read_model_info(tuned).precision
    print(Path(path).name, json.dumps(record))
    assert record["within_budget"] and record["holdout"]["error"] <= 1e-2


# ------------------------------------------------------------------ fp32-strict


def _three_by_three_model(channels: int = 64, seed: int = 0) -> onnx.ModelProto:
    """input [8, C, 28, 28] -> conv3x3 + bias -> Relu -> conv3x3 + bias -> output: the shapes on
    which cuDNN offers Winograd and FFT algorithms under FMA math."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    scale = np.sqrt(2.0 / (channels * 9))
    inits = [numpy_helper.from_array((rng.standard_normal((channels, channels, 3, 3)) * scale).astype(np.float32), f"w{i}")
             for i in (1, 2)]
    inits += [numpy_helper.from_array(rng.normal(0, 0.1, channels).astype(np.float32), f"b{i}") for i in (1, 2)]
    nodes = [helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["output"], name="conv2", kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "three_by_three", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [8, channels, 28, 28])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [8, channels, 28, 28])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_fp32_strict_records_no_transform_algorithm_and_matches_float64(tmp_path):
    """Tuned on this GPU with --precision fp32-strict: every conv decided (measured), FMA math, no
    Winograd or FFT algorithm, read back as fp32-strict; the GPU executor's output within 1e-5 (max
    |y - t| / max |t|) of the float64 truth. The fp32 tuning of the same model is printed beside it
    (which algorithms the strict level gave up)."""
    from convpass.compiler.precision.float64 import float64_outputs
    from convpass.core.algo import is_transform

    model = _three_by_three_model()
    path, out, cache = tmp_path / "m.onnx", tmp_path / "strict.onnx", str(tmp_path / "c.db")
    onnx.save(model, path)
    tuned = convpass.optimize(str(path), str(out), cache=cache, precision="fp32-strict", quiet=True)
    records = inspect(tuned)
    fp32 = inspect(convpass.optimize(str(path), None, cache=cache, precision="fp32", quiet=True))
    print("fp32-strict:", [(r["node"], r["algo"], r["memory_format"], r["time_ms"]) for r in records])
    print("fp32:       ", [(r["node"], r["algo"], r["memory_format"], r["time_ms"]) for r in fp32])
    assert len(records) == 2 and all(r["source"] == "measure" for r in records)
    assert not any(is_transform(r[k]) for r in records for k in ("algo", "dgrad_algo", "wgrad_algo")), records
    assert {(r["precision"], r["math_mode"]) for r in records} == {("fp32-strict", "fma")}
    x = np.random.default_rng(7).standard_normal((8, 64, 28, 28)).astype(np.float32)
    got = convpass.Executor(str(out), device="cuda", output_kind="numpy").run(None, {"input": x})[0]
    truth = float64_outputs(model, [{"input": x}])[0][0]
    error = float(np.max(np.abs(got.astype(np.float64) - truth)) / np.max(np.abs(truth)))
    print(f"fp32-strict against float64: {error:.2e}")
    assert error <= 1e-5

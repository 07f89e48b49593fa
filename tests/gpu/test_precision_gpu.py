"""Precision per conv on a real GPU: float16 / bfloat16 conv candidates against a float64 reference,
a mixed-precision model tuned within its budget and checked end to end, the GPU evaluator against
the CPU emulation, and a tuned model's outputs the same bits in two fresh processes."""

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


@pytest.fixture(autouse=True)
def _need_gpu():
    from convpass.native import device

    if device.detect() is None:
        pytest.skip("no usable GPU / cuDNN")


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

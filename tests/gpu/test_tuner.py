"""The measuring tuner on a real GPU: every conv decided by measurement and checked, cache hit on the
second run, forced / heuristic / exhaustive modes, training directions, unsupported forced algos."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import MODELS, conv_model, random_input, run_ort  # noqa: E402

import convpass  # noqa: E402
from convpass.compiler.pipeline import optimize_model  # noqa: E402
from convpass.core import annotation  # noqa: E402
from convpass.core.model_io import load_model, to_proto  # noqa: E402
from convpass.core.options import TuneOptions  # noqa: E402


def _feeds(model: onnx.ModelProto) -> tuple[dict, list[str]]:
    feeds, shapes = {}, []
    for inp in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else 2 for d in inp.type.tensor_type.shape.dim]
        if any(not d.HasField("dim_value") for d in inp.type.tensor_type.shape.dim):
            shapes.append(f"{inp.name}={'x'.join(map(str, dims))}")
        feeds[inp.name] = random_input(dims)
    return feeds, shapes


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.onnx")), ids=lambda p: p.stem)
def test_samples_are_measured_then_cached(path, tmp_path):
    original = onnx.load(path)
    feeds, shapes = _feeds(original)
    first = load_model(path)
    report = optimize_model(first, TuneOptions(), shapes, cache=tmp_path / "c.db")
    assert report.undecided == 0 and report.failed == 0 and report.measured == report.problems
    tuned = to_proto(first)
    onnx.checker.check_model(tuned, full_check=True)
    for want, got in zip(run_ort(original, feeds), run_ort(tuned, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    records = convpass.inspect(tuned)
    assert all(r["source"] == "measure" and r["time_ms"] > 0 and r["algo"] != "auto" for r in records)
    assert all(r["memory_format"] in ("NCHW", "NHWC", "NCW", "NWC", "NCDHW", "NDHWC") for r in records)
    # second run: every decision from the cache, nothing timed, same choices
    second = load_model(path)
    again = optimize_model(second, TuneOptions(), shapes, cache=tmp_path / "c.db")
    assert again.measured == 0 and again.cached == again.problems
    # the same model, byte for byte: a decision names the strategy that took it, timed now or
    # before (so the first run's kernel side-car still matches the re-run's model)
    assert to_proto(second).SerializeToString() == tuned.SerializeToString()
    # the cache-only backend (a machine without this GPU) plans the same layouts: the transposes
    # the tuner timed are in the cache
    from convpass.native import device

    third = load_model(path)
    replay = optimize_model(third, TuneOptions(), shapes, cache=tmp_path / "c.db", device_name=str(device.detect()))
    assert replay.layout_mode is None, replay.notes
    assert [(r["algo"], r["memory_format"]) for r in convpass.inspect(to_proto(third))] == [
        (r["algo"], r["memory_format"]) for r in records
    ]


def _tune(model, tmp_path, **options):
    return convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, **options)


def test_forced_algorithm_is_honoured_and_measured(tmp_path):
    model = conv_model("Conv", (2, 16, 16, 16), (32, 16, 3, 3), pads=[1, 1, 1, 1])
    (record,) = convpass.inspect(_tune(model, tmp_path, fprop_algo="gemm", layout="nchw"))
    assert record["algo"] == "gemm" and record["source"] == "forced" and record["time_ms"] > 0


def test_forced_algorithm_unsupported_for_a_problem_is_left_auto(tmp_path, caplog):
    model = conv_model("Conv", (1, 8, 16, 16), (8, 8, 3, 3), strides=[2, 2], dilations=[2, 2])
    (record,) = convpass.inspect(_tune(model, tmp_path, fprop_algo="fft"))
    assert record["algo"] == "auto" and "left to run time" in caplog.text


@pytest.mark.parametrize("mode", ["heuristic", "exhaustive"])
def test_cudnn_modes(mode, tmp_path):
    model = conv_model("Conv", (1, 16, 14, 14), (32, 16, 3, 3), pads=[1, 1, 1, 1])
    (record,) = convpass.inspect(_tune(model, tmp_path, mode=mode))
    assert record["source"] == mode and record["algo"] != "auto" and record["time_ms"] > 0


def test_training_directions_and_tf32_off(tmp_path):
    model = conv_model("Conv", (2, 8, 12, 12), (16, 8, 3, 3), pads=[1, 1, 1, 1])
    (record,) = convpass.inspect(_tune(model, tmp_path, directions="fwd,dgrad,wgrad", tf32="off"))
    assert record["math_mode"] == "fma" and record["tf32"] is False
    assert record["dgrad_algo"] not in (None, "auto") and record["wgrad_algo"] not in (None, "auto")


def test_deterministic_and_workspace_limit(tmp_path):
    from convpass.native.cudnn import is_deterministic

    model = conv_model("Conv", (1, 16, 14, 14), (16, 16, 3, 3), pads=[1, 1, 1, 1])
    (record,) = convpass.inspect(_tune(model, tmp_path, directions="fwd,dgrad,wgrad", deterministic=True, workspace_limit=0))
    assert record["workspace_bytes"] == 0
    assert is_deterministic("dgrad", record["dgrad_algo"]) and is_deterministic("wgrad", record["wgrad_algo"])


def test_conv_transpose_and_fp16(tmp_path):
    from onnx import TensorProto

    model = conv_model("ConvTranspose", (1, 8, 8, 8), (8, 4, 4, 4), elem_type=TensorProto.FLOAT16, strides=[2, 2], pads=[1, 1, 1, 1])
    (record,) = convpass.inspect(_tune(model, tmp_path))
    assert record["problem_key"].startswith("dgrad|") and "float16" in record["problem_key"]
    assert record["algo"] in ("algo_0", "algo_1", "fft", "fft_tiling", "winograd", "winograd_nonfused")


def test_second_optimize_says_it_timed_nothing(tmp_path, capsys):
    model = conv_model("Conv", (1, 8, 8, 8), (8, 8, 3, 3), pads=[1, 1, 1, 1])
    convpass.optimize(model, cache=tmp_path / "c.db")
    convpass.optimize(model, cache=tmp_path / "c.db")
    assert "nothing was timed" in capsys.readouterr().err
    info = annotation.read_model_info(_tune(model, tmp_path))
    assert "cudnn" in info.device


@pytest.mark.parametrize("shape", [(2, 8, 5, 5), (32, 64, 14, 14), (1, 4, 3, 6, 6), (2, 16, 30), (2, 16)], ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float32-nhwc"])
def test_the_correctness_check_matches_float64_numpy(shape, dtype):
    """The tuner's check (one reduction over all axes but N and the first spatial one) against
    NumPy's float64 norms, for each storage dtype, a channels-last view and ranks 2 to 5; NaN in the
    output gives inf."""
    from convpass.tuning import harness

    rng = np.random.default_rng(0)
    ref = rng.standard_normal(shape).astype(np.float32)
    out = ref + 1e-3 * rng.standard_normal(shape).astype(np.float32)
    if dtype == "float32-nhwc" and len(shape) >= 3:
        last = (0, *range(2, len(shape)), 1)
        stored = cp.ascontiguousarray(cp.asarray(out).transpose(last))
        device_out = stored.transpose(0, len(shape) - 1, *range(1, len(shape) - 1))
        assert not device_out.flags.c_contiguous
    elif dtype == "bfloat16":
        device_out = harness.to_float32(harness.to_storage(cp.asarray(out), "bfloat16"), "bfloat16")
    else:
        device_out = cp.asarray(out).astype(dtype.split("-")[0])
    host = cp.asnumpy(device_out).astype(np.float64)
    want = np.linalg.norm(host - ref) / np.linalg.norm(ref.astype(np.float64))
    got = harness.relative_error(device_out, cp.asarray(ref))
    assert got == pytest.approx(want, rel=1e-5)
    device_out[(0,) * len(shape)] = float("nan")
    assert harness.relative_error(device_out, cp.asarray(ref)) == float("inf")

"""``optimize --precision`` end to end on the CPU: options, metrics, the TF32 emulation, input files,
the budget loop on a real small model with the CPU evaluator and a synthetic tuning cache, the
annotation (schema 7, and schema 6 still read), ``inspect``, and ONNX Runtime running the
mixed-precision tuned model."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import MODELS, REPO, conv_model, run_ort
from precision_fakes import RATES, synthetic_cache

import convpass
from convpass.cli.main import main as cli_main
from convpass.compiler.pipeline import build_options, inspect
from convpass.compiler.precision.data import InputSet, load_feeds, model_error
from convpass.compiler.precision.evaluate import CpuEvaluator, round_to_tf32
from convpass.core import annotation
from convpass.core.errors import ConvpassError, OptionError

MODEL = MODELS / "residual_cnn.onnx"
# slow made-up rates: the sample model's convs are tiny, and the float16 plan should pay for its casts
SLOW = {k: v / 1000 for k, v in RATES.items()}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("precision") / "synthetic.db"
    synthetic_cache(path, onnx.load(MODEL), rates=SLOW)
    return str(path)


def _optimize(cache, out=None, **kw):
    return convpass.optimize(str(MODEL), out, cache=cache, device_name="Synthetic", kernels=False, quiet=True, **kw)


def _reference(x):
    return ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


# ------------------------------------------------------------------ options


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"precision": "auto"}, "--precision auto needs --max-error"),
        ({"max_error": 1e-2}, "--max-error applies with --precision"),
        ({"precision": "auto", "max_error": -1.0}, "expected a positive number"),
        ({"precision": "auto", "max_error": math.inf}, "expected a positive number"),
        ({"precision": "fp32", "tf32": "on"}, "contradicts --tf32 on"),
        ({"precision": "tf32", "tf32": "off"}, "contradicts --tf32 off"),
        ({"precision": "bf16"}, "opset 22"),
        ({"precision": "fp8"}, "--precision 'fp8'"),
        ({"precision": "auto", "max_error": 1e-2, "error_metric": "l1"}, "--error-metric"),
    ],
)
def test_bad_precision_options_are_one_line_errors(kw, message):
    with pytest.raises(OptionError, match=message) as e:
        build_options(kw)
    assert "\n" not in str(e.value)


def test_precision_options_set_the_math_modes():
    assert build_options({"precision": "fp32"}).math_modes("float32") == ("fma",)
    assert build_options({"precision": "tf32"}).math_modes("float32") == ("default",)
    assert build_options({"precision": "auto", "max_error": 1e-3}).math_modes("float32") == ("default", "fma")
    assert build_options({"precision": "auto", "max_error": 1e-3, "tf32": "off"}).wide_precisions == ("fp32", "fp32-strict")
    assert build_options({"precision": "auto", "max_error": 1e-3, "tf32": "on"}).wide_precisions == ("tf32",)
    assert build_options({"precision": "fp32-strict"}).math_modes("float32") == ("fma",)
    assert build_options({"precision": "fp16"}).wide_precisions == ("tf32", "fp32")  # as before fp32-strict
    assert not build_options({"precision": "fp32-strict"}).transforms and build_options({"precision": "fp32"}).transforms
    assert build_options({}).math_modes("float32") == ("default", "fma")  # --tf32 auto, as before


def test_calibration_files_without_precision_are_refused(tmp_path):
    with pytest.raises(OptionError, match="--calibration applies with --precision"):
        convpass.optimize(str(MODEL), calibration=[str(tmp_path / "a.npz")], quiet=True, kernels=False)


def test_auto_without_measurements_says_what_it_needs():
    with pytest.raises(ConvpassError, match="needs a GPU, or --device-name"):
        convpass.optimize(str(MODEL), precision="auto", max_error=1e-2, quiet=True, kernels=False)


def test_cli_conflict_and_bf16_are_one_line_errors(tmp_path, capsys):
    out = tmp_path / "t.onnx"
    assert cli_main(["optimize", str(MODEL), "-o", str(out), "--precision", "fp32", "--tf32", "on"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("convpass: error: --precision fp32") and len(err.splitlines()) == 1
    assert cli_main(["optimize", str(MODEL), "-o", str(out), "--precision", "bf16"]) == 1
    assert "bfloat16" in capsys.readouterr().err and not out.exists()


# ------------------------------------------------------------------ metrics, emulation, inputs


def test_the_metrics_are_as_documented():
    ref = [[np.array([1.0, -4.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)]]
    out = [[np.array([1.5, -4.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)]]
    assert model_error(out, ref, "max-rel") == pytest.approx(0.5 / 4.0)
    assert model_error(out, ref, "rel-l2") == pytest.approx(0.5 / math.sqrt(21.0))
    # the worst output counts; all feeds of an output taken together
    two = [[np.array([1.0], np.float32)], [np.array([10.0], np.float32)]]
    assert model_error([[np.array([1.5], np.float32)], [np.array([10.0], np.float32)]], two, "max-rel") == pytest.approx(0.05)
    assert model_error([[np.array([np.inf, 0, 0], np.float32), ref[0][1]]], ref, "max-rel") == math.inf
    assert model_error([[np.zeros(3, np.float32)]], [[np.zeros(3, np.float32)]], "rel-l2") == 0.0


def test_tf32_rounding_keeps_ten_mantissa_bits_to_nearest_ties_away():
    ulp = 2.0 ** -10
    x = np.array([1 + ulp / 2, 1 + ulp / 4, -(1 + ulp / 2), 1 + 3 * ulp / 4, np.inf, -np.inf, 3.0], np.float32)
    got = round_to_tf32(x)
    assert got.tolist() == [1 + ulp, 1.0, -(1 + ulp), 1 + ulp, np.inf, -np.inf, 3.0]
    r = np.random.default_rng(0).standard_normal(10000).astype(np.float32)
    t = round_to_tf32(r)
    assert np.all(t.view(np.uint32) & 0x1FFF == 0)
    assert np.max(np.abs(t - r) / np.abs(r)) <= 2.0 ** -11 * (1 + 1e-6)
    assert np.isnan(round_to_tf32(np.array([np.nan], np.float32))[0])


def test_the_cpu_evaluator_emulates_half_and_tf32():
    proto = onnx.load(MODEL)
    x = np.random.default_rng(3).standard_normal((1, 3, 64, 64)).astype(np.float32)
    inputs = InputSet("calibration", ({"input": x},), "test")
    ref = [[_reference(x)]]
    evaluator = CpuEvaluator()
    exact = model_error(evaluator.outputs(proto, [], inputs), ref, "max-rel")
    convs = [n.name for n in proto.graph.node if n.op_type == "Conv"]
    tf32 = model_error(evaluator.outputs(proto, convs, inputs), ref, "max-rel")
    assert exact < 1e-5 and 1e-5 < tf32 < 1e-2, (exact, tf32)


def test_tf32_emulation_rounds_both_operands_of_the_named_conv_only():
    """The evaluator's TF32 conv is the float32 conv of the TF32-rounded input and weight (ONNX
    Runtime on the rounded tensors), to well within the difference TF32 makes; a conv not named runs
    in float32."""
    model = conv_model("Conv", (2, 16, 12, 12), (8, 16, 3, 3), pads=[1, 1, 1, 1], bias=False)
    x = np.random.default_rng(5).standard_normal((2, 16, 12, 12)).astype(np.float32)
    inputs = InputSet("calibration", ({"x": x},), "test")
    rounded = onnx.ModelProto.FromString(model.SerializeToString())
    w = onnx.numpy_helper.to_array(rounded.graph.initializer[0])
    rounded.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(round_to_tf32(w), "w"))
    want = [[run_ort(rounded, {"x": round_to_tf32(x)})[0]]]
    exact = [[run_ort(model, {"x": x})[0]]]
    assert model_error(exact, want, "max-rel") > 1e-4  # what TF32 changes
    assert model_error(CpuEvaluator().outputs(model, ["conv"], inputs), want, "max-rel") < 1e-5
    assert model_error(CpuEvaluator().outputs(model, [], inputs), exact, "max-rel") < 1e-5


def test_npz_inputs_are_checked_against_the_model(tmp_path):
    proto = onnx.load(MODEL)
    good = tmp_path / "good.npz"
    np.savez(good, input=np.zeros((1, 3, 64, 64), np.float32))
    assert load_feeds([good], proto, "calibration").feeds[0]["input"].shape == (1, 3, 64, 64)
    np.savez(tmp_path / "batch.npz", input=np.zeros((4, 3, 64, 64), np.float32))
    with pytest.raises(OptionError, match=r"has shape \(4, 3, 64, 64\); the model fixes dim 0 at 1"):
        load_feeds([tmp_path / "batch.npz"], proto, "calibration")
    np.savez(tmp_path / "other.npz", image=np.zeros((1, 3, 64, 64), np.float32))
    with pytest.raises(OptionError, match=r"--calibration .*other.npz: holds no array for the model input\(s\) input"):
        load_feeds([tmp_path / "other.npz"], proto, "calibration")
    np.savez(tmp_path / "rank.npz", input=np.zeros((3, 64, 64), np.float32))
    with pytest.raises(OptionError, match="rank 3; the model takes float32 of rank 4"):
        load_feeds([tmp_path / "rank.npz"], proto, "holdout")
    (tmp_path / "text.npz").write_text("no")
    with pytest.raises(ConvpassError, match="is not a NumPy .npy or .npz file"):
        load_feeds([tmp_path / "text.npz"], proto, "calibration")
    with pytest.raises(ConvpassError, match="no such file"):
        load_feeds([tmp_path / "missing.npz"], proto, "calibration")


# ------------------------------------------------------------------ the loop on a real model


def _record(model: onnx.ModelProto) -> dict:
    info = annotation.read_model_info(model)
    assert info is not None and info.schema_version == annotation.SCHEMA_VERSION == 7
    return dict(info.precision)


@pytest.mark.parametrize("budget", [1e-2, 1e-4])
def test_auto_returns_a_plan_within_budget_measured_end_to_end(cache, budget):
    tuned = _optimize(cache, precision="auto", max_error=budget)
    onnx.checker.check_model(tuned, full_check=True)
    record = _record(tuned)
    assert record["mode"] == "auto" and record["metric"] == "max-rel" and record["max_error"] == budget
    assert record["within_budget"] and record["calibration"]["error"] <= budget
    assert "random normal, seed 1" in record["holdout"]["inputs"] and "emulated" in record["evaluator"]
    precisions = {r["node"]: r["precision"] for r in inspect(tuned)}
    if budget == 1e-2:
        assert set(precisions.values()) == {"fp16"}  # the fastest plan fits
        assert record["casts"] == 2  # the whole body in float16: the input in, the pooled features out
    else:
        assert {"fp32-strict", "fp32", "tf32"} & set(precisions.values())
    # the error the record states is the tuned model's own, run again here by the same evaluator
    x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    inputs = InputSet("calibration", ({"input": x},), "seed 0")
    tf32 = [n for n, p in precisions.items() if p == "tf32"]
    again = model_error(CpuEvaluator().outputs(tuned, tf32, inputs), [[_reference(x)]], "max-rel")
    assert again == pytest.approx(record["calibration"]["error"], rel=1e-6)


def test_a_tighter_budget_never_runs_fewer_convs_in_full_precision(cache):
    order = {"fp16": 0, "tf32": 1, "fp32": 2, "fp32-strict": 3}
    loose = {r["node"]: order[r["precision"]] for r in inspect(_optimize(cache, precision="auto", max_error=1e-3))}
    tight = {r["node"]: order[r["precision"]] for r in inspect(_optimize(cache, precision="auto", max_error=3e-5))}
    assert sum(tight.values()) >= sum(loose.values())


def test_an_impossible_budget_writes_the_top_level_and_says_so(cache, capsys):
    tuned = convpass.optimize(str(MODEL), cache=cache, device_name="Synthetic", kernels=False, precision="auto", max_error=1e-12)
    record = _record(tuned)
    assert not record["within_budget"] and record["convs"] == {"fp32-strict": 6}
    assert "even with every conv in fp32-strict" in capsys.readouterr().err
    assert {r["precision"] for r in inspect(tuned)} == {"fp32-strict"}


def test_inspect_shows_each_layers_precision_and_error(cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # the table fits the terminal: a wide one shows every header whole
    out = tmp_path / "t.onnx"
    _optimize(cache, str(out), precision="auto", max_error=1e-4)
    records = inspect(str(out))
    assert all(r["precision"] in ("fp16", "tf32", "fp32", "fp32-strict") for r in records)
    for r in records:  # every conv below the top (fp32-strict) has its contribution; every conv its fp16 sensitivity
        assert (r["precision_error"] is not None) == (r["precision"] != "fp32-strict"), r
        assert r["precision_sensitivity"] is not None and r["precision_sensitivity"] > 0
    assert cli_main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "precision" in shown and "fp16 alone" in shown and "precision auto (max-rel <= 0.0001)" in shown
    assert cli_main(["inspect", str(out), "--json"]) == 0
    assert {"precision", "precision_error", "precision_sensitivity"} <= set(json.loads(capsys.readouterr().out)["records"][0])


def test_onnx_runtime_runs_the_mixed_precision_model_within_the_budget(cache, tmp_path):
    out = tmp_path / "t.onnx"
    tuned = _optimize(cache, str(out), precision="auto", max_error=1e-3)
    kinds = {n.op_type for n in tuned.graph.node}
    assert "Cast" in kinds and any(i.data_type == onnx.TensorProto.FLOAT16 for i in tuned.graph.initializer)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((1, 3, 64, 64)).astype(np.float32)  # the held-out seed
    got, want = session.run(None, {"input": x})[0], _reference(x)
    assert got.dtype == np.float32 and model_error([[got]], [[want]], "max-rel") <= 1e-3
    executor = convpass.Executor(str(out))
    assert model_error([[executor.run(None, {"input": x})[0]]], [[want]], "max-rel") <= 1e-3


def test_calibration_and_holdout_files_are_used_and_recorded(cache, tmp_path):
    rng = np.random.default_rng(7)
    files = []
    for i in range(3):
        files.append(tmp_path / f"set{i}.npz")
        np.savez(files[-1], input=rng.uniform(0, 1, (1, 3, 64, 64)).astype(np.float32))
    tuned = _optimize(cache, precision="auto", max_error=1e-3, error_metric="rel-l2",
                      calibration=[str(files[0]), str(files[1])], holdout=[str(files[2])])
    record = _record(tuned)
    assert record["metric"] == "rel-l2" and record["calibration"]["inputs"] == "2 file(s): set0.npz, set1.npz"
    assert record["holdout"]["inputs"] == "1 file(s): set2.npz" and record["calibration"]["error"] <= 1e-3


def test_forced_fp16_needs_no_gpu_and_no_cache(tmp_path):
    out = tmp_path / "t.onnx"
    tuned = convpass.optimize(str(MODEL), str(out), precision="fp16", quiet=True, kernels=False)
    records = inspect(tuned)
    assert {r["precision"] for r in records} == {"fp16"} and all(r["algo"] == "auto" for r in records)
    record = _record(tuned)
    assert record["mode"] == "fp16" and record["max_error"] is None and record["within_budget"]
    assert 1e-5 < record["holdout"]["error"] < 1e-2
    x = np.random.default_rng(4).standard_normal((1, 3, 64, 64)).astype(np.float32)
    assert ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0].dtype == np.float32


@pytest.mark.parametrize("forced,math_mode", [("fp32", "fma"), ("tf32", "default")])
def test_forced_wide_precisions_set_the_math_of_every_conv(cache, forced, math_mode):
    tuned = _optimize(cache, precision=forced)
    records = inspect(tuned)
    assert {(r["precision"], r["math_mode"]) for r in records} == {(forced, math_mode)}
    assert not any(n.op_type == "Cast" for n in tuned.graph.node)
    assert _record(tuned)["calibration"]["error"] < (1e-5 if forced == "fp32" else 1e-2)


def test_without_precision_nothing_changes(cache):
    tuned = _optimize(cache)
    info = annotation.read_model_info(tuned)
    assert info.precision == {} and "convpass.precision" not in {p.key for p in tuned.metadata_props}
    assert not any(n.op_type == "Cast" for n in tuned.graph.node)
    assert all(r["precision_error"] is None for r in inspect(tuned))


def test_the_cli_runs_the_budget_loop(cache, tmp_path):
    out = tmp_path / "t.onnx"
    result = subprocess.run([sys.executable, "-m", "convpass.cli.main", "optimize", str(MODEL), "-o", str(out), "--cache", cache,
                             "--device-name", "Synthetic", "--no-kernels", "--precision", "auto", "--max-error", "1e-3"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "precision auto (max-rel <= 0.001)" in result.stderr and "random-normal inputs" in result.stderr
    assert _record(onnx.load(out))["within_budget"]


def test_a_cache_without_float16_timings_plans_in_float32_and_says_so(tmp_path, capsys):
    path = tmp_path / "fp32-only.db"
    synthetic_cache(path, onnx.load(MODEL), rates=SLOW, dtypes=("float32",))
    tuned = convpass.optimize(str(MODEL), cache=str(path), device_name="Synthetic", kernels=False, precision="auto", max_error=1e-2)
    assert {r["precision"] for r in inspect(tuned)} == {"tf32"}
    assert "6 conv(s) have no float16 measurement" in capsys.readouterr().err


def test_unnamed_and_duplicate_nodes_get_unique_names():
    model = onnx.load(MODEL)
    for i, node in enumerate(model.graph.node):
        node.name = "" if i % 2 else "same"
    tuned = convpass.optimize(model, precision="fp16", kernels=False, quiet=True)
    names = [n.name for n in tuned.graph.node]
    assert len(set(names)) == len(names) and all(names)
    assert {r["precision"] for r in inspect(tuned)} == {"fp16"}


# ------------------------------------------------------------------ annotation


def test_schema_7_round_trip_of_the_precision_attributes():
    decision = annotation.ConvDecision(algo="gemm", memory_format="NHWC", math_mode="default",
                                       problem_key="fwd|n=1|c=3|k=4|in=8x8|ker=3x3|pad=1x1|str=1x1|dil=1x1|g=1|float16|nhwc|default")
    attrs = {**annotation.decision_attributes([decision]), **annotation.precision_attributes(2.5e-4, None)}
    node = onnx.helper.make_node("ConvNoBias", ["x", "w"], ["y"], name="c", domain=annotation.DOMAIN, **attrs)
    read = annotation.read_node(node, 1)
    assert read.decisions[0].precision == "fp16" and read.precision_error == pytest.approx(2.5e-4)
    assert read.precision_sensitivity is None
    assert annotation.ConvDecision(math_mode="fma", problem_key=decision.problem_key.replace("float16", "float32")).precision == "fp32"
    assert annotation.ConvDecision().precision is None
    assert annotation.precision_attributes(None, None) == {}
    assert [a.name for a in annotation.standard_attributes(node)] == []


def test_a_schema_6_model_still_reads_and_runs():
    path = REPO / "tests" / "data" / "schema6-mobile-block.tuned.onnx"
    info, nodes = annotation.read_annotations(onnx.load(path))
    assert info.schema_version == 6 and info.precision == {}
    assert len(nodes) == 6 and all(n.precision_error is None for n in nodes)
    assert {n.decisions[0].precision for n in nodes} == {"tf32"}
    assert {r["precision"] for r in inspect(str(path))} == {"tf32"}
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    want = ort.InferenceSession(str(MODELS / "mobile_block.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    got = convpass.Executor(str(path)).run(None, {"input": x})[0]
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_retuning_without_precision_drops_the_old_precision_record(cache, tmp_path):
    out = tmp_path / "t.onnx"
    _optimize(cache, str(out), precision="fp16")
    again = convpass.optimize(str(out), tmp_path / "again.onnx", kernels=False, quiet=True, retune=True)
    assert "convpass.precision" not in {p.key for p in again.metadata_props}




def test_the_record_holds_the_predicted_cost_of_the_plan_and_of_its_two_bounds(cache):
    predicted = _record(_optimize(cache, precision="auto", max_error=1e-2))["predicted_ms"]
    assert set(predicted) == {"plan", "float16", "wide"}
    # float16 is the faster rate here: the first plan is the whole region, within budget at once
    assert predicted["plan"] == pytest.approx(predicted["float16"]) and predicted["float16"] < predicted["wide"]


def test_a_plan_that_keeps_float32_says_what_the_float16_region_would_have_cost(tmp_path, capsys):
    path = tmp_path / "slow-fp16.db"
    rates = {**SLOW, ("float16", "default"): SLOW[("float32", "default")] / 2}  # float16 slower than TF32
    synthetic_cache(path, onnx.load(MODEL), rates=rates)
    tuned = convpass.optimize(str(MODEL), cache=str(path), device_name="Synthetic", kernels=False, precision="auto", max_error=1e-2)
    record = _record(tuned)
    assert {r["precision"] for r in inspect(tuned)} == {"tf32"} and record["rounds"] == 0
    predicted = record["predicted_ms"]
    assert predicted["plan"] == pytest.approx(predicted["wide"]) and predicted["float16"] > predicted["wide"]
    err = " ".join(capsys.readouterr().err.split())
    assert (f"no conv runs in float16: by the measured timings the float16 region costs {predicted['float16']:.4f} ms "
            f"(conv steps and casts) against {predicted['wide']:.4f} ms without it") in err

"""CPU tests of ``convpass bench``: report formatting, JSON schema, ratios, geometric means, targets,
roofline arithmetic, unavailable contenders and the no-GPU exit. Nothing here needs a GPU, CuPy,
PyTorch or onnxruntime-gpu.

The peer timings are the H200 anchors (shared/anchors/h200-2026-11-22/ort.jsonl and torch.jsonl,
copied here as literals: the device machine does not have shared/). The convpass figures are made
up for the arithmetic and say so.
"""

from __future__ import annotations

import argparse
import builtins
import json
import math
import sys

import pytest

from convpass.bench import cli as bench_cli
from convpass.bench import contenders, report, roofline
from convpass.problem import ProblemKey

from conftest import MODELS

# (model, batch, search, nhwc, session_s, first_run_s, median_ms) from ort.jsonl (use_tf32=1)
ORT_ANCHORS = [
    ("resnet50", 1, "EXHAUSTIVE", 0, 0.543, 0.656, 1.932),
    ("resnet50", 1, "EXHAUSTIVE", 1, 0.193, 0.163, 1.728),
    ("resnet50", 1, "HEURISTIC", 0, 0.087, 0.162, 1.86),
    ("resnet50", 1, "HEURISTIC", 1, 0.101, 0.162, 1.832),
    ("resnet50", 32, "EXHAUSTIVE", 0, 0.112, 0.182, 5.401),
    ("resnet50", 32, "EXHAUSTIVE", 1, 0.136, 0.179, 4.491),
    ("resnet50", 32, "HEURISTIC", 0, 0.122, 0.163, 5.408),
    ("resnet50", 32, "HEURISTIC", 1, 0.137, 0.182, 4.504),
    ("mobilenet_v3_large", 1, "EXHAUSTIVE", 0, 0.041, 1.008, 1.943),
    ("mobilenet_v3_large", 1, "EXHAUSTIVE", 1, 0.043, 3.658, 1.989),
    ("mobilenet_v3_large", 1, "HEURISTIC", 0, 0.043, 0.899, 1.987),
    ("mobilenet_v3_large", 1, "HEURISTIC", 1, 0.043, 2.729, 1.358),
]
# (model, batch, channels_last, first_run_s, median_ms) from torch.jsonl, cudnn_benchmark=true
TORCH_ANCHORS = [
    ("resnet50", 1, False, 0.004, 3.381),
    ("resnet50", 1, True, 0.003, 3.303),
    ("resnet50", 32, False, 0.005, 5.306),
    ("resnet50", 32, True, 0.004, 4.334),
    ("mobilenet_v3_large", 1, False, 0.007, 6.655),
    ("mobilenet_v3_large", 1, True, 0.008, 3.649),
]
# made up: convpass median and cold start per case
CONVPASS_SAMPLE = {("resnet50", 1): (1.40, 0.080), ("resnet50", 32): (4.20, 0.095), ("mobilenet_v3_large", 1): (1.30, 0.120)}

ENV = {
    "device": "NVIDIA H200", "driver": "580.159.04", "cuda_runtime": "13.0", "cuda_driver_api": "13.0", "cudnn": "9.19.0",
    "packages": {"convpass": "0.1.0", "onnx": "1.23.1", "onnxruntime-gpu": "1.31.1", "cupy": "14.2.0", "torch": "2.11.0"},
}
SETTINGS = {"runs": 30, "warmup": 5, "batches": {"resnet50": [1, 32], "mobilenet_v3_large": [1]}, "vs": ["ort", "torch"],
            "tf32": "auto", "timing": contenders.TIMING}
PEAKS = {"tf32_flops_per_s": 400e12, "fp32_flops_per_s": 60e12, "copy_bytes_per_s": 4e12}


def _times(median: float) -> list[float]:
    # 5 runs around the median (the anchors kept only medians)
    return [median * f for f in (0.98, 0.99, 1.0, 1.02, 1.05)]


def _case(model: str, batch: int) -> dict:
    cs = []
    med, cold = CONVPASS_SAMPLE[(model, batch)]
    cs.append(report.contender("convpass", "convpass", {"device": "cuda"}, cold_start_s=cold, times_ms=_times(med),
                               rel_err=1e-4, tolerance=5e-3, tf32=True,
                               tuning={"optimize_s": 3.8, "tuning_s": 3.5, "measured": 23, "cached": 0, "failed": 0,
                                       "undecided": 0, "all_cached": False}))
    for m, b, search, nhwc, sess, first, median in ORT_ANCHORS:
        if (m, b) == (model, batch):
            cs.append(report.contender(contenders.ort_name(search, nhwc), "ort",
                                       {"cudnn_conv_algo_search": search, "prefer_nhwc": nhwc, "use_tf32": 1},
                                       cold_start_s=sess + first, session_s=sess, first_run_s=first, times_ms=_times(median),
                                       rel_err=2e-4, tolerance=5e-3, tf32=True))
    for m, b, cl, first, median in TORCH_ANCHORS:
        if (m, b) == (model, batch):
            cs.append(report.contender(contenders.torch_name(cl), "torch", {"channels_last": cl, "cudnn_benchmark": True},
                                       cold_start_s=first, times_ms=_times(median), rel_err=3e-4, tolerance=5e-3, tf32=True))
    return {
        "model": model, "file": f".panel/{model}.onnx", "batch": batch, "inputs": {"input": [batch, 3, 224, 224]},
        "dtype": "float32", "reference": "onnxruntime 1.31.1 CPU", "contenders": cs, "best_peer": None, "best_ort": None,
        "best_torch": None, "ratios": {}, "roofline": None, "notes": [],
    }


def _doc() -> dict:
    cases = [_case(m, b) for m, b in CONVPASS_SAMPLE]
    cases[0]["roofline"] = roofline.conv_roofline(
        [{"node": "c1", "profile": "p0", "problem_key": KEY_3X3, "time_ms": 0.02}], PEAKS, "p0")
    return report.build_document(ENV, SETTINGS, PEAKS, cases, "2026-11-22T00:00:00+00:00")


KEY_3X3 = "fwd|n=1|c=64|k=64|in=56x56|ker=3x3|pad=1x1|str=1x1|dil=1x1|g=1|float32|nchw|default"
KEY_DW = "fwd|n=1|c=960|k=960|in=7x7|ker=5x5|pad=2x2|str=1x1|dil=1x1|g=960|float32|nhwc|fma"


# ---------------------------------------------------------------------------------------------
# statistics


def test_percentiles_match_numpy_linear_interpolation():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0, 7.0]
    for q in (0, 10, 50, 90, 100):
        assert report.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    s = report.summarize_times([2.0, 1.0, 3.0])
    assert (s["median_ms"], s["min_ms"], s["runs"]) == (2.0, 1.0, 3)
    assert s["p10_ms"] == pytest.approx(1.2) and s["p90_ms"] == pytest.approx(2.8)
    with pytest.raises(ValueError):
        report.summarize_times([])


def test_geomean():
    assert report.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert report.geomean([0.5]) == 0.5
    assert report.geomean([]) is None
    with pytest.raises(ValueError):
        report.geomean([1.0, 0.0])


def test_relative_error_and_judge():
    import numpy as np

    ref = [np.ones((2, 3), np.float32)]
    assert report.relative_error([np.ones((2, 3))], ref) == 0.0
    out = [np.ones((2, 3)) * 1.001]
    assert report.relative_error(out, ref) == pytest.approx(1e-3)
    assert report.relative_error([np.full((2, 3), np.nan)], ref) == math.inf
    assert report.relative_error([np.ones((3, 2))], ref) == math.inf
    assert report.tolerance_for(True) == 5e-3 and report.tolerance_for(False) == 1e-4
    assert report.tolerance_for(False, "float16") == 1e-2
    c = report.judge(report.contender("x", "ort", times_ms=[1.0]), 1e-3, report.tolerance_for(False))
    assert c["status"] == "wrong" and "1.00e-03 > tolerance 1e-04" in c["reason"]
    c = report.judge(report.contender("x", "ort", times_ms=[1.0]), 1e-3, report.tolerance_for(True))
    assert c["status"] == "ok"
    c = report.judge(report.contender("x", "ort", times_ms=[1.0]), math.inf, 5e-3)
    assert c["status"] == "wrong" and c["rel_err"] is None
    c = report.judge(report.contender("x", "ort", times_ms=[1.0]), None, 5e-3)
    assert c["status"] == "unchecked"


def test_time_steady_uses_clock_and_syncs_after_every_run():
    ticks = iter(range(100))
    calls: list[str] = []
    times = contenders.time_steady(lambda: calls.append("run"), lambda: calls.append("sync"), runs=3, warmup=2,
                                   clock=lambda: next(ticks) * 0.001)
    assert calls == ["run", "sync"] * 5
    assert times == pytest.approx([1.0, 1.0, 1.0])


# ---------------------------------------------------------------------------------------------
# ratios on the anchor figures


def test_ratios_against_best_peers():
    case = report.annotate_case(_case("resnet50", 1))
    assert case["best_ort"] == "ort EXHAUSTIVE nhwc"  # 1.728 ms
    assert case["best_torch"] == "torch channels_last"  # 3.303 ms
    assert case["best_peer"] == "ort EXHAUSTIVE nhwc"
    r = case["ratios"]
    assert r["vs_best_ort"] == pytest.approx(1.40 / 1.728)
    assert r["vs_best_torch"] == pytest.approx(1.40 / 3.303)
    # cold start: the faster EXHAUSTIVE configuration, session + first run = 0.193 + 0.163
    assert r["ort_exhaustive_cold"] == "ort EXHAUSTIVE nhwc"
    assert r["cold_start_speedup_vs_ort_exhaustive"] == pytest.approx((0.193 + 0.163) / 0.080)
    ours = report.find(case, "convpass")
    assert ours["ratio_to_best_peer"] == pytest.approx(1.40 / 1.728)
    assert report.find(case, "ort EXHAUSTIVE nhwc")["ratio_to_best_peer"] == pytest.approx(1.0)


def test_wrong_contender_is_shown_but_never_ranked():
    case = _case("resnet50", 1)
    best = report.find(case, "ort EXHAUSTIVE nhwc")
    report.judge(best, 0.2, 5e-3)
    report.annotate_case(case)
    assert best["status"] == "wrong" and best["ratio_to_best_peer"] is None
    assert case["best_ort"] == "ort HEURISTIC nhwc"  # 1.832 ms is the next one
    assert case["ratios"]["vs_best_ort"] == pytest.approx(1.40 / 1.832)
    # and the cold-start comparison falls back to the other EXHAUSTIVE configuration
    assert case["ratios"]["ort_exhaustive_cold"] == "ort EXHAUSTIVE nchw"
    text = report.format_case(case)
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("ort EXHAUSTIVE nhwc"))
    assert "not ranked" in line and "WRONG" in line


def test_summary_and_verdicts():
    doc = _doc()
    s = doc["summary"]
    assert s["cases"] == 3
    ort = s["steady_vs_best_ort"]
    expect = math.exp((math.log(1.40 / 1.728) + math.log(4.20 / 4.491) + math.log(1.30 / 1.358)) / 3)
    assert ort["geomean"] == pytest.approx(expect) and ort["n"] == 3
    assert ort["verdict"] == ("met" if expect <= 0.85 else "not met") == "not met"
    torch_s = s["steady_vs_best_torch"]
    assert torch_s["verdict"] == "met" and torch_s["worst_case"] == "resnet50 b32"
    assert torch_s["worst"] == pytest.approx(4.20 / 4.334)
    cold = s["cold_start_vs_ort_exhaustive"]
    # resnet50 b32: min(0.112 + 0.182, 0.136 + 0.179) / 0.095 = 3.09x < 5x
    assert cold["worst_case"] == "resnet50 b32" and cold["worst"] == pytest.approx(0.294 / 0.095)
    assert cold["verdict"] == "not met"


def test_verdict_met_and_not_measured():
    cases = [_case("resnet50", 1)]
    ours = report.find(cases[0], "convpass")
    ours["times_ms"] = _times(1.0)
    ours.update(report.summarize_times(ours["times_ms"]))
    ours["cold_start_s"] = 0.05
    s = report.build_document(ENV, SETTINGS, None, cases)["summary"]
    assert s["steady_vs_best_ort"]["verdict"] == "met"  # 1.0 / 1.728 = 0.58
    assert s["cold_start_vs_ort_exhaustive"]["verdict"] == "met"  # 0.356 / 0.05 = 7.1x
    # no peers at all: not measured, never "met"
    lone = _case("resnet50", 1)
    lone["contenders"] = lone["contenders"][:1]
    s = report.build_document(ENV, SETTINGS, None, [lone])["summary"]
    assert {v["verdict"] for k, v in s.items() if isinstance(v, dict)} == {"not measured"}


def test_wrong_convpass_fails_every_target():
    case = _case("resnet50", 1)
    ours = report.find(case, "convpass")
    ours["times_ms"] = _times(0.5)
    ours.update(report.summarize_times(ours["times_ms"]))
    report.judge(ours, 0.5, 5e-3)
    other = _case("resnet50", 32)
    s = report.build_document(ENV, SETTINGS, None, [case, other])["summary"]
    assert s["steady_vs_best_ort"]["convpass_invalid"] == ["resnet50 b1"]
    assert s["steady_vs_best_ort"]["verdict"] == "not met"
    assert s["steady_vs_best_torch"]["verdict"] == "not met"
    assert "resnet50 b1" in s["steady_vs_best_ort"]["not_measured"]


# ---------------------------------------------------------------------------------------------
# formatting


def test_case_table_and_report_text():
    doc = _doc()
    text = report.format_report(doc)
    assert "NVIDIA H200" in text and "cuDNN 9.19.0" in text and "580.159.04" in text
    case_text = report.format_case(doc["cases"][0])
    lines = case_text.splitlines()
    assert lines[0].startswith("resnet50 batch 1 (input 1x3x224x224; float32; TF32 on); reference: onnxruntime 1.31.1 CPU")
    assert "convpass optimize: 3.800 s, tuner 3.5 s (23 problems measured, 0 from the tuning cache)" in case_text
    row = next(ln for ln in lines if ln.strip().startswith("convpass ") and "optimize" not in ln)
    assert "0.080" in row and "1.400" in row and f"{1.40 / 1.728:.2f}x" in row and "ok" in row
    ort_row = next(ln for ln in lines if ln.strip().startswith("ort EXHAUSTIVE nhwc"))
    assert "0.356 (0.193+0.163)" in ort_row and "1.00x (best)" in ort_row
    assert "roofline: 1 convs" in case_text
    assert "Summary over 3 model/batch case(s)" in text
    assert "target <= 0.85x: NOT MET" in text
    assert "target <= 1.00x in every case: MET" in text
    assert "target >= 5x in every case: NOT MET" in text
    md = report.format_markdown(doc["cases"])
    rows = md.splitlines()
    assert rows[0].startswith("| model, batch |") and set(rows[1]) <= {"|", "-"}
    assert rows[1].count("|") == rows[0].count("|") == rows[2].count("|")
    assert rows[2].startswith("| resnet50, 1 | 1.400 | 1.728 (EXHAUSTIVE nhwc) | 3.303 (channels_last) |")


def test_all_cached_tuning_line():
    line = report.tuning_line({"optimize_s": 0.8, "tuning_s": 0.1, "measured": 0, "cached": 23, "failed": 0, "all_cached": True})
    assert "every decision from the tuning cache (23 problems), nothing timed" in line


# ---------------------------------------------------------------------------------------------
# JSON schema


def test_document_is_valid_and_round_trips():
    doc = _doc()
    assert report.validate_document(doc) == []
    again = json.loads(report.to_json(doc))
    assert report.validate_document(again) == []
    assert again["summary"]["steady_vs_best_ort"]["geomean"] == pytest.approx(doc["summary"]["steady_vs_best_ort"]["geomean"])
    assert again["environment"]["packages"]["onnxruntime-gpu"] == "1.31.1"
    assert len(again["cases"][0]["contenders"][0]["times_ms"]) == 5


def test_schema_catches_mistakes():
    doc = _doc()
    doc["cases"][0]["contenders"][0]["status"] = "fast"
    del doc["cases"][1]["batch"]
    doc["cases"][2]["contenders"][1]["median_ms"] = "1.2"
    doc["summary"]["steady_vs_best_ort"]["verdict"] = "almost"
    doc["environment"]["packages"]["torch"] = 2
    errors = report.validate_document(doc)
    assert any("$.cases[0].contenders[0].status" in e and "'fast'" in e for e in errors)
    assert "$.cases[1].batch: missing" in errors
    assert any(e.startswith("$.cases[2].contenders[1].median_ms: expected a number") for e in errors)
    assert any(e.startswith("$.summary.steady_vs_best_ort.verdict") for e in errors)
    assert any(e.startswith("$.environment.packages.torch") for e in errors)
    assert report.validate_document([]) == ["$: expected an object, got list"]
    # bools are not numbers, NaN is not JSON
    doc = _doc()
    doc["settings"]["runs"] = True
    assert any("$.settings.runs" in e for e in report.validate_document(doc))
    doc = _doc()
    doc["cases"][0]["contenders"][0]["median_ms"] = float("nan")
    assert any("not JSON-serializable" in e for e in report.validate_document(doc))
    assert json.loads(report.to_json(doc))["cases"][0]["contenders"][0]["median_ms"] is None


def test_contender_record_rejects_unknown_fields_and_values():
    with pytest.raises(ValueError):
        report.contender("x", "tensorrt")
    with pytest.raises(ValueError):
        report.contender("x", "ort", status="fastest")
    with pytest.raises(ValueError):
        report.contender("x", "ort", speed=3)


# ---------------------------------------------------------------------------------------------
# roofline


def test_roofline_arithmetic():
    flops, nbytes, fast = roofline.conv_cost(KEY_3X3)
    assert flops == 2 * 1 * 64 * 56 * 56 * 64 * 3 * 3 == 231_211_008
    assert nbytes == (64 * 56 * 56 + 64 * 64 * 9 + 64 * 56 * 56) * 4 == 1_753_088
    assert fast is True
    # compute-bound at 400 TFLOP/s (0.578 us) vs 4 TB/s (0.438 us)
    b, compute = roofline.conv_bound_s(flops, nbytes, PEAKS["tf32_flops_per_s"], PEAKS["copy_bytes_per_s"])
    assert compute and b == pytest.approx(flops / 400e12)
    # depthwise with TF32 off: FP32 rate; memory-bound
    dflops, dbytes, dfast = roofline.conv_cost(KEY_DW)
    assert dflops == 2 * 960 * 7 * 7 * 1 * 25 and dfast is False
    assert dbytes == (960 * 49 + 960 * 25 + 960 * 49) * 4
    records = [
        {"node": "a", "profile": "p0", "problem_key": KEY_3X3, "time_ms": 0.010},
        {"node": "b", "profile": "p0", "problem_key": KEY_DW, "time_ms": 0.005},
        {"node": "c", "profile": "p0", "problem_key": "", "time_ms": None},  # untuned: left out
        {"node": "a", "profile": "p1", "problem_key": KEY_3X3, "time_ms": 0.5},  # other profile
    ]
    r = roofline.conv_roofline(records, PEAKS, "p0")
    assert (r["convs"], r["counted"], r["compute_bound_convs"]) == (3, 2, 1)
    bound = flops / 400e12 + max(dflops / 60e12, dbytes / 4e12)
    assert r["bound_ms"] == pytest.approx(bound * 1e3)
    assert r["measured_conv_ms"] == pytest.approx(0.015)
    assert r["efficiency"] == pytest.approx(bound * 1e3 / 0.015)
    assert r["flops"] == flops + dflops and r["bytes"] == nbytes + dbytes
    # no FP32 peak: the TF32 rate is used and it says so; no peaks at all: sums without a bound
    r = roofline.conv_roofline(records, {"tf32_flops_per_s": 400e12, "copy_bytes_per_s": 4e12}, "p0")
    assert "TF32-off convs bounded by the TF32 rate" in r["note"]
    r = roofline.conv_roofline(records, None, "p0")
    assert r["bound_ms"] is None and r["efficiency"] is None and r["measured_conv_ms"] == pytest.approx(0.015)
    assert "not computed" in report.roofline_line(r)
    ProblemKey.parse(KEY_DW)  # the sample keys are real keys


# ---------------------------------------------------------------------------------------------
# unavailable contenders


def test_no_cuda_ep_reports_four_unavailable_configurations(monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    reason = contenders.ort_unavailable_reason()
    assert "no CUDAExecutionProvider" in reason and "onnxruntime-gpu" in reason
    # nothing touches a GPU on this path
    got = contenders.run_ort(None, {}, {}, None, True, "float32", 5, 1)
    assert [c["name"] for c in got] == ["ort EXHAUSTIVE nchw", "ort EXHAUSTIVE nhwc", "ort HEURISTIC nchw", "ort HEURISTIC nhwc"]
    assert {c["status"] for c in got} == {"unavailable"} and all(c["reason"] == reason for c in got)
    assert got[1]["config"]["prefer_nhwc"] == 1 and got[0]["config"]["use_tf32"] == 1


def test_onnxruntime_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import raises ImportError
    assert contenders.ort_unavailable_reason().startswith("onnxruntime is not installed")


def test_torch_missing_reports_unavailable(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)
    reason = contenders.torch_unavailable_reason()
    assert reason.startswith("torch is not installed")
    got = contenders.run_torch(tmp_path / "m.onnx", None, {}, None, True, "float32", 5, 1, {})
    assert [c["name"] for c in got] == ["torch nchw", "torch channels_last"]
    assert {c["status"] for c in got} == {"unavailable"}


def test_unavailable_peers_in_table_json_and_summary(monkeypatch):
    case = _case("resnet50", 1)
    why = "onnxruntime 1.31.1 has no CUDAExecutionProvider (providers: CPUExecutionProvider); install onnxruntime-gpu"
    case["contenders"] = [c for c in case["contenders"] if c["family"] != "ort"]
    case["contenders"] += [report.unavailable(contenders.ort_name(s, n), "ort", why) for s, n in contenders.ORT_CONFIGS]
    doc = report.build_document(ENV, SETTINGS, None, [case])
    assert report.validate_document(doc) == []
    text = report.format_report(doc)
    assert f"unavailable: {why}" in text
    assert doc["summary"]["steady_vs_best_ort"]["verdict"] == "not measured"
    assert doc["summary"]["cold_start_vs_ort_exhaustive"]["verdict"] == "not measured"
    assert doc["summary"]["steady_vs_best_torch"]["verdict"] == "met"
    assert "NOT MEASURED (not measured for resnet50 b1)" in text
    assert case["best_peer"] == "torch channels_last"


def test_panel_entry_lookup(tmp_path):
    (tmp_path / "panel.json").write_text(json.dumps({"models": [
        {"name": "resnet50", "file": "resnet50.onnx", "builder": "torchvision.models.resnet50"},
        {"name": "dcgan_generator", "file": "dcgan_generator_fp16.onnx", "dtype": "float16"},
    ]}))
    entry, why = contenders.panel_entry(tmp_path / "resnet50.onnx")
    assert entry["name"] == "resnet50" and why is None
    entry, _ = contenders.panel_entry(tmp_path / "dcgan_generator_fp16.onnx")
    assert entry["dtype"] == "float16"
    entry, why = contenders.panel_entry(tmp_path / "mine.onnx")
    assert entry is None and "not listed" in why
    entry, why = contenders.panel_entry(tmp_path / "sub" / "resnet50.onnx")
    assert entry is None and "no " in why and "--panel-json" in why
    entry, _ = contenders.panel_entry(tmp_path / "sub" / "resnet50.onnx", tmp_path / "panel.json")
    assert entry["name"] == "resnet50"


def test_export_panel_is_found():
    assert any(p.is_file() for p in contenders.export_panel_candidates())


# ---------------------------------------------------------------------------------------------
# inputs


def test_input_shapes_set_only_the_batch_axis():
    import onnx
    from onnx import TensorProto, helper

    def model(dims):
        g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    assert contenders.input_shapes(model(["batch", 3, 8, 8]), 32) == {"x": (32, 3, 8, 8)}
    assert contenders.input_shapes(model([4, 3]), 4) == {"x": (4, 3)}
    with pytest.raises(contenders.CaseSkipped):
        contenders.input_shapes(model([1, 3]), 32)
    with pytest.raises(ValueError, match="symbolic"):
        contenders.input_shapes(model(["batch", "h"]), 1)
    assert contenders.shape_spec({"x": (32, 3, 8, 8)}) == "x=32x3x8x8"
    feeds = contenders.make_feeds(model(["batch", 3]), {"x": (2, 3)})
    assert feeds["x"].shape == (2, 3) and str(feeds["x"].dtype) == "float32" and feeds["x"].any()
    real = onnx.load(MODELS / "residual_cnn.onnx", load_external_data=False)
    (name, dims, _), = contenders.model_inputs(real)
    assert contenders.input_shapes(real, dims[0] if isinstance(dims[0], int) else 2)


def test_decision_helpers():
    recs = [{"memory_format": "NHWC", "math_mode": "default", "source": "measure", "problem_key": KEY_3X3},
            {"memory_format": "NCHW", "math_mode": "fma", "source": "cache", "problem_key": KEY_DW}]
    assert contenders.decision_summary(recs)["memory_format"] == {"NHWC": 1, "NCHW": 1}
    assert contenders.uses_tf32(recs) is True
    assert contenders.uses_tf32(recs[1:]) is False
    assert contenders.uses_tf32([{"math_mode": "auto", "problem_key": ""}]) is True  # run time picks default math
    assert contenders.uses_tf32([]) is False and contenders.uses_tf32([], matmul_tf32=True) is True


# ---------------------------------------------------------------------------------------------
# the command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convpass")
    sub = parser.add_subparsers(dest="command", required=True)
    bench_cli.add_bench_parser(sub)
    return parser


def test_no_gpu_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "gpu_unavailable_reason", lambda: "CuPy is not installed (pip install 'convpass[gpu]')")
    args = _parser().parse_args(["bench", str(MODELS / "residual_cnn.onnx"), "--batch", "1,32", "--vs", "ort,torch"])
    assert args.func(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("convpass bench: no usable GPU here: CuPy is not installed")


def test_no_gpu_without_monkeypatch_when_cupy_is_absent(capsys):
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed here")
    args = _parser().parse_args(["bench", str(MODELS / "residual_cnn.onnx")])
    assert args.func(args) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_option_parsing():
    assert bench_cli.parse_batches([]) == ((1, 32), {})
    assert bench_cli.parse_batches(["1,8", "r3d_18=1,4"]) == ((1, 8), {"r3d_18": (1, 4)})
    assert bench_cli.parse_vs("ort,torch") == ("ort", "torch")
    assert bench_cli.parse_vs("none") == () and bench_cli.parse_vs("TORCH") == ("torch",)
    from convpass.errors import ConvpassError

    for bad in (["0"], ["a,b"], ["=1"]):
        with pytest.raises(ConvpassError):
            bench_cli.parse_batches(bad)
    with pytest.raises(ConvpassError):
        bench_cli.parse_vs("ort,tensorrt")
    args = _parser().parse_args(["bench", "m.onnx"])
    assert (args.runs, args.warmup, args.vs, args.json_path, args.plot, args.cache, args.panel_json) == (
        50, 10, "ort,torch", None, None, None, None)


def test_model_batches_precedence(tmp_path):
    """NAME=N,N > plain --batch > panel.json's bench_batches > 1,32."""
    (tmp_path / "panel.json").write_text(json.dumps({"models": [
        {"name": "r2plus1d_18", "file": "r2plus1d_18.onnx", "bench_batches": [1, 16]},
        {"name": "resnet50", "file": "resnet50.onnx", "bench_batches": [1, 32]},
        {"name": "broken", "file": "broken.onnx", "bench_batches": [0, "x"]},
    ]}))
    paths = [tmp_path / f"{n}.onnx" for n in ("r2plus1d_18", "resnet50", "broken", "mine")]
    assert bench_cli.model_batches(paths, []) == {
        "r2plus1d_18": (1, 16), "resnet50": (1, 32), "broken": (1, 32), "mine": (1, 32)}
    assert bench_cli.model_batches(paths, ["resnet50=4"]) == {
        "r2plus1d_18": (1, 16), "resnet50": (4,), "broken": (1, 32), "mine": (1, 32)}
    assert set(bench_cli.model_batches(paths, ["1,8", "mine=2"]).items()) == {
        ("r2plus1d_18", (1, 8)), ("resnet50", (1, 8)), ("broken", (1, 8)), ("mine", (2,))}
    elsewhere = [tmp_path / "sub" / "r2plus1d_18.onnx"]
    assert bench_cli.model_batches(elsewhere, []) == {"r2plus1d_18": (1, 32)}
    assert bench_cli.model_batches(elsewhere, [], str(tmp_path / "panel.json")) == {"r2plus1d_18": (1, 16)}


def test_every_panel_model_has_its_bench_facts():
    """What the bench reads about a panel model (batches, input) is declared for every one of them."""
    panel = contenders.load_export_panel()
    for name in panel.panel_names():
        spec = panel.PANEL[name]
        batches = panel.bench_batches(name)
        assert batches and all(type(b) is int and b >= 1 for b in batches), name
        rank = {"image": 4, "latent": 4, "video": 5, "audio": 3}[spec["input_kind"]]
        assert len(spec["shape"]) == rank and spec["shape"][0] == 1, name
        assert spec["family"] and spec["builder"], name


def test_from_json_renders_and_merges_without_gpu(tmp_path, capsys, monkeypatch):
    doc = _doc()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    first = dict(doc, cases=doc["cases"][:2])
    second = dict(doc, cases=doc["cases"][2:])
    a.write_text(report.to_json(first))
    b.write_text(report.to_json(second))
    real_import = builtins.__import__

    def no_matplotlib(name, *a_, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a_, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out_json = tmp_path / "merged.json"
    args = _parser().parse_args(["bench", "--from-json", str(a), str(b), "--json", str(out_json), "--plot", str(tmp_path / "p.png")])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert "Summary over 3 model/batch case(s)" in out
    assert "matplotlib is not installed" in err and not (tmp_path / "p.png").exists()
    merged = json.loads(out_json.read_text())
    assert report.validate_document(merged) == []
    assert merged["summary"]["steady_vs_best_ort"]["geomean"] == pytest.approx(doc["summary"]["steady_vs_best_ort"]["geomean"])


def test_from_json_refuses_other_documents(tmp_path):
    from convpass.errors import ConvpassError

    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"hello": 1}))
    args = _parser().parse_args(["bench", "--from-json", str(bad)])
    with pytest.raises(ConvpassError, match="not a convpass bench document"):
        args.func(args)


def test_plot_with_a_fake_pyplot(tmp_path):
    calls: list[str] = []

    class Ax:
        def __getattr__(self, name):
            return lambda *a, **k: calls.append(name)

    class Fig:
        def tight_layout(self):
            pass

        def savefig(self, path, dpi=None):
            calls.append("savefig")
            open(path, "wb").close()

    class Plt:
        def subplots(self, figsize=None):
            return Fig(), Ax()

        def close(self, fig):
            pass

    path = tmp_path / "chart.png"
    assert report.write_plot(_doc(), str(path), importer=Plt) == str(path)
    assert path.exists() and calls.count("bar") == 3 and "axhline" in calls


def test_bench_package_imports_no_gpu_libraries():
    import subprocess

    code = ("import sys, convpass.bench.cli, convpass.bench.contenders, convpass.bench.report, convpass.bench.roofline;"
            "bad=[m for m in ('cupy','torch','onnxruntime','matplotlib') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------------------------------------
# the whole command on this CPU machine with stand-ins for CuPy and the cuda executor: every GPU
# code path of convpass bench except the kernels themselves (what the device machine checks)


def _fake_cupy():
    import types

    import numpy as np

    class Arr(np.ndarray):
        @property
        def data(self):
            arr = self
            return types.SimpleNamespace(ptr=arr.ctypes.data, copy_from_device_async=lambda *a: None)

        def get(self):
            return np.array(self)

    m = types.ModuleType("cupy")
    m.ndarray = Arr
    m.float32 = np.float32
    m.asarray = lambda a: np.array(a).view(Arr)
    m.empty = lambda shape, dtype=np.float32: np.empty(shape, dtype).view(Arr)
    m.ones = lambda shape, dtype=np.float32: np.ones(shape, dtype).view(Arr)
    props = {"name": b"Fake GPU", "major": 9, "minor": 0, "multiProcessorCount": 132, "totalGlobalMem": 1 << 30}
    runtime = types.SimpleNamespace(deviceSynchronize=lambda: None, getDeviceCount=lambda: 1,
                                    getDeviceProperties=lambda i: props, runtimeGetVersion=lambda: 13000,
                                    driverGetVersion=lambda: 13000)
    m.cuda = types.SimpleNamespace(runtime=runtime, Device=lambda *a: types.SimpleNamespace(id=0))
    m.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    return m


def test_bench_end_to_end_with_stand_ins(monkeypatch, tmp_path, capsys):
    import convpass.runtime.executor as executor_mod

    pytest.importorskip("onnxruntime")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setitem(sys.modules, "torch", None)  # torch missing: said so, the rest runs
    monkeypatch.setattr(bench_cli, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(contenders, "warm_gpu", lambda seconds=0.05: None)
    monkeypatch.setattr(roofline, "measure_peaks", lambda: dict(PEAKS))
    real = executor_mod.Executor

    class CpuExecutor(real):  # the NumPy executor stands in for the cuda one
        def __init__(self, model, device="cpu", **kw):
            assert device == "cuda" and kw.get("output_kind") == "device"
            super().__init__(model, device="cpu", **kw)

    monkeypatch.setattr(executor_mod, "Executor", CpuExecutor)
    out_json = tmp_path / "bench.json"
    args = _parser().parse_args([
        "bench", str(MODELS / "mobile_block.onnx"), str(MODELS / "residual_cnn.onnx"), "--batch", "1,2",
        "--runs", "3", "--warmup", "1", "--cache", str(tmp_path / "t.db"), "--json", str(out_json),
    ])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out_json.read_text())
    assert report.validate_document(doc) == [], report.validate_document(doc)
    assert doc["environment"]["device"] == "Fake GPU" and doc["environment"]["cuda_runtime"] == "13.0"
    labels = [report.case_label(c) for c in doc["cases"]]
    assert labels == ["mobile_block b1", "mobile_block b2", "residual_cnn b1"]
    assert any("residual_cnn b2 skipped: input 'input' has a fixed batch of 1" in n for n in doc["notes"])
    for case in doc["cases"]:
        ours = report.find(case, "convpass")
        assert ours["status"] == "ok", ours
        assert ours["runs"] == 3 and len(ours["times_ms"]) == 3 and ours["cold_start_s"] > 0
        assert ours["tuning"]["measured"] is None  # no GPU tuner here: decisions left to run time
        assert case["reference"].startswith("onnxruntime") and case["roofline"]["counted"] == 0
        by_family = {c["family"]: c for c in case["contenders"]}
        # CPU-only onnxruntime: reported as unavailable; torch: not installed
        assert {c["status"] for c in case["contenders"] if c["family"] == "ort"} == {"unavailable"}
        assert "CUDAExecutionProvider" in by_family["ort"]["reason"]
        assert by_family["torch"]["status"] == "unavailable" and "torch is not installed" in by_family["torch"]["reason"]
    assert doc["summary"]["steady_vs_best_ort"]["verdict"] == "not measured"
    assert "Summary over 3 model/batch case(s)" in out and "unavailable: onnxruntime" in out
    assert "[bench] mobile_block b1: convpass optimize" in err


def test_bench_json_keeps_finished_cases_when_a_later_one_is_interrupted(monkeypatch, tmp_path):
    import convpass.runtime.executor as executor_mod

    pytest.importorskip("onnxruntime")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(bench_cli, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(contenders, "warm_gpu", lambda seconds=0.05: None)
    real = executor_mod.Executor

    class CpuExecutor(real):
        def __init__(self, model, device="cpu", **kw):
            super().__init__(model, device="cpu", **kw)

    monkeypatch.setattr(executor_mod, "Executor", CpuExecutor)
    real_case = contenders.bench_case
    calls = []

    def interrupted_second(*a, **kw):
        calls.append(a[1])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_case(*a, **kw)

    monkeypatch.setattr(contenders, "bench_case", interrupted_second)
    out_json = tmp_path / "bench.json"
    args = _parser().parse_args(["bench", str(MODELS / "mobile_block.onnx"), "--batch", "1,2", "--vs", "none", "--no-roofline",
                                 "--runs", "2", "--warmup", "0", "--cache", str(tmp_path / "t.db"), "--json", str(out_json)])
    with pytest.raises(KeyboardInterrupt):
        args.func(args)
    doc = json.loads(out_json.read_text())
    assert report.validate_document(doc) == []
    assert [report.case_label(c) for c in doc["cases"]] == ["mobile_block b1"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_bench_reports_ort_cuda_ep_that_does_not_load(monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    import numpy as np

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = contenders.run_ort(MODELS / "residual_cnn.onnx", {"input": x}, {"input": sys.modules["cupy"].asarray(x)},
                                 None, True, "float32", 2, 0)
    assert len(got) == 4
    for c in got:
        assert c["status"] in ("unavailable", "failed"), c
        assert c["median_ms"] is None


def test_module_entry_point(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench_cli, "gpu_unavailable_reason", lambda: "no CUDA GPU is visible")
    assert bench_cli.main([str(MODELS / "residual_cnn.onnx")]) == 2
    assert capsys.readouterr().err == "convpass bench: no usable GPU here: no CUDA GPU is visible; nothing was benchmarked\n"
    assert bench_cli.main(["--from-json", str(tmp_path / "missing.json")]) == 1
    assert "convpass: error: --from-json" in capsys.readouterr().err

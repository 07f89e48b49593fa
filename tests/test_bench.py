"""CPU tests of ``convpass bench``: report formatting, JSON schema, ratios, geometric means, targets
(per batch group, worst case, CUDA graph capture, op profile), the op-profile classification and
aggregation, roofline arithmetic, unavailable contenders, re-rendering recorded documents and the
no-GPU exit. Nothing here needs a GPU, CuPy, PyTorch or onnxruntime-gpu.

The peer timings are the H200 anchors (shared/anchors/h200-2026-11-22/ort.jsonl and torch.jsonl,
copied here as literals: the device machine does not have shared/). The convpass figures are made
up for the arithmetic and say so. ``data/bench-h200-2026-11-22-panel.trimmed.json`` is the recorded
``convpass.bench/1`` run of benchmarks/results, trimmed (it says how in its notes).
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
from conftest import MODELS, REPO, benchmark_script

from convpass.bench import (
    contenders,
    convpass_contender,
    document,
    measure,
    opprofile,
    ort_contender,
    peers,
    plot,
    ranking,
    records,
    render,
    render_summary,
    roofline,
    schema,
    stats,
    targets,
    torch_contender,
)
from convpass.cli import bench as bench_cli
from convpass.core import profiles
from convpass.core.problem import ProblemKey
from convpass.kernels.plan import GraphStatus

RECORDED_V1 = REPO / "tests" / "data" / "bench-h200-2026-11-22-panel.trimmed.json"

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
            "tf32": "auto", "timing": measure.TIMING}
PEAKS = {"tf32_flops_per_s": 400e12, "fp32_flops_per_s": 60e12, "copy_bytes_per_s": 4e12}


def _t(summary: dict, name: str) -> dict:
    """A target's verdict record in a summary, by name."""
    return next(t for t in summary["targets"] if t["name"] == name)


def _g(summary: dict, name: str, group: str) -> dict:
    """One batch group's record of a per-batch-group target."""
    return next(g for g in _t(summary, name)["groups"] if g["group"] == group)


def _times(median: float) -> list[float]:
    # 5 runs around the median (the anchors kept only medians)
    return [median * f for f in (0.98, 0.99, 1.0, 1.02, 1.05)]


def _case(model: str, batch: int) -> dict:
    cs = []
    med, cold = CONVPASS_SAMPLE[(model, batch)]
    cs.append(records.contender("convpass", "convpass", {"device": "cuda"}, cold_start_s=cold, times_ms=_times(med),
                               rel_err=1e-4, tolerance=5e-3, tf32=True,
                               cuda_graph=records.graph_status_record(GraphStatus(True, "212 launch(es) in one CUDA graph")),
                               tuning={"optimize_s": 3.8, "tuning_s": 3.5, "measured": 23, "cached": 0, "failed": 0,
                                       "undecided": 0, "all_cached": False}))
    for m, b, search, nhwc, sess, first, median in ORT_ANCHORS:
        if (m, b) == (model, batch):
            cs.append(records.contender(peers.ort_name(search, nhwc), "ort",
                                       {"cudnn_conv_algo_search": search, "prefer_nhwc": nhwc, "use_tf32": 1},
                                       cold_start_s=sess + first, session_s=sess, first_run_s=first, times_ms=_times(median),
                                       rel_err=2e-4, tolerance=5e-3, tf32=True))
    for m, b, cl, first, median in TORCH_ANCHORS:
        if (m, b) == (model, batch):
            cs.append(records.contender(peers.torch_name(cl), "torch", {"channels_last": cl, "cudnn_benchmark": True},
                                       cold_start_s=first, times_ms=_times(median), rel_err=3e-4, tolerance=5e-3, tf32=True))
    return {
        "model": model, "file": f".panel/{model}.onnx", "batch": batch, "inputs": {"input": [batch, 3, 224, 224]},
        "dtype": "float32", "reference": "onnxruntime 1.31.1 CPU", "contenders": cs, "best_peer": None, "best_ort": None,
        "best_torch": None, "ratios": {}, "roofline": None, "op_profile": None, "notes": [],
    }


def _doc() -> dict:
    cases = [_case(m, b) for m, b in CONVPASS_SAMPLE]
    cases[0]["roofline"] = roofline.conv_roofline(
        [{"node": "c1", "profile": "p0", "problem_key": KEY_3X3, "time_ms": 0.02}], PEAKS, "p0")
    return document.build_document(ENV, SETTINGS, PEAKS, cases, "2026-11-22T00:00:00+00:00")


KEY_3X3 = "fwd|n=1|c=64|k=64|in=56x56|ker=3x3|pad=1x1|str=1x1|dil=1x1|g=1|float32|nchw|default"
KEY_DW = "fwd|n=1|c=960|k=960|in=7x7|ker=5x5|pad=2x2|str=1x1|dil=1x1|g=960|float32|nhwc|fma"


# ---------------------------------------------------------------------------------------------
# statistics


def test_percentiles_match_numpy_linear_interpolation():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0, 7.0]
    for q in (0, 10, 50, 90, 100):
        assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    s = stats.summarize_times([2.0, 1.0, 3.0])
    assert (s["median_ms"], s["min_ms"], s["runs"]) == (2.0, 1.0, 3)
    assert s["p10_ms"] == pytest.approx(1.2) and s["p90_ms"] == pytest.approx(2.8)
    with pytest.raises(ValueError):
        stats.summarize_times([])


def test_geomean():
    assert stats.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert stats.geomean([0.5]) == 0.5
    assert stats.geomean([]) is None
    with pytest.raises(ValueError):
        stats.geomean([1.0, 0.0])


def test_relative_error_and_judge():
    import numpy as np

    ref = [np.ones((2, 3), np.float32)]
    assert stats.relative_error([np.ones((2, 3))], ref) == 0.0
    out = [np.ones((2, 3)) * 1.001]
    assert stats.relative_error(out, ref) == pytest.approx(1e-3)
    assert stats.relative_error([np.full((2, 3), np.nan)], ref) == math.inf
    assert stats.relative_error([np.ones((3, 2))], ref) == math.inf
    assert stats.tolerance_for(True) == 5e-3 and stats.tolerance_for(False) == 1e-4
    assert stats.tolerance_for(False, "float16") == 1e-2
    c = records.judge(records.contender("x", "ort", times_ms=[1.0]), 1e-3, stats.tolerance_for(False))
    assert c["status"] == "wrong" and "1.00e-03 > tolerance 1e-04" in c["reason"]
    c = records.judge(records.contender("x", "ort", times_ms=[1.0]), 1e-3, stats.tolerance_for(True))
    assert c["status"] == "ok"
    c = records.judge(records.contender("x", "ort", times_ms=[1.0]), math.inf, 5e-3)
    assert c["status"] == "wrong" and c["rel_err"] is None
    c = records.judge(records.contender("x", "ort", times_ms=[1.0]), None, 5e-3)
    assert c["status"] == "unchecked"


def test_time_steady_uses_clock_and_syncs_after_every_run():
    ticks = iter(range(100))
    calls: list[str] = []
    times = measure.time_steady(lambda: calls.append("run"), lambda: calls.append("sync"), runs=3, warmup=2,
                                   clock=lambda: next(ticks) * 0.001)
    assert calls == ["run", "sync"] * 5
    assert times == pytest.approx([1.0, 1.0, 1.0])


# ---------------------------------------------------------------------------------------------
# ratios on the anchor figures


def test_ratios_against_best_peers():
    case = ranking.annotate_case(_case("resnet50", 1))
    assert case["best"]["ort"] == "ort EXHAUSTIVE nhwc"  # 1.728 ms
    assert case["best"]["torch"] == "torch channels_last"  # 3.303 ms
    assert case["best"]["all"] == "ort EXHAUSTIVE nhwc"
    r = case["ratios"]
    assert r["vs_ort"] == pytest.approx(1.40 / 1.728)
    assert r["vs_torch"] == pytest.approx(1.40 / 3.303)
    # cold start: the faster EXHAUSTIVE configuration, session + first run = 0.193 + 0.163
    assert r["ort_exhaustive_cold"] == "ort EXHAUSTIVE nhwc"
    assert r["cold_start_speedup_vs_ort_exhaustive"] == pytest.approx((0.193 + 0.163) / 0.080)
    ours = records.find(case, "convpass")
    assert ours["ratio_to_best_peer"] == pytest.approx(1.40 / 1.728)
    assert records.find(case, "ort EXHAUSTIVE nhwc")["ratio_to_best_peer"] == pytest.approx(1.0)


def test_wrong_contender_is_shown_but_never_ranked():
    case = _case("resnet50", 1)
    best = records.find(case, "ort EXHAUSTIVE nhwc")
    records.judge(best, 0.2, 5e-3)
    ranking.annotate_case(case)
    assert best["status"] == "wrong" and best["ratio_to_best_peer"] is None
    assert case["best"]["ort"] == "ort HEURISTIC nhwc"  # 1.832 ms is the next one
    assert case["ratios"]["vs_ort"] == pytest.approx(1.40 / 1.832)
    # and the cold-start comparison falls back to the other EXHAUSTIVE configuration
    assert case["ratios"]["ort_exhaustive_cold"] == "ort EXHAUSTIVE nchw"
    text = render.format_case(case)
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("ort EXHAUSTIVE nhwc"))
    assert "not ranked" in line and "WRONG" in line


def test_summary_and_verdicts():
    doc = _doc()
    s = doc["summary"]
    assert s["cases"] == 3
    b1 = _g(s, "steady_vs_ort_per_batch_group", "batch 1")  # resnet50 b1 and mobilenet_v3_large b1
    expect = math.exp((math.log(1.40 / 1.728) + math.log(1.30 / 1.358)) / 2)
    assert b1["geomean"] == pytest.approx(expect) and b1["n"] == 2 and b1["batches"] == [1]
    assert b1["verdict"] == ("met" if expect <= 0.80 else "not met") == "not met"
    large = _g(s, "steady_vs_ort_per_batch_group", "batch > 1")
    assert large["per_case"] == {"resnet50 b32": pytest.approx(4.20 / 4.491)} and large["batches"] == [32]
    assert large["verdict"] == "not met"
    worst = _t(s, "steady_vs_ort_every_case")
    assert worst["worst_case"] == "mobilenet_v3_large b1" and worst["worst"] == pytest.approx(1.30 / 1.358)
    assert worst["failing"] == [] and worst["verdict"] == "met"  # 0.96 <= 1.05
    pooled = math.exp((math.log(1.40 / 1.728) + math.log(4.20 / 4.491) + math.log(1.30 / 1.358)) / 3)
    assert worst["geomean"] == pytest.approx(pooled)  # every case pooled, shown as information
    torch_s = _t(s, "steady_vs_torch_eager_every_case")
    assert torch_s["verdict"] == "met" and torch_s["worst_case"] == "resnet50 b32"
    assert torch_s["worst"] == pytest.approx(4.20 / 4.334)
    assert _t(s, "one_cuda_graph")["verdict"] == "met" and len(_t(s, "one_cuda_graph")["captured"]) == 3
    assert _t(s, "op_profile_reported")["verdict"] == "not measured"  # no --profile-ops
    cold = _t(s, "cold_start_vs_ort_exhaustive")
    # resnet50 b32: min(0.112 + 0.182, 0.136 + 0.179) / 0.095 = 3.09x < 5x
    assert cold["worst_case"] == "resnet50 b32" and cold["worst"] == pytest.approx(0.294 / 0.095)
    # mobilenet_v3_large b1: min(0.041 + 1.008, 0.043 + 3.658) / 0.120 = 8.7x
    assert cold["verdict"] == "not met" and cold["failing"] == ["resnet50 b1", "resnet50 b32"]
    # every target of the packaged file is judged, in its order, named by what it judges
    assert [t["name"] for t in s["targets"]] == [t["name"] for t in targets.load()]
    assert all("issue" not in t and "issue" not in t["name"] for t in s["targets"])
    # no torch.compile or CUDA-graph peer ran: their targets are not measured, never met
    assert _t(s, "steady_vs_torch_compile_every_case")["verdict"] == "not measured"
    assert s["rankings"]["ort-graph"]["n"] == 0 and s["rankings"]["ort"]["n"] == 3


def test_verdict_met_and_not_measured():
    cases = [_case("resnet50", 1)]
    ours = records.find(cases[0], "convpass")
    ours["times_ms"] = _times(1.0)
    ours.update(stats.summarize_times(ours["times_ms"]))
    ours["cold_start_s"] = 0.05
    s = document.build_document(ENV, SETTINGS, None, cases)["summary"]
    assert _g(s, "steady_vs_ort_per_batch_group", "batch 1")["verdict"] == "met"  # 1.0 / 1.728 = 0.58
    assert _g(s, "steady_vs_ort_per_batch_group", "batch > 1")["verdict"] == "not measured"  # no batch > 1 case
    assert _g(s, "steady_vs_ort_per_batch_group", "batch > 1")["n"] == 0 and _g(s, "steady_vs_ort_per_batch_group", "batch > 1")["batches"] == []
    assert _t(s, "cold_start_vs_ort_exhaustive")["verdict"] == "met"  # 0.356 / 0.05 = 7.1x
    # no peers at all: not measured, never "met"
    lone = _case("resnet50", 1)
    lone["contenders"] = lone["contenders"][:1]
    records.find(lone, "convpass")["cuda_graph"] = None
    s = document.build_document(ENV, SETTINGS, None, [lone])["summary"]
    assert {t["verdict"] for t in s["targets"]} == {"not measured"}
    assert {r["n"] for r in s["rankings"].values()} == {0}


def test_wrong_convpass_fails_every_target():
    case = _case("resnet50", 1)
    ours = records.find(case, "convpass")
    ours["times_ms"] = _times(0.5)
    ours.update(stats.summarize_times(ours["times_ms"]))
    records.judge(ours, 0.5, 5e-3)
    other = _case("resnet50", 32)
    s = document.build_document(ENV, SETTINGS, None, [case, other])["summary"]
    assert _g(s, "steady_vs_ort_per_batch_group", "batch 1")["convpass_invalid"] == ["resnet50 b1"]
    assert _g(s, "steady_vs_ort_per_batch_group", "batch 1")["verdict"] == "not met"
    assert "resnet50 b1" in _g(s, "steady_vs_ort_per_batch_group", "batch 1")["not_measured"]
    assert _g(s, "steady_vs_ort_per_batch_group", "batch > 1")["convpass_invalid"] == []  # the other group is judged on its own
    for key in ("steady_vs_ort_every_case", "steady_vs_torch_eager_every_case", "one_cuda_graph"):
        assert _t(s, key)["verdict"] == "not met", key
    assert "resnet50 b1" in s["rankings"]["all"]["not_measured"]


# ---------------------------------------------------------------------------------------------
# targets: per batch group, worst case, CUDA graph capture


def _ratio_case(model: str, batch: int, ratio: float, graph: GraphStatus | None = GraphStatus(True, "9 launch(es) in one CUDA graph")) -> dict:  # noqa: B008  (a frozen value)
    """A case where convpass runs at ``ratio`` x the best ORT configuration (10 ms), 2x faster than PyTorch."""
    cs = [records.contender("convpass", "convpass", times_ms=[10.0 * ratio], rel_err=0.0, tolerance=5e-3,
                           cold_start_s=0.1, cuda_graph=records.graph_status_record(graph) if graph else None),
          records.contender("ort EXHAUSTIVE nhwc", "ort", {"cudnn_conv_algo_search": "EXHAUSTIVE"}, times_ms=[10.0],
                           cold_start_s=1.0, rel_err=0.0, tolerance=5e-3),
          records.contender("torch nchw", "torch", times_ms=[20.0 * ratio], rel_err=0.0, tolerance=5e-3)]
    return {"model": model, "file": f"{model}.onnx", "batch": batch, "inputs": {"x": [batch, 3, 8, 8]}, "dtype": "float32",
            "reference": "ref", "contenders": cs, "best_peer": None, "best_ort": None, "best_torch": None, "ratios": {},
            "roofline": None, "op_profile": None, "notes": []}


def test_targets_are_judged_per_batch_group():
    # batch 1: 0.5, 0.8 -> 0.632; large batches (32, 16 for video, 8 for audio): 0.9, 1.0, 0.8 -> 0.896
    cases = [_ratio_case("a", 1, 0.5), _ratio_case("a", 32, 0.9), _ratio_case("video", 1, 0.8), _ratio_case("video", 16, 1.0),
             _ratio_case("audio", 8, 0.8)]
    doc = document.build_document(ENV, SETTINGS, None, cases)
    assert schema.validate_document(doc) == []
    s = doc["summary"]
    b1, large = _g(s, "steady_vs_ort_per_batch_group", "batch 1"), _g(s, "steady_vs_ort_per_batch_group", "batch > 1")
    assert (b1["group"], b1["batches"], b1["n"]) == ("batch 1", [1], 2)
    assert b1["geomean"] == pytest.approx(math.sqrt(0.5 * 0.8)) and b1["verdict"] == "met"
    assert (large["group"], large["batches"], large["n"]) == ("batch > 1", [8, 16, 32], 3)
    assert large["geomean"] == pytest.approx((0.9 * 1.0 * 0.8) ** (1 / 3)) and large["verdict"] == "not met"
    assert set(large["per_case"]) == {"a b32", "video b16", "audio b8"}
    text = render_summary.format_summary(s)
    assert "      batch 1 (2 case(s)): geometric mean 0.63x; target <= 0.80x: MET" in text.splitlines()
    assert "      batch > 1 (batches 8, 16, 32; 3 case(s)): geometric mean 0.90x; target <= 0.80x: NOT MET" in text.splitlines()
    assert "    steady_vs_ort_per_batch_group: steady state: convpass against the best ONNX Runtime configuration" in text
    # pooled over every case the geomean would be 0.79x and pass: the targets judge the batch groups apart
    assert _t(s, "steady_vs_ort_every_case")["geomean"] == pytest.approx((0.5 * 0.9 * 0.8 * 1.0 * 0.8) ** 0.2)
    assert records.batch_group(1) == "batch 1" and records.batch_group(2) == records.batch_group(32) == "batch > 1"


def test_worst_case_target_names_the_case_and_lists_every_failing_one():
    cases = [_ratio_case("a", 1, 0.5), _ratio_case("b", 1, 1.05), _ratio_case("c", 32, 1.3), _ratio_case("d", 32, 1.2)]
    s = document.summarize([ranking.annotate_case(c) for c in cases])
    w = _t(s, "steady_vs_ort_every_case")
    assert (w["worst_case"], w["worst"]) == ("c b32", pytest.approx(1.3))
    assert w["failing"] == ["c b32", "d b32"] and w["verdict"] == "not met"  # 1.05 itself is within the target
    assert _t(s, "steady_vs_torch_eager_every_case")["verdict"] == "met"  # convpass is 2x faster than PyTorch everywhere
    text = render_summary.format_summary(s)
    assert "      worst 1.30x (c b32); above 1.05x: c b32 1.30x, d b32 1.20x;" in text
    assert "target <= 1.05x in every case: NOT MET" in text
    # the rankings: convpass against every peer group, per batch group and worst case
    assert "    every peer: batch 1 0.72x (2 case(s)); batch > 1 1.25x (2 case(s)); worst 1.30x (c b32)" in text
    assert "    torch.compile: not measured" in text
    s = document.summarize([ranking.annotate_case(c) for c in cases[:2]])
    assert _t(s, "steady_vs_ort_every_case")["verdict"] == "met" and _t(s, "steady_vs_ort_every_case")["failing"] == []


BREAK = ("node 'nz' (NonZero) needs the host while running (1 device -> host copies): 2 CUDA graph(s) with 1 launch(es) "
         "run eagerly between them")


def test_cuda_graph_status_is_shown_marked_and_judged():
    cases = [_ratio_case("a", 1, 0.5), _ratio_case("b", 1, 0.6, GraphStatus(False, BREAK, "nz")),
             _ratio_case("c", 32, 0.7, None), _ratio_case("d", 32, 0.7, GraphStatus(None, "cuda_graph=False"))]
    del records.find(cases[2], "convpass")["cuda_graph"]  # a convpass.bench/1 contender: never recorded
    doc = document.build_document(ENV, SETTINGS, None, cases)
    assert schema.validate_document(doc) == []
    texts = [render.format_case(c) for c in doc["cases"]]
    assert "  CUDA graph: yes (9 launch(es) in one CUDA graph)" in texts[0].splitlines()
    assert f"  CUDA graph: no ({BREAK})" in texts[1].splitlines()
    assert "  CUDA graph: ? (not recorded in this document)" in texts[2].splitlines()
    assert "  CUDA graph: n/a (cuda_graph=False)" in texts[3].splitlines()
    assert [render.graph_mark(c) for c in cases] == ["yes", "no", "?", "n/a"]
    g = _t(doc["summary"], "one_cuda_graph")
    assert g["captured"] == ["a b1"] and g["failing"] == {"b b1": BREAK}
    assert g["not_measured"] == ["c b32", "d b32"] and g["verdict"] == "not met"
    summary = render_summary.format_summary(doc["summary"])
    assert "    one_cuda_graph: every case runs as one captured CUDA graph" in summary.splitlines()
    assert (f"      1 of 4 case(s) captured; not captured: b b1: {BREAK}; "
            "target: every case: NOT MET (not measured for c b32, d b32)") in summary.splitlines()
    md = render.format_markdown(doc["cases"]).splitlines()
    col = md[0].split("|").index(" CUDA graph ")
    assert [row.split("|")[col].strip() for row in md[2:6]] == ["yes", "no†1", "?", "n/a"]
    assert md[6] == "" and md[7] == f"- †1 b, 1: not one CUDA graph: {BREAK}"
    # a convpass that failed before its steady state: "?", and the capture target is not met
    failed = _ratio_case("e", 1, 0.5, None)
    ours = records.find(failed, "convpass")
    ours.update(status="failed", reason="convpass executor: out of memory", median_ms=None, times_ms=[])
    s = document.summarize([ranking.annotate_case(failed), ranking.annotate_case(_ratio_case("a", 1, 0.5))])
    assert _t(s, "one_cuda_graph")["verdict"] == "not met" and _t(s, "one_cuda_graph")["convpass_invalid"] == ["e b1"]
    assert render.graph_text(failed) == "CUDA graph: ? (convpass did not reach its steady-state runs)"


def test_graph_status_record_keeps_the_executors_words():
    rec = records.graph_status_record(GraphStatus(False, BREAK, "nz"))
    assert rec == {"captured": False, "reason": BREAK, "node": "nz", "text": f"CUDA graph: no ({BREAK})"}
    assert records.graph_status_record(GraphStatus(None))["text"] == "CUDA graph: n/a"


# ---------------------------------------------------------------------------------------------
# op profile: classification, aggregation, measurement with a fake clock


def test_op_family_of_every_launch_label_the_runtime_emits():
    launches = {
        ("Conv", "Conv"): "conv", ("Conv+relu", "Conv"): "conv", ("Conv+residual+relu", "Conv"): "conv",
        ("ConvTranspose", "ConvTranspose"): "conv",
        ("fused Sigmoid+Mul", "Mul"): "elementwise", ("fused Div+Erf+Add+Mul+Mul", "Mul"): "elementwise",
        # a fused group by its head (the runtime records the group's last node as op_type)
        ("fused BatchNormalization+Relu", "Relu"): "normalization", ("fused Add+Relu", "Relu"): "elementwise",
        ("MaxPool (kernel)", "MaxPool"): "pooling", ("AveragePool (cuDNN)", "AveragePool"): "pooling",
        ("GlobalAveragePool (kernel)", "GlobalAveragePool"): "pooling", ("ReduceMean", "ReduceMean"): "pooling",
        ("LayerNormalization kernel (warp)", "LayerNormalization"): "normalization",
        ("BatchNormalization", "BatchNormalization"): "normalization",
        # the fused GroupNorm / InstanceNorm unit (its statistics and apply passes with the chain)
        ("FusedNorm+Mul+Add+Sigmoid+Mul", "FusedNorm"): "normalization", ("FusedNorm+Mul+Add", "FusedNorm"): "normalization",
        ("Softmax kernel", "Softmax"): "softmax", ("Resize kernel", "Resize"): "resize",
        ("Concat", "Concat"): "concat_copy", ("Concat (in place)", "Concat"): "concat_copy",
        ("Transpose", "Transpose"): "concat_copy", ("Reshape", "Reshape"): "concat_copy",
        ("MatMul", "MatMul"): "matmul", ("Gemm", "Gemm"): "matmul", ("Add", "Add"): "elementwise",
        ("ReduceSum", "ReduceSum"): "reduce", ("NonZero", "NonZero"): "other", ("", ""): "other",
    }
    for (label, op_type), family in launches.items():
        assert opprofile.op_family(label, op_type) == family, (label, op_type)
    # one row per op type; every family of the table is a family of the record
    assert sum(len(ops) for ops in opprofile.FAMILY_OPS.values()) == len(opprofile.OP_FAMILY)
    assert opprofile.FAMILIES[-1] == "other" and set(opprofile.FAMILY_OPS) < set(opprofile.FAMILIES)


def _samples(runs: int) -> list[tuple[str, str, float]]:
    one = [("Conv+relu", "Conv", 0.30), ("Conv+relu", "Conv", 0.20), ("fused Sigmoid+Mul", "Mul", 0.05),
           ("fused BatchNormalization+Relu", "Relu", 0.10), ("Concat (in place)", "Concat", 0.02),
           ("fused Sigmoid+Mul", "Mul", 0.07), ("GlobalAveragePool (kernel)", "GlobalAveragePool", 0.01)]
    return one * runs


def test_aggregate_per_run_by_family_and_label():
    p = opprofile.aggregate(_samples(3), 3, host_gaps_excluded=True, method="m")
    assert (p["status"], p["runs"], p["launches"], p["method"], p["host_gaps_excluded"]) == ("ok", 3, 7, "m", True)
    assert p["total_ms"] == pytest.approx(0.75) and p["conv_ms"] == pytest.approx(0.50)
    assert p["non_conv_ms"] == pytest.approx(0.25) and p["non_conv_pct"] == pytest.approx(100 / 3)
    assert (p["top_non_conv_family"], p["top_non_conv_ms"]) == ("elementwise", pytest.approx(0.12))
    assert list(p["families"]) == ["conv", "elementwise", "normalization", "concat_copy", "pooling"]
    assert p["families"]["conv"] == {"ms": pytest.approx(0.5), "launches": 2}
    assert [r["label"] for r in p["labels"][:2]] == ["Conv+relu", "fused Sigmoid+Mul"]
    assert p["labels"][1] == {"label": "fused Sigmoid+Mul", "op_type": "Mul", "family": "elementwise",
                              "ms": pytest.approx(0.12), "launches": 2}
    line = opprofile.summary_line(p)
    assert line == ("GPU time per eager run (3 run(s), host gaps excluded): 0.750 ms in 7 launches; conv 0.500 ms, "
                    "non-conv 0.250 ms (33.3%); top non-conv family: elementwise 0.120 ms (16.0%)")
    assert opprofile.family_line(p) == ("by family: conv 0.500, elementwise 0.120, normalization 0.100, "
                                        "concat_copy 0.020, pooling 0.010 ms")
    assert opprofile.short_text(p) == "0.250 ms, 33% (elementwise)"
    assert opprofile.label_lines(p, top=1) == ["   0.500 ms   66.7%  x2    Conv+relu (conv)"]
    # only convolutions: no top non-conv family; nothing at all: no share
    only = opprofile.aggregate([("Conv", "Conv", 1.0)], 1, host_gaps_excluded=False, method="m")
    assert only["top_non_conv_family"] is None and only["non_conv_pct"] == 0.0
    assert "top non-conv family: none" in opprofile.summary_line(only)
    assert "HOST LAUNCH OVERHEAD INCLUDED" in opprofile.summary_line(only)
    assert opprofile.aggregate([], 2, host_gaps_excluded=True, method="m")["non_conv_pct"] is None
    with pytest.raises(ValueError):
        opprofile.aggregate([], 0, host_gaps_excluded=True, method="m")
    assert opprofile.summary_line(None) is None and opprofile.short_text(None) == "-"
    assert opprofile.summary_line(opprofile.failed("out of memory")) == "GPU time by op family: failed: out of memory"


class _FakeEvent:
    def __init__(self, t: float) -> None:
        self.t = t


class _FakeProfiledExecutor:
    """Stands in for an eager cuda executor: every run appends its launches to backend.step_events."""

    def __init__(self, samples_per_run: list[tuple[str, str, float]]) -> None:
        import types

        self.backend = types.SimpleNamespace(step_events=None)
        self.samples = samples_per_run
        self.runs = 0
        self.profiled_runs = 0

    def run(self, names, feeds):
        self.runs += 1
        events = self.backend.step_events
        if events is not None:
            self.profiled_runs += 1
            t = 0.0
            for label, op_type, ms in self.samples:
                events.append((label, op_type, _FakeEvent(t), _FakeEvent(t + ms)))
                t += ms
        return []


class _FakeClock:
    """Scripted holds: ``queued`` says, per timed run, whether the hold outlasted the run's enqueue."""

    def __init__(self, queued: list[bool] | None, empty_ms: float | None = None) -> None:
        self.queued = list(queued) if queued is not None else None
        self.holds: list[float] = []
        self.syncs = 0
        self.note = "" if queued is not None else "no hold kernel (CompileException: nvrtc missing)"
        self.empty_ms = empty_ms  # an empty launch's time between its events (None: no empty kernel)
        self.empties = 0

    def empty(self):
        if self.empty_ms is None or self.queued is None:
            return None
        self.empties += 1
        return _FakeEvent(0.0), _FakeEvent(self.empty_ms)

    def sync(self) -> None:
        self.syncs += 1

    def elapsed_ms(self, start, end) -> float:
        return end.t - start.t

    def hold(self, seconds):
        if self.queued is None:
            return None
        self.holds.append(seconds)
        answer = self.queued.pop(0)
        return lambda: answer


def test_profile_executor_times_only_runs_queued_whole():
    ex = _FakeProfiledExecutor(_samples(1))
    ticks = iter([0.0, 0.004])  # the untimed run that sizes the hold: 4 ms of host time
    clock = _FakeClock([False, True, True])
    p = opprofile.profile_executor(ex, {}, runs=2, clock=clock, warmup=2, host_clock=lambda: next(ticks))
    assert ex.runs == 2 + 1 + 3 and ex.profiled_runs == 3 and ex.backend.step_events is None
    assert clock.holds == [pytest.approx(0.009), pytest.approx(0.018), pytest.approx(0.018)]  # 2 x 4 ms + 1 ms, doubled after a miss
    assert p["host_gaps_excluded"] is True and p["runs"] == 2 and p["launches"] == 7
    assert p["total_ms"] == pytest.approx(0.75) and "queued whole behind a hold kernel" in p["method"]
    assert "mean of 2 run(s)" in p["method"]


def test_profile_executor_takes_the_timing_s_own_cost_off_every_launch():
    """An event pair costs GPU time of its own: an empty launch timed the same way is taken off each
    launch (a step that launches nothing reads 0, not the floor), and the floor is reported."""
    samples = [("Conv", "Conv", 0.100), ("Reshape", "Reshape", 0.003), ("fused Relu", "Relu", 0.010)]
    ex = _FakeProfiledExecutor(samples)
    clock = _FakeClock([True] * 3, empty_ms=0.004)
    p = opprofile.profile_executor(ex, {}, runs=2, clock=clock, host_clock=lambda: 0.0)
    assert p["floor_ms"] == pytest.approx(0.004) and clock.empties == 2 * opprofile.FLOOR_LAUNCHES
    ms = {r["label"]: r["ms"] for r in p["labels"]}
    assert ms == {"Conv": pytest.approx(0.096), "Reshape": 0.0, "fused Relu": pytest.approx(0.006)}
    assert p["conv_ms"] == pytest.approx(0.096) and p["non_conv_ms"] == pytest.approx(0.006)
    assert "each launch less the timing's own 0.0040 ms" in p["method"]
    plain = opprofile.profile_executor(_FakeProfiledExecutor(samples), {}, runs=2, clock=_FakeClock([True] * 3), host_clock=lambda: 0.0)
    assert plain["floor_ms"] is None and plain["conv_ms"] == pytest.approx(0.100) and "no empty kernel" in plain["method"]


def test_profile_executor_counts_the_inputs_conv_launches_copy():
    """Their time is in the conv family; how many there are per run is said beside it."""
    ex = _FakeProfiledExecutor(_samples(1))
    ex.backend.counters = {"layout_copies": 0}
    plain_run = ex.run

    def run(names, feeds):
        ex.backend.counters["layout_copies"] += 3
        return plain_run(names, feeds)

    ex.run = run
    p = opprofile.profile_executor(ex, {}, runs=2, clock=_FakeClock([True] * 3), host_clock=lambda: 0.0)
    assert p["conv_input_copies"] == 3
    assert "conv 0." in opprofile.summary_line(p) and "(with 3 input copies made inside conv launches)" in opprofile.summary_line(p)
    plain = opprofile.profile_executor(_FakeProfiledExecutor(_samples(1)), {}, runs=2, clock=_FakeClock([True] * 3), host_clock=lambda: 0.0)
    assert plain["conv_input_copies"] is None and "input copies" not in opprofile.summary_line(plain)


def test_profile_executor_says_when_host_gaps_are_included():
    ex = _FakeProfiledExecutor(_samples(1))
    p = opprofile.profile_executor(ex, {}, runs=3, clock=_FakeClock(None), host_clock=lambda: 0.0)
    assert ex.profiled_runs == 3 and p["runs"] == 3 and p["host_gaps_excluded"] is False
    assert "host launch overhead included (no hold kernel (CompileException: nvrtc missing))" in p["method"]
    ex = _FakeProfiledExecutor(_samples(1))
    p = opprofile.profile_executor(ex, {}, runs=2, clock=_FakeClock([False] * 4), host_clock=lambda: 0.0)
    assert ex.profiled_runs == 4 and p["runs"] == 2 and p["host_gaps_excluded"] is False  # gave up after 2 x runs
    assert "a launch waits for the host inside the run" in p["method"]
    with pytest.raises(ValueError):
        opprofile.profile_executor(ex, {}, runs=0, clock=_FakeClock(None))


def test_op_profile_in_case_table_markdown_summary_and_schema():
    cases = [_ratio_case("a", 1, 0.5), _ratio_case("b", 32, 0.9), _ratio_case("c", 32, 0.9)]
    cases[0]["op_profile"] = opprofile.aggregate(_samples(2), 2, host_gaps_excluded=True, method="m")
    cases[1]["op_profile"] = opprofile.failed("CUDARuntimeError: out of memory")
    doc = document.build_document(ENV, dict(SETTINGS, profile_ops=5), None, cases)
    assert schema.validate_document(doc) == []
    text = render.format_case(doc["cases"][0])
    assert "  GPU time per eager run (2 run(s), host gaps excluded): 0.750 ms in 7 launches;" in text
    assert "  by family: conv 0.500, elementwise 0.120," in text
    assert "GPU time by op family: failed: CUDARuntimeError: out of memory" in render.format_case(doc["cases"][1])
    md = render.format_markdown(doc["cases"]).splitlines()
    col = md[0].split("|").index(" non-conv GPU time (top family) ")
    assert [row.split("|")[col].strip() for row in md[2:5]] == ["0.250 ms, 33% (elementwise)", "failed", "-"]
    s = _t(doc["summary"], "op_profile_reported")
    assert s["per_case"] == {"a b1": "0.250 ms, 33% (elementwise)"} and s["failing"] == {"b b32": "CUDARuntimeError: out of memory"}
    assert s["not_measured"] == ["c b32"] and s["verdict"] == "not met"
    assert ("      reported for 1 of 3 case(s); failed for b b32: "
            "CUDARuntimeError: out of memory; target: every case: NOT MET (not measured for c b32; run with --profile-ops)"
            ) in render_summary.format_summary(doc["summary"]).splitlines()
    # the non-conv share of a batch > 1 case is judged from the same profile (b b32 failed, c b32 has none)
    share = _t(doc["summary"], "non_conv_share_large_batch")
    assert share["cases"] == "batch > 1" and share["n"] == 0 and share["not_measured"] == ["b b32", "c b32"]
    assert doc["cases"][0]["ratios"]["non_conv_share"] == pytest.approx(0.25 / 0.75)
    doc["cases"][0]["op_profile"]["top_non_conv_family"] = "gemm"
    assert any("top_non_conv_family" in e for e in schema.validate_document(doc))


# ---------------------------------------------------------------------------------------------
# formatting


def test_case_table_and_report_text():
    doc = _doc()
    text = render.format_report(doc)
    assert "NVIDIA H200" in text and "cuDNN 9.19.0" in text and "580.159.04" in text
    case_text = render.format_case(doc["cases"][0])
    lines = case_text.splitlines()
    assert lines[0].startswith("resnet50 batch 1 (input 1x3x224x224; float32; TF32 on); reference: onnxruntime 1.31.1 CPU")
    assert "convpass optimize: 3.800 s, tuner 3.5 s (23 problems measured, 0 from the tuning cache)" in case_text
    row = next(ln for ln in lines if ln.strip().startswith("convpass ") and "optimize" not in ln)
    assert "0.080" in row and "1.400" in row and f"{1.40 / 1.728:.2f}x" in row and "ok" in row
    ort_row = next(ln for ln in lines if ln.strip().startswith("ort EXHAUSTIVE nhwc"))
    assert "0.356 (0.193+0.163)" in ort_row and "1.00x (best)" in ort_row
    assert "roofline: 1 convs" in case_text
    assert "Summary over 3 model/batch case(s)" in text
    assert "target <= 0.80x: NOT MET" in text
    assert "target <= 1.00x in every case: MET" in text
    assert "target >= 5.00x in every case: NOT MET" in text
    assert text.index("  convpass / the best of each peer") < text.index("  Targets:")
    assert text.index("  Targets:") < text.index("    cold_start_vs_ort_exhaustive: in-process cold start")
    assert "issue" not in text.lower()
    assert "  CUDA graph: yes (212 launch(es) in one CUDA graph)" in lines
    md = render.format_markdown(doc["cases"])
    rows = md.splitlines()
    assert rows[0].startswith("| model, batch |") and set(rows[1]) <= {"|", "-"}
    assert rows[1].count("|") == rows[0].count("|") == rows[2].count("|")
    assert rows[2].startswith("| resnet50, 1 | 1.400 | 1.728 (EXHAUSTIVE nhwc) | - | 3.303 (channels_last) | - | 0.81x | - | 0.81x "
                              "| yes | - | 0.080 | 0.356 | 4.45x | - |")


def test_all_cached_tuning_line():
    line = render.tuning_line({"optimize_s": 0.8, "tuning_s": 0.1, "measured": 0, "cached": 23, "failed": 0, "all_cached": True})
    assert "every decision from the tuning cache (23 problems), nothing timed" in line
    assert "graph-API" not in line
    engines = render.tuning_line({"optimize_s": 9.0, "tuning_s": 8.0, "measured": 40, "cached": 6, "failed": 0,
                                  "engine_decisions": 17})
    assert engines.endswith("(40 problems measured, 6 from the tuning cache; 17 run a cuDNN graph-API engine)")


# ---------------------------------------------------------------------------------------------
# JSON schema


def test_merged_parts_of_one_run_keep_every_case_and_each_note_once():
    a = document.build_document(ENV, SETTINGS, None, [_case("resnet50", 1)], notes=["same note", "part a"])
    b = document.build_document(ENV, SETTINGS, None, [_case("resnet50", 32)], notes=["same note"])
    merged = document.merge_documents([a, b])
    assert [(c["model"], c["batch"]) for c in merged["cases"]] == [("resnet50", 1), ("resnet50", 32)]
    assert merged["notes"] == ["same note", "part a"]
    assert merged["summary"]["cases"] == 2


def test_document_is_valid_and_round_trips():
    doc = _doc()
    assert schema.validate_document(doc) == []
    again = json.loads(document.to_json(doc))
    assert schema.validate_document(again) == []
    key = "steady_vs_ort_per_batch_group"
    assert _g(again["summary"], key, "batch 1")["geomean"] == pytest.approx(_g(doc["summary"], key, "batch 1")["geomean"])
    assert again["environment"]["packages"]["onnxruntime-gpu"] == "1.31.1"
    assert again["schema"] == schema.SCHEMA_ID == "convpass.bench/4" and again["cases"][0]["contenders"][0]["cuda_graph"]["captured"] is True
    assert len(again["cases"][0]["contenders"][0]["times_ms"]) == 5


def test_schema_catches_mistakes():
    doc = _doc()
    doc["cases"][0]["contenders"][0]["status"] = "fast"
    del doc["cases"][1]["batch"]
    doc["cases"][2]["contenders"][1]["median_ms"] = "1.2"
    _g(doc["summary"], "steady_vs_ort_per_batch_group", "batch 1")["verdict"] = "almost"
    doc["cases"][0]["contenders"][0]["cuda_graph"]["captured"] = "yes"
    doc["environment"]["packages"]["torch"] = 2
    errors = schema.validate_document(doc)
    assert any("$.cases[0].contenders[0].status" in e and "'fast'" in e for e in errors)
    assert "$.cases[1].batch: missing" in errors
    assert any(e.startswith("$.cases[2].contenders[1].median_ms: '1.2' is not of type") for e in errors)
    assert any(e.startswith("$.summary.targets[0].groups[0].verdict: 'almost' is not one of") for e in errors)
    assert any(e.startswith("$.cases[0].contenders[0].cuda_graph.captured: 'yes' is not of type") for e in errors)
    assert any(e.startswith("$.environment.packages.torch") for e in errors)
    assert schema.validate_document([]) == ["$: [] is not of type 'object'"]
    # bools are not numbers, NaN is not JSON
    doc = _doc()
    doc["settings"]["runs"] = True
    assert any("$.settings.runs" in e for e in schema.validate_document(doc))
    doc = _doc()
    doc["cases"][0]["contenders"][0]["median_ms"] = float("nan")
    assert any("not JSON-serializable" in e for e in schema.validate_document(doc))
    assert json.loads(document.to_json(doc))["cases"][0]["contenders"][0]["median_ms"] is None


def test_contender_record_rejects_unknown_fields_and_values():
    with pytest.raises(ValueError):
        records.contender("x", "tensorrt")
    with pytest.raises(ValueError):
        records.contender("x", "ort", status="fastest")
    with pytest.raises(ValueError):
        records.contender("x", "ort", speed=3)


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
    assert "not computed" in render.roofline_line(r)
    ProblemKey.parse(KEY_DW)  # the sample keys are real keys


# ---------------------------------------------------------------------------------------------
# unavailable contenders


def test_no_cuda_ep_reports_four_unavailable_configurations(monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    reason = ort_contender.ort_unavailable_reason()
    assert "no CUDAExecutionProvider" in reason and "onnxruntime-gpu" in reason
    # nothing touches a GPU on this path
    got = ort_contender.run_ort(None, {}, {}, None, True, "float32", 5, 1)
    assert [c["name"] for c in got] == ["ort EXHAUSTIVE nchw", "ort EXHAUSTIVE nhwc", "ort HEURISTIC nchw", "ort HEURISTIC nhwc"]
    assert {c["status"] for c in got} == {"unavailable"} and all(c["reason"] == reason for c in got)
    assert got[1]["config"]["prefer_nhwc"] == 1 and got[0]["config"]["use_tf32"] == 1


def test_onnxruntime_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import raises ImportError
    assert ort_contender.ort_unavailable_reason().startswith("onnxruntime is not installed")


def test_torch_missing_reports_unavailable(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)
    reason = torch_contender.torch_unavailable_reason()
    assert reason.startswith("torch is not installed")
    got = torch_contender.run_torch(tmp_path / "m.onnx", None, {}, None, True, "float32", 5, 1, {})
    assert [c["name"] for c in got] == ["torch nchw", "torch channels_last"]
    assert {c["status"] for c in got} == {"unavailable"}


def test_unavailable_peers_in_table_json_and_summary(monkeypatch):
    case = _case("resnet50", 1)
    why = "onnxruntime 1.31.1 has no CUDAExecutionProvider (providers: CPUExecutionProvider); install onnxruntime-gpu"
    case["contenders"] = [c for c in case["contenders"] if c["family"] != "ort"]
    case["contenders"] += [records.unavailable(peers.ort_name(s, n), "ort", why) for s, n in peers.ORT_CONFIGS]
    doc = document.build_document(ENV, SETTINGS, None, [case])
    assert schema.validate_document(doc) == []
    text = render.format_report(doc)
    assert f"unavailable: {why}" in text
    assert _g(doc["summary"], "steady_vs_ort_per_batch_group", "batch 1")["verdict"] == "not measured"
    assert _t(doc["summary"], "cold_start_vs_ort_exhaustive")["verdict"] == "not measured"
    assert _t(doc["summary"], "steady_vs_torch_eager_every_case")["verdict"] == "met"
    assert "target <= 0.80x: NOT MEASURED (not measured for any case)" in text
    assert case["best"]["all"] == "torch channels_last"


def test_panel_entry_lookup(tmp_path):
    (tmp_path / "panel.json").write_text(json.dumps({"models": [
        {"name": "resnet50", "file": "resnet50.onnx", "builder": "torchvision.models.resnet50"},
        {"name": "dcgan_generator", "file": "dcgan_generator_fp16.onnx", "dtype": "float16"},
    ]}))
    entry, why = peers.panel_entry(tmp_path / "resnet50.onnx")
    assert entry["name"] == "resnet50" and why is None
    entry, _ = peers.panel_entry(tmp_path / "dcgan_generator_fp16.onnx")
    assert entry["dtype"] == "float16"
    entry, why = peers.panel_entry(tmp_path / "mine.onnx")
    assert entry is None and "not listed" in why
    entry, why = peers.panel_entry(tmp_path / "sub" / "resnet50.onnx")
    assert entry is None and "no " in why and "--panel-json" in why
    entry, _ = peers.panel_entry(tmp_path / "sub" / "resnet50.onnx", tmp_path / "panel.json")
    assert entry["name"] == "resnet50"


def test_export_panel_is_found():
    assert any(p.is_file() for p in peers.export_panel_candidates())


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

    assert profiles.input_shapes(model(["batch", 3, 8, 8]), 32) == {"x": (32, 3, 8, 8)}
    assert profiles.input_shapes(model([4, 3]), 4) == {"x": (4, 3)}
    with pytest.raises(profiles.CaseSkipped):
        profiles.input_shapes(model([1, 3]), 32)
    with pytest.raises(ValueError, match="symbolic"):
        profiles.input_shapes(model(["batch", "h"]), 1)
    assert profiles.shape_spec({"x": (32, 3, 8, 8)}) == "x=32x3x8x8"
    feeds = measure.make_feeds(model(["batch", 3]), {"x": (2, 3)})
    assert feeds["x"].shape == (2, 3) and str(feeds["x"].dtype) == "float32" and feeds["x"].any()
    real = onnx.load(MODELS / "residual_cnn.onnx", load_external_data=False)
    (name, dims, _), = profiles.model_inputs(real)
    assert profiles.input_shapes(real, dims[0] if isinstance(dims[0], int) else 2)


def test_decision_helpers():
    recs = [{"memory_format": "NHWC", "math_mode": "default", "source": "measure", "problem_key": KEY_3X3},
            {"memory_format": "NCHW", "math_mode": "fma", "source": "cache", "problem_key": KEY_DW}]
    assert convpass_contender.decision_summary(recs)["memory_format"] == {"NHWC": 1, "NCHW": 1}
    assert convpass_contender.uses_tf32(recs) is True
    assert convpass_contender.uses_tf32(recs[1:]) is False
    assert convpass_contender.uses_tf32([{"math_mode": "auto", "problem_key": ""}]) is True  # run time picks default math
    assert convpass_contender.uses_tf32([]) is False and convpass_contender.uses_tf32([], matmul_tf32=True) is True


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
    assert bench_cli.parse_vs("torch-compile,ort-graph") == ("ort-graph", "torch-compile")  # in the bench's order
    assert bench_cli.parse_vs("all") == bench_cli.parse_vs("ort,torch,all") == ("ort", "ort-graph", "torch", "torch-compile")
    from convpass.core.errors import ConvpassError

    for bad in (["0"], ["a,b"], ["=1"]):
        with pytest.raises(ConvpassError):
            bench_cli.parse_batches(bad)
    for bad in ("ort,tensorrt", "both", "", "none,ort", "ort-graphs"):
        with pytest.raises(ConvpassError, match="--vs"):
            bench_cli.parse_vs(bad)
    args = _parser().parse_args(["bench", "m.onnx"])
    assert (args.runs, args.warmup, args.vs, args.json, args.json_file, args.plot, args.cache, args.panel_json, args.profile_ops) == (
        50, 10, "all", False, None, None, None, None, False)
    assert args.torch_compile_modes == "default,reduce-overhead" and args.targets is None
    assert _parser().parse_args(["bench", "m.onnx", "--profile-ops"]).profile_ops is True


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
    panel = peers.load_export_panel()
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
    a.write_text(document.to_json(first))
    b.write_text(document.to_json(second))
    real_import = builtins.__import__

    def no_matplotlib(name, *a_, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a_, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out_json = tmp_path / "merged.json"
    # --plot without matplotlib: one line, exit 1 (through the CLI's error handler), nothing written
    argv = ["--from-json", str(a), str(b), "--json-file", str(out_json), "--plot", str(tmp_path / "p.png")]
    assert bench_cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("convpass: error: --plot needs matplotlib, which is not installed")
    assert not (tmp_path / "p.png").exists() and not out_json.exists()
    # without --plot: merged, written to the file, and with --json printed on stdout (the report on stderr)
    args = _parser().parse_args(["bench", "--from-json", str(a), str(b), "--json-file", str(out_json), "--json"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert "Summary over 3 model/batch case(s)" in err and "Summary" not in out
    merged = json.loads(out_json.read_text())
    assert json.loads(out) == merged
    assert schema.validate_document(merged) == []
    for group in ("batch 1", "batch > 1"):
        key = "steady_vs_ort_per_batch_group"
        assert _g(merged["summary"], key, group)["geomean"] == pytest.approx(_g(doc["summary"], key, group)["geomean"])


def test_from_json_rerenders_a_recorded_v1_document(tmp_path, capsys):
    """A recorded panel run (convpass.bench/1: no CUDA graph status, no op profile, its own summary
    form) re-rendered with this version's targets: recomputed from its own ratios, grouped by batch."""
    recorded = json.loads(RECORDED_V1.read_text())
    assert recorded["schema"] == "convpass.bench/1" and "steady_vs_best_ort" in recorded["summary"]
    assert schema.validate_document(recorded, recorded=True) == []
    assert any("$.schema" in e for e in schema.validate_document(recorded))  # not what this version writes
    out_json = tmp_path / "again.json"
    args = _parser().parse_args(["bench", "--from-json", str(RECORDED_V1), "--json-file", str(out_json)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "convpass.bench/4" and schema.validate_document(doc) == []
    assert doc["settings"]["targets"] == targets.load() and doc["settings"]["argv"] == recorded["settings"]["argv"]
    # expected from the ratios the run itself recorded (its own summary), split by batch here
    old = recorded["summary"]["steady_vs_best_ort"]["per_case"]
    by_group: dict[str, list[float]] = {"batch 1": [], "batch > 1": []}
    for label, ratio in old.items():
        by_group["batch 1" if label.endswith(" b1") else "batch > 1"].append(ratio)
    s = doc["summary"]
    assert _g(s, "steady_vs_ort_per_batch_group", "batch 1")["geomean"] == pytest.approx(stats.geomean(by_group["batch 1"]))
    assert _g(s, "steady_vs_ort_per_batch_group", "batch > 1")["geomean"] == pytest.approx(stats.geomean(by_group["batch > 1"]))
    assert _g(s, "steady_vs_ort_per_batch_group", "batch > 1")["batches"] == [8, 32] and _g(s, "steady_vs_ort_per_batch_group", "batch > 1")["n"] == 8
    assert _t(s, "steady_vs_ort_every_case")["worst_case"] == max(old, key=old.get) == "convnext_tiny b32"
    assert _t(s, "steady_vs_ort_every_case")["geomean"] == pytest.approx(recorded["summary"]["steady_vs_best_ort"]["geomean"])
    assert _t(s, "steady_vs_torch_eager_every_case")["worst"] == pytest.approx(recorded["summary"]["steady_vs_best_torch"]["worst"])
    assert _t(s, "cold_start_vs_ort_exhaustive")["geomean"] == pytest.approx(recorded["summary"]["cold_start_vs_ort_exhaustive"]["geomean"])
    assert (_t(s, "one_cuda_graph")["verdict"], _t(s, "one_cuda_graph")["n"], len(_t(s, "one_cuda_graph")["not_measured"])) == ("not measured", 0, 16)
    assert _t(s, "op_profile_reported")["verdict"] == "not measured"
    assert "batch 1 (8 case(s)): geometric mean 0.62x; target <= 0.80x: MET" in out
    assert "batch > 1 (batches 8, 32; 8 case(s)): geometric mean 1.03x; target <= 0.80x: NOT MET" in out
    assert "      worst 1.58x (convnext_tiny b32); above 1.05x: " in out and " mobilenet_v3_large b32 1.30x," in out
    assert "      0 of 16 case(s) captured; target: every case: NOT MEASURED" in out
    assert out.count("CUDA graph: ? (not recorded in this document)") == 16
    assert "| resnet50, 1 | 0.574 | 1.224 (EXHAUSTIVE nhwc) | - | 3.162 (channels_last) | - | 0.47x | - | 0.47x | ? | - |" in out


def test_from_json_refuses_other_documents(tmp_path):
    from convpass.core.errors import ConvpassError

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

        def savefig(self, path, dpi=None, format=None):
            calls.append("savefig")
            path.write(b"chart")

    class Plt:
        def subplots(self, figsize=None):
            return Fig(), Ax()

        def close(self, fig):
            pass

    path = tmp_path / "chart.png"
    assert plot.write_plot(_doc(), str(path), importer=Plt) == str(path)
    assert path.exists() and calls.count("bar") == 3 and "axhline" in calls


def test_bench_package_imports_no_gpu_libraries():
    import subprocess

    code = ("import sys, convpass.cli.bench, convpass.bench.contenders, convpass.bench.document, convpass.bench.render, "
            "convpass.bench.plot, convpass.bench.schema, convpass.bench.targets, convpass.bench.roofline;"
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


def _stand_in_kernels(tuned_path):
    """What write_kernels records, without the GPU it needs."""
    return {"kernels": f"{tuned_path}.kernels: 3 kernel(s) compiled ahead of time (sm_90: 3) (stand-in)", "kernels_s": 0.25}


def _bench_on_cpu(monkeypatch) -> None:
    """The bench's GPU pieces stood in for: CuPy faked, the GPU check passed, no clock warming, stand-in
    kernels, and the NumPy executor in place of the cuda one."""
    import convpass.runtime.executor as executor_mod

    pytest.importorskip("onnxruntime")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(bench_cli, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(measure, "warm_gpu", lambda seconds=0.05: None)
    monkeypatch.setattr(convpass_contender, "write_kernels", _stand_in_kernels)
    real = executor_mod.Executor

    class CpuExecutor(real):
        def __init__(self, model, device="cpu", **kw):
            super().__init__(model, device="cpu", **kw)

    monkeypatch.setattr(executor_mod, "Executor", CpuExecutor)


def test_the_tuned_model_gets_its_kernel_sidecar_or_says_why_not(tmp_path):
    import shutil

    shutil.copy(MODELS / "residual_cnn.onnx", tmp_path / "m.tuned.onnx")
    got = convpass_contender.write_kernels(tmp_path / "m.tuned.onnx")  # no GPU here
    assert got["kernels"].startswith("not written: compiling kernels ahead of time needs a GPU") and got["kernels_s"] >= 0
    line = render.tuning_line({"optimize_s": 2.0, "measured": 3, "cached": 0, **_stand_in_kernels("m.tuned.onnx")})
    assert line.endswith("; kernels ahead of time (0.250 s): m.tuned.onnx.kernels: 3 kernel(s) compiled ahead of time "
                         "(sm_90: 3) (stand-in)")


def test_the_in_place_check_of_the_kernel_compile_is_kept_and_its_slow_convs_named():
    from convpass.compiler.aot import KernelReport

    conv = {"node": "c1", "profile": 0, "algo": "IMPLICIT_GEMM", "memory_format": "nhwc", "tuned_ms": 0.1}
    docs = ({"reliable": True, "convs": [dict(conv, in_place_ms=0.2, ratio=2.0), dict(conv, node="c2", in_place_ms=0.1, ratio=1.0)]},)
    report = KernelReport(Path("m.kernels"), 3, {"90": 3}, ["1x3x8x8"], [], 1.0, in_place=docs)
    got = convpass_contender.in_place_record(report)
    assert (got["timed"], got["judged"], len(got["slow"])) == (2, True, 1) and "'c1'" in got["slow"][0]
    assert convpass_contender.in_place_record(dataclasses.replace(report, in_place=())) is None
    unjudged = convpass_contender.in_place_record(dataclasses.replace(report, in_place=(dict(docs[0], reliable=False),)))
    assert (unjudged["judged"], unjudged["slow"]) == (False, [])
    line = render.tuning_line({"optimize_s": 2.0, "measured": 3, "cached": 0, **_stand_in_kernels("m.tuned.onnx"), "in_place": got})
    assert "; in place: 2 tuned conv launch(es) timed inside the plan, 1 more than 15% over their tuned time\n    conv 'c1'" in line
    assert line.count("\n") == 1 and "more" not in line.splitlines()[-1]
    # a real model may have a hundred slow convs: five are named, the rest counted in one line
    many = dataclasses.replace(report, in_place=({"reliable": True, "convs": [
        dict(conv, node=f"c{i}", in_place_ms=0.2, ratio=2.0) for i in range(12)]},))
    got = convpass_contender.in_place_record(many)
    assert len(got["slow"]) == 12  # the record keeps every one
    tail = render.tuning_line({"optimize_s": 2.0, "measured": 3, "cached": 0, "in_place": got}).splitlines()[1:]
    assert [s.split("'")[1] for s in tail[:-1]] == ["c0", "c1", "c2", "c3", "c4"] and tail[-1] == "    ... and 7 more (the JSON record lists every one)"
    five = dict(got, slow=got["slow"][:5])
    assert render.tuning_line({"optimize_s": 2.0, "measured": 3, "cached": 0, "in_place": five}).count("\n") == 5
    six = dict(got, slow=got["slow"][:6])
    assert render.tuning_line({"optimize_s": 2.0, "measured": 3, "cached": 0, "in_place": six}).endswith("\n    ... and 1 more (the JSON record lists every one)")


def _in_place(slow: int, judged: bool = True) -> dict:
    """A convpass tuning record's in-place check with ``slow`` slow convs (made up)."""
    lines = [f"conv 'c{i}' (profile 0) runs 0.2000 ms in place against 0.1000 ms tuned (2.00x > 1.15x)" for i in range(slow)]
    return {"line": f"in place: 20 tuned conv launch(es) timed inside the plan, {slow} more than 15% over their tuned time",
            "timed": 20, "judged": judged, "slow": lines if judged else []}


def test_the_in_place_slow_convs_target_counts_every_case_and_leaves_out_what_it_cannot_judge():
    cases = [_case(m, b) for m, b in CONVPASS_SAMPLE]  # resnet50 b1, resnet50 b32, mobilenet_v3_large b1
    fourth = _case("resnet50", 1)
    fourth["batch"] = 8
    tunings = [records.find(c, "convpass")["tuning"] for c in [*cases, fourth]]
    tunings[0]["in_place"] = _in_place(0)
    tunings[1]["in_place"] = _in_place(12)
    tunings[2]["in_place"] = _in_place(0, judged=False)  # timed with host gaps; the fourth: no check ran
    doc = document.build_document(ENV, SETTINGS, None, [*cases, fourth])
    assert schema.validate_document(doc) == [], schema.validate_document(doc)
    broken = json.loads(json.dumps(doc))
    records.find(broken["cases"][1], "convpass")["tuning"]["in_place"]["slow"] = 12
    assert any(".tuning.in_place.slow: 12 is not of type 'array'" in e for e in schema.validate_document(broken))
    t = _t(doc["summary"], "in_place_slow_convs")
    assert (t["measure"], t["rule"], t["at_most"]) == ("in_place_slow_convs", "every_case", 0)
    assert t["per_case"] == {"resnet50 b1": 0, "resnet50 b32": 12} and t["n"] == 2
    assert t["failing"] == ["resnet50 b32"] and (t["worst"], t["worst_case"]) == (12, "resnet50 b32")
    assert t["not_measured"] == ["resnet50 b8"] and t["not_judged"] == ["mobilenet_v3_large b1"]
    assert t["verdict"] == "not met"
    text = render.format_report(doc).splitlines()
    assert ("    in_place_slow_convs: tuned convs more than 15% over their tuned time when timed inside the plan "
            "(the in-place check), per case") in text
    assert ("      worst 12 (resnet50 b32); above 0: resnet50 b32 12; 2 case(s); target <= 0 in every case: NOT MET "
            "(not measured for resnet50 b8; bench without --no-kernels, on a GPU; timed with host gaps, not judged for "
            "mobilenet_v3_large b1)") in text
    # none slow where judged: met, what was left out still listed
    tunings[1]["in_place"] = _in_place(0)
    t = _t(document.build_document(ENV, SETTINGS, None, [*cases, fourth])["summary"], "in_place_slow_convs")
    assert t["verdict"] == "met" and t["failing"] == [] and t["not_judged"] == ["mobilenet_v3_large b1"]
    # a wrong convpass output fails it, as every target that reads convpass
    records.judge(records.find(cases[0], "convpass"), 0.5, 5e-3)
    assert _t(document.build_document(ENV, SETTINGS, None, cases)["summary"], "in_place_slow_convs")["verdict"] == "not met"
    # no check ran anywhere (--no-kernels, or no GPU): not measured, with how to take it
    s = document.build_document(ENV, SETTINGS, None, [fourth])["summary"]
    assert _t(s, "in_place_slow_convs")["verdict"] == "not measured"
    assert ("      no case measured; target <= 0 in every case: NOT MEASURED (not measured for any case; bench without "
            "--no-kernels, on a GPU)") in render_summary.format_summary(s).splitlines()
    # only checks timed with host gaps: not measured either, and said why
    s = document.build_document(ENV, SETTINGS, None, [cases[2]])["summary"]
    assert _t(s, "in_place_slow_convs")["verdict"] == "not measured"
    assert ("      no case measured; target <= 0 in every case: NOT MEASURED (timed with host gaps, not judged for "
            "mobilenet_v3_large b1)") in render_summary.format_summary(s).splitlines()


def test_bench_end_to_end_with_stand_ins(monkeypatch, tmp_path, capsys):
    import convpass.runtime.executor as executor_mod

    pytest.importorskip("onnxruntime")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setitem(sys.modules, "torch", None)  # torch missing: said so, the rest runs
    monkeypatch.setattr(bench_cli, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(measure, "warm_gpu", lambda seconds=0.05: None)
    monkeypatch.setattr(convpass_contender, "write_kernels", _stand_in_kernels)
    monkeypatch.setattr(roofline, "measure_peaks", lambda: dict(PEAKS))
    real = executor_mod.Executor

    class CpuExecutor(real):  # the NumPy executor stands in for the cuda one
        def __init__(self, model, device="cpu", **kw):
            assert device == "cuda" and kw.get("output_kind") == "device"
            super().__init__(model, device="cpu", **kw)

        def run(self, names, feeds):
            out = super().run(names, feeds)
            if getattr(self.backend, "step_events", None) is not None:  # --profile-ops: the launches' event pairs
                assert not self.cuda_graph
                self.backend.step_events += [(label, op, _FakeEvent(0.0), _FakeEvent(ms)) for label, op, ms in _samples(1)]
            return out

    monkeypatch.setattr(executor_mod, "Executor", CpuExecutor)
    monkeypatch.setattr(opprofile, "CupyClock", lambda: _FakeClock([True] * 20))
    out_json = tmp_path / "bench.json"
    args = _parser().parse_args([
        "bench", str(MODELS / "mobile_block.onnx"), str(MODELS / "residual_cnn.onnx"), "--batch", "1,2",
        "--runs", "3", "--warmup", "1", "--cache", str(tmp_path / "t.db"), "--json-file", str(out_json), "--profile-ops",
    ])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out_json.read_text())
    assert schema.validate_document(doc) == [], schema.validate_document(doc)
    assert doc["environment"]["device"] == "Fake GPU" and doc["environment"]["cuda_runtime"] == "13.0"
    labels = [records.case_label(c) for c in doc["cases"]]
    assert labels == ["mobile_block b1", "mobile_block b2", "residual_cnn b1"]
    assert any("residual_cnn b2 skipped: input 'input' has a fixed batch of 1" in n for n in doc["notes"])
    for case in doc["cases"]:
        ours = records.find(case, "convpass")
        assert ours["status"] == "ok", ours
        assert ours["runs"] == 3 and len(ours["times_ms"]) == 3 and ours["cold_start_s"] > 0
        assert ours["tuning"]["measured"] is None  # no GPU tuner here: decisions left to run time
        assert case["reference"].startswith("onnxruntime") and case["roofline"]["counted"] == 0
        by_family = {c["family"]: c for c in case["contenders"]}
        # CPU-only onnxruntime: reported as unavailable; torch: not installed
        assert {c["status"] for c in case["contenders"] if c["family"] == "ort"} == {"unavailable"}
        assert "CUDAExecutionProvider" in by_family["ort"]["reason"]
        assert by_family["torch"]["status"] == "unavailable" and "torch is not installed" in by_family["torch"]["reason"]
        # --vs all (the default): the CUDA-graph configurations and torch.compile's modes are there too, saying why not
        assert [c["name"] for c in case["contenders"] if c["family"] == "ort-graph"] == [
            "ort-graph EXHAUSTIVE nchw", "ort-graph EXHAUSTIVE nhwc", "ort-graph HEURISTIC nchw", "ort-graph HEURISTIC nhwc"]
        assert {c["status"] for c in case["contenders"] if c["family"] == "ort-graph"} == {"unavailable"}
        assert [(c["name"], c["status"]) for c in case["contenders"] if c["family"] == "torch-compile"] == [
            ("torch.compile default", "unavailable"), ("torch.compile reduce-overhead", "unavailable")]
        # the CPU backend has no CUDA graph: recorded as the executor says, judged "not measured"
        assert ours["cuda_graph"] == {"captured": None, "reason": "cpu backend", "node": "", "text": "CUDA graph: n/a (cpu backend)"}
        prof = case["op_profile"]
        assert prof["status"] == "ok" and prof["runs"] == opprofile.PROFILE_RUNS and prof["host_gaps_excluded"] is True
        assert prof["conv_ms"] == pytest.approx(0.5) and prof["top_non_conv_family"] == "elementwise"
    s = doc["summary"]
    assert _g(s, "steady_vs_ort_per_batch_group", "batch 1")["verdict"] == _g(s, "steady_vs_ort_per_batch_group", "batch > 1")["verdict"] == "not measured"
    assert _t(s, "one_cuda_graph")["verdict"] == "not measured" and _t(s, "op_profile_reported")["verdict"] == "met"
    assert doc["settings"]["profile_ops"] == opprofile.PROFILE_RUNS
    assert doc["settings"]["vs"] == ["ort", "ort-graph", "torch", "torch-compile"]
    assert doc["settings"]["torch_compile_modes"] == ["default", "reduce-overhead"]
    assert doc["settings"]["targets_file"] == str(targets.DEFAULT_FILE)
    assert "CUDA graph: n/a (cpu backend)" in out and "GPU time per eager run" in out
    assert "[bench] mobile_block b1: convpass GPU time per op family" in err
    assert "Summary over 3 model/batch case(s)" in out and "unavailable: onnxruntime" in out
    assert "[bench] mobile_block b1: convpass optimize" in err
    assert "kernels ahead of time (0.250 s): " in out and records.find(doc["cases"][0], "convpass")["tuning"]["kernels_s"] == 0.25


def test_bench_json_keeps_finished_cases_when_a_later_one_is_interrupted(monkeypatch, tmp_path):
    _bench_on_cpu(monkeypatch)
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
                                 "--runs", "2", "--warmup", "0", "--cache", str(tmp_path / "t.db"), "--json-file", str(out_json)])
    with pytest.raises(KeyboardInterrupt):
        args.func(args)
    doc = json.loads(out_json.read_text())
    assert schema.validate_document(doc) == []
    assert [records.case_label(c) for c in doc["cases"]] == ["mobile_block b1"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_bench_no_kernels_skips_the_sidecar_and_says_what_the_cold_start_then_holds(monkeypatch, tmp_path, capsys):
    _bench_on_cpu(monkeypatch)

    def no_call(path):
        raise AssertionError("write_kernels called under --no-kernels")

    monkeypatch.setattr(convpass_contender, "write_kernels", no_call)
    out_json = tmp_path / "bench.json"
    args = _parser().parse_args(["bench", str(MODELS / "mobile_block.onnx"), "--batch", "1,2", "--vs", "none", "--no-roofline",
                                 "--runs", "2", "--warmup", "0", "--cache", str(tmp_path / "t.db"), "--json-file", str(out_json), "--no-kernels"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    assert schema.validate_document(doc) == []
    assert doc["settings"]["kernels"] is False
    assert any(n.startswith("--no-kernels: ") and "includes compiling" in n for n in doc["notes"])
    for case in doc["cases"]:
        tuning = records.find(case, "convpass")["tuning"]
        assert (tuning["kernels"], tuning["kernels_s"]) == (convpass_contender.NO_KERNELS, None)
    assert f"; kernels: {convpass_contender.NO_KERNELS}" in out
    from convpass.core.errors import ConvpassError

    both = _parser().parse_args(["bench", str(MODELS / "mobile_block.onnx"), "--no-kernels", "--fresh-process"])
    with pytest.raises(ConvpassError, match="not with --no-kernels"):
        both.func(both)


def test_bench_reports_ort_cuda_ep_that_does_not_load(monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    import numpy as np

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ort_contender.run_ort(MODELS / "residual_cnn.onnx", {"input": x}, {"input": sys.modules["cupy"].asarray(x)},
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


def test_executor_speed_profile_ops_uses_the_bench_measurement(monkeypatch, capsys):
    mod = benchmark_script("executor_speed")
    ex = _FakeProfiledExecutor(_samples(1))
    monkeypatch.setattr(mod, "_warm_eager", lambda path, batch, cache: (ex, {}))
    monkeypatch.setattr(opprofile, "CupyClock", lambda: _FakeClock([True] * 20))
    prof = mod._profile_ops(REPO / "resnet50.onnx", 32, None, runs=4)
    out = capsys.readouterr().out
    assert prof["runs"] == 4 and ex.profiled_runs == 4
    assert out.splitlines()[0].startswith("GPU time per op, resnet50 batch 32 (eager (cuda_graph=False)")
    assert "  " + opprofile.summary_line(prof) in out.splitlines()
    assert "non-conv 0.250 ms (33.3%); top non-conv family: elementwise 0.120 ms (16.0%)" in out
    assert "Conv+relu (conv)" in out

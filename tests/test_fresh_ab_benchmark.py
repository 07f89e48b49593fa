"""benchmarks/fresh_ab.py: fresh processes of convpass under two source trees, interleaved (CPU
children, real processes), and the check that each child imported its own tree."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from conftest import REPO, benchmark_script, conv_model, random_input

from convpass.bench import fresh

fresh_ab = benchmark_script("fresh_ab")


@pytest.fixture
def case(tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), model)
    np.savez(tmp_path / "in.npz", x=random_input((1, 3, 8, 8)))
    return ("m.b1", model, tmp_path / "in.npz")


def test_each_tree_s_children_import_that_tree_round_robin(tmp_path, case):
    other = tmp_path / "other"
    shutil.copytree(REPO / "convpass", other / "convpass", ignore=shutil.ignore_patterns("__pycache__"))
    seen: list[str] = []
    records = fresh_ab.run([("old", other), ("new", REPO)], [case], runs=2, device="cpu", timeout=120, log=seen.append)
    assert [len(records["m.b1"][t]) for t in ("old", "new")] == [2, 2]
    assert {r["module"] for r in records["m.b1"]["old"]} == {str(other / "convpass")}
    assert {r["module"] for r in records["m.b1"]["new"]} == {str(REPO / "convpass")}
    # round-robin, the trees' order reversed every other run
    assert [s.split(":")[0] for s in seen if s.startswith("run")] == ["run 1/2 m.b1 old", "run 1/2 m.b1 new", "run 2/2 m.b1 new", "run 2/2 m.b1 old"]
    lines = fresh_ab.table(records)
    assert len(lines) == 2 and lines[0].startswith("m.b1") and "total median" in lines[0] and "runs [" in lines[0]


def test_a_tree_from_before_the_module_key_is_checked_by_its_probe(tmp_path, case):
    # children of trees before 6c2f103 report no module: the probe process vouches for the tree
    old = tmp_path / "old"
    shutil.copytree(REPO / "convpass", old / "convpass", ignore=shutil.ignore_patterns("__pycache__"))
    child = old / "convpass" / "bench" / "fresh.py"
    text = child.read_text()
    assert ",\n                      module=_convpass_folder())" in text
    child.write_text(text.replace(",\n                      module=_convpass_folder())", ")"))
    records = fresh_ab.run([("old", old), ("new", REPO)], [case], runs=1, device="cpu", timeout=120, log=lambda s: None)
    assert records["m.b1"]["old"][0]["status"] == "ok" and records["m.b1"]["old"][0]["module"] is None


def test_a_tree_whose_processes_import_convpass_from_elsewhere_fails_the_run(monkeypatch, tmp_path, case):
    import subprocess

    found = json.dumps({"convpass": str(tmp_path / "t" / "convpass" / "__init__.py"), "convpass.compiler.passes": "/elsewhere/passes/__init__.py"})
    monkeypatch.setattr(fresh_ab.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, found + "\n", ""))
    with pytest.raises(RuntimeError, match=r"imported convpass modules from elsewhere: convpass.compiler.passes \(/elsewhere"):
        fresh_ab.run([("a", tmp_path / "t"), ("b", REPO)], [case], runs=1, device="cpu", timeout=10, log=lambda s: None)


def test_a_child_that_reports_another_tree_fails_the_run(monkeypatch, tmp_path, case):
    monkeypatch.setattr(fresh_ab, "_check_tree", lambda *a: None)
    elsewhere = {"parts": {"total_s": 1.0}, "module": str(tmp_path / "elsewhere" / "convpass")}
    monkeypatch.setattr(fresh, "spawn", lambda *a, **k: fresh.record("ok", **elsewhere))
    with pytest.raises(RuntimeError, match="imported convpass from .*elsewhere"):
        fresh_ab.run([("a", REPO), ("b", tmp_path)], [case], runs=1, device="cpu", timeout=10, log=lambda s: None)


def test_a_failed_child_is_recorded_and_the_runs_go_on(monkeypatch, case):
    monkeypatch.setattr(fresh_ab, "_check_tree", lambda *a: None)
    monkeypatch.setattr(fresh, "spawn", lambda *a, **k: fresh.record("failed", "exit status 1: boom"))
    records = fresh_ab.run([("a", REPO), ("b", REPO / "convpass")], [case], runs=2, device="cpu", timeout=10, log=lambda s: None)
    assert [r["reason"] for r in records["m.b1"]["a"]] == ["exit status 1: boom"] * 2
    assert fresh_ab.table(records)[0].endswith("no run succeeded  2 failed")


def test_onnx_runtime_configurations_run_in_the_rotation_on_the_original_model(tmp_path, case):
    seen: list[str] = []
    name, model, inputs = case
    records = fresh_ab.run([("new", REPO)], [fresh_ab.Case(name, model, inputs, model)], runs=2, device="cpu", timeout=120,
                           log=seen.append, ort=["HEURISTIC-nchw"])
    ort = records["m.b1"]["ort:HEURISTIC-nchw"]
    assert [r["status"] for r in ort] == ["ok", "ok"] and all(r["parts"]["total_s"] > 0 for r in ort)
    assert [s.split(":")[0] for s in seen if s.startswith("run")] == [
        "run 1/2 m.b1 new", "run 1/2 m.b1 ort", "run 2/2 m.b1 ort", "run 2/2 m.b1 new"]
    with pytest.raises(ValueError, match="original model"):
        fresh_ab.run([("new", REPO)], [case], runs=1, device="cpu", timeout=10, log=lambda s: None, ort=["HEURISTIC-nchw"])


def _records(totals: dict[str, list[float | None]]) -> dict[str, list[dict]]:
    return {name: [fresh.record("ok", parts={"total_s": t}) if t is not None else fresh.record("failed", "boom") for t in ts]
            for name, ts in totals.items()}


def test_the_targets_are_judged_on_medians_against_onnx_runtime_s_fastest_configuration():
    records = {
        "a.b1": _records({"new": [0.9, 1.0, 0.8], "ort:HEURISTIC-nchw": [1.2, 1.0, 1.1], "ort:HEURISTIC-nhwc": [0.95, 0.95, 0.95],
                          "ort:EXHAUSTIVE-nchw": [2.0, 2.0, 2.0]}),
        "b.b1": _records({"new": [0.6, 0.6, 0.6], "ort:HEURISTIC-nchw": [1.0, 1.0, 1.0], "ort:HEURISTIC-nhwc": [1.0, 1.0, 1.0],
                          "ort:EXHAUSTIVE-nchw": [1.5, 1.5, 1.5]}),
    }
    lines = fresh_ab.targets(records)
    assert lines[0].startswith("a.b1") and "0.95x ONNX Runtime HEURISTIC (0.950 s, HEURISTIC-nhwc)" in lines[0]
    assert "0.45x ONNX Runtime EXHAUSTIVE (2.000 s, EXHAUSTIVE-nchw)" in lines[0]
    # 0.45x and 0.40x: geometric mean 0.42x
    assert lines[-1] == ("new: at or below ONNX Runtime HEURISTIC in every case: met (2 of 2); "
                         "at most 0.5x EXHAUSTIVE, geometric mean: met (0.42x)")
    records["b.b1"]["new"] = _records({"x": [1.1, 1.1, None]})["x"]  # above HEURISTIC, one failure
    assert fresh_ab.targets(records)[-1] == ("new: at or below ONNX Runtime HEURISTIC in every case: not met (1 of 2); "
                                             "at most 0.5x EXHAUSTIVE, geometric mean: not met (0.57x)")
    records["b.b1"]["ort:EXHAUSTIVE-nchw"] = _records({"x": [None]})["x"]  # EXHAUSTIVE failed there: HEURISTIC still judged
    lines = fresh_ab.targets(records)
    assert "1.10x ONNX Runtime HEURISTIC" in lines[1] and "EXHAUSTIVE not measured (no successful run of EXHAUSTIVE)" in lines[1]
    assert lines[-1] == ("new: at or below ONNX Runtime HEURISTIC in every case: not met (1 of 2); "
                         "at most 0.5x EXHAUSTIVE, geometric mean: not met (0.45x, 1 case(s) not measured)")
    assert fresh_ab.targets({"a.b1": _records({"old": [1.0], "new": [1.0]})}) == []  # no ONNX Runtime: no verdicts


def test_only_the_searches_that_ran_are_judged_and_a_tree_without_a_run_still_gets_its_verdict():
    records = {"a.b1": _records({"old": [None], "new": [0.9], "ort:HEURISTIC-nchw": [1.0]})}
    lines = fresh_ab.targets(records)
    assert lines == [
        "a.b1                     old                 no successful run: HEURISTIC not measured (no successful run of this tree)",
        "old: at or below ONNX Runtime HEURISTIC in every case: not met (0 of 0, 1 case(s) not measured)",
        "a.b1                     new                 0.900 s: 0.90x ONNX Runtime HEURISTIC (1.000 s, HEURISTIC-nchw)",
        "new: at or below ONNX Runtime HEURISTIC in every case: met (1 of 1)",
    ]


def test_the_command_line_refuses_a_tree_named_like_onnx_runtime_and_a_repeated_configuration(tmp_path, case):
    name, model, inputs = case
    spec = f"{name}={model},{inputs},{model}"
    for argv in (["--tree", f"ort:x={REPO}", "--ort", "HEURISTIC-nchw", "--case", spec],
                 ["--tree", f"new={REPO}", "--ort", "HEURISTIC-nchw", "--ort", "HEURISTIC-nchw", "--case", spec]):
        with pytest.raises(SystemExit, match="each --ort is given once"):
            fresh_ab.main(argv)
    with pytest.raises(SystemExit, match="--ort needs the original model"):
        fresh_ab.main(["--tree", f"new={REPO}", "--ort", "HEURISTIC-nchw", "--case", f"{name}={model},{inputs}"])


def test_the_table_says_when_a_child_compiled_kernels_at_start_up():
    records = {"a.b1": {"new": [fresh.record("ok", parts={"total_s": 1.0}, compilations=3), fresh.record("ok", parts={"total_s": 1.2}, compilations=0)]}}
    assert fresh_ab.table(records)[0].endswith("runs [1.000, 1.200]  3 run-time compilation(s)")
    records["a.b1"]["new"][0]["compilations"] = 0
    assert fresh_ab.table(records)[0].endswith("runs [1.000, 1.200]")

"""The comparison behind benchmarks/fleet_scaling.py's report, on the recorded H200 runs: decisions
of one run re-timed on another run's clock (the tuner's run-to-run noise)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import recorded
from conftest import REPO, benchmark_script
from recorded import H200

from convpass.core.problem import ConvProblem, ProblemKey
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement

fleet_scaling = benchmark_script("fleet_scaling")


OPTIONS = fleet_scaling.tune_options()


def _decisions(run: str) -> dict:
    """(device, problem) -> Decision: each recorded run's fastest configuration (bare convs)."""
    out = {}
    for shape, rows in recorded.recorded_rows(run).items():
        best = min(rows, key=lambda m: m.time_ms)
        problem = ConvProblem((shape,))
        out[(str(H200), str(problem))] = fleet_scaling.Decision(problem, str(best.key), best.algo)
    return out


@pytest.fixture(scope="module")
def oracle_clock(tmp_path_factory):
    path = tmp_path_factory.mktemp("clock") / "oracle.db"
    with TuningCache(path) as c:
        c.put(H200, [m for rows in recorded.recorded_rows("oracle").values() for m in rows])
    return fleet_scaling.clock_of(path, str(H200))


def test_clock_holds_every_recorded_time(oracle_clock):
    rows = recorded.recorded_rows("oracle")
    assert len(oracle_clock) == len(rows) == 208
    for shape, ms in rows.items():
        assert {(str(m.key), m.algo): m.time_ms for m in oracle_clock[str(shape)]} == {(str(m.key), m.algo): m.time_ms for m in ms}


def test_run_to_run_noise_of_the_recorded_runs(oracle_clock):
    """The tuning run's choices timed by the independent oracle run, as computed from the results
    files directly: the noise a 2-GPU run's decisions are held to."""
    tuning, oracle = _decisions("tuning"), _decisions("oracle")
    result = fleet_scaling.compare(tuning, oracle, oracle_clock, OPTIONS)
    firsts = {}
    for path in recorded.RESULTS:
        for r in json.loads(path.read_text()):
            for shape, d in r["detail"].items():
                firsts.setdefault(shape, d["chosen_ms_oracle_run"] / d["oracle_ms"])
    expected = sorted(firsts.values())
    noise = result["a_vs_best"]
    assert noise["problems"] == 208
    assert noise["within_3pct"] == sum(r <= 1.03 for r in expected)
    assert noise["max"] == pytest.approx(expected[-1], abs=1e-4)
    assert result["b_vs_best"] == {"problems": 208, "within_3pct": 208, "median": 1.0, "p95": 1.0, "max": 1.0}
    # the oracle's choices are never slower than the tuning run's on the oracle's own clock
    assert result["b_vs_a"]["max"] <= 1.0 and result["b_vs_a"]["within_3pct"] == 208
    assert result["same_choice"] == sum((tuning[k].key, tuning[k].row) == (oracle[k].key, oracle[k].row) for k in tuning)
    assert [w["ratio"] for w in result["worst_b_vs_a"]] == sorted((w["ratio"] for w in result["worst_b_vs_a"]), reverse=True)


def test_identical_runs_compare_equal_and_unknown_decisions_are_left_out(oracle_clock):
    tuning = _decisions("tuning")
    unknown = ConvProblem((ProblemKey.parse("fwd|n=7|c=1|k=1|in=7x7|ker=1x1|pad=0x0|str=1x1|dil=1x1|g=1|float32|nchw|default").shape,))
    extra = {**tuning, ("x", str(unknown)): fleet_scaling.Decision(unknown, str(unknown.primary) + "|nchw|default", "gemm")}
    result = fleet_scaling.compare(tuning, extra, oracle_clock, OPTIONS)
    assert result["decided"] == {"a": 208, "b": 209, "retimed_both": 208}
    assert result["b_vs_a"]["within_3pct"] == 208 and result["b_vs_a"]["max"] == 1.0


def _bias_problem(times: dict[str, float]) -> tuple[ConvProblem, list[Measurement]]:
    """One problem with a bias epilogue and rows named as the tuner names them (``times``: row name
    -> ms): bare algorithms, their fused calls (``<algo>+bias``) and the epilogue's own pass (``pass``)."""
    key = ProblemKey.parse("fwd|n=1|c=64|k=256|in=56x56|ker=1x1|pad=0x0|str=1x1|dil=1x1|g=1|float32|nchw|default")
    rows = [Measurement(key, "bias" if name == "pass" else name, "ok", ms, 0, True, 0.0, method="epilogue" if name == "pass" else "measure")
            for name, ms in times.items()]
    return ConvProblem((key.shape,), "bias"), rows


def test_a_decision_is_retimed_as_the_step_it_runs(oracle_clock):
    """A fused call is its own row; an unfused configuration is its row plus the epilogue's pass;
    the best is what the tuner decides from the clock. (The bare row of a fused decision read
    alone made a 2-GPU run look 1.70x off on the H200: the +bias call costs 8.1 us in both math
    modes, the bare TF32 conv 4.7 us.)"""
    problem, rows = _bias_problem({"implicit_precomp_gemm": 0.0047, "implicit_precomp_gemm+bias": 0.0081, "gemm": 0.0050, "pass": 0.0040})
    clock = {str(problem.primary): rows}
    key = str(rows[0].key)
    fused = fleet_scaling.Decision(problem, key, "implicit_precomp_gemm+bias")
    bare = fleet_scaling.Decision(problem, key, "implicit_precomp_gemm")
    other = fleet_scaling.Decision(problem, key, "gemm")
    got = fleet_scaling.retimed({"fused": fused, "bare": bare, "other": other}, clock, OPTIONS)
    assert got["fused"] == {"time_ms": 0.0081, "best_ms": 0.0081}
    assert got["bare"]["time_ms"] == pytest.approx(0.0087) and got["other"]["time_ms"] == pytest.approx(0.0090)
    result = fleet_scaling.compare({"p": fused}, {"p": bare}, clock, OPTIONS)
    assert result["b_vs_a"]["max"] == pytest.approx(0.0087 / 0.0081, abs=1e-4) and result["same_choice"] == 0


def _clock(problem: ConvProblem, rows: list[Measurement], **times: float) -> dict:
    """``rows`` as one clock, with the times of the rows named in ``times`` (``pass``: the epilogue)."""
    named = {("pass" if m.method == "epilogue" else m.algo): m for m in rows}
    return {str(problem.primary): [dataclasses.replace(m, time_ms=times.get(n, m.time_ms)) for n, m in named.items()]}


def test_the_median_clock_takes_each_configurations_median_time():
    problem, rows = _bias_problem({"implicit_precomp_gemm": 0.0047, "implicit_precomp_gemm+bias": 0.0081, "gemm": 0.0050, "pass": 0.0040})
    clocks = [_clock(problem, rows), _clock(problem, rows, gemm=0.0060), _clock(problem, rows[:1], implicit_precomp_gemm=0.0049)]
    merged = {(m.algo, m.method): m for m in fleet_scaling.median_clock(clocks)[str(problem.primary)]}
    assert len(merged) == 4
    assert merged[("implicit_precomp_gemm", "measure")].time_ms == pytest.approx(0.0047)  # 0.0047, 0.0047, 0.0049
    assert merged[("gemm", "measure")].time_ms == pytest.approx(0.0055)  # two clocks: their mean
    assert merged[("implicit_precomp_gemm+bias", "measure")].time_ms == pytest.approx(0.0081)
    assert merged[("gemm", "measure")].note == "median of 2 clocks: 0.00500, 0.00600"
    # an early-stopped estimate counts only where no clock measured the configuration
    estimate = {str(problem.primary): [dataclasses.replace(m, time_ms=0.0100, note="early stop: estimate over 1.5x the best") for m in rows]}
    merged = {(m.algo, m.method): m for m in fleet_scaling.median_clock([*clocks, estimate])[str(problem.primary)]}
    assert merged[("gemm", "measure")].time_ms == pytest.approx(0.0055)
    assert fleet_scaling.median_clock([estimate])[str(problem.primary)][0].time_ms == 0.0100


def test_one_clock_reading_high_flips_a_near_tie_and_the_median_clock_does_not():
    """A fused call and the bare conv + its pass 1% apart: a single clock on which the fused call read
    8% high (as r3d_18's 3-D convs did between two H200 runs) puts the fused decision 7% off; the
    median of three clocks puts it where it is, and the spread says how far one clock was off."""
    problem, rows = _bias_problem({"implicit_precomp_gemm": 0.0047, "implicit_precomp_gemm+bias": 0.0087, "pass": 0.0041})
    key = str(rows[0].key)
    fused = {"p": fleet_scaling.Decision(problem, key, "implicit_precomp_gemm+bias")}
    bare = {"p": fleet_scaling.Decision(problem, key, "implicit_precomp_gemm")}
    high = _clock(problem, rows, **{"implicit_precomp_gemm+bias": 0.0087 * 1.08})
    clocks = [high, _clock(problem, rows), _clock(problem, rows, implicit_precomp_gemm=0.00475)]
    assert fleet_scaling.compare(bare, fused, high, OPTIONS)["b_vs_a"]["max"] == pytest.approx(1.08 * 0.0087 / 0.0088, abs=1e-4)
    median = fleet_scaling.compare(bare, fused, fleet_scaling.median_clock(clocks), OPTIONS)["b_vs_a"]
    assert median["within_3pct"] == 1 and median["max"] == pytest.approx(0.0087 / 0.0088, abs=1e-4)
    assert fleet_scaling.differing(bare, fused) == [bare["p"]] and fleet_scaling.differing(bare, bare) == []
    other_pass = Measurement(rows[0].key, "bias+relu", "ok", 0.0020, 0, True, 0.0, method="epilogue")  # another problem's pass
    clocks[1][str(problem.primary)].append(other_pass)
    clocks[2][str(problem.primary)].append(dataclasses.replace(other_pass, time_ms=0.0040))
    spread = fleet_scaling.clock_spread([bare["p"], fused["p"]], clocks)
    # the bare row (0.0047 / 0.00475), the fused call (1.08x) and its problem's pass (1.0x)
    assert spread["problems"] == 3 and spread["max"] == pytest.approx(1.08, abs=1e-4)


def test_decisions_are_read_from_tuned_models():
    got = fleet_scaling.decisions_of([REPO / "tests" / "data" / "schema1-resnet-stem.tuned.onnx"], OPTIONS)
    assert len(got) == 4 and {device for device, _ in got} == {str(H200)}
    d = next(d for d in got.values() if str(d.problem.primary) == "fwd|n=1|c=3|k=64|in=224x224|ker=7x7|pad=3x3|str=2x2|dil=1x1|g=1|float32")
    assert d.key.endswith("|nhwc|default") and d.row == "implicit_precomp_gemm"


def test_report_reads_the_phases_it_is_given(tmp_path, capsys):
    """The device script's report on runs made here with recorded measurements (replayed, so the
    wall times are this machine's, not a GPU's): the plumbing, not the targets."""
    from rich.console import Console

    from convpass.core.options import TuneOptions
    from convpass.fleet import driver
    from convpass.fleet import models as fleet_models
    from convpass.fleet.local import LocalExecutor
    from convpass.fleet.measurers import RecordedMeasurer

    source = tmp_path / "recorded.db"
    with TuningCache(source) as c:
        c.put(H200, [m for rows in recorded.recorded_rows("oracle").values() for m in rows])
    models = [recorded.save(recorded.resnet_stem(), tmp_path, "resnet_stem"), recorded.save(recorded.inverted_residual(), tmp_path, "ir")]
    specs, _ = fleet_models.specs_from_batches(models, ["1,32"])
    work = tmp_path / "work"
    for name, workers in (("one", 1), ("two", 2), ("retime", 1)):
        (work / name).mkdir(parents=True)
        report = driver.tune(specs, work / name, TuneOptions(layout="per-conv"), cluster=LocalExecutor(workers=workers),
                             cache=work / f"{name}.db", measurer=RecordedMeasurer(source, H200), console=Console(quiet=True))
        (work / f"{name}.json").write_text(json.dumps({"name": name, "gpus": "-", "cluster": "local",
                                                       "wall_s": report.seconds["total"], "summary": report.to_json()}))
    assert fleet_scaling.main(["report", "--work", str(work), "--out", str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "fleet-check.json").read_text())
    assert doc["wall"]["problems"] == 14 and set(doc["runs"]) == {"one", "two", "retime"}
    wall = doc["wall"]  # against the faster of the two 1-GPU runs
    assert set(wall["ratio_per_run"]) == {"one", "retime"} and wall["ratio"] == max(wall["ratio_per_run"].values())
    assert doc["decisions"]["b_vs_a"] == {"problems": 14, "within_3pct": 14, "median": 1.0, "p95": 1.0, "max": 1.0}
    printed = capsys.readouterr().out
    assert "2-GPU within 3% of 1-GPU on 14/14" in printed
    assert re.search(r"two: wall .* GPU busy in tuning: proc0 [0-9.]+ s \(\d+%\), proc1", printed)
    assert re.search(r"seconds of the problems' tasks, depthwise / others: one 0\.0 / [0-9.]+, two 0\.0 / [0-9.]+, retime", printed)
    assert len(doc["runs"]["one"]["summary"]["task_seconds"]) == 14 and printed.count("    one ") == 5
    assert "decisions_median_clock" not in doc

    # after a reclock phase (made here from the retime run's cache: no GPU), the median clock's line
    import shutil

    for r in range(2):
        shutil.copy(work / "retime.db", work / f"reclock-{r}.db")
    (work / "reclock.json").write_text(json.dumps({"rounds": 2, "problems": [], "seconds": 0.5}))
    assert fleet_scaling.main(["report", "--work", str(work), "--out", str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "fleet-check.json").read_text())
    median = doc["decisions_median_clock"]
    assert median["clocks"] == 3 and median["b_vs_a"]["within_3pct"] == 14 and median["clock_spread"] == {"problems": 0}
    assert "the same on the median of 3 clocks (the retime run and 2 re-measurements of the 0 problems" in capsys.readouterr().out


def test_reclock_before_the_runs_it_needs_says_which(tmp_path):
    with pytest.raises(SystemExit, match=r"retime\.json is missing: run the 'retime' phase first"):
        fleet_scaling.main(["reclock", "--work", str(tmp_path)])

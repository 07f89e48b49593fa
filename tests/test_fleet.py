"""Fleet tuning on CPU: problem collection across models and profiles, the scheduler's bookkeeping
through the local executor's worker processes (retries, lost workers, timeouts, interrupt and
resume), models written while the workers measure, several device types in one model, and the
``tune`` command.

Workers replay recorded H200 measurements (tests/recorded.py) through ``RecordedMeasurer``, the
cache-only decision path; nothing is timed and no timing is made up.
"""

from __future__ import annotations

import json
import multiprocessing
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
import recorded
from conftest import REPO, conv_model
from fleet_faults import HangsOnce, KilledMidTask, NotStarting, ReplayPerGpu, SlowReplay, SlowStart
from recorded import H200, H200_TUNING_RUN
from rich.console import Console

import convpass
from convpass.cli.main import main
from convpass.core import annotation
from convpass.core.options import TuneOptions
from convpass.core.problem import ProblemKey
from convpass.fleet import driver
from convpass.fleet import models as fleet_models
from convpass.fleet import report as fleet_report
from convpass.fleet.local import LocalExecutor
from convpass.fleet.measurers import RecordedMeasurer
from convpass.fleet.model_procs import ModelProcessError, ModelProcesses, ModelSpec, prepare
from convpass.tuning.cache import TuningCache
from convpass.tuning.decide import select

OPTIONS = TuneOptions(layout="per-conv")
MODELS = ("resnet_stem", "resnet_block", "inverted_residual", "resnet_unrecorded")
RECORDED_PROBLEMS = 16  # of the 18 distinct problems; resnet_unrecorded's 64->48 conv (b1, b32) was never measured


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The recorded runs in one cache (the H200's oracle run; its tuning run as a second device) and the models."""
    root = tmp_path_factory.mktemp("fleet")
    with TuningCache(root / "recorded.db") as c:
        c.put(H200, [m for rows in recorded.recorded_rows("oracle").values() for m in rows])
        c.put(H200_TUNING_RUN, [m for rows in recorded.recorded_rows("tuning").values() for m in rows])
    paths = [recorded.save(getattr(recorded, name)(), root, name) for name in MODELS]
    specs = fleet_models.specs_with_batches(paths, ["1,32"])  # as the command line: resolved when collected
    assert [s.batches for s in specs] == [(1, 32)] * 4
    return {"root": root, "recorded": root / "recorded.db", "paths": paths, "specs": specs}


def _tune(lab, tmp_path, measurer=None, workers=2, executor=None, specs=None, **kw):
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    return driver.tune(
        specs or lab["specs"], out, OPTIONS,
        cluster=executor or LocalExecutor(workers=workers),
        cache=tmp_path / "driver.db",
        measurer=measurer or RecordedMeasurer(lab["recorded"], H200),
        console=Console(quiet=True),
        **kw,
    )


def _decisions(paths, device=None):
    """(node, profile) -> (algo, memory format, math, time, source) of every written model."""
    out = {}
    for path in paths:
        info, nodes = annotation.read_annotations(onnx.load(path), device=device)
        for n in nodes:
            for i, d in enumerate(n.decisions):
                out[(Path(path).name, n.node_name, i)] = (d.algo, d.memory_format, d.math_mode, d.time_ms, d.source, d.problem_key)
    return out


def _recorded_choice(problem_key: str, run: str):
    """The configuration select() picks from one recorded run for the problem of a decision."""
    shape = ProblemKey.parse(problem_key).shape
    from convpass.core.problem import ConvProblem

    chosen = select(recorded.recorded_rows(run)[shape], ConvProblem((shape,)), OPTIONS)
    return str(chosen.key), chosen.algo


def _stored(cache_path, device=H200):
    """The driver cache's rows for every recorded geometry (shape -> rows), where it has any."""
    with TuningCache(cache_path) as c:
        found = {shape: c.get(device, shape) for shape in recorded.recorded_rows("oracle")}
    return {shape: rows for shape, rows in found.items() if rows}


def _check_decisions(written, run="oracle", device=None):
    """Every decision is the recorded run's best configuration; resnet_unrecorded's 64->48 conv is auto."""
    decisions = _decisions(written, device)
    auto = {k for k, d in decisions.items() if d[0] == "auto"}
    assert auto == {("resnet_unrecorded.tuned.onnx", "conv2", 0), ("resnet_unrecorded.tuned.onnx", "conv2", 1)}
    assert all(decisions[k][4] == "auto" for k in auto)
    for key, (algo, _, _, time_ms, _, problem_key) in decisions.items():
        if key not in auto:
            assert (problem_key, algo) == _recorded_choice(problem_key, run) and time_ms > 0, key
    return decisions


def _check_nothing_lost(doc, cache_path):
    """Every recorded problem measured and written exactly once; only the unrecorded ones failed."""
    assert doc["missing"] == [] and doc["measured"] == RECORDED_PROBLEMS
    assert doc["cache_writes"] == {"tasks": RECORDED_PROBLEMS, "max_per_task": 1}
    assert sorted("|k=48|" in f["problem"] for f in doc["failed"]) == [True, True]
    stored = _stored(cache_path)
    oracle = recorded.recorded_rows("oracle")
    assert len(stored) == RECORDED_PROBLEMS
    assert all(sorted(rows, key=repr) == sorted(oracle[shape], key=repr) for shape, rows in stored.items())


# ------------------------------------------------------------------------------------------------
# collection


def test_problems_are_collected_once_across_models_and_profiles(lab, tmp_path):
    models, distinct = fleet_models.collect(lab["specs"], OPTIONS, tmp_path)
    assert [len(m.problems) for m in models] == [8, 8, 6, 4]
    stem, block = set(models[0].problems), set(models[1].problems)
    assert len(stem & block) == 6  # 1x1 64->64, 3x3 64->64, 1x1 64->256 at batch 1 and 32
    assert len(distinct) == 18 and len(set(distinct)) == 18
    assert distinct[:8] == models[0].problems  # first seen, first listed
    assert [m.output.name for m in models] == [f"{n}.tuned.onnx" for n in MODELS]
    same_twice = ModelSpec(lab["paths"][0], ("input=1x3x224x224", "input=1x3x224x224"))
    models, distinct = fleet_models.collect([same_twice], OPTIONS, tmp_path)
    assert len(models[0].report.profiles) == 2 and len(distinct) == 4


def test_problems_are_tuned_model_by_model_largest_first(lab, tmp_path):
    models, distinct = fleet_models.collect(lab["specs"], OPTIONS, tmp_path)
    order = fleet_models.tuning_order(models)
    assert sorted(order, key=distinct.index) == distinct
    flops = [p.primary.flops for p in order]
    start = 0
    for m in models:  # each model's new problems, after those of the models before it
        new = [p for p in m.problems if p not in order[:start]]
        assert set(order[start:start + len(new)]) == set(new)
        assert flops[start:start + len(new)] == sorted(flops[start:start + len(new)], reverse=True)
        start += len(new)
    assert start == len(order) == 18
    # the model that completes last (the last to bring new problems) stays prepared for its write
    assert [m.prepared is not None for m in models] == [False, False, False, True]
    assert set(models[3].prepared[1]) == set(models[3].problems)


def test_batches_follow_each_models_inputs(tmp_path):
    dynamic = tmp_path / "dyn.onnx"
    onnx.save(conv_model("Conv", ["N", 3, 8, 8], (4, 3, 3, 3)), dynamic)
    fixed = tmp_path / "fixed.onnx"
    onnx.save(conv_model("Conv", [1, 3, 8, 8], (4, 3, 3, 3)), fixed)
    specs, notes = fleet_models.specs_from_batches([dynamic, fixed], ["1,32", "dyn=2"])
    assert [s.shapes for s in specs] == [("x=2x3x8x8",), ("x=1x3x8x8",)]
    assert notes == ["fixed.onnx: batch 32 left out: input 'x' has a fixed batch of 1, not 32"]
    with pytest.raises(convpass.core.errors.ConvpassError, match="none of the batch sizes"):
        fleet_models.specs_from_batches([fixed], ["8"])
    with pytest.raises(convpass.core.errors.ConvpassError, match="not given: other"):
        fleet_models.specs_from_batches([fixed], ["other=1"])
    # tune resolves them when it collects each model (in a model process), with the same result
    lazy = fleet_models.specs_with_batches([dynamic, fixed], ["1,32", "dyn=2"])
    assert [(s.shapes, s.batches) for s in lazy] == [((), (2,)), ((), (1, 32))]
    assert [prepare(s, OPTIONS)[3:] for s in lazy] == [(("x=2x3x8x8",), []), (("x=1x3x8x8",), notes)]
    with pytest.raises(convpass.core.errors.ConvpassError, match="none of the batch sizes"):
        prepare(fleet_models.specs_with_batches([fixed], ["8"])[0], OPTIONS)
    with pytest.raises(convpass.core.errors.ConvpassError, match="nowhere.onnx: no such file"):
        fleet_models.specs_with_batches([tmp_path / "nowhere.onnx"], ["1"])


# ------------------------------------------------------------------------------------------------
# bookkeeping through worker processes


def test_each_problem_is_measured_once_and_every_model_written(lab, tmp_path):
    report = _tune(lab, tmp_path)
    doc = report.to_json()
    assert doc["problems"] == 18 and doc["tasks"] == 18 and doc["cached"] == 0
    assert [s["id"] for s in doc["slots"]] == ["proc0", "proc1"] and all(doc["measured_by_slot"].values())
    assert set(doc["busy_s_by_slot"]) == {"proc0", "proc1"}  # each slot's time holding tasks, within the tuning span
    assert all(0 < b <= doc["seconds"]["tune"] + 0.002 for b in doc["busy_s_by_slot"].values())  # (rounded to ms)
    timed = doc["task_seconds"]  # per finished problem, its measuring attempt's time (the failed ones have none)
    assert len(timed) == doc["measured"] and all(t["slot"] in ("proc0", "proc1") and t["seconds"] > 0 for t in timed)
    depthwise = {t["problem"].split(" ")[0] for t in timed if t["depthwise"]}  # inverted_residual's 3x3 convs, g == c
    assert depthwise and all(re.search(r"\|c=(\d+)\|.*\|g=\1\|", p) for p in depthwise)
    assert all(re.search(r"\|g=1\|", t["problem"]) for t in timed if not t["depthwise"])
    assert sum(t["seconds"] for t in timed) <= sum(doc["busy_s_by_slot"].values()) + 0.02
    _check_nothing_lost(doc, tmp_path / "driver.db")
    (f1, f2) = doc["failed"]
    assert f1["attempts"] == f2["attempts"] == 3  # 1 + --retries 2
    assert all("no measurement of" in r and "recorded in" in r for r in f1["reasons"])
    assert doc["workers_lost"] == [] and doc["retried"] == 4
    written = [tmp_path / "out" / f"{n}.tuned.onnx" for n in MODELS]
    assert [Path(m["output"]) for m in doc["models"]] == written
    decisions = _check_decisions(written)
    assert {d[4] for d in decisions.values()} == {"measure", "auto"}
    for m in doc["models"]:
        onnx.checker.check_model(onnx.load(m["output"]), full_check=True)


def test_one_worker_and_two_workers_decide_the_same(lab, tmp_path):
    one = _tune(lab, tmp_path / "one", workers=1)
    two = _tune(lab, tmp_path / "two", workers=2)
    assert one.to_json()["measured_by_slot"] == {"proc0": RECORDED_PROBLEMS}
    assert _decisions(one.written) == _decisions(two.written)
    assert _stored(tmp_path / "one" / "driver.db") == _stored(tmp_path / "two" / "driver.db")


def test_a_worker_killed_mid_task_loses_nothing(lab, tmp_path):
    report = _tune(lab, tmp_path, KilledMidTask(lab["recorded"], H200, tmp_path / "killed", nth=3))
    doc = report.to_json()
    (lost,) = doc["workers_lost"]
    assert "killed by SIGKILL" in lost["reason"]
    _check_nothing_lost(doc, tmp_path / "driver.db")
    (retried,) = doc["retries"]  # the problem the dead worker held, measured by a later attempt
    assert retried["attempts"] == 2 and "lost: worker process was killed by SIGKILL" in retried["reasons"][0]
    assert len(doc["slots"]) == 2 and doc["slots_retired"] == {}
    _check_decisions(report.written)


def test_a_broken_gpu_is_retired_and_its_problems_run_on_the_others(lab, tmp_path):
    measurer = ReplayPerGpu(lab["recorded"], {"0": H200, "1": H200}, broken=("1",))
    doc = _tune(lab, tmp_path, measurer, executor=LocalExecutor(gpus=["0", "1"])).to_json()
    assert [s["where"].split(",")[0] for s in doc["slots"]] == ["GPU 0 of this host", "GPU 1 of this host"]
    assert [w["slot"] for w in doc["workers_lost"]] == ["gpu1"] * 3
    assert "lost 3 workers in a row" in doc["slots_retired"]["gpu1"]
    assert set(doc["busy_s_by_slot"]) == {"gpu0", "gpu1"}  # a lost worker's task counts as busy time too
    assert doc["measured_by_slot"] == {"gpu0": RECORDED_PROBLEMS}
    _check_nothing_lost(doc, tmp_path / "driver.db")


def test_a_hung_problem_times_out_and_runs_again(lab, tmp_path):
    doc = _tune(lab, tmp_path, HangsOnce(lab["recorded"], H200, tmp_path / "hung", n=32), task_timeout=1.0).to_json()
    (lost,) = doc["workers_lost"]
    assert "ran over --task-timeout 1 s" in lost["reason"] and "n=32" in lost["reason"]
    _check_nothing_lost(doc, tmp_path / "driver.db")


def test_an_interrupted_driver_keeps_what_was_measured_and_a_rerun_measures_the_rest(lab, tmp_path):
    def interrupt_after_five(progress):
        if progress.finished >= 5:
            raise KeyboardInterrupt

    first = _tune(lab, tmp_path, on_progress=interrupt_after_five)
    doc = first.to_json()
    assert first.interrupted and doc["interrupted"] and first.written == []
    assert not list((tmp_path / "out").iterdir())  # no model, not even half of one
    kept = doc["measured"]
    # under load the interrupt can come before the last model's problems are collected: then its
    # tasks do not exist yet, and the model says so
    collected = [m for m in doc["models"] if m["collected"]]
    assert kept >= 5 and len(doc["missing"]) == doc["tasks"] - kept - len(doc["failed"])
    assert doc["tasks"] == 18 or len(collected) < len(MODELS)
    assert len(_stored(tmp_path / "driver.db")) == kept
    again = _tune(lab, tmp_path).to_json()
    assert again["cached"] == kept and again["measured"] == RECORDED_PROBLEMS - kept
    assert again["missing"] == [] and len(again["failed"]) == 2
    resumed = _check_decisions([tmp_path / "out" / f"{n}.tuned.onnx" for n in MODELS])
    # measured before the interrupt or after: a decision names the strategy that took it, and the
    # models are those of a run that was never interrupted, byte for byte
    assert {v[4] for v in resumed.values() if v[0] != "auto"} == {"measure"}
    _tune(lab, tmp_path / "whole")
    for n in MODELS:
        assert (tmp_path / "out" / f"{n}.tuned.onnx").read_bytes() == (tmp_path / "whole" / "out" / f"{n}.tuned.onnx").read_bytes()


def _wait_for(path: Path, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return path.exists()


def test_a_model_is_written_as_soon_as_its_problems_are_settled(lab, tmp_path):
    stem = tmp_path / "out" / "resnet_stem.tuned.onnx"
    seen = []

    def wait_for_the_stem(progress):
        # one worker settles tasks in order: the stem's 8 problems first, 0.1 s each. Once every model
        # is collected (the total is known), no model process is busy: the driver's thread waits
        # here, so no further task settles while the stem is written.
        if progress.finished >= 8 and progress.total == 18 and not seen:
            seen.append((_wait_for(stem), progress.finished + progress.failed < progress.total))

    report = _tune(lab, tmp_path, SlowReplay(lab["recorded"], H200, 0.1), workers=1, on_progress=wait_for_the_stem)
    doc = report.to_json()
    assert seen == [(True, True)]  # written while 10 tasks were still to run
    assert report.written[0] == stem and doc["written_during_tune"] >= 1
    assert sorted(report.written) == sorted(tmp_path / "out" / f"{n}.tuned.onnx" for n in MODELS)
    assert all(m.prepared is None for m in report.models)
    _check_nothing_lost(doc, tmp_path / "driver.db")
    _check_decisions(report.written)  # the failed problems of resnet_unrecorded are auto
    assert set(doc["seconds"]) == {"workers", "first_model", "collect", "first_task", "tune", "write", "total"}
    sec = doc["seconds"]
    assert sec["first_model"] <= sec["collect"] <= sec["total"] and sec["first_task"] + sec["tune"] + sec["write"] <= sec["total"]
    console = Console(record=True, width=400)
    fleet_report.print_report(report, console)
    assert f"; {doc['written_during_tune']} of 4 model(s) written while tuning" in console.export_text()


def test_an_interrupt_after_a_model_was_written_says_which_were_written(lab, tmp_path):
    out = tmp_path / "out"
    stem = out / "resnet_stem.tuned.onnx"

    def interrupt_once_the_stem_is_written(progress):
        # as above: the stem's 8 problems first, 0.1 s each, and every model collected by then
        if progress.finished == 8 and progress.total == 18 and _wait_for(stem):
            raise KeyboardInterrupt

    first = _tune(lab, tmp_path, SlowReplay(lab["recorded"], H200, 0.1), workers=1, on_progress=interrupt_once_the_stem_is_written)
    doc = first.to_json()
    assert first.interrupted and first.written == [stem] and doc["written_during_tune"] == 1
    assert [m["output"] for m in doc["models"]] == [str(stem), None, None, None]
    assert [p.name for p in out.iterdir()] == [stem.name]  # nothing else, not even half a model
    assert doc["measured"] == 8 and len(doc["missing"]) == 10
    for key, d in _decisions([stem]).items():  # written from its complete measurements only
        assert (d[5], d[0]) == _recorded_choice(d[5], "oracle") and d[4] == "measure", key
    console = Console(record=True, width=400)
    fleet_report.print_report(first, console)
    text = console.export_text()
    assert f"wrote {stem}" in text
    assert "1 model(s) complete before the interrupt were written (above); not written: " + ", ".join(map(str, lab["paths"][1:])) in text
    again = _tune(lab, tmp_path).to_json()
    assert again["cached"] == 8 and again["measured"] == RECORDED_PROBLEMS - 8 and not again["interrupted"]
    _check_decisions([out / f"{n}.tuned.onnx" for n in MODELS])


def test_a_model_that_cannot_be_written_stops_the_run(lab, tmp_path):
    def remove_the_output_dir(progress):
        if progress.finished == 1:
            shutil.rmtree(tmp_path / "out", ignore_errors=True)

    with pytest.raises(convpass.core.errors.ConvpassError, match="output directory .* does not exist"):
        _tune(lab, tmp_path, workers=1, on_progress=remove_the_output_dir)
    assert multiprocessing.active_children() == []
    assert len(_stored(tmp_path / "driver.db")) >= 8  # what was measured stays


def test_a_model_that_cannot_be_prepared_stops_the_workers_while_they_start(lab, tmp_path):
    bad = tmp_path / "dynamic.onnx"
    onnx.save(conv_model("Conv", ["N", 3, 8, 8], (4, 3, 3, 3)), bad)
    (tmp_path / "out").mkdir()
    executor = LocalExecutor(workers=2)
    started = time.monotonic()
    with pytest.raises(convpass.core.errors.ShapeError, match=f"^{bad}: Conv 'conv': dim 0 of its input 'x' is 'N'"):
        driver.tune([*lab["specs"], ModelSpec(bad)], tmp_path / "out", OPTIONS, cluster=executor,
                    cache=tmp_path / "driver.db", measurer=SlowStart(lab["recorded"], H200), console=Console(quiet=True))
    assert time.monotonic() - started < 30  # the workers were stopped while starting (their start takes 60 s)
    assert len(executor._procs) == 2 and multiprocessing.active_children() == []
    assert not list((tmp_path / "out").iterdir()) and not (tmp_path / "driver.db").exists()


def test_workers_that_do_not_start_are_reported(lab, tmp_path):
    with pytest.raises(convpass.core.errors.ConvpassError, match="no worker started.*CUDA_ERROR_NO_DEVICE"):
        _tune(lab, tmp_path, NotStarting(lab["recorded"], H200))


# ------------------------------------------------------------------------------------------------
# tuning while later models are still being collected


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """``inverted_residual`` with 40,000 Relu nodes after it: its 6 recorded problems, and about 2.5 s
    to prepare (graph passes over every node), during which the models before it are tuned."""
    from onnx import TensorProto, helper

    model = recorded.inverted_residual()
    graph = model.graph
    x = graph.output[0].name
    graph.node.extend(helper.make_node("Relu", [x if i == 0 else f"t{i - 1}"], [f"t{i}"], name=f"tail{i}") for i in range(40_000))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("t39999", TensorProto.FLOAT, ["batch", 80, 14, 14]))
    return recorded.save(model, tmp_path_factory.mktemp("slow"), "slow_tail")


def test_models_are_tuned_while_later_ones_are_collected(lab, tmp_path, slow_model):
    """The stem's problems go to the workers while the slow model is still being collected; the
    models after it, collected meanwhile by the other model process, wait for it (tasks keep the
    model order); a copy of the stem adds no task and is written from the stem's measurements."""
    copy = recorded.save(recorded.resnet_stem(), tmp_path, "stem_copy")
    specs = [lab["specs"][0], ModelSpec(slow_model, batches=(1, 32)), ModelSpec(copy, batches=(1, 32)), lab["specs"][1]]
    seen = []
    report = _tune(lab, tmp_path, specs=specs, model_processes=2, on_progress=lambda p: seen.append((p.finished + p.failed, p.total)))
    doc = report.to_json()
    assert (8, 8) in seen  # every task of the stem settled before anything else was known
    assert sorted({total for _, total in seen} - {0}) == [8, 16]  # then the rest at once: never the block's 2 before the slow model's 6
    assert doc["seconds"]["first_task"] < doc["seconds"]["collect"]
    assert [p for t in report.tasks for p in t.problems] == fleet_models.tuning_order(report.models)  # as if every model had been collected first
    assert doc["tasks"] == doc["measured"] == doc["problems"] == 16 and doc["cache_writes"]["max_per_task"] == 1
    assert [m["problems"] for m in doc["models"]] == [8, 6, 8, 8] and all(m["collected"] for m in doc["models"])
    assert len(report.written) == 4
    stem, twin = (_decisions([tmp_path / "out" / f"{n}.tuned.onnx"]) for n in ("resnet_stem", "stem_copy"))
    assert {k[1:]: v for k, v in stem.items()} == {k[1:]: v for k, v in twin.items()} and len(stem) == 8


def test_a_model_that_cannot_be_prepared_while_others_are_tuned_loses_nothing(lab, tmp_path, slow_model):
    bad = tmp_path / "dynamic.onnx"
    onnx.save(conv_model("Conv", ["N", 3, 8, 8], (4, 3, 3, 3)), bad)
    specs = [lab["specs"][0], ModelSpec(slow_model, batches=(1, 32)), ModelSpec(bad)]
    with pytest.raises(convpass.core.errors.ShapeError) as raised:
        _tune(lab, tmp_path, specs=specs, model_processes=1)
    message = str(raised.value)
    assert message.startswith(f"{bad}: Conv 'conv': dim 0 of its input 'x' is 'N'"), message
    kept = re.search(r"\(the run stopped: the (\d+) problem\(s\) it measured are in the tuning cache (.+); (written: (.+)|no model was written); "
                     r"once fixed, the same command measures only what is missing\)$", message)
    assert kept, message
    assert str(tmp_path / "driver.db") == kept[2]
    assert 8 <= int(kept[1]) <= 14 and len(_stored(tmp_path / "driver.db")) == int(kept[1])  # the tasks running finished
    written = [w for w in (kept[4] or "").split(", ") if w]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(written)
    for name in written:  # complete models only
        onnx.checker.check_model(onnx.load(tmp_path / "out" / name), full_check=True)
    assert multiprocessing.active_children() == []


def test_a_model_process_that_dies_stops_the_run_and_says_so(lab, tmp_path):
    def kill_the_model_process(progress):
        if progress.finished == 1:
            for child in multiprocessing.active_children():
                if child.name == "convpass-model-process":
                    child.kill()

    with pytest.raises(ModelProcessError, match=r"^a model process \(pid \d+\) was killed by SIGKILL.*\(the run stopped: the \d+ problem"):
        _tune(lab, tmp_path, model_processes=1, on_progress=kill_the_model_process)
    assert multiprocessing.active_children() == [] and len(_stored(tmp_path / "driver.db")) >= 1


def test_model_processes_answer_in_order_and_stop(lab, tmp_path):
    procs = ModelProcesses(1, ["a", "b"])
    procs.start()
    try:
        deadline = time.monotonic() + 60
        while not procs.idle() and time.monotonic() < deadline:
            procs.receive(0.05)
        from convpass.fleet.model_procs import CollectJob

        for i in (0, 1):
            procs.submit(0, "collect", i, CollectJob(lab["specs"][i], OPTIONS, str(tmp_path)))
        answers = []
        while len(answers) < 2 and time.monotonic() < deadline:
            answers += procs.receive(0.5)
        assert [(kind, index) for kind, index, _, _ in answers] == [("collected", 0), ("collected", 1)]
        assert [len(a[2].problems) for a in answers] == [8, 8] and answers[0][2].shapes == ("input=1x3x224x224", "input=32x3x224x224")
        assert procs.holder(1) == 0 and procs.holder(0) is None  # it keeps the last model it collected
    finally:
        assert procs.stop() == []
    assert multiprocessing.active_children() == []


# ------------------------------------------------------------------------------------------------
# several device types


def test_a_mixed_cluster_gives_one_model_with_a_table_per_device(lab, tmp_path):
    measurer = ReplayPerGpu(lab["recorded"], {"0": H200, "1": H200_TUNING_RUN})
    report = _tune(lab, tmp_path, measurer, executor=LocalExecutor(gpus=["0", "1"]))
    doc = report.to_json()
    assert report.devices == [H200, H200_TUNING_RUN] and report.cache_only == []
    assert doc["tasks"] == 36 and doc["measured"] == 32 and len(doc["failed"]) == 4
    by_id = {t.id: t for t in report.tasks}
    for task_id, slot in report.schedule.finished.items():
        assert slot == ("gpu0" if by_id[task_id].device == H200 else "gpu1")  # problems go to their own GPU type
    stem = tmp_path / "out" / "resnet_stem.tuned.onnx"
    info = annotation.read_model_info(onnx.load(stem))
    assert info.devices == (str(H200), str(H200_TUNING_RUN))
    for device, run in ((H200, "oracle"), (H200_TUNING_RUN, "tuning")):
        for key, d in _decisions([stem], device=device).items():
            assert (d[5], d[0]) == _recorded_choice(d[5], run), key
    differ = [k for k, d in _decisions([stem], H200).items() if d[:3] != _decisions([stem], H200_TUNING_RUN)[k][:3]]
    assert differ  # the two runs chose differently somewhere: each device reads its own table
    records = convpass.inspect(stem, device="tuning run")
    assert {r["device"] for r in records} == {str(H200_TUNING_RUN)} and len(records) == 8


def test_devices_picks_the_device_types_to_tune(lab, tmp_path):
    measurer = ReplayPerGpu(lab["recorded"], {"0": H200, "1": H200_TUNING_RUN})
    report = _tune(lab, tmp_path, measurer, executor=LocalExecutor(gpus=["0", "1"]), devices=["tuning run"])
    assert report.devices == [H200_TUNING_RUN]
    assert set(report.schedule.finished.values()) == {"gpu1"}
    info = annotation.read_model_info(onnx.load(report.written[0]))
    assert info.devices == (str(H200_TUNING_RUN),)


# ------------------------------------------------------------------------------------------------
# the command line


@pytest.fixture
def no_gpu(monkeypatch):
    """A build machine: the local cluster sees no GPU (even where the tests run on a GPU host)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_merged_caches_give_one_model_for_two_gpus_without_a_gpu(lab, tmp_path, capsys, no_gpu):
    """Caches exported on two GPUs, merged with `convpass cache import`, applied on a GPU-less machine."""
    for device, name in ((H200, "a"), (H200_TUNING_RUN, "b")):
        with TuningCache(lab["recorded"]) as c:
            c.export_json(tmp_path / f"{name}.json", device)
        assert main(["cache", "import", str(tmp_path / f"{name}.json"), "--cache", str(tmp_path / "merged.db")]) == 0
    (tmp_path / "out").mkdir()
    capsys.readouterr()
    code = main(["tune", *map(str, lab["paths"][:2]), "--batch", "1,32", "-o", str(tmp_path / "out"), "--json", "-q",
                 "--devices", f"{H200},tuning run", "--cache", str(tmp_path / "merged.db")])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cache_only_devices"] == [str(H200), str(H200_TUNING_RUN)] and doc["slots"] == []
    assert doc["tasks"] == 0 and doc["measured"] == 0 and doc["failed"] == []
    assert [m["decided"] for m in doc["models"]] == [{str(H200): 8, str(H200_TUNING_RUN): 8}] * 2
    stem = doc["models"][0]["output"]
    for device, run in ((H200, "oracle"), (H200_TUNING_RUN, "tuning")):
        for d in _decisions([stem], device=device).values():
            assert (d[5], d[0]) == _recorded_choice(d[5], run) and d[4] == "cache"
    assert main(["inspect", stem]) == 0
    table = capsys.readouterr().out
    assert "decisions for 2 devices" in table and "device" in table
    assert main(["inspect", stem, "--json", "--device", "tuning run"]) == 0
    assert {r["device"] for r in json.loads(capsys.readouterr().out)["records"]} == {str(H200_TUNING_RUN)}


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--layout", "auto"], "--layout auto plans the whole graph"),
        ([], "no worker started (the cluster has no GPU)"),
        (["--devices", "A100"], "--devices 'A100': no GPU of the cluster matches (cluster: no workers)"),
        (["--cluster", "spark"], "--cluster 'spark': expected local, ray or ray://HOST:PORT"),
        (["--retries", "-1"], "--retries must be >= 0"),
        (["--task-timeout", "0"], "--task-timeout must be > 0"),
    ],
)
def test_tune_errors_are_one_line(lab, tmp_path, capsys, no_gpu, extra, message):
    (tmp_path / "out").mkdir()
    code = main(["tune", str(lab["paths"][0]), "--batch", "1", "-o", str(tmp_path / "out"), "--cache", str(tmp_path / "c.db"), *extra])
    err = capsys.readouterr().err
    assert code == 1 and message in err and err.count("\n") == 1, err
    assert not list((tmp_path / "out").iterdir())


def test_tune_interrupted_with_no_report_does_not_say_nothing_was_written(lab, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # a second Ctrl-C while the writer finishes a model

    monkeypatch.setattr(driver, "tune", interrupted)
    (tmp_path / "out").mkdir()
    assert main(["tune", str(lab["paths"][0]), "--batch", "1", "-o", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err
    assert "nothing was written" not in err and "written by this run is complete" in err


def test_tune_refuses_outputs_that_collide_and_missing_output_dirs(lab, tmp_path, capsys, no_gpu):
    other = tmp_path / "again"
    other.mkdir()
    twin = recorded.save(recorded.resnet_stem(), other, "resnet_stem")
    (tmp_path / "out").mkdir()
    assert main(["tune", str(lab["paths"][0]), str(twin), "-o", str(tmp_path / "out"), "--batch", "1"]) == 1
    assert "would both be written to" in capsys.readouterr().err
    assert main(["tune", str(twin), "-o", str(tmp_path / "nowhere")]) == 1
    assert "output directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["tune", str(twin), "-o", str(tmp_path / "out"), "--batch", "1", "--shape", "input=1x3x224x224"])
    assert exit_.value.code == 2  # --shape and --batch exclude each other


def test_convpass_imports_and_runs_without_ray(tmp_path):
    code = """
import sys
sys.modules["ray"] = None  # importing ray now fails, as where it is not installed
import convpass, convpass.cli.main, convpass.fleet, convpass.fleet.driver, convpass.fleet.local
convpass.cli.main.build_parser().parse_args(["tune", "m.onnx", "-o", "out"])
from convpass.core.errors import OptionError
try:
    convpass.fleet.driver.make_executor("ray")
except OptionError as e:
    print(e)
assert "ray" not in [m for m in sys.modules if sys.modules[m] is not None]
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Ray is not installed here" in out.stdout and "pip install 'convpass[fleet]'" in out.stdout

"""The fleet's bookkeeping on a local Ray cluster of 2 CPUs (skipped where Ray is not installed):
the same replayed measurements as tests/test_fleet.py, through Ray actors instead of processes."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.fleet  # CI runs these in a step of their own, with Ray installed (.ci/run)
ray = pytest.importorskip("ray")

from conftest import REPO  # noqa: E402
from fleet_faults import KilledMidTask  # noqa: E402
from recorded import H200  # noqa: E402
from test_fleet import RECORDED_PROBLEMS, _check_decisions, _check_nothing_lost, _tune, lab  # noqa: E402,F401

from convpass.fleet.ray_cluster import RayExecutor  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    # actors unpickle the test measurers by module name: give them the tests folder
    path = os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


def test_ray_measures_each_problem_once_and_decides_from_the_measurements(lab, tmp_path, ray_cluster):
    report = _tune(lab, tmp_path / "ray", executor=RayExecutor(workers=2))
    doc = report.to_json()
    assert len(doc["slots"]) == 2 and all(s["id"].endswith(("/cpu0", "/cpu1")) for s in doc["slots"])
    _check_nothing_lost(doc, tmp_path / "ray" / "driver.db")
    assert all(f["attempts"] == 3 and "no measurement of" in f["reasons"][-1] for f in doc["failed"])
    assert ray.is_initialized()  # a runtime the caller started is left running
    _check_decisions(report.written)


def test_ray_worker_killed_mid_task_loses_nothing(lab, tmp_path, ray_cluster):
    measurer = KilledMidTask(lab["recorded"], H200, tmp_path / "killed", nth=3)
    doc = _tune(lab, tmp_path, measurer, executor=RayExecutor(workers=2)).to_json()
    (lost,) = doc["workers_lost"]
    assert "died" in lost["reason"], lost  # e.g. "ActorDiedError: The actor died unexpectedly before finishing this task."
    _check_nothing_lost(doc, tmp_path / "driver.db")
    (retried,) = doc["retries"]
    assert retried["attempts"] == 2


def test_ray_interrupt_keeps_results_and_resume_measures_the_rest(lab, tmp_path, ray_cluster):
    def interrupt(progress):
        if progress.finished >= 4:
            raise KeyboardInterrupt

    first = _tune(lab, tmp_path, executor=RayExecutor(workers=2), on_progress=interrupt).to_json()
    assert first["interrupted"] and first["measured"] >= 4
    again = _tune(lab, tmp_path, executor=RayExecutor(workers=2)).to_json()
    assert again["cached"] == first["measured"] and again["measured"] == RECORDED_PROBLEMS - first["measured"]
    assert again["missing"] == [] and len(again["failed"]) == 2

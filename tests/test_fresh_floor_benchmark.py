"""benchmarks/fresh_floor.py: a fresh process per step, timed, failures reported with their reason
(real processes, CPU)."""

from __future__ import annotations

from conftest import benchmark_script

fresh_floor = benchmark_script("fresh_floor")


def test_the_python_steps_are_timed_and_a_step_that_cannot_run_says_why():
    seen: list[str] = []
    table = fresh_floor.measure(2, None, log=seen.append)
    by = {row["what"]: row for row in table}
    for what in ("start Python", "import numpy", "import numpy, convpass.runtime"):
        assert len(by[what]["runs"]) == 2 and by[what]["median"] > 0 and not by[what]["failed"]
    cupy = by["import numpy and CuPy, make a CUDA context"]
    assert len(cupy["runs"]) + len(cupy["failed"]) == 2  # timed on a GPU machine, a reason elsewhere
    assert all(reason for reason in cupy["failed"])
    assert not any("cuDNN" in row["what"] for row in table)  # no library given: no cuDNN steps
    assert len([s for s in seen if s.startswith("run 1/2")]) == len(table)
    text = fresh_floor.lines(table)
    assert text[0].startswith("start Python") and "median" in text[0] and "runs [" in text[0]


def test_a_failing_process_gives_its_last_line_and_no_time():
    rec = fresh_floor.time_step("raise SystemExit('no GPU here')")
    assert rec == {"status": "failed", "reason": "no GPU here"}
    table = [{"what": "x", "code": "", "runs": [], "failed": ["no GPU here"], "median": None}]
    assert fresh_floor.lines(table) == [f"{'x':60s} failed: no GPU here"]


def test_the_cudnn_steps_load_the_library_given():
    named = dict(fresh_floor.steps("/opt/lib/libcudnn.so.9"))
    assert "'/opt/lib/libcudnn.so.9'" in named["load cuDNN and make its handle (ctypes; makes the context)"]
    assert "cudnnCreate" in named["all of the above but convpass"] and "cupy" in named["all of the above but convpass"]

"""scripts/gpu_tests_progress.py, the pytest plugin behind scripts/gpu-tests.sh: shards and a log
that makes a cut-off GPU test run resumable (run here on a few plain tests, in subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_tests_progress  # noqa: E402

_TESTS = '''
import pytest

pytestmark = pytest.mark.gpu

def test_a(): pass
def test_b(): assert False, "b is broken"
def test_c(): pytest.skip("no GPU")
@pytest.mark.xfail(reason="known")
def test_d(): assert False
def test_e(): pass
@pytest.mark.cpu_only
def test_f(): pass
'''

_INI = "[pytest]\nmarkers =\n    gpu: needs a GPU\n    cpu_only: not a GPU test\n"


def _run(tmp: Path, shard: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "scripts"), GPU_TESTS_LOG=str(tmp / "done"))
    env.pop("GPU_TESTS_SHARD", None)
    if shard:
        env["GPU_TESTS_SHARD"] = shard
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_tests_progress",
                           "-m", "gpu and not cpu_only", str(tmp / "test_some.py")], cwd=tmp, env=env, capture_output=True, text=True, timeout=120)


def test_shards_split_the_tests_and_a_second_call_runs_only_what_is_left(tmp_path):
    (tmp_path / "test_some.py").write_text(_TESTS)
    (tmp_path / "pytest.ini").write_text(_INI)  # test_f is deselected by -m before the shards are cut
    first = _run(tmp_path, "0/2")  # tests 0, 2, 4 of the collection: a, c, e
    assert "2 passed, 1 skipped, 3 deselected" in first.stdout, first.stdout
    log = tmp_path / "done"
    assert gpu_tests_progress.read_log(log) == {"test_some.py::test_a": "passed", "test_some.py::test_c": "skipped",
                                                "test_some.py::test_e": "passed"}
    assert "2 passed, 1 skipped\n2 of 5 left" in gpu_tests_progress.summary(str(log))  # shard 1 has not run yet
    second = _run(tmp_path, "1/2")  # b and d
    assert "1 failed" in second.stdout and "1 xfailed" in second.stdout
    outcomes = gpu_tests_progress.read_log(log)
    assert outcomes["test_some.py::test_b"] == "failed" and outcomes["test_some.py::test_d"] == "xfailed"
    assert "b is broken" in (tmp_path / "done.failures").read_text()
    text = gpu_tests_progress.summary(str(log))
    assert text.startswith("1 failed, 2 passed, 1 xfailed, 1 skipped\n0 of 5 left") and "FAILED test_some.py::test_b" in text
    seconds = gpu_tests_progress.read_seconds(tmp_path / "done.seconds")  # every test that ran, its phases summed
    assert set(seconds) == {f"test_some.py::test_{t}" for t in "abcde"} and all(s >= 0 for s in seconds.values())
    assert "in 5 tests; the slowest:" in text and text.count("s  test_some.py::test_") == 5
    # again, without shards: every test is in the log, so nothing runs
    again = _run(tmp_path, None)
    assert "6 deselected" in again.stdout, again.stdout


def test_a_cut_off_test_is_not_logged_and_the_worst_outcome_of_an_id_wins(tmp_path):
    log = tmp_path / "done"
    log.write_text("passed\tt::a\nerror\tt::a\nskipped\tt::b\nbogus line\n")
    assert gpu_tests_progress.read_log(log) == {"t::a": "error", "t::b": "skipped"}
    assert gpu_tests_progress.summary(str(log)).splitlines()[1] == "nothing collected yet"
    assert gpu_tests_progress.read_log(tmp_path / "absent") == {}


def test_a_malformed_shard_is_a_clear_error(tmp_path):
    (tmp_path / "test_some.py").write_text(_TESTS)
    (tmp_path / "pytest.ini").write_text(_INI)
    for shard in ("2/2", "one/two", "3"):
        done = _run(tmp_path, shard)
        assert done.returncode != 0 and f"GPU_TESTS_SHARD={shard!r}: want k/n" in done.stderr + done.stdout, (shard, done.stderr)
        assert not (tmp_path / "done").exists()

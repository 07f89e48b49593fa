"""The device fingerprint on a real GPU: the driver's answer (``convpass.core.device.detect``) is
CuPy's, for the current device, and a cached ``optimize`` on a GPU machine asks it without
importing CuPy (each check that looks at ``sys.modules`` runs in a process of its own). On a
machine with one GPU only device 0 is compared: the choice of the current context's device is
checked on a stand-in driver in ``tests/test_device.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import MODELS, REPO  # noqa: E402

from convpass.native import device  # noqa: E402


def test_the_driver_fingerprint_is_cupys_for_the_current_device():
    for index in range(cp.cuda.runtime.getDeviceCount()):
        with cp.cuda.Device(index):
            found = device.detect()
            assert found is not None
            assert (found.name, found.compute_capability, found.sm_count) == device._asked_of_cupy()


def test_a_cached_optimize_does_not_import_cupy(tmp_path):
    """The first run measures (and so imports CuPy); the second, from its cache, does not."""
    model = MODELS / "residual_cnn.onnx"
    args = [str(model), "--cache", str(tmp_path / "tune.db"), "--no-kernels", "-q"]
    code = """
import sys
from convpass.cli.main import main
code = main(["optimize", *sys.argv[2:], "-o", sys.argv[1]])
assert not code, code
print("cupy" in sys.modules)
"""
    outs = []
    for name in ("first.onnx", "second.onnx"):
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / name), *args], capture_output=True, text=True, cwd=REPO, timeout=300)
        assert done.returncode == 0, done.stderr
        outs.append(done.stdout.split()[-1])
    assert outs == ["True", "False"]
    assert (tmp_path / "first.onnx").read_bytes() == (tmp_path / "second.onnx").read_bytes()

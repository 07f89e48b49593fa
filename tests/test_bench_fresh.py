"""CPU tests of the fresh-process cold start (``convpass bench --fresh-process``,
:mod:`convpass.bench.fresh`): the parts from the stamps, the child on the CPU executor and on ONNX
Runtime's CPU EP (real processes), the parent's harness (fresh kernel-cache folders, the rest of the
environment kept, a child that fails, exits non-zero, prints nothing or hangs), and that the child
imports nothing but the standard library before its runtime.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

from convpass.bench import fresh

from conftest import MODELS, run_ort

MODEL = MODELS / "residual_cnn.onnx"  # fixed batch 1: input 1x3x64x64


def _inputs(tmp_path, batch: int = 1):
    x = np.random.default_rng(0).standard_normal((batch, 3, 64, 64)).astype(np.float32)
    path = tmp_path / "inputs.npz"
    np.savez(path, input=x)
    return path, {"input": x}


def _outputs(path):
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# ---------------------------------------------------------------------------------------------
# parts


def test_parts_from_stamps():
    stamps = {"spawn": 100.0, "main": 100.5, "import": 101.5, "inputs": 101.6, "context": 102.0, "model_read": 102.5,
              "plan": 104.0, "first_result": 104.25}
    got = fresh.parts(stamps)
    assert list(got) == list(fresh.PART_KEYS)
    assert got == pytest.approx({"interpreter_s": 0.5, "import_s": 1.0, "inputs_s": 0.1, "context_s": 0.4, "model_read_s": 0.5,
                                 "plan_s": 1.5, "first_run_s": 0.25, "total_s": 4.25})
    # ONNX Runtime cannot separate its context and model read: their time is in the plan part
    ort = {k: v for k, v in stamps.items() if k not in fresh.UNSEPARATED["ort"]}
    got = fresh.parts(ort)
    assert got["context_s"] is None and got["model_read_s"] is None and got["plan_s"] == pytest.approx(2.4)
    assert got["total_s"] == pytest.approx(4.25)
    # no spawn time (a child started by hand): no interpreter part, no total; a child that stopped early: its parts so far
    got = fresh.parts({"spawn": None, "main": 1.0, "import": 2.0})
    assert got["interpreter_s"] is None and got["import_s"] == pytest.approx(1.0)
    assert got["plan_s"] is None and got["total_s"] is None


# ---------------------------------------------------------------------------------------------
# the child, in real processes


def test_convpass_child_on_the_cpu_executor(tmp_path):
    pytest.importorskip("onnxruntime")  # the reference
    inputs, feeds = _inputs(tmp_path)
    out = tmp_path / "out.npz"
    rec = fresh.spawn(fresh.child_command("convpass", MODEL, inputs, device="cpu", out=out), 120, tmp_path)
    assert rec["status"] == "ok" and rec["reason"] is None, rec
    assert set(rec) == set(fresh.RECORD_KEYS)
    parts = rec["parts"]
    assert all(isinstance(parts[k], float) and parts[k] >= 0 for k in fresh.PART_KEYS), parts
    assert parts["import_s"] > 0 and parts["interpreter_s"] > 0
    assert parts["total_s"] == pytest.approx(sum(parts[k] for k in fresh.PART_KEYS if k != "total_s"))
    # the CPU executor never imports the kernel compiler: not counted; CuPy's (new, empty) cache stays empty
    assert rec["compilations"] is None and rec["compiled"] is None and rec["cache_files"] == 0
    (got,) = _outputs(out)
    (want,) = run_ort(onnx.load(MODEL), feeds)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("fresh-")], "the kernel-cache folders are removed"


def test_ort_child_on_the_cpu_ep(tmp_path):
    pytest.importorskip("onnxruntime")
    inputs, feeds = _inputs(tmp_path)
    out = tmp_path / "out.npz"
    rec = fresh.spawn(fresh.child_command("ort", MODEL, inputs, config="EXHAUSTIVE-nhwc", device="cpu", out=out), 120, tmp_path)
    assert rec["status"] == "ok", rec
    parts = rec["parts"]
    assert parts["context_s"] is None and parts["model_read_s"] is None  # inside InferenceSession()
    assert parts["plan_s"] > 0 and parts["first_run_s"] > 0 and parts["total_s"] > parts["plan_s"]
    assert rec["compilations"] is None and rec["cache_files"] is None  # convpass's counters only
    np.testing.assert_allclose(_outputs(out)[0], run_ort(onnx.load(MODEL), feeds)[0], rtol=1e-5, atol=1e-5)


def test_a_failing_child_names_the_phase_and_gives_no_numbers(tmp_path):
    inputs, _ = _inputs(tmp_path, batch=2)  # the model's batch is fixed at 1: the plan refuses it
    rec = fresh.spawn(fresh.child_command("convpass", MODEL, inputs, device="cpu"), 120, tmp_path)
    assert rec["status"] == "failed" and rec["reason"].startswith("plan: ExecutorError: input 'input' dim 0 is 2"), rec
    assert rec["parts"] is None and rec["compilations"] is None


def test_a_runtime_that_is_not_installed_fails_at_import(tmp_path):
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch is installed here")
    inputs, _ = _inputs(tmp_path)
    cmd = fresh.child_command("torch", MODEL, inputs, config="nchw", device="cpu", weights=tmp_path / "w.pt")
    rec = fresh.spawn(cmd, 120, tmp_path)
    assert rec == fresh.record("failed", "import: ModuleNotFoundError: No module named 'torch'")


def test_child_usage_errors_are_reported(tmp_path):
    inputs, _ = _inputs(tmp_path)
    rec = fresh.spawn(fresh.child_command("ort", MODEL, inputs, device="cpu"), 60, tmp_path)  # no --config
    assert rec["status"] == "failed" and rec["reason"].startswith("exit status 2: ")
    assert "--runtime ort needs --config, one of EXHAUSTIVE-nchw, EXHAUSTIVE-nhwc, HEURISTIC-nchw, HEURISTIC-nhwc" in rec["reason"]
    rec = fresh.spawn(fresh.child_command("convpass", MODEL, inputs, config="nchw"), 60, tmp_path)
    assert "--runtime convpass has no configurations" in rec["reason"]


def test_the_child_imports_only_the_standard_library_before_its_runtime():
    code = ("import sys, convpass.bench.fresh; bad = [m for m in ('numpy', 'onnx', 'cupy', 'torch', 'onnxruntime') "
            "if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    res = subprocess.run(_py(code), capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------------------------------------
# the harness


def test_spawn_gives_new_empty_kernel_caches_and_keeps_the_rest_of_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVPASS_FRESH_TEST", "kept")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "warm"))
    code = r"""
import json, os, sys, time
cupy, cuda = os.environ["CUPY_CACHE_DIR"], os.environ["CUDA_CACHE_PATH"]
assert os.path.isdir(cupy) and os.path.isdir(cuda) and cupy != cuda and not os.listdir(cupy) and not os.listdir(cuda)
assert "warm" not in cupy and os.environ["CONVPASS_FRESH_TEST"] == "kept"
assert sys.argv[-2] == "--spawn-time" and 0 <= time.time() - float(sys.argv[-1]) < 60
open(os.path.join(cupy, "kernel.cubin"), "w").close()
print("library chatter")
print(json.dumps({"stamps": {}, "parts": {"total_s": 1.5}, "compilations": 0, "compiled": [], "cache_files": 1, "error": None}))
"""
    rec = fresh.spawn(_py(code), 60, tmp_path)
    assert rec == fresh.record("ok", parts={"total_s": 1.5}, compilations=0, compiled=[], cache_files=1), rec
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "each child's folders are removed after it"


def test_spawn_timeout(tmp_path):
    rec = fresh.spawn(_py("import sys, time; print('loading', file=sys.stderr, flush=True); time.sleep(60)"), 1, tmp_path)
    assert rec["status"] == "failed" and rec["reason"].startswith("timed out after 1 s"), rec
    assert rec["parts"] is None


@pytest.mark.parametrize("code, reason", [
    ("import sys; print('Traceback: boom', file=sys.stderr); sys.exit(3)", "exit status 3: Traceback: boom"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
    ("print('hello')", "no result line on stdout"),
    ("print('{not json')", "no result line on stdout"),
    ('import json; print(json.dumps({"stamps": {}, "parts": {}, "error": "context: CUDARuntimeError: no device"})); raise SystemExit(1)',
     "context: CUDARuntimeError: no device"),
])
def test_spawn_reports_a_failing_child_with_its_reason(tmp_path, code, reason):
    rec = fresh.spawn(_py(code), 60, tmp_path)
    assert rec == fresh.record("failed", reason)


def test_spawn_a_command_that_cannot_start(tmp_path):
    rec = fresh.spawn([str(tmp_path / "no-such-python")], 60, tmp_path)
    assert rec["status"] == "failed" and rec["reason"].startswith("could not start: FileNotFoundError")


def test_child_command_line():
    cmd = fresh.child_command("torch", "m.onnx", "in.npz", config="channels_last", tf32=False, weights="w.pt",
                              panel_json="p.json", out="o.npz")
    assert cmd[:3] == [sys.executable, "-m", "convpass.bench.fresh"]
    args = fresh._parser().parse_args(cmd[3:])
    assert (args.runtime, args.config, args.model, args.inputs, args.device, args.tf32) == (
        "torch", "channels_last", "m.onnx", "in.npz", "cuda", "off")
    assert (args.weights, args.panel_json, args.out, args.spawn_time) == ("w.pt", "p.json", "o.npz", None)
    assert fresh.CONFIGS["ort"] == ("EXHAUSTIVE-nchw", "EXHAUSTIVE-nhwc", "HEURISTIC-nchw", "HEURISTIC-nhwc")
    assert fresh.CONFIGS["torch"] == ("nchw", "channels_last")

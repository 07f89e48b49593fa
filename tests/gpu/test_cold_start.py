"""Kernels compiled ahead of time, on a real GPU: a model written by ``optimize`` carries its
kernel side-car, and a fresh Python process — CuPy's kernel cache pointed at an empty folder —
runs it with zero run-time compilations (counted by the seam, and checked independently: CuPy
writes every kernel it compiles into that folder, which stays empty). Without the side-car the
same process compiles and says so once; a side-car for another architecture or of a changed model
falls back to compiling, with one warning, and stays correct. The panel in ``.panel/`` (batch
``CONVPASS_PANEL_BATCH``, models ``CONVPASS_COLD_MODELS`` or all exported) too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import MODELS, REPO, run_ort  # noqa: E402
from test_executor_cuda import PANEL_BATCH, PANEL_OPTIONS, _feeds, _rel, _tolerance  # noqa: E402

import convpass  # noqa: E402
from convpass.core import kernel_file  # noqa: E402

SAMPLES = sorted(MODELS.glob("*.onnx"))
PANEL = REPO / ".panel"
COLD_MODELS = [m for m in os.environ.get("CONVPASS_COLD_MODELS", "").split(",") if m]

# The deployment's process: load the model (and its side-car), prepare, run twice, report what was compiled.
_CHILD = r"""
import json, os, sys, warnings
import numpy as np
warnings.simplefilter("always")
from convpass.runtime import Executor
from convpass.native import prebuilt
model, kernels, feeds_in, out = sys.argv[1:5]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ex = Executor(model, device="cuda", kernels=None if kernels == "auto" else False)
    feeds = dict(np.load(feeds_in))
    ex.prepare(feeds)
    outs = ex.run(None, feeds)
    again = ex.run(None, feeds)
np.savez(out, *outs)
cache = os.environ["CUPY_CACHE_DIR"]
print(json.dumps({
    "compilations": list(prebuilt.COMPILATIONS),
    "plans_built": [list(b) for b in ex._backend.convs.engine_builds],  # cuDNN plans built, not loaded
    "engines": sum(1 for ex_ in ex._backend.convs.executions if getattr(ex_, "engine", None) is not None),
    "cache_files": sorted(os.listdir(cache)) if os.path.isdir(cache) else [],
    "warnings": [str(w.message) for w in caught],
    "trusted": ex.trusted,
    "graph": bool(ex.graph_status().captured),
    # normwise, not per element: some algorithms accumulate with atomics (backward-data algo_0 in
    # DCGAN's last ConvTranspose), so two runs differ in the last bits (9e-10 there) in any order
    "replay_equal": all(np.linalg.norm((a - b).ravel()) <= 1e-6 * np.linalg.norm(b.ravel()) for a, b in zip(outs, again)),
    # cupyx (and with it SciPy, 0.3 s) is imported by a CuPy operator comparison or cupyx.scipy.special
    "slow_imports": sorted(m for m in ("cupyx.scipy", "scipy") if m in sys.modules),
}))
"""


def _fresh(model: Path, feeds: dict, tmp: Path, kernels: str = "auto") -> tuple[dict, list[np.ndarray]]:
    tmp.mkdir(parents=True, exist_ok=True)
    np.savez(tmp / "feeds.npz", **feeds)
    env = dict(os.environ, CUPY_CACHE_DIR=str(tmp / "cupy-cache"), CUDA_CACHE_PATH=str(tmp / "cuda-cache"))
    done = subprocess.run([sys.executable, "-c", _CHILD, str(model), kernels, str(tmp / "feeds.npz"), str(tmp / "out.npz")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(tmp / "out.npz") as z:
        outs = [z[f"arr_{i}"] for i in range(len(z.files))]
    return json.loads(done.stdout.strip().splitlines()[-1]), outs


def _check(outs, refs, tol, what):
    assert len(outs) == len(refs)
    for got, want in zip(outs, refs):
        err = _rel(got, want)
        assert err <= tol, f"{what}: normwise relative error {err:.3g} > {tol:g}"


def _optimized(path: Path, tmp: Path, batch: int = 2, **options) -> tuple[Path, dict]:
    model = onnx.load(path)
    feeds, shapes = _feeds(model, batch=batch)
    out = tmp / f"{path.stem}.tuned.onnx"
    cache = os.environ.get("CONVPASS_TUNE_CACHE") or tmp / "tune.db"
    convpass.optimize(path, out, cache=cache, shapes=shapes, quiet=True, **options)
    assert kernel_file.sidecar_path(out).exists(), "optimize on a GPU writes the kernel side-car"
    return out, feeds


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_a_fresh_process_compiles_nothing(path, tmp_path):
    out, feeds = _optimized(path, tmp_path)
    refs = run_ort(onnx.load(path), feeds)
    info, outs = _fresh(out, feeds, tmp_path / "fresh")
    assert info["compilations"] == [], info["compilations"]
    assert info["plans_built"] == [], info["plans_built"]
    assert info["cache_files"] == [], "CuPy compiled kernels the seam did not see"
    assert info["trusted"] and info["replay_equal"]
    assert info["slow_imports"] == [], "start-up imported cupyx / SciPy (see convpass/runtime/ops.py on comparisons)"
    assert not [w for w in info["warnings"] if "compiled at start-up" in w or "side-car" in w], info["warnings"]
    _check(outs, refs, _tolerance(onnx.load(out)), f"{path.stem} from its side-car")


def test_graph_api_plans_are_loaded_from_the_side_car_not_built(tmp_path):
    """A model on graph-API engines only (fused SiLU graphs where cuDNN offers them, NHWC): its
    side-car stores every built plan; a fresh process loads them all (nothing built, nothing
    compiled, no warning) and computes what ONNX Runtime does. Without the side-car the same
    process builds them and says why once."""
    from conftest import silu_model

    from convpass.native.cudnn import graph_api

    if graph_api.unavailable():
        pytest.skip(graph_api.unavailable())
    model = silu_model((2, 16, 12, 12))
    out = tmp_path / "silu.tuned.onnx"
    convpass.optimize(model, out, cache=tmp_path / "tune.db", quiet=True, tf32="on", engines="graph", layout="nhwc")
    engines = [r for r in convpass.inspect(onnx.load(out)) if r["engine"]]
    if not engines:
        pytest.skip("cuDNN kept no engine for these convs here")
    described = kernel_file.describe(out)
    assert "built cuDNN plan(s)" in described, described
    # a cached re-run writes the same model: its side-car, built here for the model's profiles, is kept
    from convpass.native import prebuilt

    side = kernel_file.sidecar_path(out)
    kf = kernel_file.read(side)
    assert kf.recorded_arch == prebuilt.device_arch() and kf.model_profiles
    before = (side.read_bytes(), side.stat().st_mtime_ns, out.read_bytes())
    convpass.optimize(model, out, cache=tmp_path / "tune.db", quiet=True, tf32="on", engines="graph", layout="nhwc")
    assert (side.read_bytes(), side.stat().st_mtime_ns, out.read_bytes()) == before
    feeds = {"x": np.random.default_rng(4).standard_normal((2, 16, 12, 12)).astype(np.float32)}
    refs = run_ort(model, feeds)
    info, outs = _fresh(out, feeds, tmp_path / "fresh")
    assert info["engines"] >= len(engines) and info["plans_built"] == [] and info["compilations"] == [], info
    assert not [w for w in info["warnings"] if "start-up" in w], info["warnings"]
    # the first run checks each engine step against a legacy algorithm: without importing cupyx / SciPy
    assert info["slow_imports"] == [], "start-up imported cupyx / SciPy (see convpass/runtime/ops.py on comparisons)"
    _check(outs, refs, 5e-3, "plans from the side-car")
    info, outs = _fresh(out, feeds, tmp_path / "none", kernels="none")
    assert len(info["plans_built"]) >= len(engines), info
    _check(outs, refs, 5e-3, "plans built at start-up")


def test_without_the_sidecar_kernels_compile_and_that_is_said_once(tmp_path):
    path = MODELS / "residual_cnn.onnx" if (MODELS / "residual_cnn.onnx").exists() else SAMPLES[0]
    out, feeds = _optimized(path, tmp_path)
    info, _ = _fresh(out, feeds, tmp_path / "fresh", kernels="none")
    assert info["compilations"] and info["cache_files"], info  # the counter and CuPy's cache agree something compiled
    said = [w for w in info["warnings"] if "compiled at start-up" in w]
    assert len(said) == 1 and "kernels=False" in said[0], info["warnings"]


def test_a_sidecar_for_another_architecture_or_model_falls_back_with_one_warning(tmp_path):
    path = MODELS / "residual_cnn.onnx" if (MODELS / "residual_cnn.onnx").exists() else SAMPLES[0]
    out, feeds = _optimized(path, tmp_path)
    refs = run_ort(onnx.load(path), feeds)
    tol = _tolerance(onnx.load(out))
    assert subprocess.run([sys.executable, "-m", "convpass.cli.main", "compile", str(out), "--arch", "80"], capture_output=True).returncode == 0
    side = kernel_file.sidecar_path(out)
    kf = kernel_file.read(side)
    local = [a for a in kf.archs if a != "80"]
    assert "80" in kf.archs and len(local) == 1, kf.archs
    # keep only the sm_80 binaries: this GPU (another architecture) must compile, warn once, stay correct
    kernel_file.write(side, [e for (k, a), e in kf.entries.items() if a == "80"], model_sha256=kf.model_sha256, verified=True, cupy_version=kf.cupy_version)
    info, outs = _fresh(out, feeds, tmp_path / "other-arch")
    said = [w for w in info["warnings"] if "compiled at start-up" in w]
    assert info["compilations"] and len(said) == 1 and "holds binaries for sm_80" in said[0] and f"sm_{local[0]}" in said[0], info["warnings"]
    _check(outs, refs, tol, "other architecture")
    # the model changed after its kernels were compiled: the side-car is refused, the model checked
    changed = onnx.load(out)
    changed.doc_string += " (edited)"
    onnx.save(changed, out)
    info, outs = _fresh(out, feeds, tmp_path / "changed")
    assert not info["trusted"]
    assert any("written for another model" in w for w in info["warnings"]), info["warnings"]
    _check(outs, refs, tol, "changed model")


def _panel_names() -> list[str]:
    names = COLD_MODELS or sorted(p.stem for p in PANEL.glob("*.onnx") if not p.stem.endswith("_fp16"))
    return names or ["resnet50"]


@pytest.mark.parametrize("name", _panel_names())
def test_panel_model_fresh_process_compiles_nothing(name, tmp_path):
    path = PANEL / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} not exported (python3 models/export_panel.py --out .panel --models {name})")
    out, feeds = _optimized(path, tmp_path, batch=PANEL_BATCH, **PANEL_OPTIONS["fp32"])
    info, outs = _fresh(out, feeds, tmp_path / "fresh")
    assert info["compilations"] == [] and info["cache_files"] == [], info
    assert info["graph"] and info["replay_equal"]
    assert info["slow_imports"] == [], "start-up imported cupyx / SciPy (see convpass/runtime/ops.py on comparisons)"
    _check(outs, run_ort(onnx.load(path), feeds), _tolerance(onnx.load(out)), name)


# ---------------------------------------------------------------------------------------------
# convpass bench --fresh-process: its children on the GPU (convpass.bench.fresh)


def _bench_child(runtime: str, model: Path, feeds: dict, tmp: Path, **kw) -> tuple[dict, list[np.ndarray]]:
    from convpass.bench import fresh

    tmp.mkdir(parents=True, exist_ok=True)
    np.savez(tmp / "inputs.npz", **feeds)
    rec = fresh.spawn(fresh.child_command(runtime, model, tmp / "inputs.npz", out=tmp / "out.npz", **kw), 600, tmp)
    assert rec["status"] == "ok", rec
    assert isinstance(rec["parts"]["total_s"], float) and rec["parts"]["total_s"] > 0, rec["parts"]
    with np.load(tmp / "out.npz") as z:
        return rec, [z[f"arr_{i}"] for i in range(len(z.files))]


def test_the_bench_child_of_convpass_compiles_nothing_and_times_every_part(tmp_path):
    from convpass.bench import fresh

    path = MODELS / "residual_cnn.onnx" if (MODELS / "residual_cnn.onnx").exists() else SAMPLES[0]
    out, feeds = _optimized(path, tmp_path)
    rec, outs = _bench_child("convpass", out, feeds, tmp_path / "fresh")
    # the CUDA context and cuDNN are set up while the model is read (the executor's helper thread): one part
    assert rec["parts"]["context_s"] is None
    timed = [k for k in fresh.PART_KEYS if k != "context_s"]
    assert all(isinstance(rec["parts"][k], float) and rec["parts"][k] >= 0 for k in timed), rec["parts"]
    assert rec["compilations"] == 0 and rec["compiled"] == [] and rec["cache_files"] == 0, rec
    _check(outs, run_ort(onnx.load(path), feeds), _tolerance(onnx.load(out)), f"{path.stem} in the bench's fresh child")


@pytest.mark.parametrize("config", ["EXHAUSTIVE-nhwc", "HEURISTIC-nchw"])
def test_the_bench_child_of_onnxruntime_runs_on_the_cuda_ep(tmp_path, config):
    from convpass.bench import ort_contender

    reason = ort_contender.ort_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    path = MODELS / "residual_cnn.onnx" if (MODELS / "residual_cnn.onnx").exists() else SAMPLES[0]
    feeds, _ = _feeds(onnx.load(path), batch=1)
    rec, outs = _bench_child("ort", path, feeds, tmp_path, config=config)
    assert rec["parts"]["context_s"] is None and rec["parts"]["model_read_s"] is None and rec["parts"]["plan_s"] > 0
    _check(outs, run_ort(onnx.load(path), feeds), 5e-3, f"onnxruntime {config}")


@pytest.mark.parametrize("config", ["nchw", "channels_last"])
def test_the_bench_child_of_pytorch_loads_the_saved_weights(tmp_path, config):
    from convpass.bench import peers, torch_contender

    reason = torch_contender.torch_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    path = PANEL / "dcgan_generator.onnx"
    if not path.exists():
        pytest.skip(f"{path} not exported (python3 models/export_panel.py --out .panel --models dcgan_generator)")
    import torch

    module, _ = peers.load_export_panel().build_torch_model("dcgan_generator")
    torch.save(module.state_dict(), tmp_path / "weights.pt")
    feeds, _ = _feeds(onnx.load(path), batch=2)
    rec, outs = _bench_child("torch", path, feeds, tmp_path / "fresh", config=config, weights=tmp_path / "weights.pt")
    assert all(isinstance(rec["parts"][k], float) for k in ("import_s", "context_s", "model_read_s", "plan_s", "first_run_s"))
    _check(outs, run_ort(onnx.load(path), feeds), 5e-3, f"torch {config}")


def test_the_bench_times_a_later_batch_size_in_the_executor_that_ran_the_first(tmp_path):
    from convpass.bench import convpass_contender

    path = MODELS / "mobile_block.onnx"  # the sample whose batch is dynamic
    records = convpass_contender.run_batch_sizes_in_one_executor(path, [1, 4], "on", str(tmp_path / "tune.db"), tmp_path)
    assert list(records) == [4]
    rec = records[4]
    assert rec["status"] == "ok" and rec["after"] == 1 and 0 < rec["seconds"] < 60, rec
    assert not list(tmp_path.glob("*.tuned.onnx*"))  # its model and side-car are removed

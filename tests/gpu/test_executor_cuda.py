"""The cuda executor backend on a real GPU: CuPy + cuDNN with the recorded choices, CUDA graphs.

Every sample model, untuned and tuned, against ONNX Runtime (CPU) with a TF32-aware tolerance
(normwise relative error <= 5e-3 when TF32 may be used, 1e-4 with FMA math only); the recorded
algorithm and problem key are the ones cuDNN is asked to run; CUDA-graph replay equals eager
execution, also for new inputs; fallbacks (other GPU, unsupported algorithm) warn and stay
correct; CuPy / DLPack feeds give CuPy outputs; cuDNN's Find is never called; the torchvision
panel in ``.panel/`` when it was exported there.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_cuda_backend")]

cp = pytest.importorskip("cupy")

import test_cuda_fusion as fusion_cases  # noqa: E402
import test_matmul_epilogues as matmul_cases  # noqa: E402
from conftest import MODELS, REPO, as_float32, conv_model, panel_models, residual_block_model, run_ort  # noqa: E402

import convpass  # noqa: E402
from convpass.core import annotation  # noqa: E402
from convpass.native import cudnn  # noqa: E402
from convpass.runtime import Executor  # noqa: E402

SAMPLES = sorted(MODELS.glob("*.onnx"))
PANEL = REPO / ".panel"
TF32_TOL = 5e-3
FMA_TOL = 1e-4
FP16_NORMAL_MIN = 2.0**-14  # smallest normal float16
# The panel is checked at batch 1 and tuned into one cache for the whole session (CONVPASS_TUNE_CACHE
# names a file to keep, e.g. for the benchmark that follows on the same GPU): tuning every model from
# scratch for the tests alone would cost more device time than the checks themselves.
PANEL_BATCH = int(os.environ.get("CONVPASS_PANEL_BATCH", "1"))
# How the panel tests tune, per precision. float32: the bench's settings (TF32 on, every candidate),
# whose decisions the H200 tuning cache (.tunecache) holds for the whole panel, so the tests check
# exactly what the bench runs. float16: cuDNN's legacy algorithms and convpass's own kernels only;
# with graph-API engines and fused graphs as candidates a float16 panel model took 2-3 s of tuning
# per problem (2026-11-24: 247 problems in 6 minutes on 2 H200s), more device time than a session
# has for the whole suite. Engines on float16 tensors are checked on small models in
# test_graph_api_gpu.py instead.
# scripts/gpu-tests.sh tunes the panel with the same options first: keep them in step.
PANEL_OPTIONS = {"fp32": {"tf32": "on"}, "fp16": {"engines": "legacy"}}



def _ExecutorWarning():
    from convpass.runtime.cuda import ExecutorWarning

    return ExecutorWarning


def _feeds(model: onnx.ModelProto, batch: int = 2, seed: int = 1) -> tuple[dict, list[str]]:
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds, shapes = {}, []
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else batch for d in inp.type.tensor_type.shape.dim]
        shapes.append(f"{inp.name}={'x'.join(map(str, dims))}")
        feeds[inp.name] = rng.standard_normal(dims).astype(helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type))
    return feeds, shapes


def _rel(got, want) -> float:
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    return float(np.linalg.norm((got - want).ravel()) / max(np.linalg.norm(want.ravel()), 1e-30))


def _tolerance(tuned: onnx.ModelProto | None) -> float:
    if tuned is None:
        return TF32_TOL  # untuned convs run cuDNN's default math: TF32 on Ampere and later
    info = annotation.read_model_info(tuned)
    records = convpass.inspect(tuned)
    fma_only = all(r["math_mode"] == "fma" for r in records if r["algo"] is not None)
    return FMA_TOL if fma_only and not (info and info.matmul_allow_tf32) else TF32_TOL


def _check_against(outs, refs, tol, what):
    assert len(outs) == len(refs)
    for got, want in zip(outs, refs):
        assert isinstance(got, np.ndarray), type(got)
        err = _rel(got, want)
        assert err <= tol, f"{what}: normwise relative error {err:.3g} > {tol:g}"


_TUNED: dict[tuple[str, str], onnx.ModelProto] = {}


def _tuned(path: Path, tmp_path_factory, **options) -> onnx.ModelProto:
    """Each sample tuned once per session (measured on this GPU)."""
    tag = repr(sorted(options.items()))
    key = (str(path), tag)
    if key not in _TUNED:
        _, shapes = _feeds(onnx.load(path))
        cache = tmp_path_factory.mktemp("tune") / "c.db"
        _TUNED[key] = convpass.optimize(path, cache=cache, shapes=shapes, quiet=True, **options)
    return _TUNED[key]


# ---------------------------------------------------------------------------------------------
# correctness against ONNX Runtime


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_untuned_sample_matches_ort(path):
    model = onnx.load(path)
    feeds, _ = _feeds(model)
    refs = run_ort(model, feeds)
    with pytest.warns(_ExecutorWarning(), match="untuned: using cuDNN's heuristic"):
        ex = Executor(model, device="cuda")
        first = ex.run(None, feeds)
    _check_against(first, refs, _tolerance(None), f"{path.stem} untuned, first run")
    with warnings.catch_warnings():
        warnings.simplefilter("error", _ExecutorWarning())  # the note comes once per executor
        for i in range(3):  # warm-up + capture, then replays
            _check_against(ex.run(None, feeds), refs, _tolerance(None), f"{path.stem} untuned, run {i + 2}")
    assert all(not s.tuned and s.algo not in ("-", "auto") for s in ex.plan_summary())


def test_a_tuned_model_run_at_a_shape_of_no_profile_names_its_profiles_and_stays_correct(tmp_path):
    model = conv_model("Conv", ["N", 4, 8, 8], (6, 4, 3, 3), pads=[1, 1, 1, 1])
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", shapes=["x=1x4x8x8"], quiet=True)
    x = np.random.default_rng(0).standard_normal((3, 4, 8, 8)).astype(np.float32)
    with pytest.warns(_ExecutorWarning(), match=r"tuned for shape profiles x=1x4x8x8 and this run's shape x=3x4x8x8 matches none") as said:
        ex = Executor(tuned, device="cuda")
        got = ex.run(None, {"x": x})[0]
    assert not [w for w in said if "untuned" in str(w.message)], [str(w.message) for w in said]
    _check_against([got], run_ort(model, {"x": x}), _tolerance(None), "tuned model, shape of no profile")


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_tuned_sample_matches_ort_and_runs_the_recorded_algorithms(path, tmp_path_factory):
    model = onnx.load(path)
    tuned = _tuned(path, tmp_path_factory)
    feeds, _ = _feeds(model)
    refs = run_ort(model, feeds)
    recorded = {(r["algo"], r["problem_key"]) for r in convpass.inspect(tuned)}
    assert recorded and all(a not in (None, "auto") and k for a, k in recorded)  # an engine's too: its legacy fallback
    with warnings.catch_warnings():
        warnings.simplefilter("error", _ExecutorWarning())  # tuned here: nothing to warn about
        ex = Executor(tuned, device="cuda", cuda_graph=False)
        with cudnn.record_calls() as calls:
            outs = [ex.run(None, feeds) for _ in range(2)]  # the plan-building run, then the plan's runner
    for i, o in enumerate(outs):
        _check_against(o, refs, _tolerance(tuned), f"{path.stem} tuned, run {i + 1}")
    _check_recorded_calls(calls, tuned, ex)
    assert all(s.tuned and s.source != "fallback" for s in ex.plan_summary())


def _check_recorded_calls(calls, tuned, ex) -> None:
    """The legacy cuDNN calls of a tuned model's first runs are its recorded legacy decisions: each
    one called, and nothing else but the legacy algorithm of a graph-API engine decision (the
    op-by-op run that records the plan runs a fused one's; the first run of every engine step is
    checked against it, or against engine_check.REFERENCE_ALGOS where none is recorded).
    Engine decisions make no other legacy call: they are counted as graph-API calls
    (tests/gpu/test_graph_api_gpu.py checks them against references); decisions for convpass's own
    depthwise kernel neither: the backend counts its launches."""
    from convpass.core.algo import Algo
    from convpass.kernels.engine_check import REFERENCE_ALGOS

    def is_own(text):
        return Algo.parse(text).is_own

    records = convpass.inspect(tuned)
    legacy = {(r["algo"], r["problem_key"]) for r in records if not r["engine"] and not is_own(r["algo"])}
    fused_fallbacks = {(a, r["problem_key"]) for r in records if r["engine"] for a in (r["algo"], *REFERENCE_ALGOS)}
    called = {(c.algo, str(c.key)) for c in calls}
    assert legacy <= called <= legacy | fused_fallbacks, (
        f"called {sorted(called - legacy - fused_fallbacks)}, recorded but not called {sorted(legacy - called)}")
    own = [r for r in records if is_own(r["algo"])]  # convpass's own kernel: no cuDNN call, counted by the backend
    assert bool(own) == bool(ex._backend.counters["own_kernel_calls"]), (own, dict(ex._backend.counters))
    if any(r["engine"] for r in records):
        assert ex._backend.counters["graph_api_calls"] > 0, dict(ex._backend.counters)


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_cuda_graph_replay_equals_eager(path, tmp_path_factory):
    model = onnx.load(path)
    tuned = _tuned(path, tmp_path_factory)
    feeds_a, _ = _feeds(model, seed=1)
    feeds_b, _ = _feeds(model, seed=2)
    graph = Executor(tuned, device="cuda", cuda_graph=True)
    eager = Executor(tuned, device="cuda", cuda_graph=False)
    for _ in range(3):
        graph.run(None, feeds_a)
        eager.run(None, feeds_a)
    state = graph.last_plan.backend_state
    assert state.captured and state.mode == "graph", state.note
    assert eager.last_plan.backend_state.graph is None
    refs = run_ort(model, feeds_b)
    for _ in range(2):  # replays see new inputs
        got, want = graph.run(None, feeds_b), eager.run(None, feeds_b)
        for g, e in zip(got, want):
            assert _rel(g, e) <= 1e-5
        _check_against(got, refs, _tolerance(tuned), f"{path.stem} graph replay")
    assert state.replays >= 2


def test_a_replay_returns_fresh_outputs_and_needs_no_host_settings(tmp_path_factory):
    """A whole-graph replay copies the feeds in and the outputs out with one memcpy each, and runs
    outside the backend's errstate (no matmul math switch): outputs are new arrays every run, an
    earlier result survives a later run, and a model with a Gemm replays without the switch."""
    import cupy as cp

    path = MODELS / "residual_cnn.onnx"
    model = onnx.load(path)
    tuned = _tuned(path, tmp_path_factory)
    feeds_a, _ = _feeds(model, seed=1)
    feeds_b, _ = _feeds(model, seed=2)
    ex = Executor(tuned, device="cuda", output_kind="device")
    dev_a = {k: cp.asarray(v) for k, v in feeds_a.items()}
    dev_b = {k: cp.asarray(v) for k, v in feeds_b.items()}
    for _ in range(3):
        ex.run(None, dev_a)
    assert ex.last_plan.backend_state.captured

    def refuse(*a, **k):
        raise AssertionError("a captured replay entered the matmul math switch")

    ex._backend._matmul_math = refuse
    first = ex.run(None, dev_a)
    second = ex.run(None, dev_b)
    statics = [o.data.ptr for o in ex.last_plan.backend_state.outputs]
    for a, b in zip(first, second):
        assert a.data.ptr != b.data.ptr and a.data.ptr not in statics and b.data.ptr not in statics
    refs_a, refs_b = run_ort(model, feeds_a), run_ort(model, feeds_b)
    _check_against([cp.asnumpy(o) for o in first], refs_a, _tolerance(tuned), "first replay, after a second one")
    _check_against([cp.asnumpy(o) for o in second], refs_b, _tolerance(tuned), "second replay")
    # a feed that is not C-contiguous (a transposed view) is still copied in correctly
    name, value = next(iter(feeds_b.items()))
    view = cp.asfortranarray(cp.asarray(value))
    assert not view.flags.c_contiguous
    _check_against([cp.asnumpy(o) for o in ex.run(None, {**dev_b, name: view})], refs_b, _tolerance(tuned), "non-contiguous feed")


def test_fma_only_tuning_meets_the_tight_tolerance(tmp_path_factory):
    path = MODELS / "residual_cnn.onnx"
    tuned = _tuned(path, tmp_path_factory, tf32="off")
    assert all(r["math_mode"] == "fma" for r in convpass.inspect(tuned))
    model = onnx.load(path)
    feeds, _ = _feeds(model)
    refs = run_ort(model, feeds)
    ex = Executor(tuned, device="cuda")
    for i in range(3):
        _check_against(ex.run(None, feeds), refs, FMA_TOL, f"fma run {i + 1}")


# ---------------------------------------------------------------------------------------------
# fallbacks


def _set_meta(model: onnx.ModelProto, key: str, value: str) -> onnx.ModelProto:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for p in model.metadata_props:
        if p.key == key:
            p.value = value
            return model
    model.metadata_props.add(key=key, value=value)
    return model


def test_other_gpu_fingerprint_falls_back_to_the_heuristic_with_a_warning(tmp_path_factory):
    path = MODELS / "residual_cnn.onnx"
    tuned = _set_meta(_tuned(path, tmp_path_factory), "convpass.devices", '["NVIDIA Imaginary 9000|sm_7.0|80sm|cudnn90100"]')
    model = onnx.load(path)
    feeds, _ = _feeds(model)
    refs = run_ort(model, feeds)
    with pytest.warns(_ExecutorWarning(), match="tuned on 'NVIDIA Imaginary 9000") as record:
        ex = Executor(tuned, device="cuda")
        with cudnn.record_calls() as calls:
            out = ex.run(None, feeds)
    assert any("stem/conv" in str(w.message) for w in record)
    _check_against(out, refs, TF32_TOL, "other-GPU fallback")
    assert calls and all(c.key.layout == "nchw" for c in calls)
    assert all(s.source == "fallback" for s in ex.plan_summary())
    for _ in range(2):
        _check_against(ex.run(None, feeds), refs, TF32_TOL, "other-GPU fallback, replay")


def test_recorded_algorithm_unsupported_here_falls_back_naming_the_node(tmp_path):
    model = conv_model("Conv", (1, 8, 16, 16), (8, 8, 3, 3), strides=[2, 2], dilations=[2, 2])
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True)
    (node,) = [n for n in tuned.graph.node if n.domain == "ai.convpass"]
    for a in node.attribute:
        if a.name == "algo":
            a.s = b"fft"  # cuDNN's FFT forward takes neither strides nor dilations
    # a graph-API engine the tuner may have chosen would run in its place: the decision is fft alone
    kept = [a for a in node.attribute if a.name not in ("engine", "fusion")]
    del node.attribute[:]
    node.attribute.extend(kept)
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 8, 16, 16)).astype(np.float32)}
    (ref,) = run_ort(model, feeds)
    with pytest.warns(_ExecutorWarning(), match="node 'conv': recorded algorithm 'fft'"):
        ex = Executor(tuned, device="cuda")
        (out,) = ex.run(None, feeds)
    assert _rel(out, ref) <= TF32_TOL
    (summary,) = ex.plan_summary()
    assert summary.source == "fallback" and summary.algo != "fft"


def test_data_dependent_plan_runs_eagerly():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 4, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["y"], ["r"], name="relu"),
            helper.make_node("NonZero", ["r"], ["idx"], name="nonzero"),
        ],
        "nz",
        [x],
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [4, "nnz"])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    want = Executor(model).run(None, feeds)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", _ExecutorWarning())
        ex = Executor(model, device="cuda", cuda_graph=True)
        for _ in range(3):
            (got,) = ex.run(None, feeds)
            np.testing.assert_array_equal(got, want)
    state = ex.last_plan.backend_state
    assert state.mode == "eager" and not state.captured and "NonZero" in state.note


# ---------------------------------------------------------------------------------------------
# feeds and outputs, start-up


def test_cupy_feeds_give_cupy_outputs(tmp_path_factory):
    path = MODELS / "residual_cnn.onnx"
    tuned = _tuned(path, tmp_path_factory)
    feeds, _ = _feeds(onnx.load(path))
    ex = Executor(tuned, device="cuda")
    host = ex.run(None, feeds)
    for _ in range(3):
        dev = ex.run(None, {k: cp.asarray(v) for k, v in feeds.items()})
        assert all(isinstance(d, cp.ndarray) for d in dev)
        for d, h in zip(dev, host):
            assert _rel(cp.asnumpy(d), h) <= 1e-5
    assert all(isinstance(h, np.ndarray) for h in host)
    forced = Executor(tuned, device="cuda", output_kind="numpy").run(None, {k: cp.asarray(v) for k, v in feeds.items()})
    assert all(isinstance(o, np.ndarray) for o in forced)


def test_dlpack_cuda_feeds_are_used_in_place(tmp_path_factory):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    path = MODELS / "residual_cnn.onnx"
    tuned = _tuned(path, tmp_path_factory)
    feeds, _ = _feeds(onnx.load(path))
    ex = Executor(tuned, device="cuda")
    host = ex.run(None, feeds)
    dev = ex.run(None, {k: torch.from_numpy(v).cuda() for k, v in feeds.items()})
    assert all(isinstance(d, cp.ndarray) for d in dev)
    for d, h in zip(dev, host):
        assert _rel(cp.asnumpy(d), h) <= 1e-5


def test_no_search_at_start_up(tmp_path_factory, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the executor called cuDNN Find")

    monkeypatch.setattr(cudnn, "find", refuse)
    monkeypatch.setattr(cudnn.api, "find", refuse)
    path = MODELS / "encoder_decoder.onnx"
    feeds, _ = _feeds(onnx.load(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", _ExecutorWarning())
        for model in (onnx.load(path), _tuned(path, tmp_path_factory)):
            ex = Executor(model, device="cuda")
            for _ in range(3):
                ex.run(None, feeds)


def test_matmul_tf32_follows_the_model_switch():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 1024)).astype(np.float32)
    b = numpy_helper.from_array(rng.standard_normal((1024, 256)).astype(np.float32), "b")
    b3 = numpy_helper.from_array(rng.standard_normal((4, 1024, 64)).astype(np.float32), "b3")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["a", "b"], ["y2"], name="mm2"),
            helper.make_node("Reshape", ["a", "shape"], ["a3"], name="reshape"),
            helper.make_node("MatMul", ["a3", "b3"], ["y3"], name="mm3"),
        ],
        "mm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [256, 1024])],
        [helper.make_tensor_value_info("y2", TensorProto.FLOAT, [256, 256]), helper.make_tensor_value_info("y3", TensorProto.FLOAT, [4, 64, 64])],
        [b, b3, numpy_helper.from_array(np.array([4, 64, 1024], np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    b64 = numpy_helper.to_array(b).astype(np.float64)
    b364 = numpy_helper.to_array(b3).astype(np.float64)
    want = [a.astype(np.float64) @ b64, a.astype(np.float64).reshape(4, 64, 1024) @ b364]
    errors = {}
    for flag in ("0", "1"):
        m = _set_meta(_set_meta(model, "convpass.schema_version", "1"), "convpass.matmul_allow_tf32", flag)
        ex = Executor(m, device="cuda")
        assert ex.model_info.matmul_allow_tf32 == (flag == "1")
        errors[flag] = [max(_rel(o, w) for o in (ex.run(None, {"a": a})[i] for _ in range(3))) for i, w in enumerate(want)]
    assert all(e < 1e-5 for e in errors["0"]), errors
    major = cp.cuda.Device().compute_capability[0]
    if int(major) >= 8:
        assert all(e > 5e-5 for e in errors["1"]), errors  # TF32 rounds the inputs to 10 mantissa bits


@pytest.mark.parametrize("engines", ["legacy", "all"])
def test_conv_epilogues_are_tuned_and_run_the_way_they_were_timed(engines, tmp_path):
    """conv1 + bias + Relu (``bias+relu``) and conv2 + bias + Add(x) + Relu (``bias+add+relu``):
    each epilogue timed as one pass after the conv and as cuDNN's fused call of the fastest legacy
    algorithms (checked against the reference first); the executor then makes the fused call
    exactly where the decision recorded one, and otherwise the conv and one pass."""
    from convpass.core.algo import Algo
    from convpass.core.problem import ProblemKey
    from convpass.native.device import detect
    from convpass.runtime.cuda import CudaBackend
    from convpass.tuning.cache import TuningCache
    from convpass.tuning.decide import EPILOGUE_METHOD

    model = residual_block_model()
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, tf32="on", engines=engines)
    records = {r["node"]: r for r in convpass.inspect(tuned)}
    shape = ProblemKey.parse(records["conv1"]["problem_key"]).shape  # both convs: one geometry
    with TuningCache(tmp_path / "c.db") as cache:
        rows = cache.get(detect(), shape)
    for name in ("bias+relu", "bias+add+relu"):
        assert any(m.method == EPILOGUE_METHOD and m.algo == name and m.status == "ok" for m in rows), name
        fused = [m for m in rows if Algo.parse(m.algo).fusion == name and not m.algo.startswith("engine:")]
        assert fused and all(m.status in ("ok", "unsupported") for m in fused), [(m.algo, m.status, m.note) for m in fused]
        assert any(m.status == "ok" for m in fused), [(m.algo, m.note) for m in fused]
    x = np.random.default_rng(8).standard_normal((2, 16, 14, 14)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", _ExecutorWarning())  # a recorded fused call cuDNN refuses would warn
        ex = Executor(tuned, device=CudaBackend(cuda_graph=False))
        ex.run(None, {"x": x})  # the first run builds the plan
        before = dict(ex._backend.counters)
        with cudnn.record_calls() as calls:
            outs = ex.run(None, {"x": x})
    counters = {k: v - before.get(k, 0) for k, v in ex._backend.counters.items()}
    legacy_fused = {n: r["fusion"] for n, r in records.items() if r["fusion"] and not r["engine"]}
    want = {"conv1": "fused_relu", "conv2": "fused_residual_relu"}
    for node, counter in want.items():
        assert counters[counter] == (1 if node in legacy_fused else 0), (node, records[node], counters)
    fused_calls = [c for c in calls if c.call == "cudnnConvolutionBiasActivationForward"]
    assert len(fused_calls) == len(legacy_fused), (legacy_fused, [c.call for c in calls])
    _check_against(outs, run_ort(model, {"x": x}), _tolerance(tuned), f"conv epilogues ({engines})")


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layouts", [("nchw", "nchw"), ("nhwc", "nhwc"), ("nhwc", "nchw")], ids=["nchw", "nhwc", "z-other-order"])
@pytest.mark.parametrize("bias,residual,relu", [(b, z, r) for b in (0, 1) for z in (0, 1) for r in (0, 1)])
def test_the_conv_epilogue_pass_matches_numpy(bias, residual, relu, layouts, dtype):
    """act(y + z + b) in one pass, in place, over the storage order of y (a residual in another
    memory order takes the logical path); NaN passes the ReLU as NaN."""
    from convpass.kernels.conv_exec import apply_epilogue

    rng = np.random.default_rng(3)
    shape = (2, 6, 5, 7)
    y0, z0, b0 = (rng.standard_normal(s).astype(dtype) for s in (shape, shape, (6,)))
    y0[0, 0, 0, 0] = np.nan
    y = cudnn.as_layout(cp.asarray(y0), layouts[0])
    z = cudnn.as_layout(cp.asarray(z0), layouts[1]) if residual else None
    apply_epilogue(cp, y, cp.asarray(b0) if bias else None, bool(relu), z)
    want = y0.astype(np.float64) + (z0 if residual else 0) + (b0.reshape(1, -1, 1, 1) if bias else 0)
    want = np.where(want < 0, 0, want) if relu else want
    got = cp.asnumpy(y).astype(np.float64)
    assert np.isnan(got[0, 0, 0, 0])
    np.testing.assert_allclose(got.ravel()[1:], want.ravel()[1:], rtol=2e-3 if dtype == np.float16 else 1e-6, atol=2e-3 if dtype == np.float16 else 1e-6)
    assert cudnn.layout_of(y) == layouts[0]


# ---------------------------------------------------------------------------------------------
# element-wise fusion (the generated kernels; grouping rules and kernel math: tests/test_cuda_fusion.py)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=["fp32", "fp16", "fp64"])
@pytest.mark.parametrize("case", sorted(fusion_cases.CASES))
def test_fused_elementwise_kernels_match_the_cpu_executor(case, dtype):
    """Each case is one fused kernel; float16 against the float32 model on the CPU, rounded once."""
    from convpass.runtime.cuda import CudaBackend

    nodes, extra, inits, opset = fusion_cases.CASES[case]

    def variant(dt):
        tp = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.float64: TensorProto.DOUBLE}[dt]
        cast = [fusion_cases._const(t.name, numpy_helper.to_array(t), dt) for t in inits]
        return fusion_cases._model(nodes, [("X", fusion_cases.X_SHAPE), *extra], "Y", tp, cast, opset)

    feeds = fusion_cases._feeds(extra, dtype)
    ref_dtype = np.float32 if dtype == np.float16 else dtype
    (ref,) = Executor(variant(ref_dtype), device="cpu").run(None, {k: v.astype(ref_dtype) for k, v in feeds.items()})
    ref = ref.astype(dtype)
    tol = {np.float32: 1e-5, np.float16: 2e-3, np.float64: 1e-12}[dtype]
    for graph in (False, True):
        backend = CudaBackend(cuda_graph=graph)
        ex = Executor(variant(dtype), device=backend)
        ex.run(None, feeds)
        (out,) = ex.run(None, feeds)
        assert backend.counters["fused_elementwise"] >= 1, (case, backend.notes)
        assert out.dtype == dtype
        # absolute tolerance on the data's scale: GELU's 1 + erf(x) cancels for negative x, so an
        # ulp of erf near -1 is a large relative error on a result near 0 (as in any evaluation)
        scale = float(np.max(np.abs(ref[np.isfinite(ref)]), initial=1.0))
        np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), rtol=tol, atol=tol * scale, equal_nan=True,
                                   err_msg=f"{case} {np.dtype(dtype)} graph={graph}")


@pytest.mark.parametrize("size", [(6, 8, 8), (6, 8, 5), (2 * 56 * 56, 96, 384)], ids=["small", "odd", "convnext"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", sorted(n for n, c in matmul_cases.CASES.items() if c[2] is not None))
def test_matmul_epilogues_run_as_one_cublaslt_call_and_match_the_cpu_executor(case, dtype, size, monkeypatch):
    """Each case is one cublasLtMatmul with its epilogue, eagerly and in the captured graph (also
    with rows 20 bytes apart, "odd"); float16 against the float32 model on the CPU."""
    from convpass.runtime.cuda import CudaBackend

    for attr, value in zip("MKC", size):
        monkeypatch.setattr(matmul_cases, attr, value)
    feeds = matmul_cases.feeds(case, dtype)
    (ref,) = Executor(matmul_cases.model(case, np.float32), device="cpu").run(None, {k: v.astype(np.float32) for k, v in feeds.items()})
    backend = CudaBackend()
    ex = Executor(matmul_cases.model(case, dtype), device=backend)
    outs = [ex.run(None, feeds)[0] for _ in range(3)]  # eager, capture, replay
    assert ex.graph_status().captured, ex.graph_status().describe()
    labels = [launch.label for launch in ex.last_plan.backend_state.launch_list()]
    assert matmul_cases.CASES[case][2] in labels, labels
    assert backend.blas().lt_calls >= 2, backend.notes  # eager and capture ran cuBLASLt, not the fallback
    tol = 1e-4 if dtype == np.float32 else 5e-3
    for out in outs:
        assert out.dtype == dtype and _rel(out, ref) < tol, (case, _rel(out, ref))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape,bias", [((2, 7, 5, 96), True), ((3, 768), False), ((4, 33), True)], ids=["nhwc96", "c768_nobias", "c33"])
def test_layer_norm_kernel_matches_the_cpu_executor(shape, bias, dtype):
    from convpass.runtime.cuda import CudaBackend

    tp = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    rng = np.random.default_rng(3)
    c = shape[-1]
    inits = [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(c)).astype(dtype), "g")]
    ins = ["x", "g"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(c).astype(dtype), "b"))
        ins.append("b")
    node = helper.make_node("LayerNormalization", ins, ["y"], axis=-1, epsilon=1e-5)
    graph = helper.make_graph([node], "ln", [helper.make_tensor_value_info("x", tp, shape)], [helper.make_tensor_value_info("y", tp, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = (3 + 2 * rng.standard_normal(shape)).astype(dtype)  # an offset mean: the centred variance matters
    (ref,) = Executor(model, device="cpu").run(None, {"x": x})
    for graph_mode in (False, True):
        backend = CudaBackend(cuda_graph=graph_mode)
        ex = Executor(model, device=backend)
        ex.run(None, {"x": x})
        (out,) = ex.run(None, {"x": x})
        from convpass.kernels.normalization import NormLaunch

        assert isinstance(ex.last_plan.backend_state.launches[0], NormLaunch), backend.notes
        assert out.dtype == dtype
        tol = 1e-5 if dtype == np.float32 else 2e-3
        np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), rtol=tol, atol=tol * 4)


# ---------------------------------------------------------------------------------------------
# fp16


@pytest.mark.parametrize(
    "op_type,x_shape,w_shape,attrs",
    [
        ("Conv", (2, 16, 14, 14), (32, 16, 3, 3), {"pads": [1, 1, 1, 1]}),
        ("ConvTranspose", (2, 16, 8, 8), (16, 8, 4, 4), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
        ("Conv", (2, 32, 14, 14), (32, 1, 3, 3), {"group": 32, "pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ],
    ids=["conv", "conv_transpose", "depthwise"],
)
def test_fp16_tuned_models(op_type, x_shape, w_shape, attrs, tmp_path):
    model = conv_model(op_type, x_shape, w_shape, elem_type=TensorProto.FLOAT16, **attrs)
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True)
    x = np.random.default_rng(5).standard_normal(x_shape).astype(np.float16)
    (ref,) = run_ort(model, {"x": x})
    ex = Executor(tuned, device="cuda")
    with cudnn.record_calls() as calls:
        (out,) = ex.run(None, {"x": x})
    assert out.dtype == np.float16
    _check_recorded_calls(calls, tuned, ex)
    err = np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref.astype(np.float64))
    assert err < 1e-2, err


# ---------------------------------------------------------------------------------------------
# the torchvision panel (when exported to .panel/ on this machine)


def _fp16_probe(ref_model: onnx.ModelProto, model: onnx.ModelProto, feeds: dict) -> tuple[str | None, np.ndarray | None]:
    """The deepest conv output of the float32 reference model whose values are comfortably inside
    float16's normal range (RMS >= 1e-2) and that the fp16 export also has, with its reference value.

    Random-weight exports of deep nets shrink their signal layer by layer: the final logits of
    mobilenet_v3_large / efficientnet_b0 are ~1e-10, below float16's smallest subnormal, so they
    are 0 in any float16 execution. A probe inside the network keeps the fp16 check meaningful."""
    fp16_names = {o for n in model.graph.node for o in n.output}
    candidates = [n.output[0] for n in ref_model.graph.node if n.op_type in annotation.CONV_OPS and n.output[0] in fp16_names]
    probe_model = onnx.ModelProto()
    probe_model.CopyFrom(ref_model)
    for name in candidates:
        probe_model.graph.output.append(helper.make_empty_tensor_value_info(name))
    values = run_ort(probe_model, {k: v.astype(np.float32) for k, v in feeds.items()})[len(ref_model.graph.output):]
    for name, v in reversed(list(zip(candidates, values))):
        if np.sqrt(np.mean(np.square(v, dtype=np.float64))) >= 1e-2:
            return name, v
    return None, None


def _check_panel_outputs(outs, refs, tol, what):
    """:func:`_check_against`, except that float16 outputs whose reference lies below float16's
    normal range are checked for shape and finiteness only (see :func:`test_panel_model`)."""
    assert len(outs) == len(refs)
    judged = []
    for got, want in zip(outs, refs):
        if want.dtype == np.float16 and np.sqrt(np.mean(np.square(want, dtype=np.float64))) < FP16_NORMAL_MIN:
            assert got.shape == want.shape and np.isfinite(got).all(), f"{what}: shape {got.shape} or non-finite values"
        else:
            judged.append((got, want))
    assert judged, f"{what}: no output in float16's normal range to judge"
    _check_against([g for g, _ in judged], [w for _, w in judged], tol, what)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("name", panel_models())
def test_panel_model(name, precision, tmp_path):
    """fp16 exports (``export_panel.py --fp16``) are checked against ONNX Runtime CPU running the
    same export widened to float32 (its own float16 weights: :func:`conftest.as_float32`) on the
    same, fp16-rounded, inputs, normwise 1e-2: the outputs rounded to float16, and one inner conv
    output (:func:`_fp16_probe`) added as a model output. So the tolerance judges float16
    arithmetic alone. (Against the fp32 export, the rounding of the weights to float16 alone put
    efficientnet_v2_s's probe 1.37% off: ONNX Runtime CPU in float32 with the fp16 export's
    weights, measured 2026-11-24, exactly convpass's own float16 error there.)
    An output below float16's normal range (RMS < 2**-14) is only checked for shape and
    finiteness: it was computed through subnormal intermediates, where float16 keeps few bits
    (PyTorch's own fp16 run of efficientnet_v2_s, logits RMS ~1e-6: 20-87% error in the last
    blocks' outputs); the probe checks the computation where float16 has its full precision."""
    path = PANEL / (f"{name}_fp16.onnx" if precision == "fp16" else f"{name}.onnx")
    if not path.exists():
        flag = " --fp16" if precision == "fp16" else ""
        pytest.skip(f"{path} not exported (python3 models/export_panel.py --out .panel --models {name}{flag})")
    model = onnx.load(path)
    ref_model = as_float32(model) if precision == "fp16" else model
    feeds, shapes = _feeds(model, batch=PANEL_BATCH)
    refs = run_ort(ref_model, {k: v.astype(np.float32) for k, v in feeds.items()})
    tol = 1e-2 if precision == "fp16" else None
    if precision == "fp16":
        refs = [r.astype(np.float16) for r in refs]
        if any(np.sqrt(np.mean(np.square(r, dtype=np.float64))) < 1e-2 for r in refs):
            probe, probe_ref = _fp16_probe(ref_model, model, feeds)
            assert probe is not None, "no conv output of the reference has RMS >= 1e-2"
            model.graph.output.append(helper.make_tensor_value_info(probe, TensorProto.FLOAT16, ["batch", *probe_ref.shape[1:]]))
            refs.append(probe_ref)
            path = tmp_path / path.name
            onnx.save(model, path)
    cache = os.environ.get("CONVPASS_TUNE_CACHE") or tmp_path / "c.db"
    tuned = convpass.optimize(path, cache=cache, shapes=shapes, quiet=True, **PANEL_OPTIONS[precision])
    tol = tol or _tolerance(tuned)
    with warnings.catch_warnings():
        warnings.simplefilter("error", _ExecutorWarning())
        ex = Executor(tuned, device="cuda")
        with cudnn.record_calls() as calls:
            first = ex.run(None, feeds)
    _check_recorded_calls(calls, tuned, ex)
    assert all(o.dtype == (np.float16 if precision == "fp16" else np.float32) for o in first)
    _check_panel_outputs(first, refs, tol, f"{name} {precision} first run")
    for i in range(3):
        _check_panel_outputs(ex.run(None, feeds), refs, tol, f"{name} {precision} run {i + 2}")
    assert ex.graph_status().captured, ex.graph_status().describe()


def _depthwise_model() -> onnx.ModelProto:
    """Depthwise convs the way MobileNets and ConvNeXt have them: 3x3 + bias + Relu, 5x5 stride 2 +
    bias, 7x7 + bias + residual Add + Relu, and a 3x3 without bias written into a Concat slice."""
    rng = np.random.default_rng(11)
    c = 16

    def w(name, k):
        return numpy_helper.from_array((rng.standard_normal((c, 1, k, k)) * 0.2).astype(np.float32), name)

    def b(name):
        return numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w3", "b3"], ["y3"], name="dw3", group=c, pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["y3"], ["r3"], name="relu3"),
        helper.make_node("Conv", ["r3", "w5", "b5"], ["y5"], name="dw5s2", group=c, pads=[2, 2, 2, 2], strides=[2, 2]),
        helper.make_node("Identity", ["y5"], ["out5"], name="id5"),  # a conv that is a graph output has no epilogue step
        helper.make_node("Conv", ["r3", "w7", "b7"], ["y7"], name="dw7", group=c, pads=[3, 3, 3, 3]),
        helper.make_node("Add", ["y7", "r3"], ["s7"], name="add7"),
        helper.make_node("Relu", ["s7"], ["r7"], name="relu7"),
        helper.make_node("Conv", ["r7", "wc"], ["yc"], name="dwcat", group=c, pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["yc", "r7"], ["cat"], name="cat", axis=1),
    ]
    graph = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, 20, 20])],
                              [helper.make_tensor_value_info("out5", TensorProto.FLOAT, [2, c, 10, 10]), helper.make_tensor_value_info("cat", TensorProto.FLOAT, [2, 2 * c, 20, 20])],
                              [w("w3", 3), b("b3"), w("w5", 5), b("b5"), w("w7", 7), b("b7"), w("wc", 3)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_own_depthwise_kernels_are_tuned_checked_and_run_as_recorded(layout, tmp_path):
    """The tuner times convpass's depthwise kernel beside cuDNN (every variant checked against the
    reference, the fastest also with its epilogue); with the kernel recorded for every conv
    (its rows made fastest in the cache), the executor runs it, in one CUDA graph, with the
    epilogues where they were recorded, and matches ONNX Runtime."""
    import dataclasses

    from convpass.core.algo import Algo
    from convpass.core.problem import ProblemKey
    from convpass.native.device import detect
    from convpass.runtime.cuda import CudaBackend
    from convpass.tuning.cache import TuningCache

    def is_own(text):
        return Algo.parse(text).is_own

    model = _depthwise_model()
    db = tmp_path / "c.db"
    first_tuning = convpass.optimize(model, cache=db, quiet=True, tf32="on", engines="legacy", layout=layout)
    device = detect()
    with TuningCache(db) as cache:
        shapes = {ProblemKey.parse(r["problem_key"]).shape for r in convpass.inspect(first_tuning)}
        rows = [m for s in shapes for m in cache.get(device, s)]
        own = [m for m in rows if is_own(m.algo)]
        assert {m.key.shape for m in own} == shapes
        assert all(m.status == "ok" for m in own), [(m.algo, m.status, m.note) for m in own if m.status != "ok"]
        assert {Algo.parse(m.algo).fusion for m in own} >= {"", "bias+relu", "bias", "bias+add+relu"}
        cache.put(device, [dataclasses.replace(m, time_ms=1e-6) for m in own])  # now the fastest everywhere
    tuned = convpass.optimize(model, cache=db, quiet=True, tf32="on", engines="legacy", layout=layout)
    records = {r["node"]: r for r in convpass.inspect(tuned)}
    assert all(is_own(r["algo"]) for r in records.values()), records
    assert {n: r["fusion"] for n, r in records.items()} == {"dw3": "bias+relu", "dw5s2": "bias", "dw7": "bias+add+relu", "dwcat": None}
    x = np.random.default_rng(12).standard_normal((2, 16, 20, 20)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", _ExecutorWarning())  # a recorded kernel that cannot run would warn
        ex = Executor(tuned, device=CudaBackend())
        first = ex.run(None, {"x": x})  # op by op: the run that records the plan
        before = dict(ex._backend.counters)
        ex.run(None, {"x": x})  # the plan's launches (warm-up, capture)
        counters = {k: v - before.get(k, 0) for k, v in ex._backend.counters.items()}
        outs = [ex.run(None, {"x": x}) for _ in range(2)][-1]  # replayed
    assert ex.graph_status().captured, ex.graph_status().describe()
    assert counters.get("own_kernel_calls", 0) >= 4 and not counters.get("cudnn_calls"), counters
    assert counters.get("fused_relu") and counters.get("fused_identity") and counters.get("fused_residual_relu"), counters
    refs = run_ort(model, {"x": x})
    _check_against(first, refs, FMA_TOL, f"own depthwise kernels ({layout})")
    _check_against(outs, refs, FMA_TOL, f"own depthwise kernels, replayed ({layout})")

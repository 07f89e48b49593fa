"""Choosing from measurements (shared by the tuner and the cache backend), candidate keys, cache
completeness, and cache-only optimize on a machine without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import conv_model, random_input, run_ort

import convpass
from convpass.compiler.passes.canonicalize_convs import canonicalize_conv
from convpass.core import annotation
from convpass.core.device import DeviceFingerprint
from convpass.core.errors import ConvpassError
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.candidates import skip_reason
from convpass.tuning.decide import select
from convpass.tuning.tuner import candidate_keys, complete

H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)
SHAPE = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, (1, 3, 8, 8), (4, 3, 3, 3)).shapes[0]
PROBLEM = ConvProblem((SHAPE,))


def m(layout, math, algo, time_ms, method="measure", status="ok", ws=0, det=True, hr=None, fr=None, shape=SHAPE):
    return Measurement(shape.key(layout, math), algo, status, time_ms, ws, det, 1.0, method, heuristic_rank=hr, find_rank=fr)


ROWS = [
    m("nchw", "default", "implicit_gemm", 0.020),
    m("nchw", "default", "fft", 0.012, ws=1 << 20),
    m("nchw", "default", "winograd_nonfused", None, status="wrong_result"),
    m("nhwc", "default", "implicit_precomp_gemm", 0.015),
    m("nchw", "fma", "implicit_gemm", 0.030),
    m("nchw", "fma", "gemm", 0.018),
    m("nhwc", "fma", "implicit_gemm", 0.011, det=False),
    m("nchw", "default", "implicit_precomp_gemm", None, method="heuristic", hr=0),
    m("nchw", "default", "implicit_gemm", None, method="heuristic", hr=1),
    m("nhwc", "default", "implicit_gemm", None, method="heuristic", hr=0),
    m("nchw", "default", "gemm", 0.050, method="find", fr=0),
    m("nchw", "default", "implicit_gemm", 0.060, method="find", fr=1),
    m("nchw", "default", "implicit_precomp_gemm", 0.016),
    m("nchw", "default", "gemm", 0.025),
]


@pytest.mark.parametrize(
    "options,expected",
    [
        (TuneOptions(), ("nhwc", "fma", "implicit_gemm")),
        (TuneOptions(deterministic=True), ("nchw", "default", "fft")),
        (TuneOptions(deterministic=True, workspace_limit=0), ("nhwc", "default", "implicit_precomp_gemm")),
        (TuneOptions(tf32="off"), ("nhwc", "fma", "implicit_gemm")),
        (TuneOptions(tf32="off", layout="nchw"), ("nchw", "fma", "gemm")),
        (TuneOptions(tf32="on", layout="nchw"), ("nchw", "default", "fft")),
        (TuneOptions(fprop_algo="gemm"), ("nchw", "fma", "gemm")),
        (TuneOptions(mode="heuristic"), ("nchw", "default", "implicit_precomp_gemm")),
        (TuneOptions(fprop_algo="normal", layout="nhwc"), ("nhwc", "default", "implicit_gemm")),
        (TuneOptions(mode="exhaustive"), ("nchw", "default", "gemm")),
    ],
)
def test_select_follows_strategy_and_constraints(options, expected):
    chosen = select(ROWS, PROBLEM, options)
    assert (chosen.key.layout, chosen.key.math, chosen.algo) == expected


def test_select_reports_our_own_timing_of_heuristic_and_find_choices():
    assert select(ROWS, PROBLEM, TuneOptions(mode="heuristic")).time_ms == 0.016
    assert select(ROWS, PROBLEM, TuneOptions(mode="exhaustive")).time_ms == 0.025


def test_nothing_allowed_gives_none():
    assert select(ROWS, PROBLEM, TuneOptions(fprop_algo="direct")) is None
    assert select([r for r in ROWS if r.status != "ok"], PROBLEM, TuneOptions()) is None


def test_candidate_keys_cover_mappings_layouts_and_math():
    can = canonicalize_conv("Conv", {}, (1, 2, 30), (3, 2, 5))
    problem = ConvProblem(can.shapes)
    assert len(candidate_keys(problem, TuneOptions())) == 2 * 2 * 2
    assert len(candidate_keys(problem, TuneOptions(layout="nhwc", tf32="on"))) == 2
    half = ConvProblem((SHAPE.__class__(**{**SHAPE.__dict__, "dtype": "float16"}),))
    assert {k.math for k in candidate_keys(half, TuneOptions(tf32="off"))} == {"default"}


def test_complete_knows_what_each_strategy_needs():
    from convpass.core.cudnn_enums import algo_names

    keys = [SHAPE.key("nchw", "default")]
    heur = [m("nchw", "default", "implicit_gemm", None, method="heuristic", hr=0)]
    all_timed = [m("nchw", "default", a, 0.01) for a in algo_names("fwd")]
    assert not complete([], keys, "measure", None)
    assert not complete(heur, keys, "measure", None)
    assert complete(heur + all_timed, keys, "measure", None)
    assert not complete(heur + all_timed[:2], keys, "measure", None)
    assert complete(heur + all_timed[:1], keys, "heuristic", None)
    assert not complete(heur, keys, "heuristic", None)
    assert complete(heur + all_timed[:3], keys, "forced", "gemm")
    assert not complete(heur + all_timed, keys, "exhaustive", None)


def _fill_cache(path, shapes_rows):
    with TuningCache(path) as cache:
        cache.put(H200, shapes_rows)


def test_cache_only_optimize_without_gpu(tmp_path):
    """A build machine without a GPU applies measurements imported from a GPU machine."""
    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1])
    gpu_cache = tmp_path / "gpu.db"
    _fill_cache(gpu_cache, ROWS)
    TuningCache(gpu_cache).export_json(tmp_path / "h200.json")
    build_cache = tmp_path / "build.db"
    TuningCache(build_cache).import_json(tmp_path / "h200.json")

    tuned = convpass.optimize(model, cache=build_cache, device_name="H200", quiet=True)
    (record,) = convpass.inspect(tuned)
    assert (record["algo"], record["memory_format"], record["math_mode"], record["source"]) == ("implicit_gemm", "NHWC", "fma", "cache")
    assert record["time_ms"] == pytest.approx(0.011) and record["tf32"] is False
    assert record["problem_key"] == str(SHAPE.key("nhwc", "fma"))
    info = annotation.read_model_info(tuned)
    assert info.device == str(H200) and info.cudnn_version == "91900"
    assert info.options["layout"] == "auto" and info.options["layout_applied"] == "per-conv"
    for want, got in zip(run_ort(model, {"x": random_input((1, 3, 8, 8))}), run_ort(tuned, {"x": random_input((1, 3, 8, 8))})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_cache_only_optimize_leaves_unknown_problems_auto(tmp_path):
    _fill_cache(tmp_path / "c.db", ROWS)
    model = conv_model("Conv", (1, 3, 16, 16), (4, 3, 3, 3))  # a problem the cache has not seen
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", device_name="H200", quiet=True)
    assert convpass.inspect(tuned)[0]["algo"] == "auto"


def test_nothing_decided_from_the_cache_says_nothing_about_layouts(tmp_path):
    from convpass.compiler.pipeline import optimize_model
    from convpass.core.model_io import load_model

    _fill_cache(tmp_path / "c.db", ROWS)
    model = load_model(conv_model("Conv", (1, 3, 16, 16), (4, 3, 3, 3)))  # a problem the cache has not seen
    report = optimize_model(model, TuneOptions(), cache=tmp_path / "c.db", device_name="H200")
    assert report.decided == 0 and report.layout_mode is None  # no conv costs: no transposes asked for
    assert not any("transpose" in note for note in report.notes), report.notes


def test_unknown_device_name_lists_known_devices(tmp_path):
    _fill_cache(tmp_path / "c.db", ROWS)
    with pytest.raises(ConvpassError, match="H200"):
        convpass.optimize(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), cache=tmp_path / "c.db", device_name="A100", quiet=True)


def test_device_name_with_a_cache_that_does_not_exist_is_an_error_and_creates_nothing(tmp_path):
    with pytest.raises(ConvpassError, match=r"^device_name H200: tuning cache .*nowhere\.db does not exist; .* with cache "):
        convpass.optimize(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), cache=tmp_path / "nowhere.db", device_name="H200", quiet=True)
    assert list(tmp_path.iterdir()) == []


def test_fft_tiling_is_skipped_on_many_groups_unless_forced():
    depthwise = canonicalize_conv("Conv", {"group": 64, "pads": [1, 1, 1, 1]}, (1, 64, 14, 14), (64, 1, 3, 3)).shapes[0]
    key = depthwise.key("nchw", "default")
    assert "per group" in skip_reason(key, "fft_tiling", forced=False)
    assert skip_reason(key, "fft_tiling", forced=True) is None
    assert skip_reason(key, "implicit_gemm", forced=False) is None
    assert skip_reason(SHAPE.key("nchw", "default"), "fft_tiling", forced=False) is None


def test_cache_only_layout_auto_says_it_cannot_plan(tmp_path):
    from convpass.compiler.pipeline import optimize_model
    from convpass.core.model_io import load_model

    _fill_cache(tmp_path / "c.db", ROWS)
    model = load_model(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1]))
    report = optimize_model(model, TuneOptions(), cache=tmp_path / "c.db", device_name="H200")
    assert report.layout_mode == "per-conv" and not report.layout_plans
    assert any("holds none for 2 tensor shape(s)" in note and "1x3x8x8 float32" in note for note in report.notes)


# The one conv of _layout_model: fastest in NHWC (0.011 ms) by 1 us, so with 0.05 ms per transpose
# of its NCHW input and output the whole-graph plan keeps it in NCHW (fft, 0.012 ms).
def _layout_model():
    return conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1])


def _decisions(report_model, source=False):
    from convpass.core.model_io import to_proto

    return [(r["algo"], r["memory_format"], r["math_mode"], *((r["source"],) if source else ()))
            for r in convpass.inspect(to_proto(report_model))]


def test_cache_only_plans_layouts_with_recorded_transposes(tmp_path):
    from convpass.compiler.pipeline import optimize_model
    from convpass.core.model_io import load_model

    _fill_cache(tmp_path / "c.db", ROWS)
    with TuningCache(tmp_path / "c.db") as cache:
        for dims in ((1, 3, 8, 8), (1, 4, 8, 8)):
            cache.put_transpose(H200, dims, "float32", 0.05)
    model = load_model(_layout_model())
    report = optimize_model(model, TuneOptions(), cache=tmp_path / "c.db", device_name="H200")
    assert report.layout_mode is None and not report.notes
    assert _decisions(model) == [("fft", "NCHW", "default")]
    per_conv = load_model(_layout_model())
    optimize_model(per_conv, TuneOptions(layout="per-conv"), cache=tmp_path / "c.db", device_name="H200")
    assert _decisions(per_conv) == [("implicit_gemm", "NHWC", "fma")]


def test_measured_and_cached_runs_plan_the_same_layouts(tmp_path, monkeypatch):
    """The tuner records the transposes it times; a cached re-run (tuner or cache-only) reads them
    and decides exactly as the run that measured (no GPU here: measurement is simulated)."""
    import contextlib
    import sys
    import types

    from convpass.compiler.pipeline import optimize_model
    from convpass.core.model_io import load_model
    from convpass.tuning import tuner

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=lambda **_: contextlib.nullcontext())))
    measured: list = []
    monkeypatch.setattr(tuner, "measure_problem", lambda problem, options, have=(), pruner=None: measured.append(problem) or list(ROWS))
    monkeypatch.setattr(tuner, "problem_complete", lambda rows, problem, options: bool(rows))
    transposes: list = []
    monkeypatch.setattr(tuner, "measure_transpose", lambda dims, dtype: transposes.append(dims) or 0.05)

    from convpass.core.model_io import to_proto

    def run(backend=None, **kw):
        model = load_model(_layout_model())
        report = optimize_model(model, TuneOptions(), backend=backend, **kw)
        return _decisions(model, source=True), report, to_proto(model).SerializeToString()

    with TuningCache(tmp_path / "c.db") as cache:
        fresh, report, fresh_bytes = run(tuner.CudnnTuner(cache, H200))
        assert measured and sorted(transposes) == [(1, 3, 8, 8), (1, 4, 8, 8)] and report.layout_plans
        assert fresh == [("fft", "NCHW", "default", "measure")]  # a planned decision says how it was decided
        measured.clear(), transposes.clear()
        again, _, again_bytes = run(tuner.CudnnTuner(cache, H200))
        assert not measured and not transposes
        # the strategy decided, now or before: the re-run writes the same model, byte for byte
        assert again_bytes == fresh_bytes
    replay, report, _ = run(cache=tmp_path / "c.db", device_name="H200")
    assert replay == [("fft", "NCHW", "default", "cache")] and report.layout_plans  # looked up without the GPU

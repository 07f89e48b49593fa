"""cuDNN graph-API engines as a second tuning space, on the CPU: configuration names, the
``--engines`` space in selection and cache completeness, the legacy fallback, the annotation
(schema 3) and what happens without the nvidia-cudnn-frontend package."""

from __future__ import annotations

import json
import logging
import types

import onnx
import pytest
from conftest import conv_model, fake_cuda, no_plan_side_car, numpy_candidates, offer_configs

import convpass
from convpass.compiler.passes.canonicalize_convs import canonicalize_conv
from convpass.core import annotation
from convpass.core.algo import Algo
from convpass.core.device import DeviceFingerprint
from convpass.core.errors import OptionError
from convpass.core.options import TuneOptions
from convpass.core.problem import ConvProblem
from convpass.native.cudnn import graph_api
from convpass.native.cudnn.graph_api import EngineConfig
from convpass.tuning import tuner
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement
from convpass.tuning.decide import CacheBackend, choice_from, legacy_fallback, select

H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)


def is_engine(text):
    return bool(text) and Algo.parse(text).is_engine
SHAPE = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, (2, 3, 8, 8), (4, 3, 3, 3)).shapes[0]
PROBLEM = ConvProblem((SHAPE,))
ENG5 = "engine:eng5"
ENG67 = "engine:eng67_k2=16_k13=0_k18=0"


def m(layout, algo, time_ms, method="measure", status="ok", hr=None, math="default"):
    return Measurement(SHAPE.key(layout, math), algo, status, time_ms, 0, True, 1.0, method, heuristic_rank=hr)


ROWS = [
    m("nchw", "implicit_gemm", 0.030),
    m("nchw", "implicit_precomp_gemm", None, method="heuristic", hr=0),
    m("nhwc", "implicit_gemm", 0.020),
    m("nhwc", "implicit_precomp_gemm", 0.025),
    m("nhwc", "implicit_precomp_gemm", None, method="heuristic", hr=0),
    m("nhwc", ENG5, 0.010),
    m("nchw", ENG67, 0.015),
    m("nhwc", ENG67, None, status="wrong_result"),
    m("nchw", "engine:none", None, status="unsupported"),
]


@pytest.mark.parametrize(
    "text,engine_id,knobs",
    [("eng5", 5, ()), ("engine:eng5", 5, ()), ("eng67_k2=16_k13=0_k18=0", 67, ((2, 16), (13, 0), (18, 0))),
     ("engine:eng3_k11=-1", 3, ((11, -1),)), ("eng9_k5=2_k3=0", 9, ((3, 0), (5, 2)))],
)
def test_engine_names_round_trip(text, engine_id, knobs):
    config = EngineConfig.parse(text)
    assert (config.engine_id, config.knobs) == (engine_id, knobs)
    assert EngineConfig.parse(config.name) == config == EngineConfig.parse(config.algo)
    assert config.algo == "engine:" + config.name and is_engine(config.algo)


@pytest.mark.parametrize("text", ["implicit_gemm", "engine:", "engine:none", "eng", "eng5_k2", "eng5 k2=1", "engX"])
def test_bad_engine_names_are_refused(text):
    with pytest.raises(ValueError, match="not a cuDNN engine configuration"):
        EngineConfig.parse(text)


def test_only_the_prefix_marks_an_engine():
    assert not is_engine("implicit_gemm") and not is_engine("") and not is_engine(None)
    assert is_engine("engine:none")


@pytest.mark.parametrize(
    "engines,expected",
    [("all", ("nhwc", ENG5)), ("graph", ("nhwc", ENG5)), ("legacy", ("nhwc", "implicit_gemm"))],
)
def test_the_engine_space_option_chooses_the_candidates(engines, expected):
    chosen = select(ROWS, PROBLEM, TuneOptions(tf32="on", engines=engines))
    assert (chosen.key.layout, chosen.algo) == expected


def test_graph_space_in_one_layout_and_no_engine_at_all():
    assert select(ROWS, PROBLEM, TuneOptions(tf32="on", engines="graph", layout="nchw")).algo == ENG67
    legacy_only = [r for r in ROWS if not is_engine(r.algo)]
    assert select(legacy_only, PROBLEM, TuneOptions(tf32="on", engines="graph")) is None
    assert select(legacy_only, PROBLEM, TuneOptions(tf32="on", engines="all")).algo == "implicit_gemm"


def test_engines_belong_to_the_measure_mode_and_the_forward_direction():
    assert TuneOptions().engine_space("fwd") == (True, True)
    assert TuneOptions(engines="graph").engine_space("fwd") == (False, True)
    assert TuneOptions(engines="graph").engine_space("dgrad") == (True, False)
    assert TuneOptions(engines="legacy").engine_space("fwd") == (True, False)
    assert TuneOptions(mode="heuristic").engine_space("fwd") == (True, False)
    assert TuneOptions(fprop_algo="gemm", engines="graph").engine_space("fwd") == (True, False)
    with pytest.raises(OptionError, match="--engines"):
        TuneOptions(engines="fast")


def test_an_engine_choice_carries_the_nearest_legacy_algorithm():
    chosen = select(ROWS, PROBLEM, TuneOptions(tf32="on"))
    choice = choice_from(chosen, "measure", ROWS)
    assert choice.algo == ENG5 and choice.fallback == "implicit_gemm"  # fastest legacy, same key (NHWC)
    nchw = SHAPE.key("nchw", "default")
    assert legacy_fallback(ROWS, nchw) == "implicit_gemm"
    heuristic_only = [r for r in ROWS if r.method == "heuristic"]
    assert legacy_fallback(heuristic_only, nchw) == "implicit_precomp_gemm"
    assert legacy_fallback([], nchw) is None
    assert choice_from(m("nchw", "gemm", 0.1), "measure", ROWS).fallback is None  # legacy choices need none


def test_cache_completeness_needs_an_engine_row_per_key():
    keys = [SHAPE.key("nchw", "default"), SHAPE.key("nhwc", "default")]
    from convpass.core.cudnn_enums import algo_names

    legacy = [m(layout, a, 0.1) for layout in ("nchw", "nhwc") for a in algo_names("fwd")]
    legacy += [m(layout, "implicit_gemm", None, method="heuristic", hr=0) for layout in ("nchw", "nhwc")]
    assert tuner.complete(legacy, keys, "measure", None, legacy=True, engines=False)
    assert not tuner.complete(legacy, keys, "measure", None, legacy=True, engines=True)
    with_engines = legacy + [m("nchw", ENG5, 0.1), m("nhwc", "engine:none", None, status="unsupported")]
    assert tuner.complete(with_engines, keys, "measure", None, legacy=True, engines=True)
    # graph only: the legacy algorithms need not be timed, only ranked
    ranked = [r for r in with_engines if r.method == "heuristic" or is_engine(r.algo)]
    assert tuner.complete(ranked, keys, "measure", None, legacy=False, engines=True)
    assert not tuner.complete(ranked, keys, "measure", None, legacy=True, engines=True)


def test_without_the_frontend_graph_is_an_error_and_all_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(graph_api, "unavailable", lambda: "the nvidia-cudnn-frontend package is not installed")
    monkeypatch.setattr(tuner, "_warned_no_graph_api", set())
    with pytest.raises(OptionError, match="--engines graph: the nvidia-cudnn-frontend package is not installed"):
        tuner.spaces(PROBLEM, TuneOptions(engines="graph"))
    with caplog.at_level(logging.WARNING, logger="convpass"):
        assert tuner.spaces(PROBLEM, TuneOptions()) == (True, False)
        assert tuner.spaces(PROBLEM, TuneOptions()) == (True, False)
    assert sum("graph-API engines are not tuned" in r.getMessage() for r in caplog.records) == 1
    assert tuner.spaces(PROBLEM, TuneOptions(engines="legacy")) == (True, False)


def test_unavailable_names_the_reason_on_a_machine_without_the_package():
    try:
        import cudnn  # noqa: F401
    except ImportError:
        assert "nvidia-cudnn-frontend" in graph_api.unavailable()
    else:
        pytest.skip("nvidia-cudnn-frontend is installed here")


def _tuned_from_cache(tmp_path, rows, **options):
    """A one-conv model decided from a recorded cache (no GPU)."""
    model = conv_model("Conv", (2, 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1])
    cache = TuningCache(tmp_path / "c.db")
    cache.put(H200, rows)
    cache.close()
    return convpass.optimize(model, cache=tmp_path / "c.db", device_name=str(H200), quiet=True, tf32="on", **options)


def test_a_tuned_model_records_the_engine_and_its_legacy_fallback(tmp_path):
    tuned = _tuned_from_cache(tmp_path, ROWS, layout="per-conv")
    onnx.checker.check_model(tuned, full_check=True)
    [record] = convpass.inspect(tuned)
    assert (record["engine"], record["algo"], record["memory_format"]) == ("eng5", "implicit_gemm", "NHWC")
    info, [node] = annotation.read_annotations(tuned)
    assert info.schema_version == annotation.SCHEMA_VERSION == 7
    assert node.decisions[0].engine == "eng5" and not node.decisions[0].is_auto
    legacy = _tuned_from_cache(tmp_path / "l", ROWS, layout="per-conv", engines="legacy")
    [record] = convpass.inspect(legacy)
    assert (record["engine"], record["algo"]) == (None, "implicit_gemm")
    assert not any(a.name == "engine" for n in legacy.graph.node for a in n.attribute)


def test_engine_attribute_round_trips_per_table_and_profile():
    decisions = [annotation.ConvDecision(algo="gemm", engine="eng5"), annotation.ConvDecision(algo="gemm"),
                 annotation.ConvDecision(algo=annotation.AUTO, engine="eng67_k2=16")]
    attrs = annotation.decision_attributes(decisions)
    assert attrs["engine"] == ["eng5", "", "eng67_k2=16"]
    node = onnx.helper.make_node("Conv", ["x", "w"], ["y"], domain=annotation.DOMAIN, **attrs)
    read = annotation.read_node(node, n_profiles=3)
    assert [d.engine for d in read.decisions] == ["eng5", "", "eng67_k2=16"]
    assert [d.is_auto for d in read.decisions] == [False, False, False]
    plain = onnx.helper.make_node("Conv", ["x", "w"], ["y"], domain=annotation.DOMAIN, algo="gemm")
    assert annotation.read_node(plain, n_profiles=1).decisions[0].engine == ""  # schema 2 nodes read as legacy


def test_the_cache_backend_chooses_engines_from_recorded_rows(tmp_path):
    cache = TuningCache(tmp_path / "c.db")
    cache.put(H200, ROWS)
    [choice] = CacheBackend(cache, H200).decide([PROBLEM], TuneOptions(tf32="on")).values()
    assert (choice.algo, choice.fallback, choice.source) == (ENG5, "implicit_gemm", "cache")
    cache.close()


class _Notes:
    def __init__(self):
        self.said = []
        self.kernel_file = None

    def note_once(self, tag, message, warn=True, category=None):
        self.said.append((tag, message, category))


def test_plans_built_at_start_up_are_reported_once_they_take_time():
    from convpass.native.cuda import StartupCompileWarning
    from convpass.runtime.cuda.startup import note_engine_builds

    quick = _Notes()
    why = "the model's kernel side-car does not store it"
    note_engine_builds(quick, [("conv1", 0.001, why), ("conv2", 0.002, why)])  # engines cuDNN does not compile
    assert quick.said == []
    slow = _Notes()
    note_engine_builds(slow, [("a", 0.01, why), ("dw1", 0.21, why), ("dw2", 0.64, why), ("b", 0.0, why), ("dw3", 0.2, why)])
    [(tag, message, category)] = slow.said
    assert tag == "engine-build" and category is StartupCompileWarning
    assert message.startswith("5 cuDNN graph-API plan(s) built at start-up in 1.06 s (slowest: 'dw2' 0.64 s, 'dw1' 0.21 s, 'dw3' 0.20 s)")
    assert message.endswith(f"and {why} (`convpass compile` on a GPU stores them)")


# ---------------------------------------------------------------------------------------------
# the tuner's engine bookkeeping, on NumPy stand-ins for CuPy and the frontend (no timing invented:
# the "times" below are the fakes' own numbers, and only statuses and notes are checked)

class _FakePlan:
    """Engine ids: 1 right, 2 not buildable, 3 wrong, 4 not capturable, 5 slow, 6 right and fast."""

    last = None
    ms = {1: 0.010, 3: 0.010, 4: 0.008, 5: 0.200, 6: 0.005}

    def __init__(self, key, config, enumerated=None):
        if config.engine_id == 2:
            raise graph_api.GraphApiError(f"cuDNN does not build {config.name} for {key}: NOT_SUPPORTED")
        self.config = config
        self.workspace_bytes = 64 * config.engine_id

    def execute(self, x, w, y, workspace=None):
        _FakePlan.last = self
        y[...] = x.sum() if self.config.engine_id != 3 else -1.0


def _fake_timing(launch, sets, best_ms=None, **_):
    from convpass.tuning.harness import Timing

    launch(0)
    ms = _FakePlan.ms[_FakePlan.last.config.engine_id]
    return Timing(ms, 10, 0.0, early_stop=best_ms is not None and ms > 4 * best_ms, eager=_FakePlan.last.config.engine_id == 4)


@pytest.fixture
def engine_bench(monkeypatch):
    from convpass.tuning import harness

    monkeypatch.setattr(graph_api, "EnginePlan", _FakePlan)
    monkeypatch.setattr(harness, "time_launches", _fake_timing)
    return numpy_candidates(monkeypatch, SHAPE)


def test_every_engine_configuration_gets_a_row_with_its_status_and_reason(engine_bench, monkeypatch):
    offer_configs(monkeypatch, lambda key, fusion="": [EngineConfig(i, (), fusion) for i in (1, 2, 3, 4, 5, 6)])
    key = SHAPE.key("nhwc", "default")
    rows = {r.algo: r for r in engine_bench.measure_engines(key, best_ms=0.02)}
    assert {a: r.status for a, r in rows.items()} == {
        "engine:eng1": "ok", "engine:eng2": "unsupported", "engine:eng3": "wrong_result",
        "engine:eng4": "unsupported", "engine:eng5": "ok", "engine:eng6": "ok"}
    assert all(r.key == key and r.method == "measure" for r in rows.values())
    assert "NOT_SUPPORTED" in rows["engine:eng2"].note
    assert "relative error" in rows["engine:eng3"].note and rows["engine:eng3"].time_ms is None
    assert "cannot be captured into a CUDA graph" in rows["engine:eng4"].note
    assert "early stop" in rows["engine:eng5"].note  # over 4x the best so far (eng1's 0.010 ms)
    assert rows["engine:eng6"].time_ms == 0.005 and "plan built in" in rows["engine:eng6"].note
    assert rows["engine:eng6"].workspace_bytes == 6 * 64


@pytest.mark.parametrize("offered", [[], graph_api.GraphApiError("cuDNN's graph API has no engine for this")])
def test_no_engine_at_all_is_recorded_so_the_cache_counts_as_complete(engine_bench, monkeypatch, offered):
    def configs(key, fusion=""):
        if isinstance(offered, Exception):
            raise offered
        return offered

    offer_configs(monkeypatch, configs)
    [row] = engine_bench.measure_engines(SHAPE.key("nchw", "default"), best_ms=None)
    assert (row.algo, row.status) == ("engine:none", "unsupported") and row.note
    assert is_engine(row.algo)


def test_a_cache_with_every_legacy_row_gets_only_its_engines_measured(monkeypatch):
    from convpass.core.cudnn_enums import algo_names
    from convpass.tuning import harness

    seen = []
    monkeypatch.setattr(harness, "warm_clocks", lambda: None)
    monkeypatch.setattr(tuner, "spaces", lambda problem, options: (True, True))
    monkeypatch.setattr(tuner, "_measure", lambda problem, options, keys, strategy, forced, legacy, engines, best, fusion, have=(), **own: seen.append((legacy, engines, best)) or [])
    options = TuneOptions(tf32="on", layout="nhwc")
    key = SHAPE.key("nhwc", "default")
    have = [Measurement(key, a, "ok", 0.01 * (i + 1), 0, True, 1.0, "measure") for i, a in enumerate(algo_names("fwd"))]
    have.append(Measurement(key, "implicit_gemm", "ok", None, 0, True, 1.0, "heuristic", heuristic_rank=0))
    tuner.measure_problem(PROBLEM, options, have)
    tuner.measure_problem(PROBLEM, options, have[1:])  # one legacy algorithm missing: everything again
    tuner.measure_problem(PROBLEM, options)
    assert seen == [(False, True, 0.01), (True, True, None), (True, True, None)]


def test_the_plan_summary_names_the_engine_that_runs(tmp_path):
    import numpy as np

    from convpass.runtime import Executor

    tuned = _tuned_from_cache(tmp_path, ROWS, layout="per-conv")
    ex = Executor(tuned, device="cpu")
    ex.run(None, {"x": np.ones((2, 3, 8, 8), np.float32)})
    [conv] = ex.plan_summary()
    assert (conv.algo, conv.memory_format, conv.source) == ("engine:eng5", "NHWC", "cache")


def test_legacy_algorithms_go_through_the_same_check_and_timing(engine_bench, monkeypatch):
    """The legacy path shares the check-and-time core: statuses by cuDNN's answer, an eager timing
    kept (with a note) rather than refused, as before engines existed."""
    import convpass.native.cudnn as cudnn_pkg
    from convpass.core.cudnn_enums import STATUS, CudnnError
    from convpass.tuning import harness

    def workspace_size(descs, direction, algo):
        if algo == "gemm":
            raise CudnnError(STATUS["CUDNN_STATUS_NOT_SUPPORTED"], "cudnnGetConvolutionForwardWorkspaceSize")
        return 128

    def run(descs, direction, algo, x, w, y, workspace=None):
        if algo == "direct":
            raise CudnnError(STATUS["CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"], "cudnnConvolutionForward")
        y[...] = x.sum() if algo != "fft" else 0.0

    def timing(launch, sets, best_ms=None, **_):
        launch(0)
        return harness.Timing(0.02, 10, 0.0, eager=True)

    monkeypatch.setattr(cudnn_pkg, "workspace_size", workspace_size)
    monkeypatch.setattr(cudnn_pkg, "run", run)
    monkeypatch.setattr(harness, "time_launches", timing)
    key = SHAPE.key("nchw", "default")
    rows = {a: engine_bench.measure_legacy(None, key, a, None) for a in ("implicit_gemm", "gemm", "fft", "direct")}
    assert {a: r.status for a, r in rows.items()} == {"implicit_gemm": "ok", "gemm": "unsupported", "fft": "wrong_result", "direct": "oom"}
    assert rows["implicit_gemm"].time_ms == 0.02 and "eager launches (not capturable)" in rows["implicit_gemm"].note
    assert rows["implicit_gemm"].workspace_bytes == 128 and "graph API" not in rows["implicit_gemm"].note


def test_optimize_says_how_many_decisions_run_an_engine(tmp_path, capsys):
    from convpass.cli.main import main

    model = conv_model("Conv", (2, 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1])
    onnx.save(model, tmp_path / "m.onnx")
    cache = TuningCache(tmp_path / "c.db")
    cache.put(H200, ROWS)
    cache.close()
    args = ["optimize", str(tmp_path / "m.onnx"), "--cache", str(tmp_path / "c.db"), "--device-name", str(H200),
            "--tf32", "on", "--layout", "per-conv"]
    assert main(args + ["-o", str(tmp_path / "t.onnx")]) == 0
    assert "1 of 1 conv decisions run a cuDNN graph-API engine" in capsys.readouterr().err
    assert main(args + ["-o", str(tmp_path / "l.onnx"), "--engines", "legacy"]) == 0
    assert "graph-API engine" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# graph_api against a stand-in for the nvidia-cudnn-frontend package: the calls it makes, in order


def test_configs_lists_every_mode_once_without_the_frontends_python_engines(frontend):
    key = SHAPE.key("nhwc", "default")
    names = [c.name for c in graph_api.enumerate_configs(key).configs()]
    assert names == ["eng5", "eng67_k2=16_k13=0", "eng13_k3=1", "eng0", "eng28_k2=4_k3=0"]
    assert ("plans", ("A", "B", "FALLBACK")) in frontend.calls
    assert ("conv", (1, 1), (1, 1), (1, 1)) in frontend.calls


def test_configs_for_tf32_off_and_for_a_graph_without_engines(frontend):
    with pytest.raises(graph_api.GraphApiError, match="TF32 off"):
        graph_api.enumerate_configs(SHAPE.key("nhwc", "fma"))
    frontend.offers = {}
    with pytest.raises(graph_api.GraphApiError, match="has no engine for .*no engine"):
        graph_api.enumerate_configs(SHAPE.key("nchw", "default"))


def test_a_plan_is_found_by_name_mode_a_first_and_runs_on_the_current_stream(frontend):
    import types

    key = SHAPE.key("nhwc", "default")
    plan = graph_api.EnginePlan(key, EngineConfig.parse("eng5"))
    assert [c for c in frontend.calls if c[0] == "plans"] == [("plans", ("A",))]  # found in mode A: no B query
    assert plan.workspace_bytes == 1024
    arr = lambda p: types.SimpleNamespace(data=types.SimpleNamespace(ptr=p), nbytes=8)  # noqa: E731
    plan.execute(arr(1), arr(2), arr(3), arr(9))
    assert frontend.calls[-2:] == [("stream", 77), ("execute", "eng5", (1, 2, 3), 9)]
    frontend.calls.clear()
    graph_api.EnginePlan(key, EngineConfig.parse("eng28_k2=4_k3=0"))  # a fallback configuration
    assert [c for c in frontend.calls if c[0] == "plans"] == [("plans", ("A",)), ("plans", ("A", "B", "FALLBACK"))]
    assert ("build", "eng28_k2=4_k3=0") in frontend.calls


def test_the_tuners_plans_are_built_on_the_graph_it_enumerated_once(frontend):
    """Enumerating cuDNN's configurations for every candidate again was a third of a ResNet-50's
    tuning time: the tuner's plans are built on the one enumerated graph."""
    key = SHAPE.key("nhwc", "default")
    enumerated = graph_api.enumerate_configs(key)
    frontend.calls.clear()
    plans = []
    for config in enumerated.configs():
        try:
            plans.append(graph_api.EnginePlan(key, config, enumerated))
        except graph_api.GraphApiError as e:
            assert config.name == "eng13_k3=1" and "Finalizing" in str(e)  # the stand-in refuses it
    assert len(plans) == len(enumerated.configs()) - 1
    assert not [c for c in frontend.calls if c[0] in ("plans", "conv")]  # no graph, no enumeration
    assert [c[1] for c in frontend.calls if c[0] == "build" and c[1] != "eng13_k3=1"] == [p.config.name for p in plans]
    other = graph_api.EnginePlan(SHAPE.key("nchw", "default"), enumerated.configs()[0], enumerated)  # not its graph
    assert other.config.name == plans[0].config.name and [c for c in frontend.calls if c[0] == "plans"]


@pytest.mark.parametrize("name,why", [("eng99", "does not offer eng99"), ("eng13_k3=1", "Finalizing the engine config failed")])
def test_a_plan_cuDNN_will_not_give_is_refused_with_the_reason(frontend, name, why):
    with pytest.raises(graph_api.GraphApiError, match=why):
        graph_api.EnginePlan(SHAPE.key("nhwc", "default"), EngineConfig.parse(name))


def test_an_engine_plan_cuDNN_compiled_at_start_up_is_counted_as_a_compilation(monkeypatch):
    import time as time_mod
    import types

    from convpass.kernels import conv_resolve, convolution

    class SlowPlan:
        def __init__(self, key, config, enumerated=None):
            time_mod.sleep(0.06 if config.engine_id == 5 else 0.0)
            self.config, self.workspace_bytes = config, 0

    monkeypatch.setattr(graph_api, "EnginePlan", SlowPlan)
    no_plan_side_car(monkeypatch)
    monkeypatch.setattr(conv_resolve, "ENGINE_COMPILATIONS", [])
    convs = convolution.Convolutions(types.SimpleNamespace(cp=None))
    geometry = types.SimpleNamespace(op_type="Conv", spatial_rank=2)
    for node, engine in (("dw1", "eng5"), ("pw1", "eng0")):
        call = types.SimpleNamespace(node_name=node, geometry=geometry)
        ex = convs.resolver._engine_exec(call, annotation.ConvDecision(algo="implicit_gemm", engine=engine), SHAPE.key("nhwc", "default"))
        assert ex.algo == "engine:" + engine and ex.engine is not None and ex.conv.output_slice_strides is None  # a packed key: a packed output
    assert [n for n, _, _ in convs.engine_builds] == ["dw1", "pw1"]
    assert len(conv_resolve.ENGINE_COMPILATIONS) == 1 and conv_resolve.ENGINE_COMPILATIONS[0].startswith("cuDNN plan eng5 of 'dw1'")


# ---------------------------------------------------------------------------------------------
# stored plans: the serialized form, and the executor's load-or-build (frontend stood in for)

def test_a_built_plan_round_trips_through_its_stored_form(frontend):
    key = SHAPE.key("nhwc", "default")
    for config, uids in ((EngineConfig.parse("eng67_k2=16_k13=0"), (1, 2, 3)), (EngineConfig.parse("eng5", "bias+swish"), (1, 2, 4, 6))):
        data = graph_api.EnginePlan(key, config).serialize(verify=False)
        header = json.loads(data.partition(b"\n")[0])
        assert header["format"] == graph_api.PLAN_FORMAT and header["cudnn"] == "91900" and header["algo"] == config.algo
        frontend.calls.clear()
        loaded = graph_api.EnginePlan.load(key, config, data)
        assert ("deserialize", config.name) in frontend.calls and not any(c[0] in ("build", "plans") for c in frontend.calls)
        assert loaded.workspace_bytes == 1024
        arr = lambda p: types.SimpleNamespace(data=types.SimpleNamespace(ptr=p), nbytes=8)  # noqa: E731
        loaded.execute(arr(1), arr(2), arr(3), arr(9), bias=arr(4) if config.fusion else None)
        assert frontend.calls[-1] == ("execute", config.name, (1, 2, 3, 4)[:len(uids)], 9)
        with pytest.raises(graph_api.GraphApiError, match="was loaded, not built"):
            loaded.serialize()


def test_a_stored_plan_of_another_cudnn_problem_or_configuration_is_refused(frontend, monkeypatch):
    key, config = SHAPE.key("nhwc", "default"), EngineConfig.parse("eng5")
    data = graph_api.EnginePlan(key, config).serialize(verify=False)
    with pytest.raises(graph_api.GraphApiError, match="is for key"):
        graph_api.EnginePlan.load(SHAPE.key("nchw", "default"), config, data)
    with pytest.raises(graph_api.GraphApiError, match="is for algo 'engine:eng5', not 'engine:eng0'"):
        graph_api.EnginePlan.load(key, EngineConfig.parse("eng0"), data)
    with pytest.raises(graph_api.GraphApiError, match="not a stored cuDNN plan"):
        graph_api.EnginePlan.load(key, config, b"\x00garbage")
    head, _, _ = data.partition(b"\n")
    with pytest.raises(graph_api.GraphApiError, match="does not load the stored plan"):
        graph_api.EnginePlan.load(key, config, head + b"\ntruncated")
    ident = graph_api.plan_id(key, config)
    monkeypatch.setattr(frontend, "backend_version", lambda: 92000)
    with pytest.raises(graph_api.GraphApiError, match="is for cudnn '91900', not '92000'"):
        graph_api.EnginePlan.load(key, config, data)
    assert graph_api.plan_id(key, config) != ident  # another cuDNN looks for another entry


class _StoredPlan:
    """EnginePlan stood in for: built (counted), or loaded from bytes naming its configuration."""

    built: list = []

    def __init__(self, key, config, enumerated=None):
        _StoredPlan.built.append(config.algo)
        self.key, self.config, self.workspace_bytes = key, config, 0

    def serialize(self, verify=True):
        return b"stored " + self.config.algo.encode()

    @classmethod
    def load(cls, key, config, data):
        if data != b"stored " + config.algo.encode():
            raise graph_api.GraphApiError("the stored plan is for cudnn '91000', not '91900'")
        plan = cls.__new__(cls)
        plan.key, plan.config, plan.workspace_bytes = key, config, 0
        return plan


def _engine_execs(convs, engines):
    geometry = types.SimpleNamespace(op_type="Conv", spatial_rank=2)
    out = []
    for node, engine in engines:
        call = types.SimpleNamespace(node_name=node, geometry=geometry)
        out.append(convs.resolver._engine_exec(call, annotation.ConvDecision(algo="implicit_gemm", engine=engine), SHAPE.key("nhwc", "default")))
    return out


def test_the_executor_loads_stored_plans_builds_the_rest_and_says_why(monkeypatch):
    from convpass.core.kernel_file import KernelEntry
    from convpass.kernels import convolution

    stored = {"plan-engine:eng5": KernelEntry("plan-engine:eng5", "90", "cudnn plan engine:eng5", b"stored engine:eng5"),
              "plan-engine:eng7": KernelEntry("plan-engine:eng7", "90", "cudnn plan engine:eng7", b"stored by another cuDNN")}
    _StoredPlan.built = []
    monkeypatch.setattr(graph_api, "EnginePlan", _StoredPlan)
    no_plan_side_car(monkeypatch, stored)
    convs = convolution.Convolutions(types.SimpleNamespace(cp=None))
    execs = _engine_execs(convs, [("dw1", "eng5"), ("dw2", "eng6"), ("dw3", "eng7"), ("dw4", "eng6")])
    assert [ex.algo for ex in execs] == ["engine:eng5", "engine:eng6", "engine:eng7", "engine:eng6"]
    assert _StoredPlan.built == ["engine:eng6", "engine:eng7"]  # eng5 was loaded; dw4 shares dw2's plan
    assert execs[3].engine is execs[1].engine
    assert [(n, why) for n, _, why in convs.engine_builds] == [
        ("dw2", "the model's kernel side-car does not store it"),
        ("dw3", "its stored plan was refused: the stored plan is for cudnn '91000', not '91900'")]


def test_plans_are_stored_while_a_side_car_is_recorded(monkeypatch):
    from convpass.core.kernel_file import PLAN_PREFIX, KernelEntry
    from convpass.kernels import convolution

    recorded = []
    stored = {"plan-engine:eng5": KernelEntry("plan-engine:eng5", "90", PLAN_PREFIX + "engine:eng5", b"stored engine:eng5")}
    monkeypatch.setattr(graph_api, "EnginePlan", _StoredPlan)
    no_plan_side_car(monkeypatch, stored, recorded)
    convs = convolution.Convolutions(types.SimpleNamespace(cp=None))
    _engine_execs(convs, [("dw1", "eng5"), ("pw1", "eng0")])
    assert recorded == [("plan-engine:eng5", PLAN_PREFIX + "engine:eng5", b"stored engine:eng5"),
                        ("plan-engine:eng0", PLAN_PREFIX + "engine:eng0", b"stored engine:eng0")]


def _device_array(ptr: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr))


def test_a_misaligned_tensor_is_refused_before_the_plan_runs():
    """A view at an odd offset (a batch or channel slice of a buffer) would be read by a plan built
    for 16-byte aligned tensors with misaligned vector loads: a GraphApiError (the executor's
    warned fallback) before any call, never a sticky CUDA error."""
    from convpass.kernels.conv_exec import EngineConv

    key = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, (2, 16, 14, 14), (16, 16, 3, 3)).shapes[0].key("nhwc", "default")
    ran = []
    plan = types.SimpleNamespace(config=types.SimpleNamespace(algo="engine:eng5+bias+swish+add"), workspace_bytes=0,
                                 execute=lambda *a, **k: ran.append(a))
    conv = EngineConv(key, Algo.parse("engine:eng5+bias+swish+add"), "bias+swish+add", types.SimpleNamespace(cuda=fake_cuda([])), plan)
    aligned = [_device_array(p) for p in (256, 512, 768, 1024)]
    conv._launch(*aligned[:3], None, aligned[3], _device_array(1280))
    assert len(ran) == 1
    with pytest.raises(graph_api.ResidualRefused, match="z not 16-byte aligned"):  # z alone: a refusal of the residual
        conv._launch(*aligned[:3], None, aligned[3], _device_array(1284))
    for x, z, odd in ((_device_array(8), _device_array(1280), "x"), (_device_array(8), _device_array(1284), "x, z")):
        with pytest.raises(graph_api.GraphApiError, match=f"{odd} not 16-byte aligned") as e:
            conv._launch(x, *aligned[1:3], None, aligned[3], z)
        assert not isinstance(e.value, graph_api.ResidualRefused)  # a copy of z would not run either
    assert len(ran) == 1 and graph_api.misaligned(x=None, y=_device_array(64)) == []


def test_the_gpu_tests_of_engines_are_skipped_saying_why_where_the_frontend_is_unusable(request, monkeypatch):
    """``need_graph_api`` (the graph-API GPU tests' gate) skips with the frontend's own reason."""
    monkeypatch.setattr(graph_api, "unavailable", lambda: "the nvidia-cudnn-frontend package is not installed")
    with pytest.raises(pytest.skip.Exception, match="nvidia-cudnn-frontend package is not installed"):
        request.getfixturevalue("need_graph_api")


def test_the_gpu_tests_of_engines_run_where_the_frontend_is_usable(request, monkeypatch):
    monkeypatch.setattr(graph_api, "unavailable", lambda: None)
    assert request.getfixturevalue("need_graph_api") is None  # no skip


@pytest.mark.parametrize("algo,fusion,fenced", [
    ("engine:eng4+bias+add+relu", "bias+add+relu", True),
    ("engine:eng4_k24=2+bias+add+relu", "bias+add+relu", True),
    ("engine:eng5+bias+swish", "bias+swish", True),
    ("engine:eng5", "", False),
])
def test_a_fused_engine_graph_starts_after_everything_before_it(algo, fusion, fenced, monkeypatch):
    """With ``conv_exec.FENCE == "memset"``, a fused engine graph's launch is preceded by a memset on
    its stream (a full dependency in a captured graph: no overlap with the end of its producer);
    the bare engine's is not. The fence is
    part of the launch the tuner times and the executor runs."""
    from convpass.kernels import conv_exec
    from convpass.kernels.conv_exec import EngineConv

    monkeypatch.setattr(conv_exec, "FENCE", "memset")
    key = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, (2, 16, 14, 14), (16, 16, 3, 3)).shapes[0].key("nhwc", "default")
    log: list = []
    plan = types.SimpleNamespace(config=types.SimpleNamespace(algo=algo), workspace_bytes=0,
                                 execute=lambda *a, **k: log.append(("execute", len(a))))
    conv = EngineConv(key, Algo.parse(algo), fusion, types.SimpleNamespace(cuda=fake_cuda(log)), plan)
    if not fenced:
        conv._pass = lambda y, bias, z: log.append(("pass", 0))
    arrays = [_device_array(p) for p in (256, 512, 768, 1024, 1280)]
    conv._launch(*arrays[:3], None, arrays[3], arrays[4])
    assert [name for name, _ in log] == (["fence", "execute"] if fenced else ["execute", "pass"])


def test_the_launch_asks_fence_needed_which_names_every_fused_graph_and_no_bare_engine(monkeypatch):
    """:func:`~convpass.kernels.conv_exec.fence_needed` is the one place that scopes the fence: by
    default every fused graph and no bare engine; the launch asks it each time, so a predicate put
    in its place (a narrower scope) is what the launch follows."""
    from convpass.kernels import conv_exec

    monkeypatch.setattr(conv_exec, "FENCE", "memset")
    key = canonicalize_conv("Conv", {"pads": [1, 1, 1, 1]}, (2, 16, 14, 14), (16, 16, 3, 3)).shapes[0].key("nhwc", "default")
    log: list = []

    def engine(algo: str, fusion: str):
        plan = types.SimpleNamespace(config=types.SimpleNamespace(algo=algo), workspace_bytes=0,
                                     execute=lambda *a, **k: log.append(("execute", len(a))))
        conv = conv_exec.EngineConv(key, Algo.parse(algo), fusion, types.SimpleNamespace(cuda=fake_cuda(log)), plan)
        conv._pass = lambda y, bias, z: log.append(("pass", 0))
        return conv

    fused, residual, bare = engine("engine:eng4+bias+relu", "bias+relu"), engine("engine:eng4+bias+add+relu", "bias+add+relu"), engine("engine:eng4", "")
    assert [conv_exec.fence_needed(c) for c in (fused, residual, bare)] == [True, True, False]
    arrays = [_device_array(p) for p in (256, 512, 768, 1024, 1280)]

    def names(conv) -> list[str]:
        log.clear()
        conv._launch(*arrays[:3], None, arrays[3], arrays[4])
        return [name for name, _ in log]

    monkeypatch.setattr(conv_exec, "fence_needed", lambda conv: conv.residual)  # a narrower scope: graphs that read z
    assert (names(fused), names(residual), names(bare)) == (["execute"], ["fence", "execute"], ["execute", "pass"])
    monkeypatch.setattr(conv_exec, "fence_needed", lambda conv: True)  # the bare engine's launch too
    assert names(bare) == ["fence", "execute", "pass"]

"""The ``fp32-strict`` precision on the CPU: which algorithms are transform algorithms, the selection
rule that excludes them, the precision plan's tie rule, the forced mode and the budget loop on a
synthetic tuning cache whose Winograd / FFT rows are the fastest, the note where a conv has nothing
else, and the annotation of the level (round trip, ``inspect``, a re-tune that drops it)."""

from __future__ import annotations

import json

import onnx
import pytest
from conftest import MODELS
from precision_fakes import WITH_TRANSFORMS, synthetic_cache
from test_decide import PROBLEM, m

import convpass
from convpass.cli.main import main as cli_main
from convpass.compiler.passes.plan_precision import plan_precision
from convpass.compiler.pipeline import build_options, inspect
from convpass.core import annotation
from convpass.core.algo import TRANSFORM_ALGORITHMS, Algo, is_transform
from convpass.core.errors import OptionError
from convpass.core.options import ALGORITHMS, TuneOptions
from convpass.tuning.decide import select

MODEL = MODELS / "residual_cnn.onnx"
STEM_C = 3  # the stem conv's input channels: the one conv the "transforms only" cache gives nothing else


# ------------------------------------------------------------------ the rule


def test_the_transform_algorithms_are_winograd_and_fft_in_every_direction():
    for direction, names in ALGORITHMS.items():
        transforms = {n for n in names if is_transform(n)}
        assert transforms == {n for n in names if "winograd" in n or "fft" in n}, direction
        assert transforms <= TRANSFORM_ALGORITHMS
    assert {n for names in ALGORITHMS.values() for n in names if is_transform(n)} == TRANSFORM_ALGORITHMS
    assert is_transform("winograd+bias+relu") and Algo.parse("fft_tiling+bias").is_transform
    for other in ("implicit_gemm", "implicit_precomp_gemm", "gemm", "direct", "algo_0", "algo_1", "algo_3",
                  "engine:eng67_k2=16_k13=0", "convpass_depthwise_r8", "bias+relu", "auto", "", None):
        assert not is_transform(other), other


def test_strict_options_refuse_what_contradicts_them():
    with pytest.raises(OptionError, match="--precision fp32-strict turns TF32 off .* --tf32 on"):
        build_options({"precision": "fp32-strict", "tf32": "on"})
    with pytest.raises(OptionError, match="no Winograd or FFT algorithm: it contradicts --fprop-algo winograd_nonfused"):
        build_options({"precision": "fp32-strict", "fprop_algo": "winograd_nonfused"})
    with pytest.raises(OptionError, match="--wgrad-algo fft"):
        build_options({"precision": "fp32-strict", "directions": "fwd,wgrad", "wgrad_algo": "fft"})
    assert build_options({"precision": "fp32-strict", "fprop_algo": "gemm"}).strategy("fwd") == ("forced", "gemm")


# ------------------------------------------------------------------ the selection rule

ROWS = [
    m("nchw", "fma", "winograd_nonfused", 0.005),
    m("nchw", "fma", "fft", 0.006),
    m("nchw", "fma", "implicit_precomp_gemm", 0.012),
    m("nhwc", "fma", "implicit_gemm", 0.010),
    m("nchw", "default", "implicit_gemm", 0.004),
]


def test_strict_takes_the_fastest_non_transform_configuration():
    assert select(ROWS, PROBLEM, TuneOptions(precision="fp32")).algo == "winograd_nonfused"
    strict = select(ROWS, PROBLEM, TuneOptions(precision="fp32-strict"))
    assert (strict.algo, strict.key.layout, strict.key.math) == ("implicit_gemm", "nhwc", "fma")
    assert select(ROWS, PROBLEM, TuneOptions(precision="fp32-strict", layout="nchw")).algo == "implicit_precomp_gemm"
    # without --precision, and under --precision auto, transforms stay candidates (auto's levels choose)
    assert select(ROWS, PROBLEM, TuneOptions(tf32="off")).algo == "winograd_nonfused"


def test_strict_with_only_transforms_measured_keeps_the_fastest_fp32_one():
    only = [r for r in ROWS if is_transform(r.algo)]
    assert select(only, PROBLEM, TuneOptions(precision="fp32-strict")).algo == "winograd_nonfused"
    assert select([], PROBLEM, TuneOptions(precision="fp32-strict")) is None


def test_the_plan_breaks_ties_towards_the_more_accurate_level():
    import onnx_ir as ir

    graph = ir.serde.deserialize_model(onnx.load(MODEL)).graph
    conv = next(n for n in graph if n.op_type == "Conv")
    precision = lambda costs: plan_precision(graph, {conv: costs}, "fp16", lambda v: 1.0).precisions[conv]  # noqa: E731
    assert precision({"fp32": 2.0, "fp32-strict": 2.0, "tf32": 2.0}) == "fp32-strict"  # the same algorithm: strict
    assert precision({"fp32": 1.0, "fp32-strict": 2.0}) == "fp32"  # a transform algorithm is faster
    assert precision({"fp32-strict": 2.0, "tf32": 1.0}) == "tf32"


# ------------------------------------------------------------------ forced mode and the loop, on a cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Every problem with GEMM, Winograd and FFT rows, the transform ones the fastest."""
    path = tmp_path_factory.mktemp("strict") / "transforms.db"
    synthetic_cache(path, onnx.load(MODEL), algos=lambda problem: WITH_TRANSFORMS)
    return str(path)


def _optimize(cache, out=None, **kw):
    return convpass.optimize(str(MODEL), out, cache=cache, device_name="Synthetic", kernels=False, quiet=True, **kw)


def _algos(records):
    return {r["algo"] for r in records}


@pytest.mark.parametrize("layout", ["auto", "nchw"])
def test_forced_strict_decides_no_transform_algorithm(cache, layout):
    """In the layout plan (auto) and without it (nchw): every conv GEMM-based, FMA math, and the
    level recorded and shown; forced fp32 keeps its meaning (the fastest FMA algorithm, Winograd)."""
    strict = _optimize(cache, precision="fp32-strict", layout=layout)
    onnx.checker.check_model(strict, full_check=True)
    records = inspect(strict)
    assert len(records) == 6 and _algos(records) == {"implicit_gemm"}
    assert {(r["precision"], r["math_mode"]) for r in records} == {("fp32-strict", "fma")}
    info = annotation.read_model_info(strict)
    assert info.schema_version == 7 and info.precision["mode"] == "fp32-strict" and info.precision["convs"] == {"fp32-strict": 6}
    fp32 = inspect(_optimize(cache, precision="fp32", layout=layout))
    assert _algos(fp32) == {"winograd_nonfused"} and {r["precision"] for r in fp32} == {"fp32"}


def test_auto_over_budget_ends_at_the_strict_level(cache):
    tuned = _optimize(cache, precision="auto", max_error=1e-12)
    record = annotation.read_model_info(tuned).precision
    assert not record["within_budget"] and record["convs"] == {"fp32-strict": 6}
    assert "even with every conv in fp32-strict" in record["note"]
    records = inspect(tuned)
    assert {r["precision"] for r in records} == {"fp32-strict"} and _algos(records) == {"implicit_gemm"}


def test_auto_within_a_loose_budget_keeps_the_fast_levels(cache):
    records = inspect(_optimize(cache, precision="auto", max_error=1e-2))
    assert "fp32-strict" not in {r["precision"] for r in records}


def test_a_conv_with_only_transforms_measured_says_so(tmp_path, capsys):
    path = tmp_path / "stem-transforms.db"
    synthetic_cache(path, onnx.load(MODEL), algos=lambda p: {"winograd_nonfused": 0.5} if p.primary.c == STEM_C else WITH_TRANSFORMS)
    tuned = convpass.optimize(str(MODEL), cache=str(path), device_name="Synthetic", kernels=False, precision="fp32-strict")
    by_node = {r["node"]: r for r in inspect(tuned)}
    assert by_node["stem/conv"]["algo"] == "winograd_nonfused" and by_node["stem/conv"]["precision"] == "fp32"
    assert {r["algo"] for n, r in by_node.items() if n != "stem/conv"} == {"implicit_gemm"}
    err = capsys.readouterr().err
    assert "1 conv(s) at fp32-strict have no measured configuration without a Winograd or FFT algorithm" in err
    assert "stem/conv" in err


def test_forced_strict_without_a_gpu_or_cache_says_the_heuristic_decides(capsys):
    tuned = convpass.optimize(str(MODEL), kernels=False, precision="fp32-strict")
    records = inspect(tuned)
    assert all(r["algo"] == "auto" and r["math_mode"] == "fma" for r in records)
    assert {r["precision"] for r in records} == {"fp32"}  # nothing decided: nothing guarantees the level
    assert "6 conv(s) at fp32-strict have no decided algorithm" in capsys.readouterr().err


# ------------------------------------------------------------------ the annotation


def _node(decision: annotation.ConvDecision, strict: bool) -> onnx.NodeProto:
    attrs = {**annotation.decision_attributes([decision]), **annotation.level_attributes(strict)}
    return onnx.helper.make_node("ConvNoBias", ["x", "w"], ["y"], name="c", domain=annotation.DOMAIN, **attrs)


KEY = "fwd|n=1|c=3|k=4|in=8x8|ker=3x3|pad=1x1|str=1x1|dil=1x1|g=1|float32|nchw|fma"


def test_the_level_round_trips_and_reads_as_what_the_decision_honours():
    gemm = annotation.ConvDecision(algo="implicit_gemm", memory_format="NCHW", math_mode="fma", problem_key=KEY)
    node = _node(gemm, True)
    assert [a.name for a in node.attribute if a.name == annotation.LEVEL_ATTRIBUTE] == ["precision"]
    assert annotation.standard_attributes(node) == []
    assert annotation.read_node(node, 1).decisions[0].precision == "fp32-strict"
    assert annotation.read_node(_node(gemm, False), 1).decisions[0].precision == "fp32"  # older models: no attribute
    winograd = annotation.ConvDecision(algo="winograd_nonfused", math_mode="fma", problem_key=KEY)
    assert annotation.read_node(_node(winograd, True), 1).decisions[0].precision == "fp32"
    undecided = annotation.ConvDecision(math_mode="fma", problem_key=KEY)
    assert annotation.read_node(_node(undecided, True), 1).decisions[0].precision == "fp32"
    training = annotation.ConvDecision(algo="implicit_gemm", math_mode="fma", problem_key=KEY, wgrad_algo="fft")
    assert annotation.read_node(_node(training, True), 1).decisions[0].precision == "fp32"
    tf32 = annotation.ConvDecision(algo="implicit_gemm", math_mode="default", problem_key=KEY)
    assert annotation.read_node(_node(tf32, True), 1).decisions[0].precision == "tf32"
    bad = _node(gemm, False)
    bad.attribute.append(onnx.helper.make_attribute("precision", "fp64"))
    with pytest.raises(annotation.AnnotationError, match="node 'c': precision is b'fp64', not 'fp32-strict'"):
        annotation.read_node(bad, 1)


def test_inspect_shows_the_strict_level(cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    out = tmp_path / "strict.onnx"
    _optimize(cache, str(out), precision="fp32-strict")
    assert cli_main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert shown.count("fp32-strict") >= 6 and "precision fp32-strict" in shown and "winograd" not in shown
    assert cli_main(["inspect", str(out), "--json"]) == 0
    assert {r["precision"] for r in json.loads(capsys.readouterr().out)["records"]} == {"fp32-strict"}


def test_a_re_tune_without_precision_drops_the_level(cache, tmp_path):
    out = tmp_path / "strict.onnx"
    _optimize(cache, str(out), precision="fp32-strict")
    again = convpass.optimize(str(out), tmp_path / "again.onnx", cache=cache, device_name="Synthetic", kernels=False, quiet=True,
                              retune=True, tf32="off")
    names = {a.name for n in again.graph.node for a in n.attribute}
    assert "precision" not in names and "precision_error" not in names
    assert {r["precision"] for r in inspect(again)} == {"fp32"} and _algos(inspect(again)) == {"winograd_nonfused"}

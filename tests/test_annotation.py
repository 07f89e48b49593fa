"""The annotation schema: round trips, per-profile encoding, and models it cannot read."""

from __future__ import annotations

import math

import onnx
import pytest
from conftest import REPO
from onnx import helper

from convpass.core import annotation
from convpass.core.annotation import AnnotationError, ConvDecision, ModelInfo, Profile
from convpass.core.problem import ConvShape, ProblemKey

KEY = ConvShape("fwd", 1, 3, 8, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1)).key("nhwc", "fma")
MEASURED = ConvDecision("implicit_gemm", "NHWC", "fma", 1024, 0.0123, str(KEY), "measure", dgrad_algo="algo_1", wgrad_algo="algo_0")
AUTO = ConvDecision(problem_key="fwd|...", dgrad_algo=None)
INFO = ModelInfo(annotation.SCHEMA_VERSION, "0.1.0", "NVIDIA H200|sm_9.0|132sm|cudnn91900", "91900", "measure",
                 (Profile("x=1x3x8x8", {"x": (1, 3, 8, 8)}), Profile("x=4x3x8x8", {"x": (4, 3, 8, 8)})), True, {"tf32": "auto"})


def _node(decisions):
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="c", domain=annotation.DOMAIN, pads=[1, 1, 1, 1])
    for name, value in annotation.decision_attributes(decisions).items():
        node.attribute.append(helper.make_attribute(name, value))
    return node


@pytest.mark.parametrize("decisions", [[MEASURED], [MEASURED, AUTO], [AUTO, AUTO]])
def test_decisions_round_trip(decisions):
    read = annotation.read_node(_node(decisions), len(decisions))
    assert list(read.decisions) == [
        ConvDecision(d.algo, d.memory_format, d.math_mode, d.workspace_bytes, d.time_ms and pytest.approx(d.time_ms), d.problem_key, d.source,
                     d.dgrad_algo or ("auto" if any(x.dgrad_algo for x in decisions) else None),
                     d.wgrad_algo or ("auto" if any(x.wgrad_algo for x in decisions) else None))
        for d in decisions
    ]


def test_single_profile_is_scalar_and_several_are_lists():
    one = annotation.decision_attributes([MEASURED])
    assert one["algo"] == "implicit_gemm" and one["time_ms"] == 0.0123
    two = annotation.decision_attributes([MEASURED, AUTO])
    assert two["algo"] == ["implicit_gemm", "auto"] and math.isnan(two["time_ms"][1]) and two["workspace_bytes"] == [1024, -1]


def test_unmeasured_decisions_carry_no_time():
    assert "time_ms" not in annotation.decision_attributes([AUTO])
    assert annotation.read_node(_node([AUTO]), 1).decisions[0].time_ms is None


def test_tf32_follows_math_mode():
    assert MEASURED.tf32 is False and AUTO.tf32 is None
    assert ConvDecision("gemm", "NCHW", "default").tf32 is True


def _model(meta):
    graph = helper.make_graph([_node([MEASURED, AUTO])], "g", [], [])
    model = helper.make_model(graph, ir_version=8)
    for k, v in meta.items():
        model.metadata_props.add(key=k, value=v)
    return model


def test_model_info_round_trip():
    model = _model(annotation.metadata_entries(INFO))
    info, nodes = annotation.read_annotations(model)
    assert info == INFO
    assert nodes[0].decisions[0].algo == "implicit_gemm"
    assert ProblemKey.parse(nodes[0].decisions[0].problem_key) == KEY


@pytest.mark.parametrize(
    "version,message",
    [("8", "newer convpass"), ("0", "no longer reads"), ("abc", "damaged")],
)
def test_other_schema_versions_are_refused_clearly(version, message):
    meta = annotation.metadata_entries(INFO)
    meta["convpass.schema_version"] = version
    with pytest.raises(AnnotationError, match=message):
        annotation.read_annotations(_model(meta))


def test_damaged_annotations():
    meta = annotation.metadata_entries(INFO)
    meta["convpass.profiles"] = "{not json"
    with pytest.raises(AnnotationError, match="damaged"):
        annotation.read_annotations(_model(meta))
    with pytest.raises(AnnotationError, match="no convpass metadata"):
        annotation.read_annotations(_model({}))
    model = _model(annotation.metadata_entries(INFO))
    del model.graph.node[0].attribute[1:]  # keep pads only: no 'algo'
    with pytest.raises(AnnotationError, match="no 'algo'"):
        annotation.read_annotations(model)
    model = _model({**annotation.metadata_entries(INFO), "convpass.profiles": "[]"})
    with pytest.raises(AnnotationError, match="entries for 1 profiles"):
        annotation.read_annotations(model)


def test_conv_function_body_is_the_standard_op():
    for op in annotation.CONV_OPS:
        function = annotation.conv_function(op, 13)
        assert (function.domain, function.name) == (annotation.DOMAIN, op)
        (body,) = function.node
        assert body.op_type == op and body.domain == ""
        assert {a.ref_attr_name for a in body.attribute} == set(annotation.STANDARD_ATTRIBUTES[op])
        assert set(annotation.DECISION_ATTRIBUTES) <= set(function.attribute)


# ------------------------------------------------------------------------------------------
# per-device tables (schema 2) and schema-1 models

H200 = "NVIDIA H200|sm_9.0|132sm|cudnn91900"
H100 = "NVIDIA H100 80GB HBM3|sm_9.0|132sm|cudnn91000"
ON_H100 = ConvDecision("implicit_precomp_gemm", "NCHW", "default", 0, 0.02, str(KEY), "cache")


def _two_device_model():
    info = ModelInfo(annotation.SCHEMA_VERSION, "0.1.0", H200, "", "measure", INFO.profiles, False, {}, devices=(H200, H100))
    # device-major: H200's two profiles, then H100's
    graph = helper.make_graph([_node([MEASURED, AUTO, ON_H100, ON_H100])], "g", [], [])
    model = helper.make_model(graph, ir_version=8)
    for k, v in annotation.metadata_entries(info).items():
        model.metadata_props.add(key=k, value=v)
    return model


def test_each_device_reads_its_own_table():
    model = _two_device_model()
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["convpass.devices"] == f'["{H200}", "{H100}"]' and "convpass.device" not in meta
    info, (node,) = annotation.read_annotations(model, device=H100)
    assert (info.device, info.cudnn_version, info.devices) == (H100, "91000", (H200, H100))
    assert [d.algo for d in node.decisions] == ["implicit_precomp_gemm"] * 2
    assert [[d.algo for d in t] for t in node.tables] == [["implicit_gemm", "auto"], ["implicit_precomp_gemm"] * 2]
    from convpass.core.device import DeviceFingerprint

    info, (node,) = annotation.read_annotations(model, device=DeviceFingerprint.parse(H200))
    assert info.device == H200 and node.decisions[0].algo == MEASURED.algo and node.decisions[1].algo == "auto"
    info, (node,) = annotation.read_annotations(model)  # no device: the first table
    assert info.device == H200 and node.decisions[0].algo == MEASURED.algo


def test_a_device_without_a_table_gets_the_first_table_named_as_such():
    """The CUDA executor compares ModelInfo.device with its GPU: a mismatch runs the heuristic with
    one warning, as for any model tuned elsewhere."""
    info, (node,) = annotation.read_annotations(_two_device_model(), device="NVIDIA A100|sm_8.0|108sm|cudnn91900")
    assert info.device == H200 and node.decisions[0].algo == MEASURED.algo
    assert info.table_of("NVIDIA A100|sm_8.0|108sm|cudnn91900") is None and info.table_of(H100) == 1


def test_device_tables_must_match_the_attribute_length():
    model = _two_device_model()
    model.graph.node[0].CopyFrom(_node([MEASURED, AUTO]))
    with pytest.raises(AnnotationError, match="2 entries for 2 device tables x 2 profiles"):
        annotation.read_annotations(model)
    meta = {p.key: p for p in model.metadata_props}
    meta["convpass.devices"].value = '"not a list"'
    with pytest.raises(AnnotationError, match="damaged"):
        annotation.read_annotations(model)


def test_model_info_checks_its_devices():
    with pytest.raises(ValueError, match="not one of its devices"):
        ModelInfo(2, "", H100, "", "measure", (), False, {}, devices=(H200,))
    with pytest.raises(ValueError, match="twice"):
        ModelInfo(2, "", H200, "", "measure", (), False, {}, devices=(H200, H200))
    assert ModelInfo(2, "", "", "", "measure", (), False, {}).tables == 1


SCHEMA1 = REPO / "tests" / "data" / "schema1-resnet-stem.tuned.onnx"


def test_schema1_model_still_reads():
    """A model written by convpass before per-device tables (tests/data/README.md)."""
    model = onnx.load(SCHEMA1)
    info, nodes = annotation.read_annotations(model)
    assert info.schema_version == 1 and info.devices == (H200,) and info.device == H200 and info.cudnn_version == "91900"
    assert [p.name for p in info.profiles] == ["input=1x3x224x224", "input=32x3x224x224"]
    got = [(n.node_name, d.algo, d.memory_format, d.source, d.time_ms) for n in nodes for d in n.decisions]
    assert got == [
        ("conv0", "implicit_precomp_gemm", "NHWC", "cache", pytest.approx(0.018278175964951515)),
        ("conv0", "implicit_precomp_gemm", "NHWC", "cache", pytest.approx(0.2065407931804657)),
        ("conv2", "implicit_precomp_gemm", "NCHW", "cache", pytest.approx(0.003966720309108496)),
        ("conv2", "implicit_precomp_gemm", "NHWC", "cache", pytest.approx(0.017199698835611343)),
    ]
    same, nodes_h200 = annotation.read_annotations(model, device=H200)
    assert same == info and nodes_h200 == nodes
    other, nodes_other = annotation.read_annotations(model, device=H100)
    assert other.device == H200 and nodes_other == nodes  # mismatch visible: heuristic at run time


def test_schema1_model_runs_its_decisions_in_the_executor_and_inspect():
    import convpass

    records = convpass.inspect(SCHEMA1)
    assert [(r["node"], r["device"], r["memory_format"]) for r in records] == [
        ("conv0", H200, "NHWC"), ("conv0", H200, "NHWC"), ("conv2", H200, "NCHW"), ("conv2", H200, "NHWC")]
    ex = convpass.Executor(str(SCHEMA1))
    assert [(s.node, s.algo, s.memory_format, s.source) for s in ex.plan_summary()] == [
        ("conv0", "implicit_precomp_gemm", "NHWC", "cache"), ("conv2", "implicit_precomp_gemm", "NCHW", "cache")]


def test_a_tuned_model_goes_back_to_standard_convs_without_changing_the_tuned_one():
    tuned = onnx.load(str(REPO / "tests" / "data" / "schema1-resnet-stem.tuned.onnx"))
    before = tuned.SerializeToString()
    plain = annotation.standard_model(tuned)
    assert tuned.SerializeToString() == before  # a copy: the tuned model keeps its decisions
    convs = [n for n in plain.graph.node if n.op_type == "Conv"]
    assert convs and all(n.domain == "" for n in convs)
    assert not any(annotation.is_annotated_conv(n) for n in plain.graph.node)
    assert all(a.name not in annotation.DECISION_ATTRIBUTES for n in convs for a in n.attribute)
    originals = {n.name: n for n in tuned.graph.node}
    for n in convs:  # the standard attributes (pads, strides...) are kept as they were
        assert list(n.attribute) == annotation.standard_attributes(originals[n.name])
        assert {a.name for a in n.attribute} == {"group", "kernel_shape", "pads", "strides"}

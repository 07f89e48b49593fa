"""The annotation schema: round trips, per-profile encoding, and models it cannot read."""

from __future__ import annotations

import math

import onnx
import pytest
from onnx import helper

from convpass import annotation
from convpass.annotation import AnnotationError, ConvDecision, ModelInfo, Profile
from convpass.problem import ConvShape, ProblemKey

KEY = ConvShape("fwd", 1, 3, 8, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1)).key("nhwc", "fma")
MEASURED = ConvDecision("implicit_gemm", "NHWC", "fma", 1024, 0.0123, str(KEY), "measure", dgrad_algo="algo_1", wgrad_algo="algo_0")
AUTO = ConvDecision(problem_key="fwd|...", dgrad_algo=None)
INFO = ModelInfo(1, "0.1.0", "NVIDIA H200|sm_9.0|132sm|cudnn91900", "91900", "measure",
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
    [("2", "newer convpass"), ("0", "no longer reads"), ("abc", "damaged")],
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

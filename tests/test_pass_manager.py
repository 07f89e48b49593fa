"""The pipeline's passes as onnx-ir pass sequences: each pass's preconditions and postconditions
(convpass.compiler.passes.state), the sequences of convpass.compiler.passes.manager, and how their
errors come out."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import conv_model
from onnx import TensorProto, helper, numpy_helper

from convpass.compiler.passes import manager, state
from convpass.compiler.passes.annotate_convs import AnnotateConvsPass, DeviceChoices
from convpass.compiler.passes.canonicalize_convs import CanonicalizeConvsPass
from convpass.compiler.passes.collect_conv_problems import CollectConvProblemsPass
from convpass.compiler.passes.fold_batchnorms import FoldBatchNormsPass
from convpass.compiler.passes.fold_conv_weights import FoldConvWeightsPass
from convpass.compiler.passes.fold_relu_affine import FoldReluAffinePass
from convpass.compiler.passes.resolve_shapes import ResolveShapesPass
from convpass.compiler.passes.sum_branches import SumBranchesPass
from convpass.compiler.pipeline import OptimizeReport, build_options, prepare_model
from convpass.core.annotation import SCHEMA_VERSION, ModelInfo
from convpass.core.errors import ShapeError
from convpass.core.model_io import load_model

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
SAMPLE_SHAPES = {"mobile_block": ["input=2x3x32x32", "input=8x3x32x32"]}


def _model() -> ir.Model:
    return load_model(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1]))


def _computed_weight_model() -> ir.Model:
    """A Conv whose weight is computed from an initializer (w * 2), then a BatchNormalization."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w0"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    for name, fill in (("scale", 1.5), ("bias", 0.1), ("mean", 0.2), ("var", 0.9)):
        inits.append(numpy_helper.from_array(np.full(4, fill, np.float32), name))
    nodes = [helper.make_node("Mul", ["w0", "two"], ["w"], name="scale_w"),
             helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["y", "scale", "bias", "mean", "var"], ["out"], name="bn")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))


def _annotate() -> AnnotateConvsPass:
    info = ModelInfo(SCHEMA_VERSION, "", "", "", "auto", (), False, {})
    return AnnotateConvsPass([DeviceChoices({})], info)


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("make_pass", [FoldBatchNormsPass, ResolveShapesPass])
def test_passes_after_folding_refuse_a_computed_weight(make_pass):
    model = _computed_weight_model()
    with pytest.raises(ir.passes.PreconditionError) as error:
        make_pass()(model)
    assert _one_line(error) == (f"{make_pass.__name__} requires folded conv weights: Conv 'conv' reads the computed weight 'w' "
                                "(run FoldConvWeightsPass before it)")
    FoldConvWeightsPass()(model)
    make_pass()(model)  # in order: no error


def test_canonicalize_requires_resolved_shapes():
    model = _model()
    with pytest.raises(ir.passes.PreconditionError) as error:
        CanonicalizeConvsPass()(model)
    assert _one_line(error) == ("CanonicalizeConvsPass requires resolved shapes: the model has no shape profiles "
                                "(run ResolveShapesPass before it)")
    ResolveShapesPass()(model)
    del next(state.tuned_convs(model)).meta[state.SHAPES_KEY]
    with pytest.raises(ir.passes.PreconditionError, match=r"^CanonicalizeConvsPass requires resolved shapes: Conv 'conv' has no shapes"):
        CanonicalizeConvsPass()(model)


def test_collect_requires_canonical_convs():
    model = _model()
    ResolveShapesPass()(model)
    with pytest.raises(ir.passes.PreconditionError) as error:
        CollectConvProblemsPass()(model)
    assert _one_line(error) == ("CollectConvProblemsPass requires canonical convs: Conv 'conv' has no canonical form "
                                "(run CanonicalizeConvsPass before it)")


def test_annotate_requires_collected_problems():
    model = _model()
    ResolveShapesPass()(model)
    CanonicalizeConvsPass()(model)
    with pytest.raises(ir.passes.PreconditionError) as error:
        _annotate()(model)
    assert _one_line(error) == ("AnnotateConvsPass requires collected problems: the model has no collected problems "
                                "(run CollectConvProblemsPass before it)")
    CollectConvProblemsPass()(model)
    _annotate()(model)
    assert next(iter(model.graph)).domain == "ai.convpass"


def test_a_profile_count_that_does_not_match_is_refused():
    model = _model()
    ResolveShapesPass()(model)
    CanonicalizeConvsPass()(model)
    model.meta[state.PROFILES_KEY] = model.meta[state.PROFILES_KEY] * 2
    with pytest.raises(ir.passes.PreconditionError, match=r"Conv 'conv' has canonical form for 1 of 2 profile\(s\)"):
        CollectConvProblemsPass()(model)


class _NoOp:
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, modified=False)


class _BrokenFold(_NoOp, FoldConvWeightsPass):
    pass


class _BrokenResolve(_NoOp, ResolveShapesPass):
    pass


class _BrokenCanonicalize(_NoOp, CanonicalizeConvsPass):
    pass


def test_postconditions_name_the_pass_and_what_it_did_not_leave():
    with pytest.raises(ir.passes.PostconditionError) as error:
        _BrokenFold()(_computed_weight_model())
    assert _one_line(error) == "_BrokenFold ensures folded conv weights, but Conv 'conv' reads the computed weight 'w'"
    model = _model()
    with pytest.raises(ir.passes.PostconditionError, match=r"^_BrokenResolve ensures resolved shapes, but the model has no shape profiles$"):
        _BrokenResolve()(model)
    ResolveShapesPass()(model)
    with pytest.raises(ir.passes.PostconditionError, match=r"^_BrokenCanonicalize ensures canonical convs, but Conv 'conv' has no canonical form$"):
        _BrokenCanonicalize()(model)


def test_a_skipped_conv_needs_nothing():
    """A conv whose weight is a graph input is marked to skip by the folding, and no later pass
    requires anything of it."""
    proto = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3))
    proto.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3, 3, 3]))
    del proto.graph.initializer[0]
    model = load_model(proto)
    fold, resolve, collect = FoldConvWeightsPass(), ResolveShapesPass(), CollectConvProblemsPass()
    manager.run(manager.preparation(fold, resolve, collect), model)
    assert state.SKIP_KEY in next(iter(model.graph)).meta and collect.problems == {}


def test_the_preparation_runs_the_passes_in_their_order():
    fold, resolve, collect = FoldConvWeightsPass(), ResolveShapesPass(), CollectConvProblemsPass()
    sequence = manager.preparation(fold, resolve, collect)
    folding, *rest = sequence.passes
    assert [type(p) for p in folding.passes] == [FoldConvWeightsPass, FoldBatchNormsPass, FoldReluAffinePass] and folding.passes[0] is fold
    assert rest[0] is resolve and type(rest[1]) is SumBranchesPass and type(rest[2]) is CanonicalizeConvsPass and rest[3] is collect
    model = _computed_weight_model()
    manager.run(sequence, model)
    assert [n.op_type for n in model.graph] == ["Conv"]  # the weight computed, the BatchNormalization folded
    assert len(collect.problems) == 1
    _annotate()(model)


def test_errors_come_out_of_a_sequence_as_the_pass_raised_them():
    model = load_model(conv_model("Conv", ("batch", 3, 8, 8), (4, 3, 3, 3)))
    with pytest.raises(ShapeError, match=r"^Conv 'conv': dim 0 of its input 'x' is 'batch'"):
        manager.run(manager.preparation(FoldConvWeightsPass(), ResolveShapesPass(), CollectConvProblemsPass()), model)
    with pytest.raises(ir.passes.PreconditionError, match=r"^CollectConvProblemsPass requires canonical convs"):
        manager.run(ir.passes.PassManager([ResolveShapesPass(), CollectConvProblemsPass()]), _model())


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(MODELS) if f.endswith(".onnx")))
def test_the_preparation_is_the_passes_run_one_by_one(name):
    """The pass manager leaves each sample model, and its problems, as the passes called one after
    the other in the documented order do."""
    proto = onnx.load(os.path.join(MODELS, f"{name}.onnx"))
    shapes = SAMPLE_SHAPES.get(name, [])
    managed = load_model(proto)
    uses = prepare_model(managed, build_options({}), shapes, OptimizeReport())
    by_hand = load_model(proto)
    for pass_ in (FoldConvWeightsPass(), FoldBatchNormsPass(), ResolveShapesPass(shapes), CanonicalizeConvsPass()):
        pass_(by_hand)
    collect = CollectConvProblemsPass()
    collect(by_hand)
    assert uses and list(uses) == list(collect.problems)
    assert ir.serde.serialize_model(managed).SerializeToString() == ir.serde.serialize_model(by_hand).SerializeToString()

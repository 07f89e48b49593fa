"""Shapes resolve for valid models with concrete profiles: ONNX inference first (IR-3 models with
folded weights included), the CPU run for what it leaves unknown, honest notes, clear errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import random_input, run_ort
from onnx import TensorProto, helper, numpy_helper
from shufflenet_like import shufflenet_like

import convpass
from convpass.compiler.passes.cpu_shapes import value_dependence
from convpass.compiler.passes.fold_conv_weights import FoldConvWeightsPass
from convpass.compiler.passes.resolve_shapes import SHAPES_KEY, VALUE_SHAPES_KEY, ResolveShapesPass
from convpass.compiler.pipeline import optimize_model
from convpass.core import annotation
from convpass.core.errors import ShapeError
from convpass.core.model_io import load_model, to_proto
from convpass.core.options import TuneOptions


def _check_tuned(original: onnx.ModelProto, tuned: onnx.ModelProto, feeds: dict) -> None:
    """Valid, runs in ONNX Runtime as the original, and on the CPU executor every conv computes the
    problem recorded for the profile its inputs match (the resolved shapes were the real ones)."""
    onnx.checker.check_model(tuned, full_check=True)
    want = run_ort(original, feeds)
    for w, got in zip(want, run_ort(tuned, feeds)):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
    executor = convpass.Executor(tuned, device="cpu")
    for w, got in zip(want, executor.run(None, feeds)):
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4)
    summary = executor.plan_summary()
    assert summary and all(s.profile is not None for s in summary)
    for s in summary:
        assert s.recorded_problem_key.split("|layout=")[0].startswith(s.problem), s.node


# ---------------------------------------------------------------------------------------------
# IR version 3: weights folded from ConstantOfShape


def _ir3_constant_of_shape_model(elem_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """As the light model-zoo exports: IR 3, opset 9, weights made by ConstantOfShape from shape
    initializers that are (as IR 3 requires) graph inputs too."""
    nodes, inits = [], []
    for name, dims in (("w1", [4, 3, 3, 3]), ("b1", [4]), ("w2", [6, 4, 3, 3])):
        inits.append(numpy_helper.from_array(np.array(dims, np.int64), f"{name}__SHAPE"))
        value = numpy_helper.from_array(np.array([0.02], helper.tensor_dtype_to_np_dtype(elem_type)))
        nodes.append(helper.make_node("ConstantOfShape", [f"{name}__SHAPE"], [name], value=value))
    nodes += [
        helper.make_node("Conv", ["x", "w1", "b1"], ["r0"], name="n0", kernel_shape=[3, 3], strides=[2, 2]),
        helper.make_node("Relu", ["r0"], ["r1"], name="n1"),
        helper.make_node("MaxPool", ["r1"], ["r2"], name="n2", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["r2", "w2"], ["y"], name="n3", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "ir3",
        [helper.make_tensor_value_info("x", elem_type, [1, 3, 32, 32])]
        + [helper.make_tensor_value_info(t.name, TensorProto.INT64, list(t.dims)) for t in inits],
        [helper.make_tensor_value_info("y", elem_type, [None] * 4)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=3)
    onnx.checker.check_model(model, full_check=True)
    return model


def test_ir3_folded_weights_keep_shapes_flowing():
    model = load_model(_ir3_constant_of_shape_model())
    FoldConvWeightsPass()(model)
    # IR 3 would need every folded weight listed as a graph input: the pass moves the model to IR 4
    assert model.ir_version == 4
    onnx.checker.check_model(to_proto(model), full_check=True)
    resolve = ResolveShapesPass()
    resolve(model)
    assert resolve.cpu_runs == [], "ONNX shape inference alone resolves it"
    conv2 = next(n for n in model.graph if n.name == "n3")
    assert conv2.meta[SHAPES_KEY] == (((1, 4, 7, 7), (6, 4, 3, 3), "float32"),)
    assert model.meta[VALUE_SHAPES_KEY][0]["y"] == (1, 6, 7, 7)


def test_ir3_model_optimizes_and_runs():
    model = _ir3_constant_of_shape_model()
    tuned = convpass.optimize(model, quiet=True)
    assert tuned.ir_version == annotation.MIN_IR_VERSION
    assert [r["problem_key"].split("|")[2:4] for r in convpass.inspect(tuned)] == [["c=3", "k=4"], ["c=4", "k=6"]]
    _check_tuned(model, tuned, {"x": random_input((1, 3, 32, 32))})


def test_ir3_model_with_only_untuned_convs_is_still_valid():
    """Folding alone (no conv annotated, so nothing else raises the IR version) keeps it valid."""
    model = _ir3_constant_of_shape_model(TensorProto.DOUBLE)
    tuned = convpass.optimize(model, quiet=True)
    assert tuned.ir_version == 4
    assert {n.domain for n in tuned.graph.node if n.op_type == "Conv"} == {""}
    onnx.checker.check_model(tuned, full_check=True)
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32))
    np.testing.assert_allclose(convpass.Executor(tuned).run(None, {"x": x})[0], convpass.Executor(model).run(None, {"x": x})[0])


# ---------------------------------------------------------------------------------------------
# the CPU run: a ShuffleNet V2 as torch exports it, dynamic batch


SMALL = dict(widths=(8, 16, 32, 64), repeats=(2, 2), size=32, classes=10)


@pytest.fixture(scope="module")
def shufflenet():
    return shufflenet_like(**SMALL)


def test_onnx_inference_alone_cannot_resolve_the_shufflenet(shufflenet):
    model = load_model(shufflenet)
    inferred = onnx.shape_inference.infer_shapes(to_proto(model), data_prop=True)
    dims = {vi.name: [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim] for vi in inferred.graph.value_info}
    assert all(isinstance(d, str) for d in dims["/stage2/stage2.1/Slice_1_output_0"])


def test_shufflenet_shapes_resolve_on_the_cpu_for_batch_1_and_32(shufflenet):
    model = load_model(shufflenet)
    FoldConvWeightsPass()(model)
    resolve = ResolveShapesPass(["input=1x3x32x32", "input=32x3x32x32"])
    resolve(model)
    conv = next(n for n in model.graph if n.name == "/stage2/stage2.1/branch2/branch2.0/Conv")
    assert conv.meta[SHAPES_KEY] == (((1, 8, 4, 4), (8, 8, 1, 1), "float32"), ((32, 8, 4, 4), (8, 8, 1, 1), "float32"))
    last = next(n for n in model.graph if n.name == "/conv5/conv5.0/Conv")
    assert [s[0] for s in last.meta[SHAPES_KEY]] == [(1, 32, 2, 2), (32, 32, 2, 2)]
    # the resolved shapes reach every value inference could carry them to (the layout planner's input)
    for batch, shapes in zip((1, 32), model.meta[VALUE_SHAPES_KEY]):
        assert shapes["/stage2/stage2.1/Reshape_output_0"] == (batch, 2, 8, 4, 4)
        assert shapes["/stage3/stage3.1/Reshape_1_output_0"] == (batch, 32, 2, 2)
    runs = resolve.cpu_runs
    assert [r.profile for r in runs] == ["input=1x3x32x32", "input=32x3x32x32"]
    for run in runs:
        assert run.value_dependent == {}
        assert 0 < run.rounds < 10 and run.seconds < 5
        # only what the shapes depend on: Slices, the channel-shuffle Reshapes and their shape
        # arithmetic; the convs never run, nor anything inference could carry the shapes through
        assert run.ops_run["Slice"] == 4 and run.ops_run["Reshape"] == 4
        assert not {"Conv", "Relu", "MaxPool", "Transpose", "ReduceMean", "Gemm"} & set(run.ops_run)
    # nothing was unknown but conv inputs behind the first chunk
    assert "/stage2/stage2.0/branch2/branch2.0/Relu_output_0" not in runs[0].resolved
    assert "/stage2/stage2.1/Slice_1_output_0" in runs[0].resolved


def test_shufflenet_optimizes_with_notes_and_runs(shufflenet):
    profiles = ["input=1x3x32x32", "input=32x3x32x32"]
    model = load_model(shufflenet)
    report = optimize_model(model, TuneOptions(), profiles)
    cpu_notes = [n for n in report.notes if "on the CPU" in n]
    assert len(cpu_notes) == 2
    for profile, note in zip(profiles, cpu_notes):
        assert note.startswith(f"profile {profile!r}: ONNX shape inference left 11 conv input(s) unknown")
        assert "'/stage2/stage2.1/Slice_1_output_0'" in note and "and 7 more" in note
    tuned = to_proto(model)
    for batch in (1, 32):
        _check_tuned(shufflenet, tuned, {"input": random_input((batch, 3, 32, 32))})


def test_symbolic_batch_without_a_profile_still_asks_for_shape(shufflenet):
    with pytest.raises(ShapeError, match=r"'batch' of input 'input'.*shapes=\['input=1x3x32x32'\]"):
        convpass.optimize(shufflenet, quiet=True)


def test_shufflenet_cli(shufflenet, tmp_path, capsys):
    from convpass.cli.main import main

    onnx.save(shufflenet, tmp_path / "m.onnx")
    assert main(["optimize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx"), "--shape", "input=2x3x32x32"]) == 0
    err = capsys.readouterr().err
    assert "profile 'input=2x3x32x32': ONNX shape inference left 11 conv input(s) unknown" in err
    assert (tmp_path / "t.onnx").is_file()


# ---------------------------------------------------------------------------------------------
# shapes that depend on input values; failures


def _gather_positive_model() -> onnx.ModelProto:
    """Keeps the samples whose mean is positive (NonZero), then convolves them: the conv's batch
    depends on the input values."""
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], name="mean", axes=[1, 2, 3], keepdims=0),
        helper.make_node("Greater", ["mean", "zero"], ["positive"], name="positive"),
        helper.make_node("NonZero", ["positive"], ["nz"], name="nz"),
        helper.make_node("Squeeze", ["nz", "axis0"], ["index"], name="index"),
        helper.make_node("Gather", ["x", "index"], ["kept"], name="kept", axis=0),
        helper.make_node("Conv", ["kept", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
    ]
    inits = [
        numpy_helper.from_array(np.array(0, np.float32), "zero"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        numpy_helper.from_array(w, "w"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * 4)], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_value_dependent_shape_is_tuned_for_the_shape_seen():
    model = load_model(_gather_positive_model())
    report = optimize_model(model, TuneOptions(), ["x=32x3x8x8"])
    # the documented feeds: seeded, standard normal floats
    x = np.random.default_rng(0).standard_normal((32, 3, 8, 8)).astype(np.float32)
    kept = int((x.mean(axis=(1, 2, 3)) > 0).sum())
    assert 0 < kept < 32
    conv = next(n for n in model.graph if n.name == "conv")
    assert conv.meta[SHAPES_KEY][0][0] == (kept, 3, 8, 8)
    (note,) = [n for n in report.notes if "depends on input values" in n]
    assert note == (
        "Conv 'conv' (profile 'x=32x3x8x8'): the shape of its input 'kept' depends on input values "
        f"(NonZero 'nz' upstream has a data-dependent output shape): tuned for the shape seen on random inputs, {kept}x3x8x8"
    )


def _half_batch_model() -> onnx.ModelProto:
    """Folds pairs of samples into channels: view(n // 2, 2 * c, h, w) -- only even batches work."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "zero"], ["n"], name="n", axis=0),
        helper.make_node("Div", ["n", "two"], ["half"], name="half"),
        helper.make_node("Concat", ["half", "rest"], ["target"], name="target", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["pairs"], name="pairs"),
        helper.make_node("Conv", ["pairs", "w"], ["y"], name="conv"),
    ]
    inits = [
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([2], np.int64), "two"),
        numpy_helper.from_array(np.array([6, 8, 8], np.int64), "rest"),
        numpy_helper.from_array(np.ones((4, 6, 1, 1), np.float32), "w"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * 4)], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_cpu_run_failure_names_node_and_profile_and_writes_nothing(tmp_path):
    out = tmp_path / "tuned.onnx"
    tuned = convpass.optimize(_half_batch_model(), shapes=["x=4x3x8x8"], quiet=True)
    assert convpass.inspect(tuned)[0]["problem_key"].startswith("fwd|n=2|c=6|k=4|in=8x8")
    with pytest.raises(ShapeError) as info:
        convpass.optimize(_half_batch_model(), out, shapes=["x=4x3x8x8", "x=1x3x8x8"], quiet=True)
    message = str(info.value)
    assert message.startswith("resolving shapes on the CPU for profile 'x=1x3x8x8' failed (computing 'pairs')")
    assert "node 'pairs' (Reshape)" in message and "\n" not in message
    assert not out.exists() and list(tmp_path.iterdir()) == []


def _reshape_by_input_model() -> onnx.ModelProto:
    """Folds the 96 positions of each channel into (96 / (g + 1)) x (g + 1), with ``g`` an integer
    input: a Reshape whose target is computed from input values."""
    nodes = [
        helper.make_node("Add", ["g", "one"], ["width"], name="width"),
        helper.make_node("Concat", ["keep", "width"], ["target"], name="target", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["folded"], name="fold"),
        helper.make_node("Conv", ["folded", "w"], ["y"], name="conv"),
    ]
    inits = [
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([0, 3, -1], np.int64), "keep"),
        numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w"),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 12, 8]), helper.make_tensor_value_info("g", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * 4)], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_reshape_target_from_an_integer_input_is_tuned_for_the_shape_seen():
    model = load_model(_reshape_by_input_model())
    report = optimize_model(model, TuneOptions(), ["x=2x3x12x8"])
    # the documented feeds: seeded; integers uniform in 0..3 (x only lends its shape: zeros)
    width = int(np.random.default_rng(0).integers(0, 4, size=(1,))[0]) + 1
    conv = next(n for n in model.graph if n.name == "conv")
    assert conv.meta[SHAPES_KEY][0][0] == (2, 3, 96 // width, width)
    (note,) = [n for n in report.notes if "depends on input values" in n]
    assert note == (
        "Conv 'conv' (profile 'x=2x3x12x8'): the shape of its input 'folded' depends on input values (Reshape 'fold' "
        f"upstream takes its shape from 'target', which is computed from input values): tuned for the shape seen on "
        f"random inputs, 2x3x{96 // width}x{width}"
    )


def test_shape_chains_are_not_value_dependent(shufflenet):
    """The executor's rule: Slice ends and Reshape targets computed from Shape are fixed by the input
    shapes; NonZero and a Reshape target from an input's values are not."""
    assert value_dependence(load_model(shufflenet)) == {}
    causes = value_dependence(load_model(_gather_positive_model()))
    assert set(causes) == {"nz", "index", "kept", "y"} and causes["y"] == "NonZero 'nz' upstream has a data-dependent output shape"
    causes = value_dependence(load_model(_reshape_by_input_model()))
    assert set(causes) == {"folded", "y"}


def test_an_input_left_symbolic_is_not_recorded_in_the_profile():
    """A second input no conv depends on may stay symbolic: the profile records only the concrete
    shapes it was tuned for, so the tuned model reads back and runs with any shape of it."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv"), helper.make_node("Relu", ["z"], ["zr"], name="relu")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8]), helper.make_tensor_value_info("z", TensorProto.FLOAT, ["m", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 6, 6]), helper.make_tensor_value_info("zr", TensorProto.FLOAT, ["m", 5])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    tuned = convpass.optimize(model, shapes=["x=2x3x8x8"], quiet=True)
    info, _ = annotation.read_annotations(tuned)
    assert [p.inputs for p in info.profiles] == [{"x": (2, 3, 8, 8)}]
    feeds = {"x": random_input((2, 3, 8, 8)), "z": random_input((7, 5))}
    _check_tuned(model, tuned, feeds)

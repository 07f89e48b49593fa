"""optimize / inspect end to end on CPU: tuned models stay valid ONNX, run unchanged in ONNX Runtime,
and record every convolution; bad input gives one clear line and writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import MODELS, conv_model, random_input, run_ort
from onnx import TensorProto, helper, numpy_helper
from test_canonicalize import CASES

import convpass
from convpass.core import annotation
from convpass.core.errors import ConvpassError, ModelLoadError, OptionError, ShapeError


def _check_tuned(original: onnx.ModelProto, tuned: onnx.ModelProto, feeds: dict, rtol=1e-5, atol=1e-5) -> None:
    onnx.checker.check_model(tuned, full_check=True)
    for want, got in zip(run_ort(original, feeds), run_ort(tuned, feeds)):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    convs = [n for n in original.graph.node if n.op_type in annotation.CONV_OPS]
    records = convpass.inspect(tuned)
    assert len({r["node"] for r in records}) == len(convs)


@pytest.mark.parametrize("op_type,x_shape,w_shape,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_every_conv_variant_round_trips(op_type, x_shape, w_shape, attrs):
    model = conv_model(op_type, x_shape, w_shape, **attrs)
    tuned = convpass.optimize(model, quiet=True)
    _check_tuned(model, tuned, {"x": random_input(x_shape)})
    (node,) = [n for n in tuned.graph.node if n.op_type == op_type]
    assert node.domain == annotation.DOMAIN
    original = {a.name: a for a in model.graph.node[0].attribute}
    for name, attr in original.items():
        assert {a.name: a for a in node.attribute}[name] == attr, "original attributes are kept unchanged"
    (record,) = convpass.inspect(tuned)
    assert record["algo"] == "auto" and record["source"] == "auto" and record["time_ms"] is None
    assert record["problem_key"].startswith("fwd|" if op_type == "Conv" else "dgrad|")


def test_fp16_model_round_trips():
    model = conv_model("Conv", (1, 4, 8, 8), (8, 4, 3, 3), elem_type=TensorProto.FLOAT16, pads=[1, 1, 1, 1])
    tuned = convpass.optimize(model, quiet=True)
    _check_tuned(model, tuned, {"x": random_input((1, 4, 8, 8), TensorProto.FLOAT16)}, rtol=1e-3, atol=1e-3)
    assert "float16" in convpass.inspect(tuned)[0]["problem_key"]


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.onnx")), ids=lambda p: p.stem)
def test_sample_models(path):
    model = onnx.load(path)
    shapes = []
    feeds = {}
    for inp in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else 2 for d in inp.type.tensor_type.shape.dim]
        if any(not d.HasField("dim_value") for d in inp.type.tensor_type.shape.dim):
            shapes.append(f"{inp.name}={'x'.join(map(str, dims))}")
        feeds[inp.name] = random_input(dims)
    tuned = convpass.optimize(path, shapes=shapes, quiet=True)
    _check_tuned(model, tuned, feeds, rtol=1e-4, atol=1e-5)


def test_dynamic_batch_with_two_profiles(tmp_path):
    model = conv_model("Conv", ("batch", 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1])
    tuned = convpass.optimize(model, shapes=["x=1x3x8x8", "x=32x3x8x8"], quiet=True)
    info, (node,) = annotation.read_annotations(tuned)
    assert [p.name for p in info.profiles] == ["x=1x3x8x8", "x=32x3x8x8"]
    assert [d.problem_key.split("|")[1] for d in node.decisions] == ["n=1", "n=32"]
    _check_tuned(model, tuned, {"x": random_input((5, 3, 8, 8))})
    records = convpass.inspect(tuned)
    assert [r["profile"] for r in records] == ["x=1x3x8x8", "x=32x3x8x8"]


def test_identical_problems_are_listed_once():
    from convpass.compiler.passes.canonicalize_convs import CanonicalizeConvsPass
    from convpass.compiler.passes.collect_conv_problems import CollectConvProblemsPass
    from convpass.compiler.passes.resolve_shapes import ResolveShapesPass
    from convpass.core.model_io import load_model

    w = numpy_helper.from_array(np.ones((3, 3, 3, 3), np.float32), "w")
    nodes = [helper.make_node("Conv", [a, "w"], [b], name=f"c{i}", pads=[1, 1, 1, 1]) for i, (a, b) in enumerate([("x", "y1"), ("y1", "y2"), ("y2", "y3")])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y3", TensorProto.FLOAT, [1, 3, 8, 8])], [w])
    model = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    ResolveShapesPass()(model)
    CanonicalizeConvsPass()(model)
    collect = CollectConvProblemsPass(("fwd", "dgrad", "wgrad"))
    collect(model)
    assert [p.direction for p in collect.problems] == ["fwd", "dgrad", "wgrad"]
    assert all(len(uses) == 3 for uses in collect.problems.values())


def test_unresolved_shape_names_node_tensor_dim_and_fix():
    model = conv_model("Conv", ("batch", 3, 8, 8), (4, 3, 3, 3))
    with pytest.raises(ShapeError) as info:
        convpass.optimize(model, quiet=True)
    message = str(info.value)
    for part in ("'conv'", "'x'", "dim 0", "'batch'", "shapes=['x=1x3x8x8']"):
        assert part in message


@pytest.mark.parametrize(
    "spec,message",
    [("y=1x3x8x8", "unknown input"), ("x=1x3x8", "rank 4"), ("x=1x4x8x8", "fixed at 3"), ("x=1by3", "NAME=DIMS"), ("x=0x3x8x8", "between 1 and")],
)
def test_bad_shape_profiles(spec, message):
    model = conv_model("Conv", ("batch", 3, 8, 8), (4, 3, 3, 3))
    with pytest.raises(ShapeError, match=message):
        convpass.optimize(model, shapes=[spec], quiet=True)


def _model_with_weight_chain(kind: str) -> onnx.ModelProto:
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes, inits, inputs = [], [], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])]
    if kind == "constant":
        nodes.append(helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(w)))
    elif kind == "cast_reshape":
        inits += [numpy_helper.from_array(w.reshape(4, 27).astype(np.float16), "w16"), numpy_helper.from_array(np.array([4, 3, 3, 3], np.int64), "shape")]
        nodes += [helper.make_node("Cast", ["w16"], ["w32"], to=TensorProto.FLOAT), helper.make_node("Identity", ["w32"], ["w32i"]),
                  helper.make_node("Reshape", ["w32i", "shape"], ["w"])]
    elif kind == "dequantize":
        q = np.clip(np.round(w / 0.05), -127, 127).astype(np.int8)
        inits += [numpy_helper.from_array(q, "wq"), numpy_helper.from_array(np.array(0.05, np.float32), "scale")]
        nodes.append(helper.make_node("DequantizeLinear", ["wq", "scale"], ["w"]))
    elif kind == "dynamic":
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3, 3, 3]))
    nodes.append(helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("kind", ["constant", "cast_reshape", "dequantize"])
def test_constant_weight_chains_are_folded_and_tuned(kind):
    model = _model_with_weight_chain(kind)
    tuned = convpass.optimize(model, quiet=True)
    (conv,) = [n for n in tuned.graph.node if annotation.standard_op_type(n) == "Conv"]
    assert conv.domain == annotation.DOMAIN
    assert conv.input[1] in {i.name for i in tuned.graph.initializer}
    assert len(tuned.graph.node) == 1, "the folded chain is removed"
    _check_tuned(model, tuned, {"x": random_input((1, 3, 8, 8))})


def test_dynamic_weight_is_left_untuned_with_a_warning(caplog):
    model = _model_with_weight_chain("dynamic")
    tuned = convpass.optimize(model, quiet=True)
    (conv,) = tuned.graph.node
    assert conv.domain == "" and "left untuned" in caplog.text and "graph input" in caplog.text
    rng = np.random.default_rng(3)
    feeds = {"x": random_input((1, 3, 8, 8)), "w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32)}
    _check_tuned(model, tuned, feeds)
    assert convpass.inspect(tuned)[0]["source"] == "untuned"


def test_old_ir_initializers_listed_as_inputs():
    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), opset=7, ir_version=3, pads=[1, 1, 1, 1])
    for init in model.graph.initializer:
        model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    tuned = convpass.optimize(model, quiet=True)
    assert tuned.ir_version == annotation.MIN_IR_VERSION
    assert [n.domain for n in tuned.graph.node if n.op_type == "Conv"] == [annotation.DOMAIN]
    _check_tuned(model, tuned, {"x": random_input((1, 3, 8, 8))})


@pytest.mark.parametrize("opset,ir_version", [(7, 4), (9, 4), (11, 6), (13, 7), (17, 8), (21, 10)])
def test_opsets_7_to_21_and_ir_versions(opset, ir_version):
    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), opset=opset, ir_version=ir_version, strides=[2, 2])
    tuned = convpass.optimize(model, quiet=True)
    assert tuned.ir_version == max(ir_version, 8)
    _check_tuned(model, tuned, {"x": random_input((1, 3, 8, 8))})


def test_training_directions_are_recorded():
    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1])
    tuned = convpass.optimize(model, directions="fwd,dgrad,wgrad", quiet=True)
    (record,) = convpass.inspect(tuned)
    assert record["dgrad_algo"] == "auto" and record["wgrad_algo"] == "auto"
    info = annotation.read_model_info(tuned)
    assert info.options["directions"] == ["fwd", "dgrad", "wgrad"]


def test_no_gpu_and_no_device_name_touches_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVPASS_CACHE", str(tmp_path / "never.db"))
    convpass.optimize(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), quiet=True)
    assert not (tmp_path / "never.db").exists()


def test_metadata_records_version_mode_profiles_and_matmul_tf32():
    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3))
    tuned = convpass.optimize(model, mode="heuristic", matmul_tf32="on", quiet=True)
    info = annotation.read_model_info(tuned)
    assert info.convpass_version == convpass.__version__
    assert info.mode == "heuristic" and info.matmul_allow_tf32 is True
    assert info.device == "" and len(info.profiles) == 1


@pytest.mark.parametrize(
    "options,message",
    [
        ({"mode": "fast"}, "mode 'fast'"),
        ({"fprop_algo": "algo_0"}, "fprop_algo 'algo_0'"),
        ({"wgrad_algo": "implicit_gemm"}, "wgrad_algo 'implicit_gemm'"),
        ({"tf32": "maybe"}, "tf32 'maybe'"),
        ({"layout": "nwhc"}, "layout 'nwhc'"),
        ({"workspace_limit": "lots"}, "workspace_limit 'lots'"),
        ({"directions": "fwd,bwd"}, "directions 'fwd,bwd'"),
    ],
)
def test_unknown_option_values(options, message):
    """The Python API names its own arguments, not the CLI's flags."""
    with pytest.raises(OptionError, match=message) as info:
        convpass.optimize(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), quiet=True, **options)
    assert "--" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# bad input through the CLI: one line, non-zero exit, nothing written


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "convpass.cli.main", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def _bad_files(tmp_path):
    good = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3))
    data = good.SerializeToString()
    (tmp_path / "text.onnx").write_text("this is not a model\n" * 10)
    (tmp_path / "truncated.onnx").write_bytes(data[: len(data) // 2])
    (tmp_path / "zero.onnx").write_bytes(b"")
    empty = helper.make_model(helper.make_graph([], "g", [], []), opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(empty, tmp_path / "empty.onnx")
    onnx.save(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), opset=6, ir_version=3), tmp_path / "opset6.onnx")
    onnx.save(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), opset=22, ir_version=10), tmp_path / "opset22.onnx")
    negpads = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), pads=[-1, 1, 1, 1])
    negpads.graph.output[0].CopyFrom(helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 7, 8]))
    onnx.save(negpads, tmp_path / "negpads.onnx")
    onnx.save(conv_model("Conv", (1, 3, 2, 2), (4, 3, 5, 5)), tmp_path / "bigkernel.onnx")
    onnx.save(good, tmp_path / "good.onnx")


@pytest.mark.parametrize(
    "name,extra,message",
    [
        ("text.onnx", [], "not an ONNX model"),
        ("truncated.onnx", [], "not an ONNX model"),
        ("zero.onnx", [], "empty"),
        ("missing.onnx", [], "no such file"),
        ("empty.onnx", [], "graph is empty"),
        ("opset6.onnx", [], "unsupported opset 6"),
        ("opset22.onnx", [], "unsupported opset 22"),
        ("negpads.onnx", [], "negative pads"),
        ("bigkernel.onnx", [], "larger than the padded input"),
        ("good.onnx", ["--mode", "fast"], "invalid choice"),
        ("good.onnx", ["--tf32", "maybe"], "--tf32"),
        ("good.onnx", ["--shape", "x=1x3"], "rank 4"),
    ],
)
def test_cli_bad_input(tmp_path, name, extra, message):
    _bad_files(tmp_path)
    out = tmp_path / "out" / "tuned.onnx"
    out.parent.mkdir()
    result = _cli("optimize", tmp_path / name, "-o", out, *extra)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    if result.returncode == 1:  # convpass's own errors are one line (argparse's come with the usage)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(out.parent.iterdir()) == [], "nothing is written on failure"


def test_cli_missing_output_directory(tmp_path):
    onnx.save(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), tmp_path / "m.onnx")
    result = _cli("optimize", tmp_path / "m.onnx", "-o", tmp_path / "nope" / "t.onnx")
    assert result.returncode == 1 and "does not exist" in result.stderr


def test_cli_optimize_and_inspect_json(tmp_path):
    onnx.save(conv_model("Conv", ("n", 3, 8, 8), (4, 3, 3, 3)), tmp_path / "m.onnx")
    result = _cli("optimize", tmp_path / "m.onnx", "-o", tmp_path / "t.onnx", "--shape", "x=1x3x8x8", "--shape", "x=8x3x8x8")
    assert result.returncode == 0, result.stderr
    assert "recorded as algo=auto" in result.stderr and "no GPU" in result.stderr
    result = _cli("inspect", tmp_path / "t.onnx", "--json")
    records = json.loads(result.stdout)["records"]
    assert [(r["node"], r["profile"]) for r in records] == [("conv", "x=1x3x8x8"), ("conv", "x=8x3x8x8")]
    assert _cli("inspect", tmp_path / "t.onnx").returncode == 0


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    import onnx_ir as ir

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ir, "save", boom)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConvpassError, match="cannot write .*t.onnx: disk full"):
        convpass.optimize(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), out / "t.onnx", quiet=True)
    assert list(out.iterdir()) == []


def test_external_data_is_kept_next_to_the_output(tmp_path):
    model = conv_model("Conv", (1, 16, 8, 8), (64, 16, 3, 3), pads=[1, 1, 1, 1])
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(onnx.ModelProto.FromString(model.SerializeToString()), src / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True, location="m.weights", size_threshold=0)
    out = tmp_path / "out"
    out.mkdir()
    convpass.optimize(src / "m.onnx", out / "t.onnx", quiet=True)
    assert sorted(p.name for p in out.iterdir()) == ["t.onnx", "t.onnx.data"]
    tuned = onnx.load(out / "t.onnx")
    _check_tuned(model, tuned, {"x": random_input((1, 16, 8, 8))})


def test_external_data_escaping_the_folder_is_refused(tmp_path):
    model = conv_model("Conv", (1, 16, 8, 8), (64, 16, 3, 3))
    (tmp_path / "a").mkdir()
    onnx.save(model, tmp_path / "a" / "m.onnx", save_as_external_data=True, location="w.bin", size_threshold=0)
    proto = onnx.load(tmp_path / "a" / "m.onnx", load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../w.bin"
    (tmp_path / "a" / "w.bin").rename(tmp_path / "w.bin")
    onnx.save(proto, tmp_path / "a" / "m.onnx")
    with pytest.raises(ModelLoadError, match="outside the model's folder"):
        convpass.optimize(tmp_path / "a" / "m.onnx", quiet=True)


def test_python_api_accepts_bytes_and_reports_errors_as_convpass_errors():
    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3))
    assert convpass.optimize(model.SerializeToString(), quiet=True).graph.node[0].domain == annotation.DOMAIN
    with pytest.raises(ConvpassError):
        convpass.optimize(b"garbage", quiet=True)


def test_the_checker_refuses_an_invalid_model_however_it_comes(tmp_path):
    """ONNX's checker reads a file's or bytes' own serialization (no copy made again): it must still
    refuse what it refuses as a ModelProto."""
    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3))
    for key in ("k", "k"):  # duplicate metadata keys: valid protobuf, invalid ONNX
        model.metadata_props.add(key=key, value="v")
    onnx.save(model, tmp_path / "dup.onnx")
    for source in (model, model.SerializeToString(), tmp_path / "dup.onnx", str(tmp_path / "dup.onnx")):
        with pytest.raises(ModelLoadError, match="invalid ONNX model"):
            convpass.optimize(source, quiet=True)


def test_large_model_paths(tmp_path, monkeypatch):
    """Past the protobuf limit, initializers go to shape inference as typed inputs and the output is
    written with external data; exercised here by lowering both thresholds to zero."""
    from convpass.compiler.passes import resolve_shapes
    from convpass.core import model_io

    monkeypatch.setattr(resolve_shapes, "_INLINE_LIMIT", 0)
    monkeypatch.setattr(model_io, "_EXTERNAL_DATA_THRESHOLD", 0)
    model = conv_model("Conv", ("n", 8, 8, 8), (16, 8, 3, 3), pads=[1, 1, 1, 1])
    convpass.optimize(model, tmp_path / "big.onnx", shapes=["x=2x8x8x8"], quiet=True)
    assert (tmp_path / "big.onnx.data").is_file()
    tuned = onnx.load(tmp_path / "big.onnx")
    _check_tuned(model, tuned, {"x": random_input((2, 8, 8, 8))})
    assert "n=2" in convpass.inspect(tuned)[0]["problem_key"]


def test_optimize_replaces_the_old_kernel_sidecar_and_says_where_kernels_come_from(tmp_path, capsys):
    from convpass.core.kernel_file import sidecar_path

    out = tmp_path / "t.onnx"
    stale = sidecar_path(out)
    stale.write_bytes(b"the kernels of the model that was here before")
    convpass.optimize(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), out)
    assert out.exists() and not stale.exists()
    assert "kernels: not compiled ahead of time here" in capsys.readouterr().err
    convpass.optimize(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), out, kernels=False)
    assert "kernels:" not in capsys.readouterr().err


def test_executor_reads_a_model_with_external_data_by_path(tmp_path):
    from convpass.runtime import Executor

    model = conv_model("Conv", (1, 16, 8, 8), (64, 16, 3, 3), pads=[1, 1, 1, 1])
    onnx.save(onnx.ModelProto.FromString(model.SerializeToString()), tmp_path / "m.onnx", save_as_external_data=True,
              all_tensors_to_one_file=True, location="m.weights", size_threshold=0)
    x = random_input((1, 16, 8, 8))
    np.testing.assert_allclose(Executor(tmp_path / "m.onnx").run(None, {"x": x})[0], run_ort(model, {"x": x})[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quiet", [False, True])
def test_kernels_that_do_not_build_are_said_even_when_quiet(tmp_path, monkeypatch, capsys, caplog, quiet):
    import convpass.compiler.aot
    import convpass.runtime.cuda

    def fail(path, **kw):
        raise ConvpassError(f"compiling the kernels of {path} failed (nothing was written):\nboom")

    monkeypatch.setattr(convpass.runtime.cuda, "unavailable_reason", lambda: None)  # "a GPU is here"
    monkeypatch.setattr(convpass.compiler.aot, "compile_kernels", fail)
    out = tmp_path / "t.onnx"
    convpass.optimize(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), out, quiet=quiet)
    said = capsys.readouterr().err + caplog.text
    assert out.exists() and "the tuned model was written, its kernels were not" in said and "boom" in said


def _bias_and_biasless_model(empty_bias_name: bool = False) -> onnx.ModelProto:
    """A bias-less conv (as torch.export writes them; or with an empty bias name) feeding a conv
    with a bias, 16 channels."""
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32), name) for name in ("w1", "w2")]
    inits.append(numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b2"))
    nodes = [
        helper.make_node("Conv", ["x", "w1", ""] if empty_bias_name else ["x", "w1"], ["y1"], name="plain", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["y1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["out"], name="biased", pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 16, 16])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 16, 16, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _ort_optimized_ops(model: onnx.ModelProto, tmp_path, name: str) -> list[tuple[str, str]]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.optimized_model_filepath = str(tmp_path / name)
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sorted((n.domain, n.op_type) for n in onnx.load(tmp_path / name).graph.node)


@pytest.mark.parametrize("empty_bias_name", [False, True], ids=["two_inputs", "empty_bias_name"])
def test_a_conv_without_a_bias_gets_a_function_without_one(empty_bias_name, tmp_path):
    """Schema 6: a bias-less conv is ai.convpass.ConvNoBias, whose function takes X, W only. Called
    without B, a 3-input function inlines to a conv with an empty bias input, which ONNX Runtime's
    CPU layout optimizer leaves alone (a torch.export ResNet-50 ran 20-30% slower once tuned)."""
    model = _bias_and_biasless_model(empty_bias_name)
    tuned = convpass.optimize(model, quiet=True)
    _check_tuned(model, tuned, {"x": random_input((1, 16, 16, 16))})
    ops = {n.name: (n.op_type, len(n.input)) for n in tuned.graph.node if n.domain == annotation.DOMAIN}
    assert ops == {"plain": ("ConvNoBias", 2), "biased": ("Conv", 3)}  # an empty bias name is dropped
    functions = {f.name: list(f.input) for f in tuned.functions}
    assert functions == {"Conv": ["X", "W", "B"], "ConvNoBias": ["X", "W"]}
    assert [r["op"] for r in convpass.inspect(tuned)] == ["Conv", "Conv"]
    # as ONNX Runtime optimizes the two-input original (with an empty bias name its layout optimizer
    # leaves the original's conv alone: the tuned model is then the faster one)
    assert _ort_optimized_ops(tuned, tmp_path, "tuned.onnx") == _ort_optimized_ops(_bias_and_biasless_model(), tmp_path, "original.onnx")
    assert [n.op_type for n in annotation.standard_model(tuned).graph.node] == ["Conv", "Relu", "Conv"]
    onnx.inliner.inline_local_functions(tuned)  # the call matches its function's inputs
    out = convpass.Executor(tuned, device="cpu").run(None, {"x": random_input((1, 16, 16, 16))})
    np.testing.assert_allclose(out[0], run_ort(model, {"x": random_input((1, 16, 16, 16))})[0], rtol=1e-5, atol=1e-5)


def test_a_schema_5_model_with_a_biasless_conv_still_reads():
    tuned = convpass.optimize(_bias_and_biasless_model(), quiet=True)
    old = onnx.ModelProto()
    old.CopyFrom(tuned)  # as schema 5 wrote it: every conv named Conv, one 3-input function
    for node in old.graph.node:
        node.op_type = annotation.standard_op_type(node)
    del old.functions[:]
    old.functions.append(annotation.conv_function("Conv", 17))
    for prop in old.metadata_props:
        if prop.key == "convpass.schema_version":
            prop.value = "5"
    onnx.checker.check_model(old, full_check=True)
    assert [r["op"] for r in convpass.inspect(old)] == ["Conv", "Conv"]
    x = {"x": random_input((1, 16, 16, 16))}
    np.testing.assert_allclose(convpass.Executor(old, device="cpu").run(None, x)[0], run_ort(tuned, x)[0], rtol=1e-5, atol=1e-5)


def test_re_optimizing_a_tuned_model_resolves_shapes_through_its_tuned_convs():
    """A tuned model edited and optimized again: a conv downstream whose input shape ONNX cannot
    infer (a Reshape to a computed shape) is resolved by the CPU run, which takes the tuned convs
    by their standard op's rules (shapes only), not as ops it does not know."""
    from convpass.compiler.pipeline import build_options, optimize_model
    from convpass.core.model_io import load_model

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((4, 4, 3, 3)) * 0.1).astype(np.float32), n) for n in ("w1", "w2")]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["y"], name="c1", pads=[1, 1, 1, 1]),
        helper.make_node("Shape", ["y"], ["s"]),
        helper.make_node("ReduceMax", ["s"], ["m"], keepdims=1),
        helper.make_node("Div", ["s", "m"], ["s1"]),
        helper.make_node("Mul", ["s1", "m"], ["s2"]),
        helper.make_node("Reshape", ["y", "s2"], ["y2"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 8, 8])],
                              [helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["a", "b", "c", "d"])], inits)
    tuned = convpass.optimize(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
                              quiet=True, shapes=["x=2x4x8x8"])
    tuned.graph.node.append(helper.make_node("Conv", ["y2", "w2"], ["z"], name="c2", pads=[1, 1, 1, 1]))
    del tuned.graph.output[:]
    tuned.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["a", "b", "c", "d"]))
    model = load_model(tuned)
    report = optimize_model(model, build_options({}), ["x=2x4x8x8"])
    (note,) = [n for n in report.notes if "resolved by running" in n]
    assert "'y2'" in note and "depends on input values" not in " ".join(report.notes)


@pytest.mark.parametrize("kw,math", [
    ({"tf32": "off"}, "fma"), ({"precision": "fp32"}, "fma"),
    ({"tf32": "on"}, "default"), ({"precision": "tf32"}, "default"),
    ({}, annotation.AUTO),
])
def test_an_undecided_conv_records_the_math_its_options_force(kw, math):
    """Without a GPU nothing is tuned: each conv is left to cuDNN's heuristic at run time, under the
    math the options ask for (FMA for --tf32 off / --precision fp32, so that the executor's heuristic
    does not run TF32), and ``auto`` where both are allowed."""
    tuned = convpass.optimize(onnx.load(str(MODELS / "residual_cnn.onnx")), quiet=True, **kw)
    _, nodes = annotation.read_annotations(tuned)
    decisions = [d for node in nodes for d in node.decisions]
    assert decisions and all(d.is_auto for d in decisions)
    assert {d.math_mode for d in decisions} == {math}


def test_an_untuned_conv_runs_cudnn_s_heuristic_under_the_math_its_model_records(monkeypatch):
    import types

    from convpass.kernels.conv_resolve import ConvResolver
    from convpass.ops.conv import ConvCall

    seen = []
    monkeypatch.setattr(ConvResolver, "heuristic_exec",
                        lambda self, call, source, note, math="default": seen.append((source, math)) or "ran")
    rt = types.SimpleNamespace(cp=None)
    geometry = types.SimpleNamespace(op_type="Conv", spatial_rank=2, shapes=[types.SimpleNamespace(dtype="float32")])
    for math in ("fma", "default", annotation.AUTO):
        decision = annotation.ConvDecision(math_mode=math)
        assert ConvResolver(rt, None)._make_exec(ConvCall("c1", geometry, decision), np.float32) == "ran"
    assert seen == [("untuned", "fma"), ("untuned", "default"), ("untuned", "default")]

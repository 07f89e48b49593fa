"""Initializers stored as external data: memory-mapped by the executor, not read into memory
(issue 10: no whole-model copies at start-up), with clear errors for a file that cannot serve."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import conv_model, random_input, run_ort
from onnx import TensorProto, helper

from convpass.runtime import Executor, ExecutorError


def _external(model: onnx.ModelProto, folder: Path, location: str = "m.weights") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    onnx.save(onnx.ModelProto.FromString(model.SerializeToString()), path, save_as_external_data=True,
              all_tensors_to_one_file=True, location=location, size_threshold=0)
    return path


def _mapped(a: np.ndarray) -> bool:
    base = a
    while base is not None:
        if isinstance(base, mmap.mmap):
            return True
        base = getattr(base, "base", None)
    return False


def test_external_initializers_are_mapped_and_compute_what_onnx_runtime_does(tmp_path):
    model = conv_model("Conv", (1, 16, 8, 8), (32, 16, 3, 3), pads=[1, 1, 1, 1], bias=True)
    path = _external(model, tmp_path)
    feeds = {"x": random_input((1, 16, 8, 8))}
    ex = Executor(path, fold_batchnorm=False)
    weights = ex._constants
    assert weights and all(_mapped(a) for a in weights.values())
    assert all(type(a) is np.ndarray for a in weights.values())  # a plain array over the map
    np.testing.assert_allclose(ex.run(None, feeds)[0], run_ort(model, feeds)[0], rtol=1e-4, atol=1e-5)
    # copy on write: what the executor would write into an array never reaches the file
    before = (tmp_path / "m.weights").read_bytes()
    next(iter(weights.values()))[...] = 0
    assert (tmp_path / "m.weights").read_bytes() == before


def _edit_external(path: Path, **changes: str) -> None:
    proto = onnx.load(path, load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key in changes:
                e.value = changes[e.key]
    onnx.save(proto, path)


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    path = _external(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), tmp_path / "a")
    (tmp_path / "a" / "m.weights").rename(tmp_path / "m.weights")
    _edit_external(path, location="../m.weights")
    with pytest.raises(ExecutorError, match=r"external data of initializer .* points outside the model's folder"):
        Executor(path, check_model=False)


def test_a_truncated_external_data_file_is_a_clear_error(tmp_path):
    path = _external(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), tmp_path)
    data = tmp_path / "m.weights"
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(ExecutorError, match=r"external data file 'm.weights' holds \d+ bytes, fewer than initializer .* needs .*truncated"):
        Executor(path, check_model=False)


def test_a_length_that_does_not_fit_the_shape_is_refused(tmp_path):
    path = _external(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), tmp_path)
    _edit_external(path, length="12")
    with pytest.raises(ExecutorError, match=r"external data of initializer .* has length 12, but its dims \[4, 3, 3, 3\] need 432 bytes"):
        Executor(path, check_model=False)


def test_external_data_needs_the_model_s_path(tmp_path):
    path = _external(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), tmp_path)
    with pytest.raises(ExecutorError, match="model was not given as a path"):
        Executor(path.read_bytes(), check_model=False)


def test_types_it_does_not_map_are_read_by_onnx(tmp_path):
    # bfloat16 (ml_dtypes) is read by onnx, not mapped: the values onnx gives
    from convpass.runtime.model_file import read_initializers

    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = helper.make_tensor("c", TensorProto.BFLOAT16, [2, 3], values.tolist())
    graph = helper.make_graph([helper.make_node("Cast", ["c"], ["y"], to=TensorProto.FLOAT)], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [t])
    path = _external(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path)
    read = read_initializers(onnx.load(path, load_external_data=False), str(tmp_path))["c"]
    assert not _mapped(read)
    np.testing.assert_array_equal(read.astype(np.float32), values)


def test_a_constant_s_value_stored_outside_is_read_from_the_model_s_folder(tmp_path, monkeypatch):
    # onnx.save(convert_attribute=True) moves Constant values out too; they are read from the
    # model's folder, never from the working one (which holds a decoy file of the same name)
    w = np.full((4, 3, 3, 3), 2, np.float32)
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["w"], value=onnx.numpy_helper.from_array(w, "wv")), helper.make_node("Conv", ["x", "w"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder = tmp_path / "model"
    folder.mkdir()
    x = {"x": np.ones((1, 3, 8, 8), np.float32)}
    want = run_ort(model, x)[0]
    onnx.save(model, folder / "m.onnx", save_as_external_data=True, location="m.w", size_threshold=0, convert_attribute=True)
    stored = onnx.load(folder / "m.onnx", load_external_data=False)
    assert stored.graph.node[0].attribute[0].t.data_location == TensorProto.EXTERNAL
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (elsewhere / "m.w").write_bytes(np.zeros(w.size, np.float32).tobytes())
    monkeypatch.chdir(elsewhere)
    np.testing.assert_allclose(Executor(folder / "m.onnx").run(None, x)[0], want, rtol=1e-5)


def test_a_model_with_external_weights_still_inlines_schema_functions(tmp_path, monkeypatch):
    # Attention (opset 23) has no kernel here: its schema function is inlined, and the inlined
    # model is checked in memory while the weight stays in the external file
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    x = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["q"]), helper.make_node("Attention", ["q", "x", "x"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 8])], [onnx.numpy_helper.from_array(w, "w")])
    path = _external(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), tmp_path / "model")
    monkeypatch.chdir(tmp_path)  # no weights file here
    q = x @ w
    scores = q @ x.transpose(0, 1, 3, 2) / np.sqrt(8)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ x
    np.testing.assert_allclose(Executor(path).run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-5)


def test_an_unaligned_external_tensor_is_copied_aligned(tmp_path):
    from convpass.runtime.model_file import read_initializers

    inits = [onnx.numpy_helper.from_array(np.arange(3, dtype=np.int8), "pad"), onnx.numpy_helper.from_array(np.arange(8, dtype=np.float32), "f")]
    graph = helper.make_graph([helper.make_node("Identity", ["f"], ["y"])], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])], inits)
    path = _external(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path)
    proto = onnx.load(path, load_external_data=False)
    offsets = {t.name: int(next((e.value for e in t.external_data if e.key == "offset"), 0)) for t in proto.graph.initializer}
    assert offsets["f"] % 4  # onnx put it unaligned after the 3 int8s
    read = read_initializers(proto, str(tmp_path))
    assert read["f"].flags.aligned and not _mapped(read["f"]) and _mapped(read["pad"])
    np.testing.assert_array_equal(read["f"], np.arange(8, dtype=np.float32))


def test_a_model_given_without_a_path_with_an_external_constant_is_refused(tmp_path):
    w = onnx.numpy_helper.from_array(np.full((4, 3, 3, 3), 2, np.float32), "wv")
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["w"], value=w), helper.make_node("Conv", ["x", "w"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx",
              save_as_external_data=True, location="m.w", size_threshold=0, convert_attribute=True)
    data = (tmp_path / "m.onnx").read_bytes()
    for given in (data, onnx.load_from_string(data)):
        with pytest.raises(ExecutorError, match="'wv' is stored in an external file, and the model was not given as a path"):
            Executor(given, check_model=False)


def test_the_in_memory_check_puts_the_external_initializers_back(tmp_path):
    from convpass.runtime.support import _check_in_memory

    path = _external(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), bias=True), tmp_path)
    proto = onnx.load(path, load_external_data=False)
    before = (sorted(t.SerializeToString() for t in proto.graph.initializer), [i.SerializeToString() for i in proto.graph.input])
    _check_in_memory(proto)  # the checker would look for m.weights in the working folder
    assert (sorted(t.SerializeToString() for t in proto.graph.initializer), [i.SerializeToString() for i in proto.graph.input]) == before

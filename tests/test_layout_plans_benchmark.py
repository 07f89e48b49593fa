"""benchmarks/layout_plans.py reads a panel folder and a tuning cache and prints one plan row per
model, on a machine without a GPU."""

from __future__ import annotations

import json
import shutil

import recorded
from conftest import REPO, benchmark_script
from recorded import H200

from convpass.tuning.cache import TuningCache

layout_plans = benchmark_script("layout_plans")


def _panel(tmp_path):
    shutil.copy(REPO / "models" / "mobile_block.onnx", tmp_path / "mobile_block.onnx")
    entry = {"name": "mobile_block", "file": "mobile_block.onnx", "input": "input", "input_shape": ["batch", 3, 32, 32]}
    fp16 = dict(entry, file="mobile_block_fp16.onnx")  # not read: the fp32 file only
    (tmp_path / "panel.json").write_text(json.dumps({"models": [entry, fp16]}))


def test_one_row_per_fp32_model_and_what_the_cache_lacks(tmp_path, capsys):
    _panel(tmp_path)
    with TuningCache(tmp_path / "h200.db") as c:  # the H200's recorded rows: none of this model's problems
        c.put(H200, [m for rows in recorded.recorded_rows("tuning").values() for m in rows])
    code = layout_plans.main(["--panel", str(tmp_path), "--cache", str(tmp_path / "h200.db"), "--batch", "4", "--pinned"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert code == 0 and len(rows) == 1
    assert rows[0].startswith("mobile_block") and "no plan (" in rows[0] and "could not be measured or found in the cache" in rows[0]


def test_a_cache_without_the_device_is_a_clear_error(tmp_path, capsys):
    _panel(tmp_path)
    code = layout_plans.main(["--panel", str(tmp_path), "--cache", str(tmp_path / "empty.db")])
    assert code == 2 and "empty.db does not exist" in capsys.readouterr().err and not (tmp_path / "empty.db").exists()
    TuningCache(tmp_path / "empty.db").close()
    code = layout_plans.main(["--panel", str(tmp_path), "--cache", str(tmp_path / "empty.db")])
    assert code == 2 and "no device matching 'H200'" in capsys.readouterr().err
    code = layout_plans.main(["--panel", str(tmp_path / "nowhere"), "--cache", str(tmp_path / "empty.db")])
    assert code == 2 and "nowhere/panel.json is not a panel" in capsys.readouterr().err


def test_pinned_ops_are_the_ones_next_to_nodes_that_may_go_nhwc():
    import onnx_ir as ir

    x = ir.Value(name="x")
    conv = ir.Node("", "Conv", [x], name="conv")
    reshape = ir.Node("", "Reshape", [conv.outputs[0]], name="reshape")  # pinned, reads the conv's output
    gather = ir.Node("", "Gather", [reshape.outputs[0]], name="gather")  # pinned, among pinned nodes only
    graph = ir.Graph([x], [gather.outputs[0]], nodes=[conv, reshape, gather])
    text = layout_plans._pinned_ops(graph, {conv: {"nchw": 1.0, "nhwc": 0.5}}, lambda v: 0.25)
    assert text == "Reshape 1 (0.250 ms)"
    assert layout_plans._pinned_ops(graph, {}, lambda v: 0.25) == "none"
    # a Transpose that moves the channels last reads NHWC by rule: not pinned; any other is
    for perm, want in [((0, 2, 3, 1), "none"), ((0, 1, 3, 2), "Transpose 1 (0.250 ms)")]:
        x = ir.Value(name="x")
        conv = ir.Node("", "Conv", [x], name="conv")
        move = ir.Node("", "Transpose", [conv.outputs[0]], attributes=[ir.AttrInt64s("perm", perm)], name="move")
        graph = ir.Graph([x], [move.outputs[0]], nodes=[conv, move])
        assert layout_plans._pinned_ops(graph, {conv: {"nchw": 1.0, "nhwc": 0.5}}, lambda v: 0.25) == want, perm


def test_a_cache_with_both_layouts_and_transposes_gives_the_plan(tmp_path, capsys):
    # two 3x3 convs whose recorded NHWC times are half their NCHW times, and cheap transposes:
    # the plan puts both in NHWC and pays the graph input's and output's transposes
    import numpy as np
    import onnx
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    from convpass.compiler.pipeline import OptimizeReport, build_options, prepare_model
    from convpass.tuning.cache_rows import Measurement

    w = numpy_helper.from_array(np.ones((4, 4, 3, 3), np.float32), "w")
    nodes = [helper.make_node("Conv", ["input", "w"], ["a"], pads=[1, 1, 1, 1], name="c0"),
             helper.make_node("Relu", ["a"], ["b"], name="r"),
             helper.make_node("Conv", ["b", "w"], ["output"], pads=[1, 1, 1, 1], name="c1")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4, 8, 8])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 4, 8, 8])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "two.onnx")
    (tmp_path / "panel.json").write_text(json.dumps({"models": [
        {"name": "two", "file": "two.onnx", "input": "input", "input_shape": ["batch", 4, 8, 8]}]}))
    problems = prepare_model(ir.serde.deserialize_model(onnx.load(tmp_path / "two.onnx")), build_options({"tf32": "on"}),
                             ["input=2x4x8x8"], OptimizeReport())
    assert len(problems) == 1  # both convs are one problem
    shape = next(iter(problems)).primary
    rows = [Measurement(key=shape.key(layout, "default"), algo="implicit_gemm", status="ok", time_ms=ms, workspace_bytes=0,
                        deterministic=True, measured_at=0.0, method="measure", note="test")
            for layout, ms in (("nchw", 1.0), ("nhwc", 0.5))]
    with TuningCache(tmp_path / "h200.db") as c:
        c.put(H200, rows)
        c.put_transpose(H200, (2, 4, 8, 8), "float32", 0.01)
    code = layout_plans.main(["--panel", str(tmp_path), "--cache", str(tmp_path / "h200.db"), "--batch", "2", "--pinned"])
    row = capsys.readouterr().out.strip()
    assert code == 0
    assert row.startswith("two") and "2/  2 convs NHWC,   2 transposes, plan    1.020 ms" in row and row.endswith("pinned: none"), row

"""benchmarks/layout_plans.py reads a panel folder and a tuning cache and prints one plan row per
model, on a machine without a GPU."""

from __future__ import annotations

import importlib.util
import json
import shutil

import recorded
from conftest import REPO
from convpass.cache import TuningCache
from recorded import H200

_spec = importlib.util.spec_from_file_location("layout_plans", REPO / "benchmarks" / "layout_plans.py")
layout_plans = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout_plans)


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
    assert code == 2 and "no device matching 'H200'" in capsys.readouterr().err


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

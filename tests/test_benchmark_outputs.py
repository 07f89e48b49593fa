"""The files the benchmark scripts write (``--json`` / ``--out``): refused up front, before any work,
over the files the script reads (the model, the tuning cache) or over a special file; written
atomically as every convpass output is (:func:`convpass.core.files.write_text_atomically`); names
from the model reach the terminal escaped."""

from __future__ import annotations

import json
import os

import onnx
import prune_rows
import pytest
from conftest import benchmark_script
from test_local_errors_benchmark import bit_block

from convpass.tuning.cache import TuningCache


def _refused(capsys, script: str, argv: list[str], match: str) -> None:
    with pytest.raises(SystemExit) as e:
        benchmark_script(script).main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err, err


@pytest.fixture
def files(tmp_path):
    onnx.save(bit_block(), tmp_path / "m.onnx")
    with TuningCache(tmp_path / "c.db") as cache:
        cache.put(prune_rows.DEVICE, prune_rows.models())
    os.mkfifo(tmp_path / "fifo")
    return {p.name: p.read_bytes() if p.is_file() else None for p in tmp_path.iterdir() if not p.name.startswith("c.db-")}


def _unchanged(tmp_path, before) -> None:
    assert {p.name: p.read_bytes() if p.is_file() else None for p in tmp_path.iterdir() if not p.name.startswith("c.db-")} == before


@pytest.mark.parametrize("target, message", [("c.db", "is the tuning cache: refusing to overwrite it"),
                                             ("fifo", "is a FIFO (named pipe), not a regular file: refusing to replace it")])
def test_prune_replay_json_never_replaces_the_cache_it_replays(tmp_path, capsys, files, target, message):
    _refused(capsys, "prune_replay", [str(tmp_path / "c.db"), "--json", str(tmp_path / target)], f"--json {tmp_path / target} {message}")
    _unchanged(tmp_path, files)


@pytest.mark.parametrize("script, argv", [
    ("local_errors", ["--model", "{m}", "--device", "cpu", "--cache", "{c}", "--json"]),
    ("kernel_table", ["--model", "{m}", "--cache", "{c}", "--json"]),
    ("precision_panel", ["--model", "{m}", "--cache", "{c}", "--out"]),
])
@pytest.mark.parametrize("target", ["m.onnx", "c.db", "fifo"])
def test_benchmark_outputs_are_refused_before_any_work(tmp_path, capsys, files, script, argv, target):
    args = [a.format(m=tmp_path / "m.onnx", c=tmp_path / "c.db") for a in argv] + [str(tmp_path / target)]
    message = {"m.onnx": "refusing to overwrite it", "c.db": "is the tuning cache: refusing to overwrite it",
               "fifo": "not a regular file: refusing to replace it"}[target]
    _refused(capsys, script, args, message)
    _unchanged(tmp_path, files)


def test_local_errors_prints_node_names_escaped_and_writes_json(tmp_path, capsys):
    model = bit_block()
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    conv.name = "conv\x1b]0;pwned\x07\x1b[2J"
    onnx.save(model, tmp_path / "bit.onnx")
    out = tmp_path / "errors.json"
    assert benchmark_script("local_errors").main(["--model", str(tmp_path / "bit.onnx"), "--batch", "2", "--device", "cpu",
                                                  "--cache", str(tmp_path / "c.db"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "\x1b" not in text and "\x07" not in text and "conv" in text
    assert conv.name in [r["node"] for r in json.loads(out.read_text())["nodes"]]  # the JSON keeps the name as it is
    assert not list(tmp_path.glob(".*.tmp"))

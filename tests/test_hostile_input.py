"""Hostile input: every case refused in one line (or handled), nothing changed that was not the named output.

One test per cause; a test's cases are the ways that cause was seen (or could be). Each asserts the
exit code, that a refusal is one ``convpass: error:`` line and nothing else (no traceback, no raw
control character), and that no file changed: inputs, the tuning cache and any would-be output are
compared byte for byte (with their modification times) before and after.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import sqlite3
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import convpass
from conftest import conv_model, random_input, run_ort
from convpass.cli.main import main

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what must never reach a terminal raw (tab and newline may)
HOSTILE = "conv\x1b]0;pwned\x07\x9b31m[bold red]x[/]\u202e"  # an OSC title, a C1 CSI, rich markup, a bidi override


# ---------------------------------------------------------------------------------------------
# helpers


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (itself included) -> (kind, size, mtime_ns, sha256 of a regular file's bytes)."""
    out = {}
    paths = [root] + (sorted(root.rglob("*")) if root.is_dir() and not root.is_symlink() else [])
    for p in paths:
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else os.readlink(p) if p.is_symlink() else None
        out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, digest)
    return out


def check_output(code: int, out: str, err: str, expected: int) -> None:
    assert "Traceback" not in err and "Traceback" not in out, err
    assert not CONTROL.search(out) and not CONTROL.search(err), (out, err)
    assert code == expected, (code, out, err)
    if expected == 1:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("convpass: error: "), err


def cli(capsys, *args, expected: int = 1, match: str | None = None) -> tuple[str, str]:
    """Run the command line in this process; assert the exit code, one error line (exit 1) and no raw
    control characters; ``match``: a regex the error line (or the output) must contain."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    check_output(code, out, err, expected)
    if match is not None:
        assert re.search(match, err if expected else out), (err, out)
    return out, err


def cli_process(*args, expected: int = 1, match: str | None = None, timeout: float = 60, cwd=None) -> tuple[str, str]:
    """:func:`cli` in a process of its own, for the cases that hung (a hang fails the test at ``timeout``)."""
    result = subprocess.run([sys.executable, "-m", "convpass.cli.main", *map(str, args)], capture_output=True, text=True,
                            timeout=timeout, cwd=cwd)
    check_output(result.returncode, result.stdout, result.stderr, expected)
    if match is not None:
        assert re.search(match, result.stderr if expected else result.stdout), result.stderr
    return result.stdout, result.stderr


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, path)
    return path


def small_model() -> onnx.ModelProto:
    return conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1])


def tuned_model(tmp_path: Path, model: onnx.ModelProto | None = None, name: str = "tuned.onnx") -> Path:
    src = save(model or small_model(), tmp_path / "src.onnx")
    out = tmp_path / name
    convpass.optimize(src, out, quiet=True)
    src.unlink()
    return out


# ---------------------------------------------------------------------------------------------
# strings from files reach the terminal escaped


def test_names_from_files_reach_the_terminal_escaped(tmp_path, capsys):
    model = small_model()
    model.graph.node[0].name = HOSTILE
    model.graph.output[0].name = HOSTILE + "out"
    model.graph.node[-1].output[0] = HOSTILE + "out"
    # a second conv whose weight is a graph input: left untuned, and optimize names it
    model.graph.input.append(helper.make_tensor_value_info("w2", TensorProto.FLOAT, [4, 4, 1, 1]))
    model.graph.node.append(helper.make_node("Conv", [HOSTILE + "out", "w2"], ["z"], name=HOSTILE + "dyn"))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4, 8, 8]))
    src = save(model, tmp_path / "m[red].onnx")
    out, err = cli(capsys, "optimize", src, "-o", tmp_path / "t.onnx", expected=0)
    assert "\\x1b]0;pwned\\x07\\x9b31m[bold red]x[/]\\u202e" in err  # shown, escaped, markup as written
    out, _ = cli(capsys, "inspect", tmp_path / "t.onnx", expected=0)
    assert "\\x1b]0;pwned" in out and "[bold" in out and "m[red].onnx" not in out  # (the title is the tuned file's)
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    np.save(tmp_path / "w2.npy", random_input((4, 4, 1, 1)))
    out, _ = cli(capsys, "run", tmp_path / "t.onnx", "-i", f"x={tmp_path / 'x.npy'}", "-i", f"w2={tmp_path / 'w2.npy'}",
                 "--device", "cpu", "--summary", expected=0)
    assert "conv\\x1b]0;pwned" in out


def test_a_markup_error_in_a_name_is_no_traceback(tmp_path, capsys):
    model = small_model()
    model.graph.node[0].name = "[/]"  # rich's "closing tag with nothing to close"
    out, _ = cli(capsys, "inspect", tuned_model(tmp_path, model), expected=0)
    assert "[/]" in out


# ---------------------------------------------------------------------------------------------
# odd model values and invalid conv attributes: one line naming the node, nothing written


def _with_attrs(**attrs) -> onnx.ModelProto:
    model = small_model()
    node = model.graph.node[0]
    keep = [a for a in node.attribute if a.name not in attrs]
    del node.attribute[:]
    node.attribute.extend(keep + [helper.make_attribute(k, v) for k, v in attrs.items()])
    return model


def _bias(length: int) -> onnx.ModelProto:
    model = small_model()
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.ones(length, np.float32), "b"))
    return model


def _integer_weights() -> onnx.ModelProto:
    model = small_model()
    w = numpy_helper.to_array(model.graph.initializer[0])
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w.astype(np.int32), "w"))
    return model


def _big_constant() -> onnx.ModelProto:
    """A Constant that declares 10^12 elements and holds none."""
    model = small_model()
    big = TensorProto(name="big", data_type=TensorProto.FLOAT, dims=[10**12])
    model.graph.node.insert(0, helper.make_node("Constant", [], ["c"], value=big, name="const"))
    return model


def _big_initializer() -> onnx.ModelProto:
    model = small_model()
    model.graph.initializer.append(TensorProto(name="big", data_type=TensorProto.FLOAT, dims=[10**6, 10**6]))
    return model


def _invalid_utf8(path: Path) -> None:
    path.write_bytes(small_model().SerializeToString().replace(b"relu", b"r\xfflu"))


CONV_CASES = {
    "stride 0": (lambda: _with_attrs(strides=[0, 0]), r"Conv 'conv': strides must be >= 1"),
    "dilation 0": (lambda: _with_attrs(dilations=[1, 0]), r"Conv 'conv': dilations must be >= 1"),
    "pads of 2^40": (lambda: _with_attrs(pads=[2**40] * 4), r"Conv 'conv': pads .* larger than"),
    "negative group": (lambda: _with_attrs(group=-3), r"Conv 'conv': group must be >= 1"),
    "group not dividing": (lambda: _with_attrs(group=2), r"Conv 'conv': .*group 2"),
    "kernel_shape": (lambda: _with_attrs(kernel_shape=[5, 5]), r"Conv 'conv': kernel_shape \[5, 5\] does not match"),
    "strides of another rank": (lambda: _with_attrs(strides=[1, 1, 1]), r"Conv 'conv': strides has 3 entries"),
    "bias of the wrong length": (lambda: _bias(3), r"Conv 'conv': its bias 'b' has 3 values for 4 output channels"),
    "a bias of rank 2": (lambda: _bias(4).__class__ and _matrix_bias(), r"Conv 'conv': its bias 'b' has shape \[2, 2\]"),
    "integer weights": (_integer_weights, r"Conv 'conv': .*int32"),
    "auto_pad unknown": (lambda: _with_attrs(auto_pad="SIDEWAYS"), r"Conv 'conv': unknown auto_pad 'SIDEWAYS'"),
}


def _matrix_bias() -> onnx.ModelProto:
    model = small_model()
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.ones((2, 2), np.float32), "b"))
    return model


@pytest.mark.parametrize("case", CONV_CASES)
def test_invalid_conv_attributes_are_optimize_errors(tmp_path, capsys, case):
    build, message = CONV_CASES[case]
    src = save(build(), tmp_path / "m.onnx")
    before = tree(tmp_path)
    cli(capsys, "optimize", src, "-o", tmp_path / "t.onnx", match=message)
    assert tree(tmp_path) == before


MODEL_CASES = {
    "a 10^12-element constant": (_big_constant, r"tensor attribute 'value' of node 'const' declares dims \[1000000000000\] .* holds 0 values"),
    "a 10^12-element initializer": (_big_initializer, r"initializer 'big' declares dims \[1000000, 1000000\] .* holds 0 values"),
    "invalid UTF-8 text": (None, r"field graph.node\[1\].name is not valid UTF-8"),
    "opset 6": (lambda: conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), opset=6, ir_version=3), r"unsupported opset 6 \(.* opsets 7 to \d+\)"),
    "opset 99": (lambda: conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), opset=99, ir_version=10), r"unsupported opset 99 \(.* opsets 7 to \d+\)"),
}


@pytest.mark.parametrize("command", ["optimize", "inspect", "run"])
@pytest.mark.parametrize("case", MODEL_CASES)
def test_odd_model_values_are_one_line_errors(tmp_path, capsys, case, command):
    build, message = MODEL_CASES[case]
    src = tmp_path / "m.onnx"
    _invalid_utf8(src) if build is None else save(build(), src)
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    before = tree(tmp_path)
    args = {"optimize": ["-o", tmp_path / "t.onnx"], "inspect": [], "run": ["-i", tmp_path / "x.npy", "-o", tmp_path / "out"]}[command]
    cli(capsys, command, src, *args, match=message)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("spec,message", [
    (f"x={2**64}x3x8x8", r"--shape .*: dimensions must be between 1 and 2147483647"),
    (f"x={2**31}x3x8x8", r"--shape .*: dimensions must be between 1 and 2147483647"),
    ("x=0x3x8x8", r"--shape .*: dimensions must be between 1 and"),
    ("x=-1x3x8x8", r"--shape 'x=-1x3x8x8': expected NAME=DIMS"),
    ("x=1x3x8x8,x=1x3x8x8", r"given twice"),
])
def test_shape_options_out_of_range_are_one_line_errors(tmp_path, capsys, spec, message):
    src = save(conv_model("Conv", ("N", 3, 8, 8), (4, 3, 3, 3)), tmp_path / "m.onnx")
    before = tree(tmp_path)
    cli(capsys, "optimize", src, "-o", tmp_path / "t.onnx", "--shape", spec, match=message)
    assert tree(tmp_path) == before

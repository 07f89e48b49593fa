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


# ---------------------------------------------------------------------------------------------
# outputs: never the input, the cache, a special file or a folder


def _cache_with_rows(path: Path) -> Path:
    from convpass.core.device import DeviceFingerprint
    from convpass.core.problem import ConvShape
    from convpass.tuning.cache import Measurement, TuningCache

    key = ConvShape("fwd", 1, 3, 4, (10, 10), (3, 3), (0, 0), (1, 1), (1, 1)).key("nchw", "default")
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        with TuningCache(path) as c:
            c.put(DeviceFingerprint(name, "9.0", 132, 91900), [Measurement(key, "gemm", "ok", 0.5, 0, True, 1.79e9, "measure")])
    return path


def _outputs(tmp_path: Path) -> dict[str, tuple[Path | str, str]]:
    """name -> (the -o value, what the refusal says), with the files they name made."""
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "null").symlink_to("/dev/null")  # a link, so a broken check would replace the link, not the device
    (tmp_path / "link-to-model.onnx").symlink_to(tmp_path / "m.onnx")
    return {
        "the model itself": (tmp_path / "m.onnx", r"is the input model: refusing to overwrite it"),
        "a link to the model": (tmp_path / "link-to-model.onnx", r"is the input model: refusing to overwrite it"),
        "the tuning cache": (tmp_path / "cache.db", r"is the tuning cache: refusing to overwrite it"),
        "a device node": (tmp_path / "null", r"is a character device, not a regular file: refusing to replace it"),
        "a FIFO": (tmp_path / "fifo", r"is a FIFO \(named pipe\), not a regular file: refusing to replace it"),
        "a folder": (tmp_path / "folder", r"is a folder, not a regular file: refusing to replace it"),
        "an empty path": ("", r"an empty path; give a file name"),
        "a missing folder": (tmp_path / "nope" / "t.onnx", r"the output directory .*nope does not exist"),
    }


@pytest.mark.parametrize("case", ["the model itself", "a link to the model", "the tuning cache", "a device node", "a FIFO", "a folder",
                                  "an empty path", "a missing folder"])
def test_optimize_output_refusals(tmp_path, capsys, case):
    save(small_model(), tmp_path / "m.onnx")
    _cache_with_rows(tmp_path / "cache.db")
    target, message = _outputs(tmp_path)[case]
    before = tree(tmp_path)
    cli(capsys, "optimize", tmp_path / "m.onnx", "-o", target, "--cache", tmp_path / "cache.db", "--device-name", "H200", match=message)
    assert tree(tmp_path) == before


def test_optimize_output_never_replaces_the_input_s_external_data(tmp_path, capsys):
    """The input's weights in ``t.onnx.data``: an output ``t.onnx`` would write its own data there."""
    onnx.save(small_model(), tmp_path / "m.onnx", save_as_external_data=True, location="t.onnx.data", size_threshold=0)
    before = tree(tmp_path)
    cli(capsys, "optimize", tmp_path / "m.onnx", "-o", tmp_path / "t.onnx", match=r"t.onnx.data is the input model's external data")
    cli(capsys, "optimize", tmp_path / "m.onnx", "-o", tmp_path / "t.onnx.data", match=r"is the input model's external data")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("case", ["the tuning cache", "a device node", "a FIFO", "a folder", "an empty path", "a missing folder"])
def test_cache_export_output_refusals(tmp_path, capsys, case):
    save(small_model(), tmp_path / "m.onnx")
    _cache_with_rows(tmp_path / "cache.db")
    target, message = _outputs(tmp_path)[case]
    before = tree(tmp_path)
    cli(capsys, "cache", "export", target, "--cache", tmp_path / "cache.db", match=message.replace("a file name", "a file name"))
    assert tree(tmp_path) == before


@pytest.mark.parametrize("case", ["a FIFO", "a folder", "a device node"])
def test_compile_and_run_output_refusals(tmp_path, capsys, case):
    tuned = tuned_model(tmp_path)
    target, message = _outputs(tmp_path)[case]
    os.rename(target, f"{tuned}.kernels")
    before = tree(tmp_path)
    cli(capsys, "compile", tuned, match="kernel side-car .*" + message)
    out = tmp_path / "outs"
    out.mkdir()
    os.rename(f"{tuned}.kernels", out / "out.npy")  # where `run -o outs` saves the output 'out'
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    before = tree(tmp_path)
    cli(capsys, "run", tuned, "-i", tmp_path / "x.npy", "-o", out, "--device", "cpu", match="output 'out' .*" + message)
    assert tree(tmp_path) == before


def test_run_output_dir_refusals(tmp_path, capsys):
    tuned = tuned_model(tmp_path)
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    before = tree(tmp_path)
    cli(capsys, "run", tuned, "-i", tmp_path / "x.npy", "-o", "", match="--output-dir: an empty path")
    cli(capsys, "run", tuned, "-i", tmp_path / "x.npy", "-o", tmp_path / "x.npy", match="is not a folder")
    assert tree(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# destructive cache commands need a selector


@pytest.mark.parametrize("args,message", [
    (["--device-name", ""], r"--device-name is empty, which would name every device; .* or --all"),
    ([], r"needs --device-name NAME .* or --all .*nothing was deleted"),
    (["--device-name", "H200", "--all"], r"--all goes with 'cache clear' alone"),
])
def test_cache_clear_refuses_an_empty_or_missing_selector(tmp_path, capsys, args, message):
    cache = _cache_with_rows(tmp_path / "cache.db")
    before = tree(tmp_path)
    cli(capsys, "cache", "clear", "--cache", cache, *args, match=message)
    assert tree(tmp_path) == before
    cli(capsys, "cache", "clear", "--cache", cache, "--all", expected=0, match="cleared 2 measurements")


# ---------------------------------------------------------------------------------------------
# reads: FIFOs, devices and folders refused before they are opened; sizes bounded


def _special(tmp_path: Path, kind: str) -> Path:
    if kind == "FIFO":
        os.mkfifo(tmp_path / "special")
        return tmp_path / "special"
    if kind == "/dev/zero":
        return Path("/dev/zero")
    (tmp_path / "special").mkdir()
    return tmp_path / "special"


KINDS = {"FIFO": r"FIFO \(named pipe\), not a regular file: refused", "/dev/zero": r"character device, not a regular file: refused",
         "folder": r"(folder, not a regular file|is a directory)"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("role", ["optimize model", "inspect model", "run model", "run input", "cache import file", "--cache",
                                  "optimize --cache", "external data"])
def test_special_files_are_refused_before_they_are_read(tmp_path, role, kind):
    """In a process of its own: a FIFO read would block it (the test fails at the timeout, not forever)."""
    special = _special(tmp_path, kind)
    model = save(small_model(), tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    _cache_with_rows(tmp_path / "cache.db")
    if role == "external data":
        if kind == "/dev/zero":
            pytest.skip("external data lies in the model's folder")
        onnx.save(small_model(), tmp_path / "m.onnx", save_as_external_data=True, location="w.data", size_threshold=0)
        os.replace(tmp_path / "w.data", tmp_path / "w.data.real")
        os.rename(special, tmp_path / "w.data")
    before = tree(tmp_path)
    args = {
        "optimize model": ["optimize", special, "-o", tmp_path / "t.onnx"],
        "inspect model": ["inspect", special],
        "run model": ["run", special, "--device", "cpu"],
        "run input": ["run", model, "-i", special, "--device", "cpu"],
        "cache import file": ["cache", "import", special, "--cache", tmp_path / "cache.db"],
        "--cache": ["cache", "stats", "--cache", special],
        "optimize --cache": ["optimize", model, "-o", tmp_path / "t.onnx", "--cache", special, "--device-name", "H200"],
        "external data": ["optimize", model, "-o", tmp_path / "t.onnx"],
    }[role]
    message = KINDS[kind] if role != "external data" else r"external data file 'w.data' of initializer 'w' is a " + KINDS[kind]
    cli_process(*args, match=message)
    assert tree(tmp_path) == before


def test_external_data_and_side_car_fifos_are_refused_by_run_and_inspect(tmp_path):
    tuned = tuned_model(tmp_path)
    os.mkfifo(f"{tuned}.kernels")
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    before = tree(tmp_path)
    out, _ = cli_process("inspect", tuned, expected=0)
    assert re.search(r"kernels: refused, kernel side-car .* is a FIFO", out)
    cli_process("run", tuned, "-i", tmp_path / "x.npy", "--device", "cpu", expected=0)
    assert tree(tmp_path) == before


def test_reads_are_bounded(tmp_path, capsys, monkeypatch):
    from convpass.core import files, model_io
    from convpass.tuning import cache

    model = save(small_model(), tmp_path / "m.onnx")
    (tmp_path / "big.json").write_text(" " * 5000)
    monkeypatch.setattr(model_io, "_PROTOBUF_LIMIT", 100)
    monkeypatch.setattr(cache, "EXPORT_LIMIT", 1000)
    before = tree(tmp_path)
    cli(capsys, "optimize", model, "-o", tmp_path / "t.onnx", match=r"model .*m.onnx is \d+ bytes, more than the 100 bytes convpass reads: refused")
    cli(capsys, "cache", "import", tmp_path / "big.json", "--cache", tmp_path / "c.db",
        match=r"tuning-cache export .*big.json is 5000 bytes, more than the 1000 bytes convpass reads: refused")
    assert tree(tmp_path) == before
    assert files.read_bytes(model, "model", 10**6) == model.read_bytes()


def test_a_model_declaring_100000_profiles_is_refused_quickly(tmp_path, capsys):
    import time

    tuned = tuned_model(tmp_path)
    model = onnx.load(tuned)
    profiles = json.dumps([{"name": f"p{i}", "inputs": {"x": [1, 3, 8, 8]}} for i in range(100_000)])
    for p in model.metadata_props:
        if p.key == "convpass.profiles":
            p.value = profiles
    save(model, tuned)
    started = time.perf_counter()
    out, err = cli(capsys, "inspect", tuned, match=r"metadata 'convpass.profiles' holds [\d,]+ characters, more than the")
    assert time.perf_counter() - started < 5 and len(out) + len(err) < 1000
    for p in model.metadata_props:
        if p.key == "convpass.profiles":
            p.value = json.dumps([{"name": f"p{i}", "inputs": {"x": [1, 3, 8, 8]}} for i in range(300)])
    save(model, tuned)
    cli(capsys, "inspect", tuned, match=r"the model declares 300 shape profiles; convpass reads at most 256")
    cli(capsys, "run", tuned, "--device", "cpu", match=r"the model declares 300 shape profiles")

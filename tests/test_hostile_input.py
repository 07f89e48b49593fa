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
import math
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
from conftest import conv_model, newer_schema_cache, random_input, run_ort
from onnx import TensorProto, helper, numpy_helper

import convpass
from convpass.cli.main import main
from convpass.core.errors import ExecutorError

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what must never reach a terminal raw (tab and newline may)
HOSTILE = "conv\x1b]0;pwned\x07\x9b31m[bold red]x[/]\u202e"  # an OSC title, a C1 CSI, rich markup, a bidi override


# ---------------------------------------------------------------------------------------------
# helpers


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (itself included) -> (kind, size, mtime_ns, sha256 of a regular file's bytes)."""
    out = {}
    paths = sorted(root.rglob("*")) if root.is_dir() and not root.is_symlink() else [root]
    for p in paths:  # (a folder's own time is left out: a temporary file made and removed beside an output changes it)
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else os.readlink(p) if p.is_symlink() else None
        mtime = st.st_mtime_ns if not stat.S_ISDIR(st.st_mode) else None
        out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_size if mtime else None, mtime, digest)
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


def test_device_names_from_files_reach_the_terminal_escaped(tmp_path, capsys):
    tuned = tuned_model(tmp_path)
    model = onnx.load(tuned)
    next(p for p in model.metadata_props if p.key == "convpass.devices").value = json.dumps([HOSTILE + "|sm_9.0|132sm|cudnn91900"])
    save(model, tuned)
    out, _ = cli(capsys, "inspect", tuned, expected=0)
    assert "decisions for conv\\x1b]0;pwned" in out.replace("\n", "")
    # a cache import of such a device is refused; one already stored is shown escaped
    entry = {"device": HOSTILE + "|sm_9.0|132sm|cudnn91900", "key": "fwd|n=1|c=3|k=4|in=10x10|ker=3x3|pad=0x0|str=1x1|dil=1x1|g=1|float32|nchw|default",
             "algo": "gemm", "status": "ok", "time_ms": 0.5, "workspace_bytes": 0, "deterministic": True, "measured_at": 1.79e9,
             "method": "measure"}
    (tmp_path / "e.json").write_text(json.dumps({"format": "convpass-tuning-cache", "version": 2, "entries": [entry]}))
    cache = _cache_with_rows(tmp_path / "cache.db")
    before = tree(tmp_path)
    cli(capsys, "cache", "import", tmp_path / "e.json", "--cache", cache, match=r"entry 0, field 'device': not a device fingerprint")
    assert tree(tmp_path) == before
    with sqlite3.connect(cache) as c:
        c.execute("UPDATE measurements SET device = ? WHERE device LIKE 'NVIDIA H200%'", (entry["device"],))
    c.close()
    out, err = cli(capsys, "cache", "stats", "--cache", cache, expected=0)
    assert "conv\\x1b]0;pwn" in out and "red]x[/]" in out


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
    from convpass.tuning.cache import TuningCache
    from convpass.tuning.cache_rows import Measurement

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
    assert re.search(r"kernels: refused, kernel side-car .* is a FIFO", out.replace("\n", ""))  # the line folds at the terminal's width
    cli_process("run", tuned, "-i", tmp_path / "x.npy", "--device", "cpu", expected=0)
    assert tree(tmp_path) == before


def test_reads_are_bounded(tmp_path, capsys, monkeypatch):
    from convpass.core import files, model_io
    from convpass.tuning import cache_exchange as cache

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


# ---------------------------------------------------------------------------------------------
# external data: a tuned model complete wherever it is; lengths that do not fit refused


def _model_with_external_constant_and_subgraph(folder: Path) -> tuple[Path, onnx.ModelProto]:
    """A Conv whose output gets a Constant added, then an If whose branches each add an
    initializer of their own; the Constant's value and both branch initializers stored outside."""
    rng = np.random.default_rng(3)
    model = small_model()
    shape = [1, 4, 8, 8]
    c = numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), "cval")

    def branch(name: str, value: float) -> onnx.GraphProto:
        init = numpy_helper.from_array(np.full(shape, value, np.float32), f"{name}_init")
        return helper.make_graph([helper.make_node("Add", ["plus", f"{name}_init"], [f"{name}_out"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, shape)], [init])

    model.graph.node.extend([
        helper.make_node("Constant", [], ["c"], value=c, name="const"),
        helper.make_node("Add", ["out", "c"], ["plus"], name="add"),
        helper.make_node("ReduceSum", ["plus"], ["s"], keepdims=0, name="sum"),
        helper.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
        helper.make_node("If", ["cond"], ["final"], then_branch=branch("then", 1.0), else_branch=branch("else", -1.0), name="if"),
    ])
    model.graph.initializer.append(numpy_helper.from_array(np.array(0, np.float32), "zero"))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("final", TensorProto.FLOAT, shape))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    stored = onnx.ModelProto()
    stored.CopyFrom(model)  # (onnx.save moves the tensors of what it saves out)
    onnx.save(stored, path, save_as_external_data=True, location="m.data", size_threshold=0, convert_attribute=True)
    stored = onnx.load(path, load_external_data=False)
    assert stored.graph.node[2].attribute[0].t.data_location == TensorProto.EXTERNAL  # the Constant's value
    assert stored.graph.node[-1].attribute[0].g.initializer[0].data_location == TensorProto.EXTERNAL  # a branch's
    return path, model


def test_a_tuned_model_with_external_constants_and_subgraphs_loads_anywhere(tmp_path, capsys, monkeypatch):
    import onnxruntime as ort

    src, model = _model_with_external_constant_and_subgraph(tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # the working folder holds nothing of either model
    cli(capsys, "optimize", src, "-o", out / "t.onnx", expected=0)
    x = {"x": random_input((1, 3, 8, 8))}
    want = run_ort(model, x)[0]
    for folder in (tmp_path, out, tmp_path / "in"):  # wherever ONNX Runtime is started
        monkeypatch.chdir(folder)
        got = ort.InferenceSession(str(out / "t.onnx"), providers=["CPUExecutionProvider"]).run(None, x)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    tuned = onnx.load(out / "t.onnx", load_external_data=False)
    outside = [t.name for _, t in __import__("convpass.core.model_check", fromlist=["tensors"]).tensors(tuned)
               if t.data_location == TensorProto.EXTERNAL]
    assert outside == ["w"]  # only the main graph's initializers (over 256 bytes), in the output's own data file
    assert sorted(p.name for p in out.iterdir()) == ["t.onnx", "t.onnx.data"]


@pytest.mark.parametrize("edit,message", [
    ({"length": "12"}, r"external data of initializer 'w' has length 12, but its dims \[4, 3, 3, 3\] need 432 bytes"),
    ({"offset": "-4"}, r"external data of initializer 'w' has a negative offset"),
    ({"offset": "lots"}, r"external data of initializer 'w' has offset 'lots', not an integer"),
    ({"location": "../outside.data"}, r"points outside the model's folder"),
    ({"location": "/etc/passwd"}, r"points outside the model's folder"),
    ({"location": "missing.data"}, r"external data file 'missing.data' of initializer 'w' is missing"),
    ({"truncate": 8}, r"external data file 'm.data' holds \d+ bytes, fewer than initializer '\w+' needs .* truncated"),
    ({"location": ""}, r"initializer 'w' is stored as external data but names no location"),
])
@pytest.mark.parametrize("command", ["optimize", "inspect", "run"])
def test_external_data_that_does_not_fit_is_refused(tmp_path, capsys, edit, message, command):
    path = tmp_path / "m.onnx"
    onnx.save(small_model(), path, save_as_external_data=True, location="m.data", size_threshold=0)
    proto = onnx.load(path, load_external_data=False)
    if "truncate" in edit:
        data = tmp_path / "m.data"
        data.write_bytes(data.read_bytes()[: -edit["truncate"]])
    else:
        for e in proto.graph.initializer[0].external_data:
            if e.key in edit:
                e.value = edit[e.key]
        if "offset" in edit and not any(e.key == "offset" for e in proto.graph.initializer[0].external_data):
            proto.graph.initializer[0].external_data.add(key="offset", value=edit["offset"])
        save(proto, path)
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    before = tree(tmp_path)
    args = {"optimize": ["-o", tmp_path / "t.onnx"], "inspect": [], "run": ["-i", tmp_path / "x.npy", "--device", "cpu"]}[command]
    cli(capsys, command, path, *args, match=message)
    assert tree(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# tuned models altered after tuning; side-cars that claim too much or hold too much


def _square_tuned(tmp_path: Path) -> Path:
    """A tuned 1x1 conv with as many output as input channels: a Conv and a ConvTranspose of it both run."""
    return tuned_model(tmp_path, conv_model("Conv", (1, 4, 8, 8), (4, 4, 1, 1)))


def _tamper(path: Path, how: str) -> None:
    model = onnx.load(path)
    if how == "function body":
        model.functions[0].node[0].op_type = "ConvTranspose"
    elif how == "node op type":  # and a matching function, so that ONNX Runtime would run it as a ConvTranspose
        model.graph.node[0].op_type = "ConvTranspose"
        from convpass.core.annotation import conv_function

        model.functions.append(conv_function("ConvTranspose", 17))
    elif how == "decision direction":
        for a in model.graph.node[0].attribute:
            if a.name == "problem_key":
                a.s = a.s.replace(b"fwd|", b"dgrad|")
    save(model, path)


@pytest.mark.parametrize("how", ["function body", "node op type", "decision direction"])
def test_a_tuned_model_altered_after_tuning_is_refused(tmp_path, capsys, how):
    tuned = _square_tuned(tmp_path)
    _tamper(tuned, how)
    np.save(tmp_path / "x.npy", random_input((1, 4, 8, 8)))
    before = tree(tmp_path)
    message = r"the tuned model was altered; re-run `convpass optimize` on the original model"
    cli(capsys, "run", tuned, "-i", tmp_path / "x.npy", "--device", "cpu", match=message)
    cli(capsys, "inspect", tuned, match=message)
    with pytest.raises(ExecutorError, match=message):
        convpass.Executor(tuned)
    assert tree(tmp_path) == before


def test_a_side_car_s_verified_claim_does_not_skip_the_model_check(tmp_path, capsys):
    from convpass.core import kernel_file

    tuned = tuned_model(tmp_path)
    model = onnx.load(tuned)
    model.graph.node[-1].input.append("nowhere")  # a Relu with two inputs: onnx.checker refuses it
    save(model, tuned)
    kernel_file.write(kernel_file.sidecar_path(tuned), [], model_sha256=kernel_file.file_sha256(tuned), verified=True, cupy_version="14")
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    cli(capsys, "run", tuned, "-i", tmp_path / "x.npy", "--device", "cpu", match=r"model fails onnx.checker")


def _bomb(path: Path, declared: int, actual: int, model_sha256: str) -> None:
    """A side-car whose one member unpacks to ``actual`` bytes of zeros (a few KiB packed), its manifest saying ``declared``."""
    payload = bytes(actual)
    manifest = {"format": "convpass.kernels/1", "convpass": "0", "cupy": "14", "model_sha256": model_sha256, "verified": True,
                "kernels": [{"key": "k" * 32, "arch": "90", "name": "bomb", "file": "bin/" + "k" * 32 + ".sm90",
                             "sha256": hashlib.sha256(payload).hexdigest(), "size": declared}]}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("manifest.json", json.dumps(manifest))
        z.writestr("bin/" + "k" * 32 + ".sm90", payload)


@pytest.mark.parametrize("declared,actual,message", [
    (1000, 64 << 20, r"the binary of kernel 'bomb', bin/k+\.sm90 holds more than 1000 bytes: refused"),
    (1 << 40, 64 << 20, r"kernel 'bomb' declares 1099511627776 bytes, more than convpass reads"),
    (2 << 20, 4 << 20, r"holds more than 2097152 bytes: refused"),
])
def test_side_car_members_are_bounded_and_hashed_while_streamed(tmp_path, capsys, declared, actual, message):
    import tracemalloc

    from convpass.core import kernel_file

    tuned = tuned_model(tmp_path)
    side = kernel_file.sidecar_path(tuned)
    _bomb(side, declared, actual, kernel_file.file_sha256(tuned))
    assert side.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(kernel_file.KernelFileError, match=message):
            kernel_file.read(side)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < max(declared, 1 << 20) + (4 << 20), f"{peak} bytes held while reading"  # never the whole member
    before = tree(tmp_path)
    out, _ = cli(capsys, "inspect", tuned, expected=0)
    assert "kernels: refused" in out
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    cli(capsys, "run", tuned, "-i", tmp_path / "x.npy", "--device", "cpu", expected=0)
    assert {k: v for k, v in tree(tmp_path).items() if k != "x.npy"} == before


# ---------------------------------------------------------------------------------------------
# annotation errors and file-system errors: one line


@pytest.mark.parametrize("key,value,message", [
    ("convpass.schema_version", "abc", r"convpass.schema_version is 'abc', not a number"),
    ("convpass.schema_version", "99", r"tuned by a newer convpass"),
    ("convpass.profiles", "{not json", r"convpass metadata is damaged"),
    ("convpass.profiles", "[" * 100_000, r"convpass metadata is damaged"),
    ("convpass.profiles", '[{"name": "p", "inputs": {"x": [18446744073709551616]}}]', r"convpass metadata is damaged"),
    ("convpass.devices", "[1, 2]", r"convpass metadata is damaged"),
])
def test_annotation_errors_are_one_line_in_inspect_and_run(tmp_path, capsys, key, value, message):
    tuned = tuned_model(tmp_path)
    model = onnx.load(tuned)
    entry = next((p for p in model.metadata_props if p.key == key), None) or model.metadata_props.add(key=key)
    entry.value = value
    save(model, tuned)
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    before = tree(tmp_path)
    cli(capsys, "inspect", tuned, match=message)
    cli(capsys, "run", tuned, "-i", tmp_path / "x.npy", "--device", "cpu", match=message)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("name,value,message", [
    ("time_ms", "fast", r"node 'conv': time_ms holds str values, not numbers"),
    ("algo", 5, r"node 'conv': algo holds int values, not text"),
    ("algo", b"\xff\xfe", r"node 'conv': algo is not UTF-8 text"),
    ("memory_format", ["NCHW"] * 7, r"node 'conv': memory_format has 7 entries for 1 profiles"),
])
def test_decision_attributes_of_the_wrong_kind_are_one_line(tmp_path, capsys, name, value, message):
    tuned = tuned_model(tmp_path)
    model = onnx.load(tuned)
    node = model.graph.node[0]
    keep = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(keep + [helper.make_attribute(name, value)])
    save(model, tuned)
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    cli(capsys, "inspect", tuned, match=message)
    cli(capsys, "run", tuned, "-i", tmp_path / "x.npy", "--device", "cpu", match=message)


def _raise(error: OSError):
    def fail(*args, **kwargs):
        raise error
    return fail


@pytest.mark.parametrize("case", ["disk full while saving", "disk full while renaming", "read-only folder", "unreadable model",
                                  "disk full while exporting", "disk full while saving run outputs"])
def test_file_system_errors_are_one_line(tmp_path, capsys, monkeypatch, case):
    import onnx_ir as ir

    model = save(small_model(), tmp_path / "m.onnx")
    _cache_with_rows(tmp_path / "cache.db")
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    before = tree(tmp_path)
    full = OSError(errno.ENOSPC, "No space left on device")
    if case == "disk full while saving":
        monkeypatch.setattr(ir, "save", _raise(full))
        cli(capsys, "optimize", model, "-o", tmp_path / "t.onnx", match=r"cannot write .*t.onnx: No space left on device \(the disk is full")
    elif case == "disk full while renaming":
        real = os.replace
        monkeypatch.setattr(os, "replace", lambda a, b: _raise(full)() if str(b).endswith("t.onnx") else real(a, b))
        cli(capsys, "optimize", model, "-o", tmp_path / "t.onnx", match=r"cannot write .*t.onnx: No space left on device")
    elif case == "read-only folder":  # (as root, permissions do not stop a write: the refusal the OS would give)
        import tempfile

        monkeypatch.setattr(tempfile, "mkdtemp", _raise(PermissionError(errno.EACCES, "Permission denied")))
        cli(capsys, "optimize", model, "-o", tmp_path / "t.onnx", match=r"cannot write .*t.onnx: Permission denied")
    elif case == "unreadable model":
        real_open = os.open
        monkeypatch.setattr(os, "open", lambda p, *a, **k: _raise(PermissionError(errno.EACCES, "Permission denied", str(p)))()
                            if str(p).endswith("m.onnx") else real_open(p, *a, **k))
        cli(capsys, "optimize", model, "-o", tmp_path / "t.onnx", match=r"cannot read .*m.onnx: Permission denied")
        cli(capsys, "inspect", model, match=r"cannot read .*m.onnx: Permission denied")
        cli(capsys, "run", model, "--device", "cpu", match=r"cannot read .*m.onnx: Permission denied")
    elif case == "disk full while exporting":
        monkeypatch.setattr(json, "dump", _raise(full))
        cli(capsys, "cache", "export", tmp_path / "e.json", "--cache", tmp_path / "cache.db", match=r"cannot write .*e.json: No space left")
    else:
        monkeypatch.setattr(np, "save", _raise(full))
        cli(capsys, "run", model, "-i", tmp_path / "x.npy", "-o", tmp_path / "outs", "--device", "cpu", match=r"cannot write .*out.npy: No space")
        (tmp_path / "outs").rmdir()  # the folder asked for is made; nothing in it
    assert tree(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# large batches on the CPU: memory grows with what is live, not with every tensor of the model


def _fire_model(size: int = 48) -> onnx.ModelProto:
    """squeezenet1_1's pattern: a stem conv, then fire modules (squeeze 1x1, expand 1x1 and 3x3, concat)."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def conv(name, x, cin, cout, k, stride=1, pad=0):
        inits.append(numpy_helper.from_array((rng.standard_normal((cout, cin, k, k)) * (cin * k * k) ** -0.5).astype(np.float32), name + "_w"))
        inits.append(numpy_helper.from_array(np.zeros(cout, np.float32), name + "_b"))
        nodes.append(helper.make_node("Conv", [x, name + "_w", name + "_b"], [name], strides=[stride] * 2, pads=[pad] * 4, name=name))
        nodes.append(helper.make_node("Relu", [name], [name + "_r"], name=name + "_relu"))
        return name + "_r"

    def fire(name, x, cin, s, e):
        sq = conv(name + "_sq", x, cin, s, 1)
        nodes.append(helper.make_node("Concat", [conv(name + "_e1", sq, s, e, 1), conv(name + "_e3", sq, s, e, 3, pad=1)], [name], axis=1))
        return name

    x = conv("stem", "x", 3, 64, 3, stride=2)
    for i in range(4):
        x = fire(f"f{i}", x, 64 if i == 0 else 128, 16, 64)
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["y"]))
    graph = helper.make_graph(nodes, "fire", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 128, 1, 1])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_the_cpu_executor_holds_what_is_live_not_every_tensor(tmp_path):
    import tracemalloc

    model = _fire_model()
    ex = convpass.Executor(model)

    def peak_per_sample(batch: int) -> tuple[float, float]:
        x = random_input((batch, 3, 48, 48))
        peaks = []
        for _ in range(2):  # the first run builds the plan, the second replays it
            tracemalloc.stop()  # (a fresh start: no peak of anything before)
            tracemalloc.start()
            try:
                ex.run(None, {"x": x})
                peaks.append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()
        return peaks[0], peaks[1]

    small, large = peak_per_sample(4), peak_per_sample(16)
    growth = [(big - little) / 12 for little, big in zip(small, large)]  # bytes per sample, first run and replay
    plan = ex.plans[-1]
    every_tensor = sum(math.prod(shape) * dtype.itemsize for shape, dtype in plan.value_info.values()) / 16
    assert growth[0] < 0.45 * every_tensor, (growth, every_tensor)  # the first run held every tensor: 1.0
    assert growth[0] < 1.15 * growth[1], growth  # and it holds what the plan's replays hold
    np.testing.assert_allclose(ex.run(None, {"x": random_input((2, 3, 48, 48))})[0],
                               run_ort(model, {"x": random_input((2, 3, 48, 48))})[0], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# tuning caches: hostile rows, foreign files, read-only commands


_ENTRY = {"device": "NVIDIA H200|sm_9.0|132sm|cudnn91900", "key": "fwd|n=1|c=3|k=4|in=10x10|ker=3x3|pad=0x0|str=1x1|dil=1x1|g=1|float32|nchw|default",
          "algo": "gemm", "status": "ok", "time_ms": 0.5, "workspace_bytes": 0, "deterministic": True, "measured_at": 1.79e9, "method": "measure"}


@pytest.mark.parametrize("case,message", [
    ({"workspace_bytes": 2**63}, r"entry 0, field 'workspace_bytes': must be an integer from 0 to 9223372036854775807"),
    ({"heuristic_rank": 2**64}, r"entry 0, field 'heuristic_rank': must be an integer from 0 to"),
    ({"measured_at": 1e300}, r"entry 0, field 'measured_at': must be a unix time \(a number from 0 to 253402300799"),
    ({"time_ms": float("nan")}, r"not valid JSON \(NaN is not valid JSON\)"),
    ("deep", r"not a convpass tuning-cache export \(JSON nested too deeply\)"),
    ("transpose dims", r"transpose 0: transpose dims must be 1 to 8 integers from 1 to 2147483647"),
    ("not UTF-8", r"not a convpass tuning-cache export \(not UTF-8 text"),
])
def test_hostile_cache_imports_are_one_line_and_change_nothing(tmp_path, capsys, case, message):
    cache = _cache_with_rows(tmp_path / "cache.db")
    path = tmp_path / "e.json"
    if case == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "not UTF-8":
        path.write_bytes(b'{"format": "\xff"}')
    elif case == "transpose dims":
        path.write_text(json.dumps({"format": "convpass-tuning-cache", "version": 2, "entries": [], "transposes": [
            {"device": _ENTRY["device"], "dims": [2**40, 3], "dtype": "float32", "time_ms": 0.1, "measured_at": 1.79e9}]}))
    else:
        path.write_text(json.dumps({"format": "convpass-tuning-cache", "version": 2, "entries": [{**_ENTRY, **case}]}))
    before = tree(tmp_path)
    cli(capsys, "cache", "import", path, "--cache", cache, match=message)
    cli(capsys, "cache", "import", path, "--cache", tmp_path / "new.db", match=message)  # and no new cache is made
    assert tree(tmp_path) == before


@pytest.mark.parametrize("column,value", [("workspace_bytes", "lots"), ("measured_at", 1e300), ("status", "great"), ("key", "not a key"),
                                          ("time_ms", "fast"), ("device", "not a fingerprint"), ("heuristic_rank", -5)])
def test_bad_rows_already_stored_are_skipped_with_a_warning(tmp_path, capsys, column, value):
    from convpass.compiler.optimize import optimize

    cache = _cache_with_rows(tmp_path / "cache.db")
    with sqlite3.connect(cache) as c:  # beside each device's good row, one more that another program wrote
        c.execute("INSERT INTO measurements SELECT device, key, shape, 'bad', method, status, time_ms, workspace_bytes, deterministic, "
                  "measured_at, note, heuristic_rank, find_rank FROM measurements")
        c.execute(f"UPDATE measurements SET {column} = ?{' || rowid' if column == 'device' else ''} WHERE algo = 'bad'", (value,))
    c.close()
    with pytest.warns(Warning) as caught:
        cli(capsys, "cache", "export", tmp_path / "e.json", "--cache", cache, expected=0)
    assert any("skipped" in str(w.message) for w in caught), [str(w.message) for w in caught]
    exported = json.loads((tmp_path / "e.json").read_text())
    assert sorted((e["device"], e["algo"]) for e in exported["entries"]) == [
        ("NVIDIA H100 80GB HBM3|sm_9.0|132sm|cudnn91900", "gemm"), ("NVIDIA H200|sm_9.0|132sm|cudnn91900", "gemm")]
    (tmp_path / "e.json").unlink()
    out, _ = cli(capsys, "cache", "stats", "--cache", cache, expected=0)
    if column == "measured_at":
        assert "?" in out
    model = save(conv_model("Conv", (1, 3, 10, 10), (4, 3, 3, 3)), tmp_path / "m.onnx")
    before = tree(tmp_path)
    with pytest.warns(Warning):
        tuned = optimize(model, cache=cache, device_name="H100", quiet=True, layout="nchw", tf32="on")
    assert tree(tmp_path) == before
    assert convpass.inspect(tuned)[0]["algo"] == "gemm"  # the good row still serves


def _foreign_caches(tmp_path: Path) -> dict[str, Path]:

    out = {}
    out["a model"] = save(small_model(), tmp_path / "model.db")
    out["a text file"] = tmp_path / "notes.db"
    out["a text file"].write_text("my notes\n" * 100)
    out["another program's SQLite"] = tmp_path / "other.db"
    with sqlite3.connect(out["another program's SQLite"]) as c:
        c.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        c.execute("INSERT INTO users VALUES (1, 'ada')")
    c.close()
    newer = out["a newer convpass's cache"] = tmp_path / "newer.db"
    newer_schema_cache(newer)
    return out


FOREIGN = {"a model": "not a convpass tuning cache", "a text file": "not a convpass tuning cache",
           "another program's SQLite": "another program's SQLite database", "a newer convpass's cache": "written by a newer convpass"}


@pytest.mark.parametrize("kind", FOREIGN)
@pytest.mark.parametrize("command", ["cache stats", "cache export", "cache import", "cache clear", "optimize --device-name"])
def test_a_cache_that_is_not_ours_is_refused_never_moved_aside(tmp_path, capsys, kind, command):
    path = _foreign_caches(tmp_path)[kind]
    model = tmp_path / "model.db" if kind == "a model" else save(small_model(), tmp_path / "m.onnx")
    (tmp_path / "e.json").write_text(json.dumps({"format": "convpass-tuning-cache", "version": 2, "entries": [_ENTRY]}))
    before = tree(tmp_path)
    args = {"cache stats": ["cache", "stats"], "cache export": ["cache", "export", tmp_path / "out.json"],
            "cache import": ["cache", "import", tmp_path / "e.json"], "cache clear": ["cache", "clear", "--all"],
            "optimize --device-name": ["optimize", save(small_model(), tmp_path / "x.onnx") if kind == "a model" else model,
                                       "-o", tmp_path / "t.onnx", "--device-name", "H200"]}[command]
    before = tree(tmp_path)
    cli(capsys, *args, "--cache", path, match=FOREIGN[kind] + r".*refused, nothing was changed")
    assert tree(tmp_path) == before
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_read_only_cache_commands_change_and_create_nothing(tmp_path, capsys):
    cache = _cache_with_rows(tmp_path / "cache.db")
    model = save(conv_model("Conv", (1, 3, 10, 10), (4, 3, 3, 3)), tmp_path / "m.onnx")
    before = tree(tmp_path)
    cli(capsys, "cache", "stats", "--cache", cache, expected=0)
    cli(capsys, "cache", "stats", "--cache", cache, "--json", expected=0)
    cli(capsys, "cache", "export", tmp_path / "e.json", "--cache", cache, expected=0)
    (tmp_path / "e.json").unlink()
    cli(capsys, "optimize", model, "--cache", cache, "--device-name", "H200", "-o", tmp_path / "t.onnx", expected=0)
    for name in ("t.onnx", "t.onnx.kernels"):
        (tmp_path / name).unlink(missing_ok=True)
    assert tree(tmp_path) == before  # not a byte, not a -wal, -shm or lock file
    mistyped = tmp_path / "sub" / "tunnig.db"
    for args in (["cache", "stats"], ["cache", "export", tmp_path / "e.json"], ["cache", "clear", "--all"]):
        cli(capsys, *args, "--cache", mistyped, match=r"no tuning cache at .*tunnig.db")
    cli(capsys, "optimize", model, "--cache", mistyped, "--device-name", "H200", "-o", tmp_path / "t.onnx", match="does not exist")
    assert tree(tmp_path) == before and not (tmp_path / "sub").exists()


# ---------------------------------------------------------------------------------------------
# more of the same causes, by other paths


def test_links_and_lying_headers(tmp_path, capsys):
    from convpass.core import kernel_file

    model = save(small_model(), tmp_path / "m.onnx")
    (tmp_path / "loop.onnx").symlink_to(tmp_path / "loop.onnx")
    (tmp_path / "zero.onnx").symlink_to("/dev/zero")
    os.link(model, tmp_path / "hard.onnx")
    np.save(tmp_path / "x.npy", random_input((1, 3, 8, 8)))
    header = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "lying.npy").write_bytes(header.replace(b"(1, 3, 8, 8)", b"(9999999, 3, 8, 8)"))  # a header that promises more
    cache = _cache_with_rows(tmp_path / "cache.db")
    before = tree(tmp_path)
    cli(capsys, "optimize", tmp_path / "loop.onnx", "-o", tmp_path / "t.onnx", match=r"cannot read .*loop.onnx: Too many levels of symbolic links")
    cli(capsys, "inspect", tmp_path / "zero.onnx", match=r"zero.onnx is a character device, not a regular file: refused")
    cli(capsys, "optimize", model, "-o", tmp_path / "hard.onnx", match=r"hard.onnx is the input model: refusing to overwrite it")
    cli(capsys, "run", model, "-i", tmp_path / "lying.npy", "--device", "cpu", match=r"lying.npy declares shape \(9999999, 3, 8, 8\) of float32 .* but holds \d+ bytes: refused")
    cli(capsys, "cache", "import", cache, "--cache", cache, match=r"not a convpass tuning-cache export \(not UTF-8 text")
    assert tree(tmp_path) == before
    # external data reached through a link that leaves the model's folder
    inner = tmp_path / "inner"
    inner.mkdir()
    onnx.save(small_model(), inner / "e.onnx", save_as_external_data=True, location="e.data", size_threshold=0)
    os.replace(inner / "e.data", tmp_path / "e.data")
    (inner / "e.data").symlink_to(tmp_path / "e.data")
    before = tree(tmp_path)
    cli(capsys, "optimize", inner / "e.onnx", "-o", tmp_path / "t.onnx", match=r"points outside the model's folder")
    (inner / "e.data").unlink()
    (inner / "e.data").symlink_to(inner / "e.data")  # a loop
    before = tree(tmp_path)
    cli(capsys, "optimize", inner / "e.onnx", "-o", tmp_path / "t.onnx", match=r"external data file 'e.data' of initializer 'w' cannot be followed")
    cli(capsys, "run", inner / "e.onnx", "--device", "cpu", match=r"external data file 'e.data' of initializer 'w' cannot be followed")
    # a side-car that lists more kernels than any model has
    tuned = tuned_model(tmp_path / "inner")
    with zipfile.ZipFile(kernel_file.sidecar_path(tuned), "w") as z:
        z.writestr("manifest.json", json.dumps({"format": "convpass.kernels/1", "model_sha256": kernel_file.file_sha256(tuned),
                                                "kernels": [{}] * 100_001}))
    out, _ = cli(capsys, "inspect", tuned, expected=0)
    assert re.search(r"kernels: refused, .* lists 100001 kernels, more than the 100000", out.replace("\n", ""))
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("inner/tuned")} == before

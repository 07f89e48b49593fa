"""Hostile input for the readers and writers added after tests/test_hostile_input.py: the input files
of ``optimize --precision auto``, ``--json-file`` / ``--html`` outputs, ``account``, ``bench
--targets`` / ``--from-json`` and the tuning cache's fusion timings.

As there, each test asserts the exit code, that a refusal is one ``convpass: error:`` line naming
the file or option, and that no file changed and none appeared (inputs, the tuning cache, the
would-be outputs and temporary files beside them), compared before and after.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import MODELS
from precision_fakes import synthetic_cache
from test_hostile_input import HOSTILE, _cache_with_rows, _outputs, _raise, cli, cli_process, save, small_model, tree

PRECISION_MODEL = MODELS / "residual_cnn.onnx"  # input (1, 3, 64, 64) float32
GOOD = np.zeros((1, 3, 64, 64), np.float32)


@pytest.fixture(scope="module")
def synthetic_db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile-readers") / "synthetic.db"
    synthetic_cache(path, onnx.load(PRECISION_MODEL))
    return path


def _precision_folder(tmp_path: Path, synthetic_db: Path) -> tuple[Path, Path]:
    """The model and a copy of the synthetic cache in ``tmp_path`` (so that the test sees any change to them)."""
    model, cache = tmp_path / "m.onnx", tmp_path / "cache.db"
    shutil.copyfile(PRECISION_MODEL, model)
    shutil.copyfile(synthetic_db, cache)
    return model, cache


def _optimize_auto(model: Path, cache: Path, *files: str) -> list[str]:
    return ["optimize", model, "-o", model.parent / "t.onnx", "--cache", cache, "--device-name", "Synthetic", "--no-kernels",
            "--precision", "auto", "--max-error", "1e-2", *files]


# ---------------------------------------------------------------------------------------------
# optimize --precision auto: the --calibration / --holdout .npz files


def _npy_bytes(header: dict, data: bytes) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + data


def _hostile_npz(path: Path, case: str) -> None:
    if case == "truncated":
        np.savez(path, input=GOOD)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif case == "not a zip":
        path.write_text("input = zeros(1, 3, 64, 64)\n")
    elif case == "a .npy":
        np.save(open(path, "wb"), GOOD)
    elif case == "object array":
        np.savez(path, input=np.array([{"a": 1}, None], dtype=object))
    elif case == "huge declared shape":  # 4 TB declared over 64 bytes: nothing may be allocated for it
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("input.npy", _npy_bytes({"descr": "<f4", "fortran_order": False, "shape": (1000, 3, 64, 64 * 80_000)}, b"\0" * 64))
    elif case == "a member that is no array":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("input", b"raw bytes")
    elif case == "empty archive":
        zipfile.ZipFile(path, "w").close()
    elif case == "float64":
        np.savez(path, input=GOOD.astype(np.float64))
    elif case in ("NaN", "Inf"):
        bad = GOOD.copy()
        bad[0, 1, 2, 3] = np.nan if case == "NaN" else -np.inf
        np.savez(path, input=bad)
    else:
        raise AssertionError(case)


NPZ_CASES = {
    "truncated": r"--calibration .*in.npz is a damaged NumPy file \(.*\): refused",
    "not a zip": r"--calibration .*in.npz is not a NumPy .npy or .npz file: refused",
    "a .npy": r"--calibration .*in.npz: a .npy file holds one unnamed array; give an .npz archive .*np.savez\(FILE, input=",
    "object array": r"--calibration .*in.npz, array 'input' holds Python objects \(a pickle, .*\): refused",
    "huge declared shape": r"--calibration .*in.npz, array 'input' declares shape \(1000, 3, 64, 5120000\) of float32 \(3932160000000 bytes\) but holds 64 bytes: refused",
    "a member that is no array": r"--calibration .*in.npz: member 'input' is not a .npy array: refused",
    "empty archive": r"--calibration .*in.npz: holds no array for the model input\(s\) input \(it holds none\)",
    "float64": r"--calibration .*in.npz: array 'input' is float64 of rank 4; the model takes float32 of rank 4",
    "NaN": r"--calibration .*in.npz: array 'input' holds 1 NaN or infinite value\(s\); the error cannot be measured on them",
    "Inf": r"--calibration .*in.npz: array 'input' holds 1 NaN or infinite value\(s\)",
}


@pytest.mark.parametrize("case", NPZ_CASES)
def test_hostile_calibration_files_are_one_line_and_change_nothing(tmp_path, capsys, synthetic_db, case):
    model, cache = _precision_folder(tmp_path, synthetic_db)
    _hostile_npz(tmp_path / "in.npz", case)
    before = tree(tmp_path)
    cli(capsys, *_optimize_auto(model, cache, "--calibration", tmp_path / "in.npz"), match=NPZ_CASES[case])
    assert tree(tmp_path) == before


def test_a_calibration_archive_that_inflates_past_the_limit_is_refused_before_it_is_inflated(tmp_path, capsys, synthetic_db, monkeypatch):
    from convpass.compiler.precision import data

    model, cache = _precision_folder(tmp_path, synthetic_db)
    np.savez_compressed(tmp_path / "bomb.npz", input=np.zeros((1, 3, 64, 64 * 64), np.float32))  # 3 MiB of zeros in 4 KiB
    assert (tmp_path / "bomb.npz").stat().st_size < 1 << 16
    monkeypatch.setattr(data, "INPUT_LIMIT", 1 << 20)
    inflated = []
    monkeypatch.setattr(zipfile.ZipExtFile, "read", lambda *a, **k: inflated.append(1))  # nothing may be inflated
    before = tree(tmp_path)
    cli(capsys, *_optimize_auto(model, cache, "--holdout", tmp_path / "bomb.npz"),
        match=r"--holdout .*bomb.npz inflates to 3145856 bytes, more than the 1048576 convpass reads: refused")
    assert tree(tmp_path) == before and not inflated


@pytest.mark.parametrize("kind", ["FIFO", "folder"])
def test_a_calibration_fifo_or_folder_is_refused_before_it_is_read(tmp_path, synthetic_db, kind):
    """In a process of its own: a FIFO read would block it (the test fails at the timeout, not forever)."""
    model, cache = _precision_folder(tmp_path, synthetic_db)
    special = tmp_path / "in.npz"
    os.mkfifo(special) if kind == "FIFO" else special.mkdir()
    before = tree(tmp_path)
    message = r"FIFO \(named pipe\), not a regular file: refused" if kind == "FIFO" else r"folder, not a regular file: refused"
    cli_process(*_optimize_auto(model, cache, "--calibration", special), match=r"--calibration .*in.npz is a " + message)
    assert tree(tmp_path) == before


def test_the_bounded_reader_reads_what_numpy_writes(tmp_path):
    """Plain, compressed, Fortran-ordered, big-endian, version-2 headers, several arrays: the same
    arrays as ``np.load`` gives."""
    from convpass.core.array_file import read_arrays

    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((2, 3, 4)).astype(np.float32), "f": np.asfortranarray(rng.standard_normal((3, 5))),
              "be": np.arange(6, dtype=">i4").reshape(2, 3), "b": rng.integers(0, 2, (7,)).astype(bool), "s": np.float16(1.5),
              "e": np.zeros((0, 4), np.int64)}
    np.savez(tmp_path / "a.npz", **arrays)
    np.savez_compressed(tmp_path / "c.npz", **arrays)
    for path in (tmp_path / "a.npz", tmp_path / "c.npz"):
        got = read_arrays(path)
        assert list(got) == list(arrays)
        for k, want in arrays.items():
            assert got[k].dtype == want.dtype and got[k].shape == want.shape and np.array_equal(got[k], want), k
        assert got["f"].flags.f_contiguous and got["x"].flags.writeable
    with open(tmp_path / "v2.npy", "wb") as f:
        np.lib.format.write_array(f, arrays["x"], version=(2, 0))
    assert np.array_equal(read_arrays(tmp_path / "v2.npy")[""], arrays["x"])


def test_run_input_archives_are_read_within_bounds_too(tmp_path, capsys, monkeypatch):
    """``run --input`` reads .npy / .npz files by the same bounded reader: an archive that would
    inflate past the limit is refused from its directory, a header promising more than the file holds
    before anything is allocated."""
    from conftest import conv_model

    from convpass.cli import feeds

    onnx.save(conv_model("Conv", (1, 3, 64, 64), (4, 3, 3, 3)), tmp_path / "m.onnx")
    np.savez_compressed(tmp_path / "bomb.npz", x=np.zeros((1, 3, 64, 64 * 64), np.float32))
    _hostile_npz(tmp_path / "huge.npz", "huge declared shape")
    monkeypatch.setattr(feeds, "INPUT_FILE_LIMIT", 1 << 20)
    before = tree(tmp_path)
    cli(capsys, "run", tmp_path / "m.onnx", "--device", "cpu", "-i", tmp_path / "bomb.npz",
        match=r"--input .*bomb.npz inflates to 3145856 bytes, more than the 1048576 convpass reads: refused")
    cli(capsys, "run", tmp_path / "m.onnx", "--device", "cpu", "-i", f"x={tmp_path / 'huge.npz'}",
        match=r"--input .*huge.npz, array 'input' declares shape \(1000, 3, 64, 5120000\) of float32 .* but holds 64 bytes: refused")
    assert tree(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# --json-file on every verb, inspect --html: checked before any work, written atomically, never over an input


RECORDED_BENCH = Path(__file__).parent / "data" / "bench-h200-2026-11-22-panel.trimmed.json"


def _verb_args(tmp_path: Path, verb: str) -> list:
    """A command line of ``verb`` that reads ``m.onnx`` (or, for bench, ``doc.json``) and the tuning cache ``cache.db``."""
    m = tmp_path / "m.onnx"
    return {"optimize": ["optimize", m, "-o", tmp_path / "t.onnx", "--device-name", "H200"],
            "tune": ["tune", m, "-o", tmp_path / "tuned"],
            "compile": ["compile", m],
            "inspect": ["inspect", m],
            "run": ["run", m, "--device", "cpu"],
            "cache": ["cache", "stats"],
            "account": ["account", m],
            "bench": ["bench", "--from-json", tmp_path / "doc.json"]}[verb]


def _json_file_setup(tmp_path: Path, monkeypatch) -> None:
    save(small_model(), tmp_path / "m.onnx")
    _cache_with_rows(tmp_path / "cache.db")
    shutil.copyfile(RECORDED_BENCH, tmp_path / "doc.json")
    monkeypatch.setenv("CONVPASS_CACHE", str(tmp_path / "cache.db"))  # the default cache of every verb


OUTPUT_CASES = ["the model itself", "a link to the model", "the tuning cache", "a device node", "a FIFO", "a folder", "an empty path",
                "a missing folder"]


MODEL_CASES = ("the model itself", "a link to the model")


@pytest.mark.parametrize("verb,case", [(v, c) for v in ("optimize", "tune", "compile", "inspect", "run", "cache", "account", "bench")
                                       for c in OUTPUT_CASES if not (v == "cache" and c in MODEL_CASES)])  # cache reads no model
def test_json_file_refusals_on_every_verb_before_any_work(tmp_path, capsys, monkeypatch, verb, case):
    """Refused up front (tune, compile and account would first need a GPU and minutes of work)."""
    _json_file_setup(tmp_path, monkeypatch)
    target, message = _outputs(tmp_path)[case]
    if case in MODEL_CASES:
        if verb == "bench":
            target, message = tmp_path / "doc.json", r"is a --from-json document: refusing to overwrite it"
            if case == "a link to the model":
                (tmp_path / "link.json").symlink_to(target)
                target = tmp_path / "link.json"
        if verb == "tune":
            message = message.replace("the input model", "an input model")  # one of several
    before = tree(tmp_path)
    cli(capsys, *_verb_args(tmp_path, verb), "--json-file", target, match="--json-file.*" + message)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("case", OUTPUT_CASES)
def test_inspect_html_refusals(tmp_path, capsys, monkeypatch, case):
    _json_file_setup(tmp_path, monkeypatch)
    target, message = _outputs(tmp_path)[case]
    before = tree(tmp_path)
    cli(capsys, "inspect", tmp_path / "m.onnx", "--html", target, match="--html.*" + message)
    assert tree(tmp_path) == before


def test_json_file_is_not_the_command_s_other_outputs(tmp_path, capsys, monkeypatch):
    _json_file_setup(tmp_path, monkeypatch)
    (tmp_path / "t.onnx").write_text("an older tuned model")
    before = tree(tmp_path)
    cli(capsys, *_verb_args(tmp_path, "optimize"), "--json-file", tmp_path / "t.onnx", match=r"--json-file .*t.onnx is the output model: refusing")
    cli(capsys, "inspect", tmp_path / "m.onnx", "--html", tmp_path / "r.json", "--json-file", tmp_path / "r.json",
        match=r"--json-file .*r.json is the --html report: refusing")
    cli(capsys, "cache", "export", tmp_path / "e.json", "--json-file", tmp_path / "e.json", match=r"--json-file .*e.json is the cache export")
    cli(capsys, *_verb_args(tmp_path, "compile"), "--json-file", tmp_path / "m.onnx.kernels",
        match=r"--json-file .*m.onnx.kernels is the kernel side-car: refusing")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("verb", ["inspect", "cache", "bench", "inspect --html"])
def test_json_file_and_html_writes_leave_nothing_half_written(tmp_path, capsys, monkeypatch, verb):
    """A failure while writing (the disk full, at the write or the rename) leaves the older file as it
    was and no temporary file beside it."""
    _json_file_setup(tmp_path, monkeypatch)
    (tmp_path / "r.out").write_text("an older report")
    args = _verb_args(tmp_path, verb.split()[0]) + (["--html", tmp_path / "r.out"] if verb == "inspect --html" else ["--json-file", tmp_path / "r.out"])
    before = tree(tmp_path)
    full = OSError(errno.ENOSPC, "No space left on device")
    real_replace = os.replace
    with monkeypatch.context() as patched:
        patched.setattr(os, "replace", lambda a, b: _raise(full)() if str(b).endswith("r.out") else real_replace(a, b))
        cli(capsys, *args, match=r"cannot write .*r.out: No space left on device \(the disk is full")
    assert tree(tmp_path) == before
    real_fdopen = os.fdopen

    def failing_writer(fd, *a, **k):
        f = real_fdopen(fd, *a, **k)
        f.write = _raise(full)
        return f

    with monkeypatch.context() as patched:
        patched.setattr(os, "fdopen", failing_writer)
        cli(capsys, *args, match=r"cannot write .*r.out: No space left on device")
    assert tree(tmp_path) == before
    cli(capsys, *args, expected=0)
    assert (tmp_path / "r.out").read_text() != "an older report"


# ---------------------------------------------------------------------------------------------
# convpass account: names from the model reach the terminal escaped; the JSON is JSON


def test_account_escapes_names_from_the_model_and_writes_valid_json(tmp_path, capsys, monkeypatch):
    """(The account needs a GPU: its rows are given here as a tuned model on one would give them.)"""
    from convpass.bench import account

    rows = [{"node": HOSTILE, "profile": 0, "memory_format": "NHWC\x1b[2J", "tuned_ms": 0.1, "in_place_ms": float("nan"),
             "best_ms": 0.0, "in_place_over_best": float("inf"), "floor_ms": 0.001}]
    monkeypatch.setattr(account, "account", lambda *a, **k: rows)
    save(small_model(), tmp_path / "m.onnx")
    out, _ = cli(capsys, "account", tmp_path / "m.onnx", "--json-file", tmp_path / "a.json", expected=0)
    assert "\\x1b]0;pwned" in out and "\\x1b[2J" in out
    doc = json.loads((tmp_path / "a.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert doc["convs"][0]["node"] == HOSTILE and doc["convs"][0]["in_place_ms"] is None and doc["convs"][0]["in_place_over_best"] is None
    out, _ = cli(capsys, "account", tmp_path / "m.onnx", "--json", expected=0)
    assert json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))["convs"][0]["node"] == HOSTILE


# ---------------------------------------------------------------------------------------------
# bench --targets FILE (malformed JSON, unknown measures and rules, a missing list: tests/test_bench_peers.py)


_TARGET = {"name": "any_peer", "judges": "convpass against every peer", "measure": "vs_all", "rule": "every_case", "at_most": 2.0}


@pytest.mark.parametrize("case,message", [
    ("nested 100,000 deep", r"--targets .*t.json: cannot read a targets file \(JSON nested too deeply\)"),
    ("NaN bound", r"--targets .*t.json: cannot read a targets file \(NaN is not JSON\)"),
    ("Infinity bound", r"--targets .*t.json: cannot read a targets file \(-Infinity is not JSON\)"),
    ("1e999 bound", r"--targets .*t.json: target 'any_peer': at_most must be a finite number, not inf"),
    ("a bound of the wrong type", r"--targets .*t.json: \$.targets\[0\].at_least: '1.0' is not of type 'number'"),
    ("a 500 kB rule name", r"--targets .*t.json: \$.targets\[0\].rule: 'xxxx.* \.\.\. .*' is not one of"),
    ("over 1 MiB", r"--targets file .*t.json is 1.0 MiB, more than the 1.0 MiB convpass reads: refused"),
])
def test_hostile_targets_files_are_one_line_and_change_nothing(tmp_path, capsys, case, message):
    path = tmp_path / "t.json"
    if case == "nested 100,000 deep":
        path.write_text('{"targets": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif case in ("NaN bound", "Infinity bound", "1e999 bound"):
        value = {"NaN bound": "NaN", "Infinity bound": "-Infinity", "1e999 bound": "1e999"}[case]
        path.write_text(json.dumps({"targets": [_TARGET]}).replace("2.0", value))
    elif case == "a bound of the wrong type":
        path.write_text(json.dumps({"targets": [{**_TARGET, "at_most": None, "at_least": "1.0"}]}).replace('"at_most": null, ', ""))
    elif case == "a 500 kB rule name":
        path.write_text(json.dumps({"targets": [{**_TARGET, "rule": "x" * 500_000}]}))
    else:
        path.write_text(json.dumps({"targets": [_TARGET], "about": " " * (1 << 20)}))
    shutil.copyfile(RECORDED_BENCH, tmp_path / "doc.json")
    before = tree(tmp_path)
    _, err = cli(capsys, "bench", "--from-json", tmp_path / "doc.json", "--targets", path, match=message)
    assert len(err) < 1000
    assert tree(tmp_path) == before


def test_a_targets_fifo_is_refused_before_it_is_read(tmp_path):
    os.mkfifo(tmp_path / "t.json")
    shutil.copyfile(RECORDED_BENCH, tmp_path / "doc.json")
    before = tree(tmp_path)
    cli_process("bench", "--from-json", tmp_path / "doc.json", "--targets", tmp_path / "t.json",
                match=r"--targets file .*t.json is a FIFO \(named pipe\), not a regular file: refused")
    assert tree(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# bench --from-json documents (other JSON and a wrong schema: tests/test_bench.py)


def _recorded(tmp_path: Path, edit=None) -> Path:
    doc = json.loads(RECORDED_BENCH.read_text())
    if edit is not None:
        edit(doc)
    (tmp_path / "doc.json").write_text(json.dumps(doc))
    return tmp_path / "doc.json"


def test_strings_of_a_recorded_document_reach_the_terminal_escaped(tmp_path, capsys):
    def edit(doc):
        doc["environment"]["device"] = "NVIDIA " + HOSTILE
        doc["cases"][0]["model"] = HOSTILE
        doc["cases"][0]["contenders"][1]["name"] = HOSTILE
        doc["notes"].append(HOSTILE)

    _recorded(tmp_path, edit)
    before = tree(tmp_path)
    out, _ = cli(capsys, "bench", "--from-json", tmp_path / "doc.json", expected=0)  # (cli asserts that no raw control character is printed)
    assert "\\x1b]0;pwned\\x07" in out and "[bold red]x[/]" in out
    assert tree(tmp_path) == before


def test_a_recorded_contender_missing_optional_times_renders(tmp_path, capsys):
    """The schema leaves a contender's times optional: one recorded with its session time alone is shown with ``-``."""
    def edit(doc):
        for key in ("cold_start_s", "first_run_s"):
            del doc["cases"][0]["contenders"][1][key]

    _recorded(tmp_path, edit)
    out, _ = cli(capsys, "bench", "--from-json", tmp_path / "doc.json", expected=0)
    assert re.search(r"ort EXHAUSTIVE nchw +- \(0.075\+-\)", out), out[:2000]


def test_a_recorded_document_over_the_limit_or_special_is_refused_before_it_is_parsed(tmp_path):
    from convpass.bench.document import DOCUMENT_LIMIT

    (tmp_path / "big.json").write_text(" " * (DOCUMENT_LIMIT + 1))
    os.mkfifo(tmp_path / "fifo.json")
    before = tree(tmp_path)
    cli_process("bench", "--from-json", tmp_path / "big.json",
                match=r"--from-json document .*big.json is 64.0 MiB, more than the 64.0 MiB convpass reads: refused")
    cli_process("bench", "--from-json", tmp_path / "fifo.json", match=r"--from-json document .*fifo.json is a FIFO \(named pipe\), not a regular file: refused")
    assert tree(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# the tuning cache's fusion timings: a stored row that is not one is skipped with a warning


def _cache_with_fusion_rows(path: Path) -> None:
    """The timings of the two fusion units of ``fused_models.block()`` on the H200 of ``_cache_with_rows``,
    as a GPU run of optimize keeps them."""
    import types

    from fused_models import block

    from convpass.compiler import pipeline
    from convpass.core.device import DeviceFingerprint
    from convpass.core.model_io import load_model
    from convpass.core.options import TuneOptions
    from convpass.tuning.cache import TuningCache

    _cache_with_rows(path)
    cache = TuningCache(path)
    model = load_model(block())
    report = pipeline.OptimizeReport()
    uses = pipeline.prepare_model(model, TuneOptions(), ["x=2x8x5x6"], report)
    backend = types.SimpleNamespace(device=DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900), cache=cache,
                                    decide=lambda problems, options: {p: None for p in problems})
    pipeline.decide_and_annotate(model, TuneOptions(), uses, [backend], report, fusion_timer=lambda *_: 1.0)
    cache.close()
    assert report.fusion_measured == 2


@pytest.mark.parametrize("times", ["not JSON", "[" * 100_000 + "]" * 100_000, '{"fused_nchw": Infinity, "unfused_nchw": 1}',
                                   '{"fused_nchw": 1e999, "unfused_nchw": 1}', '{"fused_nchw": true, "unfused_nchw": 1}',
                                   '{"fused_nchw": "fast", "unfused_nchw": 1}', '{"fused_nchw": -1, "unfused_nchw": 1}', "[1, 2]",
                                   '{"fused_nchw": 1}', b"\xff\xfe", 42, None])
def test_stored_fusion_timings_that_are_not_timings_are_skipped_with_a_warning(tmp_path, capsys, times):
    import sqlite3

    from fused_models import block

    from convpass.core import annotation

    cache = tmp_path / "cache.db"
    _cache_with_fusion_rows(cache)
    with sqlite3.connect(cache) as c:
        c.execute("PRAGMA ignore_check_constraints = 1")
        rows = c.execute("SELECT signature FROM fusion_timings").fetchall()
        assert len(rows) == 2
        if times is None:  # (NOT NULL in the schema: a table another program made without it)
            c.execute("ALTER TABLE fusion_timings RENAME TO old")
            c.execute("CREATE TABLE fusion_timings (device TEXT, signature TEXT, times TEXT, measured_at REAL, PRIMARY KEY (device, signature))")
            c.execute("INSERT INTO fusion_timings SELECT * FROM old")
            c.execute("DROP TABLE old")
        c.execute("UPDATE fusion_timings SET times = ? WHERE signature = ?", (times, rows[0][0]))
    c.close()
    onnx.save(block(), tmp_path / "m.onnx")
    before = tree(tmp_path)
    with pytest.warns(Warning) as caught:
        cli(capsys, "optimize", tmp_path / "m.onnx", "-o", tmp_path / "t.onnx", "--device-name", "H200", "--cache", cache,
            "--shape", "x=2x8x5x6", expected=0)
    warned = [str(w.message) for w in caught if "fusion" in str(w.message)]
    assert len(warned) == 1 and re.search(r"tuning cache .*cache.db: skipped the stored timings of 1 fusion unit\(s\) that are not "
                                          r"valid timings \(the first: ", warned[0]), [str(w.message) for w in caught]
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if k != "t.onnx"} == before  # the cache unchanged: nothing is timed without a GPU
    record = annotation.read_fusions(onnx.load(tmp_path / "t.onnx"))
    sources = sorted(d.source for _, _, ds in record.units.values() for d in ds)
    assert sources == [annotation.MEASURED, annotation.NOT_MEASURED]  # the good row still serves


# ---------------------------------------------------------------------------------------------
# bench --plot: the same rules as --json-file


@pytest.mark.parametrize("case", ["the recorded document", "the tuning cache", "a FIFO", "a folder", "a device node", "an empty path"])
def test_plot_refusals_before_any_work(tmp_path, capsys, monkeypatch, case):
    _json_file_setup(tmp_path, monkeypatch)
    if case == "the recorded document":
        target, message = tmp_path / "doc.json", r"is a --from-json document: refusing to overwrite it"
    else:
        target, message = _outputs(tmp_path)[case]
    before = tree(tmp_path)
    cli(capsys, "bench", "--from-json", tmp_path / "doc.json", "--plot", target, match="--plot.*" + message)
    assert tree(tmp_path) == before


def test_a_plot_is_written_atomically(tmp_path, monkeypatch):
    """The chart is drawn in memory and written as every output is: a failure while drawing or
    writing leaves the older file and no temporary file."""
    from convpass.bench import plot

    doc = json.loads(RECORDED_BENCH.read_text())
    saved = []

    class Fig:
        def tight_layout(self):
            pass

        def savefig(self, fname, dpi=None, format=None):
            if format == "svg":
                raise ValueError("broken figure")
            saved.append(format)
            fname.write(b"\x89PNG chart")

    class Ax:
        def __getattr__(self, name):
            return lambda *a, **k: None

    class Plt:
        def subplots(self, figsize=None):
            return Fig(), Ax()

        def close(self, fig):
            pass

    (tmp_path / "c.png").write_bytes(b"an older chart")
    (tmp_path / "c.svg").write_bytes(b"an older chart")
    before = tree(tmp_path)
    with pytest.raises(plot.ConvpassError, match=r"--plot .*c.svg: cannot draw the chart \(broken figure\)"):
        plot.write_plot(doc, str(tmp_path / "c.svg"), importer=Plt)
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: _raise(OSError(errno.ENOSPC, "No space left on device"))() if str(b).endswith("c.png")
                        else real_replace(a, b))
    with pytest.raises(plot.ConvpassError, match=r"cannot write .*c.png: No space left on device"):
        plot.write_plot(doc, str(tmp_path / "c.png"), importer=Plt)
    assert tree(tmp_path) == before
    monkeypatch.setattr(os, "replace", real_replace)
    assert plot.write_plot(doc, str(tmp_path / "c.png"), importer=Plt) == str(tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes() == b"\x89PNG chart" and saved == ["png", "png"]


@pytest.mark.parametrize("flag", ["--calibration", "--holdout"])
def test_the_output_model_is_not_an_input_file_of_the_run(tmp_path, capsys, flag):
    """``-o`` over a --calibration / --holdout file would replace an input of the run with the tuned
    model: refused before any work, as over the input model or the tuning cache."""
    model, cache = tmp_path / "m.onnx", tmp_path / "cache.db"
    shutil.copyfile(PRECISION_MODEL, model)
    synthetic_cache(cache, onnx.load(PRECISION_MODEL)).close()  # closed: every row in the file (a run would get this far)
    np.savez(tmp_path / "in.npz", input=GOOD)
    before = tree(tmp_path)
    cli(capsys, *_optimize_auto(model, cache, flag, tmp_path / "in.npz"), "-o", tmp_path / "in.npz",
        match=rf"-o .*in.npz is a {flag} file: refusing to overwrite it")
    assert tree(tmp_path) == before


def test_array_names_of_a_calibration_file_are_quoted_in_one_line(tmp_path, capsys):
    """The names an archive holds come from the file: a newline in one must not start a line of its own."""
    model, cache = tmp_path / "m.onnx", tmp_path / "cache.db"
    shutil.copyfile(PRECISION_MODEL, model)
    synthetic_cache(cache, onnx.load(PRECISION_MODEL)).close()
    with zipfile.ZipFile(tmp_path / "in.npz", "w") as z:
        z.writestr("x\nconvpass: done.npy", _npy_bytes({"descr": "<f4", "fortran_order": False, "shape": (1,)}, b"\0" * 4))
    before = tree(tmp_path)
    cli(capsys, *_optimize_auto(model, cache, "--calibration", tmp_path / "in.npz"),
        match=r"holds no array for the model input\(s\) input \(it holds 'x\\nconvpass: done'\)")
    assert tree(tmp_path) == before


def test_run_input_array_names_are_quoted_in_one_line(tmp_path, capsys):
    from conftest import conv_model

    onnx.save(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), tmp_path / "m.onnx")
    one = _npy_bytes({"descr": "<f4", "fortran_order": False, "shape": (1,)}, b"\0" * 4)
    with zipfile.ZipFile(tmp_path / "in.npz", "w") as z:
        z.writestr("a\nconvpass: done.npy", one)
        z.writestr("b.npy", one)
    before = tree(tmp_path)
    cli(capsys, "run", tmp_path / "m.onnx", "--device", "cpu", "-i", f"x={tmp_path / 'in.npz'}",
        match=r"holds no array named 'x' \(it holds 'a\\nconvpass: done', 'b'\)")
    assert tree(tmp_path) == before

"""The command line as a user of polygraphy or trtexec meets it: -v / -q on every verb, --json on
stdout with a schema per verb, --json-file, help texts that list what each option accepts,
tables that fit the terminal, honest summaries, and ``convpass run``'s generated inputs, timing
and comparison with ONNX Runtime."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from conftest import REPO, conv_model, run_ort
from onnx import TensorProto, helper

from convpass.cli.main import build_parser, main
from convpass.cli.schemas import SCHEMAS

SAMPLE = REPO / "models" / "residual_cnn.onnx"
VERB_ARGS = {
    "optimize": ["m.onnx", "-o", "t.onnx"], "tune": ["m.onnx", "-o", "out"], "compile": ["m.onnx"],
    "inspect": ["m.onnx"], "run": ["m.onnx"], "cache": ["stats"], "account": ["m.onnx"], "bench": ["m.onnx"],
}
SCHEMA_VERBS = ["optimize", "tune", "compile", "inspect", "run", "cache"]  # their documents: convpass/cli/schemas.py


def _json(capsys, schema: str) -> dict:
    """The stdout of a --json run: one document and nothing else, valid under its schema."""
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, SCHEMAS[schema])
    assert doc["schema"] == schema
    return doc


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "m.onnx"
    onnx.save(conv_model("Conv", ("n", 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1]), path)
    return path


@pytest.fixture(autouse=True)
def _convpass_logger_restored():
    import logging

    logger = logging.getLogger("convpass")
    level = logger.level
    yield
    logger.setLevel(level)


# ------------------------------------------------------------------------------- every verb


@pytest.mark.parametrize("verb", list(VERB_ARGS))
def test_verbose_and_quiet_are_taken_before_and_after_every_verb(verb):
    rest = VERB_ARGS[verb]
    for argv, verbose, quiet in (([verb, *rest], False, False), (["-v", verb, *rest], True, False),
                                 ([verb, *rest, "-v"], True, False), (["-q", verb, *rest], False, True),
                                 ([verb, "--quiet", *rest], False, True), (["--verbose", verb, *rest, "-q"], True, True)):
        args = build_parser().parse_args(argv)
        assert (args.command, args.verbose, args.quiet) == (verb, verbose, quiet), argv


@pytest.mark.parametrize("verb", list(VERB_ARGS))
def test_json_and_json_file_on_every_verb(verb, tmp_path):
    args = build_parser().parse_args([verb, *VERB_ARGS[verb], "--json", "--json-file", str(tmp_path / "r.json")])
    assert args.json is True and args.json_file == str(tmp_path / "r.json")
    assert verb not in SCHEMA_VERBS or f"convpass.{verb}/1" in SCHEMAS


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((name, a, sub) for a in sub._actions)
        else:
            yield "convpass", action, parser


def test_every_choice_a_parser_accepts_is_in_its_help():
    """The help says exactly what each option takes: every choices= list appears in it."""
    checked = 0
    for verb, action, parser in _actions(build_parser()):
        if not action.choices or isinstance(action, argparse._SubParsersAction):
            continue
        text = parser.format_help()
        for choice in action.choices:
            assert str(choice) in text, f"convpass {verb} {'/'.join(action.option_strings) or action.dest}: {choice!r} not in its help"
        checked += 1
    assert checked >= 12


def test_the_decision_options_refuse_what_their_help_does_not_list(capsys):
    for flag, value in (("--tf32", "maybe"), ("--layout", "nwhc"), ("--fprop-algo", "algo_0"), ("--engines", "fast")):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["optimize", "m.onnx", "-o", "t.onnx", flag, value])
        assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,message", [
    ("--workspace-limit", "lots", "--workspace-limit 'lots': expected a size"),
    ("--directions", "fwd,bwd", "--directions 'fwd,bwd'"),
    ("--shape", "x=1by3", "--shape 'x=1by3': expected NAME=DIMS"),
])
def test_cli_errors_name_the_flag(model, tmp_path, capsys, flag, value, message):
    assert main(["optimize", str(model), "-o", str(tmp_path / "t.onnx"), flag, value]) == 1
    err = capsys.readouterr().err
    assert err.startswith("convpass: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "t.onnx").exists()


# ------------------------------------------------------------------------------- optimize


def test_optimize_says_how_many_were_decided_and_how(model, tmp_path, capsys):
    assert main(["optimize", str(model), "-o", str(tmp_path / "t.onnx"), "--shape", "x=1x3x8x8", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    jsonschema.validate(doc, SCHEMAS["convpass.optimize/1"])
    assert doc["convolutions"] == 1 and doc["problems"] == 1
    assert doc["decisions"] == {"measured": 0, "cached": 0, "auto": 1} and doc["output"] == str(tmp_path / "t.onnx")
    assert "decided 0 of 1 problem (0 from the tuning cache); 1 left to run time" in captured.err
    assert "tuned)" not in captured.err  # no claim of tuning where nothing was decided


def test_optimize_from_the_cache_counts_cached_decisions(model, tmp_path, capsys):
    from test_decide import H200, ROWS

    from convpass.tuning.cache import TuningCache

    with TuningCache(tmp_path / "c.db") as cache:
        cache.put(H200, ROWS)
    argv = ["optimize", str(model), "-o", str(tmp_path / "t.onnx"), "--shape", "x=1x3x8x8", "--device-name", "H200",
            "--cache", str(tmp_path / "c.db"), "--no-kernels", "--json-file", str(tmp_path / "r.json")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "decided 1 of 1 problem (1 from the tuning cache)" in err and "left to run time" not in err
    doc = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(doc, SCHEMAS["convpass.optimize/1"])
    assert doc["decisions"] == {"measured": 0, "cached": 1, "auto": 0}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_install_hints_reach_the_terminal_literally(model, tmp_path, capsys, monkeypatch):
    """rich markup must not eat ``[gpu]`` from ``pip install 'convpass[gpu]'``, nor a profile's brackets."""
    import convpass.runtime.cuda

    monkeypatch.setattr(convpass.runtime.cuda, "unavailable_reason", lambda: "CuPy is not installed: pip install 'convpass[gpu]'")
    assert main(["optimize", str(model), "-o", str(tmp_path / "t.onnx"), "--shape", "x=1x3x8x8"]) == 0
    err = capsys.readouterr().err
    assert "pip install 'convpass[gpu]'" in err and "[x=1x3x8x8]" in err


def test_verbose_is_convpass_s_debug_only(model, tmp_path):
    done = subprocess.run([sys.executable, "-m", "convpass.cli.main", "optimize", str(model), "-o", str(tmp_path / "t.onnx"),
                           "--shape", "x=1x3x8x8", "-v"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "convpass " in done.stderr and "on Python" in done.stderr  # convpass's own debug line
    assert "ValueInfoProto not found" not in done.stderr  # onnx-ir's debug lines stay out
    quiet = subprocess.run([sys.executable, "-m", "convpass.cli.main", "-q", "optimize", str(model), "-o",
                            str(tmp_path / "t.onnx"), "--shape", "x=1x3x8x8"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == ""


# ------------------------------------------------------------------------------- inspect, cache, compile


def test_inspect_json_is_the_only_thing_on_stdout(tmp_path):
    tuned = tmp_path / "t.onnx"
    assert main(["-q", "optimize", str(SAMPLE), "-o", str(tuned)]) == 0
    done = subprocess.run([sys.executable, "-m", "convpass.cli.main", "inspect", str(tuned), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    jsonschema.validate(doc, SCHEMAS["convpass.inspect/1"])
    assert len(doc["records"]) == 6 and all(r["source"] == "auto" for r in doc["records"])


def test_inspect_table_fits_the_terminal_and_prints_names_as_text(tmp_path, capsys, monkeypatch):
    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3))
    model.graph.node[0].name = "[bold]conv[/bold] [link=x]"
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["-q", "optimize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx")]) == 0
    for columns in (60, 80, 120):
        monkeypatch.setenv("COLUMNS", str(columns))
        assert main(["inspect", str(tmp_path / "t.onnx")]) == 0
        out = capsys.readouterr().out
        assert max(len(line) for line in out.splitlines()) <= columns, out
        folded = "".join(out.split())
        assert "[bold]conv[/bold]" in folded and "[link=x]" in folded  # markup shown, not applied
        assert "fwd|n=1|c=3|k=4|in=8x8" in folded  # the problem key, folded, not cut


def test_cache_json_and_a_mistyped_cache_path(tmp_path, capsys):
    from test_decide import H200, ROWS

    from convpass.tuning.cache import TuningCache

    with TuningCache(tmp_path / "c.db") as cache:
        cache.put(H200, ROWS)
    assert main(["cache", "stats", "--cache", str(tmp_path / "c.db"), "--json"]) == 0
    doc = _json(capsys, "convpass.cache/1")
    assert doc["action"] == "stats" and doc["measurements"] == len(ROWS)
    assert main(["cache", "export", str(tmp_path / "e.json"), "--cache", str(tmp_path / "c.db"), "--json"]) == 0
    assert _json(capsys, "convpass.cache/1")["entries"] == len(ROWS)
    for action in (["stats"], ["export", str(tmp_path / "x.json")]):
        assert main(["cache", *action, "--cache", str(tmp_path / "typo.db")]) == 1
        assert "no tuning cache at" in capsys.readouterr().err
    assert not (tmp_path / "typo.db").exists() and not (tmp_path / "x.json").exists()


def test_json_file_refuses_what_is_not_a_regular_file(model, tmp_path, capsys):
    (tmp_path / "folder").mkdir()
    assert main(["inspect", str(model), "--json-file", str(tmp_path / "folder")]) == 1
    assert "not a regular file" in capsys.readouterr().err
    assert main(["inspect", str(model), "--json-file", str(tmp_path / "no" / "r.json")]) == 1
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------------------- run


def _two_input_model(tmp_path) -> Path:
    """x (float, symbolic batch) and k (int64) in; y = Relu(x) * 2, z = k + 1 out."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "two"], ["y"]),
             helper.make_node("Add", ["k", "one"], ["z"])]
    graph = helper.make_graph(
        nodes, "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4]), helper.make_tensor_value_info("k", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 4]), helper.make_tensor_value_info("z", TensorProto.INT64, [2])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]), helper.make_tensor("one", TensorProto.INT64, [], [1])],
    )
    path = tmp_path / "two.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def test_run_generates_inputs_times_and_summarizes(tmp_path, capsys):
    path = _two_input_model(tmp_path)
    argv = ["run", str(path), "--batch", "5", "--seed", "7", "--runs", "4", "--warmup", "2", "--device", "cpu", "--json",
            "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 0
    doc = _json(capsys, "convpass.run/1")
    assert [(i["name"], i["shape"], i["dtype"], i["source"]) for i in doc["inputs"]] == [
        ("x", [5, 3, 4], "float32", "generated"), ("k", [2], "int64", "generated")]
    x = np.random.default_rng(7).standard_normal((5, 3, 4)).astype(np.float32)  # the documented generator
    y = np.load(tmp_path / "out" / "y.npy")
    np.testing.assert_array_equal(y, np.maximum(x, 0) * 2)
    out = {o["name"]: o for o in doc["outputs"]}
    assert out["y"]["shape"] == [5, 3, 4] and out["y"]["file"] == str(tmp_path / "out" / "y.npy")
    assert out["y"]["min"] == pytest.approx(float(y.min())) and out["y"]["max"] == pytest.approx(float(y.max()))
    assert out["y"]["mean"] == pytest.approx(float(y.astype(np.float64).mean()))
    assert 0 <= min(np.load(tmp_path / "out" / "z.npy")) - 1 and max(np.load(tmp_path / "out" / "z.npy")) - 1 <= 3
    latency = doc["latency_ms"]
    assert latency["runs"] == 4 and latency["warmup"] == 2 and 0 < latency["min"] <= latency["median"] <= latency["p90"] <= latency["max"]
    assert doc["compare"] is None
    # the same run for a person: summaries and latency on stdout
    assert main(argv[:-3]) == 0
    text = capsys.readouterr().out
    assert "generated (seed 7)" in text and "min " in text and "mean " in text and "median" in text and "p90" in text


def test_run_reads_npy_and_npz_inputs(tmp_path, capsys):
    path = _two_input_model(tmp_path)
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 12
    k = np.array([5, 6], np.int64)
    np.savez(tmp_path / "both.npz", x=x, k=k, unused=np.zeros(1))
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "one.npz", anything=k)
    for inputs in ([str(tmp_path / "both.npz")], [f"x={tmp_path / 'x.npy'}", f"k={tmp_path / 'both.npz'}"],
                   [f"x={tmp_path / 'both.npz'}", f"k={tmp_path / 'one.npz'}"]):
        assert main(["run", str(path), "--json", *(a for i in inputs for a in ("--input", i))]) == 0
        doc = _json(capsys, "convpass.run/1")
        assert all(i["source"] != "generated" for i in doc["inputs"])
        out = {o["name"]: o for o in doc["outputs"]}
        assert out["y"]["max"] == 22.0 and out["z"]["min"] == 6 and out["z"]["max"] == 7


@pytest.mark.parametrize("argv,message", [
    (["--shape", "x=2x3x5"], "dim 2 of input 'x' is fixed at 4"),
    (["--shape", "q=1x2"], "unknown input(s) 'q'"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--runs", "0"], "--runs must be >= 1"),
    (["--input", "x.npy"], "has no NAME="),
    (["--shape", "x=100000000x3x4"], "convpass generates inputs of at most"),
])
def test_run_errors_are_one_line(tmp_path, capsys, argv, message):
    path = _two_input_model(tmp_path)
    np.save(tmp_path / "x.npy", np.zeros((1, 3, 4), np.float32))
    assert main(["run", str(path), *[a.replace("x.npy", str(tmp_path / "x.npy")) for a in argv]]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_run_symbolic_dims_beyond_the_batch_need_a_shape(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(conv_model("Conv", ("n", 3, "h", "w"), (4, 3, 3, 3)), path)
    assert main(["run", str(path)]) == 1
    assert "dim 2 of input 'x' is symbolic ('h'): give it with --shape x=DIMS" in capsys.readouterr().err
    assert main(["run", str(path), "--shape", "x=2x3x9x9", "--json"]) == 0
    assert _json(capsys, "convpass.run/1")["outputs"][0]["shape"] == [2, 4, 7, 7]


def test_run_compare_with_onnx_runtime(model, tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(model), "--input", f"x={tmp_path / 'x.npy'}", "--compare", "ort", "--json"]) == 0
    doc = _json(capsys, "convpass.run/1")
    [error] = doc["compare"]["outputs"]
    assert doc["compare"]["ok"] and error["ok"] and error["name"] == "out"
    reference = run_ort(onnx.load(model), {"x": x})[0]
    ours = np.maximum(reference, 0)  # the CPU executor agrees with ONNX Runtime to float32 rounding
    assert 0 <= error["max_abs_error"] <= 1e-5 * max(1.0, float(np.abs(ours).max()))


def test_run_compare_fails_on_a_wrong_output(model, tmp_path, capsys, monkeypatch):
    """An executor that gets one element wrong by 0.1 is caught: exit 1, the output named, the
    errors printed (max abs 0.1; max rel at least 0.1 / |reference| there)."""
    from convpass.runtime.executor import Executor

    run = Executor.run

    def off_by_a_little(self, names, feeds):
        outputs = run(self, names, feeds)
        outputs[0] = outputs[0].copy()
        outputs[0].flat[int(np.argmax(outputs[0]))] += 0.1  # where the reference is largest
        return outputs

    monkeypatch.setattr(Executor, "run", off_by_a_little)
    x = np.abs(np.random.default_rng(0).standard_normal((1, 3, 8, 8))).astype(np.float32) + 1
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(model), "-i", str(tmp_path / "x.npy"), "--compare", "ort", "--json-file", str(tmp_path / "r.json")]) == 1
    captured = capsys.readouterr()
    assert "DIFFERS" in captured.out and captured.err.startswith("convpass: error: --compare ort: 1 of 1 outputs differ")
    doc = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(doc, SCHEMAS["convpass.run/1"])
    [error] = doc["compare"]["outputs"]
    reference = run_ort(onnx.load(model), {"x": x})[0]
    assert not error["ok"] and error["max_abs_error"] == pytest.approx(0.1, rel=1e-3)
    assert error["max_rel_error"] >= 0.1 / float(np.abs(reference).max()) * 0.99


def test_run_compare_without_onnxruntime_is_a_clear_error(model, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert main(["run", str(model), "--compare", "ort"]) == 1
    assert "--compare ort needs onnxruntime, which is not installed here" in capsys.readouterr().err


# ------------------------------------------------------------------------------- tune


def test_tune_json_is_valid(tmp_path, capsys, monkeypatch):
    from convpass.fleet import driver
    from convpass.fleet.report import FleetReport

    report = FleetReport(cluster="local", cache=str(tmp_path / "c.db"), models=[])
    monkeypatch.setattr(driver, "tune", lambda *a, **k: report)
    (tmp_path / "out").mkdir()
    assert main(["tune", str(SAMPLE), "-o", str(tmp_path / "out"), "--json", "-q"]) == 0
    doc = _json(capsys, "convpass.tune/1")
    assert doc["cluster"] == "local" and doc["models"] == []


def test_the_cli_runs_as_a_program_from_a_fresh_process(tmp_path):
    done = subprocess.run([sys.executable, "-m", "convpass.cli.main", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("convpass ")
    done = subprocess.run([sys.executable, "-m", "convpass.cli.main", "run", str(SAMPLE), "--json", "--runs", "2"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    jsonschema.validate(doc, SCHEMAS["convpass.run/1"])
    assert doc["outputs"][0]["name"] == "logits" and doc["latency_ms"]["runs"] == 2


def test_docs_cli_names_every_option_and_schema():
    text = (REPO / "docs" / "cli.md").read_text()
    for verb, action, _ in _actions(build_parser()):
        if verb not in SCHEMA_VERBS or isinstance(action, argparse._SubParsersAction):
            continue  # bench and account: their owners' pages
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                assert f"`{option}" in text or f"[{option}" in text or f" {option} " in text, f"docs/cli.md: {verb} {option}"
        for choice in action.choices or ():
            assert str(choice) in text, f"docs/cli.md: {verb} {action.dest} {choice}"
    for name in SCHEMAS:
        assert f"`{name}`" in text


def test_a_missing_optional_package_is_a_clear_error_naming_its_extra(monkeypatch):
    """What ``bench --plot`` and ``run --compare ort`` call before their work: never a silent no-op."""
    from convpass.core.errors import OptionError
    from convpass.core.extras import require

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(OptionError, match=r"^--plot needs matplotlib, which is not installed here .*pip install 'convpass\[plot\]'$"):
        require("matplotlib", "--plot")
    assert require("json", "--json").dumps([]) == "[]"


def test_pyproject_extras():
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = config["optional-dependencies"]
    assert any(r.startswith("nvidia-cudnn-frontend") for r in extras["gpu"]) and any(r.startswith("nvidia-cudnn-frontend") for r in extras["cuda12"])
    assert any(r.startswith("cupy-cuda12x") for r in extras["cuda12"]) and any(r.startswith("matplotlib") for r in extras["plot"])
    assert any(r.startswith("ray") for r in extras["fleet"]) and not any(r.startswith("ray") for r in extras["dev"])
    assert config["license"]["text"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    main_run = ci.index("python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' && .venv/bin/python -m pytest -q")
    assert any("pip install -q 'ray" in line and "pytest -q -m fleet" in line for line in ci[main_run + 1:])


def test_escape_sequences_from_a_model_never_reach_the_terminal(tmp_path, capsys):
    model = conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3))
    model.graph.node[0].name = "conv\x1b]0;owned\x07"
    model.graph.node[1].output[0] = model.graph.output[0].name = "out\x1b[2J"
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["optimize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx")]) == 0
    assert main(["inspect", str(tmp_path / "t.onnx")]) == 0
    assert main(["run", str(tmp_path / "t.onnx")]) == 0
    captured = capsys.readouterr()
    for stream in (captured.out, captured.err):
        assert "\x1b" not in stream and "\x07" not in stream
    folded = "".join(captured.out.split())
    assert "conv\\x1b]0;owned\\x07" in folded and "out\\x1b[2J" in folded

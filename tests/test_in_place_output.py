"""What ``optimize`` and ``compile`` say of the in-place check: one line with the counts and the
timing floor, the worst slow convs by excess time and a count of the rest (the JSON keeps every
one), and a hint to a command that exists."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import jsonschema
import onnx
import pytest
from conftest import conv_model

from convpass.cli.main import build_parser, main
from convpass.cli.schemas import SCHEMAS
from convpass.compiler.aot import SHOWN_SLOW, KernelReport


def _conv(node: str, tuned: float, in_place: float, floor: float | None = 0.003, profile: int = 0) -> dict:
    row = {"node": node, "profile": profile, "tuned_ms": tuned, "in_place_ms": in_place, "algo": "gemm",
           "memory_format": "NHWC", "ratio": round(in_place / tuned, 4)}
    if floor is not None:  # records written before the floor have no floor_ms / raw_ms
        row.update(raw_ms=in_place + floor, floor_ms=floor)
    return row


def _slow_model(n: int) -> dict:
    """A profile's record: ``n`` slow convs, conv ``s{i}`` i * 0.01 ms over its 0.01 ms, and two near their time."""
    convs = [_conv(f"s{i}", 0.01, 0.01 + 0.01 * i) for i in range(1, n + 1)] + [_conv("ok1", 0.1, 0.1), _conv("ok2", 0.02, 0.021)]
    return {"how": "h", "reliable": True, "slow_ratio": 1.15, "floor_ms": 0.003, "convs": convs}


def _report(*docs: dict, path: Path = Path("t.onnx.kernels")) -> KernelReport:
    return KernelReport(path, 1, {"90": 1}, ["1x3x8x8"], [], 0.1, 0, tuple(docs))


def test_slow_convs_come_worst_first_and_optimize_shows_the_five_worst():
    report = _report(_slow_model(8))
    every = report.slow_convs()
    assert [line.split("'")[1] for line in every] == [f"s{i}" for i in range(8, 0, -1)]  # most excess time first
    assert "; timed 0.0930 ms less the 0.0030 ms floor" in every[0]
    shown = report.slow_shown("out dir/t.onnx")
    assert len(shown) == SHOWN_SLOW + 1 and shown[:SHOWN_SLOW] == every[:SHOWN_SLOW]
    assert shown[-1] == "... and 3 more (convpass account 'out dir/t.onnx' shows every conv)"
    assert _report(_slow_model(SHOWN_SLOW)).slow_shown("t.onnx") == _report(_slow_model(SHOWN_SLOW)).slow_convs()  # no tail


def test_the_hint_names_a_command_that_shows_every_conv():
    from convpass.cli.account import account_command

    hint = _report(_slow_model(7)).slow_shown("out dir/t.onnx")[-1]
    command = hint[hint.index("(") + 1:hint.index(" shows every conv")]
    argv = shlex.split(command)
    assert argv[:2] == ["convpass", "account"]
    args = build_parser("account").parse_args(argv[1:])
    assert args.func is account_command and args.model == "out dir/t.onnx"


def test_the_worst_are_chosen_over_every_profile():
    a, b = _slow_model(3), _slow_model(0)
    b["convs"].append(_conv("big", 1.0, 3.0, profile=1))
    shown = _report(a, b).slow_shown("t.onnx")
    assert shown[0].startswith("conv 'big' (profile 1) runs 3.0000 ms in place against 1.0000 ms tuned (3.00x")


def test_the_count_line_says_the_floor_and_reads_records_without_one():
    line = _report(_slow_model(8), dict(_slow_model(0), floor_ms=0.0042)).in_place_line()
    assert line == ("in place: 12 tuned conv launch(es) timed inside the plan, 8 more than 15% over their tuned time "
                    "(each less the timing's own 0.0030-0.0042 ms per launch)")
    old = {"how": "h", "reliable": True, "convs": [_conv("s", 0.1, 0.2, floor=None), _conv("f", 0.1, 0.1, floor=None)]}
    report = _report(old)
    assert report.in_place_line() == "in place: 2 tuned conv launch(es) timed inside the plan, 1 more than 15% over their tuned time"
    assert report.slow_convs() == ["conv 's' (profile 0) runs 0.2000 ms in place against 0.1000 ms tuned (2.00x > 1.15x; gemm, NHWC)"]


@pytest.fixture
def gpu_stand_in(monkeypatch):
    """A GPU for the side-car step only: compiling the kernels returns a report of 8 slow convs."""
    import convpass.compiler.aot
    import convpass.runtime.cuda

    def compile_kernels(output, **_):
        return _report(_slow_model(8), path=Path(f"{output}.kernels"))

    monkeypatch.setattr(convpass.runtime.cuda, "unavailable_reason", lambda: None)
    monkeypatch.setattr(convpass.compiler.aot, "compile_kernels", compile_kernels)


def test_optimize_prints_the_worst_five_and_its_json_keeps_every_conv(gpu_stand_in, tmp_path, capsys, caplog):
    model, out = tmp_path / "m.onnx", tmp_path / "t.onnx"
    onnx.save(conv_model("Conv", ("n", 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1]), model)
    with caplog.at_level("WARNING", logger="convpass"):
        assert main(["optimize", str(model), "-o", str(out), "--shape", "x=1x3x8x8", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    jsonschema.validate(doc, SCHEMAS["convpass.optimize/1"])
    assert [c["node"] for c in doc["in_place"][0]["convs"]] == [f"s{i}" for i in range(1, 9)] + ["ok1", "ok2"]
    assert doc["in_place"][0]["floor_ms"] == 0.003 and doc["in_place"][0]["convs"][0]["raw_ms"] == pytest.approx(0.023)
    assert "in place: 10 tuned conv launch(es) timed inside the plan, 8 more than 15% over their tuned time" in captured.err
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    slow = [w for w in warned if w.startswith("conv '")]
    assert [w.split("'")[1] for w in slow] == ["s8", "s7", "s6", "s5", "s4"]
    assert f"... and 3 more (convpass account {out} shows every conv)" in warned


def test_optimize_json_without_the_check_says_null(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    onnx.save(conv_model("Conv", ("n", 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1]), model)
    assert main(["optimize", str(model), "-o", str(tmp_path / "t.onnx"), "--shape", "x=1x3x8x8", "--no-kernels", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, SCHEMAS["convpass.optimize/1"])
    assert doc["in_place"] is None


def test_compile_says_the_check_as_optimize_does(gpu_stand_in, tmp_path, capsys, caplog):
    model = tmp_path / "t.onnx"
    onnx.save(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3)), model)
    with caplog.at_level("WARNING", logger="convpass"):
        assert main(["compile", str(model), "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    jsonschema.validate(doc, SCHEMAS["convpass.compile/1"])
    assert len(doc["in_place"][0]["convs"]) == 10 and "8 more than 15% over their tuned time" in captured.err
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == SHOWN_SLOW + 1 and warned[-1] == f"... and 3 more (convpass account {model} shows every conv)"


def test_the_bench_report_shows_the_five_worst_of_its_record():
    from convpass.bench import convpass_contender, render

    record = convpass_contender.in_place_record(_report(_slow_model(8)))
    assert len(record["slow"]) == 8  # the record keeps every one
    line = render.tuning_line({"optimize_s": 2.0, "measured": 3, "cached": 0, "kernels": "k", "kernels_s": 0.1, "in_place": record})
    shown = line.split("\n")[1:]
    assert [s.split("'")[1] for s in shown[:SHOWN_SLOW]] == ["s8", "s7", "s6", "s5", "s4"]
    assert shown[SHOWN_SLOW:] == ["    ... and 3 more (the JSON record lists every one)"]

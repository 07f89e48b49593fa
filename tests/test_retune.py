"""Optimizing a model convpass tuned already: refused in one line naming --retune, or re-tuned with
--retune (its recorded profiles unless --shape is given) with what changed said; never a silent no-op."""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from conftest import conv_model, random_input, run_ort
from test_hostile_input import check_output, tree

import convpass
from convpass.cli.main import main
from convpass.core import annotation
from convpass.core.device import DeviceFingerprint
from convpass.core.errors import ConvpassError
from convpass.core.problem import ConvShape
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_rows import Measurement

H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)


def _tuned(tmp_path, shapes=("x=1x3x8x8", "x=4x3x8x8")):
    src = tmp_path / "m.onnx"
    onnx.save(conv_model("Conv", ("N", 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1]), src)
    out = tmp_path / "t.onnx"
    assert main(["optimize", str(src), "-o", str(out), *[a for s in shapes for a in ("--shape", s)]]) == 0
    return src, out


def test_a_tuned_model_is_refused_in_one_line_naming_retune(tmp_path, capsys):
    _, tuned = _tuned(tmp_path)
    capsys.readouterr()
    before = tree(tmp_path)
    code = main(["optimize", str(tuned), "-o", str(tmp_path / "again.onnx")])
    out, err = capsys.readouterr()
    check_output(code, out, err, 1)
    assert "is already tuned by convpass (1 tuned convolution(s)); pass --retune to tune it again" in err
    assert tree(tmp_path) == before
    with pytest.raises(ConvpassError, match="pass retune=True"):  # the Python API names its own argument
        convpass.optimize(tuned, quiet=True)


def test_tune_refuses_a_tuned_model(tmp_path):
    from convpass.core.options import TuneOptions
    from convpass.fleet.model_procs import ModelSpec, prepare

    _, tuned = _tuned(tmp_path)
    with pytest.raises(ConvpassError, match=r"already tuned by convpass .*tune the model it was tuned from"):
        prepare(ModelSpec(tuned, ()), TuneOptions())


def test_retune_keeps_the_recorded_profiles_and_says_nothing_changed(tmp_path, capsys):
    src, tuned = _tuned(tmp_path)
    capsys.readouterr()
    again = tmp_path / "again.onnx"
    assert main(["optimize", str(tuned), "-o", str(again), "--retune"]) == 0
    err = capsys.readouterr().err
    assert "re-tuned: 0 of 2 recorded decisions changed" in err
    first, second = onnx.load(tuned), onnx.load(again)
    assert [p.name for p in annotation.read_model_info(second).profiles] == ["x=1x3x8x8", "x=4x3x8x8"]
    assert [r["problem_key"] for r in convpass.inspect(second)] == [r["problem_key"] for r in convpass.inspect(first)]
    assert len(second.functions) == 1 and len(annotation.read_annotations(second)[1]) == 1  # once tuned, not twice
    x = {"x": random_input((4, 3, 8, 8))}
    np.testing.assert_allclose(run_ort(second, x)[0], run_ort(onnx.load(src), x)[0], rtol=1e-5, atol=1e-5)


def test_retune_with_shapes_takes_the_new_profiles_and_says_so(tmp_path, capsys):
    _, tuned = _tuned(tmp_path)
    capsys.readouterr()
    assert main(["optimize", str(tuned), "-o", str(tmp_path / "again.onnx"), "--retune", "--shape", "x=16x3x8x8"]) == 0
    err = capsys.readouterr().err
    assert "profiles now ['x=16x3x8x8'] (were ['x=1x3x8x8', 'x=4x3x8x8'])" in err
    info = annotation.read_model_info(onnx.load(tmp_path / "again.onnx"))
    assert [p.name for p in info.profiles] == ["x=16x3x8x8"]


def _cache(path, fastest: str) -> None:
    key = ConvShape("fwd", 1, 3, 4, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1)).key("nchw", "default")
    rows = [Measurement(key, algo, "ok", 0.01 if algo == fastest else 0.05, 0, True, time.time(), "measure")
            for algo in ("gemm", "implicit_gemm")]
    with TuningCache(path) as cache:
        cache.put(H200, rows)


def test_retune_says_which_decisions_changed(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(conv_model("Conv", (1, 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1], bias=False), src)
    _cache(tmp_path / "c.db", "gemm")
    common = ["--cache", str(tmp_path / "c.db"), "--device-name", "H200", "--layout", "nchw", "--tf32", "on"]
    assert main(["optimize", str(src), "-o", str(tmp_path / "t.onnx"), *common]) == 0
    assert convpass.inspect(tmp_path / "t.onnx")[0]["algo"] == "gemm"
    _cache(tmp_path / "c.db", "implicit_gemm")  # measured again: another algorithm is faster now
    capsys.readouterr()
    assert main(["optimize", str(tmp_path / "t.onnx"), "-o", str(tmp_path / "t2.onnx"), "--retune", *common]) == 0
    err = capsys.readouterr().err
    assert "re-tuned: 1 of 1 recorded decisions changed (conv [model shapes]: gemm NCHW default -> implicit_gemm NCHW default)" in err
    assert convpass.inspect(tmp_path / "t2.onnx")[0]["algo"] == "implicit_gemm"

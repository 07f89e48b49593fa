"""The command line on a GPU: optimize measures and says so, compile and run print their JSON
documents, run --compare ort holds on the CUDA executor, and inspect --html charts the candidates
the tuner measured (read from the tuning cache it filled)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import MODELS  # noqa: E402
from test_inspect_html import _data, _parse  # noqa: E402

from convpass.cli.main import main  # noqa: E402
from convpass.cli.schemas import SCHEMAS  # noqa: E402


def _doc(capsys, schema: str) -> dict:
    """The --json document on stdout, checked against its schema (its required fields where the
    machine lacks jsonschema)."""
    doc = json.loads(capsys.readouterr().out)
    try:
        import jsonschema
    except ImportError:
        assert doc["schema"] == schema and set(SCHEMAS[schema]["required"]) <= set(doc)
    else:
        jsonschema.validate(doc, SCHEMAS[schema])
    return doc


def test_optimize_compile_run_and_html_on_the_gpu(tmp_path, capsys):
    model, tuned, cache = MODELS / "residual_cnn.onnx", tmp_path / "t.onnx", tmp_path / "c.db"
    assert main(["optimize", str(model), "-o", str(tuned), "--cache", str(cache), "--json"]) == 0
    doc = _doc(capsys, "convpass.optimize/1")
    problems = doc["problems"]
    assert doc["decisions"]["measured"] == problems > 0 and doc["decisions"]["auto"] == 0
    assert doc["tuning"]["timed"] == problems and doc["device"]
    # again: every decision from the cache, and said so
    assert main(["optimize", str(model), "-o", str(tuned), "--cache", str(cache), "--json"]) == 0
    assert _doc(capsys, "convpass.optimize/1")["decisions"] == {"measured": 0, "cached": problems, "auto": 0}

    assert main(["compile", str(tuned), "--json"]) == 0
    compiled = _doc(capsys, "convpass.compile/1")
    assert compiled["sidecar"].endswith("t.onnx.kernels") and not compiled["failed"]

    assert main(["run", str(tuned), "--device", "cuda", "--runs", "20", "--warmup", "3", "--compare", "ort", "--rtol", "1e-2",
                 "--atol", "1e-3", "--json"]) == 0
    run = _doc(capsys, "convpass.run/1")
    assert run["device"] == "cuda" and run["compare"]["ok"] and run["latency_ms"]["runs"] == 20
    assert run["latency_ms"]["median"] < 50  # ms: a steady-state run of a small model, host copies included

    assert main(["inspect", str(tuned), "--html", str(tmp_path / "r.html"), "--cache", str(cache)]) == 0
    data = _data(_parse((tmp_path / "r.html").read_text()))
    assert len(data["sections"]) == 6
    for section in data["sections"]:
        assert len(section["candidates"]) >= 2 and sum(c["chosen"] for c in section["candidates"]) == 1, section["node"]
        assert section["runner_up_margin"] is not None
        assert section["heuristic_ms"] is not None  # the tuner times cuDNN's heuristic first choice

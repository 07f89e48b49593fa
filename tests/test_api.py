"""The Python API: real signatures, docstrings with Args / Returns / Raises, ``__all__``, errors that
name the API's arguments (the CLI's name its flags), and no import-time side effects (those are
tested in a fresh process: tests/test_deferred_imports.py)."""

from __future__ import annotations

import inspect
import pydoc

import numpy as np
import onnx
import pytest
from conftest import conv_model, random_input, run_ort

import convpass
from convpass.core.errors import ConvpassError, OptionError, ShapeError

KEYWORDS = ["shapes", "mode", "tf32", "layout", "engines", "prune", "fprop_algo", "dgrad_algo", "wgrad_algo", "matmul_tf32",
            "workspace_limit", "deterministic", "directions", "cache", "device_name", "kernels", "quiet", "retune", "precision", "max_error",
            "error_metric", "calibration", "holdout"]


def test_all_names_the_public_api():
    assert sorted(convpass.__all__) == ["ConvpassError", "Executor", "__version__", "inspect", "optimize"]
    for name in convpass.__all__:
        assert getattr(convpass, name) is not None
    assert set(convpass.__all__) <= set(dir(convpass))
    with pytest.raises(AttributeError):
        convpass.pipeline  # noqa: B018  (only the API is public)


def test_optimize_has_a_real_signature():
    sig = inspect.signature(convpass.optimize)
    params = list(sig.parameters.values())
    assert [p.name for p in params[:2]] == ["model", "output"]
    assert [p.name for p in params[2:]] == KEYWORDS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:])
    assert not any(p.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL) for p in params)
    assert sig.parameters["mode"].default == "measure" and sig.parameters["tf32"].default == "auto"
    assert sig.return_annotation in ("onnx.ModelProto", onnx.ModelProto)
    rendered = pydoc.render_doc(convpass.optimize, renderer=pydoc.plaintext)
    assert "shapes: 'Sequence[ShapeProfile]' = ()" in rendered and "**" not in rendered.split("\n\n")[1]


@pytest.mark.parametrize("function", ["optimize", "inspect"])
def test_docstrings_say_args_returns_raises(function):
    doc = inspect.getdoc(getattr(convpass, function))
    for section in ("Args:", "Returns:", "Raises:"):
        assert section in doc, f"{function}: no {section}"
    for name in inspect.signature(getattr(convpass, function)).parameters:
        assert f"    {name}:" in doc, f"{function}: argument {name} is not described"


def test_inspect_takes_the_device_by_keyword_only():
    params = inspect.signature(convpass.inspect).parameters
    assert params["device"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.getdoc(convpass.Executor)


@pytest.mark.parametrize("kwargs,message", [
    ({"shapes": ["x=1x3x8x8", "x=one"]}, r"^shapes\[1\] 'x=one': expected NAME=DIMS"),
    ({"shapes": "x=1x3x8x8"}, r"^shapes: expected a list of profiles"),
    ({"shapes": [{"x": (1, 0, 8, 8)}]}, r"^shapes\[0\] .*positive integer dims"),
    ({"shapes": ["x=1x3x8x8,y=1x2"]}, r"^shapes\[0\] names unknown input"),
    ({"workspace_limit": -1}, r"^workspace_limit must be >= 0"),
    ({"matmul_tf32": "maybe"}, r"^matmul_tf32 'maybe'"),
    ({"device_name": 3}, r"^device_name 3"),
])
def test_api_errors_name_the_argument(kwargs, message):
    with pytest.raises(ConvpassError, match=message) as info:
        convpass.optimize(conv_model("Conv", ("n", 3, 8, 8), (4, 3, 3, 3)), quiet=True, **kwargs)
    assert "--" not in str(info.value)
    assert isinstance(info.value, (OptionError, ShapeError))


def test_optimize_takes_every_documented_form_of_its_options(tmp_path):
    model = conv_model("Conv", ("n", 3, 8, 8), (4, 3, 3, 3), pads=[1, 1, 1, 1])
    tuned = convpass.optimize(model, tmp_path / "t.onnx", shapes=[{"x": (1, 3, 8, 8)}, "x=2x3x8x8"], tf32="on",
                              layout="nchw", matmul_tf32="on", workspace_limit="64MiB", directions=["fwd"], quiet=True)
    assert isinstance(tuned, onnx.ModelProto) and (tmp_path / "t.onnx").is_file()
    records = convpass.inspect(tuned)
    assert [r["profile"] for r in records] == ["x=1x3x8x8", "x=2x3x8x8"]
    x = random_input((2, 3, 8, 8))
    (y,) = convpass.Executor(tuned).run(None, {"x": x})
    np.testing.assert_allclose(y, run_ort(model, {"x": x})[0], rtol=1e-4, atol=1e-5)


def test_docs_python_api_describes_every_argument():
    from conftest import REPO

    text = (REPO / "docs" / "python-api.md").read_text()
    for name in ["model", "output", *KEYWORDS]:
        assert f"`{name}`" in text or f"`{name}`," in text, name


def test_the_executor_documents_its_arguments():
    doc = inspect.getdoc(convpass.Executor)
    assert "Args:" in doc and "Raises:" in doc
    for name in inspect.signature(convpass.Executor).parameters:
        assert f"    {name}:" in doc, name

"""Convs inside If / Loop / Scan bodies measured on a real GPU like the main graph's, and the tuned
model still computing what the original does in ONNX Runtime."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from conftest import random_input  # noqa: E402
from test_subgraph_convs import _annotated, _same_outputs, if_model, loop_model, scan_model  # noqa: E402

import convpass  # noqa: E402


@pytest.mark.parametrize("build,shape,shapes", [(if_model, (2, 3, 8, 8), ["x=2x3x8x8"]), (loop_model, (2, 3, 8, 8), []),
                                                (scan_model, (5, 1, 3, 8, 8), [])], ids=["if", "loop", "scan"])
def test_body_convs_are_measured(build, shape, shapes, tmp_path):
    model = build()
    tuned = convpass.optimize(model, quiet=True, shapes=shapes, cache=tmp_path / "c.db", kernels=False)
    records = convpass.inspect(tuned)
    assert {r["node"] for r in records} == set(_annotated(tuned))
    assert all(r["source"] == "measure" and r["algo"] != "auto" for r in records), records
    _same_outputs(model, tuned, {"x": random_input(shape)})

"""Convs whose weights the graph computes from initializers, tuned on the GPU and run by the cuda executor.

The patterns of tests/test_fold_conv_weights.py (weight standardization two ways, weight
normalization, NF-Net's scaled standardization, Reshape / Transpose / Cast / DequantizeLinear
chains): every conv measured (a recorded algorithm, not ``auto``), the cuda executor runs the
recorded algorithm, and its outputs, eager and replayed, match ONNX Runtime CPU on the original
model within TF32's tolerance (normwise relative error <= 5e-3).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_cuda_backend")]

cp = pytest.importorskip("cupy")

import test_fold_conv_weights as patterns  # noqa: E402
from conftest import run_ort  # noqa: E402

import convpass  # noqa: E402
from convpass.runtime import Executor  # noqa: E402

TF32_TOL = 5e-3



@pytest.mark.parametrize("pattern", patterns.PATTERNS)
def test_folded_weights_are_measured_and_run_as_recorded(pattern, tmp_path):
    model = patterns.PATTERNS[pattern]()
    tuned = convpass.optimize(model, cache=tmp_path / "c.db", quiet=True, engines="legacy")
    records = convpass.inspect(tuned)
    assert records and all(r["source"] != "untuned" and r["algo"] != "auto" and r["time_ms"] is not None for r in records), records
    feeds = patterns._feeds(model)
    (want,) = run_ort(model, feeds)
    ex = Executor(tuned, device="cuda")
    for _ in range(3):  # built eagerly, then captured, then replayed
        (got,) = ex.run(None, feeds)
        err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
        assert err <= TF32_TOL, f"{pattern}: normwise relative error {err:.2e}"
    recorded = {r["node"]: r["algo"] for r in records}
    summary = ex.plan_summary()
    assert {s.node for s in summary} == set(recorded)
    assert all(s.tuned and s.algo == recorded[s.node] for s in summary), summary
